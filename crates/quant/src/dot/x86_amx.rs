//! AMX-INT8 tile kernels for batched prefill: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
//! IQ4_XS, IQ3_S, IQ2_XXS, IQ3_XXS, IQ2_XS and IQ2_S (against Q8_K
//! activations), Q8_0, Q4_0, Q5_0, IQ4_NL and MXFP4 (against Q8_0) and Q4_1
//! and Q5_1 (against Q8_1), 16 weight rows by 16 activation rows per tile
//! multiply.
//!
//! The tile multiplies (`tdpbusd`, `tdpbssd`) produce the integer block sums
//! of ggml's dot products, and integer sums are exact in any order, so only
//! the float combination decides the bits: it runs the scalar reference's
//! steps in its order with one activation row per vector lane (separate
//! multiply and add, no FMA). Every value therefore has the bits of
//! [`super::scalar`], the AVX-512 kernels and the one-row decode path.
//!
//! * **Q4_K, Q5_K.** A block's sum is `Σ_j sc_j · Σ_{k∈j} q_k a_k` with 6-bit
//!   sub-block scales `sc_j`, and its mins term `Σ_j m_j · Σ_{k∈j} a_k`. The
//!   weights are unpacked once per call into three u8 operands: `q·(sc & 7)`,
//!   `q·(sc >> 3)` (each below 256 for quants up to 31) and `m_j` repeated
//!   over its sub-block, so `sumi = C₀ + 8·C₁` and `summ = C₂` come from
//!   three tile multiplies over the whole block.
//! * **Q2_K.** Quants 0..=3 times 4-bit scales, and the 4-bit mins repeated
//!   over their 16 elements: `sumi = C₀`, `summ = C₁` (`tdpbusd`).
//! * **Q3_K.** Values in -4..=3 and signed 6-bit scales over 16 elements:
//!   the operands `v·(sc & 7)` and `v·(sc >> 3)` are signed bytes, so
//!   `sumi = C₀ + 8·C₁` from two `tdpbssd` a step (no mins).
//! * **Q6_K.** Values `q - 32` in -32..=31 and signed 8-bit scales over 16
//!   elements: the scale's four 2-bit digits (the top one signed) give four
//!   signed byte operands, `sumi = C₀ + 4 C₁ + 16 C₂ + 64 C₃`. Unpacking four
//!   operands costs more than the tiles save below about 32 activation rows,
//!   so Q6_K takes them from 40 (`amx_min_rows`).
//! * **IQ4_XS, IQ3_S, IQ2_XXS, IQ3_XXS, IQ2_XS, IQ2_S** ([`sub::SubScaled`], in
//!   [`sub`]). Their values (the non-linear table's, or signed grid bytes)
//!   times a sub-block scale do not fit a byte, so the values are unpacked
//!   as they are, each sub-block's sum (32 elements, or 16 for IQ2_XS and
//!   IQ2_S) comes from its own tile multiply (K = its width), and the scales
//!   multiply the stored sums.
//! * **Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4, Q4_1, Q5_1** ([`Block32`]). Q8_0's
//!   weight tiles are read straight from the file (a row's 32 quants at the
//!   row stride); the nibble formats' are unpacked through their 16-entry
//!   tables (`pshufb`), Q5_0's and Q5_1's with their fifth bits, once per
//!   call. Each 32-element block's sum is stored, scaled (Q4_1 and Q5_1 add
//!   their offset times the Q8_1 block's `s`) and folded into lane `b % 8` as
//!   [`super::scalar::lanes8`] does.
//!
//! The activations are rearranged once per call into the tile layout (four
//! consecutive quants of 16 rows interleaved by dword), so a call should
//! cover many weight rows: the kernels loop over tiles of 16 weight rows
//! themselves.

use crate::blocks::*;
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

mod sub;
pub(super) use sub::sub_tiles;

/// Whether the CPU has AMX-TILE and AMX-INT8, the OS saves the tile state,
/// and this process was granted the tile data state (Linux asks for it with
/// `arch_prctl(ARCH_REQ_XCOMP_PERM)`; the grant covers every thread).
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(target_os = "linux")]
fn detect() -> bool {
    // CPUID leaf 7 only after checking the highest leaf.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let leaf7 = __cpuid_count(7, 0);
    let (tile, int8) = (leaf7.edx >> 24 & 1 == 1, leaf7.edx >> 25 & 1 == 1);
    let osxsave = __cpuid(1).ecx >> 27 & 1 == 1;
    if !(tile && int8 && osxsave) {
        return false;
    }
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS manages tile state.
    let xcr0: u64 = {
        let (lo, hi): (u32, u32);
        // SAFETY: XGETBV with ECX = 0 is valid when OSXSAVE is set (checked).
        unsafe {
            asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack))
        };
        (hi as u64) << 32 | lo as u64
    };
    if xcr0 >> 17 & 3 != 3 {
        return false;
    }
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) only grows this
    // process's permitted xsave state; it reads and writes no user memory.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        )
    };
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn detect() -> bool {
    false
}

/// A tile configuration (palette 1): rows and bytes per row of tmm0..tmm7.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    fn new(shapes: [(u8, u16); 8]) -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (t, (rows, colsb)) in shapes.into_iter().enumerate() {
            c.rows[t] = rows;
            c.colsb[t] = colsb;
        }
        c
    }

    /// Load this configuration on the current thread (zeroes every tile).
    ///
    /// # Safety
    /// [`available`] must be true.
    #[inline(always)]
    unsafe fn load(&self) {
        unsafe { asm!("ldtilecfg [{}]", in(reg) self, options(nostack, readonly)) };
    }
}

/// Release the tile state (the thread's next tile use loads a configuration).
///
/// # Safety
/// [`available`] must be true.
#[inline(always)]
unsafe fn release() {
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Per-thread scratch: 64-byte aligned, grown on demand, reused by every call.
struct Scratch {
    acts: Vec<__m512i>,
    weights: Vec<__m512i>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new(Scratch { acts: Vec::new(), weights: Vec::new() })
    };
}

/// This thread's two scratch buffers, grown to at least `acts` and `weights`
/// bytes (64-byte aligned). The memory stays valid until the next call on
/// this thread; the kernels do not nest.
fn scratch(acts: usize, weights: usize) -> (*mut u8, *mut u8) {
    fn room(v: &mut Vec<__m512i>, bytes: usize) -> *mut u8 {
        let zmm = bytes.div_ceil(64);
        if v.len() < zmm {
            // SAFETY: an all-zero vector is a valid __m512i.
            v.resize(zmm, unsafe { std::mem::zeroed() });
        }
        v.as_mut_ptr().cast()
    }
    SCRATCH.with(|s| {
        let s = &mut *s.borrow_mut();
        (room(&mut s.acts, acts), room(&mut s.weights, weights))
    })
}

