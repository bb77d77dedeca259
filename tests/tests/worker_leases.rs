//! Worker-local leases (`state.worker_leases`, issue 21 lever 2) against a
//! real Envoy with several workers: a burst admits exactly the bucket's
//! capacity whatever the worker count (never more; what a worker's lease
//! still holds comes back at its ttl), and what one worker can strand
//! while the others refuse stays within the stated bound.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): leases are
//! sluice's arithmetic, whatever server answers.

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

/// Three Envoys of two workers each, fleet leases from Redis and worker
/// sub-leases of them (one mechanism, two levels): 0 overshoot, and every
/// unit is admitted once the leases are back.
#[test]
fn a_fleet_with_worker_sub_leases_never_overshoots() {
    use sluice_tests::fleet::{policy, Node, Redis};
    use sluice_tests::MockLlm;
    const C: usize = 100;
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = policy(&format!(
        "default_tier: free\nidentity: {{ sources: [client_address] }}\n\
         tiers: {{ free: {{ requests: {C}/day }} }}\n\
         sidecar: {{ cluster: sluice_sidecar, stale_after: 60s, on_stale: fail_open, poll_wait: 5s }}\n\
         fleet: {{ expected_replicas: 3, salt: fleet-test-salt-0123, lease: {{ idle: 300ms }} }}\n\
         state: {{ worker_leases: {{ enabled: true, workers: 2, max_permille: 100, ttl: 500ms }} }}\n"
    ));
    let nodes: Vec<Node> = (0..3)
        .map(|_| Node::start(&redis.url(), &upstream, None, &p, 2))
        .collect();
    let urls: Vec<String> = nodes
        .iter()
        .map(|n| n.envoy.url("/v1/chat/completions"))
        .collect();
    let statuses = runtime().block_on(async {
        let client = async_client();
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(48));
        let tasks: Vec<_> = (0..1_000)
            .map(|i| {
                let (url, client, sem) = (urls[i % 3].clone(), client.clone(), sem.clone());
                tokio::spawn(async move {
                    let _permit = sem.acquire().await;
                    post_json_async(&client, &url, &[], &chat_body(MODEL))
                        .await
                        .map_or(0, |r| r.status)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap_or(0));
        }
        out
    });
    let in_burst = statuses.iter().filter(|s| **s == 200).count();
    let seen = || upstream.stats()["requests_total"].as_u64().unwrap_or(0) as usize;
    assert!(in_burst <= C, "{in_burst} admitted");
    assert_eq!(seen(), in_burst, "0 overshoot upstream");
    let mut admitted = in_burst;
    let mut n = 0;
    wait_for(Duration::from_secs(20), || {
        n += 1;
        let r = sluice_tests::post_json(&urls[n % 3], &[], &chat_body(MODEL));
        admitted += usize::from(r.status == 200);
        assert!(admitted <= C, "over capacity: {admitted}");
        admitted == C
    });
    println!("fleet of 3 × 2 workers: {in_burst} admitted in the burst, {admitted} in all");
    assert_eq!(admitted, C);
    assert_eq!(seen(), C, "0 overshoot upstream");
}

/// Connections each Envoy worker accepted so far.
fn connections_per_worker(stack: &Stack, workers: u32) -> Vec<u64> {
    let addr = stack.envoy.addr();
    let listener = format!("listener.{}_{}", addr.ip(), addr.port());
    (0..workers)
        .map(|w| {
            let stat = format!("{listener}.worker_{w}.downstream_cx_total");
            stack.envoy.counter_value(&stat).unwrap_or(0)
        })
        .collect()
}

/// One keep-alive connection (a client that keeps it): every request on
/// it goes to the worker that accepted it.
struct Connection {
    client: reqwest::blocking::Client,
    url: String,
    worker: usize,
}

impl Connection {
    /// Opens a connection with its first request (admitted or not: its
    /// status) and finds the worker that accepted it.
    fn open(stack: &Stack, workers: u32) -> (Connection, u16) {
        let before = connections_per_worker(stack, workers);
        let client = reqwest::blocking::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(1)
            .build()
            .expect("client");
        let mut c = Connection {
            client,
            url: stack.envoy.url("/v1/chat/completions"),
            worker: usize::MAX,
        };
        let status = c.chat();
        let after = connections_per_worker(stack, workers);
        c.worker = (0..workers as usize)
            .find(|&w| after[w] > before[w])
            .expect("a worker accepted the connection");
        (c, status)
    }

    fn chat(&mut self) -> u16 {
        self.client
            .post(&self.url)
            .header("content-type", "application/json")
            .header(KEY.0, KEY.1)
            .body(chat_body(MODEL).to_string())
            .send()
            .expect("request")
            .status()
            .as_u16()
    }
}

/// The stranding bound, observed: worker A takes a lease on one
/// connection; another worker B spends the shared bucket until it is
/// refused; A still admits what its lease holds (stranded from B's point
/// of view: at least 1, at most `max_permille × C`), and not a unit more.
#[test]
fn a_lease_held_by_one_worker_is_what_another_cannot_have_and_no_more() {
    const C: usize = 100;
    const WORKERS: u32 = 4;
    // 20 % of C at most per lease, held for up to 60 s (longer than the
    // test: no ttl return in between).
    let stack = stack(WORKERS, C as u64, 200, "60s");
    let (mut a, first) = Connection::open(&stack, WORKERS);
    assert_eq!(first, 200);
    let mut admitted = 1;
    // A connection on another worker.
    let mut b = loop {
        let (b, status) = Connection::open(&stack, WORKERS);
        admitted += usize::from(status == 200);
        if b.worker != a.worker {
            break b;
        }
    };
    while b.chat() == 200 {
        admitted += 1;
        assert!(admitted <= C);
    }
    // B is refused: what is left is A's lease.
    let mut stranded = 0;
    while a.chat() == 200 {
        stranded += 1;
        assert!(admitted + stranded <= C, "over capacity");
    }
    println!(
        "worker {} held {stranded} while worker {} was refused (bound {})",
        a.worker,
        b.worker,
        C / 5
    );
    assert!(stranded >= 1, "A's lease served after B was refused");
    assert!(stranded <= C / 5, "{stranded} over the bound");
    assert_eq!(admitted + stranded, C, "every unit, once");
    assert_eq!(b.chat(), 429);
    assert_eq!(stack.upstream_requests(), C as u64, "0 overshoot");
}
