//! Every SIMD kernel family returns the same bits as the scalar reference, on
//! random blocks (quants over their whole range, random scales of both signs) and,
//! for the float formats, on lengths that exercise every tail.

use samesum_quant::GgmlType;
use samesum_quant::dot::{self, ActRow, DOT_FORMATS};
use samesum_quant::isa::Isa;
use samesum_quant::rng::Rng;
use samesum_quant::testing::*;

fn random_act(weight: GgmlType, n: usize, rng: &mut Rng) -> ActRow {
    match dot::act_type(weight).unwrap() {
        GgmlType::F32 => ActRow::F32((0..n).map(|_| rng.range(-3.0, 3.0)).collect()),
        GgmlType::Q8_0 => ActRow::Q8_0((0..n / 32).map(|_| random_q8_0(rng)).collect()),
        GgmlType::Q8_1 => ActRow::Q8_1((0..n / 32).map(|_| random_q8_1(rng)).collect()),
        _ => ActRow::Q8K((0..n / 256).map(|_| random_q8_k(rng)).collect()),
    }
}

#[test]
fn simd_equals_scalar_bitwise_on_random_blocks() {
    let isas = Isa::available();
    eprintln!("kernel families on this CPU: {isas:?}");
    let mut rng = Rng::new(7);
    let mut compared = 0usize;
    for &ty in DOT_FORMATS {
        let bs = ty.block_size();
        let lens: Vec<usize> = if bs == 1 {
            vec![1, 7, 16, 63, 64, 65, 127, 128, 200, 256, 1000, 2048, 4099]
        } else if bs == 32 {
            // Every tail length of the 8-block groups.
            (1..=40).map(|k| k * 32).collect()
        } else {
            (1..=12).map(|k| k * 256).collect()
        };
        for &n in &lens {
            for _ in 0..40 {
                let w = random_weight_blocks(ty, n / bs, &mut rng).unwrap();
                let act = random_act(ty, n, &mut rng);
                let reference = dot::dot_with(Isa::Scalar, ty, &w, &act).unwrap();
                assert!(reference.is_finite(), "{ty} n={n}: reference not finite");
                for &isa in &isas[1..] {
                    let got = dot::dot_with(isa, ty, &w, &act).unwrap();
                    assert_eq!(
                        got.to_bits(),
                        reference.to_bits(),
                        "{ty} n={n} {isa}: {got} vs scalar {reference}"
                    );
                    compared += 1;
                }
            }
        }
    }
    eprintln!("{compared} SIMD results compared bitwise");
}

#[test]
#[allow(clippy::single_range_in_vec_init)]
fn simd_handles_extreme_quants() {
    // All quants at -128 / 127 (where saturating instructions would go wrong).
    let mut rng = Rng::new(11);
    for &ty in DOT_FORMATS {
        if ty.block_size() == 1 {
            continue;
        }
        for fill in [0u8, 0xFF, 0x80, 0x7F, 0x88] {
            let mut w = random_weight_blocks(ty, 4, &mut rng).unwrap();
            let ts = ty.type_size();
            // Overwrite quant bytes but keep the scale fields set by the generator.
            let keep: &[std::ops::Range<usize>] = match ty {
                GgmlType::Q2_K => &[80..84],
                GgmlType::Q3_K => &[108..110],
                GgmlType::Q6_K => &[208..210],
                GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q4_1 | GgmlType::Q5_1 => &[0..4],
                GgmlType::MXFP4 => &[0..1],
                _ => &[0..2],
            };
            for b in w.chunks_exact_mut(ts) {
                let saved: Vec<(usize, u8)> = keep
                    .iter()
                    .flat_map(|r| r.clone())
                    .map(|i| (i, b[i]))
                    .collect();
                b.fill(fill);
                for (i, v) in saved {
                    b[i] = v;
                }
            }
            let n = 4 * ty.block_size();
            let act = match dot::act_type(ty).unwrap() {
                GgmlType::Q8_0 => ActRow::Q8_0(
                    (0..n / 32)
                        .map(|_| {
                            let mut b = random_q8_0(&mut rng);
                            b.qs = [fill as i8; 32];
                            b
                        })
                        .collect(),
                ),
                GgmlType::Q8_1 => {
                    ActRow::Q8_1((0..n / 32).map(|_| random_q8_1(&mut rng)).collect())
                }
                _ => ActRow::Q8K(
                    (0..n / 256)
                        .map(|_| {
                            let mut b = random_q8_k(&mut rng);
                            b.qs = [fill as i8; 256];
                            b.bsums = [16 * (fill as i8) as i16; 16];
                            b
                        })
                        .collect(),
                ),
            };
            let reference = dot::dot_with(Isa::Scalar, ty, &w, &act).unwrap();
            for isa in Isa::available() {
                let got = dot::dot_with(isa, ty, &w, &act).unwrap();
                assert_eq!(
                    got.to_bits(),
                    reference.to_bits(),
                    "{ty} fill={fill:#x} {isa}"
                );
            }
        }
    }
}

