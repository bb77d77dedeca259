//! The queue is shared fairly and follows the state of the world (issue
//! #18, items 2, 4 and 5), against a real Envoy with 2 workers: one
//! tenant cannot fill a class's queue, a caller its buckets would refuse
//! takes no place, the kill switch reaches queued requests, and a reload
//! governs what waits and what is in flight.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the queue's
//! fairness is sluice's, whatever server answers.

use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::queue::{depth, stack_with_policy, volley, Aim, Shot, MODEL};
use sluice_tests::{
    get, post_json, shipped_config_for, wait_for, Envoy, MockLlm, PolicyBuilder, Sidecar,
};

const WORKERS: u32 = 2;

/// Callers name themselves (`x-user`) and their tier (`x-tier`): `batch`
/// (unlimited) and `capped` (3 requests a minute), both in the `batch`
/// class (waits 20 s, 10 places per model).
fn policy(concurrency: u32) -> Value {
    PolicyBuilder::header_tiers("batch")
        .tier("batch", json!({"class": "batch"}))
        .tier("capped", json!({"class": "batch", "requests": "3/min"}))
        .class("batch", json!({"max_wait": "20s", "max_depth": 10}))
        .model(MODEL, json!({"concurrency": concurrency}))
        .build()
}

fn count(shots: &[Shot], status: u16, reason: Option<&str>) -> usize {
    shots
        .iter()
        .filter(|s| s.status == status && s.reason.as_deref() == reason)
        .count()
}

fn in_flight(upstream: &MockLlm) -> u64 {
    upstream.stats()["in_flight"].as_u64().unwrap_or(0)
}

/// A holds the slot and fills all 10 places (5 more refused `queue_full`);
/// B then arrives with 3: each takes the newest place of A (who holds the
/// most), so B waits like anyone and is served; A's 3 evicted requests are
/// answered `queue_full`. Before: B got `queue_full` three times.
#[test]
fn one_tenant_cannot_fill_a_class_queue() {
    let s = stack_with_policy(WORKERS, policy(1), &[]);
    let mut aims = vec![Aim::new("A", "batch").latency_ms(5_000)];
    aims.extend((0..15).map(|_| Aim::new("A", "batch").latency_ms(10).after_ms(100)));
    let (a, b) = std::thread::scope(|scope| {
        let envoy = &s.envoy;
        let a = scope.spawn(move || volley(envoy, aims));
        assert!(
            wait_for(Duration::from_secs(10), || depth(envoy, "batch") == 10.0),
            "A never filled the queue"
        );
        let b = volley(envoy, (0..3).map(|_| Aim::new("B", "batch")).collect());
        (a.join().expect("A's volley"), b)
    });
    assert_eq!(count(&b, 200, None), 3, "B is served: {b:?}");
    assert_eq!(count(&a, 200, None), 1 + 10 - 3, "{a:?}");
    assert_eq!(count(&a, 429, Some("queue_full")), 5 + 3, "{a:?}");
    assert_eq!(s.upstream.stats()["peak_in_flight"], 1);
    assert_eq!(depth(&s.envoy, "batch"), 0.0, "nothing left behind");
}

/// K spent its 3 requests a minute; while the model is busy, 20 more of
/// its requests are refused at once with its bucket's 429 (the next
/// request frees in 20 s, the same as its wait: no point in waiting), and
/// take no place: an innocent caller's 10 then find all 10 places. Before:
/// K's requests took the 10 places (to be refused at dispatch) and the
/// innocent caller got `queue_full`.
#[test]
fn a_caller_its_buckets_refuse_takes_no_place() {
    let s = stack_with_policy(WORKERS, policy(1), &[]);
    let spent = volley(&s.envoy, (0..3).map(|_| Aim::new("K", "capped")).collect());
    assert_eq!(count(&spent, 200, None), 3, "{spent:?}");
    let (k, innocent) = std::thread::scope(|scope| {
        let envoy = &s.envoy;
        let busy =
            scope.spawn(move || volley(envoy, vec![Aim::new("X", "batch").latency_ms(4_000)]));
        assert!(wait_for(Duration::from_secs(10), || in_flight(&s.upstream) == 1));
        let aims = (0..20).map(|_| Aim::new("K", "capped")).collect();
        let k = scope.spawn(move || volley(envoy, aims));
        // K is answered, or (before the fix) holds every place.
        assert!(wait_for(Duration::from_secs(10), || k.is_finished()
            || depth(envoy, "batch") == 10.0));
        let innocent = volley(envoy, (0..10).map(|_| Aim::new("I", "batch")).collect());
        busy.join().expect("X's volley");
        (k.join().expect("K's volley"), innocent)
    });
    assert_eq!(count(&k, 429, Some("user_rate_limit")), 20, "{k:?}");
    assert_eq!(count(&innocent, 200, None), 10, "{innocent:?}");
    assert_eq!(
        s.upstream.stats()["requests_total"],
        3 + 1 + 10,
        "none of K's 20 reached the upstream"
    );
}

