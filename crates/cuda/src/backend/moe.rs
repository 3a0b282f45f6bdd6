//! Mixture of experts: router, top-k, the expert plan, routed and shared
//! experts, the weighted combine.

use super::matmul::quant_kernels;
use super::*;

/// The one-launch plan's limits (`plan_small_block` in moe.cu).
const PLAN_SMALL_PAIRS: usize = 256;
const PLAN_SMALL_EXPERTS: usize = 2048;

/// The expert plan computed on the host, the reference the plan kernels are
/// tested against (`plan_count` + `plan_place_wide`, `plan_small_block`,
/// `plan_warp`): each expert's pair count rounded up to `pad`, their
/// exclusive scan in expert order, pair t (token t / k) placed at its
/// expert's offset plus the earlier pairs of that expert; ids of -1 are
/// skipped. Returns (placed rows, placed experts, slots), unused places -1.
#[doc(hidden)]
pub fn plan_reference(
    ids: &[i32],
    k: usize,
    e: usize,
    pad: usize,
    cap: usize,
) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let mut off = vec![0usize; e];
    for &i in ids.iter().filter(|&&i| i >= 0) {
        off[i as usize] += 1;
    }
    let mut run = 0;
    for o in off.iter_mut() {
        let count = *o;
        *o = run;
        run += count.div_ceil(pad) * pad;
    }
    let (mut row, mut mat, mut slot) = (vec![-1; cap], vec![-1; cap], vec![-1; ids.len()]);
    for (t, &i) in ids.iter().enumerate() {
        if i >= 0 {
            let dst = off[i as usize];
            off[i as usize] += 1;
            row[dst] = (t / k) as i32;
            mat[dst] = i;
            slot[t] = dst as i32;
        }
    }
    (row, mat, slot)
}

/// How a MoE call routes its rows (softmax, top k, weights renormalized)
/// and plans their pairs, by the call's shape: every way the same ids,
/// weights, softmaxed logits and places.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Routing {
    /// One decode row of an f32 router: the router's launch routes and
    /// plans it too (`mm_f32_multi_route_rd`), one launch fewer a layer.
    InRouter,
    /// One decode row of a router in another format: one warp
    /// (`route_plan_one_r`, the router launch's routing code on its own).
    OneWarp,
    /// Up to [`PLAN_SMALL_PAIRS`] pairs in one block (`route_plan_small`).
    Small,
    /// Wide calls: `route`, then the plan's `plan_count` and
    /// `plan_place_wide` (see [`Cuda::plan`]).
    Wide,
}

impl Routing {
    /// The routing of `m` rows, `k` experts each of `e`; `f32_router`: the
    /// router is an f32 matrix (its launch can route).
    pub(super) fn select(m: usize, k: usize, e: usize, f32_router: bool) -> Self {
        if m == 1 && k <= 32 && e <= 1024 {
            if f32_router {
                Routing::InRouter
            } else {
                Routing::OneWarp
            }
        } else if m * k <= PLAN_SMALL_PAIRS && e <= PLAN_SMALL_EXPERTS {
            Routing::Small
        } else {
            Routing::Wide
        }
    }
}

impl Cuda {
    /// The expert plan of `n` (token, k) pairs (`ids`, -1 for skipped):
    /// each expert's rows padded to `pad`, placed in token order. Returns the
    /// placed pairs' token rows and experts (`cap` places, -1 where unused)
    /// and each pair's place (-1 for skipped ids): a histogram
    /// (`plan_count`), then `plan_place_wide`, a block per expert, which sums
    /// the padded counts below its expert and places its pairs.
    pub(super) fn plan(
        &self,
        ids: &CudaSlice<i32>,
        n: usize,
        k: usize,
        e: usize,
        pad: usize,
        cap: usize,
    ) -> Result<(CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>)> {
        let d = &self.dev;
        let (ki, ni, padi, capi) = (k as i32, n as i32, pad as i32, cap as i32);
        let mut placed_row = d.scratch::<i32>(cap)?;
        let mut placed_mat = d.scratch::<i32>(cap)?;
        let mut slot = d.scratch::<i32>(n)?;
        let mut counts = d.zeros::<i32>(e)?;
        launch!(
            d,
            "plan_count",
            cfg1(cap),
            ids,
            &ni,
            &mut counts,
            &mut placed_row,
            &mut placed_mat,
            &capi
        )?;
        launch!(
            d,
            "plan_place_wide",
            cfg((e as u32, 1, 1), 256, 0),
            ids,
            &ni,
            &ki,
            &counts,
            &padi,
            &mut placed_row,
            &mut placed_mat,
            &mut slot
        )?;
        Ok((placed_row, placed_mat, slot))
    }

