//! [`Backend`] on a CUDA device: the layer blocks of the forward pass built
//! from the kernels in `kernels/`, with the model's weights resident on the
//! device (the GGUF's bytes uploaded once, matrices addressed by their file
//! offsets; f32 vectors uploaded beside them).
//!
//! Decode and prefill run the same launches with a different row count; every
//! kernel's per-row arithmetic is independent of it (see `kernels/*.cu`).

use crate::device::{
    Device, addr, cfg, cfg1, drv, lane_cfg, lane_cfg_rows, lane_threads, launch, launch_as,
    upload_bar,
};
use crate::error::{CudaError, Result};
use crate::tier::{RESERVE, TierSizes, plan as tier_plan};
use crate::tiered::{Tier, TierStats};
use cudarc::driver::CudaSlice;
use samesum_engine::backend::{Backend, DecodeStep, Norm, SeqsStep};
use samesum_engine::model::Matrix;
use samesum_engine::model::weights::{AttentionW, DeltaBa, DeltaInput, DeltaNetW, Mixer, MoeW};
use samesum_engine::{Arch, EngineError, KvType, Model};
use samesum_gguf::GgmlType;
use samesum_quant::dequant;
use std::collections::HashMap;
use std::sync::Mutex;

mod attention;
mod buf;
mod delta_net;
mod graphs;
mod input;
mod kv;
mod matmul;
mod moe;
mod norm;
mod ops;

pub use buf::CudaBuf;
use input::*;
pub use moe::plan_reference;

type R<T> = samesum_engine::Result<T>;
/// A column map's description: (kind, sizes...).
type MapKey = (u8, usize, usize, usize);

/// Bytes allocated past the weights on the device: the tensor-core kernels
/// of formats whose blocks are not 16-byte aligned (Q6_K, the 32-value
/// formats) copy a block as the aligned 16-byte pieces that hold it, which
/// reads up to 15 bytes past a tensor's last block.
const FILE_SLACK: usize = 16;

/// Weight formats with a CUDA matmul kernel.
pub const FORMATS: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
];

/// [`FORMATS`] as ggml names them, for messages.
pub(crate) fn format_names() -> String {
    FORMATS
        .iter()
        .map(|t| t.name().to_uppercase())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The CUDA backend for one model.
pub struct Cuda {
    dev: Device,
    /// The GGUF file's bytes on the device (matrices at their file offsets).
    file: CudaSlice<u8>,
    file_ptr: u64,
    /// f32 vectors of the model keyed by (host address, length).
    vecs: HashMap<(usize, usize), CudaSlice<f32>>,
    /// Zeroed device counters (a set of [`COUNTERS`] per lane) for launches
    /// whose last block finishes the work and resets its counter (the
    /// decode router launch that also routes, `mm_f32_multi_route_rd`).
    counters: CudaSlice<i32>,
    /// Column maps for layout shuffles, keyed by a description.
    maps: Mutex<HashMap<MapKey, CudaSlice<i32>>>,
    /// The kernel of the last attention score pass (for tests).
    att_last: Mutex<&'static str>,
    /// Rows the one-launch decode attention has taken (for the tests).
    att_seq_rows: std::sync::atomic::AtomicUsize,
    /// The delta-rule kernel the last delta-net call launched (for the tests).
    delta_last: Mutex<&'static str>,
    /// Each lane's marks (see `Backend::lane_mark`): an event per layer.
    lane_marks: Mutex<[Vec<Option<cudarc::driver::CudaEvent>>; 2]>,
    /// Attention on the tensor-core passes ([`CudaOptions::fast_attention`]).
    fast_attention: bool,
    /// The negative control's reordering ([`Cuda::with_reversed_topk`]).
    reversed_topk: bool,
    /// Most bytes of attention partials one call may use (rows run in groups
    /// under it; [`ATTN_PARTIALS`] unless set for a test).
    attn_partials: usize,
    /// Tier mode: each trunk matrix's device address by its file offset
    /// (`file` then holds the trunk packed); empty in resident mode.
    trunk: HashMap<usize, u64>,
    /// Tier mode's expert store, cache and staging.
    tier: Option<Tier>,
    /// One-token steps recorded as CUDA graphs and replayed (unless
    /// `SAMESUM_CUDA_GRAPHS=0`: the same launches one by one).
    graphs: bool,
    /// Recorded decode steps of several sequences, by key, and the one
    /// bound now ([`Backend::seqs_step`]).
    seqs: Mutex<graphs::SeqsSteps>,
}

/// `name` with `note` inside its closing parenthesis ("GPU (cuda:0, sm_90a)"
/// -> "GPU (cuda:0, sm_90a, note)"), or after it.
fn with_note(name: &str, note: &str) -> String {
    match name.strip_suffix(')') {
        Some(head) => format!("{head}, {note})"),
        None => format!("{name} ({note})"),
    }
}

/// How to place a model on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// Tier mode within this many bytes of VRAM (`--vram-budget`); without
    /// it, resident mode when the model fits and tier mode with the free
    /// memory as the budget when it does not.
    pub vram_budget: Option<u64>,
    /// Flash attention on f16 tensor cores with f32 accumulation
    /// (`--attention fast`, opt-in; the default is the exact f32 passes
    /// until this one meets its bars): q, k, v and
    /// the probabilities rounded to f16, so not the same bytes as the exact
    /// passes, but one function for decode and prefill (key splits fixed by
    /// position), so batched prefill equals replay with it on. Measured
    /// against the bars in docs/CAPABILITIES.md. Head dims 64, 128 and 256
    /// with query groups dividing 128; other shapes keep the exact passes.
    pub fast_attention: bool,
}

