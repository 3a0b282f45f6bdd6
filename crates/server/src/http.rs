//! The HTTP side: routes, request checks, queueing, and the responses
//! (JSON, or server-sent events ending with `data: [DONE]`).
//!
//! Routes:
//! - `POST /v1/chat/completions`, `POST /v1/completions` (fields: [`api`]).
//! - `GET /v1/models`, and `GET /v1/models/{id}`: the model object, or a 404
//!   with OpenAI's error object for another id.
//! - `POST /tokenize`: `{"content": "...", "add_special": false,
//!   "with_pieces": false}` gives `{"tokens": [ids]}`, or with `with_pieces`
//!   `{"tokens": [{"id": id, "piece": "..."}]}` (llama-server's shape;
//!   special tokens in the text are recognized; `add_special` prepends BOS
//!   when the model asks for it).
//! - `POST /detokenize`: `{"tokens": [ids]}` gives `{"content": "..."}`
//!   (special tokens are left out, as in the completions' text).
//! - `GET /health`, `GET /metrics` (Prometheus text).

use crate::api::{self, ApiError, ChatRequest, CompletionRequest, Settings};
use crate::metrics::Metrics;
use crate::scheduler::{Event, Job, TokenLogprob, Usage};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use samesum_engine::sample::SamplerConfig;
use samesum_engine::tokenizer::Tokenizer;
use serde::Deserialize;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// What the handlers share.
pub struct App {
    /// The model thread's queue.
    pub queue: SyncSender<Job>,
    /// The tokenizer (prompts are tokenized and checked before queueing).
    pub tok: Arc<Tokenizer>,
    /// The name `/v1/models` reports.
    pub model_name: String,
    /// Context size per request.
    pub ctx: usize,
    /// The request body limit (for the 413 message).
    pub max_body: usize,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Request ids.
    pub next_id: AtomicU64,
}

/// The router.
pub fn router(app: Arc<App>) -> Router {
    let limit = app.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .with_state(app)
}

