// Norms, residual adds, the GLU's silu_mul and row gathers. Each output row
// is computed from its own inputs with an order of arithmetic fixed by the
// model's sizes, never by the call's row count. (The "ops" compile unit is
// this file, attention.cu, delta_net.cu and moe.cu, in that order.)

// Values per thread kept in registers (rows up to 256 x 8 = 2,048 wide); wider
// rows take the same loops through memory. NORM_THREADS and norm_tree are in
// common.cuh.
#define NORM_VPT 8

// One row of RMSNorm (and, with `inc`, the residual add before it: acc[i] =
// acc[i] + inc[i], stored): thread t takes elements t, t + 256, ... in order
// for its f64 sum of squares, then the fixed tree; y = (x * scale) * w. For
// rows up to 2,048 every load (x, inc, w) is issued before any arithmetic, so
// the row waits on memory once; the operations are the same either way.
__device__ __forceinline__ void norm_row(float* xr, const float* inc, const float* w, float* yr, int width,
                                         float eps) {
    __shared__ double part[NORM_THREADS];
    int t = threadIdx.x;
    double s = 0.0;
    if (width <= NORM_THREADS * NORM_VPT) {
        float v[NORM_VPT], wv[NORM_VPT], iv[NORM_VPT];
#pragma unroll
        for (int k = 0; k < NORM_VPT; k++) {
            int i = t + k * NORM_THREADS;
            v[k] = i < width ? xr[i] : 0.0f;
            iv[k] = inc && i < width ? inc[i] : 0.0f;
            wv[k] = i < width ? w[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < NORM_VPT; k++) {
            int i = t + k * NORM_THREADS;
            if (i < width) {
                if (inc) {
                    v[k] = v[k] + iv[k];
                    xr[i] = v[k];
                }
                s += (double)v[k] * (double)v[k];
            }
        }
        part[t] = s;
        float mean = (float)(norm_tree(part, t) / (double)width);
        float scale = 1.0f / sqrtf(mean + eps);
#pragma unroll
        for (int k = 0; k < NORM_VPT; k++) {
            int i = t + k * NORM_THREADS;
            if (i < width) yr[i] = (v[k] * scale) * wv[k];
        }
        return;
    }
    for (int i = t; i < width; i += NORM_THREADS) {
        float a = xr[i];
        if (inc) {
            a = a + inc[i];
            xr[i] = a;
        }
        s += (double)a * (double)a;
    }
    part[t] = s;
    float mean = (float)(norm_tree(part, t) / (double)width);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = t; i < width; i += NORM_THREADS) yr[i] = (xr[i] * scale) * w[i];
}

// RMSNorm of `m` rows of `width` (a block per row): the sum of squares in f64,
// each thread over a fixed stride, then a fixed tree; y = (x * scale) * w.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm(const float* x, const float* w, float* y, int width, float eps) {
    pdl_wait();
    int r = blockIdx.x;
    norm_row((float*)(x + (i64)r * width), nullptr, w, y + (i64)r * width, width, eps);
}

// RMSNorm of rows up to 256 wide (the per-head q and k norms), a warp per
// row instead of a block: lane l holds elements l + 32 j (j < 8) and their
// squares in f64 (+0.0 past the row, as rms_norm's threads past it hold),
// then rms_norm's tree on them: its levels o = 128, 64, 32 (part[t] +
// part[t + o], t = l + 32 j) are a_j + a_{j+4}, then b_j + b_{j+2}, then
// c_0 + c_1 within the lane, and its last five levels the same shuffles.
// The same sum, scale and products as rms_norm, so the same bytes.
// One row of up to 256 by one warp (rms_norm_small's arithmetic); xr and
// yr may be global or shared memory.
__device__ __forceinline__ void norm_small_row(const float* xr, const float* w, float* yr, int width, float eps,
                                               int lane) {
    float v[8], wv[8];
    double a[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int i = lane + 32 * j;
        v[j] = i < width ? xr[i] : 0.0f;
        wv[j] = i < width ? w[i] : 0.0f;
        a[j] = i < width ? (double)v[j] * (double)v[j] : 0.0;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) a[j] = a[j] + a[j + 4];
#pragma unroll
    for (int j = 0; j < 2; j++) a[j] = a[j] + a[j + 2];
    double s = a[0] + a[1];
    for (int o = 16; o > 0; o /= 2) s = s + __shfl_down_sync(0xffffffffu, s, o);
    s = __shfl_sync(0xffffffffu, s, 0);
    float mean = (float)(s / (double)width);
    float scale = 1.0f / sqrtf(mean + eps);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int i = lane + 32 * j;
        if (i < width) yr[i] = (v[j] * scale) * wv[j];
    }
}

extern "C" __global__ void __launch_bounds__(256)
    rms_norm_small(const float* x, const float* w, float* y, int rows, int width, float eps) {
    pdl_wait();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    i64 r = (i64)blockIdx.x * 8 + warp;
    if (r >= rows) return;
    norm_small_row(x + r * width, w, y + r * width, width, eps, lane);
}

