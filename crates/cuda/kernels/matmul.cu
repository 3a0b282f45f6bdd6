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

#define MT 8
#define WARPS 4

// Q8_K activation block: d (f32), qs[256], bsums[16] (i16) = 292 bytes.
#define Q8K_BYTES 292
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
    i8* qs = (i8*)(ob + 4);
    i16* bsums = (i16*)(ob + 260);
    if (amax == 0.0f) {
        for (int i = 0; i < 8; i++) qs[i * 32 + lane] = 0;
        if (lane < 16) bsums[lane] = 0;
        if (lane == 0) *(float*)ob = 0.0f;
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
    if (lane == 0) *(float*)ob = 1.0f / iscale;
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

// Q4_K: d, dmin (f16), scales[12], qs[128]; 8 lanes per block, lane s takes
// sub-block s (32 values).
struct FmtQ4K {
    enum { ELEMS = 256, BYTES = 144, LANES = 8, ABYTES = Q8K_BYTES };
    u32 q[8];
    int sc, mn;
    float d, dmin;
    __device__ void load(const u8* b, int s) {
        const u8* S = b + 4;
        if (s < 4) {
            sc = S[s] & 63;
            mn = S[s + 4] & 63;
        } else {
            sc = (S[s + 4] & 0x0F) | ((S[s - 4] >> 6) << 4);
            mn = (S[s + 4] >> 4) | ((S[s] >> 6) << 4);
        }
        const u8* qs = b + 16 + (s / 2) * 32;
        int shift = 4 * (s % 2);
        for (int i = 0; i < 8; i++) q[i] = (ld_u32(qs + 4 * i) >> shift) & 0x0F0F0F0Fu;
        d = f16_to_f32(ld_u16(b));
        dmin = f16_to_f32(ld_u16(b + 2));
    }
    // Integer parts of this lane's sub-block against activation block `a`.
    __device__ void part(const u8* a, int s, int& si, int& sm) const {
        const int* aq = (const int*)(a + 4 + s * 32);
        int acc = 0;
        for (int i = 0; i < 8; i++) acc = __dp4a((int)q[i], aq[i], acc);
        const i16* bs = (const i16*)(a + 260);
        si = sc * acc;
        sm = mn * ((int)bs[2 * s] + (int)bs[2 * s + 1]);
    }
    __device__ float combine(float acc, const u8* a, int si, int sm) const {
        float da = *(const float*)a;
        acc = acc + (d * da) * (float)si;
        return acc - (dmin * da) * (float)sm;
    }
};

// Q5_K: d, dmin, scales[12], qh[32], qs[128]; 8 lanes per block.
struct FmtQ5K {
    enum { ELEMS = 256, BYTES = 176, LANES = 8, ABYTES = Q8K_BYTES };
    u32 q[8];
    int sc, mn;
    float d, dmin;
    __device__ void load(const u8* b, int s) {
        const u8* S = b + 4;
        if (s < 4) {
            sc = S[s] & 63;
            mn = S[s + 4] & 63;
        } else {
            sc = (S[s + 4] & 0x0F) | ((S[s - 4] >> 6) << 4);
            mn = (S[s + 4] >> 4) | ((S[s] >> 6) << 4);
        }
        const u8* qh = b + 16;
        const u8* qs = b + 48 + (s / 2) * 32;
        int shift = 4 * (s % 2);
        for (int i = 0; i < 8; i++) {
            u32 lo = (ld_u32(qs + 4 * i) >> shift) & 0x0F0F0F0Fu;
            u32 hi = 0;
            for (int k = 0; k < 4; k++) hi |= (u32)((qh[4 * i + k] >> s) & 1) << (8 * k + 4);
            q[i] = lo | hi;
        }
        d = f16_to_f32(ld_u16(b));
        dmin = f16_to_f32(ld_u16(b + 2));
    }
    __device__ void part(const u8* a, int s, int& si, int& sm) const {
        const int* aq = (const int*)(a + 4 + s * 32);
        int acc = 0;
        for (int i = 0; i < 8; i++) acc = __dp4a((int)q[i], aq[i], acc);
        const i16* bs = (const i16*)(a + 260);
        si = sc * acc;
        sm = mn * ((int)bs[2 * s] + (int)bs[2 * s + 1]);
    }
    __device__ float combine(float acc, const u8* a, int si, int sm) const {
        float da = *(const float*)a;
        acc = acc + (d * da) * (float)si;
        return acc - (dmin * da) * (float)sm;
    }
};

// Q6_K: ql[128], qh[64], scales[16] (i8), d (f16); 16 lanes per block, lane g
// takes group g (16 values).
struct FmtQ6K {
    enum { ELEMS = 256, BYTES = 210, LANES = 16, ABYTES = Q8K_BYTES };
    u32 q[4];
    int sc;
    float d;
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
    __device__ void part(const u8* a, int g, int& si, int& sm) const {
        const int* aq = (const int*)(a + 4 + g * 16);
        int acc = 0;
        for (int i = 0; i < 4; i++) acc = __dp4a((int)q[i], aq[i], acc);
        si = sc * acc;
        sm = 0;
    }
    __device__ float combine(float acc, const u8* a, int si, int) const {
        float da = *(const float*)a;
        return acc + (d * da) * (float)si;
    }
};

// Q8_0: d (f16), qs[32]; 8 lanes per block, 4 values each.
struct FmtQ8_0 {
    enum { ELEMS = 32, BYTES = 34, LANES = 8, ABYTES = Q8A_BYTES };
    u32 q;
    float d;
    __device__ void load(const u8* b, int s) {
        const u8* p = b + 2 + 4 * s;
        q = (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
        d = f16_to_f32(ld_u16(b));
    }
    __device__ void part(const u8* a, int s, int& si, int& sm) const {
        si = __dp4a((int)q, ((const int*)a)[s], 0);
        sm = 0;
    }
    __device__ float combine(float acc, const u8* a, int si, int) const {
        float da = *(const float*)(a + 32);
        return acc + (d * da) * (float)si;
    }
};

// Integer-block formats: lane = (group, sub); G = 32 / LANES groups walk the
// blocks in turn.
template <class F>
__device__ void mm_blocks(const u8* W, i64 mat_stride, int row_bytes, const int* mats,
                          const u8* A, float* Y, int rows, int m, int nb) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j = blockIdx.x * WARPS + warp;
    int r0 = blockIdx.y * MT;
    if (j >= rows || r0 >= m) return;
    const int G = 32 / F::LANES;
    int g = lane / F::LANES, s = lane % F::LANES;
    int nr = min(MT, m - r0);
    i64 arow = (i64)nb * F::ABYTES;
    float acc[MT];
    int mat[MT];
    for (int t = 0; t < MT; t++) {
        acc[t] = 0.0f;
        mat[t] = t < nr ? (mats ? mats[r0 + t] : 0) : -1;
    }
    F f;
    // Every lane runs every step (the shuffles need the whole warp); a group
    // past the last block adds nothing.
    for (int b0 = 0; b0 < nb; b0 += G) {
        int b = b0 + g;
        bool live = b < nb;
        int cur = -1;
        for (int t = 0; t < MT; t++) {
            if (mat[t] < 0) continue;
            if (mat[t] != cur) {
                cur = mat[t];
                if (live) f.load(W + cur * mat_stride + (i64)j * row_bytes + (i64)b * F::BYTES, s);
            }
            const u8* a = A + (r0 + t) * arow + (i64)(live ? b : 0) * F::ABYTES;
            int si = 0, sm = 0;
            if (live) f.part(a, s, si, sm);
            si = isum_lanes(si, F::LANES);
            sm = isum_lanes(sm, F::LANES);
            if (live) acc[t] = f.combine(acc[t], a, si, sm);
        }
    }
    // Groups: a fixed butterfly over the group index.
    for (int t = 0; t < MT; t++) {
        for (int o = F::LANES; o < 32; o *= 2) acc[t] = acc[t] + __shfl_xor_sync(0xffffffffu, acc[t], o);
    }
    if (lane == 0) {
        for (int t = 0; t < nr; t++) Y[(i64)(r0 + t) * rows + j] = mat[t] < 0 ? 0.0f : acc[t];
    }
}

#define MM_KERNEL(name, F)                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) {                                                       \
        mm_blocks<F>(W, mat_stride, row_bytes, mats, A, Y, rows, m, nb);                      \
    }

MM_KERNEL(mm_q4_k, FmtQ4K)
MM_KERNEL(mm_q5_k, FmtQ5K)
MM_KERNEL(mm_q6_k, FmtQ6K)
MM_KERNEL(mm_q8_0, FmtQ8_0)

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
