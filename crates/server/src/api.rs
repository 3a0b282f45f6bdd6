//! The OpenAI-compatible request bodies, their validation, and the error
//! object every failure is reported with.
//!
//! Parsing is strict where a mistake would silently change the result (wrong
//! types, unknown fields of a message, unsupported options such as `n > 1`),
//! and accepts the OpenAI fields that have no effect here (`user`,
//! `stream_options`, penalties at 0).

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

/// One chat message (strict: only `role`, `content`, `name`).
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
    /// Ignored (allowed by the API).
    #[allow(dead_code)]
    pub name: Option<String>,
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
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub n: Option<u64>,
    pub ignore_eos: Option<bool>,
}

/// Defines a request struct with the endpoint's own fields plus the shared
/// ones (serde cannot deny unknown fields through `flatten`).
macro_rules! request {
    ($(#[$doc:meta])* $name:ident { $($(#[$fdoc:meta])* $f:ident : $t:ty),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Deserialize, Debug, Clone)]
        #[serde(deny_unknown_fields)]
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
            pub seed: Option<u64>,
            pub stop: Option<Stop>,
            pub stream: Option<bool>,
            /// Accepted and ignored (usage is always reported).
            pub stream_options: Option<Value>,
            pub n: Option<u64>,
            /// Keep generating past the model's end-of-text tokens (llama.cpp's
            /// server option; for benchmarks).
            pub ignore_eos: Option<bool>,
            /// Accepted and ignored.
            pub user: Option<String>,
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
                    seed: self.seed,
                    stop: self.stop.clone(),
                    stream: self.stream,
                    n: self.n,
                    ignore_eos: self.ignore_eos,
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
    }
}

/// `prompt`: a string, or a list holding one string.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Prompt {
    /// A string.
    One(String),
    /// A list of strings (exactly one is supported).
    Many(Vec<String>),
}

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
    /// Tokens to generate at most (`None`: up to the context).
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
}

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
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::bad(
                Some("n".into()),
                format!("n = {n} is not supported (only 1 choice per request)"),
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(x) = v
                && x != 0.0
            {
                return Err(ApiError::bad(
                    Some(name.into()),
                    format!("{name} is not supported (use repeat_penalty)"),
                ));
            }
        }
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
            seed: self.seed,
            stop,
            stream: self.stream.unwrap_or(false),
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

impl ChatRequest {
    /// Validate the messages and settings.
    pub fn check(&self) -> Result<Settings, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad(
                Some("messages".into()),
                "messages must not be empty",
            ));
        }
        for (i, m) in self.messages.iter().enumerate() {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "developer"
            ) {
                return Err(ApiError::bad(
                    Some(format!("messages[{i}].role")),
                    format!(
                        "unknown role {:?} (system, developer, user, assistant)",
                        m.role
                    ),
                ));
            }
        }
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
        self.common().settings(lp)
    }
}

impl CompletionRequest {
    /// Validate the prompt and settings; returns the prompt text too.
    pub fn check(&self) -> Result<(String, Settings), ApiError> {
        let prompt = match &self.prompt {
            Prompt::One(s) => s.clone(),
            Prompt::Many(v) if v.len() == 1 => v[0].clone(),
            Prompt::Many(v) => {
                return Err(ApiError::bad(
                    Some("prompt".into()),
                    format!("{} prompts given; one per request is supported", v.len()),
                ));
            }
        };
        if self.echo.unwrap_or(false) {
            return Err(ApiError::bad(Some("echo".into()), "echo is not supported"));
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
        let mut s = self.common().settings(lp)?;
        // The completions API's default length.
        s.max_tokens.get_or_insert(16);
        Ok((prompt, s))
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
        let e = parse::<ChatRequest>(
            br#"{"messages": [{"role": "user", "content": "x", "colour": 1}]}"#,
        )
        .unwrap_err();
        assert!(e.message.contains("colour"), "{}", e.message);
        let e = parse::<ChatRequest>(b"\xff\xfe").unwrap_err();
        assert!(e.message.contains("UTF-8"));
        let r =
            parse::<ChatRequest>(br#"{"messages": [{"role": "user", "content": "x"}], "n": 2}"#)
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
        let s = r.check().unwrap();
        assert_eq!(s.stop, vec!["x".to_string()]);
        assert!(s.stream);
        assert_eq!(s.max_tokens, None);
        let c = parse::<CompletionRequest>(br#"{"prompt": ["a"], "logprobs": 2}"#).unwrap();
        let (p, s) = c.check().unwrap();
        assert_eq!(p, "a");
        assert_eq!(s.max_tokens, Some(16));
        assert_eq!(s.logprobs, Some(2));
    }
}