/// Device counters kept zeroed between launches (`Cuda::counters`).
const COUNTERS: usize = 4096;

/// Most bytes of attention partials (per pair and key tile: max, sum and a
/// head-dim row) one attention call allocates; longer contexts run the rows
/// in groups. 256 MiB: a 512-row chunk of qwen3moe (32 heads of 128) stays in
/// one group up to ~7,900 positions.
const ATTN_PARTIALS: usize = 256 << 20;

/// One sequence's state on the device.
pub struct CudaState {
    pos: usize,
    ctx: usize,
    kvw: usize,
    /// Each attention layer's paged KV cache (`kv.rs`).
    kv: Vec<Option<kv::KvPages>>,
    f16: bool,
    linear: Vec<Option<(CudaSlice<f32>, CudaSlice<f32>)>>,
    /// The position on the device (the kernels read it there, so a recorded
    /// step replays at any position) and the value last written to it.
    pos_dev: CudaSlice<i32>,
    pos_dev_val: Option<usize>,
    /// The lane the state's chunk runs on now (see `Backend::enter_lane`)
    /// and the other lane's device position and its value: a lane's kernels
    /// read the position of its own chunk.
    lane: usize,
    other_pos_dev: CudaSlice<i32>,
    other_pos_dev_val: Option<usize>,
    /// Attention grids sized for the whole context (while recording a step).
    whole_ctx: bool,
    /// The sequence's decode step: its row buffers and recorded graph.
    step: Option<samesum_engine::backend::DecodeStep<Cuda>>,
}

fn matrices(model: &Model) -> Vec<&Matrix> {
    let w = &model.w;
    let mut out = vec![&w.token_embd, &w.output];
    for l in &w.layers {
        match &l.mixer {
            Mixer::Attention(a) => out.extend([&a.q, &a.k, &a.v, &a.o]),
            Mixer::Linear(dn) => {
                match &dn.input {
                    DeltaInput::Split { qkv, z } => out.extend([qkv, z]),
                    DeltaInput::Fused { ssm_in } => out.push(ssm_in),
                }
                match &dn.ba {
                    DeltaBa::Fused(m) => out.push(m),
                    DeltaBa::Split { beta, alpha } => out.extend([beta, alpha]),
                }
                out.push(&dn.out);
            }
        }
        let m = &l.moe;
        out.extend([&m.router, &m.gate, &m.up, &m.down]);
        if let Some(s) = &m.shared {
            out.extend([&s.gate, &s.up, &s.down, &s.gate_inp]);
        }
    }
    out
}

