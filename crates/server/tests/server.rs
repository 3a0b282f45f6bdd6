//! The server end to end on loopback, against a tiny synthetic model: the
//! endpoints, batch invariance of concurrent requests, bad input (each a 4xx
//! with an OpenAI-style error, the server still serving), the full queue, and
//! cancellation by disconnect.

use samesum_engine::{KvType, Model};
use samesum_gguf::GgmlType;
use samesum_server::{CpuBackend, Options};
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

fn start(max_batch: usize, max_queue: usize, ctx: usize) -> Server {
    start_with(max_batch, max_queue, ctx, 4096)
}

fn start_with(max_batch: usize, max_queue: usize, ctx: usize, max_body: usize) -> Server {
    start_template(max_batch, max_queue, ctx, max_body, None)
}

fn start_template(
    max_batch: usize,
    max_queue: usize,
    ctx: usize,
    max_body: usize,
    chat_template: Option<String>,
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    write_model(
        &SynthOptions::new(
            shapes::by_name("tiny-qwen3next").unwrap(),
            GgmlType::Q8_0,
            0,
        ),
        &p,
        &mut |_, _| {},
    )
    .unwrap();
    let model = Model::load(&p).unwrap();
    let opts = Options {
        host: "127.0.0.1".into(),
        port: 0,
        backend: std::sync::Arc::new(CpuBackend(2)),
        max_batch,
        max_queue,
        max_body,
        ctx,
        prefill_chunk: 16,
        kv: KvType::F32,
        prefix_cache_mb: samesum_server::DEFAULT_PREFIX_CACHE_MB,
        kv_budget: Default::default(),
        model_name: "tiny".into(),
        limits: Default::default(),
        reasoning_format: samesum_server::api::ReasoningFormat::Deepseek,
        chat_template,
        access: Default::default(),
    };
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

/// One HTTP/1.1 request with `Connection: close`: (status, headers, body).
fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut rest = raw[split + 4..].to_vec();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = Vec::new();
        loop {
            let line_end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n =
                usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap().trim(), 16)
                    .unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[line_end + 2..line_end + 2 + n]);
            rest.drain(..line_end + 2 + n + 2);
        }
        rest = out;
    }
    (status, head, rest)
}

fn post(addr: SocketAddr, path: &str, v: &Value) -> (u16, Value) {
    let (st, _, b) = request(addr, "POST", path, v.to_string().as_bytes());
    (st, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

fn chat_body(content: &str, extra: Value) -> Value {
    let mut v = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 24, "logprobs": true, "top_logprobs": 3});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

#[test]
fn endpoints_answer() {
    let s = start(4, 16, 512);
    let (st, _, b) = request(s.addr, "GET", "/health", b"");
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["status"], "ok");
    let (st, _, b) = request(s.addr, "GET", "/v1/models", b"");
    assert_eq!(st, 200);
    assert_eq!(
        serde_json::from_slice::<Value>(&b).unwrap()["data"][0]["id"],
        "tiny"
    );
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body("Hello", json!({"temperature": 0})),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["completion_tokens"], 24);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len(),
        24
    );
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    // Streaming: well-formed events, the text equal to the non-streamed one.
    let body = chat_body("Hello", json!({"temperature": 0, "stream": true}));
    let (st, head, b) = request(
        s.addr,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(st, 200);
    assert!(
        head.to_ascii_lowercase().contains("text/event-stream"),
        "{head}"
    );
    let text = String::from_utf8(b).unwrap();
    let datas: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*datas.last().unwrap(), "[DONE]");
    let mut streamed = String::new();
    for d in &datas[..datas.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(c);
        }
    }
    let (_, v) = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body("Hello", json!({"temperature": 0})),
    );
    assert_eq!(
        streamed,
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let (st, _, b) = request(s.addr, "GET", "/metrics", b"");
    assert_eq!(st, 200);
    let m = String::from_utf8(b).unwrap();
    assert!(m.contains("samesum_requests_total 4"), "{m}");
    // Tier mode's expert-cache counters are exposed, zero without tier mode.
    assert!(m.contains("samesum_expert_cache_hits_total 0"), "{m}");
    assert!(m.contains("samesum_expert_cache_misses_total 0"), "{m}");
}

