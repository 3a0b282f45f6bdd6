//! The chat page at `GET /`: one HTML file with its CSS and JavaScript
//! inline (no other request than the API's own), built into the binary.
//!
//! It streams replies from `POST /v1/chat/completions` (`stream: true`),
//! keeps the conversation, shows `delta.reasoning_content` folded above the
//! answer, stops a reply with its Stop button (the request is cancelled when
//! the connection closes), and has fields for a system prompt, the sampling
//! settings and an API key (kept in the browser's localStorage, sent as
//! `Authorization: Bearer`). Each reply's element carries `data-state`
//! (`streaming`, `done`, `stopped` or `error`) for tests.
//!
//! The page's Content-Security-Policy allows only inline script and style
//! and connections to the page's own origin.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The page.
pub const CHAT_HTML: &str = include_str!("page/chat.html");

/// The policy: nothing loads from elsewhere; the page may not be framed.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// `GET /`.
pub async fn chat() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        CHAT_HTML,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::CHAT_HTML;

    #[test]
    fn the_page_is_self_contained_and_sets_no_html_from_text() {
        let lower = CHAT_HTML.to_ascii_lowercase();
        assert!(lower.starts_with("<!doctype html>"));
        for banned in [
            "http://",
            "https://",
            "//cdn",
            "src=",
            "<link",
            "@import",
            "innerhtml",
            "outerhtml",
            "insertadjacenthtml",
            "document.write",
            "eval(",
        ] {
            assert!(!lower.contains(banned), "the page contains {banned:?}");
        }
        for needed in [
            "v1/chat/completions",
            "reasoning_content",
            "abortcontroller",
            "localstorage",
            "data-state",
        ] {
            assert!(lower.contains(needed), "the page lacks {needed:?}");
        }
    }
}
