//! Refusals that stop retries, through a real Envoy: a budget configured
//! `refuse_with: 402` (or 403) answers that status with `x-should-retry:
//! false` and no `Retry-After`; a rate bucket's 429 keeps `Retry-After`;
//! and the real `openai` Python SDK (retrying twice, its default) tries
//! the 402 once and retries the 429 after its wait
//! (tests/clients/retry_signals.py).
//!
//! The SDK check runs where the clients are installed (`make test` sets
//! `SLUICE_REQUIRE_CLIENTS=1`); by hand without them it says so and skips.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`).

use std::time::Duration;

use serde_yaml::Value;
use sluice_tests::{clients_python, run_client_script, EnvoyConfig, Stack};

const MODEL: &str = "llama3.1:8b";

/// Three tiers: a day's token budget of 1 refusing with 402 (every call
/// is over it), the same with 403, and one request per 2 s.
fn tiers(cfg: &mut EnvoyConfig) {
    let policy = cfg.policy_mut();
    let tier = |text: &str| serde_yaml::from_str::<Value>(text).expect("yaml");
    policy["tiers"]["capped"] =
        tier("{requests: 100/min, daily_tokens: {limit: 1, refuse_with: 402}}");
    policy["tiers"]["denied"] =
        tier("{requests: 100/min, daily_tokens: {limit: 1, refuse_with: 403}}");
    policy["tiers"]["trickle"] = tier("{requests: 1/2s}");
    let keys = &mut policy["identity"]["api_key"]["keys"];
    for (key, tier) in [
        ("retry-capped-key", "capped"),
        ("retry-denied-key", "denied"),
        ("retry-trickle-key", "trickle"),
    ] {
        keys[key] = Value::from(tier);
    }
}

#[test]
fn a_budget_refusing_with_402_or_403_says_do_not_retry_and_a_429_says_when() {
    let stack = Stack::start(tiers);
    for (key, status) in [("retry-capped-key", 402), ("retry-denied-key", 403)] {
        let resp = stack.chat(MODEL, &[("x-api-key", key)]);
        assert_eq!(resp.status, status, "{resp:?}");
        assert_eq!(resp.header("x-should-retry"), Some("false"), "{resp:?}");
        assert_eq!(resp.header("retry-after"), None, "{resp:?}");
        assert_eq!(
            resp.header("x-sluice-reason"),
            Some("daily_budget_exceeded")
        );
        assert!(resp.header("x-ratelimit-reset").is_some(), "{resp:?}");
        let body = resp.json();
        assert_eq!(body["error"]["code"], "daily_budget_exceeded", "{body}");
        assert!(body["error"]["sluice"]["reset_at"].is_string(), "{body}");
    }
    let first = stack.chat(MODEL, &[("x-api-key", "retry-trickle-key")]);
    assert_eq!(first.status, 200, "{first:?}");
    let refused = stack.chat(MODEL, &[("x-api-key", "retry-trickle-key")]);
    assert_eq!(refused.status, 429, "{refused:?}");
    let wait: u64 = refused
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After on the 429: {refused:?}"));
    assert!((1..=2).contains(&wait), "{refused:?}");
    assert_eq!(refused.header("x-should-retry"), None, "{refused:?}");
    // The limits endpoint tells the caller ahead which status it would get.
    let limits = sluice_tests::get(
        &stack.envoy.url("/v1/sluice/limits"),
        &[("x-api-key", "retry-capped-key")],
    )
    .json();
    let budget = limits["limits"]
        .as_array()
        .and_then(|l| l.iter().find(|e| e["id"] == "tier/capped/daily_tokens"))
        .unwrap_or_else(|| panic!("{limits}"));
    assert_eq!(budget["refuse_with"], 402, "{limits}");
    assert_eq!(
        stack.upstream_requests(),
        1,
        "only the admitted call went up"
    );
}

#[test]
fn the_openai_sdk_tries_a_402_once_and_retries_a_429() {
    let Some(python) = clients_python(
        "the_openai_sdk_tries_a_402_once_and_retries_a_429",
        "openai",
    ) else {
        return;
    };
    let stack = Stack::start(tiers);
    let (finished, status, output) = run_client_script(
        &python,
        "retry_signals.py",
        &stack.envoy.url(""),
        Duration::from_secs(60),
    );
    assert!(
        finished,
        "retry_signals.py still running after 60 s:\n{output}"
    );
    assert!(
        status.success() && output.lines().any(|l| l == "ALL OK"),
        "retry_signals.py failed ({status}):\n{output}"
    );
    for check in ["budget_402_not_retried", "rate_429_retried"] {
        assert!(
            output
                .lines()
                .any(|l| l.starts_with(&format!("ok {check}"))),
            "{check} did not run:\n{output}"
        );
    }
    // Sluice counted what the SDK sent: one refusal by the 402 budget.
    let refused = stack.envoy.metric(
        "sluice_requests_total",
        &[("tier", "capped"), ("decision", "refuse")],
    );
    assert_eq!(refused, Some(1.0), "the SDK retried the 402:\n{output}");
}
