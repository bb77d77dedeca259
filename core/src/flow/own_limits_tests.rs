//! A caller's own limits endpoint through the whole request path (mock
//! host): answered here, charged as a request, read without reserving,
//! one caller's figures only.

use serde_json::{json, Value};

use super::*;
use crate::host::mock::MockHost;

const T0: u64 = 1_700_000_000_000;

fn load(host: &MockHost, policy: Value) -> Poller {
    if let Err(e) = crate::policy::Policy::load(policy.clone()) {
        panic!("{e}");
    }
    let mut poller = Poller::new();
    assert!(poller.configure(host, policy.to_string().as_bytes()));
    poller
}

fn policy() -> Value {
    json!({
        "default_tier": "free",
        "identity": {"sources": ["api_key"], "api_key": {"header": "x-api-key", "keys": {
            "alice-key": {"tier": "pro", "team": "search", "org": "acme"},
            "bob-key": "pro",
            "carol-key": "free",
        }}},
        "tiers": {
            "free": {"requests": "3/min"},
            "pro": {"requests": "10/min", "daily_tokens": 5000,
                     "daily_spend": {"limit": 2.5, "mode": "soft"}},
        },
        "teams": {"search": {"requests": "100/min"}},
        "orgs": {"acme": {"daily_tokens": 100000}},
        "models": {"m": {"requests": "50/min", "price": {"input": "1", "output": "2"}}},
        "providers": {"p": {"route": "fallback", "speaks": ["openai"], "models": {"m": "gpt"},
                     "prices": {"gpt": {"input": "1", "output": "1"}}, "daily_spend": 5}},
        "ladder": ["p"],
    })
}

/// `method path` with `key` (if any), ending with its headers.
fn call(poller: &Poller, host: &MockHost, method: &str, path: &str, key: Option<&str>) -> Action {
    let mut headers = vec![(":method", method), (":path", path)];
    if let Some(key) = key {
        headers.push(("x-api-key", key));
    }
    host.replies.borrow_mut().clear();
    host.begin(&headers, b"");
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    let action = req.on_request_headers(host, true);
    req.on_log(host);
    action
}

/// The answer to `GET /v1/sluice/limits` as `key`: status and JSON.
fn limits(poller: &Poller, host: &MockHost, key: &str) -> (u32, Value) {
    assert_eq!(
        call(poller, host, "GET", "/v1/sluice/limits", Some(key)),
        Action::Pause,
        "answered here, never let through"
    );
    let reply = host.last_reply().expect("answered");
    let body = serde_json::from_slice(&reply.body).unwrap_or(Value::Null);
    (reply.status, body)
}

fn entry<'a>(body: &'a Value, id: &str) -> &'a Value {
    body["limits"]
        .as_array()
        .and_then(|all| all.iter().find(|e| e["id"] == id))
        .unwrap_or_else(|| panic!("no `{id}` in {body}"))
}

/// A chat request as `key` that the upstream answers with usage.
fn chat(poller: &Poller, host: &MockHost, key: &str, input: u64, output: u64) {
    let len = host.begin_chat(100, &[("x-api-key", key)]);
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    assert_eq!(req.on_request_body(host, len, true), Action::Continue);
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    assert_eq!(req.on_response_headers(host), Action::Continue);
    let answer = json!({"choices": [], "usage": {"prompt_tokens": input,
        "completion_tokens": output, "total_tokens": input + output}})
    .to_string();
    *host.response_body.borrow_mut() = answer.clone().into_bytes();
    req.on_response_body(host, answer.len(), true);
    req.on_log(host);
}

#[test]
fn a_caller_reads_every_limit_it_is_subject_to_and_nothing_else() {
    let host = MockHost::new(T0);
    let poller = load(&host, policy());
    let (status, body) = limits(&poller, &host, "alice-key");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "sluice.limits");
    assert_eq!(
        (&body["tier"], &body["team"], &body["org"]),
        (&json!("pro"), &json!("search"), &json!("acme"))
    );
    assert_eq!(body["models"], json!(["m"]));
    assert_eq!(body["unlisted_models"], false);
    let requests = entry(&body, "tier/pro/requests");
    // The read itself was a request.
    assert_eq!(
        (&requests["limit"], &requests["remaining"]),
        (&json!(10), &json!(9))
    );
    assert_eq!(
        (&requests["unit"], &requests["kind"], &requests["scope"]),
        (&json!("requests"), &json!("rate"), &json!("caller"))
    );
    assert_eq!(requests["hard"], true);
    assert!(requests["reset_seconds"].as_u64().is_some_and(|s| s <= 6));
    let spend = entry(&body, "tier/pro/daily_spend");
    assert_eq!(
        (&spend["unit"], &spend["limit"]),
        (&json!("currency"), &json!(2.5))
    );
    assert_eq!(
        (&spend["kind"], &spend["hard"]),
        (&json!("daily"), &json!(false))
    );
    // Midnight UTC after T0 (2023-11-14T22:13:20Z).
    assert_eq!(spend["reset_at"], "2023-11-15T00:00:00Z");
    assert_eq!(spend["reset_seconds"], 6400);
    for shared in [
        "team/search/requests",
        "org/acme/daily_tokens",
        "model/m/requests",
    ] {
        assert_eq!(entry(&body, shared)["scope"], "shared", "{shared}");
    }
    // A provider's budget is the operator's; another tier's is not hers.
    let text = body.to_string();
    assert!(!text.contains("provider/"), "{text}");
    assert!(!text.contains("tier/free"), "{text}");
    assert!(!text.contains("bob"), "{text}");
    // It counts as an admitted request.
    assert_eq!(
        host.metric("sluice_requests_total_decision=admit;.reason=none;.tier=pro;.model=none;"),
        Some(1)
    );
}

