//! `impl Backend for Cuda`: the engine's ops mapped to the op families.

use super::*;

impl Backend for Cuda {
    type Buf = CudaSlice<f32>;
    type State = CudaState;

    fn name(&self) -> String {
        // The opt-in attention (a different function) shows in the name, so
        // that benchmark tables and logs say which arm ran.
        match (self.att_tc, self.att_tc_acc) {
            (true, true) => with_note(&self.dev.name, "fast attention"),
            (true, false) => with_note(&self.dev.name, "ATT_TC"),
            _ if self.att_ulp => with_note(&self.dev.name, "ATT_ULP probe"),
            _ => self.dev.name.clone(),
        }
    }

    fn alloc(&self, n: usize) -> R<CudaSlice<f32>> {
        self.dev.zeros::<f32>(n).map_err(e)
    }

    fn upload(&self, host: &[f32]) -> R<CudaSlice<f32>> {
        self.dev.upload(host).map_err(e)
    }

    fn download(&self, buf: &CudaSlice<f32>) -> R<Vec<f32>> {
        self.dev.download(buf, buf.len()).map_err(e)
    }

    fn new_state(&self, model: &Model, ctx: usize, kv: KvType) -> R<CudaState> {
        let hp = &model.hp;
        let kvw = hp.n_head_kv * hp.head_dim;
        let f16 = kv == KvType::F16;
        let el = if f16 { 2 } else { 4 };
        let mut kvs = Vec::new();
        let mut lin = Vec::new();
        for kind in &hp.layers {
            if *kind == samesum_engine::model::LayerKind::Attention {
                kvs.push(Some((
                    self.dev.zeros::<u8>(ctx * kvw * el).map_err(e)?,
                    self.dev.zeros::<u8>(ctx * kvw * el).map_err(e)?,
                )));
                lin.push(None);
            } else {
                let s = hp.ssm.ok_or_else(|| {
                    EngineError::BadHParam("linear layer without ssm sizes".into())
                })?;
                kvs.push(None);
                lin.push(Some((
                    self.dev
                        .zeros::<f32>((s.d_conv - 1) * s.conv_dim())
                        .map_err(e)?,
                    self.dev
                        .zeros::<f32>(s.n_v_heads * s.head_k_dim * s.head_v_dim)
                        .map_err(e)?,
                )));
            }
        }
        Ok(CudaState {
            pos: 0,
            ctx,
            kvw,
            kv: kvs,
            f16,
            linear: lin,
            pos_dev: self.dev.zeros::<i32>(1).map_err(e)?,
            pos_dev_val: None,
            lane: 0,
            other_pos_dev: self.dev.zeros::<i32>(1).map_err(e)?,
            other_pos_dev_val: None,
            whole_ctx: false,
            eager_steps: 0,
            no_graph: false,
            step: None,
        })
    }

    fn position(&self, st: &CudaState) -> usize {
        st.pos
    }

    fn capacity(&self, st: &CudaState) -> usize {
        st.ctx
    }

    fn download_state(&self, st: &CudaState) -> R<Vec<f32>> {
        let mut out = vec![st.pos as f32];
        let w = st.kvw;
        let el = if st.f16 { 2 } else { 4 };
        let n = st.pos * w * el;
        let val = |b: &[u8], i: usize| -> f32 {
            if st.f16 {
                half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
            } else {
                f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
            }
        };
        for (k, v) in st.kv.iter().flatten() {
            let kh = self.dev.download(k, n).map_err(e)?;
            let vh = self.dev.download(v, n).map_err(e)?;
            for pos in 0..st.pos {
                for i in 0..w {
                    out.push(val(&kh, pos * w + i));
                    out.push(val(&vh, pos * w + i));
                }
            }
        }
        for (c, s) in st.linear.iter().flatten() {
            out.extend(self.dev.download(c, c.len()).map_err(e)?);
            out.extend(self.dev.download(s, s.len()).map_err(e)?);
        }
        Ok(out)
    }

    fn advance(&self, st: &mut CudaState, m: usize) {
        st.pos += m;
    }

    fn lanes(&self) -> usize {
        if self.wave && self.tier.is_none() && !self.dev.profiling() {
            2
        } else {
            1
        }
    }

    fn enter_lane(&self, st: &mut CudaState, lane: usize, pos: usize) -> R<()> {
        let lane = lane.min(1);
        if st.lane != lane {
            std::mem::swap(&mut st.pos_dev, &mut st.other_pos_dev);
            std::mem::swap(&mut st.pos_dev_val, &mut st.other_pos_dev_val);
            st.lane = lane;
        }
        st.pos = pos;
        self.dev.set_lane(lane);
        Ok(())
    }

    fn lane_mark(&self, layer: usize) -> R<()> {
        let ev = self.dev.lane_event().map_err(e)?;
        let mut marks = self.lane_marks.lock().unwrap_or_else(|p| p.into_inner());
        let v = &mut marks[self.dev.lane()];
        if v.len() <= layer {
            v.resize_with(layer + 1, || None);
        }
        v[layer] = Some(ev);
        Ok(())
    }

