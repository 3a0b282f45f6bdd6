#!/usr/bin/env bash
# Session 17 call 3 (ad hoc): the new GPU tests, then prefill and decode A/Bs.
out=${1:?}
mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
done
for t in tensor_core_matmuls tiled_conv programmatic_dependent graph_replayed every_block_op_obeys; do
    timeout 300 .gpu/test-gpu --nocapture --test-threads=1 "$t" > "$out/test-$t.txt" 2>&1
    echo "test $t rc=$?" | tee -a "$out/tests.txt"
done
SAMESUM_GPU_STEPS=prefill,decode SAMESUM_GPU_PREFILL_ROUNDS=2 \
SAMESUM_GPU_PREFILL_ARMS="-;SAMESUM_CUDA_TC_GROUPS=1;SAMESUM_CUDA_CONV_TILE=0;SAMESUM_CUDA_PDL_PREFILL=1;SAMESUM_CUDA_PROFILE=1;SAMESUM_CUDA_PROFILE=1 SAMESUM_CUDA_TC_GROUPS=1 SAMESUM_CUDA_CONV_TILE=0" \
SAMESUM_GPU_DECODE_SHAPES=qwen35moe-35b-a3b SAMESUM_GPU_DECODE_ARMS="-;SAMESUM_CUDA_PDL_AT_EXIT=1;SAMESUM_CUDA_PDL=0" \
    scripts/gpu.sh run "$out"
