#!/usr/bin/env python3
"""Time to first token of a follow-up chat turn, against a running server.

Each round sends a first turn (a user message of about WORDS words,
max_tokens 32, temperature 0), then the follow-up (that message, the reply,
"And then?") with max_tokens 1, and prints the follow-up's prompt tokens,
the tokens the server reused (timings.cache_n), its prefill time
(timings.prompt_ms) and the request's wall time. Run it against a server
with its prefix cache on and again with --prefix-cache-mb 0 (the cold
request): the ratio of the medians is the follow-up's share of cold.

    scripts/followup.py --url http://127.0.0.1:8089 --words 6000 --rounds 5

Standard library only (the GPU machines have Python but no network).
"""

import argparse
import json
import statistics
import sys
import time
import urllib.request


def post(url, body, timeout):
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return out, time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--words", type=int, default=6000, help="words in the first message (~1.3 tokens each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    if a.words < 1 or a.rounds < 1:
        sys.exit("--words and --rounds must be at least 1")
    walls, prefill = [], []
    print("| round | follow-up prompt tokens | reused (cache_n) | prompt_ms | request s |")
    print("|---:|---:|---:|---:|---:|")
    for r in range(a.rounds):
        words = " ".join(f"r{r}w{i} the quick brown fox jumps over the lazy dog." for i in range(a.words // 10 + 1))
        first = {"messages": [{"role": "user", "content": words}], "max_tokens": 32, "temperature": 0}
        reply, _ = post(a.url, first, a.timeout)
        text = reply["choices"][0]["message"].get("content") or ""
        follow = {
            "messages": [
                {"role": "user", "content": words},
                {"role": "assistant", "content": text},
                {"role": "user", "content": "And then?"},
            ],
            "max_tokens": 1,
            "temperature": 0,
        }
        out, wall = post(a.url, follow, a.timeout)
        t = out.get("timings", {})
        u = out.get("usage", {})
        walls.append(wall)
        prefill.append(t.get("prompt_ms", float("nan")))
        print(f"| {r} | {u.get('prompt_tokens')} | {t.get('cache_n')} | {t.get('prompt_ms', 0):.1f} | {wall:.3f} |")
    print(f"\nmedian request {statistics.median(walls):.3f} s, median prompt_ms {statistics.median(prefill):.1f}")


if __name__ == "__main__":
    main()
