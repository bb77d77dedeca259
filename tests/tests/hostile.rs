//! Hostile clients (docs/src/design.md, "Guarantees"): however a request ends and however
//! its path or body is spelled, it reaches the upstream only through one admission
//! decision, and no client number wraps a reservation.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): paths, numbers
//! and duplicate keys are refused before any server reads them (the body
//! fields each server reads are endpoints.rs', output_limits.rs' and
//! parsing.rs' tests, against each personality).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use serde_yaml::Value as Yaml;
use sluice_tests::{
    chat_request, post_chunked, post_json, request, runtime, wait_for, Response, Stack,
};

const MODEL: &str = "llama3.1:8b";

fn chat(max_tokens: Option<u64>) -> Value {
    chat_request(MODEL, "hello", max_tokens, false)
}

/// One HTTP/2 (h2c, prior knowledge) POST whose body is followed by
/// trailers; `body: None` sends headers then trailers only.
async fn h2_with_trailers(addr: SocketAddr, path: &str, body: Option<&[u8]>) -> (u16, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(())
        .expect("request");
    let (response, mut stream) = client.send_request(req, false).expect("send headers");
    if let Some(body) = body {
        stream
            .send_data(Bytes::copy_from_slice(body), false)
            .expect("send body");
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-client-trailer", http::HeaderValue::from_static("1"));
    stream.send_trailers(trailers).expect("send trailers");
    let response = response.await.expect("response");
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut text = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("response body");
        let _ = body.flow_control().release_capacity(chunk.len());
        text.extend_from_slice(&chunk);
    }
    (status, String::from_utf8_lossy(&text).into_owned())
}

fn upstream_body(stack: &Stack) -> Value {
    stack.upstream.stats()["last_request"]["body"].clone()
}

/// `shares: {anonymous: 100%}`: these tests count an anonymous caller's
/// admissions against the whole model bucket.
fn all_to_anonymous() -> Yaml {
    serde_yaml::from_str("{anonymous: 100%}").expect("shares YAML")
}

fn assert_invalid(resp: &Response, param: Option<&str>) {
    assert_eq!(resp.status, 400, "{resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), Some("invalid_request"));
    let body = resp.json();
    assert_eq!(body["error"]["param"].as_str(), param, "{body}");
}

/// Finding: 50 of 50 h2c requests that ended with trailers got 200 from a
/// model whose limit was spent, undecided and unrewritten.
#[test]
fn requests_that_end_with_trailers_are_decided() {
    let stack = Stack::start(|cfg| {
        cfg.policy_mut()["models"][MODEL]["requests"] = Yaml::from("3/min");
        // Anonymous callers here may use all of it (docs/src/limits.md, "Fair shares").
        cfg.policy_mut()["models"][MODEL]["shares"] = all_to_anonymous();
    });
    let body = chat(None).to_string();
    let results: Vec<(u16, String)> = runtime().block_on(async {
        let mut out = Vec::new();
        for _ in 0..6 {
            out.push(
                h2_with_trailers(
                    stack.envoy.addr(),
                    "/v1/chat/completions",
                    Some(body.as_bytes()),
                )
                .await,
            );
        }
        out
    });
    let statuses: Vec<u16> = results.iter().map(|r| r.0).collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429], "{results:?}");
    assert!(results[3].1.contains("model_rate_limit"), "{results:?}");
    assert_eq!(stack.upstream_requests(), 3);
    // The body went up as sluice decided it: with the reserved maximum.
    assert_eq!(
        upstream_body(&stack)["max_tokens"],
        512,
        "{}",
        stack.upstream.stats()
    );

    // Headers, then trailers, no body: decided on the empty body (400).
    let (status, text) = runtime().block_on(h2_with_trailers(
        stack.envoy.addr(),
        "/v1/chat/completions",
        None,
    ));
    assert_eq!(status, 400, "{text}");
    assert_eq!(stack.upstream_requests(), 3);

    // HTTP/1.1 chunked with trailers (Envoy drops them): decided as well.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json",
        stack.envoy.addr()
    );
    let resp = post_chunked(stack.envoy.addr(), &head, body.as_bytes(), 16);
    assert_eq!(resp.status, 429, "{resp:?}");
    assert_eq!(stack.upstream_requests(), 3);
}

