//! Hard budgets bounded, not guessed, against a real Envoy with the shipped
//! config (docs/src/design.md, "Bounded, not guessed"): a hard budget
//! reserves the most the server can charge for a request's input, so input
//! the estimate never reads (Ollama's `template` and `context`) cannot
//! spend past it; a Responses API `background` request is refused; input
//! the upstream does not report is charged at the bound and says so.
//!
//! Upstream: mock-llm's Ollama personality (and its own, for the chat and
//! Responses rows), which renders a request's own `template`
//! with the prompt and prepends `context`'s token ids (mock-llm's
//! `tokens.rs` counts both, as Ollama's `GenerateHandler` feeds them).

use std::time::Duration;

use serde_json::{json, Value as Json};
use sluice_tests::{
    async_client, post_json, post_json_async, runtime, wait_for, Personality, Response, Stack,
};

const FREE: (&str, &str) = ("x-api-key", "demo-free-key");
/// The shipped free tier's hard daily budget.
const FREE_BUDGET: u64 = 5_000;

/// Tokens settled so far (input and output), from the filter's counters.
fn charged(stack: &Stack) -> u64 {
    ["input", "output"]
        .iter()
        .map(|d| {
            let labels = [("direction", *d), ("kind", "actual")];
            stack
                .envoy
                .metric("sluice_tokens_total", &labels)
                .unwrap_or(0.0) as u64
        })
        .sum()
}

/// What Ollama's answer says it charged.
fn ollama_usage(resp: &Response) -> u64 {
    let body: Json = serde_json::from_str(&resp.body).expect("JSON answer");
    body["prompt_eval_count"].as_u64().unwrap_or(0) + body["eval_count"].as_u64().unwrap_or(0)
}

fn drained(stack: &Stack) -> bool {
    wait_for(Duration::from_secs(10), || {
        stack.envoy.metric("sluice_reservations_outstanding", &[]) == Some(0.0)
    })
}

/// `/api/generate` with a template of `template_bytes` around the prompt
/// and `ids` context token ids.
fn generate(template_bytes: usize, ids: usize) -> Json {
    let template = format!("{}{{{{ .Prompt }}}}", "t".repeat(template_bytes));
    let context: Vec<u64> = (0..ids as u64).map(|i| 1000 + i).collect();
    json!({"model": "llama3.1:8b", "prompt": "hi", "template": template,
        "context": context, "stream": false, "options": {"num_predict": 64}})
}

#[test]
fn ollama_template_and_context_cannot_spend_past_the_free_keys_hard_budget() {
    let stack = Stack::start_as(Personality::Ollama, |_| {});
    let url = stack.envoy.url("/api/generate");
    // Each costs the server 504 input tokens for the template and prompt,
    // 200 for the context and 16 of output (mock-llm's default answer,
    // under the 64 allowed): 720. Eight at once would be 5,760 on a budget
    // of 5,000 if only the prompt were reserved.
    let body = generate(2_000, 200);
    let answers = runtime().block_on(async {
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let (url, body) = (url.clone(), body.clone());
                tokio::spawn(async move {
                    let client = async_client();
                    let headers = [FREE, ("x-mock-latency-ms", "300")];
                    post_json_async(&client, &url, &headers, &body).await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.expect("task").expect("request"));
        }
        answers
    });
    let statuses: Vec<u16> = answers.iter().map(|r| r.status).collect();
    let admitted: Vec<&Response> = answers.iter().filter(|r| r.status == 200).collect();
    assert!(!admitted.is_empty(), "{statuses:?}");
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!(r.status, 429, "{r:?}");
        assert_eq!(r.header("x-sluice-reason"), Some("daily_budget_exceeded"));
    }
    let mut used: u64 = admitted.iter().map(|r| ollama_usage(r)).sum();
    assert_eq!(admitted[0].status, 200);
    assert_eq!(ollama_usage(admitted[0]), 720, "the server's own count");
    assert!(drained(&stack), "reservations left outstanding");
    // One after another until the budget refuses (the free tier's 10/min
    // leaves room for a few more).
    for _ in 0..(10 - answers.len().min(10)) {
        let resp = post_json(&url, &[FREE], &body);
        match resp.status {
            200 => used += ollama_usage(&resp),
            429 => break,
            other => panic!("unexpected {other}: {resp:?}"),
        }
    }
    assert!(drained(&stack));
    println!("statuses {statuses:?}; the server charged {used} of {FREE_BUDGET}");
    assert!(used <= FREE_BUDGET, "overshoot: {used} > {FREE_BUDGET}");
    assert_eq!(charged(&stack), used, "sluice charged what the server said");
}

