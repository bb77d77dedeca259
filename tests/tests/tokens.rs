//! Token economics against a real Envoy (docs/src/design.md, "Demand and estimate",
//! "Admit", "Settle"; issue 3): reservations of input estimate + max output that
//! admit exactly what a budget holds, settlement at the upstream's usage, streams
//! cut at their allowance, no leaked reservation when clients vanish, untrustworthy
//! usage, soft-cap downshift, the request rewrites the upstream sees,
//! denial-of-wallet and budget alerts.
//!
//! Requests name a model the policy does not list unless a test needs one:
//! such a model never gets a learned estimate correction, so its input
//! estimate is exactly `ceil(input_tokens(body))` and every reservation here
//! is computed, not guessed.
//!
//! Upstream: the tests of what a chat server reads and answers (the stream
//! cut, usage sluice cannot believe, the limit and usage chunk the upstream
//! gets) run against every personality that speaks chat
//! ([`sluice_tests::speaking`]); the others test the policy's arithmetic
//! and run against mock-llm's own (`Personality::Mock`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mock_llm::generate::Api;
use serde_json::{json, Value as Json};
use sluice_core::bench::{input_tokens, text_tokens};
use sluice_tests::{
    against, async_client, chat_request, get, post_json, post_json_async, prometheus_value,
    runtime, speaking, wait_for, Personality, PolicyBuilder, Response, Stack,
};

/// A model the policy does not list: its estimate is never corrected.
const UNLISTED: &str = "sluice-test-model";
const BIG: &str = "llama3.1:70b";
const SMALL: &str = "llama3.1:8b";
/// The shortest output sluice lowers a request to before refusing it.
const MIN_LOWERED_OUTPUT: u64 = sluice_core::bench::MIN_LOWERED_OUTPUT;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// A chat body for [`UNLISTED`].
fn chat(content: &str, max_tokens: Option<u64>, stream: bool) -> Json {
    chat_request(UNLISTED, content, max_tokens, stream)
}

/// sluice's input estimate of `body` (exact for [`UNLISTED`]).
fn estimate(body: &Json) -> u64 {
    input_tokens(body).ceil() as u64
}

/// The input a hard budget (`daily_tokens`) reserves for `body`: its
/// bound at the default figures (exact for [`UNLISTED`]), never below the
/// estimate. Rates and soft caps reserve [`estimate`].
fn bound(body: &Json) -> u64 {
    let figures = sluice_core::bench::InputBound::default();
    let rendered = sluice_core::bench::rendered(sluice_core::bench::Api::OpenAiChat, body);
    rendered.tokens(&figures, None).max(estimate(body))
}

/// The input tokens mock-llm reports for one message: ceil(chars / 4).
fn mock_input(content: &str) -> u64 {
    (content.chars().count() as u64).div_ceil(4).max(1)
}

fn int_header(resp: &Response, name: &str) -> u64 {
    let value = resp
        .header(name)
        .unwrap_or_else(|| panic!("no `{name}` header in {resp:?}"));
    value
        .parse()
        .unwrap_or_else(|_| panic!("`{name}: {value}` is not an integer"))
}

fn metric(stack: &Stack, name: &str) -> u64 {
    stack.envoy.metric(name, &[]).unwrap_or(0.0) as u64
}

/// Tokens settled so far in one direction, all tiers and models.
fn settled(stack: &Stack, direction: &str) -> u64 {
    let labels = [("direction", direction), ("kind", "actual")];
    stack
        .envoy
        .metric("sluice_tokens_total", &labels)
        .unwrap_or(0.0) as u64
}

/// Tokens settled so far (input + output), from the filter's counters.
fn charged(stack: &Stack) -> u64 {
    settled(stack, "input") + settled(stack, "output")
}

fn outstanding(stack: &Stack) -> Option<f64> {
    stack.envoy.metric("sluice_reservations_outstanding", &[])
}

/// Waits until no reservation is held; panics with the gauge otherwise.
fn assert_no_reservation_left(stack: &Stack) {
    let drained = wait_for(Duration::from_secs(10), || outstanding(stack) == Some(0.0));
    assert!(
        drained,
        "sluice_reservations_outstanding is {:?}, not back to 0",
        outstanding(stack)
    );
}

/// The upstream's view of the last request body.
fn upstream_body(stack: &Stack) -> Json {
    stack.upstream.stats()["last_request"]["body"].clone()
}

/// `usage.total_tokens` of a JSON answer.
fn total_tokens(resp: &Response) -> u64 {
    let body = resp.json();
    body["usage"]["total_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage.total_tokens in {body}"))
}

/// The `data:` payloads of an SSE body, in order.
fn sse_payloads(body: &str) -> Vec<&str> {
    body.split("\n\n")
        .filter_map(|event| {
            event
                .lines()
                .find_map(|line| line.strip_prefix("data:"))
                .map(str::trim)
        })
        .collect()
}

/// Payloads of an SSE body that are JSON (everything but `[DONE]`).
fn sse_json(body: &str) -> Vec<Json> {
    sse_payloads(body)
        .into_iter()
        .filter(|p| *p != "[DONE]")
        .map(|p| serde_json::from_str(p).unwrap_or_else(|e| panic!("event {p:?}: {e}")))
        .collect()
}

