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
//! - `GET /`: the chat page ([`crate::page`]).
//!
//! Limits: `max_tokens` above the server's cap is a 400 naming it (as
//! OpenAI refuses a `max_tokens` above the model's limit); a request without
//! one gets the cap (completions: 16, at most the cap). A request past its
//! deadline ends with finish reason `length` when it has generated tokens,
//! else with a 503 `request_timeout` (retryable: the server was too busy to
//! start it in time).
//!
//! A client that half-closes or goes away while its request runs is probed
//! (see [`crate::conn`]): a stream gets an SSE comment every
//! [`PROBE`](crate::conn::PROBE); a non-streamed response commits its 200
//! head and sends a space (leading JSON whitespace) as often, then the JSON.
//! A client that is gone fails the next write and its request is cancelled;
//! one that only half-closed reads its response (an error found after the
//! head was committed comes as the error object under status 200).

use crate::api::{
    self, ApiError, ChatRequest, CompletionRequest, PromptInput, ReasoningFormat, Settings,
};
use crate::chat_output::{Piece, Splitter, Tool};
use crate::conn::{ClientEof, PROBE};
use crate::metrics::Metrics;
use crate::scheduler::{Event, Job, PromptLogprobs, TokenLogprob, Usage};
use crate::structured::Format;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use samesum_engine::constraint::SharedConstraint;
use samesum_engine::sample::SamplerConfig;
use samesum_engine::sched::{SubmitError, context_bytes, request_context};
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{HParams, KvType};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};

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
    /// Sequences decoded at once (`--max-batch`).
    pub slots: usize,
    /// The request body limit (for the 413 message).
    pub max_body: usize,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Request ids.
    pub next_id: AtomicU64,
    /// Generated tokens per request at most (0: up to the context).
    pub max_tokens_cap: usize,
    /// The KV budget, to refuse a request that could never fit before it
    /// is queued (`None`: no limit).
    pub kv_check: Option<KvCheck>,
    /// A request's deadline, from when it is queued.
    pub request_timeout: Duration,
    /// The threads that prepare requests (parse, template, tokenize).
    pub prep: crate::prep::PrepPool,
    /// How replies' `<think>` blocks are returned unless a request says.
    pub reasoning: ReasoningFormat,
    /// Structured output for this vocabulary (`Err`: why it is not
    /// available).
    pub grammars: Result<crate::structured::Grammars, String>,
}

/// The constraint `s.format` asks for, one for each of the `s.n` choices,
/// built off the HTTP threads (a large schema takes a while to compile); a
/// bad schema or grammar is a 400 naming its field.
fn constraints(
    app: &App,
    s: &Settings,
    prompts: usize,
) -> Result<Vec<Option<SharedConstraint>>, ApiError> {
    (0..s.n.max(1) * prompts)
        .map(|_| constraint(app, s))
        .collect()
}

fn constraint(app: &App, s: &Settings) -> Result<Option<SharedConstraint>, ApiError> {
    let Some(f) = &s.format else {
        return Ok(None);
    };
    let param = match f {
        Format::JsonObject | Format::JsonSchema(_) => "response_format",
        Format::Lark(_) => "grammar",
        Format::ToolCall(_) => "tool_choice",
    };
    let g = app.grammars.as_ref().map_err(|e| {
        ApiError::bad(
            Some(param.into()),
            format!("structured output is not available for this model: {e}"),
        )
    })?;
    g.constraint(f)
        .map(Some)
        .map_err(|e| ApiError::bad(Some(param.into()), format!("{param}: {e}")))
}

/// How a chat reply is read back: its reasoning and tool calls.
#[derive(Clone, Debug)]
struct ChatOut {
    reasoning: bool,
    /// The prompt ended inside a think block.
    think_open: bool,
    tools: Option<Vec<Tool>>,
}

impl ChatOut {
    fn splitter(&self) -> Splitter {
        Splitter::new(self.reasoning, self.think_open, self.tools.clone())
    }
}

/// What a request's context costs against the KV budget.
#[derive(Clone, Debug)]
pub struct KvCheck {
    /// The model's sizes.
    pub hp: HParams,
    /// KV cache type.
    pub kv: KvType,
    /// The budget in bytes.
    pub budget: u64,
}

/// The router.
pub fn router(app: Arc<App>) -> Router {
    let limit = app.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completion", post(crate::llama_api::native_completion))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(crate::llama_api::tokenize))
        .route("/detokenize", post(crate::llama_api::detokenize))
        .route("/apply-template", post(crate::llama_api::apply_template))
        .route("/props", get(crate::llama_api::props))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/", get(crate::page::chat))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .with_state(app)
}

