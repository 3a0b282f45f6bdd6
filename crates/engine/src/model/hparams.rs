//! Hyperparameters from GGUF metadata, for the three supported architectures.

use crate::error::{EngineError, Result};
use samesum_gguf::Metadata;

/// A supported architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `qwen3moe`.
    Qwen3Moe,
    /// `qwen3next`.
    Qwen3Next,
    /// `qwen35moe`.
    Qwen35Moe,
}

/// The architectures samesum runs, by GGUF name.
pub const SUPPORTED: &[&str] = &["qwen3moe", "qwen3next", "qwen35moe"];

impl Arch {
    /// Parse a `general.architecture` value.
    pub fn from_gguf(name: &str) -> Result<Arch> {
        match name {
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "qwen3next" => Ok(Arch::Qwen3Next),
            "qwen35moe" => Ok(Arch::Qwen35Moe),
            other => Err(EngineError::UnsupportedArch {
                found: other.to_string(),
                supported: SUPPORTED.join(", "),
            }),
        }
    }

    /// The GGUF name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen3Next => "qwen3next",
            Arch::Qwen35Moe => "qwen35moe",
        }
    }

    /// Hybrid (gated delta net + gated attention, shared expert) architectures.
    pub fn is_hybrid(self) -> bool {
        !matches!(self, Arch::Qwen3Moe)
    }
}

/// What a layer's token mixer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Full (softmax) attention with a KV cache.
    Attention,
    /// Gated delta net (linear attention) with conv and recurrent state.
    Linear,
}

/// Gated delta-net sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ssm {
    /// Conv kernel Kc.
    pub d_conv: usize,
    /// Key head dim dk (`ssm.state_size`).
    pub head_k_dim: usize,
    /// Key heads Hk (`ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads Hv (`ssm.time_step_rank`).
    pub n_v_heads: usize,
    /// Value head dim dv (`ssm.inner_size / time_step_rank`).
    pub head_v_dim: usize,
}

impl Ssm {
    /// Hk * dk.
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_k_dim
    }
    /// Hv * dv.
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_v_dim
    }
    /// Conv channels: 2 key_dim + value_dim.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// Every hyperparameter the forward pass needs.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    /// Architecture.
    pub arch: Arch,
    /// Trunk layers (block_count - nextn_predict_layers).
    pub n_layer: usize,
    /// Hidden size D.
    pub n_embd: usize,
    /// Attention heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Attention head dim (key_length).
    pub head_dim: usize,
    /// Rotary dims.
    pub n_rot: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE context scaling (`rope.scaling.*`).
    pub rope_scaling: super::RopeScaling,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Training context length.
    pub n_ctx_train: usize,
    /// Experts.
    pub n_expert: usize,
    /// Experts per token.
    pub n_expert_used: usize,
    /// Expert FFN width.
    pub n_ff_exp: usize,
    /// Shared expert FFN width (0: none).
    pub n_ff_shexp: usize,
    /// Delta-net sizes (hybrid architectures).
    pub ssm: Option<Ssm>,
    /// Mixer of each trunk layer.
    pub layers: Vec<LayerKind>,
}

/// The largest value a size key may hold (the context length excepted):
/// with every dimension at most 2^20, each product of three that the
/// weights are bound with fits in 64 bits.
const MAX_DIM: u64 = 1 << 20;

fn uint(m: &Metadata, key: &str) -> Result<usize> {
    let v = m.get_uint(key)?;
    if v > MAX_DIM && !key.ends_with("context_length") {
        return Err(EngineError::BadHParam(format!(
            "{key} = {v}, larger than any model's (at most {MAX_DIM})"
        )));
    }
    Ok(v as usize)
}

fn uint_or(m: &Metadata, key: &str, default: usize) -> Result<usize> {
    match m.get(key) {
        None => Ok(default),
        Some(_) => uint(m, key),
    }
}

impl HParams {
    /// The rotary embedding of the attention layers.
    pub fn rope(&self) -> super::Rope {
        super::Rope::new(self.n_rot, self.rope_theta, self.rope_scaling)
    }

