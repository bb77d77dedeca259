//! Bodies sluice cannot accept (docs/src/design.md, "Demand and estimate"): over the size
//! cap → 413, not JSON or without a model → 400, a key a Go server reads as another
//! → 400. None of them reaches the upstream.
//!
//! Size and syntax are the server's no matter which it is: those tests run
//! against mock-llm's own personality. Key spellings are read differently
//! by Ollama (Go): that test runs against the ollama personality.

use serde_json::json;
use serde_yaml::Value;
use sluice_tests::{post_chunked, request, MockLlm, Personality, Response, Stack};

const MODEL: &str = "llama3.1:8b";
const CAP: usize = 64 * 1024;

fn stack() -> Stack {
    Stack::start(|cfg| {
        cfg.policy_mut()["request"]["max_body_bytes"] = Value::from("64KiB");
        // Near-cap bodies are ~16k tokens: more than the demo free tier's
        // daily budget, which is not what these tests are about.
        cfg.policy_mut()["tiers"]["free"]["daily_tokens"] = Value::from(1_000_000);
    })
}

/// A valid chat body of about `size` bytes.
fn chat_of_size(size: usize) -> Vec<u8> {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "x".repeat(size.saturating_sub(80))}],
    });
    body.to_string().into_bytes()
}

fn post_raw(stack: &Stack, body: &[u8]) -> Response {
    request(
        "POST",
        &stack.envoy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        Some(body.to_vec()),
    )
    .unwrap_or_else(|e| panic!("{e:#}"))
}

fn chunked(stack: &Stack, body: &[u8]) -> Response {
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json",
        stack.envoy.addr()
    );
    post_chunked(stack.envoy.addr(), &head, body, 8 * 1024)
}

fn assert_rejected(resp: &Response, status: u16, code: &str, param: Option<&str>) {
    assert_eq!(resp.status, status, "{resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), Some(code), "{resp:?}");
    assert!(
        resp.header("content-type")
            .is_some_and(|v| v.starts_with("application/json")),
        "{resp:?}"
    );
    let body = resp.json();
    assert_eq!(body["error"]["code"], code, "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    match param {
        Some(p) => assert_eq!(body["error"]["param"], p, "{body}"),
        None => assert!(body["error"]["param"].is_null(), "{body}"),
    }
}

#[test]
fn oversized_bodies_get_413_with_and_without_content_length() {
    let stack = stack();

    // Just under the cap goes through, sized and chunked alike.
    let fits = chat_of_size(CAP - 1024);
    assert!(fits.len() < CAP);
    assert_eq!(post_raw(&stack, &fits).status, 200);
    let resp = chunked(&stack, &fits);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(stack.upstream_requests(), 2);

    let big = chat_of_size(CAP + 16 * 1024);
    assert!(big.len() > CAP);
    let resp = post_raw(&stack, &big);
    assert_rejected(&resp, 413, "request_too_large", None);
    // Without a declared length sluice counts the bytes as they arrive.
    let resp = chunked(&stack, &big);
    assert_rejected(&resp, 413, "request_too_large", None);
    // Far over the cap, still sluice's answer rather than Envoy's buffer limit.
    let resp = chunked(&stack, &chat_of_size(4 * CAP));
    assert_rejected(&resp, 413, "request_too_large", None);

    assert_eq!(stack.upstream_requests(), 2, "{}", stack.upstream.stats());
}

#[test]
fn bodies_that_are_not_a_request_get_400() {
    let stack = stack();

    let resp = post_raw(&stack, b"{\"model\": \"llama3.1:8b\", \"messages\": [");
    assert_rejected(&resp, 400, "invalid_request", None);
    let resp = post_raw(&stack, b"not json at all");
    assert_rejected(&resp, 400, "invalid_request", None);
    let resp = chunked(&stack, b"{\"model\": ");
    assert_rejected(&resp, 400, "invalid_request", None);

    let no_model = json!({"messages": [{"role": "user", "content": "hello"}]});
    let resp = post_raw(&stack, no_model.to_string().as_bytes());
    assert_rejected(&resp, 400, "invalid_request", Some("model"));
    let resp = chunked(&stack, no_model.to_string().as_bytes());
    assert_rejected(&resp, 400, "invalid_request", Some("model"));

    assert_eq!(stack.upstream_requests(), 0, "{}", stack.upstream.stats());
    // The caller's bucket was not charged for bodies it could not send.
    let resp = stack.chat(MODEL, &[]);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("9"), "{resp:?}");
}