/// f16 to f32 by F16C (the bits of [`f16_to_f32`]).
#[inline(always)]
unsafe fn h2f(h: half::f16) -> f32 {
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32))) }
}

/// Store the 16 × 16 results of one (weight tile, activation group) pair:
/// `acc[r]` lane `n` is weight row `j0 + r` · activation row `n0 + n`.
#[inline(always)]
unsafe fn store_results(
    acc: &[__m512; 16],
    out: &mut [f32],
    rows: usize,
    j0: usize,
    nj: usize,
    n0: usize,
    nn: usize,
) {
    let mut t = [[0f32; 16]; 16];
    for r in 0..16 {
        unsafe { _mm512_storeu_ps(t[r].as_mut_ptr(), acc[r]) };
    }
    for n in 0..nn {
        let o = &mut out[(n0 + n) * rows + j0..(n0 + n) * rows + j0 + nj];
        for (r, o) in o.iter_mut().enumerate() {
            *o = t[r][n];
        }
    }
}

/// A 256-element format whose quants (at most 31) and 6-bit scales and mins
/// follow Q4_K's layout.
pub(super) trait KQuant: bytemuck::Pod {
    /// The 64 quants of elements `64 s .. 64 s + 64`, one per byte.
    unsafe fn quants(&self, s: usize) -> __m512i;
    fn scales(&self) -> &[u8; 12];
    fn d(&self) -> half::f16;
    fn dmin(&self) -> half::f16;
}

/// Low and high nibbles of 32 packed bytes: elements `0..32` then `32..64`.
#[inline(always)]
unsafe fn nibbles(qs: &[u8]) -> __m512i {
    unsafe {
        let x = _mm256_loadu_si256(qs.as_ptr().cast());
        let m = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(x, m);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

impl KQuant for BlockQ4K {
    #[inline(always)]
    unsafe fn quants(&self, s: usize) -> __m512i {
        unsafe { nibbles(&self.qs[32 * s..32 * s + 32]) }
    }
    fn scales(&self) -> &[u8; 12] {
        &self.scales
    }
    fn d(&self) -> half::f16 {
        self.d
    }
    fn dmin(&self) -> half::f16 {
        self.dmin
    }
}

impl KQuant for BlockQ5K {
    #[inline(always)]
    unsafe fn quants(&self, s: usize) -> __m512i {
        unsafe {
            let q = nibbles(&self.qs[32 * s..32 * s + 32]);
            // Fifth bits: bit 2s of qh[l] for element l, bit 2s + 1 for 32 + l.
            let h = _mm256_loadu_si256(self.qh.as_ptr().cast());
            let one = _mm256_set1_epi8(1);
            let lo = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * s as i32)), one);
            let hi = _mm256_and_si256(
                _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * s as i32 + 1)),
                one,
            );
            let h = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            _mm512_or_si512(q, _mm512_slli_epi16::<4>(h))
        }
    }
    fn scales(&self) -> &[u8; 12] {
        &self.scales
    }
    fn d(&self) -> half::f16 {
        self.d
    }
    fn dmin(&self) -> half::f16 {
        self.dmin
    }
}

/// Q8_K activation rows rearranged for the tiles: for group `g` of 16 rows and
/// block `b`, four 16 × 64-byte tiles (step `s` covers elements `64 s .. + 64`;
/// its row `kk` holds elements `64 s + 4 kk .. + 4` of the 16 rows, a dword
/// each), then the 16 rows' scales, then four vectors whose lane `n` holds
/// row `n`'s sub-block sums `2i`, `2i + 1` (from its `bsums`) as two i16.
/// Rows past the end are zero (scale 0). Each (group, block) takes
/// [`Q8K_PREP`] bytes.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn prep_q8k(acts: &[&[BlockQ8K]], nb: usize, base: *mut u8) {
    for g in 0..acts.len().div_ceil(16) {
        for b in 0..nb {
            let at = unsafe { base.add((g * nb + b) * Q8K_PREP) };
            let tiles = at.cast::<u32>();
            let das = unsafe { at.add(4096).cast::<f32>() };
            let bp = unsafe { at.add(4096 + 64).cast::<[i16; 2]>() };
            for n in 0..16 {
                let Some(a) = acts.get(g * 16 + n) else {
                    for i in 0..64 {
                        unsafe { tiles.add(i * 16 + n).write(0) };
                    }
                    unsafe { das.add(n).write(0.0) };
                    for i in 0..4 {
                        unsafe { bp.add(i * 16 + n).write([0, 0]) };
                    }
                    continue;
                };
                let blk = &a[b];
                let q: &[u8; 256] = bytemuck::cast_ref(&blk.qs);
                for (i, w) in q.chunks_exact(4).enumerate() {
                    let w = u32::from_le_bytes(w.try_into().expect("4 bytes"));
                    unsafe { tiles.add(i * 16 + n).write(w) };
                }
                unsafe { das.add(n).write(blk.d) };
                let s = &blk.bsums;
                for i in 0..4 {
                    // |bsum| <= 16 * 128, so a pair's sum fits in i16.
                    let pair = [s[4 * i] + s[4 * i + 1], s[4 * i + 2] + s[4 * i + 3]];
                    unsafe { bp.add(i * 16 + n).write(pair) };
                }
            }
        }
    }
}

/// Bytes per (group, block) of [`prep_q8k`]'s output.
const Q8K_PREP: usize = 4096 + 64 + 256;

/// Bytes per block of [`prep_kquant`]'s output for a tile of 16 weight rows:
/// eight operand tiles, then per row `d`, `dmin` and the mins as 8 words.
const KQ_PREP: usize = 8 * 1024 + 16 * (4 + 4 + 16);

/// Shuffle controls for [`prep_kquant`]: for step `s`, 128-bit lanes 0 and 1
/// pick byte `2 s` of a broadcast qword into the low byte of every word, lanes
/// 2 and 3 byte `2 s + 1` (high bytes zero).
#[inline(always)]
unsafe fn word_pick(s: usize) -> __m512i {
    let (a, b) = (
        ((0x80 << 8) | (2 * s)) as i16,
        ((0x80 << 8) | (2 * s + 1)) as i16,
    );
    unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(a)),
            _mm256_set1_epi16(b),
        )
    }
}

