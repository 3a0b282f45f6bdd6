//! AVX-512 kernels that dot two weight rows with up to 8 activation rows at
//! once (the batched-prefill tiles): each weight block is unpacked once for
//! every activation row, and each activation block is loaded once for both
//! weight rows.
//!
//! Per (weight row, activation row) the arithmetic is the scalar reference's:
//! the integer block sums are exact (whatever their order), and the float
//! combination runs the reference's steps with one activation row per vector
//! lane (separate multiply and add, no FMA), so every value has the bits of
//! [`super::dot_rows`].

use super::ActRow;
use super::scalar;
use super::x86::{hsum8, load256};
use super::x86_kquant as k;
use crate::blocks::*;
use crate::error::{QuantError, Result};
use samesum_gguf::GgmlType;
use std::arch::x86_64::*;

/// Formats with a multi-row AVX-512 kernel.
pub(super) const MULTI_FORMATS: &[GgmlType] = &[
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
];

/// Activation block types, taken out of an [`ActRow`].
trait ActBlock: Sized {
    const TYPE: GgmlType;
    fn blocks(a: &ActRow) -> Option<&[Self]>;
}

impl ActBlock for BlockQ8K {
    const TYPE: GgmlType = GgmlType::Q8_K;
    fn blocks(a: &ActRow) -> Option<&[Self]> {
        match a {
            ActRow::Q8K(b) => Some(b),
            _ => None,
        }
    }
}

impl ActBlock for BlockQ8_0 {
    const TYPE: GgmlType = GgmlType::Q8_0;
    fn blocks(a: &ActRow) -> Option<&[Self]> {
        match a {
            ActRow::Q8_0(b) => Some(b),
            _ => None,
        }
    }
}

/// A two-row kernel: weight rows `w0`, `w1` against `acts` (at most 8), results
/// into `out0[..acts.len()]` and `out1[..acts.len()]`.
type Multi2<W, A> = unsafe fn(&[W], &[W], &[&[A]], &mut [f32; 8], &mut [f32; 8]);

/// `out[r * rows + j]` = weight row `j` of `w` · `acts[r]` with the multi-row
/// kernel of `weight`; `Ok(false)` when `weight` has none. The caller has checked
/// that AVX-512 is supported, that every activation row has `n` elements (a
/// positive multiple of the block size) and that `w` holds `rows` rows.
pub(super) fn dot_rows_multi(
    weight: GgmlType,
    w: &[u8],
    acts: &[ActRow],
    n: usize,
    rows: usize,
    out: &mut [f32],
) -> Result<bool> {
    use GgmlType as T;
    match weight {
        T::Q8_0 => drive::<BlockQ8_0, BlockQ8_0>(weight, w, acts, n, rows, out, q8_0_multi2),
        T::Q4_K => drive_tile(weight, w, acts, n, rows, out, k::q4_k_tile),
        T::Q5_K => drive_tile(weight, w, acts, n, rows, out, k::q5_k_tile),
        T::Q6_K => drive_tile(weight, w, acts, n, rows, out, k::q6_k_tile),
        T::IQ4_XS => drive_tile(weight, w, acts, n, rows, out, k::iq4_xs_tile),
        _ => return Ok(false),
    }?;
    Ok(true)
}

/// `out[j]` = weight row `j` of `w` · `act` for the first `8 * k` rows with the
/// eight-row kernel of `weight`; returns how many rows it did (0 when `weight`
/// has none). The caller has checked AVX-512 support and lengths (`per_row`
/// blocks a row).
pub(super) fn dot_rows8(
    weight: GgmlType,
    w: &[u8],
    act: &ActRow,
    per_row: usize,
    out: &mut [f32],
) -> Result<usize> {
    use GgmlType as T;
    let ActRow::Q8K(a) = act else {
        return Ok(0);
    };
    match weight {
        T::Q4_K => drive8(weight, w, a, per_row, out, k::q4_k_rows8),
        T::Q5_K => drive8(weight, w, a, per_row, out, k::q5_k_rows8),
        T::Q6_K => drive8(weight, w, a, per_row, out, k::q6_k_rows8),
        T::IQ4_XS => drive8(weight, w, a, per_row, out, k::iq4_xs_rows8),
        _ => Ok(0),
    }
}

fn drive8<W: bytemuck::Pod>(
    weight: GgmlType,
    w: &[u8],
    a: &[BlockQ8K],
    nb: usize,
    out: &mut [f32],
    kernel: unsafe fn(&[&[W]; 8], &[BlockQ8K], &mut [f32; 8]),
) -> Result<usize> {
    let blocks: &[W] = crate::cast_blocks(weight, w)?;
    let a = &a[..nb];
    let mut done = 0;
    for (rows, o) in blocks.chunks_exact(8 * nb).zip(out.chunks_exact_mut(8)) {
        let w: [&[W]; 8] = arr!(ib in 8 => &rows[ib * nb..(ib + 1) * nb]);
        let o: &mut [f32; 8] = o.try_into().expect("chunks of 8");
        // SAFETY: AVX-512 F/BW support was checked by the caller; every row
        // has `nb` blocks.
        unsafe { kernel(&w, a, o) };
        done += 8;
    }
    Ok(done)
}

/// A tile kernel of a 256-element format (see [`k::tile`]).
type TileFn<W> = unsafe fn(&[W], usize, usize, &[&[BlockQ8K]], &mut [f32], usize);

