//! The gate through the mock host: two workers sharing shared data and
//! wake-up queues, as Envoy's do.

use serde_json::{json, Value};

use super::super::{Poller, Request, Vm};
use crate::host::mock::MockHost;
use crate::host::Action;

const T0: u64 = 1_700_000_000_000;

fn policy() -> Value {
    json!({
        "default_tier": "free",
        "identity": {"sources": ["trusted_header"],
                     "trusted_header": {"principal": "x-user", "tier": "x-tier", "class": "x-class"}},
        "tiers": {"free": {"class": "standard"}, "pro": {"class": "interactive"}},
        "classes": {"interactive": {"queue": false},
                    "standard": {"max_wait": "5s", "max_depth": 2}},
        "models": {"m": {"concurrency": 1}},
    })
}

fn load(host: &MockHost, policy: &Value) -> Poller {
    let mut poller = Poller::new();
    assert!(poller.configure(host, policy.to_string().as_bytes()));
    poller
}

/// A chat request on context `ctx` with `extra` headers (also used by the
/// fleet-slot tests).
pub(in crate::flow) fn post(
    poller: &Poller,
    host: &MockHost,
    ctx: u32,
    extra: &[(&str, &str)],
) -> (Request, Action) {
    let body = json!({"model": "m", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let len = body.len().to_string();
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-type", "application/json"),
        ("content-length", len.as_str()),
    ];
    headers.extend_from_slice(extra);
    host.begin(&headers, body.as_bytes());
    let mut req = poller.request_for(ctx).unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    let action = req.on_request_body(host, body.len(), true);
    (req, action)
}

/// Answers `req` 200 with usage and ends it.
pub(in crate::flow) fn finish(host: &MockHost, req: &mut Request) {
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    req.on_response_headers(host);
    let body = "{\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}";
    *host.response_body.borrow_mut() = body.as_bytes().to_vec();
    req.on_response_body(host, body.len(), true);
    req.on_log(host);
}

fn inflight(host: &MockHost) -> i64 {
    host.metric("sluice_inflight_model=m;").unwrap_or(-1)
}
fn depth(host: &MockHost) -> i64 {
    host.metric("sluice_queue_depth_model=m;.class=standard;")
        .unwrap_or(-1)
}

#[test]
fn a_freed_slot_wakes_the_waiter_on_another_worker() {
    let w1 = MockHost::new(T0);
    let w2 = MockHost::worker_of(&w1);
    let p = policy();
    let p1 = load(&w1, &p);
    let mut p2 = load(&w2, &p);
    let (mut a, action) = post(&p1, &w1, 1, &[("x-user", "a")]);
    assert_eq!(action, Action::Continue);
    let (mut b, action) = post(&p2, &w2, 2, &[("x-user", "b")]);
    assert_eq!(action, Action::Pause, "queued");
    assert!(w2.replies.borrow().is_empty());
    assert_eq!((inflight(&w2), depth(&w2)), (1, 1));
    w1.advance(40);
    w2.advance(40);
    finish(&w1, &mut a);
    // The grant went to worker 2's queue; its root resumes the stream.
    assert!(w2.resumed.borrow().is_empty());
    p2.on_wake(&w2);
    assert_eq!(*w2.resumed.borrow(), vec![2]);
    assert_eq!(w2.effective_context.get(), Some(2));
    finish(&w2, &mut b);
    assert_eq!(w2.resp_header("x-sluice-queued-ms").as_deref(), Some("40"));
    assert_eq!((inflight(&w2), depth(&w2)), (0, 0));
    assert_eq!(
        w2.metric("sluice_queue_total_outcome=dispatched;.reason=queued;.model=m;.class=standard;"),
        Some(1)
    );
}

#[test]
fn interactive_is_refused_at_once_and_a_full_queue_says_so() {
    let w = MockHost::new(T0);
    let p = load(&w, &policy());
    let (_a, action) = post(&p, &w, 1, &[("x-user", "a")]);
    assert_eq!(action, Action::Continue);
    let (_b, action) = post(&p, &w, 2, &[("x-user", "b"), ("x-tier", "pro")]);
    assert_eq!(action, Action::Pause);
    let reply = w.last_reply().unwrap();
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header("x-sluice-reason"), Some("model_concurrency"));
    assert_eq!(reply.header("retry-after"), Some("1"));
    let (_c, _) = post(&p, &w, 3, &[("x-user", "c")]);
    let (_d, _) = post(&p, &w, 4, &[("x-user", "d")]);
    assert!(w.replies.borrow().is_empty(), "two wait (max_depth 2)");
    let (_e, _) = post(&p, &w, 5, &[("x-user", "e")]);
    assert_eq!(
        w.last_reply().unwrap().header("x-sluice-reason"),
        Some("queue_full")
    );
    // A trusted class header moves a free caller to interactive.
    let (_f, _) = post(&p, &w, 6, &[("x-user", "f"), ("x-class", "interactive")]);
    assert_eq!(
        w.last_reply().unwrap().header("x-sluice-reason"),
        Some("model_concurrency")
    );
}

