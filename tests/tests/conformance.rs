//! Every API sluice reads debits every budget that applies, through a real
//! Envoy: for each budget kind (a caller's own, a tier's total of
//! undeclared callers, a team's, an organisation's spend, a run's), each
//! API (OpenAI chat, completions, embeddings, Responses; Anthropic
//! messages; Ollama chat, generate, embed; a declared API), streamed and
//! not where the API streams, the budget's remaining falls by exactly what
//! the request settled. A provider's spend budget applies only to a request
//! its rung serves (the primary out); its row, for every API a provider
//! speaks, is `core/src/admission/provider_tests.rs` (the declared API is
//! the application's own: no provider serves it).
//!
//! How a budget's remaining is read: a probe whose input alone is larger
//! than the budget is refused by it, and the refusal says what is left
//! (`error.sluice.remaining`); a refused probe holds nothing. What a request
//! settled is the filter's own count (`sluice_tokens_total{kind="actual"}`,
//! `sluice_spend_micros_total`).
//!
//! Upstream: mock-llm's own personality (every API, usage reported); the
//! declared API is an Envoy route rewriting `/app/chat` to mock-llm's chat
//! completions, declared with the answer's usage pointers.

use std::time::Duration;

use serde_json::{json, Value as Json};
use sluice_tests::{post_json, wait_for, EnvoyConfig, Stack};

const MODEL: &str = "llama3.1:8b";
/// A token budget's limit; the probe's input is far above it.
const TOKENS: u64 = 6_000;
/// A spend budget's limit (currency units) at the price below.
const SPEND: f64 = 1.0;
/// Per 1M tokens: 100 micro-units a token, so a request spends thousands.
const PRICE: &str = "100";