/// One tile of 16 weight rows (`w`: the first of them, `nj` valid; the rest
/// zero) unpacked, per block `b` at `b * KQ_PREP`: the operands `q·(sc & 7)`
/// (tile `2 s`) and `q·(sc >> 3)` (tile `2 s + 1`) of each step `s`, 1 KiB
/// each, then the rows' `d`, their `dmin`, and their mins as words.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn prep_kquant<W: KQuant>(w: &[W], nb: usize, nj: usize, base: *mut u8) {
    let pick = unsafe { [word_pick(0), word_pick(1), word_pick(2), word_pick(3)] };
    let size = std::mem::size_of::<W>();
    // The next tile's rows follow this one's: fetch them as these are read
    // (prefetches never fault, past the end of the weights included).
    let next = w.as_ptr().cast::<u8>().wrapping_add(16 * nb * size);
    unsafe {
        for r in 0..16 {
            for b in 0..nb {
                let at = base.add(b * KQ_PREP);
                let d = at.add(8 * 1024).cast::<f32>();
                let dmin = d.add(16);
                let mins = dmin.add(16).cast::<__m128i>();
                let tile = |t: usize| at.add(t * 1024 + r * 64).cast::<__m512i>();
                if r >= nj {
                    for t in 0..8 {
                        _mm512_store_si512(tile(t), _mm512_setzero_si512());
                    }
                    d.add(r).write(0.0);
                    dmin.add(r).write(0.0);
                    _mm_store_si128(mins.add(r), _mm_setzero_si128());
                    continue;
                }
                let p = next.wrapping_add((r * nb + b) * size);
                for line in (0..size).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line).cast());
                }
                let blk = &w[r * nb + b];
                let (sc, mn) = scales_mins_k4(blk.scales());
                let lo = _mm512_set1_epi64((sc & 0x0707_0707_0707_0707) as i64);
                let hi = _mm512_set1_epi64((sc >> 3 & 0x0707_0707_0707_0707) as i64);
                for (s, pick) in pick.iter().enumerate() {
                    let q = blk.quants(s);
                    // Each byte product is below 256 (q <= 31, factor <= 7),
                    // so one 16-bit multiply forms both bytes of a word.
                    let f_lo = _mm512_shuffle_epi8(lo, *pick);
                    let f_hi = _mm512_shuffle_epi8(hi, *pick);
                    _mm512_store_si512(tile(2 * s), _mm512_mullo_epi16(q, f_lo));
                    _mm512_store_si512(tile(2 * s + 1), _mm512_mullo_epi16(q, f_hi));
                }
                d.add(r).write(h2f(blk.d()));
                dmin.add(r).write(h2f(blk.dmin()));
                _mm_store_si128(mins.add(r), _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64)));
            }
        }
    }
}

/// The loops every Q8_K tile kernel shares: the activations rearranged once
/// ([`prep_q8k`]); per tile of 16 weight rows (`j0`, `nj` of them valid)
/// the operands unpacked by `prep(j0, nj, base)`, `prep_bytes` a block;
/// per group of 16 activation rows, `block(a, w, cbuf, acc)` for each
/// weight block in order (`a`, `w`: the block's activation tiles and
/// operands; `cbuf`: `cbuf_bytes` of scratch for the tile sums), then the
/// 16 × 16 results stored.
///
/// # Safety
/// As [`kquant_tiles`]; `cfg` is the tile shapes `block` uses.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q8k_tile_loop(
    nb: usize,
    rows: usize,
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
    cfg: &TileConfig,
    (prep_bytes, cbuf_bytes): (usize, usize),
    mut prep: impl FnMut(usize, usize, *mut u8),
    mut block: impl FnMut(*const u8, *const u8, *mut u8, &mut [__m512; 16]),
) {
    let m = acts.len();
    let (abase, wbase) = scratch(m.div_ceil(16) * nb * Q8K_PREP, nb * prep_bytes + cbuf_bytes);
    unsafe {
        prep_q8k(acts, nb, abase);
        let cbuf = wbase.add(nb * prep_bytes);
        cfg.load();
        for j0 in (0..rows).step_by(16) {
            let nj = (rows - j0).min(16);
            prep(j0, nj, wbase);
            for g in 0..m.div_ceil(16) {
                let mut acc = [_mm512_setzero_ps(); 16];
                for b in 0..nb {
                    let ap = abase.add((g * nb + b) * Q8K_PREP);
                    block(ap, wbase.add(b * prep_bytes), cbuf, &mut acc);
                }
                store_results(&acc, out, rows, j0, nj, g * 16, (m - g * 16).min(16));
            }
        }
        release();
    }
}

/// Every weight row of `w` (`rows` rows of `nb` blocks) against every
/// activation row of `acts`: `out[r * rows + j]` = row `j` · `acts[r]`.
///
/// # Safety
/// AVX-512 F/BW and [`available`] must hold; `w` holds `rows * nb` blocks and
/// every activation row `nb`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub(super) unsafe fn kquant_tiles<W: KQuant>(
    w: &[W],
    nb: usize,
    rows: usize,
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // tmm0, tmm1: the two sums; tmm3: activations; tmm4, tmm5: weights.
    let cfg = TileConfig::new([(16, 64); 8]);
    unsafe {
        q8k_tile_loop(
            nb,
            rows,
            acts,
            out,
            &cfg,
            (KQ_PREP, 2 * 1024),
            |j0, nj, base| prep_kquant(&w[j0 * nb..(j0 + nj) * nb], nb, nj, base),
            |ap, wp, cbuf, acc| {
                asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
                for s in 0..4 {
                    asm!(
                        "tileloadd tmm3, [{a} + {st}]",
                        "tileloadd tmm4, [{w0} + {st}]",
                        "tileloadd tmm5, [{w1} + {st}]",
                        "tdpbusd tmm0, tmm4, tmm3",
                        "tdpbusd tmm1, tmm5, tmm3",
                        a = in(reg) ap.add(s * 1024),
                        w0 = in(reg) wp.add(2 * s * 1024),
                        w1 = in(reg) wp.add((2 * s + 1) * 1024),
                        st = in(reg) 64usize,
                        options(nostack, readonly),
                    );
                }
                asm!(
                    "tilestored [{c0} + {st}], tmm0",
                    "tilestored [{c1} + {st}], tmm1",
                    c0 = in(reg) cbuf,
                    c1 = in(reg) cbuf.add(1024),
                    st = in(reg) 64usize,
                    options(nostack),
                );
                let da = _mm512_load_ps(ap.add(4096).cast());
                let bp = ap.add(4096 + 64).cast::<__m512i>();
                let bp = [
                    bp.read(),
                    bp.add(1).read(),
                    bp.add(2).read(),
                    bp.add(3).read(),
                ];
                let d = wp.add(8 * 1024).cast::<f32>();
                let dmin = d.add(16);
                let mins = dmin.add(16).cast::<i32>();
                let c = cbuf.cast::<__m512i>();
                for r in 0..16 {
                    let lo = _mm512_load_si512(c.add(r));
                    let hi = _mm512_load_si512(c.add(16 + r));
                    let sumi = _mm512_add_epi32(lo, _mm512_slli_epi32::<3>(hi));
                    // Σ_j m_j · (sub-block j's activation sum), two j a madd.
                    let t = arr!(i in 4 => _mm512_madd_epi16(bp[i], _mm512_set1_epi32(*mins.add(r * 4 + i))));
                    let summ = _mm512_add_epi32(
                        _mm512_add_epi32(t[0], t[1]),
                        _mm512_add_epi32(t[2], t[3]),
                    );
                    let dd = _mm512_mul_ps(_mm512_set1_ps(*d.add(r)), da);
                    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi)));
                    let dm = _mm512_mul_ps(_mm512_set1_ps(*dmin.add(r)), da);
                    acc[r] = _mm512_sub_ps(acc[r], _mm512_mul_ps(dm, _mm512_cvtepi32_ps(summ)));
                }
            },
        );
    }
}

