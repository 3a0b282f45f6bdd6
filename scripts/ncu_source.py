#!/usr/bin/env python3
"""Where one kernel launch's stall samples go, from Nsight Compute's source page.

    SAMESUM_GPU_STEPS=ncu SAMESUM_GPU_NCU_SOURCE=1 SAMESUM_GPU_NCU_PREFILL=K \
        SAMESUM_GPU_NCU_SECTIONS="--section SourceCounters" scripts/gpu.sh run OUT
    scripts/ncu_source.py OUT/ncu-K-source.csv.gz [--windows N]

Prints the launch's stall reasons (share of all warp samples), then per
opcode its share of the executed warp instructions and of the samples: an
opcode whose sample share is far above its instruction share is where the
warps wait. With --windows N, also every run of N consecutive SASS
instructions holding at least 0.5% of the samples (its first instruction's
index, sample and instruction shares, commonest opcodes), to find the
regions (a prologue, a loop) the waits sit in.
"""
import collections
import csv
import gzip
import sys


def opcode(src):
    words = src.split()
    if words and words[0].startswith("@"):  # a predicate guard
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        sys.exit(__doc__)
    window = 0
    if "--windows" in args:
        i = args.index("--windows")
        try:
            window = int(args[i + 1])
        except (IndexError, ValueError):
            sys.exit("--windows takes a count of instructions")
    path = args[0]
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        sys.exit(f"{path}: {e}")
    # Row 0 names the kernel; row 1 is the header.
    if len(rows) < 3 or "Source" not in rows[1]:
        sys.exit(f"{path}: not an ncu source page (--page source --csv)")
    hdr = rows[1]
    col = {h: i for i, h in enumerate(hdr)}
    need = ["Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    missing = [h for h in need if h not in col]
    if missing:
        sys.exit(f"{path}: no column {missing[0]!r} (was --section SourceCounters set?)")
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, h):
        try:
            return int(r[col[h]] or 0)
        except ValueError:
            return 0

    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    samples = [num(r, need[1]) for r in data]
    execd = [num(r, need[2]) for r in data]
    ts, te = sum(samples) or 1, sum(execd) or 1
    print(f"{rows[0][1] if len(rows[0]) > 1 else path}: {sum(samples)} samples, "
          f"{sum(execd)} warp instructions")
    reasons = collections.Counter({h: sum(num(r, h) for r in data) for h in stalls})
    for h, v in reasons.most_common(12):
        print(f"  {h[len('stall_'):]:20s} {100 * v / ts:5.1f}%")
    ops_e, ops_s = collections.Counter(), collections.Counter()
    for r, s, e in zip(data, samples, execd):
        o = opcode(r[col["Source"]])
        ops_e[o] += e
        ops_s[o] += s
    print("  opcode      instructions  samples")
    for o, e in ops_e.most_common(20):
        print(f"  {o:10s} {100 * e / te:12.1f}% {100 * ops_s[o] / ts:7.1f}%")
    if window > 0:
        print(f"  windows of {window} instructions with >= 0.5% of the samples:")
        for i in range(0, len(data), window):
            s = sum(samples[i:i + window])
            if s < 0.005 * ts:
                continue
            e = sum(execd[i:i + window])
            top = collections.Counter()
            for r, x in zip(data[i:i + window], execd[i:i + window]):
                top[opcode(r[col["Source"]])] += x
            common = ", ".join(o for o, _ in top.most_common(4))
            print(f"  {i:6d} samples {100 * s / ts:5.1f}% instructions {100 * e / te:5.1f}%  {common}")


if __name__ == "__main__":
    main()
