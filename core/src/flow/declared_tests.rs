//! A declared API (the policy's `apis`) through the whole request path:
//! refused before it is declared, then read at its pointers, reserved
//! against the budgets, rewritten at its pointers only, settled from the
//! usage its answer reports, and answered statically in its own shape.

use serde_json::{json, Value};

use super::*;
use crate::host::mock::MockHost;
use crate::state::store::SharedStore;

const T0: u64 = 1_700_000_000_000;
const PATH: &str = "/api/v1/ai/chat";

fn policy(declared: bool) -> Value {
    let mut p = json!({
        "default_tier": "t",
        // A declared request reserves its whole body's bytes and the
        // template's figures as its input's bound (93 here).
        "tiers": {"t": {"daily_tokens": 280}},
        "defaults": {"max_output_tokens": 64},
        "sidecar": {"cluster": "sluice_sidecar", "poll_wait": "20s", "stale_after": "10s"},
        "static_fallback": {"message": "resting", "answers": {"what is sluice?": "a gate"}},
    });
    if declared {
        p["apis"] = json!([{
            "path": PATH,
            "model": "/model",
            "input": ["/message"],
            "output_limit": "/max_tokens",
            "answer": {"text": "/reply", "input_tokens": "/usage/prompt",
                       "output_tokens": "/usage/completion"},
        }]);
    }
    p
}

fn load(host: &MockHost, declared: bool) -> Poller {
    let mut poller = Poller::new();
    let text = policy(declared).to_string();
    assert!(
        poller.configure(host, text.as_bytes()),
        "{:?}",
        host.logs.borrow()
    );
    poller
}

fn post(poller: &Poller, host: &MockHost, body: &Value) -> (Request, Action) {
    let body = body.to_string();
    let len = body.len().to_string();
    host.begin(
        &[
            (":method", "POST"),
            (":path", PATH),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
        ],
        body.as_bytes(),
    );
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    let action = match req.on_request_headers(host, false) {
        Action::Pause if host.replies.borrow().is_empty() => {
            req.on_request_body(host, body.len(), true)
        }
        action => action,
    };
    (req, action)
}

fn answer(host: &MockHost, req: &mut Request, body: &Value) {
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    assert_eq!(req.on_response_headers(host), Action::Continue);
    let body = body.to_string();
    *host.response_body.borrow_mut() = body.as_bytes().to_vec();
    req.on_response_body(host, body.len(), true);
    req.on_log(host);
}

fn sent(host: &MockHost) -> Value {
    serde_json::from_slice(&host.request_body.borrow()).unwrap()
}

fn tokens(host: &MockHost, direction: &str, kind: &str) -> Option<i64> {
    host.metric(&format!(
        "sluice_tokens_total_direction={direction};.kind={kind};.tier=t;.model=other;"
    ))
}

#[test]
fn an_undeclared_application_endpoint_is_refused_and_a_declared_one_is_read() {
    let host = MockHost::new(T0);
    let body = json!({"model": "llama3.1:8b", "message": "hello there", "user_id": "u1"});
    let (_, action) = post(&load(&host, false), &host, &body);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.last_reply().unwrap().status, 404, "deny by default");

    let host = MockHost::new(T0);
    let poller = load(&host, true);
    let (mut req, action) = post(&poller, &host, &body);
    assert_eq!(action, Action::Continue, "{:?}", host.last_reply());
    // The default output is reserved and written where the service reads
    // it; the rest of the body goes as the client sent it.
    assert_eq!(
        sent(&host),
        json!({"model": "llama3.1:8b", "message": "hello there", "user_id": "u1", "max_tokens": 64})
    );
    assert_eq!(tokens(&host, "output", "estimated"), Some(64));
    answer(
        &host,
        &mut req,
        &json!({"reply": "hi", "usage": {"prompt": 7, "completion": 3}}),
    );
    assert_eq!(tokens(&host, "input", "actual"), Some(7));
    assert_eq!(tokens(&host, "output", "actual"), Some(3));
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0)
    );
}

#[test]
fn a_bad_body_is_a_400_naming_the_declared_pointer() {
    let host = MockHost::new(T0);
    let poller = load(&host, true);
    for (body, param) in [
        (json!({"message": "x"}), "/model"),
        (json!({"model": "m", "max_tokens": "lots"}), "/max_tokens"),
        (json!({"model": "m", "max_tokens": 1e9}), "/max_tokens"),
    ] {
        host.replies.borrow_mut().clear();
        post(&poller, &host, &body);
        let reply = host.last_reply().unwrap();
        assert_eq!(reply.status, 400, "{body}");
        let got: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(got["error"]["param"], param, "{got}");
    }
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name)
            .unwrap_or(0),
        0
    );
}

/// The daily budget of 280 tokens holds across declared requests: the
/// second is lowered to what is left (written at the pointer), the third
/// refused, and nothing is generated past the budget.
#[test]
fn the_budget_lowers_then_refuses_a_declared_request() {
    let host = MockHost::new(T0);
    let poller = load(&host, true);
    let ask = json!({"model": "m", "message": "hello there", "max_tokens": 100});
    let (mut req, action) = post(&poller, &host, &ask);
    assert_eq!(action, Action::Continue);
    assert_eq!(sent(&host)["max_tokens"], 100, "as asked");
    answer(
        &host,
        &mut req,
        &json!({"reply": "x", "usage": {"prompt": 5, "completion": 100}}),
    );

    let (mut req, action) = post(&poller, &host, &ask);
    assert_eq!(action, Action::Continue);
    let lowered = sent(&host)["max_tokens"].as_u64().unwrap();
    assert!((16..100).contains(&lowered), "lowered to fit: {lowered}");
    let usage = json!({"prompt": 5, "completion": lowered});
    answer(&host, &mut req, &json!({"reply": "x", "usage": usage}));

    host.replies.borrow_mut().clear();
    post(&poller, &host, &ask);
    let reply = host.last_reply().expect("refused");
    assert_eq!(reply.status, 429);
    assert_eq!(tokens(&host, "input", "actual"), Some(10));
    assert_eq!(
        tokens(&host, "output", "actual"),
        Some(100 + lowered as i64)
    );
}

#[test]
fn an_answer_without_believable_usage_is_charged_its_reservation() {
    let host = MockHost::new(T0);
    let poller = load(&host, true);
    let (mut req, _) = post(&poller, &host, &json!({"model": "m", "message": "hi"}));
    host.respond(&[(":status", "200"), ("content-type", "text/plain")]);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    req.on_response_headers(&host);
    *host.response_body.borrow_mut() = b"not json at all".to_vec();
    req.on_response_body(&host, 15, true);
    req.on_log(&host);
    // The whole reserved output is charged: the service may have
    // generated it all, and nothing says otherwise.
    assert_eq!(tokens(&host, "output", "estimated"), Some(64));
    assert_eq!(tokens(&host, "output", "actual"), Some(64));
}

#[test]
fn the_kill_switch_answers_statically_in_the_services_shape() {
    let host = MockHost::new(T0);
    let poller = load(&host, true);
    let state = json!({"version": 2, "kill_switch": {"active": true}}).to_string();
    let seen = crate::admission::route::encode_seen(host.now_ms(), state.as_bytes());
    host.set(SIDECAR_KEY, &seen, 0).unwrap();
    for (message, text) in [("hello", "resting"), ("What is sluice?", "a gate")] {
        host.replies.borrow_mut().clear();
        post(&poller, &host, &json!({"model": "m", "message": message}));
        let reply = host.last_reply().unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-sluice-degraded"), Some("static"));
        let got: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(got, json!({"reply": text}));
    }
}
