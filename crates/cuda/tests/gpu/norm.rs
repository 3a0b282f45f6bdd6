//! Norms and elementwise kernels on the GPU.

use super::*;

/// The warp-per-row norm (`rms_norm_small`, rows up to 256 wide: the q and
/// k head norms) against rms_norm's block per row, byte for byte, on random
/// rows of many widths and scales (a wrong tree order shows in some rows'
/// last bits of the mean); then whole forward passes with it on and off.
#[test]
fn small_norms_equal_the_block_norm() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 5);
    let (small, block) = switch_arms(&model, "SMALL_NORM");
    let mut rng = Rng::new(41);
    let mut differing_rows = 0;
    for width in [1usize, 17, 32, 64, 96, 100, 128, 200, 255, 256] {
        for scale in [1e-3f32, 1.0, 3e4] {
            let rows = 613;
            let x: Vec<f32> = (0..rows * width).map(|_| rng.normal() * scale).collect();
            let w: Vec<f32> = (0..width).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            let a = small.rms_norm_host(&x, &w, 1e-6).unwrap();
            let b = block.rms_norm_host(&x, &w, 1e-6).unwrap();
            assert!(a.iter().all(|v| v.is_finite()), "width {width}: non-finite");
            if let Some(i) = a
                .iter()
                .zip(&b)
                .position(|(p, q)| p.to_bits() != q.to_bits())
            {
                panic!("width {width} scale {scale}: row {} differs", i / width);
            }
            // The norm is not the identity: the rows did change.
            differing_rows += x
                .chunks(width)
                .zip(a.chunks(width))
                .filter(|(p, q)| p != q)
                .count();
        }
    }
    assert!(differing_rows > 0);
    let toks = test_tokens(&model, 3);
    assert_same_logits(
        &small,
        &block,
        &model,
        &toks,
        &[64, 7],
        "forward differs with the small norm",
    );
    eprintln!(
        "rms_norm_small == rms_norm on 10 widths x 3 scales x 613 rows, and in forward passes"
    );
}

/// Prefill GLUs that write their Q8_K blocks (`silu_mul_q8k`) against
/// silu_mul and a quantize launch: the same logits bytes at every position,
/// chunks of 64 and 7, on every tiny shape (routed and shared experts), and
/// batched still equal to replay.
#[test]
fn glu_quantization_in_the_glu_equals_a_quantize_launch() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 29);
        let (fused, apart) = switch_arms(&model, "SILU_Q8K");
        let toks = test_tokens(&model, 9);
        let what = format!("{shape}: silu_mul_q8k != silu_mul + quantize");
        let batched = assert_same_logits(&fused, &apart, &model, &toks, &[64, 7], &what);
        let replay = all_logits(&fused, &model, &toks, 1);
        for (chunk, b) in [64, 7].into_iter().zip(&batched) {
            assert!(
                same_bits(b, &replay),
                "{shape} chunk {chunk}: batched != replay"
            );
        }
        eprintln!("{shape}: silu_mul_q8k == silu_mul + quantize_q8k == replay (chunks 64 and 7)");
    }
}
