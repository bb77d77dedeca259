//! The GPU sidecar in the data path, against a real Envoy (docs/src/design.md, "Route",
//! "Sidecar"; issue 4): breakers pushed into Envoy by long poll and how fast they
//! land, the stale-data policy, the kill switch and its failover provider,
//! admin authentication, upstream pushback (`Retry-After` pause, error
//! breaker with half-open probes) and the static fallback.
//!
//! Every sidecar here runs on the simulated GPU with short sustain times;
//! every Envoy points its `sluice_sidecar` and `llm_fallback` clusters at
//! processes of the test (or at the harness's closed address), never at a
//! developer's demo.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): breakers come
//! from the GPU sidecar, not from the inference server. The provider rung
//! of the ladder plays OpenAI (its own model names, its own key).

use std::collections::BTreeSet;
use std::fs;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value as Json};
use serde_yaml::Value;
use sluice_tests::{
    async_client, chat_body, get, post_json, post_json_async, prometheus_value, repo_root, request,
    runtime, wait_for, EnvoyConfig, MockLlm, Response, Sidecar, Stack,
};

const MODEL: &str = "llama3.1:8b";
const OTHER_MODEL: &str = "mistral:7b";
const TOKEN: &str = "sidecar-test-admin-token-0123456789";
/// The sidecar's scope when it has no backends: every model's default.
const SCOPE: &str = "backend:local";
/// `retry_after` of the test sidecar's breakers.
const BREAKER_RETRY_AFTER: u64 = 7;
/// The shipped policy's canned answer for "What is sluice?" and its message.
const CANNED: &str = "sluice is admission control for LLM traffic, built into Envoy.";
const DEFAULT_MESSAGE: &str =
    "The assistant is temporarily unavailable. Please try again in a few minutes.";

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// A sidecar on the simulated GPU with its own admin token, state file and
/// config (one GPU rule with the given sustain times, scope `backend:local`).
struct TestSidecar {
    sidecar: Sidecar,
    dir: tempfile::TempDir,
}

impl TestSidecar {
    fn start(open_for: &str, close_after: &str) -> TestSidecar {
        TestSidecar::start_with(open_for, close_after, "", None)
    }

    /// With `extra` appended to the config, listening on `listen` if given.
    fn start_with(
        open_for: &str,
        close_after: &str,
        extra: &str,
        listen: Option<SocketAddr>,
    ) -> TestSidecar {
        let dir = tempfile::Builder::new()
            .prefix("sluice-sidecar-test-")
            .tempdir()
            .expect("temp dir");
        fs::write(dir.path().join("token"), format!("{TOKEN}\n")).expect("token file");
        let config = format!(
            "scrape_interval: 50ms\n\
             sources: {{ gpu: simulated }}\n\
             rules:\n  - {{ metric: gpu_utilization, open_at: 90, close_below: 80, \
             open_for: {open_for}, close_after: {close_after} }}\n\
             breaker: {{ half_open_fraction: 0.5, half_open_for: 1s, \
             retry_after: {BREAKER_RETRY_AFTER}s }}\n{extra}"
        );
        fs::write(dir.path().join("sidecar.yaml"), config).expect("sidecar config");
        let sidecar = TestSidecar::spawn(dir.path(), listen);
        TestSidecar { sidecar, dir }
    }

    fn spawn(dir: &Path, listen: Option<SocketAddr>) -> Sidecar {
        let path = |name: &str| dir.join(name).display().to_string();
        let (config, token, state) = (path("sidecar.yaml"), path("token"), path("state.json"));
        let listen = listen.map(|a| a.to_string());
        let mut args = vec![
            "--simulate",
            "--config",
            &config,
            "--admin-token-file",
            &token,
            "--state-file",
            &state,
        ];
        if let Some(listen) = &listen {
            args.extend_from_slice(&["--listen", listen]);
        }
        Sidecar::start_with_args(&args)
    }

    /// Kills the sidecar and starts a new one on the same address with the
    /// same state file.
    fn restart(&mut self) {
        let addr = self.sidecar.addr();
        self.sidecar.process().kill();
        self.sidecar = TestSidecar::spawn(self.dir.path(), Some(addr));
        assert_eq!(self.sidecar.addr(), addr);
    }

    fn addr(&self) -> SocketAddr {
        self.sidecar.addr()
    }

    fn state(&self) -> Json {
        get(&self.sidecar.url("/v1/state"), &[]).ok().json()
    }

    /// `open` / `half_open` of the scope's breaker; `None` when closed.
    fn breaker(&self) -> Option<String> {
        let state = self.state();
        state["breakers"]
            .as_array()
            .expect("breakers is a list")
            .iter()
            .find(|b| b["scope"] == SCOPE)
            .map(|b| b["state"].as_str().expect("breaker state").to_string())
    }

    fn simulate(&self, utilization: f64) {
        post_json(
            &self.sidecar.url("/v1/simulate"),
            &[("authorization", &format!("Bearer {TOKEN}"))],
            &json!({"gpus": [{"utilization": utilization}]}),
        )
        .ok();
    }

    fn kill_switch_with(&self, authorization: Option<&str>, active: bool) -> Response {
        let headers: Vec<(&str, &str)> = authorization
            .map(|a| ("authorization", a))
            .into_iter()
            .collect();
        post_json(
            &self.sidecar.url("/v1/kill-switch"),
            &headers,
            &json!({"active": active, "reason": "sluice integration test"}),
        )
    }

    fn kill_switch(&self, active: bool) -> Json {
        let answer = self
            .kill_switch_with(Some(&format!("Bearer {TOKEN}")), active)
            .ok()
            .json();
        assert_eq!(answer["kill_switch"]["active"], active, "{answer}");
        answer
    }

    /// Long polls held right now (an Envoy that has its state and waits for
    /// the next one holds one).
    fn subscribers(&self) -> f64 {
        let text = get(&self.sidecar.url("/metrics"), &[]).ok().body;
        prometheus_value(&text, "sluice_sidecar_long_poll_subscribers", &[]).unwrap_or(0.0)
    }

    /// Waits until Envoy has received the current state and polls for the next.
    /// Restarts with `extra` added to its config (what needs an address
    /// known only once Envoy runs), and waits for Envoy's poll.
    fn restart_with(&mut self, extra: &str) {
        let config = self.dir.path().join("sidecar.yaml");
        let mut text = fs::read_to_string(&config).expect("the sidecar's config");
        text.push_str(extra);
        fs::write(&config, text).expect("the sidecar's config");
        self.restart();
        self.wait_for_envoy();
    }

    fn wait_for_envoy(&self) {
        assert!(
            wait_for(Duration::from_secs(10), || self.subscribers() >= 1.0),
            "Envoy never long-polled the sidecar:\n{}",
            self.sidecar.log()
        );
    }
}

