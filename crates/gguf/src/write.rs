//! The writer: lays out header, metadata, tensor infos and aligned data, and
//! streams tensor data to disk one piece at a time.
//!
//! The file is written to `PATH.partial` and renamed into place by
//! [`DataWriter::finish`], so an interrupted write never leaves a file that looks
//! complete.

use crate::error::{GgufError, Result};
use crate::ggml_type::GgmlType;
use crate::read::{TensorInfo, tensor_size};
use crate::value::{Metadata, Value};
use crate::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Collects metadata and the tensor directory, then writes the file.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    names: HashSet<String>,
}

impl GgufWriter {
    /// An empty file description.
    pub fn new() -> Self {
        Self::default()
    }

    /// Start from existing metadata (e.g. to rewrite a file).
    pub fn with_metadata(metadata: Metadata) -> Self {
        GgufWriter {
            metadata,
            ..Self::default()
        }
    }

    /// The metadata to be written.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Mutable access to the metadata to be written.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Add (or replace) a metadata value.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<Value>) {
        self.metadata.set(key, value);
    }

    /// The alignment the file will use (`general.alignment`, default 32).
    pub fn alignment(&self) -> Result<u64> {
        let a = match self.metadata.get("general.alignment") {
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
        if a == 0 || !a.is_power_of_two() {
            return Err(GgufError::BadAlignment { value: a });
        }
        Ok(a)
    }

    /// Declare a tensor; data is written later, in declaration order.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<()> {
        let name = name.into();
        if dims.len() > MAX_DIMS as usize {
            return Err(GgufError::TooManyDims {
                name,
                n_dims: dims.len() as u32,
                max: MAX_DIMS,
            });
        }
        if !self.names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor { name });
        }
        let size = tensor_size(&name, dims, ty)?;
        // Offsets are assigned when the header is encoded (they depend on alignment).
        self.tensors.push(TensorInfo {
            name,
            dims: dims.to_vec(),
            ggml_type: ty,
            offset: 0,
            size,
        });
        Ok(())
    }

    /// The declared tensors.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Assign offsets and encode everything up to the start of the data section.
    fn layout(&self) -> Result<(Vec<u8>, Vec<TensorInfo>, u64)> {
        let alignment = self.alignment()?;
        let mut tensors = self.tensors.clone();
        let mut off = 0u64;
        for t in &mut tensors {
            t.offset = off;
            off = (off + t.size).div_ceil(alignment) * alignment;
        }
        let mut h = Vec::new();
        h.extend_from_slice(&GGUF_MAGIC);
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in self.metadata.iter() {
            put_str(&mut h, k);
            h.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut h, k, v)?;
        }
        for t in &tensors {
            put_str(&mut h, &t.name);
            h.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            h.extend_from_slice(&t.offset.to_le_bytes());
        }
        let pad = (h.len() as u64).div_ceil(alignment) * alignment - h.len() as u64;
        h.resize(h.len() + pad as usize, 0);
        Ok((h, tensors, alignment))
    }

    /// Encode a whole file in memory (for tests and small files). `data` gives each
    /// declared tensor's bytes, in declaration order.
    pub fn to_bytes(&self, data: &[&[u8]]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut w = DataWriter::start(self, Box::new(&mut out), None)?;
        for (t, d) in self.tensors.iter().zip(data) {
            w.write_tensor(&t.name, d)?;
        }
        w.finish()?;
        Ok(out)
    }

    /// Write the header to `PATH.partial` and return a writer for the tensor data.
    pub fn create(&self, path: impl AsRef<Path>) -> Result<DataWriter<'static>> {
        let path = path.as_ref().to_path_buf();
        let mut tmp = path.clone().into_os_string();
        tmp.push(".partial");
        let tmp = PathBuf::from(tmp);
        let file = File::create(&tmp).map_err(|e| GgufError::io(&tmp, e))?;
        let sink = Box::new(BufWriter::with_capacity(1 << 20, file));
        DataWriter::start(self, sink, Some((tmp, path)))
    }
}

fn put_str(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

fn put_value(h: &mut Vec<u8>, key: &str, v: &Value) -> Result<()> {
    match v {
        Value::U8(x) => h.push(*x),
        Value::I8(x) => h.push(*x as u8),
        Value::U16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => h.push(*x as u8),
        Value::String(s) => put_str(h, s),
        Value::Array(a) => {
            h.extend_from_slice(&(a.elem_type as u32).to_le_bytes());
            h.extend_from_slice(&(a.items.len() as u64).to_le_bytes());
            for item in &a.items {
                if item.value_type() != a.elem_type {
                    return Err(GgufError::WrongType {
                        key: key.to_string(),
                        expected: format!("array items of type {}", a.elem_type),
                        found: item.type_description(),
                    });
                }
                put_value(h, key, item)?;
            }
        }
    }
    Ok(())
}

/// Streams tensor data after the header; created by [`GgufWriter::create`].
pub struct DataWriter<'a> {
    sink: Box<dyn Write + 'a>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    next: usize,
    in_tensor: u64,
    pos: u64,
    paths: Option<(PathBuf, PathBuf)>,
    done: bool,
}

