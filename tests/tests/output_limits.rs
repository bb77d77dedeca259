//! Output limits per API against a real Envoy (issue 27 item 1): sluice
//! reserves the limit the API's real servers obey, refuses a limit field of
//! another API by name, and writes the reserved limit into every field that
//! API's servers read, so a hard token budget is never overshot whichever
//! field the server behind the route picks.
//!
//! The reported overshoot: `{"max_tokens":10,"max_completion_tokens":20000}`
//! on chat reserved 10 and went up unchanged (vLLM obeys
//! `max_completion_tokens`); `max_output_tokens` and `options.num_predict`
//! on chat were reserved and reached a server that reads neither.
//!
//! Which fields each API's servers read (independent of the filter's own
//! table, `core/src/usage/output_limit.rs`, which cites the sources):
//! chat `max_completion_tokens` (vLLM first, OpenAI) and `max_tokens`
//! (vLLM second, Ollama only); completions and Anthropic `max_tokens`;
//! Responses `max_output_tokens`; Ollama native `options.num_predict`.
//!
//! Upstream: each personality whose server speaks the API under test
//! (`PERSONALITIES`, filtered by the endpoints each serves), each
//! generating all a request allows.

use std::time::Duration;

use serde_json::{json, Value as Json};
use sluice_tests::{
    post_json, request, shipped_config_for, wait_for, Envoy, EnvoyConfig, MockLlm, Personality,
    Response,
};

/// A model the policy does not list (its estimate is never corrected).
const MODEL: &str = "sluice-test-model";
/// The output reserved when a request sets no limit.
const DEFAULT_OUTPUT: u64 = 64;

/// The servers mock-llm plays for these tests, each generating all a
/// request allows (`--generate-allowed`): its own plain reading (the first
/// limit field present) and vLLM's, OpenAI's and Ollama's, each with its
/// own field precedence (`mock-llm/src/personality.rs`), so a field read
/// differently by one server fails a test.
const PERSONALITIES: [Personality; 4] = [
    Personality::Mock,
    Personality::Vllm,
    Personality::Openai,
    Personality::Ollama,
];

/// Does the server `p` plays have the API at `path`?
fn serves(p: Personality, path: &str) -> bool {
    match p {
        Personality::Mock => true,
        Personality::Vllm => !path.starts_with("/api/"),
        Personality::Openai => !path.starts_with("/api/") && path != "/v1/messages",
        Personality::Ollama => true,
        Personality::Anthropic => path == "/v1/messages",
    }
}

/// The limit fields each API's servers read, by path.
fn read_fields(path: &str) -> &'static [&'static str] {
    match path {
        "/v1/chat/completions" => &["max_completion_tokens", "max_tokens"],
        "/v1/completions" | "/v1/messages" => &["max_tokens"],
        "/v1/responses" => &["max_output_tokens"],
        "/api/generate" | "/api/chat" => &["options.num_predict"],
        _ => &[],
    }
}

/// Per server that may sit behind `path`, the limit fields it reads in
/// the order it picks them (the first one set wins): chat has vLLM's and
/// OpenAI's order, and Ollama's OpenAI layer, which reads `max_tokens` only.
fn servers(path: &str) -> Vec<&'static [&'static str]> {
    match path {
        "/v1/chat/completions" => vec![&["max_completion_tokens", "max_tokens"], &["max_tokens"]],
        other => vec![read_fields(other)],
    }
}

/// The limit each server behind `path` would obey in `body` (`None`: it
/// finds none and generates its own default).
fn obeyed(path: &str, body: &Json) -> Vec<Option<u64>> {
    servers(path)
        .iter()
        .map(|order| order.iter().find_map(|n| field(body, n).as_u64()))
        .collect()
}

fn field<'a>(body: &'a Json, name: &str) -> &'a Json {
    match name.split_once('.') {
        Some((outer, inner)) => &body[outer][inner],
        None => &body[name],
    }
}

/// mock-llm (as `personality`) behind Envoy with one tier whose daily
/// token budget is `budget` (hard: output is lowered, never overshot).
struct Bench {
    envoy: Envoy,
    upstream: MockLlm,
}

