//! Random tensor contents, generated piece by piece so no tensor is ever held whole.
//!
//! Float tensors draw values from their [`Fill`]. Quantized weight matrices are
//! generated directly as blocks: uniform random quants with block scales chosen so
//! the dequantized values have mean about 0 and the requested standard deviation
//! (sane, finite scales; generating 20 GB this way takes seconds, where quantizing
//! floats would take hours).
//!
//! Each format's scale follows from the spread of its quants: for `y = d * s * k`
//! with independent uniform quants `k` and group scales `s`, the root mean square
//! is `d * rms(s) * rms(k)`, so `d = sd / (rms(s) * rms(k))`. Where the quants'
//! mean is not zero the block's (or group's) scale takes a random sign, or an
//! offset cancels the mean. For the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S,
//! IQ3_XXS, IQ3_S) every byte after the scale is random; `rms(k)` is the root
//! mean square of the magnitudes in ggml's grid tables (`ggml-common.h`).

use crate::plan::Fill;
use half::f16;
use samesum_gguf::GgmlType;
use samesum_quant::blocks::*;
use samesum_quant::quantize::{f32_to_bf16, quantize_into};
use samesum_quant::rng::Rng;

/// Seed of a tensor's stream: the model seed mixed with the tensor's name, so each
/// tensor's contents do not depend on the order tensors are written in.
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Types whose random blocks are generated directly: every type a `--quant`
/// or `--mix` plan can hold.
pub fn direct_block_type(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        Q4_0 | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ4_NL
            | IQ4_XS
            | MXFP4
            | IQ2_XXS
            | IQ2_XS
            | IQ2_S
            | IQ3_XXS
            | IQ3_S
    )
}

/// Root mean square of the magnitudes in ggml's IQ2_XXS grid (values 8, 25, 43).
const RMS_IQ2XXS_GRID: f32 = 23.118;
/// Root mean square of the magnitudes in ggml's IQ2_XS grid.
const RMS_IQ2XS_GRID: f32 = 24.217;
/// Root mean square of the magnitudes in ggml's IQ2_S grid.
const RMS_IQ2S_GRID: f32 = 24.430;
/// Root mean square of the magnitudes in ggml's IQ3_XXS grid (4 ... 62).
const RMS_IQ3XXS_GRID: f32 = 30.849;
/// Root mean square of the magnitudes in ggml's IQ3_S grid (1 ... 15).
const RMS_IQ3S_GRID: f32 = 7.594;
/// Root mean square of `0.5 + s` for a 4-bit `s` (the IQ2/IQ3_XXS group scales).
const RMS_HALF_PLUS_NIBBLE: f32 = 9.233;
/// Root mean square of `1 + 2 s` for a 4-bit `s` (the IQ3_S group scales).
const RMS_ODD_NIBBLE: f32 = 18.466;
/// Root mean square of a signed 6-bit scale drawn as `±[16, 31]`.
const RMS_SCALE_16_31: f32 = 23.948;

/// Root mean square of a table of values.
fn rms(t: &[i8]) -> f32 {
    (t.iter().map(|&v| (v as f32).powi(2)).sum::<f32>() / t.len() as f32).sqrt()
}

/// `1.0` or `-1.0`, at random.
fn random_sign(rng: &mut Rng) -> f32 {
    if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }
}

/// A signed 6-bit scale `±[16, 31]`, stored with the +32 offset Q3_K and
/// IQ4_XS use.
fn signed_scale_6bit(rng: &mut Rng) -> u8 {
    let m = 16 + rng.below(16) as i32;
    let s = if rng.next_u64() & 1 == 0 { m } else { -m };
    (s + 32) as u8
}

/// Blocks of `size` random bytes with the f16 scale `d` written at `offset`.
fn random_blocks_with_scale(rng: &mut Rng, out: &mut [u8], size: usize, offset: usize, d: f32) {
    rng.fill_bytes(out);
    let d = f16::from_f32(d).to_le_bytes();
    for b in out.chunks_exact_mut(size) {
        b[offset..offset + 2].copy_from_slice(&d);
    }
}

