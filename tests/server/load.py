"""Load test for samesum serve: concurrent streaming clients on loopback.

Usage: load.py BASE_URL SERVER_PID [--clients 32] [--requests 200] [--out FILE]

Every request streams a chat completion of 32 tokens: one of 20 kinds, 10
prompts of different lengths (about 15 to 150 tokens) each greedy or sampled
with a seed (temperature 0.9). Checks: every request answered exactly once,
every stream well-formed (one id per stream, unique across streams, a finish
reason, usage), every answer identical to the same request run alone (no
cross-talk between streams, whoever shares the batch and whenever it joined),
the seeded answers differing from the greedy ones (a control: the comparison
would see a change of sampling), no errors, and the server's resident memory
flat (within 4 MiB) over a second full round. Prints requests/s and
time-to-first-token percentiles.
"""

import argparse
import asyncio
import json
import statistics
import time

import openai

ap = argparse.ArgumentParser()
ap.add_argument("base")
ap.add_argument("pid", type=int)
ap.add_argument("--clients", type=int, default=32)
ap.add_argument("--requests", type=int, default=200)
ap.add_argument("--out")
args = ap.parse_args()

PROMPTS = [" ".join([f"Request topic {i}: tell me something about the number {i * 7}."] * (i + 1))
           for i in range(10)]
KINDS = 2 * len(PROMPTS)


def kind(i):
    """(prompt, sampling) of request i: greedy for the first 10 kinds, seeded after."""
    k = i % KINDS
    p = PROMPTS[k % len(PROMPTS)]
    return (p, {"temperature": 0}) if k < len(PROMPTS) else (p, {"temperature": 0.9, "seed": k})


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def one(client, i, results):
    t0 = time.perf_counter()
    ttft = None
    ids, parts, finish, usage = set(), [], None, None
    prompt, sampling = kind(i)
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=32,
        stream=True,
        **sampling,
        extra_body={"ignore_eos": True},
    )
    async for ch in stream:
        ids.add(ch.id)
        if ch.choices and ch.choices[0].delta.content is not None:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
        if getattr(ch, "usage", None):
            usage = ch.usage
    results.append(
        {"i": i, "ids": sorted(ids), "text": "".join(parts), "finish": finish,
         "completion_tokens": usage.completion_tokens if usage else None,
         "ttft": ttft, "total": time.perf_counter() - t0}
    )


async def run(n, clients):
    client = openai.AsyncOpenAI(base_url=args.base.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
    queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    results = []

    async def worker():
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await one(client, i, results)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


# Warm-up (also the reference answers, one request at a time).
ref, _ = asyncio.run(run(KINDS, 1))
expected = {r["i"] % KINDS: r["text"] for r in ref}
differ = sum(expected[k] != expected[k + len(PROMPTS)] for k in range(len(PROMPTS)))
assert differ >= len(PROMPTS) // 2, f"only {differ} of {len(PROMPTS)} seeded answers differ from the greedy ones"
# One full round first (allocator pools, thread stacks, connection buffers
# reach their working size), then the measured round: memory must not grow.
asyncio.run(run(args.requests, args.clients))
rss0 = rss_kib(args.pid)
results, wall = asyncio.run(run(args.requests, args.clients))
rss1 = rss_kib(args.pid)

assert len(results) == args.requests, f"{len(results)} answers for {args.requests} requests"
assert sorted(r["i"] for r in results) == list(range(args.requests)), "a request lost or duplicated"
all_ids = [r["ids"] for r in results]
assert all(len(x) == 1 for x in all_ids), "a stream carried several ids"
assert len({x[0] for x in all_ids}) == args.requests, "two streams shared an id"
for r in results:
    assert r["finish"] == "length" and r["completion_tokens"] == 32, r
    assert r["text"] == expected[r["i"] % KINDS], f"request {r['i']}: its answer differs from the same request alone"
growth = (rss1 - rss0) / 1024
assert growth < 4, f"resident memory grew by {growth:.1f} MiB over the second round"

ttfts = sorted(r["ttft"] for r in results)
p = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]
summary = {
    "requests": args.requests, "clients": args.clients, "wall_s": round(wall, 3),
    "requests_per_s": round(args.requests / wall, 2),
    "tokens_per_s": round(32 * args.requests / wall, 1),
    "ttft_p50_ms": round(p(0.50) * 1e3, 1), "ttft_p99_ms": round(p(0.99) * 1e3, 1),
    "ttft_mean_ms": round(statistics.mean(ttfts) * 1e3, 1),
    "rss_before_mib": round(rss0 / 1024, 1), "rss_after_mib": round(rss1 / 1024, 1),
}
print(json.dumps(summary))
if args.out:
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
print("load test passed: none lost, none duplicated, every stream well-formed, answers identical to the same request alone (greedy and seeded), memory flat")
