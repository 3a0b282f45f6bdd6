//! The paged KV cache on the device: one attention layer's keys and values of
//! one sequence in blocks of [`KV_BLOCK`] positions (the CPU cache's
//! blocks, so the scheduler's budget counts the same bytes on both), found
//! through a block table the kernels read (`kv_block_base` in
//! `kernels/attention.cu`).
//!
//! A block is allocated when the sequence first writes a position in it
//! ([`KvPages::reserve`]), so a state costs the blocks it has reached, not
//! its whole context. Forking a state ([`KvPages::fork`]) shares every block
//! it holds; the first write to a shared block (by either state) copies it
//! first, so a prefix served from the cache costs its recurrent states and
//! the table, not the KV rows. The table lives on the device at a fixed
//! address for the state's life, so a recorded step replays over blocks
//! allocated after it was recorded.

use crate::device::{Device, addr, drv};
use crate::error::{CudaError, Result};
use cudarc::driver::CudaSlice;
use samesum_engine::state::KV_BLOCK;
use std::sync::Arc;

/// One block: [`KV_BLOCK`] key rows, then as many value rows.
struct Block(CudaSlice<u8>);

/// One layer's cache of one sequence.
pub(super) struct KvPages {
    /// Block `b` (positions `b * KV_BLOCK ..`), where allocated.
    blocks: Vec<Option<Arc<Block>>>,
    /// Bytes of one row (`kvw` values of the cache's type).
    row: usize,
    /// The table as the device holds it: the blocks' key addresses, then
    /// their value addresses (0 where none).
    host: Vec<u64>,
    /// The table on the device.
    table: CudaSlice<u64>,
}

impl KvPages {
    /// An empty cache of `cap` blocks of rows of `row` bytes.
    pub(super) fn new(dev: &Device, cap: usize, row: usize) -> Result<KvPages> {
        Ok(KvPages {
            blocks: vec![None; cap],
            row,
            host: vec![0; 2 * cap],
            table: dev.zeros::<u64>(2 * cap)?,
        })
    }

