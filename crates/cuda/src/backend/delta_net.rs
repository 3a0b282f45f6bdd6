//! The gated delta rule and the short causal conv of linear-attention layers.

use super::*;

impl Cuda {
    /// The delta-rule kernel a call of `m` rows at key head dim `dk` takes
    /// with the current switches (`None`: the general `delta_rows`). Calls
    /// of fewer than 16 rows (every decode step) have no full row group, so
    /// they keep the pipelined loop's kernel.
    pub fn delta_kernel(&self, dk: usize, m: usize) -> Option<&'static str> {
        let unrolled = self.delta_async && self.delta_pipe && self.delta_unroll && m >= 16;
        match (dk, self.delta_async, self.delta_pipe) {
            (64, true, true) if unrolled && self.delta_tri => Some("delta_cols_async_tri_64"),
            (128, true, true) if unrolled && self.delta_tri => Some("delta_cols_async_tri_128"),
            (64, true, true) if unrolled && self.delta_carry => Some("delta_cols_async_carry_64"),
            (128, true, true) if unrolled && self.delta_carry => Some("delta_cols_async_carry_128"),
            (64, true, true) if unrolled && self.delta_xchg => Some("delta_cols_async_xchg_64"),
            (128, true, true) if unrolled && self.delta_xchg => Some("delta_cols_async_xchg_128"),
            (64, true, true) if unrolled => Some("delta_cols_async_unroll_64"),
            (128, true, true) if unrolled => Some("delta_cols_async_unroll_128"),
            (16, _, _) => Some("delta_cols_16"),
            (32, _, _) => Some("delta_cols_32"),
            (64, true, false) => Some("delta_cols_async_64"),
            (128, true, false) => Some("delta_cols_async_128"),
            (256, true, _) => Some("delta_cols_async_256"),
            (64, true, true) => Some("delta_cols_async_pipe_64"),
            (128, true, true) => Some("delta_cols_async_pipe_128"),
            (64, false, _) => Some("delta_cols_64"),
            (128, false, _) => Some("delta_cols_128"),
            (256, false, _) => Some("delta_cols_256"),
            _ => None,
        }
    }

    pub(super) fn delta_rows(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<u8>>,
        st: &mut CudaState,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let hp = &model.hp;
        let d = &self.dev;
        let s = hp.ssm.ok_or_else(|| CudaError::Driver {
            op: "delta_net".into(),
            msg: "no ssm sizes".into(),
        })?;
        let m = x.len() / hp.n_embd;
        let (kd, vd, cd) = (s.key_dim(), s.value_dim(), s.conv_dim());
        let (hk, hv, dk, dv, kc) = (
            s.n_k_heads,
            s.n_v_heads,
            s.head_k_dim,
            s.head_v_dim,
            s.d_conv,
        );
        let ratio = hv / hk;
        let mut qkv = d.scratch::<f32>(m * cd)?;
        let mut z = d.scratch::<f32>(m * vd)?;
        let xin = Input::with_given_q8k(x, m, xq);
        let mut b = d.scratch::<f32>(m * hv)?;
        let mut a = d.scratch::<f32>(m * hv)?;
        // The common layout (split projections): all four in one group.
        let mut grouped = false;
        if let (DeltaInput::Split { qkv: wq, z: wz }, DeltaBa::Split { beta, alpha }) =
            (&dn.input, &dn.ba)
        {
            self.mm_group(
                &xin,
                &mut [
                    (wq, &mut qkv),
                    (wz, &mut z),
                    (beta, &mut b),
                    (alpha, &mut a),
                ],
            )?;
            grouped = true;
        }
        match &dn.input {
            _ if grouped => {}
            DeltaInput::Split { qkv: wq, z: wz } => {
                self.mm(wq, &xin, None, &mut qkv)?;
                self.mm(wz, &xin, None, &mut z)?;
            }
            DeltaInput::Fused { ssm_in } => {
                let width = 2 * dk + 2 * ratio * dv;
                let mut f = d.scratch::<f32>(m * ssm_in.rows)?;
                self.mm(ssm_in, &xin, None, &mut f)?;
                let vs = ratio * dv;
                let m1 = self.map((2, hk, dk, vs), || {
                    let mut map = vec![0i32; cd];
                    for g in 0..hk {
                        for i in 0..dk {
                            map[g * dk + i] = (g * width + i) as i32;
                            map[kd + g * dk + i] = (g * width + dk + i) as i32;
                        }
                        for i in 0..vs {
                            map[2 * kd + g * vs + i] = (g * width + 2 * dk + i) as i32;
                        }
                    }
                    map
                })?;
                let m2 = self.map((3, hk, dk, vs), || {
                    let mut map = vec![0i32; vd];
                    for g in 0..hk {
                        for i in 0..vs {
                            map[g * vs + i] = (g * width + 2 * dk + vs + i) as i32;
                        }
                    }
                    map
                })?;
                self.copy_cols(&f, ssm_in.rows, &mut qkv, cd, m1, m)?;
                self.copy_cols(&f, ssm_in.rows, &mut z, vd, m2, m)?;
            }
        }
        match &dn.ba {
            _ if grouped => {}
            DeltaBa::Fused(wba) => {
                let mut ba = d.scratch::<f32>(m * 2 * hv)?;
                self.mm(wba, &xin, None, &mut ba)?;
                let mb = self.map((4, hk, ratio, 0), || {
                    (0..hv)
                        .map(|n| ((n / ratio) * 2 * ratio + n % ratio) as i32)
                        .collect()
                })?;
                let ma = self.map((5, hk, ratio, 0), || {
                    (0..hv)
                        .map(|n| ((n / ratio) * 2 * ratio + ratio + n % ratio) as i32)
                        .collect()
                })?;
                self.copy_cols(&ba, 2 * hv, &mut b, hv, mb, m)?;
                self.copy_cols(&ba, 2 * hv, &mut a, hv, ma, m)?;
            }
            DeltaBa::Split { beta, alpha } => {
                self.mm(beta, &xin, None, &mut b)?;
                self.mm(alpha, &xin, None, &mut a)?;
            }
        }
        let (conv_state, s_state) = st.linear[l].as_mut().ok_or_else(|| CudaError::Driver {
            op: "delta_net".into(),
            msg: format!("layer {l} has no delta-net state"),
        })?;
        if kc > 8 || kc == 0 {
            return Err(CudaError::Driver {
                op: "conv_rows".into(),
                msg: format!("conv kernel of {kc} taps: the kernel takes 1 to 8"),
            });
        }
        let mut conv = d.scratch::<f32>(m * cd)?;
        let taps = self.vec(&dn.conv)?;
        let (mi, cdi, kci) = (m as i32, cd as i32, kc as i32);
        let mut qk = d.scratch::<f32>(m * 2 * kd)?;
        let (hki, dki, eps) = (hk as i32, dk as i32, hp.eps);
        if self.conv_l2 && m == 1 && self.small_plan && dk <= 256 {
            // One decode row: the conv, the shift and the head norms in one
            // launch (a block a q/k head, then a thread a value channel).
            let blocks = 2 * hk + (cd - 2 * hk * dk).div_ceil(128);
            launch!(
                d,
                "conv_l2_one",
                cfg((blocks as u32, 1, 1), 128, 0),
                &qkv,
                taps,
                conv_state,
                &mut conv,
                &mut qk,
                &cdi,
                &kci,
                &hki,
                &dki,
                &eps
            )?;
        } else {
            if m <= 16 && self.small_plan {
                // Decode sizes: the conv and the state shift in one launch.
                launch!(
                    d,
                    "conv_small",
                    cfg1(cd),
                    &qkv,
                    taps,
                    conv_state,
                    &mut conv,
                    &mi,
                    &cdi,
                    &kci
                )?;
            } else {
                if self.conv_tile && kc == 4 {
                    launch!(
                        d,
                        "conv_tile",
                        cfg(
                            (cd.div_ceil(128) as u32, m.div_ceil(CONV_TR) as u32, 1),
                            128,
                            0
                        ),
                        &qkv,
                        taps,
                        &*conv_state,
                        &mut conv,
                        &mi,
                        &cdi
                    )?;
                } else {
                    launch!(
                        d,
                        "conv_rows",
                        cfg1(m * cd),
                        &qkv,
                        taps,
                        &*conv_state,
                        &mut conv,
                        &mi,
                        &cdi,
                        &kci
                    )?;
                }
                launch!(d, "conv_shift", cfg1(cd), &qkv, conv_state, &mi, &cdi, &kci)?;
            }
            // `HEAD_SUMS`: a lane a head, 32 heads a block.
            let warps = cfg(((m * 2 * hk).div_ceil(4) as u32, 1, 1), 128, 0);
            let (kernel, c) = if self.sq_lanes && self.head_sums && m > 16 && dk <= 256 {
                ("l2norm_qk_h", head_sums_cfg(m * 2 * hk, dk))
            } else if self.sq_lanes {
                ("l2norm_qk", warps)
            } else {
                ("l2norm_qk_lane0", warps)
            };
            launch!(d, kernel, c, &conv, &mut qk, &mi, &cdi, &hki, &dki, &eps)?;
        }
        let mut o = d.scratch::<f32>(m * vd)?;
        let (hvi, dvi, tiled) = (hv as i32, dv as i32, (hp.arch == Arch::Qwen35Moe) as i32);
        if dk > 512 {
            return Err(CudaError::Driver {
                op: "delta_rows".into(),
                msg: format!("key head dim {dk}: the delta-rule kernel takes at most 512"),
            });
        }
        let (dtb, sa, nw) = (
            self.vec(&dn.dt_bias)?,
            self.vec(&dn.a)?,
            self.vec(&dn.norm)?,
        );
        let cols_kernel = self.delta_kernel(dk, m);
        if let Some(kname) = cols_kernel {
            // Eight lanes per state column (the kernel for the usual head
            // dims). The three-buffer kernels stage in dynamic shared memory:
            // 3 buffers of 16 rows of 2 (8 (dk / 8 + 4)) + 16 floats (ops.cu,
            // delta_cols_async's ROWF).
            let smem = if kname.starts_with("delta_cols_async_tri_") {
                (3 * 16 * (2 * 8 * (dk / 8 + 4) + 16) * 4) as u32
            } else {
                0
            };
            launch!(
                d,
                kname,
                cfg((hv as u32, dv.div_ceil(16) as u32, 1), 128, smem),
                &qk,
                &conv,
                &b,
                &a,
                dtb,
                sa,
                s_state,
                &mut o,
                &mi,
                &hki,
                &hvi,
                &dvi,
                &tiled
            )?;
        } else {
            launch!(
                d,
                "delta_rows",
                cfg(
                    (hv as u32, dv.div_ceil(32) as u32, 1),
                    32,
                    ((dk * 32 + 16 * 2 * dk + 32) * 4) as u32
                ),
                &qk,
                &conv,
                &b,
                &a,
                dtb,
                sa,
                s_state,
                &mut o,
                &mi,
                &hki,
                &hvi,
                &dki,
                &dvi,
                &tiled
            )?;
        }
        let rh = (m * hv) as i32;
        // `GN_FOLD`: one row, the output projection's blocks take the gated
        // norm and its Q8_K blocks themselves.
        if self.gn_fold
            && m == 1
            && self.gn_q8k
            && self.row_kernels
            && self.lane_rows
            && dn.out.ty == GgmlType::Q4_K
            && dn.out.cols == vd
            && dv % 32 == 0
            && 256 % dv == 0
            && vd % 256 == 0
        {
            let nb = (vd / 256) as i32;
            let (wptr, row_bytes, rows) = (
                self.wptr(&dn.out)?,
                dn.out.row_bytes as i32,
                dn.out.rows as i32,
            );
            if y.len() < dn.out.rows {
                return Err(CudaError::Driver {
                    op: "delta_rows".into(),
                    msg: format!(
                        "{}: an output of {} for {} rows",
                        dn.out.name,
                        y.len(),
                        dn.out.rows
                    ),
                });
            }
            launch!(
                d,
                "mm_q4_k_lane_gn_1",
                lane_cfg(dn.out.rows, m, nb),
                &wptr,
                &row_bytes,
                &o,
                &z,
                nw,
                y,
                &rows,
                &mi,
                &nb,
                &dvi,
                &eps
            )?;
            return Ok(());
        }
        // With the out projection reading Q8_K rows, the norm writes them
        // too (four heads a block: whole 256-blocks of one row).
        if self.gn_q8k && k_quant(dn.out.ty) && dv <= 256 && dv % 64 == 0 && hv % 4 == 0 {
            let mut q = d.scratch::<u8>(m * hv * dv / 256 * 304)?;
            // Decode-sized calls keep lane 0's squares: with the lanes'
            // squares in gated_norm_q8k and conv_l2_one, qwen35moe tg128 fell
            // from 315-319 to 302.5 tok/s (H200, session 17; the only decode
            // change specific to that model), while prefill gained 0.6%.
            // `HEAD_SUMS`: a lane a head, 32 heads a block.
            let warps = cfg(((m * hv).div_ceil(4) as u32, 1, 1), 128, 0);
            let (kernel, c) = if self.sq_lanes && self.head_sums && m > 16 {
                ("gated_norm_q8k_h", head_sums_cfg(m * hv, dv))
            } else if self.sq_lanes && m > 16 {
                ("gated_norm_q8k", warps)
            } else {
                ("gated_norm_q8k_lane0", warps)
            };
            launch!(d, kernel, c, &mut o, &z, nw, &mut q, &rh, &dvi, &eps)?;
            return self.mm(&dn.out, &Input::with_q8k(&o, m, Some(q)), None, y);
        }
        launch!(
            d,
            "gated_norm",
            cfg(((m * hv).div_ceil(4) as u32, 1, 1), 128, 0),
            &mut o,
            &z,
            nw,
            &rh,
            &dvi,
            &eps
        )?;
        self.matmul(&dn.out, &o, m, None, y)
    }
}
