//! The cache on the request path, through the mock host: lookup before
//! admission, a hit answered locally at the hit's cost, a miss admitted
//! and its complete answer stored; a timeout is a miss.

use serde_json::{json, Value};

use super::*;
use crate::host::mock::MockHost;

const T0: u64 = 1_700_000_000_000;

fn policy() -> Value {
    json!({
        "default_tier": "t",
        // Room for a few requests at their input's bound (about 70 each).
        "tiers": {"t": {"requests": "3/min", "daily_tokens": "300"}},
        "identity": {"sources": ["client_address"]},
        "sidecar": {"cluster": "sluice_sidecar"},
        // The tier in Envoy off: these tests drive the sidecar's callouts
        // (`tier_*` below drive the tier).
        "cache": {"salt": "s", "in_envoy": {"slots": 0}, "models": {"m": {"exact": true}}},
    })
}

fn tier_policy() -> Value {
    let mut p = policy();
    p["cache"].as_object_mut().unwrap().remove("in_envoy");
    p
}

fn body() -> Value {
    json!({"model": "m", "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "user", "content": "hello"}]})
}

fn start(host: &MockHost, poller: &Poller, addr: &str, b: &Value) -> (Request, Action) {
    let text = b.to_string();
    let len = text.len().to_string();
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
        ],
        text.as_bytes(),
    );
    host.set_prop(&["source", "address"], addr.as_bytes());
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    let action = req.on_request_body(host, text.len(), true);
    (req, action)
}

fn last_post(host: &MockHost) -> (u32, String, Value) {
    let posted = host.posted.borrow();
    let (token, body) = posted.last().unwrap().clone();
    let path = host
        .callouts
        .borrow()
        .iter()
        .find(|c| c.token == token)
        .and_then(|c| {
            c.headers
                .iter()
                .find(|(n, _)| n == ":path")
                .map(|(_, v)| v.clone())
        })
        .unwrap();
    (token, path, serde_json::from_slice(&body).unwrap())
}

fn deliver(host: &MockHost, req: &mut Request, token: u32, status: &str, body: &Value) {
    *host.call_response_headers.borrow_mut() = vec![(":status".into(), status.into())];
    let b = body.to_string().into_bytes();
    let n = b.len();
    *host.call_response_body.borrow_mut() = b;
    req.on_call_response(host, token, n);
}

const STORED: &str = r#"{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;

#[test]
fn a_hit_is_answered_here_and_counts_a_request() {
    let host = MockHost::new(T0);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, policy().to_string().as_bytes()));
    let (mut req, action) = start(&host, &poller, "10.0.0.1", &body());
    assert_eq!(action, Action::Pause, "paused for the lookup");
    let (token, path, lookup) = last_post(&host);
    assert_eq!(path, "/v1/cache/lookup");
    assert_eq!(lookup["key"].as_str().unwrap().len(), 64);
    let hit = json!({"hit": {"kind": "exact", "age_s": 7, "entry": {"body": STORED,
        "prompt_tokens": 5, "completion_tokens": 1, "spend_micros": 250}}});
    deliver(&host, &mut req, token, "200", &hit);
    let reply = host.last_reply().expect("answered by the filter");
    // What it saved, by the caller's tier and the model.
    let saved = |m: &crate::host::metrics::Metric| host.metric(&m.named(&["t", "other"]));
    assert_eq!(saved(&crate::host::metrics::CACHE_SAVED_TOKENS), Some(6));
    assert_eq!(saved(&crate::host::metrics::CACHE_SAVED_SPEND), Some(250));
    assert_eq!(
        host.metric(crate::host::metrics::SPEND_MICROS.name)
            .unwrap_or(0),
        0,
        "the hit is charged nothing"
    );
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-sluice-cache"), Some("hit"));
    assert_eq!(reply.header("age"), Some("7"));
    assert_eq!(String::from_utf8(reply.body.clone()).unwrap(), STORED);
    assert_eq!(
        // `m` is not in the policy's `models`: labelled as any unknown model.
        host.metric("sluice_cache_total_result=hit;.kind=exact;.model=other;"),
        Some(1)
    );
    // It counted a request: two more hits, then the third is refused by
    // the request rate (3/min) although the answer is cached.
    for i in 0..3 {
        let (mut r, _) = start(&host, &poller, "10.0.0.1", &body());
        let (token, _, _) = last_post(&host);
        deliver(&host, &mut r, token, "200", &hit);
        let reply = host.last_reply().unwrap();
        if i < 2 {
            assert_eq!(reply.status, 200);
            assert_eq!(
                saved(&crate::host::metrics::CACHE_SAVED_SPEND),
                Some(250 * (i + 2))
            );
        } else {
            assert_eq!(
                reply.status,
                429,
                "{}",
                String::from_utf8_lossy(&reply.body)
            );
        }
    }
}

