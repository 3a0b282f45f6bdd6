//! Attention over the KV cache: score and value passes, kernel choice.

use super::*;

impl Cuda {
    /// Run attention's score pass for head dims 65-128 through
    /// `attention_tiles_q4` (`true`, the default unless
    /// `SAMESUM_CUDA_ATT_Q4=0`) or `attention_tiles`, for comparisons.
    #[doc(hidden)]
    pub fn set_attention_q4(&mut self, on: bool) {
        self.att_q4 = on;
    }

    /// The attention kernel the switches pick for a head dim, a query-head
    /// group size and a call of `rows` rows: its name, the (row, head) pairs
    /// a block takes, and its dynamic shared memory in bytes. The
    /// tensor-core kernel keeps 32 pairs' q and score rows in dynamic shared
    /// memory; the CUDA-core ones take 16 pairs in static arrays, or 32 in
    /// dynamic shared memory (`attention_tiles_q4w2`) for calls of more than
    /// 16 pairs: with fewer (decode) its second half would be empty and its
    /// 66 KB of shared memory cost decode attention 13 -> 23 us a launch
    /// (H200, session 17).
    #[doc(hidden)]
    pub fn attention_kernel(
        &self,
        hd: usize,
        gs: usize,
        rows: usize,
    ) -> (&'static str, usize, usize) {
        // As in ops.cu: ATC_P pairs a block, q rows hd + 8 floats apart, score
        // rows ATC_SS = 256 + 8 floats apart; AP pairs for the CUDA-core ones.
        const ATC_P: usize = 32;
        const ATC_SS: usize = 256 + 8;
        const AP: usize = 16;
        // attention_tiles_q4w2: 2 AP pairs, q and score rows (ATT_HD = 256
        // and ATT_S = 260 floats) in dynamic shared memory (ATT_P32_SMEM).
        const P32_SMEM: usize = 2 * AP * (256 + 260) * 4;
        if self.att_tc && hd.is_multiple_of(32) && hd <= 256 && gs > 0 && ATC_P.is_multiple_of(gs) {
            let name = if self.att_tc_acc {
                "attention_tiles_tc_acc"
            } else {
                "attention_tiles_tc"
            };
            (name, ATC_P, ATC_P * (hd + 8 + ATC_SS) * 4)
        } else if self.att_q4
            && self.att_vfull
            && self.att_q4p
            && self.att_q4w
            && self.att_p32
            && (hd == 128 || hd == 256)
            && gs > 0
            && AP.is_multiple_of(gs)
            && rows * gs > AP
        {
            let name = if self.att_kb4 && hd > 128 {
                "attention_tiles_q4w2k4"
            } else {
                "attention_tiles_q4w2"
            };
            (name, 2 * AP, P32_SMEM)
        } else if self.att_q4 {
            let name = if self.att_vfull && self.att_q4p && self.att_q4w {
                "attention_tiles_q4w"
            } else if self.att_vfull && self.att_q4p {
                "attention_tiles_q4p"
            } else if self.att_vfull {
                "attention_tiles_q4"
            } else {
                "attention_tiles_q4_checked"
            };
            (name, AP, 0)
        } else {
            ("attention_tiles", AP, 0)
        }
    }