#[test]
fn the_deadline_answers_queue_deadline_and_the_client_may_only_shorten_it() {
    let w = MockHost::new(T0);
    let mut p = load(&w, &policy());
    let (_a, _) = post(&p, &w, 1, &[("x-user", "a")]);
    let (mut b, _) = post(
        &p,
        &w,
        2,
        &[("x-user", "b"), ("x-sluice-max-wait-ms", "300")],
    );
    let (mut c, _) = post(
        &p,
        &w,
        3,
        &[("x-user", "c"), ("x-sluice-max-wait-ms", "99999999")],
    );
    w.advance(299);
    p.tick(&w);
    assert!(w.context_replies.borrow().is_empty());
    w.advance(20);
    p.tick(&w);
    let replies = w.context_replies.borrow().clone();
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].0, 2);
    assert_eq!(replies[0].1.status, 429);
    assert_eq!(
        replies[0].1.header("x-sluice-reason"),
        Some("queue_deadline")
    );
    assert!(replies[0].1.header("retry-after").is_some());
    b.on_log(&w);
    // c asked for more than its class allows: 5 s, not 27 h.
    w.advance(5_000 - 319);
    p.tick(&w);
    assert_eq!(w.context_replies.borrow().len(), 2);
    c.on_log(&w);
    assert_eq!((inflight(&w), depth(&w)), (1, 0));
    // A bad value is a 400 naming the header.
    let (_d, _) = post(
        &p,
        &w,
        4,
        &[("x-user", "d"), ("x-sluice-max-wait-ms", "soon")],
    );
    let reply = w.last_reply().unwrap();
    assert_eq!(reply.status, 400);
    assert!(String::from_utf8_lossy(&reply.body).contains("x-sluice-max-wait-ms"));
}

#[test]
fn a_client_that_leaves_while_queued_or_granted_leaks_nothing() {
    let w = MockHost::new(T0);
    let mut p = load(&w, &policy());
    let (mut a, _) = post(&p, &w, 1, &[("x-user", "a")]);
    let (mut b, _) = post(&p, &w, 2, &[("x-user", "b")]);
    let (mut c, _) = post(&p, &w, 3, &[("x-user", "c")]);
    assert_eq!(depth(&w), 2);
    // b leaves while queued.
    b.on_log(&w);
    assert_eq!(depth(&w), 1);
    // a ends: c is granted; c leaves before its wake-up is handled.
    finish(&w, &mut a);
    assert_eq!((inflight(&w), depth(&w)), (1, 0));
    c.on_log(&w);
    p.on_wake(&w);
    assert!(w.resumed.borrow().is_empty());
    assert_eq!((inflight(&w), depth(&w)), (0, 0));
    assert_eq!(
        w.metric(
            "sluice_queue_total_outcome=abandoned;.reason=client_gone;.model=m;.class=standard;"
        ),
        Some(2)
    );
}

