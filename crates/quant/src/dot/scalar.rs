//! Scalar reference dot kernels: the definition every SIMD path must reproduce
//! byte for byte.
//!
//! Quantized formats: each block's inner sum is an exact integer. The float
//! combination of 256-element formats is, per block in order,
//! `acc += (d_w * d_a) * (sumi as f32)` (and for formats with mins, then
//! `acc -= (dmin_w * d_a) * (summ as f32)`); 32-element formats put block `b`'s
//! term into lane `b % 8` and reduce the 8 lanes by a fixed tree ([`lanes8`]). Float formats:
//! element `i` accumulates into lane `i % 64` as `lane = lane + w*x` (no FMA), then
//! the lanes reduce by the fixed tree of [`reduce64`].

use crate::blocks::*;
use crate::dequant::{iq2_s_index, iq2_xxs_words, iq3_xxs_word};
use crate::iq_tables::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};

/// Reduce 16 lanes: halves added (i, i+8), then (i, i+4), (i, i+2), (0, 1).
#[inline]
pub fn reduce16(l: &[f32; 16]) -> f32 {
    let mut s = [0f32; 8];
    for i in 0..8 {
        s[i] = l[i] + l[i + 8];
    }
    let t = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

/// Reduce 64 lanes: (i, i+32), then (i, i+16), then [`reduce16`].
#[inline]
pub fn reduce64(l: &[f32; 64]) -> f32 {
    let mut s = [0f32; 32];
    for i in 0..32 {
        s[i] = l[i] + l[i + 32];
    }
    let mut t = [0f32; 16];
    for i in 0..16 {
        t[i] = s[i] + s[i + 16];
    }
    reduce16(&t)
}

/// Add `w[i] * x[i]` for `i` in `start..` into lane `i % 64`.
#[inline]
pub fn f32_lanes_tail(
    lanes: &mut [f32; 64],
    w: impl Iterator<Item = f32>,
    x: &[f32],
    start: usize,
) {
    for (i, wv) in (start..).zip(w) {
        lanes[i % 64] = lanes[i % 64] + wv * x[i];
    }
}

/// F32 weights · f32 activations.
pub fn f32_f32(w: &[f32], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 64];
    f32_lanes_tail(&mut lanes, w.iter().copied(), x, 0);
    reduce64(&lanes)
}

/// F16 weights · f32 activations.
pub fn f16_f32(w: &[half::f16], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 64];
    f32_lanes_tail(&mut lanes, w.iter().map(|v| f16_to_f32(*v)), x, 0);
    reduce64(&lanes)
}

/// bf16 bits to f32.
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// BF16 weights · f32 activations.
pub fn bf16_f32(w: &[u16], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 64];
    f32_lanes_tail(&mut lanes, w.iter().map(|&v| bf16_to_f32(v)), x, 0);
    reduce64(&lanes)
}

/// Combine one block: `acc + (dw*da) * sumi`.
#[inline]
pub fn combine(acc: f32, dw: f32, da: f32, sumi: i32) -> f32 {
    acc + (dw * da) * (sumi as f32)
}

/// Combine one block of an i-quant whose sums carry a fixed power-of-two factor
/// `k` (ggml's 0.125 or 0.25): `acc + ((dw * da) * k) * sumi`.
#[inline]
pub fn combine_scaled(acc: f32, dw: f32, da: f32, k: f32, sumi: i32) -> f32 {
    acc + ((dw * da) * k) * (sumi as f32)
}

/// Combine one block with mins: `(acc + (d*da)*sumi) - (dmin*da)*summ`.
#[inline]
pub fn combine_min(acc: f32, d: f32, dmin: f32, da: f32, sumi: i32, summ: i32) -> f32 {
    let acc = acc + (d * da) * (sumi as f32);
    acc - (dmin * da) * (summ as f32)
}

/// Integer inner sum of a Q4_0 block with a Q8_0 block.
#[inline]
pub fn sumi_q4_0(w: &BlockQ4_0, a: &BlockQ8_0) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += ((w.qs[j] & 0x0F) as i32 - 8) * a.qs[j] as i32;
        s += ((w.qs[j] >> 4) as i32 - 8) * a.qs[j + 16] as i32;
    }
    s
}

