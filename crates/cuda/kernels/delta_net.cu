// Causal conv + SiLU with state, one thread per (row, channel): the conv
// reads inputs only (the last kc-1 input rows of earlier calls live in
// `state`, oldest first), so every row is independent: acc is the fma chain
// over taps 0..kc-1 in order against inputs r-kc+1..r. `conv_shift` then moves
// the last kc-1 inputs into the state (a separate launch, after the reads).
#define MAX_KC 8
extern "C" __global__ void conv_rows(const float* x, const float* taps, const float* state, float* out, int m, int cd,
                                     int kc) {
    pdl_wait();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)m * cd) return;
    int r = (int)(i / cd), c = (int)(i % cd);
    float acc = 0.0f;
    for (int j = 0; j < kc; j++) {
        int q = r - (kc - 1) + j;
        float xv = q >= 0 ? x[(i64)q * cd + c] : state[(i64)(r + j) * cd + c];
        acc = __fmaf_rn(taps[(i64)c * kc + j], xv, acc);
    }
    out[i] = silu(acc);
}

// conv_rows with a thread per channel and CONV_TR consecutive rows (calls
// of more than 16 rows with kc = 4, the models' conv): the rows' inputs are
// loaded together, each once (conv_rows loads each input kc times, one
// dependent load after another), and a row's taps are slid along in
// registers. Each output is conv_rows's: the same kc fmas from 0 in tap
// order, then silu, so the same bytes.
#define CONV_TR 16
extern "C" __global__ void __launch_bounds__(128)
    conv_tile(const float* x, const float* taps, const float* state, float* out, int m, int cd) {
    pdl_wait();
    constexpr int KC = 4;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    int r0 = blockIdx.y * CONV_TR;
    float t[KC], w[KC - 1], xs[CONV_TR];
#pragma unroll
    for (int j = 0; j < KC; j++) t[j] = taps[(i64)c * KC + j];
    // Rows r0 - 3 .. r0 - 1: from this call's input, or the state before it
    // (row q < 0 is state row q + KC - 1, as in conv_rows).
#pragma unroll
    for (int j = 0; j < KC - 1; j++) {
        int q = r0 - (KC - 1) + j;
        w[j] = q >= 0 ? x[(i64)q * cd + c] : state[(i64)(q + KC - 1) * cd + c];
    }
#pragma unroll
    for (int i = 0; i < CONV_TR; i++) xs[i] = r0 + i < m ? x[(i64)(r0 + i) * cd + c] : 0.0f;
#pragma unroll
    for (int i = 0; i < CONV_TR; i++) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < KC - 1; j++) acc = __fmaf_rn(t[j], w[j], acc);
        acc = __fmaf_rn(t[KC - 1], xs[i], acc);
        if (r0 + i < m) out[(i64)(r0 + i) * cd + c] = silu(acc);
#pragma unroll
        for (int j = 0; j < KC - 2; j++) w[j] = w[j + 1];
        w[KC - 2] = xs[i];
    }
}

// Decode-sized calls: conv_rows then conv_shift for one channel per thread
// (every row's output from the old state first, then the shift), one launch;
// each output and state value as the two kernels compute it. Returns row
// m - 1's output.
__device__ __forceinline__ float conv_channel(const float* x, const float* taps, float* state, float* out, int m,
                                              int cd, int kc, int c) {
    float last = 0.0f;
    for (int r = 0; r < m; r++) {
        float acc = 0.0f;
        for (int j = 0; j < kc; j++) {
            int q = r - (kc - 1) + j;
            float xv = q >= 0 ? x[(i64)q * cd + c] : state[(i64)(r + j) * cd + c];
            acc = __fmaf_rn(taps[(i64)c * kc + j], xv, acc);
        }
        last = silu(acc);
        out[(i64)r * cd + c] = last;
    }
    for (int j = 0; j < kc - 1; j++) {
        int q = m - (kc - 1) + j;
        state[(i64)j * cd + c] = q >= 0 ? x[(i64)q * cd + c] : state[(i64)(j + m) * cd + c];
    }
    return last;
}

extern "C" __global__ void conv_small(const float* x, const float* taps, float* state, float* out, int m, int cd,
                                      int kc) {
    pdl_wait();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    conv_channel(x, taps, state, out, m, cd, kc, c);
}

extern "C" __global__ void conv_shift(const float* x, float* state, int m, int cd, int kc) {
    pdl_wait();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    // Ascending j reads state[j + m] before anything overwrites it.
    for (int j = 0; j < kc - 1; j++) {
        int q = m - (kc - 1) + j;
        state[(i64)j * cd + c] = q >= 0 ? x[(i64)q * cd + c] : state[(i64)(j + m) * cd + c];
    }
}

// A head's f64 sum of squares in index order, by lane 0, from a copy of the
// head in shared memory (read four values per load; the adds stay in order).
// `v` is 16-byte aligned; returns the sum to every lane. Decode-sized calls
// (conv_l2_one, gated_norm_q8k_lane0) take it: there sumsq_in_order's lane
// squares measured slower (qwen35moe tg128 302.5 against 315-319 tok/s on
// an H200).
__device__ __forceinline__ double sumsq_lane0(const float* v, int n, int lane) {
    double s = 0.0;
    if (lane == 0) {
        int i = 0;
        for (; i + 4 <= n; i += 4) {
            float4 q = *(const float4*)(v + i);
            s += (double)q.x * (double)q.x;
            s += (double)q.y * (double)q.y;
            s += (double)q.z * (double)q.z;
            s += (double)q.w * (double)q.w;
        }
        for (; i < n; i++) s += (double)v[i] * (double)v[i];
    }
    return __shfl_sync(0xffffffffu, s, 0);
}