#[test]
fn remaining_falls_after_a_chat_request_and_reading_reserves_nothing() {
    let host = MockHost::new(T0);
    let poller = load(&host, policy());
    let (_, before) = limits(&poller, &host, "alice-key");
    let (_, again) = limits(&poller, &host, "alice-key");
    // Reading twice: one request each, no tokens held.
    assert_eq!(entry(&again, "tier/pro/requests")["remaining"], 8);
    for id in [
        "tier/pro/daily_tokens",
        "org/acme/daily_tokens",
        "tier/pro/daily_spend",
    ] {
        assert_eq!(
            entry(&before, id)["remaining"],
            entry(&again, id)["remaining"],
            "{id}"
        );
    }
    chat(&poller, &host, "alice-key", 40, 60);
    let (_, after) = limits(&poller, &host, "alice-key");
    assert_eq!(entry(&after, "tier/pro/requests")["remaining"], 6);
    assert_eq!(entry(&after, "tier/pro/daily_tokens")["remaining"], 4900);
    assert_eq!(entry(&after, "org/acme/daily_tokens")["remaining"], 99900);
    assert_eq!(entry(&after, "model/m/requests")["remaining"], 49);
    // 40 × 1 + 60 × 2 per million tokens.
    assert_eq!(entry(&after, "tier/pro/daily_spend")["remaining"], 2.49984);

    // Bob (same tier) sees his own count, untouched by Alice's, and
    // nothing of her team or org.
    let (_, bob) = limits(&poller, &host, "bob-key");
    assert_eq!(entry(&bob, "tier/pro/requests")["remaining"], 9);
    assert_eq!(entry(&bob, "tier/pro/daily_tokens")["remaining"], 5000);
    assert_eq!((&bob["team"], &bob["org"]), (&Value::Null, &Value::Null));
    let text = bob.to_string();
    assert!(!text.contains("search") && !text.contains("acme"), "{text}");
}

#[test]
fn the_endpoint_is_a_request_an_unknown_key_or_other_method_is_refused() {
    let host = MockHost::new(T0);
    let poller = load(&host, policy());
    for left in [2, 1, 0] {
        let (status, body) = limits(&poller, &host, "carol-key");
        assert_eq!(status, 200);
        assert_eq!(entry(&body, "tier/free/requests")["remaining"], left);
    }
    let (status, body) = limits(&poller, &host, "carol-key");
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "user_rate_limit");

    let (status, body) = limits(&poller, &host, "made-up-key");
    assert_eq!(status, 401, "{body}");

    for method in ["POST", "DELETE", "PUT", "HEAD"] {
        call(&poller, &host, method, "/v1/sluice/limits", Some("bob-key"));
        let reply = host.last_reply().expect("answered");
        assert_eq!(reply.status, 405, "{method}");
        assert_eq!(reply.header("allow"), Some("GET"));
        assert_eq!(reply.header("x-sluice-reason"), Some("method_not_allowed"));
        let body: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
    }
    // A 405 takes nothing: Bob still has all but his one read.
    let (_, bob) = limits(&poller, &host, "bob-key");
    assert_eq!(entry(&bob, "tier/pro/requests")["remaining"], 9);
}

#[test]
fn the_path_is_configurable_can_be_turned_off_and_is_checked() {
    let host = MockHost::new(T0);
    let mut p = policy();
    p["request"] = json!({"limits_path": "/me/limits"});
    let poller = load(&host, p.clone());
    assert_eq!(
        call(&poller, &host, "GET", "/me/limits?x=1", Some("bob-key")),
        Action::Pause
    );
    assert_eq!(host.last_reply().map(|r| r.status), Some(200));
    // The default path is an ordinary GET now: it goes on.
    assert_eq!(
        call(&poller, &host, "GET", "/v1/sluice/limits", Some("bob-key")),
        Action::Continue
    );
    p["request"] = json!({"limits_path": null});
    let poller = load(&host, p.clone());
    assert_eq!(
        call(&poller, &host, "GET", "/v1/sluice/limits", Some("bob-key")),
        Action::Continue
    );
    for (bad, why) in [
        ("/V1/Limits", "canonical"),
        ("v1/limits", "canonical"),
        ("/v1/limits/", "canonical"),
        ("/v1/chat/completions", "LLM API"),
    ] {
        p["request"] = json!({"limits_path": bad});
        let err = crate::policy::Policy::load(p.clone()).unwrap_err();
        assert_eq!(err.path, "request.limits_path", "{bad}: {err}");
        assert!(err.message.contains(why), "{bad}: {err}");
    }
    p["request"] = json!({});
    p["passthrough"] = json!([{"path": "/v1/sluice/limits", "requests": "1/min"}]);
    let err = crate::policy::Policy::load(p).unwrap_err();
    assert_eq!(err.path, "request.limits_path", "{err}");
}
