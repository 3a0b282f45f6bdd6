// Flash attention on tensor cores (`--attention fast`): the prefill
// blocks, decode's blocks a split each (one sequence's rows, or a row each
// of several sequences), and the fold of decode's splits. Compiled in the
// ops module after attention.cu (its OneSeq / OfSeqs row tables).

// f16 operands, f32 accumulation, online softmax, as llama.cpp's default
// attention computes: q, k, v and the probabilities rounded to f16 for
// mma.sync m16n8k16, the scores, sums and outputs kept in f32. A different
// function from the exact passes (attention.cu), one function for decode and prefill.
//
// The row contract by construction. A block takes FA_P (row, head) pairs of
// one KV head (FA_P / gs rows x the gs query heads of the group), a warp
// 16 or 32 of them as the rows of its one or two mma m-tiles (FaPrefill);
// an mma row's result depends on that
// row's q (or probabilities) and the tile's keys (or values) only. A pair's
// keys 0..=pos are cut by position alone: into splits of FA_SPLIT keys, each
// split into tiles of FA_KT keys. Within a split the tiles are folded in
// order by the online softmax (running max m, sum l, output o); the splits
// are then folded in order by fa_fold. Prefill blocks run a pair's splits
// one after another and fold them in registers; decode blocks (few rows,
// attention_flash_dec below) take one split each, write its (m, l, o) and attention_flash_combine folds
// them, with the same fa_fold, in the same order: the same bytes either way.
// A tile past a pair's position (prefill blocks run up to their last row's)
// adds nothing: its scores are -inf, its probabilities 0, the running
// values scaled by 1. Scores are kept in the log2 domain (times scale *
// log2(e)) and exponentiated with ex2.approx, the same instruction in every
// kernel here.
#define FA_W 8              // warps a block
#define FA_P (16 * FA_W)    // (row, head) pairs a block
#define FA_KT 64            // keys a tile
#define FA_SPLIT 512        // keys a split: fixed, so the fold order is fixed
static_assert(KV_BLOCK % FA_KT == 0, "a key tile lies in one block of the paged cache");

__device__ __forceinline__ float fa_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 fa_pack(float lo, float hi) {
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}

// Two cache values as halves, as an f16 cache stores them (f32_to_f16_kv).
__device__ __forceinline__ u32 fa_pack_kv(float lo, float hi) {
    return (u32)f32_to_f16_kv(lo) | ((u32)f32_to_f16_kv(hi) << 16);
}

__device__ __forceinline__ void fa_ldsm4(u32 (&r)[4], const u16* p) {
    u32 a = smem_addr(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void fa_ldsm4t(u32 (&r)[4], const u16* p) {
    u32 a = smem_addr(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void fa_mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The fold of a split's (ms, ls, os) into the running (M, L, O) of the
// splits before it: the weights of both sides, computed once per row.
struct FaFold {
    float a, b;
    __device__ __forceinline__ FaFold(float& M, float& L, float ms, float ls) {
        float mn = fmaxf(M, ms);
        a = fa_ex2(__fsub_rn(M, mn));
        b = fa_ex2(__fsub_rn(ms, mn));
        L = __fmaf_rn(L, a, __fmul_rn(ls, b));
        M = mn;
    }
    __device__ __forceinline__ float out(float o, float os) const { return __fmaf_rn(o, a, __fmul_rn(os, b)); }
};

// A tile's online-softmax step on a lane's scores sc (log2 domain, -inf
// past each row's position) given its two rows' maxima mt over the lane's
// own scores: the maxima over the quad, the running maximum mr and the
// factor al the running values rescale by, sc replaced by the
// probabilities and the running sum lr updated. The prefill and decode
// blocks both run it, so they compute the same bits.
__device__ __forceinline__ void fa_softmax_tile(float (&sc)[FA_KT / 8][4], float (&mt)[2], float (&mr)[2],
                                                float (&lr)[2], float (&al)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 1));
        mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 2));
        // The running values rescale only when the maximum grows (a tile
        // with no key for the row, all -inf, is an exact no-op: a factor of
        // exactly 1 and zero products).
        al[h] = mt[h] > mr[h] ? fa_ex2(__fsub_rn(mr[h], mt[h])) : 1.0f;
        mr[h] = fmaxf(mr[h], mt[h]);
    }
    float ps[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < FA_KT / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int h = e / 2;
            float p = mr[h] == -INFINITY ? 0.0f : fa_ex2(__fsub_rn(sc[n][e], mr[h]));
            sc[n][e] = p;
            ps[h] = __fadd_rn(ps[h], p);
        }
