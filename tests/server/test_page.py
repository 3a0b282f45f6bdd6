"""The chat page at / in a real headless Chromium, against a running server.

Usage: test_page.py BASE_URL API_KEY
  (a server started with --api-key API_KEY and a context of 16,384 tokens or
  more, so that a reply can run long enough to be stopped)

Drives Debian's Chromium through chromedriver (CHROMIUM and CHROMEDRIVER
override /usr/bin/chromium and /usr/bin/chromedriver) with Selenium:
- without a key the page shows the server's 401 message and keeps the text;
- with the key (kept in localStorage across a reload) a greedy reply streamed
  into the page equals the same request's non-streamed `content`, turn after
  turn (the page keeps the conversation);
- "More fields" must be a JSON object (else an error, nothing sent);
- Stop ends a long generation (ignore_eos through "More fields") (the server cancels it), keeps the partial
  reply, and the page serves the next message.
Plain asserts; exits non-zero on the first failure.
"""

import http.client
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.parse

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

BASE = sys.argv[1].rstrip("/")
KEY = sys.argv[2]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def api(method, path, body=None):
    u = urllib.parse.urlparse(BASE)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    headers = {"Authorization": "Bearer " + KEY}
    if body is not None:
        headers["Content-Type"] = "application/json"
    c.request(method, path, None if body is None else json.dumps(body), headers)
    r = c.getresponse()
    data = r.read().decode()
    assert r.status == 200, f"{method} {path}: {r.status} {data}"
    return data


def metric(name):
    for line in api("GET", "/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def direct(messages, top_p):
    """The reply the API gives the page's settings, not streamed."""
    body = {"messages": messages, "temperature": 0, "top_p": top_p, "max_tokens": 16, "seed": 1}
    r = json.loads(api("POST", "/v1/chat/completions", body))
    return r["choices"][0]["message"]["content"]


def browser(profile):
    opts = webdriver.ChromeOptions()
    opts.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    for f in FLAGS:
        opts.add_argument(f)
    opts.add_argument("--user-data-dir=" + profile)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver"))
    return webdriver.Chrome(service=service, options=opts)


def main():
    profile = tempfile.mkdtemp(prefix="samesum-chromium-")
    d = browser(profile)
    try:
        run(d)
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)
    print("chat page: all checks passed")


def field(d, id_, value):
    el = d.find_element(By.ID, id_)
    el.clear()
    if value != "":
        el.send_keys(value)
    assert el.get_property("value") == value, (id_, el.get_property("value"), value)


def replies(d):
    return d.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def send(d, text):
    """Type a message, click Send; the new reply's element."""
    before = len(replies(d))
    d.find_element(By.ID, "input").send_keys(text)
    d.find_element(By.ID, "send").click()
    WebDriverWait(d, 10).until(lambda _: len(replies(d)) == before + 1)
    return replies(d)[-1]


def finished(d, msg, timeout=120):
    WebDriverWait(d, timeout).until(lambda _: msg.get_attribute("data-state") != "streaming")
    return msg.get_attribute("data-state")


def text(d, msg):
    return d.execute_script("return arguments[0].querySelector('.text').textContent", msg)


def note(d, msg):
    return d.execute_script("return arguments[0].querySelector('.note').textContent", msg)


def run(d):
    d.get(BASE + "/")
    assert d.title == "samesum chat", d.title
    top_p = float(d.find_element(By.ID, "top_p").get_property("value"))
    field(d, "temperature", "0")
    field(d, "max_tokens", "16")
    field(d, "seed", "1")

    # No key: the server's error object's message is shown, the text is kept
    # for a retry, and the turn is not part of the conversation.
    m = send(d, "Hello there")
    assert finished(d, m) == "error", m.get_attribute("data-state")
    assert "API key" in note(d, m) and "401" in note(d, m), note(d, m)
    assert d.find_element(By.ID, "input").get_property("value") == "Hello there"
    assert not d.find_element(By.ID, "send").get_property("disabled")
    print("no key: the page shows", repr(note(d, m)))

    # The key is kept in localStorage: set it, reload, and it is still there.
    field(d, "apikey", KEY)
    d.find_element(By.ID, "system").click()  # blur: the change event stores it
    stored = d.execute_script("return localStorage.getItem('samesum.apiKey')")
    assert stored == KEY, stored
    d.refresh()
    assert d.find_element(By.ID, "apikey").get_property("value") == KEY
    WebDriverWait(d, 10).until(lambda _: d.find_element(By.ID, "model").text != "")
    print("model shown:", d.find_element(By.ID, "model").text)
    field(d, "temperature", "0")
    field(d, "max_tokens", "16")
    field(d, "seed", "1")

    # Greedy replies streamed into the page equal the API's, turn by turn.
    conversation = []
    for turn in ["Hello there", "Tell me more about experts.", "And the router?"]:
        m = send(d, turn)
        state = finished(d, m)
        assert state == "done", (state, note(d, m))
        got = text(d, m)
        conversation.append({"role": "user", "content": turn})
        want = direct(conversation, top_p)
        assert got == want, f"turn {len(conversation) // 2 + 1}: page {got!r} != API {want!r}"
        assert want != "", "the model said nothing: the comparison shows nothing"
        conversation.append({"role": "assistant", "content": want})
        print(f"turn {len(conversation) // 2}: page == API ({len(got)} chars, {note(d, m)})")

    # Stop: a long generation ends at once, the server cancels it, and the
    # page keeps working.
    field(d, "extra", "[1]")
    m = send(d, "Write a very long story.")
    assert finished(d, m) == "error" and "JSON object" in note(d, m), note(d, m)
    d.find_element(By.ID, "input").clear()
    cancelled = metric("samesum_requests_cancelled_total")
    field(d, "max_tokens", "")
    field(d, "extra", '{"ignore_eos": true, "temperature": 1}')
    m = send(d, "Write a very long story.")
    WebDriverWait(d, 60).until(lambda _: len(text(d, m)) >= 20)
    assert m.get_attribute("data-state") == "streaming"
    assert not d.find_element(By.ID, "stop").get_property("disabled")
    d.find_element(By.ID, "stop").click()
    assert finished(d, m, timeout=5) == "stopped", note(d, m)
    partial = text(d, m)
    time.sleep(0.5)
    assert text(d, m) == partial, "the reply grew after Stop"
    deadline = time.time() + 15
    while metric("samesum_requests_cancelled_total") <= cancelled:
        assert time.time() < deadline, "the server did not cancel the stopped request"
        time.sleep(0.1)
    assert d.find_element(By.ID, "stop").get_property("disabled")
    print(f"stop: the stream ended after {len(partial)} chars; the server cancelled it")
    field(d, "max_tokens", "16")
    field(d, "extra", "")
    m = send(d, "Short one now.")
    assert finished(d, m) == "done", note(d, m)
    assert text(d, m) != ""

    # New chat forgets the conversation: the first turn again gives the first reply.
    d.find_element(By.ID, "new").click()
    assert replies(d) == []
    m = send(d, "Hello there")
    assert finished(d, m) == "done", note(d, m)
    assert text(d, m) == conversation[1]["content"]
    print("after Stop the page serves the next message; New chat starts over")

    bad = [e["message"] for e in d.get_log("browser") if "Content Security Policy" in e["message"]]
    assert not bad, bad


if __name__ == "__main__":
    main()
