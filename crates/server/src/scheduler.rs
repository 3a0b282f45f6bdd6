//! The model thread: continuous batching over the engine's `forward_batch`.
//!
//! Requests arrive through a bounded queue. Each step takes every running
//! request's next rows (one decode row each, plus at most `prefill_chunk`
//! prompt rows shared among the requests still prefilling, shortest
//! remaining prompt first, so a short request's first token does not wait
//! for a long prompt; one passed over for [`AGING_STEPS`] steps goes first,
//! so none waits forever) and runs them in one forward call. A request joins
//! or leaves between steps; one whose client went away is dropped at the next
//! step, in the middle of a prefill too. A request past its deadline ends
//! before the next step: with finish reason `length` when it has generated
//! tokens (llama.cpp's convention for its generation time limit), else with
//! [`Event::TimedOut`]. By the row contract, each request's logits (so its
//! tokens and log-probabilities) are the same bytes whatever else runs beside
//! it.
//!
//! With the prefix cache on ([`Config::prefix_cache_bytes`]), a request
//! starts from a copy of the longest saved state whose tokens begin its
//! prompt and prefills the rest (the same bytes as cold, see [`crate::prefix`]);
//! a copy of each request's state is saved when its prompt is prefilled and
//! when it finishes (its prompt and the generated tokens fed so far), so a
//! follow-up turn that repeats the conversation reuses it.

use crate::metrics::Metrics;
use crate::prefix::{PrefixCache, entry_bytes};
use samesum_engine::backend::Backend;
use samesum_engine::sample::{Penalties, Sampler, SamplerConfig};
use samesum_engine::tokenizer::{StreamDecoder, Tokenizer};
use samesum_engine::{KvType, Logits, Model, Segment, forward_batch};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// A token's log-probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The `n` most likely tokens and theirs.
    pub top: Vec<(String, f32)>,
}

/// Token and timing counts of a finished request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens restored from the prefix cache (not prefilled).
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Time in the queue, ms.
    pub queue_ms: f64,
    /// Prefill time, ms.
    pub prompt_ms: f64,
    /// Generation time, ms.
    pub gen_ms: f64,
}

/// What the model thread sends back for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New text (possibly empty while a stop sequence or a split character is
    /// pending) and, if asked for, the token's log-probabilities.
    Token {
        /// Text to append.
        text: String,
        /// The generated token (`None` for text held back and flushed at
        /// the end).
        id: Option<u32>,
        /// Log-probabilities of the token.
        logprob: Option<TokenLogprob>,
    },
    /// The request ended: `stop` or `length`.
    Done {
        /// Finish reason.
        finish: &'static str,
        /// Counts and timings.
        usage: Usage,
    },
    /// The request failed.
    Error(String),
    /// The deadline passed before the request generated a token.
    TimedOut,
}

/// One request for the model thread.
pub struct Job {
    /// Request id (for logs).
    pub id: String,
    /// Prompt tokens (non-empty, checked against the context).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_new: usize,
    /// Sampling.
    pub sampler: SamplerConfig,
    /// Presence and frequency penalties.
    pub penalties: Penalties,
    /// `(token, bias)` added to the logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
    /// Generate past end-of-text tokens.
    pub ignore_eos: bool,
    /// Where events go; a closed channel cancels the request.
    pub events: UnboundedSender<Event>,
    /// When it was queued.
    pub queued: Instant,
    /// When it must end (see [`Event::TimedOut`]); `None`: no deadline.
    pub deadline: Option<Instant>,
}

impl Job {
    fn expired(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }
}

/// Model-thread settings.
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
}

struct Running<S> {
    job: Job,
    state: S,
    fed: usize,
    /// Prompt tokens restored from the prefix cache.
    cached: usize,
    sampler: Sampler,
    history: Vec<u32>,
    generated: Vec<u32>,
    /// The generated text so far (whole characters), built incrementally.
    text: String,
    decoder: StreamDecoder,
    emitted: usize,
    next: Option<u32>,
    started: Instant,
    prefilled: Option<Instant>,
    /// Steps in a row this request was prefilling and got no rows.
    passed_over: usize,
}

/// Steps a prefilling request may be passed over by shorter ones before it
/// goes first.
pub const AGING_STEPS: usize = 8;

