//! The linear-attention (delta-net) layer: the input projections and their
//! split, the short causal conv with its state, the q/k head norms, the gated
//! delta rule with its state, the gated norm and the output projection.

use super::*;

/// The lane-a-head kernels (`gated_norm_q8k_h`, `l2norm_qk_h`): `n` heads
/// of `dim` values, HS_HEADS (delta_net.cu) a block of 128 threads, staged
/// in rows of `dim + 1` floats.
fn head_sums_cfg(n: usize, dim: usize) -> cudarc::driver::LaunchConfig {
    const HS_HEADS: usize = 32;
    cfg(
        (n.div_ceil(HS_HEADS) as u32, 1, 1),
        128,
        (HS_HEADS * (dim + 1) * 4) as u32,
    )
}

/// Rows a thread of `conv_tile` takes (CONV_TR in delta_net.cu).
const CONV_TR: usize = 16;

/// The causal conv's kernel for a call of `m` rows, `kc` taps, key heads of
/// `dk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Conv {
    /// One row at key head dims up to 256 (every decode step): the conv, the
    /// state shift and the q/k head norms in one launch (`conv_l2_one`).
    OneRow,
    /// Up to 16 rows: the conv and the state shift in one launch
    /// (`conv_small`), then the head norms.
    Small,
    /// Wider calls with 4 taps (the models' conv): a thread a channel and 16
    /// rows (`conv_tile`), then `conv_shift` and the head norms.
    Tile,
    /// Wider calls with other tap counts: a thread an output (`conv_rows`),
    /// then `conv_shift` and the head norms.
    Rows,
}

impl Conv {
    fn select(m: usize, kc: usize, dk: usize) -> Self {
        if m == 1 && dk <= 256 {
            Conv::OneRow
        } else if m <= 16 {
            Conv::Small
        } else if kc == 4 {
            Conv::Tile
        } else {
            Conv::Rows
        }
    }
}

/// Whether the head norms of a call of `m` rows at head dim `dim` take a
/// lane a head, 32 heads a block (`l2norm_qk_h`, `gated_norm_q8k_h`; launched
/// with [`head_sums_cfg`]) rather than a warp a head: calls of more than 16
/// rows (H200, qwen35moe pp4096: the gated norm 4.08 -> 2.91 ms, l2norm_qk
/// 2.84 -> 1.64 ms). The same sums, so the same bytes.
fn lane_a_head(m: usize, dim: usize) -> bool {
    m > 16 && dim <= 256
}

/// The gated delta rule's kernel for a call of `m` rows at key head dim
/// `dk`. Every one computes the same bytes as a one-row call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DeltaKernel {
    /// `delta_cols_16`, `delta_cols_32`: eight lanes a state column, the
    /// rows staged with plain loads.
    Cols16,
    Cols32,
    /// `delta_cols_async_256`: the next 8-row group staged by cp.async while
    /// this one runs.
    Async256,
    /// `delta_cols_async_pipe_64`, `_128`: as Async256 with 16-row groups,
    /// each row's output dot beside the next row's k dot. Calls of fewer
    /// than 16 rows (every decode step) have no full group.
    Pipe64,
    Pipe128,
    /// `delta_cols_async_unroll_64`, `_128`: the pipelined kernel with full
    /// 16-row groups as straight-line code (H200, qwen35moe pp4096: the
    /// delta rule 45.53 -> 37.92 ms, bench 17,118 -> 17,474 tok/s).
    Unroll64,
    Unroll128,
    /// `delta_rows`: a thread a state column, at the other key head dims
    /// (up to 512).
    Rows,
}

impl DeltaKernel {
    fn select(dk: usize, m: usize) -> Self {
        let full_groups = m >= 16;
        match dk {
            16 => DeltaKernel::Cols16,
            32 => DeltaKernel::Cols32,
            64 if full_groups => DeltaKernel::Unroll64,
            64 => DeltaKernel::Pipe64,
            128 if full_groups => DeltaKernel::Unroll128,
            128 => DeltaKernel::Pipe128,
            256 => DeltaKernel::Async256,
            _ => DeltaKernel::Rows,
        }
    }

    /// The kernel's form for a decode row each of several sequences in one
    /// launch (each row's state from a table), where it has one.
    fn seqs_name(self) -> Option<&'static str> {
        match self {
            DeltaKernel::Async256 => Some("delta_cols_async_256_seqs"),
            DeltaKernel::Pipe64 => Some("delta_cols_async_pipe_64_seqs"),
            DeltaKernel::Pipe128 => Some("delta_cols_async_pipe_128_seqs"),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            DeltaKernel::Cols16 => "delta_cols_16",
            DeltaKernel::Cols32 => "delta_cols_32",
            DeltaKernel::Async256 => "delta_cols_async_256",
            DeltaKernel::Pipe64 => "delta_cols_async_pipe_64",
            DeltaKernel::Pipe128 => "delta_cols_async_pipe_128",
            DeltaKernel::Unroll64 => "delta_cols_async_unroll_64",
            DeltaKernel::Unroll128 => "delta_cols_async_unroll_128",
            DeltaKernel::Rows => "delta_rows",
        }
    }
}

