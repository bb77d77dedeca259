//! A budget's `refuse_with` through the whole request path (mock host):
//! its refusal answers 402 with `x-should-retry: false` and no
//! `Retry-After`; a rate bucket of the same tier still answers 429 with it.

use serde_json::{json, Value};

use super::*;
use crate::host::mock::MockHost;

const T0: u64 = 1_700_000_000_000;

fn chat_reply(poller: &Poller, host: &MockHost, max_tokens: u64) -> Option<u32> {
    let len = host.begin_chat(max_tokens, &[]);
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    req.on_request_headers(host, false);
    req.on_request_body(host, len, true);
    host.last_reply().map(|r| r.status)
}

#[test]
fn a_budget_refuses_with_its_status_and_a_rate_bucket_with_429() {
    let host = MockHost::new(T0);
    let policy: Value = json!({
        "default_tier": "t",
        "tiers": {"t": {"requests": "2/min",
                        "daily_tokens": {"limit": 100, "refuse_with": 402}}},
    });
    let mut poller = Poller::new();
    assert!(poller.configure(&host, policy.to_string().as_bytes()));
    // Far over the day's budget: refused by it, not lowered (16+ left).
    assert_eq!(
        chat_reply(&poller, &host, 5_000),
        None,
        "lowered and admitted"
    );
    host.advance(1);
    let status = chat_reply(&poller, &host, 5_000);
    let reply = host.last_reply().expect("refused");
    assert_eq!(status, Some(402), "{reply:?}");
    assert_eq!(reply.header("x-should-retry"), Some("false"));
    assert_eq!(reply.header("retry-after"), None);
    assert_eq!(
        reply.header("x-sluice-reason"),
        Some("daily_budget_exceeded")
    );
    assert_eq!(
        host.metric("sluice_requests_total_decision=refuse;.reason=daily_budget_exceeded;.tier=t;.model=other;"),
        Some(1)
    );
    // With the tier's request bucket spent first, that bucket answers: a
    // rate refilling soon is a 429 with Retry-After.
    let host = MockHost::new(T0);
    let mut policy = policy;
    policy["tiers"]["t"]["requests"] = json!("1/min");
    let mut poller = Poller::new();
    assert!(poller.configure(&host, policy.to_string().as_bytes()));
    assert_eq!(chat_reply(&poller, &host, 10), None);
    assert_eq!(chat_reply(&poller, &host, 10), Some(429));
    let reply = host.last_reply().expect("refused");
    assert_eq!(reply.header("x-sluice-reason"), Some("user_rate_limit"));
    assert!(reply.header("retry-after").is_some());
    assert_eq!(reply.header("x-should-retry"), None);
}
