//! Run budgets and the loop guard, on the engine alone.

use std::borrow::Cow;

use serde_json::{json, Value};

use super::*;
use crate::state::store::MemStore;
use crate::usage::reconcile::Usage;

/// A caller by address, naming its run in `x-run` (or not).
struct Call(&'static str, Option<String>);

impl RequestView for Call {
    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        (name == "x-run").then(|| self.1.as_deref().map(Cow::Borrowed))?
    }
    fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
        None
    }
    fn client_address(&self) -> Option<String> {
        Some(self.0.into())
    }
}

fn engine(runs: Value, daily: u64) -> (Engine, MemStore) {
    let p = json!({
        "default_tier": "t",
        "identity": {"sources": ["client_address"]},
        "tiers": {"t": {"daily_tokens": daily}},
        "runs": runs,
        "loop_guard": {"max_repeats": 2, "window": "10s", "slots": 64},
    });
    let e = Engine::new(Policy::from_value(p).unwrap());
    let store = MemStore::default();
    e.prepare(&store).unwrap();
    (e, store)
}

fn runs() -> Value {
    json!({"id": {"header": "x-run"}, "ttl": "60s", "tokens": 1000, "max_per_caller": 3, "max_live": 8})
}

fn chat(max_tokens: u64) -> Value {
    json!({"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
}

/// Admits one request of `who` in `run` at `now_ms`, settled at once to
/// `used` output tokens; the reason of a refusal.
fn call(e: &Engine, store: &MemStore, who: &Call, now_ms: u64, used: u64) -> Result<(), String> {
    let mut id = e.identify(who).unwrap();
    let a = e
        .demand(&id, Api::OpenAiChat, chat(100).to_string().as_bytes())
        .unwrap()
        .unwrap();
    id.run = e.run_of(&id, who, Some(&a)).map_err(|v| reason(&v))?;
    let v = e.admit(
        store,
        &ctx(
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            now_ms,
        ),
    );
    let refused = reason(&v);
    match v.into_plan() {
        Some(plan) => {
            let usage = Found::Usage(Usage {
                input: 0,
                output: used,
            });
            e.settle(store, &plan, usage, 0, true, now_ms);
            Ok(())
        }
        None => Err(refused),
    }
}

fn reason(v: &Verdict) -> String {
    v.reply()
        .and_then(|r| r.header("x-sluice-reason").map(str::to_string))
        .unwrap_or_else(|| "admitted".into())
}

fn who(addr: &'static str, run: &str) -> Call {
    Call(addr, Some(run.to_string()))
}

#[test]
fn a_run_is_refused_at_its_budget_while_the_daily_one_has_room_and_a_new_run_starts_fresh() {
    let (e, store) = engine(runs(), 100_000);
    let a = who("1.1.1.1:1", "r1");
    // 400 a request settled: two fit in 1,000, the third's reservation
    // (its bound of input + 100 output) is lowered, then refused.
    let mut admitted = 0;
    while call(&e, &store, &a, 0, 400).is_ok() {
        admitted += 1;
        assert!(admitted < 10);
    }
    assert!((2..=3).contains(&admitted), "{admitted}");
    assert_eq!(
        call(&e, &store, &a, 0, 400),
        Err("run_budget_exceeded".into())
    );
    // Another run of the same caller starts with the whole run budget.
    assert_eq!(call(&e, &store, &who("1.1.1.1:1", "r2"), 0, 400), Ok(()));
    // Another caller naming the same run id has its own run.
    assert_eq!(call(&e, &store, &who("2.2.2.2:1", "r1"), 0, 400), Ok(()));
}

#[test]
fn the_daily_budget_still_binds_across_runs() {
    let (e, store) = engine(runs(), 1_500);
    let runs = ["a", "b", "c", "d", "e"];
    let outcomes: Vec<_> = runs
        .iter()
        .map(|r| call(&e, &store, &who("1.1.1.1:1", r), 0, 600))
        .collect();
    assert!(
        outcomes.contains(&Err("daily_budget_exceeded".into())),
        "{outcomes:?}"
    );
}

#[test]
fn a_run_unused_for_its_ttl_is_forgotten_and_one_in_use_is_not() {
    let (e, store) = engine(runs(), 1_000_000);
    let a = who("1.1.1.1:1", "r1");
    while call(&e, &store, &a, 0, 400).is_ok() {}
    // Still within the ttl of its last use: still spent.
    assert_eq!(
        call(&e, &store, &a, 59_000, 400),
        Err("run_budget_exceeded".into())
    );
    // A refusal is no use: 60 s after the last admitted request it is gone.
    assert_eq!(call(&e, &store, &a, 60_000, 400), Ok(()));
}

#[test]
fn a_flood_of_run_ids_hits_the_cap_and_never_evicts_a_live_run() {
    let (e, store) = engine(runs(), 1_000_000);
    let a = |r: String| Call("1.1.1.1:1", Some(r));
    assert_eq!(call(&e, &store, &a("keep".into()), 0, 900), Ok(()));
    let refused = (0..1000)
        .filter(|i| call(&e, &store, &a(format!("flood-{i}")), 1, 1) == Err("run_limit".into()))
        .count();
    // Three runs per caller: the kept one and two new ones.
    assert_eq!(refused, 998);
    // The live run kept its count: 900 of 1,000 spent.
    assert_eq!(
        call(&e, &store, &a("keep".into()), 2, 1),
        Err("run_budget_exceeded".into())
    );
    // Every other caller is bounded by the table (8 runs in all).
    let others = (0..100)
        .filter(|i| {
            let addr: &'static str = Box::leak(format!("10.0.0.{i}:1").into_boxed_str());
            call(&e, &store, &Call(addr, Some("x".into())), 3, 1).is_ok()
        })
        .count();
    assert!(others <= 5, "{others}");
    // Once unused for the ttl, slots are free again.
    assert_eq!(call(&e, &store, &a("late".into()), 61_000, 1), Ok(()));
}

#[test]
fn a_missing_or_bad_run_id_is_refused_naming_the_field() {
    let (e, store) = engine(runs(), 1_000_000);
    let refusal = |who: &Call| {
        let id = e.identify(who).unwrap();
        let a = e
            .demand(&id, Api::OpenAiChat, chat(10).to_string().as_bytes())
            .unwrap()
            .unwrap();
        let reply = e.run_of(&id, who, Some(&a)).unwrap_err().reply().unwrap();
        let body: Value = serde_json::from_slice(&reply.body).unwrap();
        (
            reply.status,
            body["error"]["param"].as_str().unwrap().to_string(),
        )
    };
    let expected = (400, "x-run".to_string());
    assert_eq!(refusal(&Call("1.1.1.1:1", None)), expected);
    assert_eq!(refusal(&who("1.1.1.1:1", &"x".repeat(129))), expected);
    assert_eq!(refusal(&who("1.1.1.1:1", "")), expected);
    assert_eq!(refusal(&who("1.1.1.1:1", "a\tb")), expected);
    let _ = store;
    // Optional: a request naming no run is counted against none.
    let mut optional = runs();
    optional["required"] = json!(false);
    let (e, store) = engine(optional, 1_000_000);
    for _ in 0..5 {
        assert_eq!(call(&e, &store, &Call("1.1.1.1:1", None), 0, 900), Ok(()));
    }
}

#[test]
fn a_run_named_in_the_body_must_be_a_string() {
    let r = json!({"id": {"body": "metadata.session_id"}, "ttl": "1m", "tokens": 1000});
    let (e, _) = engine(r, 1_000_000);
    let id = e.identify(&Call("1.1.1.1:1", None)).unwrap();
    let of = |body: Value| {
        let a = e
            .demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
            .unwrap()
            .unwrap();
        e.run_of(&id, &Call("1.1.1.1:1", None), Some(&a))
            .map_err(|v| v.reply().unwrap().status)
    };
    let mut body = chat(10);
    body["metadata"] = json!({"session_id": 7});
    assert_eq!(of(body.clone()), Err(400));
    body["metadata"] = json!({"session_id": "s-1"});
    let first = of(body.clone()).unwrap().unwrap();
    assert_eq!(of(body.clone()), Ok(Some(first)), "stable");
    body["metadata"] = json!({"session_id": "s-2"});
    assert_ne!(of(body).unwrap(), Some(first));
}

#[test]
fn the_loop_guard_refuses_the_same_body_past_its_repeats() {
    let (e, store) = engine(runs(), 1_000_000);
    let id = e.identify(&Call("1.1.1.1:1", None)).unwrap();
    let other = e.identify(&Call("2.2.2.2:1", None)).unwrap();
    let seen = |id: &Identity, body: &[u8], now: u64| {
        e.loop_seen(&store, id, "/v1/chat/completions", body, now).0
    };
    assert_eq!(seen(&id, b"same", 0), runs::LoopSeen::Fine);
    assert_eq!(seen(&id, b"same", 1), runs::LoopSeen::Fine);
    assert_eq!(
        seen(&id, b"same", 2_000),
        runs::LoopSeen::Loop {
            retry_after_ms: 8_000
        }
    );
    assert_eq!(seen(&id, b"different", 3), runs::LoopSeen::Fine);
    assert_eq!(seen(&other, b"same", 3), runs::LoopSeen::Fine);
    // The window over, the body counts afresh.
    assert_eq!(seen(&id, b"same", 10_000), runs::LoopSeen::Fine);
    let reply = e.loop_refusal(&id, 8_000).reply().unwrap();
    assert_eq!(
        (reply.status, reply.header("retry-after")),
        (429, Some("8"))
    );
    assert_eq!(reply.header("x-sluice-reason"), Some("loop_detected"));
}

#[test]
fn the_loop_guard_lets_through_what_it_cannot_count() {
    let (e, store) = engine(runs(), 1_000_000);
    let id = e.identify(&Call("1.1.1.1:1", None)).unwrap();
    let untracked = (0..1000u32)
        .filter(|i| {
            let body = i.to_le_bytes();
            e.loop_seen(&store, &id, "/p", &body, 0).0 == runs::LoopSeen::Untracked
        })
        .count();
    // 64 records: the rest let through, uncounted, never refused.
    assert!(untracked >= 1000 - 64, "{untracked}");
}

#[test]
fn the_limits_endpoint_shows_the_named_runs_budget_or_a_new_runs() {
    let (e, store) = engine(runs(), 100_000);
    let a = who("1.1.1.1:1", "r1");
    call(&e, &store, &a, 0, 400).unwrap();
    let run_entry = |view: &Call| {
        let mut id = e.identify(view).unwrap();
        id.run = e.run_in_header(&id, view);
        let body = e.own_limits(&store, &id, 0);
        let entry = body["limits"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["scope"] == "run")
            .cloned()
            .unwrap_or_else(|| panic!("no run entry: {body}"));
        (body["run_named"].clone(), entry)
    };
    // The run that spent 400 (and a reservation's rounding at most).
    let (named, entry) = run_entry(&a);
    assert_eq!(named, json!(true));
    assert_eq!(entry["limit"], json!(1000));
    assert_eq!(entry["kind"], json!("run"));
    assert_eq!(entry["reset_seconds"], json!(60));
    let left = entry["remaining"].as_u64().unwrap();
    assert!(left <= 600, "{entry}");
    // No run named, or another caller's run of the same name: a new run's.
    for view in [Call("1.1.1.1:1", None), who("2.2.2.2:1", "r1")] {
        let (_, entry) = run_entry(&view);
        assert_eq!(entry["remaining"], json!(1000), "{entry}");
    }
    // A bad run id names no run (nothing is refused: nothing is taken).
    let bad = who("1.1.1.1:1", "");
    let id = e.identify(&bad).unwrap();
    assert_eq!(e.run_in_header(&id, &bad), None);
}
