//! The response cache's fast path and its door (issue 20, follow-up),
//! against a real Envoy, the real sidecar and mock-llm:
//! - the exact tier in Envoy (single-Envoy mode, the default): an exact
//!   miss and its store make no callout, a hit is answered from Envoy's
//!   shared data, an admin purge at the sidecar still empties it, and a
//!   scope never reads another's entry;
//! - `exact: false`: a semantic-only model never answers by its exact key;
//! - under the kill switch a hit is served and marked
//!   `x-sluice-degraded: cache`;
//! - the cache endpoints' shared secret: without it, or with a wrong one,
//!   a caller (from loopback) can neither read nor write entries.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the tiers and
//! the door are the cache's own, whichever server wrote the entries.

use std::fs;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::{
    get, post_json, prometheus_value, wait_for, Envoy, EnvoyConfig, MockLlm, Response, Sidecar,
};

const SALT: &str = "cache-tier-test-salt-0123456789";
const TOKEN: &str = "cache-tier-test-admin-token-0123456789";
const SECRET: &str = "cache-tier-test-secret-0123456789";
const A: &str = "demo-pro-key";
const B: &str = "demo-enterprise-key";

struct Stack {
    envoy: Envoy,
    sidecar: Sidecar,
    upstream: MockLlm,
    _fallback: Option<MockLlm>,
    dir: tempfile::TempDir,
}

struct Setup<'a> {
    cache: Value,
    /// Lines added to the sidecar's `cache:` section.
    sidecar_cache: &'a str,
    embeddings: bool,
    fallback: bool,
}

impl Default for Setup<'_> {
    fn default() -> Self {
        Setup {
            cache: json!({"salt": SALT, "models": {"llama3.1:8b": {"exact": true}}}),
            sidecar_cache: "",
            embeddings: true,
            fallback: false,
        }
    }
}

fn start(setup: Setup<'_>, edit: impl FnOnce(&mut EnvoyConfig)) -> Stack {
    let upstream = MockLlm::start("primary");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sidecar.yaml");
    let mut yaml = String::from("sources: {gpu: simulated}\ncache:\n  max_entries: 1000\n");
    if setup.embeddings {
        let url = upstream.url("/v1/embeddings");
        yaml.push_str(&format!(
            "  embeddings: {{url: \"{url}\", model: mock-embed, timeout: 2s}}\n"
        ));
    }
    yaml.push_str(setup.sidecar_cache);
    fs::write(&config, yaml).unwrap();
    let token = dir.path().join("token");
    fs::write(&token, TOKEN).unwrap();
    let sidecar = Sidecar::start_with_args(&[
        "--config",
        &config.display().to_string(),
        "--admin-token-file",
        &token.display().to_string(),
    ]);
    let fallback = setup.fallback.then(|| MockLlm::start("fallback"));
    let mut cfg = sluice_tests::shipped_config_for(&upstream);
    cfg.set_cluster_addr("sluice_sidecar", sidecar.addr());
    if let Some(f) = &fallback {
        cfg.set_cluster_addr("llm_fallback", f.addr());
    }
    cfg.policy_mut()["cache"] = serde_yaml::to_value(&setup.cache).unwrap();
    edit(&mut cfg);
    let envoy = Envoy::start(&cfg, 2);
    // Entries are kept under the sidecar's cache generation: one stored
    // before its first state reached Envoy (generation 0) is not live once
    // it has. Tests start from the state a running Envoy is in.
    assert!(
        wait_for(Duration::from_secs(10), || envoy
            .metric("sluice_sidecar_polls_total", &[])
            .unwrap_or(0.0)
            >= 1.0),
        "Envoy never heard from the sidecar:\n{}",
        sidecar.log()
    );
    Stack {
        envoy,
        sidecar,
        upstream,
        _fallback: fallback,
        dir,
    }
}

