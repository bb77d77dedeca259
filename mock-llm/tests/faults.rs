//! Server-wide scripted faults (`--fault`, `PUT /admin/fault`), driven over
//! real TCP: a reset, a hang or a stalled stream only shows on the wire.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mock_llm::{Config, Personality};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const CHAT: &str =
    r#"{"model":"m","max_tokens":3,"messages":[{"role":"user","content":"hello world!"}]}"#;
const STREAM: &str = r#"{"model":"m","max_tokens":3,"stream":true,"messages":[{"role":"user","content":"hello world!"}]}"#;

async fn start_with(config: Config) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = mock_llm::app(config).unwrap();
    tokio::spawn(mock_llm::serve(listener, app, std::future::pending()));
    addr
}

async fn start() -> SocketAddr {
    start_with(Config {
        name: "primary".into(),
        ..Config::default()
    })
    .await
}

/// How an exchange ended, as a client sees it.
#[derive(Debug)]
enum Outcome {
    /// Bytes came back and the server closed (or reset after them).
    Answer(Answer),
    /// The connection failed with no byte of response.
    ConnectionError(std::io::ErrorKind),
    /// Nothing within the wait, connection still open; what came so far.
    TimedOut(Vec<u8>),
}

#[derive(Debug)]
struct Answer {
    status: u16,
    /// Lowercased head.
    head: String,
    /// De-chunked body.
    body: Vec<u8>,
    /// Chunked: the terminating chunk arrived; else: the body is whole.
    clean_end: bool,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then_some(v.trim())
        })
    }

    /// The SSE events of the body.
    fn events(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.body)
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect()
    }
}

impl Outcome {
    fn answer(self) -> Answer {
        match self {
            Outcome::Answer(a) => a,
            other => panic!("expected an answer, got {other:?}"),
        }
    }
}

/// One request with `Connection: close`, read until the server closes,
/// resets, or `wait` passes.
async fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    wait: Duration,
) -> Outcome {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    let mut error = None;
    let read_all = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(e) => {
                    error = Some(e.kind());
                    break;
                }
            }
        }
    };
    if tokio::time::timeout(wait, read_all).await.is_err() {
        return Outcome::TimedOut(raw);
    }
    if raw.is_empty() {
        return Outcome::ConnectionError(error.unwrap_or(std::io::ErrorKind::UnexpectedEof));
    }
    Outcome::Answer(parse(&raw))
}

async fn post(addr: SocketAddr, path: &str, body: &str) -> Outcome {
    exchange(addr, "POST", path, body, Duration::from_secs(10)).await
}

fn parse(raw: &[u8]) -> Answer {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head[9..12].parse().unwrap();
    let rest = &raw[split + 4..];
    let (body, clean_end) = if head.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        (rest.to_vec(), true)
    };
    Answer {
        status,
        head,
        body,
        clean_end,
    }
}