/// The activation blocks of the 32-element formats: Q8_0, and Q8_1 with
/// its `s = d · Σ q` for the weight formats with an offset (Q4_1, Q5_1).
pub(super) trait Act32: bytemuck::Pod {
    fn qs(&self) -> &[i8; 32];
    fn d(&self) -> half::f16;
    /// `d · Σ q` (Q8_1); Q8_0 has none and gives 0.
    fn s(&self) -> half::f16;
}

impl Act32 for BlockQ8_0 {
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
    fn d(&self) -> half::f16 {
        self.d
    }
    fn s(&self) -> half::f16 {
        half::f16::ZERO
    }
}

impl Act32 for BlockQ8_1 {
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
    fn d(&self) -> half::f16 {
        self.d
    }
    fn s(&self) -> half::f16 {
        self.s
    }
}

/// Activation rows of 32-element blocks rearranged for the tiles: for group
/// `g` of 16 rows and block `b`, an 8 × 64-byte tile whose row `kk` holds
/// quants `4 kk .. + 4` of the 16 rows, one dword each; then the rows'
/// scales, then their `s`. Rows past the end are zero.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn prep_act32<A: Act32>(
    acts: &[&[A]],
    nb: usize,
    base: *mut u8,
) -> (*const u8, *const f32, *const f32) {
    let groups = acts.len().div_ceil(16);
    let tiles = base.cast::<u32>();
    let das = unsafe { base.add(groups * nb * 512).cast::<f32>() };
    let ss = unsafe { das.add(groups * nb * 16) };
    for g in 0..groups {
        for n in 0..16 {
            let a = acts.get(g * 16 + n);
            for b in 0..nb {
                let t = unsafe { tiles.add((g * nb + b) * 128 + n) };
                let (q, da, sa) = match a {
                    Some(a) => (
                        bytemuck::cast::<[i8; 32], [u8; 32]>(*a[b].qs()),
                        unsafe { h2f(a[b].d()) },
                        unsafe { h2f(a[b].s()) },
                    ),
                    None => ([0u8; 32], 0.0, 0.0),
                };
                for (i, w) in q.chunks_exact(4).enumerate() {
                    let w = u32::from_le_bytes(w.try_into().expect("4 bytes"));
                    unsafe { t.add(i * 16).write(w) };
                }
                unsafe {
                    das.add((g * nb + b) * 16 + n).write(da);
                    ss.add((g * nb + b) * 16 + n).write(sa);
                }
            }
        }
    }
    (tiles.cast(), das, ss)
}

/// A 32-element format against Q8_0 (or Q8_1) activations: a block's sum
/// is one tile multiply of its 32 signed values, times `dw · da` (plus
/// `m · s` for the formats with an offset), folded into lane `b % 8`
/// ([`super::scalar::lanes8`]).
pub(super) trait Block32: bytemuck::Pod {
    /// The activation blocks it pairs with.
    type Act: Act32;
    /// Whether a block has an offset `m` (its term `(dw · da) · sumi + m · s`).
    const MIN: bool = false;

    /// Scratch bytes [`Block32::operands`] needs for `nb` blocks a row.
    fn scratch(nb: usize) -> usize;

    /// Row `r`'s offset of block `b` to `mw[b * 16 + r]` for the 16 weight
    /// rows of `w` (`nj` valid, the rest 0); only called where [`Block32::MIN`].
    ///
    /// # Safety
    /// `mw` holds `16 * nb` floats.
    unsafe fn mins(_w: &[Self], _nb: usize, _nj: usize, _mw: *mut f32) {}

    /// The operands of 16 weight rows (`w`: `nj` rows of `nb` blocks, the
    /// rest zero): returns `(base, step, stride)`, block `b`'s 16 × 32-byte
    /// tile at `base + b * step` with rows `stride` bytes apart, and writes
    /// row `r`'s scale of block `b` to `dw[b * 16 + r]`.
    ///
    /// # Safety
    /// `scratch` holds [`Block32::scratch`] bytes and `dw` `16 * nb` floats.
    unsafe fn operands(
        w: &[Self],
        nb: usize,
        nj: usize,
        scratch: *mut u8,
        dw: *mut f32,
    ) -> (*const u8, usize, usize);
}

impl Block32 for BlockQ8_0 {
    type Act = BlockQ8_0;

    fn scratch(nb: usize) -> usize {
        16 * nb * 34
    }

    /// The quants straight from the file (a partial tile copied, padded).
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn operands(
        w: &[Self],
        nb: usize,
        nj: usize,
        pad: *mut u8,
        dw: *mut f32,
    ) -> (*const u8, usize, usize) {
        let row_bytes = nb * 34;
        let mut tile = bytemuck::cast_slice::<_, u8>(w).as_ptr();
        unsafe {
            if nj < 16 {
                std::ptr::copy_nonoverlapping(tile, pad, nj * row_bytes);
                std::ptr::write_bytes(pad.add(nj * row_bytes), 0, (16 - nj) * row_bytes);
                tile = pad;
            }
            for b in 0..nb {
                for r in 0..16 {
                    let h = tile
                        .add(r * row_bytes + b * 34)
                        .cast::<u16>()
                        .read_unaligned();
                    dw.add(b * 16 + r).write(h2f(half::f16::from_bits(h)));
                }
            }
            (tile.add(2), 34, row_bytes)
        }
    }
}

/// The 32-element formats whose block unpacks to 32 signed bytes: `$unpack`
/// writes block `$blk`'s bytes at `$row` and evaluates to its scale; the
/// operands are 16 × 32-byte tiles, rows past the tile's `nj` zero.
macro_rules! bytes_block32 {
    ($ty:ty, $act:ty, {$($min:item)*}, |$blk:ident, $row:ident| $unpack:block) => {
        impl Block32 for $ty {
            type Act = $act;
            $($min)*

            fn scratch(nb: usize) -> usize {
                nb * 512
            }

            #[target_feature(enable = "avx512f,avx512bw,f16c")]
            unsafe fn operands(
                w: &[Self],
                nb: usize,
                nj: usize,
                base: *mut u8,
                dw: *mut f32,
            ) -> (*const u8, usize, usize) {
                unsafe {
                    for b in 0..nb {
                        for r in 0..16 {
                            let $row = base.add(b * 512 + r * 32);
                            let Some($blk) = (r < nj).then(|| &w[r * nb + b]) else {
                                std::ptr::write_bytes($row, 0, 32);
                                dw.add(b * 16 + r).write(0.0);
                                continue;
                            };
                            let scale: f32 = $unpack;
                            dw.add(b * 16 + r).write(scale);
                        }
                    }
                }
                (base, 512, 32)
            }
        }
    };
}

