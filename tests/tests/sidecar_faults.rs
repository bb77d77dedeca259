//! A faulty environment, as the on-call engineer meets it (issue 29, item
//! 13), against the real sidecar binary: a Redis it cannot use (nothing
//! listening, no or a wrong password, TLS to a plain port) is logged once
//! per outage with the reason and a hint, never the password, and counted
//! in `/metrics`; a hung embeddings endpoint costs one timeout, then
//! semantic lookups miss at once; a sidecar without NVML says so at error
//! level, in `/metrics` and on the operator page, and fakes no GPU.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`), only behind
//! the Envoy of the embeddings test; the faults are the sidecar's.

use std::fs;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_core::bench::sha256_hex;
use sluice_tests::fleet::{policy, salted, Redis};
use sluice_tests::{
    get, post_json, prometheus_value, shipped_config_for, wait_for, Envoy, MockLlm, Sidecar,
};

fn metric(sc: &Sidecar, name: &str, labels: &[(&str, &str)]) -> f64 {
    prometheus_value(&get(&sc.url("/metrics"), &[]).body, name, labels).unwrap_or(0.0)
}

/// A sidecar that is a fleet agent for `redis_url` (`extra`: more lines
/// under `fleet:`), with the simulated GPU.
fn fleet_sidecar(dir: &tempfile::TempDir, redis_url: &str, extra: &str) -> Sidecar {
    let d = dir.path();
    let p = salted(&policy(
        "default_tier: free\nidentity: { sources: [client_address] }\n\
         tiers: { free: { requests: 3/day } }\n\
         sidecar: { cluster: sluice_sidecar }\n\
         fleet: { expected_replicas: 1 }\n",
    ));
    fs::write(
        d.join("policy.json"),
        serde_json::to_string(&p).expect("JSON"),
    )
    .expect("policy");
    fs::write(d.join("fleet-secret"), "sidecar-faults-fleet-secret-0123").expect("secret");
    let config = d.join("sidecar.yaml");
    fs::write(
        &config,
        format!(
            "fleet:\n  redis: {redis_url}\n  timeout: 300ms\n  sync_interval: 50ms\n  \
             policy: {}\n  secret_file: {}\n{extra}",
            d.join("policy.json").display(),
            d.join("fleet-secret").display()
        ),
    )
    .expect("config");
    Sidecar::start_with_args(&["--simulate", "--config", &config.display().to_string()])
}

/// Waits until the sidecar has failed `n` Redis calls; the log lines that
/// report an outage.
fn outage_lines(sc: &Sidecar, n: f64) -> Vec<String> {
    assert!(
        wait_for(Duration::from_secs(20), || metric(
            sc,
            "sluice_sidecar_redis_errors_total",
            &[]
        ) >= n),
        "fewer than {n} failed Redis calls:\n{}",
        sc.log()
    );
    sc.log()
        .lines()
        .filter(|l| l.contains("fleet: error: Redis"))
        .map(String::from)
        .collect()
}

/// Nothing listening, then Redis comes up there: one line for the outage
/// (with its reason and what to check) however many calls failed, one when
/// it answers; `sluice_sidecar_redis_up` and `_errors_total` follow.
#[test]
fn a_redis_outage_is_logged_once_with_its_reason_and_its_end() {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("redis://127.0.0.1:{port}");
    let sc = fleet_sidecar(&dir, &url, "");
    let lines = outage_lines(&sc, 10.0);
    assert_eq!(lines.len(), 1, "one line per outage:\n{}", sc.log());
    assert!(
        lines[0].contains(&format!("Redis {url} unavailable"))
            && lines[0].contains("Connection refused")
            && lines[0].contains("nothing listens there"),
        "{}",
        lines[0]
    );
    assert_eq!(metric(&sc, "sluice_sidecar_redis_up", &[]), 0.0);

    let _redis = Redis::start_on(port);
    assert!(
        wait_for(Duration::from_secs(20), || metric(
            &sc,
            "sluice_sidecar_redis_up",
            &[]
        ) == 1.0),
        "{}",
        sc.log()
    );
    let log = sc.log();
    assert!(log.contains("answers again (after "), "{log}");
    assert_eq!(
        log.matches("fleet: error: Redis").count(),
        1,
        "nothing more: {log}"
    );
}

