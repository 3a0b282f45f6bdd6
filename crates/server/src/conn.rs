//! The sockets: the accept loop, what one connection may hold and for how
//! long, and the drain on shutdown.
//!
//! Each accepted connection is served by hyper's HTTP/1.1 server through an
//! `Io` wrapper that records when the connection last read and whether a
//! write is stuck, and a sweeper task closes, every [`SWEEP`]:
//! - a connection with no request in flight whose next request's head has
//!   not fully arrived within the read timeout of its first byte (slowloris);
//! - one with no request in flight and no byte of a next one for the
//!   keep-alive timeout (idle sockets, fresh ones included);
//! - one whose response write has made no progress for the write timeout (a
//!   client that stopped reading), which cancels its request.
//!
//! A request's head is 32 KiB at most (else 431). Its body must arrive
//! within the read timeout of the head (else 408) and within the body limit
//! (else 413, before reading it when `Content-Length` says so); it is read
//! whole before the router sees the request.
//!
//! On Linux a connection reaches the server once its first bytes arrived, or
//! after about the keep-alive timeout ([`listen`]): connections that send
//! nothing wait in the kernel. The connection cap: past it, the connection
//! idle the longest (no request in flight, none waiting unread in the
//! kernel, no response still being written) is closed to make room, as nginx
//! reuses keep-alive connections (connections already being closed are
//! waited for, up to [`CLOSING_WAIT`], since a burst of accepts can find the
//! registry full of them); when every connection has a request in
//! flight, a new client is served one answer on an overflow lane of
//! [`OVERFLOW`] connections (`/health` answers as usual, anything else gets a
//! 503 `too_many_connections` with `Retry-After`) and is closed; past the
//! lane, new connections are closed at once. The cap is lowered at start to
//! what the file-descriptor limit allows (the soft limit is raised toward
//! the hard one first), and an accept that fails for lack of descriptors
//! closes idle connections and retries: the server never stops accepting.
//! When no request is in flight after connections came and went, the memory
//! their buffers took is handed back to the system.
//!
//! A client that half-closes its socket after sending its request still gets
//! its response. An end of stream read while a request is in flight cannot
//! tell a half-close from a client that has gone, so it is held back from
//! hyper and reported to the handler ([`ClientEof`]), which then writes a
//! probe every [`PROBE`] (an SSE comment, or leading JSON whitespace after
//! committing a 200 head): a client that is gone answers with a reset, the
//! next write fails, and the request is cancelled.
//!
//! Shutdown: stop accepting, close the idle connections, let each one with a
//! request in flight finish its response (then close), and after the drain
//! timeout close the rest, which cancels their requests.

use crate::Limits;
use crate::api::ApiError;
use crate::metrics::Metrics;
use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tower_service::Service;

/// How often the sweeper checks the connections' timeouts.
pub const SWEEP: Duration = Duration::from_millis(100);
/// Connections beyond the cap that get one answer before they are closed.
pub const OVERFLOW: usize = 32;
/// How long an overflow connection may take to send its request.
pub const OVERFLOW_TIMEOUT: Duration = Duration::from_secs(2);
/// The interval of the probes written after a client's end of stream.
pub const PROBE: Duration = Duration::from_millis(100);
/// How long a new connection past the cap waits for connections being
/// closed to leave before it is sent to the overflow lane.
const CLOSING_WAIT: Duration = Duration::from_millis(200);
/// File descriptors kept for everything but connections.
const FD_RESERVE: usize = 32;
/// hyper's read and write buffer limit per connection.
const MAX_BUF: usize = 64 << 10;
/// The largest request head (request line and headers); past it, a 431.
const MAX_HEAD: usize = 32 << 10;

/// No request in flight.
const IDLE: u8 = 0;
/// A request in flight (from its head to the end of its response).
const BUSY: u8 = 1;
/// Being closed.
const CLOSING: u8 = 2;
/// A response is done but hyper may still be writing it out; idle once hyper
/// reads again (see [`Conn::reading`]).
const FINISHING: u8 = 3;

/// A clock of milliseconds since the server started, plus one (so that 0
/// means "never").
#[derive(Clone, Copy)]
struct Clock(Instant);

impl Clock {
    fn now(&self) -> u64 {
        self.0.elapsed().as_millis() as u64 + 1
    }
}

