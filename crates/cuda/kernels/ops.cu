// Row ops of the forward pass: norms, residual adds, RoPE, the KV cache,
// attention, the causal conv, the gated delta rule, routing, the expert plan,
// gather and combine. Each output row is computed from its own inputs (and, for
// the sequential ops, the state its sequence's earlier rows wrote) with an
// order of arithmetic fixed by the model's sizes, never by the call's row count.

// Values per thread kept in registers (rows up to 256 x 8 = 2,048 wide); wider
// rows take the same loops through memory. NORM_THREADS and norm_tree are in
// common.cuh (the decode router launch runs the same norm).
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

// silu_mul on rows of `width` (a multiple of 256), a block per row, then the
// row's Q8_K blocks as quantize_q8k makes them (quantize_own_row): the GLU
// output's quantization for the down projection without a launch of its own.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    silu_mul_q8k(float* a, const float* b, u8* q, int width) {
    pdl_wait();
    i64 r = blockIdx.x;
    float* ar = a + r * width;
    const float* br = b + r * width;
    for (int i = threadIdx.x; i < width; i += NORM_THREADS) ar[i] = silu(ar[i]) * br[i];
    quantize_own_row(ar, q + r * (width / 256) * Q8K_BYTES, width);
}

// silu_mul_q8k with a warp per 256-block (`SAMESUM_CUDA_SILU_WARP`,
// default): warp w of the launch takes block w % nb of row w / nb (nb =
// width / 256), its 256 products (loads first), then its Q8_K block. The
// same products and the same q8k_block, so the same bytes. The block-per-row
// kernel gives a 512-wide routed GLU row 2 values a thread and then
// quantizes it with 2 of its 8 warps.
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

// silu_mul_q8k_w on the rows that have an expert only (`LIVE_ROWS`,
// opt-in until measured): a wide routed call's rows are padded per expert
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

// silu_mul_q8k_w quantizing the products from registers, without storing
// them (`SILU_REGS`, opt-in: H200, session 19, 4.72 ms against 4.44 at
// qwen35moe pp4096, though the float rows' write, a third of the traffic,
// goes): the next matmul reads the Q8_K blocks only. `a` keeps the gate's
// outputs. The same products and q8k_block's arithmetic on them, so the
// same Q8_K bytes.
extern "C" __global__ void __launch_bounds__(128)
    silu_mul_q8k_wr(const float* a, const float* b, u8* q, int width, int m) {
    pdl_wait();
    int nb = width / 256, lane = threadIdx.x % 32;
    i64 w = (i64)blockIdx.x * 4 + threadIdx.x / 32;
    if (w >= (i64)m * nb) return;
    i64 r = w / nb;
    int c = (int)(w % nb);
    const float* ab = a + r * width + c * 256;
    const float* bb = b + r * width + c * 256;
    float av[8], bv[8], v[8];
#pragma unroll
    for (int t = 0; t < 8; t++) {
        av[t] = ab[lane + 32 * t];
        bv[t] = bb[lane + 32 * t];
    }
#pragma unroll
    for (int t = 0; t < 8; t++) v[t] = silu(av[t]) * bv[t];
    q8k_block_regs(v, q + (r * nb + c) * Q8K_BYTES, lane);
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
// activation rows); a negative index gives a zero row, or (ZERO false, the
// `_live` kernel, `LIVE_ROWS`) leaves the row as it was: no kernel that
// reads the rows of a wide routed call uses a row with no expert.
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

extern "C" __global__ void gather_words(const int4* src, const int* rows, int4* dst, int words, int n) {
    pdl_wait();
    gather_words_k<true>(src, rows, dst, words, n);
}

extern "C" __global__ void gather_words_live(const int4* src, const int* rows, int4* dst, int words, int n) {
    pdl_wait();
    gather_words_k<false>(src, rows, dst, words, n);
}

// The sequence position (`pos0` of the kernels below) is read from device
// memory, so a recorded decode step (a CUDA graph) replays at any position.

// NeoX RoPE of pair (i, i + n_rot / 2) of one head at position `pos`.
__device__ __forceinline__ void rope_pair(float* head, int i, int n_rot, float theta, int pos) {
    int half = n_rot / 2;
    float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)n_rot);
    float ang = (float)pos * inv_freq;
    float sn, cs;
    sincosf(ang, &sn, &cs);
    float a = head[i], b = head[i + half];
    head[i] = a * cs - b * sn;
    head[i + half] = b * cs + a * sn;
}

// NeoX RoPE on the first n_rot dims of each head of `m` rows at pos0 + r.
extern "C" __global__ void rope(float* x, int m, int heads, int hd, int n_rot, float theta, const int* posp) {
    pdl_wait();
    int pos0 = *posp;
    int half = n_rot / 2;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (i64)m * heads * half) return;
    int i = (int)(t % half);
    int h = (int)((t / half) % heads);
    int r = (int)(t / ((i64)half * heads));
    rope_pair(x + ((i64)r * heads + h) * hd, i, n_rot, theta, pos0 + r);
}

// Write m rows of k and v (kvw wide) to the cache at positions pos0.. (f32 or f16).
extern "C" __global__ void kv_write(const float* k, const float* v, void* ck, void* cv, const int* posp, int m,
                                    int kvw, int f16) {
    pdl_wait();
    int pos0 = *posp;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)m * kvw) return;
    i64 at = (i64)pos0 * kvw + i;
    if (f16) {
        ((u16*)ck)[at] = f32_to_f16(k[i]);
        ((u16*)cv)[at] = f32_to_f16(v[i]);
    } else {
        ((float*)ck)[at] = k[i];
        ((float*)cv)[at] = v[i];
    }
}

// An attention layer's head norms, RoPE and KV write in one launch, for
// every m: a warp per (row, head), the q heads of all rows, then the k heads.
// Each head is normed as rms_norm_small does (norm_small_row) into the warp's
// shared row, roped there pair by pair as `rope` does (rope_pair), then
// stored: q heads to `q` (m x hq x hd), k heads to the cache as kv_write
// stores them, with the same head of v. q is read in place from the
// projection's rows (`q_row` floats a row, `q_head` floats between heads:
// the gated projection interleaves q and gate heads).
extern "C" __global__ void __launch_bounds__(256)
    qk_norm_rope_kv(const float* qsrc, int q_row, int q_head, const float* k, const float* v, const float* qnw,
                    const float* knw, float* q, void* ck, void* cv, const int* posp, int m, int hq, int hkv, int hd,
                    int n_rot, float theta, float eps, int f16) {
    pdl_wait();
    __shared__ float rowbuf[8][256];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    i64 g = (i64)blockIdx.x * 8 + warp;
    if (g >= (i64)m * (hq + hkv)) return;
    int pos0 = *posp;
    float* sr = rowbuf[warp];
    bool isq = g < (i64)m * hq;
    int r, h;
    if (isq) {
        r = (int)(g / hq), h = (int)(g % hq);
        norm_small_row(qsrc + (i64)r * q_row + (i64)h * q_head, qnw, sr, hd, eps, lane);
    } else {
        i64 gk = g - (i64)m * hq;
        r = (int)(gk / hkv), h = (int)(gk % hkv);
        norm_small_row(k + ((i64)r * hkv + h) * hd, knw, sr, hd, eps, lane);
    }
    __syncwarp();
    for (int i = lane; i < n_rot / 2; i += 32) rope_pair(sr, i, n_rot, theta, pos0 + r);
    __syncwarp();
    if (isq) {
        float* qo = q + ((i64)r * hq + h) * hd;
        for (int i = lane; i < hd; i += 32) qo[i] = sr[i];
        return;
    }
    int kvw = hkv * hd;
    i64 at = (i64)(pos0 + r) * kvw + (i64)h * hd;
    const float* vr = v + (i64)r * kvw + (i64)h * hd;
    for (int i = lane; i < hd; i += 32) {
        if (f16) {
            ((u16*)ck)[at + i] = f32_to_f16(sr[i]);
            ((u16*)cv)[at + i] = f32_to_f16(vr[i]);
        } else {
            ((float*)ck)[at + i] = sr[i];
            ((float*)cv)[at + i] = vr[i];
        }
    }
}

__device__ __forceinline__ float kv_at(const void* c, i64 i, int f16) {
    return f16 ? f16_to_f32(((const u16*)c)[i]) : ((const float*)c)[i];
}

#define ATT_THREADS 256
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_T 256  // keys per tile: tile b holds positions [256 b, 256 b + 256)
#define AP 16      // (row, head) pairs per block
#define ATT_HD 256 // largest head dim
#ifndef ATT_KB
#define ATT_KB 2   // keys a step in the score pass for head dims over 128
#endif
static_assert(ATT_T % (ATT_WARPS * ATT_KB) == 0, "a score step's keys lie in one tile");

// The value pass of attention_tiles for one thread: output dim t % hdp of
// pairs t / hdp, t / hdp + G, ... (AP / G of them); each (pair, dim) is the
// fma chain over the tile's keys in order, up to the pair's own position.
template <int G, int FULL = 1>
__device__ __forceinline__ void tile_values(const void* cv, const float (*st)[ATT_T], float* pacc, int hdp, int kvw,
                                            int np, int gs, int g, int hq, int hd, int r0, int pos0, int j0,
                                            int jend, int b, int nb, int f16) {
    constexpr int P = AP / G;
    int t = threadIdx.x, dim = t % hdp, grp = t / hdp;
    if (dim >= hd || grp >= G) return;
    int cnt[P];  // keys of the tile the pair sees
    float acc[P];
#pragma unroll
    for (int i = 0; i < P; i++) {
        int p = grp + G * i;
        cnt[i] = p < np ? min(jend, pos0 + r0 + p / gs + 1) - j0 : 0;
        acc[i] = 0.0f;
    }
    // Four keys per step: their values loaded first, each pair's four scores
    // read as one float4 (st rows are 16-byte aligned), then the same fma
    // chain, key by key, as one key per step. Up to `full`, the keys every
    // pair of this thread with a key in the tile sees, no key needs its
    // pair's bound checked (pairs with none compute what is never written):
    // the same fmas in the same order without a compare each.
    int n = jend - j0, jj = 0, full = FULL ? n : 0;
#pragma unroll
    for (int i = 0; i < P; i++)
        if (cnt[i] > 0) full = min(full, cnt[i]);
    for (; jj + 4 <= full; jj += 4) {
        i64 at = (i64)(j0 + jj) * kvw + g * hd + dim;
        float v0 = kv_at(cv, at, f16), v1 = kv_at(cv, at + kvw, f16);
        float v2 = kv_at(cv, at + 2 * kvw, f16), v3 = kv_at(cv, at + 3 * kvw, f16);
#pragma unroll
        for (int i = 0; i < P; i++) {
            float4 s4 = *reinterpret_cast<const float4*>(&st[grp + G * i][jj]);
            acc[i] = __fmaf_rn(s4.x, v0, acc[i]);
            acc[i] = __fmaf_rn(s4.y, v1, acc[i]);
            acc[i] = __fmaf_rn(s4.z, v2, acc[i]);
            acc[i] = __fmaf_rn(s4.w, v3, acc[i]);
        }
    }
    for (; jj + 4 <= n; jj += 4) {
        i64 at = (i64)(j0 + jj) * kvw + g * hd + dim;
        float v0 = kv_at(cv, at, f16), v1 = kv_at(cv, at + kvw, f16);
        float v2 = kv_at(cv, at + 2 * kvw, f16), v3 = kv_at(cv, at + 3 * kvw, f16);
#pragma unroll
        for (int i = 0; i < P; i++) {
            float4 s4 = *reinterpret_cast<const float4*>(&st[grp + G * i][jj]);
            if (jj < cnt[i]) acc[i] = __fmaf_rn(s4.x, v0, acc[i]);
            if (jj + 1 < cnt[i]) acc[i] = __fmaf_rn(s4.y, v1, acc[i]);
            if (jj + 2 < cnt[i]) acc[i] = __fmaf_rn(s4.z, v2, acc[i]);
            if (jj + 3 < cnt[i]) acc[i] = __fmaf_rn(s4.w, v3, acc[i]);
        }
    }
    for (; jj < n; jj++) {
        float v = kv_at(cv, (i64)(j0 + jj) * kvw + g * hd + dim, f16);
#pragma unroll
        for (int i = 0; i < P; i++)
            if (jj < cnt[i]) acc[i] = __fmaf_rn(st[grp + G * i][jj], v, acc[i]);
    }
#pragma unroll
    for (int i = 0; i < P; i++) {
        int p = grp + G * i;
        if (cnt[i] > 0) {
            i64 pair = (i64)(r0 + p / gs) * hq + g * gs + p % gs;
            pacc[(pair * nb + b) * hd + dim] = acc[i];
        }
    }
}

// The score pass of attention_tiles for one warp: keys warp, warp + 8, ...
// of the tile. Lane l holds dims l, l + 32, ... (NC chunks of 32) and runs the
// 16 pairs' fma chains over them (register r of lane l for pair r ^
// qs_mask(l), q stored to match); the butterfly then runs for all 16 pairs at
// once: at step o every lane keeps half of its pairs and adds the partner's
// (lane ^ o) partial of the same pair, which is the one-pair butterfly's own +
// partner add; lane l ends with pair l / 2. With NC <= 4 each lane keeps its
// q values in registers (64 at most); with NC = 8 it reads them from shared
// memory, and takes KB keys a step (warp, warp + 8, ...: each q value read
// once for all of them, the keys' loads in flight together). The same terms
// in the same order either way, and the running max over the warp's keys in
// the same order. Returns the lane's running max (pair l / 2), writes the
// scaled scores to st (-inf past a pair's last key).
// One step of the pairs' butterfly: lanes with bit O2 keep pairs [W, 2W) of
// their current set, the others [0, W), each adding the partner's partial.
// Lane l's register r holds pair r ^ qs_mask(l) (q is stored so, see
// qs_row), which puts the pairs a lane keeps in d[0, W) and the ones it sends
// in d[W, 2W) on every lane: no select, and the same add (own partial plus
// the partner's, of the same pair) as a lane holding pair r in register r.
template <int O2, int W>
__device__ __forceinline__ void pair_step(float (&d)[AP]) {
#pragma unroll
    for (int i = 0; i < W; i++) d[i] = __fadd_rn(d[i], __shfl_xor_sync(0xffffffffu, d[W + i], O2));
}

// Which pair sits in register r of lane l in the score pass: r ^ qs_mask(l),
// the mask's bits 3, 2, 1, 0 being the lane's bits 16, 8, 4, 2 (the
// butterfly's steps), so that lane l ends with pair l / 2.
__device__ __forceinline__ int qs_mask(int lane) { return (lane >> 1) & 15; }

// The shared-memory row of pair p's q value at dim d (read only by lane d %
// 32): p ^ qs_mask(d % 32).
__device__ __forceinline__ int qs_row(int p, int d) { return p ^ qs_mask(d & 31); }

// Its column above head dim 128 (dim d otherwise): lane l's dims l + 32 c sit
// together two at a time (c = 2 k + i at 64 k + 2 l + i), so a lane reads
// two chunks' q with one float2 and a warp's float2s cover 256 contiguous
// bytes (no bank conflict). (Four at a time, the float4s' registers made the
// kernel spill.)
__device__ __forceinline__ int qs_col(int d) { return (d >> 6) * 64 + (d & 31) * 2 + ((d >> 5) & 1); }

// The butterfly as before session 10, for lanes holding pair r in register
// r (attention_tiles_q4_checked): a select per value sent and kept.
template <int O2, int W>
__device__ __forceinline__ void pair_step_sel(float (&d)[AP], int lane) {
    bool upper = (lane & O2) != 0;
#pragma unroll
    for (int i = 0; i < W; i++) {
        float lo = d[i], hi = d[W + i];
        float got = __shfl_xor_sync(0xffffffffu, upper ? lo : hi, O2);
        d[i] = __fadd_rn(upper ? hi : lo, got);
    }
}

