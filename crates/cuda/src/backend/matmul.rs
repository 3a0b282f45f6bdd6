//! Matmuls: each call's kernel chosen by [`MatmulKernel::select`] from the
//! weights' format and rows, the call's rows and whether they name experts;
//! the fused GLU, a layer's one-row input projections in one launch, and
//! several matrices' wide calls in one tensor-core launch.

use super::*;

/// Activation rows per tile of the tensor-core matmuls (the async kernel's
/// 32-row variant aside): the expert plan pads each expert's rows to a
/// multiple of this in wide calls.
pub(super) const TC_ROWS: usize = 16;

/// Calls of at least this many rows per weight matrix (for expert calls, on
/// average per expert) take the async kernel's 32-row tiles: each
/// staged weight block then serves twice the rows. Below it the plan's
/// padding to 32 would cost more rows than the tiles save (H200, qwen35moe
/// at 16 rows per expert: pp512 10,128 -> 9,399 with 32-row tiles
/// everywhere; at 64, pp4096 9,381 -> 9,540).
const TC_ROWS32_MIN: usize = 64;

/// The most rows a one-row Q4_K matmul may have to take 16 rows a block
/// (4,096 rows are 128 blocks of 32: a wave of the H200's 132 SMs already).
const LANE16_ROWS: usize = 4096;

/// The largest matrix a call of 2 to 16 rows of one matrix reads once per
/// activation row (the row and lane kernels, `mm_f32_1`: each activation
/// row's blocks sweep the whole matrix). Below it the sweeps after the first
/// read the L2 (50 MB on the H100 and H200); an output head (417 MB of Q6_K
/// for a 248,320-token vocabulary) would come from memory once per row, so
/// larger matrices take the tile kernels, which read each weight row once
/// for 16 activation rows (H200, 8-layer qwen35moe q4_k_m, 16 sequences a
/// step: 2,813 tok/s with its Q6_K matrices, the head among them, on the row
/// kernel, 3,421 on the tile kernel; the head's 16 sweeps are ~1.4 ms of
/// memory traffic a step at 4.8 TB/s, the steps 1.0 ms apart).
const ROW_REREAD_BYTES: usize = 32 << 20;

/// Would a call of `m` rows of `w` take a kernel that sweeps `w` once per
/// activation row, with `w` too large for the sweeps to hit the L2?
fn rereads(w: &Matrix, m: usize, experts: bool) -> bool {
    m > 1 && !experts && w.rows * w.row_bytes > ROW_REREAD_BYTES
}

/// `mm_f32_tile_w8`'s two stages of shared memory: 32 weight rows and 16
/// activation rows of 128 f32 columns each (MFW_SMEM in matmul_float.cu).
const MFW_SMEM: u32 = 2 * (32 + 16) * 128 * 4;

/// Float matrices of at most this many rows take `mm_f32_few` instead
/// (MFF_ROWS in matmul_float.cu).
const MFF_ROWS: usize = 8;

/// The weight rows of a tensor-core tile (TQ_WROWS in matmul_tc.cu).
const TQ_WROWS: usize = 128;

/// Dynamic shared memory of the async tensor-core kernels: two stages of
/// (128 weight rows at 160 bytes for Q4_K or 224 for Q5_K, `rows` activation
/// rows at 352, rows x 4 packed bsums, rows scales), as `TaLayout` in
/// matmul_tc.cu.
const fn tc_async_smem(q5: bool, rows: usize) -> u32 {
    let wst = if q5 { 224 } else { 160 };
    (2 * (128 * wst + rows * 352 + rows * 4 * 4 + rows * 4)) as u32
}

/// Dynamic shared memory of format `t`'s tensor-core kernels for tiles of
/// `rows` activation rows: two stages of 128 weight rows and the activation
/// rows (matmul_tc.cu: Q4_K and Q5_K as above; Q6_K 240 and 352 bytes a
/// row, T6Layout; IQ4_XS 144 and 352, TxLayout; the low-bit formats 144
/// and 352, TlLayout; the 32-value formats 336 and 304, T8Layout).
fn tc_smem(t: GgmlType, rows: usize) -> u32 {
    let (w, a) = match t {
        GgmlType::Q4_K | GgmlType::Q5_K => return tc_async_smem(t == GgmlType::Q5_K, rows),
        GgmlType::Q6_K => (240, 352),
        GgmlType::IQ4_XS => (144, 352),
        GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S => (144, 352),
        _ => (336, 304),
    };
    (2 * (128 * w + rows * a)) as u32
}

/// A quantized format's row kernels (kernels/matmul_dp4a.cu,
/// matmul_nib.cu) and tensor-core kernels (matmul_tc.cu): one family, the
/// same bytes from every member. Q4_K's one-row kernels are its lane
/// kernels (a lane per weight row, launched as such).
pub(super) struct QuantKernels {
    /// Wide calls, 16 activation rows a tile.
    pub tc16: &'static str,
    /// Wide calls, 32 activation rows a tile.
    pub tc32: &'static str,
    /// A warp per weight row and 16-row tile: the reference kernel.
    pub tile: &'static str,
    /// Calls of up to 16 rows, with or without expert ids.
    pub row: &'static str,
    /// `silu(gate . x) * (up . x)`, decode-sized.
    pub glu: &'static str,
    /// Up to four matrices on one row.
    pub multi: &'static str,
    /// A decode MoE's routed and shared experts: plain and GLU.
    pub moe: &'static str,
    pub moe_glu: &'static str,
}

macro_rules! quant_kernels {
    ($p:literal, $tc16:literal, $tc32:literal, $row:literal) => {
        QuantKernels {
            tc16: $tc16,
            tc32: $tc32,
            tile: concat!("mm_", $p),
            row: $row,
            glu: concat!("mm_", $p, "_glu_1"),
            multi: concat!("mm_", $p, "_multi_1"),
            moe: concat!("mm_", $p, "_moe_1"),
            moe_glu: concat!("mm_", $p, "_moe_glu_1"),
        }
    };
}

