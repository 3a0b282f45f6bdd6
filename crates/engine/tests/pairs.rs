//! Two chunks of one prompt as a wavefront (`forward_pair`: the second
//! chunk's layer l after the first chunk's layer l, and before the first
//! chunk's later layers) give the same logits bytes and state as the two
//! chunks one after the other, on all three architectures. The CPU backend
//! with lanes runs each op when it is issued, so this checks the order the
//! GPU's two streams are held to; the misordered control (the second chunk's
//! layer first) must differ, so the comparison can fail.

mod common;

use samesum_engine::backend::Backend;
use samesum_engine::cpu::Cpu;
use samesum_engine::{
    KvType, Logits, Model, forward, forward_pair, forward_pair_misordered, prefill,
};
use samesum_gguf::GgmlType;
use samesum_quant::rng::Rng;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn model(shape: &str) -> (tempfile::TempDir, Model) {
    common::synth_model(shape, GgmlType::Q4_K, 6)
}

/// Every row's logits of `toks` in chunks of `chunk`, pairs through `pair`,
/// and the state after.
fn run_pairs(
    cpu: &Cpu,
    model: &Model,
    toks: &[u32],
    chunk: usize,
    misordered: bool,
) -> (Vec<f32>, Vec<f32>) {
    let mut st = cpu.new_state(model, toks.len(), KvType::F32).unwrap();
    let mut out = Vec::new();
    let pieces: Vec<&[u32]> = toks.chunks(chunk).collect();
    for pair in pieces.chunks(2) {
        match *pair {
            [a, b] => {
                let f = if misordered {
                    forward_pair_misordered
                } else {
                    forward_pair
                };
                let [x, y] = f(model, cpu, &mut st, a, b, [Logits::All; 2]).unwrap();
                out.extend(x);
                out.extend(y);
            }
            [a] => out.extend(forward(model, cpu, &mut st, a, Logits::All).unwrap()),
            _ => unreachable!(),
        }
    }
    (out, cpu.download_state(&st).unwrap())
}

#[test]
fn chunk_pairs_in_wavefront_order_equal_one_chunk_after_another() {
    for shape in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
        let (_d, model) = model(shape);
        let (one, laned) = (Cpu::new(2), Cpu::new(2).with_lanes());
        assert_eq!((one.lanes(), laned.lanes()), (1, 2));
        let mut rng = Rng::new(23);
        let toks: Vec<u32> = (0..45)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        // Even and odd chunk counts, and a short last chunk.
        for chunk in [9usize, 15, 20] {
            let mut st = one.new_state(&model, toks.len(), KvType::F32).unwrap();
            let mut serial = Vec::new();
            for c in toks.chunks(chunk) {
                serial.extend(forward(&model, &one, &mut st, c, Logits::All).unwrap());
            }
            let serial_state = one.download_state(&st).unwrap();
            let (paired, state) = run_pairs(&laned, &model, &toks, chunk, false);
            assert_eq!(
                bits(&paired),
                bits(&serial),
                "{shape} chunk {chunk}: the wavefront's logits differ"
            );
            assert_eq!(
                bits(&state),
                bits(&serial_state),
                "{shape} chunk {chunk}: the wavefront's state differs"
            );
            // The control: the second chunk's layers before the first's.
            let (wrong, _) = run_pairs(&laned, &model, &toks, chunk, true);
            assert_ne!(
                bits(&wrong),
                bits(&serial),
                "{shape} chunk {chunk}: the misordered pair was not caught"
            );
        }
    }
}

#[test]
fn prefill_returns_the_last_chunks_logits_and_leaves_the_same_state() {
    let (_d, model) = model("tiny-qwen35moe");
    let (one, laned) = (Cpu::new(2), Cpu::new(2).with_lanes());
    let mut rng = Rng::new(29);
    let toks: Vec<u32> = (0..50)
        .map(|_| rng.below(model.w.n_vocab as u64) as u32)
        .collect();
    for chunk in [8usize, 10, 50, 64] {
        let mut st = one.new_state(&model, toks.len() + 1, KvType::F32).unwrap();
        let mut last = Vec::new();
        for c in toks.chunks(chunk) {
            last = forward(&model, &one, &mut st, c, Logits::Last).unwrap();
        }
        for b in [&one, &laned] {
            let mut st2 = b.new_state(&model, toks.len() + 1, KvType::F32).unwrap();
            let got = prefill(&model, b, &mut st2, &toks, chunk, Logits::Last).unwrap();
            assert_eq!(bits(&got), bits(&last), "chunk {chunk}: last row's logits");
            assert_eq!(b.position(&st2), toks.len(), "chunk {chunk}: position");
            assert_eq!(
                bits(&b.download_state(&st2).unwrap()),
                bits(&one.download_state(&st).unwrap()),
                "chunk {chunk}: state"
            );
            let none = prefill(
                &model,
                b,
                &mut b.new_state(&model, 64, KvType::F32).unwrap(),
                &toks,
                chunk,
                Logits::None,
            )
            .unwrap();
            assert!(none.is_empty(), "chunk {chunk}: Logits::None returned rows");
        }
    }
}

#[test]
fn a_bad_token_in_the_second_chunk_is_an_error_and_changes_nothing() {
    let (_d, model) = model("tiny-qwen3next");
    let laned = Cpu::new(2).with_lanes();
    let mut rng = Rng::new(31);
    let v = model.w.n_vocab as u64;
    let toks: Vec<u32> = (0..24).map(|_| rng.below(v) as u32).collect();
    let mut bad = toks.clone();
    bad[20] = model.w.n_vocab as u32;
    let mut st = laned.new_state(&model, 64, KvType::F32).unwrap();
    let err = forward_pair(
        &model,
        &laned,
        &mut st,
        &bad[..12],
        &bad[12..],
        [Logits::All; 2],
    )
    .unwrap_err();
    assert!(
        matches!(err, samesum_engine::EngineError::BadToken { .. }),
        "{err:?}"
    );
    assert_eq!(laned.position(&st), 0, "the position moved");
    // The same state then takes the good tokens as a fresh one does.
    let [a, b] = forward_pair(
        &model,
        &laned,
        &mut st,
        &toks[..12],
        &toks[12..],
        [Logits::All; 2],
    )
    .unwrap();
    let mut fresh = laned.new_state(&model, 64, KvType::F32).unwrap();
    let [c, e] = forward_pair(
        &model,
        &laned,
        &mut fresh,
        &toks[..12],
        &toks[12..],
        [Logits::All; 2],
    )
    .unwrap();
    assert_eq!((bits(&a), bits(&b)), (bits(&c), bits(&e)));
    assert_eq!(
        bits(&laned.download_state(&st).unwrap()),
        bits(&laned.download_state(&fresh).unwrap())
    );
}