#[test]
fn a_miss_is_admitted_and_its_answer_stored() {
    let host = MockHost::new(T0);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, policy().to_string().as_bytes()));
    let (mut req, _) = start(&host, &poller, "10.0.0.2", &body());
    let (token, _, lookup) = last_post(&host);
    let replies = host.replies.borrow().len();
    deliver(&host, &mut req, token, "200", &json!({"hit": null}));
    assert_eq!(host.replies.borrow().len(), replies, "not answered locally");
    assert!(!host.resumed.borrow().is_empty(), "resumed to the upstream");
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    assert_eq!(req.on_response_headers(&host), Action::Continue);
    assert_eq!(host.resp_header("x-sluice-cache").as_deref(), Some("miss"));
    *host.response_body.borrow_mut() = STORED.as_bytes().to_vec();
    req.on_response_body(&host, STORED.len(), true);
    let (_, path, store) = last_post(&host);
    assert_eq!(path, "/v1/cache/store");
    assert_eq!(store["key"], lookup["key"]);
    assert_eq!(store["entry"]["body"], STORED);
    assert_eq!(store["entry"]["completion_tokens"], 1);
    assert_eq!(store["ttl_s"], 86_400);
    // The sidecar's bounds per scope and purges by scope go by the
    // scope's id (hex SHA-256 of the scope value), never its text.
    let scope = store["scope"].as_str().unwrap();
    assert_eq!(scope.len(), 64);
    assert!(scope.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(!store.to_string().contains("10.0.0.2"));
}

#[test]
fn no_answer_is_a_miss_and_errors_are_not_stored() {
    let host = MockHost::new(T0);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, policy().to_string().as_bytes()));
    let (mut req, _) = start(&host, &poller, "10.0.0.3", &body());
    let (token, _, _) = last_post(&host);
    let posts = host.posted.borrow().len();
    // The lookup timed out (Envoy answers the callout without a status).
    *host.call_response_headers.borrow_mut() = vec![];
    *host.call_response_body.borrow_mut() = vec![];
    req.on_call_response(&host, token, 0);
    assert_eq!(
        host.metric("sluice_cache_total_result=timeout;.kind=exact;.model=other;"),
        Some(1)
    );
    host.respond(&[(":status", "500"), ("content-type", "application/json")]);
    req.on_response_headers(&host);
    let err = br#"{"error":{"message":"boom"}}"#;
    *host.response_body.borrow_mut() = err.to_vec();
    req.on_response_body(&host, err.len(), true);
    assert_eq!(host.posted.borrow().len(), posts, "a 500 is never stored");
    // `no-store`: no lookup, no store.
    let text = body().to_string();
    let len = text.len().to_string();
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
            ("cache-control", "no-store"),
        ],
        text.as_bytes(),
    );
    let mut r = poller.request().unwrap();
    r.on_request_headers(&host, false);
    assert_eq!(r.on_request_body(&host, text.len(), true), Action::Continue);
    assert_eq!(host.posted.borrow().len(), posts);
}

#[test]
fn the_policy_section_is_checked() {
    let mut p = policy();
    p["cache"]["models"]["m"]["ttl"] = json!("forever");
    let err = Policy::from_value(p).unwrap_err();
    assert!(err.to_string().contains("cache.models.m.ttl"), "{err}");
    let mut p = policy();
    p.as_object_mut().unwrap().remove("sidecar");
    let err = Policy::from_value(p).unwrap_err();
    assert!(err.to_string().contains("cache"), "{err}");
}