// rms_norm and add_rms_norm that also write each output row as Q8_K blocks
// (width a multiple of 256): after the row is stored, warp w quantizes blocks
// w, w + 8, ... of it exactly as quantize_q8k does (q8k_block), so the
// layer's matmuls need no separate quantize launch.
__device__ __forceinline__ void quantize_own_row(const float* yr, u8* qr, int width) {
    __syncthreads();  // the block's stores of yr are visible to the block
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int blk = warp; blk < width / 256; blk += NORM_THREADS / 32)
        q8k_block(yr + blk * 256, qr + (i64)blk * Q8K_BYTES, lane);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm_q8k(const float* x, const float* w, float* y, u8* q, int width, float eps) {
    pdl_wait();
    int r = blockIdx.x;
    norm_row((float*)(x + (i64)r * width), nullptr, w, y + (i64)r * width, width, eps);
    quantize_own_row(y + (i64)r * width, q + (i64)r * (width / 256) * Q8K_BYTES, width);
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    add_rms_norm_q8k(float* acc, const float* x, const float* w, float* y, u8* q, int width, float eps) {
    pdl_wait();
    int r = blockIdx.x;
    norm_row(acc + (i64)r * width, x + (i64)r * width, w, y + (i64)r * width, width, eps);
    quantize_own_row(y + (i64)r * width, q + (i64)r * (width / 256) * Q8K_BYTES, width);
}

// acc += x, then y = RMSNorm(acc): add_inplace's sum per element, then
// rms_norm's arithmetic on the stored sums, in one launch.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    add_rms_norm(float* acc, const float* x, const float* w, float* y, int width, float eps) {
    pdl_wait();
    int r = blockIdx.x;
    norm_row(acc + (i64)r * width, x + (i64)r * width, w, y + (i64)r * width, width, eps);
}

extern "C" __global__ void add_inplace(float* acc, const float* x, i64 n) {
    pdl_wait();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] = acc[i] + x[i];
}

// o *= sigmoid(g)
extern "C" __global__ void sigmoid_mul(float* o, const float* g, i64 n) {
    pdl_wait();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) o[i] = o[i] * sigmoid(g[i]);
}

// a = silu(a) * b
extern "C" __global__ void silu_mul(float* a, const float* b, i64 n) {
    pdl_wait();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = silu(a[i]) * b[i];
}

// silu_mul on rows of `width` (a multiple of 256) with the rows' Q8_K
// blocks as quantize_q8k makes them (the GLU output's quantization for the
// down projection without a launch of its own), a warp per 256-block: warp
// w of the launch takes block w % nb of row w / nb (nb = width / 256), its
// 256 products (loads first), then its Q8_K block (q8k_block). A block a row
// would give a 512-wide routed GLU row 2 values a thread and then quantize
// it with 2 of its 8 warps.
// LIVE: rows whose expert id (`mats`) is negative (the expert plan's
// padding, and the places past the last expert's rows) are skipped, their
// products and Q8_K blocks left unwritten (see silu_mul_q8k_wl).
template <bool LIVE>
__device__ __forceinline__ void silu_q8k_warp(float* a, const float* b, u8* q, int width, int m, const int* mats) {
    int nb = width / 256, lane = threadIdx.x % 32;
    i64 w = (i64)blockIdx.x * 4 + threadIdx.x / 32;
    if (w >= (i64)m * nb) return;
    i64 r = w / nb;
    if (LIVE && mats[r] < 0) return;
    int c = (int)(w % nb);
    float* ab = a + r * width + c * 256;
    const float* bb = b + r * width + c * 256;
    float av[8], bv[8];
#pragma unroll
    for (int t = 0; t < 8; t++) {
        av[t] = ab[lane + 32 * t];
        bv[t] = bb[lane + 32 * t];
    }
#pragma unroll
    for (int t = 0; t < 8; t++) ab[lane + 32 * t] = silu(av[t]) * bv[t];
    __syncwarp();  // the warp's stores are visible to the warp
    q8k_block(ab, q + (r * nb + c) * Q8K_BYTES, lane);
}

extern "C" __global__ void __launch_bounds__(128)
    silu_mul_q8k_w(float* a, const float* b, u8* q, int width, int m) {
    pdl_wait();
    silu_q8k_warp<false>(a, b, q, width, m, nullptr);
}

// silu_mul_q8k_w on the rows that have an expert only: a wide routed
// call's rows are padded per expert
// to the tensor-core tile and sized for the worst case, so about a third of
// them (qwen35moe, chunk 2,048: ~7,900 of 24,320) hold no pair. Nothing
// reads their outputs: the down projection computes and stores only rows
// with an expert, and a row's integer and float steps read only that row's
// block, so an unwritten block's bytes reach no stored output. The rows it
// writes are silu_mul_q8k_w's bytes.
extern "C" __global__ void __launch_bounds__(128)
    silu_mul_q8k_wl(float* a, const float* b, u8* q, int width, int m, const int* mats) {
    pdl_wait();
    silu_q8k_warp<true>(a, b, q, width, m, mats);
}

