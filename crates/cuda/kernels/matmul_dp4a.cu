// Quantized matmul rows: y[r][j] = W_{mat(r)}[j] . x[r].
//
// Every kernel here reduces each output element in one order fixed by the
// row length (see "formats" below): integer sums per weight block, exact in
// any order, then one float step per block in block order. Nothing depends on
// how many rows the call has, which tile a row falls in, which other rows
// share it, or which kernel (dp4a rows, tensor-core tiles) ran: m = 1 (decode)
// and m = chunk (prefill) compute the same bytes.
//
// Activations are quantized per row exactly as the CPU does (Q8_K for the
// K-quants, Q8_0 for Q8_0; f32 rows for float weights), so the integer parts
// equal the CPU's and only the float accumulation order differs.
//
// `mats` (may be null) gives each activation row its stacked matrix (expert);
// a negative entry marks an unused row (its outputs are written as 0).

#define MT 16
#define WARPS 4

// Q8_0 activation block as laid out here: qs[32], then d widened to f32 = 36 bytes.
#define Q8A_BYTES 36

// ---------------------------------------------------------------- activations

// One warp per (row, 256-block): ggml's quantize_row_q8_K_ref (q8k_block in
// common.cuh).
extern "C" __global__ void quantize_q8k(const float* x, u8* out, int cols, int m) {
    pdl_wait();
    int nb = cols / 256;
    int blk = blockIdx.x;
    int r = blockIdx.y;
    if (r >= m || blk >= nb) return;
    q8k_block(x + (i64)r * cols + blk * 256, out + ((i64)r * nb + blk) * Q8K_BYTES, threadIdx.x);
}

// A warp per (row, 32-block), a lane a value: ggml's quantize_row_q8_0_ref
// (d from the block's largest magnitude, a maximum that is the same in any
// order, rounded to f16; quants rounded half away from zero). Launch with
// whole warps a block of threads.
extern "C" __global__ void quantize_q8_0(const float* x, u8* out, int cols, int m) {
    pdl_wait();
    int nb = cols / 32;
    i64 t = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (t >= (i64)m * nb) return;
    int r = (int)(t / nb), blk = (int)(t % nb);
    float v = x[(i64)r * cols + blk * 32 + lane];
    float amax = fabsf(v);
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    u8* ob = out + t * Q8A_BYTES;
    ((i8*)ob)[lane] = (i8)roundf(v * id);
    if (lane == 0) *(float*)(ob + 32) = f16_to_f32(f32_to_f16(d));
}

// ---------------------------------------------------------------- formats
//
// The order per output element, shared by every kernel below (the dp4a row
// kernels for any m and the tensor-core tile kernels for wide calls):
//
//     acc = 0
//     for each weight block b, in order:
//         isum = sum over the block's parts of scale_part * dot_part   (exact int)
//         msum = sum over the block's parts of min_part * bsum_part    (exact int)
//         acc = acc + (d_b * da_b) * float(isum)  [ - (dmin_b * da_b) * float(msum) ]
//
// The integer sums are exact whatever order or unit (dp4a, mma) computes
// them, and the float steps use explicit round-to-nearest intrinsics that the
// compiler never fuses into FMAs, so every kernel computes each element with
// the same operations: m = 1 (decode) and m = chunk (prefill) agree by
// construction. The sums fit in int32: Q4_K 8 x 63 x 32 x 15 x 127 < 2^25,
// Q5_K < 2^26, Q6_K 16 x 128 x 16 x 32 x 127 < 2^28.

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

#define FMUL __fmul_rn
#define FADD __fadd_rn
#define FSUB __fsub_rn

// One block's float step (K-quants with mins).
__device__ __forceinline__ float step_min(float acc, float d, float dmin, float da, int isum, int msum) {
    acc = FADD(acc, FMUL(FMUL(d, da), __int2float_rn(isum)));
    return FSUB(acc, FMUL(FMUL(dmin, da), __int2float_rn(msum)));
}
// One block's float step (formats without mins).
__device__ __forceinline__ float step_plain(float acc, float d, float da, int isum) {
    return FADD(acc, FMUL(FMUL(d, da), __int2float_rn(isum)));
}

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