/// Reduce 8 lanes: (i, i+4), then (i, i+2), then (0, 1).
#[inline]
pub fn reduce8(l: &[f32; 8]) -> f32 {
    let t = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

/// The float combination of every 32-element format: block `b`'s term goes into
/// lane `b % 8` (`lane = lane + term`), then [`reduce8`]. Eight independent lanes
/// let SIMD kernels combine eight blocks per instruction with the same rounding.
#[inline]
pub fn lanes8<W, A>(w: &[W], a: &[A], term: impl Fn(&W, &A) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    for (b, (w, a)) in w.iter().zip(a).enumerate() {
        lanes[b % 8] = lanes[b % 8] + term(w, a);
    }
    reduce8(&lanes)
}

/// One block's term: `(dw * da) * sumi`.
#[inline(always)]
pub fn term(dw: f32, da: f32, sumi: i32) -> f32 {
    (dw * da) * (sumi as f32)
}

/// Q4_0 · Q8_0.
pub fn q4_0_q8_0(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    lanes8(w, a, |w, a| {
        term(f16_to_f32(w.d), f16_to_f32(a.d), sumi_q4_0(w, a))
    })
}

/// Integer inner sum of a Q4_1 block (unsigned nibbles) with a Q8_1 block.
#[inline]
pub fn sumi_q4_1(w: &BlockQ4_1, a: &BlockQ8_1) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += (w.qs[j] & 0x0F) as i32 * a.qs[j] as i32;
        s += (w.qs[j] >> 4) as i32 * a.qs[j + 16] as i32;
    }
    s
}

/// Q4_1 · Q8_1: term `(dw*da)*sumi + m*s`.
pub fn q4_1_q8_1(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
    lanes8(w, a, |w, a| {
        term(f16_to_f32(w.d), f16_to_f32(a.d), sumi_q4_1(w, a)) + f16_to_f32(w.m) * f16_to_f32(a.s)
    })
}

fn q5(qh: &[u8; 4], qs: &[u8; 16], j: usize) -> i32 {
    let h = u32::from_le_bytes(*qh);
    let nib = if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    };
    (nib | ((((h >> j) & 1) as u8) << 4)) as i32
}

/// Q5_0 · Q8_0.
pub fn q5_0_q8_0(w: &[BlockQ5_0], a: &[BlockQ8_0]) -> f32 {
    lanes8(w, a, |w, a| {
        let s: i32 = (0..32)
            .map(|j| (q5(&w.qh, &w.qs, j) - 16) * a.qs[j] as i32)
            .sum();
        term(f16_to_f32(w.d), f16_to_f32(a.d), s)
    })
}

/// Q5_1 · Q8_1.
pub fn q5_1_q8_1(w: &[BlockQ5_1], a: &[BlockQ8_1]) -> f32 {
    lanes8(w, a, |w, a| {
        let s: i32 = (0..32).map(|j| q5(&w.qh, &w.qs, j) * a.qs[j] as i32).sum();
        term(f16_to_f32(w.d), f16_to_f32(a.d), s) + f16_to_f32(w.m) * f16_to_f32(a.s)
    })
}

/// Integer inner sum of two Q8_0 blocks.
#[inline]
pub fn sumi_q8_0(w: &BlockQ8_0, a: &BlockQ8_0) -> i32 {
    w.qs.iter()
        .zip(&a.qs)
        .map(|(&x, &y)| x as i32 * y as i32)
        .sum()
}

/// Q8_0 · Q8_0.
pub fn q8_0_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    lanes8(w, a, |w, a| {
        term(f16_to_f32(w.d), f16_to_f32(a.d), sumi_q8_0(w, a))
    })
}

/// IQ4_NL · Q8_0.
pub fn iq4_nl_q8_0(w: &[BlockIq4Nl], a: &[BlockQ8_0]) -> f32 {
    lanes8(w, a, |w, a| {
        let mut s = 0i32;
        for j in 0..16 {
            s += KVALUES_IQ4NL[(w.qs[j] & 0x0F) as usize] as i32 * a.qs[j] as i32;
            s += KVALUES_IQ4NL[(w.qs[j] >> 4) as usize] as i32 * a.qs[j + 16] as i32;
        }
        term(f16_to_f32(w.d), f16_to_f32(a.d), s)
    })
}