// sigmoid_mul on rows of `width` (a multiple of 256), then the rows' Q8_K
// blocks as quantize_q8k makes them: the gated attention's output, quantized
// for the out projection without a launch of its own. A warp per 256-block
// (four a block, blockIdx.y the row): its products, then its quantization
// (a decode row of 16 blocks is 16 warps at once, not 8 warps twice over).
extern "C" __global__ void __launch_bounds__(128) sigmoid_mul_q8k(float* o, const float* g, u8* q, int width) {
    pdl_wait();
    int nb = width / 256, c = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (c >= nb) return;
    i64 r = blockIdx.y;
    float* ob = o + r * width + c * 256;
    const float* gb = g + r * width + c * 256;
#pragma unroll
    for (int t = 0; t < 8; t++) ob[lane + 32 * t] = ob[lane + 32 * t] * sigmoid(gb[lane + 32 * t]);
    __syncwarp();  // the warp's stores are visible to the warp
    q8k_block(ob, q + (r * nb + c) * Q8K_BYTES, lane);
}

// dst[r][c] = src[r][map[c]] for `m` rows.
extern "C" __global__ void copy_cols(const float* src, int src_w, float* dst, int dst_w, const int* map, int m) {
    pdl_wait();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)m * dst_w) return;
    int r = (int)(i / dst_w), c = (int)(i % dst_w);
    dst[i] = src[(i64)r * src_w + map[c]];
}

// dst[i] = src[rows[i]] (rows of `width`).
extern "C" __global__ void gather_rows(const float* src, const int* rows, float* dst, int width, int n) {
    pdl_wait();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n * width) return;
    int r = (int)(i / width), c = (int)(i % width);
    int s = rows[r];
    dst[i] = s < 0 ? 0.0f : src[(i64)s * width + c];
}

// dst row i = src row rows[i] for rows of `words` 16-byte words (quantized
// activation rows); a negative index leaves the row as it was (ZERO false,
// the `_live` kernel launched; ZERO true would give a zero row): no kernel
// that reads the rows of a wide routed call uses a row with no expert.
template <bool ZERO>
__device__ __forceinline__ void gather_words_k(const int4* src, const int* rows, int4* dst, int words, int n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n * words) return;
    int r = (int)(i / words), c = (int)(i % words);
    int s = rows[r];
    if (!ZERO && s < 0) return;
    int4 v;
    v.x = v.y = v.z = v.w = 0;
    if (s >= 0) v = src[(i64)s * words + c];
    dst[i] = v;
}

extern "C" __global__ void gather_words_live(const int4* src, const int* rows, int4* dst, int words, int n) {
    pdl_wait();
    gather_words_k<false>(src, rows, dst, words, n);
}


// Each row's most likely token, as the host's sample::argmax picks it: the
// lowest index among the values equal to the row's largest non-NaN value
// (so +0 and -0 tie), NaNs never chosen, and index 0 when the row's first
// value is NaN or no value exceeds -inf. A block a row: each thread keeps
// the first of its strided values that is strictly larger than all before
// it, then the block keeps the larger value, the lower index on a tie.
#define AM_THREADS 1024
extern "C" __global__ void __launch_bounds__(AM_THREADS) argmax_rows(const float* x, u32* out, int n) {
    pdl_wait();
    __shared__ float sv[AM_THREADS / 32];
    __shared__ int si[AM_THREADS / 32];
    const float* row = x + (i64)blockIdx.x * n;
    int t = threadIdx.x, lane = t % 32, warp = t / 32;
    const int NONE = 0x7fffffff;
    float bv = -INFINITY;
    int bi = NONE;  // none yet
    for (int i = t; i < n; i += AM_THREADS) {
        float v = row[i];
        if (v > bv) bv = v, bi = i;
    }
    // (value, index) pairs folded: the larger value, the lower index on
    // equal values; a thread with none (NONE) loses to any other.
    auto keep = [NONE](float& v, int& i, float ov, int oi) {
        if (oi == NONE) return;
        if (i == NONE || ov > v || (ov == v && oi < i)) v = ov, i = oi;
    };
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        keep(bv, bi, ov, oi);
    }
    if (lane == 0) sv[warp] = bv, si[warp] = bi;
    __syncthreads();
    if (warp == 0) {
        bv = lane < AM_THREADS / 32 ? sv[lane] : -INFINITY;
        bi = lane < AM_THREADS / 32 ? si[lane] : NONE;
#pragma unroll
        for (int o = 16; o > 0; o /= 2) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            keep(bv, bi, ov, oi);
        }
        if (lane == 0) out[blockIdx.x] = (n == 0 || isnan(row[0]) || bi == NONE) ? 0u : (u32)bi;
    }
}