    /// Route `m` rows of router logits (softmax in place, top `k` ids and
    /// weights) and plan their pairs, the way `how` names
    /// ([`Routing::InRouter`] is the router launch's, not this).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn route_plan(
        &self,
        how: Routing,
        logits: &mut CudaSlice<f32>,
        ids: &mut CudaSlice<i32>,
        wts: &mut CudaSlice<f32>,
        m: usize,
        e: usize,
        k: usize,
        pad: usize,
        cap: usize,
    ) -> Result<(CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>)> {
        let d = &self.dev;
        let n = m * k;
        if e > 2048 {
            return Err(CudaError::Driver {
                op: "route".into(),
                msg: format!("{e} experts: the router kernel takes at most 2048"),
            });
        }
        let (mi, ei, ki, padi, capi) = (m as i32, e as i32, k as i32, pad as i32, cap as i32);
        // The plan's outputs: placed rows and experts, each pair's slot.
        let places = || -> Result<(CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>)> {
            Ok((d.scratch(cap)?, d.scratch(cap)?, d.scratch(n)?))
        };
        match how {
            Routing::InRouter => Err(CudaError::Driver {
                op: "route".into(),
                msg: "this routing runs in the router launch".into(),
            }),
            Routing::OneWarp => {
                let (mut placed_row, mut placed_mat, mut slot) = places()?;
                launch!(
                    d,
                    "route_plan_one_r",
                    cfg((1, 1, 1), 32, 0),
                    logits,
                    ids,
                    wts,
                    &ei,
                    &ki,
                    &padi,
                    &mut placed_row,
                    &mut placed_mat,
                    &mut slot,
                    &capi
                )?;
                Ok((placed_row, placed_mat, slot))
            }
            Routing::Small => {
                // A warp a row: the kernel's routing of up to `block_rows`
                // rows by the whole block measured no faster (H200, tg128
                // 247.05 -> 244.31), so none take it.
                let block_rows: i32 = 0;
                let (mut placed_row, mut placed_mat, mut slot) = places()?;
                launch!(
                    d,
                    "route_plan_small",
                    cfg((1, 1, 1), 256, 0),
                    logits,
                    ids,
                    wts,
                    &mi,
                    &ei,
                    &ki,
                    &padi,
                    &mut placed_row,
                    &mut placed_mat,
                    &mut slot,
                    &capi,
                    &block_rows
                )?;
                Ok((placed_row, placed_mat, slot))
            }
            Routing::Wide => {
                launch!(
                    d,
                    "route",
                    cfg((m.div_ceil(4) as u32, 1, 1), 128, 0),
                    logits,
                    ids,
                    wts,
                    &mi,
                    &ei,
                    &ki
                )?;
                self.plan(ids, n, k, e, pad, cap)
            }
        }
    }

    /// Routing and plan on host logits, for the kernel tests: (softmaxed
    /// logits, ids, weights, placed rows, placed experts, slots), through
    /// the launch the shape takes outside a router launch
    /// (`route_plan_one_r` for one row, `route_plan_small`, or `route` and
    /// the plan), or with `wide` through `route` and the plan whatever the
    /// shape.
    #[doc(hidden)]
    #[allow(clippy::type_complexity)]
    pub fn route_plan_host(
        &self,
        logits: &[f32],
        m: usize,
        k: usize,
        pad: usize,
        wide: bool,
    ) -> Result<(Vec<f32>, Vec<i32>, Vec<f32>, Vec<i32>, Vec<i32>, Vec<i32>)> {
        let e = logits.len() / m.max(1);
        let n = m * k;
        let cap = n + e.min(n) * (pad - 1);
        let how = if wide {
            Routing::Wide
        } else {
            Routing::select(m, k, e, false)
        };
        let mut lg = self.dev.upload(logits)?;
        let mut ids = self.dev.upload(&vec![i32::MIN; n])?;
        let mut wts = self.dev.upload(&vec![f32::NAN; n])?;
        let (pr, pm, sl) = self.route_plan(how, &mut lg, &mut ids, &mut wts, m, e, k, pad, cap)?;
        Ok((
            self.dev.download(&lg, m * e)?,
            self.dev.download(&ids, n)?,
            self.dev.download(&wts, n)?,
            self.dev.download(&pr, cap)?,
            self.dev.download(&pm, cap)?,
            self.dev.download(&sl, n)?,
        ))
    }

    /// The expert plan ([`Cuda::plan`]) on host data, for the kernel tests:
    /// (placed rows, placed experts, slots).
    #[doc(hidden)]
    pub fn plan_host(
        &self,
        ids: &[i32],
        k: usize,
        e: usize,
        pad: usize,
    ) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let n = ids.len();
        let cap = n + e.min(n) * (pad - 1);
        let idd = self.dev.upload(ids)?;
        let (r, m, sl) = self.plan(&idd, n, k, e, pad, cap)?;
        Ok((
            self.dev.download(&r, cap)?,
            self.dev.download(&m, cap)?,
            self.dev.download(&sl, n)?,
        ))
    }

    /// The shared expert of `m` token rows: ys = down(silu(gate x) * up x),
    /// gi = the gate's input projection (sigmoid applied by the combine).
    pub(super) fn shared_expert(
        &self,
        sh: &samesum_engine::model::weights::SharedW,
        xin: &Input,
        m: usize,
        fs: usize,
        ys: &mut CudaSlice<f32>,
        gi: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut sg = self.dev.scratch::<f32>(m * fs)?;
        let bases = [self.wptr(&sh.gate)?, self.wptr(&sh.up)?];
        let q = self.glu_on(
            &sh.gate,
            &sh.up,
            bases,
            xin,
            None,
            &mut sg,
            k_quant(sh.down.ty),
        )?;
        self.mm(&sh.gate_inp, xin, None, gi)?;
        self.mm(&sh.down, &Input::with_q8k(&sg, m, q), None, ys)
    }

    /// The rest of a decode-sized MoE call with a shared expert (see
    /// `moe_rows`): both GLUs in one launch into one buffer (the routed
    /// rows, then the token rows), one quantization of it, both down
    /// projections in one launch, then the combine. The routed pairs read
    /// their token's quantized row through `placed_row` (the bytes a gather
    /// would have copied), so no gather runs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_joint_rows(
        &self,
        mw: &MoeW,
        sh: Option<&samesum_engine::model::weights::SharedW>,
        bases: [u64; 3],
        mats: &CudaSlice<i32>,
        placed_row: &CudaSlice<i32>,
        xin: &Input,
        cap: usize,
        m: usize,
        slot: &CudaSlice<i32>,
        wts: &CudaSlice<f32>,
        gi: Option<CudaSlice<f32>>,
        y: &mut CudaSlice<f32>,
        k: usize,
        after: Option<&AfterNorm>,
    ) -> Result<bool> {
        use crate::device::{MoeJobs, addr};
        let d = &self.dev;
        let (f, dm) = (mw.gate.rows, mw.down.rows);
        let q8_0 = q8_0_act;
        let quant = |input: &Input, t: GgmlType| -> Result<u64> {
            Ok(addr(
                d,
                if q8_0(t) {
                    input.q80(d)?
                } else {
                    input.q8k(d)?
                },
            ))
        };
        // Q4_K on the lane kernels (the down launch quantizing the rows it
        // reads: a Q4_K row's width is a multiple of 256); the other formats
        // a warp per (weight row, activation row).
        let glu_kernel = quant_kernels(mw.gate.ty).map_or("", |k| k.moe_glu);
        let down_kernel = quant_kernels(mw.down.ty).map_or("", |k| k.moe);
        let nb = |w: &Matrix| (w.cols / w.ty.block_size()) as i32;
        // Both GLUs: rows 0..cap the routed pairs, cap..cap+m the tokens
        // (a second job only with a shared expert).
        let ms = if sh.is_some() { m } else { 0 };
        let jobs_n = 1 + sh.is_some() as usize;
        let g = d.scratch::<f32>((cap + ms) * f)?;
        let gp = addr(d, &g);
        let xq = quant(xin, mw.gate.ty)?;
        let mut jobs = MoeJobs {
            wg: [
                bases[0],
                sh.map(|s| self.wptr(&s.gate)).transpose()?.unwrap_or(0),
            ],
            wu: [
                bases[1],
                sh.map(|s| self.wptr(&s.up)).transpose()?.unwrap_or(0),
            ],
            stride: [(mw.gate.rows * mw.gate.row_bytes) as i64, 0],
            mats: [addr(d, mats), 0],
            a: [xq, xq],
            y: [gp, gp + (cap * f * 4) as u64],
            amap: [addr(d, placed_row), 0],
            rows: [f as i32, f as i32],
            m: [cap as i32, ms as i32],
        };
        // Q4_K takes the lane-row kernels.
        let lane = |t: GgmlType| t == GgmlType::Q4_K;
        let moe_cfg = |t: GgmlType, rows: usize, nb: i32| {
            if lane(t) {
                cfg(
                    ((jobs_n * rows.div_ceil(32)) as u32, cap.max(ms) as u32, 1),
                    lane_threads(nb),
                    0,
                )
            } else {
                cfg(
                    ((jobs_n * rows.div_ceil(4)) as u32, cap.max(ms) as u32, 1),
                    128,
                    0,
                )
            }
        };
        let (rb, nbg) = (mw.gate.row_bytes as i32, nb(&mw.gate));
        let row_q = if q8_0(mw.down.ty) {
            f / 32 * 36
        } else {
            f / 256 * 304
        };
        let gin = Input::new(&g, cap + ms);
        // On lane rows the down launch quantizes the rows it reads.
        let qin = lane(mw.down.ty);
        launch!(d, glu_kernel, moe_cfg(mw.gate.ty, f, nbg), &jobs, &rb, &nbg)?;
        // One quantization of both GLU outputs (unless the down launch
        // quantizes them), then both down projections.
        let ga = if qin { gp } else { quant(&gin, mw.down.ty)? };
        let oe = d.scratch::<f32>(cap * dm)?;
        let ys = d.scratch::<f32>((ms * dm).max(1))?;
        jobs.wg = [
            bases[2],
            sh.map(|s| self.wptr(&s.down)).transpose()?.unwrap_or(0),
        ];
        jobs.wu = [0, 0];
        jobs.stride = [(mw.down.rows * mw.down.row_bytes) as i64, 0];
        jobs.a = if qin {
            [ga, ga + (cap * f * 4) as u64]
        } else {
            [ga, ga + (cap * row_q) as u64]
        };
        jobs.y = [addr(d, &oe), addr(d, &ys)];
        jobs.amap = [0, 0];
        jobs.rows = [dm as i32, dm as i32];
        let (rb, nbd) = (mw.down.row_bytes as i32, nb(&mw.down));
        launch!(
            d,
            down_kernel,
            moe_cfg(mw.down.ty, dm, nbd),
            &jobs,
            &rb,
            &nbd
        )?;
        let gi = match gi {
            Some(gi) => gi,
            None => d.scratch::<f32>(1)?,
        };
        let (mi, ki, dmi, shared) = (m as i32, k as i32, dm as i32, sh.is_some() as i32);
        self.reverse_topk_if(slot, wts, m, k)?;
        if let Some(an) = after {
            launch!(
                d,
                "moe_combine_add_rms_norm_q8k",
                cfg((m as u32, 1, 1), 256, 0),
                &oe,
                slot,
                wts,
                &ys,
                &gi,
                y,
                &ki,
                &shared,
                &an.acc,
                an.w,
                &an.out,
                &an.q,
                &dmi,
                &an.eps
            )?;
            return Ok(true);
        }
        launch!(
            d,
            "moe_combine",
            cfg1(m * dm),
            &oe,
            slot,
            wts,
            &ys,
            &gi,
            y,
            &mi,
            &ki,
            &dmi,
            &shared
        )?;
        Ok(false)
    }

    /// The MoE of `x` into `y`, then `h += y` and `x` = RMSNorm(h) with
    /// weight `which` (the trait's `moe_add_rms_norm`). Where the call takes
    /// the decode launches (`moe_joint_rows`) and the norm is a layer norm
    /// of Q8_K width, the combine's launch runs the norm and writes `x`'s
    /// Q8_K rows.
    pub(super) fn moe_then_norm(
        &self,
        model: &Model,
        mw: &MoeW,
        which: Norm,
        h: &mut CudaBuf,
        x: &mut CudaBuf,
        y: &mut CudaBuf,
    ) -> R<()> {
        let w = which.weight(model);
        // The fused norm is add_rms_norm_q8k's (a layer norm of Q8_K width).
        let fits = !matches!(which, Norm::Output)
            && w.len() == model.hp.n_embd
            && w.len().is_multiple_of(256)
            && h.len() == x.len()
            && y.len() == x.len();
        if fits {
            let d = &self.dev;
            // The storage of x's Q8_K rows, which the combine's launch
            // writes when it runs the norm (the MoE reads the current ones
            // first, in earlier launches).
            let len = x.len();
            let q = crate::device::addr(d, x.q8k_storage(d, len / 256 * 304).map_err(e)?);
            let an = AfterNorm {
                acc: crate::device::addr(d, &h.rows),
                w: self.vec(w).map_err(e)?,
                out: crate::device::addr(d, &x.rows),
                q,
                eps: model.hp.eps,
            };
            let fused = self
                .moe_rows_then(model, mw, &x.rows, x.q8k(), y.write(), Some(&an))
                .map_err(e)?;
            if fused {
                // The launch wrote h too (no Q8_K rows of it).
                h.write();
                x.q8k_written();
                return Ok(());
            }
        } else {
            self.moe_rows_then(model, mw, &x.rows, x.q8k(), y.write(), None)
                .map_err(e)?;
        }
        self.add_rms_norm(model, which, h, y, x)
    }

    pub(super) fn moe_rows(
        &self,
        model: &Model,
        mw: &MoeW,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<u8>>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.moe_rows_then(model, mw, x, xq, y, None).map(|_| ())
    }

    /// `moe_rows`, and where `after` is given and the call takes the
    /// decode launches (`moe_joint_rows`), the next norm in the combine's
    /// launch: then the norm's Q8_K rows are returned (else `None`, and the
    /// caller runs the norm).
    pub(super) fn moe_rows_then(
        &self,
        model: &Model,
        mw: &MoeW,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<u8>>,
        y: &mut CudaSlice<f32>,
        after: Option<&AfterNorm>,
    ) -> Result<bool> {
        let hp = &model.hp;
        let d = &self.dev;
        let (dm, e, k, f, fs) = (
            hp.n_embd,
            hp.n_expert,
            hp.n_expert_used,
            hp.n_ff_exp,
            hp.n_ff_shexp,
        );
        let m = x.len() / dm;
        let n = m * k;
        // Wide calls pad each expert's rows to the tensor-core tile, so a tile
        // holds one expert; `cap` bounds the padded total (at most min(e, n)
        // experts have rows). Rows past the real ones stay unused (-1).
        let pad = if n > 16 { self.tc_pad(n, e) } else { 1 };
        let cap = n + e.min(n) * (pad - 1);
        let mut logits = d.scratch::<f32>(m * e)?;
        let xin = Input::with_given_q8k(x, m, xq);
        // Decode-sized calls with a shared expert of the routed experts'
        // shape run both in the same launches (`mm_*_moe_*`: router and
        // input gate, the GLUs, one quantization of both GLU outputs, the
        // down projections), each row computed as the separate kernels do.
        // Without a shared expert the routed experts alone take those
        // launches (`routed_only`). Either way the routed pairs read their
        // token's quantized row in place, with no gather.
        let joint_ok = self.tier.is_none()
            && cap <= 16
            && (mw.up.ty, mw.up.cols, mw.up.row_bytes)
                == (mw.gate.ty, mw.gate.cols, mw.gate.row_bytes)
            && quant_kernels(mw.gate.ty).is_some()
            && quant_kernels(mw.down.ty).is_some();
        let joint = match &mw.shared {
            Some(sh)
                if joint_ok
                    && f == fs
                    && mw.router.ty == GgmlType::F32
                    && sh.gate_inp.ty == GgmlType::F32
                    && sh.gate_inp.cols == mw.router.cols
                    && [&sh.gate, &sh.up].iter().all(|w| {
                        (w.ty, w.cols, w.row_bytes) == (mw.gate.ty, mw.gate.cols, mw.gate.row_bytes)
                    })
                    && (sh.down.ty, sh.down.cols, sh.down.row_bytes)
                        == (mw.down.ty, mw.down.cols, mw.down.row_bytes) =>
            {
                Some(sh)
            }
            _ => None,
        };
        let routed_only = mw.shared.is_none() && joint_ok;
        let mut gi_joint = None;
        let mut ids = d.scratch::<i32>(n)?;
        let mut wts = d.scratch::<f32>(n)?;
        let (mi, ki) = (m as i32, k as i32);
        let routing = Routing::select(m, k, e, mw.router.ty == GgmlType::F32);
        // One decode row: the router's launch routes and plans it too.
        let fold = routing == Routing::InRouter;
        let mut folded = None;
        if joint.is_some() || fold {
            let gi = d.scratch::<f32>(m)?;
            let (w1, y1, r1) = match joint {
                Some(sh) => (self.wptr(&sh.gate_inp)?, crate::device::addr(d, &gi), 1),
                None => (0, 0, 0),
            };
            let nj = if joint.is_some() { 2 } else { 1 };
            let mj = crate::device::MmJobs {
                w: [self.wptr(&mw.router)?, w1, 0, 0],
                y: [crate::device::addr(d, &logits), y1, 0, 0],
                rows: [e as i32, r1, 0, 0],
                nj,
            };
            let blocks = (e.div_ceil(4) + r1 as usize) as u32;
            let (rb, ci) = (mw.router.row_bytes as i32, dm as i32);
            if fold {
                let mut placed_row = d.scratch::<i32>(cap)?;
                let mut placed_mat = d.scratch::<i32>(cap)?;
                let mut slot = d.scratch::<i32>(n)?;
                let (ei, padi, capi) = (e as i32, pad as i32, cap as i32);
                let c0 = self.dev.lane() * COUNTERS;
                let counter = self.counters.slice(c0..c0 + 1);
                launch!(
                    d,
                    "mm_f32_multi_route_rd",
                    cfg((blocks, 1, 1), 128, 0),
                    &mj,
                    &rb,
                    x,
                    &ci,
                    &mut ids,
                    &mut wts,
                    &ei,
                    &ki,
                    &padi,
                    &mut placed_row,
                    &mut placed_mat,
                    &mut slot,
                    &capi,
                    &counter
                )?;
                folded = Some((placed_row, placed_mat, slot));
            } else {
                launch!(
                    d,
                    "mm_f32_multi",
                    cfg((blocks, m as u32, 1), 128, 0),
                    &mj,
                    &rb,
                    x,
                    &mi,
                    &ci
                )?;
            }
            if joint.is_some() {
                gi_joint = Some(gi);
            }
        } else {
            self.mm(&mw.router, &xin, None, &mut logits)?;
        }
        let (placed_row, placed_mat, slot) = match folded {
            Some(p) => p,
            None => self.route_plan(routing, &mut logits, &mut ids, &mut wts, m, e, k, pad, cap)?,
        };
        // This MoE's layer (its index picks the tier's expert slots).
        let layer = model.w.layers.iter().position(|l| std::ptr::eq(&l.moe, mw));
        let capi = cap as i32;
        // The shared expert's outputs (written on the second stream when it
        // runs beside the routed experts: prefill-sized calls, resident
        // weights, launches not being timed).
        let mut ys = d.scratch::<f32>(if mw.shared.is_some() { m * dm } else { 1 })?;
        let mut gi = d.scratch::<f32>(m.max(1))?;
        let side_done = match &mw.shared {
            Some(sh) if m > 16 && self.tier.is_none() && !d.profiling() => {
                // The token rows' quantized form, made on the main stream
                // before the fork (it is read on both streams).
                if k_quant(sh.gate.ty) {
                    xin.q8k(d)?;
                } else if q8_0_act(sh.gate.ty) {
                    xin.q80(d)?;
                }
                let ((), ev) =
                    d.on_side(|| self.shared_expert(sh, &xin, m, fs, &mut ys, &mut gi))?;
                Some(ev)
            }
            _ => None,
        };
        // Where the experts' weights are read: the resident file, or in tier
        // mode the decode cache's slot pools (rows remapped from expert ids
        // to slots) or a staged copy of the layer (expert ids as they are).
        // Either way every row reads the same bytes.
        let mut remapped = None;
        let mut staged = None;
        let bases = match (&self.tier, layer) {
            (Some(t), Some(l)) if t.uses_cache(m, k) => {
                // The one read-back per layer: the step's expert ids.
                let ids_h = d.download(&ids, n)?;
                let (table, bases) = t.fetch(d, model, l, &ids_h)?;
                let table = d.upload(&table)?;
                let mut mats = d.scratch::<i32>(cap)?;
                launch!(
                    d,
                    "remap_ids",
                    cfg1(cap),
                    &placed_mat,
                    &table,
                    &mut mats,
                    &capi
                )?;
                remapped = Some(mats);
                bases
            }
            (Some(t), Some(l)) => {
                let (b, bases) = t.stage(d, model, l)?;
                staged = Some((t, b, l));
                bases
            }
            _ => [
                self.wptr(&mw.gate)?,
                self.wptr(&mw.up)?,
                self.wptr(&mw.down)?,
            ],
        };
        let mats = remapped.as_ref().unwrap_or(&placed_mat);
        if joint.is_some() || routed_only {
            return self.moe_joint_rows(
                mw,
                joint,
                bases,
                mats,
                &placed_row,
                &xin,
                cap,
                m,
                &slot,
                &wts,
                gi_joint,
                y,
                k,
                after,
            );
        }
        // Gather, the experts' rows (each tile reads its experts' weights once), down.
        // Where gate and up read Q8_K activations, the token rows are
        // quantized once and their blocks gathered (a quantized row is a
        // function of the row alone; the shared expert reuses them), else
        // the f32 rows are gathered.
        let dmi = dm as i32;
        let gather_quantized = k_quant(mw.gate.ty) && k_quant(mw.up.ty) && dm % 256 == 0;
        let xe;
        let xein = if gather_quantized {
            let xq = xin.q8k(d)?;
            let words = dm / 256 * 304 / 16;
            let mut xeq = d.scratch::<u8>(cap * words * 16)?;
            let wi = words as i32;
            launch!(
                d,
                "gather_words_live",
                cfg1(cap * words),
                xq,
                &placed_row,
                &mut xeq,
                &wi,
                &capi
            )?;
            Input::quantized(xeq, cap, dm).padded(pad).live(true)
        } else {
            let mut rows = d.scratch::<f32>(cap * dm)?;
            launch!(
                d,
                "gather_rows",
                cfg1(cap * dm),
                x,
                &placed_row,
                &mut rows,
                &dmi,
                &capi
            )?;
            xe = rows;
            Input::new(&xe, cap).padded(pad).live(true)
        };
        let mut ge = d.scratch::<f32>(cap * f)?;
        let gq = self.glu_on(
            &mw.gate,
            &mw.up,
            [bases[0], bases[1]],
            &xein,
            Some(mats),
            &mut ge,
            k_quant(mw.down.ty),
        )?;
        let mut oe = d.scratch::<f32>(cap * dm)?;
        let gin = Input::with_q8k(&ge, cap, gq).padded(pad).live(true);
        self.matmul_on(&mw.down, bases[2], &gin, Some(mats), &mut oe)?;
        if let Some((t, b, l)) = staged {
            t.staged_read(d, model, b, l)?;
        }
        // Shared expert: computed beside the routed experts (above) when it
        // went to the second stream, here otherwise.
        if let Some(ev) = &side_done {
            d.wait_for(ev)?;
        } else if let Some(sh) = &mw.shared {
            self.shared_expert(sh, &xin, m, fs, &mut ys, &mut gi)?;
        }
        let shared = mw.shared.is_some().then_some((&ys, &gi));
        self.reverse_topk_if(&slot, &wts, m, k)?;
        self.moe_combine_on(&oe, &slot, &wts, shared, y, m, k, dm, false)?;
        Ok(false)
    }

    /// With [`Cuda::with_reversed_topk`] and more than one row, each row's
    /// top-k slots and weights reversed in place before the combine.
    fn reverse_topk_if(
        &self,
        slot: &CudaSlice<i32>,
        wts: &CudaSlice<f32>,
        m: usize,
        k: usize,
    ) -> Result<()> {
        if !self.reversed_topk || m < 2 {
            return Ok(());
        }
        let (mi, ki) = (m as i32, k as i32);
        launch!(&self.dev, "reverse_topk", cfg1(m), slot, wts, &mi, &ki)
    }

    /// A wide call's MoE combine: `y[r] = sum over s < k, slot[r k + s] >= 0,
    /// in s order, of wts[r k + s] * out[slot[r k + s]]`, then, with a shared
    /// expert `(ys, gi)`, `+ sigmoid(gi[r]) * ys[r]`; on `moe_combine4` (four
    /// columns a thread) where `d` is a multiple of 4 and the three row
    /// buffers are 16-byte aligned, else (and with `column`, the reference
    /// the tests compare against) on `moe_combine`, a thread a column. The
    /// same bytes either way.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_combine_on(
        &self,
        out: &CudaSlice<f32>,
        slot: &CudaSlice<i32>,
        wts: &CudaSlice<f32>,
        shared: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        y: &mut CudaSlice<f32>,
        m: usize,
        k: usize,
        d: usize,
        column: bool,
    ) -> Result<()> {
        let dev = &self.dev;
        // Without a shared expert the kernel reads neither pointer.
        let unused;
        let (ys, gi) = match shared {
            Some(pair) => pair,
            None => {
                unused = dev.scratch::<f32>(1)?;
                (&unused, &unused)
            }
        };
        let (mi, ki, di, sh) = (m as i32, k as i32, d as i32, shared.is_some() as i32);
        // 16-byte loads and stores: whole rows of them, from aligned bases.
        let vec = !column
            && d.is_multiple_of(4)
            && [addr(dev, out), addr(dev, ys), addr(dev, &*y)]
                .iter()
                .all(|a| a.is_multiple_of(16));
        launch!(
            dev,
            if vec { "moe_combine4" } else { "moe_combine" },
            cfg1(if vec { m * d / 4 } else { m * d }),
            out,
            slot,
            wts,
            ys,
            gi,
            y,
            &mi,
            &ki,
            &di,
            &sh
        )
    }

    /// `moe_combine_on` of host rows (for tests): `out` holds the expert
    /// rows (`d` wide), `slot` and `wts` `k` a row for `m` rows, `shared`
    /// the shared expert's rows and gate inputs; `column`: on `moe_combine`
    /// whatever the width. The output starts as NaN.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_host(
        &self,
        out: &[f32],
        slot: &[i32],
        wts: &[f32],
        shared: Option<(&[f32], &[f32])>,
        m: usize,
        k: usize,
        d: usize,
        column: bool,
    ) -> Result<Vec<f32>> {
        // Sizes and slots that would send the kernel out of its buffers are
        // an error naming what disagrees.
        let rows = out.len().checked_div(d).unwrap_or(0);
        let shared_ok = shared.is_none_or(|(ys, gi)| ys.len() == m * d && gi.len() == m);
        let bad_slot = slot.iter().find(|&&s| s >= 0 && s as usize >= rows);
        if d == 0
            || !out.len().is_multiple_of(d)
            || slot.len() != m * k
            || wts.len() != m * k
            || !shared_ok
            || bad_slot.is_some()
        {
            return Err(CudaError::Driver {
                op: "moe_combine".into(),
                msg: format!(
                    "{m} rows x {k} slots of width {d}: out {} values ({rows} rows), slot {}, \
                     wts {}, shared {:?}, first slot past the rows {bad_slot:?}",
                    out.len(),
                    slot.len(),
                    wts.len(),
                    shared.map(|(ys, gi)| (ys.len(), gi.len()))
                ),
            });
        }
        let dev = &self.dev;
        let (od, sd, wd) = (dev.upload(out)?, dev.upload(slot)?, dev.upload(wts)?);
        let sh = match shared {
            Some((ys, gi)) => Some((dev.upload(ys)?, dev.upload(gi)?)),
            None => None,
        };
        let mut y = dev.upload(&vec![f32::NAN; m * d])?;
        self.moe_combine_on(
            &od,
            &sd,
            &wd,
            sh.as_ref().map(|(a, b)| (a, b)),
            &mut y,
            m,
            k,
            d,
            column,
        )?;
        dev.download(&y, m * d)
    }
}

