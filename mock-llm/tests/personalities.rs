//! Each personality behaves as its real server does, through the whole
//! router: limit fields obeyed and ignored, refusals, usage, streams, rate
//! limits, stored responses.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use mock_llm::{Config, Personality};
use serde_json::{json, Value};
use tower::ServiceExt as _;

fn app(p: Personality, tweak: impl FnOnce(&mut Config)) -> Router {
    let mut cfg = Config {
        personality: p,
        max_model_len: 1_000,
        ..Config::default()
    };
    tweak(&mut cfg);
    mock_llm::app(cfg).unwrap()
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("{e}: {}", self.text))
    }
}

async fn send(app: &Router, path: &str, headers: &[(&str, &str)], body: Value) -> Answer {
    let mut req = Request::post(path).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let res = app
        .clone()
        .oneshot(req.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let (parts, body) = res.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    Answer {
        status: parts.status,
        headers: parts.headers,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

const ALLOWED: (&str, &str) = ("x-mock-output-tokens", "allowed");

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}]});
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
    body
}

#[tokio::test]
async fn each_server_generates_what_its_own_field_allows() {
    // The same body, two limits: who obeys which shows in the output.
    let body = chat(json!({"max_tokens": 5, "max_completion_tokens": 40}));
    let out = |a: &Answer| a.json()["usage"]["completion_tokens"].as_u64();
    let vllm = app(Personality::Vllm, |_| {});
    assert_eq!(
        out(&send(&vllm, "/v1/chat/completions", &[ALLOWED], body.clone()).await),
        Some(40)
    );
    let openai = app(Personality::Openai, |_| {});
    assert_eq!(
        out(&send(&openai, "/v1/chat/completions", &[ALLOWED], body.clone()).await),
        Some(40)
    );
    // Ollama's OpenAI layer reads max_tokens only.
    let ollama = app(Personality::Ollama, |_| {});
    assert_eq!(
        out(&send(&ollama, "/v1/chat/completions", &[ALLOWED], body.clone()).await),
        Some(5)
    );
    let only_mct = chat(json!({"max_completion_tokens": 7}));
    let a = send(&ollama, "/v1/chat/completions", &[ALLOWED], only_mct).await;
    assert_eq!(
        out(&a),
        Some(1_000 - 2),
        "ignored: the context is the limit"
    );
    // vLLM chat ignores max_output_tokens and options.num_predict.
    let ignored = chat(json!({"max_output_tokens": 3, "options": {"num_predict": 3}}));
    let a = send(&vllm, "/v1/chat/completions", &[ALLOWED], ignored).await;
    assert_eq!(out(&a), Some(1_000 - 2));
    assert_eq!(a.json()["choices"][0]["finish_reason"], "length");
    // Native Ollama obeys options.num_predict.
    let a = send(
        &ollama,
        "/api/chat",
        &[ALLOWED],
        json!({"model": "m", "messages": [], "stream": false, "options": {"num_predict": 6},
               "max_tokens": 99}),
    )
    .await;
    assert_eq!(a.json()["eval_count"], 6);
    // Without the knob, mock-llm's own 16-token cap still applies.
    let a = send(
        &vllm,
        "/v1/chat/completions",
        &[],
        chat(json!({"max_completion_tokens": 40})),
    )
    .await;
    assert_eq!(out(&a), Some(16));
    // A process-wide --generate-allowed does the same as the knob.
    let all = app(Personality::Vllm, |c| c.generate_allowed = true);
    let a = send(
        &all,
        "/v1/completions",
        &[],
        json!({"model": "m", "prompt": "abcd"}),
    )
    .await;
    assert_eq!(
        a.json()["usage"]["completion_tokens"],
        16,
        "completions default to 16"
    );
}

#[tokio::test]
async fn vllm_refuses_a_limit_past_its_context() {
    let vllm = app(Personality::Vllm, |_| {});
    let a = send(
        &vllm,
        "/v1/chat/completions",
        &[],
        chat(json!({"max_tokens": 999})),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text);
    assert_eq!(a.json()["error"]["type"], "BadRequestError");
    assert_eq!(a.json()["error"]["code"], 400);
}