/// The attention shapes the tiled kernel takes: head dims up to 256 and up
/// to 16 query heads per KV head (all three architectures' models are).
fn attention_shape(hq: usize, hkv: usize, hd: usize) -> Result<()> {
    if hd == 0 || hd > 256 || hkv == 0 || !hq.is_multiple_of(hkv) || hq / hkv > 16 {
        return Err(CudaError::Driver {
            op: "attention".into(),
            msg: format!(
                "{hq} query heads over {hkv} KV heads of dim {hd}: the CUDA attention takes head dims up to 256 and up to 16 query heads per KV head"
            ),
        });
    }
    Ok(())
}

fn vectors(model: &Model) -> Vec<&Vec<f32>> {
    let w = &model.w;
    let mut out = vec![&w.output_norm];
    for l in &w.layers {
        out.extend([&l.attn_norm, &l.ffn_norm]);
        match &l.mixer {
            Mixer::Attention(a) => out.extend([&a.q_norm, &a.k_norm]),
            Mixer::Linear(dn) => out.extend([&dn.conv, &dn.dt_bias, &dn.a, &dn.norm]),
        }
    }
    out
}

impl Cuda {
    /// Open device `ordinal` and upload `model`'s weights (resident mode, or
    /// tier mode when they do not fit), with progress bars when `progress`
    /// is set.
    pub fn new(ordinal: usize, model: &Model, progress: bool) -> Result<Cuda> {
        Cuda::with_options(ordinal, model, progress, CudaOptions::default())
    }

    /// [`Cuda::new`] with options. Fails before uploading anything when a
    /// matrix has no kernel, or when the trunk, the reserve for activations
    /// and the KV cache, the staging buffers and one token's experts do not
    /// fit the budget (the error names each size).
    pub fn with_options(
        ordinal: usize,
        model: &Model,
        progress: bool,
        opts: CudaOptions,
    ) -> Result<Cuda> {
        let mut c = Cuda::place(ordinal, model, progress, opts)?;
        c.fast_attention = opts.fast_attention;
        Ok(c)
    }