    /// The attention kernel the last attention call launched ("" before any).
    #[doc(hidden)]
    pub fn last_attention_kernel(&self) -> &'static str {
        *self.att_last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cap the attention partials of one call at `bytes` (rows then run in
    /// groups; 1 runs one row at a time), for the tests.
    #[doc(hidden)]
    pub fn set_attention_partials(&mut self, bytes: usize) {
        self.attn_partials = bytes.max(1);
    }

    pub(super) fn attention_rows(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<u8>>,
        st: &mut CudaState,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let hp = &model.hp;
        let d = &self.dev;
        let (hq, hkv, hd) = (hp.n_head, hp.n_head_kv, hp.head_dim);
        let m = x.len() / hp.n_embd;
        let (qw, kvw) = (hq * hd, hkv * hd);
        let mut qg = d.scratch::<f32>(m * a.q.rows)?;
        let mut k = d.scratch::<f32>(m * kvw)?;
        let mut v = d.scratch::<f32>(m * kvw)?;
        let xin = Input::with_given_q8k(x, m, xq);
        self.mm_group(&xin, &mut [(&a.q, &mut qg), (&a.k, &mut k), (&a.v, &mut v)])?;
        self.sync_pos(st)?;
        let (ck, cv) = st.kv[l].as_mut().ok_or_else(|| CudaError::Driver {
            op: "attention".into(),
            msg: format!("layer {l} has no KV cache"),
        })?;
        let (mi, hqi, hkvi, hdi, nrot) =
            (m as i32, hq as i32, hkv as i32, hd as i32, hp.n_rot as i32);
        let (kvwi, f16) = (kvw as i32, st.f16 as i32);
        let pos0 = &st.pos_dev;
        let theta = hp.rope_theta;
        // The gate's columns of a gated projection (head h's q at 2 h hd,
        // its gate at 2 h hd + hd).
        let gate = if a.gated {
            let mut g = d.scratch::<f32>(m * qw)?;
            let mg = self.map((1, hq, hd, 0), || {
                (0..qw)
                    .map(|c| ((c / hd) * 2 * hd + hd + c % hd) as i32)
                    .collect()
            })?;
            self.copy_cols(&qg, 2 * qw, &mut g, qw, mg, m)?;
            Some(g)
        } else {
            None
        };
        let mut q = d.scratch::<f32>(m * qw)?;
        if self.qk_fuse && self.small_norm && hd <= 256 {
            let (q_row, q_head) = if a.gated {
                (2 * qw as i32, 2 * hdi)
            } else {
                (qw as i32, hdi)
            };
            let (qn, kn) = (self.vec(&a.q_norm)?, self.vec(&a.k_norm)?);
            let eps = hp.eps;
            launch!(
                d,
                "qk_norm_rope_kv",
                cfg(((m * (hq + hkv)).div_ceil(8) as u32, 1, 1), 256, 0),
                &qg,
                &q_row,
                &q_head,
                &k,
                &v,
                qn,
                kn,
                &mut q,
                &mut *ck,
                &mut *cv,
                pos0,
                &mi,
                &hqi,
                &hkvi,
                &hdi,
                &nrot,
                &theta,
                &eps,
                &f16
            )?;
        } else {
            let q_raw = if a.gated {
                let mut q = d.scratch::<f32>(m * qw)?;
                let mq = self.map((0, hq, hd, 0), || {
                    (0..qw)
                        .map(|c| ((c / hd) * 2 * hd + c % hd) as i32)
                        .collect()
                })?;
                self.copy_cols(&qg, 2 * qw, &mut q, qw, mq, m)?;
                q
            } else {
                qg
            };
            self.rms_norm_rows(&q_raw, &a.q_norm, m * hq, hp.eps, &mut q)?;
            let mut kn = d.scratch::<f32>(m * kvw)?;
            self.rms_norm_rows(&k, &a.k_norm, m * hkv, hp.eps, &mut kn)?;
            launch!(
                d,
                "rope",
                cfg1(m * hq * hp.n_rot / 2),
                &mut q,
                &mi,
                &hqi,
                &hdi,
                &nrot,
                &theta,
                pos0
            )?;
            launch!(
                d,
                "rope",
                cfg1(m * hkv * hp.n_rot / 2),
                &mut kn,
                &mi,
                &hkvi,
                &hdi,
                &nrot,
                &theta,
                pos0
            )?;
            launch!(
                d,
                "kv_write",
                cfg1(m * kvw),
                &kn,
                &v,
                &mut *ck,
                &mut *cv,
                pos0,
                &mi,
                &kvwi,
                &f16
            )?;
        }
        let mut o = d.scratch::<f32>(m * qw)?;
        let scale = 1.0f32 / (hd as f32).sqrt();
        let gs = hq / hkv;
        // One kernel for every m: fixed key tiles of 256 positions, a block
        // per (KV head, row tile, key tile), then the tiles folded in order
        // (ops.cu, attention_tiles).
        // A recorded step covers the whole context (blocks past a row's
        // position return at once), so its replays serve every position.
        let nb = if st.whole_ctx {
            st.ctx.div_ceil(256)
        } else {
            (st.pos + m).div_ceil(256)
        };
        // The partials (a max, a sum and a head-dim row per pair and tile)
        // grow with rows x context, so long contexts run the rows in groups
        // that keep them under `attn_partials` bytes. Each pair's sums are
        // the same whatever group it is in.
        let per_row = hq * nb * (hd + 2) * 4;
        let group = (self.attn_partials / per_row).clamp(1, m);
        let group = m.div_ceil(m.div_ceil(group)); // groups of even size
        // Ungated attention into a K-quant out projection: the combine also
        // writes the rows' Q8_K blocks (no quantize launch).
        let mut oq = if self.combine_q8k
            && !self.att_ulp
            && gate.is_none()
            && k_quant(a.o.ty)
            && qw.is_multiple_of(256)
        {
            Some(d.scratch::<u8>(m * qw / 256 * 304)?)
        } else {
            None
        };
        let mut pml = d.scratch::<f32>(group * hq * nb * 2)?;
        let mut pacc = d.scratch::<f32>(group * hq * nb * hd)?;
        let nbi = nb as i32;
        for r0 in (0..m).step_by(group) {
            let mr = group.min(m - r0);
            let (mri, r0i) = (mr as i32, r0 as i32);
            let qg = q.slice(r0 * qw..(r0 + mr) * qw);
            let (mut kernel, pairs, smem) = self.attention_kernel(hd, gs, mr);
            // One row on the CUDA-core kernels: the same tile in compact code.
            if self.att_one && mr == 1 && !kernel.starts_with("attention_tiles_tc") && hd <= 256 {
                kernel = "attention_one";
            }
            *self.att_last.lock().unwrap_or_else(|p| p.into_inner()) = kernel;
            launch!(
                d,
                kernel,
                cfg(
                    (hkv as u32, mr.div_ceil(pairs / gs) as u32, nb as u32),
                    256,
                    smem as u32
                ),
                &qg,
                &*ck,
                &*cv,
                &mut pml,
                &mut pacc,
                &mri,
                &hqi,
                &hkvi,
                &hdi,
                pos0,
                &r0i,
                &scale,
                &f16,
                &nbi
            )?;
            let mut og = o.slice_mut(r0 * qw..(r0 + mr) * qw);
            if let Some(oq) = oq.as_mut() {
                let row_q = qw / 256 * 304;
                let mut qg = oq.slice_mut(r0 * row_q..(r0 + mr) * row_q);
                launch!(
                    d,
                    "attention_combine_q8k",
                    cfg(((qw / 256) as u32, mr as u32, 1), 256, 0),
                    &pml,
                    &pacc,
                    &mut og,
                    &mut qg,
                    &mri,
                    &hqi,
                    &hdi,
                    pos0,
                    &r0i,
                    &nbi
                )?;
                continue;
            }
            launch!(
                d,
                if self.att_ulp {
                    "attention_combine_ulp"
                } else {
                    "attention_combine"
                },
                cfg(((mr * hq) as u32, 1, 1), hd.div_ceil(32) as u32 * 32, 0),
                &pml,
                &pacc,
                &mut og,
                &mri,
                &hqi,
                &hdi,
                pos0,
                &r0i,
                &nbi
            )?;
        }
        if let Some(g) = gate {
            // With the out projection reading Q8_K rows, the gate writes
            // them too (a warp per 256-block).
            if self.gn_q8k && k_quant(a.o.ty) && qw.is_multiple_of(256) {
                let mut q = d.scratch::<u8>(m * qw / 256 * 304)?;
                let qwi = qw as i32;
                launch!(
                    d,
                    "sigmoid_mul_q8k",
                    cfg(((qw / 256).div_ceil(4) as u32, m as u32, 1), 128, 0),
                    &mut o,
                    &g,
                    &mut q,
                    &qwi
                )?;
                return self.mm(&a.o, &Input::with_q8k(&o, m, Some(q)), None, y);
            }
            let n = (m * qw) as i64;
            launch!(d, "sigmoid_mul", cfg1(m * qw), &mut o, &g, &n)?;
        }
        if let Some(oq) = oq {
            return self.mm(&a.o, &Input::with_q8k(&o, m, Some(oq)), None, y);
        }
        self.matmul(&a.o, &o, m, None, y)
    }
}

/// The score pass's 16-pair butterfly (ops.cu, `pair_butterfly`) simulated
/// on the host in f32: lanes holding pair `r ^ ((lane >> 1) & 15)` in
/// register `r` and exchanging with no select end with the same bits as
/// lanes holding pair `r` in register `r` and selecting what to send and
/// keep (`pair_butterfly_sel`, the session-9 form). The device test compares
/// the two kernels themselves; this one shows the layout is right on any
/// machine, and that a wrong layout is caught.
#[cfg(test)]
mod butterfly_tests {
    use samesum_quant::rng::Rng;

