//! GPU health from NVIDIA's DCGM exporter (issue 22, item 4): a test HTTP
//! server serves a DCGM exporter's `/metrics` in the exporter's own format
//! (`gpu-sidecar/testdata/dcgm-exporter.txt`: default counters, pod
//! mapping on, 4 H100s), the real sidecar scrapes it as `sources.dcgm[]`,
//! and its breakers reach a real Envoy running sluice.
//!
//! The fixture's GPUs 0–1 belong to pod `llm/vllm-llama-0`, GPU 2 to
//! `llm/vllm-mistral-0`, GPU 3 to nobody; the sidecar's DCGM source selects
//! the llama pod's GPUs for model `llama3.1:8b`, so only that model's
//! breaker moves, and `mistral:7b` is served throughout.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): GPU health
//! comes from the exporter, not from the inference server.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::Value as Json;
use serde_yaml::Value;
use sluice_tests::{
    bin_path, get, prometheus_value, repo_root, wait_for, EnvoyConfig, Response, Sidecar, Stack,
};

const MODEL: &str = "llama3.1:8b";
const OTHER_MODEL: &str = "mistral:7b";
const SCOPE: &str = "model:llama3.1:8b";
const SOURCE: &str = "gpu-node-7";
const RETRY_AFTER: u64 = 7;
/// The sidecar's round (and scrape) interval here.
const ROUND: Duration = Duration::from_millis(50);

fn fixture() -> String {
    let path = repo_root().join("gpu-sidecar/testdata/dcgm-exporter.txt");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `text` with `metric` of GPU `gpu` set to `value` (the exporter writes
/// `gpu` as the first label).
fn with(text: &str, metric: &str, gpu: u32, value: &str) -> String {
    let prefix = format!("{metric}{{gpu=\"{gpu}\",");
    let mut changed = 0;
    let out: Vec<String> = text
        .lines()
        .map(|l| {
            if l.starts_with(&prefix) {
                changed += 1;
                let (head, _) = l.rsplit_once(' ').expect("a sample line");
                format!("{head} {value}")
            } else {
                l.to_string()
            }
        })
        .collect();
    assert_eq!(changed, 1, "{metric} of GPU {gpu} is in the fixture once");
    out.join("\n") + "\n"
}

/// What the fake exporter does with a scrape.
#[derive(Clone)]
enum Answer {
    Metrics(String),
    /// Reads the request and never answers (a hung exporter).
    Hang,
}

/// A fake DCGM exporter: `GET /metrics` answered with what the test set.
struct Exporter {
    addr: SocketAddr,
    answer: Arc<Mutex<Answer>>,
    scrapes: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Exporter {
    fn start(text: String) -> Exporter {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let answer = Arc::new(Mutex::new(Answer::Metrics(text)));
        let scrapes = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, n, s) = (answer.clone(), scrapes.clone(), stop.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let answer = a.lock().expect("answer").clone();
                n.fetch_add(1, Ordering::SeqCst);
                thread::spawn(move || serve(conn, answer));
            }
        });
        Exporter {
            addr,
            answer,
            scrapes,
            stop,
        }
    }

    fn set(&self, answer: Answer) {
        *self.answer.lock().expect("answer") = answer;
    }

    fn scrapes(&self) -> usize {
        self.scrapes.load(Ordering::SeqCst)
    }

    /// Waits until the sidecar has scraped `n` more times: `n` rounds
    /// (each at least [`ROUND`] apart) saw what the test set before.
    fn wait_scrapes(&self, n: usize) {
        let target = self.scrapes() + n;
        assert!(
            wait_for(Duration::from_secs(20), || self.scrapes() >= target),
            "the sidecar stopped scraping"
        );
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

fn serve(mut conn: TcpStream, answer: Answer) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut req = Vec::new();
    let mut buf = [0u8; 4096];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let text = match answer {
        Answer::Metrics(text) => text,
        Answer::Hang => {
            // Hold the connection until the sidecar gives up on it.
            let _ = conn.read(&mut buf);
            return;
        }
    };
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        text.len()
    );
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(text.as_bytes());
}

/// A sidecar whose only source is the DCGM exporter at `exporter`,
/// selecting the llama pod's GPUs for [`MODEL`], with `rules` and
/// `on_stale` (and `sources.gpu: none`).
struct DcgmSidecar {
    sidecar: Sidecar,
    _dir: tempfile::TempDir,
}

