//! The ladder through the whole request path: the rung a request goes to
//! is chosen before dispatch, so the body is rewritten for it, the client's
//! credentials stay behind and spend is settled at the rung's prices.

use serde_json::{json, Value};

use super::*;
use crate::host::mock::MockHost;
use crate::state::store::SharedStore;

const T0: u64 = 1_700_000_000_000;

fn policy() -> Value {
    json!({
        "default_tier": "t", "tiers": {"t": {"daily_spend": 1_000_000}},
        "models": {"llama3.1:8b": {"price": {"input": "0.05", "output": "0.08"}},
                   "mistral": {}},
        "sidecar": {"cluster": "sluice_sidecar", "poll_wait": "20s", "stale_after": "10s"},
        "providers": {"openai": {
            "models": {"llama3.1:8b": "gpt-4o-mini"},
            "limit_field": "max_completion_tokens",
            "prices": {"gpt-4o-mini": {"input": "0.15", "output": "0.60", "cached_input": "0.075"}},
        }},
        "ladder": ["openai"],
        "static_fallback": {"message": "resting"},
    })
}

fn load(host: &MockHost) -> Poller {
    let mut poller = Poller::new();
    assert!(
        poller.configure(host, policy().to_string().as_bytes()),
        "{:?}",
        host.logs.borrow()
    );
    poller
}

fn publish(host: &MockHost, state: Value) {
    let bytes = crate::admission::route::encode_seen(host.now_ms(), state.to_string().as_bytes());
    host.set(SIDECAR_KEY, &bytes, 0).unwrap();
}

fn post(poller: &Poller, host: &MockHost, model: &str) -> (Request, Action) {
    let body = json!({"model": model, "max_tokens": 50,
                      "messages": [{"role": "user", "content": "hello there"}]})
    .to_string();
    let len = body.len().to_string();
    host.begin(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
            ("authorization", "Bearer sk-the-clients-own"),
            ("x-api-key", "the-clients-own"),
        ],
        body.as_bytes(),
    );
    host.set_prop(&["source", "address"], b"10.0.0.1:1");
    let mut req = poller.request().unwrap();
    assert_eq!(req.on_request_headers(host, false), Action::Pause);
    let action = req.on_request_body(host, body.len(), true);
    (req, action)
}

fn answer(host: &MockHost, req: &mut Request, body: &Value) {
    host.respond(&[(":status", "200"), ("content-type", "application/json")]);
    host.set_prop(&["response", "code_details"], b"via_upstream");
    assert_eq!(req.on_response_headers(host), Action::Continue);
    let body = body.to_string();
    *host.response_body.borrow_mut() = body.as_bytes().to_vec();
    assert_eq!(
        req.on_response_body(host, body.len(), true),
        Action::Continue
    );
    req.on_log(host);
}

/// 1,000 prompt tokens, 400 of them cached, and 200 out: at openai's
/// rates (600 x 0.15 + 400 x 0.075 + 200 x 0.60) / 1M = 240 µ.
fn cached_answer() -> Value {
    json!({"choices": [{"message": {"content": "hi"}}],
           "usage": {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200,
                     "prompt_tokens_details": {"cached_tokens": 400}}})
}

fn sent(host: &MockHost) -> Value {
    serde_json::from_slice(&host.request_body.borrow()).unwrap()
}

#[test]
fn the_kill_switch_sends_the_mapped_model_without_the_clients_key_at_the_providers_price() {
    let host = MockHost::new(T0);
    let poller = load(&host);
    publish(
        &host,
        json!({"version": 2, "kill_switch": {"active": true}}),
    );
    let (mut req, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("openai")
    );
    assert_eq!(
        host.req_header("authorization"),
        None,
        "the client's key stays behind"
    );
    assert_eq!(host.req_header("x-api-key"), None);
    let body = sent(&host);
    assert_eq!(body["model"], "gpt-4o-mini");
    assert_eq!(body["max_completion_tokens"], 50, "its one limit field");
    assert!(body.get("max_tokens").is_none(), "{body}");
    // 1,000 prompt tokens, 400 of them cached, and 200 out, at openai's
    // rates: (600 x 0.15 + 400 x 0.075 + 200 x 0.60) / 1M = 240 µ.
    answer(&host, &mut req, &cached_answer());
    assert_eq!(
        host.resp_header("x-sluice-provider").as_deref(),
        Some("openai")
    );
    assert_eq!(
        host.resp_header("x-sluice-kill-switch").as_deref(),
        Some("1")
    );
    assert_eq!(
        host.metric(crate::host::metrics::SPEND_MICROS.name),
        Some(240)
    );
}

