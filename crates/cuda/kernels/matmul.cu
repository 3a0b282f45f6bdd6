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

// One thread per (row, 32-block): ggml's quantize_row_q8_0_ref (d rounded to
// f16, quants rounded half away from zero).
extern "C" __global__ void quantize_q8_0(const float* x, u8* out, int cols, int m) {
    pdl_wait();
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

// Q6_K with 8 lanes a block (`Q6_LANES8`, one-row calls): part s (n = s / 4,
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

// Q8_0: d (f16), qs[32]; part s = values 4s..4s+3.
struct Act80 {
    int x;
    float da;
};

struct FmtQ8_0 {
    enum { ELEMS = 32, BYTES = 34, LANES = 8, ABYTES = Q8A_BYTES };
    typedef Act80 A;
    u32 q;
    float d, dmin;
    static __device__ A act(const u8* a, int s) {
        A r;
        r.x = ((const int*)a)[s];  // 36-byte blocks: 4-byte aligned
        r.da = *(const float*)(a + 32);
        return r;
    }
    __device__ void load(const u8* b, int s) {
        q = ld_u32_a2(b + 2 + 4 * s);  // 34-byte blocks: 2-byte aligned
        d = f16_to_f32(ld_u16(b));
        dmin = 0.0f;
    }
    __device__ int iprod(const A& x) const { return __dp4a((int)q, x.x, 0); }
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
// buffering), so a row of two groups (2,048 Q4_K columns) waits on memory
// once. The per-element arithmetic is mm_blocks's: exact integer terms per
// block, then the float steps in block order.
template <class F, int NW, bool ROWS = false>
//
// `amap` (optional) names each row's input row: row r reads A's row amap[r]
// (a decode MoE's placed pairs reading their token's row in place of a
// gathered copy of it: the same bytes).
__device__ void mm_row(const u8* W, const u8* W2, i64 mat_stride, int row_bytes, const int* mats,
                       const u8* A, float* Y, int rows, int m, int nb, int jb, const int* amap = nullptr) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // ROWS: the warp's NW consecutive rows of W from j, each its own output.
    int j = (jb * WARPS + warp) * (ROWS ? NW : 1);
    int r = blockIdx.y;
    if (j >= rows || r >= m) return;
    const int L = F::LANES, G = 32 / F::LANES;
    int g = lane / L, s = lane % L;
    int mat = mats ? mats[r] : 0;
    if (mat < 0) {
        if constexpr (ROWS) {
            if (lane == 0)
                for (int w = 0; w < NW; w++)
                    if (j + w < rows) Y[(i64)r * rows + j + w] = 0.0f;
        } else {
            if (lane == 0) Y[(i64)r * rows + j] = 0.0f;
        }
        return;
    }
    const u8* wr[NW];
    if constexpr (ROWS) {
        // Rows past the matrix's end load its last row and store nothing.
#pragma unroll
        for (int w = 0; w < NW; w++) wr[w] = W + mat * mat_stride + (i64)min(j + w, rows - 1) * row_bytes;
    } else {
        wr[0] = W + mat * mat_stride + (i64)j * row_bytes;
        if (NW == 2) wr[NW - 1] = W2 + mat * mat_stride + (i64)j * row_bytes;
    }
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
    if constexpr (ROWS) {
        if (lane == 0)
#pragma unroll
            for (int w = 0; w < NW; w++)
                if (j + w < rows) Y[(i64)r * rows + j + w] = acc[w];
    } else {
        // NW = 2: the gate and up rows of a GLU, combined as silu_mul does.
        if (lane == 0) Y[(i64)r * rows + j] = NW == 2 ? silu(acc[0]) * acc[NW - 1] : acc[0];
    }
}

#define MM_ROW_KERNEL(name, F)                                                                \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) { pdl_wait();                                           \
        mm_row<F, 1>(W, nullptr, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x); \
    }

// mm_row with four consecutive weight rows a warp (`HEAD_X4`: decode's
// output head, one activation row against tens of thousands of rows): each
// row's arithmetic is mm_row's, and the four rows' next groups are loaded
// before this group's arithmetic, so a warp has eight groups' loads in
// flight where mm_row has two.
#define ROW4 4

// The one-row kernels four rows a warp: a block per 16 weight rows (grid x),
// blockIdx.y the input row. MINB: blocks an SM the registers must allow
// (Q6_K and Q8_0 at 5, 20 warps: 96 and 56 registers without spills; Q4_K
// and Q5_K unbounded, as they spill at 96).
#define MM_ROW4_KERNEL(name, F, MINB)                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)                            \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) { pdl_wait();                                           \
        mm_row<F, ROW4, true>(W, nullptr, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x); \
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

MM_MOE_KERNEL(mm_q4_k_moe_1, FmtQ4K, 1)
MM_MOE_KERNEL(mm_q5_k_moe_1, FmtQ5K, 1)
MM_MOE_KERNEL(mm_q6_k_moe_1, FmtQ6K, 1)
MM_MOE_KERNEL(mm_q8_0_moe_1, FmtQ8_0, 1)
MM_MOE_KERNEL(mm_q4_k_moe_glu_1, FmtQ4K, 2)
MM_MOE_KERNEL(mm_q5_k_moe_glu_1, FmtQ5K, 2)
MM_MOE_KERNEL(mm_q6_k_moe_glu_1, FmtQ6K, 2)
MM_MOE_KERNEL(mm_q8_0_moe_glu_1, FmtQ8_0, 2)

MM_MULTI_KERNEL(mm_q4_k_multi_1, FmtQ4K)
MM_MULTI_KERNEL(mm_q5_k_multi_1, FmtQ5K)
MM_MULTI_KERNEL(mm_q6_k_multi_1, FmtQ6K)
MM_MULTI_KERNEL(mm_q8_0_multi_1, FmtQ8_0)

MM_ROW_KERNEL(mm_q4_k_1, FmtQ4K)
MM_ROW_KERNEL(mm_q5_k_1, FmtQ5K)
MM_ROW_KERNEL(mm_q6_k_1, FmtQ6K)
// Q6_K one-row calls eight lanes a block (`Q6_LANES8`): the same bytes.
MM_ROW_KERNEL(mm_q6_k8_1, FmtQ6K8)
MM_ROW_KERNEL(mm_q8_0_1, FmtQ8_0)
MM_ROW4_KERNEL(mm_q4_k_1x4, FmtQ4K, 1)
MM_ROW4_KERNEL(mm_q5_k_1x4, FmtQ5K, 1)
MM_ROW4_KERNEL(mm_q6_k_1x4, FmtQ6K, 5)
MM_ROW4_KERNEL(mm_q8_0_1x4, FmtQ8_0, 5)
MM_GLU_KERNEL(mm_q4_k_glu_1, FmtQ4K)
MM_GLU_KERNEL(mm_q5_k_glu_1, FmtQ5K)
MM_GLU_KERNEL(mm_q6_k_glu_1, FmtQ6K)
MM_GLU_KERNEL(mm_q8_0_glu_1, FmtQ8_0)

// ---------------------------------------------------------------- lane rows
//
// Decode-sized Q4_K calls with a lane per weight row (mm_q4_k_lane_*): a
// block takes 32 consecutive rows of one matrix against one activation row.
// Each of its kw warps (blockDim.x / 32, one to sixteen: a warp per block of
// the row up to 16) computes, for its
// lane's row, the exact integer terms of blocks w, w + kw, ... (a whole
// 256-block per lane, so no shuffles), and leaves them in shared memory with
// the block's d and dmin; warp 0 then takes the float steps in block order
// (step_min, as every kernel here). The same bytes as mm_row and the tile
// kernels, with about a twentieth of mm_row's instructions per row and block
// (mm_row spends ~150 a row and block on lane sums and broadcasts).
#define LANE_CH 16
#define LANE_THREADS (32 * LANE_CH)

// Byte i (constant) of a Q4_K block's scales[12], held in three words.
__device__ __forceinline__ int sbyte(const u32 (&S)[3], int i) { return (int)((S[i / 4] >> (8 * (i % 4))) & 0xffu); }

// A Q4_K block (144 bytes) in nine 16-byte words: d, dmin and scales[12],
// then qs[128].
#define Q4K_WORDS 9
__device__ __forceinline__ void q4k_lane_load(const u8* blk, uint4 (&q)[Q4K_WORDS]) {
#pragma unroll
    for (int i = 0; i < Q4K_WORDS; i++) q[i] = ((const uint4*)blk)[i];
}

// The isum and msum of one Q4_K block held in registers (k4_scale_min's
// scales and mins per sub-block, dot32's products) against a Q8_K block `ab`
// (global or shared memory); the block's d and dmin (f16 pair) are q[0].x.
__device__ __forceinline__ void q4k_lane_dot(const uint4 (&blk)[Q4K_WORDS], const u8* ab, int& isum, int& msum) {
    const u32 S[3] = {blk[0].y, blk[0].z, blk[0].w};
    int4 bw0 = ld_i4(ab + Q8K_BSUMS), bw1 = ld_i4(ab + Q8K_BSUMS + 16);
    const int bw[8] = {bw0.x, bw0.y, bw0.z, bw0.w, bw1.x, bw1.y, bw1.z, bw1.w};
    int is = 0, ms = 0;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        uint4 q0 = blk[1 + 2 * p];
        uint4 q1 = blk[2 + 2 * p];
        const u32 q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        int4 a0 = ld_i4(ab + 64 * p), a1 = ld_i4(ab + 64 * p + 16);
        int4 a2 = ld_i4(ab + 64 * p + 32), a3 = ld_i4(ab + 64 * p + 48);
        const int alo[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const int ahi[8] = {a2.x, a2.y, a2.z, a2.w, a3.x, a3.y, a3.z, a3.w};
        int dlo = 0, dhi = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            dlo = __dp4a((int)(q[i] & 0x0F0F0F0Fu), alo[i], dlo);
            dhi = __dp4a((int)((q[i] >> 4) & 0x0F0F0F0Fu), ahi[i], dhi);
        }
        // Sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles).
#pragma unroll
        for (int h2 = 0; h2 < 2; h2++) {
            int s = 2 * p + h2, sc, mn;
            if (s < 4) {
                sc = sbyte(S, s) & 63;
                mn = sbyte(S, s + 4) & 63;
            } else {
                sc = (sbyte(S, s + 4) & 0x0F) | ((sbyte(S, s - 4) >> 6) << 4);
                mn = (sbyte(S, s + 4) >> 4) | ((sbyte(S, s) >> 6) << 4);
            }
            int pair = (int)(short)(bw[s] & 0xffff) + (bw[s] >> 16);
            is += sc * (h2 ? dhi : dlo);
            ms += mn * pair;
        }
    }
    isum = is;
    msum = ms;
}

// The delta net's gated norm of one 256-block of a row (whole heads of dv
// values, dv a multiple of 32 dividing 256) and its Q8_K block, by one
// warp: the bytes gated_norm_q8k_lane0 then quantize_q8k give. Lane h adds
// head h's squares in f64 in index order, as sumsq_lane0's lane 0 adds one
// head's (each square of an f32 is exact in f64, so fused or not the sum
// is the same); then o = ((o * scale) * norm) * silu(z) into `sv` (shared)
// and q8k_block of it.
__device__ __forceinline__ void gn_q8k_block(const float* o, const float* z, const float* nw, int dv, float eps,
                                             float* sv, u8* ob, int lane) {
    for (int i = lane; i < 256; i += 32) sv[i] = o[i];
    __syncwarp();
    double s = 0.0;
    if (lane < 256 / dv) {
        const float* v = sv + lane * dv;
        for (int i = 0; i + 4 <= dv; i += 4) {
            float4 q = *(const float4*)(v + i);
            s += (double)q.x * (double)q.x;
            s += (double)q.y * (double)q.y;
            s += (double)q.z * (double)q.z;
            s += (double)q.w * (double)q.w;
        }
    }
    for (int i = lane; i < 256; i += 32) {
        int h = i / dv;  // the same for the whole warp (32 divides dv)
        double sh = __shfl_sync(0xffffffffu, s, h);
        float mean = (float)(sh / (double)dv);
        float scale = 1.0f / sqrtf(mean + eps);
        sv[i] = ((sv[i] * scale) * nw[i - h * dv]) * silu(z[i]);
    }
    __syncwarp();
    q8k_block(sv, ob, lane);
}

