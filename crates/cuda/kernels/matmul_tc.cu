// ---------------------------------------------------------------- tensor cores
//
// Wide Q4_K / Q5_K calls on int8 mma.sync (m16n8k32, s32 accumulators; the
// other formats' tiles follow, each with its own staging): a
// block computes 128 weight rows (32 per warp: two m16 tiles) against 16
// activation rows (two n8 tiles) staged in shared memory per weight block.
// Each mma computes one sub-block's exact dots; the scale products, the sums
// over sub-blocks and the float step are those of the order above, so the
// bytes equal the dp4a kernels'. A tile whose rows use several matrices
// (experts) is computed once per matrix, storing that matrix's rows; the
// expert plan pads each expert's rows to a multiple of the tile's rows so
// that is rare.

#define TQ_ROWS 16
#define TQ_WROWS 128

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

// ---------------------------------------------------------------- tensor cores, async copies
//
// The weight and activation blocks brought into shared memory by cp.async
// (two stages: block b + 1 is in flight while block b computes) instead of
// held in registers, so more blocks fit on a multiprocessor (a register
// double buffer held 112 of 237 registers: 2 blocks of 4 warps per SM; this
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
template <int Q5, int R>
struct TaSrc {
    static constexpr int WPC = TaLayout<Q5, R>::BYTES / 16;
    static constexpr int PIECES = TQ_WROWS * WPC;
    static constexpr int WP = PIECES / 128;
    static_assert(PIECES % 128 == 0, "whole weight pieces a thread");
    u32 w[WP];
    __device__ __forceinline__ TaSrc(int row_bytes, int wrow0, int rows, int tid) {
#pragma unroll
        for (int i = 0; i < WP; i++) {
            int c = tid + 128 * i;
            int r = c / WPC, q = c - r * WPC;
            w[i] = (u32)((min(wrow0 + r, rows - 1) - wrow0) * row_bytes + 16 * q);
        }
    }
    // The pieces' offsets for one block's copies.
    __device__ __forceinline__ void offsets(u32 (&o)[WP]) const {
#pragma unroll
        for (int i = 0; i < WP; i++) o[i] = w[i];
    }
};

// Weight block b of the tile whose first row is at `wt`, and activation
// block b of its R rows from `at` (`arow` bytes apart; rows from `nr` on are
// zero-filled): warp w copies activation rows w, w + 4, ..., lane l < 19
// piece l of each, one row's 304 consecutive bytes an instruction at offsets
// that step by a constant. The same bytes in the same places as ta_issue.
template <int Q5, int R>
__device__ __forceinline__ void ta_issue_kept(u8* stage, const u8* wt, const u8* at, const TaSrc<Q5, R>& src,
                                              u32 arow, int nr, int b, int tid) {
    typedef TaLayout<Q5, R> L;
    typedef TaSrc<Q5, R> S;
    constexpr int NWARP = 4;
    static_assert(R % NWARP == 0, "activation rows a warp");
    const u8* wb = wt + (i64)b * L::BYTES;
    u32 off[S::WP];
    src.offsets(off);
#pragma unroll
    for (int i = 0; i < S::WP; i++) {
        int c = tid + 128 * i, r = c / S::WPC, q = c - r * S::WPC;
        cp_async16(stage + L::W_OFF + r * L::WST + q * 16, wb + off[i], true);
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
// but with GS: the groups past the matrix's last row, which in expert calls
// are the plan's padding, are skipped; every stored output's integer sums
// and float steps are as they were).
template <int Q5, int R, bool MS, int NG, class S>
__device__ __forceinline__ void tc_async_matrix(u8* dsm, const S& js, i64 mat_stride, int row_bytes, int cur,
                                                int wrow0, const u8* A, i64 arow, int r0, int nr, int nb,
                                                const TaSrc<Q5, R>& src, const u8* at, u32 live, int tid,
                                                int warp, int gq, int tq) {
    typedef TaLayout<Q5, R> L;
    constexpr bool KEPT = R >= 32;
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
            ta_issue_kept<Q5, R>(stage, wt, at, src, (u32)arow, nr, b, tid);
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
        // This thread's rows: wrow + 8 i WST (one base, constant offsets).
        const u8* wrow = st + L::W_OFF + (warp * 32 + gq) * L::WST;
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
        const u8* sqb = st + L::A_OFF;
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
        // Stage b & 1 is refilled by the next iteration's copies (block
        // b + 2): every read of it ends here.
        __syncthreads();
    }
    // The output base through an opaque copy: otherwise the compiler
    // works the 32 store addresses out before the K loop and keeps them
    // in local memory.
    const int rows = js.rows();
    float* yo = js.y() + (i64)r0 * rows + wrow0 + warp * 32 + gq;
    asm volatile("" : "+l"(yo));
    int wbase = wrow0 + warp * 32;
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int n = 0; n < NG; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                if (wbase + 8 * i + gq < rows && ((live >> t) & 1u)) yo[(i64)t * rows + 8 * i] = acc[a][n][c];
            }
}

