//! The policy as operators give it (docs/src/design.md, "Policy"): a bad policy is
//! refused with its field path at start and at reload (the last good one keeps
//! serving), a reload keeps the live counts, and the JSON-string form works like the
//! native YAML one.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the policy is
//! read and reloaded before any server is involved.

use serde_json::json;
use serde_yaml::Value;
use sluice_tests::{bin_path, shipped_config_for, Envoy, MockLlm, Stack};

const MODEL: &str = "llama3.1:8b";

/// Sends `n` anonymous chat calls and returns their statuses.
fn statuses(stack: &Stack, n: usize) -> Vec<u16> {
    (0..n).map(|_| stack.chat(MODEL, &[]).status).collect()
}

#[test]
fn unknown_policy_field_stops_envoy_at_start_naming_the_field() {
    let upstream = MockLlm::start("primary");
    let mut cfg = shipped_config_for(&upstream);
    cfg.policy_mut()["tiers"]["free"]["requets"] = Value::from("5/min");
    let log = match Envoy::try_start(&cfg, 1) {
        Ok(envoy) => panic!(
            "Envoy started with a policy field that does not exist:\n{}",
            envoy.log()
        ),
        Err(log) => log,
    };
    assert!(log.contains("tiers.free.requets"), "{log}");
    assert_eq!(
        upstream.stats()["requests_total"],
        0,
        "{}",
        upstream.stats()
    );
}

#[test]
fn bad_policy_on_reload_is_rejected_and_the_old_one_keeps_serving() {
    let stack = Stack::start(|cfg| {
        cfg.policy_mut()["tiers"]["free"]["requests"] = Value::from("3/day");
    });
    assert_eq!(statuses(&stack, 2), [200, 200]);

    let mut bad = stack.config.clone();
    bad.policy_mut()["tiers"]["free"]["requets"] = Value::from("100/day");
    let err = stack
        .envoy
        .reload(&bad)
        .expect_err("Envoy accepted a policy with an unknown field");
    assert!(err.contains("tiers.free.requets"), "{err}");

    // The old policy, with its count, still decides.
    assert_eq!(statuses(&stack, 2), [200, 429]);
    let resp = stack.chat(MODEL, &[]);
    assert_eq!(resp.header("x-ratelimit-limit"), Some("3"), "{resp:?}");
    assert_eq!(stack.upstream_requests(), 3);
}

#[test]
fn reload_with_a_new_limit_keeps_the_count() {
    let stack = Stack::start(|cfg| {
        cfg.policy_mut()["tiers"]["free"]["requests"] = Value::from("10/day");
    });
    let before = statuses(&stack, 11);
    assert_eq!(before[..10], [200; 10]);
    assert_eq!(before[10], 429);

    let mut raised = stack.config.clone();
    raised.policy_mut()["tiers"]["free"]["requests"] = Value::from("12/day");
    stack.envoy.reload(&raised).expect("reload accepted");

    // 10 of 12 are already used: exactly two more, then 429 again.
    let after: Vec<_> = (0..3).map(|_| stack.chat(MODEL, &[])).collect();
    let codes: Vec<u16> = after.iter().map(|r| r.status).collect();
    assert_eq!(codes, [200, 200, 429], "{after:?}");
    assert_eq!(after[0].header("x-ratelimit-limit"), Some("12"));
    assert_eq!(after[0].header("x-ratelimit-remaining"), Some("1"));
    assert_eq!(after[2].header("x-ratelimit-limit"), Some("12"));
    assert_eq!(stack.upstream_requests(), 12);
}