/// The kernels of quantized format `t` (every format in [`super::FORMATS`]
/// but the float ones).
pub(super) fn quant_kernels(t: GgmlType) -> Option<QuantKernels> {
    use GgmlType::*;
    Some(match t {
        Q4_K => QuantKernels {
            tc16: "mm_tc_q4_k_async",
            tc32: "mm_tc_q4_k_async32g",
            tile: "mm_q4_k",
            row: "mm_q4_k_lane_1", // never chosen as `Row` (see `select`)
            glu: "mm_q4_k_lane_glu_1",
            multi: "mm_q4_k_lane_multi_1",
            moe: "mm_q4_k_lane_moe_qin_1",
            moe_glu: "mm_q4_k_lane_moe_glu_1",
        },
        Q5_K => quant_kernels!(
            "q5_k",
            "mm_tc_q5_k_async",
            "mm_tc_q5_k_async32",
            "mm_q5_k_1"
        ),
        // Eight lanes a block on one row: both nibbles of a ql byte in one lane.
        Q6_K => quant_kernels!("q6_k", "mm_tc_q6_k", "mm_tc_q6_k32", "mm_q6_k8_1"),
        Q8_0 => quant_kernels!("q8_0", "mm_tc_q8_0", "mm_tc_q8_0_32", "mm_q8_0_1"),
        Q4_0 => quant_kernels!("q4_0", "mm_tc_q4_0", "mm_tc_q4_0_32", "mm_q4_0_1"),
        Q5_0 => quant_kernels!("q5_0", "mm_tc_q5_0", "mm_tc_q5_0_32", "mm_q5_0_1"),
        Q4_1 => quant_kernels!("q4_1", "mm_tc_q4_1", "mm_tc_q4_1_32", "mm_q4_1_1"),
        Q5_1 => quant_kernels!("q5_1", "mm_tc_q5_1", "mm_tc_q5_1_32", "mm_q5_1_1"),
        IQ4_NL => quant_kernels!("iq4_nl", "mm_tc_iq4_nl", "mm_tc_iq4_nl32", "mm_iq4_nl_1"),
        MXFP4 => quant_kernels!("mxfp4", "mm_tc_mxfp4", "mm_tc_mxfp4_32", "mm_mxfp4_1"),
        IQ4_XS => quant_kernels!("iq4_xs", "mm_tc_iq4_xs", "mm_tc_iq4_xs32", "mm_iq4_xs_1"),
        Q2_K => quant_kernels!("q2_k", "mm_tc_q2_k", "mm_tc_q2_k32", "mm_q2_k_1"),
        Q3_K => quant_kernels!("q3_k", "mm_tc_q3_k", "mm_tc_q3_k32", "mm_q3_k_1"),
        IQ2_XXS => quant_kernels!(
            "iq2_xxs",
            "mm_tc_iq2_xxs",
            "mm_tc_iq2_xxs32",
            "mm_iq2_xxs_1"
        ),
        IQ2_XS => quant_kernels!("iq2_xs", "mm_tc_iq2_xs", "mm_tc_iq2_xs32", "mm_iq2_xs_1"),
        IQ2_S => quant_kernels!("iq2_s", "mm_tc_iq2_s", "mm_tc_iq2_s32", "mm_iq2_s_1"),
        IQ3_XXS => quant_kernels!(
            "iq3_xxs",
            "mm_tc_iq3_xxs",
            "mm_tc_iq3_xxs32",
            "mm_iq3_xxs_1"
        ),
        IQ3_S => quant_kernels!("iq3_s", "mm_tc_iq3_s", "mm_tc_iq3_s32", "mm_iq3_s_1"),
        _ => return None,
    })
}

/// The kernel of one matmul call. Every one computes each output element
/// with the same operations in the same order (kernels/matmul_dp4a.cu), so
/// the choice changes the speed only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MatmulKernel {
    /// Float weights, a warp per weight row and 16-row tile (`mm_f32`,
    /// `mm_f16`, `mm_bf16`): wide expert calls, calls of 2 to 16 rows of a
    /// matrix over [`ROW_REREAD_BYTES`], and the reference the other float
    /// kernels are tested against.
    FloatRows,
    /// Float weights, up to 16 rows: a warp per (weight row, activation
    /// row), a block row per activation row (`mm_f32_1`, `mm_f16_1`,
    /// `mm_bf16_1`), so the rows' load chains run side by side; the same
    /// arithmetic as [`Self::FloatRows`].
    FloatRow,
    /// Float weights, wide calls of one matrix: 4 weight rows x 16
    /// activation rows a warp (`mm_f32_tile`, `mm_f16_tile`, `mm_bf16_tile`).
    FloatTile,
    /// f32 weights of at most `MFF_ROWS` rows (a shared expert's input
    /// gate), wide calls: a warp an activation row (`mm_f32_few`).
    FloatFew,
    /// f32 weights, wide calls: 8 weight rows x 16 activation rows a warp,
    /// the operands staged by cp.async (`mm_f32_tile_w8`).
    FloatWide,
    /// Quantized weights, a warp per weight row and 16-row tile (`mm_q4_k`,
    /// `mm_q6_k`, ...: [`QuantKernels::tile`]): the reference the other
    /// quantized kernels are tested against, and calls of 2 to 16 rows of a
    /// matrix over [`ROW_REREAD_BYTES`]. Smaller ones take the row kernels:
    /// a warp's rows one after the other chain their load latencies (an
    /// 8-row Q4_K call took ~19 us against ~7 us for one row).
    Tile,
    /// Up to 16 rows, with or without expert ids: a warp per (weight row,
    /// activation row) (`mm_q5_k_1`, `mm_q6_k8_1`, ...:
    /// [`QuantKernels::row`]).
    Row,
    /// Q4_K calls of the `Row` kind: a lane per weight row, `rows` of them a
    /// block (`mm_q4_k_lane_1`: 32; `mm_q4_k_lane16_1`: 16, for matrices of
    /// at most `LANE16_ROWS` rows, twice the blocks).
    Lane { rows: usize },
    /// Wide calls of every quantized format on tensor cores, `tile`
    /// activation rows a block (see [`tc_tile`]). `live`: a routed call whose rows with no
    /// expert no one reads, left unwritten (the 32-row Q4_K kernel's
    /// `_live` form).
    TensorCore { tile: usize, live: bool },
}