#[test]
fn a_template_larger_than_the_budget_is_refused_before_the_server_sees_it() {
    let stack = Stack::start_as(Personality::Ollama, |_| {});
    // 26 KB of template: 6,500 tokens to the server for a 2-byte prompt.
    let resp = post_json(
        &stack.envoy.url("/api/generate"),
        &[FREE],
        &generate(26_000, 0),
    );
    assert_eq!(resp.status, 429, "{resp:?}");
    assert_eq!(
        resp.header("x-sluice-reason"),
        Some("daily_budget_exceeded")
    );
    assert_eq!(stack.upstream_requests(), 0);
}

#[test]
fn a_background_response_is_refused_and_never_reaches_the_upstream() {
    let stack = Stack::start(|_| {});
    let body = json!({"model": "llama3.1:8b", "input": "write a long story",
        "max_output_tokens": 4000, "background": true});
    let resp = post_json(&stack.envoy.url("/v1/responses"), &[FREE], &body);
    assert_eq!(resp.status, 400, "{resp:?}");
    let got: Json = serde_json::from_str(&resp.body).unwrap();
    assert_eq!(got["error"]["param"], "background", "{got}");
    assert_eq!(stack.upstream_requests(), 0);
}

#[test]
fn input_the_server_does_not_report_is_charged_at_the_bound_and_audited_so() {
    let stack = Stack::start_as(Personality::Ollama, |_| {});
    let body = json!({"model": "llama3.1:8b", "prompt": "ciao mondo, come stai oggi?",
        "stream": false, "options": {"num_predict": 8}});
    let headers = [FREE, ("x-mock-usage", "missing")];
    let resp = post_json(&stack.envoy.url("/api/generate"), &headers, &body);
    assert_eq!(resp.status, 200, "{resp:?}");
    let line = wait_for(Duration::from_secs(10), || {
        stack
            .envoy
            .audit_log()
            .iter()
            .any(|l| l["input_source"].is_string())
    });
    assert!(line, "no settled audit line");
    let log = stack.envoy.audit_log();
    let line = log
        .iter()
        .find(|l| l["input_source"].is_string())
        .expect("a settled line");
    assert_eq!(line["input_source"], "bounded", "{line}");
    // The prompt's 27 bytes and one for the string, the template's 32.
    let input = line["tokens_input"].as_u64().expect("tokens_input");
    assert_eq!(input, 27 + 1 + 32, "{line}");
    let kind = [("kind", "bounded")];
    assert_eq!(
        stack.envoy.metric("sluice_input_source_total", &kind),
        Some(1.0)
    );
}

