//! The CPU implementation of [`Backend`]: layer blocks built from the CPU row
//! kernels in [`crate::cpu`].

use crate::backend::{Backend, Norm};
use crate::cpu::{self, Cpu, MatmulJob};
use crate::error::{EngineError, Result};
use crate::model::weights::{AttentionW, DeltaBa, DeltaInput, DeltaNetW, MoeW};
use crate::model::{Arch, Model};
use crate::plan::Plan;
use crate::state::{KvType, SeqState};
use samesum_quant::dequant;

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Graph = ();
    type State = SeqState;

    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads())
    }

    fn alloc(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(host.to_vec())
    }

    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }

    fn new_state(&self, model: &Model, ctx: usize, kv: KvType) -> Result<SeqState> {
        SeqState::try_new(&model.hp, ctx, kv)
    }

    fn position(&self, st: &SeqState) -> usize {
        st.pos
    }

    fn capacity(&self, st: &SeqState) -> usize {
        st.ctx
    }

    fn download_state(&self, st: &SeqState) -> Result<Vec<f32>> {
        let mut out = vec![st.pos as f32];
        for kv in st.kv.iter().flatten() {
            let w = kv.width();
            for pos in 0..st.pos {
                for i in 0..w {
                    out.push(kv.k_at(pos, w, i));
                    out.push(kv.v_at(pos, w, i));
                }
            }
        }
        for l in st.linear.iter().flatten() {
            out.extend_from_slice(&l.conv);
            out.extend_from_slice(&l.s);
        }
        Ok(out)
    }

    fn advance(&self, st: &mut SeqState, m: usize) {
        st.pos += m;
    }

    /// The KV blocks shared copy-on-write ([`SeqState::fork`]): the fork
    /// costs the recurrent states' copy; a block is copied when either
    /// state first writes into it.
    fn fork_state(&self, st: &SeqState, ctx: usize) -> Result<SeqState> {
        st.fork(ctx)
    }

    fn lanes(&self) -> usize {
        if self.lanes_on() { 2 } else { 1 }
    }

    fn enter_lane(&self, st: &mut SeqState, _lane: usize, pos: usize) -> Result<()> {
        st.pos = pos;
        Ok(())
    }

    fn rows(&self, x: &Vec<f32>, width: usize, r0: usize, n: usize) -> Result<Vec<f32>> {
        Ok(x[r0 * width..(r0 + n) * width].to_vec())
    }

    fn set_rows(&self, dst: &mut Vec<f32>, width: usize, r0: usize, src: &Vec<f32>) -> Result<()> {
        dst[r0 * width..r0 * width + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn embed(&self, model: &Model, tokens: &[u32], out: &mut Vec<f32>) -> Result<()> {
        let w = &model.w;
        let d = model.hp.n_embd;
        for (r, &t) in tokens.iter().enumerate() {
            if t as usize >= w.n_vocab {
                return Err(EngineError::BadToken {
                    token: t,
                    vocab: w.n_vocab,
                });
            }
            let row = w.token_embd.row(model.bytes(), 0, t as usize);
            dequant::dequantize(w.token_embd.ty, row, &mut out[r * d..(r + 1) * d])?;
        }
        Ok(())
    }

    fn rms_norm(&self, model: &Model, which: Norm, x: &Vec<f32>, out: &mut Vec<f32>) -> Result<()> {
        let w = which.weight(model);
        cpu::rms_norm(x, w, model.hp.eps, out);
        Ok(())
    }

    fn add(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        for (a, v) in acc.iter_mut().zip(x) {
            *a += *v;
        }
        Ok(())
    }

    fn attention(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &Vec<f32>,
        st: &mut SeqState,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        let m = x.len() / model.hp.n_embd;
        attention(model, self, &mut [st], &[m], l, a, x, y);
        Ok(())
    }

    fn attention_seqs(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &Vec<f32>,
        sts: &mut [&mut SeqState],
        rows: &[usize],
        y: &mut Vec<f32>,
    ) -> Result<()> {
        attention(model, self, sts, rows, l, a, x, y);
        Ok(())
    }

    fn delta_net_seqs(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &Vec<f32>,
        sts: &mut [&mut SeqState],
        rows: &[usize],
        y: &mut Vec<f32>,
    ) -> Result<()> {
        delta_net(model, self, sts, rows, l, dn, x, y);
        Ok(())
    }

    fn delta_net(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &Vec<f32>,
        st: &mut SeqState,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        let m = x.len() / model.hp.n_embd;
        delta_net(model, self, &mut [st], &[m], l, dn, x, y);
        Ok(())
    }

    fn moe(&self, model: &Model, mw: &MoeW, x: &Vec<f32>, y: &mut Vec<f32>) -> Result<()> {
        moe(model, self, mw, x, y);
        Ok(())
    }

    fn logits(&self, model: &Model, h: &Vec<f32>, rows: &[usize]) -> Result<Vec<f32>> {
        let d = model.hp.n_embd;
        let w = &model.w;
        let mut xs = vec![0f32; rows.len() * d];
        for (i, &r) in rows.iter().enumerate() {
            cpu::rms_norm(
                &h[r * d..(r + 1) * d],
                &w.output_norm,
                model.hp.eps,
                &mut xs[i * d..(i + 1) * d],
            );
        }
        let mut logits = vec![0f32; rows.len() * w.n_vocab];
        self.matmul(model.bytes(), &w.output, 0, &xs, &mut logits);
        Ok(logits)
    }
}

/// Attention rows of several sequences (`rows[i]` rows of `sts[i]`, one
/// after the other in `x`): the projections, head norms, gate and output
/// projection over all rows at once (row-wise), RoPE, the cache and the
/// attention per sequence.
#[allow(clippy::too_many_arguments)]
fn attention(
    model: &Model,
    cpu: &Cpu,
    sts: &mut [&mut SeqState],
    rows: &[usize],
    l: usize,
    a: &AttentionW,
    x: &[f32],
    y: &mut [f32],
) {
    let hp = &model.hp;
    let file = model.bytes();
    let (hq, hkv, hd) = (hp.n_head, hp.n_head_kv, hp.head_dim);
    let m = x.len() / hp.n_embd;
    let (qw, kvw) = (hq * hd, hkv * hd);
    let mut qg = vec![0f32; m * a.q.rows];
    let mut k = vec![0f32; m * kvw];
    let mut v = vec![0f32; m * kvw];
    cpu.matmuls(
        file,
        &mut [
            MatmulJob {
                w: &a.q,
                mat: 0,
                x,
                y: &mut qg,
            },
            MatmulJob {
                w: &a.k,
                mat: 0,
                x,
                y: &mut k,
            },
            MatmulJob {
                w: &a.v,
                mat: 0,
                x,
                y: &mut v,
            },
        ],
    );
    // Split [q | gate] per head (hybrid archs).
    let (mut q, gate) = if a.gated {
        let mut q = vec![0f32; m * qw];
        let mut g = vec![0f32; m * qw];
        for r in 0..m {
            for h in 0..hq {
                let src = &qg[r * 2 * qw + h * 2 * hd..];
                q[r * qw + h * hd..r * qw + (h + 1) * hd].copy_from_slice(&src[..hd]);
                g[r * qw + h * hd..r * qw + (h + 1) * hd].copy_from_slice(&src[hd..2 * hd]);
            }
        }
        (q, Some(g))
    } else {
        (qg, None)
    };
    let mut tmp = vec![0f32; q.len()];
    cpu::rms_norm(&q, &a.q_norm, hp.eps, &mut tmp);
    std::mem::swap(&mut q, &mut tmp);
    let mut tmp = vec![0f32; k.len()];
    cpu::rms_norm(&k, &a.k_norm, hp.eps, &mut tmp);
    let mut k = tmp;
    let mut o = vec![0f32; m * qw];
    let p = cpu::AttnParams {
        n_head: hq,
        n_head_kv: hkv,
        head_dim: hd,
        rope: hp.rope(),
    };
    // Each sequence's rows with its cache, all in one parallel region.
    let mut segs = Vec::with_capacity(sts.len());
    let (mut q_rest, mut k_rest, mut v_rest, mut o_rest) =
        (&mut q[..], &mut k[..], &v[..], &mut o[..]);
    for (st, &n) in sts.iter_mut().zip(rows) {
        let (qs, qt) = q_rest.split_at_mut(n * qw);
        let (ks, kt) = k_rest.split_at_mut(n * kvw);
        let (vs, vt) = v_rest.split_at(n * kvw);
        let (os, ot) = o_rest.split_at_mut(n * qw);
        (q_rest, k_rest, v_rest, o_rest) = (qt, kt, vt, ot);
        if n > 0 {
            segs.push(cpu::AttnRows {
                q: qs,
                k: ks,
                v: vs,
                pos0: st.pos,
                cache: st.kv[l].as_mut().expect("attention layer has a KV cache"),
                o: os,
            });
        }
    }
    cpu.attention_seqs(&mut segs, &p);
    drop(segs);
    if let Some(g) = gate {
        for (ov, gv) in o.iter_mut().zip(&g) {
            *ov *= cpu::sigmoid(*gv);
        }
    }
    cpu.matmul(file, &a.o, 0, &o, y);
}

/// Delta-net rows of several sequences, as [`attention`]: projections and
/// output projection over all rows, the conv and the delta rule per
/// sequence with its state.
#[allow(clippy::too_many_arguments)]
fn delta_net(
    model: &Model,
    cpu: &Cpu,
    sts: &mut [&mut SeqState],
    rows: &[usize],
    l: usize,
    dn: &DeltaNetW,
    x: &[f32],
    y: &mut [f32],
) {
    let hp = &model.hp;
    let file = model.bytes();
    let s = hp.ssm.expect("linear layers have ssm sizes");
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
    // Projections for all rows.
    let mut qkv = vec![0f32; m * cd];
    let mut z = vec![0f32; m * vd];
    match &dn.input {
        DeltaInput::Split { qkv: wq, z: wz } => {
            cpu.matmuls(
                file,
                &mut [
                    MatmulJob {
                        w: wq,
                        mat: 0,
                        x,
                        y: &mut qkv,
                    },
                    MatmulJob {
                        w: wz,
                        mat: 0,
                        x,
                        y: &mut z,
                    },
                ],
            );
        }
        DeltaInput::Fused { ssm_in } => {
            let width = 2 * dk + 2 * ratio * dv;
            let mut f = vec![0f32; m * ssm_in.rows];
            cpu.matmul(file, ssm_in, 0, x, &mut f);
            for r in 0..m {
                for g in 0..hk {
                    let src = &f[r * ssm_in.rows + g * width..];
                    let dst = &mut qkv[r * cd..(r + 1) * cd];
                    dst[g * dk..(g + 1) * dk].copy_from_slice(&src[..dk]);
                    dst[kd + g * dk..kd + (g + 1) * dk].copy_from_slice(&src[dk..2 * dk]);
                    let vs = ratio * dv;
                    dst[2 * kd + g * vs..2 * kd + (g + 1) * vs]
                        .copy_from_slice(&src[2 * dk..2 * dk + vs]);
                    z[r * vd + g * vs..r * vd + (g + 1) * vs]
                        .copy_from_slice(&src[2 * dk + vs..2 * dk + 2 * vs]);
                }
            }
        }
    }
    // beta and alpha per value head, in the file's head order.
    let mut b = vec![0f32; m * hv];
    let mut a = vec![0f32; m * hv];
    match &dn.ba {
        DeltaBa::Fused(wba) => {
            let mut ba = vec![0f32; m * 2 * hv];
            cpu.matmul(file, wba, 0, x, &mut ba);
            for r in 0..m {
                for g in 0..hk {
                    for j in 0..ratio {
                        b[r * hv + g * ratio + j] = ba[r * 2 * hv + g * 2 * ratio + j];
                        a[r * hv + g * ratio + j] = ba[r * 2 * hv + g * 2 * ratio + ratio + j];
                    }
                }
            }
        }
        DeltaBa::Split { beta, alpha } => {
            cpu.matmuls(
                file,
                &mut [
                    MatmulJob {
                        w: beta,
                        mat: 0,
                        x,
                        y: &mut b,
                    },
                    MatmulJob {
                        w: alpha,
                        mat: 0,
                        x,
                        y: &mut a,
                    },
                ],
            );
        }
    }
    let mut conv = vec![0f32; m * cd];
    let p = cpu::DeltaParams {
        n_k_heads: hk,
        n_v_heads: hv,
        head_k_dim: dk,
        head_v_dim: dv,
        tiled: model.hp.arch == Arch::Qwen35Moe,
        eps: hp.eps,
    };
    let mut o = vec![0f32; m * vd];
    // Each sequence's conv with its state, then the delta rule of every
    // sequence in one parallel region.
    let mut r0 = 0;
    for (st, &n) in sts.iter_mut().zip(rows) {
        let state = st.linear[l].as_mut().expect("linear layer has state");
        let (c0, c1) = (r0 * cd, (r0 + n) * cd);
        cpu::conv_rows(
            &qkv[c0..c1],
            &dn.conv,
            kc,
            &mut state.conv,
            &mut conv[c0..c1],
        );
        r0 += n;
    }
    let mut seqs = Vec::with_capacity(sts.len());
    let (mut r0, mut o_rest) = (0, &mut o[..]);
    for (st, &n) in sts.iter_mut().zip(rows) {
        let (o_seq, tail) = o_rest.split_at_mut(n * vd);
        o_rest = tail;
        if n > 0 {
            let state = st.linear[l].as_mut().expect("linear layer has state");
            seqs.push(cpu::DeltaSeq {
                conv: &conv[r0 * cd..(r0 + n) * cd],
                b: &b[r0 * hv..(r0 + n) * hv],
                a: &a[r0 * hv..(r0 + n) * hv],
                z: &z[r0 * vd..(r0 + n) * vd],
                state: &mut state.s,
                o: o_seq,
            });
        }
        r0 += n;
    }
    cpu.delta_rows_seqs(&mut seqs, &dn.dt_bias, &dn.a, &dn.norm, &p);
    drop(seqs);
    cpu.matmul(file, &dn.out, 0, &o, y);
}

/// MoE rows with the expert plan: route every row, group the (token, slot)
/// pairs by expert, gather each expert's rows and run its gate/up and down
/// projections over all of them at once (its weights read once per call), write
/// one result per pair, then combine each token's results in slot order and add
/// the gated shared expert. One row (decode) is the same path with a plan of k
/// single-row experts.
pub(crate) fn moe(model: &Model, cpu: &Cpu, mw: &MoeW, x: &[f32], y: &mut [f32]) {
    let k = model.hp.n_expert_used;
    let (ids, weights) = moe_route(model, cpu, mw, x);
    let (pair_out, shared) = moe_experts(model, cpu, mw, x, &ids, k, true);
    let m = x.len() / model.hp.n_embd;
    // The negative control changes batched calls only, so replay stays right.
    let reversed = cpu.reversed_topk() && m > 1;
    moe_combine(
        model,
        &ids,
        &weights,
        &pair_out,
        shared.as_ref(),
        reversed,
        y,
    );
}

/// The router: each row's `k` expert ids (-1 = skipped) and weights.
pub(crate) fn moe_route(model: &Model, cpu: &Cpu, mw: &MoeW, x: &[f32]) -> (Vec<i32>, Vec<f32>) {
    let hp = &model.hp;
    let (d, e, k) = (hp.n_embd, hp.n_expert, hp.n_expert_used);
    let m = x.len() / d;
    let mut logits = vec![0f32; m * e];
    cpu.matmul(model.bytes(), &mw.router, 0, x, &mut logits);
    let mut ids = vec![-1i32; m * k];
    let mut weights = vec![0f32; m * k];
    for r in 0..m {
        let (ri, rw) = cpu::route(&mut logits[r * e..(r + 1) * e], k);
        for (s, (i, w)) in ri.into_iter().zip(rw).enumerate() {
            ids[r * k + s] = i as i32;
            weights[r * k + s] = w;
        }
    }
    (ids, weights)
}

/// The shared expert's output rows and gate inputs.
pub(crate) struct SharedOut {
    ys: Vec<f32>,
    gi: Vec<f32>,
}

/// The routed experts over rows `x`, pairs `ids` (`rows * k`, -1 = skipped):
/// one output row per pair (zero for a skipped one), and with `shared` the
/// shared expert over every row, its matmuls in the same parallel calls.
pub(crate) fn moe_experts(
    model: &Model,
    cpu: &Cpu,
    mw: &MoeW,
    x: &[f32],
    ids: &[i32],
    k: usize,
    shared: bool,
) -> (Vec<f32>, Option<SharedOut>) {
    let hp = &model.hp;
    let file = model.bytes();
    let (d, e, f, fs) = (hp.n_embd, hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp);
    let m = x.len() / d;
    let sh = mw.shared.as_ref().filter(|_| shared);
    let plan = Plan::build(ids, e, 1);
    let active: Vec<usize> = (0..e).filter(|&i| plan.counts[i] > 0).collect();
    let xs: Vec<Vec<f32>> = active
        .iter()
        .map(|&i| {
            let mut g = Vec::new();
            plan.gather(i, x, d, k, &mut g);
            g
        })
        .collect();
    let mut gate: Vec<Vec<f32>> = active
        .iter()
        .map(|&i| vec![0f32; plan.counts[i] as usize * f])
        .collect();
    let mut up = gate.clone();
    let ms = if sh.is_some() { m } else { 0 };
    let mut sg = vec![0f32; ms * fs];
    let mut su = vec![0f32; ms * fs];
    let mut gi = vec![0f32; ms];
    {
        let mut jobs: Vec<MatmulJob> = Vec::with_capacity(2 * active.len() + 3);
        for (((&i, xe), g), u) in active
            .iter()
            .zip(&xs)
            .zip(gate.iter_mut())
            .zip(up.iter_mut())
        {
            jobs.push(MatmulJob {
                w: &mw.gate,
                mat: i,
                x: xe,
                y: g,
            });
            jobs.push(MatmulJob {
                w: &mw.up,
                mat: i,
                x: xe,
                y: u,
            });
        }
        if let Some(sh) = sh {
            jobs.push(MatmulJob {
                w: &sh.gate,
                mat: 0,
                x,
                y: &mut sg,
            });
            jobs.push(MatmulJob {
                w: &sh.up,
                mat: 0,
                x,
                y: &mut su,
            });
            jobs.push(MatmulJob {
                w: &sh.gate_inp,
                mat: 0,
                x,
                y: &mut gi,
            });
        }
        cpu.matmuls(file, &mut jobs);
    }
    for (g, u) in gate.iter_mut().zip(&up) {
        for (a, b) in g.iter_mut().zip(u) {
            *a = cpu::silu(*a) * *b;
        }
    }
    for (a, b) in sg.iter_mut().zip(&su) {
        *a = cpu::silu(*a) * *b;
    }
    let mut outs: Vec<Vec<f32>> = active
        .iter()
        .map(|&i| vec![0f32; plan.counts[i] as usize * d])
        .collect();
    let mut ys = vec![0f32; ms * d];
    {
        let mut jobs: Vec<MatmulJob> = Vec::with_capacity(active.len() + 1);
        for ((&i, h), o) in active.iter().zip(&gate).zip(outs.iter_mut()) {
            jobs.push(MatmulJob {
                w: &mw.down,
                mat: i,
                x: h,
                y: o,
            });
        }
        if let Some(sh) = sh {
            jobs.push(MatmulJob {
                w: &sh.down,
                mat: 0,
                x: &sg,
                y: &mut ys,
            });
        }
        cpu.matmuls(file, &mut jobs);
    }
    // One result per (token, slot).
    let mut pair_out = vec![0f32; ids.len() * d];
    for (&i, o) in active.iter().zip(&outs) {
        for (row, &p) in o.chunks_exact(d).zip(plan.expert(i)) {
            pair_out[p as usize * d..(p as usize + 1) * d].copy_from_slice(row);
        }
    }
    (pair_out, sh.map(|_| SharedOut { ys, gi }))
}

/// Each token's routed results summed in slot order with the router's
/// weights, then the sigmoid-gated shared expert added: the one order every
/// MoE call uses, whichever device or rank computed the pairs. `reversed` is
/// the negative control (slots backwards, fused multiply-adds).
pub(crate) fn moe_combine(
    model: &Model,
    ids: &[i32],
    weights: &[f32],
    pair_out: &[f32],
    shared: Option<&SharedOut>,
    reversed: bool,
    y: &mut [f32],
) {
    let (d, k) = (model.hp.n_embd, model.hp.n_expert_used);
    let m = ids.len() / k;
    for r in 0..m {
        let yr = &mut y[r * d..(r + 1) * d];
        yr.fill(0.0);
        let order: Vec<usize> = if reversed {
            (0..k).rev().collect()
        } else {
            (0..k).collect()
        };
        for s in order {
            if ids[r * k + s] < 0 {
                continue;
            }
            let wgt = weights[r * k + s];
            let o = &pair_out[(r * k + s) * d..(r * k + s + 1) * d];
            if reversed {
                for (acc, v) in yr.iter_mut().zip(o) {
                    *acc = wgt.mul_add(*v, *acc);
                }
                continue;
            }
            for (acc, v) in yr.iter_mut().zip(o) {
                *acc += wgt * *v;
            }
        }
        if let Some(sh) = shared {
            let sgate = cpu::sigmoid(sh.gi[r]);
            for (acc, v) in yr.iter_mut().zip(&sh.ys[r * d..(r + 1) * d]) {
                *acc += sgate * *v;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::forward::{Logits, forward};
    use crate::state::KV_BLOCK;
    use samesum_gguf::GgmlType;
    use samesum_synth::{SynthOptions, shapes, write_model};

    fn model(shape: &str) -> (tempfile::TempDir, Model) {
        model_in(shape, GgmlType::Q8_0)
    }

    /// A synthetic model of `shape` with its matrices in `quant` (seed 3),
    /// in a temporary directory that lives as long as the returned guard.
    pub(crate) fn model_in(shape: &str, quant: GgmlType) -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        write_model(
            &SynthOptions::new(shapes::by_name(shape).unwrap(), quant, 3),
            &p,
            &mut |_, _| {},
        )
        .unwrap();
        let m = Model::load(&p).unwrap();
        (dir, m)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| (i * 37 + salt) % 200 + 3).collect()
    }

    /// A fork written to leaves the original's bytes unchanged, and the
    /// original written to leaves the fork's unchanged; each then equals a
    /// sequence fed its tokens from the start. The fork point sits inside a
    /// KV block and the writes cross into the next, on every architecture
    /// and every KV type.
    #[test]
    fn a_fork_and_its_original_are_independent_and_equal_a_cold_run() {
        let cpu = Cpu::new(2);
        for shape in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
            let (_dir, m) = model(shape);
            for kv in [KvType::F32, KvType::F16, KvType::BF16] {
                let head = tokens(KV_BLOCK - 3, 1);
                let (a, b) = (tokens(7, 5), tokens(7, 11));
                let ctx = KV_BLOCK + 8;
                let mut orig = cpu.new_state(&m, ctx, kv).unwrap();
                forward(&m, &cpu, &mut orig, &head, Logits::None).unwrap();
                let before = cpu.download_state(&orig).unwrap();
                let mut fork = cpu.fork_state(&orig, ctx).unwrap();
                assert_eq!(bits(&cpu.download_state(&fork).unwrap()), bits(&before));
                let shared: usize = fork.kv.iter().flatten().map(|l| l.shared_blocks()).sum();
                let attn = fork.kv.iter().flatten().count();
                assert_eq!(shared, attn, "{shape}: the fork shares the KV block");
                let got_fork = forward(&m, &cpu, &mut fork, &a, Logits::Last).unwrap();
                assert_eq!(
                    bits(&cpu.download_state(&orig).unwrap()),
                    bits(&before),
                    "{shape} {kv:?}: writing to the fork changed the original"
                );
                let fork_after = cpu.download_state(&fork).unwrap();
                let got_orig = forward(&m, &cpu, &mut orig, &b, Logits::Last).unwrap();
                assert_eq!(
                    bits(&cpu.download_state(&fork).unwrap()),
                    bits(&fork_after),
                    "{shape} {kv:?}: writing to the original changed the fork"
                );
                for (st, got, tail) in [(&fork, &got_fork, &a), (&orig, &got_orig, &b)] {
                    let mut cold = cpu.new_state(&m, ctx, kv).unwrap();
                    let all: Vec<u32> = head.iter().chain(tail.iter()).copied().collect();
                    let want = forward(&m, &cpu, &mut cold, &all, Logits::Last).unwrap();
                    assert_eq!(bits(got), bits(&want), "{shape} {kv:?}: logits");
                    assert_eq!(
                        bits(&cpu.download_state(st).unwrap()),
                        bits(&cpu.download_state(&cold).unwrap()),
                        "{shape} {kv:?}: state"
                    );
                }
            }
        }
    }

    /// A fork's context may grow past the original's, never fall below its
    /// position; the recurrent states are copies, not shared.
    #[test]
    fn a_fork_takes_any_context_from_its_position_up() {
        let cpu = Cpu::new(1);
        let (_dir, m) = model("tiny-qwen3next");
        let mut st = cpu.new_state(&m, 16, KvType::F32).unwrap();
        forward(&m, &cpu, &mut st, &tokens(10, 2), Logits::None).unwrap();
        assert!(matches!(
            cpu.fork_state(&st, 9),
            Err(EngineError::ContextFull { pos: 10, ctx: 9 })
        ));
        assert!(matches!(
            cpu.fork_state(&st, usize::MAX),
            Err(EngineError::Alloc { .. })
        ));
        let mut f = cpu.fork_state(&st, 10).unwrap();
        assert_eq!((cpu.position(&f), cpu.capacity(&f)), (10, 10));
        assert!(forward(&m, &cpu, &mut f, &[5], Logits::Last).is_err());
        let mut f = cpu.fork_state(&st, 64).unwrap();
        assert_eq!(cpu.capacity(&f), 64);
        let lin = st.linear.iter().flatten().next().unwrap().s.clone();
        forward(&m, &cpu, &mut f, &[5], Logits::Last).unwrap();
        assert_eq!(st.linear.iter().flatten().next().unwrap().s, lin);
        assert_ne!(f.linear.iter().flatten().next().unwrap().s, lin);
    }
}
