//! Dequantization: block bytes to f32, one scalar reference per format.
//!
//! Each routine evaluates the same expression, in the same order and precision, as
//! gguf-py's `gguf.quants.dequantize` (llama.cpp's numpy reference), so the results
//! are bit-identical with it; the oracle test in `tests/oracle` checks that.

use crate::blocks::*;
use crate::error::{QuantError, Result};
use crate::iq_tables::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use crate::{cast_blocks, check_lengths};
use samesum_gguf::GgmlType;

/// Whether [`dequantize`] supports `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
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

/// Dequantize `dst.len()` elements of type `ty` from `src`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_lengths(ty, src.len(), dst.len())?;
    use GgmlType::*;
    match ty {
        F32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        F16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16_to_f32(half::f16::from_le_bytes([c[0], c[1]]));
            }
        }
        BF16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        Q4_0 => each(cast_blocks::<BlockQ4_0>(ty, src)?, dst, q4_0),
        Q4_1 => each(cast_blocks::<BlockQ4_1>(ty, src)?, dst, q4_1),
        Q5_0 => each(cast_blocks::<BlockQ5_0>(ty, src)?, dst, q5_0),
        Q5_1 => each(cast_blocks::<BlockQ5_1>(ty, src)?, dst, q5_1),
        Q8_0 => each(cast_blocks::<BlockQ8_0>(ty, src)?, dst, q8_0),
        Q8_1 => each(cast_blocks::<BlockQ8_1>(ty, src)?, dst, q8_1),
        Q2_K => each(cast_blocks::<BlockQ2K>(ty, src)?, dst, q2_k),
        Q3_K => each(cast_blocks::<BlockQ3K>(ty, src)?, dst, q3_k),
        Q4_K => each(cast_blocks::<BlockQ4K>(ty, src)?, dst, q4_k),
        Q5_K => each(cast_blocks::<BlockQ5K>(ty, src)?, dst, q5_k),
        Q6_K => each(cast_blocks::<BlockQ6K>(ty, src)?, dst, q6_k),
        Q8_K => each(cast_blocks::<BlockQ8K>(ty, src)?, dst, q8_k),
        IQ4_NL => each(cast_blocks::<BlockIq4Nl>(ty, src)?, dst, iq4_nl),
        IQ4_XS => each(cast_blocks::<BlockIq4Xs>(ty, src)?, dst, iq4_xs),
        MXFP4 => each(cast_blocks::<BlockMxfp4>(ty, src)?, dst, mxfp4),
        IQ2_XS => each(cast_blocks::<BlockIq2Xs>(ty, src)?, dst, iq2_xs),
        IQ3_S => each(cast_blocks::<BlockIq3S>(ty, src)?, dst, iq3_s),
        IQ2_XXS => each(cast_blocks::<BlockIq2Xxs>(ty, src)?, dst, iq2_xxs),
        IQ3_XXS => each(cast_blocks::<BlockIq3Xxs>(ty, src)?, dst, iq3_xxs),
        IQ2_S => each(cast_blocks::<BlockIq2S>(ty, src)?, dst, iq2_s),
        other => {
            return Err(QuantError::Unsupported {
                ty: other,
                what: "dequantize",
            });
        }
    }
    Ok(())
}

fn each<B, const N: usize>(blocks: &[B], dst: &mut [f32], f: fn(&B, &mut [f32; N])) {
    for (b, out) in blocks.iter().zip(dst.chunks_exact_mut(N)) {
        f(b, out.try_into().expect("chunk of N"));
    }
}

/// Q4_0 block.
pub fn q4_0(b: &BlockQ4_0, y: &mut [f32; 32]) {
    let d = f16_to_f32(b.d);
    for j in 0..16 {
        y[j] = d * (((b.qs[j] & 0x0F) as i8 - 8) as f32);
        y[j + 16] = d * (((b.qs[j] >> 4) as i8 - 8) as f32);
    }
}

