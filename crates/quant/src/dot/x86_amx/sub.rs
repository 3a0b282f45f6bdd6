//! The AMX tile kernel of the 256-element formats whose sub-block scales
//! times their values do not fit a byte (IQ4_XS, IQ3_S, IQ2_XXS, IQ3_XXS,
//! IQ2_XS, IQ2_S): each sub-block's integer sum comes from its own tile
//! multiply, and the scales multiply the stored sums before the reference's
//! float steps.

use super::*;
use crate::dot::x86_iq::{IqChunks, signed};

/// Bytes per block of [`prep_sub`]'s output for a tile of 16 weight rows:
/// the operand tiles (one a sub-block: 16 rows of its values, 4,096 bytes
/// in all), then the rows' `d`, then room for their sixteen sub-block
/// scales as i32.
const SUB_PREP: usize = 4096 + 16 * 4 + 16 * 16 * 4;

/// A 256-element format whose block sum is `Σ_s c_s · Σ_{k∈s} v_k a_k`
/// over [`Self::SUBS`] equal sub-blocks, with i8 values `v` and integer
/// scales `c_s` whose products need not fit a byte, combined as
/// `acc + ((dw·da)·K)·sumi` (`K` = 1: `acc + (dw·da)·sumi`).
pub(crate) trait SubScaled: bytemuck::Pod {
    /// Sub-blocks a block: 8 of 32 elements or 16 of 16.
    const SUBS: usize;
    /// The block's fixed factor (ggml's 0.125, 0.25), `None` for none.
    const K: Option<f32>;
    /// The block's `dw`.
    fn dw(&self) -> f32;
    /// Write sub-block `s`'s `256 / SUBS` values, in element order, to `dst
    /// + s * 4096 / SUBS`, and return the `SUBS` scales (the rest zero).
    ///
    /// # Safety
    /// `dst + s * 4096 / SUBS .. + 256 / SUBS` is writable for every `s`
    /// below `SUBS`.
    unsafe fn unpack(&self, dst: *mut u8) -> [i32; 16];
}

impl SubScaled for BlockIq4Xs {
    const SUBS: usize = 8;
    const K: Option<f32> = None;
    fn dw(&self) -> f32 {
        f16_to_f32(self.d)
    }

    /// The non-linear table's entries by `pshufb`; byte j of a sub-block
    /// holds element j (low nibble) and j + 16 (high nibble).
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn unpack(&self, dst: *mut u8) -> [i32; 16] {
        unsafe {
            let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast());
            let mask = _mm_set1_epi8(0x0F);
            for ib in 0..8 {
                let q = _mm_loadu_si128(self.qs.as_ptr().add(ib * 16).cast());
                let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, mask));
                let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(q), mask));
                _mm_storeu_si128(dst.add(ib * 512).cast(), lo);
                _mm_storeu_si128(dst.add(ib * 512 + 16).cast(), hi);
            }
        }
        let sc = iq4xs_scales(self);
        std::array::from_fn(|s| sc.get(s).map_or(0, |&c| i32::from(c)))
    }
}

/// A grid i-quant of 32-element sub-blocks from its chunks
/// ([`IqChunks::chunk`], the one-row and AVX-512 kernels' unpacking): chunk
/// `ib`'s 32 values with their signs applied, to `dst + ib * 512`, and its
/// scale.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn unpack_grid32<W: IqChunks>(w: &W, dst: *mut u8) -> [i32; 16] {
    let mut sc = [0i32; 16];
    unsafe {
        for (ib, sc) in sc.iter_mut().take(8).enumerate() {
            let (grid, signs, lo, _) = w.chunk(ib);
            _mm256_storeu_si256(dst.add(ib * 512).cast(), signed(grid, signs));
            *sc = i32::from(lo);
        }
    }
    sc
}

