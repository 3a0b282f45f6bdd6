#!/usr/bin/env bash
# Session 16 call 3 (ad hoc): the tensor-core matmul test after the ballot bookkeeping,
# qwen35moe pp4096 kernel profiles (TC_MINS on and off), qwen3moe, and a
# full ncu report (stall reasons, per-instruction samples) of one
# mm_tc_q4_k_async32m launch.
set -u
out=${1:?}; mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d $d ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
t=tensor_core_matmuls_equal_the_dp4a_kernels_and_single_rows
env CUDA_CACHE_DISABLE=1 .gpu/test-kernels_compile --nocapture > "$out/kc.txt" 2>&1; echo "kernels_compile rc=$?"
.gpu/test-gpu $t --nocapture --test-threads=1 > "$out/test-$t.txt" 2>&1; echo "$t rc=$?"; grep -E "cases|panicked" "$out/test-$t.txt"
f=/tmp/models/qwen35moe-35b-a3b.gguf
mkdir -p /tmp/models; [ -f $f ] || .gpu/samesum synth --shape qwen35moe-35b-a3b --quant q4_k -o $f > "$out/synth.txt" 2>&1
for arm in "X=1" "SAMESUM_CUDA_TC_MINS=0" "X=2"; do
  echo "=== $arm"
  env $arm timeout 120 .gpu/samesum bench --device cuda -m $f -p 4096 -n 0 -r 1 --prefill batched --profile > "$out/prof.txt" 2>&1
  grep -E "mm_tc|total|pp4096" "$out/prof.txt" | head -4
done
q3=/tmp/models/qwen3moe-30b-a3b.gguf
[ -f $q3 ] || .gpu/samesum synth --shape qwen3moe-30b-a3b --quant q4_k -o $q3 > "$out/synth3.txt" 2>&1
timeout 120 .gpu/samesum bench --device cuda -m $q3 -p 4096 -n 0 -r 1 --prefill batched --profile > "$out/prof3.txt" 2>&1
grep -E "mm_tc|attention_tiles|total|pp4096" "$out/prof3.txt" | head -5
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout 300 "$ncu" --clock-control none -k "regex:^mm_tc_q4_k_async32m\$" --launch-skip 12 -c 1 --set full --import-source no -o "$out/tc" \
  env SAMESUM_CUDA_GRAPHS=0 .gpu/samesum bench --device cuda -m $f -p 4096 -n 0 -r 1 --no-warmup --prefill batched > "$out/ncu-run.txt" 2>&1
echo "ncu rc=$?"
"$ncu" -i "$out/tc.ncu-rep" --page details --print-details all > "$out/tc-details.txt" 2>&1
"$ncu" -i "$out/tc.ncu-rep" --page raw --csv > "$out/tc-raw.csv" 2>&1
"$ncu" -i "$out/tc.ncu-rep" --page source --csv --print-source sass > "$out/tc-source.csv" 2>&1
echo "source rc=$? $(wc -l < "$out/tc-source.csv")"
grep -iE "stall|Eligible|Issued" "$out/tc-details.txt" | head -30
rm -f "$out/tc.ncu-rep"
