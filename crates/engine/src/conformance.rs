//! Conformance bodies written once against [`Backend`] and run on every
//! backend: [`conformance_tests!`](crate::conformance_tests) instantiates
//! them as tests, one per body and tiny architecture, for the backend an
//! expression makes (the CPU's in `crates/engine/tests/conformance.rs`, the
//! CUDA backend's in `crates/cuda/tests/gpu`).
//!
//! The bodies: every block op obeys the row contract (one m-row call equals
//! m one-row calls byte for byte, for many m, on fresh random inputs, into
//! NaN-poisoned outputs), batched prefill equals replay (logits at every
//! position, the state after the prompt, greedy tokens after it), sequences
//! batched together equal each alone, and the Hugging Face fixtures'
//! logits within 1e-4 of transformers'.

use crate::backend::{Backend, Norm};
use crate::forward::{Logits, Segment, forward, forward_batch};
use crate::identity;
use crate::model::Model;
use crate::model::weights::Mixer;
use crate::state::KvType;
use samesum_quant::rng::Rng;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

pub use samesum_gguf::GgmlType;

/// Row counts the row contract is checked at: 1, small odd and even
/// counts, and counts on both sides of 16, 64 and 256.
pub const MS: &[usize] = &[1, 2, 3, 5, 16, 17, 64, 100, 257];

/// The weight types the row contract is checked on unless the suite names
/// its backend's own: every format the CPU runs.
pub const ROW_CONTRACT_TYPES: &[GgmlType] = samesum_quant::dot::DOT_FORMATS;

/// The weight types batched prefill is checked against replay on.
pub const PREFILL_TYPES: [GgmlType; 3] = [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::F32];

/// Prompt length of the prefill check: more than two key tiles of 128.
pub const PREFILL_TOKENS: usize = 300;

/// Chunk sizes of the prefill check: uneven (7), even (64, 128: the last
/// chunk short), and the whole prompt in one call.
pub const PREFILL_CHUNKS: [usize; 4] = [7, 64, 128, PREFILL_TOKENS];

/// Greedy tokens generated after the prompt in the prefill check.
pub const PREFILL_GEN: usize = 16;

/// Largest relative logit error against transformers: max |logit - ref| <=
/// `HF_BAR` * max |ref| at every position of every fixture prompt (f32
/// weights, f32 KV cache).
pub const HF_BAR: f32 = 1e-4;

/// The bar with the f16 KV cache (`--kv-type f16`), as docs/CAPABILITIES.md
/// sets it: llama.cpp's f16 cache measures about 1.3e-3 on such models.
pub const HF_BAR_F16_KV: f32 = 2e-3;

/// Writes a synthetic model of a shape (a `samesum_synth` shape name), a
/// weight type and a seed to a path. [`conformance_tests!`](crate::conformance_tests)
/// passes one that calls `samesum_synth` (the engine does not depend on it).
pub type WriteSynth = fn(shape: &str, quant: GgmlType, seed: u64, path: &Path);

/// The conformance bodies for one tiny architecture (`shape`) on the
/// backend `make` builds for a model (`None`: the backend cannot start
/// here, and each body returns after saying it skipped).
pub struct Suite<B, F> {
    shape: &'static str,
    write: WriteSynth,
    make: F,
    formats: &'static [GgmlType],
    backend: PhantomData<fn() -> B>,
}

impl<B: Backend, F: Fn(&Model) -> Option<B>> Suite<B, F> {
    /// The suite of `shape` with models written by `write` and backends
    /// made by `make`.
    pub fn new(shape: &'static str, write: WriteSynth, make: F) -> Self {
        Suite {
            shape,
            write,
            make,
            formats: ROW_CONTRACT_TYPES,
            backend: PhantomData,
        }
    }

    /// The suite with the row contract checked on `formats` (the weight
    /// formats the backend runs) in place of [`ROW_CONTRACT_TYPES`].
    pub fn with_formats(mut self, formats: &'static [GgmlType]) -> Self {
        self.formats = formats;
        self
    }