/// [`SubScaled`] for a grid i-quant: `SUBS` sub-blocks, the factor `K`
/// (`None` for 1), the unpacking function.
macro_rules! grid_sub {
    ($w:ty, $subs:expr, $k:expr, $unpack:ident) => {
        impl SubScaled for $w {
            const SUBS: usize = $subs;
            const K: Option<f32> = $k;
            fn dw(&self) -> f32 {
                f16_to_f32(self.d)
            }
            #[target_feature(enable = "avx512f,avx512bw,f16c")]
            unsafe fn unpack(&self, dst: *mut u8) -> [i32; 16] {
                unsafe { $unpack(self, dst) }
            }
        }
    };
}

grid_sub!(BlockIq2Xxs, 8, Some(0.125), unpack_grid32);
grid_sub!(BlockIq3Xxs, 8, Some(0.25), unpack_grid32);
grid_sub!(BlockIq3S, 8, None, unpack_grid32);
grid_sub!(BlockIq2Xs, 16, Some(0.125), unpack_iq2_xs);
grid_sub!(BlockIq2S, 16, Some(0.125), unpack_iq2_s);

/// The `2 c + 1` scales of the 4-bit digits `c` in `scales`, low nibble
/// first.
fn odd_scales(scales: &[u8]) -> [i32; 16] {
    std::array::from_fn(|k| {
        scales
            .get(k / 2)
            .map_or(0, |&b| 2 * ((b >> (4 * (k % 2))) & 0x0F) as i32 + 1)
    })
}

/// Two 16-element sub-blocks `k`, `k + 1` (four 8-byte grid entries `g`
/// with the sign bytes of `signs`) to their operands `dst + k * 256` and
/// `dst + (k + 1) * 256`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn store_pair16(dst: *mut u8, k: usize, g: [i64; 4], signs: u32) {
    unsafe {
        let v = signed(_mm256_setr_epi64x(g[0], g[1], g[2], g[3]), signs);
        _mm_storeu_si128(dst.add(k * 256).cast(), _mm256_castsi256_si128(v));
        _mm_storeu_si128(
            dst.add((k + 1) * 256).cast(),
            _mm256_extracti128_si256::<1>(v),
        );
    }
}

/// IQ2_XS's 16-element sub-blocks, two at a time: per 16 elements two
/// 8-byte grid entries (nine-bit indices) and their 7-bit sign indices, `2
/// sc + 1` (the chunk form measured ~12% slower at 16 activation rows).
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn unpack_iq2_xs(w: &BlockIq2Xs, dst: *mut u8) -> [i32; 16] {
    use crate::iq_tables::{IQ2XS_GRID, KSIGNS_IQ2XS};
    for k in (0..16).step_by(2) {
        let q = |l: usize| w.qs[2 * k + l];
        let g = std::array::from_fn(|l| i64::from_le_bytes(IQ2XS_GRID[(q(l) & 511) as usize]));
        let signs = (0..4).fold(0u32, |acc, l| {
            acc | (KSIGNS_IQ2XS[(q(l) >> 9) as usize] as u32) << (8 * l)
        });
        unsafe { store_pair16(dst, k, g, signs) };
    }
    odd_scales(&w.scales)
}

/// IQ2_S's 16-element sub-blocks, two at a time: per 16 elements two
/// 8-byte grid entries (ten-bit indices) and their sign bytes, `2 sc + 1`.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn unpack_iq2_s(w: &BlockIq2S, dst: *mut u8) -> [i32; 16] {
    use crate::iq_tables::IQ2S_GRID;
    for k in (0..16).step_by(2) {
        let g =
            std::array::from_fn(|l| IQ2S_GRID[crate::dequant::iq2_s_index(w, 2 * k + l)] as i64);
        let signs = u32::from_le_bytes(std::array::from_fn(|l| w.signs[2 * k + l]));
        unsafe { store_pair16(dst, k, g, signs) };
    }
    odd_scales(&w.scales)
}

