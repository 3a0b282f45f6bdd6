// Router rows, one warp per row: softmax (max; exp; the sum with lane l over
// entries l, l + 32, ... then a fixed butterfly; divide), the top k (largest
// first, lowest id among equals: k rounds of an exact warp argmax), weights
// renormalized by their sum in k order clamped at 2^-14.
// One row's routing with the row's logits in registers (U per lane, U * 32 >=
// e): lane l holds entries l, l + 32, ... and every pass (max, exp and sum,
// divide, each argmax round) walks them in that order, as a loop over memory
// would; the softmaxed row is also stored back.
template <int U>
__device__ __forceinline__ void softmax_row_u(float* p, float* v, int e, int lane) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        int i = lane + 32 * u;
        v[u] = i < e ? p[i] : 0.0f;
    }
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (lane + 32 * u < e) mx = fmaxf(mx, v[u]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (lane + 32 * u < e) {
            v[u] = expf(v[u] - mx);
            sum = sum + v[u];
        }
    for (int o = 16; o > 0; o /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
    for (int u = 0; u < U; u++) {
        int i = lane + 32 * u;
        if (i < e) {
            v[u] = v[u] / sum;
            p[i] = v[u];
        }
    }
}

// A round's pick as every argmax path records it: lane 0 stores the id (and
// in sids, when given), the value is kept for the weights, and added to the
// running sum in round order.
__device__ __forceinline__ void record_pick(int* ids, int* sids, int r, int k, int s, int lane, int best, float bv,
                                            float& keep0, float& keep1, float& tot) {
    if (lane == 0) {
        ids[(i64)r * k + s] = best;
        if (sids) sids[r * k + s] = best;
    }
    keep_pick(keep0, keep1, s, lane, bv);
    tot = tot + bv;
}

// "a before b" in the argmax rounds' order: larger value first, lower id
// among equals; an absent entry (id -1) after every present one.
__device__ __forceinline__ bool pick_before(float av, int ai, float bv, int bi) {
    if (bi < 0) return ai >= 0;
    if (ai < 0) return false;
    return av > bv || (av == bv && ai < bi);
}

// Entries a and b of the parallel arrays v and id exchanged.
__device__ __forceinline__ void swap_entries(float* v, int* id, int a, int b) {
    float tv = v[a];
    v[a] = v[b];
    v[b] = tv;
    int ti = id[a];
    id[a] = id[b];
    id[b] = ti;
}

__device__ __forceinline__ void pick_cas(float* v, int* id, int a, int b) {
    if (pick_before(v[b], id[b], v[a], id[a])) swap_entries(v, id, a, b);
}

// Batcher's odd-even merge sort of a lane's U entries (U = 4 or 8) into
// pick_before order, written out so every index is a constant and the
// entries stay in registers (its loop form was left rolled, with the entries
// in local memory, where route_plan_small inlines it); the networks are
// checked on every 0/1 input by a host test (backend/moe.rs, topk_tests).
template <int U>
__device__ __forceinline__ void sort_picks(float* v, int* id) {
    static_assert(U == 4 || U == 8, "networks for 4 and 8 entries");
    if (U == 4) {
        pick_cas(v, id, 0, 1);
        pick_cas(v, id, 2, 3);
        pick_cas(v, id, 0, 2);
        pick_cas(v, id, 1, 3);
        pick_cas(v, id, 1, 2);
    } else {
        pick_cas(v, id, 0, 1);
        pick_cas(v, id, 2, 3);
        pick_cas(v, id, 4, 5);
        pick_cas(v, id, 6, 7);
        pick_cas(v, id, 0, 2);
        pick_cas(v, id, 1, 3);
        pick_cas(v, id, 4, 6);
        pick_cas(v, id, 5, 7);
        pick_cas(v, id, 1, 2);
        pick_cas(v, id, 5, 6);
        pick_cas(v, id, 0, 4);
        pick_cas(v, id, 1, 5);
        pick_cas(v, id, 2, 6);
        pick_cas(v, id, 3, 7);
        pick_cas(v, id, 2, 4);
        pick_cas(v, id, 3, 5);
        pick_cas(v, id, 1, 2);
        pick_cas(v, id, 3, 4);
        pick_cas(v, id, 5, 6);
    }
}

template <int U>
__device__ __forceinline__ void topk_row_u(const float* v, const float* p, int* ids, float* wts, int r, int e,
                                           int k, int lane, int* sids = nullptr) {
    __syncwarp();
    float tot = 0.0f, keep0 = 0.0f, keep1 = 0.0f;
    bool nan = false;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (lane + 32 * u < e) nan |= v[u] != v[u];
    if ((U == 4 || U == 8) && !__any_sync(0xffffffffu, nan)) {
        // Each lane's entries sorted once in the rounds' order: a lane's best
        // entry not yet taken is always its first left (a lane loses only
        // the entry that won a round), so each round is one warp argmax over
        // the lanes' first entries, then the winner drops its first. The
        // same picks in the same order as the rounds below, which a row
        // holding a NaN (where comparisons do not order) still takes.
        float sv[U];
        int si[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = lane + 32 * u;
            sv[u] = i < e ? v[u] : 0.0f;
            si[u] = i < e ? i : -1;
        }
        sort_picks<(U == 4 || U == 8) ? U : 8>(sv, si);
        int h = 0;  // the lane's entries before h are taken
#pragma unroll 1
        for (int s = 0; s < k; s++) {
            // Entry h, picked by compares with constants (an index into the
            // arrays would put them in local memory).
            int best = -1;
            float bv = 0.0f;
#pragma unroll
            for (int u = 0; u < U; u++)
                if (h == u) {
                    best = si[u];
                    bv = best >= 0 ? sv[u] : 0.0f;
                }
            warp_argmax(bv, best);
            if (best >= 0 && (best & 31) == lane) h++;
            record_pick(ids, sids, r, k, s, lane, best, bv, keep0, keep1, tot);
        }
        finish_weights(p, ids, wts, r, k, lane, keep0, keep1, tot);
        return;
    }
    unsigned long long taken = 0;  // bit u: entry lane + 32u chosen (e <= 2048)
    for (int s = 0; s < k; s++) {
        int best = -1;
        float bv = 0.0f;
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = lane + 32 * u;
            if (i >= e || ((taken >> u) & 1ull)) continue;
            if (best < 0 || v[u] > bv) {
                best = i;
                bv = v[u];
            }
        }
        warp_argmax(bv, best);
        if ((best & 31) == lane) taken |= 1ull << (best / 32);
        record_pick(ids, sids, r, k, s, lane, best, bv, keep0, keep1, tot);
    }
    finish_weights(p, ids, wts, r, k, lane, keep0, keep1, tot);
}

