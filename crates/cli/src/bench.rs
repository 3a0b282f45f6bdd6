//! `samesum bench`: llama-bench-style prompt-processing and generation speed.

use crate::args::{BackendArgs, ChunkArgs, KvArgs, ModelArgs, Prefill, ThreadsArgs};
use crate::with_backend;
use anyhow::{Result, bail};
use samesum_engine::sample::SamplerConfig;
use samesum_engine::sched::{Config as SchedConfig, Output, Request, Scheduler};
use samesum_engine::{Backend, KvType, Logits, Model, forward, prefill};
use samesum_quant::rng::Rng;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `samesum bench`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths to measure (comma-separated; 0 skips).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    n_prompt: Vec<usize>,
    /// Generation lengths to measure (comma-separated; 0 skips).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    n_gen: Vec<usize>,
    /// Context depths (comma-separated, llama-bench's -d): each test runs
    /// after this many random tokens were prefilled (batched, not timed).
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    n_depth: Vec<usize>,
    /// Repetitions per test.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    #[command(flatten)]
    threads: ThreadsArgs,
    #[command(flatten)]
    chunk: ChunkArgs,
    /// Prefill arms to measure: batched, replay (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "batched")]
    prefill: Vec<Prefill>,
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    backend: BackendArgs,
    /// Per-kernel time breakdown (CUDA events around every launch; slows the
    /// run). On CUDA it also launches everything on one stream (the prefill's
    /// shared expert does not run beside the routed experts) and decode
    /// without graphs, so its schedule is not the unprofiled run's. Each
    /// test's table is its last timed run's, the depth fill (-d) left out;
    /// `--parallel`'s covers the steps after every prompt's first token.
    #[arg(long)]
    profile: bool,
    /// Skip the uncounted warm-up run before each test (llama-bench's
    /// --no-warmup), for long replay runs.
    #[arg(long)]
    no_warmup: bool,
    /// After the tests, write the logits bytes of one check run to this file
    /// (f32, little-endian): every row of the first prompt length, prefilled
    /// batched, then each step of greedy decoding for the first generation
    /// length. Two builds that should compute the same sums write the same file.
    #[arg(long, value_name = "FILE")]
    logits_out: Option<PathBuf>,
    /// Also decode N sequences together through the serving scheduler
    /// (comma-separated list, llama-batched-bench's -npl): each of N random
    /// prompts of the first prompt length generates the first generation
    /// length (greedy), prompts prefilled --chunk rows a step beside the
    /// decoding ones. Reports the aggregate prompt and generation rates
    /// (forward time split by rows), the whole run's rate, each sequence's
    /// own generation rate, and the share of the steps' time spent outside
    /// their forward calls (the scheduler's host work).
    #[arg(long = "parallel", value_name = "N", value_delimiter = ',')]
    parallel: Vec<usize>,
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

pub(crate) fn run(a: Args) -> Result<()> {
    let dev = a.backend.device(a.threads.threads)?;
    let kv = a.kv.kv(&dev)?;
    if a.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    let (path, _tmp) = a.model.path_or_synth("tiny-qwen3next", "q8_0", None)?;
    if a.profile {
        // SAFETY: set before any thread of this process reads the environment.
        unsafe { std::env::set_var("SAMESUM_CUDA_PROFILE", "1") };
    }
    let model = crate::run::load_with_progress(&path)?;
    let backend = crate::args::open(dev, &model)?;
    let chunk = a.chunk.or_default(&backend);
    with_backend!(&backend, |b| bench(b, &model, &path, &a, kv, chunk))?;
    println!("\nbuild: {}", env!("BUILD_COMMIT"));
    Ok(())
}

/// Tier mode's counters over a test's timed runs (the untimed warm-up and
/// depth fills left out).
#[derive(Default)]
struct Offload {
    at: Option<samesum_engine::backend::OffloadCounters>,
    sum: Option<samesum_engine::backend::OffloadCounters>,
    secs: f64,
}

impl Offload {
    /// Right before a run's timed part.
    fn begin<B: Backend>(&mut self, b: &B) {
        self.at = b.offload_counters();
    }

