//! The OpenAI-compatible request bodies, their validation, and the error
//! object every failure is reported with.
//!
//! The policy, field by field:
//! - Fields that change the result are parsed strictly: a wrong type or an
//!   out-of-range value is a 400 naming the field.
//! - Known fields whose feature is not implemented are a 400 naming the field
//!   when they would change the result (`n > 1`, `best_of > 1`,
//!   `tools`, `tool_choice: "required"`, `functions`,
//!   `response_format` other than text, `modalities` other than text,
//!   `audio`, `echo`, `suffix`), and accepted when they are the no-op value
//!   (`n: 1`, `best_of: 1`, `tools: []`,
//!   `tool_choice: "none"`/`"auto"`, `response_format: {"type": "text"}`).
//! - Any other field (`user`, `store`, `metadata`, `service_tier`,
//!   `parallel_tool_calls`, `stream_options`, ...) cannot change the tokens
//!   and is ignored; unknown names are logged at debug level.
//!
//! Sampling fields beyond OpenAI's, as llama-server names them: `top_k`,
//! `min_p`, `repeat_penalty`, `repeat_last_n` (the window of the three
//! penalties, default 64; 0: off), `ignore_eos`. `presence_penalty` and
//! `frequency_penalty` (-2 to 2) follow llama.cpp's penalties sampler (see
//! `samesum_engine::sample`). `logit_bias` is OpenAI's object of token ids
//! (as strings) to biases from -100 to 100, added to the logits before the
//! penalties, as llama.cpp does; an id outside the vocabulary is a 400.
//!
//! A message's `content` is a string or an array of content parts; the text
//! parts are concatenated in order, and any other part type (`image_url`,
//! `input_audio`, ...) is a 400 naming the type.

use crate::structured::Format;
use samesum_engine::sample::Penalties;
use serde::Deserialize;
use serde_json::{Value, json};

/// An error as the OpenAI API reports it, with its HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Human-readable message naming the problem.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The offending parameter, if one.
    pub param: Option<String>,
    /// A machine code (`context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn bad(param: impl Into<Option<String>>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// `stop`: one string or a list of up to 4.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// One chat message.
#[derive(Deserialize, Debug, Clone)]
pub struct Message {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// A string, an array of content parts, or null (an empty turn).
    #[serde(default)]
    pub content: Value,
    /// The author's name (given to the template).
    pub name: Option<String>,
    /// An assistant turn's tool calls (OpenAI's shape).
    pub tool_calls: Option<Value>,
    /// A `tool` turn's call id.
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning (given back to templates that show it).
    pub reasoning_content: Option<String>,
    /// Refused unless null (function calls are not supported).
    pub function_call: Option<Value>,
    /// Refused unless null (audio is not supported).
    pub audio: Option<Value>,
    /// Any other field: ignored (`refusal`, ...).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

impl Message {
    /// The text of message `i`: the string, or its text parts in order.
    pub fn text(&self, i: usize) -> Result<String, ApiError> {
        let at = |f: &str| Some(format!("messages[{i}].{f}"));
        for (f, v) in [
            ("function_call", &self.function_call),
            ("audio", &self.audio),
        ] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::bad(
                    at(f),
                    format!("{f} in messages is not supported"),
                ));
            }
        }
        match &self.content {
            Value::String(s) => Ok(s.clone()),
            Value::Null => Ok(String::new()),
            Value::Array(parts) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    let pat = |f: &str| at(&format!("content[{j}]{f}"));
                    let ty = p.get("type").and_then(Value::as_str).ok_or_else(|| {
                        ApiError::bad(
                            pat(""),
                            "a content part must be an object with a string \"type\"",
                        )
                    })?;
                    if ty != "text" {
                        return Err(ApiError::bad(
                            pat(".type"),
                            format!(
                                "content part type {ty:?} is not supported (only \"text\" parts)"
                            ),
                        ));
                    }
                    let t = p.get("text").and_then(Value::as_str).ok_or_else(|| {
                        ApiError::bad(pat(".text"), "a text part needs a string \"text\"")
                    })?;
                    text.push_str(t);
                }
                Ok(text)
            }
            _ => Err(ApiError::bad(
                at("content"),
                "content must be a string or an array of content parts",
            )),
        }
    }
}

/// Null, an empty array or an empty object.
fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// The sampling and length fields both endpoints share (OpenAI's names).
#[derive(Debug, Clone, Default)]
#[allow(missing_docs)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub n: Option<u64>,
    pub best_of: Option<u64>,
    pub ignore_eos: Option<bool>,
    pub logit_bias: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub response_format: Option<Value>,
    pub grammar: Option<String>,
    pub modalities: Option<Value>,
    pub audio: Option<Value>,
}

