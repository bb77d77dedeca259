//! Deployment (issue 22): the OCI image of the filter (`make image`), Envoy's
//! own remote code source (`envoy/sluice-remote.yaml`), the kustomize tree
//! under `deploy/` and the sidecar reached under Istio's cluster name.
//!
//! Tools that come from Debian packages (`skopeo`, `docker-registry`,
//! `kubectl`) are used where present; where one is missing its test says so
//! and returns, unless `SLUICE_REQUIRE_OCI_TOOLS=1` (set by `make test`,
//! which installs skopeo and docker-registry) makes that a failure.
//! kubectl is in no package registry these machines reach: its absence is
//! always a printed skip, and everything it would check that needs no
//! rendering runs anyway.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): what is
//! deployed, not how a server reads a request.

use std::collections::BTreeSet;
use std::fs;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use serde_json::json;
use serde_yaml::Value;
use sha2::{Digest as _, Sha256};
use sluice_tests::deploy::{self, Release};
use sluice_tests::{
    bin_path, chat_body, closed_addr, get, post_json, repo_root, shipped_config_for, wait_for,
    wasm_path, ChildGuard, Envoy, EnvoyConfig, MockLlm, Sidecar,
};

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `tool` is there; when it is not, says so (the test then
/// returns), or fails when `SLUICE_REQUIRE_OCI_TOOLS=1`.
fn oci_tool(tool: &str, package: &str) -> bool {
    if have(tool) {
        return true;
    }
    let required = std::env::var("SLUICE_REQUIRE_OCI_TOOLS").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "{tool} is missing and SLUICE_REQUIRE_OCI_TOOLS=1: `make oci-tools` installs Debian's {package}"
    );
    eprintln!(
        "SKIPPED: {tool} not found (Debian package `{package}`; `make oci-tools` installs it)"
    );
    false
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `scripts/oci-image.py` on the built filter, into `out`; returns the
/// digest it printed last.
fn build_image(out: &Path) -> String {
    let stdout = run(Command::new("python3")
        .arg(repo_root().join("scripts/oci-image.py"))
        .arg("--wasm")
        .arg(wasm_path())
        .arg("--out")
        .arg(out));
    let digest = stdout.lines().last().unwrap_or_default().trim().to_string();
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "{stdout}"
    );
    digest
}

fn blob(layout: &Path, digest: &str) -> Vec<u8> {
    let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
    let bytes = fs::read(layout.join("blobs/sha256").join(hex)).expect("blob exists");
    assert_eq!(sha256_hex(&bytes), hex, "blob content matches its name");
    bytes
}

/// Files of a gzipped tar (name → bytes), read with the system's `tar`.
fn untar(tgz: &[u8], dir: &Path) -> Vec<(String, Vec<u8>)> {
    let archive = dir.join("layer.tar.gz");
    fs::write(&archive, tgz).expect("write layer");
    let listing = run(Command::new("tar").arg("-tzf").arg(&archive));
    let x = dir.join("x");
    fs::create_dir_all(&x).expect("mkdir");
    run(Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(&x));
    listing
        .lines()
        .map(|name| {
            let bytes = fs::read(x.join(name)).expect("extracted file");
            (name.to_string(), bytes)
        })
        .collect()
}

/// The manifest's one layer, checked against the compat variant of the
/// Wasm image spec; returns its `plugin.wasm`.
fn compat_plugin(manifest: &serde_json::Value, layer: &[u8], scratch: &Path) -> Vec<u8> {
    assert_eq!(manifest["schemaVersion"], 2, "{manifest}");
    assert_eq!(
        manifest["config"]["mediaType"], "application/vnd.oci.image.config.v1+json",
        "{manifest}"
    );
    assert_eq!(
        manifest["annotations"]["module.wasm.image/variant"], "compat",
        "{manifest}"
    );
    let layers = manifest["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 1, "one layer: {manifest}");
    assert_eq!(
        layers[0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip",
        "{manifest}"
    );
    let files = untar(layer, scratch);
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["plugin.wasm"], "the layer holds only plugin.wasm");
    files.into_iter().next().map(|(_, b)| b).unwrap_or_default()
}

/// A loopback HTTP server answering every request with `body`; counts them.
struct FileServer {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
}

impl FileServer {
    fn start(body: Vec<u8>) -> FileServer {
        FileServer::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), body)
    }

    fn start_on(addr: SocketAddr, body: Vec<u8>) -> FileServer {
        let listener = TcpListener::bind(addr).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = hits.clone();
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let body = body.clone();
                let counter = counter.clone();
                thread::spawn(move || {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    counter.fetch_add(1, Ordering::SeqCst);
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\ncontent-type: application/wasm\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = stream.write_all(&body);
                });
            }
        });
        FileServer { addr, hits }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// `envoy/sluice-remote.yaml`, pointed at `upstream`, the wasm at `server`
/// and checked against `sha256`, with the test-only edits of
/// [`shipped_config_for`] (no penalty box, sidecar and fallback closed).
fn remote_config(upstream: &MockLlm, server: SocketAddr, sha256: &str) -> EnvoyConfig {
    let mut cfg = EnvoyConfig::load(&repo_root().join("envoy/sluice-remote.yaml"));
    if let Some(policy) = cfg.policy_mut().as_mapping_mut() {
        policy.remove("abuse");
    }
    cfg.set_cluster_addr("llm_upstream", upstream.addr());
    cfg.set_cluster_addr("llm_fallback", closed_addr());
    cfg.set_cluster_addr("sluice_sidecar", closed_addr());
    cfg.set_cluster_addr("sluice_wasm_source", server);
    let remote = cfg
        .http_filter_mut("sluice")
        .get_mut("typed_config")
        .and_then(|t| t.get_mut("config"))
        .and_then(|c| c.get_mut("vm_config"))
        .and_then(|v| v.get_mut("code"))
        .and_then(|c| c.get_mut("remote"))
        .and_then(Value::as_mapping_mut)
        .expect("envoy/sluice-remote.yaml loads the filter with code.remote");
    remote.insert("sha256".into(), sha256.into());
    if let Some(uri) = remote.get_mut("http_uri").and_then(Value::as_mapping_mut) {
        uri.insert(
            "uri".into(),
            format!("http://{server}/sluice_filter.wasm").into(),
        );
    }
    cfg
}

fn chat_ok(envoy: &Envoy, upstream: &MockLlm) {
    let before = upstream.stats()["requests_total"].as_u64().unwrap_or(0);
    let r = post_json(
        &envoy.url("/v1/chat/completions"),
        &[("x-api-key", "demo-pro-key")],
        &chat_body("llama3.1:8b"),
    );
    assert_eq!(r.status, 200, "{r:?}");
    // sluice ran: an admitted answer carries its rate-limit headers.
    assert!(r.header("x-ratelimit-limit").is_some(), "{r:?}");
    let after = upstream.stats()["requests_total"].as_u64().unwrap_or(0);
    assert_eq!(after, before + 1, "the request reached the upstream once");
}