impl Stack {
    fn upstream_requests(&self) -> u64 {
        self.upstream.stats()["by_path"]["/v1/chat/completions"]
            .as_u64()
            .unwrap_or(0)
    }

    fn sidecar_metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let text = get(&self.sidecar.url("/metrics"), &[]).body;
        prometheus_value(&text, name, labels).unwrap_or(0.0)
    }

    /// Callouts Envoy made to the sidecar's cluster (the long poll's too).
    fn sidecar_calls(&self) -> f64 {
        self.envoy
            .metric(
                "envoy_cluster_upstream_rq_total",
                &[("envoy_cluster_name", "sluice_sidecar")],
            )
            .unwrap_or(0.0)
    }

    fn chat(&self, key: &str, body: &Value) -> Response {
        post_json(
            &self.envoy.url("/v1/chat/completions"),
            &[("x-api-key", key)],
            body,
        )
    }

    fn purge(&self) {
        let r = post_json(
            &self.sidecar.url("/v1/cache/purge"),
            &[("authorization", &format!("Bearer {TOKEN}"))],
            &json!({}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

fn chat(model: &str, question: &str) -> Value {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": question}
        ],
        "max_tokens": 8,
        "temperature": 0,
    })
}

#[test]
fn the_tier_in_envoy_answers_without_the_sidecar_and_a_purge_still_empties_it() {
    let s = start(Setup::default(), |_| {});
    let body = chat("llama3.1:8b", "Kept in Envoy?");
    let first = s.chat(A, &body);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-sluice-cache"), Some("miss"));
    let (calls, upstream) = (s.sidecar_calls(), s.upstream_requests());
    let second = s.chat(A, &body);
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.header("x-sluice-cache"), Some("hit"), "{second:?}");
    assert_eq!(second.header("x-sluice-cache-kind"), Some("exact"));
    assert_eq!(second.json(), first.json(), "the same answer");
    assert_eq!(
        s.upstream_requests(),
        upstream,
        "never reached the upstream"
    );
    // Neither the store nor the hit went to the sidecar (the long poll
    // may have been renewed meanwhile: at most one call).
    assert!(
        s.sidecar_calls() <= calls + 1.0,
        "{} → {}",
        calls,
        s.sidecar_calls()
    );
    assert_eq!(
        s.sidecar_metric("sluice_sidecar_cache_total", &[("result", "store")]),
        0.0,
        "kept in Envoy, not in the sidecar"
    );
    // A streaming request of the same question: an SSE stream from Envoy.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let sse = s.chat(A, &streamed);
    assert_eq!(sse.header("x-sluice-cache"), Some("hit"), "{sse:?}");
    assert!(
        sse.header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream")),
        "{sse:?}"
    );
    assert!(
        sse.body.trim_end().ends_with("data: [DONE]"),
        "{}",
        sse.body
    );
    assert_eq!(s.upstream_requests(), upstream);
    // Another caller (scope principal): its own miss.
    assert_eq!(s.chat(B, &body).header("x-sluice-cache"), Some("miss"));
    // The admin purge at the sidecar reaches the entries in Envoy (its
    // generation comes with the next state push).
    s.purge();
    assert!(
        wait_for(Duration::from_secs(10), || s
            .chat(A, &body)
            .header("x-sluice-cache")
            == Some("miss")),
        "the purge never reached the tier in Envoy"
    );
    // Stored again after the purge: a hit again.
    assert_eq!(s.chat(A, &body).header("x-sluice-cache"), Some("hit"));
}

