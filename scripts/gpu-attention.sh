#!/usr/bin/env bash
# CUDA's default attention (`--attention fast --kv-type f16`:
# flash attention over an f16 cache) on a GPU machine without Rust or
# network: its gates, its agreement with the reference configuration, and
# its speed at depth against the build being replaced and llama.cpp on the
# same files, in one run.
#
#   scripts/gpu-attention.sh start OUT [LAYERS]  # there: starts the run in the background
#   scripts/gpu-attention.sh wait OUT S [COPY]   # there: shows progress for up to S seconds
#                                                # (and copies OUT's logs to COPY)
#
# A run outlives the call that started it: start it in a fixed OUT (e.g.
# /tmp/att-run) and give each call's own output folder as COPY, so every
# call brings the log so far back.
#
# LAYERS (default: the shapes' own) writes the models with that many layers:
# a short run still measures decode attention at depth per layer, the
# tests and the gates, in minutes instead of the full models' twenty.
#
# Needs .gpu/ (`scripts/gpu.sh bundle`), .gpu-old/samesum (the build being
# replaced, run with `--attention fast --kv-type f16`) and
# .cache/gpu-carry/llama.cpp.tar.xz (`scripts/gpu-mixes.sh carry`). Steps, in
# order (SAMESUM_ATT_STEPS picks some): compile (the machine's NVRTC, spills),
# tests (the GPU tests of attention, sequences, block ops, graphs), identity
# (the gate with the defaults on the tiny models, and its negative control),
# probe (decode by depth with and without recorded steps, the kernel
# tables of 8 and 64 sequences a step, the MoE block at 1, 8 and 64 rows, on qwen3moe-30b-a3b and qwen35moe-35b-a3b at
# the q4_k_m mix, qwen3moe with YaRN x4 so that 65,536 fits), agree
# (teacher-forced agreement with the reference and the probe), bench (pp and
# tg at depth, several sequences a step; samesum and the old build, prefill too), serving
# (not in the default steps: `samesum serve` with 8 and 64 streaming clients
# against llama-batched-bench, both builds, and a follow-up chat turn of an
# ~8,000-token conversation from the prefix cache against cold;
# SAMESUM_ATT_SERVE_BINS picks the builds, default ".gpu .gpu-old", and
# SAMESUM_ATT_SERVE_FLAGS adds `serve` flags, e.g. "--chunk 2048"; the
# follow-up turns use the first), llama
# (llama.cpp's figures on the same files), long (not in the default
# steps: pp131072 on qwen35moe against llama.cpp, and the identity gate on
# prompts of 32,768 and 131,072 tokens), ab (not in the default steps:
# the builds in the directories SAMESUM_ATT_AB, default ".gpu-old .gpu",
# alternated SAMESUM_ATT_ROUNDS (2) times: pp4096 and pp16384 (-r 2),
# tg128 at depth 16,384, 2, 8, 16, 32 and 64 sequences a step, both models). SAMESUM_ATT_PP=0 leaves
# prefill out of bench and llama; the llama.cpp steps wait up to
# SAMESUM_ATT_LLAMA_WAIT x 5 s (60) for its build. The models and llama.cpp are made in the background from the
# start. Results: OUT/log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
start)
    out=${2:?usage: scripts/gpu-attention.sh start OUT}
    mkdir -p "$out"
    setsid nohup "$0" run "$out" "${3:-}" >"$out/log.txt" 2>&1 </dev/null &
    echo "started: $out/log.txt"
    ;;