// ---------------------------------------------------------------------------
// The OCI image
// ---------------------------------------------------------------------------

/// `make image` twice gives the same digest and the same bytes; the image
/// is the compat variant with exactly one `plugin.wasm`, the built filter;
/// and Envoy loads the file taken out of the image and serves through it.
#[test]
fn image_is_reproducible_and_envoy_serves_the_module_it_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let digest = build_image(&a);
    assert_eq!(build_image(&b), digest, "two builds, one digest");
    let files = |p: &Path| -> Vec<(PathBuf, Vec<u8>)> {
        let mut v: Vec<_> = walk(p)
            .into_iter()
            .map(|f| {
                (
                    f.strip_prefix(p).expect("under").to_path_buf(),
                    fs::read(&f).expect("read"),
                )
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(files(&a), files(&b), "two builds, the same bytes");
    eprintln!("image digest: {digest}");

    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(a.join("index.json")).expect("index")).expect("json");
    assert_eq!(index["manifests"][0]["digest"], digest.as_str(), "{index}");
    let manifest: serde_json::Value =
        serde_json::from_slice(&blob(&a, &digest)).expect("manifest json");
    let layer = blob(
        &a,
        manifest["layers"][0]["digest"].as_str().expect("digest"),
    );
    let config: serde_json::Value = serde_json::from_slice(&blob(
        &a,
        manifest["config"]["digest"]
            .as_str()
            .expect("config digest"),
    ))
    .expect("config json");
    let plugin = compat_plugin(&manifest, &layer, dir.path());
    let built = fs::read(wasm_path()).expect("built filter");
    assert!(plugin == built, "plugin.wasm is the built filter");
    assert_eq!(
        manifest["annotations"]["io.sluice.plugin.wasm.sha256"],
        sha256_hex(&built).as_str()
    );
    // The config names the uncompressed layer (what registries check).
    let tar_sha = {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "gzip -dc {} | sha256sum",
                dir.path().join("layer.tar.gz").display()
            ))
            .output()
            .expect("gzip");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(
        config["rootfs"]["diff_ids"][0],
        format!("sha256:{tar_sha}").as_str()
    );

    // Envoy loads the module as extracted from the image.
    let extracted = dir.path().join("plugin.wasm");
    fs::write(&extracted, &plugin).expect("write plugin.wasm");
    let upstream = MockLlm::start("primary");
    let mut cfg = shipped_config_for(&upstream);
    *cfg.http_filter_mut("sluice")
        .get_mut("typed_config")
        .and_then(|t| t.get_mut("config"))
        .and_then(|c| c.get_mut("vm_config"))
        .and_then(|v| v.get_mut("code"))
        .expect("code") = serde_yaml::from_str(&format!(
        "local: {{ filename: {:?} }}",
        extracted.display().to_string()
    ))
    .expect("yaml");
    let envoy = Envoy::start(&cfg, 1);
    chat_ok(&envoy, &upstream);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).expect("read_dir").flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The image pushed to a registry (Debian's `docker-registry` on a
/// loopback port) with skopeo keeps its digest, and what is pulled back
/// holds exactly one `plugin.wasm`, the built filter.
#[test]
fn image_round_trips_through_a_local_registry_with_its_digest() {
    if !oci_tool("skopeo", "skopeo") || !oci_tool("docker-registry", "docker-registry") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let layout = dir.path().join("layout");
    let digest = build_image(&layout);
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let config = dir.path().join("registry.yml");
    fs::write(
        &config,
        format!(
            "version: 0.1\nlog: {{level: warn}}\nstorage:\n  filesystem: {{rootdirectory: {}}}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.path().join("data").display()
        ),
    )
    .expect("registry config");
    let _registry = ChildGuard::spawn(
        "docker-registry",
        Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .expect("start docker-registry");
    assert!(
        wait_for(Duration::from_secs(20), || {
            sluice_tests::request("GET", &format!("http://127.0.0.1:{port}/v2/"), &[], None)
                .is_ok_and(|r| r.status == 200)
        }),
        "docker-registry did not answer on 127.0.0.1:{port}"
    );
    let repo = format!("127.0.0.1:{port}/sluice/sluice-filter");
    run(Command::new("skopeo")
        .args([
            "copy",
            "--quiet",
            "--preserve-digests",
            "--dest-tls-verify=false",
        ])
        .arg(format!("oci:{}:0.1.0", layout.display()))
        .arg(format!("docker://{repo}:0.1.0")));
    let inspect = run(Command::new("skopeo")
        .args(["inspect", "--tls-verify=false"])
        .arg(format!("docker://{repo}:0.1.0")));
    let inspect: serde_json::Value = serde_json::from_str(&inspect).expect("inspect json");
    assert_eq!(
        inspect["Digest"],
        digest.as_str(),
        "the registry keeps the digest"
    );

    let pulled = dir.path().join("pulled");
    run(Command::new("skopeo")
        .args(["copy", "--quiet", "--src-tls-verify=false"])
        .arg(format!("docker://{repo}@{digest}"))
        .arg(format!("dir:{}", pulled.display())));
    let manifest_bytes = fs::read(pulled.join("manifest.json")).expect("manifest");
    assert_eq!(format!("sha256:{}", sha256_hex(&manifest_bytes)), digest);
    let manifest: serde_json::Value = serde_json::from_slice(&manifest_bytes).expect("json");
    let layer_hex = manifest["layers"][0]["digest"]
        .as_str()
        .and_then(|d| d.strip_prefix("sha256:"))
        .expect("layer digest")
        .to_string();
    let layer = fs::read(pulled.join(&layer_hex)).expect("layer blob");
    let plugin = compat_plugin(&manifest, &layer, dir.path());
    assert_eq!(
        sha256_hex(&plugin),
        sha256_hex(&fs::read(wasm_path()).expect("wasm")),
        "the pulled plugin.wasm is the built filter"
    );
}

/// Every pin of the module is the module `make build` produces: a stale
/// pin ships an Envoy that is `/ready` LIVE while every request gets 503
/// (its log says "retry limit exceeded" for the remote fetch, not that the
/// hash differs). `make image` rewrites the pins and the manifests.
#[test]
fn every_pin_of_the_wasm_is_the_built_one() {
    let root = repo_root();
    let built = sha256_hex(&fs::read(wasm_path()).expect("built filter"));
    let release = Release::load(&root).expect("release.env");
    assert_eq!(
        release.wasm_sha256, built,
        "deploy/release.env WASM_SHA256 is not the built filter's SHA-256: run `make image`"
    );
    let remote = fs::read_to_string(root.join("envoy/sluice-remote.yaml")).expect("remote");
    let pins: Vec<&str> = remote
        .lines()
        .filter_map(|l| l.trim().strip_prefix("sha256:"))
        .map(str::trim)
        .collect();
    assert!(!pins.is_empty(), "envoy/sluice-remote.yaml pins no sha256");
    for pin in pins {
        assert_eq!(
            pin, built,
            "envoy/sluice-remote.yaml pins another module than the built one: run `make image`"
        );
    }
}

// ---------------------------------------------------------------------------
// Envoy's remote code source
// ---------------------------------------------------------------------------

/// `envoy/sluice-remote.yaml`: Envoy fetches the module over HTTP, checks
/// its SHA-256 and serves through it.
#[test]
fn remote_code_with_the_right_sha256_is_fetched_and_serves() {
    let wasm = fs::read(wasm_path()).expect("wasm");
    let server = FileServer::start(wasm.clone());
    let upstream = MockLlm::start("primary");
    let cfg = remote_config(&upstream, server.addr, &sha256_hex(&wasm));
    let envoy = Envoy::start(&cfg, 2);
    assert!(server.hits() >= 1, "Envoy fetched the module");
    chat_ok(&envoy, &upstream);
}

/// A module whose SHA-256 is not the configured one is never run. What
/// Envoy 1.40 does (checked here): the fetch counts as failed ("Retry limit
/// exceeded"), the plugin does not load, the listener still starts, and
/// with the shipped `failure_policy: FAIL_CLOSED` Envoy answers every
/// request on it 503 itself: nothing reaches the upstream unchecked. (With
/// FAIL_OPEN the requests would go through without sluice: never ship that.)
#[test]
fn remote_code_with_a_wrong_sha256_is_refused_and_nothing_is_served() {
    let wasm = fs::read(wasm_path()).expect("wasm");
    let server = FileServer::start(wasm.clone());
    let upstream = MockLlm::start("primary");
    let mut tampered = wasm.clone();
    tampered.extend_from_slice(b"\0");
    let wrong = sha256_hex(&tampered);
    let mut cfg = remote_config(&upstream, server.addr, &wrong);
    assert_eq!(
        cfg.http_filter_mut("sluice")["typed_config"]["config"]["failure_policy"],
        "FAIL_CLOSED",
        "envoy/sluice-remote.yaml fails closed"
    );
    let envoy = Envoy::start(&cfg, 2);
    assert!(server.hits() >= 1, "Envoy fetched the module");
    assert!(
        wait_for(Duration::from_secs(10), || envoy
            .log()
            .contains("Plugin configured to fail closed failed to load")),
        "Envoy says the plugin did not load:\n{}",
        envoy.log()
    );
    for _ in 0..5 {
        let r = post_json(
            &envoy.url("/v1/chat/completions"),
            &[("x-api-key", "demo-pro-key")],
            &chat_body("llama3.1:8b"),
        );
        assert_eq!(r.status, 503, "{r:?}");
        assert!(r.header("x-ratelimit-limit").is_none(), "{r:?}");
    }
    assert_eq!(
        upstream.stats()["requests_total"].as_u64(),
        Some(0),
        "nothing reached the upstream"
    );
}

/// The server holding the module is down when Envoy starts: the same as a
/// wrong SHA-256. The plugin does not load, and every request on the
/// listener gets Envoy's own 503 until a listener update fetches the module:
/// with `code.remote` the artifact server is on the start path.
#[test]
fn remote_code_unreachable_at_start_fails_closed() {
    let wasm = fs::read(wasm_path()).expect("wasm");
    let upstream = MockLlm::start("primary");
    let cfg = remote_config(&upstream, closed_addr(), &sha256_hex(&wasm));
    let envoy = Envoy::start(&cfg, 1);
    assert!(
        wait_for(Duration::from_secs(20), || envoy
            .log()
            .contains("Plugin configured to fail closed failed to load")),
        "Envoy says the plugin did not load:\n{}",
        envoy.log()
    );
    let r = post_json(
        &envoy.url("/v1/chat/completions"),
        &[("x-api-key", "demo-pro-key")],
        &chat_body("llama3.1:8b"),
    );
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(upstream.stats()["requests_total"].as_u64(), Some(0));
}

/// After a failed fetch, a listener update whose fetch succeeds brings
/// sluice back: the fix for a bad or missing module is a config push, not
/// an Envoy restart.
#[test]
fn remote_code_recovers_at_the_next_listener_update() {
    let wasm = fs::read(wasm_path()).expect("wasm");
    let upstream = MockLlm::start("primary");
    let sha = sha256_hex(&wasm);
    // A port nothing listens on yet; the module server comes up there later.
    let addr = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port");
    let envoy = Envoy::start(&remote_config(&upstream, addr, &sha), 1);
    assert!(wait_for(Duration::from_secs(20), || envoy
        .log()
        .contains("Plugin configured to fail closed failed to load")));
    let server = FileServer::start_on(addr, wasm);
    // A listener update (here: another URI on the same server) fetches again.
    let mut cfg = remote_config(&upstream, addr, &sha);
    cfg.http_filter_mut("sluice")["typed_config"]["config"]["vm_config"]["code"]["remote"]
        ["http_uri"]["uri"] = format!("http://{addr}/sluice_filter.wasm?update=1").into();
    envoy.reload(&cfg).expect("reload");
    assert!(
        wait_for(Duration::from_secs(20), || {
            post_json(
                &envoy.url("/v1/chat/completions"),
                &[("x-api-key", "demo-pro-key")],
                &chat_body("llama3.1:8b"),
            )
            .status
                == 200
        }),
        "sluice serves after the update:\n{}",
        envoy.log()
    );
    assert!(server.hits() >= 1);
}

/// Why the shipped configs say FAIL_CLOSED: with FAIL_OPEN, Envoy runs the
/// listener without a filter that failed to load, and requests reach the
/// upstream unchecked (no sluice headers).
#[test]
fn remote_code_with_a_wrong_sha256_under_fail_open_lets_requests_through_unchecked() {
    let wasm = fs::read(wasm_path()).expect("wasm");
    let server = FileServer::start(wasm.clone());
    let upstream = MockLlm::start("primary");
    let mut tampered = wasm;
    tampered.push(0);
    let mut cfg = remote_config(&upstream, server.addr, &sha256_hex(&tampered));
    cfg.http_filter_mut("sluice")["typed_config"]["config"]["failure_policy"] = "FAIL_OPEN".into();
    let envoy = Envoy::start(&cfg, 1);
    assert!(wait_for(Duration::from_secs(20), || envoy
        .log()
        .contains("failed to load")));
    let r = post_json(
        &envoy.url("/v1/chat/completions"),
        &[("x-api-key", "demo-pro-key")],
        &chat_body("llama3.1:8b"),
    );
    eprintln!("FAIL_OPEN answer: {r:?}");
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        r.header("x-ratelimit-limit").is_none(),
        "sluice did not run: {r:?}"
    );
    assert_eq!(upstream.stats()["requests_total"].as_u64(), Some(1));
}

// ---------------------------------------------------------------------------
// The sidecar under Istio's cluster name
// ---------------------------------------------------------------------------

const ISTIO_TEST_TOKEN: &str = "deploy-test-admin-token-0123456789";

/// The sidecar (answering the Service's host), a primary and a fallback
/// mock-llm, and Envoy whose sidecar cluster has Istio's name, with the
/// Istio overlay's `sidecar` section (`authority` as given).
fn istio_named_stack(
    authority: Option<&str>,
) -> (tempfile::TempDir, Sidecar, MockLlm, MockLlm, Envoy) {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("token"), ISTIO_TEST_TOKEN).expect("token file");
    let host = deploy::sidecar_host();
    let sidecar = Sidecar::start_with_args(&[
        "--simulate",
        "--admin-token-file",
        &dir.path().join("token").display().to_string(),
        "--state-file",
        &dir.path().join("state.json").display().to_string(),
        "--allowed-host",
        &host,
    ]);
    let upstream = MockLlm::start("primary");
    let fallback = MockLlm::start("fallback");
    let mut cfg = shipped_config_for(&upstream);
    cfg.set_cluster_addr("llm_fallback", fallback.addr());
    cfg.set_cluster_addr("sluice_sidecar", sidecar.addr());
    let istio_name = deploy::istio_sidecar_cluster();
    assert_eq!(
        istio_name,
        "outbound|9911||sluice-sidecar.sluice.svc.cluster.local"
    );
    cfg.cluster_mut("sluice_sidecar")
        .as_mapping_mut()
        .expect("cluster map")
        .insert("name".into(), istio_name.clone().into());
    cfg.cluster_mut(&istio_name)
        .get_mut("load_assignment")
        .and_then(Value::as_mapping_mut)
        .expect("load_assignment")
        .insert("cluster_name".into(), istio_name.clone().into());
    let istio_policy = deploy::policy_for(&cfg, &istio_name, authority);
    cfg.policy_mut()["sidecar"] = istio_policy["sidecar"].clone();
    let envoy = Envoy::start(&cfg, 2);
    (dir, sidecar, upstream, fallback, envoy)
}