// Sixteen byte products: four words of weights against four of activations.
__device__ __forceinline__ int dot16(const u32* q, const int4& x) {
    int t = __dp4a((int)q[0], x.x, 0);
    t = __dp4a((int)q[1], x.y, t);
    t = __dp4a((int)q[2], x.z, t);
    return __dp4a((int)q[3], x.w, t);
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

// Each format splits a block into LANES parts: `iprod`/`mprod` give one part's
// integer terms, `step` the block's float step from the summed terms.

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
    __device__ int iprod(const A& x) const { return sc * dot32(q, x); }
    __device__ int mprod(const A& x) const { return mn * x.bs; }
    static __device__ float step(float acc, float d, float dmin, float da, int is, int ms) {
        return step_min(acc, d, dmin, da, is, ms);
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
    __device__ int iprod(const A& x) const { return sc * dot32(q, x); }
    __device__ int mprod(const A& x) const { return mn * x.bs; }
    static __device__ float step(float acc, float d, float dmin, float da, int is, int ms) {
        return step_min(acc, d, dmin, da, is, ms);
    }
};

// Q6_K: ql[128], qh[64], scales[16] (i8), d (f16); part g = group g (16 values).
struct ActK16 {
    int4 x;
    float da;
};

__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {  // 2-byte aligned
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

// Four Q6_K values starting at element e (a multiple of 4) as signed bytes.
__device__ __forceinline__ u32 q6_word(const u8* b, int e) {
    int n = e / 128, r = e % 128;
    u32 lo = (ld_u32_a2(b + n * 64 + r % 64) >> (4 * (r / 64))) & 0x0F0F0F0Fu;
    u32 hi = (ld_u32_a2(b + 128 + n * 32 + r % 32) >> (2 * (r / 32))) & 0x03030303u;
    return __vsub4(lo | (hi << 4), 0x20202020u);
}

// 16 bytes at p (2-byte aligned) as four little-endian words: five aligned
// 4-byte loads around them, funnel-shifted into place (the same bytes as
// eight ld_u32_a2, with 5 loads instead of 16 two-byte ones). The fifth word
// lies inside the block wherever Q6_K's ql and qh runs end (they are followed
// by qh and by the scales).
__device__ __forceinline__ void ld16_a2(const u8* p, u32 (&w)[4]) {
    const u32* a = (const u32*)((size_t)p & ~(size_t)3);
    u32 sh = ((u32)(size_t)p & 3u) * 8u;  // 0 or 16
    u32 x0 = a[0], x1 = a[1], x2 = a[2], x3 = a[3], x4 = a[4];
    w[0] = __funnelshift_r(x0, x1, sh);
    w[1] = __funnelshift_r(x1, x2, sh);
    w[2] = __funnelshift_r(x2, x3, sh);
    w[3] = __funnelshift_r(x3, x4, sh);
}

struct FmtQ6K {
    enum { ELEMS = 256, BYTES = 210, LANES = 16, ABYTES = Q8K_BYTES };
    typedef ActK16 A;
    u32 q[4];
    int sc;
    float d, dmin;
    static __device__ A act(const u8* a, int g) {
        A r;
        r.x = ld_i4(a + g * 16);
        r.da = *(const float*)(a + Q8K_D);
        return r;
    }
    // q6_word(b, 16 g + 4 i) for i < 4: elements 16 g .. 16 g + 15 take 16
    // consecutive ql bytes and 16 consecutive qh bytes, each word shifted by
    // the same amount, so both runs are read whole (ld16_a2).
    __device__ void load(const u8* b, int g) {
        int n = g / 8, h = g % 8;
        u32 ql[4], qh[4];
        ld16_a2(b + n * 64 + 16 * (h % 4), ql);
        ld16_a2(b + 128 + n * 32 + 16 * (h % 2), qh);
        int sl = 4 * (h / 4), shh = 2 * (h / 2);
#pragma unroll
        for (int i = 0; i < 4; i++)
            q[i] = __vsub4(((ql[i] >> sl) & 0x0F0F0F0Fu) | (((qh[i] >> shh) & 0x03030303u) << 4), 0x20202020u);
        sc = (int)(i8)b[192 + g];
        d = f16_to_f32(ld_u16(b + 208));
        dmin = 0.0f;
    }
    __device__ int iprod(const A& x) const { return sc * dot16(q, x.x); }
    __device__ int mprod(const A&) const { return 0; }
    static __device__ float step(float acc, float d, float, float da, int is, int) {
        return step_plain(acc, d, da, is);
    }
};

// Q6_K with 8 lanes a block (one-row calls): part s (n = s / 4,
// u = s % 4) takes the 16 ql bytes 64 n + 16 u .. + 15 whole, both nibbles:
// the low ones are group 8 n + u of FmtQ6K (elements 128 n + 16 u + i), the
// high ones group 8 n + u + 4 (elements + 64), and the 16 qh bytes both
// groups share (128 + 32 n + 16 (u % 2), shifted by 2 (u / 2) and by 4
// more). The values stay unsigned (0..63, valid signed bytes for dp4a) and
// each group's dot takes 32 times its activations' sum (the Q8_K block's
// bsums) off, so a part's integer is FmtQ6K's two groups' sc * dot summed:
// the block's sum of every part is the same integer, so the same float
// steps and the same bytes, with half the unpacking a value (no signed
// subtraction a byte, both nibbles of every ql byte loaded) and twice the
// blocks a warp's pass.
struct ActK16x2 {
    int4 lo, hi;
    int bs0, bs1;
    float da;
};

struct FmtQ6K8 {
    enum { ELEMS = 256, BYTES = 210, LANES = 8, ABYTES = Q8K_BYTES };
    typedef ActK16x2 A;
    u32 lo[4], hi[4];
    int sc0, sc1;
    float d, dmin;
    static __device__ A act(const u8* a, int s) {
        const int grp = 8 * (s / 4) + s % 4;
        A r;
        r.lo = ld_i4(a + grp * 16);
        r.hi = ld_i4(a + (grp + 4) * 16);
        const i16* bs = (const i16*)(a + Q8K_BSUMS);
        r.bs0 = bs[grp];
        r.bs1 = bs[grp + 4];
        r.da = *(const float*)(a + Q8K_D);
        return r;
    }
    __device__ void load(const u8* b, int s) {
        const int n = s / 4, u = s % 4, grp = 8 * n + u;
        u32 ql[4], qh[4];
        ld16_a2(b + n * 64 + 16 * u, ql);
        ld16_a2(b + 128 + n * 32 + 16 * (u % 2), qh);
        const int sh = 2 * (u / 2);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = (ql[i] & 0x0F0F0F0Fu) | (((qh[i] >> sh) & 0x03030303u) << 4);
            hi[i] = ((ql[i] >> 4) & 0x0F0F0F0Fu) | (((qh[i] >> (sh + 4)) & 0x03030303u) << 4);
        }
        sc0 = (int)(i8)b[192 + grp];
        sc1 = (int)(i8)b[192 + grp + 4];
        d = f16_to_f32(*(const u16*)(b + 208));  // 210-byte blocks: 2-byte aligned
        dmin = 0.0f;
    }
    __device__ int iprod(const A& x) const {
        return sc0 * (dot16(lo, x.lo) - 32 * x.bs0) + sc1 * (dot16(hi, x.hi) - 32 * x.bs1);
    }
    __device__ int mprod(const A&) const { return 0; }
    static __device__ float step(float acc, float d, float, float da, int is, int) {
        return step_plain(acc, d, da, is);
    }
};

// Q8_0: d (f16), qs[32]; part s = values 16s..16s+15 (two lanes a block, so
// a warp's pass reads 16 consecutive blocks).
struct Act80 {
    u32 x[4];
    float da;
};

struct FmtQ8_0 {
    enum { ELEMS = 32, BYTES = 34, LANES = 2, ABYTES = Q8A_BYTES };
    typedef Act80 A;
    u32 q[4];
    float d, dmin;
    static __device__ A act(const u8* a, int s) {
        A r;
        const u32* x = (const u32*)(a + 16 * s);  // 36-byte blocks: 4-byte aligned
#pragma unroll
        for (int i = 0; i < 4; i++) r.x[i] = x[i];
        r.da = *(const float*)(a + 32);
        return r;
    }
    __device__ void load(const u8* b, int s) {
        ld16_a2(b + 2 + 16 * s, q);  // 34-byte blocks: 2-byte aligned
        d = f16_to_f32(ld_u16(b));
        dmin = 0.0f;
    }
    __device__ int iprod(const A& x) const {
        int t = __dp4a((int)q[0], (int)x.x[0], 0);
        t = __dp4a((int)q[1], (int)x.x[1], t);
        t = __dp4a((int)q[2], (int)x.x[2], t);
        return __dp4a((int)q[3], (int)x.x[3], t);
    }
    __device__ int mprod(const A&) const { return 0; }
    static __device__ float step(float acc, float d, float, float da, int is, int) {
        return step_plain(acc, d, da, is);
    }
};

// ---------------------------------------------------------------- dp4a rows
//
// One warp computes RW weight rows (1 for decode-sized calls, 4 for wide
// calls) against a tile of up to MT activation rows. Lane (g, s) takes part s
// of block b0 + g; a group's integer terms are summed exactly with shuffles,
// then every lane applies the G blocks' float steps in block order.
template <class F, int RW>
__device__ void mm_blocks(const u8* W, i64 mat_stride, int row_bytes, const int* mats,
                          const u8* A, float* Y, int rows, int m, int nb) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j0 = (blockIdx.x * WARPS + warp) * RW;
    int r0 = blockIdx.y * MT;
    if (j0 >= rows || r0 >= m) return;
    const int L = F::LANES, G = 32 / F::LANES;
    int g = lane / L, s = lane % L;
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
    for (int b0 = 0; b0 < nb; b0 += G) {
        int b = b0 + g;
        bool ok = b < nb;
        int cur = -1;
#pragma unroll
        for (int t = 0; t < MT; t++) {
            if (mat[t] < 0) continue;
            if (mat[t] != cur) {
                cur = mat[t];
#pragma unroll
                for (int w = 0; w < RW; w++)
                    if (ok && j0 + w < rows)
                        f[w].load(W + cur * mat_stride + (i64)(j0 + w) * row_bytes + (i64)b * F::BYTES, s);
            }
            typename F::A x = typename F::A();
            if (ok) x = F::act(A + (r0 + t) * arow + (i64)b * F::ABYTES, s);
#pragma unroll
            for (int w = 0; w < RW; w++) {
                bool live = ok && j0 + w < rows;
                int ip = isum_lanes(live ? f[w].iprod(x) : 0, L);
                int mp = isum_lanes(live ? f[w].mprod(x) : 0, L);
                for (int gg = 0; gg < G && b0 + gg < nb; gg++) {
                    int src = gg * L;
                    int is = __shfl_sync(0xffffffffu, ip, src);
                    int ms = __shfl_sync(0xffffffffu, mp, src);
                    float dw = __shfl_sync(0xffffffffu, f[w].d, src);
                    float dm = __shfl_sync(0xffffffffu, f[w].dmin, src);
                    float da = __shfl_sync(0xffffffffu, x.da, src);
                    acc[w][t] = F::step(acc[w][t], dw, dm, da, is, ms);
                }
            }
        }
    }
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
             int rows, int m, int nb) { pdl_wait();                                           \
        mm_blocks<F, RW>(W, mat_stride, row_bytes, mats, A, Y, rows, m, nb);                  \
    }

