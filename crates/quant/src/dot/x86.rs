//! x86-64 SIMD dot kernels (AVX2, AVX-512), each reproducing its scalar reference
//! bit for bit: integer inner sums (exact whatever the order; widening or
//! non-saturating instructions only) and the float combination in the reference's
//! order; float formats keep the reference's 64-lane layout with separate multiply
//! and add (no FMA).

use super::ActRow;
use super::scalar::{self, combine, combine_min};
use super::x86_iq as iq;
use super::x86_kquant_avx2 as k2;
use crate::blocks::*;
use crate::error::Result;
use crate::isa::Isa;
use samesum_gguf::GgmlType;
use std::arch::x86_64::*;

/// Formats with AVX2 kernels.
pub(super) const AVX2_FORMATS: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
];

/// Formats with AVX-512 kernels (the others use the AVX2 kernel on AVX-512 CPUs).
pub(super) const AVX512_FORMATS: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
];

/// Run the SIMD kernel for `weight` if `isa` has one; `None` means use scalar.
/// The caller has checked lengths, pairing and that `isa` is supported.
pub(super) fn dot_rows(
    isa: Isa,
    weight: GgmlType,
    w: &[u8],
    act: &ActRow,
    per_row: usize,
    out: &mut [f32],
) -> Result<bool> {
    use GgmlType as T;
    macro_rules! each_row {
        ($kernel:path, $a:expr) => {{
            let blocks = crate::cast_blocks(weight, w)?;
            for (o, wr) in out.iter_mut().zip(blocks.chunks_exact(per_row)) {
                *o = $kernel(wr, $a);
            }
        }};
    }
    // SAFETY (all calls below): `isa.supported()` was checked by the caller, so the
    // CPU has the features each kernel is compiled for; slices were length-checked.
    #[allow(clippy::unit_arg)]
    unsafe {
        match (isa, weight, act) {
            (Isa::Avx512, T::F32, ActRow::F32(x)) => each_row!(f32_avx512, x),
            (Isa::Avx512, T::F16, ActRow::F32(x)) => each_row!(f16_avx512, x),
            (Isa::Avx512, T::BF16, ActRow::F32(x)) => {
                each_row!(bf16_avx512, x)
            }
            (Isa::Avx512, T::Q8_0, ActRow::Q8_0(a)) => {
                each_row!(q8_0_avx512, a)
            }
            (Isa::Avx512, T::Q4_0, ActRow::Q8_0(a)) => {
                each_row!(q4_0_avx512, a)
            }
            (Isa::Avx512, T::Q4_K, ActRow::Q8K(a)) => {
                each_row!(q4_k_avx512, a)
            }
            (Isa::Avx512, T::Q5_K, ActRow::Q8K(a)) => {
                each_row!(q5_k_avx512, a)
            }
            (Isa::Avx512, T::Q6_K, ActRow::Q8K(a)) => {
                each_row!(q6_k_avx512, a)
            }
            (Isa::Avx512, T::IQ4_XS, ActRow::Q8K(a)) => {
                each_row!(iq4_xs_avx512, a)
            }
            (_, T::F32, ActRow::F32(x)) => each_row!(f32_avx2, x),
            (_, T::F16, ActRow::F32(x)) => each_row!(f16_avx2, x),
            (_, T::BF16, ActRow::F32(x)) => each_row!(bf16_avx2, x),
            (_, T::Q8_0, ActRow::Q8_0(a)) => each_row!(q8_0_avx2, a),
            (_, T::Q4_0, ActRow::Q8_0(a)) => each_row!(q4_0_avx2, a),
            (_, T::Q5_0, ActRow::Q8_0(a)) => each_row!(q5_0_avx2, a),
            (_, T::IQ4_NL, ActRow::Q8_0(a)) => each_row!(iq4_nl_avx2, a),
            (_, T::MXFP4, ActRow::Q8_0(a)) => each_row!(mxfp4_avx2, a),
            (_, T::Q4_1, ActRow::Q8_1(a)) => each_row!(q4_1_avx2, a),
            (_, T::Q5_1, ActRow::Q8_1(a)) => each_row!(q5_1_avx2, a),
            (_, T::Q2_K, ActRow::Q8K(a)) => each_row!(k2::q2_k_row, a),
            (_, T::Q3_K, ActRow::Q8K(a)) => each_row!(k2::q3_k_row, a),
            (_, T::Q4_K, ActRow::Q8K(a)) => each_row!(k2::q4_k_row, a),
            (_, T::Q5_K, ActRow::Q8K(a)) => each_row!(k2::q5_k_row, a),
            (_, T::Q6_K, ActRow::Q8K(a)) => each_row!(k2::q6_k_row, a),
            (_, T::IQ4_XS, ActRow::Q8K(a)) => each_row!(iq4_xs_avx2, a),
            (_, T::IQ2_XXS, ActRow::Q8K(a)) => each_row!(iq::iq2_xxs_avx2, a),
            (_, T::IQ2_S, ActRow::Q8K(a)) => each_row!(iq::iq2_s_avx2, a),
            (_, T::IQ3_XXS, ActRow::Q8K(a)) => each_row!(iq::iq3_xxs_avx2, a),
            (_, T::IQ2_XS, ActRow::Q8K(a)) => each_row!(iq::iq2_xs_avx2, a),
            (_, T::IQ3_S, ActRow::Q8K(a)) => each_row!(iq::iq3_s_avx2, a),
            _ => return Ok(false),
        }
    };
    Ok(true)
}

