//! The negative control of the batch check: several sequences in one
//! forward call must equal each alone (the conformance body
//! `sequences_batched_together_equal_each_alone`, tests/conformance.rs), and
//! a batch-dependent MoE must fail that comparison.

mod common;

use samesum_engine::backend::Backend;
use samesum_engine::cpu::Cpu;
use samesum_engine::{KvType, Logits, Segment, forward, forward_batch};
use samesum_gguf::GgmlType;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_batch_check_catches_a_batch_dependent_op() {
    // The negative-control CPU variant sums a token's experts in another order
    // in calls of more than one row: two decode rows of two sequences in one
    // call must then differ from the same rows alone.
    let (_dir, model) = common::synth_model("tiny-qwen3next", GgmlType::Q4_K, 4);
    let bad = Cpu::new(1).with_reversed_topk();
    let mut differs = false;
    for t in 0..20u32 {
        let mut a = bad.new_state(&model, 4, KvType::F32).unwrap();
        let mut b = bad.new_state(&model, 4, KvType::F32).unwrap();
        let mut segs = [
            Segment {
                state: &mut a,
                tokens: &[t],
                want: Logits::Last,
            },
            Segment {
                state: &mut b,
                tokens: &[t + 100],
                want: Logits::Last,
            },
        ];
        let got = forward_batch(&model, &bad, &mut segs).unwrap();
        let mut c = bad.new_state(&model, 4, KvType::F32).unwrap();
        let alone = forward(&model, &bad, &mut c, &[t], Logits::Last).unwrap();
        differs |= bits(&got[0]) != bits(&alone);
    }
    assert!(differs, "a batch-dependent MoE went unnoticed");
}