// One block of 32 rows against one activation row. Per chunk of up to
// LANE_CH blocks of K: each lane loads its rows' block first (both matrices
// of a GLU; with `early`, the first chunk's before pdl_wait, as the weights
// never change and their addresses need nothing a previous kernel writes),
// the block's threads copy the chunk's activation blocks into shared memory
// beside those loads, and only then does any arithmetic wait on memory.
// Integer terms per (row, block) are exact, so where they are computed does
// not change them; warp 0's float steps run in block order as before.
// QIN: A holds f32 rows (nb * 256 wide), and the block quantizes the
// chunk's blocks of its row into shared memory itself (q8k_block,
// quantize_q8k's code, a warp a block): the bytes a quantize_q8k launch
// would have written, with no launch (`DOWN_QIN`).
// GN: A holds the delta net's f32 output rows o (nb * 256 wide, heads of
// gdv values) and the block takes the gated norm of each chunk block first
// (gn_q8k_block: gated_norm_q8k's arithmetic, then quantize_q8k's), the
// bytes a gated_norm_q8k launch would have written, with no launch
// (`GN_FOLD`).
// RB: rows a block (32, or 16 with lanes 16-31 idle: twice the blocks for
// a matrix of few rows, each row's arithmetic unchanged).
template <int NW, bool QOUT = false, bool QIN = false, bool GN = false, int RB = 32>
__device__ void mm_lane(const u8* W, const u8* W2, i64 mat_stride, int row_bytes, const int* mats,
                        const u8* A, float* Y, int rows, int m, int nb, int jb, const int* amap, bool early,
                        u8* Q = nullptr, int* cnt = nullptr, const float* gz = nullptr,
                        const float* gw = nullptr, int gdv = 0, float geps = 0.0f) {
    __shared__ int4 part[NW][LANE_CH][32];
    __shared__ __align__(16) u8 act[LANE_CH * Q8K_BYTES];
    int kw = blockDim.x / 32, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int r = blockIdx.y;
    int j = jb * RB + lane;
    bool live = lane < RB && j < rows && r < m;
    uint4 q[NW][Q4K_WORDS];
    const u8* wr[NW];
    if (early) {  // no expert ids: the rows are known before the wait
        wr[0] = W + (i64)j * row_bytes;
        if (NW == 2) wr[NW - 1] = W2 + (i64)j * row_bytes;
        if (live && w < nb) {
#pragma unroll
            for (int v = 0; v < NW; v++) q4k_lane_load(wr[v] + (i64)w * FmtQ4K::BYTES, q[v]);
        }
    }
    pdl_wait();
    if (r >= m) return;  // the whole block
    int mat = mats ? mats[r] : 0;
    if (mat < 0) {  // the whole block: an unused row
        if (w == 0 && live) Y[(i64)r * rows + j] = 0.0f;
        return;
    }
    if (!early) {
        wr[0] = W + mat * mat_stride + (i64)j * row_bytes;
        if (NW == 2) wr[NW - 1] = W2 + mat * mat_stride + (i64)j * row_bytes;
    }
    const u8* ar = A + (i64)(amap ? amap[r] : r) * nb * Q8K_BYTES;
    float acc[NW];
#pragma unroll
    for (int v = 0; v < NW; v++) acc[v] = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += LANE_CH) {
        int be = min(nb, b0 + LANE_CH);
        int b = b0 + w;
        if (live && b < be && !(early && b0 == 0)) {
#pragma unroll
            for (int v = 0; v < NW; v++) q4k_lane_load(wr[v] + (i64)b * FmtQ4K::BYTES, q[v]);
        }
        if constexpr (GN) {
            __shared__ __align__(16) float gstage[LANE_CH][256];
            const float* fr = (const float*)A + (i64)r * nb * 256;
            const float* zr = gz + (i64)r * nb * 256;
            for (int bb = w; bb < be - b0; bb += kw)
                gn_q8k_block(fr + (i64)(b0 + bb) * 256, zr + (i64)(b0 + bb) * 256, gw, gdv, geps, gstage[bb],
                             act + bb * Q8K_BYTES, lane);
        } else if constexpr (QIN) {
            const float* fr = (const float*)A + (i64)(amap ? amap[r] : r) * nb * 256;
            for (int bb = w; bb < be - b0; bb += kw) q8k_block(fr + (i64)(b0 + bb) * 256, act + bb * Q8K_BYTES, lane);
        } else {
            int pieces = (be - b0) * (Q8K_BYTES / 16);
            for (int t = threadIdx.x; t < pieces; t += blockDim.x)
                cp_async16(act + 16 * t, ar + (i64)b0 * Q8K_BYTES + 16 * t, true);
            cp_async_commit();
            cp_async_wait<0>();
        }
        __syncthreads();
        // kw = min(16, nb) warps: one block a warp per chunk; the loop only
        // runs further under a narrower launch.
        for (; b < be; b += kw) {
            if (b != b0 + w && live) {
#pragma unroll
                for (int v = 0; v < NW; v++) q4k_lane_load(wr[v] + (i64)b * FmtQ4K::BYTES, q[v]);
            }
            if (live) {
#pragma unroll
                for (int v = 0; v < NW; v++) {
                    int is, ms;
                    q4k_lane_dot(q[v], act + (b - b0) * Q8K_BYTES, is, ms);
                    part[v][b - b0][lane] = make_int4(is, ms, (int)q[v][0].x, 0);
                }
            }
        }
        __syncthreads();
        if (w == 0 && live)
            for (int bb = b0; bb < be; bb++) {
                float da = *(const float*)(act + (bb - b0) * Q8K_BYTES + Q8K_D);
#pragma unroll
                for (int v = 0; v < NW; v++) {
                    int4 t = part[v][bb - b0][lane];
                    u32 dd = (u32)t.z;
                    acc[v] = step_min(acc[v], f16_to_f32((u16)(dd & 0xffff)), f16_to_f32((u16)(dd >> 16)), da,
                                      t.x, t.y);
                }
            }
        __syncthreads();
    }
    // NW = 2: the gate and up rows of a GLU, combined as mm_row does.
    if (w == 0 && live) Y[(i64)r * rows + j] = NW == 2 ? silu(acc[0]) * acc[NW - 1] : acc[0];
    if (QOUT) {
        // The row's Q8_K blocks (rows a multiple of 256): each block counts
        // itself into its 256 columns' counter once its outputs are fenced;
        // the eighth reads the 256 from L2 and quantizes them as
        // quantize_q8k does (q8k_block), then resets the counter.
        __shared__ int lastq;
        __shared__ float xb[256];
        __threadfence();
        __syncthreads();
        int* c = cnt + (i64)r * 16 + jb / 8;
        if (threadIdx.x == 0) lastq = atomicAdd(c, 1) == 7;
        __syncthreads();
        if (!lastq || w != 0) return;
        __threadfence();
        if (lane == 0) *c = 0;
        const float* yb = Y + (i64)r * rows + (jb / 8) * 256;
#pragma unroll
        for (int i = 0; i < 8; i++) xb[i * 32 + lane] = __ldcg(yb + i * 32 + lane);
        __syncwarp();
        q8k_block(xb, Q + ((i64)r * (rows / 256) + jb / 8) * Q8K_BYTES, lane);
    }
}

// The lane-row forms of mm_q4_k_1, _glu_1, _multi_1, _moe_1 and _moe_glu_1:
// the same arguments, a block per 32 rows (grid x), blockIdx.y the input row,
// 32 x min(16, nb) threads. The one-matrix kernels are held to 80 registers
// (three blocks of eight warps an SM); pdl_wait is in mm_lane.
extern "C" __global__ void __maxnreg__(80)
    mm_q4_k_lane_1(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, int rows,
                   int m, int nb) {
    mm_lane<1>(W, nullptr, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x, nullptr, mats == nullptr);
}

// mm_q4_k_lane_1 with 16 rows a block (`LANE16`: a matrix of few rows,
// e.g. decode's output projections, 2,048 rows in 64 blocks of 32, on twice
// the SMs). The same per-row arithmetic.
extern "C" __global__ void __maxnreg__(80)
    mm_q4_k_lane16_1(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, int rows,
                     int m, int nb) {
    mm_lane<1, false, false, false, 16>(W, nullptr, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x, nullptr,
                                        mats == nullptr);
}

extern "C" __global__ void __launch_bounds__(LANE_THREADS, 1)
    mm_q4_k_lane_glu_1(const u8* Wg, const u8* Wu, i64 mat_stride, int row_bytes, const int* mats, const u8* A,
                       float* Y, int rows, int m, int nb) {
    mm_lane<2>(Wg, Wu, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x, nullptr, mats == nullptr);
}

extern "C" __global__ void __maxnreg__(80) mm_q4_k_lane_multi_1(MmJobs jobs, int row_bytes, const u8* A, int m, int nb) {
    const MmJob j = mm_job(jobs, 32);
    mm_lane<1>(j.w, nullptr, 0, row_bytes, nullptr, A, j.y, j.rows, m, nb, j.bx, nullptr, true);
}

// mm_q4_k_lane_1 on the delta net's f32 output rows O, each block taking
// their gated norm (gate rows Z, weight nw, heads of dv) and Q8_K blocks
// itself (`GN_FOLD`: decode's output projection without the
// gated_norm_q8k launch). m rows (grid y), nb blocks of 256 a row.
extern "C" __global__ void __maxnreg__(80)
    mm_q4_k_lane_gn_1(const u8* W, int row_bytes, const float* O, const float* Z, const float* nw, float* Y, int rows,
                      int m, int nb, int dv, float eps) {
    mm_lane<1, false, false, true>(W, nullptr, 0, row_bytes, nullptr, (const u8*)O, Y, rows, m, nb, blockIdx.x, nullptr,
                                   true, nullptr, nullptr, Z, nw, dv, eps);
}

// Expert ids and input rows come from the routing kernel: no loads before
// the wait.
template <int NW, bool QIN = false>
__device__ __forceinline__ void mm_lane_moe(const MoeJobs& jobs, int row_bytes, int nb) {
    int c0 = (jobs.rows[0] + 31) / 32, bx = blockIdx.x, j = 0;
    if (bx >= c0) bx -= c0, j = 1;
    mm_lane<NW, false, QIN>(j ? jobs.wg[1] : jobs.wg[0], j ? jobs.wu[1] : jobs.wu[0], j ? jobs.stride[1] : jobs.stride[0],
                row_bytes, j ? jobs.mats[1] : jobs.mats[0], j ? jobs.a[1] : jobs.a[0], j ? jobs.y[1] : jobs.y[0],
                j ? jobs.rows[1] : jobs.rows[0], j ? jobs.m[1] : jobs.m[0], nb, bx,
                j ? jobs.amap[1] : jobs.amap[0], false);
}

extern "C" __global__ void __maxnreg__(80) mm_q4_k_lane_moe_1(MoeJobs jobs, int row_bytes, int nb) {
    mm_lane_moe<1>(jobs, row_bytes, nb);
}

// mm_q4_k_lane_moe_1 on f32 input rows, quantized by each block as
// quantize_q8k would (`DOWN_QIN`: decode's down projections without the
// GLU outputs' quantize launch).
extern "C" __global__ void __maxnreg__(80) mm_q4_k_lane_moe_qin_1(MoeJobs jobs, int row_bytes, int nb) {
    mm_lane_moe<1, true>(jobs, row_bytes, nb);
}

extern "C" __global__ void __launch_bounds__(LANE_THREADS, 1) mm_q4_k_lane_moe_glu_1(MoeJobs jobs, int row_bytes, int nb) {
    mm_lane_moe<2>(jobs, row_bytes, nb);
}

// mm_q4_k_lane_moe_glu_1 that also writes its outputs' Q8_K rows for the
// down projections (GLU_Q8K): job j's rows to q[j], its counters from
// cnt + 512 j (16 a row, rows < 32, outputs a multiple of 256, at most 4096).
extern "C" __global__ void __launch_bounds__(LANE_THREADS, 1)
    mm_q4_k_lane_moe_glu_q8k_1(MoeJobs jobs, int row_bytes, int nb, u8* q0, u8* q1, int* cnt) {
    int c0 = (jobs.rows[0] + 31) / 32, bx = blockIdx.x, j = 0;
    if (bx >= c0) bx -= c0, j = 1;
    mm_lane<2, true>(j ? jobs.wg[1] : jobs.wg[0], j ? jobs.wu[1] : jobs.wu[0], j ? jobs.stride[1] : jobs.stride[0],
                     row_bytes, j ? jobs.mats[1] : jobs.mats[0], j ? jobs.a[1] : jobs.a[0], j ? jobs.y[1] : jobs.y[0],
                     j ? jobs.rows[1] : jobs.rows[0], j ? jobs.m[1] : jobs.m[0], nb, bx,
                     j ? jobs.amap[1] : jobs.amap[0], false, j ? q1 : q0, cnt + 512 * j);
}