// `bx`: the tile's column of 128 weight rows (blockIdx.x, or its place in
// its own matrix in a launch of several, `mm_tc_q4_k_async32g_jobs`).
// ZERO: rows with no matrix (id -1) get zeros; without it (the `_live`
// kernels) they are left as they were, for callers that read no such row,
// and a tile of none but them does nothing.
template <int Q5, int R, bool MS = false, bool GS = false, bool ZERO = true, class S = TcArgs>
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
    // reduction instead of loops over shared memory (under ncu those loops
    // and the per-element checks of the stores took ~23% of the kernel's
    // stall samples, its K loop being 2 to 8 blocks).
    static_assert(R <= 32, "a lane a tile row");
    const int vmat = lane < R ? smat[lane] : -1;
    const int col = wrow0 + tid;  // the first TQ_WROWS threads: a thread a weight row
    // Rows of the tile with no matrix get zeros, as in the dp4a kernels.
    for (u32 zero = ZERO ? __ballot_sync(0xffffffffu, lane < nr && vmat < 0) : 0u; zero; zero &= zero - 1) {
        int t = __ffs(zero) - 1;
        if (col < js.rows()) js.y()[(i64)(r0 + t) * js.rows() + col] = 0.0f;
    }
    // The 32-row kernels' copy offsets (unused, so not computed, in the others).
    const TaSrc<Q5, R> src(row_bytes, wrow0, js.rows(), tid);
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
#define TC_MATRIX(G)                                                                                    \
    tc_async_matrix<Q5, R, MS, G>(dsm, js, mat_stride, row_bytes, cur, wrow0, A, arow, r0, nr, nb, src, at, live, \
                                  tid, warp, gq, tq)
        if constexpr (GS && N == 4) {
            if (ng == 1) TC_MATRIX(1);
            else if (ng == 2) TC_MATRIX(2);
            else if (ng == 3) TC_MATRIX(3);
            else TC_MATRIX(4);
        } else if constexpr (GS && N == 2) {
            if (ng == 1) TC_MATRIX(1);
            else TC_MATRIX(2);
        } else {
            TC_MATRIX(N);
        }
#undef TC_MATRIX
    }
}

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
// a 2-block form at 0.77 eligible warps of 1.96 a scheduler, waiting on its
// own dependent steps); Q5_K, whose spills at 168 would be larger, 2.
// MS: the mins sums on tensor cores, GS: each matrix's groups of rows past
// its last row skipped (see mm_tc_async_k; Q5_K's, at 2 blocks an SM, would
// spill). H200, qwen35moe pp4096, the Q4_K kernel skipping the groups:
// 111.2 -> 107.9 ms.
#define TC_ASYNC32_KERNEL(name, Q5, BLOCKS, MS, GS)                                             \
    extern "C" __global__ void __launch_bounds__(128, BLOCKS)                                  \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, \
             int rows, int m, int nb) { pdl_wait();                                            \
        mm_tc_async_k<Q5, 32, MS, GS>(TcArgs{W, Y, rows}, mat_stride, row_bytes, mats, A, m, nb, blockIdx.x); \
    }

TC_ASYNC32_KERNEL(mm_tc_q5_k_async32, 1, 2, false, false)
TC_ASYNC32_KERNEL(mm_tc_q4_k_async32g, 0, 3, true, true)

// mm_tc_q4_k_async32g leaving rows with no matrix unwritten (a wide routed
// call's places past the last expert's rows and its padding, which nothing
// reads; a tile of places past the last expert's rows does nothing). Every
// row it writes is mm_tc_q4_k_async32g's.
extern "C" __global__ void __launch_bounds__(128, 3)
    mm_tc_q4_k_async32g_live(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y,
                             int rows, int m, int nb) {
    pdl_wait();
    mm_tc_async_k<0, 32, true, true, false>(TcArgs{W, Y, rows}, mat_stride, row_bytes, mats, A, m, nb, blockIdx.x);
}

// mm_tc_q4_k_async32g for up to 4 matrices of one width against the same
// activation rows (and, for expert stacks, the same matrix ids and stride)
// in one launch: blockIdx.x runs over job 0's columns of 128 weight rows,
// then job 1's, ..., and each block computes its tile of its job's matrix
// as the one-matrix launch would (the same code, so the same bytes). A
// matrix of few rows (a delta net's beta and alpha) then runs beside the
// others instead of as a launch of a few blocks (H200, qwen35moe pp4096:
// the Q4_K matmuls 74.0 -> 66.9 ms). ZERO as in mm_tc_async_k. A macro, as
// the kernels above, so that each kernel's job sits in its own shared
// memory.
#define TC_JOBS_KERNEL(name, ZERO)                                                                  \
    extern "C" __global__ void __launch_bounds__(128, 3)                                           \
        name(MmJobs jobs, i64 mat_stride, int row_bytes, const int* mats, const u8* A, int m, int nb) { \
        pdl_wait();                                                                                 \
        const MmJob j = mm_job(jobs, TQ_WROWS);                                                     \
        /* The job in shared memory, read back at each use. */                                      \
        __shared__ TcJob job;                                                                       \
        if (threadIdx.x == 0) job = TcJob{j.w, j.y, j.rows};                                        \
        __syncthreads();                                                                            \
        mm_tc_async_k<0, 32, true, true, ZERO, TcJobRef>(TcJobRef{&job}, mat_stride, row_bytes, mats, A, m, nb, \
                                                         j.bx);                                     \
    }

TC_JOBS_KERNEL(mm_tc_q4_k_async32g_jobs, true)
// mm_tc_q4_k_async32g_jobs leaving rows with no matrix unwritten (as
// mm_tc_q4_k_async32g_live).
TC_JOBS_KERNEL(mm_tc_q4_k_async32g_jobs_live, false)