/// Defines a request struct with the endpoint's own fields plus the shared
/// ones (a flattened `Common` would hide the field names from the errors'
/// paths).
macro_rules! request {
    ($(#[$doc:meta])* $name:ident { $($(#[$fdoc:meta])* $f:ident : $t:ty),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Deserialize, Debug, Clone)]
        #[allow(missing_docs)]
        pub struct $name {
            $($(#[$fdoc])* pub $f: $t,)*
            pub model: Option<String>,
            pub max_tokens: Option<u64>,
            pub max_completion_tokens: Option<u64>,
            pub temperature: Option<f32>,
            pub top_p: Option<f32>,
            pub top_k: Option<u64>,
            pub min_p: Option<f32>,
            pub repeat_penalty: Option<f32>,
            pub presence_penalty: Option<f32>,
            pub frequency_penalty: Option<f32>,
            /// The penalties' window (llama.cpp's; -1: the whole context).
            pub repeat_last_n: Option<i64>,
            pub seed: Option<u64>,
            pub stop: Option<Stop>,
            pub stream: Option<bool>,
            pub n: Option<u64>,
            pub best_of: Option<u64>,
            /// Keep generating past the model's end-of-text tokens (llama.cpp's
            /// server option; for benchmarks).
            pub ignore_eos: Option<bool>,
            /// Token ids (as strings) to biases.
            pub logit_bias: Option<Value>,
            /// Accepted when empty.
            pub tools: Option<Value>,
            /// Accepted when `none` or `auto`.
            pub tool_choice: Option<Value>,
            /// Accepted when empty.
            pub functions: Option<Value>,
            /// Accepted when `none` or `auto`.
            pub function_call: Option<Value>,
            /// `text`, `json_object` or `json_schema`.
            pub response_format: Option<Value>,
            /// A grammar the output must match: llguidance's Lark syntax,
            /// or llama.cpp's GBNF (`root ::= ...`), converted.
            pub grammar: Option<String>,
            /// Accepted when `["text"]`.
            pub modalities: Option<Value>,
            /// Accepted when null.
            pub audio: Option<Value>,
            /// Every other field (`user`, `store`, `stream_options`, ...):
            /// ignored.
            #[serde(flatten)]
            pub extra: serde_json::Map<String, Value>,
        }

        impl $name {
            /// The shared fields.
            pub fn common(&self) -> Common {
                Common {
                    model: self.model.clone(),
                    max_tokens: self.max_tokens,
                    max_completion_tokens: self.max_completion_tokens,
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    min_p: self.min_p,
                    repeat_penalty: self.repeat_penalty,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    repeat_last_n: self.repeat_last_n,
                    seed: self.seed,
                    stop: self.stop.clone(),
                    stream: self.stream,
                    n: self.n,
                    best_of: self.best_of,
                    ignore_eos: self.ignore_eos,
                    logit_bias: self.logit_bias.clone(),
                    tools: self.tools.clone(),
                    tool_choice: self.tool_choice.clone(),
                    functions: self.functions.clone(),
                    function_call: self.function_call.clone(),
                    response_format: self.response_format.clone(),
                    grammar: self.grammar.clone(),
                    modalities: self.modalities.clone(),
                    audio: self.audio.clone(),
                }
            }

            /// Log the names of the ignored fields (debug level).
            pub fn log_ignored(&self) {
                if !self.extra.is_empty() {
                    let names: Vec<&str> = self.extra.keys().map(String::as_str).collect();
                    tracing::debug!(fields = ?names, "ignored request fields");
                }
            }
        }
    };
}

request! {
    /// `POST /v1/chat/completions`.
    ChatRequest {
        messages: Vec<Message>,
        logprobs: Option<bool>,
        top_logprobs: Option<u64>,
        /// Variables for the chat template (`enable_thinking`, ...), as
        /// vLLM and llama-server take them.
        chat_template_kwargs: Option<serde_json::Map<String, Value>>,
        /// `deepseek` (reasoning apart) or `none` (as generated); the
        /// server's `--reasoning-format` when absent.
        reasoning_format: Option<String>,
    }
}

/// How the reply's `<think>` block is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// In the text, as generated.
    None,
    /// Apart, as `reasoning_content` (vLLM's and llama-server's convention).
    Deepseek,
}

impl ReasoningFormat {
    /// Parse a format name.
    pub fn parse(s: &str) -> Option<ReasoningFormat> {
        match s {
            "none" => Some(ReasoningFormat::None),
            "deepseek" | "auto" => Some(ReasoningFormat::Deepseek),
            _ => None,
        }
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// No tools offered, or `"none"`: the template is not shown them and
    /// the reply is not parsed for calls.
    None,
    /// `"auto"` (the default with tools): the model may call them.
    Auto,
    /// `"required"` or a named function: the reply is one call to one of
    /// these tools, its arguments valid against the tool's parameters
    /// (by constrained sampling).
    Required(Vec<Value>),
}

/// A validated chat: what the template renders and how the reply is read.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatPrompt {
    /// The messages, normalized for templates: `developer` read as
    /// `system`, content parts joined, tool call arguments as objects.
    pub messages: Value,
    /// The tools, when offered and not switched off.
    pub tools: Option<Value>,
    /// Template variables.
    pub kwargs: serde_json::Map<String, Value>,
    /// The tool choice.
    pub tool_choice: ToolChoice,
    /// The reasoning format asked for (`None`: the server's default).
    pub reasoning: Option<ReasoningFormat>,
}

impl ChatPrompt {
    /// The messages as `(role, content)` pairs.
    pub fn pairs(&self) -> Vec<(String, String)> {
        let text = |v: &Value| v.as_str().unwrap_or("").to_string();
        self.messages
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|m| (text(&m["role"]), text(&m["content"])))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list
/// of lists of token ids (OpenAI's four shapes; several prompts give one
/// choice each, in order).
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Prompt {
    /// A string.
    One(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Several strings.
    Many(Vec<String>),
    /// Several token id lists.
    ManyTokens(Vec<Vec<u32>>),
}

/// One prompt of a completions request.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    /// Text, to tokenize.
    Text(String),
    /// Token ids, as given.
    Tokens(Vec<u32>),
}

/// The most prompts one completions request may carry, times `n`.
pub const MAX_PROMPTS: usize = 64;

request! {
    /// `POST /v1/completions`.
    CompletionRequest {
        prompt: Prompt,
        logprobs: Option<u64>,
        echo: Option<bool>,
        suffix: Option<String>,
    }
}

/// Validated generation settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Tokens to generate at most (`None`: the endpoint's default: up to
    /// the context for chat, 16 for completions, within the server's cap).
    pub max_tokens: Option<usize>,
    /// Temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Top-k (0: off).
    pub top_k: usize,
    /// Min-p.
    pub min_p: f32,
    /// Repetition penalty (1: off).
    pub repeat_penalty: f32,
    /// Presence and frequency penalties (0: off).
    pub penalties: Penalties,
    /// `(token, bias)` added to the logits, by increasing token id.
    pub logit_bias: Vec<(u32, f32)>,
    /// The penalties' window in tokens (`None`: the whole context).
    pub repeat_last_n: Option<usize>,
    /// Seed (`None`: drawn per request).
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stream as server-sent events.
    pub stream: bool,
    /// Report log-probabilities, with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Do not stop at the model's end-of-text tokens.
    pub ignore_eos: bool,
    /// What the output must be (structured output); `None`: free text.
    pub format: Option<Format>,
    /// Choices: independent samples of the same prompt, choice `i` seeded
    /// with `seed + i`.
    pub n: usize,
    /// Completions: the prompt comes back before the completion, in the
    /// text and (with `logprobs`) with its tokens' log-probabilities.
    pub echo: bool,
}

/// The most choices one request may ask for (`n`).
pub const MAX_CHOICES: usize = 16;

/// Parse a JSON body, naming the problem on failure.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::bad(None, "the request body is not valid UTF-8"));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let v = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let param = (path != ".").then_some(path);
        let msg = match (&param, inner.classify()) {
            (_, serde_json::error::Category::Syntax | serde_json::error::Category::Eof) => {
                format!("the request body is not valid JSON: {inner}")
            }
            (Some(p), _) => format!("invalid value for {p}: {inner}"),
            (None, _) => format!("invalid request body: {inner}"),
        };
        ApiError::bad(param, msg)
    })?;
    de.end()
        .map_err(|e| ApiError::bad(None, format!("the request body is not valid JSON: {e}")))?;
    Ok(v)
}