/// Host checks of the decode routing kernel's shortcuts (moe.cu): the
/// sorting networks of `sort_picks`, read from the kernel source, sort every
/// 0/1 input (so every input); the top k from each lane's sorted entries
/// picks what the argmax rounds pick, in the same order, ties included; and
/// the one-warp plan places every pair where the block plan does. The GPU
/// test compares the kernels themselves.
#[cfg(test)]
mod topk_tests {
    use samesum_quant::rng::Rng;

    /// The comparator pairs of `sort_picks`'s branch for `u` entries.
    fn network(u: usize) -> Vec<(usize, usize)> {
        let src = include_str!("../../kernels/moe.cu");
        let body = &src[src.find("void sort_picks(").expect("sort_picks")..];
        let body = &body[..body.find("\n}\n").expect("end of sort_picks")];
        let part = if u == 4 {
            &body[body.find("if (U == 4)").unwrap()..body.find("} else {").unwrap()]
        } else {
            &body[body.find("} else {").unwrap()..]
        };
        part.match_indices("pick_cas(v, id, ")
            .map(|(i, m)| {
                let rest = &part[i + m.len()..];
                let nums: Vec<usize> = rest[..rest.find(')').unwrap()]
                    .split(", ")
                    .map(|x| x.trim().parse().unwrap())
                    .collect();
                (nums[0], nums[1])
            })
            .collect()
    }