// ---------------------------------------------------------------- float formats

/// Finish a 64-lane accumulation: add the tail elements into their lanes, reduce.
fn finish64(
    lanes: &mut [f32; 64],
    tail: impl Iterator<Item = f32>,
    x: &[f32],
    start: usize,
) -> f32 {
    for (i, wv) in (start..).zip(tail) {
        lanes[i % 64] = lanes[i % 64] + wv * x[i];
    }
    scalar::reduce64(lanes)
}

macro_rules! float_avx2 {
    ($name:ident, $t:ty, $load:expr, $conv:expr) => {
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn $name(w: &[$t], x: &[f32]) -> f32 {
            let n = w.len().min(x.len());
            let full = n / 64 * 64;
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut i = 0;
            while i < full {
                for r in 0..8 {
                    // SAFETY: i + 8r + 8 <= full <= n.
                    let wv = unsafe { $load(w.as_ptr().add(i + 8 * r)) };
                    let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(i + 8 * r)) };
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(wv, xv));
                }
                i += 64;
            }
            let mut lanes = [0f32; 64];
            for r in 0..8 {
                // SAFETY: 8 floats into lanes[8r..8r+8].
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * r), acc[r]) };
            }
            finish64(&mut lanes, w[full..n].iter().map($conv), x, full)
        }
    };
}

macro_rules! float_avx512 {
    ($name:ident, $t:ty, $load:expr, $conv:expr) => {
        #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
        unsafe fn $name(w: &[$t], x: &[f32]) -> f32 {
            let n = w.len().min(x.len());
            let full = n / 64 * 64;
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            while i < full {
                for r in 0..4 {
                    // SAFETY: i + 16r + 16 <= full <= n.
                    let wv = unsafe { $load(w.as_ptr().add(i + 16 * r)) };
                    let xv = unsafe { _mm512_loadu_ps(x.as_ptr().add(i + 16 * r)) };
                    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(wv, xv));
                }
                i += 64;
            }
            let mut lanes = [0f32; 64];
            for r in 0..4 {
                // SAFETY: 16 floats into lanes[16r..16r+16].
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr().add(16 * r), acc[r]) };
            }
            finish64(&mut lanes, w[full..n].iter().map($conv), x, full)
        }
    };
}

#[inline(always)]
unsafe fn ld_f32_8(p: *const f32) -> __m256 {
    unsafe { _mm256_loadu_ps(p) }
}
#[inline(always)]
unsafe fn ld_f16_8(p: *const half::f16) -> __m256 {
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
}
#[inline(always)]
unsafe fn ld_bf16_8(p: *const u16) -> __m256 {
    unsafe {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p as *const __m128i),
        )))
    }
}
#[inline(always)]
unsafe fn ld_f32_16(p: *const f32) -> __m512 {
    unsafe { _mm512_loadu_ps(p) }
}
#[inline(always)]
unsafe fn ld_f16_16(p: *const half::f16) -> __m512 {
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
}
#[inline(always)]
unsafe fn ld_bf16_16(p: *const u16) -> __m512 {
    unsafe {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p as *const __m256i),
        )))
    }
}