// The same sum (n <= 256) with the squares taken by every lane: lane l
// squares values l, l + 32, ... into `sq` (the warp's own 256 doubles of
// shared memory; a float's square is exact in f64, so it is the product
// sumsq_lane0 adds), then lane 0 adds them in index order, as sumsq_lane0
// does: the same sum. sumsq_lane0's lane 0 converted all n values itself,
// and the f32-to-f64 conversion issues at a quarter of the f64 add's rate:
// the bound of the warp-a-head norms (~4 us of conversions per 1,000
// heads an SM).
__device__ __forceinline__ double sumsq_in_order(const float* v, int n, int lane, double* sq) {
    for (int i = lane; i < n; i += 32) {
        double d = (double)v[i];
        sq[i] = d * d;
    }
    __syncwarp();
    double s = 0.0;
    if (lane == 0) {
        int i = 0;
#pragma unroll 4
        for (; i + 2 <= n; i += 2) {
            double2 p = *(const double2*)(sq + i);
            s += p.x;
            s += p.y;
        }
        for (; i < n; i++) s += sq[i];
    }
    s = __shfl_sync(0xffffffffu, s, 0);
    __syncwarp();  // every read of sq is done before the warp reuses it
    return s;
}

// L2 norm of each dk-wide head of the q and k parts (2*hk heads) of m conv rows
// into qk (m rows of 2*kd): the sum of squares in f64, index order.
// One warp per (row, head): the head's values are read once, coalesced, into
// shared memory (head dims up to 256; larger ones read global memory); lane 0
// sums the squares in f64 in index order (as the CPU does), then every lane
// scales its values.
#define L2_WARPS 4
extern "C" __global__ void __launch_bounds__(L2_WARPS * 32)
    l2norm_qk(const float* conv, float* qk, int m, int cd, int hk, int dk, float eps) {
    pdl_wait();
    __shared__ __align__(16) float stage[L2_WARPS][256];
    __shared__ __align__(16) double sqs[L2_WARPS][256];
    int t = blockIdx.x * L2_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (t >= m * 2 * hk) return;
    int r = t / (2 * hk), h = t % (2 * hk);
    const float* src = conv + (i64)r * cd + h * dk;
    float* dst = qk + (i64)r * 2 * hk * dk + h * dk;
    const float* v = src;
    if (dk <= 256) {
        float* sv = stage[threadIdx.x / 32];
        for (int i = lane; i < dk; i += 32) sv[i] = src[i];
        __syncwarp();
        v = sv;
    }
    double s;
    if (dk <= 256) {
        s = sumsq_in_order(v, dk, lane, sqs[threadIdx.x / 32]);
    } else {
        s = 0.0;
        if (lane == 0)
            for (int i = 0; i < dk; i++) s += (double)v[i] * (double)v[i];
        s = __shfl_sync(0xffffffffu, s, 0);
    }
    float scale = 1.0f / sqrtf((float)s + eps);
    for (int i = lane; i < dk; i += 32) dst[i] = v[i] * scale;
}

// The lane-a-head kernels (calls of more than 16 rows): heads a block,
// loads issued together a thread.
#define HS_HEADS 32
#define HS_BATCH 8

// One lane's f64 sum of the squares of n values in index order: the sum
// sumsq_in_order's lane 0 and sumsq_lane0 make (a float's square is exact
// in f64, so fma and a product then an add round alike), its loads issued
// eight ahead of the chain.
__device__ __forceinline__ double sumsq_one_lane(const float* v, int n) {
    double s = 0.0;
#pragma unroll 8
    for (int i = 0; i < n; i++) {
        double d = (double)v[i];
        s += d * d;
    }
    return s;
}

// l2norm_qk with a lane a head (dk <= 256): a block of 128 threads takes 32 of
// the m * 2hk heads, stages them (dynamic shared memory, 32 rows of dk + 1
// floats; a thread's loads of its column in the 32 heads issued together), and
// lane l of warp 0 adds head l's squares in f64 in index order, as
// sumsq_in_order's lane 0 adds one head's: the same sums, then l2norm_qk's
// scale and products.
extern "C" __global__ void __launch_bounds__(128, 6)
    l2norm_qk_h(const float* conv, float* qk, int m, int cd, int hk, int dk, float eps) {
    pdl_wait();
    extern __shared__ __align__(16) float hs_stage[];
    __shared__ float scales[HS_HEADS];
    const int t0 = blockIdx.x * HS_HEADS, tid = threadIdx.x, ld = dk + 1, hh2 = 2 * hk;
    const int nh = min(HS_HEADS, m * hh2 - t0);
    // Head t0 + h's row and place in it, stepped along (no division a head).
    const int r0 = t0 / hh2, p0 = t0 % hh2;
    for (int c = tid; c < dk; c += 128) {
        int r = r0, p = p0;
#pragma unroll 1
        for (int h0 = 0; h0 < HS_HEADS; h0 += HS_BATCH) {
            float v[HS_BATCH];
#pragma unroll
            for (int h = 0; h < HS_BATCH; h++) {
                v[h] = h0 + h < nh ? conv[(i64)r * cd + p * dk + c] : 0.0f;
                if (++p == hh2) p = 0, r++;
            }
#pragma unroll
            for (int h = 0; h < HS_BATCH; h++) hs_stage[(h0 + h) * ld + c] = v[h];
        }
    }
    __syncthreads();
    if (tid < nh) scales[tid] = 1.0f / sqrtf((float)sumsq_one_lane(hs_stage + tid * ld, dk) + eps);
    __syncthreads();
    for (int c = tid; c < dk; c += 128) {
        int r = r0, p = p0;
#pragma unroll 1
        for (int h0 = 0; h0 < HS_HEADS; h0 += HS_BATCH) {
#pragma unroll
            for (int h = h0; h < h0 + HS_BATCH; h++) {
                if (h < nh) qk[(i64)r * hh2 * dk + p * dk + c] = hs_stage[h * ld + c] * scales[h];
                if (++p == hh2) p = 0, r++;
            }
        }
    }
}

