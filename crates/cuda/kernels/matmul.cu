// Quantized matmul rows: y[r][j] = W_{mat(r)}[j] . x[r].
//
// One warp computes one weight row j against a tile of up to MT activation
// rows. Each output element is reduced in one order fixed by the row length:
// the warp walks the row's blocks in groups (lane group g takes blocks
// g, g + G, ...), each block's integer sum is exact (integer adds in any order),
// one float combine per block in block order per group, then a fixed butterfly
// across the groups. Nothing depends on how many rows the call has, which tile a
// row falls in, or which other rows share it: m = 1 (decode) and m = chunk
// (prefill) compute the same bytes.
//
// Activations are quantized per row exactly as the CPU does (Q8_K for the
// K-quants, Q8_0 for Q8_0; f32 rows for float weights), so the integer parts
// equal the CPU's and only the float accumulation order differs.
//
// `mats` (may be null) gives each activation row its stacked matrix (expert);
// a negative entry marks an unused row (its outputs are written as 0).

#define MT 16
#define WARPS 4

// Q8_K activation block as laid out here: qs[256], bsums[16] (i16), d (f32),
// padding to 304 bytes (so every block starts 16-byte aligned).
#define Q8K_BYTES 304
#define Q8K_BSUMS 256
#define Q8K_D 288
// Q8_0 activation block as laid out here: qs[32], then d widened to f32 = 36 bytes.
#define Q8A_BYTES 36

// ---------------------------------------------------------------- activations

// One warp per (row, 256-block): ggml's quantize_row_q8_K_ref.
extern "C" __global__ void quantize_q8k(const float* x, u8* out, int cols, int m) {
    int nb = cols / 256;
    int blk = blockIdx.x;
    int r = blockIdx.y;
    if (r >= m || blk >= nb) return;
    int lane = threadIdx.x;
    const float* xb = x + (i64)r * cols + blk * 256;
    u8* ob = out + ((i64)r * nb + blk) * Q8K_BYTES;
    float v[8];
    float amax = 0.0f;
    int first = 1 << 30;
    for (int i = 0; i < 8; i++) {
        v[i] = xb[i * 32 + lane];
        amax = fmaxf(amax, fabsf(v[i]));
    }
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    for (int i = 0; i < 8; i++) {
        if (fabsf(v[i]) == amax && first == (1 << 30)) first = i * 32 + lane;
    }
    for (int o = 16; o > 0; o /= 2) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    i8* qs = (i8*)ob;
    i16* bsums = (i16*)(ob + Q8K_BSUMS);
    if (amax == 0.0f) {
        for (int i = 0; i < 8; i++) qs[i * 32 + lane] = 0;
        if (lane < 16) bsums[lane] = 0;
        if (lane == 0) *(float*)(ob + Q8K_D) = 0.0f;
        return;
    }
    float max = xb[first];
    float iscale = -127.0f / max;
    int q[8];
    for (int i = 0; i < 8; i++) {
        int t = __float2int_rn(iscale * v[i]);
        q[i] = t > 127 ? 127 : t;
        qs[i * 32 + lane] = (i8)q[i];
    }
    // bsums[g] = sum of elements 16g..16g+15: element i*32+lane lies in group
    // 2i + lane/16; integer sums, so the order is free.
    for (int i = 0; i < 8; i++) {
        int s = q[i];
        for (int o = 8; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if ((lane & 15) == 0) bsums[2 * i + lane / 16] = (i16)s;
    }
    if (lane == 0) *(float*)(ob + Q8K_D) = 1.0f / iscale;
}

// One thread per (row, 32-block): ggml's quantize_row_q8_0_ref (d rounded to
// f16, quants rounded half away from zero).
extern "C" __global__ void quantize_q8_0(const float* x, u8* out, int cols, int m) {
    int nb = cols / 32;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (i64)m * nb) return;
    int r = (int)(t / nb), blk = (int)(t % nb);
    const float* xb = x + (i64)r * cols + blk * 32;
    u8* ob = out + t * Q8A_BYTES;
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; i++) ((i8*)ob)[i] = (i8)roundf(xb[i] * id);
    *(float*)(ob + 32) = f16_to_f32(f32_to_f16(d));
}

// ---------------------------------------------------------------- formats
//
// Each format splits a block into LANES parts; `acc` adds one part's float
// term. The order per output element: lane (group g, part p) walks blocks
// g, g + G, ... adding its part's term, then one fixed butterfly over the warp.