float_avx2!(f32_avx2, f32, ld_f32_8, |v: &f32| *v);
float_avx2!(f16_avx2, half::f16, ld_f16_8, |v: &half::f16| f16_to_f32(
    *v
));
float_avx2!(bf16_avx2, u16, ld_bf16_8, |v: &u16| scalar::bf16_to_f32(*v));
float_avx512!(f32_avx512, f32, ld_f32_16, |v: &f32| *v);
float_avx512!(
    f16_avx512,
    half::f16,
    ld_f16_16,
    |v: &half::f16| f16_to_f32(*v)
);
float_avx512!(bf16_avx512, u16, ld_bf16_16, |v: &u16| scalar::bf16_to_f32(
    *v
));

// ---------------------------------------------------------------- integer helpers

#[inline(always)]
pub(super) unsafe fn hsum_i32(v: __m256i) -> i32 {
    unsafe {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }
}

/// Exact signed i8 × i8 products of 32 pairs, summed into 8 i32 lanes.
#[inline(always)]
unsafe fn dot_i8(a: __m256i, b: __m256i) -> __m256i {
    unsafe {
        let a0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(a));
        let a1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(a));
        let b0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b));
        let b1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(b));
        _mm256_add_epi32(_mm256_madd_epi16(a0, b0), _mm256_madd_epi16(a1, b1))
    }
}

#[inline(always)]
pub(super) unsafe fn load256(p: &[i8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }
}

#[inline(always)]
pub(super) unsafe fn load256u(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }
}

// ---------------------------------------------------------------- quantized formats

/// Horizontal sums of 8 vectors: lane `k` of the result is the sum of `v[k]`.
#[inline(always)]
pub(super) unsafe fn hsum8(v: &[__m256i; 8]) -> __m256i {
    unsafe {
        let h01 = _mm256_hadd_epi32(v[0], v[1]);
        let h23 = _mm256_hadd_epi32(v[2], v[3]);
        let h45 = _mm256_hadd_epi32(v[4], v[5]);
        let h67 = _mm256_hadd_epi32(v[6], v[7]);
        let h0123 = _mm256_hadd_epi32(h01, h23);
        let h4567 = _mm256_hadd_epi32(h45, h67);
        let lo = _mm256_permute2x128_si256::<0x20>(h0123, h4567);
        let hi = _mm256_permute2x128_si256::<0x31>(h0123, h4567);
        _mm256_add_epi32(lo, hi)
    }
}

/// [`scalar::reduce8`] of the eight lanes of `acc` after the blocks `tail`
/// (each into lane `b % 8`, as the reference adds them): without a tail, the
/// same three rounds of additions, operands in the same order, by shuffles.
#[inline(always)]
pub(super) unsafe fn finish_lanes8(
    acc: __m256,
    tail: std::ops::Range<usize>,
    term: impl Fn(usize) -> f32,
) -> f32 {
    unsafe {
        if tail.is_empty() {
            // [l0 + l4, l1 + l5, l2 + l6, l3 + l7], then lane 0: (l0 + l4) +
            // (l2 + l6), lane 1: (l1 + l5) + (l3 + l7), then their sum.
            let t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
            return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        for b in tail {
            lanes[b % 8] = lanes[b % 8] + term(b);
        }
        scalar::reduce8(&lanes)
    }
}

/// The 8-lane combination of 32-element formats ([`scalar::lanes8`]), eight blocks
/// at a time: `block(b)` gives block `b`'s exact integer sum (as 8 partial lanes)
/// and the f16 bits of its two scales; a group's scales are converted by F16C
/// (exactly as `f16_to_f32`), multiplied, and combined with one vector multiply and
/// add. The tail goes through the scalar term into the same lanes.
#[inline(always)]
unsafe fn lanes8_avx2(
    nb: usize,
    mut block: impl FnMut(usize) -> (__m256i, u16, u16),
    tail: impl Fn(usize) -> f32,
) -> f32 {
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let groups = nb / 8;
        for g in 0..groups {
            let mut v = [_mm256_setzero_si256(); 8];
            let mut dw = [0u16; 8];
            let mut da = [0u16; 8];
            for k in 0..8 {
                (v[k], dw[k], da[k]) = block(8 * g + k);
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(dw.as_ptr() as *const __m128i));
            let da = _mm256_cvtph_ps(_mm_loadu_si128(da.as_ptr() as *const __m128i));
            let s = _mm256_cvtepi32_ps(hsum8(&v));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dw, da), s));
        }
        finish_lanes8(acc, groups * 8..nb, tail)
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn q8_0_avx2(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_avx2(
            nb,
            |b| {
                let v = dot_i8(load256(&w[b].qs), load256(&a[b].qs));
                (v, w[b].d.to_bits(), a[b].d.to_bits())
            },
            |b| {
                scalar::term(
                    f16_to_f32(w[b].d),
                    f16_to_f32(a[b].d),
                    scalar::sumi_q8_0(&w[b], &a[b]),
                )
            },
        )
    }
}