fn draw(rng: &mut Rng, fill: Fill) -> f32 {
    match fill {
        Fill::Normal(sd) => rng.normal() * sd,
        Fill::Norm(sd) => 1.0 + rng.normal() * sd,
        Fill::Uniform(lo, hi) => rng.range(lo, hi),
        Fill::NegExp(hi) => -(rng.range(0.0, hi.ln())).exp(),
    }
}

/// Fill `out` (a whole number of blocks of `ty`) with the next values of the stream.
pub fn fill(rng: &mut Rng, ty: GgmlType, fill: Fill, out: &mut [u8]) {
    let sd = match fill {
        Fill::Normal(sd) => sd,
        _ => 0.0,
    };
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&draw(rng, fill).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(draw(rng, fill)).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f32_to_bf16(draw(rng, fill)).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => blocks(rng, out, |rng| {
            let mut b = BlockQ8_0 {
                d: f16::from_f32(sd / 73.6),
                qs: [0; 32],
            };
            for q in &mut b.qs {
                *q = (rng.below(255) as i32 - 127) as i8;
            }
            b
        }),
        GgmlType::Q4_0 => blocks(rng, out, |rng| {
            // q - 8 has mean -1/2: alternate the scale's sign so the mean is zero.
            let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            let mut b = BlockQ4_0 {
                d: f16::from_f32(sign * sd / 4.61),
                qs: [0; 16],
            };
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q4_K => blocks(rng, out, |rng| {
            let d = sd / (52.0 * 4.61);
            let mut b = BlockQ4K {
                d: f16::from_f32(d),
                dmin: f16::from_f32(7.5 * d),
                scales: k4_scales(rng),
                qs: [0; 128],
            };
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q5_K => blocks(rng, out, |rng| {
            let d = sd / (52.0 * 9.23);
            let mut b = BlockQ5K {
                d: f16::from_f32(d),
                dmin: f16::from_f32(15.5 * d),
                scales: k4_scales(rng),
                qh: [0; 32],
                qs: [0; 128],
            };
            rng.fill_bytes(&mut b.qh);
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q6_K => blocks(rng, out, |rng| {
            let mut b = BlockQ6K {
                ql: [0; 128],
                qh: [0; 64],
                scales: [0; 16],
                d: f16::from_f32(sd / (87.3 * 18.47)),
            };
            rng.fill_bytes(&mut b.ql);
            rng.fill_bytes(&mut b.qh);
            for s in &mut b.scales {
                *s = (40 + rng.below(88)) as i8;
            }
            b
        }),
        GgmlType::Q4_1 => blocks(rng, out, |rng| {
            // d * q + m with q uniform in 0..16: m = -7.5 d centres it.
            let d = f16::from_f32(sd / 4.61);
            let mut b = BlockQ4_1 {
                d,
                m: f16::from_f32(-7.5 * d.to_f32()),
                qs: [0; 16],
            };
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q5_0 => blocks(rng, out, |rng| {
            // q - 16 (q uniform in 0..32) has mean -1/2: a random sign per block.
            let mut b = BlockQ5_0 {
                d: f16::from_f32(random_sign(rng) * sd / 9.23),
                qh: [0; 4],
                qs: [0; 16],
            };
            rng.fill_bytes(&mut b.qh);
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q5_1 => blocks(rng, out, |rng| {
            let d = f16::from_f32(sd / 9.23);
            let mut b = BlockQ5_1 {
                d,
                m: f16::from_f32(-15.5 * d.to_f32()),
                qh: [0; 4],
                qs: [0; 16],
            };
            rng.fill_bytes(&mut b.qh);
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q2_K => blocks(rng, out, |rng| {
            // y = d * sc * q - dmin * m with q uniform in 0..4 (mean 1.5, rms of
            // q - 1.5 is 1.118): dmin = d and m = 1.5 sc centre each group;
            // sc in {6, 8, 10} (rms 8.165) keeps m within 4 bits.
            let d = sd / (8.165 * 1.118);
            let mut b = BlockQ2K {
                scales: [0; 16],
                qs: [0; 64],
                d: f16::from_f32(d),
                dmin: f16::from_f32(d),
            };
            for s in &mut b.scales {
                let sc = 6 + 2 * rng.below(3) as u8;
                *s = sc | ((3 * sc / 2) << 4);
            }
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q3_K => blocks(rng, out, |rng| {
            // q uniform in -4..4 (mean -1/2, rms 2.345) times a scale of random
            // sign in ±[16, 31].
            let mut b = BlockQ3K {
                hmask: [0; 32],
                qs: [0; 64],
                scales: [0; 12],
                d: f16::from_f32(sd / (RMS_SCALE_16_31 * 2.345)),
            };
            rng.fill_bytes(&mut b.hmask);
            rng.fill_bytes(&mut b.qs);
            for k in 0..16 {
                let v = signed_scale_6bit(rng);
                if k < 8 {
                    b.scales[k] |= v & 0x0F;
                } else {
                    b.scales[k - 8] |= (v & 0x0F) << 4;
                }
                b.scales[8 + k % 4] |= (v >> 4) << (2 * (k / 4));
            }
            b
        }),
        GgmlType::IQ4_NL => {
            let k = rms(&KVALUES_IQ4NL);
            blocks(rng, out, |rng| {
                // The table's mean is not zero: a random sign per block.
                let mut b = BlockIq4Nl {
                    d: f16::from_f32(random_sign(rng) * sd / k),
                    qs: [0; 16],
                };
                rng.fill_bytes(&mut b.qs);
                b
            })
        }
        GgmlType::IQ4_XS => {
            let k = rms(&KVALUES_IQ4NL);
            blocks(rng, out, |rng| {
                let mut b = BlockIq4Xs {
                    d: f16::from_f32(sd / (RMS_SCALE_16_31 * k)),
                    scales_h: 0,
                    scales_l: [0; 4],
                    qs: [0; 128],
                };
                for ib in 0..8 {
                    let v = signed_scale_6bit(rng);
                    b.scales_l[ib / 2] |= (v & 0x0F) << (4 * (ib % 2));
                    b.scales_h |= ((v >> 4) as u16) << (2 * ib);
                }
                rng.fill_bytes(&mut b.qs);
                b
            })
        }
        GgmlType::MXFP4 => {
            // y = 2^(e - 128) * k, k the doubled E2M1 values (mean 0). The scale is
            // a power of two, so blocks take the exponent below or above the
            // ideal one with the odds that make the mean square exact.
            let t = (sd / rms(&KVALUES_MXFP4)).log2();
            let (lo, frac) = (t.floor(), t - t.floor());
            let p_hi = (4f32.powf(frac) - 1.0) / 3.0;
            let e_lo = if sd > 0.0 {
                (128.0 + lo).clamp(2.0, 253.0) as u8
            } else {
                0
            };
            blocks(rng, out, |rng| {
                let up = sd > 0.0 && rng.f32() < p_hi;
                let mut b = BlockMxfp4 {
                    e: e_lo + up as u8,
                    qs: [0; 16],
                };
                rng.fill_bytes(&mut b.qs);
                b
            })
        }
        GgmlType::IQ2_XXS => random_blocks_with_scale(
            rng,
            out,
            66,
            0,
            sd / (RMS_HALF_PLUS_NIBBLE * 0.25 * RMS_IQ2XXS_GRID),
        ),
        GgmlType::IQ2_XS => random_blocks_with_scale(
            rng,
            out,
            74,
            0,
            sd / (RMS_HALF_PLUS_NIBBLE * 0.25 * RMS_IQ2XS_GRID),
        ),
        GgmlType::IQ2_S => random_blocks_with_scale(
            rng,
            out,
            82,
            0,
            sd / (RMS_HALF_PLUS_NIBBLE * 0.25 * RMS_IQ2S_GRID),
        ),
        GgmlType::IQ3_XXS => random_blocks_with_scale(
            rng,
            out,
            98,
            0,
            sd / (RMS_HALF_PLUS_NIBBLE * 0.5 * RMS_IQ3XXS_GRID),
        ),
        GgmlType::IQ3_S => {
            random_blocks_with_scale(rng, out, 110, 0, sd / (RMS_ODD_NIBBLE * RMS_IQ3S_GRID))
        }
        other => {
            // Any other quantizable type: draw floats and quantize them.
            let bs = other.block_size();
            let n = out.len() / other.type_size() * bs;
            let xs: Vec<f32> = (0..n).map(|_| draw(rng, fill)).collect();
            quantize_into(other, &xs, out).expect("synth only plans quantizable types");
        }
    }
}

/// Scales and mins of a Q4_K/Q5_K block: the same random 6-bit value in [40, 63]
/// for a group's scale and min, so every group is centred on zero.
fn k4_scales(rng: &mut Rng) -> [u8; 12] {
    let mut ls = [0u8; 8];
    for s in &mut ls {
        *s = (40 + rng.below(24)) as u8;
    }
    let mut p = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            p[j] = ls[j];
            p[j + 4] = ls[j];
        } else {
            p[j + 4] = (ls[j] & 0x0F) | ((ls[j] & 0x0F) << 4);
            p[j - 4] |= (ls[j] >> 4) << 6;
            p[j] |= (ls[j] >> 4) << 6;
        }
    }
    p
}

fn blocks<B: bytemuck::Pod>(rng: &mut Rng, out: &mut [u8], mut f: impl FnMut(&mut Rng) -> B) {
    let size = std::mem::size_of::<B>();
    for o in out.chunks_exact_mut(size) {
        o.copy_from_slice(bytemuck::bytes_of(&f(rng)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use samesum_quant::dequant::{can_dequantize, dequantize};

    fn generate(ty: GgmlType, n: usize, sd: f32, seed: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; n / ty.block_size() * ty.type_size()];
        fill(&mut Rng::new(seed), ty, Fill::Normal(sd), &mut bytes);
        bytes
    }

    #[test]
    fn every_generated_type_dequantizes_to_the_requested_spread() {
        let mut checked = Vec::new();
        for &ty in GgmlType::ALL {
            let generated = direct_block_type(ty) || matches!(ty, GgmlType::F16 | GgmlType::BF16);
            if !generated || !can_dequantize(ty) {
                continue;
            }
            for (sd, seed) in [(0.02f32, 1), (1.0, 2)] {
                let n = 1 << 15;
                let mut x = vec![0f32; n];
                dequantize(ty, &generate(ty, n, sd, seed), &mut x).unwrap();
                assert!(x.iter().all(|v| v.is_finite()), "{ty}: non-finite value");
                let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
                let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
                let (mean, got) = (mean as f32, var.sqrt() as f32);
                // Q6_K's quants have mean -1/2 under positive scales, a mean of
                // -0.026 sd (kept: `--quant` files stay as they were); the
                // other formats centre within sampling noise.
                assert!(mean.abs() < 0.04 * sd, "{ty} sd {sd}: mean {mean}");
                assert!(
                    (0.9 * sd..1.1 * sd).contains(&got),
                    "{ty}: standard deviation {got}, want {sd}"
                );
            }
            checked.push(ty);
        }
        // The formats the CPU dequantizes today are all covered.
        for ty in [
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::IQ4_NL,
            GgmlType::IQ4_XS,
            GgmlType::MXFP4,
            GgmlType::IQ2_XS,
            GgmlType::IQ3_S,
            GgmlType::F16,
            GgmlType::BF16,
        ] {
            assert!(checked.contains(&ty), "{ty} not checked");
        }
    }

    #[test]
    fn grid_iquants_carry_a_finite_positive_scale_at_offset_zero() {
        for (ty, rms_per_d) in [
            (GgmlType::IQ2_XXS, 9.233 * 0.25 * 23.118),
            (GgmlType::IQ2_S, 9.233 * 0.25 * 24.430),
            (GgmlType::IQ3_XXS, 9.233 * 0.5 * 30.849),
        ] {
            let sd = 0.05f32;
            let bytes = generate(ty, 4096, sd, 3);
            assert_eq!(bytes.len(), 16 * ty.type_size());
            for b in bytes.chunks_exact(ty.type_size()) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                assert!(d.is_finite() && d > 0.0, "{ty}: scale {d}");
                assert!(
                    ((d * rms_per_d) / sd - 1.0).abs() < 0.01,
                    "{ty}: scale {d} gives a spread of {}",
                    d * rms_per_d
                );
            }
            assert_ne!(bytes[2..66], bytes[ty.type_size() + 2..ty.type_size() + 66]);
        }
    }
}
