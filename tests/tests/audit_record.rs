//! The audit line as one record (issue 21, lever 3): sluice hands Envoy's
//! access log all its fields in one filter-state value written at the end
//! of the stream (`wasm.sluice_audit`, a JSON fragment spliced in by the
//! shipped `text_format_source`). Against a real Envoy with the shipped
//! config: every line of the audit log is JSON — admitted, streamed,
//! refused before and after the body, answered locally, never classified,
//! the client gone mid-body, a request Envoy refused before any filter —
//! with the field names and types operators read (counts as numbers), and
//! hostile values (quotes, backslashes, control characters, line
//! separators, bytes that are not UTF-8) escaped inside their own field.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the audit line
//! is sluice's record of the request, whichever server answered it.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value as Json};
use sluice_tests::{get, request, wait_for, Stack};

const FREE: &str = "Bearer demo-free-key";
const MODEL: &str = "llama3.1:8b";

/// Envoy's own fields: on every line.
const ENVOY_FIELDS: &[(&str, Kind)] = &[
    ("time", Kind::Text),
    ("status", Kind::Count),
    ("latency_ms", Kind::Count),
    ("upstream_cluster", Kind::Text),
];

/// sluice's fields: on every line of a request sluice saw, null when they
/// do not apply.
const SLUICE_FIELDS: &[(&str, Kind)] = &[
    ("request_id", Kind::Text),
    ("method", Kind::Text),
    ("route", Kind::Text),
    ("principal", Kind::Text),
    ("tier", Kind::Text),
    ("team", Kind::Text),
    ("org", Kind::Text),
    ("decision", Kind::Text),
    ("reason", Kind::Text),
    ("bucket", Kind::Text),
    ("degraded", Kind::Text),
    ("model_requested", Kind::Text),
    ("model_served", Kind::Text),
    ("provider", Kind::Text),
    ("failed", Kind::Text),
    ("tokens_estimated", Kind::Count),
    ("tokens_input", Kind::Count),
    ("tokens_output", Kind::Count),
    ("tokens_input_cached", Kind::Count),
    ("tokens_input_cache_write", Kind::Count),
    ("tokens_output_reasoning", Kind::Count),
    ("usage_source", Kind::Text),
    ("input_source", Kind::Text),
    ("cost_micros", Kind::Count),
    ("ttft_ms", Kind::Count),
    ("request_sha256", Kind::Text),
    ("response_sha256", Kind::Text),
    ("cache", Kind::Text),
];

#[derive(Clone, Copy, Debug)]
enum Kind {
    Text,
    Count,
}

fn check_type(line: &Json, name: &str, kind: Kind) {
    let v = &line[name];
    let ok = v.is_null()
        || match kind {
            Kind::Text => v.is_string(),
            Kind::Count => v.is_u64(),
        };
    assert!(ok, "`{name}` is not {kind:?} or null in {line}");
}

/// The audit log's raw text once it holds `n` whole lines.
fn raw_lines(stack: &Stack, n: usize) -> Vec<String> {
    let path = stack.envoy.dir().join("audit.jsonl");
    let read = || {
        let text = std::fs::read(&path).unwrap_or_default();
        let text = String::from_utf8(text).expect("the audit log is UTF-8");
        let whole = text.rfind('\n').map_or("", |end| &text[..end]).to_string();
        whole.lines().map(str::to_string).collect::<Vec<_>>()
    };
    assert!(
        wait_for(Duration::from_secs(20), || read().len() >= n),
        "expected {n} audit lines: {:#?}",
        read()
    );
    read()
}

fn parse(raw: &str) -> Json {
    serde_json::from_str(raw).unwrap_or_else(|e| panic!("audit line is not JSON ({e}): {raw}"))
}

/// Raw HTTP/1.1 bytes to Envoy; the answer's bytes (until Envoy closes or
/// the read times out).
fn raw_http(stack: &Stack, bytes: &[u8], close_after: bool) -> Vec<u8> {
    let mut stream = TcpStream::connect(stack.envoy.addr()).expect("connect to Envoy");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    stream.write_all(bytes).expect("send");
    let mut out = Vec::new();
    if close_after {
        // The client goes away mid-request.
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return out;
    }
    let _ = stream.read_to_end(&mut out);
    out
}

fn chat(model: &str, stream: bool) -> Json {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": stream,
    })
}

