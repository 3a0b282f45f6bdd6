#!/usr/bin/env bash
# Session 16 final call (ad hoc): every GPU test, the identity gates, both
# models' benchmarks (with the qwen35moe kernel profile), replay on
# qwen35moe at pp4096.
set -u
out=${1:?}
SAMESUM_GPU_STEPS=tests,identity,bigidentity,bench,q3moe SAMESUM_GPU_PP=512,4096,16384 SAMESUM_GPU_REPS=1 \
  SAMESUM_GPU_ARMS=batched scripts/gpu.sh run "$out" > "$out.txt" 2>&1
for d in /usr/local/cuda/lib64; do export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
export SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
timeout 120 .gpu/samesum bench --device cuda -m /tmp/models/qwen35moe-35b-a3b.gguf -p 4096 -n 0 -r 1 --prefill replay --no-warmup > "$out/replay.txt" 2>&1
cat "$out/summary.txt" 2>/dev/null || tail -20 "$out.txt"
grep -E "pp[0-9]|tg[0-9]|equal|passed|failed" "$out/log.txt" | grep -v "^test " | tail -40
grep -E "attention|mm_tc|delta|total" "$out/log.txt" | head -14
grep pp4096 "$out/replay.txt"
