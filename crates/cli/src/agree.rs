//! `samesum agree`: teacher-forced agreement between two arms, the measure a
//! kernel variant that does not compute the same bytes needs before it may
//! exist (docs/CAPABILITIES.md). Arm A is the reference configuration
//! (exact attention, an f32 KV cache unless `--kv-type` says otherwise);
//! arm B the same device as configured (`--attention`, `--kv-type-b`), with
//! any `--variant`. Where B equals A (no such options), B is a same-arm
//! control, which must agree everywhere. Per prompt, A's greedy continuation
//! is the reference; both arms then read the prompt and the reference and
//! predict each next token, and the share of positions where their argmax
//! tokens agree is compared with `--bar`. With `--probe`, a third arm (the
//! smallest change there is) runs on the same prompts, and arm B must agree
//! about as often as it does: on models whose greedy tokens any change moves
//! (random weights), that is the bar that can tell a careful reordering from
//! a poor one.
//!
//! Arms that differ run one after the other, each on its own backend (a
//! CUDA arm holds the model's weights; two would need twice the memory):
//! arm A's rows are kept for the arms after it.

use crate::args::{BackendArgs, ChunkArgs, KvArgs, ModelArgs, ShapeArgs, ThreadsArgs};
use crate::backend::{AnyBackend, CudaOptions, Device};
use crate::with_backend;
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
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    shape: ShapeArgs,
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
    /// A probe arm: arm A with these variants (the smallest change to a
    /// result), run on the same prompts; with it the verdict is the probe
    /// bar: arm B's share of agreeing positions over all prompts at least
    /// the probe's share less --probe-margin points.
    #[arg(long, value_enum, value_delimiter = ',')]
    probe: Vec<Variant>,
    /// Points of agreement arm B may fall below the probe (the probe bar).
    #[arg(long, default_value_t = 5.0, allow_negative_numbers = true)]
    probe_margin: f64,
    /// Take the prompts from this text file instead of random tokens: its
    /// tokens from the start, repeated when the text is shorter than a
    /// length.
    #[arg(long, value_name = "FILE")]
    text: Option<PathBuf>,
    /// Arm B's variants (comma-separated), on top of its device's
    /// configuration (see --attention and --kv-type-b).
    #[arg(long, value_enum, value_delimiter = ',')]
    variant: Vec<Variant>,
    #[command(flatten)]
    chunk: ChunkArgs,
    #[command(flatten)]
    threads: ThreadsArgs,
    #[command(flatten)]
    kv: KvArgs,
    /// Arm B's KV cache type (default: arm A's): measures a cache type
    /// against another, e.g. `--kv-type f32 --kv-type-b f16` (the default
    /// f16 cache against the reference's).
    #[arg(long = "kv-type-b", value_name = "TYPE", value_parser = ["f32", "f16", "bf16"])]
    kv_type_b: Option<String>,
    // `--attention` applies to arm B (not given: arm A's exact passes);
    // arm A runs the exact passes.
    #[command(flatten)]
    backend: BackendArgs,
}

/// A variant of a backend (CPU or CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Variant {
    /// The MoE's top-k experts summed in reverse order.
    ReversedTopk,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::ReversedTopk => "reversed-topk",
        }
    }
}

/// One arm: its device (with its options) and CPU variants.
#[derive(Clone, Debug, PartialEq)]
struct Arm {
    device: Device,
    variants: Vec<Variant>,
    kv: KvType,
}