/// One connection's state, shared by its task, its [`Io`], its requests and
/// the sweeper.
struct Conn {
    phase: AtomicU8,
    /// When it last became idle.
    idle_since: AtomicU64,
    /// When the first byte of the next request arrived (0: none yet).
    head_since: AtomicU64,
    /// When a write started waiting (0: none waits).
    write_stalled: AtomicU64,
    /// Set when an end of stream was held back (read while busy).
    eof: watch::Sender<bool>,
    close: Notify,
    /// The socket, to see whether the kernel holds bytes not read yet. It
    /// stays open while the connection is registered (see [`Registered`]).
    #[cfg(unix)]
    fd: Option<std::os::fd::RawFd>,
}

impl Conn {
    fn new(now: u64) -> Conn {
        Conn {
            phase: AtomicU8::new(IDLE),
            idle_since: AtomicU64::new(now),
            head_since: AtomicU64::new(0),
            write_stalled: AtomicU64::new(0),
            eof: watch::channel(false).0,
            close: Notify::new(),
            #[cfg(unix)]
            fd: None,
        }
    }

    fn with_socket(now: u64, s: &TcpStream) -> Conn {
        #[cfg(unix)]
        {
            use std::os::fd::AsRawFd;
            Conn {
                fd: Some(s.as_raw_fd()),
                ..Conn::new(now)
            }
        }
        #[cfg(not(unix))]
        {
            let _ = s;
            Conn::new(now)
        }
    }

