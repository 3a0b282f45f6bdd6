//! The prefix cache: a request restored from a saved state gives the bytes
//! (tokens and log-probabilities) of the same request cold, on every tiny
//! architecture, greedy and seeded; a follow-up whose prompt extends an
//! earlier prompt and reply reuses them; the metrics count it; a tiny budget
//! evicts and changes nothing; a restore one token off would be caught.
//! The model thread is driven directly (token prompts, token ids back), and
//! once over HTTP with a chat template's follow-up turn.

use samesum_engine::cpu::Cpu;
use samesum_engine::sample::{Penalties, SamplerConfig};
use samesum_engine::sched::prefix::entry_bytes;
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{KvType, Model};
use samesum_gguf::GgmlType;
use samesum_server::metrics::Metrics;
use samesum_server::scheduler::{self, Config, Event, Job, Usage};
use samesum_server::{CpuBackend, Options};
use samesum_synth::{SynthOptions, shapes, write_model};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SHAPES: [&str; 3] = ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"];

fn model(shape: &str) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    write_model(
        &SynthOptions::new(shapes::by_name(shape).unwrap(), GgmlType::Q8_0, 5),
        &p,
        &mut |_, _| {},
    )
    .unwrap();
    let m = Model::load(&p).unwrap();
    (dir, m)
}

/// A token's log-probability and its top alternatives, as bits.
type Lp = (u32, Vec<(String, u32)>);

/// What a request produced: token ids, each token's log-probability and
/// top alternatives as bits, the finish reason and the usage.
#[derive(Debug)]
struct Out {
    ids: Vec<u32>,
    lps: Vec<Lp>,
    finish: &'static str,
    usage: Usage,
}

impl Out {
    /// The bytes a restore must not change.
    fn bytes(&self) -> (&[u32], &[Lp], &str) {
        (&self.ids, &self.lps, self.finish)
    }
}

/// The model thread on the CPU, fed jobs one at a time.
struct Thread {
    tx: Option<std::sync::mpsc::SyncSender<Job>>,
    handle: Option<std::thread::JoinHandle<()>>,
    metrics: Arc<Metrics>,
    next: usize,
}

impl Thread {
    fn start(model: &Arc<Model>, tok: &Arc<Tokenizer>, chunk: usize, cache_bytes: u64) -> Thread {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(64);
        let metrics = Arc::new(Metrics::default());
        let (model, tok, m) = (model.clone(), tok.clone(), metrics.clone());
        let cfg = Config {
            max_batch: 4,
            prefill_chunk: chunk,
            kv: KvType::F32,
            prefix_cache_bytes: cache_bytes,
            kv_budget: None,
        };
        let handle = std::thread::spawn(move || {
            scheduler::run(&model, &tok, &Cpu::new(2), rx, &cfg, &m);
        });
        Thread {
            tx: Some(tx),
            handle: Some(handle),
            metrics,
            next: 0,
        }
    }

    /// Queue a request; its events arrive on the returned receiver.
    fn send(
        &mut self,
        prompt: &[u32],
        sampler: &SamplerConfig,
    ) -> tokio::sync::mpsc::UnboundedReceiver<Event> {
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        self.next += 1;
        let job = Job {
            id: format!("r{}", self.next),
            prompt: prompt.to_vec(),
            max_new: 6,
            sampler: sampler.clone(),
            penalties: Penalties::default(),
            logit_bias: Vec::new(),
            stop: Vec::new(),
            logprobs: Some(3),
            ignore_eos: true,
            constraint: None,
            echo: false,
            prompt_logprobs: None,
            events: etx,
            queued: Instant::now(),
            deadline: None,
        };
        self.tx.as_ref().unwrap().send(job).unwrap();
        erx
    }