// ---------------------------------------------------------------- tensor cores, Q6_K
//
// Wide Q6_K calls on int8 mma.sync m16n8k16: a Q6_K group (16 values, one
// signed 8-bit scale) is one k16 product of the values minus 32 (signed
// bytes, as FmtQ6K unpacks them) and the activations; its exact dot times
// the group's scale goes into the block's integer sum, and the block's float
// step is step_plain: FmtQ6K's integer and float step, so the bytes of the
// dp4a kernels (decode takes FmtQ6K8, whose parts sum to the same integer).
// A block computes 128 weight rows (32 a warp: two m16 tiles) against R
// activation rows (R / 8 n8 tiles), two stages of cp.async copies as above.
//
// A 210-byte block starts 2-byte aligned, so each row's block is copied as
// the T6_PIECES (or fewer) aligned 16-byte pieces that hold it, and every
// word of the block is read back as two aligned words funnel-shifted by the
// block's offset in its first piece. The copy may read up to 15 bytes before
// a block and after it (inside the tensor, the file before it, or the slack
// the device copy of the weights is allocated with).

#define T6_PIECES 14
#define T6_WST 240  // a row's stride: a warp's 8 rows x 4 words fall in distinct banks

template <int R>
struct T6Layout {
    static constexpr int A_OFF = TQ_WROWS * T6_WST;
    static constexpr int STAGE = A_OFF + R * TA_AST;
};

// Issue the copies of weight block b of the tile's 128 rows (row r's block
// from `wrow0[r]`, already clamped to the matrix) and activation block b of
// its R rows (rows from `nr` on zero-filled) into `stage`.
template <int R>
__device__ __forceinline__ void t6_issue(u8* stage, const u8* wt, int row_bytes, int wrow0, int rows, const u8* at,
                                         i64 arow, int nr, int b, int tid) {
    for (int c = tid; c < TQ_WROWS * T6_PIECES; c += 128) {
        int r = c / T6_PIECES, q = c - r * T6_PIECES;
        int j = min(wrow0 + r, rows - 1) - wrow0;
        unsigned long long sa = (unsigned long long)(wt + (i64)j * row_bytes + (i64)b * 210);
        // The 16-byte pieces holding bytes [sa, sa + 210).
        if (q < (int)(((sa & 15ull) + 210 + 15) / 16))
            cp_async16(stage + r * T6_WST + 16 * q, (const u8*)(sa & ~15ull) + 16 * q, true);
    }
    for (int c = tid; c < R * (Q8K_BYTES / 16); c += 128) {
        int t = c / (Q8K_BYTES / 16), q = c % (Q8K_BYTES / 16);
        bool ok = t < nr;
        const u8* src = at + (ok ? t * arow + (i64)b * Q8K_BYTES + q * 16 : 0);
        cp_async16(stage + T6Layout<R>::A_OFF + t * TA_AST + q * 16, src, ok);
    }
}

// One m16n8k16 int8 product into fresh int32 sums.
__device__ __forceinline__ void mma_s8_k16(int* c, u32 a0, u32 a1, u32 b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0), "r"(0), "r"(0), "r"(0));
}

// A tile thread's accumulators (two m16 tiles x N n8 tiles x 4): zeroed,
// and stored to the outputs of its rows that lie in the matrix and whose
// activation rows are the matrix's (`live`).
template <int N>
__device__ __forceinline__ void tc_zero(float (&acc)[2][N][4]) {
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int n = 0; n < N; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][n][c] = 0.0f;
}
template <int N>
__device__ __forceinline__ void tc_store(const float (&acc)[2][N][4], float* Y, int r0, int rows, int wrow0, int warp,
                                         int gq, int tq, u32 live) {
    float* yo = Y + (i64)r0 * rows + wrow0 + warp * 32 + gq;
    int wbase = wrow0 + warp * 32;
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int n = 0; n < N; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                if (wbase + 8 * i + gq < rows && ((live >> t) & 1u)) yo[(i64)t * rows + 8 * i] = acc[a][n][c];
            }
}

