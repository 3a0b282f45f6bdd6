//! Decode steps recorded as CUDA graphs and replayed: the engine drives the
//! recording ([`samesum_engine::decode_step`]); this is the backend's part
//! (the position on the device, the capture on the compute stream, launch).

use super::attention::FA_SPLIT;
use super::delta_net::delta_one_launch;
use super::*;

impl Cuda {
    /// Write the state's position to its device copy if it changed.
    pub(super) fn sync_pos(&self, st: &mut CudaState) -> Result<()> {
        if st.pos_dev_val != Some(st.pos) {
            self.dev
                .current()
                .memcpy_htod(&[st.pos as i32], &mut st.pos_dev)
                .map_err(|x| drv("copy the position", x))?;
            st.pos_dev_val = Some(st.pos);
        }
        Ok(())
    }

    /// Start capturing the compute stream's launches for `st`: its position
    /// is written to the device first (the kernels read it there, so the
    /// graph replays at any position), and attention's grids are sized for
    /// the whole context while recording.
    pub(super) fn begin_record(&self, st: &mut CudaState) -> Result<()> {
        self.sync_pos(st)?;
        self.dev
            .stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(|x| drv("begin recording the decode step", x))?;
        st.whole_ctx = true;
        Ok(())
    }

    /// End the capture (whatever happened while recording, so the stream
    /// works again) and return the recorded graph.
    pub(super) fn end_record(&self, st: &mut CudaState) -> Result<cudarc::driver::CudaGraph> {
        st.whole_ctx = false;
        self.dev
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(|x| drv("record the decode step", x))?
            .ok_or_else(|| drv("record the decode step", "an empty graph"))
    }

    /// Launch a recorded step at the state's position.
    pub(super) fn replay_step(
        &self,
        st: &mut CudaState,
        g: &cudarc::driver::CudaGraph,
    ) -> Result<()> {
        self.sync_pos(st)?;
        // The recording reads the block table at its fixed address; the
        // block of this step's position is made there first (a no-op where
        // the forward call reserved it).
        st.reserve_kv(&self.dev, 1)?;
        g.launch().map_err(|x| drv("launch the decode graph", x))
    }
}

/// Most rows of a recorded step of several sequences (more run call by call).
const SEQS_MAX_ROWS: usize = 256;

/// Most multi-sequence recordings kept (each holds its launches' scratch):
/// past it, the one used longest ago is dropped.
const SEQS_MAX_KEYS: usize = 24;

/// The rows a recorded step of `n` sequences runs: powers of two up to 32,
/// then multiples of 32, so a few recordings serve every count and at most
/// 31 rows are padding.
pub(super) fn seqs_bucket(n: usize) -> usize {
    if n <= 32 {
        n.next_power_of_two()
    } else {
        n.div_ceil(32) * 32
    }
}

/// A bound step of several sequences ([`Backend::bind_seqs`]): where its
/// kernels read each row's cache or state and position.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bound {
    /// The step's table on the device: per layer `3 * rows` addresses and
    /// positions (attention: the rows' key and value block tables,
    /// positions; delta
    /// net: conv states, delta-rule states, unused), the layout of the
    /// one-launch kernels' tables (`OfSeqs` in attention_flash.cu,
    /// `conv_l2_one_seqs` and the delta rule's `_seqs` kernels).
    table: u64,
    /// Rows of the step (its sequences, then padding rows).
    pub(super) rows: usize,
    /// The sequences bound (the first rows).
    pub(super) seqs: usize,
    /// Key splits the attention grids cover: every bound row's position is
    /// below `nsplit * FA_SPLIT` (blocks past a row's position return).
    pub(super) nsplit: usize,
    /// The rows' caches are f16.
    pub(super) f16: bool,
}

impl Bound {
    /// Layer `l`'s part of the table.
    pub(super) fn layer(&self, l: usize) -> u64 {
        self.table + (l * 3 * self.rows * 8) as u64
    }
}