/// Under Istio the sidecar's cluster is named `outbound|9911||<service
/// host>`: a policy naming that cluster (and the Service's host as
/// `sidecar.authority`, which the sidecar allows with `--allowed-host`)
/// long-polls the sidecar and follows its kill switch.
#[test]
fn sidecar_reached_under_istios_cluster_name_works() {
    let host = deploy::sidecar_host();
    let istio_name = deploy::istio_sidecar_cluster();
    let token = ISTIO_TEST_TOKEN;
    let (_dir, sidecar, _upstream, _fallback, envoy) = istio_named_stack(Some(&host));

    let polls_ok = || {
        let text = get(&sidecar.url("/metrics"), &[]).body;
        sluice_tests::prometheus_value(&text, "sluice_sidecar_long_poll_subscribers", &[])
            .unwrap_or(0.0)
            >= 1.0
    };
    assert!(
        wait_for(Duration::from_secs(20), polls_ok),
        "Envoy long-polls the sidecar through `{istio_name}`:\n{}\n{}",
        envoy.log(),
        sidecar.log()
    );
    let on = post_json(
        &sidecar.url("/v1/kill-switch"),
        &[("authorization", &format!("Bearer {token}"))],
        &json!({"active": true, "reason": "deploy test"}),
    );
    assert_eq!(on.status, 200, "{on:?}");
    let chat = || {
        post_json(
            &envoy.url("/v1/chat/completions"),
            &[("x-api-key", "demo-pro-key")],
            &chat_body("llama3.1:8b"),
        )
    };
    assert!(
        wait_for(Duration::from_secs(10), || chat().header("x-mock-name")
            == Some("fallback")),
        "the kill switch reached Envoy through `{istio_name}`:\n{}",
        envoy.log()
    );
}

