//! Who may call the server: API keys (`--api-key`) and CORS (`--cors`).
//!
//! With keys set, every request to `/v1/...`, `/completion`, `/tokenize`, `/detokenize`, `/apply-template`, `/props`
//! and `/metrics` must carry `Authorization: Bearer KEY` with one of them;
//! otherwise it gets a 401 with OpenAI's error object (code
//! `invalid_api_key`) and `WWW-Authenticate: Bearer`. Keys are compared in
//! time that does not depend on where a wrong key differs. `/health`, the
//! chat page at `/` and unknown paths (404) stay open. Without keys nothing
//! is checked.
//!
//! With CORS origins set, responses to a request from an allowed origin
//! carry `Access-Control-Allow-Origin`, and preflight `OPTIONS` requests are
//! answered (methods `GET`, `POST`, the request's headers allowed, cached
//! for 10 minutes) before the key check: a browser sends its preflight
//! without credentials. Without origins no CORS header is sent, and a page
//! from another origin cannot read the API's responses.

use crate::api::ApiError;
use crate::metrics::Metrics;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Duration;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

/// What [`crate::Options`] says about access.
#[derive(Clone, Default, PartialEq)]
pub struct Access {
    /// API keys (each entry may hold several, comma-separated); empty: no
    /// key needed.
    pub api_keys: Vec<String>,
    /// Origins allowed by CORS (each entry may hold several,
    /// comma-separated; `*`: any); empty: no CORS headers.
    pub cors: Vec<String>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field(
                "api_keys",
                &format_args!("[{} redacted]", self.api_keys.len()),
            )
            .field("cors", &self.cors)
            .finish()
    }
}

/// The checked form of [`Access`], ready to wrap the router.
pub struct Checked {
    keys: Vec<Vec<u8>>,
    cors: Option<CorsLayer>,
}

/// Split comma-separated entries, trimmed; an empty one is an error.
fn split<'a>(entries: &'a [String], what: &str) -> Result<Vec<&'a str>, String> {
    let mut out = Vec::new();
    for e in entries {
        for item in e.split(',') {
            let item = item.trim();
            if item.is_empty() {
                return Err(format!("{what}: empty entry in {e:?}"));
            }
            out.push(item);
        }
    }
    Ok(out)
}

impl Access {
    /// Check the keys (visible ASCII, no spaces: what fits in a bearer
    /// token) and the origins (`scheme://host[:port]`, or `*`).
    pub fn check(&self) -> Result<Checked, String> {
        let mut keys = Vec::new();
        for k in split(&self.api_keys, "--api-key")? {
            if !k.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(
                    "--api-key: a key must be printable ASCII without spaces (it is sent as `Authorization: Bearer KEY`)"
                        .into(),
                );
            }
            keys.push(k.as_bytes().to_vec());
        }
        let origins = split(&self.cors, "--cors")?;
        let cors = if origins.is_empty() {
            None
        } else {
            let allow = if origins.contains(&"*") {
                AllowOrigin::any()
            } else {
                let mut list = Vec::new();
                for o in origins {
                    list.push(origin(o)?);
                }
                AllowOrigin::list(list)
            };
            Some(
                CorsLayer::new()
                    .allow_origin(allow)
                    .allow_methods([Method::GET, Method::POST])
                    .allow_headers(AllowHeaders::mirror_request())
                    .expose_headers([header::RETRY_AFTER])
                    .max_age(Duration::from_secs(600)),
            )
        };
        Ok(Checked { keys, cors })
    }
}

/// One `--cors` origin as a browser sends it: `scheme://host[:port]`, no
/// path (a trailing `/` is dropped), lowercase scheme and host.
fn origin(o: &str) -> Result<HeaderValue, String> {
    let bad = || format!("--cors: {o:?} is not an origin (scheme://host[:port], or *)");
    let o = o.strip_suffix('/').unwrap_or(o);
    let (scheme, rest) = o.split_once("://").ok_or_else(bad)?;
    let ok_scheme = !scheme.is_empty()
        && scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b));
    let ok_host = !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"/?#@\\".contains(&b));
    if !ok_scheme || !ok_host {
        return Err(bad());
    }
    HeaderValue::from_str(&o.to_ascii_lowercase()).map_err(|_| bad())
}

