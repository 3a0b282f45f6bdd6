//! x86-64 kernels of the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
//! IQ3_S) against Q8_K activations: one-row AVX2 kernels, and AVX-512
//! tile (batched) and eight-row kernels through [`super::x86_kquant`]'s
//! [`Format`] driver. A block is 8 chunks of 32 elements; each chunk is
//! grid magnitudes, 32 sign bits and one odd scale a half ([`IqChunks`]), the
//! same for every kernel here and for the scalar reference's integer sum.
//! The integer sums are exact in any order, and the float step is the
//! reference's `acc + ((dw * da) * k) * sumi` (`k` a power of two, 1/8 or
//! 1/4, or 1 for IQ3_S): the tile kernels form `dw * k` first, which is
//! exact, so `(dw * k) * da` has the bits of `(dw * da) * k`.

use super::scalar::combine_scaled;
use super::x86::{hsum_i32, load256, sign_masks};
use super::x86_kquant::{Format, rows8, tile};
use crate::blocks::*;
use crate::dequant::{iq2_xxs_words, iq3_xxs_word};
use crate::iq_tables::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use std::arch::x86_64::*;

// The grids read by gathers, as statics (one address for every kernel).
// IQ2_XXS and IQ2_XS keep four scalar loads: a gather measured slower there
// (the 64-bit gather of four entries against four loads).
static GRID_IQ2S: [u64; 1024] = IQ2S_GRID;
static GRID_IQ3XXS: [u32; 256] = IQ3XXS_GRID;
static GRID_IQ3S: [[u8; 4]; 512] = IQ3S_GRID;

/// A grid i-quant block, chunk by chunk.
pub(super) trait IqChunks: Copy {
    /// The float step's power of two (`acc + ((dw * da) * K) * sumi`).
    const K: f32;
    /// The block's scale.
    fn d(&self) -> half::f16;
    /// Chunk `ib` (elements `32 ib .. 32 ib + 32`): grid magnitudes (bytes
    /// below 64), sign bits (bit `i` negates element `i`), and the odd scales
    /// of elements `0..16` and `16..32`.
    unsafe fn chunk(&self, ib: usize) -> (__m256i, u32, i16, i16);
}

/// Four sign bytes from four 7-bit indices into [`KSIGNS_IQ2XS`] (the low 28
/// bits of `aux`), byte `l` for index `l`.
#[inline(always)]
fn ksigns4(aux: u32) -> u32 {
    (0..4).fold(0u32, |s, l| {
        s | (KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize] as u32) << (8 * l)
    })
}

impl IqChunks for BlockIq2Xxs {
    const K: f32 = 0.125;
    fn d(&self) -> half::f16 {
        self.d
    }
    #[inline(always)]
    unsafe fn chunk(&self, ib: usize) -> (__m256i, u32, i16, i16) {
        let (grids, aux) = iq2_xxs_words(self, ib);
        let g = |l: u32| IQ2XXS_GRID[((grids >> (8 * l)) & 0xff) as usize] as i64;
        let ls = (2 * (aux >> 28) + 1) as i16;
        let grid = unsafe { _mm256_set_epi64x(g(3), g(2), g(1), g(0)) };
        (grid, ksigns4(aux), ls, ls)
    }
}

impl IqChunks for BlockIq3Xxs {
    const K: f32 = 0.25;
    fn d(&self) -> half::f16 {
        self.d
    }
    #[inline(always)]
    unsafe fn chunk(&self, ib: usize) -> (__m256i, u32, i16, i16) {
        let aux = iq3_xxs_word(self, ib);
        let ls = (2 * (aux >> 28) + 1) as i16;
        // The eight entries by one gather (the chunk's eight index bytes).
        let grid = unsafe {
            let q = _mm_loadl_epi64(self.qs.as_ptr().add(ib * 8).cast());
            _mm256_i32gather_epi32::<4>(GRID_IQ3XXS.as_ptr().cast(), _mm256_cvtepu8_epi32(q))
        };
        (grid, ksigns4(aux), ls, ls)
    }
}

