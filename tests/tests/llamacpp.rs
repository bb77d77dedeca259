//! A real inference server behind a real Envoy with sluice (issue 48,
//! item 7): llama.cpp's server with SmolLM2-135M-Instruct, installed by
//! `make llamacpp` (tests/src/llamacpp.rs says how it runs). Every other
//! integration test talks to a fake; here the server's own tokenizer and
//! chat template decide what a request costs, and its `usage` is the truth
//! sluice must settle at and a hard budget must hold against.
//!
//! What this server reads, from llama.cpp's source (ggml-org/llama.cpp):
//! - The output limit: `tools/server/server-task.cpp`, `params_from_json_cmpl`
//!   reads `n_predict`, else `max_completion_tokens`, else `max_tokens`
//!   (`auto max_tokens = json_value(data, "max_tokens", …); params.n_predict =
//!   json_value(data, "n_predict", json_value(data, "max_completion_tokens",
//!   max_tokens))`), on chat and completions alike (the OpenAI routes become
//!   the same completion task: `tools/server/server-context.cpp`,
//!   `handle_completions_impl`).
//! - Streams: the same function reads `stream_options.include_usage`; the
//!   usage chunk is a last chunk with empty `choices`, before `[DONE]`.
//! - The chat template is the model's (SmolLM2's injects a default system
//!   prompt, "You are a helpful AI assistant named SmolLM…", when the first
//!   message is not a system one), and `prompt_tokens` counts the rendered
//!   template: `POST /apply-template` and `POST /tokenize` give the same count.
//! - `/metrics` (with `--metrics`): `tools/server/server-task.cpp`,
//!   `server_task_result_metrics::to_metrics`, gauges
//!   `llamacpp:requests_processing` and `llamacpp:requests_deferred`;
//!   `llamacpp:kv_cache_usage_ratio` is gone since ggml-org/llama.cpp#13660.
//!
//! The server is shared by every test here (one model load for the
//! binary) and decodes 2 requests at a time on 2 threads: each test reads
//! its own answers' usage, never the server's totals.
//!
//! `make test` installs the server and sets `SLUICE_REQUIRE_LLAMACPP=1`;
//! run by hand without it, each test says SKIPPED and passes.

use std::fs;
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};
use sluice_tests::llamacpp::{post_json, require, LlamaCpp};
use sluice_tests::third_party::shipped_config_for_addr;
use sluice_tests::{get, prometheus_value, wait_for, Envoy, EnvoyConfig, Response, Sidecar};

/// A model the shipped policy lists (its per-model learning applies, as
/// in the repro); llama.cpp serves whatever the body names.
const MODEL: &str = "llama3.1:8b";

/// Another model the shipped policy lists.
const OTHER_MODEL: &str = "mistral:7b";

/// The free tier's key in the shipped policy (hard 5,000 tokens a day).
const FREE_KEY: &str = "demo-free-key";

/// Envoy with the shipped config and policy in front of the shared server.
struct Real {
    envoy: Envoy,
}

impl Real {
    fn start(server: &'static LlamaCpp, edit: impl FnOnce(&mut EnvoyConfig)) -> Real {
        let mut cfg = shipped_config_for_addr(server.addr());
        edit(&mut cfg);
        let envoy = Envoy::start(&cfg, 2);
        Real { envoy }
    }

    fn post(&self, path: &str, headers: &[(&str, &str)], body: &Json) -> Response {
        post_json(&self.envoy.url(path), headers, body)
    }
}

/// The shipped policy with the requests-per-minute limits lifted (the
/// tests send faster than 10/min) and nothing else changed.
fn shipped_policy_without_rate_limits(cfg: &mut EnvoyConfig) {
    let policy = cfg.policy_mut();
    for tier in ["free", "pro", "enterprise"] {
        policy["tiers"][tier]["requests"] = "10000/min".into();
    }
    policy["models"][MODEL]["requests"] = "10000/min".into();
}

/// A policy with one tier `t` (one principal per client address) and the
/// audit record on.
fn open_policy(cfg: &mut EnvoyConfig) {
    let policy = json!({
        "default_tier": "t",
        "identity": {"sources": ["client_address"]},
        "tiers": {"t": {"requests": "10000/min", "daily_tokens": 10_000_000}},
        "models": {},
        "defaults": {"max_output_tokens": 512},
        "audit": {"salt": "llamacpp"},
    });
    *cfg.policy_mut() = serde_yaml::to_value(&policy).expect("policy as YAML");
}

