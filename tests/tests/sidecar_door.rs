//! The sidecar's own door (issue 18, items 9 and 10): it answers only to its
//! own host names, so a DNS-rebinding page cannot read or drive it, while
//! the shipped Envoy config's polls and fleet callouts still get through;
//! the admin token has a minimum length; wrong tokens are slowed down per
//! client, counted and logged without the guess, while the right token is
//! never refused for anyone's guesses (issue 29, item 10).
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the door is the
//! sidecar's.

use std::fs;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::fleet::{policy, Node, Redis, TOKEN as FLEET_TOKEN};
use sluice_tests::{
    bin_path, chat_body, get, post_json, prometheus_value, wait_for, MockLlm, Sidecar,
};

const TOKEN: &str = "sidecar-door-test-admin-token-0123456789";

/// One HTTP/1.1 request on its own connection, with exactly the `Host`
/// given (none when `None`); the status.
fn raw(addr: SocketAddr, method: &str, path: &str, host: Option<&str>, extra: &str) -> u16 {
    let mut s = TcpStream::connect(addr).expect("connect to the sidecar");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let host = host.map_or(String::new(), |h| format!("Host: {h}\r\n"));
    let body = if method == "POST" { "{}" } else { "" };
    let req = format!(
        "{method} {path} HTTP/1.1\r\n{host}{extra}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"))
}

fn sidecar_metric(sc: &Sidecar, name: &str, labels: &[(&str, &str)]) -> f64 {
    prometheus_value(&get(&sc.url("/metrics"), &[]).body, name, labels).unwrap_or(0.0)
}

/// A DNS-rebinding page reaches the sidecar with its own name in `Host`:
/// every route refuses it (421), the fleet's too; `localhost:PORT` is
/// served; and the Envoy of the shipped config, polling and calling the
/// fleet with `:authority: sluice_sidecar`, is never refused.
#[test]
fn a_rebinding_page_is_refused_on_every_route_while_envoy_gets_through() {
    let redis = Redis::start();
    let upstream = MockLlm::start("primary");
    let p = policy(
        "default_tier: free\nidentity: { sources: [client_address] }\n\
         tiers: { free: { requests: 3/day } }\n\
         sidecar: { cluster: sluice_sidecar, stale_after: 60s, on_stale: fail_open, poll_wait: 5s }\n\
         fleet: { expected_replicas: 1, salt: sidecar-door-test-salt }\n",
    );
    let node = Node::start(&redis.url(), &upstream, None, &p, 2);
    let sc = &node.sidecar;
    let addr = sc.addr();
    let auth = format!("Authorization: Bearer {FLEET_TOKEN}\r\n");
    let gets = [
        "/",
        "/page.js",
        "/page.css",
        "/v1/history",
        "/v1/state",
        "/metrics",
        "/healthz",
        "/v1/simulate",
        "/v1/fleet",
    ];
    let posts = [
        "/v1/kill-switch",
        "/v1/simulate",
        "/v1/fleet/take",
        "/v1/fleet/give",
        "/v1/fleet/slots",
    ];
    let mut refused = 0;
    for host in [
        Some("evil.example".to_string()),
        Some(format!("evil.example:{}", addr.port())),
        Some(format!("localhost.evil.example:{}", addr.port())),
        None,
    ] {
        for path in gets {
            let status = raw(addr, "GET", path, host.as_deref(), "");
            assert_eq!(status, 421, "GET {path} with Host {host:?}");
            refused += 1;
        }
        for path in posts {
            let status = raw(addr, "POST", path, host.as_deref(), &auth);
            assert_eq!(status, 421, "POST {path} with Host {host:?}");
            refused += 1;
        }
    }
    let local = format!("localhost:{}", addr.port());
    for path in gets {
        assert_eq!(raw(addr, "GET", path, Some(&local), ""), 200, "GET {path}");
    }
    assert_eq!(
        get(&sc.url("/v1/state"), &[]).json()["kill_switch"]["active"],
        false,
        "a refused kill switch changed nothing"
    );

    // The Envoy of the shipped config: its poll is held, its fleet callouts
    // count in Redis (3 of 5 admitted by the fleet-wide bucket).
    assert!(
        wait_for(Duration::from_secs(10), || sidecar_metric(
            sc,
            "sluice_sidecar_long_poll_subscribers",
            &[]
        ) >= 1.0),
        "Envoy never held a poll:\n{}",
        sc.log()
    );
    let url = node.envoy.url("/v1/chat/completions");
    let statuses: Vec<u16> = (0..5)
        .map(|_| post_json(&url, &[], &chat_body("m")).status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429], "{}", sc.log());
    assert!(
        !redis.keys("*").is_empty(),
        "the fleet never reached Redis: {}",
        sc.log()
    );
    assert_eq!(
        sidecar_metric(sc, "sluice_sidecar_host_refused_total", &[]),
        f64::from(refused),
        "only this test's requests were refused, none of Envoy's"
    );
}