// One decode row's conv, state shift and q/k head norms in one launch
// (key head dims up to 256), blocks of 128 threads: block h < 2 hk
// takes q/k head h, a thread a channel (conv_channel, as conv_small), the
// head's outputs staged in shared memory and normed as l2norm_qk does
// (sumsq_lane0 by warp 0, then the scale); the other blocks take the
// value channels, a thread each.
__device__ __forceinline__ void conv_l2_one_k(const float* x, const float* taps, float* state, float* out,
                                              float* qk, int cd, int kc, int hk, int dk, float eps) {
    __shared__ __align__(16) float sv[256];
    __shared__ float scale_s;
    int h = blockIdx.x, t = threadIdx.x;
    if (h < 2 * hk) {
        for (int i = t; i < dk; i += 128) sv[i] = conv_channel(x, taps, state, out, 1, cd, kc, h * dk + i);
        __syncthreads();
        if (t < 32) {
            // Lane 0's squares (one row: see sumsq_lane0).
            double s = sumsq_lane0(sv, dk, t);
            if (t == 0) scale_s = 1.0f / sqrtf((float)s + eps);
        }
        __syncthreads();
        float scale = scale_s;
        float* dst = qk + h * dk;
        for (int i = t; i < dk; i += 128) dst[i] = sv[i] * scale;
        return;
    }
    int c = 2 * hk * dk + (h - 2 * hk) * 128 + t;
    if (c < cd) conv_channel(x, taps, state, out, 1, cd, kc, c);
}

extern "C" __global__ void __launch_bounds__(128)
    conv_l2_one(const float* x, const float* taps, float* state, float* out, float* qk, int cd, int kc, int hk,
                int dk, float eps) {
    pdl_wait();
    conv_l2_one_k(x, taps, state, out, qk, cd, kc, hk, dk, eps);
}

// conv_l2_one for a decode row each of several sequences (row blockIdx.y,
// its conv state at tab[row]): each row's block runs the one-row kernel's
// code on that row's inputs and state, so its bytes are its own call's.
extern "C" __global__ void __launch_bounds__(128)
    conv_l2_one_seqs(const float* x, const float* taps, const u64* tab, float* out, float* qk, int cd, int kc,
                     int hk, int dk, float eps) {
    pdl_wait();
    int r = blockIdx.y;
    conv_l2_one_k(x + (i64)r * cd, taps, reinterpret_cast<float*>(tab[r]), out + (i64)r * cd,
                  qk + (i64)r * 2 * hk * dk, cd, kc, hk, dk, eps);
}

// Gated delta rule: block (n, c) holds columns 32c..32c+31 of value head n's
// state; thread j owns column j (S[i][j], i over dk) and walks the rows in
// order, as the CPU does: decay, kv_j = sum_i S[i][j] k_i,
// delta_j = (v_j - kv_j) beta, S[i][j] += k_i delta_j,
// o_j = sum_i S[i][j] q_i / sqrt(dk). The columns stay in shared memory for
// all rows of the call (loaded once, stored once); each element sees the same
// operations in the same order as a one-row call. The gated RMSNorm over the
// head follows in `gated_norm`.
#define DCOLS 32
#define DR 16
// Dynamic shared memory: S (dk * DCOLS), then per staged row its k and
// q * q_scale (DR * 2 * dk), then beta and decay per staged row (2 * DR).
extern "C" __global__ void __launch_bounds__(DCOLS)
    delta_rows(const float* qk, const float* conv, const float* b, const float* a, const float* dt_bias,
               const float* ssm_a, float* state, float* o, int m, int hk, int hv, int dk, int dv, int tiled) {
    pdl_wait();
    extern __shared__ float sh[];
    float* S = sh;
    float* kq = sh + dk * DCOLS;
    float* bd = kq + DR * 2 * dk;
    int n = blockIdx.x, t = threadIdx.x;
    int j = blockIdx.y * DCOLS + t;
    bool live = j < dv;
    int kd = hk * dk, vd = hv * dv, cd = 2 * kd + vd;
    int ratio = hv / hk;
    int kh = tiled ? n % hk : n / ratio;
    float q_scale = 1.0f / sqrtf((float)dk);
    float* G = state + (i64)n * dk * dv;
    if (live)
        for (int i = 0; i < dk; i++) S[i * DCOLS + t] = G[(i64)i * dv + j];
    for (int r0 = 0; r0 < m; r0 += DR) {
        int cnt = min(DR, m - r0);
        // Stage the next rows: all their loads in flight at once.
        __syncwarp();
        for (int idx = t; idx < cnt * dk; idx += DCOLS) {
            int rr = idx / dk, i = idx % dk;
            const float* row = qk + (i64)(r0 + rr) * 2 * kd;
            kq[rr * 2 * dk + i] = row[kd + kh * dk + i];
            kq[rr * 2 * dk + dk + i] = row[kh * dk + i] * q_scale;
        }
        if (t < cnt) {
            int r = r0 + t;
            bd[t] = sigmoid(b[(i64)r * hv + n]);
            float gl = softplus(a[(i64)r * hv + n] + dt_bias[n]) * ssm_a[n];
            bd[DR + t] = expf(gl);
        }
        float vv[DR];
#pragma unroll
        for (int rr = 0; rr < DR; rr++)
            vv[rr] = (live && rr < cnt) ? conv[(i64)(r0 + rr) * cd + 2 * kd + n * dv + j] : 0.0f;
        __syncwarp();
#pragma unroll
        for (int rr = 0; rr < DR; rr++) {
            if (rr >= cnt || !live) continue;
            const float* kr = kq + rr * 2 * dk;
            float beta = bd[rr], decay = bd[DR + rr];
            float kv = 0.0f;
#pragma unroll 8
            for (int i = 0; i < dk; i++) {
                float sv = S[i * DCOLS + t] * decay;
                S[i * DCOLS + t] = sv;
                kv = kv + sv * kr[i];
            }
            float delta = (vv[rr] - kv) * beta;
            float acc = 0.0f;
#pragma unroll 8
            for (int i = 0; i < dk; i++) {
                float sv = S[i * DCOLS + t] + kr[i] * delta;
                S[i * DCOLS + t] = sv;
                acc = acc + sv * kr[dk + i];
            }
            o[(i64)(r0 + rr) * vd + n * dv + j] = acc;
        }
    }
    if (live)
        for (int i = 0; i < dk; i++) G[(i64)i * dv + j] = S[i * DCOLS + t];
}