/// The shipped policy with limits no test here reaches, short error-breaker
/// cooldown and pause jitter, and the sidecar and fallback clusters pointed
/// at the test's processes (else at the harness's closed address). The
/// breakers' and pauses' own answers are what these tests read: no Envoy
/// retry, no failover, the rung only under the kill switch, and the
/// breaker's default of two callers (tests/tests/provider_faults.rs runs
/// them all together, as shipped).
fn test_policy(cfg: &mut EnvoyConfig, sidecar: Option<SocketAddr>, fallback: Option<SocketAddr>) {
    sluice_tests::without_retries(cfg);
    if let Some(addr) = sidecar {
        cfg.set_cluster_addr("sluice_sidecar", addr);
    }
    if let Some(addr) = fallback {
        cfg.set_cluster_addr("llm_fallback", addr);
    }
    let p = cfg.policy_mut();
    let unlimited = || serde_yaml::from_str::<Value>("{requests: 100000/min}").expect("yaml");
    for tier in ["free", "pro", "enterprise"] {
        p["tiers"][tier] = unlimited();
    }
    for model in [MODEL, OTHER_MODEL] {
        p["models"][model]["requests"] = Value::from("100000/min");
    }
    p["protection"]["cooldown"] = Value::from("1s");
    p["protection"]["pause_jitter"] = Value::from("200ms");
    p["protection"]["min_callers"] = Value::from(2);
    p["ladder_when_out"] = Value::from(false);
    sluice_tests::without_failover(p);
}

fn chat_with(stack: &Stack, prompt: &str, stream: bool) -> Response {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                          "max_tokens": 8});
    if stream {
        body["stream"] = true.into();
    }
    post_json(&stack.envoy.url("/v1/chat/completions"), &[], &body)
}

fn int_header(r: &Response, name: &str) -> u64 {
    r.header(name)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no integer `{name}` header in {r:?}"))
}

/// A 503 refusal in the OpenAI error shape with `code` and `Retry-After`;
/// returns the `Retry-After` seconds.
fn assert_refused(r: &Response, code: &str) -> u64 {
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.header("x-sluice-reason"), Some(code), "{r:?}");
    assert!(
        r.header("content-type")
            .is_some_and(|v| v.starts_with("application/json")),
        "{r:?}"
    );
    assert!(
        r.header("x-mock-name").is_none(),
        "came from upstream: {r:?}"
    );
    let retry_after = int_header(r, "retry-after");
    assert!(retry_after >= 1, "{r:?}");
    let body = r.json();
    let error = &body["error"];
    assert_eq!(error["code"], code, "{body}");
    assert!(
        error["type"].as_str().is_some_and(|t| !t.is_empty()),
        "{body}"
    );
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(error["param"].is_null(), "{body}");
    assert_eq!(
        error["sluice"]["retry_after_seconds"], retry_after,
        "{body}"
    );
    retry_after
}

fn served_by(r: &Response) -> Option<&str> {
    r.header("x-mock-name")
}

/// A response that came from the fallback provider through the kill switch.
fn assert_rerouted(r: &Response) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(served_by(r), Some("fallback"), "{r:?}");
    assert_eq!(r.header("x-sluice-provider"), Some("openai"), "{r:?}");
    assert_eq!(r.header("x-sluice-kill-switch"), Some("1"), "{r:?}");
}

fn assert_primary(r: &Response) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(served_by(r), Some("primary"), "{r:?}");
    assert!(r.header("x-sluice-provider").is_none(), "{r:?}");
    assert!(r.header("x-sluice-kill-switch").is_none(), "{r:?}");
}

fn requests_total(mock: &MockLlm) -> u64 {
    mock.stats()["requests_total"]
        .as_u64()
        .expect("requests_total")
}

fn last_request_headers(mock: &MockLlm) -> Json {
    mock.stats()["last_request"]["headers"].clone()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

// The shapes the OpenAI Rust clients (async-openai's
// CreateChatCompletionResponse / CreateChatCompletionStreamResponse)
// require: a body missing a required field or with an unknown role or
// finish reason does not parse.

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Role {
    Assistant,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    ContentFilter,
    FunctionCall,
}

#[derive(Debug, Deserialize)]
struct Usage {
    #[allow(dead_code)]
    prompt_tokens: u32,
    #[allow(dead_code)]
    completion_tokens: u32,
    #[allow(dead_code)]
    total_tokens: u32,
}

#[derive(Debug, Deserialize)]
struct Message {
    #[allow(dead_code)]
    role: Role,
    content: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    index: u32,
    message: Message,
    finish_reason: Option<FinishReason>,
}

#[derive(Debug, Deserialize)]
struct ChatCompletion {
    id: String,
    object: String,
    #[allow(dead_code)]
    created: u32,
    model: String,
    choices: Vec<Choice>,
    #[allow(dead_code)]
    usage: Option<Usage>,
}

#[derive(Debug, Deserialize)]
struct Delta {
    #[allow(dead_code)]
    role: Option<Role>,
    content: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ChunkChoice {
    index: u32,
    delta: Delta,
    finish_reason: Option<FinishReason>,
}

#[derive(Debug, Deserialize)]
struct ChatCompletionChunk {
    id: String,
    object: String,
    #[allow(dead_code)]
    created: u32,
    model: String,
    choices: Vec<ChunkChoice>,
}

/// A static answer: 200, `x-sluice-degraded: static`, an OpenAI
/// chat.completion whose content is `text`.
fn assert_static(r: &Response, text: &str) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-sluice-degraded"), Some("static"), "{r:?}");
    assert!(served_by(r).is_none(), "came from upstream: {r:?}");
    assert!(
        r.header("content-type")
            .is_some_and(|v| v.starts_with("application/json")),
        "{r:?}"
    );
    let c: ChatCompletion = serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("not an OpenAI chat.completion ({e}): {}", r.body));
    assert_eq!(c.object, "chat.completion");
    assert!(!c.id.is_empty());
    assert_eq!(c.model, MODEL);
    assert_eq!(c.choices.len(), 1, "{}", r.body);
    assert_eq!(c.choices[0].index, 0);
    assert_eq!(c.choices[0].message.content.as_deref(), Some(text));
    assert_eq!(c.choices[0].finish_reason, Some(FinishReason::Stop));
}

/// A static stream: SSE `data:` chunks of chat.completion.chunk, then
/// `data: [DONE]`; the deltas spell `text`.
fn assert_static_stream(r: &Response, text: &str) {
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-sluice-degraded"), Some("static"), "{r:?}");
    assert!(
        r.header("content-type")
            .is_some_and(|v| v.starts_with("text/event-stream")),
        "{r:?}"
    );
    let events: Vec<&str> = r
        .body
        .split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    let (done, chunks) = events.split_last().expect("at least one event");
    assert_eq!(*done, "data: [DONE]", "{}", r.body);
    assert!(!chunks.is_empty(), "{}", r.body);
    let mut content = String::new();
    let mut finish = None;
    for event in chunks {
        let data = event
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an SSE data event: {event:?}"));
        let chunk: ChatCompletionChunk = serde_json::from_str(data)
            .unwrap_or_else(|e| panic!("not a chat.completion.chunk ({e}): {data}"));
        assert_eq!(chunk.object, "chat.completion.chunk");
        assert!(!chunk.id.is_empty());
        assert_eq!(chunk.model, MODEL);
        for choice in chunk.choices {
            assert_eq!(choice.index, 0);
            content.push_str(choice.delta.content.as_deref().unwrap_or(""));
            if choice.finish_reason.is_some() {
                finish = choice.finish_reason;
            }
        }
    }
    assert_eq!(content, text);
    assert_eq!(finish, Some(FinishReason::Stop));
}

// ---------------------------------------------------------------------------
// GPU breakers
// ---------------------------------------------------------------------------

