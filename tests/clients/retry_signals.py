"""Does the real OpenAI SDK retry what sluice says to retry, and only that?
(driven by tests/tests/retry_signals.rs, which starts Envoy + mock-llm with
the keys below and passes the URL).

A budget that refuses with 402 (`refuse_with: 402`, `x-should-retry:
false`, no Retry-After) is tried once, even with `max_retries=2`; a rate
bucket's 429 (Retry-After) is retried after the wait and then admitted.
Each check prints `ok <name> <detail>`; a failure raises (non-zero exit).
"""

import sys

import openai

BASE = sys.argv[1]
MODEL = "llama3.1:8b"
MESSAGES = [{"role": "user", "content": "hello there"}]


def ok(name, detail=""):
    print(f"ok {name} {detail}".rstrip(), flush=True)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def recording_client(key):
    """A client retrying twice (the SDK's default) that records every
    answer it gets, retries included."""
    seen = []

    def record(response):
        seen.append((response.status_code, response.headers.get("retry-after"),
                     response.headers.get("x-should-retry")))

    http = openai.DefaultHttpxClient(event_hooks={"response": [record]})
    c = openai.OpenAI(base_url=f"{BASE}/v1", api_key=key, max_retries=2, http_client=http)
    return c, seen


def budget_402_is_not_retried():
    c, seen = recording_client("retry-capped-key")
    try:
        c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        raise AssertionError("a spent budget admitted the call")
    except openai.APIStatusError as e:
        check(e.status_code == 402, f"status: {e.status_code} {e.body}")
        check(e.code == "daily_budget_exceeded", f"code: {e.body}")
    check(seen == [(402, None, "false")], f"attempts: {seen}")
    ok("budget_402_not_retried", f"attempts={len(seen)}")


def rate_429_is_retried():
    c, seen = recording_client("retry-trickle-key")
    c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    seen.clear()
    resp = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    check(resp.usage.completion_tokens == 2, f"retried call: {resp}")
    check([s for s, _, _ in seen] == [429, 200], f"attempts: {seen}")
    check(seen[0][1] is not None and seen[0][2] is None, f"429 headers: {seen}")
    ok("rate_429_retried", f"attempts={len(seen)}")


budget_402_is_not_retried()
rate_429_is_retried()
print("ALL OK", flush=True)