#[test]
fn concurrent_requests_get_the_bytes_they_get_alone() {
    let s = start(8, 32, 512);
    let prompts = [
        "Tell me a story",
        "What is two plus two",
        "Name three colours",
        "Why",
        "Explain mixture of experts models in detail please",
        "Hi",
    ];
    let bodies: Vec<Value> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if i % 2 == 0 {
                chat_body(p, json!({"temperature": 0}))
            } else {
                chat_body(p, json!({"temperature": 0.9, "seed": 1000 + i}))
            }
        })
        .collect();
    let key = |v: &Value| {
        (
            v["choices"][0]["message"]["content"].clone(),
            v["choices"][0]["logprobs"].to_string(),
        )
    };
    let alone: Vec<_> = bodies
        .iter()
        .map(|b| {
            let (st, v) = post(s.addr, "/v1/chat/completions", b);
            assert_eq!(st, 200, "{v}");
            key(&v)
        })
        .collect();
    for round in 0..2 {
        let handles: Vec<_> = bodies
            .iter()
            .cloned()
            .map(|b| {
                let a = s.addr;
                std::thread::spawn(move || post(a, "/v1/chat/completions", &b))
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            let (st, v) = h.join().unwrap();
            assert_eq!(st, 200, "{v}");
            assert_eq!(
                key(&v),
                alone[i],
                "round {round}: request {i} differs when run beside others"
            );
        }
    }
    // The concurrent rounds really shared forward calls.
    let (_, _, b) = request(s.addr, "GET", "/metrics", b"");
    let m = String::from_utf8(b).unwrap();
    let most: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("samesum_max_step_requests "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(most >= 3, "at most {most} requests shared a step");
}

#[test]
fn bad_input_is_a_4xx_with_an_error_object_and_the_server_stays_up() {
    let s = start(2, 8, 256);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "malformed json",
            b"{\"messages\": [".to_vec(),
            400,
            "not valid JSON",
        ),
        (
            "wrong type",
            br#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#.to_vec(),
            400,
            "temperature",
        ),
        (
            "a non-text content part",
            br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#.to_vec(),
            400,
            "image_url",
        ),
        (
            "logit_bias outside the vocabulary",
            br#"{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 5}}"#
                .to_vec(),
            400,
            "logit_bias",
        ),
        (
            "tools of another type",
            br#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]}"#
                .to_vec(),
            400,
            "tools",
        ),
        (
            "response_format of an unknown type",
            br#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}"#
                .to_vec(),
            400,
            "response_format",
        ),
        (
            "presence_penalty out of range",
            br#"{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}"#
                .to_vec(),
            400,
            "presence_penalty",
        ),
        (
            "negative max_tokens",
            br#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}"#.to_vec(),
            400,
            "max_tokens",
        ),
        (
            "huge max_tokens",
            br#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000000}"#
                .to_vec(),
            400,
            "context",
        ),
        (
            "invalid utf-8",
            b"{\"messages\": \xff\xfe}".to_vec(),
            400,
            "UTF-8",
        ),
        (
            "empty messages",
            br#"{"messages": []}"#.to_vec(),
            400,
            "messages",
        ),
        (
            "n above the cap",
            br#"{"messages": [{"role": "user", "content": "x"}], "n": 30}"#.to_vec(),
            400,
            "n must be 1 to 16",
        ),
        (
            "oversized body",
            format!(
                r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#,
                "a".repeat(10_000)
            )
            .into_bytes(),
            413,
            "--max-body",
        ),
        (
            "prompt longer than the context",
            json!({"messages": [{"role": "user", "content": "word ".repeat(400)}]})
                .to_string()
                .into_bytes(),
            400,
            "context",
        ),
    ];
    for (what, body, want, needle) in cases {
        let (st, _, b) = request(s.addr, "POST", "/v1/chat/completions", &body);
        assert_eq!(st, want, "{what}: {}", String::from_utf8_lossy(&b));
        let v: Value = serde_json::from_slice(&b)
            .unwrap_or_else(|_| panic!("{what}: not JSON: {}", String::from_utf8_lossy(&b)));
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: no error object: {v}"));
        assert!(
            msg.contains(needle),
            "{what}: {msg:?} does not mention {needle:?}"
        );
        assert!(v["error"]["type"].is_string(), "{what}: {v}");
    }
    let (st, _, _) = request(s.addr, "GET", "/nope", b"");
    assert_eq!(st, 404);
    // Still serving.
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "ok", "max_tokens": 2}),
    );
    assert_eq!(st, 200, "{v}");
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    // One request running, one waiting: the rest are refused.
    let s = start(1, 1, 4096);
    let long = json!({"prompt": "go", "max_tokens": 3000, "temperature": 0, "ignore_eos": true});
    let addr = s.addr;
    let first = std::thread::spawn(move || post(addr, "/v1/completions", &long));
    std::thread::sleep(Duration::from_millis(300));
    // Four at once while the long one runs: one fits the queue, three do not.
    let others: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                request(
                    addr,
                    "POST",
                    "/v1/completions",
                    br#"{"prompt": "x", "max_tokens": 1}"#,
                )
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for h in others {
        let (st, head, b) = h.join().unwrap();
        if st == 503 {
            assert!(
                head.to_ascii_lowercase().contains("retry-after: 1"),
                "{head}"
            );
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert!(
                v["error"]["message"].as_str().unwrap().contains("queue"),
                "{v}"
            );
        }
        statuses.push(st);
    }
    let refused = statuses.iter().filter(|&&s| s == 503).count();
    assert!(
        refused >= 2,
        "a queue of 1 behind a long request refused {refused} of 4: {statuses:?}"
    );
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 503),
        "{statuses:?}"
    );
    let (st, v) = first.join().unwrap();
    assert_eq!(st, 200);
    assert_eq!(v["usage"]["completion_tokens"], 3000, "{v}");
}

