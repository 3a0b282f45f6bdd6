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

