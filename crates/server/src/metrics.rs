//! Server counters and their Prometheus text form (`GET /metrics`).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonically increasing count.
#[derive(Default, Debug)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Add `n`.
    pub fn inc(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// Set it to a count kept elsewhere (that only grows).
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
    /// The value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Default, Debug)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// Set it.
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
    /// Add one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    /// Take one away (never below 0).
    pub fn dec(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(1))
            });
    }
    /// The value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    /// Raise to `v` if higher.
    pub fn max(&self, v: u64) {
        self.0.fetch_max(v, Ordering::Relaxed);
    }
}

/// A sum of seconds.
#[derive(Default, Debug)]
pub struct Seconds(AtomicU64);

impl Seconds {
    /// Add `s` seconds.
    pub fn add(&self, s: f64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((f64::from_bits(b) + s).to_bits())
            });
    }
    /// Set it to a sum kept elsewhere (that only grows).
    pub fn set(&self, s: f64) {
        self.0.store(s.to_bits(), Ordering::Relaxed);
    }
    /// The sum.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Everything `/metrics` reports.
#[derive(Default, Debug)]
pub struct Metrics {
    /// Requests accepted into the queue.
    pub requests: Counter,
    /// Requests finished (stop or length).
    pub requests_done: Counter,
    /// Requests refused because the queue was full (503).
    pub rejected: Counter,
    /// Requests refused as malformed (4xx).
    pub bad_requests: Counter,
    /// Requests cancelled because the client went away.
    pub cancelled: Counter,
    /// Requests ended by their deadline (`--request-timeout`).
    pub timed_out: Counter,
    /// Connections accepted.
    pub connections: Counter,
    /// Connections open (under the cap).
    pub connections_open: Gauge,
    /// Idle connections closed to make room for new ones.
    pub connections_evicted: Counter,
    /// Connections closed by a timeout (idle, slow head, stuck write).
    pub connections_timed_out: Counter,
    /// Connections refused past the cap (a 503, or closed at once).
    pub connections_refused: Counter,
    /// Prompt tokens prefilled.
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub completion_tokens: Counter,
    /// Time in forward calls, attributed to prompt rows.
    pub prefill_seconds: Seconds,
    /// Time in forward calls, attributed to decode rows.
    pub decode_seconds: Seconds,
    /// Requests waiting in the queue.
    pub queue_depth: Gauge,
    /// Requests running on the model thread.
    pub running: Gauge,
    /// The most requests one forward call has carried.
    pub max_step_requests: Gauge,
    /// Prompt tokens of running requests not prefilled yet (prefill progress).
    pub prefill_pending: Gauge,
    /// Tier mode's decode cache: lookups that found the expert in VRAM.
    pub expert_cache_hits: Gauge,
    /// Tier mode's decode cache: lookups that copied the expert in.
    pub expert_cache_misses: Gauge,
    /// Requests that started from a prefix cache entry.
    pub prefix_cache_hits: Counter,
    /// Requests that found no prefix cache entry (counted when it is on).
    pub prefix_cache_misses: Counter,
    /// Prompt tokens restored from the prefix cache instead of prefilled.
    pub prefix_cache_reused_tokens: Counter,
    /// Prefix cache entries held.
    pub prefix_cache_entries: Gauge,
    /// Bytes the prefix cache's entries are counted at.
    pub prefix_cache_bytes: Gauge,
    /// Prefix cache entries evicted (a count the model thread keeps).
    pub prefix_cache_evictions: Gauge,
    /// The KV budget in bytes (0: no limit).
    pub kv_budget_bytes: Gauge,
    /// Bytes the running requests' contexts reserve against it.
    pub kv_reserved_bytes: Gauge,
    /// Requests held back because the next one's context does not fit.
    pub kv_waiting: Gauge,
    /// Requests that waited for KV memory at least once.
    pub kv_memory_waits: Counter,
}

