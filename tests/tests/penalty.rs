//! The penalty box and cheap refusals through a real Envoy (issue 18
//! items 3, 6, 7, 8): a flood of one-shot addresses blocks no newcomer;
//! IPv6 callers count by prefix; failed authentication counts; a reload
//! that changes `abuse.slots` keeps a block and a count; a spent key's
//! large bodies are refused before they are sent.
//!
//! Thresholds are per hour, so that no period ends within a test however
//! slow the machine (the box's periods start at a sub-sketch's first
//! request, which may be one of the flood's).
//!
//! Distinct addresses come from `x-forwarded-for`: the tests' Envoy trusts
//! one hop (`xff_num_trusted_hops: 1`), so the rightmost entry is the
//! client address sluice reads (`source.address`), IPv6 included.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the penalty box
//! is sluice's, whatever server answers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serde_yaml::Value as Yaml;
use sluice_tests::{client_builder, EnvoyConfig, Response, Stack};

fn yaml(v: Value) -> Yaml {
    serde_yaml::to_value(v).expect("yaml")
}

/// The shipped policy with the box at `abuse`, callers' own buckets out of
/// the way, and one trusted forwarding hop.
fn start_with(abuse: Value, edit: impl FnOnce(&mut EnvoyConfig)) -> Stack {
    Stack::start(|cfg| {
        cfg.hcm_mut()["xff_num_trusted_hops"] = Yaml::from(1);
        let policy = cfg.policy_mut();
        policy["abuse"] = yaml(abuse);
        policy["tiers"]["free"] = yaml(json!({"requests": "1000000/min"}));
        edit(cfg);
    })
}

fn start(abuse: Value) -> Stack {
    start_with(abuse, |_| {})
}

/// `GET /v1/models` as `from` (fresh connection: after a reload it meets
/// the new listener).
fn models_from(stack: &Stack, from: &str, headers: &[(&str, &str)]) -> Response {
    let client = client_builder().build().expect("client");
    let mut req = client
        .get(stack.envoy.url("/v1/models"))
        .header("x-forwarded-for", from);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().expect("send");
    Response {
        status: resp.status().as_u16(),
        headers: resp.headers().clone(),
        body: resp.text().unwrap_or_default(),
    }
}

/// Status and the start of the body (an upstream answer to a 1 MB body
/// is tens of MB).
fn brief(r: &Response) -> String {
    let body: String = r.body.chars().take(300).collect();
    format!("{} {body}", r.status)
}

fn reason(r: &Response) -> Option<&str> {
    r.header("x-sluice-reason")
}

fn counter(stack: &Stack, name: &str, labels: &[(&str, &str)]) -> f64 {
    stack.envoy.metric(name, labels).unwrap_or(0.0)
}

/// Issue 18 item 6: 6,000 one-request addresses filled the 4,096 slots and
/// the shared overflow record then refused every first-time caller.
#[test]
fn a_flood_of_one_shot_addresses_blocks_no_newcomer() {
    let stack = start(json!({"threshold": "60/h", "block_for": "10m"}));
    let client = client_builder().build().expect("client");
    let url = stack.envoy.url("/v1/models");
    let mut refused = 0;
    for i in 0..6_000u32 {
        let from = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
        let r = client
            .get(&url)
            .header("x-forwarded-for", from)
            .send()
            .expect("flood request");
        refused += u32::from(r.status().as_u16() == 429);
    }
    assert_eq!(refused, 0, "one-shot callers are under the threshold");
    for n in 0..20 {
        let r = models_from(&stack, &format!("192.0.2.{n}"), &[]);
        assert_eq!(r.status, 200, "newcomer {n}: {r:?}");
    }
    // A caller over the threshold is still blocked, and only it.
    for _ in 0..60 {
        assert_eq!(models_from(&stack, "198.51.100.7", &[]).status, 200);
    }
    let r = models_from(&stack, "198.51.100.7", &[]);
    assert_eq!(reason(&r), Some("temporarily_blocked"), "{r:?}");
    assert_eq!(models_from(&stack, "198.51.100.8", &[]).status, 200);
    assert_eq!(counter(&stack, "sluice_abuse_blocks_total", &[]), 1.0);
    assert_eq!(counter(&stack, "sluice_abuse_untracked_total", &[]), 0.0);
}