/// The 32-element formats of 16 nibbles, each a 16-entry table's index:
/// unpacked by `pshufb` into 16 × 32-byte tiles.
macro_rules! nibble_block32 {
    ($ty:ty, $table:expr, |$blk:ident| $scale:expr) => {
        nibble_block32!($ty, BlockQ8_0, $table, |$blk| $scale, {});
    };
    ($ty:ty, $act:ty, $table:expr, |$blk:ident| $scale:expr, {$($min:item)*}) => {
        bytes_block32!($ty, $act, {$($min)*}, |$blk, row| {
            let table: [i8; 16] = $table;
            let table = _mm_loadu_si128(table.as_ptr().cast());
            let mask = _mm_set1_epi8(0x0F);
            // Byte j: element j (low nibble), j + 16 (high).
            let q = _mm_loadu_si128($blk.qs.as_ptr().cast());
            let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, mask));
            let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(q), mask));
            _mm_storeu_si128(row.cast(), lo);
            _mm_storeu_si128(row.add(16).cast(), hi);
            $scale
        });
    };
}

nibble_block32!(
    BlockQ4_0,
    [-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7],
    |blk| h2f(blk.d)
);
nibble_block32!(BlockIq4Nl, KVALUES_IQ4NL, |blk| h2f(blk.d));
nibble_block32!(BlockMxfp4, KVALUES_MXFP4, |blk| e8m0_to_f32_half(blk.e));

/// The offsets `m` of the formats that have one, per [`Block32::mins`].
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn block_mins<W>(w: &[W], nb: usize, nj: usize, mw: *mut f32, m: impl Fn(&W) -> half::f16) {
    for b in 0..nb {
        for r in 0..16 {
            let v = if r < nj {
                unsafe { h2f(m(&w[r * nb + b])) }
            } else {
                0.0
            };
            unsafe { mw.add(b * 16 + r).write(v) };
        }
    }
}

// Q4_1: the nibbles as they are (0..=15), against Q8_1.
nibble_block32!(
    BlockQ4_1,
    BlockQ8_1,
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    |blk| h2f(blk.d),
    {
        const MIN: bool = true;

        #[target_feature(enable = "avx512f,avx512bw,f16c")]
        unsafe fn mins(w: &[Self], nb: usize, nj: usize, mw: *mut f32) {
            unsafe { block_mins(w, nb, nj, mw, |b: &Self| b.m) }
        }
    }
);

/// Q5_0 and Q5_1: each element's nibble and its fifth bit from `qh` (bit
/// `i` for element `i`), less `$off` (Q5_0's 16; Q5_1 keeps 0..=31 and has
/// an offset `m` against Q8_1), as a signed byte.
macro_rules! five_bit_block32 {
    ($ty:ty, $act:ty, $off:literal, {$($min:item)*}) => {
        bytes_block32!($ty, $act, {$($min)*}, |blk, row| {
            let (mask, off) = (_mm_set1_epi8(0x0F), _mm_set1_epi8($off));
            // Byte i: 0x10 where element i's fifth bit is set.
            let h = _mm256_and_si256(
                super::x86::sign_masks(u32::from_le_bytes(blk.qh)),
                _mm256_set1_epi8(0x10),
            );
            let q = _mm_loadu_si128(blk.qs.as_ptr().cast());
            let lo = _mm_or_si128(_mm_and_si128(q, mask), _mm256_castsi256_si128(h));
            let hi = _mm_or_si128(
                _mm_and_si128(_mm_srli_epi16::<4>(q), mask),
                _mm256_extracti128_si256::<1>(h),
            );
            _mm_storeu_si128(row.cast(), _mm_sub_epi8(lo, off));
            _mm_storeu_si128(row.add(16).cast(), _mm_sub_epi8(hi, off));
            h2f(blk.d)
        });
    };
}

five_bit_block32!(BlockQ5_0, BlockQ8_0, 16, {});
five_bit_block32!(BlockQ5_1, BlockQ8_1, 0, {
    const MIN: bool = true;

    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn mins(w: &[Self], nb: usize, nj: usize, mw: *mut f32) {
        unsafe { block_mins(w, nb, nj, mw, |b: &Self| b.m) }
    }
});