/// Without `sidecar.authority` the filter sends the cluster's name as the
/// Host, `outbound|9911||…`, which the sidecar's door refuses (421, DNS
/// rebinding): why the Istio policy sets `authority`.
#[test]
fn istios_cluster_name_without_authority_is_refused_by_the_sidecars_door() {
    let (_dir, sidecar, _upstream, _fallback, envoy) = istio_named_stack(None);
    assert!(
        wait_for(Duration::from_secs(20), || sidecar
            .log()
            .contains("refused for their Host")),
        "the sidecar refuses the cluster name as Host:\n{}",
        sidecar.log()
    );
    assert!(
        wait_for(Duration::from_secs(20), || envoy
            .metric("sluice_sidecar_poll_errors_total", &[])
            .is_some_and(|n| n >= 1.0)),
        "the filter counts failed polls:\n{}",
        envoy.log()
    );
}

// ---------------------------------------------------------------------------
// deploy/: generated files, YAML, kustomizations, rendering
// ---------------------------------------------------------------------------

/// Every generated file is what `make deploy-manifests` makes from the
/// current `envoy/` and `deploy/release.env`: the rules, the dashboard, the
/// policy and the remote-code config never drift from what the tests load.
#[test]
fn generated_deploy_files_are_in_sync_with_envoy() {
    let root = repo_root();
    let mut stale = Vec::new();
    for (rel, text) in deploy::generated_files(&root).expect("render") {
        if fs::read_to_string(root.join(&rel)).ok().as_deref() != Some(text.as_str()) {
            stale.push(rel);
        }
    }
    assert!(
        stale.is_empty(),
        "out of date (run `make deploy-manifests` and commit): {stale:?}"
    );
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = walk(dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    v.sort();
    v
}

fn docs(path: &Path) -> Vec<Value> {
    let text = fs::read_to_string(path).expect("read");
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            serde::Deserialize::deserialize(d)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()))
        })
        .collect()
}

/// Every YAML file under `deploy/` parses, and every path a kustomization
/// names (`resources`, `patches`, `components`, generators' files) exists:
/// checked without kubectl, always.
#[test]
fn every_deploy_yaml_parses_and_every_kustomization_path_exists() {
    let root = repo_root().join("deploy");
    let files = yaml_files(&root);
    assert!(files.len() >= 10, "{files:?}");
    let mut kustomizations = 0;
    for file in &files {
        let all = docs(file);
        if file.file_name().is_some_and(|n| n == "kustomization.yaml") {
            kustomizations += 1;
            let k = &all[0];
            let dir = file.parent().expect("dir");
            let mut named: Vec<String> = Vec::new();
            for key in ["resources", "components"] {
                for r in k[key].as_sequence().into_iter().flatten() {
                    named.push(r.as_str().expect("path").to_string());
                }
            }
            for p in k["patches"].as_sequence().into_iter().flatten() {
                if let Some(path) = p["path"].as_str() {
                    named.push(path.to_string());
                }
            }
            for g in ["configMapGenerator", "secretGenerator"] {
                for gen in k[g].as_sequence().into_iter().flatten() {
                    for f in gen["files"].as_sequence().into_iter().flatten() {
                        let f = f.as_str().expect("file");
                        named.push(f.split_once('=').map_or(f, |(_, p)| p).to_string());
                    }
                }
            }
            for rel in named {
                assert!(
                    dir.join(&rel).exists(),
                    "{} names `{rel}`, which does not exist",
                    file.display()
                );
            }
        } else {
            for d in &all {
                if d.is_null() {
                    continue;
                }
                assert!(
                    d["apiVersion"].is_string() && d["kind"].is_string(),
                    "{}: every object has apiVersion and kind",
                    file.display()
                );
            }
        }
    }
    assert!(kustomizations >= 5, "{kustomizations} kustomizations");
}

