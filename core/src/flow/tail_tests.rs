//! The decision's one tail (`Stream::conclude`) with the cache, the queue
//! and the kill switch together, through the mock host: a request decided
//! as it arrives and one decided when its turn in the queue comes run the
//! same function, so the fallback's answer is never stored under the
//! primary's cache key on either path.

use serde_json::{json, Value};

use super::{Poller, Request, CONCLUDED, SIDECAR_KEY};
use crate::host::mock::MockHost;
use crate::host::Action;
use crate::state::store::SharedStore;

const T0: u64 = 1_700_000_000_000;

/// One slot for `m`, a queueing class, a sidecar with a fallback, and
/// `m`'s answers cached in Envoy (scoped to the caller).
fn policy() -> Value {
    json!({
        "default_tier": "free",
        "identity": {"sources": ["trusted_header"],
                     "trusted_header": {"principal": "x-user", "tier": "x-tier"}},
        "tiers": {"free": {"class": "standard"}},
        "classes": {"standard": {"max_wait": "5s", "max_depth": 2}},
        "models": {"m": {"concurrency": 1}},
        "sidecar": {"cluster": "sidecar", "stale_after": "10s"},
        "fallback": {"header": "x-sluice-upstream", "value": "backup", "provider": "acme"},
        "cache": {"salt": "s", "models": {"m": {"exact": true}}},
    })
}

fn load(host: &MockHost) -> Poller {
    let mut poller = Poller::new();
    assert!(poller.configure(host, policy().to_string().as_bytes()));
    poller
}

/// The sidecar's state as its poll leaves it, the kill switch `active`.
fn kill_switch(host: &MockHost, version: u64, active: bool) {
    let state = json!({"version": version, "kill_switch": {"active": active}, "breakers": []});
    let bytes =
        crate::admission::route::encode_seen(host.clock_ms.get(), state.to_string().as_bytes());
    let cas = host.get(SIDECAR_KEY).map_or(0, |(_, cas)| cas);
    host.set(SIDECAR_KEY, &bytes, cas).unwrap();
}

/// `user` asks `question` of `m` on context `ctx`.
fn ask(
    poller: &Poller,
    host: &MockHost,
    ctx: u32,
    user: &str,
    question: &str,
) -> (Request, Action) {
    let body = json!({"model": "m", "max_tokens": 8, "temperature": 0,
                      "messages": [{"role": "user", "content": question}]})
    .to_string();
    let len = body.len().to_string();
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
            ("x-user", user),
        ],
        body.as_bytes(),
    );
    let mut req = poller.request_for(ctx).unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    let action = req.on_request_body(host, body.len(), true);
    (req, action)
}

const ANSWER: &str = r#"{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;

/// The upstream (whichever Envoy routed it to) answers `req` 200, whole.
fn answer(host: &MockHost, req: &mut Request) {
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    req.on_response_headers(host);
    *host.response_body.borrow_mut() = ANSWER.as_bytes().to_vec();
    req.on_response_body(host, ANSWER.len(), true);
    req.on_log(host);
}

fn stores(host: &MockHost) -> i64 {
    host.metric("sluice_cache_total_result=store;.kind=exact;.model=m;")
        .unwrap_or(0)
}

/// Is `user`'s `question` answered from the cache now?
fn cached(poller: &Poller, host: &MockHost, ctx: u32, user: &str, question: &str) -> bool {
    let (mut req, action) = ask(poller, host, ctx, user, question);
    let hit = host
        .last_reply()
        .is_some_and(|r| r.header("x-sluice-cache") == Some("hit"));
    assert_eq!(action == Action::Pause, hit, "a miss goes on at once");
    if !hit {
        answer(host, &mut req);
    }
    hit
}

fn concluded() -> u32 {
    CONCLUDED.with(|c| c.get())
}

/// Decided as it arrived, while the kill switch is pulled: one run of the
/// tail sends it to the fallback, whose answer is not stored; the primary's
/// answer to the same question, once the switch is released, is.
#[test]
fn a_request_the_kill_switch_sends_to_the_fallback_at_once_stores_nothing() {
    let host = MockHost::new(T0);
    let poller = load(&host);
    kill_switch(&host, 1, true);
    let before = concluded();
    let (mut req, action) = ask(&poller, &host, 1, "a", "who answers?");
    assert_eq!(action, Action::Continue, "a miss, to the fallback");
    assert_eq!(concluded(), before + 1, "decided by the one tail");
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("backup")
    );
    answer(&host, &mut req);
    assert_eq!(
        host.resp_header("x-sluice-provider").as_deref(),
        Some("acme")
    );
    assert_eq!(host.resp_header("x-sluice-cache"), None, "nothing to store");
    assert_eq!(stores(&host), 0);
    kill_switch(&host, 2, false);
    assert!(
        !cached(&poller, &host, 2, "a", "who answers?"),
        "the fallback's answer"
    );
    assert_eq!(host.req_header("x-sluice-upstream"), None, "the primary's");
    assert_eq!(stores(&host), 1);
    assert!(
        cached(&poller, &host, 3, "a", "who answers?"),
        "the primary's answer"
    );
}

/// Queued behind a slow call, it misses the cache and waits; the kill
/// switch is pulled meanwhile. When its turn comes the same tail routes it
/// again (to the fallback) and drops what it meant to store, as for a
/// request decided at once: the fallback's answer is not the primary's.
#[test]
fn a_queued_request_the_kill_switch_sends_to_the_fallback_stores_nothing() {
    let host = MockHost::new(T0);
    let mut poller = load(&host);
    kill_switch(&host, 1, false);
    let (mut slow, action) = ask(&poller, &host, 1, "a", "something else");
    assert_eq!(action, Action::Continue, "holds m's slot");
    let before = concluded();
    let (mut queued, action) = ask(&poller, &host, 2, "b", "who answers?");
    assert_eq!(action, Action::Pause, "queued");
    assert_eq!(concluded(), before + 1);
    kill_switch(&host, 2, true);
    answer(&host, &mut slow);
    assert_eq!(stores(&host), 1, "the primary's answer to a");
    poller.on_wake(&host);
    assert_eq!(*host.resumed.borrow(), vec![2]);
    assert_eq!(concluded(), before + 2, "its dispatch ran the same tail");
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("backup")
    );
    assert_eq!(
        host.metric(
            "sluice_queue_total_outcome=rerouted;.reason=fallback;.model=m;.class=standard;"
        ),
        Some(1)
    );
    answer(&host, &mut queued);
    assert_eq!(
        host.resp_header("x-sluice-provider").as_deref(),
        Some("acme")
    );
    assert_eq!(host.resp_header("x-sluice-cache"), None, "nothing to store");
    assert_eq!(stores(&host), 1, "the fallback's answer is not stored");
    kill_switch(&host, 3, false);
    assert!(
        !cached(&poller, &host, 3, "b", "who answers?"),
        "the fallback's answer"
    );
    assert_eq!(stores(&host), 2, "the primary's answer is");
    assert!(cached(&poller, &host, 4, "b", "who answers?"));
    assert!(cached(&poller, &host, 5, "a", "something else"));
}