#[test]
fn every_audit_line_is_json_with_its_fields_and_hostile_values_stay_in_theirs() {
    // Unlisted models let through, so the hostile name below is admitted
    // and recorded (a model the policy does not serve is refused before
    // its name is recorded).
    let stack = Stack::start(|cfg| {
        cfg.policy_mut()["unlisted_models"] =
            serde_yaml::from_str("{price: {input: 0, output: 0}}").expect("YAML");
    });
    let auth = [("authorization", FREE)];
    // (A model name with a control character is refused before it is
    // recorded; these characters are not control characters.)
    let hostile = "m\"x\\y\u{2028}\u{2029}é\u{fffd}\",\"decision\":\"forged";

    // 1. admitted, 2. streamed, 3. unauthenticated, 4. never classified
    // (a GET sluice lets through), 5. a body that is not JSON, 6. a hostile
    // model name (admitted as "other").
    assert_eq!(
        stack.envoy.client().chat(&auth, &chat(MODEL, false)).status,
        200
    );
    assert_eq!(
        stack.envoy.client().chat(&auth, &chat(MODEL, true)).status,
        200
    );
    let unknown = [("authorization", "Bearer not-a-key")];
    assert_eq!(
        stack
            .envoy
            .client()
            .chat(&unknown, &chat(MODEL, false))
            .status,
        401
    );
    let _ = get(&stack.envoy.url("/healthz?q=\"x\\y"), &[]);
    let bad = request(
        "POST",
        &stack.envoy.url("/v1/chat/completions"),
        &[
            ("authorization", FREE),
            ("content-type", "application/json"),
        ],
        Some(b"{not json".to_vec()),
    )
    .expect("answered");
    assert_eq!(bad.status, 400);
    let _ = stack.envoy.client().chat(&auth, &chat(hostile, false));
    // 7. a path with a quote, a backslash and a byte that is not UTF-8, as
    // raw HTTP/1.1 (Envoy may refuse it before any filter, or pass it).
    let _ = raw_http(
        &stack,
        b"GET /v1/x\"y\\z\xff HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n",
        false,
    );
    let _ = raw_http(
        &stack,
        b"GET /raw?q=\"x\\y HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n",
        false,
    );
    // 8. not HTTP at all: Envoy answers 400 before any filter.
    let _ = raw_http(&stack, b"NOT HTTP\r\n\r\n", false);
    // 9. the client gone before its body ends.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\nauthorization: {FREE}\r\n\
         content-type: application/json\r\ncontent-length: 100000\r\n\r\n{{\"model\":"
    );
    let _ = raw_http(&stack, head.as_bytes(), true);

    let raw = raw_lines(&stack, 10);
    let lines: Vec<Json> = raw.iter().map(|l| parse(l)).collect();
    for (text, line) in raw.iter().zip(&lines) {
        assert!(!text.contains('\u{2028}'), "a raw line separator: {text}");
        for (name, kind) in ENVOY_FIELDS {
            assert!(line.get(*name).is_some(), "no `{name}` in {line}");
            check_type(line, name, *kind);
        }
        // A line sluice saw has all its fields; one it never saw, none.
        let seen = line.get("decision").is_some();
        for (name, kind) in SLUICE_FIELDS {
            assert_eq!(line.get(*name).is_some(), seen, "`{name}` in {line}");
            check_type(line, name, *kind);
        }
    }
    let by_status = |status: u64| {
        lines
            .iter()
            .filter(|l| l["status"] == status && l.get("decision").is_some())
            .collect::<Vec<_>>()
    };
    // Admitted: counts are numbers, the request's own fields are there.
    let admitted: Vec<_> = by_status(200)
        .into_iter()
        .filter(|l| l["model_requested"] == MODEL)
        .collect();
    assert_eq!(admitted.len(), 2, "{lines:#?}");
    for line in admitted {
        assert_eq!(line["decision"], "admit", "{line}");
        assert_eq!(line["method"], "POST");
        assert_eq!(line["route"], "/v1/chat/completions");
        assert_eq!(line["upstream_cluster"], "llm_upstream");
        assert_eq!(line["tokens_output"], 4, "{line}");
        assert!(line["tokens_input"].as_u64().unwrap() > 0, "{line}");
        assert!(line["tokens_estimated"].as_u64().unwrap() >= 4, "{line}");
        assert!(line["ttft_ms"].is_u64(), "{line}");
        assert_eq!(line["usage_source"], "upstream");
        let id = line["request_id"].as_str().unwrap_or_default();
        assert_eq!(id.len(), 36, "Envoy's request id: {line}");
        let principal = line["principal"].as_str().unwrap_or_default();
        assert!(principal.len() == 32 && principal.chars().all(|c| c.is_ascii_hexdigit()));
    }
    // Refused: local replies carry the decision and reason.
    let refused = by_status(401);
    assert_eq!(refused.len(), 1, "{lines:#?}");
    assert_eq!(refused[0]["decision"], "refuse", "{}", refused[0]);
    assert!(refused[0]["tokens_input"].is_null());
    assert!(by_status(400)
        .iter()
        .any(|l| l["reason"] == "invalid_request" && l["decision"] == "refuse"));
    // The hostile model name is one field, whole (within the bound), and
    // forged nothing.
    let hostile_line = lines
        .iter()
        .find(|l| {
            l["model_requested"]
                .as_str()
                .is_some_and(|m| m.starts_with("m\"x"))
        })
        .unwrap_or_else(|| panic!("no line with the hostile model: {lines:#?}"));
    assert_eq!(hostile_line["model_requested"], hostile, "{hostile_line}");
    assert_ne!(hostile_line["decision"], "forged");
    // Never classified: the query's backslash stays in `route`, and a raw
    // quote too where Envoy lets it through.
    assert!(
        lines
            .iter()
            .any(|l| l["route"] == "/healthz?q=%22x\\y" && l["method"] == "GET"),
        "{lines:#?}"
    );
    for l in lines
        .iter()
        .filter(|l| l["route"].as_str().is_some_and(|r| r.starts_with("/raw")))
    {
        assert_eq!(l["route"], "/raw?q=\"x\\y", "{l}");
    }
    // The client gone mid-body: still a line, with what sluice knew.
    assert!(
        lines.iter().any(|l| l["method"] == "POST"
            && l["decision"].is_null()
            && l["tier"].is_null()
            || l["status"] == 0),
        "no line for the client that left: {lines:#?}"
    );
    // Envoy's own 400 (not HTTP): sluice saw no request, its fields null.
    assert!(
        lines
            .iter()
            .any(|l| l["status"] == 400 && l["method"].is_null() && l["decision"].is_null()),
        "{lines:#?}"
    );
}