// ---------------------------------------------------------------- one row
//
// Decode-sized calls (one activation row, or a few rows that each name their
// own expert): one warp per (weight row, activation row), so a warp never
// waits on one expert's loads before the next expert's. Group b0 + G's
// weights and activations are loaded before group b0's arithmetic (double
// buffering), so a row of two groups (2,048 Q5_K columns) waits on memory
// once. The per-element arithmetic is mm_blocks's: exact integer terms per
// block, then the float steps in block order.
template <class F, int NW>
//
// `amap` (optional) names each row's input row: row r reads A's row amap[r]
// (a decode MoE's placed pairs reading their token's row in place of a
// gathered copy of it: the same bytes).
__device__ void mm_row(const u8* W, const u8* W2, i64 mat_stride, int row_bytes, const int* mats,
                       const u8* A, float* Y, int rows, int m, int nb, int jb, const int* amap = nullptr) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j = jb * WARPS + warp;
    int r = blockIdx.y;
    if (j >= rows || r >= m) return;
    const int L = F::LANES, G = 32 / F::LANES;
    int g = lane / L, s = lane % L;
    int mat = mats ? mats[r] : 0;
    if (mat < 0) {
        if (lane == 0) Y[(i64)r * rows + j] = 0.0f;
        return;
    }
    const u8* wr[NW];
    wr[0] = W + mat * mat_stride + (i64)j * row_bytes;
    if (NW == 2) wr[NW - 1] = W2 + mat * mat_stride + (i64)j * row_bytes;
    const u8* ar = A + (i64)(amap ? amap[r] : r) * nb * F::ABYTES;
    F f[NW], fn[NW];
    typename F::A x = typename F::A(), xn = typename F::A();
    if (g < nb) {
#pragma unroll
        for (int w = 0; w < NW; w++) f[w].load(wr[w] + (i64)g * F::BYTES, s);
        x = F::act(ar + (i64)g * F::ABYTES, s);
    }
    float acc[NW];
