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
use super::x86::{IDX_K4, IDX_PAIRS, hsum8, join, load256, load256u};
use crate::blocks::*;
use crate::error::{QuantError, Result};
use samesum_gguf::GgmlType;
use std::arch::x86_64::*;

/// `[e(0), e(1), ...]` written out: `std::array::from_fn` is not compiled with
/// the caller's target features, so its closure would not inline (every vector
/// would go through memory).
macro_rules! arr {
    ($c:ident in 2 => $e:expr) => {
        [{ let $c = 0usize; $e }, { let $c = 1usize; $e }]
    };
    ($c:ident in 4 => $e:expr) => {
        [{ let $c = 0usize; $e }, { let $c = 1usize; $e }, { let $c = 2usize; $e }, { let $c = 3usize; $e }]
    };
    ($c:ident in 8 => $e:expr) => {
        [
            { let $c = 0usize; $e }, { let $c = 1usize; $e }, { let $c = 2usize; $e }, { let $c = 3usize; $e },
            { let $c = 4usize; $e }, { let $c = 5usize; $e }, { let $c = 6usize; $e }, { let $c = 7usize; $e },
        ]
    };
}

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
        T::Q4_K => drive::<BlockQ4K, BlockQ8K>(weight, w, acts, n, rows, out, q4_k_multi2),
        T::Q5_K => drive::<BlockQ5K, BlockQ8K>(weight, w, acts, n, rows, out, q5_k_multi2),
        T::Q6_K => drive::<BlockQ6K, BlockQ8K>(weight, w, acts, n, rows, out, q6_k_multi2),
        T::IQ4_XS => drive::<BlockIq4Xs, BlockQ8K>(weight, w, acts, n, rows, out, iq4_xs_multi2),
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
        T::Q4_K => drive8::<BlockQ4K>(weight, w, a, per_row, out, q4_k_rows8),
        T::Q5_K => drive8::<BlockQ5K>(weight, w, a, per_row, out, q5_k_rows8),
        T::Q6_K => drive8::<BlockQ6K>(weight, w, a, per_row, out, q6_k_rows8),
        T::IQ4_XS => drive8::<BlockIq4Xs>(weight, w, a, per_row, out, iq4_xs_rows8),
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

/// The 8 activation scales of a group (lanes past `nr` zero).
#[inline(always)]
unsafe fn act_scales(acts: &[&[BlockQ8K]], b: usize) -> __m256 {
    let mut d = [0f32; 8];
    for (x, a) in d.iter_mut().zip(acts) {
        *x = a[b].d;
    }
    unsafe { _mm256_loadu_ps(d.as_ptr()) }
}

// ---------------------------------------------------------------- 256-element formats

/// A 256-element weight format for the shared loops [`core2`] and [`core8`].
/// Every method is `inline(always)` (closures here would be compiled apart
/// from their caller and pass every vector through memory).
trait Format {
    type W;
    /// One weight block, unpacked.
    type U: Copy;
    /// One activation block, loaded.
    type A: Copy;
    /// Whether the block has mins (`acc - (dmin*da)*summ` after each block).
    const MINS: bool;
    unsafe fn unpack(&self, w: &Self::W) -> Self::U;
    unsafe fn load(&self, a: &BlockQ8K) -> Self::A;
    /// 8-lane partial sums whose totals are the exact `sumi` and (with
    /// `MINS`) `summ` of one weight block against one activation block.
    unsafe fn dot(&self, u: &Self::U, a: &Self::A) -> (__m256i, __m256i);
    /// Block scales (`d`, and `dmin` with `MINS`).
    fn scales(u: &Self::U) -> (f32, f32);
}

/// f16 to f32 by F16C (the bits of [`f16_to_f32`]).
#[inline(always)]
unsafe fn h2f(h: half::f16) -> f32 {
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32))) }
}

