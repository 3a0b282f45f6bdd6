//! Attention over the KV cache: head norms, RoPE and the KV write, the score
//! and value passes, the combine of the key tiles, and the kernel choice.

use super::*;
use cudarc::driver::{CudaView, CudaViewMut};

/// The attention kernels (ops unit, kernels/attention.cu and attention_flash.cu). The exact ones
/// take a block per (KV head, row tile, key tile of 256 positions) and
/// write the tiles' partials, which `attention_combine` folds in order; the
/// flash kernel folds its key tiles and splits itself (or, for decode, one
/// split a block, then `attention_flash_combine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AttentionKernel {
    /// `attention_tiles`: the plain tile kernel at every head dim, run only
    /// by the tests, as the reference the default kernels give the bytes of.
    Reference,
    /// `attention_tiles_q4w`: 16 (row, head) pairs a block in static shared
    /// memory; head dims 128 and 256 in lean code, others in the plain
    /// tile kernel's code.
    Pairs16,
    /// `attention_tiles_q4w2`: `attention_tiles_q4w` at 32 pairs a block
    /// (two 16-pair halves sharing each key and value row loaded), q and
    /// the scores in dynamic shared memory.
    Pairs32,
    /// `attention_flash_{64,128,256}`: flash attention on f16 tensor cores
    /// with f32 accumulation, the opt-in `--attention fast`: a different
    /// function from the exact kernels, the same for decode and prefill.
    Flash,
}

/// Pairs a block of the CUDA-core kernels (`AP` in attention.cu).
const AP: usize = 16;
/// Pairs a block of the flash kernel (`FA_P`), keys a tile (`FA_KT`) and
/// keys a split (`FA_SPLIT`).
const FA_P: usize = 128;
const FA_KT: usize = 64;
pub(super) const FA_SPLIT: usize = 512;
/// Calls of up to this many rows run the decode flash kernel, a split a
/// block (the splits fill the GPU at depth), and fold the splits in a second
/// launch; larger calls fold them in the blocks (no partials).
const FA_SPLIT_ROWS: usize = 4;
/// The decode flash kernel's (row, head) pairs a block (`FD_P`), threads
/// (`FD_W` warps) and score rows' stride in floats (`FD_SS`).
const FD_P: usize = 16;
const FD_THREADS: u32 = 128;
const FD_SS: usize = FA_KT + 4;
/// `attention_tiles_q4w2`'s dynamic shared memory (`ATT_P32_SMEM`): 2 x 16
/// pairs' q rows (`ATT_HD` = 256 floats) and score rows (`ATT_S` = 260).
const P32_SMEM: usize = 2 * AP * (256 + 260) * 4;

/// The flash kernel's dynamic shared memory in bytes at head dim `hd`
/// (`FaLayout`): its pairs' q, their running max and sum (floats, one copy
/// for each of the 4 lanes holding a pair) and,
/// with an f16 cache, two buffers of a tile's keys and values (the next
/// tile is copied while one is read), with an f32 cache one (its tiles are
/// converted in place); halves, rows hd + 8 apart.
fn flash_smem(hd: usize, f16: bool) -> usize {
    (FA_P + if f16 { 4 } else { 2 } * FA_KT) * (hd + 8) * 2 + FA_P * 4 * 2 * 4
}

/// The prefill flash kernel's threads (`FaPrefill::W` warps): 4 warps of
/// two m-tiles each at head dims up to 128 (two blocks an SM), 8 of one at
/// 256.
fn flash_threads(hd: usize) -> u32 {
    if hd <= 128 { 128 } else { 256 }
}

/// The decode flash kernel's dynamic shared memory in bytes at head dim
/// `hd` (`FdLayout::BYTES`): its pairs' q, two buffers of a tile's keys and
/// values (halves, rows hd + 8 apart), then the tile's scores.
fn flash_dec_smem(hd: usize) -> usize {
    (FD_P + 4 * FA_KT) * (hd + 8) * 2 + FD_P * FD_SS * 4
}

/// The decode flash kernel at head dim `hd` (64, 128 or 256).
fn flash_dec_name(hd: usize) -> &'static str {
    match hd {
        64 => "attention_flash_dec_64",
        128 => "attention_flash_dec_128",
        _ => "attention_flash_dec_256",
    }
}