    /// pick_before: larger value first, lower id among equals, absent last.
    fn before(a: (f32, i32), b: (f32, i32)) -> bool {
        if b.1 < 0 {
            return a.1 >= 0;
        }
        if a.1 < 0 {
            return false;
        }
        a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
    }

    fn sort(net: &[(usize, usize)], e: &mut [(f32, i32)]) {
        for &(a, b) in net {
            if before(e[b], e[a]) {
                e.swap(a, b);
            }
        }
    }

    #[test]
    fn the_sorting_networks_sort_every_input() {
        for u in [4usize, 8] {
            let net = network(u);
            assert_eq!(net.len(), if u == 4 { 5 } else { 19 });
            for bits in 0u32..1 << u {
                let mut e: Vec<(f32, i32)> =
                    (0..u).map(|i| ((bits >> i & 1) as f32, i as i32)).collect();
                sort(&net, &mut e);
                assert!(
                    e.windows(2).all(|w| before(w[0], w[1])),
                    "u {u}: {bits:#b} -> {e:?}"
                );
            }
            // A network with one comparator left out fails some input.
            for skip in 0..net.len() {
                let short: Vec<_> = (0..net.len())
                    .filter(|&i| i != skip)
                    .map(|i| net[i])
                    .collect();
                let fails = (0u32..1 << u).any(|bits| {
                    let mut e: Vec<(f32, i32)> =
                        (0..u).map(|i| ((bits >> i & 1) as f32, i as i32)).collect();
                    sort(&short, &mut e);
                    !e.windows(2).all(|w| before(w[0], w[1]))
                });
                assert!(fails, "u {u}: comparator {skip} is not needed");
            }
        }
    }

