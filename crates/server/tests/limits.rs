//! The server's limits end to end on loopback, against a tiny synthetic
//! model: half-closed clients, clients gone during a non-streamed prefill,
//! the keep-alive, head and body timeouts, the connection cap (eviction of
//! idle connections, the 503 past it, `/health` still answering), the body
//! limit, the generated-token cap, the KV budget (a request waits for
//! memory and is unchanged; one over the whole budget is refused), the
//! request deadline, and the drain on shutdown.

use samesum_engine::sched::context_bytes;
use samesum_engine::{KvType, Model};
use samesum_gguf::GgmlType;
use samesum_server::{CpuBackend, KvBudget, Limits, Options};
use samesum_synth::{SynthOptions, shapes, write_model};
use serde_json::{Value, json};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

struct Server {
    addr: SocketAddr,
    dir: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Start the drain and wait until `serve` returns; how long that took.
    fn shut_down(&mut self) -> Duration {
        let t = Instant::now();
        let _ = self.stop.take().unwrap().send(());
        self.thread.take().unwrap().join().unwrap();
        t.elapsed()
    }

    fn metric(&self, name: &str) -> u64 {
        self.try_metric(name)
            .unwrap_or_else(|| panic!("no /metrics answer"))
    }

    /// `None` when `/metrics` did not answer 200 (past the connection cap).
    fn try_metric(&self, name: &str) -> Option<u64> {
        let (st, _, b) = request(self.addr, "GET", "/metrics", b"");
        if st != 200 {
            return None;
        }
        let v = String::from_utf8(b)
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} not in /metrics"))
            .parse()
            .unwrap();
        Some(v)
    }

    /// Wait until `name` is 0 (a reservation given back after its
    /// response was sent).
    fn wait_zero(&self, name: &str, within: Duration) {
        let t = Instant::now();
        while self.try_metric(name).is_none_or(|v| v > 0) {
            assert!(t.elapsed() < within, "{name} stayed above 0 for {within:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn wait_metric(&self, name: &str, at_least: u64, within: Duration) {
        let t = Instant::now();
        while self.try_metric(name).is_none_or(|v| v < at_least) {
            assert!(
                t.elapsed() < within,
                "{name} stayed below {at_least} for {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
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

fn start(limits: Limits, max_batch: usize, ctx: usize) -> Server {
    start_with(limits, max_batch, ctx, |_| KvBudget::default())
}

/// [`start`] with the KV budget `budget` gives for the model.
fn start_with(
    limits: Limits,
    max_batch: usize,
    ctx: usize,
    budget: impl FnOnce(&Model) -> KvBudget,
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
    let kv_budget = budget(&model);
    let opts = Options {
        host: "127.0.0.1".into(),
        port: 0,
        backend: std::sync::Arc::new(CpuBackend(2)),
        max_batch,
        max_queue: 8,
        max_body: 1 << 20,
        ctx,
        prefill_chunk: 16,
        kv: KvType::F32,
        prefix_cache_mb: samesum_server::DEFAULT_PREFIX_CACHE_MB,
        kv_budget,
        model_name: "tiny".into(),
        limits,
        reasoning_format: samesum_server::api::ReasoningFormat::Deepseek,
        chat_template: None,
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
        dir,
        stop: Some(stop_tx),
        thread: Some(thread),
    }
}

/// Send `head` + `body` on a new connection.
fn send(addr: SocketAddr, method: &str, path: &str, body: &[u8], close: bool) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}\r\n",
        body.len(),
        if close { "Connection: close\r\n" } else { "" }
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s
}

/// Read a whole response up to the end of the stream: (status, head, body
/// with the chunked coding removed).
fn read_all(s: &mut TcpStream) -> (u16, String, Vec<u8>) {
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse(&raw)
}

fn parse(raw: &[u8]) -> (u16, String, Vec<u8>) {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut rest = raw[split + 4..].to_vec();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = Vec::new();
        while let Some(line_end) = rest.windows(2).position(|w| w == b"\r\n") {
            let n =
                usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap().trim(), 16)
                    .unwrap();
            if n == 0 || rest.len() < line_end + 2 + n {
                break;
            }
            out.extend_from_slice(&rest[line_end + 2..line_end + 2 + n]);
            rest.drain(..line_end + 2 + n + 2);
        }
        rest = out;
    }
    (status, head, rest)
}

/// Read one response with a `Content-Length` from a kept-alive connection.
fn read_one(s: &mut TcpStream) -> (u16, String, Vec<u8>) {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            if raw.len() >= split + 4 + len {
                return parse(&raw[..split + 4 + len]);
            }
        }
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the connection closed mid-response");
        raw.extend_from_slice(&buf[..n]);
    }
}

fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
    read_all(&mut send(addr, method, path, body, true))
}

fn post(addr: SocketAddr, path: &str, v: &Value) -> (u16, Value) {
    let (st, _, b) = request(addr, "POST", path, v.to_string().as_bytes());
    (
        st,
        serde_json::from_slice(&b)
            .unwrap_or_else(|_| panic!("not JSON: {:?}", String::from_utf8_lossy(&b))),
    )
}

/// The streamed text and the data lines of an SSE body.
fn sse(body: &[u8]) -> (String, Vec<String>) {
    let text = String::from_utf8(body.to_vec()).unwrap();
    let datas: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect();
    let mut out = String::new();
    for d in &datas {
        if let Ok(v) = serde_json::from_str::<Value>(d)
            && let Some(t) = v["choices"][0]["text"].as_str()
        {
            out.push_str(t);
        }
    }
    (out, datas)
}

/// Whether the server closed `s` within `within` (reads return the end of
/// the stream or a reset).
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Duration> {
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = [0u8; 1024];
    while t.elapsed() < within {
        match s.read(&mut buf) {
            Ok(0) => return Some(t.elapsed()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return Some(t.elapsed()),
        }
    }
    None
}

#[test]
fn a_half_closed_client_gets_its_response() {
    let s = start(Limits::default(), 2, 512);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    let (st, alone) = post(s.addr, "/v1/completions", &body);
    assert_eq!(st, 200, "{alone}");
    // Non-streamed: the request, then shutdown(SHUT_WR), then the response.
    let mut c = send(
        s.addr,
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
        false,
    );
    c.shutdown(Shutdown::Write).unwrap();
    let (st, _, b) = read_all(&mut c);
    assert_eq!(st, 200);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["choices"][0]["text"], alone["choices"][0]["text"], "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 40);
    // Streamed: every token, then [DONE].
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let mut c = send(
        s.addr,
        "POST",
        "/v1/completions",
        sb.to_string().as_bytes(),
        false,
    );
    c.shutdown(Shutdown::Write).unwrap();
    let (st, _, b) = read_all(&mut c);
    assert_eq!(st, 200);
    let (text, datas) = sse(&b);
    assert_eq!(datas.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(text, alone["choices"][0]["text"].as_str().unwrap());
    assert_eq!(s.metric("samesum_requests_cancelled_total"), 0);
}

#[test]
fn a_client_gone_during_a_non_streamed_prefill_is_cancelled() {
    let s = start(Limits::default(), 2, 16384);
    let prompt = "alpha beta gamma delta ".repeat(400);
    let body = json!({"prompt": prompt, "max_tokens": 4}).to_string();
    let c = send(s.addr, "POST", "/v1/completions", body.as_bytes(), false);
    // Until the prefill has started.
    s.wait_metric("samesum_prompt_tokens_total", 1, Duration::from_secs(30));
    drop(c);
    s.wait_metric(
        "samesum_requests_cancelled_total",
        1,
        Duration::from_secs(20),
    );
    let model = Model::load(s.dir.path().join("m.gguf")).unwrap();
    let tok = samesum_engine::tokenizer::Tokenizer::from_metadata(model.file.metadata()).unwrap();
    let total = tok.encode(&prompt).unwrap().len() as u64;
    let fed = s.metric("samesum_prompt_tokens_total");
    eprintln!("cancelled after {fed} of {total} prompt tokens");
    assert!(
        fed + 500 < total,
        "{fed} of {total} prompt tokens prefilled"
    );
    assert_eq!(s.metric("samesum_completion_tokens_total"), 0);
}

#[test]
fn idle_connections_slow_heads_and_slow_bodies_are_cut_off() {
    let limits = Limits {
        timeout: Duration::from_millis(1000),
        keep_alive: Duration::from_millis(400),
        ..Limits::default()
    };
    let s = start(limits, 2, 512);
    // A connection that sends nothing: closed after the keep-alive timeout.
    let mut idle = TcpStream::connect(s.addr).unwrap();
    let t = closed_within(&mut idle, Duration::from_secs(5)).expect("an idle socket stayed open");
    assert!(t >= Duration::from_millis(300), "closed after {t:?}");
    // One kept alive after a request: the same.
    let mut ka = send(s.addr, "GET", "/health", b"", false);
    let (st, _, _) = read_one(&mut ka);
    assert_eq!(st, 200);
    let t =
        closed_within(&mut ka, Duration::from_secs(5)).expect("a kept-alive socket stayed open");
    assert!(t >= Duration::from_millis(300), "closed after {t:?}");
    // A head sent a byte at a time, each in time for the keep-alive timeout
    // but the whole slower than the read timeout: cut off.
    let mut slow = TcpStream::connect(s.addr).unwrap();
    let t = Instant::now();
    let head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut cut = None;
    for &b in head.iter() {
        if slow.write_all(&[b]).is_err() {
            cut = Some(t.elapsed());
            break;
        }
        slow.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut buf = [0u8; 256];
        match slow.read(&mut buf) {
            Ok(0) => {
                cut = Some(t.elapsed());
                break;
            }
            Ok(n) => panic!(
                "an answer to a slow head: {:?}",
                String::from_utf8_lossy(&buf[..n])
            ),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => {
                cut = Some(t.elapsed());
                break;
            }
        }
    }
    let cut = cut.expect("a slow head was read to its end");
    assert!(
        cut >= Duration::from_millis(900) && cut < Duration::from_secs(3),
        "a slow head cut off after {cut:?}"
    );
    // A body slower than the read timeout: 408.
    let mut sb = TcpStream::connect(s.addr).unwrap();
    sb.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        .unwrap();
    let t = Instant::now();
    let (st, _, b) = read_all(&mut sb);
    assert_eq!(st, 408, "{}", String::from_utf8_lossy(&b));
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(s.metric("samesum_connections_timed_out_total") >= 3);
    // Still serving.
    assert_eq!(request(s.addr, "GET", "/health", b"").0, 200);
}

#[test]
fn the_connection_cap_evicts_idle_connections_then_answers_503() {
    let limits = Limits {
        max_connections: 2,
        ..Limits::default()
    };
    let s = start(limits, 4, 4096);
    // Two connections with no request in flight (each has sent the first
    // byte of a head: on Linux the kernel holds back connections that have
    // sent nothing) fill the cap; a third client is served, and the
    // connection idle the longest is closed for it.
    let mut first = TcpStream::connect(s.addr).unwrap();
    first.write_all(b"G").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let mut second = TcpStream::connect(s.addr).unwrap();
    second.write_all(b"G").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(request(s.addr, "GET", "/health", b"").0, 200);
    assert!(closed_within(&mut first, Duration::from_secs(2)).is_some());
    assert!(closed_within(&mut second, Duration::from_millis(200)).is_none());
    assert!(s.metric("samesum_connections_evicted_total") >= 1);
    drop(second);
    // Two connections with a request in flight: a third gets a 503 and
    // /health still answers.
    let long =
        json!({"prompt": "go", "max_tokens": 3000, "stream": true, "ignore_eos": true}).to_string();
    let mut streams = Vec::new();
    for _ in 0..2 {
        let mut c = send(s.addr, "POST", "/v1/completions", long.as_bytes(), false);
        let mut buf = [0u8; 256];
        assert!(c.read(&mut buf).unwrap() > 0);
        streams.push(c);
    }
    let (st, head, b) = request(
        s.addr,
        "POST",
        "/v1/completions",
        br#"{"prompt": "x", "max_tokens": 1}"#,
    );
    assert_eq!(st, 503, "{}", String::from_utf8_lossy(&b));
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 1"),
        "{head}"
    );
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["error"]["code"], "too_many_connections", "{v}");
    let t = Instant::now();
    assert_eq!(request(s.addr, "GET", "/health", b"").0, 200);
    assert!(t.elapsed() < Duration::from_secs(1));
    // The streams go: their requests are cancelled, and new clients served.
    drop(streams);
    s.wait_metric(
        "samesum_requests_cancelled_total",
        2,
        Duration::from_secs(20),
    );
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    );
    assert_eq!(st, 200, "{v}");
}

