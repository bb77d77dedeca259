//! Run budgets (`runs`) and the loop guard (`loop_guard`) through a real
//! Envoy: a run's budget beside the caller's daily one, runs kept apart
//! per caller, forgotten after their ttl, a flood of run ids bounded, the
//! same body refused past its repeats.
//!
//! Upstream: mock-llm's own personality (the shipped config's): every
//! answer reports its usage.

use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};
use sluice_tests::{get, post_json, wait_for, EnvoyConfig, Response, Stack};

const FREE: &str = "demo-free-key";
const PRO: &str = "demo-pro-key";

fn set(cfg: &mut EnvoyConfig, key: &str, value: Json) {
    cfg.policy_mut()[key] = serde_yaml::to_value(value).expect("YAML");
}

/// The shipped config with `runs` (and the tiers' limits made room for a
/// flood): free keeps a small daily budget, pro a large one.
fn start(runs: Json, loop_guard: Option<Json>) -> Stack {
    Stack::start(|cfg| {
        set(
            cfg,
            "tiers",
            json!({"free": {"daily_tokens": 200}, "pro": {"daily_tokens": 10_000_000},
                   "enterprise": {"requests": "300/min"}}),
        );
        set(cfg, "runs", runs);
        if let Some(guard) = loop_guard {
            set(cfg, "loop_guard", guard);
        }
    })
}

fn chat(text: &str) -> Json {
    json!({"model": "llama3.1:8b", "max_tokens": 16,
           "messages": [{"role": "user", "content": text}]})
}

fn call(stack: &Stack, key: &str, run: Option<&str>, body: &Json) -> Response {
    let url = stack.envoy.url("/v1/chat/completions");
    let mut headers = vec![("x-api-key", key)];
    if let Some(run) = run {
        headers.push(("x-session-id", run));
    }
    post_json(&url, &headers, body)
}

fn reason(resp: &Response) -> &str {
    resp.header("x-sluice-reason").unwrap_or("admitted")
}

fn drained(stack: &Stack) -> bool {
    wait_for(Duration::from_secs(10), || {
        stack.envoy.metric("sluice_reservations_outstanding", &[]) == Some(0.0)
    })
}

/// Calls until refused (at most 50); the admitted count and the refusal.
fn until_refused(stack: &Stack, key: &str, run: &str) -> (usize, Response) {
    for n in 0..50 {
        let resp = call(stack, key, Some(run), &chat(&format!("{run} {n}")));
        if resp.status != 200 {
            return (n, resp);
        }
    }
    panic!("never refused");
}

fn header_runs(ttl: &str, tokens: u64) -> Json {
    json!({"id": {"header": "x-session-id"}, "ttl": ttl, "tokens": tokens,
           "max_per_caller": 4, "max_live": 64})
}

#[test]
fn a_run_budget_binds_beside_the_daily_one_and_is_the_callers_own() {
    let stack = start(header_runs("1h", 150), None);
    // Pro's daily budget is far away: the run's budget refuses.
    let (admitted, refused) = until_refused(&stack, PRO, "r1");
    assert!(admitted >= 1, "{refused:?}");
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(reason(&refused), "run_budget_exceeded");
    let error = refused.json()["error"].clone();
    assert_eq!(error["sluice"]["bucket"], "run/tokens", "{error}");
    assert_eq!(error["type"], "insufficient_quota", "{error}");
    assert!(refused.header("retry-after").is_some());
    // The limits endpoint shows the run the caller names, spent, and what
    // a new run starts with when it names none.
    let run_left = |run: Option<&str>| {
        let mut headers = vec![("x-api-key", PRO)];
        headers.extend(run.map(|r| ("x-session-id", r)));
        let body = get(&stack.envoy.url("/v1/sluice/limits"), &headers).json();
        let entry = body["limits"]
            .as_array()
            .and_then(|l| l.iter().find(|e| e["id"] == "run/tokens").cloned())
            .unwrap_or_else(|| panic!("no run/tokens entry: {body}"));
        assert_eq!(entry["kind"], "run", "{entry}");
        assert_eq!(body["run_named"], run.is_some(), "{body}");
        entry["remaining"].as_u64().expect("remaining")
    };
    assert!(run_left(Some("r1")) < 150);
    assert_eq!(run_left(None), 150);
    // A new run of the same caller starts with the whole run budget.
    assert_eq!(call(&stack, PRO, Some("r2"), &chat("r2")).status, 200);
    // Another caller naming the same run id does not share it.
    let other = call(&stack, FREE, Some("r1"), &chat("free r1"));
    assert_eq!(other.status, 200, "{other:?}");
    // Free's daily budget (200) binds across its runs: its other three
    // runs (150 each, 450 together) are no way around it.
    let refusals: Vec<String> = (0..20)
        .map(|i| {
            let run = format!("f{}", i % 3);
            call(&stack, FREE, Some(&run), &chat(&format!("f{i}")))
        })
        .filter(|r| r.status != 200)
        .map(|r| reason(&r).to_string())
        .collect();
    assert!(
        refusals.iter().any(|r| r == "daily_budget_exceeded"),
        "{refusals:?}"
    );
    assert!(drained(&stack), "a reservation left behind");
    // No run id in the metrics.
    let stats = stack.envoy.stats_prometheus();
    assert!(
        !stats.contains("r1") && !stats.contains("f2"),
        "a run id in the metrics"
    );
}

