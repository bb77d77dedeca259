//! The lease logic natively, through the whole request path on the mock
//! host; the sidecar's answers are written by hand.

use serde_json::{json, Value};

use super::*;
use crate::flow::{Poller, Request};
use crate::host::mock::MockHost;
use crate::host::Action;
use crate::state::store::SharedStore;

const T0: u64 = 1_700_000_000_000;

/// The salt of the test policies (required by `fleet`).
const SALT: &str = "fleet-unit-test-salt";

fn policy(tiers: Value, mut fleet: Value) -> Value {
    if let Some(f) = fleet.as_object_mut() {
        f.entry("salt").or_insert(json!(SALT));
    }
    json!({
        "default_tier": "t",
        "identity": {"sources": ["client_address"]},
        "tiers": {"t": tiers},
        "sidecar": {"cluster": "sc"},
        "fleet": fleet,
    })
}

fn load(host: &MockHost, policy: Value) -> Poller {
    let mut poller = Poller::new();
    assert!(
        poller.configure(host, policy.to_string().as_bytes()),
        "{:?}",
        host.logs.borrow()
    );
    poller
}

fn post(poller: &Poller, host: &MockHost, addr: &str, max_tokens: u64) -> (Request, Action) {
    let body = json!({"model": "m", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello"}]})
    .to_string();
    let len = body.len().to_string();
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
        ],
        body.as_bytes(),
    );
    host.set_prop(&["source", "address"], addr.as_bytes());
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    let action = req.on_request_body(host, body.len(), true);
    (req, action)
}

/// The last POST the filter sent, as JSON.
fn last_post(host: &MockHost) -> (u32, Value) {
    let posted = host.posted.borrow();
    let (token, body) = posted.last().expect("a POST to the sidecar");
    (*token, serde_json::from_slice(body).unwrap())
}

/// The sidecar answers callout `token` with `status` and `body`.
fn sidecar_says(host: &MockHost, req: &mut Request, token: u32, status: &str, body: Value) {
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), status.into())];
    let bytes = body.to_string().into_bytes();
    let len = bytes.len();
    *host.call_response_body.borrow_mut() = bytes;
    req.on_call_response(host, token, len);
}

fn lease(host: &MockHost, key: &str) -> FleetLease {
    FleetLease::decode(&host.get(key).unwrap().0)
}

fn lease_of_requests(host: &MockHost) -> FleetLease {
    // One caller: its lease is in one of its probed slots.
    (0..64)
        .map(|s| lease(host, &lease_table("tier/t/requests", 64).key(s)))
        .find(|l| l.owner != 0)
        .unwrap_or_default()
}

fn outbox(host: &MockHost) -> Vec<GiveItem> {
    serde_json::from_slice(&host.get(OUTBOX_KEY).unwrap().0).unwrap_or_default()
}

/// `host` answered one 429 for `reason`, and nothing went upstream.
fn refused_by(host: &MockHost, reason: &str) {
    let replies = host.replies.borrow();
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].status, 429);
    assert_eq!(replies[0].header("x-sluice-reason"), Some(reason));
    assert!(host.resumed.borrow().is_empty(), "never goes upstream");
}

#[test]
fn a_lease_is_taken_once_then_debited_locally_across_workers() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        policy(
            json!({"requests": "100/day"}),
            json!({"expected_replicas": 2}),
        ),
    );
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Pause, "waits for the sidecar");
    let (token, body) = last_post(&host);
    let claim = &body["claims"][0];
    assert_eq!(claim["need"], 1);
    assert_eq!(claim["want"], 5, "1 + initial 4");
    // The bucket by name and the caller by hash: the sidecar finds the
    // limit, the replicas and the key name in its own copy of the policy.
    assert_eq!(claim["rule"], "tier/t/requests");
    assert!(
        claim["owner"].as_u64().unwrap() >= 2,
        "a hash, never the caller"
    );
    assert!(body.get("replicas").is_none());
    assert!(claim.get("capacity").is_none());
    assert!(body["id"].as_str().is_some_and(|id| !id.is_empty()));
    assert_eq!(body["deadline_ms"], T0 + 1_000, "now + fleet.timeout");
    assert!(!body.to_string().contains("10.0.0.1"));
    let sent = host.callouts.borrow().last().unwrap().headers.clone();
    let header = |name: &str| sent.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    assert_eq!(
        header(SECRET_HEADER).as_deref(),
        Some(crate::host::mock::MOCK_FLEET_SECRET)
    );
    assert_eq!(header(FINGERPRINT_HEADER).map(|f| f.len()), Some(32));
    sidecar_says(
        &host,
        &mut req,
        token,
        "200",
        json!({"ok": true, "grants": [5], "left": [95]}),
    );
    assert_eq!(host.resumed.borrow().len(), 1);
    assert!(host.replies.borrow().is_empty());
    assert_eq!(lease_of_requests(&host).balance, 4);
    // Another worker (same shared data) serves the next 4 from the lease,
    // with no call.
    let worker = MockHost::sharing(host.store.clone(), T0 + 10);
    let calls = host.posted.borrow().len();
    for _ in 0..4 {
        let (_, action) = post(&poller, &worker, "10.0.0.1:1", 4);
        assert_eq!(action, Action::Continue);
    }
    assert!(worker.posted.borrow().is_empty());
    assert_eq!(host.posted.borrow().len(), calls);
    assert_eq!(lease_of_requests(&host).balance, 0);
    // Empty: the next one asks again, for a doubled lease.
    let (_, action) = post(&poller, &worker, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Pause);
    let (_, body) = last_post(&worker);
    assert_eq!(body["claims"][0]["want"], 11, "1 + 2 x the last grant");
}