wait)
    out=${2:?} secs=${3:-540} copy=${4:-}
    [ -e "$out/log.txt" ] || { echo "no run in $out (scripts/gpu-attention.sh start $out first)"; exit 2; }
    end=$((SECONDS + secs))
    while [ $SECONDS -lt $end ] && ! grep -q "^=== done" "$out/log.txt" 2>/dev/null; do
        sleep 10
        [ -n "$copy" ] && mkdir -p "$copy" && cp "$out"/*.log "$out/log.txt" "$copy"/ 2>/dev/null
    done
    [ -n "$copy" ] && mkdir -p "$copy" && cp "$out"/*.log "$out/log.txt" "$copy"/ 2>/dev/null
    tail -n "${SAMESUM_ATT_TAIL:-60}" "$out/log.txt"
    ;;
run)
    out=${2:?}
    layers=()
    [ -n "${3:-}" ] && layers=(--layers "$3")
    steps=",${SAMESUM_ATT_STEPS:-compile,tests,identity,bench,probe,agree,llama},"
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
    done
    export SAMESUM_REQUIRE=gpu,nvrtc
    export SAMESUM_KERNEL_CACHE=${SAMESUM_KERNEL_CACHE:-/tmp/samesum-kernels}
    work=${SAMESUM_ATT_WORK:-/tmp/att}
    FAST="--attention fast --kv-type f16"
    mkdir -p "$work"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    q35=$work/qwen35moe-q4_k_m.gguf q3=$work/qwen3moe-yarn4-q4_k_m.gguf
    # The models are kept in WORK for a later run with the same LAYERS.
    stamp="$work/synth.done.${3:-full}"
    [ -e "$stamp" ] && [ -e "$q35" ] && [ -e "$q3" ] && cp "$stamp" "$work/synth.done"
    [ -e "$work/synth.done" ] && [ ! -e "$stamp" ] && rm -f "$work/synth.done"
    [ -e "$work/synth.done" ] || (
        .gpu/samesum synth --force --shape qwen35moe-35b-a3b --mix q4_k_m "${layers[@]}" -o "$q35" 2>&1 | tail -n 1
        .gpu/samesum synth --force --shape qwen3moe-30b-a3b --mix q4_k_m --yarn 4 "${layers[@]}" -o "$q3" 2>&1 | tail -n 1
        touch "$work/synth.done" "$stamp"
    ) >"$out/synth.log" 2>&1 &
    llama=$work/llama.cpp/build/bin
    # A build that an earlier run on this machine started and that is still
    # going is left to finish (starting over would lose its progress).
    building() { [ -e "$work/llama.pid" ] && kill -0 "$(cat "$work/llama.pid")" 2>/dev/null; }
    if [ ! -x "$llama/llama-bench" ] && ! building; then
        (
            set -e
            cd "$work"
            rm -rf llama.cpp
            tar xJf "$OLDPWD/.cache/gpu-carry/llama.cpp.tar.xz"
            export PATH=$PATH:/usr/local/cuda/bin
            cmake -S llama.cpp -B llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
                -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
                -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF
            cmake --build llama.cpp/build -j10 --target llama-bench llama-batched-bench
        ) >"$work/llama-build.log" 2>&1 &
        echo $! >"$work/llama.pid"
    fi
    step() { # name, command...
        local name=$1
        shift
        local t0=$SECONDS
        echo "=== $name"
        "$@"
        local rc=$?
        echo "=== $name: rc=$rc ($((SECONDS - t0)) s)"
        return $rc
    }
    if [[ $steps == *,compile,* ]]; then
        step compile .gpu/test-kernels_compile --nocapture
    fi
    if [[ $steps == *,tests,* ]]; then
        filter=(attention flash f16_kv sequences_batched every_block_op graph_replayed moe_combine
            forked batched several_sequences greedy recorded paged)
        # Where they fail and .gpu-sg/test-gpu is there (the tests of the
        # build below this one's last change), those run too.
        step tests .gpu/test-gpu "${filter[@]}" --include-ignored --test-threads=1 ||
            { [ -x .gpu-sg/test-gpu ] && step "tests, .gpu-sg" .gpu-sg/test-gpu "${filter[@]}" \
                --include-ignored --test-threads=1; }
    fi
    if [[ $steps == *,identity,* ]]; then
        for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
            step "identity $shape" timeout 300 .gpu/samesum identity --device cuda \
                --shape "$shape" --chunk 1,7,64,256 --gen 32 $FAST
        done
        step "negative control (must fail)" timeout 300 .gpu/samesum identity --device cuda \
            --shape tiny-qwen3moe --chunk 64 --gen 16 --negative-control $FAST 2>&1 | tee "$work/neg.log"
        if grep -Eq "identity gate failed: [1-9][0-9]* different" "$work/neg.log"; then
            echo "negative control: caught"
        else
            echo "negative control: NOT caught (no differing runs reported)"
        fi
    fi
    while [ ! -e "$work/synth.done" ]; do sleep 5; done
    cat "$out/synth.log"
    if [[ $steps == *,probe,* ]]; then
        # Where decode's time goes at depth and with many sequences: the
        # slope over depth with recorded steps and without, and the kernel
        # tables of 8- and 64-sequence runs.
        for m in "$q3" "$q35"; do
            step "samesum tg by depth $m" timeout 300 .gpu/samesum bench --device cuda -m "$m" \
                -p 0 -n 32 -d 0,4096,16384,65536 -r 1 $FAST
            step "samesum tg by depth, no graphs $m" env SAMESUM_CUDA_GRAPHS=0 timeout 300 \
                .gpu/samesum bench --device cuda -m "$m" -p 0 -n 32 -d 0,16384,65536 -r 1 $FAST
            step "samesum parallel profile $m" timeout 300 .gpu/samesum bench --device cuda \
                -m "$m" -p 128 -n 16 -r 1 --parallel 8,64 --profile $FAST
        done
        # The MoE block alone at the rows of 1, 8 and 64 decode sequences.
        for rows in 1 8 64; do
            step "bench-gemm qwen35moe q4_k $rows rows" timeout 120 .gpu/samesum bench-gemm \
                --device cuda --shape qwen35moe-35b-a3b --formats q4_k,q6_k -m "$rows" -r 20 --profile
        done
    fi
    if [[ $steps == *,agree,* ]]; then
        for m in "$q35" "$q3"; do
            step "agree $m" timeout 900 .gpu/samesum agree --device cuda -m "$m" \
                --lens 512,8192,32768 --gen 64 --seeds 2 --probe reversed-topk \
                --attention fast --kv-type-b f16
            step "control $m" timeout 300 .gpu/samesum agree --device cuda -m "$m" \
                --lens 512 --gen 64 --attention exact --kv-type-b f32
        done
    fi
    if [[ $steps == *,ab,* ]]; then
        for r in $(seq "${SAMESUM_ATT_ROUNDS:-2}"); do
            for m in "$q35" "$q3"; do
                for bin in ${SAMESUM_ATT_AB:-.gpu-old .gpu}; do
                    step "ab round $r $bin pp $m" timeout 300 "$bin/samesum" bench --device cuda \
                        -m "$m" -p 4096,16384 -n 0 -r 2 --prefill batched $FAST
                    step "ab round $r $bin tg $m" timeout 300 "$bin/samesum" bench --device cuda \
                        -m "$m" -p 0 -n 128 -d 16384 -r 1 $FAST
                    step "ab round $r $bin parallel $m" timeout 300 "$bin/samesum" bench \
                        --device cuda -m "$m" -p 128 -n 32 -r 1 --parallel 2,8,16,32,64 $FAST
                done
            done
        done
    fi
    if [[ $steps == *,bench,* ]]; then
        for m in "$q35" "$q3"; do
            pp=4096,16384
            [ "$m" = "$q35" ] && pp=4096,16384,32768
            [ "${SAMESUM_ATT_PP:-1}" = 1 ] && step "samesum pp $m" timeout 600 .gpu/samesum bench \
                --device cuda -m "$m" -p "$pp" -n 0 -r 1 --prefill batched $FAST
            [ "${SAMESUM_ATT_PP:-1}" = 1 ] && step "old build pp $m" timeout 600 .gpu-old/samesum bench \
                --device cuda -m "$m" -p "$pp" -n 0 -r 1 --prefill batched --attention fast --kv-type f16
            step "samesum tg $m" timeout 600 .gpu/samesum bench --device cuda -m "$m" -p 0 \
                -n 128 -d 0,16384,65536 -r 1 $FAST
            step "old build tg $m" timeout 300 .gpu-old/samesum bench --device cuda -m "$m" -p 0 \
                -n 128 -d 16384 -r 1 --attention fast --kv-type f16
            step "samesum profile tg $m" timeout 300 .gpu/samesum bench --device cuda -m "$m" \
                -p 0 -n 32 -d 16384 -r 1 --profile $FAST
            step "samesum parallel $m" timeout 300 .gpu/samesum bench --device cuda -m "$m" \
                -p 128 -n 64 -r 1 --parallel 8,64 $FAST
            step "old build parallel $m" timeout 300 .gpu-old/samesum bench --device cuda -m "$m" \
                -p 128 -n 64 -r 1 --parallel 8,64 --attention fast --kv-type f16
        done
    fi
    if [[ $steps == *,serving,* ]]; then
        # The serving bars' setting: qwen35moe behind `samesum serve`, 8 and
        # 64 streaming clients, prompts of about 512 tokens, 128 generated
        # (bench-serve), then llama-batched-bench on the same file at 1, 8
        # and 64 sequences (npp 512, ntg 128).
        serve() { # name, binary dir, extra serve flags...
            local name=$1 bin=$2
            shift 2
            "$bin/samesum" serve --device cuda -m "$q35" --max-batch 64 -c 16384 --port 8089 \
                ${SAMESUM_ATT_SERVE_FLAGS:-} "$@" \
                >"$out/serve-$name.log" 2>&1 &
            spid=$!
            for i in $(seq 120); do
                curl -sf http://127.0.0.1:8089/health >/dev/null 2>&1 && break
                sleep 1
            done
        }
        bins=(${SAMESUM_ATT_SERVE_BINS:-.gpu .gpu-old})
        for bin in "${bins[@]}"; do
            serve "${bin#.}" "$bin"
            for c in 8 64; do
                step "serving $bin $c clients" timeout 300 .gpu/samesum bench-serve \
                    --url http://127.0.0.1:8089 --clients "$c" --requests $((2 * c)) \
                    --prompt-tokens 512 --max-tokens 128
            done
            # A follow-up turn of an ~8,000-token conversation from the
            # prefix cache (the cold request: the server below).
            [ "$bin" = "${bins[0]}" ] && step "follow-up turn, prefix cache" timeout 300 \
                python3 scripts/followup.py --url http://127.0.0.1:8089 --words 2600 --rounds 5
            kill "$spid"
            wait "$spid" 2>/dev/null
        done
        serve cold "${bins[0]}" --prefix-cache-mb 0
        step "follow-up turn, cold" timeout 300 \
            python3 scripts/followup.py --url http://127.0.0.1:8089 --words 2600 --rounds 5
        kill "$spid"
        wait "$spid" 2>/dev/null
        for i in $(seq "${SAMESUM_ATT_LLAMA_WAIT:-60}"); do [ -x "$llama/llama-batched-bench" ] && break; sleep 5; done
        step "llama.cpp batched $q35" timeout 600 "$llama/llama-batched-bench" -m "$q35" \
            -c 90000 -b 2048 -ub 2048 -fa 1 -ngl 99 -npp 512 -ntg 128 -npl 1,8,64
    fi
    if [[ $steps == *,llama,* ]]; then
        for i in $(seq "${SAMESUM_ATT_LLAMA_WAIT:-60}"); do [ -x "$llama/llama-bench" ] && break; sleep 5; done
        tail -n 3 "$work/llama-build.log"
        for m in "$q35" "$q3"; do
            pp=4096,16384
            [ "$m" = "$q35" ] && pp=4096,16384,32768
            [ "${SAMESUM_ATT_PP:-1}" = 1 ] && step "llama.cpp pp $m" timeout 600 "$llama/llama-bench" -m "$m" -fa 1 -ub 2048 -ngl 99 \
                -r 1 -p "$pp" -n 0
            step "llama.cpp tg $m" timeout 600 "$llama/llama-bench" -m "$m" -fa 1 -ub 2048 -ngl 99 \
                -r 1 -p 0 -n 128 -d 0,16384,65536
        done
    fi
    if [[ $steps == *,long,* ]]; then
        # 131,072-token prompts: qwen35moe's prefill against llama.cpp, then
        # the identity gate on random prompts 8 tokens short of each length
        # in SAMESUM_ATT_LONG (default "32768 131072"; 131,072 on qwen35moe
        # only), CUDA's default chunk, 16 generated tokens so decode crosses
        # a key split. The one-token replay of 131,072 tokens takes minutes.
        step "samesum pp131072 $q35" timeout 600 .gpu/samesum bench --device cuda -m "$q35" \
            -p 131072 -n 0 -r 1 --prefill batched $FAST
        for i in $(seq "${SAMESUM_ATT_LLAMA_WAIT:-60}"); do [ -x "$llama/llama-bench" ] && break; sleep 5; done
        step "llama.cpp pp131072 $q35" timeout 600 "$llama/llama-bench" -m "$q35" -fa 1 \
            -ub 2048 -ngl 99 -r 1 -p 131072 -n 0
        for len in ${SAMESUM_ATT_LONG:-32768 131072}; do
            n=$((len - 8))
            printf '[{"name": "random-%s", "random": %s, "seed": 5}]\n' "$n" "$n" >"$work/long-$n.json"
            models=("$q35")
            [ "$len" -le 32768 ] && models+=("$q3")
            for m in "${models[@]}"; do
                step "identity $len $m" timeout 1200 .gpu/samesum identity --device cuda -m "$m" \
                    --prompts "$work/long-$n.json" --chunk 2048 --gen 16 $FAST
            done
        done
    fi
    echo "=== done"
    ;;
*)
    sed -n 2,20p "$0"
    exit 2
    ;;
esac
