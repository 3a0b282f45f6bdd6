//! Matmul input rows and their quantized forms, made once per call.

use super::matmul::TC_ROWS;
use super::*;

/// The next layer's input norm run by a decode MoE's last launch
/// (`moe_combine_add_rms_norm_q8k`): `acc` += the MoE's output, `out` =
/// RMSNorm(acc) with weights `w`, and its Q8_K rows at `q` (device
/// addresses: `out` and `q` are also the MoE's input, read by earlier
/// launches).
pub(super) struct AfterNorm<'a> {
    pub(super) acc: u64,
    pub(super) w: &'a CudaSlice<f32>,
    pub(super) out: u64,
    pub(super) q: u64,
    pub(super) eps: f32,
}

/// The input rows of one or more matmuls and their quantized forms, made on
/// first use: matmuls that share an input quantize it once (one launch, not
/// one per matrix).
pub(super) struct Input<'a> {
    /// The f32 rows; `None` when the rows arrive already quantized.
    pub(super) x: Option<&'a CudaSlice<f32>>,
    pub(super) m: usize,
    pub(super) cols: usize,
    pub(super) q8k: std::cell::OnceCell<CudaSlice<u8>>,
    pub(super) q80: std::cell::OnceCell<CudaSlice<u8>>,
    /// The rows' Q8_K blocks as their producer wrote them (borrowed; taken
    /// before `q8k`).
    pub(super) given_q8k: Option<&'a CudaSlice<u8>>,
    /// For rows placed by the expert plan: the plan's padding (each
    /// expert's rows start at a multiple of it, so a tensor-core tile of up
    /// to this many rows holds one expert); 16 otherwise.
    pub(super) tile: usize,
    /// Rows with no expert (id -1) are read by no one downstream (a wide
    /// routed call's padding and unused places): the kernels that can may
    /// leave their outputs unwritten.
    pub(super) live: bool,
}

impl<'a> Input<'a> {
    /// f32 rows whose Q8_K blocks may already exist (`q`: quantize_q8k's
    /// bytes for exactly these rows).
    pub(super) fn with_q8k(x: &'a CudaSlice<f32>, m: usize, q: Option<CudaSlice<u8>>) -> Self {
        let me = Input::new(x, m);
        if let Some(q) = q {
            let _ = me.q8k.set(q);
        }
        me
    }

    pub(super) fn new(x: &'a CudaSlice<f32>, m: usize) -> Self {
        Input {
            x: Some(x),
            m,
            cols: x.len() / m.max(1),
            q8k: std::cell::OnceCell::new(),
            q80: std::cell::OnceCell::new(),
            given_q8k: None,
            tile: TC_ROWS,
            live: false,
        }
    }

    /// The same rows, placed by an expert plan that padded to `pad`.
    pub(super) fn padded(mut self, pad: usize) -> Self {
        self.tile = pad;
        self
    }

    /// The same rows, marked (with `on`) as ones whose id -1 rows no one
    /// reads (see `live`).
    pub(super) fn live(mut self, on: bool) -> Self {
        self.live = on;
        self
    }

    /// `m` rows of `cols` given only as Q8_K blocks (a quantized row is a
    /// function of the row alone, so these equal quantizing the f32 rows).
    pub(super) fn quantized(q8k: CudaSlice<u8>, m: usize, cols: usize) -> Self {
        let cell = std::cell::OnceCell::new();
        let _ = cell.set(q8k);
        Input {
            x: None,
            m,
            cols,
            q8k: cell,
            q80: std::cell::OnceCell::new(),
            given_q8k: None,
            tile: TC_ROWS,
            live: false,
        }
    }

    /// Row width.
    pub(super) fn cols(&self) -> usize {
        self.cols
    }

    /// The f32 rows (an error for rows given only quantized).
    pub(super) fn f32_rows(&self) -> Result<&'a CudaSlice<f32>> {
        self.x.ok_or_else(|| CudaError::Driver {
            op: "matmul".into(),
            msg: "f32 rows wanted from rows given as Q8_K blocks".into(),
        })
    }

    /// f32 rows with the Q8_K blocks their producer wrote, if it did.
    pub(super) fn with_given_q8k(
        x: &'a CudaSlice<f32>,
        m: usize,
        q: Option<&'a CudaSlice<u8>>,
    ) -> Self {
        let mut me = Input::new(x, m);
        me.given_q8k = q;
        me
    }

    /// The rows as Q8_K blocks (304 bytes each), quantized once.
    pub(super) fn q8k(&self, d: &Device) -> Result<&CudaSlice<u8>> {
        if let Some(q) = self.given_q8k {
            return Ok(q);
        }
        if self.q8k.get().is_none() {
            let (m, cols) = (self.m, self.cols());
            let nb = cols / 256;
            let mut a = d.scratch::<u8>(m * nb * 304)?;
            let (ci, mi) = (cols as i32, m as i32);
            launch!(
                d,
                "quantize_q8k",
                cfg((nb as u32, m as u32, 1), 32, 0),
                self.f32_rows()?,
                &mut a,
                &ci,
                &mi
            )?;
            let _ = self.q8k.set(a);
        }
        Ok(self.q8k.get().expect("set above"))
    }

    /// The rows as Q8_0 blocks (36 bytes each), quantized once.
    pub(super) fn q80(&self, d: &Device) -> Result<&CudaSlice<u8>> {
        if self.q80.get().is_none() {
            let (m, cols) = (self.m, self.cols());
            let nb = cols / 32;
            let mut a = d.scratch::<u8>(m * nb * 36)?;
            let (ci, mi) = (cols as i32, m as i32);
            launch!(
                d,
                "quantize_q8_0",
                // A warp a block.
                cfg1(32 * m * nb),
                self.f32_rows()?,
                &mut a,
                &ci,
                &mi
            )?;
            let _ = self.q80.set(a);
        }
        Ok(self.q80.get().expect("set above"))
    }
}
