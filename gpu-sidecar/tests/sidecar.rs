//! The real `sluice-sidecar` binary against an in-process mock-llm (its vLLM
//! `/metrics` set through `POST /admin/metrics`): breakers open and close
//! with the configured (short) sustain times, the long poll wakes on the
//! change, the kill switch needs the token and survives a restart.

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_sidecar::http::{self, Method, Target};

const BIN: &str = env!("CARGO_BIN_EXE_sluice-sidecar");

/// A running sidecar, killed on drop (its log printed if the test failed).
struct Sidecar {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Sidecar {
    fn start(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Sidecar {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, Ordering::Relaxed);
        let log = dir.join(format!("sidecar-{n}.log"));
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("SLUICE_ADMIN_TOKEN")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Some(addr) = line.strip_prefix("sluice-sidecar listening on ") {
                    let _ = tx.send(addr.parse::<SocketAddr>().unwrap());
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "sidecar did not start:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        };
        Sidecar { child, addr, log }
    }

    fn target(&self, path: &str) -> Target {
        Target::parse(&format!("http://{}{path}", self.addr)).unwrap()
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (u16, String) {
        let body = body.map(|b| b.to_string().into_bytes());
        let (status, bytes) = http::request(
            &self.target(path),
            method,
            headers,
            body,
            Duration::from_secs(40),
        )
        .await
        .unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    async fn json(&self, path: &str) -> Value {
        let (status, body) = self.call(Method::GET, path, &[], None).await;
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    async fn text(&self, path: &str) -> String {
        let (status, body) = self.call(Method::GET, path, &[], None).await;
        assert_eq!(status, 200, "{path}: {body}");
        body
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- sidecar log ---\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// mock-llm in this process, on a free port.
async fn mock_llm() -> SocketAddr {
    let app = mock_llm::app(mock_llm::Config {
        name: "primary".into(),
        model: "mock-model".into(),
        ..mock_llm::Config::default()
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(mock_llm::serve(listener, app, std::future::pending()));
    addr
}

async fn set_mock_metrics(mock: SocketAddr, body: Value) {
    let t = Target::parse(&format!("http://{mock}/admin/metrics")).unwrap();
    http::post_json(&t, body.to_string().into_bytes(), Duration::from_secs(5))
        .await
        .unwrap();
}

/// Polls `f` until it answers `Some`, for at most `limit`.
async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn breaker<'a>(state: &'a Value, scope: &str) -> Option<&'a Value> {
    state["breakers"]
        .as_array()?
        .iter()
        .find(|b| b["scope"] == scope)
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_queue_opens_the_breaker_and_the_long_poll_wakes() {
    let dir = tempfile::tempdir().unwrap();
    let mock = mock_llm().await;
    let config = write(
        dir.path(),
        "sidecar.yaml",
        &format!(
            r#"
scrape_interval: 100ms
sources:
  gpu: none
  vllm:
    - {{name: mock, url: "http://{mock}", models: [mock-model]}}
rules:
  - {{metric: vllm_waiting, open_at: 50, close_below: 40, open_for: 1s, close_after: 300ms}}
  - {{metric: kv_cache, open_at: 0.9, close_below: 0.8, open_for: 1s, close_after: 300ms}}
breaker: {{stale_after: 2s, half_open_for: 400ms}}
"#
        ),
    );
    let sc = Sidecar::start(dir.path(), &["--config", config.to_str().unwrap()], &[]);
    eventually(Duration::from_secs(10), "the first scrape", || async {
        sc.text("/metrics")
            .await
            .contains("sluice_sidecar_backend_up{backend=\"mock\",kind=\"vllm\"} 1")
            .then_some(())
    })
    .await;
    let start = sc.json("/v1/state").await;
    assert_eq!(start["breakers"], json!([]));
    assert_eq!(start["stale"], false);

    set_mock_metrics(mock, json!({"num_requests_waiting": 80})).await;
    let set_at = Instant::now();
    // Follow the long poll as the filter does, until the breaker shows.
    let mut version = start["version"].as_u64().unwrap();
    let opened = loop {
        assert!(set_at.elapsed() < Duration::from_secs(10), "never opened");
        let polled_at = Instant::now();
        let s = sc.json(&format!("/v1/state?since={version}&wait=20")).await;
        assert!(
            polled_at.elapsed() < Duration::from_secs(5),
            "the poll was held past the change"
        );
        version = s["version"].as_u64().unwrap();
        if breaker(&s, "backend:mock").is_some() {
            break s;
        }
    };
    let took = set_at.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "opened before the sustain time: {took:?}"
    );
    assert!(took < Duration::from_secs(4), "opened too late: {took:?}");
    for scope in ["backend:mock", "model:mock-model"] {
        let b = breaker(&opened, scope).unwrap_or_else(|| panic!("{scope} in {opened}"));
        assert_eq!(b["state"], "open");
        assert_eq!(b["reason"], "vllm_waiting 80 >= 50 for 1s");
        assert_eq!(b["retry_after_seconds"], 30);
        assert_eq!(b["half_open_fraction"], 0.0);
        assert!(humantime::parse_rfc3339(b["since"].as_str().unwrap()).is_ok());
    }
    assert!(humantime::parse_rfc3339(opened["updated_at"].as_str().unwrap()).is_ok());

    let metrics = sc.text("/metrics").await;
    for line in [
        "sluice_sidecar_vllm_requests_waiting{backend=\"mock\"} 80",
        "sluice_sidecar_breaker_state{scope=\"backend:mock\"} 2",
        "sluice_sidecar_breaker_state{scope=\"model:mock-model\"} 2",
        "sluice_sidecar_kill_switch_active 0",
        "sluice_sidecar_stale 0",
        "sluice_sidecar_long_poll_subscribers 0",
        "# TYPE sluice_sidecar_scrape_errors_total counter",
        "# TYPE sluice_sidecar_gpu_utilization_percent gauge",
        "# TYPE sluice_sidecar_vllm_kv_cache_usage_ratio gauge",
        "# TYPE sluice_sidecar_vllm_ttft_seconds gauge",
        "# TYPE sluice_sidecar_alerts_suppressed_total counter",
        "sluice_sidecar_breaker_transitions_total{scope=\"backend:mock\",to=\"open\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing in\n{metrics}");
    }
    // The operator page's data: the breaker with its rule and value, and
    // the transition on the timeline.
    let history = sc.json("/v1/history").await;
    let b = history["breakers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["scope"] == "backend:mock")
        .unwrap_or_else(|| panic!("{history}"));
    assert_eq!(b["state"], "open");
    assert_eq!(history["backends"][0]["name"], "mock", "{history}");
    assert_eq!(history["backends"][0]["samples"]["vllm_waiting"], 80.0);
    let rule = b["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["metric"] == "vllm_waiting")
        .unwrap_or_else(|| panic!("{b}"));
    assert_eq!(
        (rule["value"].as_f64(), rule["hot"].as_bool()),
        (Some(80.0), Some(true))
    );
    assert!(
        history["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["scope"] == "backend:mock"
                && e["to"] == "open"
                && e["reason"]
                    .as_str()
                    .unwrap_or("")
                    .contains("vllm_waiting 80 >= 50")),
        "{history}"
    );

    // The queue drains: half-open (with the trickle), then closed.
    set_mock_metrics(mock, json!({"num_requests_waiting": 0})).await;
    let mut saw_half_open = false;
    loop {
        assert!(set_at.elapsed() < Duration::from_secs(15), "never closed");
        let s = sc.json(&format!("/v1/state?since={version}&wait=20")).await;
        version = s["version"].as_u64().unwrap();
        if let Some(b) = breaker(&s, "backend:mock") {
            if b["state"] == "half_open" {
                saw_half_open = true;
                assert_eq!(b["half_open_fraction"], 0.1);
            }
        } else {
            break;
        }
    }
    assert!(saw_half_open);

    // A full KV cache opens it on its own rule.
    set_mock_metrics(mock, json!({"kv_cache_usage_perc": 0.95})).await;
    let b = eventually(Duration::from_secs(5), "the KV-cache breaker", || async {
        breaker(&sc.json("/v1/state").await, "backend:mock").cloned()
    })
    .await;
    assert_eq!(b["reason"], "kv_cache 0.95 >= 0.9 for 1s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_switch_needs_the_token_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state_file = dir.path().join("state.json");
    let token_file = write(dir.path(), "token", "s3cret-s3cret-s3cret-0123456789ab\n");
    let args = [
        "--simulate",
        "--state-file",
        state_file.to_str().unwrap(),
        "--admin-token-file",
        token_file.to_str().unwrap(),
    ];
    let sc = Sidecar::start(dir.path(), &args, &[]);
    let on = json!({"active": true, "reason": "GPU fire drill"});
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("Bearer s3cret-s3cret-s3cre"),
        Some("s3cret-s3cret-s3cret-0123456789ab"),
    ] {
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", *a)).collect();
        let (status, body) = sc
            .call(Method::POST, "/v1/kill-switch", &headers, Some(on.clone()))
            .await;
        assert_eq!(status, 401, "{auth:?}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "unauthorized");
    }
    assert_eq!(sc.json("/v1/state").await["kill_switch"]["active"], false);
    assert!(!state_file.exists());

    let auth = [("authorization", "Bearer s3cret-s3cret-s3cret-0123456789ab")];
    let (status, body) = sc
        .call(Method::POST, "/v1/kill-switch", &auth, Some(on.clone()))
        .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["persisted"], true);
    let before = sc.json("/v1/state").await;
    assert_eq!(before["kill_switch"]["active"], true);
    assert_eq!(before["kill_switch"]["reason"], "GPU fire drill");
    assert!(sc
        .text("/metrics")
        .await
        .contains("sluice_sidecar_kill_switch_active 1"));
    drop(sc);

    // Restarted (the token now from the environment): still on.
    let args = ["--simulate", "--state-file", state_file.to_str().unwrap()];
    let sc = Sidecar::start(
        dir.path(),
        &args,
        &[("SLUICE_ADMIN_TOKEN", "env-token-0123456789abcdef-0123456")],
    );
    let after = sc.json("/v1/state").await;
    assert_eq!(after["kill_switch"], before["kill_switch"]);
    assert!(
        after["version"].as_u64() > before["version"].as_u64(),
        "a restart never repeats a version: {} then {}",
        before["version"],
        after["version"]
    );
    let (status, _) = sc
        .call(
            Method::POST,
            "/v1/kill-switch",
            &auth,
            Some(json!({"active": false})),
        )
        .await;
    assert_eq!(status, 401, "the old token is gone");
    let env_auth = [("authorization", "Bearer env-token-0123456789abcdef-0123456")];
    let (status, _) = sc
        .call(
            Method::POST,
            "/v1/kill-switch",
            &env_auth,
            Some(json!({"active": false})),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(sc.json("/v1/state").await["kill_switch"]["active"], false);
    let saved: Value = serde_json::from_slice(&std::fs::read(&state_file).unwrap()).unwrap();
    assert_eq!(saved["kill_switch"]["active"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_gpu_opens_and_stale_data_keeps_it_open() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(
        dir.path(),
        "sidecar.yaml",
        r#"
scrape_interval: 100ms
sources: {gpu: simulated}
rules:
  - {metric: gpu_utilization, open_at: 90, close_below: 80, open_for: 500ms, close_after: 200ms}
breaker: {stale_after: 1s}
"#,
    );
    let sc = Sidecar::start(
        dir.path(),
        &["--config", config.to_str().unwrap()],
        &[("SLUICE_ADMIN_TOKEN", "sim-token-0123456789abcdef-0123456")],
    );
    let auth = [("authorization", "Bearer sim-token-0123456789abcdef-0123456")];
    let (status, body) = sc
        .call(
            Method::POST,
            "/v1/simulate",
            &[],
            Some(json!({"gpus": [{"utilization": 95}]})),
        )
        .await;
    assert_eq!(status, 401, "faking the GPUs is an admin call: {body}");
    let (status, body) = sc
        .call(
            Method::POST,
            "/v1/simulate",
            &auth,
            Some(json!({"gpus": [{"utilization": 95, "memory_used_mb": 70000}]})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let open = eventually(Duration::from_secs(5), "the GPU breaker", || async {
        let s = sc.json("/v1/state").await;
        breaker(&s, "backend:local").cloned()
    })
    .await;
    assert_eq!(open["state"], "open");
    assert_eq!(open["reason"], "gpu_utilization 95 >= 90 for 500ms");
    let metrics = sc.text("/metrics").await;
    assert!(
        metrics.contains("sluice_sidecar_gpu_source_info{source=\"simulated\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "sluice_sidecar_gpu_utilization_percent{gpu=\"0\",name=\"Simulated GPU\"} 95"
        ),
        "{metrics}"
    );

    // The GPU source fails: after stale_after the scope is stale, and the
    // open breaker stays open (a GPU that fell off the bus often takes its
    // source with it; `on_stale: fail_open` only keeps a closed one closed).
    let (status, _) = sc
        .call(
            Method::POST,
            "/v1/simulate",
            &auth,
            Some(json!({"gpus": [], "fail": true})),
        )
        .await;
    assert_eq!(status, 200);
    let stale = eventually(Duration::from_secs(5), "stale, fail open", || async {
        let s = sc.json("/v1/state").await;
        (s["stale"] == true).then_some(s)
    })
    .await;
    assert_eq!(stale["breakers"][0]["scope"], "backend:local", "{stale}");
    assert_eq!(stale["breakers"][0]["state"], "open", "{stale}");
    let metrics = sc.text("/metrics").await;
    assert!(metrics.contains("sluice_sidecar_stale 1"), "{metrics}");
    assert!(
        metrics.contains("sluice_sidecar_scrape_errors_total{source=\"gpu\"}"),
        "{metrics}"
    );

    let (status, _) = sc
        .call(
            Method::POST,
            "/v1/simulate",
            &auth,
            Some(json!({"gpus": [{"utilization": 20}]})),
        )
        .await;
    assert_eq!(status, 200);
    eventually(Duration::from_secs(5), "fresh again", || async {
        (sc.json("/v1/state").await["stale"] == false).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_with_no_config_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let sc = Sidecar::start(dir.path(), &[], &[]);
    assert_eq!(sc.text("/healthz").await, "ok");
    let s = sc.json("/v1/state").await;
    assert_eq!(s["breakers"], json!([]));
    assert_eq!(s["kill_switch"]["active"], false);
    let metrics = sc.text("/metrics").await;
    // `none` here (no NVML: no made-up GPU); `nvml` on a GPU machine.
    assert!(
        metrics.contains("sluice_sidecar_gpu_source_info{source="),
        "{metrics}"
    );
    assert!(sc.text("/").await.contains("<h2>GPUs"));
    let (status, body) = sc
        .call(
            Method::POST,
            "/v1/kill-switch",
            &[("authorization", "Bearer x")],
            Some(json!({"active": true})),
        )
        .await;
    assert_eq!(status, 401, "no token configured: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_simulate_route_without_the_simulated_source() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "sidecar.yaml", "sources: {gpu: none}\n");
    let sc = Sidecar::start(
        dir.path(),
        &["--config", config.to_str().unwrap()],
        &[("SLUICE_ADMIN_TOKEN", "t-0123456789abcdef-0123456789abcd")],
    );
    for auth in [
        &[][..],
        &[("authorization", "Bearer t-0123456789abcdef-0123456789abcd")][..],
    ] {
        let (status, _) = sc
            .call(
                Method::POST,
                "/v1/simulate",
                auth,
                Some(json!({"gpus": [{"utilization": 99}]})),
            )
            .await;
        assert_eq!(status, 404);
    }
}

#[test]
fn check_sidecar_config_names_the_field() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/sidecar.example.yaml");
    let out = Command::new(BIN)
        .args(["check-sidecar-config", example])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("model:llama3.1:70b"));
    let dir = tempfile::tempdir().unwrap();
    let bad = write(dir.path(), "bad.yaml", "breaker:\n  stale_afterr: 5s\n");
    let out = Command::new(BIN)
        .args(["check-sidecar-config", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("breaker") && err.contains("stale_afterr"),
        "{err}"
    );
}