#[test]
fn dot_rejects_mismatched_rows() {
    let w = vec![0u8; 144];
    let act = ActRow::quantize(GgmlType::Q4_K, &[0.5; 512]).unwrap();
    assert!(dot::dot(GgmlType::Q4_K, &w, &act).is_err());
    let act = ActRow::quantize(GgmlType::Q8_0, &[0.5; 256]).unwrap();
    assert!(
        dot::dot(GgmlType::Q4_K, &w, &act).is_err(),
        "wrong activation type accepted"
    );
    assert!(ActRow::quantize(GgmlType::IQ1_S, &[0.0; 256]).is_err());
}

#[test]
fn the_bitwise_check_catches_a_reordered_sum() {
    // Negative control: the same products summed in another order (plain left to
    // right, or with fused multiply-adds) are a different function, and the
    // bit-for-bit comparison above must see it.
    let mut rng = Rng::new(5);
    let (mut seq_differs, mut fma_differs) = (0, 0);
    for _ in 0..50 {
        let n = 4096;
        let w: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
        let x: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let reference =
            dot::dot_with(Isa::Scalar, GgmlType::F32, &bytes, &ActRow::F32(x.clone())).unwrap();
        let sequential = w.iter().zip(&x).fold(0f32, |acc, (a, b)| acc + a * b);
        let fused = w
            .iter()
            .zip(&x)
            .fold(0f32, |acc, (a, b)| a.mul_add(*b, acc));
        seq_differs += (sequential.to_bits() != reference.to_bits()) as usize;
        fma_differs += (fused.to_bits() != reference.to_bits()) as usize;
    }
    assert!(
        seq_differs > 10 && fma_differs > 10,
        "{seq_differs} {fma_differs}"
    );
}

#[test]
fn dot_rows_equals_one_dot_per_row() {
    let mut rng = Rng::new(21);
    for &ty in DOT_FORMATS {
        let n = 512;
        let rows = 7;
        let w = random_weight_blocks(ty, rows * n / ty.block_size(), &mut rng).unwrap();
        let act = random_act(ty, n, &mut rng);
        let rb = w.len() / rows;
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; rows];
            dot::dot_rows_with(isa, ty, &w, &act, &mut out).unwrap();
            for r in 0..rows {
                let one = dot::dot_with(isa, ty, &w[r * rb..(r + 1) * rb], &act).unwrap();
                assert_eq!(out[r].to_bits(), one.to_bits(), "{ty} {isa} row {r}");
            }
        }
        let mut short = vec![0f32; rows + 1];
        assert!(
            dot::dot_rows(ty, &w, &act, &mut short).is_err(),
            "{ty}: wrong row count accepted"
        );
    }
}

#[test]
fn dot_rows_multi_equals_one_dot_per_pair() {
    let mut rng = Rng::new(23);
    for &ty in DOT_FORMATS {
        let n = 512;
        let rows = 5;
        let w = random_weight_blocks(ty, rows * n / ty.block_size(), &mut rng).unwrap();
        let rb = w.len() / rows;
        for nr in [1usize, 3, 8, 11, 17] {
            let acts: Vec<ActRow> = (0..nr).map(|_| random_act(ty, n, &mut rng)).collect();
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; rows * nr];
                dot::dot_rows_multi_with(isa, ty, &w, &acts, &mut out).unwrap();
                for j in 0..rows {
                    for (r, a) in acts.iter().enumerate() {
                        let one = dot::dot_with(isa, ty, &w[j * rb..(j + 1) * rb], a).unwrap();
                        assert_eq!(
                            out[r * rows + j].to_bits(),
                            one.to_bits(),
                            "{ty} {isa} nr={nr} row {j} act {r}"
                        );
                    }
                }
            }
        }
    }
}

