#!/usr/bin/env bash
# Real quant mixes on the GPU, samesum against llama.cpp on the same files in
# the same run, on a GPU machine without Rust or network.
#
#   scripts/gpu-mixes.sh carry       # here: .gpu/samesum, and in .cache/gpu-carry
#                                    # llama.cpp's source (from the pinned
#                                    # llama-cpp-python sdist) and cmake/ninja wheels
#                                    # (carry only llama.cpp.tar.xz where the GPU
#                                    # machine has cmake and ninja)
#   scripts/gpu-mixes.sh start OUT   # there: starts the run in the background
#   scripts/gpu-mixes.sh wait OUT S  # there: shows progress for up to S seconds
#
# `start` builds llama.cpp's llama-bench and llama-batched-bench for sm_90 in
# the background while the GPU tests (.gpu/test-gpu, ignored ones included;
# OUT/tests.log) and the identity gate on the tiny shapes at every mix
# (SAMESUM_ID_MIXES) run, then,
# for each shape x mix (SAMESUM_MIX_SHAPES x SAMESUM_MIXES), writes the file
# with `samesum synth --mix`, runs `samesum bench --device cuda -p 4096 -n 128`
# and, once built, `llama-bench -fa 1 -ub 2048 -ngl 99` with the same tests,
# then deletes the file (a 30B file is 17-32 GiB); SAMESUM_MIX_LLAMA=0 runs
# samesum alone, SAMESUM_MIX_PROFILE=1 adds kernel profiles at pp4096 and
# tg64 (OUT/profile-SHAPE-MIX.txt, OUT/profile-tg-SHAPE-MIX.txt),
# SAMESUM_MIX_TESTS=0 leaves the GPU tests out, SAMESUM_MIX_AFTER=FILE holds the benchmarks
# back while FILE exists (another job on the GPU). The mixes are the outer
# loop, so a run cut short has both shapes of the first mixes. Results:
# OUT/mixes.log, one line per figure in OUT/results.tsv.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
CARRY=.cache/gpu-carry
case "$mode" in
carry)
    set -e
    cargo build --release --locked -p samesum
    mkdir -p .gpu "$CARRY/wheels"
    cp target/release/samesum .gpu/samesum && strip .gpu/samesum
    ver=0.3.36 # vendors llama.cpp 0c1e570
    sdist=.cache/sdist/llama_cpp_python-$ver.tar.gz
    if [ ! -f "$CARRY/llama.cpp.tar.xz" ]; then
        # The sdist by its PyPI link (scripts/qwen2-vocab.sh fetches it there).
        [ -f "$sdist" ] || scripts/qwen2-vocab.sh >/dev/null
        tmp=$(mktemp -d)
        tar xzf "$sdist" -C "$tmp" "llama_cpp_python-$ver/vendor/llama.cpp"
        # What a CUDA build of llama-bench does not need (vocabularies, docs).
        (cd "$tmp/llama_cpp_python-$ver/vendor" &&
            rm -rf llama.cpp/models/*.gguf* llama.cpp/docs llama.cpp/media llama.cpp/benches &&
            tar cJf - llama.cpp) > "$CARRY/llama.cpp.tar.xz"
        rm -rf "$tmp"
    fi
    ls "$CARRY"/wheels/cmake-* >/dev/null 2>&1 || pip download --only-binary :all: \
        --platform manylinux2014_x86_64 --python-version 3.10 cmake ninja -d "$CARRY/wheels"
    du -sh .gpu "$CARRY"
    ;;
start)
    out=${2:?usage: scripts/gpu-mixes.sh start OUT}
    mkdir -p "$out"
    setsid nohup "$0" run "$out" >"$out/mixes.log" 2>&1 < /dev/null &
    echo "started: $out/mixes.log"
    ;;
wait)
    out=${2:?} secs=${3:-540}
    end=$((SECONDS + secs))
    while [ $SECONDS -lt $end ] && ! grep -q "^=== done" "$out/mixes.log" 2>/dev/null; do sleep 10; done
    tail -n 40 "$out/mixes.log"
    ;;
run)
    out=${2:?}
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
    done
    export SAMESUM_KERNEL_CACHE=${SAMESUM_KERNEL_CACHE:-/tmp/samesum-kernels}
    work=${SAMESUM_MIX_WORK:-/tmp/mixes}
    mkdir -p "$work"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    llama=$work/llama.cpp/build/bin/llama-bench
    # A build an earlier start left running on this machine is waited for,
    # not started over.
    building() { [ -e "$work/llama.pid" ] && kill -0 "$(cat "$work/llama.pid")" 2>/dev/null; }
    if [ "${SAMESUM_MIX_LLAMA:-1}" = 0 ]; then
        llama=/nonexistent
    elif [ ! -x "$llama" ] && ! building; then
        (
            set -e
            cd "$work"
            rm -rf llama.cpp venv
            tar xJf "$OLDPWD/$CARRY/llama.cpp.tar.xz"
            # The CUDA image has cmake and ninja; elsewhere, the carried wheels.
            if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
                python3 -m venv venv
                venv/bin/pip install --quiet --no-index --find-links "$OLDPWD/$CARRY/wheels" cmake ninja
                export PATH=$work/venv/bin:$PATH
            fi
            export PATH=$PATH:/usr/local/cuda/bin
            cmake -S llama.cpp -B llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
                -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
                -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF
            cmake --build llama.cpp/build -j"${SAMESUM_LLAMA_JOBS:-12}" --target llama-bench \
                llama-batched-bench
        ) >"$work/llama-build.log" 2>&1 &
        echo $! >"$work/llama.pid"
    fi
    res=$out/results.tsv
    tests=
    if [ "${SAMESUM_MIX_TESTS:-1}" = 1 ] && [ -x .gpu/test-gpu ]; then
        # Beside the identity gate: correctness only, nothing here is timed.
        (SAMESUM_REQUIRE=gpu,nvrtc timeout 600 .gpu/test-gpu --include-ignored --test-threads=2 \
            >"$out/tests.log" 2>&1; echo "rc=$?" >>"$out/tests.log") &
        tests=$!
    fi
    echo "=== identity gate on the tiny shapes at each mix"
    for mix in ${SAMESUM_ID_MIXES:-q4_k_m ud-q4_k_xl q5_k_m q6_k q8_0 iq4_xs iq4_nl mxfp4 q3_k_m q2_k iq3_s iq3_xxs iq2_m iq2_xxs bf16}; do
        for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
            f=$work/$shape-$mix.gguf
            .gpu/samesum synth --force --shape "$shape" --mix "$mix" -o "$f" >/dev/null 2>&1 \
                || { echo "synth $shape $mix failed"; continue; }
            line=$(timeout 120 .gpu/samesum identity --device cuda -m "$f" --chunk 1,64,256 \
                --max-len "${SAMESUM_ID_MAX_LEN:-515}" --gen 16 2>&1 | tail -n 1)
            echo "identity $shape $mix: $line"
            printf 'identity\t%s\t%s\t%s\n' "$shape" "$mix" "$line" >>"$res"
            rm -f "$f"
        done
    done
    if [ -n "$tests" ]; then
        wait "$tests"
        echo "=== GPU tests: $(grep -E '^test result' "$out/tests.log" | tail -n 1) $(tail -n 1 "$out/tests.log")"
    fi
    while [ -n "${SAMESUM_MIX_AFTER:-}" ] && [ -e "$SAMESUM_MIX_AFTER" ]; do sleep 5; done
    for mix in ${SAMESUM_MIXES:-q4_k_m ud-q4_k_xl iq4_xs q8_0}; do
        for shape in ${SAMESUM_MIX_SHAPES:-qwen35moe-35b-a3b qwen3moe-30b-a3b}; do
            f=$work/$shape-$mix.gguf
            echo "=== $shape $mix: synth"
            t0=$SECONDS
            .gpu/samesum synth --force --shape "$shape" --mix "$mix" -o "$f" 2>&1 | tail -n 1
            echo "($((SECONDS - t0)) s)"
            echo "=== $shape $mix: samesum"
            timeout 400 .gpu/samesum bench --device cuda -m "$f" -p 4096 -n 128 \
                -r "${SAMESUM_MIX_REPS:-2}" --prefill batched 2>&1 | tee "$work/s.txt" | grep -E '^\|'
            grep -E '\| (pp|tg)[0-9]+ ' "$work/s.txt" | awk -F'|' -v s="$shape" -v m="$mix" \
                '{gsub(/ /,"",$6); gsub(/ /,"",$7); print "samesum\t" s "\t" m "\t" $6 "\t" $7}' >>"$res"
            if [ "${SAMESUM_MIX_PROFILE:-0}" = 1 ]; then
                timeout 200 .gpu/samesum bench --device cuda -m "$f" -p 4096 -n 0 -r 1 \
                    --prefill batched --profile >"$out/profile-$shape-$mix.txt" 2>&1
                timeout 200 .gpu/samesum bench --device cuda -m "$f" -p 0 -n 64 -r 1 \
                    --profile >"$out/profile-tg-$shape-$mix.txt" 2>&1
            fi
            if building; then
                echo "=== waiting for llama-bench"
                while building; do sleep 5; done
                [ -x "$llama" ] || { echo "llama.cpp build failed:"; tail -n 20 "$work/llama-build.log"; }
            fi
            if [ -x "$llama" ]; then
                echo "=== $shape $mix: llama.cpp"
                timeout 400 "$llama" -m "$f" -p 4096 -n 128 -fa 1 -ub 2048 -ngl 99 \
                    -r "${SAMESUM_MIX_REPS:-2}" 2>&1 | tee "$work/l.txt" | grep -E '^\|'
                grep -E '\| +(pp|tg)[0-9]+ ' "$work/l.txt" | awk -F'|' -v s="$shape" -v m="$mix" \
                    '{n=NF-1; t=$(n-1); v=$n; gsub(/ /,"",t); gsub(/ /,"",v); print "llama.cpp\t" s "\t" m "\t" t "\t" v}' >>"$res"
            fi
            rm -f "$f"
        done
    done
    echo "=== done"
    ;;
*)
    sed -n 2,17p "$0"
    exit 2
    ;;
esac
