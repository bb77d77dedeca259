//! Checks the harness itself against a real Envoy, without sluice's own
//! binaries: the shipped config minus the wasm and JWT filters, in front of a
//! tiny upstream written here (a fixed-answer server, no mock-llm
//! personality).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::thread;
use std::time::Duration;

use serde_json::json;
use serde_yaml::Value;
use sluice_tests::{
    async_client, get, post_json, post_json_async, runtime, wait_for, ChildGuard, Envoy,
    EnvoyConfig,
};

/// An HTTP/1.1 upstream answering every request with 200 and
/// `hello from upstream <path>`, one request per connection.
fn start_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
    let addr = listener.local_addr().expect("upstream addr");
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            thread::spawn(move || {
                let mut reader = BufReader::new(&stream);
                let mut request_line = String::new();
                if reader.read_line(&mut request_line).is_err() {
                    return;
                }
                // Read the headers and the body, so closing never resets a
                // connection with unread data in it.
                let mut length = 0;
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                    if let Some((name, value)) = line.split_once(':') {
                        if name.eq_ignore_ascii_case("content-length") {
                            length = value.trim().parse().unwrap_or(0);
                        }
                    }
                    line.clear();
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    return;
                }
                let path = request_line.split_whitespace().nth(1).unwrap_or("?");
                let body = format!("hello from upstream {path}");
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = (&stream).write_all(reply.as_bytes());
            });
        }
    });
    addr
}

fn plain_config(upstream: SocketAddr) -> EnvoyConfig {
    let mut cfg = EnvoyConfig::load_shipped();
    cfg.remove_http_filter("sluice");
    cfg.remove_http_filter("envoy.filters.http.jwt_authn");
    cfg.set_cluster_addr("llm_upstream", upstream);
    cfg
}

fn routes_mut(cfg: &mut EnvoyConfig) -> &mut Value {
    &mut cfg.hcm_mut()["route_config"]["virtual_hosts"][0]["routes"]
}

#[test]
fn envoy_proxies_reloads_and_refuses_bad_listeners() {
    let upstream = start_upstream();
    let cfg = plain_config(upstream);
    let envoy = Envoy::start(&cfg, 2);

    let resp = get(&envoy.url("/v1/models"), &[]);
    assert_eq!(resp.status, 200, "{}", envoy.log());
    assert_eq!(resp.body, "hello from upstream /v1/models");
    assert!(
        envoy
            .metric(
                "envoy_cluster_upstream_rq_total",
                &[("envoy_cluster_name", "llm_upstream")]
            )
            .is_some_and(|n| n >= 1.0),
        "{}",
        envoy.stats_prometheus()
    );
    assert_eq!(
        envoy.counter_value("cluster.llm_upstream.upstream_rq_200"),
        Some(1)
    );

    // A live reload with a new route takes effect for the next request.
    let mut reloaded = cfg.clone();
    *routes_mut(&mut reloaded) = serde_yaml::from_str(
        r#"[{match: {prefix: "/"}, direct_response: {status: 418, body: {inline_string: reloaded}}}]"#,
    )
    .unwrap();
    envoy.reload(&reloaded).expect("reload accepted");
    let resp = get(&envoy.url("/v1/models"), &[]);
    assert_eq!((resp.status, resp.body.as_str()), (418, "reloaded"));
    assert_eq!(
        envoy.counter_value("listener_manager.lds.update_success"),
        Some(2)
    );

    // A listener routing to a cluster that does not exist is rejected, and
    // the last good listener keeps serving.
    let mut bad = reloaded.clone();
    *routes_mut(&mut bad) =
        serde_yaml::from_str(r#"[{match: {prefix: "/"}, route: {cluster: no_such_cluster}}]"#)
            .unwrap();
    let err = envoy.reload(&bad).expect_err("reload rejected");
    assert!(err.contains("no_such_cluster"), "{err}");
    let resp = get(&envoy.url("/v1/models"), &[]);
    assert_eq!((resp.status, resp.body.as_str()), (418, "reloaded"));

    // Changing a cluster is not a listener reload.
    let mut moved = reloaded.clone();
    moved.set_cluster_addr("llm_upstream", "127.0.0.1:1".parse().unwrap());
    assert!(envoy.reload(&moved).is_err());

    // Back to the original listener.
    envoy.reload(&cfg).expect("reload back");
    let resp = get(&envoy.url("/again"), &[]);
    assert_eq!(
        (resp.status, resp.body.as_str()),
        (200, "hello from upstream /again")
    );
}

#[test]
fn bad_bootstrap_is_reported_with_the_log() {
    let mut cfg = plain_config(start_upstream());
    cfg.cluster_mut("llm_upstream")["type"] = Value::from("NOT_A_TYPE");
    let err = Envoy::try_start(&cfg, 1)
        .err()
        .expect("Envoy refuses the config");
    assert!(err.contains("NOT_A_TYPE"), "{err}");
}

#[test]
fn child_guard_kills_its_process_group_on_drop() {
    let guard = ChildGuard::spawn("sleep", Command::new("sleep").arg("60")).expect("spawn sleep");
    let pid = guard.id() as libc::pid_t;
    // SAFETY: kill with signal 0 only checks that the process exists.
    assert_eq!(unsafe { libc::kill(pid, 0) }, 0);
    drop(guard);
    // Dropped means killed and reaped: the pid no longer exists.
    assert!(wait_for(Duration::from_secs(5), || unsafe {
        libc::kill(pid, 0) != 0
    }));
}

#[test]
fn concurrent_posts_through_envoy() {
    let envoy = Envoy::start(&plain_config(start_upstream()), 2);
    let resp = post_json(
        &envoy.url("/v1/chat/completions"),
        &[],
        &json!({"model": "m"}),
    );
    assert_eq!(resp.status, 200);

    let url = envoy.url("/v1/chat/completions");
    let statuses = runtime().block_on(async {
        let client = async_client();
        let calls = (0..32).map(|i| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let body = json!({"model": "m", "n": i});
                post_json_async(&client, &url, &[("x-api-key", "k")], &body).await
            })
        });
        let mut statuses = Vec::new();
        for call in calls.collect::<Vec<_>>() {
            statuses.push(call.await.expect("task").expect("request").status);
        }
        statuses
    });
    assert_eq!(statuses, vec![200; 32]);
    assert_eq!(
        envoy.counter_value("cluster.llm_upstream.upstream_rq_200"),
        Some(33)
    );
}