// Gated delta rule at key head dims 16 and 32 (delta_cols_async below takes 64,
// 128 and 256, delta_rows the others): the same recurrence, with each state
// column split over 8 lanes so that a row's two dot products are eight short
// chains plus a fixed butterfly instead of one chain of dk. Block (n, c):
// columns 16c..16c+15 of value head n, 8 lanes per column; lane p keeps
// S[p + 8q][j] (q < dk/8) in registers for all rows of the call. Per row:
// S *= decay; kv = sum over lanes (fixed xor 4, 2, 1 butterfly) of each
// lane's fma chain in q order; delta = (v - kv) * beta; S += k * delta; o
// likewise. Every operation is an explicit intrinsic, the order depends only
// on dk: a one-row call computes the same bytes.
#define DC_COLS 16
#define DC_PARTS 8
#define DC_ROWS 16
#define DC_BATCH 12

// A state column's dot product from its 8 lanes' partials: the fixed xor 4,
// 2, 1 butterfly (every delta-rule kernel).
__device__ __forceinline__ float dc_lanes_sum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 4));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return v;
}

template <int DK>
__device__ void delta_cols(const float* qk, const float* conv, const float* b, const float* a,
                           const float* dt_bias, const float* ssm_a, float* state, float* o, int m,
                           int hk, int hv, int dv, int tiled) {
    const int SP = DK / DC_PARTS, ROWF = 2 * DK + DC_COLS;
    __shared__ __align__(16) float st[DC_ROWS * ROWF];
    __shared__ float sb[2 * DC_ROWS];
    int n = blockIdx.x, tid = threadIdx.x;
    int c = tid / DC_PARTS, p = tid % DC_PARTS;
    int j = blockIdx.y * DC_COLS + c;
    bool live = j < dv;
    int kd = hk * DK, vd = hv * dv, cd = 2 * kd + vd;
    int kh = tiled ? n % hk : n / (hv / hk);
    float q_scale = 1.0f / sqrtf((float)DK);
    float* G = state + (i64)n * DK * dv;
    float S[SP];
#pragma unroll
    for (int q = 0; q < SP; q++) S[q] = live ? G[(i64)(p + DC_PARTS * q) * dv + j] : 0.0f;
    for (int r0 = 0; r0 < m; r0 += DC_ROWS) {
        int cnt = min(DC_ROWS, m - r0);
        __syncthreads();
        // The staging loads go out DC_BATCH at a time before any is
        // stored (a plain loop waited on each load in turn: the kernel's
        // bound at prefill sizes). Values and places are unchanged.
        for (int base = 0; base < cnt * ROWF; base += DC_BATCH * DC_COLS * DC_PARTS) {
            float v[DC_BATCH];
#pragma unroll
            for (int u = 0; u < DC_BATCH; u++) {
                int idx = base + u * DC_COLS * DC_PARTS + tid;
                v[u] = 0.0f;
                if (idx < cnt * ROWF) {
                    int rr = idx / ROWF, e = idx % ROWF;
                    const float* row = qk + (i64)(r0 + rr) * 2 * kd;
                    if (e < DK) {
                        v[u] = row[kd + kh * DK + e];
                    } else if (e < 2 * DK) {
                        v[u] = row[kh * DK + e - DK] * q_scale;
                    } else {
                        int jj = blockIdx.y * DC_COLS + e - 2 * DK;
                        v[u] = jj < dv ? conv[(i64)(r0 + rr) * cd + 2 * kd + n * dv + jj] : 0.0f;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < DC_BATCH; u++) {
                int idx = base + u * DC_COLS * DC_PARTS + tid;
                if (idx < cnt * ROWF) st[idx] = v[u];
            }
        }
        if (tid < cnt) {
            int r = r0 + tid;
            sb[tid] = sigmoid(b[(i64)r * hv + n]);
            float gl = softplus(a[(i64)r * hv + n] + dt_bias[n]) * ssm_a[n];
            sb[DC_ROWS + tid] = expf(gl);
        }
        __syncthreads();
        for (int rr = 0; rr < cnt; rr++) {
            const float* kr = st + rr * ROWF;
            float beta = sb[rr], decay = sb[DC_ROWS + rr];
            float kv = 0.0f;
#pragma unroll
            for (int q = 0; q < SP; q++) {
                S[q] = __fmul_rn(S[q], decay);
                kv = __fmaf_rn(S[q], kr[p + DC_PARTS * q], kv);
            }
            kv = dc_lanes_sum(kv);
            float delta = __fmul_rn(__fsub_rn(kr[2 * DK + c], kv), beta);
            float acc = 0.0f;
#pragma unroll
            for (int q = 0; q < SP; q++) {
                S[q] = __fmaf_rn(kr[p + DC_PARTS * q], delta, S[q]);
                acc = __fmaf_rn(S[q], kr[DK + p + DC_PARTS * q], acc);
            }
            acc = dc_lanes_sum(acc);
            if (live && p == 0) o[(i64)(r0 + rr) * vd + n * dv + j] = acc;
        }
    }
    if (live)
#pragma unroll
        for (int q = 0; q < SP; q++) G[(i64)(p + DC_PARTS * q) * dv + j] = S[q];
}

#define DELTA_COLS(name, DK)                                                                         \
    extern "C" __global__ void __launch_bounds__(DC_COLS * DC_PARTS, 4)                               \
        name(const float* qk, const float* conv, const float* b, const float* a, const float* dt_bias, \
             const float* ssm_a, float* state, float* o, int m, int hk, int hv, int dv, int tiled) { pdl_wait(); \
        delta_cols<DK>(qk, conv, b, a, dt_bias, ssm_a, state, o, m, hk, hv, dv, tiled);              \
    }

DELTA_COLS(delta_cols_16, 16)
DELTA_COLS(delta_cols_32, 32)

// The same rule in the same order (delta_cols: each value, product and sum
// as there), with the staging moved off the rows' path. Nsight Compute had
// delta_cols at dk 128 at 1.9 warps a scheduler (its 256 blocks are the whole
// parallelism the order allows) with 41% of its stall cycles waiting on the
// staging's global loads. Here the next group of rows comes into shared
// memory by cp.async (and its b and a into registers) while this group's
// rows run, two buffers in turn. k and q are staged transposed: lane p's
// slots q = 0..SP-1 (elements p + 8q) sit together, PS = SP + 4 floats apart
// (conflict-free float4 reads), so a row reads its k and q with SP/2 vector
// loads instead of 2 SP scalar ones. Thread t copies elements t, t + 128,
// ... of each row's k and of its q, and scales its own q's in shared memory
// once they land (the same multiply as delta_cols). RG rows a group.
//
// PIPE = 0 (head dim 256, 8-row groups): each row's decay, k dot, update and
// output dot in turn, as delta_cols.
//
// PIPE = 1 (head dims 64 and 128, calls of fewer than 16 rows): after row r's state update, one loop over the state values runs
// row r's output dot beside row r + 1's decay and k dot (two independent
// chains a thread), then both butterflies. Every value goes through the
// same operations in the same order as PIPE = 0: the same bytes. (Not at
// head dim 256: a thread's four 32-value arrays would spill.)
//
// PIPE = 2 (calls of 16 rows or more): a full group's rows as PIPE = 1's,
// unrolled into straight-line code with the outputs through shared memory,
// so its loads issue ahead of the chain (H200, qwen35moe pp4096: 45.5 ->
// 37.9 ms). A partial group runs PIPE = 1's loop.
template <int DK>
__device__ __forceinline__ void dc_load4(const float* src, float* dst) {
    const float4* v = reinterpret_cast<const float4*>(src);
#pragma unroll
    for (int u = 0; u < DK / DC_PARTS / 4; u++) {
        float4 t = v[u];
        dst[4 * u] = t.x, dst[4 * u + 1] = t.y, dst[4 * u + 2] = t.z, dst[4 * u + 3] = t.w;
    }
}

// The pipelined kernels' steps (delta_cols_async, PIPE 1 and 2), shared by the
// row loop and the unrolled groups so both run the same operations.
//
// A group's first row: S *= decay, then the k dot over the 8 lanes.
template <int SP>
__device__ __forceinline__ float dc_decay_kdot(float (&S)[SP], const float (&kk)[SP], float decay) {
    float kv = 0.0f;
#pragma unroll
    for (int q = 0; q < SP; q++) {
        S[q] = __fmul_rn(S[q], decay);
        kv = __fmaf_rn(S[q], kk[q], kv);
    }
    return dc_lanes_sum(kv);
}

// A row's update and output dot beside the next row's decay and k dot (two
// chains a thread; kk becomes the next row's k). The lanes' partials are
// left in acc and kv2 for the caller's butterflies.
template <int SP>
__device__ __forceinline__ void dc_step_next(float (&S)[SP], float (&kk)[SP], const float (&qq)[SP],
                                             const float (&kn)[SP], float delta, float dn, float& acc,
                                             float& kv2) {
#pragma unroll
    for (int q = 0; q < SP; q++) {
        S[q] = __fmaf_rn(kk[q], delta, S[q]);
        acc = __fmaf_rn(S[q], qq[q], acc);
        S[q] = __fmul_rn(S[q], dn);
        kv2 = __fmaf_rn(S[q], kn[q], kv2);
        kk[q] = kn[q];
    }
}

// dc_lanes_sum of two values, their shuffles interleaved.
__device__ __forceinline__ void dc_lanes_sum2(float& a, float& b) {
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 4));
    b = __fadd_rn(b, __shfl_xor_sync(0xffffffffu, b, 4));
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 2));
    b = __fadd_rn(b, __shfl_xor_sync(0xffffffffu, b, 2));
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 1));
    b = __fadd_rn(b, __shfl_xor_sync(0xffffffffu, b, 1));
}