    fn lane_wait(&self, lane: usize, layer: usize) -> R<()> {
        let marks = self.lane_marks.lock().unwrap_or_else(|p| p.into_inner());
        match marks
            .get(lane)
            .and_then(|v| v.get(layer))
            .and_then(|m| m.as_ref())
        {
            Some(ev) => self.dev.wait_for(ev).map_err(e),
            None => Err(e(CudaError::Driver {
                op: "lane_wait".into(),
                msg: format!("lane {lane} has no mark for layer {layer}"),
            })),
        }
    }

    fn rows(&self, x: &CudaSlice<f32>, width: usize, r0: usize, n: usize) -> R<CudaSlice<f32>> {
        let mut out = self.dev.scratch::<f32>(n * width).map_err(e)?;
        let src = x.slice(r0 * width..(r0 + n) * width);
        self.dev
            .current()
            .memcpy_dtod(&src, &mut out)
            .map_err(|x| e(drv("copy rows", x)))?;
        Ok(out)
    }

    fn set_rows(
        &self,
        dst: &mut CudaSlice<f32>,
        width: usize,
        r0: usize,
        src: &CudaSlice<f32>,
    ) -> R<()> {
        let mut d = dst.slice_mut(r0 * width..r0 * width + src.len());
        self.dev
            .current()
            .memcpy_dtod(src, &mut d)
            .map_err(|x| e(drv("copy rows", x)))
    }

    fn embed(&self, model: &Model, tokens: &[u32], out: &mut CudaSlice<f32>) -> R<()> {
        // Every forward call starts here: its size picks the launch mode.
        self.dev.rows_in_call(tokens.len());
        let w = &model.w;
        let d = model.hp.n_embd;
        let mut host = vec![0f32; tokens.len() * d];
        for (r, &t) in tokens.iter().enumerate() {
            if t as usize >= w.n_vocab {
                return Err(EngineError::BadToken {
                    token: t,
                    vocab: w.n_vocab,
                });
            }
            let row = w.token_embd.row(model.bytes(), 0, t as usize);
            dequant::dequantize(w.token_embd.ty, row, &mut host[r * d..(r + 1) * d])?;
        }
        let mut dst = out.slice_mut(0..host.len());
        self.dev
            .current()
            .memcpy_htod(&host, &mut dst)
            .map_err(|x| e(drv("embed: copy rows", x)))
    }