/// Finding: `max_tokens: 2^64 − 1` wrapped the reservation to a handful of
/// tokens; `2^64 − 6` to 0, skipping the token buckets.
#[test]
fn client_numbers_never_wrap_and_every_choice_is_reserved() {
    let stack = Stack::start(|_| {});
    let url = stack.envoy.url("/v1/chat/completions");
    for max in [u64::MAX, u64::MAX - 5, 1 << 32, (1 << 20) + 1] {
        let resp = post_json(&url, &[], &chat(Some(max)));
        assert_invalid(&resp, Some("max_tokens"));
    }
    for (field, value) in [
        ("max_completion_tokens", json!(u64::MAX)),
        ("max_tokens", json!(-1)),
        ("max_tokens", json!(1e300)),
        ("n", json!(0)),
        ("n", json!(1_000_000)),
        ("best_of", json!(u64::MAX)),
    ] {
        let mut body = chat(None);
        body[field] = value.clone();
        let resp = post_json(&url, &[], &body);
        assert_invalid(&resp, Some(field));
    }
    let mut ollama = json!({"model": MODEL, "prompt": "hi", "options": {"num_predict": u64::MAX}});
    let resp = post_json(&stack.envoy.url("/api/generate"), &[], &ollama);
    assert_invalid(&resp, Some("options.num_predict"));
    ollama["options"]["num_predict"] = json!(-1); // Ollama's "no limit"
    post_json(&stack.envoy.url("/api/generate"), &[], &ollama).ok();
    assert_eq!(upstream_body(&stack)["options"]["num_predict"], 512);
    assert_eq!(stack.upstream_requests(), 1);

    // The free tier's hard budget is 5,000 tokens/day: 8 choices of 1,000
    // do not fit, 8 choices of what is left (÷ 8) do.
    let mut body = chat(Some(1_000));
    body["n"] = json!(8);
    let resp = post_json(&url, &[], &body).ok();
    let sent = upstream_body(&stack);
    let per_choice = sent["max_tokens"].as_u64().expect("lowered max_tokens");
    assert_eq!(sent["n"], 8);
    assert!(per_choice < 1_000 && per_choice * 8 <= 5_000, "{sent}");
    assert!(resp.header("x-ratelimit-remaining-tokens").is_some());
}

/// Finding: `/v1/chat/%63ompletions` and friends reached an upstream that
/// decodes paths (vLLM's Starlette) without their body being read.
#[test]
fn every_spelling_of_an_llm_path_is_admitted_as_one() {
    for envoy_normalises in [true, false] {
        let stack = Stack::start(|cfg| {
            cfg.policy_mut()["models"][MODEL]["requests"] = Yaml::from("2/min");
            cfg.policy_mut()["models"][MODEL]["shares"] = all_to_anonymous();
            if !envoy_normalises {
                // sluice's own canonical form, for configs without these.
                let hcm = cfg.hcm_mut().as_mapping_mut().expect("hcm");
                for key in [
                    "normalize_path",
                    "merge_slashes",
                    "path_with_escaped_slashes_action",
                ] {
                    hcm.remove(key);
                }
            }
        });
        let spellings = [
            "/v1/chat/%63ompletions",
            "/v1/chat%2Fcompletions",
            "/%761/chat/completions",
            "/V1/Chat/Completions/",
        ];
        let statuses: Vec<u16> = spellings
            .iter()
            .map(|path| post_json(&stack.envoy.url(path), &[], &chat(None)).status)
            .collect();
        assert_eq!(
            statuses,
            [200, 200, 429, 429],
            "normalised by Envoy: {envoy_normalises}"
        );
        // What went up was read and rewritten: the default maximum.
        assert_eq!(upstream_body(&stack)["max_tokens"], 512);
        // A path that reads differently decoded once or twice: refused.
        let resp = post_json(
            &stack.envoy.url("/v1/chat/%2563ompletions"),
            &[],
            &chat(None),
        );
        assert_invalid(&resp, None);
        assert_eq!(stack.upstream_requests(), 2);
    }
}

