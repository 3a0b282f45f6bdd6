//! `samesum serve`: an OpenAI-compatible HTTP server.
//!
//! The model runs on its own thread ([`scheduler`]), which drives the
//! engine's step scheduler ([`samesum_engine::sched`]: admission within the
//! KV budget, continuous batching of every running request into one
//! forward call per step, the prefix cache) and turns its tokens into text;
//! the HTTP side ([`http`], axum on tokio) checks and tokenizes requests,
//! queues them (bounded: a full queue answers 503 with `Retry-After`), and
//! streams the results back. A request whose client disconnects is
//! cancelled at the model thread's next step.
//!
//! [`conn`] owns the sockets: the connection cap, the read, write and
//! keep-alive timeouts, the request body limit, and the drain on shutdown
//! ([`Limits`]).
//!
//! [`auth`] checks API keys and adds CORS headers when asked to; [`page`]
//! is the chat page at `/`.

pub mod api;
pub mod auth;
pub mod backend;
pub mod chat_output;
pub mod conn;
pub mod http;
pub mod llama_api;
pub mod metrics;
pub mod page;
pub mod prep;
pub mod scheduler;
pub mod structured;

pub use auth::Access;
pub use backend::{CpuBackend, Memory, ModelThread, OpenBackend, Opened};

use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{KvType, Model};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

/// Server settings.
#[derive(Clone, Debug)]
pub struct Options {
    /// Address to listen on.
    pub host: String,
    /// Port (0: any free port).
    pub port: u16,
    /// Opens the backend on the model thread ([`CpuBackend`], or the
    /// caller's own for other devices).
    pub backend: Arc<dyn OpenBackend>,
    /// Requests running at once.
    pub max_batch: usize,
    /// Requests waiting at most (then 503).
    pub max_queue: usize,
    /// Largest request body in bytes (then 413).
    pub max_body: usize,
    /// Context per request (prompt + completion).
    pub ctx: usize,
    /// Prompt rows per step.
    pub prefill_chunk: usize,
    /// KV cache type.
    pub kv: KvType,
    /// The prefix cache's budget in MiB (0: off; see
    /// [`samesum_engine::sched::prefix`]).
    pub prefix_cache_mb: u64,
    /// The KV budget: bytes the running requests' whole contexts may
    /// reserve together.
    pub kv_budget: KvBudget,
    /// The name `/v1/models` reports.
    pub model_name: String,
    /// Connection and request limits.
    pub limits: Limits,
    /// How replies' `<think>` blocks are returned unless a request says
    /// (`--reasoning-format`).
    pub reasoning_format: api::ReasoningFormat,
    /// A chat template used instead of the model's (`--chat-template-file`).
    pub chat_template: Option<String>,
    /// API keys and CORS origins.
    pub access: Access,
}

/// `--prefix-cache-mb`'s default: room for a few saved conversations of a
/// large model (its KV rows and recurrent states), in host memory on the
/// CPU and VRAM on CUDA.
pub const DEFAULT_PREFIX_CACHE_MB: u64 = 512;

/// `--kv-budget`: bytes the running requests' whole contexts (prompt +
/// max_tokens + 1 tokens of KV rows in whole blocks, and recurrent states)
/// may reserve together. A request that does not fit beside the running
/// ones waits; one larger than the whole budget is refused with a 400.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvBudget {
    /// On the CPU, half the memory available when the server starts
    /// (`MemAvailable`, Linux; no limit elsewhere). On CUDA, 90% of the
    /// VRAM left free once the weights are placed, less the prefix cache
    /// and a reserve for the steps' activations and scratch
    /// ([`CUDA_STEP_RESERVE`], or a tenth of the card if that is more).
    #[default]
    Auto,
    /// No limit.
    Unlimited,
    /// This many bytes.
    Bytes(u64),
}

/// A `--kv-budget` that is not a size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseSizeError(String);

impl std::str::FromStr for KvBudget {
    type Err = ParseSizeError;