impl MatmulKernel {
    /// The kernel for `w` on `input`, whose rows name experts or not.
    /// `aligned`: whether f32 weights and rows start on 16-byte boundaries
    /// (asked only of wide f32 calls whose rows are whole 16-byte pieces).
    pub(super) fn select(
        w: &Matrix,
        input: &Input,
        experts: bool,
        aligned: impl FnOnce() -> bool,
    ) -> Self {
        let m = input.m;
        let wide = m > 16;
        match w.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                if !wide && !rereads(w, m, experts) {
                    Self::FloatRow
                } else if !wide || experts {
                    Self::FloatRows
                } else if w.ty == GgmlType::F32 && w.cols.is_multiple_of(4) && aligned() {
                    if w.rows <= MFF_ROWS {
                        Self::FloatFew
                    } else {
                        Self::FloatWide
                    }
                } else {
                    Self::FloatTile
                }
            }
            _ if wide => {
                let tile = tc_tile(m, input.tile, experts);
                Self::TensorCore {
                    tile,
                    live: w.ty == GgmlType::Q4_K && tile == 32 && input.live && experts,
                }
            }
            _ if rereads(w, m, experts) => Self::Tile,
            GgmlType::Q4_K => Self::Lane {
                rows: if w.rows <= LANE16_ROWS { 16 } else { 32 },
            },
            _ => Self::Row,
        }
    }

    /// The kernel's name for weights of format `ty`, `None` where it has no
    /// form for them.
    fn name(self, ty: GgmlType) -> Option<&'static str> {
        use GgmlType::{BF16, F16, F32, Q4_K};
        Some(match (self, ty) {
            (Self::FloatRows, F32) => "mm_f32",
            (Self::FloatRows, F16) => "mm_f16",
            (Self::FloatRows, BF16) => "mm_bf16",
            (Self::FloatRow, F32) => "mm_f32_1",
            (Self::FloatRow, F16) => "mm_f16_1",
            (Self::FloatRow, BF16) => "mm_bf16_1",
            (Self::FloatTile, F32) => "mm_f32_tile",
            (Self::FloatTile, F16) => "mm_f16_tile",
            (Self::FloatTile, BF16) => "mm_bf16_tile",
            (Self::FloatFew, F32) => "mm_f32_few",
            (Self::FloatWide, F32) => "mm_f32_tile_w8",
            (Self::Lane { rows: 16 }, Q4_K) => "mm_q4_k_lane16_1",
            (Self::Lane { rows: 32 }, Q4_K) => "mm_q4_k_lane_1",
            (Self::TensorCore { tile: 32, live }, Q4_K) if live => "mm_tc_q4_k_async32g_live",
            (Self::Tile, t) => quant_kernels(t)?.tile,
            // Q4_K's one-row calls take the lane kernels (their own launch).
            (Self::Row, Q4_K) => return None,
            (Self::Row, t) => quant_kernels(t)?.row,
            (Self::TensorCore { tile: 16, .. }, t) => quant_kernels(t)?.tc16,
            (Self::TensorCore { tile: 32, .. }, t) => quant_kernels(t)?.tc32,
            _ => return None,
        })
    }
}

/// Activation rows per tile of a wide tensor-core call of `m` rows: 32
/// where there are at least `TC_ROWS32_MIN` rows per matrix (for an expert
/// call, where its plan padded each expert's rows to `plan_tile` = 32, see
/// [`Cuda::tc_pad`]), else 16.
fn tc_tile(m: usize, plan_tile: usize, experts: bool) -> usize {
    let enough = if experts {
        plan_tile == 32
    } else {
        m >= TC_ROWS32_MIN
    };
    if enough { 32 } else { TC_ROWS }
}

impl Cuda {
    /// `silu(gate . x) * (up . x)` for `m` host rows (`mats`: each row's
    /// expert, -1 for none), on [`Cuda::glu_on`]'s kernels or (`reference`)
    /// on two reference matmuls and `silu_mul`, for tests.
    #[doc(hidden)]
    pub fn glu_host(
        &self,
        gate: &Matrix,
        up: &Matrix,
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
        reference: bool,
    ) -> Result<Vec<f32>> {
        let xd = self.dev.upload(x)?;
        let md = match mats {
            Some(v) => Some(self.dev.upload(v)?),
            None => None,
        };
        let mut y = self.dev.upload(&vec![f32::NAN; m * gate.rows])?;
        let (bg, bu) = (self.wptr(gate)?, self.wptr(up)?);
        let input = Input::new(&xd, m);
        if reference {
            let mut u = self.dev.upload(&vec![f32::NAN; m * up.rows])?;
            let k = MatmulKernel::Tile;
            self.matmul_with(gate, bg, &input, md.as_ref(), &mut y, Some(k))?;
            self.matmul_with(up, bu, &input, md.as_ref(), &mut u, Some(k))?;
            let n = (m * gate.rows) as i64;
            launch!(self.dev, "silu_mul", cfg1(m * gate.rows), &mut y, &u, &n)?;
        } else {
            self.glu_on(gate, up, [bg, bu], &input, md.as_ref(), &mut y, false)?;
        }
        self.dev.download(&y, m * gate.rows)
    }

