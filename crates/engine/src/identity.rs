//! The identity gate: for each prompt, prefill it by replay (one decode step per
//! token) and batched (chunks of C rows), and compare the logits bytes at every
//! prompt position, the state after the prompt, and greedy continuations.

use crate::backend::Backend;
use crate::error::Result;
use crate::forward::{Logits, forward, forward_chunks};
use crate::model::Model;
use crate::sample::argmax;
use crate::state::KvType;

/// One prompt's outcome for one chunk size.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Prompt tokens.
    pub len: usize,
    /// Chunk size of the batched arm.
    pub chunk: usize,
    /// Rows the batched arm computed in calls of more than one row.
    pub rows_batched: usize,
    /// Largest call of the replay arm (must be 1).
    pub replay_max_rows: usize,
    /// First prompt position whose logits differ, with max |diff| there.
    pub logits_diff: Option<(usize, f32)>,
    /// Whether the states after the prompt are bit-identical.
    pub state_equal: bool,
    /// First generated step whose token differs, if any.
    pub gen_diff: Option<usize>,
    /// Tokens generated per arm.
    pub generated: usize,
}

impl Verdict {
    /// Every comparison equal.
    pub fn equal(&self) -> bool {
        self.logits_diff.is_none() && self.state_equal && self.gen_diff.is_none()
    }

    /// The verdict counts only if the batched arm really batched (some call of
    /// more than one row whenever the prompt and the chunk allow it) and the
    /// replay arm really replayed (never more than one row per call).
    pub fn valid(&self) -> bool {
        let must_batch = self.chunk > 1 && self.len > 1;
        self.replay_max_rows <= 1 && (!must_batch || self.rows_batched > 0)
    }
}

/// The replay arm's results, computed once per prompt and reused for every chunk
/// size.
pub struct Replay {
    logits: Vec<f32>,
    state: Vec<f32>,
    tokens: Vec<u32>,
    max_rows: usize,
}

/// Greedy tokens after `last_logits` (the logits of the state's last
/// position): `n` of them, each fed back through a one-row forward call.
pub fn continue_greedy<B: Backend>(
    b: &B,
    model: &Model,
    st: &mut B::State,
    last_logits: &[f32],
    n: usize,
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(n);
    let mut logits = last_logits.to_vec();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = forward(model, b, st, &[t], Logits::Last)?;
    }
    Ok(out)
}

/// Run the replay arm: every prompt token through its own forward call.
pub fn replay<B: Backend>(
    b: &B,
    model: &Model,
    prompt: &[u32],
    n_gen: usize,
    kv: KvType,
) -> Result<Replay> {
    let v = model.w.n_vocab;
    let mut st = b.new_state(model, prompt.len() + n_gen + 1, kv)?;
    let mut logits = Vec::with_capacity(prompt.len() * v);
    for &t in prompt {
        logits.extend(forward(model, b, &mut st, &[t], Logits::All)?);
    }
    let state = b.download_state(&st)?;
    let last = logits[(prompt.len() - 1) * v..].to_vec();
    let tokens = continue_greedy(b, model, &mut st, &last, n_gen)?;
    Ok(Replay {
        logits,
        state,
        tokens,
        max_rows: 1,
    })
}

/// Run the batched arm with chunks of `chunk` rows and compare with `r`.
pub fn batched<B: Backend>(
    b: &B,
    model: &Model,
    prompt: &[u32],
    chunk: usize,
    n_gen: usize,
    kv: KvType,
    r: &Replay,
) -> Result<Verdict> {
    let v = model.w.n_vocab;
    let mut st = b.new_state(model, prompt.len() + n_gen + 1, kv)?;
    let mut logits = Vec::with_capacity(prompt.len() * v);
    let mut rows_batched = 0;
    // Two chunks at a time: on a backend with lanes the second runs beside
    // the first (forward_pair), so the gate covers that schedule too.
    let pieces: Vec<&[u32]> = prompt.chunks(chunk.max(1)).collect();
    logits.extend(forward_chunks(model, b, &mut st, &pieces, |_| Logits::All)?);
    rows_batched += pieces
        .iter()
        .filter(|c| c.len() > 1)
        .map(|c| c.len())
        .sum::<usize>();
    let mut logits_diff = None;
    for p in 0..prompt.len() {
        let (x, y) = (&logits[p * v..(p + 1) * v], &r.logits[p * v..(p + 1) * v]);
        if x.iter().zip(y).any(|(a, b)| a.to_bits() != b.to_bits()) {
            let d = x
                .iter()
                .zip(y)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            logits_diff = Some((p, d));
            break;
        }
    }
    let state = b.download_state(&st)?;
    let state_equal = state.len() == r.state.len()
        && state
            .iter()
            .zip(&r.state)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    let last = logits[(prompt.len() - 1) * v..].to_vec();
    let tokens = continue_greedy(b, model, &mut st, &last, n_gen)?;
    let gen_diff = tokens.iter().zip(&r.tokens).position(|(a, b)| a != b);
    Ok(Verdict {
        len: prompt.len(),
        chunk,
        rows_batched,
        replay_max_rows: r.max_rows,
        logits_diff,
        state_equal,
        gen_diff,
        generated: tokens.len(),
    })
}