pub(crate) fn error(app: &App, e: ApiError) -> Response {
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
        message: "no such endpoint (try /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, or / for the chat page)".into(),
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

pub(crate) fn body(app: &App, b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
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
/// `default_max` is the endpoint's length when the request names none.
fn submit(
    app: &App,
    id: &str,
    prompt: Vec<u32>,
    s: &Settings,
    default_max: Option<usize>,
    constraint: Option<SharedConstraint>,
    choice: usize,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad(
            Some("prompt".into()),
            "the prompt is empty after tokenization",
        ));
    }
    let cap = if app.max_tokens_cap == 0 {
        usize::MAX
    } else {
        app.max_tokens_cap
    };
    if let Some(n) = s.max_tokens
        && n > cap
    {
        return Err(ApiError::bad(
            Some("max_tokens".into()),
            format!(
                "max_tokens is too large: {n}; this server generates at most {cap} tokens per request (--max-tokens-cap)"
            ),
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
    if s.max_tokens == Some(0) && !s.echo {
        return Err(ApiError::bad(
            Some("max_tokens".into()),
            "max_tokens must be at least 1",
        ));
    }
    let max_new = s
        .max_tokens
        .or(default_max)
        .unwrap_or(room)
        .min(room)
        .min(cap);
    if let Some(k) = &app.kv_check {
        let ctx = request_context(prompt.len(), max_new);
        let need = context_bytes(&k.hp, k.kv, ctx);
        if need > k.budget {
            let e = SubmitError::OverBudget {
                need,
                ctx,
                budget: k.budget,
            };
            return Err(ApiError {
                status: 400,
                message: format!(
                    "{e} (--kv-budget); lower max_tokens (it was {max_new}{}) or shorten the prompt ({} tokens)",
                    if s.max_tokens.is_none() {
                        ", the default, as the request named none"
                    } else {
                        ""
                    },
                    prompt.len()
                ),
                kind: "invalid_request_error",
                param: Some("max_tokens".into()),
                code: Some("kv_budget_exceeded"),
            });
        }
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    // Choice `i` of a seeded request samples with `seed + i`.
    let seed = s
        .seed
        .map(|x| x.wrapping_add(choice as u64))
        .unwrap_or_else(|| {
            // No seed: a different stream per request and per choice.
            let t = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            (t as u64)
                ^ app
                    .next_id
                    .load(Ordering::Relaxed)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ (choice as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)
        });
    let now = Instant::now();
    let job = Job {
        id: id.to_string(),
        prompt,
        max_new,
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
        constraint,
        echo: s.echo,
        prompt_logprobs: if s.echo { s.logprobs } else { None },
        events: tx,
        queued: now,
        deadline: now.checked_add(app.request_timeout),
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
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// llama.cpp's `timings`: `prompt_n` counts the prompt tokens prefilled,
/// `cache_n` those restored from the prefix cache.
fn timings_json(u: &Usage) -> Value {
    let per = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    let prefilled = u.prompt_tokens.saturating_sub(u.cached_tokens);
    json!({
        "queue_ms": u.queue_ms,
        "cache_n": u.cached_tokens,
        "prompt_n": prefilled,
        "prompt_ms": u.prompt_ms,
        "prompt_per_second": per(prefilled, u.prompt_ms),
        "predicted_n": u.completion_tokens,
        "predicted_ms": u.gen_ms,
        "predicted_per_second": per(u.completion_tokens, u.gen_ms),
    })
}

/// A token's entry in a chat reply's `logprobs.content`: `bytes` are the
/// token's own bytes (part of a UTF-8 character for some tokens, whose
/// `token` string then shows U+FFFD).
fn chat_logprob(lp: &TokenLogprob) -> Value {
    json!({
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": lp.top.iter().zip(&lp.top_bytes).map(|((t, l), b)| json!({"token": t, "logprob": l, "bytes": b})).collect::<Vec<_>>(),
    })
}

/// Which API shape a response takes.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Chat,
    Completion,
    /// llama-server's native `/completion`.
    Native,
}

/// Bodies at least this large give the memory their preparation freed back
/// to the system.
const TRIM_BODY: usize = 64 << 10;

/// Run request parsing, chat templating and tokenizing on [`App::prep`],
/// off the threads that answer HTTP: a large prompt or a slow template
/// never holds up `/health` or other requests, and at most the pool's
/// threads prepare at once (each can take tens of MB for a large body; the
/// rest wait their turn). `body` is the body's size in bytes.
pub(crate) async fn off_http<T: Send + 'static>(
    app: &App,
    body: usize,
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let run = move || {
        let r = f();
        if body >= TRIM_BODY {
            crate::trim_heap();
        }
        r
    };
    app.prep.run(run).await.unwrap_or_else(|| {
        Err(ApiError {
            status: 500,
            message: "preparing the request failed".into(),
            kind: "server_error",
            param: None,
            code: None,
        })
    })
}

/// The request's [`ClientEof`] (one that never fires when the router runs
/// without [`crate::conn`]).
fn client_eof(e: Option<Extension<ClientEof>>) -> ClientEof {
    e.map(|Extension(e)| e).unwrap_or_else(ClientEof::never)
}

/// A chat's prompt as the model's (or `--chat-template-file`'s) template
/// renders it, ready for the assistant's reply.
pub(crate) fn render_prompt(app: &App, chat: &api::ChatPrompt) -> Result<String, ApiError> {
    app.tok
        .render_chat(&samesum_engine::tokenizer::ChatInput {
            messages: &chat.messages,
            tools: chat.tools.as_ref(),
            kwargs: &chat.kwargs,
            add_generation_prompt: true,
        })
        .map_err(|e| ApiError::bad(Some("messages".into()), e.to_string()))
}

async fn chat(
    State(app): State<Arc<App>>,
    eof: Option<Extension<ClientEof>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let body_len = b.as_ref().map_or(0, Bytes::len);
    let a = app.clone();
    type Prepared = (Vec<u32>, Settings, ChatOut, Vec<Option<SharedConstraint>>);
    let run = move || -> Result<Prepared, ApiError> {
        let app = a;
        let b = body(&app, b)?;
        let req: ChatRequest = api::parse(&b)?;
        req.log_ignored();
        let (chat, s) = req.check()?;
        let constraint = constraints(&app, &s, 1)?;
        let mut text = render_prompt(&app, &chat)?;
        // A constrained reply starts at once: a think block the template
        // opened is closed in the prompt (as enable_thinking=false renders).
        if s.format.is_some() && text.trim_end().ends_with("<think>") {
            text.push_str("\n\n</think>\n\n");
        }
        let ids = app
            .tok
            .encode(&text)
            .map_err(|e| ApiError::bad(Some("messages".into()), e.to_string()))?;
        let reasoning = chat.reasoning.unwrap_or(app.reasoning) == ReasoningFormat::Deepseek;
        let out = ChatOut {
            reasoning,
            think_open: reasoning && text.trim_end().ends_with("<think>"),
            tools: chat.tools.as_ref().map(Tool::list),
        };
        Ok((ids, s, out, constraint))
    };
    match off_http(&app, body_len, run).await {
        Ok((ids, s, out, c)) => {
            respond(app, Kind::Chat, vec![ids], s, Some(out), c, client_eof(eof)).await
        }
        Err(e) => error(&app, e),
    }
}

async fn completions(
    State(app): State<Arc<App>>,
    eof: Option<Extension<ClientEof>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    completions_as(app, Kind::Completion, eof, b).await
}

pub(crate) async fn completions_as(
    app: Arc<App>,
    kind: Kind,
    eof: Option<Extension<ClientEof>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let body_len = b.as_ref().map_or(0, Bytes::len);
    let a = app.clone();
    type Prepared = (Vec<Vec<u32>>, Settings, Vec<Option<SharedConstraint>>);
    let run = move || -> Result<Prepared, ApiError> {
        let app = a;
        let mut b = body(&app, b)?;
        if kind == Kind::Native {
            b = crate::llama_api::native_request(&b)?;
        }
        let req: CompletionRequest = api::parse(&b)?;
        req.log_ignored();
        let (prompts, s) = req.check()?;
        if kind == Kind::Native && prompts.len() > 1 {
            return Err(ApiError::bad(
                Some("prompt".into()),
                "/completion takes one prompt (several: /v1/completions)",
            ));
        }
        let c = constraints(&app, &s, prompts.len())?;
        let mut all = Vec::with_capacity(prompts.len());
        for (i, p) in prompts.into_iter().enumerate() {
            let ids = match p {
                PromptInput::Text(t) => app
                    .tok
                    .encode(&t)
                    .map_err(|e| ApiError::bad(Some("prompt".into()), e.to_string()))?,
                PromptInput::Tokens(ids) => {
                    if let Some(&t) = ids.iter().find(|&&t| t as usize >= app.tok.len()) {
                        return Err(ApiError::bad(
                            Some("prompt".into()),
                            format!(
                                "prompt {i}: token id {t} is outside the vocabulary of {} tokens",
                                app.tok.len()
                            ),
                        ));
                    }
                    ids
                }
            };
            all.push(ids);
        }
        Ok((all, s, c))
    };
    match off_http(&app, body_len, run).await {
        Ok((ids, s, c)) => respond(app, kind, ids, s, None, c, client_eof(eof)).await,
        Err(e) => error(&app, e),
    }
}

async fn respond(
    app: Arc<App>,
    kind: Kind,
    prompts: Vec<Vec<u32>>,
    s: Settings,
    out: Option<ChatOut>,
    constraints: Vec<Option<SharedConstraint>>,
    eof: ClientEof,
) -> Response {
    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{n}"),
        Kind::Completion | Kind::Native => format!("cmpl-{n}"),
    };
    // The completions API's default length.
    let default_max = (kind == Kind::Completion).then_some(16);
    // One job per choice; dropping the receivers (an error below, or the
    // client leaving) cancels the ones already queued.
    // Choices in order: each prompt's `n` samples.
    let mut rxs = Vec::with_capacity(constraints.len());
    let mut cs = constraints.into_iter();
    for ids in &prompts {
        for i in 0..s.n.max(1) {
            let c = cs.next().flatten();
            match submit(&app, &id, ids.clone(), &s, default_max, c, i) {
                Ok(rx) => rxs.push(rx),
                Err(e) => return error(&app, e),
            }
        }
    }
    if rxs.len() > 1 {
        return respond_choices(app, kind, id, rxs, &s, out).await;
    }
    let Some(rx) = rxs.pop() else {
        return error(&app, ended_without_result());
    };
    let created = now_secs();
    let model = app.model_name.clone();
    // Plain text passes through untouched.
    let splitter = out.map(|o| o.splitter()).filter(Splitter::active);
    if s.stream {
        let events = stream(
            kind,
            id,
            created,
            model,
            rx,
            s.logprobs.is_some(),
            app.request_timeout,
            splitter,
            0,
        )
        .chain(tokio_stream::iter(
            (kind != Kind::Native).then(|| Ok(SseEvent::default().data("[DONE]"))),
        ));
        Sse::new(Probed {
            inner: events,
            gone: Box::pin(eof.wait()),
            tick: None,
        })
        .keep_alive(KeepAlive::default())
        .into_response()
    } else {
        let c = Collected {
            kind,
            id,
            created,
            model,
            want_lp: s.logprobs.is_some(),
            request_timeout: app.request_timeout,
            text: String::new(),
            lps: Vec::new(),
            splitter,
            prompt_lp: None,
        };
        collect(app, c, rx, eof).await
    }
}

fn timed_out(limit: Duration) -> ApiError {
    ApiError {
        status: 503,
        message: format!(
            "the request did not start generating within the server's request timeout of {} s (--request-timeout); retry later",
            limit.as_secs_f64()
        ),
        kind: "server_error",
        param: None,
        code: Some("request_timeout"),
    }
}

fn ended_without_result() -> ApiError {
    ApiError {
        status: 500,
        message: "the request ended without a result".into(),
        kind: "server_error",
        param: None,
        code: None,
    }
}

/// A non-streamed response being gathered.
struct Collected {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    want_lp: bool,
    request_timeout: Duration,
    text: String,
    lps: Vec<TokenLogprob>,
    splitter: Option<Splitter>,
    /// The echoed prompt's log-probabilities.
    prompt_lp: Option<PromptLogprobs>,
}

/// A tool call as the API returns it, `n`-th of its reply.
fn tool_call_json(id: &str, n: usize, name: &str, arguments: &str) -> Value {
    json!({
        "id": format!("call_{}_{n}", id.trim_start_matches("chatcmpl-")),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

impl Collected {
    /// Take one event; the response's body (or error) once the request ends.
    fn push(&mut self, ev: Event) -> Option<Result<Value, ApiError>> {
        match ev {
            Event::Prompt { text, logprobs } => {
                self.text.insert_str(0, &text);
                self.prompt_lp = logprobs;
                None
            }
            Event::Token {
                text: t, logprob, ..
            } => {
                self.text.push_str(&t);
                if let Some(l) = logprob {
                    self.lps.push(l);
                }
                None
            }
            Event::Error(msg) => Some(Err(ApiError {
                status: 500,
                message: msg,
                kind: "server_error",
                param: None,
                code: None,
            })),
            Event::TimedOut => Some(Err(timed_out(self.request_timeout))),
            Event::Done { finish, usage } => {
                let (id, created, model) = (&self.id, self.created, &self.model);
                let text = std::mem::take(&mut self.text);
                let mut message = json!({"role": "assistant", "content": text});
                let mut finish = finish;
                if let Some(sp) = &mut self.splitter {
                    let (reasoning, content, calls) = crate::chat_output::split_all(sp, &text);
                    message["content"] = json!(content);
                    if !reasoning.is_empty() {
                        message["reasoning_content"] = json!(reasoning);
                    }
                    if !calls.is_empty() {
                        let calls: Vec<Value> = calls
                            .iter()
                            .enumerate()
                            .map(|(n, (name, args))| tool_call_json(id, n, name, args))
                            .collect();
                        message["tool_calls"] = Value::Array(calls);
                        if content.is_empty() {
                            message["content"] = Value::Null;
                        }
                        if finish == "stop" {
                            finish = "tool_calls";
                        }
                    }
                }
                Some(Ok(match self.kind {
                    Kind::Chat => json!({
                        "id": id, "object": "chat.completion", "created": created, "model": model,
                        "choices": [{
                            "index": 0,
                            "message": message,
                            "logprobs": if self.want_lp { json!({"content": self.lps.iter().map(chat_logprob).collect::<Vec<_>>()}) } else { Value::Null },
                            "finish_reason": finish,
                        }],
                        "usage": usage_json(&usage),
                        "timings": timings_json(&usage),
                    }),
                    Kind::Native => crate::llama_api::native_json(
                        &text,
                        model,
                        0,
                        json!(finish),
                        Some((&usage_json(&usage), &timings_json(&usage))),
                    ),
                    Kind::Completion => json!({
                        "id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{
                            "index": 0,
                            "text": text,
                            "logprobs": if self.want_lp { completion_logprobs(&self.lps, 0, self.prompt_lp.as_ref()) } else { Value::Null },
                            "finish_reason": finish,
                        }],
                        "usage": usage_json(&usage),
                        "timings": timings_json(&usage),
                    }),
                }))
            }
        }
    }
}

/// Gather a non-streamed response; once the client's end of stream is seen,
/// commit a 200 head and go on in [`Committed`].
async fn collect(
    app: Arc<App>,
    mut c: Collected,
    mut rx: UnboundedReceiver<Event>,
    eof: ClientEof,
) -> Response {
    let gone = eof.wait();
    tokio::pin!(gone);
    loop {
        tokio::select! {
            biased;
            ev = rx.recv() => {
                let out = match ev {
                    Some(ev) => match c.push(ev) {
                        Some(out) => out,
                        None => continue,
                    },
                    None => Err(ended_without_result()),
                };
                return match out {
                    Ok(v) => axum::Json(v).into_response(),
                    Err(e) => error(&app, e),
                };
            }
            _ = &mut gone => {
                let mut tick = tokio::time::interval(PROBE);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let body = Body::from_stream(Committed { c, rx, tick, done: false });
                return ([(header::CONTENT_TYPE, "application/json")], body).into_response();
            }
        }
    }
}

/// The body of a non-streamed response whose head is committed: a space
/// every [`PROBE`] until the request ends, then its JSON (or error object).
struct Committed {
    c: Collected,
    rx: UnboundedReceiver<Event>,
    tick: tokio::time::Interval,
    done: bool,
}

impl Stream for Committed {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let me = self.get_mut();
        if me.done {
            return Poll::Ready(None);
        }
        loop {
            let out = match me.rx.poll_recv(cx) {
                Poll::Ready(Some(ev)) => match me.c.push(ev) {
                    Some(out) => out,
                    None => continue,
                },
                Poll::Ready(None) => Err(ended_without_result()),
                Poll::Pending => break,
            };
            me.done = true;
            let v = out.unwrap_or_else(|e| e.body());
            return Poll::Ready(Some(Ok(Bytes::from(v.to_string()))));
        }
        match me.tick.poll_tick(cx) {
            Poll::Ready(_) => Poll::Ready(Some(Ok(Bytes::from_static(b" ")))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A server-sent event stream that, once the client's end of stream is seen,
/// adds a comment every [`PROBE`].
struct Probed<S> {
    inner: S,
    gone: Pin<Box<dyn Future<Output = ()> + Send>>,
    tick: Option<tokio::time::Interval>,
}

impl<S: Stream<Item = Result<SseEvent, Infallible>> + Unpin> Stream for Probed<S> {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let me = self.get_mut();
        if let Poll::Ready(x) = Pin::new(&mut me.inner).poll_next(cx) {
            return Poll::Ready(x);
        }
        let tick = match &mut me.tick {
            Some(t) => t,
            None => {
                if me.gone.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let mut t = tokio::time::interval(PROBE);
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                me.tick.insert(t)
            }
        };
        match tick.poll_tick(cx) {
            Poll::Ready(_) => Poll::Ready(Some(Ok(SseEvent::default().comment("")))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The completions API's `logprobs` for `lps`, the first starting at
/// `start` in the text: `text_offset` counts the bytes of the tokens before
/// each one (their own bytes, so a character split over two tokens counts
/// once).
///
/// With `prompt` (`echo`), the prompt's tokens come first, the first of them
/// with `null` log-probabilities (nothing precedes it), as
/// lm-evaluation-harness reads them.
fn completion_logprobs(
    lps: &[TokenLogprob],
    start: usize,
    prompt: Option<&PromptLogprobs>,
) -> Value {
    let mut offset = start;
    let (mut tokens, mut logprobs, mut tops, mut offsets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let top = |l: &TokenLogprob| {
        let m: serde_json::Map<String, Value> =
            l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect();
        Value::Object(m)
    };
    if let Some(p) = prompt {
        tokens.push(json!(p.first.0));
        logprobs.push(Value::Null);
        tops.push(Value::Null);
        offsets.push(offset);
        offset += p.first.1.len();
    }
    for l in prompt
        .map(|p| p.rest.as_slice())
        .unwrap_or(&[])
        .iter()
        .chain(lps)
    {
        tokens.push(json!(l.token));
        logprobs.push(json!(l.logprob));
        tops.push(top(l));
        offsets.push(offset);
        offset += l.bytes.len();
    }
    json!({
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    })
}

/// The bytes of an echoed prompt's tokens.
fn prompt_bytes(p: &PromptLogprobs) -> usize {
    p.first.1.len() + p.rest.iter().map(|l| l.bytes.len()).sum::<usize>()
}

#[allow(clippy::too_many_arguments)]
fn stream(
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    rx: UnboundedReceiver<Event>,
    want_lp: bool,
    request_timeout: Duration,
    mut splitter: Option<Splitter>,
    index: usize,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Unpin + Send + 'static {
    let mut first = true;
    // Bytes of the completion's tokens so far (`text_offset`).
    let mut offset = 0usize;
    let mut calls = 0usize;
    UnboundedReceiverStream::new(rx).map(move |ev| {
        let chunk = |delta: Value, lp: Value, finish: Value, extra: Option<(Value, Value)>| {
            let mut c = match kind {
                Kind::Chat => json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
                }),
                Kind::Completion => json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": lp, "finish_reason": finish}],
                }),
                Kind::Native => {
                    let text = delta.get("content").and_then(Value::as_str).unwrap_or("");
                    return crate::llama_api::native_json(text, &model, index, finish, extra.as_ref().map(|(u, t)| (u, t)));
                }
            };
            if let Some((u, t)) = extra {
                c["usage"] = u;
                c["timings"] = t;
            }
            c
        };
        // A chat delta from the splitter's pieces (or the text as it is).
        let mut delta_of = |text: &str, end: bool, calls: &mut usize| -> Value {
            let Some(sp) = splitter.as_mut() else {
                return json!({"content": text});
            };
            let mut pieces = sp.push(text);
            if end {
                pieces.extend(sp.finish());
            }
            let mut d = json!({});
            let mut tool_calls = Vec::new();
            for p in pieces {
                match p {
                    Piece::Reasoning(t) => {
                        let r = d["reasoning_content"].as_str().unwrap_or("").to_string() + &t;
                        d["reasoning_content"] = json!(r);
                    }
                    Piece::Content(t) => {
                        let c = d["content"].as_str().unwrap_or("").to_string() + &t;
                        d["content"] = json!(c);
                    }
                    Piece::ToolCall { name, arguments } => {
                        let mut c = tool_call_json(&id, *calls, &name, &arguments);
                        c["index"] = json!(*calls);
                        *calls += 1;
                        tool_calls.push(c);
                    }
                }
            }
            if !tool_calls.is_empty() {
                d["tool_calls"] = Value::Array(tool_calls);
            }
            d
        };
        let v = match ev {
            Event::Prompt { text, logprobs } => {
                // The echoed prompt: its own chunk, first.
                first = false;
                let lp = match (&logprobs, want_lp) {
                    (Some(p), true) => {
                        let v = completion_logprobs(&[], offset, Some(p));
                        offset += prompt_bytes(p);
                        v
                    }
                    _ => Value::Null,
                };
                chunk(json!({"content": text}), lp, Value::Null, None)
            }
            Event::Token { text, logprob, .. } => {
                let mut delta = if kind == Kind::Chat {
                    delta_of(&text, false, &mut calls)
                } else {
                    json!({"content": text})
                };
                if first {
                    delta["role"] = json!("assistant");
                    if delta.get("content").is_none() {
                        delta["content"] = json!("");
                    }
                    first = false;
                }
                let lp = match (&logprob, want_lp, kind) {
                    (Some(l), true, Kind::Chat) => json!({"content": [chat_logprob(l)]}),
                    (Some(l), true, Kind::Completion | Kind::Native) => {
                        let v = completion_logprobs(std::slice::from_ref(l), offset, None);
                        offset += l.bytes.len();
                        v
                    }
                    _ => Value::Null,
                };
                chunk(delta, lp, Value::Null, None)
            }
            Event::Done { finish, usage } => {
                let delta = if kind == Kind::Chat {
                    delta_of("", true, &mut calls)
                } else {
                    json!({})
                };
                let finish = if calls > 0 && finish == "stop" {
                    "tool_calls"
                } else {
                    finish
                };
                // The last chunk carries what the splitter still held.
                let usage = Some((usage_json(&usage), timings_json(&usage)));
                chunk(delta, Value::Null, json!(finish), usage)
            }
            Event::Error(msg) => json!({"error": {"message": msg, "type": "server_error", "param": null, "code": null}}),
            Event::TimedOut => timed_out(request_timeout).body(),
        };
        Ok(SseEvent::default().data(v.to_string()))
    })
}

/// A response of several choices (`n` > 1): streamed, the choices' chunks
/// as they come (each with its `index`), then `[DONE]`; not streamed, one
/// body with every choice, the prompt counted once in `usage` and the
/// choices' tokens added up.
async fn respond_choices(
    app: Arc<App>,
    kind: Kind,
    id: String,
    rxs: Vec<UnboundedReceiver<Event>>,
    s: &Settings,
    out: Option<ChatOut>,
) -> Response {
    let created = now_secs();
    let model = app.model_name.clone();
    let splitter = || out.as_ref().map(ChatOut::splitter).filter(Splitter::active);
    if s.stream {
        let mut map = tokio_stream::StreamMap::new();
        for (i, rx) in rxs.into_iter().enumerate() {
            let st = stream(
                kind,
                id.clone(),
                created,
                model.clone(),
                rx,
                s.logprobs.is_some(),
                app.request_timeout,
                splitter(),
                i,
            );
            map.insert(i, st);
        }
        let events = map
            .map(|(_, ev)| ev)
            .chain(tokio_stream::once(Ok(SseEvent::default().data("[DONE]"))));
        return Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    let mut body: Option<Value> = None;
    let mut choices = Vec::new();
    let mut completion = 0u64;
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let mut c = Collected {
            kind,
            id: id.clone(),
            created,
            model: model.clone(),
            want_lp: s.logprobs.is_some(),
            request_timeout: app.request_timeout,
            text: String::new(),
            lps: Vec::new(),
            splitter: splitter(),
            prompt_lp: None,
        };
        let v = loop {
            match rx.recv().await {
                Some(ev) => {
                    if let Some(r) = c.push(ev) {
                        break r;
                    }
                }
                None => break Err(ended_without_result()),
            }
        };
        let v = match v {
            Ok(v) => v,
            Err(e) => return error(&app, e),
        };
        let mut ch = v["choices"][0].clone();
        ch["index"] = json!(i);
        choices.push(ch);
        completion += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        body.get_or_insert(v);
    }
    let Some(mut v) = body else {
        return error(&app, ended_without_result());
    };
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    v["choices"] = Value::Array(choices);
    v["usage"]["completion_tokens"] = json!(completion);
    v["usage"]["total_tokens"] = json!(prompt + completion);
    axum::Json(v).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Option<Vec<Tool>> {
        Some(Tool::list(
            &json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]),
        ))
    }

    const REPLY: [&str; 9] = [
        "<think>",
        "\nI should",
        " look it up.\n",
        "</think>",
        "\n\n",
        "Let me check.\n",
        "<tool_call>",
        "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n",
        "</tool_call>",
    ];

    fn events(lp: bool) -> UnboundedReceiver<Event> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for t in REPLY {
            let logprob = lp.then(|| TokenLogprob {
                token: t.into(),
                bytes: t.as_bytes().to_vec(),
                logprob: -0.5,
                top: vec![],
                top_bytes: vec![],
            });
            tx.send(Event::Token {
                text: t.into(),
                id: Some(1),
                logprob,
            })
            .unwrap();
        }
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 9,
            ..Usage::default()
        };
        tx.send(Event::Done {
            finish: "stop",
            usage,
        })
        .unwrap();
        rx
    }

    /// The `data:` payloads of an SSE stream, as a client reads them.
    async fn datas(
        s: impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
    ) -> Vec<String> {
        let body = Sse::new(s).into_response().into_body();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(String::from)
            .collect()
    }

    fn splitter() -> Option<Splitter> {
        Some(
            ChatOut {
                reasoning: true,
                think_open: false,
                tools: tools(),
            }
            .splitter(),
        )
    }

    /// A reply with a think block and a tool call: the non-streamed message
    /// has `reasoning_content`, `content` and `tool_calls` with finish
    /// reason `tool_calls`; the streamed deltas add up to the same fields.
    #[tokio::test]
    async fn reasoning_and_tool_calls_streamed_and_not() {
        let mut c = Collected {
            kind: Kind::Chat,
            id: "chatcmpl-7".into(),
            created: 0,
            model: "m".into(),
            want_lp: false,
            request_timeout: Duration::from_secs(1),
            text: String::new(),
            lps: Vec::new(),
            splitter: splitter(),
            prompt_lp: None,
        };
        let mut rx = events(false);
        let mut body = None;
        while let Some(ev) = rx.recv().await {
            if let Some(b) = c.push(ev) {
                body = Some(b.unwrap());
            }
        }
        let v = body.unwrap();
        let choice = &v["choices"][0];
        let m = &choice["message"];
        assert_eq!(m["reasoning_content"], "I should look it up.", "{v}");
        assert_eq!(m["content"], "Let me check.", "{v}");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(
            m["tool_calls"][0]["function"]["arguments"],
            r#"{"city":"Paris"}"#
        );
        assert_eq!(m["tool_calls"][0]["id"], "call_7_0");
        assert_eq!(choice["finish_reason"], "tool_calls");

        let s = stream(
            Kind::Chat,
            "chatcmpl-7".into(),
            0,
            "m".into(),
            events(true),
            true,
            Duration::from_secs(1),
            splitter(),
            0,
        );
        let chunks = datas(s).await;
        assert_eq!(
            chunks.len(),
            REPLY.len() + 1,
            "a chunk per token, then the end"
        );
        let mut reasoning = String::new();
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut finish = Value::Null;
        for ch in &chunks {
            let v: Value = serde_json::from_str(ch).unwrap();
            let d = &v["choices"][0]["delta"];
            reasoning += d["reasoning_content"].as_str().unwrap_or("");
            content += d["content"].as_str().unwrap_or("");
            calls.extend(d["tool_calls"].as_array().cloned().unwrap_or_default());
            if !v["choices"][0]["finish_reason"].is_null() {
                finish = v["choices"][0]["finish_reason"].clone();
            }
        }
        assert_eq!(reasoning, m["reasoning_content"]);
        assert_eq!(content, m["content"]);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["index"], 0);
        assert_eq!(calls[0]["function"], m["tool_calls"][0]["function"]);
        assert_eq!(finish, "tool_calls");
    }

    /// Streamed completions' `text_offset` runs on across chunks.
    #[tokio::test]
    async fn streamed_text_offsets_run_on() {
        let s = stream(
            Kind::Completion,
            "cmpl-1".into(),
            0,
            "m".into(),
            events(true),
            true,
            Duration::from_secs(1),
            None,
            0,
        );
        let chunks = datas(s).await;
        let mut offsets = Vec::new();
        for ch in &chunks {
            let v: Value = serde_json::from_str(ch).unwrap();
            if let Some(o) = v["choices"][0]["logprobs"]["text_offset"].as_array() {
                offsets.extend(o.iter().map(|x| x.as_u64().unwrap() as usize));
            }
        }
        let mut want = Vec::new();
        let mut at = 0;
        for t in REPLY {
            want.push(at);
            at += t.len();
        }
        assert_eq!(offsets, want);
    }
}
