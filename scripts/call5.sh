#!/usr/bin/env bash
# ad hoc (session 14, final call): gates, GPU tests, benches of the final build
set -u
out=$1
SAMESUM_GPU_STEPS=tests,identity,bigidentity,bench,q3moe SAMESUM_GPU_PP=512,4096,16384 SAMESUM_GPU_REPS=1 \
  SAMESUM_GPU_ARMS=batched scripts/gpu.sh run $out
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels timeout 120 .gpu/samesum bench --device cuda -m /tmp/models/qwen35moe-35b-a3b.gguf \
  -p 4096 -n 0 -r 1 --prefill replay --no-warmup > $out/replay.txt 2>&1