#pragma unroll
    for (int w = 0; w < NW; w++) acc[w] = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += G) {
        int b = b0 + g;
        bool ok = b < nb;
        if (b + G < nb) {
#pragma unroll
            for (int w = 0; w < NW; w++) fn[w].load(wr[w] + (i64)(b + G) * F::BYTES, s);
            xn = F::act(ar + (i64)(b + G) * F::ABYTES, s);
        }
#pragma unroll
        for (int w = 0; w < NW; w++) {
            int ip = isum_lanes(ok ? f[w].iprod(x) : 0, L);
            int mp = isum_lanes(ok ? f[w].mprod(x) : 0, L);
            for (int gg = 0; gg < G && b0 + gg < nb; gg++) {
                int src = gg * L;
                int is = __shfl_sync(0xffffffffu, ip, src);
                int ms = __shfl_sync(0xffffffffu, mp, src);
                float dw = __shfl_sync(0xffffffffu, f[w].d, src);
                float dm = __shfl_sync(0xffffffffu, f[w].dmin, src);
                float da = __shfl_sync(0xffffffffu, x.da, src);
                acc[w] = F::step(acc[w], dw, dm, da, is, ms);
            }
            f[w] = fn[w];
        }
        x = xn;
    }
    // NW = 2: the gate and up rows of a GLU, combined as silu_mul does.
    if (lane == 0) Y[(i64)r * rows + j] = NW == 2 ? silu(acc[0]) * acc[NW - 1] : acc[0];
}

