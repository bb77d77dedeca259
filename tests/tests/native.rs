//! The native module (issue 32, prototype) in the pinned Envoy: the `.so`
//! `make build` writes (target/release-native/libsluice_native.so) loads
//! through Envoy's dynamic-modules HTTP filter with its ABI version
//! matched, every callback it declares bound at load (it is linked
//! `-z now`, so a callback this Envoy lacks fails the load), and runs the
//! same policy core as the wasm filter: a caller's bucket admits up to its
//! limit and the next request gets sluice's 429, which never reaches the
//! upstream. A POST's JSON body is read (the model's bucket, the output
//! limit written into the body sent upstream). A policy the module cannot
//! run (the shipped demo policy: JWT claims, the sidecar's kill switch,
//! failover, queues) or an operator's hash key too short is refused at
//! load, naming the field, and Envoy refuses the listener; the demo policy
//! without those fields loads and its ladder takes a request whose primary
//! paused. A module missing the init symbol is refused by Envoy. A stream
//! cut at its allowance whose upstream sends on is reset through the
//! module's `reset_stream` callback (issue 48).
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): admission
//! is decided before the upstream.

use std::path::PathBuf;

use std::time::Duration;

use sluice_tests::{
    async_client, get, post_json, prometheus_value, repo_root, runtime, wait_for, Envoy,
    EnvoyConfig, MockLlm, Stack,
};

const KEY: &str = "native-key";
const LIMIT: u32 = 3;
/// A model the policy lists with its own bucket.
const MODEL: &str = "sluice-test-model";

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

/// A shared object that is surely not a module: the C library this test
/// process itself runs with, found where the dynamic loader mapped it
/// (`/proc/self/maps`), wherever the system keeps it.
fn mapped_libc() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    let libs: Vec<PathBuf> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/') && path.contains(".so"))
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .collect();
    let is_libc = |p: &&PathBuf| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libc.so") || n.starts_with("libc-"))
    };
    libs.iter()
        .find(is_libc)
        .cloned()
        .unwrap_or_else(|| panic!("no libc among the shared objects this test runs with:\n{maps}"))
}

