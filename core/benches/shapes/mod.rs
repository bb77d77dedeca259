//! The three request shapes `make bench` measures (bench/run.py), driven
//! through the whole request path on the mock host: shared by
//! `tests/hostcalls.rs` (host calls per request) and `benches/path.rs`
//! (native time per request).
#![allow(dead_code)]

use serde_json::{json, Value};
use sluice_core::bench::MockHost;
use sluice_core::{Action, Poller};

pub const T0: u64 = 1_700_000_000_000;
const HIGH_RATE: &str = "1000000000/s";
const HIGH_TOKENS: &str = "1000000000000/s";

fn identity() -> Value {
    json!({"sources": ["api_key", "client_address"],
           "api_key": {"header": "x-api-key", "keys": {"bench-key": "pro"}, "bearer": false}})
}

/// bench/run.py's HEADER_POLICY plus the shipped audit section.
pub fn header_policy() -> Value {
    json!({
        "default_tier": "free",
        "identity": identity(),
        "tiers": {"free": {"requests": HIGH_RATE}, "pro": {"requests": HIGH_RATE}},
        "routes": [{"name": "v1", "path_prefix": "/v1/", "requests": HIGH_RATE}],
        "audit": {"salt": "demo-salt-change-me", "hash_bodies": false},
    })
}

/// bench/run.py's FULL_POLICY plus the shipped audit section.
pub fn full_policy() -> Value {
    json!({
        "default_tier": "free",
        "identity": identity(),
        "tiers": {
            "free": {"requests": HIGH_RATE},
            "pro": {"requests": HIGH_RATE, "tokens": HIGH_TOKENS, "input_tokens": HIGH_TOKENS,
                    "daily_tokens": 1_000_000_000_000u64, "daily_spend": 1_000_000},
        },
        "models": {"bench-model": {"requests": HIGH_RATE, "tokens": HIGH_TOKENS,
                                   "price": {"input_per_1k": 0.00015, "output_per_1k": 0.0006}}},
        "routes": [{"name": "v1", "path_prefix": "/v1/", "requests": HIGH_RATE}],
        "defaults": {"max_output_tokens": 512},
        "request": {"max_body_bytes": "1MiB"},
        "audit": {"salt": "demo-salt-change-me", "hash_bodies": false},
    })
}

