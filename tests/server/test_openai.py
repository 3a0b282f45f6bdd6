"""samesum serve against the official `openai` Python client.

Usage: test_openai.py BASE_URL   (e.g. http://127.0.0.1:8080)
Plain asserts; exits non-zero on the first failure.
"""

import http.client
import json
import sys
import time
import urllib.parse

import openai

BASE = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused")
MSG = [{"role": "user", "content": "Tell me about mixture-of-experts models."}]


def metric(name):
    u = urllib.parse.urlparse(BASE)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def post_json(path, body):
    u = urllib.parse.urlparse(BASE)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read().decode()
    if r.status != 200:
        raise AssertionError(f"POST {path}: {r.status} {data}")
    return json.loads(data)


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


models = client.models.list()
check("models list", len(models.data) == 1 and models.data[0].id, models)
model = models.data[0].id

# Non-streaming chat, usage counts.
r = client.chat.completions.create(model=model, messages=MSG, max_tokens=16, temperature=0)
c = r.choices[0]
check("chat: text", isinstance(c.message.content, str) and c.message.role == "assistant", r)
check("chat: usage", r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage)
check("chat: finish", c.finish_reason in ("length", "stop") and (c.finish_reason == "stop" or r.usage.completion_tokens == 16), c.finish_reason)

# Streaming chat gives the same text, then a finish reason.
parts, finish, usage = [], None, None
for ch in client.chat.completions.create(model=model, messages=MSG, max_tokens=16, temperature=0, stream=True):
    if ch.choices and ch.choices[0].delta.content:
        parts.append(ch.choices[0].delta.content)
    if ch.choices and ch.choices[0].finish_reason:
        finish = ch.choices[0].finish_reason
    if getattr(ch, "usage", None):
        usage = ch.usage
check("chat stream: same text as non-streamed", "".join(parts) == c.message.content, ("".join(parts), c.message.content))
check("chat stream: finish reason", finish == c.finish_reason, finish)
check("chat stream: usage in the last chunk", usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage)

# Completions, both ways.
r2 = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
check("completions: text and usage", isinstance(r2.choices[0].text, str) and r2.usage.completion_tokens <= 12, r2)
s2 = "".join(ch.choices[0].text for ch in client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True) if ch.choices)
check("completions stream: same text", s2 == r2.choices[0].text, (s2, r2.choices[0].text))

# Stop sequences: the text ends where the stop string starts.
base = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
stop = None
for i in range(5, len(base) - 3):
    cand = base[i : i + 2]
    if cand.strip() and base.find(cand) == i:
        stop = cand
        break
check("stop: a stop string found in the greedy text", stop is not None, repr(base))
rs = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
check("stop: text cut before the stop string", rs.choices[0].text == base[: base.find(stop)] and rs.choices[0].finish_reason == "stop", (rs.choices[0].text, base, stop))
rss = "".join(ch.choices[0].text for ch in client.completions.create(model=model, prompt="The quick brown fox", max_tokens=40, temperature=0, stop=[stop], stream=True, extra_body={"ignore_eos": True}) if ch.choices)
check("stop: streamed the same", rss == rs.choices[0].text, (rss, rs.choices[0].text))

# Log-probabilities.
rl = client.chat.completions.create(model=model, messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
lp = rl.choices[0].logprobs.content
check("logprobs: one per token, 3 alternatives, sorted", len(lp) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp) and all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in lp), lp)

# Seeds: the same seed and temperature give the same text.
a = client.chat.completions.create(model=model, messages=MSG, max_tokens=12, temperature=0.9, seed=7).choices[0].message.content
b = client.chat.completions.create(model=model, messages=MSG, max_tokens=12, temperature=0.9, seed=7).choices[0].message.content
check("seed: reproducible", a == b, (a, b))

# Content as an array of text parts reads as the joined text.
rp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], max_tokens=8, temperature=0)
rs_ = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
check("content parts: same as the string", rp.choices[0].message.content == rs_.choices[0].message.content and rp.usage == rs_.usage, (rp, rs_))
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], max_tokens=4)
    check("content parts: an image is refused", False, "no error")
except openai.BadRequestError as e:
    check("content parts: an image is a 400 naming its type", "image_url" in str(e), e)

