//! Split GGUF files as llama.cpp's `gguf-split` writes them: a model in
//! `NAME-00001-of-0000N.gguf` ... `NAME-0000N-of-0000N.gguf`.
//!
//! The first shard carries all the metadata; every shard carries `split.no`
//! (u16, 0-based), `split.count` (u16) and `split.tensors.count` (i32, the
//! total number of tensors) and its own tensors. Opening any shard opens all
//! of them as one file: each shard is mapped at a page-aligned place inside one
//! reserved range of addresses, so the model's bytes stay one contiguous slice
//! (tensor offsets are absolute in it, the gaps between shards read as zeros)
//! and nothing downstream of the reader knows the model was split.
//!
//! Checks: the names follow the pattern, every shard exists, each shard's
//! `split.no` matches its place, the counts agree, no tensor appears twice,
//! and the tensors add up to `split.tensors.count`.
//!
//! [`SplitWriter`] writes such files: the tensors in order, at most a given
//! number a shard, every shard renamed into place only once all are complete.

use crate::error::{GgufError, Result};
use crate::read::{Gguf, GgufFile, Header, TensorInfo, parse_header};
use crate::value::Metadata;
use crate::write::{DataWriter, GgufWriter};
use std::collections::HashMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// Key of a shard's 0-based number (u16).
pub const KEY_SPLIT_NO: &str = "split.no";
/// Key of the number of shards (u16).
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// Key of the total number of tensors over all shards (i32).
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// The path of shard `no` (0-based) of `count` for the prefix `prefix`:
/// `PREFIX-00001-of-00003.gguf`, as llama.cpp's `llama_split_path`.
pub fn split_path(prefix: &Path, no: usize, count: usize) -> PathBuf {
    let mut s = prefix.as_os_str().to_os_string();
    s.push(format!("-{:05}-of-{:05}.gguf", no + 1, count));
    PathBuf::from(s)
}

/// The prefix `split_path` would extend to name the shards of `output`:
/// `output` without a trailing `.gguf`.
pub fn split_prefix(output: &Path) -> PathBuf {
    match output.to_str().and_then(|s| s.strip_suffix(".gguf")) {
        Some(p) => PathBuf::from(p),
        None => output.to_path_buf(),
    }
}

/// A shard's name taken apart: `(prefix, no (0-based), count)`, or `None` when
/// the name is not `PREFIX-NNNNN-of-MMMMM.gguf` with 1 <= NNNNN <= MMMMM.
pub fn parse_split_path(path: &Path) -> Option<(PathBuf, usize, usize)> {
    let s = path.to_str()?;
    let stem = s.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |d: &str| d.len() == 5 && d.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) || prefix.is_empty() {
        return None;
    }
    let (no, count): (usize, usize) = (no.parse().ok()?, count.parse().ok()?);
    if no == 0 || no > count {
        return None;
    }
    Some((PathBuf::from(prefix), no - 1, count))
}

/// The split keys of a shard's metadata: `(no, count, tensors)`, `None` when
/// the file carries no `split.count` (not a split file).
fn split_keys(m: &Metadata, path: &Path) -> Result<Option<(u64, u64, u64)>> {
    if m.get(KEY_SPLIT_COUNT).is_none() {
        return Ok(None);
    }
    let get = |k: &str| {
        m.get_uint(k).map_err(|e| GgufError::Split {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })
    };
    Ok(Some((
        get(KEY_SPLIT_NO)?,
        get(KEY_SPLIT_COUNT)?,
        get(KEY_SPLIT_TENSORS_COUNT)?,
    )))
}

/// The bytes of an opened model: one file's map, or a split model's shards
/// mapped side by side.
pub struct Mapping(Inner);

enum Inner {
    File(memmap2::Mmap),
    Span(span::Span),
}

impl From<memmap2::Mmap> for Mapping {
    fn from(m: memmap2::Mmap) -> Self {
        Mapping(Inner::File(m))
    }
}

impl Deref for Mapping {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Inner::File(m) => m,
            Inner::Span(s) => s,
        }
    }
}