// One matrix `cur` of a tile over its rows `live` (as tc_async_matrix).
template <int R>
__device__ __forceinline__ void t6_matrix(u8* dsm, const u8* W, i64 mat_stride, int row_bytes, int cur, int wrow0,
                                          int rows, float* Y, const u8* at, i64 arow, int r0, int nr, int nb,
                                          u32 live, int tid, int warp, int gq, int tq) {
    typedef T6Layout<R> L;
    constexpr int N = R / 8;
    float acc[2][N][4];
    tc_zero<N>(acc);
    const u8* wt = W + (i64)cur * mat_stride + (i64)wrow0 * row_bytes;
    // This thread's rows' offsets in their first 16-byte pieces at block 0
    // (a block moves it by 210 bytes).
    u32 sh0[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int j = min(wrow0 + warp * 32 + gq + 8 * i, rows - 1) - wrow0;
        sh0[i] = (u32)((unsigned long long)(wt + (i64)j * row_bytes) & 15ull);
    }
    t6_issue<R>(dsm, wt, row_bytes, wrow0, rows, at, arow, nr, 0, tid);
    cp_async_commit();
    for (int b = 0; b < nb; b++) {
        u8* st = dsm + (b & 1) * L::STAGE;
        if (b + 1 < nb) {
            t6_issue<R>(dsm + ((b + 1) & 1) * L::STAGE, wt, row_bytes, wrow0, rows, at, arow, nr, b + 1, tid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u8* wrow = st + (warp * 32 + gq) * T6_WST;
        const u8* sq = st + L::A_OFF;
        u32 sh[4];
#pragma unroll
        for (int i = 0; i < 4; i++) sh[i] = (sh0[i] + 210u * (u32)b) & 15u;
        int isum[2][N][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < N; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) isum[a][n][c] = 0;
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            // Half hf of the block (elements 128 hf ..): ql words at
            // 64 hf + 16 u + 4 tq, qh words at 128 + 32 hf + 16 u + 4 tq,
            // the scales of groups 8 hf .. 8 hf + 7.
            u32 ql[4][4], qh[4][2], sc[4][2];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u8* rw = wrow + 8 * i * T6_WST;
#pragma unroll
                for (int u = 0; u < 4; u++) ql[i][u] = tc_word(rw, sh[i] + 64 * hf + 16 * u + 4 * tq);
#pragma unroll
                for (int u = 0; u < 2; u++) qh[i][u] = tc_word(rw, sh[i] + 128 + 32 * hf + 16 * u + 4 * tq);
#pragma unroll
                for (int u = 0; u < 2; u++) sc[i][u] = tc_word(rw, sh[i] + 192 + 8 * hf + 4 * u);
            }
#pragma unroll
            for (int h = 0; h < 8; h++) {
                const int g = 8 * hf + h;
                u32 av[4];
#pragma unroll
                for (int i = 0; i < 4; i++)
                    av[i] = __vsub4(((ql[i][h % 4] >> (4 * (h / 4))) & 0x0F0F0F0Fu) |
                                        (((qh[i][h % 2] >> (2 * (h / 2))) & 0x03030303u) << 4),
                                    0x20202020u);
                u32 bq[N];
#pragma unroll
                for (int n = 0; n < N; n++) bq[n] = *(const u32*)(sq + (n * 8 + gq) * TA_AST + 16 * g + 4 * tq);
#pragma unroll
                for (int a = 0; a < 2; a++) {
                    const int sc0 = (int)(i8)(sc[2 * a][h / 4] >> (8 * (h % 4)));
                    const int sc1 = (int)(i8)(sc[2 * a + 1][h / 4] >> (8 * (h % 4)));
#pragma unroll
                    for (int n = 0; n < N; n++) {
                        int d[4];
                        mma_s8_k16(d, av[2 * a], av[2 * a + 1], bq[n]);
                        isum[a][n][0] += sc0 * d[0];
                        isum[a][n][1] += sc0 * d[1];
                        isum[a][n][2] += sc1 * d[2];
                        isum[a][n][3] += sc1 * d[3];
                    }
                }
            }
        }
        float dw[4];
#pragma unroll
        for (int i = 0; i < 4; i++) dw[i] = f16_to_f32((u16)(tc_word(wrow + 8 * i * T6_WST, sh[i] + 208) & 0xffffu));
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < N; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                    float da = *(const float*)(sq + t * TA_AST + Q8K_D);
                    acc[a][n][c] = step_plain(acc[a][n][c], dw[i], da, isum[a][n][c]);
                }
        // Stage b & 1 is refilled by the next iteration's copies.
        __syncthreads();
    }
    tc_store<N>(acc, Y, r0, rows, wrow0, warp, gq, tq, live);
}

// ---------------------------------------------------------------- tensor cores, 32-value blocks
//
// Wide calls of the formats with 32-value blocks and Q8_0 activations (Q8_0,
// and Q4_0, Q5_0, IQ4_NL, MXFP4, Q4_1, Q5_1 through Nib32) on int8
// mma.sync m16n8k32: a block is one k32 product of its values as signed
// bytes against the activations' Q8_0 block, and its float step is
// step_plain (Q4_1 and Q5_1: step_min, its min sum the activation block's
// quant sum, one more k32 product of ones against the same fragments): the
// row kernels' integer and float step (FmtQ8_0, FmtNib32), so their bytes.
// A stage holds T8_KB blocks of K. Blocks are 34, 18, 17, 22, 20 or 24
// bytes, so a row's start is only byte aligned: a stage of a row is copied
// as the aligned 16-byte pieces that hold it and fragments read back
// funnel-shifted (as Q6_K). Activation blocks (36 bytes: 32 quants, then d
// as f32) are word aligned.

#define T8_KB 8
#define T8_WST 336  // 84 words: a warp's 8 rows start in banks 0, 20, 8, 28, ...
#define T8_AST 304  // 76 words: 8 rows x 4 lanes' words in distinct banks

template <int R>
struct T8Layout {
    static constexpr int A_OFF = TQ_WROWS * T8_WST;
    static constexpr int STAGE = A_OFF + R * T8_AST;
};

// KIND 8: Q8_0; 0-5: Nib32<KIND>.
template <int KIND>
struct Blk32 {
    typedef Nib32<(KIND == 8 ? 0 : KIND)> N;
    static constexpr int BYTES = KIND == 8 ? 34 : N::BYTES;
    static constexpr bool MINS = KIND != 8 && N::MINS;
    // The values at k = 4 tq.. (lo) and 16 + 4 tq.. (hi) of the block at
    // byte o of a row in shared memory, as signed bytes; its scale.
    static __device__ __forceinline__ void values(const u8* row, u32 o, int tq, u32& lo, u32& hi) {
        if constexpr (KIND == 8) {
            lo = tc_word(row, o + 2 + 4 * tq);
            hi = tc_word(row, o + 18 + 4 * tq);
        } else {
            u32 w = tc_word(row, o + N::QS + 4 * tq);
            u32 qh = N::Q5 ? tc_word(row, o + N::QH) : 0u;
            lo = N::values(w, qh, tq, 0);
            hi = N::values(w, qh, tq, 1);
        }
    }
    // The block's scale and its step's dmin (Nib32's, from its first word).
    static __device__ __forceinline__ float scale(const u8* row, u32 o) {
        u32 w = tc_word(row, o);
        if constexpr (KIND == 8) return f16_to_f32((u16)(w & 0xffffu));
        return N::scale_of(w);
    }
    static __device__ __forceinline__ float dmin(const u8* row, u32 o) { return N::dmin_of(tc_word(row, o)); }
};

