//! Quantization: f32 rows to blocks.
//!
//! Activation formats (Q8_0, Q8_1, Q8_K) follow ggml's reference quantizers
//! exactly (same scale, same rounding), so an activation row quantizes to the same
//! bytes as in ggml. Weight formats Q4_0 (ggml's reference) and Q4_K, Q5_K, Q6_K
//! (a least-squares search of our own over candidate scales) are used to write
//! synthetic models; they meet ggml's error bounds (see the tests).

use crate::blocks::*;
use crate::error::{QuantError, Result};
use crate::row_size;
use half::f16;
use samesum_gguf::GgmlType;

/// Whether [`quantize`] supports `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q8_0 | Q8_1 | Q8_K | Q4_K | Q5_K | Q6_K
    )
}

/// Quantize `x` to a new buffer of `ty` blocks.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    let mut out = vec![0u8; row_size(ty, x.len())?];
    quantize_into(ty, x, &mut out)?;
    Ok(out)
}

/// Quantize `x` into `out`, which must be exactly the row size.
pub fn quantize_into(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    crate::check_lengths(ty, out.len(), x.len())?;
    use GgmlType::*;
    match ty {
        F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
            }
        }
        Q4_0 => blocks::<BlockQ4_0, 32>(x, out, q4_0),
        Q8_0 => blocks::<BlockQ8_0, 32>(x, out, q8_0),
        Q8_1 => blocks::<BlockQ8_1, 32>(x, out, q8_1),
        Q8_K => blocks::<BlockQ8K, 256>(x, out, q8_k),
        Q4_K => blocks::<BlockQ4K, 256>(x, out, q4_k),
        Q5_K => blocks::<BlockQ5K, 256>(x, out, q5_k),
        Q6_K => blocks::<BlockQ6K, 256>(x, out, q6_k),
        other => {
            return Err(QuantError::Unsupported {
                ty: other,
                what: "quantize",
            });
        }
    }
    Ok(())
}

fn blocks<B: bytemuck::Pod, const N: usize>(x: &[f32], out: &mut [u8], f: fn(&[f32; N]) -> B) {
    let size = std::mem::size_of::<B>();
    for (xs, o) in x.chunks_exact(N).zip(out.chunks_exact_mut(size)) {
        let b = f(xs.try_into().expect("chunk of N"));
        o.copy_from_slice(bytemuck::bytes_of(&b));
    }
}

/// f32 to bf16 bits, rounding to nearest even and quieting NaNs (ggml's rule).
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u as u64 + (0x7fff + ((u >> 16) & 1)) as u64) >> 16) as u16
}

/// Q8_0 as ggml's `quantize_row_q8_0_ref`: `d = amax/127`, round half away from zero.
pub fn q8_0(x: &[f32; 32]) -> BlockQ8_0 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; 32];
    for (q, v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// Q8_1 as ggml's `quantize_row_q8_1_ref`, with `s = d * sum(q)`.
pub fn q8_1(x: &[f32; 32]) -> BlockQ8_1 {
    let b = q8_0(x);
    let d = amax_over_127(x);
    let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
    BlockQ8_1 {
        d: b.d,
        s: f16::from_f32(sum as f32 * d),
        qs: b.qs,
    }
}

fn amax_over_127(x: &[f32; 32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0
}

/// Q8_K as ggml's `quantize_row_q8_K_ref`: `iscale = -127/max` (max = the signed
/// value of largest magnitude), round half to even, clamp at 127, and the sums of
/// each 16 quants.
pub fn q8_k(x: &[f32; 256]) -> BlockQ8K {
    // The largest magnitude (a max, exact in any order, so it vectorizes), then
    // the first value that has it: the same `max` as ggml's single scan.
    let mut amax = 0f32;
    for &v in x {
        amax = amax.max(v.abs());
    }
    let max = if amax > 0.0 {
        x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0)
    } else {
        0.0
    };
    let mut b = BlockQ8K {
        d: 0.0,
        qs: [0; 256],
        bsums: [0; 16],
    };
    if amax == 0.0 {
        return b;
    }
    let iscale = -127.0 / max;
    for (q, v) in b.qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (j, s) in b.bsums.iter_mut().enumerate() {
        *s = b.qs[j * 16..j * 16 + 16].iter().map(|&q| q as i16).sum();
    }
    b.d = 1.0 / iscale;
    b
}

/// Round to nearest, ties to even, for |x| < 2^22 (ggml's `nearest_int`: adding
/// 1.5 * 2^23 leaves the integer in the low mantissa bits).
#[inline(always)]
fn nearest_int(x: f32) -> i32 {
    debug_assert!(x.abs() <= 4_194_303.0);
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Q4_0 as ggml's `quantize_row_q4_0_ref`.
pub fn q4_0(x: &[f32; 32]) -> BlockQ4_0 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
        qs[j] = q0 | (q1 << 4);
    }
    BlockQ4_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// Fit `x ≈ scale * l - min` with `l` in `0..=nmax`, `min >= 0`: try candidate
/// scales around the range, refine each by least squares, keep the best.
fn fit_asymmetric(x: &[f32], nmax: i32, l_out: &mut [u8]) -> (f32, f32) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if hi <= lo {
        l_out.fill(0);
        return (0.0, -lo);
    }
    let mut best = (f32::INFINITY, 0.0f32, -lo);
    let mut l = vec![0u8; x.len()];
    for step in -6..=6 {
        let iscale = (nmax as f32 + 0.1 * step as f32) / (hi - lo);
        for (li, &v) in l.iter_mut().zip(x) {
            *li = ((iscale * (v - lo)).round() as i32).clamp(0, nmax) as u8;
        }
        // Least squares for scale and offset given l.
        let n = x.len() as f32;
        let (mut sl, mut sl2, mut sx, mut sxl) = (0f32, 0f32, 0f32, 0f32);
        for (&li, &v) in l.iter().zip(x) {
            let lf = li as f32;
            sl += lf;
            sl2 += lf * lf;
            sx += v;
            sxl += v * lf;
        }
        let det = n * sl2 - sl * sl;
        let (mut scale, mut off) = if det > 0.0 {
            ((n * sxl - sl * sx) / det, (sl2 * sx - sl * sxl) / det)
        } else {
            (1.0 / iscale, lo)
        };
        if off > 0.0 {
            // The format needs min >= 0 (an offset <= 0): refit the scale with offset 0.
            off = 0.0;
            scale = if sl2 > 0.0 { sxl / sl2 } else { 0.0 };
        }
        let err: f32 = l
            .iter()
            .zip(x)
            .map(|(&li, &v)| (scale * li as f32 + off - v).powi(2))
            .sum();
        if err < best.0 && scale > 0.0 {
            best = (err, scale, -off);
            l_out.copy_from_slice(&l);
        }
    }
    if best.1 == 0.0 {
        let scale = (hi - lo) / nmax as f32;
        for (li, &v) in l_out.iter_mut().zip(x) {
            *li = (((v - lo) / scale).round() as i32).clamp(0, nmax) as u8;
        }
        return (scale, -lo);
    }
    (best.1, best.2)
}