template <int U>
__device__ __forceinline__ void route_row_u(float* logits, int* ids, float* wts, int r, int e, int k, int lane,
                                            int* sids) {
    float* p = logits + (i64)r * e;
    float v[U];
    softmax_row_u<U>(p, v, e, lane);
    topk_row_u<U>(v, p, ids, wts, r, e, k, lane, sids);
}

// One row's routing by a whole 256-thread block (decode: one row, where a
// lone warp's k argmax rounds were the kernel's critical path). Warp 0
// computes the softmax exactly as route_row_u and copies it to shared
// memory; then every entry's rank in the order "larger value first, lower id
// among equals" is counted by its own thread, and the entry of rank s is the
// s-th pick of the argmax rounds (the same ids in the same order; the weights
// are the same values over the same k-order sum). A row holding a NaN (where
// comparisons do not order) takes warp 0's argmax rounds instead, so the
// result is route_row's for every input. Needs e <= 1024 and k <= 64.
#define RB_MAX_E 1024
template <int U>
__device__ void route_row_block_u(float* logits, int* ids, float* wts, int r, int e, int k, float* sp, int* sid,
                                  float* sv, int* flag) {
    int t = threadIdx.x, warp = t / 32, lane = t % 32;
    float* p = logits + (i64)r * e;
    float v[U];
    if (warp == 0) {
        softmax_row_u<U>(p, v, e, lane);
        bool nan = false;
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = lane + 32 * u;
            if (i < e) {
                sp[i] = v[u];
                nan |= v[u] != v[u];
            }
        }
        nan = __any_sync(0xffffffffu, nan);
        if (lane == 0) *flag = nan;
    }
    __syncthreads();
    if (*flag) {
        if (warp == 0) topk_row_u<U>(v, p, ids, wts, r, e, k, lane);
        __syncthreads();
        return;
    }
    for (int i = t; i < e; i += blockDim.x) {
        float x = sp[i];
        int rank = 0;
        for (int j = 0; j < i; j++) rank += sp[j] >= x;  // equal and lower id: ahead
        for (int j = i + 1; j < e; j++) rank += sp[j] > x;
        if (rank < k) {
            sid[rank] = i;
            sv[rank] = x;
        }
    }
    __syncthreads();
    if (t == 0) {
        float tot = 0.0f;
        for (int s2 = 0; s2 < k; s2++) tot = tot + sv[s2];
        sp[0] = fmaxf(tot, 6.103515625e-5f);  // sp is free again
    }
    __syncthreads();
    if (t < k) {
        ids[(i64)r * k + t] = sid[t];
        wts[(i64)r * k + t] = sv[t] / sp[0];
    }
    __syncthreads();
}

