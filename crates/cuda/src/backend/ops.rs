//! `impl Backend for Cuda`: the engine's ops mapped to the op families.

use super::*;

impl Backend for Cuda {
    type Buf = CudaBuf;
    type Graph = cudarc::driver::CudaGraph;
    type State = CudaState;

    fn name(&self) -> String {
        // The tensor-core attention (a different function from the exact
        // passes) and the negative control show in the name, so that
        // benchmark tables and logs say which arm ran.
        let mut name = self.dev.name.clone();
        if self.fast_attention() {
            name = with_note(&name, "fast attention");
        }
        if self.reversed_topk {
            name = with_note(&name, "reversed top-k");
        }
        name
    }

    fn alloc(&self, n: usize) -> R<CudaBuf> {
        Ok(CudaBuf::new(self.dev.zeros::<f32>(n).map_err(e)?))
    }

    fn upload(&self, host: &[f32]) -> R<CudaBuf> {
        Ok(CudaBuf::new(self.dev.upload(host).map_err(e)?))
    }

    fn download(&self, buf: &CudaBuf) -> R<Vec<f32>> {
        self.dev.download(&buf.rows, buf.len()).map_err(e)
    }

    fn new_state(&self, model: &Model, ctx: usize, kv: KvType) -> R<CudaState> {
        let hp = &model.hp;
        let kvw = hp.n_head_kv * hp.head_dim;
        if kv == KvType::BF16 {
            return Err(EngineError::Device {
                backend: "cuda",
                op: "new state".into(),
                msg: "no bf16 KV cache on CUDA (--kv-type f16 or f32)".into(),
            });
        }
        let f16 = kv == KvType::F16;
        let el = if f16 { 2 } else { 4 };
        let mut kvs = Vec::new();
        let mut lin = Vec::new();
        for kind in &hp.layers {
            if *kind == samesum_engine::model::LayerKind::Attention {
                // Paged: blocks come as the sequence reaches them.
                kvs.push(Some(
                    kv::KvPages::new(
                        &self.dev,
                        ctx.div_ceil(samesum_engine::state::KV_BLOCK),
                        kvw * el,
                    )
                    .map_err(e)?,
                ));
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
        let val = |b: &[u8], i: usize| -> f32 {
            if st.f16 {
                half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
            } else {
                f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
            }
        };
        for p in st.kv.iter().flatten() {
            let (kh, vh) = p.download(&self.dev, st.pos).map_err(e)?;
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

    fn reserve(&self, st: &mut CudaState, m: usize) -> R<()> {
        st.reserve_kv(&self.dev, m).map_err(e)
    }

    fn advance(&self, st: &mut CudaState, m: usize) {
        st.pos += m;
    }

    fn fork_state(&self, st: &CudaState, ctx: usize) -> R<CudaState> {
        self.fork_cuda_state(st, ctx)
    }

    fn lanes(&self) -> usize {
        if self.tier.is_none() && !self.dev.profiling() {
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

    fn rows(&self, x: &CudaBuf, width: usize, r0: usize, n: usize) -> R<CudaBuf> {
        let mut out = self.dev.scratch::<f32>(n * width).map_err(e)?;
        let src = x.rows.slice(r0 * width..(r0 + n) * width);
        self.dev
            .current()
            .memcpy_dtod(&src, &mut out)
            .map_err(|x| e(drv("copy rows", x)))?;
        Ok(CudaBuf::new(out))
    }

    fn set_rows(&self, dst: &mut CudaBuf, width: usize, r0: usize, src: &CudaBuf) -> R<()> {
        let mut d = dst.write().slice_mut(r0 * width..r0 * width + src.len());
        self.dev
            .current()
            .memcpy_dtod(&src.rows, &mut d)
            .map_err(|x| e(drv("copy rows", x)))
    }

    fn embed(&self, model: &Model, tokens: &[u32], out: &mut CudaBuf) -> R<()> {
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
        let mut dst = out.write().slice_mut(0..host.len());
        self.dev
            .current()
            .memcpy_htod(&host, &mut dst)
            .map_err(|x| e(drv("embed: copy rows", x)))
    }

    fn add_rms_norm(
        &self,
        model: &Model,
        which: Norm,
        acc: &mut CudaBuf,
        x: &CudaBuf,
        out: &mut CudaBuf,
    ) -> R<()> {
        let w = which.weight(model);
        let (acc, x) = (acc.write(), &x.rows);
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
        // A layer norm of Q8_K width also writes its rows as Q8_K blocks,
        // which the matmuls that read `out` next take.
        if layer_norm && w.len().is_multiple_of(256) && out.len() == acc.len() {
            let (out, q) = out
                .write_with_q8k(&self.dev, rows * w.len() / 256 * 304)
                .map_err(e)?;
            return launch!(
                self.dev,
                "add_rms_norm_q8k",
                cfg((rows as u32, 1, 1), 256, 0),
                acc,
                x,
                wd,
                out,
                q,
                &width,
                &eps
            )
            .map_err(e);
        }
        launch!(
            self.dev,
            "add_rms_norm",
            cfg((rows as u32, 1, 1), 256, 0),
            acc,
            x,
            wd,
            out.write(),
            &width,
            &eps
        )
        .map_err(e)
    }

    fn rms_norm(&self, model: &Model, which: Norm, x: &CudaBuf, out: &mut CudaBuf) -> R<()> {
        let w = which.weight(model);
        let x = &x.rows;
        let rows = x.len() / w.len();
        // A layer norm of Q8_K width also writes its rows as Q8_K blocks,
        // which the matmuls that read `out` next take.
        let layer_norm = !matches!(which, Norm::Output);
        if layer_norm && w.len().is_multiple_of(256) && out.len() == x.len() {
            let wd = self.vec(w).map_err(e)?;
            let (width, eps) = (w.len() as i32, model.hp.eps);
            let (out, q) = out
                .write_with_q8k(&self.dev, rows * w.len() / 256 * 304)
                .map_err(e)?;
            return launch!(
                self.dev,
                "rms_norm_q8k",
                cfg((rows as u32, 1, 1), 256, 0),
                x,
                wd,
                out,
                q,
                &width,
                &eps
            )
            .map_err(e);
        }
        self.rms_norm_rows(x, w, rows, model.hp.eps, out.write())
            .map_err(e)
    }

    fn add(&self, acc: &mut CudaBuf, x: &CudaBuf) -> R<()> {
        let len = acc.len();
        let n = len as i64;
        launch!(self.dev, "add_inplace", cfg1(len), acc.write(), &x.rows, &n).map_err(e)
    }

    fn attention(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &CudaBuf,
        st: &mut CudaState,
        y: &mut CudaBuf,
    ) -> R<()> {
        self.attention_rows(model, l, a, &x.rows, x.q8k(), st, y.write())
            .map_err(e)
    }

    fn delta_net(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &CudaBuf,
        st: &mut CudaState,
        y: &mut CudaBuf,
    ) -> R<()> {
        self.delta_rows(model, l, dn, &x.rows, x.q8k(), st, y.write())
            .map_err(e)
    }

    fn attention_seqs(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &CudaBuf,
        sts: &mut [&mut CudaState],
        rows: &[usize],
        y: &mut CudaBuf,
    ) -> R<()> {
        self.attention_seq_rows(model, l, a, &x.rows, x.q8k(), sts, rows, y.write())
            .map_err(e)
    }

    fn delta_net_seqs(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &CudaBuf,
        sts: &mut [&mut CudaState],
        rows: &[usize],
        y: &mut CudaBuf,
    ) -> R<()> {
        self.delta_seq_rows(model, l, dn, &x.rows, x.q8k(), sts, rows, y.write())
            .map_err(e)
    }

    fn moe(&self, model: &Model, mw: &MoeW, x: &CudaBuf, y: &mut CudaBuf) -> R<()> {
        self.moe_rows(model, mw, &x.rows, x.q8k(), y.write())
            .map_err(e)
    }

    fn moe_add_rms_norm(
        &self,
        model: &Model,
        mw: &MoeW,
        which: Norm,
        h: &mut CudaBuf,
        x: &mut CudaBuf,
        y: &mut CudaBuf,
    ) -> R<()> {
        self.moe_then_norm(model, mw, which, h, x, y)
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

    fn records_steps(&self) -> bool {
        self.graphs && self.tier.is_none() && !self.dev.profiling()
    }

    fn take_step(&self, st: &mut CudaState) -> Option<DecodeStep<Cuda>> {
        st.step.take()
    }

    fn put_step(&self, st: &mut CudaState, step: DecodeStep<Cuda>) {
        st.step = Some(step);
    }

    fn begin_recording(&self, st: &mut CudaState) -> R<()> {
        self.begin_record(st).map_err(e)
    }

    fn end_recording(&self, st: &mut CudaState) -> R<cudarc::driver::CudaGraph> {
        self.end_record(st).map_err(e)
    }

    fn replay(&self, st: &mut CudaState, g: &cudarc::driver::CudaGraph) -> R<()> {
        self.replay_step(st, g).map_err(e)
    }

    fn seqs_step(&self, model: &Model, sts: &[&CudaState]) -> Option<SeqsStep> {
        if self.records_steps() {
            self.plan_seqs_step(model, sts)
        } else {
            None
        }
    }

    fn take_seqs_step(&self, key: u64) -> Option<DecodeStep<Cuda>> {
        self.take_seqs_entry(key)
    }

    fn put_seqs_step(&self, key: u64, step: DecodeStep<Cuda>) {
        self.put_seqs_entry(key, step)
    }

    fn bind_seqs(&self, model: &Model, step: SeqsStep, sts: &[&CudaState]) -> R<()> {
        self.bind_seqs_step(model, step, sts).map_err(e)
    }

    fn unbind_seqs(&self) {
        self.unbind_seqs_step()
    }

    fn begin_recording_seqs(&self) -> R<()> {
        self.begin_record_seqs().map_err(e)
    }

    fn end_recording_seqs(&self) -> R<cudarc::driver::CudaGraph> {
        self.end_record_seqs().map_err(e)
    }

    fn replay_seqs(&self, g: &cudarc::driver::CudaGraph) -> R<()> {
        self.replay_seqs_step(g).map_err(e)
    }

    fn synchronize(&self) -> R<()> {
        self.dev.sync().map_err(e)
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

    fn logits(&self, model: &Model, h: &CudaBuf, rows: &[usize]) -> R<Vec<f32>> {
        let run = || -> Result<Vec<f32>> {
            let logits = self.device_logits(model, &h.rows, rows)?;
            self.dev.download(&logits, rows.len() * model.w.n_vocab)
        };
        run().map_err(e)
    }

    /// The rows' argmax picked on the device (`argmax_rows`, the host's
    /// `sample::argmax` to the index): four bytes a row come back instead
    /// of the row's logits.
    fn logits_argmax(&self, model: &Model, h: &CudaBuf, rows: &[usize]) -> R<Vec<u32>> {
        let run = || -> Result<Vec<u32>> {
            let n = rows.len();
            if n == 0 {
                return Ok(Vec::new());
            }
            let logits = self.device_logits(model, &h.rows, rows)?;
            let mut ids = self.dev.scratch::<u32>(n)?;
            let vi = model.w.n_vocab as i32;
            launch!(
                self.dev,
                "argmax_rows",
                cfg((n as u32, 1, 1), 1024, 0),
                &logits,
                &mut ids,
                &vi
            )?;
            self.dev.download(&ids, n)
        };
        run().map_err(e)
    }
}

impl Cuda {
    /// `argmax_rows` over the rows of `n` values in `x`, for the tests.
    #[doc(hidden)]
    pub fn argmax_host(&self, x: &[f32], n: usize) -> Result<Vec<u32>> {
        if n == 0 || x.is_empty() || !x.len().is_multiple_of(n) {
            return Err(crate::device::drv(
                "argmax",
                format!("{} values are not whole rows of {n}", x.len()),
            ));
        }
        let rows = x.len() / n;
        let xs = self.dev.upload(x)?;
        let mut ids = self.dev.scratch::<u32>(rows.max(1))?;
        let ni = n as i32;
        launch!(
            self.dev,
            "argmax_rows",
            cfg((rows as u32, 1, 1), 1024, 0),
            &xs,
            &mut ids,
            &ni
        )?;
        self.dev.download(&ids, rows)
    }

    /// The final norm and the LM head over `rows` of `h`, on the device
    /// (`rows.len() * n_vocab` values).
    fn device_logits(
        &self,
        model: &Model,
        h: &CudaSlice<f32>,
        rows: &[usize],
    ) -> Result<CudaSlice<f32>> {
        let d = model.hp.n_embd;
        let w = &model.w;
        let n = rows.len();
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
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
        Ok(logits)
    }
}