fn error(app: &App, e: ApiError) -> Response {
    if e.status < 500 {
        app.metrics.bad_requests.inc(1);
    }
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut r = (status, axum::Json(e.body())).into_response();
    if e.status == 503 {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

async fn not_found() -> Response {
    let e = ApiError {
        status: 404,
        message: "no such endpoint (try /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health, /metrics)".into(),
        kind: "invalid_request_error",
        param: None,
        code: None,
    };
    (StatusCode::NOT_FOUND, axum::Json(e.body())).into_response()
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn model_object(app: &App) -> Value {
    json!({"id": app.model_name, "object": "model", "created": now_secs(), "owned_by": "samesum"})
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id == app.model_name {
        return axum::Json(model_object(&app)).into_response();
    }
    let e = ApiError {
        status: 404,
        message: format!(
            "the model {id:?} does not exist (this server serves {:?})",
            app.model_name
        ),
        kind: "invalid_request_error",
        param: Some("model".into()),
        code: Some("model_not_found"),
    };
    (StatusCode::NOT_FOUND, axum::Json(e.body())).into_response()
}

/// `POST /tokenize` (llama-server's fields).
#[derive(Deserialize)]
struct TokenizeRequest {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

/// `POST /detokenize`.
#[derive(Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

async fn tokenize(State(app): State<Arc<App>>, b: Result<Bytes, BytesRejection>) -> Response {
    let a = app.clone();
    let run = move || -> Result<Value, ApiError> {
        let app = a;
        let b = body(&app, b)?;
        let req: TokenizeRequest = api::parse(&b)?;
        let mut ids = app
            .tok
            .encode(&req.content)
            .map_err(|e| ApiError::bad(Some("content".into()), e.to_string()))?;
        if !req.add_special
            && app.tok.add_bos
            && app.tok.bos.is_some()
            && ids.first() == app.tok.bos.as_ref()
        {
            ids.remove(0);
        }
        if !req.with_pieces {
            return Ok(json!({"tokens": ids}));
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in &ids {
            let piece = app
                .tok
                .decode(&[id])
                .map_err(|e| ApiError::bad(Some("content".into()), e.to_string()))?;
            // A special token decodes to nothing; its piece is its text.
            let piece = if piece.is_empty() {
                app.tok.token(id).to_string()
            } else {
                piece
            };
            out.push(json!({"id": id, "piece": piece}));
        }
        Ok(json!({"tokens": out}))
    };
    match off_http(run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => error(&app, e),
    }
}

async fn detokenize(State(app): State<Arc<App>>, b: Result<Bytes, BytesRejection>) -> Response {
    let a = app.clone();
    let run = move || -> Result<Value, ApiError> {
        let app = a;
        let b = body(&app, b)?;
        let req: DetokenizeRequest = api::parse(&b)?;
        if let Some((i, &t)) = req
            .tokens
            .iter()
            .enumerate()
            .find(|&(_, &t)| t as usize >= app.tok.len())
        {
            return Err(ApiError::bad(
                Some(format!("tokens[{i}]")),
                format!(
                    "token id {t} is outside the vocabulary of {} tokens",
                    app.tok.len()
                ),
            ));
        }
        let content = app
            .tok
            .decode(&req.tokens)
            .map_err(|e| ApiError::bad(Some("tokens".into()), e.to_string()))?;
        Ok(json!({"content": content}))
    };
    match off_http(run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => error(&app, e),
    }
}

fn body(app: &App, b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        let status = r.status().as_u16();
        ApiError {
            status,
            message: if status == 413 {
                format!(
                    "the request body is larger than the server's limit of {} bytes (--max-body)",
                    app.max_body
                )
            } else {
                format!("could not read the request body: {r}")
            },
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    })
}

/// Tokenize-checked prompt into a queued job; returns the event receiver.
fn submit(
    app: &App,
    id: &str,
    prompt: Vec<u32>,
    s: &Settings,
) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad(
            Some("prompt".into()),
            "the prompt is empty after tokenization",
        ));
    }
    let room = app.ctx.saturating_sub(prompt.len());
    if room == 0 || s.max_tokens.is_some_and(|n| n > room) {
        return Err(ApiError {
            status: 400,
            message: format!(
                "this model's context is {} tokens; the prompt has {} and {} were requested for the completion",
                app.ctx,
                prompt.len(),
                s.max_tokens
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "at least 1".into())
            ),
            kind: "invalid_request_error",
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
        });
    }
    if let Some(&(t, _)) = s
        .logit_bias
        .iter()
        .find(|&&(t, _)| t as usize >= app.tok.len())
    {
        return Err(ApiError::bad(
            Some("logit_bias".into()),
            format!(
                "logit_bias: token id {t} is outside the vocabulary of {} tokens",
                app.tok.len()
            ),
        ));
    }
    if s.max_tokens == Some(0) {
        return Err(ApiError::bad(
            Some("max_tokens".into()),
            "max_tokens must be at least 1",
        ));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let seed = s.seed.unwrap_or_else(|| {
        // No seed: a different stream per request.
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        (t as u64)
            ^ app
                .next_id
                .load(Ordering::Relaxed)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
    });
    let job = Job {
        id: id.to_string(),
        prompt,
        max_new: s.max_tokens.unwrap_or(room),
        sampler: SamplerConfig {
            temp: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repeat_penalty: s.repeat_penalty,
            repeat_last_n: s.repeat_last_n.unwrap_or(usize::MAX),
            seed,
        },
        penalties: s.penalties,
        logit_bias: s.logit_bias.clone(),
        stop: s.stop.clone(),
        logprobs: s.logprobs,
        ignore_eos: s.ignore_eos,
        events: tx,
        queued: Instant::now(),
    };
    // Counted before the send: the model thread may take it at once.
    app.metrics.queue_depth.inc();
    match app.queue.try_send(job) {
        Ok(()) => {
            app.metrics.requests.inc(1);
            Ok(rx)
        }
        Err(TrySendError::Full(_)) => {
            app.metrics.queue_depth.dec();
            app.metrics.rejected.inc(1);
            Err(ApiError {
                status: 503,
                message: "the server is busy: the request queue is full (--max-queue); retry later"
                    .into(),
                kind: "server_error",
                param: None,
                code: Some("queue_full"),
            })
        }
        Err(TrySendError::Disconnected(_)) => Err({
            app.metrics.queue_depth.dec();
            ApiError {
                status: 500,
                message: "the model thread has stopped".into(),
                kind: "server_error",
                param: None,
                code: None,
            }
        }),
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

fn timings_json(u: &Usage) -> Value {
    let per = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    json!({
        "queue_ms": u.queue_ms,
        "prompt_n": u.prompt_tokens,
        "prompt_ms": u.prompt_ms,
        "prompt_per_second": per(u.prompt_tokens, u.prompt_ms),
        "predicted_n": u.completion_tokens,
        "predicted_ms": u.gen_ms,
        "predicted_per_second": per(u.completion_tokens, u.gen_ms),
    })
}

fn chat_logprob(lp: &TokenLogprob) -> Value {
    let bytes = |s: &str| s.as_bytes().to_vec();
    json!({
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": bytes(&lp.token),
        "top_logprobs": lp.top.iter().map(|(t, l)| json!({"token": t, "logprob": l, "bytes": bytes(t)})).collect::<Vec<_>>(),
    })
}

/// Which API shape a response takes.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

/// Run request parsing, chat templating and tokenizing on tokio's blocking
/// pool, off the threads that answer HTTP: a large prompt or a slow
/// template never holds up `/health` or other requests.
async fn off_http<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError {
            status: 500,
            message: format!("preparing the request failed: {e}"),
            kind: "server_error",
            param: None,
            code: None,
        })
    })
}