    /// Right after a run's timed part of `secs` seconds (run 0 is the
    /// warm-up and is not counted).
    fn end<B: Backend>(&mut self, b: &B, rep: usize, secs: f64) {
        if rep == 0 {
            return;
        }
        if let (Some(now), Some(at)) = (b.offload_counters(), self.at) {
            let d = now.since(&at);
            let s = self.sum.get_or_insert_with(Default::default);
            s.hits += d.hits;
            s.misses += d.misses;
            s.fetched_bytes += d.fetched_bytes;
            s.staged_bytes += d.staged_bytes;
        }
        self.secs += secs;
    }

    /// One line after the test's row (nothing in resident mode).
    fn print(&self, test: &str) {
        let Some(d) = self.sum else {
            return;
        };
        let gib = |x: u64| x as f64 / (1u64 << 30) as f64;
        let rate = |x: u64| x as f64 / 1e9 / self.secs.max(1e-9);
        println!(
            "{test}, tier mode, timed runs: decode cache {} hits, {} misses ({:.1}% hits), {:.2} GiB fetched ({:.1} GB/s), {:.2} GiB staged for prefill ({:.1} GB/s)",
            d.hits,
            d.misses,
            100.0 * d.hit_rate(),
            gib(d.fetched_bytes),
            rate(d.fetched_bytes),
            gib(d.staged_bytes),
            rate(d.staged_bytes)
        );
    }
}

/// Every (length, depth) pair of the lists, lengths outer, zero lengths skipped.
fn tests<'a>(
    lens: &'a [usize],
    depths: &'a [usize],
) -> impl Iterator<Item = (&'a usize, &'a usize)> {
    lens.iter()
        .filter(|&&n| n > 0)
        .flat_map(move |n| depths.iter().map(move |d| (n, d)))
}

/// A test name's depth suffix, as llama-bench writes it.
fn at(depth: usize) -> String {
    if depth > 0 {
        format!(" @ d{depth}")
    } else {
        String::new()
    }
}

/// Fill the context with `toks` before a test (batched, no logits; untimed),
/// and wait for the device to finish it: without logits nothing waits for
/// the fill's last calls, and the test's timer would count them (as
/// llama-bench synchronizes after its depth fill).
fn prefill_depth<B: Backend>(
    b: &B,
    model: &Model,
    st: &mut B::State,
    toks: &[u32],
    chunk: usize,
) -> Result<()> {
    prefill(model, b, st, toks, chunk, Logits::None)?;
    b.synchronize()?;
    Ok(())
}

