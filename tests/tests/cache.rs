//! The response cache (docs/src/design.md, "Response cache"; issue 20) against a real
//! Envoy, the real sidecar (entries in its memory, mock-llm's embeddings) and
//! mock-llm: exact hits never reach the upstream and carry `x-sluice-cache: hit`;
//! any output parameter, system prompt or earlier turn misses; nothing
//! crosses scopes; errors, cut streams and `no-store` are never stored;
//! a paraphrase in the same conversation is a semantic hit and the
//! "enable 2FA" / "disable 2FA" near miss is not; a hit costs a request
//! and no tokens.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`) (its chat,
//! completions and embeddings): what the cache stores and serves does not
//! depend on which server wrote the answer.

use std::fs;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::{
    get, post_json, prometheus_value, wait_for, Envoy, EnvoyConfig, MockLlm, Response, Sidecar,
};

const SALT: &str = "cache-test-salt-0123456789";
const TOKEN: &str = "cache-test-admin-token-0123456789";

/// mock-llm, a sidecar holding the cache, and Envoy with the shipped
/// policy plus a `cache:` section.
struct CacheStack {
    envoy: Envoy,
    sidecar: Sidecar,
    upstream: MockLlm,
    _dir: tempfile::TempDir,
}

fn start(cache: Value, sidecar_cache: &str, edit: impl FnOnce(&mut EnvoyConfig)) -> CacheStack {
    let upstream = MockLlm::start("primary");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sidecar.yaml");
    let embeddings = upstream.url("/v1/embeddings");
    let yaml = format!(
        "sources: {{gpu: simulated}}\ncache:\n  embeddings: {{url: \"{embeddings}\", model: mock-embed, timeout: 2s}}\n{sidecar_cache}"
    );
    fs::write(&config, yaml).unwrap();
    let token = dir.path().join("token");
    fs::write(&token, TOKEN).unwrap();
    let sidecar = Sidecar::start_with_args(&[
        "--config",
        &config.display().to_string(),
        "--admin-token-file",
        &token.display().to_string(),
    ]);
    let mut cfg = sluice_tests::shipped_config_for(&upstream);
    cfg.set_cluster_addr("sluice_sidecar", sidecar.addr());
    let policy = cfg.policy_mut();
    policy["cache"] = serde_yaml::to_value(&cache).unwrap();
    edit(&mut cfg);
    let envoy = Envoy::start(&cfg, 2);
    CacheStack {
        envoy,
        sidecar,
        upstream,
        _dir: dir,
    }
}

fn default_cache() -> Value {
    json!({
        "salt": SALT,
        // The exact tier in Envoy off: these tests check the sidecar's
        // store (tests/tests/cache_tier.rs checks the tier, the default).
        "in_envoy": {"slots": 0},
        "models": {
            "llama3.1:8b": {"exact": true},
            "mistral:7b": {"exact": true, "semantic": true},
        }
    })
}

impl CacheStack {
    /// Chat requests that reached mock-llm (its embeddings, which the
    /// sidecar calls, are not counted).
    fn upstream_requests(&self) -> u64 {
        self.upstream.stats()["by_path"]["/v1/chat/completions"]
            .as_u64()
            .unwrap_or(0)
    }

