//! The fleet (SPEC §7): several real Envoys, each with its own sidecar, one
//! real Redis. Exactness across Envoys, budgets settled once, stranding,
//! Redis and sidecar outages, the fleet-wide kill switch.

use std::time::{Duration, Instant};

use sluice_tests::fleet::{policy, Node, Redis};
use sluice_tests::{async_client, chat_body, post_json_async, runtime, wait_for, MockLlm};

const SIDECAR: &str =
    "sidecar: { cluster: sluice_sidecar, stale_after: 60s, on_stale: fail_open, poll_wait: 5s }\n";

fn fleet_policy(tiers: &str, fleet: &str) -> serde_yaml::Value {
    policy(&format!(
        "default_tier: free\nidentity: {{ sources: [client_address] }}\n{tiers}\n{SIDECAR}{fleet}\n"
    ))
}

/// Sends `n` chat requests spread round-robin over `urls`, `parallel` at a
/// time; the statuses in order.
fn blast(urls: &[String], n: usize, parallel: usize, max_tokens: u64) -> Vec<u16> {
    runtime().block_on(async {
        let client = async_client();
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(parallel));
        let mut tasks = Vec::new();
        for i in 0..n {
            let url = urls[i % urls.len()].clone();
            let client = client.clone();
            let sem = sem.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire().await;
                let mut body = chat_body("m");
                body["max_tokens"] = max_tokens.into();
                post_json_async(&client, &url, &[], &body)
                    .await
                    .map_or(0, |r| r.status)
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap_or(0));
        }
        out
    })
}

#[test]
fn a_fleet_request_bucket_admits_exactly_its_limit_across_three_envoys() {
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = fleet_policy(
        "tiers: { free: { requests: 100/day } }",
        "fleet: { expected_replicas: 3 }",
    );
    let nodes: Vec<Node> = (0..3)
        .map(|_| Node::start(&redis.url(), &upstream, None, &p, 2))
        .collect();
    let urls: Vec<String> = nodes
        .iter()
        .map(|n| n.envoy.url("/v1/chat/completions"))
        .collect();
    let statuses = blast(&urls, 1_000, 48, 4);
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    let upstream_seen = upstream.stats()["requests_total"].as_u64().unwrap_or(0);
    assert_eq!(
        (admitted, refused, upstream_seen),
        (100, 900, 100),
        "statuses other than 200/429: {:?}; sidecar log: {}",
        statuses
            .iter()
            .filter(|s| **s != 200 && **s != 429)
            .take(5)
            .collect::<Vec<_>>(),
        nodes[0].sidecar.log()
    );
}
