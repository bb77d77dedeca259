//! What an answer's usage says beyond its two totals, and context a body
//! does not show, against a real Envoy (issue 27, items 3 and 5).
//!
//! The upstream here is a fixed-answer server written in this file: it
//! answers each request with the body its `x-test-answer` header names,
//! shaped as the real servers send them (OpenAI/vLLM usage details,
//! Anthropic's prompt-cache counts, the Responses API's stream, Ollama's
//! final line without `prompt_eval_count`, Ollama's OpenAI API saying
//! `prompt_tokens: 0`), split over several writes.
//!
//! Upstream: no mock-llm personality but a fixed-answer server written here,
//! which sends each real server's usage shapes (OpenAI/vLLM details,
//! Anthropic's cache counts, Ollama's lines) as they are.

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use serde_json::{json, Value as Json};
use sluice_tests::{post_json, wait_for, EnvoyConfig, PolicyBuilder, Response, Stack};

/// A model the policy does not list: its estimate is never corrected.
const MODEL: &str = "sluice-test-model";
const BUDGET: u64 = 1_000_000;

/// One fixed answer: its content type and its body, sent in `pieces`.
#[derive(Clone)]
struct Answer {
    content_type: &'static str,
    body: String,
}

/// An upstream answering each request with the answer its
/// `x-test-answer` header names (404 for none).
struct Fixed {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Fixed {
    fn start(answers: HashMap<&'static str, Answer>) -> Fixed {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let answers = Arc::new(answers);
        thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let answers = answers.clone();
                thread::spawn(move || serve(conn, &answers));
            }
        });
        Fixed { addr, stop }
    }
}

impl Drop for Fixed {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// Reads one request (headers and a `content-length` body) and answers it
/// with a chunked body in pieces of 7 bytes, then closes.
fn serve(mut conn: TcpStream, answers: &HashMap<&'static str, Answer>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_string())
    };
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let Some(answer) = header("x-test-answer").and_then(|n| answers.get(n.as_str())) else {
        let _ = conn
            .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        return;
    };
    let _ = write!(
        conn,
        "HTTP/1.1 200 OK\r\ncontent-type: {}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
        answer.content_type
    );
    for piece in answer.body.as_bytes().chunks(7) {
        let _ = write!(conn, "{:x}\r\n", piece.len());
        let _ = conn.write_all(piece);
        let _ = conn.write_all(b"\r\n");
        let _ = conn.flush();
    }
    let _ = conn.write_all(b"0\r\n\r\n");
}

fn sse(events: &[(&str, Json)]) -> String {
    events
        .iter()
        .map(|(name, e)| match name {
            &"" => format!("data: {e}\n\n"),
            name => format!("event: {name}\ndata: {e}\n\n"),
        })
        .collect()
}