#[test]
fn ipv6_callers_are_counted_by_their_64_prefix_or_the_configured_one() {
    let stack = start(json!({"threshold": "5/h", "block_for": "10m"}));
    // Five addresses of one /64: one caller.
    for n in 1..=5 {
        let r = models_from(&stack, &format!("2001:db8:1:2::{n}"), &[]);
        assert_eq!(r.status, 200, "{r:?}");
    }
    let r = models_from(&stack, "2001:db8:1:2:ffff:ffff:ffff:ffff", &[]);
    assert_eq!(reason(&r), Some("temporarily_blocked"), "{r:?}");
    // The next /64 is someone else.
    assert_eq!(models_from(&stack, "2001:db8:1:3::1", &[]).status, 200);

    let stack = start(json!({"threshold": "5/h", "block_for": "10m", "ipv6_prefix": 48}));
    for n in 1..=5 {
        let from = format!("2001:db8:7:{n}::1");
        assert_eq!(models_from(&stack, &from, &[]).status, 200);
    }
    let r = models_from(&stack, "2001:db8:7:99::1", &[]);
    assert_eq!(reason(&r), Some("temporarily_blocked"), "/48: {r:?}");
    assert_eq!(models_from(&stack, "2001:db8:8::1", &[]).status, 200);
}

/// Issue 18 item 7: 100 wrong keys and 100 bad JWTs from one address all
/// got 401, and the address was never blocked.
#[test]
fn wrong_keys_and_bad_jwts_count_toward_the_box_and_are_metered() {
    let stack = start(json!({"threshold": "60/h", "block_for": "10m", "exempt_declared": true}));
    let from = "203.0.113.9";
    let mut statuses = Vec::new();
    for i in 0..50 {
        let key = format!("wrong-key-{i}");
        statuses.push(models_from(&stack, from, &[("x-api-key", &key)]).status);
    }
    for i in 0..10 {
        let jwt = format!("Bearer eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ{i}In0.c2ln");
        statuses.push(models_from(&stack, from, &[("authorization", &jwt)]).status);
    }
    assert_eq!(statuses, vec![401; 60]);
    let r = models_from(&stack, from, &[("x-api-key", "wrong-key-61")]);
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(reason(&r), Some("temporarily_blocked"));
    assert!(r.header("retry-after").is_some());
    // Guessing stopped: more guesses get the block, not a 401 telling
    // a wrong key from a right one.
    let jwt = "Bearer eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln";
    let r = models_from(&stack, from, &[("authorization", jwt)]);
    assert_eq!(reason(&r), Some("temporarily_blocked"), "{r:?}");
    // Another address is not affected, nor a declared (exempt) key here.
    assert_eq!(models_from(&stack, "203.0.113.10", &[]).status, 200);
    let r = models_from(&stack, from, &[("x-api-key", "demo-pro-key")]);
    assert_eq!(r.status, 200, "{r:?}");
    let failures = |why: &str| counter(&stack, "sluice_auth_failures_total", &[("reason", why)]);
    assert_eq!(failures("unknown_key"), 51.0);
    assert_eq!(failures("unverified_jwt"), 11.0);
    assert_eq!(counter(&stack, "sluice_abuse_blocks_total", &[]), 1.0);
}

/// Issue 18 item 8: the home slot was `who % slots`, so a reload from
/// 4,096 to 4,099 slots freed every block.
#[test]
fn a_reload_from_4096_to_4099_slots_keeps_blocks_and_counts() {
    let abuse = |slots: u32| json!({"threshold": "5/h", "block_for": "10m", "slots": slots});
    let stack = start(abuse(4096));
    for _ in 0..5 {
        assert_eq!(models_from(&stack, "198.51.100.1", &[]).status, 200);
    }
    let r = models_from(&stack, "198.51.100.1", &[]);
    assert_eq!(reason(&r), Some("temporarily_blocked"), "{r:?}");
    for _ in 0..4 {
        assert_eq!(models_from(&stack, "198.51.100.2", &[]).status, 200);
    }

    let mut reloaded = stack.config.clone();
    reloaded.policy_mut()["abuse"] = yaml(abuse(4099));
    stack.envoy.reload(&reloaded).expect("reload accepted");

    let r = models_from(&stack, "198.51.100.1", &[]);
    assert_eq!(
        reason(&r),
        Some("temporarily_blocked"),
        "the block survived: {r:?}"
    );
    // The running count too: one more, then over.
    assert_eq!(models_from(&stack, "198.51.100.2", &[]).status, 200);
    let r = models_from(&stack, "198.51.100.2", &[]);
    assert_eq!(
        reason(&r),
        Some("temporarily_blocked"),
        "the count survived: {r:?}"
    );
    assert_eq!(models_from(&stack, "198.51.100.3", &[]).status, 200);
}