    /// Run one request to its end.
    fn ask(&mut self, prompt: &[u32], sampler: &SamplerConfig) -> Out {
        let rx = self.send(prompt, sampler);
        collect(rx)
    }
}

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Out {
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    loop {
        match rx.blocking_recv().expect("the request ends with Done") {
            Event::Token { id, logprob, .. } => {
                if let Some(id) = id {
                    ids.push(id);
                    let l = logprob.expect("log-probabilities were asked for");
                    let top = l
                        .top
                        .iter()
                        .map(|(t, p)| (t.clone(), p.to_bits()))
                        .collect();
                    lps.push((l.logprob.to_bits(), top));
                }
            }
            Event::Done { finish, usage } => {
                return Out {
                    ids,
                    lps,
                    finish,
                    usage,
                };
            }
            e => panic!("request failed: {e:?}"),
        }
    }
}

impl Drop for Thread {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(h) = self.handle.take() {
            h.join().unwrap();
        }
    }
}

fn setup(shape: &str) -> (tempfile::TempDir, Arc<Model>, Arc<Tokenizer>) {
    let (dir, m) = model(shape);
    let tok = Tokenizer::from_metadata(m.file.metadata()).unwrap();
    (dir, Arc::new(m), Arc::new(tok))
}

fn samplers() -> [SamplerConfig; 2] {
    [
        SamplerConfig {
            temp: 0.0,
            ..Default::default()
        },
        SamplerConfig {
            temp: 0.9,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1234,
            ..Default::default()
        },
    ]
}

fn cat(parts: &[&[u32]]) -> Vec<u32> {
    parts.concat()
}

/// A first request, a follow-up extending its prompt and reply, and one
/// extending its prompt only: with the cache, the follow-ups restore the
/// state saved at the end of the first request and at the end of its
/// prompt, and every output equals the same request without the cache.
#[test]
fn a_request_restored_from_the_cache_equals_it_cold() {
    for shape in SHAPES {
        let (_dir, model, tok) = setup(shape);
        let p1 = tok
            .encode("The cache keeps what the model has read.")
            .unwrap();
        let more = tok.encode(" And then what happened?").unwrap();
        let other = tok.encode(" Something else entirely.").unwrap();
        for sampler in samplers() {
            let label = format!("{shape} temp {}", sampler.temp);
            // Prefill chunks of 5: the restore points fall inside chunks.
            let mut cold = Thread::start(&model, &tok, 5, 0);
            let mut warm = Thread::start(&model, &tok, 5, 64 << 20);
            let a_cold = cold.ask(&p1, &sampler);
            let a = warm.ask(&p1, &sampler);
            assert_eq!(a.bytes(), a_cold.bytes(), "{label}: first request");
            assert_eq!(a.usage.cached_tokens, 0);
            assert_eq!(a.ids.len(), 6, "{label}");
            // The follow-up turn: the prompt, the reply, new tokens.
            let p2 = cat(&[&p1, &a.ids, &more]);
            let b_cold = cold.ask(&p2, &sampler);
            let b = warm.ask(&p2, &sampler);
            assert_eq!(b.bytes(), b_cold.bytes(), "{label}: follow-up");
            // The last sampled token of the reply was never fed.
            assert_eq!(b.usage.cached_tokens, p1.len() + a.ids.len() - 1, "{label}");
            assert_eq!(b_cold.usage.cached_tokens, 0);
            // Another continuation of the first prompt: its end's state.
            let p3 = cat(&[&p1, &other]);
            let c_cold = cold.ask(&p3, &sampler);
            let c = warm.ask(&p3, &sampler);
            assert_eq!(c.bytes(), c_cold.bytes(), "{label}: other continuation");
            assert_eq!(c.usage.cached_tokens, p1.len(), "{label}");
            // The same prompt again: the longest saved state shorter than it.
            let b2 = warm.ask(&p2, &sampler);
            assert_eq!(b2.bytes(), b_cold.bytes(), "{label}: repeated follow-up");
            assert_eq!(b2.usage.cached_tokens, p1.len() + a.ids.len() - 1);
            let m = &warm.metrics;
            assert_eq!(m.prefix_cache_hits.get(), 3, "{label}");
            assert_eq!(m.prefix_cache_misses.get(), 1, "{label}");
            assert_eq!(
                m.prefix_cache_reused_tokens.get() as usize,
                2 * (p1.len() + 5) + p1.len(),
                "{label}"
            );
            // Prefilled: only what was not restored.
            let total = p1.len() + 2 * p2.len() + p3.len();
            assert_eq!(
                m.prompt_tokens.get() + m.prefix_cache_reused_tokens.get(),
                total as u64
            );
            assert_eq!(
                cold.metrics.prompt_tokens.get() as usize,
                p1.len() + p2.len() + p3.len()
            );
            assert_eq!(cold.metrics.prefix_cache_hits.get(), 0);
            assert_eq!(cold.metrics.prefix_cache_misses.get(), 0);
            assert_eq!(cold.metrics.prefix_cache_entries.get(), 0);
            let text = m.render();
            assert!(
                text.contains("samesum_prefix_cache_hits_total 3\n"),
                "{text}"
            );
            assert!(
                text.contains("samesum_prefix_cache_misses_total 1\n"),
                "{text}"
            );
        }
    }
}

