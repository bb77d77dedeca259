//! Provider faults against the shipped config (`envoy/sluice.yaml` as it
//! is: ports changed, the rung's demo budget raised so no test spends it,
//! and where a test would wait minutes, the one timeout it waits on scaled
//! down and named): each scripted fault of a fake provider, and what a
//! careful operator expects the caller to get — rescued by the next rung
//! of the ladder, or a clean, bounded error where nothing can rescue an
//! answer that has started.
//!
//! Upstreams: mock-llm's own personality (`Personality::Mock`, OpenAI's
//! shapes) as the primary, failing as its server-wide scripted fault says
//! (`--fault`, `PUT /admin/fault`), and a second mock-llm as the `openai`
//! rung (the shipped route `fallback`).

use std::io::Read;
use std::time::{Duration, Instant};

use serde_json::json;
use serde_yaml::Value as Yaml;
use sluice_tests::{http_client, post_json, Envoy, EnvoyConfig, MockLlm, Response};

struct Faulty {
    primary: MockLlm,
    fallback: MockLlm,
    envoy: Envoy,
}

/// The shipped config with the primary and the rung at these mocks.
fn shipped(primary: &MockLlm, fallback: &MockLlm) -> EnvoyConfig {
    let mut cfg = EnvoyConfig::load_shipped();
    cfg.set_cluster_addr("llm_upstream", primary.addr());
    cfg.set_cluster_addr("llm_fallback", fallback.addr());
    cfg.set_cluster_addr("sluice_sidecar", sluice_tests::closed_addr());
    cfg.policy_mut()["providers"]["openai"]["daily_spend"]["limit"] = Yaml::from(100);
    cfg
}

/// The primary's route in `cfg` (the shipped catch-all).
fn primary_route(cfg: &mut EnvoyConfig) -> &mut Yaml {
    let routes = &mut cfg.hcm_mut()["route_config"]["virtual_hosts"][0]["routes"];
    let last = routes.as_sequence().map_or(0, |r| r.len()) - 1;
    &mut routes[last]["route"]
}

fn faulty_with(fault: &str, edit: impl FnOnce(&mut EnvoyConfig)) -> Faulty {
    let primary = MockLlm::start_with_args("primary", &["--fault", fault]);
    let fallback = MockLlm::start("fallback");
    let mut cfg = shipped(&primary, &fallback);
    edit(&mut cfg);
    let envoy = Envoy::start(&cfg, 2);
    Faulty {
        primary,
        fallback,
        envoy,
    }
}

fn faulty(fault: &str) -> Faulty {
    faulty_with(fault, |_| {})
}

fn body(stream: bool) -> serde_json::Value {
    json!({"model": "llama3.1:8b", "max_tokens": 20, "stream": stream,
           "messages": [{"role": "user", "content": "hello there"}]})
}

fn chat(f: &Faulty) -> Response {
    post_json(
        &f.envoy.url("/v1/chat/completions"),
        &[("x-api-key", "demo-pro-key")],
        &body(false),
    )
}

/// A streamed chat read to its end or its break: status, headers, the
/// bytes that came, and whether the stream broke (reset, not ended).
struct Streamed {
    status: u16,
    provider: Option<String>,
    failed: Option<String>,
    text: String,
    broke: bool,
}

fn stream(f: &Faulty) -> Streamed {
    let resp = http_client()
        .post(f.envoy.url("/v1/chat/completions"))
        .header("x-api-key", "demo-pro-key")
        .header("content-type", "application/json")
        .body(body(true).to_string())
        .send()
        .expect("the answer's headers come");
    let header = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (status, provider, failed) = (
        resp.status().as_u16(),
        header("x-sluice-provider"),
        header("x-sluice-failed"),
    );
    let mut resp = resp;
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    let broke = loop {
        match resp.read(&mut buf) {
            Ok(0) => break false,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(_) => break true,
        }
    };
    Streamed {
        status,
        provider,
        failed,
        text: String::from_utf8_lossy(&bytes).into_owned(),
        broke,
    }
}

fn served_by(r: &Response) -> Option<&str> {
    r.header("x-mock-name")
}

fn requests(m: &MockLlm) -> u64 {
    m.stats()["requests_total"].as_u64().unwrap_or(0)
}

/// Rescued: the rung's answer, naming it and the failures before it.
fn assert_rescued(r: &Response, failed: &str) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(served_by(r), Some("fallback"), "{r:?}");
    assert_eq!(r.header("x-sluice-provider"), Some("openai"), "{r:?}");
    assert_eq!(r.header("x-sluice-failed"), Some(failed), "{r:?}");
    assert_eq!(r.json()["model"], "gpt-4o-mini", "the rung's model answers");
}