    fn sidecar_metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let text = get(&self.sidecar.url("/metrics"), &[]).body;
        prometheus_value(&text, name, labels).unwrap_or(0.0)
    }

    fn stores(&self) -> f64 {
        let text = get(&self.sidecar.url("/metrics"), &[]).body;
        ["llama3.1:8b", "mistral:7b"]
            .iter()
            .map(|m| {
                prometheus_value(
                    &text,
                    "sluice_sidecar_cache_total",
                    &[("result", "store"), ("kind", "exact"), ("model", m)],
                )
                .unwrap_or(0.0)
            })
            .sum()
    }

    /// Waits until the sidecar holds `n` stores in all.
    fn wait_stores(&self, n: f64) {
        assert!(
            wait_for(Duration::from_secs(10), || self.stores() >= n),
            "the sidecar never stored {n} answers:\n{}",
            self.sidecar.log()
        );
    }

    fn chat(&self, key: &str, body: &Value, headers: &[(&str, &str)]) -> Response {
        let mut h = vec![("x-api-key", key)];
        h.extend_from_slice(headers);
        post_json(&self.envoy.url("/v1/chat/completions"), &h, body)
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

const A: &str = "demo-pro-key";
const B: &str = "demo-enterprise-key";

#[test]
fn exact_hit_never_reaches_the_upstream() {
    let s = start(default_cache(), "", |_| {});
    let body = chat("llama3.1:8b", "What is sluice?");
    let first = s.chat(A, &body, &[]);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-sluice-cache"), Some("miss"));
    s.wait_stores(1.0);
    let before = s.upstream_requests();
    let second = s.chat(A, &body, &[]);
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        second.header("x-sluice-cache"),
        Some("hit"),
        "{:?}",
        second.headers
    );
    assert!(second.header("age").is_some());
    assert_eq!(second.json(), first.json(), "the stored body, as it was");
    assert_eq!(
        s.upstream_requests(),
        before,
        "a hit never reaches mock-llm"
    );
    // `stream`, `stream_options` and `user` do not change the key: a
    // streaming request of the same question is a hit, as SSE.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["user"] = json!("someone");
    let sse = s.chat(A, &streamed, &[]);
    assert_eq!(sse.header("x-sluice-cache"), Some("hit"));
    assert!(sse
        .header("content-type")
        .unwrap_or("")
        .starts_with("text/event-stream"));
    assert!(
        sse.body.trim_end().ends_with("data: [DONE]"),
        "{}",
        sse.body
    );
    assert!(
        !sse.body.contains("\"usage\""),
        "no usage chunk unless asked"
    );
    let mut with_usage = streamed.clone();
    with_usage["stream_options"] = json!({"include_usage": true});
    let sse = s.chat(A, &with_usage, &[]);
    assert!(sse.body.contains("\"usage\""), "{}", sse.body);
    assert_eq!(s.upstream_requests(), before);
}

#[test]
fn any_output_parameter_or_earlier_turn_misses() {
    let s = start(default_cache(), "", |_| {});
    let base = chat("llama3.1:8b", "Name a colour.");
    assert_eq!(s.chat(A, &base, &[]).status, 200);
    s.wait_stores(1.0);
    let mut variants = Vec::new();
    for (field, value) in [
        ("temperature", json!(0.1)),
        ("max_tokens", json!(9)),
        ("seed", json!(7)),
        ("top_p", json!(0.5)),
        ("stop", json!(["\n"])),
    ] {
        let mut v = base.clone();
        v[field] = value;
        variants.push(v);
    }
    let mut system = base.clone();
    system["messages"][0]["content"] = json!("You are verbose.");
    variants.push(system);
    let mut earlier = base.clone();
    earlier["messages"]
        .as_array_mut()
        .unwrap()
        .insert(1, json!({"role": "user", "content": "Hi"}));
    variants.push(earlier);
    for v in &variants {
        let before = s.upstream_requests();
        let r = s.chat(A, v, &[]);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-sluice-cache"), Some("miss"), "{v}");
        assert_eq!(s.upstream_requests(), before + 1, "{v}");
    }
}