/// A Redis that wants a password: without one, and with a wrong one, the
/// reason and the field to fix are logged, never a password.
#[test]
fn a_missing_or_wrong_redis_password_is_named_never_shown() {
    let redis = Redis::start();
    let password = "the-redis-password-0123456789";
    redis
        .command(&["CONFIG", "SET", "requirepass", password])
        .expect("CONFIG SET requirepass");
    let wrong = "not-the-redis-password-987654";
    for (extra, says) in [
        ("", "Redis wants a password: set fleet.password_file"),
        (
            "  password_file: PASSWORD\n",
            "Redis refused the password: check fleet.password_file",
        ),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("redis-password");
        fs::write(&file, wrong).expect("password file");
        let extra = extra.replace("PASSWORD", &file.display().to_string());
        let sc = fleet_sidecar(&dir, &redis.url(), &extra);
        let lines = outage_lines(&sc, 5.0);
        assert_eq!(lines.len(), 1, "{}", sc.log());
        assert!(lines[0].contains(says), "{}", lines[0]);
        let log = sc.log();
        assert!(
            !log.contains(password) && !log.contains(wrong),
            "a password in the log:\n{log}"
        );
    }
}

/// TLS (`rediss://`) to a plain Redis port: Redis reads the handshake as
/// an unfinished command and never answers; the timeout is named, with the
/// hint that the port may be plain text. (Plain text to a TLS port, a CA
/// that does not sign the server's certificate: the sidecar's unit test
/// `rediss_with_a_ca_file_and_a_password_file`, on a TLS redis-server.)
#[test]
fn tls_to_a_plain_redis_port_is_named() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let sc = fleet_sidecar(&dir, &format!("rediss://localhost:{}", redis.port), "");
    let lines = outage_lines(&sc, 3.0);
    assert_eq!(lines.len(), 1, "{}", sc.log());
    assert!(
        lines[0].contains("connect timed out")
            && lines[0].contains("TLS (`rediss://`) to a plain port"),
        "{}",
        lines[0]
    );
}

/// A listener that accepts connections and holds them, never reading or
/// answering (a hung endpoint); the connections it took.
fn hung_endpoint() -> (SocketAddr, Arc<Mutex<Vec<TcpStream>>>) {
    let hung = TcpListener::bind("127.0.0.1:0").expect("listener");
    let addr = hung.local_addr().expect("addr");
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = held.clone();
    std::thread::spawn(move || {
        for conn in hung.incoming().flatten() {
            keep.lock().expect("lock").push(conn);
        }
    });
    (addr, held)
}

/// An embeddings endpoint that accepts connections and never answers
/// (hung): the first semantic lookup waits the timeout, then lookups miss
/// at once while it stays out (one probe per pause); logged once, skips
/// counted. Before, every miss waited the whole timeout.
#[test]
fn a_hung_embeddings_endpoint_costs_one_timeout_not_every_miss() {
    let (addr, held) = hung_endpoint();
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("sidecar.yaml");
    let timeout = Duration::from_secs(3);
    fs::write(
        &config,
        format!(
            "cache:\n  backend: memory\n  embeddings: {{url: \"http://{addr}/v1/embeddings\", \
             model: e, timeout: {}s}}\n",
            timeout.as_secs()
        ),
    )
    .expect("config");
    let sc = Sidecar::start_with_args(&["--simulate", "--config", &config.display().to_string()]);
    let lookup = |i: usize| {
        let started = Instant::now();
        let r = post_json(
            &sc.url("/v1/cache/lookup"),
            &[],
            &json!({"key": sha256_hex(format!("never stored {i}").as_bytes()), "model": "m",
                    "semantic": {"context": sha256_hex(b"team:a/m"),
                                 "text": format!("How do I enable 2FA, take {i}?")}}),
        );
        assert_eq!(r.status, 200, "{r:?}");
        assert!(r.json()["hit"].is_null(), "{r:?}");
        started.elapsed()
    };
    let first = lookup(0);
    assert!(first >= timeout, "the first lookup waited {first:?}");
    // Within the first pause (1 s) all of them skip; a machine slow enough
    // to pass it meets one probe (3 s), then a 2 s pause: at most two more
    // waits, where every lookup waited before.
    let n = 20;
    let took: Vec<Duration> = (1..=n).map(lookup).collect();
    let slow = took.iter().filter(|t| **t >= timeout).count();
    assert!(
        slow <= 2,
        "{slow} of {n} lookups waited the timeout: {took:?}\n{}",
        sc.log()
    );
    let calls = held.lock().expect("lock").len();
    assert!(calls <= 1 + slow, "{calls} calls reached the endpoint");
    let skipped = metric(&sc, "sluice_sidecar_cache_embedding_skipped_total", &[]);
    assert!(skipped >= (n - slow) as f64, "skipped {skipped}");
    let log = sc.log();
    assert_eq!(
        log.matches("the embeddings endpoint is out").count(),
        1,
        "{log}"
    );
    println!(
        "hung embeddings endpoint: first lookup {first:?}, then {n} lookups in {:?} \
         (slowest {:?}), {calls} call(s) reached it, {skipped} skipped",
        took.iter().sum::<Duration>(),
        took.iter().max()
    );
}