    /// The synthetic model of this shape in `quant`, weights from `seed`
    /// (written to a temporary file, mapped, and the file unlinked).
    fn model(&self, quant: GgmlType, seed: u64) -> Model {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "samesum-conformance-{}-{}-{}.gguf",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
            self.shape
        ));
        (self.write)(self.shape, quant, seed, &path);
        let model = Model::load(&path);
        let _ = std::fs::remove_file(&path);
        model.unwrap_or_else(|e| panic!("{}: loading the synthetic model: {e}", self.shape))
    }

    /// The backend for `model`, or `None` after saying the body skipped.
    fn backend(&self, model: &Model) -> Option<B> {
        let b = (self.make)(model);
        if b.is_none() {
            eprintln!("skipped: {}: the backend did not start", self.shape);
        }
        b
    }

    /// Every block op obeys the row contract ([`block_ops_match`]) for
    /// every m of [`MS`], with weights of each of the suite's formats
    /// (by default [`ROW_CONTRACT_TYPES`]: all uniform synthetic files).
    pub fn block_ops_obey_the_row_contract(&self) {
        for &quant in self.formats {
            let model = self.model(quant, 9);
            let Some(b) = self.backend(&model) else {
                return;
            };
            if let Err(e) = block_ops_match(&b, &model, MS, 77) {
                panic!("{} {quant}: {e}", self.shape);
            }
        }
    }

    /// Batched prefill equals replay ([`identity::batched`] against
    /// [`identity::replay`]): every position's logits, the state after the
    /// prompt and [`PREFILL_GEN`] greedy tokens after it, byte for byte,
    /// for a prompt of [`PREFILL_TOKENS`] random tokens in chunks of each
    /// of [`PREFILL_CHUNKS`], with weights of each of [`PREFILL_TYPES`] and
    /// an f32 KV cache; and with an f16 KV cache on the first type.
    pub fn batched_prefill_equals_replay(&self) {
        for (i, quant) in PREFILL_TYPES.into_iter().enumerate() {
            let model = self.model(quant, 11);
            let Some(b) = self.backend(&model) else {
                return;
            };
            let mut rng = Rng::new(8);
            let toks: Vec<u32> = (0..PREFILL_TOKENS)
                .map(|_| rng.below(model.w.n_vocab as u64) as u32)
                .collect();
            let kvs: &[KvType] = if i == 0 {
                &[KvType::F32, KvType::F16]
            } else {
                &[KvType::F32]
            };
            for &kv in kvs {
                let r = identity::replay(&b, &model, &toks, PREFILL_GEN, kv).expect("replay");
                for chunk in PREFILL_CHUNKS {
                    let v = identity::batched(&b, &model, &toks, chunk, PREFILL_GEN, kv, &r)
                        .expect("batched");
                    assert!(
                        v.valid() && v.equal(),
                        "{} {quant} kv {kv:?} chunk {chunk}: batched differs from replay: {v:?}",
                        self.shape
                    );
                }
            }
        }
    }

    /// Several sequences in one forward call ([`forward_batch`], what the
    /// server's continuous batching runs) get the same logits bytes and
    /// states as each sequence alone, whatever the mix of prefill chunks
    /// and decode rows in a step.
    pub fn sequences_batched_together_equal_each_alone(&self) {
        let model = self.model(GgmlType::Q4_K, 4);
        let Some(b) = self.backend(&model) else {
            return;
        };
        let shape = self.shape;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut rng = Rng::new(17);
        let v = model.w.n_vocab as u64;
        // Three sequences, fed in steps of different sizes (a prefill chunk
        // beside decode rows, a sequence idle in a step, a decode row of
        // each: the backends' one-launch decode step).
        let steps: [[usize; 3]; 8] = [
            [9, 1, 0],
            [1, 30, 2],
            [1, 1, 1],
            [1, 1, 17],
            [0, 1, 1],
            [1, 1, 1],
            [5, 1, 1],
            [1, 1, 1],
        ];
        let toks: Vec<Vec<u32>> = (0..3)
            .map(|i| {
                let n: usize = steps.iter().map(|s| s[i]).sum();
                (0..n).map(|_| rng.below(v) as u32).collect()
            })
            .collect();
        let state = || b.new_state(&model, 64, KvType::F32).expect("state");
        let mut together: Vec<_> = (0..3).map(|_| state()).collect();
        let mut alone: Vec<_> = (0..3).map(|_| state()).collect();
        let mut at = [0usize; 3];
        for (k, step) in steps.iter().enumerate() {
            let want = if k % 2 == 0 {
                Logits::All
            } else {
                Logits::Last
            };
            let mut segs: Vec<Segment<'_, _>> = together
                .iter_mut()
                .enumerate()
                .map(|(i, st)| Segment {
                    state: st,
                    tokens: &toks[i][at[i]..at[i] + step[i]],
                    want,
                })
                .collect();
            let got = forward_batch(&model, &b, &mut segs).expect("forward_batch");
            for i in 0..3 {
                let tokens = &toks[i][at[i]..at[i] + step[i]];
                let one = forward(&model, &b, &mut alone[i], tokens, want).expect("forward");
                assert_eq!(
                    bits(&got[i]),
                    bits(&one),
                    "{shape}: step {k}, sequence {i}: batched with others differs from alone"
                );
                at[i] += step[i];
            }
        }
        for i in 0..3 {
            assert_eq!(
                bits(&b.download_state(&together[i]).expect("state")),
                bits(&b.download_state(&alone[i]).expect("state")),
                "{shape}: state of sequence {i}"
            );
        }
    }

    /// The Hugging Face fixtures of this architecture
    /// (`tests/conformance/fixtures`: tiny random-weight models run in f32
    /// by transformers, converted by llama.cpp's converter) within
    /// [`HF_BAR`] of transformers' logits at every position of every
    /// prompt (qwen3moe-yarn: with YaRN rope scaling); and, for qwen3next,
    /// the converter's q8_0 file loads and
    /// gives finite logits.
    pub fn matches_transformers(&self) {
        let dir = fixtures_dir();
        let names: &[&str] = match self.shape {
            "tiny-qwen3moe" => &["qwen3moe", "qwen3moe-tied", "qwen3moe-yarn"],
            "tiny-qwen3next" => &["qwen3next"],
            "tiny-qwen35moe" => &["qwen35moe"],
            other => panic!("no Hugging Face fixture for {other}"),
        };
        for name in names {
            let model = Model::load(dir.join(format!("{name}.gguf"))).expect("fixture");
            match *name {
                "qwen3moe-tied" => assert!(
                    !model.file.has_tensor("output.weight"),
                    "{name}: the fixture must tie its output to the embeddings"
                ),
                "qwen3moe-yarn" => assert!(
                    matches!(
                        model.hp.rope_scaling,
                        crate::model::RopeScaling::Yarn {
                            factor: 4.0,
                            orig_ctx: 64,
                            ..
                        }
                    ),
                    "{name}: the fixture must declare YaRN x4 over 64 positions, found {:?}",
                    model.hp.rope_scaling
                ),
                "qwen3next" | "qwen35moe" => {
                    let s = model.hp.ssm.expect("a hybrid fixture");
                    assert_eq!(
                        s.n_v_heads / s.n_k_heads,
                        2,
                        "{name}: the fixture must have 2 value heads per key head"
                    );
                }
                _ => {}
            }
            let Some(b) = self.backend(&model) else {
                return;
            };
            let json = std::fs::read_to_string(dir.join(format!("{name}.json"))).expect("manifest");
            let worst = fixture_error(&b, &model, &json, &dir.join(format!("{name}.logits")))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            eprintln!("{name}: max|diff|/max|ref| = {worst:.2e} (bar {HF_BAR:e})");
            assert!(
                worst <= HF_BAR,
                "{name}: max|diff|/max|ref| = {worst:.3e} > {HF_BAR:e}"
            );
            // The f16 KV cache against its own bar.
            let worst16 = fixture_error_kv(
                &b,
                &model,
                &json,
                &dir.join(format!("{name}.logits")),
                KvType::F16,
            )
            .unwrap_or_else(|e| panic!("{name}, f16 KV: {e}"));
            eprintln!(
                "{name}, f16 KV cache: max|diff|/max|ref| = {worst16:.2e} (bar {HF_BAR_F16_KV:e})"
            );
            assert!(
                worst16 <= HF_BAR_F16_KV,
                "{name}, f16 KV cache: max|diff|/max|ref| = {worst16:.3e} > {HF_BAR_F16_KV:e}"
            );
        }
        if self.shape == "tiny-qwen3next" {
            let model = Model::load(dir.join("qwen3next-q8_0.gguf")).expect("fixture");
            assert!(
                model
                    .file
                    .tensors()
                    .iter()
                    .any(|t| t.ggml_type == GgmlType::Q8_0),
                "qwen3next-q8_0: no q8_0 tensor"
            );
            let Some(b) = self.backend(&model) else {
                return;
            };
            let mut st = b.new_state(&model, 64, KvType::F32).expect("state");
            let logits =
                forward(&model, &b, &mut st, &[5, 17, 42, 99, 3], Logits::All).expect("forward");
            assert_eq!(logits.len(), 5 * model.w.n_vocab);
            assert!(
                logits.iter().all(|x| x.is_finite()),
                "qwen3next-q8_0: non-finite logits"
            );
        }
    }
}