#[test]
fn a_missing_or_bad_run_id_is_refused_naming_the_field() {
    let stack = start(header_runs("1h", 1000), None);
    for run in [None, Some("x".repeat(129).as_str()), Some("")] {
        let resp = call(&stack, PRO, run, &chat("hi"));
        assert_eq!(resp.status, 400, "{run:?}: {resp:?}");
        assert_eq!(resp.json()["error"]["param"], "x-session-id", "{resp:?}");
    }
    // Named in the body instead: a number there is refused too.
    let stack = start(
        json!({"id": {"body": "metadata.session_id"}, "ttl": "1h", "tokens": 150}),
        None,
    );
    let mut body = chat("hi");
    body["metadata"] = json!({"session_id": 42});
    let resp = call(&stack, PRO, None, &body);
    assert_eq!(resp.status, 400, "{resp:?}");
    assert_eq!(resp.json()["error"]["param"], "metadata.session_id");
    body["metadata"] = json!({"session_id": "s1"});
    let mut admitted = 0;
    let refused = loop {
        body["messages"][0]["content"] = json!(format!("n{admitted}"));
        let resp = call(&stack, PRO, None, &body);
        if resp.status != 200 {
            break resp;
        }
        admitted += 1;
        assert!(admitted < 50);
    };
    assert_eq!(reason(&refused), "run_budget_exceeded", "{refused:?}");
}

#[test]
fn a_flood_of_run_ids_hits_the_cap_without_evicting_a_live_run() {
    let stack = start(header_runs("1h", 150), None);
    let (_, refused) = until_refused(&stack, PRO, "keep");
    assert_eq!(reason(&refused), "run_budget_exceeded");
    const FLOOD: usize = 2_000;
    let mut run_limit = 0;
    for i in 0..FLOOD {
        let run = format!("flood-{i}");
        let resp = call(&stack, PRO, Some(&run), &chat(&run));
        match resp.status {
            200 => {}
            429 => {
                assert_eq!(reason(&resp), "run_limit", "{resp:?}");
                assert!(resp.header("retry-after").is_some());
                run_limit += 1;
            }
            other => panic!("{other}: {resp:?}"),
        }
    }
    // Four runs a caller: the spent one and three new ones.
    assert_eq!(run_limit, FLOOD - 3);
    let counted = stack
        .envoy
        .metric("sluice_requests_total", &[("reason", "run_limit")])
        .unwrap_or(0.0);
    assert_eq!(counted as usize, FLOOD - 3);
    // The live run kept its count: still spent, not reset by the flood.
    let again = call(&stack, PRO, Some("keep"), &chat("keep again"));
    assert_eq!(reason(&again), "run_budget_exceeded", "{again:?}");
    // Another caller still has its own runs.
    assert_eq!(call(&stack, FREE, Some("keep"), &chat("x")).status, 200);
    assert!(drained(&stack));
    let stats = stack.envoy.stats_prometheus();
    assert!(!stats.contains("flood-"), "a run id in the metrics");
}

#[test]
fn a_run_is_forgotten_after_its_ttl_and_the_loop_guard_refuses_repeats() {
    let guard = json!({"max_repeats": 3, "window": "1h"});
    let stack = start(header_runs("2s", 150), Some(guard));
    let (_, refused) = until_refused(&stack, PRO, "t1");
    assert_eq!(reason(&refused), "run_budget_exceeded");
    let spent = Instant::now();
    // Refusals are no use of the run: polling does not keep it alive.
    let mut n = 0;
    let back = wait_for(Duration::from_secs(60), || {
        n += 1;
        call(&stack, PRO, Some("t1"), &chat(&format!("poll {n}"))).status == 200
    });
    assert!(back, "the run was never forgotten");
    assert!(spent.elapsed() >= Duration::from_millis(1_500));
    // The loop guard: the same body a fourth time within the window.
    let same = chat("the same question");
    for _ in 0..3 {
        assert_eq!(call(&stack, PRO, Some("loop"), &same).status, 200);
    }
    let looped = call(&stack, PRO, Some("loop"), &same);
    assert_eq!(looped.status, 429, "{looped:?}");
    assert_eq!(reason(&looped), "loop_detected");
    assert!(looped.header("retry-after").is_some());
    // A different body passes; so does the same body from another caller.
    assert_eq!(
        call(&stack, PRO, Some("loop"), &chat("another")).status,
        200
    );
    assert_eq!(call(&stack, FREE, Some("loop"), &same).status, 200);
    assert!(drained(&stack));
}