/// [`kquant_tiles`] for 32-element weights ([`Block32`]: Q8_0, Q4_0,
/// Q5_0, IQ4_NL, MXFP4 against Q8_0 activations; Q4_1, Q5_1 against Q8_1).
///
/// # Safety
/// As [`kquant_tiles`].
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub(super) unsafe fn block32_tiles<W: Block32>(
    w: &[W],
    nb: usize,
    rows: usize,
    acts: &[&[W::Act]],
    out: &mut [f32],
) {
    let m = acts.len();
    // tmm0..3: sums of four blocks; tmm4: weights (16 rows × 32 quants);
    // tmm6: activations (8 × 16 dwords).
    let cfg = TileConfig::new([
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 32),
        (16, 32),
        (8, 64),
        (8, 64),
    ]);
    // Activations; eight lanes of 16 × 16 partial sums, four blocks' sums,
    // the scales of one tile, and the weights' operands.
    let (abase, wbase) = scratch(
        m.div_ceil(16) * nb * (512 + 128),
        8 * 1024 + 4 * 1024 + nb * 128 + W::scratch(nb),
    );
    {
        unsafe {
            let (atiles, das, ss) = prep_act32(acts, nb, abase);
            let lanes = wbase.cast::<__m512>();
            let cbuf = wbase.add(8 * 1024);
            let dw = cbuf.add(4 * 1024).cast::<f32>();
            let mw = dw.add(nb * 16);
            let ops = mw.add(nb * 16).cast::<u8>();
            cfg.load();
            for j0 in (0..rows).step_by(16) {
                let nj = (rows - j0).min(16);
                let wj = &w[j0 * nb..(j0 + nj) * nb];
                let (tile, step, ws) = W::operands(wj, nb, nj, ops, dw);
                if W::MIN {
                    W::mins(wj, nb, nj, mw);
                }
                for g in 0..m.div_ceil(16) {
                    for l in 0..8 * 16 {
                        lanes.add(l).write(_mm512_setzero_ps());
                    }
                    for b0 in (0..nb).step_by(4) {
                        let nk = (nb - b0).min(4);
                        macro_rules! block {
                            ($i:literal, $tmm:literal) => {
                                if $i < nk {
                                    let b = b0 + $i;
                                    asm!(
                                        concat!("tilezero tmm", $tmm),
                                        "tileloadd tmm4, [{w} + {ws}]",
                                        "tileloadd tmm6, [{a} + {st}]",
                                        concat!("tdpbssd tmm", $tmm, ", tmm4, tmm6"),
                                        concat!("tilestored [{c} + {st}], tmm", $tmm),
                                        w = in(reg) tile.add(b * step),
                                        ws = in(reg) ws,
                                        a = in(reg) atiles.add((g * nb + b) * 512),
                                        c = in(reg) cbuf.add($i * 1024),
                                        st = in(reg) 64usize,
                                        options(nostack),
                                    );
                                }
                            };
                        }
                        block!(0, "0");
                        block!(1, "1");
                        block!(2, "2");
                        block!(3, "3");
                        for i in 0..nk {
                            let b = b0 + i;
                            let da = _mm512_loadu_ps(das.add((g * nb + b) * 16));
                            let sa = _mm512_loadu_ps(ss.add((g * nb + b) * 16));
                            let c = cbuf.add(i * 1024).cast::<__m512i>();
                            let lane = lanes.add((b % 8) * 16);
                            for r in 0..16 {
                                let dd = _mm512_mul_ps(_mm512_set1_ps(*dw.add(b * 16 + r)), da);
                                let mut t = _mm512_mul_ps(
                                    dd,
                                    _mm512_cvtepi32_ps(_mm512_load_si512(c.add(r))),
                                );
                                if W::MIN {
                                    // + m · s, after the product (the scalar term).
                                    let ms = _mm512_mul_ps(_mm512_set1_ps(*mw.add(b * 16 + r)), sa);
                                    t = _mm512_add_ps(t, ms);
                                }
                                lane.add(r).write(_mm512_add_ps(lane.add(r).read(), t));
                            }
                        }
                    }
                    // reduce8 per lane: (l0+l4, l1+l5, l2+l6, l3+l7), pairs, total.
                    let mut acc = [_mm512_setzero_ps(); 16];
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let l = |k: usize| lanes.add(k * 16 + r).read();
                        let t = [
                            _mm512_add_ps(l(0), l(4)),
                            _mm512_add_ps(l(1), l(5)),
                            _mm512_add_ps(l(2), l(6)),
                            _mm512_add_ps(l(3), l(7)),
                        ];
                        let u = [_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3])];
                        *acc = _mm512_add_ps(u[0], u[1]);
                    }
                    store_results(&acc, out, rows, j0, nj, g * 16, (m - g * 16).min(16));
                }
            }
            release();
        }
    }
}

/// Bytes per block of [`prep_q3k`]'s output for a tile of 16 weight rows:
/// eight operand tiles, then the rows' `d`.
const Q3K_PREP: usize = 8 * 1024 + 16 * 4;

/// One tile of 16 weight rows (`w`: the first of them, `nj` valid; the rest
/// zero) unpacked, per block `b` at `b * Q3K_PREP`: the i8 operands
/// `v·(sc & 7)` (tile `2 s`) and `v·(sc >> 3)` (tile `2 s + 1`) of each step
/// `s` of 64 elements, for the values `v` in -4..=3 and the signed 6-bit
/// scale `sc` of each element's 16, so both products fit a byte and `sc·v =
/// v·(sc & 7) + 8·v·(sc >> 3)`; then the rows' `d`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn prep_q3k(w: &[BlockQ3K], nb: usize, nj: usize, base: *mut u8) {
    unsafe {
        let (three, one, four) = (
            _mm256_set1_epi8(3),
            _mm256_set1_epi8(1),
            _mm256_set1_epi8(4),
        );
        for b in 0..nb {
            let at = base.add(b * Q3K_PREP);
            let d = at.add(8 * 1024).cast::<f32>();
            for r in 0..16 {
                let Some(blk) = (r < nj).then(|| &w[r * nb + b]) else {
                    for t in 0..8 {
                        std::ptr::write_bytes(at.add(t * 1024 + r * 64), 0, 64);
                    }
                    d.add(r).write(0.0);
                    continue;
                };
                let sc = q3k_scales(&blk.scales);
                let hm = _mm256_loadu_si256(blk.hmask.as_ptr().cast());
                // Elements 32 j .. + 32: bits 2 (j % 4) of the low-bit bytes
                // 32 (j / 4) .. + 32, bit j of the high-bit bytes.
                for j in 0..8 {
                    let q = _mm256_loadu_si256(blk.qs.as_ptr().add((j / 4) * 32).cast());
                    let ql = _mm256_and_si256(
                        _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (j % 4) as i32)),
                        three,
                    );
                    let h =
                        _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(j as i32)), one);
                    let v = _mm256_sub_epi8(_mm256_add_epi8(ql, _mm256_slli_epi16::<2>(h)), four);
                    let v = _mm512_cvtepi8_epi16(v);
                    let (s0, s1) = (sc[2 * j] as i16, sc[2 * j + 1] as i16);
                    let lo = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_set1_epi16(s0 & 7)),
                        _mm256_set1_epi16(s1 & 7),
                    );
                    let hi = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_set1_epi16(s0 >> 3)),
                        _mm256_set1_epi16(s1 >> 3),
                    );
                    let (s, off) = (j / 2, (j % 2) * 32);
                    let t0 = at.add(2 * s * 1024 + r * 64 + off);
                    let t1 = at.add((2 * s + 1) * 1024 + r * 64 + off);
                    _mm256_storeu_si256(t0.cast(), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(v, lo)));
                    _mm256_storeu_si256(t1.cast(), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(v, hi)));
                }
                d.add(r).write(h2f(blk.d));
            }
        }
    }
}

/// Bytes per block of [`prep_q6k`]'s output for a tile of 16 weight rows:
/// sixteen operand tiles (four a step), then the rows' `d`.
const Q6K_PREP: usize = 16 * 1024 + 16 * 4;

