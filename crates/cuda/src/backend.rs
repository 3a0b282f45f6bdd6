//! [`Backend`] on a CUDA device: the layer blocks of the forward pass built
//! from the kernels in `kernels/`, with the model's weights resident on the
//! device (the GGUF's bytes uploaded once, matrices addressed by their file
//! offsets; f32 vectors uploaded beside them).
//!
//! Decode and prefill run the same launches with a different row count; every
//! kernel's per-row arithmetic is independent of it (see `kernels/*.cu`).

use crate::device::{
    Device, addr, cfg, cfg1, drv, lane_cfg, lane_cfg_rows, lane_threads, launch, launch_as,
    upload_bar,
};
use crate::error::{CudaError, Result};
use crate::tier::{RESERVE, TierSizes, plan as tier_plan};
use crate::tiered::{Tier, TierStats};
use cudarc::driver::CudaSlice;
use samesum_engine::backend::{Backend, Norm};
use samesum_engine::model::Matrix;
use samesum_engine::model::weights::{AttentionW, DeltaBa, DeltaInput, DeltaNetW, Mixer, MoeW};
use samesum_engine::{Arch, EngineError, KvType, Model};
use samesum_gguf::GgmlType;
use samesum_quant::dequant;
use std::collections::HashMap;
use std::sync::Mutex;

type R<T> = samesum_engine::Result<T>;
/// A column map's description: (kind, sizes...).
type MapKey = (u8, usize, usize, usize);

/// Weight formats with a CUDA matmul kernel.
pub const FORMATS: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// The expert plan computed on the host, the reference the plan kernels are
/// tested against (`plan_count`/`plan_scan`/`plan_place`, `plan_small`,
/// `plan_warp`): each expert's pair count rounded up to `pad`, their
/// exclusive scan in expert order, pair t (token t / k) placed at its
/// expert's offset plus the earlier pairs of that expert; ids of -1 are
/// skipped. Returns (placed rows, placed experts, slots), unused places -1.
#[doc(hidden)]
pub fn plan_reference(
    ids: &[i32],
    k: usize,
    e: usize,
    pad: usize,
    cap: usize,
) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let mut off = vec![0usize; e];
    for &i in ids.iter().filter(|&&i| i >= 0) {
        off[i as usize] += 1;
    }
    let mut run = 0;
    for o in off.iter_mut() {
        let count = *o;
        *o = run;
        run += count.div_ceil(pad) * pad;
    }
    let (mut row, mut mat, mut slot) = (vec![-1; cap], vec![-1; cap], vec![-1; ids.len()]);
    for (t, &i) in ids.iter().enumerate() {
        if i >= 0 {
            let dst = off[i as usize];
            off[i as usize] += 1;
            row[dst] = (t / k) as i32;
            mat[dst] = i;
            slot[t] = dst as i32;
        }
    }
    (row, mat, slot)
}

/// Rows from which a one-row call is an output head for `HEAD_R4`.
pub const HEAD_R4_ROWS: usize = 32_768;

/// The CUDA backend for one model.
pub struct Cuda {
    dev: Device,
    /// The GGUF file's bytes on the device (matrices at their file offsets).
    file: CudaSlice<u8>,
    file_ptr: u64,
    /// f32 vectors of the model keyed by (host address, length).
    vecs: HashMap<(usize, usize), CudaSlice<f32>>,
    /// Zeroed device counters (a set of [`COUNTERS`] per lane) for launches
    /// whose last block finishes the
    /// work (each such block resets its counter): [0] the router launch
    /// that routes (`mm_f32_multi_route`), from [`GLU_COUNTERS`] the decode
    /// GLU's per-output-block counts (`mm_q4_k_lane_moe_glu_q8k_1`).
    counters: CudaSlice<i32>,
    /// Column maps for layout shuffles, keyed by a description.
    maps: Mutex<HashMap<MapKey, CudaSlice<i32>>>,
    /// Wide Q4_K/Q5_K calls on the tensor-core kernels (default); off with
    /// `SAMESUM_CUDA_TC=0` (the dp4a kernels, same bytes) for comparisons.
    tensor_cores: bool,
    /// Which tensor-core kernel family runs the wide calls (all compute the
    /// same bytes): the cp.async one (default), the register-pipelined one
    /// (`SAMESUM_CUDA_TC_ASYNC=0`) or the plain one (`SAMESUM_CUDA_TC_PIPE=0`).
    /// Measured on the H200, qwen35moe pp4096: plain 5,647 -> pipelined 5,996
    /// tok/s at chunk 512 (session 6); pipelined 7,958 -> async 8,350 at
    /// chunk 2048 (session 8).
    tc_kernel: TcKernel,
    /// With the async kernel: 32-row tiles for calls of at least
    /// `TC_ROWS32_MIN` rows per matrix (default; off with
    /// `SAMESUM_CUDA_TC_ROWS32_AUTO=0`, 16-row tiles everywhere). The same
    /// bytes either way.
    tc_rows32_auto: bool,
    /// The 32-row Q4_K tensor-core kernel at 3 blocks an SM
    /// (`mm_tc_q4_k_async32`, 168 registers; default) or at 2
    /// (`mm_tc_q4_k_async32_b2`, `SAMESUM_CUDA_TC_OCC3=0`): the same code,
    /// so the same bytes.
    tc_occ3: bool,
    /// The 32-row Q4_K tensor-core kernel with each element's mins sum taken by
    /// two tensor-core products from the raw bsums (`mm_tc_q4_k_async32m`;
    /// default) instead of by dp2a from bsums pairs staged in a pass of
    /// their own (`SAMESUM_CUDA_TC_MINS=0`). The same integers, so the same
    /// bytes.
    tc_mins: bool,
    /// The mins kernel skipping, for each matrix of a tile, the groups of 8
    /// activation rows past its last row (`mm_tc_q4_k_async32g`; the expert
    /// plan pads each expert's rows to 32, so a tail tile is often mostly
    /// padding; default, off with `SAMESUM_CUDA_TC_GROUPS=0`; H200, session
    /// 17: mm_tc 111.2 -> 107.9 ms at qwen35moe pp4096). The same bytes.
    tc_groups: bool,
    /// The delta rule at key head dims 64, 128 and 256 on the kernels that
    /// stage the next rows by cp.async while the current ones run
    /// (`delta_cols_async_*`; default, off with `SAMESUM_CUDA_DELTA_ASYNC=0`
    /// for `delta_cols_*`). The same bytes.
    delta_async: bool,
    /// With `delta_async`, at key head dims 64 and 128: each row's output
    /// dot beside the next row's k dot (`delta_cols_async_pipe_*`; default,
    /// off with `SAMESUM_CUDA_DELTA_PIPE=0`). The same bytes.
    delta_pipe: bool,
    /// With `delta_pipe`, calls of 16 rows or more: a call's full 16-row
    /// groups as straight-line code, the outputs through shared memory
    /// (`delta_cols_async_unroll_*`), so each row's shared-memory loads are
    /// issued ahead of the recurrence's chain; a partial group takes the
    /// pipelined loop, and decode-sized calls keep `delta_cols_async_pipe_*`.
    /// Default since session 22 (`SAMESUM_CUDA_DELTA_UNROLL=0` turns it
    /// off). H200, qwen35moe pp4096: the delta rule 45.53 -> 37.92 ms,
    /// bench 17,118 -> 17,474 tok/s. The same bytes.
    delta_unroll: bool,
    /// With `delta_unroll`: the next row's k dot summed from its 8 partials
    /// through shared memory, every lane adding them in the butterfly's
    /// lane-0 order (`delta_cols_async_xchg_*`). Opt-in,
    /// `SAMESUM_CUDA_DELTA_XCHG=1`: measured no faster (H200, session 22:
    /// 38.47 ms against 37.92 unrolled alone). The same bytes.
    delta_xchg: bool,
    /// With `delta_unroll`: a full group followed by a full group runs its
    /// last row with the next group's first k and decay (after a wait for
    /// the next group's copies and gates), so the next group starts without
    /// its own first decay and k dot (`delta_cols_async_carry_*`). Opt-in,
    /// `SAMESUM_CUDA_DELTA_CARRY=1`: measured slower (H200, session 22:
    /// 38.83 ms against 37.79 unrolled alone). The same bytes.
    delta_carry: bool,
    /// With `delta_unroll`: three staging buffers in turn instead of two
    /// (`delta_cols_async_tri_*`, in dynamic shared memory), so a group
    /// starts without the barrier that waited for every warp to leave the
    /// buffer being restaged. Opt-in, `SAMESUM_CUDA_DELTA_TRI=1`: measured
    /// no faster (H200, session 23: 37.91 ms against 37.77 unrolled alone).
    /// The same bytes.
    delta_tri: bool,
    /// Wide float matmuls of one matrix (routers, gates in prefill) on the
    /// register-tiled kernels (`mm_*_tile`: each output's fmas and butterfly
    /// as the per-row kernel's; default, off with `SAMESUM_CUDA_F32_TILE=0`).
    float_tiles: bool,
    /// With `float_tiles`, f32 weights of a width that is a multiple of 4
    /// on the wide tile kernel (`mm_f32_tile_w8`: 8 weight rows x 16
    /// activation rows a warp, operands staged by cp.async, one
    /// reduce-scatter for the butterflies; default, off with
    /// `SAMESUM_CUDA_F32_WIDE=0`). The same bytes.
    float_wide: bool,
    /// Wide calls of a plain Q4_K/Q5_K matrix of fewer than 128 rows (one
    /// tensor-core tile) on the dp4a kernels (opt-in,
    /// `SAMESUM_CUDA_TC_SMALL=1`; H200, session 18: slower, the delta nets'
    /// beta and alpha 5.62 -> 10.28 ms at qwen35moe pp4096). The same bytes.
    tc_small: bool,
    /// Wide calls of 2 to 4 Q4_K matrices of one width on the same rows
    /// (a delta net's or attention's input projections, a GLU's gate and
    /// up) in one tensor-core launch (`mm_tc_q4_k_async32g_jobs`) where each
    /// would take `mm_tc_q4_k_async32g` (default, off with
    /// `SAMESUM_CUDA_TC_JOBS=0`; H200, session 19: qwen35moe pp4096 +2.4%,
    /// the Q4_K matmuls 74.0 -> 66.9 ms). The same bytes.
    tc_jobs: bool,
    /// The 32-row padding-skipping Q4_K kernels (one matrix and jobs, each
    /// with its live form) with their weight pieces' copy offsets in shared
    /// memory, read back each block of K (`mm_tc_q4_k_async32g_ws`,
    /// `_live_ws`, `_jobs_ws`, `_jobs_live_ws`), so the K loop keeps
    /// no value in local memory (ncu, session 23: the default's five
    /// reloads a block of K and the stalls behind them were ~7% of
    /// `mm_tc_q4_k_async32g_jobs_live`'s samples). Opt-in until measured,
    /// `SAMESUM_CUDA_TC_WSMEM=1`. The same copies, so the same bytes.
    tc_wsmem: bool,
    /// The 32-row padding-skipping Q4_K tensor-core kernel at 8 warps a
    /// block, each on half the tile's activation rows (`mm_tc_q4_k_async32w`:
    /// 128 registers, 16 warps an SM against 12; opt-in,
    /// `SAMESUM_CUDA_TC_W8=1`: slower on the H200, session 19, qwen35moe
    /// pp4096 -6.5%). The same bytes.
    tc_w8: bool,
    /// The layer norms also write their output as Q8_K blocks
    /// (`rms_norm_q8k`, `add_rms_norm_q8k`: quantize_q8k's bytes), kept here
    /// for the next op's input projections instead of a quantize launch
    /// (default; off with `SAMESUM_CUDA_NORM_Q8K=0`).
    norm_quant: bool,
    /// Norms of rows up to 256 wide (the per-head q and k norms) a warp per
    /// row (`rms_norm_small`: rms_norm's tree within the lane, the same
    /// bytes; default, off with `SAMESUM_CUDA_SMALL_NORM=0`).
    small_norm: bool,
    /// Prefill GLUs write their output's Q8_K blocks with the product
    /// (`silu_mul_q8k`: quantize_q8k's bytes) for the down projection instead
    /// of a quantize launch (default; off with `SAMESUM_CUDA_SILU_Q8K=0`).
    silu_q8k: bool,
    /// The delta net's gated norm and the gated attention's output gate
    /// write their output's Q8_K blocks for the out projection
    /// (`gated_norm_q8k`, `sigmoid_mul_q8k`: quantize_q8k's bytes; default,
    /// off with `SAMESUM_CUDA_GN_Q8K=0`): one launch fewer per such layer.
    gn_q8k: bool,
    /// Decode's delta-net output projection takes the gated norm itself
    /// (`mm_q4_k_lane_gn_1`: every block computes gated_norm_q8k's values
    /// and Q8_K blocks of the row into shared memory, as DOWN_QIN does for
    /// the quantization), so the gated norm needs no launch. One-row calls
    /// on a Q4_K output projection with heads that tile 256-blocks
    /// (`SAMESUM_CUDA_GN_FOLD`). The same bytes.
    gn_fold: bool,
    /// One-row Q4_K matmuls of at most [`LANE16_ROWS`] rows on 16 rows a
    /// block (`mm_q4_k_lane16_1`: the lane kernel's arithmetic a row, on
    /// twice the blocks; under ncu decode's output projection, 2,048 rows
    /// in 64 blocks of 32, leaves 68 of 132 SMs idle and its SMs active a
    /// third of its 7 us). Default (session 26: 6.54 -> 5.67 us a launch,
    /// qwen35moe tg128 +0.65%); `SAMESUM_CUDA_LANE16=0` for 32 rows a
    /// block everywhere. The same bytes.
    lane16: bool,
    /// Decode's router launch with a warp (a router row) a block
    /// (`mm_f32_multi_route_rd1`: 257 blocks of 32 threads for qwen35moe's
    /// 256 experts and shared gate, where 65 blocks of four warps leave
    /// half of the H200's SMs idle). `SAMESUM_CUDA_ROUTER_1W`. The same lane
    /// chains, so the same logits, ids and plan.
    router_1w: bool,
    /// Decode-sized Q4_K matmuls (one row, GLU, grouped, MoE) with a lane
    /// per weight row (`mm_q4_k_lane_*`: each lane a whole block's integer
    /// terms, warp 0 the float steps in block order; the row kernels' bytes;
    /// default, off with `SAMESUM_CUDA_LANE_ROWS=0`).
    lane_rows: bool,
    /// One decode row's routing and plan by one warp in compact code
    /// (`route_plan_one`; default, off with `SAMESUM_CUDA_ROUTE_ONE=0` for
    /// route_plan_small's one-row path): the same ids, weights and plan.
    route_one: bool,
    /// An attention layer's q and k head norms, RoPE and KV write in one
    /// launch for every m (`qk_norm_rope_kv`: rms_norm_small's, rope's and
    /// kv_write's arithmetic, q read in place from the projection; default,
    /// off with `SAMESUM_CUDA_QK_FUSE=0`).
    qk_fuse: bool,
    /// A decode MoE layer's router launch also routes and plans its row
    /// (`mm_f32_multi_route`: its last block runs route_plan_one's code;
    /// default, off with `SAMESUM_CUDA_ROUTE_FOLD=0`).
    route_fold: bool,
    /// Decode's one-row routing holds the row in registers and takes each
    /// argmax round as two warp reductions (`route_one_warp_r`, in
    /// `route_plan_one_r` and `mm_f32_multi_route_r`; e <= 256, rows with a
    /// NaN sum on route_one_warp's code). Default since session 20 (the
    /// router launch 12.87 -> 9.88 us under ncu), off with
    /// `SAMESUM_CUDA_ROUTE_REGS=0`. The same ids, weights and plan.
    route_regs: bool,
    /// The router launch that routes (`mm_f32_multi_route_d`) loads 32
    /// elements a lane a step in place of 16, so a 2,048-wide row waits on
    /// memory once. Default since session 20 (12.87 -> 12.24 us), off with
    /// `SAMESUM_CUDA_ROUTER_DEEP=0`. The same fmas in the same order.
    router_deep: bool,
    /// Wide calls' expert plan takes two launches (`plan_count`, then
    /// `plan_place_wide`: each expert's block sums the padded counts below
    /// it, plan_scan's offset, and places its pairs 32 a thread, two block
    /// barriers per 8,192 pairs in place of two per 256). Default since
    /// session 21 (H200, qwen35moe pp4096: plan_place + plan_scan 2.64 ms
    /// -> plan_place_wide 0.92), off with `SAMESUM_CUDA_PLAN_WIDE=0`. The
    /// same plan.
    plan_wide: bool,
    /// A one-row call against a matrix of at least [`HEAD_R4_ROWS`] rows
    /// (the output head) in formats without a lane kernel (Q5_K, Q6_K,
    /// Q8_0) runs the wide kernel (`mm_*_r4`: four weight rows a warp, the
    /// same per-element arithmetic as `mm_*_1`). Opt-in,
    /// `SAMESUM_CUDA_HEAD_R4=1`: slower on the H200, session 21 (qwen35moe's
    /// Q6_K head under ncu: `mm_q6_k_1` 214 us, `mm_q6_k_r4` 541).
    head_r4: bool,
    /// The same calls on `mm_*_1x4` (mm_row's arithmetic four rows a warp,
    /// the four rows' next groups loaded before a group's arithmetic; taken
    /// first when both are on). Opt-in, `SAMESUM_CUDA_HEAD_X4=1`: no faster
    /// on the H200, session 21 (214 -> 224 us under ncu).
    head_x4: bool,
    /// One-row Q6_K calls (decode's output head among them) eight lanes a
    /// block (`mm_q6_k8_1`: a lane takes both nibbles of 16 ql bytes, the
    /// values unsigned with each group's dot less 32 times its Q8_K block
    /// sum: the same integers, so the same bytes), where `mm_q6_k_1` takes
    /// sixteen, each unpacking one nibble and subtracting 32 a byte (under
    /// ncu `mm_q6_k_1` is bound by its instructions: ALU pipe 65%, issue
    /// slots 79% busy, 1.94 TB/s). Default since session 21 (qwen35moe's
    /// head 214.4 -> 174.7 us, tg128 +1.0%), off with
    /// `SAMESUM_CUDA_Q6_LANES8=0`.
    q6_lanes8: bool,
    /// Decode's routed and shared down projections read the GLU's f32 rows
    /// and quantize them in each block (`mm_q4_k_lane_moe_qin_1`: q8k_block,
    /// quantize_q8k's code, into shared memory), so the GLU outputs need no
    /// quantize launch. Default since session 21 (H200 under ncu: 6.47 +
    /// 2.51 us -> 7.30 a layer), off with `SAMESUM_CUDA_DOWN_QIN=0`. The
    /// same bytes.
    down_qin: bool,
    /// Decode's post-mixer norm runs in the MoE's router launch
    /// (`mm_f32_multi_route_norm`: every block takes add_rms_norm_q8k's
    /// norm of the row into shared memory, the last stores the residual,
    /// the normed row and its Q8_K rows), so the norm needs no launch.
    /// Opt-in, `SAMESUM_CUDA_NORM_ROUTER=1`: no faster on the H200, session
    /// 21 (13.09 us against 9.26 + 3.82 apart, under ncu). The same bytes.
    norm_router: bool,
    /// The decode MoE's lane GLU writes its outputs' Q8_K rows for the down
    /// projections (`mm_q4_k_lane_moe_glu_q8k_1`: quantize_q8k's bytes by
    /// the last block per 256 columns; opt-in with `SAMESUM_CUDA_GLU_Q8K=1`:
    /// no faster on the H200, session 13: the last block's quantization
    /// costs what the launch it saves did).
    glu_q8k: bool,
    /// One decode row's conv, state shift and q/k head norms in one launch
    /// (`conv_l2_one`: conv_small's and l2norm_qk's arithmetic; default, off
    /// with `SAMESUM_CUDA_CONV_L2=0`).
    conv_l2: bool,
    /// Prefill's causal conv with a thread per channel and 16 rows
    /// (`conv_tile`: conv_rows's arithmetic, inputs loaded once; default,
    /// off with `SAMESUM_CUDA_CONV_TILE=0`).
    conv_tile: bool,
    /// The f64 sums of squares of l2norm_qk and gated_norm_q8k in calls of
    /// more than 16 rows with every lane squaring its values and lane 0
    /// adding them in index order (default) or with lane 0 squaring them
    /// all, as before session 17 and as decode-sized calls do (`*_lane0`,
    /// `SAMESUM_CUDA_SQ_LANES=0`). The same sums, so the same bytes.
    sq_lanes: bool,
    /// With `sq_lanes`, calls of more than 16 rows sum 32 heads' squares a
    /// warp, a lane a head (`gated_norm_q8k_h`, `l2norm_qk_h`; head dims up
    /// to 256), each in index order as lane 0 sums one head's. Default
    /// since session 22 (`SAMESUM_CUDA_HEAD_SUMS=0` turns it off). H200,
    /// session 21, qwen35moe pp4096: the first form was slower
    /// (gated_norm_q8k 4.07 -> 5.51 ms, l2norm_qk 2.84 -> 4.01: a thread
    /// waited on memory once a head); with a thread's loads for 8 heads
    /// issued together, faster (4.08 -> 2.91, 2.84 -> 1.64; kernels 237.73
    /// -> 234.96 ms). The same sums, so the same bytes.
    head_sums: bool,
    /// The GLU output's product and Q8_K blocks a warp per 256-block
    /// (`silu_mul_q8k_w`; default) or a block per row (`silu_mul_q8k`,
    /// `SAMESUM_CUDA_SILU_WARP=0`). The same bytes.
    silu_warp: bool,
    /// With `silu_warp`: the GLU's products quantized from registers, not
    /// also stored as floats (`silu_mul_q8k_wr`: the next matmul reads the
    /// Q8_K blocks only; opt-in, `SAMESUM_CUDA_SILU_REGS=1`: slower on the
    /// H200, session 19). The same Q8_K bytes.
    silu_regs: bool,
    /// Wide calls' MoE combine four columns a thread (`moe_combine4`: each
    /// column's sum as moe_combine's; default, off with
    /// `SAMESUM_CUDA_COMBINE_VEC=0`; H200, session 19: 4.97 -> 3.95 ms at
    /// qwen35moe pp4096). The same bytes.
    combine_vec: bool,
    /// Wide routed calls leave the rows with no expert unwritten: the plan's
    /// padding and the places past the last expert's rows, which nothing
    /// reads (the gate, up and down projections on
    /// `mm_tc_q4_k_async32g_live` and `_jobs_live`, which write no zeros
    /// there, the GLU's products and Q8_K blocks on `silu_mul_q8k_wl`, and
    /// the gathered input rows on `gather_words_live`). Default since
    /// session 20 (pp4096 +1.8%), off with `SAMESUM_CUDA_LIVE_ROWS=0`. The
    /// same bytes wherever they are read.
    live_rows: bool,
    /// Ungated attention's combine writes the out projection's Q8_K rows
    /// (`attention_combine_q8k`: attention_combine's and quantize_q8k's
    /// bytes; default, off with `SAMESUM_CUDA_COMBINE_Q8K=0`).
    combine_q8k: bool,
    /// A decode MoE's combine also adds into the residual and runs the next
    /// layer's input norm and its quantization (`moe_combine_add_rms_norm_q8k`:
    /// moe_combine's and add_rms_norm_q8k's arithmetic). Slower on the
    /// H200 in session 13, as one block a row waited on memory once a slot;
    /// since session 20 a row of up to 8 slots issues every slot's loads
    /// first: default since session 21 (under ncu 5.80 us against 3.31 +
    /// 3.82 apart), off with `SAMESUM_CUDA_MOE_NORM=0`.
    moe_norm: bool,
    /// One decode row's attention tile in compact code (`attention_one`:
    /// attention_tiles_q4's arithmetic with its loops rolled; opt-in with
    /// `SAMESUM_CUDA_ATT_ONE=1`: faster at a context of one key, slower over
    /// a 128-token decode on the H200, session 13, with one key a warp step
    /// where the tile kernel takes four).
    att_one: bool,
    /// The attention kernel the last attention call launched (for tests).
    att_last: Mutex<&'static str>,
    /// Decode-sized routing (up to 4 rows) by the whole block, each entry's
    /// rank counted by its own thread (opt-in with
    /// `SAMESUM_CUDA_BLOCK_ROUTE=1`; the argmax rounds' ids and weights, as
    /// its GPU test shows; measured no faster on the H200, session 8: the
    /// kernel's time is not in the argmax rounds); by default a warp's argmax
    /// rounds per row.
    block_route: bool,
    /// Attention's score pass for head dims 65-128 with q read from shared
    /// memory four keys a step (`attention_tiles_q4`; the default,
    /// `SAMESUM_CUDA_ATT_Q4=0` for q in registers one key a step): the same
    /// terms in the same order, the same bytes. Measured on the H200,
    /// qwen3moe pp4096 4,628 -> 4,923 tok/s (session 8).
    att_q4: bool,
    /// Attention's score and value passes on tensor cores (3xTF32 mma,
    /// `attention_tiles_tc`; opt-in, `SAMESUM_CUDA_ATT_TC=1`, head dims that
    /// are multiples of 32 up to 256, groups of 1, 2, 4, 8, 16 or 32 query heads): a different summation order from the CUDA-core
    /// passes, so a different function, run by decode and prefill alike
    /// while it is on.
    att_tc: bool,
    /// The CUDA-core passes in their session-10 forms: the value pass
    /// without a bound check per key up to the keys every pair of a thread
    /// sees, the score pass's butterfly without selects (default;
    /// `SAMESUM_CUDA_ATT_VFULL=0` for `attention_tiles_q4_checked`, the
    /// session-9 kernel). The same bytes.
    att_vfull: bool,
    /// With `att_q4` and `att_vfull`: `attention_tiles_q4p`, the q4
    /// kernel's arithmetic in lean code for head dims 128 and 256 (typed
    /// cache loads, 32-bit tile offsets, per-pair indices once a block,
    /// padded score rows, value loads eight keys ahead); the default,
    /// `SAMESUM_CUDA_ATT_Q4P=0` for `attention_tiles_q4`. The same bytes.
    /// Measured on the H200 (session 14): attention at pp4096 490 -> 419 ms
    /// (qwen3moe), 82.4 -> 70.4 ms (qwen35moe).
    att_q4p: bool,
    /// With `att_q4p`: `attention_tiles_q4w`, the lean kernel with a wider
    /// value pass (four dims of 2 or 4 pairs a thread); the default,
    /// `SAMESUM_CUDA_ATT_Q4W=0` for `attention_tiles_q4p`. The same bytes.
    /// Measured on the H200 (session 15): attention at pp4096 70.5 -> 63.8
    /// ms (qwen35moe, head dim 256), no change on qwen3moe (head dim 128).
    att_q4w: bool,
    /// With `att_q4w`: `attention_tiles_q4w2`, the same passes for 32 pairs
    /// a block (two 16-pair halves sharing each key and value row loaded),
    /// at head dims 128 and 256 where the query group divides 16
    /// (default; `SAMESUM_CUDA_ATT_P32=0` for the 16-pair kernel). The same
    /// bytes.
    att_p32: bool,
    /// With `att_p32`: four keys a score step at head dims over 128
    /// (`attention_tiles_q4w2k4`: each q value read serves four keys, at one
    /// block an SM). Opt-in until measured, `SAMESUM_CUDA_ATT_KB4=1`. The
    /// same bytes.
    att_kb4: bool,
    /// With `att_tc`: each step's three products summed apart and added to
    /// the running sums in fp32 (`attention_tiles_tc_acc`,
    /// `SAMESUM_CUDA_ATT_TC_ACC=1`): another function again, measured for
    /// accuracy against the plain tensor-core passes.
    att_tc_acc: bool,
    /// A sensitivity probe for `samesum agree`, not a user path: every
    /// attention output one ulp up (`attention_combine_ulp`,
    /// `SAMESUM_CUDA_ATT_ULP=1`).
    att_ulp: bool,
    /// Prefill's shared expert on a second stream beside the routed experts
    /// (default; `SAMESUM_CUDA_OVERLAP=0` runs it after them on the main
    /// stream: the same kernels on the same inputs, the same bytes).
    overlap: bool,
    /// Batched prefill runs two consecutive chunks of a sequence at once on
    /// two lanes (streams), the later chunk's layer `l` after the earlier
    /// chunk's ([`samesum_engine::forward::forward_pair`]; default,
    /// `SAMESUM_CUDA_WAVE=0` runs them one after the other: the same kernels
    /// on the same rows, the same bytes). Not while profiling or in tier mode.
    wave: bool,
    /// Each lane's marks: `lane_marks[lane][layer]`, the event its layer's
    /// launches ended with (see `Backend::lane_mark`).
    lane_marks: Mutex<[Vec<Option<cudarc::driver::CudaEvent>>; 2]>,
    /// Decode steps pull weights that a later kernel of the step reads into
    /// L2 ahead of it, from the second stream (`l2_prefetch`): the layer's
    /// output projection, router and shared expert while the mixer's short
    /// kernels run, the next layer's input projections while the experts
    /// run. Nothing is computed or written, so the bytes are the same
    /// (`SAMESUM_CUDA_PREFETCH`). Resident mode, one-row calls, not while
    /// profiling.
    prefetch: bool,
    /// With `prefetch`, a prefetch instruction a 128-byte line
    /// (`SAMESUM_CUDA_PREFETCH_LINES=1`) instead of one bulk prefetch a 16
    /// KB piece (default): a comparison arm.
    prefetch_lines: bool,
    /// The second stream's last prefetch, joined into the main stream at
    /// the end of the step (a recorded step must join every fork).
    prefetch_done: Mutex<Option<cudarc::driver::CudaEvent>>,
    /// Decode-sized MoE calls run the routed and shared experts in the same
    /// launches (`mm_*_moe_*`, `mm_f32_multi`; the routed experts alone
    /// where there is no shared expert), the routed pairs reading their
    /// token's quantized row in place instead of a gathered copy (default,
    /// off with `SAMESUM_CUDA_MOE_JOINT=0`: separate launches and the
    /// gather, the same bytes).
    moe_joint: bool,
    /// Each lane's last norm's Q8_K rows, valid while no kernel has run
    /// since on that lane.
    norm_q8k: Mutex<[Option<NormQ8k>; 2]>,
    /// Decode-sized quantized calls (one row, or up to 16 rows with experts)
    /// on the one-row kernels (`mm_*_1`: a warp per weight row and activation
    /// row; default, off with `SAMESUM_CUDA_ROW=0`: the 16-row tile kernels,
    /// the same bytes).
    row_kernels: bool,
    /// Decode-sized GLUs (gate and up of one format) in one launch
    /// (`mm_*_glu_1`: both products and silu_mul's expression; default, off
    /// with `SAMESUM_CUDA_GLU=0`: two matmuls and silu_mul, the same bytes).
    glu: bool,
    /// One-row calls of a layer's input projections in one launch
    /// (`mm_*_multi_1`; default, off with `SAMESUM_CUDA_MULTI=0`: one launch
    /// per matrix, the same bytes).
    multi: bool,
    /// MoE rows gathered as Q8_K blocks after quantizing each token row once
    /// (default; `SAMESUM_CUDA_QGATHER=0` gathers f32 rows and quantizes the
    /// gathered ones: the same bytes).
    quantized_gather: bool,
    /// Small calls' routing and expert plans in one launch
    /// (`route_plan_small`) and their causal conv and state shift in one
    /// (`conv_small`); default, off with `SAMESUM_CUDA_SMALL_PLAN=0`: the
    /// same results from `route`, three plan launches, `conv_rows` and
    /// `conv_shift`.
    small_plan: bool,
    /// Most bytes of attention partials one call may use (rows run in groups
    /// under it; [`ATTN_PARTIALS`] unless set for a test).
    attn_partials: usize,
    /// Tier mode: each trunk matrix's device address by its file offset
    /// (`file` then holds the trunk packed); empty in resident mode.
    trunk: HashMap<usize, u64>,
    /// Tier mode's expert store, cache and staging.
    tier: Option<Tier>,
    /// One-token steps recorded as CUDA graphs and replayed (default; off
    /// with `SAMESUM_CUDA_GRAPHS=0`, the same launches one by one).
    graphs: bool,
}