#define MM_ROW_KERNEL(name, F)                                                                \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) { pdl_wait();                                           \
        mm_row<F, 1>(W, nullptr, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x); \
    }

// y = silu(Wg . x) * (Wu . x) for decode-sized calls: each product exactly as
// the one-row kernel computes it, then silu_mul's expression.
#define MM_GLU_KERNEL(name, F)                                                                \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
        name(const u8* Wg, const u8* Wu, i64 mat_stride, int row_bytes, const int* mats,      \
             const u8* A, float* Y, int rows, int m, int nb) { pdl_wait();                    \
        mm_row<F, 2>(Wg, Wu, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x);     \
    }

// Up to four matrices of one format and width against the same activation
// rows in one launch (a layer's input projections at decode): the blocks of
// job 0 come first, then job 1's, ...; each block computes its job's rows
// exactly as the one-row kernel does.
struct MmJobs {
    const u8* w[4];
    float* y[4];
    int rows[4];
    int nj;
};

// The block's job in a launch whose blockIdx.x runs over job 0's columns of
// `per` weight rows, then job 1's, ...: its matrix, output, rows and column
// within it (constant indices only: an indexed parameter array would be
// copied to local memory).
struct MmJob {
    const u8* w;
    float* y;
    int rows, bx;
};
__device__ __forceinline__ MmJob mm_job(const MmJobs& jobs, int per) {
    int bx = blockIdx.x, j = 0;
    int c0 = (jobs.rows[0] + per - 1) / per, c1 = (jobs.rows[1] + per - 1) / per,
        c2 = (jobs.rows[2] + per - 1) / per;
    if (jobs.nj > 1 && bx >= c0) {
        bx -= c0, j = 1;
        if (jobs.nj > 2 && bx >= c1) {
            bx -= c1, j = 2;
            if (jobs.nj > 3 && bx >= c2) bx -= c2, j = 3;
        }
    }
    return MmJob{j == 0 ? jobs.w[0] : j == 1 ? jobs.w[1] : j == 2 ? jobs.w[2] : jobs.w[3],
                 j == 0 ? jobs.y[0] : j == 1 ? jobs.y[1] : j == 2 ? jobs.y[2] : jobs.y[3],
                 j == 0 ? jobs.rows[0] : j == 1 ? jobs.rows[1] : j == 2 ? jobs.rows[2] : jobs.rows[3], bx};
}