impl Bench {
    fn start(personality: Personality, budget: u64) -> Bench {
        let upstream = MockLlm::start_as_with_args("primary", personality, &["--generate-allowed"]);
        let mut cfg: EnvoyConfig = shipped_config_for(&upstream);
        let policy = json!({
            "default_tier": "t",
            "identity": {"sources": ["client_address"]},
            "tiers": {"t": {"daily_tokens": budget}},
            "defaults": {"max_output_tokens": DEFAULT_OUTPUT},
        });
        *cfg.policy_mut() = serde_yaml::to_value(&policy).expect("policy as YAML");
        let envoy = Envoy::start(&cfg, 2);
        Bench { envoy, upstream }
    }

    fn post(&self, path: &str, body: &Json) -> Response {
        post_json(&self.envoy.url(path), &[], body)
    }

    fn upstream_requests(&self) -> u64 {
        self.upstream.stats()["requests_total"]
            .as_u64()
            .expect("requests_total")
    }

    /// The body the upstream got last.
    fn upstream_body(&self) -> Json {
        self.upstream.stats()["last_request"]["body"].clone()
    }

    /// Tokens settled (charged) so far, input and output.
    fn charged(&self) -> u64 {
        ["input", "output"]
            .iter()
            .map(|d| {
                self.envoy
                    .metric(
                        "sluice_tokens_total",
                        &[("direction", d), ("kind", "actual")],
                    )
                    .unwrap_or(0.0) as u64
            })
            .sum()
    }

    fn settled(&self) -> bool {
        wait_for(Duration::from_secs(10), || {
            self.envoy.metric("sluice_reservations_outstanding", &[]) == Some(0.0)
        })
    }
}

/// A body of the API at `path` with `limits` merged in.
fn body(path: &str, limits: Json) -> Json {
    let mut body = match path {
        "/v1/chat/completions" | "/api/chat" => {
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        }
        "/v1/messages" => {
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        }
        "/v1/completions" | "/api/generate" => json!({"model": MODEL, "prompt": "hi"}),
        "/v1/responses" | "/v1/embeddings" => json!({"model": MODEL, "input": "hi"}),
        other => panic!("no body for {other}"),
    };
    if path.starts_with("/api/") {
        body["stream"] = false.into();
    }
    if let (Some(b), Json::Object(l)) = (body.as_object_mut(), limits) {
        b.extend(l);
    }
    body
}

/// The field a body sets, as the 400 must name it.
fn limit(name: &str, v: i64) -> Json {
    match name.split_once('.') {
        Some((outer, inner)) => json!({ outer: { inner: v } }),
        None => json!({ name: v }),
    }
}

#[test]
fn a_limit_field_of_another_api_is_refused_by_name() {
    // Refused before any upstream: one personality is enough.
    {
        let bench = Bench::start(Personality::Mock, 1_000_000);
        let all = [
            "max_tokens",
            "max_completion_tokens",
            "max_output_tokens",
            "options.num_predict",
        ];
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/messages",
            "/api/generate",
            "/api/chat",
            "/v1/embeddings",
        ] {
            for foreign in all.iter().filter(|f| !read_fields(path).contains(f)) {
                // Alone, and beside a field the API does read (the
                // reported `max_output_tokens: 1` on chat is the first).
                let mut bodies = vec![body(path, limit(foreign, 1))];
                if let Some(own) = read_fields(path).first() {
                    let mut mixed = body(path, limit(own, 5));
                    if let (Some(m), Json::Object(f)) = (mixed.as_object_mut(), limit(foreign, 1)) {
                        m.extend(f);
                    }
                    bodies.push(mixed);
                }
                for b in bodies {
                    let resp = bench.post(path, &b);
                    assert_eq!(resp.status, 400, "{path} {b}: {resp:?}");
                    assert_eq!(resp.header("x-sluice-reason"), Some("invalid_request"));
                    let err = resp.json();
                    assert_eq!(
                        err["error"]["param"].as_str(),
                        Some(*foreign),
                        "{path} {b}: {err}"
                    );
                }
            }
        }
        // Go's decoder (Ollama) matches keys without case and takes the
        // last: another spelling of a limit key is refused by name too.
        for (path, key) in [
            ("/v1/chat/completions", "MAX_TOKENS"),
            ("/api/generate", "Options"),
        ] {
            let mut b = body(path, json!({}));
            b[key] = json!({"num_predict": 99_999});
            let resp = bench.post(path, &b);
            assert_eq!(resp.status, 400, "{b}: {resp:?}");
            assert_eq!(resp.json()["error"]["param"].as_str(), Some(key), "{b}");
        }
        assert_eq!(
            bench.upstream_requests(),
            0,
            "nothing refused went upstream"
        );
    }
}