/// Sends only the headers of a `content_length`-byte POST and waits (up
/// to `deadline`) for an answer: the status, if one came before any body.
fn answer_before_body(
    stack: &Stack,
    path: &str,
    headers: &[(&str, &str)],
    content_length: usize,
    deadline: Duration,
) -> Option<(u16, String)> {
    let mut tcp = TcpStream::connect(stack.envoy.addr()).expect("connect");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: sluice\r\ncontent-type: application/json\r\ncontent-length: {content_length}\r\n"
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    tcp.write_all(head.as_bytes()).expect("send headers");
    tcp.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < deadline {
        match tcp.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let status = text.get(9..12)?.parse().ok()?;
            return Some((status, text[..end].to_ascii_lowercase()));
        }
    }
    None
}

/// Issue 18 item 3: a spent key's 1 MB `/v1/embeddings` bodies were each
/// buffered, parsed and estimated before its bucket refused them.
#[test]
fn a_spent_keys_large_bodies_are_refused_before_they_are_sent() {
    let stack = start_with(json!({"threshold": "1000/min", "block_for": "1m"}), |cfg| {
        cfg.policy_mut()["tiers"]["free"] = yaml(json!({"requests": "2/hour"}));
    });
    let key = [("x-api-key", "demo-free-key")];
    let small = json!({"model": "llama3.1:8b", "input": "hello"});
    for _ in 0..2 {
        let r = sluice_tests::post_json(&stack.envoy.url("/v1/embeddings"), &key, &small);
        assert_eq!(r.status, 200, "{r:?}");
    }
    let answered = answer_before_body(
        &stack,
        "/v1/embeddings",
        &key,
        512 * 1024,
        Duration::from_secs(10),
    );
    let (status, head) = answered.expect("no answer before the body was sent");
    assert_eq!(status, 429, "{head}");
    assert!(head.contains("x-sluice-reason: user_rate_limit"), "{head}");
    assert!(head.contains("retry-after:"), "{head}");
    assert_eq!(
        counter(&stack, "sluice_refused_before_body_total", &[]),
        1.0
    );
    assert_eq!(stack.upstream_requests(), 2);

    // A caller with room left is read as before: headers alone get no
    // answer (the body decides).
    let other = [("x-api-key", "demo-pro-key")];
    let none = answer_before_body(
        &stack,
        "/v1/embeddings",
        &other,
        512 * 1024,
        Duration::from_secs(1),
    );
    assert_eq!(none, None);
    assert_eq!(
        counter(&stack, "sluice_refused_before_body_total", &[]),
        1.0
    );
}

/// The parse stops at its bounds: the issue's `[[1],[1],…]` body is
/// refused 400 naming `input`, and the Envoy goes on serving.
#[test]
fn a_body_past_the_parse_bounds_is_refused_naming_the_field() {
    let stack = start(json!({"threshold": "1000/min", "block_for": "1m"}));
    let body = format!(
        r#"{{"model":"llama3.1:8b","input":[{}[1]]}}"#,
        "[1],".repeat(230_000)
    );
    let r = sluice_tests::request(
        "POST",
        &stack.envoy.url("/v1/embeddings"),
        &[
            ("content-type", "application/json"),
            ("x-api-key", "demo-pro-key"),
        ],
        Some(body.into_bytes()),
    )
    .expect("send");
    assert_eq!(r.status, 400, "{}", brief(&r));
    let e = r.json();
    assert_eq!(e["error"]["param"], "input", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("arrays and objects"),
        "{e}"
    );
    assert_eq!(stack.upstream_requests(), 0);
    let deep = format!(
        r#"{{"model":"llama3.1:8b","input":{}1{}}}"#,
        "[".repeat(100),
        "]".repeat(100)
    );
    let r = sluice_tests::request(
        "POST",
        &stack.envoy.url("/v1/embeddings"),
        &[
            ("content-type", "application/json"),
            ("x-api-key", "demo-pro-key"),
        ],
        Some(deep.into_bytes()),
    )
    .expect("send");
    assert_eq!(r.status, 400, "{}", brief(&r));
    assert_eq!(r.json()["error"]["param"], "input");
    assert_eq!(stack.upstream_requests(), 0);
}

