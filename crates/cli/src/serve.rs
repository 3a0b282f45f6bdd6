//! `samesum serve`: the OpenAI-compatible server (see `samesum-server`).

use crate::device::Device;
use anyhow::{Context, Result, bail};
use samesum_engine::KvType;
use std::path::PathBuf;

/// Arguments of `samesum serve`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// GGUF model (default: the built-in tiny synthetic model, random weights).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Backend: cpu, cuda or cuda:N.
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
    /// CPU worker threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Requests decoded together at most.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Requests waiting at most; past it the server answers 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Largest request body in bytes (past it: 413).
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// Context per request (prompt + completion tokens).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    ctx: usize,
    /// Prompt rows per scheduler step (shared by the requests still
    /// prefilling); default 128 on the CPU, 512 on CUDA.
    #[arg(long)]
    chunk: Option<usize>,
    /// KV cache type: f32 or f16.
    #[arg(long, default_value = "f32")]
    kv_type: String,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let kv = match a.kv_type.as_str() {
        "f32" => KvType::F32,
        "f16" => KvType::F16,
        other => bail!("--kv-type {other:?} is not supported (f32, f16)"),
    };
    let parsed = Device::parse(&a.device, a.vram_budget.as_deref())?.with_attention(a.attention)?;
    let chunk = match a.chunk {
        Some(0) => bail!("--chunk must be at least 1"),
        Some(c) => c,
        None => parsed.serve_chunk(),
    };
    let device = match parsed {
        Device::Cpu => samesum_server::Device::Cpu(a.threads),
        Device::Cuda(n, budget) => samesum_server::Device::Cuda(n, budget),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let (path, _tmp) = crate::synth::model_or_builtin(
        &a.model,
        "tiny-qwen3next",
        "q8_0",
        Some(
            "(no -m given: serving a tiny synthetic qwen3next model with random weights; expect gibberish)",
        ),
    )?;
    let model = crate::run::load_with_progress(&path)?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let opts = samesum_server::Options {
        host: a.host,
        port: a.port,
        device,
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        max_body: a.max_body,
        ctx: a.ctx,
        prefill_chunk: chunk,
        kv,
        model_name: name,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(samesum_server::serve(
        model,
        opts,
        |addr| {
            println!("listening on http://{addr}");
            use std::io::Write;
            let _ = std::io::stdout().flush();
        },
        async {
            // Ctrl-C or SIGTERM: stop accepting, finish the open responses.
            #[cfg(unix)]
            {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("a SIGTERM handler");
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            #[cfg(not(unix))]
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("shutting down");
        },
    ))?;
    Ok(())
}