#[test]
fn a_downshifted_answer_is_not_stored_under_the_requested_model() {
    let host = MockHost::new(T0);
    let mut p = policy();
    p["tiers"]["t"] = json!({"requests": "100/min", "daily_tokens": {"limit": 10, "mode": "soft"}});
    p["models"] = json!({"m": {"downshift_to": "small"}, "small": {}});
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let (mut req, _) = start(&host, &poller, "10.0.0.4", &body());
    let (token, _, _) = last_post(&host);
    deliver(&host, &mut req, token, "200", &json!({"hit": null}));
    let sent: Value = serde_json::from_slice(&host.request_body.borrow()).unwrap_or(Value::Null);
    let posts = host.posted.borrow().len();
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    req.on_response_headers(&host);
    *host.response_body.borrow_mut() = STORED.as_bytes().to_vec();
    req.on_response_body(&host, STORED.len(), true);
    assert_eq!(sent["model"], "small", "over the soft cap: downshifted");
    assert_eq!(
        host.posted.borrow().len(),
        posts,
        "the cheaper model's answer is not stored"
    );
}

#[test]
fn hits_charge_tokens_only_when_the_policy_says() {
    let host = MockHost::new(T0);
    let mut p = policy();
    p["tiers"]["t"] = json!({"requests": "100/min", "daily_tokens": "100"});
    p["cache"]["hit_cost"] = json!({"tokens": true});
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let hit = json!({"hit": {"kind": "exact", "age_s": 1, "entry": {"body": STORED,
        "prompt_tokens": 30, "completion_tokens": 30, "spend_micros": 0}}});
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let (mut r, _) = start(&host, &poller, "10.0.0.5", &body());
        let (token, _, _) = last_post(&host);
        deliver(&host, &mut r, token, "200", &hit);
        statuses.push(host.last_reply().unwrap().status);
    }
    // 60 tokens a hit against 100 a day: the second no longer fits.
    assert_eq!(statuses[0], 200);
    assert!(statuses[1..].contains(&429), "{statuses:?}");
}