// The same through memory, for more than 1,024 experts.
__device__ __forceinline__ void route_row_mem(float* logits, int* ids, float* wts, int r, int e, int k, int lane,
                                              int* sids) {
    float* p = logits + (i64)r * e;
    float mx = -INFINITY;
    for (int i = lane; i < e; i += 32) mx = fmaxf(mx, p[i]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int i = lane; i < e; i += 32) {
        float v = expf(p[i] - mx);
        p[i] = v;
        sum = sum + v;
    }
    for (int o = 16; o > 0; o /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, o);
    for (int i = lane; i < e; i += 32) p[i] = p[i] / sum;
    __syncwarp();
    unsigned long long taken = 0;  // bit u: entry lane + 32u chosen (e <= 2048)
    float tot = 0.0f, keep0 = 0.0f, keep1 = 0.0f;
    for (int s = 0; s < k; s++) {
        int best = -1;
        float bv = 0.0f;
        for (int u = 0, i = lane; i < e; u++, i += 32) {
            if ((taken >> u) & 1ull) continue;
            float v = p[i];
            if (best < 0 || v > bv) {
                best = i;
                bv = v;
            }
        }
        warp_argmax(bv, best);
        if ((best & 31) == lane) taken |= 1ull << (best / 32);
        record_pick(ids, sids, r, k, s, lane, best, bv, keep0, keep1, tot);
    }
    finish_weights(p, ids, wts, r, k, lane, keep0, keep1, tot);
}

// Routing of row r: softmax (max; exp; the sum with lane l over entries l,
// l + 32, ... then a fixed butterfly; divide), the top k (largest first,
// lowest id among equals: k rounds of an exact warp argmax), weights
// renormalized by their sum in k order clamped at 2^-14 (e <= 2048).
__device__ __forceinline__ void route_row(float* logits, int* ids, float* wts, int r, int e, int k, int lane,
                                          int* sids = nullptr) {
    int n = (e + 31) / 32;
    if (n <= 4)
        route_row_u<4>(logits, ids, wts, r, e, k, lane, sids);
    else if (n <= 8)
        route_row_u<8>(logits, ids, wts, r, e, k, lane, sids);
    else if (n <= 16)
        route_row_u<16>(logits, ids, wts, r, e, k, lane, sids);
    else if (n <= 32)
        route_row_u<32>(logits, ids, wts, r, e, k, lane, sids);
    else
        route_row_mem(logits, ids, wts, r, e, k, lane, sids);
}

extern "C" __global__ void route(float* logits, int* ids, float* wts, int m, int e, int k) {
    pdl_wait();
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= m) return;
    route_row(logits, ids, wts, r, e, k, lane);
}

// The expert plan of wide calls, two deterministic kernels.
// 1. Histogram of the (token, slot) pairs per expert (integer atomics: the
//    counts do not depend on their order); counts must be zeroed first. Also
//    marks every placed row unused (-1) up to `cap`, for the placement.
extern "C" __global__ void plan_count(const int* ids, int n, int* counts, int* placed_row, int* placed_mat,
                                      int cap) {
    pdl_wait();
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < cap) {
        placed_row[p] = -1;
        placed_mat[p] = -1;
    }
    if (p >= n) return;
    int e = ids[p];
    if (e >= 0) atomicAdd(&counts[e], 1);
}