/// The order in which prefilling requests, given as (prompt rows left,
/// steps passed over), get this step's prompt rows: those passed over for
/// [`AGING_STEPS`] or more first (the longest waiting first), then the
/// shortest remaining prompt first; ties in arrival order.
fn prefill_order(reqs: &[(usize, usize)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&k| {
        let (left, passed) = reqs[k];
        let aged = passed >= AGING_STEPS;
        (!aged, if aged { usize::MAX - passed } else { 0 }, left, k)
    });
    order
}

/// Log-softmax value of `t` and the `n` most likely tokens.
fn logprobs(tok: &Tokenizer, logits: &[f32], t: u32, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |i: u32| (logits[i as usize] as f64 - lse) as f32;
    let text = |i: u32| tok.decode(&[i]).unwrap_or_default();
    let mut top = Vec::new();
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = n.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        top = idx.into_iter().map(|i| (text(i), lp(i))).collect();
    }
    TokenLogprob {
        token: text(t),
        logprob: lp(t),
        top,
    }
}

/// The longest suffix of `s` that is a proper prefix of one of `stops` (text
/// that must wait: the next token may complete a stop sequence).
fn pending_prefix(s: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for st in stops {
        for k in (1..st.len()).rev() {
            if k <= s.len()
                && s.is_char_boundary(s.len() - k)
                && st.is_char_boundary(k)
                && s.ends_with(&st[..k])
            {
                best = best.max(k);
                break;
            }
        }
    }
    best
}

impl<S> Running<S> {
    fn usage(&self) -> Usage {
        let now = Instant::now();
        let pre = self.prefilled.unwrap_or(now);
        Usage {
            prompt_tokens: self.job.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: self.generated.len(),
            queue_ms: (self.started - self.job.queued).as_secs_f64() * 1e3,
            prompt_ms: (pre - self.started).as_secs_f64() * 1e3,
            gen_ms: (now - pre).as_secs_f64() * 1e3,
        }
    }

    /// Take the logits of the next token: sample, emit, and say whether the
    /// request goes on.
    fn advance(&mut self, tok: &Tokenizer, logits: &[f32], m: &Metrics) -> bool {
        let t = self.sampler.sample(logits, &self.history);
        let lp = self.job.logprobs.map(|n| logprobs(tok, logits, t, n));
        if !self.job.ignore_eos && tok.stop.contains(&t) {
            return self.finish(tok, "stop", None, m);
        }
        self.generated.push(t);
        self.history.push(t);
        m.completion_tokens.inc(1);
        let piece = self.decoder.push(tok, t).unwrap_or_default();
        self.text.push_str(&piece);
        let full = &self.text;
        // A stop sequence ends the text where it starts.
        if let Some(at) = self
            .job
            .stop
            .iter()
            .filter_map(|s| {
                full.get(self.emitted..)
                    .unwrap_or("")
                    .find(s.as_str())
                    .map(|i| i + self.emitted)
            })
            .min()
        {
            let text = full.get(self.emitted..at).unwrap_or("").to_string();
            self.emitted = at;
            let _ = self.job.events.send(Event::Token {
                text,
                id: Some(t),
                logprob: lp,
            });
            return self.finish(tok, "stop", Some(at), m);
        }
        // Whole characters only (the decoder holds back a split one).
        let safe = full.len() - pending_prefix(full, &self.job.stop);
        let text = full
            .get(self.emitted..safe.max(self.emitted))
            .unwrap_or("")
            .to_string();
        self.emitted = safe.max(self.emitted);
        let _ = self.job.events.send(Event::Token {
            text,
            id: Some(t),
            logprob: lp,
        });
        if self.generated.len() >= self.job.max_new {
            return self.finish(tok, "length", None, m);
        }
        self.next = Some(t);
        true
    }

