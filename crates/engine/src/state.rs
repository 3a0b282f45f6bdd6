//! Per-sequence state: the KV cache of attention layers, the conv and delta-rule
//! state of linear layers, and the position.

use crate::model::{HParams, LayerKind};

/// Storage type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    /// f32 (exact).
    #[default]
    F32,
    /// f16 (half the memory; values rounded on write).
    F16,
}

/// The KV cache of one attention layer: `ctx` rows of `n_head_kv * head_dim`.
#[derive(Clone, Debug)]
pub enum KvLayer {
    /// f32 rows.
    F32 {
        /// Keys (after norm and RoPE).
        k: Vec<f32>,
        /// Values.
        v: Vec<f32>,
    },
    /// f16 rows.
    F16 {
        /// Keys.
        k: Vec<half::f16>,
        /// Values.
        v: Vec<half::f16>,
    },
}

impl KvLayer {
    fn new(ty: KvType, n: usize) -> Self {
        match ty {
            KvType::F32 => KvLayer::F32 {
                k: vec![0.0; n],
                v: vec![0.0; n],
            },
            KvType::F16 => KvLayer::F16 {
                k: vec![half::f16::ZERO; n],
                v: vec![half::f16::ZERO; n],
            },
        }
    }

    /// Write row `pos` (width `w`).
    pub fn write(&mut self, pos: usize, w: usize, k: &[f32], v: &[f32]) {
        match self {
            KvLayer::F32 { k: kc, v: vc } => {
                kc[pos * w..(pos + 1) * w].copy_from_slice(k);
                vc[pos * w..(pos + 1) * w].copy_from_slice(v);
            }
            KvLayer::F16 { k: kc, v: vc } => {
                for (d, s) in kc[pos * w..(pos + 1) * w].iter_mut().zip(k) {
                    *d = half::f16::from_f32(*s);
                }
                for (d, s) in vc[pos * w..(pos + 1) * w].iter_mut().zip(v) {
                    *d = half::f16::from_f32(*s);
                }
            }
        }
    }

    /// Element `i` of key row `pos` (width `w`).
    #[inline]
    pub fn k_at(&self, pos: usize, w: usize, i: usize) -> f32 {
        match self {
            KvLayer::F32 { k, .. } => k[pos * w + i],
            KvLayer::F16 { k, .. } => k[pos * w + i].to_f32(),
        }
    }

    /// Element `i` of value row `pos`.
    #[inline]
    pub fn v_at(&self, pos: usize, w: usize, i: usize) -> f32 {
        match self {
            KvLayer::F32 { v, .. } => v[pos * w + i],
            KvLayer::F16 { v, .. } => v[pos * w + i].to_f32(),
        }
    }
}

/// State of one linear (delta-net) layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearState {
    /// The last `Kc - 1` conv inputs, oldest first: `conv[t * conv_dim + c]`.
    pub conv: Vec<f32>,
    /// Recurrent state per value head, `s[(n * dk + i) * dv + j]` = `S_n[i][j]`
    /// (i: key index, j: value index).
    pub s: Vec<f32>,
}

/// Everything one sequence carries between forward calls.
#[derive(Clone, Debug)]
pub struct SeqState {
    /// Tokens processed so far (the next token's position).
    pub pos: usize,
    /// Context size (KV rows allocated).
    pub ctx: usize,
    /// KV caches (attention layers).
    pub kv: Vec<Option<KvLayer>>,
    /// Delta-net states (linear layers).
    pub linear: Vec<Option<LinearState>>,
}

impl SeqState {
    /// Empty state for a context of `ctx` tokens (panics where
    /// [`SeqState::try_new`] fails: for tests and known-small contexts).
    pub fn new(hp: &HParams, ctx: usize, kv_type: KvType) -> Self {
        Self::try_new(hp, ctx, kv_type).expect("state allocation")
    }

    /// Empty state for a context of `ctx` tokens, or an error naming the
    /// size when the KV cache cannot be allocated.
    pub fn try_new(hp: &HParams, ctx: usize, kv_type: KvType) -> crate::Result<Self> {
        let kvw = hp.n_head_kv * hp.head_dim;
        let el = match kv_type {
            KvType::F32 => 4,
            KvType::F16 => 2,
        };
        let layers = hp
            .layers
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count();
        let bytes = 2 * (layers * kvw * el) as u128 * ctx as u128;
        // Probe the largest buffer first (the allocation itself stays lazy
        // zeroed memory), so an impossible context is an error, not an abort.
        let fits = ctx
            .checked_mul(kvw * el)
            .is_some_and(|n| Vec::<u8>::new().try_reserve_exact(n).is_ok());
        if !fits {
            return Err(crate::EngineError::Alloc {
                what: "KV cache",
                ctx,
                bytes,
            });
        }
        let kv = hp
            .layers
            .iter()
            .map(|k| (*k == LayerKind::Attention).then(|| KvLayer::new(kv_type, ctx * kvw)))
            .collect();
        let linear = hp
            .layers
            .iter()
            .map(|k| {
                (*k == LayerKind::Linear).then(|| {
                    let s = hp.ssm.expect("linear layers have ssm sizes");
                    LinearState {
                        conv: vec![0.0; (s.d_conv - 1) * s.conv_dim()],
                        s: vec![0.0; s.n_v_heads * s.head_k_dim * s.head_v_dim],
                    }
                })
            })
            .collect();
        Ok(SeqState {
            pos: 0,
            ctx,
            kv,
            linear,
        })
    }

    /// Forget everything (position 0, zero state).
    pub fn reset(&mut self) {
        self.pos = 0;
        for l in self.linear.iter_mut().flatten() {
            l.conv.fill(0.0);
            l.s.fill(0.0);
        }
    }
}