MM_KERNEL(mm_q4_k, FmtQ4K, 1)
MM_KERNEL(mm_q5_k, FmtQ5K, 1)
MM_KERNEL(mm_q6_k, FmtQ6K, 1)
MM_KERNEL(mm_q8_0, FmtQ8_0, 1)
MM_KERNEL(mm_q4_k_r4, FmtQ4K, 4)
MM_KERNEL(mm_q5_k_r4, FmtQ5K, 4)
MM_KERNEL(mm_q6_k_r4, FmtQ6K, 4)
MM_KERNEL(mm_q8_0_r4, FmtQ8_0, 4)

// ---------------------------------------------------------------- tensor cores
//
// Wide Q4_K / Q5_K calls on int8 mma.sync (m16n8k32, s32 accumulators): a
// block computes 128 weight rows (32 per warp: two m16 tiles) against 16
// activation rows (two n8 tiles) staged in shared memory per weight block.
// Each mma computes one sub-block's exact dots; the scale products, the sums
// over sub-blocks and the float step are those of the order above, so the
// bytes equal the dp4a kernels'. A tile whose rows use several matrices
// (experts) is computed once per matrix, storing that matrix's rows; the
// expert plan pads each expert's rows to a multiple of 16 so that is rare.

#define TQ_ROWS 16
#define TQ_WROWS 128
#define TQ_AST 288  // staged row stride: 256 quants + 32 (conflict-free 8-byte fragment reads)

// One m16n8k32 int8 product into fresh int32 sums. B_U8: the B bytes
// (activations) unsigned, as the low bytes of the i16 bsums in the mins'
// tensor-core sums below; signed otherwise.
template <bool B_U8 = false>
__device__ __forceinline__ void mma_s8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#define MMA_S8_ASM(BT)                                                                              \
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8." BT ".s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
                 "{%8,%9}, {%10,%11,%12,%13};"                                                     \
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])                                  \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0))
    if constexpr (B_U8)
        MMA_S8_ASM("u8");
    else
        MMA_S8_ASM("s8");
#undef MMA_S8_ASM
}

__device__ __forceinline__ int byte_of(u32 w, int i) { return (int)((w >> (8 * i)) & 0xffu); }

// One sub-block s (half h of byte group p) of a tensor-core tile step, as
// every tensor-core kernel runs it: the four weight rows' 4-bit values (q:
// the group's 8 bytes per row at this thread's k positions; for Q5_K the
// fifth bits from qh), the two 8-row activation fragments from shared memory
// (rows `ast` bytes apart), one mma per (row pair, activation half), each
// exact dot times its sub-block scale added into isum.
template <int Q5, int N>
__device__ __forceinline__ void tc_subblock(int (&isum)[2][N][4], const uint2 (&q)[4], const uint2 (&qh)[4],
                                            const u8* sq, int ast, int s, int h, int gq, int tq,
                                            const u32 (&scl)[4], const u32 (&sch)[4]) {
    u32 al[4], ah[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        al[i] = (q[i].x >> (4 * h)) & 0x0F0F0F0Fu;
        ah[i] = (q[i].y >> (4 * h)) & 0x0F0F0F0Fu;
        if (Q5) {
            al[i] |= ((qh[i].x >> s) & 0x01010101u) << 4;
            ah[i] |= ((qh[i].y >> s) & 0x01010101u) << 4;
        }
    }
    u32 bq[N][2];
#pragma unroll
    for (int n = 0; n < N; n++) {
        uint2 v = *(const uint2*)(sq + (n * 8 + gq) * ast + s * 32 + 8 * tq);
        bq[n][0] = v.x;
        bq[n][1] = v.y;
    }
#pragma unroll
    for (int a = 0; a < 2; a++) {
        int sc0 = byte_of(s < 4 ? scl[2 * a] : sch[2 * a], s & 3);
        int sc1 = byte_of(s < 4 ? scl[2 * a + 1] : sch[2 * a + 1], s & 3);
#pragma unroll
        for (int n = 0; n < N; n++) {
            int d[4];
            mma_s8(d, al[2 * a], al[2 * a + 1], ah[2 * a], ah[2 * a + 1], bq[n][0], bq[n][1]);
            isum[a][n][0] += sc0 * d[0];
            isum[a][n][1] += sc0 * d[1];
            isum[a][n][2] += sc1 * d[2];
            isum[a][n][3] += sc1 * d[3];
        }
    }
}

template <int Q5>
__device__ void mm_tc_k(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A,
                        float* Y, int rows, int m, int nb) {
    const int BYTES = Q5 ? 176 : 144;
    const int QS = Q5 ? 48 : 16;
    __shared__ __align__(16) u8 sq[TQ_ROWS * TQ_AST];
    __shared__ int sbs[TQ_ROWS][4];  // sub-block bsums as i16 pairs (0,1) (2,3) (4,5) (6,7)
    __shared__ float sda[TQ_ROWS];
    __shared__ int smat[TQ_ROWS];
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int r0 = blockIdx.y * TQ_ROWS;
    if (r0 >= m) return;
    int nr = min(TQ_ROWS, m - r0);
    if (tid < TQ_ROWS) smat[tid] = tid < nr ? (mats ? mats[r0 + tid] : 0) : -1;
    __syncthreads();
    int gq = lane >> 2, tq = lane & 3;
    int wbase = blockIdx.x * TQ_WROWS + warp * 32;
    i64 arow = (i64)nb * Q8K_BYTES;
    // Rows of the tile with no matrix get zeros, as in the dp4a kernels.
    for (int c = tid; c < TQ_ROWS * TQ_WROWS; c += blockDim.x) {
        int t = c / TQ_WROWS, j = blockIdx.x * TQ_WROWS + c % TQ_WROWS;
        if (t < nr && smat[t] < 0 && j < rows) Y[(i64)(r0 + t) * rows + j] = 0.0f;
    }
    int prev = -1;
    for (;;) {
        // The next matrix of the tile, ascending (uniform over the block).
        int cur = 0x7fffffff;
        for (int t = 0; t < TQ_ROWS; t++) {
            int v = smat[t];
            if (v > prev && v < cur) cur = v;
        }
        if (cur == 0x7fffffff) break;
        prev = cur;
        const u8* wr[4];  // this thread's weight rows: wbase + 8i + gq
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int j = min(wbase + 8 * i + gq, rows - 1);
            wr[i] = W + (i64)cur * mat_stride + (i64)j * row_bytes;
        }
        float acc[2][2][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int b = 0; b < 2; b++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[a][b][c] = 0.0f;
        for (int b = 0; b < nb; b++) {
            __syncthreads();
            for (int c = tid; c < TQ_ROWS * 16; c += blockDim.x) {
                int t = c / 16, q = c % 16;
                int4 v = make_int4(0, 0, 0, 0);
                if (t < nr) v = ld_i4(A + (r0 + t) * arow + (i64)b * Q8K_BYTES + q * 16);
                *(int4*)(sq + t * TQ_AST + q * 16) = v;
            }
            for (int c = tid; c < TQ_ROWS * 4; c += blockDim.x) {
                int t = c / 4, w = c % 4;
                u32 v = 0;
                float da = 0.0f;
                if (t < nr) {
                    const u8* ab = A + (r0 + t) * arow + (i64)b * Q8K_BYTES;
                    const i16* bs = (const i16*)(ab + Q8K_BSUMS);
                    int s0 = (int)bs[4 * w] + (int)bs[4 * w + 1];      // |sum of 32 int8| < 2^15
                    int s1 = (int)bs[4 * w + 2] + (int)bs[4 * w + 3];
                    v = ((u32)s0 & 0xffffu) | ((u32)s1 << 16);
                    da = *(const float*)(ab + Q8K_D);
                }
                sbs[t][w] = (int)v;
                if (w == 0) sda[t] = da;
            }
            __syncthreads();
            // Scales and mins of the four rows, packed a byte per sub-block.
            u32 scl[4], sch[4], mnl[4], mnh[4];
            float dw[4], dmw[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32* h = (const u32*)(wr[i] + (i64)b * BYTES);
                u32 h0 = h[0], h1 = h[1], h2 = h[2], h3 = h[3];
                dw[i] = f16_to_f32((u16)(h0 & 0xffff));
                dmw[i] = f16_to_f32((u16)(h0 >> 16));
                scl[i] = h1 & 0x3f3f3f3fu;
                mnl[i] = h2 & 0x3f3f3f3fu;
                sch[i] = (h3 & 0x0f0f0f0fu) | (((h1 >> 6) & 0x03030303u) << 4);
                mnh[i] = ((h3 >> 4) & 0x0f0f0f0fu) | (((h2 >> 6) & 0x03030303u) << 4);
            }
            int isum[2][2][4];
#pragma unroll
            for (int a = 0; a < 2; a++)
#pragma unroll
                for (int n = 0; n < 2; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++) isum[a][n][c] = 0;
            // The fragments take each sub-block's values in the k order
            // "thread tq: a0/b0 = values 8tq..8tq+3, a2/b1 = 8tq+4..8tq+7"
            // (the same permutation for weights and activations, so the
            // exact dots are unchanged) and load 8 contiguous bytes each.
            uint2 qh[4];
            if (Q5) {
#pragma unroll
                for (int i = 0; i < 4; i++) qh[i] = *(const uint2*)(wr[i] + (i64)b * BYTES + 16 + 8 * tq);
            }
#pragma unroll
            for (int p = 0; p < 4; p++) {
                uint2 q[4];
#pragma unroll
                for (int i = 0; i < 4; i++) q[i] = *(const uint2*)(wr[i] + (i64)b * BYTES + QS + 32 * p + 8 * tq);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int s = 2 * p + h;
                    tc_subblock<Q5>(isum, q, qh, sq, TQ_AST, s, h, gq, tq, scl, sch);
                }
            }
            // The block's float step for each of the thread's 16 elements:
            // element (a, n, c) is weight row 2a + c/2 and activation row
            // 8n + 2tq + c%2.
#pragma unroll
            for (int a = 0; a < 2; a++)
#pragma unroll
                for (int n = 0; n < 2; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                        int ms = __dp2a_lo(sbs[t][0], (int)mnl[i], 0);
                        ms = __dp2a_hi(sbs[t][1], (int)mnl[i], ms);
                        ms = __dp2a_lo(sbs[t][2], (int)mnh[i], ms);
                        ms = __dp2a_hi(sbs[t][3], (int)mnh[i], ms);
                        acc[a][n][c] = step_min(acc[a][n][c], dw[i], dmw[i], sda[t], isum[a][n][c], ms);
                    }
        }
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int j = wbase + 8 * (2 * a + c / 2) + gq, t = 8 * n + 2 * tq + c % 2;
                    if (j < rows && t < nr && smat[t] == cur) Y[(i64)(r0 + t) * rows + j] = acc[a][n][c];
                }
    }
}

// The weights of one Q4_K/Q5_K block for this thread's four rows: the
// 16-byte header (d, dmin, packed scales and mins), the Q5 high bits at
// 8 tq.. and the quants at 32 p + 8 tq.. (p = 0..3).
struct TcW {
    u32 h[4][4];
    uint2 q[4][4];  // [p][row]
    uint2 qh[4];
};

template <int Q5>
__device__ __forceinline__ void tc_load_w(TcW& w, const u8* const* wr, int b, int tq) {
    const int BYTES = Q5 ? 176 : 144;
    const int QS = Q5 ? 48 : 16;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u8* blk = wr[i] + (i64)b * BYTES;
        const u32* h = (const u32*)blk;
#pragma unroll
        for (int k = 0; k < 4; k++) w.h[i][k] = h[k];
        if (Q5) w.qh[i] = *(const uint2*)(blk + 16 + 8 * tq);
#pragma unroll
        for (int p = 0; p < 4; p++) w.q[p][i] = *(const uint2*)(blk + QS + 32 * p + 8 * tq);
    }
}

// This thread's share of staging one activation block of the tile's 16 rows:
// two 16-byte pieces of quants (c = tid, tid + 128 of 16 rows x 16 pieces)
// and, for tid < 64, one pair of sub-block bsums (and the row's scale).
struct TcA {
    int4 v[2];
    u32 bs;
    float da;
};

