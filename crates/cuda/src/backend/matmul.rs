//! Matmuls: the per-format kernels, the tensor-core jobs and groups, the
//! fused GLU, chosen by shape and format.

use super::*;

impl Cuda {
    /// `silu(gate . x) * (up . x)` for `m` host rows through
    /// [`Cuda::glu_on`]'s choice of kernels (for tests).
    #[doc(hidden)]
    pub fn glu_host(
        &self,
        gate: &Matrix,
        up: &Matrix,
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
    ) -> Result<Vec<f32>> {
        let xd = self.dev.upload(x)?;
        let md = match mats {
            Some(v) => Some(self.dev.upload(v)?),
            None => None,
        };
        let mut y = self.dev.upload(&vec![f32::NAN; m * gate.rows])?;
        let (bg, bu) = (self.wptr(gate)?, self.wptr(up)?);
        self.glu_on(
            gate,
            up,
            [bg, bu],
            &Input::new(&xd, m),
            md.as_ref(),
            &mut y,
            false,
        )?;
        self.dev.download(&y, m * gate.rows)
    }

    /// `y = silu(gate . x) * (up . x)` per row (rows with a negative matrix
    /// id give 0): in one launch for decode-sized calls where gate and up
    /// share a format and shape, else two matmuls and `silu_mul`. The same
    /// bytes either way: each product is the matmul's, then silu_mul's
    /// expression. With `quant`, where the two matmuls ran, `y`'s Q8_K
    /// blocks too (`silu_mul_q8k`, with the `SILU_Q8K` switch on and rows a
    /// multiple of 256 wide), for the next matmul's input; where they are
    /// returned with `SILU_REGS` on, `y` keeps the gate's outputs and the
    /// blocks alone hold the GLU's (every K-quant matmul reads them).
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
        let fused = self.glu
            && self.row_kernels
            && m > 0
            && m <= 16
            && (m == 1 || mats.is_some())
            && gate.ty == up.ty
            && (gate.rows, gate.cols, gate.row_bytes, gate.n_mats)
                == (up.rows, up.cols, up.row_bytes, up.n_mats)
            && input.cols() == gate.cols;
        let kernel = match gate.ty {
            GgmlType::Q4_K => "mm_q4_k_glu_1",
            GgmlType::Q5_K => "mm_q5_k_glu_1",
            GgmlType::Q6_K => "mm_q6_k_glu_1",
            GgmlType::Q8_0 => "mm_q8_0_glu_1",
            _ => "",
        };
        if !fused || kernel.is_empty() {
            let mut u = self.dev.scratch::<f32>(m * up.rows)?;
            // Gate and up in one tensor-core launch where each would take
            // the same kernel alone (TC_JOBS), else one each.
            if !self.tc_jobs_on(&[gate, up], &bases, input, mats, &mut [&mut *y, &mut u])? {
                self.matmul_on(gate, bases[0], input, mats, y, self.tensor_cores)?;
                self.matmul_on(up, bases[1], input, mats, &mut u, self.tensor_cores)?;
            }
            if quant && self.silu_q8k && gate.rows.is_multiple_of(256) {
                let mut q = self.dev.scratch::<u8>(m * gate.rows / 256 * 304)?;
                let width = gate.rows as i32;
                let warps = cfg(((m * gate.rows / 256).div_ceil(4) as u32, 1, 1), 128, 0);
                let mi = m as i32;
                match mats.filter(|_| input.live && !self.silu_regs) {
                    Some(ids) if self.silu_warp => {
                        launch!(
                            self.dev,
                            "silu_mul_q8k_wl",
                            warps,
                            y,
                            &u,
                            &mut q,
                            &width,
                            &mi,
                            ids
                        )?;
                    }
                    _ if self.silu_warp => {
                        launch!(
                            self.dev,
                            if self.silu_regs {
                                "silu_mul_q8k_wr"
                            } else {
                                "silu_mul_q8k_w"
                            },
                            warps,
                            y,
                            &u,
                            &mut q,
                            &width,
                            &mi
                        )?;
                    }
                    _ => {
                        launch!(
                            self.dev,
                            "silu_mul_q8k",
                            cfg((m as u32, 1, 1), 256, 0),
                            y,
                            &u,
                            &mut q,
                            &width
                        )?;
                    }
                }
                return Ok(Some(q));
            }
            let n = (m * gate.rows) as i64;
            launch!(self.dev, "silu_mul", cfg1(m * gate.rows), y, &u, &n)?;
            return Ok(None);
        }
        let d = &self.dev;
        let a = if gate.ty == GgmlType::Q8_0 {
            input.q80(d)?
        } else {
            input.q8k(d)?
        };
        let nb = (gate.cols / if gate.ty == GgmlType::Q8_0 { 32 } else { 256 }) as i32;
        let stride = (gate.rows * gate.row_bytes) as i64;
        let row_bytes = gate.row_bytes as i32;
        let mats_ptr: u64 = mats.map_or(0, |s| crate::device::addr(d, s));
        let (rows, mi) = (gate.rows as i32, m as i32);
        let (kernel, c) = if self.lane_rows && gate.ty == GgmlType::Q4_K {
            ("mm_q4_k_lane_glu_1", lane_cfg(gate.rows, m, nb))
        } else {
            (
                kernel,
                cfg((gate.rows.div_ceil(4) as u32, m as u32, 1), 128, 0),
            )
        };
        launch!(
            d, kernel, c, &bases[0], &bases[1], &stride, &row_bytes, &mats_ptr, a, y, &rows, &mi,
            &nb
        )?;
        Ok(None)
    }

    /// One matmul call on host data, for the kernel tests: `m` rows of `x`
    /// against `w` (`mats` per row, -1 for none), on the tensor-core kernels
    /// where they apply or (with `tensor_cores` false) on the dp4a kernels.
    /// The output starts NaN-poisoned; with `LIVE_ROWS` on and `mats`
    /// given, rows of id -1 may stay so.
    #[doc(hidden)]
    pub fn matmul_host(
        &self,
        w: &Matrix,
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
        tensor_cores: bool,
    ) -> Result<Vec<f32>> {
        let xd = self.dev.upload(x)?;
        let md = match mats {
            Some(v) => Some(self.dev.upload(v)?),
            None => None,
        };
        let mut y = self.dev.upload(&vec![f32::NAN; m * w.rows])?;
        let base = self.wptr(w)?;
        self.matmul_on(
            w,
            base,
            &Input::new(&xd, m).live(self.live_rows && mats.is_some()),
            md.as_ref(),
            &mut y,
            tensor_cores,
        )?;
        self.dev.download(&y, m * w.rows)
    }

    /// `ws` on `m` host rows in one tensor-core launch (`TC_JOBS`; `mats`:
    /// expert ids laid out in tiles of 32 by the plan, shared by every
    /// matrix): `None` when that launch does not apply (see `tc_jobs_on`),
    /// for tests.
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
        // Expert ids come laid out as the plan pads them for 32-row tiles.
        let input = Input::new(&xd, m).padded(if mats.is_some() { 32 } else { TC_ROWS });
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
        self.matmul_on(
            w,
            self.wptr(w)?,
            &Input::new(x, m),
            mats,
            y,
            self.tensor_cores,
        )
    }

    /// [`Self::matmul`] on a shared input (quantized once for all its matmuls).
    pub(super) fn mm(
        &self,
        w: &Matrix,
        x: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.matmul_on(w, self.wptr(w)?, x, mats, y, self.tensor_cores)
    }

    /// The tensor-core kernel and tile rows for `w` on `input` (expert
    /// stacks or not), or `None` where the call takes the dp4a kernels:
    /// calls of up to 16 rows, formats other than Q4_K/Q5_K, tensor cores
    /// off, and (with `tc_small`) plain matrices under one tile's 128 rows.
    pub(super) fn tc_kernel_for(
        &self,
        w: &Matrix,
        input: &Input,
        experts: bool,
        tensor_cores: bool,
    ) -> Option<(&'static str, usize)> {
        // A plain matrix of fewer rows than a tensor-core tile's 128 (a
        // delta net's beta and alpha: 32) would run a few blocks, each
        // mostly unused rows: the dp4a kernels spread it over the GPU.
        let small = self.tc_small && !experts && w.rows < TQ_WROWS;
        if input.m <= 16
            || !tensor_cores
            || small
            || !matches!(w.ty, GgmlType::Q4_K | GgmlType::Q5_K)
        {
            return None;
        }
        let tile = self.tc_tile(input.m, input.tile, experts);
        let q4 = w.ty == GgmlType::Q4_K;
        let g = self.tc_occ3 && self.tc_mins && self.tc_groups;
        let k = match (self.tc_kernel, tile) {
            (TcKernel::Plain, _) if q4 => "mm_tc_q4_k",
            (TcKernel::Plain, _) => "mm_tc_q5_k",
            (TcKernel::Pipelined, _) if q4 => "mm_tc_q4_k_pipe",
            (TcKernel::Pipelined, _) => "mm_tc_q5_k_pipe",
            (_, 32) if q4 && g && self.tc_w8 => "mm_tc_q4_k_async32w",
            (_, 32) if q4 && g => "mm_tc_q4_k_async32g",
            (_, 32) if q4 && self.tc_occ3 && self.tc_mins => "mm_tc_q4_k_async32m",
            (_, 32) if q4 && self.tc_occ3 => "mm_tc_q4_k_async32",
            (_, 32) if q4 => "mm_tc_q4_k_async32_b2",
            (_, 32) => "mm_tc_q5_k_async32",
            _ if q4 => "mm_tc_q4_k_async",
            _ => "mm_tc_q5_k_async",
        };
        Some((k, tile))
    }

    /// Would a wide call of `w` take `mm_tc_q4_k_async32g` (the kernel
    /// whose several-matrix form `tc_jobs_on` launches)?
    pub(super) fn takes_tc32g(&self, w: &Matrix, input: &Input, experts: bool) -> bool {
        self.tc_kernel_for(w, input, experts, self.tensor_cores)
            .is_some_and(|(k, _)| k == "mm_tc_q4_k_async32g")
    }

    /// `ys[i] = ws[i] . x` (with `bases[i]` the matrices' device addresses)
    /// for 2 to 4 Q4_K matrices of one width, row size and stack layout in
    /// one tensor-core launch (`mm_tc_q4_k_async32g_jobs`, `TC_JOBS`) when
    /// each would take `mm_tc_q4_k_async32g` alone: every output is that
    /// kernel's. Returns false, launching nothing, otherwise.
    pub(super) fn tc_jobs_on(
        &self,
        ws: &[&Matrix],
        bases: &[u64],
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<bool> {
        let Some(first) = ws.first().filter(|_| self.tc_jobs) else {
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
                .all(|w| self.takes_tc32g(w, input, mats.is_some()))
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
            match (input.live && mats.is_some(), self.tc_wsmem) {
                (true, false) => "mm_tc_q4_k_async32g_jobs_live",
                (false, false) => "mm_tc_q4_k_async32g_jobs",
                (true, true) => "mm_tc_q4_k_async32g_jobs_live_ws",
                (false, true) => "mm_tc_q4_k_async32g_jobs_ws",
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
    /// launch (`mm_*_multi_1`) for one-row calls where every matrix has one
    /// format, width and row size, else one matmul each. The same bytes
    /// either way: each row is the one-row kernel's.
    pub(super) fn mm_group(
        &self,
        input: &Input,
        jobs: &mut [(&Matrix, &mut CudaSlice<f32>)],
    ) -> Result<()> {
        let first = jobs.first().map(|(w, _)| (w.ty, w.cols, w.row_bytes));
        let kernel = match first.map(|f| f.0) {
            Some(GgmlType::Q4_K) => "mm_q4_k_multi_1",
            Some(GgmlType::Q5_K) => "mm_q5_k_multi_1",
            Some(GgmlType::Q6_K) => "mm_q6_k_multi_1",
            Some(GgmlType::Q8_0) => "mm_q8_0_multi_1",
            _ => "",
        };
        let grouped = self.row_kernels
            && self.multi
            && input.m == 1
            && !kernel.is_empty()
            && (2..=4).contains(&jobs.len())
            && jobs.iter().all(|(w, y)| {
                Some((w.ty, w.cols, w.row_bytes)) == first && w.n_mats == 1 && y.len() >= w.rows
            })
            && input.cols() == jobs[0].0.cols;
        if !grouped {
            // Wide calls: the matrices the tensor-core kernel would take one
            // by one, in one launch where there are two or more (TC_JOBS).
            let mut rest: Vec<usize> = (0..jobs.len()).collect();
            if self.tc_jobs {
                // The input's width fixes every matrix's columns, and Q4_K
                // fixes their row size: tc_jobs_on's shape checks hold.
                let tc: Vec<usize> = (0..jobs.len())
                    .filter(|&i| self.takes_tc32g(jobs[i].0, input, false))
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
            }
            for i in rest {
                let (w, y) = &mut jobs[i];
                self.mm(w, input, None, y)?;
            }
            return Ok(());
        }
        let d = &self.dev;
        let (ty, cols, row_bytes) = first.expect("jobs is not empty");
        let a = if ty == GgmlType::Q8_0 {
            input.q80(d)?
        } else {
            input.q8k(d)?
        };
        let lane = self.lane_rows && ty == GgmlType::Q4_K;
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
        let nb = (cols / if ty == GgmlType::Q8_0 { 32 } else { 256 }) as i32;
        let (rb, mi) = (row_bytes as i32, 1i32);
        let (kernel, threads) = if lane {
            ("mm_q4_k_lane_multi_1", lane_threads(nb))
        } else {
            (kernel, 128)
        };
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

    /// Matmuls of `ws` on host rows through [`Cuda::mm_group`] (`grouped`) or
    /// one at a time, for tests.
    #[doc(hidden)]
    pub fn mm_group_host(
        &mut self,
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
        let was = self.multi;
        self.multi = grouped;
        let mut jobs: Vec<(&Matrix, &mut CudaSlice<f32>)> =
            ws.iter().copied().zip(ys.iter_mut()).collect();
        let r = self.mm_group(&Input::new(&xd, m), &mut jobs);
        self.multi = was;
        r?;
        ws.iter()
            .zip(&ys)
            .map(|(w, y)| self.dev.download(y, m * w.rows))
            .collect()
    }

    /// Tensor-core tile rows for a call with (`enough`) or without
    /// `TC_ROWS32_MIN` rows per matrix: 32 on the async kernel where `Async32`
    /// forces it or, by default, where there are enough; 16 otherwise.
    pub(super) fn tc_rows(&self, enough: bool) -> usize {
        match self.tc_kernel {
            TcKernel::Async32 => 32,
            TcKernel::Async if self.tc_rows32_auto && enough => 32,
            _ => TC_ROWS,
        }
    }

    /// Rows per tile of a wide tensor-core call of `m` rows: for an expert
    /// call, what its plan padded to (`plan_tile`, from `tc_pad`).
    pub(super) fn tc_tile(&self, m: usize, plan_tile: usize, experts: bool) -> usize {
        self.tc_rows(if experts {
            plan_tile == 32
        } else {
            m >= TC_ROWS32_MIN
        })
    }

    /// The expert plan's padding for `n` (token, expert) pairs over `e`
    /// experts in a wide call: the tensor-core tile its calls will take.
    pub(super) fn tc_pad(&self, n: usize, e: usize) -> usize {
        self.tc_rows(n >= TC_ROWS32_MIN * e)
    }

    /// A matmul reading `w`'s stacked matrices at device address `base`.
    pub(super) fn matmul_on(
        &self,
        w: &Matrix,
        base: u64,
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
        tensor_cores: bool,
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
        let grid = ((w.rows.div_ceil(4)) as u32, m.div_ceil(16) as u32, 1);
        let c = cfg(grid, 128, 0);
        // Calls of more than one 16-row tile take four weight rows per warp
        // (same per-element arithmetic, activations read once for the four).
        let wide = m > 16;
        // One activation row, or a few rows that each name an expert: a warp
        // per (weight row, activation row), same per-element arithmetic.
        let one_row = self.row_kernels && !wide && (m == 1 || mats.is_some());
        // One row against a matrix of many rows (the output head), with
        // `HEAD_R4`: four weight rows a warp (the wide kernel, the same
        // per-element arithmetic), four times the loads in flight a warp.
        // With `HEAD_X4` (first if both are on): mm_row's arithmetic four
        // rows a warp, double buffered (`mm_*_1x4`).
        let head = one_row && m == 1 && mats.is_none() && w.rows >= HEAD_R4_ROWS;
        let head_x4 = head && self.head_x4;
        let head_r4 = head && self.head_r4 && !head_x4;
        let cx4 = cfg((w.rows.div_ceil(16) as u32, m as u32, 1), 128, 0);
        let c1 = cfg((w.rows.div_ceil(4) as u32, m as u32, 1), 128, 0);
        let c4 = cfg(
            (w.rows.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
            128,
            0,
        );
        macro_rules! mm {
            ($k:literal, $k4:literal, $k1:literal, $kx4:literal, $a:expr, $n:expr) => {
                if one_row && self.lane_rows && w.ty == GgmlType::Q4_K {
                    let (kl, cl) = if self.lane16 && w.rows <= LANE16_ROWS {
                        ("mm_q4_k_lane16_1", lane_cfg_rows(w.rows, m, *$n, 16))
                    } else {
                        ("mm_q4_k_lane_1", lane_cfg(w.rows, m, *$n))
                    };
                    launch!(
                        d, kl, cl, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                } else if head_x4 {
                    launch!(
                        d, $kx4, cx4, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                } else if one_row && !head_r4 {
                    launch!(
                        d, $k1, c1, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                } else if wide || head_r4 {
                    launch!(
                        d, $k4, c4, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                } else {
                    launch!(
                        d, $k, c, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                }
            };
        }
        match w.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                let (k, kt) = match w.ty {
                    GgmlType::F32 => ("mm_f32", "mm_f32_tile"),
                    GgmlType::F16 => ("mm_f16", "mm_f16_tile"),
                    _ => ("mm_bf16", "mm_bf16_tile"),
                };
                let x = input.f32_rows()?;
                let wide_tiles = wide
                    && mats.is_none()
                    && self.float_tiles
                    && self.float_wide
                    && w.ty == GgmlType::F32
                    // 16-byte pieces: whole ones a row, aligned.
                    && w.cols.is_multiple_of(4)
                    && wptr.is_multiple_of(16)
                    && addr(d, x).is_multiple_of(16);
                if wide_tiles {
                    let (kernel, cw) = if w.rows <= MFF_ROWS {
                        // A matrix of a few rows (a shared expert's input
                        // gate: one) would leave most of a 32-row tile's
                        // work unused: a warp an activation row.
                        ("mm_f32_few", cfg((m.div_ceil(4) as u32, 1, 1), 128, 0))
                    } else {
                        // 8 weight rows x 16 activation rows a warp, 4 warps
                        // a block sharing the activation rows (MFW_* in
                        // matmul.cu).
                        let grid = (w.rows.div_ceil(32) as u32, m.div_ceil(16) as u32, 1);
                        ("mm_f32_tile_w8", cfg(grid, 128, MFW_SMEM))
                    };
                    return launch!(d, kernel, cw, &wptr, &row_bytes, x, y, &rows, &mi, &cols);
                }
                if wide && mats.is_none() && self.float_tiles {
                    // Tiles of 4 weight rows x 16 activation rows per warp
                    // (MFT_W, MFT_R in matmul.cu), 4 warps a block.
                    let ct = cfg(
                        (w.rows.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
                        128,
                        0,
                    );
                    return launch!(d, kt, ct, &wptr, &row_bytes, x, y, &rows, &mi, &cols);
                }
                launch!(
                    d, k, c, &wptr, &stride, &row_bytes, &mats_ptr, x, y, &rows, &mi, &cols
                )
            }
            GgmlType::Q8_0 => {
                let nbi = (w.cols / 32) as i32;
                let a = input.q80(d)?;
                mm!("mm_q8_0", "mm_q8_0_r4", "mm_q8_0_1", "mm_q8_0_1x4", a, &nbi)
            }
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                let nbi = (w.cols / 256) as i32;
                let a = input.q8k(d)?;
                if let Some((k, tile)) = self.tc_kernel_for(w, input, mats.is_some(), tensor_cores)
                {
                    // Rows with no expert that no one reads: left unwritten.
                    let k = match k {
                        "mm_tc_q4_k_async32g" if input.live && mats.is_some() => {
                            if self.tc_wsmem {
                                "mm_tc_q4_k_async32g_live_ws"
                            } else {
                                "mm_tc_q4_k_async32g_live"
                            }
                        }
                        "mm_tc_q4_k_async32g" if self.tc_wsmem => "mm_tc_q4_k_async32g_ws",
                        _ => k,
                    };
                    // The async kernels' two stages of shared memory (see
                    // TaLayout in matmul.cu).
                    let smem = match self.tc_kernel {
                        TcKernel::Async | TcKernel::Async32 => {
                            tc_async_smem(w.ty == GgmlType::Q5_K, tile)
                        }
                        _ => 0,
                    };
                    // 8 warps a block for the 8-warp kernel, 4 for the others.
                    let threads = if k == "mm_tc_q4_k_async32w" { 256 } else { 128 };
                    let ct = cfg(
                        (w.rows.div_ceil(128) as u32, m.div_ceil(tile) as u32, 1),
                        threads,
                        smem,
                    );
                    // Profiles split the tensor-core launches by kind and
                    // reduction length (the K loop's blocks against the
                    // tile's fixed costs).
                    let label = match (mats.is_some(), nbi) {
                        _ if !d.profiling() => k,
                        (true, 2) => "mm_tc (experts, K 512)",
                        (true, 8) => "mm_tc (experts, K 2048)",
                        (true, _) => "mm_tc (experts, other K)",
                        (false, 2) => "mm_tc (dense, K 512)",
                        (false, 8) if w.rows < TQ_WROWS => "mm_tc (dense, K 2048, < 128 rows)",
                        (false, 8) => "mm_tc (dense, K 2048)",
                        (false, 16) => "mm_tc (dense, K 4096)",
                        (false, _) => "mm_tc (dense, other K)",
                    };
                    return launch_as!(
                        d, k, label, ct, &wptr, &stride, &row_bytes, &mats_ptr, a, y, &rows, &mi,
                        &nbi
                    );
                }
                match w.ty {
                    GgmlType::Q4_K => {
                        mm!("mm_q4_k", "mm_q4_k_r4", "mm_q4_k_1", "mm_q4_k_1x4", a, &nbi)
                    }
                    GgmlType::Q5_K => {
                        mm!("mm_q5_k", "mm_q5_k_r4", "mm_q5_k_1", "mm_q5_k_1x4", a, &nbi)
                    }
                    // `Q6_LANES8`: one-row calls eight lanes a block.
                    _ if self.q6_lanes8 => {
                        mm!(
                            "mm_q6_k",
                            "mm_q6_k_r4",
                            "mm_q6_k8_1",
                            "mm_q6_k_1x4",
                            a,
                            &nbi
                        )
                    }
                    _ => mm!("mm_q6_k", "mm_q6_k_r4", "mm_q6_k_1", "mm_q6_k_1x4", a, &nbi),
                }
            }
            other => Err(CudaError::Unsupported {
                tensor: w.name.clone(),
                ty: format!("{other:?}"),
            }),
        }
    }
}

/// `FmtQ6K::load` (matmul.cu) reads a group's 16 ql and 16 qh bytes with
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
