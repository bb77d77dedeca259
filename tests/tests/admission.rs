//! Admission against a real Envoy (docs/src/design.md, "Admit", "What the client sees"):
//! per-caller and per-model buckets, the 429 contract, isolation between principals,
//! exactness when every worker thread races for one bucket, and the decision metric.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): buckets, the
//! 429 contract and the decision metric are sluice's, whatever server answers.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value as Json;
use serde_yaml::Value;
use sluice_tests::{async_client, chat_body, post_json_async, runtime, Response, Stack};

const SMALL: &str = "llama3.1:8b";
const BIG: &str = "llama3.1:70b";

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

fn int_header(resp: &Response, name: &str) -> u64 {
    let value = resp
        .header(name)
        .unwrap_or_else(|| panic!("no `{name}` header in {resp:?}"));
    value
        .parse()
        .unwrap_or_else(|_| panic!("`{name}: {value}` is not an integer"))
}

/// The 429 contract (docs/src/design.md, "What the client sees"), for a bucket of `limit`.
fn assert_429_contract(resp: &Response, reason: &str, limit: u64, tier: &str) {
    assert_eq!(resp.status, 429, "{resp:?}");
    let retry_after = int_header(resp, "retry-after");
    assert!(retry_after >= 1, "Retry-After {retry_after}");
    assert_eq!(int_header(resp, "x-ratelimit-limit"), limit, "{resp:?}");
    assert_eq!(int_header(resp, "x-ratelimit-remaining"), 0, "{resp:?}");
    int_header(resp, "x-ratelimit-reset");
    assert_eq!(resp.header("x-sluice-reason"), Some(reason), "{resp:?}");
    assert!(
        resp.header("content-type")
            .is_some_and(|v| v.starts_with("application/json")),
        "{resp:?}"
    );

    let body = resp.json();
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(error["type"], "rate_limit_exceeded", "{body}");
    assert_eq!(error["code"], reason, "{body}");
    assert!(error.get("param").is_some_and(Json::is_null), "{body}");
    let sluice = &error["sluice"];
    assert_eq!(sluice["limit"], limit, "{body}");
    assert_eq!(sluice["remaining"], 0, "{body}");
    assert_eq!(sluice["retry_after_seconds"], retry_after, "{body}");
    assert_eq!(sluice["tier"], tier, "{body}");
    assert!(
        sluice["bucket"].as_str().is_some_and(|b| !b.is_empty()),
        "{body}"
    );
    let reset_at = sluice["reset_at"].as_str().unwrap_or_default();
    let reset = sluice_tests::parse_rfc3339_utc(reset_at)
        .unwrap_or_else(|| panic!("reset_at {reset_at:?} is not RFC 3339 UTC: {body}"));
    let now = now_secs();
    assert!(
        reset + 2 >= now && reset <= now + retry_after + 2,
        "reset_at {reset_at} is not about now + {retry_after} s (now {now})"
    );
}

/// The demo policy's free tier (10/min) from an anonymous caller: 12 calls
/// at once, returned in order.
fn twelve_anonymous_calls(stack: &Stack) -> Vec<Response> {
    (0..12).map(|_| stack.chat(SMALL, &[])).collect()
}

#[test]
fn free_tier_admits_exactly_ten_and_refuses_with_the_full_contract() {
    let stack = Stack::start(|_| {});
    let answers = twelve_anonymous_calls(&stack);

    for (i, resp) in answers[..10].iter().enumerate() {
        assert_eq!(resp.status, 200, "call {i}: {resp:?}");
        assert_eq!(resp.header("x-mock-name"), Some("primary"), "{resp:?}");
        // The tightest bucket is the caller's (10/min), not the model's (200/min).
        assert_eq!(int_header(resp, "x-ratelimit-limit"), 10, "call {i}");
        assert_eq!(
            int_header(resp, "x-ratelimit-remaining"),
            9 - i as u64,
            "call {i}: {resp:?}"
        );
        int_header(resp, "x-ratelimit-reset");
    }
    for resp in &answers[10..] {
        assert_429_contract(resp, "user_rate_limit", 10, "free");
    }
    assert_eq!(stack.upstream_requests(), 10, "{}", stack.upstream.stats());
}

#[test]
fn decision_metric_counts_admits_and_refusals_with_labels() {
    let stack = Stack::start(|_| {});
    let statuses: Vec<u16> = twelve_anonymous_calls(&stack)
        .iter()
        .map(|r| r.status)
        .collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 10);

    let text = stack.envoy.stats_prometheus();
    let count = |decision, reason| {
        sluice_tests::prometheus_value(
            &text,
            "sluice_requests_total",
            &[
                ("decision", decision),
                ("reason", reason),
                ("tier", "free"),
                ("model", SMALL),
            ],
        )
    };
    assert_eq!(count("admit", "none"), Some(10.0), "{text}");
    assert_eq!(count("refuse", "user_rate_limit"), Some(2.0), "{text}");
    // Nothing else was counted.
    assert_eq!(
        sluice_tests::prometheus_value(&text, "sluice_requests_total", &[]),
        Some(12.0),
        "{text}"
    );
}

