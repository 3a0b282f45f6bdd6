//! The CPU backend: row kernels over f32 slices.
//!
//! Every op computes each output row from that row's inputs only (plus, for the
//! sequential ops, the state its own sequence has written), with one fixed order
//! of arithmetic; threads split output columns or heads, never a reduction, so
//! results are the same for any number of rows in the call and any thread count.

use crate::model::{Matrix, Rope};
use crate::pool::Pool;
use crate::state::KvLayer;
use samesum_quant::dot::{self, ActRow};

/// The CPU backend: a thread pool.
pub struct Cpu {
    pool: Pool,
    reversed_topk: bool,
    lanes: bool,
}

/// One matmul of [`Cpu::matmuls`]: `y = W_mat · x` row by row.
pub struct MatmulJob<'a> {
    /// The weights.
    pub w: &'a Matrix,
    /// Which stacked matrix (expert).
    pub mat: usize,
    /// Input rows (`cols` each).
    pub x: &'a [f32],
    /// Output rows (`rows` each).
    pub y: &'a mut [f32],
}

/// Defines `$name`, which runs `$body` (an `#[inline(always)]` function with the
/// same parameters) compiled for AVX-512 F, for AVX2, or for the baseline,
/// whichever is the widest this CPU has (`Isa::best`, so `SAMESUM_ISA` caps it
/// too). Rust never fuses or reorders float operations, so every width
/// computes the same bytes; only the vector length changes.
macro_rules! widest {
    ($(#[$m:meta])* fn $name:ident $([$($g:tt)*])? ($($a:ident: $t:ty),* $(,)?) => $body:ident) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        fn $name $(<$($g)*>)? ($($a: $t),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                #[allow(clippy::too_many_arguments)]
                fn wide512 $(<$($g)*>)? ($($a: $t),*) {
                    $body($($a),*)
                }
                #[target_feature(enable = "avx2")]
                #[allow(clippy::too_many_arguments)]
                fn wide256 $(<$($g)*>)? ($($a: $t),*) {
                    $body($($a),*)
                }
                use samesum_quant::isa::Isa;
                let isa = Isa::best();
                if isa >= Isa::Avx512 {
                    // SAFETY: Isa::best reports AVX-512 F only when the CPU has it.
                    return unsafe { wide512($($a),*) };
                }
                if isa >= Isa::Avx2 {
                    // SAFETY: as above, for AVX2.
                    return unsafe { wide256($($a),*) };
                }
            }
            $body($($a),*)
        }
    };
}

mod act;
mod attend;

/// Largest delta-net value head dim the kernels take (real models use 128).
const MAX_DV: usize = 512;

/// Fewest activation values (all rows of a call) quantized in a parallel
/// region; fewer are quantized on the caller (a region's hand-off costs
/// more than quantizing a few rows).
const PAR_QUANT_VALUES: usize = 16 * 1024;

/// Fewest output columns per parallel task in a matmul.
const MIN_COLS_PER_TASK: usize = 16;

impl Cpu {
    /// A backend running on `threads` threads (0: all cores).
    pub fn new(threads: usize) -> Cpu {
        Cpu {
            pool: Pool::new(threads),
            reversed_topk: false,
            lanes: false,
        }
    }

    /// Two lanes ([`crate::Backend::lanes`]): [`crate::forward_pair`] then
    /// runs its wavefront order on the CPU (layer 0 of the first chunk,
    /// layer 1 of the first, layer 0 of the second, ...), each op when it is
    /// issued, so the tests can check that order against one chunk after the
    /// other without a GPU. Off by default (nothing runs beside anything on
    /// the CPU).
    pub fn with_lanes(mut self) -> Self {
        self.lanes = true;
        self
    }

    /// Whether two lanes are on.
    pub(crate) fn lanes_on(&self) -> bool {
        self.lanes
    }

    /// A deliberately wrong variant for the identity gate's negative control: the
    /// batched MoE sums each token's experts in reverse slot order with fused
    /// multiply-adds (a different rounding from decode; with two experts the
    /// reversal alone would commute). Never use it for anything else.
    #[doc(hidden)]
    pub fn with_reversed_topk(mut self) -> Self {
        self.reversed_topk = true;
        self
    }