/// The shared two-row loop: per block, in order, the reference's
/// `acc + (d*da)*sumi` and, with mins, `acc - (dmin*da)*summ`, one activation
/// row per lane.
#[inline(always)]
unsafe fn core2<F: Format>(
    f: &F,
    w0: &[F::W],
    w1: &[F::W],
    acts: &[&[BlockQ8K]],
    out0: &mut [f32; 8],
    out1: &mut [f32; 8],
) {
    let nr = acts.len().min(8);
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 2];
        for b in 0..w0.len().min(w1.len()) {
            let u = [f.unpack(&w0[b]), f.unpack(&w1[b])];
            let mut vs = [[_mm256_setzero_si256(); 8]; 2];
            let mut ms = [[_mm256_setzero_si256(); 8]; 2];
            for r in 0..nr {
                let a = f.load(&acts[r][b]);
                (vs[0][r], ms[0][r]) = f.dot(&u[0], &a);
                (vs[1][r], ms[1][r]) = f.dot(&u[1], &a);
            }
            let da = act_scales(&acts[..nr], b);
            for t in 0..2 {
                let (d, dmin) = F::scales(&u[t]);
                let sumi = _mm256_cvtepi32_ps(hsum8(&vs[t]));
                acc[t] = _mm256_add_ps(
                    acc[t],
                    _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), da), sumi),
                );
                if F::MINS {
                    let summ = _mm256_cvtepi32_ps(hsum8(&ms[t]));
                    acc[t] = _mm256_sub_ps(
                        acc[t],
                        _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), da), summ),
                    );
                }
            }
        }
        _mm256_storeu_ps(out0.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(out1.as_mut_ptr(), acc[1]);
    }
}

/// The shared eight-row loop (eight weight rows, one activation row: decode):
/// the same per-block steps as [`core2`], one weight row per lane.
#[inline(always)]
unsafe fn core8<F: Format>(f: &F, w: &[&[F::W]; 8], a: &[BlockQ8K], out: &mut [f32; 8]) {
    let size = std::mem::size_of::<F::W>();
    // The eight rows are one contiguous run of `8 * nb` blocks (see `drive8`),
    // read in an interleaved order the hardware prefetcher follows poorly: each
    // block step fetches the same block of the next run instead (prefetches
    // never fault, past the end of the weights included).
    let next = w[0].as_ptr().cast::<u8>().wrapping_add(8 * a.len() * size);
    unsafe {
        let mut acc = _mm256_setzero_ps();
        for (b, ab) in a.iter().enumerate() {
            let x = f.load(ab);
            let mut vs = [_mm256_setzero_si256(); 8];
            let mut ms = [_mm256_setzero_si256(); 8];
            let (mut d, mut dmin) = ([0f32; 8], [0f32; 8]);
            for t in 0..8 {
                let p = next.wrapping_add((t * a.len() + b) * size);
                for line in (0..size).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line).cast());
                }
                let u = f.unpack(&w[t][b]);
                (vs[t], ms[t]) = f.dot(&u, &x);
                (d[t], dmin[t]) = F::scales(&u);
            }
            let da = _mm256_set1_ps(ab.d);
            let sumi = _mm256_cvtepi32_ps(hsum8(&vs));
            let d = _mm256_loadu_ps(d.as_ptr());
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(d, da), sumi));
            if F::MINS {
                let summ = _mm256_cvtepi32_ps(hsum8(&ms));
                let dmin = _mm256_loadu_ps(dmin.as_ptr());
                acc = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dmin, da), summ));
            }
        }
        _mm256_storeu_ps(out.as_mut_ptr(), acc);
    }
}

/// A Q4_K/Q5_K/Q6_K block: quants (below 64) of elements `64c..64c+64` in
/// order, the i16 scale of each `maddubs` pair sum of `q[c]`, and 16 i16
/// factors against the activation's 16 `bsums` (each min twice, or Q6_K's
/// scales).
#[derive(Clone, Copy)]
struct KBlock {
    q: [__m512i; 4],
    sc: [__m512i; 4],
    m: __m256i,
    d: f32,
    dmin: f32,
}

/// A Q8_K block loaded for the K-quant dot: quants in 4 registers of 64, bsums.
#[derive(Clone, Copy)]
struct KAct {
    q: [__m512i; 4],
    bsums: __m256i,
}

#[inline(always)]
unsafe fn k_load(a: &BlockQ8K) -> KAct {
    unsafe {
        KAct {
            q: arr!(c in 4 => _mm512_loadu_si512(a.qs[64 * c..].as_ptr() as *const _)),
            bsums: _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i),
        }
    }
}

