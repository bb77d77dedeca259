//! `Server-Timing: sluice;dur=<ms>` through a real Envoy: with
//! `request.server_timing: true`, an admitted answer (from the upstream), a
//! refusal and the limits endpoint (answered here) each carry a parseable
//! entry, and `sluice_decision_microseconds` counts them by decision; off
//! (the default), no answer carries one (that nothing is recorded then is
//! the core's test, `flow/timing.rs`). No assertion reads how long a
//! decision took: only that it is a number of milliseconds with its
//! microseconds.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`).

use std::time::Duration;

use sluice_tests::{get, prometheus_value, wait_for, Response, Stack};

const MODEL: &str = "llama3.1:8b";

/// The `dur` of sluice's `Server-Timing` entry, in ms; panics unless there
/// is exactly one, written `sluice;dur=<ms>.<µs: 3 digits>`.
fn sluice_dur(resp: &Response) -> f64 {
    let field = resp
        .header("server-timing")
        .unwrap_or_else(|| panic!("no Server-Timing in {resp:?}"));
    let ours: Vec<&str> = field
        .split(',')
        .map(str::trim)
        .filter(|e| e.starts_with("sluice;"))
        .collect();
    assert_eq!(ours.len(), 1, "`{field}`");
    let dur = ours[0]
        .strip_prefix("sluice;dur=")
        .unwrap_or_else(|| panic!("`{field}`"));
    let (whole, micros) = dur.split_once('.').unwrap_or_else(|| panic!("`{field}`"));
    assert!(
        !whole.is_empty() && whole.bytes().all(|b| b.is_ascii_digit()),
        "`{field}`"
    );
    assert!(
        micros.len() == 3 && micros.bytes().all(|b| b.is_ascii_digit()),
        "`{field}`"
    );
    dur.parse().unwrap_or_else(|_| panic!("`{field}`"))
}

#[test]
fn answers_carry_the_decision_time_when_on() {
    let stack = Stack::start(|cfg| {
        cfg.policy_mut()["request"]["server_timing"] = serde_yaml::Value::from(true);
    });
    let admitted = stack.chat(MODEL, &[("x-api-key", "demo-pro-key")]);
    assert_eq!(admitted.status, 200, "{admitted:?}");
    assert!(sluice_dur(&admitted) >= 0.0);
    let refused = stack.chat(MODEL, &[("x-api-key", "not-a-key")]);
    assert_eq!(refused.status, 401, "{refused:?}");
    assert!(sluice_dur(&refused) >= 0.0);
    let limits = get(
        &stack.envoy.url("/v1/sluice/limits"),
        &[("x-api-key", "demo-pro-key")],
    );
    assert_eq!(limits.status, 200, "{limits:?}");
    assert!(sluice_dur(&limits) >= 0.0);

    // Histograms reach /stats/prometheus at Envoy's next stats flush (5 s).
    let count = |text: &str, decision: &str| {
        prometheus_value(
            text,
            "sluice_decision_microseconds_count",
            &[("decision", decision)],
        )
    };
    let mut text = String::new();
    let flushed = wait_for(Duration::from_secs(12), || {
        text = stack.envoy.stats_prometheus();
        count(&text, "admit") == Some(2.0) && count(&text, "refuse") == Some(1.0)
    });
    assert!(
        flushed,
        "decision histogram:\n{}",
        text.lines()
            .filter(|l| l.starts_with("sluice_decision"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn off_by_default_no_answer_carries_it() {
    let stack = Stack::start(|_| {});
    let admitted = stack.chat(MODEL, &[("x-api-key", "demo-pro-key")]);
    assert_eq!(admitted.status, 200, "{admitted:?}");
    let refused = stack.chat(MODEL, &[("x-api-key", "not-a-key")]);
    assert_eq!(refused.status, 401, "{refused:?}");
    for resp in [admitted, refused] {
        assert_eq!(resp.header("server-timing"), None, "{resp:?}");
    }
}
