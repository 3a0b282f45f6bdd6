//! `samesum bench-serve`: a bounded loopback load generator for an
//! OpenAI-compatible server (`samesum serve`, or llama.cpp's `llama-server`
//! for a side-by-side figure).
//!
//! `--clients` concurrent streams send `--requests` streaming completions
//! (`/v1/completions`, a prompt of `--prompt-tokens` tokens, `--max-tokens`
//! generated with `ignore_eos`, temperature 0) over plain
//! HTTP/1.1, one connection a request. The generator is deliberately light
//! (one thread, raw sockets, no JSON parsing but for the final usage), so
//! on a small machine it leaves the cores to the server. It prints the
//! aggregate generated tokens per second (over the wall time), the
//! per-stream rate, the time to first token (p50, p99), and the decode rate
//! of the whole load: the tokens after each stream's first over the time
//! some stream was generating (prefill waits left out, as in
//! llama-batched-bench's S_TG).
//!
//! The prompts are token ids (as llama-batched-bench's are): filler text,
//! different per request from its first tokens on, tokenized once by the
//! server's `/tokenize` (llama.cpp's endpoint) and cut to exactly
//! `--prompt-tokens`. A server without `/tokenize` gets the filler text, one
//! word a token or more, and the table says the length is approximate.

use anyhow::{Context, Result, bail};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Arguments of `samesum bench-serve`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The server's base URL (http://HOST:PORT), e.g. of `samesum serve --port 8080`.
    #[arg(long)]
    url: String,
    /// Concurrent streams (1 to 1024).
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Requests in all (default: 4 per client).
    #[arg(long)]
    requests: Option<usize>,
    /// Prompt length in tokens (exact where the server has `/tokenize`).
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Tokens generated per request (1 to 65,536; `ignore_eos`).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// The `model` field sent.
    #[arg(long, default_value = "samesum")]
    model: String,
    /// An API key sent as `Authorization: Bearer KEY` (for a server started
    /// with `--api-key`; default: $SAMESUM_API_KEY if set).
    #[arg(long)]
    api_key: Option<String>,
    /// Seconds a request may take before the run fails.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

/// One request's timings.
struct Sample {
    /// When the request was sent.
    start: Instant,
    ttft: Duration,
    total: Duration,
    tokens: usize,
}

/// Seconds covered by the union of the intervals `(from, to)`: the time
/// during which at least one stream was generating.
fn covered(mut spans: Vec<(Instant, Instant)>) -> f64 {
    spans.sort_by_key(|s| s.0);
    let mut total = Duration::ZERO;
    let mut cur: Option<(Instant, Instant)> = None;
    for (a, b) in spans {
        match &mut cur {
            Some((_, e)) if a <= *e => *e = (*e).max(b),
            _ => {
                if let Some((s, e)) = cur {
                    total += e - s;
                }
                cur = Some((a, b));
            }
        }
    }
    if let Some((s, e)) = cur {
        total += e - s;
    }
    total.as_secs_f64()
}

/// `host:port` of an `http://host:port[/...]` URL.
fn authority(url: &str) -> Result<String> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("--url {url:?}: only http:// URLs are supported"))?;
    let auth = rest.split('/').next().unwrap_or("");
    if auth.is_empty() || !auth.contains(':') {
        bail!("--url {url:?}: give the host and port, e.g. http://127.0.0.1:8080");
    }
    Ok(auth.to_string())
}

/// About `n` tokens of filler words, different per request.
fn prompt_text(n: usize, i: usize) -> String {
    const WORDS: [&str; 16] = [
        "the", "river", "stone", "quiet", "morning", "light", "over", "green", "hills", "and", "a",
        "small", "town", "wakes", "slowly", "today",
    ];
    let mut s = format!("Request {i}:");
    for k in 0..n.saturating_sub(3) {
        s.push(' ');
        s.push_str(WORDS[(k * 7 + i) % WORDS.len()]);
    }
    s
}

/// POST `body` to `path` and return the response's body, failing on a
/// status other than 200.
async fn post(auth: &str, key: &str, path: &str, body: &str) -> Result<String> {
    let mut s = TcpStream::connect(auth)
        .await
        .with_context(|| format!("connecting to {auth}"))?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {auth}\r\nContent-Type: application/json\r\n{key}Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    (&mut s).take(256 << 20).read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{path}: no HTTP response"))?;
    let status = head.lines().next().unwrap_or("");
    if !status.contains(" 200") {
        bail!("{path}: the server answered {status}");
    }
    Ok(rest.to_string())
}

