//! `samesum run`: generate text from a prompt, streaming it as it comes.

use crate::args::{BackendArgs, ChunkArgs, CtxArgs, KvArgs, ModelArgs, Prefill, ThreadsArgs};
use crate::with_backend;
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use samesum_engine::sample::{Sampler, SamplerConfig};
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{Backend, KvType, Logits, Model, forward, forward_chunks};
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
    /// Tokens to generate (-1: until a stop token or the end of the
    /// context).
    #[arg(short = 'n', long = "n-predict", default_value = "128", value_name = "N",
          allow_negative_numbers = true, value_parser = parse_n_predict)]
    n_predict: NPredict,
    #[command(flatten)]
    ctx: CtxArgs,
    #[command(flatten)]
    threads: ThreadsArgs,
    /// Temperature (0: greedy; a negative value is greedy too, with a
    /// warning).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temp: f32,
    /// Top-k (0: off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Top-p, in (0, 1] (1: off; outside, a warning).
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    top_p: f32,
    /// Min-p, in [0, 1] (0: off; outside, a warning).
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Sampling seed (-1 or absent: a random one; the seed used is printed
    /// on stderr, so --seed repeats the run).
    #[arg(short, long, value_name = "N", allow_negative_numbers = true,
          value_parser = parse_seed)]
    seed: Option<Seed>,
    /// Raw completion: do not wrap the prompt in the chat template.
    #[arg(long)]
    no_chat: bool,
    /// System message (chat mode).
    #[arg(long)]
    system: Option<String>,
    /// Variables for the chat template, a JSON object (e.g.
    /// '{"enable_thinking": false}'), as vLLM's and llama-server's
    /// chat_template_kwargs.
    #[arg(long, value_name = "JSON", value_parser = parse_kwargs)]
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Thinking on or off for templates that switch it (Qwen3's
    /// enable_thinking); without it, the template's default (on for
    /// Qwen3). Shorthand for --chat-template-kwargs '{"enable_thinking": ...}'.
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    think: Option<String>,
    /// Use this Jinja chat template instead of the model's (llama.cpp's
    /// --chat-template-file).
    #[arg(long, value_name = "FILE")]
    chat_template_file: Option<PathBuf>,
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
    /// Conversation mode (llama-cli's -cnv): read user turns from stdin, a
    /// line each, and answer each with the whole history rendered by the
    /// chat template, continuing one sequence state (only the new tokens are
    /// prefilled). EOF or a line /exit ends; Ctrl-C stops a reply. -n limits
    /// each reply; --system gives the system message.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_file", "no_chat", "verbose_prompt"])]
    conversation: bool,
    #[command(flatten)]
    backend: BackendArgs,
}

/// The chat template's variables: `--chat-template-kwargs`, with `--think`
/// setting `enable_thinking`.
fn template_kwargs(a: &Args) -> serde_json::Map<String, serde_json::Value> {
    let mut kwargs = a.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(t) = &a.think {
        kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(t == "on"));
    }
    kwargs
}

/// `--chat-template-kwargs`: a JSON object.
fn parse_kwargs(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str::<serde_json::Value>(s) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err("expected a JSON object, e.g. '{\"enable_thinking\": false}'".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// `-n`: how many tokens to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NPredict {
    /// At most this many.
    Tokens(usize),
    /// Until a stop token or the end of the context (`-1`).
    UntilEnd,
}

fn parse_n_predict(s: &str) -> Result<NPredict, String> {
    match s.trim().parse::<i64>() {
        Ok(-1) => Ok(NPredict::UntilEnd),
        Ok(n) if n < 0 => Err(format!(
            "{n} is not a token count: -1 means until a stop token or the end of the context"
        )),
        Ok(n) => Ok(NPredict::Tokens(n as usize)),
        Err(e) => Err(e.to_string()),
    }
}

/// `--seed`: a given seed, or `-1` for a random one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seed {
    /// This seed.
    Fixed(u64),
    /// A random seed (`-1`).
    Random,
}