__device__ __forceinline__ void tc_load_a(TcA& x, const u8* A, i64 arow, int r0, int nr, int b, int tid) {
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int c = tid + 128 * k, t = c / 16, q = c % 16;
        x.v[k] = t < nr ? ld_i4(A + (r0 + t) * arow + (i64)b * Q8K_BYTES + q * 16) : make_int4(0, 0, 0, 0);
    }
    x.bs = 0;
    x.da = 0.0f;
    if (tid < TQ_ROWS * 4) {
        int t = tid / 4, w = tid % 4;
        if (t < nr) {
            const u8* ab = A + (r0 + t) * arow + (i64)b * Q8K_BYTES;
            const i16* bs = (const i16*)(ab + Q8K_BSUMS);
            int s0 = (int)bs[4 * w] + (int)bs[4 * w + 1];  // |sum of 32 int8| < 2^15
            int s1 = (int)bs[4 * w + 2] + (int)bs[4 * w + 3];
            x.bs = ((u32)s0 & 0xffffu) | ((u32)s1 << 16);
            x.da = *(const float*)(ab + Q8K_D);
        }
    }
}

__device__ __forceinline__ void tc_store_a(const TcA& x, u8* sq, int (*sbs)[4], float* sda, int tid) {
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int c = tid + 128 * k, t = c / 16, q = c % 16;
        *(int4*)(sq + t * TQ_AST + q * 16) = x.v[k];
    }
    if (tid < TQ_ROWS * 4) {
        int t = tid / 4, w = tid % 4;
        sbs[t][w] = (int)x.bs;
        if (w == 0) sda[t] = x.da;
    }
}

// One block of 128 threads (the staging above assumes exactly 128).
// Software-pipelined over the weight blocks: block b + 1's weights (into
// registers) and activations (into the other of two shared buffers) are
// loaded while block b computes; one barrier per block. The arithmetic of
// each element is unchanged.
template <int Q5>
__device__ void mm_tc_pipe_k(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A,
                        float* Y, int rows, int m, int nb) {
    __shared__ __align__(16) u8 sq[2][TQ_ROWS * TQ_AST];
    __shared__ int sbs[2][TQ_ROWS][4];  // sub-block bsums as i16 pairs (0,1) (2,3) (4,5) (6,7)
    __shared__ float sda[2][TQ_ROWS];
    __shared__ int smat[TQ_ROWS];
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int r0 = blockIdx.y * TQ_ROWS;
    if (r0 >= m) return;
    int nr = min(TQ_ROWS, m - r0);
    if (tid < TQ_ROWS) smat[tid] = tid < nr ? (mats ? mats[r0 + tid] : 0) : -1;
    __syncthreads();
    int gq = lane >> 2, tq = lane & 3;
    int wbase = blockIdx.x * TQ_WROWS + warp * 32;
    i64 arow = (i64)nb * Q8K_BYTES;
    // Rows of the tile with no matrix get zeros, as in the dp4a kernels.
    for (int c = tid; c < TQ_ROWS * TQ_WROWS; c += blockDim.x) {
        int t = c / TQ_WROWS, j = blockIdx.x * TQ_WROWS + c % TQ_WROWS;
        if (t < nr && smat[t] < 0 && j < rows) Y[(i64)(r0 + t) * rows + j] = 0.0f;
    }
    int prev = -1;
    for (;;) {
        // The next matrix of the tile, ascending (uniform over the block).
        int cur = 0x7fffffff;
        for (int t = 0; t < TQ_ROWS; t++) {
            int v = smat[t];
            if (v > prev && v < cur) cur = v;
        }
        if (cur == 0x7fffffff) break;
        prev = cur;
        const u8* wr[4];  // this thread's weight rows: wbase + 8i + gq
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int j = min(wbase + 8 * i + gq, rows - 1);
            wr[i] = W + (i64)cur * mat_stride + (i64)j * row_bytes;
        }
        float acc[2][2][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int b = 0; b < 2; b++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[a][b][c] = 0.0f;
        // Prologue: block 0's activations staged in buffer 0, its weights in
        // registers. (The barrier also orders this matrix's first writes
        // after the previous matrix's last reads of buffer 0.)
        TcW w;
        TcA x;
        __syncthreads();
        tc_load_a(x, A, arow, r0, nr, 0, tid);
        tc_store_a(x, sq[0], sbs[0], sda[0], tid);
        tc_load_w<Q5>(w, wr, 0, tq);
        __syncthreads();
        for (int b = 0; b < nb; b++) {
            const int cb = b & 1;
            TcW wn;
            bool more = b + 1 < nb;
            if (more) {
                tc_load_a(x, A, arow, r0, nr, b + 1, tid);
                tc_load_w<Q5>(wn, wr, b + 1, tq);
            }
            // Scales and mins of the four rows, packed a byte per sub-block.
            u32 scl[4], sch[4], mnl[4], mnh[4];
            float dw[4], dmw[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                u32 h0 = w.h[i][0], h1 = w.h[i][1], h2 = w.h[i][2], h3 = w.h[i][3];
                dw[i] = f16_to_f32((u16)(h0 & 0xffff));
                dmw[i] = f16_to_f32((u16)(h0 >> 16));
                scl[i] = h1 & 0x3f3f3f3fu;
                mnl[i] = h2 & 0x3f3f3f3fu;
                sch[i] = (h3 & 0x0f0f0f0fu) | (((h1 >> 6) & 0x03030303u) << 4);
                mnh[i] = ((h3 >> 4) & 0x0f0f0f0fu) | (((h2 >> 6) & 0x03030303u) << 4);
            }
            int isum[2][2][4];
#pragma unroll
            for (int a = 0; a < 2; a++)
#pragma unroll
                for (int n = 0; n < 2; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++) isum[a][n][c] = 0;
            // The fragments take each sub-block's values in the k order
            // "thread tq: a0/b0 = values 8tq..8tq+3, a2/b1 = 8tq+4..8tq+7"
            // (the same permutation for weights and activations, so the
            // exact dots are unchanged) and load 8 contiguous bytes each.
            const u8* sqb = sq[cb];
#pragma unroll
            for (int p = 0; p < 4; p++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int s = 2 * p + h;
                    tc_subblock<Q5>(isum, w.q[p], w.qh, sqb, TQ_AST, s, h, gq, tq, scl, sch);
                }
            }
            // The block's float step for each of the thread's 16 elements:
            // element (a, n, c) is weight row 2a + c/2 and activation row
            // 8n + 2tq + c%2.
#pragma unroll
            for (int a = 0; a < 2; a++)
#pragma unroll
                for (int n = 0; n < 2; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                        int ms = __dp2a_lo(sbs[cb][t][0], (int)mnl[i], 0);
                        ms = __dp2a_hi(sbs[cb][t][1], (int)mnl[i], ms);
                        ms = __dp2a_lo(sbs[cb][t][2], (int)mnh[i], ms);
                        ms = __dp2a_hi(sbs[cb][t][3], (int)mnh[i], ms);
                        acc[a][n][c] = step_min(acc[a][n][c], dw[i], dmw[i], sda[cb][t], isum[a][n][c], ms);
                    }
            if (more) {
                // Buffer cb ^ 1 was last read in block b - 1, before the
                // barrier that ended it.
                tc_store_a(x, sq[cb ^ 1], sbs[cb ^ 1], sda[cb ^ 1], tid);
                w = wn;
            }
            __syncthreads();
        }
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int j = wbase + 8 * (2 * a + c / 2) + gq, t = 8 * n + 2 * tq + c % 2;
                    if (j < rows && t < nr && smat[t] == cur) Y[(i64)(r0 + t) * rows + j] = acc[a][n][c];
                }
    }
}

// ---------------------------------------------------------------- tensor cores, async copies
//
// The pipelined kernel's arithmetic with the weight and activation blocks
// brought into shared memory by cp.async (two stages: block b + 1 is in
// flight while block b computes) instead of held in registers, so more
// blocks fit on a multiprocessor (the register double buffer held 112 of the
// pipelined kernel's 237 registers: 2 blocks of 4 warps per SM; this one
// takes 163-166 registers and 53-69 KB of shared memory: 3 blocks). Rows are
// padded in shared memory so a warp's 8-byte fragment reads hit distinct
// banks (weights: 160 bytes a row for Q4_K, 224 for Q5_K; activations: 352).
// Every element's integer sums and float steps are the other kernels'.

#define TA_AST 352
template <int Q5, int R = TQ_ROWS>
struct TaLayout {
    static constexpr int BYTES = Q5 ? 176 : 144;
    static constexpr int QS = Q5 ? 48 : 16;
    static constexpr int WST = Q5 ? 224 : 160;
    static constexpr int W_OFF = 0;
    static constexpr int A_OFF = TQ_WROWS * WST;
    static constexpr int BS_OFF = A_OFF + R * TA_AST;
    static constexpr int DA_OFF = BS_OFF + R * 4 * 4;
    static constexpr int STAGE = DA_OFF + R * 4;
};

// Issue the copies of weight block b (the tile's 128 rows of matrix `cur`)
// and activation block b (its R rows) into `stage`: the 16-row kernels' copies
// (3 blocks an SM at 168 registers leave none to keep offsets in).
template <int Q5, int R>
__device__ __forceinline__ void ta_issue(u8* stage, const u8* W, i64 mat_stride, int row_bytes, int cur, int wrow0,
                                         int rows, const u8* A, i64 arow, int r0, int nr, int b, int tid) {
    typedef TaLayout<Q5, R> L;
    const int PIECES = L::BYTES / 16;
    for (int c = tid; c < TQ_WROWS * PIECES; c += 128) {
        int r = c / PIECES, q = c % PIECES;
        int j = min(wrow0 + r, rows - 1);
        const u8* src = W + (i64)cur * mat_stride + (i64)j * row_bytes + (i64)b * L::BYTES + q * 16;
        cp_async16(stage + L::W_OFF + r * L::WST + q * 16, src, true);
    }
    for (int c = tid; c < R * (Q8K_BYTES / 16); c += 128) {
        int t = c / (Q8K_BYTES / 16), q = c % (Q8K_BYTES / 16);
        bool ok = t < nr;
        const u8* src = A + (ok ? (r0 + t) * arow + (i64)b * Q8K_BYTES + q * 16 : 0);
        cp_async16(stage + L::A_OFF + t * TA_AST + q * 16, src, ok);
    }
}

// The 32-row kernels' copies, with no division, remainder or 64-bit multiply
// per 16 bytes (those were ~500 of ~1,900 instructions a block of K), and a
// warp still reading consecutive bytes. Weight pieces c = tid + 128 i (row
// c / PIECES of the tile, piece c % PIECES; rows past the matrix's read its
// last row) come from byte offsets worked out once per block of threads
// (`TaSrc`, kept in registers) from the tile's first row at block 0.
// T: the block's threads (128, or 256 in the 8-warp kernel, where the
// 1,152 Q4_K pieces are 4.5 a thread: the fifth for the first 128 only).
// WS (`TC_WSMEM`): the offsets in shared memory instead, a thread's WP
// of them in a row of TA_WS words (conflict-free for 16-byte reads), read
// again at each block of K: ptxas kept 4 of the 9 in local memory at 168
// registers, and their reloads in the K loop, with the stalls behind them,
// took ~7% of mm_tc_q4_k_async32g_jobs_live's stall samples (ncu, session
// 23). The same offsets, so the same copies.
#define TA_WS 12
template <int Q5, int R, int T = 128, bool WS = false>
struct TaSrc {
    static constexpr int WPC = TaLayout<Q5, R>::BYTES / 16;
    static constexpr int PIECES = TQ_WROWS * WPC;
    static constexpr int WP = (PIECES + T - 1) / T;
    static_assert(T == 128 ? PIECES % T == 0 : PIECES % 128 == 0, "whole weight pieces a thread");
    static_assert(!WS || (T == 128 && WP <= TA_WS), "shared offsets: the 4-warp kernels");
    u32 w[WS ? 1 : WP];
    u32* ws;  // WS: this thread's row of offsets
    __device__ __forceinline__ TaSrc(int row_bytes, int wrow0, int rows, int tid) {
        if constexpr (WS) {
            __shared__ __align__(16) u32 ta_ws[128 * TA_WS];
            ws = ta_ws + tid * TA_WS;
        }
#pragma unroll
        for (int i = 0; i < WP; i++) {
            int c = tid + T * i;
            if constexpr (PIECES % T != 0) c = min(c, PIECES - 1);  // unused past the pieces
            int r = c / WPC, q = c - r * WPC;
            u32 o = (u32)((min(wrow0 + r, rows - 1) - wrow0) * row_bytes + 16 * q);
            if constexpr (WS) ws[i] = o;
            else w[i] = o;
        }
    }
    // The pieces' offsets for one block's copies (WS: read back by 16-byte
    // loads the compiler may not move or merge, so never held in registers
    // across the K loop).
    __device__ __forceinline__ void offsets(u32 (&o)[WP]) const {
        if constexpr (WS) {
            u32 v[TA_WS];
#pragma unroll
            for (int k = 0; k < (WP + 3) / 4; k++) {
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(v[4 * k]), "=r"(v[4 * k + 1]), "=r"(v[4 * k + 2]), "=r"(v[4 * k + 3])
                             : "r"(smem_addr(ws + 4 * k)));
            }
#pragma unroll
            for (int i = 0; i < WP; i++) o[i] = v[i];
        } else {
#pragma unroll
            for (int i = 0; i < WP; i++) o[i] = w[i];
        }
    }
};