/// Finding: `{"model":"llama3.1:70b","model":"mistral:7b"}` was decided on
/// the last model and forwarded raw to an upstream that may read the first.
#[test]
fn duplicate_keys_and_unbounded_model_names_are_refused() {
    let stack = Stack::start(|_| {});
    let url = stack.envoy.url("/v1/chat/completions");
    let send = |body: &str| {
        request(
            "POST",
            &url,
            &[("content-type", "application/json")],
            Some(body.as_bytes().to_vec()),
        )
        .expect("request")
    };
    let resp = send(r#"{"model":"llama3.1:70b","model":"mistral:7b","messages":[]}"#);
    assert_invalid(&resp, Some("model"));
    let resp = send(r#"{"model":"m","max_tokens":10,"max_tokens":100000,"messages":[]}"#);
    assert_invalid(&resp, Some("max_tokens"));
    let resp = send(&format!(
        r#"{{"model":"{}","messages":[]}}"#,
        "m".repeat(200_000)
    ));
    assert_invalid(&resp, Some("model"));
    assert!(resp.body.len() < 1_000, "the answer does not echo the name");
    assert_eq!(stack.upstream_requests(), 0);
    // Every audit line stays small, whatever the client sent.
    // Envoy writes the access log asynchronously.
    wait_for(Duration::from_secs(10), || {
        stack.envoy.audit_log().len() >= 3
    });
    let audit = stack.envoy.audit_log();
    assert_eq!(audit.len(), 3, "{audit:?}");
    for line in audit {
        assert!(line.to_string().len() < 4_096, "{line}");
    }
}

/// Finding: the shipped buffer limit equalled `max_body_bytes`, so a body
/// at the cap was admitted and then 413'd by Envoy after sluice's rewrite.
#[test]
fn a_body_at_the_cap_survives_the_rewrite() {
    let stack = Stack::start(|cfg| {
        cfg.policy_mut()["tiers"]["free"]["daily_tokens"] = Yaml::from(10_000_000);
    });
    let cap = 1 << 20;
    let mut body =
        json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": ""}]});
    let filler = cap - body.to_string().len();
    body["messages"][0]["content"] = json!("a ".repeat(filler / 2));
    let bytes = body.to_string().into_bytes();
    assert!(
        bytes.len() <= cap && bytes.len() > cap - 4,
        "{}",
        bytes.len()
    );
    let resp = request(
        "POST",
        &stack.envoy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        Some(bytes),
    )
    .expect("request");
    assert_eq!(
        resp.status,
        200,
        "{}",
        &resp.body[..resp.body.len().min(500)]
    );
    let sent = upstream_body(&stack);
    assert_eq!(sent["stream_options"]["include_usage"], true, "rewritten");
}

/// Finding (issue 48): fields a server reads that sluice read otherwise. A
/// declared service in Go or ASP.NET Core reads `MAX_TOKENS` as its
/// `max_tokens` and `Model` as its `model` (ten `"MAX_TOKENS": 4000`
/// requests beside `"max_tokens": 16` cost 40,010 tokens on a 5,000
/// budget); OpenAI reads an input item `{"id": "msg_1"}` (no type, or a
/// null one) as a stored item by id, input sluice never saw. One row per
/// field: each is a 400 naming it, and none reaches the upstream.
#[test]
fn fields_a_server_reads_otherwise_are_refused_naming_them() {
    let stack = Stack::start(|cfg| {
        cfg.policy_mut()["apis"] = serde_yaml::to_value(json!([{
            "path": "/api/v1/ai/chat", "model": "/model", "input": ["/message"],
            "output_limit": "/options/max_tokens",
        }]))
        .expect("YAML");
    });
    let declared = |extra: Value| {
        let mut body = json!({"model": MODEL, "message": "hi", "options": {"max_tokens": 16}});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        body
    };
    let responses = |input: Value| json!({"model": MODEL, "input": input, "max_output_tokens": 16});
    let mut nested = declared(json!({}));
    nested["options"]["MAX_TOKENS"] = json!(4000);
    let rows = [
        ("/api/v1/ai/chat", nested, "/options/MAX_TOKENS"),
        (
            "/api/v1/ai/chat",
            declared(json!({"Options": {"max_tokens": 4000}})),
            "/Options",
        ),
        (
            "/api/v1/ai/chat",
            declared(json!({"Model": "llama3.1:70b"})),
            "/Model",
        ),
        (
            "/api/v1/ai/chat",
            declared(json!({"me\u{17F}\u{17F}age": "a prompt"})),
            "/me\u{17F}\u{17F}age",
        ),
        (
            "/v1/responses",
            responses(json!([{"id": "msg_1"}])),
            "input",
        ),
        (
            "/v1/responses",
            responses(json!([{"role": "user", "content": "hi"}, {"id": "msg_1", "type": null}])),
            "input",
        ),
        (
            "/v1/responses",
            responses(json!([{"type": "item_reference", "id": "msg_1"}])),
            "input",
        ),
    ];
    for (path, body, param) in rows {
        let resp = post_json(&stack.envoy.url(path), &[], &body);
        assert_invalid(&resp, Some(param));
        assert_eq!(stack.upstream_requests(), 0, "{path} {body}");
    }
    // An item with an id and content of its own (an assistant message sent
    // back) is no reference.
    let body = responses(json!([
        {"role": "user", "content": "hi"},
        {"id": "msg_0", "type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": "and then?"},
    ]));
    let resp = post_json(&stack.envoy.url("/v1/responses"), &[], &body);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(stack.upstream_requests(), 1);
}