/// `name` with `note` inside its closing parenthesis ("GPU (cuda:0, sm_90a)"
/// -> "GPU (cuda:0, sm_90a, note)"), or after it.
fn with_note(name: &str, note: &str) -> String {
    match name.strip_suffix(')') {
        Some(head) => format!("{head}, {note})"),
        None => format!("{name} ({note})"),
    }
}

/// How to place a model on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// Tier mode within this many bytes of VRAM (`--vram-budget`); without
    /// it, resident mode when the model fits and tier mode with the free
    /// memory as the budget when it does not.
    pub vram_budget: Option<u64>,
    /// Attention's score and value passes on tensor cores, with each step's
    /// products added to the running sums in fp32 (`--attention fast`; the
    /// switches `SAMESUM_CUDA_ATT_TC=1 SAMESUM_CUDA_ATT_TC_ACC=1`). Opt-in: a
    /// different summation order from the default passes, so not the same
    /// bytes as the default, but one function for decode and prefill, so
    /// batched prefill still equals replay with it on. Measured against the
    /// bar in docs/CAPABILITIES.md. Head dims that are multiples of 32 up to
    /// 256 and query groups dividing 32; other shapes keep the default.
    pub fast_attention: bool,
}

/// The next layer's input norm run by a decode MoE's last launch
/// (`moe_combine_add_rms_norm_q8k`): `acc` += the MoE's output, `out` =
/// RMSNorm(acc) with weights `w`, and its Q8_K rows (device addresses: `out`
/// is also the MoE's input, read by earlier launches).
struct AfterNorm<'a> {
    acc: u64,
    w: &'a CudaSlice<f32>,
    out: u64,
    eps: f32,
}

/// The post-mixer norm run inside a decode MoE's router launch
/// (`NORM_ROUTER`, `mm_f32_multi_route_norm`): `acc += inc`, then the
/// RMSNorm of `acc` with weight `w` into the MoE's input rows (f32 and
/// Q8_K), as add_rms_norm_q8k computes it.
struct PreNorm<'a> {
    acc: u64,
    inc: u64,
    w: &'a CudaSlice<f32>,
    eps: f32,
}

/// The input rows of one or more matmuls and their quantized forms, made on
/// first use: matmuls that share an input quantize it once (one launch, not
/// one per matrix).
struct Input<'a> {
    /// The f32 rows; `None` when the rows arrive already quantized.
    x: Option<&'a CudaSlice<f32>>,
    m: usize,
    cols: usize,
    q8k: std::cell::OnceCell<CudaSlice<u8>>,
    q80: std::cell::OnceCell<CudaSlice<u8>>,
    /// For rows placed by the expert plan: the plan's padding (each
    /// expert's rows start at a multiple of it, so a tensor-core tile of up
    /// to this many rows holds one expert); 16 otherwise.
    tile: usize,
    /// Rows with no expert (id -1) are read by no one downstream (a wide
    /// routed call's padding and unused places, with `LIVE_ROWS`): the
    /// kernels that can may leave their outputs unwritten.
    live: bool,
}

/// A norm's output rows as Q8_K blocks, written by the norm kernel itself.
struct NormQ8k {
    /// Device address and length of the f32 rows they quantize.
    addr: u64,
    len: usize,
    /// The device's launch count right after the norm.
    seq: u64,
    q: CudaSlice<u8>,
}

impl<'a> Input<'a> {
    /// f32 rows whose Q8_K blocks may already exist (`q`: quantize_q8k's
    /// bytes for exactly these rows).
    fn with_q8k(x: &'a CudaSlice<f32>, m: usize, q: Option<CudaSlice<u8>>) -> Self {
        let me = Input::new(x, m);
        if let Some(q) = q {
            let _ = me.q8k.set(q);
        }
        me
    }

    fn new(x: &'a CudaSlice<f32>, m: usize) -> Self {
        Input {
            x: Some(x),
            m,
            cols: x.len() / m.max(1),
            q8k: std::cell::OnceCell::new(),
            q80: std::cell::OnceCell::new(),
            tile: TC_ROWS,
            live: false,
        }
    }

    /// The same rows, placed by an expert plan that padded to `pad`.
    fn padded(mut self, pad: usize) -> Self {
        self.tile = pad;
        self
    }

    /// The same rows, marked (with `on`) as ones whose id -1 rows no one
    /// reads (see `live`).
    fn live(mut self, on: bool) -> Self {
        self.live = on;
        self
    }

    /// `m` rows of `cols` given only as Q8_K blocks (a quantized row is a
    /// function of the row alone, so these equal quantizing the f32 rows).
    fn quantized(q8k: CudaSlice<u8>, m: usize, cols: usize) -> Self {
        let cell = std::cell::OnceCell::new();
        let _ = cell.set(q8k);
        Input {
            x: None,
            m,
            cols,
            q8k: cell,
            q80: std::cell::OnceCell::new(),
            tile: TC_ROWS,
            live: false,
        }
    }

    /// Row width.
    fn cols(&self) -> usize {
        self.cols
    }

    /// The f32 rows (an error for rows given only quantized).
    fn f32_rows(&self) -> Result<&'a CudaSlice<f32>> {
        self.x.ok_or_else(|| CudaError::Driver {
            op: "matmul".into(),
            msg: "f32 rows wanted from rows given as Q8_K blocks".into(),
        })
    }

    /// The rows as Q8_K blocks (304 bytes each), quantized once.
    fn q8k(&self, d: &Device) -> Result<&CudaSlice<u8>> {
        if self.q8k.get().is_none() {
            let (m, cols) = (self.m, self.cols());
            let nb = cols / 256;
            let mut a = d.scratch::<u8>(m * nb * 304)?;
            let (ci, mi) = (cols as i32, m as i32);
            launch!(
                d,
                "quantize_q8k",
                cfg((nb as u32, m as u32, 1), 32, 0),
                self.f32_rows()?,
                &mut a,
                &ci,
                &mi
            )?;
            let _ = self.q8k.set(a);
        }
        Ok(self.q8k.get().expect("set above"))
    }

    /// The rows as Q8_0 blocks (36 bytes each), quantized once.
    fn q80(&self, d: &Device) -> Result<&CudaSlice<u8>> {
        if self.q80.get().is_none() {
            let (m, cols) = (self.m, self.cols());
            let nb = cols / 32;
            let mut a = d.scratch::<u8>(m * nb * 36)?;
            let (ci, mi) = (cols as i32, m as i32);
            launch!(
                d,
                "quantize_q8_0",
                cfg1(m * nb),
                self.f32_rows()?,
                &mut a,
                &ci,
                &mi
            )?;
            let _ = self.q80.set(a);
        }
        Ok(self.q80.get().expect("set above"))
    }
}

/// Activation rows per tile of the tensor-core matmuls (the async kernel's
/// 32-row variant aside): the expert plan pads each expert's rows to a
/// multiple of this in wide calls.
const TC_ROWS: usize = 16;

/// Calls of at least this many rows per weight matrix (for expert calls, on
/// average per expert) take the async kernel's 32-row tiles by default: each
/// staged weight block then serves twice the rows. Below it the plan's
/// padding to 32 would cost more rows than the tiles save (session 10,
/// qwen35moe at 16 rows per expert: pp512 10,128 -> 9,399 with 32-row tiles
/// everywhere; at 64, pp4096 9,381 -> 9,540).
const TC_ROWS32_MIN: usize = 64;

/// The most rows a one-row Q4_K matmul may have to take 16 rows a block
/// with `LANE16` (4,096 rows are 128 blocks of 32: a wave of the H200's
/// 132 SMs already).
const LANE16_ROWS: usize = 4096;

/// The lane-a-head kernels (`HEAD_SUMS`: `gated_norm_q8k_h`,
/// `l2norm_qk_h`): `n` heads of `dim` values, HS_HEADS (ops.cu) a block of
/// 128 threads, staged in rows of `dim + 1` floats.
fn head_sums_cfg(n: usize, dim: usize) -> cudarc::driver::LaunchConfig {
    const HS_HEADS: usize = 32;
    cfg(
        (n.div_ceil(HS_HEADS) as u32, 1, 1),
        128,
        (HS_HEADS * (dim + 1) * 4) as u32,
    )
}

/// `mm_f32_tile_w8`'s two stages of shared memory: 32 weight rows and 16
/// activation rows of 128 f32 columns each (MFW_SMEM in matmul.cu).
const MFW_SMEM: u32 = 2 * (32 + 16) * 128 * 4;

/// Float matrices of at most this many rows take `mm_f32_few` instead
/// (MFF_ROWS in matmul.cu).
const MFF_ROWS: usize = 8;

/// The weight rows of a tensor-core tile (TQ_WROWS in matmul.cu).
const TQ_WROWS: usize = 128;

/// Dynamic shared memory of the async tensor-core kernels: two stages of
/// (128 weight rows at 160 bytes for Q4_K or 224 for Q5_K, `rows` activation
/// rows at 352, rows x 4 packed bsums, rows scales), as `TaLayout` in
/// matmul.cu.
const fn tc_async_smem(q5: bool, rows: usize) -> u32 {
    let wst = if q5 { 224 } else { 160 };
    (2 * (128 * wst + rows * 352 + rows * 4 * 4 + rows * 4)) as u32
}

/// A `SAMESUM_CUDA_*` switch: `default` unless the variable says otherwise
/// (`0` turns a default-on path off, `1` turns a default-off path on).
fn env_switch(name: &str, default: bool) -> bool {
    match std::env::var(name).as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => default,
    }
}

/// A kernel switch: its name, how to read it and how to set it.
type Switch = (&'static str, fn(&Cuda) -> bool, fn(&mut Cuda, bool));

/// Every `SAMESUM_CUDA_*` switch read at startup, by name (a test keeps the
/// two in step).
const SWITCHES: &[Switch] = &[
    ("TC", |c| c.tensor_cores, |c, on| c.tensor_cores = on),
    (
        "TC_PIPE",
        |c| c.tc_kernel != TcKernel::Plain,
        |c, on| c.tc_kernel = if on { TcKernel::Async } else { TcKernel::Plain },
    ),
    (
        "TC_ASYNC",
        |c| matches!(c.tc_kernel, TcKernel::Async | TcKernel::Async32),
        |c, on| {
            c.tc_kernel = if on {
                TcKernel::Async
            } else {
                TcKernel::Pipelined
            }
        },
    ),
    (
        "TC_ROWS32_AUTO",
        |c| c.tc_rows32_auto,
        |c, on| c.tc_rows32_auto = on,
    ),
    (
        "TC_ROWS32",
        |c| c.tc_kernel == TcKernel::Async32,
        |c, on| {
            c.tc_kernel = if on {
                TcKernel::Async32
            } else {
                TcKernel::Async
            }
        },
    ),
    ("TC_OCC3", |c| c.tc_occ3, |c, on| c.tc_occ3 = on),
    ("TC_MINS", |c| c.tc_mins, |c, on| c.tc_mins = on),
    ("TC_GROUPS", |c| c.tc_groups, |c, on| c.tc_groups = on),
    ("F32_TILE", |c| c.float_tiles, |c, on| c.float_tiles = on),
    ("F32_WIDE", |c| c.float_wide, |c, on| c.float_wide = on),
    ("TC_SMALL", |c| c.tc_small, |c, on| c.tc_small = on),
    ("TC_JOBS", |c| c.tc_jobs, |c, on| c.tc_jobs = on),
    ("TC_WSMEM", |c| c.tc_wsmem, |c, on| c.tc_wsmem = on),
    ("TC_W8", |c| c.tc_w8, |c, on| c.tc_w8 = on),
    ("DELTA_ASYNC", |c| c.delta_async, |c, on| c.delta_async = on),
    ("DELTA_PIPE", |c| c.delta_pipe, |c, on| c.delta_pipe = on),
    (
        "DELTA_UNROLL",
        |c| c.delta_unroll,
        |c, on| c.delta_unroll = on,
    ),
    ("DELTA_XCHG", |c| c.delta_xchg, |c, on| c.delta_xchg = on),
    ("DELTA_CARRY", |c| c.delta_carry, |c, on| c.delta_carry = on),
    ("DELTA_TRI", |c| c.delta_tri, |c, on| c.delta_tri = on),
    ("NORM_Q8K", |c| c.norm_quant, |c, on| c.norm_quant = on),
    ("SMALL_NORM", |c| c.small_norm, |c, on| c.small_norm = on),
    ("SILU_Q8K", |c| c.silu_q8k, |c, on| c.silu_q8k = on),
    ("GN_Q8K", |c| c.gn_q8k, |c, on| c.gn_q8k = on),
    ("LANE_ROWS", |c| c.lane_rows, |c, on| c.lane_rows = on),
    ("ROUTE_ONE", |c| c.route_one, |c, on| c.route_one = on),
    ("QK_FUSE", |c| c.qk_fuse, |c, on| c.qk_fuse = on),
    ("ROUTE_FOLD", |c| c.route_fold, |c, on| c.route_fold = on),
    ("ROUTE_REGS", |c| c.route_regs, |c, on| c.route_regs = on),
    ("ROUTER_DEEP", |c| c.router_deep, |c, on| c.router_deep = on),
    ("PLAN_WIDE", |c| c.plan_wide, |c, on| c.plan_wide = on),
    ("HEAD_R4", |c| c.head_r4, |c, on| c.head_r4 = on),
    ("HEAD_X4", |c| c.head_x4, |c, on| c.head_x4 = on),
    ("Q6_LANES8", |c| c.q6_lanes8, |c, on| c.q6_lanes8 = on),
    ("DOWN_QIN", |c| c.down_qin, |c, on| c.down_qin = on),
    ("NORM_ROUTER", |c| c.norm_router, |c, on| c.norm_router = on),
    ("GLU_Q8K", |c| c.glu_q8k, |c, on| c.glu_q8k = on),
    ("CONV_L2", |c| c.conv_l2, |c, on| c.conv_l2 = on),
    ("CONV_TILE", |c| c.conv_tile, |c, on| c.conv_tile = on),
    ("SQ_LANES", |c| c.sq_lanes, |c, on| c.sq_lanes = on),
    ("HEAD_SUMS", |c| c.head_sums, |c, on| c.head_sums = on),
    ("SILU_WARP", |c| c.silu_warp, |c, on| c.silu_warp = on),
    ("SILU_REGS", |c| c.silu_regs, |c, on| c.silu_regs = on),
    ("COMBINE_VEC", |c| c.combine_vec, |c, on| c.combine_vec = on),
    ("LIVE_ROWS", |c| c.live_rows, |c, on| c.live_rows = on),
    ("COMBINE_Q8K", |c| c.combine_q8k, |c, on| c.combine_q8k = on),
    ("MOE_NORM", |c| c.moe_norm, |c, on| c.moe_norm = on),
    ("ATT_ONE", |c| c.att_one, |c, on| c.att_one = on),
    ("BLOCK_ROUTE", |c| c.block_route, |c, on| c.block_route = on),
    ("SMALL_PLAN", |c| c.small_plan, |c, on| c.small_plan = on),
    ("ROW", |c| c.row_kernels, |c, on| c.row_kernels = on),
    ("GLU", |c| c.glu, |c, on| c.glu = on),
    ("MULTI", |c| c.multi, |c, on| c.multi = on),
    (
        "QGATHER",
        |c| c.quantized_gather,
        |c, on| c.quantized_gather = on,
    ),
    ("OVERLAP", |c| c.overlap, |c, on| c.overlap = on),
    ("WAVE", |c| c.wave, |c, on| c.wave = on),
    ("PREFETCH", |c| c.prefetch, |c, on| c.prefetch = on),
    ("GN_FOLD", |c| c.gn_fold, |c, on| c.gn_fold = on),
    ("LANE16", |c| c.lane16, |c, on| c.lane16 = on),
    ("ROUTER_1W", |c| c.router_1w, |c, on| c.router_1w = on),
    (
        "PREFETCH_LINES",
        |c| c.prefetch_lines,
        |c, on| c.prefetch_lines = on,
    ),
    ("ATT_Q4", |c| c.att_q4, |c, on| c.att_q4 = on),
    ("ATT_TC", |c| c.att_tc, |c, on| c.att_tc = on),
    ("ATT_VFULL", |c| c.att_vfull, |c, on| c.att_vfull = on),
    ("ATT_Q4P", |c| c.att_q4p, |c, on| c.att_q4p = on),
    ("ATT_Q4W", |c| c.att_q4w, |c, on| c.att_q4w = on),
    ("ATT_P32", |c| c.att_p32, |c, on| c.att_p32 = on),
    ("ATT_KB4", |c| c.att_kb4, |c, on| c.att_kb4 = on),
    ("ATT_TC_ACC", |c| c.att_tc_acc, |c, on| c.att_tc_acc = on),
    ("ATT_ULP", |c| c.att_ulp, |c, on| c.att_ulp = on),
    ("MOE_JOINT", |c| c.moe_joint, |c, on| c.moe_joint = on),
    ("GRAPHS", |c| c.graphs, |c, on| c.graphs = on),
];

fn switch_named(name: &str) -> Result<&'static Switch> {
    SWITCHES
        .iter()
        .find(|s| s.0.eq_ignore_ascii_case(name))
        .ok_or_else(|| CudaError::UnknownSwitch {
            name: name.to_string(),
            known: Cuda::switch_names().collect::<Vec<_>>().join(", "),
        })
}

/// The tensor-core kernel families for wide Q4_K/Q5_K calls; every one
/// computes the same bytes as the dp4a kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcKernel {
    /// One weight block at a time (`mm_tc_*`).
    Plain,
    /// The next block's loads issued before this block's arithmetic, in
    /// registers (`mm_tc_*_pipe`; `SAMESUM_CUDA_TC_ASYNC=0`).
    Pipelined,
    /// The pipelined kernel's arithmetic with the weight and activation
    /// blocks copied into shared memory by `cp.async`, two stages, so more
    /// blocks fit per multiprocessor (`mm_tc_*_async`; the default).
    Async,
    /// The async kernel with 32 activation rows a tile (`mm_tc_*_async32`)
    /// in every wide call, and the expert plan padding to 32
    /// (`SAMESUM_CUDA_TC_ROWS32=1`; `Async` takes it where there are enough
    /// rows, see `TC_ROWS32_MIN`). The same bytes.
    Async32,
}

/// Rows a thread of `conv_tile` takes (CONV_TR in kernels/ops.cu).
const CONV_TR: usize = 16;
/// The one-launch plan's limits (`plan_small` in ops.cu).
const PLAN_SMALL_PAIRS: usize = 256;
/// Device counters kept zeroed between launches (`Cuda::counters`).
const COUNTERS: usize = 4096;
/// The first of the decode GLU's output-block counters.
const GLU_COUNTERS: usize = 64;
const PLAN_SMALL_EXPERTS: usize = 2048;

/// Most bytes of attention partials (per pair and key tile: max, sum and a
/// head-dim row) one attention call allocates; longer contexts run the rows
/// in groups. 256 MiB: a 512-row chunk of qwen3moe (32 heads of 128) stays in
/// one group up to ~7,900 positions.
const ATTN_PARTIALS: usize = 256 << 20;