    /// `y = silu(gate . x) * (up . x)` per row (rows with a negative matrix
    /// id give 0): in one launch for decode-sized calls where gate and up
    /// share a format and shape, else two matmuls and `silu_mul`. The same
    /// bytes either way: each product is the matmul's, then silu_mul's
    /// expression. With `quant`, where the two matmuls ran and rows are a
    /// multiple of 256 wide, `y`'s Q8_K blocks too (`silu_mul_q8k_w`), for
    /// the next matmul's input.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn glu_on(
        &self,
        gate: &Matrix,
        up: &Matrix,
        bases: [u64; 2],
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
        quant: bool,
    ) -> Result<Option<CudaSlice<u8>>> {
        let m = input.m;
        let fused = m > 0
            && m <= 16
            && !rereads(gate, m, mats.is_some())
            && gate.ty == up.ty
            && (gate.rows, gate.cols, gate.row_bytes, gate.n_mats)
                == (up.rows, up.cols, up.row_bytes, up.n_mats)
            && input.cols() == gate.cols;
        let kernel = quant_kernels(gate.ty).map_or("", |k| k.glu);
        if !fused || kernel.is_empty() {
            let mut u = self.dev.scratch::<f32>(m * up.rows)?;
            // Gate and up in one tensor-core launch where each would take
            // the same kernel alone, else one each.
            if !self.tc_jobs_on(&[gate, up], &bases, input, mats, &mut [&mut *y, &mut u])? {
                self.matmul_on(gate, bases[0], input, mats, y)?;
                self.matmul_on(up, bases[1], input, mats, &mut u)?;
            }
            if quant && gate.rows.is_multiple_of(256) {
                // A warp per 256-block of the products. Rows with no expert
                // that no one reads (`live`) are left unwritten.
                let mut q = self.dev.scratch::<u8>(m * gate.rows / 256 * 304)?;
                let width = gate.rows as i32;
                let warps = cfg(((m * gate.rows / 256).div_ceil(4) as u32, 1, 1), 128, 0);
                let mi = m as i32;
                match mats.filter(|_| input.live) {
                    Some(ids) => launch!(
                        self.dev,
                        "silu_mul_q8k_wl",
                        warps,
                        y,
                        &u,
                        &mut q,
                        &width,
                        &mi,
                        ids
                    )?,
                    None => launch!(
                        self.dev,
                        "silu_mul_q8k_w",
                        warps,
                        y,
                        &u,
                        &mut q,
                        &width,
                        &mi
                    )?,
                }
                return Ok(Some(q));
            }
            let n = (m * gate.rows) as i64;
            launch!(self.dev, "silu_mul", cfg1(m * gate.rows), y, &u, &n)?;
            return Ok(None);
        }
        let d = &self.dev;
        let a = if q8_0_act(gate.ty) {
            input.q80(d)?
        } else {
            input.q8k(d)?
        };
        let nb = (gate.cols / gate.ty.block_size()) as i32;
        let stride = (gate.rows * gate.row_bytes) as i64;
        let row_bytes = gate.row_bytes as i32;
        let mats_ptr: u64 = mats.map_or(0, |s| crate::device::addr(d, s));
        let (rows, mi) = (gate.rows as i32, m as i32);
        // Q4_K on the lane kernel (a lane per weight row), the others a warp
        // per (weight row, activation row).
        let c = if gate.ty == GgmlType::Q4_K {
            lane_cfg(gate.rows, m, nb)
        } else {
            cfg((gate.rows.div_ceil(4) as u32, m as u32, 1), 128, 0)
        };
        launch!(
            d, kernel, c, &bases[0], &bases[1], &stride, &row_bytes, &mats_ptr, a, y, &rows, &mi,
            &nb
        )?;
        Ok(None)
    }

    /// One matmul call on host data, for the kernel tests: `m` rows of `x`
    /// against `w` on the default kernels. `mats`: each row's expert (-1
    /// for none), the rows placed as the expert plan places them, padded to
    /// `pad` (16 or 32) rows an expert; the rows of id -1 are then read by
    /// no one, so on the 32-row Q4_K tensor-core kernel they stay as they
    /// start, NaN.
    #[doc(hidden)]
    pub fn matmul_host(
        &self,
        w: &Matrix,
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
        pad: usize,
    ) -> Result<Vec<f32>> {
        let xd = self.dev.upload(x)?;
        let input = Input::new(&xd, m);
        let input = match mats {
            Some(_) => input.padded(pad).live(true),
            None => input,
        };
        self.matmul_host_on(w, &input, mats, None)
    }

    /// [`Cuda::matmul_host`] on the reference kernel ([`MatmulKernel::Tile`]
    /// for quantized weights, [`MatmulKernel::FloatRows`] for float ones),
    /// every row of id -1 written as zeros.
    #[doc(hidden)]
    pub fn matmul_reference_host(
        &self,
        w: &Matrix,
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
    ) -> Result<Vec<f32>> {
        let xd = self.dev.upload(x)?;
        let k = match w.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => MatmulKernel::FloatRows,
            _ => MatmulKernel::Tile,
        };
        self.matmul_host_on(w, &Input::new(&xd, m), mats, Some(k))
    }

    fn matmul_host_on(
        &self,
        w: &Matrix,
        input: &Input,
        mats: Option<&[i32]>,
        kernel: Option<MatmulKernel>,
    ) -> Result<Vec<f32>> {
        let m = input.m;
        let md = match mats {
            Some(v) => Some(self.dev.upload(v)?),
            None => None,
        };
        let mut y = self.dev.upload(&vec![f32::NAN; m * w.rows])?;
        let base = self.wptr(w)?;
        self.matmul_with(w, base, input, md.as_ref(), &mut y, kernel)?;
        self.dev.download(&y, m * w.rows)
    }

    /// `ws` on `m` host rows in one tensor-core launch (`mats`: expert ids
    /// laid out by the plan in tiles of 32, shared by every matrix, their
    /// rows of id -1 read by no one): `None` where that launch does not
    /// apply (see `tc_jobs_on`), for tests.
    #[doc(hidden)]
    pub fn tc_jobs_host(
        &self,
        ws: &[&Matrix],
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let xd = self.dev.upload(x)?;
        let md = match mats {
            Some(v) => Some(self.dev.upload(v)?),
            None => None,
        };
        let mut ys = ws
            .iter()
            .map(|w| self.dev.upload(&vec![f32::NAN; m * w.rows]))
            .collect::<Result<Vec<_>>>()?;
        let bases = ws
            .iter()
            .map(|w| self.wptr(w))
            .collect::<Result<Vec<_>>>()?;
        let input = match mats {
            Some(_) => Input::new(&xd, m).padded(32).live(true),
            None => Input::new(&xd, m),
        };
        let mut refs: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
        if !self.tc_jobs_on(ws, &bases, &input, md.as_ref(), &mut refs)? {
            return Ok(None);
        }
        ws.iter()
            .zip(&ys)
            .map(|(w, y)| self.dev.download(y, m * w.rows))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// `y = W_mat(r) · x[r]` for `m` rows; `mats` gives each row's matrix
    /// (expert), or `None` for matrix 0.
    pub(super) fn matmul(
        &self,
        w: &Matrix,
        x: &CudaSlice<f32>,
        m: usize,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.matmul_on(w, self.wptr(w)?, &Input::new(x, m), mats, y)
    }

    /// [`Self::matmul`] on a shared input (quantized once for all its matmuls).
    pub(super) fn mm(
        &self,
        w: &Matrix,
        x: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.matmul_on(w, self.wptr(w)?, x, mats, y)
    }

    /// Would a call of `w` on `input` take the 32-row Q4_K tensor-core
    /// kernel (the kernel whose several-matrix form `tc_jobs_on` launches)?
    fn takes_tc32(w: &Matrix, input: &Input, experts: bool) -> bool {
        w.ty == GgmlType::Q4_K
            && matches!(
                MatmulKernel::select(w, input, experts, || false),
                MatmulKernel::TensorCore { tile: 32, .. }
            )
    }

    /// `ys[i] = ws[i] . x` (with `bases[i]` the matrices' device addresses)
    /// for 2 to 4 Q4_K matrices of one width, row size and stack layout in
    /// one tensor-core launch (`mm_tc_q4_k_async32g_jobs`, or `_jobs_live`
    /// for routed rows read only where they name an expert) when each would
    /// take `mm_tc_q4_k_async32g` alone: every output is that kernel's.
    /// Returns false, launching nothing, otherwise.
    pub(super) fn tc_jobs_on(
        &self,
        ws: &[&Matrix],
        bases: &[u64],
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<bool> {
        let Some(first) = ws.first() else {
            return Ok(false);
        };
        let same = ws.iter().all(|w| {
            (w.ty, w.cols, w.row_bytes, w.n_mats)
                == (first.ty, first.cols, first.row_bytes, first.n_mats)
                && (mats.is_none() || w.rows == first.rows)
        });
        let ok = (2..=4).contains(&ws.len())
            && ws.len() == bases.len()
            && ws.len() == ys.len()
            && same
            && input.cols() == first.cols
            && ws
                .iter()
                .all(|w| Self::takes_tc32(w, input, mats.is_some()))
            && ys.iter().zip(ws).all(|(y, w)| y.len() >= input.m * w.rows);
        if !ok {
            return Ok(false);
        }
        let d = &self.dev;
        let a = input.q8k(d)?;
        let mut mj = crate::device::MmJobs::default();
        let mut tiles = 0u32;
        for (i, (w, y)) in ws.iter().zip(ys.iter()).enumerate() {
            mj.w[i] = bases[i];
            mj.y[i] = crate::device::addr(d, &**y);
            mj.rows[i] = w.rows as i32;
            tiles += w.rows.div_ceil(TQ_WROWS) as u32;
        }
        mj.nj = ws.len() as i32;
        let stride = (first.rows * first.row_bytes) as i64;
        let row_bytes = first.row_bytes as i32;
        let mats_ptr: u64 = mats.map_or(0, |s| crate::device::addr(d, s));
        let (mi, nb) = (input.m as i32, (first.cols / 256) as i32);
        let ct = cfg(
            (tiles, input.m.div_ceil(32) as u32, 1),
            128,
            tc_async_smem(false, 32),
        );
        launch!(
            d,
            if input.live && mats.is_some() {
                "mm_tc_q4_k_async32g_jobs_live"
            } else {
                "mm_tc_q4_k_async32g_jobs"
            },
            ct,
            &mj,
            &stride,
            &row_bytes,
            &mats_ptr,
            a,
            &mi,
            &nb
        )?;
        Ok(true)
    }

    /// `ys[i] = ws[i] . x` for up to four matrices sharing the input: one
    /// launch (`mm_q4_k_lane_multi_1`, `mm_*_multi_1`) for one-row calls
    /// where every matrix has one format, width and row size; for wide
    /// calls, the matrices that take the 32-row Q4_K tensor-core kernel in
    /// one launch where there are two or more; else one matmul each. The
    /// same bytes either way: each row is the single matmul's.
    pub(super) fn mm_group(
        &self,
        input: &Input,
        jobs: &mut [(&Matrix, &mut CudaSlice<f32>)],
    ) -> Result<()> {
        let first = jobs.first().map(|(w, _)| (w.ty, w.cols, w.row_bytes));
        // Q4_K's: a lane per weight row.
        let kernel = first
            .and_then(|f| quant_kernels(f.0))
            .map_or("", |k| k.multi);
        let grouped = input.m == 1
            && !kernel.is_empty()
            && (2..=4).contains(&jobs.len())
            && jobs.iter().all(|(w, y)| {
                Some((w.ty, w.cols, w.row_bytes)) == first && w.n_mats == 1 && y.len() >= w.rows
            })
            && input.cols() == jobs[0].0.cols;
        if !grouped {
            // The input's width fixes every matrix's columns, and Q4_K
            // fixes their row size: tc_jobs_on's shape checks hold.
            let mut rest: Vec<usize> = (0..jobs.len()).collect();
            let tc: Vec<usize> = (0..jobs.len())
                .filter(|&i| Self::takes_tc32(jobs[i].0, input, false))
                .collect();
            if tc.len() >= 2 {
                let ws: Vec<&Matrix> = tc.iter().map(|&i| jobs[i].0).collect();
                let bases = ws
                    .iter()
                    .map(|w| self.wptr(w))
                    .collect::<Result<Vec<_>>>()?;
                let mut ys: Vec<&mut CudaSlice<f32>> = jobs
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| tc.contains(i))
                    .map(|(_, (_, y))| &mut **y)
                    .collect();
                if self.tc_jobs_on(&ws, &bases, input, None, &mut ys)? {
                    rest.retain(|i| !tc.contains(i));
                }
            }
            for i in rest {
                let (w, y) = &mut jobs[i];
                self.mm(w, input, None, y)?;
            }
            return Ok(());
        }
        let d = &self.dev;
        let (ty, cols, row_bytes) = first.expect("jobs is not empty");
        let a = if q8_0_act(ty) {
            input.q80(d)?
        } else {
            input.q8k(d)?
        };
        let lane = ty == GgmlType::Q4_K;
        let per = if lane { 32 } else { 4 };
        let mut mj = crate::device::MmJobs::default();
        let mut blocks = 0u32;
        for (i, (w, y)) in jobs.iter().enumerate() {
            mj.w[i] = self.wptr(w)?;
            mj.y[i] = crate::device::addr(d, y);
            mj.rows[i] = w.rows as i32;
            blocks += w.rows.div_ceil(per) as u32;
        }
        mj.nj = jobs.len() as i32;
        let nb = (cols / ty.block_size()) as i32;
        let (rb, mi) = (row_bytes as i32, 1i32);
        let threads = if lane { lane_threads(nb) } else { 128 };
        launch!(
            d,
            kernel,
            cfg((blocks, 1, 1), threads, 0),
            &mj,
            &rb,
            a,
            &mi,
            &nb
        )
    }

    /// `m` host rows quantized to Q8_0 blocks as the matmuls read them (32
    /// quants, then d as f32: 36 bytes a block), for tests.
    #[doc(hidden)]
    pub fn quantize_q8_0_host(&self, x: &[f32], m: usize) -> Result<Vec<u8>> {
        let xd = self.dev.upload(x)?;
        let input = Input::new(&xd, m);
        let q = input.q80(&self.dev)?;
        self.dev.download(q, m * (x.len() / m) / 32 * 36)
    }

    /// Matmuls of `ws` on host rows through [`Cuda::mm_group`] (`grouped`) or
    /// one matmul each, for tests.
    #[doc(hidden)]
    pub fn mm_group_host(
        &self,
        ws: &[&Matrix],
        x: &[f32],
        m: usize,
        grouped: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let xd = self.dev.upload(x)?;
        let mut ys = ws
            .iter()
            .map(|w| self.dev.upload(&vec![f32::NAN; m * w.rows]))
            .collect::<Result<Vec<_>>>()?;
        let input = Input::new(&xd, m);
        if grouped {
            let mut jobs: Vec<(&Matrix, &mut CudaSlice<f32>)> =
                ws.iter().copied().zip(ys.iter_mut()).collect();
            self.mm_group(&input, &mut jobs)?;
        } else {
            for (w, y) in ws.iter().zip(ys.iter_mut()) {
                self.mm(w, &input, None, y)?;
            }
        }
        ws.iter()
            .zip(&ys)
            .map(|(w, y)| self.dev.download(y, m * w.rows))
            .collect()
    }

    /// The expert plan's padding for `n` (token, expert) pairs over `e`
    /// experts in a wide call: the tensor-core tile its calls will take
    /// (32 with at least `TC_ROWS32_MIN` pairs an expert on average, else 16).
    pub(super) fn tc_pad(&self, n: usize, e: usize) -> usize {
        if n >= TC_ROWS32_MIN * e { 32 } else { TC_ROWS }
    }

    /// A matmul reading `w`'s stacked matrices at device address `base`, on
    /// the kernel [`MatmulKernel::select`] picks.
    pub(super) fn matmul_on(
        &self,
        w: &Matrix,
        base: u64,
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.matmul_with(w, base, input, mats, y, None)
    }

    /// [`Cuda::matmul_on`] on `kernel` where given (the tests' reference
    /// kernel), else on the selected one.
    fn matmul_with(
        &self,
        w: &Matrix,
        base: u64,
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
        kernel: Option<MatmulKernel>,
    ) -> Result<()> {
        let m = input.m;
        if input.cols() != w.cols {
            return Err(CudaError::Driver {
                op: "matmul".into(),
                msg: format!(
                    "{}: rows of {} for {} columns",
                    w.name,
                    input.cols(),
                    w.cols
                ),
            });
        }
        if m == 0 {
            return Ok(());
        }
        let d = &self.dev;
        let wptr = base;
        let stride = (w.rows * w.row_bytes) as i64;
        let row_bytes = w.row_bytes as i32;
        let mats_ptr: u64 = mats.map_or(0, |s| crate::device::addr(d, s));
        let (rows, mi, cols) = (w.rows as i32, m as i32, w.cols as i32);
        let unsupported = || CudaError::Unsupported {
            tensor: w.name.clone(),
            ty: format!("{:?}", w.ty),
        };
        if !FORMATS.contains(&w.ty) {
            return Err(unsupported());
        }
        // A warp per weight row and 16-row tile (also the float rows kernel's
        // launch), four weight rows a warp, a warp per (weight row, row).
        let tile = cfg(
            (w.rows.div_ceil(4) as u32, m.div_ceil(16) as u32, 1),
            128,
            0,
        );
        let tile4 = cfg(
            (w.rows.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
            128,
            0,
        );
        let row = cfg((w.rows.div_ceil(4) as u32, m as u32, 1), 128, 0);
        if matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            let x = input.f32_rows()?;
            let k = kernel.unwrap_or_else(|| {
                MatmulKernel::select(w, input, mats.is_some(), || {
                    // 16-byte pieces: whole ones a row, aligned.
                    wptr.is_multiple_of(16) && addr(d, x).is_multiple_of(16)
                })
            });
            let name = k.name(w.ty).ok_or_else(unsupported)?;
            return match k {
                MatmulKernel::FloatRow => launch!(
                    d, name, row, &wptr, &stride, &row_bytes, &mats_ptr, x, y, &rows, &mi, &cols
                ),
                MatmulKernel::FloatRows => launch!(
                    d, name, tile, &wptr, &stride, &row_bytes, &mats_ptr, x, y, &rows, &mi, &cols
                ),
                _ => {
                    let c = match k {
                        MatmulKernel::FloatFew => cfg((m.div_ceil(4) as u32, 1, 1), 128, 0),
                        // 8 weight rows x 16 activation rows a warp, 4 warps
                        // a block sharing the activation rows.
                        MatmulKernel::FloatWide => cfg(
                            (w.rows.div_ceil(32) as u32, m.div_ceil(16) as u32, 1),
                            128,
                            MFW_SMEM,
                        ),
                        // 4 weight rows x 16 activation rows a warp.
                        _ => tile4,
                    };
                    launch!(d, name, c, &wptr, &row_bytes, x, y, &rows, &mi, &cols)
                }
            };
        }
        let nbi = (w.cols / w.ty.block_size()) as i32;
        let a = if q8_0_act(w.ty) {
            input.q80(d)?
        } else {
            input.q8k(d)?
        };
        let k = kernel.unwrap_or_else(|| MatmulKernel::select(w, input, mats.is_some(), || false));
        let name = k.name(w.ty).ok_or_else(unsupported)?;
        let (c, label) = match k {
            MatmulKernel::Row => (row, name),
            MatmulKernel::Lane { rows: rb } => (lane_cfg_rows(w.rows, m, nbi, rb), name),
            MatmulKernel::TensorCore { tile, .. } => {
                // The async kernels' two stages of shared memory (see
                // TaLayout in matmul_tc.cu).
                let c = cfg(
                    (w.rows.div_ceil(128) as u32, m.div_ceil(tile) as u32, 1),
                    128,
                    tc_smem(w.ty, tile),
                );
                // Profiles split the tensor-core launches by kind and
                // reduction length (the K loop's blocks against the tile's
                // fixed costs).
                let label = match (mats.is_some(), nbi) {
                    _ if !d.profiling() => name,
                    (true, 2) => "mm_tc (experts, K 512)",
                    (true, 8) => "mm_tc (experts, K 2048)",
                    (true, _) => "mm_tc (experts, other K)",
                    (false, 2) => "mm_tc (dense, K 512)",
                    (false, 8) if w.rows < TQ_WROWS => "mm_tc (dense, K 2048, < 128 rows)",
                    (false, 8) => "mm_tc (dense, K 2048)",
                    (false, 16) => "mm_tc (dense, K 4096)",
                    (false, _) => "mm_tc (dense, other K)",
                };
                (c, label)
            }
            _ => (tile, name),
        };
        launch_as!(
            d, name, label, c, &wptr, &stride, &row_bytes, &mats_ptr, a, y, &rows, &mi, &nbi
        )
    }
}