# Fields that cannot change the result are accepted (and ignored).
rx = client.chat.completions.create(
    model=model, messages=MSG, max_tokens=16, temperature=0, n=1, user="u", store=False, metadata={"k": "v"},
    stream_options=None, logit_bias={}, extra_body={"parallel_tool_calls": False, "service_tier": "auto"},
)
check("ignored fields: same text", rx.choices[0].message.content == c.message.content, (rx.choices[0].message.content, c.message.content))

# logit_bias: -100 bans the greedy choice (on a prompt whose first greedy
# token is a whole token of its own text, found with /tokenize).
def first_text(prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"ignore_eos": True}, **kw).choices[0].text
found = None
for p in ["Once upon a time", "Hello", "The", "1 2 3", "a", "x y", "Why"]:
    t0 = first_text(p)
    ids = post_json("/tokenize", {"content": t0})["tokens"]
    if len(ids) == 1 and "\ufffd" not in t0:
        found = (p, t0, ids[0])
        break
check("tokenize: a greedy first token found by its text", found is not None)
check("logit_bias: -100 bans the greedy token", first_text(found[0], logit_bias={str(found[2]): -100}) != found[1], found)
check("detokenize: the token's text", post_json("/detokenize", {"tokens": [found[2]]})["content"] == found[1], found)

# Presence and frequency penalties: reproducible with a seed, and they change the tokens.
def penalized(**kw):
    return client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0.8, seed=11, extra_body={"ignore_eos": True}, **kw).choices[0].text
p0 = penalized()
p1 = penalized(presence_penalty=1.5, frequency_penalty=1.5)
check("penalties: reproducible", p1 == penalized(presence_penalty=1.5, frequency_penalty=1.5), p1)
check("penalties: change the tokens", p1 != p0, (p0, p1))

# The model object, and a 404 for another id.
m = client.models.retrieve(model)
check("models retrieve", m.id == model and m.object == "model", m)
try:
    client.models.retrieve("no-such-model")
    check("models retrieve: unknown id", False, "no error")
except openai.NotFoundError as e:
    check("models retrieve: unknown id is a 404", e.status_code == 404, e)

# Errors come back as OpenAI errors.
try:
    client.chat.completions.create(model=model, messages=MSG, max_tokens=-1)
    check("error: negative max_tokens", False, "no error")
except openai.BadRequestError as e:
    check("error: negative max_tokens is a 400 naming it", e.status_code == 400 and "max_tokens" in str(e), e)
try:
    client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])
    check("error: bad role", False, "no error")
except openai.BadRequestError as e:
    check("error: bad role is a 400", "wizard" in str(e), e)

# lm-evaluation-harness's loglikelihood request: token-array prompts,
# echo, logprobs, max_tokens 0; the prompt's log-probabilities come back,
# the first None.
ids = post_json("/tokenize", {"content": "The capital of France is Paris"})["tokens"]
r = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=1, temperature=0)
lp = r.choices[0].logprobs
check("echo: one choice per prompt", len(r.choices) == 2 and r.choices[1].index == 1, r)
check("echo: the prompt's tokens and log-probabilities", len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
      and all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:]) and r.choices[0].text == "The capital of France is Paris", lp)
check("echo: a prefix scores the same", r.choices[1].logprobs.token_logprobs == lp.token_logprobs[:3], r.choices[1].logprobs)

# Cancellation by disconnect, in the middle of a long stream: the client
# reads one chunk and closes the stream.
before = metric("samesum_requests_cancelled_total")
stream = client.completions.create(model=model, prompt="go", max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
first = next(iter(stream))
check("cancel: the stream started", first.choices and isinstance(first.choices[0].text, str), first)
stream.close()
deadline = time.time() + 20
while metric("samesum_requests_cancelled_total") < before + 1:
    if time.time() > deadline:
        raise AssertionError("cancel: the request was not cancelled after the client went away")
    time.sleep(0.05)
check("cancel: the server dropped the request", True)

# Still serving afterwards.
r3 = client.completions.create(model=model, prompt="ok", max_tokens=2, extra_body={"ignore_eos": True})
check("still serving", r3.usage.completion_tokens >= 1, r3)
print("all openai-client checks passed")