// Copies of blocks b0 .. b0 + kb - 1 of the tile's 128 weight rows and of
// its R activation rows (rows from `nr` on zero-filled) into `stage`.
template <int KIND, int R>
__device__ __forceinline__ void t8_issue(u8* stage, const u8* wt, int row_bytes, int wrow0, int rows, const u8* at,
                                         i64 arow, int nr, int b0, int kb, int tid) {
    constexpr int BY = Blk32<KIND>::BYTES;
    constexpr int PMAX = (15 + BY * T8_KB + 15) / 16;
    static_assert(PMAX * 16 <= T8_WST, "a row's pieces fit its stride");
    for (int c = tid; c < TQ_WROWS * PMAX; c += 128) {
        int r = c / PMAX, q = c - r * PMAX;
        int j = min(wrow0 + r, rows - 1) - wrow0;
        unsigned long long sa = (unsigned long long)(wt + (i64)j * row_bytes + (i64)b0 * BY);
        // The 16-byte pieces holding bytes [sa, sa + BY kb).
        if (q < (int)(((sa & 15ull) + BY * kb + 15) / 16))
            cp_async16(stage + r * T8_WST + 16 * q, (const u8*)(sa & ~15ull) + 16 * q, true);
    }
    for (int c = tid; c < R * 72; c += 128) {
        int t = c / 72, w = c - t * 72;
        if (w < 9 * kb) {
            u8* dst = stage + T8Layout<R>::A_OFF + t * T8_AST + 4 * w;
            if (t < nr)
                cp_async4(dst, at + t * arow + (i64)b0 * 36 + 4 * w);
            else
                *(u32*)dst = 0u;
        }
    }
}