/// Quantize the per-group (scale, min) pairs of a Q4_K/Q5_K block to 6 bits and
/// requantize the values with the quantized scales. Returns (d, dmin, scales, L).
fn kquant_asym(x: &[f32; 256], nmax: i32) -> (f16, f16, [u8; 12], [u8; 256]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let (s, m) = fit_asymmetric(&x[j * 32..j * 32 + 32], nmax, &mut l[j * 32..j * 32 + 32]);
        scales[j] = s;
        mins[j] = m;
    }
    let max_scale = scales.iter().copied().fold(0f32, f32::max);
    let max_min = mins.iter().copied().fold(0f32, f32::max);
    let inv_s = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_m = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = ((inv_s * scales[j]).round() as i32).clamp(0, 63) as u8;
        lm[j] = ((inv_m * mins[j]).round() as i32).clamp(0, 63) as u8;
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    let mut packed = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            packed[j] = ls[j];
            packed[j + 4] = lm[j];
        } else {
            packed[j + 4] = (ls[j] & 0x0F) | ((lm[j] & 0x0F) << 4);
            packed[j - 4] |= (ls[j] >> 4) << 6;
            packed[j] |= (lm[j] >> 4) << 6;
        }
    }
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &packed);
        let dl = d.to_f32() * sc as f32;
        if dl == 0.0 {
            continue;
        }
        let ml = dmin.to_f32() * m as f32;
        for i in 0..32 {
            let v = x[j * 32 + i];
            l[j * 32 + i] = (((v + ml) / dl).round() as i32).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed, l)
}