// A group's last row: its update and output dot, summed over the lanes.
template <int SP>
__device__ __forceinline__ float dc_step_last(float (&S)[SP], const float (&kk)[SP], const float (&qq)[SP],
                                              float delta) {
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < SP; q++) {
        S[q] = __fmaf_rn(kk[q], delta, S[q]);
        acc = __fmaf_rn(S[q], qq[q], acc);
    }
    return dc_lanes_sum(acc);
}

template <int DK, int RG, int PIPE>
__device__ void delta_cols_async(const float* qk, const float* conv, const float* b, const float* a,
                                 const float* dt_bias, const float* ssm_a, float* state, float* o,
                                 int m, int hk, int hv, int dv, int tiled) {
    constexpr int SP = DK / DC_PARTS, PS = SP + 4, SEC = DC_PARTS * PS;
    constexpr int ROWF = 2 * SEC + DC_COLS, NT = DC_COLS * DC_PARTS;
    // Staging buffer i is st(i): indexing st2 in place compiles to other
    // register choices (the same results, other SASS).
    __shared__ __align__(16) float st2[2][RG * ROWF];
    auto st = [&](int i) -> float* { return st2[i]; };
    __shared__ float sb[2][2 * RG];
    int n = blockIdx.x, tid = threadIdx.x;
    int c = tid / DC_PARTS, p = tid % DC_PARTS;
    int j = blockIdx.y * DC_COLS + c;
    bool live = j < dv;
    int kd = hk * DK, vd = hv * dv, cd = 2 * kd + vd;
    int kh = tiled ? n % hk : n / (hv / hk);
    float q_scale = 1.0f / sqrtf((float)DK);
    float* G = state + (i64)n * DK * dv;
    float S[SP];
#pragma unroll
    for (int q = 0; q < SP; q++) S[q] = live ? G[(i64)(p + DC_PARTS * q) * dv + j] : 0.0f;
    // Thread t's elements of a row's k and q: f = t + u NT (u < FU, a
    // compile-time count, so no loop is left when NT divides DK), at their
    // transposed places.
    constexpr int FU = (DK + NT - 1) / NT;
    int at[FU];
#pragma unroll
    for (int u = 0; u < FU; u++) {
        int f = tid + u * NT;
        at[u] = (f % DC_PARTS) * PS + f / DC_PARTS;
    }
    int jj = blockIdx.y * DC_COLS + tid;
    // Group r0's k, q and v into buffer bi (one commit group), and its rows'
    // b and a (thread t < rows: row r0 + t) into *pb, *pa.
    auto stage = [&](int r0, int bi, float* pb, float* pa) {
        int cnt = min(RG, m - r0);
        const float* row = qk + (i64)r0 * 2 * kd + kh * DK + tid;
        const float* vrow = conv + (i64)r0 * cd + 2 * kd + n * dv + jj;
        float* dst = st(bi);
        for (int rr = 0; rr < cnt; rr++, row += 2 * kd, vrow += cd, dst += ROWF) {
#pragma unroll
            for (int u = 0; u < FU; u++) {
                if (DK % NT == 0 || tid + u * NT < DK) {
                    cp_async4(dst + at[u], row + kd + u * NT);
                    cp_async4(dst + SEC + at[u], row + u * NT);
                }
            }
            if (tid < DC_COLS) {
                if (jj < dv)
                    cp_async4(dst + 2 * SEC + tid, vrow);
                else
                    dst[2 * SEC + tid] = 0.0f;
            }
        }
        cp_async_commit();
        if (tid < cnt) {
            *pb = b[(i64)(r0 + tid) * hv + n];
            *pa = a[(i64)(r0 + tid) * hv + n];
        }
    };
    // beta and decay of group row t from its b and a, into sb[bi].
    auto gates = [&](int bi, int t, float bv, float av) {
        sb[bi][t] = sigmoid(bv);
        float gl = softplus(av + dt_bias[n]) * ssm_a[n];
        sb[bi][RG + t] = expf(gl);
    };
    int groups = (m + RG - 1) / RG;
    float nb = 0.0f, na = 0.0f;
    if (groups > 0) {
        stage(0, 0, &nb, &na);
        if (tid < min(RG, m)) gates(0, tid, nb, na);
    }
    for (int g = 0; g < groups; g++) {
        int r0 = g * RG, cnt = min(RG, m - r0), bi = g & 1;
        int nx = bi ^ 1;  // group g + 1's buffer
        bool more = g + 1 < groups;
        if (g > 0) __syncthreads();  // group g - 1 is done with buffer nx
        if (more) {
            stage(r0 + RG, nx, &nb, &na);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        // This thread's copies of group g have landed: scale its q's.
        {
            float* dst = st(bi) + SEC;
            for (int rr = 0; rr < cnt; rr++, dst += ROWF) {
#pragma unroll
                for (int u = 0; u < FU; u++)
                    if (DK % NT == 0 || tid + u * NT < DK) dst[at[u]] = __fmul_rn(dst[at[u]], q_scale);
            }
        }
        __syncthreads();
        const float* sg = st(bi);
        float kk[SP], qq[SP];
        if (PIPE == 2 && cnt == RG) {
            // The pipelined rows of a full group as straight-line code,
            // every shared-memory offset a constant, so the compiler can
            // issue a row's v, beta, decay, q and next k loads ahead of the
            // chain that needs them. The same operations in the same order
            // as the PIPE = 1 loop below.
            dc_load4<DK>(sg + p * PS, kk);
            float kv = dc_decay_kdot<SP>(S, kk, sb[bi][RG]);
            // Each row's outputs go to shared memory (a predicated store, no
            // branch in the row body) and the warp writes its 4 columns of
            // the group's rows out after the last row.
            __shared__ float so[RG * DC_COLS];
#pragma unroll
            for (int rr = 0; rr < RG; rr++) {
                const float* kr = sg + rr * ROWF;
                float delta = __fmul_rn(__fsub_rn(kr[2 * SEC + c], kv), sb[bi][rr]);
                dc_load4<DK>(kr + SEC + p * PS, qq);
                float acc = 0.0f;
                if (rr + 1 < RG) {
                    float kn[SP], kv2 = 0.0f;
                    dc_load4<DK>(kr + ROWF + p * PS, kn);
                    dc_step_next<SP>(S, kk, qq, kn, delta, sb[bi][RG + rr + 1], acc, kv2);
                    dc_lanes_sum2(acc, kv2);
                    kv = kv2;
                } else {
                    acc = dc_step_last<SP>(S, kk, qq, delta);
                }
                if (p == 0) so[rr * DC_COLS + c] = acc;
            }
            __syncwarp();
            int lane = tid & 31, w4 = (tid >> 5) * (32 / DC_PARTS);
#pragma unroll
            for (int e = lane; e < RG * (32 / DC_PARTS); e += 32) {
                int rr = e / (32 / DC_PARTS), cc = w4 + e % (32 / DC_PARTS);
                int jc = blockIdx.y * DC_COLS + cc;
                if (jc < dv) o[(i64)(r0 + rr) * vd + n * dv + jc] = so[rr * DC_COLS + cc];
            }
        } else if (PIPE) {
            // Row 0's decay and k dot, then per row: its update and output
            // dot beside the next row's decay and k dot.
            dc_load4<DK>(sg + p * PS, kk);
            float kv = dc_decay_kdot<SP>(S, kk, sb[bi][RG]);
            for (int rr = 0; rr < cnt; rr++) {
                const float* kr = sg + rr * ROWF;
                bool next = rr + 1 < cnt;
                float delta = __fmul_rn(__fsub_rn(kr[2 * SEC + c], kv), sb[bi][rr]);
                dc_load4<DK>(kr + SEC + p * PS, qq);
                float acc = 0.0f, kv2 = 0.0f;
                if (next) {
                    float kn[SP];
                    dc_load4<DK>(kr + ROWF + p * PS, kn);
                    dc_step_next<SP>(S, kk, qq, kn, delta, sb[bi][RG + rr + 1], acc, kv2);
                    dc_lanes_sum2(acc, kv2);
                } else {
                    acc = dc_step_last<SP>(S, kk, qq, delta);
                }
                if (live && p == 0) o[(i64)(r0 + rr) * vd + n * dv + j] = acc;
                kv = kv2;
            }
        } else {
            for (int rr = 0; rr < cnt; rr++) {
                const float* kr = sg + rr * ROWF;
                float beta = sb[bi][rr], decay = sb[bi][RG + rr];
                dc_load4<DK>(kr + p * PS, kk);
                float kv = 0.0f;
#pragma unroll
                for (int q = 0; q < SP; q++) {
                    S[q] = __fmul_rn(S[q], decay);
                    kv = __fmaf_rn(S[q], kk[q], kv);
                }
                kv = dc_lanes_sum(kv);
                float delta = __fmul_rn(__fsub_rn(kr[2 * SEC + c], kv), beta);
                dc_load4<DK>(kr + SEC + p * PS, qq);
                float acc = 0.0f;
#pragma unroll
                for (int q = 0; q < SP; q++) {
                    S[q] = __fmaf_rn(kk[q], delta, S[q]);
                    acc = __fmaf_rn(S[q], qq[q], acc);
                }
                acc = dc_lanes_sum(acc);
                if (live && p == 0) o[(i64)(r0 + rr) * vd + n * dv + j] = acc;
            }
        }
        if (more && tid < min(RG, m - r0 - RG)) gates(nx, tid, nb, na);
    }
    if (live)
#pragma unroll
        for (int q = 0; q < SP; q++) G[(i64)(p + DC_PARTS * q) * dv + j] = S[q];
}

#define DELTA_COLS_ASYNC(name, DK, RG, PIPE)                                                         \
    extern "C" __global__ void __launch_bounds__(DC_COLS * DC_PARTS, 4)                               \
        name(const float* qk, const float* conv, const float* b, const float* a, const float* dt_bias, \
             const float* ssm_a, float* state, float* o, int m, int hk, int hv, int dv, int tiled) { pdl_wait(); \
        delta_cols_async<DK, RG, PIPE>(qk, conv, b, a, dt_bias, ssm_a, state, o, m, hk, hv, dv, tiled); \
    }

// A decode row each of ns sequences (row blockIdx.z, its state at
// tab[ns + row]): the one-row call's code on each row's inputs and state.
#define DELTA_COLS_ASYNC_SEQS(name, DK, RG, PIPE)                                                      \
    extern "C" __global__ void __launch_bounds__(DC_COLS * DC_PARTS, 4)                                 \
        name(const float* qk, const float* conv, const float* b, const float* a, const float* dt_bias,   \
             const float* ssm_a, const u64* tab, float* o, int ns, int hk, int hv, int dv, int tiled) {  \
        pdl_wait();                                                                                      \
        int r = blockIdx.z, kd = hk * DK, vd = hv * dv;                                                  \
        delta_cols_async<DK, RG, PIPE>(qk + (i64)r * 2 * kd, conv + (i64)r * (2 * kd + vd),              \
                                       b + (i64)r * hv, a + (i64)r * hv, dt_bias, ssm_a,                 \
                                       reinterpret_cast<float*>(tab[ns + r]), o + (i64)r * vd, 1, hk, hv, \
                                       dv, tiled);                                                       \
    }

DELTA_COLS_ASYNC(delta_cols_async_256, 256, 8, 0)
DELTA_COLS_ASYNC(delta_cols_async_pipe_64, 64, 16, 1)
DELTA_COLS_ASYNC(delta_cols_async_pipe_128, 128, 16, 1)
DELTA_COLS_ASYNC(delta_cols_async_unroll_64, 64, 16, 2)
DELTA_COLS_ASYNC(delta_cols_async_unroll_128, 128, 16, 2)
DELTA_COLS_ASYNC_SEQS(delta_cols_async_256_seqs, 256, 8, 0)
DELTA_COLS_ASYNC_SEQS(delta_cols_async_pipe_64_seqs, 64, 16, 1)
DELTA_COLS_ASYNC_SEQS(delta_cols_async_pipe_128_seqs, 128, 16, 1)

// The delta net's gated RMSNorm, one warp per (row, value head): the head is
// read once, coalesced, into shared memory (head dims up to 256; larger ones
// read global memory), the sum of squares in f64 in index order (lane 0, as
// the CPU does), then o = ((o * scale) * norm) * silu(z).
#define GN_WARPS 4
extern "C" __global__ void __launch_bounds__(GN_WARPS * 32)
    gated_norm(float* o, const float* z, const float* norm, int rows_heads, int dv, float eps) {
    pdl_wait();
    __shared__ __align__(16) float stage[GN_WARPS][256];
    __shared__ __align__(16) double sqs[GN_WARPS][256];
    int w = blockIdx.x * GN_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (w >= rows_heads) return;
    float* on = o + (i64)w * dv;
    const float* zn = z + (i64)w * dv;
    double s;
    if (dv <= 256) {
        float* sv = stage[threadIdx.x / 32];
        for (int i = lane; i < dv; i += 32) sv[i] = on[i];
        __syncwarp();
        s = sumsq_in_order(sv, dv, lane, sqs[threadIdx.x / 32]);
    } else {
        s = 0.0;
        if (lane == 0)
            for (int i = 0; i < dv; i++) s += (double)on[i] * (double)on[i];
        s = __shfl_sync(0xffffffffu, s, 0);
    }
    float mean = (float)(s / (double)dv);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = lane; i < dv; i += 32) on[i] = ((on[i] * scale) * norm[i]) * silu(zn[i]);
}

