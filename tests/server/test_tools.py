"""Tools, structured output and reasoning against samesum serve, with the
official `openai` Python client.

Usage: test_tools.py BASE_URL
Run on the built-in model (its synthetic template renders tools in Qwen3's
form) and on a model carrying the real Qwen3 chat template. The weights are
random, so tool calls are forced (tool_choice "required", constrained
sampling) and a grammar makes the model think first. Plain asserts; exits
non-zero on the first failure.
"""

import json
import sys

import openai

BASE = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused")
MSG = [{"role": "user", "content": "Tell me about mixture-of-experts models."}]
model = client.models.list().data[0].id


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")

# Tools: a full round trip. The built-in model's weights are random, so the
# call is forced (tool_choice "required", constrained sampling); the reply
# comes back as tool_calls, the call and its result go back as messages.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                   temperature=0.7, seed=11, max_tokens=120)
c = r.choices[0]
check("tools: finish_reason tool_calls", c.finish_reason == "tool_calls", c)
calls = c.message.tool_calls
check("tools: one call to get_weather", calls and len(calls) == 1 and calls[0].function.name == "get_weather", c.message)
args = json.loads(calls[0].function.arguments)
check("tools: arguments follow the schema", isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit") and set(args) == {"city", "unit"}, args)
# The same request streamed: the deltas add up to the same call.
name, arguments, finish = None, "", None
for ch in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                         temperature=0.7, seed=11, max_tokens=120, stream=True):
    if not ch.choices:
        continue
    d = ch.choices[0].delta
    for tc in d.tool_calls or []:
        name = tc.function.name or name
        arguments += tc.function.arguments or ""
    finish = ch.choices[0].finish_reason or finish
check("tools: streamed call equals the non-streamed one", (name, arguments, finish) == ("get_weather", calls[0].function.arguments, "tool_calls"), (name, arguments, finish))
# The call and its result go back; the model answers in text (tool_choice auto).
follow = ASK + [c.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"}]
r2 = client.chat.completions.create(model=model, messages=follow, tools=TOOLS, temperature=0, max_tokens=8)
check("tools: the round trip's second turn answers", r2.choices[0].finish_reason in ("stop", "length", "tool_calls") and r2.usage.prompt_tokens > r.usage.prompt_tokens, r2)
# A named function.
r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120)
check("tools: a named function is called", r.choices[0].message.tool_calls[0].function.name == "get_weather", r)

# Structured output: every reply parses and follows the schema.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "kind": {"enum": ["a", "b", "c"]},
    "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}},
    "required": ["name", "kind", "scores", "inner"], "additionalProperties": False}
for seed in range(5):
    r = client.chat.completions.create(model=model, messages=MSG, temperature=1.0 if seed else 0, seed=seed, max_tokens=200,
                                       response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    v = json.loads(r.choices[0].message.content)
    ok = (len(v["name"]) <= 10 and v["kind"] in "abc" and all(isinstance(x, int) for x in v["scores"])
          and len(v["scores"]) <= 3 and isinstance(v["inner"]["ok"], bool) and set(v) == set(SCHEMA["properties"]))
    check(f"structured output: seed {seed} parses and validates", ok and r.choices[0].finish_reason == "stop", v)
# Any object: the random model may write one long key until max_tokens
# runs out (finish "length"); one that ends ("stop") parses.
for seed in range(3):
    r = client.chat.completions.create(model=model, messages=MSG, temperature=1.0, seed=seed, max_tokens=300, response_format={"type": "json_object"})
    c = r.choices[0]
    ok = c.message.content.startswith("{") and (c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict))
    check(f"structured output: json_object, seed {seed} ({c.finish_reason})", ok, c)

# Reasoning: a grammar makes the model think first; the think block comes
# back as reasoning_content, apart from the answer, streamed or not.
THINK = {"grammar": 'start: "<think>\\n" /[a-z]{1,8}( [a-z]{1,8}){0,3}/ "\\n</think>\\n\\n" /[a-z]{1,8}( [a-z]{1,8}){0,2}/'}
r = client.chat.completions.create(model=model, messages=MSG, temperature=0.8, seed=3, max_tokens=80, extra_body=THINK)
m = r.choices[0].message
reasoning = (m.model_extra or {}).get("reasoning_content")
check("reasoning: reasoning_content apart from content", reasoning and m.content and "<think>" not in m.content and "<think>" not in reasoning, m)
parts, content = [], []
for ch in client.chat.completions.create(model=model, messages=MSG, temperature=0.8, seed=3, max_tokens=80, stream=True, extra_body=THINK):
    if ch.choices:
        d = ch.choices[0].delta
        parts.append((d.model_extra or {}).get("reasoning_content") or "")
        content.append(d.content or "")
check("reasoning: streamed deltas add up to the same fields", ("".join(parts), "".join(content)) == (reasoning, m.content), (parts, content))
r = client.chat.completions.create(model=model, messages=MSG, temperature=0.8, seed=3, max_tokens=80, extra_body={**THINK, "reasoning_format": "none"})
check("reasoning: reasoning_format none keeps the text", r.choices[0].message.content.startswith("<think>\n" + reasoning), r)
# chat_template_kwargs reach the template: thinking off adds an empty think block to the prompt.
on = client.chat.completions.create(model=model, messages=MSG, max_tokens=1)
off = client.chat.completions.create(model=model, messages=MSG, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
check("chat_template_kwargs: enable_thinking false renders the empty think block", off.usage.prompt_tokens > on.usage.prompt_tokens, (on.usage, off.usage))

print("all tools, structured-output and reasoning checks passed")