#[test]
fn a_free_hit_never_drains_a_token_or_spend_budget() {
    // The estimate's floor (one input token) was once reserved and, the
    // hit reporting no input, charged at settle: a token and its spend a
    // hit. Two tokens a day would then hold two hits.
    let host = MockHost::new(T0);
    let mut p = policy();
    p["tiers"]["t"] =
        json!({"requests": "100/min", "daily_tokens": "2", "daily_spend": "0.000002"});
    p["models"] = json!({"m": {"price": {"input": "1", "output": "1"}}});
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let hit = json!({"hit": {"kind": "exact", "age_s": 1, "entry": {"body": STORED,
        "prompt_tokens": 30, "completion_tokens": 30, "spend_micros": 60}}});
    for i in 0..10 {
        let (mut r, _) = start(&host, &poller, "10.0.0.6", &body());
        let (token, _, _) = last_post(&host);
        deliver(&host, &mut r, token, "200", &hit);
        let reply = host.last_reply().unwrap();
        assert_eq!(
            reply.status,
            200,
            "hit {i}: {}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name)
            .unwrap_or(0),
        0
    );
    let saved = host.metric(&crate::host::metrics::CACHE_SAVED_SPEND.named(&["t", "m"]));
    assert_eq!(saved, Some(600));
}

#[test]
fn a_route_rule_caches_models_without_their_own() {
    let host = MockHost::new(T0);
    let mut p = policy();
    p["routes"] = json!([{"name": "chat", "path_prefix": "/v1/chat/", "requests": "100/s"}]);
    p["cache"]["models"] = json!({});
    p["cache"]["routes"] = json!({"chat": {"exact": true}});
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let (_req, action) = start(&host, &poller, "10.0.0.6", &body());
    assert_eq!(action, Action::Pause, "looked up: the route is cached");
    let (_, path, _) = last_post(&host);
    assert_eq!(path, "/v1/cache/lookup");
    p["cache"]["routes"] = json!({"nope": {"exact": true}});
    let err = Policy::from_value(p).unwrap_err();
    assert!(err.to_string().contains("cache.routes.nope"), "{err}");
}

#[test]
fn metric_labels_never_carry_a_model_the_policy_does_not_know() {
    let host = MockHost::new(T0);
    let mut p = policy();
    p["routes"] = json!([{"name": "chat", "path_prefix": "/v1/chat/", "requests": "100/s"}]);
    p["cache"]["routes"] = json!({"chat": {"exact": true}});
    p["models"] = json!({"m": {}});
    p["unlisted_models"] = json!({"price": {"input": 0, "output": 0}});
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    for (i, model) in ["m", "made-up-1", "made-up-2"].iter().enumerate() {
        let mut b = body();
        b["model"] = json!(model);
        let (mut req, action) = start(&host, &poller, &format!("10.0.0.{}", 20 + i), &b);
        assert_eq!(action, Action::Pause);
        let (token, _, _) = last_post(&host);
        deliver(&host, &mut req, token, "200", &json!({"hit": null}));
    }
    assert_eq!(
        host.metric("sluice_cache_total_result=miss;.kind=exact;.model=m;"),
        Some(1)
    );
    assert_eq!(
        host.metric("sluice_cache_total_result=miss;.kind=exact;.model=other;"),
        Some(2)
    );
    assert_eq!(
        host.metric("sluice_cache_total_result=miss;.kind=exact;.model=made-up-1;"),
        None
    );
}

#[test]
fn a_stream_sluice_cut_is_never_stored() {
    let host = MockHost::new(T0);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, policy().to_string().as_bytes()));
    let mut b = body();
    b["stream"] = json!(true);
    b["max_tokens"] = json!(2);
    let (mut req, _) = start(&host, &poller, "10.0.0.30", &b);
    let (token, _, _) = last_post(&host);
    deliver(&host, &mut req, token, "200", &json!({"hit": null}));
    host.respond(&[(":status", "200"), ("content-type", "text/event-stream")]);
    req.on_response_headers(&host);
    let posts = host.posted.borrow().len();
    // The upstream ignores max_tokens: 5 output events for an allowance
    // of 2; sluice ends the client's stream after the second.
    let mut sse = String::new();
    for i in 0..5 {
        sse.push_str(&format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"w{i} \"}},\"finish_reason\":null}}]}}\n\n"
        ));
    }
    sse.push_str("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
    sse.push_str("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":5,\"total_tokens\":10}}\n\ndata: [DONE]\n\n");
    *host.response_body.borrow_mut() = sse.as_bytes().to_vec();
    req.on_response_body(&host, sse.len(), true);
    let sent = String::from_utf8(host.response_body.borrow().clone()).unwrap();
    assert!(!sent.contains("w4"), "the client's stream was cut: {sent}");
    assert_eq!(host.posted.borrow().len(), posts, "nothing stored");
    assert_eq!(
        host.metric("sluice_cache_total_result=skip;.kind=exact;.model=other;"),
        Some(1)
    );
}

#[test]
fn an_answer_under_a_lowered_output_limit_is_not_stored() {
    let host = MockHost::new(T0);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, policy().to_string().as_bytes()));
    // 500 output tokens asked, a 300-token budget: admitted with a lower
    // max_tokens.
    let mut b = body();
    b["max_tokens"] = json!(500);
    let (mut req, _) = start(&host, &poller, "10.0.0.40", &b);
    let (token, _, _) = last_post(&host);
    deliver(&host, &mut req, token, "200", &json!({"hit": null}));
    let sent: Value = serde_json::from_slice(&host.request_body.borrow()).unwrap();
    assert!(
        sent["max_tokens"].as_u64().is_some_and(|m| m < 500),
        "lowered: {sent}"
    );
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    req.on_response_headers(&host);
    let posts = host.posted.borrow().len();
    *host.response_body.borrow_mut() = STORED.as_bytes().to_vec();
    req.on_response_body(&host, STORED.len(), true);
    assert_eq!(host.posted.borrow().len(), posts, "nothing stored");
}

