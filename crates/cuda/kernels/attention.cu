// The sequence position (`pos0` of the kernels below) is read from device
// memory, so a recorded decode step (a CUDA graph) replays at any position.

// The rotary embedding: base, and the context scaling (the engine's `Rope`:
// freq_scale 1 for none; ext_factor 0 for linear, 1 for YaRN's ramp from
// pair corr_lo to corr_hi; mscale on cos and sin).
struct RopeP {
    float theta, freq_scale, ext_factor, corr_lo, corr_hi, mscale;
};

// NeoX RoPE of pair (i, i + n_rot / 2) of one head at position `pos`.
__device__ __forceinline__ void rope_pair(float* head, int i, int n_rot, RopeP rp, int pos) {
    int half = n_rot / 2;
    float inv_freq = 1.0f / powf(rp.theta, (float)(2 * i) / (float)n_rot);
    if (rp.freq_scale != 1.0f) {
        float interp = inv_freq * rp.freq_scale;
        if (rp.ext_factor != 0.0f) {
            float y = ((float)i - rp.corr_lo) / fmaxf(0.001f, rp.corr_hi - rp.corr_lo);
            float mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * rp.ext_factor;
            inv_freq = interp * (1.0f - mix) + inv_freq * mix;
        } else {
            inv_freq = interp;
        }
    }
    float ang = (float)pos * inv_freq;
    float sn, cs;
    sincosf(ang, &sn, &cs);
    sn *= rp.mscale;
    cs *= rp.mscale;
    float a = head[i], b = head[i + half];
    head[i] = a * cs - b * sn;
    head[i + half] = b * cs + a * sn;
}

// An attention layer's head norms, RoPE and KV write in one launch, for
// every m: a warp per (row, head), the q heads of all rows, then the k heads.
// Each head (dim up to 256) is normed as rms_norm_small does
// (norm_small_row) into the warp's shared row, roped there pair by pair
// (rope_pair) at position pos0 + r, then stored: q heads to `q` (m x hq x
// hd), k heads to the cache (f32, or halves with `f16`) at position pos0 + r
// with the same head of v. q is read in place from the projection's rows
// (`q_row` floats a row, `q_head` floats between heads: the gated projection
// interleaves q and gate heads).
// The KV cache of one layer and sequence is paged: blocks of KV_BLOCK
// positions (the engine's `state::KV_BLOCK`), block b's key rows at kt[b]
// and its value rows at vt[b] (the block tables), each row kvw values of
// `el` bytes. A block is allocated when the sequence first reaches it and
// may be shared with other sequences (a forked prefix) until written.
// kv_block_base(t, j, ..) is the address of block j / KV_BLOCK less the
// rows before it, so that position j' of that block sits at row j' from it
// as in one contiguous cache: a tile within one block indexes its keys by
// position, as before paging.
#define KV_BLOCK 256
__device__ __forceinline__ const void* kv_block_base(const u64* t, int j, int kvw, int el) {
    int b = j / KV_BLOCK;
    return (const void*)(t[b] - (u64)b * KV_BLOCK * (u64)kvw * (u64)el);
}

// Where a row's position and cache are: one sequence's rows at pos0, pos0 +
// 1, ... in one cache, or (OfSeqs) each row a sequence of its own, its
// cache's block tables and position in a table (kvt: m key tables, m value
// tables, m positions).
struct OneSeq {
    int pos0;
    const u64* kt;
    const u64* vt;
    __device__ __forceinline__ int pos(int r) const { return pos0 + r; }
    __device__ __forceinline__ const u64* k(int) const { return kt; }
    __device__ __forceinline__ const u64* v(int) const { return vt; }
};
struct OfSeqs {
    const u64* kvt;
    int m;
    __device__ __forceinline__ int pos(int r) const { return (int)kvt[2 * m + r]; }
    __device__ __forceinline__ const u64* k(int r) const { return (const u64*)kvt[r]; }
    __device__ __forceinline__ const u64* v(int r) const { return (const u64*)kvt[m + r]; }
};

