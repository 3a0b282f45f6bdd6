//! AVX2 kernels of the formats of llama-quantize's K mixes (Q2_K to Q6_K;
//! Q8_0, which UD-style files put on attention and SSM projections; IQ4_XS)
//! and of the 32-value formats of Q4_0, IQ4_NL and MXFP4 files, on CPUs
//! without AVX-512. The K formats have one unpacking of a weight block for
//! the tile kernel (every weight row of a call against groups of up to 8
//! activation rows, each block unpacked once for the group's rows: batched
//! prefill) and the one-row kernel (decode). A block's sub-block
//! scales are decoded once, and its mins (or Q6_K's offset correction) meet
//! the activation's bsums in one vector multiply-add. The 32-value formats'
//! tile takes the values' magnitudes of each group of 8 weight blocks once
//! for up to 8 activation rows, IQ4_XS's looks each block's levels up once
//! for them; a block's dot is then one byte multiply-add.
//!
//! Per (weight row, activation row) the arithmetic is the scalar
//! reference's: a block's integer sums (the quants' dot with each sub-block
//! scale, the mins' or Q6_K's offset correction against the activation's
//! bsums) are exact whatever their order, and the float steps run the
//! reference's `combine_min` / `combine` in block order (in the tile kernel
//! with one activation row per vector lane, separate multiply and add), so
//! every value has the bits of the scalar kernels.

use super::ActRow;
use super::scalar;
use super::scalar::{combine, combine_min};
use super::x86::{finish_lanes8, hsum_i32, hsum8, load256, load256u, q4_0_values, table_values};
use super::x86_kquant::scratch;
use super::x86_multi::drive_tile;
use crate::blocks::*;
use crate::error::Result;
use samesum_gguf::GgmlType;
use std::arch::x86_64::*;

/// Formats with an AVX2 tile kernel.
pub(super) const TILE_FORMATS: &[GgmlType] = &[
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::IQ4_XS,
];

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
    /// Mins (`combine_min`); without them the values' offset (Q6_K's 32,
    /// Q3_K's 4: `1 << OFFSET_SHIFT`) is taken off the sum as `offset *
    /// (scales . bsums)` (`combine`).
    const MINS: bool;
    const OFFSET_SHIFT: i32 = 0;
    /// # Safety
    /// The CPU has AVX2.
    unsafe fn unpack(w: &Self::W) -> Unpacked;
}

/// The 8 scales (each broadcast to a whole vector) and the mins (each
/// twice, in order) of a Q4_K or Q5_K block's packed 6-bit scales: the
/// bytes unpacked as four u32 words (scales 0-7 in the first two, mins 0-7
/// in the last two, each the value `scale_min_k4` gives), then widened to
/// i16 and spread by byte shuffles.
#[inline(always)]
unsafe fn scales_mins_k4(s: &[u8; 12]) -> ([__m256i; 8], __m256i) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    let u = [
        w0 & LOW6,
        (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4),
        w1 & LOW6,
        ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4),
    ];
    unsafe {
        let x = _mm_loadu_si128(u.as_ptr() as *const __m128i);
        let sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(x));
        let sc: [__m256i; 8] = std::array::from_fn(|k| {
            let m = _mm256_loadu_si256(WORD_BCAST[k].as_ptr() as *const __m256i);
            _mm256_shuffle_epi8(sc16, m)
        });
        let m8 = _mm_cvtepu8_epi16(_mm_srli_si128::<8>(x));
        let mins = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
        (sc, mins)
    }
}

/// A byte shuffle putting i16 word `lo` of each 128-bit lane in every word
/// of the low lane and word `hi` in every word of the high lane.
const fn word_shuffle(lo: usize, hi: usize) -> [u8; 32] {
    let mut t = [0u8; 32];
    let mut b = 0;
    while b < 32 {
        let word = if b < 16 { lo } else { hi };
        t[b] = (2 * word + b % 2) as u8;
        b += 1;
    }
    t
}

