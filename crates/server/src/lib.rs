//! `samesum serve`: an OpenAI-compatible HTTP server.
//!
//! The model runs on its own thread ([`scheduler`]), which batches every
//! running request into one forward call per step (continuous batching); the
//! HTTP side ([`http`], axum on tokio) checks and tokenizes requests, queues
//! them (bounded: a full queue answers 503 with `Retry-After`), and streams
//! the results back. A request whose client disconnects is cancelled at the
//! model thread's next step.

pub mod api;
pub mod backend;
pub mod http;
pub mod metrics;
pub mod scheduler;

pub use backend::Device;
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
    /// Backend.
    pub device: Device,
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
    /// The name `/v1/models` reports.
    pub model_name: String,
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

/// Start the model thread for `model` and serve until Ctrl-C (or until
/// `shutdown` resolves). `on_listen` receives the bound address.
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
    let tok = Arc::new(
        Tokenizer::from_metadata(model.file.metadata())
            .map_err(|e| ServeError::Setup(e.to_string()))?,
    );
    let metrics = Arc::new(metrics::Metrics::default());
    let (tx, rx) = std::sync::mpsc::sync_channel::<scheduler::Job>(opts.max_queue);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<String, String>>();
    let cfg = scheduler::Config {
        max_batch: opts.max_batch,
        prefill_chunk: opts.prefill_chunk,
        kv: opts.kv,
    };
    let (tok2, m2, device) = (tok.clone(), metrics.clone(), opts.device);
    std::thread::Builder::new()
        .name("samesum-model".into())
        .spawn(move || {
            let t = std::time::Instant::now();
            match backend::AnyBackend::open(device, &model, true) {
                Ok(b) => {
                    if let Some(p) = b.placement(t.elapsed().as_secs_f64()) {
                        tracing::info!("{p}");
                    }
                    let _ = ready_tx.send(Ok(b.name()));
                    with_backend!(&b, |b| scheduler::run(&model, &tok2, b, rx, &cfg, &m2));
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                }
            }
        })?;
    let backend = ready_rx
        .recv()
        .map_err(|_| ServeError::Setup("the model thread stopped while starting".into()))?
        .map_err(ServeError::Setup)?;
    let app = Arc::new(http::App {
        queue: tx,
        tok,
        model_name: opts.model_name.clone(),
        ctx: opts.ctx,
        max_body: opts.max_body,
        metrics,
        next_id: AtomicU64::new(1),
    });
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|err| ServeError::Bind {
            addr: addr.clone(),
            err,
        })?;
    let local = listener.local_addr()?;
    tracing::info!(%local, backend, max_batch = opts.max_batch, max_queue = opts.max_queue, "listening");
    on_listen(local);
    axum::serve(listener, http::router(app))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}