#[test]
fn a_fleet_refusal_is_the_buckets_429_and_gives_back_what_was_taken() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        policy(
            json!({"requests": "100/day", "daily_tokens": 1000}),
            json!({}),
        ),
    );
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let (token, body) = last_post(&host);
    assert_eq!(
        body["claims"].as_array().unwrap().len(),
        2,
        "both buckets in one call"
    );
    sidecar_says(
        &host,
        &mut req,
        token,
        "200",
        json!({"ok": false, "refused": 1, "left": [3]}),
    );
    refused_by(&host, "daily_budget_exceeded");
}

/// Two of one caller's requests wait for the fleet at once; the first's
/// grant leaves a surplus in the caller's lease before the second's take
/// comes back refused (Redis has nothing left: this Envoy holds it).
fn a_burst_of_two(tiers: Value, second: Value) -> (MockHost, MockHost) {
    let host = MockHost::new(T0);
    let poller = load(&host, policy(tiers, json!({"expected_replicas": 2})));
    let (mut first, action) = post(&poller, &host, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Pause);
    let (first_token, asked) = last_post(&host);
    // The requests bucket granted 5 (1 + a top-up of 4); any other bucket
    // exactly its need.
    let grants: Vec<Value> = asked["claims"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| if i == 0 { json!(5) } else { c["need"].clone() })
        .collect();
    let worker = MockHost::sharing(host.store.clone(), T0 + 5);
    let (mut other, action) = post(&poller, &worker, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Pause, "no lease yet: it asks too");
    let (other_token, _) = last_post(&worker);
    sidecar_says(
        &host,
        &mut first,
        first_token,
        "200",
        json!({"ok": true, "grants": grants, "left": [0]}),
    );
    assert_eq!(host.resumed.borrow().len(), 1);
    assert_eq!(lease_of_requests(&host).balance, 4, "the first's surplus");
    sidecar_says(&worker, &mut other, other_token, "200", second);
    (host, worker)
}

#[test]
fn a_take_refused_while_this_envoys_lease_filled_is_covered_from_the_lease() {
    let (host, worker) = a_burst_of_two(
        json!({"requests": "5/day"}),
        json!({"ok": false, "refused": 0, "left": [0]}),
    );
    assert!(worker.replies.borrow().is_empty(), "not refused");
    assert_eq!(worker.resumed.borrow().len(), 1, "goes upstream");
    assert_eq!(lease_of_requests(&host).balance, 3);
    assert_eq!(worker.metric("sluice_fleet_refused_total"), None);
}

#[test]
fn a_refused_take_the_lease_covers_only_in_part_is_refused_and_gives_it_back() {
    // Two buckets: the requests lease has a surplus, the token budget's
    // has none (its grant was exact), so the request is refused whole and
    // the requests lease keeps every unit.
    let (host, worker) = a_burst_of_two(
        json!({"requests": "5/day", "daily_tokens": 1000}),
        json!({"ok": false, "refused": 1, "left": [0]}),
    );
    refused_by(&worker, "daily_budget_exceeded");
    assert_eq!(lease_of_requests(&host).balance, 4, "nothing lost");
}

#[test]
fn settlement_goes_to_the_lease_then_unused_leases_go_back_in_batches_applied_once() {
    let host = MockHost::new(T0);
    let mut poller = load(
        &host,
        policy(
            json!({"daily_tokens": 100000}),
            json!({"lease": {"idle": "1s"}}),
        ),
    );
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 98);
    let (token, body) = last_post(&host);
    let need = body["claims"][0]["need"].as_u64().unwrap();
    assert!(need > 98, "the input estimate + 98 output: {need}");
    sidecar_says(
        &host,
        &mut req,
        token,
        "200",
        json!({"ok": true, "grants": [500], "left": [99500]}),
    );
    let key = (0..64)
        .map(|s| lease_table("tier/t/daily_tokens", 64).key(s))
        .find(|k| lease(&host, k).owner != 0)
        .unwrap();
    assert_eq!(lease(&host, &key).balance, 500 - need as i64);
    // The upstream used 2 + 10: the rest comes back to the lease.
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    assert_eq!(req.on_response_headers(&host), Action::Continue);
    let answer = json!({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 10, "total_tokens": 12}}).to_string();
    *host.response_body.borrow_mut() = answer.as_bytes().to_vec();
    req.on_response_body(&host, answer.len(), true);
    req.on_log(&host);
    assert_eq!(lease(&host, &key).balance, 488);
    // Idle: the poller VM gives the lease back in a batch with an id.
    host.clock_ms.set(T0 + 5_000);
    poller.tick(&host);
    assert_eq!(lease(&host, &key).owner, 0, "freed");
    let (token, batch) = last_post(&host);
    assert_eq!(batch["items"][0]["delta"], 488);
    let id = batch["id"].as_str().unwrap().to_string();
    // Its answer lost: sent again with the same id (the sidecar applies
    // an id once).
    *host.call_response_headers.borrow_mut() = vec![];
    *host.call_response_body.borrow_mut() = vec![];
    poller.on_call_response(&host, token, 0);
    host.clock_ms.set(T0 + 6_000);
    poller.tick(&host);
    let (token, again) = last_post(&host);
    assert_eq!(again["id"], id.as_str());
    assert_eq!(again["items"], batch["items"]);
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), "200".into())];
    poller.on_call_response(&host, token, 0);
    host.clock_ms.set(T0 + 7_000);
    let before = host.posted.borrow().len();
    poller.tick(&host);
    assert_eq!(host.posted.borrow().len(), before, "nothing left to send");
    assert!(outbox(&host).is_empty());
}

