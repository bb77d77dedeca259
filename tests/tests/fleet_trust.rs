//! What the fleet agent trusts (issue 17, items 3–7), against real Envoys,
//! sidecars and a real Redis: forged fleet calls are refused and change
//! nothing; limits come from the sidecar's own policy; a salt on one Envoy
//! only degrades instead of doubling; a Redis that lost its data does not
//! reset a hard budget; a take that arrives after the filter gave up on it
//! charges nothing.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): what the fleet
//! agent trusts is between sidecars, Envoys and Redis.

use std::time::Duration;

use sluice_tests::fleet::{fleet_policy, Node, Redis, SECRET};
use sluice_tests::{async_client, chat_body, post_json_async, runtime, wait_for, MockLlm};

/// One chat request to `url`: status and `usage.total_tokens`.
fn one(url: &str, max_tokens: u64) -> (u16, u64) {
    let mut body = chat_body("m");
    body["max_tokens"] = max_tokens.into();
    let r = sluice_tests::post_json(url, &[], &body);
    let used = if r.status == 200 {
        r.json()["usage"]["total_tokens"].as_u64().unwrap_or(0)
    } else {
        0
    };
    (r.status, used)
}

/// Like [`one`], the upstream producing all `max_tokens` (the budget is
/// really spent, not only reserved).
fn full(url: &str, max_tokens: u64) -> (u16, u64) {
    let mut body = chat_body("m");
    body["max_tokens"] = max_tokens.into();
    let out = max_tokens.to_string();
    let r = sluice_tests::post_json(url, &[("x-mock-output-tokens", out.as_str())], &body);
    let used = if r.status == 200 {
        r.json()["usage"]["total_tokens"].as_u64().unwrap_or(0)
    } else {
        0
    };
    (r.status, used)
}

fn chat(node: &Node) -> String {
    node.envoy.url("/v1/chat/completions")
}

/// Every fleet key in Redis with its value (`DUMP` is binary: `TYPE` and
/// the string or hash content instead), sorted.
fn snapshot(redis: &Redis) -> Vec<String> {
    let mut out: Vec<String> = redis
        .keys("sluice:fleet:*")
        .into_iter()
        // Written by the sidecars on their own every sync: not counts.
        .filter(|k| {
            !k.ends_with(":breakers")
                && !k.ends_with(":fingerprints")
                && !k.contains(":slots:live:")
        })
        .map(|k| {
            let kind = redis.command(&["TYPE", &k]).unwrap_or_default();
            let value = if kind.contains("hash") {
                redis.command(&["HGETALL", &k]).unwrap_or_default()
            } else {
                redis.command(&["GET", &k]).unwrap_or_default()
            };
            format!("{k} = {value}")
        })
        .collect();
    out.sort();
    out
}

