//! Harness for the fleet tests: a real `redis-server` on an ephemeral
//! loopback port (no persistence), and Envoys each with its own sidecar
//! pointed at it.

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use serde_yaml::Value;

use crate::{
    closed_addr, shipped_config_for, wait_for, ChildGuard, Envoy, EnvoyConfig, MockLlm, Sidecar,
};

/// The admin token of every fleet test sidecar.
pub const TOKEN: &str = "fleet-test-admin-token-0123456789";
/// The fleet secret each test Envoy and its sidecar share (the Envoy's VM
/// gets it in `vm_config.environment_variables`, the sidecar from a file).
pub const SECRET: &str = "fleet-test-secret-0123456789";
/// The salt a test policy gets when it names none (`fleet.salt` is
/// required).
pub const SALT: &str = "fleet-test-salt-0123456789";

/// `policy` with the harness' salt when its `fleet` has none.
pub fn salted(policy: &Value) -> Value {
    let mut policy = policy.clone();
    if let Some(Value::Mapping(fleet)) = policy.get_mut("fleet") {
        let key = Value::from("salt");
        if !fleet.contains_key(&key) {
            fleet.insert(key, Value::from(SALT));
        }
    }
    policy
}

/// Gives the sluice VM of `config` the environment variable `name`
/// (`vm_config.environment_variables.key_values`), as an operator would
/// with `host_env_keys` from Envoy's own environment.
pub fn set_vm_env(config: &mut EnvoyConfig, name: &str, value: &str) {
    let vm = config
        .http_filter_mut("sluice")
        .get_mut("typed_config")
        .and_then(|t| t.get_mut("config"))
        .and_then(|c| c.get_mut("vm_config"))
        .expect("the sluice filter's vm_config");
    let mut kv = serde_yaml::Mapping::new();
    kv.insert(Value::from(name), Value::from(value));
    let mut env = serde_yaml::Mapping::new();
    env.insert(Value::from("key_values"), Value::Mapping(kv));
    vm.as_mapping_mut()
        .expect("vm_config is a map")
        .insert(Value::from("environment_variables"), Value::Mapping(env));
}

/// `redis-server` (Debian's package) on 127.0.0.1, killed on drop.
pub struct Redis {
    guard: ChildGuard,
    pub port: u16,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl Redis {
    /// On a free port. The port is probed, then bound by redis-server: if
    /// another process took it in between, this Redis exits (or another one
    /// answers there) and a new port is tried, so no test ever counts in
    /// another test's Redis.
    pub fn start() -> Redis {
        for _ in 0..4 {
            if let Some(redis) = Redis::try_start_on(free_port()) {
                return redis;
            }
        }
        Redis::start_on(free_port())
    }

    /// On `port` (a restart keeps the sidecars' address).
    pub fn start_on(port: u16) -> Redis {
        Redis::try_start_on(port)
            .unwrap_or_else(|| panic!("redis-server could not serve on port {port}"))
    }

    /// `None` when the redis-server started here is not the one answering
    /// on `port` (it exited: the port was taken).
    fn try_start_on(port: u16) -> Option<Redis> {
        let dir = tempfile::Builder::new()
            .prefix("sluice-redis-")
            .tempdir()
            .expect("temp dir");
        let port_s = port.to_string();
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port_s,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            "redis.log",
            "--dir",
        ])
        .arg(dir.path());
        let guard = ChildGuard::spawn("redis-server", &mut cmd)
            .expect("redis-server (Debian package redis-server; `make test` installs it)");
        let mut redis = Redis {
            guard,
            port,
            _dir: dir,
        };
        let ours = format!("process_id:{}\r\n", redis.guard.id());
        let mut exited = false;
        let up = wait_for(Duration::from_secs(10), || {
            exited = redis.guard.try_wait().is_some();
            exited
                || redis
                    .command(&["INFO", "server"])
                    .is_some_and(|r| r.contains(&ours))
        });
        assert!(up, "redis-server did not answer on {port}");
        (!exited).then_some(redis)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// One command over RESP; the raw answer, `None` when Redis is away.
    pub fn command(&self, args: &[&str]) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(req.as_bytes()).ok()?;
        let mut buf = vec![0u8; 1 << 16];
        let mut out = Vec::new();
        // Enough for the short answers the tests read.
        loop {
            let n = s.read(&mut buf).ok()?;
            out.extend_from_slice(&buf[..n]);
            if n == 0 || out.ends_with(b"\r\n") {
                break;
            }
        }
        Some(String::from_utf8_lossy(&out).into_owned())
    }

    /// Commands Redis ran, by name (`INFO commandstats`).
    pub fn commands(&self) -> u64 {
        let info = self.command(&["INFO", "commandstats"]).unwrap_or_default();
        info.lines()
            .filter_map(|l| l.split("calls=").nth(1))
            .filter_map(|v| v.split(',').next()?.parse::<u64>().ok())
            .sum()
    }

    /// `KEYS pattern`.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let raw = self.command(&["KEYS", pattern]).unwrap_or_default();
        raw.lines()
            .skip(1)
            .filter(|l| !l.starts_with('$'))
            .map(str::to_string)
            .collect()
    }

    /// `GET key` as a number (absent: `None`).
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        let raw = self.command(&["GET", key])?;
        raw.lines().nth(1)?.trim().parse().ok()
    }

    /// The used count of the one calendar-window bucket in Redis (the
    /// fleet keys ending in a window end other than 0).
    pub fn window_used(&self) -> Option<i64> {
        let keys: Vec<String> = self
            .keys("sluice:fleet:*")
            .into_iter()
            // Bucket keys end in their window's end; 0 for token buckets.
            .filter(|k| {
                k.rsplit(':')
                    .next()
                    .and_then(|end| end.parse::<u64>().ok())
                    .is_some_and(|end| end > 0)
            })
            .collect();
        match keys.as_slice() {
            [one] => self.get_i64(one),
            _ => None,
        }
    }

    pub fn kill(&mut self) {
        self.guard.kill();
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) redis-server: what it
    /// was sent meanwhile runs when it continues (a slow Redis).
    pub fn pause(&self, paused: bool) {
        signal(self.guard.id(), paused);
    }
}

