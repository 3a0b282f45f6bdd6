//! AVX-512 kernels that dot many row pairs at once, and their dispatch: tiles
//! of weight rows against up to 8 activation rows (batched prefill) and runs
//! of 8 weight rows against one activation row (decode). The 256-element
//! formats' kernels are in [`super::x86_kquant`]; Q8_0's are here (with
//! AVX-512 VNNI where the CPU has it, else a two-row kernel).
//!
//! Per (weight row, activation row) the arithmetic is the scalar reference's:
//! the integer block sums are exact (whatever their order), and the float
//! combination runs the reference's steps with one row per vector lane
//! (separate multiply and add, no FMA), so every value has the bits of
//! [`super::dot_rows`].

use super::ActRow;
use super::scalar;
use super::x86::{hsum8, load256};
use super::x86_iq as iq;
use super::x86_kquant as k;
use crate::blocks::*;
use crate::error::{QuantError, Result};
use samesum_gguf::GgmlType;
use std::arch::x86_64::*;

/// Formats with a multi-row AVX-512 kernel.
pub(super) const MULTI_FORMATS: &[GgmlType] = &[
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
];

/// Formats with an AMX tile kernel ([`super::x86_amx`]).
pub(super) const AMX_FORMATS: &[GgmlType] = &[
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_XS,
    GgmlType::Q3_K,
    GgmlType::Q6_K,
    GgmlType::Q2_K,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::IQ2_XXS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
];

/// An AMX tile kernel: (weights, blocks a row, rows, activation rows, out).
type AmxFn<W, A> = unsafe fn(&[W], usize, usize, &[&[A]], &mut [f32]);

/// [`dot_rows_multi`] with the AMX tile kernel of `weight`; `Ok(false)` when
/// it has none. The caller has also checked that AMX is available.
pub(super) fn dot_rows_multi_amx(
    weight: GgmlType,
    w: &[u8],
    acts: &[ActRow],
    n: usize,
    rows: usize,
    out: &mut [f32],
) -> Result<bool> {
    use super::x86_amx as amx;
    use GgmlType as T;
    fn run<W: bytemuck::Pod, A: ActBlock>(
        weight: GgmlType,
        w: &[u8],
        acts: &[ActRow],
        n: usize,
        rows: usize,
        out: &mut [f32],
        kernel: AmxFn<W, A>,
    ) -> Result<bool> {
        let blocks: &[W] = crate::cast_blocks(weight, w)?;
        let per = acts
            .iter()
            .map(|a| A::of(weight, a))
            .collect::<Result<Vec<&[A]>>>()?;
        // SAFETY: AVX-512 F/BW and AMX were checked by the caller; `blocks`
        // holds `rows` rows of `n / block` blocks, every activation row as many.
        unsafe { kernel(blocks, n / weight.block_size(), rows, &per, out) };
        Ok(true)
    }
    macro_rules! amx {
        ($kernel:expr) => {
            run(weight, w, acts, n, rows, out, $kernel)
        };
    }
    match weight {
        T::Q4_K => amx!(amx::kquant_tiles::<BlockQ4K>),
        T::Q5_K => amx!(amx::kquant_tiles::<BlockQ5K>),
        T::Q2_K => amx!(amx::pair_tiles::<BlockQ2K>),
        T::Q3_K => amx!(amx::pair_tiles::<BlockQ3K>),
        T::Q6_K => amx!(amx::q6k_tiles),
        T::IQ4_XS => amx!(amx::sub_tiles::<BlockIq4Xs>),
        T::IQ2_XXS => amx!(amx::sub_tiles::<BlockIq2Xxs>),
        T::IQ3_XXS => amx!(amx::sub_tiles::<BlockIq3Xxs>),
        T::IQ3_S => amx!(amx::sub_tiles::<BlockIq3S>),
        T::IQ2_XS => amx!(amx::sub_tiles::<BlockIq2Xs>),
        T::IQ2_S => amx!(amx::sub_tiles::<BlockIq2S>),
        T::Q8_0 => amx!(amx::block32_tiles::<BlockQ8_0>),
        T::Q4_0 => amx!(amx::block32_tiles::<BlockQ4_0>),
        T::Q5_0 => amx!(amx::block32_tiles::<BlockQ5_0>),
        T::IQ4_NL => amx!(amx::block32_tiles::<BlockIq4Nl>),
        T::MXFP4 => amx!(amx::block32_tiles::<BlockMxfp4>),
        T::Q4_1 => amx!(amx::block32_tiles::<BlockQ4_1>),
        T::Q5_1 => amx!(amx::block32_tiles::<BlockQ5_1>),
        _ => Ok(false),
    }
}

