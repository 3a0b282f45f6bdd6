//! The backend's row buffers: f32 rows on the device and, when the op that
//! wrote them also wrote them as Q8_K blocks (the fused norms), those
//! blocks, so the matmuls that read the rows next take them instead of
//! quantizing again. The blocks are quantize_q8k's bytes for exactly these
//! rows; every op that writes the rows without them marks them stale.
//!
//! The blocks' storage stays with the buffer once made and is reused: a
//! decode step's buffers get theirs in the step that runs call by call, so
//! a recorded step (a CUDA graph) allocates and frees nothing that outlives
//! it.

use crate::device::Device;
use crate::error::Result;
use cudarc::driver::CudaSlice;

/// Rows of f32 on the device, with their Q8_K blocks when known.
#[derive(Debug)]
pub struct CudaBuf {
    pub(crate) rows: CudaSlice<f32>,
    q8k: Option<CudaSlice<u8>>,
    q8k_current: bool,
}

impl CudaBuf {
    /// Rows with no Q8_K blocks.
    pub(crate) fn new(rows: CudaSlice<f32>) -> Self {
        CudaBuf {
            rows,
            q8k: None,
            q8k_current: false,
        }
    }

    /// Number of f32 values.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.rows.len() == 0
    }

    /// The f32 rows, about to be written without their Q8_K blocks (which
    /// become stale).
    pub(crate) fn write(&mut self) -> &mut CudaSlice<f32> {
        self.q8k_current = false;
        &mut self.rows
    }

    /// The rows' Q8_K blocks, if the op that last wrote the rows wrote them.
    pub(crate) fn q8k(&self) -> Option<&CudaSlice<u8>> {
        self.q8k.as_ref().filter(|_| self.q8k_current)
    }

    /// The storage of the rows' Q8_K blocks, `bytes` long (made on first
    /// use, when the blocks are not current).
    pub(crate) fn q8k_storage(&mut self, dev: &Device, bytes: usize) -> Result<&CudaSlice<u8>> {
        if self.q8k.as_ref().is_none_or(|q| q.len() != bytes) {
            self.q8k_current = false;
            self.q8k = None;
            self.q8k = Some(dev.scratch::<u8>(bytes)?);
        }
        Ok(self.q8k.as_ref().expect("made above"))
    }

    /// An op wrote the rows and their Q8_K blocks (into
    /// [`CudaBuf::q8k_storage`]) together.
    pub(crate) fn q8k_written(&mut self) {
        self.q8k_current = self.q8k.is_some();
    }

    /// The f32 rows and the storage of their Q8_K blocks (`bytes` long),
    /// about to be written together by one op.
    pub(crate) fn write_with_q8k(
        &mut self,
        dev: &Device,
        bytes: usize,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<u8>)> {
        self.q8k_storage(dev, bytes)?;
        self.q8k_current = true;
        Ok((&mut self.rows, self.q8k.as_mut().expect("made above")))
    }
}