    const STEPS: [(usize, usize); 4] = [(16, 8), (8, 4), (4, 2), (2, 1)];

    /// Lane l's final value (pair l / 2) with the select form.
    fn with_selects(part: &[[f32; 16]; 32]) -> [f32; 32] {
        let mut d = *part;
        for (o2, w) in STEPS {
            let sent: Vec<Vec<f32>> = (0..32)
                .map(|l| {
                    let up = l & o2 != 0;
                    (0..w)
                        .map(|i| if up { d[l][i] } else { d[l][w + i] })
                        .collect()
                })
                .collect();
            for l in 0..32 {
                let up = l & o2 != 0;
                for i in 0..w {
                    let own = if up { d[l][w + i] } else { d[l][i] };
                    d[l][i] = own + sent[l ^ o2][i];
                }
            }
        }
        std::array::from_fn(|l| d[l][0] + d[l ^ 1][0])
    }

    /// The same with lane l holding pair `r ^ mask(l)` in register r.
    fn permuted(part: &[[f32; 16]; 32], mask: fn(usize) -> usize) -> [f32; 32] {
        let mut d: [[f32; 16]; 32] =
            std::array::from_fn(|l| std::array::from_fn(|r| part[l][r ^ mask(l)]));
        for (o2, w) in STEPS {
            let sent: Vec<Vec<f32>> = (0..32).map(|l| d[l][w..2 * w].to_vec()).collect();
            for l in 0..32 {
                for i in 0..w {
                    d[l][i] += sent[l ^ o2][i];
                }
            }
        }
        std::array::from_fn(|l| d[l][0] + d[l ^ 1][0])
    }