/// A padding row's scratch state, shared by its layers: a KV cache of one
/// block (f32-sized, so either cache type fits; a padding row is at
/// position 0) and its block table (the key block's address, then the
/// value block's), a conv state and a delta-rule state.
struct Pad {
    /// Held for the table, which points into it.
    #[allow(dead_code)]
    kv: CudaSlice<u8>,
    table: CudaSlice<u64>,
    conv: CudaSlice<f32>,
    s: CudaSlice<f32>,
}

/// A recorded step of several sequences: its table (the graph reads it at
/// this address) and its row buffers and recording.
struct SeqsEntry {
    table: CudaSlice<u64>,
    step: Option<KeptStep>,
    /// The bind count when it was last bound (which entry to drop first).
    used: u64,
}

/// A step's buffers and recording kept by the backend between steps.
struct KeptStep(DecodeStep<Cuda>);

// SAFETY: a CUDA graph's handles (cudarc's `CudaGraph` holds them as raw
// pointers, hence not `Send`) belong to the context, not to the thread that
// made them: the driver API takes them from any thread. The backend keeps a
// step under its mutex and hands it to one caller at a time
// (`take_seqs_entry` / `put_seqs_entry`), so no two threads use it at once.
unsafe impl Send for KeptStep {}

/// The multi-sequence steps of [`Backend::seqs_step`]: one entry a key
/// (rows, splits, cache type), the padding rows' states, and the step bound
/// now.
#[derive(Default)]
pub(super) struct SeqsSteps {
    steps: HashMap<u64, SeqsEntry>,
    pads: Vec<Pad>,
    bound: Option<Bound>,
    /// Binds so far.
    binds: u64,
}

/// A multi-sequence step's key: its rows, attention splits and cache type.
fn seqs_key(rows: usize, nsplit: usize, f16: bool) -> u64 {
    rows as u64 | (nsplit as u64) << 20 | (f16 as u64) << 60
}

fn seqs_key_parts(key: u64) -> (usize, usize, bool) {
    (
        (key & 0xF_FFFF) as usize,
        ((key >> 20) & 0xFF_FFFF_FFFF) as usize,
        key >> 60 & 1 == 1,
    )
}

impl Cuda {
    /// The multi-sequence steps recorded so far, by rows (for the tests).
    #[doc(hidden)]
    pub fn recorded_seqs_steps(&self) -> Vec<usize> {
        let g = self.seqs.lock().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<usize> = g
            .steps
            .iter()
            .filter(|(_, e)| e.step.as_ref().is_some_and(|k| k.0.graph.is_some()))
            .map(|(&key, _)| seqs_key_parts(key).0)
            .collect();
        rows.sort_unstable();
        rows
    }

    /// The bound multi-sequence step, if one is bound.
    pub(super) fn bound_seqs(&self) -> Option<Bound> {
        self.seqs.lock().unwrap_or_else(|p| p.into_inner()).bound
    }

    /// How a decode step of `sts` runs recorded ([`Backend::seqs_step`]):
    /// with the flash attention and every layer's one-launch kernels, the
    /// sequences' caches of one type, up to [`SEQS_MAX_ROWS`] rows.
    pub(super) fn plan_seqs_step(&self, model: &Model, sts: &[&CudaState]) -> Option<SeqsStep> {
        if sts.len() < 2 || !self.fast_attention() || !self.one_launch_layers(model) {
            return None;
        }
        let f16 = sts[0].f16;
        let rows = seqs_bucket(sts.len());
        if rows > SEQS_MAX_ROWS
            || sts.iter().any(|st| {
                st.f16 != f16
                    || st
                        .kv
                        .iter()
                        .zip(&st.linear)
                        .any(|(k, c)| k.is_none() == c.is_none())
            })
        {
            return None;
        }
        let nsplit = sts
            .iter()
            .map(|st| (st.pos + 1).div_ceil(FA_SPLIT))
            .max()?
            .next_power_of_two();
        // The decode attention's partials (a max, a sum and a head-dim row
        // per row, head and split) stay under the cap one attention call
        // has; past it the step runs call by call.
        let hp = &model.hp;
        if rows * hp.n_head * nsplit * (hp.head_dim + 2) * 4 > self.attn_partials {
            return None;
        }
        Some(SeqsStep {
            key: seqs_key(rows, nsplit, f16),
            rows,
        })
    }