#[test]
fn a_client_that_disconnects_is_cancelled() {
    let s = start(2, 8, 4096);
    let body =
        json!({"prompt": "go", "max_tokens": 4000, "stream": true, "ignore_eos": true}).to_string();
    let mut c = TcpStream::connect(s.addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 512];
    let n = c.read(&mut buf).unwrap();
    assert!(n > 0);
    drop(c);
    let cancelled = |s: &Server| {
        let (_, _, b) = request(s.addr, "GET", "/metrics", b"");
        String::from_utf8(b)
            .unwrap()
            .contains("samesum_requests_cancelled_total 1")
    };
    let t = std::time::Instant::now();
    while !cancelled(&s) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the request was not cancelled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // It stopped early: far fewer than 4000 tokens were generated.
    let (_, _, b) = request(s.addr, "GET", "/metrics", b"");
    let m = String::from_utf8(b).unwrap();
    let generated: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("samesum_completion_tokens_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        generated < 4000,
        "{generated} tokens generated after the disconnect"
    );
}

#[test]
fn a_client_that_disconnects_during_prefill_is_cancelled_before_it_ends() {
    let s = start_with(2, 8, 16384, 1 << 20);
    // About 6400 prompt tokens (the tiny vocabulary splits words finely),
    // prefilled 16 rows per step.
    let prompt = "alpha beta gamma delta ".repeat(400);
    let body = json!({"prompt": prompt, "max_tokens": 4, "stream": true}).to_string();
    let mut c = TcpStream::connect(s.addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 1024];
    let n = c.read(&mut buf).unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    drop(c);
    let metric = |name: &str| -> u64 {
        let (_, _, b) = request(s.addr, "GET", "/metrics", b"");
        String::from_utf8(b)
            .unwrap()
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!("{name} "))
                    .map(|v| v.parse::<u64>().unwrap())
            })
            .unwrap()
    };
    let t = std::time::Instant::now();
    while metric("samesum_requests_cancelled_total") < 1 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the request was not cancelled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let model = Model::load(s._dir.path().join("m.gguf")).unwrap();
    let tok = samesum_engine::tokenizer::Tokenizer::from_metadata(model.file.metadata()).unwrap();
    let total = tok.encode(&prompt).unwrap().len() as u64;
    let fed = metric("samesum_prompt_tokens_total");
    eprintln!("cancelled after {fed} of {total} prompt tokens");
    assert!(
        fed + 500 < total,
        "{fed} of {total} prompt tokens were prefilled despite the disconnect"
    );
    assert_eq!(metric("samesum_completion_tokens_total"), 0);
}