    /// Flush held-back text (unless cut at a stop sequence) and send Done.
    fn finish(
        &mut self,
        tok: &Tokenizer,
        finish: &'static str,
        cut: Option<usize>,
        m: &Metrics,
    ) -> bool {
        if cut.is_none() {
            let tail = self.decoder.flush(tok).unwrap_or_default();
            self.text.push_str(&tail);
            if let Some(rest) = self.text.get(self.emitted..)
                && !rest.is_empty()
            {
                let _ = self.job.events.send(Event::Token {
                    text: rest.to_string(),
                    id: None,
                    logprob: None,
                });
            }
        }
        let usage = self.usage();
        m.requests_done.inc(1);
        tracing::info!(
            id = %self.job.id,
            prompt = usage.prompt_tokens,
            cached = usage.cached_tokens,
            completion = usage.completion_tokens,
            finish,
            prompt_ms = format!("{:.1}", usage.prompt_ms),
            gen_ms = format!("{:.1}", usage.gen_ms),
            "request done"
        );
        let _ = self.job.events.send(Event::Done { finish, usage });
        false
    }
}

/// Save a copy of `st` (which has consumed exactly `tokens`) in the prefix
/// cache, unless it is held already or is over the budget. A copy that
/// fails (memory) is skipped: the cache is an optimization.
fn save<B: Backend>(
    model: &Model,
    b: &B,
    cfg: &Config,
    cache: &mut PrefixCache<B::State>,
    st: &B::State,
    tokens: &[u32],
    m: &Metrics,
) {
    let pos = b.position(st);
    if pos != tokens.len() {
        return;
    }
    let bytes = entry_bytes(&model.hp, cfg.kv, pos);
    if !cache.wants(tokens, bytes) {
        return;
    }
    match b.fork_state(st, pos) {
        Ok(copy) => cache.insert(tokens.to_vec(), copy, bytes),
        Err(e) => tracing::warn!("prefix cache: could not copy a state of {pos} tokens: {e}"),
    }
    m.prefix_cache_entries.set(cache.len() as u64);
    m.prefix_cache_bytes.set(cache.bytes());
    m.prefix_cache_evictions.set(cache.evictions());
}

/// A state for `job` with a context of `ctx`: a copy of the longest prefix
/// cache entry its prompt extends (and how many prompt tokens that entry
/// holds), else an empty one. When memory runs out the cache is emptied
/// and the allocation tried again.
fn start_state<B: Backend>(
    model: &Model,
    b: &B,
    cfg: &Config,
    cache: &mut PrefixCache<B::State>,
    job: &Job,
    ctx: usize,
    m: &Metrics,
) -> samesum_engine::Result<(B::State, usize)> {
    if cache.enabled() {
        let restored = cache
            .lookup(&job.prompt)
            .map(|(n, st)| b.fork_state(st, ctx).map(|s| (s, n)));
        match restored {
            Some(Ok((st, n))) => {
                m.prefix_cache_hits.inc(1);
                m.prefix_cache_reused_tokens.inc(n as u64);
                return Ok((st, n));
            }
            Some(Err(e)) => {
                tracing::warn!(id = %job.id, "prefix cache: could not copy a saved state: {e}")
            }
            None => {}
        }
        m.prefix_cache_misses.inc(1);
    }
    match b.new_state(model, ctx, cfg.kv) {
        Ok(st) => Ok((st, 0)),
        Err(e) if !cache.is_empty() => {
            tracing::warn!(id = %job.id, entries = cache.len(), "prefix cache emptied to make room: {e}");
            cache.clear();
            m.prefix_cache_entries.set(0);
            m.prefix_cache_bytes.set(0);
            m.prefix_cache_evictions.set(cache.evictions());
            b.new_state(model, ctx, cfg.kv).map(|st| (st, 0))
        }
        Err(e) => Err(e),
    }
}