/// Runs `sluice-sidecar check-config` on every policy the objects carry (a
/// `policy.yaml` ConfigMap, the Istio EnvoyFilter's extension config, an
/// EnvoyExtensionPolicy's config); returns how many.
fn check_policies(what: &str, objects: &[Value]) -> usize {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut checked = 0;
    for d in objects {
        let policy = match d["kind"].as_str() {
            Some("ConfigMap") if d["data"]["policy.yaml"].is_string() => {
                serde_yaml::from_str::<Value>(d["data"]["policy.yaml"].as_str().unwrap_or(""))
                    .expect("policy.yaml parses")
            }
            Some("EnvoyFilter") => {
                istio_extension(d)["typed_config"]["config"]["configuration"]["value"].clone()
            }
            Some("EnvoyExtensionPolicy") => d["spec"]["wasm"][0]["config"].clone(),
            _ => continue,
        };
        let out = dir.path().join(format!("policy-{checked}.yaml"));
        fs::write(&out, serde_yaml::to_string(&policy).expect("yaml")).expect("write");
        let status = Command::new(bin_path("sluice-sidecar"))
            .arg("check-config")
            .arg(&out)
            .output()
            .expect("check-config");
        assert!(
            status.status.success(),
            "{what}: {} is refused: {}",
            d["kind"].as_str().unwrap_or("?"),
            String::from_utf8_lossy(&status.stderr)
        );
        checked += 1;
    }
    checked
}

/// The policies the manifests carry pass `sluice-sidecar check-config`
/// (as Envoy would accept them), and every image is pinned by digest.
#[test]
fn shipped_policies_pass_check_config_and_images_are_pinned() {
    let root = repo_root();
    let mut checked = 0;
    for file in yaml_files(&root.join("deploy")) {
        checked += check_policies(&file.display().to_string(), &docs(&file));
    }
    assert!(checked >= 4, "{checked} policies checked");
    let release = Release::load(&root).expect("release.env");
    for image in [
        release.filter_ref(),
        release.sidecar_image.clone(),
        release.redis_image.clone(),
    ] {
        assert!(pinned(&image), "{image} is pinned by digest");
    }
}