fn finite(name: &str, v: Option<f32>, lo: f32, hi: f32, default: f32) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x),
        Some(x) => Err(ApiError::bad(
            Some(name.to_string()),
            format!("{name} must be between {lo} and {hi}, got {x}"),
        )),
    }
}

impl Common {
    /// Check every field and turn them into [`Settings`]; `logprobs` comes from
    /// the endpoint's own field.
    pub fn settings(&self, logprobs: Option<usize>) -> Result<Settings, ApiError> {
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_CHOICES as u64).contains(&n) {
            return Err(ApiError::bad(
                Some("n".into()),
                format!("n must be 1 to {MAX_CHOICES}, got {n}"),
            ));
        }
        if let Some(b) = self.best_of
            && b != 1
            && b != n
        {
            return Err(ApiError::bad(
                Some("best_of".into()),
                format!(
                    "best_of = {b} is not supported (only 1, or equal to n: every sample is returned)"
                ),
            ));
        }
        self.unsupported()?;
        let repeat_last_n = match self.repeat_last_n {
            None => Some(64),
            Some(-1) => None,
            Some(n) if (0..=1 << 20).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ApiError::bad(
                    Some("repeat_last_n".into()),
                    format!("repeat_last_n must be -1 (the context) or 0 to 1048576, got {n}"),
                ));
            }
        };
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(a), _) | (None, Some(a)) => {
                if a > u32::MAX as u64 {
                    return Err(ApiError::bad(
                        Some("max_tokens".into()),
                        format!("max_tokens {a} is too large"),
                    ));
                }
                Some(a as usize)
            }
            (None, None) => None,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return Err(ApiError::bad(
                Some("stop".into()),
                "at most 4 stop sequences are allowed",
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::bad(
                Some("stop".into()),
                "stop sequences must not be empty",
            ));
        }
        let top_k = self.top_k.unwrap_or(0);
        if top_k > 1 << 20 {
            return Err(ApiError::bad(Some("top_k".into()), "top_k is too large"));
        }
        Ok(Settings {
            max_tokens,
            temperature: finite("temperature", self.temperature, 0.0, 2.0, 1.0)?,
            top_p: finite("top_p", self.top_p, 0.0, 1.0, 1.0)?,
            top_k: top_k as usize,
            min_p: finite("min_p", self.min_p, 0.0, 1.0, 0.0)?,
            repeat_penalty: finite("repeat_penalty", self.repeat_penalty, 0.0, 10.0, 1.0)?,
            penalties: Penalties {
                presence: finite("presence_penalty", self.presence_penalty, -2.0, 2.0, 0.0)?,
                frequency: finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0, 0.0)?,
            },
            repeat_last_n,
            logit_bias: self.logit_bias()?,
            seed: self.seed,
            stop,
            stream: self.stream.unwrap_or(false),
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            format: self.format()?,
            n: n as usize,
            echo: false,
        })
    }
}