// 2. Placement, one block of 256 threads per expert. The block first sums
//    the padded counts (each rounded up to a multiple of `pad`, the
//    matmul's row tile) of the experts below its own: its offset (an
//    integer sum, the same whatever the order). It then places its pairs in
//    passes of 256 x PW_RUN: thread t takes the PW_RUN consecutive pairs
//    from base + t PW_RUN (their ids in 16-byte loads where the run is whole
//    and aligned), and its hits go, in pair order, after the hits of the
//    threads before it (a warp scan of the counts, then the warps' totals).
//    So pair p of expert e lands at offsets[e] + (pairs before p with expert
//    e), with two block barriers a pass. Writes the placed pair's token row,
//    its expert, and each pair's place (-1 for skipped ids, by block 0).
//    plan_count has filled placed_row and placed_mat with -1.
#define PW_RUN 32
extern "C" __global__ void __launch_bounds__(256)
    plan_place_wide(const int* ids, int n, int k, const int* counts, int pad, int* placed_row, int* placed_mat,
                    int* slot) {
    pdl_wait();
    __shared__ int wsum[8];
    int e = blockIdx.x, t = threadIdx.x, lane = t % 32, warp = t / 32;
    int off = 0;
    for (int j = t; j < e; j += 256) off += (counts[j] + pad - 1) / pad * pad;
    for (int o = 16; o > 0; o /= 2) off += __shfl_xor_sync(0xffffffffu, off, o);
    if (lane == 0) wsum[warp] = off;
    __syncthreads();
    off = 0;
    for (int w = 0; w < 8; w++) off += wsum[w];
    __syncthreads();
    int carry = 0;
    for (int base = 0; base < n; base += 256 * PW_RUN) {
        int p0 = base + t * PW_RUN;
        int v[PW_RUN];
        if (p0 + PW_RUN <= n && ((unsigned long long)(ids + p0) & 15ull) == 0) {
#pragma unroll
            for (int q = 0; q < PW_RUN / 4; q++) {
                int4 x = reinterpret_cast<const int4*>(ids + p0)[q];
                v[4 * q] = x.x;
                v[4 * q + 1] = x.y;
                v[4 * q + 2] = x.z;
                v[4 * q + 3] = x.w;
            }
        } else {
#pragma unroll
            for (int q = 0; q < PW_RUN; q++) v[q] = p0 + q < n ? ids[p0 + q] : -2;
        }
        unsigned hits = 0;  // bit q: pair p0 + q is expert e's
#pragma unroll
        for (int q = 0; q < PW_RUN; q++) {
            if (v[q] == e) hits |= 1u << q;
            if (e == 0 && p0 + q < n && v[q] < 0) slot[p0 + q] = -1;
        }
        int c = __popc(hits), inc = c;
        for (int o = 1; o < 32; o *= 2) {
            int y = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += y;
        }
        if (lane == 31) wsum[warp] = inc;
        __syncthreads();
        int before = carry + inc - c, total = 0;
        for (int w = 0; w < 8; w++) {
            if (w < warp) before += wsum[w];
            total += wsum[w];
        }
        while (hits) {
            int q = __ffs(hits) - 1;
            hits &= hits - 1u;
            int p = p0 + q, dst = off + before++;
            placed_row[dst] = p / k;
            placed_mat[dst] = e;
            slot[p] = dst;
        }
        carry += total;
        __syncthreads();
    }
}