    /// Whether the negative-control variant is on.
    pub(crate) fn reversed_topk(&self) -> bool {
        self.reversed_topk
    }

    /// Threads in use.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// `y[r][j] = W_mat[j] · x[r]` for each of the `x.len() / cols` rows: each
    /// activation row is quantized once into the weight format's partner, then one
    /// dot per output element.
    pub fn matmul(&self, file: &[u8], w: &Matrix, mat: usize, x: &[f32], y: &mut [f32]) {
        self.matmuls(file, &mut [MatmulJob { w, mat, x, y }]);
    }

    /// Several independent matmuls in one parallel region (fewer thread wake-ups
    /// than one region each). Every output element is the same single dot product
    /// as in [`Cpu::matmul`]; only the assignment of elements to threads differs.
    pub fn matmuls(&self, file: &[u8], jobs: &mut [MatmulJob<'_>]) {
        // Quantize every activation row once: jobs reading the same rows into the
        // same activation format (gate and up of one expert) share them.
        let key = |j: &MatmulJob| (j.x.as_ptr(), j.x.len(), j.w.cols, dot::act_type(j.w.ty));
        let src: Vec<usize> = (0..jobs.len())
            .map(|i| {
                (0..i)
                    .find(|&p| key(&jobs[p]) == key(&jobs[i]))
                    .unwrap_or(i)
            })
            .collect();
        let acts = self.quantize_jobs(jobs, &src);
        let total: usize = jobs.iter().map(|j| j.w.rows).sum();
        // Tasks are ranges of weight rows: a few per thread, enough to balance.
        // Inside a task, a tile of weight rows is applied to every activation row
        // before the next tile, so each weight byte is read from memory once per
        // call whatever the number of rows. Every output element is still one dot
        // of one weight row with one activation row: the tiling never splits a sum.
        let per = total.div_ceil(4 * self.threads()).max(MIN_COLS_PER_TASK);
        struct Out {
            ptr: *mut f32,
            len: usize,
        }
        // SAFETY (Send/Sync): tasks write disjoint (row, column) ranges of each
        // output, and `matmuls` holds the &mut for the whole parallel region.
        unsafe impl Send for Out {}
        unsafe impl Sync for Out {}
        let outs: Vec<Out> = jobs
            .iter_mut()
            .map(|j| Out {
                ptr: j.y.as_mut_ptr(),
                len: j.y.len(),
            })
            .collect();
        let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
        for (ji, j) in jobs.iter().enumerate() {
            let mut j0 = 0;
            while j0 < j.w.rows {
                let j1 = (j0 + per).min(j.w.rows);
                tasks.push((ji, j0, j1));
                j0 = j1;
            }
        }
        let jobs = &*jobs;
        self.pool.run(tasks.len(), &|t| {
            let (ji, j0, j1) = tasks[t];
            let j = &jobs[ji];
            let (w, rb) = (j.w, j.w.row_bytes);
            let bytes = w.mat_bytes(file, j.mat);
            let out = &outs[ji];
            let acts = &acts[src[ji]];
            let m = acts.len();
            // Weight rows per kernel call: a tile that stays in L1 while every
            // activation row passes, or the whole range for kernels that tile
            // it themselves (`dot::multi_rows_per_call`).
            let per_call = if m == 1 {
                j1 - j0
            } else {
                dot::multi_rows_per_call(w.ty, m)
            };
            let mut tile = Vec::new();
            let mut t0 = j0;
            while t0 < j1 {
                let t1 = t0.saturating_add(per_call).min(j1);
                let rows = &bytes[t0 * rb..t1 * rb];
                if m == 1 {
                    debug_assert!(t1 <= out.len);
                    // SAFETY: [t0, t1) is this task's column range of the only row.
                    let y = unsafe { std::slice::from_raw_parts_mut(out.ptr.add(t0), t1 - t0) };
                    dot::dot_rows(w.ty, rows, &acts[0], y).expect("checked at bind");
                } else {
                    let n = t1 - t0;
                    tile.resize(n * m, 0.0);
                    dot::dot_rows_multi(w.ty, rows, acts, &mut tile).expect("checked at bind");
                    for (r, vals) in tile.chunks_exact(n).enumerate() {
                        let at = r * w.rows + t0;
                        debug_assert!(at + n <= out.len);
                        // SAFETY: row r, columns t0..t1 are this task's alone.
                        unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), out.ptr.add(at), n) };
                    }
                }
                t0 = t1;
            }
        });
    }

    /// The activation rows of every job that is its own source (`src[i] ==
    /// i`; the others are empty): all of them in one parallel region, or on
    /// the caller when there are too few values to be worth a hand-off. Each
    /// row is quantized by itself, so the split changes no byte.
    fn quantize_jobs(&self, jobs: &[MatmulJob<'_>], src: &[usize]) -> Vec<Vec<ActRow>> {
        let quant = |j: &MatmulJob, r: usize| {
            let c = j.w.cols;
            act::quantize(j.w.ty, &j.x[r * c..(r + 1) * c])
                .expect("bound matrices have a dot kernel and whole blocks")
        };
        let rows: Vec<(usize, usize)> = (0..jobs.len())
            .filter(|&i| src[i] == i)
            .flat_map(|i| (0..jobs[i].x.len() / jobs[i].w.cols).map(move |r| (i, r)))
            .collect();
        let values: usize = rows.iter().map(|&(i, _)| jobs[i].w.cols).sum();
        let mut acts: Vec<Vec<ActRow>> = jobs.iter().map(|_| Vec::new()).collect();
        if values < PAR_QUANT_VALUES || rows.len() < 2 {
            for &(i, r) in &rows {
                acts[i].push(quant(&jobs[i], r));
            }
            return acts;
        }
        let mut out: Vec<Option<ActRow>> = vec![None; rows.len()];
        self.pool.for_each_mut(&mut out, |k, a| {
            let (i, r) = rows[k];
            *a = Some(quant(&jobs[i], r));
        });
        for (&(i, _), a) in rows.iter().zip(out) {
            acts[i].push(a.expect("quantized"));
        }
        acts
    }

    /// Attention rows over a KV cache. `q` (m rows of `n_head * head_dim`) and `k`
    /// (m rows of `n_head_kv * head_dim`) come after their head norms and before
    /// RoPE; row `r` is position `pos0 + r`. Every row's rotated key and its
    /// value are written to the cache, then each row attends over positions
    /// `0..=pos0 + r` (block by block, see [`attend`]), exactly as a one-row
    /// call at that position would.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_rows(
        &self,
        q: &mut [f32],
        k: &mut [f32],
        v: &[f32],
        cache: &mut KvLayer,
        pos0: usize,
        p: &AttnParams,
        o: &mut [f32],
    ) {
        let mut seg = [AttnRows {
            q,
            k,
            v,
            cache,
            pos0,
            o,
        }];
        self.attention_seqs(&mut seg, p);
    }

    /// Attention rows of several sequences: as [`Cpu::attention_rows`] for
    /// each, the attention of all of them in one parallel region.
    pub fn attention_seqs(&self, segs: &mut [AttnRows<'_>], p: &AttnParams) {
        // Rotate and store every row's key first: row r reads cache positions
        // 0..=pos0+r only, so keys of later rows in the cache change nothing it
        // computes.
        for s in segs.iter_mut() {
            rope_store_rows(s.q, s.k, s.v, s.cache, s.pos0, p);
        }
        let mut at: Vec<attend::AttnSeg<'_>> = segs
            .iter_mut()
            .map(|s| attend::AttnSeg {
                q: &*s.q,
                pos0: s.pos0,
                cache: &*s.cache,
                o: &mut *s.o,
            })
            .collect();
        self.attend_segments(&mut at, p);
    }

    /// Gated delta-rule rows with state. Per row, in order: q and k (from the
    /// conv output) are L2-normed per key head; each value head `n` (key head
    /// `n % Hk` when `tiled`, else `n / (Hv/Hk)`) decays its state by
    /// `exp(softplus(a + dt_bias) * A)`, applies the delta update with
    /// `beta = sigmoid(b)`, reads out `S^T q / sqrt(dk)`, and applies the gated
    /// RMSNorm with `z`. Heads run in parallel; each owns its state block.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_rows(
        &self,
        conv: &[f32],
        b: &[f32],
        a: &[f32],
        z: &[f32],
        dt_bias: &[f32],
        ssm_a: &[f32],
        norm: &[f32],
        p: &DeltaParams,
        state: &mut [f32],
        o: &mut [f32],
    ) {
        let mut seq = [DeltaSeq {
            conv,
            b,
            a,
            z,
            state,
            o,
        }];
        self.delta_rows_seqs(&mut seq, dt_bias, ssm_a, norm, p);
    }

    /// [`Cpu::delta_rows`] for several sequences, each with its own rows and
    /// state, in one parallel region over (sequence, value head): every
    /// head's arithmetic is that of a call of its own.
    pub fn delta_rows_seqs(
        &self,
        seqs: &mut [DeltaSeq<'_>],
        dt_bias: &[f32],
        ssm_a: &[f32],
        norm: &[f32],
        p: &DeltaParams,
    ) {
        let (hk, hv, dk, dv) = (p.n_k_heads, p.n_v_heads, p.head_k_dim, p.head_v_dim);
        let (kd, vd) = (hk * dk, hv * dv);
        let cd = 2 * kd + vd;
        let ratio = hv / hk;
        let q_scale = 1.0 / (dk as f32).sqrt();
        // L2-normed q and k of every row of every sequence first (per row,
        // per key head).
        let qks: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| {
                let m = s.conv.len() / cd;
                let mut qk = vec![0f32; m * 2 * kd];
                for r in 0..m {
                    let dst = &mut qk[r * 2 * kd..(r + 1) * 2 * kd];
                    dst.copy_from_slice(&s.conv[r * cd..r * cd + 2 * kd]);
                    for h in 0..2 * hk {
                        l2_norm(&mut dst[h * dk..(h + 1) * dk], p.eps);
                    }
                }
                qk
            })
            .collect();
        // Each (sequence, value head) owns its state block: all of them in
        // parallel, each walking its rows in order, exactly as one-row calls
        // would.
        struct Head<'s> {
            seq: usize,
            n: usize,
            sn: &'s mut [f32],
            o: usize,
        }
        let mut heads: Vec<Head<'_>> = Vec::new();
        let mut inputs = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter_mut().enumerate() {
            let o = s.o.as_mut_ptr() as usize;
            inputs.push((s.conv, s.b, s.a, s.z));
            for (n, sn) in s.state.chunks_mut(dk * dv).enumerate() {
                heads.push(Head { seq: i, n, sn, o });
            }
        }
        self.pool.for_each_mut(&mut heads, |_, h| {
            let (conv, b, a, z) = inputs[h.seq];
            let qk = &qks[h.seq];
            let n = h.n;
            let m = conv.len() / cd;
            let kh = if p.tiled { n % hk } else { n / ratio };
            for r in 0..m {
                let qkr = &qk[r * 2 * kd..(r + 1) * 2 * kd];
                let qh = &qkr[kh * dk..(kh + 1) * dk];
                let khv = &qkr[kd + kh * dk..kd + (kh + 1) * dk];
                let vh = &conv[r * cd + 2 * kd + n * dv..r * cd + 2 * kd + (n + 1) * dv];
                // SAFETY: head n of row r owns o[r*vd + n*dv .. + dv] of its
                // sequence's output; heads are distinct tasks and rows are
                // walked by one task.
                let on = unsafe {
                    std::slice::from_raw_parts_mut((h.o as *mut f32).add(r * vd + n * dv), dv)
                };
                let beta = sigmoid(b[r * hv + n]);
                let g = softplus(a[r * hv + n] + dt_bias[n]) * ssm_a[n];
                let decay = g.exp();
                let u = DeltaStep {
                    k: khv,
                    q: qh,
                    v: vh,
                    beta,
                    decay,
                    q_scale,
                };
                delta_step(&u, h.sn, on);
                let scale = rms_scale(on, p.eps);
                let zh = &z[r * vd + n * dv..r * vd + (n + 1) * dv];
                for j in 0..dv {
                    on[j] = ((on[j] * scale) * norm[j]) * silu(zh[j]);
                }
            }
        });
    }

    /// Run `f(head)` for `n` independent heads in parallel.
    pub fn par_heads<T: Send>(
        &self,
        out: &mut [T],
        per: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let mut chunks: Vec<&mut [T]> = out.chunks_mut(per).collect();
        self.pool.for_each_mut(&mut chunks, |h, c| f(h, c));
    }
}