/// One sequence's state on the device.
pub struct CudaState {
    pos: usize,
    ctx: usize,
    kvw: usize,
    kv: Vec<Option<(CudaSlice<u8>, CudaSlice<u8>)>>,
    f16: bool,
    linear: Vec<Option<(CudaSlice<f32>, CudaSlice<f32>)>>,
    /// The position on the device (the kernels read it there, so a recorded
    /// step replays at any position) and the value last written to it.
    pos_dev: CudaSlice<i32>,
    pos_dev_val: Option<usize>,
    /// The lane the state's chunk runs on now (see `Backend::enter_lane`)
    /// and the other lane's device position and its value: a lane's kernels
    /// read the position of its own chunk.
    lane: usize,
    other_pos_dev: CudaSlice<i32>,
    other_pos_dev_val: Option<usize>,
    /// Attention grids sized for the whole context (while recording a step).
    whole_ctx: bool,
    /// One-token steps run eagerly so far (the first warms the caches).
    eager_steps: usize,
    /// Recording failed once for this state: its steps stay eager.
    no_graph: bool,
    /// The recorded one-token step and the row buffers it was recorded on.
    step: Option<Step>,
}

/// A one-token step recorded as a CUDA graph, on its own row buffers (the
/// graph has their addresses baked in).
struct Step {
    h: CudaSlice<f32>,
    x: CudaSlice<f32>,
    y: CudaSlice<f32>,
    graph: Option<cudarc::driver::CudaGraph>,
}

fn matrices(model: &Model) -> Vec<&Matrix> {
    let w = &model.w;
    let mut out = vec![&w.token_embd, &w.output];
    for l in &w.layers {
        match &l.mixer {
            Mixer::Attention(a) => out.extend([&a.q, &a.k, &a.v, &a.o]),
            Mixer::Linear(dn) => {
                match &dn.input {
                    DeltaInput::Split { qkv, z } => out.extend([qkv, z]),
                    DeltaInput::Fused { ssm_in } => out.push(ssm_in),
                }
                match &dn.ba {
                    DeltaBa::Fused(m) => out.push(m),
                    DeltaBa::Split { beta, alpha } => out.extend([beta, alpha]),
                }
                out.push(&dn.out);
            }
        }
        let m = &l.moe;
        out.extend([&m.router, &m.gate, &m.up, &m.down]);
        if let Some(s) = &m.shared {
            out.extend([&s.gate, &s.up, &s.down, &s.gate_inp]);
        }
    }
    out
}

/// The attention shapes the tiled kernel takes: head dims up to 256 and up
/// to 16 query heads per KV head (all three architectures' models are).
fn attention_shape(hq: usize, hkv: usize, hd: usize) -> Result<()> {
    if hd == 0 || hd > 256 || hkv == 0 || !hq.is_multiple_of(hkv) || hq / hkv > 16 {
        return Err(CudaError::Driver {
            op: "attention".into(),
            msg: format!(
                "{hq} query heads over {hkv} KV heads of dim {hd}: the CUDA attention takes head dims up to 256 and up to 16 query heads per KV head"
            ),
        });
    }
    Ok(())
}

fn vectors(model: &Model) -> Vec<&Vec<f32>> {
    let w = &model.w;
    let mut out = vec![&w.output_norm];
    for l in &w.layers {
        out.extend([&l.attn_norm, &l.ffn_norm]);
        match &l.mixer {
            Mixer::Attention(a) => out.extend([&a.q_norm, &a.k_norm]),
            Mixer::Linear(dn) => out.extend([&dn.conv, &dn.dt_bias, &dn.a, &dn.norm]),
        }
    }
    out
}

impl Cuda {
    /// Open device `ordinal` and upload `model`'s weights (resident mode, or
    /// tier mode when they do not fit), with progress bars when `progress`
    /// is set.
    pub fn new(ordinal: usize, model: &Model, progress: bool) -> Result<Cuda> {
        Cuda::with_options(ordinal, model, progress, CudaOptions::default())
    }

    /// [`Cuda::new`] with options. Fails before uploading anything when a
    /// matrix has no kernel, or when the trunk, the reserve for activations
    /// and the KV cache, the staging buffers and one token's experts do not
    /// fit the budget (the error names each size).
    pub fn with_options(
        ordinal: usize,
        model: &Model,
        progress: bool,
        opts: CudaOptions,
    ) -> Result<Cuda> {
        let mut c = Cuda::place(ordinal, model, progress, opts)?;
        if opts.fast_attention {
            c.att_tc = true;
            c.att_tc_acc = true;
        }
        Ok(c)
    }

    /// The backend with the model's weights placed (resident or tiered) and
    /// every switch as the environment sets it (`SAMESUM_CUDA_*`).
    fn place(ordinal: usize, model: &Model, progress: bool, opts: CudaOptions) -> Result<Cuda> {
        for m in matrices(model) {
            if !FORMATS.contains(&m.ty) && !std::ptr::eq(m, &model.w.token_embd) {
                return Err(CudaError::Unsupported {
                    tensor: m.name.clone(),
                    ty: format!("{:?}", m.ty),
                });
            }
        }
        let hp = &model.hp;
        if model
            .w
            .layers
            .iter()
            .any(|l| matches!(l.mixer, Mixer::Attention(_)))
        {
            attention_shape(hp.n_head, hp.n_head_kv, hp.head_dim)?;
        }
        let dev = Device::open(ordinal)?;
        let bytes = model.bytes();
        let vec_bytes: usize = vectors(model).iter().map(|v| v.len() * 4).sum();
        let need = (bytes.len() + vec_bytes) as u64;
        let (free, total) = dev.ctx.mem_get_info().map_err(|e| drv("cuMemGetInfo", e))?;
        let (free, total) = (free as u64, total as u64);
        let budget = match opts.vram_budget {
            Some(b) if b > free => {
                return Err(CudaError::Driver {
                    op: "--vram-budget".into(),
                    msg: format!(
                        "{} MiB asked for, but {} has {} MiB free of {} MiB",
                        b >> 20,
                        dev.name,
                        free >> 20,
                        total >> 20
                    ),
                });
            }
            Some(b) => Some(b),
            None if need + RESERVE > free => Some(free),
            None => None,
        };
        let Some(budget) = budget else {
            return Cuda::resident(dev, model, progress);
        };
        let plan = tier_plan(TierSizes::of(model), budget, RESERVE)?;
        if opts.vram_budget.is_none() && progress {
            eprintln!(
                "the model ({} MiB) does not fit in {} MiB of free VRAM: tier mode, {} expert slots per layer",
                need >> 20,
                free >> 20,
                plan.slots
            );
        }
        // The trunk: every matrix but the routed experts, packed; the token
        // embedding stays on the host (the embedding is dequantized there)
        // unless the head shares it.
        let routed: std::collections::HashSet<usize> = model
            .w
            .layers
            .iter()
            .flat_map(|l| [l.moe.gate.offset, l.moe.up.offset, l.moe.down.offset])
            .collect();
        let mut trunk_mats: Vec<&Matrix> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for m in matrices(model) {
            let embd_only = std::ptr::eq(m, &model.w.token_embd);
            if routed.contains(&m.offset) || embd_only || !seen.insert(m.offset) {
                continue;
            }
            trunk_mats.push(m);
        }
        let size = |m: &Matrix| (m.rows * m.row_bytes * m.n_mats).next_multiple_of(256);
        let trunk_bytes: usize = trunk_mats.iter().map(|m| size(m)).sum();
        let mut file = dev.scratch::<u8>(trunk_bytes)?;
        let file_ptr = addr(&dev, &file);
        let bar = upload_bar(progress, trunk_bytes as u64, "trunk to VRAM");
        let mut trunk = HashMap::new();
        let mut at = 0usize;
        for m in trunk_mats {
            let len = m.rows * m.row_bytes * m.n_mats;
            let src = bytes
                .get(m.offset..m.offset + len)
                .ok_or_else(|| CudaError::Driver {
                    op: "upload weights".into(),
                    msg: format!(
                        "{}: {len} bytes at offset {} run past the file ({} bytes)",
                        m.name,
                        m.offset,
                        bytes.len()
                    ),
                })?;
            let mut dst = file.slice_mut(at..at + len);
            dev.stream
                .memcpy_htod(src, &mut dst)
                .map_err(|e| drv(format!("upload {}", m.name), e))?;
            trunk.insert(m.offset, file_ptr + at as u64);
            at += size(m);
            bar.set_position(at as u64);
        }
        dev.sync()?;
        bar.finish_and_clear();
        let tier = Tier::new(&dev, model, plan, progress)?;
        Cuda::assemble(dev, model, file, trunk, Some(tier))
    }

    /// The backend around uploaded matrices: the f32 vectors uploaded beside
    /// them, the caches empty.
    fn assemble(
        dev: Device,
        model: &Model,
        file: CudaSlice<u8>,
        trunk: HashMap<usize, u64>,
        tier: Option<Tier>,
    ) -> Result<Cuda> {
        let mut vecs = HashMap::new();
        for v in vectors(model) {
            vecs.insert((v.as_ptr() as usize, v.len()), dev.upload(v)?);
        }
        let counters = dev.zeros::<i32>(2 * COUNTERS)?;
        Ok(Cuda {
            file_ptr: addr(&dev, &file),
            dev,
            file,
            vecs,
            counters,
            maps: Mutex::new(HashMap::new()),
            tensor_cores: env_switch("SAMESUM_CUDA_TC", true),
            tc_kernel: if !env_switch("SAMESUM_CUDA_TC_PIPE", true) {
                TcKernel::Plain
            } else if env_switch("SAMESUM_CUDA_TC_ASYNC", true) {
                if env_switch("SAMESUM_CUDA_TC_ROWS32", false) {
                    TcKernel::Async32
                } else {
                    TcKernel::Async
                }
            } else {
                TcKernel::Pipelined
            },
            tc_rows32_auto: env_switch("SAMESUM_CUDA_TC_ROWS32_AUTO", true),
            tc_occ3: env_switch("SAMESUM_CUDA_TC_OCC3", true),
            tc_mins: env_switch("SAMESUM_CUDA_TC_MINS", true),
            tc_groups: env_switch("SAMESUM_CUDA_TC_GROUPS", true),
            delta_async: env_switch("SAMESUM_CUDA_DELTA_ASYNC", true),
            delta_pipe: env_switch("SAMESUM_CUDA_DELTA_PIPE", true),
            delta_unroll: env_switch("SAMESUM_CUDA_DELTA_UNROLL", true),
            delta_xchg: env_switch("SAMESUM_CUDA_DELTA_XCHG", false),
            delta_carry: env_switch("SAMESUM_CUDA_DELTA_CARRY", false),
            delta_tri: env_switch("SAMESUM_CUDA_DELTA_TRI", false),
            float_tiles: env_switch("SAMESUM_CUDA_F32_TILE", true),
            float_wide: env_switch("SAMESUM_CUDA_F32_WIDE", true),
            tc_small: env_switch("SAMESUM_CUDA_TC_SMALL", false),
            tc_jobs: env_switch("SAMESUM_CUDA_TC_JOBS", true),
            tc_wsmem: env_switch("SAMESUM_CUDA_TC_WSMEM", false),
            tc_w8: env_switch("SAMESUM_CUDA_TC_W8", false),
            norm_quant: env_switch("SAMESUM_CUDA_NORM_Q8K", true),
            small_norm: env_switch("SAMESUM_CUDA_SMALL_NORM", true),
            silu_q8k: env_switch("SAMESUM_CUDA_SILU_Q8K", true),
            gn_q8k: env_switch("SAMESUM_CUDA_GN_Q8K", true),
            gn_fold: env_switch("SAMESUM_CUDA_GN_FOLD", false),
            lane16: env_switch("SAMESUM_CUDA_LANE16", true),
            router_1w: env_switch("SAMESUM_CUDA_ROUTER_1W", false),
            lane_rows: env_switch("SAMESUM_CUDA_LANE_ROWS", true),
            route_one: env_switch("SAMESUM_CUDA_ROUTE_ONE", true),
            qk_fuse: env_switch("SAMESUM_CUDA_QK_FUSE", true),
            route_fold: env_switch("SAMESUM_CUDA_ROUTE_FOLD", true),
            route_regs: env_switch("SAMESUM_CUDA_ROUTE_REGS", true),
            router_deep: env_switch("SAMESUM_CUDA_ROUTER_DEEP", true),
            plan_wide: env_switch("SAMESUM_CUDA_PLAN_WIDE", true),
            head_r4: env_switch("SAMESUM_CUDA_HEAD_R4", false),
            head_x4: env_switch("SAMESUM_CUDA_HEAD_X4", false),
            q6_lanes8: env_switch("SAMESUM_CUDA_Q6_LANES8", true),
            down_qin: env_switch("SAMESUM_CUDA_DOWN_QIN", true),
            norm_router: env_switch("SAMESUM_CUDA_NORM_ROUTER", false),
            glu_q8k: env_switch("SAMESUM_CUDA_GLU_Q8K", false),
            conv_l2: env_switch("SAMESUM_CUDA_CONV_L2", true),
            conv_tile: env_switch("SAMESUM_CUDA_CONV_TILE", true),
            sq_lanes: env_switch("SAMESUM_CUDA_SQ_LANES", true),
            head_sums: env_switch("SAMESUM_CUDA_HEAD_SUMS", true),
            silu_warp: env_switch("SAMESUM_CUDA_SILU_WARP", true),
            silu_regs: env_switch("SAMESUM_CUDA_SILU_REGS", false),
            combine_vec: env_switch("SAMESUM_CUDA_COMBINE_VEC", true),
            live_rows: env_switch("SAMESUM_CUDA_LIVE_ROWS", true),
            combine_q8k: env_switch("SAMESUM_CUDA_COMBINE_Q8K", true),
            moe_norm: env_switch("SAMESUM_CUDA_MOE_NORM", true),
            att_one: env_switch("SAMESUM_CUDA_ATT_ONE", false),
            att_last: Mutex::new(""),
            norm_q8k: Mutex::new([None, None]),
            block_route: env_switch("SAMESUM_CUDA_BLOCK_ROUTE", false),
            small_plan: env_switch("SAMESUM_CUDA_SMALL_PLAN", true),
            row_kernels: env_switch("SAMESUM_CUDA_ROW", true),
            glu: env_switch("SAMESUM_CUDA_GLU", true),
            multi: env_switch("SAMESUM_CUDA_MULTI", true),
            quantized_gather: env_switch("SAMESUM_CUDA_QGATHER", true),
            overlap: env_switch("SAMESUM_CUDA_OVERLAP", true),
            wave: env_switch("SAMESUM_CUDA_WAVE", true),
            lane_marks: Mutex::new([Vec::new(), Vec::new()]),
            prefetch: env_switch("SAMESUM_CUDA_PREFETCH", false),
            prefetch_lines: env_switch("SAMESUM_CUDA_PREFETCH_LINES", false),
            prefetch_done: Mutex::new(None),
            att_q4: env_switch("SAMESUM_CUDA_ATT_Q4", true),
            att_tc: env_switch("SAMESUM_CUDA_ATT_TC", false),
            att_vfull: env_switch("SAMESUM_CUDA_ATT_VFULL", true),
            att_q4p: env_switch("SAMESUM_CUDA_ATT_Q4P", true),
            att_q4w: env_switch("SAMESUM_CUDA_ATT_Q4W", true),
            att_p32: env_switch("SAMESUM_CUDA_ATT_P32", true),
            att_kb4: env_switch("SAMESUM_CUDA_ATT_KB4", false),
            att_tc_acc: env_switch("SAMESUM_CUDA_ATT_TC_ACC", false),
            att_ulp: env_switch("SAMESUM_CUDA_ATT_ULP", false),
            moe_joint: env_switch("SAMESUM_CUDA_MOE_JOINT", true),
            attn_partials: ATTN_PARTIALS,
            graphs: env_switch("SAMESUM_CUDA_GRAPHS", true),
            trunk,
            tier,
        })
    }

    /// Resident mode: the whole file on the device.
    fn resident(dev: Device, model: &Model, progress: bool) -> Result<Cuda> {
        let bytes = model.bytes();
        let mut file = dev.scratch::<u8>(bytes.len())?;
        let bar = upload_bar(progress, bytes.len() as u64, "uploading weights");
        const PIECE: usize = 64 << 20;
        let mut at = 0;
        while at < bytes.len() {
            let end = (at + PIECE).min(bytes.len());
            let mut dst = file.slice_mut(at..end);
            dev.stream
                .memcpy_htod(&bytes[at..end], &mut dst)
                .map_err(|e| drv("upload weights", e))?;
            bar.set_position(end as u64);
            at = end;
        }
        dev.sync()?;
        bar.finish_and_clear();
        Cuda::assemble(dev, model, file, HashMap::new(), None)
    }

    /// Tier mode's plan and counters (`None` in resident mode).
    pub fn tier_stats(&self) -> Option<(crate::tier::TierPlan, TierStats, bool)> {
        self.tier.as_ref().map(|t| (t.plan, t.stats(), t.pinned))
    }

    /// A matrix's device address.
    fn wptr(&self, w: &Matrix) -> Result<u64> {
        if self.tier.is_none() {
            return Ok(self.file_ptr + w.offset as u64);
        }
        self.trunk
            .get(&w.offset)
            .copied()
            .ok_or_else(|| CudaError::Driver {
                op: "matmul".into(),
                msg: format!(
                    "{} is not in VRAM (a routed expert stack in tier mode)",
                    w.name
                ),
            })
    }

