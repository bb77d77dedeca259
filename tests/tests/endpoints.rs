//! Deny by default and every multiplier of work, against a real Envoy: no
//! endpoint an inference server serves, no prompt array and no path
//! spelling lets a caller spend what its budget does not hold.
//!
//! Each test runs against every upstream personality whose real server has
//! the endpoints it drives (mock-llm's own, vLLM, OpenAI, Ollama,
//! Anthropic), each generating all a request allows, so a reservation made
//! from a field the server ignores shows as an overshoot.

use std::time::Duration;

use mock_llm::generate::Api;
use serde_json::{json, Value};
use serde_yaml::Value as Yaml;
use sluice_tests::{
    against, get, post_chunked, post_json, request, wait_for, EnvoyConfig, MockLlm, Personality,
    Response, Stack,
};

const MODEL: &str = "llama3.1:8b";
const FREE: (&str, &str) = ("x-api-key", "demo-free-key");

fn yaml(text: &str) -> Yaml {
    serde_yaml::from_str(text).expect("YAML literal")
}

/// The shipped stack with the free tier's daily budget at `budget` tokens
/// and room for many requests a minute.
fn with_budget(budget: u64) -> impl FnOnce(&mut EnvoyConfig) {
    move |cfg: &mut EnvoyConfig| {
        let free = &mut cfg.policy_mut()["tiers"]["free"];
        free["requests"] = yaml("1000/min");
        free["daily_tokens"] = yaml(&budget.to_string());
    }
}

/// The shipped stack (after `edit`) in front of an upstream playing `p`
/// that generates all each request allows (`--generate-allowed`).
fn stack_as(p: Personality, edit: impl FnOnce(&mut EnvoyConfig)) -> Stack {
    let upstream = MockLlm::start_as_with_args("primary", p, &["--generate-allowed"]);
    Stack::start_upstream(2, upstream, edit)
}

/// Servers that answer a prompt array on `/v1/completions` (Ollama's
/// layer refuses one with a 400; Anthropic has no completions).
const PROMPT_ARRAYS: [Personality; 3] = [Personality::Mock, Personality::Vllm, Personality::Openai];

fn post(stack: &Stack, path: &str, body: &Value) -> Response {
    post_json(&stack.envoy.url(path), &[FREE], body)
}

fn reason(resp: &Response) -> String {
    resp.header("x-sluice-reason").unwrap_or("").to_string()
}

fn prompts(n: usize) -> Value {
    json!((0..n)
        .map(|i| format!("write a poem about {i}"))
        .collect::<Vec<_>>())
}

fn token_prompts(n: usize) -> Value {
    json!((0..n).map(|i| vec![1, 2, 3, i]).collect::<Vec<_>>())
}

/// Tokens the upstream reported in an answer (`usage.total_tokens`).
fn total_tokens(resp: &Response) -> u64 {
    let u = &resp.json()["usage"];
    // Anthropic reports no total: its input and output, plus cache reads
    // and writes (which are not inside input_tokens).
    let sum = [
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ]
    .iter()
    .filter_map(|k| u[*k].as_u64())
    .sum::<u64>();
    u["total_tokens"]
        .as_u64()
        .or((sum > 0).then_some(sum))
        .unwrap_or_else(|| panic!("no usage in {resp:?}"))
}

/// Finding: `"prompt": [40 strings]` made the upstream generate 40
/// completions on a reservation of one: 8,088 tokens on a 5,000 budget.
#[test]
fn prompt_arrays_cannot_overshoot_a_hard_budget() {
    against(
        &PROMPT_ARRAYS,
        prompt_arrays_cannot_overshoot_a_hard_budget_as,
    );
}

fn prompt_arrays_cannot_overshoot_a_hard_budget_as(p: Personality) {
    let budget = 600;
    let stack = stack_as(p, with_budget(budget));
    // 40 prompts × 16 tokens cannot fit in 600: refused, never sent up.
    for prompt in [prompts(40), token_prompts(40)] {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 16});
        let resp = post(&stack, "/v1/completions", &body);
        assert_eq!(resp.status, 429, "{resp:?}");
        assert_eq!(reason(&resp), "daily_budget_exceeded");
    }
    assert_eq!(stack.upstream_requests(), 0);
    // Smaller arrays fit until the budget is spent; what the upstream
    // really produced (its usage: one completion per prompt) never passes it.
    let mut served = 0;
    let mut admitted = 0;
    for i in 0..40 {
        let prompt = if i % 2 == 0 {
            prompts(4)
        } else {
            token_prompts(4)
        };
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 16});
        let resp = post(&stack, "/v1/completions", &body);
        match resp.status {
            200 => {
                assert_eq!(resp.json()["choices"].as_array().map(Vec::len), Some(4));
                served += total_tokens(&resp);
                admitted += 1;
            }
            429 => {
                assert_eq!(reason(&resp), "daily_budget_exceeded", "{resp:?}");
                break;
            }
            _ => panic!("{resp:?}"),
        }
    }
    assert!(admitted >= 2, "the budget serves a few small arrays");
    assert!(
        served <= budget,
        "served {served} tokens on a {budget} budget"
    );
    assert_eq!(stack.upstream_requests(), admitted);
}