/// One sequence's rows of [`Cpu::delta_rows_seqs`]: its conv output, beta
/// and alpha logits, gate, recurrent state and output rows.
pub struct DeltaSeq<'a> {
    /// Conv output rows (`2 Hk dk + Hv dv` each).
    pub conv: &'a [f32],
    /// Beta logits (`Hv` a row).
    pub b: &'a [f32],
    /// Alpha logits (`Hv` a row).
    pub a: &'a [f32],
    /// Gate rows (`Hv dv` each).
    pub z: &'a [f32],
    /// Recurrent state, `dk x dv` per value head.
    pub state: &'a mut [f32],
    /// Output rows (`Hv dv` each).
    pub o: &'a mut [f32],
}

/// One row of one value head's delta rule: the inputs of [`delta_step`].
struct DeltaStep<'a> {
    k: &'a [f32],
    q: &'a [f32],
    v: &'a [f32],
    beta: f32,
    decay: f32,
    q_scale: f32,
}

/// One row's state update and read-out for one value head (`sn`: dk rows of dv).
/// Pass 1: decay the state and accumulate kv[j] = Σ_i S[i][j] k[i] (i
/// ascending); pass 2: the rank-1 update and the read-out
/// o[j] = Σ_i S'[i][j] q[i] / sqrt(dk) (i ascending). Each element's sequence
/// of operations is fixed; the loops run across j, so wider vectors change
/// nothing but speed (Rust never fuses or reorders these float operations).
#[inline(always)]
fn delta_step_body(u: &DeltaStep<'_>, sn: &mut [f32], on: &mut [f32]) {
    let (dk, dv) = (u.k.len(), on.len());
    let mut kv = [0f32; MAX_DV];
    let kv = &mut kv[..dv];
    for i in 0..dk {
        let ki = u.k[i];
        for (acc, s) in kv.iter_mut().zip(sn[i * dv..(i + 1) * dv].iter_mut()) {
            *s *= u.decay;
            *acc += *s * ki;
        }
    }
    let mut delta = [0f32; MAX_DV];
    let delta = &mut delta[..dv];
    for j in 0..dv {
        delta[j] = (u.v[j] - kv[j]) * u.beta;
    }
    on.fill(0.0);
    for i in 0..dk {
        let ki = u.k[i];
        let qi = u.q[i] * u.q_scale;
        for ((s, d), acc) in sn[i * dv..(i + 1) * dv]
            .iter_mut()
            .zip(delta.iter())
            .zip(on.iter_mut())
        {
            *s += ki * *d;
            *acc += *s * qi;
        }
    }
}