/// Open `path`, and when it is a shard of a split model, every shard.
pub(crate) fn open(path: &Path) -> Result<GgufFile> {
    let first = open_one(path)?;
    let Some((no, count, total)) = split_keys(first.metadata(), path)? else {
        return Ok(first);
    };
    let split_err = |msg: String| GgufError::Split {
        path: path.to_path_buf(),
        msg,
    };
    if count == 0 || count > u16::MAX as u64 {
        return Err(split_err(format!("split.count = {count} is out of range")));
    }
    if count == 1 {
        if no != 0 || total != first.tensors().len() as u64 {
            return Err(split_err(format!(
                "one shard of one, but split.no = {no} and split.tensors.count = {total} for {} tensors",
                first.tensors().len()
            )));
        }
        return Ok(first);
    }
    let count = count as usize;
    let Some((prefix, name_no, name_count)) = parse_split_path(path) else {
        return Err(split_err(format!(
            "the file is shard {} of {count} (split.no = {no}), but its name does not follow NAME-{:05}-of-{count:05}.gguf",
            no + 1,
            no + 1
        )));
    };
    if name_count != count || name_no as u64 != no {
        return Err(split_err(format!(
            "the name says shard {} of {name_count}, the metadata says shard {} of {count} (split.no = {no})",
            name_no + 1,
            no + 1
        )));
    }
    drop(first);
    let paths: Vec<PathBuf> = (0..count).map(|i| split_path(&prefix, i, count)).collect();
    let mut files = Vec::with_capacity(count);
    for p in &paths {
        let f = open_regular(p).map_err(|e| match e {
            GgufError::Io { path: missing, err } if err.kind() == std::io::ErrorKind::NotFound => {
                GgufError::MissingShard {
                    path: missing,
                    count,
                    given: path.to_path_buf(),
                }
            }
            e => e,
        })?;
        files.push(f);
    }
    let (span, starts) = span::map(&paths, &files)?;
    drop(files);
    let mut tensors: Vec<TensorInfo> = Vec::new();
    let mut owner: HashMap<String, usize> = HashMap::new();
    let mut metadata = Metadata::new();
    let (mut version, mut alignment) = (3, crate::DEFAULT_ALIGNMENT);
    for (i, p) in paths.iter().enumerate() {
        let (start, len) = starts[i];
        let shard_err = |e: GgufError| GgufError::Shard {
            path: p.clone(),
            err: Box::new(e),
        };
        let h = parse_header(&span[start..start + len]).map_err(shard_err)?;
        let Some((s_no, s_count, s_total)) = split_keys(&h.metadata, p)? else {
            return Err(GgufError::Split {
                path: p.clone(),
                msg: "no split.count: not a shard of a split model".into(),
            });
        };
        if s_no != i as u64 {
            return Err(GgufError::Split {
                path: p.clone(),
                msg: format!("split.no = {s_no}, but the name makes it {i}"),
            });
        }
        if s_count != count as u64 || s_total != total {
            return Err(GgufError::Split {
                path: p.clone(),
                msg: format!(
                    "split.count = {s_count}, split.tensors.count = {s_total}; shard {} of the same model says {count} and {total}",
                    no + 1
                ),
            });
        }
        for t in &h.tensors {
            if let Some(&j) = owner.get(&t.name) {
                return Err(GgufError::SplitDuplicateTensor {
                    name: t.name.clone(),
                    first: paths[j].clone(),
                    second: p.clone(),
                });
            }
            owner.insert(t.name.clone(), i);
            tensors.push(TensorInfo {
                offset: (start as u64) + h.data_start + t.offset,
                ..t.clone()
            });
        }
        if i == 0 {
            metadata = h.metadata;
            version = h.version;
            alignment = h.alignment;
        }
    }
    if tensors.len() as u64 != total {
        return Err(GgufError::Split {
            path: paths[0].clone(),
            msg: format!(
                "split.tensors.count = {total}, but the {count} shards hold {} tensors",
                tensors.len()
            ),
        });
    }
    let data_len = span.len() as u64;
    let header = Header {
        version,
        metadata,
        tensors,
        alignment,
        data_start: 0,
        data_len,
    };
    Ok(Gguf::assemble(Mapping(Inner::Span(span)), header, paths))
}

/// Open a regular file (a FIFO would block, a directory fails obscurely).
fn open_regular(path: &Path) -> Result<std::fs::File> {
    let meta = std::fs::metadata(path).map_err(|e| GgufError::io(path, e))?;
    if !meta.is_file() {
        return Err(GgufError::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file (a GGUF model is a file)",
            ),
        ));
    }
    std::fs::File::open(path).map_err(|e| GgufError::io(path, e))
}

