//! `samesum serve`: the OpenAI-compatible server (see `samesum-server`).

use crate::args::{BackendArgs, CtxArgs, KvArgs, ModelArgs, ThreadsArgs, at_least_one};
use anyhow::{Context, Result};

/// Arguments of `samesum serve`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    threads: ThreadsArgs,
    /// Requests decoded together at most (also -np/--parallel, llama.cpp's
    /// spellings).
    #[arg(long, visible_alias = "parallel", default_value_t = 8)]
    max_batch: usize,
    /// Requests waiting at most; past it the server answers 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Largest request body in bytes (past it: 413).
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    #[command(flatten)]
    ctx: CtxArgs,
    /// Prompt rows per scheduler step (shared by the requests still
    /// prefilling). [default: 128 on the CPU, 512 on CUDA]
    #[arg(long, value_parser = at_least_one)]
    chunk: Option<usize>,
    #[command(flatten)]
    kv: KvArgs,
}

pub(crate) fn run(a: Args) -> Result<()> {
    let kv = a.kv.kv();
    let device = a.backend.device(a.threads.threads)?;
    let chunk = a.chunk.unwrap_or_else(|| device.serve_chunk());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let (path, _tmp) = a.model.path_or_synth(
        "tiny-qwen3next",
        "q8_0",
        Some(
            "(no -m given: serving a tiny synthetic qwen3next model with random weights; expect gibberish)",
        ),
    )?;
    let model = crate::run::load_with_progress(&path)?;
    let ctx = a.ctx.for_model(&model);
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
        ctx,
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
