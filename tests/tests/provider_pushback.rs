//! A provider that says it has no requests left until a reset: the queue
//! waits for the reset instead of sending requests into its 429s, however
//! the provider spells it. Upstreams: mock-llm playing OpenAI
//! (`x-ratelimit-remaining-requests: 0`, `x-ratelimit-reset-requests: 1.5s`)
//! and Anthropic (`anthropic-ratelimit-requests-remaining: 0`,
//! `anthropic-ratelimit-requests-reset: <RFC 3339>`), each with a limit of
//! 3 requests per 1.5 s window (`--ratelimit-requests 3`).

use serde_json::{json, Value};
use sluice_tests::queue::{stack, MODEL};
use sluice_tests::{post_json, Personality, Response, Stack};

fn limited(p: Personality) -> Stack {
    let personality = p.to_string();
    stack(
        2,
        4,
        &[
            "--personality",
            &personality,
            "--ratelimit-requests",
            "3",
            "--ratelimit-window-ms",
            "1500",
        ],
    )
}

fn send(s: &Stack, p: Personality, user: &str) -> Response {
    let (path, body): (&str, Value) = match p {
        Personality::Anthropic => (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        _ => (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        ),
    };
    post_json(
        &s.envoy.url(path),
        &[("x-user", user), ("x-tier", "batch")],
        &body,
    )
}

/// Three requests spend the window; the fourth waits for its reset and is
/// served, and nothing the provider refused ever reached it.
fn waits_for_the_reset(p: Personality) {
    let s = limited(p);
    for i in 0..3 {
        let resp = send(&s, p, &format!("a{i}"));
        assert_eq!(resp.status, 200, "{p}: {resp:?}");
    }
    let fourth = send(&s, p, "b");
    assert_eq!(fourth.status, 200, "{p}: {fourth:?}");
    assert_eq!(
        s.upstream.stats()["requests_total"],
        4,
        "{p}: a request went into the provider's 429 ({})",
        s.upstream.stats()["by_path"]
    );
}

#[test]
fn openai_pushback_makes_the_queue_wait_for_the_reset() {
    waits_for_the_reset(Personality::Openai);
}

#[test]
fn anthropic_pushback_makes_the_queue_wait_for_the_reset() {
    waits_for_the_reset(Personality::Anthropic);
}
