//! Activation rows quantized for the matmuls: the same bytes as
//! [`ActRow::quantize`], with Q8_0 (the partner of Q8_0, Q4_0, Q5_0, IQ4_NL
//! and MXFP4 weights) computed by an AVX-512 kernel, or elsewhere by a
//! kernel the compiler vectorizes.
//!
//! `f32::round` is a library call on baseline x86_64, once per element; here
//! it is `trunc` plus a half-away-from-zero step, which is the same function:
//! `v - trunc(v)` is exact, so `|v - trunc(v)| >= 0.5` is exactly the case
//! where `round` moves away from zero (NaN and infinities take the `trunc`
//! branch, as they do in `round`). The block scale's max is a max, exact in
//! any order.

use samesum_quant::GgmlType;
use samesum_quant::blocks::BlockQ8_0;
use samesum_quant::dot::{self, ActRow};

/// `x` quantized for a dot with weights of type `weight`; `None` for a
/// weight type without a dot kernel or a row that is not whole blocks.
pub(crate) fn quantize(weight: GgmlType, x: &[f32]) -> Option<ActRow> {
    if dot::act_type(weight) == Some(GgmlType::Q8_0) && x.len().is_multiple_of(32) {
        let mut out = Vec::with_capacity(x.len() / 32);
        q8_0_row(x, &mut out);
        return Some(ActRow::Q8_0(out));
    }
    ActRow::quantize(weight, x).ok()
}

/// `v.round()` (half away from zero) without the library call.
#[inline(always)]
fn round_half_away(v: f32) -> f32 {
    let t = v.trunc();
    if (v - t).abs() >= 0.5 {
        t + 1f32.copysign(v)
    } else {
        t
    }
}

#[inline(always)]
fn q8_0_row_body(x: &[f32], out: &mut Vec<BlockQ8_0>) {
    for c in x.chunks_exact(32) {
        let c: &[f32; 32] = c.try_into().expect("32 values");
        let mut m = [0f32; 16];
        for j in 0..16 {
            m[j] = c[j].abs().max(c[j + 16].abs());
        }
        let amax = m.iter().fold(0f32, |a, &v| a.max(v));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; 32];
        for (q, &v) in qs.iter_mut().zip(c) {
            *q = round_half_away(v * id) as i8;
        }
        out.push(BlockQ8_0 {
            d: half::f16::from_f32(d),
            qs,
        });
    }
}

widest! {
    /// [`q8_0_row_body`] compiled for the widest vectors the CPU has.
    fn q8_0_row_auto(x: &[f32], out: &mut Vec<BlockQ8_0>) => q8_0_row_body
}

/// Q8_0 blocks of `x`: [`q8_0_row_avx512`] where the CPU has AVX-512, else
/// [`q8_0_row_body`] as the compiler vectorizes it. The same bytes either way.
fn q8_0_row(x: &[f32], out: &mut Vec<BlockQ8_0>) {
    #[cfg(target_arch = "x86_64")]
    if samesum_quant::isa::Isa::best() >= samesum_quant::isa::Isa::Avx512 {
        // SAFETY: Isa::best reports AVX-512 F + BW only when the CPU has them.
        unsafe { q8_0_row_avx512(x, out) };
        return;
    }
    q8_0_row_auto(x, out);
}

