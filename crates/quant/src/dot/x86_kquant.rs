//! AVX-512 kernels for the 256-element formats (Q4_K, Q5_K, Q6_K, IQ4_XS)
//! that dot many row pairs at once: a tile of weight rows against up to 8
//! activation rows (batched prefill), and 8 weight rows against one activation
//! row (decode).
//!
//! Each activation block is prepared once per call (for Q4_K/Q5_K its quants
//! reordered so that four `maddubs` results of one sub-block share lanes and
//! add in i16 before one multiply by the scales; for IQ4_XS widened to i16),
//! and each weight block is unpacked once for every activation row. The
//! integer block sums are exact (whatever their order: every partial sum is
//! bounded well inside its lane type), and the float combination runs the
//! scalar reference's steps in its order with one row per vector lane
//! (separate multiply and add, no FMA), so every value has the bits of
//! [`super::scalar`].

use super::x86::{IDX_PAIRS, crumbs, hsum8, join, load256, load256u};
use crate::blocks::*;
use std::arch::x86_64::*;

/// A 256-element weight format. Every method is `inline(always)` (a closure
/// or a non-inlined helper here would pass every vector through memory).
pub(super) trait Format {
    type W;
    /// One weight block, unpacked.
    type U: Copy;
    /// One activation block, prepared.
    type P: Copy;
    /// The block has mins: `acc - (dmin*da)*summ` after each block, with
    /// `summ = Σ fac·bsums`.
    const MINS: bool;
    /// The block's sum is `dot − 2^CORR_SHIFT·Σ fac·bsums` (Q6_K's offset of
    /// 32, Q3_K's of 4).
    const CORR: bool;
    /// The power of two of the `CORR` offset.
    const CORR_SHIFT: i32 = 5;
    unsafe fn unpack(&self, w: &Self::W) -> Self::U;
    unsafe fn prep(&self, a: &BlockQ8K) -> Self::P;
    /// 16 lanes whose total is the exact integer dot of the block pair (before
    /// any `CORR` correction).
    unsafe fn dot(&self, u: &Self::U, p: &Self::P) -> __m512i;
    /// 16 i16 factors against the activation's 16 `bsums`.
    unsafe fn fac(&self, u: &Self::U) -> __m256i;
    /// Block scales (`d`, and `dmin` with `MINS`).
    fn scales(u: &Self::U) -> (f32, f32);
}

/// f16 to f32 by F16C (the bits of [`f16_to_f32`]).
#[inline(always)]
unsafe fn h2f(h: half::f16) -> f32 {
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32))) }
}

/// Rows `a` and `b` interleaved by dword, their partial sums added.
#[inline(always)]
pub(super) unsafe fn pair32(a: __m512i, b: __m512i) -> __m512i {
    unsafe { _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b)) }
}

/// Two row pairs interleaved by qword, their partial sums added.
#[inline(always)]
pub(super) unsafe fn pair64(a: __m512i, b: __m512i) -> __m512i {
    unsafe { _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b)) }
}

/// Lane `r` of the result is the total of the 16 lanes of `v[r]` (exact: i32
/// additions in another order).
#[inline(always)]
unsafe fn tree8(v: &[__m512i; 8]) -> __m256i {
    unsafe {
        // 128-bit lane l of `x0` holds partial sums of rows 0..4 in order, of
        // `x1` of rows 4..8.
        let x0 = pair64(pair32(v[0], v[1]), pair32(v[2], v[3]));
        let x1 = pair64(pair32(v[4], v[5]), pair32(v[6], v[7]));
        // [x0.l0, x0.l1, x1.l0, x1.l1] + [x0.l2, x0.l3, x1.l2, x1.l3].
        let g = _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0b01_00_01_00>(x0, x1),
            _mm512_shuffle_i32x4::<0b11_10_11_10>(x0, x1),
        );
        let s = _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0b10_00_10_00>(g, g),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(g, g),
        );
        _mm512_castsi512_si256(s)
    }
}