/// Run the model thread until the queue's senders are all gone.
pub fn run<B: Backend>(
    model: &Model,
    tok: &Tokenizer,
    b: &B,
    rx: Receiver<Job>,
    cfg: &Config,
    m: &Arc<Metrics>,
) {
    let mut running: Vec<Running<B::State>> = Vec::new();
    let mut cache: PrefixCache<B::State> = PrefixCache::new(cfg.prefix_cache_bytes);
    // Whether freed memory went back to the system since the last step.
    let mut trimmed = true;
    loop {
        // Admit new requests between steps (wait when idle).
        while running.len() < cfg.max_batch.max(1) {
            let job = if running.is_empty() {
                if !trimmed {
                    // Idle: the requests' KV caches and activations are
                    // freed; give them back (see `trim_heap`).
                    crate::trim_heap();
                    trimmed = true;
                }
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(j) => j,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(j) => j,
                    Err(_) => break,
                }
            };
            m.queue_depth.dec();
            if job.events.is_closed() {
                m.cancelled.inc(1);
                continue;
            }
            if job.expired(Instant::now()) {
                m.timed_out.inc(1);
                tracing::info!(id = %job.id, "deadline passed in the queue");
                let _ = job.events.send(Event::TimedOut);
                continue;
            }
            let ctx = job.prompt.len() + job.max_new + 1;
            match start_state(model, b, cfg, &mut cache, &job, ctx, m) {
                Ok((state, cached)) => {
                    let seed = job.sampler.seed;
                    running.push(Running {
                        sampler: Sampler::new(SamplerConfig {
                            seed,
                            ..job.sampler.clone()
                        })
                        .with_penalties(job.penalties)
                        .with_logit_bias(job.logit_bias.clone()),
                        history: job.prompt.clone(),
                        job,
                        state,
                        fed: cached,
                        cached,
                        generated: Vec::new(),
                        text: String::new(),
                        decoder: StreamDecoder::new(),
                        emitted: 0,
                        next: None,
                        started: Instant::now(),
                        prefilled: None,
                        passed_over: 0,
                    });
                }
                Err(e) => {
                    let _ = job
                        .events
                        .send(Event::Error(format!("could not start the request: {e}")));
                }
            }
        }
        // Drop the requests whose clients went away.
        running.retain(|r| {
            let gone = r.job.events.is_closed();
            if gone {
                m.cancelled.inc(1);
                tracing::info!(id = %r.job.id, fed = r.fed, generated = r.generated.len(), "client gone: request cancelled");
            }
            !gone
        });
        // End the requests past their deadline.
        let now = Instant::now();
        running.retain_mut(|r| {
            if !r.job.expired(now) {
                return true;
            }
            m.timed_out.inc(1);
            tracing::info!(id = %r.job.id, fed = r.fed, generated = r.generated.len(), "deadline passed");
            if r.generated.is_empty() {
                let _ = r.job.events.send(Event::TimedOut);
                false
            } else {
                let keep = r.finish(tok, "length", None, m);
                let n = r.history.len().min(b.position(&r.state));
                save(model, b, cfg, &mut cache, &r.state, &r.history[..n], m);
                keep
            }
        });
        m.running.set(running.len() as u64);
        if running.is_empty() {
            continue;
        }
        // This step's rows.
        let mut budget = cfg.prefill_chunk.max(1);
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (running index, rows)
        let mut prefill_rows = 0;
        let mut prefilling = Vec::new();
        for (i, r) in running.iter().enumerate() {
            if r.next.is_some() {
                plan.push((i, 1));
            } else if r.fed < r.job.prompt.len() {
                prefilling.push(i);
            }
        }
        let order = prefill_order(
            &prefilling
                .iter()
                .map(|&i| {
                    (
                        running[i].job.prompt.len() - running[i].fed,
                        running[i].passed_over,
                    )
                })
                .collect::<Vec<_>>(),
        );
        for i in order.into_iter().map(|k| prefilling[k]) {
            let r = &mut running[i];
            if budget == 0 {
                r.passed_over += 1;
                continue;
            }
            let n = (r.job.prompt.len() - r.fed).min(budget);
            budget -= n;
            prefill_rows += n;
            r.passed_over = 0;
            plan.push((i, n));
        }
        plan.sort_unstable();
        m.max_step_requests.max(plan.len() as u64);
        let t0 = Instant::now();
        let tokens: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(i, n)| {
                let r = &running[i];
                match r.next {
                    Some(t) => vec![t],
                    None => r.job.prompt[r.fed..r.fed + n].to_vec(),
                }
            })
            .collect();
        let wants: Vec<Logits> = plan
            .iter()
            .map(|&(i, n)| {
                let r = &running[i];
                if r.next.is_some() || r.fed + n == r.job.prompt.len() {
                    Logits::Last
                } else {
                    Logits::None
                }
            })
            .collect();
        let result = {
            let mut states: Vec<Option<&mut B::State>> =
                running.iter_mut().map(|r| Some(&mut r.state)).collect();
            let mut segs: Vec<Segment<'_, B::State>> = plan
                .iter()
                .zip(&tokens)
                .zip(&wants)
                .map(|((&(i, _), t), &want)| Segment {
                    state: states[i].take().expect("one segment per request"),
                    tokens: t,
                    want,
                })
                .collect();
            forward_batch(model, b, &mut segs)
        };
        let dt = t0.elapsed().as_secs_f64();
        trimmed = false;
        if let Some(c) = b.offload_counters() {
            m.expert_cache_hits.set(c.hits);
            m.expert_cache_misses.set(c.misses);
        }
        let decode_rows = plan.len()
            - plan
                .iter()
                .filter(|&&(i, _)| running[i].next.is_none())
                .count();
        if prefill_rows > 0 {
            m.prompt_tokens.inc(prefill_rows as u64);
            m.prefill_seconds
                .add(dt * prefill_rows as f64 / (prefill_rows + decode_rows) as f64);
        }
        if decode_rows > 0 {
            m.decode_seconds
                .add(dt * decode_rows as f64 / (prefill_rows + decode_rows) as f64);
        }
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("forward failed: {e}");
                for &(i, _) in &plan {
                    let _ = running[i]
                        .job
                        .events
                        .send(Event::Error(format!("the model failed: {e}")));
                }
                let failed: Vec<usize> = plan.iter().map(|&(i, _)| i).collect();
                let mut k = 0;
                running.retain(|_| {
                    k += 1;
                    !failed.contains(&(k - 1))
                });
                continue;
            }
        };
        let mut keep = vec![true; running.len()];
        for (&(i, n), l) in plan.iter().zip(&logits) {
            let r = &mut running[i];
            if r.next.is_none() {
                r.fed += n;
                if r.job.prompt.len() > cfg.prefill_chunk {
                    tracing::info!(id = %r.job.id, fed = r.fed, of = r.job.prompt.len(), "prefill");
                }
                if r.fed < r.job.prompt.len() {
                    continue;
                }
                r.prefilled = Some(Instant::now());
            }
            keep[i] = r.advance(tok, l, m);
            // Saved after the token went out, so the copy does not delay it:
            // the state at the end of the prompt, and at the end of the
            // request (the prompt and the generated tokens fed, which are
            // the history but for a last sampled token never fed).
            let n = r.history.len().min(b.position(&r.state));
            if n == r.job.prompt.len() || !keep[i] {
                save(model, b, cfg, &mut cache, &r.state, &r.history[..n], m);
            }
        }
        let mut k = 0;
        running.retain(|_| {
            k += 1;
            keep[k - 1]
        });
        m.running.set(running.len() as u64);
        m.prefill_pending.set(
            running
                .iter()
                .map(|r| (r.job.prompt.len() - r.fed) as u64)
                .sum(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::pending_prefix;

    #[test]
    fn prefill_goes_to_the_shortest_prompt_unless_one_waited_too_long() {
        use super::{AGING_STEPS, prefill_order};
        // Shortest remaining first, ties in arrival order.
        assert_eq!(
            prefill_order(&[(6000, 0), (5, 0), (40, 0), (5, 0)]),
            [1, 3, 2, 0]
        );
        // Passed over AGING_STEPS times: first, however long.
        assert_eq!(prefill_order(&[(6000, AGING_STEPS), (5, 0)]), [0, 1]);
        assert_eq!(prefill_order(&[(6000, AGING_STEPS - 1), (5, 0)]), [1, 0]);
        // Among the aged, the longest waiting first.
        assert_eq!(
            prefill_order(&[(10, AGING_STEPS), (20, AGING_STEPS + 3), (1, 0)]),
            [1, 0, 2]
        );
    }

    #[test]
    fn held_back_text_is_a_stop_prefix() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(pending_prefix("abc E", &stops), 1);
        assert_eq!(pending_prefix("abc EN", &stops), 2);
        assert_eq!(pending_prefix("abc\n", &stops), 1);
        assert_eq!(pending_prefix("abc", &stops), 0);
        assert_eq!(pending_prefix("é", &["éa".to_string()]), 2);
    }
}
