//! The native module (issue 32, prototype) in the pinned Envoy: the `.so`
//! `make build` writes (target/release-native/libsluice_native.so) loads
//! through Envoy's dynamic-modules HTTP filter with its ABI version
//! matched, every callback it declares bound at load (it is linked
//! `-z now`, so a callback this Envoy lacks fails the load), and runs the
//! same policy core as the wasm filter: a caller's bucket admits up to its
//! limit and the next request gets sluice's 429, which never reaches the
//! upstream. A module missing the init symbol is refused by Envoy.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): admission
//! is decided before the upstream.

use std::path::PathBuf;

use sluice_tests::{get, prometheus_value, repo_root, Envoy, EnvoyConfig, MockLlm, Stack};

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
    serde_json::json!({
        "default_tier": "free",
        "identity": {
            "sources": ["api_key"],
            "api_key": {"header": "x-api-key", "keys": {KEY: "free"}},
        },
        "tiers": {"free": {"requests": format!("{LIMIT}/min")}},
    })
    .to_string()
}

/// The shipped listener with its `sluice` filter swapped for the native
/// module named `module` (lib<module>.so under `dir`), same place in the chain.
fn use_native(cfg: &mut EnvoyConfig, module: &str, dir: &std::path::Path) {
    let entry = serde_yaml::to_value(serde_json::json!({
        "name": "sluice",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": module, "do_not_close": true},
            "filter_name": "sluice",
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": policy(),
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