impl<'a> DataWriter<'a> {
    fn start(
        w: &GgufWriter,
        mut sink: Box<dyn Write + 'a>,
        paths: Option<(PathBuf, PathBuf)>,
    ) -> Result<Self> {
        let (header, tensors, alignment) = w.layout()?;
        let name = paths.as_ref().map(|p| p.0.clone()).unwrap_or_default();
        sink.write_all(&header)
            .map_err(|e| GgufError::io(&name, e))?;
        Ok(DataWriter {
            sink,
            tensors,
            alignment,
            next: 0,
            in_tensor: 0,
            pos: 0,
            paths,
            done: false,
        })
    }

    fn io_err(&self, e: std::io::Error) -> GgufError {
        let name = self.paths.as_ref().map(|p| p.0.clone()).unwrap_or_default();
        GgufError::io(name, e)
    }

    /// The tensor whose data comes next, if any.
    pub fn next_tensor(&self) -> Option<&TensorInfo> {
        self.tensors.get(self.next)
    }

    /// Append a piece of the current tensor's data. Pieces of one tensor must add up
    /// to exactly its size; the writer moves to the next tensor when one is complete.
    pub fn write_piece(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(t) = self.tensors.get(self.next) else {
            return Err(GgufError::Writer(format!(
                "{} bytes written after the last tensor",
                bytes.len()
            )));
        };
        if self.in_tensor + bytes.len() as u64 > t.size {
            return Err(GgufError::Writer(format!(
                "tensor {:?}: {} bytes written, but its size is {}",
                t.name,
                self.in_tensor + bytes.len() as u64,
                t.size
            )));
        }
        self.sink.write_all(bytes).map_err(|e| self.io_err(e))?;
        self.in_tensor += bytes.len() as u64;
        self.pos += bytes.len() as u64;
        if self.in_tensor == t.size {
            self.next += 1;
            self.in_tensor = 0;
            self.pad()?;
        }
        Ok(())
    }

    fn pad(&mut self) -> Result<()> {
        // Pad only between tensors: the file ends right after the last tensor's data,
        // as ggml writes it.
        if self.next < self.tensors.len() {
            let target = self.tensors[self.next].offset;
            debug_assert!(target >= self.pos);
            let zeros = vec![0u8; (target - self.pos) as usize];
            self.sink.write_all(&zeros).map_err(|e| self.io_err(e))?;
            self.pos = target;
        }
        Ok(())
    }

    /// Write the whole data of tensor `name`, which must be the next one declared.
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        match self.tensors.get(self.next) {
            Some(t) if t.name == name && self.in_tensor == 0 => {
                if bytes.len() as u64 != t.size {
                    return Err(GgufError::Writer(format!(
                        "tensor {name:?}: got {} bytes, expected {}",
                        bytes.len(),
                        t.size
                    )));
                }
                if t.size == 0 {
                    self.next += 1;
                    return self.pad();
                }
                self.write_piece(bytes)
            }
            Some(t) => Err(GgufError::Writer(format!(
                "tensor {name:?} written out of order: next expected is {:?}",
                t.name
            ))),
            None => Err(GgufError::Writer(format!(
                "tensor {name:?} written after the last one"
            ))),
        }
    }

    /// The alignment in use.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Check that every tensor was written, flush, and move the file into place.
    pub fn finish(self) -> Result<()> {
        if let Some((tmp, path)) = self.finish_pending()? {
            std::fs::rename(&tmp, &path).map_err(|e| GgufError::io(&path, e))?;
        }
        Ok(())
    }

    /// [`DataWriter::finish`] short of the rename: the file is complete and
    /// closed under its temporary name, returned with its final one (`None`
    /// for an in-memory sink). The caller renames it (or removes it).
    pub(crate) fn finish_pending(mut self) -> Result<Option<(PathBuf, PathBuf)>> {
        while self.next < self.tensors.len() && self.tensors[self.next].size == 0 {
            self.next += 1;
        }
        if self.next != self.tensors.len() {
            return Err(GgufError::Writer(format!(
                "finished before tensor {:?} was written",
                self.tensors[self.next].name
            )));
        }
        self.sink.flush().map_err(|e| self.io_err(e))?;
        self.done = true;
        // Drop the sink so the file is closed before any rename.
        self.sink = Box::new(std::io::sink());
        Ok(self.paths.take())
    }
}

impl Drop for DataWriter<'_> {
    fn drop(&mut self) {
        if !self.done
            && let Some((tmp, _)) = &self.paths
        {
            let _ = std::fs::remove_file(tmp);
        }
    }
}