impl DcgmSidecar {
    fn start(exporter: SocketAddr, rules: &str, on_stale: &str) -> DcgmSidecar {
        DcgmSidecar::start_with_gpu(exporter, rules, on_stale, "  gpu: none\n")
    }

    /// With `gpu` as the `sources.gpu` line (empty: the default, `auto`).
    fn start_with_gpu(exporter: SocketAddr, rules: &str, on_stale: &str, gpu: &str) -> DcgmSidecar {
        let dir = tempfile::Builder::new()
            .prefix("sluice-dcgm-test-")
            .tempdir()
            .expect("temp dir");
        let config = format!(
            "scrape_interval: {}ms\n\
             scrape_timeout: 300ms\n\
             sources:\n{gpu}  dcgm:\n    - name: {SOURCE}\n      url: http://{exporter}/metrics\n\
             \x20     models: [\"{MODEL}\"]\n      select: {{ namespace: llm, pod: \"vllm-llama-*\" }}\n\
             \x20     xid: {{ window: 2s }}\n\
             rules:\n{rules}\
             breaker: {{ half_open_fraction: 0, retry_after: {RETRY_AFTER}s, stale_after: 2s, on_stale: {on_stale} }}\n",
            ROUND.as_millis()
        );
        let path = dir.path().join("sidecar.yaml");
        std::fs::write(&path, config).expect("sidecar config");
        let path = path.display().to_string();
        let sidecar = Sidecar::start_with_args(&["--config", &path]);
        DcgmSidecar { sidecar, _dir: dir }
    }

    fn state(&self) -> Json {
        get(&self.sidecar.url("/v1/state"), &[]).ok().json()
    }

    /// The breaker of `scope` as published (`open`, …), `None` when closed.
    fn breaker(&self, scope: &str) -> Option<Json> {
        let state = self.state();
        state["breakers"]
            .as_array()
            .expect("breakers is a list")
            .iter()
            .find(|b| b["scope"] == scope)
            .cloned()
    }

    /// How often the breaker of `scope` has opened.
    fn opened(&self, scope: &str) -> f64 {
        prometheus_value(
            &self.metrics(),
            "sluice_sidecar_breaker_transitions_total",
            &[("scope", scope), ("to", "open")],
        )
        .unwrap_or(0.0)
    }

    fn metrics(&self) -> String {
        get(&self.sidecar.url("/metrics"), &[]).ok().body
    }

    /// What the monitor's last round saw of the DCGM source.
    fn source_status(&self) -> Json {
        let history = get(&self.sidecar.url("/v1/history"), &[]).ok().json();
        history["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .find(|b| b["name"] == SOURCE)
            .cloned()
            .unwrap_or_else(|| panic!("no backend {SOURCE} in {history}"))
    }

    fn wait_for_envoy(&self) {
        assert!(
            wait_for(Duration::from_secs(10), || {
                prometheus_value(&self.metrics(), "sluice_sidecar_long_poll_subscribers", &[])
                    .unwrap_or(0.0)
                    >= 1.0
            }),
            "Envoy never long-polled the sidecar:\n{}",
            self.sidecar.log()
        );
    }
}

fn stack_for(sidecar: &DcgmSidecar) -> Stack {
    Stack::start(|cfg: &mut EnvoyConfig| {
        cfg.set_cluster_addr("sluice_sidecar", sidecar.sidecar.addr());
        let p = cfg.policy_mut();
        let unlimited = || serde_yaml::from_str::<Value>("{requests: 100000/min}").expect("yaml");
        for tier in ["free", "pro", "enterprise"] {
            p["tiers"][tier] = unlimited();
        }
        for model in [MODEL, OTHER_MODEL] {
            p["models"][model]["requests"] = Value::from("100000/min");
        }
        // The breaker's own refusal is what these tests read, not the
        // rung that would take the request meanwhile.
        p["ladder_when_out"] = Value::from(false);
    })
}

fn assert_served(r: &Response) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-mock-name"), Some("primary"), "{r:?}");
}

