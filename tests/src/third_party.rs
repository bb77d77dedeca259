//! Upstreams nobody here wrote: guidellm's `mock-server` (PyPI `guidellm`,
//! pinned in the Makefile, installed by `make third-party` into
//! `.venv/third-party`). It answers `/v1/chat/completions`,
//! `/v1/completions` and `/v1/responses` with its own token counting
//! (guidellm `mock_server/utils.py`: a word, a punctuation mark or a run of
//! whitespace is one token), so what sluice settles is what a server that
//! shares none of our assumptions reports.
//!
//! The server picks its own port from the command line; the harness gives
//! it a free loopback port and waits for `GET /v1/models` to answer.

use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{closed_addr, repo_root, ChildGuard, EnvoyConfig};

/// How long the Python server may take to import and bind on a loaded
/// machine (it imports transformers).
const GUIDELLM_STARTUP: Duration = Duration::from_secs(90);

/// The `guidellm` executable: `SLUICE_GUIDELLM`, else the one
/// `make third-party` installs; `Err` says why there is none.
pub fn guidellm_bin() -> Result<PathBuf, String> {
    let bin = std::env::var_os("SLUICE_GUIDELLM")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/third-party/bin/guidellm"));
    let probe = Command::new(&bin)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match probe {
        Ok(status) if status.success() => Ok(bin),
        _ => Err(format!(
            "{} does not run; `make third-party` installs it (make test does)",
            bin.display()
        )),
    }
}

/// A running `guidellm mock-server`, killed (with its process group) on drop.
pub struct GuidellmServer {
    guard: ChildGuard,
    dir: tempfile::TempDir,
    addr: SocketAddr,
}

impl GuidellmServer {
    /// Starts `guidellm mock-server --model MODEL` on a free loopback port
    /// with `extra` arguments (`--output-tokens`, `--ttft-ms`, …).
    pub fn start(bin: &Path, model: &str, extra: &[&str]) -> Result<GuidellmServer, String> {
        let mut last = String::new();
        // The port is free when probed; another process may take it before
        // the server binds, so a clash is retried.
        for _ in 0..3 {
            match GuidellmServer::try_start(bin, model, extra) {
                Ok(server) => return Ok(server),
                Err(log) if log.contains("in use") => last = log,
                Err(log) => return Err(log),
            }
        }
        Err(last)
    }

    fn try_start(bin: &Path, model: &str, extra: &[&str]) -> Result<GuidellmServer, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("bind 127.0.0.1:0: {e}"))?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let dir = tempfile::Builder::new()
            .prefix("sluice-guidellm-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let log = dir.path().join("out.log");
        let out = fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| format!("log: {e}"))?;
        let mut cmd = Command::new(bin);
        cmd.args(["mock-server", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--model", model, "--workers", "1"])
            .args(extra)
            .current_dir(dir.path())
            // Nothing is fetched at run time: no hub, no telemetry.
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let mut guard =
            ChildGuard::spawn("guidellm", &mut cmd).map_err(|e| format!("spawn guidellm: {e}"))?;
        let client = reqwest::blocking::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| format!("client: {e}"))?;
        let deadline = Instant::now() + GUIDELLM_STARTUP;
        let models = format!("http://{addr}/v1/models");
        loop {
            if client
                .get(&models)
                .send()
                .is_ok_and(|r| r.status().is_success())
            {
                return Ok(GuidellmServer { guard, dir, addr });
            }
            let text = fs::read_to_string(&log).unwrap_or_default();
            if let Some(status) = guard.try_wait() {
                return Err(format!(
                    "guidellm exited ({status}) before serving:\n{text}"
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "guidellm did not answer {models} in {GUIDELLM_STARTUP:?}:\n{text}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Its stdout and stderr so far (Sanic's access log among them).
    pub fn log(&self) -> String {
        fs::read(self.dir.path().join("out.log"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// How many `POST <path>` requests its access log shows answered.
    /// Sanic writes the line when the response is done, so wait for a
    /// count with [`crate::wait_for`] rather than reading it once.
    pub fn posts(&self, path: &str) -> usize {
        // `… POST http://<Host header><path> <status> …`: the host is
        // whatever the proxy forwarded, so only the path is matched.
        self.log()
            .lines()
            .filter(|l| {
                l.split_once(" POST http://")
                    .and_then(|(_, rest)| rest.split_once(' '))
                    .is_some_and(|(url, _)| url.find('/').is_some_and(|i| &url[i..] == path))
            })
            .count()
    }

    /// The process guard.
    pub fn process(&mut self) -> &mut ChildGuard {
        &mut self.guard
    }
}

/// The shipped Envoy config with `upstream` as the model upstream (the
/// penalty box off, the fallback and sidecar clusters closed), as
/// [`crate::shipped_config_for`] does for mock-llm.
pub fn shipped_config_for_addr(upstream: SocketAddr) -> EnvoyConfig {
    let mut cfg = EnvoyConfig::load_shipped();
    if let Some(policy) = cfg.policy_mut().as_mapping_mut() {
        policy.remove("abuse");
    }
    cfg.set_cluster_addr("llm_upstream", upstream);
    cfg.set_cluster_addr("llm_fallback", closed_addr());
    cfg.set_cluster_addr("sluice_sidecar", closed_addr());
    cfg
}