    /// Whether bytes from the client wait in the kernel, not read yet (a
    /// request on its way: the connection is not idle).
    fn has_unread(&self) -> bool {
        #[cfg(unix)]
        if let Some(fd) = self.fd {
            let mut b = 0u8;
            // SAFETY: `fd` is this connection's open socket (the registry
            // entry goes before the socket closes, and this runs under the
            // registry's lock); MSG_PEEK leaves the byte where it is.
            let n = unsafe {
                libc::recv(
                    fd,
                    (&raw mut b).cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            return n > 0;
        }
        false
    }

    /// hyper reads: a finished response has been written out (hyper reads
    /// the next request after it has written the last one, and flushed it
    /// unless the write is stuck, which the sweeper and eviction see).
    fn reading(&self, clock: Clock) {
        if self
            .phase
            .compare_exchange(FINISHING, IDLE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.idle_since.store(clock.now(), Ordering::Release);
        }
    }

    /// Close it if it is in `phase`; false when it was not.
    fn close_if(&self, phase: u8) -> bool {
        let ok = self
            .phase
            .compare_exchange(phase, CLOSING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if ok {
            self.close.notify_one();
        }
        ok
    }

    fn close_now(&self) {
        self.phase.store(CLOSING, Ordering::Release);
        self.close.notify_one();
    }
}

/// Marks a connection busy for as long as it lives: from when hyper has
/// parsed a request's head (taken in the service's synchronous part, before
/// hyper reads on) to the end of its response body.
struct Busy {
    conn: Arc<Conn>,
    clock: Clock,
}

impl Busy {
    fn enter(conn: &Arc<Conn>, clock: Clock) -> Option<Busy> {
        [IDLE, FINISHING].into_iter().find(|&from| {
            conn.phase
                .compare_exchange(from, BUSY, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })?;
        conn.head_since.store(0, Ordering::Release);
        Some(Busy {
            conn: conn.clone(),
            clock,
        })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let c = &self.conn;
        c.head_since.store(0, Ordering::Release);
        c.idle_since.store(self.clock.now(), Ordering::Release);
        let _ = c
            .phase
            .compare_exchange(BUSY, FINISHING, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// The socket as hyper sees it: records the first byte of each request's
/// head and stuck writes for the sweeper, and holds back an end of stream
/// read while a request is in flight (see the module doc).
struct Io {
    s: TcpStream,
    conn: Arc<Conn>,
    clock: Clock,
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let me = self.get_mut();
        me.conn.reading(me.clock);
        let before = buf.filled().len();
        let r = Pin::new(&mut me.s).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let c = &me.conn;
            if buf.filled().len() > before {
                if c.phase.load(Ordering::Acquire) == IDLE
                    && c.head_since.load(Ordering::Acquire) == 0
                {
                    c.head_since.store(me.clock.now(), Ordering::Release);
                }
            } else if c.phase.load(Ordering::Acquire) == BUSY {
                // A half-close or a client gone: the handler finds out
                // which by writing (a body cut short is answered by
                // `handle`). An end of stream stays readable, so hyper sees
                // it once the response is done.
                c.eof.send_replace(true);
                return Poll::Pending;
            }
        }
        r
    }
}

impl Io {
    fn track<T>(&self, r: Poll<T>) -> Poll<T> {
        match r {
            Poll::Pending => {
                let _ = self.conn.write_stalled.compare_exchange(
                    0,
                    self.clock.now(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            Poll::Ready(_) => self.conn.write_stalled.store(0, Ordering::Release),
        }
        r
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.s).poll_write(cx, buf);
        me.track(r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.s).poll_write_vectored(cx, bufs);
        me.track(r)
    }

    fn is_write_vectored(&self) -> bool {
        self.s.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let me = self.get_mut();
        let r = Pin::new(&mut me.s).poll_flush(cx);
        me.track(r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().s).poll_shutdown(cx)
    }
}

/// A request's handle on its client's end of stream (a request extension):
/// [`ClientEof::wait`] resolves once the client has half-closed or gone.
#[derive(Clone)]
pub struct ClientEof(watch::Receiver<bool>);

impl ClientEof {
    /// A handle that never fires.
    pub fn never() -> ClientEof {
        ClientEof(watch::channel(false).1)
    }

    /// Resolves when an end of stream was read from the client.
    pub fn wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.0.clone();
        async move {
            if rx.wait_for(|&v| v).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// A response body that keeps its connection busy until it is dropped.
struct Guarded {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A JSON error response that closes the connection.
fn refuse(e: ApiError, retry: bool) -> Response<Body> {
    let mut r = Response::new(Body::from(e.body().to_string()));
    *r.status_mut() = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    if retry {
        h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

fn request_error(status: u16, message: String) -> ApiError {
    ApiError {
        status,
        message,
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}

/// What the accept loop and the sweeper share.
struct Shared {
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    clock: Clock,
    overflow: AtomicUsize,
    metrics: Arc<Metrics>,
    limits: Limits,
    max_connections: usize,
    max_body: usize,
}

impl Shared {
    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Set the open-connections gauge from the registry: the connections
    /// not being closed (an evicted or timed-out one keeps its place until
    /// its task ends, and would read as open past the cap).
    fn count_open(&self, conns: &HashMap<u64, Arc<Conn>>) {
        let open = conns
            .values()
            .filter(|c| c.phase.load(Ordering::Acquire) != CLOSING)
            .count();
        self.metrics.connections_open.set(open as u64);
    }

    /// Close the connection idle the longest; false when none is idle. One
    /// whose next request waits in the kernel, not read yet, is not idle.
    fn evict_idle(&self) -> bool {
        let conns = self.conns();
        let mut idle: Vec<&Arc<Conn>> = conns
            .values()
            .filter(|c| c.phase.load(Ordering::Acquire) == IDLE)
            .collect();
        idle.sort_by_key(|c| c.idle_since.load(Ordering::Acquire));
        for c in idle {
            // Not one still writing a response out, nor one whose next
            // request waits in the kernel.
            if c.write_stalled.load(Ordering::Acquire) == 0 && !c.has_unread() && c.close_if(IDLE) {
                self.metrics.connections_evicted.inc(1);
                self.count_open(&conns);
                return true;
            }
        }
        false
    }

    /// Wait (at most [`CLOSING_WAIT`]) while connections being closed still
    /// hold places in the registry; true once it has room below the cap.
    async fn wait_for_closing(&self) -> bool {
        let until = Instant::now() + CLOSING_WAIT;
        loop {
            let (n, closing) = {
                let conns = self.conns();
                let closing = conns
                    .values()
                    .filter(|c| c.phase.load(Ordering::Acquire) == CLOSING)
                    .count();
                (conns.len(), closing)
            };
            if n < self.max_connections {
                return true;
            }
            if closing == 0 || Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Connections with a request in flight.
    fn busy(&self) -> usize {
        self.conns()
            .values()
            .filter(|c| c.phase.load(Ordering::Acquire) == BUSY)
            .count()
    }

    /// Close the connections past their timeouts.
    fn sweep(&self) {
        let now = self.clock.now();
        let ms = |d: Duration| d.as_millis() as u64;
        let (read, write, idle) = (
            ms(self.limits.timeout),
            ms(self.limits.timeout),
            ms(self.limits.keep_alive),
        );
        let conns = self.conns();
        for c in conns.values() {
            let phase = c.phase.load(Ordering::Acquire);
            let stalled = c.write_stalled.load(Ordering::Acquire);
            // A write waiting (the tail of a response, too, once the
            // connection is idle again) answers to the write timeout only.
            let late = if stalled != 0 {
                now.saturating_sub(stalled) > write
            } else if phase == IDLE || phase == FINISHING {
                let head = c.head_since.load(Ordering::Acquire);
                if head != 0 {
                    now.saturating_sub(head) > read
                } else {
                    now.saturating_sub(c.idle_since.load(Ordering::Acquire)) > idle
                }
            } else {
                false
            };
            let closed = late && phase != CLOSING && c.close_if(phase);
            if closed {
                self.metrics.connections_timed_out.inc(1);
            }
        }
        self.count_open(&conns);
    }
}

/// Read a request's body whole (within the body limit and the read
/// timeout), then hand the request to the router with its [`ClientEof`].
async fn handle(
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    busy: Option<Busy>,
    mut router: Router,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let Some(busy) = busy else {
        // Closed by the sweeper or an eviction as the head arrived.
        return Ok(refuse(
            ApiError {
                status: 503,
                message: "the connection is closing; retry on a new one".into(),
                kind: "server_error",
                param: None,
                code: Some("connection_closing"),
            },
            true,
        ));
    };
    let limit = shared.max_body;
    let too_large = || {
        request_error(
            413,
            format!(
                "the request body is larger than the server's limit of {limit} bytes (--max-body)"
            ),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        shared.metrics.bad_requests.inc(1);
        return Ok(guard(refuse(too_large(), false), busy));
    }
    let (parts, body) = req.into_parts();
    let eof = ClientEof(conn.eof.subscribe());
    let bytes = match read_body(body, limit, shared.limits.timeout, &eof).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            shared.metrics.bad_requests.inc(1);
            let e = if e.downcast_ref::<LengthLimitError>().is_some() {
                too_large()
            } else {
                request_error(400, format!("could not read the request body: {e}"))
            };
            return Ok(guard(refuse(e, false), busy));
        }
        Err(BodyCut::Late) => {
            shared.metrics.bad_requests.inc(1);
            let e = request_error(
                408,
                format!(
                    "the request body did not arrive within {} s (--timeout)",
                    shared.limits.timeout.as_secs_f64()
                ),
            );
            return Ok(guard(refuse(e, false), busy));
        }
        Err(BodyCut::Closed) => {
            shared.metrics.bad_requests.inc(1);
            let e = request_error(
                400,
                "the client closed its side before sending the whole request body".into(),
            );
            return Ok(guard(refuse(e, false), busy));
        }
    };
    let mut req = Request::from_parts(parts, Body::from(bytes));
    req.extensions_mut().insert(eof);
    let resp = match router.call(req).await {
        Ok(r) => r,
        Err(e) => match e {},
    };
    Ok(guard(resp, busy))
}

/// Why a request body was not read whole.
enum BodyCut {
    /// Not within the read timeout.
    Late,
    /// The client closed its side first.
    Closed,
}

/// Read a body whole within `limit` bytes and `timeout`; an end of stream
/// from the client leaves it a moment to finish (hyper may hand over the
/// last bytes after the end of stream was seen).
async fn read_body(
    body: Incoming,
    limit: usize,
    timeout: Duration,
    eof: &ClientEof,
) -> Result<Result<Bytes, Box<dyn std::error::Error + Send + Sync>>, BodyCut> {
    let collect = Limited::new(body, limit).collect();
    let late = tokio::time::sleep(timeout);
    let gone = eof.wait();
    tokio::pin!(collect, late, gone);
    let mut closed = false;
    loop {
        tokio::select! {
            biased;
            r = &mut collect => return Ok(r.map(|c| c.to_bytes())),
            _ = &mut late => return Err(if closed { BodyCut::Closed } else { BodyCut::Late }),
            _ = &mut gone, if !closed => {
                closed = true;
                let soon = tokio::time::Instant::now() + Duration::from_millis(200);
                if soon < late.deadline() {
                    late.as_mut().reset(soon);
                }
            }
        }
    }
}

fn guard(r: Response<Body>, busy: Busy) -> Response<Body> {
    r.map(|inner| Body::new(Guarded { inner, _busy: busy }))
}

/// Serve one connection until it ends, is closed, or (draining) its
/// response is done.
async fn serve_conn(
    shared: Arc<Shared>,
    id: u64,
    conn: Arc<Conn>,
    stream: TcpStream,
    router: Router,
    mut drain: watch::Receiver<bool>,
) {
    let io = Io {
        s: stream,
        conn: conn.clone(),
        clock: shared.clock,
    };
    let (s2, c2) = (shared.clone(), conn.clone());
    let svc = hyper::service::service_fn(move |req| {
        // Busy from here: hyper reads on before it polls the handler.
        let busy = Busy::enter(&c2, s2.clock);
        handle(s2.clone(), c2.clone(), busy, router.clone(), req)
    });
    let mut b = http1::Builder::new();
    b.max_buf_size(MAX_BUF)
        .max_header_size(MAX_HEAD)
        .header_read_timeout(None);
    let c = b.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(c);
    // Dropped before `c` (and the socket in it), even when the task is
    // aborted.
    let _registered = Registered {
        shared: shared.clone(),
        id,
    };
    let mut draining = *drain.borrow_and_update();
    if draining {
        c.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            _ = c.as_mut() => break,
            _ = conn.close.notified() => break,
            _ = drain.changed(), if !draining => {
                draining = true;
                c.as_mut().graceful_shutdown();
            }
        }
    }
}

/// A connection's place in the registry, given up when dropped.
struct Registered {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut conns = self.shared.conns();
        conns.remove(&self.id);
        self.shared.count_open(&conns);
    }
}

/// Answer one request past the connection cap: `/health` as usual, anything
/// else a 503; then close.
async fn serve_overflow(shared: Arc<Shared>, stream: TcpStream, max_connections: usize) {
    let m = shared.metrics.clone();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let m = m.clone();
        async move {
            let r = if req.uri().path() == "/health" {
                let mut r = Response::new(Body::from(r#"{"status":"ok"}"#));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                r
            } else {
                m.connections_refused.inc(1);
                refuse(
                    ApiError {
                        status: 503,
                        message: format!(
                            "the server is busy: all {max_connections} connections have a request in flight (--max-connections); retry later"
                        ),
                        kind: "server_error",
                        param: None,
                        code: Some("too_many_connections"),
                    },
                    true,
                )
            };
            Ok::<_, Infallible>(r)
        }
    });
    let mut b = http1::Builder::new();
    b.keep_alive(false)
        .max_buf_size(MAX_BUF)
        .max_header_size(MAX_HEAD)
        .header_read_timeout(None);
    let t = OVERFLOW_TIMEOUT.min(shared.limits.timeout);
    let _ = tokio::time::timeout(t, b.serve_connection(TokioIo::new(stream), svc)).await;
    shared.overflow.fetch_sub(1, Ordering::AcqRel);
}

/// Pending connections the listener queues before accepting them (the kernel
/// caps it at `net.core.somaxconn`): a burst of connections waits for the
/// accept loop instead of having its SYNs dropped, which costs each client a
/// second before it retries.
pub const BACKLOG: u32 = 4096;

/// Listen on `addr` (`host:port`) with a [`BACKLOG`]. On Linux, a
/// connection is handed to the server only once its first bytes arrived, or
/// after about `idle` (`TCP_DEFER_ACCEPT`, as nginx's `listen ... deferred`):
/// a crowd of connections that send nothing waits in the kernel instead of
/// taking the server's descriptors and connection slots.
pub async fn listen(addr: &str, idle: Duration) -> std::io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let s = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        #[cfg(unix)]
        s.set_reuseaddr(true)?;
        #[cfg(target_os = "linux")]
        defer_accept(&s, idle);
        #[cfg(not(target_os = "linux"))]
        let _ = idle;
        match s.bind(a).and_then(|()| s.listen(BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            "no address to listen on",
        )
    }))
}

/// Set `TCP_DEFER_ACCEPT` to `idle`, in whole seconds (at least 1); a failure
/// only loses the protection, so it is logged.
#[cfg(target_os = "linux")]
fn defer_accept(s: &tokio::net::TcpSocket, idle: Duration) {
    use std::os::fd::AsRawFd;
    let secs = idle.as_secs_f64().ceil().clamp(1.0, 3600.0) as libc::c_int;
    // SAFETY: the socket is open; the option is a c_int read by the kernel.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&raw const secs).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::warn!(
            "TCP_DEFER_ACCEPT: {}; connections that send nothing take slots at once",
            std::io::Error::last_os_error()
        );
    }
}

/// Whether an accept error means the process is out of file descriptors.
fn out_of_fds(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    {
        matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
    }
    #[cfg(not(unix))]
    {
        let _ = e;
        false
    }
}

/// The connections the file-descriptor limit leaves room for, beside the
/// overflow lane and [`FD_RESERVE`] for the rest of the process, raising the
/// soft limit toward the hard one as far as `wanted` needs; `None` when the
/// limit cannot be read.
pub fn fd_room(wanted: usize) -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        let used = std::fs::read_dir("/proc/self/fd").ok()?.count();
        let need = (wanted + OVERFLOW + FD_RESERVE + used) as libc::rlim_t;
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
            return None;
        }
        if r.rlim_cur < need {
            let raised = libc::rlimit {
                rlim_cur: need.min(r.rlim_max),
                rlim_max: r.rlim_max,
            };
            // SAFETY: setrlimit reads the struct it is given.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                r.rlim_cur = raised.rlim_cur;
            }
        }
        Some((r.rlim_cur as usize).saturating_sub(OVERFLOW + FD_RESERVE + used))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = wanted;
        None
    }
}

/// Serve `router` on `listener` under `limits` until `shutdown` resolves,
/// then drain (see the module doc). `max_connections` is the cap in force
/// (see [`fd_room`]).
pub async fn run(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    max_connections: usize,
    max_body: usize,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let shared = Arc::new(Shared {
        conns: Mutex::new(HashMap::new()),
        clock: Clock(Instant::now()),
        overflow: AtomicUsize::new(0),
        metrics,
        limits,
        max_connections: max_connections.max(1),
        max_body,
    });
    let sweeper = {
        let s = shared.clone();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(SWEEP);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // When no request is in flight and connections came and went
            // since the last time, hand the memory their buffers took back
            // to the system (at most once a second).
            let mut trimmed_at = (0, Instant::now());
            loop {
                t.tick().await;
                s.sweep();
                let seen = s.metrics.connections.get();
                if seen != trimmed_at.0
                    && trimmed_at.1.elapsed() >= Duration::from_secs(1)
                    && s.busy() == 0
                {
                    trimmed_at = (seen, Instant::now());
                    tokio::task::spawn_blocking(crate::trim_heap);
                }
            }
        })
    };
    let (drain_tx, drain_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut next_id = 0u64;
    let mut fd_warned: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors: close the longest idle connections
                // and let their tasks run; with none idle, wait a little.
                let fds = out_of_fds(&e);
                let freed = fds && (0..8).filter(|_| shared.evict_idle()).count() > 0;
                if fds && fd_warned.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(
                        "accept: {e}; closing idle connections (raise `ulimit -n` or lower --max-connections)"
                    );
                    fd_warned = Some(Instant::now());
                }
                if freed {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        shared.metrics.connections.inc(1);
        if shared.conns().len() >= shared.max_connections {
            // Make room: close the connection idle the longest. With none
            // idle, connections just evicted or swept may still hold places
            // (they leave once their tasks run, and a burst of accepts can
            // find the registry full of them): wait for those, briefly,
            // before turning the client away.
            let room =
                shared.evict_idle() || shared.wait_for_closing().await || shared.evict_idle();
            if room {
                // Let an evicted connection's task close its socket before
                // the next accept takes another descriptor.
                tokio::task::yield_now().await;
            } else {
                if shared.overflow.fetch_add(1, Ordering::AcqRel) < OVERFLOW {
                    tasks.spawn(serve_overflow(
                        shared.clone(),
                        stream,
                        shared.max_connections,
                    ));
                } else {
                    shared.overflow.fetch_sub(1, Ordering::AcqRel);
                    shared.metrics.connections_refused.inc(1);
                    drop(stream);
                }
                continue;
            }
        }
        next_id += 1;
        let conn = Arc::new(Conn::with_socket(shared.clock.now(), &stream));
        {
            let mut conns = shared.conns();
            conns.insert(next_id, conn.clone());
            shared.count_open(&conns);
        }
        tasks.spawn(serve_conn(
            shared.clone(),
            next_id,
            conn,
            stream,
            router.clone(),
            drain_rx.clone(),
        ));
    }
    drop(listener);
    drop(router);
    // Draining: idle connections close now, busy ones after their response.
    let _ = drain_tx.send(true);
    let busy = {
        let conns = shared.conns();
        for c in conns.values() {
            c.close_if(IDLE);
        }
        shared.count_open(&conns);
        conns
            .values()
            .filter(|c| c.phase.load(Ordering::Acquire) == BUSY)
            .count()
    };
    tracing::info!(
        busy,
        drain_timeout_s = shared.limits.drain_timeout.as_secs_f64(),
        "draining: no new connections; waiting for the responses in flight"
    );
    let deadline = tokio::time::sleep(shared.limits.drain_timeout);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => {
                let left = shared.conns().len();
                tracing::warn!(left, "drain timeout: closing the remaining connections (their requests are cancelled)");
                let conns = shared.conns();
                for c in conns.values() {
                    c.close_now();
                }
                shared.count_open(&conns);
                break;
            }
            r = tasks.join_next() => if r.is_none() { break },
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tasks.abort_all();
    sweeper.abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(limits: Limits) -> Shared {
        Shared {
            conns: Mutex::new(HashMap::new()),
            clock: Clock(Instant::now()),
            overflow: AtomicUsize::new(0),
            metrics: Arc::new(Metrics::default()),
            limits,
            max_connections: 4,
            max_body: 1024,
        }
    }

    fn add(s: &Shared, id: u64, c: Conn) -> Arc<Conn> {
        let c = Arc::new(c);
        s.conns().insert(id, c.clone());
        c
    }

    #[test]
    fn eviction_takes_the_longest_idle_and_spares_busy_ones() {
        let s = shared(Limits::default());
        let old_busy = add(&s, 1, Conn::new(1));
        old_busy.phase.store(BUSY, Ordering::Release);
        // Idle, but a response's tail is still waiting to be written.
        let old_writing = add(&s, 4, Conn::new(1));
        old_writing.write_stalled.store(3, Ordering::Release);
        let newer = add(&s, 2, Conn::new(50));
        let older = add(&s, 3, Conn::new(10));
        assert!(s.evict_idle());
        assert_eq!(older.phase.load(Ordering::Acquire), CLOSING);
        assert_eq!(newer.phase.load(Ordering::Acquire), IDLE);
        assert!(s.evict_idle());
        assert_eq!(newer.phase.load(Ordering::Acquire), CLOSING);
        // Only the busy and the writing one are left: nothing to evict.
        assert!(!s.evict_idle());
        assert_eq!(old_busy.phase.load(Ordering::Acquire), BUSY);
        assert_eq!(old_writing.phase.load(Ordering::Acquire), IDLE);
        assert_eq!(s.metrics.connections_evicted.get(), 2);
        // The two being closed still hold places but no longer count as open.
        assert_eq!(s.conns().len(), 4);
        assert_eq!(s.metrics.connections_open.get(), 2);
    }

    #[tokio::test]
    async fn a_full_registry_waits_for_its_closing_connections_only() {
        let s = Arc::new(shared(Limits::default()));
        for id in 0..4 {
            add(&s, id, Conn::new(1))
                .phase
                .store(BUSY, Ordering::Release);
        }
        // Full, every connection busy, none closing: no room, no wait.
        let t = Instant::now();
        assert!(!s.wait_for_closing().await);
        assert!(t.elapsed() < CLOSING_WAIT / 2);
        // One being closed leaves the registry a moment later: room.
        s.conns()[&3].phase.store(CLOSING, Ordering::Release);
        let s2 = s.clone();
        let leave = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            s2.conns().remove(&3);
        });
        assert!(s.wait_for_closing().await);
        leave.await.unwrap();
        // One closing that never leaves: the wait ends, without room.
        add(&s, 3, Conn::new(1))
            .phase
            .store(CLOSING, Ordering::Release);
        let t = Instant::now();
        assert!(!s.wait_for_closing().await);
        assert!(t.elapsed() >= CLOSING_WAIT);
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn a_connection_whose_request_waits_unread_is_not_evicted() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        let mut sent = std::net::TcpStream::connect(a).unwrap();
        let (older, _) = l.accept().await.unwrap();
        let _quiet = std::net::TcpStream::connect(a).unwrap();
        let (newer, _) = l.accept().await.unwrap();
        std::io::Write::write_all(&mut sent, b"GET /health HTTP/1.1\r\n\r\n").unwrap();
        let s = shared(Limits::default());
        let older_c = add(&s, 1, Conn::with_socket(1, &older));
        let newer_c = add(&s, 2, Conn::with_socket(2, &newer));
        // The bytes reach the server's socket.
        let t = Instant::now();
        while !older_c.has_unread() {
            assert!(t.elapsed() < Duration::from_secs(5));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(!newer_c.has_unread());
        assert!(s.evict_idle());
        assert_eq!(newer_c.phase.load(Ordering::Acquire), CLOSING);
        assert_eq!(older_c.phase.load(Ordering::Acquire), IDLE);
        assert!(!s.evict_idle());
    }