    /// The backend with the model's weights placed (resident or tiered).
    fn place(ordinal: usize, model: &Model, progress: bool, opts: CudaOptions) -> Result<Cuda> {
        for m in matrices(model) {
            if !FORMATS.contains(&m.ty) && !std::ptr::eq(m, &model.w.token_embd) {
                return Err(CudaError::Unsupported {
                    tensor: m.name.clone(),
                    ty: format!("{:?}", m.ty),
                });
            }
        }
        let hp = &model.hp;
        if model
            .w
            .layers
            .iter()
            .any(|l| matches!(l.mixer, Mixer::Attention(_)))
        {
            attention_shape(hp.n_head, hp.n_head_kv, hp.head_dim)?;
        }
        let dev = Device::open(ordinal)?;
        let bytes = model.bytes();
        let vec_bytes: usize = vectors(model).iter().map(|v| v.len() * 4).sum();
        let need = (bytes.len() + vec_bytes) as u64;
        let (free, total) = dev.ctx.mem_get_info().map_err(|e| drv("cuMemGetInfo", e))?;
        let (free, total) = (free as u64, total as u64);
        let budget = match opts.vram_budget {
            Some(b) if b > free => {
                return Err(CudaError::Driver {
                    op: "--vram-budget".into(),
                    msg: format!(
                        "{} MiB asked for, but {} has {} MiB free of {} MiB",
                        b >> 20,
                        dev.name,
                        free >> 20,
                        total >> 20
                    ),
                });
            }
            Some(b) => Some(b),
            None if need + RESERVE > free => Some(free),
            None => None,
        };
        let Some(budget) = budget else {
            return Cuda::resident(dev, model, progress);
        };
        let plan = tier_plan(TierSizes::of(model), budget, RESERVE)?;
        if opts.vram_budget.is_none() && progress {
            eprintln!(
                "the model ({} MiB) does not fit in {} MiB of free VRAM: tier mode, {} expert slots per layer",
                need >> 20,
                free >> 20,
                plan.slots
            );
        }
        // The trunk: every matrix but the routed experts, packed; the token
        // embedding stays on the host (the embedding is dequantized there)
        // unless the head shares it.
        let routed: std::collections::HashSet<usize> = model
            .w
            .layers
            .iter()
            .flat_map(|l| [l.moe.gate.offset, l.moe.up.offset, l.moe.down.offset])
            .collect();
        let mut trunk_mats: Vec<&Matrix> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for m in matrices(model) {
            let embd_only = std::ptr::eq(m, &model.w.token_embd);
            if routed.contains(&m.offset) || embd_only || !seen.insert(m.offset) {
                continue;
            }
            trunk_mats.push(m);
        }
        let size = |m: &Matrix| (m.rows * m.row_bytes * m.n_mats).next_multiple_of(256);
        let trunk_bytes: usize = trunk_mats.iter().map(|m| size(m)).sum();
        // FILE_SLACK: the tensor-core copies' overread.
        let mut file = dev.scratch::<u8>(trunk_bytes + FILE_SLACK)?;
        let file_ptr = addr(&dev, &file);
        let bar = upload_bar(progress, trunk_bytes as u64, "trunk to VRAM");
        let mut trunk = HashMap::new();
        let mut at = 0usize;
        for m in trunk_mats {
            let len = m.rows * m.row_bytes * m.n_mats;
            let src = bytes
                .get(m.offset..m.offset + len)
                .ok_or_else(|| CudaError::Driver {
                    op: "upload weights".into(),
                    msg: format!(
                        "{}: {len} bytes at offset {} run past the file ({} bytes)",
                        m.name,
                        m.offset,
                        bytes.len()
                    ),
                })?;
            let mut dst = file.slice_mut(at..at + len);
            dev.stream
                .memcpy_htod(src, &mut dst)
                .map_err(|e| drv(format!("upload {}", m.name), e))?;
            trunk.insert(m.offset, file_ptr + at as u64);
            at += size(m);
            bar.set_position(at as u64);
        }
        dev.sync()?;
        bar.finish_and_clear();
        let tier = Tier::new(&dev, model, plan, progress)?;
        Cuda::assemble(dev, model, file, trunk, Some(tier))
    }

    /// The backend around uploaded matrices: the f32 vectors uploaded beside
    /// them, the caches empty.
    fn assemble(
        dev: Device,
        model: &Model,
        file: CudaSlice<u8>,
        trunk: HashMap<usize, u64>,
        tier: Option<Tier>,
    ) -> Result<Cuda> {
        let mut vecs = HashMap::new();
        for v in vectors(model) {
            vecs.insert((v.as_ptr() as usize, v.len()), dev.upload(v)?);
        }
        let counters = dev.zeros::<i32>(2 * COUNTERS)?;
        Ok(Cuda {
            file_ptr: addr(&dev, &file),
            dev,
            file,
            vecs,
            counters,
            maps: Mutex::new(HashMap::new()),
            att_last: Mutex::new(""),
            att_seq_rows: Default::default(),
            delta_last: Mutex::new(""),
            lane_marks: Mutex::new([Vec::new(), Vec::new()]),
            fast_attention: false,
            reversed_topk: false,
            attn_partials: ATTN_PARTIALS,
            graphs: std::env::var("SAMESUM_CUDA_GRAPHS").as_deref() != Ok("0"),
            seqs: Mutex::new(graphs::SeqsSteps::default()),
            trunk,
            tier,
        })
    }