/// The 32 signed values `q - 8` of a Q4_0 block, in element order.
#[inline(always)]
pub(super) unsafe fn q4_0_values(b: &BlockQ4_0) -> __m256i {
    unsafe { _mm256_sub_epi8(nibbles32(&b.qs), _mm256_set1_epi8(8)) }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn q4_0_avx2(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_avx2(
            nb,
            |b| {
                let v = dot_i8(q4_0_values(&w[b]), load256(&a[b].qs));
                (v, w[b].d.to_bits(), a[b].d.to_bits())
            },
            |b| {
                scalar::term(
                    f16_to_f32(w[b].d),
                    f16_to_f32(a[b].d),
                    scalar::sumi_q4_0(&w[b], &a[b]),
                )
            },
        )
    }
}

/// The 32 nibbles of a 32-value block as unsigned bytes in element order
/// (element j the low nibble of byte j, element j + 16 its high nibble).
#[inline(always)]
pub(super) unsafe fn nibbles32(qs: &[u8; 16]) -> __m256i {
    unsafe {
        let q = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        let m4 = _mm_set1_epi8(0x0F);
        _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(q), m4),
            _mm_and_si128(q, m4),
        )
    }
}

/// The 5-bit values of a Q5_0 / Q5_1 block (nibble | fifth bit << 4),
/// unsigned, in element order.
#[inline(always)]
pub(super) unsafe fn q5_values(qh: &[u8; 4], qs: &[u8; 16]) -> __m256i {
    unsafe {
        let high = _mm256_and_si256(sign_masks(u32::from_le_bytes(*qh)), _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles32(qs), high)
    }
}

/// A 16-entry signed byte table looked up by a block's nibbles.
#[inline(always)]
pub(super) unsafe fn table_values(table: &[i8; 16], qs: &[u8; 16]) -> __m256i {
    unsafe {
        let t = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i));
        _mm256_shuffle_epi8(t, nibbles32(qs))
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn q5_0_avx2(w: &[BlockQ5_0], a: &[BlockQ8_0]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_avx2(
            nb,
            |b| {
                let v = _mm256_sub_epi8(q5_values(&w[b].qh, &w[b].qs), _mm256_set1_epi8(16));
                (
                    dot_i8(v, load256(&a[b].qs)),
                    w[b].d.to_bits(),
                    a[b].d.to_bits(),
                )
            },
            |b| scalar::q5_0_q8_0(&w[b..b + 1], &a[b..b + 1]),
        )
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn iq4_nl_avx2(w: &[BlockIq4Nl], a: &[BlockQ8_0]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_avx2(
            nb,
            |b| {
                let v = table_values(&KVALUES_IQ4NL, &w[b].qs);
                (
                    dot_i8(v, load256(&a[b].qs)),
                    w[b].d.to_bits(),
                    a[b].d.to_bits(),
                )
            },
            |b| scalar::iq4_nl_q8_0(&w[b..b + 1], &a[b..b + 1]),
        )
    }
}