/// `Σ_k madd(bt[k], dword k of f)`: lane `r` is `Σ_g f_g · bsum_{r,g}` when
/// `bt[k]` holds the bsum pairs `2k, 2k+1` of row `r` in dword `r`. Two `k` a
/// 512-bit multiply (`bt[2i]`, `bt[2i+1]` are one 64-byte run; `idx[i]` has
/// dword `2i` in the low half and `2i + 1` in the high).
#[inline(always)]
unsafe fn bsum_dot(f: __m256i, bt: &[__m256i; 8], idx: &[__m512i; 4]) -> __m256i {
    unsafe {
        let f = _mm512_castsi256_si512(f);
        let bt = bt.as_ptr().cast::<__m512i>();
        let t = arr!(i in 4 => _mm512_madd_epi16(
            _mm512_loadu_si512(bt.add(i).cast()),
            _mm512_permutexvar_epi32(idx[i], f),
        ));
        let s = _mm512_add_epi32(_mm512_add_epi32(t[0], t[1]), _mm512_add_epi32(t[2], t[3]));
        _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s))
    }
}

/// The 8×8 dword transpose: dword `r` of result `k` is dword `k` of `m[r]`.
#[inline(always)]
unsafe fn transpose8(m: &[__m256i; 8]) -> [__m256i; 8] {
    unsafe {
        let a = arr!(i in 4 => _mm256_unpacklo_epi32(m[2 * i], m[2 * i + 1]));
        let b = arr!(i in 4 => _mm256_unpackhi_epi32(m[2 * i], m[2 * i + 1]));
        // a[i]: [m2i.0, m2i+1.0, m2i.1, m2i+1.1 | m2i.4, m2i+1.4, m2i.5, m2i+1.5]
        let c = arr!(i in 2 => _mm256_unpacklo_epi64(a[2 * i], a[2 * i + 1]));
        let d = arr!(i in 2 => _mm256_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
        let e = arr!(i in 2 => _mm256_unpacklo_epi64(b[2 * i], b[2 * i + 1]));
        let f = arr!(i in 2 => _mm256_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
        // c[i]: dword 0 (low lane) / 4 (high lane) of rows 4i..4i+4, d: 1 / 5,
        // e: 2 / 6, f: 3 / 7.
        [
            _mm256_permute2x128_si256::<0x20>(c[0], c[1]),
            _mm256_permute2x128_si256::<0x20>(d[0], d[1]),
            _mm256_permute2x128_si256::<0x20>(e[0], e[1]),
            _mm256_permute2x128_si256::<0x20>(f[0], f[1]),
            _mm256_permute2x128_si256::<0x31>(c[0], c[1]),
            _mm256_permute2x128_si256::<0x31>(d[0], d[1]),
            _mm256_permute2x128_si256::<0x31>(e[0], e[1]),
            _mm256_permute2x128_si256::<0x31>(f[0], f[1]),
        ]
    }
}

thread_local! {
    /// The prepared activations of the tiles run on this thread: one
    /// allocation reused by every call (a call per tile of every matmul).
    static SCRATCH: std::cell::RefCell<Vec<__m512i>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// This thread's scratch buffer as room for `n` values of `T`, a type of
/// SIMD vectors (any bytes are a valid value; alignment at most 64).
///
/// # Safety
/// The memory stays valid until the next call on this thread: use it only
/// until then (the tiles do not nest, and each takes it once).
#[inline(always)]
pub(super) unsafe fn scratch<T: Copy>(n: usize) -> *mut T {
    const { assert!(std::mem::align_of::<T>() <= 64) };
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let zmm = (n * std::mem::size_of::<T>()).div_ceil(64);
        if s.len() < zmm {
            // SAFETY: an all-zero vector is a valid __m512i.
            s.resize(zmm, unsafe { std::mem::zeroed() });
        }
        s.as_mut_ptr().cast::<T>()
    })
}

/// One activation block for the tile loop: prepared quants of 8 rows, their
/// bsums transposed (dword `r` of `bt[k]`: bsums `2k, 2k+1` of row `r`), and the
/// 8 scales.
#[derive(Clone, Copy)]
struct Prepared<P> {
    p: [P; 8],
    bt: [__m256i; 8],
    da: __m256,
}

/// A tile: every weight row of `w` (`rows` rows of `nb` blocks) against the
/// activation rows `acts` (1 to 8); `out[(row0 + r) * rows + j]` = row `j` ·
/// `acts[r]`.
#[inline(always)]
pub(super) unsafe fn tile<F: Format>(
    f: &F,
    w: &[F::W],
    nb: usize,
    rows: usize,
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
    row0: usize,
) {
    let nr = acts.len().min(8);
    unsafe {
        let bidx = arr!(i in 4 => _mm512_inserti64x4::<1>(
            _mm512_set1_epi32(2 * i as i32),
            _mm256_set1_epi32(2 * i as i32 + 1),
        ));
        // SAFETY: `nb` values, every byte initialized, used only in this call.
        let prep = std::slice::from_raw_parts_mut(scratch::<Prepared<F::P>>(nb), nb);
        for b in 0..nb {
            // Rows past `nr` repeat the last one (their results are dropped).
            let a = |r: usize| &acts[r.min(nr - 1)][b];
            let bs = arr!(r in 8 => _mm256_loadu_si256(a(r).bsums.as_ptr() as *const __m256i));
            let mut da = [0f32; 8];
            for (x, a) in da.iter_mut().zip(acts) {
                *x = a[b].d;
            }
            prep[b] = Prepared {
                p: arr!(r in 8 => f.prep(a(r))),
                bt: transpose8(&bs),
                da: _mm256_loadu_ps(da.as_ptr()),
            };
        }
        let size = std::mem::size_of::<F::W>();
        for j in (0..rows).step_by(2) {
            let j1 = (j + 1).min(rows - 1);
            let (w0, w1) = (&w[j * nb..(j + 1) * nb], &w[j1 * nb..(j1 + 1) * nb]);
            // The next pair of rows follows this one: fetch it block by block
            // (prefetches never fault, past the end of the weights included).
            let next = w1.as_ptr().cast::<u8>().wrapping_add(nb * size);
            let mut acc = [_mm256_setzero_ps(); 2];
            for (b, pb) in prep.iter().enumerate() {
                for t in 0..2 {
                    let p = next.wrapping_add((t * nb + b) * size);
                    for line in (0..size).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line).cast());
                    }
                }
                let u = [f.unpack(&w0[b]), f.unpack(&w1[b])];
                for t in 0..2 {
                    let mut v = [_mm512_setzero_si512(); 8];
                    for r in 0..nr {
                        v[r] = f.dot(&u[t], &pb.p[r]);
                    }
                    let mut s = tree8(&v);
                    let (d, dmin) = F::scales(&u[t]);
                    if F::CORR {
                        let m = bsum_dot(f.fac(&u[t]), &pb.bt, &bidx);
                        s = _mm256_sub_epi32(
                            s,
                            _mm256_sll_epi32(m, _mm_cvtsi32_si128(F::CORR_SHIFT)),
                        );
                    }
                    let sumi = _mm256_cvtepi32_ps(s);
                    acc[t] = _mm256_add_ps(
                        acc[t],
                        _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), pb.da), sumi),
                    );
                    if F::MINS {
                        let summ = _mm256_cvtepi32_ps(bsum_dot(f.fac(&u[t]), &pb.bt, &bidx));
                        acc[t] = _mm256_sub_ps(
                            acc[t],
                            _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), pb.da), summ),
                        );
                    }
                }
            }
            let mut res = [[0f32; 8]; 2];
            _mm256_storeu_ps(res[0].as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(res[1].as_mut_ptr(), acc[1]);
            for r in 0..nr {
                out[(row0 + r) * rows + j] = res[0][r];
                out[(row0 + r) * rows + j1] = res[1][r];
            }
        }
    }
}