/// MXFP4 · Q8_0.
pub fn mxfp4_q8_0(w: &[BlockMxfp4], a: &[BlockQ8_0]) -> f32 {
    lanes8(w, a, |w, a| {
        let mut s = 0i32;
        for j in 0..16 {
            s += KVALUES_MXFP4[(w.qs[j] & 0x0F) as usize] as i32 * a.qs[j] as i32;
            s += KVALUES_MXFP4[(w.qs[j] >> 4) as usize] as i32 * a.qs[j + 16] as i32;
        }
        term(e8m0_to_f32_half(w.e), f16_to_f32(a.d), s)
    })
}

/// Q2_K · Q8_K.
pub fn q2_k_q8_k(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        let (mut sumi, mut summ) = (0i32, 0i32);
        for g in 0..16 {
            let mut s = 0i32;
            for i in 0..16 {
                let e = g * 16 + i;
                let (n, sh, l) = (e / 128, (e % 128) / 32, e % 32);
                let q = (w.qs[n * 32 + l] >> (2 * sh)) & 3;
                s += q as i32 * a.qs[e] as i32;
            }
            sumi += (w.scales[g] & 0x0F) as i32 * s;
            summ += (w.scales[g] >> 4) as i32 * a.bsums[g] as i32;
        }
        combine_min(acc, f16_to_f32(w.d), f16_to_f32(w.dmin), a.d, sumi, summ)
    })
}

/// Q3_K · Q8_K.
pub fn q3_k_q8_k(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        let sc = q3k_scales(&w.scales);
        let mut sumi = 0i32;
        for g in 0..16 {
            let mut s = 0i32;
            for i in 0..16 {
                let e = g * 16 + i;
                let (n, sh, l) = (e / 128, (e % 128) / 32, e % 32);
                let ql = ((w.qs[n * 32 + l] >> (2 * sh)) & 3) as i32;
                let h = ((w.hmask[l] >> (e / 32)) & 1) as i32;
                s += (ql - 4 * (1 - h)) * a.qs[e] as i32;
            }
            sumi += sc[g] as i32 * s;
        }
        combine(acc, f16_to_f32(w.d), a.d, sumi)
    })
}

/// Integer sums of a Q4_K block with a Q8_K block: (Σ sc·Σqa, Σ m·bsum).
#[inline]
pub fn sumi_q4_k(w: &BlockQ4K, a: &BlockQ8K) -> (i32, i32) {
    let (mut sumi, mut summ) = (0i32, 0i32);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &w.scales);
        let (c, shift) = (j / 2, 4 * (j % 2));
        let mut s = 0i32;
        for l in 0..32 {
            s += ((w.qs[c * 32 + l] >> shift) & 0x0F) as i32 * a.qs[j * 32 + l] as i32;
        }
        sumi += sc as i32 * s;
        summ += m as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
    }
    (sumi, summ)
}

/// Q4_K · Q8_K.
pub fn q4_k_q8_k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        let (sumi, summ) = sumi_q4_k(w, a);
        combine_min(acc, f16_to_f32(w.d), f16_to_f32(w.dmin), a.d, sumi, summ)
    })
}

/// Integer sums of a Q5_K block with a Q8_K block.
#[inline]
pub fn sumi_q5_k(w: &BlockQ5K, a: &BlockQ8K) -> (i32, i32) {
    let (mut sumi, mut summ) = (0i32, 0i32);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &w.scales);
        let (c, shift) = (j / 2, 4 * (j % 2));
        let mut s = 0i32;
        for l in 0..32 {
            let q = ((w.qs[c * 32 + l] >> shift) & 0x0F) | (((w.qh[l] >> j) & 1) << 4);
            s += q as i32 * a.qs[j * 32 + l] as i32;
        }
        sumi += sc as i32 * s;
        summ += m as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
    }
    (sumi, summ)
}

