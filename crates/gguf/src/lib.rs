//! GGUF, the file format of llama.cpp: a validating mmap reader, a streaming
//! writer, typed metadata and the table of ggml tensor types.
//!
//! ```
//! use samesum_gguf::{GgufWriter, Gguf, GgmlType};
//! let mut w = GgufWriter::new();
//! w.set("general.architecture", "demo");
//! w.add_tensor("x", &[4], GgmlType::F32).unwrap();
//! let bytes = w.to_bytes(&[&[0u8; 16]]).unwrap();
//! let f = Gguf::from_bytes(bytes).unwrap();
//! assert_eq!(f.metadata().get_str("general.architecture").unwrap(), "demo");
//! assert_eq!(f.tensor_data("x").unwrap().len(), 16);
//! ```

mod error;
mod ggml_type;
mod read;
pub mod split;
mod value;
mod write;

pub use error::{GgufError, Result};
pub use ggml_type::GgmlType;
pub use read::{Gguf, GgufFile, Header, TensorInfo, parse_header, tensor_size};
pub use split::{Mapping, SplitWriter};
pub use value::{Array, Metadata, Value, ValueType};
pub use write::{DataWriter, GgufWriter};

/// The four magic bytes at the start of every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays accepted in metadata.
pub const MAX_ARRAY_NESTING: usize = 8;
