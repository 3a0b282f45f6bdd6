#!/usr/bin/env bash
# Session 16 call 4 (ad hoc): the tensor-core matmul test again (its output
# did not come back from call 3), then per-instruction ncu samples of one
# launch each of the delta rule, mm_f32_tile and (qwen3moe) attention_combine_q8k
# at pp4096, to look for the bookkeeping costs call 2 found in mm_tc.
set -u
out=${1:?}; mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d $d ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}; done
t=tensor_core_matmuls_equal_the_dp4a_kernels_and_single_rows
.gpu/test-gpu $t --nocapture --test-threads=1 > "$out/log.txt" 2>&1; echo "$t rc=$?"; grep -E "cases|panicked|test result" "$out/log.txt"
f=/tmp/models/qwen35moe-35b-a3b.gguf; q3=/tmp/models/qwen3moe-30b-a3b.gguf
mkdir -p /tmp/models
[ -f $f ] || .gpu/samesum synth --shape qwen35moe-35b-a3b --quant q4_k -o $f >> "$out/log.txt" 2>&1
[ -f $q3 ] || .gpu/samesum synth --shape qwen3moe-30b-a3b --quant q4_k -o $q3 >> "$out/log.txt" 2>&1
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
one() { # kernel model
  timeout 200 "$ncu" --clock-control none -k "regex:^$1\$" --launch-skip 6 -c 1 --set full --import-source no -o "/tmp/$1" \
    env SAMESUM_CUDA_GRAPHS=0 .gpu/samesum bench --device cuda -m $2 -p 4096 -n 0 -r 1 --no-warmup --prefill batched >> "$out/log.txt" 2>&1
  echo "ncu $1 rc=$?"
  "$ncu" -i "/tmp/$1.ncu-rep" --page details --print-details all > "/tmp/$1-details.txt" 2>&1
  grep -E "Duration|Stall (Wait|Long|Short|Barrier|Not Sel|Math|MIO)|Issued Warp|Eligible Warps|Registers Per|Achieved Occ" "/tmp/$1-details.txt" | head -16
  "$ncu" -i "/tmp/$1.ncu-rep" --page source --csv --print-source sass > "$out/$1.csv" 2>&1
}
one delta_cols_async_pipe_128 $f
one mm_f32_tile $f
one attention_combine_q8k $q3
ls -la "$out"
