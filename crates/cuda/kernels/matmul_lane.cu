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

// One block of 32 rows against one activation row. Per chunk of up to
// LANE_CH blocks of K: each lane loads its rows' block first (both matrices
// of a GLU; with `early`, the first chunk's before pdl_wait, as the weights
// never change and their addresses need nothing a previous kernel writes),
// the block's threads copy the chunk's activation blocks into shared memory
// beside those loads, and only then does any arithmetic wait on memory.
// Integer terms per (row, block) are exact, so where they are computed does
// not change them; warp 0's float steps run in block order, as mm_row's.
// QIN: A holds f32 rows (nb * 256 wide), and the block quantizes the
// chunk's blocks of its row into shared memory itself (q8k_block,
// quantize_q8k's code, a warp a block): the bytes a quantize_q8k launch
// would have written, with no launch.
// RB: rows a block (32, or 16 with lanes 16-31 idle: twice the blocks for
// a matrix of few rows, each row's arithmetic unchanged).
template <int NW, bool QIN = false, int RB = 32>
__device__ void mm_lane(const u8* W, const u8* W2, i64 mat_stride, int row_bytes, const int* mats,
                        const u8* A, float* Y, int rows, int m, int nb, int jb, const int* amap, bool early) {
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
        if constexpr (QIN) {
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
}

// The lane-row forms of the one-row kernels (mm_*_1, _glu_1, _multi_1,
// _moe_1 and _moe_glu_1): the same arguments, a block per 32 rows (grid x),
// blockIdx.y the input row, 32 x min(16, nb) threads. The one-matrix kernels are held to 80 registers
// (three blocks of eight warps an SM); pdl_wait is in mm_lane.
extern "C" __global__ void __maxnreg__(80)
    mm_q4_k_lane_1(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, int rows,
                   int m, int nb) {
    mm_lane<1>(W, nullptr, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x, nullptr, mats == nullptr);
}

// mm_q4_k_lane_1 with 16 rows a block (a matrix of few rows, e.g. decode's
// output projections, 2,048 rows in 64 blocks of 32, on twice the SMs:
// 6.54 -> 5.67 us a launch on an H200, qwen35moe tg128 +0.65%). The same
// per-row arithmetic.
extern "C" __global__ void __maxnreg__(80)
    mm_q4_k_lane16_1(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, int rows,
                     int m, int nb) {
    mm_lane<1, false, 16>(W, nullptr, mat_stride, row_bytes, mats, A, Y, rows, m, nb, blockIdx.x, nullptr,
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

// Expert ids and input rows come from the routing kernel: no loads before
// the wait.
template <int NW, bool QIN = false>
__device__ __forceinline__ void mm_lane_moe(const MoeJobs& jobs, int row_bytes, int nb) {
    int c0 = (jobs.rows[0] + 31) / 32, bx = blockIdx.x, j = 0;
    if (bx >= c0) bx -= c0, j = 1;
    mm_lane<NW, QIN>(j ? jobs.wg[1] : jobs.wg[0], j ? jobs.wu[1] : jobs.wu[0], j ? jobs.stride[1] : jobs.stride[0],
                row_bytes, j ? jobs.mats[1] : jobs.mats[0], j ? jobs.a[1] : jobs.a[0], j ? jobs.y[1] : jobs.y[0],
                j ? jobs.rows[1] : jobs.rows[0], j ? jobs.m[1] : jobs.m[0], nb, bx,
                j ? jobs.amap[1] : jobs.amap[0], false);
}

// Decode's routed down projections on lane rows: the f32 GLU outputs
// quantized by each block as quantize_q8k would (no quantize launch of
// their own).
extern "C" __global__ void __maxnreg__(80) mm_q4_k_lane_moe_qin_1(MoeJobs jobs, int row_bytes, int nb) {
    mm_lane_moe<1, true>(jobs, row_bytes, nb);
}

extern "C" __global__ void __launch_bounds__(LANE_THREADS, 1) mm_q4_k_lane_moe_glu_1(MoeJobs jobs, int row_bytes, int nb) {
    mm_lane_moe<2>(jobs, row_bytes, nb);
}

MM_KERNEL(mm_q4_k, FmtQ4K, 1)
MM_KERNEL(mm_q5_k, FmtQ5K, 1)
MM_KERNEL(mm_q6_k, FmtQ6K, 1)
MM_KERNEL(mm_q8_0, FmtQ8_0, 1)

