//! Who may call the server, on loopback against a tiny synthetic model: the
//! API key (401 with OpenAI's error object without or with a wrong key, 200
//! with a right one, `/health` and the chat page open), CORS (off by
//! default; preflight answered without a key when on), and the chat page at
//! `GET /`.

use samesum_engine::{KvType, Model};
use samesum_gguf::GgmlType;
use samesum_server::{Access, CpuBackend, Options};
use samesum_synth::{SynthOptions, shapes, write_model};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

struct Server {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn options(access: Access) -> Options {
    Options {
        host: "127.0.0.1".into(),
        port: 0,
        backend: std::sync::Arc::new(CpuBackend(1)),
        max_batch: 2,
        max_queue: 4,
        max_body: 1 << 16,
        ctx: 256,
        prefill_chunk: 16,
        kv: KvType::F32,
        prefix_cache_mb: 0,
        kv_budget: Default::default(),
        model_name: "tiny".into(),
        limits: Default::default(),
        access,
        reasoning_format: samesum_server::api::ReasoningFormat::Deepseek,
        chat_template: None,
    }
}

fn model() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    let shape = shapes::by_name("tiny-qwen3moe").unwrap();
    write_model(
        &SynthOptions::new(shape, GgmlType::Q8_0, 0),
        &p,
        &mut |_, _| {},
    )
    .unwrap();
    let model = Model::load(&p).unwrap();
    (dir, model)
}

fn start(keys: &[&str], cors: &[&str]) -> Server {
    let (dir, model) = model();
    let opts = options(Access {
        api_keys: keys.iter().map(|s| s.to_string()).collect(),
        cors: cors.iter().map(|s| s.to_string()).collect(),
    });
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(samesum_server::serve(
            model,
            opts,
            move |a| addr_tx.send(a).unwrap(),
            async {
                let _ = stop_rx.await;
            },
        ))
        .unwrap();
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    Server {
        addr,
        _dir: dir,
        stop: Some(stop_tx),
        thread: Some(thread),
    }
}

/// A response: status, head lines lowercased (`name: value`), body.
struct Resp {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Resp {
    /// The value of header `name` (lowercase), if present.
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// One HTTP/1.1 request with `Connection: close` and extra header lines.
fn request(addr: SocketAddr, method: &str, path: &str, headers: &[&str], body: &str) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut body = raw[split + 4..].to_vec();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = Vec::new();
        loop {
            let end = body.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&body[..end]).unwrap().trim(), 16)
                .unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&body[end + 2..end + 2 + n]);
            body.drain(..end + 2 + n + 2);
        }
        body = out;
    }
    Resp { status, head, body }
}

fn chat_body() -> String {
    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
        .to_string()
}

fn assert_401(r: &Resp, what: &str) {
    assert_eq!(r.status, 401, "{what}: {}", r.head);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{what}");
    let e = &r.json()["error"];
    assert_eq!(e["type"], "invalid_request_error", "{what}: {e}");
    assert_eq!(e["code"], "invalid_api_key", "{what}: {e}");
    assert!(e["param"].is_null(), "{what}: {e}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {e}"
    );
}

#[test]
fn the_api_key_guards_the_api_and_leaves_health_and_the_page_open() {
    let s = start(&["k1,k2", "third"], &[]);
    let a = s.addr;
    let chat = chat_body();
    let guarded: [(&str, &str, &str); 6] = [
        ("POST", "/v1/chat/completions", &chat),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "a", "max_tokens": 2}"#,
        ),
        ("GET", "/v1/models", ""),
        ("POST", "/tokenize", r#"{"content": "a b"}"#),
        ("POST", "/detokenize", r#"{"tokens": [1, 2]}"#),
        ("GET", "/metrics", ""),
    ];
    for (method, path, body) in guarded {
        for (auth, what) in [
            (None, "no key"),
            (Some("Authorization: Bearer k3"), "a wrong key"),
            (
                Some("Authorization: Bearer k1x"),
                "a key with a right prefix",
            ),
            (Some("Authorization: Bearer k"), "a prefix of a key"),
            (Some("Authorization: Basic k1"), "another scheme"),
            (Some("Authorization: Bearer"), "no token"),
            (Some("Authorization: k1"), "no scheme"),
        ] {
            let r = request(a, method, path, auth.as_slice(), body);
            assert_401(&r, &format!("{method} {path} with {what}"));
        }
        for key in ["k1", "k2", "third"] {
            for h in [
                format!("Authorization: Bearer {key}"),
                format!("authorization: bearer  {key}"),
            ] {
                let r = request(a, method, path, &[&h], body);
                assert_eq!(r.status, 200, "{method} {path} with {h:?}: {}", r.head);
            }
        }
    }
    // A streamed chat with the key: the tokens arrive.
    let stream =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true})
            .to_string();
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &["Authorization: Bearer third"],
        &stream,
    );
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).ends_with("data: [DONE]\n\n"));
    // Unknown /v1 paths need the key too; other unknown paths are a 404.
    assert_401(&request(a, "GET", "/v1/nothing", &[], ""), "/v1/nothing");
    assert_eq!(request(a, "GET", "/nothing", &[], "").status, 404);
    // Open: /health, the page.
    let r = request(a, "GET", "/health", &[], "");
    assert_eq!((r.status, r.json()), (200, json!({"status": "ok"})));
    let r = request(a, "GET", "/", &[], "");
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/html"));
    // Without --cors, no CORS header even with a key and an Origin.
    let r = request(
        a,
        "GET",
        "/v1/models",
        &["Authorization: Bearer k1", "Origin: http://elsewhere.test"],
        "",
    );
    assert_eq!(r.status, 200);
    assert!(
        !r.head.to_ascii_lowercase().contains("access-control-"),
        "{}",
        r.head
    );
    // Refused requests are counted with the bad ones.
    let m = request(a, "GET", "/metrics", &["Authorization: Bearer k2"], "");
    let text = String::from_utf8_lossy(&m.body).to_string();
    let bad = text
        .lines()
        .find(|l| l.starts_with("samesum_requests_invalid_total "))
        .unwrap_or_else(|| panic!("no requests_invalid counter in {text}"));
    assert!(
        bad.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 43,
        "{bad}"
    );
}