fn bench<B: Backend>(
    b: &B,
    model: &Model,
    path: &std::path::Path,
    a: &Args,
    kv: KvType,
    batch_chunk: usize,
) -> Result<()> {
    let size: u64 = model.file.tensors().iter().map(|t| t.size).sum();
    let params: u64 = model.file.tensors().iter().map(|t| t.n_elements()).sum();
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    println!("| model | size | params | backend | test | t/s |");
    println!("| --- | ---: | ---: | --- | --- | ---: |");
    let row = |test: String, rates: &[f64]| {
        let (m, sd) = mean_sd(rates);
        println!(
            "| {name} ({}) | {:.2} GiB | {:.2} B | {} | {test} | {m:.2} ± {sd:.2} |",
            model.hp.arch.name(),
            size as f64 / (1u64 << 30) as f64,
            params as f64 / 1e9,
            b.name(),
        );
    };
    let mut rng = Rng::new(42);
    let vocab = model.w.n_vocab as u64;
    let mut tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(vocab) as u32).collect() };
    let first = usize::from(a.no_warmup);
    for arm in &a.prefill {
        let chunk = match arm {
            Prefill::Batched => batch_chunk,
            Prefill::Replay => 1,
        };
        for (&np, &depth) in tests(&a.n_prompt, &a.n_depth) {
            let mut rates = Vec::new();
            let mut off = Offload::default();
            let mut report = None;
            for rep in first..=a.repetitions {
                let mut st = b.new_state(model, depth + np, kv)?;
                prefill_depth(b, model, &mut st, &tokens(depth), batch_chunk)?;
                // The depth fill is not part of the test's kernel times.
                b.take_report()?;
                let prompt = tokens(np);
                off.begin(b);
                let t = Instant::now();
                prefill(model, b, &mut st, &prompt, chunk, Logits::Last)?;
                let secs = t.elapsed().as_secs_f64();
                off.end(b, rep, secs);
                let r = b.take_report()?;
                if rep > 0 {
                    // The first run warms caches and is not counted, as llama-bench does.
                    rates.push(np as f64 / secs);
                    report = r;
                }
            }
            let name = if a.prefill.len() > 1 || *arm != Prefill::Batched {
                format!("pp{np} {arm}{}", at(depth))
            } else {
                format!("pp{np}{}", at(depth))
            };
            row(name.clone(), &rates);
            off.print(&name);
            if let Some(r) = report {
                println!("\nkernel time, {name}, the last timed run:\n\n{r}");
            }
        }
    }
    for (&ng, &depth) in tests(&a.n_gen, &a.n_depth) {
        let mut rates = Vec::new();
        let mut off = Offload::default();
        let mut report = None;
        for rep in first..=a.repetitions {
            let mut st = b.new_state(model, depth + ng, kv)?;
            prefill_depth(b, model, &mut st, &tokens(depth), batch_chunk)?;
            b.take_report()?;
            let toks = tokens(ng);
            off.begin(b);
            let t = Instant::now();
            for &tok in &toks {
                forward(model, b, &mut st, &[tok], Logits::Last)?;
            }
            let secs = t.elapsed().as_secs_f64();
            off.end(b, rep, secs);
            let r = b.take_report()?;
            if rep > 0 {
                rates.push(ng as f64 / secs);
                report = r;
            }
        }
        let name = format!("tg{ng}{}", at(depth));
        row(name.clone(), &rates);
        off.print(&name);
        if let Some(r) = report {
            println!("\nkernel time, {name}, the last timed run:\n\n{r}");
        }
    }
    if !a.parallel.is_empty() {
        parallel(b, model, a, kv, batch_chunk)?;
    }
    if let Some(out) = &a.logits_out {
        write_logits(b, model, a, kv, batch_chunk, out)?;
    }
    Ok(())
}

