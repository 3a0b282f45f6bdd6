//! The step scheduler: continuous batching over [`forward_batch`], as a
//! library that `samesum serve`, `samesum bench` and the serving benchmark
//! all drive. It knows tokens only: no text, no clock-driven policy, no I/O.
//!
//! A caller [`Scheduler::submit`]s requests, which wait in arrival order;
//! each [`Scheduler::step`] first admits waiting requests (while fewer than
//! [`Config::max_batch`] run and the next one's whole context fits the KV
//! budget beside the running ones), then takes every running request's next
//! rows (one decode row each, plus at most [`Config::prefill_chunk`] prompt
//! rows shared among the requests still prefilling, shortest remaining prompt
//! first, so a short request's first token does not wait for a long prompt;
//! one passed over for [`AGING_STEPS`] steps goes first, so none waits
//! forever), runs them in one forward call, samples, and reports what
//! happened as [`Output`]s. A request leaves when it samples one of its stop
//! tokens or reaches its length; the caller ends one sooner with
//! [`Scheduler::finish`] (a stop string, a deadline) or
//! [`Scheduler::cancel`] (its client went away). By the row contract, each
//! request's logits (so its tokens and log-probabilities) are the same bytes
//! whatever else runs beside it.
//!
//! The KV budget ([`Config::kv_budget`]): a request reserves its whole
//! context (prompt, tokens to generate and one more, in whole
//! [`KV_BLOCK`](crate::state::KV_BLOCK)s, plus its recurrent states; see
//! [`context_bytes`]) when it is admitted and gives it back when it leaves,
//! so a running request never runs out of its share mid-run. One that does
//! not fit beside the running ones waits (and the ones behind it: admission
//! is first come, first served); one larger than the whole budget is refused
//! by [`Scheduler::submit`].
//!
//! With the prefix cache on ([`Config::prefix_cache_bytes`]), a request
//! starts from a copy of the longest saved state whose tokens begin its
//! prompt and prefills the rest (the same bytes as cold, see [`prefix`]); a
//! copy of each request's state is saved when its prompt is prefilled and
//! when it finishes (its prompt and the generated tokens fed so far), so a
//! follow-up turn that repeats the conversation reuses it. The cache has its
//! own budget, apart from the KV budget.

pub mod prefix;
#[cfg(test)]
mod tests;

use crate::backend::Backend;
use crate::constraint::{SharedConstraint, Step};
use crate::model::HParams;
use crate::sample::{Penalties, Sampler, SamplerConfig};
use crate::state::KV_BLOCK;
use crate::{KvType, Logits, Model, Segment, forward_batch};
use prefix::{PrefixCache, entry_bytes};
use std::collections::VecDeque;
use std::time::Instant;

/// A request's handle, unique within a [`Scheduler`].
pub type SeqId = u64;

/// Scheduler settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// Requests running at once.
    pub max_batch: usize,
    /// Prompt rows per step (shared by the prefilling requests).
    pub prefill_chunk: usize,
    /// KV cache type.
    pub kv: KvType,
    /// The prefix cache's budget in bytes (0: off).
    pub prefix_cache_bytes: u64,
    /// Bytes the running requests' contexts may reserve together
    /// ([`context_bytes`]); `None`: no limit.
    pub kv_budget: Option<u64>,
}

/// One request: tokens in, tokens out.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt tokens (non-empty, inside the vocabulary).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_new: usize,
    /// Sampling.
    pub sampler: SamplerConfig,
    /// Presence and frequency penalties.
    pub penalties: Penalties,
    /// `(token, bias)` added to the logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Tokens that end the request when sampled (not reported as tokens);
    /// empty: generate to the length.
    pub stop_tokens: Vec<u32>,
    /// Log-probabilities of each token with this many alternatives.
    pub logprobs: Option<usize>,
    /// Which tokens may come next (structured output); `None`: any.
    pub constraint: Option<SharedConstraint>,
}

/// A generated token's log-probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct Logprob {
    /// The token's log-probability.
    pub logprob: f32,
    /// The `n` most likely tokens and theirs, most likely first (ties: the
    /// lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token (or the caller's stop, [`Scheduler::finish`]).
    Stop,
    /// The length ([`Request::max_new`]).
    Length,
}

