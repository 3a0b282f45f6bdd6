//! `samesum run -cnv`: conversation mode, as llama-cli's.
//!
//! User turns come from stdin, one line each (a `> ` prompt on stderr when
//! stdin is a terminal); EOF or a line `/exit` ends the conversation. Every
//! turn renders the whole history (the system message, each user turn, each
//! reply as printed) with the model's chat template and continues the one
//! sequence state: only the tokens the new rendering adds beyond those already
//! fed are prefilled. When the rendering does not extend them (a template may
//! render earlier turns differently once more follow, or a reply's text may
//! tokenize otherwise than it was generated), the whole conversation is
//! prefilled into a fresh state, which the debug log (`RUST_LOG=debug`)
//! reports. Either way a reply's bytes are those of a one-shot run on the
//! rendered conversation: batched prefill equals one-token replay.
//!
//! Ctrl-C during a reply stops that reply; at the prompt it exits.

use crate::run::NPredict;
use anyhow::{Result, bail};
use samesum_engine::sample::{Sampler, SamplerConfig};
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{Backend, KvType, Logits, Model, forward, forward_chunks};
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// What a conversation runs with (the flags of `samesum run`).
pub(crate) struct Settings<'a> {
    pub(crate) system: Option<&'a str>,
    /// The chat template's variables (`--chat-template-kwargs`, `--think`).
    pub(crate) kwargs: serde_json::Map<String, serde_json::Value>,
    pub(crate) ctx: usize,
    pub(crate) n_predict: NPredict,
    pub(crate) sampling: SamplerConfig,
    pub(crate) kv: KvType,
    pub(crate) chunk: usize,
}

/// The history and what the sequence state holds.
struct History {
    /// Messages as `(role, content)`, the system message first if any.
    msgs: Vec<(String, String)>,
    /// Tokens fed into the state, in order.
    fed: Vec<u32>,
}

impl History {
    /// The tokens of the whole conversation rendered for the next reply.
    fn render(
        &self,
        tok: &Tokenizer,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>> {
        let msgs: Vec<serde_json::Value> = self
            .msgs
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        let text = tok.render_chat(&samesum_engine::tokenizer::ChatInput {
            messages: &serde_json::Value::Array(msgs),
            tools: None,
            kwargs,
            add_generation_prompt: true,
        })?;
        Ok(tok.encode(&text)?)
    }

    /// What to prefill for `tokens`: the part past what the state holds, or
    /// `None` when `tokens` does not extend it (the state must start over).
    fn delta<'t>(&self, tokens: &'t [u32]) -> Option<&'t [u32]> {
        (tokens.len() > self.fed.len() && tokens.starts_with(&self.fed))
            .then(|| &tokens[self.fed.len()..])
    }
}