impl Arm {
    /// Open the arm's backend, with its variants.
    fn open(&self, model: &Model) -> Result<AnyBackend> {
        let b = match self.device {
            Device::Cpu(threads) => AnyBackend::Cpu(Cpu::new(threads)),
            Device::Cuda(..) => crate::args::open(self.device, model)?,
        };
        Ok(self.variants.iter().fold(b, |b, v| match (v, b) {
            (Variant::ReversedTopk, AnyBackend::Cpu(c)) => AnyBackend::Cpu(c.with_reversed_topk()),
            (Variant::ReversedTopk, AnyBackend::Cuda(c)) => {
                AnyBackend::Cuda(Box::new(c.with_reversed_topk()))
            }
        }))
    }
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

/// Arm A's reference and rows, and the other arms' agreements with A, per
/// prompt.
struct Runs<'a> {
    model: &'a Model,
    prompts: &'a [Vec<u32>],
    r#gen: usize,
    /// KV cache types of arm A, arm B and the probe.
    kv: [KvType; 3],
    /// Arm A's greedy tokens.
    reference: Vec<Vec<u32>>,
    /// Arm A's teacher-forced rows, kept for the arms that run after it.
    rows_a: Vec<Vec<f32>>,
    /// Arm B's agreement with A, and the probe's.
    agreements: Vec<[Option<Agreement>; 2]>,
}