/// Served by the primary, nothing failed over.
fn assert_primary(r: &Response) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(served_by(r), Some("primary"), "{r:?}");
    assert_eq!(r.header("x-sluice-failed"), None, "{r:?}");
}

fn metric(f: &Faulty, name: &str, labels: &[(&str, &str)]) -> f64 {
    f.envoy.metric(name, labels).unwrap_or(0.0)
}

#[test]
fn a_persistent_503_is_rescued_by_the_next_rung() {
    let f = faulty("503");
    assert_rescued(&chat(&f), "primary=503");
    // Envoy tried the primary twice (a retry on 503), the rung once.
    assert_eq!((requests(&f.primary), requests(&f.fallback)), (2, 1));
}

#[test]
fn a_persistent_429_without_retry_after_is_pushback_and_rescued() {
    let f = faulty("429");
    assert_rescued(&chat(&f), "primary=429");
    assert_eq!(
        metric(
            &f,
            "sluice_upstream_pauses_total",
            &[("kind", "credential")]
        ),
        1.0,
        "a 429 without Retry-After pauses the caller's credential"
    );
    // Paused: the next request goes to the rung before dispatch.
    let before = requests(&f.primary);
    let r = chat(&f);
    assert_eq!((r.status, served_by(&r)), (200, Some("fallback")), "{r:?}");
    assert_eq!(r.header("x-sluice-failed"), None, "{r:?}");
    assert_eq!(requests(&f.primary), before, "the paused primary is spared");
}

#[test]
fn a_429_once_with_retry_after_is_retried_after_it_by_envoy() {
    let f = faulty("429:retry_after=1,times=1");
    let started = Instant::now();
    let r = chat(&f);
    assert_primary(&r);
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "the retry waited the provider's Retry-After ({:?})",
        started.elapsed()
    );
    assert_eq!(requests(&f.fallback), 0);
}

#[test]
fn a_429_with_a_long_retry_after_pauses_the_route_and_is_rescued() {
    let f = faulty("429:retry_after=30");
    assert_rescued(&chat(&f), "primary=429");
    let r = chat(&f);
    assert_eq!((r.status, served_by(&r)), (200, Some("fallback")), "{r:?}");
}

#[test]
fn a_500_once_is_rescued_and_the_primary_serves_the_next() {
    let f = faulty("500:times=1");
    assert_rescued(&chat(&f), "primary=500");
    assert_primary(&chat(&f));
}

#[test]
fn a_reset_before_the_headers_is_retried_then_rescued() {
    let f = faulty("reset");
    let r = chat(&f);
    assert_rescued(&r, "primary=503");
    assert_eq!(requests(&f.fallback), 1);
}

#[test]
fn a_provider_that_never_answers_is_abandoned_and_rescued() {
    // The shipped per-try timeout is 120 s; 1 s here, so the test does
    // not wait four minutes (Envoy tries twice).
    let f = faulty_with("hang", |cfg| {
        primary_route(cfg)["retry_policy"]["per_try_timeout"] = Yaml::from("1s");
    });
    let started = Instant::now();
    let r = chat(&f);
    let took = started.elapsed();
    assert_rescued(&r, "primary=504");
    assert!(took < Duration::from_secs(10), "rescued in {took:?}");
    eprintln!("time to rescue from a provider that never answers (1 s per try): {took:?}");
}

#[test]
fn a_slow_first_token_is_waited_for() {
    let f = faulty("slow_first_token:ms=2000");
    let r = chat(&f);
    assert_primary(&r);
    let s = stream(&f);
    assert_eq!((s.status, s.broke), (200, false));
    assert!(s.text.contains("[DONE]"), "{}", s.text);
}

#[test]
fn a_failed_stream_is_rescued_whole_before_its_first_byte() {
    let f = faulty("503");
    let s = stream(&f);
    assert_eq!(s.status, 200, "{}", s.text);
    assert_eq!(s.provider.as_deref(), Some("openai"));
    assert_eq!(s.failed.as_deref(), Some("primary=503"));
    assert!(!s.broke);
    assert!(s.text.contains("gpt-4o-mini"), "{}", s.text);
    assert!(s.text.trim_end().ends_with("data: [DONE]"), "{}", s.text);
}