/// Run the conversation on stdin until EOF or `/exit`. `stop` is set by
/// Ctrl-C while `busy` (a reply in progress); the handler exits otherwise.
pub(crate) fn converse<B: Backend>(
    b: &B,
    model: &Model,
    tok: &Tokenizer,
    s: &Settings<'_>,
    stop: &AtomicBool,
    busy: &AtomicBool,
) -> Result<()> {
    eprintln!("backend: {}", b.name());
    let stdin = std::io::stdin();
    let terminal = stdin.is_terminal();
    if terminal {
        eprintln!(
            "conversation mode: a line is a turn; /exit or Ctrl-D ends, Ctrl-C stops a reply"
        );
    }
    let mut h = History {
        msgs: s
            .system
            .map(|t| vec![("system".to_string(), t.to_string())])
            .unwrap_or_default(),
        fed: Vec::new(),
    };
    let mut st = crate::run::state_with_room(b, model, s.ctx, s.kv, s.ctx)?;
    let mut sampler = Sampler::new(s.sampling.clone());
    let mut input = stdin.lock();
    let mut line = String::new();
    loop {
        if terminal {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        line.clear();
        if input.read_line(&mut line)? == 0 {
            break;
        }
        let text = line.strip_suffix('\n').unwrap_or(&line);
        let text = text.strip_suffix('\r').unwrap_or(text);
        if text.trim() == "/exit" {
            break;
        }
        h.msgs.push(("user".into(), text.to_string()));
        let tokens = h.render(tok, &s.kwargs)?;
        if tokens.len() >= s.ctx {
            bail!(
                "the conversation ({} tokens) no longer fits the context of {} (raise -c)",
                tokens.len(),
                s.ctx
            );
        }
        let delta = match h.delta(&tokens) {
            Some(d) => {
                tracing::debug!(
                    kept = h.fed.len(),
                    new = d.len(),
                    "conversation: the rendering extends the state; prefilling the new tokens"
                );
                d
            }
            None => {
                tracing::debug!(
                    fed = h.fed.len(),
                    rendered = tokens.len(),
                    "conversation: the rendering does not extend the tokens fed; prefilling the whole conversation into a fresh state"
                );
                st = crate::run::state_with_room(b, model, s.ctx, s.kv, s.ctx)?;
                h.fed.clear();
                &tokens[..]
            }
        };
        let room = s.ctx - tokens.len();
        let limit = match s.n_predict {
            NPredict::Tokens(n) => n.min(room),
            NPredict::UntilEnd => room,
        };
        stop.store(false, Ordering::SeqCst);
        busy.store(true, Ordering::SeqCst);
        let reply = reply(
            b,
            model,
            tok,
            &mut st,
            &mut h.fed,
            delta,
            s.chunk,
            limit,
            &mut sampler,
            stop,
        );
        busy.store(false, Ordering::SeqCst);
        let reply = reply?;
        if stop.swap(false, Ordering::SeqCst) {
            eprintln!("[interrupted]");
        }
        h.msgs.push(("assistant".into(), reply));
    }
    Ok(())
}

/// Prefill `delta` onto the state in chunks of `chunk` rows, then sample
/// and print up to `limit` tokens; returns the reply's text as printed.
/// `fed` gets every token that went into the state.
fn reply<B: Backend>(
    b: &B,
    model: &Model,
    tok: &Tokenizer,
    st: &mut B::State,
    fed: &mut Vec<u32>,
    delta: &[u32],
    chunk: usize,
    limit: usize,
    sampler: &mut Sampler,
    stop: &AtomicBool,
) -> Result<String> {
    let pieces: Vec<&[u32]> = delta.chunks(chunk.max(1)).collect();
    let n = pieces.len();
    let mut logits = Vec::new();
    // Two chunks at a time, as `run` prefills (on the GPU the second runs
    // beside the first).
    for (p, pair) in pieces.chunks(2).enumerate() {
        if stop.load(Ordering::SeqCst) {
            return Ok(String::new());
        }
        let want = |j: usize| {
            if 2 * p + j + 1 == n {
                Logits::Last
            } else {
                Logits::None
            }
        };
        logits = forward_chunks(model, b, st, pair, want)?;
        for c in pair {
            fed.extend_from_slice(c);
        }
    }
    let mut out = std::io::stdout().lock();
    let mut stream = tok.stream();
    let mut text = String::new();
    let mut generated = 0usize;
    while generated < limit && !stop.load(Ordering::SeqCst) && !logits.is_empty() {
        let next = sampler.sample(&logits, fed);
        if tok.stop.contains(&next) {
            break;
        }
        generated += 1;
        let piece = stream.push(next)?;
        write!(out, "{piece}")?;
        out.flush()?;
        text.push_str(&piece);
        if generated == limit {
            break;
        }
        logits = forward(model, b, st, &[next], Logits::Last)?;
        fed.push(next);
    }
    let rest = stream.flush()?;
    write!(out, "{rest}")?;
    writeln!(out)?;
    out.flush()?;
    text.push_str(&rest);
    Ok(text)
}
