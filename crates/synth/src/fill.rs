//! Random tensor contents, generated piece by piece so no tensor is ever held whole.
//!
//! Float tensors draw values from their [`Fill`]. Quantized weight matrices are
//! generated directly as blocks: uniform random quants with block scales chosen so
//! the dequantized values have mean about 0 and the requested standard deviation
//! (sane, finite scales; generating 20 GB this way takes seconds, where quantizing
//! floats would take hours).

use crate::plan::Fill;
use half::f16;
use samesum_gguf::GgmlType;
use samesum_quant::blocks::*;
use samesum_quant::quantize::{f32_to_bf16, quantize_into};
use samesum_quant::rng::Rng;

/// Seed of a tensor's stream: the model seed mixed with the tensor's name, so each
/// tensor's contents do not depend on the order tensors are written in.
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Types whose random blocks are generated directly.
pub fn direct_block_type(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K
    )
}

fn draw(rng: &mut Rng, fill: Fill) -> f32 {
    match fill {
        Fill::Normal(sd) => rng.normal() * sd,
        Fill::Norm(sd) => 1.0 + rng.normal() * sd,
        Fill::Uniform(lo, hi) => rng.range(lo, hi),
        Fill::NegExp(hi) => -(rng.range(0.0, hi.ln())).exp(),
    }
}

/// Fill `out` (a whole number of blocks of `ty`) with the next values of the stream.
pub fn fill(rng: &mut Rng, ty: GgmlType, fill: Fill, out: &mut [u8]) {
    let sd = match fill {
        Fill::Normal(sd) => sd,
        _ => 0.0,
    };
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&draw(rng, fill).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(draw(rng, fill)).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f32_to_bf16(draw(rng, fill)).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => blocks(rng, out, |rng| {
            let mut b = BlockQ8_0 {
                d: f16::from_f32(sd / 73.6),
                qs: [0; 32],
            };
            for q in &mut b.qs {
                *q = (rng.below(255) as i32 - 127) as i8;
            }
            b
        }),
        GgmlType::Q4_0 => blocks(rng, out, |rng| {
            // q - 8 has mean -1/2: alternate the scale's sign so the mean is zero.
            let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            let mut b = BlockQ4_0 {
                d: f16::from_f32(sign * sd / 4.61),
                qs: [0; 16],
            };
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q4_K => blocks(rng, out, |rng| {
            let d = sd / (52.0 * 4.61);
            let mut b = BlockQ4K {
                d: f16::from_f32(d),
                dmin: f16::from_f32(7.5 * d),
                scales: k4_scales(rng),
                qs: [0; 128],
            };
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q5_K => blocks(rng, out, |rng| {
            let d = sd / (52.0 * 9.23);
            let mut b = BlockQ5K {
                d: f16::from_f32(d),
                dmin: f16::from_f32(15.5 * d),
                scales: k4_scales(rng),
                qh: [0; 32],
                qs: [0; 128],
            };
            rng.fill_bytes(&mut b.qh);
            rng.fill_bytes(&mut b.qs);
            b
        }),
        GgmlType::Q6_K => blocks(rng, out, |rng| {
            let mut b = BlockQ6K {
                ql: [0; 128],
                qh: [0; 64],
                scales: [0; 16],
                d: f16::from_f32(sd / (87.3 * 18.47)),
            };
            rng.fill_bytes(&mut b.ql);
            rng.fill_bytes(&mut b.qh);
            for s in &mut b.scales {
                *s = (40 + rng.below(88)) as i8;
            }
            b
        }),
        other => {
            // Any other quantizable type: draw floats and quantize them.
            let bs = other.block_size();
            let n = out.len() / other.type_size() * bs;
            let xs: Vec<f32> = (0..n).map(|_| draw(rng, fill)).collect();
            quantize_into(other, &xs, out).expect("synth only plans quantizable types");
        }
    }
}

/// Scales and mins of a Q4_K/Q5_K block: the same random 6-bit value in [40, 63]
/// for a group's scale and min, so every group is centred on zero.
fn k4_scales(rng: &mut Rng) -> [u8; 12] {
    let mut ls = [0u8; 8];
    for s in &mut ls {
        *s = (40 + rng.below(24)) as u8;
    }
    let mut p = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            p[j] = ls[j];
            p[j + 4] = ls[j];
        } else {
            p[j + 4] = (ls[j] & 0x0F) | ((ls[j] & 0x0F) << 4);
            p[j - 4] |= (ls[j] >> 4) << 6;
            p[j] |= (ls[j] >> 4) << 6;
        }
    }
    p
}

fn blocks<B: bytemuck::Pod>(rng: &mut Rng, out: &mut [u8], mut f: impl FnMut(&mut Rng) -> B) {
    let size = std::mem::size_of::<B>();
    for o in out.chunks_exact_mut(size) {
        o.copy_from_slice(bytemuck::bytes_of(&f(rng)));
    }
}