/// A sidecar with the test's token and its own config, `extra` appended.
fn sidecar_with_token(dir: &tempfile::TempDir, extra_args: &[&str]) -> Sidecar {
    let token = dir.path().join("token");
    fs::write(&token, TOKEN).expect("token file");
    let token = token.display().to_string();
    let mut args = vec!["--simulate", "--admin-token-file", &token];
    args.extend_from_slice(extra_args);
    Sidecar::start_with_args(&args)
}

/// `allowed_hosts` and `--allowed-host` add names (a Kubernetes Service);
/// a malformed one stops the sidecar at start, naming it.
#[test]
fn configured_host_names_are_served_and_bad_ones_refused_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("sidecar.yaml");
    fs::write(
        &config,
        "allowed_hosts: [sluice-sidecar.prod.svc.cluster.local]\n",
    )
    .expect("config");
    let config = config.display().to_string();
    let sc = sidecar_with_token(
        &dir,
        &["--config", &config, "--allowed-host", "sluice-sidecar"],
    );
    let addr = sc.addr();
    for host in [
        "sluice-sidecar.prod.svc.cluster.local:9911",
        "sluice-sidecar",
        "127.0.0.1",
    ] {
        assert_eq!(raw(addr, "GET", "/v1/state", Some(host), ""), 200, "{host}");
    }
    assert_eq!(
        raw(addr, "GET", "/v1/state", Some("sluice-sidecar.evil"), ""),
        421
    );
    drop(sc);

    for (args, says) in [
        (
            vec!["--allowed-host", "http://x"],
            "allowed_hosts / --allowed-host `http://x`",
        ),
        (vec!["--allowed-host", "x:80"], "`x:80`"),
    ] {
        let mut cmd = Command::new(bin_path("sluice-sidecar"));
        cmd.args(["serve", "--listen", "127.0.0.1:0"]).args(&args);
        let (code, log) = exit_of(cmd, None);
        assert_eq!(code, Some(1), "{log}");
        assert!(log.contains(says), "{log}");
    }
    fs::write(dir.path().join("bad.yaml"), "allowed_hosts: ['a b']\n").expect("config");
    let out = Command::new(bin_path("sluice-sidecar"))
        .arg("check-sidecar-config")
        .arg(dir.path().join("bad.yaml"))
        .output()
        .expect("check-sidecar-config");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("allowed_hosts[0]"),
        "{text}"
    );
}

/// Runs `cmd` (which should exit at once) with only the admin token `env`
/// gives it; its exit code and output.
fn exit_of(mut cmd: Command, env: Option<&str>) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("out.log");
    let out = fs::File::create(&log).expect("log");
    let err = out.try_clone().expect("log");
    cmd.env_remove("SLUICE_ADMIN_TOKEN");
    if let Some(token) = env {
        cmd.env("SLUICE_ADMIN_TOKEN", token);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn sluice-sidecar");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = fs::read_to_string(&log).unwrap_or_default();
    (status.and_then(|s| s.code()), text)
}