#[test]
fn without_a_key_or_cors_nothing_changes() {
    let s = start(&[], &[]);
    let a = s.addr;
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        &["Origin: http://x.test"],
        &chat_body(),
    );
    assert_eq!(r.status, 200, "{}", r.head);
    assert!(
        !r.head.to_ascii_lowercase().contains("access-control-"),
        "{}",
        r.head
    );
    // A preflight is not answered: the route takes POST only.
    let r = request(
        a,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            "Origin: http://x.test",
            "Access-Control-Request-Method: POST",
        ],
        "",
    );
    assert_eq!(r.status, 405, "{}", r.head);
    assert!(
        !r.head.to_ascii_lowercase().contains("access-control-"),
        "{}",
        r.head
    );
    // The page: HTML, self-contained, under a policy that forbids other origins.
    let r = request(a, "GET", "/", &[], "");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/html; charset=utf-8"));
    let csp = r.header("content-security-policy").unwrap();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
        "{csp}"
    );
    let html = String::from_utf8(r.body).unwrap();
    assert!(html.starts_with("<!doctype html>"));
    assert!(html.contains("v1/chat/completions") && html.contains("</html>"));
    assert_eq!(html, samesum_server::page::CHAT_HTML);
}

#[test]
fn cors_answers_preflights_without_the_key() {
    let s = start(
        &["secret"],
        &["http://app.test", "https://other.test:8443/"],
    );
    let a = s.addr;
    for origin in ["http://app.test", "https://other.test:8443"] {
        let o = format!("Origin: {origin}");
        let r = request(
            a,
            "OPTIONS",
            "/v1/chat/completions",
            &[
                &o,
                "Access-Control-Request-Method: POST",
                "Access-Control-Request-Headers: authorization, content-type",
            ],
            "",
        );
        assert!(r.status == 200 || r.status == 204, "{}", r.head);
        assert_eq!(r.header("access-control-allow-origin"), Some(origin));
        assert!(
            r.header("access-control-allow-methods")
                .unwrap()
                .contains("POST")
        );
        let allowed = r
            .header("access-control-allow-headers")
            .unwrap()
            .to_ascii_lowercase();
        assert!(
            allowed.contains("authorization") && allowed.contains("content-type"),
            "{allowed}"
        );
        // The real request: the key is still needed, and both answers carry
        // the CORS header so the page can read them.
        let r = request(a, "POST", "/v1/chat/completions", &[&o], &chat_body());
        assert_401(&r, "CORS without a key");
        assert_eq!(r.header("access-control-allow-origin"), Some(origin));
        let r = request(
            a,
            "POST",
            "/v1/chat/completions",
            &[&o, "Authorization: Bearer secret"],
            &chat_body(),
        );
        assert_eq!(r.status, 200);
        assert_eq!(r.header("access-control-allow-origin"), Some(origin));
    }
    // Another origin gets no allow header.
    let r = request(
        a,
        "OPTIONS",
        "/v1/models",
        &[
            "Origin: http://evil.test",
            "Access-Control-Request-Method: GET",
        ],
        "",
    );
    assert_eq!(r.header("access-control-allow-origin"), None, "{}", r.head);
    // `*`: any origin.
    drop(s);
    let s = start(&[], &["*"]);
    let r = request(
        s.addr,
        "GET",
        "/v1/models",
        &["Origin: http://any.test"],
        "",
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
}

#[test]
fn bad_keys_and_origins_are_refused_at_start() {
    let (_dir, model) = model();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let access = Access {
        api_keys: vec!["a b".into()],
        cors: vec![],
    };
    let r = rt.block_on(samesum_server::serve(
        model,
        options(access),
        |_| {},
        async {},
    ));
    let e = r
        .expect_err("a key with a space must be refused")
        .to_string();
    assert!(e.contains("--api-key"), "{e}");
    let (_dir, model) = self::model();
    let access = Access {
        api_keys: vec![],
        cors: vec!["not an origin".into()],
    };
    let r = rt.block_on(samesum_server::serve(
        model,
        options(access),
        |_| {},
        async {},
    ));
    let e = r.expect_err("a bad origin must be refused").to_string();
    assert!(e.contains("--cors"), "{e}");
}