/// The K-quant dot: `Σ_c madd(maddubs(q_c, a_c), sc_c)` folded to 8 lanes, and
/// `madd(m, bsums)`. With `Q6`, the second is folded into the first as
/// `sumi − 32·Σ sc·bsum` (ggml's −32 offset of the Q6_K quants).
#[inline(always)]
unsafe fn k_dot<const Q6: bool>(u: &KBlock, a: &KAct) -> (__m256i, __m256i) {
    unsafe {
        let mut v = _mm512_madd_epi16(_mm512_maddubs_epi16(u.q[0], a.q[0]), u.sc[0]);
        for c in 1..4 {
            v = _mm512_add_epi32(
                v,
                _mm512_madd_epi16(_mm512_maddubs_epi16(u.q[c], a.q[c]), u.sc[c]),
            );
        }
        let m = _mm256_madd_epi16(u.m, a.bsums);
        if Q6 {
            (_mm256_sub_epi32(fold(v), _mm256_slli_epi32::<5>(m)), m)
        } else {
            (fold(v), m)
        }
    }
}

/// Q4_K and Q5_K (`HIGH`: the fifth bits): nibble chunk `c` holds sub-blocks
/// `2c` (low nibbles) and `2c+1` (high nibbles), i.e. elements `64c..64c+64`.
struct K4<W, const HIGH: bool> {
    m4: __m256i,
    sixteen: __m512i,
    idx: [__m512i; 4],
    pairs: __m512i,
    _w: std::marker::PhantomData<W>,
}

impl<W, const HIGH: bool> K4<W, HIGH> {
    #[inline(always)]
    unsafe fn new() -> Self {
        unsafe {
            K4 {
                m4: _mm256_set1_epi8(0x0F),
                sixteen: _mm512_set1_epi8(16),
                idx: arr!(c in 4 => _mm512_loadu_si512(IDX_K4[c].as_ptr() as *const _)),
                pairs: _mm512_loadu_si512(IDX_PAIRS.as_ptr() as *const _),
                _w: std::marker::PhantomData,
            }
        }
    }

    /// Scales per pair sum of each chunk, the mins each twice (against the
    /// two bsums of their group), and the nibbles of each chunk.
    #[inline(always)]
    unsafe fn common(&self, scales: &[u8; 12], qs: &[u8; 128]) -> KBlock {
        unsafe {
            let (sc, mn) = scales_mins_k4(scales);
            let scv = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(sc as i64)));
            let mnv = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(mn as i64)));
            KBlock {
                q: arr!(c in 4 => {
                    let q = load256u(&qs[c * 32..]);
                    join(
                        _mm256_and_si256(q, self.m4),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(q), self.m4),
                    )
                }),
                sc: arr!(c in 4 => _mm512_permutexvar_epi16(self.idx[c], scv)),
                m: _mm512_castsi512_si256(_mm512_permutexvar_epi16(self.pairs, mnv)),
                d: 0.0,
                dmin: 0.0,
            }
        }
    }
}

