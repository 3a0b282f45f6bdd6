//! Tier mode on the device: the routed experts live in page-locked
//! host memory (the mapped file when page-locked memory runs out); decode
//! reads them through a per-layer VRAM cache of expert slots, prefill through
//! two staging buffers that a second stream fills one layer ahead.
//!
//! Nothing here changes what a kernel computes: the expert matmuls address a
//! row's weights as `base + mats[r] * stride` in both modes, and tier mode
//! only changes `base` (a slot pool or a staging buffer) and `mats` (slots in
//! decode, expert ids in a staged stack), so the bytes read, and therefore
//! the results, are the resident mode's.

use crate::device::{Device, addr as ptr, drv, upload_bar};
use crate::error::Result;
use crate::tier::{ExpertCache, TierPlan};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use samesum_engine::Model;
use samesum_engine::model::Matrix;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Where one layer's stacked expert tensor lives on the host.
enum HostCopy {
    /// Page-locked: copies run asynchronously at the bus's rate.
    Pinned(PinnedHostSlice<u8>),
    /// The mapped file at this offset (page-locked memory ran out): the
    /// driver stages these copies itself, synchronously and more slowly.
    Mapped(usize),
}

/// The routed experts of one layer: gate, up and down.
struct LayerExperts {
    host: [HostCopy; 3],
    /// Bytes of one expert of each tensor.
    one: [usize; 3],
    /// Bytes of each whole stack.
    whole: [usize; 3],
    /// The decode cache: `slots` experts of each tensor.
    pools: [CudaSlice<u8>; 3],
}

/// The two prefill staging buffers' bookkeeping.
#[derive(Default)]
struct Staging {
    /// The layer each buffer holds (or is being filled with).
    holds: [Option<usize>; 2],
    /// Recorded on the copy stream after each buffer's fill.
    filled: [Option<CudaEvent>; 2],
    /// Recorded on the compute stream after each buffer's last read.
    read: [Option<CudaEvent>; 2],
    /// The buffer the latest layer computed from.
    last: usize,
}

/// Counters of tier mode's traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Decode-cache lookups that found the expert resident.
    pub hits: u64,
    /// Decode-cache lookups that fetched the expert.
    pub misses: u64,
    /// Bytes copied from host memory into cache slots.
    pub fetched_bytes: u64,
    /// Bytes copied from host memory into staging buffers.
    pub staged_bytes: u64,
    /// Layers staged for prefill.
    pub staged_layers: u64,
}

/// The device side of tier mode for one model.
pub(crate) struct Tier {
    pub(crate) plan: TierPlan,
    layers: Vec<LayerExperts>,
    stage: [CudaSlice<u8>; 2],
    copy: Arc<CudaStream>,
    staging: Mutex<Staging>,
    cache: Mutex<ExpertCache>,
    /// Whether every expert stack is page-locked.
    pub(crate) pinned: bool,
    fetched: AtomicU64,
    staged: AtomicU64,
    staged_layers: AtomicU64,
}

fn stack_bytes(m: &Matrix) -> usize {
    m.rows * m.row_bytes * m.n_mats
}

/// A stack's start in a staging buffer keeps the file's alignment (and more).
fn aligned(n: usize) -> usize {
    n.next_multiple_of(256)
}