/// Whether the delta-net layers of `model` have one-launch kernels for a
/// row each of several sequences (the one-row conv, a `_seqs` delta rule).
pub(super) fn delta_one_launch(model: &Model) -> bool {
    model.hp.ssm.is_some_and(|s| {
        (1..=8).contains(&s.d_conv)
            && Conv::select(1, s.d_conv, s.head_k_dim) == Conv::OneRow
            && DeltaKernel::select(s.head_k_dim, 1).seqs_name().is_some()
    })
}

impl Cuda {
    /// The delta-rule kernel the last delta-net call launched ("" before
    /// any).
    #[doc(hidden)]
    pub fn last_delta_kernel(&self) -> &'static str {
        *self.delta_last.lock().unwrap_or_else(|p| p.into_inner())
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
        let m = x.len() / model.hp.n_embd;
        self.delta_seq_rows(model, l, dn, x, xq, &mut [st], &[m], y)
    }

    /// The delta-net layer over the rows of several sequences (`rows[i]`
    /// consecutive rows of `x` for `sts[i]`): the input projections, the
    /// gated norm and the output projection over all rows in one call each;
    /// the short conv, the q/k norms and the delta rule per sequence, on its
    /// rows and states, with the kernels a call of its rows alone would
    /// pick. Every op is row-wise or per sequence, so each sequence gets the
    /// bytes of a call of its own.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn delta_seq_rows(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<u8>>,
        sts: &mut [&mut CudaState],
        rows: &[usize],
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let hp = &model.hp;
        let d = &self.dev;
        let s = hp.ssm.ok_or_else(|| CudaError::Driver {
            op: "delta_net".into(),
            msg: "no ssm sizes".into(),
        })?;
        let m = x.len() / hp.n_embd;
        // A bound step of several sequences runs its rows through its table.
        let bound = self.bound_seqs();
        let fits = match bound {
            Some(bd) => bd.rows == m && bd.seqs == rows.len() && rows.iter().all(|&n| n == 1),
            None => rows.iter().sum::<usize>() == m,
        };
        if !fits || rows.len() != sts.len() {
            return Err(CudaError::Driver {
                op: "delta_net".into(),
                msg: format!("{m} rows for {} sequences of {rows:?} rows", sts.len()),
            });
        }
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
        if kc > 8 || kc == 0 {
            return Err(CudaError::Driver {
                op: "conv_rows".into(),
                msg: format!("conv kernel of {kc} taps: the kernel takes 1 to 8"),
            });
        }
        if dk > 512 {
            return Err(CudaError::Driver {
                op: "delta_rows".into(),
                msg: format!("key head dim {dk}: the delta-rule kernel takes at most 512"),
            });
        }
        let mut conv = d.scratch::<f32>(m * cd)?;
        let taps = self.vec(&dn.conv)?;
        let (cdi, kci) = (cd as i32, kc as i32);
        let mut qk = d.scratch::<f32>(m * 2 * kd)?;
        let (hki, dki, eps) = (hk as i32, dk as i32, hp.eps);
        let mut o = d.scratch::<f32>(m * vd)?;
        let (hvi, dvi, tiled) = (hv as i32, dv as i32, (hp.arch == Arch::Qwen35Moe) as i32);
        let (dtb, sa, nw) = (
            self.vec(&dn.dt_bias)?,
            self.vec(&dn.a)?,
            self.vec(&dn.norm)?,
        );
        // The one-row conv's blocks: one a q/k head, then 128 value channels
        // a block.
        let conv_one_blocks = (2 * hk + (cd - 2 * hk * dk).div_ceil(128)) as u32;
        // The decode rows that lead the call (the scheduler puts them
        // first): every such sequence's row in one launch of the conv (with
        // the head norms) and one of the delta rule, each row's states from
        // a table; each row runs the one-row kernels' code on its own inputs
        // and states, so it gets the bytes of its own call. The sequences
        // after them run call by call below.
        let seqs_kernel = DeltaKernel::select(dk, 1).seqs_name();
        let lead = rows.iter().take_while(|&&n| n == 1).count();
        let one_launch = bound.is_some()
            || lead > 1
                && Conv::select(1, kc, dk) == Conv::OneRow
                && seqs_kernel.is_some()
                && sts[..lead].iter().all(|st| st.linear[l].is_some());
        if one_launch && seqs_kernel.is_none() {
            return Err(CudaError::Driver {
                op: "delta_net".into(),
                msg: format!("a bound step of several sequences at key head dim {dk}"),
            });
        }
        let done = match (bound, one_launch) {
            (Some(_), _) => sts.len(),
            (None, true) => lead,
            (None, false) => 0,
        };
        if let (true, Some(kernel)) = (one_launch, seqs_kernel) {
            // The rows' states: the bound step's table, or this call's
            // (conv states, then delta-rule states).
            let mut table_buf = None;
            let (tab, ns) = match bound {
                Some(bd) => (bd.layer(l), bd.rows),
                None => {
                    let ns = lead;
                    let mut table = vec![0u64; 2 * ns];
                    for (i, st) in sts[..lead].iter().enumerate() {
                        let (conv_state, s_state) = st.linear[l].as_ref().expect("checked above");
                        table[i] = crate::device::addr(d, conv_state);
                        table[ns + i] = crate::device::addr(d, s_state);
                    }
                    let buf = table_buf.insert(d.upload(&table)?);
                    (crate::device::addr(d, buf), ns)
                }
            };
            let nsi = ns as i32;
            launch!(
                d,
                "conv_l2_one_seqs",
                cfg((conv_one_blocks, ns as u32, 1), 128, 0),
                &qkv,
                taps,
                &tab,
                &mut conv,
                &mut qk,
                &cdi,
                &kci,
                &hki,
                &dki,
                &eps
            )?;
            launch!(
                d,
                kernel,
                cfg((hv as u32, dv.div_ceil(16) as u32, ns as u32), 128, 0),
                &qk,
                &conv,
                &b,
                &a,
                dtb,
                sa,
                &tab,
                &mut o,
                &nsi,
                &hki,
                &hvi,
                &dvi,
                &tiled
            )?;
            *self.delta_last.lock().unwrap_or_else(|p| p.into_inner()) = kernel;
            drop(table_buf);
        }
        let mut r0 = done;
        for (st, &n) in sts.iter_mut().zip(rows).skip(done) {
            if n == 0 {
                continue;
            }
            let (conv_state, s_state) = st.linear[l].as_mut().ok_or_else(|| CudaError::Driver {
                op: "delta_net".into(),
                msg: format!("layer {l} has no delta-net state"),
            })?;
            let mi = n as i32;
            let qkv = qkv.slice(r0 * cd..(r0 + n) * cd);
            let (b, a) = (
                b.slice(r0 * hv..(r0 + n) * hv),
                a.slice(r0 * hv..(r0 + n) * hv),
            );
            let mut conv = conv.slice_mut(r0 * cd..(r0 + n) * cd);
            let mut qk = qk.slice_mut(r0 * 2 * kd..(r0 + n) * 2 * kd);
            let mut o = o.slice_mut(r0 * vd..(r0 + n) * vd);
            let conv_kernel = Conv::select(n, kc, dk);
            match conv_kernel {
                // A block a q/k head, then a thread a value channel.
                Conv::OneRow => launch!(
                    d,
                    "conv_l2_one",
                    cfg((conv_one_blocks, 1, 1), 128, 0),
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
                )?,
                Conv::Small => launch!(
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
                )?,
                Conv::Tile => launch!(
                    d,
                    "conv_tile",
                    cfg(
                        (cd.div_ceil(128) as u32, n.div_ceil(CONV_TR) as u32, 1),
                        128,
                        0
                    ),
                    &qkv,
                    taps,
                    &*conv_state,
                    &mut conv,
                    &mi,
                    &cdi
                )?,
                Conv::Rows => launch!(
                    d,
                    "conv_rows",
                    cfg1(n * cd),
                    &qkv,
                    taps,
                    &*conv_state,
                    &mut conv,
                    &mi,
                    &cdi,
                    &kci
                )?,
            }
            if matches!(conv_kernel, Conv::Tile | Conv::Rows) {
                // The state shift, after every row's conv has read the old state.
                launch!(d, "conv_shift", cfg1(cd), &qkv, conv_state, &mi, &cdi, &kci)?;
            }
            if conv_kernel != Conv::OneRow {
                let (kernel, c) = if lane_a_head(n, dk) {
                    ("l2norm_qk_h", head_sums_cfg(n * 2 * hk, dk))
                } else {
                    (
                        "l2norm_qk",
                        cfg(((n * 2 * hk).div_ceil(4) as u32, 1, 1), 128, 0),
                    )
                };
                launch!(d, kernel, c, &conv, &mut qk, &mi, &cdi, &hki, &dki, &eps)?;
            }
            *self.delta_last.lock().unwrap_or_else(|p| p.into_inner()) =
                DeltaKernel::select(dk, n).name();
            match DeltaKernel::select(dk, n) {
                // A thread a state column, the columns and the staged rows in
                // dynamic shared memory.
                k @ DeltaKernel::Rows => launch!(
                    d,
                    k.name(),
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
                )?,
                // Eight lanes a state column, 16 columns a block.
                k => launch!(
                    d,
                    k.name(),
                    cfg((hv as u32, dv.div_ceil(16) as u32, 1), 128, 0),
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
                )?,
            }
            r0 += n;
        }
        let rh = (m * hv) as i32;
        // With the out projection reading Q8_K rows, the norm writes them
        // too (four heads a block: whole 256-blocks of one row).
        if k_quant(dn.out.ty) && dv <= 256 && dv % 64 == 0 && hv % 4 == 0 {
            let mut q = d.scratch::<u8>(m * hv * dv / 256 * 304)?;
            let (kernel, c) = if lane_a_head(m, dv) {
                ("gated_norm_q8k_h", head_sums_cfg(m * hv, dv))
            } else {
                (
                    "gated_norm_q8k_lane0",
                    cfg(((m * hv).div_ceil(4) as u32, 1, 1), 128, 0),
                )
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

#[cfg(test)]
mod tests {
    use super::{Conv, DeltaKernel};
    use crate::compile::{MODULES, kernels_defined};

    /// Every delta-rule kernel the selection can name is defined in the ops
    /// module; at head dims 64 and 128 calls with a full 16-row group take
    /// the unrolled kernel and smaller ones (every decode step) the
    /// pipelined loop; the other head dims take one kernel at every m.
    #[test]
    fn delta_kernels_are_defined_and_chosen_by_head_dim_and_rows() {
        let ops = MODULES.iter().find(|(n, _)| *n == "ops").unwrap().1;
        let defined = kernels_defined(ops);
        for dk in [8, 16, 32, 48, 64, 96, 128, 192, 256, 512] {
            for m in [1, 2, 15, 16, 17, 64, 300] {
                let k = DeltaKernel::select(dk, m);
                assert!(
                    defined.iter().any(|n| n == k.name()),
                    "dk {dk} m {m}: {} is not defined",
                    k.name()
                );
                if let Some(seqs) = k.seqs_name() {
                    assert!(
                        defined.iter().any(|n| n == seqs),
                        "dk {dk}: {seqs} is not defined"
                    );
                }
                let one_kernel = match dk {
                    16 => Some(DeltaKernel::Cols16),
                    32 => Some(DeltaKernel::Cols32),
                    256 => Some(DeltaKernel::Async256),
                    64 | 128 => None,
                    _ => Some(DeltaKernel::Rows),
                };
                match one_kernel {
                    Some(want) => assert_eq!(k, want, "dk {dk} m {m}"),
                    None => assert_eq!(
                        k.name(),
                        if m >= 16 {
                            format!("delta_cols_async_unroll_{dk}")
                        } else {
                            format!("delta_cols_async_pipe_{dk}")
                        },
                        "dk {dk} m {m}"
                    ),
                }
            }
        }
    }

    /// Decode rows of several sequences have a one-launch form at the head
    /// dims whose one-row kernel is the cp.async family, and its conv too.
    #[test]
    fn one_launch_decode_kernels_exist_where_chosen() {
        let ops = MODULES.iter().find(|(n, _)| *n == "ops").unwrap().1;
        let defined = kernels_defined(ops);
        assert!(defined.iter().any(|n| n == "conv_l2_one_seqs"));
        for (dk, want) in [
            (64, Some("delta_cols_async_pipe_64_seqs")),
            (128, Some("delta_cols_async_pipe_128_seqs")),
            (256, Some("delta_cols_async_256_seqs")),
            (32, None),
            (96, None),
        ] {
            assert_eq!(DeltaKernel::select(dk, 1).seqs_name(), want, "dk {dk}");
        }
    }

    /// One row takes the one-launch conv and head norms up to key head dim
    /// 256; up to 16 rows the small conv; wider calls the tiled conv with
    /// the models' 4 taps, the row conv otherwise.
    #[test]
    fn conv_kernel_by_rows_taps_and_head_dim() {
        assert_eq!(Conv::select(1, 4, 128), Conv::OneRow);
        assert_eq!(Conv::select(1, 4, 256), Conv::OneRow);
        assert_eq!(Conv::select(1, 4, 512), Conv::Small);
        assert_eq!(Conv::select(2, 4, 128), Conv::Small);
        assert_eq!(Conv::select(16, 3, 128), Conv::Small);
        assert_eq!(Conv::select(17, 4, 128), Conv::Tile);
        assert_eq!(Conv::select(300, 4, 512), Conv::Tile);
        assert_eq!(Conv::select(17, 3, 128), Conv::Rows);
    }
}
