//! The reader: parses and validates a GGUF header from bytes (normally an mmap),
//! and hands out zero-copy views of tensor data.
//!
//! Every count read from the file is checked against the bytes that remain before
//! anything is allocated, so a corrupt or hostile file costs at most its own size in
//! memory and never panics.

use crate::error::{GgufError, Result};
use crate::ggml_type::GgmlType;
use crate::value::{Array, Metadata, Value, ValueType};
use crate::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_NESTING, MAX_DIMS};
use std::collections::HashMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// Dimensions, fastest-varying first (ggml `ne` order).
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes (computed from dims and type).
    pub size: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Number of rows: the product of all dims but the first.
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Bytes in one row (along dim 0).
    pub fn row_bytes(&self) -> u64 {
        self.ggml_type
            .row_bytes(self.dims.first().copied().unwrap_or(1))
            .unwrap_or(0)
    }
}

/// A parsed and validated GGUF header.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Metadata,
    /// Tensor directory in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of every tensor's offset.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    /// Length of the data section (to the end of the file).
    pub data_len: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos as u64;
        let len = self.u64(&|| format!("length of {}", what()))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what: what(),
            offset: at,
        })
    }

    /// Check that `count` items of at least `min_size` bytes each can still be in the file.
    fn check_count(&self, count: u64, min_size: u64, what: &dyn Fn() -> String) -> Result<()> {
        match count.checked_mul(min_size) {
            Some(bytes) if bytes <= self.remaining() => Ok(()),
            _ => Err(GgufError::CountTooLarge {
                what: what(),
                offset: self.pos as u64,
                count,
                remaining: self.remaining(),
            }),
        }
    }

    fn value(&mut self, key: &str, ty: ValueType, depth: usize) -> Result<Value> {
        let what = || format!("value of {key:?}");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => Value::Bool(self.array::<1>(&what)?[0] != 0),
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(GgufError::NestingTooDeep {
                        key: key.to_string(),
                        max: MAX_ARRAY_NESTING,
                    });
                }
                let at = self.pos as u64;
                let type_id = self.u32(&|| format!("array element type of {key:?}"))?;
                let elem_type =
                    ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                        key: key.to_string(),
                        offset: at,
                        type_id,
                    })?;
                let count = self.u64(&|| format!("array length of {key:?}"))?;
                self.check_count(count, elem_type.min_encoded_size(), &|| {
                    format!("array {key:?} of {elem_type}")
                })?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(key, elem_type, depth + 1)?);
                }
                Value::Array(Array { elem_type, items })
            }
        })
    }
}

/// Parse and validate the header of a GGUF file held in `buf`.
pub fn parse_header(buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array(&|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".into())?;
    match version {
        2 | 3 => {}
        v if v != 0 && v & 0xffff == 0 => return Err(GgufError::BigEndian { found: v }),
        v => return Err(GgufError::UnsupportedVersion { found: v }),
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;
    // Every key/value needs at least 8 (key length) + 4 (type) + 1 bytes.
    c.check_count(n_kv, 13, &|| "metadata entries".into())?;

    let mut metadata = Metadata::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let at = c.pos as u64;
        let type_id = c.u32(&|| format!("value type of {key:?}"))?;
        let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            key: key.clone(),
            offset: at,
            type_id,
        })?;
        let value = c.value(&key, ty, 0)?;
        metadata.insert(key, value)?;
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) => *a as u64,
        Some(v) => {
            return Err(GgufError::WrongType {
                key: "general.alignment".into(),
                expected: "u32".into(),
                found: v.type_description(),
            });
        }
    };
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment { value: alignment });
    }

    // Every tensor info needs at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
    c.check_count(n_tensors, 24, &|| "tensor infos".into())?;
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names: HashMap<String, usize> = HashMap::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        let n_dims = c.u32(&|| format!("dimension count of tensor {name:?}"))?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(c.u64(&|| format!("dimension {d} of tensor {name:?}"))?);
        }
        let type_id = c.u32(&|| format!("type of tensor {name:?}"))?;
        let offset = c.u64(&|| format!("data offset of tensor {name:?}"))?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownGgmlType {
            name: name.clone(),
            type_id,
        })?;
        let size = tensor_size(&name, &dims, ggml_type)?;
        if offset % alignment != 0 {
            return Err(GgufError::Misaligned {
                name,
                offset,
                alignment,
            });
        }
        if names.insert(name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor { name });
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            size,
        });
    }

    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    if data_start > file_len {
        if tensors.is_empty() {
            return Ok(Header {
                version,
                metadata,
                tensors,
                alignment,
                data_start: file_len,
                data_len: 0,
            });
        }
        return Err(GgufError::DataSectionMissing {
            data_start,
            file_len,
        });
    }
    let data_len = file_len - data_start;
    for t in &tensors {
        let end = t.offset.checked_add(t.size);
        if end.is_none_or(|e| e > data_len) {
            return Err(GgufError::OutOfBounds {
                name: t.name.clone(),
                offset: t.offset,
                size: t.size,
                data_len,
            });
        }
    }
    let mut order: Vec<usize> = (0..tensors.len())
        .filter(|&i| tensors[i].size > 0)
        .collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        if a.offset + a.size > b.offset {
            return Err(GgufError::Overlap {
                first: a.name.clone(),
                second: b.name.clone(),
            });
        }
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_start,
        data_len,
    })
}