// gated_norm for decode-sized calls (lane 0 squaring every value, see
// sumsq_lane0), then the Q8_K blocks of what the block wrote (the out
// projection's input, quantized as quantize_q8k does it): the block's four
// heads are dv * 4 consecutive values of one row (the launch checks that
// 256 divides dv * 4 and a row's heads come in fours), so they are whole
// blocks of 256; warp w quantizes blocks w, w + 4, ... of them. Only
// LANES = false (lane 0's squares) is launched; the template stays as it is
// because the kernel without it compiles to other SASS.
template <bool LANES>
__device__ __forceinline__ void gated_norm_q8k_k(float* o, const float* z, const float* norm, u8* q, int rows_heads,
                                                 int dv, float eps) {
    __shared__ __align__(16) double sqs[LANES ? GN_WARPS : 1][256];
    int w0 = blockIdx.x * GN_WARPS, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int w = w0 + warp;
    if (w < rows_heads) {
        float* on = o + (i64)w * dv;
        const float* zn = z + (i64)w * dv;
        __shared__ __align__(16) float stage[GN_WARPS][256];
        float* sv = stage[warp];
        for (int i = lane; i < dv; i += 32) sv[i] = on[i];
        __syncwarp();
        double s = LANES ? sumsq_in_order(sv, dv, lane, sqs[LANES ? warp : 0]) : sumsq_lane0(sv, dv, lane);
        float mean = (float)(s / (double)dv);
        float scale = 1.0f / sqrtf(mean + eps);
        for (int i = lane; i < dv; i += 32) on[i] = ((on[i] * scale) * norm[i]) * silu(zn[i]);
    }
    __syncthreads();  // the block's stores of o are visible to the block
    int heads = min(GN_WARPS, rows_heads - w0);
    i64 first = (i64)w0 * dv;  // a multiple of 256
    for (int b = warp; b < heads * dv / 256; b += GN_WARPS)
        q8k_block(o + first + b * 256, q + (first / 256 + b) * Q8K_BYTES, lane);
}