#[test]
fn gpu_breaker_refuses_past_the_sustain_time_and_admits_after_hysteresis() {
    let sc = TestSidecar::start("1s", "1s");
    let stack = Stack::start(|cfg| test_policy(cfg, Some(sc.addr()), None));
    sc.wait_for_envoy();
    assert_primary(&stack.chat(MODEL, &[]));

    // 95 %: nothing changes before the sustain time, then 503 gpu_overloaded.
    sc.simulate(95.0);
    let hot = Instant::now();
    assert_primary(&stack.chat(MODEL, &[]));
    let mut refused = None;
    let opened = wait_for(Duration::from_secs(10), || {
        let r = stack.chat(MODEL, &[]);
        if r.status == 200 {
            return false;
        }
        refused = Some(r);
        true
    });
    assert!(opened, "the breaker never reached Envoy: {:?}", sc.state());
    let opened_after = hot.elapsed();
    assert!(
        opened_after >= Duration::from_millis(950),
        "refused {opened_after:?} after 95 %, before open_for (1 s)"
    );
    let refused = refused.expect("a refusal");
    let retry_after = assert_refused(&refused, "gpu_overloaded");
    assert_eq!(retry_after, BREAKER_RETRY_AFTER, "{refused:?}");
    let state = sc.state();
    let breaker = &state["breakers"][0];
    assert_eq!(
        (&breaker["scope"], &breaker["state"]),
        (&Json::from(SCOPE), &Json::from("open")),
        "{state}"
    );
    assert!(
        breaker["reason"]
            .as_str()
            .is_some_and(|r| r.contains("gpu_utilization")),
        "{state}"
    );

    // Every model is on backend `local`; none reaches the upstream now.
    let reached = stack.upstream_requests();
    for model in [MODEL, OTHER_MODEL, MODEL, OTHER_MODEL] {
        assert_refused(&stack.chat(model, &[]), "gpu_overloaded");
    }
    assert_eq!(stack.upstream_requests(), reached);

    // 70 %: still open right after (hysteresis), half-open after
    // close_after (a share gets through), closed after half_open_for.
    sc.simulate(70.0);
    let cool = Instant::now();
    assert_refused(&stack.chat(MODEL, &[]), "gpu_overloaded");
    let mut states = BTreeSet::new();
    let (mut half_open_admitted, mut half_open_refused) = (0, 0);
    let closed = wait_for(Duration::from_secs(15), || {
        let state = sc.breaker();
        let r = stack.chat(MODEL, &[]);
        if state.as_deref() == Some("half_open") {
            if r.status == 200 {
                half_open_admitted += 1;
            } else {
                assert_refused(&r, "gpu_overloaded");
                half_open_refused += 1;
            }
        }
        states.extend(state.clone());
        state.is_none()
    });
    assert!(closed, "the breaker did not close: {:?}", sc.state());
    let closed_after = cool.elapsed();
    assert!(states.contains("half_open"), "{states:?}");
    assert!(
        closed_after >= Duration::from_millis(1900),
        "closed {closed_after:?} after 70 %: before close_after + half_open_for"
    );
    assert!(
        half_open_admitted > 0 && half_open_refused > 0,
        "half-open at 0.5 let {half_open_admitted} through and refused {half_open_refused}"
    );
    // Closed: everything flows again.
    assert!(wait_for(Duration::from_secs(5), || stack
        .chat(MODEL, &[])
        .status
        == 200));
    for _ in 0..10 {
        assert_primary(&stack.chat(MODEL, &[]));
    }
}

#[test]
fn kill_switch_reaches_envoy_in_well_under_100_ms() {
    let fallback = MockLlm::start("fallback");
    let sc = TestSidecar::start("30s", "10s");
    let stack = Stack::start(|cfg| test_policy(cfg, Some(sc.addr()), Some(fallback.addr())));
    sc.wait_for_envoy();
    assert_primary(&stack.chat(MODEL, &[]));

    // From the admin call (sent, and answered: the change is published)
    // to the first answer from the other provider, back on a fresh
    // connection.
    let (mut from_call, mut from_commit) = (Vec::new(), Vec::new());
    for toggle in 0..50 {
        let on = toggle % 2 == 0;
        let sent = Instant::now();
        sc.kill_switch(on);
        let committed = Instant::now();
        let deadline = sent + Duration::from_secs(5);
        loop {
            let r = stack.chat(MODEL, &[]);
            let rerouted = r.header("x-sluice-kill-switch") == Some("1");
            if rerouted {
                assert_rerouted(&r);
            } else {
                assert_primary(&r);
            }
            if rerouted == on {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "toggle {toggle}: the kill switch did not reach Envoy within 5 s"
            );
        }
        let done = Instant::now();
        from_call.push((done - sent).as_secs_f64() * 1000.0);
        from_commit.push((done - committed).as_secs_f64() * 1000.0);
    }
    from_call.sort_by(f64::total_cmp);
    from_commit.sort_by(f64::total_cmp);
    let report = format!(
        "kill switch → Envoy rerouting, {} toggles, 2 workers (ms):\n\
         from the admin call:   p50 {:.1}  p99 {:.1}  max {:.1}\n\
         from the call's answer: p50 {:.1}  p99 {:.1}  max {:.1}\n",
        from_call.len(),
        percentile(&from_call, 50.0),
        percentile(&from_call, 99.0),
        from_call[from_call.len() - 1],
        percentile(&from_commit, 50.0),
        percentile(&from_commit, 99.0),
        from_commit[from_commit.len() - 1],
    );
    eprintln!("{report}");
    let out = repo_root().join("target/reaction-times.txt");
    fs::write(&out, &report).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
    // The figures are printed and kept (target/reaction-times.txt), not
    // asserted: on a loaded machine any latency bound is a coin toss. What
    // must hold, every toggle reaching Envoy, is checked above.
}