impl Checked {
    /// Whether keys are required.
    pub fn needs_key(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether CORS is on.
    pub fn cors(&self) -> bool {
        self.cors.is_some()
    }

    /// `router` with the key check and CORS around it (CORS outermost, so
    /// that preflights skip the key check and 401s carry CORS headers).
    pub fn wrap(self, router: Router, metrics: Arc<Metrics>) -> Router {
        let mut r = router;
        if !self.keys.is_empty() {
            let gate = Arc::new(Gate {
                keys: self.keys,
                metrics,
            });
            r = r.layer(axum::middleware::from_fn_with_state(gate, require_key));
        }
        if let Some(cors) = self.cors {
            r = r.layer(cors);
        }
        r
    }
}

/// Whether `path` needs a key when keys are set.
pub fn protected(path: &str) -> bool {
    path == "/v1"
        || path.starts_with("/v1/")
        || matches!(
            path,
            "/completion" | "/tokenize" | "/detokenize" | "/apply-template" | "/props" | "/metrics"
        )
}

/// The key check's state.
struct Gate {
    keys: Vec<Vec<u8>>,
    metrics: Arc<Metrics>,
}

/// `a == b` in time that depends on the lengths only: every byte of `key`
/// is looked at whatever `given` holds.
fn same(given: &[u8], key: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != key.len());
    for (i, &k) in key.iter().enumerate() {
        diff |= k ^ given.get(i).copied().unwrap_or(!k);
    }
    std::hint::black_box(diff) == 0
}

/// The token of an `Authorization: Bearer TOKEN` header (the scheme is
/// case-insensitive).
fn bearer(v: &HeaderValue) -> Option<&[u8]> {
    let v = v.as_bytes();
    let (scheme, rest) = v.split_at(v.iter().position(|&b| b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

async fn require_key(State(gate): State<Arc<Gate>>, req: Request, next: Next) -> Response {
    if !protected(req.uri().path()) {
        return next.run(req).await;
    }
    let token = req.headers().get(header::AUTHORIZATION).map(bearer);
    let message = match token {
        Some(Some(t)) => {
            // Every key is compared: the time does not say which matched.
            let ok = gate.keys.iter().fold(false, |ok, k| ok | same(t, k));
            if ok {
                return next.run(req).await;
            }
            "Incorrect API key provided."
        }
        Some(None) => "The Authorization header must be `Bearer KEY`.",
        None => {
            "You didn't provide an API key: send it as `Authorization: Bearer KEY` (the server was started with --api-key)."
        }
    };
    gate.metrics.bad_requests.inc(1);
    unauthorized(message)
}

/// A 401 with OpenAI's error object and `WWW-Authenticate: Bearer`.
fn unauthorized(message: &str) -> Response {
    let e = ApiError {
        status: 401,
        message: message.into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
    };
    let mut r = (StatusCode::UNAUTHORIZED, axum::Json(e.body())).into_response();
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(keys: &[&str], cors: &[&str]) -> Access {
        Access {
            api_keys: keys.iter().map(|s| s.to_string()).collect(),
            cors: cors.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn keys_and_origins_parse() {
        let c = access(&["a, b", "c"], &[]).check().unwrap();
        assert_eq!(c.keys, [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        assert!(c.needs_key() && !c.cors());
        let c = access(&[], &["http://localhost:3000/", "https://x.example"])
            .check()
            .unwrap();
        assert!(!c.needs_key() && c.cors());
        assert!(access(&[], &["*"]).check().unwrap().cors());
        for bad in [
            access(&[""], &[]),
            access(&["a,,b"], &[]),
            access(&["has space"], &[]),
            access(&["é"], &[]),
            access(&[], &["localhost:3000"]),
            access(&[], &["http://x/path"]),
            access(&[], &["http://"]),
            access(&[], &["http://a,"]),
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        assert_eq!(origin("HTTP://Host:1/").unwrap(), "http://host:1");
        let shown = format!("{:?}", access(&["secret"], &[]));
        assert!(!shown.contains("secret"), "{shown}");
    }

    #[test]
    fn keys_compare_whole() {
        assert!(same(b"key", b"key"));
        for given in [&b""[..], b"ke", b"kez", b"keyy", b"Key", b"\xff\xff\xff"] {
            assert!(!same(given, b"key"), "{given:?}");
        }
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert_eq!(bearer(&h("Bearer abc")), Some(&b"abc"[..]));
        assert_eq!(bearer(&h("bearer   abc")), Some(&b"abc"[..]));
        assert_eq!(bearer(&h("Basic abc")), None);
        assert_eq!(bearer(&h("Bearer")), None);
        assert_eq!(bearer(&h("Bearer ")), None);
        assert_eq!(bearer(&h("abc")), None);
    }

    #[test]
    fn protected_paths() {
        for p in [
            "/v1",
            "/v1/models",
            "/v1/chat/completions",
            "/v1/x",
            "/tokenize",
            "/metrics",
        ] {
            assert!(protected(p), "{p}");
        }
        for p in ["/", "/health", "/v10", "/tokenizer", "/favicon.ico"] {
            assert!(!protected(p), "{p}");
        }
    }
}