#[test]
fn a_long_prefill_does_not_stall_a_running_stream() {
    let s = start_with(4, 8, 16384, 1 << 20);
    let addr = s.addr;
    // A stream that runs for a while.
    let body =
        json!({"prompt": "go", "max_tokens": 6000, "stream": true, "ignore_eos": true}).to_string();
    let mut c = TcpStream::connect(addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let (arrivals_tx, arrivals_rx) = std::sync::mpsc::channel::<std::time::Instant>();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = c.read(&mut buf) {
            if n == 0 || arrivals_tx.send(std::time::Instant::now()).is_err() {
                break;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    // A long prompt arrives: about 6400 tokens, 16 rows per step.
    let t0 = std::time::Instant::now();
    let (st, v) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "alpha beta gamma delta ".repeat(400), "max_tokens": 1}),
    );
    let t1 = std::time::Instant::now();
    assert_eq!(st, 200, "{v}");
    let arrivals: Vec<std::time::Instant> = arrivals_rx
        .try_iter()
        .filter(|&t| t >= t0 && t <= t1)
        .collect();
    drop(arrivals_rx);
    let mut gaps: Vec<f64> = arrivals
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    gaps.sort_by(f64::total_cmp);
    let worst = gaps.last().copied().unwrap_or(f64::INFINITY);
    eprintln!(
        "prefill of the long prompt took {:.2}s; the stream got {} pieces meanwhile, worst gap {:.3}s",
        (t1 - t0).as_secs_f64(),
        arrivals.len(),
        worst
    );
    assert!(
        arrivals.len() > 20,
        "the running stream stalled: {} pieces during the prefill",
        arrivals.len()
    );
    // A stall would be about the whole prefill; allow a quarter of it (the
    // other tests of this binary run at the same time on few cores).
    let took = (t1 - t0).as_secs_f64();
    assert!(
        worst < took / 4.0,
        "the running stream waited {worst:.3}s during a {took:.2}s prefill"
    );
    drop(s);
    let _ = reader.join();
}

/// A short request that arrives while a long prompt is prefilling is
/// prefilled first (shortest remaining prompt first): it finishes before the
/// long request's first token, where oldest-first would make it wait for the
/// whole long prefill. Both still get the bytes they get alone.
#[test]
fn a_short_request_does_not_wait_for_a_long_prefill() {
    let s = start_with(4, 8, 16384, 1 << 20);
    let addr = s.addr;
    let long_prompt = "alpha beta gamma delta ".repeat(400);
    let alone = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Hello there", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(alone.0, 200, "{}", alone.1);
    let (first_tx, first_rx) = std::sync::mpsc::channel::<std::time::Instant>();
    let long = std::thread::spawn(move || {
        let body = json!({"prompt": long_prompt, "max_tokens": 2, "stream": true}).to_string();
        let mut c = TcpStream::connect(addr).unwrap();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        let mut sent = false;
        while let Ok(n) = c.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
            if !sent && String::from_utf8_lossy(&seen).contains("data: {") {
                let _ = first_tx.send(std::time::Instant::now());
                sent = true;
            }
            if String::from_utf8_lossy(&seen).contains("[DONE]") {
                break;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let (st, v) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Hello there", "max_tokens": 4, "temperature": 0}),
    );
    let short_done = std::time::Instant::now();
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["text"], alone.1["choices"][0]["text"],
        "{v}"
    );
    let long_first = first_rx
        .recv_timeout(Duration::from_secs(300))
        .expect("the long request's first token");
    assert!(
        short_done < long_first,
        "the short request finished after the long request's first token"
    );
    long.join().unwrap();
}

/// What OpenAI clients send beyond the core fields: unknown fields ignored,
/// no-op values accepted, content-part arrays read as their text.
#[test]
fn openai_client_fields_are_accepted() {
    let s = start(2, 8, 256);
    let (st, plain) = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body("Hi there", json!({"temperature": 0})),
    );
    assert_eq!(st, 200, "{plain}");
    let extra = json!({
        "temperature": 0, "store": false, "parallel_tool_calls": false, "user": "u",
        "metadata": {"k": "v"}, "service_tier": "auto", "stream_options": {"include_usage": true},
        "logit_bias": {}, "n": 1, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}, "some_future_field": [1, 2],
    });
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body("Hi there", extra),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"], plain["choices"][0]["message"]);
    // The same text as parts, split anywhere, gives the same tokens.
    let mut parts = chat_body("", json!({"temperature": 0}));
    parts["messages"][0]["content"] =
        json!([{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]);
    parts["messages"][0]["name"] = json!("me");
    let (st, v) = post(s.addr, "/v1/chat/completions", &parts);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"], plain["choices"][0]["message"]);
    assert_eq!(v["usage"], plain["usage"]);
    // A non-text part is refused, naming its type and where it is.
    parts["messages"][0]["content"][1] = json!({"type": "input_audio", "input_audio": {}});
    let (st, v) = post(s.addr, "/v1/chat/completions", &parts);
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages[0].content[1].type");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("input_audio")
    );
    // Completions: best_of 1, n 1, logit_bias {} and unknown fields.
    let (st, a) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(st, 200, "{a}");
    let (st, b) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 4, "temperature": 0, "best_of": 1, "n": 1, "logit_bias": {}, "store": true}),
    );
    assert_eq!(st, 200, "{b}");
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    for (field, val) in [
        ("best_of", json!(2)),
        ("logit_bias", json!({"one": -100})),
        ("n", json!(0)),
    ] {
        let mut body = json!({"prompt": "Once", "max_tokens": 4});
        body[field] = val;
        let (st, v) = post(s.addr, "/v1/completions", &body);
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], field);
    }
}

