//! The forward pass, written once for `m` rows against the [`Backend`] interface:
//! decode is `m = 1`, prefill is the same code with `m = chunk`. Nothing here
//! knows which one it is, or which backend runs it.
//!
//! Per layer: RMSNorm -> mixer (attention or gated delta net) -> residual ->
//! RMSNorm -> MoE (router, top-k experts combined in k order, shared expert) ->
//! residual; then the final norm and the LM head for the rows whose logits are
//! wanted.

use crate::backend::{Backend, Norm};
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::model::weights::Mixer;

/// Which rows' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every row's (`m * n_vocab` values).
    All,
    /// The last row's only.
    Last,
    /// None (state update only).
    None,
}

/// Run `tokens` (at the state's next positions) through the model, update the
/// state, and return the requested logits.
pub fn forward<B: Backend>(
    model: &Model,
    b: &B,
    st: &mut B::State,
    tokens: &[u32],
    want: Logits,
) -> Result<Vec<f32>> {
    let (m, d) = (tokens.len(), model.hp.n_embd);
    if m == 0 {
        return Ok(Vec::new());
    }
    let pos = b.position(st);
    if pos + m > b.capacity(st) {
        return Err(EngineError::ContextFull {
            pos: pos + m - 1,
            ctx: b.capacity(st),
        });
    }
    let mut h = b.alloc(m * d)?;
    b.embed(model, tokens, &mut h)?;
    let mut x = b.alloc(m * d)?;
    let mut y = b.alloc(m * d)?;
    for (l, lw) in model.w.layers.iter().enumerate() {
        b.rms_norm(model, Norm::Attn(l), &h, &mut x)?;
        match &lw.mixer {
            Mixer::Attention(a) => b.attention(model, l, a, &x, st, &mut y)?,
            Mixer::Linear(dn) => b.delta_net(model, l, dn, &x, st, &mut y)?,
        }
        b.add(&mut h, &y)?;
        b.rms_norm(model, Norm::Ffn(l), &h, &mut x)?;
        b.moe(model, &lw.moe, &x, &mut y)?;
        b.add(&mut h, &y)?;
    }
    b.advance(st, m);
    let rows: Vec<usize> = match want {
        Logits::All => (0..m).collect(),
        Logits::Last => vec![m - 1],
        Logits::None => return Ok(Vec::new()),
    };
    b.logits(model, &h, &rows)
}