/// The prompts: `n` token ids each, request `i`'s from filler text that
/// differs from its first word, cut from the server's tokenization of that
/// text. `None` where the server cannot tokenize.
async fn token_prompts(auth: &str, key: &str, n: usize, requests: usize) -> Option<Vec<Vec<u64>>> {
    let mut out = Vec::with_capacity(requests);
    for i in 0..requests {
        // One word is one token or more, so `words` words give `n` tokens
        // at least; the loop doubles them where a tokenizer merges words.
        let mut words = n + 3;
        loop {
            let body = serde_json::json!({"content": prompt_text(words, i)}).to_string();
            let r = post(auth, key, "/tokenize", &body).await.ok()?;
            let v: serde_json::Value = serde_json::from_str(&r).ok()?;
            let ids: Vec<u64> = v["tokens"]
                .as_array()?
                .iter()
                .map(|t| t.as_u64())
                .collect::<Option<_>>()?;
            if ids.len() >= n {
                out.push(ids[..n].to_vec());
                break;
            }
            if words > 8 * (n + 3) {
                return None;
            }
            words *= 2;
        }
    }
    Some(out)
}

/// One streaming completion: time to the first data event, to the end, and
/// the generated tokens (the final usage, else the data events counted).
async fn one(auth: &str, key: &str, body: &str, timeout: Duration) -> Result<Sample> {
    let t0 = Instant::now();
    let work = async {
        let mut s = TcpStream::connect(auth)
            .await
            .with_context(|| format!("connecting to {auth}"))?;
        s.set_nodelay(true)?;
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {auth}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{key}Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await?;
        let (mut ttft, mut events, mut usage) = (None, 0usize, None);
        let mut buf = Vec::with_capacity(1 << 14);
        let mut chunk = [0u8; 8192];
        let mut scanned = 0;
        let mut status_checked = false;
        loop {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            if !status_checked && buf.len() >= 12 {
                let status = String::from_utf8_lossy(&buf[..12]).to_string();
                if !status.starts_with("HTTP/1.1 200") && !status.starts_with("HTTP/1.0 200") {
                    let text = String::from_utf8_lossy(&buf).to_string();
                    bail!("the server answered {}", text.lines().next().unwrap_or(""));
                }
                status_checked = true;
            }
            // Complete lines since the last scan.
            while let Some(nl) = buf[scanned..].iter().position(|&b| b == b'\n') {
                let line = &buf[scanned..scanned + nl];
                scanned += nl + 1;
                if let Some(data) = line.strip_prefix(b"data: ") {
                    if data.starts_with(b"[DONE]") {
                        continue;
                    }
                    events += 1;
                    ttft.get_or_insert_with(|| t0.elapsed());
                    if let Some(at) = find(data, b"\"completion_tokens\":") {
                        let digits: String = data[at + 20..]
                            .iter()
                            .skip_while(|b| **b == b' ')
                            .take_while(|b| b.is_ascii_digit())
                            .map(|&b| b as char)
                            .collect();
                        usage = digits.parse::<usize>().ok();
                    }
                }
            }
            if buf.len() > 64 << 20 {
                bail!("a response over 64 MiB");
            }
        }
        let ttft = ttft.context("the stream ended without a data event")?;
        Ok(Sample {
            start: t0,
            ttft,
            total: t0.elapsed(),
            tokens: usage.unwrap_or(events),
        })
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| anyhow::anyhow!("a request took over {} s", timeout.as_secs()))?
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    sorted[((q * sorted.len() as f64) as usize).min(sorted.len() - 1)]
}

