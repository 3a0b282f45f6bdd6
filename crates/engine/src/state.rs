//! Per-sequence state: the KV cache of attention layers, the conv and delta-rule
//! state of linear layers, and the position.
//!
//! KV blocks are shared copy-on-write: cloning a state ([`SeqState::fork`])
//! shares every block with the original, and the first write to a shared
//! block (by either) copies that block first, so a fork costs its recurrent
//! states and the block table, not the KV rows.

use crate::model::{HParams, LayerKind};
use std::sync::Arc;

/// Storage type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    /// f32 (exact).
    #[default]
    F32,
    /// f16 (half the memory; values rounded on write).
    F16,
    /// bf16 (half the memory, f32's range; values rounded to nearest even
    /// on write, 8 bits of mantissa).
    BF16,
}

/// Positions per KV cache block: the cache of a layer is a table of blocks
/// of this many rows, allocated as the sequence reaches them, and attention
/// walks keys one block at a time (its position splits).
pub const KV_BLOCK: usize = 256;

/// One block of a layer's KV cache: [`KV_BLOCK`] key rows and as many value
/// rows, `width` values each. Cloning shares the rows; [`KvLayer::write`]
/// copies a shared block before writing into it.
#[derive(Clone, Debug)]
pub struct KvBlock<T> {
    /// Keys (after norm and RoPE), row after row.
    pub k: Arc<[T]>,
    /// Values, row after row.
    pub v: Arc<[T]>,
}

impl KvType {
    /// Bytes of one stored value.
    pub fn size(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 | KvType::BF16 => 2,
        }
    }
}

/// The KV cache of one attention layer: rows of `width` (= `n_head_kv *
/// head_dim`) values in blocks of [`KV_BLOCK`] positions; block `b` holds
/// positions `b * KV_BLOCK ..`.
#[derive(Clone, Debug)]
pub enum KvLayer {
    /// f32 rows.
    F32 {
        /// Values per row.
        width: usize,
        /// The block table.
        blocks: Vec<KvBlock<f32>>,
    },
    /// f16 rows.
    F16 {
        /// Values per row.
        width: usize,
        /// The block table.
        blocks: Vec<KvBlock<half::f16>>,
    },
    /// bf16 rows.
    BF16 {
        /// Values per row.
        width: usize,
        /// The block table.
        blocks: Vec<KvBlock<half::bf16>>,
    },
}

fn block<T: Copy>(zero: T, n: usize) -> KvBlock<T> {
    KvBlock {
        k: vec![zero; n].into(),
        v: vec![zero; n].into(),
    }
}

impl KvLayer {
    /// An empty cache of rows of `width` values.
    pub fn new(ty: KvType, width: usize) -> Self {
        match ty {
            KvType::F32 => KvLayer::F32 {
                width,
                blocks: Vec::new(),
            },
            KvType::F16 => KvLayer::F16 {
                width,
                blocks: Vec::new(),
            },
            KvType::BF16 => KvLayer::BF16 {
                width,
                blocks: Vec::new(),
            },
        }
    }

    /// The storage type.
    pub fn kv_type(&self) -> KvType {
        match self {
            KvLayer::F32 { .. } => KvType::F32,
            KvLayer::F16 { .. } => KvType::F16,
            KvLayer::BF16 { .. } => KvType::BF16,
        }
    }

    /// Values per row.
    pub fn width(&self) -> usize {
        match self {
            KvLayer::F32 { width, .. }
            | KvLayer::F16 { width, .. }
            | KvLayer::BF16 { width, .. } => *width,
        }
    }

    /// Write row `pos` (`k` and `v` of width `w`, the cache's width),
    /// allocating its block when the sequence first reaches it and copying
    /// it first when another state shares it.
    pub fn write(&mut self, pos: usize, w: usize, k: &[f32], v: &[f32]) {
        let (b, at) = (pos / KV_BLOCK, (pos % KV_BLOCK) * w);
        match self {
            KvLayer::F32 { width, blocks } => {
                debug_assert_eq!(*width, w);
                while blocks.len() <= b {
                    blocks.push(block(0f32, KV_BLOCK * w));
                }
                Arc::make_mut(&mut blocks[b].k)[at..at + w].copy_from_slice(k);
                Arc::make_mut(&mut blocks[b].v)[at..at + w].copy_from_slice(v);
            }
            KvLayer::F16 { width, blocks } => {
                debug_assert_eq!(*width, w);
                while blocks.len() <= b {
                    blocks.push(block(half::f16::ZERO, KV_BLOCK * w));
                }
                for (d, s) in Arc::make_mut(&mut blocks[b].k)[at..at + w]
                    .iter_mut()
                    .zip(k)
                {
                    *d = half::f16::from_f32(*s);
                }
                for (d, s) in Arc::make_mut(&mut blocks[b].v)[at..at + w]
                    .iter_mut()
                    .zip(v)
                {
                    *d = half::f16::from_f32(*s);
                }
            }
            KvLayer::BF16 { width, blocks } => {
                debug_assert_eq!(*width, w);
                while blocks.len() <= b {
                    blocks.push(block(half::bf16::ZERO, KV_BLOCK * w));
                }
                for (d, s) in Arc::make_mut(&mut blocks[b].k)[at..at + w]
                    .iter_mut()
                    .zip(k)
                {
                    *d = half::bf16::from_f32(*s);
                }
                for (d, s) in Arc::make_mut(&mut blocks[b].v)[at..at + w]
                    .iter_mut()
                    .zip(v)
                {
                    *d = half::bf16::from_f32(*s);
                }
            }
        }
    }

    /// Blocks allocated so far.
    pub fn blocks(&self) -> usize {
        match self {
            KvLayer::F32 { blocks, .. } => blocks.len(),
            KvLayer::F16 { blocks, .. } => blocks.len(),
            KvLayer::BF16 { blocks, .. } => blocks.len(),
        }
    }

