//! `#[repr(C)]` layouts of the ggml blocks, byte-for-byte as ggml stores them.
//!
//! Every block is `Pod`, so a row of a GGUF tensor is viewed as `&[Block]` with no
//! copy. Sizes are checked against ggml's table at compile time.

use bytemuck::{Pod, Zeroable};
use half::f16;

/// Elements in a K-quant super-block.
pub const QK_K: usize = 256;
/// Elements in a 32-element block (Q4_0 ... Q8_1, IQ4_NL, MXFP4).
pub const QK32: usize = 32;

macro_rules! block {
    ($(#[$doc:meta])* $name:ident, $size:expr, { $($(#[$fdoc:meta])* $f:ident : $t:ty),* $(,)? }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
        pub struct $name { $($(#[$fdoc])* pub $f: $t),* }
        const _: () = assert!(std::mem::size_of::<$name>() == $size);
    };
}

block!(
    /// Q4_0: 32 weights, `d * (q - 8)`, q in 0..16.
    BlockQ4_0, 18, { /** scale */ d: f16, /** nibbles: element j low, j+16 high */ qs: [u8; 16] });
block!(
    /// Q4_1: 32 weights, `d * q + m`.
    BlockQ4_1, 20, { /** scale */ d: f16, /** offset */ m: f16, /** nibbles */ qs: [u8; 16] });
block!(
    /// Q5_0: 32 weights, `d * (q - 16)`, q 5 bits.
    BlockQ5_0, 22, { /** scale */ d: f16, /** fifth bits, bit i for element i (LE u32) */ qh: [u8; 4], /** nibbles */ qs: [u8; 16] });
block!(
    /// Q5_1: 32 weights, `d * q + m`, q 5 bits.
    BlockQ5_1, 24, { /** scale */ d: f16, /** offset */ m: f16, /** fifth bits */ qh: [u8; 4], /** nibbles */ qs: [u8; 16] });
block!(
    /// Q8_0: 32 weights, `d * q`.
    BlockQ8_0, 34, { /** scale */ d: f16, /** quants */ qs: [i8; 32] });
block!(
    /// Q8_1: 32 activations, `d * q`, with `s = d * sum(q)`.
    BlockQ8_1, 36, { /** scale */ d: f16, /** d times the sum of the quants */ s: f16, /** quants */ qs: [i8; 32] });
block!(
    /// Q2_K: 256 weights in 16 groups of 16; 4-bit scale and min per group.
    BlockQ2K, 84, { /** low nibble scale, high nibble min, per group */ scales: [u8; 16], /** 2-bit quants */ qs: [u8; 64], /** super scale */ d: f16, /** super min scale */ dmin: f16 });
block!(
    /// Q3_K: 256 weights in 16 groups of 16; 6-bit signed scales.
    BlockQ3K, 110, { /** high bits (set means no -4 offset) */ hmask: [u8; 32], /** low 2 bits */ qs: [u8; 64], /** packed 6-bit scales */ scales: [u8; 12], /** super scale */ d: f16 });
block!(
    /// Q4_K: 256 weights in 8 groups of 32; 6-bit scale and min per group.
    BlockQ4K, 144, { /** super scale */ d: f16, /** super min scale */ dmin: f16, /** packed 6-bit scales and mins */ scales: [u8; 12], /** nibbles */ qs: [u8; 128] });
block!(
    /// Q5_K: Q4_K plus a fifth bit per weight.
    BlockQ5K, 176, { /** super scale */ d: f16, /** super min scale */ dmin: f16, /** packed 6-bit scales and mins */ scales: [u8; 12], /** fifth bits */ qh: [u8; 32], /** nibbles */ qs: [u8; 128] });
block!(
    /// Q6_K: 256 weights in 16 groups of 16; 8-bit signed scales; `d * sc * (q - 32)`.
    BlockQ6K, 210, { /** low 4 bits */ ql: [u8; 128], /** high 2 bits */ qh: [u8; 64], /** scales */ scales: [i8; 16], /** super scale */ d: f16 });
block!(
    /// Q8_K: 256 activations with an f32 scale and sums of each 16 quants.
    BlockQ8K, 292, { /** scale */ d: f32, /** quants */ qs: [i8; 256], /** sums of quants per 16 */ bsums: [i16; 16] });
block!(
    /// IQ4_NL: 32 weights, `d * KVALUES_IQ4NL[q]`.
    BlockIq4Nl, 18, { /** scale */ d: f16, /** nibbles (table indices) */ qs: [u8; 16] });
block!(
    /// IQ4_XS: 256 weights in 8 groups of 32 with 6-bit signed scales and the IQ4_NL table.
    BlockIq4Xs, 136, { /** super scale */ d: f16, /** high 2 bits of the 8 scales */ scales_h: u16, /** low 4 bits of the scales */ scales_l: [u8; 4], /** nibbles */ qs: [u8; 128] });
block!(
    /// MXFP4: 32 weights, an E8M0 shared exponent and E2M1 values.
    BlockMxfp4, 17, { /** E8M0 exponent */ e: u8, /** nibbles */ qs: [u8; 16] });

block!(
    /// IQ2_XS: 256 weights; each u16 holds a 9-bit grid index (8 magnitudes) and a
    /// 7-bit sign index; a 4-bit scale per 16 weights.
    BlockIq2Xs, 74, { /** super scale */ d: f16, /** grid and sign indices */ qs: [u16; 32], /** 4-bit scales */ scales: [u8; 8] });
block!(
    /// IQ3_S: 256 weights; 9-bit grid indices (4 magnitudes each), explicit sign
    /// bits, a 4-bit scale per 32 weights.
    BlockIq3S, 110, { /** super scale */ d: f16, /** low 8 bits of grid indices */ qs: [u8; 64], /** ninth bits */ qh: [u8; 8], /** sign bits */ signs: [u8; 32], /** 4-bit scales */ scales: [u8; 4] });
block!(
    /// IQ2_XXS: 256 weights in 8 groups of 32. Per group two little-endian u32
    /// (four u16 here): the first holds four 8-bit grid indices (8 magnitudes
    /// each), the second four 7-bit sign indices and a 4-bit scale in its top bits.
    BlockIq2Xxs, 66, { /** super scale */ d: f16, /** grid indices, sign indices and scales */ qs: [u16; 32] });
block!(
    /// IQ3_XXS: 256 weights in 8 groups of 32; 8-bit grid indices (4 magnitudes
    /// each), then per group a little-endian u32 of four 7-bit sign indices and a
    /// 4-bit scale in its top bits. ggml declares one `qs[96]`; split here.
    BlockIq3Xxs, 98, { /** super scale */ d: f16, /** grid indices, 8 per group */ qs: [u8; 64], /** per group a u32 of sign indices and scale */ scales_signs: [u8; 32] });
block!(
    /// IQ2_S: 256 weights; 10-bit grid indices (8 magnitudes each), explicit sign
    /// bits, a 4-bit scale per 16 weights. ggml declares `qs[64]` holding the low
    /// index bits then the signs; split here.
    BlockIq2S, 82, { /** super scale */ d: f16, /** low 8 bits of grid indices */ qs: [u8; 32], /** sign bits, one per weight */ signs: [u8; 32], /** high 2 bits of grid indices, four per byte */ qh: [u8; 8], /** 4-bit scales */ scales: [u8; 8] });

/// f16 to f32, exactly, as the F16C instruction converts (NaNs come out quiet).
///
/// Used by every kernel instead of `half::f16::to_f32`, whose run-time dispatch
/// costs a call (and a spill of every vector register) per block.
#[inline(always)]
pub fn f16_to_f32(h: f16) -> f32 {
    let h = h.to_bits() as u32;
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = h & 0x3ff;
    if exp == 0x1f {
        let nan_quiet = if man != 0 { 0x0040_0000 } else { 0 };
        f32::from_bits(sign | 0x7f80_0000 | nan_quiet | (man << 13))
    } else if exp == 0 {
        // Zero or subnormal: man * 2^-24 is exact in f32.
        let v = man as f32 * f32::from_bits(0x3380_0000);
        f32::from_bits(sign | v.to_bits())
    } else {
        f32::from_bits(sign | ((exp + 112) << 23) | (man << 13))
    }
}

/// The non-linear 4-bit table shared by IQ4_NL and IQ4_XS.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// E2M1 values doubled, indexed by the 4-bit code (MXFP4).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of the E8M0 scale `2^(e-127)`, as ggml's `ggml_e8m0_to_fp32_half`.
#[inline]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// All eight 6-bit scales and mins of a Q4_K/Q5_K block at once, a byte per
/// group (group j in byte j, little-endian): the same values as
/// [`scale_min_k4`] for j = 0..8, from 32-bit masks and shifts instead of
/// eight byte-wise calls.
#[inline]
pub fn scales_mins_k4(s: &[u8; 12]) -> (u64, u64) {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (h1, h2, h3) = (w(0), w(1), w(2));
    let sc_lo = h1 & 0x3f3f_3f3f;
    let mn_lo = h2 & 0x3f3f_3f3f;
    let sc_hi = (h3 & 0x0f0f_0f0f) | (((h1 >> 6) & 0x0303_0303) << 4);
    let mn_hi = ((h3 >> 4) & 0x0f0f_0f0f) | (((h2 >> 6) & 0x0303_0303) << 4);
    (
        sc_lo as u64 | ((sc_hi as u64) << 32),
        mn_lo as u64 | ((mn_hi as u64) << 32),
    )
}

/// Unpack the 6-bit scale and min of group `j` (0..8) of a Q4_K/Q5_K block.
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Unpack the 16 signed 6-bit scales of a Q3_K block.
#[inline]
pub fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for k in 0..16 {
        let lo = if k < 8 { s[k] & 0x0F } else { s[k - 8] >> 4 };
        let hi = (s[8 + (k % 4)] >> (2 * (k / 4))) & 3;
        out[k] = ((lo | (hi << 4)) as i8).wrapping_sub(32);
    }
    out
}

/// The 8 signed 6-bit scales of an IQ4_XS block.
#[inline]
pub fn iq4xs_scales(b: &BlockIq4Xs) -> [i8; 8] {
    let mut out = [0i8; 8];
    for ib in 0..8 {
        let lo = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let hi = ((b.scales_h >> (2 * ib)) & 3) as u8;
        out[ib] = ((lo | (hi << 4)) as i8).wrapping_sub(32);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i_quant_blocks_have_ggml_sizes() {
        use samesum_gguf::GgmlType as T;
        use std::mem::size_of;
        for (ty, size) in [
            (T::IQ2_XXS, size_of::<BlockIq2Xxs>()),
            (T::IQ2_XS, size_of::<BlockIq2Xs>()),
            (T::IQ2_S, size_of::<BlockIq2S>()),
            (T::IQ3_XXS, size_of::<BlockIq3Xxs>()),
            (T::IQ3_S, size_of::<BlockIq3S>()),
            (T::IQ4_XS, size_of::<BlockIq4Xs>()),
        ] {
            assert_eq!(size, ty.type_size(), "{ty}");
            assert_eq!(ty.block_size(), QK_K, "{ty}");
        }
    }

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let (ours, reference) = (f16_to_f32(h), h.to_f32());
            if reference.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
                assert_eq!(
                    ours.to_bits() & 0x0040_0000,
                    0x0040_0000,
                    "{bits:#06x}: NaN not quiet"
                );
            } else {
                assert_eq!(ours.to_bits(), reference.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn all_scales_and_mins_at_once_equal_the_one_group_unpacking() {
        // Every byte value at every position (the others random), then random blocks.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let check = |s: [u8; 12]| {
            let (sc, mn) = scales_mins_k4(&s);
            for j in 0..8 {
                let (a, b) = scale_min_k4(j, &s);
                assert_eq!(((sc >> (8 * j)) & 0xff) as u8, a, "{s:?} scale {j}");
                assert_eq!(((mn >> (8 * j)) & 0xff) as u8, b, "{s:?} min {j}");
            }
        };
        for pos in 0..12 {
            for v in 0..=255u8 {
                let mut s: [u8; 12] = std::array::from_fn(|_| next() as u8);
                s[pos] = v;
                check(s);
            }
        }
        for _ in 0..100_000 {
            check(std::array::from_fn(|_| next() as u8));
        }
    }
}