#[test]
fn a_lost_wake_up_is_found_by_the_tick() {
    let w = MockHost::new(T0);
    let mut p = load(&w, &policy());
    let (mut a, _) = post(&p, &w, 1, &[("x-user", "a")]);
    let (_b, _) = post(&p, &w, 2, &[("x-user", "b")]);
    finish(&w, &mut a);
    w.wake_queues
        .lock()
        .unwrap()
        .messages
        .values_mut()
        .for_each(|q| q.clear());
    p.tick(&w);
    assert_eq!(*w.resumed.borrow(), vec![2]);
}

/// Workers write the same gauge; one may record an older state after
/// another recorded the newer one. The tick puts it right: each tick while
/// the worker has waiters, every second when it has none.
#[test]
fn a_stale_queue_gauge_is_put_right_by_the_tick() {
    let w = MockHost::new(T0);
    let mut p = load(&w, &policy());
    let (mut a, _) = post(&p, &w, 1, &[("x-user", "a")]);
    let (mut b, _) = post(&p, &w, 2, &[("x-user", "b")]);
    assert_eq!(depth(&w), 1);
    let stale = |n: u64| crate::host::metrics::QUEUE_DEPTH.record_at(&w, &["m", "standard"], n);
    stale(2);
    p.tick(&w);
    assert_eq!(depth(&w), 1, "a tick with a waiter publishes");
    finish(&w, &mut a);
    p.on_wake(&w);
    finish(&w, &mut b);
    assert_eq!(depth(&w), 0);
    stale(1);
    for _ in 1..super::IDLE_PUBLISH_TICKS {
        p.tick(&w);
    }
    assert_eq!(depth(&w), 1, "idle ticks publish only now and then");
    p.tick(&w);
    assert_eq!(depth(&w), 0, "then the queue's state is published");
}

#[test]
fn provider_limits_hold_the_queue_until_the_reset() {
    let w = MockHost::new(T0);
    let mut p = load(&w, &policy());
    let (mut a, _) = post(&p, &w, 1, &[("x-user", "a")]);
    w.respond(&[
        (":status", "200"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "2s"),
    ]);
    w.set_prop(&["response", "code_details"], b"via_upstream");
    a.on_response_headers(&w);
    a.on_log(&w);
    assert_eq!(inflight(&w), 0);
    let (_b, action) = post(&p, &w, 2, &[("x-user", "b")]);
    assert_eq!(action, Action::Pause);
    assert!(w.replies.borrow().is_empty(), "waits for the reset");
    w.advance(1_980);
    p.tick(&w);
    p.on_wake(&w);
    assert!(w.resumed.borrow().is_empty());
    w.advance(20);
    p.tick(&w);
    p.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![2]);
    // Interactive is told at once.
    let (_c, _) = post(&p, &w, 3, &[("x-user", "c"), ("x-tier", "pro")]);
    assert!(w.last_reply().is_some());
}

/// The sidecar says the backend is saturated: batch waits (slots free or
/// not), interactive is refused 503; saturation clears and the queue drains.
#[test]
fn saturation_holds_batch_and_refuses_interactive() {
    let w = MockHost::new(T0);
    let mut p = policy();
    p["sidecar"] = json!({"cluster": "sidecar"});
    p["models"]["m"]["concurrency"] = json!(4);
    let mut poller = load(&w, &p);
    let state = |breakers: Value| {
        let s = json!({"version": 2, "breakers": breakers});
        let bytes =
            crate::admission::route::encode_seen(w.clock_ms.get(), s.to_string().as_bytes());
        crate::state::store::SharedStore::set(&w, super::super::SIDECAR_KEY, &bytes, 0).unwrap();
    };
    state(json!([{"scope": "backend:local", "state": "saturated"}]));
    let (_a, action) = post(&poller, &w, 1, &[("x-user", "a")]);
    assert_eq!(action, Action::Pause);
    assert!(w.replies.borrow().is_empty(), "batch waits");
    let (_b, _) = post(&poller, &w, 2, &[("x-user", "b"), ("x-tier", "pro")]);
    let reply = w.last_reply().unwrap();
    assert_eq!(
        (reply.status, reply.header("x-sluice-reason")),
        (503, Some("gpu_overloaded"))
    );
    w.advance(20);
    poller.tick(&w);
    poller.on_wake(&w);
    assert!(w.resumed.borrow().is_empty());
    state(json!([]));
    w.advance(20);
    poller.tick(&w);
    poller.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![1]);
}