/// 503 `gpu_overloaded` in the OpenAI shape with the sidecar's Retry-After.
fn assert_gpu_refused(r: &Response) {
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.header("x-sluice-reason"), Some("gpu_overloaded"), "{r:?}");
    assert!(
        r.header("x-mock-name").is_none(),
        "came from upstream: {r:?}"
    );
    assert_eq!(
        r.header("retry-after"),
        Some(RETRY_AFTER.to_string().as_str()),
        "{r:?}"
    );
    assert_eq!(r.json()["error"]["code"], "gpu_overloaded", "{}", r.body);
}

const TEMPERATURE_RULE: &str =
    "  - { metric: gpu_temperature, open_at: 85, close_below: 80, open_for: 300ms, close_after: 300ms }\n";
const XID_RULE: &str =
    "  - { metric: gpu_xid_errors, open_at: 1, close_below: 1, open_for: 0s, close_after: 0s }\n";

#[test]
fn a_hot_gpu_of_the_selected_pod_opens_its_models_breaker_in_envoy() {
    let exporter = Exporter::start(fixture());
    // `sources.gpu` left at `auto`: with a DCGM source it never falls
    // back to the simulated GPU (made-up readings would keep the scope
    // fresh while the exporter is down).
    let sc = DcgmSidecar::start_with_gpu(
        exporter.addr,
        &format!("{TEMPERATURE_RULE}{XID_RULE}"),
        "fail_open",
        "",
    );
    let stack = stack_for(&sc);
    sc.wait_for_envoy();
    exporter.wait_scrapes(3);
    assert_served(&stack.chat(MODEL, &[]));
    let history = get(&sc.sidecar.url("/v1/history"), &[]).ok().json();
    assert_ne!(history["gpu_source"], "simulated", "{}", sc.sidecar.log());
    // The selection's worst GPU (GPU 1: 63 °C, 47 %), not the node's.
    let status = sc.source_status();
    assert_eq!(status["kind"], "dcgm", "{status}");
    assert_eq!(status["up"], true, "{status}");
    assert_eq!(status["samples"]["gpu_temperature"], 63.0, "{status}");
    assert_eq!(status["samples"]["gpu_utilization"], 47.0, "{status}");
    assert_eq!(status["samples"]["gpu_xid_errors"], 0.0, "{status}");
    let up = prometheus_value(
        &sc.metrics(),
        "sluice_sidecar_backend_up",
        &[("backend", SOURCE), ("kind", "dcgm")],
    );
    assert_eq!(up, Some(1.0));

    // GPU 2 (the mistral pod's) at 95 °C for well past open_for: not
    // this model's GPU, nothing opens.
    exporter.set(Answer::Metrics(with(
        &fixture(),
        "DCGM_FI_DEV_GPU_TEMP",
        2,
        "95",
    )));
    exporter.wait_scrapes(12);
    assert_eq!(sc.breaker(SCOPE), None, "{}", sc.state());
    assert_eq!(
        sc.opened(SCOPE),
        0.0,
        "another pod's GPU opened the breaker"
    );
    assert_served(&stack.chat(MODEL, &[]));

    // GPU 1 at 95 °C: the model's breaker opens and Envoy refuses it.
    exporter.set(Answer::Metrics(with(
        &fixture(),
        "DCGM_FI_DEV_GPU_TEMP",
        1,
        "95",
    )));
    let mut refused = None;
    assert!(
        wait_for(Duration::from_secs(10), || {
            let r = stack.chat(MODEL, &[]);
            let done = r.status != 200;
            refused = Some(r);
            done
        }),
        "the breaker never reached Envoy: {}",
        sc.state()
    );
    assert_gpu_refused(&refused.expect("a refusal"));
    let b = sc.breaker(SCOPE).expect("the model's breaker");
    assert_eq!(b["state"], "open", "{b}");
    assert!(
        b["reason"]
            .as_str()
            .is_some_and(|r| r.contains("gpu_temperature 95 >= 85")),
        "{b}"
    );
    // The other model is on other GPUs: served.
    for _ in 0..5 {
        assert_served(&stack.chat(OTHER_MODEL, &[]));
    }

    // Cooled: closed again, served again.
    exporter.set(Answer::Metrics(fixture()));
    assert!(
        wait_for(Duration::from_secs(10), || stack.chat(MODEL, &[]).status
            == 200),
        "still refused after cooling: {}",
        sc.state()
    );
    assert_served(&stack.chat(MODEL, &[]));
}