#[test]
fn policy_as_a_json_string_works_like_the_struct_form() {
    let stack = Stack::start(|cfg| {
        let policy = json!({
            "default_tier": "free",
            "identity": {"sources": ["client_address"]},
            "tiers": {"free": {"requests": "3/day"}},
            "models": {MODEL: {"requests": "100/day"}},
            "request": {"max_body_bytes": "64KiB"},
        });
        cfg.set_policy_json_string(policy.to_string());
    });
    let answers: Vec<_> = (0..4).map(|_| stack.chat(MODEL, &[])).collect();
    let codes: Vec<u16> = answers.iter().map(|r| r.status).collect();
    assert_eq!(codes, [200, 200, 200, 429], "{answers:?}");
    assert_eq!(answers[0].header("x-ratelimit-limit"), Some("3"));
    assert_eq!(answers[2].header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        answers[3].header("x-sluice-reason"),
        Some("user_rate_limit")
    );
    assert_eq!(stack.upstream_requests(), 3);

    // A broken JSON string is refused at start like a broken Struct.
    let upstream = MockLlm::start("other");
    let mut cfg = shipped_config_for(&upstream);
    cfg.set_policy_json_string(
        json!({"default_tier": "free", "tiers": {"free": {"requets": "3/day"}}}).to_string(),
    );
    let log = match Envoy::try_start(&cfg, 1) {
        Ok(envoy) => panic!("Envoy started with a bad JSON policy:\n{}", envoy.log()),
        Err(log) => log,
    };
    assert!(log.contains("tiers.free.requets"), "{log}");
}

/// A rate of zero once passed every check and trapped the VM (a division by
/// zero in the bucket math) at the first request. Now it is refused at
/// start and at reload with its field path, and `check-config` says so.
#[test]
fn a_zero_rate_is_refused_at_load_with_its_path() {
    let upstream = MockLlm::start("primary");
    let mut cfg = shipped_config_for(&upstream);
    cfg.policy_mut()["tiers"]["free"]["requests"] = Value::from("0/min");
    let log = match Envoy::try_start(&cfg, 1) {
        Ok(envoy) => panic!("Envoy started with `requests: 0/min`:\n{}", envoy.log()),
        Err(log) => log,
    };
    assert!(log.contains("tiers.free.requests"), "{log}");
    assert!(log.contains("at least 1"), "{log}");

    // Offline, before Envoy sees it: the same path. Siblings too.
    let dir = tempfile::Builder::new()
        .prefix("sluice-zero-rate-")
        .tempdir()
        .expect("temp dir");
    let sibling = |edit: &dyn Fn(&mut Value)| {
        let mut policy = shipped_config_for(&upstream);
        edit(policy.policy_mut());
        let file = dir.path().join("policy.yaml");
        let text = serde_yaml::to_string(policy.policy_mut()).expect("yaml");
        std::fs::write(&file, text).expect("policy file");
        let out = std::process::Command::new(bin_path("sluice-sidecar"))
            .arg("check-config")
            .arg(&file)
            .output()
            .expect("running check-config");
        assert!(!out.status.success(), "check-config accepted it");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = sibling(&|p| p["tiers"]["free"]["requests"] = Value::from("0/min"));
    assert!(err.contains("tiers.free.requests"), "{err}");
    let err = sibling(&|p| p["models"][MODEL]["tokens"] = Value::from("0 tokens/min"));
    assert!(err.contains(&format!("models.{MODEL}.tokens")), "{err}");
    let err = sibling(&|p| {
        p["tiers"]["free"]["requests"] =
            serde_yaml::from_str("{rate: 5/min, burst: 0}").expect("yaml")
    });
    assert!(err.contains("burst"), "{err}");

    // At reload: refused, and the running policy keeps serving.
    let stack = Stack::start(|_| {});
    let mut bad = stack.config.clone();
    bad.policy_mut()["models"][MODEL]["requests"] = Value::from("0/min");
    let err = stack
        .envoy
        .reload(&bad)
        .expect_err("Envoy accepted `requests: 0/min` on reload");
    assert!(err.contains(&format!("models.{MODEL}.requests")), "{err}");
    assert_eq!(statuses(&stack, 2), [200, 200]);
}
