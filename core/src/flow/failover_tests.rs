//! Failover after dispatch through the whole request path (the host is
//! the mock; the real Envoy runs it in tests/tests/provider_faults.rs): a
//! failed attempt is held, released unbilled and sent to the next rung
//! through the listener, and the caller gets the rung's answer.

use serde_json::{json, Value};

use super::*;
use crate::host::mock::MockHost;
use crate::state::store::SharedStore;

const T0: u64 = 1_700_000_000_000;

fn policy(static_answer: bool) -> Value {
    let mut p = json!({
        "default_tier": "t", "tiers": {"t": {"daily_spend": 1_000_000}},
        "models": {"llama3.1:8b": {"price": {"input": "0.05", "output": "0.08"}}},
        "providers": {"openai": {
            "models": {"llama3.1:8b": "gpt-4o-mini"},
            "limit_field": "max_completion_tokens",
            "prices": {"gpt-4o-mini": {"input": "0.15", "output": "0.60"}},
        }},
        "ladder": ["openai"],
        "ladder_when_out": false,
        "failover": {"attempts": 3, "deadline": "30s"},
    });
    if static_answer {
        p["static_fallback"] = json!({"message": "resting"});
    }
    p
}

fn load(host: &MockHost, static_answer: bool) -> Poller {
    let mut poller = Poller::new();
    let text = policy(static_answer).to_string();
    assert!(
        poller.configure(host, text.as_bytes()),
        "{:?}",
        host.logs.borrow()
    );
    poller
}

fn post(poller: &Poller, host: &MockHost, extra: &[(&str, &str)]) -> Request {
    let body = json!({"model": "llama3.1:8b", "max_tokens": 50,
                      "messages": [{"role": "user", "content": "hello there"}]})
    .to_string();
    let len = body.len().to_string();
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "llm.example"),
        ("content-type", "application/json"),
        ("content-length", len.as_str()),
        ("authorization", "Bearer sk-the-clients-own"),
        ("openai-organization", "org-the-client-picked"),
    ];
    headers.extend_from_slice(extra);
    host.begin(&headers, body.as_bytes());
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    assert_eq!(
        req.on_request_body(host, body.len(), true),
        Action::Continue
    );
    req
}

/// The upstream answers `status` (from the upstream itself).
fn fail(host: &MockHost, req: &mut Request, status: &str) -> Action {
    host.respond(&[(":status", status), ("content-type", "application/json")]);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    req.on_response_headers(host)
}

fn spent(host: &MockHost) -> i64 {
    host.metric("sluice_spend_micros_total").unwrap_or(0)
}

fn outstanding(host: &MockHost) -> i64 {
    host.metric("sluice_reservations_outstanding").unwrap_or(0)
}

fn answer_attempt(host: &MockHost, req: &mut Request, status: &str, body: &Value) {
    let token = host.callouts.borrow().last().unwrap().token;
    *host.call_response_headers.borrow_mut() = vec![
        (":status".into(), status.into()),
        ("content-type".into(), "application/json".into()),
        ("content-length".into(), "999".into()),
        ("x-mock-name".into(), "fallback".into()),
    ];
    let bytes = body.to_string().into_bytes();
    let size = bytes.len();
    *host.call_response_body.borrow_mut() = bytes;
    req.on_call_response(host, token, size);
}