/// Presence and frequency penalties change the sampled tokens, the same way
/// each time for a seed.
#[test]
fn penalties_change_sampled_tokens_deterministically() {
    let s = start(2, 8, 256);
    let complete = |extra: Value| {
        let mut body =
            json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "seed": 11});
        for (k, x) in extra.as_object().unwrap() {
            body[k] = x.clone();
        }
        let (st, v) = post(s.addr, "/v1/completions", &body);
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let plain = complete(json!({}));
    assert_eq!(
        plain,
        complete(json!({"presence_penalty": 0, "frequency_penalty": 0}))
    );
    let pen = json!({"presence_penalty": 1.5, "frequency_penalty": 1.5});
    let a = complete(pen.clone());
    assert_eq!(a, complete(pen));
    assert_ne!(a, plain);
    let b = complete(json!({"frequency_penalty": 2, "repeat_last_n": -1}));
    assert_eq!(
        b,
        complete(json!({"frequency_penalty": 2, "repeat_last_n": -1}))
    );
    assert_ne!(b, plain);
    // A window of 0 turns the penalties off.
    assert_eq!(
        plain,
        complete(json!({"presence_penalty": 2, "repeat_last_n": 0}))
    );
}

#[test]
fn model_tokenize_and_detokenize_endpoints() {
    let s = start(2, 8, 256);
    let (st, _, b) = request(s.addr, "GET", "/v1/models/tiny", b"");
    assert_eq!(st, 200);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["id"], "tiny");
    assert_eq!(v["object"], "model");
    let (st, _, b) = request(s.addr, "GET", "/v1/models/gpt-4o", b"");
    assert_eq!(st, 404);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(v["error"]["message"].as_str().unwrap().contains("gpt-4o"));
    assert!(v["error"]["type"].is_string());

    let (st, v) = post(s.addr, "/tokenize", &json!({"content": "Hello world"}));
    assert_eq!(st, 200, "{v}");
    let ids: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert!(!ids.is_empty());
    let (st, p) = post(
        s.addr,
        "/tokenize",
        &json!({"content": "Hello world", "with_pieces": true, "add_special": true}),
    );
    assert_eq!(st, 200, "{p}");
    let pieces = p["tokens"].as_array().unwrap();
    let tail: Vec<u64> = pieces[pieces.len() - ids.len()..]
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    assert_eq!(tail, ids, "add_special only prepends");
    let joined: String = pieces[pieces.len() - ids.len()..]
        .iter()
        .map(|t| t["piece"].as_str().unwrap())
        .collect();
    assert_eq!(joined, "Hello world");
    let (st, v) = post(s.addr, "/detokenize", &json!({"tokens": ids}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["content"], "Hello world");
    let (st, v) = post(s.addr, "/detokenize", &json!({"tokens": [1u64 << 31]}));
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "tokens[0]");
    let (st, v) = post(s.addr, "/tokenize", &json!({"text": "x"}));
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("content"));
}