#[test]
fn the_upstream_gets_the_reserved_limit_in_every_field_its_servers_read() {
    for personality in PERSONALITIES {
        let bench = Bench::start(personality, 1_000_000);
        // (path, the client's limit fields, the limit reserved per choice)
        let cases = [
            // The reported overshoot: vLLM obeys the 2,000.
            (
                "/v1/chat/completions",
                json!({"max_tokens": 10, "max_completion_tokens": 2000}),
                2000,
            ),
            (
                "/v1/chat/completions",
                json!({"max_tokens": 2000, "max_completion_tokens": 10}),
                2000,
            ),
            // Ollama reads only max_tokens: it is written too.
            (
                "/v1/chat/completions",
                json!({"max_completion_tokens": 7}),
                7,
            ),
            ("/v1/chat/completions", json!({}), DEFAULT_OUTPUT),
            ("/v1/completions", json!({"max_tokens": 9}), 9),
            ("/v1/completions", json!({}), DEFAULT_OUTPUT),
            ("/v1/responses", json!({"max_output_tokens": 11}), 11),
            ("/v1/responses", json!({}), DEFAULT_OUTPUT),
            ("/v1/messages", json!({"max_tokens": 13}), 13),
            ("/api/generate", json!({"options": {"num_predict": 5}}), 5),
            // Ollama's "no limit": the default, written.
            (
                "/api/chat",
                json!({"options": {"num_predict": -1}}),
                DEFAULT_OUTPUT,
            ),
            ("/api/chat", json!({}), DEFAULT_OUTPUT),
        ];
        for (path, limits, reserved) in cases {
            if !serves(personality, path) {
                continue;
            }
            let sent = body(path, limits.clone());
            let resp = bench.post(path, &sent);
            assert_eq!(resp.status, 200, "{path} {sent}: {resp:?}");
            let up = bench.upstream_body();
            for obeys in obeyed(path, &up) {
                assert_eq!(
                    obeys,
                    Some(reserved),
                    "{path} {limits}: a server would obey {obeys:?} in {up} ({personality:?})"
                );
            }
            // Every field a server reads that is present carries it.
            for name in read_fields(path) {
                let v = field(&up, name);
                assert!(v.is_null() || v.as_u64() == Some(reserved), "{path}: {up}");
            }
            // No field the API's servers do not read was added.
            for name in ["max_tokens", "max_completion_tokens", "max_output_tokens"] {
                if !read_fields(path).contains(&name) {
                    assert!(up.get(name).is_none(), "{path}: `{name}` added in {up}");
                }
            }
        }
        // `max_completion_tokens` is not added where the client did not
        // use it (OpenAI's reasoning models refuse `max_tokens`, and a body
        // with both: sluice adds only what a server needs).
        bench.post(
            "/v1/chat/completions",
            &body("/v1/chat/completions", json!({"max_tokens": 3})),
        );
        let up = bench.upstream_body();
        assert_eq!(
            (up["max_tokens"].as_u64(), up.get("max_completion_tokens")),
            (Some(3), None)
        );
        assert!(bench.settled());
    }
}