#[test]
fn a_dead_sidecar_fails_open_after_the_staleness_window() {
    let mut sc = TestSidecar::start("200ms", "10s");
    let stack = Stack::start(|cfg| {
        test_policy(cfg, Some(sc.addr()), None);
        cfg.policy_mut()["sidecar"]["stale_after"] = Value::from("2s");
    });
    sc.wait_for_envoy();
    sc.simulate(95.0);
    assert!(
        wait_for(Duration::from_secs(10), || stack.chat(MODEL, &[]).status
            == 503),
        "the breaker never reached Envoy: {:?}",
        sc.state()
    );

    // A live sidecar whose state does not change stays fresh: the open
    // breaker holds well past stale_after.
    let held = Instant::now();
    while held.elapsed() < Duration::from_millis(3500) {
        assert_refused(&stack.chat(MODEL, &[]), "gpu_overloaded");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Killed: the last state (an open breaker) holds for a while, then
    // requests flow again.
    sc.sidecar.process().kill();
    let killed = Instant::now();
    assert_refused(&stack.chat(MODEL, &[]), "gpu_overloaded");
    assert!(
        wait_for(Duration::from_secs(10), || stack.chat(MODEL, &[]).status
            == 200),
        "still refusing 10 s after the sidecar died"
    );
    // Within the wait above (10 s): how soon after stale_after depends on
    // how fast this machine answers requests, so it is printed, not bounded.
    let open_after = killed.elapsed();
    eprintln!("failed open {open_after:?} after the sidecar died (stale_after 2 s)");
    for _ in 0..5 {
        assert_primary(&stack.chat(MODEL, &[]));
    }
    let errors = stack
        .envoy
        .metric("sluice_sidecar_poll_errors_total", &[])
        .unwrap_or(0.0);
    assert!(errors >= 1.0, "failed polls are metered");
    let log = stack.envoy.log();
    assert_eq!(
        log.matches("sidecar unreachable").count(),
        1,
        "the outage is logged, once"
    );
}

// ---------------------------------------------------------------------------
// Kill switch
// ---------------------------------------------------------------------------

#[test]
fn kill_switch_reroutes_to_the_fallback_and_survives_a_sidecar_restart() {
    let fallback = MockLlm::start("fallback");
    let mut sc = TestSidecar::start("30s", "10s");
    let stack = Stack::start(|cfg| test_policy(cfg, Some(sc.addr()), Some(fallback.addr())));
    sc.wait_for_envoy();
    let key = ("x-api-key", "demo-pro-key");
    let forged = ("x-sluice-upstream", "fallback");

    // Off: a client cannot pick the fallback (and its credentials) itself.
    let r = stack.chat(MODEL, &[key, forged]);
    assert_primary(&r);
    assert_eq!(requests_total(&fallback), 0);
    let seen = last_request_headers(&stack.upstream);
    assert!(seen.get("x-sluice-upstream").is_none(), "{seen}");

    // On: the fallback provider answers, with Envoy's credentials.
    let answer = sc.kill_switch(true);
    assert_eq!(answer["persisted"], true, "{answer}");
    assert!(wait_for(Duration::from_secs(5), || served_by(
        &stack.chat(MODEL, &[key])
    ) == Some("fallback")));
    let primary_before = stack.upstream_requests();
    for _ in 0..4 {
        assert_rerouted(&stack.chat(MODEL, &[key]));
    }
    assert_eq!(stack.upstream_requests(), primary_before);
    let seen = last_request_headers(&fallback);
    assert_eq!(
        seen["authorization"], "Bearer demo-fallback-credential",
        "{seen}"
    );
    assert!(seen.get("x-api-key").is_none(), "client key leaked: {seen}");
    assert!(seen.get("x-sluice-upstream").is_none(), "{seen}");

    // Restarted with the same state file: still on, and Envoy (polling the
    // new sidecar) still reroutes.
    sc.restart();
    let state = sc.state();
    assert_eq!(state["kill_switch"]["active"], true, "{state}");
    assert_eq!(
        state["kill_switch"]["reason"], "sluice integration test",
        "{state}"
    );
    sc.wait_for_envoy();
    for _ in 0..4 {
        assert_rerouted(&stack.chat(MODEL, &[key]));
    }

    // Off, through the restarted sidecar: back to the primary.
    sc.kill_switch(false);
    assert!(wait_for(Duration::from_secs(5), || served_by(
        &stack.chat(MODEL, &[key])
    ) == Some("primary")));
    let fallback_before = requests_total(&fallback);
    for _ in 0..4 {
        assert_primary(&stack.chat(MODEL, &[key]));
        assert_primary(&stack.chat(MODEL, &[key, forged]));
    }
    assert_eq!(requests_total(&fallback), fallback_before);
}

/// An address of this machine that is not loopback (the one it would
/// route out from), if it has one.
fn non_loopback_ip() -> Option<std::net::IpAddr> {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    // Connecting a UDP socket sends nothing; it only picks the route.
    probe.connect("198.51.100.1:9").ok()?;
    let ip = probe.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn held_polls_past_the_cap_get_503_and_envoy_keeps_its_reserved_slot() {
    use std::io::Write as _;
    let Some(ip) = non_loopback_ip() else {
        eprintln!("SKIPPED: this machine has no non-loopback address to poll from");
        return;
    };
    let fallback = MockLlm::start("fallback");
    let sc = TestSidecar::start_with(
        "30s",
        "10s",
        "long_poll: { max_held: 6, reserved: 1 }\n",
        Some(SocketAddr::from(([0, 0, 0, 0], 0))),
    );
    let port = sc.addr().port();
    let stack = Stack::start(|cfg| {
        test_policy(
            cfg,
            Some(SocketAddr::from(([127, 0, 0, 1], port))),
            Some(fallback.addr()),
        );
        // Envoy renews its poll every second: it must win a slot while
        // the others are full, not only hold one from before.
        cfg.policy_mut()["sidecar"]["poll_wait"] = Value::from("1s");
    });
    sc.wait_for_envoy();
    let version = sc.state()["version"].as_u64().expect("version");
    let poll = format!("/v1/state?since={version}&wait=60");

    // Five remote pollers take every unreserved slot and hold them.
    let remote: Vec<std::net::TcpStream> = (0..5)
        .map(|_| {
            let mut s = std::net::TcpStream::connect((ip, port))
                .unwrap_or_else(|e| panic!("connecting to {ip}:{port}: {e}"));
            // By address: the sidecar answers only to its own host names.
            write!(s, "GET {poll} HTTP/1.1\r\nhost: {ip}:{port}\r\n\r\n").expect("send poll");
            s
        })
        .collect();
    assert!(
        wait_for(Duration::from_secs(5), || sc.subscribers() >= 5.0),
        "remote polls not held: {}",
        sc.subscribers()
    );
    // The sixth remote poll is refused at once, in JSON, with Retry-After.
    let url = format!("http://{ip}:{port}/v1/state?since={version}&wait=1");
    let r = get(&url, &[]);
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.header("retry-after"), Some("2"), "{r:?}");
    assert_eq!(r.json()["error"]["code"], "too_many_polls", "{r:?}");

    // Envoy's own poll, renewed twice meanwhile, still gets the reserved
    // slot…
    let polls = || {
        stack
            .envoy
            .metric("sluice_sidecar_polls_total", &[])
            .unwrap_or(0.0)
    };
    let errors = || {
        stack
            .envoy
            .metric("sluice_sidecar_poll_errors_total", &[])
            .unwrap_or(0.0)
    };
    let (before, errors_before) = (polls(), errors());
    assert!(
        wait_for(Duration::from_secs(5), || polls() >= before + 2.0),
        "Envoy stopped polling"
    );
    assert_eq!(errors(), errors_before, "Envoy's poll was refused");
    let metrics = get(&sc.sidecar.url("/metrics"), &[]).ok().body;
    let refused = |caller| {
        prometheus_value(
            &metrics,
            "sluice_sidecar_long_poll_refused_total",
            &[("caller", caller)],
        )
    };
    assert_eq!(refused("local"), Some(0.0), "{metrics}");
    assert!(refused("remote") >= Some(1.0), "{metrics}");
    // …so the kill switch reaches it while the flood holds the rest.
    sc.kill_switch(true);
    assert!(
        wait_for(Duration::from_secs(3), || served_by(
            &stack.chat(MODEL, &[])
        ) == Some("fallback")),
        "the kill switch did not reach Envoy"
    );
    drop(remote);
}

#[test]
fn admin_calls_without_the_right_token_get_401() {
    let sc = TestSidecar::start("30s", "10s");
    let version = sc.state()["version"].clone();
    let wrong = [
        None,
        Some("Bearer not-the-token".to_string()),
        Some(format!("Bearer {TOKEN}x")),
        Some(format!("Bearer {}", &TOKEN[..TOKEN.len() - 1])),
        Some("Bearer ".to_string()),
        Some(format!("Basic {TOKEN}")),
        Some(TOKEN.to_string()),
    ];
    for auth in &wrong {
        let r = sc.kill_switch_with(auth.as_deref(), true);
        assert_eq!(r.status, 401, "{auth:?}: {r:?}");
        assert_eq!(r.json()["error"]["code"], "unauthorized", "{r:?}");
        assert!(!r.body.contains(TOKEN), "the answer shows the token: {r:?}");
    }
    let state = sc.state();
    assert_eq!(state["kill_switch"]["active"], false, "{state}");
    assert_eq!(
        state["version"], version,
        "a refused call changed the state"
    );
    assert!(
        !sc.dir.path().join("state.json").exists(),
        "a refused call wrote the state file"
    );
    sc.kill_switch(true);
    assert_eq!(sc.state()["kill_switch"]["active"], true);

    // No token configured at all: every admin call is refused.
    let bare = Sidecar::start_with_args(&["--simulate"]);
    let r = post_json(
        &bare.url("/v1/kill-switch"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
        &json!({"active": true}),
    );
    assert_eq!(r.status, 401, "{r:?}");
    let r = request("GET", &bare.url("/v1/state"), &[], None).expect("state");
    assert_eq!(r.json()["kill_switch"]["active"], false);
}

// ---------------------------------------------------------------------------
// Upstream pushback
// ---------------------------------------------------------------------------

#[test]
fn upstream_retry_after_pauses_the_route_for_every_worker() {
    const WORKERS: u32 = 4;
    let stack = Stack::start_with(WORKERS, |cfg| test_policy(cfg, None, None));
    let listener = stack.envoy.addr();
    let per_worker = |i: u32| {
        stack
            .envoy
            .counter_value(&format!(
                "listener.{}_{}.worker_{i}.downstream_cx_total",
                listener.ip(),
                listener.port()
            ))
            .unwrap_or_else(|| panic!("no connection counter for worker {i}"))
    };
    let before: Vec<u64> = (0..WORKERS).map(per_worker).collect();

    let sent = Instant::now();
    let r = stack.chat(
        MODEL,
        &[("x-mock-status", "503"), ("x-mock-retry-after", "5")],
    );
    assert_eq!((r.status, served_by(&r)), (503, Some("primary")), "{r:?}");
    assert_eq!(r.header("retry-after"), Some("5"), "{r:?}");
    let reached = stack.upstream_requests();

    // Until 5 s after the 503: every request for that model, on fresh
    // connections spread over every worker, is refused at Envoy.
    let url = stack.envoy.url("/v1/chat/completions");
    let mut refused = 0;
    runtime().block_on(async {
        let client = async_client();
        let mut first = true;
        // Batches start until 4.5 s: one started later could be sent after
        // the pause on a loaded machine.
        while sent.elapsed() < Duration::from_millis(4500) {
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let (client, url) = (client.clone(), url.clone());
                    tokio::spawn(async move {
                        post_json_async(&client, &url, &[], &chat_body(MODEL)).await
                    })
                })
                .collect();
            let mut answers = Vec::new();
            for t in tasks {
                answers.push(t.await.expect("task").expect("request"));
            }
            // The pause lasts at least until 5 s after the 503 was sent.
            let left_ms = 5000u64.saturating_sub(sent.elapsed().as_millis() as u64);
            for r in &answers {
                let retry_after = assert_refused(r, "upstream_paused");
                assert!(
                    retry_after * 1000 >= left_ms,
                    "Retry-After {retry_after} with {left_ms} ms of pause left"
                );
                if first {
                    assert!(retry_after >= 4, "{r:?}");
                }
                refused += 1;
            }
            first = false;
        }
    });
    assert_eq!(
        stack.upstream_requests(),
        reached,
        "a paused request got through"
    );
    let after: Vec<u64> = (0..WORKERS).map(per_worker).collect();
    for i in 0..WORKERS as usize {
        assert!(
            after[i] > before[i],
            "worker {i} served none of the {refused} refused requests: {before:?} → {after:?}"
        );
    }
    // Only that model's route is paused.
    assert_primary(&stack.chat(OTHER_MODEL, &[]));
    assert_eq!(stack.upstream_requests(), reached + 1);

    // Then it flows again (5 s + at most 200 ms of jitter).
    assert!(wait_for(Duration::from_secs(5), || stack
        .chat(MODEL, &[])
        .status
        == 200));
    assert!(sent.elapsed() >= Duration::from_secs(5));
    assert_primary(&stack.chat(MODEL, &[]));
}