/// Bytes of a tensor of `dims` and `ty`, checking block multiples and overflow.
pub fn tensor_size(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64> {
    let overflow = || GgufError::DimOverflow {
        name: name.to_string(),
        dims: dims.to_vec(),
    };
    let ne0 = dims.first().copied().unwrap_or(1);
    let block = ty.block_size() as u64;
    if ne0 % block != 0 {
        return Err(GgufError::NotBlockMultiple {
            name: name.to_string(),
            ty: ty.name().to_string(),
            ne0,
            block,
        });
    }
    let mut n: u64 = 1;
    for &d in dims {
        n = n.checked_mul(d).ok_or_else(overflow)?;
    }
    // ggml keeps element counts in int64.
    if n > i64::MAX as u64 {
        return Err(overflow());
    }
    (n / block)
        .checked_mul(ty.type_size() as u64)
        .ok_or_else(overflow)
}

/// A GGUF file: the validated header over its bytes (an mmap, or any byte buffer).
pub struct Gguf<B: Deref<Target = [u8]>> {
    bytes: B,
    header: Header,
    by_name: HashMap<String, usize>,
    paths: Vec<PathBuf>,
}

/// A GGUF file mapped from disk: one file, or every shard of a split model
/// (see [`crate::split`]).
pub type GgufFile = Gguf<crate::split::Mapping>;

impl GgufFile {
    /// Map `path` and validate it. When `path` is a shard of a split model
    /// (`NAME-00002-of-00003.gguf`, with `split.*` keys), every shard is
    /// mapped and checked, and the result is the whole model: one directory
    /// of tensors over one contiguous run of bytes, the first shard's metadata.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        crate::split::open(path.as_ref())
    }
}

impl<B: Deref<Target = [u8]>> Gguf<B> {
    /// Validate a GGUF image held in `bytes`.
    pub fn from_bytes(bytes: B) -> Result<Self> {
        let header = parse_header(&bytes)?;
        Ok(Self::assemble(bytes, header, Vec::new()))
    }

    /// A validated header over its bytes, from the files at `paths`.
    pub(crate) fn assemble(bytes: B, header: Header, paths: Vec<PathBuf>) -> Self {
        let by_name = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Gguf {
            bytes,
            header,
            by_name,
            paths,
        }
    }

    pub(crate) fn set_paths(&mut self, paths: Vec<PathBuf>) {
        self.paths = paths;
    }

    /// The files the model was read from: one, or every shard of a split
    /// model in order; none when it was made from bytes in memory.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Number of files the model spans (1 unless split).
    pub fn shard_count(&self) -> usize {
        self.paths.len().max(1)
    }

    /// The header (version, metadata, tensor directory, layout).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }

    /// The tensor directory in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.by_name
            .get(name)
            .map(|&i| &self.header.tensors[i])
            .ok_or_else(|| GgufError::TensorNotFound {
                name: name.to_string(),
            })
    }

    /// Whether a tensor named `name` exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Zero-copy view of a tensor's bytes.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor(name)?;
        Ok(self.data_of(t))
    }

    /// Zero-copy view of the bytes of a tensor from this file's directory.
    pub fn data_of(&self, t: &TensorInfo) -> &[u8] {
        // Validated in parse_header: offset + size <= data_len.
        let start = (self.header.data_start + t.offset) as usize;
        &self.bytes[start..start + t.size as usize]
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}