/// `logit_bias` bans a token with -100 and forces one with +100.
#[test]
fn logit_bias_bans_and_forces_tokens() {
    let s = start(2, 8, 256);
    let complete = |prompt: &str, n: u64, bias: Value| {
        let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "logit_bias": bias, "ignore_eos": true});
        let (st, v) = post(s.addr, "/v1/completions", &body);
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    // A prompt whose greedy first token is a whole token of its own text.
    let (prompt, first, id) = [
        "Once upon a time",
        "Hello",
        "The",
        "1 2 3",
        "a",
        "x y",
        "Why",
    ]
    .iter()
    .find_map(|p| {
        let first = complete(p, 1, json!({}));
        let (_, v) = post(s.addr, "/tokenize", &json!({"content": first}));
        let ids = v["tokens"].as_array().unwrap().clone();
        (ids.len() == 1 && !first.contains('\u{FFFD}')).then(|| (*p, first, ids[0].clone()))
    })
    .expect("a prompt whose first token round-trips");
    let banned = complete(prompt, 1, json!({ id.to_string(): -100 }));
    assert_ne!(banned, first);
    let (_, v) = post(s.addr, "/tokenize", &json!({"content": " the"}));
    let the = v["tokens"][0].as_u64().unwrap();
    let forced = complete(prompt, 4, json!({ the.to_string(): 100 }));
    let (_, v) = post(
        s.addr,
        "/detokenize",
        &json!({"tokens": [the, the, the, the]}),
    );
    assert_eq!(forced, v["content"].as_str().unwrap());
}

/// Structured output over HTTP: every reply to a JSON schema (greedy and
/// seeded, nested objects, an enum, an array) parses and validates and ends
/// with `stop`; a forced tool call comes back as `tool_calls`; a bad schema
/// is a 400. The model's log-probabilities are untouched: the first
/// token's alternatives are the same bits as without the constraint.
#[test]
fn structured_output_parses_validates_and_keeps_the_logits() {
    let s = start(4, 16, 2048);
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["rain", "sun"]},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}},
        "required": ["city", "kind", "days", "meta"], "additionalProperties": false});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "w", "schema": schema}});
    for seed in 0..6 {
        let temp = if seed == 0 { 0.0 } else { 1.0 };
        let extra =
            json!({"response_format": rf, "temperature": temp, "seed": seed, "max_tokens": 300});
        let (st, v) = post(
            s.addr,
            "/v1/chat/completions",
            &chat_body("Weather?", extra),
        );
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        let text = c["message"]["content"].as_str().unwrap();
        let j: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}: {v}"));
        assert!(j["city"].as_str().unwrap().chars().count() <= 12, "{text}");
        assert!(
            ["rain", "sun"].contains(&j["kind"].as_str().unwrap()),
            "{text}"
        );
        assert!(
            j["days"]
                .as_array()
                .unwrap()
                .iter()
                .all(|x| x.as_f64().is_some_and(|f| f.fract() == 0.0)),
            "{text}"
        );
        assert!(j["meta"]["ok"].is_boolean(), "{text}");
        assert_eq!(c["finish_reason"], "stop", "{v}");
    }
    // The first token's alternatives: the model's, constrained or not.
    let lp = json!({"logprobs": true, "top_logprobs": 5, "temperature": 0, "max_tokens": 3});
    let mut with = lp.clone();
    with["response_format"] = json!({"type": "json_object"});
    let (_, free) = post(s.addr, "/v1/chat/completions", &chat_body("Weather?", lp));
    let (_, cons) = post(s.addr, "/v1/chat/completions", &chat_body("Weather?", with));
    let top = |v: &Value| v["choices"][0]["logprobs"]["content"][0]["top_logprobs"].clone();
    assert_eq!(top(&free), top(&cons));
    assert!(
        cons["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with('{'),
        "{cons}"
    );
    // A forced tool call.
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters":
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": false}}}]);
    let extra = json!({"tools": tools, "tool_choice": "required", "temperature": 0.8, "seed": 4, "max_tokens": 200});
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body("Weather in Paris?", extra),
    );
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    let call = &c["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{v}");
    // A schema llguidance cannot compile is the client's error.
    let extra = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}});
    let (st, v) = post(s.addr, "/v1/chat/completions", &chat_body("x", extra));
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("response_format")),
        "{v}"
    );
}

