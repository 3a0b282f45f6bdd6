//! The model thread: the engine's step scheduler
//! ([`samesum_engine::sched::Scheduler`]) driven from the request queue.
//!
//! The scheduler owns admission (a batch slot and the KV budget), the
//! per-step plan (chunked prefill, shortest prompt first with aging), the
//! forward call, sampling, stop tokens, lengths and the prefix cache. This
//! thread owns what is text or time: it takes jobs from the queue while the
//! scheduler has room ([`Config::max_batch`] requests running or waiting
//! for memory; the rest stay in the bounded queue, which answers 503 when
//! full), detokenizes each token into whole characters, finds stop strings
//! (and ends the request there, [`Scheduler::finish`]), turns token ids of
//! log-probabilities into text, ends requests past their deadline (with
//! finish reason `length` when they have generated tokens, llama.cpp's
//! convention for its generation time limit, else with
//! [`Event::TimedOut`]), cancels those whose client went away, and sends
//! [`Event`]s to the connections. By the row contract, each request's
//! logits (so its tokens and log-probabilities) are the same bytes whatever
//! else runs beside it.

use crate::metrics::Metrics;
use samesum_engine::backend::Backend;
use samesum_engine::sample::{Penalties, SamplerConfig};
use samesum_engine::sched::{self, Output, Request, Scheduler, SeqId, SeqInfo, Stats};
use samesum_engine::tokenizer::{StreamDecoder, Tokenizer};
use samesum_engine::{KvType, Model};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// A token's log-probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (lossy: U+FFFD for a part of a character).
    pub token: String,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f32,
    /// The `n` most likely tokens and theirs.
    pub top: Vec<(String, f32)>,
    /// The bytes of each of `top`'s tokens.
    pub top_bytes: Vec<Vec<u8>>,
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

/// The prompt's tokens with their log-probabilities (`echo`): the first
/// token has none (nothing comes before it).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct PromptLogprobs {
    /// The first token's text and bytes.
    pub first: (String, Vec<u8>),
    /// Each later token's log-probability given the tokens before it.
    pub rest: Vec<TokenLogprob>,
}

/// What the model thread sends back for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The prompt, echoed (first, before any token): its text and, if
    /// asked for, its tokens' log-probabilities.
    Prompt {
        /// The prompt's text.
        text: String,
        /// Its log-probabilities.
        logprobs: Option<PromptLogprobs>,
    },
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
    /// Which tokens may come next (structured output).
    pub constraint: Option<samesum_engine::constraint::SharedConstraint>,
    /// Echo the prompt ([`Event::Prompt`]) before the completion.
    pub echo: bool,
    /// With `echo`: the prompt tokens' log-probabilities with this many
    /// alternatives.
    pub prompt_logprobs: Option<usize>,
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
    /// Bytes the running requests' whole contexts may reserve together
    /// (see [`samesum_engine::sched`]); `None`: no limit.
    pub kv_budget: Option<u64>,
}

/// A request's text side while the scheduler runs it.
struct Conn {
    job: Job,
    generated: usize,
    /// The generated text so far (whole characters), built incrementally.
    text: String,
    decoder: StreamDecoder,
    emitted: usize,
    /// A stop string ended the text: nothing held back is flushed.
    stopped: bool,
}

/// A log-probability with its token ids as text.
fn text_logprob(tok: &Tokenizer, t: u32, lp: sched::Logprob) -> TokenLogprob {
    // A token's text is its bytes read as UTF-8 (U+FFFD for a part of a
    // character); a control token's is its name, as llama-server shows it.
    let text = |i: u32| String::from_utf8_lossy(&tok.token_bytes(i)).into_owned();
    TokenLogprob {
        token: text(t),
        bytes: tok.token_bytes(t),
        logprob: lp.logprob,
        top_bytes: lp.top.iter().map(|&(i, _)| tok.token_bytes(i)).collect(),
        top: lp.top.into_iter().map(|(i, l)| (text(i), l)).collect(),
    }
}

