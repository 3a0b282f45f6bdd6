//! The backend's row buffers: f32 rows on the device and, when the op that
//! wrote them also wrote them as Q8_K blocks (the fused norms), those
//! blocks, so the matmuls that read the rows next take them instead of
//! quantizing again. The blocks are quantize_q8k's bytes for exactly these
//! rows; every op that writes the rows without them drops them.

use cudarc::driver::CudaSlice;

/// Rows of f32 on the device, with their Q8_K blocks when known.
#[derive(Debug)]
pub struct CudaBuf {
    pub(crate) rows: CudaSlice<f32>,
    pub(crate) q8k: Option<CudaSlice<u8>>,
}

impl CudaBuf {
    /// Rows with no Q8_K blocks.
    pub(crate) fn new(rows: CudaSlice<f32>) -> Self {
        CudaBuf { rows, q8k: None }
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
    /// are dropped).
    pub(crate) fn write(&mut self) -> &mut CudaSlice<f32> {
        self.q8k = None;
        &mut self.rows
    }
}
