//! CPU attention over the paged KV cache.
//!
//! Each query row attends over its positions `0..=pos` one cache block
//! ([`KV_BLOCK`] positions) at a time. Per block, on its own: the scores
//! (each a [`dot16`]), their maximum `m`, `p = exp(s − m)`, `l = Σp` and
//! `o = Σ p·v` with the keys in position order. The blocks are then folded
//! in position order into the row's `(M, L, O)`: `M' = max(M, m)`,
//! `L = L·e^(M−M') + l·e^(m−M')`, the same factors for `O`; the result is
//! `O / L`. The splits are the cache's blocks, fixed by position, so a row's
//! arithmetic is the same whatever other rows share the call (decode is a
//! call of one row), a block's partials do not depend on the blocks before
//! it (they may be computed in any order or in parallel and folded after),
//! and the scratch is bounded by the block size, not the context.
//!
//! A task is a few consecutive rows and query heads of one KV head: the
//! rows and heads share every key and value row read (in groups of up to
//! four (row, head) pairs), and each row touches only the blocks its
//! position reaches.

use super::{AttnParams, Cpu};
use crate::state::{KV_BLOCK, KvBlock, KvLayer};
use std::cell::RefCell;

/// A KV cache element.
pub(super) trait KvElem: Copy + Sync {
    fn f32(self) -> f32;
    /// The slice itself when the elements are f32 already.
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
}
impl KvElem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}
impl KvElem for half::f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        samesum_quant::blocks::f16_to_f32(self)
    }
    #[inline(always)]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}
impl KvElem for half::bf16 {
    /// Exact: a bf16 is an f32's upper half.
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

/// `q · k` with element `i` accumulated into lane `i % 16` (multiply, then add)
/// and the lanes reduced by a fixed tree: one order for every caller, and one the
/// compiler can keep in vector registers.
#[inline(always)]
pub(super) fn dot16(q: &[f32], k: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let n = q.len().min(k.len());
    let full = n / 16 * 16;
    for (qc, kc) in q[..full].chunks_exact(16).zip(k[..full].chunks_exact(16)) {
        for l in 0..16 {
            lanes[l] = lanes[l] + qc[l] * kc[l];
        }
    }
    for i in full..n {
        lanes[i % 16] = lanes[i % 16] + q[i] * k[i];
    }
    tree16(&lanes)
}

/// [`dot16`] of the first `g` (1 to 4) query rows of `q` with one key row
/// (the key read once); entries past `g` are unspecified.
#[inline(always)]
fn dot16_group(q: &[&[f32]; 4], g: usize, k: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if k.len().is_multiple_of(16) && avx512() {
        // SAFETY: AVX-512 F is present; every slice holds k.len() values.
        return unsafe {
            match g {
                1 => x86::dot16_g::<1>(q, k),
                2 => x86::dot16_g::<2>(q, k),
                3 => x86::dot16_g::<3>(q, k),
                _ => x86::dot16_g::<4>(q, k),
            }
        };
    }
    let mut d = [0f32; 4];
    for x in 0..g {
        d[x] = dot16(q[x], k);
    }
    d
}

/// `o_x += p_x[j] · v(j)` for `j` in `0..n`, key after key, for the `g`
/// pairs whose outputs are the consecutive `hd`-wide rows of `os`.
#[inline(always)]
fn axpy_group<'v>(
    os: &mut [f32],
    g: usize,
    hd: usize,
    ps: &[&[f32]; 4],
    n: usize,
    v: impl Fn(usize) -> &'v [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(64) && avx512() {
        for c in (0..hd).step_by(64) {
            // SAFETY: AVX-512 F is present; each of the g output rows and
            // every value row holds hd >= c + 64 values.
            unsafe {
                match g {
                    1 => x86::axpy_g::<1>(os, hd, c, ps, n, &v),
                    2 => x86::axpy_g::<2>(os, hd, c, ps, n, &v),
                    3 => x86::axpy_g::<3>(os, hd, c, ps, n, &v),
                    _ => x86::axpy_g::<4>(os, hd, c, ps, n, &v),
                }
            }
        }
        return;
    }
    for x in 0..g {
        let o = &mut os[x * hd..(x + 1) * hd];
        for j in 0..n {
            let p = ps[x][j];
            for (o, v) in o.iter_mut().zip(v(j)) {
                *o = *o + p * *v;
            }
        }
    }
}

