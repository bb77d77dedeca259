//! A caller's own limits (`GET /v1/sluice/limits`) through a real Envoy
//! with the shipped policy: answered by sluice (mock-llm never sees it),
//! under the caller's identity, charged as a request, its figures falling
//! after a real chat request, one caller's figures only; an unknown key
//! gets 401 and any other method 405.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`).

use serde_json::Value;
use sluice_tests::{get, post_json, request, Response, Stack};

const MODEL: &str = "llama3.1:8b";

fn limits(stack: &Stack, key: &str) -> Response {
    get(&stack.envoy.url("/v1/sluice/limits"), &[("x-api-key", key)])
}

fn entry<'a>(body: &'a Value, id: &str) -> &'a Value {
    body["limits"]
        .as_array()
        .and_then(|all| all.iter().find(|e| e["id"] == id))
        .unwrap_or_else(|| panic!("no `{id}` in {body}"))
}

fn remaining(body: &Value, id: &str) -> u64 {
    entry(body, id)["remaining"]
        .as_u64()
        .unwrap_or_else(|| panic!("`{id}` has no whole remaining: {body}"))
}

#[test]
fn remaining_falls_after_a_chat_request_and_a_second_caller_sees_only_its_own() {
    let stack = Stack::start(|_| {});
    let before = limits(&stack, "demo-pro-key");
    assert_eq!(before.status, 200, "{before:?}");
    assert_eq!(before.header("content-type"), Some("application/json"));
    assert_eq!(before.header("cache-control"), Some("no-store"));
    let before = before.json();
    assert_eq!(before["tier"], "pro", "{before}");
    assert_eq!(remaining(&before, "tier/pro/requests"), 59, "{before}");
    let tokens = entry(&before, "tier/pro/daily_tokens");
    assert_eq!(
        (&tokens["hard"], &tokens["kind"]),
        (&false.into(), &"daily".into())
    );
    assert!(tokens["reset_at"]
        .as_str()
        .is_some_and(|t| t.ends_with("T00:00:00Z")));
    assert!(tokens["reset_seconds"]
        .as_u64()
        .is_some_and(|s| s <= 86_400));
    assert!(before["models"]
        .as_array()
        .is_some_and(|m| m.contains(&MODEL.into())));
    assert_eq!(stack.upstream_requests(), 0, "the endpoint went upstream");

    let chat = stack.chat(MODEL, &[("x-api-key", "demo-pro-key")]);
    assert_eq!(chat.status, 200, "{chat:?}");
    let after = limits(&stack, "demo-pro-key").json();
    // The chat and the second read.
    assert_eq!(remaining(&after, "tier/pro/requests"), 57, "{after}");
    let used =
        remaining(&before, "tier/pro/daily_tokens") - remaining(&after, "tier/pro/daily_tokens");
    assert!(used > 0, "no tokens charged: {before} → {after}");
    assert!(
        remaining(&after, "model/llama3.1:8b/requests")
            < remaining(&before, "model/llama3.1:8b/requests")
    );
    assert_eq!(stack.upstream_requests(), 1);

    // Another caller of another tier: its own counts, nothing of pro's.
    let other = limits(&stack, "demo-enterprise-key").json();
    assert_eq!(other["tier"], "enterprise");
    assert_eq!(
        remaining(&other, "tier/enterprise/requests"),
        299,
        "{other}"
    );
    assert_eq!(
        remaining(&other, "tier/enterprise/daily_tokens"),
        500_000,
        "{other}"
    );
    let text = other.to_string();
    assert!(
        !text.contains("tier/pro") && !text.contains("demo-pro"),
        "{text}"
    );
    assert!(
        !text.contains("provider/"),
        "a provider budget is the operator's: {text}"
    );
    // A member of a team sees its team; the pro caller above did not.
    let member = limits(&stack, "demo-search-key-1").json();
    assert_eq!(
        (&member["team"], &member["org"]),
        (&"search".into(), &"demo".into())
    );
    assert_eq!(remaining(&member, "team/search/requests"), 14, "{member}");
    assert!(!before.to_string().contains("team/search"), "{before}");
}

#[test]
fn unknown_keys_other_methods_and_an_exhausted_bucket_are_refused_locally() {
    let stack = Stack::start(|_| {});
    let unknown = limits(&stack, "not-a-key");
    assert_eq!(unknown.status, 401, "{unknown:?}");
    assert_eq!(unknown.header("x-sluice-reason"), Some("unauthenticated"));

    for method in ["POST", "PUT", "DELETE"] {
        let resp = request(
            method,
            &stack.envoy.url("/v1/sluice/limits"),
            &[
                ("x-api-key", "demo-pro-key"),
                ("content-type", "application/json"),
            ],
            Some(b"{}".to_vec()),
        )
        .expect("answered");
        assert_eq!(resp.status, 405, "{method}: {resp:?}");
        assert_eq!(resp.header("allow"), Some("GET"), "{resp:?}");
        assert_eq!(resp.json()["error"]["code"], "method_not_allowed");
    }
    // The free tier's 10/min: the endpoint is a request like any other.
    for i in 0..10 {
        let resp = limits(&stack, "demo-free-key");
        assert_eq!(resp.status, 200, "read {i}: {resp:?}");
        let body = resp.json();
        assert_eq!(remaining(&body, "tier/free/requests"), 9 - i);
        // A declared key is outside its tier's anonymous total.
        assert!(!body.to_string().contains("anonymous"), "{body}");
    }
    // A caller without a key (its address): its own count, and the total
    // of all undeclared callers it is part of, shown as shared.
    let anonymous = get(&stack.envoy.url("/v1/sluice/limits"), &[]).json();
    assert_eq!(anonymous["declared_key"], false, "{anonymous}");
    assert_eq!(entry(&anonymous, "tier/free/requests")["scope"], "caller");
    assert_eq!(
        remaining(&anonymous, "tier/free/requests"),
        9,
        "{anonymous}"
    );
    let total = entry(&anonymous, "tier/free/anonymous/requests");
    assert_eq!(
        (&total["scope"], &total["limit"]),
        (&"shared".into(), &600.into())
    );
    let refused = limits(&stack, "demo-free-key");
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.header("x-sluice-reason"), Some("user_rate_limit"));
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    // So is a chat request now: the reads spent the bucket.
    let chat = stack.chat(MODEL, &[("x-api-key", "demo-free-key")]);
    assert_eq!(chat.status, 429, "{chat:?}");
    assert_eq!(
        stack.upstream_requests(),
        0,
        "nothing of this went upstream"
    );
    // Other paths are unchanged: the SDKs' calls go through.
    let models = get(
        &stack.envoy.url("/v1/models"),
        &[("x-api-key", "demo-pro-key")],
    );
    assert_eq!(models.status, 200, "{models:?}");
    let chat = post_json(
        &stack.envoy.url("/v1/chat/completions"),
        &[("x-api-key", "demo-pro-key")],
        &sluice_tests::chat_body(MODEL),
    );
    assert_eq!(chat.status, 200, "{chat:?}");
}