/// `n` choices: choice `i` is what the same request with `n: 1` and seed
/// `seed + i` gives, streamed or not; greedy choices agree; usage counts
/// the prompt once; more than the cap is a 400.
#[test]
fn n_choices_are_independent_seeded_samples() {
    let s = start(8, 32, 2048);
    let base = json!({"temperature": 0.9, "seed": 5, "max_tokens": 12, "ignore_eos": true, "logprobs": false, "top_logprobs": null});
    let mut three = base.clone();
    three["n"] = json!(3);
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body("Hello there", three.clone()),
    );
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut texts = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let mut one = base.clone();
        one["seed"] = json!(5 + i);
        let (_, alone) = post(
            s.addr,
            "/v1/chat/completions",
            &chat_body("Hello there", one),
        );
        assert_eq!(
            c["message"]["content"], alone["choices"][0]["message"]["content"],
            "choice {i}"
        );
        texts.push(c["message"]["content"].as_str().unwrap().to_string());
    }
    assert!(
        texts[0] != texts[1] || texts[1] != texts[2],
        "seeded choices all equal: {texts:?}"
    );
    assert_eq!(v["usage"]["completion_tokens"], 36, "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["total_tokens"], prompt + 36);
    // Streamed: each index's deltas add up to that choice.
    let mut streamed = three.clone();
    streamed["stream"] = json!(true);
    let (st, _, body) = request(
        s.addr,
        "POST",
        "/v1/chat/completions",
        chat_body("Hello there", streamed).to_string().as_bytes(),
    );
    assert_eq!(st, 200);
    let body = String::from_utf8(body).unwrap();
    let mut got = vec![String::new(); 3];
    for line in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            continue;
        }
        let c: Value = serde_json::from_str(line).unwrap();
        let ch = &c["choices"][0];
        got[ch["index"].as_u64().unwrap() as usize] +=
            ch["delta"]["content"].as_str().unwrap_or("");
    }
    assert_eq!(got, texts);
    assert!(body.trim_end().ends_with("data: [DONE]"));
    // Greedy choices agree; completions take n too.
    let (_, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Once", "n": 2, "temperature": 0, "max_tokens": 6}),
    );
    assert_eq!(v["choices"][0]["text"], v["choices"][1]["text"], "{v}");
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body("x", json!({"n": 17})),
    );
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("n")), "{v}");
}

/// `echo` with `logprobs` and `max_tokens: 0` (lm-evaluation-harness's
/// loglikelihood requests): the prompt's tokens and their log-probabilities,
/// the first `null`; each equals, bit for bit, the log-probability the
/// decode path reports when it generates that token; token-array prompts
/// and several prompts at once; the completion after the echoed prompt.
#[test]
fn echo_gives_prompt_logprobs_equal_to_the_decode_paths() {
    let s = start(4, 32, 2048);
    let tok = |text: &str| {
        let (_, v) = post(s.addr, "/tokenize", &json!({"content": text}));
        v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    let prompt = "The quick brown fox jumps";
    let ids = tok(prompt);
    // Three tokens generated by the decode path (a logit bias forces the
    // token; the reported log-probabilities are the model's, unbiased).
    let x = tok(" the")[0];
    let forced = json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2,
        "ignore_eos": true, "logit_bias": {x.to_string(): 100}});
    let (_, greedy) = post(s.addr, "/v1/completions", &forced);
    let gen_lp = &greedy["choices"][0]["logprobs"];
    let gen_text = greedy["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(gen_text, " the the the", "{greedy}");
    // The prompt and those three tokens, echoed and scored by prefill.
    let mut all = ids.clone();
    all.extend([x, x, x]);
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": all, "max_tokens": 0, "echo": true, "logprobs": 2, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["text"], format!("{prompt}{gen_text}"), "{v}");
    let lp = &c["logprobs"];
    let n = all.len();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    for k in 0..3 {
        // Same bits: prefill's row for a position is the decode step's.
        assert_eq!(
            lp["token_logprobs"][n - 3 + k],
            gen_lp["token_logprobs"][k],
            "token {k}: {v} vs {greedy}"
        );
        assert_eq!(lp["top_logprobs"][n - 3 + k], gen_lp["top_logprobs"][k]);
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], n);
    // Text and token prompts agree; several prompts give one choice each.
    let (_, a) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": [prompt, "Hello"], "max_tokens": 0, "echo": true, "logprobs": 1}),
    );
    let (_, b) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": [ids, tok("Hello")], "max_tokens": 0, "echo": true, "logprobs": 1}),
    );
    assert_eq!(a["choices"], b["choices"]);
    assert_eq!(a["choices"][1]["index"], 1);
    assert_eq!(a["choices"][1]["text"], "Hello");
    // Echo before a completion; streamed, the prompt comes first.
    let mut body = forced.clone();
    body["echo"] = json!(true);
    let (_, e) = post(s.addr, "/v1/completions", &body);
    assert_eq!(e["choices"][0]["text"], format!("{prompt}{gen_text}"));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, _, raw) = request(
        s.addr,
        "POST",
        "/v1/completions",
        streamed.to_string().as_bytes(),
    );
    let raw = String::from_utf8(raw).unwrap();
    let texts: Vec<String> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(texts[0], prompt);
    assert_eq!(texts.concat(), format!("{prompt}{gen_text}"));
    // Errors: max_tokens 0 without echo, a token outside the vocabulary.
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 0}),
    );
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("max_tokens")),
        "{v}"
    );
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": [1, 999999], "max_tokens": 1}),
    );
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{v}"
    );
}