impl Runs<'_> {
    /// One backend over every prompt: arm A's reference and rows first when
    /// `with_a`, then the rows of the `arms` it runs (0: arm B, 1: the
    /// probe), compared with A's. On the `last` backend, A's rows are freed
    /// and `done` gets the prompt's agreements as each prompt is through.
    fn phase<B: Backend>(
        &mut self,
        b: &B,
        with_a: bool,
        arms: &[usize],
        chunk: usize,
        last: bool,
        done: &mut dyn FnMut(usize, &[Option<Agreement>; 2]),
    ) -> Result<()> {
        let (model, kv, n_vocab) = (self.model, self.kv, self.model.w.n_vocab);
        for (i, p) in self.prompts.iter().enumerate() {
            if with_a {
                let reference = greedy(b, model, p, self.r#gen, chunk, kv[0])?;
                self.rows_a[i] = teacher_forced(b, model, p, &reference, chunk, kv[0])?;
                self.reference[i] = reference;
            }
            for &k in arms {
                let rows = teacher_forced(b, model, p, &self.reference[i], chunk, kv[1 + k])?;
                let r = compare(&self.rows_a[i], &rows, &self.reference[i], n_vocab);
                self.agreements[i][k] = Some(r);
            }
            if last {
                self.rows_a[i] = Vec::new();
                done(i, &self.agreements[i]);
            }
        }
        Ok(())
    }
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
    if a.r#gen == 0 {
        bail!("--gen must be at least 1");
    }
    if a.lens.is_empty() || a.lens.contains(&0) {
        bail!("--lens must list prompt lengths of at least 1 token");
    }
    if !(0.0..=1.0).contains(&a.bar) {
        bail!("--bar {} is not a share between 0 and 1", a.bar);
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
    let device = a.backend.device(a.threads.threads)?;
    // Arm A: the reference configuration (exact attention, an f32 cache
    // unless --kv-type says otherwise); arm B the device as given.
    let kv = a.kv.given().unwrap_or(KvType::F32);
    let base = match device {
        Device::Cuda(n, opts) => Device::Cuda(
            n,
            CudaOptions {
                fast_attention: false,
                ..opts
            },
        ),
        cpu => cpu,
    };
    // Arm B differs from arm A only where an option says so (the cache by
    // --kv-type-b, the attention by --attention, --variant): with none it
    // is a same-arm control, whatever the device's defaults are.
    let kv_b = match a.kv_type_b.as_deref() {
        Some("f32") => KvType::F32,
        Some("bf16") => KvType::BF16,
        Some(_) => KvType::F16,
        None => kv,
    };
    let device = if a.backend.attention_given() {
        device
    } else {
        base
    };
    let arm_a = Arm {
        device: base,
        variants: Vec::new(),
        kv,
    };
    let arm_b = Arm {
        device,
        variants: a.variant.clone(),
        kv: kv_b,
    };
    let probing = !a.probe.is_empty();
    let arm_p = probing.then(|| Arm {
        device: base,
        variants: a.probe.clone(),
        kv,
    });
    let (path, _tmp) = a.model.path_or_synth(&a.shape.shape, "q4_k", None)?;
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
    let specs: Vec<(usize, u64)> = a
        .lens
        .iter()
        .flat_map(|&len| (0..a.seeds as u64).map(move |s| (len, s)))
        .map(|(len, s)| (len, a.seed + s))
        .collect();
    let prompts: Vec<Vec<u32>> = specs.iter().map(|&(len, s)| prompt_of(len, s)).collect();
    let mut b_changes: Vec<&str> = a.variant.iter().map(|v| v.name()).collect();
    if matches!(device, Device::Cuda(_, o) if o.fast_attention) {
        b_changes.push("fast attention");
    }
    let kv_name = |k: KvType| match k {
        KvType::F16 => "an f16 KV cache",
        KvType::BF16 => "a bf16 KV cache",
        KvType::F32 => "an f32 KV cache",
    };
    if kv_b != kv {
        b_changes.push(kv_name(kv_b));
    }
    println!(
        "teacher-forced agreement: {} ({}), arm A with {}, arm B {}, {} positions per prompt, bar {:.2}%",
        path.display(),
        model.hp.arch.name(),
        kv_name(kv),
        if b_changes.is_empty() {
            "= arm A (same-arm control)".to_string()
        } else {
            format!("= arm A with {}", b_changes.join(", "))
        },
        a.r#gen,
        a.bar * 100.0
    );
    if probing {
        let names: Vec<&str> = a.probe.iter().map(|v| v.name()).collect();
        println!(
            "probe arm = arm A with {}; probe bar: B's share at least the probe's less {} points",
            names.join(", "),
            a.probe_margin
        );
    }
    println!(
        "| prompt tokens | agree | share | A's own greedy | max abs logit diff | verdict | seed | probe agree |"
    );
    println!("|---:|---:|---:|---:|---:|---|---:|---:|");
    let t0 = Instant::now();
    let mut results: Vec<(Agreement, Option<Agreement>, bool)> = Vec::new();
    let mut report = |i: usize, arms: &[Option<Agreement>; 2]| {
        let (len, seed) = specs[i];
        let r = arms[0].clone().expect("arm B ran");
        let p = arms[1].clone();
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
    // The arms by backend, arm A's first: an arm equal to A (the control,
    // or a probe without variants) shares its backend.
    let mut phases: Vec<(&Arm, Vec<usize>)> = vec![(&arm_a, Vec::new())];
    for (k, arm) in std::iter::once(&arm_b).chain(&arm_p).enumerate() {
        match phases.iter_mut().find(|(x, _)| *x == arm) {
            Some((_, ks)) => ks.push(k),
            None => phases.push((arm, vec![k])),
        }
    }
    let mut runs = Runs {
        model: &model,
        prompts: &prompts,
        r#gen: a.r#gen,
        kv: [kv, kv_b, kv],
        reference: vec![Vec::new(); prompts.len()],
        rows_a: vec![Vec::new(); prompts.len()],
        agreements: vec![[None, None]; prompts.len()],
    };
    let mut chunk = None;
    for (n, (arm, ks)) in phases.iter().enumerate() {
        let mut names: Vec<&str> = if n == 0 { vec!["arm A"] } else { Vec::new() };
        names.extend(ks.iter().map(|&k| ["arm B", "the probe"][k]));
        eprintln!(
            "running {} on {} prompts",
            names.join(" and "),
            prompts.len()
        );
        let backend = arm.open(&model)?;
        // Every arm runs arm A's chunk (A's backend's default without --chunk).
        let chunk = *chunk.get_or_insert_with(|| a.chunk.or_default(&backend));
        let last = n + 1 == phases.len();
        let with_a = n == 0;
        with_backend!(&backend, |b| runs.phase(
            b,
            with_a,
            ks,
            chunk,
            last,
            &mut report
        ))?;
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
