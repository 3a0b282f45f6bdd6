//! Conformance against Hugging Face transformers: tiny random-weight models built
//! and run in float32 by transformers, converted to GGUF by llama.cpp's own
//! converter (tests/conformance/make_fixtures.py). Bar: max |logit - ref| <=
//! 1e-4 * max |ref| at every position of every prompt, with f32 weights and an f32
//! KV cache.

use samesum_engine::{KvType, Logits, Model, SeqState, cpu::Cpu, forward};
use std::path::PathBuf;

const BAR: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/conformance/fixtures")
}

fn check(name: &str) -> f32 {
    let dir = fixtures();
    let model = Model::load(dir.join(format!("{name}.gguf"))).unwrap();
    let manifest = std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap();
    let ps = samesum_engine::conformance::fixture_prompts(&manifest);
    assert!(
        ps.len() >= 4 && ps.iter().any(|p| p.len() > 64),
        "{name}: fixture prompts {ps:?}"
    );
    let raw = std::fs::read(dir.join(format!("{name}.logits"))).unwrap();
    let reference: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let v = model.w.n_vocab;
    let cpu = Cpu::new(2);
    let mut off = 0;
    let mut worst = 0f32;
    for p in &ps {
        let mut st = SeqState::new(&model.hp, 256, KvType::F32);
        let got = forward(&model, &cpu, &mut st, p, Logits::All).unwrap();
        let want = &reference[off..off + p.len() * v];
        off += p.len() * v;
        let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let mut max_diff = 0f32;
        for (pos, (g, w)) in got.chunks(v).zip(want.chunks(v)).enumerate() {
            for (a, b) in g.iter().zip(w) {
                assert!(a.is_finite(), "{name}: non-finite logit at position {pos}");
                max_diff = max_diff.max((a - b).abs());
            }
        }
        let rel = max_diff / max_ref;
        eprintln!(
            "{name}: prompt of {:>3} tokens: max|diff| {max_diff:.3e}, max|ref| {max_ref:.3e}, ratio {rel:.2e}",
            p.len()
        );
        worst = worst.max(rel);
    }
    assert_eq!(off, reference.len(), "{name}: logits file size");
    assert!(
        worst <= BAR,
        "{name}: max|diff|/max|ref| = {worst:.3e} > {BAR:e}"
    );
    worst
}

#[test]
fn qwen3moe_matches_transformers() {
    check("qwen3moe");
}

#[test]
fn qwen3moe_with_tied_output_matches_transformers() {
    let m = Model::load(fixtures().join("qwen3moe-tied.gguf")).unwrap();
    assert!(
        !m.file.has_tensor("output.weight"),
        "fixture must tie its output to the embeddings"
    );
    check("qwen3moe-tied");
}

#[test]
fn qwen3next_matches_transformers() {
    let m = Model::load(fixtures().join("qwen3next.gguf")).unwrap();
    let s = m.hp.ssm.unwrap();
    assert_eq!(
        s.n_v_heads / s.n_k_heads,
        2,
        "fixture must have 2 value heads per key head"
    );
    check("qwen3next");
}

#[test]
fn qwen35moe_matches_transformers() {
    let m = Model::load(fixtures().join("qwen35moe.gguf")).unwrap();
    let s = m.hp.ssm.unwrap();
    assert_eq!(
        s.n_v_heads / s.n_k_heads,
        2,
        "fixture must have 2 value heads per key head"
    );
    check("qwen35moe");
}

#[test]
fn q8_0_fixture_from_the_official_converter_loads_and_runs() {
    let model = Model::load(fixtures().join("qwen3next-q8_0.gguf")).unwrap();
    assert!(
        model
            .file
            .tensors()
            .iter()
            .any(|t| t.ggml_type == samesum_gguf::GgmlType::Q8_0)
    );
    let cpu = Cpu::new(1);
    let mut st = SeqState::new(&model.hp, 64, KvType::F32);
    let logits = forward(&model, &cpu, &mut st, &[5, 17, 42, 99, 3], Logits::All).unwrap();
    assert_eq!(logits.len(), 5 * model.w.n_vocab);
    assert!(logits.iter().all(|x| x.is_finite()));
}