/// Finding: with the daily budget spent, every one of these reached the
/// upstream, counted only by the requests bucket.
#[test]
fn with_the_budget_spent_no_endpoint_reaches_the_upstream() {
    against(
        &Personality::ALL,
        with_the_budget_spent_no_endpoint_reaches_the_upstream_as,
    );
}

fn with_the_budget_spent_no_endpoint_reaches_the_upstream_as(p: Personality) {
    let stack = stack_as(p, with_budget(300));
    // Spent: an upstream that ignores max_tokens (the knob) is charged
    // what it really produced, which empties the budget.
    let spend = if p == Personality::Anthropic {
        "/v1/messages"
    } else {
        "/v1/chat/completions"
    };
    let resp = post_json(
        &stack.envoy.url(spend),
        &[FREE, ("x-mock-output-tokens", "2000")],
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}),
    )
    .ok();
    assert!(total_tokens(&resp) > 300, "{resp:?}");
    let refused = post(
        &stack,
        "/v1/chat/completions",
        &sluice_tests::chat_body(MODEL),
    );
    assert_eq!(reason(&refused), "daily_budget_exceeded", "{refused:?}");
    let before = stack.upstream_requests();

    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000});
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/invocations", chat.clone(), "daily_budget_exceeded"),
        (
            "/invocations",
            json!({"model": MODEL, "prompt": "hi", "max_tokens": 100_000}),
            "daily_budget_exceeded",
        ),
        (
            "/invocations",
            json!({"model": MODEL, "input": "hi"}),
            "daily_budget_exceeded",
        ),
        (
            "/invocations",
            json!({"model": MODEL, "max_tokens": 100_000}),
            "invalid_request",
        ),
        ("/v1/messages", chat.clone(), "daily_budget_exceeded"),
        (
            "/v1/messages",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000, "stream": true}),
            "daily_budget_exceeded",
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
            "invalid_request",
        ),
        (
            "/v1/score",
            json!({"model": MODEL, "text_1": "q", "text_2": ["a", "b"]}),
            "daily_budget_exceeded",
        ),
        (
            "/score",
            json!({"model": MODEL, "text_1": "q", "text_2": "a"}),
            "daily_budget_exceeded",
        ),
        (
            "/v1/rerank",
            json!({"model": MODEL, "query": "q", "documents": ["a"]}),
            "daily_budget_exceeded",
        ),
        (
            "/rerank",
            json!({"model": MODEL, "query": "q", "documents": ["a"]}),
            "daily_budget_exceeded",
        ),
        (
            "/v2/rerank",
            json!({"model": MODEL, "query": "q", "documents": ["a"]}),
            "daily_budget_exceeded",
        ),
        (
            "/pooling",
            json!({"model": MODEL, "input": "x"}),
            "daily_budget_exceeded",
        ),
        (
            "/classify",
            json!({"model": MODEL, "input": ["x"]}),
            "daily_budget_exceeded",
        ),
        (
            "/tokenize",
            json!({"model": MODEL, "prompt": "x"}),
            "daily_budget_exceeded",
        ),
        (
            "/detokenize",
            json!({"model": MODEL, "tokens": [1, 2]}),
            "daily_budget_exceeded",
        ),
        (
            "/api/embed",
            json!({"model": MODEL, "input": ["a", "b"]}),
            "daily_budget_exceeded",
        ),
        (
            "/api/embeddings",
            json!({"model": MODEL, "prompt": "a"}),
            "daily_budget_exceeded",
        ),
        (
            "/v1/embeddings",
            json!({"model": MODEL, "input": "a"}),
            "daily_budget_exceeded",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": prompts(3), "max_tokens": 100_000}),
            "daily_budget_exceeded",
        ),
        (
            "/v1/chat/completions;x",
            chat.clone(),
            "daily_budget_exceeded",
        ),
        (
            "/v1/chat/completions;x=1/",
            chat.clone(),
            "daily_budget_exceeded",
        ),
        (
            "/x/..;/v1/chat/completions",
            chat.clone(),
            "daily_budget_exceeded",
        ),
        (
            "/v1/audio/transcriptions",
            json!({"model": "whisper-1"}),
            "unknown_endpoint",
        ),
        (
            "/v1/audio/speech",
            json!({"model": "tts-1", "input": "hi"}),
            "unknown_endpoint",
        ),
        (
            "/v1/images/generations",
            json!({"model": "dall-e-3", "prompt": "a cat"}),
            "unknown_endpoint",
        ),
        (
            "/v1/messages/count_tokens",
            chat.clone(),
            "unknown_endpoint",
        ),
    ];
    let mut wrong = Vec::new();
    for (path, body, expected) in &cases {
        let resp = post(&stack, path, body);
        let status_ok = match *expected {
            "unknown_endpoint" => resp.status == 404,
            "invalid_request" => resp.status == 400,
            _ => resp.status == 429,
        };
        if !status_ok || reason(&resp) != *expected {
            wrong.push(format!(
                "{path}: {} {} {}",
                resp.status,
                reason(&resp),
                resp.body
            ));
        }
        if *expected == "unknown_endpoint" {
            assert_eq!(resp.json()["error"]["code"], "unknown_endpoint", "{resp:?}");
        }
    }
    // A body on a GET is work too; a bodyless GET carries none.
    let resp = request(
        "GET",
        &stack.envoy.url("/v1/models"),
        &[FREE, ("content-type", "application/json")],
        Some(chat.to_string().into_bytes()),
    )
    .expect("GET with a body");
    if resp.status != 404 || reason(&resp) != "unknown_endpoint" {
        wrong.push(format!(
            "GET /v1/models with a body: {} {}",
            resp.status,
            reason(&resp)
        ));
    }
    assert!(
        wrong.is_empty(),
        "answered otherwise:\n{}",
        wrong.join("\n")
    );
    assert_eq!(
        stack.upstream_requests(),
        before,
        "reached mock-llm: {}",
        stack.upstream.stats()["by_path"]
    );
    let models = get(&stack.envoy.url("/v1/models"), &[FREE]);
    assert_eq!(models.status, 200, "{models:?}");
    assert_eq!(stack.upstream_requests(), before + 1);
}

