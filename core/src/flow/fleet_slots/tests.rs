//! Fleet-wide slots through the mock host: the sidecar's answers are
//! written by hand.

use serde_json::{json, Value};

use super::super::{Poller, Request};
use crate::host::mock::MockHost;
use crate::host::Action;
use crate::queue::State;

const T0: u64 = 1_700_000_000_000;

fn policy(fleet: Value) -> Value {
    json!({
        "default_tier": "free",
        "identity": {"sources": ["trusted_header"],
                     "trusted_header": {"principal": "x-user", "tier": "x-tier"}},
        "tiers": {"free": {"class": "batch"}, "pro": {"class": "interactive"}},
        "classes": {"interactive": {"queue": false},
                    "batch": {"max_wait": "5s"}},
        "models": {"m": {"concurrency": 2, "backend": "b"}},
        "sidecar": {"cluster": "sc"},
        "fleet": with_salt(fleet),
    })
}

/// `fleet.salt` is required: the tests' own unless they give one.
fn with_salt(mut fleet: Value) -> Value {
    if let Some(f) = fleet.as_object_mut() {
        f.entry("salt")
            .or_insert(serde_json::json!("slots-unit-test-salt"));
    }
    fleet
}

fn load(host: &MockHost, policy: &Value) -> Poller {
    let mut poller = Poller::new();
    assert!(
        poller.configure(host, policy.to_string().as_bytes()),
        "{:?}",
        host.logs.borrow()
    );
    poller
}

use super::super::waiting::tests::finish;

fn post(poller: &Poller, host: &MockHost, ctx: u32, tier: &str) -> (Request, Action) {
    super::super::waiting::tests::post(poller, host, ctx, &[("x-user", "u"), ("x-tier", tier)])
}

fn state(host: &MockHost) -> State {
    let (bytes, _) = crate::state::store::SharedStore::get(host, "sluice:v1:queue:b").unwrap();
    State::decode(&bytes).unwrap()
}

fn leased(host: &MockHost) -> u32 {
    state(host)
        .models
        .iter()
        .find(|m| m.name == "m")
        .map_or(0, |m| m.leased)
}

/// The reports sent so far to `/v1/fleet/slots`: (token, body).
fn reports(host: &MockHost) -> Vec<(u32, Value)> {
    let paths: Vec<u32> = host
        .callouts
        .borrow()
        .iter()
        .filter(|c| {
            c.headers
                .iter()
                .any(|(n, v)| n == ":path" && v == super::PATH)
        })
        .map(|c| c.token)
        .collect();
    host.posted
        .borrow()
        .iter()
        .filter(|(t, _)| paths.contains(t))
        .map(|(t, b)| (*t, serde_json::from_slice(b).unwrap()))
        .collect()
}

fn answer(poller: &mut Poller, host: &MockHost, token: u32, status: &str, body: Value) {
    let bytes = body.to_string().into_bytes();
    let len = bytes.len();
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), status.into())];
    *host.call_response_body.borrow_mut() = bytes;
    poller.on_call_response(host, token, len);
}

/// Ticks until this VM is the poller (it holds the poller lease).
fn become_poller(poller: &mut Poller, host: &MockHost) {
    poller.tick(host);
    host.advance(20);
    poller.tick(host);
}

#[test]
fn slots_are_leased_from_the_fleet_before_use_and_given_back_when_idle() {
    let host = MockHost::new(T0);
    let mut poller = load(&host, &policy(json!({"expected_replicas": 2})));
    become_poller(&mut poller, &host);
    assert!(
        reports(&host).is_empty(),
        "idle: nothing held, nothing reported"
    );
    // No slot held here yet: batch waits, interactive is refused at once.
    let (_pro, action) = post(&poller, &host, 1, "pro");
    assert_eq!(action, Action::Pause);
    assert_eq!(host.last_reply().unwrap().status, 429);
    let (mut a, action) = post(&poller, &host, 2, "free");
    assert_eq!(action, Action::Pause, "queued: no lease");
    let (mut b, _) = post(&poller, &host, 3, "free");
    let (mut c, _) = post(&poller, &host, 4, "free");
    host.advance(20);
    poller.tick(&host);
    let sent = reports(&host);
    assert_eq!(sent.len(), 1);
    let (token, report) = &sent[0];
    assert_eq!(
        report["scopes"],
        json!([{"id": "concurrency/b/m", "hold": 2}]),
        "demand 3, capped at the limit"
    );
    // Another Envoy holds one: this one is granted the other.
    answer(&mut poller, &host, *token, "200", json!({"grants": [1]}));
    assert_eq!(leased(&host), 1);
    poller.on_wake(&host);
    assert_eq!(host.resumed.borrow().as_slice(), &[2], "one waiter goes");
    assert_eq!(state(&host).inflight("m"), 1);
    // The next report asks again; the other Envoy has given its slot back.
    host.advance(20);
    poller.tick(&host);
    let (token, report) = reports(&host).pop().unwrap();
    assert_eq!(report["scopes"][0]["hold"], 2);
    answer(&mut poller, &host, token, "200", json!({"grants": [2]}));
    poller.on_wake(&host);
    assert_eq!(host.resumed.borrow().as_slice(), &[2, 3]);
    assert_eq!(state(&host).inflight("m"), 2, "never more than the lease");
    finish(&host, &mut a);
    poller.on_wake(&host);
    assert_eq!(
        host.resumed.borrow().as_slice(),
        &[2, 3, 4],
        "the freed slot goes to the waiter"
    );
    finish(&host, &mut b);
    // A freed slot nobody here waits for is lowered at once, then reported.
    host.advance(20);
    poller.tick(&host);
    assert_eq!(leased(&host), 1, "lowered before the report");
    let (token, report) = reports(&host).pop().unwrap();
    assert_eq!(report["scopes"][0]["hold"], 1);
    answer(&mut poller, &host, token, "200", json!({"grants": [1]}));
    finish(&host, &mut c);
    host.advance(20);
    poller.tick(&host);
    assert_eq!(leased(&host), 0);
    let (token, report) = reports(&host).pop().unwrap();
    assert_eq!(report["scopes"][0]["hold"], 0);
    answer(&mut poller, &host, token, "200", json!({"grants": [0]}));
    // Idle, nothing held: no more reports.
    let n = reports(&host).len();
    host.advance(5_000);
    poller.tick(&host);
    assert_eq!(reports(&host).len(), n);
}