/// `WORD_BCAST[k]`: word `k` to every word of both lanes.
static WORD_BCAST: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let mut k = 0;
    while k < 8 {
        t[k] = word_shuffle(k, k);
        k += 1;
    }
    t
};

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

/// `PAIR_BCAST[i]`: word `2 i` to the low lane, word `2 i + 1` to the high.
static PAIR_BCAST: [[u8; 32]; 4] = {
    let mut t = [[0u8; 32]; 4];
    let mut i = 0;
    while i < 4 {
        t[i] = word_shuffle(2 * i, 2 * i + 1);
        i += 1;
    }
    t
};

struct Q6K;
impl Format for Q6K {
    type W = BlockQ6K;
    const MINS: bool = false;
    const OFFSET_SHIFT: i32 = 5;
    #[inline(always)]
    unsafe fn unpack(w: &BlockQ6K) -> Unpacked {
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let m2 = _mm256_set1_epi8(0x03);
            let mut q = [_mm256_setzero_si256(); 8];
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
            }
            // Values 32 i .. 32 i + 31 are sub-blocks 2 i and 2 i + 1 of 16.
            let s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.scales.as_ptr() as *const __m128i));
            let sc = group_scales16(s16);
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

/// The per-pair i16 scales of the 16 groups of 16 values in `s16` (groups
/// 0-7 in the low half, 8-15 in the high): vector `k` (values 32 k ..) gets
/// group 2 k in its low lane and 2 k + 1 in its high lane.
#[inline(always)]
unsafe fn group_scales16(s16: __m256i) -> [__m256i; 8] {
    unsafe {
        let halves = [
            _mm256_permute4x64_epi64::<0x44>(s16),
            _mm256_permute4x64_epi64::<0xEE>(s16),
        ];
        std::array::from_fn(|i| {
            let m = _mm256_loadu_si256(PAIR_BCAST[i % 4].as_ptr() as *const __m256i);
            _mm256_shuffle_epi8(halves[i / 4], m)
        })
    }
}

/// The 2-bit values of a Q2_K / Q3_K block's `qs`: vector `k` (values 32 k
/// ..) is bits 2 (k % 4) of bytes 32 (k / 4) ...
#[inline(always)]
unsafe fn crumbs(qs: &[u8; 64]) -> [__m256i; 8] {
    unsafe {
        let m2 = _mm256_set1_epi8(0x03);
        let x = [load256u(&qs[..32]), load256u(&qs[32..])];
        std::array::from_fn(|k| {
            let v = x[k / 4];
            let v = match k % 4 {
                0 => v,
                1 => _mm256_srli_epi16::<2>(v),
                2 => _mm256_srli_epi16::<4>(v),
                _ => _mm256_srli_epi16::<6>(v),
            };
            _mm256_and_si256(v, m2)
        })
    }
}

struct Q2K;
impl Format for Q2K {
    type W = BlockQ2K;
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unpack(w: &BlockQ2K) -> Unpacked {
        unsafe {
            // Each group's scale in the low nibble, its min in the high.
            let s = _mm_loadu_si128(w.scales.as_ptr() as *const __m128i);
            let m4 = _mm_set1_epi8(0x0F);
            let sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s, m4));
            let mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(s), m4));
            Unpacked {
                q: crumbs(&w.qs),
                sc: group_scales16(sc16),
                m: mn16,
                d: f16_to_f32(w.d),
                dmin: f16_to_f32(w.dmin),
            }
        }
    }
}

