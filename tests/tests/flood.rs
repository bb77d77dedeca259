//! A flood of new identities through a real Envoy (SPEC §8, issue 9 item
//! 7): it cannot take the capacity of a caller whose API key the policy
//! declares; a new caller who finds the per-caller table full gets a plain
//! 429 `capacity_exhausted` (counted), never a misleading budget refusal;
//! and a tier's `anonymous_total` bounds all undeclared callers together.
//!
//! Distinct identities come cheap from a header the test's policy trusts
//! (`x-test-user`), the way an auth filter in front of sluice would set it.

use serde_yaml::Value;
use sluice_tests::{get, Stack};

const DECLARED_KEY: &str = "flood-test-declared-key";

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).expect("test policy YAML")
}

/// Tier `free`: 10/hour per caller (a slot drains one request in 6 min, so
/// no slot frees while the flood runs, however slowly) and a daily budget,
/// 8 hashed slots. Tier
/// `capped`: 10/min per caller, but 5/min for all undeclared callers.
fn start() -> Stack {
    Stack::start(|cfg| {
        let policy = cfg.policy_mut();
        policy["identity"] = yaml(&format!(
            "sources: [api_key, trusted_header, client_address]
trusted_header: {{principal: x-test-user, tier: x-test-tier}}
api_key: {{header: x-api-key, keys: {{{DECLARED_KEY}: free}}}}"
        ));
        policy["tiers"] = yaml(
            "free: {requests: 10/hour, daily_tokens: 5000}
capped: {requests: 10/min, anonymous_total: {requests: 5/min}}",
        );
        policy["state"] = yaml("principal_slots: 8");
    })
}

fn models(stack: &Stack, headers: &[(&str, &str)]) -> sluice_tests::Response {
    get(&stack.envoy.url("/v1/models"), headers)
}

#[test]
fn a_flood_of_new_callers_takes_nothing_from_declared_ones() {
    let stack = start();
    // 100 new callers, one request each: 8 fit in the 8 slots, the rest
    // find every slot in use by a caller who has something in it.
    let mut admitted = 0;
    for i in 0..100 {
        let user = format!("flood-{i}");
        let resp = models(&stack, &[("x-test-user", &user)]);
        match resp.status {
            200 => admitted += 1,
            429 => assert_eq!(
                resp.header("x-sluice-reason"),
                Some("capacity_exhausted"),
                "{resp:?}"
            ),
            _ => panic!("flood call {i}: {resp:?}"),
        }
    }
    assert_eq!(admitted, 8, "one per slot");

    // The declared key has its own bucket: all of its 10, then its own 429.
    for i in 0..10 {
        let resp = models(&stack, &[("x-api-key", DECLARED_KEY)]);
        assert_eq!(resp.status, 200, "declared call {i}: {resp:?}");
    }
    let resp = models(&stack, &[("x-api-key", DECLARED_KEY)]);
    assert_eq!(resp.header("x-sluice-reason"), Some("user_rate_limit"));

    // A new caller: a clear 429 with a Retry-After (a slot drains one
    // request of 10/hour in 6 min), not `daily_budget_exceeded`.
    let resp = models(&stack, &[("x-test-user", "late-comer")]);
    assert_eq!(resp.status, 429, "{resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), Some("capacity_exhausted"));
    let retry: u64 = resp
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After: {resp:?}"));
    assert!((1..=360).contains(&retry), "{resp:?}");
    let body = resp.json();
    assert_eq!(body["error"]["code"], "capacity_exhausted", "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");

    let text = stack.envoy.stats_prometheus();
    let metric = |name, labels: &[(&str, &str)]| {
        sluice_tests::prometheus_value(&text, name, labels).unwrap_or(0.0)
    };
    assert_eq!(metric("sluice_capacity_exhausted_total", &[]), 93.0);
    assert_eq!(
        metric(
            "sluice_requests_total",
            &[("reason", "capacity_exhausted"), ("tier", "free")]
        ),
        93.0
    );
    assert_eq!(stack.upstream_requests(), 8 + 10);
}

#[test]
fn the_anonymous_total_bounds_undeclared_callers_together() {
    let stack = start();
    let statuses: Vec<(u16, Option<String>)> = (0..8)
        .map(|i| {
            let user = format!("anon-{i}");
            let resp = models(&stack, &[("x-test-user", &user), ("x-test-tier", "capped")]);
            (
                resp.status,
                resp.header("x-sluice-reason").map(String::from),
            )
        })
        .collect();
    let ok = statuses.iter().filter(|(s, _)| *s == 200).count();
    assert_eq!(ok, 5, "{statuses:?}");
    for (status, reason) in &statuses[5..] {
        assert_eq!(
            (*status, reason.as_deref()),
            (429, Some("anonymous_limit")),
            "{statuses:?}"
        );
    }
    assert_eq!(stack.upstream_requests(), 5);
}