/// `sluice_tokens_total{direction, kind="actual", tier="free"}`.
fn actual(stack: &Stack, direction: &str) -> u64 {
    let labels = [
        ("direction", direction),
        ("kind", "actual"),
        ("tier", "free"),
    ];
    stack
        .envoy
        .metric("sluice_tokens_total", &labels)
        .unwrap_or(0.0) as u64
}

/// Settles a request and checks that what sluice charged is what the
/// upstream reported: waits for the counters to move by exactly that.
fn charged_as_reported(stack: &Stack, before: (u64, u64), reported: (u64, u64), what: &str) {
    let expected = (before.0 + reported.0, before.1 + reported.1);
    let mut seen = before;
    let settled = wait_for(Duration::from_secs(10), || {
        seen = (actual(stack, "input"), actual(stack, "output"));
        seen == expected
    });
    assert!(settled, "{what}: charged {seen:?}, expected {expected:?}");
}

/// The upstream's counts in an Anthropic SSE stream: `message_start`'s
/// input, `message_delta`'s (cumulative) output.
fn anthropic_stream_usage(text: &str) -> (u64, u64) {
    let mut usage = (0, 0);
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let v: Value = serde_json::from_str(data).expect("SSE data is JSON");
        if let Some(i) = v
            .pointer("/message/usage/input_tokens")
            .and_then(Value::as_u64)
        {
            usage.0 = i;
        }
        if v["type"] == "message_delta" {
            usage.1 = v["usage"]["output_tokens"].as_u64().unwrap_or(0);
        }
    }
    usage
}

/// Findings: `/invocations` and `/v1/messages` went up unread (no tokens
/// counted at all); prompt arrays were settled as one completion.
#[test]
fn new_endpoints_reconcile_to_the_real_usage() {
    against(
        &Personality::ALL,
        new_endpoints_reconcile_to_the_real_usage_as,
    );
}