struct Q3K;
impl Format for Q3K {
    type W = BlockQ3K;
    const MINS: bool = false;
    const OFFSET_SHIFT: i32 = 2;
    #[inline(always)]
    unsafe fn unpack(w: &BlockQ3K) -> Unpacked {
        unsafe {
            // Value e is (its 2 bits | hmask bit e / 32 of byte e % 32 << 2) - 4.
            let hm = load256u(&w.hmask);
            let one = _mm256_set1_epi8(1);
            let low = crumbs(&w.qs);
            let q: [__m256i; 8] = std::array::from_fn(|k| {
                let h = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(k as i32)), one);
                _mm256_or_si256(low[k], _mm256_slli_epi16::<2>(h))
            });
            let sc = q3k_scales(&w.scales);
            let s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr() as *const __m128i));
            Unpacked {
                q,
                sc: group_scales16(s16),
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
                    let shift = _mm_cvtsi32_si128(F::OFFSET_SHIFT);
                    let s = _mm256_sub_epi32(sumi, _mm256_sll_epi32(summ, shift));
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

/// Weight row `w` · activation row `a`, one block after another.
#[inline(always)]
unsafe fn row<F: Format>(w: &[F::W], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w.iter().zip(a) {
        unsafe {
            let u = F::unpack(wb);
            let mut v = _mm256_setzero_si256();
            for k in 0..8 {
                let p = _mm256_maddubs_epi16(u.q[k], load256(&ab.qs[32 * k..]));
                v = _mm256_add_epi32(v, _mm256_madd_epi16(p, u.sc[k]));
            }
            let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
            let mv = _mm256_madd_epi16(u.m, bs);
            acc = if F::MINS {
                combine_min(acc, u.d, u.dmin, ab.d, hsum_i32(v), hsum_i32(mv))
            } else {
                let shift = _mm_cvtsi32_si128(F::OFFSET_SHIFT);
                let s = _mm256_sub_epi32(v, _mm256_sll_epi32(mv, shift));
                combine(acc, u.d, ab.d, hsum_i32(s))
            };
        }
    }
    acc
}

/// The one-row kernels (`super::x86::dot_rows`' AVX2 entries), each
/// [`row`] of its format.
macro_rules! row_kernels {
    ($($name:ident: $w:ty => $f:ty),* $(,)?) => {$(
        /// # Safety
        /// The CPU has AVX2; `a` has at least as many blocks as `w`.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn $name(w: &[$w], a: &[BlockQ8K]) -> f32 {
            unsafe { row::<$f>(w, a) }
        }
    )*};
}

row_kernels!(
    q2_k_row: BlockQ2K => Q2K,
    q3_k_row: BlockQ3K => Q3K,
    q4_k_row: BlockQ4K => Q4K,
    q5_k_row: BlockQ5K => Q5K,
    q6_k_row: BlockQ6K => Q6K,
);

/// A format of 32-value blocks against Q8_0 activations, as its one-row
/// AVX2 kernel reads it.
trait Blk32 {
    type W: bytemuck::Pod;
    /// The block's 32 values as signed bytes (-128 only in Q8_0, whose
    /// magnitude 128 is still an unsigned byte).
    ///
    /// # Safety
    /// The CPU has AVX2.
    unsafe fn values(w: &Self::W) -> __m256i;
    /// The scales of 8 consecutive blocks as f32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C.
    unsafe fn scales8(w: &[Self::W]) -> __m256;
    /// One block's term, as the one-row kernel takes the blocks past the
    /// last whole group of 8.
    fn term(w: &Self::W, a: &BlockQ8_0) -> f32;
}

/// The f32 lanes of 8 f16 scales.
#[inline(always)]
unsafe fn f16x8(d: impl Fn(usize) -> half::f16) -> __m256 {
    let bits: [u16; 8] = std::array::from_fn(|k| d(k).to_bits());
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i)) }
}

struct Q80;
impl Blk32 for Q80 {
    type W = BlockQ8_0;
    unsafe fn values(w: &BlockQ8_0) -> __m256i {
        unsafe { load256(&w.qs) }
    }
    unsafe fn scales8(w: &[BlockQ8_0]) -> __m256 {
        unsafe { f16x8(|k| w[k].d) }
    }
    fn term(w: &BlockQ8_0, a: &BlockQ8_0) -> f32 {
        scalar::term(f16_to_f32(w.d), f16_to_f32(a.d), scalar::sumi_q8_0(w, a))
    }
}