#[test]
fn a_declared_body_over_the_limit_is_a_413_before_it_is_read() {
    let s = start(Limits::default(), 2, 512);
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{")
        .unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (st, head, b) = read_all(&mut c);
    assert_eq!(st, 413, "{}", String::from_utf8_lossy(&b));
    assert!(head.to_ascii_lowercase().contains("connection: close"));
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-body"),
        "{v}"
    );
}

#[test]
fn generated_tokens_are_capped() {
    let limits = Limits {
        max_tokens_cap: 8,
        ..Limits::default()
    };
    let s = start(limits, 2, 512);
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 9}),
    );
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-tokens-cap")
    );
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "ignore_eos": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
}

/// With a KV budget of one and a half blocks, a second request waits
/// while a first runs (the metrics see it waiting for memory), then runs;
/// both answer what they answer alone, and a request whose context needs
/// two blocks is refused at once with a 400 naming the budget.
#[test]
fn a_request_waits_for_kv_memory_and_one_over_the_budget_is_refused() {
    let mut budget = 0;
    let s = start_with(Limits::default(), 4, 512, |m| {
        // A context of one token: one KV block and the recurrent states.
        budget = context_bytes(&m.hp, KvType::F32, 1) * 3 / 2;
        KvBudget::Bytes(budget)
    });
    assert_eq!(s.metric("samesum_kv_budget_bytes"), budget);
    let long = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": true});
    let short =
        json!({"prompt": "x", "max_tokens": 20, "temperature": 0.9, "seed": 3, "ignore_eos": true});
    let (st, long_alone) = post(s.addr, "/v1/completions", &long);
    assert_eq!(st, 200, "{long_alone}");
    s.wait_zero("samesum_kv_reserved_bytes", Duration::from_secs(10));
    let (st, short_alone) = post(s.addr, "/v1/completions", &short);
    assert_eq!(st, 200, "{short_alone}");
    // The model thread gives a reservation back just after the response:
    // wait for it, so the streamed request below finds the budget free.
    s.wait_zero("samesum_kv_reserved_bytes", Duration::from_secs(10));
    assert_eq!(s.metric("samesum_kv_memory_waits_total"), 0);
    // The long one streams; once its first token is out, the short one is
    // sent and waits for memory.
    let mut streamed = json!({"stream": true});
    for (k, v) in long.as_object().unwrap() {
        streamed[k] = v.clone();
    }
    let mut a = send(
        s.addr,
        "POST",
        "/v1/completions",
        streamed.to_string().as_bytes(),
        true,
    );
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !raw.windows(6).any(|w| w == b"data: ") {
        let n = a.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its first token");
        raw.extend_from_slice(&buf[..n]);
    }
    let addr = s.addr;
    let b = std::thread::spawn(move || post(addr, "/v1/completions", &short));
    s.wait_metric(
        "samesum_requests_waiting_memory",
        1,
        Duration::from_secs(60),
    );
    a.read_to_end(&mut raw).unwrap();
    let (st, _, body) = parse(&raw);
    assert_eq!(st, 200);
    let (text, datas) = sse(&body);
    assert_eq!(datas.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(text, long_alone["choices"][0]["text"].as_str().unwrap());
    let (st, v) = b.join().unwrap();
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], short_alone["choices"][0]["text"]);
    assert_eq!(v["usage"]["completion_tokens"], 20, "{v}");
    assert_eq!(s.metric("samesum_kv_memory_waits_total"), 1);
    assert_eq!(s.metric("samesum_requests_waiting_memory"), 0);
    // The reservation comes back just after the response (as above).
    s.wait_zero("samesum_kv_reserved_bytes", Duration::from_secs(10));
    // 1 + 300 + 1 tokens: two blocks, over the whole budget.
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 300}),
    );
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "kv_budget_exceeded", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("whole KV budget")
            && msg.contains(&budget.to_string())
            && msg.contains("max_tokens"),
        "{msg}"
    );
    assert_eq!(s.metric("samesum_kv_memory_waits_total"), 1);
}

