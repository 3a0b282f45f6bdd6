#!/usr/bin/env bash
# The project's test command: Rust tests, then the oracles that need Python
# (gguf-py, llama.cpp's reference) in a venv this script makes itself.
#
#   scripts/test.sh            # everything
#   SAMESUM_SKIP_ORACLE=1 scripts/test.sh   # Rust tests only
#   SAMESUM_LLAMA_CHECK=1 scripts/test.sh   # also build llama.cpp and run it on synth models
#   LLAMA_SIMPLE=/path/to/llama-simple scripts/test.sh   # ... with a llama.cpp you built
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check, cargo clippy -D warnings"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release --locked -- -D warnings

echo "== cargo test (workspace)"
cargo test --workspace --release --locked

if [[ "${SAMESUM_SKIP_ORACLE:-0}" == "1" ]]; then
    echo "== oracles skipped (SAMESUM_SKIP_ORACLE=1)"
    exit 0
fi

VENV="${SAMESUM_VENV:-.venv-oracle}"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "== creating $VENV (gguf, numpy)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet "gguf==0.19.0" "numpy>=1.26"
fi
PY="$VENV/bin/python"
"$PY" -c "import openai" 2>/dev/null || "$VENV/bin/pip" install --quiet "openai==3.57.0"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

echo "== oracle: dequantize/quantize bit-exact against gguf-py (10,000 random blocks per format + edge values)"
cargo run --release --locked -q -p samesum-quant --example oracle_dump -- "$OUT/oracle" 10000
"$PY" tests/oracle/check_dequant.py "$OUT/oracle"

echo "== oracle: gguf-py reads what samesum synth writes"
BIN=target/release/samesum
cargo build --release --locked -q -p samesum
for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
    for quant in q4_k q8_0 bf16 f32; do
        f="$OUT/$shape-$quant.gguf"
        "$BIN" synth --shape "$shape" --quant "$quant" --seed 3 -o "$f"
        "$BIN" inspect --json --all-metadata "$f" > "$f.json"
        "$PY" tests/oracle/check_gguf_py.py "$f" "$f.json"
    done
done

echo "== identity gate: replay vs batched on the shipped prompt set (tiny models, chunks 1/7/64/128/256, threads 1/2)"
for shape in tiny-qwen3moe tiny-qwen3next tiny-qwen35moe; do
    "$BIN" identity --shape "$shape" --chunk 1,7,64,128,256 --threads 1,2 --gen 64 > "$OUT/identity-$shape.md" \
        || { cat "$OUT/identity-$shape.md"; echo "identity gate failed on $shape"; exit 1; }
    tail -1 "$OUT/identity-$shape.md"
done
echo "== identity gate with an f16 KV cache (attention-only model)"
"$BIN" identity --shape tiny-qwen3moe --kv-type f16 --chunk 7,256 --threads 2 --max-len 1000 --gen 16 > "$OUT/identity-f16.md" \
    || { cat "$OUT/identity-f16.md"; echo "identity gate failed with an f16 KV cache"; exit 1; }
tail -1 "$OUT/identity-f16.md"
echo "== identity gate negative control: a reordered MoE combination must be caught"
if "$BIN" identity --shape tiny-qwen3next --chunk 16 --max-len 200 --gen 8 --negative-control > "$OUT/neg.md" 2>&1; then
    cat "$OUT/neg.md"; echo "the gate did not catch the reordered variant"; exit 1
fi
tail -2 "$OUT/neg.md" | head -1

echo "== samesum serve: the official openai client, then a load test (32 streaming clients, 200 requests)"
SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap 'stop_server; rm -rf "$OUT"' EXIT
"$BIN" serve --port 0 --max-batch 8 > "$OUT/serve.out" 2> "$OUT/serve.log" &
SERVER_PID=$!
for _ in $(seq 100); do grep -q "listening on" "$OUT/serve.out" 2>/dev/null && break; sleep 0.1; done
URL="$(grep -o 'http://[0-9.:]*' "$OUT/serve.out")" || { cat "$OUT/serve.log"; echo "the server did not start"; exit 1; }
"$PY" tests/server/test_openai.py "$URL" > "$OUT/openai.log" 2>&1 \
    || { cat "$OUT/openai.log"; tail -20 "$OUT/serve.log"; echo "openai client checks failed"; exit 1; }
tail -1 "$OUT/openai.log"
"$PY" tests/server/load.py "$URL" "$SERVER_PID" --clients 32 --requests 200 > "$OUT/load.log" 2>&1 \
    || { cat "$OUT/load.log"; tail -20 "$OUT/serve.log"; echo "load test failed"; exit 1; }
tail -2 "$OUT/load.log"
stop_server

if [[ "${SAMESUM_SKIP_CUDA:-0}" != "1" ]]; then
    # No GPU here: NVRTC (from PyPI, pinned to the H200's CUDA 13.0) compiles
    # every kernel for sm_90a, so a kernel that does not compile fails CI.
    CUDA_VENV="${SAMESUM_CUDA_VENV:-.venv-cuda}"
    if [[ ! -x "$CUDA_VENV/bin/python" ]]; then
        echo "== creating $CUDA_VENV (NVRTC 13.0)"
        python3 -m venv "$CUDA_VENV"
        "$CUDA_VENV/bin/pip" install --quiet "nvidia-cuda-nvrtc==13.0.*"
    fi
    NVRTC_LIB="$("$CUDA_VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')"
    echo "== CUDA kernels compile with NVRTC for sm_90a (registers and spills per kernel)"
    LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" SAMESUM_REQUIRE_NVRTC=1 \
        cargo test --release --locked -q -p samesum-cuda --test kernels_compile -- --nocapture --test-threads=1 2>&1 \
        | grep -E "^(NVRTC|\||test result)"
fi

if [[ "${SAMESUM_LLAMA_CHECK:-0}" == "1" && -z "${LLAMA_SIMPLE:-}" ]]; then
    echo "== building llama.cpp's llama-simple (cached in .cache/)"
    LLAMA_SIMPLE="$(scripts/llama-cpp.sh)"
fi
if [[ -n "${LLAMA_SIMPLE:-}" ]]; then
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