#[test]
fn a_failed_primary_is_sent_to_the_next_rung_and_its_answer_reaches_the_caller() {
    let host = MockHost::new(T0);
    let poller = load(&host, true);
    let mut req = post(&poller, &host, &[]);
    assert_eq!(fail(&host, &mut req, "503"), Action::Pause, "held");
    // The primary's body is buffered behind the held headers.
    assert_eq!(req.on_response_body(&host, 10, true), Action::Pause);

    let call = host.callouts.borrow().last().cloned().unwrap();
    assert_eq!(call.cluster, "sluice_self");
    let header = |name: &str| {
        call.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header(":path").as_deref(), Some("/v1/chat/completions"));
    assert_eq!(header(":authority").as_deref(), Some("llm.example"));
    assert_eq!(header("x-sluice-upstream").as_deref(), Some("openai"));
    assert_eq!(
        header("authorization"),
        None,
        "the client's key stays behind"
    );
    assert_eq!(header("openai-organization"), None, "so does its account");
    assert_eq!(header("content-length"), None);
    let marker = header(failover::ATTEMPT_HEADER).unwrap();
    assert!(failover::is_attempt(&host, &marker));
    let posted: Value = serde_json::from_slice(&host.posted.borrow().last().unwrap().1).unwrap();
    assert_eq!(posted["model"], "gpt-4o-mini");
    assert_eq!(posted["max_completion_tokens"], 50);

    // 1,000 in and 200 out at openai's prices: 150 + 120 = 270 µ.
    let usage = json!({"choices": [{"message": {"content": "hi"}}], "model": "gpt-4o-mini",
                       "usage": {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200}});
    answer_attempt(&host, &mut req, "200", &usage);
    let reply = host.replies.borrow().last().cloned().unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-sluice-provider"), Some("openai"));
    assert_eq!(reply.header("x-sluice-failed"), Some("primary=503"));
    assert_eq!(reply.header("x-mock-name"), Some("fallback"));
    assert_eq!(reply.header("content-length"), None);
    assert_eq!(serde_json::from_slice::<Value>(&reply.body).unwrap(), usage);
    req.on_log(&host);
    assert_eq!(spent(&host), 270, "billed once, at the rung's prices");
    assert_eq!(outstanding(&host), 0);
    assert_eq!(
        host.metric("sluice_failover_total_outcome=rescued;"),
        Some(1)
    );
}

#[test]
fn when_every_rung_fails_the_ladder_ends_in_the_static_answer_or_the_held_failure() {
    // With a static answer: it ends the ladder.
    let host = MockHost::new(T0);
    let poller = load(&host, true);
    let mut req = post(&poller, &host, &[]);
    assert_eq!(fail(&host, &mut req, "429"), Action::Pause);
    answer_attempt(&host, &mut req, "503", &json!({"error": "down"}));
    let reply = host.replies.borrow().last().cloned().unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-sluice-failed"),
        Some("primary=429,openai=503")
    );
    assert!(String::from_utf8_lossy(&reply.body).contains("resting"));
    req.on_log(&host);
    assert_eq!(spent(&host), 0, "failed attempts are never billed");
    assert_eq!(outstanding(&host), 0);

    // Without one: the primary's own failure goes on, held until now.
    let host = MockHost::new(T0);
    let poller = load(&host, false);
    let mut req = post(&poller, &host, &[]);
    assert_eq!(fail(&host, &mut req, "502"), Action::Pause);
    answer_attempt(&host, &mut req, "500", &json!({"error": "down"}));
    assert!(host.replies.borrow().is_empty());
    assert_eq!(host.responses_resumed.get(), 1);
    assert_eq!(
        host.resp_header("x-sluice-failed").as_deref(),
        Some("primary=502,openai=500")
    );
    req.on_log(&host);
    assert_eq!(outstanding(&host), 0);
}

#[test]
fn the_callers_own_error_and_sluices_own_answers_never_fail_over() {
    let host = MockHost::new(T0);
    let poller = load(&host, true);
    let mut req = post(&poller, &host, &[]);
    assert_eq!(fail(&host, &mut req, "400"), Action::Continue);
    assert!(host.callouts.borrow().is_empty());
    req.on_log(&host);
}

