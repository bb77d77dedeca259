//! Identity through a real Envoy (SPEC §2.1): headers a client makes up are
//! never believed, and tiers claimed in a JWT count only once Envoy's own
//! `jwt_authn` has verified the token.

use sluice_tests::jwt::{b64, claims, fresh_key, jwks, mint};
use sluice_tests::Stack;

const MODEL: &str = "llama3.1:8b";

#[test]
fn forged_identity_headers_are_ignored() {
    let stack = Stack::start(|_| {});
    let forged = [
        ("x-sluice-user", "ceo"),
        ("x-sluice-tier", "enterprise"),
        ("x-user-id", "ceo"),
        ("x-tier", "enterprise"),
        ("x-forwarded-for", "1.2.3.4"),
        ("x-real-ip", "1.2.3.4"),
    ];
    // Alternate forged and plain calls: one caller, one bucket of 10.
    let statuses: Vec<u16> = (0..12)
        .map(|i| {
            let headers: &[(&str, &str)] = if i % 2 == 0 { &forged } else { &[] };
            let resp = stack.chat(MODEL, headers);
            if resp.status == 200 {
                assert_eq!(
                    resp.header("x-ratelimit-limit"),
                    Some("10"),
                    "call {i} got another tier: {resp:?}"
                );
            }
            resp.status
        })
        .collect();
    // `x-forwarded-for` is the subtle one: unless the listener's HTTP
    // connection manager sets `use_remote_address: true`, Envoy takes the
    // client address (`source.address`) from that header, and every forged
    // value is a fresh anonymous caller with a fresh budget.
    assert_eq!(statuses[..10], [200; 10], "{statuses:?}");
    assert_eq!(
        statuses[10..],
        [429; 2],
        "forged headers bought more than the free tier's 10 (all: {statuses:?}); \
         does the shipped config set use_remote_address: true?"
    );
    assert_eq!(stack.upstream_requests(), 10);
}

#[test]
fn jwt_tier_is_honoured_only_when_jwt_authn_verified_it() {
    let key = fresh_key();
    let stack = Stack::start(|cfg| cfg.set_jwks_inline(jwks(&key)));
    let bearer = |token: &str| format!("Bearer {token}");

    // A verified enterprise claim: the enterprise tier (300/min).
    let alice = bearer(&mint(&key, &claims("alice", "enterprise")));
    let resp = stack.chat(MODEL, &[("authorization", &alice)]);
    assert_eq!(resp.status, 200, "{resp:?}\n{}", stack.envoy.log());
    assert_eq!(resp.header("x-ratelimit-limit"), Some("200"), "{resp:?}");
    // The model (200/min) is tighter than enterprise (300/min) on a chat
    // call; a GET reads no body, names no model, and shows the tier alone.
    let resp = sluice_tests::get(&stack.envoy.url("/v1/models"), &[("authorization", &alice)]);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-limit"), Some("300"), "{resp:?}");
    assert_eq!(
        resp.header("x-ratelimit-remaining"),
        Some("298"),
        "{resp:?}"
    );

    // A tier nobody configured falls back to the default tier (10/min), for
    // a principal of its own.
    let bob = bearer(&mint(&key, &claims("bob", "platinum")));
    let resp = sluice_tests::get(&stack.envoy.url("/v1/models"), &[("authorization", &bob)]);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-limit"), Some("10"), "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("9"), "{resp:?}");

    // A token signed with another key never reaches sluice: jwt_authn says 401.
    let forged = bearer(&mint(&fresh_key(), &claims("mallory", "enterprise")));
    let resp = stack.chat(MODEL, &[("authorization", &forged)]);
    assert_eq!(resp.status, 401, "{resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), None, "{resp:?}");
    // Nor does bob's real signature over a payload he rewrote.
    let bob_token = mint(&key, &claims("bob", "platinum"));
    let parts: Vec<&str> = bob_token.split('.').collect();
    let promoted = claims("bob", "enterprise").to_string();
    let tampered = format!("{}.{}.{}", parts[0], b64(promoted.as_bytes()), parts[2]);
    let resp = stack.chat(MODEL, &[("authorization", &bearer(&tampered))]);
    assert_eq!(resp.status, 401, "{resp:?}");

    let before = stack.upstream_requests();
    // bob (free by default) uses up his own 10; the anonymous caller from the
    // same address is untouched, and so is alice.
    for i in 1..10 {
        let resp = stack.chat(MODEL, &[("authorization", &bob)]);
        assert_eq!(resp.status, 200, "bob call {i}: {resp:?}");
    }
    let resp = stack.chat(MODEL, &[("authorization", &bob)]);
    assert_eq!(resp.status, 429, "{resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), Some("user_rate_limit"));
    let resp = sluice_tests::get(&stack.envoy.url("/v1/models"), &[]);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-limit"), Some("10"), "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("9"), "{resp:?}");
    let resp = sluice_tests::get(&stack.envoy.url("/v1/models"), &[("authorization", &alice)]);
    assert_eq!(
        resp.header("x-ratelimit-remaining"),
        Some("297"),
        "{resp:?}"
    );
    assert_eq!(stack.upstream_requests(), before + 9 + 1 + 1);
}

#[test]
fn unknown_api_key_gets_401_and_never_reaches_the_upstream() {
    let stack = Stack::start(|_| {});
    let resp = stack.chat(MODEL, &[("x-api-key", "made-up-key")]);
    assert_eq!(resp.status, 401, "{resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), Some("unauthenticated"));
    let body = resp.json();
    assert_eq!(body["error"]["code"], "unauthenticated", "{body}");
    assert!(
        !resp.body.contains("made-up-key"),
        "the answer echoes the key: {body}"
    );
    assert_eq!(stack.upstream_requests(), 0);
}
