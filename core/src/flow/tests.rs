//! The whole request path through the mock host: every decision the
//! proxy-wasm adapter used to make, natively.

use std::sync::Arc;

use serde_json::{json, Value};

use super::*;
use crate::host::mock::MockHost;
use crate::state::store::{MemStore, SharedStore};

const T0: u64 = 1_700_000_000_000;

fn load(host: &MockHost, policy: Value) -> Poller {
    let mut poller = Poller::new();
    assert!(poller.configure(host, policy.to_string().as_bytes()));
    poller
}

fn chat(model: &str, max_tokens: u64) -> Value {
    json!({"model": model, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "hello there"}]})
}

/// A POST from `addr` with `extra` headers, its body delivered whole.
fn post(
    poller: &Poller,
    host: &MockHost,
    addr: &str,
    extra: &[(&str, &str)],
    body: &Value,
) -> (Request, Action) {
    let body = body.to_string();
    let len = body.len().to_string();
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-type", "application/json"),
        ("content-length", len.as_str()),
    ];
    headers.extend_from_slice(extra);
    host.begin(&headers, body.as_bytes());
    host.set_prop(&["source", "address"], addr.as_bytes());
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    let action = req.on_request_body(host, body.len(), true);
    (req, action)
}

/// The upstream answers; the stream ends and is logged.
fn answer(host: &MockHost, req: &mut Request, status: &str, headers: &[(&str, &str)], body: &str) {
    let mut all = vec![(":status", status)];
    all.extend_from_slice(headers);
    host.respond(&all);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    assert_eq!(req.on_response_headers(host), Action::Continue);
    *host.response_body.borrow_mut() = body.as_bytes().to_vec();
    assert_eq!(
        req.on_response_body(host, body.len(), true),
        Action::Continue
    );
    req.on_log(host);
}

fn record(host: &MockHost, model: &str) -> route::RouteHealth {
    route::read(host, &format!("sluice:v1:upstream/{model}")).0
}

#[test]
fn an_admitted_stream_is_rewritten_metered_and_settled_from_usage() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"tokens": "10000/min"}}, "audit": {}}),
    );
    let mut body = chat("m", 50);
    body["stream"] = json!(true);
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", &[], &body);
    assert_eq!(action, Action::Continue);
    assert!(host.replies.borrow().is_empty());
    // The upstream is asked for the usage chunk; the length follows.
    let sent: Value = serde_json::from_slice(&host.request_body.borrow()).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert_eq!(
        host.req_header("content-length").unwrap(),
        host.request_body.borrow().len().to_string()
    );
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(1)
    );
    let estimated = host
        .metric("sluice_tokens_total_direction=output;.kind=estimated;.tier=t;.model=other;")
        .unwrap();
    assert_eq!(estimated, 50);

    host.advance(40);
    let sse = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3,\"total_tokens\":8}}\n\n",
        "data: [DONE]\n\n",
    );
    answer(
        &host,
        &mut req,
        "200",
        &[("content-type", "text/event-stream")],
        sse,
    );
    // The client did not ask for usage: it does not see it.
    let delivered = String::from_utf8(host.response_body.borrow().clone()).unwrap();
    assert!(!delivered.contains("usage"), "{delivered}");
    assert!(delivered.contains("[DONE]"));
    assert_eq!(host.resp_header("content-length"), None);
    let actual = |dir: &str| {
        host.metric(&format!(
            "sluice_tokens_total_direction={dir};.kind=actual;.tier=t;.model=other;"
        ))
    };
    assert_eq!((actual("input"), actual("output")), (Some(5), Some(3)));
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0)
    );
    assert_eq!(
        host.state("sluice_usage_source").as_deref(),
        Some("upstream")
    );
    assert_eq!(host.state("sluice_decision").as_deref(), Some("admit"));
    assert_eq!(host.state("sluice_ttft_ms").as_deref(), Some("40"));
    let hist = host.histograms.borrow();
    assert_eq!(hist["sluice_ttft_milliseconds_model=other;"], vec![40]);
    assert_eq!(hist["sluice_e2e_milliseconds_model=other;"], vec![40]);
}

#[test]
fn a_request_the_upstream_never_answers_is_settled_once_in_on_log() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"tokens": "10000/min"}}}),
    );
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 50));
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(1)
    );
    req.on_log(&host);
    req.on_log(&host);
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0)
    );
    assert_eq!(
        host.metric(crate::host::metrics::USAGE_MISSING.name),
        Some(1)
    );
    // No e2e latency for a request without an answer.
    assert!(host.histograms.borrow().is_empty());
}