/// `FmtQ6K::load` (matmul_dp4a.cu) reads a group's 16 ql and 16 qh bytes with
/// five aligned words each (`ld16_a2`) where it read two bytes at a time
/// (`q6_word`): the same four words for every group, on blocks at both
/// 2-byte alignments. A host model of both; the GPU tests compare the
/// kernels' outputs.
#[cfg(test)]
mod q6_load_tests {
    use samesum_quant::rng::Rng;

    fn le32(m: &[u8], at: usize) -> u32 {
        u32::from_le_bytes([m[at], m[at + 1], m[at + 2], m[at + 3]])
    }

    fn vsub4(a: u32, b: u32) -> u32 {
        u32::from_le_bytes(std::array::from_fn(|i| {
            (a.to_le_bytes()[i]).wrapping_sub(b.to_le_bytes()[i])
        }))
    }

    /// q6_word(b, e) with the block at byte `b` of memory `m`.
    fn q6_word(m: &[u8], b: usize, e: usize) -> u32 {
        let (n, r) = (e / 128, e % 128);
        let lo = (le32(m, b + n * 64 + r % 64) >> (4 * (r / 64))) & 0x0F0F0F0F;
        let hi = (le32(m, b + 128 + n * 32 + r % 32) >> (2 * (r / 32))) & 0x03030303;
        vsub4(lo | (hi << 4), 0x20202020)
    }