fn signal(pid: u32, stop: bool) {
    let flag = if stop { "-STOP" } else { "-CONT" };
    let ok = Command::new("kill")
        .args([flag, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {flag} {pid}");
}

/// One Envoy of the fleet with its own sidecar.
pub struct Node {
    /// Declared first: Envoy stops before its sidecar.
    pub envoy: Envoy,
    pub sidecar: Sidecar,
    pub config: EnvoyConfig,
    dir: tempfile::TempDir,
}

/// A sidecar config file for `redis_url` in `dir` (with `extra` YAML
/// appended); returns its args. Its fleet policy is `dir/policy.json`
/// (written by [`Node::start_with`]), its secret `dir/fleet-secret`.
fn sidecar_args(dir: &std::path::Path, redis_url: &str, extra: &str) -> Vec<String> {
    let config = dir.join("sidecar.yaml");
    let secret = dir.join("fleet-secret");
    if !secret.exists() {
        fs::write(&secret, SECRET).expect("fleet secret file");
    }
    fs::write(
        &config,
        format!(
            "scrape_interval: 100ms\nfleet:\n  redis: {redis_url}\n  timeout: 200ms\n  sync_interval: 50ms\n  policy: {}\n  secret_file: {}\n{extra}",
            dir.join("policy.json").display(),
            secret.display()
        ),
    )
    .expect("sidecar config");
    let token = dir.join("token");
    fs::write(&token, TOKEN).expect("token file");
    vec![
        "--simulate".into(),
        "--config".into(),
        config.display().to_string(),
        "--admin-token-file".into(),
        token.display().to_string(),
    ]
}

impl Node {
    /// A sidecar for `redis_url` and an Envoy (`concurrency` workers) with
    /// `policy`, its upstream `upstream` and fallback `fallback`.
    pub fn start(
        redis_url: &str,
        upstream: &MockLlm,
        fallback: Option<&MockLlm>,
        policy: &Value,
        concurrency: u32,
    ) -> Node {
        Node::start_with(redis_url, upstream, fallback, policy, concurrency, "")
    }

    /// Like [`Node::start`], with `sidecar_extra` appended to the sidecar's
    /// config (rules, breaker …).
    pub fn start_with(
        redis_url: &str,
        upstream: &MockLlm,
        fallback: Option<&MockLlm>,
        policy: &Value,
        concurrency: u32,
        sidecar_extra: &str,
    ) -> Node {
        Node::start_tweaked(
            redis_url,
            upstream,
            fallback,
            policy,
            concurrency,
            sidecar_extra,
            |_| {},
        )
    }

    /// Like [`Node::start_with`], with `tweak` applied to the Envoy config
    /// last (e.g. another way to give the VM its secret).
    pub fn start_tweaked(
        redis_url: &str,
        upstream: &MockLlm,
        fallback: Option<&MockLlm>,
        policy: &Value,
        concurrency: u32,
        sidecar_extra: &str,
        tweak: impl FnOnce(&mut EnvoyConfig),
    ) -> Node {
        let dir = tempfile::Builder::new()
            .prefix("sluice-fleet-node-")
            .tempdir()
            .expect("temp dir");
        // The sidecar checks every claim against its own copy of the
        // policy: the one this Envoy loads.
        let policy = salted(policy);
        fs::write(
            dir.path().join("policy.json"),
            serde_json::to_string(&policy).expect("policy as JSON"),
        )
        .expect("policy file");
        let args = sidecar_args(dir.path(), redis_url, sidecar_extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let sidecar = Sidecar::start_with_args(&args);
        let mut config = shipped_config_for(upstream);
        config.set_cluster_addr("sluice_sidecar", sidecar.addr());
        config.set_cluster_addr(
            "llm_fallback",
            fallback.map_or_else(closed_addr, |f| f.addr()),
        );
        *config.policy_mut() = policy;
        set_vm_env(&mut config, "SLUICE_FLEET_SECRET", SECRET);
        tweak(&mut config);
        let envoy = Envoy::start(&config, concurrency);
        Node {
            envoy,
            sidecar,
            config,
            dir,
        }
    }

    /// Kills this node's sidecar (its Envoy stays).
    pub fn kill_sidecar(&mut self) {
        self.sidecar.process().kill();
    }

    /// Starts the sidecar again on its address.
    pub fn restart_sidecar(&mut self, redis_url: &str) {
        let addr: SocketAddr = self.sidecar.addr();
        self.sidecar.process().kill();
        let mut args = sidecar_args(self.dir.path(), redis_url, "");
        args.extend(["--listen".into(), addr.to_string()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.sidecar = Sidecar::start_with_args(&args);
    }

    /// A raw POST to this node's sidecar (the forger's view): its status
    /// and body.
    pub fn sidecar_post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
        let mut req = crate::http_client().post(self.sidecar.url(path));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        match req.body(body.to_string()).send() {
            Ok(r) => {
                let status = r.status().as_u16();
                (status, r.text().unwrap_or_default())
            }
            Err(e) => (0, e.to_string()),
        }
    }

    /// The headers this node's filter sends on a fleet call (its secret
    /// and its policy's fingerprint, read from the sidecar).
    pub fn fleet_headers(&self) -> Vec<(&'static str, String)> {
        let fingerprint = self.fleet_stats()["fingerprint"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        vec![
            ("x-sluice-fleet-secret", SECRET.to_string()),
            ("x-sluice-fleet-fingerprint", fingerprint),
        ]
    }

    /// `GET /v1/fleet` of this node's sidecar.
    pub fn fleet_stats(&self) -> serde_json::Value {
        crate::http_client()
            .get(self.sidecar.url("/v1/fleet"))
            .send()
            .ok()
            .and_then(|r| r.json().ok())
            .unwrap_or_default()
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) this node's sidecar: a
    /// sidecar slower than `fleet.timeout`.
    pub fn pause_sidecar(&mut self, paused: bool) {
        signal(self.sidecar.process().id(), paused);
    }

    /// Sets this node's simulated GPU utilization (percent).
    pub fn simulate(&self, utilization: f64) {
        let auth = format!("Bearer {TOKEN}");
        let r = crate::post_json(
            &self.sidecar.url("/v1/simulate"),
            &[("authorization", auth.as_str())],
            &serde_json::json!({"gpus": [{"utilization": utilization}]}),
        );
        assert_eq!(r.status, 200, "simulate: {}", r.body);
    }

    /// `POST /v1/kill-switch` on this node's sidecar.
    pub fn kill_switch(&self, active: bool) {
        let body = serde_json::json!({"active": active, "reason": "fleet drill"});
        let auth = format!("Bearer {TOKEN}");
        let r = crate::post_json(
            &self.sidecar.url("/v1/kill-switch"),
            &[("authorization", auth.as_str())],
            &body,
        );
        assert_eq!(r.status, 200, "kill switch: {}", r.body);
    }
}

/// A policy in YAML (as the tests write it).
pub fn policy(yaml: &str) -> Value {
    serde_yaml::from_str(yaml).expect("test policy YAML")
}

/// The sidecar as the fleet tests reach it: a fresh sidecar polled every
/// 5 s, trusted for a minute, and failed open when it goes quiet.
const SIDECAR: &str =
    "sidecar: { cluster: sluice_sidecar, stale_after: 60s, on_stale: fail_open, poll_wait: 5s }\n";

/// A fleet policy: every caller `free` by address, the `tiers` and `fleet`
/// sections as YAML, and [`SIDECAR`].
pub fn fleet_policy(tiers: &str, fleet: &str) -> Value {
    policy(&format!(
        "default_tier: free\nidentity: {{ sources: [client_address] }}\n{tiers}\n{SIDECAR}{fleet}\n"
    ))
}
