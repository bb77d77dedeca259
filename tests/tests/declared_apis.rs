//! Declared APIs against a real Envoy: an application's own endpoint
//! (`POST /api/v1/ai/chat` with `{"model", "message", "user_id"}`) is
//! refused by deny by default until the policy declares it; declared, it
//! is reserved against the caller's token budget, its output limit written
//! where the service reads it, settled from the usage its answer reports,
//! exact under a parallel burst; a bad body is a 400 naming the pointer and
//! never reaches the service; `check-config` names a bad pointer.
//!
//! Upstream personality: a small service written here (not mock-llm,
//! which plays the LLM servers sluice knows): it answers in its own shape
//! and generates as many tokens as the body's `max_tokens` allows (64 when
//! absent), which is what a service that obeys its limit does at worst.
//! It reads its body as a Go service does (`encoding/json` into a struct:
//! keys matched without case, the last match winning; mock-llm's
//! `go_json`), so `"MAX_TOKENS": 4000` after `"max_tokens": 16` is 4,000.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use mock_llm::go_json::{self, GoStruct};
use serde_json::{json, Value as Json};
use sluice_tests::{bin_path, post_json, request, EnvoyConfig, PolicyBuilder, Response, Stack};

const PATH: &str = "/api/v1/ai/chat";
/// The input tokens the service reports: one per word of the message
/// (what a tokenizer gives short English words; sluice's estimate of the
/// same text is no smaller).
fn prompt_tokens(body: &Json) -> u64 {
    body["message"]
        .as_str()
        .map_or(0, |m| m.split_whitespace().count() as u64)
}

/// The service's request struct, by its `json:` tags.
static REQUEST: GoStruct = GoStruct {
    fields: &["model", "message", "user_id", "max_tokens"],
    nested: &[],
};

/// The application's service: records each body it is sent (as sent) and
/// the tokens it reported (input and output, as it read the body).
struct App {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    bodies: Arc<Mutex<Vec<Json>>>,
    reported: Arc<AtomicU64>,
}

impl App {
    fn start() -> App {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let stop = Arc::new(AtomicBool::new(false));
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let reported = Arc::new(AtomicU64::new(0));
        let (s, b, r) = (stop.clone(), bodies.clone(), reported.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let (b, r) = (b.clone(), r.clone());
                thread::spawn(move || serve(conn, &b, &r));
            }
        });
        App {
            addr,
            stop,
            bodies,
            reported,
        }
    }

    fn bodies(&self) -> Vec<Json> {
        self.bodies.lock().unwrap().clone()
    }

    fn reported(&self) -> u64 {
        self.reported.load(Ordering::SeqCst)
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// Serves requests on one connection (keep-alive) until it closes.
fn serve(mut conn: TcpStream, bodies: &Mutex<Vec<Json>>, reported: &AtomicU64) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let bytes = &buf[head_end..head_end + length];
        let body: Json = serde_json::from_slice(bytes).unwrap_or(Json::Null);
        let read = go_json::read(bytes, &REQUEST).unwrap_or(Json::Null);
        buf.drain(..head_end + length);
        let answer = if head.starts_with(&format!("post {PATH} ")) {
            let max = read["max_tokens"].as_u64().unwrap_or(64);
            let prompt = prompt_tokens(&read);
            reported.fetch_add(prompt + max, Ordering::SeqCst);
            bodies.lock().unwrap().push(body);
            json!({"reply": "tok ".repeat(max as usize).trim_end(),
                   "usage": {"prompt_tokens": prompt, "completion_tokens": max}})
            .to_string()
        } else {
            let _ = conn.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n");
            continue;
        };
        let _ = write!(
            conn,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
    }
}

fn declaration() -> Json {
    json!({
        "path": PATH,
        "model": "/model",
        "input": ["/message"],
        "output_limit": "/max_tokens",
        "answer": {"text": "/reply", "input_tokens": "/usage/prompt_tokens",
                   "output_tokens": "/usage/completion_tokens"},
    })
}

fn policy(budget: u64, declared: bool) -> Json {
    let p = PolicyBuilder::one_tier(json!({"requests": "10000/min", "daily_tokens": budget}))
        .max_output_tokens(64);
    if declared {
        p.with("apis", json!([declaration()])).build()
    } else {
        p.build()
    }
}

fn stack(app: &App, budget: u64, declared: bool) -> Stack {
    let addr = app.addr;
    Stack::start(move |cfg: &mut EnvoyConfig| {
        cfg.set_policy(&policy(budget, declared));
        cfg.set_cluster_addr("llm_upstream", addr);
    })
}

fn ask(stack: &Stack, body: &Json) -> Response {
    post_json(&stack.envoy.url(PATH), &[], body)
}

