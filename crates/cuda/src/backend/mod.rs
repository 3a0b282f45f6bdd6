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
use samesum_engine::backend::{Backend, DecodeStep, Norm};
use samesum_engine::model::Matrix;
use samesum_engine::model::weights::{AttentionW, DeltaBa, DeltaInput, DeltaNetW, Mixer, MoeW};
use samesum_engine::{Arch, EngineError, KvType, Model};
use samesum_gguf::GgmlType;
use samesum_quant::dequant;
use std::collections::HashMap;
use std::sync::Mutex;

mod attention;
mod buf;
mod delta_net;
mod graphs;
mod input;
mod matmul;
mod moe;
mod norm;
mod ops;

pub use buf::CudaBuf;
use input::*;
pub use moe::plan_reference;

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
    /// Decode-sized MoE calls run the routed and shared experts in the same
    /// launches (`mm_*_moe_*`, `mm_f32_multi`; the routed experts alone
    /// where there is no shared expert), the routed pairs reading their
    /// token's quantized row in place instead of a gathered copy (default,
    /// off with `SAMESUM_CUDA_MOE_JOINT=0`: separate launches and the
    /// gather, the same bytes).
    moe_joint: bool,
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
    ("GN_FOLD", |c| c.gn_fold, |c, on| c.gn_fold = on),
    ("LANE16", |c| c.lane16, |c, on| c.lane16 = on),
    ("ROUTER_1W", |c| c.router_1w, |c, on| c.router_1w = on),
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
    /// The sequence's decode step: its row buffers and recorded graph.
    step: Option<samesum_engine::backend::DecodeStep<Cuda>>,
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
            block_route: env_switch("SAMESUM_CUDA_BLOCK_ROUTE", false),
            small_plan: env_switch("SAMESUM_CUDA_SMALL_PLAN", true),
            row_kernels: env_switch("SAMESUM_CUDA_ROW", true),
            glu: env_switch("SAMESUM_CUDA_GLU", true),
            multi: env_switch("SAMESUM_CUDA_MULTI", true),
            quantized_gather: env_switch("SAMESUM_CUDA_QGATHER", true),
            overlap: env_switch("SAMESUM_CUDA_OVERLAP", true),
            wave: env_switch("SAMESUM_CUDA_WAVE", true),
            lane_marks: Mutex::new([Vec::new(), Vec::new()]),
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

    /// Whether attention takes the opt-in tensor-core passes
    /// ([`CudaOptions::fast_attention`]).
    pub fn fast_attention(&self) -> bool {
        self.att_tc && self.att_tc_acc
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
}

/// Formats whose matmuls read Q8_K activation rows.
fn k_quant(t: GgmlType) -> bool {
    matches!(t, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

fn e(err: CudaError) -> EngineError {
    err.into()
}

#[cfg(test)]
mod tests {
    use super::attention_shape;

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
