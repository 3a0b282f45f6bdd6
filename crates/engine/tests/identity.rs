//! The identity gate passes on the real engine and fails on a deliberately
//! reordered variant (the negative control), on all three architectures.

mod common;

use samesum_engine::KvType;
use samesum_engine::cpu::Cpu;
use samesum_engine::identity::{batched, replay};
use samesum_gguf::GgmlType;

#[test]
fn gate_passes_and_its_negative_control_fails() {
    let prompt: Vec<u32> = (0..70).map(|i| (i * 29 + 3) % 500).collect();
    for shape in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
        let (_dir, model) = common::synth_model(shape, GgmlType::Q4_K, 2);
        let cpu = Cpu::new(2);
        let r = replay(&cpu, &model, &prompt, 16, KvType::F32).unwrap();
        for chunk in [1, 7, 64] {
            let v = batched(&cpu, &model, &prompt, chunk, 16, KvType::F32, &r).unwrap();
            assert!(v.valid() && v.equal(), "{shape} chunk {chunk}: {v:?}");
            assert_eq!(v.rows_batched, if chunk > 1 { 70 } else { 0 });
        }
        let wrong = Cpu::new(2).with_reversed_topk();
        let v = batched(&wrong, &model, &prompt, 7, 16, KvType::F32, &r).unwrap();
        assert!(
            v.valid() && !v.equal(),
            "{shape}: the reordered variant was not caught: {v:?}"
        );
        assert!(v.logits_diff.is_some(), "{shape}: logits should differ");
    }
}
