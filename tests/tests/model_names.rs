//! One identity per model (issue 48, "Model names as the client spells
//! them"): Ollama resolves `LLAMA3.1:70B`, `library/llama3.1:70b` and
//! `registry.ollama.ai/library/llama3.1:70b` to `llama3.1:70b`, so each
//! spelling must meet that model's limit, concurrency and price — before,
//! each was an unlisted model: 8 of 8 admitted past its 5/min, 6 in flight
//! past its concurrency of 2, priced at 0. And a model the policy does not
//! list is refused, not run for free.
//!
//! Upstream: mock-llm playing Ollama (`Personality::Ollama`), the server
//! whose naming rules these are.

use std::time::Duration;

use serde_json::{json, Value as Json};
use sluice_tests::{
    async_client, post_json, post_json_async, prometheus_value, runtime, wait_for, EnvoyConfig,
    Personality, Response, Stack,
};

const MODEL: &str = "llama3.1:70b";

/// Eight ways a client spells `llama3.1:70b` that Ollama reads as it.
const SPELLINGS: [&str; 8] = [
    "llama3.1:70b",
    "LLAMA3.1:70B",
    "library/llama3.1:70b",
    "registry.ollama.ai/library/llama3.1:70b",
    "Llama3.1:70B",
    "LIBRARY/llama3.1:70b",
    "llama3.1:70b:local",
    "https://registry.ollama.ai/library/LLAMA3.1:70b",
];

fn set(cfg: &mut EnvoyConfig, path: &[&str], value: Json) {
    let mut node = cfg.policy_mut();
    for key in &path[..path.len() - 1] {
        node = &mut node[*key];
    }
    node[path[path.len() - 1]] = serde_yaml::to_value(value).expect("YAML");
}

/// The demo policy with `llama3.1:70b` at `requests`, 2 in flight, every
/// output token 1,000 micro-units (input free), and all of its buckets
/// open to anonymous callers.
fn stack(requests: &str) -> Stack {
    Stack::start_as(Personality::Ollama, |cfg| {
        set(
            cfg,
            &["models", MODEL],
            json!({
                "requests": requests,
                "concurrency": 2,
                "downshift_to": "llama3.1:8b",
                "price": {"input_per_1k": 0, "output_per_1k": 1.0},
                "shares": {"anonymous": "100%"},
            }),
        );
    })
}

fn chat(model: &str) -> Json {
    json!({"model": model, "stream": false, "options": {"num_predict": 10},
           "messages": [{"role": "user", "content": "hi"}]})
}

const TEN_TOKENS: (&str, &str) = ("x-mock-output-tokens", "10");

fn spent(stack: &Stack) -> Option<f64> {
    prometheus_value(
        &stack.envoy.stats_prometheus(),
        "sluice_spend_micros_total",
        &[],
    )
}

/// Finding: 8 of 8 spellings admitted past the model's 5/min, priced at 0.
#[test]
fn every_spelling_meets_the_models_limit_and_price() {
    let stack = stack("5/min");
    let url = stack.envoy.url("/api/chat");
    let mut statuses = Vec::new();
    for spelt in SPELLINGS {
        let resp = post_json(&url, &[TEN_TOKENS], &chat(spelt));
        if resp.status == 200 {
            // The server gets the policy's name: it runs the model that
            // was limited and priced.
            let sent = &stack.upstream.stats()["last_request"]["body"]["model"];
            assert_eq!(sent, MODEL, "{spelt}");
        } else {
            assert_eq!(resp.status, 429, "{spelt}: {resp:?}");
            assert_eq!(
                resp.header("x-sluice-reason"),
                Some("model_rate_limit"),
                "{spelt}"
            );
        }
        statuses.push(resp.status);
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429, 429]);
    assert_eq!(stack.upstream_requests(), 5);
    // Charged at the model's price: 5 × 10 output tokens × 1,000.
    assert!(
        wait_for(Duration::from_secs(10), || spent(&stack) == Some(50_000.0)),
        "spend {:?}",
        spent(&stack)
    );
}

/// Finding: 6 in flight past the model's concurrency of 2.
#[test]
fn every_spelling_shares_the_models_concurrency() {
    let stack = stack("100/min");
    let url = stack.envoy.url("/api/chat");
    let responses: Vec<Response> = runtime().block_on(async {
        let calls: Vec<_> = SPELLINGS
            .iter()
            .map(|spelt| {
                let (url, body) = (url.clone(), chat(spelt));
                tokio::spawn(async move {
                    let client = async_client();
                    let headers = [TEN_TOKENS, ("x-mock-latency-ms", "300")];
                    post_json_async(&client, &url, &headers, &body).await
                })
            })
            .collect();
        let mut out = Vec::new();
        for call in calls {
            out.push(call.await.expect("task").expect("request"));
        }
        out
    });
    // Anonymous callers are `standard`: they wait for a slot, so all are
    // served, never more than 2 at once.
    for r in &responses {
        assert_eq!(r.status, 200, "{r:?}");
    }
    let stats = stack.upstream.stats();
    assert_eq!(stats["peak_in_flight"], 2, "{stats}");
    assert_eq!(stats["requests_total"], 8, "{stats}");
    assert!(
        wait_for(Duration::from_secs(10), || spent(&stack) == Some(80_000.0)),
        "spend {:?}",
        spent(&stack)
    );
}

/// Finding: a model the policy does not list ran priced at 0. Now a 400
/// naming the models served, nothing upstream; and a name only Ollama's
/// rules tie to a listed model is refused on an API that compares names
/// exactly.
#[test]
fn a_model_the_policy_does_not_list_is_refused() {
    let stack = stack("5/min");
    for (path, model) in [
        ("/api/chat", "phi3:mini"),
        ("/api/chat", "llama3.1:70b:cloud"),
        ("/v1/chat/completions", "gpt-made-up"),
        ("/v1/chat/completions", "LLAMA3.1:70B"),
    ] {
        let body = match path {
            "/api/chat" => chat(model),
            _ => json!({"model": model, "max_tokens": 10,
                        "messages": [{"role": "user", "content": "hi"}]}),
        };
        let resp = post_json(&stack.envoy.url(path), &[], &body);
        assert_eq!(resp.status, 400, "{model}: {resp:?}");
        assert_eq!(resp.header("x-sluice-reason"), Some("invalid_request"));
        let error = &resp.json()["error"];
        assert_eq!(error["param"], "model", "{error}");
        let message = error["message"].as_str().unwrap_or_default();
        assert!(message.contains(&format!("`{model}`")), "{message}");
        assert!(message.contains("`llama3.1:70b`"), "{message}");
    }
    assert_eq!(stack.upstream_requests(), 0);
}