/// Map one file and validate it.
fn open_one(path: &Path) -> Result<GgufFile> {
    let file = open_regular(path)?;
    // SAFETY: the map is read-only; the file may change underneath only if another
    // process rewrites it, which the GGUF workflow does not do.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| GgufError::io(path, e))?;
    let mut g = Gguf::from_bytes(Mapping::from(map))?;
    g.set_paths(vec![path.to_path_buf()]);
    Ok(g)
}

#[cfg(unix)]
mod span {
    //! The shards side by side in one reserved address range.

    use crate::error::{GgufError, Result};
    use std::os::fd::AsRawFd;
    use std::path::PathBuf;

    /// A read-only range of addresses holding every shard, each at a page
    /// boundary; unmapped as a whole when dropped.
    pub(super) struct Span {
        ptr: *mut u8,
        len: usize,
    }

    // SAFETY: the range is read-only and owned by this value.
    unsafe impl Send for Span {}
    // SAFETY: as above: nothing writes through it.
    unsafe impl Sync for Span {}

    impl std::ops::Deref for Span {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            // SAFETY: [ptr, ptr + len) is mapped readable for the life of self.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }

    impl Drop for Span {
        fn drop(&mut self) {
            // SAFETY: the range was mapped by `map` and is unmapped once.
            unsafe {
                libc::munmap(self.ptr.cast(), self.len);
            }
        }
    }

    /// Map `files` one after another; returns the span and each file's
    /// (start, length) in it.
    pub(super) fn map(
        paths: &[PathBuf],
        files: &[std::fs::File],
    ) -> Result<(Span, Vec<(usize, usize)>)> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let mut starts = Vec::with_capacity(files.len());
        let mut total = 0usize;
        for (p, f) in paths.iter().zip(files) {
            let len = f.metadata().map_err(|e| GgufError::io(p, e))?.len();
            let len = usize::try_from(len)
                .map_err(|_| GgufError::io(p, std::io::Error::other("file too large to map")))?;
            starts.push((total, len));
            total = len
                .div_ceil(page)
                .checked_mul(page)
                .and_then(|l| total.checked_add(l))
                .ok_or_else(|| GgufError::io(p, std::io::Error::other("shards too large")))?;
        }
        let total = total.max(page);
        // SAFETY: a fresh anonymous private mapping; the kernel picks the place.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(GgufError::io(&paths[0], e));
        }
        let span = Span {
            ptr: base.cast(),
            len: total,
        };
        for ((p, f), &(start, len)) in paths.iter().zip(files).zip(&starts) {
            if len == 0 {
                continue;
            }
            // SAFETY: [base + start, base + start + len) lies inside the range
            // reserved above and owned by `span`, so MAP_FIXED replaces only
            // our own anonymous pages; start is a page multiple.
            let at = unsafe {
                libc::mmap(
                    span.ptr.add(start).cast(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_FIXED,
                    f.as_raw_fd(),
                    0,
                )
            };
            if at == libc::MAP_FAILED {
                return Err(GgufError::io(p, std::io::Error::last_os_error()));
            }
        }
        Ok((span, starts))
    }
}

#[cfg(not(unix))]
mod span {
    //! The shards read side by side into memory (no fixed-address maps here).

    use crate::error::{GgufError, Result};
    use std::io::Read;
    use std::path::PathBuf;

    pub(super) type Span = Vec<u8>;

    pub(super) fn map(
        paths: &[PathBuf],
        files: &[std::fs::File],
    ) -> Result<(Span, Vec<(usize, usize)>)> {
        let mut out = Vec::new();
        let mut starts = Vec::new();
        for (p, mut f) in paths.iter().zip(files) {
            let start = out.len();
            f.read_to_end(&mut out).map_err(|e| GgufError::io(p, e))?;
            starts.push((start, out.len() - start));
            out.resize(out.len().div_ceil(4096) * 4096, 0);
        }
        Ok((out, starts))
    }
}

/// Streams a model's tensors into shards of at most `max_tensors` tensors,
/// as llama.cpp's `gguf-split --split-max-tensors` lays them out: the first
/// shard with all the metadata, every shard with the `split.*` keys.
/// Each shard is written to `PATH.partial`; [`SplitWriter::finish`] renames
/// all of them into place once every one is complete, and dropping the
/// writer before that removes them.
pub struct SplitWriter {
    shards: Vec<GgufWriter>,
    paths: Vec<PathBuf>,
    current: Option<DataWriter<'static>>,
    next_shard: usize,
    pending: Vec<(PathBuf, PathBuf)>,
    done: bool,
}