/// The upstream paused the route (503 with Retry-After): a standard caller
/// waits out the pause in the queue, an interactive one gets the 503.
#[test]
fn an_upstream_pause_is_waited_out_by_classes_that_wait() {
    let w = MockHost::new(T0);
    let mut p = policy();
    p["protection"] = json!({"pause_jitter": "0s"});
    let mut poller = load(&w, &p);
    let (mut a, _) = post(&poller, &w, 1, &[("x-user", "a")]);
    w.respond(&[(":status", "503"), ("retry-after", "2")]);
    w.set_prop(&["response", "code_details"], b"via_upstream");
    a.on_response_headers(&w);
    a.on_log(&w);
    let (_b, action) = post(&poller, &w, 2, &[("x-user", "b")]);
    assert_eq!(action, Action::Pause);
    assert!(w.replies.borrow().is_empty(), "waits out the pause");
    let (_c, _) = post(&poller, &w, 3, &[("x-user", "c"), ("x-tier", "pro")]);
    let reply = w.last_reply().unwrap();
    assert_eq!(
        (reply.status, reply.header("x-sluice-reason")),
        (503, Some("upstream_paused"))
    );
    w.advance(1_900);
    poller.tick(&w);
    poller.on_wake(&w);
    assert!(w.resumed.borrow().is_empty());
    w.advance(200);
    poller.tick(&w);
    poller.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![2]);
}

/// A request bucket that frees within the class's wait: the request
/// sleeps (holding no slot) and tries again instead of a 429.
#[test]
fn a_bucket_that_frees_soon_is_waited_for() {
    let w = MockHost::new(T0);
    let mut p = policy();
    p["tiers"]["free"]["requests"] = json!("1/s");
    p["tiers"]["pro"]["requests"] = json!("1/s");
    let mut poller = load(&w, &p);
    let (mut a, action) = post(&poller, &w, 1, &[("x-user", "a")]);
    assert_eq!(action, Action::Continue);
    finish(&w, &mut a);
    let (mut b, action) = post(&poller, &w, 2, &[("x-user", "a")]);
    assert_eq!(action, Action::Pause);
    assert!(w.replies.borrow().is_empty(), "sleeps instead of a 429");
    assert_eq!(inflight(&w), 0, "holds no slot while asleep");
    w.advance(500);
    poller.tick(&w);
    assert!(w.resumed.borrow().is_empty());
    w.advance(500);
    poller.tick(&w);
    assert_eq!(*w.resumed.borrow(), vec![2]);
    assert_eq!(inflight(&w), 1);
    finish(&w, &mut b);
    assert_eq!(w.resp_header("x-sluice-queued-ms").as_deref(), Some("1000"));
    assert_eq!(inflight(&w), 0);
    // Interactive callers get the 429 at once.
    let (_c, _) = post(&poller, &w, 3, &[("x-user", "p"), ("x-tier", "pro")]);
    let (_d, _) = post(&poller, &w, 4, &[("x-user", "p"), ("x-tier", "pro")]);
    assert_eq!(w.last_reply().unwrap().status, 429);
    // A sleeper whose client leaves is forgotten.
    let (_e, _) = post(&poller, &w, 5, &[("x-user", "a")]);
    let (mut f, action) = post(&poller, &w, 6, &[("x-user", "a")]);
    assert_eq!(action, Action::Pause);
    f.on_log(&w);
    w.advance(2_000);
    poller.tick(&w);
    assert!(!w.resumed.borrow().contains(&6));
}