impl Common {
    /// A 400 for each known field whose feature is not implemented, unless
    /// it holds the value that changes nothing.
    fn unsupported(&self) -> Result<(), ApiError> {
        let refuse = |f: &str, why: &str| Err(ApiError::bad(Some(f.into()), format!("{f}: {why}")));
        if self.functions.as_ref().is_some_and(|v| !is_empty(v)) {
            return refuse(
                "functions",
                "the deprecated functions field is not supported; use tools",
            );
        }
        match self.function_call.as_ref() {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "none" || s == "auto" => {}
            Some(_) => {
                return refuse(
                    "function_call",
                    "the deprecated function_call field is not supported; use tool_choice",
                );
            }
        }
        match self.modalities.as_ref() {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.iter().all(|m| m == "text") => {}
            Some(_) => return refuse("modalities", "only [\"text\"] is supported"),
        }
        if self.audio.as_ref().is_some_and(|v| !v.is_null()) {
            return refuse("audio", "audio output is not supported");
        }
        Ok(())
    }
}

impl Common {
    /// `response_format` and `grammar` as a [`Format`].
    fn format(&self) -> Result<Option<Format>, ApiError> {
        let bad = |f: &str, why: String| Err(ApiError::bad(Some(f.into()), format!("{f}: {why}")));
        let rf = match self.response_format.as_ref() {
            None | Some(Value::Null) => None,
            Some(v) => match v.get("type").and_then(Value::as_str) {
                Some("text") => None,
                // llama-server also takes a schema beside json_object.
                Some("json_object") => Some(match v.get("schema") {
                    Some(s @ Value::Object(_)) => Format::JsonSchema(s.clone()),
                    _ => Format::JsonObject,
                }),
                Some("json_schema") => match v.get("json_schema").and_then(|j| j.get("schema")) {
                    Some(s @ Value::Object(_)) => Some(Format::JsonSchema(s.clone())),
                    Some(Value::Bool(true)) => Some(Format::JsonSchema(json!({}))),
                    _ => {
                        return bad(
                                "response_format",
                                "a json_schema response format needs json_schema.schema, a JSON Schema object".into(),
                            );
                    }
                },
                Some(t) => {
                    return bad(
                        "response_format",
                        format!("type {t:?} is not supported (text, json_object, json_schema)"),
                    );
                }
                None => return bad("response_format", "needs a string \"type\"".into()),
            },
        };
        match (&self.grammar, rf) {
            (Some(_), Some(_)) => bad(
                "grammar",
                "give grammar or response_format, not both".into(),
            ),
            (Some(g), None) if g.trim().is_empty() => Ok(None),
            (Some(g), None) => Ok(Some(Format::Lark(crate::structured::gbnf_to_lark(g)))),
            (None, rf) => Ok(rf),
        }
    }

    /// `logit_bias` as `(token, bias)` by increasing id.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let bad =
            |why: String| ApiError::bad(Some("logit_bias".into()), format!("logit_bias: {why}"));
        let map = match &self.logit_bias {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Object(m)) => m,
            Some(_) => return Err(bad("must be an object of token ids to biases".into())),
        };
        let mut out = Vec::with_capacity(map.len());
        for (k, v) in map {
            let id: u32 = k
                .parse()
                .map_err(|_| bad(format!("the key {k:?} is not a token id")))?;
            let b = v
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    bad(format!(
                        "the bias of token {k} must be a number from -100 to 100, got {v}"
                    ))
                })?;
            out.push((id, b as f32));
        }
        out.sort_by_key(|&(id, _)| id);
        Ok(out)
    }
}