/// What the upstream reads is what is keyed: the query string (an
/// `?api-version=` route), and integers a float cannot hold exactly (a
/// Python server reads `2^64` and `2^64 + 1` as two seeds).
#[test]
fn the_query_string_and_big_integers_are_keyed_as_the_upstream_reads_them() {
    let s = start(default_cache(), "", |_| {});
    let base = chat("llama3.1:8b", "Name a number.");
    let url = |q: &str| {
        s.envoy
            .url(&format!("/v1/chat/completions?api-version={q}"))
    };
    let first = post_json(&url("1"), &[("x-api-key", A)], &base);
    assert_eq!(first.status, 200, "{}", first.body);
    s.wait_stores(1.0);
    let again = post_json(&url("1"), &[("x-api-key", A)], &base);
    assert_eq!(
        again.header("x-sluice-cache"),
        Some("hit"),
        "same query: a hit"
    );
    let before = s.upstream_requests();
    let other = post_json(&url("2"), &[("x-api-key", A)], &base);
    assert_eq!(other.status, 200, "{}", other.body);
    assert_eq!(
        other.header("x-sluice-cache"),
        Some("miss"),
        "another query misses"
    );
    assert_eq!(s.upstream_requests(), before + 1);

    for seed in ["18446744073709551616", "18446744073709551617"] {
        let mut text = base.to_string();
        text.insert_str(text.len() - 1, &format!(",\"seed\":{seed}"));
        let before = s.upstream_requests();
        let r = sluice_tests::request(
            "POST",
            &s.envoy.url("/v1/chat/completions"),
            &[("x-api-key", A), ("content-type", "application/json")],
            Some(text.into_bytes()),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(r.header("x-sluice-cache"), Some("hit"), "seed {seed}");
        assert_eq!(
            s.upstream_requests(),
            before + 1,
            "seed {seed} reached the upstream"
        );
    }
}

#[test]
fn nothing_crosses_scopes() {
    let s = start(default_cache(), "", |_| {});
    let body = chat("llama3.1:8b", "A secret of caller A?");
    s.chat(A, &body, &[]);
    s.wait_stores(1.0);
    let before = s.upstream_requests();
    // Caller B, same prompt: its own miss (scope principal by default).
    let r = s.chat(B, &body, &[]);
    assert_eq!(r.header("x-sluice-cache"), Some("miss"));
    assert_eq!(s.upstream_requests(), before + 1);
    s.wait_stores(2.0);
    // Each now hits its own entry.
    assert_eq!(s.chat(A, &body, &[]).header("x-sluice-cache"), Some("hit"));
    assert_eq!(s.chat(B, &body, &[]).header("x-sluice-cache"), Some("hit"));
    assert_eq!(s.upstream_requests(), before + 1);
    // Semantic too: the same question by B in mistral's semantic cache.
    let q = chat("mistral:7b", "How do I enable 2FA on my account?");
    s.chat(A, &q, &[]);
    s.wait_stores(3.0);
    let para = chat("mistral:7b", "how do I enable 2FA on my account");
    assert_eq!(s.chat(B, &para, &[]).header("x-sluice-cache"), Some("miss"));
}

#[test]
fn a_tier_scope_shares_between_its_keys() {
    let mut cache = default_cache();
    cache["models"]["llama3.1:8b"]["scope"] = json!("tier");
    let s = start(cache, "", |cfg| {
        let keys = &mut cfg.policy_mut()["identity"]["api_key"]["keys"];
        keys["second-pro-key"] = serde_yaml::Value::from("pro");
    });
    let body = chat("llama3.1:8b", "Shared within the tier?");
    s.chat(A, &body, &[]);
    s.wait_stores(1.0);
    let r = s.chat("second-pro-key", &body, &[]);
    assert_eq!(
        r.header("x-sluice-cache"),
        Some("hit"),
        "same tier, scope tier"
    );
    let r = s.chat(B, &body, &[]);
    assert_eq!(r.header("x-sluice-cache"), Some("miss"), "another tier");
}

#[test]
fn errors_and_no_store_are_never_stored() {
    // The upstream's own errors, as it sends them: not sent down the
    // ladder (which would answer them from the static table), and its 429
    // without Retry-After pausing nobody (the next requests are the
    // caller's own).
    let s = start(default_cache(), "", |cfg| {
        let p = cfg.policy_mut();
        sluice_tests::without_failover(p);
        p["protection"]["pause_without_retry_after"] = serde_yaml::Value::from("0s");
    });
    let body = chat("llama3.1:8b", "Never stored?");
    for status in ["500", "429"] {
        let r = s.chat(A, &body, &[("x-mock-status", status)]);
        assert!(r.status >= 400, "{}", r.body);
    }
    // no-store: neither read nor stored; no-cache: stored, not read.
    let r = s.chat(A, &body, &[("cache-control", "no-store")]);
    assert_eq!(r.status, 200);
    // A cut stream is not stored either.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let _ = sluice_tests::try_post_json(
        &s.envoy.url("/v1/chat/completions"),
        &[("x-api-key", A), ("x-mock-reset-after-chunks", "2")],
        &streamed,
    );
    let before = s.upstream_requests();
    let r = s.chat(A, &body, &[]);
    assert_eq!(
        r.header("x-sluice-cache"),
        Some("miss"),
        "nothing was stored"
    );
    assert_eq!(s.upstream_requests(), before + 1);
    s.wait_stores(1.0);
    let r = s.chat(A, &body, &[("cache-control", "no-cache")]);
    assert_eq!(
        r.header("x-sluice-cache"),
        Some("miss"),
        "no-cache does not read"
    );
    assert_eq!(s.chat(A, &body, &[]).header("x-sluice-cache"), Some("hit"));
}