#[test]
fn errors_and_no_store_stay_out_of_the_tier_in_envoy() {
    // The upstream's own 500, as it sends it (not sent down the ladder).
    let s = start(Setup::default(), |cfg| {
        sluice_tests::without_failover(cfg.policy_mut());
    });
    let body = chat("llama3.1:8b", "Fails first?");
    let failed = post_json(
        &s.envoy.url("/v1/chat/completions"),
        &[("x-api-key", A), ("x-mock-status", "500")],
        &body,
    );
    assert_eq!(failed.status, 500, "{}", failed.body);
    let ok = s.chat(A, &body);
    assert_eq!(ok.status, 200);
    assert_eq!(
        ok.header("x-sluice-cache"),
        Some("miss"),
        "the 500 was not kept"
    );
    let private = chat("llama3.1:8b", "Not to be kept?");
    let r = post_json(
        &s.envoy.url("/v1/chat/completions"),
        &[("x-api-key", A), ("cache-control", "no-store")],
        &private,
    );
    assert_eq!(r.status, 200);
    assert_eq!(s.chat(A, &private).header("x-sluice-cache"), Some("miss"));
}

#[test]
fn a_semantic_only_model_never_answers_by_its_exact_key() {
    // No embeddings endpoint: every semantic lookup is a miss, so only an
    // exact lookup could answer — and `exact: false` says it must not.
    let s = start(
        Setup {
            cache: json!({"salt": SALT, "models": {"mistral:7b": {"exact": false, "semantic": true}}}),
            embeddings: false,
            ..Setup::default()
        },
        |_| {},
    );
    let body = chat("mistral:7b", "Only by meaning?");
    assert_eq!(s.chat(A, &body).status, 200);
    assert!(
        wait_for(Duration::from_secs(10), || s.sidecar_metric(
            "sluice_sidecar_cache_total",
            &[("result", "store"), ("kind", "exact")]
        ) >= 1.0),
        "never stored:\n{}",
        s.sidecar.log()
    );
    let before = s.upstream_requests();
    let again = s.chat(A, &body);
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.header("x-sluice-cache"), Some("miss"), "{again:?}");
    assert_eq!(s.upstream_requests(), before + 1);
}

#[test]
fn a_semantic_only_model_hits_by_meaning() {
    let s = start(
        Setup {
            cache: json!({"salt": SALT, "models": {"mistral:7b": {"exact": false, "semantic": true}}}),
            ..Setup::default()
        },
        |_| {},
    );
    assert_eq!(
        s.chat(A, &chat("mistral:7b", "How do I reset my password?"))
            .status,
        200
    );
    assert!(wait_for(Duration::from_secs(10), || s.sidecar_metric(
        "sluice_sidecar_cache_total",
        &[("result", "store"), ("kind", "exact")]
    ) >= 1.0));
    let same = s.chat(A, &chat("mistral:7b", "How do I reset my password?"));
    assert_eq!(same.header("x-sluice-cache"), Some("hit"), "{same:?}");
    assert_eq!(
        same.header("x-sluice-cache-kind"),
        Some("semantic"),
        "found by meaning, never by its exact key"
    );
}

