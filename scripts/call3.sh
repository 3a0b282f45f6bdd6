#!/usr/bin/env bash
# Session 15 call 3 (ad hoc): the attention test, then qwen3moe kernel
# profiles at pp4096: q4p, q4w (8-key value steps), q4x (q4w's values, q4p's scores).
set -u
out=${1:?}; mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d $d ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
mkdir -p /tmp/models; m=/tmp/models/q3.gguf
.gpu/samesum synth --shape qwen3moe-30b-a3b --quant q4_k -o $m > /dev/null 2>&1 &
.gpu/test-gpu attention_at_the_real_models_head_shapes --nocapture --test-threads=1 > "$out/test.txt" 2>&1; echo "test rc=$?"
wait
for arm in "X=0" "SAMESUM_CUDA_ATT_Q4W=1" "SAMESUM_CUDA_ATT_Q4W=1 SAMESUM_CUDA_ATT_Q4X=1"; do
  echo "=== $arm"
  env $arm .gpu/samesum bench --device cuda -m $m -p 4096 -n 0 -r 1 --prefill batched --profile 2>&1 | grep -E "pp4096|attention_tiles|total"
done