/// The same through Envoy, where the filter waits `lookup_timeout` (100 ms)
/// and drops the lookup while the sidecar still waits for the endpoint:
/// the abandoned call counts as the endpoint out, so the next lookups and
/// stores skip it instead of each holding a call to the hung endpoint (and
/// the request its 100 ms). Every request is served by the upstream.
#[test]
fn through_envoy_an_abandoned_embedding_pauses_the_hung_endpoint() {
    let (addr, held) = hung_endpoint();
    let upstream = MockLlm::start("primary");
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("sidecar.yaml");
    fs::write(
        &config,
        format!(
            "cache:\n  backend: memory\n  embeddings: {{url: \"http://{addr}/v1/embeddings\", \
             model: e, timeout: 30s}}\n"
        ),
    )
    .expect("config");
    let sc = Sidecar::start_with_args(&["--simulate", "--config", &config.display().to_string()]);
    let mut cfg = shipped_config_for(&upstream);
    cfg.policy_mut()["cache"] = serde_yaml::to_value(json!({
        "salt": "sidecar-faults-cache-salt-0123456789",
        "in_envoy": {"slots": 0},
        "models": {"mistral:7b": {"exact": true, "semantic": true}},
    }))
    .expect("YAML");
    cfg.set_cluster_addr("sluice_sidecar", sc.addr());
    let envoy = Envoy::start(&cfg, 1);
    let started = Instant::now();
    let n = 10;
    for i in 0..n {
        let body = json!({"model": "mistral:7b", "max_tokens": 8, "messages": [
            {"role": "user", "content": format!("How do I enable 2FA, take {i}?")}]});
        let r = post_json(
            &envoy.url("/v1/chat/completions"),
            &[("x-api-key", "demo-pro-key")],
            &body,
        );
        assert_eq!(r.status, 200, "{r:?}");
    }
    let took = started.elapsed();
    assert!(
        wait_for(Duration::from_secs(10), || sc
            .log()
            .contains("the lookup was abandoned before it answered")),
        "{}",
        sc.log()
    );
    let calls = held.lock().expect("lock").len();
    // One call per pause at most (1 s, 2 s, 4 s …) while the requests ran,
    // against two per request (lookup and store) before.
    let pauses = 2 + usize::try_from(took.as_secs()).unwrap_or(usize::MAX);
    assert!(
        calls <= pauses.min(n),
        "{calls} calls reached the hung endpoint in {took:?}\n{}",
        sc.log()
    );
    let skipped = metric(&sc, "sluice_sidecar_cache_embedding_skipped_total", &[]);
    assert!(skipped >= 1.0, "skipped {skipped}");
    assert_eq!(
        sc.log().matches("the embeddings endpoint is out").count(),
        1,
        "{}",
        sc.log()
    );
    println!(
        "through Envoy: {n} requests in {took:?}; {calls} call(s) reached the hung endpoint, \
         {skipped} embeddings skipped"
    );
}

/// Without NVML and without `--simulate`, the sidecar says so at error
/// level, shows it in `/metrics` (`gpu_source_missing`) and on the
/// operator page, and runs with no GPU source: no made-up readings, no
/// `/v1/simulate`. On a host with NVML it reads the real GPUs instead.
#[test]
fn a_sidecar_without_nvml_says_so_and_fakes_no_gpu() {
    let sc = Sidecar::start();
    if metric(&sc, "sluice_sidecar_nvml_available", &[]) == 1.0 {
        assert_eq!(metric(&sc, "sluice_sidecar_gpu_source_missing", &[]), 0.0);
        assert_eq!(
            metric(&sc, "sluice_sidecar_gpu_source_info", &[("source", "nvml")]),
            1.0
        );
        println!("NVML is loaded here: the real GPUs are read");
        return;
    }
    let log = sc.log();
    assert!(
        log.contains("sluice-sidecar: error: no NVML") && log.contains("--simulate"),
        "{log}"
    );
    assert_eq!(metric(&sc, "sluice_sidecar_gpu_source_missing", &[]), 1.0);
    assert_eq!(
        metric(&sc, "sluice_sidecar_gpu_source_info", &[("source", "none")]),
        1.0
    );
    assert_eq!(get(&sc.url("/v1/simulate"), &[]).status, 404);
    let h = get(&sc.url("/v1/history"), &[]).ok().json();
    assert!(
        h["gpu_missing"]
            .as_str()
            .is_some_and(|m| m.starts_with("no NVML")),
        "{h}"
    );
    assert!(h["gpu_source"].is_null(), "{h}");
    let js = get(&sc.url("/page.js"), &[]).ok().body;
    assert!(js.contains("No GPU source: "), "the page shows it");
    // Asked for, the simulated GPU still runs (the demo and the tests).
    let sim = Sidecar::start_with_args(&["--simulate"]);
    assert_eq!(metric(&sim, "sluice_sidecar_gpu_source_missing", &[]), 0.0);
    assert_eq!(get(&sim.url("/v1/simulate"), &[]).status, 200);
}
