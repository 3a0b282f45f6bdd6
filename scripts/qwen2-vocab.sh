#!/usr/bin/env bash
# Extracts llama.cpp's Qwen vocabulary and its tokenizer test vectors
# (`models/ggml-vocab-qwen2.gguf` with `.inp` and `.out`) from the PyPI sdist
# of llama-cpp-python (pinned, as scripts/llama-cpp.sh) into a cache folder,
# and prints that folder. Nothing of llama.cpp is kept in this repository.
#
#   DIR=$(scripts/qwen2-vocab.sh)
#   SAMESUM_QWEN2_VOCAB=$DIR/ggml-vocab-qwen2.gguf cargo test ...
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
mkdir -p "${SAMESUM_CACHE:-.cache}"
CACHE="$(cd "${SAMESUM_CACHE:-.cache}" && pwd)"
OUT="$CACHE/qwen2-vocab-$VERSION"
if [[ -s "$OUT/ggml-vocab-qwen2.gguf.out" ]]; then
    echo "$OUT"
    exit 0
fi
SDIST="$CACHE/sdist"
NAME=llama_cpp_python-$VERSION.tar.gz
if [[ ! -s "$SDIST/$NAME" ]]; then
    mkdir -p "$SDIST"
    # The file itself, by its link on PyPI's simple index, checked against
    # the index's sha256: `pip download --no-binary :all:` would first
    # build the sdist's metadata, compiling its build tools (cmake) from
    # source. pip stays the fallback where the index cannot be read.
    INDEX=${PIP_INDEX_URL:-https://pypi.org/simple}
    LINK=$(curl -fsSL "${INDEX%/}/llama-cpp-python/" 2>/dev/null |
        grep -o "href=\"[^\"]*/$NAME#sha256=[0-9a-f]*\"" | head -n 1 | sed 's/^href="//; s/"$//') || LINK=
    if [[ -n "$LINK" ]] && curl -fsSL -o "$SDIST/$NAME.part" "${LINK%%#*}" &&
        [[ "$(sha256sum "$SDIST/$NAME.part" | cut -d' ' -f1)" == "${LINK##*sha256=}" ]]; then
        mv "$SDIST/$NAME.part" "$SDIST/$NAME"
    else
        rm -f "$SDIST/$NAME.part"
        VENV="$CACHE/venv-fetch"
        [[ -x "$VENV/bin/pip" ]] || python3 -m venv "$VENV" >&2
        "$VENV/bin/pip" download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$VERSION" -d "$SDIST" >&2
    fi
fi
rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp"
for f in ggml-vocab-qwen2.gguf ggml-vocab-qwen2.gguf.inp ggml-vocab-qwen2.gguf.out; do
    tar xzf "$SDIST/llama_cpp_python-$VERSION.tar.gz" -O \
        "llama_cpp_python-$VERSION/vendor/llama.cpp/models/$f" > "$OUT.tmp/$f"
done
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "$OUT"
