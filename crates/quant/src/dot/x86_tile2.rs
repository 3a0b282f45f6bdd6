//! AVX2 tile kernels for batched prefill on CPUs without AVX-512: every
//! weight row of a call against groups of up to 8 activation rows, each
//! weight block unpacked once (values, sub-block scales and mins) for the
//! group's rows instead of once per row as the one-row kernels do. Q4_K, Q5_K
//! and Q6_K, the formats of llama-quantize's K mixes.
//!
//! Per (weight row, activation row) the arithmetic is the scalar
//! reference's: a block's integer sums (the quants' dot with each sub-block
//! scale, the mins' or Q6_K's offset correction against the activation's
//! bsums) are exact whatever their order, and the float steps run the
//! reference's `combine_min` / `combine` in block order with one activation
//! row per vector lane (separate multiply and add), so every value has the
//! bits of [`super::dot_rows`].

use super::ActRow;
use super::x86::{hsum8, load256, load256u};
use super::x86_kquant::scratch;
use super::x86_multi::ActBlock;
use crate::blocks::*;
use crate::error::Result;
use samesum_gguf::GgmlType;
use std::arch::x86_64::*;

/// Formats with an AVX2 tile kernel.
pub(super) const TILE_FORMATS: &[GgmlType] = &[GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

/// One weight block, unpacked: its 256 quants as 8 vectors of 32 unsigned
/// values (vector `k` against activation quants `32 k ..`), the i16 scale
/// of each value pair (`sc[k]`), `m`: the i16 factors of the activation
/// bsums (each sub-block's min twice for the K formats with mins, the 16
/// scales for Q6_K), and the block's float scales.
struct Unpacked {
    q: [__m256i; 8],
    sc: [__m256i; 8],
    m: __m256i,
    d: f32,
    dmin: f32,
}

/// A 256-element format's block unpacking.
trait Format {
    type W: bytemuck::Pod;
    /// Mins (`combine_min`); without them Q6_K's offset of 32 is taken off
    /// the sum as `32 * (scales . bsums)` (`combine`).
    const MINS: bool;
    /// # Safety
    /// The CPU has AVX2.
    unsafe fn unpack(w: &Self::W) -> Unpacked;
}

/// The 8 scales (as `set1` vectors) and the mins (each twice) of a Q4_K or
/// Q5_K block's packed 6-bit scales.
#[inline(always)]
unsafe fn scales_mins_k4(s: &[u8; 12]) -> ([__m256i; 8], __m256i) {
    let mut mins = [0i16; 16];
    let mut sc = [unsafe { _mm256_setzero_si256() }; 8];
    for (j, v) in sc.iter_mut().enumerate() {
        let (s, m) = scale_min_k4(j, s);
        *v = unsafe { _mm256_set1_epi16(s as i16) };
        mins[2 * j] = m as i16;
        mins[2 * j + 1] = m as i16;
    }
    (sc, unsafe {
        _mm256_loadu_si256(mins.as_ptr() as *const __m256i)
    })
}

struct Q4K;
impl Format for Q4K {
    type W = BlockQ4K;
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unpack(w: &BlockQ4K) -> Unpacked {
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let mut q = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let x = load256u(&w.qs[c * 32..]);
                q[2 * c] = _mm256_and_si256(x, m4);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m4);
            }
            let (sc, m) = scales_mins_k4(&w.scales);
            Unpacked {
                q,
                sc,
                m,
                d: f16_to_f32(w.d),
                dmin: f16_to_f32(w.dmin),
            }
        }
    }
}

struct Q5K;
impl Format for Q5K {
    type W = BlockQ5K;
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unpack(w: &BlockQ5K) -> Unpacked {
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let sixteen = _mm256_set1_epi8(16);
            let qh = load256u(&w.qh);
            let high = |j: usize| {
                let bit = _mm256_set1_epi8((1u8 << j) as i8);
                _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), sixteen)
            };
            let mut q = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let x = load256u(&w.qs[c * 32..]);
                q[2 * c] = _mm256_or_si256(_mm256_and_si256(x, m4), high(2 * c));
                q[2 * c + 1] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(x), m4),
                    high(2 * c + 1),
                );
            }
            let (sc, m) = scales_mins_k4(&w.scales);
            Unpacked {
                q,
                sc,
                m,
                d: f16_to_f32(w.d),
                dmin: f16_to_f32(w.dmin),
            }
        }
    }
}

struct Q6K;
impl Format for Q6K {
    type W = BlockQ6K;
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn unpack(w: &BlockQ6K) -> Unpacked {
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let m2 = _mm256_set1_epi8(0x03);
            let mut q = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                let ql0 = load256u(&w.ql[n * 64..]);
                let ql1 = load256u(&w.ql[n * 64 + 32..]);
                let qh = load256u(&w.qh[n * 32..]);
                let hb = |s: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(s, m2));
                q[4 * n] = _mm256_or_si256(_mm256_and_si256(ql0, m4), hb(qh));
                q[4 * n + 1] =
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), hb(_mm256_srli_epi16::<2>(qh)));
                q[4 * n + 2] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                    hb(_mm256_srli_epi16::<4>(qh)),
                );
                q[4 * n + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                    hb(_mm256_srli_epi16::<6>(qh)),
                );
                for k in 0..4 {
                    // Values 32 (4n + k) .. : sub-blocks g and g + 1 of 16.
                    let g = 2 * (4 * n + k);
                    sc[4 * n + k] = _mm256_set_m128i(
                        _mm_set1_epi16(w.scales[g + 1] as i16),
                        _mm_set1_epi16(w.scales[g] as i16),
                    );
                }
            }
            let s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.scales.as_ptr() as *const __m128i));
            Unpacked {
                q,
                sc,
                m: s16,
                d: f16_to_f32(w.d),
                dmin: 0.0,
            }
        }
    }
}