#[test]
fn consecutive_500s_open_the_error_breaker_and_a_probe_closes_it() {
    let stack = Stack::start(|cfg| test_policy(cfg, None, None));
    // Callers told apart by their demo keys: the breaker needs failures
    // from two of them (`min_callers`), one caller's alone never open it.
    let fail_as = |key| [("x-mock-status", "500"), ("x-api-key", key)];
    assert_primary(&stack.chat(MODEL, &[]));
    for key in ["demo-pro-key", "demo-enterprise-key", "demo-pro-key"] {
        let r = stack.chat(MODEL, &fail_as(key));
        assert_eq!((r.status, served_by(&r)), (500, Some("primary")), "{r:?}");
    }
    let opened = Instant::now();
    let reached = stack.upstream_requests();
    let r = stack.chat(MODEL, &[]);
    assert_eq!(assert_refused(&r, "upstream_unhealthy"), 1, "{r:?}");
    assert_refused(&stack.chat(MODEL, &[]), "upstream_unhealthy");
    assert_eq!(stack.upstream_requests(), reached);
    // Per model route: another model still flows.
    assert_primary(&stack.chat(OTHER_MODEL, &[]));
    let reached = reached + 1;

    // After the 1 s cooldown one probe goes through and fails; a second
    // caller's probe fails too, and the breaker reopens for twice as long.
    let mut probe = None;
    assert!(wait_for(Duration::from_secs(5), || {
        let r = stack.chat(MODEL, &fail_as("demo-pro-key"));
        if r.status == 503 && r.header("x-sluice-reason") == Some("upstream_unhealthy") {
            return false;
        }
        probe = Some(r);
        true
    }));
    let probed_after = opened.elapsed();
    let probe = probe.expect("a probe");
    assert_eq!((probe.status, served_by(&probe)), (500, Some("primary")));
    assert!(
        probed_after >= Duration::from_millis(950),
        "probed {probed_after:?} after opening, before the 1 s cooldown"
    );
    assert_eq!(stack.upstream_requests(), reached + 1, "exactly one probe");
    let r = stack.chat(MODEL, &fail_as("demo-enterprise-key"));
    assert_eq!((r.status, served_by(&r)), (500, Some("primary")), "{r:?}");
    let reopened = Instant::now();
    let r = stack.chat(MODEL, &[]);
    assert_eq!(assert_refused(&r, "upstream_unhealthy"), 2, "{r:?}");

    // After the 2 s cooldown a good probe closes the breaker.
    assert!(wait_for(Duration::from_secs(6), || stack
        .chat(MODEL, &[])
        .status
        == 200));
    assert!(
        reopened.elapsed() >= Duration::from_millis(1900),
        "closed {:?} after reopening, before the doubled cooldown",
        reopened.elapsed()
    );
    for _ in 0..5 {
        assert_primary(&stack.chat(MODEL, &[]));
    }
}

// ---------------------------------------------------------------------------
// Static fallback
// ---------------------------------------------------------------------------