    /// The argmax rounds (topk_row_u's general path): each lane's best entry
    /// not taken, then the warp's best of those.
    fn rounds(v: &[f32], k: usize) -> Vec<(i32, f32)> {
        let mut taken = vec![false; v.len()];
        (0..k)
            .map(|_| {
                let mut cand: Vec<(f32, i32)> = vec![(0.0, -1); 32];
                for (i, &x) in v.iter().enumerate() {
                    let c = &mut cand[i % 32];
                    if !taken[i] && (c.1 < 0 || x > c.0) {
                        *c = (x, i as i32);
                    }
                }
                let best = warp_best(&cand);
                if best.1 >= 0 {
                    taken[best.1 as usize] = true;
                }
                (best.1, best.0)
            })
            .collect()
    }

    /// warp_argmax's butterfly on (value, id) candidates.
    fn warp_best(cand: &[(f32, i32)]) -> (f32, i32) {
        let mut c = cand.to_vec();
        for o in [16, 8, 4, 2, 1] {
            let prev = c.clone();
            for l in 0..32 {
                let (ov, oi) = prev[l ^ o];
                let (bv, best) = c[l];
                if oi >= 0 && (best < 0 || ov > bv || (ov == bv && oi < best)) {
                    c[l] = (ov, oi);
                }
            }
        }
        c[0]
    }