#define MM_MULTI_KERNEL(name, F)                                                              \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
        name(MmJobs jobs, int row_bytes, const u8* A, int m, int nb) { pdl_wait();            \
        int bx = blockIdx.x, j = 0;                                                           \
        int c0 = (jobs.rows[0] + WARPS - 1) / WARPS, c1 = (jobs.rows[1] + WARPS - 1) / WARPS;  \
        int c2 = (jobs.rows[2] + WARPS - 1) / WARPS;                                          \
        if (jobs.nj > 1 && bx >= c0) {                                                        \
            bx -= c0, j = 1;                                                                  \
            if (jobs.nj > 2 && bx >= c1) {                                                    \
                bx -= c1, j = 2;                                                              \
                if (jobs.nj > 3 && bx >= c2) bx -= c2, j = 3;                                 \
            }                                                                                 \
        }                                                                                     \
        const u8* w = j == 0 ? jobs.w[0] : j == 1 ? jobs.w[1] : j == 2 ? jobs.w[2] : jobs.w[3]; \
        float* y = j == 0 ? jobs.y[0] : j == 1 ? jobs.y[1] : j == 2 ? jobs.y[2] : jobs.y[3];  \
        int rows = j == 0 ? jobs.rows[0] : j == 1 ? jobs.rows[1] : j == 2 ? jobs.rows[2] : jobs.rows[3]; \
        mm_row<F, 1>(w, nullptr, 0, row_bytes, nullptr, A, y, rows, m, nb, bx);               \
    }

// A decode MoE's routed experts and its shared expert in one launch: two
// jobs of one format and row width, each with its own weights (stacked
// experts with per-row ids, or one matrix), input rows, row count and
// outputs; job 0's blocks first, blockIdx.y the input row. NW = 2: the GLU
// (gate and up bases), NW = 1: a plain product. Each block computes its
// job's rows exactly as mm_*_1 / mm_*_glu_1 do.
struct MoeJobs {
    const u8* wg[2];
    const u8* wu[2];
    i64 stride[2];
    const int* mats[2];
    const u8* a[2];
    float* y[2];
    const int* amap[2];  // per-row input rows (see mm_row), or null
    int rows[2];
    int m[2];
};

#define MM_MOE_KERNEL(name, F, NW)                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
        name(MoeJobs jobs, int row_bytes, int nb) { pdl_wait();                               \
        int c0 = (jobs.rows[0] + WARPS - 1) / WARPS, bx = blockIdx.x, j = 0;                  \
        if (bx >= c0) bx -= c0, j = 1;                                                        \
        mm_row<F, NW>(j ? jobs.wg[1] : jobs.wg[0], j ? jobs.wu[1] : jobs.wu[0],               \
                      j ? jobs.stride[1] : jobs.stride[0], row_bytes,                         \
                      j ? jobs.mats[1] : jobs.mats[0], j ? jobs.a[1] : jobs.a[0],             \
                      j ? jobs.y[1] : jobs.y[0], j ? jobs.rows[1] : jobs.rows[0],             \
                      j ? jobs.m[1] : jobs.m[0], nb, bx, j ? jobs.amap[1] : jobs.amap[0]);    \
    }

MM_MOE_KERNEL(mm_q5_k_moe_1, FmtQ5K, 1)
MM_MOE_KERNEL(mm_q6_k_moe_1, FmtQ6K, 1)
MM_MOE_KERNEL(mm_q8_0_moe_1, FmtQ8_0, 1)
MM_MOE_KERNEL(mm_q5_k_moe_glu_1, FmtQ5K, 2)
MM_MOE_KERNEL(mm_q6_k_moe_glu_1, FmtQ6K, 2)
MM_MOE_KERNEL(mm_q8_0_moe_glu_1, FmtQ8_0, 2)

MM_MULTI_KERNEL(mm_q5_k_multi_1, FmtQ5K)
MM_MULTI_KERNEL(mm_q6_k_multi_1, FmtQ6K)
MM_MULTI_KERNEL(mm_q8_0_multi_1, FmtQ8_0)

MM_ROW_KERNEL(mm_q5_k_1, FmtQ5K)
// Q6_K one-row calls eight lanes a block: the same bytes.
MM_ROW_KERNEL(mm_q6_k8_1, FmtQ6K8)
MM_ROW_KERNEL(mm_q8_0_1, FmtQ8_0)
MM_GLU_KERNEL(mm_q5_k_glu_1, FmtQ5K)
MM_GLU_KERNEL(mm_q6_k_glu_1, FmtQ6K)
MM_GLU_KERNEL(mm_q8_0_glu_1, FmtQ8_0)

