//! Quantization and dot products meet ggml's own bounds (llama.cpp's
//! test-quantize-fns: total quantization error `sqrt(Σ(x-x̂)²)/n <= 0.002`, dot
//! product error `|dot - exact|/n <= 0.02`), on ggml's test data and on uniform
//! random data; and every dot kernel agrees with the dot of the dequantized rows.

use samesum_quant::GgmlType;
use samesum_quant::dequant::dequantize;
use samesum_quant::dot::{self, ActRow, DOT_FORMATS};
use samesum_quant::quantize::quantize;
use samesum_quant::rng::Rng;
use samesum_quant::testing::random_weight_blocks;

const N: usize = 32 * 128;
const MAX_QUANT_ERROR: f64 = 0.002;
const MAX_DOT_ERROR: f64 = 0.02;

fn ggml_data(offset: f32) -> Vec<f32> {
    (0..N)
        .map(|i| 0.1 + 2.0 * (i as f32 + offset).cos())
        .collect()
}

fn uniform(seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..N).map(|_| r.range(-1.0, 1.0)).collect()
}

fn total_error(a: &[f32], b: &[f32]) -> f64 {
    let s: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    s.sqrt() / a.len() as f64
}

const QUANTIZED: &[GgmlType] = &[
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q8_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::F16,
    GgmlType::BF16,
];

#[test]
fn quantization_error_within_ggml_bound() {
    for &ty in QUANTIZED {
        for (name, x) in [("ggml cos", ggml_data(0.0)), ("uniform", uniform(3))] {
            let q = quantize(ty, &x).unwrap();
            let mut y = vec![0f32; N];
            dequantize(ty, &q, &mut y).unwrap();
            let err = total_error(&x, &y);
            eprintln!("{ty:>5} {name:>8}: total error {err:.6}");
            assert!(
                err <= MAX_QUANT_ERROR,
                "{ty} on {name}: {err} > {MAX_QUANT_ERROR}"
            );
        }
    }
}

#[test]
fn quantizers_improve_with_bits() {
    // A check that could fail if a packer scrambled values: more bits, less error.
    let x = uniform(5);
    let err = |ty| {
        let q = quantize(ty, &x).unwrap();
        let mut y = vec![0f32; N];
        dequantize(ty, &q, &mut y).unwrap();
        total_error(&x, &y)
    };
    let (e4, e5, e6, e8) = (
        err(GgmlType::Q4_K),
        err(GgmlType::Q5_K),
        err(GgmlType::Q6_K),
        err(GgmlType::Q8_0),
    );
    assert!(e4 > e5 && e5 > e6 && e6 > e8, "{e4} {e5} {e6} {e8}");
}

#[test]
fn dot_error_within_ggml_bound() {
    for &ty in &[
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ] {
        for (name, x, y) in [
            ("ggml cos", ggml_data(0.0), ggml_data(1.0)),
            ("uniform", uniform(1), uniform(2)),
        ] {
            let w = quantize(ty, &x).unwrap();
            let act = ActRow::quantize(ty, &y).unwrap();
            let got = dot::dot(ty, &w, &act).unwrap() as f64;
            let exact: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
            let err = (got - exact).abs() / N as f64;
            eprintln!("{ty:>5} {name:>8}: dot error {err:.6}");
            assert!(err <= MAX_DOT_ERROR, "{ty} on {name}: {err}");
        }
    }
}

#[test]
fn dot_matches_dot_of_dequantized_rows() {
    // The integer kernels must compute the same value as dequantize-then-multiply
    // (up to float rounding): catches any bit-layout slip in a kernel.
    let mut rng = Rng::new(99);
    for &ty in DOT_FORMATS {
        let n = 1024;
        for _ in 0..20 {
            let w = random_weight_blocks(ty, n / ty.block_size(), &mut rng).unwrap();
            let x: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
            let act = ActRow::quantize(ty, &x).unwrap();
            let act_ty = dot::act_type(ty).unwrap();
            let xq: Vec<f32> = if act_ty == GgmlType::F32 {
                x.clone()
            } else {
                let q = quantize(act_ty, &x).unwrap();
                let mut v = vec![0f32; n];
                dequantize(act_ty, &q, &mut v).unwrap();
                v
            };
            let mut wf = vec![0f32; n];
            dequantize(ty, &w, &mut wf).unwrap();
            let reference: f64 = wf.iter().zip(&xq).map(|(a, b)| *a as f64 * *b as f64).sum();
            let scale: f64 = wf
                .iter()
                .zip(&xq)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            let got = dot::dot(ty, &w, &act).unwrap() as f64;
            assert!(
                (got - reference).abs() <= 1e-4 * scale.max(1e-30),
                "{ty}: kernel {got} vs dequantized {reference} (scale {scale})"
            );
        }
    }
}
