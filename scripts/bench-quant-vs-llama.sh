#!/usr/bin/env bash
# Dot-product throughput, samesum vs llama.cpp, single thread, same formats and
# sizes: llama.cpp's tests/test-quantize-perf (vec_dot_q) against
# `samesum bench-quant` over the same number of weights, in rows of 4096 (a
# model-sized row: the activation row stays in L1 and is reused by every weight
# row, where llama.cpp's microbenchmark streams one activation as long as the weights).
#
#   scripts/bench-quant-vs-llama.sh /path/to/test-quantize-perf
set -euo pipefail
cd "$(dirname "$0")/.."
PERF="$1"
BIN=target/release/samesum
cargo build --release --locked -q -p samesum
echo "| format | weights | llama.cpp vec_dot GB/s | samesum avx2 GB/s | samesum avx512 GB/s |"
echo "|---|---|---|---|---|"
for t in q4_0 q8_0 q4_K q5_K q6_K iq4_xs f16 bf16; do
    for n in 655360 65536000; do
        # llama.cpp: "quantized throughput" of the block for size n.
        ll=$("$PERF" --type "$t" --op vec_dot_q --size "$n" -i 10 2>&1 \
            | awk '/quantized throughput/ {print $4}' | tail -1)
        bytes=$(python3 -c "
sizes={'q4_0':(32,18),'q8_0':(32,34),'q4_K':(256,144),'q5_K':(256,176),'q6_K':(256,210),'iq4_xs':(256,136),'f16':(1,2),'bf16':(1,2)}
b,s=sizes['$t']; print($n//b*s)")
        row=4096
        ours=$("$BIN" bench-quant --formats "$t" --bytes "$bytes" --row "$row" --min-ms 300 \
            | awk -F'|' -v t="$t" '$2 ~ "^ "t" $" {gsub(/ /,"",$0); print $0}')
        avx2=$(echo "$ours" | awk -F'|' '{print $8}')
        avx512=$(echo "$ours" | awk -F'|' '{print $10}')
        echo "| $t | $n | $ll | $avx2 | $avx512 |"
    done
done
