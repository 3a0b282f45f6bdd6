#!/usr/bin/env bash
# Session 15 call 2 (ad hoc): the attention test (q4w against q4), then
# kernel profiles at pp4096 with ATT_Q4W off and on.
set -u
out=${1:?}; mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d $d ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
.gpu/test-gpu attention_at_the_real_models_head_shapes --nocapture --test-threads=1 > "$out/test.txt" 2>&1; echo "test rc=$?"
tail -5 "$out/test.txt"
SAMESUM_GPU_STEPS=profiles SAMESUM_GPU_PROFILE_ARMS="-;SAMESUM_CUDA_ATT_Q4W=1" scripts/gpu.sh run "$out/p" > "$out/p.txt" 2>&1
tail -5 "$out/p.txt"
grep -E "attention_tiles|pp4096|^===|total" "$out/p/log.txt" | head -40