impl Tier {
    /// Copy `model`'s routed experts into page-locked host memory (falling
    /// back to the mapped file, with a warning, when that runs out) and
    /// allocate the cache pools and staging buffers `plan` sized.
    pub(crate) fn new(dev: &Device, model: &Model, plan: TierPlan, progress: bool) -> Result<Tier> {
        let bytes = model.bytes();
        let total: usize = model
            .w
            .layers
            .iter()
            .map(|l| stack_bytes(&l.moe.gate) + stack_bytes(&l.moe.up) + stack_bytes(&l.moe.down))
            .sum();
        let bar = upload_bar(progress, total as u64, "experts to host memory");
        let mut pinned = true;
        let mut layers = Vec::with_capacity(model.w.layers.len());
        let mut stage_bytes = 0;
        let mut done = 0u64;
        for l in &model.w.layers {
            let mats = [&l.moe.gate, &l.moe.up, &l.moe.down];
            let mut host = Vec::with_capacity(3);
            let mut one = [0; 3];
            let mut whole = [0; 3];
            let mut pools = Vec::with_capacity(3);
            for (i, m) in mats.iter().enumerate() {
                whole[i] = stack_bytes(m);
                one[i] = m.rows * m.row_bytes;
                let src = bytes.get(m.offset..m.offset + whole[i]).ok_or_else(|| {
                    drv(
                        "tier",
                        format!(
                            "{}: {} bytes at offset {} run past the file ({} bytes)",
                            m.name,
                            whole[i],
                            m.offset,
                            bytes.len()
                        ),
                    )
                })?;
                let copy = if pinned {
                    // SAFETY: every byte is written right below before any read.
                    match unsafe { dev.ctx.alloc_pinned::<u8>(whole[i]) } {
                        Ok(mut p) => {
                            p.as_mut_slice()
                                .map_err(|e| drv("tier: page-locked memory", e))?
                                .copy_from_slice(src);
                            Some(HostCopy::Pinned(p))
                        }
                        Err(e) => {
                            eprintln!(
                                "warning: page-locked host memory ran out after {} MiB ({e:?}); the remaining experts are copied from the mapped file (slower transfers)",
                                done >> 20
                            );
                            pinned = false;
                            None
                        }
                    }
                } else {
                    None
                };
                host.push(copy.unwrap_or(HostCopy::Mapped(m.offset)));
                // 16 bytes of slack: the tensor-core copies of formats whose
                // blocks are not 16-byte aligned read up to 15 bytes past a
                // slot's last block.
                pools.push(dev.scratch::<u8>(plan.slots * one[i] + 16)?);
                done += whole[i] as u64;
                bar.set_position(done);
            }
            stage_bytes = stage_bytes.max(whole.iter().map(|&w| aligned(w)).sum::<usize>());
            let three = || drv("tier", "a layer without gate, up and down expert stacks");
            let host: [HostCopy; 3] = host.try_into().map_err(|_| three())?;
            let pools: [CudaSlice<u8>; 3] = pools.try_into().map_err(|_| three())?;
            layers.push(LayerExperts {
                host,
                one,
                whole,
                pools,
            });
        }
        bar.finish_and_clear();
        // Slack as for the pools.
        let stage = [
            dev.scratch::<u8>(stage_bytes + 16)?,
            dev.scratch::<u8>(stage_bytes + 16)?,
        ];
        let copy = dev
            .ctx
            .new_stream()
            .map_err(|e| drv("tier: copy stream", e))?;
        // The buffers were allocated in the compute stream's order; the copy
        // stream writes the staging buffers, so let the allocations finish.
        dev.sync()?;
        Ok(Tier {
            cache: Mutex::new(ExpertCache::new(
                layers.len(),
                model.hp.n_expert,
                plan.slots,
            )),
            plan,
            layers,
            stage,
            copy,
            staging: Mutex::new(Staging::default()),
            pinned,
            fetched: AtomicU64::new(0),
            staged: AtomicU64::new(0),
            staged_layers: AtomicU64::new(0),
        })
    }

    /// Bytes of VRAM the cache pools and staging buffers take.
    pub(crate) fn vram_bytes(&self) -> usize {
        let pools: usize = self
            .layers
            .iter()
            .flat_map(|l| l.pools.iter())
            .map(|p| p.len())
            .sum();
        pools + self.stage.iter().map(|s| s.len()).sum::<usize>()
    }

    /// Whether a call of `m` rows routing `k` experts each runs through the
    /// decode cache (it holds every expert such a step can need) rather than
    /// a staged layer.
    pub(crate) fn uses_cache(&self, m: usize, k: usize) -> bool {
        m <= 16 && m * k <= self.plan.slots
    }

    /// Counters so far.
    pub(crate) fn stats(&self) -> TierStats {
        let c = self.cache.lock().expect("expert cache lock");
        TierStats {
            hits: c.hits,
            misses: c.misses,
            fetched_bytes: self.fetched.load(Ordering::Relaxed),
            staged_bytes: self.staged.load(Ordering::Relaxed),
            staged_layers: self.staged_layers.load(Ordering::Relaxed),
        }
    }

