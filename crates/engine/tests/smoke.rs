//! The forward pass runs on synthetic models of all three architectures, and the
//! m-row call gives the same bytes as m one-row calls (the row contract, end to
//! end), at several chunk sizes and thread counts.

use samesum_engine::conformance::forward_rows_match;
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
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 500).collect();
    for shape in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
        for q in [GgmlType::Q4_K, GgmlType::F32] {
            let (_d, m) = model(shape, q);
            for threads in [1, 3] {
                let cpu = Cpu::new(threads);
                for chunk in [1, 7, 16, 40] {
                    if let Err(d) = forward_rows_match(&cpu, &m, &tokens, chunk) {
                        panic!(
                            "{shape} {q} threads={threads} chunk={chunk}: first difference {d:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn state_after_batched_equals_state_after_replay() {
    let tokens: Vec<u32> = (0..23).map(|i| (i * 13 + 5) % 500).collect();
    for shape in ["tiny-qwen3next", "tiny-qwen35moe"] {
        let (_d, m) = model(shape, GgmlType::Q8_0);
        let cpu = Cpu::new(2);
        let mut a = SeqState::new(&m.hp, 64, KvType::F32);
        forward(&m, &cpu, &mut a, &tokens, Logits::None).unwrap();
        let mut b = SeqState::new(&m.hp, 64, KvType::F32);
        for &t in &tokens {
            forward(&m, &cpu, &mut b, &[t], Logits::None).unwrap();
        }
        assert_eq!(a.pos, b.pos);
        for (x, y) in a.linear.iter().zip(&b.linear) {
            assert_eq!(x, y, "{shape}: delta-net state differs");
        }
    }
}