impl Finish {
    /// OpenAI's finish reason: `stop` or `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// Counts and times of a request that ended.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqInfo {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens restored from the prefix cache (not prefilled).
    pub cached_tokens: usize,
    /// Tokens generated (stop tokens not counted).
    pub generated: usize,
    /// When it was admitted (its state allocated).
    pub admitted: Instant,
    /// When its prompt was prefilled (`None`: it never was).
    pub prefilled: Option<Instant>,
}

/// What a step reports, per request, in the order it happened.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// The request was admitted: its state is allocated (`cached` prompt
    /// tokens restored from the prefix cache).
    Started {
        /// The request.
        id: SeqId,
        /// Prompt tokens restored.
        cached: usize,
    },
    /// A generated token.
    Token {
        /// The request.
        id: SeqId,
        /// The token.
        token: u32,
        /// Its log-probabilities, when asked for.
        logprob: Option<Logprob>,
    },
    /// The request ended and left.
    Finished {
        /// The request.
        id: SeqId,
        /// Why.
        finish: Finish,
        /// Its counts and times.
        info: SeqInfo,
    },
    /// The request failed (its state could not be allocated, or the forward
    /// call it was in failed) and left.
    Failed {
        /// The request.
        id: SeqId,
        /// What went wrong.
        error: String,
    },
}

/// A request [`Scheduler::submit`] refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// No prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Nothing to generate.
    #[error("the request must generate at least 1 token")]
    NoTokens,
    /// A prompt token outside the vocabulary.
    #[error("prompt token id {token} is outside the vocabulary of {vocab} tokens")]
    BadToken {
        /// The token.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The request's whole context is larger than the whole KV budget: it
    /// could never be admitted.
    #[error(
        "the request needs {need} bytes of KV cache and recurrent state (a context of {ctx} tokens: the prompt, the tokens to generate and one more, in blocks of {KV_BLOCK}), more than the whole KV budget of {budget} bytes"
    )]
    OverBudget {
        /// Bytes the request would reserve.
        need: u64,
        /// Its context in tokens.
        ctx: usize,
        /// The budget.
        budget: u64,
    },
}

/// Counters and gauges of a scheduler (cumulative where they count).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Requests running.
    pub running: usize,
    /// Requests submitted and not admitted yet.
    pub waiting: usize,
    /// Of those, the ones held back by the KV budget: all of them while the
    /// first one does not fit beside the running ones, else 0.
    pub waiting_for_memory: usize,
    /// Requests that had to wait for memory at least once.
    pub memory_waits: u64,
    /// The KV budget (`None`: no limit).
    pub kv_budget: Option<u64>,
    /// Bytes the running requests reserve.
    pub kv_reserved: u64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
    /// Of those, the ones the backend picked greedily (`Logits::Greedy`:
    /// no logits brought to the host).
    pub greedy_picks: u64,
    /// Forward time attributed to prompt rows.
    pub prefill_seconds: f64,
    /// Forward time attributed to decode rows.
    pub decode_seconds: f64,
    /// Time steps spent outside their forward call: admission, the step's
    /// plan, sampling, stop checks, prefix-cache saves (host work a device
    /// waits through).
    pub host_seconds: f64,
    /// Forward calls made.
    pub steps: u64,
    /// The most requests one forward call has carried.
    pub max_step_seqs: usize,
    /// Prompt tokens of running requests not prefilled yet.
    pub prefill_pending: u64,
    /// Requests that started from a prefix cache entry.
    pub prefix_hits: u64,
    /// Requests that found no entry (counted when the cache is on).
    pub prefix_misses: u64,
    /// Prompt tokens restored instead of prefilled.
    pub prefix_reused_tokens: u64,
    /// Entries held.
    pub prefix_entries: usize,
    /// Bytes the entries are counted at.
    pub prefix_bytes: u64,
    /// Entries evicted.
    pub prefix_evictions: u64,
    /// State copies that failed (memory): an entry not saved, or a request
    /// started cold instead of restored.
    pub prefix_copy_failures: u64,
    /// Times the whole cache was emptied to give its memory to a request
    /// whose state could not be allocated.
    pub prefix_cleared: u64,
}