/// Q5_K · Q8_K.
pub fn q5_k_q8_k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        let (sumi, summ) = sumi_q5_k(w, a);
        combine_min(acc, f16_to_f32(w.d), f16_to_f32(w.dmin), a.d, sumi, summ)
    })
}

/// Integer sum of a Q6_K block with a Q8_K block: Σ_g sc_g·(Σ q·a − 32·bsum_g).
#[inline]
pub fn sumi_q6_k(w: &BlockQ6K, a: &BlockQ8K) -> i32 {
    let mut sumi = 0i32;
    for g in 0..16 {
        let mut s = 0i32;
        for i in 0..16 {
            let e = g * 16 + i;
            s += crate::dequant::q6k_value(w, e) as i32 * a.qs[e] as i32;
        }
        sumi += w.scales[g] as i32 * (s - 32 * a.bsums[g] as i32);
    }
    sumi
}

/// Q6_K · Q8_K.
pub fn q6_k_q8_k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        combine(acc, f16_to_f32(w.d), a.d, sumi_q6_k(w, a))
    })
}

/// Integer sum of an IQ4_XS block with a Q8_K block.
#[inline]
pub fn sumi_iq4_xs(w: &BlockIq4Xs, a: &BlockQ8K) -> i32 {
    let sc = iq4xs_scales(w);
    let mut sumi = 0i32;
    for ib in 0..8 {
        let mut s = 0i32;
        for j in 0..16 {
            let q = w.qs[ib * 16 + j];
            s += KVALUES_IQ4NL[(q & 0x0F) as usize] as i32 * a.qs[ib * 32 + j] as i32;
            s += KVALUES_IQ4NL[(q >> 4) as usize] as i32 * a.qs[ib * 32 + j + 16] as i32;
        }
        sumi += sc[ib] as i32 * s;
    }
    sumi
}

/// IQ4_XS · Q8_K.
pub fn iq4_xs_q8_k(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        combine(acc, f16_to_f32(w.d), a.d, sumi_iq4_xs(w, a))
    })
}

/// IQ2_XS · Q8_K: `sumi = Σ_k (2 sc_k + 1) · Σ grid·sign·a`, then
/// `acc + ((dw*da) * 0.125) * sumi`.
pub fn iq2_xs_q8_k(w: &[BlockIq2Xs], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        let mut sumi = 0i32;
        for k in 0..16 {
            let sc = ((w.scales[k / 2] >> (4 * (k % 2))) & 0x0F) as i32;
            let mut s = 0i32;
            for h in 0..2 {
                let q = w.qs[2 * k + h];
                let grid = &IQ2XS_GRID[(q & 511) as usize];
                let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
                for i in 0..8 {
                    let v = grid[i] as i32 * a.qs[k * 16 + h * 8 + i] as i32;
                    s += if (signs >> i) & 1 == 0 { v } else { -v };
                }
            }
            sumi += (2 * sc + 1) * s;
        }
        combine_scaled(acc, f16_to_f32(w.d), a.d, 0.125, sumi)
    })
}

/// IQ3_S · Q8_K: `sumi = Σ_k (2 sc_k + 1) · Σ grid·sign·a`.
pub fn iq3_s_q8_k(w: &[BlockIq3S], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        let mut sumi = 0i32;
        for k in 0..8 {
            let sc = ((w.scales[k / 2] >> (4 * (k % 2))) & 0x0F) as i32;
            let mut s = 0i32;
            for j in 0..8 {
                let e = k * 8 + j;
                let idx = w.qs[e] as usize | ((((w.qh[e / 8] >> (e % 8)) & 1) as usize) << 8);
                let grid = &IQ3S_GRID[idx];
                for i in 0..4 {
                    let el = e * 4 + i;
                    let v = grid[i] as i32 * a.qs[el] as i32;
                    s += if (w.signs[el / 8] >> (el % 8)) & 1 == 0 {
                        v
                    } else {
                        -v
                    };
                }
            }
            sumi += (2 * sc + 1) * s;
        }
        combine(acc, f16_to_f32(w.d), a.d, sumi)
    })
}