#[test]
fn only_this_envoys_marker_skips_admission_and_a_forged_one_is_removed() {
    let host = MockHost::new(T0);
    let poller = load(&host, true);
    // A client's guess is removed, and its request admitted as any other.
    let req = post(&poller, &host, &[(failover::ATTEMPT_HEADER, "guess")]);
    assert_eq!(host.req_header(failover::ATTEMPT_HEADER), None);
    drop(req);
    assert_eq!(outstanding(&host), 1);

    // The real marker: passed on unadmitted, its routing header kept.
    let secret = String::from_utf8(host.get(failover::SECRET_KEY).unwrap().0).unwrap();
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("x-sluice-upstream", "openai"),
            (failover::ATTEMPT_HEADER, secret.as_str()),
        ],
        b"{}",
    );
    let mut inner = poller.request().unwrap();
    assert_eq!(inner.on_request_headers(&host, false), Action::Continue);
    assert_eq!(inner.on_request_body(&host, 2, true), Action::Continue);
    assert_eq!(host.req_header(failover::ATTEMPT_HEADER), None);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("openai")
    );
    assert_eq!(outstanding(&host), 1);
}

fn overflow_policy() -> Value {
    let mut p = policy(false);
    p["models"] = json!({
        "small": {"context_length": 8, "overflow": "big"},
        "big": {"context_length": 100000},
        "tight": {"context_length": 8},
    });
    p
}

fn post_model(poller: &Poller, host: &MockHost, model: &str) -> (Request, Action) {
    let body = json!({"model": model, "max_tokens": 5,
                      "messages": [{"role": "user", "content": "a b c d e f g h i j k l m n o p"}]})
    .to_string();
    let len = body.len().to_string();
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
            ("authorization", "Bearer sk-the-clients-own"),
        ],
        body.as_bytes(),
    );
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    let action = req.on_request_body(host, body.len(), true);
    (req, action)
}

#[test]
fn an_input_over_the_context_length_goes_to_the_overflow_model_or_is_refused_naming_it() {
    let host = MockHost::new(T0);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, overflow_policy().to_string().as_bytes()));
    let (_req, action) = post_model(&poller, &host, "small");
    assert_eq!(action, Action::Continue);
    let sent: Value = serde_json::from_slice(&host.request_body.borrow()).unwrap();
    assert_eq!(sent["model"], "big", "the overflow model is sent");

    let (_req, action) = post_model(&poller, &host, "tight");
    assert_eq!(action, Action::Pause);
    let reply = host.replies.borrow().last().cloned().unwrap();
    assert_eq!(reply.status, 400);
    let error: Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(error["error"]["code"], "context_length_exceeded");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("8 tokens"),
        "{error}"
    );
}

#[test]
fn a_servers_context_length_refusal_is_sent_again_as_the_overflow_model() {
    let host = MockHost::new(T0);
    let mut p = overflow_policy();
    p["models"]["small"]["context_length"] = json!(100);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let (mut req, action) = post_model(&poller, &host, "small");
    assert_eq!(action, Action::Continue);
    assert_eq!(
        fail(&host, &mut req, "400"),
        Action::Pause,
        "read to its end"
    );
    let refusal = json!({"error": {"code": "context_length_exceeded", "message": "too long"}});
    *host.response_body.borrow_mut() = refusal.to_string().into_bytes();
    let size = host.response_body.borrow().len();
    assert_eq!(req.on_response_body(&host, size, true), Action::Pause);
    let call = host.callouts.borrow().last().cloned().unwrap();
    let header = |name: &str| {
        call.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("x-sluice-upstream"), None, "the primary's route");
    assert!(
        header("authorization").is_some(),
        "the primary keeps the client's key"
    );
    let posted: Value = serde_json::from_slice(&host.posted.borrow().last().unwrap().1).unwrap();
    assert_eq!(posted["model"], "big");
    answer_attempt(
        &host,
        &mut req,
        "200",
        &json!({"choices": [], "model": "big"}),
    );
    let reply = host.replies.borrow().last().cloned().unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-sluice-failed"), Some("primary=400"));

    // Another 400 goes on as it came.
    let (mut req, _) = post_model(&poller, &host, "small");
    assert_eq!(fail(&host, &mut req, "400"), Action::Pause);
    *host.response_body.borrow_mut() = br#"{"error":{"code":"content_filter"}}"#.to_vec();
    let size = host.response_body.borrow().len();
    assert_eq!(req.on_response_body(&host, size, true), Action::Continue);
}