    /// Resident mode: the whole file on the device.
    fn resident(dev: Device, model: &Model, progress: bool) -> Result<Cuda> {
        let bytes = model.bytes();
        let mut file = dev.scratch::<u8>(bytes.len() + FILE_SLACK)?;
        let bar = upload_bar(progress, bytes.len() as u64, "uploading weights");
        const PIECE: usize = 64 << 20;
        let mut at = 0;
        while at < bytes.len() {
            let end = (at + PIECE).min(bytes.len());
            let mut dst = file.slice_mut(at..end);
            dev.stream
                .memcpy_htod(&bytes[at..end], &mut dst)
                .map_err(|e| drv("upload weights", e))?;
            bar.set_position(end as u64);
            at = end;
        }
        dev.sync()?;
        bar.finish_and_clear();
        Cuda::assemble(dev, model, file, HashMap::new(), None)
    }

    /// Tier mode's plan and counters (`None` in resident mode).
    pub fn tier_stats(&self) -> Option<(crate::tier::TierPlan, TierStats, bool)> {
        self.tier.as_ref().map(|t| (t.plan, t.stats(), t.pinned))
    }

    /// A matrix's device address.
    fn wptr(&self, w: &Matrix) -> Result<u64> {
        if self.tier.is_none() {
            return Ok(self.file_ptr + w.offset as u64);
        }
        self.trunk
            .get(&w.offset)
            .copied()
            .ok_or_else(|| CudaError::Driver {
                op: "matmul".into(),
                msg: format!(
                    "{} is not in VRAM (a routed expert stack in tier mode)",
                    w.name
                ),
            })
    }

    /// Whether attention takes the tensor-core passes
    /// ([`CudaOptions::fast_attention`]).
    pub fn fast_attention(&self) -> bool {
        self.fast_attention
    }

    /// The backend with calls of more than one row summing each row's top-k
    /// experts in reverse order (as the CPU's `with_reversed_topk`): a
    /// different function in batched prefill than in decode, so the
    /// identity gate must catch it (its negative control), and the smallest
    /// change to a result, for `samesum agree --probe`.
    pub fn with_reversed_topk(mut self) -> Self {
        self.reversed_topk = true;
        self
    }

    /// Record one-token steps as CUDA graphs (`true`, the default unless
    /// `SAMESUM_CUDA_GRAPHS=0`) or launch them one by one (the graph test's
    /// eager reference).
    #[doc(hidden)]
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The device's free and total memory in bytes now.
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        let (free, total) = self
            .dev
            .ctx
            .mem_get_info()
            .map_err(|e| drv("cuMemGetInfo", e))?;
        Ok((free as u64, total as u64))
    }

    /// Bytes of weights on the device (in tier mode: the trunk, the expert
    /// cache and the staging buffers).
    pub fn resident_bytes(&self) -> usize {
        self.file.len()
            + self.vecs.values().map(|v| v.len() * 4).sum::<usize>()
            + self.tier.as_ref().map_or(0, |t| t.vram_bytes())
    }

    fn vec(&self, v: &[f32]) -> Result<&CudaSlice<f32>> {
        self.vecs
            .get(&(v.as_ptr() as usize, v.len()))
            .ok_or_else(|| CudaError::Driver {
                op: "weights".into(),
                msg: "a vector of another model was passed".into(),
            })
    }

    /// A cached column map (built by `f` the first time).
    fn map(&self, key: MapKey, f: impl FnOnce() -> Vec<i32>) -> Result<u64> {
        use cudarc::driver::DevicePtr;
        let mut maps = self.maps.lock().expect("map cache lock");
        let m = match maps.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(self.dev.upload(&f())?),
        };
        let (p, _s) = m.device_ptr(&self.dev.stream);
        Ok(p)
    }
}

