#!/usr/bin/env bash
# Session 17 verification call (ad hoc): decode on the 16-pair attention kernel.
out=${1:?}
mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
done
mkdir -p /tmp/models
(.gpu/samesum synth --shape qwen35moe-35b-a3b --quant q4_k -o /tmp/models/q35.gguf > /dev/null 2>&1;
 .gpu/samesum synth --shape qwen3moe-30b-a3b --quant q4_k -o /tmp/models/q3.gguf > /dev/null 2>&1) &
for t in attention_at_the_real compact_decode; do
    timeout 150 .gpu/test-gpu --nocapture --test-threads=1 "$t" > "$out/test-$t.txt" 2>&1
    echo "test $t rc=$?" >> "$out/summary.txt"
done
timeout 60 .gpu/samesum identity --device cuda --shape tiny-qwen35moe --chunk 1,7,64,128,256 --gen 64 \
    > "$out/identity.txt" 2>&1
echo "identity rc=$?" >> "$out/summary.txt"
wait
timeout 60 .gpu/samesum bench --device cuda -m /tmp/models/q35.gguf -p 4096 -n 128 -r 3 --prefill batched \
    > "$out/q35.txt" 2>&1
timeout 60 .gpu/samesum bench --device cuda -m /tmp/models/q3.gguf -p 0 -n 128 -r 3 > "$out/q3.txt" 2>&1
timeout 40 .gpu/samesum bench --device cuda -m /tmp/models/q35.gguf -p 4096 -n 0 -r 1 --prefill replay \
    --no-warmup > "$out/replay.txt" 2>&1
cat "$out/summary.txt"; grep -h "runs equal" "$out/identity.txt"; grep -h "| pp\|| tg" "$out"/q35.txt "$out"/q3.txt "$out"/replay.txt