/// Eight weight rows (one contiguous run of `8 * a.len()` blocks) against one
/// activation row: the same per-block steps, one weight row per lane.
#[inline(always)]
pub(super) unsafe fn rows8<F: Format>(f: &F, w: &[&[F::W]; 8], a: &[BlockQ8K], out: &mut [f32; 8]) {
    let size = std::mem::size_of::<F::W>();
    // The rows are read in an interleaved order the hardware prefetcher follows
    // poorly: each block step fetches the same block of the next run instead,
    // into the L2 (T1): fetched into the L1, the next run's lines pushed out
    // the ones being read (8-layer qwen35moe q4_k_m decode on a 2-core EPYC,
    // 2 threads: tg32 20.5-23.9 tok/s with T0, 28.8-34.0 with T1).
    let next = w[0].as_ptr().cast::<u8>().wrapping_add(8 * a.len() * size);
    unsafe {
        let mut acc = _mm256_setzero_ps();
        for (b, ab) in a.iter().enumerate() {
            let p = f.prep(ab);
            let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
            let mut v = [_mm512_setzero_si512(); 8];
            let mut ms = [_mm256_setzero_si256(); 8];
            let (mut d, mut dmin) = ([0f32; 8], [0f32; 8]);
            for t in 0..8 {
                let pf = next.wrapping_add((t * a.len() + b) * size);
                for line in (0..size).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(line).cast());
                }
                let u = f.unpack(&w[t][b]);
                v[t] = f.dot(&u, &p);
                if F::MINS || F::CORR {
                    ms[t] = _mm256_madd_epi16(f.fac(&u), bs);
                }
                (d[t], dmin[t]) = F::scales(&u);
            }
            let da = _mm256_set1_ps(ab.d);
            let mut s = tree8(&v);
            if F::CORR {
                s = _mm256_sub_epi32(
                    s,
                    _mm256_sll_epi32(hsum8(&ms), _mm_cvtsi32_si128(F::CORR_SHIFT)),
                );
            }
            let sumi = _mm256_cvtepi32_ps(s);
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

// ---------------------------------------------------------------- Q4_K, Q5_K

/// A Q4_K/Q5_K block in the sub-block-interleaved order: qword `j` of `q[k]`
/// holds elements `8k..8k+8` of sub-block `j` (so the four `maddubs` results
/// share their scale lane by lane), `sc` the scale of each i16 lane, `m` the
/// mins each twice (against the two bsums of their sub-block).
#[derive(Clone, Copy)]
pub(super) struct K4Block {
    q: [__m512i; 4],
    sc: __m512i,
    m: __m256i,
    d: f32,
    dmin: f32,
}

/// Q4_K (`HIGH` false) and Q5_K (`HIGH` true, with the fifth bits).
pub(super) struct K4<W, const HIGH: bool> {
    /// qword indices of chunk `k`: [k, k, 4+k, 4+k, 8+k, 8+k, 12+k, 12+k].
    wi: [__m512i; 4],
    /// Activation qword indices `[k, 4+k, 8+k, 12+k]` (in both halves).
    ai: [__m512i; 4],
    nib_shift: __m512i,
    m4: __m512i,
    sixteen: __m512i,
    /// Byte `i` of qword `j`: `1 << j`.
    bits: __m512i,
    /// i16 lane `p` takes scale `p / 4`.
    sc_idx: __m512i,
    pairs: __m512i,
    _w: std::marker::PhantomData<W>,
}

impl<W, const HIGH: bool> K4<W, HIGH> {
    #[inline(always)]
    pub(super) unsafe fn new() -> Self {
        unsafe {
            let k = |k: i64| _mm512_setr_epi64(k, k, 4 + k, 4 + k, 8 + k, 8 + k, 12 + k, 12 + k);
            let a = |k: i64| _mm512_setr_epi64(k, 4 + k, 8 + k, 12 + k, k, 4 + k, 8 + k, 12 + k);
            let mut sc = [0i16; 32];
            for (p, s) in sc.iter_mut().enumerate() {
                *s = (p / 4) as i16;
            }
            K4 {
                wi: [k(0), k(1), k(2), k(3)],
                ai: [a(0), a(1), a(2), a(3)],
                nib_shift: _mm512_setr_epi64(0, 4, 0, 4, 0, 4, 0, 4),
                m4: _mm512_set1_epi8(0x0F),
                sixteen: _mm512_set1_epi8(16),
                bits: _mm512_setr_epi64(
                    0x0101_0101_0101_0101,
                    0x0202_0202_0202_0202,
                    0x0404_0404_0404_0404,
                    0x0808_0808_0808_0808,
                    0x1010_1010_1010_1010,
                    0x2020_2020_2020_2020,
                    0x4040_4040_4040_4040,
                    0x8080_8080_8080_8080u64 as i64,
                ),
                sc_idx: _mm512_loadu_si512(sc.as_ptr() as *const _),
                pairs: _mm512_loadu_si512(IDX_PAIRS.as_ptr() as *const _),
                _w: std::marker::PhantomData,
            }
        }
    }

    /// Nibbles, scales and mins. Sub-block `j` is nibble `j % 2` of bytes
    /// `32 (j / 2) ..`, so qword `j` of chunk `k` is qword `4 (j / 2) + k` of
    /// `qs`, low nibbles for even `j`.
    #[inline(always)]
    unsafe fn common(&self, scales: &[u8; 12], qs: &[u8; 128], d: f32, dmin: f32) -> K4Block {
        unsafe {
            let (sc, mn) = scales_mins_k4(scales);
            let scv = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(sc as i64)));
            let mnv = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(mn as i64)));
            let z0 = _mm512_loadu_si512(qs.as_ptr() as *const _);
            let z1 = _mm512_loadu_si512(qs[64..].as_ptr() as *const _);
            K4Block {
                q: arr!(k in 4 => _mm512_and_si512(
                    _mm512_srlv_epi64(_mm512_permutex2var_epi64(z0, self.wi[k], z1), self.nib_shift),
                    self.m4,
                )),
                sc: _mm512_permutexvar_epi16(self.sc_idx, scv),
                m: _mm512_castsi512_si256(_mm512_permutexvar_epi16(self.pairs, mnv)),
                d,
                dmin,
            }
        }
    }

    /// Activation qword `4j + k` to qword `j` of chunk `k`.
    #[inline(always)]
    unsafe fn prep_k4(&self, a: &BlockQ8K) -> [__m512i; 4] {
        unsafe {
            let z = arr!(c in 4 => _mm512_loadu_si512(a.qs[64 * c..].as_ptr() as *const _));
            arr!(k in 4 => _mm512_mask_blend_epi64(
                0xF0,
                _mm512_permutex2var_epi64(z[0], self.ai[k], z[1]),
                _mm512_permutex2var_epi64(z[2], self.ai[k], z[3]),
            ))
        }
    }

    /// Σ over the four chunks in i16 (each lane at most 4·2·31·128 = 31744 in
    /// magnitude), then one multiply by the scales.
    #[inline(always)]
    unsafe fn dot_k4(&self, u: &K4Block, p: &[__m512i; 4]) -> __m512i {
        unsafe {
            let s01 = _mm512_add_epi16(
                _mm512_maddubs_epi16(u.q[0], p[0]),
                _mm512_maddubs_epi16(u.q[1], p[1]),
            );
            let s23 = _mm512_add_epi16(
                _mm512_maddubs_epi16(u.q[2], p[2]),
                _mm512_maddubs_epi16(u.q[3], p[3]),
            );
            _mm512_madd_epi16(_mm512_add_epi16(s01, s23), u.sc)
        }
    }
}