/// Bytes a context of `ctx` tokens is counted at: its KV rows in whole
/// [`KV_BLOCK`]s (what the CPU allocates) and its recurrent states.
pub fn context_bytes(hp: &HParams, kv: KvType, ctx: usize) -> u64 {
    entry_bytes(hp, kv, ctx)
}

/// The context a request of `prompt` tokens generating `max_new` reserves:
/// both and one more (the state holds room for the last sampled token).
pub fn request_context(prompt: usize, max_new: usize) -> usize {
    prompt.saturating_add(max_new).saturating_add(1)
}

/// Steps a prefilling request may be passed over by shorter ones before it
/// goes first.
pub const AGING_STEPS: usize = 8;

/// The order in which prefilling requests, given as (prompt rows left,
/// steps passed over), get this step's prompt rows: those passed over for
/// [`AGING_STEPS`] or more first (the longest waiting first), then the
/// shortest remaining prompt first; ties in arrival order.
pub fn prefill_order(reqs: &[(usize, usize)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&k| {
        let (left, passed) = reqs[k];
        let aged = passed >= AGING_STEPS;
        (!aged, if aged { usize::MAX - passed } else { 0 }, left, k)
    });
    order
}

/// The log-softmax value of `t` in `logits` and the `n` most likely tokens.
pub fn logprob(logits: &[f32], t: u32, n: usize) -> Logprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |i: u32| (logits[i as usize] as f64 - lse) as f32;
    let mut top = Vec::new();
    if n > 0 && !logits.is_empty() {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = n.min(idx.len());
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        idx.select_nth_unstable_by(k - 1, by_logit);
        idx.truncate(k);
        idx.sort_by(by_logit);
        top = idx.into_iter().map(|i| (i, lp(i))).collect();
    }
    Logprob {
        logprob: lp(t),
        top,
    }
}

struct Waiting {
    id: SeqId,
    req: Request,
    need: u64,
    waited: bool,
}

struct Seq<S> {
    id: SeqId,
    req: Request,
    state: S,
    /// Bytes reserved against the KV budget.
    need: u64,
    fed: usize,
    cached: usize,
    sampler: Sampler,
    /// The prompt and the generated tokens (the penalties' window).
    history: Vec<u32>,
    generated: usize,
    next: Option<u32>,
    admitted: Instant,
    prefilled: Option<Instant>,
    /// Steps in a row this request was prefilling and got no rows.
    passed_over: usize,
}

impl<S> Seq<S> {
    fn info(&self) -> SeqInfo {
        SeqInfo {
            prompt_tokens: self.req.prompt.len(),
            cached_tokens: self.cached,
            generated: self.generated,
            admitted: self.admitted,
            prefilled: self.prefilled,
        }
    }
}

/// Continuous batching of requests over a backend (see the module doc).
pub struct Scheduler<'a, B: Backend> {
    model: &'a Model,
    b: &'a B,
    cfg: Config,
    waiting: VecDeque<Waiting>,
    running: Vec<Seq<B::State>>,
    cache: PrefixCache<B::State>,
    next_id: SeqId,
    stats: Stats,
}