#[test]
fn envoy_refuses_a_module_without_the_init_symbol() {
    let libc = mapped_libc();
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

/// The shipped demo policy (envoy/sluice.yaml; its penalty box off, as
/// every test runs from one address), as JSON.
fn demo_policy(cfg: &mut EnvoyConfig) -> serde_json::Value {
    serde_json::to_value(cfg.policy_mut().clone()).expect("the policy as JSON")
}

/// Envoy's refusal of `cfg` (its log), or a panic if it started.
fn refused(cfg: &EnvoyConfig) -> String {
    match Envoy::try_start(cfg, 1) {
        Ok(envoy) => panic!(
            "Envoy started with a policy the module must refuse:\n{}",
            envoy.log()
        ),
        Err(log) => log,
    }
}

#[test]
fn envoy_refuses_the_demo_policy_naming_each_field_the_module_cannot_run() {
    let dir = module_dir();
    let upstream = MockLlm::start("primary");
    let mut cfg = sluice_tests::shipped_config_for(&upstream);
    let demo = demo_policy(&mut cfg).to_string();
    use_native_with(&mut cfg, "sluice_native", &dir, &demo);
    let log = refused(&cfg);
    for field in [
        "identity.jwt",
        "sidecar",
        "failover",
        "classes.batch",
        "classes.standard",
    ] {
        assert!(
            log.contains(&format!("`{field}`")),
            "the refusal does not name `{field}`:\n{log}"
        );
    }
    assert!(log.contains("kill switch"), "{log}");
}

#[test]
fn envoy_refuses_an_operators_hash_key_too_short() {
    let dir = module_dir();
    let upstream = MockLlm::start("primary");
    let mut cfg = sluice_tests::shipped_config_for(&upstream);
    use_native(&mut cfg, "sluice_native", &dir);
    cfg.set_process_env("SLUICE_HASH_KEY", "short");
    let log = refused(&cfg);
    assert!(
        log.contains(
            "identity.hash_key_env: the environment variable SLUICE_HASH_KEY holds 5 bytes"
        ),
        "{log}"
    );
    assert!(!log.contains("short\""), "never echo the key:\n{log}");
}

/// The demo policy without what the module cannot run: no JWT source, no
/// sidecar, no failover, no class that queues.
fn native_demo(cfg: &mut EnvoyConfig) -> String {
    let mut p = demo_policy(cfg);
    let map = p.as_object_mut().expect("a map");
    map.remove("sidecar");
    map.remove("failover");
    map["identity"]["sources"] = serde_json::json!(["api_key", "client_address"]);
    if let Some(identity) = map["identity"].as_object_mut() {
        identity.remove("jwt");
    }
    if let Some(classes) = map["classes"].as_object_mut() {
        for class in classes.values_mut() {
            *class = serde_json::json!({"queue": false});
        }
    }
    // The rung's demo budget, raised so no request spends it.
    map["providers"]["openai"]["daily_spend"]["limit"] = serde_json::json!(100);
    p.to_string()
}

/// The ladder on the native host: a primary that answers 503 with a long
/// `Retry-After` pauses its route (the caller gets that 503: no failover
/// here), and the next request goes to the first rung, rewritten for it.
#[test]
fn the_demo_policy_without_those_fields_loads_and_its_ladder_takes_a_paused_primary() {
    let dir = module_dir();
    let primary = MockLlm::start_with_args("primary", &["--fault", "503:retry_after=30"]);
    let fallback = MockLlm::start("fallback");
    let mut cfg = sluice_tests::shipped_config_for(&primary);
    cfg.set_cluster_addr("llm_fallback", fallback.addr());
    let policy = native_demo(&mut cfg);
    use_native_with(&mut cfg, "sluice_native", &dir, &policy);
    let envoy = Envoy::start(&cfg, 1);
    let url = envoy.url("/v1/chat/completions");
    let body = serde_json::json!({"model": "llama3.1:8b", "max_tokens": 20,
        "messages": [{"role": "user", "content": "hello there"}]});
    let key = [("x-api-key", "demo-pro-key")];
    let first = post_json(&url, &key, &body);
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(first.header("x-mock-name"), Some("primary"), "{first:?}");
    let second = post_json(&url, &key, &body);
    assert_eq!(second.status, 200, "{second:?}");
    assert_eq!(second.header("x-mock-name"), Some("fallback"), "{second:?}");
    assert_eq!(
        second.header("x-sluice-provider"),
        Some("openai"),
        "{second:?}"
    );
    assert_eq!(
        second.json()["model"],
        "gpt-4o-mini",
        "the rung's model answers"
    );
    let sent = &fallback.stats()["last_request"]["body"];
    assert_eq!(
        sent["model"], "gpt-4o-mini",
        "rewritten for the rung: {sent}"
    );
}

/// A POST through the module: its JSON body is read (the model names the
/// bucket, a request without an output limit is sent upstream with the
/// policy's default written in), and the model's bucket admits two and
/// refuses the third before the upstream.
#[test]
fn a_chat_post_is_read_admitted_and_then_refused_by_its_models_bucket() {
    let dir = module_dir();
    let policy = serde_json::json!({
        "default_tier": "free",
        "identity": {
            "sources": ["api_key"],
            "api_key": {"header": "x-api-key", "keys": {KEY: "free"}},
        },
        "tiers": {"free": {"requests": "100/min", "daily_tokens": 100_000}},
        "models": {MODEL: {"requests": "2/min"}},
        "defaults": {"max_output_tokens": 64},
    })
    .to_string();
    let stack = Stack::start_with(1, |cfg| {
        use_native_with(cfg, "sluice_native", &dir, &policy)
    });
    let url = stack.envoy.url("/v1/chat/completions");
    let body = serde_json::json!({"model": MODEL,
        "messages": [{"role": "user", "content": "hello"}]});
    for i in 0..2 {
        let resp = post_json(&url, &[("x-api-key", KEY)], &body);
        assert_eq!(resp.status, 200, "request {i}: {resp:?}");
        assert_eq!(resp.json()["object"], "chat.completion", "{}", resp.body);
        let sent = &stack.upstream.stats()["last_request"]["body"];
        assert_eq!(sent["model"], MODEL, "{sent}");
        assert_eq!(sent["messages"], body["messages"], "{sent}");
        assert_eq!(
            sent["max_tokens"], 64,
            "the default limit written in: {sent}"
        );
    }
    let refused = post_json(&url, &[("x-api-key", KEY)], &body);
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(
        refused.header("x-ratelimit-limit"),
        Some("2"),
        "{refused:?}"
    );
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert_eq!(
        stack.upstream_requests(),
        2,
        "the refused POST never went upstream"
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