    /// ld16_a2: aligned words around p, funnel-shifted.
    fn ld16_a2(m: &[u8], p: usize) -> [u32; 4] {
        let a = p & !3;
        let sh = ((p & 3) * 8) as u32;
        let x: Vec<u32> = (0..5).map(|i| le32(m, a + 4 * i)).collect();
        std::array::from_fn(|i| (((x[i + 1] as u64) << 32 | x[i] as u64) >> sh) as u32)
    }

    fn load(m: &[u8], b: usize, g: usize) -> [u32; 4] {
        let (n, h) = (g / 8, g % 8);
        let ql = ld16_a2(m, b + n * 64 + 16 * (h % 4));
        let qh = ld16_a2(m, b + 128 + n * 32 + 16 * (h % 2));
        let (sl, shh) = (4 * (h / 4), 2 * (h / 2));
        std::array::from_fn(|i| {
            vsub4(
                ((ql[i] >> sl) & 0x0F0F0F0F) | (((qh[i] >> shh) & 0x03030303) << 4),
                0x20202020,
            )
        })
    }

    #[test]
    fn whole_runs_give_the_words_of_two_byte_reads() {
        let mut rng = Rng::new(6);
        for _ in 0..200 {
            let m: Vec<u8> = (0..1024).map(|_| rng.below(256) as u8).collect();
            // Blocks at 4-byte and at 2-byte (odd blocks of a row) alignment.
            for b in [0usize, 210, 420, 630, 4 + 2] {
                for g in 0..16 {
                    let want: [u32; 4] = std::array::from_fn(|i| q6_word(&m, b, 16 * g + 4 * i));
                    assert_eq!(load(&m, b, g), want, "block at {b}, group {g}");
                }
            }
        }
        // A run read from the wrong place would differ: shift the ql run.
        let m: Vec<u8> = (0..1024).map(|i| (i * 7 + 3) as u8).collect();
        let wrong = ld16_a2(&m, 210 + 2);
        let right = ld16_a2(&m, 210);
        assert_ne!(wrong, right);
    }
}