/// sluice's own `x-ratelimit-*-tokens` (a caller's budget, added to the
/// response) never pause the model for everyone: only the upstream's count.
#[test]
fn sluices_own_rate_limit_headers_pause_nothing() {
    let w = MockHost::new(T0);
    let mut poller = load(&w, &policy());
    let (mut a, _) = post(&poller, &w, 1, &[("x-user", "a")]);
    let mut admitted = a.stream.borrow_mut();
    let Some(up) = admitted.upstream() else {
        panic!("admitted")
    };
    up.response_headers.extend([
        ("x-ratelimit-remaining-tokens".to_string(), "0".to_string()),
        ("x-ratelimit-reset-tokens".to_string(), "3600".to_string()),
    ]);
    drop(admitted);
    w.respond(&[(":status", "200")]);
    w.set_prop(&["response", "code_details"], b"via_upstream");
    a.on_response_headers(&w);
    assert_eq!(
        w.resp_header("x-ratelimit-remaining-tokens").as_deref(),
        Some("0")
    );
    a.on_log(&w);
    let (_b, action) = post(&poller, &w, 2, &[("x-user", "b")]);
    assert_eq!(action, Action::Continue, "not paused");
    poller.tick(&w);
}

fn reason(host: &MockHost) -> Option<(u32, String)> {
    let r = host.last_reply()?;
    Some((r.status, r.header("x-sluice-reason")?.to_string()))
}

/// A caller its buckets would refuse at dispatch is refused before it
/// takes a place (or sleeps, holding none, when they free within its
/// wait); one with places queued needs room for all of them.
#[test]
fn a_caller_its_buckets_refuse_takes_no_place() {
    let w = MockHost::new(T0);
    let mut p = policy();
    p["classes"]["standard"]["max_depth"] = json!(5);
    p["tiers"]["free"]["requests"] = json!("3/min");
    let mut poller = load(&w, &p);
    let (mut a1, action) = post(&poller, &w, 1, &[("x-user", "a")]);
    assert_eq!(action, Action::Continue);
    // 2 left: a2 queues (needs 1), a3 queues (needs 2: a2's and its own).
    let (_a2, action) = post(&poller, &w, 2, &[("x-user", "a")]);
    assert_eq!(action, Action::Pause);
    let (_a3, action) = post(&poller, &w, 3, &[("x-user", "a")]);
    assert_eq!(action, Action::Pause);
    assert_eq!(depth(&w), 2);
    assert!(w.replies.borrow().is_empty());
    // a4 would need 3: refused at once (the next unit frees in 20 s,
    // past its 5 s wait), holding nothing.
    let (_a4, _) = post(&poller, &w, 4, &[("x-user", "a")]);
    assert_eq!(reason(&w), Some((429, "user_rate_limit".into())));
    assert_eq!(w.last_reply().unwrap().header("retry-after"), Some("20"));
    assert_eq!(depth(&w), 2);
    // Another caller is not affected.
    let (_b, action) = post(&poller, &w, 5, &[("x-user", "b")]);
    assert_eq!(action, Action::Pause);
    assert_eq!(depth(&w), 3);
    finish(&w, &mut a1);
    poller.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![2]);

    // A bucket that frees within the wait: it sleeps without a place.
    let w = MockHost::new(T0);
    let mut p = policy();
    p["tiers"]["free"]["requests"] = json!("1/s");
    let mut poller = load(&w, &p);
    let (_c1, action) = post(&poller, &w, 1, &[("x-user", "c")]);
    assert_eq!(action, Action::Continue);
    let (_c2, action) = post(&poller, &w, 2, &[("x-user", "c")]);
    assert_eq!(action, Action::Pause, "c's second sleeps");
    assert!(w.replies.borrow().is_empty());
    assert_eq!(depth(&w), 0, "the sleeper holds no place");
    // Another caller queues meanwhile; one queued request of a 1/s
    // bucket's caller does not keep the next from queueing.
    let (_d1, action) = post(&poller, &w, 3, &[("x-user", "d")]);
    assert_eq!(action, Action::Pause);
    let (_d2, action) = post(&poller, &w, 4, &[("x-user", "d")]);
    assert_eq!(action, Action::Pause);
    assert_eq!(depth(&w), 2);
    w.advance(1_000);
    poller.tick(&w);
    // Awake, c2 finds the queue full of d's (2 ≥ 0 + 2): it takes d's
    // newest place, and d2 is answered in the same tick.
    assert_eq!(reason(&w), Some((429, "queue_full".into())));
    assert_eq!(w.replies.borrow().len(), 1);
    assert_eq!(w.effective_context.get(), Some(4));
    let state = crate::state::store::SharedStore::get(&w, "sluice:v1:queue:local")
        .unwrap()
        .0;
    let state = crate::queue::State::decode(&state).unwrap();
    assert_eq!(state.entries.len(), 2, "d1 and c2: {state:?}");
    assert!(state.entries.iter().all(|e| !e.evicted));
}

