//! `check-config` accepts and refuses `passthrough` rules as the filter
//! does when Envoy loads the policy (it runs the filter's own parser).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use sluice_sidecar::check_config::check;

const BASE: &str = "default_tier: free\ntiers: {free: {requests: 10/min}}\nmodels: {whisper: {}}\n";

#[test]
fn passthrough_rules_are_checked_like_envoy_loads_them() {
    let ok = format!(
        "{BASE}passthrough:\n  - {{path: /v1/audio/transcriptions, requests: 10/min, model: whisper}}\n  - {{prefix: /v1/images, methods: [POST, PUT], requests: 5/min}}\n"
    );
    check(&ok).expect("valid rules");
    for (rules, field) in [
        (
            "[{path: /v1/chat/completions, requests: 1/min}]",
            "passthrough[0].path",
        ),
        ("[{prefix: /, requests: 1/min}]", "passthrough[0].prefix"),
        (
            "[{path: /x, requests: 1/min, model: nope}]",
            "passthrough[0].model",
        ),
        ("[{path: /x}]", "passthrough[0]"),
        (
            "[{path: /x, requests: 1/min, methods: [\"GET X\"]}]",
            "passthrough[0].methods[0]",
        ),
    ] {
        let err = check(&format!("{BASE}passthrough: {rules}\n")).expect_err(rules);
        assert!(err.contains(field), "{rules}: {err}");
    }
}