/// Q4_1 block.
pub fn q4_1(b: &BlockQ4_1, y: &mut [f32; 32]) {
    let (d, m) = (f16_to_f32(b.d), f16_to_f32(b.m));
    for j in 0..16 {
        y[j] = d * ((b.qs[j] & 0x0F) as f32) + m;
        y[j + 16] = d * ((b.qs[j] >> 4) as f32) + m;
    }
}

#[inline]
fn q5_values(qh: &[u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    let h = u32::from_le_bytes(*qh);
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0F) | ((((h >> j) & 1) as u8) << 4);
        q[j + 16] = (qs[j] >> 4) | ((((h >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

/// Q5_0 block.
pub fn q5_0(b: &BlockQ5_0, y: &mut [f32; 32]) {
    let d = f16_to_f32(b.d);
    for (o, q) in y.iter_mut().zip(q5_values(&b.qh, &b.qs)) {
        *o = d * ((q as i8 - 16) as f32);
    }
}

/// Q5_1 block.
pub fn q5_1(b: &BlockQ5_1, y: &mut [f32; 32]) {
    let (d, m) = (f16_to_f32(b.d), f16_to_f32(b.m));
    for (o, q) in y.iter_mut().zip(q5_values(&b.qh, &b.qs)) {
        *o = d * (q as f32) + m;
    }
}

/// Q8_0 block.
pub fn q8_0(b: &BlockQ8_0, y: &mut [f32; 32]) {
    let d = f16_to_f32(b.d);
    for (o, &q) in y.iter_mut().zip(&b.qs) {
        *o = (q as f32) * d;
    }
}

/// Q8_1 block (the `s` field is derived data and not used).
pub fn q8_1(b: &BlockQ8_1, y: &mut [f32; 32]) {
    let d = f16_to_f32(b.d);
    for (o, &q) in y.iter_mut().zip(&b.qs) {
        *o = (q as f32) * d;
    }
}

/// Q2_K block.
pub fn q2_k(b: &BlockQ2K, y: &mut [f32; 256]) {
    let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
    for e in 0..256 {
        let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let q = (b.qs[n * 32 + l] >> (2 * s)) & 3;
        let sc = b.scales[e / 16];
        let dl = d * ((sc & 0x0F) as f32);
        let ml = dmin * ((sc >> 4) as f32);
        y[e] = dl * (q as f32) - ml;
    }
}

/// Q3_K block.
pub fn q3_k(b: &BlockQ3K, y: &mut [f32; 256]) {
    let d = f16_to_f32(b.d);
    let sc = q3k_scales(&b.scales);
    for e in 0..256 {
        let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let ql = ((b.qs[n * 32 + l] >> (2 * s)) & 3) as i8;
        let hbit = (b.hmask[l] >> (e / 32)) & 1;
        let q = ql - (((hbit ^ 1) << 2) as i8);
        let dl = d * (sc[e / 16] as f32);
        y[e] = dl * (q as f32);
    }
}

/// Q4_K block.
pub fn q4_k(b: &BlockQ4K, y: &mut [f32; 256]) {
    let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b.scales);
        let dl = d * (sc as f32);
        let ml = dmin * (m as f32);
        let (c, shift) = (j / 2, 4 * (j % 2));
        for l in 0..32 {
            let q = (b.qs[c * 32 + l] >> shift) & 0x0F;
            y[j * 32 + l] = dl * (q as f32) - ml;
        }
    }
}

/// Q5_K block.
pub fn q5_k(b: &BlockQ5K, y: &mut [f32; 256]) {
    let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b.scales);
        let dl = d * (sc as f32);
        let ml = dmin * (m as f32);
        let (c, shift) = (j / 2, 4 * (j % 2));
        for l in 0..32 {
            let q = ((b.qs[c * 32 + l] >> shift) & 0x0F) | (((b.qh[l] >> j) & 1) << 4);
            y[j * 32 + l] = dl * (q as f32) - ml;
        }
    }
}

/// The 6-bit value of element `e` of a Q6_K block, before the -32 offset.
#[inline]
pub fn q6k_value(b: &BlockQ6K, e: usize) -> u8 {
    let (n, r) = (e / 128, e % 128);
    let lo = (b.ql[n * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
    let hi = (b.qh[n * 32 + r % 32] >> (2 * (r / 32))) & 3;
    lo | (hi << 4)
}

/// Q6_K block.
pub fn q6_k(b: &BlockQ6K, y: &mut [f32; 256]) {
    let d = f16_to_f32(b.d);
    for e in 0..256 {
        let q = q6k_value(b, e) as i8 - 32;
        let dl = d * (b.scales[e / 16] as f32);
        y[e] = dl * (q as f32);
    }
}

/// Q8_K block.
pub fn q8_k(b: &BlockQ8K, y: &mut [f32; 256]) {
    for (o, &q) in y.iter_mut().zip(&b.qs) {
        *o = b.d * (q as f32);
    }
}

/// IQ4_NL block.
pub fn iq4_nl(b: &BlockIq4Nl, y: &mut [f32; 32]) {
    let d = f16_to_f32(b.d);
    for j in 0..16 {
        y[j] = d * (KVALUES_IQ4NL[(b.qs[j] & 0x0F) as usize] as f32);
        y[j + 16] = d * (KVALUES_IQ4NL[(b.qs[j] >> 4) as usize] as f32);
    }
}

/// IQ4_XS block.
pub fn iq4_xs(b: &BlockIq4Xs, y: &mut [f32; 256]) {
    let d = f16_to_f32(b.d);
    let sc = iq4xs_scales(b);
    for ib in 0..8 {
        let dl = d * (sc[ib] as f32);
        let qs = &b.qs[ib * 16..ib * 16 + 16];
        for j in 0..16 {
            y[ib * 32 + j] = dl * (KVALUES_IQ4NL[(qs[j] & 0x0F) as usize] as f32);
            y[ib * 32 + j + 16] = dl * (KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32);
        }
    }
}

/// MXFP4 block.
pub fn mxfp4(b: &BlockMxfp4, y: &mut [f32; 32]) {
    let d = e8m0_to_f32_half(b.e);
    for j in 0..16 {
        y[j] = d * (KVALUES_MXFP4[(b.qs[j] & 0x0F) as usize] as f32);
        y[j + 16] = d * (KVALUES_MXFP4[(b.qs[j] >> 4) as usize] as f32);
    }
}

/// IQ2_XS block: `((d * (0.5 + sc)) * 0.25 * grid) * sign`, as gguf-py evaluates it.
pub fn iq2_xs(b: &BlockIq2Xs, y: &mut [f32; 256]) {
    let d = f16_to_f32(b.d);
    for k in 0..16 {
        let sc = (b.scales[k / 2] >> (4 * (k % 2))) & 0x0F;
        let db = d * (0.5 + sc as f32) * 0.25;
        for h in 0..2 {
            let q = b.qs[2 * k + h];
            let grid = &IQ2XS_GRID[(q & 511) as usize];
            let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
            for i in 0..8 {
                let sign = if (signs >> i) & 1 == 0 { 1.0f32 } else { -1.0 };
                y[k * 16 + h * 8 + i] = db * grid[i] as f32 * sign;
            }
        }
    }
}

/// IQ3_S block: `(d * (1 + 2 sc) * grid) * sign`, as gguf-py evaluates it.
pub fn iq3_s(b: &BlockIq3S, y: &mut [f32; 256]) {
    let d = f16_to_f32(b.d);
    for k in 0..8 {
        let sc = (b.scales[k / 2] >> (4 * (k % 2))) & 0x0F;
        let db = d * (1 + 2 * sc) as f32;
        for j in 0..8 {
            let e = k * 8 + j;
            let idx = b.qs[e] as usize | ((((b.qh[e / 8] >> (e % 8)) & 1) as usize) << 8);
            let grid = &IQ3S_GRID[idx];
            for i in 0..4 {
                let el = e * 4 + i;
                let sign = if (b.signs[el / 8] >> (el % 8)) & 1 == 0 {
                    1.0f32
                } else {
                    -1.0
                };
                y[el] = db * grid[i] as f32 * sign;
            }
        }
    }
}

/// `±1.0` for bit `i` of sign byte `signs` (set means negative).
#[inline]
fn sign(signs: u8, i: usize) -> f32 {
    if (signs >> i) & 1 == 0 { 1.0 } else { -1.0 }
}

/// The two little-endian u32 words of IQ2_XXS group `ib` (0..8): four grid
/// indices, then four sign indices with the scale in the top 4 bits.
#[inline]
pub fn iq2_xxs_words(b: &BlockIq2Xxs, ib: usize) -> (u32, u32) {
    let q = &b.qs[4 * ib..4 * ib + 4];
    (
        q[0] as u32 | (q[1] as u32) << 16,
        q[2] as u32 | (q[3] as u32) << 16,
    )
}

/// The sign-and-scale word of IQ3_XXS group `ib` (0..8).
#[inline]
pub fn iq3_xxs_word(b: &BlockIq3Xxs, ib: usize) -> u32 {
    let s = &b.scales_signs[4 * ib..4 * ib + 4];
    u32::from_le_bytes([s[0], s[1], s[2], s[3]])
}

/// The 10-bit grid index of IQ2_S element group `m` (0..32, 8 weights each).
#[inline]
pub fn iq2_s_index(b: &BlockIq2S, m: usize) -> usize {
    b.qs[m] as usize | ((((b.qh[m / 4] >> (2 * (m % 4))) & 3) as usize) << 8)
}

/// IQ2_XXS block: `((d * (0.5 + sc)) * 0.25 * grid) * sign`, as gguf-py evaluates it.
pub fn iq2_xxs(b: &BlockIq2Xxs, y: &mut [f32; 256]) {
    let d = f16_to_f32(b.d);
    for ib in 0..8 {
        let (grids, aux) = iq2_xxs_words(b, ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[((grids >> (8 * l)) & 0xff) as usize].to_le_bytes();
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            for i in 0..8 {
                y[ib * 32 + l * 8 + i] = db * grid[i] as f32 * sign(signs, i);
            }
        }
    }
}

/// IQ3_XXS block: `((d * (0.5 + sc)) * 0.5 * grid) * sign`, as gguf-py evaluates it.
pub fn iq3_xxs(b: &BlockIq3Xxs, y: &mut [f32; 256]) {
    let d = f16_to_f32(b.d);
    for ib in 0..8 {
        let aux = iq3_xxs_word(b, ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            for h in 0..2 {
                let grid = IQ3XXS_GRID[b.qs[ib * 8 + l * 2 + h] as usize].to_le_bytes();
                for i in 0..4 {
                    let j = h * 4 + i;
                    y[ib * 32 + l * 8 + j] = db * grid[i] as f32 * sign(signs, j);
                }
            }
        }
    }
}

/// IQ2_S block: `((d * (0.5 + sc)) * 0.25 * grid) * sign`, as gguf-py evaluates it.
pub fn iq2_s(b: &BlockIq2S, y: &mut [f32; 256]) {
    let d = f16_to_f32(b.d);
    for k in 0..16 {
        let sc = (b.scales[k / 2] >> (4 * (k % 2))) & 0x0F;
        let db = d * (0.5 + sc as f32) * 0.25;
        for h in 0..2 {
            let m = 2 * k + h;
            let grid = IQ2S_GRID[iq2_s_index(b, m)].to_le_bytes();
            for i in 0..8 {
                y[m * 8 + i] = db * grid[i] as f32 * sign(b.signs[m], i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn can_dequantize_matches_dequantize() {
        for &ty in GgmlType::ALL {
            let n = ty.block_size() * 2;
            let src = vec![0u8; 2 * ty.type_size()];
            let mut dst = vec![1f32; n];
            let ok = dequantize(ty, &src, &mut dst).is_ok();
            assert_eq!(ok, can_dequantize(ty), "{ty}");
            if ok {
                assert!(
                    dst.iter().all(|&v| v == 0.0),
                    "{ty}: zero blocks must give zeros"
                );
            }
        }
    }
}