#[test]
fn model_limit_is_global_and_independent_of_the_caller_limit() {
    let stack = Stack::start(|_| {});
    let pro = [("x-api-key", "demo-pro-key")];
    let enterprise = [("x-api-key", "demo-enterprise-key")];

    for i in 0..5u64 {
        let resp = stack.chat(BIG, &pro);
        assert_eq!(resp.status, 200, "70b call {i}: {resp:?}");
        // The model's 5/min is tighter than pro's 60/min.
        assert_eq!(int_header(&resp, "x-ratelimit-limit"), 5);
        assert_eq!(int_header(&resp, "x-ratelimit-remaining"), 4 - i);
    }
    let refused = stack.chat(BIG, &pro);
    assert_429_contract(&refused, "model_rate_limit", 5, "pro");

    // The same caller still has its own budget on another model…
    let resp = stack.chat(SMALL, &pro);
    assert_eq!(resp.status, 200, "{resp:?}");
    // …and the refused 70b call gave back what it took from it: 6 of 60 used.
    assert_eq!(int_header(&resp, "x-ratelimit-limit"), 60, "{resp:?}");
    assert_eq!(int_header(&resp, "x-ratelimit-remaining"), 54, "{resp:?}");

    // The model bucket is one for everybody.
    let refused = stack.chat(BIG, &enterprise);
    assert_429_contract(&refused, "model_rate_limit", 5, "enterprise");
    let resp = stack.chat(SMALL, &enterprise);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(int_header(&resp, "x-ratelimit-limit"), 200, "{resp:?}");

    assert_eq!(stack.upstream_requests(), 7);
}

#[test]
fn principals_have_separate_buckets() {
    let stack = Stack::start(|_| {});
    let key = [("x-api-key", "demo-free-key")];
    let keyed: Vec<u16> = (0..11).map(|_| stack.chat(SMALL, &key).status).collect();
    assert_eq!(keyed[..10], [200; 10]);
    assert_eq!(keyed[10], 429);

    // The anonymous caller (the same client address) still has all of its own.
    for i in 0..10u64 {
        let resp = stack.chat(SMALL, &[]);
        assert_eq!(resp.status, 200, "anonymous call {i}: {resp:?}");
        assert_eq!(int_header(&resp, "x-ratelimit-remaining"), 9 - i);
    }
    let resp = stack.chat(SMALL, &[]);
    assert_429_contract(&resp, "user_rate_limit", 10, "free");
    assert_eq!(stack.upstream_requests(), 20);
}

/// Per-worker listener stats: how many downstream connections each Envoy
/// worker accepted.
fn connections_per_worker(stack: &Stack, workers: u32) -> Vec<u64> {
    let addr = stack.envoy.addr();
    let listener = format!("listener.{}_{}", addr.ip(), addr.port());
    (0..workers)
        .map(|w| {
            stack
                .envoy
                .counter_value(&format!("{listener}.worker_{w}.downstream_cx_total"))
                .unwrap_or(0)
        })
        .collect()
}

#[test]
fn one_bucket_stays_exact_under_concurrent_workers() {
    const WORKERS: u32 = 4;
    const CALLS: usize = 200;
    let stack = Stack::start_with(WORKERS, |cfg| {
        // A bucket of 50 that refills one request every ~29 minutes.
        cfg.policy_mut()["tiers"]["free"]["requests"] = Value::from("50/day");
    });

    let url = stack.envoy.url("/v1/chat/completions");
    let statuses = runtime().block_on(async {
        let calls: Vec<_> = (0..CALLS)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    // A client per call: a connection per call, which the
                    // kernel spreads over Envoy's workers.
                    let client = async_client();
                    post_json_async(&client, &url, &[], &chat_body(SMALL)).await
                })
            })
            .collect();
        let mut statuses = Vec::with_capacity(CALLS);
        for call in calls {
            statuses.push(call.await.expect("task").expect("request").status);
        }
        statuses
    });

    let admitted = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    let cas_retries = stack
        .envoy
        .metric("sluice_cas_retries_total", &[])
        .unwrap_or(0.0);
    let per_worker = connections_per_worker(&stack, WORKERS);
    println!(
        "admitted {admitted}, refused {refused}, sluice_cas_retries_total {cas_retries}, \
         connections per worker {per_worker:?}"
    );
    assert_eq!((admitted, refused), (50, CALLS - 50), "{statuses:?}");
    assert_eq!(stack.upstream_requests(), 50);
    assert!(
        per_worker.iter().filter(|n| **n > 0).count() >= 2,
        "the load did not spread over Envoy's workers: {per_worker:?}"
    );
}