/// [`lanes8_avx2`] with the block's scales given as f32 (MXFP4's E8M0
/// exponent): the same products and sums.
#[inline(always)]
unsafe fn lanes8_f32_avx2(
    nb: usize,
    mut block: impl FnMut(usize) -> (__m256i, f32, f32),
    tail: impl Fn(usize) -> f32,
) -> f32 {
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let groups = nb / 8;
        for g in 0..groups {
            let mut v = [_mm256_setzero_si256(); 8];
            let mut dw = [0f32; 8];
            let mut da = [0f32; 8];
            for k in 0..8 {
                (v[k], dw[k], da[k]) = block(8 * g + k);
            }
            let (dw, da) = (_mm256_loadu_ps(dw.as_ptr()), _mm256_loadu_ps(da.as_ptr()));
            let s = _mm256_cvtepi32_ps(hsum8(&v));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dw, da), s));
        }
        finish_lanes8(acc, groups * 8..nb, tail)
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn mxfp4_avx2(w: &[BlockMxfp4], a: &[BlockQ8_0]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_f32_avx2(
            nb,
            |b| {
                let v = table_values(&KVALUES_MXFP4, &w[b].qs);
                let dw = e8m0_to_f32_half(w[b].e);
                (dot_i8(v, load256(&a[b].qs)), dw, f16_to_f32(a[b].d))
            },
            |b| scalar::mxfp4_q8_0(&w[b..b + 1], &a[b..b + 1]),
        )
    }
}

/// The 8-lane combination of the formats with a min ([`scalar::lanes8`] of
/// `(dw * da) * sumi + m * s`), eight blocks at a time: `block(b)` gives
/// block `b`'s integer sum (8 partial lanes) and the f16 bits of its scale,
/// the activation's scale, its min and the activation's `s`.
#[inline(always)]
unsafe fn lanes8_min_avx2(
    nb: usize,
    mut block: impl FnMut(usize) -> (__m256i, [u16; 4]),
    tail: impl Fn(usize) -> f32,
) -> f32 {
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let groups = nb / 8;
        for g in 0..groups {
            let mut v = [_mm256_setzero_si256(); 8];
            let mut f = [[0u16; 8]; 4];
            for k in 0..8 {
                let (vk, h) = block(8 * g + k);
                v[k] = vk;
                for (i, x) in h.into_iter().enumerate() {
                    f[i][k] = x;
                }
            }
            let [dw, da, m, sa] =
                arr!(i in 4 => _mm256_cvtph_ps(_mm_loadu_si128(f[i].as_ptr() as *const __m128i)));
            let s = _mm256_cvtepi32_ps(hsum8(&v));
            let t = _mm256_add_ps(
                _mm256_mul_ps(_mm256_mul_ps(dw, da), s),
                _mm256_mul_ps(m, sa),
            );
            acc = _mm256_add_ps(acc, t);
        }
        finish_lanes8(acc, groups * 8..nb, tail)
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn q4_1_avx2(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_min_avx2(
            nb,
            |b| {
                let (w, a) = (&w[b], &a[b]);
                let v = dot_i8(nibbles32(&w.qs), load256(&a.qs));
                (
                    v,
                    [w.d.to_bits(), a.d.to_bits(), w.m.to_bits(), a.s.to_bits()],
                )
            },
            |b| scalar::q4_1_q8_1(&w[b..b + 1], &a[b..b + 1]),
        )
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn q5_1_avx2(w: &[BlockQ5_1], a: &[BlockQ8_1]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_min_avx2(
            nb,
            |b| {
                let (w, a) = (&w[b], &a[b]);
                let v = dot_i8(q5_values(&w.qh, &w.qs), load256(&a.qs));
                (
                    v,
                    [w.d.to_bits(), a.d.to_bits(), w.m.to_bits(), a.s.to_bits()],
                )
            },
            |b| scalar::q5_1_q8_1(&w[b..b + 1], &a[b..b + 1]),
        )
    }
}

/// The 2-bit fields at bit `2 sh` of 32 bytes, as bytes 0..3.
#[inline(always)]
pub(super) unsafe fn crumbs(q: __m256i, sh: usize) -> __m256i {
    unsafe {
        _mm256_and_si256(
            _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * sh as i32)),
            _mm256_set1_epi8(3),
        )
    }
}

