//! Model shapes: the hyperparameters of real checkpoints and of tiny test models.
//!
//! Real shapes are taken from the models' published configs (see
//! `../shared/reference/architectures.md`); `qwen35moe-122b-a10b` follows the
//! published Qwen3.5-122B-A10B config as recalled, not re-verified here (see
//! docs/DESIGN.md). Tiny shapes keep every structural feature (GQA, partial RoPE,
//! shared experts, 2 value heads per key head in the delta net) at sizes whose
//! matrix rows are multiples of 256, so K-quants apply to every weight.

/// A supported architecture, by its GGUF `general.architecture` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `qwen3moe`: full attention in every layer, routed experts only.
    Qwen3Moe,
    /// `qwen3next`: gated delta net + gated attention every 4th layer, shared expert.
    Qwen3Next,
    /// `qwen35moe`: as qwen3next with separate alpha/beta projections and IMRoPE.
    Qwen35Moe,
}

impl Arch {
    /// The GGUF architecture string.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen3Next => "qwen3next",
            Arch::Qwen35Moe => "qwen35moe",
        }
    }

    /// Whether layers are hybrid (delta net + attention).
    pub fn is_hybrid(self) -> bool {
        !matches!(self, Arch::Qwen3Moe)
    }
}

/// Gated delta-net (linear attention) sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNet {
    /// Short causal conv kernel (`ssm.conv_kernel`).
    pub conv_kernel: u32,
    /// Key head dim dk (`ssm.state_size`); llama.cpp also uses it as dv.
    pub key_head_dim: u32,
    /// Key heads Hk (`ssm.group_count`).
    pub key_heads: u32,
    /// Value heads Hv (`ssm.time_step_rank`).
    pub value_heads: u32,
    /// Value head dim dv (`ssm.inner_size / time_step_rank`).
    pub value_head_dim: u32,
}

impl DeltaNet {
    /// `ssm.inner_size` = Hv * dv.
    pub fn inner_size(&self) -> u64 {
        self.value_heads as u64 * self.value_head_dim as u64
    }
    /// Channels of the short conv: 2 * Hk * dk + Hv * dv.
    pub fn conv_dim(&self) -> u64 {
        2 * (self.key_heads as u64 * self.key_head_dim as u64) + self.inner_size()
    }
}

/// Every hyperparameter a synthetic model needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Shape name (`qwen3moe-30b-a3b`, `tiny-qwen3next`, ...).
    pub name: &'static str,
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size (`None`: the size of the built-in tokenizer).
    pub vocab: Option<u32>,
    /// Hidden size D.
    pub hidden: u32,
    /// Trunk layers.
    pub layers: u32,
    /// Attention heads Hq.
    pub heads: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Attention head dim.
    pub head_dim: u32,
    /// Rotary dims (`None`: all of head_dim and the key is not written).
    pub rope_dims: Option<u32>,
    /// RoPE base.
    pub rope_theta: f32,
    /// Context length.
    pub context: u32,
    /// `feed_forward_length`, where the converter writes it.
    pub ff: Option<u32>,
    /// Experts E.
    pub experts: u32,
    /// Experts per token k.
    pub experts_used: u32,
    /// Expert FFN width F.
    pub expert_ff: u32,
    /// Shared expert FFN width (0: none).
    pub shared_ff: u32,
    /// Delta-net sizes, for hybrid architectures.
    pub delta: Option<DeltaNet>,
    /// Every `interval`-th layer is full attention (hybrid architectures).
    pub full_attention_interval: u32,
    /// RMSNorm epsilon.
    pub eps: f32,
}

impl Shape {
    /// Whether layer `l` is full attention.
    pub fn is_full_attention(&self, l: u32) -> bool {
        !self.arch.is_hybrid() || (l + 1).is_multiple_of(self.full_attention_interval)
    }
}

const QWEN3_VOCAB: u32 = 151_936;
const QWEN35_VOCAB: u32 = 248_320;

const QWEN_NEXT_DELTA: DeltaNet = DeltaNet {
    conv_kernel: 4,
    key_head_dim: 128,
    key_heads: 16,
    value_heads: 32,
    value_head_dim: 128,
};
const TINY_DELTA: DeltaNet = DeltaNet {
    conv_kernel: 4,
    key_head_dim: 64,
    key_heads: 2,
    value_heads: 4,
    value_head_dim: 64,
};

/// All shapes `synth` knows.
pub fn all() -> Vec<Shape> {
    let qwen3moe_30b = Shape {
        name: "qwen3moe-30b-a3b",
        arch: Arch::Qwen3Moe,
        vocab: Some(QWEN3_VOCAB),
        hidden: 2048,
        layers: 48,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        rope_dims: None,
        rope_theta: 1_000_000.0,
        context: 40_960,
        ff: Some(6144),
        experts: 128,
        experts_used: 8,
        expert_ff: 768,
        shared_ff: 0,
        delta: None,
        full_attention_interval: 1,
        eps: 1e-6,
    };
    let qwen3next_80b = Shape {
        name: "qwen3next-80b-a3b",
        arch: Arch::Qwen3Next,
        vocab: Some(QWEN3_VOCAB),
        hidden: 2048,
        layers: 48,
        heads: 16,
        kv_heads: 2,
        head_dim: 256,
        rope_dims: Some(64),
        rope_theta: 10_000_000.0,
        context: 262_144,
        ff: Some(5120),
        experts: 512,
        experts_used: 10,
        expert_ff: 512,
        shared_ff: 512,
        delta: Some(QWEN_NEXT_DELTA),
        full_attention_interval: 4,
        eps: 1e-6,
    };
    let qwen35_35b = Shape {
        name: "qwen35moe-35b-a3b",
        arch: Arch::Qwen35Moe,
        vocab: Some(QWEN35_VOCAB),
        layers: 40,
        experts: 256,
        experts_used: 8,
        ff: None,
        ..qwen3next_80b.clone()
    };
    let qwen35_122b = Shape {
        name: "qwen35moe-122b-a10b",
        hidden: 3072,
        layers: 48,
        heads: 32,
        expert_ff: 1024,
        shared_ff: 1024,
        delta: Some(DeltaNet {
            value_heads: 64,
            ..QWEN_NEXT_DELTA
        }),
        ..qwen35_35b.clone()
    };
    let tiny_qwen3moe = Shape {
        name: "tiny-qwen3moe",
        vocab: None,
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        context: 4096,
        ff: Some(512),
        experts: 8,
        experts_used: 2,
        expert_ff: 256,
        ..qwen3moe_30b.clone()
    };
    let tiny_qwen3next = Shape {
        name: "tiny-qwen3next",
        vocab: None,
        hidden: 256,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        rope_dims: Some(16),
        context: 4096,
        ff: Some(512),
        experts: 8,
        experts_used: 2,
        expert_ff: 256,
        shared_ff: 256,
        delta: Some(TINY_DELTA),
        ..qwen3next_80b.clone()
    };
    let tiny_qwen35moe = Shape {
        name: "tiny-qwen35moe",
        arch: Arch::Qwen35Moe,
        ff: None,
        ..tiny_qwen3next.clone()
    };
    vec![
        qwen3moe_30b,
        qwen3next_80b,
        qwen35_35b,
        qwen35_122b,
        tiny_qwen3moe,
        tiny_qwen3next,
        tiny_qwen35moe,
    ]
}

/// The shape named `name`.
pub fn by_name(name: &str) -> Option<Shape> {
    all().into_iter().find(|s| s.name == name)
}

/// The names of all shapes.
pub fn names() -> Vec<&'static str> {
    all().iter().map(|s| s.name).collect()
}