fn outage(mode: &str) -> (MockHost, Poller) {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        policy(
            json!({"requests": "10/day"}),
            json!({"expected_replicas": 2, "on_unavailable": {"requests": mode}}),
        ),
    );
    (host, poller)
}

/// One request while the sidecar's cluster fails every call.
fn during_outage(host: &MockHost, poller: &Poller) -> Option<u32> {
    let (mut req, action) = post(poller, host, "10.0.0.1:1", 4);
    if action == Action::Pause && host.replies.borrow().is_empty() {
        let (token, _) = last_post(host);
        *host.call_response_headers.borrow_mut() = vec![(":status".into(), "503".into())];
        *host.call_response_body.borrow_mut() =
            br#"{"error":{"code":"fleet_unavailable"}}"#.to_vec();
        req.on_call_response(host, token, 38);
    }
    host.replies.borrow_mut().pop().map(|r| r.status)
}

#[test]
fn unavailable_fail_closed_refuses_fail_open_admits_and_both_are_logged_once() {
    let (host, poller) = outage("fail_closed");
    for _ in 0..3 {
        assert_eq!(during_outage(&host, &poller), Some(429));
    }
    let said = host
        .logs
        .borrow()
        .iter()
        .filter(|(_, m)| m.contains("does not answer"))
        .count();
    assert_eq!(said, 1, "logged once");
    assert_eq!(
        host.metrics.borrow()[crate::host::metrics::FLEET_UNAVAILABLE.name].1,
        1
    );

    let (host, poller) = outage("fail_open");
    for _ in 0..3 {
        assert_eq!(during_outage(&host, &poller), None, "admitted");
    }
    let charged: i64 = outbox(&host).iter().map(|i| i.delta).sum();
    assert_eq!(charged, -3, "charged to Redis when it answers again");
}

#[test]
fn unavailable_local_share_is_the_limit_over_the_replicas_exactly() {
    let (host, poller) = outage("local_share");
    let admitted = (0..8)
        .filter(|_| during_outage(&host, &poller).is_none())
        .count();
    assert_eq!(admitted, 5, "10/day over 2 replicas");
}

#[test]
fn the_fleet_section_is_checked_with_field_paths() {
    let bad = [
        (json!({"expected_replicas": 0}), "fleet.expected_replicas"),
        (json!({"local": ["tier/nope/requests"]}), "fleet.local[0]"),
        (json!({"lease": {"slots": 0}}), "fleet.lease.slots"),
        (
            json!({"on_unavailable": {"requests": "maybe"}}),
            "fleet.on_unavailable.requests",
        ),
        (json!({"surprise": 1}), "fleet"),
    ];
    for (fleet, path) in bad {
        let p = policy(json!({"requests": "10/min"}), fleet.clone());
        let err = crate::policy::Policy::from_value(p)
            .and_then(crate::admission::Engine::compile)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains(path), "{fleet}: {err}");
    }
    let mut no_sidecar = policy(json!({"requests": "10/min"}), json!({}));
    no_sidecar.as_object_mut().unwrap().remove("sidecar");
    let err = crate::policy::Policy::from_value(no_sidecar)
        .unwrap_err()
        .to_string();
    assert!(err.contains("fleet"), "{err}");
    let ok = policy(
        json!({"requests": "10/min"}),
        json!({"local": ["tier/t/requests"]}),
    );
    assert!(crate::policy::Policy::from_value(ok).is_ok());
}

#[test]
fn a_local_bucket_never_calls_the_sidecar() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        policy(
            json!({"requests": "10/day"}),
            json!({"local": ["tier/t/requests"]}),
        ),
    );
    let (_, action) = post(&poller, &host, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Continue);
    assert!(host.posted.borrow().is_empty());
}

#[test]
fn lease_max_zero_makes_every_take_exact() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        policy(json!({"requests": "100/day"}), json!({"lease": {"max": 0}})),
    );
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let (token, body) = last_post(&host);
    assert_eq!(body["claims"][0]["want"], 1);
    sidecar_says(
        &host,
        &mut req,
        token,
        "200",
        json!({"ok": true, "grants": [1], "left": [99]}),
    );
    let (_, action) = post(&poller, &host, "10.0.0.1:1", 4);
    assert_eq!(
        action,
        Action::Pause,
        "nothing held: the next one asks again"
    );
}