/// `Σ_i ±grid[i]·a[i]` over one group of 8 (bit `i` of `signs` set means minus).
#[inline]
fn signed_dot8(grid: [u8; 8], signs: u8, a: &[i8]) -> i32 {
    let mut s = 0i32;
    for i in 0..8 {
        let v = grid[i] as i32 * a[i] as i32;
        s += if (signs >> i) & 1 == 0 { v } else { -v };
    }
    s
}

/// Integer sum of an IQ2_XXS block with a Q8_K block: `Σ_ib (2 sc_ib + 1) ·
/// Σ grid·sign·a` over the 8 groups of 32.
#[inline]
pub fn sumi_iq2_xxs(w: &BlockIq2Xxs, a: &BlockQ8K) -> i32 {
    let mut sumi = 0i32;
    for ib in 0..8 {
        let (grids, aux) = iq2_xxs_words(w, ib);
        let mut s = 0i32;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[((grids >> (8 * l)) & 0xff) as usize].to_le_bytes();
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            let off = ib * 32 + l * 8;
            s += signed_dot8(grid, signs, &a.qs[off..off + 8]);
        }
        sumi += (2 * (aux >> 28) as i32 + 1) * s;
    }
    sumi
}

/// IQ2_XXS · Q8_K: `acc + ((dw*da) * 0.125) * sumi` per block.
pub fn iq2_xxs_q8_k(w: &[BlockIq2Xxs], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        combine_scaled(acc, f16_to_f32(w.d), a.d, 0.125, sumi_iq2_xxs(w, a))
    })
}

/// Integer sum of an IQ3_XXS block with a Q8_K block: `Σ_ib (2 sc_ib + 1) ·
/// Σ grid·sign·a` over the 8 groups of 32.
#[inline]
pub fn sumi_iq3_xxs(w: &BlockIq3Xxs, a: &BlockQ8K) -> i32 {
    let mut sumi = 0i32;
    for ib in 0..8 {
        let aux = iq3_xxs_word(w, ib);
        let mut s = 0i32;
        for l in 0..4 {
            let g0 = IQ3XXS_GRID[w.qs[ib * 8 + 2 * l] as usize].to_le_bytes();
            let g1 = IQ3XXS_GRID[w.qs[ib * 8 + 2 * l + 1] as usize].to_le_bytes();
            let grid = [g0[0], g0[1], g0[2], g0[3], g1[0], g1[1], g1[2], g1[3]];
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            let off = ib * 32 + l * 8;
            s += signed_dot8(grid, signs, &a.qs[off..off + 8]);
        }
        sumi += (2 * (aux >> 28) as i32 + 1) * s;
    }
    sumi
}

/// IQ3_XXS · Q8_K: `acc + ((dw*da) * 0.25) * sumi` per block.
pub fn iq3_xxs_q8_k(w: &[BlockIq3Xxs], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        combine_scaled(acc, f16_to_f32(w.d), a.d, 0.25, sumi_iq3_xxs(w, a))
    })
}

/// Integer sum of an IQ2_S block with a Q8_K block: `Σ_k (2 sc_k + 1) ·
/// Σ grid·sign·a` over the 16 groups of 16.
#[inline]
pub fn sumi_iq2_s(w: &BlockIq2S, a: &BlockQ8K) -> i32 {
    let mut sumi = 0i32;
    for k in 0..16 {
        let sc = ((w.scales[k / 2] >> (4 * (k % 2))) & 0x0F) as i32;
        let mut s = 0i32;
        for h in 0..2 {
            let m = 2 * k + h;
            let grid = IQ2S_GRID[iq2_s_index(w, m)].to_le_bytes();
            s += signed_dot8(grid, w.signs[m], &a.qs[m * 8..m * 8 + 8]);
        }
        sumi += (2 * sc + 1) * s;
    }
    sumi
}

/// IQ2_S · Q8_K: `acc + ((dw*da) * 0.125) * sumi` per block.
pub fn iq2_s_q8_k(w: &[BlockIq2S], a: &[BlockQ8K]) -> f32 {
    w.iter().zip(a).fold(0.0, |acc, (w, a)| {
        combine_scaled(acc, f16_to_f32(w.d), a.d, 0.125, sumi_iq2_s(w, a))
    })
}