/// The fields table's rows, as a hostile client would use them: each field
/// a server feeds the model (or bills) is reserved at its bound (so the
/// free key's 5,000 hard tokens refuse it) or refused by name, and none
/// reaches the upstream.
#[test]
fn every_field_a_server_feeds_the_model_is_reserved_or_refused() {
    let stack = Stack::start(|_| {});
    let big = "w ".repeat(13_000); // 26 KB, about 6,500 tokens to a server
    let image = json!({"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}});
    let audio = json!({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}});
    let file = json!({"type": "file", "file": {"file_id": "file-1"}});
    let chat_with = |part: Json| {
        json!({"model": "llama3.1:8b", "max_tokens": 16,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
    };
    let rows: Vec<(&str, &str, Json, Option<&str>)> = vec![
        (
            "ollama template",
            "/api/generate",
            json!({"model": "llama3.1:8b", "prompt": "hi", "template": format!("{big}{{{{ .Prompt }}}}"), "stream": false}),
            None,
        ),
        (
            "ollama context",
            "/api/generate",
            json!({"model": "llama3.1:8b", "prompt": "hi", "context": vec![7; 6_000], "stream": false}),
            None,
        ),
        (
            "ollama images",
            "/api/generate",
            json!({"model": "llama3.1:8b", "prompt": "hi", "images": ["aGk="], "stream": false}),
            None,
        ),
        (
            "ollama system",
            "/api/generate",
            json!({"model": "llama3.1:8b", "prompt": "hi", "system": big, "stream": false}),
            None,
        ),
        (
            "ollama suffix",
            "/api/generate",
            json!({"model": "llama3.1:8b", "prompt": "hi", "suffix": big, "stream": false}),
            None,
        ),
        (
            "ollama chat images",
            "/api/chat",
            json!({"model": "llama3.1:8b", "stream": false,
                "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}),
            None,
        ),
        (
            "chat image part",
            "/v1/chat/completions",
            chat_with(image),
            None,
        ),
        (
            "chat audio part",
            "/v1/chat/completions",
            chat_with(audio),
            None,
        ),
        (
            "chat file part",
            "/v1/chat/completions",
            chat_with(file),
            None,
        ),
        (
            "chat prediction",
            "/v1/chat/completions",
            json!({"model": "llama3.1:8b", "max_tokens": 16,
                "messages": [{"role": "user", "content": "hi"}],
                "prediction": {"type": "content", "content": big}}),
            None,
        ),
        (
            "responses background",
            "/v1/responses",
            json!({"model": "llama3.1:8b", "input": "hi", "background": true}),
            Some("background"),
        ),
    ];
    for (name, path, body, refused_field) in rows {
        let resp = post_json(&stack.envoy.url(path), &[FREE], &body);
        match refused_field {
            Some(field) => {
                assert_eq!(resp.status, 400, "{name}: {resp:?}");
                let got: Json = serde_json::from_str(&resp.body).unwrap();
                assert_eq!(got["error"]["param"], field, "{name}: {got}");
            }
            None => {
                assert_eq!(resp.status, 429, "{name}: {resp:?}");
                assert_eq!(
                    resp.header("x-sluice-reason"),
                    Some("daily_budget_exceeded"),
                    "{name}"
                );
            }
        }
    }
    assert_eq!(stack.upstream_requests(), 0, "nothing reached the upstream");
    assert!(drained(&stack));
}

/// One caller cannot steer another's reservations: the estimate's
/// correction is learnt per model and tier, and a hard budget's
/// reservation never reads it. 40 requests of `"a a a …"` (the estimate
/// counts twice what the server does) from an enterprise key leave a pro
/// key's reservation where it was.
#[test]
fn one_tiers_odd_requests_do_not_move_another_tiers_reservation() {
    let stack = Stack::start(|_| {});
    let url = stack.envoy.url("/v1/chat/completions");
    // The pro key's own samples teach its tier nothing: "hi" is a ninth of
    // its estimate at mock-llm, an outlier.
    let prose = "hi";
    let ask = |key: &str, content: &str| {
        let body = json!({"model": "llama3.1:8b", "max_tokens": 4,
            "messages": [{"role": "user", "content": content}]});
        let resp = post_json(&url, &[("x-api-key", key)], &body);
        assert_eq!(resp.status, 200, "{resp:?}");
    };
    let reserved_for = |key_tier: &str| -> Vec<u64> {
        stack
            .envoy
            .audit_log()
            .iter()
            .filter(|l| l["tier"] == key_tier && l["tokens_estimated"].is_u64())
            .map(|l| l["tokens_estimated"].as_u64().unwrap_or(0))
            .collect()
    };
    ask("demo-pro-key", prose);
    assert!(wait_for(Duration::from_secs(10), || reserved_for("pro")
        .len()
        == 1));
    let before = reserved_for("pro")[0];
    let odd = "a ".repeat(200);
    for _ in 0..40 {
        ask("demo-enterprise-key", &odd);
    }
    ask("demo-pro-key", prose);
    assert!(wait_for(Duration::from_secs(10), || reserved_for("pro")
        .len()
        == 2));
    let after = reserved_for("pro")[1];
    assert_eq!(before, after, "the pro key's reservation moved");
    let enterprise = reserved_for("enterprise");
    println!(
        "enterprise reservations {} -> {}; pro {before} -> {after}",
        enterprise[0],
        enterprise[enterprise.len() - 1]
    );
}