impl IqChunks for BlockIq2S {
    const K: f32 = 0.125;
    fn d(&self) -> half::f16 {
        self.d
    }
    #[inline(always)]
    unsafe fn chunk(&self, ib: usize) -> (__m256i, u32, i16, i16) {
        let s = &self.signs[4 * ib..4 * ib + 4];
        let sc = self.scales[ib];
        // iq2_s_index of entries 4 ib + l: byte qs[4 ib + l] and bits 2 l,
        // 2 l + 1 of qh[ib] as bits 8 and 9; the four entries by one gather.
        let grid = unsafe {
            let lo = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(i32::from_le_bytes([
                self.qs[4 * ib],
                self.qs[4 * ib + 1],
                self.qs[4 * ib + 2],
                self.qs[4 * ib + 3],
            ])));
            let hi = _mm_and_si128(
                _mm_srlv_epi32(
                    _mm_set1_epi32(self.qh[ib] as i32),
                    _mm_setr_epi32(0, 2, 4, 6),
                ),
                _mm_set1_epi32(3),
            );
            let idx = _mm_or_si128(lo, _mm_slli_epi32::<8>(hi));
            _mm256_i32gather_epi64::<8>(GRID_IQ2S.as_ptr().cast(), idx)
        };
        (
            grid,
            u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
            2 * (sc & 0x0F) as i16 + 1,
            2 * (sc >> 4) as i16 + 1,
        )
    }
}

impl IqChunks for BlockIq2Xs {
    const K: f32 = 0.125;
    fn d(&self) -> half::f16 {
        self.d
    }
    #[inline(always)]
    unsafe fn chunk(&self, ib: usize) -> (__m256i, u32, i16, i16) {
        let q2 = &self.qs[4 * ib..4 * ib + 4];
        let signs = (0..4).fold(0u32, |s, l| {
            s | (KSIGNS_IQ2XS[(q2[l] >> 9) as usize] as u32) << (8 * l)
        });
        let sc = self.scales[ib];
        let g = |l: usize| i64::from_le_bytes(IQ2XS_GRID[(q2[l] & 511) as usize]);
        let grid = unsafe { _mm256_set_epi64x(g(3), g(2), g(1), g(0)) };
        (
            grid,
            signs,
            2 * (sc & 0x0F) as i16 + 1,
            2 * (sc >> 4) as i16 + 1,
        )
    }
}

impl IqChunks for BlockIq3S {
    const K: f32 = 1.0;
    fn d(&self) -> half::f16 {
        self.d
    }
    #[inline(always)]
    unsafe fn chunk(&self, ib: usize) -> (__m256i, u32, i16, i16) {
        let s = &self.signs[4 * ib..4 * ib + 4];
        let ls = 2 * ((self.scales[ib / 2] >> (4 * (ib % 2))) & 0x0F) as i16 + 1;
        // Entry m's index: byte qs[8 ib + m] and bit m of qh[ib] as bit 8;
        // the eight entries by one gather.
        let grid = unsafe {
            let q = _mm_loadl_epi64(self.qs.as_ptr().add(ib * 8).cast());
            let hi = _mm256_and_si256(
                _mm256_srlv_epi32(
                    _mm256_set1_epi32(self.qh[ib] as i32),
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                ),
                _mm256_set1_epi32(1),
            );
            let idx = _mm256_or_si256(_mm256_cvtepu8_epi32(q), _mm256_slli_epi32::<8>(hi));
            _mm256_i32gather_epi32::<4>(GRID_IQ3S.as_ptr().cast(), idx)
        };
        (grid, u32::from_le_bytes([s[0], s[1], s[2], s[3]]), ls, ls)
    }
}

/// The chunk's values with their signs, as signed bytes.
#[inline(always)]
pub(super) unsafe fn signed(grid: __m256i, signs: u32) -> __m256i {
    unsafe {
        let m = sign_masks(signs);
        _mm256_sub_epi8(_mm256_xor_si256(grid, m), m)
    }
}

/// `Σ ±grid·scale·a` over 32 elements, in 8 i32 lanes: elements 0..16 take
/// `scale_lo` and 16..32 `scale_hi` (odd, below 32). Exact: the signed,
/// scaled grid values fit i16 (|g·scale| < 2048) and each product pair fits
/// i32.
#[inline(always)]
unsafe fn signed_grid_dot(
    grid: __m256i,
    signs: u32,
    a: __m256i,
    scale_lo: i16,
    scale_hi: i16,
) -> __m256i {
    unsafe {
        let g = signed(grid, signs);
        let g0 = _mm256_mullo_epi16(
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(g)),
            _mm256_set1_epi16(scale_lo),
        );
        let g1 = _mm256_mullo_epi16(
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(g)),
            _mm256_set1_epi16(scale_hi),
        );
        let a0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(a));
        let a1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(a));
        _mm256_add_epi32(_mm256_madd_epi16(g0, a0), _mm256_madd_epi16(g1, a1))
    }
}