    /// Blocks the table holds.
    pub(super) fn cap(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks allocated (shared ones included), and those shared with
    /// another state.
    fn counts(&self) -> (usize, usize) {
        let held = self.blocks.iter().flatten();
        let shared = held.clone().filter(|b| Arc::strong_count(b) > 1).count();
        (held.count(), shared)
    }

    /// The key table's device address (the kernels' `kt`).
    pub(super) fn kt(&self, dev: &Device) -> u64 {
        addr(dev, &self.table)
    }

    /// The value table's device address (the kernels' `vt`).
    pub(super) fn vt(&self, dev: &Device) -> u64 {
        addr(dev, &self.table) + (8 * self.cap()) as u64
    }

    fn block_bytes(&self) -> usize {
        KV_BLOCK * self.row
    }

    /// Make positions `from..to` writable: allocate the blocks they fall in
    /// and copy those another state shares, then write the table entries
    /// that changed (on the current stream, before the launches that read
    /// them). Nothing runs when every block is present and owned.
    pub(super) fn reserve(&mut self, dev: &Device, from: usize, to: usize) -> Result<()> {
        if to <= from {
            return Ok(());
        }
        let (b0, b1) = (from / KV_BLOCK, to.div_ceil(KV_BLOCK));
        if b1 > self.cap() {
            return Err(CudaError::Driver {
                op: "reserve KV blocks".into(),
                msg: format!(
                    "positions up to {to} need {b1} blocks of {KV_BLOCK}; the cache holds {}",
                    self.cap()
                ),
            });
        }
        // Keys then values. The new blocks are made first and taken only
        // once the device's table points at them, so a failure leaves the
        // cache as it was (the device table and this one agree).
        let bytes = 2 * self.block_bytes();
        let mut made = Vec::new();
        for b in b0..b1 {
            let fresh = match &self.blocks[b] {
                Some(blk) if Arc::strong_count(blk) == 1 => continue,
                // Shared: this state's writes go to a copy of its own.
                Some(blk) => {
                    let mut dst = dev.scratch::<u8>(bytes)?;
                    dev.current()
                        .memcpy_dtod(&blk.0, &mut dst)
                        .map_err(|x| drv("copy a shared KV block", x))?;
                    dst
                }
                None => dev.zeros::<u8>(bytes)?,
            };
            made.push((b, fresh));
        }
        let (Some(&(lo, _)), Some(&(last, _))) = (made.first(), made.last()) else {
            return Ok(());
        };
        let (hi, cap) = (last + 1, self.cap());
        let mut host = self.host.clone();
        for (b, fresh) in &made {
            let base = addr(dev, fresh);
            host[*b] = base;
            host[cap + *b] = base + (bytes / 2) as u64;
        }
        self.upload(dev, &host, lo, hi)?;
        self.host = host;
        for (b, fresh) in made {
            self.blocks[b] = Some(Arc::new(Block(fresh)));
        }
        Ok(())
    }

    /// Copy entries `lo..hi` (keys and values) of `host`, this cache's
    /// table as it is to be, to the device.
    fn upload(&mut self, dev: &Device, host: &[u64], lo: usize, hi: usize) -> Result<()> {
        let cap = self.cap();
        for at in [lo, cap + lo] {
            let n = hi - lo;
            let mut dst = self.table.slice_mut(at..at + n);
            dev.current()
                .memcpy_htod(&host[at..at + n], &mut dst)
                .map_err(|x| drv("copy the KV block table", x))?;
        }
        Ok(())
    }

    /// A cache of `cap` blocks sharing this one's blocks that hold
    /// positions below `pos` (the rest of the fork's blocks come as it
    /// writes).
    pub(super) fn fork(&self, dev: &Device, cap: usize, pos: usize) -> Result<KvPages> {
        let mut f = KvPages::new(dev, cap, self.row)?;
        let used = pos.div_ceil(KV_BLOCK).min(self.cap());
        if used > cap {
            return Err(CudaError::Driver {
                op: "fork a KV cache".into(),
                msg: format!("{pos} positions in a cache of {cap} blocks"),
            });
        }
        for b in 0..used {
            if let Some(blk) = &self.blocks[b] {
                f.blocks[b] = Some(Arc::clone(blk));
                f.host[b] = self.host[b];
                f.host[cap + b] = self.host[self.cap() + b];
            }
        }
        if used > 0 {
            let host = f.host.clone();
            f.upload(dev, &host, 0, used)?;
        }
        Ok(f)
    }

    /// Rows `0..pos` of the keys and of the values, each `row` bytes a
    /// position, read back from the blocks (synchronizes). Rows of a block
    /// never reached read as zeros, as on the CPU (a layer's cache the
    /// sequence's calls never wrote, in the op tests).
    pub(super) fn download(&self, dev: &Device, pos: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        let mut k = Vec::with_capacity(pos * self.row);
        let mut v = Vec::with_capacity(pos * self.row);
        // A block holds its key rows, then its value rows.
        let half = self.block_bytes();
        for b in 0..pos.div_ceil(KV_BLOCK) {
            let n = (pos - b * KV_BLOCK).min(KV_BLOCK) * self.row;
            match self.blocks.get(b).and_then(|x| x.as_ref()) {
                Some(blk) => {
                    let bytes = dev.download(&blk.0, 2 * half)?;
                    k.extend_from_slice(&bytes[..n]);
                    v.extend_from_slice(&bytes[half..half + n]);
                }
                None => {
                    k.resize(k.len() + n, 0);
                    v.resize(v.len() + n, 0);
                }
            }
        }
        Ok((k, v))
    }
}

/// A block table over contiguous key and value rows (`rows` of `row` bytes
/// each, from `k` and `v`): the layout the kernels read, for callers whose
/// rows are one buffer (the kernel tests). Returns the table's `kt` and
/// `vt` device addresses and the table itself (keep it alive while they are
/// in use).
pub(super) fn contiguous_table(
    dev: &Device,
    k: &CudaSlice<u8>,
    v: &CudaSlice<u8>,
    rows: usize,
    row: usize,
) -> Result<(u64, u64, CudaSlice<u64>)> {
    let nb = rows.div_ceil(KV_BLOCK).max(1);
    let step = (KV_BLOCK * row) as u64;
    let (ka, va) = (addr(dev, k), addr(dev, v));
    let host: Vec<u64> = (0..nb as u64)
        .map(|b| ka + b * step)
        .chain((0..nb as u64).map(|b| va + b * step))
        .collect();
    let t = dev.upload(&host)?;
    let kt = addr(dev, &t);
    Ok((kt, kt + (8 * nb) as u64, t))
}

impl super::CudaState {
    /// Make the state's next `n` positions writable in every attention
    /// layer ([`KvPages::reserve`]).
    pub(super) fn reserve_kv(&mut self, dev: &Device, n: usize) -> Result<()> {
        let (from, to) = (self.pos, self.pos + n);
        for p in self.kv.iter_mut().flatten() {
            p.reserve(dev, from, to)?;
        }
        Ok(())
    }
}

impl super::Cuda {
    /// A state's KV blocks over its attention layers: those it holds and,
    /// of them, those shared with another state (for the tests).
    #[doc(hidden)]
    pub fn kv_blocks(&self, st: &super::CudaState) -> (usize, usize) {
        st.kv.iter().flatten().fold((0, 0), |(a, s), p| {
            let (pa, ps) = p.counts();
            (a + pa, s + ps)
        })
    }
}