pub(crate) fn run(a: Args) -> Result<()> {
    if !(1..=1024).contains(&a.clients) {
        bail!("--clients {} must be in 1..=1024", a.clients);
    }
    if !(1..=65_536).contains(&a.max_tokens) {
        bail!("--max-tokens {} must be in 1..=65536", a.max_tokens);
    }
    if a.prompt_tokens > 1 << 20 {
        bail!("--prompt-tokens {} is above 2^20", a.prompt_tokens);
    }
    let requests = a.requests.unwrap_or(4 * a.clients);
    if !(1..=1_000_000).contains(&requests) {
        bail!("--requests {requests} must be in 1..=1000000");
    }
    let auth = authority(&a.url)?;
    // The header line sent with every request (empty: none).
    let key = match a
        .api_key
        .clone()
        .or_else(|| std::env::var("SAMESUM_API_KEY").ok())
    {
        Some(k) if k.chars().any(char::is_control) => bail!("--api-key: control characters"),
        Some(k) => std::sync::Arc::new(format!("Authorization: Bearer {k}\r\n")),
        None => std::sync::Arc::new(String::new()),
    };
    let timeout = Duration::from_secs(a.timeout.max(1));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let ids = if a.prompt_tokens == 0 {
        None
    } else {
        rt.block_on(token_prompts(&auth, &key, a.prompt_tokens, requests))
    };
    if ids.is_none() && a.prompt_tokens > 0 {
        eprintln!(
            "the server did not tokenize the prompts (/tokenize): sending text, about one token a word"
        );
    }
    let bodies: Vec<String> = (0..requests)
        .map(|i| {
            let prompt = match &ids {
                Some(ids) => serde_json::json!(ids[i]),
                None => serde_json::json!(prompt_text(a.prompt_tokens, i)),
            };
            serde_json::json!({
                "model": a.model,
                "prompt": prompt,
                "max_tokens": a.max_tokens,
                "temperature": 0,
                "ignore_eos": true,
                "stream": true,
                "stream_options": {"include_usage": true},
            })
            .to_string()
        })
        .collect();
    let bodies = std::sync::Arc::new(bodies);
    let auth: std::sync::Arc<str> = auth.into();
    let (samples, wall) = rt.block_on(async {
        let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..a.clients {
            let (next, bodies, auth, key) =
                (next.clone(), bodies.clone(), auth.clone(), key.clone());
            set.spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= bodies.len() {
                        return Ok::<_, anyhow::Error>(mine);
                    }
                    mine.push(one(&auth, &key, &bodies[i], timeout).await?);
                }
            });
        }
        let mut all = Vec::new();
        while let Some(r) = set.join_next().await {
            all.extend(r.context("a client task failed")??);
        }
        Ok::<_, anyhow::Error>((all, t0.elapsed()))
    })?;
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    ttft.sort_by(f64::total_cmp);
    let mut per: Vec<f64> = samples
        .iter()
        .filter(|s| s.tokens > 1 && s.total > s.ttft)
        .map(|s| (s.tokens - 1) as f64 / (s.total - s.ttft).as_secs_f64())
        .collect();
    per.sort_by(f64::total_cmp);
    // Tokens after each stream's first, over the time some stream was
    // generating: the decode rate of the whole load, prefill waits left
    // out (llama-batched-bench's S_TG counts its generation phase alone).
    let later: usize = samples.iter().map(|s| s.tokens.saturating_sub(1)).sum();
    let span = covered(
        samples
            .iter()
            .map(|s| (s.start + s.ttft, s.start + s.total))
            .collect(),
    );
    let decode = if span > 0.0 { later as f64 / span } else { 0.0 };
    println!(
        "| clients | requests | prompt tokens | max tokens | generated | generated tok/s | per-stream tok/s (p50) | TTFT p50 (ms) | TTFT p99 (ms) | wall (s) | decode tok/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {} | {}{} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} | {:.1} |",
        a.clients,
        requests,
        if ids.is_some() { "" } else { "~" },
        a.prompt_tokens,
        a.max_tokens,
        tokens,
        tokens as f64 / wall.as_secs_f64(),
        if per.is_empty() { 0.0 } else { pct(&per, 0.5) },
        pct(&ttft, 0.5),
        pct(&ttft, 0.99),
        wall.as_secs_f64(),
        decode
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_need_host_and_port() {
        assert_eq!(
            authority("http://127.0.0.1:8080").unwrap(),
            "127.0.0.1:8080"
        );
        assert_eq!(authority("http://localhost:9/v1").unwrap(), "localhost:9");
        assert!(authority("https://x:1").is_err());
        assert!(authority("http://localhost").is_err());
    }

    #[test]
    fn covered_time_is_the_union_of_the_spans() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        // [0, 10] and [5, 20] overlap, [30, 40] stands apart, [32, 35]
        // lies inside it: 20 + 10 ms.
        let spans = vec![
            (at(30), at(40)),
            (at(5), at(20)),
            (at(0), at(10)),
            (at(32), at(35)),
        ];
        assert!((covered(spans) - 0.030).abs() < 1e-9);
        assert_eq!(covered(Vec::new()), 0.0);
    }

    #[test]
    fn prompts_have_about_the_asked_words() {
        let p = prompt_text(64, 3);
        assert_eq!(p.split_whitespace().count(), 2 + 61);
        assert_ne!(p, prompt_text(64, 4));
    }
}
