//! `samesum identity`: the identity gate. Replay vs batched prefill on a prompt
//! set: logits bytes at every position, state after the prompt, greedy tokens.

use crate::device::Device;
use anyhow::{Context, Result, bail};
use samesum_engine::Backend;
use samesum_engine::cpu::Cpu;
use samesum_engine::identity::{batched, replay};
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{KvType, Model};
use samesum_quant::rng::Rng;
use std::path::PathBuf;
use std::time::Instant;

const DEFAULT_PROMPTS: &str = include_str!("../../../tests/identity/prompts.json");

/// Arguments of `samesum identity`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// GGUF model (default: a synthetic model of --shape, made on the fly).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Synthetic shape when no -m is given.
    #[arg(long, default_value = "tiny-qwen3next")]
    shape: String,
    /// Prompt set (JSON: [{"name", "text", "len"?} | {"name", "random", "seed"}]);
    /// default: the shipped set (tests/identity/prompts.json).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Only prompts of at most this many tokens.
    #[arg(long)]
    max_len: Option<usize>,
    /// Greedy tokens generated after each prompt, per arm.
    #[arg(long, default_value_t = 64)]
    r#gen: usize,
    /// Chunk sizes of the batched arm (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "256")]
    chunk: Vec<usize>,
    /// Thread counts (comma-separated; 0: all cores).
    #[arg(short = 't', long, value_delimiter = ',', default_value = "0")]
    threads: Vec<usize>,
    /// KV cache type: f32 or f16.
    #[arg(long, default_value = "f32")]
    kv_type: String,
    /// Backend: cpu, cuda or cuda:N (threads apply to the CPU only).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Tier mode within this VRAM budget (e.g. 24G): routed experts in host
    /// memory, a VRAM cache of them for decode, staged layers for prefill.
    /// Without it, tier mode starts by itself when the model does not fit.
    #[arg(long, value_name = "BYTES")]
    vram_budget: Option<String>,
    /// Attention passes on CUDA: `exact` (default) or `fast`, opt-in: tensor
    /// cores, not the same bytes as `exact`, batched still equal to replay
    /// (docs/CAPABILITIES.md: its agreement with `exact`).
    #[arg(long, value_enum, default_value_t = crate::device::Attention::Exact)]
    attention: crate::device::Attention,
    /// Run a deliberately reordered batched MoE (top-k summed in reverse) to show
    /// that the gate catches it; the command must then fail.
    #[arg(long, hide = true)]
    negative_control: bool,
}

#[derive(serde::Deserialize)]
struct PromptSpec {
    name: String,
    text: Option<String>,
    len: Option<usize>,
    random: Option<usize>,
    seed: Option<u64>,
}

fn tokens_of(spec: &PromptSpec, tok: &Tokenizer, vocab: usize) -> Result<Vec<u32>> {
    if let Some(n) = spec.random {
        let mut rng = Rng::new(spec.seed.unwrap_or(0));
        return Ok((0..n).map(|_| rng.below(vocab as u64) as u32).collect());
    }
    let text = spec
        .text
        .as_deref()
        .with_context(|| format!("prompt {:?} has neither text nor random", spec.name))?;
    let once = tok.encode(text)?;
    if once.is_empty() {
        bail!("prompt {:?} tokenizes to nothing", spec.name);
    }
    Ok(match spec.len {
        Some(n) => once.iter().copied().cycle().take(n).collect(),
        None => once,
    })
}