fn tokens(stack: &Stack, direction: &str, kind: &str) -> u64 {
    let labels = [("direction", direction), ("kind", kind)];
    stack
        .envoy
        .metric("sluice_tokens_total", &labels)
        .unwrap_or(0.0) as u64
}

fn chat(message: &str, max_tokens: Option<u64>) -> Json {
    let mut body = json!({"model": "llama3.1:8b", "message": message, "user_id": "u-42"});
    if let Some(max) = max_tokens {
        body["max_tokens"] = json!(max);
    }
    body
}

#[test]
fn an_application_endpoint_is_refused_until_declared_then_reserved_and_settled() {
    let app = App::start();
    {
        let stack = stack(&app, 10_000, false);
        let resp = ask(&stack, &chat("hello", Some(10)));
        assert_eq!(resp.status, 404, "{resp:?}");
        assert_eq!(resp.header("x-sluice-reason"), Some("unknown_endpoint"));
    }
    assert!(app.bodies().is_empty(), "nothing reached the service");

    let stack = stack(&app, 10_000, true);
    let resp = ask(&stack, &chat("hello there", None));
    assert_eq!(resp.status, 200, "{resp:?}");
    // The default output is reserved and written where the service reads
    // it; the client's other fields go as sent.
    let sent = app.bodies().pop().expect("the service got it");
    assert_eq!(
        sent,
        json!({"model": "llama3.1:8b", "message": "hello there",
                            "user_id": "u-42", "max_tokens": 64})
    );
    let answer: Json = serde_json::from_str(&resp.body).expect("the service's JSON");
    assert_eq!(answer["usage"]["completion_tokens"], 64);
    let after_first: u64 = resp
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .expect("remaining tokens");
    assert!(
        after_first <= 10_000 - 64,
        "the output was reserved: {after_first}"
    );

    let resp = ask(&stack, &chat("hello there", Some(100)));
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(app.bodies().pop().unwrap()["max_tokens"], 100, "as asked");
    // Settled from the answer's usage: 2 + 2 in and 64 + 100 out.
    assert_eq!(tokens(&stack, "input", "actual"), 4);
    assert_eq!(tokens(&stack, "output", "actual"), 164);
    let resp = ask(&stack, &chat("x", Some(0)));
    assert_eq!(resp.status, 200);
    let remaining: u64 = resp
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap();
    // Two settled (4 + 164) and this one's reservation outstanding.
    assert!(remaining <= 10_000 - 4 - 164, "{remaining}");
}

#[test]
fn a_bad_declared_body_is_a_400_naming_the_pointer_and_never_reaches_the_service() {
    let app = App::start();
    let stack = stack(&app, 10_000, true);
    let cases = [
        (json!({"message": "no model"}).to_string(), Some("/model")),
        (
            json!({"model": 7, "message": "x"}).to_string(),
            Some("/model"),
        ),
        (
            json!({"model": "m", "max_tokens": -5}).to_string(),
            Some("/max_tokens"),
        ),
        (
            json!({"model": "m", "max_tokens": "all"}).to_string(),
            Some("/max_tokens"),
        ),
        (
            json!({"model": "m", "max_tokens": 10_000_000}).to_string(),
            Some("/max_tokens"),
        ),
        // Two `max_tokens`: sluice and the service might read different ones.
        (
            r#"{"model":"m","max_tokens":1,"max_tokens":900}"#.to_string(),
            Some("max_tokens"),
        ),
        ("[1, 2]".to_string(), None),
        ("{nope".to_string(), None),
    ];
    for (body, param) in cases {
        let headers = [("content-type", "application/json")];
        let resp = request(
            "POST",
            &stack.envoy.url(PATH),
            &headers,
            Some(body.clone().into_bytes()),
        )
        .expect("transport");
        assert_eq!(resp.status, 400, "{body}: {resp:?}");
        let err: Json = serde_json::from_str(&resp.body).expect("JSON error");
        assert_eq!(err["error"]["param"].as_str(), param, "{body}: {err}");
    }
    assert!(app.bodies().is_empty(), "{:?}", app.bodies());
    assert_eq!(tokens(&stack, "output", "actual"), 0);
}