#[test]
fn a_report_goes_out_every_beat_while_slots_are_held() {
    let host = MockHost::new(T0);
    let mut poller = load(&host, &policy(json!({})));
    become_poller(&mut poller, &host);
    let (_a, _) = post(&poller, &host, 1, "free");
    host.advance(20);
    poller.tick(&host);
    let (token, _) = reports(&host).pop().unwrap();
    answer(&mut poller, &host, token, "200", json!({"grants": [1]}));
    let n = reports(&host).len();
    host.advance(500);
    poller.tick(&host);
    assert_eq!(reports(&host).len(), n, "nothing moved, beat not due");
    host.advance(600);
    poller.tick(&host);
    let (_, report) = reports(&host).pop().unwrap();
    assert_eq!(
        report["scopes"][0]["hold"], 1,
        "the beat renews the holding"
    );
}

#[test]
fn sidecar_away_the_gate_follows_on_unavailable() {
    for (mode, replicas, expect) in [
        ("local_share", 2, 1),
        ("fail_open", 2, 2),
        ("fail_closed", 2, 0),
    ] {
        let host = MockHost::new(T0);
        let fleet = json!({"expected_replicas": replicas,
                           "on_unavailable": {"requests": mode}});
        let mut poller = load(&host, &policy(fleet));
        become_poller(&mut poller, &host);
        let mut reqs = Vec::new();
        for ctx in 1..=3 {
            reqs.push(post(&poller, &host, ctx, "free").0);
        }
        host.advance(20);
        poller.tick(&host);
        let (token, _) = reports(&host).pop().unwrap();
        answer(
            &mut poller,
            &host,
            token,
            "503",
            json!({"error": {"code": "fleet_unavailable"}}),
        );
        assert_eq!(leased(&host), expect, "{mode}");
        poller.on_wake(&host);
        assert_eq!(host.resumed.borrow().len(), expect as usize, "{mode}");
        // Interactive: refused, the stand-in's slots are all in use.
        let (_p, _) = post(&poller, &host, 9, "pro");
        assert_eq!(host.last_reply().map(|r| r.status), Some(429), "{mode}");
        // Back: the grant replaces the stand-in.
        host.advance(600);
        poller.tick(&host);
        let (token, report) = reports(&host).pop().unwrap();
        assert_eq!(report["scopes"][0]["hold"], 2, "{mode}");
        answer(&mut poller, &host, token, "200", json!({"grants": [2]}));
        assert_eq!(leased(&host), 2, "{mode}");
    }
}

#[test]
fn fleet_local_keeps_the_slots_per_envoy() {
    let host = MockHost::new(T0);
    let mut poller = load(&host, &policy(json!({"local": ["concurrency/b"]})));
    become_poller(&mut poller, &host);
    let (_a, action) = post(&poller, &host, 1, "free");
    assert_eq!(action, Action::Continue, "a local gate needs no lease");
    host.advance(20);
    poller.tick(&host);
    assert!(reports(&host).is_empty());
}

#[test]
fn fleet_local_names_a_gated_backend() {
    let p = policy(json!({"local": ["concurrency/nope"]}));
    let mut poller = Poller::new();
    let host = MockHost::new(T0);
    assert!(!poller.configure(&host, p.to_string().as_bytes()));
}

#[test]
fn a_backend_limit_and_a_model_limit_are_both_leased() {
    let host = MockHost::new(T0);
    let mut p = policy(json!({}));
    p["backends"] = json!({"b": {"concurrency": 3}});
    let mut poller = load(&host, &p);
    become_poller(&mut poller, &host);
    let mut held = Vec::new();
    for ctx in 1..=3 {
        let (r, action) = post(&poller, &host, ctx, "free");
        assert_eq!(action, Action::Pause);
        held.push(r);
    }
    host.advance(20);
    poller.tick(&host);
    let (token, report) = reports(&host).pop().unwrap();
    assert_eq!(
        report["scopes"],
        json!([{"id": "concurrency/b", "hold": 3},
               {"id": "concurrency/b/m", "hold": 2}])
    );
    // The backend's slots are scarcer: only one goes.
    answer(&mut poller, &host, token, "200", json!({"grants": [1, 2]}));
    poller.on_wake(&host);
    assert_eq!(host.resumed.borrow().len(), 1);
    assert_eq!((state(&host).leased, leased(&host)), (1, 2));
    // A malformed answer counts as the sidecar away (local_share, 1 replica).
    host.advance(20);
    poller.tick(&host);
    let (token, _) = reports(&host).pop().unwrap();
    answer(&mut poller, &host, token, "200", json!({"grants": [3]}));
    assert_eq!((state(&host).leased, leased(&host)), (3, 2));
    assert_eq!(host.metric("sluice_fleet_slots_degraded"), Some(1));
}