/// A budget of about one and a half entries: entries are evicted, the
/// bytes held stay within the budget, a follow-up still finds the entry its
/// request just saved, and every output, one at a time or several at once,
/// equals the same request without the cache.
#[test]
fn eviction_under_a_tiny_budget_changes_no_output() {
    for shape in SHAPES {
        let (_dir, model, tok) = setup(shape);
        let sampler = &samplers()[1];
        let base = tok.encode("A shared opening line,").unwrap();
        let more = tok.encode(" Go on.").unwrap();
        let tails = [" one", " two two", " three three three", " four", " five!"];
        let prompts: Vec<Vec<u32>> = tails
            .iter()
            .map(|t| cat(&[&base, &tok.encode(t).unwrap()]))
            .collect();
        let budget = entry_bytes(&model.hp, KvType::F32, 200) * 3 / 2;
        let mut cold = Thread::start(&model, &tok, 7, 0);
        let mut warm = Thread::start(&model, &tok, 7, budget);
        let mut follow_ups = Vec::new();
        let mut want_follow = Vec::new();
        for p in &prompts {
            let want = cold.ask(p, sampler);
            let got = warm.ask(p, sampler);
            assert_eq!(got.bytes(), want.bytes(), "{shape}");
            let f = cat(&[p, &want.ids, &more]);
            let want_f = cold.ask(&f, sampler);
            let got_f = warm.ask(&f, sampler);
            assert_eq!(got_f.bytes(), want_f.bytes(), "{shape} follow-up");
            assert_eq!(got_f.usage.cached_tokens, p.len() + want.ids.len() - 1);
            let m = &warm.metrics;
            assert!(m.prefix_cache_bytes.get() <= budget, "{shape}");
            assert!(m.prefix_cache_entries.get() <= 1, "{shape}");
            follow_ups.push(f);
            want_follow.push(want_f);
        }
        let m = warm.metrics.clone();
        assert_eq!(m.prefix_cache_hits.get(), 5, "{shape}");
        assert!(m.prefix_cache_evictions.get() >= 9, "{shape}");
        // Several at once: whichever entries they find, the same bytes.
        let rxs: Vec<_> = follow_ups.iter().map(|p| warm.send(p, sampler)).collect();
        for (rx, w) in rxs.into_iter().zip(&want_follow) {
            assert_eq!(collect(rx).bytes(), w.bytes(), "{shape} concurrent");
        }
        assert!(m.prefix_cache_bytes.get() <= budget);
        assert!(m.prefix_cache_entries.get() <= 1, "{shape}");
    }
}