/// Events carrying generated text.
fn content_events(events: &[Json]) -> usize {
    events
        .iter()
        .filter(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .count()
}

/// A usage-only chunk (`"choices": []` with usage), as OpenAI sends last.
fn is_usage_chunk(e: &Json) -> bool {
    e["choices"].as_array().is_some_and(Vec::is_empty) && e["usage"].is_object()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

/// A 429 by `reason` (docs/src/design.md, "What the client sees"); returns `error.sluice`.
fn assert_refused(resp: &Response, reason: &str) -> Json {
    assert_eq!(resp.status, 429, "{resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), Some(reason), "{resp:?}");
    let body = resp.json();
    assert_eq!(body["error"]["code"], reason, "{body}");
    // OpenAI's type for an exhausted plan (SDKs do not retry it) or a rate.
    let kind = match reason {
        "daily_budget_exceeded" | "monthly_budget_exceeded" | "spend_cap_exceeded" => {
            "insufficient_quota"
        }
        _ => "rate_limit_exceeded",
    };
    assert_eq!(body["error"]["type"], kind, "{body}");
    body["error"]["sluice"].clone()
}

/// The 429 of a daily budget: `reset_at` is the next 00:00 UTC.
fn assert_daily_budget_refusal(resp: &Response) -> Json {
    let sluice = assert_refused(resp, "daily_budget_exceeded");
    let reset_at = sluice["reset_at"].as_str().unwrap_or_default();
    let reset = sluice_tests::parse_rfc3339_utc(reset_at)
        .unwrap_or_else(|| panic!("reset_at {reset_at:?}"));
    let now = now_secs();
    assert!(
        reset.is_multiple_of(86_400) && reset > now.saturating_sub(2) && reset <= now + 86_400,
        "reset_at {reset_at} is not the next 00:00 UTC (now {now})"
    );
    int_header(resp, "retry-after");
    sluice
}

/// A short prompt whose estimate is at least what mock-llm counts (chat
/// framing outweighs four characters a token), so a request sluice lowers
/// to the last tokens of a budget cannot overrun it through its input.
const PROMPT: &str = "Reply with a short greeting, please.";

// ---------------------------------------------------------------------------
// 1. Concurrency: a budget admits exactly what it holds
// ---------------------------------------------------------------------------

#[test]
fn concurrent_requests_fill_a_daily_budget_exactly_and_never_overshoot() {
    const BUDGET: u64 = 10_000;
    const EACH: u64 = 500;
    const CALLS: usize = 100;
    let stack = Stack::start_with(4, |cfg| {
        cfg.set_policy(
            &PolicyBuilder::one_tier(json!({"requests": "100000/min", "daily_tokens": BUDGET}))
                .build(),
        )
    });
    let est = bound(&chat(PROMPT, None, false));
    assert!(est >= mock_input(PROMPT), "bound {est} under mock's count");
    // Each request reserves exactly EACH: its input's bound + max_tokens.
    let body = chat(PROMPT, Some(EACH - est), false);
    assert_eq!(bound(&body), est);

    let url = stack.envoy.url("/v1/chat/completions");
    let answers = runtime().block_on(async {
        let calls: Vec<_> = (0..CALLS)
            .map(|_| {
                let (url, body) = (url.clone(), body.clone());
                tokio::spawn(async move {
                    // One client, so one connection, per call: spread over
                    // Envoy's workers. The latency keeps every admitted
                    // request in flight until all have been decided.
                    let client = async_client();
                    post_json_async(&client, &url, &[("x-mock-latency-ms", "400")], &body).await
                })
            })
            .collect();
        let mut answers = Vec::with_capacity(CALLS);
        for call in calls {
            answers.push(call.await.expect("task").expect("request"));
        }
        answers
    });

    let admitted: Vec<&Response> = answers.iter().filter(|r| r.status == 200).collect();
    let refused: Vec<&Response> = answers.iter().filter(|r| r.status == 429).collect();
    let statuses: Vec<u16> = answers.iter().map(|r| r.status).collect();
    assert_eq!((admitted.len(), refused.len()), (20, 80), "{statuses:?}");
    for resp in &refused {
        assert_daily_budget_refusal(resp);
    }
    assert_eq!(stack.upstream_requests(), 20);
    let mut used: u64 = admitted.iter().map(|r| total_tokens(r)).sum();
    let concurrent_usage = used;
    assert_no_reservation_left(&stack);
    // Settlement replaced every reservation by the (smaller) real usage.
    assert_eq!(charged(&stack), used, "settled at the mock's usage");

    // Later requests fit in what settlement gave back, until it is spent.
    let mut sequential = 0u64;
    let last = loop {
        let resp = post_json(&url, &[], &body);
        match resp.status {
            200 => {
                used += total_tokens(&resp);
                sequential += 1;
            }
            429 => break resp,
            other => panic!("unexpected {other}: {resp:?}"),
        }
        assert!(sequential < 2_000, "the budget never ran out");
    };
    let sluice = assert_daily_budget_refusal(&last);
    let remaining = sluice["remaining"].as_u64().expect("remaining");
    println!(
        "concurrency: admitted 20/100 reserving {EACH} each; their usage {concurrent_usage}; \
         then {sequential} sequential admits; total usage {used} of {BUDGET} \
         (overshoot {}), {remaining} left (est {est})",
        used.saturating_sub(BUDGET)
    );
    assert!(sequential > 0, "nothing fit after settlement");
    assert!(used <= BUDGET, "overshoot: {used} > {BUDGET}");
    // What the bucket holds is exactly the usage reported, and what is left
    // cannot cover even the shortest answer: the budget is truly spent.
    assert_eq!(remaining, BUDGET - used);
    assert!(remaining < est + MIN_LOWERED_OUTPUT, "{remaining} left");
    assert_eq!(charged(&stack), used);
    assert_eq!(stack.upstream_requests(), 20 + sequential);
    assert_no_reservation_left(&stack);
}

// ---------------------------------------------------------------------------
// 2. A stream that would cross a hard budget is ended cleanly
// ---------------------------------------------------------------------------

#[test]
fn a_stream_crossing_the_budget_ends_with_an_error_event_at_the_budget() {
    against(&speaking(Api::ChatCompletions), stream_cut_at_the_budget);
}

/// The stream cut, against an upstream playing `p`: every chat server
/// frames its stream and its usage its own way.
fn stream_cut_at_the_budget(p: Personality) {
    const BUDGET: u64 = 1_000;
    let stack = Stack::start_as(p, |cfg| {
        cfg.set_policy(
            &PolicyBuilder::one_tier(json!({"requests": "1000/min", "daily_tokens": BUDGET}))
                .build(),
        )
    });
    // Asks for more than the budget: sluice lowers max_tokens to what it
    // covers, and the upstream ignores it and keeps generating.
    let body = chat(PROMPT, Some(5_000), true);
    let est = bound(&body);
    let allowance = BUDGET - est;
    let started = Instant::now();
    let resp = post_cut(
        &stack.envoy.url("/v1/chat/completions"),
        &[("x-mock-output-tokens", "3000")],
        &body,
    );
    let elapsed = started.elapsed();
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(upstream_body(&stack)["max_tokens"], allowance);

    let payloads = sse_payloads(&resp.body);
    assert_eq!(payloads.last(), Some(&"[DONE]"), "{}", resp.body);
    assert_eq!(payloads.iter().filter(|p| **p == "[DONE]").count(), 1);
    let events = sse_json(&resp.body);
    let error = events.last().expect("events");
    assert_eq!(
        error["error"]["code"], "budget_exhausted_midstream",
        "{error}"
    );
    assert_eq!(error["error"]["type"], "rate_limit_exceeded", "{error}");
    assert!(error["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    assert_eq!(content_events(&events) as u64, allowance);
    assert!(!events.iter().any(is_usage_chunk), "usage chunk leaked");
    assert_eq!(metric(&stack, "sluice_stream_cut_total"), 1);

    assert_no_reservation_left(&stack);
    let spent = charged(&stack);
    println!(
        "streaming: cut after {allowance} output events (est {est}), charged {spent} \
         of {BUDGET} (overshoot {}), {elapsed:?}",
        spent as i64 - BUDGET as i64
    );
    // The input's bound (the cut stream never reported its input) + every
    // event the client got: the budget, to the token.
    assert_eq!(spent, BUDGET);

    let next = post_json(
        &stack.envoy.url("/v1/chat/completions"),
        &[],
        &chat(PROMPT, Some(1), false),
    );
    let sluice = assert_daily_budget_refusal(&next);
    assert_eq!(sluice["remaining"], 0, "{sluice}");
    assert_eq!(stack.upstream_requests(), 1);
}

/// How a client's read of a streamed answer ended.
#[derive(Debug)]
struct Read {
    body: String,
    /// When the body first ended with `data: [DONE]`.
    done_at: Option<Instant>,
    /// When the read ended, and how: `None` at a clean end of stream, the
    /// transport's error otherwise.
    ended_at: Instant,
    error: Option<String>,
}

/// What a client has read of a stream so far.
#[derive(Default)]
struct Reading {
    body: Vec<u8>,
    done_at: Option<Instant>,
}

impl Reading {
    fn push(&mut self, chunk: &[u8]) {
        self.body.extend_from_slice(chunk);
        if self.done_at.is_none() && self.body.ends_with(b"data: [DONE]\n\n") {
            self.done_at = Some(Instant::now());
        }
    }

    fn end(self, error: Option<String>) -> Read {
        Read {
            body: String::from_utf8_lossy(&self.body).into_owned(),
            done_at: self.done_at,
            ended_at: Instant::now(),
            error,
        }
    }
}

/// Reads a streamed answer the way a client that keeps its connection
/// does: to the end, never closing it first; `None` when no byte came for
/// `patience` (the stream never ended).
async fn read_to_end(resp: reqwest::Response, patience: Duration) -> Option<Read> {
    let mut resp = resp;
    let mut reading = Reading::default();
    let error = loop {
        match tokio::time::timeout(patience, resp.chunk()).await {
            Err(_) => return None,
            Ok(Ok(Some(chunk))) => reading.push(&chunk),
            Ok(Ok(None)) => break None,
            Ok(Err(e)) => break Some(format!("{e:?}")),
        }
    };
    Some(reading.end(error))
}

/// [`read_to_end`] of a chat POST over HTTP/2 (h2c, prior knowledge).
async fn read_h2_to_end(
    addr: std::net::SocketAddr,
    headers: &[(&str, &str)],
    body: &Json,
    patience: Duration,
) -> Option<Read> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(()).expect("request");
    let (response, mut stream) = client.send_request(req, false).expect("send headers");
    stream
        .send_data(bytes::Bytes::from(body.to_string()), true)
        .expect("send body");
    let response = response.await.expect("response");
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut reading = Reading::default();
    let error = loop {
        match tokio::time::timeout(patience, body.data()).await {
            Err(_) => return None,
            Ok(Some(Ok(chunk))) => {
                let _ = body.flow_control().release_capacity(chunk.len());
                reading.push(&chunk);
            }
            Ok(None) => break None,
            Ok(Some(Err(e))) => break Some(format!("{e:?}")),
        }
    };
    Some(reading.end(error))
}

/// POSTs a stream that sluice cuts and reads it to its end. An upstream
/// that sends on past the cut gets the stream reset (issue 48), so the
/// read may end in a transport error: only after the cut's `[DONE]`.
fn post_cut(url: &str, headers: &[(&str, &str)], body: &Json) -> Response {
    runtime().block_on(async {
        let mut req = async_client()
            .post(url)
            .header("content-type", "application/json")
            .body(body.to_string());
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let resp = req.send().await.expect("send");
        let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
        let read = read_to_end(resp, Duration::from_secs(10))
            .await
            .expect("the cut stream never ended");
        if let Some(error) = &read.error {
            assert!(
                read.body.trim_end().ends_with("data: [DONE]"),
                "{error} before the cut's end: {}",
                read.body
            );
        }
        Response {
            status,
            headers,
            body: read.body,
        }
    })
}

/// Issue 48, "the cut ends the work": an upstream that ignores its limit
/// and streams on slowly is reset at its next chunk after the cut. The
/// client's stream ends without the client closing it, the upstream sees
/// its connection closed within a bound, what it generated stops growing,
/// and the request is charged what the client got.
#[test]
fn a_cut_stream_ends_and_its_upstream_stops_generating() {
    for h2 in [false, true] {
        cut_ends_the_work(h2);
    }
}

/// The test above over HTTP/1.1, or HTTP/2 (`h2`).
fn cut_ends_the_work(h2: bool) {
    const MAX_OUTPUT: u64 = 24;
    const CHUNK_MS: u64 = 25;
    /// 75 s of generating, were the server left to it.
    const OUTPUT: u64 = 3_000;
    const BOUND: Duration = Duration::from_secs(2);
    let stack = Stack::start(|cfg| {
        cfg.set_policy(
            &PolicyBuilder::one_tier(json!({"requests": "1000/min", "daily_tokens": 1_000_000}))
                .build(),
        )
    });
    let body = chat(PROMPT, Some(MAX_OUTPUT), true);
    let url = stack.envoy.url("/v1/chat/completions");
    let stats = stack.upstream.url("/admin/stats");
    let stream = || get(&stats, &[]).ok().json()["streams"][0].clone();
    // The upstream's end is watched while the client reads: when its body
    // stopped being sent (the mock sees the connection go at its next
    // write, one chunk's delay at most).
    let (read, upstream_closed) = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let mut closed = None;
            wait_for(Duration::from_secs(15), || {
                let ended = stream()["ended"].as_str().is_some_and(|e| e != "open");
                if ended {
                    closed = Some(Instant::now());
                }
                ended
            });
            closed
        });
        let (output, delay) = (OUTPUT.to_string(), CHUNK_MS.to_string());
        let knobs = [
            ("x-mock-output-tokens", output.as_str()),
            ("x-mock-chunk-delay-ms", delay.as_str()),
        ];
        let patience = Duration::from_secs(5);
        let read = runtime().block_on(async {
            if h2 {
                return read_h2_to_end(stack.envoy.addr(), &knobs, &body, patience).await;
            }
            let mut req = async_client()
                .post(&url)
                .header("content-type", "application/json")
                .body(body.to_string());
            for (name, value) in knobs {
                req = req.header(name, value);
            }
            let resp = req.send().await.expect("send");
            assert_eq!(resp.status(), 200);
            read_to_end(resp, patience).await
        });
        (read, watcher.join().ok().flatten())
    });
    let read = read.expect("the stream never ended: sluice cut it and left it open");
    let done_at = read.done_at.expect("the cut's [DONE] reached the client");

    // The client got the cut's end, then the end of its stream.
    let events = sse_json(&read.body);
    assert_eq!(content_events(&events) as u64, MAX_OUTPUT, "{}", read.body);
    assert_eq!(
        events.last().expect("events")["error"]["code"],
        "budget_exhausted_midstream"
    );
    assert_eq!(sse_payloads(&read.body).last(), Some(&"[DONE]"));
    let client_end = read.ended_at.duration_since(done_at);
    assert!(
        client_end < BOUND,
        "the stream ended {client_end:?} after [DONE]"
    );

    // The upstream's connection was closed: its body was dropped unsent.
    let upstream_closed = upstream_closed.expect("the upstream streamed on for 15 s");
    let upstream_end = upstream_closed.saturating_duration_since(done_at);
    assert!(
        upstream_end < BOUND,
        "the upstream streamed on {upstream_end:?} past [DONE]"
    );
    let seen = stream();
    assert_eq!(seen["ended"], "dropped", "{seen}");
    // Frames up to the one sluice cut at: the role chunk, the allowance,
    // the first content chunk past it.
    let at_cut = MAX_OUTPUT + 2;
    let sent = seen["frames_sent"].as_u64().unwrap_or(u64::MAX);
    let after_cut = sent.saturating_sub(at_cut);
    assert!(
        after_cut <= 3,
        "generated {after_cut} frames after the cut: {seen}"
    );
    assert!(sent < seen["frames"].as_u64().unwrap_or(0), "{seen}");

    // Charged the input's bound (the cut stream never reported its input)
    // and what the client got; nothing held.
    assert_eq!(metric(&stack, "sluice_stream_cut_total"), 1);
    assert_eq!(metric(&stack, "sluice_stream_reset_total"), 1);
    assert_no_reservation_left(&stack);
    assert_eq!(charged(&stack), bound(&body) + MAX_OUTPUT);
    let protocol = if h2 { "HTTP/2" } else { "HTTP/1.1" };
    println!(
        "{protocol}: cut at {MAX_OUTPUT} output events, one every {CHUNK_MS} ms: the upstream stopped \
         {upstream_end:?} after the client's [DONE] (polled every 20 ms), having generated \
         {after_cut} frame(s) past the cut ({sent} of {}); the client's stream ended \
         {client_end:?} after its [DONE] ({})",
        seen["frames"],
        read.error.as_deref().unwrap_or("a clean end of stream"),
    );
}