/// Activation block types, taken out of an [`ActRow`].
pub(super) trait ActBlock: Sized {
    const TYPE: GgmlType;
    fn blocks(a: &ActRow) -> Option<&[Self]>;

    /// The blocks of `a`, or an error naming `weight`'s partner type.
    fn of(weight: GgmlType, a: &ActRow) -> Result<&[Self]> {
        Self::blocks(a).ok_or(QuantError::ActivationType {
            weight,
            act: a.act_type(),
            expected: Self::TYPE,
        })
    }
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

impl ActBlock for BlockQ8_1 {
    const TYPE: GgmlType = GgmlType::Q8_1;
    fn blocks(a: &ActRow) -> Option<&[Self]> {
        match a {
            ActRow::Q8_1(b) => Some(b),
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
        T::Q8_0 if has_vnni() => {
            drive_tile(weight, w, acts, n, rows, out, tile32_vnni::<BlockQ8_0>)
        }
        T::Q4_0 if has_vnni() => {
            drive_tile(weight, w, acts, n, rows, out, tile32_vnni::<BlockQ4_0>)
        }
        T::Q5_0 if has_vnni() => {
            drive_tile(weight, w, acts, n, rows, out, tile32_vnni::<BlockQ5_0>)
        }
        T::Q4_1 if has_vnni() => {
            drive_tile(weight, w, acts, n, rows, out, tile32_vnni::<BlockQ4_1>)
        }
        T::Q5_1 if has_vnni() => {
            drive_tile(weight, w, acts, n, rows, out, tile32_vnni::<BlockQ5_1>)
        }
        T::IQ4_NL if has_vnni() => {
            drive_tile(weight, w, acts, n, rows, out, tile32_vnni::<BlockIq4Nl>)
        }
        T::MXFP4 if has_vnni() => {
            drive_tile(weight, w, acts, n, rows, out, tile32_vnni::<BlockMxfp4>)
        }
        T::Q8_0 => drive::<BlockQ8_0, BlockQ8_0>(weight, w, acts, n, rows, out, q8_0_multi2),
        T::Q2_K => drive_tile(weight, w, acts, n, rows, out, k::q2_k_tile),
        T::IQ2_XXS => drive_tile(weight, w, acts, n, rows, out, iq::iq2_xxs_tile),
        T::IQ2_XS => drive_tile(weight, w, acts, n, rows, out, iq::iq2_xs_tile),
        T::IQ2_S => drive_tile(weight, w, acts, n, rows, out, iq::iq2_s_tile),
        T::IQ3_XXS => drive_tile(weight, w, acts, n, rows, out, iq::iq3_xxs_tile),
        T::IQ3_S => drive_tile(weight, w, acts, n, rows, out, iq::iq3_s_tile),
        T::Q3_K => drive_tile(weight, w, acts, n, rows, out, k::q3_k_tile),
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
    match (weight, act) {
        (T::Q2_K, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, k::q2_k_rows8),
        (T::IQ2_XXS, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, iq::iq2_xxs_rows8),
        (T::IQ2_XS, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, iq::iq2_xs_rows8),
        (T::IQ2_S, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, iq::iq2_s_rows8),
        (T::IQ3_XXS, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, iq::iq3_xxs_rows8),
        (T::IQ3_S, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, iq::iq3_s_rows8),
        (T::Q3_K, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, k::q3_k_rows8),
        (T::Q4_K, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, k::q4_k_rows8),
        (T::Q5_K, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, k::q5_k_rows8),
        (T::Q6_K, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, k::q6_k_rows8),
        (T::IQ4_XS, ActRow::Q8K(a)) => drive8(weight, w, a, per_row, out, k::iq4_xs_rows8),
        (T::Q8_0, ActRow::Q8_0(a)) if has_vnni() => {
            drive8(weight, w, a, per_row, out, rows8_32_vnni::<BlockQ8_0>)
        }
        (T::Q4_0, ActRow::Q8_0(a)) if has_vnni() => {
            drive8(weight, w, a, per_row, out, rows8_32_vnni::<BlockQ4_0>)
        }
        (T::Q5_0, ActRow::Q8_0(a)) if has_vnni() => {
            drive8(weight, w, a, per_row, out, rows8_32_vnni::<BlockQ5_0>)
        }
        (T::Q4_1, ActRow::Q8_1(a)) if has_vnni() => {
            drive8(weight, w, a, per_row, out, rows8_32_vnni::<BlockQ4_1>)
        }
        (T::Q5_1, ActRow::Q8_1(a)) if has_vnni() => {
            drive8(weight, w, a, per_row, out, rows8_32_vnni::<BlockQ5_1>)
        }
        (T::IQ4_NL, ActRow::Q8_0(a)) if has_vnni() => {
            drive8(weight, w, a, per_row, out, rows8_32_vnni::<BlockIq4Nl>)
        }
        (T::MXFP4, ActRow::Q8_0(a)) if has_vnni() => {
            drive8(weight, w, a, per_row, out, rows8_32_vnni::<BlockMxfp4>)
        }
        _ => Ok(0),
    }
}

fn drive8<W: bytemuck::Pod, A>(
    weight: GgmlType,
    w: &[u8],
    a: &[A],
    nb: usize,
    out: &mut [f32],
    kernel: unsafe fn(&[&[W]; 8], &[A], &mut [f32; 8]),
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

/// A tile kernel: every weight row (`rows` of `nb` blocks) against 1 to 8
/// activation rows, `out[(row0 + r) * rows + j]` (see [`k::tile`]).
pub(super) type TileFn<W, A> = unsafe fn(&[W], usize, usize, &[&[A]], &mut [f32], usize);

/// `kernel` over `acts` in groups of 8. The caller has checked that the CPU
/// has the kernel's instruction set.
pub(super) fn drive_tile<W: bytemuck::Pod, A: ActBlock>(
    weight: GgmlType,
    w: &[u8],
    acts: &[ActRow],
    n: usize,
    rows: usize,
    out: &mut [f32],
    kernel: TileFn<W, A>,
) -> Result<()> {
    let blocks: &[W] = crate::cast_blocks(weight, w)?;
    let nb = n / weight.block_size();
    // Groups of 8 activation rows outside, weight rows inside: a group's
    // prepared activations stay in L1 while every weight row of the tile
    // passes by.
    for (g, group) in acts.chunks(8).enumerate() {
        let mut per: [&[A]; 8] = [&[]; 8];
        for (p, a) in per.iter_mut().zip(group) {
            *p = A::of(weight, a)?;
        }
        // SAFETY: the kernel's instruction set was checked by the caller;
        // `blocks` holds `rows` rows of `nb` blocks, every activation row `nb`
        // blocks.
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
            *p = A::of(weight, a)?;
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

/// Whether the CPU has AVX-512 VNNI (`vpdpbusd`: u8 × i8 products summed by
/// four into i32, no saturation).
pub(super) fn has_vnni() -> bool {
    std::arch::is_x86_feature_detected!("avx512vnni")
}

/// The block order of [`sums4`]'s lanes.
const PERM4: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// [`scalar::reduce8`] of eight lanes held in the order [`PERM4`] (register
/// lane `k` is block lane `PERM4[k]`): the same three rounds of additions with
/// the same operands in the same order, done by shuffles instead of a store
/// and scalar adds. `acc` = `[l0, l2, l4, l6, l1, l3, l5, l7]`.
#[inline(always)]
unsafe fn reduce8_perm4(acc: __m256) -> f32 {
    unsafe {
        // Lanes 0, 1, 4, 5: l0 + l4, l2 + l6, l1 + l5, l3 + l7.
        let t = _mm256_add_ps(acc, _mm256_permute_ps::<0b01_00_11_10>(acc));
        // Lane 0: (l0 + l4) + (l2 + l6); lane 4: (l1 + l5) + (l3 + l7).
        let u = _mm256_add_ps(t, _mm256_permute_ps::<0b10_11_00_01>(t));
        _mm_cvtss_f32(_mm_add_ss(
            _mm256_castps256_ps128(u),
            _mm256_extractf128_ps::<1>(u),
        ))
    }
}

/// The reduction of one accumulator in the order [`PERM4`] with the blocks
/// past the last whole group (`tail`, each into lane `b % 8` first) as the
/// reference takes them.
#[inline(always)]
unsafe fn finish_perm4(acc: __m256, tail: impl ExactSizeIterator<Item = (usize, f32)>) -> f32 {
    if tail.len() == 0 {
        // SAFETY: the caller runs with AVX.
        return unsafe { reduce8_perm4(acc) };
    }
    let mut perm = [0f32; 8];
    // SAFETY: as above; `perm` holds 8 values.
    unsafe { _mm256_storeu_ps(perm.as_mut_ptr(), acc) };
    let mut lanes = [0f32; 8];
    for (k, &b) in PERM4.iter().enumerate() {
        lanes[b] = perm[k];
    }
    for (b, term) in tail {
        lanes[b % 8] = lanes[b % 8] + term;
    }
    scalar::reduce8(&lanes)
}

/// Eight block sums from four registers of two blocks' 8-lane partials each
/// (`v[i]`: block `2i` in the low half, `2i + 1` in the high): lane `k` of the
/// result is the total of block `PERM4[k]` (exact: i32 additions reordered).
#[inline(always)]
unsafe fn sums4(v: &[__m512i; 4]) -> __m256i {
    unsafe {
        let p01 = k::pair32(v[0], v[1]);
        let p23 = k::pair32(v[2], v[3]);
        // 128-bit lanes 0, 1: partials of blocks 0, 2, 4, 6; lanes 2, 3: 1, 3, 5, 7.
        let q = k::pair64(p01, p23);
        let s = _mm512_add_epi32(q, _mm512_shuffle_i32x4::<0b10_11_00_01>(q, q));
        _mm512_castsi512_si256(_mm512_shuffle_i32x4::<0b10_00_10_00>(s, s))
    }
}

/// A weight block of 32 values and one scale, dotted with a Q8_0 block as
/// `(dw * da) * sumi` (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4): what the VNNI
/// kernels need of it.
trait Vals32: bytemuck::Pod {
    /// The activation block it is dotted with (Q8_0, or Q8_1 with a min).
    type A: Act32;
    /// The term has a min: `(dw * da) * sumi + m * s` (Q4_1, Q5_1).
    const MIN: bool = false;
    /// The 32 values as signed bytes, in element order.
    unsafe fn vals(&self) -> __m256i;
    /// The scales of blocks `PERM4[k]` of `b`, as f32 (the reference's
    /// conversion: F16C is exact).
    unsafe fn scales(b: &[Self]) -> __m256;
    /// The mins of blocks `PERM4[k]` of `b`, as f32 (with `MIN`).
    unsafe fn mins(_b: &[Self]) -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    /// The scalar reference's term of this block with `a`.
    fn term(&self, a: &Self::A) -> f32;
}

/// A 32-value activation block: Q8_0, or Q8_1 (with `s = d · Σ q`).
trait Act32: bytemuck::Pod + ActBlock {
    fn qs(&self) -> &[i8; 32];
    fn d_bits(&self) -> u16;
    /// `s` as f16 bits (0 for Q8_0, which has none).
    fn s_bits(&self) -> u16;
}

impl Act32 for BlockQ8_0 {
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn s_bits(&self) -> u16 {
        0
    }
}

impl Act32 for BlockQ8_1 {
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn s_bits(&self) -> u16 {
        self.s.to_bits()
    }
}

/// Two activation blocks' quants in one register.
#[inline(always)]
unsafe fn act_two<A: Act32>(a: &A, b: &A) -> __m512i {
    unsafe { super::x86::join(load256(a.qs()), load256(b.qs())) }
}

/// F16 bits of blocks `PERM4[k]` (from `f`) as f32.
#[inline(always)]
unsafe fn perm_f16<T>(b: &[T], f: impl Fn(&T) -> u16) -> __m256 {
    let mut bits = [0u16; 8];
    for (x, &k) in bits.iter_mut().zip(&PERM4) {
        *x = f(&b[k]);
    }
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i)) }
}

/// [`Vals32::scales`] of blocks with an f16 scale `d`.
macro_rules! f16_scales {
    () => {
        #[inline(always)]
        unsafe fn scales(b: &[Self]) -> __m256 {
            unsafe { perm_f16(b, |x| x.d.to_bits()) }
        }
    };
}

impl Vals32 for BlockQ8_0 {
    type A = BlockQ8_0;
    #[inline(always)]
    unsafe fn vals(&self) -> __m256i {
        unsafe { load256(&self.qs) }
    }
    f16_scales!();
    fn term(&self, a: &BlockQ8_0) -> f32 {
        scalar::term(
            f16_to_f32(self.d),
            f16_to_f32(a.d),
            scalar::sumi_q8_0(self, a),
        )
    }
}

impl Vals32 for BlockQ4_0 {
    type A = BlockQ8_0;
    #[inline(always)]
    unsafe fn vals(&self) -> __m256i {
        unsafe { super::x86::q4_0_values(self) }
    }
    f16_scales!();
    fn term(&self, a: &BlockQ8_0) -> f32 {
        scalar::q4_0_q8_0(std::slice::from_ref(self), std::slice::from_ref(a))
    }
}

impl Vals32 for BlockQ5_0 {
    type A = BlockQ8_0;
    #[inline(always)]
    unsafe fn vals(&self) -> __m256i {
        unsafe {
            _mm256_sub_epi8(
                super::x86::q5_values(&self.qh, &self.qs),
                _mm256_set1_epi8(16),
            )
        }
    }
    f16_scales!();
    fn term(&self, a: &BlockQ8_0) -> f32 {
        scalar::q5_0_q8_0(std::slice::from_ref(self), std::slice::from_ref(a))
    }
}

impl Vals32 for BlockIq4Nl {
    type A = BlockQ8_0;
    #[inline(always)]
    unsafe fn vals(&self) -> __m256i {
        unsafe { super::x86::table_values(&KVALUES_IQ4NL, &self.qs) }
    }
    f16_scales!();
    fn term(&self, a: &BlockQ8_0) -> f32 {
        scalar::iq4_nl_q8_0(std::slice::from_ref(self), std::slice::from_ref(a))
    }
}

impl Vals32 for BlockMxfp4 {
    type A = BlockQ8_0;
    #[inline(always)]
    unsafe fn vals(&self) -> __m256i {
        unsafe { super::x86::table_values(&KVALUES_MXFP4, &self.qs) }
    }
    #[inline(always)]
    unsafe fn scales(b: &[Self]) -> __m256 {
        let mut d = [0f32; 8];
        for (x, &k) in d.iter_mut().zip(&PERM4) {
            *x = e8m0_to_f32_half(b[k].e);
        }
        unsafe { _mm256_loadu_ps(d.as_ptr()) }
    }
    fn term(&self, a: &BlockQ8_0) -> f32 {
        scalar::mxfp4_q8_0(std::slice::from_ref(self), std::slice::from_ref(a))
    }
}

impl Vals32 for BlockQ4_1 {
    type A = BlockQ8_1;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn vals(&self) -> __m256i {
        unsafe { super::x86::nibbles32(&self.qs) }
    }
    f16_scales!();
    #[inline(always)]
    unsafe fn mins(b: &[Self]) -> __m256 {
        unsafe { perm_f16(b, |x| x.m.to_bits()) }
    }
    fn term(&self, a: &BlockQ8_1) -> f32 {
        scalar::q4_1_q8_1(std::slice::from_ref(self), std::slice::from_ref(a))
    }
}

impl Vals32 for BlockQ5_1 {
    type A = BlockQ8_1;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn vals(&self) -> __m256i {
        unsafe { super::x86::q5_values(&self.qh, &self.qs) }
    }
    f16_scales!();
    #[inline(always)]
    unsafe fn mins(b: &[Self]) -> __m256 {
        unsafe { perm_f16(b, |x| x.m.to_bits()) }
    }
    fn term(&self, a: &BlockQ8_1) -> f32 {
        scalar::q5_1_q8_1(std::slice::from_ref(self), std::slice::from_ref(a))
    }
}

/// Two weight blocks' values in one register.
#[inline(always)]
unsafe fn two_vals<W: Vals32>(a: &W, b: &W) -> __m512i {
    unsafe { super::x86::join(a.vals(), b.vals()) }
}

/// One activation row's group of 8 Q8_0 blocks, prepared for [`tile32_vnni`]:
/// the quants, two blocks a register, `128 · Σ a` of each block and the
/// scales, in the order [`PERM4`].
#[derive(Clone, Copy)]
struct Q8Prep {
    aq: [__m512i; 4],
    a128: __m256i,
    da: __m256,
    sa: __m256,
}

/// `128 · Σ a` of each of 8 Q8_0 blocks held two a register (`aq`), in the
/// order [`PERM4`]: the offset a `vpdpbusd` of weights made unsigned (`w +
/// 128`) with these quants carries.
#[inline(always)]
unsafe fn act_offsets(aq: &[__m512i; 4]) -> __m256i {
    unsafe {
        let ones = _mm512_set1_epi8(1);
        let zero = _mm512_setzero_si512();
        let s = arr!(i in 4 => _mm512_dpbusd_epi32(zero, ones, aq[i]));
        _mm256_slli_epi32::<7>(sums4(&s))
    }
}

/// [`q8_0_multi2`] for a whole tile with VNNI: every weight row of `w` (`rows`
/// rows of `nb` blocks) against `acts` (1 to 8 rows), `out[(row0 + r) * rows +
/// j]`. `vpdpbusd` of the weights made unsigned gives `Σ (w + 128)·a`
/// exactly, less `128 · Σ a` (per activation block, prepared once with its
/// row and shared by every weight row). Lanes hold blocks in the order
/// [`PERM4`] (each lane still takes its blocks in order); the tail and the
/// reduction are the reference's.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn tile32_vnni<W: Vals32>(
    w: &[W],
    nb: usize,
    rows: usize,
    acts: &[&[W::A]],
    out: &mut [f32],
    row0: usize,
) {
    let nr = acts.len().min(8);
    let groups = nb / 8;
    unsafe {
        let flip = _mm512_set1_epi8(-128);
        let zero = _mm512_setzero_si512();
        // [group][row]
        // SAFETY: `groups * nr` values, every byte initialized, used only in
        // this call.
        let prep = std::slice::from_raw_parts_mut(k::scratch::<Q8Prep>(groups * nr), groups * nr);
        for g in 0..groups {
            for (r, a) in acts[..nr].iter().enumerate() {
                let a = &a[8 * g..8 * g + 8];
                let aq = arr!(i in 4 => act_two(&a[2 * i], &a[2 * i + 1]));
                prep[g * nr + r] = Q8Prep {
                    aq,
                    a128: act_offsets(&aq),
                    da: perm_f16(a, |x| x.d_bits()),
                    sa: if W::MIN {
                        perm_f16(a, |x| x.s_bits())
                    } else {
                        _mm256_setzero_ps()
                    },
                };
            }
        }
        let size = std::mem::size_of::<W>();
        for j in (0..rows).step_by(2) {
            let j1 = (j + 1).min(rows - 1);
            let ws = [&w[j * nb..(j + 1) * nb], &w[j1 * nb..(j1 + 1) * nb]];
            let next = ws[1].as_ptr().cast::<u8>().wrapping_add(nb * size);
            let mut acc = [[_mm256_setzero_ps(); 8]; 2];
            for g in 0..groups {
                let blk = 8 * g;
                let mut wu = [[zero; 4]; 2];
                let mut dw = [_mm256_setzero_ps(); 2];
                let mut mw = [_mm256_setzero_ps(); 2];
                for t in 0..2 {
                    // The next pair of rows follows this one (prefetches never
                    // fault, past the end of the weights included).
                    let p = next.wrapping_add((t * nb + blk) * size);
                    for line in (0..8 * size).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line).cast());
                    }
                    let b = &ws[t][blk..blk + 8];
                    wu[t] =
                        arr!(i in 4 => _mm512_xor_si512(two_vals(&b[2 * i], &b[2 * i + 1]), flip));
                    dw[t] = W::scales(b);
                    if W::MIN {
                        mw[t] = W::mins(b);
                    }
                }
                for (r, pr) in prep[g * nr..(g + 1) * nr].iter().enumerate() {
                    for t in 0..2 {
                        let v = arr!(i in 4 => _mm512_dpbusd_epi32(zero, wu[t][i], pr.aq[i]));
                        let s = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums4(&v), pr.a128));
                        let mut term = _mm256_mul_ps(_mm256_mul_ps(dw[t], pr.da), s);
                        if W::MIN {
                            term = _mm256_add_ps(term, _mm256_mul_ps(mw[t], pr.sa));
                        }
                        acc[t][r] = _mm256_add_ps(acc[t][r], term);
                    }
                }
            }
            for t in 0..2 {
                let jt = [j, j1][t];
                for r in 0..nr {
                    let tail = (groups * 8..nb).map(|b| (b, ws[t][b].term(&acts[r][b])));
                    out[(row0 + r) * rows + jt] = finish_perm4(acc[t][r], tail);
                }
            }
        }
    }
}