/// `tests/conformance/fixtures` of the source tree this was built from, or
/// of the current directory (a test binary run from a copy of the
/// repository's root, e.g. on a GPU machine).
pub fn fixtures_dir() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/conformance/fixtures");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/conformance/fixtures")
    }
}

/// The largest max |logit - ref| / max |ref| over the prompts of a Hugging
/// Face fixture (`manifest`: its JSON; `logits`: the reference, f32
/// little-endian, every position of every prompt), each prompt run alone
/// from a fresh state with an f32 KV cache.
pub fn fixture_error<B: Backend>(
    b: &B,
    model: &Model,
    manifest: &str,
    logits: &Path,
) -> Result<f32, String> {
    fixture_error_kv(b, model, manifest, logits, KvType::F32)
}

/// [`fixture_error`] with a KV cache of type `kv`.
pub fn fixture_error_kv<B: Backend>(
    b: &B,
    model: &Model,
    manifest: &str,
    logits: &Path,
    kv: KvType,
) -> Result<f32, String> {
    let ps = fixture_prompts(manifest);
    if ps.len() < 4 || !ps.iter().any(|p| p.len() > 64) {
        return Err(format!("too few or too short prompts: {ps:?}"));
    }
    let raw = std::fs::read(logits).map_err(|e| format!("{}: {e}", logits.display()))?;
    let reference: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let v = model.w.n_vocab;
    let (mut off, mut worst) = (0, 0f32);
    for p in &ps {
        let want = reference
            .get(off..off + p.len() * v)
            .ok_or("the logits file is shorter than its prompts")?;
        off += p.len() * v;
        let mut st = b.new_state(model, p.len(), kv).map_err(|e| e.to_string())?;
        let got = forward(model, b, &mut st, p, Logits::All).map_err(|e| e.to_string())?;
        let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let mut max_diff = 0f32;
        for (pos, (g, w)) in got.chunks(v).zip(want.chunks(v)).enumerate() {
            for (a, r) in g.iter().zip(w) {
                if !a.is_finite() {
                    return Err(format!("non-finite logit at position {pos}"));
                }
                max_diff = max_diff.max((a - r).abs());
            }
        }
        worst = worst.max(max_diff / max_ref);
    }
    if off != reference.len() {
        return Err(format!(
            "the logits file holds {} values, its prompts {off}",
            reference.len()
        ));
    }
    Ok(worst)
}