    /// The sorted-lane path: each lane's entries sorted once, then per round
    /// the lanes' first entries not taken.
    fn sorted_lanes(v: &[f32], k: usize, u: usize) -> Vec<(i32, f32)> {
        let net = network(u);
        let lanes: Vec<Vec<(f32, i32)>> = (0..32)
            .map(|l| {
                let mut e: Vec<(f32, i32)> = (0..u)
                    .map(|j| {
                        let i = l + 32 * j;
                        if i < v.len() {
                            (v[i], i as i32)
                        } else {
                            (0.0, -1)
                        }
                    })
                    .collect();
                sort(&net, &mut e);
                e
            })
            .collect();
        let mut head = [0usize; 32];
        (0..k)
            .map(|_| {
                let cand: Vec<(f32, i32)> = (0..32)
                    .map(|l| match lanes[l].get(head[l]) {
                        Some(&(x, i)) if i >= 0 => (x, i),
                        _ => (0.0, -1),
                    })
                    .collect();
                let best = warp_best(&cand);
                if best.1 >= 0 {
                    head[(best.1 % 32) as usize] += 1;
                }
                (best.1, best.0)
            })
            .collect()
    }

    #[test]
    fn sorted_lanes_pick_what_the_rounds_pick() {
        let mut rng = Rng::new(8);
        let mut cases = 0;
        for e in [5usize, 8, 33, 100, 128, 200, 256] {
            let u = e.div_ceil(32).next_power_of_two().max(4);
            for k in [1usize, 2, 8, 9] {
                for _ in 0..40 {
                    // Values on a coarse grid (ties) or spread; softmax rows
                    // hold values >= 0.
                    let coarse = rng.below(2) == 0;
                    let v: Vec<f32> = (0..e)
                        .map(|_| {
                            if coarse {
                                rng.below(6) as f32 * 0.125
                            } else {
                                rng.range(0.0, 1.0)
                            }
                        })
                        .collect();
                    let (a, b) = (rounds(&v, k.min(e + 1)), sorted_lanes(&v, k.min(e + 1), u));
                    assert_eq!(a.len(), b.len());
                    for (s, (x, y)) in a.iter().zip(&b).enumerate() {
                        assert_eq!(x.0, y.0, "e {e} k {k} pick {s}: ids");
                        assert_eq!(x.1.to_bits(), y.1.to_bits(), "e {e} k {k} pick {s}");
                    }
                    cases += 1;
                }
            }
        }
        assert!(cases > 1000);
    }