#[inline(always)]
fn summ_k4(scales: &[u8; 12], a: &BlockQ8K) -> i32 {
    let mut summ = 0i32;
    for j in 0..8 {
        let (_, m) = scale_min_k4(j, scales);
        summ += m as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
    }
    summ
}

/// `IDX_K4[c]`: i16 lane `t` takes scale `2c + t / 16` (the two sub-blocks of
/// nibble chunk `c`, low nibbles first).
pub(super) static IDX_K4: [[i16; 32]; 4] = {
    let mut t = [[0i16; 32]; 4];
    let mut c = 0;
    while c < 4 {
        let mut l = 0;
        while l < 32 {
            t[c][l] = (2 * c + l / 16) as i16;
            l += 1;
        }
        c += 1;
    }
    t
};

/// `IDX_PAIRS`: i16 lane `t` takes entry `t / 2` (each min twice, against the two
/// 16-element sums of its 32-element group).
pub(super) static IDX_PAIRS: [i16; 32] = {
    let mut t = [0i16; 32];
    let mut l = 0;
    while l < 32 {
        t[l] = (l / 2) as i16;
        l += 1;
    }
    t
};

#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn q4_k_avx512(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let idx: [__m512i; 4] =
            std::array::from_fn(|c| _mm512_loadu_si512(IDX_K4[c].as_ptr() as *const _));
        let pairs = _mm512_loadu_si512(IDX_PAIRS.as_ptr() as *const _);
        for (w, a) in w.iter().zip(a) {
            let (sc, mn) = scales_mins_k4(&w.scales);
            let scv = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(sc as i64)));
            let mut v = _mm512_setzero_si512();
            for c in 0..4 {
                // Nibble chunk c: low nibbles are sub-block 2c, high nibbles 2c+1,
                // i.e. elements 64c..64c+64 in order.
                let q = load256u(&w.qs[c * 32..]);
                let qz = join(
                    _mm256_and_si256(q, m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4),
                );
                let az = _mm512_loadu_si512(a.qs[64 * c..].as_ptr() as *const _);
                let p = _mm512_maddubs_epi16(qz, az);
                v = _mm512_add_epi32(
                    v,
                    _mm512_madd_epi16(p, _mm512_permutexvar_epi16(idx[c], scv)),
                );
            }
            let sumi = _mm512_reduce_add_epi32(v);
            // Σ_j m_j (bsum_2j + bsum_2j+1), exactly.
            let mnv = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(mn as i64)));
            let m2 = _mm512_castsi512_si256(_mm512_permutexvar_epi16(pairs, mnv));
            let summ = hsum_i32(_mm256_madd_epi16(
                m2,
                _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i),
            ));
            acc = combine_min(acc, f16_to_f32(w.d), f16_to_f32(w.dmin), a.d, sumi, summ);
        }
    }
    acc
}

#[target_feature(enable = "avx2")]
unsafe fn iq4_xs_avx2(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in w.iter().zip(a) {
        let sc = iq4xs_scales(w);
        let sumi = unsafe {
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                KVALUES_IQ4NL.as_ptr() as *const __m128i
            ));
            let m4 = _mm_set1_epi8(0x0F);
            let mut v = _mm256_setzero_si256();
            for ib in 0..8 {
                let q = _mm_loadu_si128(w.qs[ib * 16..].as_ptr() as *const __m128i);
                let idx = _mm256_set_m128i(
                    _mm_and_si128(_mm_srli_epi16::<4>(q), m4),
                    _mm_and_si128(q, m4),
                );
                let vals = _mm256_shuffle_epi8(table, idx);
                let p = dot_i8(vals, load256(&a.qs[ib * 32..]));
                v = _mm256_add_epi32(v, _mm256_mullo_epi32(p, _mm256_set1_epi32(sc[ib] as i32)));
            }
            hsum_i32(v)
        };
        acc = combine(acc, f16_to_f32(w.d), a.d, sumi);
    }
    acc
}

/// Byte masks of 32 sign bits: byte `i` is all ones where bit `i` of `s` is set.
#[inline(always)]
pub(super) unsafe fn sign_masks(s: u32) -> __m256i {
    unsafe {
        let spread = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let b = _mm256_shuffle_epi8(_mm256_set1_epi32(s as i32), spread);
        _mm256_cmpeq_epi8(_mm256_and_si256(b, bits), bits)
    }
}