/// A token shorter than 32 bytes (or a repeated pattern) stops the sidecar
/// at start, naming where it came from; 32 varied bytes are enough.
#[test]
fn a_short_admin_token_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("token");
    fs::write(&file, "s3cret\n").expect("token");
    let cfg = dir.path().join("sidecar.yaml");
    fs::write(
        &cfg,
        format!("admin: {{ token_file: {} }}\n", file.display()),
    )
    .expect("config");
    let serve = || {
        let mut cmd = Command::new(bin_path("sluice-sidecar"));
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--simulate"]);
        cmd
    };
    let mut by_flag = serve();
    by_flag.arg("--admin-token-file").arg(&file);
    let mut by_config = serve();
    by_config.arg("--config").arg(&cfg);
    // 16 bytes were the minimum while a throttled client's token went
    // unread; now that the right token is always read, they are too few.
    for (cmd, env, names, len) in [
        (by_flag, None, "--admin-token-file", 6),
        (by_config, None, "admin.token_file", 6),
        (serve(), Some("t"), "SLUICE_ADMIN_TOKEN", 1),
        (serve(), Some("sixteen-bytes!!!"), "SLUICE_ADMIN_TOKEN", 16),
    ] {
        let (code, log) = exit_of(cmd, env);
        assert_eq!(
            code,
            Some(1),
            "a {len}-byte token from {names} was accepted:\n{log}"
        );
        assert!(
            log.contains(names) && log.contains(&format!("is {len} bytes; at least 32")),
            "{log}"
        );
        assert!(
            !log.contains("s3cret") && !log.contains("sixteen"),
            "the token is not logged: {log}"
        );
    }
    let plain = "ab".repeat(20);
    let (code, log) = exit_of(serve(), Some(&plain));
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains("only 2 different characters"), "{log}");
    let ok = "0123456789abcdef0123456789abcdef";
    fs::write(&file, ok).expect("token");
    let token = file.display().to_string();
    let sc = Sidecar::start_with_args(&["--simulate", "--admin-token-file", &token]);
    let r = post_json(
        &sc.url("/v1/kill-switch"),
        &[("authorization", &format!("Bearer {ok}"))],
        &json!({"active": false}),
    );
    assert_eq!(r.status, 200, "{r:?}");
}

/// Guessing the admin token: each client gets 10 wrong guesses, then one
/// per 6 s; past them its wrong tokens are answered 429 with `Retry-After`.
/// Failures are counted by endpoint and reason and logged without the
/// guess; the right token works at once, however many guesses came first.
#[test]
fn guessing_the_admin_token_is_slowed_counted_and_logged() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sc = sidecar_with_token(&dir, &[]);
    let url = sc.url("/v1/kill-switch");
    let body = json!({"active": true});
    let start = Instant::now();
    let (mut wrong, mut throttled, mut retry_after) = (0u32, 0u32, None);
    let attempts = 300;
    for i in 0..attempts {
        let guess = format!("Bearer guess-{i:04}-0123456789");
        let r = post_json(&url, &[("authorization", guess.as_str())], &body);
        match r.status {
            401 => wrong += 1,
            429 => {
                throttled += 1;
                assert_eq!(r.json()["error"]["code"], "too_many_failures", "{r:?}");
                retry_after = r.header("retry-after").map(str::to_string);
            }
            other => panic!("guess {i}: {other} {r:?}"),
        }
    }
    let took = start.elapsed();
    // 10 at once, then one more per 6 s that passed.
    let allowed = 10 + u32::try_from(took.as_secs() / 6).unwrap_or(u32::MAX);
    assert!(
        (10..=allowed).contains(&wrong),
        "{wrong} guesses answered 401 in {took:?}"
    );
    assert_eq!(wrong + throttled, attempts);
    let wait: u64 = retry_after
        .as_deref()
        .and_then(|v| v.parse().ok())
        .expect("429 with Retry-After");
    assert!((1..=6).contains(&wait), "Retry-After {wait}");
    println!(
        "admin token guessing: {attempts} attempts in {:.2} s ({:.0} requests/s), \
         {wrong} checked ({:.1} guesses/s), {throttled} answered 429",
        took.as_secs_f64(),
        f64::from(attempts) / took.as_secs_f64(),
        f64::from(wrong) / took.as_secs_f64()
    );

    // Counted by endpoint and reason; the state never changed.
    let metric = |reason: &str| {
        sidecar_metric(
            &sc,
            "sluice_sidecar_admin_auth_failures_total",
            &[("endpoint", "kill_switch"), ("reason", reason)],
        )
    };
    assert_eq!(metric("wrong"), f64::from(wrong));
    assert_eq!(metric("throttled"), f64::from(throttled));
    assert_eq!(
        get(&sc.url("/v1/state"), &[]).json()["kill_switch"]["active"],
        false
    );
    // Logged, never with the guess.
    let log = sc.log();
    assert!(
        log.contains("wrong admin token for /v1/kill-switch from 127.0.0.1"),
        "{log}"
    );
    assert!(!log.contains("guess-"), "a guess in the log:\n{log}");
    let lines = log.matches("wrong admin token").count();
    assert_eq!(
        lines,
        usize::try_from(wrong).unwrap_or(0),
        "one line per checked guess"
    );

    // No wait for the right token.
    let right = format!("Bearer {TOKEN}");
    let r = post_json(&url, &[("authorization", right.as_str())], &body);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        get(&sc.url("/v1/state"), &[]).json()["kill_switch"]["active"],
        true
    );
}