#[test]
fn a_lease_in_use_is_topped_up_ahead_of_need_in_the_background() {
    let host = MockHost::new(T0);
    let mut poller = load(&host, policy(json!({"requests": "1000/day"}), json!({})));
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let (token, _) = last_post(&host);
    sidecar_says(
        &host,
        &mut req,
        token,
        "200",
        json!({"ok": true, "grants": [9], "left": [991]}),
    );
    assert_eq!(lease_of_requests(&host).balance, 8);
    for _ in 0..7 {
        assert_eq!(post(&poller, &host, "10.0.0.1:1", 4).1, Action::Continue);
    }
    assert_eq!(
        lease_of_requests(&host).balance,
        1,
        "under a quarter of the grant"
    );
    host.clock_ms.set(T0 + 300);
    poller.tick(&host);
    let (token, body) = last_post(&host);
    assert_eq!(body["claims"][0]["need"], 0, "nobody waits for it");
    assert_eq!(body["claims"][0]["want"], 9);
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), "200".into())];
    let answer = json!({"ok": true, "grants": [9], "left": [982]}).to_string();
    *host.call_response_body.borrow_mut() = answer.clone().into_bytes();
    poller.on_call_response(&host, token, answer.len());
    assert_eq!(lease_of_requests(&host).balance, 10);
    let calls = host.posted.borrow().len();
    assert_eq!(post(&poller, &host, "10.0.0.1:1", 4).1, Action::Continue);
    assert_eq!(
        host.posted.borrow().len(),
        calls,
        "served from the topped-up lease"
    );
}

#[test]
fn a_request_without_a_body_is_counted_fleet_wide_too() {
    let host = MockHost::new(T0);
    let poller = load(&host, policy(json!({"requests": "100/day"}), json!({})));
    host.begin(&[(":method", "GET"), (":path", "/v1/models")], b"");
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, true), Action::Pause);
    let (token, body) = last_post(&host);
    assert_eq!(body["claims"][0]["need"], 1);
    sidecar_says(
        &host,
        &mut req,
        token,
        "200",
        json!({"ok": false, "refused": 0, "left": [0]}),
    );
    refused_by(&host, "user_rate_limit");
}

#[test]
fn a_soft_cap_is_taken_past_its_limit_and_never_refused_when_the_fleet_is_away() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        policy(
            json!({"daily_tokens": {"limit": 1000, "mode": "soft"}}),
            json!({"on_unavailable": {"budgets": "fail_closed"}}),
        ),
    );
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let (token, body) = last_post(&host);
    assert_eq!(body["claims"][0]["rule"], "tier/t/daily_tokens");
    // The fleet is away: fail_closed does not apply to a soft cap.
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), "503".into())];
    *host.call_response_body.borrow_mut() = vec![];
    req.on_call_response(&host, token, 0);
    assert!(host.replies.borrow().is_empty());
    assert_eq!(host.resumed.borrow().len(), 1);
}

#[test]
fn an_abandoned_take_is_undone_by_its_id_but_a_refusal_before_redis_is_not() {
    // The answer never came (timeout): the take may still run in Redis.
    let (host, poller) = outage("local_share");
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let (token, take) = last_post(&host);
    *host.call_response_headers.borrow_mut() = vec![];
    *host.call_response_body.borrow_mut() = vec![];
    req.on_call_response(&host, token, 0);
    let cancels: Vec<GiveItem> = outbox(&host)
        .into_iter()
        .filter(|i| i.take.is_some())
        .collect();
    assert_eq!(cancels.len(), 1, "{:?}", outbox(&host));
    assert_eq!(cancels[0].take.as_deref(), take["id"].as_str());
    assert_eq!(cancels[0].rule, "tier/t/requests");
    assert_eq!(cancels[0].delta, 0, "Redis knows what it granted");

    // Refused before Redis was asked (mismatch): nothing to undo, and the
    // gauge says why the Envoy is on on_unavailable.
    let (host, poller) = outage("local_share");
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let (token, _) = last_post(&host);
    let body = br#"{"error":{"code":"fleet_mismatch","message":"salt"}}"#;
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), "503".into())];
    *host.call_response_body.borrow_mut() = body.to_vec();
    req.on_call_response(&host, token, body.len());
    assert!(host.replies.borrow().is_empty(), "local_share admits");
    assert!(outbox(&host).iter().all(|i| i.take.is_none()));
    assert_eq!(
        host.metrics.borrow()[crate::host::metrics::FLEET_MISMATCH.name].1,
        1
    );
    assert_eq!(
        host.metrics.borrow()[crate::host::metrics::FLEET_DATA_LOST.name].1,
        0
    );
    assert!(
        host.logs
            .borrow()
            .iter()
            .any(|(_, m)| m.contains("fleet_mismatch")),
        "the switch says why: {:?}",
        host.logs.borrow()
    );
}