/// `body` as written (key order and spelling kept: a `serde_json::Value`
/// would sort `MODEL` before `model`) to `url`.
fn post_text(url: &str, body: &str) -> Response {
    request(
        "POST",
        url,
        &[
            ("content-type", "application/json"),
            ("x-api-key", "demo-free-key"),
        ],
        Some(body.as_bytes().to_vec()),
    )
    .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Go's `encoding/json`, which Ollama decodes every body with, matches
/// keys to its struct fields without case and lets the last match win:
/// `MODEL` after `model` is the model Ollama loads, `Stream` after
/// `stream` decides whether it streams. mock-llm's ollama personality reads
/// bodies the same way. sluice refuses such a key by name; the keys inside
/// `options`, which Ollama matches exactly, pass, and the limit sluice
/// writes there is the one obeyed.
#[test]
fn keys_a_go_server_reads_without_case_are_refused_by_name() {
    let upstream =
        MockLlm::start_as_with_args("primary", Personality::Ollama, &["--generate-allowed"]);
    let stack = Stack::start_upstream(2, upstream, |cfg| {
        let policy = cfg.policy_mut();
        policy["tiers"]["free"]["daily_tokens"] = Value::from(1_000_000);
        policy["tiers"]["free"]["requests"] = Value::from("1000/min");
        policy["defaults"]["max_output_tokens"] = Value::from(40);
    });
    let two_models = r#"{"model":"llama3.1:8b","stream":false,"MODEL":"llama3.1:70b",
        "messages":[{"role":"user","content":"hi"}]}"#;
    let streams = r#"{"model":"llama3.1:8b","stream":false,"Stream":true,
        "messages":[{"role":"user","content":"hi"}]}"#;

    // What the server does with them, asked directly.
    let direct = post_text(&stack.upstream.url("/api/chat"), two_models);
    assert_eq!(direct.status, 200, "{direct:?}");
    assert_eq!(direct.header("x-mock-model"), Some("llama3.1:70b"));
    let direct = post_text(&stack.upstream.url("/api/chat"), streams);
    assert_eq!(direct.header("content-type"), Some("application/x-ndjson"));
    let before = stack.upstream_requests();

    // Through sluice: a 400 naming the key, nothing upstream.
    for (path, body, param) in [
        ("/api/chat", two_models, "MODEL"),
        ("/api/chat", streams, "Stream"),
        (
            "/api/generate",
            r#"{"model":"llama3.1:8b","prompt":"hi","stream":false,"Options":{"num_predict":99999}}"#,
            "Options",
        ),
        (
            "/api/chat",
            r#"{"model":"llama3.1:8b","stream":false,"Messages":[{"role":"user","content":"hi"}]}"#,
            "Messages",
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"llama3.1:8b","messages":[{"role":"user","content":"hi"}],"stream":true,
                "stream_options":{"include_usage":true,"Include_Usage":false}}"#,
            "stream_options.Include_Usage",
        ),
    ] {
        let resp = post_text(&stack.envoy.url(path), body);
        assert_rejected(&resp, 400, "invalid_request", Some(param));
        let message = resp.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            message.contains("another spelling"),
            "{path} {param}: {message}"
        );
    }
    assert_eq!(
        stack.upstream_requests(),
        before,
        "{}",
        stack.upstream.stats()
    );

    // Inside `options` Ollama matches exactly: `NUM_PREDICT` is no option
    // to it, and the reserved limit sluice writes is what it obeys.
    let resp = post_text(
        &stack.envoy.url("/api/generate"),
        r#"{"model":"llama3.1:8b","prompt":"hi","stream":false,"options":{"NUM_PREDICT":99999}}"#,
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.json()["eval_count"], 40, "{}", resp.body);
    let sent = &stack.upstream.stats()["last_request"]["body"]["options"];
    assert_eq!(sent["num_predict"], 40, "{sent}");
}