struct Q40;
impl Blk32 for Q40 {
    type W = BlockQ4_0;
    unsafe fn values(w: &BlockQ4_0) -> __m256i {
        unsafe { q4_0_values(w) }
    }
    unsafe fn scales8(w: &[BlockQ4_0]) -> __m256 {
        unsafe { f16x8(|k| w[k].d) }
    }
    fn term(w: &BlockQ4_0, a: &BlockQ8_0) -> f32 {
        scalar::term(f16_to_f32(w.d), f16_to_f32(a.d), scalar::sumi_q4_0(w, a))
    }
}

struct Iq4Nl;
impl Blk32 for Iq4Nl {
    type W = BlockIq4Nl;
    unsafe fn values(w: &BlockIq4Nl) -> __m256i {
        unsafe { table_values(&KVALUES_IQ4NL, &w.qs) }
    }
    unsafe fn scales8(w: &[BlockIq4Nl]) -> __m256 {
        unsafe { f16x8(|k| w[k].d) }
    }
    fn term(w: &BlockIq4Nl, a: &BlockQ8_0) -> f32 {
        scalar::iq4_nl_q8_0(std::slice::from_ref(w), std::slice::from_ref(a))
    }
}

struct Mxfp4;
impl Blk32 for Mxfp4 {
    type W = BlockMxfp4;
    unsafe fn values(w: &BlockMxfp4) -> __m256i {
        unsafe { table_values(&KVALUES_MXFP4, &w.qs) }
    }
    unsafe fn scales8(w: &[BlockMxfp4]) -> __m256 {
        let d: [f32; 8] = std::array::from_fn(|k| e8m0_to_f32_half(w[k].e));
        unsafe { _mm256_loadu_ps(d.as_ptr()) }
    }
    fn term(w: &BlockMxfp4, a: &BlockQ8_0) -> f32 {
        scalar::mxfp4_q8_0(std::slice::from_ref(w), std::slice::from_ref(a))
    }
}

/// The tile of a format of 32-value blocks (Q8_0, Q4_0, IQ4_NL, MXFP4):
/// `out[(row0 + r) * rows + j]` = weight row `j` · `acts[r]`, with the
/// one-row kernel's float steps (`lanes8`: block `b`'s term into lane `b
/// % 8`, eight blocks a vector step, the tail by the scalar term, then
/// `reduce8`). A block's integer dot is one unsigned-by-signed byte
/// multiply-add of the weight values' magnitudes (taken once per group of 8
/// weight blocks for all the activation rows) against the activation bytes
/// with the values' signs: exact while no activation byte is -128 (|w| <=
/// 128 and |a| <= 127 keep each i16 pair sum within 2 x 128 x 127). The
/// quantizer never writes -128 (its quants are rounded from at most 127 in
/// magnitude); an activation row that holds one anyway takes the exact i16
/// widening of both operands for every block. Either way the same integers.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn blk32_tile<B: Blk32>(
    w: &[B::W],
    nb: usize,
    rows: usize,
    acts: &[&[BlockQ8_0]],
    out: &mut [f32],
    row0: usize,
) {
    let nr = acts.len().min(8);
    let groups = nb / 8;
    unsafe {
        // SAFETY: `groups * nr` values, all written below, used only here.
        let da = std::slice::from_raw_parts_mut(scratch::<__m256>(groups * nr), groups * nr);
        // Rows whose bytes avoid -128 (the byte multiply-add's domain).
        let mut narrow = [true; 8];
        for (r, a) in acts.iter().enumerate().take(nr) {
            for g in 0..groups {
                da[r * groups + g] = f16x8(|k| a[8 * g + k].d);
            }
            narrow[r] = narrow_bytes(a[..groups * 8].iter().map(|b| &b.qs[..]));
        }
        let all_narrow = narrow[..nr].iter().all(|&n| n);
        let ones = _mm256_set1_epi16(1);
        for j in 0..rows {
            let wr = &w[j * nb..(j + 1) * nb];
            let mut acc = [_mm256_setzero_ps(); 8];
            for g in 0..groups {
                let wb = &wr[8 * g..8 * g + 8];
                let dw = B::scales8(wb);
                let wq: [__m256i; 8] = std::array::from_fn(|k| B::values(&wb[k]));
                let mag: [__m256i; 8] = std::array::from_fn(|k| _mm256_abs_epi8(wq[k]));
                let wide: [[__m256i; 2]; 8] = if all_narrow {
                    [[_mm256_setzero_si256(); 2]; 8]
                } else {
                    std::array::from_fn(|k| widen(wq[k]))
                };
                for (r, a) in acts.iter().enumerate().take(nr) {
                    let ab = &a[8 * g..8 * g + 8];
                    let v: [__m256i; 8] = if narrow[r] {
                        std::array::from_fn(|k| {
                            let q = _mm256_sign_epi8(load256(&ab[k].qs), wq[k]);
                            _mm256_madd_epi16(_mm256_maddubs_epi16(mag[k], q), ones)
                        })
                    } else {
                        std::array::from_fn(|k| {
                            let [lo, hi] = widen(load256(&ab[k].qs));
                            _mm256_add_epi32(
                                _mm256_madd_epi16(wide[k][0], lo),
                                _mm256_madd_epi16(wide[k][1], hi),
                            )
                        })
                    };
                    let s = _mm256_cvtepi32_ps(hsum8(&v));
                    let f = _mm256_mul_ps(dw, da[r * groups + g]);
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(f, s));
                }
            }
            for (r, a) in acts.iter().enumerate().take(nr) {
                out[(row0 + r) * rows + j] =
                    finish_lanes8(acc[r], groups * 8..nb, |b| B::term(&wr[b], &a[b]));
            }
        }
    }
}