#[test]
fn a_stream_cut_after_it_started_breaks_cleanly_and_counts_as_a_failure() {
    let f = faulty("stream_cut:after=2");
    for _ in 0..3 {
        let s = stream(&f);
        assert_eq!(s.status, 200);
        assert!(s.broke, "the caller sees the break: {}", s.text);
        assert!(s.text.starts_with("data: "), "{}", s.text);
    }
    // Three broken streams opened the primary's breaker (the shipped
    // `min_callers: 1`): the next request goes to the rung.
    assert_eq!(metric(&f, "sluice_error_breaker_opened_total", &[]), 1.0);
    let r = chat(&f);
    assert_eq!((r.status, served_by(&r)), (200, Some("fallback")), "{r:?}");
}

#[test]
fn a_stalled_stream_is_reset_by_the_idle_timeout() {
    // The shipped idle timeouts are 60 s; 1 s here.
    let f = faulty_with("stream_stall:after=2", |cfg| {
        let route = primary_route(cfg);
        route["idle_timeout"] = Yaml::from("1s");
        route["retry_policy"]["per_try_idle_timeout"] = Yaml::from("1s");
    });
    let started = Instant::now();
    let s = stream(&f);
    assert_eq!(s.status, 200);
    assert!(s.broke, "{}", s.text);
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_malformed_chunk_or_a_stream_without_done_still_ends_and_is_settled() {
    for fault in ["malformed_chunk:after=1", "no_done"] {
        let f = faulty(fault);
        let s = stream(&f);
        assert_eq!((s.status, s.broke), (200, false), "{fault}: {}", s.text);
        assert!(s.text.contains("data: "), "{fault}: {}", s.text);
        let settled = metric(&f, "sluice_input_source_total", &[("kind", "reported")])
            + metric(&f, "sluice_input_source_total", &[("kind", "bounded")])
            + metric(&f, "sluice_input_source_total", &[("kind", "estimated")]);
        assert_eq!(settled, 1.0, "{fault}: settled once");
    }
}

#[test]
fn the_callers_own_400s_reach_it_and_are_never_sent_to_a_rung() {
    for (fault, code) in [
        ("context_length", "context_length_exceeded"),
        ("content_filter", "content_filter"),
    ] {
        let f = faulty(fault);
        let r = chat(&f);
        assert_eq!(r.status, 400, "{fault}: {r:?}");
        assert_eq!(r.json()["error"]["code"], code, "{fault}");
        assert_eq!(requests(&f.fallback), 0, "{fault}");
    }
}

#[test]
fn a_rescue_is_billed_once_at_the_rungs_prices_and_the_failure_never() {
    let f = faulty("502");
    let r = chat(&f);
    assert_rescued(&r, "primary=502");
    let usage = &r.json()["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0, "{usage}");
    let spent = metric(
        &f,
        "sluice_provider_spend_micros_total",
        &[("provider", "openai")],
    );
    assert!(spent > 0.0, "billed at the rung's prices");
    assert_eq!(
        metric(&f, "sluice_spend_micros_total", &[]),
        spent,
        "nothing else billed"
    );
    assert_eq!(metric(&f, "sluice_reservations_outstanding", &[]), 0.0);
    assert_eq!(
        metric(&f, "sluice_failover_total", &[("outcome", "rescued")]),
        1.0
    );
}

#[test]
fn a_primary_down_for_a_while_serves_every_caller_and_gets_its_traffic_back() {
    // Down for 3 s (a minute, scaled), then back.
    let f = faulty("503:for_ms=3000");
    let started = Instant::now();
    let mut served = 0;
    while started.elapsed() < Duration::from_secs(4) {
        let r = chat(&f);
        assert_eq!(r.status, 200, "{r:?}");
        served += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(served >= 10, "{served}");
    // The breaker's cooldown (10 s as shipped) ends, a probe finds the
    // primary back, and the primary serves again.
    let back = sluice_tests::wait_for(Duration::from_secs(20), || {
        let r = chat(&f);
        assert_eq!(r.status, 200, "{r:?}");
        served_by(&r) == Some("primary")
    });
    assert!(back, "traffic returned to the primary");
}

#[test]
fn a_marker_a_client_sends_is_removed_and_its_request_admitted() {
    let f = faulty("none");
    let r = post_json(
        &f.envoy.url("/v1/chat/completions"),
        &[
            ("x-api-key", "demo-pro-key"),
            ("x-sluice-attempt", "0123456789abcdef0123456789abcdef"),
            ("x-sluice-upstream", "fallback"),
        ],
        &body(false),
    );
    assert_primary(&r);
    assert_eq!(
        metric(
            &f,
            "sluice_requests_total",
            &[("decision", "admit"), ("tier", "pro")]
        ),
        1.0,
        "admitted and counted like any request"
    );
}

#[test]
fn a_rung_that_fails_too_ends_at_the_static_answer_not_a_raw_503() {
    let primary = MockLlm::start_with_args("primary", &["--fault", "503"]);
    let fallback = MockLlm::start_with_args("fallback", &["--fault", "reset"]);
    let envoy = Envoy::start(&shipped(&primary, &fallback), 2);
    let f = Faulty {
        primary,
        fallback,
        envoy,
    };
    let r = chat(&f);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-sluice-degraded"), Some("static"), "{r:?}");
    assert_eq!(
        r.header("x-sluice-failed"),
        Some("primary=503,openai=503"),
        "{r:?}"
    );
    assert!(r.body.contains("temporarily unavailable"), "{}", r.body);
    assert_eq!(
        metric(&f, "sluice_failover_total", &[("outcome", "static")]),
        1.0
    );
}

#[test]
fn a_servers_context_length_refusal_goes_to_the_overflow_model() {
    let f = faulty_with("context_length:times=1", |cfg| {
        let models = &mut cfg.policy_mut()["models"];
        models["llama3.1:8b"]["context_length"] = Yaml::from(100_000);
        models["llama3.1:8b"]["overflow"] = Yaml::from("llama3.1:70b");
        models["llama3.1:70b"]["context_length"] = Yaml::from(200_000);
    });
    let r = chat(&f);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(served_by(&r), Some("primary"), "{r:?}");
    assert_eq!(r.header("x-mock-model"), Some("llama3.1:70b"), "{r:?}");
    assert_eq!(r.header("x-sluice-failed"), Some("primary=400"), "{r:?}");
    assert_eq!(requests(&f.fallback), 0);
}

/// Latencies of `n` chat requests, each one after the other, in ms,
/// sorted; every one must be answered 200.
fn latencies(f: &Faulty, n: usize) -> Vec<f64> {
    let mut out: Vec<f64> = (0..n)
        .map(|_| {
            let t0 = Instant::now();
            let r = chat(f);
            assert_eq!(r.status, 200, "{r:?}");
            t0.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

fn pct(v: &[f64], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// `bench/failover.sh`: the time to rescue a request from a dead primary
/// (nothing listens: a connect failure), against the floor of a healthy
/// primary measured in the same run, with the shipped config: per request
/// while the breaker is held closed, without Envoy's retry (the failover
/// alone) and with it (every request pays Envoy's retry back-off and the
/// failover), and as shipped (after three failures the breaker opens
/// and the rung is chosen before dispatch).
#[test]
#[ignore]
fn bench_time_to_rescue_a_dead_primary() {
    const N: usize = 40;
    let floor = faulty("none");
    let healthy = latencies(&floor, N);
    drop(floor);
    let dead = |failures_to_open: u64, retries: bool| {
        let primary = MockLlm::start("primary");
        let fallback = MockLlm::start("fallback");
        let mut cfg = shipped(&primary, &fallback);
        if !retries {
            sluice_tests::without_retries(&mut cfg);
        }
        cfg.set_cluster_addr("llm_upstream", sluice_tests::closed_addr());
        cfg.policy_mut()["protection"]["failures_to_open"] = Yaml::from(failures_to_open);
        let envoy = Envoy::start(&cfg, 2);
        let f = Faulty {
            primary,
            fallback,
            envoy,
        };
        latencies(&f, N)
    };
    let no_retry = dead(1_000, false);
    let held_closed = dead(1_000, true);
    let shipped_breaker = dead(3, true);
    let mut report = String::from(
        "failover bench: dead primary (connect refused), shipped envoy/sluice.yaml, 40 sequential requests each\n",
    );
    report.push_str(
        "case                                   p50 ms   p90 ms   max ms   p50 / floor\n",
    );
    let base = pct(&healthy, 0.5);
    for (name, v) in [
        ("healthy primary (floor)", &healthy),
        ("dead primary, no Envoy retry, held", &no_retry),
        ("dead primary, breaker held closed", &held_closed),
        ("dead primary, shipped breaker", &shipped_breaker),
    ] {
        report.push_str(&format!(
            "{name:<38} {:>6.1}   {:>6.1}   {:>6.1}   {:>6.2}x\n",
            pct(v, 0.5),
            pct(v, 0.9),
            pct(v, 1.0),
            pct(v, 0.5) / base
        ));
    }
    let path = sluice_tests::repo_root().join("target/failover-bench.txt");
    std::fs::write(&path, &report).expect("write the figures");
    println!("{report}");
}
