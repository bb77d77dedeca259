//! A flood of new identities through a real Envoy (issue 9 item 7, issue
//! 29 item 2): it cannot take the capacity of a caller whose API key the
//! policy declares; a new caller who finds its probe window full draws on
//! the scope's shared overflow record, and once that is spent too gets a
//! plain 429 `capacity_exhausted` (counted), never a misleading budget
//! refusal; callers are placed under the deployment's hash key, so
//! identities an outsider computes to share a victim's window do not; and
//! a tier's `anonymous_total` bounds all undeclared callers together.
//!
//! Distinct identities come cheap from a header the test's policy trusts
//! (`x-test-user`), the way an auth filter in front of sluice would set it.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the per-caller
//! table is sluice's, whatever server answers.

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
    // 100 new callers, one request each: 8 fit in the 8 slots, 10 more in
    // the overflow record (its 10/hour shared by all of them), the rest
    // find every slot in use and the overflow spent.
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
    assert_eq!(admitted, 8 + 10, "one per slot, then the overflow's rate");

    // The declared key has its own bucket: all of its 10, then its own 429.
    for i in 0..10 {
        let resp = models(&stack, &[("x-api-key", DECLARED_KEY)]);
        assert_eq!(resp.status, 200, "declared call {i}: {resp:?}");
    }
    let resp = models(&stack, &[("x-api-key", DECLARED_KEY)]);
    assert_eq!(resp.header("x-sluice-reason"), Some("user_rate_limit"));

    // A new caller: a clear 429 with a Retry-After (the overflow refills
    // one request of 10/hour in 6 min), not `daily_budget_exceeded`.
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
    assert_eq!(metric("sluice_capacity_exhausted_total", &[]), 83.0);
    assert_eq!(
        metric(
            "sluice_requests_total",
            &[("reason", "capacity_exhausted"), ("tier", "free")]
        ),
        83.0
    );
    assert_eq!(stack.upstream_requests(), 18 + 10);
}

/// 64-bit FNV-1a: how sluice placed callers before its hashes were keyed,
/// which anyone could compute.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The attack of issue 29: eight identities computed to share a victim's
/// home slot took its whole probe window (renewable at eight requests an
/// hour), and the victim got `capacity_exhausted` for doing nothing.
#[test]
fn identities_computed_to_share_a_victims_window_do_not_take_it() {
    let stack = Stack::start(|cfg| {
        let policy = cfg.policy_mut();
        policy["identity"] = yaml(
            "sources: [trusted_header]
trusted_header: {principal: x-test-user}",
        );
        policy["tiers"] = yaml("free: {requests: 10/hour, daily_tokens: 5000}");
        policy["state"] = yaml("principal_slots: 64");
    });
    let home = |user: &str| fnv1a(format!("header:{user}").as_bytes()) % 64;
    let victim = "victim";
    let attackers: Vec<String> = (0..)
        .map(|i| format!("attacker-{i}"))
        .filter(|a| home(a) == home(victim))
        .take(8)
        .collect();
    for a in &attackers {
        let resp = models(&stack, &[("x-test-user", a)]);
        assert_eq!(resp.status, 200, "{a}: {resp:?}");
    }
    // Placed under a key the attacker does not have, the eight landed
    // where chance put them; the victim is served, all of its 10/hour.
    for i in 0..10 {
        let resp = models(&stack, &[("x-test-user", victim)]);
        assert_eq!(resp.status, 200, "victim call {i}: {resp:?}");
    }
    let resp = models(&stack, &[("x-test-user", victim)]);
    assert_eq!(resp.header("x-sluice-reason"), Some("user_rate_limit"));
    let text = stack.envoy.stats_prometheus();
    let exhausted = sluice_tests::prometheus_value(&text, "sluice_capacity_exhausted_total", &[]);
    assert_eq!(
        exhausted.unwrap_or(0.0),
        0.0,
        "nobody was refused for a slot"
    );
    // The key's source is logged, never the key.
    let log = stack.envoy.log();
    assert!(log.contains("hash key: generated for this Envoy"), "{log}");
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
