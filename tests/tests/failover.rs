//! The failover chain of envoy/failover.yaml (docs/src/design.md, "Route"): primary →
//! secondary (Envoy priorities and retries) → static answer (sluice's error
//! breaker with `static_fallback.when_primary_out`), and back.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`) on every hop:
//! priorities, retries and the breaker are Envoy's and sluice's.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_yaml::Value;
use sluice_tests::{
    bin_path, post_json, repo_root, wait_for, ChildGuard, Envoy, EnvoyConfig, MockLlm, Response,
};

fn endpoint(addr: SocketAddr) -> Value {
    serde_yaml::from_str(&format!(
        "socket_address: {{ address: \"{}\", port_value: {} }}",
        addr.ip(),
        addr.port()
    ))
    .expect("endpoint yaml")
}

/// envoy/failover.yaml with the primary and secondary at these addresses,
/// no sidecar, and a short error-breaker cooldown.
fn config(primary: SocketAddr, secondary: SocketAddr) -> EnvoyConfig {
    let mut cfg = EnvoyConfig::load(&repo_root().join("envoy/failover.yaml"));
    let endpoints = &mut cfg.cluster_mut("llm_upstream")["load_assignment"]["endpoints"];
    endpoints[0]["lb_endpoints"][0]["endpoint"]["address"] = endpoint(primary);
    endpoints[1]["lb_endpoints"][0]["endpoint"]["address"] = endpoint(secondary);
    // Nothing listens here (a port held closed, not one that might be in
    // use): the sidecar is out of this test.
    cfg.set_cluster_addr("sluice_sidecar", sluice_tests::closed_addr());
    cfg.set_cluster_addr("llm_fallback", sluice_tests::closed_addr());
    cfg.policy_mut()["protection"]["cooldown"] = Value::from("1s");
    cfg
}

fn ask(envoy: &Envoy, prompt: &str) -> Response {
    ask_as(envoy, "demo-enterprise-key", prompt)
}

fn ask_as(envoy: &Envoy, key: &str, prompt: &str) -> Response {
    let body = serde_json::json!({"model": "llama3.1:8b", "messages": [{"role": "user", "content": prompt}]});
    post_json(
        &envoy.url("/v1/chat/completions"),
        &[("x-api-key", key)],
        &body,
    )
}

fn served_by(r: &Response) -> Option<&str> {
    r.header("x-mock-name")
}

#[test]
fn primary_then_secondary_then_static_then_back() {
    let mut primary = MockLlm::start("primary");
    let secondary = MockLlm::start("secondary");
    let envoy = Envoy::start(&config(primary.addr(), secondary.addr()), 2);

    let r = ask(&envoy, "hello");
    assert_eq!((r.status, served_by(&r)), (200, Some("primary")), "{r:?}");

    // The primary dies: Envoy retries on the secondary; clients see 200s.
    primary.process().kill();
    for _ in 0..5 {
        let r = ask(&envoy, "hello");
        assert_eq!((r.status, served_by(&r)), (200, Some("secondary")), "{r:?}");
    }

    // Both out: after a few 503s (seen by two callers: one caller's
    // failures alone never open it) sluice's error breaker opens and
    // clients get the static answer, OpenAI-shaped, instead of errors.
    let secondary_addr = secondary.addr();
    drop(secondary);
    let mut statics = 0;
    for i in 0..8 {
        let key = ["demo-enterprise-key", "demo-pro-key"][i % 2];
        let r = ask_as(&envoy, key, "What is sluice?");
        if r.header("x-sluice-degraded") == Some("static") {
            assert_eq!(r.status, 200);
            let body = r.json();
            assert_eq!(body["object"], "chat.completion");
            assert_eq!(
                body["choices"][0]["message"]["content"],
                "sluice is admission control for LLM traffic, built into Envoy."
            );
            statics += 1;
        } else {
            assert_eq!(r.status, 503, "{r:?}");
        }
    }
    assert!(
        statics >= 5,
        "the breaker opened after 3 failures: {statics} static answers"
    );
    let other = ask(&envoy, "Tell me a joke");
    assert_eq!(other.header("x-sluice-degraded"), Some("static"));
    assert_eq!(
        other.json()["choices"][0]["message"]["content"],
        "The assistant is temporarily unavailable. Please try again in a few minutes."
    );

    // An upstream comes back: after the cooldown a half-open probe gets
    // through and closes the breaker.
    let back = ChildGuard::spawn(
        "mock-llm",
        Command::new(bin_path("mock-llm"))
            .args([
                "--listen",
                &secondary_addr.to_string(),
                "--name",
                "secondary",
            ])
            .stdout(Stdio::null()),
    )
    .expect("restart the secondary");
    let healed = wait_for(Duration::from_secs(15), || {
        let r = ask(&envoy, "hello");
        r.status == 200 && served_by(&r) == Some("secondary")
    });
    assert!(healed, "traffic flows again once an upstream answers");
    drop(back);
}
