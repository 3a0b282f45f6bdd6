//! `samesum identity`: the identity gate. Replay vs batched prefill on a prompt
//! set: logits bytes at every position, state after the prompt, greedy tokens.

use crate::args::{BackendArgs, KvArgs, ModelArgs, ShapeArgs, at_least_one};
use crate::backend::{AnyBackend, Device};
use crate::with_backend;
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
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    shape: ShapeArgs,
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
    #[arg(long, value_delimiter = ',', default_value = "256", value_parser = at_least_one)]
    chunk: Vec<usize>,
    /// CPU thread counts, one run each (comma-separated; 0: all cores).
    #[arg(short = 't', long, value_delimiter = ',', default_value = "0")]
    threads: Vec<usize>,
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    backend: BackendArgs,
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
    let dev = a.backend.device(0)?;
    let kv = a.kv.kv(&dev)?;
    let (path, _tmp) = a.model.path_or_synth(&a.shape.shape, "q4_k", None)?;
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
        crate::args::kv_name(kv)
    );
    println!(
        "| prompt | tokens | chunk | threads | rows batched | logits | state | gen | verdict |"
    );
    println!("|---|---:|---:|---:|---:|---|---|---|---|");
    let t0 = Instant::now();
    let (mut failed, mut void) = (0, 0);
    // One run per CPU thread count, or one on the CUDA device.
    let devices: Vec<Device> = match dev {
        Device::Cpu(_) => a.threads.iter().map(|&t| Device::Cpu(t)).collect(),
        cuda => vec![cuda],
    };
    for &d in &devices {
        let mut backend = crate::args::open(d, &model)?;
        // On CUDA one backend serves both sides: its reordering applies to
        // calls of more than one row only, so replay stays as it was.
        if a.negative_control
            && let AnyBackend::Cuda(c) = backend
        {
            backend = AnyBackend::Cuda(Box::new(c.with_reversed_topk()));
        }
        let (f, v) = match (&backend, d) {
            (AnyBackend::Cpu(cpu), Device::Cpu(threads)) => {
                let label = cpu.threads().to_string();
                if a.negative_control {
                    let reversed = Cpu::new(threads).with_reversed_topk();
                    gate(cpu, &reversed, &label, &model, &prompts, &a, kv)?
                } else {
                    gate(cpu, cpu, &label, &model, &prompts, &a, kv)?
                }
            }
            _ => with_backend!(&backend, |b| gate(b, b, "gpu", &model, &prompts, &a, kv))?,
        };
        failed += f;
        void += v;
    }
    let runs = devices.len();
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
