//! Several sequences in one forward call (`forward_batch`, what the server's
//! continuous batching runs) get the same logits bytes and states as each
//! sequence run on its own, for all three architectures, whatever the mix of
//! prefill chunks and decode rows.

mod common;

use samesum_engine::backend::Backend;
use samesum_engine::cpu::Cpu;
use samesum_engine::{KvType, Logits, Model, Segment, forward, forward_batch};
use samesum_gguf::GgmlType;
use samesum_quant::rng::Rng;
use samesum_synth::{SynthOptions, shapes, write_model};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn sequences_batched_together_equal_each_alone() {
    for shape in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
        let (_dir, model) = common::synth_model(shape, GgmlType::Q4_K, 4);
        let cpu = Cpu::new(2);
        let mut rng = Rng::new(17);
        let v = model.w.n_vocab as u64;
        // Three sequences, fed in steps of different sizes (a prefill chunk
        // beside decode rows, a sequence idle in a step).
        let steps: [[usize; 3]; 5] = [[9, 1, 0], [1, 30, 2], [1, 1, 17], [0, 1, 1], [5, 1, 1]];
        let toks: Vec<Vec<u32>> = (0..3)
            .map(|i| {
                let n: usize = steps.iter().map(|s| s[i]).sum();
                (0..n).map(|_| rng.below(v) as u32).collect()
            })
            .collect();
        let mut together: Vec<_> = (0..3)
            .map(|_| cpu.new_state(&model, 64, KvType::F32).unwrap())
            .collect();
        let mut alone: Vec<_> = (0..3)
            .map(|_| cpu.new_state(&model, 64, KvType::F32).unwrap())
            .collect();
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
            let got = forward_batch(&model, &cpu, &mut segs).unwrap();
            for i in 0..3 {
                let want_alone = forward(
                    &model,
                    &cpu,
                    &mut alone[i],
                    &toks[i][at[i]..at[i] + step[i]],
                    want,
                )
                .unwrap();
                assert_eq!(
                    bits(&got[i]),
                    bits(&want_alone),
                    "{shape}: step {k}, sequence {i}: batched with others differs from alone"
                );
                at[i] += step[i];
            }
        }
        for i in 0..3 {
            assert_eq!(
                bits(&cpu.download_state(&together[i]).unwrap()),
                bits(&cpu.download_state(&alone[i]).unwrap()),
                "{shape}: state of sequence {i}"
            );
        }
    }
}

#[test]
fn the_batch_check_catches_a_batch_dependent_op() {
    // The negative-control CPU variant sums a token's experts in another order
    // in calls of more than one row: two decode rows of two sequences in one
    // call must then differ from the same rows alone.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    write_model(
        &SynthOptions::new(
            shapes::by_name("tiny-qwen3next").unwrap(),
            GgmlType::Q4_K,
            4,
        ),
        &p,
        &mut |_, _| {},
    )
    .unwrap();
    let model = Model::load(&p).unwrap();
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