/// Each step runs where the personality's server has the endpoint.
fn new_endpoints_reconcile_to_the_real_usage_as(p: Personality) {
    let stack = stack_as(p, with_budget(50_000));
    let now = |s: &Stack| (actual(s, "input"), actual(s, "output"));
    let messages = json!([{"role": "user", "content": "say something short please"}]);

    if p.serves(None) {
        let before = now(&stack);
        let resp = post(
            &stack,
            "/invocations",
            &json!({"model": MODEL, "messages": messages, "max_tokens": 7}),
        )
        .ok();
        let v = resp.json();
        assert_eq!(v["object"], "chat.completion", "served as chat: {v}");
        let reported = (
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        );
        assert_eq!(reported.1, 7);
        charged_as_reported(&stack, before, reported, "/invocations chat");
    }

    if PROMPT_ARRAYS.contains(&p) {
        let before = now(&stack);
        let resp = post(
            &stack,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompts(3), "n": 2, "max_tokens": 4}),
        )
        .ok();
        let v = resp.json();
        assert_eq!(v["choices"].as_array().map(Vec::len), Some(6));
        let reported = (
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        );
        assert_eq!(reported.1, 24, "3 prompts × 2 choices × 4");
        charged_as_reported(&stack, before, reported, "prompt array");
    }

    if p.serves(Some(Api::Messages)) {
        let before = now(&stack);
        let resp = post(
            &stack,
            "/v1/messages",
            &json!({"model": MODEL, "system": "be brief", "messages": messages, "max_tokens": 5}),
        )
        .ok();
        let v = resp.json();
        assert_eq!(v["type"], "message", "{v}");
        let reported = (
            v["usage"]["input_tokens"].as_u64().unwrap(),
            v["usage"]["output_tokens"].as_u64().unwrap(),
        );
        charged_as_reported(&stack, before, reported, "/v1/messages");

        let before = now(&stack);
        let resp = post(
            &stack,
            "/v1/messages",
            &json!({"model": MODEL, "messages": messages, "max_tokens": 9, "stream": true}),
        )
        .ok();
        assert!(resp.body.contains("event: message_delta"), "{}", resp.body);
        let reported = anthropic_stream_usage(&resp.body);
        assert_eq!(reported.1, 9);
        assert!(reported.0 > 0);
        charged_as_reported(&stack, before, reported, "/v1/messages stream");
    }

    if p.serves(Some(Api::Score)) {
        let before = now(&stack);
        let resp = post(
            &stack,
            "/v1/score",
            &json!({"model": MODEL, "text_1": "what is sluice", "text_2": ["a gate", "a river"]}),
        )
        .ok();
        let reported = (resp.json()["usage"]["prompt_tokens"].as_u64().unwrap(), 0);
        charged_as_reported(&stack, before, reported, "/v1/score");
    }
}

/// Prompt tokens a server served from its prefix cache are still input:
/// OpenAI and vLLM count them inside `prompt_tokens`; Anthropic reports
/// cache reads and writes beside `input_tokens`, not inside it, so a proxy
/// that reads `input_tokens` alone undercounts.
#[test]
fn cached_prompt_tokens_are_charged_as_the_server_counts_them() {
    against(&Personality::ALL, |p| {
        let stack = stack_as(p, with_budget(50_000));
        let now = |s: &Stack| (actual(s, "input"), actual(s, "output"));
        let long = "tell me about the river ".repeat(20);
        let knobs = [
            FREE,
            ("x-mock-cached-tokens", "60"),
            ("x-mock-cache-creation-tokens", "30"),
        ];
        let (path, body) = if p == Personality::Anthropic {
            let body = json!({"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": long}]});
            ("/v1/messages", body)
        } else {
            let body = json!({"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": long}]});
            ("/v1/chat/completions", body)
        };
        let before = now(&stack);
        let resp = post_json(&stack.envoy.url(path), &knobs, &body).ok();
        let u = &resp.json()["usage"];
        let reported = match u["prompt_tokens"].as_u64() {
            Some(prompt) => (prompt, u["completion_tokens"].as_u64().unwrap()),
            None => (
                [
                    "input_tokens",
                    "cache_creation_input_tokens",
                    "cache_read_input_tokens",
                ]
                .iter()
                .map(|k| u[*k].as_u64().unwrap_or(0))
                .sum(),
                u["output_tokens"].as_u64().unwrap(),
            ),
        };
        assert_eq!(reported.0, 120, "the whole prompt, cached or not: {u}");
        charged_as_reported(&stack, before, reported, path);
    });
}