    /// `auto`, `none` (no limit), or a size: bytes, or a number with `K`,
    /// `M`, `G` or `T` (powers of 1024, an optional `B` or `iB` after it;
    /// fractions allowed: `1.5G`).
    fn from_str(s: &str) -> Result<KvBudget, ParseSizeError> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "auto" => return Ok(KvBudget::Auto),
            "none" | "unlimited" | "off" => return Ok(KvBudget::Unlimited),
            _ => {}
        }
        let bad = || {
            ParseSizeError(format!(
                "{s:?}: expected a size (e.g. 2G, 512M, 1048576), auto or none"
            ))
        };
        let num = t.trim_end_matches("ib").trim_end_matches('b');
        let (digits, shift) = match num.char_indices().last() {
            Some((i, 'k')) => (&num[..i], 10),
            Some((i, 'm')) => (&num[..i], 20),
            Some((i, 'g')) => (&num[..i], 30),
            Some((i, 't')) => (&num[..i], 40),
            _ => (num, 0),
        };
        let v: f64 = digits.trim().parse().map_err(|_| bad())?;
        let bytes = v * (1u64 << shift) as f64;
        if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
            return Err(bad());
        }
        Ok(KvBudget::Bytes(bytes as u64))
    }
}

/// VRAM `--kv-budget auto` leaves on CUDA for what is not KV or state:
/// the activations and scratch of a step (two prompt chunks in flight, the
/// attention partials of up to 256 MiB a call), recorded steps and the
/// driver's own.
pub const CUDA_STEP_RESERVE: u64 = 4 << 30;

impl KvBudget {
    /// The budget in bytes for a KV cache in `memory` (`None`: no limit),
    /// and a line saying where it came from. `prefix_cache` is the bytes the
    /// prefix cache may hold there.
    pub fn resolve(self, memory: Memory, prefix_cache: u64) -> (Option<u64>, String) {
        match (self, memory) {
            (KvBudget::Bytes(b), _) => (Some(b), format!("{b} bytes (--kv-budget)")),
            (KvBudget::Unlimited, _) => (None, "no limit (--kv-budget none)".into()),
            (KvBudget::Auto, Memory::Host) => match mem_available() {
                Some(avail) => (
                    Some(avail / 2),
                    format!(
                        "{} bytes: half of the {avail} bytes available at start",
                        avail / 2
                    ),
                ),
                None => (
                    None,
                    "no limit (available memory unknown; set --kv-budget)".into(),
                ),
            },
            (KvBudget::Auto, Memory::Device(vram)) => match vram {
                Some((free, total)) => {
                    let reserve = CUDA_STEP_RESERVE.max(total / 10);
                    let b = free.saturating_sub(prefix_cache + reserve) / 10 * 9;
                    (
                        Some(b),
                        format!(
                            "{b} bytes: 90% of the {free} bytes of VRAM free with the weights placed, less {prefix_cache} for the prefix cache and {reserve} for the steps"
                        ),
                    )
                }
                None => (None, "no limit (free VRAM unknown; set --kv-budget)".into()),
            },
        }
    }
}

/// `MemAvailable` of `/proc/meminfo` in bytes (Linux).
fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What one client may hold, and for how long.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Connections served at once. Past it, the connection idle the longest
    /// is closed to make room; when every one has a request in flight, a new
    /// client gets one answer (`/health`, or a 503 `too_many_connections`)
    /// and is closed. Lowered at start to what the file-descriptor limit
    /// allows.
    pub max_connections: usize,
    /// Read and write timeout: a request's head must arrive within it of its
    /// first byte, and its body within it of the head (else 408); a response
    /// write that makes no progress for this long closes the connection.
    pub timeout: std::time::Duration,
    /// A connection with no request in flight and none arriving is closed
    /// after this long. On Linux a new connection that sends nothing waits
    /// about this long in the kernel before the server takes it.
    pub keep_alive: std::time::Duration,
    /// A request still running this long after it was queued ends: with
    /// finish reason `length` when it has generated tokens, else with a 503
    /// `request_timeout`.
    pub request_timeout: std::time::Duration,
    /// On shutdown, running requests get this long to finish; the rest are
    /// cancelled.
    pub drain_timeout: std::time::Duration,
    /// Generated tokens per request at most (0: up to the context). A
    /// request asking for more is a 400; one that names no limit gets this.
    pub max_tokens_cap: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        use std::time::Duration;
        Limits {
            max_connections: 1024,
            timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            request_timeout: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(30),
            max_tokens_cap: 0,
        }
    }
}