#pragma unroll
    for (int h = 0; h < 2; h++) lr[h] = __fmaf_rn(lr[h], al[h], ps[h]);
}

// A split's running sums over the quad's four lanes (lanes 4r .. 4r + 3
// hold row r's columns), the same adds in the same order in the prefill
// and decode blocks; every lane of the quad gets the same bits.
__device__ __forceinline__ void fa_quad_sum(float (&lr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        lr[h] = __fadd_rn(lr[h], __shfl_xor_sync(0xffffffffu, lr[h], 1));
        lr[h] = __fadd_rn(lr[h], __shfl_xor_sync(0xffffffffu, lr[h], 2));
    }
}

// N output n-tiles os (8 value columns each from va, rows ST halves apart)
// rescaled by al, then o += p v: the probabilities' C fragments are the A
// fragments of the next product (keys 16 kk .. 16 kk + 15).
template <int N, int ST>
__device__ __forceinline__ void fa_rescale_pv(float (&os)[N][4], const float (&al)[2],
                                              const float (&sc)[FA_KT / 8][4], const u16* va) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) os[n][e] = __fmul_rn(os[n][e], al[e / 2]);
#pragma unroll
    for (int kk = 0; kk < FA_KT / 16; kk++) {
        u32 a0 = fa_pack(sc[2 * kk][0], sc[2 * kk][1]), a1 = fa_pack(sc[2 * kk][2], sc[2 * kk][3]);
        u32 a2 = fa_pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        u32 a3 = fa_pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
        for (int n = 0; n < N; n += 2) {
            u32 b[4];
            fa_ldsm4t(b, va + 16 * kk * ST + 8 * n);
            fa_mma(os[n], a0, a1, a2, a3, b[0], b[1]);
            fa_mma(os[n + 1], a0, a1, a2, a3, b[2], b[3]);
        }
    }
}

// Row stride of the shared tiles in halves: rows 16 bytes (4 banks) apart
// modulo 128, so ldmatrix's eight rows hit distinct banks. The pairs' q,
// the running fold of the splits (a max and a sum, floats, per pair and
// lane of its quad: kept out of the registers the tiles need), then two buffers of a tile's keys
// and values (an f16 cache's next tile is copied into one while the other
// is read; an f32 cache's are converted into the first).
template <int HD>
struct FaLayout {
    static constexpr int ST = HD + 8;
    static constexpr int Q = 0;
    static constexpr int ML = FA_P * ST;
    static constexpr int K = ML + FA_P * 16;
    static constexpr int BUF = 2 * FA_KT * ST;  // keys then values
    static constexpr int HALVES = K + 2 * BUF;
};

// An f16 cache's keys j0 .. j0 + FA_KT - 1 of KV head g copied to shared
// memory asynchronously (zeros past key `last`) by the block's NTH threads.
template <int HD, int NTH = FA_W * 32>
__device__ __forceinline__ void fa_issue_kv(u16* ks, const u64* kt, const u64* vt, int hkv, int g, int j0,
                                            int last) {
    typedef FaLayout<HD> L;
    constexpr int CH = HD / 8;
    // The tile's keys lie in one block of the paged cache (tiles start at
    // multiples of FA_KT, which divides KV_BLOCK).
    const void* ck = kv_block_base(kt, j0, hkv * HD, 2);
    const void* cv = kv_block_base(vt, j0, hkv * HD, 2);
    // Thread t copies chunk t % CH of rows t / CH, t / CH + NTH / CH, ...
    // of each matrix: its offsets step by constants, so none is held in a
    // register across the kernel's tile loop.
    static_assert(NTH % CH == 0 && FA_KT % (NTH / CH) == 0, "threads cover a tile's rows evenly");
    // Rows past `last` are zero-filled from row j0's address (mapped: j0 <=
    // last); a row's source is the previous one's plus one position.
    constexpr int RS = NTH / CH;  // rows a pass
    int c = threadIdx.x % CH, r0 = threadIdx.x / CH;
    i64 pstep = (i64)hkv * HD;  // halves a position
#pragma unroll
    for (int mat = 0; mat < 2; mat++) {
        const u16* first = (const u16*)(mat ? cv : ck) + (i64)j0 * pstep + (i64)g * HD + 8 * c;
        const u16* src = first + r0 * pstep;
        u16* dst = ks + mat * FA_KT * L::ST + r0 * L::ST + 8 * c;
#pragma unroll
        for (int k = 0; k < FA_KT / RS; k++) {
            bool ok = j0 + r0 + RS * k <= last;
            cp_async16(dst + RS * k * L::ST, ok ? src : first, ok);
            src += RS * pstep;
        }
    }
}