/// The decode flash kernel for a row each of several sequences.
fn flash_dec_seqs_name(hd: usize) -> &'static str {
    match hd {
        64 => "attention_flash_dec_64_seqs",
        128 => "attention_flash_dec_128_seqs",
        _ => "attention_flash_dec_256_seqs",
    }
}

impl AttentionKernel {
    /// The kernel for head dim `hd`, query groups of `gs` heads and a call
    /// of `rows` rows, with or without fast attention. The 32-pair kernel
    /// takes calls of more than 16 pairs at head dims 128 and 256: with
    /// fewer (decode) its second half would be empty and its 66 KB of
    /// shared memory cost decode attention 13 -> 23 us a launch (H200).
    fn select(hd: usize, gs: usize, rows: usize, fast: bool) -> Self {
        if fast && matches!(hd, 64 | 128 | 256) && gs > 0 && FA_P.is_multiple_of(gs) {
            Self::Flash
        } else if (hd == 128 || hd == 256) && gs > 0 && AP.is_multiple_of(gs) && rows * gs > AP {
            Self::Pairs32
        } else {
            Self::Pairs16
        }
    }

    fn name(self, hd: usize) -> &'static str {
        match self {
            Self::Reference => "attention_tiles",
            Self::Pairs16 => "attention_tiles_q4w",
            Self::Pairs32 => "attention_tiles_q4w2",
            Self::Flash => match hd {
                64 => "attention_flash_64",
                128 => "attention_flash_128",
                _ => "attention_flash_256",
            },
        }
    }

    /// The (row, head) pairs a block of the tile kernels takes.
    fn pairs(self) -> usize {
        match self {
            Self::Reference | Self::Pairs16 => AP,
            Self::Pairs32 => 2 * AP,
            Self::Flash => FA_P,
        }
    }

    /// Dynamic shared memory in bytes at head dim `hd` (the flash kernel's
    /// largest, with an f16 cache).
    fn smem(self, hd: usize) -> usize {
        match self {
            Self::Reference | Self::Pairs16 => 0,
            Self::Pairs32 => P32_SMEM,
            Self::Flash => flash_smem(hd, true),
        }
    }
}

/// One attention call's score and value passes: `m` rows of q (`hq` heads
/// of `hd`) at positions `*pos0 ..` over a paged cache of `hkv` KV heads
/// (f32, or halves with `f16`; `kt` and `vt` its block tables' device
/// addresses, at least `nb` blocks each), `nb` key tiles a pair.
struct Pass<'a> {
    q: CudaView<'a, f32>,
    kt: u64,
    vt: u64,
    pos0: &'a CudaSlice<i32>,
    m: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
    nb: usize,
    f16: bool,
}

/// The key tiles' partials (a max and a sum, and a head-dim row, per pair
/// and tile or split) of the attention calls of one layer: made at the
/// first call's size and grown when a later one needs more, so the
/// sequences of a step share one allocation. Stream order keeps one
/// call's combine reading them before the next call's passes write them.
#[derive(Default)]
pub(super) struct Partials {
    ml: Option<CudaSlice<f32>>,
    acc: Option<CudaSlice<f32>>,
}

impl Partials {
    fn take(
        &mut self,
        d: &crate::device::Device,
        ml: usize,
        acc: usize,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)> {
        if self.ml.as_ref().is_none_or(|b| b.len() < ml) {
            self.ml = Some(d.scratch::<f32>(ml)?);
        }
        if self.acc.as_ref().is_none_or(|b| b.len() < acc) {
            self.acc = Some(d.scratch::<f32>(acc)?);
        }
        match (&mut self.ml, &mut self.acc) {
            (Some(ml), Some(acc)) => Ok((ml, acc)),
            _ => unreachable!("both made above"),
        }
    }
}