/// The upstream's answer to `req`, complete.
fn answer(host: &MockHost, req: &mut Request) {
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    assert_eq!(req.on_response_headers(host), Action::Continue);
    *host.response_body.borrow_mut() = STORED.as_bytes().to_vec();
    req.on_response_body(host, STORED.len(), true);
}

#[test]
fn tier_in_envoy_a_miss_and_its_store_make_no_callout_and_the_hit_none() {
    let host = MockHost::new(T0);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, tier_policy().to_string().as_bytes()));
    let (mut req, action) = start(&host, &poller, "10.0.0.50", &body());
    assert_eq!(action, Action::Continue, "a miss goes on at once");
    assert!(host.posted.borrow().is_empty(), "no lookup callout");
    answer(&host, &mut req);
    assert_eq!(host.resp_header("x-sluice-cache").as_deref(), Some("miss"));
    assert!(host.posted.borrow().is_empty(), "no store callout");
    assert_eq!(
        host.metric("sluice_cache_total_result=store;.kind=exact;.model=other;"),
        Some(1)
    );
    // The same question: answered by the filter, the same body, a request
    // counted (3/min: the third more is refused although cached).
    for i in 0..3 {
        let (_r, action) = start(&host, &poller, "10.0.0.50", &body());
        assert_eq!(action, Action::Pause);
        let reply = host.last_reply().expect("answered here");
        if i < 2 {
            assert_eq!(reply.status, 200);
            assert_eq!(reply.header("x-sluice-cache"), Some("hit"));
            assert_eq!(String::from_utf8(reply.body.clone()).unwrap(), STORED);
        } else {
            assert_eq!(reply.status, 429);
        }
    }
    assert!(host.posted.borrow().is_empty(), "never a callout");
    // Another caller (scope principal): its own miss.
    let (_r, action) = start(&host, &poller, "10.0.0.51", &body());
    assert_eq!(action, Action::Continue);
}

#[test]
fn tier_in_envoy_is_not_used_for_the_semantic_only_model() {
    let host = MockHost::new(T0);
    let mut p = tier_policy();
    p["cache"]["models"]["m"] = json!({"exact": false, "semantic": true});
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let (mut req, action) = start(&host, &poller, "10.0.0.52", &body());
    assert_eq!(action, Action::Pause, "the sidecar is asked");
    let (token, path, lookup) = last_post(&host);
    assert_eq!(path, "/v1/cache/lookup");
    assert_eq!(
        lookup["exact"], false,
        "its own key must not answer: {lookup}"
    );
    assert_eq!(lookup["semantic"]["text"], "hello");
    deliver(&host, &mut req, token, "200", &json!({"hit": null}));
    answer(&host, &mut req);
    let (_, path, store) = last_post(&host);
    assert_eq!(path, "/v1/cache/store", "stored at the sidecar only");
    assert_eq!(store["semantic"]["text"], "hello");
    let (_r, action) = start(&host, &poller, "10.0.0.52", &body());
    assert_eq!(action, Action::Pause, "asked again: nothing in Envoy");
}

#[test]
fn tier_in_envoy_with_semantic_keeps_the_answer_in_both() {
    let host = MockHost::new(T0);
    let mut p = tier_policy();
    p["cache"]["models"]["m"] = json!({"exact": true, "semantic": true});
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let (mut req, action) = start(&host, &poller, "10.0.0.53", &body());
    assert_eq!(action, Action::Pause, "a tier miss asks the semantic cache");
    let (token, _, lookup) = last_post(&host);
    assert_eq!(lookup.get("exact"), None, "exact: true is the default");
    deliver(&host, &mut req, token, "200", &json!({"hit": null}));
    answer(&host, &mut req);
    let (_, path, _) = last_post(&host);
    assert_eq!(
        path, "/v1/cache/store",
        "the sidecar needs it for paraphrases"
    );
    let posts = host.posted.borrow().len();
    let (_r, action) = start(&host, &poller, "10.0.0.53", &body());
    assert_eq!(action, Action::Pause);
    assert_eq!(
        host.last_reply().unwrap().header("x-sluice-cache"),
        Some("hit")
    );
    assert_eq!(
        host.posted.borrow().len(),
        posts,
        "the exact hit: no callout"
    );
}

