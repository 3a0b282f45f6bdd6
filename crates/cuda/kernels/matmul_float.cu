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
// WB: the warps (weight rows) a block. RT: the activation rows a block row
// (blockIdx.y), each warp's rows one after the other.
template <int KIND, int U = MMF_U, int WB = WARPS, int RT = MT>
__device__ void mm_float(const u8* W, i64 mat_stride, int row_bytes, const int* mats,
                         const float* X, float* Y, int rows, int m, int cols, int jb) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int j = jb * WB + warp;
    int r0 = blockIdx.y * RT;
    if (j >= rows || r0 >= m) return;
    int nr = min(RT, m - r0);
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
            // elements l, l + 32, ... in order, whatever U.
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

// The same with a block row per activation row (calls of up to 16 rows): a
// warp's rows one after the other are a chain of its rows' load latencies
// (an 8-row router call took ~20 us against ~3 us for one row), so each row
// gets its own warps; every output's arithmetic is mm_float's.
#define MMF_KERNEL1(name, KIND)                                                                \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                   \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const float* X, float* Y, \
             int rows, int m, int cols) { pdl_wait();                                          \
        mm_float<KIND, MMF_U, WARPS, 1>(W, mat_stride, row_bytes, mats, X, Y, rows, m, cols, blockIdx.x); \
    }

MMF_KERNEL1(mm_f32_1, 0)
MMF_KERNEL1(mm_f16_1, 1)
MMF_KERNEL1(mm_bf16_1, 2)

// Two f32 matrices of one row width against the same rows in one launch (a
// decode MoE's router and its shared expert's input gate): job 0's blocks
// first, a block row per activation row (blockIdx.y), each block computing
// its job's rows as mm_f32_1 does.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
    mm_f32_multi(MmJobs jobs, int row_bytes, const float* X, int m, int cols) {
    pdl_wait();
    int c0 = (jobs.rows[0] + WARPS - 1) / WARPS;
    int bx = blockIdx.x, j = 0;
    if (jobs.nj > 1 && bx >= c0) bx -= c0, j = 1;
    const u8* w = j == 0 ? jobs.w[0] : jobs.w[1];
    float* y = j == 0 ? jobs.y[0] : jobs.y[1];
    int rows = j == 0 ? jobs.rows[0] : jobs.rows[1];
    mm_float<0, MMF_U, WARPS, 1>(w, 0, row_bytes, nullptr, X, y, rows, m, cols, bx);
}

// mm_f32_multi for one row whose launch also routes and plans it: each
// block, once its outputs are stored, fences them and counts itself in
// `counter`; the last block's first warp resets the counter (for the next
// launch, graph replays included) and routes job 0's outputs (the router
// logits) with the row in registers (route_one_warp_r), so a decode MoE
// layer needs no routing launch. U = 32 elements a lane a step: a
// 2,048-wide row's 64 loads a lane all issued before its first fma. The
// same logits, ids, weights and plan as mm_f32_multi then a routing launch.
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

MMF_ROUTE_KERNEL(mm_f32_multi_route_rd, 32, route_one_warp_r, WARPS)

// Float weights against many f32 rows of one matrix (the routers and gates
// in prefill): a warp computes a tile of MFT_W weight rows x MFT_R
// activation rows, every lane holding its chain for each of the tile's
// outputs, so a loaded weight serves MFT_R rows and an activation MFT_W
// rows. Each output's arithmetic is mm_float's: lane l's fmas over elements
// l, l + 32, ... in order (none past the row's end), then the same
// butterfly; only the loads are shared. 16 activation rows a warp: each
// launch reads the weights from L2 once per 16 rows of activations instead
// of per 8 (a 2,048-row prefill chunk against a 256-row router read ~768 MB
// from L2 at 4 x 8, ~512 MB at 4 x 16); 168 registers.
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

// Three blocks an SM: 168 registers at most (NVRTC: 164-168, no spills).
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
    // a division, a clamp and a product a piece at every step (under ncu
    // that arithmetic was ~30% of the kernel's instructions).
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
