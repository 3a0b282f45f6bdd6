//! Conformance bodies written once against [`Backend`], run by every backend's
//! tests (the CPU's in `tests/`, the CUDA backend's on the GPU machine).

use crate::backend::Backend;
use crate::forward::{Logits, forward};
use crate::model::Model;
use crate::state::KvType;

/// Where two runs first differ.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    /// Token position.
    pub position: usize,
    /// Largest |a - b| at that position.
    pub max_abs_diff: f32,
}

/// Run `tokens` twice on fresh states: once in chunks of `chunk` rows, once one
/// token per call (replay), both asking for every position's logits, and compare
/// the bytes. `Ok` means identical at every position.
pub fn forward_rows_match<B: Backend>(
    b: &B,
    model: &Model,
    tokens: &[u32],
    chunk: usize,
) -> Result<(), Divergence> {
    let v = model.w.n_vocab;
    let ctx = tokens.len().max(1);
    let mut batched = Vec::with_capacity(tokens.len() * v);
    let mut st = b.new_state(model, ctx, KvType::F32);
    for c in tokens.chunks(chunk.max(1)) {
        batched.extend(forward(model, b, &mut st, c, Logits::All).expect("forward"));
    }
    let mut st = b.new_state(model, ctx, KvType::F32);
    for (p, &t) in tokens.iter().enumerate() {
        let one = forward(model, b, &mut st, &[t], Logits::All).expect("forward");
        let row = &batched[p * v..(p + 1) * v];
        if one.iter().zip(row).any(|(x, y)| x.to_bits() != y.to_bits()) {
            let max_abs_diff = one
                .iter()
                .zip(row)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            return Err(Divergence {
                position: p,
                max_abs_diff,
            });
        }
    }
    Ok(())
}