#[test]
fn the_salt_and_the_secret_are_required() {
    // Too short a salt is refused by the policy check (check-config too).
    for salt in ["", "short"] {
        let p = policy(json!({"requests": "10/min"}), json!({"salt": salt}));
        let err = crate::policy::Policy::from_value(p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("fleet.salt"), "{err}");
    }
    // No secret in the VM's environment: the policy does not load.
    let host = MockHost::new(T0);
    host.env.borrow_mut().insert(
        crate::policy::fleet::DEFAULT_SECRET_ENV.into(),
        "too-short".into(),
    );
    let mut poller = Poller::new();
    let p = policy(json!({"requests": "10/min"}), json!({}));
    assert!(!poller.configure(&host, p.to_string().as_bytes()));
    assert!(
        host.logs
            .borrow()
            .iter()
            .any(|(_, m)| m.contains("fleet.secret_env")
                && m.contains(crate::policy::fleet::DEFAULT_SECRET_ENV)),
        "{:?}",
        host.logs.borrow()
    );
    // Another variable named by the policy.
    let host = MockHost::new(T0);
    host.env
        .borrow_mut()
        .insert("MY_FLEET_SECRET".into(), "another-secret-0123456789".into());
    let p = policy(
        json!({"requests": "10/min"}),
        json!({"secret_env": "MY_FLEET_SECRET"}),
    );
    let poller = load(&host, p);
    let (_req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let sent = host.callouts.borrow().last().unwrap().headers.clone();
    assert!(sent
        .iter()
        .any(|(k, v)| k == SECRET_HEADER && v == "another-secret-0123456789"));
}

#[test]
fn a_full_outbox_keeps_charges_before_cancels() {
    // A loaded policy made the outbox key; the fleet is driven directly.
    let (host, _poller) = outage("local_share");
    let engine = Engine::new(
        crate::policy::Policy::from_value(policy(json!({"requests": "10/day"}), json!({})))
            .unwrap(),
    );
    let fleet = Fleet::new(&engine).unwrap();
    let cancels: Vec<GiveItem> = (0..OUTBOX_MAX as u64)
        .map(|i| cancel_item("tier/t/requests", 2 + i, 0, "t1-0"))
        .collect();
    fleet.outbox(&host, &engine, cancels);
    assert_eq!(outbox(&host).len(), OUTBOX_MAX);
    fleet.outbox(
        &host,
        &engine,
        vec![give_item("tier/t/requests", 9_999, 0, -3)],
    );
    let list = outbox(&host);
    assert_eq!(list.len(), OUTBOX_MAX);
    assert!(list.iter().any(|i| i.owner == 9_999 && i.delta == -3));
    let dropped = host
        .metrics
        .borrow()
        .get(crate::host::metrics::FLEET_OUTBOX_DROPPED.name)
        .map_or(0, |m| m.1);
    assert_eq!(dropped, 0, "the charge was kept");
}

/// Issue 19: the fleet's lookups by rule id are `get`s. A refusal for a
/// take that claimed nothing, or by a claim of a bucket the fleet does not
/// know, degrades (passes what is held / refuses with an empty quota)
/// instead of indexing out of bounds or panicking on a missing key.
#[test]
fn answers_about_unknown_claims_degrade_instead_of_panicking() {
    let (host, _poller) = outage("local_share");
    let engine = Engine::new(
        crate::policy::Policy::from_value(policy(json!({"requests": "10/day"}), json!({})))
            .unwrap(),
    );
    let fleet = Fleet::new(&engine).unwrap();
    let identity = Identity {
        principal: "ip:10.0.0.9".into(),
        hash: 99,
        tier: "t".into(),
        source: None,
        declared: false,
        team: None,
        org: None,
        run: None,
    };
    let refusal = |host: &MockHost| {
        let body = json!({"ok": false, "refused": 3, "left": [0]}).to_string();
        *host.call_response_headers.borrow_mut() = vec![(":status".into(), "200".into())];
        *host.call_response_body.borrow_mut() = body.clone().into_bytes();
        body.len()
    };
    let len = refusal(&host);
    let empty = Pending {
        token: 1,
        id: "t1-0".into(),
        done: Vec::new(),
        short: Vec::new(),
    };
    assert!(matches!(
        fleet.answer(&engine, &host, empty, len, &identity, T0),
        Gate::Pass(done) if done.is_empty()
    ));
    let unknown = Short {
        rule: "tier/nobody/requests".into(),
        owner: 99,
        amount: 1,
        window_end: 0,
        meter: Meter::Requests,
        slot: None,
        have: 0,
    };
    let len = refusal(&host);
    let pending = Pending {
        token: 2,
        id: "t1-1".into(),
        done: Vec::new(),
        short: vec![unknown.clone()],
    };
    match fleet.answer(&engine, &host, pending, len, &identity, T0) {
        Gate::Refuse { rule, quota } => {
            assert_eq!(rule, "tier/nobody/requests");
            assert_eq!((quota.limit, quota.reset_ms), (0, 1_000));
        }
        other => panic!("{other:?}"),
    }
    // Unavailable: a claim of an unknown bucket is left to the local one.
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), "503".into())];
    let pending = Pending {
        token: 3,
        id: "t1-2".into(),
        done: Vec::new(),
        short: vec![unknown],
    };
    assert!(matches!(
        fleet.answer(&engine, &host, pending, 0, &identity, T0),
        Gate::Pass(done) if done.is_empty()
    ));
}