// Weight block b of the tile whose first row is at `wt`, and activation
// block b of its R rows from `at` (`arow` bytes apart; rows from `nr` on are
// zero-filled): warp w copies activation rows w, w + 4, ..., lane l < 19
// piece l of each, one row's 304 consecutive bytes an instruction at offsets
// that step by a constant. The same bytes in the same places as ta_issue.
template <int Q5, int R, int T = 128, bool WS = false>
__device__ __forceinline__ void ta_issue_kept(u8* stage, const u8* wt, const u8* at, const TaSrc<Q5, R, T, WS>& src,
                                              u32 arow, int nr, int b, int tid) {
    typedef TaLayout<Q5, R> L;
    typedef TaSrc<Q5, R, T, WS> S;
    constexpr int NWARP = T / 32;
    static_assert(R % NWARP == 0, "activation rows a warp");
    const u8* wb = wt + (i64)b * L::BYTES;
    u32 off[S::WP];
    src.offsets(off);
#pragma unroll
    for (int i = 0; i < S::WP; i++) {
        int c = tid + T * i, r = c / S::WPC, q = c - r * S::WPC;
        if (S::PIECES % T == 0 || c < S::PIECES) cp_async16(stage + L::W_OFF + r * L::WST + q * 16, wb + off[i], true);
    }
    int warp = tid / 32, lane = tid % 32;
    if (lane < Q8K_BYTES / 16) {
        const u8* ab = at + (i64)b * Q8K_BYTES + 16 * lane;
        u8* ad = stage + L::A_OFF + warp * TA_AST + 16 * lane;
        // Opaque, so the rows' addresses are worked out here (a multiply-add
        // each) rather than hoisted out of the K loop into local memory.
        asm volatile("" : "+l"(ab));
#pragma unroll
        for (int k = 0; k < R / NWARP; k++) {
            int t = warp + NWARP * k;
            bool ok = t < nr;
            cp_async16(ad + NWARP * k * TA_AST, ab + (ok ? (u32)t * arow : 0u), ok);
        }
    }
}

// Where a tensor-core tile finds its matrix (base W), its output Y and the
// matrix's rows: the kernel's parameters (`TcArgs`), or, in a launch of
// several matrices, the block's job as staged in shared memory (`TcJob`,
// read again at each use through a volatile pointer, so the three values
// are not held in registers across the K loop as parameters are not).
struct TcArgs {
    const u8* W;
    float* Y;
    int R;
    __device__ __forceinline__ const u8* w() const { return W; }
    __device__ __forceinline__ float* y() const { return Y; }
    __device__ __forceinline__ int rows() const { return R; }
};
struct TcJob {
    const u8* w;
    float* y;
    int rows;
};
struct TcJobRef {
    const volatile TcJob* j;
    __device__ __forceinline__ const u8* w() const { return (const u8*)j->w; }
    __device__ __forceinline__ float* y() const { return (float*)j->y; }
    __device__ __forceinline__ int rows() const { return j->rows; }
};

// MS: each element's mins sum (the integer sum of sub-block min times the
// activations' 32-value sum, which the other kernels take by dp2a from
// bsums pairs staged per block) by two tensor-core products per 16 x 8
// group instead: k slots 4tq..4tq+3 of thread tq hold the 16 raw i16 bsums
// (slot j: bsum j, weight: the min of sub-block j / 2), once with their low
// bytes (unsigned) and once with their high bytes (signed), and the sum is
// high * 256 + low: the same integer, so the same float steps and bytes.
// It needs no staged pairs, so no pass over them and no barrier for them.
//
// tc_async_matrix runs one matrix `cur` of a tile (its rows: the set bits of
// `live`) over the tile's first NG groups of 8 activation rows (all of them
// but with GS, `SAMESUM_CUDA_TC_GROUPS`: the groups past the matrix's last
// row, which in expert calls are the plan's padding, are skipped; every
// stored output's integer sums and float steps are as they were).
//
// T = 256 (the 8-warp kernel): warp w takes weight rows 32 (w & 3) .. + 31
// against activation groups NG (w >> 2) .. + NG - 1 of the tile, so a block
// of 8 warps covers the same tile as 4 warps of 2 NG groups; a warp whose
// groups are all past the matrix's last row (`active` false) only copies
// and waits at the barriers.
template <int Q5, int R, bool MS, int NG, int T = 128, class S, bool WS = false>
__device__ __forceinline__ void tc_async_matrix(u8* dsm, const S& js, i64 mat_stride, int row_bytes, int cur,
                                                int wrow0, const u8* A, i64 arow, int r0, int nr, int nb,
                                                const TaSrc<Q5, R, T, WS>& src, const u8* at, u32 live, int tid,
                                                int warp, int gq, int tq, bool active = true) {
    typedef TaLayout<Q5, R> L;
    constexpr bool KEPT = R >= 32;
    static_assert(T == 128 || (T == 256 && KEPT && MS), "the 8-warp kernel is the 32-row mins kernel");
    const int wq = T == 256 ? warp & 3 : warp;          // the warp's 32 weight rows
    const int g0 = T == 256 ? (warp >> 2) * NG : 0;     // its first activation group
    float acc[2][NG][4];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int n = 0; n < NG; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][n][c] = 0.0f;
    const u8* wt = js.w() + (i64)cur * mat_stride + (i64)wrow0 * row_bytes;
    auto issue = [&](u8* stage, int b) {
        if constexpr (KEPT)
            ta_issue_kept<Q5, R, T>(stage, wt, at, src, (u32)arow, nr, b, tid);
        else
            ta_issue<Q5, R>(stage, js.w(), mat_stride, row_bytes, cur, wrow0, js.rows(), A, arow, r0, nr, b, tid);
    };
    issue(dsm, 0);
    cp_async_commit();
    for (int b = 0; b < nb; b++) {
        u8* st = dsm + (b & 1) * L::STAGE;
        if (b + 1 < nb) {
            issue(dsm + ((b + 1) & 1) * L::STAGE, b + 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        int* sbs = (int*)(st + L::BS_OFF);  // [t][4]: sub-block bsums as i16 pairs
        float* sda = (float*)(st + L::DA_OFF);
        if constexpr (!MS) {
            for (int i = tid; i < R * 4; i += blockDim.x) {
                int t = i / 4, w = i % 4;
                const i16* bs = (const i16*)(st + L::A_OFF + t * TA_AST + Q8K_BSUMS);
                int s0 = (int)bs[4 * w] + (int)bs[4 * w + 1];  // |sum of 32 int8| < 2^15
                int s1 = (int)bs[4 * w + 2] + (int)bs[4 * w + 3];
                sbs[t * 4 + w] = (int)(((u32)s0 & 0xffffu) | ((u32)s1 << 16));
                if (w == 0) sda[t] = *(const float*)(st + L::A_OFF + t * TA_AST + Q8K_D);
            }
            __syncthreads();
        }
        if (active) {
            // This thread's rows: wrow + 8 i WST (one base, constant offsets).
            const u8* wrow = st + L::W_OFF + (wq * 32 + gq) * L::WST;
            u32 scl[4], sch[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                // Header words 1 (scales) and 3 (high scale bits).
                u32 h1 = *(const u32*)(wrow + 8 * i * L::WST + 4);
                u32 h3 = *(const u32*)(wrow + 8 * i * L::WST + 12);
                scl[i] = h1 & 0x3f3f3f3fu;
                sch[i] = (h3 & 0x0f0f0f0fu) | (((h1 >> 6) & 0x03030303u) << 4);
            }
            uint2 qh[4];
            if (Q5) {
#pragma unroll
                for (int i = 0; i < 4; i++) qh[i] = *(const uint2*)(wrow + 8 * i * L::WST + 16 + 8 * tq);
            }
            int isum[2][NG][4];
#pragma unroll
            for (int a = 0; a < 2; a++)
#pragma unroll
                for (int n = 0; n < NG; n++)
#pragma unroll
                    for (int c = 0; c < 4; c++) isum[a][n][c] = 0;
            const u8* sqb = st + L::A_OFF + g0 * 8 * TA_AST;
#pragma unroll
            for (int p = 0; p < 4; p++) {
                uint2 wq[4];
#pragma unroll
                for (int i = 0; i < 4; i++) wq[i] = *(const uint2*)(wrow + 8 * i * L::WST + L::QS + 32 * p + 8 * tq);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int s = 2 * p + h;
                    tc_subblock<Q5>(isum, wq, qh, sqb, TA_AST, s, h, gq, tq, scl, sch);
                }
            }
            // d, dmin and the mins of the four rows, read again for the
            // float steps (shorter live ranges).
            u32 mnl[4], mnh[4];
            float dw[4], dmw[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                uint4 h = *(const uint4*)(wrow + 8 * i * L::WST);
                dw[i] = f16_to_f32((u16)(h.x & 0xffff));
                dmw[i] = f16_to_f32((u16)(h.x >> 16));
                mnl[i] = h.z & 0x3f3f3f3fu;
                mnh[i] = ((h.w >> 4) & 0x0f0f0f0fu) | (((h.z >> 6) & 0x03030303u) << 4);
            }
            if constexpr (MS) {
                // Row i's mins for this thread's slots: bytes (m, m, m', m')
                // of sub-blocks 2tq and 2tq + 1.
                const u32 sel = (tq & 1) ? 0x3322u : 0x1100u;
                u32 pm[4];
#pragma unroll
                for (int i = 0; i < 4; i++) pm[i] = __byte_perm(tq < 2 ? mnl[i] : mnh[i], 0, sel);
#pragma unroll
                for (int n = 0; n < NG; n++) {
                    // Activation row 8n + gq's bsums 4tq..4tq+3.
                    uint2 v = *(const uint2*)(sqb + (n * 8 + gq) * TA_AST + Q8K_BSUMS + 8 * tq);
                    u32 blo = __byte_perm(v.x, v.y, 0x6420u), bhi = __byte_perm(v.x, v.y, 0x7531u);
#pragma unroll
                    for (int a = 0; a < 2; a++) {
                        int lo[4], hi[4];
                        mma_s8<true>(lo, pm[2 * a], pm[2 * a + 1], 0u, 0u, blo, 0u);
                        mma_s8(hi, pm[2 * a], pm[2 * a + 1], 0u, 0u, bhi, 0u);
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                            float da = *(const float*)(sqb + t * TA_AST + Q8K_D);
                            acc[a][n][c] =
                                step_min(acc[a][n][c], dw[i], dmw[i], da, isum[a][n][c], hi[c] * 256 + lo[c]);
                        }
                    }
                }
            } else {
#pragma unroll
                for (int a = 0; a < 2; a++)
#pragma unroll
                    for (int n = 0; n < NG; n++)
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                            int ms = __dp2a_lo(sbs[t * 4 + 0], (int)mnl[i], 0);
                            ms = __dp2a_hi(sbs[t * 4 + 1], (int)mnl[i], ms);
                            ms = __dp2a_lo(sbs[t * 4 + 2], (int)mnh[i], ms);
                            ms = __dp2a_hi(sbs[t * 4 + 3], (int)mnh[i], ms);
                            acc[a][n][c] = step_min(acc[a][n][c], dw[i], dmw[i], sda[t], isum[a][n][c], ms);
                        }
            }
        }
        // Stage b & 1 is refilled by the next iteration's copies (block
        // b + 2): every read of it ends here.
        __syncthreads();
    }
    // The output base through an opaque copy: otherwise the compiler
    // works the 32 store addresses out before the K loop and keeps them
    // in local memory.
    const int rows = js.rows();
    float* yo = js.y() + (i64)r0 * rows + wrow0 + wq * 32 + gq;
    asm volatile("" : "+l"(yo));
    int wbase = wrow0 + wq * 32;
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int n = 0; n < NG; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = 2 * a + c / 2, t = 8 * (g0 + n) + 2 * tq + c % 2;
                if (wbase + 8 * i + gq < rows && ((live >> t) & 1u)) yo[(i64)t * rows + 8 * i] = acc[a][n][c];
            }
}

