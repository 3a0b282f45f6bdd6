//! Norms and elementwise kernels on the GPU.

use super::*;

/// The warp-per-row norm (`rms_norm_small`, rows up to 256 wide: the q and
/// k head norms) against rms_norm's block per row, byte for byte, on random
/// rows of many widths and scales (a wrong tree order shows in some rows'
/// last bits of the mean).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn small_norms_equal_the_block_norm() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 5);
    let cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(41);
    let mut differing_rows = 0;
    for width in [1usize, 17, 32, 64, 96, 100, 128, 200, 255, 256] {
        for scale in [1e-3f32, 1.0, 3e4] {
            let rows = 613;
            let x: Vec<f32> = (0..rows * width).map(|_| rng.normal() * scale).collect();
            let w: Vec<f32> = (0..width).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            let a = cuda.rms_norm_host(&x, &w, 1e-6, false).unwrap();
            let b = cuda.rms_norm_host(&x, &w, 1e-6, true).unwrap();
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
    eprintln!("rms_norm_small == rms_norm on 10 widths x 3 scales x 613 rows");
}