impl<'a, B: Backend> Scheduler<'a, B> {
    /// An empty scheduler for `model` on `b`.
    pub fn new(model: &'a Model, b: &'a B, cfg: Config) -> Self {
        let cache = PrefixCache::new(cfg.prefix_cache_bytes);
        let stats = Stats {
            kv_budget: cfg.kv_budget,
            ..Stats::default()
        };
        Scheduler {
            model,
            b,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache,
            next_id: 1,
            stats,
        }
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Bytes a request of `prompt` tokens generating `max_new` reserves
    /// against the KV budget.
    pub fn request_bytes(&self, prompt: usize, max_new: usize) -> u64 {
        context_bytes(
            &self.model.hp,
            self.cfg.kv,
            request_context(prompt, max_new),
        )
    }

    /// Queue a request; it is admitted by a later [`Scheduler::step`].
    /// Refused when it is empty, names a token outside the vocabulary, or
    /// could never fit the KV budget.
    pub fn submit(&mut self, req: Request) -> Result<SeqId, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.max_new == 0 {
            return Err(SubmitError::NoTokens);
        }
        let vocab = self.model.w.n_vocab;
        if let Some(&token) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::BadToken { token, vocab });
        }
        let ctx = request_context(req.prompt.len(), req.max_new);
        let need = self.request_bytes(req.prompt.len(), req.max_new);
        if let Some(budget) = self.cfg.kv_budget
            && need > budget
        {
            return Err(SubmitError::OverBudget { need, ctx, budget });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Waiting {
            id,
            req,
            need,
            waited: false,
        });
        Ok(id)
    }

    /// Requests running or waiting.
    pub fn held(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Whether another request would be held without exceeding
    /// [`Config::max_batch`] (running and waiting together), so a caller
    /// with a queue of its own keeps the rest there.
    pub fn has_room(&self) -> bool {
        self.held() < self.cfg.max_batch.max(1)
    }

    /// Whether nothing runs or waits.
    pub fn is_idle(&self) -> bool {
        self.held() == 0
    }

    /// Whether `id` is running or waiting.
    pub fn contains(&self, id: SeqId) -> bool {
        self.running.iter().any(|s| s.id == id) || self.waiting.iter().any(|w| w.id == id)
    }

    /// Drop a request, running or waiting, saving nothing (its client went
    /// away). Whether it was held.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.stats.kv_reserved -= s.need;
            return true;
        }
        false
    }

    /// End a running request now (a stop string in its text, a deadline):
    /// its state is saved in the prefix cache, as at a stop token, and it
    /// leaves. Its counts, or `None` when it is not running (a waiting one
    /// stays: [`Scheduler::cancel`] drops it).
    pub fn finish(&mut self, id: SeqId) -> Option<SeqInfo> {
        let i = self.running.iter().position(|s| s.id == id)?;
        let s = self.running.remove(i);
        self.save_end(&s);
        self.stats.kv_reserved -= s.need;
        Some(s.info())
    }

    /// The counters and gauges now.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.running = self.running.len();
        s.waiting = self.waiting.len();
        s.waiting_for_memory = if self.blocked_by_memory() {
            self.waiting.len()
        } else {
            0
        };
        s.prefill_pending = self
            .running
            .iter()
            .map(|r| (r.req.prompt.len() - r.fed) as u64)
            .sum();
        s.prefix_entries = self.cache.len();
        s.prefix_bytes = self.cache.bytes();
        s.prefix_evictions = self.cache.evictions();
        s
    }

    /// Whether the first waiting request has a batch slot but not the
    /// memory.
    fn blocked_by_memory(&self) -> bool {
        match (self.waiting.front(), self.cfg.kv_budget) {
            (Some(w), Some(budget)) => {
                self.running.len() < self.cfg.max_batch.max(1)
                    && self.stats.kv_reserved + w.need > budget
            }
            _ => false,
        }
    }

    /// Admit waiting requests in arrival order while there is a batch slot
    /// and the first one's context fits the budget.
    fn admit(&mut self, out: &mut Vec<Output>) {
        while self.running.len() < self.cfg.max_batch.max(1) && !self.waiting.is_empty() {
            if self.blocked_by_memory() {
                if let Some(w) = self.waiting.front_mut()
                    && !w.waited
                {
                    w.waited = true;
                    self.stats.memory_waits += 1;
                }
                break;
            }
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            let ctx = request_context(w.req.prompt.len(), w.req.max_new);
            match self.start_state(&w.req.prompt, ctx) {
                Ok((state, cached)) => {
                    let req = w.req;
                    let sampler = Sampler::new(req.sampler.clone())
                        .with_penalties(req.penalties)
                        .with_logit_bias(req.logit_bias.clone());
                    self.stats.kv_reserved += w.need;
                    out.push(Output::Started { id: w.id, cached });
                    self.running.push(Seq {
                        id: w.id,
                        history: req.prompt.clone(),
                        req,
                        state,
                        need: w.need,
                        fed: cached,
                        cached,
                        sampler,
                        generated: 0,
                        next: None,
                        admitted: Instant::now(),
                        prefilled: None,
                        passed_over: 0,
                    });
                }
                Err(e) => out.push(Output::Failed {
                    id: w.id,
                    error: format!("could not start the request: {e}"),
                }),
            }
        }
    }

    /// Admit what fits, run one forward call over every running request's
    /// next rows, sample, and report. Nothing happens (an empty report)
    /// when nothing runs or can be admitted.
    pub fn step(&mut self) -> Vec<Output> {
        let t = Instant::now();
        let before = self.stats.prefill_seconds + self.stats.decode_seconds;
        let out = self.run_step();
        let forward = self.stats.prefill_seconds + self.stats.decode_seconds - before;
        self.stats.host_seconds += (t.elapsed().as_secs_f64() - forward).max(0.0);
        out
    }

    /// [`Scheduler::step`]'s work.
    fn run_step(&mut self) -> Vec<Output> {
        let mut out = Vec::new();
        self.admit(&mut out);
        if self.running.is_empty() {
            return out;
        }
        let (model, b) = (self.model, self.b);
        // This step's rows: (running index, rows), in running order.
        let mut budget = self.cfg.prefill_chunk.max(1);
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut prefill_rows = 0;
        let mut prefilling = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if r.next.is_some() {
                plan.push((i, 1));
            } else if r.fed < r.req.prompt.len() {
                prefilling.push(i);
            }
        }
        let order = prefill_order(
            &prefilling
                .iter()
                .map(|&i| {
                    let r = &self.running[i];
                    (r.req.prompt.len() - r.fed, r.passed_over)
                })
                .collect::<Vec<_>>(),
        );
        for i in order.into_iter().map(|k| prefilling[k]) {
            let r = &mut self.running[i];
            if budget == 0 {
                r.passed_over += 1;
                continue;
            }
            let n = (r.req.prompt.len() - r.fed).min(budget);
            budget -= n;
            prefill_rows += n;
            r.passed_over = 0;
            plan.push((i, n));
        }
        // Decode rows first (in running order), then the prompt chunks: a
        // backend runs the leading one-row sequences of a call in one launch
        // per op (`Backend::attention_seqs`); any order gives the same bytes.
        plan.sort_unstable_by_key(|&(i, _)| (self.running[i].next.is_none(), i));
        if self.reserve_rows(&mut plan, &mut out) {
            if plan.is_empty() {
                return out;
            }
            prefill_rows = plan
                .iter()
                .filter(|&&(i, _)| self.running[i].next.is_none())
                .map(|&(_, n)| n)
                .sum();
        }
        self.stats.max_step_seqs = self.stats.max_step_seqs.max(plan.len());
        let t0 = Instant::now();
        let tokens: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(i, n)| {
                let r = &self.running[i];
                match r.next {
                    Some(t) => vec![t],
                    None => r.req.prompt[r.fed..r.fed + n].to_vec(),
                }
            })
            .collect();
        let wants: Vec<Logits> = plan
            .iter()
            .map(|&(i, n)| {
                let r = &self.running[i];
                if r.next.is_some() || r.fed + n == r.req.prompt.len() {
                    // A plain greedy pick needs no logits on the host.
                    if r.req.constraint.is_none()
                        && r.req.logprobs.is_none()
                        && r.sampler.is_plain_greedy()
                    {
                        Logits::Greedy
                    } else {
                        Logits::Last
                    }
                } else {
                    Logits::None
                }
            })
            .collect();
        let result = {
            let mut states: Vec<Option<&mut B::State>> = self
                .running
                .iter_mut()
                .map(|r| Some(&mut r.state))
                .collect();
            let mut segs: Vec<Segment<'_, B::State>> = Vec::with_capacity(plan.len());
            for ((&(i, _), t), &want) in plan.iter().zip(&tokens).zip(&wants) {
                if let Some(state) = states[i].take() {
                    segs.push(Segment {
                        state,
                        tokens: t,
                        want,
                    });
                }
            }
            forward_batch(model, b, &mut segs)
        };
        let dt = t0.elapsed().as_secs_f64();
        self.stats.steps += 1;
        let decode_rows = plan
            .iter()
            .filter(|&&(i, _)| self.running[i].next.is_some())
            .count();
        let rows = (prefill_rows + decode_rows) as f64;
        if prefill_rows > 0 {
            self.stats.prompt_tokens += prefill_rows as u64;
            self.stats.prefill_seconds += dt * prefill_rows as f64 / rows;
        }
        if decode_rows > 0 {
            self.stats.decode_seconds += dt * decode_rows as f64 / rows;
        }
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let mut failed = vec![false; self.running.len()];
                for &(i, _) in &plan {
                    failed[i] = true;
                }
                let mut k = 0;
                let mut freed = 0;
                self.running.retain(|r| {
                    k += 1;
                    if failed[k - 1] {
                        freed += r.need;
                        out.push(Output::Failed {
                            id: r.id,
                            error: format!("the model failed: {e}"),
                        });
                    }
                    !failed[k - 1]
                });
                self.stats.kv_reserved -= freed;
                return out;
            }
        };
        let mut ended: Vec<Option<Finish>> = vec![None; self.running.len()];
        for (k, (&(i, n), l)) in plan.iter().zip(&logits).enumerate() {
            let r = &mut self.running[i];
            if r.next.is_none() {
                r.fed += n;
                if r.fed < r.req.prompt.len() {
                    continue;
                }
                r.prefilled = Some(Instant::now());
            }
            ended[i] = advance(r, l, logits.token(k), &mut self.stats, &mut out);
            // Saved after the token is reported: the state at the end of
            // the prompt, and at the end of the request (the prompt and the
            // generated tokens fed, which are the history but for a last
            // sampled token never fed).
            let r = &self.running[i];
            let fed = r.history.len().min(b.position(&r.state));
            if fed == r.req.prompt.len() || ended[i].is_some() {
                save(
                    model,
                    b,
                    self.cfg.kv,
                    &mut self.cache,
                    &r.state,
                    &r.history[..fed],
                    &mut self.stats,
                );
            }
        }
        let mut k = 0;
        let mut freed = 0;
        self.running.retain(|r| {
            k += 1;
            match ended[k - 1] {
                Some(finish) => {
                    freed += r.need;
                    out.push(Output::Finished {
                        id: r.id,
                        finish,
                        info: r.info(),
                    });
                    false
                }
                None => true,
            }
        });
        self.stats.kv_reserved -= freed;
        out
    }

    /// Save a leaving request's state: the prompt and the generated tokens
    /// it has fed.
    fn save_end(&mut self, s: &Seq<B::State>) {
        let fed = s.history.len().min(self.b.position(&s.state));
        save(
            self.model,
            self.b,
            self.cfg.kv,
            &mut self.cache,
            &s.state,
            &s.history[..fed],
            &mut self.stats,
        );
    }

    /// Make each planned request's rows writable on its own before the step
    /// ([`Backend::reserve`]: a paged cache takes its blocks here). A request
    /// the device has no memory for fails alone, after the prefix cache is
    /// emptied once to make room; the rest of the step runs. Returns whether
    /// a request failed (`plan` then holds the others, renumbered).
    fn reserve_rows(&mut self, plan: &mut Vec<(usize, usize)>, out: &mut Vec<Output>) -> bool {
        let b = self.b;
        let mut lost = Vec::new();
        for &(i, n) in plan.iter() {
            let mut r = b.reserve(&mut self.running[i].state, n);
            if r.is_err() && !self.cache.is_empty() {
                self.cache.clear();
                self.stats.prefix_cleared += 1;
                r = b.reserve(&mut self.running[i].state, n);
            }
            if let Err(e) = r {
                lost.push((i, e));
            }
        }
        if lost.is_empty() {
            return false;
        }
        let mut gone = vec![false; self.running.len()];
        for (i, e) in lost {
            let r = &self.running[i];
            gone[i] = true;
            self.stats.kv_reserved -= r.need;
            out.push(Output::Failed {
                id: r.id,
                error: format!("no memory for the request's KV cache: {e}"),
            });
        }
        let mut to = vec![0; gone.len()];
        let mut k = 0;
        for (i, &g) in gone.iter().enumerate() {
            to[i] = k;
            k += usize::from(!g);
        }
        plan.retain(|&(i, _)| !gone[i]);
        for p in plan.iter_mut() {
            p.0 = to[p.0];
        }
        let mut i = 0;
        self.running.retain(|_| {
            i += 1;
            !gone[i - 1]
        });
        true
    }

    /// A state for `prompt` with a context of `ctx`: a copy of the longest
    /// prefix cache entry it extends (and how many prompt tokens that entry
    /// holds), else an empty one. When memory runs out the cache is emptied
    /// and the allocation tried again.
    fn start_state(&mut self, prompt: &[u32], ctx: usize) -> crate::Result<(B::State, usize)> {
        let (model, b) = (self.model, self.b);
        if self.cache.enabled() {
            let restored = self
                .cache
                .lookup(prompt)
                .map(|(n, st)| b.fork_state(st, ctx).map(|s| (s, n)));
            match restored {
                Some(Ok((st, n))) => {
                    self.stats.prefix_hits += 1;
                    self.stats.prefix_reused_tokens += n as u64;
                    return Ok((st, n));
                }
                Some(Err(_)) => self.stats.prefix_copy_failures += 1,
                None => {}
            }
            self.stats.prefix_misses += 1;
        }
        match b.new_state(model, ctx, self.cfg.kv) {
            Ok(st) => Ok((st, 0)),
            Err(_) if !self.cache.is_empty() => {
                self.cache.clear();
                self.stats.prefix_cleared += 1;
                b.new_state(model, ctx, self.cfg.kv).map(|st| (st, 0))
            }
            Err(e) => Err(e),
        }
    }
}