    fn add_rms_norm(
        &self,
        model: &Model,
        which: Norm,
        acc: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> R<()> {
        let w = which.weight(model);
        if acc.len() != x.len() || out.len() < acc.len() || !acc.len().is_multiple_of(w.len()) {
            return Err(e(CudaError::Driver {
                op: "add_rms_norm".into(),
                msg: format!(
                    "{} + {} values into {} for rows of {}",
                    acc.len(),
                    x.len(),
                    out.len(),
                    w.len()
                ),
            }));
        }
        let wd = self.vec(w).map_err(e)?;
        let (rows, width, eps) = (acc.len() / w.len(), w.len() as i32, model.hp.eps);
        let layer_norm = !matches!(which, Norm::Output);
        if self.norm_quant && layer_norm && w.len().is_multiple_of(256) && out.len() == acc.len() {
            let mut q = self
                .dev
                .scratch::<u8>(rows * w.len() / 256 * 304)
                .map_err(e)?;
            launch!(
                self.dev,
                "add_rms_norm_q8k",
                cfg((rows as u32, 1, 1), 256, 0),
                acc,
                x,
                wd,
                out,
                &mut q,
                &width,
                &eps
            )
            .map_err(e)?;
            self.keep_norm_q8k(out, q);
            return Ok(());
        }
        launch!(
            self.dev,
            "add_rms_norm",
            cfg((rows as u32, 1, 1), 256, 0),
            acc,
            x,
            wd,
            out,
            &width,
            &eps
        )
        .map_err(e)
    }

    fn rms_norm(
        &self,
        model: &Model,
        which: Norm,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> R<()> {
        let w = which.weight(model);
        let rows = x.len() / w.len();
        // Only the layer norms: their next op (attention, delta net, MoE)
        // takes the Q8_K rows at once, so they never outlive a captured step.
        let layer_norm = !matches!(which, Norm::Output);
        if self.norm_quant && layer_norm && w.len().is_multiple_of(256) && out.len() == x.len() {
            let wd = self.vec(w).map_err(e)?;
            let (width, eps) = (w.len() as i32, model.hp.eps);
            let mut q = self
                .dev
                .scratch::<u8>(rows * w.len() / 256 * 304)
                .map_err(e)?;
            launch!(
                self.dev,
                "rms_norm_q8k",
                cfg((rows as u32, 1, 1), 256, 0),
                x,
                wd,
                out,
                &mut q,
                &width,
                &eps
            )
            .map_err(e)?;
            self.keep_norm_q8k(out, q);
            return Ok(());
        }
        self.rms_norm_rows(x, w, rows, model.hp.eps, out).map_err(e)
    }

    fn add(&self, acc: &mut CudaSlice<f32>, x: &CudaSlice<f32>) -> R<()> {
        let len = acc.len();
        let n = len as i64;
        launch!(self.dev, "add_inplace", cfg1(len), acc, x, &n).map_err(e)
    }

    fn attention(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &CudaSlice<f32>,
        st: &mut CudaState,
        y: &mut CudaSlice<f32>,
    ) -> R<()> {
        self.attention_rows(model, l, a, x, st, y).map_err(e)
    }

    fn delta_net(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &CudaSlice<f32>,
        st: &mut CudaState,
        y: &mut CudaSlice<f32>,
    ) -> R<()> {
        self.delta_rows(model, l, dn, x, st, y).map_err(e)
    }

    fn moe(&self, model: &Model, mw: &MoeW, x: &CudaSlice<f32>, y: &mut CudaSlice<f32>) -> R<()> {
        self.moe_rows(model, mw, x, y).map_err(e)
    }

    fn moe_add_rms_norm(
        &self,
        model: &Model,
        mw: &MoeW,
        which: Norm,
        h: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> R<()> {
        self.moe_then_norm(model, mw, which, h, x, y, None)
    }

    fn add_rms_norm_moe_add_rms_norm(
        &self,
        model: &Model,
        mw: &MoeW,
        which: Norm,
        next: Norm,
        h: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> R<()> {
        let hp = &model.hp;
        let w = which.weight(model);
        // `NORM_ROUTER`: one decode row whose routing folds into the router
        // launch, a layer norm of Q8_K width the launch's blocks can hold.
        let d = hp.n_embd;
        let fits = self.norm_router
            && self.norm_quant
            && self.tier.is_none()
            && !matches!(which, Norm::Output)
            && x.len() == d
            && h.len() == d
            && y.len() == d
            && w.len() == d
            && d.is_multiple_of(256)
            && d <= 2048
            && self.route_folds(mw, 1, hp.n_expert_used, hp.n_expert);
        if fits {
            let pre = PreNorm {
                acc: crate::device::addr(&self.dev, h),
                inc: crate::device::addr(&self.dev, y),
                w: self.vec(w).map_err(e)?,
                eps: hp.eps,
            };
            return self.moe_then_norm(model, mw, next, h, x, y, Some(&pre));
        }
        // Otherwise the trait's default: the norm's own launch, then the MoE.
        self.add_rms_norm(model, which, h, y, x)?;
        self.moe_add_rms_norm(model, mw, next, h, x, y)
    }

    fn offload_counters(&self) -> Option<samesum_engine::backend::OffloadCounters> {
        self.tier.as_ref().map(|t| {
            let s = t.stats();
            samesum_engine::backend::OffloadCounters {
                hits: s.hits,
                misses: s.misses,
                fetched_bytes: s.fetched_bytes,
                staged_bytes: s.staged_bytes,
            }
        })
    }

    fn step_one(
        &self,
        model: &Model,
        st: &mut CudaState,
        token: u32,
        want: samesum_engine::Logits,
    ) -> Option<R<Vec<f32>>> {
        if !self.graphs || self.tier.is_some() || self.dev.profiling() {
            return None;
        }
        // A one-row step (captured graphs keep the launch mode they were
        // captured with).
        self.dev.rows_in_call(1);
        Some(self.graph_step(model, st, token, want))
    }

    fn take_report(&self) -> R<Option<String>> {
        let Some(rows) = self.dev.take_profile().map_err(e)? else {
            return Ok(None);
        };
        let total: f64 = rows.iter().map(|r| r.2).sum();
        let mut s = String::from("| kernel | launches | ms | share |\n|---|---:|---:|---:|\n");
        for (k, n, ms) in &rows {
            s += &format!(
                "| {k} | {n} | {ms:.2} | {:.1}% |\n",
                100.0 * ms / total.max(1e-12)
            );
        }
        s += &format!(
            "| total | {} | {total:.2} | 100% |\n",
            rows.iter().map(|r| r.1).sum::<usize>()
        );
        Ok(Some(s))
    }

    fn logits(&self, model: &Model, h: &CudaSlice<f32>, rows: &[usize]) -> R<Vec<f32>> {
        let d = model.hp.n_embd;
        let w = &model.w;
        let n = rows.len();
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let run = || -> Result<Vec<f32>> {
            let idx = self.dev.upload(&idx)?;
            let mut g = self.dev.scratch::<f32>(n * d)?;
            let (di, ni) = (d as i32, n as i32);
            launch!(
                self.dev,
                "gather_rows",
                cfg1(n * d),
                h,
                &idx,
                &mut g,
                &di,
                &ni
            )?;
            let mut xs = self.dev.scratch::<f32>(n * d)?;
            self.rms_norm_rows(&g, &w.output_norm, n, model.hp.eps, &mut xs)?;
            let mut logits = self.dev.scratch::<f32>(n * w.n_vocab)?;
            self.matmul(&w.output, &xs, n, None, &mut logits)?;
            self.dev.download(&logits, n * w.n_vocab)
        };
        run().map_err(e)
    }
}