#[test]
fn a_new_xid_opens_the_breaker_and_the_sticky_old_one_does_not() {
    // GPU 0 already shows XID 31 when the sidecar starts: the gauge keeps
    // the last XID until the exporter restarts, so it is the baseline.
    let sticky = with(&fixture(), "DCGM_FI_DEV_XID_ERRORS", 0, "31");
    let exporter = Exporter::start(sticky.clone());
    let sc = DcgmSidecar::start(exporter.addr, XID_RULE, "fail_open");
    let stack = stack_for(&sc);
    sc.wait_for_envoy();
    exporter.wait_scrapes(10);
    assert_eq!(sc.breaker(SCOPE), None, "{}", sc.state());
    // Not even briefly (the XID window is shorter than Envoy's start).
    assert_eq!(sc.opened(SCOPE), 0.0, "the sticky XID opened the breaker");
    assert_served(&stack.chat(MODEL, &[]));

    // XID 79 (fallen off the bus) on GPU 1: a new fault.
    exporter.set(Answer::Metrics(with(
        &sticky,
        "DCGM_FI_DEV_XID_ERRORS",
        1,
        "79",
    )));
    let mut refused = None;
    assert!(
        wait_for(Duration::from_secs(10), || {
            let r = stack.chat(MODEL, &[]);
            let done = r.status != 200;
            refused = Some(r);
            done
        }),
        "the XID never reached Envoy: {}",
        sc.state()
    );
    assert_gpu_refused(&refused.expect("a refusal"));
    let b = sc.breaker(SCOPE).expect("the model's breaker");
    assert!(
        b["reason"]
            .as_str()
            .is_some_and(|r| r.contains("gpu_xid_errors 1 >= 1")),
        "{b}"
    );
    assert_served(&stack.chat(OTHER_MODEL, &[]));
    // The gauge stays at 79; past the XID window (2 s) nothing new has
    // been seen and the breaker closes.
    assert!(
        wait_for(Duration::from_secs(15), || stack.chat(MODEL, &[]).status
            == 200),
        "still refused past the XID window: {}",
        sc.state()
    );
    assert_eq!(sc.source_status()["samples"]["gpu_xid_errors"], 0.0);
}

#[test]
fn a_hung_exporter_goes_stale_and_fails_closed_as_configured() {
    let exporter = Exporter::start(fixture());
    let sc = DcgmSidecar::start(exporter.addr, TEMPERATURE_RULE, "fail_closed");
    let stack = stack_for(&sc);
    sc.wait_for_envoy();
    exporter.wait_scrapes(3);
    assert_served(&stack.chat(MODEL, &[]));

    // Accepts, never answers: every scrape times out (300 ms), nothing is
    // fed, and after stale_after (2 s) on_stale: fail_closed opens.
    exporter.set(Answer::Hang);
    assert!(
        wait_for(Duration::from_secs(15), || stack.chat(MODEL, &[]).status
            == 503),
        "a hung exporter never failed closed: {}",
        sc.state()
    );
    assert_gpu_refused(&stack.chat(MODEL, &[]));
    let b = sc.breaker(SCOPE).expect("the model's breaker");
    assert!(
        b["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no fresh data") && r.contains("fail closed")),
        "{b}"
    );
    assert_eq!(sc.state()["stale"], true);
    let status = sc.source_status();
    assert_eq!(status["up"], false, "{status}");
    assert!(
        status["error"]
            .as_str()
            .is_some_and(|e| e.contains("no answer within")),
        "{status}"
    );
    let errors = prometheus_value(
        &sc.metrics(),
        "sluice_sidecar_scrape_errors_total",
        &[("source", SOURCE)],
    )
    .unwrap_or(0.0);
    assert!(errors >= 1.0, "failed scrapes are counted");

    // Answering again: fresh, the rule says closed.
    exporter.set(Answer::Metrics(fixture()));
    assert!(
        wait_for(Duration::from_secs(15), || stack.chat(MODEL, &[]).status
            == 200),
        "still refused after the exporter came back: {}",
        sc.state()
    );
}