/// Take the logits of a request's next token (or the token itself, where
/// the step picked it greedily: `picked`): sample, report, and say whether
/// (and why) it ends.
fn advance<S>(
    r: &mut Seq<S>,
    logits: &[f32],
    picked: Option<u32>,
    stats: &mut Stats,
    out: &mut Vec<Output>,
) -> Option<Finish> {
    let t = match (&r.req.constraint, picked) {
        (None, Some(t)) => {
            stats.greedy_picks += 1;
            t
        }
        (None, None) => r.sampler.sample(logits, &r.history),
        (Some(c), _) => {
            let mut c = c.0.lock().unwrap_or_else(|e| e.into_inner());
            let allowed = match crate::constraint::step(&mut **c, logits.len(), &r.req.stop_tokens)
            {
                Step::Sample(a) => a,
                Step::End => return Some(Finish::Stop),
            };
            let t = r.sampler.sample_masked(logits, &r.history, Some(&allowed));
            if !r.req.stop_tokens.contains(&t) && c.commit(t).is_err() {
                return Some(Finish::Stop);
            }
            t
        }
    };
    if r.req.stop_tokens.contains(&t) {
        return Some(Finish::Stop);
    }
    let lp = r.req.logprobs.map(|n| logprob(logits, t, n));
    r.generated += 1;
    r.history.push(t);
    stats.completion_tokens += 1;
    out.push(Output::Token {
        id: r.id,
        token: t,
        logprob: lp,
    });
    if r.generated >= r.req.max_new {
        return Some(Finish::Length);
    }
    r.next = Some(t);
    None
}

/// Save a copy of `st` (which has consumed exactly `tokens`) in the prefix
/// cache, unless it is held already or is over the budget. A copy that
/// fails (memory) is skipped: the cache is an optimization.
fn save<B: Backend>(
    model: &Model,
    b: &B,
    kv: KvType,
    cache: &mut PrefixCache<B::State>,
    st: &B::State,
    tokens: &[u32],
    stats: &mut Stats,
) {
    let pos = b.position(st);
    if pos != tokens.len() {
        return;
    }
    let bytes = entry_bytes(&model.hp, kv, pos);
    if !cache.wants(tokens, bytes) {
        return;
    }
    match b.fork_state(st, pos) {
        Ok(copy) => cache.insert(tokens.to_vec(), copy, bytes),
        Err(_) => stats.prefix_copy_failures += 1,
    }
}