/// The body attack of issue 18 item 3, measured (`bench/body_attack.sh`):
/// a spent declared key sends 1 MB `/v1/embeddings` bodies (`[[1],[1],…]`)
/// on 4 connections while an unrelated caller (another key) sends small
/// requests one after another; prints the unrelated caller's p50/p99
/// without and with the attack. `SLUICE_BENCH_WASM` measures another build
/// (today's main). A figure, not an assertion: machine speed decides it.
#[test]
#[ignore = "benchmark: bench/body_attack.sh"]
fn bench_body_attack() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let wasm = std::env::var("SLUICE_BENCH_WASM")
        .ok()
        .filter(|s| !s.is_empty());
    let label = std::env::var("SLUICE_BENCH_LABEL").unwrap_or_else(|_| "this build".into());
    let secs: u64 = std::env::var("SLUICE_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    // Bodies per second from the 4 connections together (issue 18 saw 39);
    // 0: as fast as they are answered.
    let rate: f64 = std::env::var("SLUICE_BENCH_RATE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(39.0);
    // `room`: the attacker's key is not spent (its bodies are read, and
    // refused 400 at the parse bounds).
    let room = std::env::var("SLUICE_BENCH_ATTACKER").is_ok_and(|v| v == "room");
    let attacker_key = if room {
        "demo-enterprise-key"
    } else {
        "demo-free-key"
    };
    let stack = Stack::start_with(2, |cfg| {
        if let Some(path) = &wasm {
            let filter = cfg.http_filter_mut("sluice");
            filter["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] =
                Yaml::from(path.as_str());
        }
        cfg.policy_mut()["tiers"]["free"] = yaml(json!({"requests": "1/hour"}));
        // The unrelated caller's own limits stay out of its way.
        cfg.policy_mut()["tiers"]["pro"] = yaml(json!({"requests": "1000000/min"}));
        cfg.policy_mut()["tiers"]["enterprise"] = yaml(json!({"requests": "1000000/min"}));
    });
    let spent = [("x-api-key", "demo-free-key")];
    let small = json!({"model": "llama3.1:8b", "input": "hello"});
    let url = stack.envoy.url("/v1/embeddings");
    assert_eq!(sluice_tests::post_json(&url, &spent, &small).status, 200);
    assert_eq!(sluice_tests::post_json(&url, &spent, &small).status, 429);

    // Just under request.max_body_bytes (1 MiB).
    let mut body = String::from(r#"{"model":"llama3.1:8b","input":["#);
    while body.len() < 1_048_000 {
        body.push_str("[1],");
    }
    body.push_str("[1]]}");
    let request = Arc::new({
        let mut r = format!(
            "POST /v1/embeddings HTTP/1.1\r\nhost: sluice\r\nx-api-key: {attacker_key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body.as_bytes());
        r
    });

    let victim = |for_secs: u64| -> (usize, f64, f64) {
        let client = sluice_tests::client_builder().build().expect("client");
        let models = stack.envoy.url("/v1/models");
        let mut ms = Vec::new();
        let end = Instant::now() + Duration::from_secs(for_secs);
        while Instant::now() < end {
            let t = Instant::now();
            let r = client
                .get(&models)
                .header("x-api-key", "demo-pro-key")
                .send()
                .expect("victim request");
            assert_eq!(r.status().as_u16(), 200);
            let _ = r.bytes();
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        ms.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| ms[((ms.len() as f64 - 1.0) * q) as usize];
        (ms.len(), at(0.5), at(0.99))
    };

    let quiet = victim(secs.min(5));
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let addr = stack.envoy.addr();
    let attackers: Vec<_> = (0..4)
        .map(|_| {
            let (stop, sent, refused, request) =
                (stop.clone(), sent.clone(), refused.clone(), request.clone());
            std::thread::spawn(move || {
                let gap = (rate > 0.0).then(|| Duration::from_secs_f64(4.0 / rate));
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    if let Some(gap) = gap {
                        // Paced: one body per `gap` per connection.
                        std::thread::sleep(next.saturating_duration_since(Instant::now()));
                        next += gap;
                    }
                    let Ok(mut tcp) = TcpStream::connect(addr) else {
                        continue;
                    };
                    let _ = tcp.set_read_timeout(Some(Duration::from_secs(5)));
                    // The answer may come before the body is through: send
                    // what Envoy takes, then read the status.
                    let _ = tcp.write_all(&request);
                    let mut head = [0u8; 64];
                    if let Ok(n) = tcp.read(&mut head) {
                        sent.fetch_add(1, Ordering::Relaxed);
                        if matches!(head.get(9..12), Some(b"429" | b"400")) && n >= 12 {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    let started = Instant::now();
    let attacked = victim(secs);
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        let _ = a.join();
    }
    let early = counter(&stack, "sluice_refused_before_body_total", &[]);
    println!(
        "body attack | {label} | {} | target {rate} bodies/s | quiet: {} req, p50 {:.2} ms, p99 {:.2} ms | attacked: {} req, p50 {:.2} ms, p99 {:.2} ms | attack {:.1} bodies/s ({} answered 429 or 400, {} refused before the body)",
        if room { "key with room" } else { "spent key" },
        quiet.0,
        quiet.1,
        quiet.2,
        attacked.0,
        attacked.1,
        attacked.2,
        sent.load(Ordering::Relaxed) as f64 / elapsed,
        refused.load(Ordering::Relaxed),
        early
    );
}