#[test]
fn semantic_paraphrase_hits_and_the_near_miss_does_not() {
    let s = start(default_cache(), "", |_| {});
    let q = chat("mistral:7b", "How do I enable 2FA on my account?");
    assert_eq!(s.chat(A, &q, &[]).status, 200);
    s.wait_stores(1.0);
    let before = s.upstream_requests();
    let para = chat("mistral:7b", "how do I enable 2FA on my account");
    let r = s.chat(A, &para, &[]);
    assert_eq!(r.header("x-sluice-cache"), Some("hit"), "{:?}", r.headers);
    assert_eq!(r.header("x-sluice-cache-kind"), Some("semantic"));
    assert_eq!(s.upstream_requests(), before);
    let opposite = chat("mistral:7b", "How do I disable 2FA on my account?");
    assert_eq!(
        s.chat(A, &opposite, &[]).header("x-sluice-cache"),
        Some("miss")
    );
    // The same question after another earlier turn: another conversation.
    let mut other = q.clone();
    other["messages"]
        .as_array_mut()
        .unwrap()
        .insert(1, json!({"role": "user", "content": "I use a phone."}));
    assert_eq!(
        s.chat(A, &other, &[]).header("x-sluice-cache"),
        Some("miss")
    );
}

/// The semantic guard: mock-llm's embeddings ignore word order (like real
/// ones weigh a swapped name, an added "not" or two swapped nouns little),
/// so without it these pairs were hits. Each stored question, then its twin: a miss that
/// reaches the upstream; the same question reworded is still a hit.
#[test]
fn semantic_near_misses_in_numbers_negations_names_and_word_order_miss() {
    let s = start(default_cache(), "", |_| {});
    let pairs = [
        (
            "Transfer 100 dollars from Alice to Bob",
            "Transfer 100 dollars from Bob to Alice",
        ),
        (
            "Should I buy this stock now",
            "Should I not buy this stock now",
        ),
        ("What is 2 plus 2", "What is 2 plus 3"),
        // Word order around a direction word: the same bag of words.
        (
            "Is the dog bigger than the cat",
            "Is the cat bigger than the dog",
        ),
        ("Convert 5 miles to km", "Convert 5 km to miles"),
    ];
    for (n, (stored, twin)) in pairs.iter().enumerate() {
        assert_eq!(s.chat(A, &chat("mistral:7b", stored), &[]).status, 200);
        s.wait_stores((n + 1) as f64);
        let again = s.chat(A, &chat("mistral:7b", &format!("{stored}?")), &[]);
        assert_eq!(
            again.header("x-sluice-cache"),
            Some("hit"),
            "{stored}: reworded"
        );
        let before = s.upstream_requests();
        let r = s.chat(A, &chat("mistral:7b", twin), &[]);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header("x-sluice-cache"),
            Some("miss"),
            "{twin} is not {stored}"
        );
        assert_eq!(s.upstream_requests(), before + 1);
    }
}