/// 40 callers at once on one address, each asking 50 output tokens of a
/// 1,000-token daily budget, to a service that generates all it may: the
/// admitted ones together never cost more than the budget, and what the
/// budget charged is what the service reported.
#[test]
fn a_parallel_burst_on_a_declared_api_never_overshoots_the_budget() {
    let app = App::start();
    let stack = stack(&app, 1_000, true);
    let url = stack.envoy.url(PATH);
    let statuses: Vec<u16> = thread::scope(|s| {
        let handles: Vec<_> = (0..40)
            .map(|_| {
                let url = url.clone();
                s.spawn(move || post_json(&url, &[], &chat("hello there", Some(50))).status)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let admitted = statuses.iter().filter(|s| **s == 200).count() as u64;
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    let served: Vec<Json> = app.bodies();
    assert_eq!(served.len() as u64, admitted);
    let generated: u64 = served
        .iter()
        .map(|b| prompt_tokens(b) + b["max_tokens"].as_u64().unwrap())
        .sum();
    assert!(
        generated <= 1_000,
        "{admitted} admitted cost {generated} of 1000"
    );
    // Each holds its input's bound (its body's bytes and the template's
    // figures, about 100) and its 50 of output: about 1000 / 150 at once.
    assert!(
        admitted >= 5,
        "the budget holds about 1000 / 150: {statuses:?}"
    );
    let charged = tokens(&stack, "input", "actual") + tokens(&stack, "output", "actual");
    assert_eq!(charged, generated);
}

#[test]
fn check_config_names_a_bad_pointer() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |api: Json| {
        let mut cfg = EnvoyConfig::load_shipped();
        cfg.policy_mut()["apis"] = serde_yaml::to_value(json!([api])).expect("yaml");
        let file = dir.path().join("envoy.yaml");
        std::fs::write(&file, serde_yaml::to_string(cfg.value()).expect("yaml")).expect("file");
        let out = std::process::Command::new(bin_path("sluice-sidecar"))
            .arg("check-config")
            .arg(&file)
            .output()
            .expect("running check-config");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, out) = run(declaration());
    assert!(ok, "{out}");
    let mut bad = declaration();
    bad["output_limit"] = json!("max_tokens");
    let (ok, out) = run(bad);
    assert!(!ok && out.contains("apis[0].output_limit"), "{out}");
    let mut bad = declaration();
    bad["path"] = json!("/v1/chat/completions");
    let (ok, out) = run(bad);
    assert!(
        !ok && out.contains("apis[0].path") && out.contains("built-in"),
        "{out}"
    );
}

/// Issue 48: a Go or ASP.NET Core service reads `MAX_TOKENS` as its
/// `max_tokens`. Ten such requests at once on the free tier's 5,000-token
/// budget, each reserving 16 tokens and asking the service for 4,000, cost
/// 40,010 tokens; now each is a 400 naming the key, and nothing reaches
/// the service. `Model` beside `model` (a bigger model than sluice
/// decided on) is refused the same way, at any level and in Go's other
/// spellings (KELVIN SIGN).
#[test]
fn keys_the_service_reads_without_case_are_refused_and_the_budget_holds() {
    let app = App::start();
    let stack = stack(&app, 5_000, true);
    let url = stack.envoy.url(PATH);
    let send = |body: &str| {
        let headers = [("content-type", "application/json")];
        request("POST", &url, &headers, Some(body.as_bytes().to_vec())).expect("transport")
    };
    // Written by hand: Go reads the last of the two, so it comes last.
    let overshoot =
        r#"{"model":"llama3.1:8b","message":"hello there","max_tokens":16,"MAX_TOKENS":4000}"#;
    let responses: Vec<Response> = thread::scope(|s| {
        let handles: Vec<_> = (0..10).map(|_| s.spawn(|| send(overshoot))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The body of an admitted one is 4,000 tokens: show its start only.
    let short = |resp: &Response| resp.body.chars().take(300).collect::<String>();
    for resp in &responses {
        assert_eq!(resp.status, 400, "{}", short(resp));
        let err = resp.json();
        assert_eq!(err["error"]["param"], "/MAX_TOKENS", "{err}");
    }
    for (body, param) in [
        (
            r#"{"model":"llama3.1:8b","message":"hi","Model":"llama3.1:70b"}"#,
            "/Model",
        ),
        (r#"{"Model":"llama3.1:70b","message":"hi"}"#, "/Model"),
        (
            "{\"model\":\"llama3.1:8b\",\"message\":\"hi\",\"max_to\u{212A}ens\":4000}",
            "/max_to\u{212A}ens",
        ),
    ] {
        let resp = send(body);
        assert_eq!(resp.status, 400, "{body}: {}", short(&resp));
        assert_eq!(resp.json()["error"]["param"], param, "{body}");
    }
    assert!(app.bodies().is_empty(), "{:?}", app.bodies());
    assert_eq!(app.reported(), 0, "the service generated nothing");
    let charged = tokens(&stack, "input", "actual") + tokens(&stack, "output", "actual");
    assert_eq!(charged, 0);
    // The exact spelling still goes through, and its cost is what the
    // service reported.
    let resp = send(r#"{"model":"llama3.1:8b","message":"hello there","max_tokens":16}"#);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(app.reported(), 2 + 16);
    assert!(app.reported() <= 5_000);
}