/// One budget kind: how to declare it, who calls, what it counts.
struct Budget {
    name: &'static str,
    /// Policy sections set (tiers, teams, orgs, runs).
    policy: fn() -> Vec<(&'static str, Json)>,
    headers: &'static [(&'static str, &'static str)],
    bucket: &'static str,
    spend: bool,
}

const BUDGETS: &[Budget] = &[
    Budget {
        name: "caller",
        policy: || vec![("tiers", json!({"pro": {"daily_tokens": TOKENS}}))],
        headers: &[("x-api-key", "demo-pro-key")],
        bucket: "tier/pro/daily_tokens",
        spend: false,
    },
    Budget {
        name: "tier",
        policy: || {
            vec![(
                "tiers",
                json!({"free": {"anonymous_total": {"daily_tokens": TOKENS}}}),
            )]
        },
        headers: &[],
        bucket: "tier/free/anonymous/daily_tokens",
        spend: false,
    },
    Budget {
        name: "team",
        policy: || vec![("teams", json!({"search": {"daily_tokens": TOKENS}}))],
        headers: &[("x-api-key", "demo-search-key-1")],
        bucket: "team/search/daily_tokens",
        spend: false,
    },
    Budget {
        name: "org",
        policy: || vec![("orgs", json!({"demo": {"daily_spend": SPEND}}))],
        headers: &[("x-api-key", "demo-search-key-1")],
        bucket: "org/demo/daily_spend",
        spend: true,
    },
    Budget {
        name: "run",
        policy: || {
            vec![(
                "runs",
                json!({"id": {"header": "x-session-id"}, "ttl": "1h", "tokens": TOKENS}),
            )]
        },
        headers: &[("x-api-key", "demo-pro-key"), ("x-session-id", "run-1")],
        bucket: "run/tokens",
        spend: false,
    },
];

/// One API call: its path and body, streamed or not.
fn calls() -> Vec<(&'static str, &'static str, Json)> {
    let msgs = json!([{"role": "user", "content": "say something short"}]);
    let mut out = Vec::new();
    for stream in [false, true] {
        out.extend([
            ("openai chat", "/v1/chat/completions",
             json!({"model": MODEL, "max_tokens": 16, "messages": msgs, "stream": stream})),
            ("openai completions", "/v1/completions",
             json!({"model": MODEL, "max_tokens": 16, "prompt": "say something", "stream": stream})),
            ("openai responses", "/v1/responses",
             json!({"model": MODEL, "max_output_tokens": 16, "input": "say something", "stream": stream})),
            ("anthropic messages", "/v1/messages",
             json!({"model": MODEL, "max_tokens": 16, "messages": msgs, "stream": stream})),
            ("ollama chat", "/api/chat",
             json!({"model": MODEL, "messages": msgs, "stream": stream, "options": {"num_predict": 16}})),
            ("ollama generate", "/api/generate",
             json!({"model": MODEL, "prompt": "say something", "stream": stream, "options": {"num_predict": 16}})),
        ]);
        // Embeddings do not stream; the declared API's service answers whole.
        if !stream {
            out.extend([
                (
                    "declared",
                    "/app/chat",
                    json!({"model": MODEL, "max_tokens": 16, "messages": msgs}),
                ),
                (
                    "openai embeddings",
                    "/v1/embeddings",
                    json!({"model": MODEL, "input": ["one text", "another"]}),
                ),
                (
                    "ollama embed",
                    "/api/embed",
                    json!({"model": MODEL, "input": ["one text"]}),
                ),
            ]);
        }
    }
    out
}

/// The shipped config with this budget alone (no other token or spend
/// budget, no rate in the way), the model priced, and the declared API.
fn start(budget: &Budget) -> Stack {
    Stack::start(|cfg| {
        let set = |cfg: &mut EnvoyConfig, key: &str, v: Json| {
            cfg.policy_mut()[key] = serde_yaml::to_value(v).expect("YAML");
        };
        set(
            cfg,
            "tiers",
            json!({"free": {}, "pro": {}, "enterprise": {}}),
        );
        set(cfg, "teams", json!({"search": {}}));
        set(cfg, "orgs", json!({"demo": {}}));
        set(
            cfg,
            "models",
            json!({MODEL: {"price": {"input": PRICE, "output": PRICE}}}),
        );
        set(cfg, "classes", json!({}));
        set(
            cfg,
            "apis",
            json!([{"path": "/app/chat", "model": "/model", "input": ["/messages"],
                    "output_limit": "/max_tokens",
                    "answer": {"text": "/choices/0/message/content",
                               "input_tokens": "/usage/prompt_tokens",
                               "output_tokens": "/usage/completion_tokens"}}]),
        );
        if let Some(p) = cfg.policy_mut().as_mapping_mut() {
            for key in ["default_class", "ladder", "providers", "fallback", "cache"] {
                p.remove(key);
            }
        }
        // The budget's own sections, merged over the empty ones.
        for (key, v) in (budget.policy)() {
            for (name, section) in v.as_object().expect("a map") {
                cfg.policy_mut()[key][name.as_str()] = serde_yaml::to_value(section).expect("YAML");
            }
        }
        declared_route(cfg);
    })
}

/// `/app/chat` goes to mock-llm's chat completions (before the catch-all).
fn declared_route(cfg: &mut EnvoyConfig) {
    let routes = &mut cfg.hcm_mut()["route_config"]["virtual_hosts"][0]["routes"];
    let list = routes.as_sequence_mut().expect("routes");
    let mut route = list.last().expect("a catch-all route").clone();
    route["match"] = serde_yaml::to_value(json!({"path": "/app/chat"})).unwrap();
    route["route"]["prefix_rewrite"] = "/v1/chat/completions".into();
    let at = list.len() - 1;
    list.insert(at, route);
}

/// What the budget has left, as its refusal of a probe says.
fn remaining(stack: &Stack, budget: &Budget) -> u64 {
    let huge = "word ".repeat(150_000);
    let probe = json!({"model": MODEL, "max_tokens": 16,
                       "messages": [{"role": "user", "content": huge}]});
    let resp = post_json(
        &stack.envoy.url("/v1/chat/completions"),
        budget.headers,
        &probe,
    );
    assert_eq!(resp.status, 429, "{}: probe {resp:?}", budget.name);
    let error = resp.json()["error"].clone();
    assert_eq!(
        error["sluice"]["bucket"], budget.bucket,
        "{}: {error}",
        budget.name
    );
    error["sluice"]["remaining"].as_u64().expect("remaining")
}

/// What the filter settled so far: tokens, or spend in micro-units.
fn settled(stack: &Stack, spend: bool) -> u64 {
    let text = stack.envoy.stats_prometheus();
    if spend {
        return sluice_tests::prometheus_value(&text, "sluice_spend_micros_total", &[])
            .unwrap_or(0.0) as u64;
    }
    ["input", "output"]
        .iter()
        .map(|d| {
            let labels = [("direction", *d), ("kind", "actual")];
            sluice_tests::prometheus_value(&text, "sluice_tokens_total", &labels).unwrap_or(0.0)
                as u64
        })
        .sum()
}

fn drained(stack: &Stack) -> bool {
    wait_for(Duration::from_secs(10), || {
        stack.envoy.metric("sluice_reservations_outstanding", &[]) == Some(0.0)
    })
}

/// The counters settle after the answer is sent: wait until they move
/// past `before` and hold still.
fn settled_after(stack: &Stack, spend: bool, before: u64) -> u64 {
    let mut last = before;
    wait_for(Duration::from_secs(10), || {
        let now = settled(stack, spend);
        let still = now == last && now > before;
        last = now;
        still
    });
    last
}

#[test]
fn every_api_debits_every_budget_that_applies() {
    let mut misses = Vec::new();
    for budget in BUDGETS {
        let stack = start(budget);
        for (api, path, body) in calls() {
            let stream = body["stream"].as_bool().unwrap_or(false);
            let before = (remaining(&stack, budget), settled(&stack, budget.spend));
            let resp = post_json(&stack.envoy.url(path), budget.headers, &body);
            assert_eq!(resp.status, 200, "{} {api}: {resp:?}", budget.name);
            assert!(drained(&stack), "{} {api}: a reservation left", budget.name);
            let charged = settled_after(&stack, budget.spend, before.1) - before.1;
            let after = remaining(&stack, budget);
            let fell = before.0.saturating_sub(after);
            if charged == 0 || fell != charged {
                misses.push(format!(
                    "{} × {api} (stream {stream}): settled {charged}, remaining fell {fell}",
                    budget.name
                ));
            }
        }
    }
    assert!(misses.is_empty(), "{misses:#?}");
}
