//! The native module (issue 32, prototype) in the pinned Envoy: the `.so`
//! `make build` writes (target/release-native/libsluice_native.so) loads
//! through Envoy's dynamic-modules HTTP filter with its ABI version
//! matched, every callback it declares bound at load (it is linked
//! `-z now`, so a callback this Envoy lacks fails the load), and runs the
//! same policy core as the wasm filter: a caller's bucket admits up to its
//! limit and the next request gets sluice's 429, which never reaches the
//! upstream. A module missing the init symbol is refused by Envoy. A
//! stream cut at its allowance whose upstream sends on is reset through
//! the module's `reset_stream` callback (issue 48).
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): admission
//! is decided before the upstream.

use std::path::PathBuf;

use std::time::Duration;

use sluice_tests::{
    async_client, get, prometheus_value, repo_root, runtime, wait_for, Envoy, EnvoyConfig, MockLlm,
    Stack,
};

const KEY: &str = "native-key";
const LIMIT: u32 = 3;

fn module_dir() -> PathBuf {
    let dir = repo_root().join("target/release-native");
    assert!(
        dir.join("libsluice_native.so").is_file(),
        "{}/libsluice_native.so is missing: run `make build` first",
        dir.display()
    );
    dir
}

/// One per-caller request bucket of [`LIMIT`] a minute.
fn policy() -> String {
    policy_of(serde_json::json!({"requests": format!("{LIMIT}/min")}))
}

/// The key [`KEY`] in tier `free`, limited by `tier`.
fn policy_of(tier: serde_json::Value) -> String {
    serde_json::json!({
        "default_tier": "free",
        "identity": {
            "sources": ["api_key"],
            "api_key": {"header": "x-api-key", "keys": {KEY: "free"}},
        },
        "tiers": {"free": tier},
    })
    .to_string()
}

/// The shipped listener with its `sluice` filter swapped for the native
/// module named `module` (lib<module>.so under `dir`), same place in the chain.
fn use_native(cfg: &mut EnvoyConfig, module: &str, dir: &std::path::Path) {
    use_native_with(cfg, module, dir, &policy());
}

/// [`use_native`] with the policy `policy`.
fn use_native_with(cfg: &mut EnvoyConfig, module: &str, dir: &std::path::Path, policy: &str) {
    let entry = serde_yaml::to_value(serde_json::json!({
        "name": "sluice",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": module, "do_not_close": true},
            "filter_name": "sluice",
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": policy,
            },
        },
    }))
    .expect("a JSON value is a YAML value");
    *cfg.http_filter_mut("sluice") = entry;
    cfg.set_process_env(
        "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
        &dir.display().to_string(),
    );
}

#[test]
fn the_module_admits_up_to_the_bucket_then_refuses_with_429() {
    let dir = module_dir();
    let stack = Stack::start_with(2, |cfg| use_native(cfg, "sluice_native", &dir));
    assert!(
        stack
            .envoy
            .log()
            .contains("Dynamic module ABI version v0.2.0 matched."),
        "Envoy did not match the module's ABI version:\n{}",
        stack.envoy.log()
    );
    let url = stack.envoy.url("/v1/models");
    for i in 0..LIMIT {
        let resp = get(&url, &[("x-api-key", KEY)]);
        assert_eq!(resp.status, 200, "request {i}: {resp:?}");
    }
    let refused = get(&url, &[("x-api-key", KEY)]);
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.header("x-sluice-reason"), Some("user_rate_limit"));
    assert_eq!(refused.header("x-ratelimit-limit"), Some("3"));
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert_eq!(
        refused.json()["error"]["code"].as_str(),
        Some("user_rate_limit"),
        "{}",
        refused.body
    );
    assert_eq!(stack.upstream_requests(), u64::from(LIMIT));
    // The decisions as Envoy stats (the module's namespace kept).
    let prom = stack.envoy.stats_prometheus();
    let decided = |decision| {
        prometheus_value(
            &prom,
            "envoy_dynamicmodulescustom_sluice_requests_total",
            &[("decision", decision)],
        )
    };
    assert_eq!(decided("admit"), Some(f64::from(LIMIT)), "{prom}");
    assert_eq!(decided("refuse"), Some(1.0), "{prom}");
}

#[test]
fn envoy_refuses_a_module_without_the_init_symbol() {
    // Any shared object that is not a module: the test binary's own libc.
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/lib/aarch64-linux-gnu/libc.so.6",
        "/usr/lib/libc.so.6",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file());
    let Some(libc) = libc else {
        eprintln!("skipped: no libc.so.6 at a known path to play a module without its symbols");
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::copy(&libc, dir.path().join("libnot_a_module.so")).expect("copy libc");
    let upstream = MockLlm::start("primary");
    let mut cfg = sluice_tests::shipped_config_for(&upstream);
    use_native(&mut cfg, "not_a_module", dir.path());
    let err = match Envoy::try_start(&cfg, 1) {
        Ok(_) => {
            panic!("Envoy started with a module that has no envoy_dynamic_module_on_program_init")
        }
        Err(log) => log,
    };
    assert!(
        err.contains("envoy_dynamic_module_on_program_init"),
        "Envoy's refusal does not name the missing symbol:\n{err}"
    );
}

/// Issue 48 on the native host: a stream cut at its allowance whose
/// upstream sends on is reset (the dynamic modules' `reset_stream`), as
/// the wasm filter's is: the client gets the cut's end and then the end of
/// its stream, and the upstream's connection is closed.
#[test]
fn a_cut_stream_whose_upstream_sends_on_is_reset() {
    let dir = module_dir();
    let policy = policy_of(serde_json::json!({"requests": "100/min", "daily_tokens": 100_000}));
    let stack = Stack::start_with(1, |cfg| {
        use_native_with(cfg, "sluice_native", &dir, &policy)
    });
    let body = serde_json::json!({
        "model": "sluice-test-model",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "stream": true,
    });
    let url = stack.envoy.url("/v1/chat/completions");
    let text = runtime().block_on(async {
        let mut resp = async_client()
            .post(&url)
            .header("content-type", "application/json")
            .header("x-api-key", KEY)
            .header("x-mock-output-tokens", "3000")
            .header("x-mock-chunk-delay-ms", "25")
            .body(body.to_string())
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200);
        let mut text = Vec::new();
        // To the end, or a transport error (the reset) after the cut's end;
        // no byte for 5 s: the stream was left open.
        loop {
            match tokio::time::timeout(Duration::from_secs(5), resp.chunk()).await {
                Err(_) => panic!("the stream never ended: {}", String::from_utf8_lossy(&text)),
                Ok(Ok(Some(chunk))) => text.extend_from_slice(&chunk),
                Ok(Ok(None)) | Ok(Err(_)) => break,
            }
        }
        String::from_utf8_lossy(&text).into_owned()
    });
    assert!(text.contains("budget_exhausted_midstream"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let stream = || stack.upstream.stats()["streams"][0].clone();
    assert!(
        wait_for(Duration::from_secs(2), || stream()["ended"] == "dropped"),
        "the upstream still streams: {}",
        stream()
    );
    // The role chunk, 8 events, the one cut at, and at most a few more.
    let sent = stream()["frames_sent"].as_u64().unwrap_or(u64::MAX);
    assert!(sent <= 10 + 3, "{}", stream());
}
