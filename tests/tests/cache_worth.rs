//! What the response cache is worth, against a real Envoy, the real
//! sidecar and mock-llm, on every API the cache serves (OpenAI chat and
//! completions, Ollama chat and generate; Anthropic messages, the
//! Responses API and embeddings are never cached): a hit leaves the
//! caller's token and spend budgets where the miss left them, holds no
//! reservation, charges no tokens or spend, and raises
//! `sluice_cache_saved_tokens_total{tier,model}` and
//! `sluice_cache_saved_spend_micros_total{tier,model}` by what the first
//! answer cost.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): every
//! answer reports its usage, which the miss settles and the hit saves.

use std::fs;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::{get, post_json, prometheus_value, wait_for, Envoy, MockLlm, Response, Sidecar};

/// A caller with a daily token budget, and one with a daily spend budget.
const TOKENS_KEY: &str = "worth-tokens-key";
const SPEND_KEY: &str = "worth-spend-key";
const TIER: &str = "worth";
const SPEND_TIER: &str = "worth-spend";
const MODEL: &str = "llama3.1:8b";
/// The budgets: 2,000 tokens, 0.02 (20,000 micros).
const TOKEN_LIMIT: f64 = 2000.0;
const SPEND_LIMIT: f64 = 20_000.0;

struct Stack {
    envoy: Envoy,
    sidecar: Sidecar,
    _upstream: MockLlm,
    _dir: tempfile::TempDir,
}

/// `slots`: the exact tier in Envoy (0: every entry in the sidecar).
fn start(slots: u64) -> Stack {
    let upstream = MockLlm::start("primary");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sidecar.yaml");
    fs::write(&config, "sources: {gpu: simulated}\ncache: {}\n").unwrap();
    let sidecar = Sidecar::start_with_args(&["--config", &config.display().to_string()]);
    let mut cfg = sluice_tests::shipped_config_for(&upstream);
    cfg.set_cluster_addr("sluice_sidecar", sidecar.addr());
    let policy = cfg.policy_mut();
    policy["cache"] = serde_yaml::to_value(json!({
        "salt": "cache-worth-salt-0123456789",
        "in_envoy": {"slots": slots},
        "models": {MODEL: {"exact": true}},
    }))
    .unwrap();
    policy["tiers"][TIER] = serde_yaml::from_str("{daily_tokens: 2000}").unwrap();
    policy["tiers"][SPEND_TIER] = serde_yaml::from_str("{daily_spend: \"0.02\"}").unwrap();
    let keys = &mut policy["identity"]["api_key"]["keys"];
    keys[TOKENS_KEY] = serde_yaml::Value::from(TIER);
    keys[SPEND_KEY] = serde_yaml::Value::from(SPEND_TIER);
    // 10 per 1M input tokens and 30 per 1M output: 10 and 30 micros each.
    policy["models"][MODEL] =
        serde_yaml::from_str("{price: {input: \"10\", output: \"30\"}}").unwrap();
    let envoy = Envoy::start(&cfg, 2);
    Stack {
        envoy,
        sidecar,
        _upstream: upstream,
        _dir: dir,
    }
}

/// One question per API the cache serves: (path, body), `text` asked.
fn questions(text: &str) -> Vec<(&'static str, Value)> {
    let messages = json!([{"role": "user", "content": text}]);
    vec![
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0}),
        ),
        (
            "/api/chat",
            json!({"model": MODEL, "messages": messages, "stream": false,
                   "options": {"num_predict": 8, "temperature": 0}}),
        ),
        (
            "/api/generate",
            json!({"model": MODEL, "prompt": text, "stream": false,
                   "options": {"num_predict": 8, "temperature": 0}}),
        ),
    ]
}

/// What Envoy's stats say of a tier's money and the cache's worth.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Books {
    tokens: f64,
    spend: f64,
    saved_tokens: f64,
    saved_spend: f64,
    reservations: f64,
}

impl Stack {
    /// Every caller of the test is alone in its tier, and the spend
    /// counter is the whole Envoy's: one caller asks at a time.
    fn books(&self, tier: &str) -> Books {
        let text = self.envoy.stats_prometheus();
        let v = |name: &str, labels: &[(&str, &str)]| {
            prometheus_value(&text, name, labels).unwrap_or(0.0)
        };
        let ours = [("tier", tier), ("model", MODEL)];
        Books {
            tokens: v(
                "sluice_tokens_total",
                &[("kind", "actual"), ("tier", tier), ("model", MODEL)],
            ),
            spend: v("sluice_spend_micros_total", &[]),
            saved_tokens: v("sluice_cache_saved_tokens_total", &ours),
            saved_spend: v("sluice_cache_saved_spend_micros_total", &ours),
            reservations: v("sluice_reservations_outstanding", &[]),
        }
    }

    fn stored(&self) -> f64 {
        let text = self.envoy.stats_prometheus();
        prometheus_value(&text, "sluice_cache_total", &[("result", "store")]).unwrap_or(0.0)
    }

    fn ask(&self, key: &str, path: &str, body: &Value) -> Response {
        post_json(&self.envoy.url(path), &[("x-api-key", key)], body)
    }