#[test]
fn refusals_are_answered_locally_and_counted() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"requests": "1/min"}}}),
    );
    let (_, first) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(first, Action::Continue);
    let (_, second) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(second, Action::Pause);
    let reply = host.last_reply().unwrap();
    assert_eq!(reply.status, 429);
    assert!(reply.header("retry-after").is_some());
    let json: Value = serde_json::from_slice(&reply.body).unwrap();
    assert!(json["error"]["message"].is_string(), "{json}");
    let reason = reply.header("x-sluice-reason").unwrap().to_string();
    let refused =
        format!("sluice_requests_total_decision=refuse;.reason={reason};.tier=t;.model=other;");
    assert_eq!(host.metric(&refused), Some(1), "{:?}", host.metrics);
    assert_eq!(
        host.metric(&crate::host::metrics::REFUSALS.named(&["tier/t/requests"])),
        Some(1)
    );
    // Another caller has its own bucket.
    let (_, other) = post(&poller, &host, "10.0.0.2:1", &[], &chat("m", 10));
    assert_eq!(other, Action::Continue);
}

#[test]
fn bodies_over_the_cap_are_refused_declared_or_streamed() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {}}, "request": {"max_body_bytes": 64}}),
    );
    // Declared: refused at the headers.
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-length", "65"),
        ],
        b"",
    );
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, false), Action::Pause);
    assert_eq!(host.last_reply().unwrap().status, 413);
    // Undeclared (chunked): refused as soon as the buffer passes the cap.
    host.begin(
        &[(":method", "POST"), (":path", "/v1/chat/completions")],
        b"",
    );
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, false), Action::Pause);
    assert_eq!(req.on_request_body(&host, 40, false), Action::Pause);
    assert!(host.replies.borrow().is_empty());
    assert_eq!(req.on_request_body(&host, 80, false), Action::Pause);
    assert_eq!(host.last_reply().unwrap().status, 413);
    // Decided: later callbacks pass through untouched.
    assert_eq!(req.on_request_body(&host, 120, true), Action::Continue);
    assert_eq!(host.replies.borrow().len(), 1);
}

#[test]
fn a_request_ending_with_trailers_is_decided_there_once() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"requests": "1/min"}}}),
    );
    let body = chat("m", 10).to_string();
    host.begin(
        &[(":method", "POST"), (":path", "/v1/chat/completions")],
        body.as_bytes(),
    );
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, false), Action::Pause);
    assert_eq!(req.on_request_body(&host, body.len(), false), Action::Pause);
    // No body callback ends the stream: the trailers decide.
    assert_eq!(req.on_request_trailers(&host), Action::Continue);
    assert_eq!(req.on_request_trailers(&host), Action::Continue);
    assert_eq!(
        req.on_request_body(&host, body.len(), true),
        Action::Continue
    );
    let admitted = "sluice_requests_total_decision=admit;.reason=none;.tier=t;.model=other;";
    assert_eq!(host.metric(admitted), Some(1), "{:?}", host.metrics);
    // The one request used the one slot: the next is refused.
    let (_, next) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(next, Action::Pause);
}

#[test]
fn ambiguous_paths_are_refused_for_post_and_passed_for_get() {
    let host = MockHost::new(T0);
    let poller = load(&host, json!({"default_tier": "t", "tiers": {"t": {}}}));
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/%252e%252e/completions"),
        ],
        b"{}",
    );
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, false), Action::Pause);
    let reply = host.last_reply().unwrap();
    assert_eq!(reply.status, 400);
    assert!(String::from_utf8_lossy(&reply.body).contains("ambiguous"));
    // Not a model call: it goes on under its raw path.
    host.begin(&[(":method", "GET"), (":path", "/models/%2563")], b"");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, true), Action::Continue);
    assert!(host.replies.borrow().is_empty());
}

#[test]
fn requests_without_a_body_are_decided_at_the_headers() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"requests": "1/min"}}}),
    );
    host.begin(&[(":method", "GET"), (":path", "/v1/models")], b"");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, true), Action::Continue);
    assert_eq!(req.on_request_headers(&host, true), Action::Pause);
    assert_eq!(host.last_reply().unwrap().status, 429);
}

