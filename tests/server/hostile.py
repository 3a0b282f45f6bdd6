"""samesum serve against hostile clients, on loopback, the tiny built-in model.

Usage: hostile.py SAMESUM_BIN [--fd-limit 512] [--idle 1000] [--threads 1]

Starts its own server (its file-descriptor limit lowered with setrlimit
before exec), records every valid request's answer sent alone (temperature
0), warms up, then attacks twice for ROUND_S seconds each. In each round,
valid requests are sent again and again (a third of them half-closing their
socket after sending), while at the same time:
- 40 slowloris clients trickle a request head a line at a time (from 0 s,
  alone: the read timeout closes them; again from 4 s, under the flood);
- malformed and oversized requests come in (garbage, bad JSON, bad fields,
  wrong method and path, a declared and a chunked body over the limit, a
  100 KB header, invalid UTF-8, JSON nested 20,000 deep, a body that stalls,
  max_tokens over the cap and over the context, a chat of 20,000 messages);
- clients disconnect mid-stream and mid-prefill (streamed and not), twice;
- from 3.5 s, another process holds up to --idle idle connections, reopening
  those the server closes twice a second (past the server's connection cap:
  it closes the longest idle ones to make room).
Another process asks /health on a new connection every 25 ms throughout.

Checks: every valid request answered exactly once with the same text,
finish reason and token count as alone (ids unique); every request the
server took ended once (finished, cancelled or timed out); every hostile
request got its status; slowloris sockets closed by the read timeout; the
disconnected requests cancelled; /health answered within 100 ms every time;
the server's RSS back near its warm level after each round; then SIGTERM drains (a running stream finishes, new
connections are refused, exit 0) and, on a second server, a second signal
exits at once with a non-zero status. The server does not take custom chat
templates (only the model file's, which runs with bounded fuel), so there is
no template bomb to send; the 20,000-message chat is the template's largest
legitimate work.

Prints the figures (max /health latency, connections, RSS before/after).
"""

import argparse
import http.client
import itertools
import json
import os
import re
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

HEALTH_MAX_MS = 100.0
READ_TIMEOUT = 2.0  # --timeout
KEEP_ALIVE = 1.0  # --keep-alive-timeout
MAX_TOKENS_CAP = 2048
ROUND_S = 9.0  # one attack
FLOOD_AT = 3.5  # when the idle flood starts in a round
# After a round, above the warm level at most: what glibc keeps in its
# per-thread arenas (freed but not returned: their tops are trimmed only past
# a threshold that grows with the largest block freed) varies from round to
# round between about 10 and 35 MiB over a peak of 120-145 MiB; a leak would
# grow past it.
RSS_SLACK_KIB = 48 * 1024

# A chat of 20,000 messages (600 KB: the template and tokenizer's work) and a
# prompt of about 2,400 tokens.
MANY = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 20000, "max_tokens": 4}).encode()
LONG_PROMPT = "alpha beta gamma delta " * 150
PREFILL_IDS = itertools.count()

# The valid requests: (name, path, body); all greedy.
PROMPTS = ["Tell me about mixture-of-experts models.", "Hello there", "1 2 3 4 5"]
VALID = []
for _i, _p in enumerate(PROMPTS):
    for _stream in (False, True):
        _s = "s" if _stream else ""
        VALID.append((f"chat{_i}{_s}", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": _p}], "max_tokens": 24, "temperature": 0,
                       "stream": _stream, "ignore_eos": True}))
        VALID.append((f"cmpl{_i}{_s}", "/v1/completions",
                      {"prompt": _p, "max_tokens": 24, "temperature": 0, "stream": _stream, "ignore_eos": True}))