fn drive_tile<W: bytemuck::Pod>(
    weight: GgmlType,
    w: &[u8],
    acts: &[ActRow],
    n: usize,
    rows: usize,
    out: &mut [f32],
    kernel: TileFn<W>,
) -> Result<()> {
    let blocks: &[W] = crate::cast_blocks(weight, w)?;
    let nb = n / weight.block_size();
    // Groups of 8 activation rows outside, weight rows inside: a group's
    // prepared activations stay in L1 while every weight row of the tile
    // passes by.
    for (g, group) in acts.chunks(8).enumerate() {
        let mut per: [&[BlockQ8K]; 8] = [&[]; 8];
        for (p, a) in per.iter_mut().zip(group) {
            *p = BlockQ8K::blocks(a).ok_or(QuantError::ActivationType {
                weight,
                act: a.act_type(),
                expected: GgmlType::Q8_K,
            })?;
        }
        // SAFETY: AVX-512 F/BW support was checked by the caller; `blocks`
        // holds `rows` rows of `nb` blocks, every activation row `nb` blocks.
        unsafe { kernel(blocks, nb, rows, &per[..group.len()], out, 8 * g) };
    }
    Ok(())
}

fn drive<W: bytemuck::Pod, A: ActBlock>(
    weight: GgmlType,
    w: &[u8],
    acts: &[ActRow],
    n: usize,
    rows: usize,
    out: &mut [f32],
    kernel: Multi2<W, A>,
) -> Result<()> {
    let blocks: &[W] = crate::cast_blocks(weight, w)?;
    let nb = n / weight.block_size();
    let wrow = |j: usize| &blocks[j * nb..(j + 1) * nb];
    let (mut tmp0, mut tmp1) = ([0f32; 8], [0f32; 8]);
    // Groups of 8 activation rows outside, weight rows inside: a group's
    // activations stay in L1 while every weight row of the tile passes by.
    // (No allocation per call: this runs once per tile of every matmul.)
    for (g, group) in acts.chunks(8).enumerate() {
        let mut per: [&[A]; 8] = [&[]; 8];
        for (p, a) in per.iter_mut().zip(group) {
            *p = A::blocks(a).ok_or(QuantError::ActivationType {
                weight,
                act: a.act_type(),
                expected: A::TYPE,
            })?;
        }
        let per = &per[..group.len()];
        for j in (0..rows).step_by(2) {
            let j1 = (j + 1).min(rows - 1);
            // SAFETY: AVX-512 F/BW support was checked by the caller; every row
            // has `nb` blocks.
            unsafe { kernel(wrow(j), wrow(j1), per, &mut tmp0, &mut tmp1) };
            for i in 0..group.len() {
                out[(g * 8 + i) * rows + j] = tmp0[i];
                out[(g * 8 + i) * rows + j1] = tmp1[i];
            }
        }
    }
    Ok(())
}

/// 512-bit register to 8 lanes: the two halves added.
#[inline(always)]
unsafe fn fold(v: __m512i) -> __m256i {
    unsafe { _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v)) }
}

// ---------------------------------------------------------------- Q8_0

/// Two Q8_0 weight rows against up to 8 activation rows; per pair exactly
/// [`scalar::q8_0_q8_0`]: block `b`'s term in lane `b % 8` (eight blocks per
/// vector step, one vector per activation row), the tail through the scalar
/// term, then [`super::scalar::reduce8`].
#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
unsafe fn q8_0_multi2(
    w0: &[BlockQ8_0],
    w1: &[BlockQ8_0],
    acts: &[&[BlockQ8_0]],
    out0: &mut [f32; 8],
    out1: &mut [f32; 8],
) {
    let nr = acts.len().min(8);
    let nb = w0.len().min(w1.len());
    let ws = [w0, w1];
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 8]; 2];
        let groups = nb / 8;
        for g in 0..groups {
            let blk = 8 * g;
            let mut wt = [[_mm512_setzero_si512(); 8]; 2];
            let mut dw = [_mm256_setzero_ps(); 2];
            for t in 0..2 {
                let mut bits = [0u16; 8];
                for k in 0..8 {
                    let b = &ws[t][blk + k];
                    wt[t][k] = _mm512_cvtepi8_epi16(load256(&b.qs));
                    bits[k] = b.d.to_bits();
                }
                dw[t] = _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i));
            }
            for r in 0..nr {
                let a = &acts[r][blk..blk + 8];
                let mut v = [[_mm256_setzero_si256(); 8]; 2];
                let mut bits = [0u16; 8];
                for k in 0..8 {
                    let az = _mm512_cvtepi8_epi16(load256(&a[k].qs));
                    v[0][k] = fold(_mm512_madd_epi16(wt[0][k], az));
                    v[1][k] = fold(_mm512_madd_epi16(wt[1][k], az));
                    bits[k] = a[k].d.to_bits();
                }
                let da = _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i));
                for t in 0..2 {
                    let s = _mm256_cvtepi32_ps(hsum8(&v[t]));
                    acc[t][r] =
                        _mm256_add_ps(acc[t][r], _mm256_mul_ps(_mm256_mul_ps(dw[t], da), s));
                }
            }
        }
        for (t, out) in [out0, out1].into_iter().enumerate() {
            for r in 0..nr {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[t][r]);
                for b in groups * 8..nb {
                    let (w, a) = (&ws[t][b], &acts[r][b]);
                    let term =
                        scalar::term(f16_to_f32(w.d), f16_to_f32(a.d), scalar::sumi_q8_0(w, a));
                    lanes[b % 8] = lanes[b % 8] + term;
                }
                out[r] = scalar::reduce8(&lanes);
            }
        }
    }
}