#[test]
fn the_probe_is_claimed_only_after_admission_and_given_back_in_on_log() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({
            "default_tier": "t",
            "tiers": {"t": {"requests": "3/min"}},
            "models": {"m": {}},
            "protection": {"failures_to_open": 2, "min_callers": 2, "cooldown": "1s",
                           "pause_jitter": "0s"},
        }),
    );
    // C spends its three requests while the route is healthy (not recorded).
    for _ in 0..3 {
        let (mut req, action) = post(&poller, &host, "10.0.0.3:1", &[], &chat("m", 10));
        assert_eq!(action, Action::Continue);
        answer(&host, &mut req, "200", &[], "{}");
    }
    assert!(record(&host, "m").is_blank());
    // Two callers' 5xx open the breaker.
    for addr in ["10.0.0.1:1", "10.0.0.2:1"] {
        let (mut req, action) = post(&poller, &host, addr, &[], &chat("m", 10));
        assert_eq!(action, Action::Continue);
        answer(&host, &mut req, "500", &[], "{}");
    }
    assert_eq!(
        host.metric(crate::host::metrics::ERROR_BREAKER_OPENED.name),
        Some(1)
    );
    let (_, action) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Pause);
    assert_eq!(host.last_reply().unwrap().status, 503);

    host.advance(1_500);
    // C may probe, but admission refuses it: it never holds the probe.
    let (_, action) = post(&poller, &host, "10.0.0.3:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Pause);
    assert_eq!(host.last_reply().unwrap().status, 429);
    assert_eq!(record(&host, "m").probe_until_ms, 0);
    // A is admitted and claims it; its client leaves before the answer.
    let (mut probe, action) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Continue);
    assert!(record(&host, "m").probe_until_ms > T0);
    let (_, action) = post(&poller, &host, "10.0.0.2:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Pause, "one probe at a time");
    probe.on_log(&host);
    assert_eq!(record(&host, "m").probe_until_ms, 0, "given back");
    // B probes next; its success closes the breaker.
    let (mut req, action) = post(&poller, &host, "10.0.0.2:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Continue);
    answer(&host, &mut req, "200", &[], "{}");
    assert!(record(&host, "m").is_blank(), "{:?}", record(&host, "m"));
}

#[test]
fn a_429_with_retry_after_pauses_only_that_credential() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {}}, "models": {"m": {}},
               "protection": {"pause_jitter": "0s"}}),
    );
    let alice = [("authorization", "Bearer sk-alice")];
    let bob = [("authorization", "Bearer sk-bob")];
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", &alice, &chat("m", 10));
    answer(&host, &mut req, "429", &[("retry-after", "5")], "{}");
    assert_eq!(
        host.metric(&crate::host::metrics::UPSTREAM_PAUSES.named(&["credential"])),
        Some(1)
    );
    assert_eq!(
        host.metric(&crate::host::metrics::UPSTREAM_PAUSES.named(&["route"])),
        Some(0)
    );
    // The same credential from another address is paused…
    let (_, action) = post(&poller, &host, "10.0.0.9:1", &alice, &chat("m", 10));
    assert_eq!(action, Action::Pause);
    let reply = host.last_reply().unwrap();
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("retry-after"), Some("5"));
    // …another credential is not.
    let (_, action) = post(&poller, &host, "10.0.0.1:1", &bob, &chat("m", 10));
    assert_eq!(action, Action::Continue);
    host.advance(5_001);
    let (_, action) = post(&poller, &host, "10.0.0.1:1", &alice, &chat("m", 10));
    assert_eq!(action, Action::Continue);
}

#[test]
fn a_503_with_retry_after_pauses_the_route_and_envoys_own_answers_count_as_failures() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {}}, "models": {"m": {}},
               "protection": {"pause_jitter": "0s", "failures_to_open": 2, "min_callers": 2}}),
    );
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    answer(&host, &mut req, "503", &[("retry-after", "2")], "{}");
    assert_eq!(
        host.metric(&crate::host::metrics::UPSTREAM_PAUSES.named(&["route"])),
        Some(1)
    );
    let (_, action) = post(&poller, &host, "10.0.0.2:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Pause);
    assert_eq!(host.last_reply().unwrap().status, 503);
    host.advance(2_001);
    // Resets (status 0 at the log, no response headers) and Envoy's own
    // 503s are failures too.
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Continue);
    host.respond(&[(":status", "503")]);
    host.set_prop(
        &["response", "code_details"],
        b"upstream_reset_before_response_started",
    );
    req.on_response_headers(&host);
    req.on_log(&host);
    assert_eq!(record(&host, "m").failures, 2, "the 503 and the reset");
    assert_eq!(
        host.metric(crate::host::metrics::ERROR_BREAKER_OPENED.name),
        Some(0),
        "one caller"
    );
    let (mut req, _) = post(&poller, &host, "10.0.0.2:1", &[], &chat("m", 10));
    answer(&host, &mut req, "502", &[], "");
    assert_eq!(
        host.metric(crate::host::metrics::ERROR_BREAKER_OPENED.name),
        Some(1)
    );
}