#[test]
fn static_fallback_answers_in_the_openai_shape_when_nothing_can_serve() {
    // The fallback route stays in the Envoy config (it is the shipped one);
    // only the policy has no fallback provider.
    let fallback = MockLlm::start("fallback");
    let sc = TestSidecar::start("200ms", "10s");
    let stack = Stack::start(|cfg| {
        test_policy(cfg, Some(sc.addr()), Some(fallback.addr()));
        let p = cfg.policy_mut();
        p["static_fallback"]["when_primary_out"] = Value::from(true);
        assert!(
            sluice_tests::without_rungs(p),
            "the shipped policy has a ladder"
        );
    });
    sc.wait_for_envoy();
    assert_primary(&stack.chat(MODEL, &[]));
    // Without a fallback section, a client still cannot pick that route
    // (and the credentials Envoy injects there).
    assert_primary(&stack.chat(MODEL, &[("x-sluice-upstream", "fallback")]));
    assert_eq!(requests_total(&fallback), 0);
    let is_static = || {
        chat_with(&stack, "What is sluice?", false).header("x-sluice-degraded") == Some("static")
    };
    let all_static = || {
        assert_static(&chat_with(&stack, "What is sluice?", false), CANNED);
        assert_static(&chat_with(&stack, "  what IS sluice ", false), CANNED);
        assert_static(&chat_with(&stack, "Tell me a joke", false), DEFAULT_MESSAGE);
        assert_static_stream(&chat_with(&stack, "What is sluice?", true), CANNED);
        assert_static_stream(&chat_with(&stack, "Tell me a joke", true), DEFAULT_MESSAGE);
    };

    // Kill switch without a fallback provider: the static answer.
    sc.kill_switch(true);
    assert!(wait_for(Duration::from_secs(5), is_static));
    let reached = stack.upstream_requests();
    all_static();
    assert_eq!(
        stack.upstream_requests(),
        reached,
        "a static answer reached the upstream"
    );
    sc.kill_switch(false);
    assert!(wait_for(Duration::from_secs(5), || stack
        .chat(MODEL, &[])
        .status
        == 200));

    // An open GPU breaker with when_primary_out: the static answer too.
    sc.simulate(95.0);
    assert!(wait_for(Duration::from_secs(10), is_static));
    let reached = stack.upstream_requests();
    all_static();
    assert_eq!(
        stack.upstream_requests(),
        reached,
        "a static answer reached the upstream"
    );
    assert_eq!(requests_total(&fallback), 0);
}

// ---------------------------------------------------------------------------
// Providers and the ladder
// ---------------------------------------------------------------------------

/// The key Envoy's shipped `fallback` route injects for its provider.
const PROVIDER_KEY: &str = "demo-fallback-credential";

/// The shipped policy with its `fallback` section replaced by one provider
/// on the shipped `fallback` route: a paid OpenAI-compatible API that knows
/// only `gpt-4o-mini`, priced per 1M tokens, that reads one limit field.
fn provider_policy(cfg: &mut EnvoyConfig, sidecar: SocketAddr, provider: SocketAddr) {
    test_policy(cfg, Some(sidecar), Some(provider));
    let p = cfg.policy_mut();
    // The shipped ladder's rung, as the tests want it (and moved by open
    // breakers too: ladder_when_out at its default).
    sluice_tests::without_rungs(p);
    p["providers"] = serde_yaml::from_str(&format!(
        "openai:\n  route: fallback\n  models: {{ \"{MODEL}\": gpt-4o-mini }}\n  \
         limit_field: max_completion_tokens\n  \
         prices: {{ gpt-4o-mini: {{ input: \"0.15\", output: \"0.60\", cached_input: \"0.075\" }} }}\n"
    ))
    .expect("providers yaml");
    p["ladder"] = serde_yaml::from_str("[openai]").expect("ladder yaml");
    // Spend is settled only where a budget counts it.
    p["tiers"]["pro"]["daily_spend"] = Value::from(1000);
}

/// The provider: OpenAI's own rules, its own model names, its own key.
fn provider() -> MockLlm {
    MockLlm::start_as_with_args(
        "fallback",
        sluice_tests::Personality::Openai,
        &["--models", "gpt-4o-mini", "--api-key", PROVIDER_KEY],
    )
}

/// An OpenAI usage object's counts: prompt, cached prompt, completion,
/// reasoning (0 where absent).
fn openai_usage(usage: &Json) -> [u64; 4] {
    [
        &usage["prompt_tokens"],
        &usage["prompt_tokens_details"]["cached_tokens"],
        &usage["completion_tokens"],
        &usage["completion_tokens_details"]["reasoning_tokens"],
    ]
    .map(|v| v.as_u64().unwrap_or(0))
}

/// A chat for `MODEL` with `max_tokens: 20`, as the caller of `key`.
fn ask_provider(stack: &Stack, key: (&str, &str)) -> Response {
    let body = json!({"model": MODEL, "max_tokens": 20,
                      "messages": [{"role": "user", "content": "hello provider"}]});
    post_json(&stack.envoy.url("/v1/chat/completions"), &[key], &body)
}

