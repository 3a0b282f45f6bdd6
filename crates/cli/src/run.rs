//! `samesum run`: generate text from a prompt, streaming it as it comes.

use crate::args::{BackendArgs, ChunkArgs, CtxArgs, KvArgs, ModelArgs, Prefill, ThreadsArgs};
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use samesum_engine::sample::{Sampler, SamplerConfig};
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{Backend, KvType, Logits, Model, forward, forward_chunks};
use samesum_server::with_backend;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Arguments of `samesum run`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text.
    #[arg(
        short,
        long,
        default_value = "Tell me about mixture-of-experts models."
    )]
    prompt: String,
    /// Read the prompt from a file instead.
    #[arg(short = 'f', long = "file")]
    prompt_file: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n_predict: usize,
    #[command(flatten)]
    ctx: CtxArgs,
    #[command(flatten)]
    threads: ThreadsArgs,
    /// Temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    /// Top-k (0: off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Top-p (1: off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Min-p (0: off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Random seed.
    #[arg(short, long, default_value_t = 0)]
    seed: u64,
    /// Raw completion: do not wrap the prompt in the chat template.
    #[arg(long)]
    no_chat: bool,
    /// System message (chat mode).
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    chunk: ChunkArgs,
    /// Prefill mode: batched (chunks of --chunk rows) or replay (one token per call).
    #[arg(long, value_enum, default_value_t = Prefill::Batched)]
    prefill: Prefill,
    /// Print the prompt's tokens before generating.
    #[arg(long)]
    verbose_prompt: bool,
    #[command(flatten)]
    backend: BackendArgs,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let kv = a.kv.kv();
    let dev = a.backend.device(a.threads.threads)?;
    let (path, _tmp) = a.model.path_or_synth(
        "tiny-qwen3next",
        "q8_0",
        Some(
            "(no -m given: running on a tiny synthetic qwen3next model with random weights; expect gibberish)",
        ),
    )?;
    let t_load = Instant::now();
    let model = load_with_progress(&path)?;
    let tok = Tokenizer::from_metadata(model.file.metadata())?;
    eprintln!(
        "loaded {} ({}, {} layers, {} experts/{} used, vocab {}) in {:.2}s",
        path.display(),
        model.hp.arch.name(),
        model.hp.n_layer,
        model.hp.n_expert,
        model.hp.n_expert_used,
        model.w.n_vocab,
        t_load.elapsed().as_secs_f64(),
    );
    let user = match &a.prompt_file {
        Some(f) => {
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
        }
        None => a.prompt.clone(),
    };
    let text = if a.no_chat {
        user
    } else {
        tok.chat(&user, a.system.as_deref())?
    };
    let prompt = tok.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if a.verbose_prompt {
        let shown: Vec<String> = prompt
            .iter()
            .map(|&t| format!("{t}:{:?}", tok.token(t)))
            .collect();
        eprintln!("prompt tokens ({}): {}", prompt.len(), shown.join(" "));
    }
    let ctx = a.ctx.ctx;
    if prompt.len() + a.n_predict > ctx {
        bail!(
            "the prompt ({} tokens) plus {} to generate does not fit the context of {ctx} (raise -c)",
            prompt.len(),
            a.n_predict,
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        let _ = ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst));
    }
    let backend = crate::args::open(dev, &model)?;
    let chunk = match a.prefill {
        Prefill::Replay => 1,
        Prefill::Batched => a.chunk.or_default(&backend),
    };
    with_backend!(&backend, |b| generate(
        b, &model, &tok, &prompt, &a, kv, chunk, &stop
    ))
}

/// Prefill `prompt` in chunks of `chunk` rows, then sample and stream tokens.
fn generate<B: Backend>(
    b: &B,
    model: &Model,
    tok: &Tokenizer,
    prompt: &[u32],
    a: &Args,
    kv: KvType,
    chunk: usize,
    stop: &AtomicBool,
) -> Result<()> {
    eprintln!("backend: {}", b.name());
    let mut st = b.new_state(model, a.ctx.ctx, kv)?;
    let mut sampler = Sampler::new(SamplerConfig {
        temp: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
        seed: a.seed,
    });
    let t_prompt = Instant::now();
    let mut logits = Vec::new();
    // Two chunks at a time (on the GPU the second runs beside the first).
    let pieces: Vec<&[u32]> = prompt.chunks(chunk).collect();
    let n = pieces.len();
    let want = |i: usize| {
        if i + 1 == n {
            Logits::Last
        } else {
            Logits::None
        }
    };
    for (p, pair) in pieces.chunks(2).enumerate() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        logits = forward_chunks(model, b, &mut st, pair, |j| want(2 * p + j))?;
    }
    let prompt_s = t_prompt.elapsed().as_secs_f64();
    let mut history = prompt.to_vec();
    let mut out = std::io::stdout().lock();
    let mut stream = tok.stream();
    let t_gen = Instant::now();
    let mut generated = 0usize;
    while generated < a.n_predict && !stop.load(Ordering::SeqCst) && !logits.is_empty() {
        let next = sampler.sample(&logits, &history);
        if tok.stop.contains(&next) {
            break;
        }
        generated += 1;
        history.push(next);
        write!(out, "{}", stream.push(next)?)?;
        out.flush()?;
        if generated == a.n_predict {
            break;
        }
        logits = forward(model, b, &mut st, &[next], Logits::Last)?;
    }
    // Text held back for a character that never completed (lossy, as the
    // server's last piece is).
    write!(out, "{}", stream.flush()?)?;
    writeln!(out)?;
    let gen_s = t_gen.elapsed().as_secs_f64();
    if stop.load(Ordering::SeqCst) {
        eprintln!("[interrupted]");
    }
    eprintln!(
        "prompt: {} tokens in {:.2}s ({:.1} tok/s) | generation: {} tokens in {:.2}s ({:.1} tok/s)",
        prompt.len(),
        prompt_s,
        prompt.len() as f64 / prompt_s.max(1e-9),
        generated,
        gen_s,
        generated as f64 / gen_s.max(1e-9)
    );
    Ok(())
}

/// Open and bind the model, touching every page of the mapping once with a
/// progress bar, so the first token does not pay for page faults.
pub(crate) fn load_with_progress(path: &std::path::Path) -> Result<Model> {
    let model = Model::load(path)?;
    let bytes = model.bytes();
    let bar = ProgressBar::new(bytes.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("loading [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut sum = 0u8;
    const STEP: usize = 1 << 24;
    for (i, chunk) in bytes.chunks(STEP).enumerate() {
        for page in chunk.iter().step_by(4096) {
            sum = sum.wrapping_add(*page);
        }
        bar.set_position(((i + 1) * STEP).min(bytes.len()) as u64);
    }
    std::hint::black_box(sum);
    bar.finish_and_clear();
    Ok(model)
}
