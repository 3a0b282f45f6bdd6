#!/usr/bin/env bash
# Session 15 call 1 (ad hoc): batched prefill at chunks 2048 / 4096 / 8192 on
# both models, and the opt-in --attention fast arm on qwen3moe.
set -u
out=${1:?}; mkdir -p "$out"
export SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d $d ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt"
mkdir -p /tmp/models
for s in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
  .gpu/samesum synth --shape $s --quant q4_k -o /tmp/models/$s.gguf > /dev/null 2>&1 &
done; wait
b() { echo "=== $*" | tee -a "$out/log.txt"; timeout 300 .gpu/samesum bench --device cuda -n 0 -r 1 --prefill batched "$@" >> "$out/log.txt" 2>&1; echo "rc=$?" >> "$out/log.txt"; }
for s in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
  m=/tmp/models/$s.gguf
  b -m $m -p 4096,16384 --chunk 2048
  b -m $m -p 4096,16384 --chunk 4096
  b -m $m -p 16384 --chunk 8192
done
b -m /tmp/models/qwen3moe-30b-a3b.gguf -p 4096,16384 --chunk 2048 --attention fast
grep -E "===|pp[0-9]|rc=" "$out/log.txt"