impl Cuda {
    /// [`Backend::fork_state`] on the device: a state for a context of
    /// `ctx` sharing the original's KV blocks that hold rows `0..pos` (each
    /// side copies a shared block on its first write to it, `kv.rs`), the
    /// conv and delta-rule states copied whole. The device positions are new buffers
    /// written on first use (`sync_pos`), the copy starts on lane 0, and the
    /// original's decode step (row buffers and recorded graph, made for the
    /// original's addresses) does not come along: the copy records its own.
    /// The device is synchronized before the copies (the original's last
    /// rows may still be in flight on either lane) and after them (the copy
    /// may next run on another stream).
    pub(crate) fn fork_cuda_state(&self, st: &CudaState, ctx: usize) -> R<CudaState> {
        if ctx < st.pos {
            return Err(EngineError::ContextFull { pos: st.pos, ctx });
        }
        self.dev.sync().map_err(e)?;
        let f32_copy = |src: &CudaSlice<f32>| -> R<CudaSlice<f32>> {
            let mut dst = self.dev.scratch::<f32>(src.len()).map_err(e)?;
            self.dev
                .current()
                .memcpy_dtod(src, &mut dst)
                .map_err(|x| e(drv("copy a recurrent state", x)))?;
            Ok(dst)
        };
        // The KV blocks are shared (copied on the first write to one).
        let cap = ctx.div_ceil(samesum_engine::state::KV_BLOCK);
        let mut kv = Vec::with_capacity(st.kv.len());
        for l in &st.kv {
            kv.push(match l {
                Some(p) => Some(p.fork(&self.dev, cap, st.pos).map_err(e)?),
                None => None,
            });
        }
        let mut linear = Vec::with_capacity(st.linear.len());
        for l in &st.linear {
            linear.push(match l {
                Some((c, s)) => Some((f32_copy(c)?, f32_copy(s)?)),
                None => None,
            });
        }
        let fork = CudaState {
            pos: st.pos,
            ctx,
            kvw: st.kvw,
            kv,
            f16: st.f16,
            linear,
            pos_dev: self.dev.zeros::<i32>(1).map_err(e)?,
            pos_dev_val: None,
            lane: 0,
            other_pos_dev: self.dev.zeros::<i32>(1).map_err(e)?,
            other_pos_dev_val: None,
            whole_ctx: false,
            step: None,
        };
        self.dev.sync().map_err(e)?;
        Ok(fork)
    }
}

/// Formats whose matmuls read Q8_K activation rows.
fn k_quant(t: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        t,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S
    )
}

/// Formats whose matmuls read Q8_0 activation rows (their blocks are 32
/// values).
fn q8_0_act(t: GgmlType) -> bool {
    matches!(
        t,
        GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::IQ4_NL
            | GgmlType::MXFP4
            | GgmlType::Q4_1
            | GgmlType::Q5_1
    )
}

fn e(err: CudaError) -> EngineError {
    err.into()
}

#[cfg(test)]
mod tests {
    use super::attention_shape;

    /// A weight with no CUDA kernel is named with its type and the formats
    /// that have one.
    #[test]
    fn an_unsupported_weight_names_tensor_type_and_the_formats_there_are() {
        let e = crate::CudaError::Unsupported {
            tensor: "blk.3.ffn_down_exps.weight".into(),
            ty: "IQ2_XXS".into(),
        }
        .to_string();
        for want in [
            "blk.3.ffn_down_exps.weight",
            "IQ2_XXS",
            "Q6_K",
            "IQ4_XS",
            "MXFP4",
        ] {
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn attention_shapes_beyond_the_kernel_are_refused_with_the_shape_named() {
        assert!(attention_shape(32, 4, 128).is_ok());
        assert!(attention_shape(16, 2, 256).is_ok());
        assert!(attention_shape(16, 1, 64).is_ok());
        for (hq, hkv, hd) in [
            (32, 1, 128),
            (16, 2, 512),
            (12, 5, 64),
            (8, 0, 64),
            (8, 8, 0),
        ] {
            let e = attention_shape(hq, hkv, hd).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{hq} query heads over {hkv} KV heads of dim {hd}")),
                "{e}"
            );
        }
    }
}