fn chat(content: &str, extra: Json) -> Json {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        // Greedy: the same request generates the same text.
        "temperature": 0,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    body
}

/// The JSON `data:` payloads of an SSE body (not `[DONE]`), and whether
/// it ended with `[DONE]`.
fn sse(body: &str) -> (Vec<Json>, bool) {
    let payloads: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| {
            e.lines()
                .find_map(|l| l.strip_prefix("data:"))
                .map(str::trim)
        })
        .collect();
    let done = payloads.last() == Some(&"[DONE]");
    let events = payloads
        .into_iter()
        .filter(|p| *p != "[DONE]")
        .map(|p| serde_json::from_str(p).unwrap_or_else(|e| panic!("event {p:?}: {e}")))
        .collect();
    (events, done)
}

fn usage_chunks(events: &[Json]) -> Vec<&Json> {
    events
        .iter()
        .filter(|e| e["usage"].is_object())
        .map(|e| &e["usage"])
        .collect()
}

fn text_of(events: &[Json]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect()
}

fn n(v: &Json) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// The server's usage of one answer, plain or streamed with the usage
/// chunk: `(prompt_tokens, completion_tokens)`.
fn usage_of(resp: &Response) -> (u64, u64) {
    let usage = if resp.body.starts_with("data:") {
        let (events, done) = sse(&resp.body);
        assert!(done, "no [DONE]: {}", resp.body);
        let chunks = usage_chunks(&events);
        assert_eq!(chunks.len(), 1, "one usage chunk: {}", resp.body);
        chunks[0].clone()
    } else {
        resp.json()["usage"].clone()
    };
    (n(&usage["prompt_tokens"]), n(&usage["completion_tokens"]))
}

fn assert_audited(line: &Json, (input, output): (u64, u64)) {
    assert_eq!(line["decision"], "admit", "{line}");
    assert_eq!(line["tokens_input"], input, "{line}");
    assert_eq!(line["tokens_output"], output, "{line}");
    assert_eq!(line["usage_source"], "upstream", "{line}");
}

/// A prompt the model answers at length (it does not stop before a small
/// limit).
const STORY: &str = "Write a long story about a lighthouse keeper and a storm.";

// ---------------------------------------------------------------------------
// 1. Request shapes: what the server reported is what sluice settled
// ---------------------------------------------------------------------------