fn sidecar_policy() -> Value {
    json!({
        "default_tier": "t", "tiers": {"t": {}},
        "sidecar": {"cluster": "sluice_sidecar", "poll_wait": "20s", "stale_after": "10s"},
        "fallback": {"header": "x-sluice-upstream", "value": "backup", "provider": "acme"},
    })
}

fn publish(host: &MockHost, state: Value) {
    let bytes = crate::admission::route::encode_seen(host.now_ms(), state.to_string().as_bytes());
    host.set(SIDECAR_KEY, &bytes, 0).unwrap();
}

#[test]
fn the_kill_switch_reroutes_with_the_header_and_a_route_cache_refresh() {
    let host = MockHost::new(T0);
    let poller = load(&host, sidecar_policy());
    publish(
        &host,
        json!({"version": 3, "kill_switch": {"active": true}}),
    );
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("backup")
    );
    assert_eq!(host.route_cache_clears.get(), 1);
    assert_eq!(host.metric(crate::host::metrics::REROUTED.name), Some(1));
    answer(&host, &mut req, "500", &[], "{}");
    assert_eq!(
        host.resp_header("x-sluice-provider").as_deref(),
        Some("acme")
    );
    assert_eq!(
        host.resp_header("x-sluice-kill-switch").as_deref(),
        Some("1")
    );
    // The fallback's failures say nothing about the primary route.
    assert!(record(&host, "other#0").is_blank());

    // Switch off: a client cannot pick the fallback route itself.
    publish(&host, json!({"version": 4}));
    let (_, action) = post(
        &poller,
        &host,
        "10.0.0.1:1",
        &[("x-sluice-upstream", "backup")],
        &chat("m", 10),
    );
    assert_eq!(action, Action::Continue);
    assert_eq!(host.req_header("x-sluice-upstream"), None);
    assert_eq!(host.route_cache_clears.get(), 1);
}

#[test]
fn the_client_routing_header_is_stripped_without_a_fallback_section() {
    let host = MockHost::new(T0);
    let poller = load(&host, json!({"default_tier": "t", "tiers": {"t": {}}}));
    host.begin(
        &[
            (":method", "GET"),
            (":path", "/v1/models"),
            (crate::admission::ladder::DEFAULT_ROUTE_HEADER, "x"),
        ],
        b"",
    );
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, true), Action::Continue);
    assert_eq!(
        host.req_header(crate::admission::ladder::DEFAULT_ROUTE_HEADER),
        None
    );
}

#[test]
fn an_open_sidecar_breaker_refuses_with_gpu_overloaded() {
    let host = MockHost::new(T0);
    let poller = load(&host, sidecar_policy());
    publish(
        &host,
        json!({"version": 1, "breakers": [{"scope": "model:m", "state": "open",
               "retry_after_seconds": 7}]}),
    );
    let (_, action) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Pause);
    let reply = host.last_reply().unwrap();
    assert_eq!(
        (reply.status, reply.header("retry-after")),
        (503, Some("7"))
    );
    assert_eq!(reply.header("x-sluice-reason"), Some("gpu_overloaded"));
}