/// 32 signed bytes widened to two vectors of 16 i16.
#[inline(always)]
unsafe fn widen(q: __m256i) -> [__m256i; 2] {
    unsafe {
        [
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(q)),
        ]
    }
}

/// Whether the activation bytes `qs` hold no -128 (the domain of the byte
/// multiply-adds below, where an activation byte takes a weight's sign).
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
unsafe fn narrow_bytes<'a>(qs: impl Iterator<Item = &'a [i8]>) -> bool {
    let m128 = _mm256_set1_epi8(i8::MIN);
    let mut hit = _mm256_setzero_si256();
    for q in qs {
        for c in q.chunks_exact(32) {
            hit = _mm256_or_si256(hit, _mm256_cmpeq_epi8(unsafe { load256(c) }, m128));
        }
    }
    _mm256_testz_si256(hit, hit) == 1
}

/// IQ4_XS's tile: `out[(row0 + r) * rows + j]` = weight row `j` · `acts[r]`
/// with the scalar reference's float step per block (`combine`, one
/// activation row a vector lane). Each weight block's 256 levels are looked
/// up once for up to 8 activation rows; a sub-block's dot is one
/// unsigned-by-signed byte multiply-add of the levels' magnitudes against
/// the activation bytes with the levels' signs (|level| <= 127, |a| <= 127),
/// then one multiply-add by the sub-block scale. An activation row holding
/// -128 (which the quantizer never writes) takes the exact i16 widening of
/// both operands instead. The same integers either way.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn iq4_xs_tile(
    w: &[BlockIq4Xs],
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
        let mut narrow = [true; 8];
        for r in 0..8 {
            narrow[r] = if r < nr {
                narrow_bytes(a[r][..nb].iter().map(|b| &b.qs[..]))
            } else {
                narrow[nr - 1]
            };
        }
        let all_narrow = narrow.iter().all(|&n| n);
        // SAFETY: `nb` values, all written below, used only in this call.
        let da = std::slice::from_raw_parts_mut(scratch::<__m256>(nb), nb);
        for (b, x) in da.iter_mut().enumerate() {
            let d: [f32; 8] = std::array::from_fn(|r| a[r][b].d);
            *x = _mm256_loadu_ps(d.as_ptr());
        }
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        let m4 = _mm_set1_epi8(0x0F);
        for j in 0..rows {
            let wr = &w[j * nb..(j + 1) * nb];
            let mut acc = _mm256_setzero_ps();
            for (b, (wb, &dab)) in wr.iter().zip(da.iter()).enumerate() {
                let sc = iq4xs_scales(wb);
                // Sub-block k (its levels, their magnitudes and its scale in
                // registers) against every row, then the next: 8 row sums
                // and 3 operands fit AVX2's 16 vector registers.
                let mut v = [_mm256_setzero_si256(); 8];
                for k in 0..8 {
                    // The low nibbles of its 16 bytes, then the high.
                    let q = _mm_loadu_si128(wb.qs[16 * k..].as_ptr() as *const __m128i);
                    let idx = _mm256_set_m128i(
                        _mm_and_si128(_mm_srli_epi16::<4>(q), m4),
                        _mm_and_si128(q, m4),
                    );
                    let vals = _mm256_shuffle_epi8(table, idx);
                    let mag = _mm256_abs_epi8(vals);
                    let scv = _mm256_set1_epi16(sc[k] as i16);
                    if all_narrow {
                        for (r, vr) in v.iter_mut().enumerate() {
                            let q = _mm256_sign_epi8(load256(&a[r][b].qs[32 * k..]), vals);
                            let p = _mm256_maddubs_epi16(mag, q);
                            *vr = _mm256_add_epi32(*vr, _mm256_madd_epi16(p, scv));
                        }
                    } else {
                        // The levels times the scale as i16 (|127 x 32| < 2^15).
                        let [lo, hi] = widen(vals);
                        let (lo, hi) = (_mm256_mullo_epi16(lo, scv), _mm256_mullo_epi16(hi, scv));
                        for (r, vr) in v.iter_mut().enumerate() {
                            let x = load256(&a[r][b].qs[32 * k..]);
                            let p = if narrow[r] {
                                _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, vals)),
                                    scv,
                                )
                            } else {
                                let [xl, xh] = widen(x);
                                _mm256_add_epi32(
                                    _mm256_madd_epi16(lo, xl),
                                    _mm256_madd_epi16(hi, xh),
                                )
                            };
                            *vr = _mm256_add_epi32(*vr, p);
                        }
                    }
                }
                // Lane r: row r's exact block sum.
                let sumi = hsum8(&v);
                let dd = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(wb.d)), dab);
                acc = _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(sumi)));
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
        GgmlType::Q4_K => drive_tile(weight, w, acts, n, rows, out, tile::<Q4K>)?,
        GgmlType::Q5_K => drive_tile(weight, w, acts, n, rows, out, tile::<Q5K>)?,
        GgmlType::Q6_K => drive_tile(weight, w, acts, n, rows, out, tile::<Q6K>)?,
        GgmlType::Q2_K => drive_tile(weight, w, acts, n, rows, out, tile::<Q2K>)?,
        GgmlType::Q3_K => drive_tile(weight, w, acts, n, rows, out, tile::<Q3K>)?,
        GgmlType::Q8_0 => drive_tile(weight, w, acts, n, rows, out, blk32_tile::<Q80>)?,
        GgmlType::Q4_0 => drive_tile(weight, w, acts, n, rows, out, blk32_tile::<Q40>)?,
        GgmlType::IQ4_NL => drive_tile(weight, w, acts, n, rows, out, blk32_tile::<Iq4Nl>)?,
        GgmlType::MXFP4 => drive_tile(weight, w, acts, n, rows, out, blk32_tile::<Mxfp4>)?,
        GgmlType::IQ4_XS => drive_tile(weight, w, acts, n, rows, out, iq4_xs_tile)?,
        _ => return Ok(false),
    }
    Ok(true)
}
