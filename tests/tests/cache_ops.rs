//! Operating the response cache (issue 20, item 8) against the real
//! sidecar binary: the admin purge by scope and by model (entries and
//! their vectors), the bounds per scope under a flood from one scope and
//! from many, and the operator page's cache panel (its data, and drawn in
//! headless Chromium when it is installed). The filter is not
//! involved (the sidecar is spoken to as the Envoy beside it speaks:
//! loopback, JSON, the store's `scope` id).
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): purges and
//! bounds are the sidecar's, whichever server wrote the entries.

use std::fs;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_core::bench::sha256_hex;
use sluice_tests::browser::Browser;
use sluice_tests::{get, post_json, MockLlm, Response, Sidecar};

const TOKEN: &str = "cache-ops-admin-token-0123456789abcdef";

struct Ops {
    sidecar: Sidecar,
    _upstream: MockLlm,
    _dir: tempfile::TempDir,
}

/// A sidecar holding the cache in memory with `bounds` (YAML lines under
/// `cache:`) and mock-llm's embeddings.
fn start(bounds: &str) -> Ops {
    let upstream = MockLlm::start("embeddings");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sidecar.yaml");
    let embeddings = upstream.url("/v1/embeddings");
    let yaml = format!(
        "sources: {{gpu: simulated}}\ncache:\n  backend: memory\n  embeddings: {{url: \"{embeddings}\", model: mock-embed, timeout: 2s}}\n{bounds}"
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
    Ops {
        sidecar,
        _upstream: upstream,
        _dir: dir,
    }
}

fn hex(s: &str) -> String {
    sha256_hex(s.as_bytes())
}

impl Ops {
    /// Stores an answer for `scope` (a scope value, e.g. `team:a`) under
    /// the key of `name`; semantic when `text` is given.
    fn store(&self, scope: &str, name: &str, model: &str, text: Option<&str>) -> Response {
        let mut body = json!({
            "key": hex(name), "model": model, "ttl_s": 600,
            "entry": {"body": format!("answer for {name}"), "prompt_tokens": 10,
                      "completion_tokens": 5, "spend_micros": 40},
        });
        if let Some(t) = text {
            body["semantic"] = json!({"context": hex(&format!("{scope}/{model}")), "text": t});
        }
        body["scope"] = json!(hex(scope));
        post_json(&self.sidecar.url("/v1/cache/store"), &[], &body)
    }

    fn stored(&self, scope: &str, name: &str, model: &str, text: Option<&str>) {
        let r = self.store(scope, name, model, text).ok();
        assert_eq!(r.json()["stored"], true, "{}", r.body);
    }

    /// The body a lookup of `name` finds (exact), if any.
    fn exact(&self, name: &str, model: &str) -> Option<String> {
        let r = post_json(
            &self.sidecar.url("/v1/cache/lookup"),
            &[],
            &json!({"key": hex(name), "model": model}),
        )
        .ok();
        r.json()["hit"]["entry"]["body"].as_str().map(String::from)
    }

    /// Whether a paraphrase of a semantic entry is found (another key).
    fn semantic(&self, scope: &str, model: &str, text: &str) -> bool {
        let r = post_json(
            &self.sidecar.url("/v1/cache/lookup"),
            &[],
            &json!({"key": hex("never stored"), "model": model,
                    "semantic": {"context": hex(&format!("{scope}/{model}")), "text": text}}),
        )
        .ok();
        r.json()["hit"]["kind"] == "semantic"
    }

    fn purge(&self, body: Value, token: &str) -> Response {
        let auth = format!("Bearer {token}");
        post_json(
            &self.sidecar.url("/v1/cache/purge"),
            &[("authorization", auth.as_str())],
            &body,
        )
    }

    fn cache_panel(&self) -> Value {
        get(&self.sidecar.url("/v1/history"), &[]).ok().json()["cache"].clone()
    }
}

#[test]
fn purge_by_scope_by_model_and_whole() {
    let ops = start("");
    for (scope, who) in [("team:a", "a"), ("team:b", "b")] {
        for model in ["m1", "m2"] {
            ops.stored(
                scope,
                &format!("{who}-{model}"),
                model,
                Some("How do I enable 2FA on my account?"),
            );
        }
    }
    assert_eq!(ops.cache_panel()["vectors"], 4);
    // The token is required; a wrong one purges nothing.
    assert_eq!(ops.purge(json!({}), "wrong-token-xxxxxxxxxxxx").status, 401);
    assert_eq!(ops.exact("a-m1", "m1").as_deref(), Some("answer for a-m1"));
    // A bad field is named.
    let bad = ops.purge(json!({"scope": 3}), TOKEN);
    assert_eq!(bad.status, 400);
    assert!(bad.json()["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("scope"));
    // One model of one scope.
    let r = ops
        .purge(json!({"scope": "team:a", "model": "m2"}), TOKEN)
        .ok();
    assert_eq!(r.json()["purged"], 1);
    assert_eq!(ops.exact("a-m2", "m2"), None);
    assert!(ops.exact("a-m1", "m1").is_some() && ops.exact("b-m2", "m2").is_some());
    // A whole scope: its entries and its vectors (a paraphrase no longer
    // hits), the other scope's untouched.
    assert!(ops.semantic("team:a", "m1", "how do I enable 2FA on my account"));
    let r = ops.purge(json!({"scope": "team:a"}), TOKEN).ok();
    assert_eq!(r.json()["purged"], 1);
    assert_eq!(ops.exact("a-m1", "m1"), None);
    assert!(!ops.semantic("team:a", "m1", "how do I enable 2FA on my account"));
    assert!(ops.semantic("team:b", "m1", "how do I enable 2FA on my account"));
    assert_eq!(ops.cache_panel()["vectors"], 2);
    // By model across scopes, then everything.
    let r = ops.purge(json!({"model": "m1"}), TOKEN).ok();
    assert_eq!(r.json()["purged"], 1);
    assert!(ops.exact("b-m2", "m2").is_some());
    let r = ops.purge(json!({}), TOKEN).ok();
    assert_eq!(r.json()["purged"], 1);
    let panel = ops.cache_panel();
    assert_eq!(
        (panel["entries"].clone(), panel["vectors"].clone()),
        (json!(0), json!(0))
    );
}

#[test]
fn one_scope_flooding_cannot_evict_the_others() {
    let ops = start("  max_entries: 50\n");
    for who in ["team:a", "team:b"] {
        for i in 0..10 {
            ops.stored(who, &format!("{who}/{i}"), "m", None);
        }
    }
    // One caller stores 300 distinct answers.
    let flood = "principal:ip:203.0.113.9";
    for i in 0..300 {
        ops.stored(flood, &format!("{flood}/{i}"), "m", None);
    }
    for who in ["team:a", "team:b"] {
        for i in 0..10 {
            let name = format!("{who}/{i}");
            assert!(ops.exact(&name, "m").is_some(), "{name} was evicted");
        }
    }
    // The flood holds the rest: its newest 30.
    let kept = (0..300)
        .filter(|i| ops.exact(&format!("{flood}/{i}"), "m").is_some())
        .count();
    assert_eq!(kept, 30);
    assert!(ops.exact(&format!("{flood}/299"), "m").is_some());
    assert_eq!(ops.cache_panel()["scopes"], 3);
    // A scope id that is not a hash is refused, naming the field.
    let r = post_json(
        &ops.sidecar.url("/v1/cache/store"),
        &[],
        &json!({"key": hex("x"), "model": "m", "ttl_s": 60, "scope": "team:a",
                "entry": {"body": "b", "prompt_tokens": 1, "completion_tokens": 1}}),
    );
    assert_eq!(r.status, 400);
    assert!(r.body.contains("scope: 64 hex digits"), "{}", r.body);
}

#[test]
fn many_scopes_flooding_never_push_a_scope_below_its_floor() {
    // 40 entries, so a floor of 4 per scope: a caller holds 20, then 30
    // new scopes store 3 each (each within the floor). The large scope
    // gives way down to its floor; the newcomers fill the rest; once every
    // scope is within its floor, later scopes' answers are not stored
    // (`full`), and nobody already there loses an entry to them.
    let ops = start(
        "  max_entries: 40
",
    );
    for i in 0..20 {
        ops.stored("team:big", &format!("big/{i}"), "m", None);
    }
    let mut refused = 0;
    for s in 0..30 {
        let scope = format!("principal:ip:198.51.100.{s}");
        for i in 0..3 {
            let r = ops.store(&scope, &format!("{scope}/{i}"), "m", None).ok();
            let a = r.json();
            if a["stored"] == false {
                assert_eq!(a["reason"], "full", "{a}");
                refused += 1;
            }
        }
    }
    let big = (0..20)
        .filter(|i| ops.exact(&format!("big/{i}"), "m").is_some())
        .count();
    let small: Vec<usize> = (0..30)
        .map(|s| {
            let scope = format!("principal:ip:198.51.100.{s}");
            (0..3)
                .filter(|i| ops.exact(&format!("{scope}/{i}"), "m").is_some())
                .count()
        })
        .collect();
    assert_eq!(big, 4, "the large scope keeps its floor");
    assert_eq!(small[..12], [3; 12], "{small:?}");
    assert_eq!(small[12..], [0; 18], "{small:?}");
    assert_eq!(refused, 18 * 3);
    // The newest 4 of the large scope are what it kept.
    assert!((16..20).all(|i| ops.exact(&format!("big/{i}"), "m").is_some()));
}

#[test]
fn the_operator_page_shows_the_cache() {
    let ops = start("");
    let panel = ops.cache_panel();
    assert_eq!(panel["hit_rate"], Value::Null, "no lookups yet: {panel}");
    ops.stored("team:a", "q1", "m", None);
    assert!(ops.exact("q1", "m").is_some());
    assert!(ops.exact("q2", "m").is_none());
    let panel = ops.cache_panel();
    assert_eq!(panel["where"], "memory");
    assert_eq!(panel["lookups"], 2);
    assert_eq!(panel["hits"], 1);
    assert_eq!(panel["hit_rate"], 0.5);
    assert_eq!(panel["entries"], 1);
    assert!(panel["bytes"].as_u64().unwrap() > 0);
    assert_eq!(panel["saved_tokens"], 15);
    assert_eq!(panel["saved_spend_micros"], 40);
    // The page draws it, through textContent only.
    let html = get(&ops.sidecar.url("/"), &[]).ok().body;
    assert!(html.contains("id=\"cache-section\""));
    for column in [
        "Hit rate",
        "Entries",
        "Bytes",
        "Saved tokens",
        "Saved spend",
    ] {
        assert!(html.contains(column), "{column}");
    }
    let js = get(&ops.sidecar.url("/page.js"), &[]).ok().body;
    assert!(js.contains("function renderCache") && js.contains("renderCache(h)"));
    assert!(!js.contains("innerHTML"));
}

#[test]
fn without_a_cache_the_page_has_no_panel_data() {
    let sidecar = Sidecar::start();
    let h = get(&sidecar.url("/v1/history"), &[]).ok().json();
    assert_eq!(h["cache"], Value::Null);
}

#[test]
fn the_cache_panel_draws_in_headless_chromium() {
    let Some(browser) = Browser::start() else {
        return;
    };
    let ops = start("");
    ops.stored("team:a", "q1", "m", None);
    assert!(ops.exact("q1", "m").is_some());
    assert!(ops.exact("q2", "m").is_none());
    browser.goto(&ops.sidecar.url("/"));
    let drawn = browser.wait_until(
        Duration::from_secs(15),
        "const s = document.querySelector('#cache-section'); \
         const r = document.querySelector('#cache tbody td.hit-rate'); \
         return !!s && !s.hidden && !!r && r.textContent === '50.0 %';",
    );
    let text = browser.eval(
        "return document.querySelector('#cache-section').textContent;",
        &[],
    );
    assert!(drawn, "{text}");
    let text = text.as_str().unwrap_or_default().to_string();
    for shown in [
        "1 (1 / 0)",
        "1 of 10000",
        "15",
        "0.000040",
        "entries in memory",
    ] {
        assert!(text.contains(shown), "{shown} in {text}");
    }
}