// `bx`: the tile's column of 128 weight rows (blockIdx.x, or its place in
// its own matrix in a launch of several, `mm_tc_q4_k_async32g_jobs`).
// T: the block's threads (256: the 8-warp kernel, see tc_async_matrix).
// ZERO: rows with no matrix (id -1) get zeros; without it (the `_live`
// kernels, `LIVE_ROWS`) they are left as they were, for callers that read
// no such row, and a tile of none but them does nothing.
template <int Q5, int R, bool MS = false, bool GS = false, int T = 128, bool ZERO = true, class S = TcArgs,
          bool WS = false>
__device__ void mm_tc_async_k(const S& js, i64 mat_stride, int row_bytes, const int* mats, const u8* A, int m,
                              int nb, int bx) {
    constexpr int N = R / 8;  // activation groups of 8 rows (the mma's n)
    extern __shared__ __align__(16) u8 dsm[];
    __shared__ int smat[R];
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int r0 = blockIdx.y * R;
    if (r0 >= m) return;
    int nr = min(R, m - r0);
    for (int t = tid; t < R; t += blockDim.x) smat[t] = t < nr ? (mats ? mats[r0 + t] : 0) : -1;
    __syncthreads();
    int gq = lane >> 2, tq = lane & 3;
    int wrow0 = bx * TQ_WROWS;
    i64 arow = (i64)nb * Q8K_BYTES;
    // Every warp keeps the tile's matrices a lane a row (R <= 32; -1 past
    // the tile's rows), so the bookkeeping below is ballots and one
    // reduction instead of loops over shared memory (ncu, session 16: those
    // loops and the per-element checks of the stores took ~23% of the
    // kernel's stall samples, its K loop being 2 to 8 blocks).
    static_assert(R <= 32, "a lane a tile row");
    const int vmat = lane < R ? smat[lane] : -1;
    const int col = wrow0 + tid;  // the first TQ_WROWS threads: a thread a weight row
    // Rows of the tile with no matrix get zeros, as in the dp4a kernels.
    for (u32 zero = ZERO ? __ballot_sync(0xffffffffu, lane < nr && vmat < 0) : 0u; zero; zero &= zero - 1) {
        int t = __ffs(zero) - 1;
        if ((T == TQ_WROWS || tid < TQ_WROWS) && col < js.rows()) js.y()[(i64)(r0 + t) * js.rows() + col] = 0.0f;
    }
    // The 32-row kernels' copy offsets (unused, so not computed, in the others).
    const TaSrc<Q5, R, T, WS> src(row_bytes, wrow0, js.rows(), tid);
    const u8* at = A + r0 * arow;
    int prev = -1;
    for (;;) {
        // The next matrix of the tile, ascending (uniform over the block).
        const int cur = __reduce_min_sync(0xffffffffu, vmat > prev ? vmat : 0x7fffffff);
        if (cur == 0x7fffffff) break;
        prev = cur;
        const u32 live = __ballot_sync(0xffffffffu, vmat == cur);
        // Groups of 8 rows up to the last of this matrix's rows.
        [[maybe_unused]] const int ng = GS ? (32 - __clz(live) + 7) / 8 : N;
#define TC_MATRIX(G, ACTIVE)                                                                               \
    tc_async_matrix<Q5, R, MS, G, T>(dsm, js, mat_stride, row_bytes, cur, wrow0, A, arow, r0, nr, nb, src, at, live, \
                                     tid, warp, gq, tq, ACTIVE)
        if constexpr (T == 256) {
            // Two groups a warp; a warp whose two are past the matrix's last
            // row (with GS) skips the arithmetic. Every warp runs the same
            // code, so the same barriers.
            static_assert(N == 4, "the 8-warp kernel runs 32-row tiles");
            TC_MATRIX(2, !GS || ng > 2 * (warp >> 2));
        } else if constexpr (GS && N == 4) {
            if (ng == 1) TC_MATRIX(1, true);
            else if (ng == 2) TC_MATRIX(2, true);
            else if (ng == 3) TC_MATRIX(3, true);
            else TC_MATRIX(4, true);
        } else if constexpr (GS && N == 2) {
            if (ng == 1) TC_MATRIX(1, true);
            else TC_MATRIX(2, true);
        } else {
            TC_MATRIX(N, true);
        }
#undef TC_MATRIX
    }
}

#define TC_KERNEL(name, Q5)                                                                    \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) { pdl_wait();                                            \
        mm_tc_k<Q5>(W, mat_stride, row_bytes, mats, A, Y, rows, m, nb);                        \
    }

TC_KERNEL(mm_tc_q4_k, 0)
TC_KERNEL(mm_tc_q5_k, 1)

// The software-pipelined variant (opt-in while it is measured: the same bytes).
#define TC_PIPE_KERNEL(name, Q5)                                                               \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) { pdl_wait();                                            \
        mm_tc_pipe_k<Q5>(W, mat_stride, row_bytes, mats, A, Y, rows, m, nb);                   \
    }

TC_PIPE_KERNEL(mm_tc_q4_k_pipe, 0)
TC_PIPE_KERNEL(mm_tc_q5_k_pipe, 1)

// The async-copy kernel: launch with 2 * TaLayout<Q5>::STAGE bytes of
// dynamic shared memory (52,864 for Q4_K, 69,248 for Q5_K).
#define TC_ASYNC_KERNEL(name, Q5)                                                              \
    extern "C" __global__ void __launch_bounds__(128, 3)                                       \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) { pdl_wait();                                            \
        mm_tc_async_k<Q5, TQ_ROWS>(TcArgs{W, Y, rows}, mat_stride, row_bytes, mats, A, m, nb, blockIdx.x); \
    }

TC_ASYNC_KERNEL(mm_tc_q4_k_async, 0)
TC_ASYNC_KERNEL(mm_tc_q5_k_async, 1)

// The async kernel with 32 activation rows a tile: each weight block staged
// serves twice the rows; every output is the same sequence of integer sums
// and float steps, so the same bytes. Dynamic shared memory:
// 2 * TaLayout<Q5, 32>::STAGE (64,768 for Q4_K, 81,152 for Q5_K). BLOCKS
// blocks an SM: Q4_K takes 3 (168 registers: ptxas keeps 11 values a thread
// in local memory, stored once and read back once per 256-wide block of K,
// ~1% of the block's instructions, for 12 warps an SM instead of 8; ncu had
// the 2-block kernel at 0.77 eligible warps of 1.96 a scheduler, waiting on
// its own dependent steps); Q5_K, whose spills at 168 would be larger, 2.
// MS: the mins sums on tensor cores (see mm_tc_async_k).
#define TC_ASYNC32_KERNEL(name, Q5, BLOCKS, MS, GS)                                             \
    extern "C" __global__ void __launch_bounds__(128, BLOCKS)                                  \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) { pdl_wait();                                            \
        mm_tc_async_k<Q5, 32, MS, GS>(TcArgs{W, Y, rows}, mat_stride, row_bytes, mats, A, m, nb, blockIdx.x); \
    }

TC_ASYNC32_KERNEL(mm_tc_q4_k_async32, 0, 3, false, false)
TC_ASYNC32_KERNEL(mm_tc_q5_k_async32, 1, 2, false, false)
// The Q4_K kernel at 2 blocks an SM (as before session 11), for comparisons
// (SAMESUM_CUDA_TC_OCC3=0): the same code, so the same bytes.
TC_ASYNC32_KERNEL(mm_tc_q4_k_async32_b2, 0, 2, false, false)
// The 32-row Q4_K kernel with the mins sums on tensor cores (MS above;
// `SAMESUM_CUDA_TC_MINS`): the same integers, so the same bytes. (Q5_K's,
// at 2 blocks an SM, would spill.)
TC_ASYNC32_KERNEL(mm_tc_q4_k_async32m, 0, 3, true, false)
// The mins kernel skipping each matrix's groups of rows past its last row
// (GS above; `SAMESUM_CUDA_TC_GROUPS`, default): the same bytes. H200,
// qwen35moe pp4096: 111.2 -> 107.9 ms.
TC_ASYNC32_KERNEL(mm_tc_q4_k_async32g, 0, 3, true, true)

// mm_tc_q4_k_async32g with 8 warps a block (`SAMESUM_CUDA_TC_W8`, opt-in
// until measured): each warp takes half of the tile's activation rows for
// its 32 weight rows, so half the accumulators, 2 blocks of 8 warps an SM
// (16 warps against 12) to hide the K loop's latencies, at the cost of each
// weight fragment's unpacking done by two warps. The same code per output,
// so the same bytes. Dynamic shared memory as mm_tc_q4_k_async32g.
extern "C" __global__ void __launch_bounds__(256, 2)
    mm_tc_q4_k_async32w(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y,
                        int rows, int m, int nb) {
    pdl_wait();
    mm_tc_async_k<0, 32, true, true, 256>(TcArgs{W, Y, rows}, mat_stride, row_bytes, mats, A, m, nb, blockIdx.x);
}

// mm_tc_q4_k_async32g leaving rows with no matrix unwritten (`LIVE_ROWS`,
// opt-in until measured: a wide routed call's places past the last expert's
// rows and its padding, which nothing reads; a tile of places past the last
// expert's rows does nothing). Every row it writes is mm_tc_q4_k_async32g's.
extern "C" __global__ void __launch_bounds__(128, 3)
    mm_tc_q4_k_async32g_live(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y,
                             int rows, int m, int nb) {
    pdl_wait();
    mm_tc_async_k<0, 32, true, true, 128, false>(TcArgs{W, Y, rows}, mat_stride, row_bytes, mats, A, m, nb,
                                                 blockIdx.x);
}

// mm_tc_q4_k_async32g and its live form with the weight pieces' copy
// offsets in shared memory (`TC_WSMEM`, opt-in until measured; see TaSrc):
// the same copies, so the same bytes.
extern "C" __global__ void __launch_bounds__(128, 3)
    mm_tc_q4_k_async32g_ws(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y,
                           int rows, int m, int nb) {
    pdl_wait();
    mm_tc_async_k<0, 32, true, true, 128, true, TcArgs, true>(TcArgs{W, Y, rows}, mat_stride, row_bytes, mats, A,
                                                              m, nb, blockIdx.x);
}
extern "C" __global__ void __launch_bounds__(128, 3)
    mm_tc_q4_k_async32g_live_ws(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A,
                                float* Y, int rows, int m, int nb) {
    pdl_wait();
    mm_tc_async_k<0, 32, true, true, 128, false, TcArgs, true>(TcArgs{W, Y, rows}, mat_stride, row_bytes, mats, A,
                                                               m, nb, blockIdx.x);
}

// mm_tc_q4_k_async32g for up to 4 matrices of one width against the same
// activation rows (and, for expert stacks, the same matrix ids and stride)
// in one launch (`SAMESUM_CUDA_TC_JOBS`): blockIdx.x runs over job 0's
// columns of 128 weight rows, then job 1's, ..., and each block computes
// its tile of its job's matrix as the one-matrix launch would (the same
// code, so the same bytes). A matrix of few rows (a delta net's beta and
// alpha) then runs beside the others instead of as a launch of a few blocks.
// ZERO as in mm_tc_async_k. A macro, as the kernels above, so that each
// kernel's job sits in its own shared memory as before.
#define TC_JOBS_KERNEL(name, ZERO, WS)                                                              \
    extern "C" __global__ void __launch_bounds__(128, 3)                                           \
        name(MmJobs jobs, i64 mat_stride, int row_bytes, const int* mats, const u8* A, int m, int nb) { \
        pdl_wait();                                                                                 \
        const MmJob j = mm_job(jobs, TQ_WROWS);                                                     \
        /* The job in shared memory, read back at each use. */                                      \
        __shared__ TcJob job;                                                                       \
        if (threadIdx.x == 0) job = TcJob{j.w, j.y, j.rows};                                        \
        __syncthreads();                                                                            \
        mm_tc_async_k<0, 32, true, true, 128, ZERO, TcJobRef, WS>(TcJobRef{&job}, mat_stride, row_bytes, mats, A, m, \
                                                                  nb, j.bx);                        \
    }

