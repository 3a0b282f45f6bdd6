//! Per-position log-probabilities from one batched call equal, bit for bit,
//! those from feeding the tokens one at a time; a reordered MoE (the negative
//! control) changes them.

mod common;

use samesum_engine::KvType;
use samesum_engine::cpu::Cpu;
use samesum_engine::score::{TokenLogprob, score_tokens};
use samesum_gguf::GgmlType;

/// A scored position as bits: token, log-probability, top (id, log-probability).
type Bits = (u32, u64, Vec<(u32, u64)>);

fn bits(s: &[TokenLogprob]) -> Vec<Bits> {
    s.iter()
        .map(|t| {
            let top = t.top.iter().map(|&(i, l)| (i, l.to_bits())).collect();
            (t.token, t.logprob.to_bits(), top)
        })
        .collect()
}

#[test]
fn batched_scores_equal_one_token_at_a_time() {
    let tokens: Vec<u32> = (0..40).map(|i| (i * 53 + 11) % 500).collect();
    for shape in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
        let (_dir, model) = common::synth_model(shape, GgmlType::Q4_K, 5);
        let cpu = Cpu::new(2);
        let one = score_tokens(&cpu, &model, &tokens, 1, 1, KvType::F32, 5).unwrap();
        assert_eq!(one.len(), 39);
        assert!(
            one.iter()
                .all(|t| t.logprob.is_finite() && t.logprob <= 0.0)
        );
        assert_eq!(one[3].token, tokens[4]);
        assert_eq!(one[0].top.len(), 5);
        for chunk in [40, 7] {
            let all = score_tokens(&cpu, &model, &tokens, 1, chunk, KvType::F32, 5).unwrap();
            assert_eq!(bits(&all), bits(&one), "{shape} chunk {chunk}");
        }
        // From the middle: the tail of the same scores.
        let half = score_tokens(&cpu, &model, &tokens, 21, 40, KvType::F32, 5).unwrap();
        assert_eq!(bits(&half), bits(&one[20..]), "{shape} from 21");
        let wrong = Cpu::new(2).with_reversed_topk();
        let w = score_tokens(&wrong, &model, &tokens, 1, 40, KvType::F32, 5).unwrap();
        assert_ne!(
            bits(&w),
            bits(&one),
            "{shape}: the reordered MoE went unnoticed"
        );
        assert!(score_tokens(&cpu, &model, &tokens, 0, 8, KvType::F32, 0).is_err());
        assert!(score_tokens(&cpu, &model, &tokens, 40, 8, KvType::F32, 0).is_err());
        assert!(score_tokens(&cpu, &model, &[1, 1_000_000], 1, 8, KvType::F32, 0).is_err());
    }
}