const ADMIN_TOKEN: &str = "queue-fairness-test-admin-token-0123456789abcdef";

/// The simulated sidecar with an admin token, for the kill switch.
fn sidecar(dir: &std::path::Path) -> Sidecar {
    let path = |name: &str| dir.join(name).display().to_string();
    std::fs::write(dir.join("token"), format!("{ADMIN_TOKEN}\n")).expect("token file");
    std::fs::write(
        dir.join("sidecar.yaml"),
        "scrape_interval: 50ms\nsources: { gpu: simulated }\nrules: []\n",
    )
    .expect("sidecar config");
    let (config, token, state) = (path("sidecar.yaml"), path("token"), path("state.json"));
    Sidecar::start_with_args(&[
        "--simulate",
        "--config",
        &config,
        "--admin-token-file",
        &token,
        "--state-file",
        &state,
    ])
}

/// Six requests wait for the one slot of the model when the kill switch is
/// pulled (the sidecar's admin API): every one of them takes the ladder at
/// dispatch and is served by its provider rung, none by the primary, and
/// they do not wait for the primary's slot. The provider plays OpenAI: it
/// serves only its own model name and takes only its own key, so a queued
/// request that left without its rung's model, limit field or credentials
/// would be its 404 or 401. Before: they were dispatched to the primary
/// once the slot freed.
#[test]
fn the_kill_switch_reaches_queued_requests() {
    let primary = MockLlm::start("primary");
    // The key the shipped fallback route injects.
    let fallback = MockLlm::start_as_with_args(
        "fallback",
        sluice_tests::Personality::Openai,
        &[
            "--models",
            "gpt-4o-mini",
            "--api-key",
            "demo-fallback-credential",
        ],
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let sc = sidecar(dir.path());
    let mut cfg = shipped_config_for(&primary);
    cfg.set_cluster_addr("sluice_sidecar", sc.addr());
    cfg.set_cluster_addr("llm_fallback", fallback.addr());
    let mut p = policy(1);
    p["sidecar"] = json!({"cluster": "sluice_sidecar", "stale_after": "10s"});
    p["providers"] = json!({"openai": {
        "route": "fallback",
        "models": {MODEL: "gpt-4o-mini"},
        "limit_field": "max_completion_tokens",
        "prices": {"gpt-4o-mini": {"input": "0.15", "output": "0.60"}},
    }});
    p["ladder"] = json!(["openai"]);
    cfg.set_policy(&p);
    let envoy = Envoy::start(&cfg, WORKERS);
    assert!(
        wait_for(Duration::from_secs(10), || envoy
            .metric("sluice_sidecar_polls_total", &[])
            .unwrap_or(0.0)
            >= 1.0),
        "Envoy never polled the sidecar:\n{}",
        sc.log()
    );
    let requests = |m: &MockLlm| m.stats()["requests_total"].as_u64().unwrap_or(0);
    let (busy, queued) = std::thread::scope(|scope| {
        let envoy = &envoy;
        let busy =
            scope.spawn(move || volley(envoy, vec![Aim::new("A", "batch").latency_ms(6_000)]));
        assert!(wait_for(Duration::from_secs(10), || in_flight(&primary) == 1));
        let aims = (0..6)
            .map(|i| Aim::new(&format!("q{i}"), "batch"))
            .collect();
        let queued = scope.spawn(move || volley(envoy, aims));
        assert!(
            wait_for(Duration::from_secs(10), || depth(envoy, "batch") == 6.0),
            "the six never queued"
        );
        let answer = post_json(
            &sc.url("/v1/kill-switch"),
            &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            &json!({"active": true, "reason": "queue fairness test"}),
        )
        .ok()
        .json();
        assert_eq!(answer["kill_switch"]["active"], true, "{answer}");
        let queued = queued.join().expect("queued volley");
        // Served while the primary's one slot is still taken.
        assert_eq!(
            in_flight(&primary),
            1,
            "{}",
            get(&sc.url("/v1/state"), &[]).body
        );
        (busy.join().expect("busy volley"), queued)
    });
    assert_eq!(count(&busy, 200, None), 1, "{busy:?}");
    assert_eq!(count(&queued, 200, None), 6, "{queued:?}");
    assert_eq!(
        requests(&fallback),
        6,
        "the queued ones went to the provider"
    );
    let last = &fallback.stats()["last_request"];
    assert_eq!(last["body"]["model"], "gpt-4o-mini", "{last}");
    assert_eq!(last["body"]["max_completion_tokens"], 5, "{last}");
    assert!(last["body"].get("max_tokens").is_none(), "{last}");
    assert_eq!(
        last["headers"]["authorization"], "Bearer demo-fallback-credential",
        "{last}"
    );
    assert_eq!(requests(&primary), 1, "none of them reached the primary");
    assert_eq!(depth(&envoy, "batch"), 0.0);
}

/// 8 in flight under `concurrency: 8` (ending one after the other), then
/// a reload to 2 and 6 new requests: none of them goes while 2 or more
/// are in flight — every sample of the upstream with a new request in it
/// shows at most 2 in flight. Before: each old request that ended let a
/// new one go (the old policy's limit governed the slots it gave back).
#[test]
fn a_reload_that_lowers_concurrency_governs_requests_in_flight() {
    let mut s = stack_with_policy(WORKERS, policy(8), &[]);
    let old: Vec<Aim> = (0..8)
        .map(|i| Aim::new(&format!("o{i}"), "batch").latency_ms(3_000 + 300 * i))
        .collect();
    let samples = std::thread::scope(|scope| {
        let envoy = &s.envoy;
        let old = scope.spawn(move || volley(envoy, old));
        assert!(wait_for(Duration::from_secs(10), || in_flight(&s.upstream) == 8));
        s.config.set_policy(&policy(2));
        s.envoy.reload(&s.config).expect("reload accepted");
        let new: Vec<Aim> = (0..6)
            .map(|i| Aim::new(&format!("n{i}"), "batch").latency_ms(1_000))
            .collect();
        let new = scope.spawn(move || volley(envoy, new));
        let mut samples = Vec::new();
        while !(old.is_finished() && new.is_finished()) {
            let stats = s.upstream.stats();
            let total = stats["requests_total"].as_u64().unwrap_or(0);
            samples.push((total, stats["in_flight"].as_u64().unwrap_or(0)));
            std::thread::sleep(Duration::from_millis(20));
        }
        let old = old.join().expect("old volley");
        let new = new.join().expect("new volley");
        assert_eq!(count(&old, 200, None), 8, "{old:?}");
        assert_eq!(count(&new, 200, None), 6, "{new:?}");
        samples
    });
    let over: Vec<_> = samples
        .iter()
        .filter(|(total, in_flight)| *total > 8 && *in_flight > 2)
        .collect();
    assert!(
        over.is_empty(),
        "new requests went past the new limit: {over:?}"
    );
    assert!(samples.iter().any(|(total, _)| *total > 8), "{samples:?}");
    assert_eq!(s.upstream.stats()["requests_total"], 14);
}

/// 2 in flight and 10 queued under `concurrency: 2`, then a reload to 8:
/// the backlog drains at 8 at once (6 more go without waiting for a slot
/// to free), and never more. Before: it kept draining at 2.
#[test]
fn a_reload_that_raises_concurrency_drains_the_backlog_at_the_new_limit() {
    let mut s = stack_with_policy(WORKERS, policy(2), &[]);
    let aims: Vec<Aim> = (0..12)
        .map(|i| Aim::new(&format!("u{i}"), "batch").latency_ms(3_000))
        .collect();
    let shots = std::thread::scope(|scope| {
        let envoy = &s.envoy;
        let shots = scope.spawn(move || volley(envoy, aims));
        assert!(
            wait_for(Duration::from_secs(10), || depth(envoy, "batch") == 10.0),
            "the backlog never queued"
        );
        assert!(wait_for(Duration::from_secs(10), || in_flight(&s.upstream) == 2));
        s.config.set_policy(&policy(8));
        s.envoy.reload(&s.config).expect("reload accepted");
        assert!(
            wait_for(Duration::from_secs(10), || in_flight(&s.upstream) == 8),
            "the backlog did not drain at 8: {}",
            s.upstream.stats()
        );
        shots.join().expect("volley")
    });
    assert_eq!(count(&shots, 200, None), 12, "{shots:?}");
    assert_eq!(s.upstream.stats()["peak_in_flight"], 8);
}

/// Issue 29 item 5, the shipped policy (it declares API keys, so
/// undeclared callers together are entitled to half of every queue):
/// `mistral:7b` (2 in flight) is held by two slow calls, 150 one-request
/// anonymous addresses queue standard requests (100 places), and the
/// declared free key still gets a place and is served; the flood's
/// newest places went to it. Before: the flood held all 100 places and
/// the free key got 429 `queue_full`.
#[test]
fn an_anonymous_flood_leaves_a_declared_key_a_place() {
    use sluice_tests::org::client_from;
    let upstream = MockLlm::start("primary");
    let mut cfg = shipped_config_for(&upstream);
    // Room for a loaded machine: the flood takes a while to queue.
    cfg.policy_mut()["classes"]["standard"]["max_wait"] = serde_yaml::Value::from("50s");
    let envoy = Envoy::start(&cfg, WORKERS);
    let url = envoy.url("/v1/chat/completions");
    let chat = |client: &reqwest::blocking::Client, key: Option<&str>, latency: u64| {
        let mut req = client.post(&url).json(&json!({
            "model": "mistral:7b", "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}]}));
        if let Some(key) = key {
            req = req.header("x-api-key", key);
        }
        let resp = req
            .header("x-mock-latency-ms", latency.to_string())
            .send()
            .expect("POST to Envoy");
        let reason = resp
            .headers()
            .get("x-sluice-reason")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let queued = resp.headers().contains_key("x-sluice-queued-ms");
        (resp.status().as_u16(), reason, queued)
    };
    let depth = || {
        envoy
            .metric(
                "sluice_queue_depth",
                &[("model", "mistral:7b"), ("class", "standard")],
            )
            .unwrap_or(0.0)
    };
    let (declared, flood) = std::thread::scope(|scope| {
        let chat = &chat;
        // pro: the interactive class, which never queues.
        let slow: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(move || chat(&client_from("127.0.0.1"), Some("demo-pro-key"), 15_000))
            })
            .collect();
        assert!(
            wait_for(Duration::from_secs(10), || in_flight(&upstream) == 2),
            "the slow calls never reached the upstream"
        );
        let flood: Vec<_> = (0..150u32)
            .map(|a| {
                let from = format!("127.0.{}.{}", 1 + a / 250, 1 + a % 250);
                scope.spawn(move || chat(&client_from(&from), None, 0))
            })
            .collect();
        assert!(
            wait_for(Duration::from_secs(20), || depth() == 100.0),
            "the flood never filled the queue (depth {})",
            depth()
        );
        assert_eq!(
            in_flight(&upstream),
            2,
            "the slow calls still hold both slots"
        );
        let declared = chat(&client_from("127.0.0.1"), Some("demo-free-key"), 0);
        for s in slow {
            assert_eq!(s.join().expect("slow call").0, 200);
        }
        let flood: Vec<_> = flood
            .into_iter()
            .map(|t| t.join().expect("flood"))
            .collect();
        (declared, flood)
    });
    let of = |status: u16, reason: Option<&str>| {
        flood
            .iter()
            .filter(|(s, r, _)| *s == status && r.as_deref() == reason)
            .count()
    };
    eprintln!(
        "anonymous flood of 150: {} served, {} queue_full, {} model_rate_limit; declared: {declared:?}",
        of(200, None),
        of(429, Some("queue_full")),
        of(429, Some("model_rate_limit")),
    );
    assert_eq!(
        declared.0, 200,
        "the declared key got a place: {declared:?}"
    );
    assert!(declared.2, "it waited in the queue: {declared:?}");
    assert!(
        of(429, Some("queue_full")) >= 50,
        "the flood held more than its half of the places"
    );
}
