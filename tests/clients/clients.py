"""Real client libraries against sluice in a real Envoy (driven by
tests/tests/clients.rs, which starts Envoy + mock-llm and passes the URL).

Each check prints one line `ok <name> <detail>`; the first failure raises,
which exits non-zero with the traceback. Keys (tiers of the shipped policy
plus the test's `trickle` tier, 1 request / 2 s) are given by the Rust side.
"""

import asyncio
import json
import sys
import time

import ollama
import openai

BASE = sys.argv[1]  # http://127.0.0.1:PORT
MODEL = "llama3.1:8b"
PRO_KEY = "demo-pro-key"
ENTERPRISE_KEY = "demo-enterprise-key"
TRICKLE_KEY = "clients-trickle-key"
MESSAGES = [{"role": "user", "content": "hello there"}]


def ok(name, detail=""):
    print(f"ok {name} {detail}".rstrip(), flush=True)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def client(key, **kw):
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=key, **kw)


def openai_sync():
    # The key travels as `Authorization: Bearer`, as in every OpenAI SDK.
    raw = client(PRO_KEY).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=7
    )
    check(raw.headers.get("x-ratelimit-limit") == "60", f"pro tier: {dict(raw.headers)}")
    resp = raw.parse()
    check(resp.choices[0].message.content, f"content: {resp}")
    check(resp.usage.completion_tokens == 7, f"usage: {resp.usage}")
    ok("openai_sync_chat", f"usage={resp.usage.total_tokens}")


def openai_refusals():
    try:
        client("not-a-key").chat.completions.create(model=MODEL, messages=MESSAGES)
        raise AssertionError("an unknown key was admitted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401 and e.code == "invalid_api_key", f"401: {e}")
        check("not-a-key" not in str(e.body), f"echoes the key: {e.body}")
    ok("openai_unknown_key", "AuthenticationError invalid_api_key")


async def openai_async():
    aclient = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key=ENTERPRISE_KEY, max_retries=0)
    results = await asyncio.gather(
        *[
            aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3 + i)
            for i in range(3)
        ]
    )
    for i, r in enumerate(results):
        check(r.usage.completion_tokens == 3 + i, f"async {i}: {r.usage}")
    # An async stream, without a usage chunk asked for: none arrives.
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True
    )
    chunks = [c async for c in stream]
    check(all(c.usage is None for c in chunks), f"unasked usage: {chunks[-1]}")
    check(sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 4, "4 tokens")
    await aclient.close()
    ok("openai_async_chat", "3 concurrent + 1 stream")


def openai_streams():
    c = client(ENTERPRISE_KEY)
    # No stream_options: sluice asks the upstream for usage (to settle the
    # reservation) but the client must not see a chunk it did not ask for.
    chunks = list(
        c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True)
    )
    check(chunks, "no chunks")
    check(all(ch.usage is None for ch in chunks), f"unasked usage chunk: {chunks[-1]}")
    check(all(ch.choices for ch in chunks), "a chunk without choices (the usage chunk)")
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    check(text, "no streamed text")
    ok("openai_stream_without_usage", f"{len(chunks)} chunks")

    # include_usage: exactly one usage chunk, last, with the real counts.
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [ch for ch in chunks if ch.usage is not None]
    check(len(usage) == 1, f"usage chunks: {len(usage)}")
    check(usage[0] is chunks[-1] and not usage[0].choices, "usage chunk is the last, choiceless")
    check(usage[0].usage.completion_tokens == 5, f"usage: {usage[0].usage}")
    ok("openai_stream_with_usage", f"completion_tokens={usage[0].usage.completion_tokens}")


def openai_retry_after():
    """The SDK's own retry on 429 honours sluice's Retry-After."""
    seen = []

    def record(response):
        seen.append((response.status_code, response.headers.get("retry-after")))

    http = openai.DefaultHttpxClient(event_hooks={"response": [record]})
    c = client(TRICKLE_KEY, max_retries=2, http_client=http)
    c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    check(seen == [(200, None)], f"first call: {seen}")
    # Without retries the SDK surfaces sluice's 429 as a RateLimitError.
    try:
        client(TRICKLE_KEY).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        raise AssertionError("the trickle tier admitted two calls at once")
    except openai.RateLimitError as e:
        check(e.code == "user_rate_limit", f"429 body: {e.body}")
    seen.clear()
    started = time.monotonic()
    resp = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    waited = time.monotonic() - started
    check(resp.usage.completion_tokens == 2, f"retried call: {resp}")
    check([s for s, _ in seen] == [429, 200], f"statuses: {seen}")
    retry_after = float(seen[0][1])
    check(1 <= retry_after <= 5, f"Retry-After: {seen}")
    # The SDK slept what Retry-After said (it adds no jitter to it).
    check(waited >= retry_after - 0.05, f"retried after {waited:.2f}s, Retry-After {retry_after}")
    http.close()
    ok("openai_retry_after", f"429 Retry-After {retry_after:g}s, success after {waited:.2f}s")


def ollama_client():
    o = ollama.Client(host=BASE, headers={"x-api-key": PRO_KEY})
    r = o.chat(model=MODEL, messages=MESSAGES, options={"num_predict": 6})
    check(r.message.content and r.done, f"chat: {r}")
    check(r.eval_count == 6 and r.prompt_eval_count, f"chat counts: {r}")
    parts = list(o.chat(model=MODEL, messages=MESSAGES, options={"num_predict": 4}, stream=True))
    check(parts[-1].done and parts[-1].eval_count == 4, f"chat stream end: {parts[-1]}")
    check(sum(1 for p in parts if p.message.content) == 4, f"chat stream: {len(parts)} parts")
    ok("ollama_chat", "plain + stream")

    g = o.generate(model=MODEL, prompt="hello", options={"num_predict": 5})
    check(g.response and g.done and g.eval_count == 5, f"generate: {g}")
    parts = list(o.generate(model=MODEL, prompt="hello", options={"num_predict": 3}, stream=True))
    check(parts[-1].done and parts[-1].eval_count == 3, f"generate stream end: {parts[-1]}")
    check("".join(p.response for p in parts), "generate stream text")
    ok("ollama_generate", "plain + stream")

    # A refusal reaches ollama's client as its ResponseError, status kept.
    try:
        ollama.Client(host=BASE, headers={"x-api-key": "not-a-key"}).chat(
            model=MODEL, messages=MESSAGES
        )
        raise AssertionError("an unknown key was admitted")
    except ollama.ResponseError as e:
        check(e.status_code == 401, f"ollama refusal: {e}")
    ok("ollama_refusal", "401")


def main():
    openai_sync()
    openai_refusals()
    asyncio.run(openai_async())
    openai_streams()
    openai_retry_after()
    ollama_client()
    print(json.dumps({"versions": {"openai": openai.__version__, "ollama": _ollama_version()}}))
    print("ALL OK", flush=True)


def _ollama_version():
    try:
        from importlib.metadata import version

        return version("ollama")
    except Exception:  # noqa: BLE001 - the version is only informative
        return "?"


if __name__ == "__main__":
    main()
