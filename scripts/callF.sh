#!/usr/bin/env bash
# Session 17 final calls (ad hoc): `A OUT` tests and tiny gates, `B OUT` the
# 40-layer gate, benchmarks and A/B arms, on the same warm machine. A test
# failure in A turns its switch off (written to /tmp/fallback.env) for the
# rest of A and all of B.
mode=${1:?}; out=${2:?}
mkdir -p "$out"
export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD SAMESUM_KERNEL_CACHE=/tmp/samesum-kernels
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
done
if [ "$mode" = A ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv > "$out/gpu.txt"
    t0=$SECONDS
    CUDA_CACHE_DISABLE=1 timeout 200 .gpu/test-kernels_compile --nocapture > "$out/kernels-compile.txt" 2>&1
    echo "kernels_compile rc=$? ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
    t0=$SECONDS
    timeout 330 .gpu/test-gpu --nocapture --test-threads=1 > "$out/gpu-tests.txt" 2>&1
    echo "gpu tests rc=$? ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
    : > /tmp/fallback.env
    for pair in attention_at_the_real:ATT_P32 lane_squares:SQ_LANES warp_glu:SILU_WARP tiled_conv:CONV_TILE tensor_core_matmuls:TC_GROUPS; do
        if grep -qE "^test ${pair%%:*}.*FAILED|^    ${pair%%:*}" "$out/gpu-tests.txt"; then
            echo "export SAMESUM_CUDA_${pair##*:}=0" >> /tmp/fallback.env
        fi
    done
    cp /tmp/fallback.env "$out/fallback.env"
    source /tmp/fallback.env
    for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
        t0=$SECONDS
        timeout 120 .gpu/samesum identity --device cuda --shape "$shape" --chunk 1,7,64,128,256 --gen 64 \
            > "$out/identity-$shape.txt" 2>&1
        echo "identity $shape rc=$? ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
    done
    grep -h "equal\|identical\|differ" "$out"/identity-*.txt | tail -6
    # The 40-layer model for B (made once per machine).
    mkdir -p /tmp/models
    t0=$SECONDS
    .gpu/samesum synth --shape qwen35moe-35b-a3b --quant q4_k -o /tmp/models/qwen35moe-35b-a3b.gguf > /dev/null 2>&1
    echo "synth qwen35moe rc=$? ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
else
    [ -f /tmp/fallback.env ] && source /tmp/fallback.env && cp /tmp/fallback.env "$out/fallback.env"
    SAMESUM_GPU_STEPS=bigidentity,bench,q3moe SAMESUM_GPU_PP=512,4096,16384 SAMESUM_GPU_REPS=1 \
        SAMESUM_GPU_ARMS=batched scripts/gpu.sh run "$out"
    q35=/tmp/models/qwen35moe-35b-a3b.gguf q3=/tmp/models/qwen3moe-30b-a3b.gguf
    timeout 60 .gpu/samesum bench --device cuda -m "$q35" -p 4096 -n 0 -r 1 --prefill replay --no-warmup \
        > "$out/replay.txt" 2>&1
    for arm in - SAMESUM_CUDA_ATT_P32=0 SAMESUM_CUDA_SQ_LANES=0 SAMESUM_CUDA_SILU_WARP=0; do
        s=(); [ "$arm" != - ] && s=("$arm"); arm=${arm#SAMESUM_CUDA_}
        timeout 60 env "${s[@]}" .gpu/samesum bench --device cuda -m "$q35" -p 4096,16384 -n 0 -r 1 \
            --prefill batched > "$out/ab-q35-${arm//=/_}.txt" 2>&1
    done
    for arm in - SAMESUM_CUDA_ATT_P32=0; do
        s=(); [ "$arm" != - ] && s=("$arm"); arm=${arm#SAMESUM_CUDA_}
        timeout 90 env "${s[@]}" .gpu/samesum bench --device cuda -m "$q3" -p 4096 -n 0 -r 1 \
            --prefill batched --profile > "$out/ab-q3-${arm//=/_}.txt" 2>&1
    done
    grep -h "pp\|tg" "$out"/replay.txt "$out"/ab-*.txt | grep "|" | head -20
fi