/// Hand freed heap memory back to the system: glibc keeps what a thread
/// freed in that thread's arena, so the server would keep the peak of the
/// largest request a thread prepared, or of a crowd of connections.
pub(crate) fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Allocations of this size or more get pages of their own from the system
/// and give them back when freed (glibc's mmap threshold, fixed).
const MMAP_THRESHOLD: i32 = 4 << 20;

/// Keep glibc from holding on to large freed blocks. Its mmap threshold
/// starts at 128 KiB and rises to the largest block freed, up to 32 MiB, so
/// after one large request (the tokenizer's offsets for a 1 MB prompt are
/// tens of MB) every later one of that size is carved from a thread's arena
/// and what it leaves there stays. Fixed at 4 MiB, memory returns to its
/// level after a crowd of large requests; blocks under it (the engine's
/// per-step buffers on small models) keep the arenas' speed.
fn limit_heap_retention() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt changes an allocator setting; it takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The model or tokenizer could not be set up.
    #[error("{0}")]
    Setup(String),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {err}")]
    Bind {
        /// Address.
        addr: String,
        /// Cause.
        err: std::io::Error,
    },
    /// The server failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

/// Start the model thread for `model` and serve until `shutdown` resolves,
/// then drain (see [`conn`]) and stop the model thread. `on_listen` receives
/// the bound address.
pub async fn serve(
    model: Model,
    opts: Options,
    on_listen: impl FnOnce(std::net::SocketAddr),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    if opts.max_queue == 0 || opts.max_batch == 0 || opts.ctx == 0 {
        return Err(ServeError::Setup(
            "--max-queue, --max-batch and --ctx-size must be at least 1".into(),
        ));
    }
    let l = &opts.limits;
    if l.max_connections == 0
        || [l.timeout, l.keep_alive, l.request_timeout]
            .iter()
            .any(|d| d.is_zero())
    {
        return Err(ServeError::Setup(
            "--max-connections, --timeout, --keep-alive-timeout and --request-timeout must be above 0"
                .into(),
        ));
    }
    let access = opts.access.check().map_err(ServeError::Setup)?;
    let mut tok = Tokenizer::from_metadata(model.file.metadata())
        .map_err(|e| ServeError::Setup(e.to_string()))?;
    if let Some(t) = &opts.chat_template {
        tok.chat_template = Some(t.clone());
    }
    let tok = Arc::new(tok);
    let metrics = Arc::new(metrics::Metrics::default());
    let (tx, rx) = std::sync::mpsc::sync_channel::<scheduler::Job>(opts.max_queue);
    // The model thread sends the backend's name and the KV budget once the
    // weights are placed (on a GPU the budget comes from the memory left).
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<backend::Ready>();
    let cfg = scheduler::Config {
        max_batch: opts.max_batch,
        prefill_chunk: opts.prefill_chunk,
        kv: opts.kv,
        prefix_cache_bytes: opts.prefix_cache_mb.saturating_mul(1 << 20),
        kv_budget: None,
    };
    let hp_check = model.hp.clone();
    let (tok2, m2, opener) = (tok.clone(), metrics.clone(), opts.backend.clone());
    let (budget, kv, ctx) = (opts.kv_budget, opts.kv, opts.ctx);
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("samesum-model".into())
        .spawn(move || {
            let thread = ModelThread {
                model: &model,
                tok: tok2,
                rx,
                cfg,
                metrics: m2,
                ready: ready_tx.clone(),
                budget,
                kv,
                ctx,
            };
            if let Err(e) = opener.open_and_run(&model, thread) {
                let _ = ready_tx.send(Err(e));
            }
            let _ = stopped_tx.send(());
        })?;
    let (backend, kv_budget) = ready_rx
        .recv()
        .map_err(|_| ServeError::Setup("the model thread stopped while starting".into()))?
        .map_err(ServeError::Setup)?;
    let kv_check = kv_budget.map(|budget| http::KvCheck {
        hp: hp_check,
        kv: opts.kv,
        budget,
    });
    limit_heap_retention();
    let grammars = structured::Grammars::new(&tok);
    if let Err(e) = &grammars {
        tracing::warn!("structured output is not available for this model: {e}");
    }
    let prep_threads = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    let app = Arc::new(http::App {
        queue: tx,
        tok,
        model_name: opts.model_name.clone(),
        slots: opts.max_batch,
        ctx: opts.ctx,
        max_body: opts.max_body,
        metrics: metrics.clone(),
        next_id: AtomicU64::new(1),
        max_tokens_cap: opts.limits.max_tokens_cap,
        kv_check,
        request_timeout: opts.limits.request_timeout,
        prep: prep::PrepPool::new(prep_threads)
            .map_err(|e| ServeError::Setup(format!("starting the request threads: {e}")))?,
        reasoning: opts.reasoning_format,
        grammars,
    });
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = conn::listen(&addr, opts.limits.keep_alive)
        .await
        .map_err(|err| ServeError::Bind {
            addr: addr.clone(),
            err,
        })?;
    let local = listener.local_addr()?;
    let wanted = opts.limits.max_connections;
    let max_connections = match conn::fd_room(wanted) {
        Some(room) if room < wanted => {
            tracing::warn!(
                wanted,
                allowed = room.max(1),
                "--max-connections lowered to what the file-descriptor limit allows (raise `ulimit -n`)"
            );
            room.max(1)
        }
        _ => wanted,
    };
    let (api_key, cors) = (access.needs_key(), access.cors());
    tracing::info!(%local, backend, max_batch = opts.max_batch, max_queue = opts.max_queue, max_connections, api_key, cors, "listening");
    on_listen(local);
    conn::run(
        listener,
        access.wrap(http::router(app), metrics.clone()),
        opts.limits.clone(),
        max_connections,
        opts.max_body,
        metrics,
        shutdown,
    )
    .await;
    // Every handle on the queue is gone with the connections: the model
    // thread ends once its running requests see their clients gone.
    if tokio::time::timeout(std::time::Duration::from_secs(10), stopped_rx)
        .await
        .is_err()
    {
        tracing::warn!("the model thread is still in a step; leaving it");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{KvBudget, Memory};

    #[test]
    fn kv_budgets_parse_and_resolve() {
        let p = |s: &str| s.parse::<KvBudget>();
        assert_eq!(p("auto"), Ok(KvBudget::Auto));
        assert_eq!(p(" None "), Ok(KvBudget::Unlimited));
        assert_eq!(p("2G"), Ok(KvBudget::Bytes(2 << 30)));
        assert_eq!(p("512MiB"), Ok(KvBudget::Bytes(512 << 20)));
        assert_eq!(p("1.5k"), Ok(KvBudget::Bytes(1536)));
        assert_eq!(p("1048576"), Ok(KvBudget::Bytes(1 << 20)));
        for bad in ["", "0", "-1G", "2X", "G", "nanG", "1e30T"] {
            assert!(p(bad).is_err(), "{bad:?}");
        }
        let gib = 1u64 << 30;
        let vram = Memory::Device(Some((100 * gib, 140 * gib)));
        assert_eq!(KvBudget::Bytes(7).resolve(vram, 0).0, Some(7));
        assert_eq!(KvBudget::Unlimited.resolve(vram, 0).0, None);
        // 90% of the free VRAM less the prefix cache and the reserve (a
        // tenth of the card here: 14 GiB).
        assert_eq!(
            KvBudget::Auto.resolve(vram, gib / 2).0,
            Some((100 * gib - gib / 2 - 14 * gib) / 10 * 9)
        );
        // On a small card the fixed reserve.
        let small = Memory::Device(Some((20 * gib, 24 * gib)));
        assert_eq!(
            KvBudget::Auto.resolve(small, 0).0,
            Some((20 * gib - super::CUDA_STEP_RESERVE) / 10 * 9)
        );
        // Nothing left: a budget of zero, not an underflow.
        assert_eq!(
            KvBudget::Auto
                .resolve(Memory::Device(Some((gib, 24 * gib))), 0)
                .0,
            Some(0)
        );
        assert_eq!(KvBudget::Auto.resolve(Memory::Device(None), 0).0, None);
        assert_eq!(KvBudget::Unlimited.resolve(Memory::Host, 0).0, None);
        if let (Some(b), _) = KvBudget::Auto.resolve(Memory::Host, 0) {
            assert!(b > 0);
        }
    }
}
