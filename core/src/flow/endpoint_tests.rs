//! Deny by default through the whole request path (mock host): a body or
//! a POST to a path sluice does not read is refused unless a `passthrough`
//! rule opens it; bodyless reads go on.

use serde_json::{json, Value};

use super::*;
use crate::host::mock::MockHost;

const T0: u64 = 1_700_000_000_000;

fn load(host: &MockHost, policy: Value) -> Poller {
    let mut poller = Poller::new();
    assert!(poller.configure(host, policy.to_string().as_bytes()));
    poller
}

/// The request headers of `method path` (with `extra`); what sluice does
/// with them, `end` saying whether they end the stream.
fn headers(
    poller: &Poller,
    host: &MockHost,
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    end: bool,
) -> (Request, Action) {
    let mut all = vec![(":method", method), (":path", path)];
    all.extend_from_slice(extra);
    host.begin(&all, b"");
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    let action = req.on_request_headers(host, end);
    (req, action)
}

fn reason(host: &MockHost) -> Option<(u32, String)> {
    let reply = host.last_reply()?;
    let reason = reply
        .headers
        .iter()
        .find(|(n, _)| n == "x-sluice-reason")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    Some((reply.status, reason))
}

fn policy() -> Value {
    json!({
        "default_tier": "t",
        "tiers": {"t": {"requests": "100/min"}},
        "passthrough": [{"path": "/v1/audio/transcriptions", "requests": "1/min"}],
    })
}

#[test]
fn unknown_endpoints_with_work_are_refused_and_reads_go_on() {
    let host = MockHost::new(T0);
    let poller = load(&host, policy());
    let denied =
        "sluice_requests_total_decision=refuse;.reason=unknown_endpoint;.tier=t;.model=none;";
    for (method, path, extra, end) in [
        (
            "POST",
            "/v1/audio/speech",
            vec![("content-length", "10")],
            false,
        ),
        ("POST", "/v1/images/generations", vec![], true), // a POST, even bodyless
        ("PUT", "/v1/whatever", vec![("content-length", "3")], false),
        // A body on a GET, however it is announced.
        ("GET", "/v1/models", vec![("content-length", "12")], false),
        (
            "GET",
            "/v1/models",
            vec![("transfer-encoding", "chunked")],
            false,
        ),
        ("GET", "/v1/models", vec![], false), // HTTP/2 DATA frames, no length
    ] {
        host.replies.borrow_mut().clear();
        let (_, action) = headers(&poller, &host, method, path, &extra, end);
        assert_eq!(action, Action::Pause, "{method} {path} {extra:?}");
        assert_eq!(
            reason(&host),
            Some((404, "unknown_endpoint".into())),
            "{method} {path} {extra:?}"
        );
        let body: Value = serde_json::from_slice(&host.last_reply().unwrap().body).unwrap();
        assert_eq!(body["error"]["code"], "unknown_endpoint");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
    assert!(host.metric(denied).unwrap_or(0) >= 6, "{:?}", host.metrics);
    // Bodyless reads carry no work: they go on under the request buckets.
    for (method, path) in [
        ("GET", "/v1/models"),
        ("GET", "/healthz"),
        ("HEAD", "/"),
        ("DELETE", "/v1/files/x"),
    ] {
        host.replies.borrow_mut().clear();
        let (_, action) = headers(
            &poller,
            &host,
            method,
            path,
            &[("content-length", "0")],
            true,
        );
        assert_eq!(action, Action::Continue, "{method} {path}");
        assert!(host.replies.borrow().is_empty(), "{method} {path}");
    }
}

#[test]
fn a_body_on_any_method_to_an_llm_path_is_read() {
    let host = MockHost::new(T0);
    let poller = load(&host, policy());
    // A GET with a body to chat: read and decided like a POST.
    let (_, action) = headers(
        &poller,
        &host,
        "GET",
        "/v1/chat/completions",
        &[("content-length", "20")],
        false,
    );
    assert_eq!(action, Action::Pause, "waits for the body");
    assert!(host.replies.borrow().is_empty());
    // `;` parameters: the path they name.
    let (_, action) = headers(
        &poller,
        &host,
        "POST",
        "/v1/chat/completions;x",
        &[("content-length", "20")],
        false,
    );
    assert_eq!(action, Action::Pause);
    assert!(host.replies.borrow().is_empty());
    // Readings that name two APIs: 400.
    let (_, action) = headers(
        &poller,
        &host,
        "POST",
        "/v1/chat/completions;/../../embeddings",
        &[("content-length", "20")],
        false,
    );
    assert_eq!(action, Action::Pause);
    assert_eq!(reason(&host), Some((400, "invalid_request".into())));
}

#[test]
fn a_passthrough_rule_opens_its_path_under_its_own_limit() {
    let host = MockHost::new(T0);
    let poller = load(&host, policy());
    let path = "/v1/audio/%74ranscriptions";
    let cl = [("content-length", "5000")];
    let (_, first) = headers(&poller, &host, "POST", path, &cl, false);
    assert_eq!(first, Action::Continue, "not read: goes on at the headers");
    assert!(host.replies.borrow().is_empty());
    let (_, second) = headers(&poller, &host, "POST", path, &cl, false);
    assert_eq!(second, Action::Pause);
    assert_eq!(reason(&host), Some((429, "route_rate_limit".into())));
    // Another method is not opened by the rule.
    let (_, put) = headers(&poller, &host, "PUT", path, &cl, false);
    assert_eq!(put, Action::Pause);
    assert_eq!(reason(&host), Some((404, "unknown_endpoint".into())));
}