impl ChatRequest {
    /// Validate the messages, tools and settings.
    pub fn check(&self) -> Result<(ChatPrompt, Settings), ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad(
                Some("messages".into()),
                "messages must not be empty",
            ));
        }
        let mut msgs = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            msgs.push(m.normalized(i)?);
        }
        let tools = check_tools(self.tools.as_ref())?;
        let tool_choice = match self.tool_choice.as_ref() {
            None | Some(Value::Null) => {
                if tools.is_some() {
                    ToolChoice::Auto
                } else {
                    ToolChoice::None
                }
            }
            Some(Value::String(s)) if s == "none" => ToolChoice::None,
            Some(Value::String(s)) if s == "auto" => {
                if tools.is_some() {
                    ToolChoice::Auto
                } else {
                    ToolChoice::None
                }
            }
            Some(v) => {
                let bad = |why: String| Err(ApiError::bad(Some("tool_choice".into()), why));
                let Some(list) = tools.as_ref().and_then(Value::as_array) else {
                    return bad(format!("tool_choice {v} needs tools"));
                };
                match v {
                    Value::String(s) if s == "required" => ToolChoice::Required(list.clone()),
                    Value::Object(o) => {
                        let name = o
                            .get("function")
                            .and_then(|f| f.get("name"))
                            .and_then(Value::as_str);
                        let Some(name) = name else {
                            return bad(format!(
                                "tool_choice {v}: expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                            ));
                        };
                        let chosen: Vec<Value> = list
                            .iter()
                            .filter(|t| t["function"]["name"] == name)
                            .cloned()
                            .collect();
                        if chosen.is_empty() {
                            return bad(format!(
                                "tool_choice names {name:?}, which is not in tools"
                            ));
                        }
                        ToolChoice::Required(chosen)
                    }
                    _ => {
                        return bad(format!(
                            "tool_choice {v}: expected \"none\", \"auto\", \"required\" or a function"
                        ));
                    }
                }
            }
        };
        let reasoning = match self.reasoning_format.as_deref() {
            None => None,
            Some(f) => Some(ReasoningFormat::parse(f).ok_or_else(|| {
                ApiError::bad(
                    Some("reasoning_format".into()),
                    format!("reasoning_format {f:?}: use \"deepseek\" or \"none\""),
                )
            })?),
        };
        let prompt = ChatPrompt {
            messages: Value::Array(msgs),
            tools: if tool_choice == ToolChoice::None {
                None
            } else {
                tools
            },
            kwargs: self.chat_template_kwargs.clone().unwrap_or_default(),
            tool_choice,
            reasoning,
        };
        let lp = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, Some(_)) => {
                return Err(ApiError::bad(
                    Some("top_logprobs".into()),
                    "top_logprobs needs logprobs: true",
                ));
            }
            (true, Some(n)) if n > 20 => {
                return Err(ApiError::bad(
                    Some("top_logprobs".into()),
                    "top_logprobs must be 0 to 20",
                ));
            }
            (true, n) => Some(n.unwrap_or(0) as usize),
            (false, None) => None,
        };
        let mut settings = self.common().settings(lp)?;
        if let ToolChoice::Required(tools) = &prompt.tool_choice {
            if settings.format.is_some() {
                return Err(ApiError::bad(
                    Some("tool_choice".into()),
                    "tool_choice \"required\" or a named function cannot be combined with response_format or grammar",
                ));
            }
            settings.format = Some(Format::ToolCall(tools.clone()));
        }
        Ok((prompt, settings))
    }
}

/// The `tools` array checked: each a `function` with a name (letters,
/// digits, `_` and `-`), an optional description and an optional
/// `parameters` object; `None` when absent or empty.
fn check_tools(tools: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::bad(
                Some("tools".into()),
                "tools must be an array of {\"type\": \"function\", \"function\": {...}}",
            ));
        }
    };
    for (i, t) in list.iter().enumerate() {
        let at = |f: &str| Some(format!("tools[{i}]{f}"));
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad(
                at(".type"),
                "only tools of type \"function\" are supported",
            ));
        }
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| ApiError::bad(at(".function"), "a tool needs a function object"))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        if name.is_empty()
            || name.len() > 64
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        {
            return Err(ApiError::bad(
                at(".function.name"),
                format!("function name {name:?}: 1 to 64 letters, digits, '_', '-' or '.'"),
            ));
        }
        if let Some(p) = f.get("parameters")
            && !p.is_object()
            && !p.is_null()
        {
            return Err(ApiError::bad(
                at(".function.parameters"),
                "parameters must be a JSON Schema object",
            ));
        }
    }
    Ok(Some(Value::Array(list.clone())))
}

impl Message {
    /// Message `i` as chat templates read it: `developer` as `system`,
    /// the text of its content, and for assistant turns the tool calls
    /// with their arguments as JSON objects (OpenAI sends them as a
    /// string; Qwen3.5's template iterates over them).
    pub fn normalized(&self, i: usize) -> Result<Value, ApiError> {
        let at = |f: &str| Some(format!("messages[{i}].{f}"));
        let role = match self.role.as_str() {
            "developer" | "system" => "system",
            r @ ("user" | "assistant" | "tool") => r,
            other => {
                return Err(ApiError::bad(
                    at("role"),
                    format!("unknown role {other:?} (system, developer, user, assistant, tool)"),
                ));
            }
        };
        let mut m = serde_json::Map::new();
        m.insert("role".into(), json!(role));
        m.insert("content".into(), json!(self.text(i)?));
        if let Some(calls) = self.tool_calls.as_ref().filter(|v| !is_empty(v)) {
            if role != "assistant" {
                return Err(ApiError::bad(
                    at("tool_calls"),
                    "only assistant messages carry tool_calls",
                ));
            }
            let calls = calls
                .as_array()
                .ok_or_else(|| ApiError::bad(at("tool_calls"), "tool_calls must be an array"))?;
            let mut out = Vec::with_capacity(calls.len());
            for (j, c) in calls.iter().enumerate() {
                let bad =
                    |why: &str| ApiError::bad(at(&format!("tool_calls[{j}]")), why.to_string());
                let f = c
                    .get("function")
                    .ok_or_else(|| bad("a tool call needs a function"))?;
                let name = f
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a tool call needs function.name"))?;
                let args = match f.get("arguments") {
                    None | Some(Value::Null) => json!({}),
                    Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => {
                            return Err(bad(
                                "function.arguments must be a JSON object (as a string)",
                            ));
                        }
                    },
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(_) => return Err(bad("function.arguments must be a JSON object")),
                };
                let mut call =
                    json!({"type": "function", "function": {"name": name, "arguments": args}});
                if let Some(id) = c.get("id") {
                    call["id"] = id.clone();
                }
                out.push(call);
            }
            m.insert("tool_calls".into(), Value::Array(out));
        }
        if let Some(id) = &self.tool_call_id {
            m.insert("tool_call_id".into(), json!(id));
        }
        if let Some(r) = &self.reasoning_content {
            m.insert("reasoning_content".into(), json!(r));
        }
        if let Some(n) = &self.name {
            m.insert("name".into(), json!(n));
        }
        Ok(Value::Object(m))
    }
}