impl SplitWriter {
    /// Plan the shards of `w`'s tensors, at most `max_tensors` each, named
    /// after `output` (`out.gguf` -> `out-00001-of-0000N.gguf`, ...).
    pub fn new(w: &GgufWriter, output: &Path, max_tensors: usize) -> Result<Self> {
        if max_tensors == 0 {
            return Err(GgufError::Writer(
                "a shard must hold at least one tensor".into(),
            ));
        }
        let n = w.tensors().len();
        let count = n.div_ceil(max_tensors).max(1);
        if count > u16::MAX as usize {
            return Err(GgufError::Writer(format!(
                "{n} tensors at {max_tensors} a shard make {count} shards (at most {})",
                u16::MAX
            )));
        }
        let total = i32::try_from(n).map_err(|_| {
            GgufError::Writer(format!("{n} tensors do not fit split.tensors.count"))
        })?;
        let prefix = split_prefix(output);
        let mut shards = Vec::with_capacity(count);
        for i in 0..count {
            let mut s = if i == 0 {
                GgufWriter::with_metadata(w.metadata().clone())
            } else {
                let mut s = GgufWriter::new();
                if let Some(a) = w.metadata().get("general.alignment") {
                    s.set("general.alignment", a.clone());
                }
                s
            };
            s.set(KEY_SPLIT_NO, i as u16);
            s.set(KEY_SPLIT_COUNT, count as u16);
            s.set(KEY_SPLIT_TENSORS_COUNT, total);
            let end = ((i + 1) * max_tensors).min(n);
            for t in &w.tensors()[(i * max_tensors).min(n)..end] {
                s.add_tensor(t.name.clone(), &t.dims, t.ggml_type)?;
            }
            shards.push(s);
        }
        let paths = (0..count).map(|i| split_path(&prefix, i, count)).collect();
        Ok(SplitWriter {
            shards,
            paths,
            current: None,
            next_shard: 0,
            pending: Vec::new(),
            done: false,
        })
    }

    /// The shards' final paths, in order.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// The writer of the shard the next tensor goes to, finishing (without
    /// renaming) the shards that are complete.
    fn writer(&mut self) -> Result<&mut DataWriter<'static>> {
        loop {
            if let Some(w) = &self.current
                && w.next_tensor().is_some()
            {
                break;
            }
            if let Some(w) = self.current.take()
                && let Some(p) = w.finish_pending()?
            {
                self.pending.push(p);
            }
            let Some(s) = self.shards.get(self.next_shard) else {
                return Err(GgufError::Writer(
                    "data written after the last tensor".into(),
                ));
            };
            self.current = Some(s.create(&self.paths[self.next_shard])?);
            self.next_shard += 1;
        }
        Ok(self.current.as_mut().expect("set above"))
    }

    /// The tensor whose data comes next, if any.
    pub fn next_tensor(&self) -> Option<&TensorInfo> {
        if let Some(t) = self.current.as_ref().and_then(|w| w.next_tensor()) {
            return Some(t);
        }
        self.shards[self.next_shard..]
            .iter()
            .find_map(|s| s.tensors().first())
    }

    /// Append a piece of the current tensor's data (see [`DataWriter::write_piece`]).
    pub fn write_piece(&mut self, bytes: &[u8]) -> Result<()> {
        self.writer()?.write_piece(bytes)
    }

    /// Write the whole data of tensor `name`, the next one declared.
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        self.writer()?.write_tensor(name, bytes)
    }

    /// Check that every tensor was written and move every shard into place.
    pub fn finish(mut self) -> Result<Vec<PathBuf>> {
        if let Some(w) = self.current.take()
            && let Some(p) = w.finish_pending()?
        {
            self.pending.push(p);
        }
        // Shards not started yet: only tensor-less (or all zero-size) ones may remain.
        while self.next_shard < self.shards.len() {
            let w = self.shards[self.next_shard].create(&self.paths[self.next_shard])?;
            self.next_shard += 1;
            if let Some(p) = w.finish_pending()? {
                self.pending.push(p);
            }
        }
        for (tmp, path) in &self.pending {
            std::fs::rename(tmp, path).map_err(|e| GgufError::io(path, e))?;
        }
        self.done = true;
        Ok(self.paths.clone())
    }
}

impl Drop for SplitWriter {
    fn drop(&mut self) {
        if !self.done {
            for (tmp, _) in &self.pending {
                let _ = std::fs::remove_file(tmp);
            }
        }
    }
}