fn answers() -> HashMap<&'static str, Answer> {
    let json_answer = |body: Json| Answer {
        content_type: "application/json",
        body: body.to_string(),
    };
    let mut a = HashMap::new();
    // OpenAI chat (and vLLM with --enable-prompt-tokens-details): both
    // details are inside their totals.
    a.insert(
        "openai",
        json_answer(json!({
            "id": "c", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "fine"}}],
            "usage": {"prompt_tokens": 1200, "completion_tokens": 300, "total_tokens": 1500,
                      "prompt_tokens_details": {"cached_tokens": 1024},
                      "completion_tokens_details": {"reasoning_tokens": 256}}})),
    );
    // Anthropic: both cache counts are outside `input_tokens`.
    a.insert(
        "anthropic",
        json_answer(json!({
            "id": "m", "type": "message", "role": "assistant", "model": MODEL,
            "content": [{"type": "text", "text": "fine"}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 50, "cache_creation_input_tokens": 2000,
                      "cache_read_input_tokens": 3000, "output_tokens": 40}})),
    );
    // Anthropic's stream: input counts in message_start, output in
    // message_delta.
    a.insert(
        "anthropic_stream",
        Answer {
            content_type: "text/event-stream",
            body: sse(&[
                ("message_start", json!({"type": "message_start", "message": {
                    "id": "m", "type": "message", "role": "assistant", "content": [], "model": MODEL,
                    "usage": {"input_tokens": 50, "cache_creation_input_tokens": 2000,
                              "cache_read_input_tokens": 3000, "output_tokens": 1}}})),
                ("content_block_start", json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}})),
                ("content_block_delta", json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": "fine"}})),
                ("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
                ("message_delta", json!({"type": "message_delta",
                    "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 40}})),
                ("message_stop", json!({"type": "message_stop"})),
            ]),
        },
    );
    // The Responses API's stream: the usage in response.completed.
    a.insert(
        "responses_stream",
        Answer {
            content_type: "text/event-stream",
            body: sse(&[
                ("response.created", json!({"type": "response.created",
                    "response": {"id": "r", "status": "in_progress", "usage": null}})),
                ("response.output_text.delta", json!({"type": "response.output_text.delta",
                    "item_id": "i", "output_index": 0, "content_index": 0, "delta": "fine"})),
                ("response.completed", json!({"type": "response.completed", "response": {
                    "id": "r", "status": "completed",
                    "usage": {"input_tokens": 900, "input_tokens_details": {"cached_tokens": 512},
                              "output_tokens": 120, "output_tokens_details": {"reasoning_tokens": 100},
                              "total_tokens": 1020}}})),
            ]),
        },
    );
    // Ollama's stream whose prompt came from its cache: no
    // prompt_eval_count on the final line.
    a.insert(
        "ollama_cached",
        Answer {
            content_type: "application/x-ndjson",
            body: [
                json!({"model": MODEL, "message": {"role": "assistant", "content": "fi"}, "done": false}),
                json!({"model": MODEL, "message": {"role": "assistant", "content": "ne"}, "done": false}),
                json!({"model": MODEL, "message": {"role": "assistant", "content": ""},
                       "done": true, "done_reason": "stop", "eval_count": 2}),
            ]
            .iter()
            .map(|l| format!("{l}\n"))
            .collect(),
        },
    );
    // Ollama's OpenAI API for the same: `prompt_tokens: 0`.
    a.insert(
        "ollama_openai_zero",
        json_answer(json!({
            "id": "c", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "fine"}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 5, "total_tokens": 5}})),
    );
    a
}

fn policy(allow_stored_context: bool) -> Json {
    // Soft: it reserves the estimate the audit's `tokens_estimated` shows,
    // so the header's moves are each request's charge (a hard budget would
    // hold the input's bound, `bounded.rs`).
    PolicyBuilder::one_tier(json!({"requests": "1000/min",
                                   "daily_tokens": {"limit": BUDGET, "mode": "soft"}}))
    .with(
        "request",
        json!({"allow_stored_context": allow_stored_context}),
    )
    .with("audit", json!({"salt": "test-salt", "hash_bodies": false}))
    .build()
}

fn stack(upstream: &Fixed, allow_stored_context: bool) -> Stack {
    let addr = upstream.addr;
    Stack::start(move |cfg: &mut EnvoyConfig| {
        cfg.set_policy(&policy(allow_stored_context));
        cfg.set_cluster_addr("llm_upstream", addr);
    })
}

fn remaining(resp: &Response) -> u64 {
    resp.header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no remaining-tokens header: {resp:?}"))
}

fn tokens(stack: &Stack, direction: &str, kind: &str) -> u64 {
    let labels = [("direction", direction), ("kind", kind)];
    stack
        .envoy
        .metric("sluice_tokens_total", &labels)
        .unwrap_or(0.0) as u64
}

/// The audit lines once there are `n`, in order.
fn audit_lines(stack: &Stack, n: usize) -> Vec<Json> {
    let mut lines = Vec::new();
    let complete = wait_for(Duration::from_secs(15), || {
        lines = stack.envoy.audit_log();
        lines.len() >= n
    });
    assert!(complete, "{} audit lines, not {n}: {lines:?}", lines.len());
    lines
}

/// (path, answer, body) of each case, and what it settles to:
/// (input, output, cached, cache_write, reasoning, usage_source); `None`
/// input: the estimate (the upstream left it out).
type Case = (
    &'static str,
    &'static str,
    Json,
    Option<u64>,
    u64,
    [u64; 3],
    &'static str,
);