    /// Read the hyperparameters of a GGUF file's metadata; `n_tensors`, the
    /// tensors the file holds, bounds the layer count (every layer has
    /// tensors of its own), so a corrupt count fails here, before anything
    /// is sized by it.
    pub fn from_metadata(m: &Metadata, n_tensors: usize) -> Result<HParams> {
        let arch = Arch::from_gguf(m.get_str("general.architecture")?)?;
        let a = arch.name();
        let k = |s: &str| format!("{a}.{s}");
        // Bounded by the tensors the file holds (with its own message).
        let block_count = usize::try_from(m.get_uint(&k("block_count"))?).unwrap_or(usize::MAX);
        if block_count > n_tensors {
            return Err(EngineError::BadHParam(format!(
                "{a}.block_count {block_count} is more than the {n_tensors} tensors the file holds (every layer has its own)"
            )));
        }
        let nextn = uint_or(m, &k("nextn_predict_layers"), 0)?;
        let n_layer = block_count
            .checked_sub(nextn)
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                EngineError::BadHParam(format!(
                    "{a}.block_count {block_count} leaves no trunk layer after {nextn} nextn layers"
                ))
            })?;
        let n_embd = uint(m, &k("embedding_length"))?;
        let n_head = uint(m, &k("attention.head_count"))?;
        let n_head_kv = uint_or(m, &k("attention.head_count_kv"), n_head)?;
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(EngineError::BadHParam(format!(
                "head_count {n_head} is not a positive multiple of head_count_kv {n_head_kv}"
            )));
        }
        let head_dim = uint_or(m, &k("attention.key_length"), n_embd / n_head)?;
        let v_len = uint_or(m, &k("attention.value_length"), head_dim)?;
        if v_len != head_dim {
            return Err(EngineError::BadHParam(format!(
                "attention.value_length {v_len} differs from key_length {head_dim}"
            )));
        }
        let n_rot = uint_or(m, &k("rope.dimension_count"), head_dim)?;
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(EngineError::BadHParam(format!(
                "rope.dimension_count {n_rot} must be even and at most key_length {head_dim}"
            )));
        }
        let rope_theta = match m.get(&k("rope.freq_base")) {
            None => 10_000.0,
            Some(_) => m.get_float(&k("rope.freq_base"))? as f32,
        };
        let eps = m.get_float(&k("attention.layer_norm_rms_epsilon"))? as f32;
        if !(eps.is_finite() && eps > 0.0 && rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(EngineError::BadHParam(format!(
                "layer_norm_rms_epsilon {eps} and rope.freq_base {rope_theta} must be finite and positive"
            )));
        }
        let n_ctx_train = uint_or(m, &k("context_length"), 4096)?;
        let rope_scaling = super::rope::scaling_from_metadata(m, a, n_ctx_train)?;
        let n_expert = uint(m, &k("expert_count"))?;
        let n_expert_used = uint(m, &k("expert_used_count"))?;
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(EngineError::BadHParam(format!(
                "expert_used_count {n_expert_used} must be in 1..={n_expert}"
            )));
        }
        let n_ff_exp = match m.get(&k("expert_feed_forward_length")) {
            Some(_) => uint(m, &k("expert_feed_forward_length"))?,
            None => uint(m, &k("feed_forward_length"))? / n_expert_used,
        };
        let n_ff_shexp = if arch.is_hybrid() {
            uint_or(m, &k("expert_shared_feed_forward_length"), 0)?
        } else {
            0
        };
        let (ssm, layers) = if arch.is_hybrid() {
            let n_v_heads = uint(m, &k("ssm.time_step_rank"))?;
            let inner = uint(m, &k("ssm.inner_size"))?;
            let ssm = Ssm {
                d_conv: uint(m, &k("ssm.conv_kernel"))?,
                head_k_dim: uint(m, &k("ssm.state_size"))?,
                n_k_heads: uint(m, &k("ssm.group_count"))?,
                n_v_heads,
                head_v_dim: inner.checked_div(n_v_heads).unwrap_or(0),
            };
            if ssm.n_k_heads == 0
                || !ssm.n_v_heads.is_multiple_of(ssm.n_k_heads)
                || ssm.head_v_dim * n_v_heads != inner
                || ssm.d_conv == 0
                || ssm.head_v_dim > 512
            {
                return Err(EngineError::BadHParam(format!(
                    "delta-net sizes are inconsistent: {ssm:?} with inner_size {inner}"
                )));
            }
            let layers = match m.get(&k("attention.recurrent_layers")) {
                Some(_) => {
                    let r = m.get_bool_array(&k("attention.recurrent_layers"))?;
                    if r.len() < n_layer {
                        return Err(EngineError::BadHParam(format!(
                            "attention.recurrent_layers has {} entries for {n_layer} layers",
                            r.len()
                        )));
                    }
                    r[..n_layer]
                        .iter()
                        .map(|&rec| {
                            if rec {
                                LayerKind::Linear
                            } else {
                                LayerKind::Attention
                            }
                        })
                        .collect()
                }
                None => {
                    let interval = uint_or(m, &k("full_attention_interval"), 4)?.max(1);
                    (0..n_layer)
                        .map(|l| {
                            if (l + 1) % interval == 0 {
                                LayerKind::Attention
                            } else {
                                LayerKind::Linear
                            }
                        })
                        .collect()
                }
            };
            (Some(ssm), layers)
        } else {
            (None, vec![LayerKind::Attention; n_layer])
        };
        Ok(HParams {
            arch,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_theta,
            rope_scaling,
            eps,
            n_ctx_train,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
            ssm,
            layers,
        })
    }
}