#[test]
fn tier_in_envoy_sends_larger_answers_to_the_sidecar() {
    let host = MockHost::new(T0);
    let mut p = tier_policy();
    p["cache"]["in_envoy"] = json!({"max_entry_bytes": 16});
    let mut poller = Poller::new();
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let (mut req, _) = start(&host, &poller, "10.0.0.54", &body());
    assert!(host.posted.borrow().is_empty());
    answer(&host, &mut req);
    let (_, path, store) = last_post(&host);
    assert_eq!(path, "/v1/cache/store");
    assert_eq!(store["entry"]["body"], STORED);
    // Envoy knows it is there: the same question asks the sidecar.
    let (_r, action) = start(&host, &poller, "10.0.0.54", &body());
    assert_eq!(action, Action::Pause);
    let (_, path, lookup) = last_post(&host);
    assert_eq!(path, "/v1/cache/lookup");
    assert_eq!(lookup["key"], store["key"]);
}

#[test]
fn the_cache_secret_is_sent_and_required() {
    let host = MockHost::new(T0);
    let mut p = policy();
    p["cache"]["secret_env"] = json!("SLUICE_CACHE_SECRET");
    let mut poller = Poller::new();
    assert!(
        !poller.configure(&host, p.to_string().as_bytes()),
        "refused without the variable"
    );
    assert!(host
        .logs
        .borrow()
        .iter()
        .any(|(_, m)| m.contains("cache.secret_env")));
    host.env
        .borrow_mut()
        .insert("SLUICE_CACHE_SECRET".into(), "short".into());
    assert!(!poller.configure(&host, p.to_string().as_bytes()));
    host.env.borrow_mut().insert(
        "SLUICE_CACHE_SECRET".into(),
        "0123456789abcdef-cache\n".into(),
    );
    assert!(poller.configure(&host, p.to_string().as_bytes()));
    let (_r, _) = start(&host, &poller, "10.0.0.55", &body());
    let (token, _, _) = last_post(&host);
    let callouts = host.callouts.borrow();
    let c = callouts.iter().find(|c| c.token == token).unwrap();
    let sent = c
        .headers
        .iter()
        .find(|(n, _)| n == "x-sluice-cache-secret")
        .map(|(_, v)| v.as_str());
    assert_eq!(sent, Some("0123456789abcdef-cache"));
}

/// The sidecar's state as its push leaves it for every worker, with the
/// cache generation `g` (a purge moves it).
fn push_generation(host: &MockHost, g: u64) {
    use crate::state::store::SharedStore;
    let json = json!({"version": g, "cache_generation": g}).to_string();
    let value = crate::admission::route::encode_seen(host.now_ms(), json.as_bytes());
    let cas = host.get(SIDECAR_KEY).map_or(0, |(_, c)| c);
    host.set(SIDECAR_KEY, &value, cas).unwrap();
}

#[test]
fn tier_in_envoy_a_purge_is_a_barrier_for_answers_in_flight() {
    let host = MockHost::new(T0);
    let mut poller = Poller::new();
    assert!(poller.configure(&host, tier_policy().to_string().as_bytes()));
    push_generation(&host, 1);
    let (mut req, action) = start(&host, &poller, "10.0.0.60", &body());
    assert_eq!(action, Action::Continue, "a miss");
    // Purged while the answer is on its way: it is stored dead.
    push_generation(&host, 2);
    answer(&host, &mut req);
    let (mut again, action) = start(&host, &poller, "10.0.0.60", &body());
    assert_eq!(
        action,
        Action::Continue,
        "what was in flight at the purge never answers"
    );
    // An answer asked for after the purge is kept and answers.
    answer(&host, &mut again);
    let (_r, action) = start(&host, &poller, "10.0.0.60", &body());
    assert_eq!(action, Action::Pause);
    let reply = host.last_reply().expect("answered here");
    assert_eq!(reply.header("x-sluice-cache"), Some("hit"));
}