/// Every kernel the host names for a quantized format is one the matmul
/// module defines (a misspelled or missing name would fail only at launch,
/// on a GPU).
#[cfg(test)]
mod kernel_name_tests {
    use super::{FORMATS, GgmlType, quant_kernels};

    #[test]
    fn every_quantized_format_names_defined_kernels() {
        let (_, src) = crate::compile::MODULES
            .iter()
            .find(|(n, _)| *n == "matmul")
            .expect("the matmul module");
        let defined = crate::compile::kernels_defined(src);
        let mut checked = 0;
        for &t in FORMATS {
            let Some(k) = quant_kernels(t) else {
                assert!(
                    matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16),
                    "{t:?} has no kernels"
                );
                continue;
            };
            for name in [
                k.tc16, k.tc32, k.tile, k.row, k.glu, k.multi, k.moe, k.moe_glu,
            ] {
                assert!(
                    defined.iter().any(|d| d == name),
                    "{t:?}: {name} is not defined"
                );
                checked += 1;
            }
        }
        assert!(checked >= 8 * 16, "only {checked} names checked");
    }
}

/// Q4_1 and Q5_1 as `FmtNib32` (matmul_nib.cu) computes them, modelled on
/// the host: `Nib32::values`'s unpacking of a qs word (and the fifth bits
/// from qh) gives the values ggml's dequantizer gives, and the per-block
/// sums and float step (`step_min` with dmin = -m, the activation block's
/// quant sum as msum) give the dot of the dequantized weights and Q8_0
/// activations within f32 rounding, and the CPU's Q8_1 dot within its f16
/// rounding of `s`. The GPU tests compare the kernels' outputs.
#[cfg(test)]
mod nib_offset_tests {
    use half::f16;
    use samesum_gguf::GgmlType;
    use samesum_quant::dot::{ActRow, dot};
    use samesum_quant::rng::Rng;

    fn le32(m: &[u8], at: usize) -> u32 {
        u32::from_le_bytes([m[at], m[at + 1], m[at + 2], m[at + 3]])
    }

    /// `Nib32<KIND>::values` for KIND 4 (Q4_1) and 5 (Q5_1): values 4j..4j+3
    /// (hi = 0) or 16+4j.. (hi = 1) as the bytes of a word.
    fn values(q5: bool, w: u32, qh: u32, j: usize, hi: usize) -> u32 {
        let n = (w >> (4 * hi)) & 0x0F0F0F0F;
        if !q5 {
            return n;
        }
        let hb = (qh >> (16 * hi + 4 * j)) & 0xF;
        let h = (hb & 1) | ((hb & 2) << 7) | ((hb & 4) << 14) | ((hb & 8) << 21);
        n | (h << 4)
    }

    /// A row of `nb` blocks: random quants, d and m small normal halves.
    fn row(rng: &mut Rng, q5: bool, nb: usize) -> Vec<u8> {
        let by = if q5 { 24 } else { 20 };
        let mut w: Vec<u8> = (0..nb * by).map(|_| rng.below(256) as u8).collect();
        for b in 0..nb {
            let d = f16::from_f32(rng.range(0.001, 0.05));
            let m = f16::from_f32(rng.range(-0.4, 0.4));
            w[b * by..b * by + 2].copy_from_slice(&d.to_le_bytes());
            w[b * by + 2..b * by + 4].copy_from_slice(&m.to_le_bytes());
        }
        w
    }