__device__ __forceinline__ int4 ld_i4(const u8* p) { return *(const int4*)p; }

__device__ __forceinline__ void k4_scale_min(const u8* S, int s, int& sc, int& mn) {
    if (s < 4) {
        sc = S[s] & 63;
        mn = S[s + 4] & 63;
    } else {
        sc = (S[s + 4] & 0x0F) | ((S[s - 4] >> 6) << 4);
        mn = (S[s + 4] >> 4) | ((S[s] >> 6) << 4);
    }
}

// The float combine uses explicit round-to-nearest intrinsics, which the
// compiler never fuses into FMAs: every instantiation of a kernel (any rows
// per warp) computes each element with the same operations.
#define FMUL __fmul_rn
#define FADD __fadd_rn
#define FSUB __fsub_rn

// One part of a Q8_K activation block: 32 values, their bsums pair, d.
struct ActK32 {
    int4 x0, x1;
    int bs;
    float da;
};

__device__ __forceinline__ ActK32 act_k32(const u8* a, int s) {
    ActK32 r;
    r.x0 = ld_i4(a + s * 32);
    r.x1 = ld_i4(a + s * 32 + 16);
    const i16* bs = (const i16*)(a + Q8K_BSUMS);
    r.bs = (int)bs[2 * s] + (int)bs[2 * s + 1];
    r.da = *(const float*)(a + Q8K_D);
    return r;
}

__device__ __forceinline__ int dot32(const u32* q, const ActK32& x) {
    int t = __dp4a((int)q[0], x.x0.x, 0);
    t = __dp4a((int)q[1], x.x0.y, t);
    t = __dp4a((int)q[2], x.x0.z, t);
    t = __dp4a((int)q[3], x.x0.w, t);
    t = __dp4a((int)q[4], x.x1.x, t);
    t = __dp4a((int)q[5], x.x1.y, t);
    t = __dp4a((int)q[6], x.x1.z, t);
    return __dp4a((int)q[7], x.x1.w, t);
}

// Q4_K: d, dmin (f16), scales[12], qs[128]; part s = sub-block s (32 values).
struct FmtQ4K {
    enum { ELEMS = 256, BYTES = 144, LANES = 8, ABYTES = Q8K_BYTES };
    typedef ActK32 A;
    u32 q[8];
    int sc, mn;
    float d, dmin;
    static __device__ A act(const u8* a, int s) { return act_k32(a, s); }
    __device__ void load(const u8* b, int s) {
        k4_scale_min(b + 4, s, sc, mn);
        const u32* qs = (const u32*)(b + 16 + (s / 2) * 32);
        int shift = 4 * (s % 2);
        for (int i = 0; i < 8; i++) q[i] = (qs[i] >> shift) & 0x0F0F0F0Fu;
        u32 dd = *(const u32*)b;
        d = f16_to_f32((u16)(dd & 0xffff));
        dmin = f16_to_f32((u16)(dd >> 16));
    }
    __device__ float acc(float acc, const A& x) const {
        acc = FADD(acc, FMUL(FMUL(d, x.da), (float)(sc * dot32(q, x))));
        return FSUB(acc, FMUL(FMUL(dmin, x.da), (float)(mn * x.bs)));
    }
};

// Q5_K: d, dmin, scales[12], qh[32], qs[128]; part s = sub-block s.
struct FmtQ5K {
    enum { ELEMS = 256, BYTES = 176, LANES = 8, ABYTES = Q8K_BYTES };
    typedef ActK32 A;
    u32 q[8];
    int sc, mn;
    float d, dmin;
    static __device__ A act(const u8* a, int s) { return act_k32(a, s); }
    __device__ void load(const u8* b, int s) {
        k4_scale_min(b + 4, s, sc, mn);
        const u32* qh = (const u32*)(b + 16);
        const u32* qs = (const u32*)(b + 48 + (s / 2) * 32);
        int shift = 4 * (s % 2);
        for (int i = 0; i < 8; i++) {
            u32 lo = (qs[i] >> shift) & 0x0F0F0F0Fu;
            u32 hi = ((qh[i] >> s) & 0x01010101u) << 4;
            q[i] = lo | hi;
        }
        u32 dd = *(const u32*)b;
        d = f16_to_f32((u16)(dd & 0xffff));
        dmin = f16_to_f32((u16)(dd >> 16));
    }
    __device__ float acc(float acc, const A& x) const {
        acc = FADD(acc, FMUL(FMUL(d, x.da), (float)(sc * dot32(q, x))));
        return FSUB(acc, FMUL(FMUL(dmin, x.da), (float)(mn * x.bs)));
    }
};