__device__ __forceinline__ float pair_butterfly_sel(float (&d)[AP], int lane) {
    pair_step_sel<16, 8>(d, lane);
    pair_step_sel<8, 4>(d, lane);
    pair_step_sel<4, 2>(d, lane);
    pair_step_sel<2, 1>(d, lane);
    return __fadd_rn(d[0], __shfl_xor_sync(0xffffffffu, d[0], 1));
}

// The 16 pairs' butterfly of one key's partial dot products (see
// tile_scores): lane l returns pair l / 2's score.
__device__ __forceinline__ float pair_butterfly(float (&d)[AP]) {
    static_assert(AP == 16, "the butterfly's steps are written for 16 pairs");
    pair_step<16, 8>(d);
    pair_step<8, 4>(d);
    pair_step<4, 2>(d);
    pair_step<2, 1>(d);
    return __fadd_rn(d[0], __shfl_xor_sync(0xffffffffu, d[0], 1));
}

template <int NC, int KB, bool REG, bool SEL = false>
__device__ __forceinline__ float tile_scores(const float (*qs)[ATT_HD], float (*st)[ATT_T], const void* ck, int kvw,
                                             int g, int hd, int mylast, int j0, int jend, int np, float scale,
                                             int f16) {
    static_assert(!REG || NC <= 4, "q in registers for head dims up to 128");
    int t = threadIdx.x, warp = t / 32, lane = t % 32, mine = lane >> 1;
    float qr[REG ? AP : 1][REG ? NC : 1];
    if constexpr (REG) {
#pragma unroll
        for (int p = 0; p < AP; p++)
#pragma unroll
            for (int c = 0; c < NC; c++) qr[p][c] = qs[p][lane + 32 * c];
    }
    float mx = -INFINITY;
    for (int jb = warp; jb < ATT_T; jb += ATT_WARPS * KB) {
        if (j0 + jb >= jend) {  // uniform over the warp: no key of this step is in the tile
#pragma unroll
            for (int u = 0; u < KB; u++)
                if ((lane & 1) == 0) st[mine][jb + u * ATT_WARPS] = -INFINITY;
            continue;
        }
        float kr[KB][NC];
#pragma unroll
        for (int u = 0; u < KB; u++) {
            int j = j0 + jb + u * ATT_WARPS;
            i64 base = (i64)j * kvw + g * hd;
#pragma unroll
            for (int c = 0; c < NC; c++)
                kr[u][c] = j < jend && lane + 32 * c < hd ? kv_at(ck, base + lane + 32 * c, f16) : 0.0f;
        }
        float d[KB][AP];
#pragma unroll
        for (int u = 0; u < KB; u++)
#pragma unroll
            for (int p = 0; p < AP; p++) d[u][p] = 0.0f;
        // Each (key, pair) chain runs over the chunks c in order.
        if constexpr (REG || SEL || NC < 8) {
#pragma unroll
            for (int c = 0; c < NC; c++) {
                if (lane + 32 * c < hd) {
#pragma unroll
                    for (int p = 0; p < AP; p++) {
                        float qv;
                        if constexpr (REG) qv = qr[p][c];
                        else qv = qs[p][lane + 32 * c];
#pragma unroll
                        for (int u = 0; u < KB; u++) d[u][p] = __fmaf_rn(qv, kr[u][c], d[u][p]);
                    }
                }
            }
        } else {
            // Head dims over 128: q from shared memory two chunks a load
            // (qs_col); each chain still takes the chunks in order.
            static_assert(NC % 2 == 0, "two chunks a load");
#pragma unroll
            for (int k = 0; k < NC / 2; k++) {
#pragma unroll
                for (int p = 0; p < AP; p++) {
                    float2 q2 = *reinterpret_cast<const float2*>(&qs[p][64 * k + 2 * lane]);
                    float qv[2] = {q2.x, q2.y};
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        int c = 2 * k + i;
                        if (lane + 32 * c < hd)
#pragma unroll
                            for (int u = 0; u < KB; u++) d[u][p] = __fmaf_rn(qv[i], kr[u][c], d[u][p]);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < KB; u++) {
            int jj = jb + u * ATT_WARPS;  // < ATT_T: ATT_T is a multiple of ATT_WARPS * KB
            int j = j0 + jj;
            float s = SEL ? pair_butterfly_sel(d[u], lane) : pair_butterfly(d[u]);
            float v = -INFINITY;
            if (j < jend && mine < np && j <= mylast) {
                v = __fmul_rn(s, scale);
                mx = fmaxf(mx, v);
            }
            if ((lane & 1) == 0) st[mine][jj] = v;
        }
    }
    return mx;
}

// The softmax pieces of a tile for pairs 0..np-1, shared by every
// attention kernel: a pair's max over the warps' maxes, e = exp(s - max) in
// place (thread t owning slot t of every pair; exp(-inf) = 0 in the slots past
// the pair's keys), and each warp's sum of its slots by a butterfly. `st`
// holds a pair's slots `sst` floats apart.
// One pair's softmax step for this thread's slot: e = exp(s - mxp) in
// place (0 where the pair has no key), then the warp's sum of its slots by
// the fixed xor butterfly.
__device__ __forceinline__ float softmax_slot(float* slot, float mxp) {
    float e = 0.0f;
    if (mxp != -INFINITY) {
        e = expf(__fsub_rn(*slot, mxp));
        *slot = e;
    }
    for (int o2 = 16; o2 > 0; o2 /= 2) e = __fadd_rn(e, __shfl_xor_sync(0xffffffffu, e, o2));
    return e;
}

// softmax_slot's warp sum without shuffles: the same xor butterfly's
// result (every lane of it ends with the same bits, as fadd commutes),
// added up by one thread from the warp's 32 exps in shared memory (e[0..32),
// 16-byte aligned): a_i = e_i + e_{i+16}, b_i = a_i + a_{i+8}, c_i = b_i +
// b_{i+4}, d_i = c_i + c_{i+2}, then d_0 + d_1.
__device__ __forceinline__ float warp_slots_sum(const float* e) {
    float v[32];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 x = reinterpret_cast<const float4*>(e)[i];
        v[4 * i] = x.x, v[4 * i + 1] = x.y, v[4 * i + 2] = x.z, v[4 * i + 3] = x.w;
    }
#pragma unroll
    for (int i = 0; i < 16; i++) v[i] = __fadd_rn(v[i], v[i + 16]);
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = __fadd_rn(v[i], v[i + 8]);
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = __fadd_rn(v[i], v[i + 4]);
    v[0] = __fadd_rn(v[0], v[2]);
    v[1] = __fadd_rn(v[1], v[3]);
    return __fadd_rn(v[0], v[1]);
}

// A pair's max over the warps' maxes, in warp order.
__device__ __forceinline__ float pair_max(const float* wmax) {
    float mxp = wmax[0];
    for (int w = 1; w < ATT_WARPS; w++) mxp = fmaxf(mxp, wmax[w]);
    return mxp;
}

// l_b: the fixed tree over the 8 warps' sums.
__device__ __forceinline__ float warp_sum_tree(const float* w) {
    return __fadd_rn(__fadd_rn(__fadd_rn(w[0], w[1]), __fadd_rn(w[2], w[3])),
                     __fadd_rn(__fadd_rn(w[4], w[5]), __fadd_rn(w[6], w[7])));
}

__device__ __forceinline__ void tile_softmax(float* st, int sst, const float (*smax)[ATT_WARPS],
                                             float (*wsum)[ATT_WARPS], float* pmax, int np) {
    int t = threadIdx.x, warp = t / 32, lane = t % 32;
    for (int p = 0; p < np; p++) {
        float mxp = pair_max(smax[p]);
        float e = softmax_slot(&st[p * sst + t], mxp);
        if (lane == 0) wsum[p][warp] = e;
        if (t == 0) pmax[p] = mxp;
    }
}

// Pair t's (m_b, l_b) of tile b, l_b the fixed tree over the 8 warps' sums,
// for a live pair with a key in the tile (every attention kernel).
__device__ __forceinline__ void tile_write_pml(const float (*wsum)[ATT_WARPS], const float* pmax, float* pml,
                                               int np, int gs, int hq, int g, int r0, int pos0, int j0, int b,
                                               int nb) {
    int t = threadIdx.x;
    if (t < np && j0 <= pos0 + r0 + t / gs) {
        float l = warp_sum_tree(wsum[t]);
        i64 pair = (i64)(r0 + t / gs) * hq + g * gs + t % gs;
        pml[(pair * nb + b) * 2] = pmax[t];
        pml[(pair * nb + b) * 2 + 1] = l;
    }
}

// Attention in fixed key tiles. For the (row, head) pair at position p (keys
// 0..=p), tile b covers keys [256 b, min(256 b + 256, p + 1)) and computes
//   s_j  = (lane l's fma chain over dims l, l + 32, ... then a fixed xor
//          butterfly) * scale,
//   m_b  = max of the tile's s_j,
//   e_j  = exp(s_j - m_b), zero in the tile's slots past p,
//   l_b  = sum of the 256 slots (a butterfly in each warp, then a fixed tree
//          over the 8 warps),
//   a_b  = per output dim, the fma chain of e_j * v_j over the keys in order;
// then `attention_combine` folds the tiles in order: M = max m_b,
// w_b = exp(m_b - M), l = chain of l_b * w_b, o = (fma chain of a_b * w_b) / l.
// Every step depends on the head dim and the position only: not on m, on
// which rows share a block, or on the other rows, so decode (m = 1) and a
// prefill chunk run this one kernel and get the same bytes. The tiles make a
// long context parallel (a block per KV head and tile) instead of one
// sequential chain per output.
//
// A step's rows may come in several calls (row groups, to bound the
// partials' memory): a call's row r is the step's row rbase + r, at position
// *posp + rbase + r; nothing else changes.
//
// Block (g, y, b): KV head g, a tile of rows (16 / gs rows x the gs query
// heads of the group = up to 16 pairs, each key and value row read once for
// all of them), key tile b. Writes pml[(pair, b)] = (m_b, l_b) and
// pacc[(pair, b)] = a_b for pairs with a key in the tile; `nb` tiles per pair.
//
// V = 1 (attention_tiles_q4) differs only in the score pass of head dims 65
// to 128: q read from shared memory, four keys a step, instead of q in
// registers one key a step: the same terms in the same order.
// NEW = 0 (attention_tiles_q4_checked): the value pass checking every key
// and the score pass's butterfly with selects over q stored unpermuted, as
// before session 10, to show the session-10 forms compute the same bytes.
template <int V, int NEW = 1>
__device__ __forceinline__ void attention_tiles_k(const float* q, const void* ck, const void* cv, float* pml,
                                                  float* pacc, int m, int hq, int hkv, int hd, const int* posp,
                                                  int rbase, float scale, int f16, int nb) {
    int pos0 = *posp + rbase;  // this call's row 0 is row rbase of the step
    __shared__ __align__(16) float qs[AP][ATT_HD];  // float4 reads in the score pass
    __shared__ __align__(16) float st[AP][ATT_T];  // 16-byte rows: the value pass reads float4s
    __shared__ float smax[AP][ATT_WARPS];
    __shared__ float wsum[AP][ATT_WARPS];
    __shared__ float pmax[AP];
    int t = threadIdx.x, warp = t / 32, lane = t % 32;
    int gs = hq / hkv, rows = AP / gs;
    int g = blockIdx.x, r0 = blockIdx.y * rows, b = blockIdx.z;
    int np = min(rows, m - r0) * gs;  // live pairs: pair p = (row r0 + p / gs, head g * gs + p % gs)
    int j0 = b * ATT_T;
    int nmax = pos0 + r0 + np / gs;  // keys of the block's last row
    if (j0 >= nmax) return;          // the whole block: no pair reaches this tile
    int jend = min(j0 + ATT_T, nmax);
    int kvw = hkv * hd;
    for (int i = t; i < AP * ATT_HD; i += ATT_THREADS) {
        int p = i / ATT_HD, d = i % ATT_HD;
        float v = 0.0f;
        if (p < np && d < hd) v = q[((i64)(r0 + p / gs) * hq + g * gs + p % gs) * hd + d];
        // Row p ^ qs_mask(d % 32) (see pair_step); above head dim 128, column
        // qs_col(d) (the score pass reads four chunks a load there).
        qs[NEW ? qs_row(p, d) : p][NEW && hd > 128 ? qs_col(d) : d] = v;
    }
    __syncthreads();
    // Scores, one warp per key (tile_scores); q in registers for head dims
    // up to 128, read from shared memory for larger ones.
    int mine = lane >> 1;
    float mx;
    int last = pos0 + r0 + mine / gs;
    if (hd <= 32) mx = tile_scores<1, 1, true, !NEW>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    else if (hd <= 64) mx = tile_scores<2, 1, true, !NEW>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    else if (hd <= 128 && V == 0) mx = tile_scores<4, 1, true, !NEW>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    else if (hd <= 128) mx = tile_scores<4, 4, false, !NEW>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    else mx = tile_scores<8, ATT_KB, false, !NEW>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    if ((lane & 1) == 0) smax[mine][warp] = mx;
    __syncthreads();
    tile_softmax(&st[0][0], ATT_T, smax, wsum, pmax, np);
    __syncthreads();
    // Values: keys in order for each (pair, dim). Head dims below 256 split
    // the pairs over G groups of threads (pair p to group p % G), so every
    // thread works; each (pair, dim) is one thread's fma chain.
    int hdp = (hd + 31) / 32 * 32;
    switch (ATT_THREADS % hdp == 0 ? ATT_THREADS / hdp : 1) {
    case 8: tile_values<8, NEW>(cv, st, pacc, hdp, kvw, np, gs, g, hq, hd, r0, pos0, j0, jend, b, nb, f16); break;
    case 4: tile_values<4, NEW>(cv, st, pacc, hdp, kvw, np, gs, g, hq, hd, r0, pos0, j0, jend, b, nb, f16); break;
    case 2: tile_values<2, NEW>(cv, st, pacc, hdp, kvw, np, gs, g, hq, hd, r0, pos0, j0, jend, b, nb, f16); break;
    default: tile_values<1, NEW>(cv, st, pacc, hdp, kvw, np, gs, g, hq, hd, r0, pos0, j0, jend, b, nb, f16); break;
    }
    tile_write_pml(wsum, pmax, pml, np, gs, hq, g, r0, pos0, j0, b, nb);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq,
                    int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_tiles_k<0>(q, ck, cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_q4(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq,
                       int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_tiles_k<1>(q, ck, cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

// ---- attention_tiles_q4p: attention_tiles_q4's arithmetic in lean code
//
// The same scores, softmax, value sums and partials as attention_tiles_q4,
// term for term and in the same order (GPU test
// `attention_at_the_real_models_head_shapes` compares the bytes), with less
// work around the fmas (ncu, session 14: the q4 kernel issued ~3 instructions
// per fma):
// * the cache's element type fixed per instantiation (f32 or f16), not
//   tested per load;
// * K and V rows addressed from the tile's base with 32-bit offsets and no
//   bound check on score steps whose keys all lie in the tile;
// * each pair's row, key count and output index computed once a block
//   (shared memory) instead of divided out per element;
// * the softmax's per-pair max taken once (thread p), its score rows 4
//   floats longer (the score stores of a key fall on 8 banks, not one), and
//   warps past the tile's keys skipped;
// * the value pass's loads 8 keys ahead for head dims up to 128.
// Head dims of 128 and 256 take these passes; others run attention_tiles_q4's.
#define ATT_S (ATT_T + 4)  // score row stride of the lean kernel

__device__ __forceinline__ float kv_ld(const float* p) { return *p; }
__device__ __forceinline__ float kv_ld(const u16* p) { return f16_to_f32(*p); }

// The score pass of attention_tiles_q4 for head dims 128 (NC = 4, KB = 4,
// q one chunk a load) and 256 (NC = 8, KB = ATT_KB, q two chunks a load):
// tile_scores<NC, KB, false> with kt the tile's first key row of KV head g,
// n its keys and mylast the lane's pair's last key, both relative to the
// tile. For H halves of 16 pairs (qs and st rows h * 16 ..; nph[h] pairs
// in half h, mylast[h] and mx[h] for the lane's pair h * 16 + lane / 2)
// each step's key rows are loaded once and each half then runs as one.
template <int NC, int KB, int H, typename T>
__device__ __forceinline__ void lean_scores_h(const float (*qs)[ATT_HD], float (*st)[ATT_S], const T* kt, int kvw,
                                              const int (&mylast)[H], int n, const int (&nph)[H], float scale,
                                              float (&mx)[H]) {
    int t = threadIdx.x, warp = t / 32, lane = t % 32, mine = lane >> 1;
#pragma unroll
    for (int h = 0; h < H; h++) mx[h] = -INFINITY;
    for (int jb = warp; jb < ATT_T; jb += ATT_WARPS * KB) {
        if (jb >= n) {  // uniform over the warp: no key of this step is in the tile
#pragma unroll
            for (int h = 0; h < H; h++)
#pragma unroll
                for (int u = 0; u < KB; u++)
                    if ((lane & 1) == 0) st[h * AP + mine][jb + u * ATT_WARPS] = -INFINITY;
            continue;
        }
        float kr[KB][NC];
        if (jb + (KB - 1) * ATT_WARPS < n) {  // every key of the step in the tile
#pragma unroll
            for (int u = 0; u < KB; u++) {
                const T* row = kt + (jb + u * ATT_WARPS) * kvw + lane;
#pragma unroll
                for (int c = 0; c < NC; c++) kr[u][c] = kv_ld(row + 32 * c);
            }
        } else {
#pragma unroll
            for (int u = 0; u < KB; u++) {
                int jj = jb + u * ATT_WARPS;
                const T* row = kt + jj * kvw + lane;
#pragma unroll
                for (int c = 0; c < NC; c++) kr[u][c] = jj < n ? kv_ld(row + 32 * c) : 0.0f;
            }
        }
#pragma unroll
        for (int h = 0; h < H; h++) {
            if (H > 1 && nph[h] == 0) {  // uniform: no pair in this half
#pragma unroll
                for (int u = 0; u < KB; u++)
                    if ((lane & 1) == 0) st[h * AP + mine][jb + u * ATT_WARPS] = -INFINITY;
                continue;
            }
            const float (*qh)[ATT_HD] = qs + h * AP;
            float d[KB][AP];
#pragma unroll
            for (int u = 0; u < KB; u++)
#pragma unroll
                for (int p = 0; p < AP; p++) d[u][p] = 0.0f;
            if constexpr (NC <= 4) {
#pragma unroll
                for (int c = 0; c < NC; c++)
#pragma unroll
                    for (int p = 0; p < AP; p++) {
                        float qv = qh[p][lane + 32 * c];
#pragma unroll
                        for (int u = 0; u < KB; u++) d[u][p] = __fmaf_rn(qv, kr[u][c], d[u][p]);
                    }
            } else {
#pragma unroll
                for (int k = 0; k < NC / 2; k++)
#pragma unroll
                    for (int p = 0; p < AP; p++) {
                        float2 q2 = *reinterpret_cast<const float2*>(&qh[p][64 * k + 2 * lane]);
                        float qv[2] = {q2.x, q2.y};
#pragma unroll
                        for (int i = 0; i < 2; i++)
#pragma unroll
                            for (int u = 0; u < KB; u++) d[u][p] = __fmaf_rn(qv[i], kr[u][2 * k + i], d[u][p]);
                    }
            }
#pragma unroll
            for (int u = 0; u < KB; u++) {
                int jj = jb + u * ATT_WARPS;
                float sc = pair_butterfly(d[u]);
                float v = -INFINITY;
                if (jj < n && mine < nph[h] && jj <= mylast[h]) {
                    v = __fmul_rn(sc, scale);
                    mx[h] = fmaxf(mx[h], v);
                }
                if ((lane & 1) == 0) st[h * AP + mine][jj] = v;
            }
        }
    }
}

// The value pass of attention_tiles_q4 (tile_values<G>): thread t's dim
// t % hd for pairs t / hd, t / hd + G, ...; vt the tile's first value row
// of KV head g; cnt0[p] pair p's keys in the tile (0 for none).
template <int G, typename T>
__device__ __forceinline__ void lean_values(const T* vt, const float (*st)[ATT_S], float* pacc, int kvw, int hd,
                                            const int* cnt0, const int* pout, int n, int b, int nb) {
    constexpr int P = AP / G;
    int t = threadIdx.x, dim = t % hd, grp = t / hd;
    if (grp >= G) return;
    int cnt[P];
    float acc[P];
#pragma unroll
    for (int i = 0; i < P; i++) {
        cnt[i] = cnt0[grp + G * i];
        acc[i] = 0.0f;
    }
    int jj = 0, full = n;
#pragma unroll
    for (int i = 0; i < P; i++)
        if (cnt[i] > 0) full = min(full, cnt[i]);
    const T* col = vt + dim;
    if constexpr (G >= 2) {  // eight keys a step, the next eight loaded first
        float nv[8];
        if (full >= 8) {
#pragma unroll
            for (int u = 0; u < 8; u++) nv[u] = kv_ld(col + u * kvw);
        }
        for (; jj + 8 <= full; jj += 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = nv[u];
            if (jj + 16 <= full) {
                const T* r = col + (jj + 8) * kvw;
#pragma unroll
                for (int u = 0; u < 8; u++) nv[u] = kv_ld(r + u * kvw);
            }
#pragma unroll
            for (int i = 0; i < P; i++) {
                float4 s0 = *reinterpret_cast<const float4*>(&st[grp + G * i][jj]);
                float4 s1 = *reinterpret_cast<const float4*>(&st[grp + G * i][jj + 4]);
                acc[i] = __fmaf_rn(s0.x, v[0], acc[i]);
                acc[i] = __fmaf_rn(s0.y, v[1], acc[i]);
                acc[i] = __fmaf_rn(s0.z, v[2], acc[i]);
                acc[i] = __fmaf_rn(s0.w, v[3], acc[i]);
                acc[i] = __fmaf_rn(s1.x, v[4], acc[i]);
                acc[i] = __fmaf_rn(s1.y, v[5], acc[i]);
                acc[i] = __fmaf_rn(s1.z, v[6], acc[i]);
                acc[i] = __fmaf_rn(s1.w, v[7], acc[i]);
            }
        }
    }
    for (; jj + 4 <= full; jj += 4) {
        const T* r = col + jj * kvw;
        float v0 = kv_ld(r), v1 = kv_ld(r + kvw), v2 = kv_ld(r + 2 * kvw), v3 = kv_ld(r + 3 * kvw);
#pragma unroll
        for (int i = 0; i < P; i++) {
            float4 s4 = *reinterpret_cast<const float4*>(&st[grp + G * i][jj]);
            acc[i] = __fmaf_rn(s4.x, v0, acc[i]);
            acc[i] = __fmaf_rn(s4.y, v1, acc[i]);
            acc[i] = __fmaf_rn(s4.z, v2, acc[i]);
            acc[i] = __fmaf_rn(s4.w, v3, acc[i]);
        }
    }
    for (; jj + 4 <= n; jj += 4) {
        const T* r = col + jj * kvw;
        float v0 = kv_ld(r), v1 = kv_ld(r + kvw), v2 = kv_ld(r + 2 * kvw), v3 = kv_ld(r + 3 * kvw);
#pragma unroll
        for (int i = 0; i < P; i++) {
            float4 s4 = *reinterpret_cast<const float4*>(&st[grp + G * i][jj]);
            if (jj < cnt[i]) acc[i] = __fmaf_rn(s4.x, v0, acc[i]);
            if (jj + 1 < cnt[i]) acc[i] = __fmaf_rn(s4.y, v1, acc[i]);
            if (jj + 2 < cnt[i]) acc[i] = __fmaf_rn(s4.z, v2, acc[i]);
            if (jj + 3 < cnt[i]) acc[i] = __fmaf_rn(s4.w, v3, acc[i]);
        }
    }
    for (; jj < n; jj++) {
        float v = kv_ld(col + jj * kvw);
#pragma unroll
        for (int i = 0; i < P; i++)
            if (jj < cnt[i]) acc[i] = __fmaf_rn(st[grp + G * i][jj], v, acc[i]);
    }
#pragma unroll
    for (int i = 0; i < P; i++)
        if (cnt[i] > 0) pacc[((i64)pout[grp + G * i] * nb + b) * hd + dim] = acc[i];
}

// Four consecutive values of a cache row as floats (16-byte aligned for f32,
// 8-byte for f16).
__device__ __forceinline__ float4 kv_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 kv_ld4(const u16* p) {
    uint2 h = *reinterpret_cast<const uint2*>(p);
    return make_float4(f16_to_f32((u16)(h.x & 0xffff)), f16_to_f32((u16)(h.x >> 16)), f16_to_f32((u16)(h.y & 0xffff)),
                       f16_to_f32((u16)(h.y >> 16)));
}

// One key's fma into one pair's 4 dims (q4w's value pass).
__device__ __forceinline__ void pair_fma4(float (&a)[4], float s, float4 v) {
    a[0] = __fmaf_rn(s, v.x, a[0]);
    a[1] = __fmaf_rn(s, v.y, a[1]);
    a[2] = __fmaf_rn(s, v.z, a[2]);
    a[3] = __fmaf_rn(s, v.w, a[3]);
}

// One key's fma into a thread's P pairs x 4 dims.
template <int P>
__device__ __forceinline__ void wide_key(float (&acc)[P][4], const float (&s)[P], float4 v) {
#pragma unroll
    for (int i = 0; i < P; i++) pair_fma4(acc[i], s[i], v);
}

// The value pass of attention_tiles_q4 with a thread per four consecutive
// dims and P consecutive pairs (q4w): thread t takes dims 4 (t % (hd / 4))
// .. + 3 of pairs P (t / (hd / 4)) .. + P - 1, P = AP / (ATT_THREADS /
// (hd / 4)) (2 at head dim 128, 4 at 256), so one float4 of a value row
// serves 4 P fmas and one float4 of a pair's scores 16. Each (pair, dim) is
// the same fma chain over the tile's keys in order as lean_values.
template <int P, int K, typename T>
__device__ __forceinline__ void wide_values(const T* vt, const float (*st)[ATT_S], float* pacc, int kvw, int hd,
                                            const int* cnt0, const int* pout, int n, int b, int nb) {
    static_assert(K == 4 || K == 8, "keys a step");
    int t = threadIdx.x, nq = hd / 4, dq = t % nq, p0 = (t / nq) * P;
    int cnt[P];
    float acc[P][4];
#pragma unroll
    for (int i = 0; i < P; i++) {
        cnt[i] = cnt0[p0 + i];
#pragma unroll
        for (int e = 0; e < 4; e++) acc[i][e] = 0.0f;
    }
    int jj = 0, full = n;
#pragma unroll
    for (int i = 0; i < P; i++)
        if (cnt[i] > 0) full = min(full, cnt[i]);
    const T* col = vt + 4 * dq;
    // K keys a step, the next K's values loaded first.
    float4 nv[K];
    if (full >= K) {
#pragma unroll
        for (int u = 0; u < K; u++) nv[u] = kv_ld4(col + u * kvw);
    }
    for (; jj + K <= full; jj += K) {
        float4 v[K];
#pragma unroll
        for (int u = 0; u < K; u++) v[u] = nv[u];
        if (jj + 2 * K <= full) {
            const T* r = col + (jj + K) * kvw;
#pragma unroll
            for (int u = 0; u < K; u++) nv[u] = kv_ld4(r + u * kvw);
        }
#pragma unroll
        for (int h = 0; h < K / 4; h++) {
            float s[4][P];
#pragma unroll
            for (int i = 0; i < P; i++) {
                float4 s4 = *reinterpret_cast<const float4*>(&st[p0 + i][jj + 4 * h]);
                s[0][i] = s4.x, s[1][i] = s4.y, s[2][i] = s4.z, s[3][i] = s4.w;
            }
#pragma unroll
            for (int u = 0; u < 4; u++) wide_key<P>(acc, s[u], v[4 * h + u]);
        }
    }
    for (; jj < n; jj++) {
        float4 v = kv_ld4(col + jj * kvw);
        float s[P];
#pragma unroll
        for (int i = 0; i < P; i++) s[i] = st[p0 + i][jj];
#pragma unroll
        for (int i = 0; i < P; i++)
            if (jj < cnt[i]) pair_fma4(acc[i], s[i], v);
    }
#pragma unroll
    for (int i = 0; i < P; i++)
        if (cnt[i] > 0)
            *reinterpret_cast<float4*>(&pacc[((i64)pout[p0 + i] * nb + b) * hd + 4 * dq]) =
                make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
}

// W: the value pass in wide_values (q4w) instead of lean_values (q4p). H:
// halves of AP pairs a block (H = 2, attention_tiles_q4w2, takes W; its q
// and score rows live in ATT_P32_SMEM bytes of dynamic shared memory).
template <typename T, bool W = false, int H = 1, int KB2 = ATT_KB>
__device__ __forceinline__ void attention_lean_k(const float* q, const T* ck, const T* cv, float* pml, float* pacc,
                                                 int m, int hq, int hkv, int hd, const int* posp, int rbase,
                                                 float scale, int nb) {
    static_assert(H == 1 || (H == 2 && W), "two halves take the wide value pass");
    constexpr int NP = H * AP;  // pairs a block
    int pos0 = *posp + rbase;
    __shared__ __align__(16) float qs1[H == 1 ? AP : 1][ATT_HD];
    __shared__ __align__(16) float st1[H == 1 ? AP : 1][ATT_S];
    extern __shared__ __align__(16) float att_dyn[];
    float (*qs)[ATT_HD] = H == 1 ? qs1 : reinterpret_cast<float (*)[ATT_HD]>(att_dyn);
    float (*st)[ATT_S] = H == 1 ? st1 : reinterpret_cast<float (*)[ATT_S]>(att_dyn + NP * ATT_HD);
    __shared__ float smax[NP][ATT_WARPS];
    __shared__ float wsum[NP][ATT_WARPS];
    __shared__ float pmax[NP];
    __shared__ int prow[NP];  // pair p's row in the block (p / gs)
    __shared__ int pout[NP];  // its (row, head) index in q and the partials
    __shared__ int pcnt[NP];  // its keys in this tile (0: none, or not live)
    int t = threadIdx.x, warp = t / 32, lane = t % 32;
    int gs = hq / hkv, rows = NP / gs;
    int g = blockIdx.x, r0 = blockIdx.y * rows, b = blockIdx.z;
    int np = min(rows, m - r0) * gs;
    int j0 = b * ATT_T;
    int nmax = pos0 + r0 + np / gs;
    if (j0 >= nmax) return;
    int n = min(j0 + ATT_T, nmax) - j0;  // the tile's keys
    int kvw = hkv * hd;
    if (t < NP) {
        int r = t / gs;
        prow[t] = r;
        pout[t] = (r0 + r) * hq + g * gs + t % gs;
        pcnt[t] = t < np ? min(n, pos0 + r0 + r + 1 - j0) : 0;
    }
    __syncthreads();
    // q rows as attention_tiles_k stores them (qs_row, qs_col), per half:
    // pair h * AP + p at row h * AP + (p ^ qs_mask(d % 32)), above head dim
    // 128 column qs_col(d). Every pair's value is loaded before any is
    // stored, so the block waits on memory once, not once a pair (ncu,
    // session 23: the loop storing each value as it came took 17% of
    // attention_tiles_q4w2's samples).
    float qv[NP];
#pragma unroll
    for (int p = 0; p < NP; p++) qv[p] = p < np && t < hd ? q[(i64)pout[p] * hd + t] : 0.0f;
#pragma unroll
    for (int p = 0; p < NP; p++) {
        int row = H == 1 ? qs_row(p, t) : (p & ~(AP - 1)) + qs_row(p & (AP - 1), t);
        if (t < ATT_HD) qs[row][hd > 128 ? qs_col(t) : t] = qv[p];
    }
    __syncthreads();
    const i64 tile0 = (i64)j0 * kvw + g * hd;
    int mine = lane >> 1;
    int mylast[H], nph[H];
#pragma unroll
    for (int h = 0; h < H; h++) {
        mylast[h] = pos0 + r0 + prow[h * AP + mine] - j0;
        nph[h] = H == 1 ? np : h == 0 ? min(np, AP) : max(np - AP, 0);
    }
    float mx[H];
    if (hd == 128) lean_scores_h<4, 4, H>(qs, st, ck + tile0, kvw, mylast, n, nph, scale, mx);
    else lean_scores_h<8, KB2, H>(qs, st, ck + tile0, kvw, mylast, n, nph, scale, mx);
    if ((lane & 1) == 0)
#pragma unroll
        for (int h = 0; h < H; h++) smax[h * AP + mine][warp] = mx[h];
    __syncthreads();
    if (t < np) pmax[t] = pair_max(smax[t]);  // once per pair
    __syncthreads();
    // The exps, then each warp's sum of its 32 slots per pair: softmax_slot's
    // exp and butterfly, the butterfly's sum added up by lane p for pair p
    // (warp_slots_sum), so no shuffles. A pair without a key in the tile
    // (max -inf) gets 0 in its slots, as softmax_slot's e is 0 there; its
    // sums are 0 and its value chains are never written.
    if (warp * 32 < n) {
#pragma unroll 4
        for (int p = 0; p < np; p++) {
            float mxp = pmax[p];
            float e = 0.0f;  // softmax_slot's exp (its store is unconditional here)
            if (mxp != -INFINITY) e = expf(__fsub_rn(st[p][t], mxp));
            st[p][t] = e;
        }
        __syncwarp();
        if (lane < np) wsum[lane][warp] = warp_slots_sum(&st[lane][warp * 32]);
    } else if (lane < np) {  // no key in this warp's slots: e = 0 in each
        wsum[lane][warp] = 0.0f;
    }
    __syncthreads();
    // Each value pass's threads cover the block's NP pairs (P = NP / the
    // thread groups of hd / 4).
    if (H == 2 && hd == 128) wide_values<4, 8>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    else if (H == 2) wide_values<8, 4>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    else if (W && hd == 128) wide_values<2, 8>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    else if (W) wide_values<4, 4>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    else if (hd == 128) lean_values<2>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    else lean_values<1>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    if (t < np && pcnt[t] > 0) {
        float l = warp_sum_tree(wsum[t]);
        pml[((i64)pout[t] * nb + b) * 2] = pmax[t];
        pml[((i64)pout[t] * nb + b) * 2 + 1] = l;
    }
}

// The lean kernels' entry: head dims 128 and 256 (the real models') in lean
// code, others in attention_tiles_q4's code.
template <bool W>
__device__ __forceinline__ void attention_lean_entry(const float* q, const void* ck, const void* cv, float* pml,
                                                     float* pacc, int m, int hq, int hkv, int hd, const int* posp,
                                                     int rbase, float scale, int f16, int nb) {
    if (hd != 128 && hd != 256)
        attention_tiles_k<1>(q, ck, cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
    else if (f16)
        attention_lean_k<u16, W>(q, (const u16*)ck, (const u16*)cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale,
                                 nb);
    else
        attention_lean_k<float, W>(q, (const float*)ck, (const float*)cv, pml, pacc, m, hq, hkv, hd, posp, rbase,
                                   scale, nb);
}

// attention_tiles_q4's bytes in lean code for head dims 128 and 256 (the
// real models'); other head dims run attention_tiles_q4's code
// (`SAMESUM_CUDA_ATT_Q4P`).
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_q4p(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq,
                        int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_lean_entry<false>(q, ck, cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

// attention_tiles_q4p with a wider value pass (`SAMESUM_CUDA_ATT_Q4W`, the
// default): each thread takes four consecutive dims of 2 (head dim 128, 8
// keys a step) or 4 (256, 4 keys a step) pairs (wide_values). The same terms
// in the same order: the same bytes as attention_tiles_q4. Measured on the
// H200 (session 15, pp4096): qwen35moe (head dim 256) 70.5 -> 63.8 ms;
// qwen3moe (128) 407 -> 409 ms, no change.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_q4w(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq,
                        int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_lean_entry<true>(q, ck, cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

// ---- 32 pairs a block (ATT_P32)
//
// attention_tiles_q4w with two 16-pair halves a block (4 rows at 8 query
// heads a KV head): each key row of the tile is loaded once for both halves
// in the score pass and each value row once for all 32 pairs in the value
// pass, so a prefill reads the cache from L2 half as often per pair. Every
// pair's score (its fma chains and butterfly, lean_scores_h's), max, exps,
// sums and value chains are the 16-pair kernel's, so the same bytes
// (attention_lean_k with H = 2). q and the scores live in dynamic shared
// memory (ATT_P32_SMEM bytes; backend.rs sizes the launch alike).
#define ATT_P32_SMEM (2 * AP * (ATT_HD + ATT_S) * 4)

// attention_tiles_q4w at 32 pairs a block (`SAMESUM_CUDA_ATT_P32`): head
// dims 128 and 256 with query groups dividing 16 (the launcher checks);
// ATT_P32_SMEM bytes of dynamic shared memory. The same bytes.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_q4w2(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq,
                         int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    if (f16)
        attention_lean_k<u16, true, 2>(q, (const u16*)ck, (const u16*)cv, pml, pacc, m, hq, hkv, hd, posp, rbase,
                                       scale, nb);
    else
        attention_lean_k<float, true, 2>(q, (const float*)ck, (const float*)cv, pml, pacc, m, hq, hkv, hd, posp,
                                         rbase, scale, nb);
}

// attention_tiles_q4w2 with four keys a score step at head dims over 128
// (`SAMESUM_CUDA_ATT_KB4`, opt-in until measured): each q value read from
// shared memory serves four keys instead of two (the score pass's q loads
// were ~15% of the kernel's instructions, session 23), at ~167 registers,
// so one block an SM instead of two. Each score's chains and butterfly are
// lean_scores_h's: the same bytes. Head dim 128 already takes four keys.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_q4w2k4(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq,
                           int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    if (f16)
        attention_lean_k<u16, true, 2, 4>(q, (const u16*)ck, (const u16*)cv, pml, pacc, m, hq, hkv, hd, posp, rbase,
                                          scale, nb);
    else
        attention_lean_k<float, true, 2, 4>(q, (const float*)ck, (const float*)cv, pml, pacc, m, hq, hkv, hd, posp,
                                            rbase, scale, nb);
}

// attention_tiles_q4 as before session 10 (NEW = 0: every key of the value
// pass bound-checked, the score butterfly with selects), kept to show the
// session-10 forms compute the same bytes (`SAMESUM_CUDA_ATT_VFULL=0`).
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_q4_checked(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m,
                               int hq, int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_tiles_k<1, 0>(q, ck, cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

// ---- Decode attention in compact code (ATT_ONE)
//
// attention_tiles_q4's tile for one row (m = 1: the gs pairs of KV head g at
// position pos0), with its loops rolled: each block still takes one KV head
// and one key tile, and each score, max, exp, sum and value chain is the
// tile kernel's. Scores: a warp per key (keys warp, warp + 8, ...), lane l
// over dims l, l + 32, ... in order (the chunk loop rolled), the 16 packed
// pairs' butterfly (pair_butterfly, q stored permuted as the tile kernel
// stores it); the running max is the same max whatever the keys' order.
// Values: a thread per (dim, pair group), the chain over the keys in order
// (the key loop rolled). ncu (session 12) had attention_tiles_q4 at 21.5 us
// a decode launch with a context of one key, bound by fetching ~2,170
// distinct instructions once each.
template <int G>
__device__ __forceinline__ void one_values(const void* cv, const float (*st)[ATT_T], float* pacc, int hdp, int kvw,
                                           int np, int g, int gs, int hd, int n, int j0, int b, int nb, int f16) {
    constexpr int P = AP / G;
    int t = threadIdx.x, dim = t % hdp, grp = t / hdp;
    if (dim >= hd || grp >= G) return;
    float acc[P];
#pragma unroll
    for (int i = 0; i < P; i++) acc[i] = 0.0f;
    const i64 at0 = (i64)j0 * kvw + g * hd + dim;
    // Eight keys' values loaded together, then the chains key by key.
#pragma unroll 1
    for (int j8 = 0; j8 < n; j8 += 8) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = j8 + u < n ? kv_at(cv, at0 + (i64)(j8 + u) * kvw, f16) : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (j8 + u < n)
#pragma unroll
                for (int i = 0; i < P; i++) acc[i] = __fmaf_rn(st[grp + G * i][j8 + u], v[u], acc[i]);
    }
#pragma unroll
    for (int i = 0; i < P; i++) {
        int p = grp + G * i;
        if (p < np) pacc[(((i64)g * gs + p) * nb + b) * hd + dim] = acc[i];
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_one(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq, int hkv,
                  int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    __shared__ __align__(16) float qs[AP][ATT_HD];
    __shared__ __align__(16) float st[AP][ATT_T];
    __shared__ float smax[AP][ATT_WARPS];
    __shared__ float wsum[AP][ATT_WARPS];
    __shared__ float pmax[AP];
    int pos0 = *posp + rbase;
    int t = threadIdx.x, warp = t / 32, lane = t % 32, mine = lane >> 1;
    int gs = hq / hkv, np = gs;  // one row: pairs (row 0, head g * gs + p)
    int g = blockIdx.x, b = blockIdx.z;
    int j0 = b * ATT_T;
    if (j0 > pos0) return;  // the whole block: the row's keys end before this tile
    int jend = min(j0 + ATT_T, pos0 + 1);
    int kvw = hkv * hd;
    bool wide = hd > 128;
#pragma unroll 1
    for (int i = t; i < AP * ATT_HD; i += ATT_THREADS) {
        int p = i / ATT_HD, d = i % ATT_HD;
        float v = p < np && d < hd ? q[((i64)g * gs + p) * hd + d] : 0.0f;
        qs[qs_row(p, d)][wide ? qs_col(d) : d] = v;
    }
    __syncthreads();
    float mx = -INFINITY;
    int nc = (hd + 31) / 32;
#pragma unroll 1
    for (int jj = warp; jj < ATT_T; jj += ATT_WARPS) {
        int j = j0 + jj;
        if (j >= jend) {  // uniform over the warp
            if ((lane & 1) == 0) st[mine][jj] = -INFINITY;
            continue;
        }
        const i64 base = (i64)j * kvw + g * hd;
        // The key's chunks loaded together (one wait on memory a key), then
        // each pair's chain over the chunks in order.
        float kr[ATT_HD / 32];
#pragma unroll
        for (int c = 0; c < ATT_HD / 32; c++) kr[c] = c < nc && lane + 32 * c < hd ? kv_at(ck, base + lane + 32 * c, f16) : 0.0f;
        float d[AP];
#pragma unroll
        for (int p = 0; p < AP; p++) d[p] = 0.0f;
#pragma unroll
        for (int c = 0; c < ATT_HD / 32; c++) {
            int dd = lane + 32 * c;
            if (c < nc && dd < hd) {
                int col = wide ? qs_col(dd) : dd;
#pragma unroll
                for (int p = 0; p < AP; p++) d[p] = __fmaf_rn(qs[p][col], kr[c], d[p]);
            }
        }
        float sc = pair_butterfly(d);
        float v = -INFINITY;
        if (mine < np) {  // j < jend <= pos0 + 1: the row sees every key here
            v = __fmul_rn(sc, scale);
            mx = fmaxf(mx, v);
        }
        if ((lane & 1) == 0) st[mine][jj] = v;
    }
    if ((lane & 1) == 0) smax[mine][warp] = mx;
    __syncthreads();
    tile_softmax(&st[0][0], ATT_T, smax, wsum, pmax, np);
    __syncthreads();
    int hdp = (hd + 31) / 32 * 32, n = jend - j0;
    switch (ATT_THREADS % hdp == 0 ? ATT_THREADS / hdp : 1) {
    case 8: one_values<8>(cv, st, pacc, hdp, kvw, np, g, gs, hd, n, j0, b, nb, f16); break;
    case 4: one_values<4>(cv, st, pacc, hdp, kvw, np, g, gs, hd, n, j0, b, nb, f16); break;
    case 2: one_values<2>(cv, st, pacc, hdp, kvw, np, g, gs, hd, n, j0, b, nb, f16); break;
    default: one_values<1>(cv, st, pacc, hdp, kvw, np, g, gs, hd, n, j0, b, nb, f16); break;
    }
    tile_write_pml(wsum, pmax, pml, np, gs, hq, g, 0, pos0, j0, b, nb);
}

// ---- Attention on tensor cores (opt-in: attention_tiles_tc)
//
// The same tiles, partials and combine as attention_tiles, but both passes as
// tf32 mma.sync.m16n8k8 with every operand split in two (x = hi + lo,
// hi = tf32(x), lo = tf32(x - hi)) and three products accumulated a step
// (lo*hi, hi*lo, then hi*hi): close to fp32 dot products, summed in the
// tensor core's order, so a different function from the CUDA-core passes.
// Decode and prefill both run it when it is on.
//
// A block takes 32 (row, head) pairs (two m16 tiles: 32 / gs rows x the gs
// query heads of KV head g), so each key and value row read serves 32 pairs.
// An mma row is one pair: its result depends on that pair's q (or
// probabilities) and the tile's keys (or values) only, never on the other
// rows, so a pair gets the same bytes whichever block it sits in. Lane l
// holds rows gr = l / 4 and gr + 8 of a tile; its k slots c = l % 4 and
// c + 4 take two adjacent elements (dims 8 s + 2 c and 8 s + 2 c + 1 of step
// s in the score pass, keys 8 s + 2 c and 8 s + 2 c + 1 in the value pass),
// read as one float2.
//
// The value pass runs the tile's keys up to the block's last key in steps of
// 32; past a pair's own keys its probabilities are 0 and past the block's
// keys the values read as 0, so those steps add zero products (the same
// bytes, as the identity gate checks).
#define ATC_P 32            // pairs a block
#define ATC_SS (ATT_T + 8)  // score row stride in floats: rows 8 banks apart

__device__ __forceinline__ u32 tf32_of(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void tf32_split(float x, u32& hi, u32& lo) {
    hi = tf32_of(x);
    lo = tf32_of(__fsub_rn(x, __uint_as_float(hi)));
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d += a * b for one m16n8k8 step, both given as fp32 fragments (a: rows gr,
// gr + 8 at slot c, then at slot c + 4; b: slots c, c + 4 of column gr).
// ACC = 1 (attention_tiles_tc_acc): the step's three products go into a
// zeroed accumulator, which is then added to d with fp32 adds, so the running
// sums are not carried through the tensor core's own additions.
template <int ACC>
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], float2 ar0, float2 ar8, u32 bh0, u32 bh1, u32 bl0,
                                           u32 bl1) {
    u32 ah[4], al[4];
    tf32_split(ar0.x, ah[0], al[0]);
    tf32_split(ar8.x, ah[1], al[1]);
    tf32_split(ar0.y, ah[2], al[2]);
    tf32_split(ar8.y, ah[3], al[3]);
    if (ACC) {
        float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_tf32(e, al[0], al[1], al[2], al[3], bh0, bh1);
        mma_tf32(e, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
        mma_tf32(e, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
#pragma unroll
        for (int i = 0; i < 4; i++) d[i] = __fadd_rn(d[i], e[i]);
    } else {
        mma_tf32(d, al[0], al[1], al[2], al[3], bh0, bh1);
        mma_tf32(d, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
        mma_tf32(d, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
    }
}

// Two adjacent cache elements (i even) as floats.
__device__ __forceinline__ float2 kv_at2(const void* c, i64 i, int f16) {
    if (f16) {
        u32 w = *reinterpret_cast<const u32*>((const u16*)c + i);
        return make_float2(f16_to_f32((u16)(w & 0xffffu)), f16_to_f32((u16)(w >> 16)));
    }
    return *reinterpret_cast<const float2*>((const float*)c + i);
}

// Head dims that are multiples of 32, up to ATT_HD; gs divides 32. Dynamic
// shared memory: 32 q rows of hd + 8 floats, then 32 score rows of ATC_SS.
template <int ACC>
__device__ __forceinline__ void attention_tiles_tc_k(const float* q, const void* ck, const void* cv, float* pml,
                                                     float* pacc, int m, int hq, int hkv, int hd, const int* posp,
                                                     int rbase, float scale, int f16, int nb) {
    extern __shared__ __align__(16) float atc_smem[];
    __shared__ float smax[ATC_P][ATT_WARPS];
    __shared__ float wsum[ATC_P][ATT_WARPS];
    __shared__ float pmax[ATC_P];
    int qst = hd + 8;  // q row stride: rows 8 banks apart
    float* qs = atc_smem;
    float* st = qs + ATC_P * qst;
    int pos0 = *posp + rbase;
    int t = threadIdx.x, warp = t / 32, lane = t % 32;
    int gr = lane >> 2, c = lane & 3;
    int gs = hq / hkv, rows = ATC_P / gs;
    int g = blockIdx.x, r0 = blockIdx.y * rows, b = blockIdx.z;
    int np = min(rows, m - r0) * gs;  // live pairs: pair p = (row r0 + p / gs, head g * gs + p % gs)
    int j0 = b * ATT_T;
    int nmax = pos0 + r0 + np / gs;  // keys of the block's last row
    if (j0 >= nmax) return;
    int jend = min(j0 + ATT_T, nmax);
    int kvw = hkv * hd;
    for (int i = t; i < ATC_P * hd; i += ATT_THREADS) {
        int p = i / hd, d = i % hd;
        qs[p * qst + d] = p < np ? q[((i64)(r0 + p / gs) * hq + g * gs + p % gs) * hd + d] : 0.0f;
    }
    __syncthreads();

    // Scores: warp w takes the key groups w, w + 8, ... (8 keys, the mma's
    // columns); each pair's dot product runs over the head dims in steps of 8
    // (four steps a chunk of 32, the keys' elements loaded a chunk ahead).
    float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};  // rows gr, gr + 8, gr + 16, gr + 24
    for (int kg = warp; kg < ATT_T / 8; kg += ATT_WARPS) {
        int jj0 = kg * 8;
        if (j0 + jj0 >= jend) {  // no key of the group is in the tile
#pragma unroll
            for (int r = 0; r < 4; r++) {
                st[(gr + 8 * r) * ATC_SS + jj0 + 2 * c] = -INFINITY;
                st[(gr + 8 * r) * ATC_SS + jj0 + 2 * c + 1] = -INFINITY;
            }
            continue;
        }
        int jk = j0 + jj0 + gr;  // this lane's key (column gr)
        bool kin = jk < jend;
        i64 kb = (i64)jk * kvw + g * hd + 2 * c;
        float2 kn[4];
#pragma unroll
        for (int s = 0; s < 4; s++) kn[s] = kin ? kv_at2(ck, kb + 8 * s, f16) : make_float2(0.0f, 0.0f);
        float d0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k0 = 0; k0 < hd; k0 += 32) {
            float2 kc[4];
#pragma unroll
            for (int s = 0; s < 4; s++) kc[s] = kn[s];
            if (k0 + 32 < hd) {
#pragma unroll
                for (int s = 0; s < 4; s++)
                    kn[s] = kin ? kv_at2(ck, kb + k0 + 32 + 8 * s, f16) : make_float2(0.0f, 0.0f);
            }
#pragma unroll
            for (int s = 0; s < 4; s++) {
                u32 bh0, bl0, bh1, bl1;
                tf32_split(kc[s].x, bh0, bl0);
                tf32_split(kc[s].y, bh1, bl1);
                const float* qa = qs + gr * qst + k0 + 8 * s + 2 * c;
                float2 q0 = *reinterpret_cast<const float2*>(qa);
                float2 q8 = *reinterpret_cast<const float2*>(qa + 8 * qst);
                float2 q16 = *reinterpret_cast<const float2*>(qa + 16 * qst);
                float2 q24 = *reinterpret_cast<const float2*>(qa + 24 * qst);
                mma_3xtf32<ACC>(d0, q0, q8, bh0, bh1, bl0, bl1);
                mma_3xtf32<ACC>(d1, q16, q24, bh0, bh1, bl0, bl1);
            }
        }
        // d[i]: row gr (i < 2) or gr + 8, key column 2 c + (i & 1).
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int p = gr + 8 * (i / 2);  // d0 rows gr, gr + 8; d1 rows gr + 16, gr + 24
            float dv = i < 4 ? d0[i] : d1[i - 4];
            int jj = jj0 + 2 * c + (i & 1);
            int j = j0 + jj;
            float v = -INFINITY;
            if (p < np && j < jend && j <= pos0 + r0 + p / gs) {
                v = __fmul_rn(dv, scale);
                mx[i / 2] = fmaxf(mx[i / 2], v);
            }
            st[p * ATC_SS + jj] = v;
        }
    }
    // Each row's max over the warp's keys: the four lanes of a row.
#pragma unroll
    for (int r = 0; r < 4; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        if (c == 0) smax[gr + 8 * r][warp] = mx[r];
    }
    __syncthreads();
    tile_softmax(st, ATC_SS, smax, wsum, pmax, np);
    __syncthreads();

    // Values: warp w takes the head dims' groups of 8, w, w + 8, ... (the
    // mma's columns); the sum runs over the tile's keys in steps of 8, four
    // a chunk, the values loaded a chunk ahead. A probability slot holding
    // -inf (a pair with no key in the tile, or not live) reads as 0.
    int n = jend - j0;
    for (int dg = warp; dg * 8 < hd; dg += ATT_WARPS) {
        i64 vb = (i64)j0 * kvw + g * hd + dg * 8 + gr;  // column gr: dim dg * 8 + gr
        float vn[8];
#pragma unroll
        for (int s = 0; s < 4; s++) {
            int kk = 8 * s + 2 * c;
            vn[2 * s] = kk < n ? kv_at(cv, vb + (i64)kk * kvw, f16) : 0.0f;
            vn[2 * s + 1] = kk + 1 < n ? kv_at(cv, vb + (i64)(kk + 1) * kvw, f16) : 0.0f;
        }
        float d0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k0 = 0; k0 < n; k0 += 32) {
            float vc[8];
#pragma unroll
            for (int i = 0; i < 8; i++) vc[i] = vn[i];
            if (k0 + 32 < n) {
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    int kk = k0 + 32 + 8 * s + 2 * c;
                    vn[2 * s] = kk < n ? kv_at(cv, vb + (i64)kk * kvw, f16) : 0.0f;
                    vn[2 * s + 1] = kk + 1 < n ? kv_at(cv, vb + (i64)(kk + 1) * kvw, f16) : 0.0f;
                }
            }
#pragma unroll
            for (int s = 0; s < 4; s++) {
                u32 bh0, bl0, bh1, bl1;
                tf32_split(vc[2 * s], bh0, bl0);
                tf32_split(vc[2 * s + 1], bh1, bl1);
                const float* pa = st + gr * ATC_SS + k0 + 8 * s + 2 * c;
                float2 p0 = *reinterpret_cast<const float2*>(pa);
                float2 p8 = *reinterpret_cast<const float2*>(pa + 8 * ATC_SS);
                float2 p16 = *reinterpret_cast<const float2*>(pa + 16 * ATC_SS);
                float2 p24 = *reinterpret_cast<const float2*>(pa + 24 * ATC_SS);
                // e >= 0, so fmaxf(., 0) maps -inf to 0 and keeps every e.
                p0 = make_float2(fmaxf(p0.x, 0.0f), fmaxf(p0.y, 0.0f));
                p8 = make_float2(fmaxf(p8.x, 0.0f), fmaxf(p8.y, 0.0f));
                p16 = make_float2(fmaxf(p16.x, 0.0f), fmaxf(p16.y, 0.0f));
                p24 = make_float2(fmaxf(p24.x, 0.0f), fmaxf(p24.y, 0.0f));
                mma_3xtf32<ACC>(d0, p0, p8, bh0, bh1, bl0, bl1);
                mma_3xtf32<ACC>(d1, p16, p24, bh0, bh1, bl0, bl1);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int p = gr + 8 * (i / 2);
            int od = dg * 8 + 2 * c + (i & 1);
            if (p < np && j0 <= pos0 + r0 + p / gs) {
                i64 pair = (i64)(r0 + p / gs) * hq + g * gs + p % gs;
                pacc[(pair * nb + b) * hd + od] = i < 4 ? d0[i] : d1[i - 4];
            }
        }
    }
    tile_write_pml(wsum, pmax, pml, np, gs, hq, g, r0, pos0, j0, b, nb);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_tc(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq,
                       int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_tiles_tc_k<0>(q, ck, cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_tc_acc(const float* q, const void* ck, const void* cv, float* pml, float* pacc, int m, int hq,
                           int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_tiles_tc_k<1>(q, ck, cv, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

// The tiles of each (row, head) pair folded in tile order (see
// attention_tiles): a block per pair, a thread per output dim. ULP = 1
// (attention_combine_ulp) is a sensitivity probe, not a user path: every
// output one ulp up (its bits + 1), so `samesum agree` can show how far the
// smallest change to attention moves a model's greedy tokens.
// Output dim t of pair `pair` (of `tiles` key tiles): the tiles folded in
// order, as attention_combine does.
// Both loops take four tiles a step with the step's loads issued first
// (ncu, session 16: the rolled loops waited on one load a tile, 8.7 of ~15
// cycles an instruction on long scoreboard); the folds are the same, tile
// by tile in order.
__device__ __forceinline__ float combine_dim(const float* pml, const float* pacc, int pair, int t, int hd,
                                             int tiles, int nb) {
    const float* ml = pml + (i64)pair * nb * 2;
    const float* pa = pacc + (i64)pair * nb * hd + t;
    float mx = -INFINITY;
    int b = 0;
    for (; b + 4 <= tiles; b += 4) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = ml[2 * (b + i)];
#pragma unroll
        for (int i = 0; i < 4; i++) mx = fmaxf(mx, v[i]);
    }
    for (; b < tiles; b++) mx = fmaxf(mx, ml[2 * b]);
    float l = 0.0f, acc = 0.0f;
    b = 0;
    for (; b + 4 <= tiles; b += 4) {
        float2 w2[4];
        float pv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w2[i] = *reinterpret_cast<const float2*>(&ml[2 * (b + i)]);
            pv[i] = pa[(i64)(b + i) * hd];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float w = expf(__fsub_rn(w2[i].x, mx));
            l = __fadd_rn(l, __fmul_rn(w2[i].y, w));
            acc = __fmaf_rn(pv[i], w, acc);
        }
    }
    for (; b < tiles; b++) {
        float w = expf(__fsub_rn(ml[2 * b], mx));
        l = __fadd_rn(l, __fmul_rn(ml[2 * b + 1], w));
        acc = __fmaf_rn(pa[(i64)b * hd], w, acc);
    }
    return __fdiv_rn(acc, l);
}

template <int ULP>
__device__ __forceinline__ void attention_combine_k(const float* pml, const float* pacc, float* o, int m, int hq,
                                                    int hd, const int* posp, int rbase, int nb) {
    int pos0 = *posp + rbase;
    int pair = blockIdx.x, t = threadIdx.x;
    int r = pair / hq;
    int tiles = (pos0 + r + 1 + ATT_T - 1) / ATT_T;
    if (t < hd) {
        float v = combine_dim(pml, pacc, pair, t, hd, tiles, nb);
        if (ULP) v = __uint_as_float(__float_as_uint(v) + 1u);
        o[(i64)pair * hd + t] = v;
    }
}

// attention_combine that also writes the rows' Q8_K blocks for the out
// projection (COMBINE_Q8K; hq * hd a multiple of 256): block (x, r) makes
// columns 256 x .. 256 x + 255 of row r, a thread a column (combine_dim),
// then warp 0 quantizes them from shared memory as quantize_q8k does.
extern "C" __global__ void __launch_bounds__(256)
    attention_combine_q8k(const float* pml, const float* pacc, float* o, u8* q, int m, int hq, int hd,
                          const int* posp, int rbase, int nb) {
    pdl_wait();
    __shared__ float xb[256];
    int r = blockIdx.y, c = blockIdx.x * 256 + threadIdx.x;
    int pos0 = *posp + rbase;
    int tiles = (pos0 + r + 1 + ATT_T - 1) / ATT_T;
    int pair = r * hq + c / hd;
    float v = combine_dim(pml, pacc, pair, c % hd, hd, tiles, nb);
    o[(i64)r * hq * hd + c] = v;
    xb[threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.x < 32) q8k_block(xb, q + ((i64)r * (hq * hd / 256) + blockIdx.x) * Q8K_BYTES, threadIdx.x);
}

extern "C" __global__ void attention_combine(const float* pml, const float* pacc, float* o, int m, int hq, int hd,
                                             const int* posp, int rbase, int nb) {
    pdl_wait();
    attention_combine_k<0>(pml, pacc, o, m, hq, hd, posp, rbase, nb);
}

extern "C" __global__ void attention_combine_ulp(const float* pml, const float* pacc, float* o, int m, int hq,
                                                 int hd, const int* posp, int rbase, int nb) {
    pdl_wait();
    attention_combine_k<1>(pml, pacc, o, m, hq, hd, posp, rbase, nb);
}

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

// conv_rows with a thread per channel and CONV_TR consecutive rows
// (`SAMESUM_CUDA_CONV_TILE`, default; kc = 4, the models' conv): the rows'
// inputs are loaded together, each once (conv_rows loads each input kc
// times, one dependent load after another), and a row's taps are slid along
// in registers. Each output is conv_rows's: the same kc fmas from 0 in tap
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
// `v` is 16-byte aligned; returns the sum to every lane. (As before session
// 17; the kernels' `_lane0` forms keep it for comparisons.)
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
// the bound of l2norm_qk and gated_norm_q8k (~4 us of conversions per 1,000
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
template <bool LANES>
__device__ __forceinline__ void l2norm_qk_k(const float* conv, float* qk, int m, int cd, int hk, int dk, float eps) {
    __shared__ __align__(16) float stage[L2_WARPS][256];
    __shared__ __align__(16) double sqs[LANES ? L2_WARPS : 1][256];
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
        s = LANES ? sumsq_in_order(v, dk, lane, sqs[LANES ? threadIdx.x / 32 : 0]) : sumsq_lane0(v, dk, lane);
    } else {
        s = 0.0;
        if (lane == 0)
            for (int i = 0; i < dk; i++) s += (double)v[i] * (double)v[i];
        s = __shfl_sync(0xffffffffu, s, 0);
    }
    float scale = 1.0f / sqrtf((float)s + eps);
    for (int i = lane; i < dk; i += 32) dst[i] = v[i] * scale;
}

extern "C" __global__ void __launch_bounds__(L2_WARPS * 32)
    l2norm_qk(const float* conv, float* qk, int m, int cd, int hk, int dk, float eps) {
    pdl_wait();
    l2norm_qk_k<true>(conv, qk, m, cd, hk, dk, eps);
}

// l2norm_qk with lane 0 squaring every value (`SAMESUM_CUDA_SQ_LANES=0`):
// the same bytes.
extern "C" __global__ void __launch_bounds__(L2_WARPS * 32)
    l2norm_qk_lane0(const float* conv, float* qk, int m, int cd, int hk, int dk, float eps) {
    pdl_wait();
    l2norm_qk_k<false>(conv, qk, m, cd, hk, dk, eps);
}

// The lane-a-head kernels (`HEAD_SUMS`): heads a block, loads issued
// together a thread.
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

// l2norm_qk with a lane a head (`SAMESUM_CUDA_HEAD_SUMS`; dk <= 256): a block
// of 128 threads takes 32 of the m * 2hk heads, stages them (dynamic shared
// memory, 32 rows of dk + 1 floats; a thread's loads of its column in the
// 32 heads issued together), and lane l of warp 0 adds head l's squares in
// f64 in index order, as sumsq_in_order's lane 0 adds one head's: the same
// sums, then l2norm_qk's scale and products.
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
// (CONV_L2; key head dims up to 256), blocks of 128 threads: block h < 2 hk
// takes q/k head h, a thread a channel (conv_channel, as conv_small), the
// head's outputs staged in shared memory and normed as l2norm_qk does
// (sumsq_in_order by warp 0, then the scale); the other blocks take the
// value channels, a thread each.
extern "C" __global__ void __launch_bounds__(128)
    conv_l2_one(const float* x, const float* taps, float* state, float* out, float* qk, int cd, int kc, int hk,
                int dk, float eps) {
    pdl_wait();
    __shared__ __align__(16) float sv[256];
    __shared__ float scale_s;
    int h = blockIdx.x, t = threadIdx.x;
    if (h < 2 * hk) {
        for (int i = t; i < dk; i += 128) sv[i] = conv_channel(x, taps, state, out, 1, cd, kc, h * dk + i);
        __syncthreads();
        if (t < 32) {
            // Lane 0's squares (one row: the lanes' squares measured no
            // faster here, see gated_norm_q8k's launch).
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

// Gated delta rule for the key head dims the models use (16..256): the same
// recurrence, with each state column split over 8 lanes so that a row's two
// dot products are eight short chains plus a fixed butterfly instead of one
// chain of dk. Block (n, c): columns 16c..16c+15 of value head n, 8 lanes per
// column; lane p keeps S[p + 8q][j] (q < dk/8) in registers for all rows of
// the call. Per row: S *= decay; kv = sum over lanes (fixed xor 4, 2, 1
// butterfly) of each lane's fma chain in q order; delta = (v - kv) * beta;
// S += k * delta; o likewise. Every operation is an explicit intrinsic, the
// order depends only on dk: a one-row call computes the same bytes.
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
DELTA_COLS(delta_cols_64, 64)
DELTA_COLS(delta_cols_128, 128)
DELTA_COLS(delta_cols_256, 256)

// The same rule in the same order (delta_cols: each value, product and sum
// as there), with the staging moved off the rows' path. Nsight Compute had
// delta_cols_128 at 1.9 warps a scheduler (its 256 blocks are the whole
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
// PIPE = 1: after row r's state update, one loop over the state values runs
// row r's output dot beside row r + 1's decay and k dot (two independent
// chains a thread), then both butterflies. Every value goes through the
// same operations in the same order as PIPE = 0: the same bytes. (Not at
// head dim 256: a thread's four 32-value arrays would spill.)
//
// PIPE = 2 (`DELTA_UNROLL`, the default for calls of 16 rows or more): a
// full group's rows as PIPE = 1's, unrolled into straight-line code with
// the outputs through shared memory, so its loads issue ahead of the chain
// (H200, qwen35moe pp4096: 45.5 -> 37.9 ms). PIPE = 3 (`DELTA_XCHG`) and 4
// (`DELTA_CARRY`) are measured variants of it, opt-in, no faster, and so is
// PIPE = 5 (`DELTA_TRI`, three staging buffers; see delta_cols_async). A
// partial group runs PIPE = 1's loop in all of them.
template <int DK>
__device__ __forceinline__ void dc_load4(const float* src, float* dst) {
    const float4* v = reinterpret_cast<const float4*>(src);
#pragma unroll
    for (int u = 0; u < DK / DC_PARTS / 4; u++) {
        float4 t = v[u];
        dst[4 * u] = t.x, dst[4 * u + 1] = t.y, dst[4 * u + 2] = t.z, dst[4 * u + 3] = t.w;
    }
}

// The pipelined kernels' steps (delta_cols_async, PIPE >= 1), shared by the
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
    // PIPE = 5 (`DELTA_TRI`): PIPE 2's rows with three staging buffers in
    // turn, in dynamic shared memory (3 RG ROWF floats; backend.rs sizes the
    // launch alike): group g + 1 is staged into the buffer group g - 2 used,
    // which every thread left before the barrier ahead of group g - 1's rows,
    // so a group starts without a barrier of its own.
    constexpr int NB = PIPE == 5 ? 3 : 2;
    __shared__ __align__(16) float st2[NB == 2 ? 2 : 1][NB == 2 ? RG * ROWF : 4];
    extern __shared__ __align__(16) float dc_dyn[];
    auto st = [&](int i) -> float* {
        if constexpr (NB == 2) return st2[i];
        else return dc_dyn + i * (RG * ROWF);
    };
    __shared__ float sb[NB][2 * RG];
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
    // PIPE = 4 (`DELTA_CARRY`): a full group followed by a full group runs
    // its last row with the next group's first k and decay, so the next
    // group starts from the carried k row and k dot instead of its own
    // first decay and k dot (the same operations, in the same order).
    float ck[PIPE == 4 ? SP : 1], ckv = 0.0f;
    bool carried = false;
    for (int g = 0; g < groups; g++) {
        int r0 = g * RG, cnt = min(RG, m - r0), bi = NB == 2 ? g & 1 : g % 3;
        int nx = NB == 2 ? bi ^ 1 : (bi == 2 ? 0 : bi + 1);  // group g + 1's buffer
        bool more = g + 1 < groups;
        bool carry_out = PIPE == 4 && cnt == RG && m - r0 - RG >= RG;
        if (NB == 2 && g > 0) __syncthreads();  // group g - 1 is done with buffer nx
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
        if (PIPE >= 2 && cnt == RG) {
            // `DELTA_UNROLL`: the pipelined rows of a full group as
            // straight-line code, every shared-memory offset a constant, so
            // the compiler can issue a row's v, beta, decay, q and next k
            // loads ahead of the chain that needs them. The same operations
            // in the same order as the PIPE = 1 loop below.
            float kv = 0.0f;
            if (PIPE == 4 && carried) {
#pragma unroll
                for (int q = 0; q < SP; q++) kk[q] = ck[PIPE == 4 ? q : 0];
                kv = ckv;
            } else {
                dc_load4<DK>(sg + p * PS, kk);
                kv = dc_decay_kdot<SP>(S, kk, sb[bi][RG]);
            }
            // Each row's outputs go to shared memory (a predicated store, no
            // branch in the row body) and the warp writes its 4 columns of
            // the group's rows out after the last row.
            __shared__ float so[RG * DC_COLS];
            __shared__ __align__(16) float sx[2][NT];
#pragma unroll
            for (int rr = 0; rr < RG; rr++) {
                const float* kr = sg + rr * ROWF;
                bool last = rr + 1 == RG;
                if (PIPE == 4 && rr == 4 && carry_out) {
                    // The next group's gates (its b and a were loaded with
                    // its copies), worked out by every thread as `gates`
                    // does and kept by the first RG: no branch, so their
                    // latency hides among these rows' chains.
                    float gb = sigmoid(nb);
                    float gl = softplus(na + dt_bias[n]) * ssm_a[n];
                    float gd = expf(gl);
                    asm volatile("" ::"f"(gb), "f"(gd));
                    if (tid < RG) {
                        sb[nx][tid] = gb;
                        sb[nx][RG + tid] = gd;
                    }
                }
                if (PIPE == 4 && last && carry_out) {
                    // The next group's copies and gates, for its first k
                    // and decay in this row.
                    cp_async_wait<0>();
                    __syncthreads();
                }
                float delta = __fmul_rn(__fsub_rn(kr[2 * SEC + c], kv), sb[bi][rr]);
                dc_load4<DK>(kr + SEC + p * PS, qq);
                float acc = 0.0f;
                if (!last || (PIPE == 4 && carry_out)) {
                    float kn[SP], kv2 = 0.0f;
                    dc_load4<DK>((last ? st(nx) : kr + ROWF) + p * PS, kn);
                    float dn = last ? sb[nx][RG] : sb[bi][RG + rr + 1];
                    dc_step_next<SP>(S, kk, qq, kn, delta, dn, acc, kv2);
                    if (PIPE == 3) {
                        // `DELTA_XCHG`: the k dot's 8 partials through shared
                        // memory (two slots by row parity, so a row's reads
                        // end before the row after next writes), every lane
                        // adding them as the butterfly's lane 0 does:
                        // ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
                        // The butterfly's other lanes add the same pairs with
                        // the operands swapped: the same sums.
                        sx[rr & 1][tid] = kv2;
                        __syncwarp();
                        const float4* xs = reinterpret_cast<const float4*>(&sx[rr & 1][tid & ~7]);
                        float4 lo = xs[0], hi = xs[1];
                        float t0 = __fadd_rn(lo.x, hi.x), t1 = __fadd_rn(lo.z, hi.z);
                        float t2 = __fadd_rn(lo.y, hi.y), t3 = __fadd_rn(lo.w, hi.w);
                        kv2 = __fadd_rn(__fadd_rn(t0, t1), __fadd_rn(t2, t3));
                        acc = dc_lanes_sum(acc);
                    } else {
                        dc_lanes_sum2(acc, kv2);
                    }
                    kv = kv2;
                } else {
                    acc = dc_step_last<SP>(S, kk, qq, delta);
                }
                if (p == 0) so[rr * DC_COLS + c] = acc;
            }
            if (PIPE == 4 && carry_out) {
#pragma unroll
                for (int q = 0; q < SP; q++) ck[PIPE == 4 ? q : 0] = kk[q];
                ckv = kv;
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
        if (more && !carry_out && tid < min(RG, m - r0 - RG)) gates(nx, tid, nb, na);
        carried = carry_out;
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

DELTA_COLS_ASYNC(delta_cols_async_64, 64, 16, 0)
DELTA_COLS_ASYNC(delta_cols_async_128, 128, 16, 0)
DELTA_COLS_ASYNC(delta_cols_async_256, 256, 8, 0)
DELTA_COLS_ASYNC(delta_cols_async_pipe_64, 64, 16, 1)
DELTA_COLS_ASYNC(delta_cols_async_pipe_128, 128, 16, 1)
DELTA_COLS_ASYNC(delta_cols_async_unroll_64, 64, 16, 2)
DELTA_COLS_ASYNC(delta_cols_async_unroll_128, 128, 16, 2)
DELTA_COLS_ASYNC(delta_cols_async_xchg_64, 64, 16, 3)
DELTA_COLS_ASYNC(delta_cols_async_xchg_128, 128, 16, 3)
DELTA_COLS_ASYNC(delta_cols_async_carry_64, 64, 16, 4)
DELTA_COLS_ASYNC(delta_cols_async_carry_128, 128, 16, 4)
DELTA_COLS_ASYNC(delta_cols_async_tri_64, 64, 16, 5)
DELTA_COLS_ASYNC(delta_cols_async_tri_128, 128, 16, 5)

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

// gated_norm, then the Q8_K blocks of what the block wrote (the out
// projection's input, quantized as quantize_q8k does it): the block's four
// heads are dv * 4 consecutive values of one row (the launch checks that
// 256 divides dv * 4 and a row's heads come in fours), so they are whole
// blocks of 256; warp w quantizes blocks w, w + 4, ... of them.
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
    gated_norm_q8k(float* o, const float* z, const float* norm, u8* q, int rows_heads, int dv, float eps) {
    pdl_wait();
    gated_norm_q8k_k<true>(o, z, norm, q, rows_heads, dv, eps);
}

// gated_norm_q8k with lane 0 squaring every value (`SAMESUM_CUDA_SQ_LANES=0`):
// the same bytes.
extern "C" __global__ void __launch_bounds__(GN_WARPS * 32)
    gated_norm_q8k_lane0(float* o, const float* z, const float* norm, u8* q, int rows_heads, int dv, float eps) {
    pdl_wait();
    gated_norm_q8k_k<false>(o, z, norm, q, rows_heads, dv, eps);
}

// gated_norm_q8k with a lane a head (`SAMESUM_CUDA_HEAD_SUMS`): a block of
// 128 threads takes HS_HEADS heads (of a row or of consecutive rows, as the
// launch's heads come), stages them in shared memory (dynamic: HS_HEADS
// rows of dv + 1 floats, so lane l's reads of head l fall in distinct
// banks), and lane l of warp 0 adds head l's squares in f64 in index order,
// as sumsq_in_order's lane 0 adds one head's: the same sum, with 32 heads'
// sums in one warp's instructions where that took a warp a head. The scale,
// the gating and the Q8_K blocks (warp w quantizes blocks w, w + 4, ...)
// are gated_norm_q8k's. The launch checks dv <= 256, 256 | 4 dv and heads
// in fours, so a block's heads are whole 256-blocks. A thread's loads of
// its column in the 32 heads are issued together (the loops over heads
// unrolled): session 21's first form loaded one head at a time, 32 memory
// waits in a row, and was slower than the warp-a-head kernel.
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

// Router rows, one warp per row: softmax (max; exp; the sum with lane l over
// entries l, l + 32, ... then a fixed butterfly; divide), the top k (largest
// first, lowest id among equals: k rounds of an exact warp argmax), weights
// renormalized by their sum in k order clamped at 2^-14.
// One row's routing with the row's logits in registers (U per lane, U * 32 >=
// e): lane l holds entries l, l + 32, ... and every pass (max, exp and sum,
// divide, each argmax round) walks them in that order, as a loop over memory
// would; the softmaxed row is also stored back.
template <int U>
__device__ __forceinline__ void softmax_row_u(float* p, float* v, int e, int lane) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        int i = lane + 32 * u;
        v[u] = i < e ? p[i] : 0.0f;
    }
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (lane + 32 * u < e) mx = fmaxf(mx, v[u]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (lane + 32 * u < e) {
            v[u] = expf(v[u] - mx);
            sum = sum + v[u];
        }
    for (int o = 16; o > 0; o /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
    for (int u = 0; u < U; u++) {
        int i = lane + 32 * u;
        if (i < e) {
            v[u] = v[u] / sum;
            p[i] = v[u];
        }
    }
}

// A round's pick as every argmax path records it: lane 0 stores the id (and
// in sids, when given), the value is kept for the weights, and added to the
// running sum in round order.
__device__ __forceinline__ void record_pick(int* ids, int* sids, int r, int k, int s, int lane, int best, float bv,
                                            float& keep0, float& keep1, float& tot) {
    if (lane == 0) {
        ids[(i64)r * k + s] = best;
        if (sids) sids[r * k + s] = best;
    }
    keep_pick(keep0, keep1, s, lane, bv);
    tot = tot + bv;
}

// "a before b" in the argmax rounds' order: larger value first, lower id
// among equals; an absent entry (id -1) after every present one.
__device__ __forceinline__ bool pick_before(float av, int ai, float bv, int bi) {
    if (bi < 0) return ai >= 0;
    if (ai < 0) return false;
    return av > bv || (av == bv && ai < bi);
}

__device__ __forceinline__ void pick_cas(float* v, int* id, int a, int b) {
    if (pick_before(v[b], id[b], v[a], id[a])) {
        float tv = v[a];
        v[a] = v[b];
        v[b] = tv;
        int ti = id[a];
        id[a] = id[b];
        id[b] = ti;
    }
}

// Batcher's odd-even merge sort of a lane's U entries (U = 4 or 8) into
// pick_before order, written out so every index is a constant and the
// entries stay in registers (its loop form was left rolled, with the entries
// in local memory, where route_plan_small inlines it); the networks are
// checked on every 0/1 input by a host test (backend.rs, topk_tests).
template <int U>
__device__ __forceinline__ void sort_picks(float* v, int* id) {
    static_assert(U == 4 || U == 8, "networks for 4 and 8 entries");
    if (U == 4) {
        pick_cas(v, id, 0, 1);
        pick_cas(v, id, 2, 3);
        pick_cas(v, id, 0, 2);
        pick_cas(v, id, 1, 3);
        pick_cas(v, id, 1, 2);
    } else {
        pick_cas(v, id, 0, 1);
        pick_cas(v, id, 2, 3);
        pick_cas(v, id, 4, 5);
        pick_cas(v, id, 6, 7);
        pick_cas(v, id, 0, 2);
        pick_cas(v, id, 1, 3);
        pick_cas(v, id, 4, 6);
        pick_cas(v, id, 5, 7);
        pick_cas(v, id, 1, 2);
        pick_cas(v, id, 5, 6);
        pick_cas(v, id, 0, 4);
        pick_cas(v, id, 1, 5);
        pick_cas(v, id, 2, 6);
        pick_cas(v, id, 3, 7);
        pick_cas(v, id, 2, 4);
        pick_cas(v, id, 3, 5);
        pick_cas(v, id, 1, 2);
        pick_cas(v, id, 3, 4);
        pick_cas(v, id, 5, 6);
    }
}

template <int U>
__device__ __forceinline__ void topk_row_u(const float* v, const float* p, int* ids, float* wts, int r, int e,
                                           int k, int lane, int* sids = nullptr) {
    __syncwarp();
    float tot = 0.0f, keep0 = 0.0f, keep1 = 0.0f;
    bool nan = false;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (lane + 32 * u < e) nan |= v[u] != v[u];
    if ((U == 4 || U == 8) && !__any_sync(0xffffffffu, nan)) {
        // Each lane's entries sorted once in the rounds' order: a lane's best
        // entry not yet taken is always its first left (a lane loses only
        // the entry that won a round), so each round is one warp argmax over
        // the lanes' first entries, then the winner drops its first. The
        // same picks in the same order as the rounds below, which a row
        // holding a NaN (where comparisons do not order) still takes.
        float sv[U];
        int si[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = lane + 32 * u;
            sv[u] = i < e ? v[u] : 0.0f;
            si[u] = i < e ? i : -1;
        }
        sort_picks<(U == 4 || U == 8) ? U : 8>(sv, si);
        int h = 0;  // the lane's entries before h are taken
#pragma unroll 1
        for (int s = 0; s < k; s++) {
            // Entry h, picked by compares with constants (an index into the
            // arrays would put them in local memory).
            int best = -1;
            float bv = 0.0f;
#pragma unroll
            for (int u = 0; u < U; u++)
                if (h == u) {
                    best = si[u];
                    bv = best >= 0 ? sv[u] : 0.0f;
                }
            warp_argmax(bv, best);
            if (best >= 0 && (best & 31) == lane) h++;
            record_pick(ids, sids, r, k, s, lane, best, bv, keep0, keep1, tot);
        }
        finish_weights(p, ids, wts, r, k, lane, keep0, keep1, tot);
        return;
    }
    unsigned long long taken = 0;  // bit u: entry lane + 32u chosen (e <= 2048)
    for (int s = 0; s < k; s++) {
        int best = -1;
        float bv = 0.0f;
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = lane + 32 * u;
            if (i >= e || ((taken >> u) & 1ull)) continue;
            if (best < 0 || v[u] > bv) {
                best = i;
                bv = v[u];
            }
        }
        warp_argmax(bv, best);
        if ((best & 31) == lane) taken |= 1ull << (best / 32);
        record_pick(ids, sids, r, k, s, lane, best, bv, keep0, keep1, tot);
    }
    finish_weights(p, ids, wts, r, k, lane, keep0, keep1, tot);
}

template <int U>
__device__ __forceinline__ void route_row_u(float* logits, int* ids, float* wts, int r, int e, int k, int lane,
                                            int* sids) {
    float* p = logits + (i64)r * e;
    float v[U];
    softmax_row_u<U>(p, v, e, lane);
    topk_row_u<U>(v, p, ids, wts, r, e, k, lane, sids);
}

// One row's routing by a whole 256-thread block (decode: one row, where a
// lone warp's k argmax rounds were the kernel's critical path). Warp 0
// computes the softmax exactly as route_row_u and copies it to shared
// memory; then every entry's rank in the order "larger value first, lower id
// among equals" is counted by its own thread, and the entry of rank s is the
// s-th pick of the argmax rounds (the same ids in the same order; the weights
// are the same values over the same k-order sum). A row holding a NaN (where
// comparisons do not order) takes warp 0's argmax rounds instead, so the
// result is route_row's for every input. Needs e <= 1024 and k <= 64.
#define RB_MAX_E 1024
template <int U>
__device__ void route_row_block_u(float* logits, int* ids, float* wts, int r, int e, int k, float* sp, int* sid,
                                  float* sv, int* flag) {
    int t = threadIdx.x, warp = t / 32, lane = t % 32;
    float* p = logits + (i64)r * e;
    float v[U];
    if (warp == 0) {
        softmax_row_u<U>(p, v, e, lane);
        bool nan = false;
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = lane + 32 * u;
            if (i < e) {
                sp[i] = v[u];
                nan |= v[u] != v[u];
            }
        }
        nan = __any_sync(0xffffffffu, nan);
        if (lane == 0) *flag = nan;
    }
    __syncthreads();
    if (*flag) {
        if (warp == 0) topk_row_u<U>(v, p, ids, wts, r, e, k, lane);
        __syncthreads();
        return;
    }
    for (int i = t; i < e; i += blockDim.x) {
        float x = sp[i];
        int rank = 0;
        for (int j = 0; j < i; j++) rank += sp[j] >= x;  // equal and lower id: ahead
        for (int j = i + 1; j < e; j++) rank += sp[j] > x;
        if (rank < k) {
            sid[rank] = i;
            sv[rank] = x;
        }
    }
    __syncthreads();
    if (t == 0) {
        float tot = 0.0f;
        for (int s2 = 0; s2 < k; s2++) tot = tot + sv[s2];
        sp[0] = fmaxf(tot, 6.103515625e-5f);  // sp is free again
    }
    __syncthreads();
    if (t < k) {
        ids[(i64)r * k + t] = sid[t];
        wts[(i64)r * k + t] = sv[t] / sp[0];
    }
    __syncthreads();
}

// The same through memory, for more than 1,024 experts.
__device__ __forceinline__ void route_row_mem(float* logits, int* ids, float* wts, int r, int e, int k, int lane,
                                              int* sids) {
    float* p = logits + (i64)r * e;
    float mx = -INFINITY;
    for (int i = lane; i < e; i += 32) mx = fmaxf(mx, p[i]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int i = lane; i < e; i += 32) {
        float v = expf(p[i] - mx);
        p[i] = v;
        sum = sum + v;
    }
    for (int o = 16; o > 0; o /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, o);
    for (int i = lane; i < e; i += 32) p[i] = p[i] / sum;
    __syncwarp();
    unsigned long long taken = 0;  // bit u: entry lane + 32u chosen (e <= 2048)
    float tot = 0.0f, keep0 = 0.0f, keep1 = 0.0f;
    for (int s = 0; s < k; s++) {
        int best = -1;
        float bv = 0.0f;
        for (int u = 0, i = lane; i < e; u++, i += 32) {
            if ((taken >> u) & 1ull) continue;
            float v = p[i];
            if (best < 0 || v > bv) {
                best = i;
                bv = v;
            }
        }
        warp_argmax(bv, best);
        if ((best & 31) == lane) taken |= 1ull << (best / 32);
        record_pick(ids, sids, r, k, s, lane, best, bv, keep0, keep1, tot);
    }
    finish_weights(p, ids, wts, r, k, lane, keep0, keep1, tot);
}

// Routing of row r: softmax (max; exp; the sum with lane l over entries l,
// l + 32, ... then a fixed butterfly; divide), the top k (largest first,
// lowest id among equals: k rounds of an exact warp argmax), weights
// renormalized by their sum in k order clamped at 2^-14 (e <= 2048).
__device__ __forceinline__ void route_row(float* logits, int* ids, float* wts, int r, int e, int k, int lane,
                                          int* sids = nullptr) {
    int n = (e + 31) / 32;
    if (n <= 4)
        route_row_u<4>(logits, ids, wts, r, e, k, lane, sids);
    else if (n <= 8)
        route_row_u<8>(logits, ids, wts, r, e, k, lane, sids);
    else if (n <= 16)
        route_row_u<16>(logits, ids, wts, r, e, k, lane, sids);
    else if (n <= 32)
        route_row_u<32>(logits, ids, wts, r, e, k, lane, sids);
    else
        route_row_mem(logits, ids, wts, r, e, k, lane, sids);
}

extern "C" __global__ void route(float* logits, int* ids, float* wts, int m, int e, int k) {
    pdl_wait();
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= m) return;
    route_row(logits, ids, wts, r, e, k, lane);
}

// The expert plan, three parallel deterministic kernels.
// 1. Histogram of the (token, slot) pairs per expert (integer atomics: the
//    counts do not depend on their order); counts must be zeroed first. Also
//    marks every placed row unused (-1) up to `cap`, for the placement.
extern "C" __global__ void plan_count(const int* ids, int n, int* counts, int* placed_row, int* placed_mat,
                                      int cap) {
    pdl_wait();
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < cap) {
        placed_row[p] = -1;
        placed_mat[p] = -1;
    }
    if (p >= n) return;
    int e = ids[p];
    if (e >= 0) atomicAdd(&counts[e], 1);
}

// 2. Exclusive scan of the counts, each rounded up to a multiple of `pad` (the
//    matmul's row tile), in one block: a Hillis-Steele scan over 1024-expert
//    pieces carried in order.
extern "C" __global__ void plan_scan(const int* counts, int* offsets, int e, int pad) {
    pdl_wait();
    __shared__ int buf[1024];
    __shared__ int carry;
    int t = threadIdx.x;
    if (t == 0) carry = 0;
    __syncthreads();
    for (int base = 0; base < e; base += 1024) {
        int v = base + t < e ? (counts[base + t] + pad - 1) / pad * pad : 0;
        buf[t] = v;
        __syncthreads();
        for (int o = 1; o < 1024; o *= 2) {
            int add = t >= o ? buf[t - o] : 0;
            __syncthreads();
            buf[t] += add;
            __syncthreads();
        }
        if (base + t < e) offsets[base + t] = carry + buf[t] - v;
        __syncthreads();
        if (t == 1023) carry += buf[1023];
        __syncthreads();
    }
}

// 3. Stable placement, one block per expert: pair p of expert e goes to
//    offsets[e] + (pairs before p with expert e), counted in order over tiles
//    of 256 pairs with warp ballots. Writes the placed pair's token row, its
//    expert, and each pair's place (-1 for skipped ids, by block 0).
//    plan_count has filled placed_row and placed_mat with -1.
extern "C" __global__ void plan_place(const int* ids, int n, int k, const int* offsets, int* placed_row,
                                      int* placed_mat, int* slot) {
    pdl_wait();
    __shared__ int wsum[8];
    int e = blockIdx.x, t = threadIdx.x, lane = t % 32, warp = t / 32;
    int carry = 0;
    for (int base = 0; base < n; base += 256) {
        int p = base + t;
        int id = p < n ? ids[p] : -2;
        if (e == 0 && p < n && id < 0) slot[p] = -1;
        bool hit = id == e;
        unsigned b = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) wsum[warp] = __popc(b);
        __syncthreads();
        int before = carry + __popc(b & ((1u << lane) - 1u)), total = 0;
        for (int w = 0; w < 8; w++) {
            if (w < warp) before += wsum[w];
            total += wsum[w];
        }
        if (hit) {
            int dst = offsets[e] + before;
            placed_row[dst] = p / k;
            placed_mat[dst] = e;
            slot[p] = dst;
        }
        carry += total;
        __syncthreads();
    }
}

// plan_scan and plan_place in one launch for wide calls (`PLAN_WIDE`), one
// block of 256 threads per expert, as plan_place. The block first sums the
// padded counts of the experts below its own: plan_scan's offset (an integer
// sum, the same whatever the order). It then places its pairs in passes of
// 256 x PW_RUN: thread t takes the PW_RUN consecutive pairs from base +
// t PW_RUN (their ids in 16-byte loads where the run is whole and aligned),
// and its hits go, in pair order, after the hits of the threads before it
// (a warp scan of the counts, then the warps' totals). So pair p of expert e
// lands at offsets[e] + (pairs before p with expert e), as plan_place puts
// it, with two block barriers a pass in place of two per 256 pairs. The
// same places, rows, experts and slots as plan_scan then plan_place.
#define PW_RUN 32
extern "C" __global__ void __launch_bounds__(256)
    plan_place_wide(const int* ids, int n, int k, const int* counts, int pad, int* placed_row, int* placed_mat,
                    int* slot) {
    pdl_wait();
    __shared__ int wsum[8];
    int e = blockIdx.x, t = threadIdx.x, lane = t % 32, warp = t / 32;
    int off = 0;
    for (int j = t; j < e; j += 256) off += (counts[j] + pad - 1) / pad * pad;
    for (int o = 16; o > 0; o /= 2) off += __shfl_xor_sync(0xffffffffu, off, o);
    if (lane == 0) wsum[warp] = off;
    __syncthreads();
    off = 0;
    for (int w = 0; w < 8; w++) off += wsum[w];
    __syncthreads();
    int carry = 0;
    for (int base = 0; base < n; base += 256 * PW_RUN) {
        int p0 = base + t * PW_RUN;
        int v[PW_RUN];
        if (p0 + PW_RUN <= n && ((unsigned long long)(ids + p0) & 15ull) == 0) {
#pragma unroll
            for (int q = 0; q < PW_RUN / 4; q++) {
                int4 x = reinterpret_cast<const int4*>(ids + p0)[q];
                v[4 * q] = x.x;
                v[4 * q + 1] = x.y;
                v[4 * q + 2] = x.z;
                v[4 * q + 3] = x.w;
            }
        } else {
#pragma unroll
            for (int q = 0; q < PW_RUN; q++) v[q] = p0 + q < n ? ids[p0 + q] : -2;
        }
        unsigned hits = 0;  // bit q: pair p0 + q is expert e's
#pragma unroll
        for (int q = 0; q < PW_RUN; q++) {
            if (v[q] == e) hits |= 1u << q;
            if (e == 0 && p0 + q < n && v[q] < 0) slot[p0 + q] = -1;
        }
        int c = __popc(hits), inc = c;
        for (int o = 1; o < 32; o *= 2) {
            int y = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += y;
        }
        if (lane == 31) wsum[warp] = inc;
        __syncthreads();
        int before = carry + inc - c, total = 0;
        for (int w = 0; w < 8; w++) {
            if (w < warp) before += wsum[w];
            total += wsum[w];
        }
        while (hits) {
            int q = __ffs(hits) - 1;
            hits &= hits - 1u;
            int p = p0 + q, dst = off + before++;
            placed_row[dst] = p / k;
            placed_mat[dst] = e;
            slot[p] = dst;
        }
        carry += total;
        __syncthreads();
    }
}

// The whole plan in one launch for small calls (n <= 256 pairs, e <= 2048
// experts; decode is n = k): one block does what plan_count, plan_scan and
// plan_place do (and the zeroing of the counts before them), with the same
// results: every expert's padded count, their exclusive scan as offsets (an
// integer sum: the same whatever the order), and pair p of expert e placed
// at offsets[e] + (pairs before p with expert e). Unused places stay -1.
#define PLAN_SMALL_PAIRS 256
#define PLAN_SMALL_EXPERTS 2048
//
// With `pre` (shared memory, already holding the n ids: route_plan_small),
// the ids are read from there instead of from global memory.
__device__ __forceinline__ void plan_small_block(const int* ids, int n, int k, int e, int pad, int* placed_row,
                                                 int* placed_mat, int* slot, int cap,
                                                 const int* pre = nullptr) {
    __shared__ int sid[PLAN_SMALL_PAIRS];
    __shared__ int cnt[PLAN_SMALL_EXPERTS];  // counts, then offsets
    __shared__ int part[256];
    int t = threadIdx.x;
    for (int i = t; i < cap; i += 256) {
        placed_row[i] = -1;
        placed_mat[i] = -1;
    }
    for (int i = t; i < e; i += 256) cnt[i] = 0;
    if (t < n) sid[t] = pre ? pre[t] : ids[t];
    __syncthreads();
    if (t < n && sid[t] >= 0) atomicAdd(&cnt[sid[t]], 1);
    __syncthreads();
    // Thread t owns experts [lo, hi): their padded counts' sum, an inclusive
    // scan of those sums over the threads, then each expert's offset.
    int per = (e + 255) / 256;
    int lo = min(t * per, e), hi = min(lo + per, e);
    int mine = 0;
    for (int i = lo; i < hi; i++) mine += (cnt[i] + pad - 1) / pad * pad;
    part[t] = mine;
    __syncthreads();
    for (int o = 1; o < 256; o *= 2) {
        int add = t >= o ? part[t - o] : 0;
        __syncthreads();
        part[t] += add;
        __syncthreads();
    }
    int run = part[t] - mine;
    for (int i = lo; i < hi; i++) {
        int v = (cnt[i] + pad - 1) / pad * pad;
        cnt[i] = run;
        run += v;
    }
    __syncthreads();
    if (t < n) {
        int id = sid[t];
        if (id < 0) {
            slot[t] = -1;
        } else {
            int before = 0;
            for (int q = 0; q < t; q++) before += sid[q] == id;
            int dst = cnt[id] + before;
            placed_row[dst] = t / k;
            placed_mat[dst] = id;
            slot[t] = dst;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    plan_small(const int* ids, int n, int k, int e, int pad, int* placed_row, int* placed_mat, int* slot, int cap) {
    pdl_wait();
    plan_small_block(ids, n, k, e, pad, placed_row, placed_mat, slot, cap);
}

// Decode-sized routing and plan in one launch of one 256-thread block: up to
// `block_rows` rows are routed one at a time by the whole block
// (route_row_block_u); one row (with k <= 32) by warp 0 alone, which also
// plans it (plan_warp); more by warp w taking rows w, w + 8, ...; every way
// exactly as `route` does; then (after a block barrier, which makes the ids
// visible to the block) the block plans them exactly as `plan_small` does.
extern "C" __global__ void __launch_bounds__(256, 1)
    route_plan_small(float* logits, int* ids, float* wts, int m, int e, int k, int pad, int* placed_row,
                     int* placed_mat, int* slot, int cap, int block_rows) {
    pdl_wait();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (m <= block_rows && e <= RB_MAX_E && k <= 64) {
        // A row at a time by the whole block (same results as route_row).
        __shared__ float sp[RB_MAX_E];
        __shared__ int sid[64];
        __shared__ float sv[64];
        __shared__ int flag;
        int n = (e + 31) / 32;
        for (int r = 0; r < m; r++) {
            if (n <= 8)
                route_row_block_u<8>(logits, ids, wts, r, e, k, sp, sid, sv, &flag);
            else
                route_row_block_u<32>(logits, ids, wts, r, e, k, sp, sid, sv, &flag);
        }
        plan_small_block(ids, m * k, k, e, pad, placed_row, placed_mat, slot, cap);
    } else if (m == 1 && k <= 32) {
        // One row (decode of one sequence): warp 0 routes it and plans its k
        // pairs (plan_warp) with no block barrier; the other warps have
        // nothing to do.
        if (warp != 0) return;
        __shared__ int rids1[32];
        route_row(logits, ids, wts, 0, e, k, lane, rids1);
        __syncwarp();
        plan_warp(lane < k ? rids1[lane] : -1, k, k, pad, placed_row, placed_mat, slot, cap, lane);
    } else {
        // The warps also leave the ids in shared memory for the plan (no
        // read back from global memory; m * k <= PLAN_SMALL_PAIRS).
        __shared__ int rids[PLAN_SMALL_PAIRS];
        for (int r = warp; r < m; r += 8) route_row(logits, ids, wts, r, e, k, lane, rids);
        __syncthreads();
        plan_small_block(ids, m * k, k, e, pad, placed_row, placed_mat, slot, cap, rids);
    }
}

// One row's routing and plan (decode of one sequence; e <= 1024, k <= 32) by
// one warp, in compact code: the softmax and the k argmax rounds of
// route_row's rolled-loop path, over the row held in shared memory, then
// plan_warp. The same results as `route` and route_plan_small (the argmax
// rounds are route_row's definition; its sorted-lane shortcut picks the
// same). Its own small kernel: ncu (session 12) had route_plan_small, a
// ~20,000-instruction kernel whose one-row path ran 1,074 distinct
// instructions on 150 code lines, at ~215 cycles a line, waiting on
// instruction fetch. Compact code alone gave 12.6 -> 11.1 us; loads and
// rounds four entries a step and the plan's sum over the pairs only, 8.3.
extern "C" __global__ void __launch_bounds__(32)
    route_plan_one(float* logits, int* ids, float* wts, int e, int k, int pad, int* placed_row, int* placed_mat,
                   int* slot, int cap) {
    pdl_wait();
    route_one_warp(logits, ids, wts, e, k, pad, placed_row, placed_mat, slot, cap, threadIdx.x);
}

// route_plan_one with the row in registers (route_one_warp_r, `ROUTE_REGS`):
// the same bytes.
extern "C" __global__ void __launch_bounds__(32)
    route_plan_one_r(float* logits, int* ids, float* wts, int e, int k, int pad, int* placed_row, int* placed_mat,
                     int* slot, int cap) {
    pdl_wait();
    route_one_warp_r(logits, ids, wts, e, k, pad, placed_row, placed_mat, slot, cap, threadIdx.x);
}

// y[r] = sum over slots s in k order of w[r][s] * out[slot[r][s]] (skipped ids
// left out), plus sigmoid(gi[r]) * ys[r] when there is a shared expert.
// (sg = sigmoid(gi[r]), computed once a row by the caller.)
__device__ __forceinline__ float moe_combine_elem(const float* out, const int* slot, const float* wts,
                                                  const float* ys, float sg, int r, int c, int k, int d,
                                                  int shared) {
    float acc = 0.0f;
    for (int s = 0; s < k; s++) {
        int at = slot[(i64)r * k + s];
        if (at < 0) continue;
        acc = acc + wts[(i64)r * k + s] * out[(i64)at * d + c];
    }
    if (shared) acc = acc + sg * ys[(i64)r * d + c];
    return acc;
}

extern "C" __global__ void moe_combine(const float* out, const int* slot, const float* wts, const float* ys,
                                       const float* gi, float* y, int m, int k, int d, int shared) {
    pdl_wait();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)m * d) return;
    int r = (int)(i / d), c = (int)(i % d);
    float sg = shared ? sigmoid(gi[r]) : 0.0f;
    y[i] = moe_combine_elem(out, slot, wts, ys, sg, r, c, k, d, shared);
}

// moe_combine four columns a thread (d a multiple of 4; `COMBINE_VEC`, wide
// calls): a row's slots and weights read once, each slot's four columns by
// one 16-byte load, the loads of four slots issued before their sums. Each
// column's sum is moe_combine_elem's: the same terms in slot order, then
// the shared expert's, so the same bytes.
extern "C" __global__ void moe_combine4(const float* out, const int* slot, const float* wts, const float* ys,
                                        const float* gi, float* y, int m, int k, int d, int shared) {
    pdl_wait();
    int d4 = d / 4;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)m * d4) return;
    int r = (int)(i / d4), c = (int)(i % d4) * 4;
    const int* sl = slot + (i64)r * k;
    const float* sw = wts + (i64)r * k;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int s0 = 0; s0 < k; s0 += 4) {
        int at[4];
        float w[4];
        float4 o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            at[j] = s0 + j < k ? sl[s0 + j] : -1;
            w[j] = s0 + j < k ? sw[s0 + j] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (at[j] >= 0) o[j] = *(const float4*)(out + (i64)at[j] * d + c);
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (at[j] >= 0) {
                a0 = a0 + w[j] * o[j].x;
                a1 = a1 + w[j] * o[j].y;
                a2 = a2 + w[j] * o[j].z;
                a3 = a3 + w[j] * o[j].w;
            }
    }
    if (shared) {
        float sg = sigmoid(gi[r]);
        float4 v = *(const float4*)(ys + (i64)r * d + c);
        a0 = a0 + sg * v.x;
        a1 = a1 + sg * v.y;
        a2 = a2 + sg * v.z;
        a3 = a3 + sg * v.w;
    }
    *(float4*)(y + (i64)r * d + c) = make_float4(a0, a1, a2, a3);
}

// moe_combine of row r (a block a row), then add_rms_norm_q8k's work on it:
// acc += y, xn = RMSNorm(acc) and its Q8_K blocks (MOE_NORM: a decode MoE
// layer's last step and the next layer's input norm in one launch).
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    moe_combine_add_rms_norm_q8k(const float* out, const int* slot, const float* wts, const float* ys,
                                 const float* gi, float* y, int k, int shared, float* acc, const float* w,
                                 float* xn, u8* q, int width, float eps) {
    pdl_wait();
    __shared__ int ss[64];
    __shared__ float sw[64];
    int r = blockIdx.x, t = threadIdx.x;
    float sg = shared ? sigmoid(gi[r]) : 0.0f;
    if (k <= 8) {
        // Up to 8 slots: every slot's loads of the thread's eight columns
        // (and the shared expert's) issued before any sum, so the row waits
        // on memory once, not once a slot (session 13: 9.4 us against 3.2 +
        // 3.9 apart, slot by slot); each column's sum still in slot order,
        // then the shared expert's term, as moe_combine.
        if (t < k) {
            ss[t] = slot[(i64)r * k + t];
            sw[t] = wts[(i64)r * k + t];
        }
        __syncthreads();
        for (int c0 = 0; c0 < width; c0 += 8 * NORM_THREADS) {
            float o[8][8], yv[8];
#pragma unroll
            for (int s = 0; s < 8; s++) {
                int at = s < k ? ss[s] : -1;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    int c = c0 + t + i * NORM_THREADS;
                    o[s][i] = at >= 0 && c < width ? out[(i64)at * width + c] : 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int c = c0 + t + i * NORM_THREADS;
                yv[i] = shared && c < width ? ys[(i64)r * width + c] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int c = c0 + t + i * NORM_THREADS;
                float a = 0.0f;
#pragma unroll
                for (int s = 0; s < 8; s++)
                    if (s < k && ss[s] >= 0) a = a + sw[s] * o[s][i];
                if (c < width) {
                    if (shared) a = a + sg * yv[i];
                    y[(i64)r * width + c] = a;
                }
            }
        }
    } else if (k <= 64) {
        // The row's slots and weights once, then eight columns a thread at a
        // time, slot by slot (each column's sum still in slot order: the
        // loads of a slot's eight columns are issued together).
        if (t < k) {
            ss[t] = slot[(i64)r * k + t];
            sw[t] = wts[(i64)r * k + t];
        }
        __syncthreads();
        for (int c0 = 0; c0 < width; c0 += 8 * NORM_THREADS) {
            float a[8];
#pragma unroll
            for (int i = 0; i < 8; i++) a[i] = 0.0f;
            for (int s = 0; s < k; s++) {
                int at = ss[s];
                if (at < 0) continue;
                float w = sw[s];
                const float* o = out + (i64)at * width;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    int c = c0 + t + i * NORM_THREADS;
                    if (c < width) a[i] = a[i] + w * o[c];
                }
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int c = c0 + t + i * NORM_THREADS;
                if (c < width) {
                    if (shared) a[i] = a[i] + sg * ys[(i64)r * width + c];
                    y[(i64)r * width + c] = a[i];
                }
            }
        }
    } else {
        for (int c = t; c < width; c += NORM_THREADS)
            y[(i64)r * width + c] = moe_combine_elem(out, slot, wts, ys, sg, r, c, k, width, shared);
    }
    __syncthreads();
    norm_row(acc + (i64)r * width, y + (i64)r * width, w, xn + (i64)r * width, width, eps);
    quantize_own_row(xn + (i64)r * width, q + (i64)r * (width / 256) * Q8K_BYTES, width);
}

// Tier mode's decode cache: each placed row's expert id through the layer's
// slot table (expert -> slot), so the expert matmuls read a slot pool with
// the same per-row matrix addressing as the resident weights. -1 stays -1.
extern "C" __global__ void remap_ids(const int* ids, const int* table, int* out, int n) {
    pdl_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int e = ids[i];
    out[i] = e < 0 ? -1 : table[e];
}

// ---------------------------------------------------------------- L2 prefetch
//
// Decode's weight prefetch (`PREFETCH`): byte ranges of weights a later
// kernel of the step reads (the layer's output projection and router while
// the mixer's short kernels run, the next layer's input projections while
// the experts run), pulled into L2 from the second stream, beside the chain.
// It writes nothing and computes nothing: every kernel reads the same bytes
// whether they come from L2 or DRAM. Up to PF_RANGES ranges cut into
// PF_CHUNK-byte pieces, piece c to block c % grid (so consecutive pieces go
// to different SMs); a piece is one bulk prefetch (Hopper's
// cp.async.bulk.prefetch, whole 16-byte units inside the range), or with
// `lines` (and before Hopper) a prefetch a 128-byte line.
#define PF_RANGES 8
#define PF_CHUNK 16384
struct PrefetchJobs {
    u64 ptr[PF_RANGES];
    u64 bytes[PF_RANGES];
    int n;
};

extern "C" __global__ void __launch_bounds__(128) l2_prefetch(PrefetchJobs j, int lines) {
    u64 t = (u64)threadIdx.x * gridDim.x + blockIdx.x, nt = (u64)gridDim.x * blockDim.x;
    for (int r = 0; r < j.n && r < PF_RANGES; r++) {
        u64 len = j.bytes[r], p0 = j.ptr[r];
        u64 pieces = (len + PF_CHUNK - 1) / PF_CHUNK;
        for (u64 c = t; c < pieces; c += nt) {
            u64 off = c * PF_CHUNK;
            u64 n = min((u64)PF_CHUNK, len - off);
#if __CUDA_ARCH__ >= 900
            if (!lines) {
                u32 n16 = (u32)(n & ~(u64)15);
                if (n16 > 0 && (p0 + off) % 16 == 0)
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p0 + off), "r"(n16) : "memory");
                continue;
            }
#endif
            for (u64 b = 0; b < n; b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p0 + off + b));
        }
    }
}