/// Fleet mode with an exact cache for `m`.
fn cached_policy() -> Value {
    let mut p = policy(json!({"requests": "100/day"}), json!({}));
    p["cache"] = json!({"salt": "s", "models": {"m": {"exact": true}}});
    p
}

fn hit() -> Value {
    let stored = r#"{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;
    json!({"hit": {"kind": "exact", "age_s": 1, "entry": {"body": stored,
        "prompt_tokens": 5, "completion_tokens": 1, "spend_micros": 0}}})
}

#[test]
fn a_cache_hit_is_counted_fleet_wide_its_reply_kept_until_the_fleet_admits_it() {
    let host = MockHost::new(T0);
    let poller = load(&host, cached_policy());
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Pause, "paused for the lookup");
    let (lookup, _) = last_post(&host);
    sidecar_says(&host, &mut req, lookup, "200", hit());
    assert!(
        host.replies.borrow().is_empty(),
        "the hit waits for the fleet"
    );
    let (take, body) = last_post(&host);
    assert_ne!(take, lookup);
    assert_eq!(body["claims"][0]["rule"], "tier/t/requests");
    assert_eq!(body["claims"][0]["need"], 1);
    sidecar_says(
        &host,
        &mut req,
        take,
        "200",
        json!({"ok": true, "grants": [5], "left": [95]}),
    );
    let replies = host.replies.borrow();
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].status, 200);
    assert_eq!(replies[0].header("x-sluice-cache"), Some("hit"));
    assert_eq!(host.resumed.borrow().len(), 0, "never goes upstream");
    assert_eq!(lease_of_requests(&host).balance, 4, "the hit took one");
}

#[test]
fn a_cache_hit_refused_fleet_wide_is_the_buckets_429() {
    let host = MockHost::new(T0);
    let poller = load(&host, cached_policy());
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let (lookup, _) = last_post(&host);
    sidecar_says(&host, &mut req, lookup, "200", hit());
    let (take, _) = last_post(&host);
    sidecar_says(
        &host,
        &mut req,
        take,
        "200",
        json!({"ok": false, "refused": 0, "left": [0]}),
    );
    let replies = host.replies.borrow();
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].status, 429);
    assert_eq!(replies[0].header("x-sluice-cache"), None);
    assert_eq!(
        host.metric("sluice_cache_total_result=refused;.kind=exact;.model=other;"),
        Some(1)
    );
}

#[test]
fn a_cache_hit_charged_tokens_takes_and_settles_the_fleet_token_budget_too() {
    let host = MockHost::new(T0);
    let mut p = policy(
        json!({"requests": "100/day", "daily_tokens": 100000}),
        json!({}),
    );
    p["cache"] = json!({"salt": "s", "models": {"m": {"exact": true}},
        "hit_cost": {"tokens": true}});
    let poller = load(&host, p);
    let (mut req, _) = post(&poller, &host, "10.0.0.1:1", 4);
    let (lookup, _) = last_post(&host);
    sidecar_says(&host, &mut req, lookup, "200", hit());
    let (take, body) = last_post(&host);
    let claims = body["claims"].as_array().unwrap();
    assert_eq!(claims.len(), 2, "requests and tokens: {body}");
    let tokens = claims
        .iter()
        .find(|c| c["rule"] == "tier/t/daily_tokens")
        .unwrap();
    // Reserved as the request's estimate, as locally.
    let reserved = tokens["need"].as_u64().unwrap();
    assert!(reserved > 6, "{tokens}");
    let grants: Vec<u64> = claims
        .iter()
        .map(|c| {
            if c["rule"] == "tier/t/daily_tokens" {
                500
            } else {
                5
            }
        })
        .collect();
    sidecar_says(
        &host,
        &mut req,
        take,
        "200",
        json!({"ok": true, "grants": grants, "left": [95, 99500]}),
    );
    assert_eq!(host.last_reply().unwrap().status, 200);
    // Settled fleet-wide at the stored answer's 5 + 1 tokens: the rest of
    // the reservation is back in the lease.
    let key = (0..64)
        .map(|s| lease_table("tier/t/daily_tokens", 64).key(s))
        .find(|k| lease(&host, k).owner != 0)
        .unwrap();
    assert_eq!(lease(&host, &key).balance, 500 - 6);
}

/// A client that leaves while its request waits for the fleet's answer
/// gets back everything the request held: its local reservation (before,
/// nothing released it: it never reached the upstream phase, so the
/// caller's local buckets stayed charged) and the take, undone by its id.
#[test]
fn a_client_gone_while_waiting_for_the_fleet_leaves_nothing_held() {
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        policy(
            json!({"requests": "2/day", "daily_tokens": 100000}),
            json!({"local": ["tier/t/requests"], "lease": {"max": 0}}),
        ),
    );
    for _ in 0..3 {
        let (mut req, action) = post(&poller, &host, "10.0.0.1:1", 4);
        assert_eq!(action, Action::Pause, "waits for the fleet, not refused");
        let (_, body) = last_post(&host);
        let id = body["id"].as_str().unwrap().to_string();
        req.on_log(&host);
        assert!(
            outbox(&host)
                .iter()
                .any(|i| i.take.as_deref() == Some(id.as_str())),
            "the take {id} is undone by its id: {:?}",
            outbox(&host)
        );
    }
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0)
    );
}

