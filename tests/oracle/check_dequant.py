#!/usr/bin/env python3
"""Bit-exact oracle: samesum's dequantization and quantization against gguf-py.

Reads the files written by `cargo run -p samesum-quant --example oracle_dump -- DIR`
and compares, bit for bit, with `gguf.quants.dequantize` / `gguf.quants.quantize`
(llama.cpp's numpy reference). Both-NaN counts as equal (NaN payloads are not part
of the contract); everything else must match exactly. Exits non-zero on any
mismatch, printing the first few.
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf.constants import GGML_QUANT_SIZES


# Formats the dump must contain: a format that silently dropped out of the dump
# would otherwise go unchecked.
REQUIRED = (
    "f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k "
    "iq4_nl iq4_xs mxfp4 iq2_xxs iq2_xs iq2_s iq3_xxs iq3_s"
).split()


def main(d: Path) -> int:
    failures = 0
    checked = 0
    missing = [name for name in REQUIRED if not (d / f"{name}.blocks").exists()]
    for name in missing:
        print(f"dequantize {name:>7}: MISSING from the dump")
    failures += len(missing)
    for blocks_path in sorted(d.glob("*.blocks")):
        name = blocks_path.stem
        qtype = Q[name.upper()]
        block, size = GGML_QUANT_SIZES[qtype]
        raw = np.fromfile(blocks_path, dtype=np.uint8)
        ours = np.fromfile(d / f"{name}.f32", dtype=np.uint32)
        n_blocks = raw.size // size
        ref = dequantize(raw.reshape(n_blocks, size), qtype).reshape(-1).astype(np.float32)
        ref_bits = ref.view(np.uint32)
        both_nan = np.isnan(ref) & np.isnan(ours.view(np.float32))
        bad = np.nonzero((ref_bits != ours) & ~both_nan)[0]
        checked += ours.size
        status = "ok" if bad.size == 0 else f"{bad.size} MISMATCHES"
        unit = "blocks" if block > 1 else "elements"
        print(f"dequantize {name:>7}: {n_blocks:>7} {unit}, {ours.size:>9} values: {status}")
        for i in bad[:5]:
            print(f"   element {i} (block {i // block}): ours {ours.view(np.float32)[i]!r} "
                  f"({ours[i]:#010x}), gguf-py {ref[i]!r} ({ref_bits[i]:#010x})")
        failures += bad.size
    rows = np.fromfile(d / "quant_input.f32", dtype=np.float32)
    for name in ("q8_0", "q4_0", "bf16"):
        qtype = Q[name.upper()]
        ours = np.fromfile(d / f"quant_{name}.bytes", dtype=np.uint8)
        ref = quantize(rows.reshape(-1, 32), qtype).reshape(-1).view(np.uint8)
        bad = np.nonzero(ours != ref)[0]
        print(f"quantize   {name:>7}: {rows.size:>9} values -> {ref.size} bytes: "
              f"{'ok' if bad.size == 0 else f'{bad.size} MISMATCHED BYTES'}")
        for i in bad[:5]:
            print(f"   byte {i}: ours {ours[i]:#04x}, gguf-py {ref[i]:#04x}")
        failures += bad.size
    # Negative control: the comparison itself must catch a one-bit difference.
    probe = np.fromfile(d / "q4_k.f32", dtype=np.uint32)
    flipped = probe.copy()
    flipped[len(flipped) // 2] ^= 1
    if np.count_nonzero(flipped != probe) != 1:
        print("negative control FAILED: a flipped bit was not detected")
        failures += 1
    print(f"{checked} dequantized values checked; {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
