//! Keeps the benchmark scripts from rotting: `bench/run.py --smoke` (what
//! `make bench BENCH_SMOKE=1` runs) must start every Envoy variant derived
//! from envoy/sluice.yaml, the floor filters (bench/floor-filter) included,
//! load each for a second, run the exactness burst and write its tables,
//! the comparison with the floors too. Figures are not checked (a smoke run measures
//! nothing); the exactness result is, since it must hold under any load.
//! LiteLLM (variant e) is left out here: it only runs when installed, and
//! its start-up alone takes longer than this whole test should.
//! `bench/cache_replay.py --smoke` must replay its three variants with no
//! cross-scope or wrong-question hit.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluice_tests::{bin_path, envoy_bin, repo_root, wait_for, wasm_path, ChildGuard};

#[test]
fn bench_smoke_mode_writes_the_table() {
    // Built artifacts (panics with a hint to run `make build` otherwise).
    wasm_path();
    bin_path("mock-llm");
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("smoke.md");
    let log = dir.path().join("run.log");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());

    let started = Instant::now();
    let log_file = std::fs::File::create(&log).expect("log file");
    let mut cmd = Command::new(&python);
    cmd.arg(repo_root().join("bench/run.py"))
        .args(["--smoke", "--variants", "abcdfgj", "--out"])
        .arg(&out)
        .current_dir(repo_root())
        .env("ENVOY_BIN", envoy_bin())
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("log fd"))
        .stderr(log_file);
    let mut run = ChildGuard::spawn("bench/run.py --smoke", &mut cmd).expect("spawn python3");
    // Generous: the first run also compiles bench/yaml2json and
    // bench/floor-filter.
    let finished = wait_for(Duration::from_secs(180), || run.try_wait().is_some());
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        finished,
        "bench/run.py --smoke still running after 180 s:\n{output}"
    );
    let status = run.kill();
    assert!(
        status.success(),
        "bench/run.py --smoke failed ({status}):\n{output}"
    );
    eprintln!("bench smoke took {:?}", started.elapsed());

    let md = std::fs::read_to_string(&out).expect("smoke report written");
    for row in [
        "| (a) Envoy, no filter | GET /v1/models",
        "| (a) Envoy, no filter | POST /v1/chat/completions",
        "| (b) Envoy + native local_ratelimit | GET",
        "| (c) Envoy + sluice, header-only policy | GET",
        "| (c) Envoy + sluice, header-only policy | POST",
        "| (d) Envoy + sluice, full policy | POST",
        "| (f) floor: empty filter | GET",
        "| (f) floor: empty filter | POST",
        "| (g) floor: body-reading filter | POST",
        "| (j) floor: (c)'s host calls, no policy | GET",
        "| (j) floor: (c)'s host calls, no policy | POST",
        // (c) split into Envoy's side of its host calls and its own code.
        "(c) split by the host-call floor (j): GET: (c) − (f) ",
        // The ratios against the floors, each with its goal and verdict.
        "| (c) header-only vs (f) empty floor | GET | ",
        "| (c) header-only vs (f) empty floor | POST 2 KB | ",
        "| (d) full vs (g) body-reading floor | POST 2 KB | ",
    ] {
        assert!(
            md.contains(row),
            "no row `{row}` in the smoke report:\n{md}"
        );
    }
    assert!(
        md.contains("| variant | request | req/s ("),
        "no table header:\n{md}"
    );
    // Each comparison with a floor states its goal and whether it is met
    // (a smoke run's figures mean nothing, so either verdict will do).
    for row in md
        .lines()
        .filter(|l| l.starts_with("| (") && l.contains(" floor | "))
    {
        assert!(
            row.contains("| ≥ 0.") && (row.contains("| yes |") || row.contains("| **no** |")),
            "floor comparison without its goal and verdict: {row}"
        );
    }
    // Every exactness row: admitted − C is **0**.
    let exact: Vec<&str> = md
        .lines()
        .filter(|l| l.starts_with("| 1 |") || l.starts_with("| 2 |"))
        .collect();
    assert_eq!(
        exact.len(),
        4,
        "exactness rows (2 concurrencies × 2 requests):\n{md}"
    );
    for row in exact {
        assert!(row.contains("| **0** |"), "admitted − C is not 0: {row}");
    }
}

/// `bench/cache_replay.py --smoke` (also in `make bench BENCH_SMOKE=1`):
/// the three variants start and replay, the table is written, and no hit
/// crossed a scope or answered another question (the script exits non-zero
/// then: that holds under any load, so it is checked; figures are not).
#[test]
fn cache_replay_smoke_writes_its_table() {
    wasm_path();
    bin_path("mock-llm");
    bin_path("sluice-sidecar");
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("cache.md");
    let log = dir.path().join("cache.log");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let log_file = std::fs::File::create(&log).expect("log file");
    let mut cmd = Command::new(&python);
    cmd.arg(repo_root().join("bench/cache_replay.py"))
        .args(["--smoke", "--out"])
        .arg(&out)
        .current_dir(repo_root())
        .env("ENVOY_BIN", envoy_bin())
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("log fd"))
        .stderr(log_file);
    let mut run =
        ChildGuard::spawn("bench/cache_replay.py --smoke", &mut cmd).expect("spawn python3");
    let finished = wait_for(Duration::from_secs(120), || run.try_wait().is_some());
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        finished,
        "bench/cache_replay.py --smoke still running after 120 s:\n{output}"
    );
    let status = run.kill();
    assert!(
        status.success(),
        "bench/cache_replay.py --smoke failed ({status}):\n{output}"
    );
    let md = std::fs::read_to_string(&out).expect("cache report written");
    assert!(md.contains("| variant | upstream calls |"), "{md}");
    for variant in ["off", "exact", "semantic"] {
        let row = md
            .lines()
            .find(|l| l.starts_with(&format!("| {variant} | ")))
            .unwrap_or_else(|| panic!("no `{variant}` row:\n{md}"));
        // Columns: variant, upstream calls, vs off, hits, cross-scope hits, wrong hits, …
        let cols: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!(cols[5], "0", "cross-scope hits: {row}");
        assert_eq!(cols[6], "0", "wrong-question hits: {row}");
    }
}