/// [`q8_0_row_body`] written out in AVX-512, a block (two vectors) at a time,
/// step for step: NaN lanes drop out of the maximum (as `f32::max` drops
/// them), the scale and its inverse are the same scalar operations, each
/// value is the same product, truncated and moved away from zero when its
/// exact remainder is at least a half, and the conversion saturates with NaN
/// going to 0, as `as i8` does.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q8_0_row_avx512(x: &[f32], out: &mut Vec<BlockQ8_0>) {
    use std::arch::x86_64::*;
    let one = _mm512_set1_ps(1.0);
    let half = _mm512_set1_ps(0.5);
    let sign = _mm512_set1_epi32(i32::MIN);
    let (lo, hi) = (_mm512_set1_ps(-128.0), _mm512_set1_ps(127.0));
    let quant = |v: __m512, id: __m512| -> __m128i {
        let p = _mm512_mul_ps(v, id);
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
        let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_abs_ps(_mm512_sub_ps(p, t)), half);
        let step = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_and_si512(_mm512_castps_si512(p), sign),
            _mm512_castps_si512(one),
        ));
        let r = _mm512_mask_add_ps(t, away, t, step);
        let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
        let r = _mm512_min_ps(_mm512_max_ps(_mm512_maskz_mov_ps(ordered, r), lo), hi);
        _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r))
    };
    out.reserve(x.len() / 32);
    for c in x.chunks_exact(32) {
        // SAFETY: `c` holds 32 values.
        let (a, b) = unsafe {
            (
                _mm512_loadu_ps(c.as_ptr()),
                _mm512_loadu_ps(c.as_ptr().add(16)),
            )
        };
        let abs = |v: __m512| {
            _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(v, v), _mm512_abs_ps(v))
        };
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(abs(a), abs(b)));
        let d = amax / 127.0;
        let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let mut qs = [0i8; 32];
        // SAFETY: each store writes 16 bytes of the 32 in `qs`.
        unsafe {
            _mm_storeu_si128(qs.as_mut_ptr().cast(), quant(a, id));
            _mm_storeu_si128(qs.as_mut_ptr().add(16).cast(), quant(b, id));
        }
        out.push(BlockQ8_0 {
            d: half::f16::from_f32(d),
            qs,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: &ActRow, b: &ActRow) -> bool {
        match (a, b) {
            (ActRow::Q8_0(x), ActRow::Q8_0(y)) => {
                x.len() == y.len()
                    && x.iter()
                        .zip(y)
                        .all(|(p, q)| p.d.to_bits() == q.d.to_bits() && p.qs == q.qs)
            }
            _ => false,
        }
    }

    /// Random rows, rows whose scaled values land on halves, zeros, tiny and
    /// huge magnitudes: every block equals the library quantizer's.
    #[test]
    fn q8_0_rows_equal_the_library_quantizer() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for _ in 0..400 {
            let scale = f32::from_bits(((next() % 60) as u32 + 100) << 23);
            rows.push(
                (0..256)
                    .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale)
                    .collect(),
            );
        }
        // amax 127: every value k + 0.5 is a tie that `round` sends away from 0.
        rows.push(
            (0..64)
                .map(|i| {
                    if i % 32 == 0 {
                        127.0
                    } else {
                        (i % 60) as f32 - 30.5
                    }
                })
                .collect(),
        );
        rows.push(vec![0.0; 64]);
        rows.push((0..32).map(|i| if i == 3 { -1e-40 } else { 0.0 }).collect());
        rows.push((0..32).map(|i| (i as f32 - 16.0) * 1e30).collect());
        rows.push((0..32).map(|i| -(i as f32) - 0.5).collect());
        for w in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::IQ4_NL] {
            for r in &rows {
                let ours = quantize(w, r).expect("whole blocks");
                let lib = ActRow::quantize(w, r).expect("whole blocks");
                assert!(same(&ours, &lib), "{w:?} row {:?}", &r[..4]);
            }
        }
        // The AVX-512 kernel against the portable body, NaN and infinities
        // included (the library quantizer is not asked about those).
        #[cfg(target_arch = "x86_64")]
        if samesum_quant::isa::Isa::Avx512.supported() {
            let mut odd = rows.clone();
            for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN]
                .into_iter()
                .enumerate()
            {
                let mut r: Vec<f32> = (0..64).map(|j| j as f32 - 20.25).collect();
                r[3 + 7 * i] = v;
                r[40] = v;
                odd.push(r);
                odd.push((0..32).map(|j| if j == i { v } else { 0.0 }).collect());
            }
            odd.push((0..32).map(|_| f32::NAN).collect());
            for r in &odd {
                let (mut a, mut b) = (Vec::new(), Vec::new());
                q8_0_row_body(r, &mut a);
                // SAFETY: checked above.
                unsafe { q8_0_row_avx512(r, &mut b) };
                assert!(
                    same(&ActRow::Q8_0(a), &ActRow::Q8_0(b)),
                    "row {:?}",
                    &r[..8]
                );
            }
        }
        // A slip of one half step in the rounding is caught.
        let r: Vec<f32> = (0..32).map(|i| i as f32 * 127.0 / 31.0).collect();
        let ActRow::Q8_0(mut b) = quantize(GgmlType::Q8_0, &r).expect("whole blocks") else {
            unreachable!()
        };
        b[0].qs[5] = b[0].qs[5].wrapping_add(1);
        assert!(!same(
            &ActRow::Q8_0(b),
            &ActRow::quantize(GgmlType::Q8_0, &r).unwrap()
        ));
    }
}