/// The largest holder's newest entry leaves for a newcomer when the queue
/// is full; its worker answers it 429 `queue_full` and nothing leaks.
#[test]
fn a_full_queue_makes_room_for_a_newcomer() {
    let w = MockHost::new(T0);
    let mut poller = load(&w, &policy());
    let (mut a1, _) = post(&poller, &w, 1, &[("x-user", "a")]);
    let (_a2, _) = post(&poller, &w, 2, &[("x-user", "a")]);
    let (_a3, _) = post(&poller, &w, 3, &[("x-user", "a")]);
    assert_eq!(depth(&w), 2);
    assert!(w.replies.borrow().is_empty());
    let (_b, action) = post(&poller, &w, 4, &[("x-user", "b")]);
    assert_eq!(action, Action::Pause, "b finds a place");
    assert!(w.replies.borrow().is_empty());
    assert_eq!(depth(&w), 2);
    // a3 (a's newest) is answered on the next tick.
    w.advance(20);
    poller.tick(&w);
    assert_eq!(reason(&w), Some((429, "queue_full".into())));
    assert_eq!(w.effective_context.get(), Some(3));
    assert_eq!(
        w.metric("sluice_queue_total_outcome=evicted;.reason=queue_full;.model=m;.class=standard;"),
        Some(1)
    );
    // b now has a place as good as a's: a third of a's is refused.
    let (_a4, _) = post(&poller, &w, 5, &[("x-user", "a")]);
    assert_eq!(reason(&w), Some((429, "queue_full".into())));
    // Fair order: a2, then b; nothing left behind.
    finish(&w, &mut a1);
    poller.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![2]);
    let state = crate::state::store::SharedStore::get(&w, "sluice:v1:queue:local")
        .unwrap()
        .0;
    let state = crate::queue::State::decode(&state).unwrap();
    assert_eq!(state.entries.len(), 1, "only b waits: {state:?}");
}

fn kill_switch_policy() -> Value {
    let mut p = policy();
    p["classes"]["standard"]["max_depth"] = json!(5);
    p["sidecar"] = json!({"cluster": "sidecar", "stale_after": "10s"});
    p["fallback"] = json!({"header": "x-sluice-upstream", "value": "backup", "provider": "acme"});
    p
}

fn kill_switch(w: &MockHost, version: u64, active: bool) {
    let s = json!({"version": version, "kill_switch": {"active": active}, "breakers": []});
    let bytes = crate::admission::route::encode_seen(w.clock_ms.get(), s.to_string().as_bytes());
    crate::state::store::SharedStore::set(w, super::super::SIDECAR_KEY, &bytes, 0).unwrap();
}