/// One tile of 16 weight rows (`w`: the first of them, `nj` valid; the rest
/// zero) unpacked, per block `b` at `b * SUB_PREP`: for sub-block `s` a 16 ×
/// `256 / SUBS`-byte operand whose row `r` holds row `r`'s values of it,
/// then the rows' `dw` and their scales (row-major, `SUBS` a row).
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn prep_sub<W: SubScaled>(w: &[W], nb: usize, nj: usize, base: *mut u8) {
    let width = 256 / W::SUBS;
    unsafe {
        for b in 0..nb {
            let at = base.add(b * SUB_PREP);
            let d = at.add(4096).cast::<f32>();
            let sc = d.add(16).cast::<i32>();
            for r in 0..16 {
                let Some(blk) = (r < nj).then(|| &w[r * nb + b]) else {
                    for s in 0..W::SUBS {
                        std::ptr::write_bytes(at.add(s * 16 * width + r * width), 0, width);
                        sc.add(r * W::SUBS + s).write(0);
                    }
                    d.add(r).write(0.0);
                    continue;
                };
                let c = blk.unpack(at.add(r * width));
                for (s, &c) in c.iter().take(W::SUBS).enumerate() {
                    sc.add(r * W::SUBS + s).write(c);
                }
                d.add(r).write(blk.dw());
            }
        }
    }
}

/// [`kquant_tiles`] for [`SubScaled`] weights (IQ4_XS, IQ3_S, IQ2_XXS,
/// IQ3_XXS, IQ2_XS, IQ2_S): each sub-block takes its own tile multiply
/// (`tdpbssd`, K = its width) and the scales multiply the stored sums.
///
/// # Safety
/// As [`kquant_tiles`].
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub(crate) unsafe fn sub_tiles<W: SubScaled>(
    w: &[W],
    nb: usize,
    rows: usize,
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    let width = 256 / W::SUBS;
    // tmm0..3: four sub-blocks' sums; tmm4: weights (16 rows × `width`
    // values); tmm5: activations (`width / 4` × 16 dwords).
    let cfg = TileConfig::new([
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 64),
        (16, width as u16),
        ((width / 4) as u8, 64),
        (16, 64),
        (16, 64),
    ]);
    unsafe {
        q8k_tile_loop(
            nb,
            rows,
            acts,
            out,
            &cfg,
            (SUB_PREP, W::SUBS * 1024),
            |j0, nj, base| prep_sub(&w[j0 * nb..(j0 + nj) * nb], nb, nj, base),
            |ap, wp, cbuf, acc| {
                // Sub-block s: the activations' rows s·width/4 ..
                // (s+1)·width/4 (elements s·width .. (s+1)·width), the
                // weights' operand s; both start at byte s·16·width.
                macro_rules! sub {
                ($s:expr, $tmm:literal) => {
                    asm!(
                        concat!("tilezero tmm", $tmm),
                        "tileloadd tmm4, [{w} + {ws}]",
                        "tileloadd tmm5, [{a} + {st}]",
                        concat!("tdpbssd tmm", $tmm, ", tmm4, tmm5"),
                        concat!("tilestored [{c} + {st}], tmm", $tmm),
                        w = in(reg) wp.add($s * 16 * width),
                        ws = in(reg) width,
                        a = in(reg) ap.add($s * 16 * width),
                        c = in(reg) cbuf.add($s * 1024),
                        st = in(reg) 64usize,
                        options(nostack),
                    )
                };
            }
                for h in (0..W::SUBS).step_by(4) {
                    sub!(h, "0");
                    sub!(h + 1, "1");
                    sub!(h + 2, "2");
                    sub!(h + 3, "3");
                }
                let da = _mm512_load_ps(ap.add(4096).cast());
                let d = wp.add(4096).cast::<f32>();
                let sc = d.add(16).cast::<i32>();
                let c = cbuf.cast::<__m512i>();
                for (r, acc) in acc.iter_mut().enumerate() {
                    let mut sumi = _mm512_setzero_si512();
                    for s in 0..W::SUBS {
                        let t = _mm512_mullo_epi32(
                            _mm512_load_si512(c.add(s * 16 + r)),
                            _mm512_set1_epi32(*sc.add(r * W::SUBS + s)),
                        );
                        sumi = _mm512_add_epi32(sumi, t);
                    }
                    let mut dd = _mm512_mul_ps(_mm512_set1_ps(*d.add(r)), da);
                    if let Some(k) = W::K {
                        dd = _mm512_mul_ps(dd, _mm512_set1_ps(k));
                    }
                    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi)));
                }
            },
        );
    }
}