/// `state.worker_leases` one level down the fleet: a worker debits a
/// sub-lease from the Envoy's fleet lease once, admits the next requests
/// from it with no call for the fleet lease, and gives back what it did
/// not use.
#[test]
fn a_worker_sub_leases_the_fleet_lease_and_gives_back_what_it_did_not_use() {
    let host = MockHost::new(T0);
    let mut p = policy(
        json!({"requests": "1000/day"}),
        json!({"expected_replicas": 1}),
    );
    p["state"] = json!({"worker_leases": {"enabled": true, "workers": 1,
                                          "max_permille": 500, "ttl": "1s"}});
    let mut poller = load(&host, p);
    let (mut req, action) = post(&poller, &host, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Pause);
    let (token, _) = last_post(&host);
    sidecar_says(
        &host,
        &mut req,
        token,
        "200",
        json!({"ok": true, "grants": [101], "left": [899]}),
    );
    assert_eq!(lease_of_requests(&host).balance, 100);
    // The next request takes 1 and a sub-lease of half of what is left
    // (1 worker: left ÷ 2).
    let (_, action) = post(&poller, &host, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Continue);
    assert_eq!(lease_of_requests(&host).balance, 50);
    // Ten more from the sub-lease: the Envoy's lease is not touched.
    host.take_calls();
    for _ in 0..10 {
        let (_, action) = post(&poller, &host, "10.0.0.1:1", 4);
        assert_eq!(action, Action::Continue);
    }
    let calls = host.take_calls();
    println!("fleet path, sub-leased, 10 requests: {calls:?}");
    assert_eq!(lease_of_requests(&host).balance, 50);
    assert_eq!(host.posted.borrow().len(), 1, "no call to the sidecar");
    // At its ttl the worker's tick gives back the 39 it did not use.
    host.advance(1_000);
    poller.tick(&host);
    assert_eq!(lease_of_requests(&host).balance, 89);
}

fn budget_policy(data_lost: Option<&str>) -> Value {
    let mut on = json!({});
    if let Some(mode) = data_lost {
        on["data_lost"] = json!(mode);
    }
    policy(
        json!({"requests": "1000/min", "daily_tokens": 5000}),
        json!({"expected_replicas": 2, "lease": {"max": 0}, "on_unavailable": on}),
    )
}

/// A request whose take the sidecar grants in full (`None`), or answers
/// 503 `fleet_data_lost`; its reply status (`None`: admitted) and the
/// claims it asked for (empty: nothing asked).
fn budget_request(
    host: &MockHost,
    poller: &Poller,
    max_tokens: u64,
    lost: bool,
) -> (Option<u32>, Vec<String>) {
    let posted = host.posted.borrow().len();
    let (mut req, action) = post(poller, host, "10.0.0.1:1", max_tokens);
    let mut asked = Vec::new();
    if action == Action::Pause && host.posted.borrow().len() > posted {
        let (token, take) = last_post(host);
        let claims = take["claims"].as_array().cloned().unwrap_or_default();
        asked = claims
            .iter()
            .map(|c| c["rule"].as_str().unwrap().to_string())
            .collect();
        if lost {
            let body = json!({"error": {"code": "fleet_data_lost", "message": "lost"}});
            sidecar_says(host, &mut req, token, "503", body);
        } else {
            let grants: Vec<Value> = claims.iter().map(|c| c["need"].clone()).collect();
            let left: Vec<Value> = claims.iter().map(|_| json!(1000)).collect();
            sidecar_says(
                host,
                &mut req,
                token,
                "200",
                json!({"ok": true, "grants": grants, "left": left}),
            );
        }
    }
    (host.replies.borrow_mut().pop().map(|r| r.status), asked)
}

#[test]
fn after_a_data_loss_a_hard_budget_is_refused_for_the_rest_of_its_window_by_default() {
    let host = MockHost::new(T0);
    let poller = load(&host, budget_policy(None));
    // 2,400 tokens admitted through the fleet.
    let (status, asked) = budget_request(&host, &poller, 2_400, false);
    assert_eq!(status, None);
    assert_eq!(asked.len(), 2, "{asked:?}");
    // The sidecar reports the loss: the budget's count is unknown.
    let (status, _) = budget_request(&host, &poller, 10, true);
    assert_eq!(status, Some(429));
    let gauge = || host.metrics.borrow()[crate::host::metrics::FLEET_DATA_LOST.name].1;
    assert_eq!(gauge(), 1);
    // Later requests are refused by the budget without asking for it,
    // while the rate is still asked of the fleet (it counts on in Redis).
    host.advance(5_000);
    let (status, asked) = budget_request(&host, &poller, 10, false);
    assert_eq!(status, Some(429));
    assert!(
        asked.is_empty(),
        "refused before anything is asked: {asked:?}"
    );
    // A good fleet call (a GET: the rate only) keeps the gauge up.
    host.begin(&[(":method", "GET"), (":path", "/v1/models")], b"");
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(&host, true), Action::Pause);
    let (token, take) = last_post(&host);
    assert_eq!(take["claims"][0]["rule"], "tier/t/requests");
    sidecar_says(
        &host,
        &mut req,
        token,
        "200",
        json!({"ok": true, "grants": [1], "left": [999]}),
    );
    let mut poller = poller;
    poller.tick(&host);
    assert_eq!(gauge(), 1, "held while the window lasts");
    let logged = host
        .logs
        .borrow()
        .iter()
        .filter(|(_, m)| m.contains("lost its data"))
        .count();
    assert_eq!(logged, 1, "logged once: {:?}", host.logs.borrow());
    // The next day counts in Redis again; the gauge drops.
    host.advance(86_400_000);
    poller.tick(&host);
    assert_eq!(gauge(), 0);
    let (status, asked) = budget_request(&host, &poller, 10, false);
    assert_eq!(status, None);
    assert_eq!(asked.len(), 2, "{asked:?}");
}