/// Pulled while requests wait: a granted one is routed again at dispatch
/// (to the fallback, giving its slot to the next), and the others leave
/// the queue on the next tick for the fallback too; none reaches the
/// primary, and no slot is left counted.
#[test]
fn the_kill_switch_reaches_queued_requests() {
    let w = MockHost::new(T0);
    let mut poller = load(&w, &kill_switch_policy());
    kill_switch(&w, 1, false);
    let (mut a, action) = post(&poller, &w, 1, &[("x-user", "a")]);
    assert_eq!(action, Action::Continue);
    assert_eq!(w.req_header("x-sluice-upstream"), None);
    let (_b, _) = post(&poller, &w, 2, &[("x-user", "b")]);
    let (_c, _) = post(&poller, &w, 3, &[("x-user", "c")]);
    assert_eq!(depth(&w), 2);
    kill_switch(&w, 2, true);
    // a's end grants b before any tick: b is routed again at dispatch,
    // and gives its slot to c, whose dispatch routes it the same way.
    finish(&w, &mut a);
    poller.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![2, 3]);
    assert_eq!(w.req_header("x-sluice-upstream").as_deref(), Some("backup"));
    assert_eq!((inflight(&w), depth(&w)), (0, 0));
    assert_eq!(
        w.metric("sluice_queue_total_outcome=rerouted;.reason=fallback;.model=m;.class=standard;"),
        Some(2)
    );

    // Pulled while nothing frees: the tick takes the waiters out.
    let w = MockHost::new(T0);
    let mut poller = load(&w, &kill_switch_policy());
    kill_switch(&w, 1, false);
    let (_a, _) = post(&poller, &w, 1, &[("x-user", "a")]);
    let (_b, _) = post(&poller, &w, 2, &[("x-user", "b")]);
    w.advance(20);
    poller.tick(&w);
    assert!(w.resumed.borrow().is_empty(), "switch off: b waits");
    kill_switch(&w, 2, true);
    w.advance(20);
    poller.tick(&w);
    assert_eq!(*w.resumed.borrow(), vec![2]);
    assert_eq!(w.req_header("x-sluice-upstream").as_deref(), Some("backup"));
    assert_eq!((inflight(&w), depth(&w)), (1, 0), "a still holds its slot");
}

/// A reload makes a new root context in the same VM: the waiters of the
/// old one are handed over, the new limit governs them at once (raised:
/// the backlog drains at the new limit) and the slots of requests in
/// flight are given back to the new gates (lowered: nothing new goes
/// until in flight is under the new limit). Nothing is counted twice.
#[test]
fn a_reload_in_a_new_root_governs_waiting_and_in_flight_requests() {
    let w = MockHost::new(T0);
    let vm = std::rc::Rc::new(Vm::default());
    let mut p = policy();
    p["classes"]["standard"]["max_depth"] = json!(10);
    let load_in = |concurrency: u32| {
        w.advance(1);
        let mut p = p.clone();
        p["models"]["m"]["concurrency"] = json!(concurrency);
        let mut poller = Poller::in_vm(vm.clone());
        assert!(poller.configure(&w, p.to_string().as_bytes()));
        poller
    };
    let mut old = load_in(1);
    let mut reqs = Vec::new();
    for ctx in 1..=5 {
        let (req, _) = post(&old, &w, ctx, &[("x-user", &format!("u{ctx}"))]);
        reqs.push(req);
    }
    assert_eq!((inflight(&w), depth(&w)), (1, 4));
    // Raised 1 → 3: two waiters go at once, woken through the old root's
    // wake-up queue (where their grants were sent).
    let mut new = load_in(3);
    old.on_wake(&w);
    new.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![2, 3]);
    assert_eq!((inflight(&w), depth(&w)), (3, 2));
    // Lowered 3 → 1 (a third root): requests 1-3 are in flight. Ends of
    // requests of the older roots give their slots to the newest gates.
    let mut newest = load_in(1);
    for req in reqs.iter_mut().take(2) {
        finish(&w, req);
    }
    old.on_wake(&w);
    new.on_wake(&w);
    newest.on_wake(&w);
    w.advance(20);
    for root in [&mut old, &mut new, &mut newest] {
        root.tick(&w);
    }
    assert_eq!(*w.resumed.borrow(), vec![2, 3], "1 in flight: nothing new");
    assert_eq!((inflight(&w), depth(&w)), (1, 2));
    finish(&w, &mut reqs[2]);
    old.on_wake(&w);
    new.on_wake(&w);
    newest.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![2, 3, 4]);
    assert_eq!((inflight(&w), depth(&w)), (1, 1));
    // The last waiter's deadline is kept by the newest root.
    w.advance(6_000);
    newest.tick(&w);
    assert_eq!(reason(&w), Some((429, "queue_deadline".into())));
    finish(&w, &mut reqs[3]);
    assert_eq!((inflight(&w), depth(&w)), (0, 0));
}