    /// Blocks this cache shares with another state (a fork's, or the one
    /// it was forked from).
    pub fn shared_blocks(&self) -> usize {
        fn shared<T>(bs: &[KvBlock<T>]) -> usize {
            bs.iter()
                .filter(|b| Arc::strong_count(&b.k) > 1 || Arc::strong_count(&b.v) > 1)
                .count()
        }
        match self {
            KvLayer::F32 { blocks, .. } => shared(blocks),
            KvLayer::F16 { blocks, .. } => shared(blocks),
            KvLayer::BF16 { blocks, .. } => shared(blocks),
        }
    }

    /// Element `i` of key row `pos` (width `w`); a row in a block never
    /// written reads as zero, as a freshly allocated cache does.
    #[inline]
    pub fn k_at(&self, pos: usize, w: usize, i: usize) -> f32 {
        let (b, at) = (pos / KV_BLOCK, (pos % KV_BLOCK) * w + i);
        match self {
            KvLayer::F32 { blocks, .. } => blocks.get(b).map_or(0.0, |x| x.k[at]),
            KvLayer::F16 { blocks, .. } => blocks.get(b).map_or(0.0, |x| x.k[at].to_f32()),
            KvLayer::BF16 { blocks, .. } => blocks.get(b).map_or(0.0, |x| x.k[at].to_f32()),
        }
    }

    /// Element `i` of value row `pos` (zero where never written).
    #[inline]
    pub fn v_at(&self, pos: usize, w: usize, i: usize) -> f32 {
        let (b, at) = (pos / KV_BLOCK, (pos % KV_BLOCK) * w + i);
        match self {
            KvLayer::F32 { blocks, .. } => blocks.get(b).map_or(0.0, |x| x.v[at]),
            KvLayer::F16 { blocks, .. } => blocks.get(b).map_or(0.0, |x| x.v[at].to_f32()),
            KvLayer::BF16 { blocks, .. } => blocks.get(b).map_or(0.0, |x| x.v[at].to_f32()),
        }
    }
}

/// Bytes of KV cache one token of context takes across the model's
/// attention layers, stored as `ty`.
pub fn kv_bytes_per_token(hp: &HParams, ty: KvType) -> u64 {
    let el = ty.size() as u64;
    let layers = hp
        .layers
        .iter()
        .filter(|k| **k == LayerKind::Attention)
        .count() as u64;
    2 * layers * (hp.n_head_kv * hp.head_dim) as u64 * el
}

/// Bytes of recurrent state (conv and delta rule, f32) one sequence carries
/// whatever its length.
pub fn recurrent_bytes(hp: &HParams) -> u64 {
    let Some(s) = hp.ssm else { return 0 };
    let layers = hp
        .layers
        .iter()
        .filter(|k| **k == LayerKind::Linear)
        .count() as u64;
    let per = (s.d_conv - 1) * s.conv_dim() + s.n_v_heads * s.head_k_dim * s.head_v_dim;
    4 * layers * per as u64
}

/// Whether one layer's whole cache for a context of `ctx` (rows of `kvw`
/// values of `el` bytes) can be allocated: probed before a state is made
/// (blocks are allocated as the sequence grows), so an impossible context
/// is an error, not an abort.
fn fits(ctx: usize, kvw: usize, el: usize) -> bool {
    ctx.checked_mul(kvw * el)
        .is_some_and(|n| Vec::<u8>::new().try_reserve_exact(n).is_ok())
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
        if !fits(ctx, kvw, kv_type.size()) {
            return Err(crate::EngineError::Alloc {
                what: "KV cache",
                ctx,
                bytes: kv_bytes_per_token(hp, kv_type) as u128 * ctx as u128,
            });
        }
        let kv = hp
            .layers
            .iter()
            .map(|k| (*k == LayerKind::Attention).then(|| KvLayer::new(kv_type, kvw)))
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

    /// A copy at the same position with a context of `ctx` tokens: the KV
    /// blocks shared copy-on-write (see [`KvLayer::write`]), the recurrent
    /// states copied. Errors when `ctx` is below the position or cannot be
    /// allocated.
    pub fn fork(&self, ctx: usize) -> crate::Result<Self> {
        if ctx < self.pos {
            return Err(crate::EngineError::ContextFull { pos: self.pos, ctx });
        }
        let layers: Vec<&KvLayer> = self.kv.iter().flatten().collect();
        if let Some(kv) = layers.first() {
            let el = kv.kv_type().size();
            if !fits(ctx, kv.width(), el) {
                return Err(crate::EngineError::Alloc {
                    what: "KV cache",
                    ctx,
                    bytes: (layers.len() * 2 * kv.width() * el) as u128 * ctx as u128,
                });
            }
        }
        Ok(SeqState {
            pos: self.pos,
            ctx,
            kv: self.kv.clone(),
            linear: self.linear.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_never_written_read_as_zero() {
        for ty in [KvType::F32, KvType::F16, KvType::BF16] {
            let mut kv = KvLayer::new(ty, 4);
            // An empty cache (a layer no call has reached yet) reads zero.
            assert_eq!(kv.k_at(KV_BLOCK + 3, 4, 1), 0.0);
            assert_eq!(kv.v_at(0, 4, 0), 0.0);
            kv.write(1, 4, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
            assert_eq!(kv.k_at(1, 4, 2), 3.0);
            assert_eq!(kv.v_at(1, 4, 3), 8.0);
            assert_eq!(kv.k_at(0, 4, 0), 0.0);
            // Past the last allocated block: zero, not a panic.
            assert_eq!(kv.k_at(3 * KV_BLOCK, 4, 0), 0.0);
        }
    }
}