/// The output limit a request is reserved by must be the one the server
/// obeys. Each case names two limits where the server obeys the larger
/// (vLLM and OpenAI chat: `max_completion_tokens` over `max_tokens`; vLLM
/// ignores `max_output_tokens` on chat; Ollama's OpenAI layer reads only
/// `max_tokens`; native Ollama only `options.num_predict`): reserving by
/// the smaller lets the upstream spend past a hard budget.
#[test]
fn the_reservation_follows_the_limit_field_the_server_obeys() {
    let real = [Personality::Vllm, Personality::Openai, Personality::Ollama];
    against(&real, |p| {
        let budget = 300;
        let messages = json!([{"role": "user", "content": "hi"}]);
        let cases: Vec<(&str, Value)> = match p {
            Personality::Vllm => vec![
                (
                    "/v1/chat/completions",
                    json!({"model": MODEL, "messages": messages, "max_tokens": 5,
                           "max_completion_tokens": 400}),
                ),
                (
                    "/v1/chat/completions",
                    json!({"model": MODEL, "messages": messages, "max_tokens": 400,
                           "max_output_tokens": 5}),
                ),
            ],
            Personality::Openai => vec![(
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": messages, "max_tokens": 5,
                       "max_completion_tokens": 400}),
            )],
            _ => vec![
                (
                    "/v1/chat/completions",
                    json!({"model": MODEL, "messages": messages, "max_tokens": 400,
                           "max_completion_tokens": 5}),
                ),
                (
                    "/api/chat",
                    json!({"model": MODEL, "messages": messages, "stream": false,
                           "max_tokens": 5, "options": {"num_predict": 400}}),
                ),
            ],
        };
        // Each case on a fresh budget, so one overshoot cannot hide another.
        let mut overshoots = Vec::new();
        for (path, body) in &cases {
            let stack = stack_as(p, with_budget(budget));
            let resp = post(&stack, path, body);
            let served = match resp.status {
                200 => {
                    let v = resp.json();
                    v["usage"]["total_tokens"].as_u64().unwrap_or_else(|| {
                        v["prompt_eval_count"].as_u64().unwrap_or(0)
                            + v["eval_count"].as_u64().unwrap_or(0)
                    })
                }
                // Refused before the upstream: over the budget, or a
                // field the API does not have.
                429 | 400 if resp.header("x-sluice-reason").is_some() => 0,
                _ => panic!("{path} {body}: {resp:?}"),
            };
            if served > budget {
                overshoots.push(format!(
                    "{path} {body}: served {served} on a {budget} budget"
                ));
            }
        }
        assert!(overshoots.is_empty(), "{}", overshoots.join("; "));
    });
}

/// A path sluice does not read goes up only through a `passthrough` rule,
/// under that rule's own limit.
#[test]
fn a_passthrough_rule_opens_a_path_with_its_own_limit() {
    against(
        &Personality::ALL,
        a_passthrough_rule_opens_a_path_with_its_own_limit_as,
    );
}

fn a_passthrough_rule_opens_a_path_with_its_own_limit_as(p: Personality) {
    let stack = stack_as(p, |cfg| {
        with_budget(5_000)(cfg);
        cfg.policy_mut()["passthrough"] =
            yaml("[{path: /v1/audio/transcriptions, methods: [POST], requests: 2/min}]");
        // sluice's own canonical form decides (Envoy forwards as written).
        let hcm = cfg.hcm_mut().as_mapping_mut().expect("hcm");
        for key in [
            "normalize_path",
            "merge_slashes",
            "path_with_escaped_slashes_action",
        ] {
            hcm.remove(key);
        }
    });
    let body = json!({"model": "whisper-1"});
    let statuses: Vec<u16> = (0..3)
        .map(|_| post(&stack, "/v1/audio/%74ranscriptions", &body).status)
        .collect();
    // The upstream has no such endpoint (its own 404); the third never
    // gets there.
    assert_eq!(statuses[..2], [404, 404], "{statuses:?}");
    assert_eq!(statuses[2], 429);
    let by_path = &stack.upstream.stats()["by_path"];
    assert_eq!(by_path["/v1/audio/transcriptions"], 2, "{by_path}");
    let third = post(&stack, "/v1/audio/transcriptions", &body);
    assert_eq!(reason(&third), "route_rate_limit", "{third:?}");
    // Another path stays closed.
    let speech = post(&stack, "/v1/audio/speech", &body);
    assert_eq!(
        (speech.status, reason(&speech)),
        (404, "unknown_endpoint".into())
    );
    assert_eq!(stack.upstream_requests(), 2);
    // One path for sluice, another for a server that cuts at the `;`: a
    // rule must not open the one for the other (HTTP/1.1 as written: a
    // client library would resolve the `..` itself).
    for path in [
        "/v1/images/generations;/../../audio/transcriptions",
        "/v1/audio/transcriptions;/../../images/generations",
    ] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\nx-api-key: demo-free-key",
            stack.envoy.addr()
        );
        let resp = post_chunked(
            stack.envoy.addr(),
            &head,
            body.to_string().as_bytes(),
            1 << 20,
        );
        assert_eq!(
            (resp.status, reason(&resp)),
            (400, "invalid_request".into()),
            "{path}"
        );
    }
    assert_eq!(stack.upstream_requests(), 2);
}