/// One tile of 16 weight rows (`w`: the first of them, `nj` valid; the rest
/// zero) unpacked, per block `b` at `b * Q6K_PREP`: for each step `s` of 64
/// elements the i8 operands `v·t_i` (tile `4 s + i`), for the values `v =
/// q - 32` in -32..=31 and the 2-bit digits `t_0..t_3` of each element's
/// signed 8-bit scale (`sc = t_0 + 4 t_1 + 16 t_2 + 64 t_3`, `t_3` signed),
/// so every product fits a signed byte; then the rows' `d`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn prep_q6k(w: &[BlockQ6K], nb: usize, nj: usize, base: *mut u8) {
    unsafe {
        let (lo4, three, off) = (
            _mm256_set1_epi8(0x0F),
            _mm256_set1_epi8(3),
            _mm256_set1_epi8(32),
        );
        for b in 0..nb {
            let at = base.add(b * Q6K_PREP);
            let d = at.add(16 * 1024).cast::<f32>();
            for r in 0..16 {
                let Some(blk) = (r < nj).then(|| &w[r * nb + b]) else {
                    for t in 0..16 {
                        std::ptr::write_bytes(at.add(t * 1024 + r * 64), 0, 64);
                    }
                    d.add(r).write(0.0);
                    continue;
                };
                // Elements 32 j .. + 32 (n = j / 4, k = j % 4): low nibbles
                // (k < 2) or high nibbles of ql[64 n + 32 (k % 2) ..], bits
                // 2 k, 2 k + 1 of qh[32 n ..].
                for j in 0..8 {
                    let (n, k) = (j / 4, j % 4);
                    let ql = _mm256_loadu_si256(blk.ql.as_ptr().add(64 * n + 32 * (k % 2)).cast());
                    let ql = _mm256_and_si256(
                        _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (k / 2) as i32)),
                        lo4,
                    );
                    let qh = _mm256_loadu_si256(blk.qh.as_ptr().add(32 * n).cast());
                    let qh = _mm256_and_si256(
                        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)),
                        three,
                    );
                    let q = _mm256_or_si256(ql, _mm256_slli_epi16::<4>(qh));
                    let v = _mm512_cvtepi8_epi16(_mm256_sub_epi8(q, off));
                    let (s0, s1) = (blk.scales[2 * j] as i16, blk.scales[2 * j + 1] as i16);
                    let (s, half) = (j / 2, (j % 2) * 32);
                    for i in 0..4 {
                        // Digit i: bits 2 i, 2 i + 1 (the top digit signed).
                        let digit = |x: i16| if i == 3 { x >> 6 } else { (x >> (2 * i)) & 3 };
                        let t = _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(_mm256_set1_epi16(digit(s0))),
                            _mm256_set1_epi16(digit(s1)),
                        );
                        let dst = at.add((4 * s + i) * 1024 + r * 64 + half);
                        _mm256_storeu_si256(
                            dst.cast(),
                            _mm512_cvtepi16_epi8(_mm512_mullo_epi16(v, t)),
                        );
                    }
                }
                d.add(r).write(h2f(blk.d));
            }
        }
    }
}

/// [`kquant_tiles`] for Q6_K weights: `sumi = C₀ + 4 C₁ + 16 C₂ + 64 C₃` from
/// four signed tile multiplies (`tdpbssd`) a step over [`prep_q6k`]'s
/// operands; the offset of 32 is in the values, so no block sums are needed.
///
/// # Safety
/// As [`kquant_tiles`].
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub(super) unsafe fn q6k_tiles(
    w: &[BlockQ6K],
    nb: usize,
    rows: usize,
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // tmm0..3: the four digits' sums; tmm4, tmm5: weights; tmm6: activations.
    let cfg = TileConfig::new([(16, 64); 8]);
    unsafe {
        q8k_tile_loop(
            nb,
            rows,
            acts,
            out,
            &cfg,
            (Q6K_PREP, 4 * 1024),
            |j0, nj, base| prep_q6k(&w[j0 * nb..(j0 + nj) * nb], nb, nj, base),
            |ap, wp, cbuf, acc| {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
                for s in 0..4 {
                    asm!(
                        "tileloadd tmm6, [{a} + {st}]",
                        "tileloadd tmm4, [{w} + {st}]",
                        "tdpbssd tmm0, tmm4, tmm6",
                        "tileloadd tmm5, [{w} + {st} + 1024]",
                        "tdpbssd tmm1, tmm5, tmm6",
                        "tileloadd tmm4, [{w} + {st} + 2048]",
                        "tdpbssd tmm2, tmm4, tmm6",
                        "tileloadd tmm5, [{w} + {st} + 3072]",
                        "tdpbssd tmm3, tmm5, tmm6",
                        a = in(reg) ap.add(s * 1024),
                        w = in(reg) wp.add(4 * s * 1024),
                        st = in(reg) 64usize,
                        options(nostack, readonly),
                    );
                }
                asm!(
                    "tilestored [{c} + {st}], tmm0",
                    "tilestored [{c} + {st} + 1024], tmm1",
                    "tilestored [{c} + {st} + 2048], tmm2",
                    "tilestored [{c} + {st} + 3072], tmm3",
                    c = in(reg) cbuf,
                    st = in(reg) 64usize,
                    options(nostack),
                );
                let da = _mm512_load_ps(ap.add(4096).cast());
                let d = wp.add(16 * 1024).cast::<f32>();
                let c = cbuf.cast::<__m512i>();
                for (r, acc) in acc.iter_mut().enumerate() {
                    let t = arr!(i in 4 => _mm512_load_si512(c.add(16 * i + r)));
                    let sumi = _mm512_add_epi32(
                        _mm512_add_epi32(t[0], _mm512_slli_epi32::<2>(t[1])),
                        _mm512_add_epi32(
                            _mm512_slli_epi32::<4>(t[2]),
                            _mm512_slli_epi32::<6>(t[3]),
                        ),
                    );
                    let dd = _mm512_mul_ps(_mm512_set1_ps(*d.add(r)), da);
                    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi)));
                }
            },
        );
    }
}

/// Bytes per block of [`prep_q2k`]'s output for a tile of 16 weight rows:
/// eight operand tiles, then the rows' `d` and `dmin`.
const Q2K_PREP: usize = 8 * 1024 + 16 * 8;

/// One tile of 16 weight rows (`w`: the first of them, `nj` valid; the rest
/// zero) unpacked, per block `b` at `b * Q2K_PREP`: for each step `s` of 64
/// elements the u8 operands `q·sc` (tile `2 s`; quants 0..=3, 4-bit scales)
/// and `m` (tile `2 s + 1`: each element's 4-bit min, so that tile's sums
/// are `Σ m_g · bsum_g`); then the rows' `d` and `dmin`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn prep_q2k(w: &[BlockQ2K], nb: usize, nj: usize, base: *mut u8) {
    unsafe {
        let three = _mm256_set1_epi8(3);
        for b in 0..nb {
            let at = base.add(b * Q2K_PREP);
            let d = at.add(8 * 1024).cast::<f32>();
            let dmin = d.add(16);
            for r in 0..16 {
                let Some(blk) = (r < nj).then(|| &w[r * nb + b]) else {
                    for t in 0..8 {
                        std::ptr::write_bytes(at.add(t * 1024 + r * 64), 0, 64);
                    }
                    d.add(r).write(0.0);
                    dmin.add(r).write(0.0);
                    continue;
                };
                // Elements 32 j .. + 32: bits 2 (j % 4) of qs[32 (j / 4) ..].
                for j in 0..8 {
                    let q = _mm256_loadu_si256(blk.qs.as_ptr().add((j / 4) * 32).cast());
                    let q = _mm256_and_si256(
                        _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (j % 4) as i32)),
                        three,
                    );
                    let (s0, s1) = (blk.scales[2 * j], blk.scales[2 * j + 1]);
                    let pair = |lo: u8, hi: u8| {
                        _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(_mm256_set1_epi16(lo as i16)),
                            _mm256_set1_epi16(hi as i16),
                        )
                    };
                    let qs = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(q), pair(s0 & 15, s1 & 15));
                    let mins = _mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(_mm_set1_epi8((s0 >> 4) as i8)),
                        _mm_set1_epi8((s1 >> 4) as i8),
                    );
                    let (s, half) = (j / 2, (j % 2) * 32);
                    let t0 = at.add(2 * s * 1024 + r * 64 + half);
                    let t1 = at.add((2 * s + 1) * 1024 + r * 64 + half);
                    _mm256_storeu_si256(t0.cast(), _mm512_cvtepi16_epi8(qs));
                    _mm256_storeu_si256(t1.cast(), mins);
                }
                d.add(r).write(h2f(blk.d));
                dmin.add(r).write(h2f(blk.dmin));
            }
        }
    }
}