/// `out[(row0 + r) * rows + j]` = weight row `j` (`rows` rows of `nb`
/// blocks in `w`) · `acts[r]` for the 1 to 8 activation rows `acts`.
///
/// # Safety
/// The CPU has AVX2; `w` holds `rows * nb` blocks and every activation row
/// `nb`; `out` holds `(row0 + acts.len()) * rows` values.
#[target_feature(enable = "avx2")]
unsafe fn tile<F: Format>(
    w: &[F::W],
    nb: usize,
    rows: usize,
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
    row0: usize,
) {
    let nr = acts.len().min(8);
    // Lanes past `nr` repeat the last row (their results are dropped).
    let a: [&[BlockQ8K]; 8] = std::array::from_fn(|r| acts[r.min(nr - 1)]);
    unsafe {
        // SAFETY: `nb` values, all written below, used only in this call.
        let da = std::slice::from_raw_parts_mut(scratch::<__m256>(nb), nb);
        for (b, x) in da.iter_mut().enumerate() {
            let d: [f32; 8] = std::array::from_fn(|r| a[r][b].d);
            *x = _mm256_loadu_ps(d.as_ptr());
        }
        for j in 0..rows {
            let wr = &w[j * nb..(j + 1) * nb];
            let mut acc = _mm256_setzero_ps();
            for (b, (wb, &dab)) in wr.iter().zip(da.iter()).enumerate() {
                let u = F::unpack(wb);
                let mut v = [_mm256_setzero_si256(); 8];
                for k in 0..8 {
                    for r in 0..8 {
                        let p = _mm256_maddubs_epi16(u.q[k], load256(&a[r][b].qs[32 * k..]));
                        v[r] = _mm256_add_epi32(v[r], _mm256_madd_epi16(p, u.sc[k]));
                    }
                }
                let mv: [__m256i; 8] = std::array::from_fn(|r| {
                    let bs = _mm256_loadu_si256(a[r][b].bsums.as_ptr() as *const __m256i);
                    _mm256_madd_epi16(u.m, bs)
                });
                // Lane r: row r's exact block sums.
                let sumi = hsum8(&v);
                let summ = hsum8(&mv);
                let dd = _mm256_mul_ps(_mm256_set1_ps(u.d), dab);
                if F::MINS {
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sumi)));
                    let dm = _mm256_mul_ps(_mm256_set1_ps(u.dmin), dab);
                    acc = _mm256_sub_ps(acc, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(summ)));
                } else {
                    let s = _mm256_sub_epi32(sumi, _mm256_slli_epi32::<5>(summ));
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(s)));
                }
            }
            let mut res = [0f32; 8];
            _mm256_storeu_ps(res.as_mut_ptr(), acc);
            for (r, &x) in res.iter().enumerate().take(nr) {
                out[(row0 + r) * rows + j] = x;
            }
        }
    }
}

/// [`super::dot_rows_multi`] on the AVX2 tile kernel of `weight`: `Ok(false)`
/// when it has none. The caller has checked AVX2 support and the lengths.
pub(super) fn dot_rows_multi(
    weight: GgmlType,
    w: &[u8],
    acts: &[ActRow],
    n: usize,
    rows: usize,
    out: &mut [f32],
) -> Result<bool> {
    match weight {
        GgmlType::Q4_K => drive::<Q4K>(weight, w, acts, n, rows, out)?,
        GgmlType::Q5_K => drive::<Q5K>(weight, w, acts, n, rows, out)?,
        GgmlType::Q6_K => drive::<Q6K>(weight, w, acts, n, rows, out)?,
        _ => return Ok(false),
    }
    Ok(true)
}

fn drive<F: Format>(
    weight: GgmlType,
    w: &[u8],
    acts: &[ActRow],
    n: usize,
    rows: usize,
    out: &mut [f32],
) -> Result<()> {
    let blocks: &[F::W] = crate::cast_blocks(weight, w)?;
    let nb = n / weight.block_size();
    // Groups of 8 activation rows outside, weight rows inside: a group's
    // activations stay in L1 while every weight row of the tile passes by.
    for (g, group) in acts.chunks(8).enumerate() {
        let mut per: [&[BlockQ8K]; 8] = [&[]; 8];
        for (p, a) in per.iter_mut().zip(group) {
            *p = <BlockQ8K as ActBlock>::of(weight, a)?;
        }
        // SAFETY: AVX2 support was checked by the caller; `blocks` holds
        // `rows` rows of `nb` blocks, every activation row `nb` blocks, `out`
        // `acts.len() * rows` values.
        unsafe { tile::<F>(blocks, nb, rows, &per[..group.len()], out, 8 * g) };
    }
    Ok(())
}