impl Format for K4<BlockQ4K, false> {
    type W = BlockQ4K;
    type U = KBlock;
    type A = KAct;
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unpack(&self, w: &BlockQ4K) -> KBlock {
        KBlock {
            d: unsafe { h2f(w.d) },
            dmin: unsafe { h2f(w.dmin) },
            ..unsafe { self.common(&w.scales, &w.qs) }
        }
    }
    #[inline(always)]
    unsafe fn load(&self, a: &BlockQ8K) -> KAct {
        unsafe { k_load(a) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &KBlock, a: &KAct) -> (__m256i, __m256i) {
        unsafe { k_dot::<false>(u, a) }
    }
    #[inline(always)]
    fn scales(u: &KBlock) -> (f32, f32) {
        (u.d, u.dmin)
    }
}

impl Format for K4<BlockQ5K, true> {
    type W = BlockQ5K;
    type U = KBlock;
    type A = KAct;
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unpack(&self, w: &BlockQ5K) -> KBlock {
        unsafe {
            let mut u = self.common(&w.scales, &w.qs);
            // Fifth bits: bit 2c of qh for the low half of chunk c, 2c+1 for
            // the high half.
            let qh = _mm512_broadcast_i64x4(load256u(&w.qh));
            for c in 0..4 {
                let bits = join(
                    _mm256_set1_epi8((1u8 << (2 * c)) as i8),
                    _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8),
                );
                let k = _mm512_test_epi8_mask(qh, bits);
                u.q[c] = _mm512_mask_add_epi8(u.q[c], k, u.q[c], self.sixteen);
            }
            u.d = h2f(w.d);
            u.dmin = h2f(w.dmin);
            u
        }
    }
    #[inline(always)]
    unsafe fn load(&self, a: &BlockQ8K) -> KAct {
        unsafe { k_load(a) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &KBlock, a: &KAct) -> (__m256i, __m256i) {
        unsafe { k_dot::<false>(u, a) }
    }
    #[inline(always)]
    fn scales(u: &KBlock) -> (f32, f32) {
        (u.d, u.dmin)
    }
}

/// Q6_K: `ql[64n..64n+64]` holds elements `128n + (0..64)` in its low nibbles
/// and `128n + (64..128)` in its high ones, `qh[32n..32n+32]` their top 2 bits.
struct Q6 {
    m4: __m512i,
    m2: __m512i,
    sh_a: __m512i,
    sh_b: __m512i,
    idx0: __m256i,
}

impl Q6 {
    #[inline(always)]
    unsafe fn new() -> Self {
        unsafe {
            Q6 {
                m4: _mm512_set1_epi8(0x0F),
                m2: _mm512_set1_epi8(0x03),
                // Low half: elements l (qh bits 0-1), high half: l + 32 (bits 2-3);
                // then l + 64 (bits 4-5) and l + 96 (bits 6-7).
                sh_a: join(_mm256_setzero_si256(), _mm256_set1_epi16(2)),
                sh_b: join(_mm256_set1_epi16(4), _mm256_set1_epi16(6)),
                // Byte indices [g x8, g+1 x8 | g+2 x8, g+3 x8]: one scale per 16
                // elements, i.e. per 8 pair sums, for the 64 elements of a register.
                idx0: _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                    3, 3, 3, 3, 3, 3,
                ),
            }
        }
    }
}

impl Format for Q6 {
    type W = BlockQ6K;
    type U = KBlock;
    type A = KAct;
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn unpack(&self, w: &BlockQ6K) -> KBlock {
        unsafe {
            let s128 = _mm_loadu_si128(w.scales.as_ptr() as *const __m128i);
            let scales = _mm256_broadcastsi128_si256(s128);
            let mut q = [_mm512_setzero_si512(); 4];
            for n in 0..2 {
                let ql = _mm512_loadu_si512(w.ql[n * 64..].as_ptr() as *const _);
                let qh = _mm512_broadcast_i64x4(load256u(&w.qh[n * 32..]));
                let h_a = _mm512_and_si512(_mm512_srlv_epi16(qh, self.sh_a), self.m2);
                let h_b = _mm512_and_si512(_mm512_srlv_epi16(qh, self.sh_b), self.m2);
                q[2 * n] =
                    _mm512_or_si512(_mm512_and_si512(ql, self.m4), _mm512_slli_epi16::<4>(h_a));
                q[2 * n + 1] = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql), self.m4),
                    _mm512_slli_epi16::<4>(h_b),
                );
            }
            KBlock {
                q,
                sc: arr!(c in 4 => {
                    let idx = _mm256_add_epi8(self.idx0, _mm256_set1_epi8((4 * c) as i8));
                    _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(scales, idx))
                }),
                m: _mm256_cvtepi8_epi16(s128),
                d: h2f(w.d),
                dmin: 0.0,
            }
        }
    }
    #[inline(always)]
    unsafe fn load(&self, a: &BlockQ8K) -> KAct {
        unsafe { k_load(a) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &KBlock, a: &KAct) -> (__m256i, __m256i) {
        unsafe { k_dot::<true>(u, a) }
    }
    #[inline(always)]
    fn scales(u: &KBlock) -> (f32, f32) {
        (u.d, 0.0)
    }
}

/// IQ4_XS: a block's 256 table values times their sub-block's scale, as i16
/// (|value · scale| ≤ 127 · 32), 32 elements a register.
#[derive(Clone, Copy)]
struct Iq4Block {
    v: [__m512i; 8],
    d: f32,
}