/// Whether the AVX-512 group kernels run (the family chosen at run time).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn avx512() -> bool {
    samesum_quant::isa::Isa::best() >= samesum_quant::isa::Isa::Avx512
}

/// AVX-512 forms of the group kernels, element for element the same
/// operations as the portable code (lane `i % 16` of a dot, multiply then
/// add; one output element's terms in key order).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot16_g<const G: usize>(q: &[&[f32]; 4], k: &[f32]) -> [f32; 4] {
        unsafe {
            let mut acc = [_mm512_setzero_ps(); G];
            for c in (0..k.len()).step_by(16) {
                let kv = _mm512_loadu_ps(k.as_ptr().add(c));
                for x in 0..G {
                    let qv = _mm512_loadu_ps(q[x].as_ptr().add(c));
                    acc[x] = _mm512_add_ps(acc[x], _mm512_mul_ps(qv, kv));
                }
            }
            let mut out = [0f32; 4];
            for x in 0..G {
                let mut lanes = [0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), acc[x]);
                out[x] = super::tree16(&lanes);
            }
            out
        }
    }

    /// Columns `c .. c + 64` of `G` output rows (`os`, rows of `hd`) kept in
    /// registers over `n` keys.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy_g<'v, const G: usize>(
        os: &mut [f32],
        hd: usize,
        c: usize,
        ps: &[&[f32]; 4],
        n: usize,
        v: &impl Fn(usize) -> &'v [f32],
    ) {
        unsafe {
            let o = os.as_mut_ptr();
            let mut acc = [[_mm512_setzero_ps(); 4]; G];
            for x in 0..G {
                for q in 0..4 {
                    acc[x][q] = _mm512_loadu_ps(o.add(x * hd + c + 16 * q));
                }
            }
            for j in 0..n {
                let vr = v(j).as_ptr().add(c);
                let vv = [
                    _mm512_loadu_ps(vr),
                    _mm512_loadu_ps(vr.add(16)),
                    _mm512_loadu_ps(vr.add(32)),
                    _mm512_loadu_ps(vr.add(48)),
                ];
                for x in 0..G {
                    let p = _mm512_set1_ps(*ps[x].get_unchecked(j));
                    for q in 0..4 {
                        acc[x][q] = _mm512_add_ps(acc[x][q], _mm512_mul_ps(p, vv[q]));
                    }
                }
            }
            for x in 0..G {
                for q in 0..4 {
                    _mm512_storeu_ps(o.add(x * hd + c + 16 * q), acc[x][q]);
                }
            }
        }
    }
}

/// The 16 lanes reduced by a fixed tree.
#[inline(always)]
fn tree16(lanes: &[f32; 16]) -> f32 {
    let mut h = [0f32; 8];
    for l in 0..8 {
        h[l] = lanes[l] + lanes[l + 8];
    }
    let q4 = [h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]];
    (q4[0] + q4[2]) + (q4[1] + q4[3])
}

/// `Σ x` with element `i` in lane `i % 16`, reduced as [`dot16`].
#[inline(always)]
fn sum16(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let full = x.len() / 16 * 16;
    for c in x[..full].chunks_exact(16) {
        for l in 0..16 {
            lanes[l] = lanes[l] + c[l];
        }
    }
    for (i, v) in x[full..].iter().enumerate() {
        lanes[i] = lanes[i] + v;
    }
    tree16(&lanes)
}

/// `e^x` for the softmax, from plain multiplies and adds (no library call,
/// no fused operations), so every vector width and the scalar code compute
/// the same bits: `x = n ln 2 + r` with `n` rounded to nearest, a degree-6
/// Taylor polynomial in `|r| <= ln 2 / 2` (relative error about 1.2e-7),
/// times `2^n`. Inputs are clamped to [-87.3, 88] (below: about 1e-38).
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    let x = x.clamp(-87.3, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The rows and heads of one task and where its inputs are.
#[derive(Clone, Copy)]
struct Task<'a> {
    /// Query rows of the task, `qw` values each (all heads).
    q: &'a [f32],
    qw: usize,
    /// Position of the first row.
    pos0: usize,
    /// KV head, first query head and number of query heads.
    g: usize,
    h0: usize,
    per: usize,
    hd: usize,
    kvw: usize,
    scale: f32,
}