#[test]
fn a_hit_counts_a_request_and_no_tokens() {
    let s = start(default_cache(), "", |cfg| {
        let policy = cfg.policy_mut();
        // Room for one request at its input's bound (113 with its output)
        // and a few more at their real cost (about 14 each).
        policy["tiers"]["tiny"] =
            serde_yaml::from_str("{requests: 100/min, daily_tokens: 200}").unwrap();
        policy["identity"]["api_key"]["keys"]["tiny-key"] = serde_yaml::Value::from("tiny");
    });
    let body = chat("llama3.1:8b", "Budget?");
    let first = s.chat("tiny-key", &body, &[]);
    assert_eq!(first.status, 200, "{}", first.body);
    s.wait_stores(1.0);
    // Spend the rest of the daily budget on other questions until refused.
    let mut refused = false;
    for i in 0..20 {
        let r = s.chat("tiny-key", &chat("llama3.1:8b", &format!("other {i}")), &[]);
        if r.status == 429 {
            refused = true;
            break;
        }
    }
    assert!(refused, "the tiny budget never ran out");
    // Over its token budget, the cached answer still comes (hits are free
    // of tokens by default), and it counts as a request.
    let r = s.chat("tiny-key", &body, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-sluice-cache"), Some("hit"));
}

#[test]
fn embeddings_down_and_sidecar_down_are_misses() {
    let s = start(default_cache(), "", |_| {});
    // No sidecar at all: every request is served, none cached.
    let mut cfg = sluice_tests::shipped_config_for(&s.upstream);
    cfg.policy_mut()["cache"] = serde_yaml::to_value(default_cache()).unwrap();
    cfg.set_cluster_addr("sluice_sidecar", sluice_tests::closed_addr());
    let lone = Envoy::start(&cfg, 1);
    let body = chat("llama3.1:8b", "Sidecar down?");
    for _ in 0..2 {
        let r = post_json(
            &lone.url("/v1/chat/completions"),
            &[("x-api-key", A)],
            &body,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(r.header("x-sluice-cache"), Some("hit"));
    }
    drop(lone);
    // Embeddings endpoint down: semantic lookups miss, requests served.
    let upstream = MockLlm::start("other");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sidecar.yaml");
    fs::write(
        &config,
        "sources: {gpu: simulated}\ncache:\n  embeddings: {url: \"http://127.0.0.1:1/v1/embeddings\", model: e, timeout: 500ms}\n",
    )
    .unwrap();
    let sidecar = Sidecar::start_with_args(&["--config", &config.display().to_string()]);
    let mut cfg = sluice_tests::shipped_config_for(&upstream);
    cfg.policy_mut()["cache"] = serde_yaml::to_value(default_cache()).unwrap();
    cfg.set_cluster_addr("sluice_sidecar", sidecar.addr());
    let envoy = Envoy::start(&cfg, 1);
    let q = chat("mistral:7b", "How do I enable 2FA on my account?");
    for _ in 0..2 {
        let r = post_json(&envoy.url("/v1/chat/completions"), &[("x-api-key", A)], &q);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let text = get(&sidecar.url("/metrics"), &[]).body;
    assert!(
        prometheus_value(&text, "sluice_sidecar_cache_embedding_failures_total", &[])
            .unwrap_or(0.0)
            >= 1.0,
        "{text}"
    );
    let _ = s.sidecar_metric("sluice_sidecar_cache_entries", &[]);
}

/// The pinned `openai` and `ollama` Python clients parse hits (JSON, SSE
/// with and without the usage chunk, NDJSON); skipped without them unless
/// `SLUICE_REQUIRE_CLIENTS` is set (as `make test` does).
#[test]
fn real_clients_parse_hits() {
    let Some(python) = sluice_tests::clients_python("real_clients_parse_hits", "openai, ollama")
    else {
        return;
    };
    let s = start(default_cache(), "", |_| {});
    let (finished, status, output) = sluice_tests::run_client_script(
        &python,
        "cache_clients.py",
        &s.envoy.url(""),
        Duration::from_secs(90),
    );
    eprintln!("{output}");
    assert!(
        finished,
        "cache_clients.py still running after 90 s:\n{output}"
    );
    assert!(
        status.success() && output.lines().any(|l| l == "ALL OK"),
        "cache_clients.py failed:\n{output}\nsidecar:\n{}",
        s.sidecar.log()
    );
}

#[test]
fn primary_out_answers_from_the_cache_before_the_static_answer() {
    let s = start(default_cache(), "", |cfg| {
        let policy = cfg.policy_mut();
        policy["static_fallback"]["when_primary_out"] = serde_yaml::Value::from(true);
        sluice_tests::without_rungs(policy);
    });
    let body = chat("llama3.1:8b", "Cached before the outage?");
    assert_eq!(s.chat(A, &body, &[]).status, 200);
    s.wait_stores(1.0);
    let on = post_json(
        &s.sidecar.url("/v1/kill-switch"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
        &json!({"active": true, "reason": "cache test"}),
    );
    assert_eq!(on.status, 200, "{}", on.body);
    assert!(
        s.envoy.kill_switch_reached(Duration::from_secs(10)),
        "the kill switch never reached Envoy"
    );
    let uncached = chat("llama3.1:8b", "Never asked before?");
    let r = s.chat(A, &uncached, &[]);
    assert_eq!(r.header("x-sluice-degraded"), Some("static"), "{r:?}");
    let before = s.upstream_requests();
    let r = s.chat(A, &body, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-sluice-cache"), Some("hit"));
    assert_eq!(r.header("x-sluice-degraded"), Some("cache"));
    assert_eq!(s.upstream_requests(), before);
}

/// The sidecar's resident memory, KiB (Linux).
fn rss_kib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn the_memory_bound_holds_under_ten_times_max_bytes() {
    let max_bytes: u64 = 4 << 20;
    let extra = format!("  max_bytes: {max_bytes}\n  max_entry_bytes: 200000\n");
    let mut s = start(default_cache(), &extra, |_| {});
    let pid = s.sidecar.process().id();
    let answer = "z".repeat(100_000);
    let store = |i: usize| {
        let key = format!("{i:064x}");
        json!({"key": key, "model": "llama3.1:8b", "ttl_s": 600,
               "entry": {"body": answer, "prompt_tokens": 1, "completion_tokens": 1}})
    };
    // Warm up (first allocations, the HTTP path), then measure.
    for i in 0..8 {
        post_json(&s.sidecar.url("/v1/cache/store"), &[], &store(i)).ok();
    }
    let before = rss_kib(pid);
    // 10× max_bytes of distinct answers.
    let n = (10 * max_bytes / 100_000) as usize;
    for i in 8..8 + n {
        let r = post_json(&s.sidecar.url("/v1/cache/store"), &[], &store(i));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let bytes = s.sidecar_metric("sluice_sidecar_cache_bytes", &[]);
    assert!(
        bytes <= max_bytes as f64,
        "{bytes} bytes held over max_bytes {max_bytes}"
    );
    let grown = rss_kib(pid).saturating_sub(before) * 1024;
    eprintln!(
        "sidecar RSS grew {} KiB storing {} MiB of answers (max_bytes {} MiB)",
        grown / 1024,
        (10 * max_bytes) >> 20,
        max_bytes >> 20
    );
    assert!(
        grown < 4 * max_bytes,
        "RSS grew {grown} bytes storing 10× max_bytes: the bound does not hold"
    );
    assert!(s.sidecar_metric("sluice_sidecar_cache_total", &[("result", "evict")]) > 0.0);
}

#[test]
fn fleet_one_envoys_answer_is_every_envoys_hit() {
    use sluice_tests::fleet::{policy, Node, Redis};
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = policy(&format!(
        "default_tier: free\nidentity: {{ sources: [client_address] }}\n\
         tiers: {{ free: {{ requests: 100/min }} }}\n\
         sidecar: {{ cluster: sluice_sidecar }}\n\
         fleet: {{ expected_replicas: 2 }}\n\
         cache: {{ salt: {SALT}, models: {{ \"llama3.1:8b\": {{ exact: true }} }} }}\n"
    ));
    let nodes: Vec<Node> = (0..2)
        .map(|_| Node::start_with(&redis.url(), &upstream, None, &p, 1, "cache: {}\n"))
        .collect();
    let url = |i: usize| nodes[i].envoy.url("/v1/chat/completions");
    let chats = || {
        upstream.stats()["by_path"]["/v1/chat/completions"]
            .as_u64()
            .unwrap_or(0)
    };
    let body = chat("llama3.1:8b", "Shared by the fleet?");
    let first = post_json(&url(0), &[], &body);
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(
        wait_for(Duration::from_secs(10), || !redis
            .keys("sluice:cache:e:*")
            .is_empty()),
        "nothing stored in Redis:\n{}",
        nodes[0].sidecar.log()
    );
    let before = chats();
    let second = post_json(&url(1), &[], &body);
    assert_eq!(
        second.header("x-sluice-cache"),
        Some("hit"),
        "{:?}",
        second.headers
    );
    assert_eq!(second.json(), first.json());
    assert_eq!(chats(), before, "Envoy 2 answered from Envoy 1's entry");
    // Redis down: misses, nothing fails.
    let mut redis = redis;
    redis.kill();
    for i in 0..2 {
        let r = post_json(
            &url(i),
            &[],
            &chat("llama3.1:8b", "Asked while Redis is down"),
        );
        assert_ne!(r.status / 100, 5, "{}", r.body);
        assert_ne!(r.header("x-sluice-cache"), Some("hit"));
    }
}

#[test]
fn a_team_scope_shares_between_two_keys_of_the_team_only() {
    let mut cache = default_cache();
    cache["models"]["llama3.1:8b"]["scope"] = json!("team");
    let s = start(cache, "", |_| {});
    let body = chat("llama3.1:8b", "Shared within team search?");
    assert_eq!(s.chat("demo-search-key-1", &body, &[]).status, 200);
    s.wait_stores(1.0);
    let before = s.upstream_requests();
    let r = s.chat("demo-search-key-2", &body, &[]);
    assert_eq!(
        r.header("x-sluice-cache"),
        Some("hit"),
        "a key of the same team"
    );
    assert_eq!(s.upstream_requests(), before);
    // A pro caller of no team is scoped to itself: never the team's entry.
    let r = s.chat(A, &body, &[]);
    assert_eq!(
        r.header("x-sluice-cache"),
        Some("miss"),
        "a caller outside the team"
    );
    assert_eq!(s.upstream_requests(), before + 1);
}

/// Issue 29 item 6: a request for a cached model waits in the queue, the
/// kill switch flips and the fallback answers it. That answer is another
/// provider's: it is never stored under the primary's key, so once the
/// switch is released the same question is a miss that the primary
/// answers, as for a request that went to the fallback at once.
#[test]
fn a_queued_request_the_fallback_answers_is_never_stored_as_the_primarys() {
    let fallback = MockLlm::start("fallback");
    let cache = json!({"salt": SALT, "models": {"mistral:7b": {"exact": true}}});
    let s = start(cache, "", |cfg| {
        cfg.set_cluster_addr("llm_fallback", fallback.addr());
        // Waits long enough for the switch to travel on a loaded machine.
        cfg.policy_mut()["classes"]["standard"]["max_wait"] = serde_yaml::Value::from("40s");
    });
    let switch = |active: bool| {
        let r = post_json(
            &s.sidecar.url("/v1/kill-switch"),
            &[("authorization", &format!("Bearer {TOKEN}"))],
            &json!({"active": active, "reason": "queued fallback test"}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    };
    let question = chat("mistral:7b", "Answered by whom, while I waited?");
    let fallback_chats = || {
        fallback.stats()["by_path"]["/v1/chat/completions"]
            .as_u64()
            .unwrap_or(0)
    };
    std::thread::scope(|scope| {
        // Two slow calls (pro: a class that never queues) hold both of
        // mistral's slots.
        let slow: Vec<_> = (0..2)
            .map(|i| {
                let s = &s;
                scope.spawn(move || {
                    let body = chat("mistral:7b", &format!("slow call {i}"));
                    s.chat(A, &body, &[("x-mock-latency-ms", "15000")])
                })
            })
            .collect();
        assert!(
            wait_for(Duration::from_secs(10), || s.upstream.stats()["in_flight"]
                == 2),
            "the slow calls never reached the upstream"
        );
        let queued = scope.spawn(|| s.chat("demo-free-key", &question, &[]));
        let depth = || {
            s.envoy
                .metric(
                    "sluice_queue_depth",
                    &[("model", "mistral:7b"), ("class", "standard")],
                )
                .unwrap_or(0.0)
        };
        assert!(
            wait_for(Duration::from_secs(10), || depth() == 1.0),
            "the free caller's request never queued"
        );
        switch(true);
        assert!(
            s.envoy.kill_switch_reached(Duration::from_secs(10)),
            "the kill switch never reached Envoy"
        );
        let r = queued.join().expect("queued request");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header("x-sluice-provider"),
            Some("openai"),
            "the queued request left the queue for the fallback: {:?}",
            r.headers
        );
        assert_eq!(fallback_chats(), 1);
        switch(false);
        assert!(
            wait_for(Duration::from_secs(10), || s
                .envoy
                .metric("sluice_kill_switch_active", &[])
                == Some(0.0)),
            "the release never reached Envoy"
        );
        for call in slow {
            assert_eq!(call.join().expect("slow call").status, 200);
        }
    });
    let before = s.upstream_requests();
    let again = s.chat("demo-free-key", &question, &[]);
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(
        again.header("x-sluice-cache"),
        Some("miss"),
        "the fallback's answer was served as the primary's: {:?}",
        again.headers
    );
    assert_eq!(s.upstream_requests(), before + 1, "the primary answers it");
    assert_eq!(fallback_chats(), 1);
}

/// Issue 29 item 7, the cache stampede: identical questions asked at once
/// make one upstream call, the others wait for its answer and are served
/// from the store; for a model without a queue (llama3.1:8b) and for one
/// whose requests queue for 2 slots (mistral:7b). Before: 150 identical
/// questions made about as many upstream calls, and queued ones never
/// looked at the cache again.
#[test]
fn identical_questions_asked_at_once_make_one_upstream_call() {
    let cache = json!({"salt": SALT, "models": {
        "llama3.1:8b": {"exact": true}, "mistral:7b": {"exact": true}}});
    let s = start(cache, "", |_| {});
    for (model, n) in [("llama3.1:8b", 150), ("mistral:7b", 100)] {
        let body = chat(model, &format!("Asked by everyone at once ({model})?"));
        let before = s.upstream_requests();
        let answers: Vec<Response> = std::thread::scope(|scope| {
            let calls: Vec<_> = (0..n)
                .map(|_| {
                    let (s, body) = (&s, &body);
                    // The upstream slow enough that all of them ask before
                    // its answer is stored.
                    scope.spawn(move || s.chat(B, body, &[("x-mock-latency-ms", "1500")]))
                })
                .collect();
            calls
                .into_iter()
                .map(|c| c.join().expect("request"))
                .collect()
        });
        let calls = s.upstream_requests() - before;
        let hits = answers
            .iter()
            .filter(|r| r.header("x-sluice-cache") == Some("hit"))
            .count();
        eprintln!("{n} identical questions to {model}: {calls} upstream call(s), {hits} hits");
        for r in &answers {
            assert_eq!(r.status, 200, "{model}: {r:?}");
        }
        assert_eq!(
            calls, 1,
            "{model}: one upstream call for {n} identical questions"
        );
        assert_eq!(hits, n - 1, "{model}: the others answered from the store");
    }
}