#[test]
fn the_kill_switch_sends_the_providers_model_with_its_key_and_bills_at_its_prices() {
    let provider = provider();
    let sc = TestSidecar::start("30s", "10s");
    let stack = Stack::start(|cfg| provider_policy(cfg, sc.addr(), provider.addr()));
    sc.wait_for_envoy();
    let key = ("x-api-key", "demo-pro-key");
    assert_primary(&stack.chat(MODEL, &[key]));

    sc.kill_switch(true);
    assert!(stack.envoy.kill_switch_reached(Duration::from_secs(5)));
    let spent = |envoy: &sluice_tests::Envoy| {
        envoy
            .metric("sluice_spend_micros_total", &[])
            .unwrap_or(0.0) as u64
    };
    let before = spent(&stack.envoy);
    let r = ask_provider(&stack, key);
    // The provider would answer 404 model_not_found for llama3.1:8b and
    // 401 invalid_api_key for the client's key: it answers 200.
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(served_by(&r), Some("fallback"), "{r:?}");
    assert_eq!(r.header("x-mock-model"), Some("gpt-4o-mini"), "{r:?}");
    assert_eq!(r.header("x-sluice-provider"), Some("openai"), "{r:?}");
    assert_eq!(r.header("x-sluice-kill-switch"), Some("1"), "{r:?}");
    let seen = provider.stats()["last_request"].clone();
    assert_eq!(
        seen["headers"]["authorization"],
        format!("Bearer {PROVIDER_KEY}"),
        "{seen}"
    );
    assert!(
        seen["headers"].get("x-api-key").is_none(),
        "client key leaked: {seen}"
    );
    assert_eq!(seen["body"]["model"], "gpt-4o-mini", "{seen}");
    assert_eq!(seen["body"]["max_completion_tokens"], 20, "{seen}");
    assert!(
        seen["body"].get("max_tokens").is_none(),
        "OpenAI refuses both: {seen}"
    );
    // Spend is the provider's invoice for the usage it reported: each part
    // at its own rate per 1M tokens, rounded up once to a micro-unit.
    let usage = &r.json()["usage"];
    let [input, cached, output, _] = openai_usage(usage);
    assert!(input > 0 && output > 0, "{usage}");
    let thousandths = 150 * (input - cached) + 75 * cached + 600 * output;
    let settled = wait_for(Duration::from_secs(5), || {
        spent(&stack.envoy) - before == thousandths.div_ceil(1000)
    });
    assert!(
        settled,
        "spent {} for {usage}, the invoice says {}",
        spent(&stack.envoy) - before,
        thousandths.div_ceil(1000)
    );

    // A model the provider has no name for skips its rung: the ladder ends
    // at the static answer, and the provider never sees the request.
    let asked = requests_total(&provider);
    let r = stack.chat(OTHER_MODEL, &[key]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-sluice-degraded"), Some("static"), "{r:?}");
    assert_eq!(requests_total(&provider), asked);
}

/// A provider priced from a LiteLLM `model_prices_and_context_window.json`
/// (a fixture written in its format: its `sample_spec`, a non-token model,
/// the provider's model under `openai/<name>`) bills its invoice for the
/// parts the answer reports: input less cached at the input rate, cached
/// input at the cache-read rate, output less reasoning at the output rate,
/// reasoning at its own rate, rounded up once to a micro-unit.
#[test]
fn a_provider_priced_from_a_litellm_price_file_bills_its_invoice() {
    let provider = provider();
    let sc = TestSidecar::start("30s", "10s");
    let file = fs::read_to_string(repo_root().join("tests/fixtures/litellm_prices.json"))
        .expect("the LiteLLM price fixture");
    let stack = Stack::start(|cfg| {
        provider_policy(cfg, sc.addr(), provider.addr());
        let openai = &mut cfg.policy_mut()["providers"]["openai"];
        openai["prices"] = serde_yaml::from_str("{}").expect("no written prices");
        // JSON is YAML: the file as it is.
        openai["prices_litellm"] = serde_yaml::from_str(&file).expect("the file as YAML");
    });
    sc.wait_for_envoy();
    sc.kill_switch(true);
    assert!(stack.envoy.kill_switch_reached(Duration::from_secs(5)));
    let spent = || {
        stack
            .envoy
            .metric("sluice_spend_micros_total", &[])
            .unwrap_or(0.0) as u64
    };
    let before = spent();
    let body = json!({"model": MODEL, "max_tokens": 20,
                      "messages": [{"role": "user", "content": "hello provider, at length"}]});
    let r = post_json(
        &stack.envoy.url("/v1/chat/completions"),
        &[
            ("x-api-key", "demo-pro-key"),
            ("x-mock-cached-tokens", "4"),
            ("x-mock-reasoning-tokens", "3"),
        ],
        &body,
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-sluice-provider"), Some("openai"), "{r:?}");
    let usage = &r.json()["usage"];
    let [input, cached, output, reasoning] = openai_usage(usage);
    assert_eq!((cached, reasoning), (4, 3), "{usage}");
    assert!(input > cached && output > reasoning, "{usage}");
    // Rates per 1M tokens from the file: 0.15, 0.075, 0.60, 1.20.
    let thousandths =
        150 * (input - cached) + 75 * cached + 600 * (output - reasoning) + 1200 * reasoning;
    let settled = wait_for(Duration::from_secs(5), || {
        spent() - before == thousandths.div_ceil(1000)
    });
    assert!(
        settled,
        "spent {} for {usage}, the invoice says {}",
        spent() - before,
        thousandths.div_ceil(1000)
    );
}

/// An application's own API (`apis`) under the kill switch: no provider
/// speaks it, so it never goes down a rung (the provider would get a body
/// it cannot read, with its key); it gets the static answer in the
/// service's own shape, at the declared `answer.text`.
#[test]
fn under_the_kill_switch_a_declared_api_gets_its_static_answer_never_a_provider() {
    let provider = provider();
    let sc = TestSidecar::start("30s", "10s");
    let stack = Stack::start(|cfg| {
        provider_policy(cfg, sc.addr(), provider.addr());
        cfg.policy_mut()["apis"] = serde_yaml::from_str(
            "[{path: /api/v1/ai/chat, model: /model, input: [/message], \
              output_limit: /max_tokens, answer: {text: /reply}}]",
        )
        .expect("apis yaml");
    });
    sc.wait_for_envoy();
    sc.kill_switch(true);
    assert!(stack.envoy.kill_switch_reached(Duration::from_secs(5)));
    let body = json!({"model": MODEL, "message": "hello", "user_id": "u1"});
    let key = ("x-api-key", "demo-pro-key");
    let r = post_json(&stack.envoy.url("/api/v1/ai/chat"), &[key], &body);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-sluice-degraded"), Some("static"), "{r:?}");
    assert!(r.json()["reply"].is_string(), "the service's shape: {r:?}");
    assert_eq!(requests_total(&provider), 0, "no provider speaks it");
    // A chat under the same switch still takes the rung.
    assert_eq!(
        ask_provider(&stack, key).header("x-sluice-provider"),
        Some("openai")
    );
}

#[test]
fn with_a_ladder_an_open_breaker_sends_traffic_to_the_provider_and_back() {
    let provider = provider();
    let sc = TestSidecar::start("200ms", "200ms");
    let stack = Stack::start(|cfg| provider_policy(cfg, sc.addr(), provider.addr()));
    sc.wait_for_envoy();
    let key = ("x-api-key", "demo-pro-key");
    sc.simulate(99.0);
    assert!(
        wait_for(Duration::from_secs(10), || sc.breaker().as_deref()
            == Some("open")),
        "{}",
        sc.state()
    );
    let moved = wait_for(Duration::from_secs(5), || {
        let r = stack.chat(MODEL, &[key]);
        r.header("x-sluice-provider") == Some("openai")
    });
    assert!(moved, "an open breaker sends the request down the ladder");
    let r = stack.chat(MODEL, &[key]);
    assert_eq!((r.status, served_by(&r)), (200, Some("fallback")), "{r:?}");
    assert_eq!(r.header("x-mock-model"), Some("gpt-4o-mini"));
    assert_eq!(r.header("x-sluice-kill-switch"), None, "{r:?}");
    // Healthy again: back to the primary.
    sc.simulate(10.0);
    assert!(wait_for(Duration::from_secs(10), || served_by(
        &stack.chat(MODEL, &[key])
    ) == Some("primary")));
}

#[test]
fn a_spent_provider_budget_ends_the_ladder_at_static_without_overshoot() {
    let provider = provider();
    let sc = TestSidecar::start("30s", "10s");
    let stack = Stack::start(|cfg| {
        provider_policy(cfg, sc.addr(), provider.addr());
        // 30 µ a day: a handful of 20-token answers at 0.60 per 1M out.
        cfg.policy_mut()["providers"]["openai"]["daily_spend"] = Value::from(0.00003);
    });
    sc.wait_for_envoy();
    sc.kill_switch(true);
    assert!(stack.envoy.kill_switch_reached(Duration::from_secs(5)));
    let key = ("x-api-key", "demo-pro-key");
    let ask = || ask_provider(&stack, key);
    let mut served = 0;
    let skipped = (0..20).find_map(|_| {
        let r = ask();
        if r.header("x-sluice-provider") == Some("openai") {
            assert_eq!(r.status, 200, "{r:?}");
            served += 1;
            None
        } else {
            Some(r)
        }
    });
    let r = skipped.expect("the provider's budget ran out within 20 requests");
    assert!(served >= 1, "the budget held at least one request");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-sluice-degraded"), Some("static"), "{r:?}");
    assert_eq!(r.header("x-sluice-skipped"), Some("openai=budget"), "{r:?}");
    // It stays skipped for the window; the provider saw only what it served.
    let asked = requests_total(&provider);
    for _ in 0..3 {
        assert_eq!(ask().header("x-sluice-skipped"), Some("openai=budget"));
    }
    assert_eq!(requests_total(&provider), asked);
    assert_eq!(asked, served as u64);
    // Reserved at the most a request may cost there: never over the budget.
    let spend = stack
        .envoy
        .metric(
            "sluice_provider_spend_micros_total",
            &[("provider", "openai")],
        )
        .expect("the provider's spend, labelled");
    assert!(spend > 0.0 && spend <= 30.0, "spent {spend} µ of 30");
    let skips = stack.envoy.metric(
        "sluice_provider_requests_total",
        &[("provider", "openai"), ("outcome", "skipped_budget")],
    );
    assert_eq!(skips, Some(4.0));
}

/// A webhook receiver: every JSON body posted to it, in order.
struct WebhookSink {
    addr: SocketAddr,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<Json>>>,
}

impl WebhookSink {
    fn start() -> WebhookSink {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the sink");
        let addr = listener.local_addr().expect("the sink's address");
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = bodies.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let mut raw = Vec::new();
                let mut buf = [0u8; 4096];
                // Headers, then content-length bytes of body.
                let body = loop {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break None,
                        Ok(n) => raw.extend_from_slice(&buf[..n]),
                    }
                    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if raw.len() >= end + 4 + len {
                        break Some(raw[end + 4..end + 4 + len].to_vec());
                    }
                };
                if let Some(v) = body.and_then(|b| serde_json::from_slice(&b).ok()) {
                    kept.lock().expect("sink lock").push(v);
                }
                let _ = stream.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                );
            }
        });
        WebhookSink { addr, bodies }
    }

    fn events(&self, event: &str) -> Vec<Json> {
        let bodies = self.bodies.lock().expect("sink lock");
        bodies
            .iter()
            .filter(|b| b["event"] == event)
            .cloned()
            .collect()
    }
}