/// Where two runs first differ.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    /// Token position.
    pub position: usize,
    /// Largest |a - b| at that position.
    pub max_abs_diff: f32,
}

/// Run `tokens` twice on fresh states: once in chunks of `chunk` rows, once one
/// token per call (replay), both asking for every position's logits, and compare
/// the bytes, then the states after the last token. `Ok` means identical at
/// every position and the same state (a state that differs is reported at
/// the position after the last token).
pub fn forward_rows_match<B: Backend>(
    b: &B,
    model: &Model,
    tokens: &[u32],
    chunk: usize,
) -> Result<(), Divergence> {
    let v = model.w.n_vocab;
    let ctx = tokens.len().max(1);
    let mut batched_st = b.new_state(model, ctx, KvType::F32).expect("state");
    let pieces: Vec<&[u32]> = tokens.chunks(chunk.max(1)).collect();
    let batched =
        crate::forward::forward_chunks(model, b, &mut batched_st, &pieces, |_| Logits::All)
            .expect("forward");
    let mut st = b.new_state(model, ctx, KvType::F32).expect("state");
    let first_diff = |p: usize, a: &[f32], b: &[f32]| -> Result<(), Divergence> {
        if a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) {
            return Ok(());
        }
        let max_abs_diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        Err(Divergence {
            position: p,
            max_abs_diff,
        })
    };
    for (p, &t) in tokens.iter().enumerate() {
        let one = forward(model, b, &mut st, &[t], Logits::All).expect("forward");
        first_diff(p, &one, &batched[p * v..(p + 1) * v])?;
    }
    first_diff(
        tokens.len(),
        &b.download_state(&st).expect("state"),
        &b.download_state(&batched_st).expect("state"),
    )
}