#[test]
fn llamacpp_usage_is_what_sluice_settles_on_chat_streams_and_completions() {
    let Some(server) = require("llamacpp_usage_is_what_sluice_settles") else {
        return;
    };
    let started = Instant::now();
    let real = Real::start(server, open_policy);
    let mut settled = (0, 0);
    let mut add = |u: (u64, u64)| {
        settled.0 += u.0;
        settled.1 += u.1;
    };

    // The server's prompt count is its template rendered and tokenized
    // (SmolLM2's default system prompt included).
    let rendered = post_json(
        &server.url("/apply-template"),
        &[],
        &json!({"messages": [{"role": "user", "content": STORY}]}),
    )
    .ok()
    .json()["prompt"]
        .as_str()
        .expect("apply-template answers a prompt")
        .to_string();
    assert!(rendered.contains("named SmolLM"), "{rendered}");
    let prompt_tokens = server.tokenize(&rendered).expect("tokenize") as u64;

    // (a) Chat, not streamed.
    let resp = real.post(
        "/v1/chat/completions",
        &[],
        &chat(STORY, json!({"max_tokens": 8})),
    );
    assert_eq!(resp.status, 200, "{resp:?}");
    let usage = usage_of(&resp);
    assert_eq!(usage, (prompt_tokens, 8), "{}", resp.body);
    assert_eq!(resp.json()["choices"][0]["finish_reason"], "length");
    add(usage);
    assert_audited(&real.envoy.flushed_audit_log(1)[0], usage);

    // (b) Streamed with the client's include_usage: the server's usage
    // chunk reaches the client once, before [DONE].
    let body = chat(
        STORY,
        json!({"max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let resp = real.post("/v1/chat/completions", &[], &body);
    assert_eq!(resp.status, 200, "{resp:?}");
    let usage = usage_of(&resp);
    assert_eq!(usage, (prompt_tokens, 8), "{}", resp.body);
    let streamed_text = text_of(&sse(&resp.body).0);
    add(usage);
    assert_audited(&real.envoy.flushed_audit_log(2)[1], usage);

    // (c) Streamed without include_usage: sluice asks the server for the
    // usage chunk, settles at it and keeps it from the client. The same
    // greedy request generates the same text.
    let body = chat(STORY, json!({"max_tokens": 8, "stream": true}));
    let resp = real.post("/v1/chat/completions", &[], &body);
    assert_eq!(resp.status, 200, "{resp:?}");
    let (events, done) = sse(&resp.body);
    assert!(done, "no [DONE]: {}", resp.body);
    assert!(
        usage_chunks(&events).is_empty(),
        "usage leaked: {}",
        resp.body
    );
    assert_eq!(text_of(&events), streamed_text);
    add((prompt_tokens, 8));
    assert_audited(&real.envoy.flushed_audit_log(3)[2], (prompt_tokens, 8));

    // (d) Legacy completions: no template, the prompt as tokenized.
    let prompt = "Once upon a time, in a lighthouse by the sea,";
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0});
    let resp = real.post("/v1/completions", &[], &body);
    assert_eq!(resp.status, 200, "{resp:?}");
    let usage = usage_of(&resp);
    // llama.cpp adds the vocabulary's BOS only where the model asks for
    // one; SmolLM2's does not.
    assert_eq!(usage.0, server.tokenize(prompt).expect("tokenize") as u64);
    assert!(usage.1 >= 1 && usage.1 <= 6, "{usage:?}");
    add(usage);
    assert_audited(&real.envoy.flushed_audit_log(4)[3], usage);

    // (e) Streamed completions with include_usage.
    let mut body = body.clone();
    body["stream"] = true.into();
    body["stream_options"] = json!({"include_usage": true});
    let resp = real.post("/v1/completions", &[], &body);
    assert_eq!(resp.status, 200, "{resp:?}");
    let usage = usage_of(&resp);
    add(usage);
    assert_audited(&real.envoy.flushed_audit_log(5)[4], usage);

    real.envoy
        .assert_no_reservation_left(Duration::from_secs(20));
    assert_eq!(
        (
            real.envoy.settled_tokens("input"),
            real.envoy.settled_tokens("output")
        ),
        settled,
        "sluice's counters vs the server's usage"
    );
    println!("llamacpp shapes: {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------
// 2. Output limits: the field the server obeys is the one sluice reserved
// ---------------------------------------------------------------------------

/// llama.cpp reads `max_completion_tokens` before `max_tokens`. Either
/// alone is obeyed; with both, sluice reserves the larger and writes it
/// into both, so the server's count never passes what was reserved.
#[test]
fn llamacpp_obeys_the_output_limit_sluice_reserved_whichever_field_the_client_used() {
    let Some(server) = require("llamacpp_obeys_the_output_limit") else {
        return;
    };
    let real = Real::start(server, open_policy);
    let cases = [
        (json!({"max_tokens": 5}), 5),
        (json!({"max_completion_tokens": 7}), 7),
        // The smaller first or second: the larger is reserved and written.
        (json!({"max_tokens": 4, "max_completion_tokens": 9}), 9),
        (json!({"max_tokens": 9, "max_completion_tokens": 4}), 9),
    ];
    for (i, (limit, reserved)) in cases.iter().enumerate() {
        let resp = real.post("/v1/chat/completions", &[], &chat(STORY, limit.clone()));
        assert_eq!(resp.status, 200, "{limit}: {resp:?}");
        let usage = usage_of(&resp);
        // The story runs past every limit here: the server generates
        // exactly the limit it read, which is the one sluice wrote.
        assert_eq!(usage.1, *reserved, "{limit}: {}", resp.body);
        let line = &real.envoy.flushed_audit_log(i + 1)[i];
        assert_audited(line, usage);
        let estimated = n(&line["tokens_estimated"]);
        assert!(
            estimated >= *reserved,
            "{limit}: reserved {estimated} < the {reserved} the server generated"
        );
    }
    real.envoy
        .assert_no_reservation_left(Duration::from_secs(20));
}

/// llama.cpp's own `n_predict` comes before both OpenAI fields. A body
/// with `max_tokens: 4` and `n_predict: 64` must not reserve 4 and let the
/// server generate 64: refused (400), or bounded by what was reserved.
#[test]
fn llamacpps_n_predict_cannot_raise_the_output_past_the_reservation() {
    let Some(server) = require("llamacpps_n_predict_cannot_raise_the_output") else {
        return;
    };
    let real = Real::start(server, open_policy);
    let body = chat(STORY, json!({"max_tokens": 4, "n_predict": 64}));
    let resp = real.post("/v1/chat/completions", &[], &body);
    match resp.status {
        400 => {}
        200 => {
            // sluice reads `n_predict` as an output limit: the largest
            // limit (64) is reserved and written into every field the
            // client sent, so what the server generates is covered.
            let usage = usage_of(&resp);
            let line = &real.envoy.flushed_audit_log(1)[0];
            let reserved = n(&line["tokens_estimated"]);
            assert!(
                usage.1 <= 64,
                "the server generated {} on an output reservation of 64 \
                 (tokens_estimated {reserved})",
                usage.1
            );
            assert!(reserved >= 64, "the largest limit reserved: {line}");
        }
        other => panic!("unexpected {other}: {resp:?}"),
    }
}

// ---------------------------------------------------------------------------
// 3. The free key's hard budget against the server's own counts
// ---------------------------------------------------------------------------

/// Original Italian prose, a sentence a line, composed into prompts of
/// 800–1,100 characters: SmolLM2's English-first vocabulary cuts Italian
/// into short pieces, the case where an estimate is furthest from it.
const FRASI: [&str; 14] = [
    "La biblioteca comunale riapre lunedì dopo sei mesi di lavori, con una sala di lettura più luminosa e un archivio finalmente ordinato.",
    "Il bibliotecario racconta che i volumi più richiesti restano i romanzi gialli, seguiti dalle guide di montagna e dai libri di cucina regionale.",
    "Nel cortile interno hanno piantato due tigli e una fila di lavande, perché d'estate si possa leggere all'ombra senza il rumore della strada.",
    "Gli studenti dell'istituto tecnico hanno rifatto l'impianto elettrico come progetto di fine anno, sotto lo sguardo attento di due ingegneri.",
    "La sera del giovedì si terrà un incontro aperto a tutti sulla storia del quartiere, con fotografie prestate dalle famiglie che ci abitano da sempre.",
    "Chi vuole partecipare può iscriversi allo sportello o lasciare un messaggio in segreteria, indicando il proprio nome e un recapito telefonico.",
    "Il sindaco ha ringraziato i volontari che durante la chiusura hanno portato i libri a domicilio agli anziani e ai malati del paese.",
    "Per l'inaugurazione è previsto un piccolo rinfresco con pane casereccio, formaggi delle malghe vicine e succhi di mela del consorzio agricolo.",
    "La nuova sezione per ragazzi occupa il primo piano e ospita laboratori di scrittura, di fumetto e di scienze il sabato mattina.",
    "Restano da sistemare gli scaffali del seminterrato, dove l'umidità dell'inverno scorso ha rovinato alcune raccolte di giornali d'epoca.",
    "Un restauratore di Bologna ha offerto il suo aiuto per recuperare le pagine più danneggiate, asciugandole una per una con pazienza.",
    "Gli orari resteranno quelli di prima: dalle nove all'una e dalle tre alle sette, con un'apertura serale il mercoledì fino alle dieci.",
    "Il prestito digitale, attivato durante la chiusura, continuerà anche dopo, perché molti lettori si sono abituati a leggere sul telefono.",
    "Infine, il comitato chiede a chi possiede vecchie cartoline del paese di portarle in visione, per allestire una mostra in autunno.",
];

/// The `i`-th prompt: sentences from `i` on, in a rotating order, until
/// the text is 800–1,100 characters; each prompt differs from the others.
fn prosa(i: usize) -> String {
    let mut text = format!("Riassumi in poche righe questo avviso (numero {i}). ");
    let mut k = i;
    while text.chars().count() < 800 {
        text.push_str(FRASI[k % FRASI.len()]);
        text.push(' ');
        k += 1 + i % 3;
    }
    let len = text.chars().count();
    assert!((800..=1_100).contains(&len), "prompt {i}: {len} characters");
    text
}

/// The repro, as a test: the free key (hard 5,000 tokens a day)
/// sends Italian prose of 800–1,100 characters, half of it streamed, two
/// at a time, until the budget refuses. Against the server's own counts
/// (its `usage`, each answer's), what it charged never passes 5,000, and
/// sluice's own counters charged exactly that. After the first refusal
/// the caller tries the same prose on another listed model, as an attacker
/// would: a reservation must cover what the server can charge there too.
///
/// Before issue 48 item 1 every reservation it prints is 8–38 % below
/// what the server charged (the estimate undercounts SmolLM2's Italian,
/// see bench/ESTIMATOR.md): the pairs alone happened to stop 215 tokens
/// short (13 admitted, 4,785), a remainder the next reservation did not
/// fit; the other model's uncorrected estimate fits it (reserved 201 for
/// 336): 5,121 charged on 5,000.
#[test]
fn the_free_keys_hard_budget_holds_against_llamacpps_own_counts() {
    let Some(server) = require("the_free_keys_hard_budget_holds_against_llamacpps_own_counts")
    else {
        return;
    };
    const BUDGET: u64 = 5_000;
    let started = Instant::now();
    let real = Real::start(server, |cfg| {
        let free = &cfg.policy_mut()["tiers"]["free"]["daily_tokens"];
        assert_eq!(
            free.as_u64(),
            Some(BUDGET),
            "the shipped free tier: {free:?}"
        );
        shipped_policy_without_rate_limits(cfg);
    });
    let key = [("x-api-key", FREE_KEY)];
    let mut used = 0;
    let mut admitted = 0;
    let mut streamed = 0;
    let mut refused = None;
    let mut next = 0;
    'rounds: while refused.is_none() {
        assert!(next < 60, "the budget never ran out ({used} used)");
        // Two at once: one plain, one streamed (with the usage chunk, so
        // the server's count of it is known here).
        let bodies: Vec<(bool, Json)> = (0..2)
            .map(|j| {
                let stream = j == 1;
                let mut extra = json!({"max_tokens": 32});
                if stream {
                    extra["stream"] = true.into();
                    extra["stream_options"] = json!({"include_usage": true});
                }
                (stream, chat(&prosa(next + j), extra))
            })
            .collect();
        next += 2;
        let answers: Vec<(bool, Response)> = std::thread::scope(|s| {
            let handles: Vec<_> = bodies
                .iter()
                .map(|(stream, body)| {
                    let real = &real;
                    let key = &key;
                    s.spawn(move || (*stream, real.post("/v1/chat/completions", key, body)))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("request thread"))
                .collect()
        });
        for (stream, resp) in answers {
            match resp.status {
                200 => {
                    let (input, output) = usage_of(&resp);
                    assert!(output <= 32, "{}", resp.body);
                    used += input + output;
                    admitted += 1;
                    streamed += usize::from(stream);
                }
                429 => {
                    assert_eq!(
                        resp.header("x-sluice-reason"),
                        Some("daily_budget_exceeded"),
                        "{resp:?}"
                    );
                    refused = Some(resp);
                }
                other => panic!("unexpected {other}: {resp:?}"),
            }
        }
        if refused.is_some() {
            break 'rounds;
        }
    }
    // Then the caller's last try, as an attacker would make it: the same
    // prose on another model the policy lists (one budget for the key),
    // whose correction has learnt nothing yet, so its reservation is the
    // raw estimate, a third under this server's count of Italian.
    let mut tail = 0;
    for i in 0..3 {
        let mut body = chat(&prosa(100 + i), json!({"max_tokens": 8}));
        body["model"] = OTHER_MODEL.into();
        let resp = real.post("/v1/chat/completions", &key, &body);
        match resp.status {
            200 => {
                let (input, output) = usage_of(&resp);
                used += input + output;
                admitted += 1;
                tail += 1;
            }
            429 => break,
            other => panic!("unexpected {other}: {resp:?}"),
        }
    }
    real.envoy
        .assert_no_reservation_left(Duration::from_secs(20));
    // What each admitted request reserved against what it cost, for the
    // record (the reservation is what bounds an overshoot).
    for line in real
        .envoy
        .flushed_audit_log(admitted + 1)
        .iter()
        .filter(|l| l["decision"] == "admit")
    {
        println!(
            "reserved {} for input {} + output {}",
            line["tokens_estimated"], line["tokens_input"], line["tokens_output"]
        );
    }
    let charged = real.envoy.settled_tokens("input") + real.envoy.settled_tokens("output");
    println!(
        "free key, hard {BUDGET}: {admitted} admitted ({streamed} streamed, {tail} on \
         {OTHER_MODEL} after the first refusal), llama.cpp counted {used}, sluice charged \
         {charged}, in {:?}",
        started.elapsed()
    );
    assert_eq!(charged, used, "sluice charged what the server reported");
    assert!(
        used <= BUDGET,
        "overshoot: the server counted {used} on a hard {BUDGET}"
    );
    assert!(
        admitted >= 4 && streamed >= 2,
        "too few requests to mean anything"
    );
}

// ---------------------------------------------------------------------------
// 4. The sidecar's llamacpp source, against this server's /metrics
// ---------------------------------------------------------------------------

/// The sidecar scrapes the server's `/metrics` as a `llamacpp` backend:
/// it is up, its queue (`requests_deferred`) and running requests
/// (`requests_processing`) are the breaker's `vllm_waiting` and
/// `vllm_running`, and a queue rule opens the backend's breaker under real
/// load and closes it when the queue drains.
#[test]
fn the_sidecar_reads_llamacpps_queue_and_opens_a_breaker_on_it() {
    let Some(server) = require("the_sidecar_reads_llamacpps_queue") else {
        return;
    };
    let started = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("sluice-llamacpp-sidecar-")
        .tempdir()
        .expect("temp dir");
    // Other tests share the server with at most 3 requests at once (a
    // deferred of 1); this test's 6 requests make at least 4 wait.
    let config = format!(
        "scrape_interval: 100ms\n\
         sources:\n  gpu: none\n  llamacpp:\n    - {{ name: smol, url: \"{}\" }}\n\
         rules:\n  - {{ metric: vllm_waiting, open_at: 3, close_below: 2, open_for: 0s, close_after: 500ms }}\n\
         breaker: {{ half_open_fraction: 0.5, half_open_for: 1s }}\n",
        server.url("")
    );
    fs::write(dir.path().join("sidecar.yaml"), config).expect("sidecar config");
    let cfg_file = dir.path().join("sidecar.yaml").display().to_string();
    let state_file = dir.path().join("state.json").display().to_string();
    let sidecar = Sidecar::start_with_args(&["--config", &cfg_file, "--state-file", &state_file]);
    let metric = |name: &str| {
        let text = get(&sidecar.url("/metrics"), &[]).ok().body;
        prometheus_value(&text, name, &[("backend", "smol")])
    };
    assert!(
        wait_for(Duration::from_secs(10), || {
            metric("sluice_sidecar_backend_up") == Some(1.0)
                && metric("sluice_sidecar_vllm_requests_waiting").is_some()
                && metric("sluice_sidecar_vllm_requests_running").is_some()
        }),
        "the llamacpp backend is not up with its gauges:\n{}",
        get(&sidecar.url("/metrics"), &[]).ok().body
    );
    let breaker = || -> Option<String> {
        let state = get(&sidecar.url("/v1/state"), &[]).ok().json();
        state["breakers"]
            .as_array()?
            .iter()
            .find(|b| b["scope"] == "backend:smol")
            .and_then(|b| b["state"].as_str().map(String::from))
    };

    // Six requests straight at the server: two decode, four wait.
    let load = std::thread::scope(|s| {
        let streams: Vec<_> = (0..6)
            .map(|i| {
                let url = server.url("/v1/chat/completions");
                s.spawn(move || {
                    let body = chat(&format!("{STORY} Chapter {i}."), json!({"max_tokens": 16}));
                    post_json(&url, &[], &body).status
                })
            })
            .collect();
        let mut seen_deferred = 0.0_f64;
        let opened = wait_for(Duration::from_secs(60), || {
            let deferred = prometheus_value(&server.metrics(), "llamacpp:requests_deferred", &[]);
            seen_deferred = seen_deferred.max(deferred.unwrap_or(0.0));
            breaker().as_deref() == Some("open")
        });
        let waiting = metric("sluice_sidecar_vllm_requests_waiting");
        let statuses: Vec<u16> = streams
            .into_iter()
            .map(|h| h.join().expect("stream"))
            .collect();
        (opened, seen_deferred, waiting, statuses)
    });
    let (opened, seen_deferred, waiting, statuses) = load;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(
        opened,
        "the breaker of backend:smol never opened (the server showed at most \
         {seen_deferred} deferred; the sidecar said {waiting:?}):\n{}",
        sidecar.log()
    );
    assert!(
        seen_deferred >= 3.0,
        "the server itself showed {seen_deferred} deferred"
    );
    // The queue drained: the breaker closes on fresh readings.
    assert!(
        wait_for(Duration::from_secs(90), || breaker().is_none()),
        "the breaker stayed {:?} after the load",
        breaker()
    );
    println!("sidecar llamacpp source: {:?}", started.elapsed());
}