#[test]
fn the_request_deadline_ends_generation_with_length_and_a_long_prefill_with_503() {
    let limits = Limits {
        request_timeout: Duration::from_millis(1500),
        ..Limits::default()
    };
    let s = start(limits, 2, 32768);
    // Generating: ends at the deadline with what it has, as "length".
    let t = Instant::now();
    let (st, v) = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "go", "max_tokens": 20000, "ignore_eos": true}),
    );
    let took = t.elapsed();
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n > 0 && n < 20000, "{n} tokens");
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(10),
        "{took:?}"
    );
    // Streaming: the same, with [DONE].
    let (st, _, b) = request(
        s.addr,
        "POST",
        "/v1/completions",
        json!({"prompt": "go", "max_tokens": 20000, "ignore_eos": true, "stream": true})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(st, 200);
    let (_, datas) = sse(&b);
    assert_eq!(datas.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&datas[datas.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
    // Still prefilling at the deadline (about 19,000 prompt tokens, 16 rows
    // a step): a 503 naming the timeout, its slot freed.
    let prompt = "alpha beta gamma delta ".repeat(1200);
    let t = Instant::now();
    let (st, head, b) = request(
        s.addr,
        "POST",
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 4})
            .to_string()
            .as_bytes(),
    );
    let took = t.elapsed();
    assert_eq!(st, 503, "{}", String::from_utf8_lossy(&b));
    assert!(head.to_ascii_lowercase().contains("retry-after"), "{head}");
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["error"]["code"], "request_timeout", "{v}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert_eq!(s.metric("samesum_requests_timed_out_total"), 3);
    // Its slot is freed (the gauge follows the event by a moment).
    let t = Instant::now();
    while s.metric("samesum_requests_running") != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the slot stayed taken"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn shutdown_lets_running_requests_finish_and_refuses_new_clients() {
    let limits = Limits {
        drain_timeout: Duration::from_secs(30),
        ..Limits::default()
    };
    let mut s = start(limits, 2, 4096);
    let body = json!({"prompt": "go", "max_tokens": 300, "stream": true, "ignore_eos": true, "temperature": 0})
        .to_string();
    let mut c = send(s.addr, "POST", "/v1/completions", body.as_bytes(), false);
    let mut first = [0u8; 64];
    assert!(c.read(&mut first).unwrap() > 0);
    let idle = TcpStream::connect(s.addr).unwrap();
    let addr = s.addr;
    let reader = std::thread::spawn(move || {
        let mut raw = first.to_vec();
        let _ = c.read_to_end(&mut raw);
        raw
    });
    let took = s.shut_down();
    let raw = reader.join().unwrap();
    let (st, _, b) = parse(&raw);
    assert_eq!(st, 200);
    let (_, datas) = sse(&b);
    assert_eq!(
        datas.last().map(String::as_str),
        Some("[DONE]"),
        "the stream was cut"
    );
    let last: Value = serde_json::from_str(&datas[datas.len() - 2]).unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 300, "{last}");
    assert!(took < Duration::from_secs(30), "{took:?}");
    drop(idle);
    assert!(
        TcpStream::connect(addr).is_err(),
        "a new connection was accepted after the drain"
    );
}

#[test]
fn the_drain_timeout_cancels_what_is_left() {
    let limits = Limits {
        drain_timeout: Duration::from_millis(500),
        ..Limits::default()
    };
    let mut s = start(limits, 2, 8192);
    let body =
        json!({"prompt": "go", "max_tokens": 8000, "stream": true, "ignore_eos": true}).to_string();
    let mut c = send(s.addr, "POST", "/v1/completions", body.as_bytes(), false);
    let mut first = [0u8; 64];
    assert!(c.read(&mut first).unwrap() > 0);
    let reader = std::thread::spawn(move || {
        let mut raw = first.to_vec();
        let _ = c.read_to_end(&mut raw);
        raw
    });
    let took = s.shut_down();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(5),
        "serve returned after {took:?}"
    );
    let raw = reader.join().unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(!text.contains("[DONE]"), "the long stream was not cut");
}