#[test]
fn a_model_no_rung_maps_ends_at_the_static_answer() {
    let host = MockHost::new(T0);
    let poller = load(&host);
    publish(
        &host,
        json!({"version": 2, "kill_switch": {"active": true}}),
    );
    let (_, action) = post(&poller, &host, "mistral");
    assert_eq!(action, Action::Pause);
    let reply = host.last_reply().unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-sluice-degraded"), Some("static"));
    assert_eq!(host.req_header("x-sluice-upstream"), None);
}

#[test]
fn an_open_breaker_sends_the_request_down_the_ladder_too() {
    let host = MockHost::new(T0);
    let poller = load(&host);
    publish(
        &host,
        json!({"version": 2, "kill_switch": {"active": false},
               "breakers": [{"scope": "model:llama3.1:8b", "state": "open",
                             "half_open_fraction": 0.0, "reason": "gpu hot"}]}),
    );
    let (mut req, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("openai")
    );
    assert_eq!(sent(&host)["model"], "gpt-4o-mini");
    answer(
        &host,
        &mut req,
        &json!({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1}}),
    );
    assert_eq!(
        host.resp_header("x-sluice-provider").as_deref(),
        Some("openai")
    );
    assert_eq!(
        host.resp_header("x-sluice-kill-switch"),
        None,
        "no kill switch"
    );
    // `ladder_when_out: false`: the breaker sheds it as without a ladder.
    let mut shedding = policy();
    shedding["ladder_when_out"] = json!(false);
    let mut strict = Poller::new();
    assert!(strict.configure(&host, shedding.to_string().as_bytes()));
    let (_, action) = post(&strict, &host, "llama3.1:8b");
    assert_eq!(action, Action::Pause);
    assert_eq!(
        host.last_reply().unwrap().header("x-sluice-degraded"),
        Some("static")
    );
    // Another model's breaker is closed: it stays on the primary, as sent.
    let (_, action) = post(&poller, &host, "mistral");
    assert_eq!(action, Action::Continue);
    assert_eq!(host.req_header("x-sluice-upstream"), None);
    assert_eq!(
        host.req_header("authorization").as_deref(),
        Some("Bearer sk-the-clients-own")
    );
}

#[test]
fn a_rung_whose_budget_cannot_hold_the_request_is_skipped_for_the_next_then_static() {
    let host = MockHost::new(T0);
    let mut p = policy();
    // 250 µ a day: one request billed 270 µ (1,000 in, 200 out) spends it.
    p["providers"]["openai"]["daily_spend"] = json!({"limit": 0.00025, "alert_at": "50%"});
    p["providers"]["together"] = json!({
        "default_model": "llama-3.1-8b", "daily_spend": 0.00025,
        "prices": {"llama-3.1-8b": {"input": "0.15", "output": "0.60"}},
    });
    p["ladder"] = json!(["openai", "together"]);
    let mut poller = Poller::new();
    assert!(
        poller.configure(&host, p.to_string().as_bytes()),
        "{:?}",
        host.logs.borrow()
    );
    publish(
        &host,
        json!({"version": 2, "kill_switch": {"active": true}}),
    );
    let billed = json!({"choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 200}});
    let (mut req, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("openai")
    );
    answer(&host, &mut req, &billed);
    assert_eq!(host.resp_header("x-sluice-skipped"), None);
    // openai's day is spent: the next rung serves, with its own model.
    let (mut req, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("together")
    );
    assert_eq!(sent(&host)["model"], "llama-3.1-8b");
    answer(&host, &mut req, &billed);
    assert_eq!(
        host.resp_header("x-sluice-provider").as_deref(),
        Some("together")
    );
    assert_eq!(
        host.resp_header("x-sluice-skipped").as_deref(),
        Some("openai=budget")
    );
    // Both spent: the static answer, saying why.
    let (_, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Pause);
    let reply = host.last_reply().unwrap();
    assert_eq!(reply.header("x-sluice-degraded"), Some("static"));
    assert_eq!(
        reply.header("x-sluice-skipped"),
        Some("openai=budget, together=budget")
    );
    let requests = |p: &str, outcome: &str| {
        host.metric(&crate::host::metrics::PROVIDER_REQUESTS.named(&[p, outcome]))
    };
    assert_eq!(requests("openai", "served"), Some(1));
    assert_eq!(requests("openai", "skipped_budget"), Some(2));
    assert_eq!(requests("together", "served"), Some(1));
    assert_eq!(requests("together", "skipped_budget"), Some(1));
    let spend = |p: &str| host.metric(&crate::host::metrics::PROVIDER_SPEND.named(&[p]));
    assert_eq!((spend("openai"), spend("together")), (Some(270), Some(270)));
    // openai's alert_at (50%) fired once in its day, however many requests
    // it skipped since; together has none.
    let alerts = |p: &str| host.metric(&crate::host::metrics::PROVIDER_BUDGET_ALERTS.named(&[p]));
    assert_eq!((alerts("openai"), alerts("together")), (Some(1), None));
    // Nothing is left reserved by the skipped rungs.
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0)
    );
    // The next day the first rung serves again.
    host.advance(86_400_000);
    let (_, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("openai")
    );
    let _ = &mut poller;
}

