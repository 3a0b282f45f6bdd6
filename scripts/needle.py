#!/usr/bin/env python3
"""Needle in a haystack: can the model find one sentence deep in a long prompt?

Builds a long prompt of filler prose, puts a key sentence (a passphrase) at
the chosen depths of it, asks for the passphrase at the end, runs
`samesum run` greedily, and checks that the answer contains the passphrase.
One line per (length, depth); the exit status is 0 only when every run found
the needle.

With real weights (an instruction-tuned Qwen3 / Qwen3.5 GGUF):

    scripts/needle.py -m Qwen3-30B-A3B-Q4_K_M.gguf --tokens 8192,32768 --depth 0.1,0.5,0.9

On a synthetic model (`samesum synth`) the weights are random, so the answer
is noise: `--smoke` checks only that every run completes and prints text.

Prompt lengths are estimated from characters (about 4 characters a token
for the English filler with a Qwen vocabulary); `-c` is set to the prompt's
bytes plus room for the answer, which bounds its tokens for any byte-level
vocabulary.
"""
import argparse
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "crates" / "synth" / "src" / "corpus.txt"
CHARS_PER_TOKEN = 4.0


def haystack(n_chars: int, seed: int) -> list:
    """Filler sentences (shuffled sentences of the corpus) of about n_chars."""
    text = CORPUS.read_text()
    sentences = [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.strip()) > 20]
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        s = rng.choice(sentences)
        out.append(s)
        size += len(s) + 1
    return out


def prompt(tokens: int, depth: float, secret: str, seed: int) -> str:
    needle = f"The secret passphrase is {secret}. Remember it."
    body = haystack(int(tokens * CHARS_PER_TOKEN), seed)
    at = min(len(body), max(0, int(round(depth * len(body)))))
    body.insert(at, needle)
    question = ("\n\nWhat is the secret passphrase mentioned in the text above? "
                "Answer with the passphrase only.")
    return " ".join(body) + question


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="GGUF file")
    ap.add_argument("--tokens", default="4096", help="prompt lengths, comma-separated (default 4096)")
    ap.add_argument("--depth", default="0.1,0.5,0.9", help="needle depths in [0, 1], comma-separated")
    ap.add_argument("--bin", default=None, help="samesum binary (default: target/release/samesum, else PATH)")
    ap.add_argument("--device", default=None, help="passed to samesum run --device (e.g. cuda)")
    ap.add_argument("-n", type=int, default=24, help="tokens to generate (default 24)")
    ap.add_argument("--seed", type=int, default=1, help="filler and passphrase seed")
    ap.add_argument("--smoke", action="store_true", help="check only that the runs complete (synthetic weights)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run (default 3600)")
    a = ap.parse_args()

    binary = a.bin or (str(ROOT / "target" / "release" / "samesum")
                       if (ROOT / "target" / "release" / "samesum").exists() else shutil.which("samesum"))
    if not binary:
        print("needle: no samesum binary (build with cargo build --release, or pass --bin)", file=sys.stderr)
        return 2
    try:
        lengths = [int(x) for x in a.tokens.split(",")]
        depths = [float(x) for x in a.depth.split(",")]
    except ValueError as e:
        print(f"needle: bad --tokens or --depth: {e}", file=sys.stderr)
        return 2
    if any(n < 64 for n in lengths) or any(not 0.0 <= d <= 1.0 for d in depths):
        print("needle: --tokens must be at least 64 and --depth within [0, 1]", file=sys.stderr)
        return 2

    rng = random.Random(a.seed)
    failures = 0
    with tempfile.TemporaryDirectory() as td:
        for n in lengths:
            for d in depths:
                secret = f"{rng.choice(['violet', 'amber', 'cobalt', 'maroon'])}-" \
                         f"{rng.choice(['river', 'falcon', 'lantern', 'meadow'])}-{rng.randint(10, 99)}"
                p = Path(td) / "prompt.txt"
                text = prompt(n, d, secret, a.seed + n)
                p.write_text(text)
                # Every byte-level BPE token covers at least one byte: the
                # prompt's bytes bound its tokens, whatever the vocabulary.
                ctx = len(text.encode()) + a.n + 64
                cmd = [binary, "run", "-m", a.model, "-f", str(p), "-n", str(a.n), "--temp", "0", "-c", str(ctx)]
                if a.device:
                    cmd += ["--device", a.device]
                t = time.time()
                try:
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                except subprocess.TimeoutExpired:
                    print(f"tokens~{n} depth {d:.2f}: TIMEOUT after {a.timeout:.0f} s")
                    failures += 1
                    continue
                dt = time.time() - t
                answer = r.stdout.strip().replace("\n", " ")
                if r.returncode != 0:
                    print(f"tokens~{n} depth {d:.2f}: samesum failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
                    failures += 1
                    continue
                if a.smoke:
                    ok = len(answer) > 0
                    verdict = "ran" if ok else "NO OUTPUT"
                else:
                    ok = secret.lower() in answer.lower()
                    verdict = "found" if ok else "MISSED"
                failures += 0 if ok else 1
                print(f"tokens~{n} depth {d:.2f}: {verdict} in {dt:.1f} s (want {secret!r}; got {answer[:80]!r})")
    print(f"{'all runs passed' if failures == 0 else f'{failures} run(s) failed'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
