//! One caller cannot pause, break or probe-block a model route for the
//! others (docs/src/design.md, "Route", "Guarantees"; issue 9 item 8), against a real
//! Envoy: mock-llm answers 5xx or 429 with `Retry-After` on the requests that ask
//! for it (`x-mock-status`, `x-mock-retry-after`), and callers are told apart by
//! the shipped policy's demo API keys (passed through to the upstream).
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`), whose knobs
//! inject the 5xx and 429s; the servers' own pushback shapes are
//! provider_pushback.rs'.

use std::time::{Duration, Instant};

use serde_yaml::Value;
use sluice_tests::{chat_body, client_builder, wait_for, EnvoyConfig, Response, Stack};

const MODEL: &str = "llama3.1:8b";
const OTHER_MODEL: &str = "mistral:7b";
const FREE: &str = "demo-free-key";
const PRO: &str = "demo-pro-key";
const ENTERPRISE: &str = "demo-enterprise-key";

/// The shipped policy with limits no test reaches (the free tier excepted
/// where a test says), a 1 s breaker cooldown and no pause jitter. Each
/// answer of the upstream reaches sluice and the caller as it came: no
/// Envoy retry, no failover, no rung while the route is out, and the
/// breaker's default of two callers (these tests read each mechanism
/// alone; tests/tests/provider_faults.rs runs them together as shipped).
fn policy(cfg: &mut EnvoyConfig) {
    sluice_tests::without_retries(cfg);
    let p = cfg.policy_mut();
    sluice_tests::without_failover(p);
    p["ladder_when_out"] = Value::from(false);
    p["protection"]["min_callers"] = Value::from(2);
    p["protection"]["pause_without_retry_after"] = Value::from("0s");
    let unlimited = || serde_yaml::from_str::<Value>("{requests: 100000/min}").expect("yaml");
    for tier in ["free", "pro", "enterprise"] {
        p["tiers"][tier] = unlimited();
    }
    for model in [MODEL, OTHER_MODEL] {
        p["models"][model]["requests"] = Value::from("100000/min");
    }
    p["protection"]["cooldown"] = Value::from("1s");
    p["protection"]["pause_jitter"] = Value::from("0s");
}

/// A chat request for `model` with caller `key`, and mock-llm knobs.
fn chat(stack: &Stack, model: &str, key: &str, knobs: &[(&str, &str)]) -> Response {
    let mut headers = vec![("x-api-key", key)];
    headers.extend_from_slice(knobs);
    stack.chat(model, &headers)
}

const FAIL: [(&str, &str); 1] = [("x-mock-status", "500")];

fn assert_served(r: &Response) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-mock-name"), Some("primary"), "{r:?}");
}

fn assert_failed_upstream(r: &Response, status: u16) {
    assert_eq!(r.status, status, "{r:?}");
    assert_eq!(r.header("x-mock-name"), Some("primary"), "{r:?}");
}

/// A 503 from sluice with `code`; returns its `Retry-After` seconds.
fn assert_refused(r: &Response, code: &str) -> u64 {
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.header("x-sluice-reason"), Some(code), "{r:?}");
    assert!(
        r.header("x-mock-name").is_none(),
        "came from upstream: {r:?}"
    );
    let body = r.json();
    assert_eq!(body["error"]["code"], code, "{body}");
    let retry_after: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After: {r:?}"));
    assert_eq!(body["error"]["sluice"]["retry_after_seconds"], retry_after);
    retry_after
}

#[test]
fn one_callers_5xx_do_not_open_the_breaker_but_two_callers_do() {
    let stack = Stack::start(policy);
    // Caller A makes its own requests fail, many times in a row.
    for _ in 0..5 {
        assert_failed_upstream(&chat(&stack, MODEL, FREE, &FAIL), 500);
    }
    // Everyone, A included, is still served.
    assert_served(&chat(&stack, MODEL, PRO, &[]));
    assert_served(&chat(&stack, MODEL, FREE, &[]));

    // Failures from two callers in a row are the upstream's: it opens.
    for key in [FREE, PRO, FREE] {
        assert_failed_upstream(&chat(&stack, MODEL, key, &FAIL), 500);
    }
    let reached = stack.upstream_requests();
    assert_refused(&chat(&stack, MODEL, ENTERPRISE, &[]), "upstream_unhealthy");
    assert_eq!(stack.upstream_requests(), reached);
    assert_served(&chat(&stack, OTHER_MODEL, ENTERPRISE, &[]));
}

#[test]
fn a_429_on_one_key_pauses_that_key_only_and_for_at_most_max_pause() {
    let stack = Stack::start(|cfg| {
        policy(cfg);
        // mistral's upstream sees Envoy's one credential: its 429 is
        // about everyone.
        cfg.policy_mut()["models"][OTHER_MODEL]["credentials"] = Value::from("injected");
    });
    let limited = [("x-mock-status", "429"), ("x-mock-retry-after", "3600")];
    let r = chat(&stack, MODEL, FREE, &limited);
    assert_failed_upstream(&r, 429);
    assert_eq!(r.header("retry-after"), Some("3600"), "{r:?}");
    let reached = stack.upstream_requests();

    // A is paused, for the policy's 5 minutes at most, not an hour.
    let retry_after = assert_refused(&chat(&stack, MODEL, FREE, &[]), "upstream_paused");
    assert!((295..=300).contains(&retry_after), "{retry_after}");
    assert_eq!(
        stack.upstream_requests(),
        reached,
        "a paused request got through"
    );
    // Others on the route, and A on another route, are served.
    assert_served(&chat(&stack, MODEL, PRO, &[]));
    assert_served(&chat(&stack, MODEL, ENTERPRISE, &[]));
    assert_served(&chat(&stack, OTHER_MODEL, FREE, &[]));
    let paused = |kind: &str| {
        stack
            .envoy
            .metric("sluice_upstream_pauses_total", &[("kind", kind)])
            .unwrap_or(0.0)
    };
    assert_eq!(paused("credential"), 1.0);

    // With an injected credential the 429 pauses the whole route.
    let r = chat(
        &stack,
        OTHER_MODEL,
        PRO,
        &[("x-mock-status", "429"), ("x-mock-retry-after", "30")],
    );
    assert_failed_upstream(&r, 429);
    let retry_after = assert_refused(
        &chat(&stack, OTHER_MODEL, ENTERPRISE, &[]),
        "upstream_paused",
    );
    assert!((28..=30).contains(&retry_after), "{retry_after}");
    assert_eq!(paused("route"), 1.0);
    assert_served(&chat(&stack, MODEL, ENTERPRISE, &[]));
}

#[test]
fn unlisted_models_do_not_share_a_breaker() {
    // The demo policy serves only its models: this one opts in to others.
    let stack = Stack::start(|cfg| {
        policy(cfg);
        cfg.policy_mut()["unlisted_models"] =
            serde_yaml::from_str("{price: {input: 0, output: 0}}").expect("YAML");
    });
    let first = "made-up-model-a";
    for key in [FREE, PRO, FREE] {
        assert_failed_upstream(&chat(&stack, first, key, &FAIL), 500);
    }
    assert_refused(&chat(&stack, first, ENTERPRISE, &[]), "upstream_unhealthy");
    // Unlisted names land in one of 64 slots placed by this Envoy's
    // generated hash key, which a test cannot know: another name shares
    // `first`'s breaker with chance 1/64. Of five other names, one sharing
    // it is refused as `first` is; the first in another slot is served
    // (all five sharing it: a chance of 1 in 64^5).
    let mut served = false;
    for name in (0..5).map(|i| format!("made-up-model-{i}")) {
        let r = chat(&stack, &name, ENTERPRISE, &[]);
        if r.status == 200 {
            assert_served(&r);
            served = true;
            break;
        }
        assert_refused(&r, "upstream_unhealthy");
    }
    assert!(served, "five unlisted names all shared one breaker");
}

/// Opens `MODEL`'s breaker with failures of two callers and waits out the
/// 1 s cooldown.
fn open_and_cool_down(stack: &Stack) {
    for key in [PRO, ENTERPRISE, PRO] {
        assert_failed_upstream(&chat(stack, MODEL, key, &FAIL), 500);
    }
    assert_refused(&chat(stack, MODEL, ENTERPRISE, &[]), "upstream_unhealthy");
    // Waits out a configured duration, not a condition: any request sent
    // meanwhile could become the probe this test is about.
    std::thread::sleep(Duration::from_millis(1100));
}

#[test]
fn a_rate_limited_caller_does_not_claim_the_probe() {
    let stack = Stack::start(|cfg| {
        policy(cfg);
        cfg.policy_mut()["tiers"]["free"]["requests"] = Value::from("1/min");
    });
    assert_served(&chat(&stack, MODEL, FREE, &[])); // the free caller's one
    open_and_cool_down(&stack);
    // The free caller is refused by its own limit, holding nothing.
    let r = chat(&stack, MODEL, FREE, &[]);
    assert_eq!(
        (r.status, r.header("x-sluice-reason")),
        (429, Some("user_rate_limit")),
        "{r:?}"
    );
    // So the next caller's request is the probe, and it closes the breaker.
    let reached = stack.upstream_requests();
    assert_served(&chat(&stack, MODEL, PRO, &[]));
    assert_eq!(stack.upstream_requests(), reached + 1);
    assert_served(&chat(&stack, MODEL, ENTERPRISE, &[]));
}

#[test]
fn one_caller_failing_probes_or_leaving_cannot_keep_the_route_shut() {
    let stack = Stack::start(policy);
    open_and_cool_down(&stack);
    // The free caller takes the probe and fails it: it waits a cooldown,
    // the breaker does not reopen for everyone.
    assert_failed_upstream(&chat(&stack, MODEL, FREE, &FAIL), 500);
    assert_refused(&chat(&stack, MODEL, FREE, &[]), "upstream_unhealthy");
    // The next caller probes; the upstream is fine, the route closes.
    assert_served(&chat(&stack, MODEL, PRO, &[]));
    assert_served(&chat(&stack, MODEL, FREE, &[]));

    // Probes failed by two callers do reopen it, for twice as long.
    open_and_cool_down(&stack);
    assert_failed_upstream(&chat(&stack, MODEL, FREE, &FAIL), 500);
    assert_failed_upstream(&chat(&stack, MODEL, PRO, &FAIL), 500);
    let r = chat(&stack, MODEL, ENTERPRISE, &[]);
    assert_eq!(assert_refused(&r, "upstream_unhealthy"), 2, "{r:?}");

    // A probe whose client leaves before the answer is given back at once
    // (not held for its 30 s lease).
    assert!(wait_for(Duration::from_secs(5), || {
        // Past the doubled cooldown a probe may go.
        chat(&stack, MODEL, FREE, &FAIL).status == 500
    }));
    // That probe failed from the free caller only: still half-open. The
    // pro caller's probe is slow and its client gives up.
    let impatient = client_builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("client");
    let left = impatient
        .post(stack.envoy.url("/v1/chat/completions"))
        .header("x-api-key", PRO)
        .header("x-mock-latency-ms", "3000")
        .json(&chat_body(MODEL))
        .send();
    assert!(left.is_err(), "the client was meant to give up: {left:?}");
    let since = Instant::now();
    assert!(
        wait_for(Duration::from_secs(2), || chat(
            &stack,
            MODEL,
            ENTERPRISE,
            &[]
        )
        .status
            == 200),
        "the abandoned probe still holds the route"
    );
    assert!(since.elapsed() < Duration::from_secs(2));
    assert_served(&chat(&stack, MODEL, FREE, &[]));
}

#[test]
fn an_http_date_retry_after_is_capped_too() {
    let stack = Stack::start(|cfg| {
        policy(cfg);
        cfg.policy_mut()["protection"]["max_pause"] = Value::from("2s");
    });
    // A date far ahead (an hour and more, whatever the clock says).
    let far = [
        ("x-mock-status", "429"),
        ("x-mock-retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"),
    ];
    assert_failed_upstream(&chat(&stack, MODEL, FREE, &far), 429);
    let paused_at = Instant::now();
    assert!(assert_refused(&chat(&stack, MODEL, FREE, &[]), "upstream_paused") <= 2);
    assert!(
        wait_for(Duration::from_secs(4), || chat(&stack, MODEL, FREE, &[])
            .status
            == 200),
        "the pause outlived max_pause"
    );
    assert!(paused_at.elapsed() < Duration::from_secs(3));
}