// An f32 cache's keys j0 .. j0 + FA_KT - 1 of KV head g into shared memory
// as halves (f32_to_f16_kv: the bytes an f16 cache holds), zeros past
// key `last`, by the block's NTH threads.
template <int HD, int NTH = FA_W * 32>
__device__ __forceinline__ void fa_load_kv(u16* ks, const u64* kt, const u64* vt, int hkv, int g, int j0,
                                           int last) {
    typedef FaLayout<HD> L;
    constexpr int CH = HD / 8;  // 8-value chunks a row
    const void* ck = kv_block_base(kt, j0, hkv * HD, 4);
    const void* cv = kv_block_base(vt, j0, hkv * HD, 4);
    // The rows of each thread as fa_issue_kv's.
    static_assert(NTH % CH == 0 && FA_KT % (NTH / CH) == 0, "threads cover a tile's rows evenly");
    int c = threadIdx.x % CH;
#pragma unroll
    for (int mat = 0; mat < 2; mat++) {
        const float* base = (const float*)(mat ? cv : ck) + (i64)g * HD + 8 * c;
#pragma unroll 1
        for (int r = threadIdx.x / CH; r < FA_KT; r += NTH / CH) {
            int j = j0 + r;
            uint4 w = make_uint4(0u, 0u, 0u, 0u);
            if (j <= last) {
                const float* src = base + (i64)j * hkv * HD;
                float4 x = *reinterpret_cast<const float4*>(src);
                float4 y = *reinterpret_cast<const float4*>(src + 4);
                w = make_uint4(fa_pack_kv(x.x, x.y), fa_pack_kv(x.z, x.w), fa_pack_kv(y.x, y.y),
                               fa_pack_kv(y.z, y.w));
            }
            *reinterpret_cast<uint4*>(ks + mat * FA_KT * L::ST + r * L::ST + 8 * c) = w;
        }
    }
}