// The whole plan by one block for small calls (n <= 256 pairs, e <= 2048
// experts; decode is n = k): the counts zeroed, then what plan_count and
// plan_place_wide do, with the same results: every expert's padded count,
// their exclusive scan as offsets (an
// integer sum: the same whatever the order), and pair p of expert e placed
// at offsets[e] + (pairs before p with expert e). Unused places stay -1.
#define PLAN_SMALL_PAIRS 256
#define PLAN_SMALL_EXPERTS 2048
//
// With `pre` (shared memory, already holding the n ids: route_plan_small),
// the ids are read from there instead of from global memory.
__device__ __forceinline__ void plan_small_block(const int* ids, int n, int k, int e, int pad, int* placed_row,
                                                 int* placed_mat, int* slot, int cap,
                                                 const int* pre = nullptr) {
    __shared__ int sid[PLAN_SMALL_PAIRS];
    __shared__ int cnt[PLAN_SMALL_EXPERTS];  // counts, then offsets
    __shared__ int part[256];
    int t = threadIdx.x;
    for (int i = t; i < cap; i += 256) {
        placed_row[i] = -1;
        placed_mat[i] = -1;
    }
    for (int i = t; i < e; i += 256) cnt[i] = 0;
    if (t < n) sid[t] = pre ? pre[t] : ids[t];
    __syncthreads();
    if (t < n && sid[t] >= 0) atomicAdd(&cnt[sid[t]], 1);
    __syncthreads();
    // Thread t owns experts [lo, hi): their padded counts' sum, an inclusive
    // scan of those sums over the threads, then each expert's offset.
    int per = (e + 255) / 256;
    int lo = min(t * per, e), hi = min(lo + per, e);
    int mine = 0;
    for (int i = lo; i < hi; i++) mine += (cnt[i] + pad - 1) / pad * pad;
    part[t] = mine;
    __syncthreads();
    for (int o = 1; o < 256; o *= 2) {
        int add = t >= o ? part[t - o] : 0;
        __syncthreads();
        part[t] += add;
        __syncthreads();
    }
    int run = part[t] - mine;
    for (int i = lo; i < hi; i++) {
        int v = (cnt[i] + pad - 1) / pad * pad;
        cnt[i] = run;
        run += v;
    }
    __syncthreads();
    if (t < n) {
        int id = sid[t];
        if (id < 0) {
            slot[t] = -1;
        } else {
            int before = 0;
            for (int q = 0; q < t; q++) before += sid[q] == id;
            int dst = cnt[id] + before;
            placed_row[dst] = t / k;
            placed_mat[dst] = id;
            slot[t] = dst;
        }
    }
}

// Decode-sized routing and plan in one launch of one 256-thread block: up to
// `block_rows` rows are routed one at a time by the whole block
// (route_row_block_u); one row (with k <= 32) by warp 0 alone, which also
// plans it (plan_warp); more by warp w taking rows w, w + 8, ...; every way
// exactly as `route` does; then (after a block barrier, which makes the ids
// visible to the block) the block plans them (plan_small_block).
extern "C" __global__ void __launch_bounds__(256, 1)
    route_plan_small(float* logits, int* ids, float* wts, int m, int e, int k, int pad, int* placed_row,
                     int* placed_mat, int* slot, int cap, int block_rows) {
    pdl_wait();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (m <= block_rows && e <= RB_MAX_E && k <= 64) {
        // A row at a time by the whole block (same results as route_row).
        __shared__ float sp[RB_MAX_E];
        __shared__ int sid[64];
        __shared__ float sv[64];
        __shared__ int flag;
        int n = (e + 31) / 32;
        for (int r = 0; r < m; r++) {
            if (n <= 8)
                route_row_block_u<8>(logits, ids, wts, r, e, k, sp, sid, sv, &flag);
            else
                route_row_block_u<32>(logits, ids, wts, r, e, k, sp, sid, sv, &flag);
        }
        plan_small_block(ids, m * k, k, e, pad, placed_row, placed_mat, slot, cap);
    } else if (m == 1 && k <= 32) {
        // One row (decode of one sequence): warp 0 routes it and plans its k
        // pairs (plan_warp) with no block barrier; the other warps have
        // nothing to do.
        if (warp != 0) return;
        __shared__ int rids1[32];
        route_row(logits, ids, wts, 0, e, k, lane, rids1);
        __syncwarp();
        plan_warp(lane < k ? rids1[lane] : -1, k, k, pad, placed_row, placed_mat, slot, cap, lane);
    } else {
        // The warps also leave the ids in shared memory for the plan (no
        // read back from global memory; m * k <= PLAN_SMALL_PAIRS).
        __shared__ int rids[PLAN_SMALL_PAIRS];
        for (int r = warp; r < m; r += 8) route_row(logits, ids, wts, r, e, k, lane, rids);
        __syncthreads();
        plan_small_block(ids, m * k, k, e, pad, placed_row, placed_mat, slot, cap, rids);
    }
}