/// A root context that Envoy discards after loading its policy (the rest
/// of the listener update failed) takes no waiter with it: the queued
/// streams are the VM's, and the older root tends them again.
#[test]
fn a_discarded_reload_loses_no_waiter() {
    let w = MockHost::new(T0);
    let vm = std::rc::Rc::new(Vm::default());
    let load_in = || {
        w.advance(1);
        let mut poller = Poller::in_vm(vm.clone());
        assert!(poller.configure(&w, policy().to_string().as_bytes()));
        poller
    };
    let mut old = load_in();
    let (_a, _) = post(&old, &w, 1, &[("x-user", "a")]);
    let (_b, action) = post(&old, &w, 2, &[("x-user", "b")]);
    assert_eq!(action, Action::Pause);
    drop(load_in());
    w.advance(6_000);
    old.tick(&w);
    assert_eq!(reason(&w), Some((429, "queue_deadline".into())));
    assert_eq!(depth(&w), 0);
}

/// The upstream pauses the route just as a queued request's slot comes:
/// routed again at dispatch, it waits the pause out in the queue instead
/// of going to the paused upstream.
#[test]
fn a_pause_that_starts_while_queued_is_waited_out() {
    let w = MockHost::new(T0);
    let mut p = policy();
    p["protection"] = json!({"pause_jitter": "0s"});
    let mut poller = load(&w, &p);
    let (mut a, _) = post(&poller, &w, 1, &[("x-user", "a")]);
    let (_b, action) = post(&poller, &w, 2, &[("x-user", "b")]);
    assert_eq!(action, Action::Pause);
    w.respond(&[(":status", "503"), ("retry-after", "2")]);
    w.set_prop(&["response", "code_details"], b"via_upstream");
    a.on_response_headers(&w);
    a.on_log(&w);
    poller.on_wake(&w);
    assert!(w.resumed.borrow().is_empty(), "not sent into the pause");
    assert!(w.replies.borrow().is_empty(), "waits, as it may");
    assert_eq!((inflight(&w), depth(&w)), (0, 1));
    w.advance(2_100);
    poller.tick(&w);
    poller.on_wake(&w);
    assert_eq!(*w.resumed.borrow(), vec![2]);
    assert_eq!(inflight(&w), 1);
}

/// Issue 29 item 15's finding: a waiting request keeps its parsed body in
/// the worker's wasm memory, which never shrinks; a burst of large queued
/// bodies crashed a VM. The bytes a VM holds for waiting requests are
/// bounded; past the bound a request that would wait is refused
/// `queue_full`, and a dispatched or departed one gives its bytes back.
#[test]
fn a_vm_holds_at_most_its_bound_of_waiting_bodies() {
    let w = MockHost::new(T0);
    let mut p = policy();
    p["classes"]["standard"]["max_depth"] = json!(10);
    // Two chat bodies of `post` (79 bytes each) fit, a third does not.
    p["request"] = json!({"max_waiting_body_bytes": 200});
    let poller = load(&w, &p);
    let (mut a, action) = post(&poller, &w, 1, &[("x-user", "a")]);
    assert_eq!(action, Action::Continue, "a slot: holds nothing after");
    let (mut b, _) = post(&poller, &w, 2, &[("x-user", "b")]);
    let (_c, _) = post(&poller, &w, 3, &[("x-user", "c")]);
    assert!(w.replies.borrow().is_empty(), "two wait");
    let (_d, _) = post(&poller, &w, 4, &[("x-user", "d")]);
    let reply = w.last_reply().unwrap();
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header("x-sluice-reason"), Some("queue_full"));
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(depth(&w), 2, "the refused one took no place");
    // a finishes, b is dispatched: its bytes are given back.
    finish(&w, &mut a);
    let mut poller = poller;
    poller.on_wake(&w);
    w.replies.borrow_mut().clear();
    let (_e, _) = post(&poller, &w, 5, &[("x-user", "e")]);
    assert!(w.replies.borrow().is_empty(), "room again: e waits");
    finish(&w, &mut b);
}