    /// Copy bytes `[at, at + len)` of tensor `k` of `layer` from the host
    /// store to device address `dst` on `stream`.
    fn h2d(
        &self,
        model: &Model,
        layer: usize,
        k: usize,
        at: usize,
        len: usize,
        dst: u64,
        stream: &CudaStream,
    ) -> Result<()> {
        let src: &[u8] = match &self.layers[layer].host[k] {
            HostCopy::Pinned(p) => &p
                .as_slice()
                .map_err(|e| drv("tier: page-locked memory", e))?[at..at + len],
            HostCopy::Mapped(off) => &model.bytes()[off + at..off + at + len],
        };
        // SAFETY: `dst` is inside a live pool or staging buffer with room for
        // `len` bytes (the callers compute it from the sizes above); `src` is
        // page-locked memory owned by self, or the model's mapping, which the
        // driver copies before returning.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }.map_err(
            |e| {
                drv(
                    format!("tier: copy {len} bytes of layer {layer}'s experts"),
                    e,
                )
            },
        )
    }

    /// Decode: make the experts `ids` (the step's expert ids, -1 = none) of
    /// `layer` resident in its cache, fetching misses on the compute stream.
    /// Returns the expert -> slot table (-1 for the others, `n_expert` long)
    /// and the three pools' addresses.
    pub(crate) fn fetch(
        &self,
        dev: &Device,
        model: &Model,
        layer: usize,
        ids: &[i32],
    ) -> Result<(Vec<i32>, [u64; 3])> {
        let (slots, fetches) = self
            .cache
            .lock()
            .expect("expert cache lock")
            .route(layer, ids)?;
        let le = &self.layers[layer];
        for f in &fetches {
            for k in 0..3 {
                let dst = ptr(dev, &le.pools[k]) + (f.slot as usize * le.one[k]) as u64;
                self.h2d(
                    model,
                    layer,
                    k,
                    f.expert as usize * le.one[k],
                    le.one[k],
                    dst,
                    &dev.stream,
                )?;
                self.fetched.fetch_add(le.one[k] as u64, Ordering::Relaxed);
            }
        }
        let mut table = vec![-1i32; model.hp.n_expert];
        for (&e, &s) in ids.iter().zip(&slots) {
            if e >= 0 {
                table[e as usize] = s;
            }
        }
        let bases = [0, 1, 2].map(|k| ptr(dev, &le.pools[k]));
        Ok((table, bases))
    }

    /// Fill staging buffer `b` with `layer`'s experts on the copy stream,
    /// after the compute stream's last read of it.
    fn fill(
        &self,
        dev: &Device,
        model: &Model,
        s: &mut Staging,
        b: usize,
        layer: usize,
    ) -> Result<()> {
        if let Some(ev) = &s.read[b] {
            self.copy
                .wait(ev)
                .map_err(|e| drv("tier: wait for the staging buffer", e))?;
        }
        let le = &self.layers[layer];
        let mut at = 0;
        for k in 0..3 {
            self.h2d(
                model,
                layer,
                k,
                0,
                le.whole[k],
                ptr(dev, &self.stage[b]) + at as u64,
                &self.copy,
            )?;
            self.staged.fetch_add(le.whole[k] as u64, Ordering::Relaxed);
            at += aligned(le.whole[k]);
        }
        self.staged_layers.fetch_add(1, Ordering::Relaxed);
        s.filled[b] = Some(
            self.copy
                .record_event(None)
                .map_err(|e| drv("tier: record the staging copy", e))?,
        );
        s.holds[b] = Some(layer);
        Ok(())
    }

    /// Prefill: `layer`'s experts in a staging buffer (filled now unless the
    /// previous layer already started it), the compute stream ordered after
    /// the fill. Returns the buffer and the gate, up and down stacks'
    /// addresses in it (the file's stacked layout, so the expert ids index
    /// it directly).
    pub(crate) fn stage(
        &self,
        dev: &Device,
        model: &Model,
        layer: usize,
    ) -> Result<(usize, [u64; 3])> {
        let mut s = self.staging.lock().expect("staging lock");
        let b = match s.holds.iter().position(|&h| h == Some(layer)) {
            Some(b) => b,
            None => {
                let b = 1 - s.last;
                self.fill(dev, model, &mut s, b, layer)?;
                b
            }
        };
        if let Some(ev) = &s.filled[b] {
            dev.stream
                .wait(ev)
                .map_err(|e| drv("tier: wait for the staged experts", e))?;
        }
        let le = &self.layers[layer];
        let base = ptr(dev, &self.stage[b]);
        Ok((
            b,
            [
                base,
                base + aligned(le.whole[0]) as u64,
                base + (aligned(le.whole[0]) + aligned(le.whole[1])) as u64,
            ],
        ))
    }

    /// After the launches that read staging buffer `b` (holding `layer`):
    /// mark it read and start staging the next layer into the other buffer.
    pub(crate) fn staged_read(
        &self,
        dev: &Device,
        model: &Model,
        b: usize,
        layer: usize,
    ) -> Result<()> {
        let mut s = self.staging.lock().expect("staging lock");
        s.read[b] = Some(
            dev.stream
                .record_event(None)
                .map_err(|e| drv("tier: record the staged layer's use", e))?,
        );
        s.last = b;
        let next = (layer + 1) % self.layers.len();
        if s.holds[1 - b] != Some(next) {
            self.fill(dev, model, &mut s, 1 - b, next)?;
        }
        Ok(())
    }
}

impl Drop for Tier {
    fn drop(&mut self) {
        // Staging copies may still be running into buffers about to be freed.
        let _ = self.copy.synchronize();
    }
}