#[test]
fn under_the_kill_switch_a_hit_is_served_and_marked_degraded() {
    let s = start(
        Setup {
            fallback: true,
            ..Setup::default()
        },
        |_| {},
    );
    let body = chat("llama3.1:8b", "Cached before the switch?");
    assert_eq!(s.chat(A, &body).header("x-sluice-cache"), Some("miss"));
    let hit = s.chat(A, &body);
    assert_eq!(hit.header("x-sluice-cache"), Some("hit"));
    assert_eq!(hit.header("x-sluice-degraded"), None, "the primary is up");
    let on = post_json(
        &s.sidecar.url("/v1/kill-switch"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
        &json!({"active": true, "reason": "cache tier test"}),
    );
    assert_eq!(on.status, 200, "{}", on.body);
    assert!(
        s.envoy.kill_switch_reached(Duration::from_secs(10)),
        "the kill switch never reached Envoy"
    );
    let uncached = chat("llama3.1:8b", "Never asked before the switch?");
    let r = s.chat(B, &uncached);
    assert_eq!(r.header("x-sluice-provider"), Some("openai"), "{r:?}");
    let before = s.upstream_requests();
    let r = s.chat(A, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-sluice-cache"), Some("hit"), "{r:?}");
    assert_eq!(r.header("x-sluice-degraded"), Some("cache"), "{r:?}");
    assert_eq!(
        r.header("x-mock-name"),
        None,
        "from the cache, not a provider"
    );
    assert_eq!(s.upstream_requests(), before);
    // An uncached question still goes to the fallback provider.
    let other = s.chat(A, &chat("llama3.1:8b", "Also never asked?"));
    assert_eq!(
        other.header("x-sluice-provider"),
        Some("openai"),
        "{other:?}"
    );
}

fn secret_setup(dir_secret: &str) -> Setup<'_> {
    Setup {
        // The tier off: every lookup and store goes through the door.
        cache: json!({"salt": SALT, "in_envoy": {"slots": 0}, "secret_env": "SLUICE_CACHE_SECRET",
                      "models": {"llama3.1:8b": {"exact": true}}}),
        sidecar_cache: dir_secret,
        ..Setup::default()
    }
}

fn store_body(key: &str, answer: &str) -> Value {
    json!({"key": key, "model": "llama3.1:8b", "ttl_s": 600,
           "entry": {"body": answer, "prompt_tokens": 1, "completion_tokens": 1}})
}

#[test]
fn the_cache_endpoints_refuse_callers_without_the_secret() {
    let secret_file = tempfile::NamedTempFile::new().unwrap();
    fs::write(secret_file.path(), format!("{SECRET}\n")).unwrap();
    let line = format!("  secret_file: {}\n", secret_file.path().display());
    let s = start(secret_setup(&line), |cfg| {
        sluice_tests::fleet::set_vm_env(cfg, "SLUICE_CACHE_SECRET", SECRET);
    });
    // The Envoy beside it has the secret: its answers are stored and hit.
    let body = chat("llama3.1:8b", "Behind the door?");
    assert_eq!(s.chat(A, &body).status, 200);
    assert!(
        wait_for(Duration::from_secs(10), || s.sidecar_metric(
            "sluice_sidecar_cache_total",
            &[("result", "store")]
        ) >= 1.0),
        "never stored:\n{}",
        s.sidecar.log()
    );
    assert_eq!(s.chat(A, &body).header("x-sluice-cache"), Some("hit"));
    // Another local process (or, under a mesh, another pod arriving from
    // 127.0.0.6): loopback, JSON, no Origin — and no secret, or a wrong one.
    let key = "ab".repeat(32);
    let lookup = json!({"key": key, "model": "llama3.1:8b"});
    let url = |p: &str| s.sidecar.url(p);
    for headers in [
        vec![],
        vec![("x-sluice-cache-secret", "cache-tier-test-secret-012345678X")],
    ] {
        let r = post_json(
            &url("/v1/cache/store"),
            &headers,
            &store_body(&key, "planted"),
        );
        assert_eq!(r.status, 401, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "unauthorized");
        let r = post_json(&url("/v1/cache/lookup"), &headers, &lookup);
        assert_eq!(r.status, 401, "{}", r.body);
        assert!(r.json().get("hit").is_none(), "nothing read: {}", r.body);
    }
    assert!(
        s.sidecar_metric(
            "sluice_sidecar_cache_refused_total",
            &[("reason", "missing")]
        ) >= 2.0
    );
    assert!(s.sidecar_metric("sluice_sidecar_cache_refused_total", &[("reason", "wrong")]) >= 2.0);
    // Nothing was planted: the holder of the secret finds no entry there.
    let right = [("x-sluice-cache-secret", SECRET)];
    let r = post_json(&url("/v1/cache/lookup"), &right, &lookup);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["hit"], Value::Null);
    // An Envoy whose policy has no secret is refused too: its lookups
    // and stores fail, its requests are served, never from the cache.
    let mut cfg = sluice_tests::shipped_config_for(&s.upstream);
    cfg.set_cluster_addr("sluice_sidecar", s.sidecar.addr());
    let mut cache = secret_setup("").cache;
    cache.as_object_mut().unwrap().remove("secret_env");
    cfg.policy_mut()["cache"] = serde_yaml::to_value(&cache).unwrap();
    let stranger = Envoy::start(&cfg, 1);
    let refused = s.sidecar_metric(
        "sluice_sidecar_cache_refused_total",
        &[("reason", "missing")],
    );
    for _ in 0..2 {
        let r = post_json(
            &stranger.url("/v1/chat/completions"),
            &[("x-api-key", A)],
            &body,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(r.header("x-sluice-cache"), Some("hit"), "{r:?}");
    }
    assert!(
        s.sidecar_metric(
            "sluice_sidecar_cache_refused_total",
            &[("reason", "missing")]
        ) >= refused + 2.0
    );
    drop(s.dir);
}

#[test]
fn check_config_reads_the_secret_fields() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sidecar.yaml");
    fs::write(
        &config,
        "cache:\n  secret_file: /nonexistent\n  secret_env: ALSO\n",
    )
    .unwrap();
    let out = std::process::Command::new(sluice_tests::bin_path("sluice-sidecar"))
        .args(["check-config", &config.display().to_string()])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("cache.secret_env"), "{text}");
}

