//! `samesum agree`: teacher-forced agreement between two arms of one backend,
//! the measure a non-identical kernel variant needs before it may exist
//! (docs/CAPABILITIES.md). Arm A is the backend as configured; arm B the same
//! backend with `--variant` switches set (none: a same-arm control, which
//! must agree everywhere). Per prompt, A's greedy continuation is the
//! reference; both arms then read the prompt and the reference and predict
//! each next token, and the share of positions where their argmax tokens
//! agree is compared with `--bar`. With `--probe`, a third arm (the
//! smallest change there is, e.g. one ulp on attention's output) runs on the
//! same prompts, and arm B must agree about as often as it does: on models
//! whose greedy tokens any change moves (random weights), that is the bar
//! that can tell a careful reordering from a poor one.

use crate::device::Device;
use anyhow::{Context, Result, bail};
use samesum_engine::cpu::Cpu;
use samesum_engine::identity::continue_greedy;
use samesum_engine::sample::argmax;
use samesum_engine::tokenizer::Tokenizer;
use samesum_engine::{Backend, KvType, Logits, Model, forward};
use samesum_quant::rng::Rng;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `samesum agree`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// GGUF model (default: a synthetic model of --shape, made on the fly).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Synthetic shape when no -m is given.
    #[arg(long, default_value = "tiny-qwen3next")]
    shape: String,
    /// Prompt lengths in tokens, comma-separated (random tokens seeded by
    /// --seed and the length, or --text).
    #[arg(long, value_delimiter = ',', default_value = "512,1024,8192")]
    lens: Vec<usize>,
    /// Positions compared per prompt (the reference's greedy tokens).
    #[arg(long, default_value_t = 64)]
    r#gen: usize,
    /// Smallest share of agreeing positions each prompt must reach.
    #[arg(long, default_value_t = 0.99)]
    bar: f64,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Random prompts per length (seeds --seed, --seed + 1, ...).
    #[arg(long, default_value_t = 1)]
    seeds: usize,
    /// A probe arm: switches that make the smallest change to a result
    /// (on CUDA e.g. ATT_ULP=1), run on the same prompts; with it the verdict
    /// is the probe bar: arm B's share of agreeing positions over all prompts
    /// at least the probe's share less --probe-margin points.
    #[arg(long, value_delimiter = ',')]
    probe: Vec<String>,
    /// Points of agreement arm B may fall below the probe (the probe bar).
    #[arg(long, default_value_t = 5.0, allow_negative_numbers = true)]
    probe_margin: f64,
    /// Take the prompts from this text file instead of random tokens: its
    /// tokens from the start, repeated when the text is shorter than a
    /// length.
    #[arg(long, value_name = "FILE")]
    text: Option<PathBuf>,
    /// Arm B's switches: on CUDA NAME=0|1 for a SAMESUM_CUDA_<NAME> switch
    /// (e.g. ATT_Q4=0); on the CPU `reversed-topk` (the MoE's top-k summed in
    /// reverse). None: a same-arm control.
    #[arg(long, value_delimiter = ',')]
    variant: Vec<String>,
    /// Prompt rows per batched call (default: the device's).
    #[arg(long)]
    chunk: Option<usize>,
    /// CPU worker threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// KV cache type: f32 or f16.
    #[arg(long, default_value = "f32")]
    kv_type: String,
    /// Backend: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// One prompt's outcome.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Agreement {
    /// Positions compared.
    pub n: usize,
    /// Positions where the arms' argmax tokens agree.
    pub same: usize,
    /// Positions where arm A's teacher-forced argmax is its own greedy token
    /// (all of them, when A's batched and one-token paths are identical).
    pub a_self: usize,
    /// Largest |logit difference| between the arms over the compared rows.
    pub max_diff: f32,
}