/// A forger on the same machine (another container of the pod, or a web
/// page the operator has open) posts to the fleet endpoints: without the
/// secret, with a wrong one, as `text/plain`, with an `Origin`. Every call
/// is refused before it is parsed, and Redis is exactly as it was. The
/// Envoy itself gets its secret from its own environment
/// (`vm_config.environment_variables.host_env_keys`) and is served.
#[test]
fn forged_fleet_calls_are_refused_and_leave_redis_as_it_was() {
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = fleet_policy(
        "tiers: { free: { requests: 1000/day, daily_tokens: 5000 } }",
        "fleet: { expected_replicas: 1, secret_env: SLUICE_TRUST_TEST_SECRET, lease: { idle: 200ms } }",
    );
    // Envoy passes its own environment variable to the VM (host_env_keys):
    // the policy and the Envoy config never hold the secret.
    let node = Node::start_tweaked(&redis.url(), &upstream, None, &p, 2, "", |config| {
        let vm = config
            .http_filter_mut("sluice")
            .get_mut("typed_config")
            .and_then(|t| t.get_mut("config"))
            .and_then(|c| c.get_mut("vm_config"))
            .and_then(|v| v.as_mapping_mut())
            .expect("vm_config");
        vm.insert(
            "environment_variables".into(),
            serde_yaml::from_str("{ host_env_keys: [SLUICE_TRUST_TEST_SECRET] }").unwrap(),
        );
        config.set_process_env("SLUICE_TRUST_TEST_SECRET", SECRET);
    });
    let mut served = 0;
    for _ in 0..3 {
        let (status, used) = one(&chat(&node), 100);
        assert_eq!(status, 200);
        served += used;
    }
    assert!(
        wait_for(Duration::from_secs(10), || redis.window_used()
            == Some(served as i64)),
        "the Envoy's own calls are heard: Redis counts {:?}, served {served}; sidecar: {}",
        redis.window_used(),
        node.sidecar.log()
    );
    let stats = node.fleet_stats();
    assert_eq!(stats["refused_calls"], 0, "{stats}");
    assert_eq!(stats["mismatch"], false, "{stats}");
    let before = snapshot(&redis);

    let end = redis
        .keys("sluice:fleet:*")
        .iter()
        .filter_map(|k| k.rsplit(':').next()?.parse::<u64>().ok())
        .find(|e| *e > 0)
        .expect("the daily window's key");
    let give = serde_json::json!({"id": "forged-1", "items": [{"rule": "tier/free/daily_tokens",
        "owner": 2, "window_end_ms": end, "delta": 5000}]})
    .to_string();
    let slots = r#"{"scopes": [{"id": "concurrency/local/m", "hold": 1000}]}"#;
    let take = serde_json::json!({"id": "forged-2", "deadline_ms": end, "claims": [{"rule":
        "tier/free/daily_tokens", "owner": 2, "window_end_ms": end, "need": 0, "want": 5000}]})
    .to_string();
    let fingerprint = node.fleet_stats()["fingerprint"]
        .as_str()
        .unwrap()
        .to_string();
    let fp = ("x-sluice-fleet-fingerprint", fingerprint.as_str());
    let json = ("content-type", "application/json");
    let text = ("content-type", "text/plain");
    let origin = ("origin", "http://evil.example");
    let right = ("x-sluice-fleet-secret", SECRET);
    let wrong = ("x-sluice-fleet-secret", "guessed-secret-0123456789");
    let forged: Vec<(Vec<(&str, &str)>, u16)> = vec![
        // The web page of the issue: a simple CORS request.
        (vec![text, origin], 403),
        (vec![text], 415),
        (vec![json], 401),
        (vec![json, wrong, fp], 401),
        // Even with the secret: a browser is never the filter.
        (vec![json, right, fp, origin], 403),
        (vec![text, right, fp], 415),
    ];
    let mut refused = 0;
    for path in ["/v1/fleet/give", "/v1/fleet/slots", "/v1/fleet/take"] {
        let body = match path {
            "/v1/fleet/give" => give.as_str(),
            "/v1/fleet/slots" => slots,
            _ => take.as_str(),
        };
        for (headers, expected) in &forged {
            let (status, answer) = node.sidecar_post(path, headers, body);
            assert_eq!(status, *expected, "{path} {headers:?}: {answer}");
            refused += 1;
        }
    }
    // The filter's own door, but limits taken from the message: the old
    // wire (capacity in the claim) is no wire at all, and an unknown bucket
    // is refused by name.
    let old = r#"{"id": "forged-3", "items": [{"key": "00112233445566778899aabbccddeeff",
        "capacity": 1000000, "amount": 1, "period_ms": 1, "window_end_ms": 0, "delta": 5000}]}"#;
    let (status, answer) = node.sidecar_post("/v1/fleet/give", &[json, right, fp], old);
    assert_eq!(status, 400, "{answer}");
    let unknown = r#"{"id": "forged-4", "items": [{"rule": "tier/gold/daily_tokens",
        "owner": 2, "window_end_ms": 0, "delta": 5000}]}"#;
    let (status, answer) = node.sidecar_post("/v1/fleet/give", &[json, right, fp], unknown);
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("items[0].rule"), "{answer}");

    assert_eq!(snapshot(&redis), before, "Redis changed");
    assert_eq!(node.fleet_stats()["refused_calls"], refused);
    // And the budget still holds what was served: the Envoy goes on.
    assert_eq!(one(&chat(&node), 100).0, 200);
}