struct Iq4 {
    table: __m256i,
    m4: __m128i,
}

impl Iq4 {
    #[inline(always)]
    unsafe fn new() -> Self {
        unsafe {
            Iq4 {
                table: _mm256_broadcastsi128_si256(_mm_loadu_si128(
                    KVALUES_IQ4NL.as_ptr() as *const __m128i
                )),
                m4: _mm_set1_epi8(0x0F),
            }
        }
    }
}

impl Format for Iq4 {
    type W = BlockIq4Xs;
    type U = Iq4Block;
    type A = [__m512i; 8];
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn unpack(&self, w: &BlockIq4Xs) -> Iq4Block {
        let sc = iq4xs_scales(w);
        unsafe {
            Iq4Block {
                // Sub-block ib: element j in the low nibble of qs[16ib + j],
                // element j + 16 in the high one.
                v: arr!(ib in 8 => {
                    let q = _mm_loadu_si128(w.qs[ib * 16..].as_ptr() as *const __m128i);
                    let idx = _mm256_set_m128i(
                        _mm_and_si128(_mm_srli_epi16::<4>(q), self.m4),
                        _mm_and_si128(q, self.m4),
                    );
                    _mm512_mullo_epi16(
                        _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(self.table, idx)),
                        _mm512_set1_epi16(sc[ib] as i16),
                    )
                }),
                d: h2f(w.d),
            }
        }
    }
    #[inline(always)]
    unsafe fn load(&self, a: &BlockQ8K) -> [__m512i; 8] {
        unsafe { arr!(ib in 8 => _mm512_cvtepi8_epi16(load256(&a.qs[ib * 32..]))) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &Iq4Block, a: &[__m512i; 8]) -> (__m256i, __m256i) {
        unsafe {
            let mut v = _mm512_madd_epi16(u.v[0], a[0]);
            for ib in 1..8 {
                v = _mm512_add_epi32(v, _mm512_madd_epi16(u.v[ib], a[ib]));
            }
            (fold(v), _mm256_setzero_si256())
        }
    }
    #[inline(always)]
    fn scales(u: &Iq4Block) -> (f32, f32) {
        (u.d, 0.0)
    }
}

/// The two-row (prefill) and eight-row (decode) kernels of a [`Format`].
macro_rules! kernels {
    ($w:ty, $multi2:ident, $rows8:ident, $name:literal, $make:expr) => {
        #[doc = concat!("Two ", $name, " weight rows against up to 8 activation rows; per pair")]
        #[doc = "exactly the scalar reference."]
        #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
        unsafe fn $multi2(
            w0: &[$w],
            w1: &[$w],
            acts: &[&[BlockQ8K]],
            out0: &mut [f32; 8],
            out1: &mut [f32; 8],
        ) {
            unsafe { core2(&$make, w0, w1, acts, out0, out1) }
        }

        #[doc = concat!("Eight ", $name, " weight rows against one activation row; per row")]
        #[doc = "exactly the scalar reference."]
        #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
        unsafe fn $rows8(w: &[&[$w]; 8], a: &[BlockQ8K], out: &mut [f32; 8]) {
            unsafe { core8(&$make, w, a, out) }
        }
    };
}

kernels!(
    BlockQ4K,
    q4_k_multi2,
    q4_k_rows8,
    "Q4_K",
    K4::<BlockQ4K, false>::new()
);
kernels!(
    BlockQ5K,
    q5_k_multi2,
    q5_k_rows8,
    "Q5_K",
    K4::<BlockQ5K, true>::new()
);
kernels!(BlockQ6K, q6_k_multi2, q6_k_rows8, "Q6_K", Q6::new());
kernels!(
    BlockIq4Xs,
    iq4_xs_multi2,
    iq4_xs_rows8,
    "IQ4_XS",
    Iq4::new()
);

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
                    let term = scalar::term(h2f(w.d), f16_to_f32(a.d), scalar::sumi_q8_0(w, a));
                    lanes[b % 8] = lanes[b % 8] + term;
                }
                out[r] = scalar::reduce8(&lanes);
            }
        }
    }
}