#[test]
fn inline_jwks_is_enforced_by_jwt_authn() {
    let mut cfg = EnvoyConfig::load_shipped();
    cfg.remove_http_filter("sluice");
    cfg.set_cluster_addr("llm_upstream", start_upstream());
    // The EC public key of RFC 7517, appendix A.1.
    cfg.set_jwks_inline(
        json!({"keys": [{"kty": "EC", "crv": "P-256", "alg": "ES256", "kid": "1",
            "x": "MKBCTNIcKUSDii11ySs3526iDZ8AiTo7Tu6KPAqv7D4",
            "y": "4Etl6SRW2YiLUrN5vfvVHuhp7x8PxltmWWlbbM4IFyM"}]})
        .to_string(),
    );
    // The shipped rule lets failed tokens on to sluice (removed here); make
    // jwt_authn itself refuse them, as the previous shipped rule did.
    let jwt = cfg.http_filter_mut("envoy.filters.http.jwt_authn");
    jwt["typed_config"]["rules"][0]["requires"] = serde_yaml::from_str(
        "requires_any: {requirements: [{provider_name: demo}, {allow_missing: {}}]}",
    )
    .unwrap();
    let envoy = Envoy::start(&cfg, 1);
    // No token: allowed through (allow_missing); a bad token: 401.
    assert_eq!(get(&envoy.url("/"), &[]).status, 200);
    let bad = get(&envoy.url("/"), &[("authorization", "Bearer not.a.jwt")]);
    assert_eq!(bad.status, 401, "{}", bad.body);
}

/// Every integration test that starts an upstream says, in its file's
/// opening comment, which server that upstream plays (a mock-llm
/// personality, or a server written in the file), so a reader knows what
/// the test proves of which real server.
#[test]
fn every_test_file_with_an_upstream_names_its_personality() {
    let dir = sluice_tests::repo_root().join("tests/tests");
    let mut silent = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("tests/tests") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("a test file");
        let starts_one = ["Stack::start", "MockLlm::start", "start_upstream("]
            .iter()
            .any(|s| text.contains(s));
        let opening: String = text
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .collect::<Vec<_>>()
            .join("\n")
            .to_lowercase();
        let says = ["personality", "fixed-answer"]
            .iter()
            .any(|s| opening.contains(s));
        if starts_one && !says {
            silent.push(path.display().to_string());
        }
    }
    assert!(
        silent.is_empty(),
        "these start an upstream without saying which personality it plays: {silent:?}"
    );
}

/// Every file in tests/tests is a module of the one integration binary
/// (tests/Cargo.toml turns off Cargo's one binary per file): a file left
/// out of main.rs would never compile or run.
#[test]
fn every_test_file_is_a_module_of_the_binary() {
    let dir = sluice_tests::repo_root().join("tests/tests");
    let main = std::fs::read_to_string(dir.join("main.rs")).expect("main.rs");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("tests/tests") {
        let name = entry
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        if module != "main" && !main.lines().any(|l| l == format!("mod {module};")) {
            missing.push(name);
        }
    }
    assert!(
        missing.is_empty(),
        "not named in tests/tests/main.rs: {missing:?}"
    );
}