/// Check every block op of `model` (embedding, both norms of every layer, every
/// layer's mixer with its state, every MoE, the final norm and head): for each
/// `m` in `ms`, one m-row call equals m one-row calls byte for byte (the mixers
/// carrying their state from row to row), on fresh random inputs drawn from
/// `seed`, with every output buffer poisoned with NaN before the call.
pub fn block_ops_match<B: Backend>(
    b: &B,
    model: &Model,
    ms: &[usize],
    seed: u64,
) -> Result<(), String> {
    let d = model.hp.n_embd;
    let mut rng = samesum_quant::rng::Rng::new(seed);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let e = |e: crate::EngineError| e.to_string();
    let nan = |n: usize| b.upload(&vec![f32::NAN; n]).map_err(e);
    let ctx = ms.iter().copied().max().unwrap_or(1);
    let check = |what: String, all: &[f32], rows: &[Vec<f32>]| -> Result<(), String> {
        let w = all.len() / rows.len().max(1);
        for (r, one) in rows.iter().enumerate() {
            if bits(one) != bits(&all[r * w..(r + 1) * w]) {
                return Err(format!(
                    "{what}: row {r} of {} differs from its one-row call",
                    rows.len()
                ));
            }
            if one.iter().any(|v| v.is_nan()) {
                return Err(format!("{what}: row {r} left unwritten (NaN)"));
            }
        }
        Ok(())
    };
    for &m in ms {
        let x: Vec<f32> = (0..m * d).map(|_| rng.range(-2.0, 2.0)).collect();
        let xb = b.upload(&x).map_err(e)?;
        let row = |r: usize| b.upload(&x[r * d..(r + 1) * d]).map_err(e);
        // Embedding.
        let toks: Vec<u32> = (0..m)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        let mut all = nan(m * d)?;
        b.embed(model, &toks, &mut all).map_err(e)?;
        let ones = toks
            .iter()
            .map(|&t| {
                let mut o = nan(d)?;
                b.embed(model, &[t], &mut o).map_err(e)?;
                b.download(&o).map_err(e)
            })
            .collect::<Result<Vec<_>, String>>()?;
        check(format!("embed m={m}"), &b.download(&all).map_err(e)?, &ones)?;
        for (l, lw) in model.w.layers.iter().enumerate() {
            for norm in [Norm::Attn(l), Norm::Ffn(l)] {
                let mut all = nan(m * d)?;
                b.rms_norm(model, norm, &xb, &mut all).map_err(e)?;
                let ones = (0..m)
                    .map(|r| {
                        let mut o = nan(d)?;
                        b.rms_norm(model, norm, &row(r)?, &mut o).map_err(e)?;
                        b.download(&o).map_err(e)
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                check(
                    format!("{norm:?} m={m}"),
                    &b.download(&all).map_err(e)?,
                    &ones,
                )?;
            }
            // The residual add fused with a norm: row-invariant, and
            // byte-equal to `add` then `rms_norm`.
            {
                let inc: Vec<f32> = (0..m * d).map(|_| rng.range(-2.0, 2.0)).collect();
                let incb = b.upload(&inc).map_err(e)?;
                let mut acc = b.upload(&x).map_err(e)?;
                let mut all = nan(m * d)?;
                b.add_rms_norm(model, Norm::Attn(l), &mut acc, &incb, &mut all)
                    .map_err(e)?;
                let (all, acc) = (b.download(&all).map_err(e)?, b.download(&acc).map_err(e)?);
                let mut ones = Vec::with_capacity(m);
                let mut accs = Vec::with_capacity(m);
                for r in 0..m {
                    let mut a1 = row(r)?;
                    let i1 = b.upload(&inc[r * d..(r + 1) * d]).map_err(e)?;
                    let mut o = nan(d)?;
                    b.add_rms_norm(model, Norm::Attn(l), &mut a1, &i1, &mut o)
                        .map_err(e)?;
                    ones.push(b.download(&o).map_err(e)?);
                    accs.push(b.download(&a1).map_err(e)?);
                }
                check(format!("add_rms_norm m={m}"), &all, &ones)?;
                check(format!("add_rms_norm sum m={m}"), &acc, &accs)?;
                let mut acc2 = b.upload(&x).map_err(e)?;
                let mut sep = nan(m * d)?;
                b.add(&mut acc2, &incb).map_err(e)?;
                b.rms_norm(model, Norm::Attn(l), &acc2, &mut sep)
                    .map_err(e)?;
                if bits(&b.download(&sep).map_err(e)?) != bits(&all)
                    || bits(&b.download(&acc2).map_err(e)?) != bits(&acc)
                {
                    return Err(format!(
                        "add_rms_norm m={m}: differs from add then rms_norm"
                    ));
                }
            }
            // The mixer, with its state.
            let mut st_all = b.new_state(model, ctx, KvType::F32).map_err(e)?;
            let mut all = nan(m * d)?;
            let mut st_one = b.new_state(model, ctx, KvType::F32).map_err(e)?;
            let mut ones = Vec::with_capacity(m);
            match &lw.mixer {
                Mixer::Attention(a) => {
                    b.attention(model, l, a, &xb, &mut st_all, &mut all)
                        .map_err(e)?;
                    for r in 0..m {
                        let mut o = nan(d)?;
                        b.attention(model, l, a, &row(r)?, &mut st_one, &mut o)
                            .map_err(e)?;
                        b.advance(&mut st_one, 1);
                        ones.push(b.download(&o).map_err(e)?);
                    }
                }
                Mixer::Linear(dn) => {
                    b.delta_net(model, l, dn, &xb, &mut st_all, &mut all)
                        .map_err(e)?;
                    for r in 0..m {
                        let mut o = nan(d)?;
                        b.delta_net(model, l, dn, &row(r)?, &mut st_one, &mut o)
                            .map_err(e)?;
                        b.advance(&mut st_one, 1);
                        ones.push(b.download(&o).map_err(e)?);
                    }
                }
            }
            check(
                format!("layer {l} mixer m={m}"),
                &b.download(&all).map_err(e)?,
                &ones,
            )?;
            // The MoE.
            let mut all = nan(m * d)?;
            b.moe(model, &lw.moe, &xb, &mut all).map_err(e)?;
            let ones = (0..m)
                .map(|r| {
                    let mut o = nan(d)?;
                    b.moe(model, &lw.moe, &row(r)?, &mut o).map_err(e)?;
                    b.download(&o).map_err(e)
                })
                .collect::<Result<Vec<_>, String>>()?;
            check(
                format!("layer {l} moe m={m}"),
                &b.download(&all).map_err(e)?,
                &ones,
            )?;
            // The MoE fused with the residual add and the next norm:
            // row-invariant in both outputs (the residual and the normed
            // rows), and byte-equal to the calls it stands for. `y` is
            // scratch.
            let next = Norm::Attn(l);
            let h: Vec<f32> = (0..m * d).map(|_| rng.range(-2.0, 2.0)).collect();
            let moe_norm = |h: &[f32], x: &[f32]| -> Result<[Vec<f32>; 2], String> {
                let (mut hb, mut xb) = (b.upload(h).map_err(e)?, b.upload(x).map_err(e)?);
                let mut yb = nan(x.len())?;
                b.moe_add_rms_norm(model, &lw.moe, next, &mut hb, &mut xb, &mut yb)
                    .map_err(e)?;
                Ok([b.download(&hb).map_err(e)?, b.download(&xb).map_err(e)?])
            };
            let moe_norm_apart = |h: &[f32], x: &[f32]| -> Result<[Vec<f32>; 2], String> {
                let (mut hb, xb) = (b.upload(h).map_err(e)?, b.upload(x).map_err(e)?);
                let (mut yb, mut out) = (nan(x.len())?, nan(x.len())?);
                b.moe(model, &lw.moe, &xb, &mut yb).map_err(e)?;
                b.add_rms_norm(model, next, &mut hb, &yb, &mut out)
                    .map_err(e)?;
                Ok([b.download(&hb).map_err(e)?, b.download(&out).map_err(e)?])
            };
            type Fused<'a> = &'a dyn Fn(&[f32], &[f32]) -> Result<[Vec<f32>; 2], String>;
            let fused: [(&str, Fused<'_>, Fused<'_>); 1] =
                [("moe_add_rms_norm", &moe_norm, &moe_norm_apart)];
            for (name, op, apart) in fused {
                let [h_all, x_all] = op(&h, &x)?;
                let mut ones = [Vec::with_capacity(m), Vec::with_capacity(m)];
                for r in 0..m {
                    let rows = op(&h[r * d..(r + 1) * d], &x[r * d..(r + 1) * d])?;
                    for (o, one) in ones.iter_mut().zip(rows) {
                        o.push(one);
                    }
                }
                check(format!("layer {l} {name} sum m={m}"), &h_all, &ones[0])?;
                check(format!("layer {l} {name} m={m}"), &x_all, &ones[1])?;
                if [h_all, x_all].map(|v| bits(&v)) != apart(&h, &x)?.map(|v| bits(&v)) {
                    return Err(format!(
                        "layer {l} {name} m={m}: differs from the calls it stands for"
                    ));
                }
            }
        }
        // Final norm and head.
        let rows: Vec<usize> = (0..m).collect();
        let all = b.logits(model, &xb, &rows).map_err(e)?;
        let ones = (0..m)
            .map(|r| b.logits(model, &row(r)?, &[0]).map_err(e))
            .collect::<Result<Vec<_>, String>>()?;
        check(format!("logits m={m}"), &all, &ones)?;
    }
    Ok(())
}

/// The prompts of a Hugging Face fixture's manifest (`"prompts": [[ids], ...]`;
/// a small hand parser, so the engine needs no JSON dependency).
pub fn fixture_prompts(json: &str) -> Vec<Vec<u32>> {
    let Some(start) = json.find("\"prompts\"") else {
        return Vec::new();
    };
    let body = &json[start + "\"prompts\"".len()..];
    let Some(open) = body.find('[') else {
        return Vec::new();
    };
    let (mut depth, mut end) = (0, open);
    for (i, c) in body[open..].char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth == 0 {
                    end = open + i;
                    break;
                }
            }
            _ => {}
        }
    }
    body[open + 1..end]
        .split(']')
        .filter_map(|p| {
            let p = p
                .trim_start_matches([',', ' ', '\n'])
                .trim_start_matches('[');
            let v: Vec<u32> = p.split(',').filter_map(|t| t.trim().parse().ok()).collect();
            (!v.is_empty()).then_some(v)
        })
        .collect()
}

