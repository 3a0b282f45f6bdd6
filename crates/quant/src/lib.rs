//! ggml block formats: layouts, dequantization, quantization and dot products.
//!
//! * [`blocks`]: `#[repr(C)]` block structs, byte-for-byte as ggml lays them out.
//! * [`dequant`]: scalar dequantization, bit-exact with gguf-py.
//! * [`quantize`]: f32 to blocks (activations Q8_0/Q8_1/Q8_K; weights Q4_0, Q4_K,
//!   Q5_K, Q6_K, and the float formats).
//! * [`dot`]: the dot product of one weight row with one activation row, as ggml
//!   pairs them. Every kernel has a scalar reference and, where the CPU has them,
//!   AVX2 and AVX-512 paths chosen at run time; all paths return byte-identical
//!   results because the inner sums are integers (or a fixed lane layout for the
//!   float formats) and the float combination follows one fixed order.
//!
//! ```
//! use samesum_quant::{dot, quantize, GgmlType};
//! let w: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37).sin()).collect();
//! let x: Vec<f32> = (0..256).map(|i| (i as f32 * 0.11).cos()).collect();
//! let wq = quantize::quantize(GgmlType::Q4_K, &w).unwrap();
//! let act = dot::ActRow::quantize(GgmlType::Q4_K, &x).unwrap();
//! let y = dot::dot(GgmlType::Q4_K, &wq, &act).unwrap();
//! let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
//! assert!((y - exact).abs() < 0.1 * exact.abs().max(1.0));
//! ```

pub mod blocks;
pub mod dequant;
pub mod dot;
mod error;
pub mod iq_tables;
pub mod isa;
pub mod quantize;
pub mod rng;
pub mod testing;

pub use error::{QuantError, Result};
pub use samesum_gguf::GgmlType;

/// Check that `n_bytes` of `ty` hold exactly `n` elements.
pub fn check_lengths(ty: GgmlType, n_bytes: usize, n: usize) -> Result<()> {
    let block = ty.block_size();
    if !n.is_multiple_of(block) {
        return Err(QuantError::NotBlockMultiple { ty, n, block });
    }
    let expected = n / block * ty.type_size();
    if n_bytes != expected {
        return Err(QuantError::ByteLength {
            ty,
            n,
            expected,
            found: n_bytes,
        });
    }
    Ok(())
}

/// View bytes as blocks of `B` (the caller has checked lengths).
pub(crate) fn cast_blocks<B: bytemuck::Pod>(ty: GgmlType, src: &[u8]) -> Result<&[B]> {
    bytemuck::try_cast_slice(src).map_err(|_| QuantError::Misaligned {
        ty,
        addr: src.as_ptr() as usize,
        align: std::mem::align_of::<B>(),
    })
}

/// Bytes taken by `n` elements of `ty`.
pub fn row_size(ty: GgmlType, n: usize) -> Result<usize> {
    let block = ty.block_size();
    if !n.is_multiple_of(block) {
        return Err(QuantError::NotBlockMultiple { ty, n, block });
    }
    Ok(n / block * ty.type_size())
}