widest! {
    /// [`attend_body`] compiled for the widest vectors the CPU has (the same
    /// bytes at every width: its lanes are fixed by [`dot16`] and
    /// [`sum16`], not by the vector size).
    fn attend_task[T: KvElem](t: &Task<'_>, blocks: &[KvBlock<T>], sc: &mut [f32], res: &mut [f32]) => attend_body
}

/// Scratch floats [`attend_body`] needs for `pairs` (row, head) pairs.
fn scratch_len(pairs: usize, hd: usize) -> usize {
    pairs * (KV_BLOCK + 2 + hd) + 2 * KV_BLOCK * hd
}

/// One task: rows `t.q` (positions `t.pos0 ..`), heads `t.h0 .. t.h0 + t.per`
/// of KV head `t.g`, into `res` (row after row, head after head, `hd` each).
#[inline(always)]
fn attend_body<T: KvElem>(t: &Task<'_>, blocks: &[KvBlock<T>], sc: &mut [f32], res: &mut [f32]) {
    let (hd, per) = (t.hd, t.per);
    let rows = t.q.len() / t.qw;
    let pairs = rows * per;
    let (s, rest) = sc.split_at_mut(pairs * KV_BLOCK);
    let (mx, rest) = rest.split_at_mut(pairs);
    let (l, rest) = rest.split_at_mut(pairs);
    let (ob, rest) = rest.split_at_mut(pairs * hd);
    let (kf, vf) = rest.split_at_mut(KV_BLOCK * hd);
    mx.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    res.fill(0.0);
    let qrow = |pi: usize| &t.q[(pi / per) * t.qw + (t.h0 + pi % per) * hd..][..hd];
    let last = t.pos0 + rows - 1;
    for (b, blk) in blocks.iter().enumerate().take(last / KV_BLOCK + 1) {
        let base = b * KV_BLOCK;
        // Pairs from `p0` on (rows from `base - pos0`) reach this block; pair
        // `pi` uses its first `nr(pi)` keys.
        let p0 = base.saturating_sub(t.pos0) * per;
        let n = (last + 1 - base).min(KV_BLOCK);
        let nr = |pi: usize| (t.pos0 + pi / per + 1 - base).min(KV_BLOCK);
        let col = t.g * hd;
        // The block's keys and values of KV head g as f32 rows.
        let (kb, vb, stride, off): (&[f32], &[f32], usize, usize) =
            match (T::as_f32(&blk.k), T::as_f32(&blk.v)) {
                (Some(k), Some(v)) => (k, v, t.kvw, col),
                _ => {
                    for j in 0..n {
                        let src_k = &blk.k[j * t.kvw + col..][..hd];
                        let src_v = &blk.v[j * t.kvw + col..][..hd];
                        for i in 0..hd {
                            kf[j * hd + i] = src_k[i].f32();
                            vf[j * hd + i] = src_v[i].f32();
                        }
                    }
                    (&kf[..], &vf[..], hd, 0)
                }
            };
        let key = |j: usize| &kb[j * stride + off..][..hd];
        let val = |j: usize| &vb[j * stride + off..][..hd];
        // Groups of up to four pairs: their common keys together (each key
        // and value row read once for the group), then each pair's tail.
        let mut pi = p0;
        while pi < pairs {
            let g = (pairs - pi).min(4);
            let common = nr(pi);
            let qs: [&[f32]; 4] = std::array::from_fn(|x| qrow(pi + x.min(g - 1)));
            for j in 0..common {
                let d = dot16_group(&qs, g, key(j));
                for x in 0..g {
                    s[(pi + x) * KV_BLOCK + j] = d[x] * t.scale;
                }
            }
            for x in 1..g {
                for j in common..nr(pi + x) {
                    s[(pi + x) * KV_BLOCK + j] = dot16(qs[x], key(j)) * t.scale;
                }
            }
            // The block's softmax numerators and sums.
            let mut mb = [0f32; 4];
            for x in 0..g {
                let sp = &mut s[(pi + x) * KV_BLOCK..][..nr(pi + x)];
                mb[x] = sp.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                for v in sp.iter_mut() {
                    *v = exp_f32(*v - mb[x]);
                }
            }
            let os = &mut ob[pi * hd..(pi + g) * hd];
            os.fill(0.0);
            let ps: [&[f32]; 4] =
                std::array::from_fn(|x| &s[(pi + x.min(g - 1)) * KV_BLOCK..][..KV_BLOCK]);
            axpy_group(os, g, hd, &ps, common, val);
            for x in 1..g {
                let o = &mut os[x * hd..(x + 1) * hd];
                for j in common..nr(pi + x) {
                    let p = ps[x][j];
                    for (o, v) in o.iter_mut().zip(val(j)) {
                        *o = *o + p * *v;
                    }
                }
            }
            // Fold the block into the running (M, L, O), blocks in order.
            for x in 0..g {
                let q = pi + x;
                let lb = sum16(&s[q * KV_BLOCK..][..nr(q)]);
                let m = mx[q].max(mb[x]);
                let (a, c) = (exp_f32(mx[q] - m), exp_f32(mb[x] - m));
                l[q] = l[q] * a + lb * c;
                mx[q] = m;
                for (o, v) in res[q * hd..(q + 1) * hd]
                    .iter_mut()
                    .zip(&os[x * hd..(x + 1) * hd])
                {
                    *o = *o * a + *v * c;
                }
            }
            pi += g;
        }
    }
    for (o, l) in res.chunks_exact_mut(hd).zip(l.iter()) {
        for x in o {
            *x = *x / *l;
        }
    }
}

thread_local! {
    /// Per-thread scratch of the attention tasks, reused by every call.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Most (row, head) pairs a task takes: their outputs (hd floats each) stay
/// in L1/L2 while a block's values pass.
const MAX_PAIRS: usize = 32;

/// One sequence's rows of [`Cpu::attend_segments`]: its queries (after
/// RoPE; row `r` at position `pos0 + r`), its cache (holding every row's key
/// and value already) and its output rows.
pub(crate) struct AttnSeg<'a> {
    /// Query rows, `n_head * head_dim` each.
    pub q: &'a [f32],
    /// Position of the first row.
    pub pos0: usize,
    /// The sequence's KV cache of this layer.
    pub cache: &'a KvLayer,
    /// Output rows, as many as `q`.
    pub o: &'a mut [f32],
}

impl Cpu {
    /// Attention of `q` (m rows of `n_head * head_dim`, after RoPE; row `r` at
    /// position `pos0 + r`) over `cache`, which already holds every row's key
    /// and value; outputs into `o`. One segment of [`Cpu::attend_segments`]
    /// (the tests' one-sequence form).
    #[cfg(test)]
    pub(super) fn attend_rows(
        &self,
        q: &[f32],
        pos0: usize,
        p: &AttnParams,
        cache: &KvLayer,
        o: &mut [f32],
    ) {
        self.attend_segments(&mut [AttnSeg { q, pos0, cache, o }], p);
    }

    /// [`Cpu::attend_rows`] for several sequences in one parallel region:
    /// tasks of a few rows of one sequence and the query heads of one KV head,
    /// each with the arithmetic of a call of its own.
    pub(crate) fn attend_segments(&self, segs: &mut [AttnSeg<'_>], p: &AttnParams) {
        let hd = p.head_dim;
        let (qw, kvw) = (p.n_head * hd, p.n_head_kv * hd);
        let m: usize = segs.iter().map(|s| s.q.len() / qw).sum();
        if m == 0 {
            return;
        }
        let rep = p.n_head / p.n_head_kv;
        let scale = 1.0 / (hd as f32).sqrt();
        let want = 4 * self.threads();
        // Heads a task: the whole group of a KV head, or fewer when there are
        // too few (row, KV head) tasks for the threads (decode on many cores).
        let mut per = rep;
        while per > 1 && m * p.n_head / per < self.threads() && per.is_multiple_of(2) {
            per /= 2;
        }
        // Rows a task: as many as keep enough tasks and the pairs bounded.
        let tasks_per_row = p.n_head / per;
        let rows_per = (m * tasks_per_row / want).clamp(1, (MAX_PAIRS / per).max(1));
        struct Out(*mut f32);
        // SAFETY (Send/Sync): tasks write disjoint (row, head) ranges of the
        // segments' outputs, and this call holds their &mut for the whole
        // parallel region.
        unsafe impl Send for Out {}
        unsafe impl Sync for Out {}
        impl Out {
            fn at(&self, i: usize) -> *mut f32 {
                self.0.wrapping_add(i)
            }
        }
        // (segment, first row, end row, first head) of every task.
        let mut tasks = Vec::new();
        for (si, s) in segs.iter().enumerate() {
            let ms = s.q.len() / qw;
            for r0 in (0..ms).step_by(rows_per) {
                for ht in 0..tasks_per_row {
                    tasks.push((si, r0, (r0 + rows_per).min(ms), ht * per));
                }
            }
        }
        let outs: Vec<Out> = segs.iter_mut().map(|s| Out(s.o.as_mut_ptr())).collect();
        let ins: Vec<(&[f32], usize, &KvLayer)> =
            segs.iter().map(|s| (s.q, s.pos0, s.cache)).collect();
        self.pool.run(tasks.len(), &|i| {
            let (si, r0, r1, h0) = tasks[i];
            let (q, pos0, cache) = ins[si];
            let out = &outs[si];
            let task = Task {
                q: &q[r0 * qw..r1 * qw],
                qw,
                pos0: pos0 + r0,
                g: h0 / rep,
                h0,
                per,
                hd,
                kvw,
                scale,
            };
            let pairs = (r1 - r0) * per;
            SCRATCH.with(|sc| {
                let mut sc = sc.borrow_mut();
                let need = scratch_len(pairs, hd) + pairs * hd;
                if sc.len() < need {
                    sc.resize(need, 0.0);
                }
                let (sc, res) = sc.split_at_mut(scratch_len(pairs, hd));
                let res = &mut res[..pairs * hd];
                match cache {
                    KvLayer::F32 { blocks, .. } => attend_task(&task, blocks, sc, res),
                    KvLayer::F16 { blocks, .. } => attend_task(&task, blocks, sc, res),
                    KvLayer::BF16 { blocks, .. } => attend_task(&task, blocks, sc, res),
                }
                for (k, r) in (r0..r1).enumerate() {
                    let src = &res[k * per * hd..(k + 1) * per * hd];
                    // SAFETY: row r, heads h0..h0+per of this segment's
                    // output are this task's alone.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr(),
                            out.at(r * qw + h0 * hd),
                            per * hd,
                        )
                    };
                }
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{KvLayer, KvType};

    fn rnd_vec(x: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *x ^= *x << 13;
                *x ^= *x >> 7;
                *x ^= *x << 17;
                (*x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// Rows attended together (several rows and heads a task, any thread
    /// count) against each row alone, byte for byte, f32 and f16 caches,
    /// with rows crossing cache block boundaries.
    #[test]
    fn rows_attend_together_as_alone() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for (n_head, n_kv, hd) in [(4, 1, 16), (8, 2, 64), (16, 2, 256), (6, 2, 40)] {
            let p = AttnParams {
                n_head,
                n_head_kv: n_kv,
                head_dim: hd,
                rope: crate::model::Rope::new(hd, 1e4, Default::default()),
            };
            let (qw, kvw) = (n_head * hd, n_kv * hd);
            for ty in [KvType::F32, KvType::F16, KvType::BF16] {
                for (pos0, m) in [(0usize, 1usize), (0, 9), (250, 13), (511, 3), (700, 40)] {
                    let mut cache = KvLayer::new(ty, kvw);
                    let k = rnd_vec(&mut x, (pos0 + m) * kvw);
                    let v = rnd_vec(&mut x, (pos0 + m) * kvw);
                    for pos in 0..pos0 + m {
                        cache.write(pos, kvw, &k[pos * kvw..][..kvw], &v[pos * kvw..][..kvw]);
                    }
                    let q = rnd_vec(&mut x, m * qw);
                    for threads in [1, 2, 3] {
                        let cpu = Cpu::new(threads);
                        let mut all = vec![f32::NAN; m * qw];
                        cpu.attend_rows(&q, pos0, &p, &cache, &mut all);
                        for r in 0..m {
                            let mut one = vec![f32::NAN; qw];
                            cpu.attend_rows(
                                &q[r * qw..(r + 1) * qw],
                                pos0 + r,
                                &p,
                                &cache,
                                &mut one,
                            );
                            let bits =
                                |a: &[f32]| a.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&all[r * qw..(r + 1) * qw]),
                                bits(&one),
                                "{ty:?} heads {n_head}/{n_kv} hd {hd} pos0 {pos0} m {m} row {r} threads {threads}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Several sequences in one call (their own caches, positions and row
    /// counts) against each sequence alone, byte for byte.
    #[test]
    fn sequences_attend_together_as_alone() {
        let mut x = 0x1234_5678_9abc_def1u64;
        let (n_head, n_kv, hd) = (8, 2, 64);
        let p = AttnParams {
            n_head,
            n_head_kv: n_kv,
            head_dim: hd,
            rope: crate::model::Rope::new(hd, 1e4, Default::default()),
        };
        let (qw, kvw) = (n_head * hd, n_kv * hd);
        let specs = [(0usize, 3usize), (300, 1), (255, 9), (40, 0), (600, 2)];
        let caches: Vec<KvLayer> = specs
            .iter()
            .map(|&(pos0, m)| {
                let mut c = KvLayer::new(KvType::F16, kvw);
                let k = rnd_vec(&mut x, (pos0 + m) * kvw);
                let v = rnd_vec(&mut x, (pos0 + m) * kvw);
                for pos in 0..pos0 + m {
                    c.write(pos, kvw, &k[pos * kvw..][..kvw], &v[pos * kvw..][..kvw]);
                }
                c
            })
            .collect();
        let qs: Vec<Vec<f32>> = specs
            .iter()
            .map(|&(_, m)| rnd_vec(&mut x, m * qw))
            .collect();
        for threads in [1, 2, 3] {
            let cpu = Cpu::new(threads);
            let mut outs: Vec<Vec<f32>> =
                specs.iter().map(|&(_, m)| vec![f32::NAN; m * qw]).collect();
            let mut segs: Vec<AttnSeg<'_>> = specs
                .iter()
                .zip(&qs)
                .zip(&caches)
                .zip(outs.iter_mut())
                .map(|(((&(pos0, _), q), cache), o)| AttnSeg { q, pos0, cache, o })
                .collect();
            cpu.attend_segments(&mut segs, &p);
            drop(segs);
            for (i, &(pos0, m)) in specs.iter().enumerate() {
                let mut alone = vec![f32::NAN; m * qw];
                cpu.attend_rows(&qs[i], pos0, &p, &caches[i], &mut alone);
                let bits = |a: &[f32]| a.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&outs[i]),
                    bits(&alone),
                    "sequence {i} threads {threads}"
                );
            }
        }
    }

    /// The blocked softmax against a plain two-pass softmax in f64: close
    /// (it is another rounding of the same function), over several blocks.
    #[test]
    fn blocked_attention_matches_a_plain_softmax() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let (n_head, n_kv, hd) = (4, 2, 32);
        let p = AttnParams {
            n_head,
            n_head_kv: n_kv,
            head_dim: hd,
            rope: crate::model::Rope::new(hd, 1e4, Default::default()),
        };
        let (qw, kvw) = (n_head * hd, n_kv * hd);
        let npos = 3 * KV_BLOCK + 17;
        let mut cache = KvLayer::new(KvType::F32, kvw);
        let k = rnd_vec(&mut x, npos * kvw);
        let v = rnd_vec(&mut x, npos * kvw);
        for pos in 0..npos {
            cache.write(pos, kvw, &k[pos * kvw..][..kvw], &v[pos * kvw..][..kvw]);
        }
        let q = rnd_vec(&mut x, qw);
        let mut o = vec![0f32; qw];
        Cpu::new(2).attend_rows(&q, npos - 1, &p, &cache, &mut o);
        let scale = 1.0 / (hd as f64).sqrt();
        for h in 0..n_head {
            let g = h / (n_head / n_kv);
            let qh = &q[h * hd..(h + 1) * hd];
            let s: Vec<f64> = (0..npos)
                .map(|j| {
                    let kr = &k[j * kvw + g * hd..][..hd];
                    qh.iter()
                        .zip(kr)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            for i in 0..hd {
                let want: f64 = (0..npos)
                    .map(|j| e[j] * v[j * kvw + g * hd + i] as f64)
                    .sum::<f64>()
                    / sum;
                let got = o[h * hd + i] as f64;
                assert!(
                    (got - want).abs() < 2e-5,
                    "head {h} col {i}: {got} vs {want}"
                );
            }
        }
    }

    /// The softmax exponential against the library's within a few ulps, and
    /// its clamped ends.
    #[test]
    fn exp_is_close_to_the_library() {
        let mut worst = 0f64;
        for i in 0..200_000 {
            let x = -87.0 + 87.0 * i as f32 / 200_000.0;
            let (got, want) = (exp_f32(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 4e-7, "relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NEG_INFINITY) < 1e-37);
        assert!(exp_f32(-1000.0) >= 0.0);
    }
}
