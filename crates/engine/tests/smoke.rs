//! The forward pass runs on synthetic models of all three architectures, and the
//! m-row call gives the same bytes as m one-row calls (the row contract, end to end).

use samesum_engine::{KvType, Logits, Model, SeqState, cpu::Cpu, forward};
use samesum_gguf::GgmlType;
use samesum_synth::{SynthOptions, shapes, write_model};

fn model(shape: &str, q: GgmlType) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    write_model(
        &SynthOptions::new(shapes::by_name(shape).unwrap(), q, 5),
        &p,
        &mut |_, _| {},
    )
    .unwrap();
    let m = Model::load(&p).unwrap();
    (dir, m)
}

#[test]
fn batched_rows_equal_one_row_calls() {
    let tokens: Vec<u32> = (0..13).map(|i| (i * 37 + 11) % 500).collect();
    for shape in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
        for q in [GgmlType::Q4_K, GgmlType::F32] {
            let (_d, m) = model(shape, q);
            let v = m.w.n_vocab;
            for threads in [1, 2] {
                let cpu = Cpu::new(threads);
                let mut a = SeqState::new(&m.hp, 64, KvType::F32);
                let all = forward(&m, &cpu, &mut a, &tokens, Logits::All).unwrap();
                assert!(
                    all.iter().all(|x| x.is_finite()),
                    "{shape} {q}: non-finite logits"
                );
                let mut b = SeqState::new(&m.hp, 64, KvType::F32);
                for (i, &t) in tokens.iter().enumerate() {
                    let one = forward(&m, &cpu, &mut b, &[t], Logits::All).unwrap();
                    let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&one),
                        bits(&all[i * v..(i + 1) * v]),
                        "{shape} {q} t={threads}: row {i}"
                    );
                }
                assert_eq!(a.pos, b.pos);
                for (x, y) in a.linear.iter().zip(&b.linear) {
                    assert_eq!(x, y, "{shape}: delta-net state differs");
                }
            }
        }
    }
}
