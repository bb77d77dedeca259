//! Fair shares of a shared bucket through a real Envoy (issue 18 item 1,
//! docs/src/limits.md, "Fair shares"): a flood of anonymous callers from distinct
//! addresses takes at most its share of a model's bucket, declared keys
//! still get theirs, an idle share is lent, and what is admitted never
//! passes the bucket, across Envoy's two workers.
//!
//! Distinct callers come from distinct loopback source addresses
//! (127.0.0.0/8): the shipped config resolves the client address from the
//! TCP peer (`use_remote_address: true`, no trusted `x-forwarded-for`).
//! The model's bucket is `{rate: 1/day, burst: 40}`: 40 requests, with a
//! refill too slow to change any count during a test, so every figure
//! below is exact whatever the machine's speed.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): shares of a
//! bucket are sluice's arithmetic, whatever server answers.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use serde_yaml::Value;
use sluice_tests::org::client_from;
use sluice_tests::{chat_body, Response, Stack};

const MODEL: &str = "llama3.1:8b";
const BUCKET: u32 = 40;

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).expect("test policy YAML")
}

/// The shipped policy with a 40-request bucket on the model, and `shares`
/// written on it when given.
fn start(shares: Option<&str>) -> Stack {
    Stack::start(|cfg| {
        let p = cfg.policy_mut();
        p["models"][MODEL]["requests"] = yaml(&format!("{{rate: 1/day, burst: {BUCKET}}}"));
        if let Some(s) = shares {
            p["models"][MODEL]["shares"] = yaml(s);
        }
    })
}

fn chat_with(client: &reqwest::blocking::Client, stack: &Stack, key: Option<&str>) -> Response {
    let mut req = client
        .post(stack.envoy.url("/v1/chat/completions"))
        .json(&chat_body(MODEL));
    if let Some(key) = key {
        req = req.header("x-api-key", key);
    }
    let resp = req.send().expect("POST to Envoy");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.text().unwrap_or_default();
    Response {
        status,
        headers,
        body,
    }
}