    #[test]
    fn unpacking_and_step_give_the_dot() {
        let mut rng = Rng::new(17);
        for (ty, q5) in [(GgmlType::Q4_1, false), (GgmlType::Q5_1, true)] {
            let (by, qs_at) = if q5 { (24, 8) } else { (20, 4) };
            for _ in 0..50 {
                let nb = 1 + rng.below(24) as usize;
                let w = row(&mut rng, q5, nb);
                let x: Vec<f32> = (0..nb * 32).map(|_| rng.range(-2.0, 2.0)).collect();
                let mut deq = vec![0f32; nb * 32];
                samesum_quant::dequant::dequantize(ty, &w, &mut deq).unwrap();
                let (mut acc, mut exact, mut mag) = (0f32, 0f64, 0f64);
                for b in 0..nb {
                    let blk = &w[b * by..(b + 1) * by];
                    let a =
                        samesum_quant::quantize::q8_0(x[32 * b..32 * b + 32].try_into().unwrap());
                    let da = a.d.to_f32();
                    let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    let dmin = -f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                    let qh = if q5 { le32(blk, 4) } else { 0 };
                    let (mut isum, mut msum) = (0i32, 0i32);
                    // Part s of FmtNib32: values 16s..16s+15.
                    for s in 0..2 {
                        for j in 0..4 {
                            let v = values(q5, le32(blk, qs_at + 4 * j), qh, j, s);
                            for (i, q) in v.to_le_bytes().into_iter().enumerate() {
                                let e = 16 * s + 4 * j + i;
                                assert!(q < if q5 { 32 } else { 16 });
                                // ggml's value of element e: d q + m.
                                assert_eq!(
                                    d * q as f32 - dmin,
                                    deq[32 * b + e],
                                    "{ty:?} block {b} element {e}"
                                );
                                isum += q as i32 * a.qs[e] as i32;
                                msum += a.qs[e] as i32;
                                let xe = deq[32 * b + e] as f64 * (da as f64 * a.qs[e] as f64);
                                exact += xe;
                                mag += xe.abs();
                            }
                        }
                    }
                    // step_min.
                    acc += (d * da) * isum as f32;
                    acc -= (dmin * da) * msum as f32;
                }
                let err = (acc as f64 - exact).abs();
                assert!(
                    err <= 1e-5 * mag,
                    "{ty:?}: {acc} against {exact} (scale {mag})"
                );
                let cpu = dot(ty, &w, &ActRow::quantize(ty, &x).unwrap()).unwrap();
                let err = (cpu as f64 - acc as f64).abs();
                assert!(
                    err <= 2e-3 * mag,
                    "{ty:?}: CPU {cpu} against {acc} (scale {mag})"
                );
            }
        }
    }
}

/// Which kernel calls of a few rows take: the row kernels (or Q4_K's lane
/// kernels) for one matrix's rows and for expert rows, the tile kernel for a
/// matrix too large to sweep once per row.
#[cfg(test)]
mod select_tests {
    use super::*;

    fn mat(ty: GgmlType, rows: usize, cols: usize, n_mats: usize) -> Matrix {
        let row_bytes = cols / ty.block_size() * ty.type_size();
        Matrix {
            name: "w".into(),
            ty,
            cols,
            rows,
            n_mats,
            offset: 0,
            row_bytes,
        }
    }

    fn pick(w: &Matrix, m: usize, experts: bool) -> MatmulKernel {
        let input = Input {
            x: None,
            m,
            cols: w.cols,
            q8k: std::cell::OnceCell::new(),
            q80: std::cell::OnceCell::new(),
            given_q8k: None,
            tile: 16,
            live: false,
        };
        MatmulKernel::select(w, &input, experts, || true)
    }

    #[test]
    fn few_rows_sweep_a_matrix_per_row_only_where_it_stays_in_l2() {
        // A 248,320-token Q6_K head (417 MB) and a Q8_0 projection (17.8 MB).
        let head = mat(GgmlType::Q6_K, 248_320, 2048, 1);
        let qkv = mat(GgmlType::Q8_0, 8192, 2048, 1);
        assert!(head.rows * head.row_bytes > ROW_REREAD_BYTES);
        assert!(qkv.rows * qkv.row_bytes <= ROW_REREAD_BYTES);
        assert_eq!(pick(&head, 1, false), MatmulKernel::Row);
        for m in [2, 8, 16] {
            assert_eq!(pick(&head, m, false), MatmulKernel::Tile, "head m={m}");
            assert_eq!(pick(&qkv, m, false), MatmulKernel::Row, "qkv m={m}");
        }
        assert!(matches!(
            pick(&head, 17, false),
            MatmulKernel::TensorCore { .. }
        ));
        // Q4_K: the lane kernels, the tile kernel for a head of its size.
        let q4 = mat(GgmlType::Q4_K, 4096, 2048, 1);
        let q4_head = mat(GgmlType::Q4_K, 248_320, 2048, 1);
        assert_eq!(pick(&q4, 8, false), MatmulKernel::Lane { rows: 16 });
        assert_eq!(pick(&q4_head, 8, false), MatmulKernel::Tile);
        assert_eq!(pick(&q4_head, 1, false), MatmulKernel::Lane { rows: 32 });
        // Expert rows each read their own expert: never a sweep per row of
        // one matrix, whatever the stack's size.
        let experts = mat(GgmlType::Q6_K, 512, 2048, 512);
        assert_eq!(pick(&experts, 8, true), MatmulKernel::Row);
        // Float heads keep the 16-row tile form: a bf16 head of 1 GB, a
        // router of 2 MB.
        let bf16_head = mat(GgmlType::BF16, 248_320, 2048, 1);
        let router = mat(GgmlType::F32, 256, 2048, 1);
        assert_eq!(pick(&bf16_head, 8, false), MatmulKernel::FloatRows);
        assert_eq!(pick(&bf16_head, 1, false), MatmulKernel::FloatRow);
        assert_eq!(pick(&router, 8, false), MatmulKernel::FloatRow);
        let float_experts = mat(GgmlType::BF16, 512, 2048, 128);
        assert_eq!(pick(&float_experts, 8, true), MatmulKernel::FloatRow);
        assert_eq!(pick(&float_experts, 24, true), MatmulKernel::FloatRows);
    }
}