/// The sidecar configs the manifests mount pass `check-sidecar-config`,
/// with what they name under /etc/sluice (the policy ConfigMap of the same
/// overlay, the Secrets) laid out in a temp dir as the pod would see it.
#[test]
fn shipped_sidecar_configs_pass_check_sidecar_config() {
    let root = repo_root();
    for (config, policy) in [
        ("deploy/base/sidecar-config.yaml", "deploy/base/policy.yaml"),
        (
            "deploy/overlays/fleet/sidecar-config.yaml",
            "deploy/overlays/fleet/policy.yaml",
        ),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let etc = dir.path().join("etc/sluice");
        for sub in ["policy", "admin", "fleet"] {
            fs::create_dir_all(etc.join(sub)).expect("mkdir");
        }
        let policy_doc = &docs(&root.join(policy))[0];
        fs::write(
            etc.join("policy/policy.yaml"),
            policy_doc["data"]["policy.yaml"]
                .as_str()
                .expect("policy.yaml"),
        )
        .expect("policy");
        for (f, v) in [
            ("admin/token", "0123456789abcdef0123"),
            ("fleet/secret", "fedcba9876543210fedc"),
            ("fleet/redis-password", "redis-password-for-the-test"),
        ] {
            fs::write(etc.join(f), v).expect("secret");
        }
        let doc = &docs(&root.join(config))[0];
        let text = doc["data"]["sidecar.yaml"]
            .as_str()
            .expect("sidecar.yaml")
            .replace("/etc/sluice/", &format!("{}/", etc.display()));
        let file = dir.path().join("sidecar.yaml");
        fs::write(&file, text).expect("write");
        let out = Command::new(bin_path("sluice-sidecar"))
            .arg("check-sidecar-config")
            .arg(&file)
            .output()
            .expect("check-sidecar-config");
        assert!(
            out.status.success(),
            "{config}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn pinned(image: &str) -> bool {
    image.split_once("@sha256:").is_some_and(|(repo, hex)| {
        !repo.is_empty() && hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// Checks objects as Kubernetes gets them: every image pinned by digest, and
/// the Istio and Envoy Gateway resources with the fields their APIs need.
/// Returns the kinds seen.
/// `by_component`: image names the images component pins (allowed in the
/// files as written, never in rendered output).
fn check_objects(
    what: &str,
    objects: &[Value],
    release: &Release,
    by_component: &[String],
) -> BTreeSet<String> {
    let mut kinds = BTreeSet::new();
    for o in objects {
        let Some(kind) = o["kind"].as_str() else {
            continue;
        };
        kinds.insert(kind.to_string());
        for image in images_in(o) {
            assert!(
                pinned(&image) || by_component.contains(&image),
                "{what}: {kind} runs {image}, not pinned by digest"
            );
        }
        let s = &o["spec"];
        match kind {
            "EnvoyFilter" => {
                assert_eq!(o["apiVersion"], "networking.istio.io/v1alpha3", "{what}");
                assert!(
                    s["workloadSelector"]["labels"].is_mapping(),
                    "{what}: workloadSelector"
                );
                let config = &istio_extension(o)["typed_config"]["config"];
                assert_eq!(
                    config["allow_on_headers_stop_iteration"], true,
                    "{what}: sluice reads the body before the route is chosen"
                );
                assert_eq!(config["failure_policy"], "FAIL_CLOSED", "{what}");
                let remote = &config["vm_config"]["code"]["remote"];
                assert_eq!(
                    remote["http_uri"]["uri"],
                    format!("oci://{}", release.filter_ref()).as_str(),
                    "{what}"
                );
                assert_eq!(
                    remote["sha256"],
                    release.filter_digest.trim_start_matches("sha256:"),
                    "{what}"
                );
                assert_eq!(
                    config["configuration"]["value"]["sidecar"]["cluster"],
                    deploy::istio_sidecar_cluster().as_str(),
                    "{what}"
                );
                let filter = &istio_http_filter_patch(o)["patch"]["value"];
                assert_eq!(filter["name"], deploy::ISTIO_EXTENSION_NAME, "{what}");
                assert!(
                    filter["config_discovery"]["config_source"]["ads"].is_mapping(),
                    "{what}: the filter loads the extension over ADS"
                );
            }
            "EnvoyPatchPolicy" => {
                assert_eq!(o["apiVersion"], "gateway.envoyproxy.io/v1alpha1", "{what}");
                assert_eq!(s["type"], "JSONPatch", "{what}");
                assert_eq!(s["targetRef"]["kind"], "Gateway", "{what}");
                assert_eq!(s["targetRef"]["name"], deploy::EG_GATEWAY, "{what}");
                let patch = &s["jsonPatches"][0];
                assert_eq!(
                    patch["type"], "type.googleapis.com/envoy.config.listener.v3.Listener",
                    "{what}"
                );
                assert_eq!(patch["name"], deploy::eg_listener_name().as_str(), "{what}");
                assert_eq!(patch["operation"]["value"], true, "{what}");
            }
            "EnvoyExtensionPolicy" => {
                assert_eq!(o["apiVersion"], "gateway.envoyproxy.io/v1alpha1", "{what}");
                let target = &s["targetRefs"][0];
                assert!(
                    target["group"].is_string()
                        && target["kind"].is_string()
                        && target["name"].is_string(),
                    "{what}: targetRefs"
                );
                let code = &s["wasm"][0]["code"];
                assert_eq!(code["type"], "Image", "{what}");
                assert_eq!(
                    code["image"]["url"],
                    release.filter_ref().as_str(),
                    "{what}"
                );
                assert_eq!(
                    code["image"]["sha256"],
                    release.filter_digest.trim_start_matches("sha256:"),
                    "{what}"
                );
                assert_eq!(s["wasm"][0]["failOpen"], false, "{what}");
            }
            _ => {}
        }
    }
    kinds
}

/// The objects under `deploy/` as written (no kubectl needed): images
/// pinned, the mesh resources complete.
#[test]
fn deploy_objects_pin_images_and_carry_the_mesh_fields() {
    let root = repo_root();
    let release = Release::load(&root).expect("release.env");
    let component = &docs(&root.join("deploy/components/images/kustomization.yaml"))[0];
    let by_component: Vec<String> = component["images"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|i| {
            let pinned_here = i["newName"].is_string()
                && i["digest"]
                    .as_str()
                    .is_some_and(|d| pinned(&format!("x@{d}")));
            pinned_here
                .then(|| i["name"].as_str().map(str::to_string))
                .flatten()
        })
        .collect();
    assert_eq!(by_component, ["sluice-sidecar", "redis"], "{component:?}");
    let mut kinds = BTreeSet::new();
    for file in yaml_files(&root.join("deploy")) {
        if file.file_name().is_some_and(|n| n == "kustomization.yaml") {
            continue;
        }
        kinds.extend(check_objects(
            &file.display().to_string(),
            &docs(&file),
            &release,
            &by_component,
        ));
    }
    for kind in [
        "EnvoyFilter",
        "EnvoyPatchPolicy",
        "EnvoyExtensionPolicy",
        "EnvoyProxy",
        "PrometheusRule",
        "ServiceMonitor",
    ] {
        assert!(kinds.contains(kind), "deploy/ has no {kind}: {kinds:?}");
    }
}

/// Every overlay renders with `kubectl kustomize`; the rendered objects are
/// all in the namespace, pin every image by digest (the images component
/// applied), and the Istio and Envoy Gateway resources carry the fields
/// their APIs need. kubectl is in no package registry here: when it is
/// missing this test says so and returns (the tests above still run).
#[test]
fn overlays_render_with_kubectl_kustomize() {
    if !have("kubectl") {
        eprintln!(
            "SKIPPED: kubectl not found (in no package registry these machines reach); \
             the YAML, path, policy, image and field checks above ran without it"
        );
        return;
    }
    let root = repo_root();
    let release = Release::load(&root).expect("release.env");
    let mut kinds_seen = BTreeSet::new();
    for overlay in ["istio", "envoy-gateway", "fleet"] {
        let dir = root.join("deploy/overlays").join(overlay);
        let text = run(Command::new("kubectl").arg("kustomize").arg(&dir));
        let objects: Vec<Value> = serde_yaml::Deserializer::from_str(&text)
            .map(|d| serde::Deserialize::deserialize(d).expect("rendered YAML"))
            .collect();
        assert!(!objects.is_empty(), "{overlay} renders objects");
        for o in &objects {
            let kind = o["kind"].as_str().expect("kind");
            if kind == "Namespace" {
                assert_eq!(o["metadata"]["name"], deploy::NAMESPACE, "{overlay}");
            } else {
                assert_eq!(
                    o["metadata"]["namespace"],
                    deploy::NAMESPACE,
                    "{overlay}: {kind} is in the namespace"
                );
            }
        }
        kinds_seen.extend(check_objects(overlay, &objects, &release, &[]));
        assert!(
            check_policies(overlay, &objects) >= 2,
            "{overlay}: its rendered policies pass check-config"
        );
    }
    for kind in [
        "Deployment",
        "Service",
        "ConfigMap",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "StatefulSet",
        "EnvoyFilter",
        "EnvoyPatchPolicy",
        "EnvoyExtensionPolicy",
        "EnvoyProxy",
        "PrometheusRule",
        "ServiceMonitor",
    ] {
        assert!(
            kinds_seen.contains(kind),
            "no overlay renders a {kind}: {kinds_seen:?}"
        );
    }
}

fn images_in(v: &Value) -> Vec<String> {
    let mut out = Vec::new();
    match v {
        Value::Mapping(m) => {
            for (k, val) in m {
                if k.as_str() == Some("image") {
                    if let Some(s) = val.as_str() {
                        out.push(s.to_string());
                    }
                }
                out.extend(images_in(val));
            }
        }
        Value::Sequence(s) => s.iter().for_each(|x| out.extend(images_in(x))),
        _ => {}
    }
    out
}

// ---------------------------------------------------------------------------
// What a mesh's Wasm API gives the filter
// ---------------------------------------------------------------------------

/// Istio's WasmPlugin and Envoy Gateway's EnvoyExtensionPolicy write the
/// Wasm filter's PluginConfig themselves and do not set
/// `allow_on_headers_stop_iteration` (envoyproxy/gateway#8382 asks for it).
/// Without it Envoy 1.40 turns sluice's pause on the request headers into
/// StopAllIterationAndWatermark and never hands it the body: a POST to an
/// LLM API hangs. It fails safe (nothing reaches the upstream unread), but
/// it does not serve: why the Istio overlay ships an EnvoyFilter instead of
/// a WasmPlugin and the Envoy Gateway overlay an EnvoyPatchPolicy (tested
/// below). This test pins the behaviour so a change is noticed.
#[test]
fn without_allow_on_headers_stop_iteration_a_post_never_reaches_the_upstream() {
    let stack = sluice_tests::Stack::start(|cfg| {
        cfg.http_filter_mut("sluice")["typed_config"]["config"]
            .as_mapping_mut()
            .expect("config")
            .remove("allow_on_headers_stop_iteration");
    });
    let client = sluice_tests::client_builder()
        .timeout(Duration::from_secs(3))
        .build()
        .expect("client");
    let answer = client
        .post(stack.envoy.url("/v1/chat/completions"))
        .header("x-api-key", "demo-pro-key")
        .header("content-type", "application/json")
        .body(chat_body("llama3.1:8b").to_string())
        .send();
    assert!(
        answer.as_ref().is_err_and(|e| e.is_timeout()),
        "a POST is held (not answered): {answer:?}"
    );
    assert_eq!(stack.upstream_requests(), 0, "nothing reached the upstream");
}

// ---------------------------------------------------------------------------
// The shipped mesh patches, in a real Envoy
// ---------------------------------------------------------------------------

/// The Istio EnvoyFilter's `EXTENSION_CONFIG` patch (the ECDS resource).
fn istio_extension(envoyfilter: &Value) -> &Value {
    let patches = envoyfilter["spec"]["configPatches"]
        .as_sequence()
        .expect("configPatches");
    let p = patches
        .iter()
        .find(|p| p["applyTo"] == "EXTENSION_CONFIG")
        .expect("an EXTENSION_CONFIG patch");
    assert_eq!(p["patch"]["operation"], "ADD", "{p:?}");
    &p["patch"]["value"]
}

/// The Istio EnvoyFilter's `HTTP_FILTER` patch.
fn istio_http_filter_patch(envoyfilter: &Value) -> &Value {
    envoyfilter["spec"]["configPatches"]
        .as_sequence()
        .expect("configPatches")
        .iter()
        .find(|p| p["applyTo"] == "HTTP_FILTER")
        .expect("an HTTP_FILTER patch")
}

/// One admitted chat completion (with sluice's headers), then a refusal
/// that needs the body: a free-tier request whose prompt alone (about 40 KB,
/// some 10 000 tokens by sluice's estimate) is more than the tier's daily
/// budget (5000 tokens) is refused 429 `daily_budget_exceeded` before
/// anything reaches the upstream. The headers of both are alike: only the
/// body tells them apart.
fn serves_and_reads_the_body(envoy: &Envoy, upstream: &MockLlm) {
    chat_ok(envoy, upstream);
    let before = upstream.stats()["requests_total"].as_u64().unwrap_or(0);
    let mut body = chat_body("llama3.1:8b");
    body["messages"][0]["content"] = json!("Please summarise this. ".repeat(40 * 1024 / 23));
    let r = post_json(
        &envoy.url("/v1/chat/completions"),
        &[("x-api-key", "demo-free-key")],
        &body,
    );
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(
        r.header("x-sluice-reason"),
        Some("daily_budget_exceeded"),
        "{r:?}"
    );
    assert_eq!(
        upstream.stats()["requests_total"].as_u64().unwrap_or(0),
        before,
        "the refused request never reached the upstream"
    );
}

/// `code.local` with the built module: what istio-agent hands Envoy after
/// pulling the image an ECDS Wasm config names (it rewrites
/// `remote.http_uri` to the file it downloaded and checked).
fn local_code() -> Value {
    serde_yaml::from_str(&format!(
        "local: {{ filename: {:?} }}",
        wasm_path().display().to_string()
    ))
    .expect("yaml")
}

/// The shipped Istio EnvoyFilter (deploy/overlays/istio/envoyfilter.yaml)
/// in a real Envoy: in place of the shipped filter, the HTTP filter its
/// `HTTP_FILTER` patch inserts (`config_discovery`, the config source
/// swapped from ADS to a file), and in that file, as the ECDS resource, the
/// Wasm filter config exactly as its `EXTENSION_CONFIG` carries it, with
/// the module from the local build (as istio-agent rewrites it) and the
/// Istio policy's sidecar cluster: a POST is served through sluice, and a
/// budget refusal shows that sluice read the body.
#[test]
fn istio_envoyfilter_extension_config_serves_posts_in_envoy() {
    let root = repo_root();
    let file = root.join("deploy/overlays/istio/envoyfilter.yaml");
    let envoyfilter = &docs(&file)[0];
    assert_eq!(envoyfilter["kind"], "EnvoyFilter");
    let extension = istio_extension(envoyfilter).clone();
    assert_eq!(
        istio_http_filter_patch(envoyfilter)["patch"]["value"]["name"],
        extension["name"],
        "the HTTP filter loads the extension config by its name"
    );
    let mut typed_config = extension["typed_config"].clone();
    assert_eq!(
        typed_config["config"]["vm_config"]["code"]["remote"]["http_uri"]["uri"]
            .as_str()
            .map(|u| u.starts_with("oci://")),
        Some(true)
    );
    typed_config["config"]["vm_config"]["code"] = local_code();
    // The test-only edit of every stack: no penalty box from 127.0.0.1.
    if let Some(policy) = typed_config["config"]["configuration"]["value"].as_mapping_mut() {
        policy.remove("abuse");
    }

    let upstream = MockLlm::start("primary");
    let mut cfg = shipped_config_for(&upstream);
    // The sidecar cluster under Istio's name (down here: on_stale fail_open).
    let istio_name = deploy::istio_sidecar_cluster();
    cfg.cluster_mut("sluice_sidecar")
        .as_mapping_mut()
        .expect("cluster map")
        .insert("name".into(), istio_name.clone().into());
    cfg.cluster_mut(&istio_name)
        .get_mut("load_assignment")
        .and_then(Value::as_mapping_mut)
        .expect("load_assignment")
        .insert("cluster_name".into(), istio_name.clone().into());
    // The HTTP filter exactly as the HTTP_FILTER patch inserts it, its
    // extension config delivered by ECDS: from a file here (Envoy's
    // filesystem subscription), over ADS from istiod in a cluster.
    let dir = tempfile::tempdir().expect("tempdir");
    let ecds = dir.path().join("sluice-ecds.yaml");
    let resource = json!({
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
            "name": extension["name"].as_str().expect("name"),
            "typed_config": serde_json::to_value(&typed_config).expect("json"),
        }]
    });
    fs::write(&ecds, serde_json::to_string(&resource).expect("json")).expect("write ecds");
    let mut filter = istio_http_filter_patch(envoyfilter)["patch"]["value"].clone();
    let source = filter["config_discovery"]["config_source"]
        .as_mapping_mut()
        .expect("config_source");
    assert!(source.remove("ads").is_some(), "the filter reads ADS");
    source.insert(
        "path_config_source".into(),
        serde_yaml::from_str(&format!("{{ path: {:?} }}", ecds.display().to_string()))
            .expect("yaml"),
    );
    *cfg.http_filter_mut("sluice") = filter;
    let envoy = Envoy::start(&cfg, 1);
    serves_and_reads_the_body(&envoy, &upstream);
}

/// Applies one `add` operation of an EnvoyPatchPolicy as Envoy Gateway does
/// for the shape the shipped policy uses: `jsonPath`
/// `..http_filters[?(@.name=='N')]` selects every HTTP filter named N
/// anywhere in the listener, and `path` (a JSON pointer) is appended to
/// each. Returns how many places it changed; panics on another shape.
fn apply_eg_add(listener: &mut Value, op: &Value) -> usize {
    assert_eq!(op["op"], "add", "{op:?}");
    let json_path = op["jsonPath"].as_str().expect("jsonPath");
    let name = json_path
        .strip_prefix("..http_filters[?(@.name=='")
        .and_then(|r| r.strip_suffix("')]"))
        .unwrap_or_else(|| panic!("unexpected jsonPath {json_path}"));
    let pointer: Vec<String> = op["path"]
        .as_str()
        .expect("path")
        .strip_prefix('/')
        .expect("a JSON pointer")
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    fn walk(v: &mut Value, name: &str, pointer: &[String], value: &Value) -> usize {
        let mut n = 0;
        match v {
            Value::Mapping(m) => {
                for (k, child) in m.iter_mut() {
                    if k.as_str() == Some("http_filters") {
                        for f in child.as_sequence_mut().into_iter().flatten() {
                            if f["name"].as_str() == Some(name) {
                                let (last, parents) = pointer.split_last().expect("path");
                                let mut at = &mut *f;
                                for p in parents {
                                    at = at.get_mut(p.as_str()).unwrap_or_else(|| {
                                        panic!("add: no `{p}` on the way to {pointer:?}")
                                    });
                                }
                                at.as_mapping_mut()
                                    .expect("add into an object")
                                    .insert(last.as_str().into(), value.clone());
                                n += 1;
                            }
                        }
                    } else {
                        n += walk(child, name, pointer, value);
                    }
                }
            }
            Value::Sequence(s) => {
                for x in s {
                    n += walk(x, name, pointer, value);
                }
            }
            _ => {}
        }
        n
    }
    walk(listener, name, &pointer, &op["value"])
}

/// The shipped EnvoyPatchPolicy applied to a listener holding sluice as
/// Envoy Gateway generates it from the shipped EnvoyExtensionPolicy, then
/// loaded in a real Envoy: POSTs are served through sluice and a budget
/// refusal shows the body is read. The generated shape (Envoy Gateway's
/// xDS translator, internal/xds/translator/wasm.go, as this was written):
/// the listener named `<namespace>/<gateway>/<listener>`; in its HTTP
/// connection manager an `envoy.extensions.filters.http.wasm.v3.Wasm`
/// filter named `envoy.filters.http.wasm/envoyextensionpolicy/<ns>/<policy>
/// /wasm/<index>`, `disabled: true` and enabled on the routes the policy
/// targets (`typed_per_filter_config`, an empty `FilterConfig`), whose
/// PluginConfig has the policy's `rootID`, `failOpen: false` as
/// FAIL_CLOSED, the `config` as a JSON `StringValue`, and no
/// `allow_on_headers_stop_iteration` (code: EG's wasm cache; here the
/// local build). Without the patch the same listener holds every POST
/// (checked here too, the shape stays honest).
#[test]
fn eg_patch_policy_on_the_generated_wasm_filter_serves_posts_in_envoy() {
    let root = repo_root();
    let eep = &docs(&root.join("deploy/overlays/envoy-gateway/envoyextensionpolicy.yaml"))[0];
    let epp = &docs(&root.join("deploy/overlays/envoy-gateway/envoypatchpolicy.yaml"))[0];
    assert_eq!(epp["kind"], "EnvoyPatchPolicy");
    assert_eq!(eep["metadata"]["name"], deploy::EG_POLICY);
    let wasm = &eep["spec"]["wasm"][0];
    let mut policy = wasm["config"].clone();
    if let Some(p) = policy.as_mapping_mut() {
        p.remove("abuse");
    }
    let filter_name = deploy::eg_wasm_filter_name(0);
    let generated = |upstream: &MockLlm| {
        let mut cfg = shipped_config_for(upstream);
        let filter: Value = serde_yaml::from_str(&format!(
            "name: {filter_name:?}
disabled: true
typed_config:
  \"@type\": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
  config:
    name: {filter_name:?}
    root_id: {root_id}
    failure_policy: FAIL_CLOSED
    vm_config:
      vm_id: {filter_name:?}
      runtime: envoy.wasm.runtime.v8
    configuration:
      \"@type\": type.googleapis.com/google.protobuf.StringValue
      value: {json:?}
",
            root_id = wasm["rootID"].as_str().expect("rootID"),
            json = serde_json::to_string(&policy).expect("json"),
        ))
        .expect("filter yaml");
        let mut filter = filter;
        filter["typed_config"]["config"]["vm_config"]["code"] = local_code();
        *cfg.http_filter_mut("sluice") = filter;
        let enable: Value = serde_yaml::from_str(&format!(
            "{filter_name:?}: {{ \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig, config: {{}} }}"
        ))
        .expect("yaml");
        for vh in cfg.hcm_mut()["route_config"]["virtual_hosts"]
            .as_sequence_mut()
            .expect("virtual_hosts")
        {
            for route in vh["routes"].as_sequence_mut().expect("routes") {
                route
                    .as_mapping_mut()
                    .expect("route")
                    .insert("typed_per_filter_config".into(), enable.clone());
            }
        }
        cfg.listener_mut()
            .as_mapping_mut()
            .expect("listener")
            .insert("name".into(), deploy::eg_listener_name().into());
        cfg
    };

    // The shipped patch, on that listener.
    let upstream = MockLlm::start("primary");
    let mut cfg = generated(&upstream);
    let patches = epp["spec"]["jsonPatches"]
        .as_sequence()
        .expect("jsonPatches");
    assert!(!patches.is_empty());
    for patch in patches {
        assert_eq!(
            patch["type"],
            "type.googleapis.com/envoy.config.listener.v3.Listener"
        );
        assert_eq!(
            patch["name"],
            cfg.listener_mut()["name"],
            "the listener's name"
        );
        assert_eq!(
            apply_eg_add(cfg.listener_mut(), &patch["operation"]),
            1,
            "the patch finds the generated wasm filter"
        );
    }
    assert_eq!(
        cfg.http_filter_mut(&filter_name)["typed_config"]["config"]
            ["allow_on_headers_stop_iteration"],
        true
    );
    let envoy = Envoy::start(&cfg, 1);
    serves_and_reads_the_body(&envoy, &upstream);
    drop(envoy);

    // The same listener without the patch holds a POST.
    let upstream = MockLlm::start("primary");
    let envoy = Envoy::start(&generated(&upstream), 1);
    let client = sluice_tests::client_builder()
        .timeout(Duration::from_secs(3))
        .build()
        .expect("client");
    let answer = client
        .post(envoy.url("/v1/chat/completions"))
        .header("x-api-key", "demo-pro-key")
        .header("content-type", "application/json")
        .body(chat_body("llama3.1:8b").to_string())
        .send();
    assert!(
        answer.as_ref().is_err_and(|e| e.is_timeout()),
        "without the patch a POST is held: {answer:?}"
    );
    assert_eq!(upstream.stats()["requests_total"].as_u64(), Some(0));
}