template <typename Rows>
__device__ __forceinline__ void qk_norm_rope_kv_k(const float* qsrc, int q_row, int q_head, const float* k,
                                                  const float* v, const float* qnw, const float* knw, float* q,
                                                  Rows rows, int m, int hq, int hkv, int hd, int n_rot, RopeP rp,
                                                  float eps, int f16) {
    __shared__ float rowbuf[8][256];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    i64 g = (i64)blockIdx.x * 8 + warp;
    if (g >= (i64)m * (hq + hkv)) return;
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
    int pos = rows.pos(r);
    __syncwarp();
    for (int i = lane; i < n_rot / 2; i += 32) rope_pair(sr, i, n_rot, rp, pos);
    __syncwarp();
    if (isq) {
        float* qo = q + ((i64)r * hq + h) * hd;
        for (int i = lane; i < hd; i += 32) qo[i] = sr[i];
        return;
    }
    int kvw = hkv * hd;
    i64 at = (i64)pos * kvw + (i64)h * hd;
    const float* vr = v + (i64)r * kvw + (i64)h * hd;
    int el = f16 ? 2 : 4;
    void* ck = (void*)kv_block_base(rows.k(r), pos, kvw, el);
    void* cv = (void*)kv_block_base(rows.v(r), pos, kvw, el);
    for (int i = lane; i < hd; i += 32) {
        if (f16) {
            ((u16*)ck)[at + i] = f32_to_f16_kv(sr[i]);
            ((u16*)cv)[at + i] = f32_to_f16_kv(vr[i]);
        } else {
            ((float*)ck)[at + i] = sr[i];
            ((float*)cv)[at + i] = vr[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    qk_norm_rope_kv(const float* qsrc, int q_row, int q_head, const float* k, const float* v, const float* qnw,
                    const float* knw, float* q, const u64* kt, const u64* vt, const int* posp, int m, int hq, int hkv,
                    int hd, int n_rot, RopeP rp, float eps, int f16) {
    pdl_wait();
    qk_norm_rope_kv_k(qsrc, q_row, q_head, k, v, qnw, knw, q, OneSeq{*posp, kt, vt}, m, hq, hkv, hd, n_rot, rp,
                      eps, f16);
}

// qk_norm_rope_kv for m rows of m sequences (a decode step of several): row
// r at its sequence's position into its sequence's cache (OfSeqs).
extern "C" __global__ void __launch_bounds__(256)
    qk_norm_rope_kv_seqs(const float* qsrc, int q_row, int q_head, const float* k, const float* v,
                         const float* qnw, const float* knw, float* q, const u64* kvt, int m, int hq, int hkv,
                         int hd, int n_rot, RopeP rp, float eps, int f16) {
    pdl_wait();
    qk_norm_rope_kv_k(qsrc, q_row, q_head, k, v, qnw, knw, q, OfSeqs{kvt, m}, m, hq, hkv, hd, n_rot, rp, eps,
                      f16);
}

__device__ __forceinline__ float kv_at(const void* c, i64 i, int f16) {
    return f16 ? f16_to_f32(((const u16*)c)[i]) : ((const float*)c)[i];
}

#define ATT_THREADS 256
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_T 256  // keys per tile: tile b holds positions [256 b, 256 b + 256)
static_assert(ATT_T == KV_BLOCK, "a key tile is one block of the paged cache");
#define AP 16      // (row, head) pairs per block
#define ATT_HD 256 // largest head dim
#define ATT_KB 2   // keys a step in the score pass for head dims over 128
static_assert(ATT_T % (ATT_WARPS * ATT_KB) == 0, "a score step's keys lie in one tile");

// The value pass of attention_tiles for one thread: output dim t % hdp of
// pairs t / hdp, t / hdp + G, ... (AP / G of them); each (pair, dim) is the
// fma chain over the tile's keys in order, up to the pair's own position.
template <int G>
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
    int n = jend - j0, jj = 0, full = n;
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

// The score pass of attention_tiles for one warp: keys warp, warp + 8, ...
// of the tile. Lane l holds dims l, l + 32, ... (NC chunks of 32) and runs the
// 16 pairs' fma chains over them (register r of lane l for pair r ^
// qs_mask(l), q stored to match); the butterfly then runs for all 16 pairs at
// once: at step o every lane keeps half of its pairs and adds the partner's
// (lane ^ o) partial of the same pair, which is the one-pair butterfly's own +
// partner add; lane l ends with pair l / 2. With REG (head dims up to 64)
// each lane keeps its q values in registers; otherwise it reads them from
// shared memory, and takes KB keys a step (warp, warp + 8, ...: each q value
// read once for all of them, the keys' loads in flight together). The same
// terms in the same order either way, and the running max over the warp's
// keys in the same order. Returns the lane's running max (pair l / 2), writes
// the scaled scores to st (-inf past a pair's last key).
template <int NC, int KB, bool REG>
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
        if constexpr (REG || NC < 8) {
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
            float s = pair_butterfly(d[u]);
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

// The softmax pieces of a tile for pairs 0..np-1: a pair's max over the
// warps' maxes, e = exp(s - max) in place (thread t owning slot t of every
// pair; exp(-inf) = 0 in the slots past the pair's keys), and each warp's sum
// of its slots by a butterfly. `st` holds a pair's slots `sst` floats apart.
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
// attention_tiles_q4w runs this code for head dims other than 128 and 256;
// attention_tiles runs it for every head dim, the reference the lean code
// (below) gives the bytes of.
__device__ __forceinline__ void attention_tiles_k(const float* q, const u64* kt, const u64* vt, float* pml,
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
        qs[qs_row(p, d)][hd > 128 ? qs_col(d) : d] = v;
    }
    __syncthreads();
    // Scores, one warp per key (tile_scores); q in registers for head dims
    // up to 64, read from shared memory for larger ones (four keys a step up
    // to 128, ATT_KB above).
    int mine = lane >> 1;
    float mx;
    int last = pos0 + r0 + mine / gs;
    // The tile is block b of the paged cache: its keys' and values'
    // addresses, found where each pass starts (short live ranges).
    const void* ck = kv_block_base(kt, j0, kvw, f16 ? 2 : 4);
    if (hd <= 32) mx = tile_scores<1, 1, true>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    else if (hd <= 64) mx = tile_scores<2, 1, true>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    else if (hd <= 128) mx = tile_scores<4, 4, false>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    else mx = tile_scores<8, ATT_KB, false>(qs, st, ck, kvw, g, hd, last, j0, jend, np, scale, f16);
    if ((lane & 1) == 0) smax[mine][warp] = mx;
    __syncthreads();
    tile_softmax(&st[0][0], ATT_T, smax, wsum, pmax, np);
    __syncthreads();
    // Values: keys in order for each (pair, dim). Head dims below 256 split
    // the pairs over G groups of threads (pair p to group p % G), so every
    // thread works; each (pair, dim) is one thread's fma chain.
    int hdp = (hd + 31) / 32 * 32;
    const void* cv = kv_block_base(vt, j0, kvw, f16 ? 2 : 4);
    switch (ATT_THREADS % hdp == 0 ? ATT_THREADS / hdp : 1) {
    case 8: tile_values<8>(cv, st, pacc, hdp, kvw, np, gs, g, hq, hd, r0, pos0, j0, jend, b, nb, f16); break;
    case 4: tile_values<4>(cv, st, pacc, hdp, kvw, np, gs, g, hq, hd, r0, pos0, j0, jend, b, nb, f16); break;
    case 2: tile_values<2>(cv, st, pacc, hdp, kvw, np, gs, g, hq, hd, r0, pos0, j0, jend, b, nb, f16); break;
    default: tile_values<1>(cv, st, pacc, hdp, kvw, np, gs, g, hq, hd, r0, pos0, j0, jend, b, nb, f16); break;
    }
    tile_write_pml(wsum, pmax, pml, np, gs, hq, g, r0, pos0, j0, b, nb);
}

// The reference kernel: attention_tiles_k at every head dim. Only the tests
// launch it (Cuda::attention_host), to show the default kernels give its
// bytes.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles(const float* q, const u64* kt, const u64* vt, float* pml, float* pacc, int m, int hq,
                    int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_tiles_k(q, kt, vt, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

// ---- attention_tiles_q4w and _q4w2: attention_tiles_k's arithmetic in lean code
//
// The same scores, softmax, value sums and partials as attention_tiles_k,
// term for term and in the same order (GPU test
// `attention_at_the_real_models_head_shapes` compares the bytes with
// attention_tiles'), with less work around the fmas (under ncu the plain
// kernel issued ~3 instructions per fma):
// * the cache's element type fixed per instantiation (f32 or f16), not
//   tested per load;
// * K and V rows addressed from the tile's base with 32-bit offsets and no
//   bound check on score steps whose keys all lie in the tile;
// * each pair's row, key count and output index computed once a block
//   (shared memory) instead of divided out per element;
// * the softmax's per-pair max taken once (thread p), its score rows 4
//   floats longer (the score stores of a key fall on 8 banks, not one), and
//   warps past the tile's keys skipped;
// * the value pass's loads 8 or 4 keys ahead, each thread taking four
//   consecutive dims of several pairs (wide_values).
// Head dims of 128 and 256 take these passes; others run attention_tiles_k's.
#define ATT_S (ATT_T + 4)  // score row stride of the lean kernel

__device__ __forceinline__ float kv_ld(const float* p) { return *p; }
__device__ __forceinline__ float kv_ld(const u16* p) { return f16_to_f32(*p); }

// The score pass of attention_tiles_k for head dims 128 (NC = 4, KB = 4,
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

// Four consecutive values of a cache row as floats (16-byte aligned for f32,
// 8-byte for f16).
__device__ __forceinline__ float4 kv_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 kv_ld4(const u16* p) {
    uint2 h = *reinterpret_cast<const uint2*>(p);
    return make_float4(f16_to_f32((u16)(h.x & 0xffff)), f16_to_f32((u16)(h.x >> 16)), f16_to_f32((u16)(h.y & 0xffff)),
                       f16_to_f32((u16)(h.y >> 16)));
}

// One key's fma into one pair's 4 dims (wide_values).
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

// The value pass of attention_tiles_k (tile_values) with a thread per four
// consecutive dims and P consecutive pairs: thread t takes dims 4 (t % (hd /
// 4)) .. + 3 of pairs P (t / (hd / 4)) .. + P - 1, P = NP / (ATT_THREADS /
// (hd / 4)) (2 at head dim 128, 4 at 256 for 16 pairs a block; twice that
// for 32), so one float4 of a value row serves 4 P fmas and one float4 of a
// pair's scores 16. Each (pair, dim) is the same fma chain over the tile's
// keys in order as tile_values.
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

// H: halves of AP pairs a block (H = 2, attention_tiles_q4w2: its q and
// score rows live in ATT_P32_SMEM bytes of dynamic shared memory).
template <typename T, int H = 1>
__device__ __forceinline__ void attention_lean_k(const float* q, const u64* kt, const u64* vt, float* pml, float* pacc,
                                                 int m, int hq, int hkv, int hd, const int* posp, int rbase,
                                                 float scale, int nb) {
    static_assert(H == 1 || H == 2, "one or two halves of AP pairs");
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
    // stored, so the block waits on memory once, not once a pair (under
    // ncu, the loop storing each value as it came took 17% of
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
    const T* ck = (const T*)kv_block_base(kt, j0, kvw, sizeof(T));
    if (hd == 128) lean_scores_h<4, 4, H>(qs, st, ck + tile0, kvw, mylast, n, nph, scale, mx);
    else lean_scores_h<8, ATT_KB, H>(qs, st, ck + tile0, kvw, mylast, n, nph, scale, mx);
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
    const T* cv = (const T*)kv_block_base(vt, j0, kvw, sizeof(T));
    if (H == 2 && hd == 128) wide_values<4, 8>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    else if (H == 2) wide_values<8, 4>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    else if (hd == 128) wide_values<2, 8>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    else wide_values<4, 4>(cv + tile0, st, pacc, kvw, hd, pcnt, pout, n, b, nb);
    if (t < np && pcnt[t] > 0) {
        float l = warp_sum_tree(wsum[t]);
        pml[((i64)pout[t] * nb + b) * 2] = pmax[t];
        pml[((i64)pout[t] * nb + b) * 2 + 1] = l;
    }
}

// The 16-pair kernel's entry: head dims 128 and 256 (the real models') in
// lean code, others in attention_tiles_k's code.
__device__ __forceinline__ void attention_lean_entry(const float* q, const u64* kt, const u64* vt, float* pml,
                                                     float* pacc, int m, int hq, int hkv, int hd, const int* posp,
                                                     int rbase, float scale, int f16, int nb) {
    if (hd != 128 && hd != 256)
        attention_tiles_k(q, kt, vt, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
    else if (f16)
        attention_lean_k<u16>(q, kt, vt, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, nb);
    else
        attention_lean_k<float>(q, kt, vt, pml, pacc, m, hq, hkv, hd, posp, rbase,
                                scale, nb);
}

// Attention at 16 pairs a block: calls of up to 16 pairs (decode) and the
// shapes attention_tiles_q4w2 does not take. Head dims 128 and 256 in lean
// code, each thread of the value pass taking four consecutive dims of 2
// (head dim 128, 8 keys a step) or 4 (256, 4 keys a step) pairs
// (wide_values); other head dims in attention_tiles_k's code. The same
// terms in the same order: the same bytes as attention_tiles. Measured on
// the H200 at pp4096: the lean code 490 -> 419 ms of attention (qwen3moe),
// 82.4 -> 70.4 ms (qwen35moe) against attention_tiles_k, and its wide
// value pass 70.5 -> 63.8 ms (qwen35moe, head dim 256; no change at 128)
// against a thread a dim.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_q4w(const float* q, const u64* kt, const u64* vt, float* pml, float* pacc, int m, int hq,
                        int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    attention_lean_entry(q, kt, vt, pml, pacc, m, hq, hkv, hd, posp, rbase, scale, f16, nb);
}

// ---- 32 pairs a block
//
// attention_tiles_q4w with two 16-pair halves a block (4 rows at 8 query
// heads a KV head): each key row of the tile is loaded once for both halves
// in the score pass and each value row once for all 32 pairs in the value
// pass, so a prefill reads the cache from L2 half as often per pair. Every
// pair's score (its fma chains and butterfly, lean_scores_h's), max, exps,
// sums and value chains are the 16-pair kernel's, so the same bytes
// (attention_lean_k with H = 2). q and the scores live in dynamic shared
// memory (ATT_P32_SMEM bytes; backend/attention.rs sizes the launch alike).
#define ATT_P32_SMEM (2 * AP * (ATT_HD + ATT_S) * 4)

// attention_tiles_q4w at 32 pairs a block, for calls of more than 16 pairs:
// head dims 128 and 256 with query groups dividing 16 (the launcher
// checks); ATT_P32_SMEM bytes of dynamic shared memory. The same bytes.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attention_tiles_q4w2(const float* q, const u64* kt, const u64* vt, float* pml, float* pacc, int m, int hq,
                         int hkv, int hd, const int* posp, int rbase, float scale, int f16, int nb) {
    pdl_wait();
    if (f16)
        attention_lean_k<u16, 2>(q, kt, vt, pml, pacc, m, hq, hkv, hd, posp, rbase,
                                 scale, nb);
    else
        attention_lean_k<float, 2>(q, kt, vt, pml, pacc, m, hq, hkv, hd, posp,
                                   rbase, scale, nb);
}

// Output dim t of pair `pair` (of `tiles` key tiles): the tiles folded in
// order (see attention_tiles). Both loops take four tiles a step with the
// step's loads issued first (under ncu the rolled loops waited on one load a
// tile, 8.7 of ~15 cycles an instruction on long scoreboard); the folds are
// the same, tile by tile in order.
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

// The tiles of each (row, head) pair folded in tile order: a block per pair,
// a thread per output dim.
__device__ __forceinline__ void attention_combine_k(const float* pml, const float* pacc, float* o, int m, int hq,
                                                    int hd, const int* posp, int rbase, int nb) {
    int pos0 = *posp + rbase;
    int pair = blockIdx.x, t = threadIdx.x;
    int r = pair / hq;
    int tiles = (pos0 + r + 1 + ATT_T - 1) / ATT_T;
    if (t < hd) {
        float v = combine_dim(pml, pacc, pair, t, hd, tiles, nb);
        o[(i64)pair * hd + t] = v;
    }
}

// attention_combine that also writes the rows' Q8_K blocks for the out
// projection (hq * hd a multiple of 256): block (x, r) makes
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
    attention_combine_k(pml, pacc, o, m, hq, hd, posp, rbase, nb);
}
