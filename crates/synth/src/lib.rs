//! Synthetic models: random weights at the exact tensor names, shapes and metadata
//! llama.cpp's converter writes for Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE, with a
//! working byte-level BPE vocabulary, streamed to disk and deterministic per seed.
//!
//! ```no_run
//! use samesum_synth::{shapes, write_model, SynthOptions};
//! use samesum_gguf::GgmlType;
//! let opts = SynthOptions::new(shapes::by_name("tiny-qwen3next").unwrap(), GgmlType::Q8_0, 1);
//! let summary = write_model(&opts, "tiny.gguf".as_ref(), &mut |_done, _total| {}).unwrap();
//! println!("{} tensors, {} bytes", summary.tensors, summary.bytes);
//! ```
//!
//! With a [`mix::Mix`] each tensor gets the type a real quantized file of that
//! kind gives it (llama-quantize's rules), instead of one type throughout.

pub mod fill;
pub mod mix;
pub mod plan;
pub mod shapes;
pub mod vocab;

use mix::Mix;
use samesum_gguf::{GgmlType, GgufError, GgufWriter, Value, ValueType};
use samesum_quant::rng::Rng;
use shapes::{Arch, Shape};
use std::path::Path;

/// Errors while writing a synthetic model.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// The container layer failed (I/O, layout).
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// An option is out of range.
    #[error("{0}")]
    Invalid(String),
}

/// Storage types `synth --quant` accepts (every weight format the CPU
/// runs).
pub const QUANT_CHOICES: &[GgmlType] = &[
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
    GgmlType::IQ3_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ2_S,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_XXS,
    GgmlType::BF16,
    GgmlType::F16,
    GgmlType::F32,
];

/// What to write.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// The model shape.
    pub shape: Shape,
    /// Storage type of the weight matrices (one of [`QUANT_CHOICES`]), when
    /// no `mix` is set.
    pub quant: GgmlType,
    /// A per-tensor type layout; when set it decides every tensor's type and
    /// `quant` is not used.
    pub mix: Option<Mix>,
    /// Random seed.
    pub seed: u64,
    /// YaRN context scaling by this factor over the shape's context (which
    /// becomes `rope.scaling.original_context_length`), written as the HF
    /// converter writes a `rope_scaling` of type yarn.
    pub yarn: Option<f32>,
    /// The chat template written to `tokenizer.chat_template` (default:
    /// [`vocab::CHAT_TEMPLATE`], plain ChatML).
    pub chat_template: Option<String>,
    /// Write the model as split files (llama.cpp's `gguf-split` layout) of
    /// at most this many tensors each, named after the output path
    /// (`out.gguf` -> `out-00001-of-0000N.gguf`, ...).
    pub split_max_tensors: Option<usize>,
}

impl SynthOptions {
    /// Options for `shape`, stored as `quant`, from `seed`.
    pub fn new(shape: Shape, quant: GgmlType, seed: u64) -> Self {
        SynthOptions {
            shape,
            quant,
            mix: None,
            seed,
            yarn: None,
            chat_template: None,
            split_max_tensors: None,
        }
    }

    /// Write split files of at most `n` tensors each.
    pub fn with_split_max_tensors(mut self, n: usize) -> Self {
        self.split_max_tensors = Some(n);
        self
    }

    /// Declare YaRN scaling by `factor` (the context grows by as much).
    pub fn with_yarn(mut self, factor: f32) -> Self {
        self.yarn = Some(factor);
        self
    }

    /// Write `template` as the model's chat template (a real model's, to
    /// test what its template does with tools and reasoning).
    pub fn with_chat_template(mut self, template: impl Into<String>) -> Self {
        self.chat_template = Some(template.into());
        self
    }

    /// Store the tensors as `mix` lays them out instead of as one type.
    pub fn with_mix(mut self, mix: Mix) -> Self {
        self.mix = Some(mix);
        self
    }

    /// Override the number of trunk layers.
    pub fn with_layers(mut self, layers: u32) -> Self {
        self.shape.layers = layers;
        self
    }
}

/// What was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Number of tensors.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub bytes: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// The files written: the output path, or every shard in order.
    pub files: Vec<std::path::PathBuf>,
}

/// Where tensor data goes: one file, or a split model's shards.
enum Sink {
    One(samesum_gguf::DataWriter<'static>),
    Split(samesum_gguf::SplitWriter),
}

impl Sink {
    fn write_piece(&mut self, b: &[u8]) -> samesum_gguf::Result<()> {
        match self {
            Sink::One(w) => w.write_piece(b),
            Sink::Split(w) => w.write_piece(b),
        }
    }

