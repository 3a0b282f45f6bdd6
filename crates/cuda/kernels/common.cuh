// Shared helpers for samesum's CUDA kernels. No CUDA headers are needed:
// half conversions go through PTX, so NVRTC compiles these sources with no
// include path at all.
//
// The row contract holds by construction: every reduction below has an order
// fixed by the sizes of the model (width, head dim, number of blocks), never by
// the number of rows in a call or the grid that covers them.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// A KV-cache value as a half: rounded to nearest, but magnitudes past the
// largest finite half kept at +-65504 instead of infinity (NaN stays NaN).
// Prefill multiplies the values of keys past a row's position by
// probabilities of exactly 0, where decode never reads them: an infinite
// value would turn that 0 into NaN in prefill alone.
__device__ __forceinline__ u16 f32_to_f16_kv(float f) {
    return f32_to_f16(fabsf(f) > 65504.0f ? copysignf(65504.0f, f) : f);
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 ld_u16(const u8* p) {
    return (u16)p[0] | ((u16)p[1] << 8);
}

__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

#define INFINITY __int_as_float(0x7f800000)

// The first statement of every kernel. Under programmatic dependent launch
// (Hopper and later; see Device::launch_raw) a kernel may start while the one
// before it in the stream is still running: `griddepcontrol.wait` blocks until
// that kernel has completed and its memory writes are visible, so nothing is
// read or written early. `launch_dependents` then lets the next kernel be
// scheduled (it waits in turn). Without the launch attribute both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// cp.async: copies global -> shared that run beside the thread's work, in
// groups (commit) waited on in order (wait<N>: all but the newest N done, and
// visible to the thread that issued them; a __syncthreads makes them
// visible to the block).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, zero-filled when !valid (src must still be a
// mapped address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
// 4 bytes global -> shared (any 4-byte-aligned addresses).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Fixed butterfly sums over a warp (or over the low `w` lanes of each group).
__device__ __forceinline__ int isum_lanes(int v, int w) {
    for (int o = w / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Q8_K activation block as laid out here: qs[256], bsums[16] (i16), d (f32),
// padding to 304 bytes (so every block starts 16-byte aligned).
#define Q8K_BYTES 304
#define Q8K_BSUMS 256
#define Q8K_D 288
// One Q8_K block of 256 floats by one warp (lane = 0..31): ggml's
// quantize_row_q8_K_ref, on a 256-block in memory, global or shared. Lane l
// reads elements l, l + 32, ...; the max, the first index reaching it, the
// element roundings and the integer block sums do not depend on which lane
// holds which element, so any caller gets the same bytes. The block's
// largest element is read back from memory rather than shuffled from
// registers (a register form took gated_norm_q8k_h and rms_norm_q8k to more
// registers, and the gated norm from 4.04 to 4.89 ms at qwen35moe pp4096 on
// an H200).
__device__ __forceinline__ void q8k_block(const float* xb, u8* ob, int lane) {
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
    i8* qs = (i8*)ob;
    i16* bsums = (i16*)(ob + Q8K_BSUMS);
    if (amax == 0.0f) {
        for (int i = 0; i < 8; i++) qs[i * 32 + lane] = 0;
        if (lane < 16) bsums[lane] = 0;
        if (lane == 0) *(float*)(ob + Q8K_D) = 0.0f;
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
    if (lane == 0) *(float*)(ob + Q8K_D) = 1.0f / iscale;
}

// ---------------------------------------------------------------- norms

// The RMSNorm rows' threads (norm_row in norm.cu).
#define NORM_THREADS 256

// The block's sum of `part` (one f64 per norm thread): a fixed tree, its last
// five levels by shuffles in warp 0 (lane t adds lane t + o: part[t] +
// part[t + o]). norm_tree_from starts at level o0 (its levels above o0
// already taken by the caller, as a block of NORM_THREADS / 2 threads does
// the first in registers): the same sums.
__device__ __forceinline__ double norm_tree_from(double* part, int t, int o0) {
    __syncthreads();
    for (int o = o0; o > 16; o /= 2) {
        if (t < o) part[t] = part[t] + part[t + o];
        __syncthreads();
    }
    if (t < 32) {
        double v = part[t];
        for (int o = 16; o > 0; o /= 2) v = v + __shfl_down_sync(0xffffffffu, v, o);
        if (t == 0) part[0] = v;
    }
    __syncthreads();
    return part[0];
}

__device__ __forceinline__ double norm_tree(double* part, int t) { return norm_tree_from(part, t, NORM_THREADS / 2); }

// ---------------------------------------------------------------- routing
// Shared by moe.cu (route, route_plan_*) and matmul_float.cu (the router launch
// that routes its own row, mm_f32_multi_route_rd).

// The warp's largest (bv, best) pair, lowest id among equal values (a lane
// with no candidate holds best = -1): a fixed xor butterfly; every lane ends
// with the same pair unless values do not order (NaN).
__device__ __forceinline__ void warp_argmax(float& bv, int& best) {
    for (int o = 16; o > 0; o /= 2) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, best, o);
        bool better = oi >= 0 && (best < 0 || ov > bv || (ov == bv && oi < best));
        if (better) {
            bv = ov;
            best = oi;
        }
    }
}

// The top k of a softmaxed row held as softmax_row_u leaves it: k rounds of
// an exact warp argmax (largest first, lowest id among equals), weights
// renormalized by their sum in k order clamped at 2^-14.
// The picks' values are kept in registers for the weights (lane l keeps
// rounds l and l + 32: every lane holds each round's value after the
// argmax), so the weights need no read back of the ids and the row; past
// round 64 they are read back. A pick of -1 (a row of NaNs) weighs 0. With
// `sids` (shared memory), lane 0 also writes the ids there.
__device__ __forceinline__ void keep_pick(float& keep0, float& keep1, int s, int lane, float bv) {
    if (lane == (s & 31)) {
        if (s < 32) keep0 = bv;
        else if (s < 64) keep1 = bv;
    }
}

__device__ __forceinline__ void write_weights(const float* p, const int* ids, float* wts, int r, int k, int lane,
                                              float keep0, float keep1, float tot) {
    for (int s = lane; s < k; s += 32) {
        float v;
        if (s < 32) v = keep0;
        else if (s < 64) v = keep1;
        else {
            int id = ids[(i64)r * k + s];
            v = id >= 0 ? p[id] : 0.0f;
        }
        wts[(i64)r * k + s] = v / tot;
    }
}

// The picks' weights: each value over their sum clamped at 2^-14.
__device__ __forceinline__ void finish_weights(const float* p, const int* ids, float* wts, int r, int k, int lane,
                                               float keep0, float keep1, float tot) {
    tot = fmaxf(tot, 6.103515625e-5f);
    __syncwarp();
    write_weights(p, ids, wts, r, k, lane, keep0, keep1, tot);
}

// plan_small_block's plan by one warp, for up to 32 pairs (lane t holds pair
// t's id): the lanes naming one expert found with a match, each pair's place
// among them counted below its lane, and each expert's offset summed over
// the experts of lower id from their first lanes' padded counts (integer
// sums: the same whatever the order). The same places, experts and slots as
// plan_small_block, with no shared memory and no block barrier.
__device__ __forceinline__ void plan_warp(int id, int n, int k, int pad, int* placed_row, int* placed_mat,
                                          int* slot, int cap, int lane) {
    for (int i = lane; i < cap; i += 32) {
        placed_row[i] = -1;
        placed_mat[i] = -1;
    }
    bool valid = lane < n && id >= 0;
    unsigned same = __match_any_sync(0xffffffffu, valid ? id : -1);
    int before = __popc(same & ((1u << lane) - 1u));
    int padded = valid && before == 0 ? (__popc(same) + pad - 1) / pad * pad : 0;
    int off = 0;
    // Lanes from n on hold no pair (padded 0): the sum stops at n.
#pragma unroll 1
    for (int j = 0; j < n; j++) {
        int idj = __shfl_sync(0xffffffffu, id, j), pj = __shfl_sync(0xffffffffu, padded, j);
        if (pj > 0 && idj < id) off += pj;
    }
    __syncwarp();  // the -1 fills above come before the places below
    if (lane < n) {
        if (!valid) {
            slot[lane] = -1;
        } else {
            int dst = off + before;
            placed_row[dst] = lane / k;
            placed_mat[dst] = id;
            slot[lane] = dst;
        }
    }
}

// One row's routing and plan (decode of one sequence; e <= 1024, k <= 32) by
// one warp (lanes 0..31 of the caller), in compact code: the softmax and the
// k argmax rounds of route_row's rolled-loop path over the row held in
// shared memory, then plan_warp. The logits are read through L2 (another
// block of the same launch may have written them: mm_f32_multi_route_rd).
__device__ __forceinline__ void route_one_warp(float* logits, int* ids, float* wts, int e, int k, int pad,
                                               int* placed_row, int* placed_mat, int* slot, int cap, int lane) {
    __shared__ float sv[1024];
    __shared__ int rids[32];
    int n = (e + 31) / 32;
    float mx = -INFINITY;
    // Loads four at a time (one wait on memory per four, not per entry).
#pragma unroll 4
    for (int u = 0; u < n; u++) {
        int i = lane + 32 * u;
        if (i < e) {
            float x = __ldcg(logits + i);  // written by other blocks of a fused launch
            sv[i] = x;
            mx = fmaxf(mx, x);
        }
    }
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll 1
    for (int u = 0; u < n; u++) {
        int i = lane + 32 * u;
        if (i < e) {
            float x = expf(sv[i] - mx);
            sv[i] = x;
            sum = sum + x;
        }
    }
    for (int o = 16; o > 0; o /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll 1
    for (int u = 0; u < n; u++) {
        int i = lane + 32 * u;
        if (i < e) {
            float x = sv[i] / sum;
            sv[i] = x;
            logits[i] = x;
        }
    }
    float tot = 0.0f, keep0 = 0.0f, keep1 = 0.0f;
    unsigned taken = 0;  // bit u: entry lane + 32u chosen
#pragma unroll 1
    for (int s = 0; s < k; s++) {
        int best = -1;
        float bv = 0.0f;
#pragma unroll 4
        for (int u = 0; u < n; u++) {
            int i = lane + 32 * u;
            if (i >= e || ((taken >> u) & 1u)) continue;
            float x = sv[i];
            if (best < 0 || x > bv) {
                best = i;
                bv = x;
            }
        }
        warp_argmax(bv, best);
        if ((best & 31) == lane) taken |= 1u << (best / 32);
        // record_pick's steps, with the shared-memory copy unconditional.
        if (lane == 0) {
            ids[s] = best;
            rids[s] = best;
        }
        keep_pick(keep0, keep1, s, lane, bv);
        tot = tot + bv;
    }
    finish_weights(logits, ids, wts, 0, k, lane, keep0, keep1, tot);
    plan_warp(lane < k ? rids[lane] : -1, k, k, pad, placed_row, placed_mat, slot, cap, lane);
}

// route_one_warp with the row in registers, for e <= 256:
// lane l holds entries l, l + 32, ... (eight at most), so the softmax's
// loops are unrolled without shared memory, and each argmax round is two
// warp reductions (the largest value's key, then the lowest id holding it)
// in place of warp_argmax's five shuffle pairs. The same bytes: the loads,
// max, exponentials, sum (in entry order per lane, then the same butterfly)
// and divisions are route_one_warp's; a row whose sum is NaN (a NaN or
// infinite logit) goes to route_one_warp itself before anything is
// written, so only rows of values in [0, 1] take the reductions, where the
// float order is the order of the bits and the reductions pick what the
// butterfly picks (largest value, lowest id among equals). Entries taken or
// past e hold -1, below every value.
// Returns false, having written nothing, for a row whose sum is NaN.
__device__ __forceinline__ bool route_regs(float* logits, int* ids, float* wts, int e, int k, int pad,
                                           int* placed_row, int* placed_mat, int* slot, int cap, int lane) {
    float v[8];
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < 8; u++) {
        int i = lane + 32 * u;
        v[u] = i < e ? __ldcg(logits + i) : 0.0f;  // written by other blocks of a fused launch
    }
#pragma unroll
    for (int u = 0; u < 8; u++)
        if (lane + 32 * u < e) mx = fmaxf(mx, v[u]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int u = 0; u < 8; u++) {
        if (lane + 32 * u < e) {
            v[u] = expf(v[u] - mx);
            sum = sum + v[u];
        }
    }
    for (int o = 16; o > 0; o /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, o);
    if (isnan(sum)) return false;  // the same on every lane: the butterfly's result
#pragma unroll
    for (int u = 0; u < 8; u++) {
        int i = lane + 32 * u;
        if (i < e) {
            v[u] = v[u] / sum;
            logits[i] = v[u];
        } else {
            v[u] = -1.0f;
        }
    }
    float tot = 0.0f, keep0 = 0.0f, keep1 = 0.0f;
    int mine = -1;  // lane s: round s's pick, for the plan
#pragma unroll 1
    for (int s = 0; s < k; s++) {
        int best = -1;
        float bv = 0.0f;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            float x = v[u];
            if (x >= 0.0f && (best < 0 || x > bv)) {
                best = lane + 32 * u;
                bv = x;
            }
        }
        // Keys: 0 for no candidate, else the value's bits plus one.
        unsigned key = best < 0 ? 0u : __float_as_uint(bv) + 1u;
        unsigned top = __reduce_max_sync(0xffffffffu, key);
        if (top == 0u) {
            best = -1;
            bv = 0.0f;
        } else {
            best = (int)__reduce_min_sync(0xffffffffu, key == top ? (unsigned)best : 0xffffffffu);
            bv = __uint_as_float(top - 1u);
        }
        // route_one_warp's taken bit (for best = -1 too: lane 31, entry 0).
        if ((best & 31) == lane) {
            int ub = best / 32;
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (u == ub) v[u] = -1.0f;
        }
        if (lane == 0) ids[s] = best;
        if (lane == s) mine = best;
        keep_pick(keep0, keep1, s, lane, bv);
        tot = tot + bv;
    }
    finish_weights(logits, ids, wts, 0, k, lane, keep0, keep1, tot);
    plan_warp(lane < k ? mine : -1, k, k, pad, placed_row, placed_mat, slot, cap, lane);
    return true;
}

__device__ __forceinline__ void route_one_warp_r(float* logits, int* ids, float* wts, int e, int k, int pad,
                                                 int* placed_row, int* placed_mat, int* slot, int cap, int lane) {
    if (e <= 256 && route_regs(logits, ids, wts, e, k, pad, placed_row, placed_mat, slot, cap, lane)) return;
    route_one_warp(logits, ids, wts, e, k, pad, placed_row, placed_mat, slot, cap, lane);
}

// The 4 bytes at byte `o` (any) of a row of shared memory copied as
// aligned words: the two words holding them, funnel-shifted.
__device__ __forceinline__ u32 tc_word(const u8* row, u32 o) {
    const u32* p = (const u32*)(row + (o & ~3u));
    return __funnelshift_r(p[0], p[1], 8 * (o & 3u));
}