fn dechunk(mut rest: &[u8]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return (body, false);
        };
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap(), 16).unwrap();
        rest = &rest[eol + 2..];
        if size == 0 {
            return (body, true);
        }
        if rest.len() < size + 2 {
            body.extend_from_slice(&rest[..size.min(rest.len())]);
            return (body, false);
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

async fn put_fault(addr: SocketAddr, spec: &str) -> Answer {
    exchange(addr, "PUT", "/admin/fault", spec, Duration::from_secs(10))
        .await
        .answer()
}

async fn get_json(addr: SocketAddr, path: &str) -> Value {
    exchange(addr, "GET", path, "", Duration::from_secs(10))
        .await
        .answer()
        .json()
}

async fn hits(addr: SocketAddr) -> Value {
    get_json(addr, "/admin/fault").await["hits"].clone()
}

#[tokio::test]
async fn status_faults_answer_openai_shaped_errors() {
    let addr = start().await;
    put_fault(addr, "429:retry_after=7").await;
    let a = post(addr, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!(a.status, 429);
    assert_eq!(a.header("retry-after"), Some("7"));
    assert_eq!(a.header("x-mock-name"), Some("primary"));
    let e = &a.json()["error"];
    assert_eq!(e["type"], "requests");
    assert_eq!(e["code"], "rate_limit_exceeded");
    assert!(e["message"].as_str().unwrap().contains("Rate limit"));

    put_fault(addr, "429").await;
    let a = post(addr, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!(a.status, 429);
    assert_eq!(a.header("retry-after"), None, "no Retry-After unless asked");

    for status in [500, 502, 503] {
        put_fault(addr, &format!("{status}:retry_after=1")).await;
        let a = post(addr, "/v1/completions", r#"{"prompt":"hi"}"#)
            .await
            .answer();
        assert_eq!(a.status, status);
        assert_eq!(a.header("retry-after"), Some("1"));
        assert_eq!(a.header("x-mock-name"), Some("primary"));
        assert_eq!(a.json()["error"]["type"], "server_error");
    }
}

#[tokio::test]
async fn faults_hit_every_model_route_and_nothing_else() {
    let addr = start().await;
    put_fault(addr, "503").await;
    for (path, body) in [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", r#"{"prompt":"hi"}"#),
        ("/v1/responses", r#"{"input":"hi"}"#),
        ("/v1/embeddings", r#"{"input":"hi"}"#),
        ("/v1/messages", r#"{"max_tokens":2,"messages":[]}"#),
        ("/api/chat", r#"{"messages":[]}"#),
        ("/api/generate", r#"{"prompt":"hi"}"#),
        ("/api/embed", r#"{"input":"hi"}"#),
    ] {
        let a = post(addr, path, body).await.answer();
        assert_eq!(a.status, 503, "{path}");
    }
    assert_eq!(hits(addr).await, 8);
    for path in ["/v1/models", "/metrics", "/admin/stats", "/admin/fault"] {
        let a = exchange(addr, "GET", path, "", Duration::from_secs(10))
            .await
            .answer();
        assert_eq!(a.status, 200, "{path}");
    }
    let a = exchange(addr, "GET", "/health", "", Duration::from_secs(10))
        .await
        .answer();
    assert_eq!(a.status, 404, "no /health: its own 404, not the fault");
    assert_eq!(hits(addr).await, 8);
    // Every faulted call still counts as a request that reached the server.
    let stats = get_json(addr, "/admin/stats").await;
    assert_eq!(stats["by_path"]["/v1/chat/completions"], 1);
    assert_eq!(stats["by_path"]["/api/embed"], 1);
}

#[tokio::test]
async fn reset_drops_the_connection_without_a_response() {
    let addr = start().await;
    put_fault(addr, "reset:times=1").await;
    match post(addr, "/v1/chat/completions", CHAT).await {
        Outcome::ConnectionError(kind) => {
            assert_eq!(kind, std::io::ErrorKind::ConnectionReset, "a TCP reset")
        }
        other => panic!("expected a connection error, got {other:?}"),
    }
    // Once used up, the same server answers.
    let a = post(addr, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!(a.status, 200);
    let fault = get_json(addr, "/admin/fault").await;
    assert_eq!(fault["hits"], 1);
    assert_eq!(fault["active"], false);
    let stats = get_json(addr, "/admin/stats").await;
    assert_eq!(stats["by_path"]["/v1/chat/completions"], 2);
}

#[tokio::test]
async fn reset_is_seen_by_a_blocking_std_client() {
    let addr = start().await;
    put_fault(addr, "reset").await;
    let outcome = tokio::task::spawn_blocking(move || {
        use std::io::{Read as _, Write as _};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let req = format!(
            "POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{CHAT}",
            CHAT.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut got = Vec::new();
        let r = s.read_to_end(&mut got);
        (r.map_err(|e| e.kind()), got)
    })
    .await
    .unwrap();
    assert_eq!(
        outcome,
        (Err(std::io::ErrorKind::ConnectionReset), Vec::new()),
        "no HTTP status, only a reset"
    );
}

#[tokio::test]
async fn hang_never_answers_until_the_client_gives_up() {
    let addr = start().await;
    put_fault(addr, "hang").await;
    let started = Instant::now();
    match exchange(
        addr,
        "POST",
        "/v1/chat/completions",
        CHAT,
        Duration::from_millis(400),
    )
    .await
    {
        Outcome::TimedOut(got) => assert!(got.is_empty(), "not even headers"),
        other => panic!("expected a client timeout, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(hits(addr).await, 1);
    let stats = get_json(addr, "/admin/stats").await;
    assert_eq!(
        stats["requests_total"], 1,
        "the hung call reached the server"
    );
    // The admin side still answers, and clearing the fault heals it.
    put_fault(addr, "none").await;
    assert_eq!(
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
        200
    );
}

#[tokio::test]
async fn slow_first_token_delays_the_head_then_answers() {
    let addr = start().await;
    put_fault(addr, "slow_first_token:ms=300").await;
    let started = Instant::now();
    // The head must not come before 300 ms.
    match exchange(
        addr,
        "POST",
        "/v1/chat/completions",
        STREAM,
        Duration::from_millis(200),
    )
    .await
    {
        Outcome::TimedOut(got) => assert!(got.is_empty()),
        other => panic!("answered too early: {other:?}"),
    }
    let started_full = Instant::now();
    let a = post(addr, "/v1/chat/completions", STREAM).await.answer();
    assert!(started_full.elapsed() >= Duration::from_millis(300));
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert_eq!(a.status, 200);
    assert!(a.clean_end);
    assert_eq!(a.events().last().map(String::as_str), Some("data: [DONE]"));
}

#[tokio::test]
async fn stream_cut_resets_after_n_chunks() {
    let addr = start().await;
    put_fault(addr, "stream_cut:after=2").await;
    let a = post(addr, "/v1/chat/completions", STREAM).await.answer();
    assert_eq!(a.status, 200);
    assert!(!a.clean_end, "a cut stream must not end cleanly");
    assert_eq!(a.events().len(), 2, "{:?}", a.events());
    // A call answered in one JSON body is not a stream: untouched, not a hit.
    assert_eq!(hits(addr).await, 1);
    let a = post(addr, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!((a.status, a.clean_end), (200, true));
    assert_eq!(a.json()["usage"]["completion_tokens"], 3);
    assert_eq!(hits(addr).await, 1);
}

#[tokio::test]
async fn stream_stall_sends_n_chunks_then_holds_the_connection() {
    let addr = start().await;
    put_fault(addr, "stream_stall:after=2").await;
    let got = match exchange(
        addr,
        "POST",
        "/v1/chat/completions",
        STREAM,
        Duration::from_millis(500),
    )
    .await
    {
        Outcome::TimedOut(got) => got,
        other => panic!("expected the stream to stay open, got {other:?}"),
    };
    let a = parse(&got);
    assert_eq!(a.status, 200);
    assert!(!a.clean_end);
    assert_eq!(a.events().len(), 2, "{:?}", a.events());
    assert!(a.events().iter().all(|e| !e.contains("[DONE]")));
}

#[tokio::test]
async fn malformed_chunk_breaks_chunk_n_plus_one_then_carries_on() {
    let addr = start().await;
    let normal = post(addr, "/v1/chat/completions", STREAM).await.answer();
    put_fault(addr, "malformed_chunk:after=1").await;
    let a = post(addr, "/v1/chat/completions", STREAM).await.answer();
    assert_eq!(a.status, 200);
    assert!(a.clean_end);
    let ev = a.events();
    assert_eq!(ev.len(), normal.events().len() + 1);
    // The first chunk is the normal role chunk (only the id differs).
    let first: Value = serde_json::from_str(ev[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let bad = ev[1].strip_prefix("data: ").unwrap();
    assert!(serde_json::from_str::<Value>(bad).is_err(), "{bad}");
    assert_eq!(ev.last().map(String::as_str), Some("data: [DONE]"));
    for e in &ev[2..ev.len() - 1] {
        serde_json::from_str::<Value>(e.strip_prefix("data: ").unwrap()).unwrap();
    }
}

#[tokio::test]
async fn no_done_ends_cleanly_without_the_terminator() {
    let addr = start().await;
    put_fault(addr, "no_done").await;
    let a = post(addr, "/v1/chat/completions", STREAM).await.answer();
    assert_eq!(a.status, 200);
    assert!(a.clean_end, "the body ends cleanly");
    let ev = a.events();
    assert!(!ev.iter().any(|e| e.contains("[DONE]")), "{ev:?}");
    let last: Value =
        serde_json::from_str(ev.last().unwrap().strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    // Ollama's NDJSON loses its closing `done: true` line instead.
    let a = post(addr, "/api/generate", r#"{"prompt":"hi"}"#)
        .await
        .answer();
    let text = String::from_utf8_lossy(&a.body).into_owned();
    assert!(a.clean_end);
    assert!(!text.contains("\"done\":true"), "{text}");
}

#[tokio::test]
async fn context_length_answers_each_servers_body() {
    let addr = start_with(Config {
        max_model_len: 100,
        ..Config::default()
    })
    .await;
    put_fault(addr, "context_length").await;
    let a = post(addr, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!(a.status, 400);
    let e = &a.json()["error"];
    assert_eq!(e["type"], "invalid_request_error");
    assert_eq!(e["param"], "messages");
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(
        e["message"],
        "This model's maximum context length is 100 tokens. However, your messages \
         resulted in 101 tokens. Please reduce the length of the messages."
    );
    let vllm = start_with(Config {
        personality: Personality::Vllm,
        max_model_len: 100,
        fault: mock_llm::fault::parse("context_length").unwrap(),
        ..Config::default()
    })
    .await;
    let a = post(vllm, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!(a.status, 400);
    let msg = a.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("your request has 101 input tokens"), "{msg}");
}

#[tokio::test]
async fn content_filter_answers_azures_body() {
    let addr = start().await;
    put_fault(addr, "content_filter").await;
    let a = post(addr, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!(a.status, 400);
    assert_eq!(a.header("x-mock-name"), Some("primary"));
    let e = &a.json()["error"];
    assert_eq!(e["code"], "content_filter");
    assert_eq!(e["param"], "prompt");
    assert_eq!(e["type"], Value::Null);
    assert_eq!(e["status"], 400);
    assert_eq!(e["innererror"]["code"], "ResponsibleAIPolicyViolation");
    assert!(e["message"]
        .as_str()
        .unwrap()
        .contains("content management policy"));
}

#[tokio::test]
async fn times_limits_the_hits_then_the_server_heals() {
    let addr = start().await;
    put_fault(addr, "500:times=2").await;
    let statuses = [
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
    ];
    assert_eq!(statuses, [500, 500, 200]);
    let fault = get_json(addr, "/admin/fault").await;
    assert_eq!(fault["fault"], "500:times=2");
    assert_eq!(fault["hits"], 2);
    assert_eq!(fault["active"], false);
    let stats = get_json(addr, "/admin/stats").await;
    assert_eq!(stats["requests_total"], 3, "every attempt is counted");
}

#[tokio::test]
async fn for_ms_limits_the_fault_in_time() {
    let addr = start().await;
    put_fault(addr, "503:for_ms=300").await;
    assert_eq!(
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
        503
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
        200
    );
    assert_eq!(hits(addr).await, 1);
}

#[tokio::test]
async fn admin_fault_replaces_reports_and_clears() {
    let addr = start().await;
    assert_eq!(
        get_json(addr, "/admin/fault").await,
        serde_json::json!({"fault": null, "hits": 0, "active": false})
    );
    let a = put_fault(addr, "429:times=5").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["fault"], "429:times=5");
    post(addr, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!(hits(addr).await, 1);
    // Replacing restarts the count.
    put_fault(addr, "502").await;
    let fault = get_json(addr, "/admin/fault").await;
    assert_eq!(
        (fault["fault"].as_str(), fault["hits"].as_u64()),
        (Some("502"), Some(0))
    );
    assert_eq!(
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
        502
    );
    // An empty body clears it, as `none` does.
    put_fault(addr, "").await;
    assert_eq!(get_json(addr, "/admin/fault").await["fault"], Value::Null);
    assert_eq!(
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
        200
    );
}

#[tokio::test]
async fn bad_specs_are_a_400_naming_the_bad_part() {
    let addr = start().await;
    put_fault(addr, "503").await;
    for (spec, names) in [
        ("teapot", "teapot"),
        ("stream_cut", "after"),
        ("429:retry_after=later", "retry_after"),
        ("hang:bogus=1", "bogus"),
    ] {
        let a = put_fault(addr, spec).await;
        assert_eq!(a.status, 400, "{spec}");
        let msg = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains(names), "{spec}: {msg}");
    }
    // A refused spec leaves the fault in force.
    assert_eq!(get_json(addr, "/admin/fault").await["fault"], "503");
}

#[test]
fn the_cli_refuses_a_bad_fault_naming_it() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mock-llm"))
        .args(["--listen", "127.0.0.1:0", "--fault", "stream_cut:afterr=2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("afterr") && err.contains("--fault"), "{err}");
    assert!(out.stdout.is_empty(), "never started listening");
}

#[tokio::test]
async fn the_cli_fault_is_in_force_from_the_start() {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_mock-llm"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--name",
            "cli",
            "--fault",
            "503:times=1",
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next_line().await.unwrap().unwrap();
    let addr: SocketAddr = line
        .strip_prefix("mock-llm listening on ")
        .unwrap()
        .parse()
        .unwrap();
    let a = post(addr, "/v1/chat/completions", CHAT).await.answer();
    assert_eq!((a.status, a.header("x-mock-name")), (503, Some("cli")));
    assert_eq!(
        post(addr, "/v1/chat/completions", CHAT)
            .await
            .answer()
            .status,
        200
    );
    child.kill().await.unwrap();
}

#[tokio::test]
async fn shutdown_does_not_wait_forever_on_a_hung_call() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = mock_llm::app(Config {
        fault: mock_llm::fault::parse("hang").unwrap(),
        ..Config::default()
    })
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(mock_llm::serve(listener, app, async {
        let _ = stopped.await;
    }));
    let hung = tokio::spawn(exchange(
        addr,
        "POST",
        "/v1/chat/completions",
        CHAT,
        Duration::from_secs(30),
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();
    let stopping = Instant::now();
    let served = tokio::time::timeout(Duration::from_secs(8), server)
        .await
        .expect("serve returned after the drain");
    served.unwrap().unwrap();
    assert!(
        stopping.elapsed() >= Duration::from_secs(4),
        "the drain was waited"
    );
    // Its connection task lives on with the runtime (the binary exits
    // here, taking it along); the client never got an answer.
    assert!(!hung.is_finished());
    hung.abort();
}