    fn write_tensor(&mut self, name: &str, b: &[u8]) -> samesum_gguf::Result<()> {
        match self {
            Sink::One(w) => w.write_tensor(name, b),
            Sink::Split(w) => w.write_tensor(name, b),
        }
    }
}

/// llama.cpp's `general.file_type` for a model stored mostly as `ty`.
pub fn file_type(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q2_K => 10,
        GgmlType::Q3_K => 11,
        GgmlType::Q4_K => 15,
        GgmlType::Q5_K => 17,
        GgmlType::Q6_K => 18,
        GgmlType::IQ2_XXS => 19,
        GgmlType::IQ2_XS => 20,
        GgmlType::IQ3_XXS => 23,
        GgmlType::IQ4_NL => 25,
        GgmlType::IQ3_S => 26,
        GgmlType::IQ2_S => 28,
        GgmlType::IQ4_XS => 30,
        GgmlType::BF16 => 32,
        GgmlType::MXFP4 => 38,
        _ => 0,
    }
}

/// The tensor list of `opts` (names, dims, types, fills), checked.
pub fn tensor_plan(opts: &SynthOptions) -> Result<Vec<plan::TensorPlan>, SynthError> {
    let s = &opts.shape;
    if opts.mix.is_none() && !QUANT_CHOICES.contains(&opts.quant) {
        return Err(SynthError::Invalid(format!(
            "--quant {} is not supported (choose one of: {})",
            opts.quant,
            QUANT_CHOICES
                .iter()
                .map(|t| t.name().to_lowercase())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    if s.layers == 0 || s.layers > 1024 {
        return Err(SynthError::Invalid(format!(
            "--layers {} is out of range (1..=1024)",
            s.layers
        )));
    }
    let vocab_size = s.vocab.unwrap_or(vocab::TINY_VOCAB) as u64;
    Ok(match opts.mix {
        None => plan::tensors(s, vocab_size, opts.quant),
        Some(m) => {
            // The converter's output (matrices in a float type, F32 here), then
            // the types llama-quantize would give it.
            let mut p = plan::tensors(s, vocab_size, GgmlType::F32);
            mix::apply(s, m, &mut p)?;
            p
        }
    })
}

/// Build the writer (metadata + tensor directory) for `opts`.
pub fn describe(opts: &SynthOptions) -> Result<(GgufWriter, Vec<plan::TensorPlan>), SynthError> {
    let plan = tensor_plan(opts)?;
    let s = &opts.shape;
    let vocab_size = s.vocab.unwrap_or(vocab::TINY_VOCAB);
    let v = vocab::build(vocab_size);
    let a = s.arch.gguf_name();
    let k = |key: &str| format!("{a}.{key}");
    let mut w = GgufWriter::new();
    w.set("general.architecture", a);
    w.set("general.type", "model");
    w.set(
        "general.name",
        format!("samesum synthetic {} (seed {})", s.name, opts.seed),
    );
    let ftype = opts.mix.map_or(file_type(opts.quant), Mix::file_type);
    w.set("general.file_type", ftype);
    if plan.iter().any(|t| t.ty.block_size() > 1) {
        w.set("general.quantization_version", 2u32);
    }
    w.set(k("block_count"), s.layers);
    match opts.yarn {
        Some(factor) => {
            w.set(
                k("context_length"),
                (s.context as f64 * factor as f64) as u32,
            );
            w.set(k("rope.scaling.type"), "yarn");
            w.set(k("rope.scaling.factor"), factor);
            w.set(k("rope.scaling.original_context_length"), s.context);
        }
        None => w.set(k("context_length"), s.context),
    }
    w.set(k("embedding_length"), s.hidden);
    if let Some(ff) = s.ff {
        w.set(k("feed_forward_length"), ff);
    }
    w.set(k("attention.head_count"), s.heads);
    w.set(k("attention.head_count_kv"), s.kv_heads);
    w.set(k("rope.freq_base"), s.rope_theta);
    w.set(k("attention.layer_norm_rms_epsilon"), s.eps);
    w.set(k("expert_used_count"), s.experts_used);
    w.set(k("attention.key_length"), s.head_dim);
    w.set(k("attention.value_length"), s.head_dim);
    w.set(k("expert_count"), s.experts);
    w.set(k("expert_feed_forward_length"), s.expert_ff);
    if s.shared_ff > 0 {
        w.set(k("expert_shared_feed_forward_length"), s.shared_ff);
    }
    if let Some(r) = s.rope_dims {
        w.set(k("rope.dimension_count"), r);
    }
    if let Some(dn) = s.delta {
        w.set(k("ssm.conv_kernel"), dn.conv_kernel);
        w.set(k("ssm.state_size"), dn.key_head_dim);
        w.set(k("ssm.group_count"), dn.key_heads);
        w.set(k("ssm.time_step_rank"), dn.value_heads);
        w.set(k("ssm.inner_size"), dn.inner_size() as u32);
        w.set(k("full_attention_interval"), s.full_attention_interval);
    }
    if s.arch == Arch::Qwen35Moe {
        let r = s.rope_dims.unwrap_or(s.head_dim) / 2;
        let (t, h) = (r - 2 * (r / 3), r / 3);
        let sections = [t as i32, h as i32, (r - t - h) as i32, 0];
        // [11, 11, 10, 0] for R = 64, as the converter writes.
        let sections = if r == 32 { [11, 11, 10, 0] } else { sections };
        w.set(
            k("rope.dimension_sections"),
            Value::array(
                ValueType::I32,
                sections.iter().map(|&x| Value::I32(x)).collect(),
            ),
        );
    }
    w.set("tokenizer.ggml.model", "gpt2");
    w.set(
        "tokenizer.ggml.pre",
        if s.arch == Arch::Qwen35Moe {
            "qwen35"
        } else {
            "qwen2"
        },
    );
    w.set(
        "tokenizer.ggml.tokens",
        Value::string_array(v.tokens.iter().cloned()),
    );
    w.set(
        "tokenizer.ggml.token_type",
        Value::array(
            ValueType::I32,
            v.types.iter().map(|&t| Value::I32(t)).collect(),
        ),
    );
    w.set(
        "tokenizer.ggml.merges",
        Value::string_array(v.merges.iter().cloned()),
    );
    w.set("tokenizer.ggml.eos_token_id", v.im_end);
    w.set("tokenizer.ggml.padding_token_id", v.eot);
    w.set("tokenizer.ggml.bos_token_id", v.eot);
    w.set("tokenizer.ggml.add_bos_token", false);
    w.set(
        "tokenizer.chat_template",
        opts.chat_template
            .as_deref()
            .unwrap_or(vocab::CHAT_TEMPLATE),
    );

    for t in &plan {
        w.add_tensor(t.name.clone(), &t.dims, t.ty)?;
    }
    Ok((w, plan))
}

/// Write the model to `path`, calling `progress(bytes_done, bytes_total)` as it goes.
/// The file appears only when complete.
pub fn write_model(
    opts: &SynthOptions,
    path: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Summary, SynthError> {
    let (w, plan) = describe(opts)?;
    let total: u64 = w.tensors().iter().map(|t| t.size).sum();
    let mut out = match opts.split_max_tensors {
        None => Sink::One(w.create(path)?),
        Some(n) => Sink::Split(samesum_gguf::SplitWriter::new(&w, path, n)?),
    };
    let mut done = 0u64;
    const PIECE: usize = 1 << 20;
    let mut buf = Vec::new();
    for (t, info) in plan.iter().zip(w.tensors()) {
        let mut rng = Rng::new(fill::tensor_seed(opts.seed, &t.name));
        let ts = t.ty.type_size();
        let per_piece = (PIECE / ts).max(1) * ts;
        let mut left = info.size as usize;
        while left > 0 {
            let n = left.min(per_piece);
            buf.resize(n, 0);
            fill::fill(&mut rng, t.ty, t.fill, &mut buf);
            out.write_piece(&buf)?;
            left -= n;
            done += n as u64;
            progress(done, total);
        }
        if info.size == 0 {
            out.write_tensor(&t.name, &[])?;
        }
    }
    let files = match out {
        Sink::One(w) => {
            w.finish()?;
            vec![path.to_path_buf()]
        }
        Sink::Split(w) => w.finish()?,
    };
    let vocab = opts.shape.vocab.unwrap_or(vocab::TINY_VOCAB) as u64;
    Ok(Summary {
        tensors: plan.len(),
        bytes: total,
        vocab,
        files,
    })
}
