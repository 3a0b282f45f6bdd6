#!/usr/bin/env python3
"""Independent reader check: gguf-py (llama.cpp's own Python reader) opens the
GGUF files samesum writes and sees the same metadata, tensor directory and bytes.

Usage: check_gguf_py.py FILE.gguf INSPECT.json
where INSPECT.json is `samesum inspect --json --all-metadata FILE.gguf`.
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main(path: str, inspect_json: str) -> int:
    ours = json.load(open(inspect_json))
    r = GGUFReader(path)
    errors = []
    if len(r.tensors) != ours["tensor_count"]:
        errors.append(f"tensor count: gguf-py {len(r.tensors)}, samesum {ours['tensor_count']}")
    by_name = {t["name"]: t for t in ours["tensors"]}
    for t in r.tensors:
        o = by_name.get(t.name)
        if o is None:
            errors.append(f"tensor {t.name} missing from samesum's directory")
            continue
        dims = [int(x) for x in t.shape]
        if dims != o["dims"]:
            errors.append(f"{t.name}: dims gguf-py {dims}, samesum {o['dims']}")
        if t.tensor_type.name.lower() != o["type"].lower():
            errors.append(f"{t.name}: type gguf-py {t.tensor_type.name}, samesum {o['type']}")
        if int(t.n_bytes) != o["bytes"]:
            errors.append(f"{t.name}: bytes gguf-py {t.n_bytes}, samesum {o['bytes']}")
        vals = dequantize(t.data, t.tensor_type)
        if not np.all(np.isfinite(vals)):
            errors.append(f"{t.name}: non-finite values")
    keys = {f.name for f in r.fields.values() if not f.name.startswith("GGUF.")}
    if keys != set(ours["metadata"].keys()):
        errors.append(f"metadata keys differ: {sorted(keys ^ set(ours['metadata'].keys()))}")
    arch = r.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    if arch != ours["architecture"]:
        errors.append(f"architecture gguf-py {arch}, samesum {ours['architecture']}")
    for e in errors[:20]:
        print("  " + e)
    print(f"gguf-py reads {path}: {len(r.tensors)} tensors, {len(keys)} keys: "
          f"{'ok' if not errors else f'{len(errors)} problems'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