#[test]
fn one_root_holds_the_poll_lease_and_renews_it_while_polling() {
    let store = Arc::new(MemStore::default());
    let a = MockHost::sharing(store.clone(), T0);
    let b = MockHost::sharing(store, T0 + 3);
    let mut pa = load(&a, sidecar_policy());
    let mut pb = load(&b, sidecar_policy());
    assert_eq!(a.tick_period_ms.get(), Some(TICK_MS));
    pa.tick(&a);
    pb.tick(&b);
    assert_eq!(a.callouts.borrow().len(), 1);
    assert_eq!(b.callouts.borrow().len(), 0, "the lease is taken");
    let poll = a.callouts.borrow()[0].clone();
    assert_eq!(poll.cluster, "sluice_sidecar");
    assert!(poll
        .headers
        .contains(&(":path".into(), "/v1/state?since=0&wait=5".into())));
    assert_eq!(poll.timeout_ms, 10_000);
    // The long poll is in flight past the lease: ticks keep renewing it.
    for _ in 0..4 {
        a.advance(2_000);
        b.advance(2_000);
        pa.tick(&a);
        pb.tick(&b);
    }
    assert_eq!(a.callouts.borrow().len(), 1, "one poll in flight");
    assert_eq!(b.callouts.borrow().len(), 0);
    // The answer is stored for every worker; the next poll asks from it.
    *a.call_response_headers.borrow_mut() = vec![(":status".into(), "200".into())];
    let state = json!({"version": 9, "kill_switch": {"active": true},
                       "breakers": [{"scope": "model:x", "state": "open"}]});
    *a.call_response_body.borrow_mut() = state.to_string().into_bytes();
    pa.on_call_response(&a, 99, 10); // not our token: ignored
    assert!(b.get(SIDECAR_KEY).is_none());
    pa.on_call_response(&a, poll.token, state.to_string().len());
    let seen = crate::admission::route::decode_seen(&b.get(SIDECAR_KEY).unwrap().0);
    assert_eq!(seen.state.unwrap().version, 9);
    assert_eq!(a.metric(crate::host::metrics::KILL_SWITCH.name), Some(1));
    assert_eq!(a.metric(crate::host::metrics::BREAKERS_OPEN.name), Some(1));
    assert_eq!(a.metric(crate::host::metrics::SIDECAR_POLLS.name), Some(1));
    let next = a.callouts.borrow()[1].clone();
    assert!(next
        .headers
        .contains(&(":path".into(), "/v1/state?since=9&wait=5".into())));
    // The holder stops (its VM gone): the other takes over after the lease.
    b.advance(LEASE_MS + 1);
    pb.tick(&b);
    assert_eq!(b.callouts.borrow().len(), 1);
}

#[test]
fn a_failing_sidecar_is_logged_once_per_outage_and_retried_after_a_pause() {
    let host = MockHost::new(T0);
    let mut poller = load(&host, sidecar_policy());
    *host.dispatch_error.borrow_mut() = Some("BadArgument".into());
    poller.tick(&host);
    assert_eq!(
        host.metric(crate::host::metrics::SIDECAR_POLL_ERRORS.name),
        Some(1)
    );
    poller.tick(&host);
    assert_eq!(host.callouts.borrow().len(), 0, "waits before retrying");
    host.advance(1_000);
    poller.tick(&host);
    assert_eq!(host.callouts.borrow().len(), 1);
    let warns = |host: &MockHost| {
        host.logs
            .borrow()
            .iter()
            .filter(|(l, m)| *l == log::Level::Warn && m.contains("unreachable"))
            .count()
    };
    for status in ["503", "200"] {
        *host.call_response_headers.borrow_mut() = vec![(":status".into(), status.into())];
        *host.call_response_body.borrow_mut() = b"not json".to_vec();
        let token = host.callouts.borrow().last().unwrap().token;
        poller.on_call_response(&host, token, 8);
        host.advance(1_000);
        poller.tick(&host);
    }
    assert_eq!(warns(&host), 1);
    assert_eq!(
        host.metric(crate::host::metrics::SIDECAR_POLL_ERRORS.name),
        Some(3)
    );
    assert!(
        host.get(SIDECAR_KEY).is_none(),
        "nothing unreadable is stored"
    );
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), "200".into())];
    *host.call_response_body.borrow_mut() = br#"{"version":1}"#.to_vec();
    let token = host.callouts.borrow().last().unwrap().token;
    poller.on_call_response(&host, token, 13);
    assert!(host
        .logs
        .borrow()
        .iter()
        .any(|(_, m)| m == "sidecar reachable again"));
}