/// The sidecar reports a rung down (an open `provider:<name>` breaker,
/// from its Envoy cluster's health checks): it is passed over before any
/// request is sent to it, down to the static answer, and serves again once
/// the sidecar says it is back. A stale report is not trusted (fail_open).
#[test]
fn a_rung_the_sidecar_reports_down_is_skipped_before_dispatch() {
    let host = MockHost::new(T0);
    let poller = load(&host);
    let down = |version: u64, open: bool| {
        let breakers = if open {
            json!([{"scope": "provider:openai", "state": "open",
                    "reason": "Envoy health checks: 0 of 1 hosts of llm_fallback healthy"}])
        } else {
            json!([])
        };
        json!({"version": version, "kill_switch": {"active": true}, "breakers": breakers})
    };
    publish(&host, down(2, true));
    let (_, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Pause);
    let reply = host.last_reply().unwrap();
    assert_eq!(reply.header("x-sluice-degraded"), Some("static"));
    assert_eq!(reply.header("x-sluice-skipped"), Some("openai=down"));
    assert_eq!(
        host.metric(&crate::host::metrics::PROVIDER_REQUESTS.named(&["openai", "skipped_down"])),
        Some(1)
    );
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0),
        "nothing reserved for a rung that is down"
    );
    // Back up: the rung serves.
    publish(&host, down(3, false));
    let (_, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.req_header("x-sluice-upstream").as_deref(),
        Some("openai")
    );
    // A report older than stale_after (10 s) is not trusted.
    publish(&host, down(4, true));
    host.advance(11_000);
    let (_, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Continue, "a stale down report fails open");
}

/// A request a rung serves is settled as it was admitted, whatever a
/// reload changes meanwhile: at the rung's prices then (not the new ones,
/// nor the primary's once the provider is gone from the policy), with its
/// reservation given back in full.
#[test]
fn a_reload_while_a_rung_serves_settles_at_the_prices_it_was_admitted_with() {
    let host = MockHost::new(T0);
    let mut poller = load(&host);
    publish(
        &host,
        json!({"version": 2, "kill_switch": {"active": true}}),
    );
    let (mut req, action) = post(&poller, &host, "llama3.1:8b");
    assert_eq!(action, Action::Continue);
    assert_eq!(sent(&host)["model"], "gpt-4o-mini");
    // Reloaded: the provider is gone, and the primary's price doubled.
    let mut changed = policy();
    changed.as_object_mut().unwrap().remove("providers");
    changed.as_object_mut().unwrap().remove("ladder");
    changed["models"]["llama3.1:8b"]["price"] = json!({"input": "0.10", "output": "0.16"});
    assert!(
        poller.configure(&host, changed.to_string().as_bytes()),
        "{:?}",
        host.logs.borrow()
    );
    answer(&host, &mut req, &cached_answer());
    // openai's rates: (600 x 0.15 + 400 x 0.075 + 200 x 0.60) / 1M = 240 µ.
    assert_eq!(
        host.metric(crate::host::metrics::SPEND_MICROS.name),
        Some(240)
    );
    assert_eq!(
        host.metric(&crate::host::metrics::PROVIDER_SPEND.named(&["openai"])),
        Some(240)
    );
    assert_eq!(
        host.metric(crate::host::metrics::RESERVATIONS_OUTSTANDING.name),
        Some(0)
    );
}
