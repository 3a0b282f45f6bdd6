#!/usr/bin/env bash
cd "$(dirname "$0")/.."
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
t0=$SECONDS
timeout 240 .gpu/test-gpu lane_row one_row grouped_input the_one_launch_route shared_expert decode_fusions graph_replayed --nocapture --test-threads=1 > $OUT/tests.txt 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; grep -E '^test |test result|panicked' $OUT/tests.txt | cut -c1-200
SAMESUM_GPU_STEPS=identity,decode SAMESUM_GPU_DECODE_ROUNDS=1 SAMESUM_GPU_DECODE_ARMS="-;SAMESUM_CUDA_LANE_ROWS=0;SAMESUM_CUDA_ROUTE_ONE=0" scripts/gpu.sh run $OUT/run > /dev/null 2>&1
cat $OUT/run/summary.txt; grep -E '^=== decode|tg128' $OUT/run/log.txt | paste - - | awk -F'|' '{print $1, $(NF-1)}'
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for s in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
SAMESUM_CUDA_GRAPHS=0 timeout 120 $ncu_bin --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
    .gpu/samesum bench --device cuda -m /tmp/models/$s.gguf -p 0 -n 2 -r 1 --no-warmup > $OUT/warm-$s.csv 2>&1
echo "ncu $s rc=$?"
done
gzip $OUT/*.csv