/// Eight Q8_0 weight rows (one contiguous run of `8 * a.len()` blocks) against
/// one activation row with VNNI, one weight row per accumulator: per row
/// exactly [`scalar::q8_0_q8_0`] (the steps of [`tile32_vnni`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn rows8_32_vnni<W: Vals32>(w: &[&[W]; 8], a: &[W::A], out: &mut [f32; 8]) {
    let nb = a.len();
    let groups = nb / 8;
    let size = std::mem::size_of::<W>();
    // The rows are read in an interleaved order the hardware prefetcher follows
    // poorly: each step fetches the same blocks of the next run instead.
    let next = w[0].as_ptr().cast::<u8>().wrapping_add(8 * nb * size);
    unsafe {
        let flip = _mm512_set1_epi8(-128);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm256_setzero_ps(); 8];
        for g in 0..groups {
            let blk = 8 * g;
            let ab = &a[blk..blk + 8];
            let aq = arr!(i in 4 => act_two(&ab[2 * i], &ab[2 * i + 1]));
            let a128 = act_offsets(&aq);
            let da = perm_f16(ab, |x| x.d_bits());
            let sa = if W::MIN {
                perm_f16(ab, |x| x.s_bits())
            } else {
                _mm256_setzero_ps()
            };
            for t in 0..8 {
                // The next run's block, into the L2 as in the K-quants' `rows8`.
                let p = next.wrapping_add((t * nb + blk) * size);
                for line in (0..8 * size).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(line).cast());
                }
                let b = &w[t][blk..blk + 8];
                let wu = arr!(i in 4 => _mm512_xor_si512(two_vals(&b[2 * i], &b[2 * i + 1]), flip));
                let v = arr!(i in 4 => _mm512_dpbusd_epi32(zero, wu[i], aq[i]));
                let s = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums4(&v), a128));
                let mut term = _mm256_mul_ps(_mm256_mul_ps(W::scales(b), da), s);
                if W::MIN {
                    term = _mm256_add_ps(term, _mm256_mul_ps(W::mins(b), sa));
                }
                acc[t] = _mm256_add_ps(acc[t], term);
            }
        }
        for t in 0..8 {
            let tail = (groups * 8..nb).map(|b| (b, w[t][b].term(&a[b])));
            out[t] = finish_perm4(acc[t], tail);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use crate::testing::{random_q8_0, random_weight_blocks};

    /// The Q8_0 two-row kernel without VNNI (which `dot_rows_multi` does not
    /// reach on a CPU with VNNI) and the VNNI tile against the scalar
    /// reference, on random and extreme quants.
    #[test]
    fn q8_0_two_row_kernels_equal_scalar() {
        if !crate::isa::Isa::Avx512.supported() {
            return;
        }
        let mut rng = Rng::new(43);

        for nb in [1usize, 7, 8, 9, 16, 19] {
            for fill in [None, Some(-128i8), Some(127), Some(-1)] {
                let mut w = random_weight_blocks(GgmlType::Q8_0, 2 * nb, &mut rng).unwrap();
                let mut acts: Vec<Vec<BlockQ8_0>> = (0..5)
                    .map(|_| (0..nb).map(|_| random_q8_0(&mut rng)).collect())
                    .collect();
                if let Some(f) = fill {
                    for b in w.chunks_exact_mut(34) {
                        b[2..].fill(f as u8);
                    }
                    for a in acts.iter_mut().flatten() {
                        a.qs = [f; 32];
                    }
                }
                let wb: &[BlockQ8_0] = bytemuck::cast_slice(&w);
                let per: Vec<&[BlockQ8_0]> = acts.iter().map(|a| a.as_slice()).collect();
                let (mut o0, mut o1) = ([0f32; 8], [0f32; 8]);
                // SAFETY: AVX-512 checked above.
                unsafe { q8_0_multi2(&wb[..nb], &wb[nb..], &per, &mut o0, &mut o1) };
                let mut tile = vec![f32::NAN; 2 * per.len()];
                if has_vnni() {
                    // SAFETY: AVX-512 and VNNI checked.
                    unsafe { tile32_vnni(wb, nb, 2, &per, &mut tile, 0) };
                }
                for (r, a) in per.iter().enumerate() {
                    for (t, o) in [o0, o1].iter().enumerate() {
                        let want = scalar::q8_0_q8_0(&wb[t * nb..(t + 1) * nb], a);
                        assert_eq!(
                            o[r].to_bits(),
                            want.to_bits(),
                            "nb={nb} {fill:?} t={t} r={r}"
                        );
                        if has_vnni() {
                            let got = tile[r * 2 + t];
                            assert_eq!(got.to_bits(), want.to_bits(), "vnni nb={nb} {fill:?}");
                        }
                    }
                }
            }
        }
    }
}
