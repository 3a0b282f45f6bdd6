//! `samesum inspect`: architecture, key hyperparameters, bytes by type, tensor list.

use anyhow::{Context, Result};
use samesum_gguf::{GgufFile, Value};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Arguments of `samesum inspect`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// GGUF file (default: the built-in tiny synthetic model, made on the fly).
    file: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Print every metadata key (arrays abbreviated).
    #[arg(long)]
    all_metadata: bool,
    /// Also plan the CUDA backend's tier mode for this VRAM budget (e.g.
    /// 24G): the trunk, the expert slots per layer, the staging buffers; an
    /// error (non-zero exit) naming the sizes when the budget is too small.
    #[arg(long, value_name = "BYTES")]
    vram_budget: Option<String>,
    /// Plan expert parallelism over this many GPUs of --vram-budget each
    /// instead: the trunk replicated on every GPU, the routed experts split
    /// in contiguous slices; an error naming the sizes when the model does
    /// not fit across them. (A plan only: running over several GPUs is not
    /// implemented yet.)
    #[arg(long, value_name = "N", requires = "vram_budget", value_parser = clap::value_parser!(u32).range(1..=64))]
    gpus: Option<u32>,
}

/// An expert-parallel placement and the sizes it was made from.
struct EpPlan {
    sizes: samesum_cuda::tier::TierSizes,
    budget: u64,
    placement: samesum_engine::ep::Placement,
}

/// Expert parallelism over `gpus` GPUs of `budget` each: every GPU keeps the
/// trunk and the reserve, and a slice of every layer's routed experts.
fn ep_plan(path: &std::path::Path, budget: &str, gpus: u32) -> Result<EpPlan> {
    let bytes = samesum_cuda::tier::parse_bytes(budget)
        .map_err(|e| anyhow::anyhow!("--vram-budget {e}"))?;
    let model = samesum_engine::Model::load(path)?;
    let sizes = samesum_cuda::tier::TierSizes::of(&model);
    let fixed = sizes.trunk + samesum_cuda::tier::RESERVE;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    if bytes < fixed {
        anyhow::bail!(
            "--vram-budget {budget} ({:.0} MiB) is below what every GPU keeps: the trunk ({:.0} MiB) and {:.0} MiB for the KV cache and activations",
            mib(bytes),
            mib(sizes.trunk),
            mib(samesum_cuda::tier::RESERVE)
        );
    }
    samesum_engine::ep::Placement::even(sizes.experts, gpus as usize)?;
    let per_expert = sizes.expert * sizes.layers as u64;
    let free = vec![bytes - fixed; gpus as usize];
    let placement = samesum_engine::ep::Placement::fitting(sizes.experts, per_expert, &free)
        .with_context(|| {
            format!(
                "the model ({:.2} MiB) does not fit on {gpus} GPUs of {budget}: each keeps the trunk ({:.2} MiB) and {:.0} MiB reserve, leaving {:.2} MiB for experts of {:.2} MiB each (all {} layers)",
                mib(sizes.total()),
                mib(sizes.trunk),
                mib(samesum_cuda::tier::RESERVE),
                mib(bytes - fixed),
                mib(per_expert),
                sizes.layers
            )
        })?;
    Ok(EpPlan {
        sizes,
        budget: bytes,
        placement,
    })
}

/// The tier plan for `budget`, or the reason there is none.
fn tier_plan(path: &std::path::Path, budget: &str) -> Result<samesum_cuda::tier::TierPlan> {
    let bytes = samesum_cuda::tier::parse_bytes(budget)
        .map_err(|e| anyhow::anyhow!("--vram-budget {e}"))?;
    let model = samesum_engine::Model::load(path)?;
    let sizes = samesum_cuda::tier::TierSizes::of(&model);
    Ok(samesum_cuda::tier::plan(
        sizes,
        bytes,
        samesum_cuda::tier::RESERVE,
    )?)
}

const HPARAMS: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.dimension_sections",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "full_attention_interval",
    "nextn_predict_layers",
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
];

fn to_json(v: &Value) -> serde_json::Value {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F32(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Bool(x) => json!(x),
        Value::String(s) => json!(s),
        Value::Array(a) if a.items.len() > 16 => {
            json!({"type": format!("array[{}]", a.elem_type), "len": a.items.len()})
        }
        Value::Array(a) => serde_json::Value::Array(a.items.iter().map(to_json).collect()),
    }
}

