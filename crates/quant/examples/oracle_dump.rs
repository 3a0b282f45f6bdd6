//! Writes random blocks of every format gguf-py can dequantize, plus this crate's
//! dequantization of them, for `tests/oracle/check_dequant.py` to compare bit for
//! bit; and f32 rows with this crate's Q8_0/Q4_0/BF16 quantization of them.
//!
//! Usage: `cargo run --release -p samesum-quant --example oracle_dump -- DIR [BLOCKS]`

use half::f16;
use samesum_quant::GgmlType;
use samesum_quant::dequant::{can_dequantize, dequantize};
use samesum_quant::quantize::quantize;
use samesum_quant::rng::Rng;
use samesum_quant::testing::random_weight_blocks;
use std::path::PathBuf;

/// Every format this crate dequantizes that gguf-py can check (it has no Q8_K
/// or Q8_1 dequantizer).
fn formats() -> Vec<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .filter(|&t| can_dequantize(t) && !matches!(t, GgmlType::Q8_K | GgmlType::Q8_1))
        .collect()
}

/// Offsets of the f16 scale fields in a block of `ty`.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL | IQ4_XS | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

/// Edge scale values: zero, negative zero, extremes, subnormals, one, minus one.
const EDGE_F16_BITS: &[u16] = &[
    0x0000, 0x8000, 0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x3C00, 0xBC00,
];

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: oracle_dump DIR [BLOCKS]"));
    let n_random: usize = args
        .next()
        .map(|s| s.parse().expect("BLOCKS"))
        .unwrap_or(10_000);
    std::fs::create_dir_all(&dir).expect("create output dir");
    let mut rng = Rng::new(2026);
    let formats = formats();
    for &ty in &formats {
        let ts = ty.type_size();
        // Plain element types: count elements, in blocks of 256 for a fair sample.
        let per = if ty.block_size() == 1 { 256 } else { 1 };
        let mut blocks = random_weight_blocks(ty, n_random * per, &mut rng).unwrap();
        // Edge cases: every edge value in every scale slot, with random quants.
        let offs = scale_offsets(ty);
        for &e in EDGE_F16_BITS {
            for (k, _) in offs.iter().enumerate() {
                let mut b = random_weight_blocks(ty, 1, &mut rng).unwrap();
                for (j, &o) in offs.iter().enumerate() {
                    let v = if j == k {
                        e
                    } else {
                        f16::from_f32(-0.5).to_bits()
                    };
                    b[o..o + 2].copy_from_slice(&v.to_le_bytes());
                }
                blocks.extend_from_slice(&b);
            }
        }
        match ty {
            GgmlType::F16 => {
                for &e in EDGE_F16_BITS {
                    blocks.extend_from_slice(&e.to_le_bytes());
                }
                blocks.extend_from_slice(&0x7C00u16.to_le_bytes()); // +inf
                blocks.extend_from_slice(&0xFC00u16.to_le_bytes()); // -inf
            }
            GgmlType::BF16 => {
                for bits in [0u16, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80] {
                    blocks.extend_from_slice(&bits.to_le_bytes());
                }
            }
            GgmlType::F32 => {
                for v in [
                    0f32,
                    -0.0,
                    f32::MIN_POSITIVE,
                    1e-45,
                    f32::MAX,
                    f32::MIN,
                    f32::INFINITY,
                ] {
                    blocks.extend_from_slice(&v.to_le_bytes());
                }
            }
            GgmlType::MXFP4 => {
                for e in [0u8, 1, 2, 127, 128, 254, 255] {
                    let mut b = random_weight_blocks(ty, 1, &mut rng).unwrap();
                    b[0] = e;
                    blocks.extend_from_slice(&b);
                }
            }
            _ => {}
        }
        let n = blocks.len() / ts * ty.block_size();
        let mut out = vec![0f32; n];
        dequantize(ty, &blocks, &mut out).expect("dequantize");
        let name = ty.name().to_ascii_lowercase();
        std::fs::write(dir.join(format!("{name}.blocks")), &blocks).unwrap();
        std::fs::write(dir.join(format!("{name}.f32")), bytemuck::cast_slice(&out)).unwrap();
    }
    // Quantization: rows of f32 and our quantization of them.
    let rows: Vec<f32> = (0..n_random * 32)
        .map(|i| match i % 7 {
            0 => rng.normal() * 3.0,
            1 => rng.range(-1.0, 1.0),
            2 => 0.0,
            _ => rng.normal() * 0.02,
        })
        .collect();
    std::fs::write(dir.join("quant_input.f32"), bytemuck::cast_slice(&rows)).unwrap();
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::BF16] {
        let q = quantize(ty, &rows).expect("quantize");
        std::fs::write(
            dir.join(format!("quant_{}.bytes", ty.name().to_ascii_lowercase())),
            q,
        )
        .unwrap();
    }
    eprintln!("wrote {} formats to {}", formats.len(), dir.display());
}