fn parse_seed(s: &str) -> Result<Seed, String> {
    let s = s.trim();
    if s == "-1" {
        return Ok(Seed::Random);
    }
    s.parse::<u64>()
        .map(Seed::Fixed)
        .map_err(|e| format!("{e} (a seed is 0 or more, or -1 for a random one)"))
}

/// A seed from the process's hash keys (randomized per process) and the
/// time: for sampling, not for secrets.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.write_u32(std::process::id());
    h.finish()
}

/// Warnings (stderr) for sampling values outside their meaningful range;
/// the sampler still runs with them as given.
fn warn_sampling(a: &Args) {
    if a.temp.is_nan() {
        eprintln!("warning: --temp is NaN; give a number (0: greedy)");
    } else if a.temp < 0.0 {
        eprintln!(
            "warning: --temp {} is negative; sampling is greedy, as --temp 0",
            a.temp
        );
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        eprintln!("warning: --top-p {} is outside (0, 1] (1: off)", a.top_p);
    }
    if !(0.0..=1.0).contains(&a.min_p) {
        eprintln!("warning: --min-p {} is outside [0, 1] (0: off)", a.min_p);
    }
}

pub(crate) fn run(a: Args) -> Result<()> {
    let dev = a.backend.device(a.threads.threads)?;
    let kv = a.kv.kv(&dev)?;
    let (path, _tmp) = a.model.path_or_synth(
        "tiny-qwen3next",
        "q8_0",
        Some(
            "(no -m given: running on a tiny synthetic qwen3next model with random weights; expect gibberish)",
        ),
    )?;
    let t_load = Instant::now();
    let model = load_with_progress(&path)?;
    let mut tok = Tokenizer::from_metadata(model.file.metadata())?;
    if let Some(p) = &a.chat_template_file {
        tok.chat_template = Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("--chat-template-file {}", p.display()))?,
        );
    }
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
    if a.conversation {
        return conversation(&a, dev, &model, &tok, kv);
    }
    let user = match &a.prompt_file {
        Some(f) => {
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
        }
        None => a.prompt.clone(),
    };
    let text = if a.no_chat {
        user
    } else {
        let kwargs = template_kwargs(&a);
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": user}));
        tok.render_chat(&samesum_engine::tokenizer::ChatInput {
            messages: &serde_json::Value::Array(messages),
            tools: None,
            kwargs: &kwargs,
            add_generation_prompt: true,
        })?
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
    let ctx = a.ctx.for_model(&model);
    let n_predict = match a.n_predict {
        NPredict::Tokens(n) => {
            if prompt.len() + n > ctx {
                bail!(
                    "the prompt ({} tokens) plus {n} to generate does not fit the context of {ctx} (raise -c)",
                    prompt.len(),
                );
            }
            n
        }
        NPredict::UntilEnd => {
            if prompt.len() >= ctx {
                bail!(
                    "the prompt ({} tokens) leaves no room to generate in the context of {ctx} (raise -c)",
                    prompt.len(),
                );
            }
            ctx - prompt.len()
        }
    };
    let sampling = sampling(&a);
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
        b, &model, &tok, &prompt, ctx, n_predict, sampling, kv, chunk, &stop
    ))
}

/// The sampler settings of the command line, with a seed (printed).
fn sampling(a: &Args) -> SamplerConfig {
    warn_sampling(a);
    let seed = match a.seed {
        Some(Seed::Fixed(s)) => s,
        Some(Seed::Random) | None => random_seed(),
    };
    eprintln!("seed: {seed}");
    SamplerConfig {
        temp: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
        seed,
    }
}