#[tokio::test]
async fn unknown_models_get_each_servers_404() {
    let models = |c: &mut Config| c.models = vec!["served".into()];
    let cases = [
        (
            Personality::Openai,
            "/v1/chat/completions",
            "model_not_found",
        ),
        (Personality::Vllm, "/v1/chat/completions", "NotFoundError"),
        (
            Personality::Ollama,
            "/v1/chat/completions",
            "not_found_error",
        ),
    ];
    for (p, path, expected) in cases {
        let a = send(&app(p, models), path, &[], chat(json!({"max_tokens": 2}))).await;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{p}");
        let e = &a.json()["error"];
        assert!(
            e["code"] == expected || e["type"] == expected,
            "{p}: {}",
            a.text
        );
    }
    let a = send(
        &app(Personality::Ollama, models),
        "/api/generate",
        &[],
        json!({"model": "llama9", "prompt": "x"}),
    )
    .await;
    assert_eq!(a.json(), json!({"error": "model 'llama9' not found"}));
    let a = send(
        &app(Personality::Anthropic, models),
        "/v1/messages",
        &[],
        json!({"model": "claude-x", "messages": [], "max_tokens": 3}),
    )
    .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.json()["error"]["type"], "not_found_error");
    // The served model passes, and the listing shows it.
    let ok = send(
        &app(Personality::Openai, models),
        "/v1/chat/completions",
        &[],
        json!({"model": "served", "messages": [], "max_tokens": 2}),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text);
}

