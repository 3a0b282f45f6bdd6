//! Decode steps recorded as CUDA graphs and replayed: the engine drives the
//! recording ([`samesum_engine::decode_step`]); this is the backend's part
//! (the position on the device, the capture on the compute stream, launch).

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
        g.launch().map_err(|x| drv("launch the decode graph", x))
    }
}