/// `/apply-template` renders with the model's template, and a template
/// given at start (`--chat-template-file`) replaces it for every request.
#[test]
fn apply_template_props_and_a_replaced_template() {
    let msgs = json!({"messages": [{"role": "user", "content": "hello"}]});
    let srv = start(2, 8, 256);
    let (st, v) = post(srv.addr, "/apply-template", &msgs);
    assert_eq!(st, 200, "{v}");
    let own = v["prompt"].as_str().unwrap().to_string();
    assert!(own.contains("<|im_start|>user\nhello<|im_end|>"), "{own}");
    let (st, v) = post(srv.addr, "/apply-template", &json!({"messages": []}));
    assert_eq!(st, 400, "{v}");
    drop(srv);

    let t = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}";
    let srv = start_template(2, 8, 256, 4096, Some(t.into()));
    let (st, v) = post(srv.addr, "/apply-template", &msgs);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["prompt"], "[user:hello]>");
    let (st, _, b) = request(srv.addr, "GET", "/props", b"");
    assert_eq!(st, 200);
    let props: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(props["chat_template"], t);
    assert_eq!(props["total_slots"], 2);
    assert_eq!(props["default_generation_settings"]["n_ctx"], 256);
    // The chat endpoint prefills that prompt: its token count is the same.
    let (_, tok) = post(srv.addr, "/tokenize", &json!({"content": "[user:hello]>"}));
    let n = tok["tokens"].as_array().unwrap().len();
    let (st, v) = post(
        srv.addr,
        "/v1/chat/completions",
        &chat_body("hello", json!({"max_tokens": 1})),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, n);
}

/// llama-server's native `/completion`: its fields in, its shape out, the
/// same text as the completions API for the same settings.
#[test]
fn native_completion_endpoint() {
    let srv = start(2, 8, 256);
    let oa =
        json!({"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (st, v) = post(srv.addr, "/v1/completions", &oa);
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();

    let native =
        json!({"prompt": "Hello there", "n_predict": 6, "temperature": 0, "ignore_eos": true});
    let (st, v) = post(srv.addr, "/completion", &native);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["content"], text);
    assert_eq!(v["stop"], true);
    assert_eq!(v["stop_type"], "limit");
    assert_eq!(v["tokens_predicted"], 6);
    assert_eq!(
        v["tokens_evaluated"],
        v["timings"]["prompt_n"].as_u64().unwrap() + v["tokens_cached"].as_u64().unwrap()
    );

    // Streamed: `content` chunks, the last with `stop`, no `[DONE]`.
    let mut streamed = native.clone();
    streamed["stream"] = json!(true);
    let (st, _, body) = request(
        srv.addr,
        "POST",
        "/completion",
        streamed.to_string().as_bytes(),
    );
    assert_eq!(st, 200);
    let body = String::from_utf8(body).unwrap();
    assert!(!body.contains("[DONE]"), "{body}");
    let chunks: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let got: String = chunks
        .iter()
        .map(|c| c["content"].as_str().unwrap())
        .collect();
    assert_eq!(got, text);
    let last = chunks.last().unwrap();
    assert_eq!(last["stop"], true);
    assert_eq!(last["tokens_predicted"], 6);
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c["stop"] == false)
    );

    // Without n_predict (or -1): up to the context, not the completions API's 16.
    let (st, v) = post(
        srv.addr,
        "/completion",
        &json!({"prompt": "Hi", "n_predict": -1, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(st, 200, "{v}");
    let n = v["tokens_predicted"].as_u64().unwrap() + v["tokens_evaluated"].as_u64().unwrap();
    assert_eq!(n, 256, "{v}");
    assert_eq!(v["stop_type"], "limit");

    // Bad fields are 400s in the error shape.
    let (st, v) = post(
        srv.addr,
        "/completion",
        &json!({"prompt": "x", "n_predict": "many"}),
    );
    assert_eq!(st, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("n_predict"),
        "{v}"
    );
    let (st, _) = post(srv.addr, "/completion", &json!({"prompt": ["a", "b"]}));
    assert_eq!(st, 400);
}
