//! A load test on loopback: 256 streaming completions at once against the
//! tiny model, twice. Every stream ends with its tokens and one `[DONE]`,
//! none is lost or answered twice (each stream's events carry one id, unique
//! across streams), streams with the same prompt get the same text whatever
//! ran beside them, the scheduler's counters return to zero, and the second
//! wave leaves the process's memory where the first left it.

use samesum_engine::{KvType, Model};
use samesum_gguf::GgmlType;
use samesum_server::{Device, Options};
use samesum_synth::{SynthOptions, shapes, write_model};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Streams at once.
const STREAMS: usize = 256;
/// Distinct prompts among them.
const PROMPTS: usize = 32;
/// Tokens each stream generates.
const TOKENS: usize = 8;

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

fn start() -> Server {
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
        device: Device::Cpu(2),
        max_batch: 64,
        max_queue: 2 * STREAMS,
        max_body: 4096,
        ctx: 256,
        prefill_chunk: 64,
        kv: KvType::F32,
        prefix_cache_mb: samesum_server::DEFAULT_PREFIX_CACHE_MB,
        kv_budget: Default::default(),
        model_name: "tiny".into(),
        limits: Default::default(),
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
        _dir: dir,
        stop: Some(stop_tx),
        thread: Some(thread),
    }
}

/// One HTTP/1.1 exchange with `Connection: close`: the status and the body
/// (de-chunked).
fn exchange(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut rest = raw[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        let mut out = Vec::new();
        loop {
            let end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..end]).unwrap().trim(), 16)
                .unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[end + 2..end + 2 + n]);
            rest.drain(..end + 2 + n + 2);
        }
        rest = out;
    }
    (status, String::from_utf8_lossy(&rest).to_string())
}

/// What one stream delivered.
struct Stream {
    /// The completion id its events carried (all of them the same).
    id: String,
    text: String,
    /// Generated tokens by the final usage.
    tokens: u64,
}

/// A streamed completion of prompt `k`, checked for shape: events that
/// carry one id, a usage event, and exactly one `[DONE]` at the end.
fn stream(addr: SocketAddr, k: usize) -> Stream {
    let body = json!({
        "prompt": format!("Stream {k}: the river runs over the stones and on"),
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let (status, sse) = exchange(addr, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{sse}");
    let data: Vec<&str> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{sse}");
    assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1, "{sse}");
    let (mut ids, mut text, mut tokens) = (HashSet::new(), String::new(), None);
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        ids.insert(v["id"].as_str().unwrap().to_string());
        if let Some(t) = v["choices"][0]["text"].as_str() {
            text += t;
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            assert!(tokens.is_none(), "two usage events: {sse}");
            tokens = Some(n);
        }
    }
    assert_eq!(ids.len(), 1, "a stream's events carry several ids: {sse}");
    Stream {
        id: ids.into_iter().next().unwrap(),
        text,
        tokens: tokens.expect("a usage event"),
    }
}

/// A counter or gauge from `/metrics` (its name without the prefix).
fn gauge(addr: SocketAddr, name: &str) -> u64 {
    let (status, m) = exchange(addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    m.lines()
        .find_map(|l| l.strip_prefix(&format!("samesum_{name} ")))
        .unwrap_or_else(|| panic!("no {name} in {m}"))
        .trim()
        .parse()
        .unwrap()
}

/// The process's resident memory in bytes (Linux; 0 elsewhere).
fn resident() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// 256 streams at once, `PROMPTS` prompts among them: each stream's id and
/// text.
fn wave(addr: SocketAddr) -> Vec<(usize, Stream)> {
    let go = std::sync::Arc::new(std::sync::Barrier::new(STREAMS));
    let handles: Vec<_> = (0..STREAMS)
        .map(|i| {
            let go = go.clone();
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || {
                    go.wait();
                    (i % PROMPTS, stream(addr, i % PROMPTS))
                })
                .unwrap()
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn two_waves_of_256_streams_lose_nothing_and_leave_memory_flat() {
    let s = start();
    let mut after = Vec::new();
    let mut texts: BTreeMap<usize, String> = BTreeMap::new();
    let mut all_ids = HashSet::new();
    for round in 0..2 {
        let got = wave(s.addr);
        assert_eq!(got.len(), STREAMS);
        for (k, st) in &got {
            assert_eq!(st.tokens, TOKENS as u64, "round {round}: a short stream");
            assert!(
                all_ids.insert(st.id.clone()),
                "round {round}: id {} answered twice",
                st.id
            );
            // The same prompt gives the same text beside any neighbours.
            let want = texts.entry(*k).or_insert_with(|| st.text.clone());
            assert_eq!(&st.text, want, "round {round}: prompt {k} changed");
        }
        for g in [
            "queue_depth",
            "requests_running",
            "requests_waiting_memory",
            "prefill_pending_tokens",
            "kv_reserved_bytes",
        ] {
            assert_eq!(gauge(s.addr, g), 0, "round {round}: {g} left over");
        }
        let n = (round + 1) * STREAMS;
        assert_eq!(gauge(s.addr, "requests_total"), n as u64);
        assert_eq!(gauge(s.addr, "requests_finished_total"), n as u64);
        assert!(
            gauge(s.addr, "max_step_requests") > 1,
            "round {round}: the streams never shared a step"
        );
        after.push(resident());
    }
    assert_eq!(all_ids.len(), 2 * STREAMS);
    // Flat: the second wave, the same work again, grows the process by
    // less than 32 MiB (the first wave's peak is already in place).
    if after[0] > 0 {
        assert!(
            after[1] <= after[0] + (32 << 20),
            "resident memory grew from {} to {} MiB",
            after[0] >> 20,
            after[1] >> 20
        );
    }
}