macro_rules! k4_format {
    ($w:ty, $high:tt) => {
        impl Format for K4<$w, $high> {
            type W = $w;
            type U = K4Block;
            type P = [__m512i; 4];
            const MINS: bool = true;
            const CORR: bool = false;
            #[inline(always)]
            unsafe fn unpack(&self, w: &$w) -> K4Block {
                unsafe {
                    #[allow(unused_mut)]
                    let mut u = self.common(&w.scales, &w.qs, h2f(w.d), h2f(w.dmin));
                    k4_high!($high, self, u, w);
                    u
                }
            }
            #[inline(always)]
            unsafe fn prep(&self, a: &BlockQ8K) -> [__m512i; 4] {
                unsafe { self.prep_k4(a) }
            }
            #[inline(always)]
            unsafe fn dot(&self, u: &K4Block, p: &[__m512i; 4]) -> __m512i {
                unsafe { self.dot_k4(u, p) }
            }
            #[inline(always)]
            unsafe fn fac(&self, u: &K4Block) -> __m256i {
                u.m
            }
            #[inline(always)]
            fn scales(u: &K4Block) -> (f32, f32) {
                (u.d, u.dmin)
            }
        }
    };
}

/// Q5_K's fifth bits: bit `j` of `qh[l]` for element `l` of sub-block `j`, so
/// qword `k` of `qh` spread over chunk `k`, tested against bit `j` in qword `j`.
macro_rules! k4_high {
    (false, $s:ident, $u:ident, $w:ident) => {};
    (true, $s:ident, $u:ident, $w:ident) => {
        for k in 0..4 {
            let h = _mm512_set1_epi64(i64::from_le_bytes(
                $w.qh[8 * k..8 * k + 8].try_into().unwrap(),
            ));
            let hit = _mm512_test_epi8_mask(h, $s.bits);
            $u.q[k] = _mm512_mask_add_epi8($u.q[k], hit, $u.q[k], $s.sixteen);
        }
    };
}