async fn chat(State(app): State<Arc<App>>, b: Result<Bytes, BytesRejection>) -> Response {
    let a = app.clone();
    let run = move || -> Result<(Vec<u32>, Settings), ApiError> {
        let app = a;
        let b = body(&app, b)?;
        let req: ChatRequest = api::parse(&b)?;
        req.log_ignored();
        let (msgs, s) = req.check()?;
        let msgs: Vec<(&str, &str)> = msgs.iter().map(|(r, t)| (r.as_str(), t.as_str())).collect();
        let text = app
            .tok
            .chat_messages(&msgs)
            .map_err(|e| ApiError::bad(Some("messages".into()), e.to_string()))?;
        let ids = app
            .tok
            .encode(&text)
            .map_err(|e| ApiError::bad(Some("messages".into()), e.to_string()))?;
        Ok((ids, s))
    };
    match off_http(run).await {
        Ok((ids, s)) => respond(app, Kind::Chat, ids, s).await,
        Err(e) => error(&app, e),
    }
}

async fn completions(State(app): State<Arc<App>>, b: Result<Bytes, BytesRejection>) -> Response {
    let a = app.clone();
    let run = move || -> Result<(Vec<u32>, Settings), ApiError> {
        let app = a;
        let b = body(&app, b)?;
        let req: CompletionRequest = api::parse(&b)?;
        req.log_ignored();
        let (prompt, s) = req.check()?;
        let ids = app
            .tok
            .encode(&prompt)
            .map_err(|e| ApiError::bad(Some("prompt".into()), e.to_string()))?;
        Ok((ids, s))
    };
    match off_http(run).await {
        Ok((ids, s)) => respond(app, Kind::Completion, ids, s).await,
        Err(e) => error(&app, e),
    }
}

