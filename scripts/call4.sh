#!/usr/bin/env bash
# ad hoc (session 14, call 4): attention_tiles_q4p test and A/B
set -u
out=$1; mkdir -p $out /tmp/models
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
export SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1
timeout 200 .gpu/test-gpu attention_at --nocapture > $out/test.txt 2>&1; echo "test rc=$?" > $out/log.txt
for m in qwen3moe-30b-a3b qwen35moe-35b-a3b; do
  f=/tmp/models/$m.gguf
  [ -f $f ] || .gpu/samesum synth --shape $m --quant q4_k -o $f >> $out/log.txt 2>&1
  for arm in 0 1; do
    t0=$SECONDS
    SAMESUM_CUDA_ATT_Q4P=$arm timeout 150 .gpu/samesum bench --device cuda -m $f -p 4096 -n 0 -r 1 --profile > $out/prof-$m-$arm.txt 2>&1
    SAMESUM_CUDA_ATT_Q4P=$arm timeout 150 .gpu/samesum bench --device cuda -m $f -p 4096,16384 -n 0 -r 1 2>&1 | grep "| pp" >> $out/bench.txt
    echo "$m arm $arm $((SECONDS-t0)) s" >> $out/log.txt
  done
done
