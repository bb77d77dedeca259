//! Drives the real server over TCP, because a clean stream end and an abrupt
//! reset differ only on the wire (HTTP/1.1 chunked framing).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn start() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = mock_llm::app(mock_llm::Config::default()).unwrap();
    tokio::spawn(mock_llm::serve(listener, app, std::future::pending()));
    addr
}

/// What a raw HTTP/1.1 exchange produced.
struct Exchange {
    head: String,
    /// The de-chunked body bytes received.
    body: Vec<u8>,
    /// Whether the chunked body ended with its terminating zero-size chunk.
    clean_end: bool,
}

/// Sends one request with `Connection: close` and reads until the server
/// closes or resets. A tiny hand-written client, since the point is to see
/// the framing that a real client library would hide.
async fn exchange(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> Exchange {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes()).await.unwrap();

    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    let read_all = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read_all)
        .await
        .expect("server neither finished nor reset the stream");

    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    assert!(
        head.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    let (body, clean_end) = dechunk(&raw[split + 4..]);
    Exchange {
        head,
        body,
        clean_end,
    }
}

/// Decodes a chunked body; `clean_end` only when the zero chunk arrived.
fn dechunk(mut rest: &[u8]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return (body, false);
        };
        let size_text = String::from_utf8_lossy(&rest[..eol]);
        let size = usize::from_str_radix(size_text.trim(), 16).expect("chunk size");
        rest = &rest[eol + 2..];
        if size == 0 {
            return (body, rest.starts_with(b"\r\n"));
        }
        if rest.len() < size + 2 {
            body.extend_from_slice(&rest[..size.min(rest.len())]);
            return (body, false);
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

const CHAT: &str = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},
"max_tokens":3,"messages":[{"role":"user","content":"hello world!"}]}"#;

#[tokio::test]
async fn stream_with_include_usage_ends_with_usage_then_done() {
    let addr = start().await;
    let ex = exchange(addr, "/v1/chat/completions", &[], CHAT).await;
    assert!(ex.head.starts_with("HTTP/1.1 200"), "{}", ex.head);
    assert!(ex.clean_end, "a normal stream must end cleanly");
    let ev = events(&ex.body);
    // role, 3 tokens, finish, usage, [DONE]
    assert_eq!(ev.len(), 7, "{ev:#?}");
    assert_eq!(ev.last().map(String::as_str), Some("data: [DONE]"));
    let usage: serde_json::Value =
        serde_json::from_str(ev[ev.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["choices"], serde_json::json!([]));
    assert_eq!(
        usage["usage"],
        serde_json::json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
    );
}

#[tokio::test]
async fn reset_knob_truncates_the_stream() {
    let addr = start().await;
    for (after, delay) in [("2", "5"), ("2", "0"), ("0", "0"), ("4", "0")] {
        let ex = exchange(
            addr,
            "/v1/chat/completions",
            &[
                ("x-mock-reset-after-chunks", after),
                ("x-mock-chunk-delay-ms", delay),
            ],
            CHAT,
        )
        .await;
        assert!(ex.head.starts_with("HTTP/1.1 200"), "{}", ex.head);
        assert!(!ex.clean_end, "a reset stream must not end cleanly");
        let ev = events(&ex.body);
        assert_eq!(ev.len().to_string(), after, "{ev:#?}");
        assert!(!ev.iter().any(|e| e.contains("[DONE]")));
    }
}