TC_JOBS_KERNEL(mm_tc_q4_k_async32g_jobs, true, false)
// mm_tc_q4_k_async32g_jobs leaving rows with no matrix unwritten (as
// mm_tc_q4_k_async32g_live).
TC_JOBS_KERNEL(mm_tc_q4_k_async32g_jobs_live, false, false)
// The two with the weight pieces' offsets in shared memory (`TC_WSMEM`,
// opt-in until measured; see TaSrc): the same copies, so the same bytes.
TC_JOBS_KERNEL(mm_tc_q4_k_async32g_jobs_ws, true, true)
TC_JOBS_KERNEL(mm_tc_q4_k_async32g_jobs_live_ws, false, true)

// Float weights against f32 rows: lane l takes elements l, l + 32, ... in order,
// then a fixed butterfly.
template <int KIND>
__device__ __forceinline__ float ld_w(const u8* row, int i) {
    if (KIND == 0) return ((const float*)row)[i];
    if (KIND == 1) return f16_to_f32(((const u16*)row)[i]);
    return bf16_to_f32(((const u16*)row)[i]);
}

#define MMF_U 16

// U: the elements a lane loads a step (the fmas' order does not depend on it).
// WB: the warps (weight rows) a block.
template <int KIND, int U = MMF_U, int WB = WARPS>
__device__ void mm_float(const u8* W, i64 mat_stride, int row_bytes, const int* mats,
                         const float* X, float* Y, int rows, int m, int cols, int jb) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j = jb * WB + warp;
    int r0 = blockIdx.y * MT;
    if (j >= rows || r0 >= m) return;
    int nr = min(MT, m - r0);
    for (int t = 0; t < nr; t++) {
        int mat = mats ? mats[r0 + t] : 0;
        float acc = 0.0f;
        if (mat >= 0) {
            const u8* w = W + mat * mat_stride + (i64)j * row_bytes;
            const float* x = X + (i64)(r0 + t) * cols;
            // U elements' loads issued before their fmas (a row is a
            // chain of dependent fmas per lane; without the batch every
            // step waits for its own load), and the next batch's loads
            // issued before this batch's fmas. The chain is lane l's over
            // elements l, l + 32, ... in order, as before.
            float wv[U], xv[U], wn[U], xn[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                int i = lane + 32 * u;
                wv[u] = i < cols ? ld_w<KIND>(w, i) : 0.0f;
                xv[u] = i < cols ? x[i] : 0.0f;
            }
            for (int i0 = lane; i0 < cols; i0 += 32 * U) {
                int i1 = i0 + 32 * U;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    int i = i1 + 32 * u;
                    wn[u] = i < cols ? ld_w<KIND>(w, i) : 0.0f;
                    xn[u] = i < cols ? x[i] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (i0 + 32 * u < cols) acc = __fmaf_rn(wv[u], xv[u], acc);
#pragma unroll
                for (int u = 0; u < U; u++) {
                    wv[u] = wn[u];
                    xv[u] = xn[u];
                }
            }
            for (int o = 16; o > 0; o /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
        }
        if (lane == 0) Y[(i64)(r0 + t) * rows + j] = acc;
    }
}

#define MMF_KERNEL(name, KIND)                                                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                   \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const float* X, float* Y, \
             int rows, int m, int cols) { pdl_wait();                                          \
        mm_float<KIND>(W, mat_stride, row_bytes, mats, X, Y, rows, m, cols, blockIdx.x);       \
    }

MMF_KERNEL(mm_f32, 0)
MMF_KERNEL(mm_f16, 1)
MMF_KERNEL(mm_bf16, 2)

// Two f32 matrices of one row width against the same rows in one launch (a
// decode MoE's router and its shared expert's input gate): job 0's blocks
// first, each block computing its job's rows as mm_f32 does.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
    mm_f32_multi(MmJobs jobs, int row_bytes, const float* X, int m, int cols) {
    pdl_wait();
    int c0 = (jobs.rows[0] + WARPS - 1) / WARPS;
    int bx = blockIdx.x, j = 0;
    if (jobs.nj > 1 && bx >= c0) bx -= c0, j = 1;
    const u8* w = j == 0 ? jobs.w[0] : jobs.w[1];
    float* y = j == 0 ? jobs.y[0] : jobs.y[1];
    int rows = j == 0 ? jobs.rows[0] : jobs.rows[1];
    mm_float<0>(w, 0, row_bytes, nullptr, X, y, rows, m, cols, bx);
}

// mm_f32_multi for one row whose launch also routes and plans it
// (ROUTE_FOLD): each block, once its outputs are stored, fences them and
// counts itself in `counter`; the last block's first warp resets the counter
// (for the next launch, graph replays included) and routes job 0's outputs
// (the router logits) with route_plan_one's code (route_one_warp), so a
// decode MoE layer needs no routing launch. The same logits, ids, weights
// and plan as mm_f32_multi then route_plan_one. Variants: `_r` routes with
// the row in registers (route_one_warp_r, `ROUTE_REGS`), `_d` loads 32
// elements a lane a step in place of 16 (`ROUTER_DEEP`: a 2,048-wide row's
// 64 loads a lane all issued before its first fma), `_rd` both; the same
// bytes.
#define MMF_ROUTE_KERNEL(name, U, ROUTE, WB)                                                            \
    extern "C" __global__ void __launch_bounds__(WB * 32)                                             \
        name(MmJobs jobs, int row_bytes, const float* X, int cols, int* ids, float* wts, int e, int k, \
             int pad, int* placed_row, int* placed_mat, int* slot, int cap, int* counter) {            \
        pdl_wait();                                                                                    \
        int c0 = (jobs.rows[0] + WB - 1) / WB;                                                         \
        int bx = blockIdx.x, j = 0;                                                                    \
        if (jobs.nj > 1 && bx >= c0) bx -= c0, j = 1;                                                  \
        const u8* w = j == 0 ? jobs.w[0] : jobs.w[1];                                                  \
        float* y = j == 0 ? jobs.y[0] : jobs.y[1];                                                     \
        int rows = j == 0 ? jobs.rows[0] : jobs.rows[1];                                               \
        mm_float<0, U, WB>(w, 0, row_bytes, nullptr, X, y, rows, 1, cols, bx);                         \
        __shared__ int last;                                                                           \
        __threadfence(); /* this thread's stores reach L2 before the count */                          \
        __syncthreads();                                                                               \
        if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)(gridDim.x * gridDim.y) - 1;        \
        __syncthreads();                                                                               \
        if (!last || threadIdx.x >= 32) return;                                                        \
        __threadfence();                                                                               \
        if (threadIdx.x == 0) *counter = 0;                                                            \
        ROUTE(jobs.y[0], ids, wts, e, k, pad, placed_row, placed_mat, slot, cap, threadIdx.x);         \
    }

MMF_ROUTE_KERNEL(mm_f32_multi_route, MMF_U, route_one_warp, WARPS)
MMF_ROUTE_KERNEL(mm_f32_multi_route_r, MMF_U, route_one_warp_r, WARPS)
MMF_ROUTE_KERNEL(mm_f32_multi_route_d, 32, route_one_warp, WARPS)
MMF_ROUTE_KERNEL(mm_f32_multi_route_rd, 32, route_one_warp_r, WARPS)
// mm_f32_multi_route_rd with a warp (a router row) a block (`ROUTER_1W`):
// 257 blocks on the H200's 132 SMs where 65 of four warps left half of them
// idle. The same lane chains, so the same logits, ids and plan.
MMF_ROUTE_KERNEL(mm_f32_multi_route_rd1, 32, route_one_warp_r, 1)

// mm_f32_multi_route_rd with the layer's post-mixer norm in its prologue
// (`NORM_ROUTER`, decode): every block adds the mixer's output row `inc` to
// the residual row `acc` and takes the RMSNorm of the sum into shared
// memory with add_rms_norm_q8k's arithmetic (norm_row: its thread u of 256
// holds elements u + 256 j, j < 8, and sums their squares in f64 in j order;
// thread t here is its threads t and t + 128, whose sums are the tree's
// first level; then the tree's other levels, norm_tree_from), and runs the
// router's rows from there. The last block, once every block has read the
// residual, stores the sum into `acc`, the normed row into `xout` and its
// Q8_K blocks into `qout` (q8k_block, as quantize_own_row), then routes.
// The same bytes as add_rms_norm_q8k then mm_f32_multi_route_rd. cols: a
// multiple of 256, at most 2,048.
#define RN_MAX 2048
extern "C" __global__ void __launch_bounds__(WARPS * 32)
    mm_f32_multi_route_norm(MmJobs jobs, int row_bytes, float* acc, const float* inc, const float* nw, float* xout,
                            u8* qout, float eps, int cols, int* ids, float* wts, int e, int k, int pad,
                            int* placed_row, int* placed_mat, int* slot, int cap, int* counter) {
    pdl_wait();
    __shared__ __align__(16) float xs[RN_MAX];
    __shared__ __align__(16) float vs[RN_MAX];
    __shared__ double part[WARPS * 32];
    static_assert(WARPS * 32 * 2 == NORM_THREADS, "two of norm_row's threads a thread");
    int t = threadIdx.x;
    double s2[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int u = t + 128 * h;
        float v[8], iv[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = u + 256 * j;
            v[j] = i < cols ? acc[i] : 0.0f;
            iv[j] = i < cols ? inc[i] : 0.0f;
        }
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = u + 256 * j;
            if (i < cols) {
                v[j] = v[j] + iv[j];
                vs[i] = v[j];
                s += (double)v[j] * (double)v[j];
            }
        }
        s2[h] = s;
    }
    part[t] = s2[0] + s2[1];  // norm_tree's level 128
    float mean = (float)(norm_tree_from(part, t, 64) / (double)cols);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = t; i < cols; i += 128) xs[i] = (vs[i] * scale) * nw[i];
    __syncthreads();
    int c0 = (jobs.rows[0] + WARPS - 1) / WARPS;
    int bx = blockIdx.x, j = 0;
    if (jobs.nj > 1 && bx >= c0) bx -= c0, j = 1;
    const u8* w = j == 0 ? jobs.w[0] : jobs.w[1];
    float* y = j == 0 ? jobs.y[0] : jobs.y[1];
    int rows = j == 0 ? jobs.rows[0] : jobs.rows[1];
    mm_float<0, 32>(w, 0, row_bytes, nullptr, xs, y, rows, 1, cols, bx);
    __shared__ int last;
    __threadfence();  // this thread's stores reach L2 before the count
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)(gridDim.x * gridDim.y) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Every block has read `acc` (each counted itself after its prologue).
    for (int i = t; i < cols; i += 128) {
        acc[i] = vs[i];
        xout[i] = xs[i];
    }
    int warp = t / 32, lane = t % 32;
    for (int b = warp; b < cols / 256; b += WARPS) q8k_block(xs + b * 256, qout + (i64)b * Q8K_BYTES, lane);
    if (t >= 32) return;
    if (t == 0) *counter = 0;
    route_one_warp_r(jobs.y[0], ids, wts, e, k, pad, placed_row, placed_mat, slot, cap, t);
}

// Float weights against many f32 rows of one matrix (the routers and gates
// in prefill): a warp computes a tile of MFT_W weight rows x MFT_R
// activation rows, every lane holding its chain for each of the tile's
// outputs, so a loaded weight serves MFT_R rows and an activation MFT_W
// rows. Each output's arithmetic is mm_float's: lane l's fmas over elements
// l, l + 32, ... in order (none past the row's end), then the same
// butterfly; only the loads are shared. 16 activation rows a warp (8 before
// session 11): each launch reads the weights from L2 once per 16 rows of
// activations instead of per 8 (a 2,048-row prefill chunk against a 256-row
// router read ~768 MB from L2 at 4 x 8, ~512 MB at 4 x 16); 168 registers.
#define MFT_W 4
#define MFT_R 16

