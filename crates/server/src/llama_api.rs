//! llama-server's own endpoints beside the OpenAI API: the native
//! `POST /completion` (its request fields mapped onto the completions API's,
//! its response shape built from the same events), `POST /apply-template`,
//! `GET /props`, `POST /tokenize` and `POST /detokenize`.

use crate::api::{self, ApiError, ChatRequest};
use crate::conn::ClientEof;
use crate::http::{App, Kind, body, completions_as, error, off_http, render_prompt};
use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;

/// llama-server's `GET /props`: the settings a client adapts to (context,
/// slots, the chat template and the special tokens it uses).
pub(crate) async fn props(State(app): State<Arc<App>>) -> Response {
    let piece = |id: Option<u32>| id.map(|t| app.tok.token(t).to_string()).unwrap_or_default();
    axum::Json(json!({
        "default_generation_settings": {"n_ctx": app.ctx, "params": {"n_predict": -1}},
        "total_slots": app.slots,
        "model_alias": app.model_name,
        "chat_template": app.tok.chat_template.clone().unwrap_or_default(),
        "bos_token": piece(app.tok.bos),
        "eos_token": piece(app.tok.stop.first().copied()),
        "modalities": {"vision": false, "audio": false},
        "build_info": concat!("samesum ", env!("CARGO_PKG_VERSION")),
    }))
    .into_response()
}

/// llama-server's `/apply-template`: a chat request's prompt as the chat
/// template renders it, without generating.
pub(crate) async fn apply_template(
    State(app): State<Arc<App>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let body_len = b.as_ref().map_or(0, Bytes::len);
    let a = app.clone();
    let run = move || -> Result<Value, ApiError> {
        let app = a;
        let b = body(&app, b)?;
        let req: ChatRequest = api::parse(&b)?;
        let (chat, _) = req.check()?;
        let text = render_prompt(&app, &chat)?;
        Ok(json!({"prompt": text}))
    };
    match off_http(&app, body_len, run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => error(&app, e),
    }
}

/// llama-server's native `POST /completion`: its request fields
/// (`n_predict`, `json_schema`; the sampling fields as in the completions
/// API) and its response shape (`content`, `stop`, `stop_type`,
/// `tokens_predicted`, `tokens_evaluated`, `timings`; streamed as `data:`
/// chunks of `content` without `[DONE]`). Without `n_predict` (or with
/// -1) it generates up to the context, as llama-server does.
pub(crate) async fn native_completion(
    State(app): State<Arc<App>>,
    eof: Option<Extension<ClientEof>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    completions_as(app, Kind::Native, eof, b).await
}

/// A native `/completion` response, or one streamed chunk of it: `finish`
/// is null until the last; `end` carries the usage and timings JSON.
/// `stop_type` is `limit` at the length limit and `eos` otherwise (an end
/// of generation token or a stop string).
pub(crate) fn native_json(
    text: &str,
    model: &str,
    index: usize,
    finish: Value,
    end: Option<(&Value, &Value)>,
) -> Value {
    let mut v = json!({"content": text, "stop": !finish.is_null(), "index": index, "id_slot": 0});
    if let Some(f) = finish.as_str() {
        v["stop_type"] = json!(if f == "length" { "limit" } else { "eos" });
        v["model"] = json!(model);
    }
    if let Some((u, t)) = end {
        v["tokens_predicted"] = u["completion_tokens"].clone();
        v["tokens_evaluated"] = u["prompt_tokens"].clone();
        v["tokens_cached"] = u["prompt_tokens_details"]["cached_tokens"].clone();
        v["timings"] = t.clone();
    }
    v
}

/// A native `/completion` body as the completions API's.
pub(crate) fn native_request(b: &[u8]) -> Result<Bytes, ApiError> {
    let mut v: Value = api::parse(b)?;
    let Some(o) = v.as_object_mut() else {
        return Err(ApiError::bad(None, "the request body is not a JSON object"));
    };
    if let Some(n) = o.remove("n_predict") {
        match n.as_i64() {
            Some(n) if n >= 0 => {
                o.insert("max_tokens".into(), json!(n));
            }
            Some(_) => {}
            None => {
                return Err(ApiError::bad(
                    Some("n_predict".into()),
                    "n_predict must be an integer (-1: up to the context)",
                ));
            }
        }
    }
    if let Some(schema) = o.remove("json_schema") {
        o.insert(
            "response_format".into(),
            json!({"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}),
        );
    }
    // One reply per request on this endpoint.
    o.remove("n");
    Ok(Bytes::from(v.to_string()))
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

pub(crate) async fn tokenize(
    State(app): State<Arc<App>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let body_len = b.as_ref().map_or(0, Bytes::len);
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
            // A control token decodes to nothing; its piece is its text.
            let piece = if piece.is_empty() {
                app.tok.token(id).to_string()
            } else {
                piece
            };
            out.push(json!({"id": id, "piece": piece}));
        }
        Ok(json!({"tokens": out}))
    };
    match off_http(&app, body_len, run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => error(&app, e),
    }
}

pub(crate) async fn detokenize(
    State(app): State<Arc<App>>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let body_len = b.as_ref().map_or(0, Bytes::len);
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
    match off_http(&app, body_len, run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => error(&app, e),
    }
}