/// The negative control: a restore one token off (a state that consumed one
/// token fewer, or one more, than the prompt tokens it is counted for)
/// computes what a cold run of the prompt with that token dropped or
/// doubled computes; those outputs differ from the right ones, so the
/// comparisons above would catch such a restore.
#[test]
fn a_restore_one_token_off_would_change_the_output() {
    for shape in SHAPES {
        let (_dir, model, tok) = setup(shape);
        let p1 = tok
            .encode("The cache keeps what the model has read.")
            .unwrap();
        let more = tok.encode(" And then what happened?").unwrap();
        for sampler in samplers() {
            let mut cold = Thread::start(&model, &tok, 5, 0);
            let a = cold.ask(&p1, &sampler);
            let p2 = cat(&[&p1, &a.ids, &more]);
            let n = p1.len() + a.ids.len() - 1;
            let right = cold.ask(&p2, &sampler);
            let dropped = cat(&[&p2[..n - 1], &p2[n..]]);
            let doubled = cat(&[&p2[..n], &p2[n - 1..]]);
            for wrong in [dropped, doubled] {
                let got = cold.ask(&wrong, &sampler);
                assert_ne!(
                    got.lps, right.lps,
                    "{shape} temp {}: a restore one token off went unnoticed",
                    sampler.temp
                );
            }
        }
    }
}

// The same over HTTP, through the chat template.

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

fn start(prefix_cache_mb: u64) -> Server {
    let (dir, model) = model("tiny-qwen35moe");
    let opts = Options {
        host: "127.0.0.1".into(),
        port: 0,
        backend: std::sync::Arc::new(CpuBackend(2)),
        max_batch: 4,
        max_queue: 8,
        max_body: 1 << 16,
        ctx: 512,
        prefill_chunk: 16,
        kv: KvType::F32,
        prefix_cache_mb,
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

/// One request with `Connection: close` (no chunked bodies: the responses
/// here are not streamed): (status, body).
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a response head");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, rest.to_string())
}

fn chat(addr: SocketAddr, messages: &Value) -> Value {
    let body = json!({"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (st, b) = request(addr, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(st, 200, "{b}");
    serde_json::from_str(&b).unwrap()
}

/// A second chat turn (the first turn and its reply rendered again by the
/// template, then a new message) reuses the first turn's saved state:
/// `usage.prompt_tokens_details.cached_tokens` says how many tokens, the
/// metrics count the hit, and the reply equals a server's without the cache.
#[test]
fn a_follow_up_chat_turn_reuses_the_first_and_answers_the_same() {
    let on = start(64);
    let off = start(0);
    let turn1 = json!([{"role": "user", "content": "Tell me about caches."}]);
    let a = chat(on.addr, &turn1);
    let a_off = chat(off.addr, &turn1);
    assert_eq!(a["choices"], a_off["choices"]);
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = a["choices"][0]["message"]["content"].clone();
    let turn2 = json!([
        {"role": "user", "content": "Tell me about caches."},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And about prefixes?"},
    ]);
    let b = chat(on.addr, &turn2);
    let b_off = chat(off.addr, &turn2);
    assert_eq!(b["choices"], b_off["choices"], "the follow-up's reply");
    let first_prompt = a["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= first_prompt && cached < b["usage"]["prompt_tokens"].as_u64().unwrap(),
        "cached {cached} of the first prompt's {first_prompt}: {b}"
    );
    assert_eq!(b["timings"]["cache_n"], cached);
    assert_eq!(
        b["timings"]["prompt_n"].as_u64().unwrap(),
        b["usage"]["prompt_tokens"].as_u64().unwrap() - cached
    );
    assert_eq!(b_off["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, metrics) = request(on.addr, "GET", "/metrics", "");
    assert!(
        metrics.contains("samesum_prefix_cache_hits_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "samesum_prefix_cache_reused_tokens_total {cached}\n"
        )),
        "{metrics}"
    );
    let (_, metrics) = request(off.addr, "GET", "/metrics", "");
    assert!(
        metrics.contains("samesum_prefix_cache_hits_total 0\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("samesum_prefix_cache_entries 0\n"),
        "{metrics}"
    );
}
