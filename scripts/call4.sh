#!/usr/bin/env bash
# Session 15 call 4 (ad hoc): the staged Q6_K row kernel's tests, then
# tg128 with Q6_STAGE on and off (both models, -r 3, two rounds).
set -u
out=${1:?}; mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d $d ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
for t in staged_q6k_rows_equal_the_row_kernel one_row_kernels_equal_the_tile_kernels; do
  .gpu/test-gpu $t --nocapture --test-threads=1 > "$out/test-$t.txt" 2>&1; echo "$t rc=$?"; grep -E "cases|panicked" "$out/test-$t.txt"
done
SAMESUM_GPU_STEPS=decode SAMESUM_GPU_DECODE_ARMS="-;SAMESUM_CUDA_Q6_STAGE=0" SAMESUM_GPU_DECODE_ROUNDS=2 scripts/gpu.sh run "$out/d" > "$out/d.txt" 2>&1
grep -E "^===|tg128" "$out/d/log.txt"