// The key tile at j0 (iteration it of a loop over keys up to jall) in
// shared memory for every thread of the block, which it returns: an f16
// cache's tile was issued one iteration ahead (double-buffered), and the
// next one is issued here; an f32 cache's tile is converted here. L is the
// calling kernel's shared-memory layout (where its tile buffers start).
template <typename L, int HD, int NTH>
__device__ __forceinline__ u16* fa_stage_kv(u16* smem, const u64* kt, const u64* vt, int hkv, int g, int j0,
                                            int jall, int last, int it, int f16) {
    static_assert(L::ST == HD + 8, "tile rows hd + 8 halves apart");
    u16* kb = smem + L::K + (f16 ? (it & 1) * L::BUF : 0);
    if (f16) {
        if (j0 + FA_KT < jall) {
            fa_issue_kv<HD, NTH>(smem + L::K + ((it + 1) & 1) * L::BUF, kt, vt, hkv, g, j0 + FA_KT, last);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
    } else {
        __syncthreads();
        fa_load_kv<HD, NTH>(kb, kt, vt, hkv, g, j0, last);
        __syncthreads();
    }
    return kb;
}

// N output n-tiles of MT m-tiles (os[t], the probabilities sc[t]) rescaled
// by al[t], then o += p v, each value fragment loaded once for the MT
// m-tiles: every element the same steps in the same order as
// fa_rescale_pv's (the scaling, then the mma of keys 16 kk .. 16 kk + 15
// for kk in order).
template <int MT, int N, int ST>
__device__ __forceinline__ void fa_rescale_pv_mt(float (&os)[MT][N][4], const float (&al)[MT][2],
                                                 const float (&sc)[MT][FA_KT / 8][4], const u16* va) {
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int n = 0; n < N; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) os[t][n][e] = __fmul_rn(os[t][n][e], al[t][e / 2]);
#pragma unroll
    for (int kk = 0; kk < FA_KT / 16; kk++) {
        u32 a[MT][4];
#pragma unroll
        for (int t = 0; t < MT; t++) {
            a[t][0] = fa_pack(sc[t][2 * kk][0], sc[t][2 * kk][1]);
            a[t][1] = fa_pack(sc[t][2 * kk][2], sc[t][2 * kk][3]);
            a[t][2] = fa_pack(sc[t][2 * kk + 1][0], sc[t][2 * kk + 1][1]);
            a[t][3] = fa_pack(sc[t][2 * kk + 1][2], sc[t][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < N; n += 2) {
            u32 b[4];
            fa_ldsm4t(b, va + 16 * kk * ST + 8 * n);
#pragma unroll
            for (int t = 0; t < MT; t++) {
                fa_mma(os[t][n], a[t][0], a[t][1], a[t][2], a[t][3], b[0], b[1]);
                fa_mma(os[t][n + 1], a[t][0], a[t][1], a[t][2], a[t][3], b[2], b[3]);
            }
        }
    }
}

// The prefill block's warps (FA_P / 16 / MT) and m-tiles a warp (MT): two
// m-tiles a warp at head dims up to 128, so each key and value fragment
// read from shared memory serves 32 pairs (half the shared-memory reads of
// one m-tile a warp) and the block of 4 warps fits twice on an SM; one at
// head dim 256, whose two m-tiles' outputs would not fit in registers.
template <int HD>
struct FaPrefill {
    static constexpr int MT = HD <= 128 ? 2 : 1;
    static constexpr int W = FA_P / 16 / MT;
};

// Pairs p of the block: (row r0 + p / gs, head g * gs + p % gs): every
// split of the block's rows, folded, the output to `o`. Warp w takes pairs
// 16 MT w .. 16 MT w + 16 MT - 1 as its MT m-tiles; each m-tile's rows run
// the steps of a one-m-tile warp exactly (its own q, the same key and
// value fragments, the same softmax), so MT changes no bits.
template <int HD>
__device__ __forceinline__ void attention_flash_k(const float* q, const u64* kt, const u64* vt, float* o, int m,
                                                  int hq, int hkv, const int* posp, int rbase, float sl2,
                                                  int f16) {
    typedef FaLayout<HD> L;
    constexpr int MT = FaPrefill<HD>::MT, NTH = FaPrefill<HD>::W * 32;
    constexpr int NT = HD / 8;  // output n-tiles a warp
    extern __shared__ __align__(16) u16 fa_smem[];
    u16* qs = fa_smem + L::Q;
    int pos0 = *posp + rbase;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int gr = lane >> 2, c = lane & 3;
    int gs = hq / hkv, rows = FA_P / gs;
    int g = blockIdx.x, r0 = blockIdx.y * rows;
    int np = min(rows, m - r0) * gs;
    int last = pos0 + r0 + (np - 1) / gs;  // the block's last key
    for (int i = tid; i < FA_P * (HD / 2); i += NTH) {
        int p = i / (HD / 2), d = 2 * (i % (HD / 2));
        u32 w = 0u;
        if (p < np) {
            float2 x = *reinterpret_cast<const float2*>(q + ((i64)(r0 + p / gs) * hq + g * gs + p % gs) * HD + d);
            w = fa_pack(x.x, x.y);
        }
        *reinterpret_cast<u32*>(qs + p * L::ST + d) = w;
    }
    // This lane's two mma rows of m-tile t: pairs pa[t] = 16 (MT warp + t) + gr
    // and pa[t] + 8 (position -1: not live).
    int pa[MT], posr[MT][2];
#pragma unroll
    for (int t = 0; t < MT; t++) {
        pa[t] = 16 * (MT * warp + t) + gr;
#pragma unroll
        for (int h = 0; h < 2; h++) posr[t][h] = pa[t] + 8 * h < np ? pos0 + r0 + (pa[t] + 8 * h) / gs : -1;
    }
    int p1 = 16 * MT * warp;  // the warp's first pair; its last key:
    int wlast = p1 < np ? pos0 + r0 + (min(p1 + 16 * MT - 1, np - 1)) / gs : -1;
    // ldmatrix addresses: A (q) rows 16 (MT warp + t) + (lane % 8) + 8 ((lane / 8) % 2),
    // columns 8 (lane / 16); K: keys (lane % 8) + 8 (lane / 16), dims 8 ((lane / 8) % 2);
    // V (transposed): keys (lane % 8) + 8 ((lane / 8) % 2), dims 8 (lane / 16).
    const u16* qa = qs + (p1 + (lane & 7) + 8 * ((lane >> 3) & 1)) * L::ST + 8 * (lane >> 4);

    // The running fold of the splits before: M and L in registers, o in the
    // output rows themselves (each element read and written by its own lane).
    // The running fold lives in shared memory, read and written at split
    // ends only: pair p's max and sum at fml[2 (4 p + c)], a copy for each
    // lane c of the quad holding the pair (the four compute the same fold).
    float* fml = reinterpret_cast<float*>(fa_smem + L::ML);
    float mr[MT][2], lr[MT][2], os[MT][NT][4];
    // The block's tiles in order, the splits' boundaries every
    // FA_SPLIT / FA_KT tiles. An f16 cache's tiles are copied a tile ahead
    // into alternate buffers; an f32 cache's are converted in place.
    int jbeg = 0, jall = last + 1;
    if (f16) {
        fa_issue_kv<HD, NTH>(fa_smem + L::K, kt, vt, hkv, g, jbeg, last);
        cp_async_commit();
    }
    for (int j0 = jbeg, it = 0; j0 < jall; j0 += FA_KT, it++) {
        u16* kb = fa_stage_kv<L, HD, NTH>(fa_smem, kt, vt, hkv, g, j0, jall, last, it, f16);
        int s = j0 / FA_SPLIT;
        if (j0 % FA_SPLIT == 0) {
#pragma unroll
            for (int t = 0; t < MT; t++) {
#pragma unroll
                for (int h = 0; h < 2; h++) mr[t][h] = -INFINITY, lr[t][h] = 0.0f;
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) os[t][n][e] = 0.0f;
            }
        }
        if (wlast >= j0) {  // else no key of the tile for any row of this warp
            const u16* ka = kb + ((lane & 7) + 8 * (lane >> 4)) * L::ST + 8 * ((lane >> 3) & 1);
            const u16* va = kb + FA_KT * L::ST + ((lane & 7) + 8 * ((lane >> 3) & 1)) * L::ST + 8 * (lane >> 4);
            float sc[MT][FA_KT / 8][4];
#pragma unroll
            for (int t = 0; t < MT; t++)
#pragma unroll
                for (int n = 0; n < FA_KT / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) sc[t][n][e] = 0.0f;
#pragma unroll
            for (int k0 = 0; k0 < HD; k0 += 16) {
                u32 a[MT][4];
#pragma unroll
                for (int t = 0; t < MT; t++) fa_ldsm4(a[t], qa + 16 * t * L::ST + k0);
#pragma unroll
                for (int n = 0; n < FA_KT / 8; n += 2) {
                    u32 b[4];
                    fa_ldsm4(b, ka + n * 8 * L::ST + k0);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        fa_mma(sc[t][n], a[t][0], a[t][1], a[t][2], a[t][3], b[0], b[1]);
                        fa_mma(sc[t][n + 1], a[t][0], a[t][1], a[t][2], a[t][3], b[2], b[3]);
                    }
                }
            }
            // Scores in the log2 domain, -inf past each row's position;
            // the tile's row maxima over the quad's lanes.
            float al[MT][2];
#pragma unroll
            for (int t = 0; t < MT; t++) {
                float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int n = 0; n < FA_KT / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int h = e / 2, j = j0 + 8 * n + 2 * c + (e & 1);
                        float v = j <= posr[t][h] ? __fmul_rn(sc[t][n][e], sl2) : -INFINITY;
                        sc[t][n][e] = v;
                        mt[h] = fmaxf(mt[h], v);
                    }
                fa_softmax_tile(sc[t], mt, mr[t], lr[t], al[t]);
            }
            fa_rescale_pv_mt<MT, NT, L::ST>(os, al, sc, va);
        }
        // The buffer just read is the one the next tile but one is copied to.
        if (f16) __syncthreads();
        if ((j0 + FA_KT) % FA_SPLIT != 0 && j0 + FA_KT < jall) continue;
        // The split ends: its sum over the quad's lanes (every lane of the
        // quad gets the same bits: fadd commutes), then its fold into the
        // running values (decode writes the split's partial instead and
        // attention_flash_combine folds it the same way).
#pragma unroll
        for (int t = 0; t < MT; t++) {
            fa_quad_sum(lr[t]);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (posr[t][h] < s * FA_SPLIT) continue;  // the row has no key in this split
                int p = pa[t] + 8 * h;
                float* orow = o + ((i64)(r0 + p / gs) * hq + g * gs + p % gs) * HD + 2 * c;
                float2* ml = reinterpret_cast<float2*>(fml) + 4 * p + c;
                if (s == 0) {
                    *ml = make_float2(mr[t][h], lr[t][h]);
#pragma unroll
                    for (int n = 0; n < NT; n++)
                        *reinterpret_cast<float2*>(orow + 8 * n) = make_float2(os[t][n][2 * h], os[t][n][2 * h + 1]);
                } else {
                    float2 v = *ml;
                    FaFold f(v.x, v.y, mr[t][h], lr[t][h]);
                    *ml = v;
#pragma unroll
                    for (int n = 0; n < NT; n++) {
                        float2 x = *reinterpret_cast<const float2*>(orow + 8 * n);
                        *reinterpret_cast<float2*>(orow + 8 * n) =
                            make_float2(f.out(x.x, os[t][n][2 * h]), f.out(x.y, os[t][n][2 * h + 1]));
                    }
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (posr[t][h] < 0) continue;
            int p = pa[t] + 8 * h;
            float* orow = o + ((i64)(r0 + p / gs) * hq + g * gs + p % gs) * HD + 2 * c;
            float Lv = fml[2 * (4 * p + c) + 1];
#pragma unroll
            for (int n = 0; n < NT; n++) {
                float2 x = *reinterpret_cast<const float2*>(orow + 8 * n);
                *reinterpret_cast<float2*>(orow + 8 * n) = make_float2(__fdiv_rn(x.x, Lv), __fdiv_rn(x.y, Lv));
            }
        }
}

// Launch with FaPrefill<HD>::W * 32 threads: 128 (two blocks an SM) at head
// dims 64 and 128, 256 (one) at 256.
#define FA_KERNEL(name, HD)                                                                                        \
    extern "C" __global__ void __launch_bounds__(FaPrefill<HD>::W * 32, FaPrefill<HD>::MT)                         \
        name(const float* q, const u64* kt, const u64* vt, float* o, int m, int hq, int hkv, const int* posp,      \
             int rbase, float sl2, int f16) {                                                                      \
        pdl_wait();                                                                                                \
        attention_flash_k<HD>(q, kt, vt, o, m, hq, hkv, posp, rbase, sl2, f16);                                    \
    }
FA_KERNEL(attention_flash_64, 64)
FA_KERNEL(attention_flash_128, 128)
FA_KERNEL(attention_flash_256, 256)

// Decode's blocks: one split of up to FD_P (row, head) pairs of one row and
// KV head g (the rows of one mma tile), its (m, l) to pml and o to pacc, the function of
// attention_flash_k's split mode to the bit with four warps at work on each
// tile instead of one. Warp w takes the tile's keys 16 w .. 16 w + 15 for
// the scores (an mma output element depends on its row's q and its key
// only, so the same bits whichever warp makes it) and writes them, scaled
// and masked, to shared memory; then every warp reads the whole tile's
// scores back in the mma layout and runs the online softmax on them as
// attention_flash_k's lane does (the same maxima, exponentials and sums in
// the same order, so every warp holds the same running max and sum), and
// multiplies the probabilities by its quarter of the head dim's value
// columns (an output column's chain of scalings and mma accumulations is
// that column's alone). Decode's per-tile chain is a quarter as long, the
// split's keys read once a block as before.
#define FD_W 4   // warps a decode block
#define FD_P 16  // (row, head) pairs a decode block
#define FD_SS (FA_KT + 4)  // a score row's stride in floats (bank spread)

template <int HD>
struct FdLayout {
    static constexpr int ST = HD + 8;
    static constexpr int K = FD_P * ST;         // after the pairs' q
    static constexpr int BUF = 2 * FA_KT * ST;  // keys then values
    static constexpr int S = K + 2 * BUF;       // the scores (floats) after two buffers
    static constexpr int BYTES = S * 2 + FD_P * FD_SS * 4;
};

// Block (g, y, s): row y / tpr, its query heads g gs + FD_P (y % tpr) ..
// (tpr = ceil(gs / FD_P) tiles a row), split s; `rows` says where the row's
// keys are and its position.
template <int HD, typename Rows>
__device__ __forceinline__ void attention_flash_dec_k(const float* q, Rows rows, float* pml, float* pacc, int m,
                                                      int hq, int hkv, float sl2, int f16, int nsplit) {
    typedef FdLayout<HD> L;
    constexpr int NW = HD / 8 / FD_W;  // a warp's output n-tiles
    constexpr int NTH = FD_W * 32;
    extern __shared__ __align__(16) u16 fa_smem[];
    u16* qs = fa_smem;
    float* ss = reinterpret_cast<float*>(fa_smem + L::S);
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int gr = lane >> 2, c = lane & 3;
    int gs = hq / hkv, tpr = (gs + FD_P - 1) / FD_P;
    int g = blockIdx.x, r = blockIdx.y / tpr, p0 = (blockIdx.y % tpr) * FD_P, s = blockIdx.z;
    if (r >= m) return;
    int np = min(FD_P, gs - p0);
    int last = rows.pos(r);  // the row's last key
    if (s * FA_SPLIT > last) return;
    const u64 *kt = rows.k(r), *vt = rows.v(r);
    // Pair p: head g gs + p0 + p of row r, output pair (r hq + that head).
    i64 pair0 = (i64)r * hq + g * gs + p0;
    for (int i = tid; i < FD_P * (HD / 2); i += NTH) {
        int p = i / (HD / 2), d = 2 * (i % (HD / 2));
        u32 w = 0u;
        if (p < np) {
            float2 x = *reinterpret_cast<const float2*>(q + (pair0 + p) * HD + d);
            w = fa_pack(x.x, x.y);
        }
        *reinterpret_cast<u32*>(qs + p * L::ST + d) = w;
    }
    int posr[2];
#pragma unroll
    for (int h = 0; h < 2; h++) posr[h] = gr + 8 * h < np ? last : -1;
    const u16* qa = qs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * L::ST + 8 * (lane >> 4);
    float mr[2] = {-INFINITY, -INFINITY}, lr[2] = {0.0f, 0.0f}, os[NW][4];
#pragma unroll
    for (int n = 0; n < NW; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) os[n][e] = 0.0f;
    int jbeg = s * FA_SPLIT, jall = min((s + 1) * FA_SPLIT, last + 1);
    if (f16) {
        fa_issue_kv<HD, NTH>(fa_smem + L::K, kt, vt, hkv, g, jbeg, last);
        cp_async_commit();
    }
    for (int j0 = jbeg, it = 0; j0 < jall; j0 += FA_KT, it++) {
        u16* kb = fa_stage_kv<L, HD, NTH>(fa_smem, kt, vt, hkv, g, j0, jall, last, it, f16);
        {
            // This warp's 16 keys: attention_flash_k's n-tiles 2 warp and
            // 2 warp + 1, the same k-steps in the same order.
            const u16* ka = kb + (16 * warp + (lane & 7) + 8 * (lane >> 4)) * L::ST + 8 * ((lane >> 3) & 1);
            float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
            for (int k0 = 0; k0 < HD; k0 += 16) {
                u32 a[4], b[4];
                fa_ldsm4(a, qa + k0);
                fa_ldsm4(b, ka + k0);
                fa_mma(sc[0], a[0], a[1], a[2], a[3], b[0], b[1]);
                fa_mma(sc[1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int col = 8 * (2 * warp + n) + 2 * c, j = j0 + col;
                    float v0 = j <= posr[h] ? __fmul_rn(sc[n][2 * h], sl2) : -INFINITY;
                    float v1 = j + 1 <= posr[h] ? __fmul_rn(sc[n][2 * h + 1], sl2) : -INFINITY;
                    *reinterpret_cast<float2*>(ss + (gr + 8 * h) * FD_SS + col) = make_float2(v0, v1);
                }
        }
        __syncthreads();
        float sc[FA_KT / 8][4];
#pragma unroll
        for (int n = 0; n < FA_KT / 8; n++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float2 v = *reinterpret_cast<const float2*>(ss + (gr + 8 * h) * FD_SS + 8 * n + 2 * c);
                sc[n][2 * h] = v.x;
                sc[n][2 * h + 1] = v.y;
            }
        // From here attention_flash_k's steps exactly, on this warp's
        // output columns.
        float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < FA_KT / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) mt[e / 2] = fmaxf(mt[e / 2], sc[n][e]);
        float al[2];
        fa_softmax_tile(sc, mt, mr, lr, al);
        const u16* va = kb + FA_KT * L::ST + ((lane & 7) + 8 * ((lane >> 3) & 1)) * L::ST + 8 * (lane >> 4) +
                        8 * NW * warp;
        fa_rescale_pv<NW, L::ST>(os, al, sc, va);
        // The buffer just read is the one the next tile but one is copied
        // to, and the scores' rows are rewritten by the next tile.
        __syncthreads();
    }
    fa_quad_sum(lr);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (posr[h] < 0) continue;  // no pair
        i64 at = (pair0 + gr + 8 * h) * nsplit + s;
        if (warp == 0 && c == 0) *reinterpret_cast<float2*>(pml + 2 * at) = make_float2(mr[h], lr[h]);
#pragma unroll
        for (int n = 0; n < NW; n++)
            *reinterpret_cast<float2*>(pacc + at * HD + 8 * (NW * warp + n) + 2 * c) =
                make_float2(os[n][2 * h], os[n][2 * h + 1]);
    }
}

// One sequence's m rows at positions *posp + rbase + r, or (_seqs) a row
// each of m sequences, their caches and positions in the table kvt.
#define FD_KERNEL(name, HD)                                                                                    \
    extern "C" __global__ void __launch_bounds__(FD_W * 32, 1)                                                 \
        name(const float* q, const u64* kt, const u64* vt, float* pml, float* pacc, int m, int hq, int hkv,   \
             const int* posp, int rbase, float sl2, int f16, int nsplit) {                                     \
        pdl_wait();                                                                                            \
        attention_flash_dec_k<HD>(q, OneSeq{*posp + rbase, kt, vt}, pml, pacc, m, hq, hkv, sl2, f16, nsplit); \
    }
#define FD_SEQS_KERNEL(name, HD)                                                                              \
    extern "C" __global__ void __launch_bounds__(FD_W * 32, 1)                                                \
        name(const float* q, const u64* kvt, float* pml, float* pacc, int m, int hq, int hkv, float sl2, int f16, \
             int nsplit) {                                                                                    \
        pdl_wait();                                                                                           \
        attention_flash_dec_k<HD>(q, OfSeqs{kvt, m}, pml, pacc, m, hq, hkv, sl2, f16, nsplit);               \
    }
FD_KERNEL(attention_flash_dec_64, 64)
FD_KERNEL(attention_flash_dec_128, 128)
FD_KERNEL(attention_flash_dec_256, 256)
FD_SEQS_KERNEL(attention_flash_dec_64_seqs, 64)
FD_SEQS_KERNEL(attention_flash_dec_128_seqs, 128)
FD_SEQS_KERNEL(attention_flash_dec_256_seqs, 256)

// The splits of each (row, head) pair folded in order (a block per pair, a
// thread per output dim): fa_fold from split 0, then o / l, as the prefill
// blocks do in registers. Four splits a step with the step's loads issued
// first (a rolled loop waits on memory once a split); the folds are the
// same, split by split in order.
template <typename Rows>
__device__ __forceinline__ void attention_flash_combine_k(const float* pml, const float* pacc, float* o, int hq,
                                                          int hd, Rows rows, int nsplit) {
    int pair = blockIdx.x, t = threadIdx.x;
    int pos = rows.pos(pair / hq);
    if (t >= hd) return;
    const float* ml = pml + (i64)pair * nsplit * 2;
    const float* pa = pacc + (i64)pair * nsplit * hd + t;
    float M = ml[0], L = ml[1], acc = pa[0];
    int ns = pos / FA_SPLIT + 1, s = 1;
    for (; s + 4 <= ns; s += 4) {
        float2 v[4];
        float a[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = *reinterpret_cast<const float2*>(ml + 2 * (s + i));
            a[i] = pa[(i64)(s + i) * hd];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            FaFold f(M, L, v[i].x, v[i].y);
            acc = f.out(acc, a[i]);
        }
    }
    for (; s < ns; s++) {
        FaFold f(M, L, ml[2 * s], ml[2 * s + 1]);
        acc = f.out(acc, pa[(i64)s * hd]);
    }
    o[(i64)pair * hd + t] = __fdiv_rn(acc, L);
}

extern "C" __global__ void attention_flash_combine(const float* pml, const float* pacc, float* o, int hq, int hd,
                                                   const int* posp, int rbase, int nsplit) {
    pdl_wait();
    attention_flash_combine_k(pml, pacc, o, hq, hd, OneSeq{*posp + rbase, nullptr, nullptr}, nsplit);
}

// attention_flash_combine for a row each of m sequences (positions in kvt).
extern "C" __global__ void attention_flash_combine_seqs(const float* pml, const float* pacc, float* o, int hq,
                                                        int hd, const u64* kvt, int m, int nsplit) {
    pdl_wait();
    attention_flash_combine_k(pml, pacc, o, hq, hd, OfSeqs{kvt, m}, nsplit);
}