impl CompletionRequest {
    /// Validate the prompts and settings; returns the prompts too.
    pub fn check(&self) -> Result<(Vec<PromptInput>, Settings), ApiError> {
        let prompts: Vec<PromptInput> = match &self.prompt {
            Prompt::One(s) => vec![PromptInput::Text(s.clone())],
            Prompt::Tokens(t) => vec![PromptInput::Tokens(t.clone())],
            Prompt::Many(v) => v.iter().cloned().map(PromptInput::Text).collect(),
            Prompt::ManyTokens(v) => v.iter().cloned().map(PromptInput::Tokens).collect(),
        };
        if prompts.is_empty() {
            return Err(ApiError::bad(
                Some("prompt".into()),
                "prompt: no prompt given",
            ));
        }
        if self.tools.as_ref().is_some_and(|v| !is_empty(v)) {
            return Err(ApiError::bad(
                Some("tools".into()),
                "tools: tools are offered through a chat template; use /v1/chat/completions",
            ));
        }
        if self.suffix.is_some() {
            return Err(ApiError::bad(
                Some("suffix".into()),
                "suffix is not supported",
            ));
        }
        let lp = match self.logprobs {
            Some(n) if n > 5 => {
                return Err(ApiError::bad(
                    Some("logprobs".into()),
                    "logprobs must be 0 to 5",
                ));
            }
            Some(n) => Some(n as usize),
            None => None,
        };
        // No max_tokens: the endpoint's default of 16 is applied when the
        // request is queued (within the server's cap).
        let mut s = self.common().settings(lp)?;
        s.echo = self.echo.unwrap_or(false);
        if s.max_tokens == Some(0) && !s.echo {
            return Err(ApiError::bad(
                Some("max_tokens".into()),
                "max_tokens must be at least 1 (0 only with echo: the prompt's log-probabilities alone)",
            ));
        }
        if prompts.len() * s.n > MAX_PROMPTS {
            return Err(ApiError::bad(
                Some("prompt".into()),
                format!(
                    "{} prompts times n = {} is more than {MAX_PROMPTS} choices in one request",
                    prompts.len(),
                    s.n
                ),
            ));
        }
        Ok((prompts, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_bodies_name_their_problem() {
        let e = parse::<ChatRequest>(b"{").unwrap_err();
        assert_eq!(e.status, 400);
        let e = parse::<ChatRequest>(br#"{"messages": [], "max_tokens": -3}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"), "{}", e.message);
        let e = parse::<ChatRequest>(br#"{"messages": [], "temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"), "{}", e.message);
        let e = parse::<ChatRequest>(br#"{"messages": [{"role": "user", "content": 3}]}"#)
            .unwrap()
            .check()
            .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content"),
            "{}",
            e.message
        );
        let e = parse::<ChatRequest>(b"\xff\xfe").unwrap_err();
        assert!(e.message.contains("UTF-8"));
        let r =
            parse::<ChatRequest>(br#"{"messages": [{"role": "user", "content": "x"}], "n": 17}"#)
                .unwrap();
        assert_eq!(r.check().unwrap_err().param.as_deref(), Some("n"));
        let r =
            parse::<ChatRequest>(br#"{"messages": [{"role": "robot", "content": "x"}]}"#).unwrap();
        assert!(r.check().unwrap_err().message.contains("robot"));
        let r = parse::<ChatRequest>(
            br#"{"messages": [{"role": "user", "content": "x"}], "temperature": 9}"#,
        )
        .unwrap();
        assert_eq!(r.check().unwrap_err().param.as_deref(), Some("temperature"));
    }

    use proptest::prelude::Strategy as _;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Arbitrary bytes, and JSON objects with arbitrary values in the known
        /// fields, never panic: they parse and check, or give a 4xx.
        #[test]
        fn any_body_is_checked_without_panicking(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            key in proptest::sample::select(vec!["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "n", "logprobs", "top_logprobs", "messages", "prompt", "echo"]),
            val in proptest::prop_oneof![
                proptest::prelude::any::<i64>().prop_map(|v| v.to_string()),
                proptest::prelude::any::<f64>().prop_map(|v| if v.is_finite() { v.to_string() } else { "1e999".into() }),
                "\\PC{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap()),
                proptest::prelude::Just("[]".to_string()),
                proptest::prelude::Just("null".to_string()),
                proptest::prelude::Just("[\"a\", \"b\", \"c\", \"d\", \"e\"]".to_string()),
                proptest::prelude::Just("{\"role\": \"user\"}".to_string()),
            ],
        ) {
            let _ = parse::<ChatRequest>(&bytes).map(|r| r.check());
            let _ = parse::<CompletionRequest>(&bytes).map(|r| r.check());
            let chat = format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], "{key}": {val}}}"#);
            if let Err(e) = parse::<ChatRequest>(chat.as_bytes()).and_then(|r| r.check()) {
                proptest::prop_assert!(e.status >= 400 && e.status < 500);
            }
            let comp = format!(r#"{{"prompt": "x", "{key}": {val}}}"#);
            if let Err(e) = parse::<CompletionRequest>(comp.as_bytes()).and_then(|r| r.check().map(|_| ())) {
                proptest::prop_assert!(e.status >= 400 && e.status < 500);
            }
        }
    }

    #[test]
    fn good_bodies_parse_with_defaults() {
        let r = parse::<ChatRequest>(
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "x", "user": "u", "stream": true}"#,
        )
        .unwrap();
        let (m, s) = r.check().unwrap();
        assert_eq!(m.messages, json!([{"role": "user", "content": "hi"}]));
        assert_eq!((m.tools, m.tool_choice), (None, ToolChoice::None));
        assert_eq!(s.stop, vec!["x".to_string()]);
        assert_eq!(s.penalties, Penalties::default());
        assert_eq!(s.repeat_last_n, Some(64));
        assert!(s.stream);
        assert_eq!(s.max_tokens, None);
        let c = parse::<CompletionRequest>(br#"{"prompt": ["a"], "logprobs": 2}"#).unwrap();
        let (p, s) = c.check().unwrap();
        assert_eq!(p, vec![PromptInput::Text("a".into())]);
        assert_eq!(s.max_tokens, None);
        assert_eq!(s.logprobs, Some(2));
    }

    /// The messages as `(role, content)`.
    fn chat(body: &str) -> Result<(Vec<(String, String)>, Settings), ApiError> {
        let (p, s) = parse::<ChatRequest>(body.as_bytes()).and_then(|r| r.check())?;
        Ok((p.pairs(), s))
    }

    #[test]
    fn response_formats_grammars_and_required_tools() {
        let with = |extra: &str| {
            let b = format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {extra}}}"#);
            parse::<ChatRequest>(b.as_bytes()).and_then(|r| r.check())
        };
        let fmt = |extra: &str| with(extra).unwrap().1.format;
        assert_eq!(
            fmt(r#""response_format": {"type": "json_object"}"#),
            Some(Format::JsonObject)
        );
        assert_eq!(
            fmt(
                r#""response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "array"}}}"#
            ),
            Some(Format::JsonSchema(json!({"type": "array"})))
        );
        assert_eq!(fmt(r#""response_format": {"type": "text"}"#), None);
        assert_eq!(
            fmt(r#""grammar": "root ::= [a-c]+ tail\ntail ::= \"!\"""#),
            Some(Format::Lark("start: /[a-c]/+ tail\ntail: \"!\"\n".into()))
        );
        let tools = r#""tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]"#;
        let (p, s) = with(&format!(r#"{tools}, "tool_choice": "required""#)).unwrap();
        assert!(matches!(&p.tool_choice, ToolChoice::Required(t) if t.len() == 2));
        assert!(matches!(&s.format, Some(Format::ToolCall(t)) if t.len() == 2));
        let (_, s) = with(&format!(
            r#"{tools}, "tool_choice": {{"type": "function", "function": {{"name": "b"}}}}"#
        ))
        .unwrap();
        assert!(
            matches!(&s.format, Some(Format::ToolCall(t)) if t[0]["function"]["name"] == "b" && t.len() == 1)
        );
        for (bad, param) in [
            (
                format!(
                    r#"{tools}, "tool_choice": {{"type": "function", "function": {{"name": "c"}}}}"#
                ),
                "tool_choice",
            ),
            (r#""tool_choice": "required""#.to_string(), "tool_choice"),
            (
                format!(
                    r#"{tools}, "tool_choice": "required", "response_format": {{"type": "json_object"}}"#
                ),
                "tool_choice",
            ),
            (
                r#""grammar": "start: \"a\"", "response_format": {"type": "json_object"}"#
                    .to_string(),
                "grammar",
            ),
        ] {
            let e = with(&bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn tools_tool_calls_and_template_kwargs() {
        let body = r#"{"messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "reasoning_content": "hm",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
            "chat_template_kwargs": {"enable_thinking": false}, "reasoning_format": "none"}"#;
        let (p, _) = parse::<ChatRequest>(body.as_bytes())
            .unwrap()
            .check()
            .unwrap();
        assert_eq!(p.tool_choice, ToolChoice::Auto);
        assert_eq!(p.tools.as_ref().unwrap()[0]["function"]["name"], "w");
        assert_eq!(p.kwargs["enable_thinking"], json!(false));
        assert_eq!(p.reasoning, Some(ReasoningFormat::None));
        let m = &p.messages;
        assert_eq!(
            m[1]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(m[1]["reasoning_content"], "hm");
        assert_eq!(
            (m[2]["role"].as_str(), m[2]["tool_call_id"].as_str()),
            (Some("tool"), Some("c1"))
        );
        // tool_choice none: the template does not see the tools.
        let none = body.replace(r#""reasoning_format": "none""#, r#""tool_choice": "none""#);
        let (p, _) = parse::<ChatRequest>(none.as_bytes())
            .unwrap()
            .check()
            .unwrap();
        assert_eq!((p.tools, p.tool_choice), (None, ToolChoice::None));
        for (bad, param) in [
            (r#""tools": [{"type": "retrieval"}]"#, "tools[0].type"),
            (
                r#""tools": [{"type": "function", "function": {"name": "a b"}}]"#,
                "tools[0].function.name",
            ),
            (r#""tools": {"type": "function"}"#, "tools"),
            (r#""reasoning_format": "xml""#, "reasoning_format"),
        ] {
            let b = format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {bad}}}"#);
            let e = parse::<ChatRequest>(b.as_bytes())
                .and_then(|r| r.check())
                .unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
        let b = r#"{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": "[1]"}}]}]}"#;
        let e = parse::<ChatRequest>(b.as_bytes())
            .and_then(|r| r.check())
            .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].tool_calls[0]"),
            "{}",
            e.message
        );
    }

    #[test]
    fn unknown_fields_are_ignored_and_no_op_values_accepted() {
        let (m, s) = chat(
            r#"{"messages": [{"role": "user", "content": "hi", "refusal": null}],
                "store": false, "parallel_tool_calls": false, "user": "u", "metadata": {"a": "b"},
                "service_tier": "auto", "stream_options": {"include_usage": true},
                "logit_bias": {}, "n": 1, "best_of": 1, "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "modalities": ["text"], "prediction": null}"#,
        )
        .unwrap();
        assert_eq!(m[0].1, "hi");
        assert_eq!(s.temperature, 1.0);
        let r = parse::<ChatRequest>(
            br#"{"messages": [{"role": "user", "content": "hi"}], "store": true}"#,
        )
        .unwrap();
        assert!(r.extra.contains_key("store"));
        let c = parse::<CompletionRequest>(
            br#"{"prompt": "x", "best_of": 1, "logit_bias": {}, "user": "u", "store": 1}"#,
        )
        .unwrap();
        assert!(c.check().is_ok());
    }

    #[test]
    fn unsupported_fields_are_refused_by_name() {
        let base = r#""messages": [{"role": "user", "content": "hi"}]"#;
        for (field, val) in [
            ("n", "0"),
            ("n", "17"),
            ("logit_bias", r#"{"x": -100}"#),
            ("logit_bias", r#"{"15": 101}"#),
            ("logit_bias", r#"{"15": "a"}"#),
            ("logit_bias", "[]"),
            ("best_of", "3"),
            ("tool_choice", r#""required""#),
            ("functions", r#"[{"name": "f"}]"#),
            ("function_call", r#"{"name": "f"}"#),
            ("response_format", r#"{"type": "xml"}"#),
            ("response_format", r#"{"type": "json_schema"}"#),
            ("modalities", r#"["text", "audio"]"#),
            ("audio", r#"{"voice": "x"}"#),
            ("presence_penalty", "2.5"),
            ("frequency_penalty", "-3"),
            ("repeat_last_n", "-2"),
        ] {
            let e = chat(&format!("{{{base}, \"{field}\": {val}}}")).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(field), "{field}: {}", e.message);
            assert!(e.message.contains(field), "{}", e.message);
        }
    }

    #[test]
    fn content_parts_are_concatenated_and_other_parts_refused() {
        let (m, _) = chat(
            r#"{"messages": [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                              {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                              {"role": "assistant", "content": null, "tool_calls": []},
                              {"role": "developer", "content": []}]}"#,
        )
        .unwrap();
        assert_eq!(
            m,
            vec![
                ("system".into(), "be brief".into()),
                ("user".into(), "Hi".into()),
                ("assistant".into(), String::new()),
                ("system".into(), String::new()),
            ]
        );
        let e = chat(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[1].type"));
        assert!(e.message.contains("image_url"), "{}", e.message);
        for (body, param) in [
            (
                r#"[{"type": "input_audio"}]"#,
                "messages[0].content[0].type",
            ),
            (r#"[{"text": "a"}]"#, "messages[0].content[0]"),
            (r#"[{"type": "text"}]"#, "messages[0].content[0].text"),
            (r#"[3]"#, "messages[0].content[0]"),
        ] {
            let e = chat(&format!(
                r#"{{"messages": [{{"role": "user", "content": {body}}}]}}"#
            ))
            .unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
        let e = chat(
            r#"{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].tool_calls[0]"));
    }

    #[test]
    fn penalties_and_window_are_read() {
        let (_, s) = chat(
            r#"{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5, "frequency_penalty": -1, "repeat_last_n": -1}"#,
        )
        .unwrap();
        assert_eq!(
            s.penalties,
            Penalties {
                presence: 0.5,
                frequency: -1.0
            }
        );
        assert_eq!(s.repeat_last_n, None);
        let (_, s) = chat(
            r#"{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"20": 1.5, "3": -100}}"#,
        )
        .unwrap();
        assert_eq!(s.logit_bias, vec![(3, -100.0), (20, 1.5)]);
    }
}