#[test]
fn usage_details_are_recorded_apart_and_the_budget_is_charged_each_total_once() {
    let upstream = Fixed::start(answers());
    let stack = stack(&upstream, false);
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                      "max_tokens": 400});
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    let messages = json!({"model": MODEL, "max_tokens": 400,
                          "messages": [{"role": "user", "content": "hello there"}]});
    let mut messages_stream = messages.clone();
    messages_stream["stream"] = json!(true);
    let responses = json!({"model": MODEL, "input": "hello there", "max_output_tokens": 400,
                           "stream": true});
    let ollama = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                        "options": {"num_predict": 400}});
    let cases: Vec<Case> = vec![
        (
            "/v1/chat/completions",
            "openai",
            chat.clone(),
            Some(1200),
            300,
            [1024, 0, 256],
            "upstream",
        ),
        (
            "/v1/messages",
            "anthropic",
            messages,
            Some(5050),
            40,
            [3000, 2000, 0],
            "upstream",
        ),
        (
            "/v1/messages",
            "anthropic_stream",
            messages_stream,
            Some(5050),
            40,
            [3000, 2000, 0],
            "upstream",
        ),
        (
            "/v1/responses",
            "responses_stream",
            responses,
            Some(900),
            120,
            [512, 0, 100],
            "upstream",
        ),
        (
            "/api/chat",
            "ollama_cached",
            ollama,
            None,
            2,
            [0, 0, 0],
            "upstream_input_estimated",
        ),
        (
            "/v1/chat/completions",
            "ollama_openai_zero",
            chat.clone(),
            None,
            5,
            [0, 0, 0],
            "upstream_input_estimated",
        ),
    ];
    let mut left = Vec::new();
    for (path, answer, body, ..) in &cases {
        let resp = post_json(&stack.envoy.url(path), &[("x-test-answer", answer)], body);
        assert_eq!(resp.status, 200, "{answer}: {resp:?}");
        left.push(remaining(&resp));
    }
    // One more request to read the budget after the last settlement.
    let probe = post_json(
        &stack.envoy.url("/v1/chat/completions"),
        &[("x-test-answer", "openai")],
        &chat,
    );
    left.push(remaining(&probe));
    let lines = audit_lines(&stack, cases.len() + 1);
    let mut want_details = [0u64; 3];
    for (i, (_, answer, _, input, output, details, source)) in cases.iter().enumerate() {
        let line = &lines[i];
        let reserved = |l: &Json| {
            l["tokens_estimated"]
                .as_u64()
                .unwrap_or_else(|| panic!("{l}"))
        };
        // The header counts this request's reservation: the budget moved
        // from one to the next by what this one was charged.
        let charged = (left[i] + reserved(line)) - (left[i + 1] + reserved(&lines[i + 1]));
        let input = input.unwrap_or_else(|| {
            // The estimate: what was reserved less the output asked for.
            reserved(line) - 400
        });
        assert_eq!(
            (
                line["tokens_input"].as_u64(),
                line["tokens_output"].as_u64()
            ),
            (Some(input), Some(*output)),
            "{answer}: {line}"
        );
        assert_eq!(
            charged,
            input + output,
            "{answer}: charged once, with every part"
        );
        assert_eq!(line["usage_source"], *source, "{answer}: {line}");
        let parts = [
            line["tokens_input_cached"].as_u64(),
            line["tokens_input_cache_write"].as_u64(),
            line["tokens_output_reasoning"].as_u64(),
        ];
        assert_eq!(parts, details.map(Some), "{answer}: {line}");
        for (sum, d) in want_details.iter_mut().zip(details) {
            *sum += d;
        }
    }
    // The probe (the OpenAI answer again) is settled too: its parts count.
    let probe_settled = wait_for(Duration::from_secs(10), || {
        tokens(&stack, "input", "cached") == want_details[0] + 1024
    });
    assert!(
        probe_settled,
        "cached input {}",
        tokens(&stack, "input", "cached")
    );
    assert_eq!(
        (
            tokens(&stack, "input", "cache_write"),
            tokens(&stack, "output", "reasoning"),
        ),
        (want_details[1], want_details[2] + 256)
    );
    // The parts are inside the actual totals, not added to them.
    let actual_input = tokens(&stack, "input", "actual");
    let inputs: u64 = lines[..=cases.len()]
        .iter()
        .map(|l| l["tokens_input"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(actual_input, inputs);
    assert!(!stack.envoy.log().contains("panicked"), "the VM panicked");
}

#[test]
fn stored_context_is_refused_naming_its_field_unless_the_policy_allows_it() {
    let upstream = Fixed::start(answers());
    let stack = stack(&upstream, false);
    let url = stack.envoy.url("/v1/responses");
    let base =
        json!({"model": MODEL, "input": "and then?", "max_output_tokens": 50, "stream": true});
    let mut cases = Vec::new();
    for (field, value) in [
        ("previous_response_id", json!("resp_abc")),
        ("conversation", json!({"id": "conv_abc"})),
        ("prompt", json!({"id": "pmpt_abc"})),
    ] {
        let mut body = base.clone();
        body[field] = value;
        cases.push((field, body));
    }
    let mut referenced = base.clone();
    referenced["input"] = json!([{"role": "user", "content": "hi"},
                                 {"type": "item_reference", "id": "msg_abc"}]);
    cases.push(("input", referenced));
    for (field, body) in &cases {
        let resp = post_json(&url, &[("x-test-answer", "responses_stream")], body);
        assert_eq!(resp.status, 400, "{field}: {resp:?}");
        let error = &resp.json()["error"];
        assert_eq!(error["param"], *field, "{error}");
        assert!(
            error["message"].as_str().unwrap_or("").contains(field),
            "{error}"
        );
    }
    // Nothing reached the upstream's answer path: the same body without
    // stored context is admitted and settled.
    let resp = post_json(&url, &[("x-test-answer", "responses_stream")], &base);
    assert_eq!(resp.status, 200, "{resp:?}");
    drop(stack);

    // Allowed by the policy: admitted, and the stored context is charged
    // from the answer's usage when it settles.
    let stack = stack_allowing(&upstream);
    let url = stack.envoy.url("/v1/responses");
    let (_, body) = &cases[0];
    let resp = post_json(&url, &[("x-test-answer", "responses_stream")], body);
    assert_eq!(resp.status, 200, "{resp:?}");
    let lines = audit_lines(&stack, 1);
    assert_eq!(lines[0]["tokens_input"], 900, "{}", lines[0]);
}

fn stack_allowing(upstream: &Fixed) -> Stack {
    stack(upstream, true)
}

/// Spend is charged at each part's price, through a real Envoy: the
/// model's price per 1M tokens is 2 input, 0.5 cached input, 2.5 cache
/// write, 8 output and 10 reasoning (issue 28, prices as providers bill).
#[test]
fn spend_is_charged_at_each_parts_own_price() {
    let upstream = Fixed::start(answers());
    let addr = upstream.addr;
    let stack = Stack::start(move |cfg: &mut EnvoyConfig| {
        let mut p = policy(false);
        p["tiers"]["t"]["daily_spend"] = json!(1.0);
        p["models"] = json!({MODEL: {"price": {"input": "2", "output": "8",
            "cached_input": "0.5", "cache_write": "2.5", "reasoning": "10"}}});
        cfg.set_policy(&p);
        cfg.set_cluster_addr("llm_upstream", addr);
    });
    let spent = || {
        stack
            .envoy
            .metric("sluice_spend_micros_total", &[])
            .unwrap_or(0.0) as u64
    };
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                      "max_tokens": 400});
    let messages = json!({"model": MODEL, "max_tokens": 400,
                          "messages": [{"role": "user", "content": "hello there"}]});
    // OpenAI: 1,200 input of which 1,024 cached, 300 output of which 256
    // reasoning: 176 × 2 + 1,024 × 0.5 + 44 × 8 + 256 × 10 = 3,776 µ
    // (every token plain would be 1,200 × 2 + 300 × 8 = 4,800 µ).
    // Anthropic: 50 plain + 3,000 read + 2,000 written, 40 output:
    // 50 × 2 + 3,000 × 0.5 + 2,000 × 2.5 + 40 × 8 = 6,920 µ.
    for (path, answer, body, cost) in [
        ("/v1/chat/completions", "openai", &chat, 3776),
        ("/v1/messages", "anthropic", &messages, 6920),
    ] {
        let before = spent();
        let resp = post_json(&stack.envoy.url(path), &[("x-test-answer", answer)], body);
        assert_eq!(resp.status, 200, "{answer}: {resp:?}");
        let settled = wait_for(Duration::from_secs(10), || spent() == before + cost);
        assert!(
            settled,
            "{answer}: spend {} after {before}, not +{cost}",
            spent()
        );
    }
}
