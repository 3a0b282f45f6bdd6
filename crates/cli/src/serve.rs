//! `samesum serve`: the OpenAI-compatible server (see `samesum-server`).

use crate::args::{BackendArgs, CtxArgs, KvArgs, ModelArgs, ThreadsArgs, at_least_one};
use anyhow::{Context, Result};
use std::time::Duration;

/// Seconds (fractions allowed), 0 or more.
fn secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("{e}"))?;
    Duration::try_from_secs_f64(v).map_err(|_| format!("{s:?} is not a number of seconds"))
}

/// Seconds above 0.
fn positive_secs(s: &str) -> Result<Duration, String> {
    match secs(s)? {
        d if d.is_zero() => Err("must be above 0".into()),
        d => Ok(d),
    }
}

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
    /// Connections served at once. Past it the connection idle the longest
    /// is closed to make room; when all have a request in flight, a new
    /// client gets /health or a 503 (too_many_connections) and is closed.
    /// Lowered to what `ulimit -n` allows.
    #[arg(long, default_value_t = 1024, value_parser = at_least_one)]
    max_connections: usize,
    /// Read/write timeout in seconds: a request's head must arrive within it
    /// of its first byte and its body within it of the head (else 408); a
    /// response write stuck this long (a client that stopped reading) closes
    /// the connection and cancels its request.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = positive_secs)]
    timeout: Duration,
    /// Seconds a connection with no request in flight (and none arriving)
    /// stays open. On Linux a new connection that sends nothing is held in
    /// the kernel for about this long before the server takes it
    /// (TCP_DEFER_ACCEPT).
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = positive_secs)]
    keep_alive_timeout: Duration,
    /// Seconds a request may run from when it is queued; then it ends with
    /// finish_reason "length" if it has generated tokens, else with a 503
    /// (request_timeout).
    #[arg(long, value_name = "SECS", default_value = "600", value_parser = positive_secs)]
    request_timeout: Duration,
    /// On Ctrl-C or SIGTERM: seconds the running requests get to finish
    /// before they are cancelled (a second signal exits at once).
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = secs)]
    drain_timeout: Duration,
    /// Generated tokens per request at most; a request asking for more is a
    /// 400, one naming no limit gets this (0: up to the context).
    #[arg(long, value_name = "N", default_value_t = 0)]
    max_tokens_cap: usize,
    #[command(flatten)]
    ctx: CtxArgs,
    /// Prompt rows per scheduler step (shared by the requests still
    /// prefilling; at most 512 in CUDA tier mode). [default: 128 on the CPU,
    /// 2048 on CUDA]
    #[arg(long, value_parser = at_least_one)]
    chunk: Option<usize>,
    #[command(flatten)]
    kv: KvArgs,
    /// Memory for the prefix cache in MiB (0: off): states saved by the
    /// tokens they consumed, at the end of each prompt and each request, so
    /// a prompt that extends one (a follow-up chat turn) prefills only the
    /// rest, with the same bytes as cold. Least recently used entries go
    /// first. Host memory on the CPU, VRAM on CUDA.
    #[arg(long, value_name = "MIB", default_value_t = samesum_server::DEFAULT_PREFIX_CACHE_MB)]
    prefix_cache_mb: u64,
    /// Memory the running requests' KV caches and recurrent states may
    /// reserve together (e.g. 2G, 512M; none: no limit). A request reserves
    /// its whole context (prompt + max_tokens + 1 tokens, in whole KV
    /// blocks, and its recurrent states) when it starts; one that does not
    /// fit beside the running ones waits in the queue, one larger than the
    /// whole budget is refused with a 400. The prefix cache has its own
    /// budget. [default: auto: on the CPU half the memory available at
    /// start; on CUDA 90% of the VRAM free with the weights placed, less
    /// the prefix cache and a reserve of 4 GiB or a tenth of the card]
    #[arg(long, value_name = "SIZE", default_value = "auto")]
    kv_budget: samesum_server::KvBudget,
    /// How a chat reply's `<think>...</think>` block is returned: `deepseek`
    /// (as `reasoning_content`, apart from `content`, as llama-server and
    /// vLLM do) or `none` (in `content`, as generated). A request's
    /// `reasoning_format` field overrides it.
    #[arg(long, value_name = "FORMAT", default_value = "deepseek", value_parser = ["deepseek", "none", "auto"])]
    reasoning_format: String,
    /// Use this Jinja chat template instead of the model's (llama-server's
    /// --chat-template-file): for a file whose template is missing or wrong.
    #[arg(long, value_name = "FILE")]
    chat_template_file: Option<std::path::PathBuf>,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize
    /// and /metrics (else 401); several keys comma-separated or the flag
    /// repeated. /health and the chat page at / stay open. Read from
    /// SAMESUM_API_KEY when the flag is absent.
    #[arg(long, value_name = "KEY")]
    api_key: Vec<String>,
    /// Allow browser pages from ORIGIN (scheme://host[:port], or * for any)
    /// to call the API: CORS headers on responses and preflight OPTIONS
    /// answered (before the key check). Repeat it or comma-separate
    /// origins. Without it no CORS header is sent.
    #[arg(long, value_name = "ORIGIN")]
    cors: Vec<String>,
}