/// `run -cnv`: the conversation on stdin (`chat.rs`). Ctrl-C stops the reply
/// in progress; at the prompt it exits (130).
fn conversation(
    a: &Args,
    dev: crate::backend::Device,
    model: &Model,
    tok: &Tokenizer,
    kv: KvType,
) -> Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    let ctx = a.ctx.for_model(model);
    let sampling = sampling(a);
    let stop = Arc::new(AtomicBool::new(false));
    let busy = Arc::new(AtomicBool::new(false));
    {
        let (stop, busy) = (stop.clone(), busy.clone());
        let _ = ctrlc::set_handler(move || {
            if busy.load(Ordering::SeqCst) {
                stop.store(true, Ordering::SeqCst);
            } else {
                eprintln!();
                std::process::exit(130);
            }
        });
    }
    let backend = crate::args::open(dev, model)?;
    let chunk = match a.prefill {
        Prefill::Replay => 1,
        Prefill::Batched => a.chunk.or_default(&backend),
    };
    let settings = crate::chat::Settings {
        system: a.system.as_deref(),
        kwargs: template_kwargs(a),
        ctx,
        n_predict: a.n_predict,
        sampling,
        kv,
        chunk,
    };
    with_backend!(&backend, |b| crate::chat::converse(
        b, model, tok, &settings, &stop, &busy
    ))
}

/// Prefill `prompt` in chunks of `chunk` rows, then sample and stream tokens.
fn generate<B: Backend>(
    b: &B,
    model: &Model,
    tok: &Tokenizer,
    prompt: &[u32],
    ctx: usize,
    n_predict: usize,
    sampling: SamplerConfig,
    kv: KvType,
    chunk: usize,
    stop: &AtomicBool,
) -> Result<()> {
    eprintln!("backend: {}", b.name());
    let mut st = state_with_room(b, model, ctx, kv, prompt.len() + n_predict)?;
    let mut sampler = Sampler::new(sampling);
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
    let mut fed = 0usize;
    for (p, pair) in pieces.chunks(2).enumerate() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        logits = forward_chunks(model, b, &mut st, pair, |j| want(2 * p + j))?;
        fed += pair.iter().map(|c| c.len()).sum::<usize>();
    }
    let prompt_s = t_prompt.elapsed().as_secs_f64();
    if fed < prompt.len() {
        // Interrupted during the prefill: say how far it got, no more.
        eprintln!(
            "[interrupted] prompt: {fed} of {} tokens in {prompt_s:.2}s ({:.1} tok/s); nothing generated",
            prompt.len(),
            fed as f64 / prompt_s.max(1e-9)
        );
        return Err(Interrupted.into());
    }
    let mut history = prompt.to_vec();
    let mut out = std::io::stdout().lock();
    let mut stream = tok.stream();
    let t_gen = Instant::now();
    let mut generated = 0usize;
    while generated < n_predict && !stop.load(Ordering::SeqCst) && !logits.is_empty() {
        let next = sampler.sample(&logits, &history);
        if tok.stop.contains(&next) {
            break;
        }
        generated += 1;
        history.push(next);
        write!(out, "{}", stream.push(next)?)?;
        out.flush()?;
        if generated == n_predict {
            break;
        }
        logits = forward(model, b, &mut st, &[next], Logits::Last)?;
    }
    // Text held back for a character that never completed (lossy, as the
    // server's last piece is).
    write!(out, "{}", stream.flush()?)?;
    writeln!(out)?;
    let gen_s = t_gen.elapsed().as_secs_f64();
    let interrupted = stop.load(Ordering::SeqCst);
    if interrupted {
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
    if interrupted {
        return Err(Interrupted.into());
    }
    Ok(())
}

/// `run` stopped by Ctrl-C (SIGINT): the process exits with 130, as a shell
/// reports a command killed by SIGINT.
#[derive(Debug)]
pub(crate) struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// Open and bind the model, touching every page of the mapping once with a
/// progress bar, so the first token does not pay for page faults.
/// A new state of `ctx` positions whose first `need` are made writable now
/// ([`Backend::reserve`]): a device without memory for the cache the
/// command will fill says so before the prompt runs, not partway through.
pub(crate) fn state_with_room<B: Backend>(
    b: &B,
    model: &Model,
    ctx: usize,
    kv: KvType,
    need: usize,
) -> Result<B::State> {
    let mut st = b.new_state(model, ctx, kv)?;
    b.reserve(&mut st, need).with_context(|| {
        format!("no device memory for the KV cache of {need} positions (lower -c or -n)")
    })?;
    Ok(st)
}

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