/// `dot_rows_multi_with(isa)` against the scalar reference of every pair, bit
/// for bit, on `rows` weight rows of `w`.
fn assert_multi_matches_scalar(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    acts: &[ActRow],
    what: &str,
) {
    let rb = w.len() / rows;
    let mut out = vec![f32::NAN; rows * acts.len()];
    dot::dot_rows_multi_with(isa, ty, w, acts, &mut out).unwrap();
    for j in 0..rows {
        for (r, a) in acts.iter().enumerate() {
            let reference = dot::dot_with(Isa::Scalar, ty, &w[j * rb..(j + 1) * rb], a).unwrap();
            let got = out[r * rows + j];
            assert_eq!(
                got.to_bits(),
                reference.to_bits(),
                "{ty} {isa} {what}: weight row {j} act {r}: {got} vs scalar {reference}"
            );
        }
    }
}

#[test]
fn multi_row_kernels_equal_scalar_bitwise() {
    let mut rng = Rng::new(29);
    let mut covered = Vec::new();
    for isa in Isa::available() {
        for &ty in dot::multi_accelerated(isa) {
            let bs = ty.block_size();
            // 32-element formats: lengths with every tail of the 8-block groups.
            let lens: Vec<usize> = if bs == 32 {
                vec![32, 7 * 32, 256, 9 * 32, 512 + 3 * 32, 1024]
            } else {
                vec![256, 512, 1280]
            };
            for &n in &lens {
                // Odd row counts pair the last weight row with itself; weight
                // rows past a 16-row tile; activation counts below, at and past
                // the 8-row groups and the 16-row tiles, and past the
                // largest per-format AMX threshold (Q6_K's 40).
                for rows in [1usize, 2, 3, 6, 17] {
                    for nr in [1usize, 2, 5, 8, 9, 16, 19, 33, 41] {
                        let w = random_weight_blocks(ty, rows * n / bs, &mut rng).unwrap();
                        let acts: Vec<ActRow> =
                            (0..nr).map(|_| random_act(ty, n, &mut rng)).collect();
                        assert_multi_matches_scalar(isa, ty, &w, rows, &acts, &format!("n={n}"));
                    }
                }
            }
            covered.push(ty);
        }
    }
    if Isa::available().contains(&Isa::Amx) {
        eprintln!("AMX tiles tested");
    }
    if Isa::available().contains(&Isa::Avx512) {
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
            GgmlType::IQ4_XS,
        ] {
            assert!(covered.contains(&ty), "{ty}: no multi-row kernel tested");
        }
    }
    eprintln!("multi-row kernels tested: {covered:?}");
}

#[test]
fn multi_row_kernels_handle_extreme_values() {
    // Weight quant bytes all 0x00 / 0xFF / 0x80 / 0x7F / 0x88 (every quant at an
    // end of its range) against activations of all -128 or all 127, with the
    // scales at extremes too: the largest f16 super-scales and scale bytes.
    let mut rng = Rng::new(31);
    for isa in Isa::available() {
        for &ty in dot::multi_accelerated(isa) {
            let bs = ty.block_size();
            let n = if bs == 32 { 11 * 32 } else { 3 * 256 };
            let rows = 3;
            for fill in [0u8, 0xFF, 0x80, 0x7F, 0x88] {
                for act_fill in [-128i8, 127, fill as i8] {
                    let mut w = random_weight_blocks(ty, rows * n / bs, &mut rng).unwrap();
                    let ts = ty.type_size();
                    // The f16 super-scale(s): keep the generator's, or the largest.
                    let d_at: &[usize] = match ty {
                        GgmlType::Q6_K => &[208],
                        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q4_1 | GgmlType::Q5_1 => {
                            &[0, 2]
                        }
                        _ => &[0],
                    };
                    for (i, b) in w.chunks_exact_mut(ts).enumerate() {
                        let saved: Vec<(usize, [u8; 2])> =
                            d_at.iter().map(|&o| (o, [b[o], b[o + 1]])).collect();
                        b.fill(fill);
                        for (o, v) in saved {
                            let v = if i % 2 == 0 {
                                v
                            } else {
                                half::f16::from_f32(if i % 4 == 1 { 65504.0 } else { -65504.0 })
                                    .to_le_bytes()
                            };
                            b[o..o + 2].copy_from_slice(&v);
                        }
                    }
                    let acts: Vec<ActRow> = (0..9)
                        .map(|_| match dot::act_type(ty).unwrap() {
                            GgmlType::Q8_0 => ActRow::Q8_0(
                                (0..n / 32)
                                    .map(|_| {
                                        let mut b = random_q8_0(&mut rng);
                                        b.qs = [act_fill; 32];
                                        b
                                    })
                                    .collect(),
                            ),
                            GgmlType::Q8_1 => ActRow::Q8_1(
                                (0..n / 32)
                                    .map(|_| {
                                        let mut b = random_q8_1(&mut rng);
                                        b.qs = [act_fill; 32];
                                        b
                                    })
                                    .collect(),
                            ),
                            _ => ActRow::Q8K(
                                (0..n / 256)
                                    .map(|_| {
                                        let mut b = random_q8_k(&mut rng);
                                        b.qs = [act_fill; 256];
                                        b.bsums = [16 * act_fill as i16; 16];
                                        b
                                    })
                                    .collect(),
                            ),
                        })
                        .collect();
                    assert_multi_matches_scalar(
                        isa,
                        ty,
                        &w,
                        rows,
                        &acts,
                        &format!("fill={fill:#x} act={act_fill}"),
                    );
                }
            }
        }
    }
}