/// Q4_K weights.
pub fn q4_k(x: &[f32; 256]) -> BlockQ4K {
    let (d, dmin, scales, l) = kquant_asym(x, 15);
    let mut qs = [0u8; 128];
    for c in 0..4 {
        for i in 0..32 {
            qs[c * 32 + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
    BlockQ4K {
        d,
        dmin,
        scales,
        qs,
    }
}

/// Q5_K weights.
pub fn q5_k(x: &[f32; 256]) -> BlockQ5K {
    let (d, dmin, scales, l) = kquant_asym(x, 31);
    let mut qs = [0u8; 128];
    let mut qh = [0u8; 32];
    for c in 0..4 {
        for i in 0..32 {
            qs[c * 32 + i] = (l[64 * c + i] & 0x0F) | ((l[64 * c + 32 + i] & 0x0F) << 4);
        }
    }
    for j in 0..8 {
        for i in 0..32 {
            qh[i] |= (l[j * 32 + i] >> 4) << j;
        }
    }
    BlockQ5K {
        d,
        dmin,
        scales,
        qh,
        qs,
    }
}

/// Fit `x ≈ scale * l` with `l` in `-nmax..nmax-1` by least squares over candidates.
fn fit_symmetric(x: &[f32], nmax: i32) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        return 0.0;
    }
    let mut best = (f32::INFINITY, max / -(nmax as f32));
    for step in -9..=9 {
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (mut sxl, mut sll) = (0f32, 0f32);
        for &v in x {
            let l = ((iscale * v).round() as i32).clamp(-nmax, nmax - 1) as f32;
            sxl += v * l;
            sll += l * l;
        }
        if sll == 0.0 {
            continue;
        }
        let scale = sxl / sll;
        let err: f32 = x
            .iter()
            .map(|&v| {
                let l = ((v / scale).round() as i32).clamp(-nmax, nmax - 1) as f32;
                (scale * l - v).powi(2)
            })
            .sum();
        if err < best.0 {
            best = (err, scale);
        }
    }
    best.1
}

/// Q6_K weights.
pub fn q6_k(x: &[f32; 256]) -> BlockQ6K {
    let mut scales = [0f32; 16];
    for g in 0..16 {
        scales[g] = fit_symmetric(&x[g * 16..g * 16 + 16], 32);
    }
    let (mut amax, mut max) = (0f32, 0f32);
    for &s in &scales {
        if s.abs() > amax {
            amax = s.abs();
            max = s;
        }
    }
    let mut b = BlockQ6K {
        ql: [0; 128],
        qh: [0; 64],
        scales: [0; 16],
        d: f16::ZERO,
    };
    if amax == 0.0 {
        // All zero: q = 32 encodes 0.
        let l = [32u8; 256];
        pack_q6(&l, &mut b);
        return b;
    }
    let iscale = -128.0 / max;
    b.d = f16::from_f32(1.0 / iscale);
    for g in 0..16 {
        b.scales[g] = ((iscale * scales[g]).round() as i32).clamp(-128, 127) as i8;
    }
    let mut l = [32u8; 256];
    for g in 0..16 {
        let dl = b.d.to_f32() * b.scales[g] as f32;
        if dl == 0.0 {
            continue;
        }
        for i in 0..16 {
            let q = ((x[g * 16 + i] / dl).round() as i32).clamp(-32, 31);
            l[g * 16 + i] = (q + 32) as u8;
        }
    }
    pack_q6(&l, &mut b);
    b
}

fn pack_q6(l: &[u8; 256], b: &mut BlockQ6K) {
    for n in 0..2 {
        for i in 0..32 {
            let q1 = l[n * 128 + i];
            let q2 = l[n * 128 + i + 32];
            let q3 = l[n * 128 + i + 64];
            let q4 = l[n * 128 + i + 96];
            b.ql[n * 64 + i] = (q1 & 0x0F) | ((q3 & 0x0F) << 4);
            b.ql[n * 64 + i + 32] = (q2 & 0x0F) | ((q4 & 0x0F) << 4);
            b.qh[n * 32 + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's Q8_K quantizer, written as its single scan.
    fn q8_k_reference(x: &[f32; 256]) -> BlockQ8K {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let mut b = BlockQ8K {
            d: 0.0,
            qs: [0; 256],
            bsums: [0; 16],
        };
        if amax == 0.0 {
            return b;
        }
        let iscale = -127.0 / max;
        for (q, v) in b.qs.iter_mut().zip(x) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (j, s) in b.bsums.iter_mut().enumerate() {
            *s = b.qs[j * 16..j * 16 + 16].iter().map(|&q| q as i16).sum();
        }
        b.d = 1.0 / iscale;
        b
    }

    #[test]
    fn q8_k_matches_ggml_scan() {
        let mut rng = crate::rng::Rng::new(8);
        for case in 0..2000 {
            let mut x = [0f32; 256];
            for v in x.iter_mut() {
                *v = rng.normal() * 3.0;
            }
            match case % 5 {
                1 => x[17] = -x.iter().fold(0f32, |m, v| m.max(v.abs())), // negative extreme
                2 => {
                    let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    x[3] = m;
                    x[200] = -m; // tie in magnitude: the first wins
                }
                3 => x = [0.0; 256],
                4 => x[9] = f32::NAN,
                _ => {}
            }
            let (a, b) = (q8_k(&x), q8_k_reference(&x));
            assert_eq!(
                bytemuck::bytes_of(&a),
                bytemuck::bytes_of(&b),
                "case {case}"
            );
        }
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        for (x, want) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.6, 127),
            (-127.0, -127),
            (3.49, 3),
        ] {
            assert_eq!(nearest_int(x), want, "{x}");
            assert_eq!(nearest_int(x), x.round_ties_even() as i32, "{x}");
        }
    }

    #[test]
    fn can_quantize_matches_quantize() {
        for &ty in GgmlType::ALL {
            let x = vec![0.25f32; ty.block_size() * 2];
            assert_eq!(quantize(ty, &x).is_ok(), can_quantize(ty), "{ty}");
        }
    }
}