template <int KIND, int R>
__device__ __forceinline__ void t8_matrix(u8* dsm, const u8* W, i64 mat_stride, int row_bytes, int cur, int wrow0,
                                          int rows, float* Y, const u8* at, i64 arow, int r0, int nr, int nb,
                                          u32 live, int tid, int warp, int gq, int tq) {
    typedef T8Layout<R> L;
    typedef Blk32<KIND> B;
    constexpr int N = R / 8;
    float acc[2][N][4];
    tc_zero<N>(acc);
    const u8* wt = W + (i64)cur * mat_stride + (i64)wrow0 * row_bytes;
    // This thread's rows' offsets in their first 16-byte pieces at stage 0
    // (a stage moves it by T8_KB blocks).
    u32 sh0[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int j = min(wrow0 + warp * 32 + gq + 8 * i, rows - 1) - wrow0;
        sh0[i] = (u32)((unsigned long long)(wt + (i64)j * row_bytes) & 15ull);
    }
    const int stages = (nb + T8_KB - 1) / T8_KB;
    t8_issue<KIND, R>(dsm, wt, row_bytes, wrow0, rows, at, arow, nr, 0, min(T8_KB, nb), tid);
    cp_async_commit();
    for (int s = 0; s < stages; s++) {
        u8* st = dsm + (s & 1) * L::STAGE;
        if (s + 1 < stages) {
            int b1 = (s + 1) * T8_KB;
            t8_issue<KIND, R>(dsm + ((s + 1) & 1) * L::STAGE, wt, row_bytes, wrow0, rows, at, arow, nr, b1,
                              min(T8_KB, nb - b1), tid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u8* wrow = st + (warp * 32 + gq) * T8_WST;
        const u8* sq = st + L::A_OFF;
        const int kb = min(T8_KB, nb - s * T8_KB);
        u32 sh[4];
#pragma unroll
        for (int i = 0; i < 4; i++) sh[i] = (sh0[i] + (u32)(B::BYTES * T8_KB) * (u32)s) & 15u;
#pragma unroll 2
        for (int kk = 0; kk < kb; kk++) {
            u32 aw[4][2];
            float dw[4], dm[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u8* rw = wrow + 8 * i * T8_WST;
                const u32 o = sh[i] + B::BYTES * kk;
                B::values(rw, o, tq, aw[i][0], aw[i][1]);
                dw[i] = B::scale(rw, o);
                dm[i] = B::MINS ? B::dmin(rw, o) : 0.0f;
            }
#pragma unroll
            for (int n = 0; n < N; n++) {
                const u8* ar = sq + (n * 8 + gq) * T8_AST + 36 * kk;
                const u32 b0 = *(const u32*)(ar + 4 * tq), b1 = *(const u32*)(ar + 16 + 4 * tq);
                // The d of this thread's two activation rows, 8 n + 2 tq (+ 1).
                const u8* dr = sq + (8 * n + 2 * tq) * T8_AST + 36 * kk + 32;
                const float da[2] = {*(const float*)dr, *(const float*)(dr + T8_AST)};
                // With mins: the quant sums of those two rows (a product
                // of all-ones weights: every output row the same; c = 0, 1
                // its columns 2 tq, 2 tq + 1).
                int asum[4] = {0, 0, 0, 0};
                if constexpr (B::MINS) mma_s8(asum, 0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u, b0, b1);
#pragma unroll
                for (int a = 0; a < 2; a++) {
                    int d[4];
                    mma_s8(d, aw[2 * a][0], aw[2 * a + 1][0], aw[2 * a][1], aw[2 * a + 1][1], b0, b1);
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        const int i = 2 * a + c / 2;
                        if constexpr (B::MINS)
                            acc[a][n][c] = step_min(acc[a][n][c], dw[i], dm[i], da[c % 2], d[c], asum[c % 2]);
                        else
                            acc[a][n][c] = step_plain(acc[a][n][c], dw[i], da[c % 2], d[c]);
                    }
                }
            }
        }
        __syncthreads();
    }
    tc_store<N>(acc, Y, r0, rows, wrow0, warp, gq, tq, live);
}

// ---------------------------------------------------------------- tensor cores, IQ4_XS
//
// Wide IQ4_XS calls on int8 mma.sync m16n8k32: sub-block s (32 values) is
// one k32 product of its table values against the Q8_K activations, its
// exact dot times the sub-block's scale into the block's integer sum, then
// step_plain: FmtIQ4XS's integer and float step, so its bytes. The values
// at k = 4 tq.. and 16 + 4 tq.. of a sub-block are the low and high nibbles
// of one qs word. 136-byte blocks are 8-byte aligned: 8-byte copies.

#define TX_WST 144  // 36 words: a warp's 8 rows x 4 words in distinct banks

template <int R>
struct TxLayout {
    static constexpr int A_OFF = TQ_WROWS * TX_WST;
    static constexpr int STAGE = A_OFF + R * TA_AST;
};

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

template <int R>
__device__ __forceinline__ void tx_issue(u8* stage, const u8* wt, int row_bytes, int wrow0, int rows, const u8* at,
                                         i64 arow, int nr, int b, int tid) {
    for (int c = tid; c < TQ_WROWS * 17; c += 128) {
        int r = c / 17, q = c - r * 17;
        int j = min(wrow0 + r, rows - 1) - wrow0;
        cp_async8(stage + r * TX_WST + 8 * q, wt + (i64)j * row_bytes + (i64)b * 136 + 8 * q);
    }
    for (int c = tid; c < R * (Q8K_BYTES / 16); c += 128) {
        int t = c / (Q8K_BYTES / 16), q = c % (Q8K_BYTES / 16);
        bool ok = t < nr;
        const u8* src = at + (ok ? t * arow + (i64)b * Q8K_BYTES + q * 16 : 0);
        cp_async16(stage + TxLayout<R>::A_OFF + t * TA_AST + q * 16, src, ok);
    }
}

template <int R>
__device__ __forceinline__ void tx_matrix(u8* dsm, const u8* W, i64 mat_stride, int row_bytes, int cur, int wrow0,
                                          int rows, float* Y, const u8* at, i64 arow, int r0, int nr, int nb,
                                          u32 live, int tid, int warp, int gq, int tq) {
    typedef TxLayout<R> L;
    constexpr int N = R / 8;
    float acc[2][N][4];
    tc_zero<N>(acc);
    const u8* wt = W + (i64)cur * mat_stride + (i64)wrow0 * row_bytes;
    tx_issue<R>(dsm, wt, row_bytes, wrow0, rows, at, arow, nr, 0, tid);
    cp_async_commit();
    for (int b = 0; b < nb; b++) {
        u8* st = dsm + (b & 1) * L::STAGE;
        if (b + 1 < nb) {
            tx_issue<R>(dsm + ((b + 1) & 1) * L::STAGE, wt, row_bytes, wrow0, rows, at, arow, nr, b + 1, tid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u8* wrow = st + (warp * 32 + gq) * TX_WST;
        const u8* sq = st + L::A_OFF;
        int isum[2][N][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < N; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) isum[a][n][c] = 0;
#pragma unroll 2
        for (int sb = 0; sb < 8; sb++) {
            u32 lo[4], hi[4];
            int sc[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u8* rw = wrow + 8 * i * TX_WST;
                u32 w = *(const u32*)(rw + 8 + 16 * sb + 4 * tq);
                lo[i] = iq4nl_lut(w & 0x0F0F0F0Fu);
                hi[i] = iq4nl_lut((w >> 4) & 0x0F0F0F0Fu);
                sc[i] = iq4xs_scale(rw, sb);
            }
#pragma unroll
            for (int n = 0; n < N; n++) {
                const u8* ar = sq + (n * 8 + gq) * TA_AST + 32 * sb;
                const u32 b0 = *(const u32*)(ar + 4 * tq), b1 = *(const u32*)(ar + 16 + 4 * tq);
#pragma unroll
                for (int a = 0; a < 2; a++) {
                    int d[4];
                    mma_s8(d, lo[2 * a], lo[2 * a + 1], hi[2 * a], hi[2 * a + 1], b0, b1);
                    isum[a][n][0] += sc[2 * a] * d[0];
                    isum[a][n][1] += sc[2 * a] * d[1];
                    isum[a][n][2] += sc[2 * a + 1] * d[2];
                    isum[a][n][3] += sc[2 * a + 1] * d[3];
                }
            }
        }
        float dw[4];
#pragma unroll
        for (int i = 0; i < 4; i++) dw[i] = f16_to_f32(*(const u16*)(wrow + 8 * i * TX_WST));
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < N; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                    float da = *(const float*)(sq + t * TA_AST + Q8K_D);
                    acc[a][n][c] = step_plain(acc[a][n][c], dw[i], da, isum[a][n][c]);
                }
        __syncthreads();
    }
    tc_store<N>(acc, Y, r0, rows, wrow0, warp, gq, tq, live);
}

// ---------------------------------------------------------------- tensor cores, low-bit formats
//
// Wide calls of the LowBit formats on int8 mma.sync m16n8k16: group g of a
// block (16 values) is one k16 product of LowBit::group's values against
// the Q8_K activations, its exact dot times the group's scale into the
// block's integer sum (and, with mins, the group's min times the 16-value
// activation sum into msum), then FmtLowBit's float step. Blocks of 66 to
// 110 bytes start 2-byte aligned: copied in the aligned 16-byte pieces that
// hold them, read back through SmemBytes.

#define TL_WST 144  // 9 pieces: a block of up to 110 bytes at any offset in its first piece

template <int R>
struct TlLayout {
    static constexpr int A_OFF = TQ_WROWS * TL_WST;
    static constexpr int STAGE = A_OFF + R * TA_AST;
};

template <int KIND, int R>
__device__ __forceinline__ void tl_issue(u8* stage, const u8* wt, int row_bytes, int wrow0, int rows, const u8* at,
                                         i64 arow, int nr, int b, int tid) {
    constexpr int BY = LowBit<KIND>::BYTES;
    constexpr int PMAX = (15 + BY + 15) / 16;
    static_assert(PMAX * 16 + 8 <= TL_WST, "a row's pieces and the last word's read fit its stride");
    for (int c = tid; c < TQ_WROWS * PMAX; c += 128) {
        int r = c / PMAX, q = c - r * PMAX;
        int j = min(wrow0 + r, rows - 1) - wrow0;
        unsigned long long sa = (unsigned long long)(wt + (i64)j * row_bytes + (i64)b * BY);
        if (q < (int)(((sa & 15ull) + BY + 15) / 16))
            cp_async16(stage + r * TL_WST + 16 * q, (const u8*)(sa & ~15ull) + 16 * q, true);
    }
    for (int c = tid; c < R * (Q8K_BYTES / 16); c += 128) {
        int t = c / (Q8K_BYTES / 16), q = c % (Q8K_BYTES / 16);
        bool ok = t < nr;
        const u8* src = at + (ok ? t * arow + (i64)b * Q8K_BYTES + q * 16 : 0);
        cp_async16(stage + TlLayout<R>::A_OFF + t * TA_AST + q * 16, src, ok);
    }
}

template <int KIND, int R>
__device__ __forceinline__ void tl_matrix(u8* dsm, const u8* W, i64 mat_stride, int row_bytes, int cur, int wrow0,
                                          int rows, float* Y, const u8* at, i64 arow, int r0, int nr, int nb,
                                          u32 live, int tid, int warp, int gq, int tq) {
    typedef TlLayout<R> L;
    typedef LowBit<KIND> F;
    constexpr int N = R / 8;
    float acc[2][N][4];
    tc_zero<N>(acc);
    const u8* wt = W + (i64)cur * mat_stride + (i64)wrow0 * row_bytes;
    u32 sh0[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int j = min(wrow0 + warp * 32 + gq + 8 * i, rows - 1) - wrow0;
        sh0[i] = (u32)((unsigned long long)(wt + (i64)j * row_bytes) & 15ull);
    }
    tl_issue<KIND, R>(dsm, wt, row_bytes, wrow0, rows, at, arow, nr, 0, tid);
    cp_async_commit();
    for (int b = 0; b < nb; b++) {
        u8* st = dsm + (b & 1) * L::STAGE;
        if (b + 1 < nb) {
            tl_issue<KIND, R>(dsm + ((b + 1) & 1) * L::STAGE, wt, row_bytes, wrow0, rows, at, arow, nr, b + 1, tid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u8* wrow = st + (warp * 32 + gq) * TL_WST;
        const u8* sq = st + L::A_OFF;
        SmemBytes rb[4];
#pragma unroll
        for (int i = 0; i < 4; i++) rb[i] = SmemBytes{wrow + 8 * i * TL_WST, (sh0[i] + (u32)F::BYTES * (u32)b) & 15u};
        int isum[2][N][4], msum[2][N][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < N; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) isum[a][n][c] = msum[a][n][c] = 0;
#pragma unroll 2
        for (int g = 0; g < 16; g++) {
            u32 v[4];
            int sc[4], mn[4];
#pragma unroll
            for (int i = 0; i < 4; i++) F::group(rb[i], g, tq, v[i], sc[i], mn[i]);
#pragma unroll
            for (int n = 0; n < N; n++) {
                const u32 bq = *(const u32*)(sq + (n * 8 + gq) * TA_AST + 16 * g + 4 * tq);
#pragma unroll
                for (int a = 0; a < 2; a++) {
                    int d[4];
                    mma_s8_k16(d, v[2 * a], v[2 * a + 1], bq);
                    isum[a][n][0] += sc[2 * a] * d[0];
                    isum[a][n][1] += sc[2 * a] * d[1];
                    isum[a][n][2] += sc[2 * a + 1] * d[2];
                    isum[a][n][3] += sc[2 * a + 1] * d[3];
                }
                if constexpr (F::MINS) {
                    // The 16-value sums of this thread's two activation rows.
                    const int t0 = 8 * n + 2 * tq;
                    const int bs0 = ((const i16*)(sq + t0 * TA_AST + Q8K_BSUMS))[g];
                    const int bs1 = ((const i16*)(sq + (t0 + 1) * TA_AST + Q8K_BSUMS))[g];
#pragma unroll
                    for (int a = 0; a < 2; a++)
#pragma unroll
                        for (int c = 0; c < 4; c++) msum[a][n][c] += mn[2 * a + c / 2] * (c % 2 ? bs1 : bs0);
                }
            }
        }
        float dw[4], dm[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            dw[i] = F::d(rb[i]);
            dm[i] = F::dmin(rb[i]);
        }
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < N; n++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int i = 2 * a + c / 2, t = 8 * n + 2 * tq + c % 2;
                    float da = *(const float*)(sq + t * TA_AST + Q8K_D);
                    acc[a][n][c] = F::MINS ? step_min(acc[a][n][c], dw[i], dm[i], da, isum[a][n][c], msum[a][n][c])
                                           : step_plain(acc[a][n][c], dw[i], da, isum[a][n][c]);
                }
        __syncthreads();
    }
    tc_store<N>(acc, Y, r0, rows, wrow0, warp, gq, tq, live);
}

// The tile kernels of the formats above (FMT 6: Q6_K, 9: IQ4_XS, 8: Q8_0,
// 0-5: the Nib32 kinds, 10 + KIND: the LowBit kinds): as mm_tc_async_k, rows with no matrix get zeros
// and each matrix of the tile is computed once, ascending; two stages of
// dynamic shared memory (T6Layout, TxLayout or T8Layout). `nb`: weight
// blocks a row; activation rows are nb Q8_K blocks (Q6_K, IQ4_XS) or nb
// Q8_0 blocks.
template <int FMT, int R>
__device__ void mm_tc_rows_k(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y,
                             int rows, int m, int nb) {
    extern __shared__ __align__(16) u8 dsm[];
    __shared__ int smat[R];
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int r0 = blockIdx.y * R;
    if (r0 >= m) return;
    int nr = min(R, m - r0);
    for (int t = tid; t < R; t += blockDim.x) smat[t] = t < nr ? (mats ? mats[r0 + t] : 0) : -1;
    __syncthreads();
    int gq = lane >> 2, tq = lane & 3;
    int wrow0 = blockIdx.x * TQ_WROWS;
    i64 arow = (i64)nb * (FMT == 6 || FMT == 9 || FMT >= 10 ? Q8K_BYTES : 36);
    static_assert(R <= 32, "a lane a tile row");
    const int vmat = lane < R ? smat[lane] : -1;
    const int col = wrow0 + tid;
    for (u32 zero = __ballot_sync(0xffffffffu, lane < nr && vmat < 0); zero; zero &= zero - 1) {
        int t = __ffs(zero) - 1;
        if (col < rows) Y[(i64)(r0 + t) * rows + col] = 0.0f;
    }
    const u8* at = A + r0 * arow;
    int prev = -1;
    for (;;) {
        const int cur = __reduce_min_sync(0xffffffffu, vmat > prev ? vmat : 0x7fffffff);
        if (cur == 0x7fffffff) break;
        prev = cur;
        const u32 live = __ballot_sync(0xffffffffu, vmat == cur);
        if constexpr (FMT == 6)
            t6_matrix<R>(dsm, W, mat_stride, row_bytes, cur, wrow0, rows, Y, at, arow, r0, nr, nb, live, tid, warp,
                         gq, tq);
        else if constexpr (FMT == 9)
            tx_matrix<R>(dsm, W, mat_stride, row_bytes, cur, wrow0, rows, Y, at, arow, r0, nr, nb, live, tid, warp,
                         gq, tq);
        else if constexpr (FMT >= 10)
            tl_matrix<FMT - 10, R>(dsm, W, mat_stride, row_bytes, cur, wrow0, rows, Y, at, arow, r0, nr, nb, live,
                                   tid, warp, gq, tq);
        else
            t8_matrix<FMT, R>(dsm, W, mat_stride, row_bytes, cur, wrow0, rows, Y, at, arow, r0, nr, nb, live, tid,
                              warp, gq, tq);
    }
}

#define TC_ROWS_KERNEL(name, FMT, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(128, 2)                                                  \
        name(const u8* W, i64 mat_stride, int row_bytes, const int* mats, const u8* A, float* Y, int rows, int m, \
             int nb) {                                                                                    \
        pdl_wait();                                                                                       \
        mm_tc_rows_k<FMT, R>(W, mat_stride, row_bytes, mats, A, Y, rows, m, nb);                          \
    }

TC_ROWS_KERNEL(mm_tc_q6_k, 6, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_q6_k32, 6, 32)
TC_ROWS_KERNEL(mm_tc_q8_0, 8, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_q8_0_32, 8, 32)
TC_ROWS_KERNEL(mm_tc_iq4_xs, 9, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_iq4_xs32, 9, 32)
TC_ROWS_KERNEL(mm_tc_q4_0, 0, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_q4_0_32, 0, 32)
TC_ROWS_KERNEL(mm_tc_iq4_nl, 1, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_iq4_nl32, 1, 32)
TC_ROWS_KERNEL(mm_tc_mxfp4, 2, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_mxfp4_32, 2, 32)
TC_ROWS_KERNEL(mm_tc_q5_0, 3, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_q5_0_32, 3, 32)
TC_ROWS_KERNEL(mm_tc_q4_1, 4, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_q4_1_32, 4, 32)
TC_ROWS_KERNEL(mm_tc_q5_1, 5, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_q5_1_32, 5, 32)
TC_ROWS_KERNEL(mm_tc_q2_k, 10, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_q2_k32, 10, 32)
TC_ROWS_KERNEL(mm_tc_q3_k, 11, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_q3_k32, 11, 32)
TC_ROWS_KERNEL(mm_tc_iq2_xxs, 12, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_iq2_xxs32, 12, 32)
TC_ROWS_KERNEL(mm_tc_iq2_xs, 13, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_iq2_xs32, 13, 32)
TC_ROWS_KERNEL(mm_tc_iq2_s, 14, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_iq2_s32, 14, 32)
TC_ROWS_KERNEL(mm_tc_iq3_xxs, 15, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_iq3_xxs32, 15, 32)
TC_ROWS_KERNEL(mm_tc_iq3_s, 16, TQ_ROWS)
TC_ROWS_KERNEL(mm_tc_iq3_s32, 16, 32)