/// `limit` and `hold` of a slots report: the limit is the sidecar's own
/// (models.m.concurrency: 2), a report cannot raise it, and the other
/// Envoy still gets its slots.
#[test]
fn a_greedy_slots_report_cannot_hold_more_than_the_policys_concurrency() {
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = fleet_policy(
        "tiers: { free: { class: batch } }\n\
         classes: { batch: { max_wait: 20s } }\n\
         models: { m: { concurrency: 2 } }",
        "fleet: { expected_replicas: 2 }",
    );
    let a = Node::start(&redis.url(), &upstream, None, &p, 1);
    let b = Node::start(&redis.url(), &upstream, None, &p, 1);
    let headers = a.fleet_headers();
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut with_json = headers.clone();
    with_json.push(("content-type", "application/json"));
    // The report of the issue: the limit claimed by the caller.
    let (status, answer) = a.sidecar_post(
        "/v1/fleet/slots",
        &with_json,
        r#"{"scopes": [{"id": "concurrency/local/m", "limit": 1000000, "hold": 1000000}]}"#,
    );
    assert_eq!(status, 400, "no limit on the wire: {answer}");
    let (status, answer) = a.sidecar_post(
        "/v1/fleet/slots",
        &with_json,
        r#"{"scopes": [{"id": "concurrency/local/m", "hold": 1000000}]}"#,
    );
    assert_eq!(status, 200, "{answer}");
    let grants: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(
        grants["grants"],
        serde_json::json!([2]),
        "capped by the policy"
    );
    let held = redis
        .command(&["HVALS", "sluice:fleet:slots:concurrency/local/m"])
        .unwrap_or_default();
    let total: u64 = held.lines().filter_map(|l| l.parse::<u64>().ok()).sum();
    assert!(total <= 2, "held in Redis: {held}");
    // Envoy B is not starved: its requests wait (batch) and are served
    // once A's report lapses (its Envoy reports what it really holds).
    let url = b.envoy.url("/v1/chat/completions");
    let statuses: Vec<u16> = runtime().block_on(async {
        let client = async_client();
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move {
                    post_json_async(
                        &client,
                        &url,
                        &[("x-mock-latency-ms", "300")],
                        &chat_body("m"),
                    )
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
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(upstream.stats()["peak_in_flight"].as_u64().unwrap_or(0) <= 2);
}

/// The issue's drill: a salt on one Envoy only. Each sidecar publishes the
/// fingerprint of its salt and rules in Redis; they differ, both see it,
/// log it, and answer `fleet_mismatch`; both Envoys follow
/// `on_unavailable` (local_share: 10 ÷ 2 each) instead of counting in two
/// universes (20 of 22 admitted before).
#[test]
fn a_salt_on_one_envoy_only_degrades_instead_of_doubling_every_limit() {
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let fleet = |salt: &str| {
        format!(
            "fleet: {{ expected_replicas: 2, salt: {salt}, on_unavailable: {{ requests: local_share }} }}"
        )
    };
    let tiers = "tiers: { free: { requests: 10/day } }";
    let a = Node::start(
        &redis.url(),
        &upstream,
        None,
        &fleet_policy(tiers, &fleet("the-fleets-salt-0123")),
        1,
    );
    let b = Node::start(
        &redis.url(),
        &upstream,
        None,
        &fleet_policy(tiers, &fleet("another-salt-4567890")),
        1,
    );
    assert!(
        wait_for(Duration::from_secs(10), || {
            a.fleet_stats()["mismatch"] == true && b.fleet_stats()["mismatch"] == true
        }),
        "the sidecars never saw the mismatch: {} {}",
        a.fleet_stats(),
        b.fleet_stats()
    );
    let urls = [chat(&a), chat(&b)];
    let admitted = (0..22).filter(|i| one(&urls[i % 2], 4).0 == 200).count();
    assert!(
        admitted <= 10,
        "{admitted} of 22 admitted on a fleet-wide 10"
    );
    for n in [&a, &b] {
        assert!(
            n.sidecar.log().contains("fingerprint mismatch"),
            "{}",
            n.sidecar.log()
        );
        assert_eq!(
            n.envoy.metric("sluice_fleet_mismatch", &[]),
            Some(1.0),
            "the Envoy meters why it is degraded"
        );
    }
    // Nothing was counted in Redis meanwhile.
    assert_eq!(redis.keys("sluice:fleet:take:*"), Vec::<String>::new());
}

/// `FLUSHALL` mid-window (as a Redis restarted without persistence): the
/// daily budget's count is gone. The sidecars notice (the epoch key every
/// script checks is gone) and refuse the hard budgets of that window
/// (`fleet_data_lost`): the Envoy follows `on_unavailable.budgets`
/// (fail_closed here) instead of serving the budget a second time.
#[test]
fn flushall_mid_window_does_not_hand_out_a_hard_budget_twice() {
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = fleet_policy(
        "tiers: { free: { requests: 100000/day, daily_tokens: 5000 } }",
        "fleet: { expected_replicas: 2, lease: { max: 0 }, on_unavailable: { budgets: fail_closed } }",
    );
    // Two Envoys: each one's local count alone would stop at 5000; the
    // fleet's count is what keeps them together.
    let node = Node::start(&redis.url(), &upstream, None, &p, 1);
    let other = Node::start(&redis.url(), &upstream, None, &p, 1);
    let urls = [chat(&node), chat(&other)];
    let mut served = 0;
    for _ in 0..6 {
        let (status, used) = full(&urls[0], 498);
        assert_eq!(status, 200);
        served += used;
    }
    assert!(
        served >= 3_000,
        "the upstream produced what was asked: {served}"
    );
    assert!(
        wait_for(Duration::from_secs(10), || redis.window_used()
            == Some(served as i64)),
        "Redis counts {:?}, served {served}",
        redis.window_used()
    );
    assert_eq!(redis.command(&["FLUSHALL"]).as_deref(), Some("+OK\r\n"));
    let mut statuses = Vec::new();
    while statuses.len() < 40 && !statuses.ends_with(&[429, 429, 429]) {
        let (status, used) = full(&urls[statuses.len() % 2], 498);
        statuses.push(status);
        served += used;
    }
    assert!(
        served <= 5_000,
        "overshoot after the flush: served {served} of 5000: {statuses:?}"
    );
    assert!(
        statuses.ends_with(&[429, 429, 429]),
        "never refused after the flush: {statuses:?}"
    );
    let stats = node.fleet_stats();
    assert!(stats["data_lost"].as_u64() >= Some(1), "{stats}");
    assert!(stats["data_lost_at_ms"].as_u64() > Some(0), "{stats}");
    assert!(
        node.sidecar.log().contains("fleet_data_lost"),
        "{}",
        node.sidecar.log()
    );
    // Each Envoy learns it from an answer of its sidecar to one of its own
    // takes (a take that timed out on a loaded machine teaches it nothing):
    // ask again, every ask refused, until each shows it.
    for n in [&node, &other] {
        let mut refused = Vec::new();
        assert!(
            wait_for(Duration::from_secs(20), || {
                refused.push(full(&chat(n), 498).0);
                n.envoy.metric("sluice_fleet_data_lost", &[]) == Some(1.0)
            }),
            "sluice_fleet_data_lost: {:?}",
            n.envoy.metric("sluice_fleet_data_lost", &[])
        );
        assert!(refused.iter().all(|s| *s == 429), "{refused:?}");
    }
}

/// The issue's drill: the fleet slower than `fleet.timeout` (Redis
/// stopped for a while, with the take already sent to it). The Envoy gives
/// up on its take and admits on `local_share` (charged to Redis later);
/// the take runs in Redis after its deadline and is not applied (checked
/// in the script by Redis' clock), and the filter's cancel (by id) would
/// undo it if it had been: what Redis counts settles to exactly what was
/// served (before: served plus the abandoned reservation).
#[test]
fn a_take_arriving_after_the_filter_gave_up_charges_nothing() {
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = fleet_policy(
        "tiers: { free: { requests: 100000/day, daily_tokens: 100000 } }",
        "fleet: { expected_replicas: 1, timeout: 300ms, lease: { max: 0 }, \
         on_unavailable: { requests: local_share, budgets: local_share } }",
    );
    let node = Node::start(&redis.url(), &upstream, None, &p, 1);
    let url = chat(&node);
    let (status, mut served) = one(&url, 498);
    assert_eq!(status, 200);
    assert!(
        wait_for(Duration::from_secs(10), || redis.window_used()
            == Some(served as i64)),
        "Redis counts {:?}, served {served}",
        redis.window_used()
    );
    redis.pause(true);
    // Its take waits in the stopped Redis' socket; the Envoy gives up
    // after 300 ms and admits on its local share.
    let (status, used) = one(&url, 498);
    redis.pause(false);
    assert_eq!(status, 200);
    served += used;
    let settled = wait_for(Duration::from_secs(15), || {
        redis.window_used() == Some(served as i64)
            && node.fleet_stats()["gives"].as_u64() >= Some(2)
    });
    assert!(
        settled,
        "Redis counts {:?}, served {served}; sidecar: {}",
        redis.window_used(),
        node.fleet_stats()
    );
}

/// Two Envoys sharing a 5,000-token daily budget, a caller spread evenly
/// over them; `FLUSHALL` once ~4,000 are spent. Returns what was served
/// in all, the statuses after the flush, and the two nodes (to read their
/// gauges).
fn data_loss_drill(on_unavailable: &str) -> (u64, Vec<u16>, Node, Node, Redis) {
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = fleet_policy(
        "tiers: { free: { requests: 100000/day, daily_tokens: 5000 } }",
        &format!("fleet: {{ expected_replicas: 2, lease: {{ max: 0 }}{on_unavailable} }}"),
    );
    let node = Node::start(&redis.url(), &upstream, None, &p, 1);
    let other = Node::start(&redis.url(), &upstream, None, &p, 1);
    let urls = [chat(&node), chat(&other)];
    let mut served = 0;
    for i in 0..8 {
        let (status, used) = full(&urls[i % 2], 488);
        assert_eq!(status, 200);
        served += used;
    }
    assert!(
        wait_for(Duration::from_secs(10), || redis.window_used()
            == Some(served as i64)),
        "Redis counts {:?}, served {served}",
        redis.window_used()
    );
    assert_eq!(redis.command(&["FLUSHALL"]).as_deref(), Some("+OK\r\n"));
    let mut statuses = Vec::new();
    while statuses.len() < 40 && !statuses.ends_with(&[429, 429, 429, 429]) {
        let (status, used) = full(&urls[statuses.len() % 2], 488);
        statuses.push(status);
        served += used;
    }
    (served, statuses, node, other, redis)
}

/// Issue 29, item 4: after a detected data loss each Envoy used to start
/// a fresh local share (`limit ÷ replicas`) of the hard budget: a caller
/// who had used 4,910 of 5,000 got 4,910 more. By default the budget now
/// refuses for the rest of its window, and the gauge holds for the window
/// (that a good fleet call does not drop it: `fleet::tests` in the filter).
#[test]
fn a_data_loss_never_hands_out_a_hard_budget_twice_by_default() {
    let (served, statuses, node, other, _redis) = data_loss_drill("");
    assert!(
        served <= 5_000,
        "overshoot after the flush: served {served} of 5000: {statuses:?}"
    );
    assert!(
        statuses.iter().all(|s| *s == 429),
        "the lost window's budget refuses: {statuses:?}"
    );
    for n in [&node, &other] {
        assert!(
            wait_for(Duration::from_secs(20), || {
                let _ = full(&chat(n), 488);
                n.envoy.metric("sluice_fleet_data_lost", &[]) == Some(1.0)
            }),
            "sluice_fleet_data_lost: {:?}",
            n.envoy.metric("sluice_fleet_data_lost", &[])
        );
        // Past a sweep of the agent (1 s), still up.
        std::thread::sleep(Duration::from_millis(1_500));
        assert_eq!(
            n.envoy.metric("sluice_fleet_data_lost", &[]),
            Some(1.0),
            "the gauge holds for the window"
        );
        let log = n.envoy.log();
        assert_eq!(
            log.matches("Redis lost its data").count(),
            1,
            "said once per Envoy: {log}"
        );
    }
}

/// `on_unavailable.data_lost: local_share`: each Envoy's share is charged
/// with what it admitted in the window before the loss (its own count of
/// it), so a caller spread evenly gets no second budget either.
#[test]
fn a_data_loss_on_local_share_counts_what_each_envoy_already_admitted() {
    let (served, statuses, _node, _other, _redis) =
        data_loss_drill(", on_unavailable: { data_lost: local_share }");
    assert!(
        served <= 5_000,
        "overshoot after the flush: served {served} of 5000: {statuses:?}"
    );
    assert!(
        statuses.ends_with(&[429, 429, 429, 429]),
        "never refused after the flush: {statuses:?}"
    );
}