widest! {
    /// [`delta_step_body`] compiled for the widest vectors the CPU has (the same
    /// bytes at every width).
    fn delta_step(u: &DeltaStep<'_>, sn: &mut [f32], on: &mut [f32]) => delta_step_body
}

/// RMSNorm of each `dim`-wide row: `y = x * (1/sqrt(mean(x²) + eps)) * w`, the sum
/// of squares accumulated in f64 in index order (as ggml does).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let dim = w.len();
    for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
        let scale = rms_scale(xr, eps);
        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

/// `1/sqrt(mean(x²) + eps)` of one row.
#[inline]
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let mut sum = 0f64;
    for &v in x {
        sum += (v as f64) * (v as f64);
    }
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// In-place L2 norm of one row: `x / sqrt(Σx² + eps)` (sum in f64, index order).
#[inline]
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let mut sum = 0f64;
    for &v in x.iter() {
        sum += (v as f64) * (v as f64);
    }
    let scale = 1.0 / ((sum as f32) + eps).sqrt();
    for v in x {
        *v *= scale;
    }
}

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `1 / (1 + exp(-x))`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(1 + exp(x))`, `x` above 20 passes through (torch's and ggml's threshold).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// One sequence's rows of [`Cpu::attention_seqs`]: q, k (after their head
/// norms, before RoPE) and v rows, its cache, the position of its first row,
/// and its output rows.
pub struct AttnRows<'a> {
    /// Query rows (`n_head * head_dim` each), rotated in place.
    pub q: &'a mut [f32],
    /// Key rows (`n_head_kv * head_dim` each), rotated in place.
    pub k: &'a mut [f32],
    /// Value rows.
    pub v: &'a [f32],
    /// The sequence's cache of this layer.
    pub cache: &'a mut KvLayer,
    /// Position of the first row.
    pub pos0: usize,
    /// Output rows.
    pub o: &'a mut [f32],
}

/// RoPE on every row's q and k at its position, and each row's key and value
/// written to the cache.
fn rope_store_rows(
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
    cache: &mut KvLayer,
    pos0: usize,
    p: &AttnParams,
) {
    let hd = p.head_dim;
    let (qw, kvw) = (p.n_head * hd, p.n_head_kv * hd);
    for r in 0..q.len() / qw {
        let pos = pos0 + r;
        rope_row(&mut q[r * qw..(r + 1) * qw], hd, &p.rope, pos);
        rope_row(&mut k[r * kvw..(r + 1) * kvw], hd, &p.rope, pos);
        cache.write(
            pos,
            kvw,
            &k[r * kvw..(r + 1) * kvw],
            &v[r * kvw..(r + 1) * kvw],
        );
    }
}

/// NeoX RoPE on the first `rope.n_rot` dims of each `head_dim`-wide head of
/// one row at position `pos`: pairs `(i, i + n_rot/2)`, angle `pos *
/// rope.inv_freq(i)` in f32, cos and sin times `rope.mscale`.
pub fn rope_row(x: &mut [f32], head_dim: usize, rope: &Rope, pos: usize) {
    let half = rope.n_rot / 2;
    for i in 0..half {
        let ang = pos as f32 * rope.inv_freq(i);
        let (sin, cos) = ang.sin_cos();
        let (sin, cos) = (sin * rope.mscale, cos * rope.mscale);
        for head in x.chunks_exact_mut(head_dim) {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}

/// Softmax of one row in place (max subtracted, exp, sum in index order, divide).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// The `k` largest entries of `p`, largest first, lower ids first among equals.
pub fn top_k(p: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Sizes of attention rows.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    /// Query heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Head dim.
    pub head_dim: usize,
    /// The rotary embedding.
    pub rope: Rope,
}

/// Sizes of gated delta-rule rows.
#[derive(Clone, Copy, Debug)]
pub struct DeltaParams {
    /// Key heads Hk.
    pub n_k_heads: usize,
    /// Value heads Hv.
    pub n_v_heads: usize,
    /// Key head dim.
    pub head_k_dim: usize,
    /// Value head dim.
    pub head_v_dim: usize,
    /// Value head n pairs with key head n % Hk (qwen35moe) rather than n / ratio.
    pub tiled: bool,
    /// Norm epsilon.
    pub eps: f32,
}

/// Causal conv + SiLU rows with state. `x` holds m rows of `channels`; `taps`
/// holds `kc` taps per channel (the last multiplies the current row); `state`
/// holds the previous `kc - 1` input rows, oldest first, and is shifted in place.
pub fn conv_rows(x: &[f32], taps: &[f32], kc: usize, state: &mut [f32], out: &mut [f32]) {
    let cd = taps.len() / kc;
    for (xin, orow) in x.chunks_exact(cd).zip(out.chunks_exact_mut(cd)) {
        for c in 0..cd {
            let t = &taps[c * kc..(c + 1) * kc];
            let mut acc = 0f32;
            for j in 0..kc - 1 {
                acc += t[j] * state[j * cd + c];
            }
            acc += t[kc - 1] * xin[c];
            orow[c] = silu(acc);
        }
        if kc > 1 {
            state.copy_within(cd.., 0);
            state[(kc - 2) * cd..].copy_from_slice(xin);
        }
    }
}

/// Router rows: softmax over one row of expert logits (in place), the top `k`
/// (lowest id first among equals), and their weights renormalized to sum to 1
/// (the sum taken in k order and clamped at 2^-14, as llama.cpp does).
pub fn route(logits: &mut [f32], k: usize) -> (Vec<usize>, Vec<f32>) {
    softmax(logits);
    let ids = top_k(logits, k);
    let mut sum = 0f32;
    for &i in &ids {
        sum += logits[i];
    }
    let sum = sum.max(6.103_515_6e-5);
    let w = ids.iter().map(|&i| logits[i] / sum).collect();
    (ids, w)
}