def probe_main(host, port, out_path):
    """/health on a new connection every 25 ms until OUT.stop exists."""
    lat, fails = [], []
    stop = out_path + ".stop"
    while not os.path.exists(stop):
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection(host, port, timeout=2)
            c.request("GET", "/health")
            r = c.getresponse()
            body = r.read()
            c.close()
            if r.status != 200 or b"ok" not in body:
                fails.append(f"status {r.status}: {body[:80]!r}")
        except Exception as e:  # noqa: BLE001 - every failure is reported
            fails.append(f"{type(e).__name__}: {e}")
        lat.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.025)
    with open(out_path, "w") as f:
        json.dump({"lat": lat, "fails": fails}, f)


def flood_main(host, port, n, seconds, out_path):
    """Hold n idle connections for `seconds`, reopening closed ones twice a second."""
    sel = selectors.DefaultSelector()
    open_, st = set(), {"opened": 0, "closed_by_server": 0, "max_open": 0, "fails": []}
    end = time.time() + seconds
    refill = 0.0
    while time.time() < end:
        if time.time() >= refill:
            while len(open_) < n:
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex((host, port))
                sel.register(s, selectors.EVENT_READ)
                open_.add(s)
                st["opened"] += 1
            refill = time.time() + 0.5
        st["max_open"] = max(st["max_open"], len(open_))
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                st["fails"].append(f"an idle connection got bytes: {data[:80]!r}")
            sel.unregister(s)
            s.close()
            open_.discard(s)
            st["closed_by_server"] += 1
    for s in open_:
        s.close()
    with open(out_path, "w") as f:
        json.dump(st, f)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Server:
    def __init__(self, binary, args, fd_limit, log_path):
        def lower_fds():
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

        self.log_path = log_path
        self.log = open(log_path, "w")
        self.p = subprocess.Popen([binary, "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                                  stderr=self.log, preexec_fn=lower_fds, text=True)
        deadline = time.time() + 120
        line = ""
        while time.time() < deadline:
            line = self.p.stdout.readline()
            if "listening on" in line or not line:
                break
        m = re.search(r"http://([0-9.]+):(\d+)", line)
        if not m:
            self.p.kill()
            raise AssertionError(f"the server did not start: {line!r}\n{self.log_text()[-3000:]}")
        self.host, self.port = m.group(1), int(m.group(2))

    def log_text(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def metrics(self):
        c = http.client.HTTPConnection(self.host, self.port, timeout=10)
        c.request("GET", "/metrics")
        r = c.getresponse()
        text = r.read().decode()
        assert r.status == 200, (r.status, text)
        out = {}
        for line in text.splitlines():
            if line.startswith("samesum_"):
                k, v = line.split()
                out[k[len("samesum_"):]] = float(v)
        return out


def read_to_end(s):
    raw = b""
    while True:
        try:
            c = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not c:
            break
        raw += c
    return raw


def raw_request(host, port, method, path, body=b"", headers=None, half_close=False, timeout=60):
    """One request on a new connection (Connection: close): (status, head, body)."""
    h = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(body)), "Connection": "close"}
    h.update(headers or {})
    data = (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode() + body
    s = socket.create_connection((host, port), timeout=timeout)
    try:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        return parse_response(read_to_end(s))
    finally:
        s.close()


def parse_response(raw):
    if b"\r\n\r\n" not in raw:
        return None, "", raw
    head, rest = raw.split(b"\r\n\r\n", 1)
    head = head.decode("latin-1")
    status = int(head.split()[1])
    if "transfer-encoding: chunked" in head.lower():
        out = b""
        while rest:
            line, _, rest = rest.partition(b"\r\n")
            n = int(line.strip() or b"0", 16)
            if n == 0:
                break
            out += rest[:n]
            rest = rest[n + 2:]
        rest = out
    return status, head, rest


def outcome(status, body, stream, chat):
    """(text, finish_reason, completion_tokens, id) of a valid response."""
    assert status == 200, (status, body[:300])
    if not stream:
        v = json.loads(body)
        c = v["choices"][0]
        text = c["message"]["content"] if chat else c["text"]
        return text, c["finish_reason"], v["usage"]["completion_tokens"], v["id"]
    datas = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", body[-300:]
    text, finish, n, ids = "", None, None, set()
    for d in datas[:-1]:
        v = json.loads(d)
        assert "error" not in v, v
        ids.add(v["id"])
        c = v["choices"][0]
        text += (c["delta"].get("content") or "") if chat else c["text"]
        if c["finish_reason"]:
            finish = c["finish_reason"]
        if v.get("usage"):
            n = v["usage"]["completion_tokens"]
    assert len(ids) == 1, ids
    return text, finish, n, ids.pop()


def run_valid(srv, req, half_close=False):
    _, path, body = req
    st, _, b = raw_request(srv.host, srv.port, "POST", path, json.dumps(body).encode(), half_close=half_close)
    return outcome(st, b, body["stream"], path.endswith("chat/completions"))


def send_head(host, port, head, timeout=30):
    s = socket.create_connection((host, port), timeout=timeout)
    s.sendall(head)
    return s


class Attack:
    """One round of hostile and valid clients against `srv`."""

    def __init__(self, srv, alone, fail, tmp, n_idle):
        self.srv, self.alone, self.fail, self.tmp, self.n_idle = srv, alone, fail, tmp, n_idle
        self.H, self.P = srv.host, srv.port
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.slow = {1: [], 2: []}
        self.results, self.valid_sent, self.bad_sent = [], 0, 0

    # Slowloris: a header line every 0.3 s, never ending the head.
    def slowloris(self, i, wave):
        t0 = time.time()
        try:
            s = send_head(self.H, self.P, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", timeout=10)
            s.settimeout(0.3)
            while time.time() - t0 < READ_TIMEOUT + 6:
                try:
                    s.sendall(f"X-Slow-{i}: {'a' * 8}\r\n".encode())
                    if s.recv(1024) == b"":
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
            with self.lock:
                self.slow[wave].append(time.time() - t0)
            s.close()
        except OSError as e:
            self.fail(f"slowloris {i}: {e}")

    def expect(self, name, got, want):
        if got not in want:
            self.fail(f"{name}: status {got}, expected {want}")

    def bad_requests(self):
        H, P = self.H, self.P

        def garbage():
            s = send_head(H, P, b"\x00\xff\xfe garbage garbage\r\n\r\n", timeout=10)
            self.expect("garbage", parse_response(read_to_end(s))[0], (400,))
            s.close()

        def huge_header():
            self.expect("100 KB header", raw_request(H, P, "GET", "/health", headers={"X-Big": "a" * 100_000})[0], (431,))

        def declared_too_big():
            s = send_head(H, P, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 100000000\r\n\r\n{", timeout=10)
            self.expect("declared body over the limit", parse_response(read_to_end(s))[0], (413,))
            s.close()

        def chunked_too_big():
            s = send_head(H, P, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n", timeout=10)
            piece = b"a" * 65536
            try:
                for _ in range(20):  # 1.25 MiB, past the 1 MiB limit
                    s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            except OSError:
                pass
            # The server may close before reading it all (a reset loses
            # the 413 then): 413 or nothing.
            self.expect("chunked body over the limit", parse_response(read_to_end(s))[0], (413, None))
            s.close()

        def post(name, body, want, path="/v1/chat/completions"):
            def f():
                st, _, b = raw_request(H, P, "POST", path, body)
                self.expect(name, st, want)
                if st and st >= 400:
                    try:
                        assert json.loads(b)["error"]["message"]
                    except Exception:  # noqa: BLE001
                        self.fail(f"{name}: not an OpenAI error object: {b[:200]!r}")
            f.__name__ = name
            return f

        def get(name, path, want):
            def f():
                self.expect(name, raw_request(H, P, "GET", path)[0], want)
            f.__name__ = name
            return f

        nested = b'{"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}"
        return [
            garbage, huge_header, declared_too_big, chunked_too_big,
            post("invalid JSON", b"{\"messages\": [", (400,)),
            post("invalid UTF-8", b"\xff\xfe\xfd", (400,)),
            post("wrong type", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', (400,)),
            post("unknown role", b'{"messages": [{"role": "wizard", "content": "x"}]}', (400,)),
            post("nested 20,000 deep", nested, (400,)),
            post("20,000 messages", MANY, (400,)),
            post("max_tokens over the cap", json.dumps({"prompt": "x", "max_tokens": MAX_TOKENS_CAP + 1}).encode(), (400,),
                 "/v1/completions"),
            post("max_tokens over the context",
                 json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}).encode(), (400,)),
            get("unknown path", "/v2/nothing", (404,)),
            get("wrong method", "/v1/chat/completions", (405,)),
        ]

    def bad_rounds(self):
        bad = self.bad_requests()
        while not self.stop.is_set():
            for f in bad:
                if self.stop.is_set():
                    return
                try:
                    f()
                    with self.lock:
                        self.bad_sent += 1
                except Exception as e:  # noqa: BLE001
                    self.fail(f"{f.__name__}: {type(e).__name__}: {e}")

    def stalled_body(self):
        s = send_head(self.H, self.P, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: 100\r\n\r\n{\"prompt\": ", timeout=15)
        t0 = time.time()
        self.expect("stalled body", parse_response(read_to_end(s))[0], (408,))
        s.close()
        if time.time() - t0 > READ_TIMEOUT + 2:
            self.fail(f"stalled body answered after {time.time() - t0:.1f} s")

    # Disconnects mid-stream and mid-prefill.
    def gone_mid_stream(self, i):
        body = json.dumps({"prompt": f"go {i}", "max_tokens": 2000, "stream": True, "ignore_eos": True}).encode()
        s = send_head(self.H, self.P, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data: ") < 3:
            c = s.recv(4096)
            if not c:
                self.fail(f"mid-stream {i}: the stream ended early")
                break
            got += c
        s.close()

    def gone_mid_prefill(self, i, stream):
        # A prompt no earlier request began with: the server's prefix cache
        # would otherwise restore a repeated one and skip the long prefill.
        body = json.dumps({"prompt": f"{next(PREFILL_IDS)} " + LONG_PROMPT + str(i), "max_tokens": 8,
                           "stream": stream}).encode()
        s = send_head(self.H, self.P, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
        if stream:
            s.recv(4096)  # the head
        else:
            time.sleep(0.3)
        s.close()

    def disconnects(self):
        ts = [threading.Thread(target=self.gone_mid_stream, args=(i,)) for i in range(6)]
        ts += [threading.Thread(target=self.gone_mid_prefill, args=(i, i % 2 == 0)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    # Valid requests, again and again.
    def valid_worker(self, k):
        mine = [req for j, req in enumerate(VALID) if j % 4 == k]
        r = 0
        while not self.stop.is_set():
            req = mine[r % len(mine)]
            half = r % 3 == k % 3
            r += 1
            with self.lock:
                self.valid_sent += 1
            try:
                out = run_valid(self.srv, req, half_close=half)
            except Exception as e:  # noqa: BLE001
                self.fail(f"valid {req[0]} (half-close {half}): {type(e).__name__}: {e}")
                continue
            with self.lock:
                self.results.append((req[0], half, out))

    def run(self, rnd):
        t0 = time.time()

        def at(t, f, *a):
            def go():
                time.sleep(max(0.0, t0 + t - time.time()))
                f(*a)
            th = threading.Thread(target=go)
            th.start()
            return th

        flood_out = f"{self.tmp}.flood{rnd}"
        flood = []

        def start_flood():
            flood.append(subprocess.Popen([sys.executable, __file__, "-", "--flood", self.H, str(self.P),
                                           str(self.n_idle), str(ROUND_S - FLOOD_AT), flood_out]))

        workers = [at(FLOOD_AT, start_flood)]
        workers += [at(0, self.slowloris, i, 1) for i in range(40)]
        workers += [at(0, self.bad_rounds), at(0, self.stalled_body), at(0, self.disconnects)]
        workers += [at(0, self.valid_worker, k) for k in range(4)]
        workers += [at(4, self.slowloris, 100 + i, 2) for i in range(40)]
        workers += [at(6, self.disconnects)]
        rss_peak, conns_peak = 0, 0
        while time.time() - t0 < ROUND_S:
            rss_peak = max(rss_peak, rss_kib(self.srv.p.pid))
            try:
                conns_peak = max(conns_peak, self.srv.metrics()["connections_open"])
            except (AssertionError, OSError):
                pass
            time.sleep(0.25)
        self.stop.set()
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                self.fail("a client thread did not finish")
        flood[0].wait(timeout=30)
        with open(flood_out) as f:
            fl = json.load(f)
        os.remove(flood_out)
        for e in fl["fails"][:3]:
            self.fail(e)
        return {"rss_peak": rss_peak, "conns_peak": conns_peak, "flood": fl, "seconds": time.time() - t0}


def main():
    if "--probe" in sys.argv:
        a = sys.argv[sys.argv.index("--probe") + 1:]
        probe_main(a[0], int(a[1]), a[2])
        return
    if "--flood" in sys.argv:
        a = sys.argv[sys.argv.index("--flood") + 1:]
        flood_main(a[0], int(a[1]), int(a[2]), float(a[3]), a[4])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--fd-limit", type=int, default=512)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1, help="the model's CPU threads (the rest serve HTTP)")
    args = ap.parse_args()
    t_start = time.time()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.idle + 400
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    n_idle = min(args.idle, soft - 300)
    if n_idle < args.idle:
        print(f"note: this machine allows {soft} descriptors: {n_idle} idle connections instead of {args.idle}")
    tmp = f"/tmp/samesum-hostile-{os.getpid()}"
    failures = []
    fail_lock = threading.Lock()

    def fail(msg):
        with fail_lock:
            failures.append(msg)

    srv = Server(args.bin, ["--max-batch", "4", "--max-queue", "64", "--threads", str(args.threads),
                            "--timeout", str(READ_TIMEOUT), "--keep-alive-timeout", str(KEEP_ALIVE),
                            "--request-timeout", "120", "--drain-timeout", "20",
                            "--max-tokens-cap", str(MAX_TOKENS_CAP)],
                 args.fd_limit, tmp + ".log")
    m = re.search(r"max_connections\W+(\d+)", srv.log_text())
    cap = int(m.group(1)) if m else None
    print(f"server: fd limit {args.fd_limit} (ulimit -n), --max-connections 1024 lowered to {cap}")
    H, P = srv.host, srv.port

    alone = {req[0]: run_valid(srv, req) for req in VALID}
    rss_cold = rss_kib(srv.p.pid)
    # Warm up what the rounds take once (a bad body, the 600 KB chat, a long
    # prefill, four requests at once), then the warm RSS.
    raw_request(H, P, "POST", "/v1/completions", b"{bad")
    raw_request(H, P, "POST", "/v1/chat/completions", MANY)
    raw_request(H, P, "POST", "/v1/completions", json.dumps({"prompt": LONG_PROMPT, "max_tokens": 2}).encode())
    warm = [threading.Thread(target=run_valid, args=(srv, req)) for req in VALID[:4]]
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    time.sleep(0.5)
    rss_warm = rss_kib(srv.p.pid)

    probe = subprocess.Popen([sys.executable, __file__, "-", "--probe", H, str(P), tmp + ".probe"])
    m0 = srv.metrics()
    rounds = []
    for rnd in (1, 2):
        a = Attack(srv, alone, fail, tmp, n_idle)
        st = a.run(rnd)
        # The server closes what is left; requests end; counters settle.
        deadline = time.time() + 15
        while time.time() < deadline:
            mm = srv.metrics()
            if mm["connections_open"] <= 1 and mm["requests_running"] == 0 and mm["queue_depth"] == 0:
                break
            time.sleep(0.2)
        time.sleep(1.5)
        st["rss_after"] = rss_kib(srv.p.pid)
        st["attack"] = a
        rounds.append(st)
        # Valid answers: one per request sent, the same as alone, ids unique.
        if len(a.results) != a.valid_sent:
            fail(f"round {rnd}: {len(a.results)} valid answers for {a.valid_sent} valid requests")
        ids = [out[3] for _, _, out in a.results]
        if len(set(ids)) != len(ids):
            fail(f"round {rnd}: duplicated response ids")
        for name, half, out in a.results:
            if out[:3] != alone[name][:3]:
                fail(f"round {rnd}: {name} (half-close {half}): {out[:3]!r} != alone {alone[name][:3]!r}")
        w1, w2 = sorted(a.slow[1]), sorted(a.slow[2])
        if len(w1) != 40 or w1[0] < READ_TIMEOUT - 0.2 or w1[-1] > READ_TIMEOUT + 1.0:
            fail(f"round {rnd}: slowloris (no flood): {len(w1)} of 40 closed, after {w1[:1]}..{w1[-1:]} s")
        if len(w2) != 40 or w2[-1] > READ_TIMEOUT + 1.5:
            fail(f"round {rnd}: slowloris (flood): {len(w2)} of 40 closed, last after {w2[-1:]} s")
    m1 = srv.metrics()
    open(tmp + ".probe.stop", "w").close()
    probe.wait(timeout=10)
    with open(tmp + ".probe") as f:
        pr = json.load(f)

    # Every request the server took ended once.
    d = {k: m1[k] - m0[k] for k in m1}
    if d["requests_total"] != d["requests_finished_total"] + d["requests_cancelled_total"] + d["requests_timed_out_total"]:
        fail(f"requests: {d['requests_total']:.0f} taken, {d['requests_finished_total']:.0f} finished, "
             f"{d['requests_cancelled_total']:.0f} cancelled, {d['requests_timed_out_total']:.0f} timed out")
    cancelled = d["requests_cancelled_total"]
    if cancelled < 40:
        fail(f"{cancelled:.0f} requests cancelled, expected 40 (4 times 6 mid-stream and 4 mid-prefill)")
    lat = sorted(pr["lat"])
    if pr["fails"]:
        fail(f"/health failed {len(pr['fails'])} times: {pr['fails'][:3]}")
    if lat[-1] > HEALTH_MAX_MS:
        fail(f"/health took {lat[-1]:.1f} ms at worst (limit {HEALTH_MAX_MS:.0f} ms)")
    r1, r2 = rounds[0]["rss_after"], rounds[1]["rss_after"]
    if max(r1, r2) - rss_warm > RSS_SLACK_KIB:
        fail(f"RSS after the rounds {r1 / 1024:.1f}, {r2 / 1024:.1f} MiB: more than "
             f"{RSS_SLACK_KIB / 1024:.0f} MiB above the warm {rss_warm / 1024:.1f} MiB")

    res = [r for st in rounds for r in st["attack"].results]
    w1 = sorted(x for st in rounds for x in st["attack"].slow[1])
    w2 = sorted(x for st in rounds for x in st["attack"].slow[2])
    fl = [st["flood"] for st in rounds]
    print(f"/health: {len(lat)} probes on new connections, max {lat[-1]:.1f} ms, p99 {lat[int(len(lat) * 0.99) - 1]:.1f} ms, "
          f"median {lat[len(lat) // 2]:.1f} ms, failures {len(pr['fails'])}")
    print(f"idle connections: {n_idle} held at once by the flood (max {max(f['max_open'] for f in fl)}), "
          f"{sum(f['opened'] for f in fl)} opened, {sum(f['closed_by_server'] for f in fl)} closed by the server")
    print(f"server connections: {d['connections_total']:.0f} accepted, at most {max(st['conns_peak'] for st in rounds):.0f} open (cap {cap}), "
          f"{d['connections_evicted_total']:.0f} evicted (idle, past the cap), {d['connections_timed_out_total']:.0f} timed out, "
          f"{d['connections_refused_total']:.0f} refused (503 or closed)")
    print(f"slowloris: {len(w1)} closed after {w1[0]:.2f}-{w1[-1]:.2f} s by the read timeout of {READ_TIMEOUT} s; "
          f"{len(w2)} under the flood after {w2[0]:.2f}-{w2[-1]:.2f} s")
    print(f"requests: {len(res)} valid during the attacks ({sum(1 for r in res if r[1])} half-closed), all equal to their answer alone; "
          f"{sum(st['attack'].bad_sent for st in rounds)} malformed or oversized ({d['requests_invalid_total']:.0f} counted invalid); "
          f"{cancelled:.0f} cancelled by disconnects; {d['requests_total']:.0f} taken = {d['requests_finished_total']:.0f} finished "
          f"+ {cancelled:.0f} cancelled + {d['requests_timed_out_total']:.0f} timed out")
    print(f"RSS: {rss_cold / 1024:.1f} MiB cold, {rss_warm / 1024:.1f} MiB warm; round 1: peak {rounds[0]['rss_peak'] / 1024:.1f}, "
          f"after {r1 / 1024:.1f} MiB; round 2: peak {rounds[1]['rss_peak'] / 1024:.1f}, after {r2 / 1024:.1f} MiB "
          f"({ROUND_S:.0f} s each)")

    # SIGTERM: a running stream finishes, new clients are refused, exit 0.
    body = json.dumps({"prompt": "drain", "max_tokens": 120, "stream": True, "ignore_eos": True}).encode()
    s = send_head(H, P, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
    raw = s.recv(4096)
    t_term = time.time()
    srv.p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        socket.create_connection((H, P), timeout=2).close()
        fail("a new connection was accepted while draining")
    except OSError:
        pass
    raw += read_to_end(s)
    s.close()
    st, _, b = parse_response(raw)
    try:
        n = outcome(st, b, True, False)[2]
        if n != 120:
            fail(f"drain: the running stream got {n} of 120 tokens")
    except AssertionError as e:
        fail(f"drain: the running stream was cut: {e}")
    code = srv.p.wait(timeout=25)
    if code != 0:
        fail(f"drain: exit status {code}, expected 0")
    print(f"SIGTERM: the running stream finished, new connections refused, exit status {code} after {time.time() - t_term:.2f} s")

    # A second signal exits at once.
    srv2 = Server(args.bin, ["--threads", str(args.threads), "--drain-timeout", "60"], args.fd_limit, tmp + ".2.log")
    body = json.dumps({"prompt": "long", "max_tokens": 4000, "stream": True, "ignore_eos": True}).encode()
    s = send_head(srv2.host, srv2.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
    s.recv(4096)
    srv2.p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    t2 = time.time()
    srv2.p.send_signal(signal.SIGTERM)
    try:
        code2 = srv2.p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        srv2.p.kill()
        code2 = None
    s.close()
    if code2 in (0, None):
        fail(f"second signal: exit status {code2}, expected non-zero at once")
    print(f"second SIGTERM during a drain: exit status {code2} after {time.time() - t2:.2f} s")

    if failures:
        print("FAILED:")
        for f in failures[:40]:
            print("  " + f)
        print(f"server logs: {tmp}.log, {tmp}.2.log")
        sys.exit(1)
    for p in (tmp + ".probe", tmp + ".probe.stop", tmp + ".log", tmp + ".2.log"):
        if os.path.exists(p):
            os.remove(p)
    print(f"all hostile-client checks passed in {time.time() - t_start:.1f} s")


if __name__ == "__main__":
    main()