/// `--parallel`: N sequences through [`Scheduler`] at once, per N.
fn parallel<B: Backend>(b: &B, model: &Model, a: &Args, kv: KvType, chunk: usize) -> Result<()> {
    let np = a.n_prompt.iter().copied().find(|&n| n > 0).unwrap_or(1);
    let ng = a.n_gen.iter().copied().find(|&n| n > 0).unwrap_or(1);
    let mut rng = Rng::new(11);
    let vocab = model.w.n_vocab as u64;
    println!();
    println!(
        "| PP | TG | B | S_PP t/s | S_TG t/s | S t/s | TG t/s per sequence (min .. max) | host share of steps |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut reports = Vec::new();
    for &n in a.parallel.iter().filter(|&&n| n > 0) {
        let (mut pp, mut tg, mut all, mut per) = (vec![], vec![], vec![], vec![]);
        let mut host = vec![];
        let mut report = None;
        for rep in usize::from(a.no_warmup)..=a.repetitions {
            let mut s = Scheduler::new(
                model,
                b,
                SchedConfig {
                    max_batch: n,
                    prefill_chunk: chunk,
                    kv,
                    prefix_cache_bytes: 0,
                    kv_budget: None,
                },
            );
            let mut first = vec![None; n];
            let mut last = vec![None; n];
            let t = Instant::now();
            // Steps after every prompt's first token (decode only): the
            // kernel table covers those.
            let mut decode_steps: Option<usize> = None;
            let mut ids = Vec::with_capacity(n);
            for _ in 0..n {
                let prompt = (0..np).map(|_| rng.below(vocab) as u32).collect();
                ids.push(s.submit(Request {
                    prompt,
                    max_new: ng,
                    sampler: SamplerConfig {
                        temp: 0.0,
                        ..Default::default()
                    },
                    penalties: Default::default(),
                    logit_bias: Vec::new(),
                    stop_tokens: Vec::new(),
                    logprobs: None,
                    constraint: None,
                })?);
            }
            while !s.is_idle() {
                for o in s.step() {
                    match o {
                        Output::Token { id, .. } => {
                            if let Some(k) = ids.iter().position(|&i| i == id) {
                                first[k].get_or_insert_with(Instant::now);
                                last[k] = Some(Instant::now());
                            }
                        }
                        Output::Failed { error, .. } => bail!("--parallel {n}: {error}"),
                        _ => {}
                    }
                }
                match &mut decode_steps {
                    Some(k) => *k += 1,
                    None if first.iter().all(Option::is_some) => {
                        // The prefill steps' kernel times are dropped.
                        b.take_report()?;
                        decode_steps = Some(0);
                    }
                    None => {}
                }
            }
            let secs = t.elapsed().as_secs_f64();
            let r = b.take_report()?;
            if rep == 0 {
                continue;
            }
            report = r.map(|r| (r, decode_steps.unwrap_or(0)));
            let st = s.stats();
            pp.push(st.prompt_tokens as f64 / st.prefill_seconds.max(1e-12));
            let decoded = st.completion_tokens.saturating_sub(n as u64);
            tg.push(decoded as f64 / st.decode_seconds.max(1e-12));
            let busy = st.prefill_seconds + st.decode_seconds + st.host_seconds;
            host.push(100.0 * st.host_seconds / busy.max(1e-12));
            all.push((n * (np + ng)) as f64 / secs);
            for (f, l) in first.iter().zip(&last) {
                if let (Some(f), Some(l)) = (f, l)
                    && ng > 1
                {
                    per.push((ng - 1) as f64 / (*l - *f).as_secs_f64().max(1e-12));
                }
            }
        }
        let (pp, tg, all) = (mean_sd(&pp).0, mean_sd(&tg).0, mean_sd(&all).0);
        let lo = per.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = per.iter().copied().fold(0.0, f64::max);
        let per_seq = if per.is_empty() {
            "-".to_string()
        } else {
            format!("{:.2} ({lo:.2} .. {hi:.2})", mean_sd(&per).0)
        };
        let host = mean_sd(&host).0;
        println!("| {np} | {ng} | {n} | {pp:.2} | {tg:.2} | {all:.2} | {per_seq} | {host:.1}% |");
        if let Some(r) = report {
            reports.push((n, r));
        }
    }
    for (n, (r, steps)) in reports {
        println!(
            "\nkernel time, {n} sequences, the {steps} steps after every prompt's first token (decode only), the last timed run:\n\n{r}"
        );
    }
    Ok(())
}

/// The check run of `--logits-out`: a fixed random prompt of the first
/// prompt length (all rows' logits), then greedy decoding of the first
/// generation length, every logit appended to `out` as f32 little-endian.
fn write_logits<B: Backend>(
    b: &B,
    model: &Model,
    a: &Args,
    kv: KvType,
    chunk: usize,
    out: &std::path::Path,
) -> Result<()> {
    use std::io::Write;
    let np = a.n_prompt.iter().copied().find(|&n| n > 0).unwrap_or(0);
    let ng = a.n_gen.iter().copied().find(|&n| n > 0).unwrap_or(0);
    let mut rng = Rng::new(7);
    let vocab = model.w.n_vocab as u64;
    let prompt: Vec<u32> = (0..np).map(|_| rng.below(vocab) as u32).collect();
    let file = std::fs::File::create(out)
        .map_err(|e| anyhow::anyhow!("creating {}: {e}", out.display()))?;
    let mut w = std::io::BufWriter::new(file);
    let mut put = |v: &[f32]| -> Result<()> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.write_all(&bytes)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", out.display()))
    };
    let mut st = b.new_state(model, np + ng + 1, kv)?;
    let n_vocab = model.w.n_vocab;
    // The prompt goes through the same chunk pairs as prefill, every row's
    // logits asked for.
    let pieces: Vec<&[u32]> = prompt.chunks(chunk.max(1)).collect();
    let all = samesum_engine::forward_chunks(model, b, &mut st, &pieces, |_| Logits::All)?;
    put(&all)?;
    let mut last = all[all.len().saturating_sub(n_vocab)..].to_vec();
    drop(all);
    for _ in 0..ng {
        let next = argmax(&last);
        last = forward(model, b, &mut st, &[next], Logits::Last)?;
        put(&last)?;
    }
    w.flush()
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", out.display()))?;
    eprintln!(
        "logits of pp{np} (all rows) and {ng} greedy steps written to {}",
        out.display()
    );
    Ok(())
}

/// The first index of the largest value (0 for an empty slice).
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