impl Cuda {
    /// The score and value pass kernel an attention call of `rows` rows
    /// launches at head dim `hd` and query groups of `gs` heads (for tests).
    #[doc(hidden)]
    pub fn attention_kernel(&self, hd: usize, gs: usize, rows: usize) -> &'static str {
        AttentionKernel::select(hd, gs, rows, self.fast_attention()).name(hd)
    }

    /// The attention kernel the last attention call launched ("" before any).
    #[doc(hidden)]
    pub fn last_attention_kernel(&self) -> &'static str {
        *self.att_last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rows the one-launch decode attention has taken so far, over every
    /// layer (for the tests).
    #[doc(hidden)]
    pub fn one_launch_attention_rows(&self) -> usize {
        self.att_seq_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Cap the attention partials of one call at `bytes` (rows then run in
    /// groups; 1 runs one row at a time), for the tests.
    #[doc(hidden)]
    pub fn set_attention_partials(&mut self, bytes: usize) {
        self.attn_partials = bytes.max(1);
    }

    /// Attention of host rows, for the kernel tests: `q` holds `m` rows of
    /// `hq` heads of `hd` (`heads` = (hq, hkv, hd)) at positions `pos ..`,
    /// `k` and `v` the cache's `pos + m` positions of `hkv` heads (stored as
    /// halves with `f16`). The score and value passes are the ones the
    /// backend picks, or with `reference` the plain `attention_tiles`, in
    /// row groups under the partials' cap; then `attention_combine`.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn attention_host(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: (usize, usize, usize),
        pos: usize,
        f16: bool,
        reference: bool,
    ) -> Result<Vec<f32>> {
        let (hq, hkv, hd) = heads;
        attention_shape(hq, hkv, hd)?;
        let (qw, kvw) = (hq * hd, hkv * hd);
        let m = q.len() / qw;
        if m == 0 || q.len() != m * qw || k.len() != (pos + m) * kvw || v.len() != k.len() {
            return Err(CudaError::Driver {
                op: "attention".into(),
                msg: format!(
                    "q of {} values ({hq} heads of {hd} a row), k of {} and v of {} \
                     ({hkv} KV heads, {pos} positions before the rows)",
                    q.len(),
                    k.len(),
                    v.len()
                ),
            });
        }
        let d = &self.dev;
        let cache = |x: &[f32]| -> Vec<u8> {
            if f16 {
                x.iter()
                    .flat_map(|&e| half::f16::from_f32(e).to_bits().to_ne_bytes())
                    .collect()
            } else {
                x.iter().flat_map(|e| e.to_ne_bytes()).collect()
            }
        };
        let (qd, ck, cv) = (d.upload(q)?, d.upload(&cache(k))?, d.upload(&cache(v))?);
        let pos0 = d.upload(&[pos as i32])?;
        let mut o = d.upload(&vec![f32::NAN; m * qw])?;
        let el = if f16 { 2 } else { 4 };
        let (kt, vt, _table) = super::kv::contiguous_table(d, &ck, &cv, pos + m, kvw * el)?;
        let pass = Pass {
            q: qd.as_view(),
            kt,
            vt,
            pos0: &pos0,
            m,
            hq,
            hkv,
            hd,
            nb: (pos + m).div_ceil(256),
            f16,
        };
        self.attend(
            &pass,
            &mut o.as_view_mut(),
            None,
            reference,
            &mut Partials::default(),
        )?;
        d.download(&o, m * qw)
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
        let m = x.len() / model.hp.n_embd;
        self.attention_seq_rows(model, l, a, x, xq, &mut [st], &[m], y)
    }

    /// Attention over the rows of several sequences (`rows[i]` consecutive
    /// rows of `x` for `sts[i]`): the q, k and v projections, the gate and
    /// the output projection over all rows in one call each; the head norms,
    /// RoPE, the KV write and the score and value passes per sequence, on
    /// that sequence's rows and cache, with the kernels a call of its rows
    /// alone would pick. Every op is row-wise (the row contract), so each
    /// sequence gets the bytes of a call of its own.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_seq_rows(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<u8>>,
        sts: &mut [&mut CudaState],
        rows: &[usize],
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let hp = &model.hp;
        let d = &self.dev;
        let (hq, hkv, hd) = (hp.n_head, hp.n_head_kv, hp.head_dim);
        let m = x.len() / hp.n_embd;
        // A bound step of several sequences runs its rows through its table.
        let bound = self.bound_seqs();
        let fits = match bound {
            Some(bd) => bd.rows == m && bd.seqs == rows.len() && rows.iter().all(|&n| n == 1),
            None => rows.iter().sum::<usize>() == m,
        };
        if !fits || rows.len() != sts.len() {
            return Err(CudaError::Driver {
                op: "attention".into(),
                msg: format!("{} rows for {} sequences of {:?} rows", m, sts.len(), rows),
            });
        }
        let (qw, kvw) = (hq * hd, hkv * hd);
        let mut qg = d.scratch::<f32>(m * a.q.rows)?;
        let mut k = d.scratch::<f32>(m * kvw)?;
        let mut v = d.scratch::<f32>(m * kvw)?;
        let xin = Input::with_given_q8k(x, m, xq);
        self.mm_group(&xin, &mut [(&a.q, &mut qg), (&a.k, &mut k), (&a.v, &mut v)])?;
        let (hqi, hkvi, hdi, nrot) = (hq as i32, hkv as i32, hd as i32, hp.n_rot as i32);
        let rope = hp.rope();
        let rp = crate::device::RopeArg {
            theta: rope.theta,
            freq_scale: rope.freq_scale,
            ext_factor: rope.ext_factor,
            corr_lo: rope.corr_lo,
            corr_hi: rope.corr_hi,
            mscale: rope.mscale,
        };
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
        // The head norms, RoPE and the KV write in one launch, q read in
        // place from the projection's rows (head dims up to 256, as
        // `attention_shape` requires: a head fits the warp's shared row).
        let mut q = d.scratch::<f32>(m * qw)?;
        let (q_row, q_head) = if a.gated {
            (2 * qw as i32, 2 * hdi)
        } else {
            (qw as i32, hdi)
        };
        let (qn, kn) = (self.vec(&a.q_norm)?, self.vec(&a.k_norm)?);
        let eps = hp.eps;
        // Ungated attention into a K-quant out projection: the combine also
        // writes the rows' Q8_K blocks (no quantize launch). The flash
        // kernel writes none, so where any sequence's rows take it, the out
        // projection quantizes the rows itself (the same blocks).
        let fast = self.fast_attention();
        let flash = rows.iter().any(|&n| {
            n > 0 && AttentionKernel::select(hd, hq / hkv, n, fast) == AttentionKernel::Flash
        });
        let mut oq = if !flash && gate.is_none() && k_quant(a.o.ty) && qw.is_multiple_of(256) {
            Some(d.scratch::<u8>(m * qw / 256 * 304)?)
        } else {
            None
        };
        let row_q = qw / 256 * 304;
        let mut o = d.scratch::<f32>(m * qw)?;
        let mut parts = Partials::default();
        // The decode rows that lead the call (the scheduler puts them
        // first), on the flash kernels: every such sequence's row in one
        // launch of each kernel, each row's cache and position from a table
        // (the bytes of each row's own call); the sequences after them run
        // call by call below. A bound step of several sequences runs all
        // its rows so, from its own table.
        let lead = rows.iter().take_while(|&&n| n == 1).count();
        let one_launch = bound.is_some()
            || fast
                && lead > 1
                && self.flash_for_one_row(model)
                && sts[..lead]
                    .iter()
                    .all(|st| st.f16 == sts[0].f16 && st.kv[l].is_some());
        // The rows' positions writable in this layer's cache (the forward
        // call reserved them: nothing runs here then).
        if bound.is_none() {
            for (st, &n) in sts.iter_mut().zip(rows) {
                let from = st.pos;
                if let Some(p) = st.kv[l].as_mut() {
                    p.reserve(d, from, from + n)?;
                }
            }
        }
        let done = match (bound, one_launch) {
            (Some(_), _) => sts.len(),
            (None, true) => lead,
            (None, false) => 0,
        };
        if one_launch {
            // The rows' caches and positions: the bound step's table (its
            // splits fixed, so its recording replays at any position below
            // them), or this call's.
            let mut table_buf = None;
            let (kvt, ns, nsplit, f16) = match bound {
                Some(bd) => (bd.layer(l), bd.rows, bd.nsplit, bd.f16 as i32),
                None => {
                    let ns = lead;
                    let mut table = vec![0u64; 3 * ns];
                    let mut nsplit = 1;
                    for (i, st) in sts[..lead].iter().enumerate() {
                        let p = st.kv[l].as_ref().expect("checked above");
                        table[i] = p.kt(d);
                        table[ns + i] = p.vt(d);
                        table[2 * ns + i] = st.pos as u64;
                        nsplit = nsplit.max((st.pos + 1).div_ceil(FA_SPLIT));
                    }
                    let buf = table_buf.insert(d.upload(&table)?);
                    (crate::device::addr(d, buf), ns, nsplit, sts[0].f16 as i32)
                }
            };
            let (nsi, nsp) = (ns as i32, nsplit as i32);
            launch!(
                d,
                "qk_norm_rope_kv_seqs",
                cfg(((ns * (hq + hkv)).div_ceil(8) as u32, 1, 1), 256, 0),
                &qg,
                &q_row,
                &q_head,
                &k,
                &v,
                qn,
                kn,
                &mut q,
                &kvt,
                &nsi,
                &hqi,
                &hkvi,
                &hdi,
                &nrot,
                &rp,
                &eps,
                &f16
            )?;
            let parts_n = ns * hq * nsplit;
            let (pml, pacc) = parts.take(d, parts_n * 2, parts_n * hd)?;
            let sl2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
            let gs = hq / hkv;
            launch!(
                d,
                flash_dec_seqs_name(hd),
                cfg(
                    (hkv as u32, (ns * gs.div_ceil(FD_P)) as u32, nsplit as u32),
                    FD_THREADS,
                    flash_dec_smem(hd) as u32
                ),
                &q,
                &kvt,
                &mut *pml,
                &mut *pacc,
                &nsi,
                &hqi,
                &hkvi,
                &sl2,
                &f16,
                &nsp
            )?;
            launch!(
                d,
                "attention_flash_combine_seqs",
                cfg(((ns * hq) as u32, 1, 1), hd.div_ceil(32) as u32 * 32, 0),
                &*pml,
                &*pacc,
                &mut o,
                &hqi,
                &hdi,
                &kvt,
                &nsi,
                &nsp
            )?;
            *self.att_last.lock().unwrap_or_else(|p| p.into_inner()) = "attention_flash_dec_seqs";
            self.att_seq_rows
                .fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
            // The call's own table is freed after the launches that read it
            // (a stream-ordered free).
            drop(table_buf);
        }
        let mut r0 = done;
        for (st, &n) in sts.iter_mut().zip(rows).skip(done) {
            if n == 0 {
                continue;
            }
            self.sync_pos(st)?;
            // A recorded step covers the whole context (blocks past a row's
            // position return at once), so its replays serve every position.
            let nb = if st.whole_ctx {
                st.ctx.div_ceil(256)
            } else {
                (st.pos + n).div_ceil(256)
            };
            let f16 = st.f16;
            let (kt, vt) = match st.kv[l].as_ref() {
                Some(p) => (p.kt(d), p.vt(d)),
                None => {
                    return Err(CudaError::Driver {
                        op: "attention".into(),
                        msg: format!("layer {l} has no KV cache"),
                    });
                }
            };
            let pos0 = &st.pos_dev;
            let ni = n as i32;
            let qr = q_row as usize;
            let (qg_s, k_s, v_s) = (
                qg.slice(r0 * qr..(r0 + n) * qr),
                k.slice(r0 * kvw..(r0 + n) * kvw),
                v.slice(r0 * kvw..(r0 + n) * kvw),
            );
            let mut q_s = q.slice_mut(r0 * qw..(r0 + n) * qw);
            let f16i = f16 as i32;
            launch!(
                d,
                "qk_norm_rope_kv",
                cfg(((n * (hq + hkv)).div_ceil(8) as u32, 1, 1), 256, 0),
                &qg_s,
                &q_row,
                &q_head,
                &k_s,
                &v_s,
                qn,
                kn,
                &mut q_s,
                &kt,
                &vt,
                pos0,
                &ni,
                &hqi,
                &hkvi,
                &hdi,
                &nrot,
                &rp,
                &eps,
                &f16i
            )?;
            let pass = Pass {
                q: q.slice(r0 * qw..(r0 + n) * qw),
                kt,
                vt,
                pos0,
                m: n,
                hq,
                hkv,
                hd,
                nb,
                f16,
            };
            let mut o_s = o.slice_mut(r0 * qw..(r0 + n) * qw);
            match oq.as_mut() {
                Some(oq) => {
                    let mut oq_s = oq.slice_mut(r0 * row_q..(r0 + n) * row_q);
                    self.attend(&pass, &mut o_s, Some(&mut oq_s), false, &mut parts)?
                }
                None => self.attend(&pass, &mut o_s, None, false, &mut parts)?,
            }
            r0 += n;
        }
        if let Some(g) = gate {
            // With the out projection reading Q8_K rows, the gate writes
            // them too (a warp per 256-block).
            if k_quant(a.o.ty) && qw.is_multiple_of(256) {
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

    /// Whether a call of one row takes the flash kernels (whose decode
    /// launches take a row each of several sequences).
    pub(super) fn flash_for_one_row(&self, model: &Model) -> bool {
        let hp = &model.hp;
        hp.n_head_kv > 0
            && hp.n_head.is_multiple_of(hp.n_head_kv)
            && AttentionKernel::select(
                hp.head_dim,
                hp.n_head / hp.n_head_kv,
                1,
                self.fast_attention(),
            ) == AttentionKernel::Flash
    }

    /// The score and value passes of one attention call, then the combine
    /// into `o` (m x hq x hd; with `oq`, `attention_combine_q8k` also
    /// writes the rows' Q8_K blocks). Fixed key tiles of 256 positions, a
    /// block per (KV head, row tile, key tile), then the tiles folded in
    /// order: the same bytes for every m (see attention_tiles).
    fn attend(
        &self,
        p: &Pass,
        o: &mut CudaViewMut<f32>,
        mut oq: Option<&mut CudaViewMut<u8>>,
        reference: bool,
        parts: &mut Partials,
    ) -> Result<()> {
        let d = &self.dev;
        let (m, hq, hkv, hd, nb) = (p.m, p.hq, p.hkv, p.hd, p.nb);
        let qw = hq * hd;
        let scale = 1.0f32 / (hd as f32).sqrt();
        let gs = hq / hkv;
        if !reference
            && AttentionKernel::select(hd, gs, m, self.fast_attention()) == AttentionKernel::Flash
        {
            return self.attend_flash(p, o, oq.is_some(), parts);
        }
        // The partials (a max, a sum and a head-dim row per pair and tile)
        // grow with rows x context, so long contexts run the rows in groups
        // that keep them under `attn_partials` bytes. Each pair's sums are
        // the same whatever group it is in.
        let per_row = hq * nb * (hd + 2) * 4;
        let group = (self.attn_partials / per_row).clamp(1, m);
        let group = m.div_ceil(m.div_ceil(group)); // groups of even size
        let (pml, pacc) = parts.take(d, group * hq * nb * 2, group * hq * nb * hd)?;
        let (hqi, hkvi, hdi, nbi, f16) =
            (hq as i32, hkv as i32, hd as i32, nb as i32, p.f16 as i32);
        for r0 in (0..m).step_by(group) {
            let mr = group.min(m - r0);
            let (mri, r0i) = (mr as i32, r0 as i32);
            let qg = p.q.slice(r0 * qw..(r0 + mr) * qw);
            let kernel = if reference {
                AttentionKernel::Reference
            } else {
                AttentionKernel::select(hd, gs, mr, self.fast_attention())
            };
            *self.att_last.lock().unwrap_or_else(|p| p.into_inner()) = kernel.name(hd);
            launch!(
                d,
                kernel.name(hd),
                cfg(
                    (
                        hkv as u32,
                        mr.div_ceil(kernel.pairs() / gs) as u32,
                        nb as u32
                    ),
                    256,
                    kernel.smem(hd) as u32
                ),
                &qg,
                &p.kt,
                &p.vt,
                &mut *pml,
                &mut *pacc,
                &mri,
                &hqi,
                &hkvi,
                &hdi,
                p.pos0,
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
                    &*pml,
                    &*pacc,
                    &mut og,
                    &mut qg,
                    &mri,
                    &hqi,
                    &hdi,
                    p.pos0,
                    &r0i,
                    &nbi
                )?;
                continue;
            }
            launch!(
                d,
                "attention_combine",
                cfg(((mr * hq) as u32, 1, 1), hd.div_ceil(32) as u32 * 32, 0),
                &*pml,
                &*pacc,
                &mut og,
                &mri,
                &hqi,
                &hdi,
                p.pos0,
                &r0i,
                &nbi
            )?;
        }
        Ok(())
    }
}

impl Cuda {
    /// Flash attention into `o` (m x hq x hd). Calls of up to
    /// `FA_SPLIT_ROWS` rows take `attention_flash_dec_*`, a block per (KV
    /// head, 16 pairs, split of 512 keys), and fold the splits' partials in
    /// `attention_flash_combine`; larger calls a block per (KV head, row
    /// tile), folding the splits in the block: the same folds in the same
    /// order (attention_flash.cu).
    fn attend_flash(
        &self,
        p: &Pass,
        o: &mut CudaViewMut<f32>,
        wants_q8k: bool,
        parts_buf: &mut Partials,
    ) -> Result<()> {
        if wants_q8k {
            return Err(CudaError::Driver {
                op: "attention".into(),
                msg: "the flash kernel writes no Q8_K rows".into(),
            });
        }
        let d = &self.dev;
        let (m, hq, hkv, hd) = (p.m, p.hq, p.hkv, p.hd);
        let gs = hq / hkv;
        let kernel = AttentionKernel::Flash;
        let name = kernel.name(hd);
        *self.att_last.lock().unwrap_or_else(|p| p.into_inner()) = name;
        // p.nb key tiles of 256 positions cover the call's keys (the whole
        // context for a recorded step): half as many splits.
        let nsplit = (p.nb * 256).div_ceil(FA_SPLIT);
        let split = m <= FA_SPLIT_ROWS;
        let sl2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
        let (mi, hqi, hkvi, hdi, nsi, f16) = (
            m as i32,
            hq as i32,
            hkv as i32,
            hd as i32,
            nsplit as i32,
            p.f16 as i32,
        );
        let r0 = 0i32;
        if !split {
            return launch!(
                d,
                name,
                cfg(
                    (hkv as u32, m.div_ceil(FA_P / gs) as u32, 1),
                    flash_threads(hd),
                    flash_smem(hd, p.f16) as u32
                ),
                &p.q,
                &p.kt,
                &p.vt,
                &mut *o,
                &mi,
                &hqi,
                &hkvi,
                p.pos0,
                &r0,
                &sl2,
                &f16
            );
        }
        let parts = m * hq * nsplit;
        let (pml, pacc) = parts_buf.take(d, parts * 2, parts * hd)?;
        launch!(
            d,
            flash_dec_name(hd),
            cfg(
                (hkv as u32, (m * gs.div_ceil(FD_P)) as u32, nsplit as u32),
                FD_THREADS,
                flash_dec_smem(hd) as u32
            ),
            &p.q,
            &p.kt,
            &p.vt,
            &mut *pml,
            &mut *pacc,
            &mi,
            &hqi,
            &hkvi,
            p.pos0,
            &r0,
            &sl2,
            &f16,
            &nsi
        )?;
        launch!(
            d,
            "attention_flash_combine",
            cfg(((m * hq) as u32, 1, 1), hd.div_ceil(32) as u32 * 32, 0),
            &*pml,
            &*pacc,
            &mut *o,
            &hqi,
            &hdi,
            p.pos0,
            &r0,
            &nsi
        )?;
        Ok(())
    }
}

/// The score pass's 16-pair butterfly (attention.cu, `pair_butterfly`)
/// simulated on the host in f32: lanes holding pair `r ^ ((lane >> 1) & 15)`
/// in register `r` and exchanging with no select end with the same bits as
/// lanes holding pair `r` in register `r` and selecting what to send and
/// keep, the plain form of the butterfly; and a wrong layout is caught.
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

    /// attention.cu's `qs_col`: where dim d of a pair's q sits in its row (head
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