#[test]
fn local_share_after_a_data_loss_counts_what_this_envoy_admitted_in_the_window() {
    let host = MockHost::new(T0);
    let poller = load(&host, budget_policy(Some("local_share")));
    // 2,400 of this Envoy's 2,500 share used before the loss (the
    // input's bound, 62, with the output).
    assert_eq!(budget_request(&host, &poller, 2_338, false).0, None);
    // Under the share: admitted without the fleet.
    assert_eq!(budget_request(&host, &poller, 30, true).0, None);
    // Past it: refused, however fresh the loss (before: a new 2,500).
    let (status, asked) = budget_request(&host, &poller, 200, false);
    assert_eq!(status, Some(429));
    assert!(asked.is_empty(), "{asked:?}");
    // A plain outage of a budget on local_share counts the same way.
    let host = MockHost::new(T0);
    let poller = load(
        &host,
        policy(
            json!({"requests": "1000/min", "daily_tokens": 5000}),
            json!({"expected_replicas": 2, "lease": {"max": 0}}),
        ),
    );
    assert_eq!(budget_request(&host, &poller, 2_495, false).0, None);
    assert_eq!(
        during_outage(&host, &poller),
        Some(429),
        "over the share already"
    );
}

/// The upstream answers `status`; the stream ends and is logged.
fn upstream_says(host: &MockHost, req: &mut Request, status: &str) {
    host.respond(&[(":status", status)]);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    assert_eq!(req.on_response_headers(host), Action::Continue);
    *host.response_body.borrow_mut() = b"{}".to_vec();
    assert_eq!(req.on_response_body(host, 2, true), Action::Continue);
    req.on_log(host);
}

fn route_record(host: &MockHost) -> crate::admission::route::RouteHealth {
    crate::admission::route::read(host, "sluice:v1:upstream/m").0
}

#[test]
fn a_probe_held_by_a_request_the_fleet_refuses_or_its_client_leaves_goes_back_at_once() {
    let host = MockHost::new(T0);
    let mut p = policy(json!({"requests": "100/day"}), json!({}));
    p["models"] = json!({"m": {}});
    p["protection"] = json!({"failures_to_open": 2, "min_callers": 2, "cooldown": "1s",
                             "pause_jitter": "0s"});
    let poller = load(&host, p);
    let granted = json!({"ok": true, "grants": [10], "left": [90]});
    // Two callers' 5xx open the route's breaker (each first takes a lease).
    for addr in ["10.0.0.1:1", "10.0.0.2:1"] {
        let (mut req, action) = post(&poller, &host, addr, 4);
        assert_eq!(action, Action::Pause, "waits for the fleet");
        let (token, _) = last_post(&host);
        sidecar_says(&host, &mut req, token, "200", granted.clone());
        upstream_says(&host, &mut req, "500");
    }
    assert_eq!(
        host.metric(crate::host::metrics::ERROR_BREAKER_OPENED.name),
        Some(1)
    );
    host.advance(1_500);
    // Half-open. C claims the probe, then waits for the fleet, which
    // refuses it: the probe goes back with the 429, not when it expires.
    let (mut c, action) = post(&poller, &host, "10.0.0.3:1", 4);
    assert_eq!(action, Action::Pause);
    assert!(route_record(&host).probe_until_ms > T0, "C holds the probe");
    let (token, _) = last_post(&host);
    sidecar_says(
        &host,
        &mut c,
        token,
        "200",
        json!({"ok": false, "refused": 0, "left": [0]}),
    );
    assert_eq!(host.last_reply().unwrap().status, 429);
    assert_eq!(
        route_record(&host).probe_until_ms,
        0,
        "given back on the refusal"
    );
    // D claims it and its client leaves while the fleet is asked.
    let (mut d, action) = post(&poller, &host, "10.0.0.4:1", 4);
    assert_eq!(action, Action::Pause);
    assert!(route_record(&host).probe_until_ms > T0, "D holds the probe");
    d.on_log(&host);
    assert_eq!(
        route_record(&host).probe_until_ms,
        0,
        "given back when D left"
    );
    // A (its lease covers it, no call) probes at once; its 200 closes it.
    let calls = host.posted.borrow().len();
    let (mut a, action) = post(&poller, &host, "10.0.0.1:1", 4);
    assert_eq!(action, Action::Continue);
    assert_eq!(host.posted.borrow().len(), calls, "its lease covers it");
    upstream_says(&host, &mut a, "200");
    assert!(route_record(&host).is_blank(), "{:?}", route_record(&host));
}
