//! The sidecar's listener against slow, huge and many connections, on the
//! real binary: a head that does not arrive within `header_timeout` is
//! closed, a head over `max_header_bytes` is answered 431, connections past
//! `connections.max` are closed as they are accepted, and hundreds of
//! unfinished large heads do not grow its memory by hundreds of MB. And a
//! sidecar with nothing to watch does not report itself stale.

use std::fs;
use std::io::{ErrorKind, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use sluice_tests::{get, prometheus_value, request, wait_for, Sidecar};

fn start(config: &str) -> (Sidecar, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sidecar.yaml");
    fs::write(&path, config).expect("write config");
    let path = path.to_str().expect("utf-8 path").to_string();
    (Sidecar::start_with_args(&["--config", &path]), dir)
}

fn metric(sc: &Sidecar, name: &str, labels: &[(&str, &str)]) -> f64 {
    prometheus_value(&get(&sc.url("/metrics"), &[]).body, name, labels).unwrap_or(0.0)
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect to the sidecar");
    s.set_read_timeout(Some(Duration::from_secs(15)))
        .expect("read timeout");
    s
}

/// Reads until the peer closes (or 15 s pass); what it sent.
fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("the sidecar kept the connection open: {e}"),
        }
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// A client that sends a byte of its head now and then is closed once the
/// head is not whole within `header_timeout` (1 s here), and counted; one
/// that sends a complete head in time is served.
#[test]
fn a_slow_head_is_closed_at_the_header_timeout() {
    let (sc, _dir) = start("connections: { header_timeout: 1s }\n");
    let addr = sc.addr();
    let mut slow = connect(addr);
    let opened = Instant::now();
    let head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ";
    let mut closed = false;
    for byte in head.iter().chain(std::iter::repeat(&b'a')).take(60) {
        if slow.write_all(&[*byte]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if !closed {
        // The write side may stay open a moment longer than the read side.
        let answer = read_until_closed(&mut slow);
        assert!(
            answer.is_empty() || answer.starts_with(b"HTTP/1.1 408"),
            "{answer:?}"
        );
    }
    let held = opened.elapsed();
    assert!(
        held < Duration::from_secs(6),
        "closed after {held:?}, not near 1 s"
    );
    assert!(
        wait_for(Duration::from_secs(5), || {
            metric(
                &sc,
                "sluice_sidecar_connections_closed_total",
                &[("reason", "header_timeout")],
            ) >= 1.0
        }),
        "the header timeout is not counted"
    );
    assert_eq!(get(&sc.url("/healthz"), &[]).status, 200);
}

/// A head over `max_header_bytes` is answered 431 and the connection
/// closed; one under it is served.
#[test]
fn a_head_over_the_cap_is_answered_431() {
    let (sc, _dir) = start("connections: { max_header_bytes: 4096 }\n");
    let mut big = connect(sc.addr());
    let filler = "a".repeat(8 * 1024);
    let request = format!("GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: {filler}\r\n\r\n");
    let _ = big.write_all(request.as_bytes());
    let answer = String::from_utf8_lossy(&read_until_closed(&mut big)).into_owned();
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
    let mut small = connect(sc.addr());
    small
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .expect("send");
    let answer = String::from_utf8_lossy(&read_until_closed(&mut small)).into_owned();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert_eq!(
        metric(
            &sc,
            "sluice_sidecar_connections_closed_total",
            &[("reason", "header_too_large")]
        ),
        1.0
    );
}

/// `connections.max` open connections are held; the next is closed as it
/// is accepted (nothing read from it), and counted; once the held ones go
/// (their heads never came: closed at the timeout) the sidecar answers.
#[test]
fn connections_past_the_cap_are_closed_as_accepted() {
    let (sc, _dir) = start("connections: { max: 8, reserved: 2, header_timeout: 3s }\n");
    let addr = sc.addr();
    let held: Vec<TcpStream> = (0..8).map(|_| connect(addr)).collect();
    // Accepted and counted before the next one comes.
    std::thread::sleep(Duration::from_millis(300));
    let mut extra = connect(addr);
    let _ = extra.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let refused_at = Instant::now();
    let answer = read_until_closed(&mut extra);
    assert!(answer.is_empty(), "past the cap it was served: {answer:?}");
    assert!(
        refused_at.elapsed() < Duration::from_secs(2),
        "closed only after {:?} (the header timeout, not the cap)",
        refused_at.elapsed()
    );
    drop(held);
    assert!(
        wait_for(Duration::from_secs(10), || {
            request("GET", &sc.url("/healthz"), &[], None).is_ok_and(|r| r.status == 200)
        }),
        "the sidecar does not answer once the held connections are gone"
    );
    assert!(
        metric(
            &sc,
            "sluice_sidecar_connections_refused_total",
            &[("caller", "local")]
        ) >= 1.0
    );
    assert_eq!(
        metric(
            &sc,
            "sluice_sidecar_connections_refused_total",
            &[("caller", "remote")]
        ),
        0.0
    );
}

/// 600 connections each sending 380 KB of a head that never ends (a flood
/// that once took the sidecar from 44 to 243 MB, near the shipped pod's
/// 256 Mi limit): with the shipped bounds each is answered 431 at 16 KiB
/// and closed, and the sidecar's resident memory grows by far less.
#[test]
fn hundreds_of_unfinished_large_heads_do_not_grow_memory() {
    let (mut sc, _dir) = start("{}\n");
    let addr = sc.addr();
    let pid = sc.process().id();
    let before = rss_kib(pid);
    let chunk = vec![b'a'; 380 * 1024];
    let mut conns = Vec::new();
    for _ in 0..600 {
        let mut s = connect(addr);
        s.set_write_timeout(Some(Duration::from_secs(5)))
            .expect("write timeout");
        let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: ");
        // The sidecar stops reading at the cap: a blocked or refused write
        // is what a bounded reader does to a flood.
        let _ = s.write_all(&chunk);
        conns.push(s);
    }
    let peak = rss_kib(pid);
    drop(conns);
    let grew_mib = peak.saturating_sub(before) / 1024;
    eprintln!("resident memory {before} KiB -> {peak} KiB under 600 unfinished 380 KB heads");
    assert!(
        grew_mib < 64,
        "resident memory {before} KiB -> {peak} KiB (+{grew_mib} MiB) under 600 unfinished 380 KB heads"
    );
    assert!(
        metric(
            &sc,
            "sluice_sidecar_connections_closed_total",
            &[("reason", "header_too_large")]
        ) >= 500.0
    );
}

/// A sidecar with no GPU source and no backend (a node without GPUs,
/// `sources.gpu: none`) has nothing to watch: past `stale_after` it is not
/// stale (the shipped stale alert would fire for as long as it runs).
#[test]
fn a_sidecar_with_nothing_to_watch_is_not_stale() {
    let (sc, _dir) =
        start("scrape_interval: 200ms\nbreaker: { stale_after: 1s }\nsources: { gpu: none }\n");
    std::thread::sleep(Duration::from_millis(2_500));
    assert_eq!(
        metric(&sc, "sluice_sidecar_stale", &[]),
        0.0,
        "{}",
        sc.log()
    );
    let state = get(&sc.url("/v1/state"), &[]);
    assert!(state.body.contains("\"stale\":false"), "{}", state.body);
    assert!(sc.log().contains("no source feeds it"), "{}", sc.log());
}