#[test]
fn audit_fields_are_written_and_bounded() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"tokens": "100000/min"}},
               "audit": {"salt": "s", "hash_bodies": true}}),
    );
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Continue, "{:?}", host.last_reply());
    // Kept in the stream until its end: no host call yet.
    assert!(host.filter_state.borrow().is_empty());
    let line = req.audit_line();
    assert_eq!(line["model_requested"], "m");
    assert_eq!(line["tier"], "t");
    assert!(line["principal"].is_string());
    assert_eq!(line["request_sha256"].as_str().unwrap().len(), 64);
    assert!(line["tokens_estimated"].as_u64().unwrap() > 10);
    answer(
        &host,
        &mut req,
        "200",
        &[("content-type", "application/json")],
        "{\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}",
    );
    assert_eq!(
        host.state("sluice_response_sha256").unwrap(),
        crate::policy::keys::sha256_hex(
            b"{\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}"
        )
    );
    assert_eq!(host.state("sluice_tokens_output").as_deref(), Some("1"));
    // One filter-state value, written once, with the request's own fields.
    assert_eq!(host.take_calls().get("set_property"), Some(&1));
    let names: Vec<String> = host.filter_state.borrow().keys().cloned().collect();
    assert_eq!(names, ["sluice_audit"]);
    assert_eq!(host.state("sluice_method").as_deref(), Some("POST"));
    assert_eq!(
        host.state("sluice_route").as_deref(),
        Some("/v1/chat/completions")
    );
    // Whatever a value holds, a field stays within the bound, in whole
    // characters (`audit::tests`).
    let _ = MAX_AUDIT_BYTES;
}

#[test]
fn without_an_audit_section_nothing_is_written_to_filter_state() {
    let host = MockHost::new(T0);
    let poller = load(&host, json!({"default_tier": "t", "tiers": {"t": {}}}));
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    answer(&host, &mut req, "200", &[], "{}");
    assert!(host.filter_state.borrow().is_empty());
}

#[test]
fn metrics_exist_at_zero_once_a_policy_loads_and_a_bad_policy_keeps_the_last() {
    let host = MockHost::new(T0);
    let mut poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"requests": "5/min"}}}),
    );
    for m in crate::host::metrics::ALL
        .iter()
        .filter(|m| m.labels.is_empty())
    {
        if m.kind != crate::host::MetricKind::Histogram {
            assert_eq!(host.metric(m.name), Some(0), "{}", m.name);
        }
    }
    assert_eq!(
        host.metric(&crate::host::metrics::REFUSALS.named(&["tier/t/requests"])),
        Some(0)
    );
    let kinds = host.metrics.borrow();
    assert_eq!(
        kinds[crate::host::metrics::KILL_SWITCH.name].0,
        crate::host::MetricKind::Gauge
    );
    assert_eq!(
        kinds[crate::host::metrics::REROUTED.name].0,
        crate::host::MetricKind::Counter
    );
    drop(kinds);
    assert_eq!(host.tick_period_ms.get(), None, "no sidecar, no tick");
    assert!(!poller.configure(&host, b"{\"default_tier\": 7}"));
    assert_eq!(
        host.metric(crate::host::metrics::CONFIG_REJECTED.name),
        Some(1)
    );
    assert!(host
        .logs
        .borrow()
        .iter()
        .any(|(l, _)| *l == log::Level::Error));
    assert!(poller.request().is_some(), "the last good policy stays");
    assert!(Poller::new().request().is_none());
}

#[test]
fn the_global_breaker_gauge_follows_admission_and_settlement() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"tokens": "1000000/min"}},
               "models": {"paid": {"price": {"input_per_1k": 1.0, "output_per_1k": 1.0}}},
               "anomaly": {"max_spend_per_hour": 0.05}}),
    );
    let mut opened = false;
    for i in 0..20 {
        let addr = format!("10.0.0.{i}:1");
        let (mut req, action) = post(&poller, &host, &addr, &[], &chat("paid", 10));
        if action == Action::Pause {
            let reply = host.last_reply().unwrap();
            assert_eq!(reply.header("x-sluice-reason"), Some("global_breaker_open"));
            assert_eq!(
                host.metric(crate::host::metrics::GLOBAL_BREAKER.name),
                Some(1)
            );
            opened = true;
            break;
        }
        assert_eq!(
            host.metric(crate::host::metrics::GLOBAL_BREAKER.name),
            Some(0)
        );
        answer(
            &host,
            &mut req,
            "200",
            &[("content-type", "application/json")],
            "{\"usage\":{\"prompt_tokens\":10000,\"completion_tokens\":0}}",
        );
    }
    assert!(opened, "{:?}", host.metrics);
}