/// The keys: `--api-key`, else `SAMESUM_API_KEY` (set but empty is an
/// error, not an open server).
fn api_keys(flag: Vec<String>) -> Result<Vec<String>> {
    if !flag.is_empty() {
        return Ok(flag);
    }
    match std::env::var("SAMESUM_API_KEY") {
        Ok(v) if v.trim().is_empty() => {
            anyhow::bail!("SAMESUM_API_KEY is set but empty (unset it to serve without a key)")
        }
        Ok(v) => Ok(vec![v]),
        Err(std::env::VarError::NotPresent) => Ok(Vec::new()),
        Err(std::env::VarError::NotUnicode(_)) => {
            anyhow::bail!("SAMESUM_API_KEY is not valid UTF-8")
        }
    }
}

pub(crate) fn run(a: Args) -> Result<()> {
    let access = samesum_server::Access {
        api_keys: api_keys(a.api_key)?,
        cors: a.cors,
    };
    // Refuse a bad key or origin before loading the model.
    access.check().map_err(anyhow::Error::msg)?;
    let device = a.backend.device(a.threads.threads)?;
    let kv = a.kv.kv(&device)?;
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
        backend: std::sync::Arc::new(device),
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        max_body: a.max_body,
        ctx,
        prefill_chunk: chunk,
        kv,
        prefix_cache_mb: a.prefix_cache_mb,
        kv_budget: a.kv_budget,
        model_name: name,
        reasoning_format: samesum_server::api::ReasoningFormat::parse(&a.reasoning_format)
            .unwrap_or(samesum_server::api::ReasoningFormat::Deepseek),
        chat_template: match &a.chat_template_file {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|e| anyhow::anyhow!("--chat-template-file {}: {e}", p.display()))?,
            ),
            None => None,
        },
        limits: samesum_server::Limits {
            max_connections: a.max_connections,
            timeout: a.timeout,
            keep_alive: a.keep_alive_timeout,
            request_timeout: a.request_timeout,
            drain_timeout: a.drain_timeout,
            max_tokens_cap: a.max_tokens_cap,
        },
        access,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Ctrl-C or SIGTERM: stop accepting, drain, exit 0; a second one: exit
    // at once (128 + the signal's number).
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = a.drain_timeout.as_secs_f64();
    rt.block_on(async {
        let mut signals = Signals::new().context("installing the signal handlers")?;
        tokio::spawn(async move {
            signals.next().await;
            eprintln!(
                "shutting down: no new connections; running requests get {drain} s to finish (signal again to exit at once)"
            );
            let _ = stop_tx.send(());
            let code = signals.next().await;
            eprintln!("second signal: exiting now");
            std::process::exit(code);
        });
        anyhow::Ok(())
    })?;
    rt.block_on(samesum_server::serve(
        model,
        opts,
        |addr| {
            println!("listening on http://{addr}");
            use std::io::Write;
            let _ = std::io::stdout().flush();
        },
        async {
            let _ = stop_rx.await;
        },
    ))?;
    // Template and tokenizer work left on the blocking pool is bounded (the
    // template's fuel, the body limit); do not wait long for it.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// Ctrl-C and SIGTERM.
struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Signals {
                int: signal(SignalKind::interrupt())?,
                term: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// The next signal; the exit status it calls for.
    async fn next(&mut self) -> i32 {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.int.recv() => 130,
                _ = self.term.recv() => 143,
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            130
        }
    }
}