/// One weight row against one activation row with AVX2.
#[inline(always)]
unsafe fn iq_avx2<W: IqChunks>(w: &[W], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in w.iter().zip(a) {
        let sumi = unsafe {
            let mut v = _mm256_setzero_si256();
            for ib in 0..8 {
                let (grid, signs, lo, hi) = w.chunk(ib);
                let q = load256(&a.qs[ib * 32..]);
                v = _mm256_add_epi32(v, signed_grid_dot(grid, signs, q, lo, hi));
            }
            hsum_i32(v)
        };
        acc = combine_scaled(acc, f16_to_f32(w.d()), a.d, W::K, sumi);
    }
    acc
}

/// A grid i-quant as a [`Format`]: chunk `ib` unpacked to its signed values
/// times their half's scale, as i16.
#[derive(Clone, Copy)]
pub(super) struct IqBlock {
    v: [__m512i; 8],
    d: f32,
}

/// Chunk `ib` of `w` as i16 signed values times their half's scale (a
/// function, not a closure, so that it is inlined into the kernels and
/// compiled with their target features).
#[inline(always)]
unsafe fn scaled_chunk<W: IqChunks>(w: &W, ib: usize) -> __m512i {
    unsafe {
        let (grid, signs, lo, hi) = w.chunk(ib);
        let sc = _mm512_inserti64x4::<1>(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi));
        _mm512_mullo_epi16(_mm512_cvtepi8_epi16(signed(grid, signs)), sc)
    }
}

/// The [`Format`] of weight blocks `W`.
pub(super) struct Iq<W>(std::marker::PhantomData<W>);

impl<W: IqChunks> Format for Iq<W> {
    type W = W;
    type U = IqBlock;
    type P = [__m512i; 8];
    const MINS: bool = false;
    const CORR: bool = false;
    #[inline(always)]
    unsafe fn unpack(&self, w: &W) -> IqBlock {
        unsafe {
            IqBlock {
                v: arr!(ib in 8 => scaled_chunk(w, ib)),
                // Exact: K is a power of two.
                d: f16_to_f32(w.d()) * W::K,
            }
        }
    }
    #[inline(always)]
    unsafe fn prep(&self, a: &BlockQ8K) -> [__m512i; 8] {
        unsafe { super::x86_kquant::widen_q8k(a) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &IqBlock, p: &[__m512i; 8]) -> __m512i {
        unsafe { super::x86_kquant::dot16(&u.v, p) }
    }
    #[inline(always)]
    unsafe fn fac(&self, _u: &IqBlock) -> __m256i {
        unsafe { _mm256_setzero_si256() }
    }
    #[inline(always)]
    fn scales(u: &IqBlock) -> (f32, f32) {
        (u.d, 0.0)
    }
}

/// The one-row AVX2 kernel, and the tile and eight-row AVX-512 kernels, of
/// one grid i-quant.
macro_rules! iq_kernels {
    ($w:ty, $avx2:ident, $tile:ident, $rows8:ident) => {
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn $avx2(w: &[$w], a: &[BlockQ8K]) -> f32 {
            unsafe { iq_avx2(w, a) }
        }

        #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
        pub(super) unsafe fn $tile(
            w: &[$w],
            nb: usize,
            rows: usize,
            acts: &[&[BlockQ8K]],
            out: &mut [f32],
            row0: usize,
        ) {
            let f = Iq::<$w>(std::marker::PhantomData);
            unsafe { tile(&f, w, nb, rows, acts, out, row0) }
        }

        #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
        pub(super) unsafe fn $rows8(w: &[&[$w]; 8], a: &[BlockQ8K], out: &mut [f32; 8]) {
            let f = Iq::<$w>(std::marker::PhantomData);
            unsafe { rows8(&f, w, a, out) }
        }
    };
}

iq_kernels!(BlockIq2Xxs, iq2_xxs_avx2, iq2_xxs_tile, iq2_xxs_rows8);
iq_kernels!(BlockIq2Xs, iq2_xs_avx2, iq2_xs_tile, iq2_xs_rows8);
iq_kernels!(BlockIq2S, iq2_s_avx2, iq2_s_tile, iq2_s_rows8);
iq_kernels!(BlockIq3Xxs, iq3_xxs_avx2, iq3_xxs_tile, iq3_xxs_rows8);
iq_kernels!(BlockIq3S, iq3_s_avx2, iq3_s_tile, iq3_s_rows8);
