//! The CPU backend: row kernels over f32 slices.
//!
//! Every op computes each output row from that row's inputs only (plus, for the
//! sequential ops, the state its own sequence has written), with one fixed order
//! of arithmetic; threads split output columns or heads, never a reduction, so
//! results are the same for any number of rows in the call and any thread count.

use crate::model::Matrix;
use crate::pool::Pool;
use samesum_quant::dot::{self, ActRow};

/// The CPU backend: a thread pool.
pub struct Cpu {
    pool: Pool,
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

/// Fewest output columns per parallel task in a matmul.
const MIN_COLS_PER_TASK: usize = 16;

impl Cpu {
    /// A backend running on `threads` threads (0: all cores).
    pub fn new(threads: usize) -> Cpu {
        Cpu {
            pool: Pool::new(threads),
        }
    }

    /// Run `f` (kept for call sites that group work; the pool needs no setup).
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
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
        // Quantize every activation row once.
        let acts: Vec<Vec<ActRow>> = jobs
            .iter()
            .map(|j| {
                j.x.chunks_exact(j.w.cols)
                    .map(|xr| {
                        ActRow::quantize(j.w.ty, xr)
                            .expect("bound matrices have a dot kernel and whole blocks")
                    })
                    .collect()
            })
            .collect();
        let total: usize = jobs.iter().map(|j| j.y.len()).sum();
        // A few tasks per thread: enough to balance, few enough that task overhead
        // stays small next to the rows' bytes. The split never touches a sum.
        let per = total.div_ceil(4 * self.threads()).max(MIN_COLS_PER_TASK);
        let mut tasks: Vec<(&Matrix, &[u8], &ActRow, &mut [f32])> = Vec::new();
        for (j, act) in jobs.iter_mut().zip(&acts) {
            let bytes = j.w.mat_bytes(file, j.mat);
            let rb = j.w.row_bytes;
            for (yr, a) in j.y.chunks_exact_mut(j.w.rows).zip(act) {
                for (c, out) in yr.chunks_mut(per).enumerate() {
                    let start = c * per * rb;
                    tasks.push((j.w, &bytes[start..start + out.len() * rb], a, out));
                }
            }
        }
        let run = |(w, rows, act, out): &mut (&Matrix, &[u8], &ActRow, &mut [f32])| {
            dot::dot_rows(w.ty, rows, act, out).expect("checked at bind");
        };
        self.pool.for_each_mut(&mut tasks, |_, t| run(t));
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

/// NeoX RoPE on the first `n_rot` dims of each `head_dim`-wide head of one row at
/// position `pos`: pairs `(i, i + n_rot/2)`; angles `pos * theta^(-2i/n_rot)` in f32.
pub fn rope_row(x: &mut [f32], head_dim: usize, n_rot: usize, theta: f32, pos: usize) {
    let half = n_rot / 2;
    for i in 0..half {
        let inv_freq = 1.0 / theta.powf((2 * i) as f32 / n_rot as f32);
        let ang = pos as f32 * inv_freq;
        let (sin, cos) = ang.sin_cos();
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