// One row's routing and plan (decode of one sequence; e <= 1024, k <= 32) by
// one warp, in compact code (route_one_warp_r: the row in registers for
// e <= 256, else route_one_warp over the row in shared memory): the softmax
// and the k argmax rounds of route_row's rolled-loop path, then plan_warp.
// The same results as `route` and route_plan_small (the argmax rounds are
// route_row's definition; its sorted-lane shortcut picks the same). Its own
// small kernel: route_plan_small's one-row path ran 1,074 distinct
// instructions of a ~20,000-instruction kernel, waiting on instruction fetch
// (ncu); compact code with loads and rounds four entries a step and the
// plan's sum over the pairs only took the one-row routing from 12.6 to 8.3 us.
extern "C" __global__ void __launch_bounds__(32)
    route_plan_one_r(float* logits, int* ids, float* wts, int e, int k, int pad, int* placed_row, int* placed_mat,
                     int* slot, int cap) {
    pdl_wait();
    route_one_warp_r(logits, ids, wts, e, k, pad, placed_row, placed_mat, slot, cap, threadIdx.x);
}

// The negative control's reordering (Cuda::with_reversed_topk): each of m
// rows' k slots and weights reversed in place, so that the combine below
// sums the row's experts in reverse order.
extern "C" __global__ void reverse_topk(int* slot, float* wts, int m, int k) {
    pdl_wait();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= m) return;
    for (int a = 0, b = k - 1; a < b; a++, b--) swap_entries(wts + (i64)r * k, slot + (i64)r * k, a, b);
}

// y[r] = sum over slots s in k order of w[r][s] * out[slot[r][s]] (skipped ids
// left out), plus sigmoid(gi[r]) * ys[r] when there is a shared expert.
// (sg = sigmoid(gi[r]), computed once a row by the caller.)
__device__ __forceinline__ float moe_combine_elem(const float* out, const int* slot, const float* wts,
                                                  const float* ys, float sg, int r, int c, int k, int d,
                                                  int shared) {
    float acc = 0.0f;
    for (int s = 0; s < k; s++) {
        int at = slot[(i64)r * k + s];
        if (at < 0) continue;
        acc = acc + wts[(i64)r * k + s] * out[(i64)at * d + c];
    }
    if (shared) acc = acc + sg * ys[(i64)r * d + c];
    return acc;
}

extern "C" __global__ void moe_combine(const float* out, const int* slot, const float* wts, const float* ys,
                                       const float* gi, float* y, int m, int k, int d, int shared) {
    pdl_wait();
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)m * d) return;
    int r = (int)(i / d), c = (int)(i % d);
    float sg = shared ? sigmoid(gi[r]) : 0.0f;
    y[i] = moe_combine_elem(out, slot, wts, ys, sg, r, c, k, d, shared);
}

// moe_combine four columns a thread (d a multiple of 4, row buffers 16-byte
// aligned; wide calls): a row's slots and weights read once, each slot's
// four columns by one 16-byte load, the loads of four slots issued before
// their sums. Each column's sum is moe_combine_elem's: the same terms in
// slot order, then the shared expert's, so the same bytes.
extern "C" __global__ void moe_combine4(const float* out, const int* slot, const float* wts, const float* ys,
                                        const float* gi, float* y, int m, int k, int d, int shared) {
    pdl_wait();
    int d4 = d / 4;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)m * d4) return;
    int r = (int)(i / d4), c = (int)(i % d4) * 4;
    const int* sl = slot + (i64)r * k;
    const float* sw = wts + (i64)r * k;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int s0 = 0; s0 < k; s0 += 4) {
        int at[4];
        float w[4];
        float4 o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            at[j] = s0 + j < k ? sl[s0 + j] : -1;
            w[j] = s0 + j < k ? sw[s0 + j] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (at[j] >= 0) o[j] = *(const float4*)(out + (i64)at[j] * d + c);
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (at[j] >= 0) {
                a0 = a0 + w[j] * o[j].x;
                a1 = a1 + w[j] * o[j].y;
                a2 = a2 + w[j] * o[j].z;
                a3 = a3 + w[j] * o[j].w;
            }
    }
    if (shared) {
        float sg = sigmoid(gi[r]);
        float4 v = *(const float4*)(ys + (i64)r * d + c);
        a0 = a0 + sg * v.x;
        a1 = a1 + sg * v.y;
        a2 = a2 + sg * v.z;
        a3 = a3 + sg * v.w;
    }
    *(float4*)(y + (i64)r * d + c) = make_float4(a0, a1, a2, a3);
}

