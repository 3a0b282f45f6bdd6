#!/usr/bin/env python3
"""Where one decode token's time goes, from Nsight Compute's CSV.

    SAMESUM_CUDA_GRAPHS=0 ncu --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv \
        samesum bench --device cuda -m M -p 0 -n 2 -r 1 --no-warmup > t.csv
    scripts/ncu_token.py t.csv [LAUNCHES]

Sums gpu__time_duration per kernel over the last LAUNCHES launches (one
token's; by default the second half, which is token 2 of `-p 0 -n 2`) and
prints them largest first. Used by `scripts/gpu.sh run` (step `token`).
"""
import csv, sys, collections
rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
r = csv.DictReader(lines)
for x in r:
    if x.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(x["Metric Value"].replace(",", ""))
    unit = x.get("Metric Unit", "")
    us = v / 1000 if unit in ("nsecond", "ns") else (v if unit in ("usecond", "us") else v * 1000)
    rows.append((x["Kernel Name"], us))
half = rows[-int(sys.argv[2]):] if len(sys.argv) > 2 else rows[len(rows) // 2:]
agg = collections.defaultdict(lambda: [0, 0.0])
for n, us in half:
    agg[n][0] += 1
    agg[n][1] += us
tot = sum(a[1] for a in agg.values())
print(f"{sys.argv[1]}: {len(rows)} launches, second half {len(half)}: {tot:.0f} us")
for n, (c, us) in sorted(agg.items(), key=lambda t: -t[1][1]):
    print(f"{us:8.1f} us {c:4d} x {us / c:6.2f}  {n[:60]}")