    fn random_parts(rng: &mut Rng) -> [[f32; 16]; 32] {
        let scale = [1e-3f32, 1.0, 1e3][rng.below(3) as usize];
        std::array::from_fn(|_| std::array::from_fn(|_| rng.range(-1.0, 1.0) * scale))
    }

    #[test]
    fn the_select_free_butterfly_gives_the_same_bits() {
        let mut rng = Rng::new(3);
        for _ in 0..300 {
            let part = random_parts(&mut rng);
            let (a, b) = (with_selects(&part), permuted(&part, |l| (l >> 1) & 15));
            for l in 0..32 {
                assert_eq!(a[l].to_bits(), b[l].to_bits(), "lane {l}");
            }
        }
    }

    /// ops.cu's `qs_col`: where dim d of a pair's q sits in its row (head
    /// dims over 128).
    fn qs_col(d: usize) -> usize {
        (d >> 6) * 64 + (d & 31) * 2 + ((d >> 5) & 1)
    }

    /// The q layout the score pass reads above head dim 128: every dim of a
    /// 256-wide row has its own column, and lane l finds chunks 2k and
    /// 2k + 1 (dims l + 32 c) in the two floats at 64 k + 2 l, the float2 it
    /// loads.
    #[test]
    fn the_q_columns_are_a_permutation_read_two_at_a_time() {
        let mut seen = [false; 256];
        for d in 0..256 {
            let c = qs_col(d);
            assert!(c < 256 && !seen[c], "dim {d} -> column {c}");
            seen[c] = true;
        }
        for lane in 0..32 {
            for c in 0..8 {
                assert_eq!(qs_col(lane + 32 * c), 64 * (c / 2) + 2 * lane + c % 2);
            }
        }
    }

    #[test]
    fn a_wrong_register_layout_is_caught() {
        let mut rng = Rng::new(4);
        let caught = (0..50).any(|_| {
            let part = random_parts(&mut rng);
            let (a, b) = (with_selects(&part), permuted(&part, |l| (l >> 1) & 7));
            (0..32).any(|l| a[l].to_bits() != b[l].to_bits())
        });
        assert!(caught, "a mask missing lane bit 16 went unnoticed");
    }
}