#[test]
fn a_providers_budget_alert_reaches_the_webhook_once_per_window() {
    let provider = provider();
    let sink = WebhookSink::start();
    let mut sc = TestSidecar::start("30s", "10s");
    let stack = Stack::start(|cfg| {
        provider_policy(cfg, sc.addr(), provider.addr());
        cfg.policy_mut()["providers"]["openai"]["daily_spend"] =
            serde_yaml::from_str("{ limit: 0.00003, alert_at: 50% }").expect("budget yaml");
    });
    // The sidecar reads Envoy's stats (where the filter counts the alert)
    // and posts to the webhook: it needs Envoy's admin address, known now.
    sc.restart_with(&format!(
        "envoy_admin: {{ url: \"{}\", scrape_every: 100ms }}\n\
         alerts: {{ webhooks: [{{ url: \"http://{}/hook\" }}] }}\n",
        stack.envoy.admin_url(""),
        sink.addr
    ));
    sc.kill_switch(true);
    assert!(stack.envoy.kill_switch_reached(Duration::from_secs(5)));
    let key = ("x-api-key", "demo-pro-key");
    let ask = || ask_provider(&stack, key);
    // Past half the budget, and then past all of it.
    let spent = (0..20).any(|_| ask().header("x-sluice-skipped").is_some());
    assert!(spent, "the provider's budget ran out within 20 requests");
    for _ in 0..3 {
        ask();
    }
    let alerted = wait_for(Duration::from_secs(10), || {
        !sink.events("provider_budget_alert").is_empty()
    });
    assert!(
        alerted,
        "no alert reached the webhook: {:?}",
        sink.bodies.lock().unwrap()
    );
    let counted = stack.envoy.metric(
        "sluice_provider_budget_alerts_total",
        &[("provider", "openai")],
    );
    assert_eq!(counted, Some(1.0), "once in the window");
    // A few more scrapes: still one post.
    std::thread::sleep(Duration::from_millis(500));
    let events = sink.events("provider_budget_alert");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["provider"], "openai", "{}", events[0]);
    assert_eq!(events[0]["scope"], "provider:openai");
}

/// Envoy health-checks the provider's cluster (its model list, with its
/// key); the sidecar reads the verdict from Envoy's admin
/// (`envoy_admin.rungs`) and reports the rung down once the provider is
/// gone, so under the kill switch a caller is passed over to the static
/// answer (`x-sluice-skipped: openai=down`) instead of being sent to a
/// provider that cannot answer (Envoy's 503 "upstream connect error").
#[test]
fn a_rung_whose_health_checks_fail_is_skipped_before_any_caller_waits_on_it() {
    let provider = provider();
    let mut sc = TestSidecar::start("30s", "10s");
    let stack = Stack::start(|cfg| {
        provider_policy(cfg, sc.addr(), provider.addr());
        // Probed every 200 ms, also while it serves no traffic (Envoy's
        // no_traffic_interval is 60 s otherwise); 2 failures in a row
        // mark it down, 2 successes up.
        cfg.cluster_mut("llm_fallback")["health_checks"] = serde_yaml::from_str(&format!(
            "[{{ timeout: 1s, interval: 0.2s, no_traffic_interval: 0.2s, \
               unhealthy_threshold: 2, healthy_threshold: 2, \
               http_health_check: {{ path: /v1/models, request_headers_to_add: \
               [{{ header: {{ key: authorization, value: \"Bearer {PROVIDER_KEY}\" }} }}] }} }}]"
        ))
        .expect("health check yaml");
    });
    sc.restart_with(&format!(
        "envoy_admin: {{ url: \"{}\", scrape_every: 100ms, rungs: {{ openai: llm_fallback }} }}\n",
        stack.envoy.admin_url("")
    ));
    sc.kill_switch(true);
    assert!(stack.envoy.kill_switch_reached(Duration::from_secs(5)));
    let key = ("x-api-key", "demo-pro-key");
    // Healthy: the provider serves (its checks pass with its key).
    let served = wait_for(Duration::from_secs(10), || {
        served_by(&ask_provider(&stack, key)) == Some("fallback")
    });
    let state = || sc.state();
    assert!(served, "{}", state());
    assert!(
        !state()["breakers"].to_string().contains("provider:openai"),
        "{}",
        state()
    );
    // The page lists the rung up, with the sidecar's connect time to it.
    let rung_row = || {
        let page: Json =
            serde_json::from_str(&get(&sc.sidecar.url("/v1/history"), &[]).body).expect("history");
        page["breakers"]
            .as_array()
            .and_then(|b| b.iter().find(|b| b["scope"] == "provider:openai").cloned())
            .unwrap_or_default()
    };
    let listed = wait_for(Duration::from_secs(5), || rung_row()["connect_ms"].is_u64());
    let row = rung_row();
    assert!(listed && row["state"] == "closed", "{row}");
    assert!(
        row["reason"]
            .as_str()
            .is_some_and(|r| r.contains("1 of 1 hosts")),
        "{row}"
    );
    // The provider goes away: Envoy's checks fail, the sidecar says so.
    drop(provider);
    let down = wait_for(Duration::from_secs(10), || {
        state()["breakers"].as_array().is_some_and(|b| {
            b.iter()
                .any(|b| b["scope"] == "provider:openai" && b["state"] == "open")
        })
    });
    assert!(down, "{}\n{}", state(), sc.sidecar.log());
    // The operator page lists the rung down with Envoy's reason, and that
    // nothing answers a connect any more.
    let row = rung_row();
    assert_eq!(row["state"], "open", "{row}");
    assert!(
        row["reason"]
            .as_str()
            .is_some_and(|r| r.contains("llm_fallback") && r.contains("TCP connect failed")),
        "{row}"
    );
    let skipped = wait_for(Duration::from_secs(5), || {
        ask_provider(&stack, key).header("x-sluice-skipped") == Some("openai=down")
    });
    assert!(skipped, "{}", state());
    let r = ask_provider(&stack, key);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-sluice-degraded"), Some("static"), "{r:?}");
    assert_eq!(
        stack
            .envoy
            .metric(
                "sluice_provider_requests_total",
                &[("provider", "openai"), ("outcome", "skipped_down")]
            )
            .map(|n| n >= 2.0),
        Some(true)
    );
}
