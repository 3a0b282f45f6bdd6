#!/usr/bin/env bash
# Every GPU test and benchmark in one call.
#
#   scripts/gpu.sh bundle        # here (has Rust): build, put binaries in .gpu/
#   scripts/gpu.sh run OUTDIR    # on the GPU machine (no Rust): run from .gpu/
#
# `run` writes its logs and tables under OUTDIR and ends with a summary.
# SAMESUM_GPU_STEPS picks steps, comma-separated (default: all of
# compile,tests,identity,bigidentity,bench,q3moe; smoke is a quick pp512/tg32 with a
# kernel profile; serve checks the server on the GPU). A full run takes longer than one 10-minute device call:
# split it, e.g. compile,tests,identity then bigidentity,bench then q3moe.
# compile is kernels_compile with the machine's NVRTC (registers and spills
# per kernel; ~60 s; CI runs the same check with NVRTC from PyPI, and the
# GPU tests compile every kernel anyway); tests runs the GPU tests, only
# those whose names contain one of SAMESUM_GPU_TESTS (space-separated) when
# it is set.
# The bench steps take SAMESUM_GPU_PP (prompt lengths, default 512,4096),
# SAMESUM_GPU_TG (decode tokens, 128), SAMESUM_GPU_REPS (2), SAMESUM_GPU_ARMS
# (replay,batched) and SAMESUM_GPU_CHUNK (the CUDA default, 2048); the chunks step sweeps
# SAMESUM_GPU_CHUNKS ("512 1024 2048") for batched pp4096 and pp16384;
# replay measures qwen35moe replay at SAMESUM_GPU_REPLAY_PP (4096), one run;
# longq35 / longq3 measure replay at pp16384 (one run, several minutes each;
# SAMESUM_GPU_LONG_PP and _LONG_TIMEOUT change the lengths and the limit);
# SAMESUM_GPU_ID_CHUNKS sets the identity step's chunk sizes.
# depth measures decode (tg128) at context depths SAMESUM_GPU_DEPTHS
# (0,4096,16384) on both models.
# ncu profiles single launches with Nsight Compute (SAMESUM_GPU_NCU_PREFILL,
# _DECODE, _SKIP; prefill kernels from a pp SAMESUM_GPU_NCU_PP run at chunk
# SAMESUM_GPU_NCU_CHUNK, 512 and 512 unless set; SAMESUM_GPU_NCU_SECTIONS adds
# ncu arguments, e.g. "--section ComputeWorkloadAnalysis"; SAMESUM_GPU_NCU_SOURCE=1
# also writes each kernel's source page, SASS with per-instruction samples,
# to OUTDIR/ncu-KERNEL-source.csv.gz, which scripts/ncu_source.py sums up).
# tier runs tier mode (issue 8): identity on the tiny models with
# --vram-budget 2G, then bench on qwen35moe at SAMESUM_GPU_BUDGETS ("24G
# 12G") for SAMESUM_GPU_TIER_PP (1024,8192); tier122 the 122B shape at 40G.
# SAMESUM_GPU_TIER_ARGS adds arguments to the tier benches (e.g. --no-warmup).
# floor builds scripts/launch_floor.cu with nvcc and runs it: microseconds a
# dependent step as graph launches, with PDL, and in one persistent launch
# (SAMESUM_GPU_FLOOR_ARGS: "steps reps", default "480 50").
# agree measures teacher-forced agreement (samesum agree) of
# SAMESUM_GPU_AGREE_VARIANT against the defaults, and the same-arm control;
# SAMESUM_GPU_AGREE_SEEDS prompts per length, SAMESUM_GPU_AGREE_PROBE a probe
# arm (e.g. ATT_ULP=1: the probe bar of docs/CAPABILITIES.md).
# profiles runs `bench --profile` on both models per arm of
# SAMESUM_GPU_PROFILE_ARMS ("-;SAMESUM_CUDA_ATT_VFULL=0": defaults, then the
# switch), at SAMESUM_GPU_PROFILE_PP (4096): kernel-time A/Bs;
# SAMESUM_GPU_PROFILE_SHAPES (space-separated) picks the models.
# token sums one decode token's kernel times (ncu, graphs off, caches warm)
# on both models per kernel (scripts/ncu_token.py), for each arm of
# SAMESUM_GPU_TOKEN_ARMS (arms as for profiles) at a context of
# SAMESUM_GPU_TOKEN_CTX (0) keys; SAMESUM_GPU_TOKEN_SHAPES (space-separated)
# picks the models.
# prefill runs batched pp4096,16384 on qwen35moe per arm of
# SAMESUM_GPU_PREFILL_ARMS (arms as for profiles), without --profile (which
# changes the schedule: one stream), the arms alternated
# SAMESUM_GPU_PREFILL_ROUNDS (2) times: prefill A/Bs of the schedule.
# decode runs tg128 (-r 3) on both models per arm of SAMESUM_GPU_DECODE_ARMS
# (arms as for profiles, e.g. "-;SAMESUM_CUDA_PDL=0"), the arms alternated
# SAMESUM_GPU_DECODE_ROUNDS (2) times: decode A/Bs, which single runs do
# not resolve (session 11: +-2 tok/s between runs); SAMESUM_GPU_DECODE_SHAPES
# (space-separated) picks the models.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
bundle)
    set -e
    cargo build --release -p samesum
    cargo test --release -p samesum-cuda --no-run --message-format=json 2>/dev/null \
        | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' > .gpu.list
    rm -rf .gpu && mkdir -p .gpu
    cp target/release/samesum .gpu/samesum
    while read -r name exe; do cp "$exe" ".gpu/test-$name"; done < .gpu.list
    rm -f .gpu.list
    strip .gpu/* 2>/dev/null || true
    ls -la .gpu
    ;;
run)
    out=${2:?usage: scripts/gpu.sh run OUTDIR}
    mkdir -p "$out"
    steps=",${SAMESUM_GPU_STEPS:-compile,tests,identity,bigidentity,bench,q3moe},"
    export SAMESUM_REQUIRE_GPU=1 SAMESUM_REQUIRE_NVRTC=1 SAMESUM_REPO=$PWD
    export SAMESUM_KERNEL_CACHE=${SAMESUM_KERNEL_CACHE:-/tmp/samesum-kernels}
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
    done
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
    summary=()
    step() { # name, command...
        local name=$1; shift
        local t0=$SECONDS
        echo "=== $name" | tee -a "$out/log.txt"
        "$@" >>"$out/log.txt" 2>&1
        local rc=$?
        summary+=("$name: rc=$rc ($((SECONDS - t0)) s)")
        echo "--- $name rc=$rc" | tee -a "$out/log.txt"
        return $rc
    }
    if [[ $steps == *,compile,* ]]; then
        step kernels-compile env CUDA_CACHE_DISABLE=1 .gpu/test-kernels_compile --nocapture
    fi
    if [[ $steps == *,tests,* ]]; then
        read -ra filters <<< "${SAMESUM_GPU_TESTS:-}"
        step gpu-tests .gpu/test-gpu "${filters[@]}" --nocapture --test-threads=1
    fi
    if [[ $steps == *,identity,* ]]; then
        for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
            step "identity-$shape" timeout 300 .gpu/samesum identity --device cuda --shape "$shape" \
                --chunk ${SAMESUM_GPU_ID_CHUNKS:-1,7,64,128,256} --gen 64
        done
    fi
    arm_split() { # arm -> settings (VAR=value words) and bin (BIN=path picks another binary, e.g. an older build's)
        settings=()
        bin=.gpu/samesum
        local all=() w
        [ "$1" != "-" ] && read -ra all <<< "$1"
        for w in "${all[@]}"; do
            if [[ $w == BIN=* ]]; then bin=${w#BIN=}; else settings+=("$w"); fi
        done
    }
    model() { # shape -> path of a synthetic q4_k model of it (made once per machine)
        local f=/tmp/models/$1.gguf
        mkdir -p /tmp/models
        [ -f "$f" ] || .gpu/samesum synth --shape "$1" --quant q4_k -o "$f" >>"$out/log.txt" 2>&1
        echo "$f"
    }
    if [[ $steps == *,smoke,* ]]; then
        q35=$(model qwen35moe-35b-a3b)
        step smoke-bench timeout 300 .gpu/samesum bench --device cuda -m "$q35" -p 512 -n 32 -r 1 \
            --prefill batched
        step smoke-profile timeout 200 .gpu/samesum bench --device cuda -m "$q35" -p 512 -n 8 -r 1 \
            --prefill batched --profile
    fi
    if [[ $steps == *,bigidentity,* ]]; then
        q35=$(model qwen35moe-35b-a3b)
        step identity-q35-40l timeout 400 .gpu/samesum identity --device cuda -m "$q35" \
            --chunk 128,2048 --gen 16 ${SAMESUM_GPU_IDENTITY_ARGS:-}
    fi
    if [[ $steps == *,bench,* ]]; then
        q35=$(model qwen35moe-35b-a3b)
        step bench-q35 timeout 400 .gpu/samesum bench --device cuda -m "$q35" \
            -p ${SAMESUM_GPU_PP:-512,4096} -n ${SAMESUM_GPU_TG:-128} -r ${SAMESUM_GPU_REPS:-2} \
            --prefill ${SAMESUM_GPU_ARMS:-replay,batched} ${SAMESUM_GPU_CHUNK:+--chunk $SAMESUM_GPU_CHUNK}
        step profile-q35 timeout 200 .gpu/samesum bench --device cuda -m "$q35" -p 4096 -n 32 -r 1 \
            --prefill batched --profile
    fi
    # Replay slows with the context (~2 us per context token per token on
    # qwen35moe at a312769: ~26 ms per token on average over 16384 tokens,
    # ~7 minutes), so run each long step alone in a device call.
    long_replay() { # shape: replay at pp16384, one run, no warm-up
        local f
        f=$(model "$1")
        step "long-replay-$1" timeout ${SAMESUM_GPU_LONG_TIMEOUT:-540} .gpu/samesum bench --device cuda -m "$f" \
            -p ${SAMESUM_GPU_LONG_PP:-16384} -n 0 -r 1 \
            --prefill replay --no-warmup
    }
    if [[ $steps == *,replay,* ]]; then
        # qwen35moe replay at pp4096 (one run, no warm-up): the
        # batched-over-replay bar's denominator.
        q35=$(model qwen35moe-35b-a3b)
        step replay-q35 timeout 200 .gpu/samesum bench --device cuda -m "$q35" \
            -p ${SAMESUM_GPU_REPLAY_PP:-4096} -n 0 -r 1 --prefill replay --no-warmup
    fi
    [[ $steps == *,longq35,* ]] && long_replay qwen35moe-35b-a3b
    [[ $steps == *,longq3,* ]] && long_replay qwen3moe-30b-a3b
    if [[ $steps == *,chunks,* ]]; then
        # Batched prefill at several chunk sizes (picks the CUDA default).
        q35=$(model qwen35moe-35b-a3b)
        for c in ${SAMESUM_GPU_CHUNKS:-512 1024 2048}; do
            step "chunk-$c" timeout 300 .gpu/samesum bench --device cuda -m "$q35" -p 4096,16384 -n 0 -r 1 \
                --prefill batched --chunk "$c"
        done
    fi
    if [[ $steps == *,q3moe,* ]]; then
        q3=$(model qwen3moe-30b-a3b)
        step bench-q3moe timeout 400 .gpu/samesum bench --device cuda -m "$q3" \
            -p ${SAMESUM_GPU_PP:-512,4096} -n ${SAMESUM_GPU_TG:-128} -r ${SAMESUM_GPU_REPS:-2} \
            --prefill ${SAMESUM_GPU_ARMS:-replay,batched} ${SAMESUM_GPU_CHUNK:+--chunk $SAMESUM_GPU_CHUNK}
    fi
    if [[ $steps == *,depth,* ]]; then
        # Decode at context depths (llama-bench's -d): tg128 after 0, 4096
        # and 16384 prefilled tokens, both models.
        for shape in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
            f=$(model "$shape")
            step "depth-$shape" timeout 400 .gpu/samesum bench --device cuda -m "$f" -p 0 -n 128 \
                -d ${SAMESUM_GPU_DEPTHS:-0,4096,16384} -r 1 ${SAMESUM_GPU_CHUNK:+--chunk $SAMESUM_GPU_CHUNK}
        done
    fi
    if [[ $steps == *,tier,* ]]; then
        # Tier mode (issue 8): the identity gate with the experts in host
        # memory, then qwen35moe under VRAM budgets (prefill from staged
        # layers, decode through the expert cache; bench prints the cache's
        # hits and the bytes copied).
        for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
            step "identity-tier-$shape" timeout 300 .gpu/samesum identity --device cuda --vram-budget 2G \
                --shape "$shape" --chunk ${SAMESUM_GPU_ID_CHUNKS:-7,64,256} --gen 64
        done
        q35=$(model qwen35moe-35b-a3b)
        for b in ${SAMESUM_GPU_BUDGETS:-24G 12G}; do
            step "bench-tier-$b" timeout 400 .gpu/samesum bench --device cuda --vram-budget "$b" -m "$q35" \
                -p ${SAMESUM_GPU_TIER_PP:-1024,8192} -n 128 -r 1 --prefill batched --chunk 512 ${SAMESUM_GPU_TIER_ARGS:-}
        done
    fi
    if [[ $steps == *,tier122,* ]]; then
        # qwen35moe-122b-a10b at q4_k is ~70 GB: more than the 1-GPU
        # machine's 64 GB disk; run on nvidia-h200-x2 (128 GB).
        big=$(model qwen35moe-122b-a10b)
        step "bench-tier122-40G" timeout 500 .gpu/samesum bench --device cuda --vram-budget 40G -m "$big" \
            -p ${SAMESUM_GPU_TIER_PP:-1024,8192} -n 128 -r 1 --prefill batched --chunk 512 ${SAMESUM_GPU_TIER_ARGS:-}
    fi
    if [[ $steps == *,ncu,* ]]; then
        # Nsight Compute on single launches (hardware counters; clocks left
        # alone): prefill kernels from a pp512 batched run, decode kernels
        # from a tg8 run, graphs off so each launch is its own.
        # SAMESUM_GPU_NCU_PREFILL / _DECODE name the kernels, _SKIP the
        # launches skipped first (past the first layers).
        ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
        q35=$(model qwen35moe-35b-a3b)
        secs="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis ${SAMESUM_GPU_NCU_SECTIONS:-}"
        ncu_one() { # kernel, bench arguments...
            local k=$1; shift
            local rep=()
            [ -n "${SAMESUM_GPU_NCU_SOURCE:-}" ] && rep=(-f -o "$out/ncu-$k")
            step "ncu-$k" timeout 300 "$ncu_bin" --clock-control none -k "regex:^$k\$" \
                --launch-skip ${SAMESUM_GPU_NCU_SKIP:-5} -c 1 $secs "${rep[@]}" \
                env SAMESUM_CUDA_GRAPHS=0 .gpu/samesum bench --device cuda -m "$q35" "$@" -r 1 --no-warmup
            # With SAMESUM_GPU_NCU_SOURCE set, the report is kept and its
            # source page (SASS with per-instruction stall samples) written
            # as CSV beside it.
            if [ -n "${SAMESUM_GPU_NCU_SOURCE:-}" ] && [ -f "$out/ncu-$k.ncu-rep" ]; then
                "$ncu_bin" --import "$out/ncu-$k.ncu-rep" --page source --csv --print-source sass \
                    > "$out/ncu-$k-source.csv" 2>>"$out/log.txt"
                gzip -f "$out/ncu-$k-source.csv"
                # The sections themselves (printed to the log without -o).
                "$ncu_bin" --import "$out/ncu-$k.ncu-rep" --page details >> "$out/log.txt" 2>&1 || true
                rm -f "$out/ncu-$k.ncu-rep"
            fi
        }
        for k in ${SAMESUM_GPU_NCU_PREFILL-mm_tc_q4_k_async attention_tiles delta_cols_128 mm_f32_tile}; do
            ncu_one "$k" -p ${SAMESUM_GPU_NCU_PP:-512} -n 0 --prefill batched --chunk ${SAMESUM_GPU_NCU_CHUNK:-512}
        done
        # (Set but empty, either list runs nothing.)
        for k in ${SAMESUM_GPU_NCU_DECODE-mm_q4_k_1 mm_q4_k_glu_1 quantize_q8k add_rms_norm}; do
            ncu_one "$k" -p 0 -n 8
        done
    fi
    if [[ $steps == *,profiles,* ]]; then
        # A/B of kernel times: `bench --profile` at SAMESUM_GPU_PROFILE_PP
        # (4096) on both models for each arm of SAMESUM_GPU_PROFILE_ARMS,
        # arms separated by ';', each a space-separated list of VAR=value
        # settings or '-' for the defaults (e.g. "-;SAMESUM_CUDA_ATT_VFULL=0"); a
        # word BIN=path runs another binary (e.g. an older build carried in
        # .gpu-old: "-;BIN=.gpu-old/samesum"), in every step that takes arms.
        # Kernel totals moved less between arms than end-to-end figures did
        # (docs/gpu-notes.md, session 10).
        IFS=';' read -ra arms <<< "${SAMESUM_GPU_PROFILE_ARMS:--}"
        for shape in ${SAMESUM_GPU_PROFILE_SHAPES:-qwen35moe-35b-a3b qwen3moe-30b-a3b}; do
            f=$(model "$shape")
            for arm in "${arms[@]}"; do
                arm_split "$arm"
                step "profile-$shape-${arm// /+}" timeout 200 env "${settings[@]}" "$bin" bench --device cuda \
                    -m "$f" -p ${SAMESUM_GPU_PROFILE_PP:-4096} -n 0 -r 1 --prefill batched --profile
            done
        done
    fi
    if [[ $steps == *,token,* ]]; then
        ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
        IFS=';' read -ra arms <<< "${SAMESUM_GPU_TOKEN_ARMS:--}"
        for shape in ${SAMESUM_GPU_TOKEN_SHAPES:-qwen35moe-35b-a3b qwen3moe-30b-a3b}; do
            f=$(model "$shape")
            for arm in "${arms[@]}"; do
                arm_split "$arm"
                csv=$(mktemp /tmp/token-XXXX.csv)
                # The CSV goes to a temporary file (few files under OUT);
                # the per-kernel table goes to the log.
                step "token-$shape-${arm// /+}" bash -c '"$@" > "'"$csv"'" && python3 scripts/ncu_token.py "'"$csv"'"' _ \
                    timeout 300 env SAMESUM_CUDA_GRAPHS=0 "${settings[@]}" "$ncu" --clock-control none \
                    --cache-control none --metrics gpu__time_duration.sum --csv "$bin" bench --device cuda \
                    -m "$f" -p "${SAMESUM_GPU_TOKEN_CTX:-0}" -n 2 -r 1 --no-warmup
                rm -f "$csv"
            done
        done
    fi
    if [[ $steps == *,decode,* ]]; then
        IFS=';' read -ra arms <<< "${SAMESUM_GPU_DECODE_ARMS:--}"
        for shape in ${SAMESUM_GPU_DECODE_SHAPES:-qwen35moe-35b-a3b qwen3moe-30b-a3b}; do
            f=$(model "$shape")
            for round in $(seq "${SAMESUM_GPU_DECODE_ROUNDS:-2}"); do
                for arm in "${arms[@]}"; do
                    arm_split "$arm"
                    step "decode-$shape-${arm// /+}-$round" timeout 200 env "${settings[@]}" "$bin" bench \
                        --device cuda -m "$f" -p 0 -n 128 -r 3
                done
            done
        done
    fi
    if [[ $steps == *,prefill,* ]]; then
        # Batched prefill A/Bs without --profile (profiling changes the
        # schedule: one stream, so no shared expert beside the routed
        # experts): pp SAMESUM_GPU_PREFILL_PP (4096,16384) on qwen35moe per
        # arm of SAMESUM_GPU_PREFILL_ARMS (arms as for profiles, e.g.
        # "-;SAMESUM_CUDA_OVERLAP=0"), alternated SAMESUM_GPU_PREFILL_ROUNDS
        # (2) times.
        IFS=';' read -ra arms <<< "${SAMESUM_GPU_PREFILL_ARMS:--}"
        f=$(model qwen35moe-35b-a3b)
        for round in $(seq "${SAMESUM_GPU_PREFILL_ROUNDS:-2}"); do
            for arm in "${arms[@]}"; do
                arm_split "$arm"
                step "prefill-${arm// /+}-$round" timeout 300 env "${settings[@]}" "$bin" bench \
                    --device cuda -m "$f" -p ${SAMESUM_GPU_PREFILL_PP:-4096,16384} -n 0 -r 1 --prefill batched
            done
        done
    fi
    if [[ $steps == *,floor,* ]]; then
        # The floor of a chain of dependent steps: graph, graph with PDL,
        # one persistent launch with grid barriers (scripts/launch_floor.cu).
        step floor-build nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/launch_floor scripts/launch_floor.cu &&
            step floor timeout 120 /tmp/launch_floor ${SAMESUM_GPU_FLOOR_ARGS:-480 50}
    fi
    if [[ $steps == *,agree,* ]]; then
        # Teacher-forced agreement of a variant with the defaults (issue 6's
        # bar for non-identical kernels, docs/CAPABILITIES.md), then the
        # same-arm control: SAMESUM_GPU_AGREE_VARIANT (NAME=0|1, comma-
        # separated), SAMESUM_GPU_AGREE_LENS (512,1024,8192), on qwen35moe
        # and qwen3moe.
        for shape in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
            f=$(model "$shape")
            if [ -n "${SAMESUM_GPU_AGREE_VARIANT:-}" ]; then
                step "agree-$shape" timeout 400 .gpu/samesum agree --device cuda -m "$f" \
                    --lens ${SAMESUM_GPU_AGREE_LENS:-512,1024,8192} --gen 64 --variant "$SAMESUM_GPU_AGREE_VARIANT" \
                    --seeds ${SAMESUM_GPU_AGREE_SEEDS:-1} ${SAMESUM_GPU_AGREE_PROBE:+--probe $SAMESUM_GPU_AGREE_PROBE}
            fi
            step "agree-control-$shape" timeout 400 .gpu/samesum agree --device cuda -m "$f" \
                --lens ${SAMESUM_GPU_AGREE_LENS:-512,1024,8192} --gen 64
        done
    fi
    if [[ $steps == *,serve,* ]]; then
        # The server on the GPU: one request alone, then six at once (batched
        # together), which must get the same text.
        serve_check() {
            .gpu/samesum serve --device cuda --port 18181 > "$out/serve.out" 2> "$out/serve.log" &
            local pid=$! u=http://127.0.0.1:18181 body
            for _ in $(seq 300); do grep -q listening "$out/serve.out" 2>/dev/null && break; sleep 0.2; done
            body='{"messages":[{"role":"user","content":"Hello"}],"max_tokens":16,"temperature":0}'
            curl -s $u/v1/chat/completions -d "$body" > "$out/serve-alone.json"
            local pids=()
            for i in 1 2 3 4 5 6; do
                curl -s $u/v1/chat/completions -d "$body" > "$out/serve-c$i.json" & pids+=($!)
            done
            wait "${pids[@]}"
            curl -sN $u/v1/completions -d '{"prompt":"Once","max_tokens":8,"stream":true}' | tail -2
            curl -s $u/metrics | grep -E "^samesum_(requests_total|max_step_requests|decode_tokens_per_second)"
            kill $pid; wait $pid
            python3 -c "
import json, sys
o = '$out'
a = json.load(open(o + '/serve-alone.json'))['choices'][0]['message']['content']
same = [json.load(open(o + '/serve-c%d.json' % i))['choices'][0]['message']['content'] == a for i in range(1, 7)]
print('alone:', repr(a), 'concurrent equal:', same)
sys.exit(0 if all(same) else 1)"
        }
        step serve-cuda serve_check
    fi
    printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
    grep -E "^\| (q|tiny|model|---|kernel|total|[a-z_0-9]+ \||[0-9]+ \|)|runs equal|positions agree|error" "$out/log.txt" | grep -v "| equal |" | tail -60
    ;;
*)
    echo "usage: scripts/gpu.sh bundle | run OUTDIR" >&2
    exit 2
    ;;
esac