// ---------------------------------------------------------------- AVX-512 quantized

/// Two 256-bit halves into one 512-bit register (`lo` in the low half).
#[inline(always)]
pub(super) unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi) }
}

/// Exact signed i8 x i8 products of 32 pairs, summed into 16 i32 lanes.
#[inline(always)]
unsafe fn dot_i8_512(a: __m256i, b: __m256i) -> __m512i {
    unsafe { _mm512_madd_epi16(_mm512_cvtepi8_epi16(a), _mm512_cvtepi8_epi16(b)) }
}

/// Exact i8 x i8 dot of 32 pairs with one 512-bit multiply, folded to 8 lanes.
#[inline(always)]
unsafe fn dot_i8_512_fold(a: __m256i, b: __m256i) -> __m256i {
    unsafe {
        let p = dot_i8_512(a, b);
        _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64::<1>(p))
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
unsafe fn q8_0_avx512(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_avx2(
            nb,
            |b| {
                let v = dot_i8_512_fold(load256(&w[b].qs), load256(&a[b].qs));
                (v, w[b].d.to_bits(), a[b].d.to_bits())
            },
            |b| {
                scalar::term(
                    f16_to_f32(w[b].d),
                    f16_to_f32(a[b].d),
                    scalar::sumi_q8_0(&w[b], &a[b]),
                )
            },
        )
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
unsafe fn q4_0_avx512(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    let nb = w.len().min(a.len());
    unsafe {
        lanes8_avx2(
            nb,
            |b| {
                let v = dot_i8_512_fold(q4_0_values(&w[b]), load256(&a[b].qs));
                (v, w[b].d.to_bits(), a[b].d.to_bits())
            },
            |b| {
                scalar::term(
                    f16_to_f32(w[b].d),
                    f16_to_f32(a[b].d),
                    scalar::sumi_q4_0(&w[b], &a[b]),
                )
            },
        )
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn q5_k_avx512(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in w.iter().zip(a) {
        let sumi = unsafe {
            let m4 = _mm512_set1_epi8(0x0F);
            let sixteen = _mm512_set1_epi8(16);
            let qh = _mm512_broadcast_i64x4(load256u(&w.qh));
            // Fifth bits of sub-block j0 (low half) and j1 (high half), as 0 or 16.
            let high = |j0: usize, j1: usize| {
                let bits = join(
                    _mm256_set1_epi8((1u8 << j0) as i8),
                    _mm256_set1_epi8((1u8 << j1) as i8),
                );
                _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bits), sixteen)
            };
            let s = |k: usize| scale_min_k4(k, &w.scales).0 as i16;
            let mut v = _mm512_setzero_si512();
            for cc in 0..2 {
                // Nibble chunks 2cc (low half) and 2cc+1 (high half): sub-blocks
                // 4cc, 4cc+2 from the low nibbles and 4cc+1, 4cc+3 from the high.
                let q = _mm512_loadu_si512(w.qs[cc * 64..].as_ptr() as *const _);
                let j = 4 * cc;
                let lo = _mm512_or_si512(_mm512_and_si512(q, m4), high(j, j + 2));
                let hi = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4),
                    high(j + 1, j + 3),
                );
                let base = 128 * cc;
                let a_lo = join(load256(&a.qs[base..]), load256(&a.qs[base + 64..]));
                let a_hi = join(load256(&a.qs[base + 32..]), load256(&a.qs[base + 96..]));
                let sc_lo = join(_mm256_set1_epi16(s(j)), _mm256_set1_epi16(s(j + 2)));
                let sc_hi = join(_mm256_set1_epi16(s(j + 1)), _mm256_set1_epi16(s(j + 3)));
                v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(lo, a_lo), sc_lo));
                v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(hi, a_hi), sc_hi));
            }
            _mm512_reduce_add_epi32(v)
        };
        acc = combine_min(
            acc,
            f16_to_f32(w.d),
            f16_to_f32(w.dmin),
            a.d,
            sumi,
            summ_k4(&w.scales, a),
        );
    }
    acc
}