/// Arm A's greedy continuation of `prompt`: `gen` tokens.
fn greedy<B: Backend>(
    b: &B,
    model: &Model,
    prompt: &[u32],
    r#gen: usize,
    chunk: usize,
    kv: KvType,
) -> Result<Vec<u32>> {
    let mut st = b.new_state(model, prompt.len() + r#gen, kv)?;
    let last = prefill(b, model, &mut st, prompt, chunk)?;
    Ok(continue_greedy(b, model, &mut st, &last, r#gen)?)
}

/// Feed `prompt` in chunks; the last row's logits.
fn prefill<B: Backend>(
    b: &B,
    model: &Model,
    st: &mut B::State,
    prompt: &[u32],
    chunk: usize,
) -> Result<Vec<f32>> {
    Ok(samesum_engine::prefill(
        model,
        b,
        st,
        prompt,
        chunk,
        Logits::Last,
    )?)
}

/// The arm's logits at the `reference.len()` predicted positions: after the
/// prompt, then after each reference token but the last (teacher forcing).
fn teacher_forced<B: Backend>(
    b: &B,
    model: &Model,
    prompt: &[u32],
    reference: &[u32],
    chunk: usize,
    kv: KvType,
) -> Result<Vec<f32>> {
    let mut st = b.new_state(model, prompt.len() + reference.len(), kv)?;
    let mut rows = prefill(b, model, &mut st, prompt, chunk)?;
    let forced = &reference[..reference.len().saturating_sub(1)];
    for c in forced.chunks(chunk) {
        rows.extend(forward(model, b, &mut st, c, Logits::All)?);
    }
    Ok(rows)
}

/// Compare two arms' teacher-forced rows (`n_vocab` logits each) and arm A's
/// rows with its own greedy `reference`.
pub(crate) fn compare(a: &[f32], b: &[f32], reference: &[u32], n_vocab: usize) -> Agreement {
    let n = reference.len();
    let (mut same, mut a_self, mut max_diff) = (0, 0, 0.0f32);
    for (i, &want) in reference.iter().enumerate() {
        let (ra, rb) = (
            &a[i * n_vocab..(i + 1) * n_vocab],
            &b[i * n_vocab..(i + 1) * n_vocab],
        );
        let ta = argmax(ra);
        same += usize::from(ta == argmax(rb));
        a_self += usize::from(ta == want);
        for (x, y) in ra.iter().zip(rb) {
            let d = (x - y).abs();
            // NaN counts as the largest difference.
            if d.is_nan() || d > max_diff {
                max_diff = if d.is_nan() { f32::INFINITY } else { d };
            }
        }
    }
    Agreement {
        n,
        same,
        a_self,
        max_diff,
    }
}

/// A's reference, then A and each other arm teacher-forced, for one prompt:
/// each arm's agreement with A.
fn agree_arms<B: Backend>(
    arm_a: &B,
    others: &[&B],
    model: &Model,
    prompt: &[u32],
    r#gen: usize,
    chunk: usize,
    kv: KvType,
) -> Result<Vec<Agreement>> {
    let reference = greedy(arm_a, model, prompt, r#gen, chunk, kv)?;
    let la = teacher_forced(arm_a, model, prompt, &reference, chunk, kv)?;
    let mut out = Vec::new();
    for b in others {
        let lb = teacher_forced(*b, model, prompt, &reference, chunk, kv)?;
        out.push(compare(&la, &lb, &reference, model.w.n_vocab));
    }
    Ok(out)
}

/// `NAME=0|1` switch settings of a CUDA arm.
fn parse_switches(list: &[String], what: &str) -> Result<Vec<(String, bool)>> {
    let mut out = Vec::new();
    for v in list {
        let (name, val) = v
            .split_once('=')
            .with_context(|| format!("{what} {v:?}: expected NAME=0 or NAME=1"))?;
        let on = match val {
            "1" => true,
            "0" => false,
            _ => bail!("{what} {v:?}: the value must be 0 or 1"),
        };
        out.push((name.to_string(), on));
    }
    Ok(out)
}

/// A CPU arm with the named variants.
fn cpu_arm(threads: usize, list: &[String]) -> Result<Cpu> {
    let mut arm = Cpu::new(threads);
    for v in list {
        match v.as_str() {
            "reversed-topk" => arm = arm.with_reversed_topk(),
            other => bail!(
                "no CPU variant {other:?} (have: reversed-topk; CUDA switches need --device cuda)"
            ),
        }
    }
    Ok(arm)
}

/// Share of agreeing positions over several prompts.
fn share(rs: &[&Agreement]) -> f64 {
    let (n, same) = rs.iter().fold((0, 0), |(n, s), r| (n + r.n, s + r.same));
    same as f64 / n.max(1) as f64
}

fn random_prompt(len: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut rng = Rng::new(seed.wrapping_mul(1_000_003).wrapping_add(len as u64));
    (0..len).map(|_| rng.below(vocab as u64) as u32).collect()
}

pub(crate) fn run(a: Args) -> Result<()> {
    let kv = match a.kv_type.as_str() {
        "f32" => KvType::F32,
        "f16" => KvType::F16,
        other => bail!("--kv-type {other:?} is not supported (f32, f16)"),
    };
    if a.r#gen == 0 {
        bail!("--gen must be at least 1");
    }
    if a.lens.is_empty() || a.lens.contains(&0) {
        bail!("--lens must list prompt lengths of at least 1 token");
    }
    if !(0.0..=1.0).contains(&a.bar) {
        bail!("--bar {} is not a share between 0 and 1", a.bar);
    }
    if a.chunk == Some(0) {
        bail!("--chunk must be at least 1");
    }
    if a.seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    if a.seeds > 1 && a.text.is_some() {
        bail!("--seeds takes random prompts; with --text there is one prompt per length");
    }
    if !a.probe_margin.is_finite() {
        bail!("--probe-margin must be a number of points");
    }
    let dev = Device::parse(&a.device, None)?;
    let (path, _tmp) = crate::synth::model_or_builtin(&a.model, &a.shape, "q4_k", None)?;
    let model = Model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let vocab = model.w.n_vocab;
    let text_tokens = match &a.text {
        Some(f) => {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            let tok = Tokenizer::from_metadata(model.file.metadata())?;
            let t = tok.encode(&text)?;
            if t.is_empty() {
                bail!("{} tokenizes to nothing", f.display());
            }
            Some(t)
        }
        None => None,
    };
    let prompt_of = |len: usize, seed: u64| match &text_tokens {
        Some(t) => t.iter().copied().cycle().take(len).collect(),
        None => random_prompt(len, seed, vocab),
    };
    // (length, seed) of each prompt, lengths first.
    let prompts: Vec<(usize, u64)> = a
        .lens
        .iter()
        .flat_map(|&len| (0..a.seeds as u64).map(move |s| (len, s)))
        .map(|(len, s)| (len, a.seed + s))
        .collect();
    let probing = !a.probe.is_empty();
    let control = a.variant.is_empty();
    println!(
        "teacher-forced agreement: {} ({}), arm B {}, {} positions per prompt, bar {:.2}%",
        path.display(),
        model.hp.arch.name(),
        if control {
            "= arm A (same-arm control)".to_string()
        } else {
            format!("= arm A with {}", a.variant.join(", "))
        },
        a.r#gen,
        a.bar * 100.0
    );
    if probing {
        println!(
            "probe arm = arm A with {}; probe bar: B's share at least the probe's less {} points",
            a.probe.join(", "),
            a.probe_margin
        );
    }
    println!(
        "| prompt tokens | agree | share | A's own greedy | max abs logit diff | verdict | seed | probe agree |"
    );
    println!("|---:|---:|---:|---:|---:|---|---:|---:|");
    let t0 = Instant::now();
    let mut results: Vec<(Agreement, Option<Agreement>, bool)> = Vec::new();
    let mut report = |len: usize, seed: u64, r: Agreement, p: Option<Agreement>| {
        let share = r.same as f64 / r.n as f64;
        let ok = share >= a.bar && r.a_self == r.n;
        println!(
            "| {len} | {}/{} | {:.2}% | {}/{} | {:.3e} | {} | {seed} | {} |",
            r.same,
            r.n,
            share * 100.0,
            r.a_self,
            r.n,
            r.max_diff,
            if ok { "pass" } else { "FAIL" },
            match &p {
                Some(p) => format!("{}/{}", p.same, p.n),
                None => "-".to_string(),
            }
        );
        results.push((r, p, ok));
    };
    match dev {
        Device::Cpu => {
            let chunk = a.chunk.unwrap_or_else(|| dev.default_chunk(false));
            let arm_a = Cpu::new(a.threads);
            let arm_b = cpu_arm(a.threads, &a.variant)?;
            let arm_p = if probing {
                Some(cpu_arm(a.threads, &a.probe)?)
            } else {
                None
            };
            let others: Vec<&Cpu> = std::iter::once(&arm_b).chain(arm_p.as_ref()).collect();
            for &(len, seed) in &prompts {
                let p: Vec<u32> = prompt_of(len, seed);
                let mut r = agree_arms(&arm_a, &others, &model, &p, a.r#gen, chunk, kv)?;
                let probe = if probing { r.pop() } else { None };
                report(len, seed, r.remove(0), probe);
            }
        }
        Device::Cuda(n, budget) => {
            let switches = parse_switches(&a.variant, "--variant")?;
            let probe = parse_switches(&a.probe, "--probe")?;
            let mut cuda = crate::device::cuda(n, budget, &model)?;
            let chunk = a
                .chunk
                .unwrap_or_else(|| dev.default_chunk(cuda.offload_counters().is_some()));
            // Every name checked (and its setting kept) before the long runs.
            let mut was = Vec::new();
            for (name, _) in switches.iter().chain(&probe) {
                was.push((name.clone(), cuda.switch(name)?));
            }
            // An arm's teacher-forced rows with its switches set, then the
            // settings put back (also when the run fails).
            let arm = |cuda: &mut samesum_cuda::Cuda,
                       set: &[(String, bool)],
                       p: &[u32],
                       reference: &[u32]|
             -> Result<Vec<f32>> {
                for (name, on) in set {
                    cuda.set_switch(name, *on)?;
                }
                let rows = teacher_forced(&*cuda, &model, p, reference, chunk, kv);
                for (name, w) in &was {
                    cuda.set_switch(name, *w)?;
                }
                rows
            };
            for &(len, seed) in &prompts {
                let p: Vec<u32> = prompt_of(len, seed);
                let reference = greedy(&cuda, &model, &p, a.r#gen, chunk, kv)?;
                let la = teacher_forced(&cuda, &model, &p, &reference, chunk, kv)?;
                let lb = arm(&mut cuda, &switches, &p, &reference)?;
                let lp = if probing {
                    Some(arm(&mut cuda, &probe, &p, &reference)?)
                } else {
                    None
                };
                let rp = lp.map(|lp| compare(&la, &lp, &reference, vocab));
                report(len, seed, compare(&la, &lb, &reference, vocab), rp);
            }
        }
    }
    let all: Vec<&Agreement> = results.iter().map(|(r, _, _)| r).collect();
    let n: usize = all.iter().map(|r| r.n).sum();
    let same: usize = all.iter().map(|r| r.same).sum();
    let failed = results.iter().filter(|(_, _, ok)| !ok).count();
    println!(
        "\n{same} of {n} positions agree ({:.2}%), {failed} of {} prompts below the bar, in {:.1}s",
        share(&all) * 100.0,
        results.len(),
        t0.elapsed().as_secs_f64()
    );
    if probing {
        let probes: Vec<&Agreement> = results.iter().filter_map(|(_, p, _)| p.as_ref()).collect();
        let (b, p) = (share(&all) * 100.0, share(&probes) * 100.0);
        let a_self = all.iter().all(|r| r.a_self == r.n);
        let ok = b >= p - a.probe_margin && a_self;
        println!(
            "probe bar: arm B {b:.2}% against the probe's {p:.2}% less {} points: {}",
            a.probe_margin,
            if ok { "pass" } else { "FAIL" }
        );
        if !a_self {
            bail!("arm A's teacher-forced argmax differs from its own greedy tokens");
        }
        if !ok {
            bail!(
                "arm B's {b:.2}% is below the probe's {p:.2}% less {} points",
                a.probe_margin
            );
        }
        return Ok(());
    }
    if failed > 0 {
        bail!("{failed} prompt(s) below the {:.2}% bar", a.bar * 100.0);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::compare;

    #[test]
    fn compare_counts_agreeing_argmaxes_and_the_largest_difference() {
        // Three rows of a 3-token vocabulary.
        let a = [0.0, 2.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0];
        let b = [0.0, 2.5, 1.0, 0.0, 6.0, 0.0, 0.0, 0.0, 1.0];
        let r = compare(&a, &b, &[1, 0, 1], 3);
        assert_eq!(r.n, 3);
        assert_eq!(r.same, 2); // rows 0 and 2
        assert_eq!(r.a_self, 2); // row 2's argmax is 2, not the reference's 1
        assert_eq!(r.max_diff, 6.0);
        let nan = [f32::NAN, 0.0, 0.0];
        assert_eq!(
            compare(&nan, &[0.0, 0.0, 0.0], &[0], 3).max_diff,
            f32::INFINITY
        );
    }
}