/// bench/run.py's `chat_body()`: an OpenAI chat request of 2,048 bytes.
pub fn chat_body() -> Vec<u8> {
    let sentence = "The quick brown fox jumps over the lazy dog, again and again. ";
    let mut base = json!({"model": "bench-model", "max_tokens": 16, "stream": false,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": ""}]});
    let empty = base.to_string().len();
    let text = sentence.repeat(2048 / sentence.len() + 1)[..2048 - empty].to_string();
    base["messages"][1]["content"] = Value::String(text);
    let body = base.to_string().into_bytes();
    assert_eq!(body.len(), 2048);
    body
}

#[derive(Clone, Copy)]
pub enum Shape {
    HeaderGet,
    HeaderPost,
    FullPost,
}

impl Shape {
    pub fn label(self) -> &'static str {
        match self {
            Shape::HeaderGet => "(c) GET",
            Shape::HeaderPost => "(c) POST 2 KB",
            Shape::FullPost => "(d) POST 2 KB",
        }
    }
}

/// One request through every callback Envoy makes, as in the bench: the
/// headers Envoy passes on, the body whole, mock-llm's answer.
pub fn one_request(poller: &Poller, host: &MockHost, shape: Shape, body: &[u8]) {
    one_request_watched(poller, host, shape, body, &mut |_| {});
}

/// [`one_request`], calling `watch(true)` before each callback of the
/// filter and `watch(false)` after it: what runs in between is the
/// filter's (and the host's answers to it), not the harness building the
/// request (`tests/allocations.rs` counts allocations there).
pub fn one_request_watched(
    poller: &Poller,
    host: &MockHost,
    shape: Shape,
    body: &[u8],
    watch: &mut dyn FnMut(bool),
) {
    let get = matches!(shape, Shape::HeaderGet);
    let len = body.len().to_string();
    let mut headers = vec![
        (":authority", "127.0.0.1:10000"),
        (
            ":path",
            if get {
                "/v1/models"
            } else {
                "/v1/chat/completions"
            },
        ),
        (":method", if get { "GET" } else { "POST" }),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("x-api-key", "bench-key"),
        ("authorization", "Bearer sk-bench-master-key"),
        ("x-forwarded-proto", "http"),
        ("x-request-id", "0b9e3c3e-6a8e-4a8e-9d7e-3c3e6a8e4a8e"),
    ];
    if !get {
        headers.push(("content-length", &len));
    }
    host.begin(&headers, if get { b"" } else { body });
    host.set_prop(&["source", "address"], b"127.0.0.1:40000");
    watch(true);
    let (req, headers_done, body_done) = request_part(poller, host, get, body.len());
    watch(false);
    let expected = if get { Action::Continue } else { Action::Pause };
    assert_eq!(headers_done, expected);
    assert_eq!(body_done, Action::Continue);
    assert!(host.last_reply().is_none(), "{:?}", host.last_reply());
    let answer = if get {
        json!({"object": "list", "data": [{"id": "bench-model", "object": "model"}]})
    } else {
        json!({"id": "chatcmpl-1", "object": "chat.completion", "model": "bench-model",
               "choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "ok ok ok ok"}}],
               "usage": {"prompt_tokens": 480, "completion_tokens": 16, "total_tokens": 496}})
    }
    .to_string();
    let answer_len = answer.len().to_string();
    host.respond(&[
        (":status", "200"),
        ("content-type", "application/json"),
        ("content-length", &answer_len),
    ]);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    let body_len = answer.len();
    *host.response_body.borrow_mut() = answer.into_bytes();
    watch(true);
    let (headers_done, body_done) = response_part(host, req, body_len);
    watch(false);
    assert_eq!(headers_done, Action::Continue);
    assert_eq!(body_done, Action::Continue);
}

/// The filter's request callbacks (not inlined: `bench/instructions.sh`
/// counts instructions inside this and [`response_part`] only).
#[inline(never)]
pub fn request_part(
    poller: &Poller,
    host: &MockHost,
    get: bool,
    body_len: usize,
) -> (sluice_core::Request, Action, Action) {
    let mut req = poller.request().expect("a policy is loaded");
    if get {
        let done = req.on_request_headers(host, true);
        (req, done, Action::Continue)
    } else {
        let paused = req.on_request_headers(host, false);
        let done = req.on_request_body(host, body_len, true);
        (req, paused, done)
    }
}

/// The filter's response callbacks and its log, the stream dropped.
#[inline(never)]
pub fn response_part(
    host: &MockHost,
    mut req: sluice_core::Request,
    body_len: usize,
) -> (Action, Action) {
    let headers_done = req.on_response_headers(host);
    let body_done = req.on_response_body(host, body_len, true);
    req.on_log(host);
    drop(req);
    (headers_done, body_done)
}

impl Shape {
    pub const ALL: [Shape; 3] = [Shape::HeaderGet, Shape::HeaderPost, Shape::FullPost];

    pub fn policy(self) -> Value {
        match self {
            Shape::FullPost => full_policy(),
            _ => header_policy(),
        }
    }

    /// A VM with this shape's policy loaded.
    pub fn load(self, host: &MockHost) -> Poller {
        let mut poller = Poller::new();
        assert!(poller.configure(host, self.policy().to_string().as_bytes()));
        poller
    }
}

impl Shape {
    /// A VM with this shape's policy and worker leases on
    /// (`state.worker_leases`, issue 21).
    pub fn load_leased(self, host: &MockHost) -> Poller {
        let mut policy = self.policy();
        policy["state"] = json!({"worker_leases": {"enabled": true}});
        let mut poller = Poller::new();
        assert!(poller.configure(host, policy.to_string().as_bytes()));
        poller
    }
}
