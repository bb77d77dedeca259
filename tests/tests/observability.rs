//! Observability and audit against a real Envoy (docs/src/design.md, "Observability and
//! audit"; issue 5): after a scripted mix of admitted, refused, degraded, streamed
//! and rerouted requests the labeled counters and the latency histograms hold exactly
//! what was sent; the access log has one JSON line per request with the
//! audit fields and no API key, JWT or prompt in it; the global anomaly
//! breaker opens at the spend ceiling with 503 `global_breaker_open`; and
//! every metric the alert rules and the dashboard in `envoy/` use is
//! exported by Envoy or the sidecar.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the counters
//! and the audit are sluice's, whatever server answers.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value as Json};
use serde_yaml::Value;
use sha2::{Digest, Sha256};
use sluice_tests::jwt::{self, fresh_key, jwks};
use sluice_tests::{
    chat_request, closed_addr, get, post_json, prometheus_value, repo_root, request, wait_for,
    EnvoyConfig, MockLlm, Sidecar, Stack,
};

const BIG: &str = "llama3.1:70b";
const SMALL: &str = "llama3.1:8b";
const MISTRAL: &str = "mistral:7b";
const ADMIN_TOKEN: &str = "observability-test-admin-token-0123456789";

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A compact HS256 JWT for `sub` in `tier`, issued by the demo issuer.
fn mint(key: &[u8], sub: &str, tier: &str) -> String {
    jwt::mint(key, &jwt::claims(sub, tier))
}

fn set(cfg: &mut EnvoyConfig, path: &[&str], yaml: &str) {
    let mut v = cfg.policy_mut();
    for key in path {
        v = &mut v[*key];
    }
    *v = serde_yaml::from_str(yaml).expect("YAML literal");
}

/// The audit log once Envoy has written `n` lines. Envoy flushes file
/// access logs every 10 s; `POST /reopen_logs` flushes them now.
fn audit_lines(stack: &Stack, n: usize) -> Vec<Json> {
    let mut lines = Vec::new();
    let complete = wait_for(Duration::from_secs(10), || {
        request("POST", &stack.envoy.admin_url("/reopen_logs"), &[], None)
            .expect("admin reachable")
            .ok();
        lines = stack.envoy.audit_log();
        lines.len() >= n
    });
    assert!(
        complete,
        "expected {n} audit lines, found {}: {lines:#?}",
        lines.len()
    );
    assert_eq!(lines.len(), n, "one line per request: {lines:#?}");
    lines
}

fn audit_text(stack: &Stack) -> String {
    fs::read_to_string(stack.envoy.dir().join("audit.jsonl")).expect("audit log exists")
}

fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> u64 {
    prometheus_value(text, name, labels).unwrap_or(0.0) as u64
}

fn num(v: &Json) -> u64 {
    match v {
        Json::Number(n) => n.as_u64().unwrap_or_else(|| panic!("{v} is not a count")),
        Json::String(s) => s.parse().unwrap_or_else(|_| panic!("{v} is not a count")),
        _ => panic!("{v} is not a count"),
    }
}

fn str_of(v: &Json) -> Option<&str> {
    v.as_str()
}

/// Fields every audit line carries (null when they do not apply).
const AUDIT_FIELDS: &[&str] = &[
    "time",
    "principal",
    "tier",
    "route",
    "model_requested",
    "model_served",
    "decision",
    "reason",
    "tokens_estimated",
    "tokens_input",
    "tokens_output",
    "cost_micros",
    "latency_ms",
    "status",
];

// ---------------------------------------------------------------------------
// The scripted mix
// ---------------------------------------------------------------------------

