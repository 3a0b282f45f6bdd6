//! Errors of the block-format layer.

use samesum_gguf::GgmlType;

/// Result with [`QuantError`].
pub type Result<T, E = QuantError> = std::result::Result<T, E>;

/// Wrong lengths, unsupported formats or misaligned buffers.
#[allow(missing_docs)]
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("{ty}: {what} is not supported for this format")]
    Unsupported { ty: GgmlType, what: &'static str },
    #[error("{ty}: {n} elements is not a multiple of the block size {block}")]
    NotBlockMultiple {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    #[error("{ty}: {n} elements need {expected} bytes, got {found}")]
    ByteLength {
        ty: GgmlType,
        n: usize,
        expected: usize,
        found: usize,
    },
    #[error("{ty}: buffer at address {addr:#x} is not aligned to {align} bytes")]
    Misaligned {
        ty: GgmlType,
        addr: usize,
        align: usize,
    },
    #[error("{ty}: activation row has {found} elements, weight row has {expected}")]
    RowMismatch {
        ty: GgmlType,
        expected: usize,
        found: usize,
    },
    #[error("activation type {act} does not pair with weight type {weight} (expected {expected})")]
    ActivationType {
        weight: GgmlType,
        act: GgmlType,
        expected: GgmlType,
    },
}
