"""Real clients parse cache hits (driven by tests/tests/cache.rs, which
starts Envoy + sidecar + mock-llm and passes the URL). Each check primes
the cache with one call, waits (with a deadline) until the same call is a
hit, then parses hits with the client: OpenAI sync, async, streaming with
and without `stream_options.include_usage`; Ollama chat and generate,
streaming and not. Prints `ok <name>` per check and `ALL OK` at the end.
"""

import asyncio
import sys
import time

import ollama
import openai

BASE = sys.argv[1]
KEY = "demo-pro-key"
MODEL = "llama3.1:8b"


def ok(name, detail=""):
    print(f"ok {name} {detail}".rstrip(), flush=True)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def client():
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0)


def until_hit(call, what):
    deadline = time.monotonic() + 15
    while True:
        raw = call()
        if raw.headers.get("x-sluice-cache") == "hit":
            return raw
        check(time.monotonic() < deadline, f"{what}: never a hit")
        time.sleep(0.1)


def messages(q):
    return [{"role": "user", "content": q}]


def openai_checks():
    c = client()
    q = messages("cached for the SDK")
    first = c.chat.completions.create(model=MODEL, messages=q, max_tokens=6, temperature=0)
    raw = until_hit(
        lambda: c.chat.completions.with_raw_response.create(
            model=MODEL, messages=q, max_tokens=6, temperature=0
        ),
        "openai sync",
    )
    hit = raw.parse()
    check(hit.choices[0].message.content == first.choices[0].message.content, f"{hit} vs {first}")
    check(hit.usage.completion_tokens == first.usage.completion_tokens, f"usage {hit.usage}")
    ok("openai_sync_hit", hit.choices[0].message.content)

    chunks = list(
        c.chat.completions.create(model=MODEL, messages=q, max_tokens=6, temperature=0, stream=True)
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(text == first.choices[0].message.content, f"stream text {text!r}")
    check(all(ch.usage is None for ch in chunks), "no usage chunk unless asked")
    ok("openai_stream_hit", f"{len(chunks)} chunks")

    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=q, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    check(len(usage) == 1 and usage[0].completion_tokens == first.usage.completion_tokens, f"{usage}")
    ok("openai_stream_usage_hit", f"usage={usage[0].total_tokens}")

    async def run():
        a = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0)
        raw = await a.chat.completions.with_raw_response.create(
            model=MODEL, messages=q, max_tokens=6, temperature=0
        )
        check(raw.headers.get("x-sluice-cache") == "hit", f"async: {dict(raw.headers)}")
        r = raw.parse()
        check(r.choices[0].message.content == first.choices[0].message.content, f"async {r}")
        await a.close()

    asyncio.run(run())
    ok("openai_async_hit")


def ollama_checks():
    o = ollama.Client(host=BASE, headers={"x-api-key": KEY})
    msgs = messages("cached for ollama")
    first = o.chat(model=MODEL, messages=msgs, stream=False, options={"num_predict": 5, "temperature": 0})
    deadline = time.monotonic() + 15
    while True:
        # The Ollama client hides headers: a hit is the two-line stream the
        # cache renders (mock-llm streams one line per token).
        parts = list(o.chat(model=MODEL, messages=msgs, stream=True, options={"num_predict": 5, "temperature": 0}))
        if len(parts) == 2:
            break
        check(time.monotonic() < deadline, f"ollama chat never a hit: {parts}")
        time.sleep(0.1)
    text = "".join(p["message"]["content"] for p in parts)
    check(text == first["message"]["content"], f"ollama stream {text!r}")
    check(parts[-1]["done"] is True and parts[-1]["eval_count"] == first["eval_count"], f"{parts[-1]}")
    again = o.chat(model=MODEL, messages=msgs, stream=False, options={"num_predict": 5, "temperature": 0})
    check(again["message"]["content"] == first["message"]["content"], f"{again}")
    ok("ollama_chat_hit", f"{len(parts)} parts")

    g = o.generate(model=MODEL, prompt="cached generate", stream=False, options={"num_predict": 4, "temperature": 0})
    deadline = time.monotonic() + 15
    while True:
        parts = list(o.generate(model=MODEL, prompt="cached generate", stream=True, options={"num_predict": 4, "temperature": 0}))
        text = "".join(p["response"] for p in parts)
        if text == g["response"] and len(parts) == 2:
            break
        check(time.monotonic() < deadline, f"ollama generate never a hit: {parts}")
        time.sleep(0.1)
    ok("ollama_generate_hit")


openai_checks()
ollama_checks()
print("ALL OK", flush=True)