// Q6_K: ql[128], qh[64], scales[16] (i8), d (f16); part g = group g (16 values).
struct ActK16 {
    int4 x;
    float da;
};

struct FmtQ6K {
    enum { ELEMS = 256, BYTES = 210, LANES = 16, ABYTES = Q8K_BYTES };
    typedef ActK16 A;
    u32 q[4];
    int sc;
    float d;
    static __device__ A act(const u8* a, int g) {
        A r;
        r.x = ld_i4(a + g * 16);
        r.da = *(const float*)(a + Q8K_D);
        return r;
    }
    __device__ void load(const u8* b, int g) {
        for (int i = 0; i < 4; i++) {
            u32 w = 0;
            for (int k = 0; k < 4; k++) {
                int e = g * 16 + i * 4 + k;
                int n = e / 128, r = e % 128;
                int lo = (b[n * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
                int hi = (b[128 + n * 32 + r % 32] >> (2 * (r / 32))) & 3;
                int v = (lo | (hi << 4)) - 32;
                w |= (u32)(u8)(i8)v << (8 * k);
            }
            q[i] = w;
        }
        sc = (int)(i8)b[192 + g];
        d = f16_to_f32(ld_u16(b + 208));
    }
    __device__ float acc(float acc, const A& x) const {
        int t = __dp4a((int)q[0], x.x.x, 0);
        t = __dp4a((int)q[1], x.x.y, t);
        t = __dp4a((int)q[2], x.x.z, t);
        t = __dp4a((int)q[3], x.x.w, t);
        return FADD(acc, FMUL(FMUL(d, x.da), (float)(sc * t)));
    }
};

// Q8_0: d (f16), qs[32]; one lane takes a whole block.
struct Act80 {
    int4 x0, x1;
    float da;
};

struct FmtQ8_0 {
    enum { ELEMS = 32, BYTES = 34, LANES = 1, ABYTES = Q8A_BYTES };
    typedef Act80 A;
    u32 q[8];
    float d;
    static __device__ A act(const u8* a, int) {
        A r;
        const int* x = (const int*)a;  // 36-byte blocks: 4-byte aligned
        r.x0 = make_int4(x[0], x[1], x[2], x[3]);
        r.x1 = make_int4(x[4], x[5], x[6], x[7]);
        r.da = *(const float*)(a + 32);
        return r;
    }
    __device__ void load(const u8* b, int) {
        const u16* h = (const u16*)b;  // 34-byte blocks: 2-byte aligned
        for (int i = 0; i < 8; i++) q[i] = (u32)h[1 + 2 * i] | ((u32)h[2 + 2 * i] << 16);
        d = f16_to_f32(h[0]);
    }
    __device__ float acc(float acc, const A& x) const {
        int t = __dp4a((int)q[0], x.x0.x, 0);
        t = __dp4a((int)q[1], x.x0.y, t);
        t = __dp4a((int)q[2], x.x0.z, t);
        t = __dp4a((int)q[3], x.x0.w, t);
        t = __dp4a((int)q[4], x.x1.x, t);
        t = __dp4a((int)q[5], x.x1.y, t);
        t = __dp4a((int)q[6], x.x1.z, t);
        t = __dp4a((int)q[7], x.x1.w, t);
        return FADD(acc, FMUL(FMUL(d, x.da), (float)t));
    }
};

// RW weight rows per warp (1 for decode-sized calls, 4 for prefill): the
// activation part is loaded once for all RW rows. The per-element order does
// not depend on RW.
template <class F, int RW>
__device__ void mm_blocks(const u8* W, i64 mat_stride, int row_bytes, const int* mats,
                          const u8* A, float* Y, int rows, int m, int nb) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j0 = (blockIdx.x * WARPS + warp) * RW;
    int r0 = blockIdx.y * MT;
    if (j0 >= rows || r0 >= m) return;
    const int G = 32 / F::LANES;
    int g = lane / F::LANES, s = lane % F::LANES;
    int nr = min(MT, m - r0);
    i64 arow = (i64)nb * F::ABYTES;
    float acc[RW][MT];
    int mat[MT];
#pragma unroll
    for (int t = 0; t < MT; t++) {
        mat[t] = t < nr ? (mats ? mats[r0 + t] : 0) : -1;
#pragma unroll
        for (int w = 0; w < RW; w++) acc[w][t] = 0.0f;
    }
    F f[RW];
    for (int b = g; b < nb; b += G) {
        int cur = -1;
#pragma unroll
        for (int t = 0; t < MT; t++) {
            if (mat[t] < 0) continue;
            if (mat[t] != cur) {
                cur = mat[t];
#pragma unroll
                for (int w = 0; w < RW; w++)
                    if (j0 + w < rows)
                        f[w].load(W + cur * mat_stride + (i64)(j0 + w) * row_bytes + (i64)b * F::BYTES, s);
            }
            typename F::A x = F::act(A + (r0 + t) * arow + (i64)b * F::ABYTES, s);
#pragma unroll
            for (int w = 0; w < RW; w++) acc[w][t] = f[w].acc(acc[w][t], x);
        }
    }
    // One fixed butterfly over the warp.
#pragma unroll
    for (int w = 0; w < RW; w++)
#pragma unroll
        for (int t = 0; t < MT; t++)
            for (int o = 16; o > 0; o /= 2) acc[w][t] = FADD(acc[w][t], __shfl_xor_sync(0xffffffffu, acc[w][t], o));
    if (lane == 0) {
#pragma unroll
        for (int w = 0; w < RW; w++)
            if (j0 + w < rows)
                for (int t = 0; t < nr; t++) Y[(i64)(r0 + t) * rows + j0 + w] = mat[t] < 0 ? 0.0f : acc[w][t];
    }
}

#define MM_KERNEL(name, F, RW)                                                                \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) {                                                       \
        mm_blocks<F, RW>(W, mat_stride, row_bytes, mats, A, Y, rows, m, nb);                  \
    }