/// Instantiate the conformance bodies ([`Suite`]) as tests for one backend:
/// a module per tiny architecture (`tiny_qwen3moe`, `tiny_qwen3next`,
/// `tiny_qwen35moe`), each with one `#[test]` per body
/// (`block_ops_obey_the_row_contract`, `batched_prefill_equals_replay`,
/// `sequences_batched_together_equal_each_alone`, `matches_transformers`).
///
/// Takes the outer attributes to put on every test (e.g. `#[ignore = "..."]`
/// for tests that need a device), then `backend =` an expression of type
/// `impl Fn(&Model) -> Option<B>` where `B: Backend`: it makes the backend
/// for a model, or gives `None` when the backend cannot start here (the
/// test then says so and passes); optionally `, formats =` the weight
/// formats the backend runs (a `&'static [GgmlType]`; default
/// [`ROW_CONTRACT_TYPES`]), on which the row contract is checked. The generated modules glob-import their
/// parent, so the expression may use the calling module's imports and
/// functions. The calling crate needs `samesum-synth` as a (dev-)dependency,
/// which writes the synthetic models.
///
/// ```ignore
/// // crates/engine/tests/conformance.rs
/// use samesum_engine::cpu::Cpu;
/// samesum_engine::conformance_tests! {
///     backend = |_model| Some(Cpu::new(2))
/// }
///
/// // a GPU test crate: the tests run with `-- --include-ignored`
/// use samesum_cuda::Cuda;
/// samesum_engine::conformance_tests! {
///     #[ignore = "needs a CUDA device"]
///     backend = |model| Some(Cuda::new(0, model, false).unwrap()),
///     formats = samesum_cuda::FORMATS
/// }
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($(#[$attr:meta])* backend = $make:expr $(;)?) => {
        $crate::conformance_tests!(
            $(#[$attr])* backend = $make, formats = $crate::conformance::ROW_CONTRACT_TYPES
        );
    };
    ($(#[$attr:meta])* backend = $make:expr, formats = $formats:expr $(;)?) => {
        $crate::conformance_tests!(@shape tiny_qwen3moe, "tiny-qwen3moe", [$(#[$attr])*], ($make, $formats));
        $crate::conformance_tests!(@shape tiny_qwen3next, "tiny-qwen3next", [$(#[$attr])*], ($make, $formats));
        $crate::conformance_tests!(@shape tiny_qwen35moe, "tiny-qwen35moe", [$(#[$attr])*], ($make, $formats));
    };
    (@shape $module:ident, $shape:literal, $attrs:tt, $mf:tt) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            fn write_synth(
                shape: &str,
                quant: $crate::conformance::GgmlType,
                seed: u64,
                path: &::std::path::Path,
            ) {
                let shape = ::samesum_synth::shapes::by_name(shape).expect("a synthetic shape");
                ::samesum_synth::write_model(
                    &::samesum_synth::SynthOptions::new(shape, quant, seed),
                    path,
                    &mut |_, _| {},
                )
                .expect("writing a synthetic model");
            }

            $crate::conformance_tests!(@test $attrs, $shape, $mf, block_ops_obey_the_row_contract);
            $crate::conformance_tests!(@test $attrs, $shape, $mf, batched_prefill_equals_replay);
            $crate::conformance_tests!(@test $attrs, $shape, $mf, sequences_batched_together_equal_each_alone);
            $crate::conformance_tests!(@test $attrs, $shape, $mf, matches_transformers);
        }
    };
    (@test [$(#[$attr:meta])*], $shape:literal, ($make:expr, $formats:expr), $body:ident) => {
        $(#[$attr])*
        #[test]
        fn $body() {
            $crate::conformance::Suite::new($shape, write_synth, $make)
                .with_formats($formats)
                .$body();
        }
    };
}