/// A 256-element format whose block sums come from two tile multiplies a
/// 64-element step over two operands unpacked by [`PairOps::prep`] (Q2_K,
/// Q3_K), folded into the result by [`PairOps::fold`].
pub(super) trait PairOps: bytemuck::Pod {
    /// Bytes per block of [`PairOps::prep`]'s output: the eight operand
    /// tiles (`2 s`, `2 s + 1` for step `s`), then the rows' scales.
    const PREP: usize;
    /// The operands are signed bytes (`tdpbssd`), else unsigned (`tdpbusd`).
    const SIGNED: bool;

    /// Unpack 16 weight rows (`nj` valid, the rest zero) to `base`.
    ///
    /// # Safety
    /// `base` holds `nb * PREP` bytes.
    unsafe fn prep(w: &[Self], nb: usize, nj: usize, base: *mut u8);

    /// `acc` after a block whose two sums for weight row `r` are `c0`, `c1`
    /// (`wp`: the block's [`PairOps::prep`] output, `da`: the activation
    /// rows' scales), in the scalar reference's float steps.
    ///
    /// # Safety
    /// `wp` is a block of [`PairOps::prep`]'s output.
    unsafe fn fold(
        acc: __m512,
        c0: __m512i,
        c1: __m512i,
        wp: *const u8,
        r: usize,
        da: __m512,
    ) -> __m512;
}

impl PairOps for BlockQ3K {
    const PREP: usize = Q3K_PREP;
    const SIGNED: bool = true;

    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn prep(w: &[Self], nb: usize, nj: usize, base: *mut u8) {
        unsafe { prep_q3k(w, nb, nj, base) }
    }

    /// `sumi = C₀ + 8·C₁`, then `acc + (d·da)·sumi`.
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn fold(
        acc: __m512,
        c0: __m512i,
        c1: __m512i,
        wp: *const u8,
        r: usize,
        da: __m512,
    ) -> __m512 {
        let d = unsafe { *wp.add(8 * 1024).cast::<f32>().add(r) };
        let sumi = _mm512_add_epi32(c0, _mm512_slli_epi32::<3>(c1));
        let dd = _mm512_mul_ps(_mm512_set1_ps(d), da);
        _mm512_add_ps(acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi)))
    }
}

impl PairOps for BlockQ2K {
    const PREP: usize = Q2K_PREP;
    const SIGNED: bool = false;

    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn prep(w: &[Self], nb: usize, nj: usize, base: *mut u8) {
        unsafe { prep_q2k(w, nb, nj, base) }
    }

    /// `sumi = C₀`, `summ = C₁`, then `(acc + (d·da)·sumi) - (dmin·da)·summ`.
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn fold(
        acc: __m512,
        c0: __m512i,
        c1: __m512i,
        wp: *const u8,
        r: usize,
        da: __m512,
    ) -> __m512 {
        let d = unsafe { wp.add(8 * 1024).cast::<f32>() };
        let (d, dmin) = unsafe { (*d.add(r), *d.add(16 + r)) };
        let dd = _mm512_mul_ps(_mm512_set1_ps(d), da);
        let acc = _mm512_add_ps(acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(c0)));
        let dm = _mm512_mul_ps(_mm512_set1_ps(dmin), da);
        _mm512_sub_ps(acc, _mm512_mul_ps(dm, _mm512_cvtepi32_ps(c1)))
    }
}

/// [`kquant_tiles`] for [`PairOps`] weights (Q2_K, Q3_K).
///
/// # Safety
/// As [`kquant_tiles`].
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub(super) unsafe fn pair_tiles<W: PairOps>(
    w: &[W],
    nb: usize,
    rows: usize,
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // tmm0, tmm1: the two sums; tmm3: activations; tmm4, tmm5: weights.
    let cfg = TileConfig::new([(16, 64); 8]);
    unsafe {
        q8k_tile_loop(
            nb,
            rows,
            acts,
            out,
            &cfg,
            (W::PREP, 2 * 1024),
            |j0, nj, base| W::prep(&w[j0 * nb..(j0 + nj) * nb], nb, nj, base),
            |ap, wp, cbuf, acc| {
                asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
                for s in 0..4 {
                    macro_rules! step {
                    ($op:literal) => {
                        asm!(
                            "tileloadd tmm3, [{a} + {st}]",
                            "tileloadd tmm4, [{w0} + {st}]",
                            "tileloadd tmm5, [{w1} + {st}]",
                            concat!($op, " tmm0, tmm4, tmm3"),
                            concat!($op, " tmm1, tmm5, tmm3"),
                            a = in(reg) ap.add(s * 1024),
                            w0 = in(reg) wp.add(2 * s * 1024),
                            w1 = in(reg) wp.add((2 * s + 1) * 1024),
                            st = in(reg) 64usize,
                            options(nostack, readonly),
                        )
                    };
                }
                    if W::SIGNED {
                        step!("tdpbssd");
                    } else {
                        step!("tdpbusd");
                    }
                }
                asm!(
                    "tilestored [{c0} + {st}], tmm0",
                    "tilestored [{c1} + {st}], tmm1",
                    c0 = in(reg) cbuf,
                    c1 = in(reg) cbuf.add(1024),
                    st = in(reg) 64usize,
                    options(nostack),
                );
                let da = _mm512_load_ps(ap.add(4096).cast());
                let c = cbuf.cast::<__m512i>();
                for (r, acc) in acc.iter_mut().enumerate() {
                    let (c0, c1) = (
                        _mm512_load_si512(c.add(r)),
                        _mm512_load_si512(c.add(16 + r)),
                    );
                    *acc = W::fold(*acc, c0, c1, wp, r, da);
                }
            },
        );
    }
}