/// `addresses` anonymous callers (127.0.1.x, 127.0.2.x, …), `each`
/// requests each, from 8 threads at once. Returns how many were admitted;
/// every refusal must be the model's bucket.
fn flood(stack: &Stack, addresses: u32, each: u32) -> u32 {
    let admitted = Arc::new(AtomicU32::new(0));
    let odd = Arc::new(Mutex::new(Vec::new()));
    thread::scope(|s| {
        for t in 0..8 {
            let (admitted, odd) = (admitted.clone(), odd.clone());
            s.spawn(move || {
                for a in (t..addresses).step_by(8) {
                    let client = client_from(&format!("127.0.{}.{}", 1 + a / 250, 1 + a % 250));
                    for _ in 0..each {
                        let r = chat_with(&client, stack, None);
                        match (r.status, r.header("x-sluice-reason")) {
                            (200, _) => {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                            (429, Some("model_rate_limit")) => {}
                            _ => odd.lock().unwrap().push(format!("{r:?}")),
                        }
                    }
                }
            });
        }
    });
    let odd = odd.lock().unwrap();
    assert!(odd.is_empty(), "unexpected answers: {odd:?}");
    admitted.load(Ordering::Relaxed)
}

/// `n` requests of a declared key: (admitted, refusal reasons).
fn declared(stack: &Stack, key: &str, n: u32) -> (u32, Vec<String>) {
    let client = client_from("127.0.0.1");
    let mut ok = 0;
    let mut reasons = Vec::new();
    for _ in 0..n {
        let r = chat_with(&client, stack, Some(key));
        match r.status {
            200 => ok += 1,
            429 => reasons.push(r.header("x-sluice-reason").unwrap_or("?").to_string()),
            _ => panic!("{key}: {r:?}"),
        }
    }
    (ok, reasons)
}

/// The attack, with no shares written: the shipped policy declares
/// API keys, so anonymous callers together hold at most half of the model.
/// On the old code the flood took all 40 and `demo-free-key` got 0 of 12.
#[test]
fn an_anonymous_flood_leaves_declared_keys_their_share_by_default() {
    let stack = start(None);
    let anonymous = flood(&stack, 200, 2);
    assert_eq!(anonymous, BUCKET / 2, "anonymous: at most 50 % of {BUCKET}");

    // demo-free-key: its own 10/min binds, not the model.
    let (free, reasons) = declared(&stack, "demo-free-key", 12);
    eprintln!(
        "fair shares: after a flood of 400 anonymous requests from 200 addresses \
         (anonymous admitted {anonymous} of {BUCKET}), demo-free-key got {free} of 12 \
         (refused: {reasons:?})"
    );
    assert_eq!(free, 10, "{reasons:?}");
    assert_eq!(reasons, ["user_rate_limit", "user_rate_limit"]);

    // Another declared key takes what is left of the model, then the
    // model's 429: the bucket is never passed.
    let (pro, reasons) = declared(&stack, "demo-pro-key", 12);
    assert_eq!(pro, BUCKET - anonymous - free, "{reasons:?}");
    assert!(
        reasons.iter().all(|r| r == "model_rate_limit"),
        "{reasons:?}"
    );
    assert_eq!(stack.upstream_requests(), u64::from(BUCKET));
}

/// Written shares: `pro` is guaranteed a quarter, `anonymous` holds at
/// most a quarter, and the declared rest (here `enterprise`, no share)
/// borrows everything nobody active has a floor on.
#[test]
fn written_shares_guarantee_a_floor_cap_anonymous_and_lend_the_rest() {
    let stack = start(Some("{pro: 25%, anonymous: 25%}"));
    // pro asks once: it is active, its floor (10) is kept for it.
    assert_eq!(declared(&stack, "demo-pro-key", 1), (1, vec![]));
    let anonymous = flood(&stack, 100, 2);
    assert_eq!(anonymous, BUCKET / 4);
    // enterprise borrows all but pro's unmet floor (9).
    let (enterprise, reasons) = declared(&stack, "demo-enterprise-key", 40);
    assert_eq!(enterprise, BUCKET - 1 - anonymous - 9, "{reasons:?}");
    assert!(
        reasons.iter().all(|r| r == "model_rate_limit"),
        "{reasons:?}"
    );
    // pro still finds its whole floor, then the bucket is full.
    let (pro, reasons) = declared(&stack, "demo-pro-key", 12);
    assert_eq!(pro, 9, "{reasons:?}");
    assert!(
        reasons.iter().all(|r| r == "model_rate_limit"),
        "{reasons:?}"
    );
    assert_eq!(stack.upstream_requests(), u64::from(BUCKET));
}

/// Work-conserving: with only one declared group asking, it uses the whole
/// bucket, whatever the others' floors.
#[test]
fn a_lone_declared_tier_uses_the_whole_bucket() {
    let stack = start(Some("{free: 30%, pro: 30%, anonymous: 30%}"));
    let (got, reasons) = declared(&stack, "demo-enterprise-key", BUCKET + 5);
    assert_eq!(got, BUCKET, "{reasons:?}");
    assert_eq!(reasons, vec!["model_rate_limit"; 5]);
}

/// Attacker's variant: one anonymous request keeps no room back from
/// declared keys (anonymous has a ceiling, not a floor), so the declared
/// rest may still use everything else.
#[test]
fn a_trickle_of_anonymous_requests_holds_nothing_back() {
    let stack = start(None);
    assert_eq!(flood(&stack, 1, 1), 1);
    let (got, reasons) = declared(&stack, "demo-enterprise-key", BUCKET);
    assert_eq!(got, BUCKET - 1, "{reasons:?}");
    assert_eq!(reasons, ["model_rate_limit"]);
}