    /// plan_warp: a match per expert, places counted below the lane, offsets
    /// summed from the first lanes of the experts with lower ids.
    fn warp_plan(ids: &[i32], k: usize, pad: usize, cap: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
        let n = ids.len();
        let id = |l: usize| if l < n { ids[l] } else { -1 };
        let valid = |l: usize| l < n && id(l) >= 0;
        let key = |l: usize| if valid(l) { id(l) } else { -1 };
        let same = |l: usize| (0..32).filter(|&j| key(j) == key(l)).collect::<Vec<_>>();
        let before = |l: usize| same(l).iter().filter(|&&j| j < l).count();
        let padded = |l: usize| {
            if valid(l) && before(l) == 0 {
                same(l).len().div_ceil(pad) * pad
            } else {
                0
            }
        };
        let (mut row, mut mat, mut slot) = (vec![-1; cap], vec![-1; cap], vec![-1; n]);
        for l in 0..n {
            if valid(l) {
                let off: usize = (0..32)
                    .filter(|&j| padded(j) > 0 && id(j) < id(l))
                    .map(padded)
                    .sum();
                let dst = off + before(l);
                row[dst] = (l / k) as i32;
                mat[dst] = id(l);
                slot[l] = dst as i32;
            }
        }
        (row, mat, slot)
    }

    #[test]
    fn the_one_warp_plan_places_pairs_as_the_block_plan() {
        let mut rng = Rng::new(12);
        for _ in 0..500 {
            let k = [1usize, 2, 4, 8][rng.below(4) as usize];
            let e = [8usize, 128, 256][rng.below(3) as usize];
            let n = k * (1 + rng.below((32 / k) as u64) as usize);
            let pad = [1usize, 16][rng.below(2) as usize];
            // Few distinct experts (shared ones) and some skipped picks.
            let pool = 1 + rng.below(e as u64) as i32;
            let ids: Vec<i32> = (0..n)
                .map(|_| {
                    if rng.below(10) == 0 {
                        -1
                    } else {
                        rng.below(pool as u64) as i32
                    }
                })
                .collect();
            let cap = n + e.min(n) * (pad - 1);
            assert_eq!(
                warp_plan(&ids, k, pad, cap),
                super::plan_reference(&ids, k, e, pad, cap),
                "ids {ids:?} k {k} pad {pad}"
            );
        }
    }
}
