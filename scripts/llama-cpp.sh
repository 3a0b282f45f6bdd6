#!/usr/bin/env bash
# Builds llama.cpp's `llama-simple` (CPU only) from the llama.cpp tree vendored in
# the PyPI sdist of llama-cpp-python (pinned), into a cache folder, and prints the
# binary's path. Used by scripts/test.sh to check that llama.cpp loads and runs
# the models `samesum synth` writes. Nothing of llama.cpp is kept in this repo.
#
#   LLAMA_SIMPLE=$(scripts/llama-cpp.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36            # vendors llama.cpp 0c1e570 (Oct 2026)
mkdir -p "${SAMESUM_CACHE:-.cache}"
CACHE="$(cd "${SAMESUM_CACHE:-.cache}" && pwd)"
DEST="$CACHE/llama.cpp-$VERSION"
BIN="$DEST/build/bin/llama-simple"
if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi
VENV="$CACHE/venv-llama-build"
if [[ ! -x "$VENV/bin/cmake" ]]; then
    python3 -m venv "$VENV" >&2
    "$VENV/bin/pip" install --quiet cmake ninja scikit-build-core >&2
fi
SDIST="$CACHE/sdist"
if ! ls "$SDIST"/llama_cpp_python-$VERSION.tar.gz >/dev/null 2>&1; then
    "$VENV/bin/pip" download --quiet --no-deps --no-binary :all: --no-build-isolation \
        "llama-cpp-python==$VERSION" -d "$SDIST" >&2
fi
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
tar xzf "$SDIST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST.tmp"
rm -rf "$DEST" && mv "$DEST.tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST" && rm -rf "$DEST.tmp"
export PATH="$VENV/bin:$PATH"
# -O1: the check runs a few tokens of tiny models, and -O1 builds in about
# half the time of -O3.
cmake -S "$DEST" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DCMAKE_C_FLAGS_RELEASE="-O1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$DEST/build" -j"$(nproc)" --target llama-simple >&2
echo "$BIN"