/// The log-probability of each prompt token after the first, with `n`
/// alternatives: the engine's scoring ([`samesum_engine::score`], as
/// `samesum perplexity` computes it), a prefill of the prompt on a state of
/// its own. A failure (memory) leaves the list empty.
fn prompt_logprobs<B: Backend>(
    model: &Model,
    tok: &Tokenizer,
    b: &B,
    cfg: &Config,
    prompt: &[u32],
    n: usize,
) -> PromptLogprobs {
    let first = prompt.first().copied().unwrap_or(0);
    let mut out = PromptLogprobs {
        first: (
            String::from_utf8_lossy(&tok.token_bytes(first)).into_owned(),
            tok.token_bytes(first),
        ),
        rest: Vec::new(),
    };
    if prompt.len() < 2 {
        return out;
    }
    match samesum_engine::score::score_tokens(b, model, prompt, 1, cfg.prefill_chunk, cfg.kv, n) {
        Ok(scores) => {
            out.rest = scores
                .into_iter()
                .map(|s| {
                    text_logprob(
                        tok,
                        s.token,
                        sched::Logprob {
                            logprob: s.logprob as f32,
                            top: s.top.into_iter().map(|(t, l)| (t, l as f32)).collect(),
                        },
                    )
                })
                .collect();
        }
        Err(e) => tracing::warn!("prompt log-probabilities failed: {e}"),
    }
    out
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

impl Conn {
    fn new(job: Job) -> Conn {
        Conn {
            job,
            generated: 0,
            text: String::new(),
            decoder: StreamDecoder::new(),
            emitted: 0,
            stopped: false,
        }
    }

    /// A generated token: send its text (whole characters, none that may
    /// begin a stop string), or the text up to a stop string, which ends
    /// the request (`stopped`).
    fn token(&mut self, tok: &Tokenizer, t: u32, lp: Option<TokenLogprob>) {
        self.generated += 1;
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
            self.stopped = true;
            let _ = self.job.events.send(Event::Token {
                text,
                id: Some(t),
                logprob: lp,
            });
            return;
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
    }

    /// Flush held-back text (unless cut at a stop string) and send Done.
    fn finish(&mut self, tok: &Tokenizer, finish: &'static str, info: &SeqInfo, m: &Metrics) {
        if !self.stopped {
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
        let now = Instant::now();
        let pre = info.prefilled.unwrap_or(now);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let usage = Usage {
            prompt_tokens: info.prompt_tokens,
            cached_tokens: info.cached_tokens,
            completion_tokens: info.generated,
            queue_ms: ms(info.admitted.saturating_duration_since(self.job.queued)),
            prompt_ms: ms(pre - info.admitted),
            gen_ms: ms(now - pre),
        };
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
    }
}

/// The request the scheduler runs for `job`.
fn request(tok: &Tokenizer, job: &Job) -> Request {
    Request {
        prompt: job.prompt.clone(),
        max_new: job.max_new,
        sampler: job.sampler.clone(),
        penalties: job.penalties,
        logit_bias: job.logit_bias.clone(),
        stop_tokens: if job.ignore_eos {
            Vec::new()
        } else {
            tok.stop.clone()
        },
        logprobs: job.logprobs,
        constraint: job.constraint.clone(),
    }
}

/// Copy the scheduler's counts into the metrics; warn about prefix cache
/// copies that failed since `seen`.
fn publish(st: &Stats, seen: &Stats, m: &Metrics) {
    if st.prefix_copy_failures > seen.prefix_copy_failures {
        tracing::warn!(
            failures = st.prefix_copy_failures - seen.prefix_copy_failures,
            "prefix cache: a state copy failed (memory); skipped"
        );
    }
    if st.prefix_cleared > seen.prefix_cleared {
        tracing::warn!("prefix cache emptied to make room for a request's state");
    }
    m.prompt_tokens.set(st.prompt_tokens);
    m.completion_tokens.set(st.completion_tokens);
    m.prefill_seconds.set(st.prefill_seconds);
    m.decode_seconds.set(st.decode_seconds);
    m.running.set(st.running as u64);
    m.max_step_requests.set(st.max_step_seqs as u64);
    m.prefill_pending.set(st.prefill_pending);
    m.prefix_cache_hits.set(st.prefix_hits);
    m.prefix_cache_misses.set(st.prefix_misses);
    m.prefix_cache_reused_tokens.set(st.prefix_reused_tokens);
    m.prefix_cache_entries.set(st.prefix_entries as u64);
    m.prefix_cache_bytes.set(st.prefix_bytes);
    m.prefix_cache_evictions.set(st.prefix_evictions);
    m.kv_budget_bytes.set(st.kv_budget.unwrap_or(0));
    m.kv_reserved_bytes.set(st.kv_reserved);
    m.kv_waiting.set(st.waiting_for_memory as u64);
    m.kv_memory_waits.set(st.memory_waits);
}

/// Run the model thread until the queue's senders are all gone and nothing
/// runs.
pub fn run<B: Backend>(
    model: &Model,
    tok: &Tokenizer,
    b: &B,
    rx: Receiver<Job>,
    cfg: &Config,
    m: &Arc<Metrics>,
) {
    let mut sched = Scheduler::new(
        model,
        b,
        sched::Config {
            max_batch: cfg.max_batch.max(1),
            prefill_chunk: cfg.prefill_chunk.max(1),
            kv: cfg.kv,
            prefix_cache_bytes: cfg.prefix_cache_bytes,
            kv_budget: cfg.kv_budget,
        },
    );
    // Ordered by id: arrival order, for the logs and the events.
    let mut conns: BTreeMap<SeqId, Conn> = BTreeMap::new();
    let mut seen = sched.stats();
    publish(&seen, &seen, m);
    // Whether freed memory went back to the system since the last step.
    let mut trimmed = true;
    loop {
        // Take new requests between steps (wait when idle).
        while sched.has_room() {
            let job = if sched.is_idle() {
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
            if job.echo {
                let logprobs = job
                    .prompt_logprobs
                    .map(|n| prompt_logprobs(model, tok, b, cfg, &job.prompt, n));
                let text = tok.decode(&job.prompt).unwrap_or_default();
                let _ = job.events.send(Event::Prompt { text, logprobs });
            }
            if job.max_new == 0 {
                // The prompt's log-probabilities alone (echo, max_tokens 0).
                m.requests_done.inc(1);
                let usage = Usage {
                    prompt_tokens: job.prompt.len(),
                    queue_ms: job.queued.elapsed().as_secs_f64() * 1e3,
                    ..Usage::default()
                };
                let _ = job.events.send(Event::Done {
                    finish: "length",
                    usage,
                });
                continue;
            }
            match sched.submit(request(tok, &job)) {
                Ok(id) => {
                    conns.insert(id, Conn::new(job));
                }
                Err(e) => {
                    let _ = job.events.send(Event::Error(e.to_string()));
                }
            }
        }
        // Drop the requests whose clients went away; end those past their
        // deadline (saving the state of one that generated tokens).
        let now = Instant::now();
        conns.retain(|&id, c| {
            if c.job.events.is_closed() {
                sched.cancel(id);
                m.cancelled.inc(1);
                tracing::info!(id = %c.job.id, generated = c.generated, "client gone: request cancelled");
                return false;
            }
            if !c.job.expired(now) {
                return true;
            }
            m.timed_out.inc(1);
            tracing::info!(id = %c.job.id, generated = c.generated, "deadline passed");
            let info = if c.generated > 0 {
                sched.finish(id)
            } else {
                None
            };
            match info {
                Some(info) => c.finish(tok, "length", &info, m),
                None => {
                    sched.cancel(id);
                    let _ = c.job.events.send(Event::TimedOut);
                }
            }
            false
        });
        if sched.is_idle() {
            let st = sched.stats();
            publish(&st, &seen, m);
            seen = st;
            continue;
        }
        let out = sched.step();
        trimmed = false;
        for o in out {
            match o {
                Output::Started { .. } => {}
                Output::Token { id, token, logprob } => {
                    if let Some(c) = conns.get_mut(&id) {
                        let lp = logprob.map(|l| text_logprob(tok, token, l));
                        c.token(tok, token, lp);
                    }
                }
                Output::Finished { id, finish, info } => {
                    if let Some(mut c) = conns.remove(&id) {
                        let finish = if c.stopped { "stop" } else { finish.as_str() };
                        c.finish(tok, finish, &info, m);
                    }
                }
                Output::Failed { id, error } => {
                    if let Some(c) = conns.remove(&id) {
                        tracing::error!(id = %c.job.id, "{error}");
                        let _ = c.job.events.send(Event::Error(error));
                    }
                }
            }
        }
        // The requests a stop string ended: their states saved as at a stop
        // token.
        conns.retain(|&id, c| {
            if !c.stopped {
                return true;
            }
            if let Some(info) = sched.finish(id) {
                c.finish(tok, "stop", &info, m);
            }
            false
        });
        if let Some(c) = b.offload_counters() {
            m.expert_cache_hits.set(c.hits);
            m.expert_cache_misses.set(c.misses);
        }
        let st = sched.stats();
        publish(&st, &seen, m);
        seen = st;
    }
}

#[cfg(test)]
mod tests {
    use super::pending_prefix;

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