#[test]
fn the_global_breaker_sees_spend_of_tiers_without_token_buckets() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"requests": "1000/min"}},
               "models": {"paid": {"price": {"input_per_1k": 1.0, "output_per_1k": 1.0}}},
               "anomaly": {"max_spend_per_hour": 0.05}}),
    );
    let mut admitted = 0;
    for i in 0..20 {
        let addr = format!("10.0.0.{i}:1");
        let (mut req, action) = post(&poller, &host, &addr, &[], &chat("paid", 10));
        if action == Action::Pause {
            let reply = host.last_reply().unwrap();
            assert_eq!(reply.header("x-sluice-reason"), Some("global_breaker_open"));
            break;
        }
        admitted += 1;
        answer(
            &host,
            &mut req,
            "200",
            &[("content-type", "application/json")],
            "{\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":0}}",
        );
    }
    // 0.01 per request: the ceiling of 0.05 is reached after five.
    assert_eq!(admitted, 5, "{:?}", host.metrics);
}

#[test]
fn a_repeated_credential_header_is_refused_at_the_headers() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "free", "tiers": {"free": {}, "pro": {}},
               "identity": {"sources": ["api_key", "client_address"],
                            "api_key": {"keys": {"k-pro": "pro"}}}}),
    );
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("x-api-key", "k-pro"),
            ("x-api-key", "k-other"),
        ],
        b"{}",
    );
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, false), Action::Pause);
    let reply = host.last_reply().unwrap();
    assert!(reply.status >= 400, "{reply:?}");
    // The refused request reads no body and is never decided again.
    assert_eq!(req.on_request_body(&host, 2, true), Action::Continue);
    assert_eq!(host.replies.borrow().len(), 1);
}

#[test]
fn a_stream_past_its_allowance_is_cut_and_charged_what_it_sent() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"tokens": "10000/min"}}}),
    );
    let mut body = chat("m", 3);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", &[], &body);
    assert_eq!(action, Action::Continue);
    host.respond(&[
        (":status", "200"),
        ("content-type", "text/event-stream"),
        ("content-length", "999"),
    ]);
    req.on_response_headers(&host);
    assert_eq!(
        host.resp_header("content-length"),
        None,
        "sluice may change the length"
    );
    let event = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
    // Events arrive over several callbacks; the upstream ignores max_tokens.
    for _ in 0..3 {
        let chunk = event.repeat(4);
        *host.response_body.borrow_mut() = chunk.clone().into_bytes();
        req.on_response_body(&host, chunk.len(), false);
    }
    *host.response_body.borrow_mut() = Vec::new();
    req.on_response_body(&host, 0, true);
    req.on_log(&host);
    assert_eq!(host.metric(crate::host::metrics::STREAM_CUT.name), Some(1));
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0)
    );
    let output = host
        .metric("sluice_tokens_total_direction=output;.kind=actual;.tier=t;.model=other;")
        .unwrap();
    assert!(output >= 3, "charged what was sent: {output}");
}

/// The cut's own callback passes its end (the error event, `[DONE]`) on;
/// the upstream's next chunk resets the stream, once; settled at the log.
#[test]
fn a_cut_stream_whose_upstream_sends_on_is_reset_once_after_its_end_went_out() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"tokens": "10000/min"}}}),
    );
    let mut body = chat("m", 3);
    body["stream"] = json!(true);
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", &[], &body);
    assert_eq!(action, Action::Continue);
    host.respond(&[(":status", "200"), ("content-type", "text/event-stream")]);
    req.on_response_headers(&host);
    let event = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
    let feed = |req: &mut crate::flow::Request, end: bool| {
        let chunk = event.repeat(4);
        *host.response_body.borrow_mut() = chunk.clone().into_bytes();
        req.on_response_body(&host, chunk.len(), end);
        String::from_utf8_lossy(&host.response_body.borrow()).into_owned()
    };
    let sent = feed(&mut req, false);
    assert!(sent.ends_with("data: [DONE]\n\n"), "{sent}");
    assert_eq!(host.stream_resets.get(), 0, "the cut's own chunk goes out");
    assert_eq!(feed(&mut req, false), "");
    assert_eq!(host.stream_resets.get(), 1, "the upstream sent on");
    assert_eq!(feed(&mut req, false), "");
    assert_eq!(host.stream_resets.get(), 1, "once");
    req.on_log(&host);
    assert_eq!(
        host.metric(crate::host::metrics::STREAM_RESET.name),
        Some(1)
    );
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0)
    );
    let output = host
        .metric("sluice_tokens_total_direction=output;.kind=actual;.tier=t;.model=other;")
        .unwrap();
    assert_eq!(output, 3, "charged what the client got");

    // An upstream that ends in the chunk after the cut is not reset.
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", &[], &body);
    host.respond(&[(":status", "200"), ("content-type", "text/event-stream")]);
    req.on_response_headers(&host);
    feed(&mut req, false);
    feed(&mut req, true);
    req.on_log(&host);
    assert_eq!(host.stream_resets.get(), 1);
}