    /// Record one-token steps as CUDA graphs (`true`, the default unless
    /// `SAMESUM_CUDA_GRAPHS=0`) or launch them one by one, for comparisons.
    #[doc(hidden)]
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
    }

    /// Route, plan and conv decode-sized calls in single launches (`true`,
    /// the default unless `SAMESUM_CUDA_SMALL_PLAN=0`) or through the
    /// separate kernels, for comparisons.
    #[doc(hidden)]
    pub fn set_small_plan(&mut self, on: bool) {
        self.small_plan = on;
    }

    /// Use the one-row kernels for decode-sized calls (`true`, the default
    /// unless `SAMESUM_CUDA_ROW=0`) or the 16-row tile kernels, for comparisons.
    #[doc(hidden)]
    pub fn set_row_kernels(&mut self, on: bool) {
        self.row_kernels = on;
    }

    /// Decode-sized Q4_K matmuls with a lane per weight row (`true`, the
    /// default unless `SAMESUM_CUDA_LANE_ROWS=0`) or a warp per row, for
    /// comparisons.
    #[doc(hidden)]
    pub fn set_lane_rows(&mut self, on: bool) {
        self.lane_rows = on;
    }

    /// Route and plan one decode row by one warp in compact code (`true`,
    /// the default unless `SAMESUM_CUDA_ROUTE_ONE=0`) or by
    /// route_plan_small, for comparisons.
    #[doc(hidden)]
    pub fn set_route_one(&mut self, on: bool) {
        self.route_one = on;
    }

    /// Run a layer's one-row input projections in one launch (`true`, the
    /// default unless `SAMESUM_CUDA_MULTI=0`) or one launch per matrix.
    #[doc(hidden)]
    pub fn set_grouped_projections(&mut self, on: bool) {
        self.multi = on;
    }

    /// Gather MoE rows as Q8_K blocks (`true`, the default unless
    /// `SAMESUM_CUDA_QGATHER=0`) or as f32 rows, for comparisons.
    #[doc(hidden)]
    pub fn set_quantized_gather(&mut self, on: bool) {
        self.quantized_gather = on;
    }

    /// Fuse decode-sized GLUs into one launch (`true`, the default unless
    /// `SAMESUM_CUDA_GLU=0`) or run two matmuls and silu_mul, for comparisons.
    #[doc(hidden)]
    pub fn set_fused_glu(&mut self, on: bool) {
        self.glu = on;
    }

    /// `silu(gate . x) * (up . x)` for `m` host rows through
    /// [`Cuda::glu_on`]'s choice of kernels (for tests).
    #[doc(hidden)]
    pub fn glu_host(
        &self,
        gate: &Matrix,
        up: &Matrix,
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
    ) -> Result<Vec<f32>> {
        let xd = self.dev.upload(x)?;
        let md = match mats {
            Some(v) => Some(self.dev.upload(v)?),
            None => None,
        };
        let mut y = self.dev.upload(&vec![f32::NAN; m * gate.rows])?;
        let (bg, bu) = (self.wptr(gate)?, self.wptr(up)?);
        self.glu_on(
            gate,
            up,
            [bg, bu],
            &Input::new(&xd, m),
            md.as_ref(),
            &mut y,
            false,
        )?;
        self.dev.download(&y, m * gate.rows)
    }

    /// `y = silu(gate . x) * (up . x)` per row (rows with a negative matrix
    /// id give 0): in one launch for decode-sized calls where gate and up
    /// share a format and shape, else two matmuls and `silu_mul`. The same
    /// bytes either way: each product is the matmul's, then silu_mul's
    /// expression. With `quant`, where the two matmuls ran, `y`'s Q8_K
    /// blocks too (`silu_mul_q8k`, with the `SILU_Q8K` switch on and rows a
    /// multiple of 256 wide), for the next matmul's input; where they are
    /// returned with `SILU_REGS` on, `y` keeps the gate's outputs and the
    /// blocks alone hold the GLU's (every K-quant matmul reads them).
    #[allow(clippy::too_many_arguments)]
    fn glu_on(
        &self,
        gate: &Matrix,
        up: &Matrix,
        bases: [u64; 2],
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
        quant: bool,
    ) -> Result<Option<CudaSlice<u8>>> {
        let m = input.m;
        let fused = self.glu
            && self.row_kernels
            && m > 0
            && m <= 16
            && (m == 1 || mats.is_some())
            && gate.ty == up.ty
            && (gate.rows, gate.cols, gate.row_bytes, gate.n_mats)
                == (up.rows, up.cols, up.row_bytes, up.n_mats)
            && input.cols() == gate.cols;
        let kernel = match gate.ty {
            GgmlType::Q4_K => "mm_q4_k_glu_1",
            GgmlType::Q5_K => "mm_q5_k_glu_1",
            GgmlType::Q6_K => "mm_q6_k_glu_1",
            GgmlType::Q8_0 => "mm_q8_0_glu_1",
            _ => "",
        };
        if !fused || kernel.is_empty() {
            let mut u = self.dev.scratch::<f32>(m * up.rows)?;
            // Gate and up in one tensor-core launch where each would take
            // the same kernel alone (TC_JOBS), else one each.
            if !self.tc_jobs_on(&[gate, up], &bases, input, mats, &mut [&mut *y, &mut u])? {
                self.matmul_on(gate, bases[0], input, mats, y, self.tensor_cores)?;
                self.matmul_on(up, bases[1], input, mats, &mut u, self.tensor_cores)?;
            }
            if quant && self.silu_q8k && gate.rows.is_multiple_of(256) {
                let mut q = self.dev.scratch::<u8>(m * gate.rows / 256 * 304)?;
                let width = gate.rows as i32;
                let warps = cfg(((m * gate.rows / 256).div_ceil(4) as u32, 1, 1), 128, 0);
                let mi = m as i32;
                match mats.filter(|_| input.live && !self.silu_regs) {
                    Some(ids) if self.silu_warp => {
                        launch!(
                            self.dev,
                            "silu_mul_q8k_wl",
                            warps,
                            y,
                            &u,
                            &mut q,
                            &width,
                            &mi,
                            ids
                        )?;
                    }
                    _ if self.silu_warp => {
                        launch!(
                            self.dev,
                            if self.silu_regs {
                                "silu_mul_q8k_wr"
                            } else {
                                "silu_mul_q8k_w"
                            },
                            warps,
                            y,
                            &u,
                            &mut q,
                            &width,
                            &mi
                        )?;
                    }
                    _ => {
                        launch!(
                            self.dev,
                            "silu_mul_q8k",
                            cfg((m as u32, 1, 1), 256, 0),
                            y,
                            &u,
                            &mut q,
                            &width
                        )?;
                    }
                }
                return Ok(Some(q));
            }
            let n = (m * gate.rows) as i64;
            launch!(self.dev, "silu_mul", cfg1(m * gate.rows), y, &u, &n)?;
            return Ok(None);
        }
        let d = &self.dev;
        let a = if gate.ty == GgmlType::Q8_0 {
            input.q80(d)?
        } else {
            input.q8k(d)?
        };
        let nb = (gate.cols / if gate.ty == GgmlType::Q8_0 { 32 } else { 256 }) as i32;
        let stride = (gate.rows * gate.row_bytes) as i64;
        let row_bytes = gate.row_bytes as i32;
        let mats_ptr: u64 = mats.map_or(0, |s| crate::device::addr(d, s));
        let (rows, mi) = (gate.rows as i32, m as i32);
        let (kernel, c) = if self.lane_rows && gate.ty == GgmlType::Q4_K {
            ("mm_q4_k_lane_glu_1", lane_cfg(gate.rows, m, nb))
        } else {
            (
                kernel,
                cfg((gate.rows.div_ceil(4) as u32, m as u32, 1), 128, 0),
            )
        };
        launch!(
            d, kernel, c, &bases[0], &bases[1], &stride, &row_bytes, &mats_ptr, a, y, &rows, &mi,
            &nb
        )?;
        Ok(None)
    }

    /// Keep a norm's Q8_K rows for the next op (see `take_norm_q8k`).
    fn keep_norm_q8k(&self, out: &CudaSlice<f32>, q: CudaSlice<u8>) {
        let kept = NormQ8k {
            addr: crate::device::addr(&self.dev, out),
            len: out.len(),
            seq: self.dev.launch_count(),
            q,
        };
        self.norm_q8k.lock().unwrap_or_else(|p| p.into_inner())[self.dev.lane()] = Some(kept);
    }

    /// The Q8_K rows of `x` if the last kernel launched was the norm that
    /// wrote `x` (same address and length, no launch since); taken either way.
    /// Whether a call of `m` rows prefetches the step's next weights (see
    /// `prefetch`).
    fn prefetches(&self, m: usize) -> bool {
        self.prefetch && m == 1 && self.tier.is_none() && !self.dev.profiling()
    }

    /// Pull the bytes of `mats` (up to eight) into L2 from the second
    /// stream, after everything queued on the main stream so far, while the
    /// main stream goes on (see `prefetch`); joined by
    /// [`Cuda::join_prefetch`].
    fn prefetch_mats(&self, mats: &[&Matrix]) -> Result<()> {
        let mut j = crate::device::PrefetchJobs::default();
        for w in mats.iter().take(j.ptr.len()) {
            let i = j.n as usize;
            j.ptr[i] = self.wptr(w)?;
            j.bytes[i] = (w.n_mats * w.rows * w.row_bytes) as u64;
            j.n += 1;
        }
        let total: u64 = j.bytes.iter().sum();
        if total == 0 {
            return Ok(());
        }
        let d = &self.dev;
        // A piece a thread, consecutive pieces on different blocks: up to
        // 64 blocks, so the pieces spread over as many SMs.
        let blocks = total.div_ceil(16384).clamp(1, 64) as u32;
        let lines = i32::from(self.prefetch_lines);
        let ((), ev) =
            d.on_side(|| launch!(d, "l2_prefetch", cfg((blocks, 1, 1), 128, 0), &j, &lines))?;
        *self.prefetch_done.lock().unwrap_or_else(|p| p.into_inner()) = Some(ev);
        Ok(())
    }

    /// A one-row mixer call's prefetch once its input projections are
    /// queued: its output projection `out`, then layer `l`'s router and
    /// shared expert, read after the mixer's short kernels.
    fn prefetch_after_mixer_input(&self, model: &Model, l: usize, out: &Matrix) -> Result<()> {
        let mut mats = vec![out];
        if let Some(lw) = model.w.layers.get(l) {
            mats.push(&lw.moe.router);
            if let Some(sh) = &lw.moe.shared {
                mats.extend([&sh.gate_inp, &sh.gate, &sh.up, &sh.down]);
            }
        }
        self.prefetch_mats(&mats)
    }

    /// Make the main stream wait for the last prefetch (a recorded step
    /// must join the second stream before its end).
    fn join_prefetch(&self) -> Result<()> {
        let ev = self
            .prefetch_done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match ev {
            Some(ev) => self.dev.wait_for(&ev),
            None => Ok(()),
        }
    }

    fn take_norm_q8k(&self, x: &CudaSlice<f32>) -> Option<CudaSlice<u8>> {
        let kept =
            self.norm_q8k.lock().unwrap_or_else(|p| p.into_inner())[self.dev.lane()].take()?;
        (kept.seq == self.dev.launch_count()
            && kept.len == x.len()
            && kept.addr == crate::device::addr(&self.dev, x))
        .then_some(kept.q)
    }

    /// Fuse the Q8_K quantization of the layer norms' outputs into the norms
    /// (`true`, the default unless `SAMESUM_CUDA_NORM_Q8K=0`), for
    /// comparisons.
    #[doc(hidden)]
    pub fn set_norm_quant(&mut self, on: bool) {
        self.norm_quant = on;
    }

    /// Route decode-sized calls with the whole block (`true`; opt-in with
    /// `SAMESUM_CUDA_BLOCK_ROUTE=1`) or a warp per row (the default).
    #[doc(hidden)]
    pub fn set_block_route(&mut self, on: bool) {
        self.block_route = on;
    }

    /// Run attention's score pass for head dims 65-128 through
    /// `attention_tiles_q4` (`true`, the default unless
    /// `SAMESUM_CUDA_ATT_Q4=0`) or `attention_tiles`, for comparisons.
    #[doc(hidden)]
    pub fn set_attention_q4(&mut self, on: bool) {
        self.att_q4 = on;
    }

    /// Whether a MoE call of `m` rows routes in its router's launch
    /// (`ROUTE_FOLD`: one decode row, the one-warp routing's limits).
    fn route_folds(&self, mw: &MoeW, m: usize, k: usize, e: usize) -> bool {
        self.route_fold
            && m == 1
            && self.route_one
            && self.small_plan
            && !self.block_route
            && k <= 32
            && e <= 1024
            && m * k <= PLAN_SMALL_PAIRS
            && mw.router.ty == GgmlType::F32
    }

    /// The kernels that route one decode row: the router launch that routes
    /// it too (`ROUTE_FOLD`) and the routing launch on its own, as the
    /// switches `ROUTE_REGS` and `ROUTER_DEEP` pick them.
    #[doc(hidden)]
    pub fn route_kernels(&self) -> (&'static str, &'static str) {
        let fused = match (self.route_regs, self.router_deep) {
            (false, false) => "mm_f32_multi_route",
            (true, false) => "mm_f32_multi_route_r",
            (false, true) => "mm_f32_multi_route_d",
            (true, true) => "mm_f32_multi_route_rd",
        };
        let one = if self.route_regs {
            "route_plan_one_r"
        } else {
            "route_plan_one"
        };
        (fused, one)
    }

    /// The attention kernel the switches pick for a head dim, a query-head
    /// group size and a call of `rows` rows: its name, the (row, head) pairs
    /// a block takes, and its dynamic shared memory in bytes. The
    /// tensor-core kernel keeps 32 pairs' q and score rows in dynamic shared
    /// memory; the CUDA-core ones take 16 pairs in static arrays, or 32 in
    /// dynamic shared memory (`attention_tiles_q4w2`) for calls of more than
    /// 16 pairs: with fewer (decode) its second half would be empty and its
    /// 66 KB of shared memory cost decode attention 13 -> 23 us a launch
    /// (H200, session 17).
    #[doc(hidden)]
    pub fn attention_kernel(
        &self,
        hd: usize,
        gs: usize,
        rows: usize,
    ) -> (&'static str, usize, usize) {
        // As in ops.cu: ATC_P pairs a block, q rows hd + 8 floats apart, score
        // rows ATC_SS = 256 + 8 floats apart; AP pairs for the CUDA-core ones.
        const ATC_P: usize = 32;
        const ATC_SS: usize = 256 + 8;
        const AP: usize = 16;
        // attention_tiles_q4w2: 2 AP pairs, q and score rows (ATT_HD = 256
        // and ATT_S = 260 floats) in dynamic shared memory (ATT_P32_SMEM).
        const P32_SMEM: usize = 2 * AP * (256 + 260) * 4;
        if self.att_tc && hd.is_multiple_of(32) && hd <= 256 && gs > 0 && ATC_P.is_multiple_of(gs) {
            let name = if self.att_tc_acc {
                "attention_tiles_tc_acc"
            } else {
                "attention_tiles_tc"
            };
            (name, ATC_P, ATC_P * (hd + 8 + ATC_SS) * 4)
        } else if self.att_q4
            && self.att_vfull
            && self.att_q4p
            && self.att_q4w
            && self.att_p32
            && (hd == 128 || hd == 256)
            && gs > 0
            && AP.is_multiple_of(gs)
            && rows * gs > AP
        {
            let name = if self.att_kb4 && hd > 128 {
                "attention_tiles_q4w2k4"
            } else {
                "attention_tiles_q4w2"
            };
            (name, 2 * AP, P32_SMEM)
        } else if self.att_q4 {
            let name = if self.att_vfull && self.att_q4p && self.att_q4w {
                "attention_tiles_q4w"
            } else if self.att_vfull && self.att_q4p {
                "attention_tiles_q4p"
            } else if self.att_vfull {
                "attention_tiles_q4"
            } else {
                "attention_tiles_q4_checked"
            };
            (name, AP, 0)
        } else {
            ("attention_tiles", AP, 0)
        }
    }

    /// The delta-rule kernel a call of `m` rows at key head dim `dk` takes
    /// with the current switches (`None`: the general `delta_rows`). Calls
    /// of fewer than 16 rows (every decode step) have no full row group, so
    /// they keep the pipelined loop's kernel.
    pub fn delta_kernel(&self, dk: usize, m: usize) -> Option<&'static str> {
        let unrolled = self.delta_async && self.delta_pipe && self.delta_unroll && m >= 16;
        match (dk, self.delta_async, self.delta_pipe) {
            (64, true, true) if unrolled && self.delta_tri => Some("delta_cols_async_tri_64"),
            (128, true, true) if unrolled && self.delta_tri => Some("delta_cols_async_tri_128"),
            (64, true, true) if unrolled && self.delta_carry => Some("delta_cols_async_carry_64"),
            (128, true, true) if unrolled && self.delta_carry => Some("delta_cols_async_carry_128"),
            (64, true, true) if unrolled && self.delta_xchg => Some("delta_cols_async_xchg_64"),
            (128, true, true) if unrolled && self.delta_xchg => Some("delta_cols_async_xchg_128"),
            (64, true, true) if unrolled => Some("delta_cols_async_unroll_64"),
            (128, true, true) if unrolled => Some("delta_cols_async_unroll_128"),
            (16, _, _) => Some("delta_cols_16"),
            (32, _, _) => Some("delta_cols_32"),
            (64, true, false) => Some("delta_cols_async_64"),
            (128, true, false) => Some("delta_cols_async_128"),
            (256, true, _) => Some("delta_cols_async_256"),
            (64, true, true) => Some("delta_cols_async_pipe_64"),
            (128, true, true) => Some("delta_cols_async_pipe_128"),
            (64, false, _) => Some("delta_cols_64"),
            (128, false, _) => Some("delta_cols_128"),
            (256, false, _) => Some("delta_cols_256"),
            _ => None,
        }
    }

    /// The attention kernel the last attention call launched ("" before any).
    #[doc(hidden)]
    pub fn last_attention_kernel(&self) -> &'static str {
        *self.att_last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run prefill's shared expert on the second stream (`true`, the default
    /// unless `SAMESUM_CUDA_OVERLAP=0`) or after the routed experts, for
    /// comparisons.
    #[doc(hidden)]
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// Run decode-sized MoE calls' routed and shared experts in the same
    /// launches (`true`, the default unless `SAMESUM_CUDA_MOE_JOINT=0`), for
    /// comparisons.
    #[doc(hidden)]
    pub fn set_moe_joint(&mut self, on: bool) {
        self.moe_joint = on;
    }

    /// Use the register-tiled float kernels for wide calls (`true`, the
    /// default unless `SAMESUM_CUDA_F32_TILE=0`) or the per-row ones, for
    /// comparisons.
    #[doc(hidden)]
    pub fn set_float_tiles(&mut self, on: bool) {
        self.float_tiles = on;
    }

    /// Pick the tensor-core kernel family (they compute the same bytes), for
    /// comparisons.
    #[doc(hidden)]
    pub fn set_tc_kernel(&mut self, k: TcKernel) {
        self.tc_kernel = k;
    }

    /// The kernel switches' names, as the `SAMESUM_CUDA_<NAME>` variables
    /// spell them (`TC_ASYNC`, `OVERLAP`, ...): `samesum agree` turns one
    /// on or off in its second arm.
    pub fn switch_names() -> impl Iterator<Item = &'static str> {
        SWITCHES.iter().map(|s| s.0)
    }

    /// Set the switch `name` (one of [`Cuda::switch_names`],
    /// case-insensitive) as its `SAMESUM_CUDA_<NAME>` variable would at
    /// startup.
    pub fn set_switch(&mut self, name: &str, on: bool) -> Result<()> {
        (switch_named(name)?.2)(self, on);
        Ok(())
    }

    /// The switch `name`'s current setting (see [`Cuda::set_switch`]).
    pub fn switch(&self, name: &str) -> Result<bool> {
        Ok((switch_named(name)?.1)(self))
    }

    /// Cap the attention partials of one call at `bytes` (rows then run in
    /// groups; 1 runs one row at a time), for the tests.
    #[doc(hidden)]
    pub fn set_attention_partials(&mut self, bytes: usize) {
        self.attn_partials = bytes.max(1);
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Bytes of weights on the device (in tier mode: the trunk, the expert
    /// cache and the staging buffers).
    pub fn resident_bytes(&self) -> usize {
        self.file.len()
            + self.vecs.values().map(|v| v.len() * 4).sum::<usize>()
            + self.tier.as_ref().map_or(0, |t| t.vram_bytes())
    }

    fn vec(&self, v: &[f32]) -> Result<&CudaSlice<f32>> {
        self.vecs
            .get(&(v.as_ptr() as usize, v.len()))
            .ok_or_else(|| CudaError::Driver {
                op: "weights".into(),
                msg: "a vector of another model was passed".into(),
            })
    }

    /// A cached column map (built by `f` the first time).
    fn map(&self, key: MapKey, f: impl FnOnce() -> Vec<i32>) -> Result<u64> {
        use cudarc::driver::DevicePtr;
        let mut maps = self.maps.lock().expect("map cache lock");
        let m = match maps.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(self.dev.upload(&f())?),
        };
        let (p, _s) = m.device_ptr(&self.dev.stream);
        Ok(p)
    }

    /// One matmul call on host data, for the kernel tests: `m` rows of `x`
    /// against `w` (`mats` per row, -1 for none), on the tensor-core kernels
    /// where they apply or (with `tensor_cores` false) on the dp4a kernels.
    /// The output starts NaN-poisoned; with `LIVE_ROWS` on and `mats`
    /// given, rows of id -1 may stay so.
    #[doc(hidden)]
    pub fn matmul_host(
        &self,
        w: &Matrix,
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
        tensor_cores: bool,
    ) -> Result<Vec<f32>> {
        let xd = self.dev.upload(x)?;
        let md = match mats {
            Some(v) => Some(self.dev.upload(v)?),
            None => None,
        };
        let mut y = self.dev.upload(&vec![f32::NAN; m * w.rows])?;
        let base = self.wptr(w)?;
        self.matmul_on(
            w,
            base,
            &Input::new(&xd, m).live(self.live_rows && mats.is_some()),
            md.as_ref(),
            &mut y,
            tensor_cores,
        )?;
        self.dev.download(&y, m * w.rows)
    }

    /// `ws` on `m` host rows in one tensor-core launch (`TC_JOBS`; `mats`:
    /// expert ids laid out in tiles of 32 by the plan, shared by every
    /// matrix): `None` when that launch does not apply (see `tc_jobs_on`),
    /// for tests.
    #[doc(hidden)]
    pub fn tc_jobs_host(
        &self,
        ws: &[&Matrix],
        x: &[f32],
        m: usize,
        mats: Option<&[i32]>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let xd = self.dev.upload(x)?;
        let md = match mats {
            Some(v) => Some(self.dev.upload(v)?),
            None => None,
        };
        let mut ys = ws
            .iter()
            .map(|w| self.dev.upload(&vec![f32::NAN; m * w.rows]))
            .collect::<Result<Vec<_>>>()?;
        let bases = ws
            .iter()
            .map(|w| self.wptr(w))
            .collect::<Result<Vec<_>>>()?;
        // Expert ids come laid out as the plan pads them for 32-row tiles.
        let input = Input::new(&xd, m).padded(if mats.is_some() { 32 } else { TC_ROWS });
        let mut refs: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
        if !self.tc_jobs_on(ws, &bases, &input, md.as_ref(), &mut refs)? {
            return Ok(None);
        }
        ws.iter()
            .zip(&ys)
            .map(|(w, y)| self.dev.download(y, m * w.rows))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// `y = W_mat(r) · x[r]` for `m` rows; `mats` gives each row's matrix
    /// (expert), or `None` for matrix 0.
    fn matmul(
        &self,
        w: &Matrix,
        x: &CudaSlice<f32>,
        m: usize,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.matmul_on(
            w,
            self.wptr(w)?,
            &Input::new(x, m),
            mats,
            y,
            self.tensor_cores,
        )
    }

    /// [`Self::matmul`] on a shared input (quantized once for all its matmuls).
    fn mm(
        &self,
        w: &Matrix,
        x: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.matmul_on(w, self.wptr(w)?, x, mats, y, self.tensor_cores)
    }

    /// The tensor-core kernel and tile rows for `w` on `input` (expert
    /// stacks or not), or `None` where the call takes the dp4a kernels:
    /// calls of up to 16 rows, formats other than Q4_K/Q5_K, tensor cores
    /// off, and (with `tc_small`) plain matrices under one tile's 128 rows.
    fn tc_kernel_for(
        &self,
        w: &Matrix,
        input: &Input,
        experts: bool,
        tensor_cores: bool,
    ) -> Option<(&'static str, usize)> {
        // A plain matrix of fewer rows than a tensor-core tile's 128 (a
        // delta net's beta and alpha: 32) would run a few blocks, each
        // mostly unused rows: the dp4a kernels spread it over the GPU.
        let small = self.tc_small && !experts && w.rows < TQ_WROWS;
        if input.m <= 16
            || !tensor_cores
            || small
            || !matches!(w.ty, GgmlType::Q4_K | GgmlType::Q5_K)
        {
            return None;
        }
        let tile = self.tc_tile(input.m, input.tile, experts);
        let q4 = w.ty == GgmlType::Q4_K;
        let g = self.tc_occ3 && self.tc_mins && self.tc_groups;
        let k = match (self.tc_kernel, tile) {
            (TcKernel::Plain, _) if q4 => "mm_tc_q4_k",
            (TcKernel::Plain, _) => "mm_tc_q5_k",
            (TcKernel::Pipelined, _) if q4 => "mm_tc_q4_k_pipe",
            (TcKernel::Pipelined, _) => "mm_tc_q5_k_pipe",
            (_, 32) if q4 && g && self.tc_w8 => "mm_tc_q4_k_async32w",
            (_, 32) if q4 && g => "mm_tc_q4_k_async32g",
            (_, 32) if q4 && self.tc_occ3 && self.tc_mins => "mm_tc_q4_k_async32m",
            (_, 32) if q4 && self.tc_occ3 => "mm_tc_q4_k_async32",
            (_, 32) if q4 => "mm_tc_q4_k_async32_b2",
            (_, 32) => "mm_tc_q5_k_async32",
            _ if q4 => "mm_tc_q4_k_async",
            _ => "mm_tc_q5_k_async",
        };
        Some((k, tile))
    }

    /// Would a wide call of `w` take `mm_tc_q4_k_async32g` (the kernel
    /// whose several-matrix form `tc_jobs_on` launches)?
    fn takes_tc32g(&self, w: &Matrix, input: &Input, experts: bool) -> bool {
        self.tc_kernel_for(w, input, experts, self.tensor_cores)
            .is_some_and(|(k, _)| k == "mm_tc_q4_k_async32g")
    }

    /// `ys[i] = ws[i] . x` (with `bases[i]` the matrices' device addresses)
    /// for 2 to 4 Q4_K matrices of one width, row size and stack layout in
    /// one tensor-core launch (`mm_tc_q4_k_async32g_jobs`, `TC_JOBS`) when
    /// each would take `mm_tc_q4_k_async32g` alone: every output is that
    /// kernel's. Returns false, launching nothing, otherwise.
    fn tc_jobs_on(
        &self,
        ws: &[&Matrix],
        bases: &[u64],
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<bool> {
        let Some(first) = ws.first().filter(|_| self.tc_jobs) else {
            return Ok(false);
        };
        let same = ws.iter().all(|w| {
            (w.ty, w.cols, w.row_bytes, w.n_mats)
                == (first.ty, first.cols, first.row_bytes, first.n_mats)
                && (mats.is_none() || w.rows == first.rows)
        });
        let ok = (2..=4).contains(&ws.len())
            && ws.len() == bases.len()
            && ws.len() == ys.len()
            && same
            && input.cols() == first.cols
            && ws
                .iter()
                .all(|w| self.takes_tc32g(w, input, mats.is_some()))
            && ys.iter().zip(ws).all(|(y, w)| y.len() >= input.m * w.rows);
        if !ok {
            return Ok(false);
        }
        let d = &self.dev;
        let a = input.q8k(d)?;
        let mut mj = crate::device::MmJobs::default();
        let mut tiles = 0u32;
        for (i, (w, y)) in ws.iter().zip(ys.iter()).enumerate() {
            mj.w[i] = bases[i];
            mj.y[i] = crate::device::addr(d, &**y);
            mj.rows[i] = w.rows as i32;
            tiles += w.rows.div_ceil(TQ_WROWS) as u32;
        }
        mj.nj = ws.len() as i32;
        let stride = (first.rows * first.row_bytes) as i64;
        let row_bytes = first.row_bytes as i32;
        let mats_ptr: u64 = mats.map_or(0, |s| crate::device::addr(d, s));
        let (mi, nb) = (input.m as i32, (first.cols / 256) as i32);
        let ct = cfg(
            (tiles, input.m.div_ceil(32) as u32, 1),
            128,
            tc_async_smem(false, 32),
        );
        launch!(
            d,
            match (input.live && mats.is_some(), self.tc_wsmem) {
                (true, false) => "mm_tc_q4_k_async32g_jobs_live",
                (false, false) => "mm_tc_q4_k_async32g_jobs",
                (true, true) => "mm_tc_q4_k_async32g_jobs_live_ws",
                (false, true) => "mm_tc_q4_k_async32g_jobs_ws",
            },
            ct,
            &mj,
            &stride,
            &row_bytes,
            &mats_ptr,
            a,
            &mi,
            &nb
        )?;
        Ok(true)
    }

    /// `ys[i] = ws[i] . x` for up to four matrices sharing the input: one
    /// launch (`mm_*_multi_1`) for one-row calls where every matrix has one
    /// format, width and row size, else one matmul each. The same bytes
    /// either way: each row is the one-row kernel's.
    fn mm_group(&self, input: &Input, jobs: &mut [(&Matrix, &mut CudaSlice<f32>)]) -> Result<()> {
        let first = jobs.first().map(|(w, _)| (w.ty, w.cols, w.row_bytes));
        let kernel = match first.map(|f| f.0) {
            Some(GgmlType::Q4_K) => "mm_q4_k_multi_1",
            Some(GgmlType::Q5_K) => "mm_q5_k_multi_1",
            Some(GgmlType::Q6_K) => "mm_q6_k_multi_1",
            Some(GgmlType::Q8_0) => "mm_q8_0_multi_1",
            _ => "",
        };
        let grouped = self.row_kernels
            && self.multi
            && input.m == 1
            && !kernel.is_empty()
            && (2..=4).contains(&jobs.len())
            && jobs.iter().all(|(w, y)| {
                Some((w.ty, w.cols, w.row_bytes)) == first && w.n_mats == 1 && y.len() >= w.rows
            })
            && input.cols() == jobs[0].0.cols;
        if !grouped {
            // Wide calls: the matrices the tensor-core kernel would take one
            // by one, in one launch where there are two or more (TC_JOBS).
            let mut rest: Vec<usize> = (0..jobs.len()).collect();
            if self.tc_jobs {
                // The input's width fixes every matrix's columns, and Q4_K
                // fixes their row size: tc_jobs_on's shape checks hold.
                let tc: Vec<usize> = (0..jobs.len())
                    .filter(|&i| self.takes_tc32g(jobs[i].0, input, false))
                    .collect();
                if tc.len() >= 2 {
                    let ws: Vec<&Matrix> = tc.iter().map(|&i| jobs[i].0).collect();
                    let bases = ws
                        .iter()
                        .map(|w| self.wptr(w))
                        .collect::<Result<Vec<_>>>()?;
                    let mut ys: Vec<&mut CudaSlice<f32>> = jobs
                        .iter_mut()
                        .enumerate()
                        .filter(|(i, _)| tc.contains(i))
                        .map(|(_, (_, y))| &mut **y)
                        .collect();
                    if self.tc_jobs_on(&ws, &bases, input, None, &mut ys)? {
                        rest.retain(|i| !tc.contains(i));
                    }
                }
            }
            for i in rest {
                let (w, y) = &mut jobs[i];
                self.mm(w, input, None, y)?;
            }
            return Ok(());
        }
        let d = &self.dev;
        let (ty, cols, row_bytes) = first.expect("jobs is not empty");
        let a = if ty == GgmlType::Q8_0 {
            input.q80(d)?
        } else {
            input.q8k(d)?
        };
        let lane = self.lane_rows && ty == GgmlType::Q4_K;
        let per = if lane { 32 } else { 4 };
        let mut mj = crate::device::MmJobs::default();
        let mut blocks = 0u32;
        for (i, (w, y)) in jobs.iter().enumerate() {
            mj.w[i] = self.wptr(w)?;
            mj.y[i] = crate::device::addr(d, y);
            mj.rows[i] = w.rows as i32;
            blocks += w.rows.div_ceil(per) as u32;
        }
        mj.nj = jobs.len() as i32;
        let nb = (cols / if ty == GgmlType::Q8_0 { 32 } else { 256 }) as i32;
        let (rb, mi) = (row_bytes as i32, 1i32);
        let (kernel, threads) = if lane {
            ("mm_q4_k_lane_multi_1", lane_threads(nb))
        } else {
            (kernel, 128)
        };
        launch!(
            d,
            kernel,
            cfg((blocks, 1, 1), threads, 0),
            &mj,
            &rb,
            a,
            &mi,
            &nb
        )
    }

    /// Matmuls of `ws` on host rows through [`Cuda::mm_group`] (`grouped`) or
    /// one at a time, for tests.
    #[doc(hidden)]
    pub fn mm_group_host(
        &mut self,
        ws: &[&Matrix],
        x: &[f32],
        m: usize,
        grouped: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let xd = self.dev.upload(x)?;
        let mut ys = ws
            .iter()
            .map(|w| self.dev.upload(&vec![f32::NAN; m * w.rows]))
            .collect::<Result<Vec<_>>>()?;
        let was = self.multi;
        self.multi = grouped;
        let mut jobs: Vec<(&Matrix, &mut CudaSlice<f32>)> =
            ws.iter().copied().zip(ys.iter_mut()).collect();
        let r = self.mm_group(&Input::new(&xd, m), &mut jobs);
        self.multi = was;
        r?;
        ws.iter()
            .zip(&ys)
            .map(|(w, y)| self.dev.download(y, m * w.rows))
            .collect()
    }

    /// Tensor-core tile rows for a call with (`enough`) or without
    /// `TC_ROWS32_MIN` rows per matrix: 32 on the async kernel where `Async32`
    /// forces it or, by default, where there are enough; 16 otherwise.
    fn tc_rows(&self, enough: bool) -> usize {
        match self.tc_kernel {
            TcKernel::Async32 => 32,
            TcKernel::Async if self.tc_rows32_auto && enough => 32,
            _ => TC_ROWS,
        }
    }

    /// Rows per tile of a wide tensor-core call of `m` rows: for an expert
    /// call, what its plan padded to (`plan_tile`, from `tc_pad`).
    fn tc_tile(&self, m: usize, plan_tile: usize, experts: bool) -> usize {
        self.tc_rows(if experts {
            plan_tile == 32
        } else {
            m >= TC_ROWS32_MIN
        })
    }

    /// The expert plan's padding for `n` (token, expert) pairs over `e`
    /// experts in a wide call: the tensor-core tile its calls will take.
    fn tc_pad(&self, n: usize, e: usize) -> usize {
        self.tc_rows(n >= TC_ROWS32_MIN * e)
    }

    /// A matmul reading `w`'s stacked matrices at device address `base`.
    fn matmul_on(
        &self,
        w: &Matrix,
        base: u64,
        input: &Input,
        mats: Option<&CudaSlice<i32>>,
        y: &mut CudaSlice<f32>,
        tensor_cores: bool,
    ) -> Result<()> {
        let m = input.m;
        if input.cols() != w.cols {
            return Err(CudaError::Driver {
                op: "matmul".into(),
                msg: format!(
                    "{}: rows of {} for {} columns",
                    w.name,
                    input.cols(),
                    w.cols
                ),
            });
        }
        if m == 0 {
            return Ok(());
        }
        let d = &self.dev;
        let wptr = base;
        let stride = (w.rows * w.row_bytes) as i64;
        let row_bytes = w.row_bytes as i32;
        let mats_ptr: u64 = mats.map_or(0, |s| crate::device::addr(d, s));
        let (rows, mi, cols) = (w.rows as i32, m as i32, w.cols as i32);
        let grid = ((w.rows.div_ceil(4)) as u32, m.div_ceil(16) as u32, 1);
        let c = cfg(grid, 128, 0);
        // Calls of more than one 16-row tile take four weight rows per warp
        // (same per-element arithmetic, activations read once for the four).
        let wide = m > 16;
        // One activation row, or a few rows that each name an expert: a warp
        // per (weight row, activation row), same per-element arithmetic.
        let one_row = self.row_kernels && !wide && (m == 1 || mats.is_some());
        // One row against a matrix of many rows (the output head), with
        // `HEAD_R4`: four weight rows a warp (the wide kernel, the same
        // per-element arithmetic), four times the loads in flight a warp.
        // With `HEAD_X4` (first if both are on): mm_row's arithmetic four
        // rows a warp, double buffered (`mm_*_1x4`).
        let head = one_row && m == 1 && mats.is_none() && w.rows >= HEAD_R4_ROWS;
        let head_x4 = head && self.head_x4;
        let head_r4 = head && self.head_r4 && !head_x4;
        let cx4 = cfg((w.rows.div_ceil(16) as u32, m as u32, 1), 128, 0);
        let c1 = cfg((w.rows.div_ceil(4) as u32, m as u32, 1), 128, 0);
        let c4 = cfg(
            (w.rows.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
            128,
            0,
        );
        macro_rules! mm {
            ($k:literal, $k4:literal, $k1:literal, $kx4:literal, $a:expr, $n:expr) => {
                if one_row && self.lane_rows && w.ty == GgmlType::Q4_K {
                    let (kl, cl) = if self.lane16 && w.rows <= LANE16_ROWS {
                        ("mm_q4_k_lane16_1", lane_cfg_rows(w.rows, m, *$n, 16))
                    } else {
                        ("mm_q4_k_lane_1", lane_cfg(w.rows, m, *$n))
                    };
                    launch!(
                        d, kl, cl, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                } else if head_x4 {
                    launch!(
                        d, $kx4, cx4, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                } else if one_row && !head_r4 {
                    launch!(
                        d, $k1, c1, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                } else if wide || head_r4 {
                    launch!(
                        d, $k4, c4, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                } else {
                    launch!(
                        d, $k, c, &wptr, &stride, &row_bytes, &mats_ptr, $a, y, &rows, &mi, $n
                    )
                }
            };
        }
        match w.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                let (k, kt) = match w.ty {
                    GgmlType::F32 => ("mm_f32", "mm_f32_tile"),
                    GgmlType::F16 => ("mm_f16", "mm_f16_tile"),
                    _ => ("mm_bf16", "mm_bf16_tile"),
                };
                let x = input.f32_rows()?;
                let wide_tiles = wide
                    && mats.is_none()
                    && self.float_tiles
                    && self.float_wide
                    && w.ty == GgmlType::F32
                    // 16-byte pieces: whole ones a row, aligned.
                    && w.cols.is_multiple_of(4)
                    && wptr.is_multiple_of(16)
                    && addr(d, x).is_multiple_of(16);
                if wide_tiles {
                    let (kernel, cw) = if w.rows <= MFF_ROWS {
                        // A matrix of a few rows (a shared expert's input
                        // gate: one) would leave most of a 32-row tile's
                        // work unused: a warp an activation row.
                        ("mm_f32_few", cfg((m.div_ceil(4) as u32, 1, 1), 128, 0))
                    } else {
                        // 8 weight rows x 16 activation rows a warp, 4 warps
                        // a block sharing the activation rows (MFW_* in
                        // matmul.cu).
                        let grid = (w.rows.div_ceil(32) as u32, m.div_ceil(16) as u32, 1);
                        ("mm_f32_tile_w8", cfg(grid, 128, MFW_SMEM))
                    };
                    return launch!(d, kernel, cw, &wptr, &row_bytes, x, y, &rows, &mi, &cols);
                }
                if wide && mats.is_none() && self.float_tiles {
                    // Tiles of 4 weight rows x 16 activation rows per warp
                    // (MFT_W, MFT_R in matmul.cu), 4 warps a block.
                    let ct = cfg(
                        (w.rows.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
                        128,
                        0,
                    );
                    return launch!(d, kt, ct, &wptr, &row_bytes, x, y, &rows, &mi, &cols);
                }
                launch!(
                    d, k, c, &wptr, &stride, &row_bytes, &mats_ptr, x, y, &rows, &mi, &cols
                )
            }
            GgmlType::Q8_0 => {
                let nbi = (w.cols / 32) as i32;
                let a = input.q80(d)?;
                mm!("mm_q8_0", "mm_q8_0_r4", "mm_q8_0_1", "mm_q8_0_1x4", a, &nbi)
            }
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                let nbi = (w.cols / 256) as i32;
                let a = input.q8k(d)?;
                if let Some((k, tile)) = self.tc_kernel_for(w, input, mats.is_some(), tensor_cores)
                {
                    // Rows with no expert that no one reads: left unwritten.
                    let k = match k {
                        "mm_tc_q4_k_async32g" if input.live && mats.is_some() => {
                            if self.tc_wsmem {
                                "mm_tc_q4_k_async32g_live_ws"
                            } else {
                                "mm_tc_q4_k_async32g_live"
                            }
                        }
                        "mm_tc_q4_k_async32g" if self.tc_wsmem => "mm_tc_q4_k_async32g_ws",
                        _ => k,
                    };
                    // The async kernels' two stages of shared memory (see
                    // TaLayout in matmul.cu).
                    let smem = match self.tc_kernel {
                        TcKernel::Async | TcKernel::Async32 => {
                            tc_async_smem(w.ty == GgmlType::Q5_K, tile)
                        }
                        _ => 0,
                    };
                    // 8 warps a block for the 8-warp kernel, 4 for the others.
                    let threads = if k == "mm_tc_q4_k_async32w" { 256 } else { 128 };
                    let ct = cfg(
                        (w.rows.div_ceil(128) as u32, m.div_ceil(tile) as u32, 1),
                        threads,
                        smem,
                    );
                    // Profiles split the tensor-core launches by kind and
                    // reduction length (the K loop's blocks against the
                    // tile's fixed costs).
                    let label = match (mats.is_some(), nbi) {
                        _ if !d.profiling() => k,
                        (true, 2) => "mm_tc (experts, K 512)",
                        (true, 8) => "mm_tc (experts, K 2048)",
                        (true, _) => "mm_tc (experts, other K)",
                        (false, 2) => "mm_tc (dense, K 512)",
                        (false, 8) if w.rows < TQ_WROWS => "mm_tc (dense, K 2048, < 128 rows)",
                        (false, 8) => "mm_tc (dense, K 2048)",
                        (false, 16) => "mm_tc (dense, K 4096)",
                        (false, _) => "mm_tc (dense, other K)",
                    };
                    return launch_as!(
                        d, k, label, ct, &wptr, &stride, &row_bytes, &mats_ptr, a, y, &rows, &mi,
                        &nbi
                    );
                }
                match w.ty {
                    GgmlType::Q4_K => {
                        mm!("mm_q4_k", "mm_q4_k_r4", "mm_q4_k_1", "mm_q4_k_1x4", a, &nbi)
                    }
                    GgmlType::Q5_K => {
                        mm!("mm_q5_k", "mm_q5_k_r4", "mm_q5_k_1", "mm_q5_k_1x4", a, &nbi)
                    }
                    // `Q6_LANES8`: one-row calls eight lanes a block.
                    _ if self.q6_lanes8 => {
                        mm!(
                            "mm_q6_k",
                            "mm_q6_k_r4",
                            "mm_q6_k8_1",
                            "mm_q6_k_1x4",
                            a,
                            &nbi
                        )
                    }
                    _ => mm!("mm_q6_k", "mm_q6_k_r4", "mm_q6_k_1", "mm_q6_k_1x4", a, &nbi),
                }
            }
            other => Err(CudaError::Unsupported {
                tensor: w.name.clone(),
                ty: format!("{other:?}"),
            }),
        }
    }

    /// RMSNorm of host rows (`x.len() / w.len()` of them) through
    /// `rms_norm_on`'s choice of kernel (for tests).
    #[doc(hidden)]
    pub fn rms_norm_host(&self, x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>> {
        let rows = x.len() / w.len().max(1);
        let xd = self.dev.upload(x)?;
        let wd = self.dev.upload(w)?;
        let mut y = self.dev.upload(&vec![f32::NAN; x.len()])?;
        self.rms_norm_on(&xd, &wd, w.len(), rows, eps, &mut y)?;
        self.dev.download(&y, x.len())
    }

    fn rms_norm_rows(
        &self,
        x: &CudaSlice<f32>,
        w: &[f32],
        rows: usize,
        eps: f32,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.rms_norm_on(x, self.vec(w)?, w.len(), rows, eps, y)
    }

    /// RMSNorm of `rows` rows of `width` with the weights at `wd`: a warp a
    /// row up to 256 wide (with the `SMALL_NORM` switch on), else a block.
    fn rms_norm_on(
        &self,
        x: &CudaSlice<f32>,
        wd: &CudaSlice<f32>,
        width: usize,
        rows: usize,
        eps: f32,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let small = self.small_norm && width <= 256;
        let width = width as i32;
        if small {
            let ri = rows as i32;
            return launch!(
                self.dev,
                "rms_norm_small",
                cfg((rows.div_ceil(8) as u32, 1, 1), 256, 0),
                x,
                wd,
                y,
                &ri,
                &width,
                &eps
            );
        }
        launch!(
            self.dev,
            "rms_norm",
            cfg((rows as u32, 1, 1), 256, 0),
            x,
            wd,
            y,
            &width,
            &eps
        )
    }

    fn copy_cols(
        &self,
        src: &CudaSlice<f32>,
        src_w: usize,
        dst: &mut CudaSlice<f32>,
        dst_w: usize,
        map: u64,
        m: usize,
    ) -> Result<()> {
        let (sw, dw, mi) = (src_w as i32, dst_w as i32, m as i32);
        launch!(
            self.dev,
            "copy_cols",
            cfg1(m * dst_w),
            src,
            &sw,
            dst,
            &dw,
            &map,
            &mi
        )
    }

    /// Write the state's position to its device copy if it changed.
    fn sync_pos(&self, st: &mut CudaState) -> Result<()> {
        if st.pos_dev_val != Some(st.pos) {
            self.dev
                .current()
                .memcpy_htod(&[st.pos as i32], &mut st.pos_dev)
                .map_err(|x| drv("copy the position", x))?;
            st.pos_dev_val = Some(st.pos);
        }
        Ok(())
    }

    /// One token on one sequence: the first step runs eagerly (loading
    /// kernels, uploading column maps), the second is recorded as a CUDA
    /// graph and launched, later ones launch it. The graph holds the same
    /// launches with the same arguments (the position comes from the device),
    /// so it computes the bytes the eager path does.
    fn graph_step(
        &self,
        model: &Model,
        st: &mut CudaState,
        token: u32,
        want: samesum_engine::Logits,
    ) -> R<Vec<f32>> {
        let d = model.hp.n_embd;
        let mut step = match st.step.take() {
            Some(s) => s,
            None => Step {
                h: self.dev.scratch::<f32>(d).map_err(e)?,
                x: self.dev.scratch::<f32>(d).map_err(e)?,
                y: self.dev.scratch::<f32>(d).map_err(e)?,
                graph: None,
            },
        };
        let out = self.run_step(model, st, &mut step, token, want);
        st.step = Some(step);
        out
    }

    fn run_step(
        &self,
        model: &Model,
        st: &mut CudaState,
        step: &mut Step,
        token: u32,
        want: samesum_engine::Logits,
    ) -> R<Vec<f32>> {
        use samesum_engine::backend::Backend as _;
        self.join_prefetch().map_err(e)?;
        self.embed(model, &[token], &mut step.h)?;
        self.sync_pos(st).map_err(e)?;
        let Step { h, x, y, graph } = step;
        if let Some(g) = graph {
            g.launch()
                .map_err(|x| e(drv("launch the decode graph", x)))?;
        } else if st.eager_steps == 0 || st.no_graph {
            samesum_engine::layers_one(model, self, st, h, x, y)?;
            self.join_prefetch().map_err(e)?;
            st.eager_steps += 1;
        } else {
            match self.record(model, st, h, x, y) {
                Ok(g) => {
                    g.launch()
                        .map_err(|x| e(drv("launch the decode graph", x)))?;
                    *graph = Some(g);
                }
                Err(err) => {
                    // Nothing ran while recording: run the step eagerly, and
                    // keep this sequence's steps eager from now on.
                    eprintln!(
                        "warning: recording the decode step failed ({err}); this sequence decodes without CUDA graphs"
                    );
                    st.no_graph = true;
                    samesum_engine::layers_one(model, self, st, h, x, y)?;
                    self.join_prefetch().map_err(e)?;
                }
            }
        }
        st.pos += 1;
        match want {
            samesum_engine::Logits::None => Ok(Vec::new()),
            _ => self.logits(model, h, &[0]),
        }
    }

    /// Record `layers_one` on the compute stream as a graph (not run).
    fn record(
        &self,
        model: &Model,
        st: &mut CudaState,
        h: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> R<cudarc::driver::CudaGraph> {
        let stream = &self.dev.stream;
        stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(|x| e(drv("begin recording the decode step", x)))?;
        st.whole_ctx = true;
        let ran = samesum_engine::layers_one(model, self, st, h, x, y);
        // The prefetches' stream joins the main stream before the end.
        let joined = self.join_prefetch();
        st.whole_ctx = false;
        // End the capture whatever happened, so the stream works again.
        let ended = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        ran?;
        joined.map_err(e)?;
        ended
            .map_err(|x| e(drv("record the decode step", x)))?
            .ok_or_else(|| e(drv("record the decode step", "an empty graph")))
    }

    fn attention_rows(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &CudaSlice<f32>,
        st: &mut CudaState,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let pre = self.take_norm_q8k(x);
        let hp = &model.hp;
        let d = &self.dev;
        let (hq, hkv, hd) = (hp.n_head, hp.n_head_kv, hp.head_dim);
        let m = x.len() / hp.n_embd;
        let (qw, kvw) = (hq * hd, hkv * hd);
        let mut qg = d.scratch::<f32>(m * a.q.rows)?;
        let mut k = d.scratch::<f32>(m * kvw)?;
        let mut v = d.scratch::<f32>(m * kvw)?;
        let xin = Input::with_q8k(x, m, pre);
        self.mm_group(&xin, &mut [(&a.q, &mut qg), (&a.k, &mut k), (&a.v, &mut v)])?;
        if self.prefetches(m) {
            self.prefetch_after_mixer_input(model, l, &a.o)?;
        }
        self.sync_pos(st)?;
        let (ck, cv) = st.kv[l].as_mut().ok_or_else(|| CudaError::Driver {
            op: "attention".into(),
            msg: format!("layer {l} has no KV cache"),
        })?;
        let (mi, hqi, hkvi, hdi, nrot) =
            (m as i32, hq as i32, hkv as i32, hd as i32, hp.n_rot as i32);
        let (kvwi, f16) = (kvw as i32, st.f16 as i32);
        let pos0 = &st.pos_dev;
        let theta = hp.rope_theta;
        // The gate's columns of a gated projection (head h's q at 2 h hd,
        // its gate at 2 h hd + hd).
        let gate = if a.gated {
            let mut g = d.scratch::<f32>(m * qw)?;
            let mg = self.map((1, hq, hd, 0), || {
                (0..qw)
                    .map(|c| ((c / hd) * 2 * hd + hd + c % hd) as i32)
                    .collect()
            })?;
            self.copy_cols(&qg, 2 * qw, &mut g, qw, mg, m)?;
            Some(g)
        } else {
            None
        };
        let mut q = d.scratch::<f32>(m * qw)?;
        if self.qk_fuse && self.small_norm && hd <= 256 {
            let (q_row, q_head) = if a.gated {
                (2 * qw as i32, 2 * hdi)
            } else {
                (qw as i32, hdi)
            };
            let (qn, kn) = (self.vec(&a.q_norm)?, self.vec(&a.k_norm)?);
            let eps = hp.eps;
            launch!(
                d,
                "qk_norm_rope_kv",
                cfg(((m * (hq + hkv)).div_ceil(8) as u32, 1, 1), 256, 0),
                &qg,
                &q_row,
                &q_head,
                &k,
                &v,
                qn,
                kn,
                &mut q,
                &mut *ck,
                &mut *cv,
                pos0,
                &mi,
                &hqi,
                &hkvi,
                &hdi,
                &nrot,
                &theta,
                &eps,
                &f16
            )?;
        } else {
            let q_raw = if a.gated {
                let mut q = d.scratch::<f32>(m * qw)?;
                let mq = self.map((0, hq, hd, 0), || {
                    (0..qw)
                        .map(|c| ((c / hd) * 2 * hd + c % hd) as i32)
                        .collect()
                })?;
                self.copy_cols(&qg, 2 * qw, &mut q, qw, mq, m)?;
                q
            } else {
                qg
            };
            self.rms_norm_rows(&q_raw, &a.q_norm, m * hq, hp.eps, &mut q)?;
            let mut kn = d.scratch::<f32>(m * kvw)?;
            self.rms_norm_rows(&k, &a.k_norm, m * hkv, hp.eps, &mut kn)?;
            launch!(
                d,
                "rope",
                cfg1(m * hq * hp.n_rot / 2),
                &mut q,
                &mi,
                &hqi,
                &hdi,
                &nrot,
                &theta,
                pos0
            )?;
            launch!(
                d,
                "rope",
                cfg1(m * hkv * hp.n_rot / 2),
                &mut kn,
                &mi,
                &hkvi,
                &hdi,
                &nrot,
                &theta,
                pos0
            )?;
            launch!(
                d,
                "kv_write",
                cfg1(m * kvw),
                &kn,
                &v,
                &mut *ck,
                &mut *cv,
                pos0,
                &mi,
                &kvwi,
                &f16
            )?;
        }
        let mut o = d.scratch::<f32>(m * qw)?;
        let scale = 1.0f32 / (hd as f32).sqrt();
        let gs = hq / hkv;
        // One kernel for every m: fixed key tiles of 256 positions, a block
        // per (KV head, row tile, key tile), then the tiles folded in order
        // (ops.cu, attention_tiles).
        // A recorded step covers the whole context (blocks past a row's
        // position return at once), so its replays serve every position.
        let nb = if st.whole_ctx {
            st.ctx.div_ceil(256)
        } else {
            (st.pos + m).div_ceil(256)
        };
        // The partials (a max, a sum and a head-dim row per pair and tile)
        // grow with rows x context, so long contexts run the rows in groups
        // that keep them under `attn_partials` bytes. Each pair's sums are
        // the same whatever group it is in.
        let per_row = hq * nb * (hd + 2) * 4;
        let group = (self.attn_partials / per_row).clamp(1, m);
        let group = m.div_ceil(m.div_ceil(group)); // groups of even size
        // Ungated attention into a K-quant out projection: the combine also
        // writes the rows' Q8_K blocks (no quantize launch).
        let mut oq = if self.combine_q8k
            && !self.att_ulp
            && gate.is_none()
            && k_quant(a.o.ty)
            && qw.is_multiple_of(256)
        {
            Some(d.scratch::<u8>(m * qw / 256 * 304)?)
        } else {
            None
        };
        let mut pml = d.scratch::<f32>(group * hq * nb * 2)?;
        let mut pacc = d.scratch::<f32>(group * hq * nb * hd)?;
        let nbi = nb as i32;
        for r0 in (0..m).step_by(group) {
            let mr = group.min(m - r0);
            let (mri, r0i) = (mr as i32, r0 as i32);
            let qg = q.slice(r0 * qw..(r0 + mr) * qw);
            let (mut kernel, pairs, smem) = self.attention_kernel(hd, gs, mr);
            // One row on the CUDA-core kernels: the same tile in compact code.
            if self.att_one && mr == 1 && !kernel.starts_with("attention_tiles_tc") && hd <= 256 {
                kernel = "attention_one";
            }
            *self.att_last.lock().unwrap_or_else(|p| p.into_inner()) = kernel;
            launch!(
                d,
                kernel,
                cfg(
                    (hkv as u32, mr.div_ceil(pairs / gs) as u32, nb as u32),
                    256,
                    smem as u32
                ),
                &qg,
                &*ck,
                &*cv,
                &mut pml,
                &mut pacc,
                &mri,
                &hqi,
                &hkvi,
                &hdi,
                pos0,
                &r0i,
                &scale,
                &f16,
                &nbi
            )?;
            let mut og = o.slice_mut(r0 * qw..(r0 + mr) * qw);
            if let Some(oq) = oq.as_mut() {
                let row_q = qw / 256 * 304;
                let mut qg = oq.slice_mut(r0 * row_q..(r0 + mr) * row_q);
                launch!(
                    d,
                    "attention_combine_q8k",
                    cfg(((qw / 256) as u32, mr as u32, 1), 256, 0),
                    &pml,
                    &pacc,
                    &mut og,
                    &mut qg,
                    &mri,
                    &hqi,
                    &hdi,
                    pos0,
                    &r0i,
                    &nbi
                )?;
                continue;
            }
            launch!(
                d,
                if self.att_ulp {
                    "attention_combine_ulp"
                } else {
                    "attention_combine"
                },
                cfg(((mr * hq) as u32, 1, 1), hd.div_ceil(32) as u32 * 32, 0),
                &pml,
                &pacc,
                &mut og,
                &mri,
                &hqi,
                &hdi,
                pos0,
                &r0i,
                &nbi
            )?;
        }
        if let Some(g) = gate {
            // With the out projection reading Q8_K rows, the gate writes
            // them too (a warp per 256-block).
            if self.gn_q8k && k_quant(a.o.ty) && qw.is_multiple_of(256) {
                let mut q = d.scratch::<u8>(m * qw / 256 * 304)?;
                let qwi = qw as i32;
                launch!(
                    d,
                    "sigmoid_mul_q8k",
                    cfg(((qw / 256).div_ceil(4) as u32, m as u32, 1), 128, 0),
                    &mut o,
                    &g,
                    &mut q,
                    &qwi
                )?;
                return self.mm(&a.o, &Input::with_q8k(&o, m, Some(q)), None, y);
            }
            let n = (m * qw) as i64;
            launch!(d, "sigmoid_mul", cfg1(m * qw), &mut o, &g, &n)?;
        }
        if let Some(oq) = oq {
            return self.mm(&a.o, &Input::with_q8k(&o, m, Some(oq)), None, y);
        }
        self.matmul(&a.o, &o, m, None, y)
    }

    fn delta_rows(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &CudaSlice<f32>,
        st: &mut CudaState,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let pre = self.take_norm_q8k(x);
        let hp = &model.hp;
        let d = &self.dev;
        let s = hp.ssm.ok_or_else(|| CudaError::Driver {
            op: "delta_net".into(),
            msg: "no ssm sizes".into(),
        })?;
        let m = x.len() / hp.n_embd;
        let (kd, vd, cd) = (s.key_dim(), s.value_dim(), s.conv_dim());
        let (hk, hv, dk, dv, kc) = (
            s.n_k_heads,
            s.n_v_heads,
            s.head_k_dim,
            s.head_v_dim,
            s.d_conv,
        );
        let ratio = hv / hk;
        let mut qkv = d.scratch::<f32>(m * cd)?;
        let mut z = d.scratch::<f32>(m * vd)?;
        let xin = Input::with_q8k(x, m, pre);
        let mut b = d.scratch::<f32>(m * hv)?;
        let mut a = d.scratch::<f32>(m * hv)?;
        // The common layout (split projections): all four in one group.
        let mut grouped = false;
        if let (DeltaInput::Split { qkv: wq, z: wz }, DeltaBa::Split { beta, alpha }) =
            (&dn.input, &dn.ba)
        {
            self.mm_group(
                &xin,
                &mut [
                    (wq, &mut qkv),
                    (wz, &mut z),
                    (beta, &mut b),
                    (alpha, &mut a),
                ],
            )?;
            grouped = true;
        }
        match &dn.input {
            _ if grouped => {}
            DeltaInput::Split { qkv: wq, z: wz } => {
                self.mm(wq, &xin, None, &mut qkv)?;
                self.mm(wz, &xin, None, &mut z)?;
            }
            DeltaInput::Fused { ssm_in } => {
                let width = 2 * dk + 2 * ratio * dv;
                let mut f = d.scratch::<f32>(m * ssm_in.rows)?;
                self.mm(ssm_in, &xin, None, &mut f)?;
                let vs = ratio * dv;
                let m1 = self.map((2, hk, dk, vs), || {
                    let mut map = vec![0i32; cd];
                    for g in 0..hk {
                        for i in 0..dk {
                            map[g * dk + i] = (g * width + i) as i32;
                            map[kd + g * dk + i] = (g * width + dk + i) as i32;
                        }
                        for i in 0..vs {
                            map[2 * kd + g * vs + i] = (g * width + 2 * dk + i) as i32;
                        }
                    }
                    map
                })?;
                let m2 = self.map((3, hk, dk, vs), || {
                    let mut map = vec![0i32; vd];
                    for g in 0..hk {
                        for i in 0..vs {
                            map[g * vs + i] = (g * width + 2 * dk + vs + i) as i32;
                        }
                    }
                    map
                })?;
                self.copy_cols(&f, ssm_in.rows, &mut qkv, cd, m1, m)?;
                self.copy_cols(&f, ssm_in.rows, &mut z, vd, m2, m)?;
            }
        }
        match &dn.ba {
            _ if grouped => {}
            DeltaBa::Fused(wba) => {
                let mut ba = d.scratch::<f32>(m * 2 * hv)?;
                self.mm(wba, &xin, None, &mut ba)?;
                let mb = self.map((4, hk, ratio, 0), || {
                    (0..hv)
                        .map(|n| ((n / ratio) * 2 * ratio + n % ratio) as i32)
                        .collect()
                })?;
                let ma = self.map((5, hk, ratio, 0), || {
                    (0..hv)
                        .map(|n| ((n / ratio) * 2 * ratio + ratio + n % ratio) as i32)
                        .collect()
                })?;
                self.copy_cols(&ba, 2 * hv, &mut b, hv, mb, m)?;
                self.copy_cols(&ba, 2 * hv, &mut a, hv, ma, m)?;
            }
            DeltaBa::Split { beta, alpha } => {
                self.mm(beta, &xin, None, &mut b)?;
                self.mm(alpha, &xin, None, &mut a)?;
            }
        }
        if self.prefetches(m) {
            self.prefetch_after_mixer_input(model, l, &dn.out)?;
        }
        let (conv_state, s_state) = st.linear[l].as_mut().ok_or_else(|| CudaError::Driver {
            op: "delta_net".into(),
            msg: format!("layer {l} has no delta-net state"),
        })?;
        if kc > 8 || kc == 0 {
            return Err(CudaError::Driver {
                op: "conv_rows".into(),
                msg: format!("conv kernel of {kc} taps: the kernel takes 1 to 8"),
            });
        }
        let mut conv = d.scratch::<f32>(m * cd)?;
        let taps = self.vec(&dn.conv)?;
        let (mi, cdi, kci) = (m as i32, cd as i32, kc as i32);
        let mut qk = d.scratch::<f32>(m * 2 * kd)?;
        let (hki, dki, eps) = (hk as i32, dk as i32, hp.eps);
        if self.conv_l2 && m == 1 && self.small_plan && dk <= 256 {
            // One decode row: the conv, the shift and the head norms in one
            // launch (a block a q/k head, then a thread a value channel).
            let blocks = 2 * hk + (cd - 2 * hk * dk).div_ceil(128);
            launch!(
                d,
                "conv_l2_one",
                cfg((blocks as u32, 1, 1), 128, 0),
                &qkv,
                taps,
                conv_state,
                &mut conv,
                &mut qk,
                &cdi,
                &kci,
                &hki,
                &dki,
                &eps
            )?;
        } else {
            if m <= 16 && self.small_plan {
                // Decode sizes: the conv and the state shift in one launch.
                launch!(
                    d,
                    "conv_small",
                    cfg1(cd),
                    &qkv,
                    taps,
                    conv_state,
                    &mut conv,
                    &mi,
                    &cdi,
                    &kci
                )?;
            } else {
                if self.conv_tile && kc == 4 {
                    launch!(
                        d,
                        "conv_tile",
                        cfg(
                            (cd.div_ceil(128) as u32, m.div_ceil(CONV_TR) as u32, 1),
                            128,
                            0
                        ),
                        &qkv,
                        taps,
                        &*conv_state,
                        &mut conv,
                        &mi,
                        &cdi
                    )?;
                } else {
                    launch!(
                        d,
                        "conv_rows",
                        cfg1(m * cd),
                        &qkv,
                        taps,
                        &*conv_state,
                        &mut conv,
                        &mi,
                        &cdi,
                        &kci
                    )?;
                }
                launch!(d, "conv_shift", cfg1(cd), &qkv, conv_state, &mi, &cdi, &kci)?;
            }
            // `HEAD_SUMS`: a lane a head, 32 heads a block.
            let warps = cfg(((m * 2 * hk).div_ceil(4) as u32, 1, 1), 128, 0);
            let (kernel, c) = if self.sq_lanes && self.head_sums && m > 16 && dk <= 256 {
                ("l2norm_qk_h", head_sums_cfg(m * 2 * hk, dk))
            } else if self.sq_lanes {
                ("l2norm_qk", warps)
            } else {
                ("l2norm_qk_lane0", warps)
            };
            launch!(d, kernel, c, &conv, &mut qk, &mi, &cdi, &hki, &dki, &eps)?;
        }
        let mut o = d.scratch::<f32>(m * vd)?;
        let (hvi, dvi, tiled) = (hv as i32, dv as i32, (hp.arch == Arch::Qwen35Moe) as i32);
        if dk > 512 {
            return Err(CudaError::Driver {
                op: "delta_rows".into(),
                msg: format!("key head dim {dk}: the delta-rule kernel takes at most 512"),
            });
        }
        let (dtb, sa, nw) = (
            self.vec(&dn.dt_bias)?,
            self.vec(&dn.a)?,
            self.vec(&dn.norm)?,
        );
        let cols_kernel = self.delta_kernel(dk, m);
        if let Some(kname) = cols_kernel {
            // Eight lanes per state column (the kernel for the usual head
            // dims). The three-buffer kernels stage in dynamic shared memory:
            // 3 buffers of 16 rows of 2 (8 (dk / 8 + 4)) + 16 floats (ops.cu,
            // delta_cols_async's ROWF).
            let smem = if kname.starts_with("delta_cols_async_tri_") {
                (3 * 16 * (2 * 8 * (dk / 8 + 4) + 16) * 4) as u32
            } else {
                0
            };
            launch!(
                d,
                kname,
                cfg((hv as u32, dv.div_ceil(16) as u32, 1), 128, smem),
                &qk,
                &conv,
                &b,
                &a,
                dtb,
                sa,
                s_state,
                &mut o,
                &mi,
                &hki,
                &hvi,
                &dvi,
                &tiled
            )?;
        } else {
            launch!(
                d,
                "delta_rows",
                cfg(
                    (hv as u32, dv.div_ceil(32) as u32, 1),
                    32,
                    ((dk * 32 + 16 * 2 * dk + 32) * 4) as u32
                ),
                &qk,
                &conv,
                &b,
                &a,
                dtb,
                sa,
                s_state,
                &mut o,
                &mi,
                &hki,
                &hvi,
                &dki,
                &dvi,
                &tiled
            )?;
        }
        let rh = (m * hv) as i32;
        // `GN_FOLD`: one row, the output projection's blocks take the gated
        // norm and its Q8_K blocks themselves.
        if self.gn_fold
            && m == 1
            && self.gn_q8k
            && self.row_kernels
            && self.lane_rows
            && dn.out.ty == GgmlType::Q4_K
            && dn.out.cols == vd
            && dv % 32 == 0
            && 256 % dv == 0
            && vd % 256 == 0
        {
            let nb = (vd / 256) as i32;
            let (wptr, row_bytes, rows) = (
                self.wptr(&dn.out)?,
                dn.out.row_bytes as i32,
                dn.out.rows as i32,
            );
            if y.len() < dn.out.rows {
                return Err(CudaError::Driver {
                    op: "delta_rows".into(),
                    msg: format!(
                        "{}: an output of {} for {} rows",
                        dn.out.name,
                        y.len(),
                        dn.out.rows
                    ),
                });
            }
            launch!(
                d,
                "mm_q4_k_lane_gn_1",
                lane_cfg(dn.out.rows, m, nb),
                &wptr,
                &row_bytes,
                &o,
                &z,
                nw,
                y,
                &rows,
                &mi,
                &nb,
                &dvi,
                &eps
            )?;
            return Ok(());
        }
        // With the out projection reading Q8_K rows, the norm writes them
        // too (four heads a block: whole 256-blocks of one row).
        if self.gn_q8k && k_quant(dn.out.ty) && dv <= 256 && dv % 64 == 0 && hv % 4 == 0 {
            let mut q = d.scratch::<u8>(m * hv * dv / 256 * 304)?;
            // Decode-sized calls keep lane 0's squares: with the lanes'
            // squares in gated_norm_q8k and conv_l2_one, qwen35moe tg128 fell
            // from 315-319 to 302.5 tok/s (H200, session 17; the only decode
            // change specific to that model), while prefill gained 0.6%.
            // `HEAD_SUMS`: a lane a head, 32 heads a block.
            let warps = cfg(((m * hv).div_ceil(4) as u32, 1, 1), 128, 0);
            let (kernel, c) = if self.sq_lanes && self.head_sums && m > 16 {
                ("gated_norm_q8k_h", head_sums_cfg(m * hv, dv))
            } else if self.sq_lanes && m > 16 {
                ("gated_norm_q8k", warps)
            } else {
                ("gated_norm_q8k_lane0", warps)
            };
            launch!(d, kernel, c, &mut o, &z, nw, &mut q, &rh, &dvi, &eps)?;
            return self.mm(&dn.out, &Input::with_q8k(&o, m, Some(q)), None, y);
        }
        launch!(
            d,
            "gated_norm",
            cfg(((m * hv).div_ceil(4) as u32, 1, 1), 128, 0),
            &mut o,
            &z,
            nw,
            &rh,
            &dvi,
            &eps
        )?;
        self.matmul(&dn.out, &o, m, None, y)
    }

    /// The expert plan of `n` (token, k) pairs (`ids`, -1 for skipped):
    /// each expert's rows padded to `pad`, placed in token order. Returns the
    /// placed pairs' token rows and experts (`cap` places, -1 where unused)
    /// and each pair's place (-1 for skipped ids). `small` (up to 256 pairs)
    /// runs it as one launch, otherwise as histogram, scan and placement:
    /// the same results.
    #[allow(clippy::too_many_arguments)]
    fn plan(
        &self,
        ids: &CudaSlice<i32>,
        n: usize,
        k: usize,
        e: usize,
        pad: usize,
        cap: usize,
        small: bool,
    ) -> Result<(CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>)> {
        let d = &self.dev;
        let (ei, ki, ni, padi, capi) = (e as i32, k as i32, n as i32, pad as i32, cap as i32);
        let mut placed_row = d.scratch::<i32>(cap)?;
        let mut placed_mat = d.scratch::<i32>(cap)?;
        let mut slot = d.scratch::<i32>(n)?;
        if small && n <= PLAN_SMALL_PAIRS && e <= PLAN_SMALL_EXPERTS {
            launch!(
                d,
                "plan_small",
                cfg((1, 1, 1), 256, 0),
                ids,
                &ni,
                &ki,
                &ei,
                &padi,
                &mut placed_row,
                &mut placed_mat,
                &mut slot,
                &capi
            )?;
            return Ok((placed_row, placed_mat, slot));
        }
        let mut counts = d.zeros::<i32>(e)?;
        launch!(
            d,
            "plan_count",
            cfg1(cap),
            ids,
            &ni,
            &mut counts,
            &mut placed_row,
            &mut placed_mat,
            &capi
        )?;
        if self.plan_wide {
            launch!(
                d,
                "plan_place_wide",
                cfg((e as u32, 1, 1), 256, 0),
                ids,
                &ni,
                &ki,
                &counts,
                &padi,
                &mut placed_row,
                &mut placed_mat,
                &mut slot
            )?;
            return Ok((placed_row, placed_mat, slot));
        }
        let mut offsets = d.scratch::<i32>(e)?;
        launch!(
            d,
            "plan_scan",
            cfg((1, 1, 1), 1024, 0),
            &counts,
            &mut offsets,
            &ei,
            &padi
        )?;
        launch!(
            d,
            "plan_place",
            cfg((e as u32, 1, 1), 256, 0),
            ids,
            &ni,
            &ki,
            &offsets,
            &mut placed_row,
            &mut placed_mat,
            &mut slot
        )?;
        Ok((placed_row, placed_mat, slot))
    }

    /// Route `m` rows of router logits (softmax in place, top `k` ids and
    /// weights) and plan their pairs: one launch for decode-sized calls
    /// (`route_plan_small`, with the small plan on), else `route` then
    /// [`Cuda::plan`]. The same results either way.
    #[allow(clippy::too_many_arguments)]
    fn route_plan(
        &self,
        logits: &mut CudaSlice<f32>,
        ids: &mut CudaSlice<i32>,
        wts: &mut CudaSlice<f32>,
        m: usize,
        e: usize,
        k: usize,
        pad: usize,
        cap: usize,
    ) -> Result<(CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>)> {
        let d = &self.dev;
        let n = m * k;
        if e > 2048 {
            return Err(CudaError::Driver {
                op: "route".into(),
                msg: format!("{e} experts: the router kernel takes at most 2048"),
            });
        }
        let (mi, ei, ki, padi, capi) = (m as i32, e as i32, k as i32, pad as i32, cap as i32);
        if self.small_plan && n <= PLAN_SMALL_PAIRS && e <= PLAN_SMALL_EXPERTS {
            // With block routing on, up to 4 rows are routed one at a time by
            // the whole block.
            let block_rows: i32 = if self.block_route { 4 } else { 0 };
            let mut placed_row = d.scratch::<i32>(cap)?;
            let mut placed_mat = d.scratch::<i32>(cap)?;
            let mut slot = d.scratch::<i32>(n)?;
            if self.route_one && m == 1 && k <= 32 && e <= 1024 && block_rows == 0 {
                let name = self.route_kernels().1;
                launch!(
                    d,
                    name,
                    cfg((1, 1, 1), 32, 0),
                    logits,
                    ids,
                    wts,
                    &ei,
                    &ki,
                    &padi,
                    &mut placed_row,
                    &mut placed_mat,
                    &mut slot,
                    &capi
                )?;
                return Ok((placed_row, placed_mat, slot));
            }
            launch!(
                d,
                "route_plan_small",
                cfg((1, 1, 1), 256, 0),
                logits,
                ids,
                wts,
                &mi,
                &ei,
                &ki,
                &padi,
                &mut placed_row,
                &mut placed_mat,
                &mut slot,
                &capi,
                &block_rows
            )?;
            return Ok((placed_row, placed_mat, slot));
        }
        launch!(
            d,
            "route",
            cfg((m.div_ceil(4) as u32, 1, 1), 128, 0),
            logits,
            ids,
            wts,
            &mi,
            &ei,
            &ki
        )?;
        self.plan(ids, n, k, e, pad, cap, self.small_plan)
    }

    /// Routing and plan on host logits, for the kernel tests: (softmaxed
    /// logits, ids, weights, placed rows, placed experts, slots), through the
    /// one-launch kernel (`small`) or `route` and the three-kernel plan.
    #[doc(hidden)]
    #[allow(clippy::type_complexity)]
    pub fn route_plan_host(
        &mut self,
        logits: &[f32],
        m: usize,
        k: usize,
        pad: usize,
        small: bool,
    ) -> Result<(Vec<f32>, Vec<i32>, Vec<f32>, Vec<i32>, Vec<i32>, Vec<i32>)> {
        let e = logits.len() / m.max(1);
        let n = m * k;
        let cap = n + e.min(n) * (pad - 1);
        let was = self.small_plan;
        self.small_plan = small;
        let mut lg = self.dev.upload(logits)?;
        let mut ids = self.dev.upload(&vec![i32::MIN; n])?;
        let mut wts = self.dev.upload(&vec![f32::NAN; n])?;
        let r = self.route_plan(&mut lg, &mut ids, &mut wts, m, e, k, pad, cap);
        self.small_plan = was;
        let (pr, pm, sl) = r?;
        Ok((
            self.dev.download(&lg, m * e)?,
            self.dev.download(&ids, n)?,
            self.dev.download(&wts, n)?,
            self.dev.download(&pr, cap)?,
            self.dev.download(&pm, cap)?,
            self.dev.download(&sl, n)?,
        ))
    }

    /// The expert plan on host data, for the kernel tests: (placed rows,
    /// placed experts, slots), through the one-launch kernel (`small`) or
    /// the three-kernel path.
    #[doc(hidden)]
    pub fn plan_host(
        &self,
        ids: &[i32],
        k: usize,
        e: usize,
        pad: usize,
        small: bool,
    ) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let n = ids.len();
        let cap = n + e.min(n) * (pad - 1);
        let idd = self.dev.upload(ids)?;
        let (r, m, sl) = self.plan(&idd, n, k, e, pad, cap, small)?;
        Ok((
            self.dev.download(&r, cap)?,
            self.dev.download(&m, cap)?,
            self.dev.download(&sl, n)?,
        ))
    }

    /// The shared expert of `m` token rows: ys = down(silu(gate x) * up x),
    /// gi = the gate's input projection (sigmoid applied by the combine).
    fn shared_expert(
        &self,
        sh: &samesum_engine::model::weights::SharedW,
        xin: &Input,
        m: usize,
        fs: usize,
        ys: &mut CudaSlice<f32>,
        gi: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let mut sg = self.dev.scratch::<f32>(m * fs)?;
        let bases = [self.wptr(&sh.gate)?, self.wptr(&sh.up)?];
        let q = self.glu_on(
            &sh.gate,
            &sh.up,
            bases,
            xin,
            None,
            &mut sg,
            k_quant(sh.down.ty),
        )?;
        self.mm(&sh.gate_inp, xin, None, gi)?;
        self.mm(&sh.down, &Input::with_q8k(&sg, m, q), None, ys)
    }

    /// The rest of a decode-sized MoE call with a shared expert (see
    /// `moe_rows`): both GLUs in one launch into one buffer (the routed
    /// rows, then the token rows), one quantization of it, both down
    /// projections in one launch, then the combine. The routed pairs read
    /// their token's quantized row through `placed_row` (the bytes a gather
    /// would have copied), so no gather runs.
    #[allow(clippy::too_many_arguments)]
    fn moe_joint_rows(
        &self,
        mw: &MoeW,
        sh: Option<&samesum_engine::model::weights::SharedW>,
        bases: [u64; 3],
        mats: &CudaSlice<i32>,
        placed_row: &CudaSlice<i32>,
        xin: &Input,
        cap: usize,
        m: usize,
        slot: &CudaSlice<i32>,
        wts: &CudaSlice<f32>,
        gi: Option<CudaSlice<f32>>,
        y: &mut CudaSlice<f32>,
        k: usize,
        after: Option<&AfterNorm>,
    ) -> Result<Option<CudaSlice<u8>>> {
        use crate::device::{MoeJobs, addr};
        let d = &self.dev;
        let (f, dm) = (mw.gate.rows, mw.down.rows);
        let q8_0 = |t: GgmlType| t == GgmlType::Q8_0;
        let quant = |input: &Input, t: GgmlType| -> Result<u64> {
            Ok(addr(
                d,
                if q8_0(t) {
                    input.q80(d)?
                } else {
                    input.q8k(d)?
                },
            ))
        };
        let kname = |t: GgmlType, glu: bool| match (t, glu) {
            (GgmlType::Q4_K, true) => "mm_q4_k_moe_glu_1",
            (GgmlType::Q5_K, true) => "mm_q5_k_moe_glu_1",
            (GgmlType::Q6_K, true) => "mm_q6_k_moe_glu_1",
            (_, true) => "mm_q8_0_moe_glu_1",
            (GgmlType::Q4_K, false) => "mm_q4_k_moe_1",
            (GgmlType::Q5_K, false) => "mm_q5_k_moe_1",
            (GgmlType::Q6_K, false) => "mm_q6_k_moe_1",
            (_, false) => "mm_q8_0_moe_1",
        };
        let nb = |w: &Matrix| (w.cols / if q8_0(w.ty) { 32 } else { 256 }) as i32;
        // Both GLUs: rows 0..cap the routed pairs, cap..cap+m the tokens
        // (a second job only with a shared expert).
        let ms = if sh.is_some() { m } else { 0 };
        let jobs_n = 1 + sh.is_some() as usize;
        let g = d.scratch::<f32>((cap + ms) * f)?;
        let gp = addr(d, &g);
        let xq = quant(xin, mw.gate.ty)?;
        let mut jobs = MoeJobs {
            wg: [
                bases[0],
                sh.map(|s| self.wptr(&s.gate)).transpose()?.unwrap_or(0),
            ],
            wu: [
                bases[1],
                sh.map(|s| self.wptr(&s.up)).transpose()?.unwrap_or(0),
            ],
            stride: [(mw.gate.rows * mw.gate.row_bytes) as i64, 0],
            mats: [addr(d, mats), 0],
            a: [xq, xq],
            y: [gp, gp + (cap * f * 4) as u64],
            amap: [addr(d, placed_row), 0],
            rows: [f as i32, f as i32],
            m: [cap as i32, ms as i32],
        };
        let lane = |t: GgmlType| self.lane_rows && t == GgmlType::Q4_K;
        let moe_cfg = |t: GgmlType, rows: usize, nb: i32| {
            if lane(t) {
                cfg(
                    ((jobs_n * rows.div_ceil(32)) as u32, cap.max(ms) as u32, 1),
                    lane_threads(nb),
                    0,
                )
            } else {
                cfg(
                    ((jobs_n * rows.div_ceil(4)) as u32, cap.max(ms) as u32, 1),
                    128,
                    0,
                )
            }
        };
        let (rb, nbg) = (mw.gate.row_bytes as i32, nb(&mw.gate));
        let row_q = if q8_0(mw.down.ty) {
            f / 32 * 36
        } else {
            f / 256 * 304
        };
        let gin = Input::new(&g, cap + ms);
        // The lane GLU can write its outputs' Q8_K rows itself (its last
        // block per 256 columns quantizes them): no quantize launch.
        let glu_q = self.glu_q8k
            && lane(mw.gate.ty)
            && k_quant(mw.down.ty)
            && f.is_multiple_of(256)
            && f <= 4096
            && cap.max(ms) <= 32;
        let qin = self.down_qin && !glu_q && lane(mw.down.ty) && f.is_multiple_of(256);
        let ga = if glu_q {
            let gq = d.scratch::<u8>((cap + ms) * row_q)?;
            let (q0, q1) = (addr(d, &gq), addr(d, &gq) + (cap * row_q) as u64);
            let c0 = self.dev.lane() * COUNTERS + GLU_COUNTERS;
            let cnt = self.counters.slice(c0..c0 + 1024);
            launch!(
                d,
                "mm_q4_k_lane_moe_glu_q8k_1",
                moe_cfg(mw.gate.ty, f, nbg),
                &jobs,
                &rb,
                &nbg,
                &q0,
                &q1,
                &cnt
            )?;
            let _ = gin.q8k.set(gq);
            q0
        } else {
            launch!(
                d,
                if lane(mw.gate.ty) {
                    "mm_q4_k_lane_moe_glu_1"
                } else {
                    kname(mw.gate.ty, true)
                },
                moe_cfg(mw.gate.ty, f, nbg),
                &jobs,
                &rb,
                &nbg
            )?;
            // One quantization of both, then both down projections (with
            // `DOWN_QIN`, the down launch quantizes the rows it reads).
            if qin { gp } else { quant(&gin, mw.down.ty)? }
        };
        let oe = d.scratch::<f32>(cap * dm)?;
        let ys = d.scratch::<f32>((ms * dm).max(1))?;
        jobs.wg = [
            bases[2],
            sh.map(|s| self.wptr(&s.down)).transpose()?.unwrap_or(0),
        ];
        jobs.wu = [0, 0];
        jobs.stride = [(mw.down.rows * mw.down.row_bytes) as i64, 0];
        jobs.a = if qin {
            [ga, ga + (cap * f * 4) as u64]
        } else {
            [ga, ga + (cap * row_q) as u64]
        };
        jobs.y = [addr(d, &oe), addr(d, &ys)];
        jobs.amap = [0, 0];
        jobs.rows = [dm as i32, dm as i32];
        let (rb, nbd) = (mw.down.row_bytes as i32, nb(&mw.down));
        launch!(
            d,
            if qin {
                "mm_q4_k_lane_moe_qin_1"
            } else if lane(mw.down.ty) {
                "mm_q4_k_lane_moe_1"
            } else {
                kname(mw.down.ty, false)
            },
            moe_cfg(mw.down.ty, dm, nbd),
            &jobs,
            &rb,
            &nbd
        )?;
        let gi = match gi {
            Some(gi) => gi,
            None => d.scratch::<f32>(1)?,
        };
        let (mi, ki, dmi, shared) = (m as i32, k as i32, dm as i32, sh.is_some() as i32);
        if let Some(an) = after {
            let mut q = d.scratch::<u8>(m * dm / 256 * 304)?;
            launch!(
                d,
                "moe_combine_add_rms_norm_q8k",
                cfg((m as u32, 1, 1), 256, 0),
                &oe,
                slot,
                wts,
                &ys,
                &gi,
                y,
                &ki,
                &shared,
                &an.acc,
                an.w,
                &an.out,
                &mut q,
                &dmi,
                &an.eps
            )?;
            return Ok(Some(q));
        }
        launch!(
            d,
            "moe_combine",
            cfg1(m * dm),
            &oe,
            slot,
            wts,
            &ys,
            &gi,
            y,
            &mi,
            &ki,
            &dmi,
            &shared
        )?;
        Ok(None)
    }

    /// [`Backend::moe_add_rms_norm`], with `prenorm` (see [`PreNorm`]) the
    /// post-mixer norm run in the router launch.
    #[allow(clippy::too_many_arguments)]
    fn moe_then_norm(
        &self,
        model: &Model,
        mw: &MoeW,
        which: Norm,
        h: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        prenorm: Option<&PreNorm>,
    ) -> R<()> {
        let w = which.weight(model);
        // The fused norm is add_rms_norm_q8k's (a layer norm of Q8_K width).
        let fits = self.moe_norm
            && self.norm_quant
            && !matches!(which, Norm::Output)
            && w.len() == model.hp.n_embd
            && w.len().is_multiple_of(256)
            && h.len() == x.len()
            && y.len() == x.len();
        if fits {
            let d = &self.dev;
            let an = AfterNorm {
                acc: crate::device::addr(d, h),
                w: self.vec(w).map_err(e)?,
                out: crate::device::addr(d, x),
                eps: model.hp.eps,
            };
            if let Some(q) = self
                .moe_rows_then(model, mw, x, y, Some(&an), prenorm)
                .map_err(e)?
            {
                self.keep_norm_q8k(x, q);
                return Ok(());
            }
        } else {
            self.moe_rows_then(model, mw, x, y, None, prenorm)
                .map_err(e)?;
        }
        self.add_rms_norm(model, which, h, y, x)
    }

    fn moe_rows(
        &self,
        model: &Model,
        mw: &MoeW,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.moe_rows_then(model, mw, x, y, None, None).map(|_| ())
    }

    /// `moe_rows`, and where `after` is given and the call takes the
    /// decode launches (`moe_joint_rows`), the next norm in the combine's
    /// launch: then the norm's Q8_K rows are returned (else `None`, and the
    /// caller runs the norm). With `prenorm` (one decode row whose routing
    /// folds into the router launch, see [`Cuda::route_folds`]), the router
    /// launch first runs that norm and writes `x` and its Q8_K rows; an
    /// error if the routing would not fold.
    #[allow(clippy::too_many_arguments)]
    fn moe_rows_then(
        &self,
        model: &Model,
        mw: &MoeW,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        after: Option<&AfterNorm>,
        prenorm: Option<&PreNorm>,
    ) -> Result<Option<CudaSlice<u8>>> {
        // With `prenorm` the router launch writes x and its Q8_K rows.
        let pre = match prenorm {
            Some(_) => Some(
                self.dev
                    .scratch::<u8>(x.len() / model.hp.n_embd * (model.hp.n_embd / 256) * 304)?,
            ),
            None => self.take_norm_q8k(x),
        };
        let prenorm_q = prenorm
            .and(pre.as_ref())
            .map(|q| crate::device::addr(&self.dev, q));
        let hp = &model.hp;
        let d = &self.dev;
        let (dm, e, k, f, fs) = (
            hp.n_embd,
            hp.n_expert,
            hp.n_expert_used,
            hp.n_ff_exp,
            hp.n_ff_shexp,
        );
        let m = x.len() / dm;
        let n = m * k;
        // Wide calls pad each expert's rows to the tensor-core tile, so a tile
        // holds one expert; `cap` bounds the padded total (at most min(e, n)
        // experts have rows). Rows past the real ones stay unused (-1).
        let pad = if n > 16 && self.tensor_cores {
            self.tc_pad(n, e)
        } else {
            1
        };
        let cap = n + e.min(n) * (pad - 1);
        let mut logits = d.scratch::<f32>(m * e)?;
        let xin = Input::with_q8k(x, m, pre);
        // Decode-sized calls with a shared expert of the routed experts'
        // shape run both in the same launches (`mm_*_moe_*`: router and
        // input gate, the GLUs, one quantization of both GLU outputs, the
        // down projections), each row computed as the separate kernels do.
        // Without a shared expert the routed experts alone take those
        // launches (`routed_only`). Either way the routed pairs read their
        // token's quantized row in place, with no gather.
        let joint_ok = self.moe_joint
            && self.tier.is_none()
            && self.row_kernels
            && self.glu
            && cap <= 16
            && (mw.up.ty, mw.up.cols, mw.up.row_bytes)
                == (mw.gate.ty, mw.gate.cols, mw.gate.row_bytes)
            && matches!(
                mw.gate.ty,
                GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_0
            )
            && matches!(
                mw.down.ty,
                GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_0
            );
        let joint = match &mw.shared {
            Some(sh)
                if joint_ok
                    && f == fs
                    && mw.router.ty == GgmlType::F32
                    && sh.gate_inp.ty == GgmlType::F32
                    && sh.gate_inp.cols == mw.router.cols
                    && [&sh.gate, &sh.up].iter().all(|w| {
                        (w.ty, w.cols, w.row_bytes) == (mw.gate.ty, mw.gate.cols, mw.gate.row_bytes)
                    })
                    && (sh.down.ty, sh.down.cols, sh.down.row_bytes)
                        == (mw.down.ty, mw.down.cols, mw.down.row_bytes) =>
            {
                Some(sh)
            }
            _ => None,
        };
        let routed_only = mw.shared.is_none() && joint_ok;
        let mut gi_joint = None;
        let mut ids = d.scratch::<i32>(n)?;
        let mut wts = d.scratch::<f32>(n)?;
        let (mi, ki) = (m as i32, k as i32);
        // One decode row: the router's launch routes it too, as
        // route_plan_one would (see route_plan's conditions).
        let fold = self.route_folds(mw, m, k, e);
        if prenorm.is_some() && !fold {
            return Err(CudaError::Driver {
                op: "moe".into(),
                msg: "the post-mixer norm in the router launch needs the routing folded into it"
                    .into(),
            });
        }
        let mut folded = None;
        if joint.is_some() || fold {
            let gi = d.scratch::<f32>(m)?;
            let (w1, y1, r1) = match joint {
                Some(sh) => (self.wptr(&sh.gate_inp)?, crate::device::addr(d, &gi), 1),
                None => (0, 0, 0),
            };
            let nj = if joint.is_some() { 2 } else { 1 };
            let mj = crate::device::MmJobs {
                w: [self.wptr(&mw.router)?, w1, 0, 0],
                y: [crate::device::addr(d, &logits), y1, 0, 0],
                rows: [e as i32, r1, 0, 0],
                nj,
            };
            let blocks = (e.div_ceil(4) + r1 as usize) as u32;
            let (rb, ci) = (mw.router.row_bytes as i32, dm as i32);
            if fold {
                let mut placed_row = d.scratch::<i32>(cap)?;
                let mut placed_mat = d.scratch::<i32>(cap)?;
                let mut slot = d.scratch::<i32>(n)?;
                let (ei, padi, capi) = (e as i32, pad as i32, cap as i32);
                let c0 = self.dev.lane() * COUNTERS;
                let counter = self.counters.slice(c0..c0 + 1);
                // The two router launches differ in the arguments before the
                // row width (the input row, or the norm's), not after.
                macro_rules! route_launch {
                    ($name:expr, $cfg:expr, $($head:expr),+) => {
                        launch!(
                            d,
                            $name,
                            $cfg,
                            &mj,
                            &rb,
                            $($head,)+
                            &ci,
                            &mut ids,
                            &mut wts,
                            &ei,
                            &ki,
                            &padi,
                            &mut placed_row,
                            &mut placed_mat,
                            &mut slot,
                            &capi,
                            &counter
                        )
                    };
                }
                if let (Some(pn), Some(qo)) = (prenorm, prenorm_q) {
                    let xo = crate::device::addr(d, x);
                    route_launch!(
                        "mm_f32_multi_route_norm",
                        cfg((blocks, 1, 1), 128, 0),
                        &pn.acc,
                        &pn.inc,
                        pn.w,
                        &xo,
                        &qo,
                        &pn.eps
                    )?;
                } else {
                    let kernel = self.route_kernels().0;
                    if self.router_1w && kernel == "mm_f32_multi_route_rd" {
                        // A warp (a router row) a block.
                        let blocks1 = (e + r1 as usize) as u32;
                        route_launch!("mm_f32_multi_route_rd1", cfg((blocks1, 1, 1), 32, 0), x)?;
                    } else {
                        route_launch!(kernel, cfg((blocks, 1, 1), 128, 0), x)?;
                    }
                }
                folded = Some((placed_row, placed_mat, slot));
            } else {
                launch!(
                    d,
                    "mm_f32_multi",
                    cfg((blocks, m.div_ceil(16) as u32, 1), 128, 0),
                    &mj,
                    &rb,
                    x,
                    &mi,
                    &ci
                )?;
            }
            if joint.is_some() {
                gi_joint = Some(gi);
            }
        } else {
            self.mm(&mw.router, &xin, None, &mut logits)?;
        }
        let (placed_row, placed_mat, slot) = match folded {
            Some(p) => p,
            None => self.route_plan(&mut logits, &mut ids, &mut wts, m, e, k, pad, cap)?,
        };
        // This MoE's layer (its index picks the tier's expert slots and the
        // next layer's weights to prefetch).
        let layer = model.w.layers.iter().position(|l| std::ptr::eq(&l.moe, mw));
        if self.prefetches(m)
            && let Some(next) = layer.and_then(|l| model.w.layers.get(l + 1))
        {
            // The next layer's input projections, while the experts run.
            match &next.mixer {
                Mixer::Attention(a) => self.prefetch_mats(&[&a.q, &a.k, &a.v])?,
                Mixer::Linear(dn) => {
                    let mut mats: Vec<&Matrix> = match &dn.input {
                        DeltaInput::Split { qkv, z } => vec![qkv, z],
                        DeltaInput::Fused { ssm_in } => vec![ssm_in],
                    };
                    match &dn.ba {
                        DeltaBa::Split { beta, alpha } => mats.extend([beta, alpha]),
                        DeltaBa::Fused(ba) => mats.push(ba),
                    }
                    self.prefetch_mats(&mats)?;
                }
            }
        }
        let capi = cap as i32;
        // The shared expert's outputs (written on the second stream when it
        // runs beside the routed experts: prefill-sized calls, resident
        // weights, launches not being timed).
        let mut ys = d.scratch::<f32>(if mw.shared.is_some() { m * dm } else { 1 })?;
        let mut gi = d.scratch::<f32>(m.max(1))?;
        let side_done = match &mw.shared {
            Some(sh) if self.overlap && m > 16 && self.tier.is_none() && !d.profiling() => {
                // The token rows' quantized form, made on the main stream
                // before the fork (it is read on both streams).
                match sh.gate.ty {
                    GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                        xin.q8k(d)?;
                    }
                    GgmlType::Q8_0 => {
                        xin.q80(d)?;
                    }
                    _ => {}
                }
                let ((), ev) =
                    d.on_side(|| self.shared_expert(sh, &xin, m, fs, &mut ys, &mut gi))?;
                Some(ev)
            }
            _ => None,
        };
        // Where the experts' weights are read: the resident file, or in tier
        // mode the decode cache's slot pools (rows remapped from expert ids
        // to slots) or a staged copy of the layer (expert ids as they are).
        // Either way every row reads the same bytes.
        let mut remapped = None;
        let mut staged = None;
        let bases = match (&self.tier, layer) {
            (Some(t), Some(l)) if t.uses_cache(m, k) => {
                // The one read-back per layer: the step's expert ids.
                let ids_h = d.download(&ids, n)?;
                let (table, bases) = t.fetch(d, model, l, &ids_h)?;
                let table = d.upload(&table)?;
                let mut mats = d.scratch::<i32>(cap)?;
                launch!(
                    d,
                    "remap_ids",
                    cfg1(cap),
                    &placed_mat,
                    &table,
                    &mut mats,
                    &capi
                )?;
                remapped = Some(mats);
                bases
            }
            (Some(t), Some(l)) => {
                let (b, bases) = t.stage(d, model, l)?;
                staged = Some((t, b, l));
                bases
            }
            _ => [
                self.wptr(&mw.gate)?,
                self.wptr(&mw.up)?,
                self.wptr(&mw.down)?,
            ],
        };
        let mats = remapped.as_ref().unwrap_or(&placed_mat);
        if joint.is_some() || routed_only {
            return self.moe_joint_rows(
                mw,
                joint,
                bases,
                mats,
                &placed_row,
                &xin,
                cap,
                m,
                &slot,
                &wts,
                gi_joint,
                y,
                k,
                after,
            );
        }
        // Gather, the experts' rows (each tile reads its experts' weights once), down.
        // Where gate and up read Q8_K activations, the token rows are
        // quantized once and their blocks gathered (a quantized row is a
        // function of the row alone; the shared expert reuses them), else
        // the f32 rows are gathered.
        let dmi = dm as i32;
        let gather_quantized =
            self.quantized_gather && k_quant(mw.gate.ty) && k_quant(mw.up.ty) && dm % 256 == 0;
        let xe;
        let xein = if gather_quantized {
            let xq = xin.q8k(d)?;
            let words = dm / 256 * 304 / 16;
            let mut xeq = d.scratch::<u8>(cap * words * 16)?;
            let wi = words as i32;
            launch!(
                d,
                if self.live_rows {
                    "gather_words_live"
                } else {
                    "gather_words"
                },
                cfg1(cap * words),
                xq,
                &placed_row,
                &mut xeq,
                &wi,
                &capi
            )?;
            Input::quantized(xeq, cap, dm)
                .padded(pad)
                .live(self.live_rows)
        } else {
            let mut rows = d.scratch::<f32>(cap * dm)?;
            launch!(
                d,
                "gather_rows",
                cfg1(cap * dm),
                x,
                &placed_row,
                &mut rows,
                &dmi,
                &capi
            )?;
            xe = rows;
            Input::new(&xe, cap).padded(pad).live(self.live_rows)
        };
        let mut ge = d.scratch::<f32>(cap * f)?;
        let tc = self.tensor_cores;
        let gq = self.glu_on(
            &mw.gate,
            &mw.up,
            [bases[0], bases[1]],
            &xein,
            Some(mats),
            &mut ge,
            k_quant(mw.down.ty),
        )?;
        let mut oe = d.scratch::<f32>(cap * dm)?;
        let gin = Input::with_q8k(&ge, cap, gq)
            .padded(pad)
            .live(self.live_rows);
        self.matmul_on(&mw.down, bases[2], &gin, Some(mats), &mut oe, tc)?;
        if let Some((t, b, l)) = staged {
            t.staged_read(d, model, b, l)?;
        }
        // Shared expert: computed beside the routed experts (above) when it
        // went to the second stream, here otherwise.
        if let Some(ev) = &side_done {
            d.wait_for(ev)?;
        } else if let Some(sh) = &mw.shared {
            self.shared_expert(sh, &xin, m, fs, &mut ys, &mut gi)?;
        }
        let shared = mw.shared.is_some().then_some((&ys, &gi));
        self.moe_combine_on(&oe, &slot, &wts, shared, y, m, k, dm)?;
        Ok(None)
    }

    /// A wide call's MoE combine: `y[r] = sum over s < k, slot[r k + s] >= 0,
    /// in s order, of wts[r k + s] * out[slot[r k + s]]`, then, with a shared
    /// expert `(ys, gi)`, `+ sigmoid(gi[r]) * ys[r]`; on `moe_combine4` (four
    /// columns a thread) with `COMBINE_VEC`, `d` a multiple of 4 and the
    /// three row buffers 16-byte aligned, else `moe_combine`. The same bytes
    /// either way.
    #[allow(clippy::too_many_arguments)]
    fn moe_combine_on(
        &self,
        out: &CudaSlice<f32>,
        slot: &CudaSlice<i32>,
        wts: &CudaSlice<f32>,
        shared: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        y: &mut CudaSlice<f32>,
        m: usize,
        k: usize,
        d: usize,
    ) -> Result<()> {
        let dev = &self.dev;
        // Without a shared expert the kernel reads neither pointer.
        let unused;
        let (ys, gi) = match shared {
            Some(pair) => pair,
            None => {
                unused = dev.scratch::<f32>(1)?;
                (&unused, &unused)
            }
        };
        let (mi, ki, di, sh) = (m as i32, k as i32, d as i32, shared.is_some() as i32);
        // 16-byte loads and stores: whole rows of them, from aligned bases.
        let vec = self.combine_vec
            && d.is_multiple_of(4)
            && [addr(dev, out), addr(dev, ys), addr(dev, &*y)]
                .iter()
                .all(|a| a.is_multiple_of(16));
        launch!(
            dev,
            if vec { "moe_combine4" } else { "moe_combine" },
            cfg1(if vec { m * d / 4 } else { m * d }),
            out,
            slot,
            wts,
            ys,
            gi,
            y,
            &mi,
            &ki,
            &di,
            &sh
        )
    }

    /// `moe_combine_on` of host rows (for tests): `out` holds the expert
    /// rows (`d` wide), `slot` and `wts` `k` a row for `m` rows, `shared`
    /// the shared expert's rows and gate inputs. The output starts as NaN.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_host(
        &self,
        out: &[f32],
        slot: &[i32],
        wts: &[f32],
        shared: Option<(&[f32], &[f32])>,
        m: usize,
        k: usize,
        d: usize,
    ) -> Result<Vec<f32>> {
        // Sizes and slots that would send the kernel out of its buffers are
        // an error naming what disagrees.
        let rows = out.len().checked_div(d).unwrap_or(0);
        let shared_ok = shared.is_none_or(|(ys, gi)| ys.len() == m * d && gi.len() == m);
        let bad_slot = slot.iter().find(|&&s| s >= 0 && s as usize >= rows);
        if d == 0
            || !out.len().is_multiple_of(d)
            || slot.len() != m * k
            || wts.len() != m * k
            || !shared_ok
            || bad_slot.is_some()
        {
            return Err(CudaError::Driver {
                op: "moe_combine".into(),
                msg: format!(
                    "{m} rows x {k} slots of width {d}: out {} values ({rows} rows), slot {}, \
                     wts {}, shared {:?}, first slot past the rows {bad_slot:?}",
                    out.len(),
                    slot.len(),
                    wts.len(),
                    shared.map(|(ys, gi)| (ys.len(), gi.len()))
                ),
            });
        }
        let dev = &self.dev;
        let (od, sd, wd) = (dev.upload(out)?, dev.upload(slot)?, dev.upload(wts)?);
        let sh = match shared {
            Some((ys, gi)) => Some((dev.upload(ys)?, dev.upload(gi)?)),
            None => None,
        };
        let mut y = dev.upload(&vec![f32::NAN; m * d])?;
        self.moe_combine_on(
            &od,
            &sd,
            &wd,
            sh.as_ref().map(|(a, b)| (a, b)),
            &mut y,
            m,
            k,
            d,
        )?;
        dev.download(&y, m * d)
    }
}

/// Formats whose matmuls read Q8_K activation rows.
fn k_quant(t: GgmlType) -> bool {
    matches!(t, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

fn e(err: CudaError) -> EngineError {
    err.into()
}

impl Backend for Cuda {
    type Buf = CudaSlice<f32>;
    type State = CudaState;

    fn name(&self) -> String {
        // The opt-in attention (a different function) shows in the name, so
        // that benchmark tables and logs say which arm ran.
        match (self.att_tc, self.att_tc_acc) {
            (true, true) => with_note(&self.dev.name, "fast attention"),
            (true, false) => with_note(&self.dev.name, "ATT_TC"),
            _ if self.att_ulp => with_note(&self.dev.name, "ATT_ULP probe"),
            _ => self.dev.name.clone(),
        }
    }

    fn alloc(&self, n: usize) -> R<CudaSlice<f32>> {
        self.dev.zeros::<f32>(n).map_err(e)
    }

    fn upload(&self, host: &[f32]) -> R<CudaSlice<f32>> {
        self.dev.upload(host).map_err(e)
    }

    fn download(&self, buf: &CudaSlice<f32>) -> R<Vec<f32>> {
        self.dev.download(buf, buf.len()).map_err(e)
    }

    fn new_state(&self, model: &Model, ctx: usize, kv: KvType) -> R<CudaState> {
        let hp = &model.hp;
        let kvw = hp.n_head_kv * hp.head_dim;
        let f16 = kv == KvType::F16;
        let el = if f16 { 2 } else { 4 };
        let mut kvs = Vec::new();
        let mut lin = Vec::new();
        for kind in &hp.layers {
            if *kind == samesum_engine::model::LayerKind::Attention {
                kvs.push(Some((
                    self.dev.zeros::<u8>(ctx * kvw * el).map_err(e)?,
                    self.dev.zeros::<u8>(ctx * kvw * el).map_err(e)?,
                )));
                lin.push(None);
            } else {
                let s = hp.ssm.ok_or_else(|| {
                    EngineError::BadHParam("linear layer without ssm sizes".into())
                })?;
                kvs.push(None);
                lin.push(Some((
                    self.dev
                        .zeros::<f32>((s.d_conv - 1) * s.conv_dim())
                        .map_err(e)?,
                    self.dev
                        .zeros::<f32>(s.n_v_heads * s.head_k_dim * s.head_v_dim)
                        .map_err(e)?,
                )));
            }
        }
        Ok(CudaState {
            pos: 0,
            ctx,
            kvw,
            kv: kvs,
            f16,
            linear: lin,
            pos_dev: self.dev.zeros::<i32>(1).map_err(e)?,
            pos_dev_val: None,
            lane: 0,
            other_pos_dev: self.dev.zeros::<i32>(1).map_err(e)?,
            other_pos_dev_val: None,
            whole_ctx: false,
            eager_steps: 0,
            no_graph: false,
            step: None,
        })
    }

    fn position(&self, st: &CudaState) -> usize {
        st.pos
    }

    fn capacity(&self, st: &CudaState) -> usize {
        st.ctx
    }

    fn download_state(&self, st: &CudaState) -> R<Vec<f32>> {
        let mut out = vec![st.pos as f32];
        let w = st.kvw;
        let el = if st.f16 { 2 } else { 4 };
        let n = st.pos * w * el;
        let val = |b: &[u8], i: usize| -> f32 {
            if st.f16 {
                half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
            } else {
                f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
            }
        };
        for (k, v) in st.kv.iter().flatten() {
            let kh = self.dev.download(k, n).map_err(e)?;
            let vh = self.dev.download(v, n).map_err(e)?;
            for pos in 0..st.pos {
                for i in 0..w {
                    out.push(val(&kh, pos * w + i));
                    out.push(val(&vh, pos * w + i));
                }
            }
        }
        for (c, s) in st.linear.iter().flatten() {
            out.extend(self.dev.download(c, c.len()).map_err(e)?);
            out.extend(self.dev.download(s, s.len()).map_err(e)?);
        }
        Ok(out)
    }

    fn advance(&self, st: &mut CudaState, m: usize) {
        st.pos += m;
    }

    fn lanes(&self) -> usize {
        if self.wave && self.tier.is_none() && !self.dev.profiling() {
            2
        } else {
            1
        }
    }

    fn enter_lane(&self, st: &mut CudaState, lane: usize, pos: usize) -> R<()> {
        let lane = lane.min(1);
        if st.lane != lane {
            std::mem::swap(&mut st.pos_dev, &mut st.other_pos_dev);
            std::mem::swap(&mut st.pos_dev_val, &mut st.other_pos_dev_val);
            st.lane = lane;
        }
        st.pos = pos;
        self.dev.set_lane(lane);
        Ok(())
    }

    fn lane_mark(&self, layer: usize) -> R<()> {
        let ev = self.dev.lane_event().map_err(e)?;
        let mut marks = self.lane_marks.lock().unwrap_or_else(|p| p.into_inner());
        let v = &mut marks[self.dev.lane()];
        if v.len() <= layer {
            v.resize_with(layer + 1, || None);
        }
        v[layer] = Some(ev);
        Ok(())
    }

    fn lane_wait(&self, lane: usize, layer: usize) -> R<()> {
        let marks = self.lane_marks.lock().unwrap_or_else(|p| p.into_inner());
        match marks
            .get(lane)
            .and_then(|v| v.get(layer))
            .and_then(|m| m.as_ref())
        {
            Some(ev) => self.dev.wait_for(ev).map_err(e),
            None => Err(e(CudaError::Driver {
                op: "lane_wait".into(),
                msg: format!("lane {lane} has no mark for layer {layer}"),
            })),
        }
    }

    fn rows(&self, x: &CudaSlice<f32>, width: usize, r0: usize, n: usize) -> R<CudaSlice<f32>> {
        let mut out = self.dev.scratch::<f32>(n * width).map_err(e)?;
        let src = x.slice(r0 * width..(r0 + n) * width);
        self.dev
            .current()
            .memcpy_dtod(&src, &mut out)
            .map_err(|x| e(drv("copy rows", x)))?;
        Ok(out)
    }

    fn set_rows(
        &self,
        dst: &mut CudaSlice<f32>,
        width: usize,
        r0: usize,
        src: &CudaSlice<f32>,
    ) -> R<()> {
        let mut d = dst.slice_mut(r0 * width..r0 * width + src.len());
        self.dev
            .current()
            .memcpy_dtod(src, &mut d)
            .map_err(|x| e(drv("copy rows", x)))
    }

    fn embed(&self, model: &Model, tokens: &[u32], out: &mut CudaSlice<f32>) -> R<()> {
        // Every forward call starts here: its size picks the launch mode.
        self.dev.rows_in_call(tokens.len());
        let w = &model.w;
        let d = model.hp.n_embd;
        let mut host = vec![0f32; tokens.len() * d];
        for (r, &t) in tokens.iter().enumerate() {
            if t as usize >= w.n_vocab {
                return Err(EngineError::BadToken {
                    token: t,
                    vocab: w.n_vocab,
                });
            }
            let row = w.token_embd.row(model.bytes(), 0, t as usize);
            dequant::dequantize(w.token_embd.ty, row, &mut host[r * d..(r + 1) * d])?;
        }
        let mut dst = out.slice_mut(0..host.len());
        self.dev
            .current()
            .memcpy_htod(&host, &mut dst)
            .map_err(|x| e(drv("embed: copy rows", x)))
    }

    fn add_rms_norm(
        &self,
        model: &Model,
        which: Norm,
        acc: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> R<()> {
        let w = which.weight(model);
        if acc.len() != x.len() || out.len() < acc.len() || !acc.len().is_multiple_of(w.len()) {
            return Err(e(CudaError::Driver {
                op: "add_rms_norm".into(),
                msg: format!(
                    "{} + {} values into {} for rows of {}",
                    acc.len(),
                    x.len(),
                    out.len(),
                    w.len()
                ),
            }));
        }
        let wd = self.vec(w).map_err(e)?;
        let (rows, width, eps) = (acc.len() / w.len(), w.len() as i32, model.hp.eps);
        let layer_norm = !matches!(which, Norm::Output);
        if self.norm_quant && layer_norm && w.len().is_multiple_of(256) && out.len() == acc.len() {
            let mut q = self
                .dev
                .scratch::<u8>(rows * w.len() / 256 * 304)
                .map_err(e)?;
            launch!(
                self.dev,
                "add_rms_norm_q8k",
                cfg((rows as u32, 1, 1), 256, 0),
                acc,
                x,
                wd,
                out,
                &mut q,
                &width,
                &eps
            )
            .map_err(e)?;
            self.keep_norm_q8k(out, q);
            return Ok(());
        }
        launch!(
            self.dev,
            "add_rms_norm",
            cfg((rows as u32, 1, 1), 256, 0),
            acc,
            x,
            wd,
            out,
            &width,
            &eps
        )
        .map_err(e)
    }

    fn rms_norm(
        &self,
        model: &Model,
        which: Norm,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> R<()> {
        let w = which.weight(model);
        let rows = x.len() / w.len();
        // Only the layer norms: their next op (attention, delta net, MoE)
        // takes the Q8_K rows at once, so they never outlive a captured step.
        let layer_norm = !matches!(which, Norm::Output);
        if self.norm_quant && layer_norm && w.len().is_multiple_of(256) && out.len() == x.len() {
            let wd = self.vec(w).map_err(e)?;
            let (width, eps) = (w.len() as i32, model.hp.eps);
            let mut q = self
                .dev
                .scratch::<u8>(rows * w.len() / 256 * 304)
                .map_err(e)?;
            launch!(
                self.dev,
                "rms_norm_q8k",
                cfg((rows as u32, 1, 1), 256, 0),
                x,
                wd,
                out,
                &mut q,
                &width,
                &eps
            )
            .map_err(e)?;
            self.keep_norm_q8k(out, q);
            return Ok(());
        }
        self.rms_norm_rows(x, w, rows, model.hp.eps, out).map_err(e)
    }

    fn add(&self, acc: &mut CudaSlice<f32>, x: &CudaSlice<f32>) -> R<()> {
        let len = acc.len();
        let n = len as i64;
        launch!(self.dev, "add_inplace", cfg1(len), acc, x, &n).map_err(e)
    }

    fn attention(
        &self,
        model: &Model,
        l: usize,
        a: &AttentionW,
        x: &CudaSlice<f32>,
        st: &mut CudaState,
        y: &mut CudaSlice<f32>,
    ) -> R<()> {
        self.attention_rows(model, l, a, x, st, y).map_err(e)
    }

    fn delta_net(
        &self,
        model: &Model,
        l: usize,
        dn: &DeltaNetW,
        x: &CudaSlice<f32>,
        st: &mut CudaState,
        y: &mut CudaSlice<f32>,
    ) -> R<()> {
        self.delta_rows(model, l, dn, x, st, y).map_err(e)
    }

    fn moe(&self, model: &Model, mw: &MoeW, x: &CudaSlice<f32>, y: &mut CudaSlice<f32>) -> R<()> {
        self.moe_rows(model, mw, x, y).map_err(e)
    }

    fn moe_add_rms_norm(
        &self,
        model: &Model,
        mw: &MoeW,
        which: Norm,
        h: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> R<()> {
        self.moe_then_norm(model, mw, which, h, x, y, None)
    }

    fn add_rms_norm_moe_add_rms_norm(
        &self,
        model: &Model,
        mw: &MoeW,
        which: Norm,
        next: Norm,
        h: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> R<()> {
        let hp = &model.hp;
        let w = which.weight(model);
        // `NORM_ROUTER`: one decode row whose routing folds into the router
        // launch, a layer norm of Q8_K width the launch's blocks can hold.
        let d = hp.n_embd;
        let fits = self.norm_router
            && self.norm_quant
            && self.tier.is_none()
            && !matches!(which, Norm::Output)
            && x.len() == d
            && h.len() == d
            && y.len() == d
            && w.len() == d
            && d.is_multiple_of(256)
            && d <= 2048
            && self.route_folds(mw, 1, hp.n_expert_used, hp.n_expert);
        if fits {
            let pre = PreNorm {
                acc: crate::device::addr(&self.dev, h),
                inc: crate::device::addr(&self.dev, y),
                w: self.vec(w).map_err(e)?,
                eps: hp.eps,
            };
            return self.moe_then_norm(model, mw, next, h, x, y, Some(&pre));
        }
        // Otherwise the trait's default: the norm's own launch, then the MoE.
        self.add_rms_norm(model, which, h, y, x)?;
        self.moe_add_rms_norm(model, mw, next, h, x, y)
    }

    fn offload_counters(&self) -> Option<samesum_engine::backend::OffloadCounters> {
        self.tier.as_ref().map(|t| {
            let s = t.stats();
            samesum_engine::backend::OffloadCounters {
                hits: s.hits,
                misses: s.misses,
                fetched_bytes: s.fetched_bytes,
                staged_bytes: s.staged_bytes,
            }
        })
    }

    fn step_one(
        &self,
        model: &Model,
        st: &mut CudaState,
        token: u32,
        want: samesum_engine::Logits,
    ) -> Option<R<Vec<f32>>> {
        if !self.graphs || self.tier.is_some() || self.dev.profiling() {
            return None;
        }
        // A one-row step (captured graphs keep the launch mode they were
        // captured with).
        self.dev.rows_in_call(1);
        Some(self.graph_step(model, st, token, want))
    }

    fn take_report(&self) -> R<Option<String>> {
        let Some(rows) = self.dev.take_profile().map_err(e)? else {
            return Ok(None);
        };
        let total: f64 = rows.iter().map(|r| r.2).sum();
        let mut s = String::from("| kernel | launches | ms | share |\n|---|---:|---:|---:|\n");
        for (k, n, ms) in &rows {
            s += &format!(
                "| {k} | {n} | {ms:.2} | {:.1}% |\n",
                100.0 * ms / total.max(1e-12)
            );
        }
        s += &format!(
            "| total | {} | {total:.2} | 100% |\n",
            rows.iter().map(|r| r.1).sum::<usize>()
        );
        Ok(Some(s))
    }

    fn logits(&self, model: &Model, h: &CudaSlice<f32>, rows: &[usize]) -> R<Vec<f32>> {
        let d = model.hp.n_embd;
        let w = &model.w;
        let n = rows.len();
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let run = || -> Result<Vec<f32>> {
            let idx = self.dev.upload(&idx)?;
            let mut g = self.dev.scratch::<f32>(n * d)?;
            let (di, ni) = (d as i32, n as i32);
            launch!(
                self.dev,
                "gather_rows",
                cfg1(n * d),
                h,
                &idx,
                &mut g,
                &di,
                &ni
            )?;
            let mut xs = self.dev.scratch::<f32>(n * d)?;
            self.rms_norm_rows(&g, &w.output_norm, n, model.hp.eps, &mut xs)?;
            let mut logits = self.dev.scratch::<f32>(n * w.n_vocab)?;
            self.matmul(&w.output, &xs, n, None, &mut logits)?;
            self.dev.download(&logits, n * w.n_vocab)
        };
        run().map_err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::{Cuda, attention_shape};

    /// Every `SAMESUM_CUDA_*` switch read at startup can be set by name
    /// (`samesum agree --variant`), and every name is read at startup: the
    /// two lists are kept in step by this test, which reads this file.
    #[test]
    fn the_switch_names_are_the_startup_variables() {
        let src = include_str!("backend.rs");
        let mut read: Vec<&str> = src
            .match_indices("env_switch(\"SAMESUM_CUDA_")
            .map(|(i, m)| {
                let rest = &src[i + m.len()..];
                &rest[..rest.find('"').unwrap()]
            })
            .collect();
        read.sort_unstable();
        read.dedup();
        let mut named: Vec<&str> = Cuda::switch_names().collect();
        named.sort_unstable();
        assert_eq!(read, named);
    }

    #[test]
    fn attention_shapes_beyond_the_kernel_are_refused_with_the_shape_named() {
        assert!(attention_shape(32, 4, 128).is_ok());
        assert!(attention_shape(16, 2, 256).is_ok());
        assert!(attention_shape(16, 1, 64).is_ok());
        for (hq, hkv, hd) in [
            (32, 1, 128),
            (16, 2, 512),
            (12, 5, 64),
            (8, 0, 64),
            (8, 8, 0),
        ] {
            let e = attention_shape(hq, hkv, hd).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{hq} query heads over {hkv} KV heads of dim {hd}")),
                "{e}"
            );
        }
    }
}

/// The score pass's 16-pair butterfly (ops.cu, `pair_butterfly`) simulated
/// on the host in f32: lanes holding pair `r ^ ((lane >> 1) & 15)` in
/// register `r` and exchanging with no select end with the same bits as
/// lanes holding pair `r` in register `r` and selecting what to send and
/// keep (`pair_butterfly_sel`, the session-9 form). The device test compares
/// the two kernels themselves; this one shows the layout is right on any
/// machine, and that a wrong layout is caught.
#[cfg(test)]
mod butterfly_tests {
    use samesum_quant::rng::Rng;

    const STEPS: [(usize, usize); 4] = [(16, 8), (8, 4), (4, 2), (2, 1)];

    /// Lane l's final value (pair l / 2) with the select form.
    fn with_selects(part: &[[f32; 16]; 32]) -> [f32; 32] {
        let mut d = *part;
        for (o2, w) in STEPS {
            let sent: Vec<Vec<f32>> = (0..32)
                .map(|l| {
                    let up = l & o2 != 0;
                    (0..w)
                        .map(|i| if up { d[l][i] } else { d[l][w + i] })
                        .collect()
                })
                .collect();
            for l in 0..32 {
                let up = l & o2 != 0;
                for i in 0..w {
                    let own = if up { d[l][w + i] } else { d[l][i] };
                    d[l][i] = own + sent[l ^ o2][i];
                }
            }
        }
        std::array::from_fn(|l| d[l][0] + d[l ^ 1][0])
    }

    /// The same with lane l holding pair `r ^ mask(l)` in register r.
    fn permuted(part: &[[f32; 16]; 32], mask: fn(usize) -> usize) -> [f32; 32] {
        let mut d: [[f32; 16]; 32] =
            std::array::from_fn(|l| std::array::from_fn(|r| part[l][r ^ mask(l)]));
        for (o2, w) in STEPS {
            let sent: Vec<Vec<f32>> = (0..32).map(|l| d[l][w..2 * w].to_vec()).collect();
            for l in 0..32 {
                for i in 0..w {
                    d[l][i] += sent[l ^ o2][i];
                }
            }
        }
        std::array::from_fn(|l| d[l][0] + d[l ^ 1][0])
    }

    fn random_parts(rng: &mut Rng) -> [[f32; 16]; 32] {
        let scale = [1e-3f32, 1.0, 1e3][rng.below(3) as usize];
        std::array::from_fn(|_| std::array::from_fn(|_| rng.range(-1.0, 1.0) * scale))
    }

    #[test]
    fn the_select_free_butterfly_gives_the_same_bits() {
        let mut rng = Rng::new(3);
        for _ in 0..300 {
            let part = random_parts(&mut rng);
            let (a, b) = (with_selects(&part), permuted(&part, |l| (l >> 1) & 15));
            for l in 0..32 {
                assert_eq!(a[l].to_bits(), b[l].to_bits(), "lane {l}");
            }
        }
    }

    /// ops.cu's `qs_col`: where dim d of a pair's q sits in its row (head
    /// dims over 128).
    fn qs_col(d: usize) -> usize {
        (d >> 6) * 64 + (d & 31) * 2 + ((d >> 5) & 1)
    }

    /// The q layout the score pass reads above head dim 128: every dim of a
    /// 256-wide row has its own column, and lane l finds chunks 2k and
    /// 2k + 1 (dims l + 32 c) in the two floats at 64 k + 2 l, the float2 it
    /// loads.
    #[test]
    fn the_q_columns_are_a_permutation_read_two_at_a_time() {
        let mut seen = [false; 256];
        for d in 0..256 {
            let c = qs_col(d);
            assert!(c < 256 && !seen[c], "dim {d} -> column {c}");
            seen[c] = true;
        }
        for lane in 0..32 {
            for c in 0..8 {
                assert_eq!(qs_col(lane + 32 * c), 64 * (c / 2) + 2 * lane + c % 2);
            }
        }
    }

    #[test]
    fn a_wrong_register_layout_is_caught() {
        let mut rng = Rng::new(4);
        let caught = (0..50).any(|_| {
            let part = random_parts(&mut rng);
            let (a, b) = (with_selects(&part), permuted(&part, |l| (l >> 1) & 7));
            (0..32).any(|l| a[l].to_bits() != b[l].to_bits())
        });
        assert!(caught, "a mask missing lane bit 16 went unnoticed");
    }
}

/// Host checks of the decode routing kernel's shortcuts (ops.cu): the
/// sorting networks of `sort_picks`, read from the kernel source, sort every
/// 0/1 input (so every input); the top k from each lane's sorted entries
/// picks what the argmax rounds pick, in the same order, ties included; and
/// the one-warp plan places every pair where the block plan does. The GPU
/// test compares the kernels themselves.
#[cfg(test)]
mod topk_tests {
    use samesum_quant::rng::Rng;

    /// The comparator pairs of `sort_picks`'s branch for `u` entries.
    fn network(u: usize) -> Vec<(usize, usize)> {
        let src = include_str!("../kernels/ops.cu");
        let body = &src[src.find("void sort_picks(").expect("sort_picks")..];
        let body = &body[..body.find("\n}\n").expect("end of sort_picks")];
        let part = if u == 4 {
            &body[body.find("if (U == 4)").unwrap()..body.find("} else {").unwrap()]
        } else {
            &body[body.find("} else {").unwrap()..]
        };
        part.match_indices("pick_cas(v, id, ")
            .map(|(i, m)| {
                let rest = &part[i + m.len()..];
                let nums: Vec<usize> = rest[..rest.find(')').unwrap()]
                    .split(", ")
                    .map(|x| x.trim().parse().unwrap())
                    .collect();
                (nums[0], nums[1])
            })
            .collect()
    }

    /// pick_before: larger value first, lower id among equals, absent last.
    fn before(a: (f32, i32), b: (f32, i32)) -> bool {
        if b.1 < 0 {
            return a.1 >= 0;
        }
        if a.1 < 0 {
            return false;
        }
        a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
    }

    fn sort(net: &[(usize, usize)], e: &mut [(f32, i32)]) {
        for &(a, b) in net {
            if before(e[b], e[a]) {
                e.swap(a, b);
            }
        }
    }

    #[test]
    fn the_sorting_networks_sort_every_input() {
        for u in [4usize, 8] {
            let net = network(u);
            assert_eq!(net.len(), if u == 4 { 5 } else { 19 });
            for bits in 0u32..1 << u {
                let mut e: Vec<(f32, i32)> =
                    (0..u).map(|i| ((bits >> i & 1) as f32, i as i32)).collect();
                sort(&net, &mut e);
                assert!(
                    e.windows(2).all(|w| before(w[0], w[1])),
                    "u {u}: {bits:#b} -> {e:?}"
                );
            }
            // A network with one comparator left out fails some input.
            for skip in 0..net.len() {
                let short: Vec<_> = (0..net.len())
                    .filter(|&i| i != skip)
                    .map(|i| net[i])
                    .collect();
                let fails = (0u32..1 << u).any(|bits| {
                    let mut e: Vec<(f32, i32)> =
                        (0..u).map(|i| ((bits >> i & 1) as f32, i as i32)).collect();
                    sort(&short, &mut e);
                    !e.windows(2).all(|w| before(w[0], w[1]))
                });
                assert!(fails, "u {u}: comparator {skip} is not needed");
            }
        }
    }

    /// The argmax rounds (topk_row_u's general path): each lane's best entry
    /// not taken, then the warp's best of those.
    fn rounds(v: &[f32], k: usize) -> Vec<(i32, f32)> {
        let mut taken = vec![false; v.len()];
        (0..k)
            .map(|_| {
                let mut cand: Vec<(f32, i32)> = vec![(0.0, -1); 32];
                for (i, &x) in v.iter().enumerate() {
                    let c = &mut cand[i % 32];
                    if !taken[i] && (c.1 < 0 || x > c.0) {
                        *c = (x, i as i32);
                    }
                }
                let best = warp_best(&cand);
                if best.1 >= 0 {
                    taken[best.1 as usize] = true;
                }
                (best.1, best.0)
            })
            .collect()
    }

    /// warp_argmax's butterfly on (value, id) candidates.
    fn warp_best(cand: &[(f32, i32)]) -> (f32, i32) {
        let mut c = cand.to_vec();
        for o in [16, 8, 4, 2, 1] {
            let prev = c.clone();
            for l in 0..32 {
                let (ov, oi) = prev[l ^ o];
                let (bv, best) = c[l];
                if oi >= 0 && (best < 0 || ov > bv || (ov == bv && oi < best)) {
                    c[l] = (ov, oi);
                }
            }
        }
        c[0]
    }

    /// The sorted-lane path: each lane's entries sorted once, then per round
    /// the lanes' first entries not taken.
    fn sorted_lanes(v: &[f32], k: usize, u: usize) -> Vec<(i32, f32)> {
        let net = network(u);
        let lanes: Vec<Vec<(f32, i32)>> = (0..32)
            .map(|l| {
                let mut e: Vec<(f32, i32)> = (0..u)
                    .map(|j| {
                        let i = l + 32 * j;
                        if i < v.len() {
                            (v[i], i as i32)
                        } else {
                            (0.0, -1)
                        }
                    })
                    .collect();
                sort(&net, &mut e);
                e
            })
            .collect();
        let mut head = [0usize; 32];
        (0..k)
            .map(|_| {
                let cand: Vec<(f32, i32)> = (0..32)
                    .map(|l| match lanes[l].get(head[l]) {
                        Some(&(x, i)) if i >= 0 => (x, i),
                        _ => (0.0, -1),
                    })
                    .collect();
                let best = warp_best(&cand);
                if best.1 >= 0 {
                    head[(best.1 % 32) as usize] += 1;
                }
                (best.1, best.0)
            })
            .collect()
    }

    #[test]
    fn sorted_lanes_pick_what_the_rounds_pick() {
        let mut rng = Rng::new(8);
        let mut cases = 0;
        for e in [5usize, 8, 33, 100, 128, 200, 256] {
            let u = e.div_ceil(32).next_power_of_two().max(4);
            for k in [1usize, 2, 8, 9] {
                for _ in 0..40 {
                    // Values on a coarse grid (ties) or spread; softmax rows
                    // hold values >= 0.
                    let coarse = rng.below(2) == 0;
                    let v: Vec<f32> = (0..e)
                        .map(|_| {
                            if coarse {
                                rng.below(6) as f32 * 0.125
                            } else {
                                rng.range(0.0, 1.0)
                            }
                        })
                        .collect();
                    let (a, b) = (rounds(&v, k.min(e + 1)), sorted_lanes(&v, k.min(e + 1), u));
                    assert_eq!(a.len(), b.len());
                    for (s, (x, y)) in a.iter().zip(&b).enumerate() {
                        assert_eq!(x.0, y.0, "e {e} k {k} pick {s}: ids");
                        assert_eq!(x.1.to_bits(), y.1.to_bits(), "e {e} k {k} pick {s}");
                    }
                    cases += 1;
                }
            }
        }
        assert!(cases > 1000);
    }

    /// plan_warp: a match per expert, places counted below the lane, offsets
    /// summed from the first lanes of the experts with lower ids.
    fn warp_plan(ids: &[i32], k: usize, pad: usize, cap: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
        let n = ids.len();
        let id = |l: usize| if l < n { ids[l] } else { -1 };
        let valid = |l: usize| l < n && id(l) >= 0;
        let key = |l: usize| if valid(l) { id(l) } else { -1 };
        let same = |l: usize| (0..32).filter(|&j| key(j) == key(l)).collect::<Vec<_>>();
        let before = |l: usize| same(l).iter().filter(|&&j| j < l).count();
        let padded = |l: usize| {
            if valid(l) && before(l) == 0 {
                same(l).len().div_ceil(pad) * pad
            } else {
                0
            }
        };
        let (mut row, mut mat, mut slot) = (vec![-1; cap], vec![-1; cap], vec![-1; n]);
        for l in 0..n {
            if valid(l) {
                let off: usize = (0..32)
                    .filter(|&j| padded(j) > 0 && id(j) < id(l))
                    .map(padded)
                    .sum();
                let dst = off + before(l);
                row[dst] = (l / k) as i32;
                mat[dst] = id(l);
                slot[l] = dst as i32;
            }
        }
        (row, mat, slot)
    }

    #[test]
    fn the_one_warp_plan_places_pairs_as_the_block_plan() {
        let mut rng = Rng::new(12);
        for _ in 0..500 {
            let k = [1usize, 2, 4, 8][rng.below(4) as usize];
            let e = [8usize, 128, 256][rng.below(3) as usize];
            let n = k * (1 + rng.below((32 / k) as u64) as usize);
            let pad = [1usize, 16][rng.below(2) as usize];
            // Few distinct experts (shared ones) and some skipped picks.
            let pool = 1 + rng.below(e as u64) as i32;
            let ids: Vec<i32> = (0..n)
                .map(|_| {
                    if rng.below(10) == 0 {
                        -1
                    } else {
                        rng.below(pool as u64) as i32
                    }
                })
                .collect();
            let cap = n + e.min(n) * (pad - 1);
            assert_eq!(
                warp_plan(&ids, k, pad, cap),
                super::plan_reference(&ids, k, e, pad, cap),
                "ids {ids:?} k {k} pad {pad}"
            );
        }
    }
}

/// `FmtQ6K::load` (matmul.cu) reads a group's 16 ql and 16 qh bytes with
/// five aligned words each (`ld16_a2`) where it read two bytes at a time
/// (`q6_word`): the same four words for every group, on blocks at both
/// 2-byte alignments. A host model of both; the GPU tests compare the
/// kernels' outputs.
#[cfg(test)]
mod q6_load_tests {
    use samesum_quant::rng::Rng;

    fn le32(m: &[u8], at: usize) -> u32 {
        u32::from_le_bytes([m[at], m[at + 1], m[at + 2], m[at + 3]])
    }

    fn vsub4(a: u32, b: u32) -> u32 {
        u32::from_le_bytes(std::array::from_fn(|i| {
            (a.to_le_bytes()[i]).wrapping_sub(b.to_le_bytes()[i])
        }))
    }

    /// q6_word(b, e) with the block at byte `b` of memory `m`.
    fn q6_word(m: &[u8], b: usize, e: usize) -> u32 {
        let (n, r) = (e / 128, e % 128);
        let lo = (le32(m, b + n * 64 + r % 64) >> (4 * (r / 64))) & 0x0F0F0F0F;
        let hi = (le32(m, b + 128 + n * 32 + r % 32) >> (2 * (r / 32))) & 0x03030303;
        vsub4(lo | (hi << 4), 0x20202020)
    }

    /// ld16_a2: aligned words around p, funnel-shifted.
    fn ld16_a2(m: &[u8], p: usize) -> [u32; 4] {
        let a = p & !3;
        let sh = ((p & 3) * 8) as u32;
        let x: Vec<u32> = (0..5).map(|i| le32(m, a + 4 * i)).collect();
        std::array::from_fn(|i| (((x[i + 1] as u64) << 32 | x[i] as u64) >> sh) as u32)
    }

    fn load(m: &[u8], b: usize, g: usize) -> [u32; 4] {
        let (n, h) = (g / 8, g % 8);
        let ql = ld16_a2(m, b + n * 64 + 16 * (h % 4));
        let qh = ld16_a2(m, b + 128 + n * 32 + 16 * (h % 2));
        let (sl, shh) = (4 * (h / 4), 2 * (h / 2));
        std::array::from_fn(|i| {
            vsub4(
                ((ql[i] >> sl) & 0x0F0F0F0F) | (((qh[i] >> shh) & 0x03030303) << 4),
                0x20202020,
            )
        })
    }

    #[test]
    fn whole_runs_give_the_words_of_two_byte_reads() {
        let mut rng = Rng::new(6);
        for _ in 0..200 {
            let m: Vec<u8> = (0..1024).map(|_| rng.below(256) as u8).collect();
            // Blocks at 4-byte and at 2-byte (odd blocks of a row) alignment.
            for b in [0usize, 210, 420, 630, 4 + 2] {
                for g in 0..16 {
                    let want: [u32; 4] = std::array::from_fn(|i| q6_word(&m, b, 16 * g + 4 * i));
                    assert_eq!(load(&m, b, g), want, "block at {b}, group {g}");
                }
            }
        }
        // A run read from the wrong place would differ: shift the ql run.
        let m: Vec<u8> = (0..1024).map(|i| (i * 7 + 3) as u8).collect();
        let wrong = ld16_a2(&m, 210 + 2);
        let right = ld16_a2(&m, 210);
        assert_ne!(wrong, right);
    }
}