k4_format!(BlockQ4K, false);
k4_format!(BlockQ5K, true);

// ---------------------------------------------------------------- Q6_K

/// A Q6_K block: quants (below 64) of elements `64c..64c+64` in order, the
/// i16 scale of each `maddubs` pair sum of `q[c]`, the 16 scales as i16.
#[derive(Clone, Copy)]
pub(super) struct Q6Block {
    q: [__m512i; 4],
    sc: [__m512i; 4],
    f: __m256i,
    d: f32,
}

/// Q6_K: `ql[64n..64n+64]` holds elements `128n + (0..64)` in its low nibbles
/// and `128n + (64..128)` in its high ones, `qh[32n..32n+32]` their top 2 bits.
pub(super) struct Q6 {
    m4: __m512i,
    m2: __m512i,
    sh_a: __m512i,
    sh_b: __m512i,
    idx0: __m256i,
}

impl Q6 {
    #[inline(always)]
    pub(super) unsafe fn new() -> Self {
        unsafe {
            Q6 {
                m4: _mm512_set1_epi8(0x0F),
                m2: _mm512_set1_epi8(0x03),
                // Low half: elements l (qh bits 0-1), high half: l + 32 (bits
                // 2-3); then l + 64 (bits 4-5) and l + 96 (bits 6-7).
                sh_a: join(_mm256_setzero_si256(), _mm256_set1_epi16(2)),
                sh_b: join(_mm256_set1_epi16(4), _mm256_set1_epi16(6)),
                // Byte indices [g x8, g+1 x8 | g+2 x8, g+3 x8]: one scale per
                // 16 elements, i.e. per 8 pair sums, for 64 elements.
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
    type U = Q6Block;
    type P = [__m512i; 4];
    const MINS: bool = false;
    const CORR: bool = true;
    #[inline(always)]
    unsafe fn unpack(&self, w: &BlockQ6K) -> Q6Block {
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
            Q6Block {
                q,
                sc: arr!(c in 4 => {
                    let idx = _mm256_add_epi8(self.idx0, _mm256_set1_epi8((4 * c) as i8));
                    _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(scales, idx))
                }),
                f: _mm256_cvtepi8_epi16(s128),
                d: h2f(w.d),
            }
        }
    }
    #[inline(always)]
    unsafe fn prep(&self, a: &BlockQ8K) -> [__m512i; 4] {
        unsafe { arr!(c in 4 => _mm512_loadu_si512(a.qs[64 * c..].as_ptr() as *const _)) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &Q6Block, p: &[__m512i; 4]) -> __m512i {
        unsafe {
            let mut v = _mm512_madd_epi16(_mm512_maddubs_epi16(u.q[0], p[0]), u.sc[0]);
            for c in 1..4 {
                v = _mm512_add_epi32(
                    v,
                    _mm512_madd_epi16(_mm512_maddubs_epi16(u.q[c], p[c]), u.sc[c]),
                );
            }
            v
        }
    }
    #[inline(always)]
    unsafe fn fac(&self, u: &Q6Block) -> __m256i {
        u.f
    }
    #[inline(always)]
    fn scales(u: &Q6Block) -> (f32, f32) {
        (u.d, 0.0)
    }
}

// ---------------------------------------------------------------- IQ4_XS

/// An IQ4_XS block: its 256 table values times their sub-block's scale, as
/// i16 (|value · scale| ≤ 127 · 32), 32 elements a register.
#[derive(Clone, Copy)]
pub(super) struct Iq4Block {
    v: [__m512i; 8],
    d: f32,
}

pub(super) struct Iq4 {
    table: __m256i,
    m4: __m128i,
}

impl Iq4 {
    #[inline(always)]
    pub(super) unsafe fn new() -> Self {
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
    type P = [__m512i; 8];
    const MINS: bool = false;
    const CORR: bool = false;
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
    unsafe fn prep(&self, a: &BlockQ8K) -> [__m512i; 8] {
        unsafe { arr!(ib in 8 => _mm512_cvtepi8_epi16(load256(&a.qs[ib * 32..]))) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &Iq4Block, p: &[__m512i; 8]) -> __m512i {
        unsafe {
            let mut v = _mm512_madd_epi16(u.v[0], p[0]);
            for ib in 1..8 {
                v = _mm512_add_epi32(v, _mm512_madd_epi16(u.v[ib], p[ib]));
            }
            v
        }
    }
    #[inline(always)]
    unsafe fn fac(&self, _u: &Iq4Block) -> __m256i {
        unsafe { _mm256_setzero_si256() }
    }
    #[inline(always)]
    fn scales(u: &Iq4Block) -> (f32, f32) {
        (u.d, 0.0)
    }
}

// ---------------------------------------------------------------- Q2_K, Q3_K

/// A Q2_K or Q3_K block unpacked: chunk `k` holds elements `32k..32k+32` as
/// i16 values already times their 16-element group's scale (Q2_K: the 2-bit
/// value and the low scale nibble; Q3_K: the 2-bit value plus 4 where the
/// high bit is set, and the signed 6-bit scale); `fac` the factors against
/// the bsums (Q2_K: the mins; Q3_K: the scales, for its offset of 4).
#[derive(Clone, Copy)]
pub(super) struct K23Block {
    v: [__m512i; 8],
    fac: __m256i,
    d: f32,
    dmin: f32,
}

/// Chunk `k`'s values (32 bytes) widened and times the scales of its two
/// groups.
#[inline(always)]
unsafe fn scaled_chunk(vals: __m256i, lo: i16, hi: i16) -> __m512i {
    unsafe {
        let sc = _mm512_inserti64x4::<1>(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi));
        _mm512_mullo_epi16(_mm512_cvtepu8_epi16(vals), sc)
    }
}

/// The 256 activations of a Q8_K block as i16, 32 a register.
#[inline(always)]
pub(super) unsafe fn widen_q8k(a: &BlockQ8K) -> [__m512i; 8] {
    unsafe { arr!(k in 8 => _mm512_cvtepi8_epi16(load256(&a.qs[k * 32..]))) }
}

/// `Σ_k madd(v[k], p[k])`: 16 lanes whose total is the block's scaled dot.
#[inline(always)]
pub(super) unsafe fn dot16(v: &[__m512i; 8], p: &[__m512i; 8]) -> __m512i {
    unsafe {
        let mut s = _mm512_madd_epi16(v[0], p[0]);
        for k in 1..8 {
            s = _mm512_add_epi32(s, _mm512_madd_epi16(v[k], p[k]));
        }
        s
    }
}

/// Q2_K: `Σ_g (scales_g & 15)·Σ q·a`, mins `scales_g >> 4` against the bsums.
pub(super) struct Q2;

impl Format for Q2 {
    type W = BlockQ2K;
    type U = K23Block;
    type P = [__m512i; 8];
    const MINS: bool = true;
    const CORR: bool = false;
    #[inline(always)]
    unsafe fn unpack(&self, w: &BlockQ2K) -> K23Block {
        unsafe {
            let q = [load256u(&w.qs[..32]), load256u(&w.qs[32..])];
            let mut mins = [0i16; 16];
            for (m, &s) in mins.iter_mut().zip(&w.scales) {
                *m = (s >> 4) as i16;
            }
            let s = |g: usize| (w.scales[g] & 0x0F) as i16;
            K23Block {
                // Elements 128 n + 32 sh + l: bits 2 sh of byte 32 n + l.
                v: arr!(k in 8 => scaled_chunk(crumbs(q[k / 4], k % 4), s(2 * k), s(2 * k + 1))),
                fac: _mm256_loadu_si256(mins.as_ptr() as *const __m256i),
                d: h2f(w.d),
                dmin: h2f(w.dmin),
            }
        }
    }
    #[inline(always)]
    unsafe fn prep(&self, a: &BlockQ8K) -> [__m512i; 8] {
        unsafe { widen_q8k(a) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &K23Block, p: &[__m512i; 8]) -> __m512i {
        unsafe { dot16(&u.v, p) }
    }
    #[inline(always)]
    unsafe fn fac(&self, u: &K23Block) -> __m256i {
        u.fac
    }
    #[inline(always)]
    fn scales(u: &K23Block) -> (f32, f32) {
        (u.d, u.dmin)
    }
}

/// Chunk `k` of a Q3_K block: the 2-bit values plus 4 where the high bit
/// (bit `k` of `hmask[l]`) is set, times the scales of its two groups.
#[inline(always)]
unsafe fn q3_chunk(q: &[__m256i; 2], hm: __m256i, sc: &[i8; 16], k: usize) -> __m512i {
    unsafe {
        let bit = _mm256_set1_epi8(1 << k);
        let high = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
        let u = _mm256_or_si256(
            crumbs(q[k / 4], k % 4),
            _mm256_and_si256(high, _mm256_set1_epi8(4)),
        );
        scaled_chunk(u, sc[2 * k] as i16, sc[2 * k + 1] as i16)
    }
}

/// Q3_K: `Σ_g sc_g·Σ (q + 4h)·a − 4·Σ_g sc_g·bsum_g` (the value is 4 lower
/// where the high bit is clear).
pub(super) struct Q3;

impl Format for Q3 {
    type W = BlockQ3K;
    type U = K23Block;
    type P = [__m512i; 8];
    const MINS: bool = false;
    const CORR: bool = true;
    const CORR_SHIFT: i32 = 2;
    #[inline(always)]
    unsafe fn unpack(&self, w: &BlockQ3K) -> K23Block {
        let sc = q3k_scales(&w.scales);
        unsafe {
            let q = [load256u(&w.qs[..32]), load256u(&w.qs[32..])];
            let hm = load256u(&w.hmask);
            let mut fac = [0i16; 16];
            for (f, &s) in fac.iter_mut().zip(&sc) {
                *f = s as i16;
            }
            K23Block {
                v: arr!(k in 8 => q3_chunk(&q, hm, &sc, k)),
                fac: _mm256_loadu_si256(fac.as_ptr() as *const __m256i),
                d: h2f(w.d),
                dmin: 0.0,
            }
        }
    }
    #[inline(always)]
    unsafe fn prep(&self, a: &BlockQ8K) -> [__m512i; 8] {
        unsafe { widen_q8k(a) }
    }
    #[inline(always)]
    unsafe fn dot(&self, u: &K23Block, p: &[__m512i; 8]) -> __m512i {
        unsafe { dot16(&u.v, p) }
    }
    #[inline(always)]
    unsafe fn fac(&self, u: &K23Block) -> __m256i {
        u.fac
    }
    #[inline(always)]
    fn scales(u: &K23Block) -> (f32, f32) {
        (u.d, 0.0)
    }
}

/// The tile (prefill) and eight-row (decode) entry points of a [`Format`].
macro_rules! kernels {
    ($w:ty, $tile:ident, $rows8:ident, $name:literal, $make:expr) => {
        #[doc = concat!("A tile of ", $name, " weight rows against up to 8 activation rows")]
        #[doc = "([`tile`]); per pair exactly the scalar reference."]
        #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
        pub(super) unsafe fn $tile(
            w: &[$w],
            nb: usize,
            rows: usize,
            acts: &[&[BlockQ8K]],
            out: &mut [f32],
            row0: usize,
        ) {
            unsafe { tile(&$make, w, nb, rows, acts, out, row0) }
        }

        #[doc = concat!("Eight ", $name, " weight rows against one activation row ([`rows8`]);")]
        #[doc = "per row exactly the scalar reference."]
        #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
        pub(super) unsafe fn $rows8(w: &[&[$w]; 8], a: &[BlockQ8K], out: &mut [f32; 8]) {
            unsafe { rows8(&$make, w, a, out) }
        }
    };
}

kernels!(
    BlockQ4K,
    q4_k_tile,
    q4_k_rows8,
    "Q4_K",
    K4::<BlockQ4K, false>::new()
);
kernels!(
    BlockQ5K,
    q5_k_tile,
    q5_k_rows8,
    "Q5_K",
    K4::<BlockQ5K, true>::new()
);
kernels!(BlockQ6K, q6_k_tile, q6_k_rows8, "Q6_K", Q6::new());
kernels!(BlockIq4Xs, iq4_xs_tile, iq4_xs_rows8, "IQ4_XS", Iq4::new());
kernels!(BlockQ2K, q2_k_tile, q2_k_rows8, "Q2_K", Q2);
kernels!(BlockQ3K, q3_k_tile, q3_k_rows8, "Q3_K", Q3);