#[tokio::test]
async fn strict_servers_refuse_what_they_do_not_know() {
    let openai = app(Personality::Openai, |_| {});
    let a = send(
        &openai,
        "/v1/chat/completions",
        &[],
        chat(json!({"options": {}})),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        a.json()["error"]["message"],
        "Unrecognized request argument supplied: options"
    );
    let anthropic = app(Personality::Anthropic, |_| {});
    let a = send(
        &anthropic,
        "/v1/messages",
        &[],
        json!({"model": "c", "messages": []}),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.json()["type"], "error");
    assert_eq!(a.json()["error"]["type"], "invalid_request_error");
    // Endpoints a server does not have are its own 404.
    let a = send(&openai, "/v1/messages", &[], json!({})).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(a.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Invalid URL"));
    let a = send(&app(Personality::Vllm, |_| {}), "/api/chat", &[], json!({})).await;
    assert_eq!(a.json(), json!({"detail": "Not Found"}));
    let a = send(
        &app(Personality::Ollama, |_| {}),
        "/invocations",
        &[],
        json!({}),
    )
    .await;
    assert_eq!(a.text, "404 page not found");
    // Ollama cannot read a prompt array.
    let a = send(
        &app(Personality::Ollama, |_| {}),
        "/v1/completions",
        &[],
        json!({"model": "m", "prompt": ["a", "b"]}),
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn n_and_prompt_arrays_by_server() {
    let body =
        json!({"model": "m", "prompt": ["abcd", "efgh"], "n": 2, "best_of": 3, "max_tokens": 4});
    let total = |a: Answer| a.json()["usage"]["completion_tokens"].as_u64();
    // vLLM: no best_of; OpenAI generates best_of per prompt.
    assert_eq!(
        total(
            send(
                &app(Personality::Vllm, |_| {}),
                "/v1/completions",
                &[],
                body.clone()
            )
            .await
        ),
        Some(16)
    );
    assert_eq!(
        total(
            send(
                &app(Personality::Openai, |_| {}),
                "/v1/completions",
                &[],
                body.clone()
            )
            .await
        ),
        Some(24)
    );
    // Ollama has no n.
    let a = send(
        &app(Personality::Ollama, |_| {}),
        "/v1/chat/completions",
        &[],
        chat(json!({"n": 3, "max_tokens": 2})),
    )
    .await;
    assert_eq!(a.json()["choices"].as_array().map(Vec::len), Some(1));
}

fn data_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn stream_usage_by_server() {
    let vllm = app(Personality::Vllm, |_| {});
    let body = chat(json!({"max_tokens": 3, "stream": true,
                           "stream_options": {"continuous_usage_stats": true}}));
    let chunks = data_lines(&send(&vllm, "/v1/chat/completions", &[], body).await.text);
    // Every chunk counts; include_usage defaults to true, so a final usage chunk.
    assert!(chunks.iter().all(|c| c["usage"].is_object()), "{chunks:?}");
    assert_eq!(chunks[2]["usage"]["completion_tokens"], 2);
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 3);
    let stray = send(
        &vllm,
        "/v1/chat/completions",
        &[],
        chat(json!({"stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(stray.status, StatusCode::BAD_REQUEST);
    let ollama = app(Personality::Ollama, |_| {});
    let body = json!({"model": "m", "prompt": "hi", "max_tokens": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let chunks = data_lines(&send(&ollama, "/v1/completions", &[], body).await.text);
    assert_eq!(
        chunks[0]["usage"]["total_tokens"], 0,
        "zeros on every chunk"
    );
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn cached_and_reasoning_tokens_as_each_reports_them() {
    let knobs = [
        ("x-mock-cached-tokens", "2"),
        ("x-mock-reasoning-tokens", "1"),
    ];
    let body = chat(json!({"max_tokens": 3}));
    let u = send(
        &app(Personality::Openai, |_| {}),
        "/v1/chat/completions",
        &knobs,
        body.clone(),
    )
    .await
    .json()["usage"]
        .clone();
    assert_eq!(u["prompt_tokens"], 2);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 2);
    assert_eq!(u["completion_tokens_details"]["reasoning_tokens"], 1);
    let u = send(
        &app(Personality::Vllm, |_| {}),
        "/v1/chat/completions",
        &knobs,
        body,
    )
    .await
    .json()["usage"]
        .clone();
    assert_eq!(u["prompt_tokens_details"], json!({"cached_tokens": 2}));
    let msg = json!({"model": "c", "max_tokens": 2,
                     "messages": [{"role": "user", "content": "a".repeat(40)}]});
    let u = send(
        &app(Personality::Anthropic, |_| {}),
        "/v1/messages",
        &[
            ("x-mock-cached-tokens", "6"),
            ("x-mock-cache-creation-tokens", "3"),
        ],
        msg,
    )
    .await
    .json()["usage"]
        .clone();
    assert_eq!(
        u,
        json!({"input_tokens": 1, "output_tokens": 2, "cache_creation_input_tokens": 3,
               "cache_read_input_tokens": 6}),
        "cache reads and writes are not inside input_tokens"
    );
    let native = json!({"model": "m", "prompt": "abcd", "stream": false});
    let ollama = app(Personality::Ollama, |_| {});
    let v = send(
        &ollama,
        "/api/generate",
        &[("x-mock-cached-tokens", "1")],
        native.clone(),
    )
    .await
    .json();
    assert_eq!(v["prompt_eval_count"], 1);
    let v = send(
        &ollama,
        "/api/generate",
        &[
            ("x-mock-cached-tokens", "1"),
            ("x-mock-cache-counting", "excluded"),
        ],
        native,
    )
    .await
    .json();
    assert!(v.get("prompt_eval_count").is_none(), "older Ollama: {v}");
}

#[tokio::test]
async fn rate_limits_in_each_servers_headers() {
    let limit = |c: &mut Config| {
        c.ratelimit = Some(mock_llm::load::RateLimit {
            requests: 1,
            tokens: Some(1_000),
            window: Duration::from_secs(60),
        })
    };
    let body = chat(json!({"max_tokens": 2}));
    let openai = app(Personality::Openai, limit);
    let ok = send(&openai, "/v1/chat/completions", &[], body.clone()).await;
    assert_eq!(ok.headers["x-ratelimit-limit-requests"], "1");
    assert_eq!(ok.headers["x-ratelimit-remaining-requests"], "0");
    assert_eq!(ok.headers["x-ratelimit-remaining-tokens"], "996");
    let reset = ok.headers["x-ratelimit-reset-requests"].to_str().unwrap();
    assert!(reset.ends_with('s'), "{reset}");
    let refused = send(&openai, "/v1/chat/completions", &[], body.clone()).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(refused.json()["error"]["type"], "requests");
    let tokens = app(Personality::Openai, |c| {
        c.ratelimit = Some(mock_llm::load::RateLimit {
            requests: 100,
            tokens: Some(3),
            window: Duration::from_secs(60),
        })
    });
    send(&tokens, "/v1/chat/completions", &[], body.clone()).await;
    let refused = send(&tokens, "/v1/chat/completions", &[], body.clone()).await;
    assert_eq!(
        refused.json()["error"]["type"],
        "tokens",
        "{}",
        refused.text
    );
    assert_eq!(refused.headers["x-ratelimit-remaining-tokens"], "0");

    let anthropic = app(Personality::Anthropic, limit);
    let msg = json!({"model": "c", "messages": [], "max_tokens": 2});
    let ok = send(&anthropic, "/v1/messages", &[], msg.clone()).await;
    let reset = ok.headers["anthropic-ratelimit-requests-reset"]
        .to_str()
        .unwrap();
    assert!(humantime::parse_rfc3339(reset).is_ok(), "{reset}");
    assert_eq!(ok.headers["anthropic-ratelimit-requests-remaining"], "0");
    let refused = send(&anthropic, "/v1/messages", &[], msg).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json()["error"]["type"], "rate_limit_error");
    assert!(refused.headers.contains_key("retry-after"));

    let vllm = app(Personality::Vllm, limit);
    send(&vllm, "/v1/chat/completions", &[], body.clone()).await;
    let refused = send(&vllm, "/v1/chat/completions", &[], body).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!refused
        .headers
        .contains_key("x-ratelimit-remaining-requests"));
    // Injected errors take the server's shape too.
    let a = send(
        &anthropic,
        "/v1/messages",
        &[("x-mock-status", "529")],
        json!({}),
    )
    .await;
    assert_eq!(a.status.as_u16(), 529);
    assert_eq!(a.json()["error"]["type"], "overloaded_error");
    let a = send(
        &app(Personality::Ollama, |_| {}),
        "/api/chat",
        &[("x-mock-status", "503")],
        json!({}),
    )
    .await;
    assert!(a.json()["error"]
        .as_str()
        .unwrap()
        .starts_with("server busy"));
}

#[tokio::test]
async fn stored_responses_carry_their_conversation_as_billed_input() {
    for p in [Personality::Openai, Personality::Vllm, Personality::Mock] {
        let app = app(p, |_| {});
        let first = send(
            &app,
            "/v1/responses",
            &[],
            json!({"model": "m", "input": "a".repeat(40), "max_output_tokens": 5}),
        )
        .await
        .json();
        assert_eq!(first["usage"]["input_tokens"], 10);
        let id = first["id"].as_str().unwrap().to_owned();
        let next = send(
            &app,
            "/v1/responses",
            &[],
            json!({"model": "m", "input": "abcd", "previous_response_id": id, "max_output_tokens": 2}),
        )
        .await
        .json();
        assert_eq!(
            next["usage"]["input_tokens"], 16,
            "{p}: 10 in + 5 out carried + 1 new"
        );
        let unknown = send(
            &app,
            "/v1/responses",
            &[],
            json!({"model": "m", "input": "x", "previous_response_id": "resp_nope"}),
        )
        .await;
        assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{p}");
        // store: false keeps nothing.
        let unstored = send(
            &app,
            "/v1/responses",
            &[],
            json!({"model": "m", "input": "x", "store": false}),
        )
        .await
        .json();
        let after = send(
            &app,
            "/v1/responses",
            &[],
            json!({"model": "m", "input": "x", "previous_response_id": unstored["id"]}),
        )
        .await;
        assert_eq!(after.status, StatusCode::NOT_FOUND, "{p}");
    }
    // Ollama's layer does not support previous_response_id: ignored.
    let ollama = app(Personality::Ollama, |_| {});
    let a = send(
        &ollama,
        "/v1/responses",
        &[],
        json!({"model": "m", "input": "abcd", "previous_response_id": "resp_x"}),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.json()["usage"]["input_tokens"], 1);
}

#[tokio::test]
async fn metrics_only_where_vllm_serves_them() {
    let get = |app: Router| async move {
        app.oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
            .await
            .unwrap()
            .status()
    };
    assert_eq!(get(app(Personality::Vllm, |_| {})).await, StatusCode::OK);
    // Names, types and label order as vLLM's prometheus_client exports
    // them (vllm/v1/metrics/loggers.py), which the sidecar's vLLM source reads.
    let vllm = app(Personality::Vllm, |c| c.model = "served".into());
    send(
        &vllm,
        "/v1/chat/completions",
        &[],
        chat(json!({"max_tokens": 1})),
    )
    .await;
    let res = vllm
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let text = String::from_utf8_lossy(
        &axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap(),
    )
    .into_owned();
    for line in [
        "# TYPE vllm:num_requests_running gauge",
        "# TYPE vllm:num_requests_waiting gauge",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"served\"} 1.0",
        "vllm:e2e_request_latency_seconds_count{engine=\"0\",model_name=\"served\"} 1.0",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    assert_eq!(
        get(app(Personality::Openai, |_| {})).await,
        StatusCode::NOT_FOUND
    );
    assert_eq!(get(app(Personality::Mock, |_| {})).await, StatusCode::OK);
}