#[test]
fn the_tier_in_envoy_shares_within_a_team_scope_only() {
    let s = start(
        Setup {
            cache: json!({"salt": SALT, "models": {"llama3.1:8b": {"exact": true, "scope": "team"}}}),
            ..Setup::default()
        },
        |_| {},
    );
    let body = chat("llama3.1:8b", "Shared within the team, in Envoy?");
    assert_eq!(
        s.chat("demo-search-key-1", &body).header("x-sluice-cache"),
        Some("miss")
    );
    let before = s.upstream_requests();
    let mate = s.chat("demo-search-key-2", &body);
    assert_eq!(
        mate.header("x-sluice-cache"),
        Some("hit"),
        "a key of the same team: {mate:?}"
    );
    assert_eq!(s.upstream_requests(), before);
    // A caller of no team is scoped to itself: never the team's entry.
    let other = s.chat(A, &body);
    assert_eq!(other.header("x-sluice-cache"), Some("miss"), "{other:?}");
    assert_eq!(s.upstream_requests(), before + 1);
}

/// Issue 29 item 5's sibling, cache entries: undeclared callers storing
/// ever-new answers held every way of the tier's sets, so a flood pushed
/// the declared callers' answers out. They now hold at most half of each
/// set and evict only each other's entries.
#[test]
fn an_undeclared_flood_keeps_the_declared_callers_answers_in_envoy() {
    // One set of four ways: every answer competes for the same places.
    let s = start(
        Setup {
            cache: json!({
                "salt": SALT,
                "in_envoy": {"slots": 4},
                "models": {"llama3.1:8b": {"exact": true}},
            }),
            ..Setup::default()
        },
        |_| {},
    );
    let mine: Vec<Value> = (0..3)
        .map(|i| chat("llama3.1:8b", &format!("declared question {i}")))
        .collect();
    for q in &mine {
        assert_eq!(s.chat(A, q).header("x-sluice-cache"), Some("miss"));
    }
    // Eight anonymous questions (the free tier's 10/min from one
    // address), each new, each stored.
    for i in 0..8 {
        let body = chat("llama3.1:8b", &format!("anonymous question {i}"));
        let r = post_json(&s.envoy.url("/v1/chat/completions"), &[], &body);
        assert_eq!(r.status, 200, "{r:?}");
    }
    let before = s.upstream_requests();
    for q in &mine {
        let r = s.chat(A, q);
        assert_eq!(r.header("x-sluice-cache"), Some("hit"), "{r:?}");
    }
    assert_eq!(s.upstream_requests(), before, "answered from the cache");
}