extern "C" __global__ void __launch_bounds__(GN_WARPS * 32)
    gated_norm_q8k_lane0(float* o, const float* z, const float* norm, u8* q, int rows_heads, int dv, float eps) {
    pdl_wait();
    gated_norm_q8k_k<false>(o, z, norm, q, rows_heads, dv, eps);
}

// gated_norm_q8k_lane0 for calls of more than 16 rows, a lane a head: a
// block of 128 threads takes HS_HEADS heads (of a row or of consecutive rows,
// as the launch's heads come), stages them in shared memory (dynamic: HS_HEADS
// rows of dv + 1 floats, so lane l's reads of head l fall in distinct
// banks), and lane l of warp 0 adds head l's squares in f64 in index order,
// as sumsq_in_order's lane 0 adds one head's: the same sum, with 32 heads'
// sums in one warp's instructions where that took a warp a head. The scale,
// the gating and the Q8_K blocks (warp w quantizes blocks w, w + 4, ...)
// are gated_norm_q8k_lane0's. The launch checks dv <= 256, 256 | 4 dv and
// heads in fours, so a block's heads are whole 256-blocks. A thread's loads
// of its column in the 32 heads are issued together (the loops over heads
// unrolled): loading one head at a time, 32 memory waits in a row, was
// slower than a warp a head (qwen35moe pp4096 on an H200: 5.51 ms against
// 4.07; 2.91 ms with the loads together).
extern "C" __global__ void __launch_bounds__(128, 8)
    gated_norm_q8k_h(float* o, const float* z, const float* norm, u8* q, int rows_heads, int dv, float eps) {
    pdl_wait();
    extern __shared__ __align__(16) float hs_stage[];
    __shared__ float scales[HS_HEADS];
    const int h0 = blockIdx.x * HS_HEADS, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int nh = min(HS_HEADS, rows_heads - h0), ld = dv + 1;
    const i64 first = (i64)h0 * dv;  // a multiple of 256
    for (int c = tid; c < dv; c += 128) {
        const float* oc = o + first + c;
#pragma unroll 1
        for (int h0 = 0; h0 < HS_HEADS; h0 += HS_BATCH) {
            float v[HS_BATCH];
#pragma unroll
            for (int h = 0; h < HS_BATCH; h++) v[h] = h0 + h < nh ? oc[(h0 + h) * dv] : 0.0f;
#pragma unroll
            for (int h = 0; h < HS_BATCH; h++) hs_stage[(h0 + h) * ld + c] = v[h];
        }
    }
    __syncthreads();
    if (tid < nh) {
        float mean = (float)(sumsq_one_lane(hs_stage + tid * ld, dv) / (double)dv);
        scales[tid] = 1.0f / sqrtf(mean + eps);
    }
    __syncthreads();
    for (int c = tid; c < dv; c += 128) {
        const float nc = norm[c];
        const float* zc = z + first + c;
        float* oc = o + first + c;
#pragma unroll 1
        for (int h0 = 0; h0 < HS_HEADS; h0 += HS_BATCH) {
            float zv[HS_BATCH];
#pragma unroll
            for (int h = 0; h < HS_BATCH; h++) zv[h] = h0 + h < nh ? zc[(h0 + h) * dv] : 0.0f;
#pragma unroll
            for (int h = 0; h < HS_BATCH; h++)
                if (h0 + h < nh)
                    oc[(h0 + h) * dv] = ((hs_stage[(h0 + h) * ld + c] * scales[h0 + h]) * nc) * silu(zv[h]);
        }
    }
    __syncthreads();  // the block's stores of o are visible to the block
    for (int b = warp; b < nh * dv / 256; b += 4) q8k_block(o + first + b * 256, q + (first / 256 + b) * Q8K_BYTES, lane);
}