    #[test]
    fn the_sweeper_closes_idle_slow_and_stuck_connections_only() {
        let s = shared(Limits {
            timeout: Duration::from_millis(1000),
            keep_alive: Duration::from_millis(300),
            ..Limits::default()
        });
        // Let the clock pass 2 s.
        let s = Shared {
            clock: Clock(Instant::now() - Duration::from_secs(2)),
            ..s
        };
        let now = s.clock.now();
        let fresh = add(&s, 1, Conn::new(now - 100));
        let idle = add(&s, 2, Conn::new(now - 400));
        let slow_head = add(&s, 3, Conn::new(now - 1500));
        slow_head.head_since.store(now - 1200, Ordering::Release);
        let head_in_time = add(&s, 4, Conn::new(now - 1500));
        head_in_time.head_since.store(now - 800, Ordering::Release);
        let stuck = add(&s, 5, Conn::new(1));
        stuck.phase.store(BUSY, Ordering::Release);
        stuck.write_stalled.store(now - 1100, Ordering::Release);
        let writing = add(&s, 6, Conn::new(1));
        writing.phase.store(BUSY, Ordering::Release);
        writing.write_stalled.store(now - 500, Ordering::Release);
        let thinking = add(&s, 7, Conn::new(1));
        thinking.phase.store(BUSY, Ordering::Release);
        // Idle past the keep-alive timeout, but still writing a response's
        // tail: the write timeout applies.
        let flushing = add(&s, 8, Conn::new(now - 900));
        flushing.write_stalled.store(now - 900, Ordering::Release);
        s.sweep();
        let phase = |c: &Arc<Conn>| c.phase.load(Ordering::Acquire);
        assert_eq!(phase(&fresh), IDLE);
        assert_eq!(phase(&idle), CLOSING);
        assert_eq!(phase(&slow_head), CLOSING);
        assert_eq!(phase(&head_in_time), IDLE);
        assert_eq!(phase(&stuck), CLOSING);
        assert_eq!(phase(&writing), BUSY);
        assert_eq!(phase(&thinking), BUSY);
        assert_eq!(phase(&flushing), IDLE);
        assert_eq!(s.metrics.connections_timed_out.get(), 3);
    }