/// `dot_rows_with(isa)` against the scalar reference of every row, bit for bit.
fn assert_rows_match_scalar(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    act: &ActRow,
    what: &str,
) {
    let rb = w.len() / rows;
    let mut out = vec![f32::NAN; rows];
    dot::dot_rows_with(isa, ty, w, act, &mut out).unwrap();
    for (j, got) in out.iter().enumerate() {
        let reference = dot::dot_with(Isa::Scalar, ty, &w[j * rb..(j + 1) * rb], act).unwrap();
        assert_eq!(
            got.to_bits(),
            reference.to_bits(),
            "{ty} {isa} {what}: row {j} of {rows}: {got} vs scalar {reference}"
        );
    }
}

#[test]
fn eight_row_kernels_equal_scalar_bitwise() {
    // Row counts at, past and between multiples of 8: the eight-row kernels
    // (one weight row per lane) take whole groups, the one-row kernels the rest.
    let mut rng = Rng::new(37);
    for isa in Isa::available() {
        for &ty in DOT_FORMATS {
            let bs = ty.block_size();
            // 32-element formats: block counts with and without a tail past
            // the groups of 8.
            let lens: &[usize] = if bs == 32 {
                &[96, 256, 416, 1024]
            } else {
                &[256, 1024]
            };
            for &n in lens.iter().filter(|&&n| n % bs == 0) {
                for rows in [8usize, 9, 16, 23] {
                    let w = random_weight_blocks(ty, rows * n / bs, &mut rng).unwrap();
                    let act = random_act(ty, n, &mut rng);
                    assert_rows_match_scalar(isa, ty, &w, rows, &act, &format!("n={n}"));
                }
            }
        }
    }
}

#[test]
fn eight_row_kernels_handle_extreme_values() {
    let mut rng = Rng::new(41);
    for isa in Isa::available() {
        for &ty in dot::multi_accelerated(isa) {
            let bs = ty.block_size();
            let (n, rows) = (if bs == 32 { 13 * 32 } else { 2 * 256 }, 11);
            for fill in [0u8, 0xFF, 0x80, 0x7F, 0x88] {
                for act_fill in [-128i8, 127] {
                    let mut w = random_weight_blocks(ty, rows * n / bs, &mut rng).unwrap();
                    let keep: &[usize] = match ty {
                        GgmlType::Q6_K => &[208, 209],
                        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q4_1 | GgmlType::Q5_1 => {
                            &[0, 1, 2, 3]
                        }
                        _ => &[0, 1],
                    };
                    for b in w.chunks_exact_mut(ty.type_size()) {
                        let saved: Vec<(usize, u8)> = keep.iter().map(|&i| (i, b[i])).collect();
                        b.fill(fill);
                        for (i, v) in saved {
                            b[i] = v;
                        }
                    }
                    let act = if dot::act_type(ty) == Some(GgmlType::Q8_1) {
                        ActRow::Q8_1(
                            (0..n / 32)
                                .map(|_| {
                                    let mut b = random_q8_1(&mut rng);
                                    b.qs = [act_fill; 32];
                                    b
                                })
                                .collect(),
                        )
                    } else if bs == 32 {
                        ActRow::Q8_0(
                            (0..n / 32)
                                .map(|_| {
                                    let mut b = random_q8_0(&mut rng);
                                    b.qs = [act_fill; 32];
                                    b
                                })
                                .collect(),
                        )
                    } else {
                        ActRow::Q8K(
                            (0..n / 256)
                                .map(|_| {
                                    let mut b = random_q8_k(&mut rng);
                                    b.qs = [act_fill; 256];
                                    b.bsums = [16 * act_fill as i16; 16];
                                    b
                                })
                                .collect(),
                        )
                    };
                    let what = format!("fill={fill:#x} act={act_fill}");
                    assert_rows_match_scalar(isa, ty, &w, rows, &act, &what);
                }
            }
        }
    }
}