impl Metrics {
    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(
                s,
                "# HELP samesum_{name} {help}\n# TYPE samesum_{name} {kind}\nsamesum_{name} {v}"
            );
        };
        put(
            "requests_total",
            "counter",
            "Requests accepted.",
            self.requests.get().to_string(),
        );
        put(
            "requests_finished_total",
            "counter",
            "Requests finished.",
            self.requests_done.get().to_string(),
        );
        put(
            "requests_rejected_total",
            "counter",
            "Requests refused with 503 (queue full).",
            self.rejected.get().to_string(),
        );
        put(
            "requests_invalid_total",
            "counter",
            "Requests refused as invalid (4xx).",
            self.bad_requests.get().to_string(),
        );
        put(
            "requests_cancelled_total",
            "counter",
            "Requests cancelled by a client disconnect.",
            self.cancelled.get().to_string(),
        );
        put(
            "requests_timed_out_total",
            "counter",
            "Requests ended by their deadline (--request-timeout).",
            self.timed_out.get().to_string(),
        );
        put(
            "connections_total",
            "counter",
            "Connections accepted.",
            self.connections.get().to_string(),
        );
        put(
            "connections_open",
            "gauge",
            "Connections open under the cap (--max-connections).",
            self.connections_open.get().to_string(),
        );
        put(
            "connections_evicted_total",
            "counter",
            "Idle connections closed to make room for new ones.",
            self.connections_evicted.get().to_string(),
        );
        put(
            "connections_timed_out_total",
            "counter",
            "Connections closed by a timeout (keep-alive, request head, stuck write).",
            self.connections_timed_out.get().to_string(),
        );
        put(
            "connections_refused_total",
            "counter",
            "Connections refused past the cap (503 too_many_connections, or closed at once).",
            self.connections_refused.get().to_string(),
        );
        put(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled.",
            self.prompt_tokens.get().to_string(),
        );
        put(
            "completion_tokens_total",
            "counter",
            "Tokens generated.",
            self.completion_tokens.get().to_string(),
        );
        let (pt, ps) = (self.prompt_tokens.get() as f64, self.prefill_seconds.get());
        let (ct, ds) = (
            self.completion_tokens.get() as f64,
            self.decode_seconds.get(),
        );
        put(
            "prefill_seconds_total",
            "counter",
            "Forward time spent on prompt rows.",
            format!("{ps:.6}"),
        );
        put(
            "decode_seconds_total",
            "counter",
            "Forward time spent on decode rows.",
            format!("{ds:.6}"),
        );
        put(
            "prefill_tokens_per_second",
            "gauge",
            "Prompt tokens per second of prefill time.",
            format!("{:.3}", if ps > 0.0 { pt / ps } else { 0.0 }),
        );
        put(
            "decode_tokens_per_second",
            "gauge",
            "Generated tokens per second of decode time.",
            format!("{:.3}", if ds > 0.0 { ct / ds } else { 0.0 }),
        );
        put(
            "queue_depth",
            "gauge",
            "Requests waiting in the queue.",
            self.queue_depth.get().to_string(),
        );
        put(
            "requests_running",
            "gauge",
            "Requests running on the model thread.",
            self.running.get().to_string(),
        );
        put(
            "prefill_pending_tokens",
            "gauge",
            "Prompt tokens of running requests still to prefill.",
            self.prefill_pending.get().to_string(),
        );
        put(
            "max_step_requests",
            "gauge",
            "The most requests one forward call has carried.",
            self.max_step_requests.get().to_string(),
        );
        put(
            "expert_cache_hits_total",
            "counter",
            "Tier mode: decode expert lookups served from VRAM (0 in resident mode).",
            self.expert_cache_hits.get().to_string(),
        );
        put(
            "expert_cache_misses_total",
            "counter",
            "Tier mode: decode expert lookups copied from host memory (0 in resident mode).",
            self.expert_cache_misses.get().to_string(),
        );
        put(
            "prefix_cache_hits_total",
            "counter",
            "Requests that started from a saved state of a prefix of their prompt.",
            self.prefix_cache_hits.get().to_string(),
        );
        put(
            "prefix_cache_misses_total",
            "counter",
            "Requests that found no saved state of a prefix of their prompt (prefix cache on).",
            self.prefix_cache_misses.get().to_string(),
        );
        put(
            "prefix_cache_reused_tokens_total",
            "counter",
            "Prompt tokens restored from the prefix cache instead of prefilled.",
            self.prefix_cache_reused_tokens.get().to_string(),
        );
        put(
            "prefix_cache_entries",
            "gauge",
            "Saved states in the prefix cache.",
            self.prefix_cache_entries.get().to_string(),
        );
        put(
            "prefix_cache_bytes",
            "gauge",
            "Bytes the prefix cache's entries are counted at (KV rows in whole blocks and recurrent states, shared blocks counted in full).",
            self.prefix_cache_bytes.get().to_string(),
        );
        put(
            "prefix_cache_evictions_total",
            "counter",
            "Prefix cache entries evicted (least recently used first, --prefix-cache-mb).",
            self.prefix_cache_evictions.get().to_string(),
        );
        put(
            "kv_budget_bytes",
            "gauge",
            "Bytes the running requests' whole contexts may reserve together (--kv-budget; 0: no limit).",
            self.kv_budget_bytes.get().to_string(),
        );
        put(
            "kv_reserved_bytes",
            "gauge",
            "Bytes the running requests reserve: KV rows of prompt + max_tokens + 1 in whole blocks, and recurrent states.",
            self.kv_reserved_bytes.get().to_string(),
        );
        put(
            "requests_waiting_memory",
            "gauge",
            "Requests admitted from the queue but waiting for KV memory (the next one does not fit beside the running ones).",
            self.kv_waiting.get().to_string(),
        );
        put(
            "kv_memory_waits_total",
            "counter",
            "Requests that waited for KV memory before they started.",
            self.kv_memory_waits.get().to_string(),
        );
        s
    }
}