pub(crate) fn run(a: Args) -> Result<()> {
    let _tmp;
    let path = match a.file {
        Some(p) => p,
        None => {
            let dir = tempfile::tempdir().context("creating a temporary directory")?;
            let p = dir.path().join("tiny-qwen3moe.gguf");
            eprintln!("(no FILE given: inspecting the built-in tiny-qwen3moe synthetic model)");
            let opts = crate::synth::options("tiny-qwen3moe", "q8_0", None, 0)?;
            crate::synth::write(&opts, &p)?;
            _tmp = dir;
            p
        }
    };
    let f = GgufFile::open(&path)?;
    let m = f.metadata();
    let arch = m
        .get_str("general.architecture")
        .unwrap_or("(none)")
        .to_string();
    let mut hparams = BTreeMap::new();
    for k in HPARAMS {
        if let Some(v) = m.get(&format!("{arch}.{k}")) {
            hparams.insert(k.to_string(), v.clone());
        }
    }
    let mut by_type: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in f.tensors() {
        let e = by_type.entry(t.ggml_type.name().to_string()).or_default();
        e.0 += 1;
        e.1 += t.size;
    }
    let total: u64 = f.tensors().iter().map(|t| t.size).sum();
    let n_params: u64 = f.tensors().iter().map(|t| t.n_elements()).sum();
    let vocab = m
        .get_array("tokenizer.ggml.tokens")
        .map(|a| a.items.len())
        .ok();
    let (plan, ep) = match (&a.vram_budget, a.gpus) {
        (Some(b), Some(n)) => (None, Some(ep_plan(&path, b, n)?)),
        (Some(b), None) => (Some(tier_plan(&path, b)?), None),
        _ => (None, None),
    };
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    // Memory per token of context, where the hyperparameters parse.
    let hp = samesum_engine::HParams::from_metadata(m, f.tensors().len()).ok();
    let context = hp.as_ref().map(|hp| {
        use samesum_engine::state::{kv_bytes_per_token, recurrent_bytes};
        (
            hp.n_ctx_train as u64,
            kv_bytes_per_token(hp, samesum_engine::KvType::F16),
            kv_bytes_per_token(hp, samesum_engine::KvType::F32),
            recurrent_bytes(hp),
            hp.rope_scaling,
        )
    });
    if a.json {
        let out = json!({
            "file": path.display().to_string(),
            "version": f.header().version,
            "files": f.paths().iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "shards": f.shard_count(),
            "architecture": arch,
            "name": m.get_str("general.name").ok(),
            "hparams": hparams.iter().map(|(k, v)| (k.clone(), to_json(v))).collect::<serde_json::Map<_, _>>(),
            "vocab_size": vocab,
            "tokenizer": {
                "model": m.get_str("tokenizer.ggml.model").ok(),
                "pre": m.get_str("tokenizer.ggml.pre").ok(),
            },
            "alignment": f.header().alignment,
            "tensor_count": f.tensors().len(),
            "parameters": n_params,
            "tensor_bytes": total,
            "by_type": by_type.iter().map(|(k, (n, b))| (k.clone(), json!({"tensors": n, "bytes": b}))).collect::<serde_json::Map<_, _>>(),
            "context": context.map(|(ctx, f16, f32, rec, scaling)| json!({
                "trained_tokens": ctx,
                "kv_bytes_per_token_f16": f16,
                "kv_bytes_per_token_f32": f32,
                "kv_bytes_at_trained_context_f16": f16 * ctx,
                "recurrent_state_bytes_per_sequence": rec,
                "rope_scaling": format!("{scaling:?}"),
            })),
            "tier_plan": plan.map(|p| json!({
                "trunk_bytes": p.sizes.trunk,
                "host_embedding_bytes": p.sizes.host,
                "expert_bytes": p.sizes.expert,
                "experts_per_layer": p.sizes.experts,
                "experts_used": p.sizes.used,
                "layers": p.sizes.layers,
                "slots_per_layer": p.slots,
                "staging_bytes": p.staging,
                "vram_bytes": p.vram,
            })),
            "expert_parallel_plan": ep.as_ref().map(|p| json!({
                "gpus": p.placement.ranks(),
                "cuda_devices_here": samesum_cuda::device_count(),
                "nccl_version_here": samesum_cuda::nccl_version(),
                "vram_budget_bytes": p.budget,
                "trunk_bytes_each": p.sizes.trunk,
                "reserve_bytes_each": samesum_cuda::tier::RESERVE,
                "host_embedding_bytes": p.sizes.host,
                "experts": (0..p.placement.ranks()).map(|r| {
                    let e = p.placement.experts(r);
                    json!({"first": e.start, "end": e.end,
                           "bytes": e.len() as u64 * p.sizes.expert * p.sizes.layers as u64})
                }).collect::<Vec<_>>(),
            })),
            "metadata": if a.all_metadata { Some(m.iter().map(|(k, v)| (k.to_string(), to_json(v))).collect::<serde_json::Map<_, _>>()) } else { None },
            "tensors": f.tensors().iter().map(|t| json!({
                "name": t.name, "dims": t.dims, "type": t.ggml_type.name(), "offset": t.offset, "bytes": t.size,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("file:          {}", path.display());
    println!("gguf version:  {}", f.header().version);
    if f.shard_count() > 1 {
        println!(
            "split:         {} shards ({} .. {})",
            f.shard_count(),
            f.paths()[0].display(),
            f.paths()[f.shard_count() - 1].display()
        );
    }
    println!("architecture:  {arch}");
    if let Ok(n) = m.get_str("general.name") {
        println!("name:          {n}");
    }
    println!(
        "tokenizer:     {} / {} ({} tokens)",
        m.get_str("tokenizer.ggml.model").unwrap_or("-"),
        m.get_str("tokenizer.ggml.pre").unwrap_or("-"),
        vocab.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
    );
    println!("hyperparameters:");
    for (k, v) in &hparams {
        println!("  {k:<36} {v}");
    }
    println!(
        "tensors:       {} ({:.2}M parameters, {:.2} MiB)",
        f.tensors().len(),
        n_params as f64 / 1e6,
        total as f64 / (1 << 20) as f64
    );
    println!("by type:");
    for (ty, (n, b)) in &by_type {
        println!(
            "  {ty:<8} {n:>6} tensors {:>12.2} MiB",
            *b as f64 / (1 << 20) as f64
        );
    }
    if let Some((ctx, f16, f32, rec, scaling)) = context {
        println!("context memory (one sequence):");
        println!(
            "  KV cache per token       {:>12.1} KiB f16, {:.1} KiB f32",
            f16 as f64 / 1024.0,
            f32 as f64 / 1024.0
        );
        println!(
            "  at the trained context   {:>12.1} MiB f16 ({ctx} tokens), {:.1} MiB f32",
            mib(f16 * ctx),
            mib(f32 * ctx)
        );
        if rec > 0 {
            println!(
                "  recurrent state          {:>12.2} MiB (any length)",
                mib(rec)
            );
        }
        if scaling != samesum_engine::model::RopeScaling::None {
            println!("  rope scaling             {scaling:?}");
        }
    }
    if let Some(p) = plan {
        let z = p.sizes;
        println!(
            "tier plan (--vram-budget {}):",
            a.vram_budget.as_deref().unwrap_or("")
        );
        println!("  trunk in VRAM            {:>12.2} MiB", mib(z.trunk));
        println!("  token embedding in host  {:>12.2} MiB", mib(z.host));
        println!(
            "  routed experts in host   {:>12.2} MiB ({} layers x {} experts x {:.2} MiB)",
            mib(z.layer_experts() * z.layers as u64),
            z.layers,
            z.experts,
            mib(z.expert)
        );
        println!(
            "  decode cache             {:>12} slots per layer ({} routed per token)",
            p.slots, z.used
        );
        println!(
            "  prefill staging          {:>12.2} MiB (two layers)",
            mib(p.staging)
        );
        println!(
            "  VRAM for weights         {:>12.2} MiB (+ {:.0} MiB kept for the KV cache and activations)",
            mib(p.vram),
            mib(samesum_cuda::tier::RESERVE)
        );
    }
    if let Some(p) = &ep {
        let z = p.sizes;
        println!(
            "expert parallelism over {} GPUs (--vram-budget {} each):",
            p.placement.ranks(),
            a.vram_budget.as_deref().unwrap_or("")
        );
        println!(
            "  on every GPU             {:>12.2} MiB trunk + {:.0} MiB for the KV cache and activations",
            mib(z.trunk),
            mib(samesum_cuda::tier::RESERVE)
        );
        println!("  token embedding in host  {:>12.2} MiB", mib(z.host));
        let nccl = samesum_cuda::nccl_version().map_or("not found".to_string(), |v| {
            format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
        });
        println!(
            "  this host                {:>12} CUDA devices, NCCL {nccl} (running over several GPUs is not implemented yet)",
            samesum_cuda::device_count()
        );
        for r in 0..p.placement.ranks() {
            let e = p.placement.experts(r);
            let bytes = e.len() as u64 * z.expert * z.layers as u64;
            println!(
                "  GPU {r:<3} experts {:>5}..{:<5} {:>9.2} MiB routed ({} of {} a layer, {} layers); {:.2} of {:.2} MiB",
                e.start,
                e.end,
                mib(bytes),
                e.len(),
                z.experts,
                z.layers,
                mib(z.trunk + samesum_cuda::tier::RESERVE + bytes),
                mib(p.budget)
            );
        }
    }
    if a.all_metadata {
        println!("metadata:");
        for (k, v) in m.iter() {
            println!("  {k:<48} {v}");
        }
    }
    println!("tensor list:");
    for t in f.tensors() {
        let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
        println!(
            "  {:<40} {:<8} {:>24} {:>12} bytes",
            t.name,
            t.ggml_type.name(),
            dims.join(" x "),
            t.size
        );
    }
    Ok(())
}