#[test]
fn non_model_calls_keep_no_latency_histograms() {
    let host = MockHost::new(T0);
    let poller = load(&host, json!({"default_tier": "t", "tiers": {"t": {}}}));
    host.begin(&[(":method", "GET"), (":path", "/v1/models")], b"");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, true), Action::Continue);
    host.respond(&[(":status", "200")]);
    req.on_response_headers(&host);
    *host.response_body.borrow_mut() = b"{\"data\":[]}".to_vec();
    req.on_response_body(&host, 11, true);
    req.on_log(&host);
    assert!(host.histograms.borrow().is_empty());
    assert_eq!(host.response_body.borrow().as_slice(), b"{\"data\":[]}");
}

#[test]
fn an_unreadable_body_is_refused_400_and_a_refusal_names_its_bucket() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {"requests": "1/min"}}, "audit": {}}),
    );
    host.begin(
        &[(":method", "POST"), (":path", "/v1/chat/completions")],
        b"{not json",
    );
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, false), Action::Pause);
    assert_eq!(req.on_request_body(&host, 9, true), Action::Pause);
    let reply = host.last_reply().unwrap();
    assert_eq!(reply.status, 400);
    assert_eq!(reply.header("x-sluice-reason"), Some("invalid_request"));
    assert_eq!(req.audit_line()["decision"], "refuse");
    let (_, first) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(first, Action::Continue, "a refused body took no slot");
    let (refused, second) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(second, Action::Pause);
    assert_eq!(refused.audit_line()["bucket"], "tier/t/requests");
}

#[test]
fn a_failed_route_cache_refresh_is_logged_and_the_request_still_rerouted() {
    let host = MockHost::new(T0);
    let poller = load(&host, sidecar_policy());
    publish(
        &host,
        json!({"version": 1, "kill_switch": {"active": true}}),
    );
    *host.route_cache_error.borrow_mut() = Some("NotFound".into());
    let (_, action) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("backup")
    );
    assert!(host
        .logs
        .borrow()
        .iter()
        .any(|(l, m)| *l == log::Level::Warn && m.contains("clear_route_cache")));
}

#[test]
fn a_settlement_outlasts_a_contention_storm_and_an_unwritable_charge_is_counted_and_logged() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        json!({"default_tier": "t", "tiers": {"t": {}},
               "models": {"m": {"tokens": "100000/min"}},
               "state": {"cas_max_retries": 2}}),
    );
    let used = || {
        crate::limits::reservation::shared_used(&host, "model/m/tokens")
            / crate::policy::units::SCALE
    };
    let usage = |completion: u64| {
        format!(
            "{{\"choices\":[],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{completion}}}}}"
        )
    };
    let json = [("content-type", "application/json")];
    // The upstream produced far more than reserved; while it answered,
    // other workers won 15 writes in a row (a take gives up after 2).
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    host.lose_writes.set(15);
    answer(&host, &mut req, "200", &json, &usage(500));
    assert_eq!(used(), 505, "charged in full");
    assert_eq!(
        host.metric(crate::host::metrics::CAS_RETRIES.name),
        Some(15)
    );
    assert_eq!(
        host.metric(crate::host::metrics::CAS_EXHAUSTED.name),
        Some(0)
    );
    // A storm past the settlement's bound (2 × 8 tries): not written, but
    // counted and said.
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", &[], &chat("m", 10));
    let before = used();
    host.lose_writes.set(16);
    answer(&host, &mut req, "200", &json, &usage(500));
    assert_eq!(used(), before, "the bucket kept the reservation");
    assert_eq!(
        host.metric(crate::host::metrics::CAS_EXHAUSTED.name),
        Some(1)
    );
    assert!(host
        .logs
        .borrow()
        .iter()
        .any(|(level, m)| *level == log::Level::Warn && m.contains("under-charged")));
}