pub(crate) fn run(a: Args) -> Result<()> {
    let kv = match a.kv_type.as_str() {
        "f32" => KvType::F32,
        "f16" => KvType::F16,
        other => bail!("--kv-type {other:?} is not supported (f32, f16)"),
    };
    if a.chunk.contains(&0) {
        bail!("--chunk sizes must be at least 1");
    }
    let dev = Device::parse(&a.device, a.vram_budget.as_deref())?.with_attention(a.attention)?;
    if a.negative_control && dev != Device::Cpu {
        bail!("--negative-control runs on the CPU backend only");
    }
    let (path, _tmp) = crate::synth::model_or_builtin(&a.model, &a.shape, "q4_k", None)?;
    let model = Model::load(&path)?;
    let tok = Tokenizer::from_metadata(model.file.metadata())?;
    let json = match &a.prompts {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
        }
        None => DEFAULT_PROMPTS.to_string(),
    };
    let specs: Vec<PromptSpec> = serde_json::from_str(&json).context("parsing the prompt set")?;
    let mut prompts = Vec::new();
    for s in &specs {
        let t = tokens_of(s, &tok, model.w.n_vocab)?;
        if a.max_len.is_none_or(|m| t.len() <= m) {
            prompts.push((s.name.clone(), t));
        }
    }
    if prompts.is_empty() {
        bail!("no prompts to run");
    }
    println!(
        "identity gate: {} ({}), {} prompts, chunks {:?}, threads {:?}, {} greedy tokens, kv {}",
        path.display(),
        model.hp.arch.name(),
        prompts.len(),
        a.chunk,
        a.threads,
        a.r#gen,
        a.kv_type
    );
    println!(
        "| prompt | tokens | chunk | threads | rows batched | logits | state | gen | verdict |"
    );
    println!("|---|---:|---:|---:|---:|---|---|---|---|");
    let t0 = Instant::now();
    let (mut failed, mut void) = (0, 0);
    let runs = match dev {
        Device::Cpu => {
            for &threads in &a.threads {
                let cpu = Cpu::new(threads);
                let cpu_batched = if a.negative_control {
                    Cpu::new(threads).with_reversed_topk()
                } else {
                    Cpu::new(threads)
                };
                let label = cpu.threads().to_string();
                let (f, v) = gate(&cpu, &cpu_batched, &label, &model, &prompts, &a, kv)?;
                failed += f;
                void += v;
            }
            a.threads.len()
        }
        Device::Cuda(n, budget) => {
            let cuda = crate::device::cuda(n, budget, &model)?;
            let (f, v) = gate(&cuda, &cuda, "gpu", &model, &prompts, &a, kv)?;
            failed += f;
            void += v;
            1
        }
    };
    let n = prompts.len() * a.chunk.len() * runs;
    println!(
        "\n{} of {n} runs equal, {failed} different, {void} void, in {:.1}s",
        n - failed - void,
        t0.elapsed().as_secs_f64()
    );
    if failed > 0 || void > 0 {
        bail!("identity gate failed: {failed} different, {void} void");
    }
    Ok(())
}

/// Both arms on every prompt and chunk size: (different, void) counts.
fn gate<B: Backend>(
    b: &B,
    b_batched: &B,
    label: &str,
    model: &Model,
    prompts: &[(String, Vec<u32>)],
    a: &Args,
    kv: KvType,
) -> Result<(usize, usize)> {
    let (mut failed, mut void) = (0, 0);
    {
        for (name, p) in prompts {
            let r = replay(b, model, p, a.r#gen, kv)?;
            for &c in &a.chunk {
                let v = batched(b_batched, model, p, c, a.r#gen, kv, &r)?;
                let logits = match v.logits_diff {
                    None => "equal".to_string(),
                    Some((pos, d)) => format!("DIFFER at {pos} (max |diff| {d:.3e})"),
                };
                let gen_s = match v.gen_diff {
                    None => format!("equal ({})", v.generated),
                    Some(s) => format!("DIFFER at step {s}"),
                };
                let verdict = if !v.valid() {
                    void += 1;
                    "VOID"
                } else if v.equal() {
                    "equal"
                } else {
                    failed += 1;
                    "DIFFERENT"
                };
                println!(
                    "| {name} | {} | {c} | {label} | {} | {logits} | {} | {gen_s} | {verdict} |",
                    v.len,
                    v.rows_batched,
                    if v.state_equal { "equal" } else { "DIFFER" },
                );
            }
        }
    }
    Ok((failed, void))
}