MM_KERNEL(mm_q4_k, FmtQ4K, 1)
MM_KERNEL(mm_q5_k, FmtQ5K, 1)
MM_KERNEL(mm_q6_k, FmtQ6K, 1)
MM_KERNEL(mm_q8_0, FmtQ8_0, 1)
MM_KERNEL(mm_q4_k_r4, FmtQ4K, 4)
MM_KERNEL(mm_q5_k_r4, FmtQ5K, 4)
MM_KERNEL(mm_q6_k_r4, FmtQ6K, 4)
MM_KERNEL(mm_q8_0_r4, FmtQ8_0, 4)

// Float weights against f32 rows: lane l takes elements l, l + 32, ... in order,
// then a fixed butterfly.
template <int KIND>
__device__ __forceinline__ float ld_w(const u8* row, int i) {
    if (KIND == 0) return ((const float*)row)[i];
    if (KIND == 1) return f16_to_f32(((const u16*)row)[i]);
    return bf16_to_f32(((const u16*)row)[i]);
}

template <int KIND>
__device__ void mm_float(const u8* W, i64 mat_stride, int row_bytes, const int* mats,
                         const float* X, float* Y, int rows, int m, int cols) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j = blockIdx.x * WARPS + warp;
    int r0 = blockIdx.y * MT;
    if (j >= rows || r0 >= m) return;
    int nr = min(MT, m - r0);
    for (int t = 0; t < nr; t++) {
        int mat = mats ? mats[r0 + t] : 0;
        float acc = 0.0f;
        if (mat >= 0) {
            const u8* w = W + mat * mat_stride + (i64)j * row_bytes;
            const float* x = X + (i64)(r0 + t) * cols;
            for (int i = lane; i < cols; i += 32) acc = acc + ld_w<KIND>(w, i) * x[i];
            for (int o = 16; o > 0; o /= 2) acc = acc + __shfl_xor_sync(0xffffffffu, acc, o);
        }
        if (lane == 0) Y[(i64)(r0 + t) * rows + j] = acc;
    }
}

#define MMF_KERNEL(name, KIND)                                                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                   \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const float* X, float* Y, \
             int rows, int m, int cols) {                                                      \
        mm_float<KIND>(W, mat_stride, row_bytes, mats, X, Y, rows, m, cols);                   \
    }

MMF_KERNEL(mm_f32, 0)
MMF_KERNEL(mm_f16, 1)
MMF_KERNEL(mm_bf16, 2)