// ---------------------------------------------------------------------------
// 3. Clients that vanish mid-stream leak nothing
// ---------------------------------------------------------------------------

/// How one stream of the disconnect test ends.
#[derive(Debug, Clone, Copy)]
enum Ending {
    /// The client gives up after this many ms, before the first byte.
    BeforeFirstByte(u64),
    /// The client drops the response after this many body chunks.
    AfterChunks(usize),
    /// The upstream aborts after this many chunks.
    UpstreamReset(usize),
    /// Read to the end.
    Complete,
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

async fn one_stream(url: String, body: Json, ending: Ending) {
    let client = async_client();
    let mut req = client
        .post(&url)
        .header("content-type", "application/json")
        .header("x-mock-chunk-delay-ms", "4")
        .header("x-mock-output-tokens", "24")
        .body(body.to_string());
    match ending {
        Ending::BeforeFirstByte(ms) => {
            let req = req.header("x-mock-latency-ms", "200");
            let sent = tokio::time::timeout(Duration::from_millis(ms), req.send()).await;
            assert!(sent.is_err(), "answered within {ms} ms despite the latency");
        }
        Ending::AfterChunks(n) => {
            let mut resp = req.send().await.expect("send");
            for _ in 0..n {
                if !matches!(resp.chunk().await, Ok(Some(_))) {
                    break;
                }
            }
            drop(resp); // closes the connection mid-stream
        }
        Ending::UpstreamReset(n) => {
            req = req.header("x-mock-reset-after-chunks", n.to_string());
            if let Ok(mut resp) = req.send().await {
                while let Ok(Some(_)) = resp.chunk().await {}
            }
        }
        Ending::Complete => {
            let mut resp = req.send().await.expect("send");
            while resp.chunk().await.expect("whole stream").is_some() {}
        }
    }
}

#[test]
fn five_hundred_streams_with_random_disconnects_leave_no_reservation() {
    const STREAMS: u64 = 500;
    const AT_ONCE: usize = 50;
    let mut stack = Stack::start_with(4, |cfg| {
        cfg.set_policy(
            &PolicyBuilder::one_tier(
                json!({"requests": "1000000/min", "daily_tokens": 100_000_000}),
            )
            .build(),
        )
    });
    let url = stack.envoy.url("/v1/chat/completions");
    let stats_url = stack.envoy.admin_url("/stats/prometheus");
    let body = chat(PROMPT, Some(64), true);

    let mut rng = 0x5eed_cafe_f00d_u64;
    let endings: Vec<Ending> = (0..STREAMS)
        .map(|_| match xorshift(&mut rng) % 10 {
            0 | 1 => Ending::BeforeFirstByte(xorshift(&mut rng) % 120),
            2 => Ending::UpstreamReset((xorshift(&mut rng) % 20) as usize),
            3 => Ending::Complete,
            _ => Ending::AfterChunks((xorshift(&mut rng) % 30) as usize),
        })
        .collect();

    let target = url.clone();
    let peak = runtime().block_on(async move {
        let done = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let sampler = {
            let (done, peak) = (done.clone(), peak.clone());
            tokio::spawn(async move {
                let client = async_client();
                while !done.load(Ordering::Relaxed) {
                    if let Ok(resp) = client.get(&stats_url).send().await {
                        let text = resp.text().await.unwrap_or_default();
                        let v = prometheus_value(&text, "sluice_reservations_outstanding", &[])
                            .unwrap_or(0.0);
                        peak.fetch_max(v as u64, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
            })
        };
        let slots = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
        let mut tasks = Vec::new();
        for ending in endings {
            let permit = slots.clone().acquire_owned().await.expect("semaphore");
            let (url, body) = (target.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                one_stream(url, body, ending).await;
                drop(permit);
            }));
        }
        for task in tasks {
            task.await.expect("stream task");
        }
        done.store(true, Ordering::Relaxed);
        sampler.await.expect("sampler");
        peak.load(Ordering::Relaxed)
    });

    assert!(peak > 0, "never saw a reservation in flight");
    let started = Instant::now();
    assert_no_reservation_left(&stack);
    println!(
        "disconnects: {STREAMS} streams, peak {peak} reservations outstanding, \
         back to 0 {:?} after the last client",
        started.elapsed()
    );
    // Envoy is alive, and the bucket holds exactly what was settled:
    // nothing stayed reserved for a stream that is gone.
    assert!(stack.envoy.process().try_wait().is_none(), "Envoy exited");
    let ready = get(&stack.envoy.admin_url("/ready"), &[]);
    assert_eq!((ready.status, ready.body.trim()), (200, "LIVE"));
    let probe = chat(PROMPT, Some(1), false);
    let settled = charged(&stack);
    let resp = post_json(&url, &[], &probe);
    assert_eq!(resp.status, 200, "{resp:?}");
    // A hard daily budget: the probe holds its input's bound.
    let reserved_now = bound(&probe) + 1;
    assert_eq!(
        int_header(&resp, "x-ratelimit-remaining-tokens"),
        100_000_000 - settled - reserved_now
    );
}

// ---------------------------------------------------------------------------
// 4. Usage sluice cannot believe
// ---------------------------------------------------------------------------

#[test]
fn missing_or_unbelievable_usage_settles_at_the_bound_on_a_hard_budget() {
    against(&speaking(Api::ChatCompletions), settles_unbelievable_usage);
}

/// Usage sluice cannot believe, from an upstream playing `p`: each chat
/// server reports usage its own way (a usage chunk, zeros on every chunk).
fn settles_unbelievable_usage(p: Personality) {
    const BUDGET: u64 = 1_000_000;
    const MAX: u64 = 20;
    let stack = Stack::start_as(p, |cfg| {
        cfg.set_policy(
            &PolicyBuilder::one_tier(json!({"requests": "1000/min", "daily_tokens": BUDGET}))
                .build(),
        )
    });
    let url = stack.envoy.url("/v1/chat/completions");
    // Input nobody reported is charged to the hard budget at its bound.
    let est = bound(&chat(PROMPT, None, false));
    // (x-mock-usage, stream); every request reserves est + MAX, so the
    // remaining-tokens header moves by exactly what each one was charged.
    let cases = [
        ("normal", false),
        ("missing", false),
        ("garbage", false),
        ("negative", false),
        ("huge", false),
        ("missing", true),
        ("garbage", true),
        ("negative", true),
        ("huge", true),
        ("normal", true),
        ("normal", false),
    ];
    let mut remaining = Vec::new();
    let mut expected = Vec::new();
    for (mode, stream) in cases {
        let (invalid, missing) = (
            metric(&stack, "sluice_usage_invalid_total"),
            metric(&stack, "sluice_usage_missing_total"),
        );
        let resp = post_json(
            &url,
            &[("x-mock-usage", mode)],
            &chat(PROMPT, Some(MAX), stream),
        );
        assert_eq!(resp.status, 200, "{mode} stream={stream}: {resp:?}");
        remaining.push(int_header(&resp, "x-ratelimit-remaining-tokens"));
        let believable = mode == "normal";
        let charge = if stream {
            let events = sse_json(&resp.body);
            assert!(!events.iter().any(is_usage_chunk), "{mode}: {}", resp.body);
            match believable {
                true => mock_input(PROMPT) + 16,
                false => est + content_events(&events) as u64,
            }
        } else if believable {
            total_tokens(&resp)
        } else {
            // No usage to believe: the input's bound, and the answer's
            // text estimated.
            let body = resp.json();
            let text = body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_else(|| panic!("no content in {body}"));
            est + text_tokens(text).ceil() as u64
        };
        expected.push(charge);
        let invalid_delta = metric(&stack, "sluice_usage_invalid_total") - invalid;
        let missing_delta = metric(&stack, "sluice_usage_missing_total") - missing;
        let unbelievable = matches!(mode, "garbage" | "negative" | "huge");
        assert_eq!(
            (invalid_delta, missing_delta),
            (u64::from(unbelievable), u64::from(!believable)),
            "{mode} stream={stream}: usage_invalid, usage_missing"
        );
    }
    let actual: Vec<u64> = remaining.windows(2).map(|w| w[0] - w[1]).collect();
    assert_eq!(
        actual,
        expected[..expected.len() - 1],
        "charges per request"
    );
    assert_no_reservation_left(&stack);
    assert!(!stack.envoy.log().contains("panicked"), "the VM panicked");
}

// ---------------------------------------------------------------------------
// 5. Over a soft cap the model is downshifted
// ---------------------------------------------------------------------------

#[test]
fn over_a_soft_cap_the_upstream_sees_the_cheaper_model() {
    let stack = Stack::start(|cfg| {
        cfg.set_policy(
            &PolicyBuilder::one_tier(
                json!({"requests": "1000/min", "daily_tokens": {"limit": 200, "mode": "soft"}}),
            )
            .model(BIG, json!({"downshift_to": SMALL}))
            .model(SMALL, json!({}))
            .build(),
        )
    });
    let url = stack.envoy.url("/v1/chat/completions");
    let body = chat_request(BIG, PROMPT, Some(50), false);

    // Within the cap: served as asked. The answer runs long and uses the
    // whole cap (a soft cap charges usage past it).
    let first = post_json(&url, &[("x-mock-output-tokens", "300")], &body);
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.header("x-mock-model"), Some(BIG));
    assert_eq!(first.header("x-sluice-degraded"), None);
    assert_eq!(metric(&stack, "sluice_degraded_total"), 0);

    // Over it: not refused, but served by the cheaper model.
    let second = post_json(&url, &[], &body);
    assert_eq!(second.status, 200, "{second:?}");
    assert_eq!(second.header("x-mock-model"), Some(SMALL), "{second:?}");
    assert_eq!(upstream_body(&stack)["model"], SMALL);
    assert_eq!(second.json()["model"], SMALL);
    assert_eq!(second.header("x-sluice-degraded"), Some("downshift"));
    assert_eq!(metric(&stack, "sluice_degraded_total"), 1);
    assert_eq!(stack.upstream_requests(), 2);
}

// ---------------------------------------------------------------------------
// 6. What the upstream receives
// ---------------------------------------------------------------------------

#[test]
fn the_upstream_gets_the_reserved_max_output_and_a_usage_chunk_the_client_does_not_see() {
    against(&speaking(Api::ChatCompletions), what_the_upstream_gets);
}

/// What an upstream playing `p` gets and answers: the limit it reads and
/// the usage chunk it sends are each server's own.
fn what_the_upstream_gets(p: Personality) {
    let stack = Stack::start_as(p, |cfg| {
        let shape =
            PolicyBuilder::one_tier(json!({"requests": "1000/min", "daily_tokens": 1_000_000}))
                .model(SMALL, json!({"default_max_output": 77}))
                .max_output_tokens(300)
                // UNLISTED, beside the listed SMALL, gets the defaults.
                .with(
                    "unlisted_models",
                    json!({"price": {"input": 0, "output": 0}}),
                )
                .build();
        cfg.set_policy(&shape);
    });
    let url = stack.envoy.url("/v1/chat/completions");

    // No max_tokens: the reserved output is written into the request.
    let resp = post_json(&url, &[], &chat(PROMPT, None, false));
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(upstream_body(&stack)["max_tokens"], 300);
    let resp = post_json(&url, &[], &chat_request(SMALL, PROMPT, None, false));
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(upstream_body(&stack)["max_tokens"], 77);
    // A client's own limit within budget goes through untouched.
    let resp = post_json(&url, &[], &chat(PROMPT, Some(9), false));
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(upstream_body(&stack)["max_tokens"], 9);

    // A stream without include_usage: sluice asks for the usage chunk and
    // keeps it from the client.
    let missing_before = metric(&stack, "sluice_usage_missing_total");
    let output_before = settled(&stack, "output");
    let resp = post_json(&url, &[], &chat(PROMPT, None, true));
    assert_eq!(resp.status, 200, "{resp:?}");
    let upstream = upstream_body(&stack);
    assert_eq!(
        upstream["stream_options"]["include_usage"], true,
        "{upstream}"
    );
    assert_eq!(upstream["max_tokens"], 300);
    let events = sse_json(&resp.body);
    assert!(!events.iter().any(is_usage_chunk), "{}", resp.body);
    assert!(
        !events.iter().any(|e| e["usage"].is_object()),
        "{}",
        resp.body
    );
    assert_eq!(content_events(&events), 16);
    assert_eq!(sse_payloads(&resp.body).last(), Some(&"[DONE]"));
    // …and settles from it.
    assert_eq!(metric(&stack, "sluice_usage_missing_total"), missing_before);
    assert_eq!(settled(&stack, "output") - output_before, 16);

    // A client that asked for the usage chunk gets it.
    let mut body = chat(PROMPT, Some(5), true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = post_json(&url, &[], &body);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(
        upstream_body(&stack)["stream_options"]["include_usage"],
        true
    );
    let events = sse_json(&resp.body);
    let usage: Vec<&Json> = events.iter().filter(|e| is_usage_chunk(e)).collect();
    assert_eq!(usage.len(), 1, "{}", resp.body);
    assert_eq!(usage[0]["usage"]["completion_tokens"], 5);
    assert_eq!(usage[0]["usage"]["prompt_tokens"], mock_input(PROMPT));
    assert_eq!(content_events(&events), 5);
    assert_eq!(sse_payloads(&resp.body).last(), Some(&"[DONE]"));
}

// ---------------------------------------------------------------------------
// 7. Denial of wallet
// ---------------------------------------------------------------------------

#[test]
fn huge_prompts_at_a_low_request_rate_are_stopped_by_the_token_bucket() {
    let stack = Stack::start(|cfg| {
        cfg.set_policy(
            &PolicyBuilder::one_tier(json!({"requests": "60/hour", "tokens": "20000/min"})).build(),
        )
    });
    let url = stack.envoy.url("/v1/chat/completions");
    let huge_prompt = "Please summarise this. ".repeat(50 * 1024 / 23);
    let huge = chat(&huge_prompt, Some(16), false);
    assert!(huge.to_string().len() >= 50 * 1000);

    let mut statuses = Vec::new();
    let mut refusal = None;
    for _ in 0..5 {
        let resp = post_json(&url, &[], &huge);
        statuses.push(resp.status);
        if resp.status == 429 {
            refusal = Some(resp);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        statuses,
        [200, 429, 429, 429, 429],
        "est {}",
        estimate(&huge)
    );
    let refusal = refusal.expect("a refusal");
    let sluice = assert_refused(&refusal, "token_rate_limit");
    assert_eq!(sluice["limit"], 20_000, "{sluice}");
    assert!(
        sluice["bucket"]
            .as_str()
            .is_some_and(|b| b.contains("tokens")),
        "{sluice}"
    );
    assert_eq!(
        stack.upstream_requests(),
        1,
        "a refused prompt went upstream"
    );

    // The request limit was never the problem: a small call goes through,
    // and only the admitted calls counted against it.
    let resp = post_json(&url, &[], &chat(PROMPT, Some(16), false));
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(int_header(&resp, "x-ratelimit-limit"), 60);
    assert_eq!(int_header(&resp, "x-ratelimit-remaining"), 58, "{resp:?}");
}

// ---------------------------------------------------------------------------
// 8. Budget alerts
// ---------------------------------------------------------------------------

#[test]
fn crossing_alert_at_adds_the_alert_header_and_counts_it() {
    const BUDGET: u64 = 1_000;
    let stack = Stack::start(|cfg| {
        cfg.set_policy(&PolicyBuilder::one_tier(json!({"requests": "1000/min", "daily_tokens": {"limit": BUDGET, "mode": "hard", "alert_at": "80%"}})).build())
    });
    let url = stack.envoy.url("/v1/chat/completions");
    // A hard budget: each request reserves its input's bound.
    let est = bound(&chat(PROMPT, None, false));

    // Half the budget reserved: no alert.
    let resp = post_json(&url, &[], &chat(PROMPT, Some(500 - est), false));
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("x-sluice-budget-alert"), None, "{resp:?}");
    assert_eq!(metric(&stack, "sluice_budget_alerts_total"), 0);
    let first_usage = total_tokens(&resp);

    // Settled at its small usage; this one takes the budget past 80 %.
    let resp = post_json(&url, &[], &chat(PROMPT, Some(800 - est), false));
    assert_eq!(resp.status, 200, "{resp:?}");
    let alert = resp
        .header("x-sluice-budget-alert")
        .unwrap_or_else(|| panic!("no alert header: {resp:?}"));
    let used_pct = (first_usage + 800) * 100 / BUDGET;
    assert!(
        alert.contains("daily tokens") && alert.contains(&format!("{used_pct}% used")),
        "{alert}"
    );
    assert_eq!(metric(&stack, "sluice_budget_alerts_total"), 1);
}

// ---------------------------------------------------------------------------
// SSE line ends: CRLF and CR frame events as well as LF
// ---------------------------------------------------------------------------

/// An SSE body with CRLF or CR line ends rewritten to LF, for the helpers
/// above (sluice's own error event may use LF in the same stream: the spec
/// allows mixing).
fn lf_framed(body: &str) -> String {
    body.replace("\r\n", "\n").replace('\r', "\n")
}

#[test]
fn streams_framed_with_crlf_or_cr_settle_from_their_usage_and_are_cut_at_their_allowance() {
    const BUDGET: u64 = 1_000;
    // `crlf-split` sends every CRLF that ends an event across two chunks.
    for newline in ["crlf", "cr", "crlf-split"] {
        let stack = Stack::start(|cfg| {
            cfg.set_policy(
                &PolicyBuilder::one_tier(json!({"requests": "1000/min", "daily_tokens": BUDGET}))
                    .build(),
            )
        });
        let url = stack.envoy.url("/v1/chat/completions");
        let framing = ("x-mock-sse-newline", newline);
        let delay = ("x-mock-chunk-delay-ms", "2");

        // Settled from the usage chunk sluice asked for, which the client
        // does not see.
        let missing_before = metric(&stack, "sluice_usage_missing_total");
        let resp = post_json(&url, &[framing, delay], &chat(PROMPT, Some(5), true));
        assert_eq!(resp.status, 200, "{newline}: {resp:?}");
        let raw = &resp.body;
        assert!(
            raw.contains(if newline == "cr" {
                "}\r\r"
            } else {
                "}\r\n\r\n"
            }),
            "{newline}: not framed as asked: {raw:?}"
        );
        let body = lf_framed(raw);
        let events = sse_json(&body);
        assert_eq!(content_events(&events), 5, "{newline}: {raw:?}");
        assert!(!events.iter().any(is_usage_chunk), "{newline}: {raw:?}");
        assert_eq!(sse_payloads(&body).last(), Some(&"[DONE]"), "{raw:?}");
        assert_eq!(settled(&stack, "output"), 5, "{newline}");
        assert_eq!(settled(&stack, "input"), mock_input(PROMPT), "{newline}");
        assert_eq!(
            metric(&stack, "sluice_usage_missing_total"),
            missing_before,
            "{newline}: usage not read from the stream"
        );
        assert_no_reservation_left(&stack);

        // Past its allowance: cut with the error event, the budget charged
        // to the token.
        let body = chat(PROMPT, Some(5_000), true);
        let allowance = BUDGET - charged(&stack) - bound(&body);
        let resp = post_cut(&url, &[framing, ("x-mock-output-tokens", "3000")], &body);
        assert_eq!(resp.status, 200, "{newline}: {resp:?}");
        let text = lf_framed(&resp.body);
        let events = sse_json(&text);
        assert_eq!(
            events.last().expect("events")["error"]["code"],
            "budget_exhausted_midstream",
            "{newline}"
        );
        assert_eq!(content_events(&events) as u64, allowance, "{newline}");
        assert_eq!(metric(&stack, "sluice_stream_cut_total"), 1, "{newline}");
        assert_no_reservation_left(&stack);
        assert_eq!(charged(&stack), BUDGET, "{newline}");
    }
}