    /// Whether every layer of `model` has one-launch kernels for a row each
    /// of several sequences (flash attention; the one-row conv and a
    /// `_seqs` delta rule).
    fn one_launch_layers(&self, model: &Model) -> bool {
        model.w.layers.iter().all(|lw| match &lw.mixer {
            Mixer::Attention(_) => self.flash_for_one_row(model),
            Mixer::Linear(_) => delta_one_launch(model),
        })
    }

    /// A padding row's state for `model`.
    fn new_pad(&self, model: &Model) -> Result<Pad> {
        let hp = &model.hp;
        let block = hp.n_head_kv * hp.head_dim * samesum_engine::state::KV_BLOCK * 4;
        let (conv, s) = match hp.ssm {
            Some(s) => (
                (s.d_conv - 1) * s.conv_dim(),
                s.n_v_heads * s.head_k_dim * s.head_v_dim,
            ),
            None => (1, 1),
        };
        let kv = self.dev.zeros::<u8>(2 * block)?;
        let base = addr(&self.dev, &kv);
        let table = self.dev.upload(&[base, base + block as u64])?;
        Ok(Pad {
            kv,
            table,
            conv: self.dev.zeros::<f32>(conv)?,
            s: self.dev.zeros::<f32>(s)?,
        })
    }

    /// Bind `sts` to the rows of `step` ([`Backend::bind_seqs`]): write the
    /// step's table (the sequences' rows, then padding rows at position 0
    /// on their scratch states) where its kernels and recording read it.
    pub(super) fn bind_seqs_step(
        &self,
        model: &Model,
        step: SeqsStep,
        sts: &[&CudaState],
    ) -> Result<()> {
        let (rows, nsplit, f16) = seqs_key_parts(step.key);
        let bad = |msg: String| CudaError::Driver {
            op: "bind a step of several sequences".into(),
            msg,
        };
        if rows != step.rows || sts.len() > rows {
            return Err(bad(format!(
                "{} sequences for {} rows",
                sts.len(),
                step.rows
            )));
        }
        if let Some(st) = sts
            .iter()
            .find(|st| st.f16 != f16 || st.pos >= nsplit * FA_SPLIT)
        {
            return Err(bad(format!(
                "a sequence at position {} (f16 cache: {}) in a step of {nsplit} splits (f16: {f16})",
                st.pos, st.f16
            )));
        }
        let mut g = self.seqs.lock().unwrap_or_else(|p| p.into_inner());
        while g.pads.len() < rows - sts.len() {
            let pad = self.new_pad(model)?;
            g.pads.push(pad);
        }
        let d = &self.dev;
        let n_layers = model.w.layers.len();
        let mut host = vec![0u64; n_layers * 3 * rows];
        for (l, t) in host.chunks_mut(3 * rows).enumerate() {
            for i in 0..rows {
                let (a, b, pos) = match sts.get(i) {
                    Some(st) => match (&st.kv[l], &st.linear[l]) {
                        (Some(p), _) => (p.kt(d), p.vt(d), st.pos),
                        (None, Some((c, s))) => (addr(d, c), addr(d, s), 0),
                        (None, None) => return Err(bad(format!("layer {l} has no state"))),
                    },
                    None => {
                        let p = &g.pads[i - sts.len()];
                        match model.w.layers[l].mixer {
                            Mixer::Attention(_) => {
                                let t = addr(d, &p.table);
                                (t, t + 8, 0)
                            }
                            Mixer::Linear(_) => (addr(d, &p.conv), addr(d, &p.s), 0),
                        }
                    }
                };
                t[i] = a;
                t[rows + i] = b;
                t[2 * rows + i] = pos as u64;
            }
        }
        if !g.steps.contains_key(&step.key) && g.steps.len() >= SEQS_MAX_KEYS {
            // Drop the recording used longest ago, after the device is done
            // with whatever of it is still queued.
            if let Some(old) = g.steps.iter().min_by_key(|(_, e)| e.used).map(|(&k, _)| k) {
                d.sync()?;
                g.steps.remove(&old);
            }
        }
        g.binds += 1;
        let used = g.binds;
        let entry = match g.steps.entry(step.key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(SeqsEntry {
                table: d.scratch::<u64>(host.len())?,
                step: None,
                used,
            }),
        };
        entry.used = used;
        if entry.table.len() != host.len() {
            return Err(bad(format!(
                "a table of {} entries for {} layers of {rows} rows",
                entry.table.len(),
                n_layers
            )));
        }
        // On the stream the step runs and is recorded on, ordered after
        // the steps before it.
        d.stream
            .memcpy_htod(&host, &mut entry.table)
            .map_err(|x| drv("copy the step's table", x))?;
        let table = addr(d, &entry.table);
        g.bound = Some(Bound {
            table,
            rows,
            seqs: sts.len(),
            nsplit,
            f16,
        });
        Ok(())
    }