/// The limit sluice writes is spliced into the client's bytes: key order,
/// spacing, escapes and number spellings reach the server as the client
/// wrote them, the new field at the end of the object.
#[test]
fn the_rewritten_body_keeps_the_clients_bytes() {
    let bench = Bench::start(Personality::Vllm, 1_000_000);
    let sent = concat!(
        "{ \"model\" : \"m\",\n  \"temperature\": 1.0,\n",
        "  \"messages\": [{\"role\": \"user\", \"content\": \"caf\\u00e9 \\\"q\\\" 1e3\"}] }"
    );
    let resp = request(
        "POST",
        &bench.envoy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        Some(sent.as_bytes().to_vec()),
    )
    .expect("the request");
    assert_eq!(resp.status, 200, "{resp:?}");
    let up = bench.upstream.stats()["last_request"]["raw"]
        .as_str()
        .expect("raw body")
        .to_string();
    let client_members = &sent[..sent.rfind(" }").expect("the closing brace")];
    assert!(
        up.starts_with(client_members) && up.ends_with(" }"),
        "the client's bytes changed: {up}"
    );
    let added: Json = serde_json::from_str(&format!(
        "{{{}}}",
        &up[client_members.len() + 1..up.len() - 2]
    ))
    .expect("the added members");
    assert_eq!(added, json!({"max_tokens": DEFAULT_OUTPUT}), "{up}");
}

#[test]
fn a_hard_budget_is_never_overshot_whatever_field_the_server_reads() {
    const BUDGET: u64 = 400;
    for personality in PERSONALITIES {
        let bench = Bench::start(personality, BUDGET);
        // Bodies whose fields disagree: each server reads a different one
        // (mock-llm's plain reading takes `max_tokens` first, like Ollama;
        // vLLM takes `max_completion_tokens` first; Ollama ignores
        // `max_completion_tokens` alone and generates its default).
        let mixed = [
            (
                "/v1/chat/completions",
                json!({"max_tokens": 16, "max_completion_tokens": 1}),
            ),
            (
                "/v1/chat/completions",
                json!({"max_tokens": 1, "max_completion_tokens": 16}),
            ),
            ("/v1/chat/completions", json!({"max_completion_tokens": 1})),
            ("/v1/completions", json!({"max_tokens": 1})),
            ("/v1/responses", json!({"max_output_tokens": 2})),
            ("/v1/messages", json!({"max_tokens": 3})),
            ("/api/generate", json!({"options": {"num_predict": -1}})),
            ("/api/chat", json!({"options": {"num_predict": 4}})),
        ];
        let (mut admitted, mut refused) = (0u64, 0u64);
        for round in 0..40 {
            let admitted_before = admitted;
            for (path, limits) in &mixed {
                if !serves(personality, path) {
                    continue;
                }
                let sent = body(path, limits.clone());
                let resp = bench.post(path, &sent);
                match resp.status {
                    200 => admitted += 1,
                    429 => {
                        refused += 1;
                        continue;
                    }
                    s => panic!("{path} {sent}: {s} {resp:?}"),
                }
                // Every server behind the API obeys one limit, the same,
                // at most the largest the client asked for.
                let up = bench.upstream_body();
                let asked = read_fields(path)
                    .iter()
                    .filter_map(|n| field(&sent, n).as_i64())
                    .max()
                    .filter(|&m| m >= 0)
                    .map_or(DEFAULT_OUTPUT, |m| m as u64);
                let obeys = obeyed(path, &up);
                assert!(
                    obeys
                        .iter()
                        .all(|o| o.is_some_and(|o| o <= asked) && *o == obeys[0]),
                    "round {round} {path} {limits}: upstream got {up}, servers obey {obeys:?}"
                );
            }
            if admitted == admitted_before {
                break; // the budget is spent for every API
            }
        }
        assert!(
            admitted > 0 && refused > 0,
            "{admitted} admitted, {refused} refused"
        );
        assert!(bench.settled(), "reservations left outstanding");
        let charged = bench.charged();
        assert!(
            charged <= BUDGET,
            "{charged} tokens charged on a {BUDGET}-token hard budget ({personality:?})"
        );
    }
}