/// A co-tenant cannot lock the operator out (issue 29, item 10): a local
/// process sends wrong tokens from the operator's own loopback address,
/// past its 10 and on without pause; the operator's right token, from the
/// same address, pulls and releases the kill switch at once every time,
/// and the guesser's wrong tokens are still answered 429.
#[test]
fn a_guessing_co_tenant_cannot_hold_the_kill_switch_shut() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sc = sidecar_with_token(&dir, &[]);
    let url = sc.url("/v1/kill-switch");
    let started = Instant::now();
    let guess = |i: u32| {
        let wrong = format!("Bearer co-tenant-guess-{i:04}-0123456789abcdef");
        post_json(
            &url,
            &[("authorization", wrong.as_str())],
            &json!({"active": true}),
        )
        .status
    };
    let first: Vec<u16> = (0..12).map(guess).collect();
    assert_eq!(&first[..10], &[401; 10], "{first:?}");
    assert_eq!(&first[10..], &[429; 2], "{first:?}");

    let right = format!("Bearer {TOKEN}");
    let operator = |active: bool| {
        let at = Instant::now();
        let r = post_json(
            &url,
            &[("authorization", right.as_str())],
            &json!({"active": active, "reason": "operator"}),
        );
        assert_eq!(
            r.status,
            200,
            "the operator was refused: {r:?}\n{}",
            sc.log()
        );
        let state = get(&sc.url("/v1/state"), &[]).json();
        assert_eq!(state["kill_switch"]["active"], active, "{state}");
        at.elapsed()
    };
    // The guesser keeps going, in its own thread, while the operator acts.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let sent = std::sync::atomic::AtomicUsize::new(0);
    let (answers, took) = std::thread::scope(|s| {
        let guesser = s.spawn(|| {
            let mut answers = Vec::new();
            let mut i = 100;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                answers.push(guess(i));
                sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                i += 1;
            }
            answers
        });
        // The operator acts once the guesser is well under way.
        assert!(wait_for(Duration::from_secs(20), || sent
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 20));
        let took: Vec<Duration> = [true, false, true].into_iter().map(operator).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (guesser.join().expect("guesser"), took)
    });
    assert!(!answers.is_empty());
    let refilled = 1 + usize::try_from(started.elapsed().as_secs() / 6).unwrap_or(usize::MAX);
    let checked = answers.iter().filter(|s| **s == 401).count();
    assert!(
        answers.iter().all(|s| *s == 401 || *s == 429) && checked <= refilled,
        "{checked} of the guesser's {} tokens were read as guesses",
        answers.len()
    );
    assert_eq!(guess(9999), 429, "wrong tokens are still throttled");
    let throttled = sidecar_metric(
        &sc,
        "sluice_sidecar_admin_auth_failures_total",
        &[("endpoint", "kill_switch"), ("reason", "throttled")],
    );
    assert!(throttled >= 3.0, "throttled {throttled}");
    println!(
        "co-tenant guessing: {} wrong tokens answered ({checked} as 401, the rest 429) \
         while the operator's 3 calls took {:?}",
        answers.len() + 13,
        took
    );
}