#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn q6_k_avx512(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    unsafe {
        let m4 = _mm512_set1_epi8(0x0F);
        let m2 = _mm512_set1_epi8(0x03);
        let sh_a = join(_mm256_setzero_si256(), _mm256_set1_epi16(2));
        let sh_b = join(_mm256_set1_epi16(4), _mm256_set1_epi16(6));
        // Byte indices [g x8, g+1 x8 | g+2 x8, g+3 x8]: one scale per 16 elements,
        // i.e. per 8 i16 pair sums of maddubs, for the 64 elements of a register.
        let idx0 = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        for (w, a) in w.iter().zip(a) {
            let scales =
                _mm256_broadcastsi128_si256(_mm_loadu_si128(w.scales.as_ptr() as *const __m128i));
            let mut v = _mm512_setzero_si512();
            for n in 0..2 {
                // ql[n*64..n*64+64] holds elements e and e+32 (low nibbles) and
                // e+64, e+96 (high nibbles); qh[n*32..] their top 2 bits.
                let ql = _mm512_loadu_si512(w.ql[n * 64..].as_ptr() as *const _);
                let qh = _mm512_broadcast_i64x4(load256u(&w.qh[n * 32..]));
                let h_a = _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srlv_epi16(qh, sh_a), m2));
                let h_b = _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srlv_epi16(qh, sh_b), m2));
                let q_a = _mm512_or_si512(_mm512_and_si512(ql, m4), h_a);
                let q_b = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4), h_b);
                for (half, q) in [q_a, q_b].into_iter().enumerate() {
                    let e = n * 128 + half * 64;
                    let idx = _mm256_add_epi8(idx0, _mm256_set1_epi8((e / 16) as i8));
                    let sc = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(scales, idx));
                    let av = _mm512_loadu_si512(a.qs[e..].as_ptr() as *const _);
                    v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(q, av), sc));
                }
            }
            let sumi = _mm512_reduce_add_epi32(v);
            // Σ_g sc_g * bsum_g, exactly.
            let corr = hsum_i32(_mm256_madd_epi16(
                _mm256_cvtepi8_epi16(_mm_loadu_si128(w.scales.as_ptr() as *const __m128i)),
                _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i),
            ));
            acc = combine(acc, f16_to_f32(w.d), a.d, sumi.wrapping_sub(32 * corr));
        }
    }
    acc
}

#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn iq4_xs_avx512(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in w.iter().zip(a) {
        let sc = iq4xs_scales(w);
        let sumi = unsafe {
            let table =
                _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
            let m4 = _mm_set1_epi8(0x0F);
            let mut v = _mm512_setzero_si512();
            for ib in (0..8).step_by(2) {
                let q0 = _mm_loadu_si128(w.qs[ib * 16..].as_ptr() as *const __m128i);
                let q1 = _mm_loadu_si128(w.qs[ib * 16 + 16..].as_ptr() as *const __m128i);
                let idx = join(
                    _mm256_set_m128i(
                        _mm_and_si128(_mm_srli_epi16::<4>(q0), m4),
                        _mm_and_si128(q0, m4),
                    ),
                    _mm256_set_m128i(
                        _mm_and_si128(_mm_srli_epi16::<4>(q1), m4),
                        _mm_and_si128(q1, m4),
                    ),
                );
                let vals = _mm512_shuffle_epi8(table, idx);
                let p0 = dot_i8_512(_mm512_castsi512_si256(vals), load256(&a.qs[ib * 32..]));
                let p1 = dot_i8_512(
                    _mm512_extracti64x4_epi64::<1>(vals),
                    load256(&a.qs[ib * 32 + 32..]),
                );
                v = _mm512_add_epi32(v, _mm512_mullo_epi32(p0, _mm512_set1_epi32(sc[ib] as i32)));
                v = _mm512_add_epi32(
                    v,
                    _mm512_mullo_epi32(p1, _mm512_set1_epi32(sc[ib + 1] as i32)),
                );
            }
            _mm512_reduce_add_epi32(v)
        };
        acc = combine(acc, f16_to_f32(w.d), a.d, sumi);
    }
    acc
}