    #[test]
    fn a_request_marks_its_connection_busy_until_its_response_is_dropped() {
        let c = Arc::new(Conn::new(1));
        let clock = Clock(Instant::now());
        c.head_since.store(5, Ordering::Release);
        let b = Busy::enter(&c, clock).unwrap();
        assert_eq!(c.phase.load(Ordering::Acquire), BUSY);
        assert_eq!(c.head_since.load(Ordering::Acquire), 0);
        // One request at a time.
        assert!(Busy::enter(&c, clock).is_none());
        drop(b);
        // Done, maybe not written out yet: not idle (not evicted) until
        // hyper reads again.
        assert_eq!(c.phase.load(Ordering::Acquire), FINISHING);
        let s = shared(Limits::default());
        s.conns().insert(1, c.clone());
        assert!(!s.evict_idle());
        c.reading(clock);
        assert_eq!(c.phase.load(Ordering::Acquire), IDLE);
        // A pipelined request may come before that.
        c.phase.store(FINISHING, Ordering::Release);
        drop(Busy::enter(&c, clock).unwrap());
        c.reading(clock);
        // A closing connection takes no request and stays closing.
        assert!(c.close_if(IDLE));
        assert!(Busy::enter(&c, clock).is_none());
        assert_eq!(c.phase.load(Ordering::Acquire), CLOSING);
    }
}