#[test]
fn an_answer_without_the_pod_is_no_data_and_fails_open() {
    let exporter = Exporter::start(fixture());
    let sc = DcgmSidecar::start(exporter.addr, TEMPERATURE_RULE, "fail_open");
    let stack = stack_for(&sc);
    sc.wait_for_envoy();
    exporter.wait_scrapes(3);
    assert_served(&stack.chat(MODEL, &[]));

    // The pod was rescheduled elsewhere: the exporter answers 200, but no
    // GPU of it carries the pod's labels. That is no healthy reading: the
    // scope goes stale and, closed, fails open (the default), as when NVML
    // fails.
    let moved = fixture().replace("pod=\"vllm-llama-0\"", "pod=\"batch-job-3\"");
    exporter.set(Answer::Metrics(moved));
    assert!(
        wait_for(Duration::from_secs(15), || sc.state()["stale"] == true),
        "never went stale: {}",
        sc.state()
    );
    assert_served(&stack.chat(MODEL, &[]));
    let status = sc.source_status();
    assert!(
        status["error"]
            .as_str()
            .is_some_and(|e| e.contains("none of the 4 GPUs listed matches")),
        "{status}"
    );
}

/// Issue 29, item 9: a GPU that falls off the bus often takes its exporter
/// with it. Its breaker opened hot; the exporter then hangs; with
/// `on_stale: fail_open` the breaker used to close once the data went
/// stale (about 7 s later). An open breaker stays open while stale.
#[test]
fn an_open_breaker_stays_open_when_its_exporter_then_hangs() {
    let hot = with(&fixture(), "DCGM_FI_DEV_GPU_TEMP", 0, "95");
    let exporter = Exporter::start(hot);
    let sc = DcgmSidecar::start(exporter.addr, TEMPERATURE_RULE, "fail_open");
    let stack = stack_for(&sc);
    sc.wait_for_envoy();
    assert!(
        wait_for(Duration::from_secs(10), || stack.chat(MODEL, &[]).status
            == 503),
        "the breaker never opened: {}",
        sc.state()
    );
    exporter.set(Answer::Hang);
    assert!(
        wait_for(Duration::from_secs(15), || sc.state()["stale"] == true),
        "never went stale: {}",
        sc.state()
    );
    // Stale (past stale_after, 2 s): fail open used to close it in the
    // same evaluation that marked the scope stale. Still refused.
    assert_gpu_refused(&stack.chat(MODEL, &[]));
    let b = sc.breaker(SCOPE).expect("the model's breaker");
    assert_eq!(b["state"], "open", "{b}");
}

#[test]
fn check_config_accepts_and_refuses_dcgm_sources_with_field_paths() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |yaml: &str| {
        let path = dir.path().join("sidecar.yaml");
        std::fs::write(&path, yaml).expect("write");
        let out = std::process::Command::new(bin_path("sluice-sidecar"))
            .arg("check-config")
            .arg(&path)
            .output()
            .expect("run check-config");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let good = format!(
        "sources:\n  gpu: none\n  dcgm:\n    - {{ name: {SOURCE}, url: 'http://10.0.0.7:9400', \
         models: ['{MODEL}'], select: {{ namespace: llm, pod: 'vllm-llama-*' }} }}\n"
    );
    let (code, out) = run(&format!("{good}rules:\n{TEMPERATURE_RULE}{XID_RULE}"));
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(SCOPE) && !out.contains("warning"), "{out}");
    let (code, out) = run(&format!("{good}rules:\n{TEMPERATURE_RULE}"));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("warning") && out.contains("gpu_xid_errors"),
        "no XID rule is worth a warning: {out}"
    );
    for (bad, at) in [
        ("url: 'https://10.0.0.7:9400'", "sources.dcgm[0].url"),
        (
            "url: 'http://h:1', select: { 'k8s-pod': x }",
            "sources.dcgm[0].select.k8s-pod",
        ),
        (
            "url: 'http://h:1', interval: 1m",
            "sources.dcgm[0].interval",
        ),
        (
            "url: 'http://h:1', xid: { window: 0s }",
            "sources.dcgm[0].xid.window",
        ),
        ("url: 'http://h:1', selector: {}", "sources.dcgm[0]"),
    ] {
        let (code, out) = run(&format!("sources:\n  dcgm:\n    - {{ name: g, {bad} }}\n"));
        assert_eq!(code, Some(1), "{bad}: {out}");
        assert!(out.contains(&format!(": {at}")), "{bad}: {out}");
    }
}