async fn respond(app: Arc<App>, kind: Kind, ids: Vec<u32>, s: Settings) -> Response {
    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{n}"),
        Kind::Completion => format!("cmpl-{n}"),
    };
    let rx = match submit(&app, &id, ids, &s) {
        Ok(rx) => rx,
        Err(e) => return error(&app, e),
    };
    let created = now_secs();
    let model = app.model_name.clone();
    if s.stream {
        stream(kind, id, created, model, rx, s.logprobs.is_some()).into_response()
    } else {
        collect(kind, id, created, model, rx, s.logprobs.is_some()).await
    }
}

async fn collect(
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    want_lp: bool,
) -> Response {
    let mut text = String::new();
    let mut lps: Vec<TokenLogprob> = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { text: t, logprob } => {
                text.push_str(&t);
                if let Some(l) = logprob {
                    lps.push(l);
                }
            }
            Event::Error(msg) => {
                let e = ApiError {
                    status: 500,
                    message: msg,
                    kind: "server_error",
                    param: None,
                    code: None,
                };
                return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(e.body())).into_response();
            }
            Event::Done { finish, usage } => {
                let body = match kind {
                    Kind::Chat => json!({
                        "id": id, "object": "chat.completion", "created": created, "model": model,
                        "choices": [{
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": if want_lp { json!({"content": lps.iter().map(chat_logprob).collect::<Vec<_>>()}) } else { Value::Null },
                            "finish_reason": finish,
                        }],
                        "usage": usage_json(&usage),
                        "timings": timings_json(&usage),
                    }),
                    Kind::Completion => json!({
                        "id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{
                            "index": 0,
                            "text": text,
                            "logprobs": if want_lp { completion_logprobs(&lps) } else { Value::Null },
                            "finish_reason": finish,
                        }],
                        "usage": usage_json(&usage),
                        "timings": timings_json(&usage),
                    }),
                };
                return axum::Json(body).into_response();
            }
        }
    }
    let e = ApiError {
        status: 500,
        message: "the request ended without a result".into(),
        kind: "server_error",
        param: None,
        code: None,
    };
    (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(e.body())).into_response()
}

fn completion_logprobs(lps: &[TokenLogprob]) -> Value {
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for l in lps {
        offsets.push(offset);
        offset += l.token.len();
    }
    json!({
        "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| {
            let m: serde_json::Map<String, Value> = l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect();
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn stream(
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    want_lp: bool,
) -> Sse<impl tokio_stream::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut first = true;
    let events = UnboundedReceiverStream::new(rx).map(move |ev| {
        let chunk = |delta: Value, lp: Value, finish: Value, extra: Option<(Value, Value)>| {
            let mut c = match kind {
                Kind::Chat => json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
                }),
                Kind::Completion => json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": lp, "finish_reason": finish}],
                }),
            };
            if let Some((u, t)) = extra {
                c["usage"] = u;
                c["timings"] = t;
            }
            c
        };
        let v = match ev {
            Event::Token { text, logprob } => {
                let mut delta = json!({"content": text});
                if first {
                    delta["role"] = json!("assistant");
                    first = false;
                }
                let lp = match (&logprob, want_lp, kind) {
                    (Some(l), true, Kind::Chat) => json!({"content": [chat_logprob(l)]}),
                    (Some(l), true, Kind::Completion) => completion_logprobs(std::slice::from_ref(l)),
                    _ => Value::Null,
                };
                chunk(delta, lp, Value::Null, None)
            }
            Event::Done { finish, usage } => chunk(
                json!({}),
                Value::Null,
                json!(finish),
                Some((usage_json(&usage), timings_json(&usage))),
            ),
            Event::Error(msg) => json!({"error": {"message": msg, "type": "server_error", "param": null, "code": null}}),
        };
        Ok(SseEvent::default().data(v.to_string()))
    });
    let done = tokio_stream::once(Ok(SseEvent::default().data("[DONE]")));
    Sse::new(events.chain(done)).keep_alive(KeepAlive::default())
}