    /// End the binding (the entries and their recordings stay).
    pub(super) fn unbind_seqs_step(&self) {
        self.seqs.lock().unwrap_or_else(|p| p.into_inner()).bound = None;
    }

    /// The row buffers and recording of step `key`.
    pub(super) fn take_seqs_entry(&self, key: u64) -> Option<DecodeStep<Cuda>> {
        let mut g = self.seqs.lock().unwrap_or_else(|p| p.into_inner());
        g.steps
            .get_mut(&key)
            .and_then(|e| e.step.take())
            .map(|k| k.0)
    }

    /// Keep step `key`'s buffers and recording (its entry was made when it
    /// was bound).
    pub(super) fn put_seqs_entry(&self, key: u64, step: DecodeStep<Cuda>) {
        let mut g = self.seqs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = g.steps.get_mut(&key) {
            e.step = Some(KeptStep(step));
        }
    }

    /// Start capturing the compute stream for the bound step.
    pub(super) fn begin_record_seqs(&self) -> Result<()> {
        if self.bound_seqs().is_none() {
            return Err(drv(
                "record a step of several sequences",
                "no step is bound",
            ));
        }
        self.dev
            .stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(|x| drv("begin recording a step of several sequences", x))
    }

    /// End the capture and return the recorded step.
    pub(super) fn end_record_seqs(&self) -> Result<cudarc::driver::CudaGraph> {
        self.dev
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(|x| drv("record a step of several sequences", x))?
            .ok_or_else(|| drv("record a step of several sequences", "an empty graph"))
    }

    /// Launch a recorded multi-sequence step on the bound sequences.
    pub(super) fn replay_seqs_step(&self, g: &cudarc::driver::CudaGraph) -> Result<()> {
        if self.bound_seqs().is_none() {
            return Err(drv(
                "replay a step of several sequences",
                "no step is bound",
            ));
        }
        g.launch()
            .map_err(|x| drv("launch a step of several sequences", x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_then_multiples_of_32() {
        let got: Vec<usize> = [2, 3, 4, 5, 9, 17, 32, 33, 64, 65, 100, 256]
            .iter()
            .map(|&n| seqs_bucket(n))
            .collect();
        assert_eq!(got, [2, 4, 4, 8, 16, 32, 32, 64, 64, 96, 128, 256]);
        for n in 2..=SEQS_MAX_ROWS {
            let b = seqs_bucket(n);
            assert!(b >= n && b - n < 32, "{n} sequences: {b} rows");
        }
    }

    #[test]
    fn a_key_gives_back_its_rows_splits_and_cache_type() {
        for (rows, nsplit, f16) in [(2, 1, false), (256, 512, true), (96, 1 << 20, true)] {
            assert_eq!(
                seqs_key_parts(seqs_key(rows, nsplit, f16)),
                (rows, nsplit, f16)
            );
        }
        assert_ne!(seqs_key(4, 2, true), seqs_key(4, 2, false));
        assert_ne!(seqs_key(4, 2, true), seqs_key(4, 4, true));
    }
}
