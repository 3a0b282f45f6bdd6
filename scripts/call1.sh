#!/usr/bin/env bash
# Session 16 call 1 (ad hoc): the tensor-core matmul test (TC_MINS on and
# off), kernel profiles with TC_MINS on and off at pp4096 on both models,
# ncu on one mm_tc launch of each arm at qwen35moe pp4096.
set -u
out=${1:?}; mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d $d ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
for t in tensor_core_matmuls_equal_the_dp4a_kernels_and_single_rows switches_are_set_and_read_by_name; do
  .gpu/test-gpu $t --nocapture --test-threads=1 > "$out/test-$t.txt" 2>&1; echo "$t rc=$?"; grep -E "cases|panicked" "$out/test-$t.txt"
done
SAMESUM_GPU_STEPS=profiles SAMESUM_GPU_PROFILE_ARMS="-;SAMESUM_CUDA_TC_MINS=0" scripts/gpu.sh run "$out/p" > "$out/p.txt" 2>&1
grep -E "^===|mm_tc|attention_tiles|total|pp4096" "$out/p/log.txt" | head -40
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
secs="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats"
for k in mm_tc_q4_k_async32m mm_tc_q4_k_async32; do
  arm=1; [ $k = mm_tc_q4_k_async32 ] && arm=0
  timeout 200 "$ncu" --clock-control none -k "regex:^$k\$" --launch-skip 12 -c 1 $secs \
    env SAMESUM_CUDA_GRAPHS=0 SAMESUM_CUDA_TC_MINS=$arm .gpu/samesum bench --device cuda -m /tmp/models/qwen35moe-35b-a3b.gguf \
    -p 4096 -n 0 -r 1 --no-warmup --prefill batched > "$out/ncu-$k.txt" 2>&1
  echo "ncu $k rc=$?"
  grep -E "Duration|Registers|Eligible|Issued Warp|Stall|Theoretical Occ|Achieved Occ|Pipe|L2 Cache Throughput|Executed Ipc|No Eligible" "$out/ncu-$k.txt" | head -40
done