#[test]
fn a_scripted_mix_is_counted_exactly_and_audited_without_secrets() {
    let key = fresh_key();
    let jwt = mint(&key, "audit-alice", "enterprise");
    let bearer = format!("Bearer {jwt}");
    let bogus_key = format!("sk-bogus-{}", nanos());
    let canary = format!("PROMPT-CANARY-{}", nanos());
    let stack = Stack::start(|cfg| {
        cfg.set_jwks_inline(jwks(&key));
        // Small limits so every refusal takes a request or two.
        set(cfg, &["tiers", "free", "requests"], "3/min");
        // Room for a request at its input's bound (about 110), not for
        // the long prompt below.
        set(cfg, &["tiers", "free", "daily_tokens"], "300");
        set(
            cfg,
            &["tiers", "pro", "daily_tokens"],
            "{limit: 1, mode: soft}",
        );
        set(cfg, &["models", BIG, "requests"], "2/min");
    });

    let prompt = |n: usize| format!("{canary} question {n}");
    let mut i = 0;
    let mut next = || {
        i += 1;
        prompt(i)
    };
    let free_key = [("x-api-key", "demo-free-key")];
    let pro_key = [("x-api-key", "demo-pro-key")];
    let ent_key = [("x-api-key", "demo-enterprise-key")];
    let jwt_auth = [("authorization", bearer.as_str())];
    let bogus = [("x-api-key", bogus_key.as_str())];
    let mut statuses = Vec::new();
    let mut prompts_admitted = Vec::new();

    // Anonymous (free by address): 3 admitted, the 4th over tier free's 3/min.
    for _ in 0..4 {
        let p = next();
        let r = stack
            .envoy
            .client()
            .chat(&[], &chat_request(SMALL, &p, Some(4), false));
        if r.status == 200 {
            prompts_admitted.push(p);
        }
        statuses.push(("anonymous", r.status));
    }
    // demo-free-key: a prompt far beyond its 300-token daily budget.
    let long = format!("{} {}", next(), "lorem ipsum ".repeat(200));
    let r = stack
        .envoy
        .client()
        .chat(&free_key, &chat_request(SMALL, &long, Some(4), false));
    assert_eq!(r.header("x-sluice-reason"), Some("daily_budget_exceeded"));
    statuses.push(("budget", r.status));
    // Enterprise key on llama3.1:70b (2/min for everyone): 2 admitted, 1 refused.
    for _ in 0..3 {
        let p = next();
        let r = stack
            .envoy
            .client()
            .chat(&ent_key, &chat_request(BIG, &p, Some(4), false));
        if r.status == 200 {
            prompts_admitted.push(p);
        }
        statuses.push(("model", r.status));
    }
    // Pro key over its soft budget: llama3.1:70b is downshifted to 8b.
    let p = next();
    let r = stack
        .envoy
        .client()
        .chat(&pro_key, &chat_request(BIG, &p, Some(4), false));
    assert_eq!(r.header("x-sluice-degraded"), Some("downshift"), "{r:?}");
    prompts_admitted.push(p);
    statuses.push(("downshift", r.status));
    // Pro key, streamed (SSE), a model without a cheaper one.
    let p = next();
    let r = stack
        .envoy
        .client()
        .chat(&pro_key, &chat_request(MISTRAL, &p, Some(4), true));
    assert!(r.body.contains("data: [DONE]"), "{r:?}");
    prompts_admitted.push(p);
    statuses.push(("stream", r.status));
    // A verified JWT (enterprise).
    let p = next();
    let r = stack
        .envoy
        .client()
        .chat(&jwt_auth, &chat_request(SMALL, &p, Some(4), false));
    prompts_admitted.push(p);
    statuses.push(("jwt", r.status));
    // An unknown API key.
    let r = stack
        .envoy
        .client()
        .chat(&bogus, &chat_request(SMALL, &next(), Some(4), false));
    statuses.push(("bogus key", r.status));

    let codes: Vec<u16> = statuses.iter().map(|s| s.1).collect();
    assert_eq!(
        codes,
        [200, 200, 200, 429, 429, 200, 200, 429, 200, 200, 200, 401],
        "{statuses:?}"
    );
    let total = codes.len();
    let admitted = codes.iter().filter(|c| **c == 200).count();
    assert_eq!(stack.upstream_requests(), admitted as u64);

    // --- metrics ----------------------------------------------------------
    // Histograms reach /stats/prometheus at Envoy's next stats flush (5 s).
    let expected_ttft: [(&str, u64); 3] = [(SMALL, 5), (BIG, 2), (MISTRAL, 1)];
    let mut text = String::new();
    let flushed = wait_for(Duration::from_secs(12), || {
        text = stack.envoy.stats_prometheus();
        expected_ttft.iter().all(|(m, n)| {
            metric(&text, "sluice_ttft_milliseconds_count", &[("model", m)]) == *n
                && metric(&text, "sluice_e2e_milliseconds_count", &[("model", m)]) == *n
        })
    });
    let sluice_lines = || {
        text.lines()
            .filter(|l| l.starts_with("sluice_"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(flushed, "histogram counts per model:\n{}", sluice_lines());
    // Buckets for LLM latencies: 10 ms … 120 s.
    let bucket = |le: &str| {
        let labels = [("model", SMALL), ("le", le)];
        prometheus_value(&text, "sluice_ttft_milliseconds_bucket", &labels)
    };
    assert!(bucket("10").is_some(), "{}", sluice_lines());
    for le in ["20000", "120000", "+Inf"] {
        assert_eq!(bucket(le), Some(5.0), "le={le}:\n{}", sluice_lines());
    }
    assert_eq!(
        prometheus_value(
            &text,
            "sluice_e2e_milliseconds_bucket",
            &[("model", SMALL), ("le", "3600000")]
        ),
        None,
        "Envoy's default buckets instead of sluice's"
    );

    let requests = |d: &str, r: &str, t: &str, m: &str| {
        let labels = [("decision", d), ("reason", r), ("tier", t), ("model", m)];
        metric(&text, "sluice_requests_total", &labels)
    };
    let expected_requests = [
        (("admit", "none", "free", SMALL), 3),
        (("refuse", "user_rate_limit", "free", SMALL), 1),
        (("refuse", "daily_budget_exceeded", "free", SMALL), 1),
        (("admit", "none", "enterprise", BIG), 2),
        (("refuse", "model_rate_limit", "enterprise", BIG), 1),
        (("admit", "none", "pro", SMALL), 1),
        (("admit", "none", "pro", MISTRAL), 1),
        (("admit", "none", "enterprise", SMALL), 1),
        (("refuse", "unauthenticated", "free", "none"), 1),
    ];
    for ((d, r, t, m), n) in expected_requests {
        assert_eq!(
            requests(d, r, t, m),
            n,
            "sluice_requests_total{{decision={d},reason={r},tier={t},model={m}}}:\n{}",
            sluice_lines()
        );
    }
    assert_eq!(metric(&text, "sluice_requests_total", &[]), total as u64);

    for (bucket, n) in [
        ("tier/free/requests", 1),
        ("tier/free/daily_tokens", 1),
        (&format!("model/{BIG}/requests")[..], 1),
        ("tier/pro/requests", 0),
    ] {
        assert_eq!(
            prometheus_value(&text, "sluice_refusals_total", &[("bucket", bucket)]),
            Some(n as f64),
            "sluice_refusals_total{{bucket={bucket}}} (defined at 0 before any refusal)"
        );
    }
    assert_eq!(metric(&text, "sluice_refusals_total", &[]), 3);
    let downshift = [("kind", "downshift"), ("tier", "pro"), ("model", SMALL)];
    assert_eq!(metric(&text, "sluice_degraded_total", &downshift), 1);
    assert_eq!(metric(&text, "sluice_degraded_total", &[]), 1);
    assert_eq!(
        prometheus_value(&text, "sluice_reservations_outstanding", &[]),
        Some(0.0)
    );
    assert_eq!(
        prometheus_value(&text, "sluice_global_breaker_open", &[]),
        Some(0.0)
    );

    // Tokens: every admitted request asked for 4 output tokens and mock-llm
    // made exactly that many; its input count is ceil(chars / 4).
    let tokens = |direction: &str, kind: &str| {
        let labels = [("direction", direction), ("kind", kind)];
        metric(&text, "sluice_tokens_total", &labels)
    };
    let mock_input: u64 = prompts_admitted
        .iter()
        .map(|p| (p.chars().count() as u64).div_ceil(4))
        .sum();
    assert_eq!(tokens("output", "estimated"), 4 * admitted as u64);
    assert_eq!(tokens("output", "actual"), 4 * admitted as u64);
    assert_eq!(tokens("input", "actual"), mock_input);

    // --- the audit log ----------------------------------------------------
    let lines = audit_lines(&stack, total);
    for line in &lines {
        for field in AUDIT_FIELDS {
            assert!(line.get(*field).is_some(), "no `{field}` in {line}");
        }
        assert_eq!(line["route"], "/v1/chat/completions", "{line}");
        let time = str_of(&line["time"]).unwrap_or_default();
        assert!(
            time.len() == 24 && time.ends_with('Z') && time.as_bytes()[10] == b'T',
            "time {time:?} in {line}"
        );
        assert!(line["latency_ms"].is_u64(), "{line}");
        if line["reason"] != "unauthenticated" {
            let principal = str_of(&line["principal"]).unwrap_or_default();
            assert!(
                principal.len() == 32 && principal.chars().all(|c| c.is_ascii_hexdigit()),
                "principal is not a salted hash: {line}"
            );
        }
        if line["decision"] == "admit" {
            let estimated = num(&line["tokens_estimated"]);
            let (input, output) = (num(&line["tokens_input"]), num(&line["tokens_output"]));
            assert_eq!(output, 4, "{line}");
            assert!(estimated >= 4 && input > 0, "{line}");
            assert!(num(&line["cost_micros"]) > 0 || line["model_served"] == MISTRAL);
            assert_eq!(line["usage_source"], "upstream", "{line}");
            assert!(
                num(&line["ttft_ms"]) <= num(&line["latency_ms"]) + 1,
                "{line}"
            );
            assert_eq!(line["status"], 200);
        } else {
            assert!(line["model_served"].is_null(), "{line}");
            assert!(line["tokens_input"].is_null(), "{line}");
        }
    }
    // One line per request, with the decision each got.
    let summary = |l: &Json| {
        let s = |k: &str| str_of(&l[k]).unwrap_or("-").to_string();
        (
            s("decision"),
            s("reason"),
            s("tier"),
            s("model_requested"),
            s("model_served"),
            s("degraded"),
            s("bucket"),
            l["status"].as_u64().unwrap_or(0),
        )
    };
    let mut got: Vec<_> = lines.iter().map(summary).collect();
    got.sort();
    let row = |d: &str, r: &str, t: &str, req: &str, served: &str, deg: &str, b: &str, st| {
        let s = |x: &str| x.to_string();
        (s(d), s(r), s(t), s(req), s(served), s(deg), s(b), st)
    };
    let big_bucket = format!("model/{BIG}/requests");
    let mut want = vec![
        row("admit", "none", "free", SMALL, SMALL, "-", "-", 200),
        row("admit", "none", "free", SMALL, SMALL, "-", "-", 200),
        row("admit", "none", "free", SMALL, SMALL, "-", "-", 200),
        row(
            "refuse",
            "user_rate_limit",
            "free",
            SMALL,
            "-",
            "-",
            "tier/free/requests",
            429,
        ),
        row(
            "refuse",
            "daily_budget_exceeded",
            "free",
            SMALL,
            "-",
            "-",
            "tier/free/daily_tokens",
            429,
        ),
        row("admit", "none", "enterprise", BIG, BIG, "-", "-", 200),
        row("admit", "none", "enterprise", BIG, BIG, "-", "-", 200),
        row(
            "refuse",
            "model_rate_limit",
            "enterprise",
            BIG,
            "-",
            "-",
            &big_bucket,
            429,
        ),
        row("admit", "none", "pro", BIG, SMALL, "downshift", "-", 200),
        row("admit", "none", "pro", MISTRAL, MISTRAL, "-", "-", 200),
        row("admit", "none", "enterprise", SMALL, SMALL, "-", "-", 200),
        row("refuse", "unauthenticated", "free", "-", "-", "-", "-", 401),
    ];
    want.sort();
    assert_eq!(got, want);

    // The same caller hashes the same; different callers differently.
    let principals = |tier: &str, decision: &str| -> BTreeSet<String> {
        lines
            .iter()
            .filter(|l| l["tier"] == tier && l["decision"] == decision)
            .filter_map(|l| str_of(&l["principal"]).map(str::to_string))
            .collect()
    };
    assert_eq!(principals("free", "admit").len(), 1, "{lines:#?}");
    assert_eq!(principals("enterprise", "admit").len(), 2, "key and JWT");
    let all: BTreeSet<_> = lines
        .iter()
        .filter_map(|l| str_of(&l["principal"]))
        .collect();
    assert_eq!(
        all.len(),
        5,
        "anonymous, free key, enterprise key, pro key, JWT"
    );

    // The audit trail agrees with the counters.
    let sum = |f: &str| -> u64 {
        lines
            .iter()
            .filter(|l| !l[f].is_null())
            .map(|l| num(&l[f]))
            .sum()
    };
    assert_eq!(
        sum("tokens_estimated"),
        tokens("input", "estimated") + tokens("output", "estimated")
    );
    assert_eq!(
        sum("tokens_input") + sum("tokens_output"),
        tokens("input", "actual") + tokens("output", "actual")
    );
    assert_eq!(
        sum("cost_micros"),
        metric(&text, "sluice_spend_micros_total", &[])
    );
    let mut per_tier: BTreeMap<String, u64> = BTreeMap::new();
    for l in lines.iter().filter(|l| l["decision"] == "admit") {
        *per_tier
            .entry(str_of(&l["tier"]).unwrap_or_default().to_string())
            .or_default() += num(&l["tokens_input"]) + num(&l["tokens_output"]);
    }
    for (tier, n) in &per_tier {
        let labels = [("tier", tier.as_str()), ("kind", "actual")];
        assert_eq!(metric(&text, "sluice_tokens_total", &labels), *n, "{tier}");
    }

    // No secret, anywhere in the file.
    let raw = audit_text(&stack);
    let signature = jwt.rsplit('.').next().expect("JWT signature");
    let payload = jwt.split('.').nth(1).expect("JWT payload");
    let secrets = [
        "demo-free-key",
        "demo-pro-key",
        "demo-enterprise-key",
        bogus_key.as_str(),
        jwt.as_str(),
        signature,
        payload,
        "audit-alice",
        canary.as_str(),
        "question",
        "lorem ipsum",
    ];
    for secret in secrets {
        assert!(
            !raw.contains(secret),
            "the audit log contains `{secret}`:\n{raw}"
        );
    }
}

// ---------------------------------------------------------------------------
// The anomaly breaker
// ---------------------------------------------------------------------------

#[test]
fn the_global_breaker_opens_at_the_spend_ceiling_with_503() {
    let stack = Stack::start(|cfg| {
        // 2 000 micro-units an hour: three 1 000-token answers of
        // llama3.1:70b (GPU cost 4.00/h at 1 500 tokens/s) are over it.
        set(cfg, &["anomaly", "max_spend_per_hour"], "0.002");
        set(cfg, &["audit", "hash_bodies"], "true");
    });
    let ent_key = [
        ("x-api-key", "demo-enterprise-key"),
        ("x-mock-output-tokens", "1000"),
    ];
    let text = || stack.envoy.stats_prometheus();
    let spend = || metric(&text(), "sluice_spend_micros_total", &[]);
    assert_eq!(
        prometheus_value(&text(), "sluice_global_breaker_open", &[]),
        Some(0.0)
    );

    let mut admitted = Vec::new();
    let mut spent_before_last = 0;
    let refusal = loop {
        assert!(
            admitted.len() < 5,
            "the breaker never opened; spend {}",
            spend()
        );
        let body = chat_request(BIG, &format!("surge {}", admitted.len()), Some(1000), false);
        let before = spend();
        let r = stack.envoy.client().chat(&ent_key, &body);
        if r.status != 200 {
            break r;
        }
        spent_before_last = before;
        admitted.push((body, r));
    };
    let ceiling = 2_000;
    assert!(
        spend() >= ceiling && spent_before_last < ceiling,
        "admitted while under the ceiling, refused at it: {spent_before_last} then {}",
        spend()
    );
    assert!(admitted.len() >= 2, "{}", admitted.len());

    // 503 with its code, for everyone: another tier and model too.
    let anonymous = stack
        .envoy
        .client()
        .chat(&[], &chat_request(SMALL, "hello", Some(4), false));
    for r in [&refusal, &anonymous] {
        assert_eq!(r.status, 503, "{r:?}");
        assert_eq!(r.header("x-sluice-reason"), Some("global_breaker_open"));
        let retry: u64 = r
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After: {r:?}"));
        assert!((1..=60).contains(&retry), "{retry}");
        assert_eq!(r.json()["error"]["code"], "global_breaker_open", "{r:?}");
    }
    let t = text();
    assert_eq!(
        prometheus_value(&t, "sluice_global_breaker_open", &[]),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &t,
            "sluice_requests_total",
            &[("reason", "global_breaker_open")]
        ),
        2
    );
    assert_eq!(stack.upstream_requests(), admitted.len() as u64);

    // The audit trail: the refusals, and the optional body hashes.
    let lines = audit_lines(&stack, admitted.len() + 2);
    let refused: Vec<_> = lines
        .iter()
        .filter(|l| l["reason"] == "global_breaker_open")
        .collect();
    assert_eq!(refused.len(), 2, "{lines:#?}");
    assert!(refused
        .iter()
        .all(|l| l["decision"] == "refuse" && l["status"] == 503));
    for (body, resp) in &admitted {
        let request_hash = sha256_hex(body.to_string().as_bytes());
        let line = lines
            .iter()
            .find(|l| l["request_sha256"] == request_hash.as_str())
            .unwrap_or_else(|| panic!("no audit line hashes {body}: {lines:#?}"));
        assert_eq!(
            line["response_sha256"],
            sha256_hex(resp.body.as_bytes()).as_str()
        );
        assert_eq!(num(&line["tokens_output"]), 1000, "{line}");
    }
    assert!(!audit_text(&stack).contains("surge 0"));
}

// ---------------------------------------------------------------------------
// The rules and the dashboard name only metrics that exist
// ---------------------------------------------------------------------------

/// `sluice_*` metric names in a PromQL expression.
fn names_in(expr: &str, into: &mut BTreeSet<String>) {
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("sluice_") {
        let start = i + at;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if boundary {
            into.insert(expr[start..end].to_string());
        }
        i = end;
    }
}

/// Every `expr` of the rule file.
fn rule_exprs() -> Vec<String> {
    let path = repo_root().join("envoy/prometheus-rules.yaml");
    let rules: Value = serde_yaml::from_str(&fs::read_to_string(&path).expect("rules file"))
        .expect("rules are YAML");
    let mut exprs = Vec::new();
    for group in rules["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let expr = rule["expr"].as_str().expect("every rule has an expr");
            let name = rule["alert"].as_str().or(rule["record"].as_str());
            assert!(name.is_some(), "rule without a name: {expr}");
            if rule.get("alert").is_some() {
                for a in ["summary", "description"] {
                    assert!(
                        rule["annotations"][a]
                            .as_str()
                            .is_some_and(|s| s.len() > 20),
                        "{name:?} has no useful {a}"
                    );
                }
            }
            exprs.push(expr.to_string());
        }
    }
    exprs
}

/// Every query of the dashboard (panel targets and template variables).
fn dashboard_exprs(dashboard: &Json) -> Vec<String> {
    fn walk(v: &Json, out: &mut Vec<String>) {
        match v {
            Json::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr" | "query" | "definition", Json::String(s)) => out.push(s.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Json::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dashboard, &mut out);
    out
}

/// Sample names and family (`# TYPE`) names of a Prometheus exposition;
/// families only when they have samples.
fn exported(text: &str, samples: &mut BTreeSet<String>, families: &mut BTreeMap<String, String>) {
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                families.insert(name.to_string(), kind.to_string());
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let end = line
                .find(|c: char| c == '{' || c.is_whitespace())
                .unwrap_or(line.len());
            samples.insert(line[..end].to_string());
        }
    }
}

#[test]
fn every_metric_of_the_rules_and_the_dashboard_is_exported() {
    // The dashboard: valid JSON, on a Prometheus datasource variable.
    let path = repo_root().join("envoy/grafana-dashboard.json");
    let dashboard: Json = serde_json::from_str(&fs::read_to_string(&path).expect("dashboard"))
        .expect("the dashboard is valid JSON");
    let vars = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    assert!(
        vars.iter()
            .any(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
        "no Prometheus datasource variable"
    );
    let panels = dashboard["panels"].as_array().expect("panels");
    for p in panels.iter().filter(|p| p["type"] != "row") {
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        assert!(!p["targets"].as_array().expect("targets").is_empty());
    }

    let mut used = BTreeSet::new();
    let (rules, queries) = (rule_exprs(), dashboard_exprs(&dashboard));
    for expr in rules.iter().chain(&queries) {
        names_in(expr, &mut used);
    }
    assert!(used.len() >= 25, "{used:?}");

    // Traffic that makes every labeled series exist: a downshift, a
    // streamed request, the kill switch and a reroute.
    let primary = MockLlm::start("primary");
    let fallback = MockLlm::start("fallback");
    let dir = tempfile::Builder::new()
        .prefix("sluice-observability-")
        .tempdir()
        .expect("temp dir");
    fs::write(dir.path().join("token"), ADMIN_TOKEN).expect("token file");
    let config = format!(
        "scrape_interval: 100ms\n\
         sources:\n  gpu: simulated\n  vllm:\n\
         \x20   - {{ name: primary, url: \"{}\" }}\n\
         \x20   - {{ name: gone, url: \"http://{}\" }}\n\
         cache: {{}}\n",
        primary.url(""),
        closed_addr()
    );
    fs::write(dir.path().join("sidecar.yaml"), config).expect("sidecar config");
    let arg = |name: &str| dir.path().join(name).display().to_string();
    let (cfg_file, token_file, state_file) = (arg("sidecar.yaml"), arg("token"), arg("state.json"));
    let sidecar = Sidecar::start_with_args(&[
        "--simulate",
        "--config",
        &cfg_file,
        "--admin-token-file",
        &token_file,
        "--state-file",
        &state_file,
    ]);
    post_json(
        &sidecar.url("/v1/simulate"),
        &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
        &json!({"gpus": [{"utilization": 42, "memory_used_mb": 1024, "memory_total_mb": 81920,
                          "temperature_c": 55, "power_w": 300}]}),
    )
    .ok();

    let mut cfg = sluice_tests::shipped_config_for(&primary);
    cfg.set_cluster_addr("sluice_sidecar", sidecar.addr());
    cfg.set_cluster_addr("llm_fallback", fallback.addr());
    set(
        &mut cfg,
        &["tiers", "pro", "daily_tokens"],
        "{limit: 1, mode: soft}",
    );
    // The exact cache on mistral (entries in the sidecar above): the cache
    // panels and SluiceCacheHitRateDrop read its series.
    set(
        &mut cfg,
        &["cache"],
        "{salt: observability-cache-salt-0123456789, in_envoy: {slots: 0}, models: {\"mistral:7b\": {exact: true}}}",
    );
    // A team's spend budget: the money panels set spend against it.
    set(&mut cfg, &["teams", "search", "daily_spend"], "10.00");
    let envoy = sluice_tests::Envoy::start(&cfg, 2);
    let stack = Stack {
        envoy,
        upstream: primary,
        config: cfg,
    };
    // A cached answer, first of all (nothing else is stored yet): asked
    // again once the sidecar holds it, a hit (saved tokens, lookups).
    let team = [("x-api-key", "demo-search-key-1")];
    let cached = chat_request(MISTRAL, "what does the cache panel show?", Some(4), false);
    stack.envoy.client().chat(&team, &cached).ok();
    let sidecar_stores = || {
        let t = get(&sidecar.url("/metrics"), &[]).body;
        prometheus_value(
            &t,
            "sluice_sidecar_cache_total",
            &[("result", "store"), ("kind", "exact"), ("model", MISTRAL)],
        )
        .unwrap_or(0.0)
    };
    assert!(
        wait_for(Duration::from_secs(10), || sidecar_stores() >= 1.0),
        "the sidecar never stored the answer:\n{}",
        sidecar.log()
    );
    let r = stack.envoy.client().chat(&team, &cached).ok();
    assert_eq!(r.header("x-sluice-cache"), Some("hit"), "{r:?}");

    let pro = [("x-api-key", "demo-pro-key")];
    let r = stack
        .envoy
        .client()
        .chat(&pro, &chat_request(BIG, "hello", Some(4), false));
    assert_eq!(r.header("x-sluice-degraded"), Some("downshift"), "{r:?}");
    stack
        .envoy
        .client()
        .chat(&pro, &chat_request(MISTRAL, "hello", Some(4), true))
        .ok();
    // A caller of a declared team (the team and org panels read its counter).
    stack
        .envoy
        .client()
        .chat(&team, &chat_request(MISTRAL, "hello", Some(4), false))
        .ok();

    let envoy_metric = |name: &str| stack.envoy.metric(name, &[]).unwrap_or(0.0);
    assert!(
        wait_for(Duration::from_secs(10), || envoy_metric(
            "sluice_sidecar_polls_total"
        ) >= 1.0),
        "Envoy never polled the sidecar:\n{}",
        sidecar.log()
    );
    post_json(
        &sidecar.url("/v1/kill-switch"),
        &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
        &json!({"active": true, "reason": "observability test"}),
    )
    .ok();
    assert!(
        wait_for(Duration::from_secs(10), || envoy_metric(
            "sluice_kill_switch_active"
        ) == 1.0),
        "the kill switch never reached Envoy"
    );
    let r = stack
        .envoy
        .client()
        .chat(&pro, &chat_request(SMALL, "hello", Some(4), false))
        .ok();
    assert_eq!(r.header("x-sluice-kill-switch"), Some("1"), "{r:?}");
    assert_eq!(envoy_metric("sluice_rerouted_total"), 1.0);

    // The sidecar has scraped both backends (one of them is gone).
    let sidecar_text = || get(&sidecar.url("/metrics"), &[]).ok().body;
    assert!(
        wait_for(Duration::from_secs(10), || {
            let t = sidecar_text();
            prometheus_value(&t, "sluice_sidecar_vllm_requests_waiting", &[]).is_some()
                && prometheus_value(&t, "sluice_sidecar_scrape_errors_total", &[])
                    .is_some_and(|n| n > 0.0)
        }),
        "the sidecar never scraped its backends:\n{}\n{}",
        sidecar_text(),
        sidecar.log()
    );

    let mut samples = BTreeSet::new();
    let mut families = BTreeMap::new();
    exported(&stack.envoy.stats_prometheus(), &mut samples, &mut families);
    exported(&sidecar_text(), &mut samples, &mut families);
    // A histogram's _bucket/_sum/_count stand for its family: present when
    // the family is a histogram with samples.
    let histogram = |base: &str| {
        families.get(base).map(String::as_str) == Some("histogram")
            && samples.contains(&format!("{base}_count"))
    };
    let present = |name: &str| {
        samples.contains(name)
            || histogram(name)
            || ["_bucket", "_sum", "_count"]
                .iter()
                .any(|suffix| name.strip_suffix(suffix).is_some_and(histogram))
    };
    // Exported only by a sidecar with a fleet (this one has none); its
    // values are checked against a real Redis in tests/tests/sidecar_faults.rs.
    const FLEET_ONLY: &[&str] = &["sluice_sidecar_redis_up"];
    let missing: Vec<&String> = used
        .iter()
        .filter(|name| !present(name) && !FLEET_ONLY.contains(&name.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "used by envoy/prometheus-rules.yaml or envoy/grafana-dashboard.json but \
         exported by neither Envoy nor the sidecar: {missing:?}"
    );
}
