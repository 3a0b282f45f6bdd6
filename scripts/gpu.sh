#!/usr/bin/env bash
# The GPU tests and benchmarks, run on a GPU machine from binaries built here.
#
#   scripts/gpu.sh bundle        # here (has Rust): build, put binaries in .gpu/
#   scripts/gpu.sh run OUTDIR    # on the GPU machine (no Rust): run from .gpu/
#
# `run` writes its log under OUTDIR and ends with a summary. SAMESUM_GPU_STEPS
# picks the steps, comma-separated (default compile,tests,identity,bigidentity,
# bench,q3moe; together about 20 minutes on an H200, so split them across
# runs where a command is time-limited):
#   compile      kernels_compile with the machine's NVRTC (registers, spills)
#   tests        the GPU tests, ignored ones included; SAMESUM_GPU_TESTS
#                (space-separated) keeps those whose names contain one
#   identity     the identity gate on the tiny models (chunks SAMESUM_GPU_ID_CHUNKS)
#   bigidentity  the identity gate on qwen35moe-35b-a3b, chunks 128 and 2048
#   longidentity the identity gate at long contexts: random prompts of 8
#                tokens short of 32,768 (qwen35moe-35b-a3b and qwen3moe-30b-a3b
#                with YaRN x4) and of 131,072 (qwen35moe) (SAMESUM_GPU_LONG,
#                default both lengths), chunk 2,048 (CUDA's default), 16
#                generated tokens, so decode crosses a key split; the
#                one-token replay of 131,072 tokens takes minutes
#   bench        qwen35moe-35b-a3b: replay and batched prefill at SAMESUM_GPU_PP
#                (512,4096), decode of SAMESUM_GPU_TG (128) tokens, SAMESUM_GPU_REPS
#                (2) runs; then a kernel profile at pp4096
#   q3moe        the same bench on qwen3moe-30b-a3b
#   replay       qwen35moe replay prefill at SAMESUM_GPU_REPLAY_PP (4096), one run
#   depth        decode tg128 after SAMESUM_GPU_DEPTHS (0,4096,16384) tokens, both models
#   profiles     bench --profile (kernel times) at pp SAMESUM_GPU_PROFILE_PP (4096), both models
#   parallel     several sequences a step through the serving scheduler
#                (bench --parallel SAMESUM_GPU_NPL, default 8,64; prompts of 128,
#                64 generated tokens), both models
#   gemm         bench-gemm: the MoE block per weight format (qwen3moe and
#                qwen35moe shapes, 4,096 rows), with kernel profiles
#   tier         tier mode: the identity gate with --vram-budget 2G, then qwen35moe
#                at budgets SAMESUM_GPU_BUDGETS ("24G 12G")
#   serve        the server: one request alone, then six at once, the same text
#   smoke        pp512/tg32 and a kernel profile on qwen35moe
#   logits       bench --logits-out (pp4096 every row, then 64 greedy steps) on both
#                models with .gpu/samesum and the base binary: byte for byte equal
# A/B: SAMESUM_GPU_BASE=path names a second samesum binary (e.g. an older
# build copied to .gpu-old/samesum, carried to the machine): bench, q3moe,
# replay, depth and profiles run with both binaries, alternated
# SAMESUM_GPU_ROUNDS (1) times, and logits compares the two (without it,
# two runs of .gpu/samesum). Models are synthetic q4_k, made once per machine.
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
    export SAMESUM_REQUIRE=gpu,nvrtc
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
    bins=(.gpu/samesum) labels=(new)
    if [ -n "${SAMESUM_GPU_BASE:-}" ]; then
        [ -x "$SAMESUM_GPU_BASE" ] || { echo "SAMESUM_GPU_BASE=$SAMESUM_GPU_BASE is not an executable" >&2; exit 2; }
        bins+=("$SAMESUM_GPU_BASE") labels+=(base)
    fi
    ab() { # name, time limit, samesum arguments...: run with each binary, alternated per round
        local name=$1 limit=$2 r i tag
        shift 2
        for r in $(seq "${SAMESUM_GPU_ROUNDS:-1}"); do
            for i in "${!bins[@]}"; do
                tag=$name
                [ ${#bins[@]} -gt 1 ] && tag+="-${labels[$i]}"
                [ "${SAMESUM_GPU_ROUNDS:-1}" -gt 1 ] && tag+="-$r"
                step "$tag" timeout "$limit" "${bins[$i]}" "$@"
            done
        done
    }
    model() { # shape -> path of a synthetic q4_k model of it (made once per machine)
        local f=/tmp/models/$1.gguf
        mkdir -p /tmp/models
        [ -f "$f" ] || .gpu/samesum synth --shape "$1" --quant q4_k -o "$f" >>"$out/log.txt" 2>&1
        echo "$f"
    }
    if [[ $steps == *,compile,* ]]; then
        step kernels-compile env CUDA_CACHE_DISABLE=1 .gpu/test-kernels_compile --nocapture --include-ignored
    fi
    if [[ $steps == *,tests,* ]]; then
        read -ra filters <<< "${SAMESUM_GPU_TESTS:-}"
        step gpu-tests .gpu/test-gpu "${filters[@]}" --include-ignored --nocapture --test-threads=1
    fi
    if [[ $steps == *,identity,* ]]; then
        for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
            step "identity-$shape" timeout 300 .gpu/samesum identity --device cuda --shape "$shape" \
                --chunk "${SAMESUM_GPU_ID_CHUNKS:-1,7,64,128,256}" --gen 64
        done
    fi
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
            --chunk 128,2048 --gen 16
    fi
    if [[ $steps == *,longidentity,* ]]; then
        for len in ${SAMESUM_GPU_LONG:-32768 131072}; do
            n=$((len - 8))
            printf '[{"name": "random-%s", "random": %s, "seed": 5}]\n' "$n" "$n" >"/tmp/long-$n.json"
            q3y=/tmp/models/qwen3moe-30b-a3b-yarn4.gguf
            [ -f "$q3y" ] || .gpu/samesum synth --shape qwen3moe-30b-a3b --quant q4_k --yarn 4 \
                -o "$q3y" >>"$out/log.txt" 2>&1
            models=("$(model qwen35moe-35b-a3b)")
            # qwen3moe's replay slows with depth: 131,072 on qwen35moe only.
            [ "$len" -le 32768 ] && models+=("$q3y")
            for m in "${models[@]}"; do
                step "identity-$len-$(basename "$m" .gguf)" timeout 900 .gpu/samesum identity \
                    --device cuda -m "$m" --prompts "/tmp/long-$n.json" --chunk 2048 --gen 16
            done
        done
    fi
    bench() { # step name, model: replay and batched prefill, decode
        ab "$1" 400 bench --device cuda -m "$2" -p "${SAMESUM_GPU_PP:-512,4096}" \
            -n "${SAMESUM_GPU_TG:-128}" -r "${SAMESUM_GPU_REPS:-2}" --prefill replay,batched
    }
    if [[ $steps == *,bench,* ]]; then
        q35=$(model qwen35moe-35b-a3b)
        bench bench-q35 "$q35"
        ab profile-q35 200 bench --device cuda -m "$q35" -p 4096 -n 32 -r 1 --prefill batched --profile
    fi
    if [[ $steps == *,q3moe,* ]]; then
        bench bench-q3moe "$(model qwen3moe-30b-a3b)"
    fi
    if [[ $steps == *,replay,* ]]; then
        # Replay slows with the context: pp4096 takes about a minute on
        # qwen35moe, pp16384 several (raise the limit with it).
        ab replay-q35 "${SAMESUM_GPU_REPLAY_TIMEOUT:-200}" bench --device cuda -m "$(model qwen35moe-35b-a3b)" \
            -p "${SAMESUM_GPU_REPLAY_PP:-4096}" -n 0 -r 1 --prefill replay --no-warmup
    fi
    if [[ $steps == *,depth,* ]]; then
        # Decode at context depths (llama-bench's -d).
        for shape in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
            ab "depth-$shape" 400 bench --device cuda -m "$(model "$shape")" -p 0 -n 128 \
                -d "${SAMESUM_GPU_DEPTHS:-0,4096,16384}" -r 1
        done
    fi
    if [[ $steps == *,profiles,* ]]; then
        # Kernel times (bench --profile: one stream, decode without graphs).
        for shape in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
            ab "profile-$shape" 200 bench --device cuda -m "$(model "$shape")" \
                -p "${SAMESUM_GPU_PROFILE_PP:-4096}" -n 0 -r 1 --prefill batched --profile
        done
    fi
    if [[ $steps == *,parallel,* ]]; then
        for shape in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
            ab "parallel-$shape" 300 bench --device cuda -m "$(model "$shape")" -p 128 -n 64 -r 1 \
                --parallel "${SAMESUM_GPU_NPL:-8,64}"
        done
    fi
    if [[ $steps == *,gemm,* ]]; then
        for shape in qwen3moe-30b-a3b qwen35moe-35b-a3b; do
            step "gemm-$shape" timeout 500 .gpu/samesum bench-gemm --device cuda --shape "$shape" \
                -m 4096 -r 10 --profile
        done
    fi
    if [[ $steps == *,tier,* ]]; then
        # Tier mode: the identity gate with the routed experts in host
        # memory, then qwen35moe under VRAM budgets (prefill from staged
        # layers, decode through the expert cache).
        for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
            step "identity-tier-$shape" timeout 300 .gpu/samesum identity --device cuda --vram-budget 2G \
                --shape "$shape" --chunk "${SAMESUM_GPU_ID_CHUNKS:-7,64,256}" --gen 64
        done
        q35=$(model qwen35moe-35b-a3b)
        for b in ${SAMESUM_GPU_BUDGETS:-24G 12G}; do
            step "bench-tier-$b" timeout 400 .gpu/samesum bench --device cuda --vram-budget "$b" -m "$q35" \
                -p 1024,8192 -n 128 -r 1 --prefill batched --chunk 512
        done
    fi
    if [[ $steps == *,logits,* ]]; then
        # The logits bytes of one fixed run from each binary (about 2.5 GB a
        # file, so under /tmp, not OUTDIR), compared byte for byte.
        base=${SAMESUM_GPU_BASE:-.gpu/samesum}
        mkdir -p /tmp/logits
        for shape in qwen35moe-35b-a3b qwen3moe-30b-a3b; do
            f=$(model "$shape")
            for arm in new base; do
                bin=.gpu/samesum
                [ $arm = base ] && bin=$base
                step "logits-$shape-$arm" timeout 300 "$bin" bench --device cuda -m "$f" -p 4096 -n 64 -r 1 \
                    --logits-out "/tmp/logits/$shape-$arm.f32"
            done
            sha256sum /tmp/logits/"$shape"-*.f32 | tee -a "$out/log.txt"
            step "logits-$shape-equal" cmp /tmp/logits/"$shape"-new.f32 /tmp/logits/"$shape"-base.f32
            rm -f /tmp/logits/"$shape"-*.f32
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
