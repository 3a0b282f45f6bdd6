//! One-token steps recorded as CUDA graphs and replayed.

use super::*;

impl Cuda {
    /// The Q8_K rows of `x` if the last kernel launched was the norm that
    /// wrote `x` (same address and length, no launch since); taken either way.
    /// Whether a call of `m` rows prefetches the step's next weights (see
    /// `prefetch`).
    pub(super) fn prefetches(&self, m: usize) -> bool {
        self.prefetch && m == 1 && self.tier.is_none() && !self.dev.profiling()
    }

    /// Pull the bytes of `mats` (up to eight) into L2 from the second
    /// stream, after everything queued on the main stream so far, while the
    /// main stream goes on (see `prefetch`); joined by
    /// [`Cuda::join_prefetch`].
    pub(super) fn prefetch_mats(&self, mats: &[&Matrix]) -> Result<()> {
        let mut j = crate::device::PrefetchJobs::default();
        for w in mats.iter().take(j.ptr.len()) {
            let i = j.n as usize;
            j.ptr[i] = self.wptr(w)?;
            j.bytes[i] = (w.n_mats * w.rows * w.row_bytes) as u64;
            j.n += 1;
        }
        let total: u64 = j.bytes.iter().sum();
        if total == 0 {
            return Ok(());
        }
        let d = &self.dev;
        // A piece a thread, consecutive pieces on different blocks: up to
        // 64 blocks, so the pieces spread over as many SMs.
        let blocks = total.div_ceil(16384).clamp(1, 64) as u32;
        let lines = i32::from(self.prefetch_lines);
        let ((), ev) =
            d.on_side(|| launch!(d, "l2_prefetch", cfg((blocks, 1, 1), 128, 0), &j, &lines))?;
        *self.prefetch_done.lock().unwrap_or_else(|p| p.into_inner()) = Some(ev);
        Ok(())
    }

    /// A one-row mixer call's prefetch once its input projections are
    /// queued: its output projection `out`, then layer `l`'s router and
    /// shared expert, read after the mixer's short kernels.
    pub(super) fn prefetch_after_mixer_input(
        &self,
        model: &Model,
        l: usize,
        out: &Matrix,
    ) -> Result<()> {
        let mut mats = vec![out];
        if let Some(lw) = model.w.layers.get(l) {
            mats.push(&lw.moe.router);
            if let Some(sh) = &lw.moe.shared {
                mats.extend([&sh.gate_inp, &sh.gate, &sh.up, &sh.down]);
            }
        }
        self.prefetch_mats(&mats)
    }

    /// Make the main stream wait for the last prefetch (a recorded step
    /// must join the second stream before its end).
    pub(super) fn join_prefetch(&self) -> Result<()> {
        let ev = self
            .prefetch_done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match ev {
            Some(ev) => self.dev.wait_for(&ev),
            None => Ok(()),
        }
    }

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

    /// One token on one sequence: the first step runs eagerly (loading
    /// kernels, uploading column maps), the second is recorded as a CUDA
    /// graph and launched, later ones launch it. The graph holds the same
    /// launches with the same arguments (the position comes from the device),
    /// so it computes the bytes the eager path does.
    pub(super) fn graph_step(
        &self,
        model: &Model,
        st: &mut CudaState,
        token: u32,
        want: samesum_engine::Logits,
    ) -> R<Vec<f32>> {
        let d = model.hp.n_embd;
        let mut step = match st.step.take() {
            Some(s) => s,
            None => Step {
                h: self.dev.scratch::<f32>(d).map_err(e)?,
                x: self.dev.scratch::<f32>(d).map_err(e)?,
                y: self.dev.scratch::<f32>(d).map_err(e)?,
                graph: None,
            },
        };
        let out = self.run_step(model, st, &mut step, token, want);
        st.step = Some(step);
        out
    }

    pub(super) fn run_step(
        &self,
        model: &Model,
        st: &mut CudaState,
        step: &mut Step,
        token: u32,
        want: samesum_engine::Logits,
    ) -> R<Vec<f32>> {
        use samesum_engine::backend::Backend as _;
        self.join_prefetch().map_err(e)?;
        self.embed(model, &[token], &mut step.h)?;
        self.sync_pos(st).map_err(e)?;
        let Step { h, x, y, graph } = step;
        if let Some(g) = graph {
            g.launch()
                .map_err(|x| e(drv("launch the decode graph", x)))?;
        } else if st.eager_steps == 0 || st.no_graph {
            samesum_engine::layers_one(model, self, st, h, x, y)?;
            self.join_prefetch().map_err(e)?;
            st.eager_steps += 1;
        } else {
            match self.record(model, st, h, x, y) {
                Ok(g) => {
                    g.launch()
                        .map_err(|x| e(drv("launch the decode graph", x)))?;
                    *graph = Some(g);
                }
                Err(err) => {
                    // Nothing ran while recording: run the step eagerly, and
                    // keep this sequence's steps eager from now on.
                    eprintln!(
                        "warning: recording the decode step failed ({err}); this sequence decodes without CUDA graphs"
                    );
                    st.no_graph = true;
                    samesum_engine::layers_one(model, self, st, h, x, y)?;
                    self.join_prefetch().map_err(e)?;
                }
            }
        }
        st.pos += 1;
        match want {
            samesum_engine::Logits::None => Ok(Vec::new()),
            _ => self.logits(model, h, &[0]),
        }
    }

    /// Record `layers_one` on the compute stream as a graph (not run).
    pub(super) fn record(
        &self,
        model: &Model,
        st: &mut CudaState,
        h: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> R<cudarc::driver::CudaGraph> {
        let stream = &self.dev.stream;
        stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(|x| e(drv("begin recording the decode step", x)))?;
        st.whole_ctx = true;
        let ran = samesum_engine::layers_one(model, self, st, h, x, y);
        // The prefetches' stream joins the main stream before the end.
        let joined = self.join_prefetch();
        st.whole_ctx = false;
        // End the capture whatever happened, so the stream works again.
        let ended = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        ran?;
        joined.map_err(e)?;
        ended
            .map_err(|x| e(drv("record the decode step", x)))?
            .ok_or_else(|| e(drv("record the decode step", "an empty graph")))
    }
}