// moe_combine of row r (a block a row), then add_rms_norm_q8k's work on it:
// acc += y, xn = RMSNorm(acc) and its Q8_K blocks (a decode MoE layer's last
// step and the next layer's input norm in one launch).
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    moe_combine_add_rms_norm_q8k(const float* out, const int* slot, const float* wts, const float* ys,
                                 const float* gi, float* y, int k, int shared, float* acc, const float* w,
                                 float* xn, u8* q, int width, float eps) {
    pdl_wait();
    __shared__ int ss[64];
    __shared__ float sw[64];
    int r = blockIdx.x, t = threadIdx.x;
    float sg = shared ? sigmoid(gi[r]) : 0.0f;
    if (k <= 8) {
        // Up to 8 slots: every slot's loads of the thread's eight columns
        // (and the shared expert's) issued before any sum, so the row waits
        // on memory once, not once a slot (9.4 us against 3.2 + 3.9 apart,
        // slot by slot); each column's sum still in slot order,
        // then the shared expert's term, as moe_combine.
        if (t < k) {
            ss[t] = slot[(i64)r * k + t];
            sw[t] = wts[(i64)r * k + t];
        }
        __syncthreads();
        for (int c0 = 0; c0 < width; c0 += 8 * NORM_THREADS) {
            float o[8][8], yv[8];
#pragma unroll
            for (int s = 0; s < 8; s++) {
                int at = s < k ? ss[s] : -1;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    int c = c0 + t + i * NORM_THREADS;
                    o[s][i] = at >= 0 && c < width ? out[(i64)at * width + c] : 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int c = c0 + t + i * NORM_THREADS;
                yv[i] = shared && c < width ? ys[(i64)r * width + c] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int c = c0 + t + i * NORM_THREADS;
                float a = 0.0f;
#pragma unroll
                for (int s = 0; s < 8; s++)
                    if (s < k && ss[s] >= 0) a = a + sw[s] * o[s][i];
                if (c < width) {
                    if (shared) a = a + sg * yv[i];
                    y[(i64)r * width + c] = a;
                }
            }
        }
    } else if (k <= 64) {
        // The row's slots and weights once, then eight columns a thread at a
        // time, slot by slot (each column's sum still in slot order: the
        // loads of a slot's eight columns are issued together).
        if (t < k) {
            ss[t] = slot[(i64)r * k + t];
            sw[t] = wts[(i64)r * k + t];
        }
        __syncthreads();
        for (int c0 = 0; c0 < width; c0 += 8 * NORM_THREADS) {
            float a[8];
#pragma unroll
            for (int i = 0; i < 8; i++) a[i] = 0.0f;
            for (int s = 0; s < k; s++) {
                int at = ss[s];
                if (at < 0) continue;
                float w = sw[s];
                const float* o = out + (i64)at * width;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    int c = c0 + t + i * NORM_THREADS;
                    if (c < width) a[i] = a[i] + w * o[c];
                }
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int c = c0 + t + i * NORM_THREADS;
                if (c < width) {
                    if (shared) a[i] = a[i] + sg * ys[(i64)r * width + c];
                    y[(i64)r * width + c] = a[i];
                }
            }
        }
    } else {
        for (int c = t; c < width; c += NORM_THREADS)
            y[(i64)r * width + c] = moe_combine_elem(out, slot, wts, ys, sg, r, c, k, width, shared);
    }
    __syncthreads();
    norm_row(acc + (i64)r * width, y + (i64)r * width, w, xn + (i64)r * width, width, eps);
    quantize_own_row(xn + (i64)r * width, q + (i64)r * (width / 256) * Q8K_BYTES, width);
}

// Tier mode's decode cache: each placed row's expert id through the layer's
// slot table (expert -> slot), so the expert matmuls read a slot pool with
// the same per-row matrix addressing as the resident weights. -1 stays -1.
extern "C" __global__ void remap_ids(const int* ids, const int* table, int* out, int n) {
    pdl_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int e = ids[i];
    out[i] = e < 0 ? -1 : table[e];
}
