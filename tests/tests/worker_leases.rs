//! Worker-local leases (`state.worker_leases`, issue 21 lever 2) against a
//! real Envoy with several workers: a burst admits exactly the bucket's
//! capacity whatever the worker count (never more; what a worker's lease
//! still holds comes back at its ttl), and what one worker can strand
//! while the others refuse stays within the stated bound.

use std::time::Duration;

use serde_json::json;
use sluice_tests::{async_client, chat_body, post_json_async, runtime, wait_for, Stack};

const MODEL: &str = "llama3.1:8b";
const KEY: (&str, &str) = ("x-api-key", "demo-enterprise-key");

/// A stack of `workers` Envoy workers where the enterprise key's requests
/// are `capacity` a day, with worker leases on.
fn stack(workers: u32, capacity: u64, max_permille: u32, ttl: &str) -> Stack {
    Stack::start_with(workers, |cfg| {
        let p = cfg.policy_mut();
        p["tiers"]["enterprise"]["requests"] = format!("{capacity}/day").into();
        let leases = json!({
            "worker_leases": {"enabled": true, "workers": workers,
                              "max_permille": max_permille, "ttl": ttl},
        });
        p["state"] = serde_yaml::to_value(leases).expect("yaml");
    })
}

/// `calls` requests at once, each on its own connection (spread by the
/// kernel over Envoy's workers): how many were admitted.
fn burst(stack: &Stack, calls: usize) -> usize {
    let url = stack.envoy.url("/v1/chat/completions");
    runtime().block_on(async {
        let tasks: Vec<_> = (0..calls)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    let client = async_client();
                    post_json_async(&client, &url, &[KEY], &chat_body(MODEL)).await
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            let resp = t.await.expect("task").expect("request");
            assert!(matches!(resp.status, 200 | 429), "{}", resp.status);
            admitted += usize::from(resp.status == 200);
        }
        admitted
    })
}

/// Requests one after the other (fresh connections) until `capacity` are
/// admitted in all or `timeout` passes: leases still held come back at
/// their ttl (the worker's tick), so the rest becomes admissible then.
fn fill_up(stack: &Stack, admitted: &mut usize, capacity: usize, timeout: Duration) {
    wait_for(timeout, || {
        let resp = stack.chat(MODEL, &[KEY]);
        *admitted += usize::from(resp.status == 200);
        assert!(*admitted <= capacity, "over capacity: {admitted}");
        *admitted == capacity
    });
}

#[test]
fn a_burst_admits_exactly_the_capacity_at_one_two_and_four_workers() {
    const C: usize = 100;
    for workers in [1, 2, 4] {
        let stack = stack(workers, C as u64, 50, "1s");
        let in_burst = burst(&stack, 1_000);
        assert!(in_burst <= C, "{workers} workers: {in_burst} admitted");
        let mut admitted = in_burst;
        fill_up(&stack, &mut admitted, C, Duration::from_secs(15));
        println!("--concurrency {workers}: {in_burst} admitted in the burst, {admitted} in all");
        assert_eq!(admitted, C, "--concurrency {workers}");
        assert_eq!(stack.chat(MODEL, &[KEY]).status, 429);
        assert_eq!(stack.upstream_requests(), C as u64, "0 overshoot");
    }
}

#[test]
fn what_workers_strand_while_others_refuse_stays_within_the_bound() {
    const C: usize = 200;
    const WORKERS: u32 = 4;
    // A lease is at most 10 % of the capacity: 20 requests.
    let stack = stack(WORKERS, C as u64, 100, "10s");
    // One caller on one connection (one worker) takes a lease first.
    let first = stack.chat(MODEL, &[KEY]);
    assert_eq!(first.status, 200);
    let mut admitted = 1 + burst(&stack, 1_000);
    let stranded = C - admitted;
    println!(
        "stranded while the others refused: {stranded} of {C} (bound {})",
        4 * 20
    );
    // Bound: every worker holds at most one lease of at most 10 % of C.
    assert!(stranded <= WORKERS as usize * C / 10, "{stranded} stranded");
    // At their ttl the leases come back: exactly C in all, never more.
    fill_up(&stack, &mut admitted, C, Duration::from_secs(30));
    assert_eq!(admitted, C);
    assert_eq!(stack.upstream_requests(), C as u64, "0 overshoot");
}
