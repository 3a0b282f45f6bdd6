//! Errors of the container: every variant names what was being read, where, and
//! what was expected versus found.

use std::path::PathBuf;

/// Result with [`GgufError`].
pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Everything that can go wrong reading or writing a GGUF file.
#[allow(missing_docs)]
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("not a GGUF file: magic is {found:02x?} (expected \"GGUF\")")]
    BadMagic { found: [u8; 4] },
    #[error("GGUF version {found} is not supported (supported: 2, 3)")]
    UnsupportedVersion { found: u32 },
    #[error("big-endian GGUF files are not supported (version field reads {found:#010x})")]
    BigEndian { found: u32 },
    #[error(
        "file truncated while reading {what} at offset {offset}: need {needed} bytes, {available} left"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error(
        "{what} at offset {offset}: count {count} cannot fit in the {remaining} bytes left in the file"
    )]
    CountTooLarge {
        what: String,
        offset: u64,
        count: u64,
        remaining: u64,
    },
    #[error("metadata key {key:?} at offset {offset}: unknown value type {type_id}")]
    UnknownValueType {
        key: String,
        offset: u64,
        type_id: u32,
    },
    #[error("metadata key {key:?}: arrays nested deeper than {max} levels")]
    NestingTooDeep { key: String, max: usize },
    #[error("metadata key {key:?} appears more than once")]
    DuplicateKey { key: String },
    #[error("metadata key {key:?} not found")]
    KeyNotFound { key: String },
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: String,
        found: String,
    },
    #[error("general.alignment = {value} is invalid (must be a non-zero power of two)")]
    BadAlignment { value: u64 },
    #[error("tensor {name:?} appears more than once")]
    DuplicateTensor { name: String },
    #[error("tensor {name:?}: {n_dims} dimensions (at most {max} supported)")]
    TooManyDims { name: String, n_dims: u32, max: u32 },
    #[error("tensor {name:?}: dims {dims:?} overflow when multiplied (element or byte count)")]
    DimOverflow { name: String, dims: Vec<u64> },
    #[error("tensor {name:?}: unknown ggml type id {type_id}")]
    UnknownGgmlType { name: String, type_id: u32 },
    #[error(
        "tensor {name:?}: first dimension {ne0} is not a multiple of the {ty} block size {block}"
    )]
    NotBlockMultiple {
        name: String,
        ty: String,
        ne0: u64,
        block: u64,
    },
    #[error("tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {name:?}: data [{offset}, {offset}+{size}) lies outside the data section ({data_len} bytes)"
    )]
    OutOfBounds {
        name: String,
        offset: u64,
        size: u64,
        data_len: u64,
    },
    #[error("tensors {first:?} and {second:?} overlap in the data section")]
    Overlap { first: String, second: String },
    #[error("data section starts at {data_start}, past the end of the file ({file_len} bytes)")]
    DataSectionMissing { data_start: u64, file_len: u64 },
    #[error("tensor {name:?} not found")]
    TensorNotFound { name: String },
    #[error("{path}: split model: {msg}")]
    Split { path: PathBuf, msg: String },
    #[error("{path}: {err}")]
    Shard { path: PathBuf, err: Box<GgufError> },
    #[error("{path}: shard missing (opening {given}, a model split in {count} files)")]
    MissingShard {
        path: PathBuf,
        count: usize,
        given: PathBuf,
    },
    #[error("tensor {name:?} appears in two shards: {first} and {second}")]
    SplitDuplicateTensor {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("writer: {0}")]
    Writer(String),
}

impl GgufError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        GgufError::Io {
            path: path.into(),
            err: source,
        }
    }
}
