//! Random blocks for tests and benchmarks: random quant bits with sane, finite
//! scales, and activation blocks whose `bsums`/`s` agree with their quants.

use crate::blocks::*;
use crate::rng::Rng;
use half::f16;
use samesum_gguf::GgmlType;

/// A random finite f16 scale of magnitude in roughly `[2^-14, 2^-2]`, either sign
/// when `signed`.
pub fn scale(rng: &mut Rng, signed: bool) -> f16 {
    let mag = 2f32.powf(rng.range(-14.0, -2.0));
    let s = if signed && rng.next_u64() & 1 == 1 {
        -mag
    } else {
        mag
    };
    f16::from_f32(s)
}

/// Random bytes for `n_blocks` blocks of weight format `ty`, with sane scales.
/// Returns `None` for formats without a block layout here.
pub fn random_weight_blocks(ty: GgmlType, n_blocks: usize, rng: &mut Rng) -> Option<Vec<u8>> {
    use GgmlType::*;
    let ts = ty.type_size();
    let mut out = vec![0u8; n_blocks * ts];
    rng.fill_bytes(&mut out);
    for b in out.chunks_exact_mut(ts) {
        let mut put = |off: usize, v: f16| b[off..off + 2].copy_from_slice(&v.to_le_bytes());
        match ty {
            F32 | F16 | BF16 => {}
            Q4_0 | Q5_0 | Q8_0 | IQ4_NL | Q4_1 | Q5_1 | Q4_K | Q5_K => {
                put(0, scale(rng, true));
                if matches!(ty, Q4_1 | Q5_1 | Q4_K | Q5_K) {
                    put(2, scale(rng, true));
                }
            }
            IQ4_XS | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S => put(0, scale(rng, true)),
            Q2_K => {
                put(80, scale(rng, true));
                put(82, scale(rng, true));
            }
            Q3_K => put(108, scale(rng, true)),
            Q6_K => put(208, scale(rng, true)),
            MXFP4 => b[0] = 100 + (rng.below(40) as u8),
            _ => return None,
        }
    }
    match ty {
        F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.range(-2.0, 2.0).to_le_bytes());
            }
        }
        F16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(rng.range(-2.0, 2.0)).to_le_bytes());
            }
        }
        BF16 => {
            for c in out.chunks_exact_mut(2) {
                let v = crate::quantize::f32_to_bf16(rng.range(-2.0, 2.0));
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => {}
    }
    Some(out)
}

/// A random Q8_0 block (quants anywhere in -128..=127).
pub fn random_q8_0(rng: &mut Rng) -> BlockQ8_0 {
    let mut qs = [0i8; 32];
    for q in &mut qs {
        *q = rng.next_u64() as i8;
    }
    BlockQ8_0 {
        d: scale(rng, true),
        qs,
    }
}

/// A random Q8_1 block with a consistent `s`.
pub fn random_q8_1(rng: &mut Rng) -> BlockQ8_1 {
    let b = random_q8_0(rng);
    let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
    BlockQ8_1 {
        d: b.d,
        s: f16::from_f32(sum as f32 * b.d.to_f32()),
        qs: b.qs,
    }
}

/// A random Q8_K block (quants anywhere in -128..=127) with consistent `bsums`.
pub fn random_q8_k(rng: &mut Rng) -> BlockQ8K {
    let mut b = BlockQ8K {
        d: rng.range(1e-4, 1e-1),
        qs: [0; 256],
        bsums: [0; 16],
    };
    for q in &mut b.qs {
        *q = rng.next_u64() as i8;
    }
    for g in 0..16 {
        b.bsums[g] = b.qs[g * 16..g * 16 + 16].iter().map(|&q| q as i16).sum();
    }
    b
}