template <int KIND>
__device__ void mm_float_tile(const u8* W, int row_bytes, const float* X, float* Y, int rows, int m,
                              int cols) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j0 = (blockIdx.x * WARPS + warp) * MFT_W;
    int r0 = blockIdx.y * MFT_R;
    if (j0 >= rows || r0 >= m) return;
    const u8* wp[MFT_W];
    const float* xp[MFT_R];
#pragma unroll
    for (int c = 0; c < MFT_W; c++) wp[c] = W + (i64)min(j0 + c, rows - 1) * row_bytes;
#pragma unroll
    for (int t = 0; t < MFT_R; t++) xp[t] = X + (i64)min(r0 + t, m - 1) * cols;
    float acc[MFT_W][MFT_R];
#pragma unroll
    for (int c = 0; c < MFT_W; c++)
#pragma unroll
        for (int t = 0; t < MFT_R; t++) acc[c][t] = 0.0f;
    // Two steps' loads in flight: step i + 64's issued before step i's fmas.
    float wv[2][MFT_W], xv[2][MFT_R];
#pragma unroll
    for (int u = 0; u < 2; u++) {
        int i = lane + 32 * u;
#pragma unroll
        for (int c = 0; c < MFT_W; c++) wv[u][c] = i < cols ? ld_w<KIND>(wp[c], i) : 0.0f;
#pragma unroll
        for (int t = 0; t < MFT_R; t++) xv[u][t] = i < cols ? xp[t][i] : 0.0f;
    }
    for (int i0 = lane; i0 < cols; i0 += 64) {
        float wn[2][MFT_W], xn[2][MFT_R];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int i = i0 + 64 + 32 * u;
#pragma unroll
            for (int c = 0; c < MFT_W; c++) wn[u][c] = i < cols ? ld_w<KIND>(wp[c], i) : 0.0f;
#pragma unroll
            for (int t = 0; t < MFT_R; t++) xn[u][t] = i < cols ? xp[t][i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (i0 + 32 * u < cols)
#pragma unroll
                for (int c = 0; c < MFT_W; c++)
#pragma unroll
                    for (int t = 0; t < MFT_R; t++) acc[c][t] = __fmaf_rn(wv[u][c], xv[u][t], acc[c][t]);
#pragma unroll
        for (int u = 0; u < 2; u++) {
#pragma unroll
            for (int c = 0; c < MFT_W; c++) wv[u][c] = wn[u][c];
#pragma unroll
            for (int t = 0; t < MFT_R; t++) xv[u][t] = xn[u][t];
        }
    }
#pragma unroll
    for (int c = 0; c < MFT_W; c++)
#pragma unroll
        for (int t = 0; t < MFT_R; t++) {
            float a = acc[c][t];
            for (int o = 16; o > 0; o /= 2) a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, o));
            if (lane == 0 && j0 + c < rows && r0 + t < m) Y[(i64)(r0 + t) * rows + j0 + c] = a;
        }
}

#define MFT_KERNEL(name, KIND)                                                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                   \
        name(const u8* W, int row_bytes, const float* X, float* Y, int rows, int m, int cols) { \
        pdl_wait();                                                                            \
        mm_float_tile<KIND>(W, row_bytes, X, Y, rows, m, cols);                                \
    }

MFT_KERNEL(mm_f32_tile, 0)
MFT_KERNEL(mm_f16_tile, 1)
MFT_KERNEL(mm_bf16_tile, 2)

// Float matrices of at most MFF_ROWS rows (a shared expert's one-row input
// gate) against many rows: a warp an activation row, holding every weight
// row's chain, so the activations are read once and every warp of the grid
// has work (the per-row kernel gives a one-row matrix one warp a block, and
// the tile kernels compute 16 or 32 weight rows for it). Each output's
// arithmetic is mm_float's: lane l's fmas over elements l, l + 32, ... in
// order, MFF_U elements' loads issued before their fmas, then the
// butterfly.
#define MFF_ROWS 8
#define MFF_U 8

extern "C" __global__ void __launch_bounds__(128)
    mm_f32_few(const u8* W, int row_bytes, const float* X, float* Y, int rows, int m, int cols) {
    pdl_wait();
    const int lane = threadIdx.x % 32, t = blockIdx.x * 4 + threadIdx.x / 32;
    if (t >= m) return;
    const float* x = X + (i64)t * cols;
    float acc[MFF_ROWS];
#pragma unroll
    for (int c = 0; c < MFF_ROWS; c++) acc[c] = 0.0f;
    for (int i0 = lane; i0 < cols; i0 += 32 * MFF_U) {
        float xv[MFF_U];
#pragma unroll
        for (int u = 0; u < MFF_U; u++) {
            int i = i0 + 32 * u;
            xv[u] = i < cols ? x[i] : 0.0f;
        }
#pragma unroll
        for (int c = 0; c < MFF_ROWS; c++) {
            if (c < rows) {
                const float* w = (const float*)(W + (i64)c * row_bytes);
                float wv[MFF_U];
#pragma unroll
                for (int u = 0; u < MFF_U; u++) {
                    int i = i0 + 32 * u;
                    wv[u] = i < cols ? w[i] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < MFF_U; u++)
                    if (i0 + 32 * u < cols) acc[c] = __fmaf_rn(wv[u], xv[u], acc[c]);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < MFF_ROWS; c++) {
        if (c < rows) {
            float a = acc[c];
            for (int o = 16; o > 0; o /= 2) a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, o));
            if (lane == 0) Y[(i64)t * rows + c] = a;
        }
    }
}

// The f32 tile kernel with twice the weight rows a warp (MFW_J = 8 x MFW_R =
// 16 outputs: 24 operand loads per 128 fmas, against 20 per 64 at 4 x 16),
// the operands staged in shared memory by cp.async (two stages of MFW_KC
// columns: the weight rows of the block's 4 warps and its 16 activation
// rows) so no registers hold loads in flight, and the 128 butterflies done
// as one reduce-scatter: at the step with lane mask o, a lane keeps the half
// of its outputs picked by its lane bit o and adds its partner's partial of
// that half (the butterfly's pair sum of the same two values; fadd is
// commutative), so after the five steps each lane holds 4 finished outputs
// (4 * lane + 0..3) and no sum is done twice. Every output's
// arithmetic is mm_float's: lane l's fmas over elements l, l + 32, ... in
// order (none past the row's end), then the xor-16, 8, 4, 2, 1 pair sums.
// Needs cols % 4 == 0 (16-byte pieces). Dynamic shared memory: MFW_SMEM.
#define MFW_J 8
#define MFW_R 16
#define MFW_KC 128
#define MFW_STAGE ((4 * MFW_J + MFW_R) * MFW_KC * 4)
#define MFW_SMEM (2 * MFW_STAGE)

template <int N, int O>
__device__ __forceinline__ void fold_half(float (&v)[MFW_J * MFW_R], int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int k = 0; k < N / 2; k++) {
        float keep = up ? v[N / 2 + k] : v[k];
        float send = up ? v[k] : v[N / 2 + k];
        v[k] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, O));
    }
}

// Three blocks an SM: 168 registers at most (NVRTC, session 21: 164-168,
// no spills).
extern "C" __global__ void __launch_bounds__(128, 3)
    mm_f32_tile_w8(const u8* W, int row_bytes, const float* X, float* Y, int rows, int m, int cols) {
    pdl_wait();
    extern __shared__ __align__(16) u8 dsm[];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int jb = blockIdx.x * 4 * MFW_J, r0 = blockIdx.y * MFW_R;
    if (jb >= rows || r0 >= m) return;
    const int nk = (cols + MFW_KC - 1) / MFW_KC;
    constexpr int PR = MFW_KC / 4;  // 16-byte pieces a staged row
    // A thread copies piece pq = tid % PR of staged rows pr + 4i (pr = tid
    // / PR): its sources are a base and a stride worked out once, here, not
    // a division, a clamp and a product a piece at every step (ncu, session
    // 21: that arithmetic was ~30% of the kernel's instructions).
    static_assert(128 / PR == 4 && (4 * MFW_J) % 4 == 0 && MFW_R % 4 == 0, "four staged rows a pass");
    // Rows past the matrix's end copy nothing (zeros; their outputs are
    // not stored), as does a piece past the row's end. `full`: the block's
    // rows all exist (every block but the last activation tile's, for the
    // routers), so its copies check nothing but the row's end.
    const int pq = tid % PR, pr = tid / PR;
    const u8* wb = W + (i64)(jb + pr) * row_bytes + 16 * pq;
    const float* xb = X + (i64)(r0 + pr) * cols + 4 * pq;
    const i64 wstep = 4 * (i64)row_bytes, xstep = 4 * (i64)cols;
    const bool full = jb + 4 * MFW_J <= rows && r0 + MFW_R <= m;
    auto issue = [&](u8* st, int kc) {
        const int c0 = kc * MFW_KC;
        const bool ok = c0 + 4 * pq < cols;
        // The piece's offset from wb and xb, or the row's start past its end.
        const int cw = ok ? 4 * c0 : -16 * pq, cx = ok ? c0 : -4 * pq;
        u8* d = st + (pr * MFW_KC + 4 * pq) * 4;
        u8* dx = d + 4 * MFW_J * MFW_KC * 4;
        if (full) {
#pragma unroll
            for (int i = 0; i < MFW_J; i++) cp_async16(d + 4 * i * MFW_KC * 4, wb + i * wstep + cw, ok);
#pragma unroll
            for (int i = 0; i < MFW_R / 4; i++) cp_async16(dx + 4 * i * MFW_KC * 4, xb + i * xstep + cx, ok);
        } else {
#pragma unroll
            for (int i = 0; i < MFW_J; i++) {
                const bool v = ok && jb + pr + 4 * i < rows;
                cp_async16(d + 4 * i * MFW_KC * 4, v ? wb + i * wstep + cw : W, v);
            }
#pragma unroll
            for (int i = 0; i < MFW_R / 4; i++) {
                const bool v = ok && r0 + pr + 4 * i < m;
                cp_async16(dx + 4 * i * MFW_KC * 4, v ? (const void*)(xb + i * xstep + cx) : (const void*)X, v);
            }
        }
    };
    float v[MFW_J * MFW_R];  // output (c, t) at c * MFW_R + t
#pragma unroll
    for (int k = 0; k < MFW_J * MFW_R; k++) v[k] = 0.0f;
    issue(dsm, 0);
    cp_async_commit();
    for (int kc = 0; kc < nk; kc++) {
        const u8* st = dsm + (kc & 1) * MFW_STAGE;
        if (kc + 1 < nk) {
            issue(dsm + ((kc + 1) & 1) * MFW_STAGE, kc + 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const float* ws = (const float*)st + warp * MFW_J * MFW_KC + lane;
        const float* xs = (const float*)st + 4 * MFW_J * MFW_KC + lane;
        const int left = cols - kc * MFW_KC - lane;  // this lane's elements left in the row
#pragma unroll
        for (int s = 0; s < MFW_KC / 32; s++) {
            if (32 * s < left) {
                float w[MFW_J], x[MFW_R];
#pragma unroll
                for (int c = 0; c < MFW_J; c++) w[c] = ws[c * MFW_KC + 32 * s];
#pragma unroll
                for (int t = 0; t < MFW_R; t++) x[t] = xs[t * MFW_KC + 32 * s];
#pragma unroll
                for (int c = 0; c < MFW_J; c++)
#pragma unroll
                    for (int t = 0; t < MFW_R; t++) v[c * MFW_R + t] = __fmaf_rn(w[c], x[t], v[c * MFW_R + t]);
            }
        }
        // Stage kc & 1 is refilled by the next iteration's copies.
        __syncthreads();
    }
    fold_half<128, 16>(v, lane);
    fold_half<64, 8>(v, lane);
    fold_half<32, 4>(v, lane);
    fold_half<16, 2>(v, lane);
    fold_half<8, 1>(v, lane);
    // Lane bit o picked the upper half at the step of mask o: a lane's
    // outputs start at 64 b4 + 32 b3 + 16 b2 + 8 b1 + 4 b0 (= 4 * lane).
    const int base = ((lane & 16) ? 64 : 0) + ((lane & 8) ? 32 : 0) + ((lane & 4) ? 16 : 0) + ((lane & 2) ? 8 : 0) +
                     ((lane & 1) ? 4 : 0);
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int k = base + r, c = k / MFW_R, t = k % MFW_R;
        int j = jb + warp * MFW_J + c;
        if (j < rows && r0 + t < m) Y[(i64)(r0 + t) * rows + j] = v[r];
    }
}