    /// What is left of `key`'s daily budget: a question whose input alone
    /// is larger is refused (reserving nothing), and the refusal says.
    fn left(&self, key: &str, path: &str, probe: &Value) -> f64 {
        let r = self.ask(key, path, probe);
        assert_eq!(r.status, 429, "{path}: the probe was admitted: {}", r.body);
        let sluice = &r.json()["error"]["sluice"];
        assert!(
            sluice["bucket"].as_str().unwrap_or("").contains("daily"),
            "{path}: {}",
            r.body
        );
        sluice["remaining"].as_f64().unwrap()
    }
}

/// Per API, for a caller of `key` in `tier` whose daily budget counts
/// `tokens` or spend: a miss spends, two hits of the same question spend
/// nothing, hold nothing and save what the miss cost, each.
fn hits_cost_nothing_and_save_what_the_miss_cost(s: &Stack, key: &str, tier: &str, tokens: bool) {
    let first = s.books(tier);
    let long = "word ".repeat(10_000);
    let probes = questions(&long);
    for (n, (path, body)) in questions("What is the cache worth?")
        .into_iter()
        .enumerate()
    {
        let probe = &probes[n].1;
        let stored = s.stored();
        let before = s.books(tier);
        let left_before = s.left(key, path, probe);
        let miss = s.ask(key, path, &body);
        assert_eq!(miss.status, 200, "{path}: {}", miss.body);
        assert_eq!(miss.header("x-sluice-cache"), Some("miss"), "{path}");
        assert!(
            wait_for(Duration::from_secs(10), || s.stored() > stored),
            "{path}: never stored:\n{}",
            s.sidecar.log()
        );
        let after_miss = s.books(tier);
        let cost = (
            after_miss.tokens - before.tokens,
            after_miss.spend - before.spend,
        );
        assert!(
            cost.0 > 0.0 && cost.1 > 0.0,
            "{path}: {before:?} {after_miss:?}"
        );
        let left = s.left(key, path, probe);
        let charged = if tokens { cost.0 } else { cost.1 };
        assert_eq!(left_before - left, charged, "{path}: the miss's charge");
        for _ in 0..2 {
            let hit = s.ask(key, path, &body);
            assert_eq!(hit.status, 200, "{path}: {}", hit.body);
            assert_eq!(hit.header("x-sluice-cache"), Some("hit"), "{path}");
        }
        assert_eq!(
            s.left(key, path, probe),
            left,
            "{path}: a hit spent the budget"
        );
        let after = s.books(tier);
        assert_eq!(after.tokens, after_miss.tokens, "{path}: tokens charged");
        assert_eq!(after.spend, after_miss.spend, "{path}: spend charged");
        assert_eq!(after.reservations, 0.0, "{path}: a reservation held");
        assert_eq!(
            after.saved_tokens - after_miss.saved_tokens,
            2.0 * cost.0,
            "{path}: saved tokens"
        );
        assert_eq!(
            after.saved_spend - after_miss.saved_spend,
            2.0 * cost.1,
            "{path}: saved spend"
        );
    }
    let limit = if tokens { TOKEN_LIMIT } else { SPEND_LIMIT };
    let now = s.books(tier);
    let spent = if tokens {
        now.tokens - first.tokens
    } else {
        now.spend - first.spend
    };
    assert_eq!(
        s.left(key, "/v1/chat/completions", &probes[0].1),
        limit - spent
    );
}

fn both_callers(s: &Stack) {
    hits_cost_nothing_and_save_what_the_miss_cost(s, TOKENS_KEY, TIER, true);
    let spent = s.books(TIER).spend;
    // The spend counter is the Envoy's: the second caller's books start
    // where the first's ended.
    assert!(spent > 0.0);
    hits_cost_nothing_and_save_what_the_miss_cost(s, SPEND_KEY, SPEND_TIER, false);
}

#[test]
fn a_hit_in_the_sidecar_spends_no_budget_on_any_cached_api() {
    let s = start(0);
    both_callers(&s);
    // The sidecar saw the same hits: its own count by model agrees.
    let text = get(&s.sidecar.url("/metrics"), &[]).body;
    let saved = prometheus_value(
        &text,
        "sluice_sidecar_cache_saved_spend_micros_total",
        &[("model", MODEL)],
    );
    let filter = s.books(TIER).saved_spend + s.books(SPEND_TIER).saved_spend;
    assert_eq!(saved, Some(filter));
}

#[test]
fn a_hit_in_envoys_own_tier_spends_no_budget_on_any_cached_api() {
    let s = start(2048);
    both_callers(&s);
}

/// An API the cache does not serve is never a hit, and saves nothing.
#[test]
fn anthropic_messages_are_not_cached() {
    let s = start(0);
    let body = json!({"model": MODEL, "max_tokens": 8,
                      "messages": [{"role": "user", "content": "Cached?"}]});
    for _ in 0..2 {
        let r = s.ask(TOKENS_KEY, "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-sluice-cache"), None, "{:?}", r.headers);
    }
    assert_eq!(s.books(TIER).saved_tokens, 0.0);
    assert_eq!(s.books(TIER).saved_spend, 0.0);
}
