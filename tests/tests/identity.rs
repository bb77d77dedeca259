//! Identity through a real Envoy (docs/src/design.md, "Identify"): headers a client makes
//! up are never believed, and tiers claimed in a JWT count only once Envoy's own
//! `jwt_authn` has verified the token.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): who the caller
//! is is decided before the upstream.

use sluice_tests::jwt::{b64, claims, fresh_key, jwks, mint};
use sluice_tests::{Response, Stack};

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

    // A token signed with another key: jwt_authn does not verify it, and
    // sluice refuses a bearer JWT without verified claims.
    let forged = bearer(&mint(&fresh_key(), &claims("mallory", "enterprise")));
    assert_invalid_api_key(&stack.chat(MODEL, &[("authorization", &forged)]));
    // Nor does bob's real signature over a payload he rewrote.
    let bob_token = mint(&key, &claims("bob", "platinum"));
    let parts: Vec<&str> = bob_token.split('.').collect();
    let promoted = claims("bob", "enterprise").to_string();
    let tampered = format!("{}.{}.{}", parts[0], b64(promoted.as_bytes()), parts[2]);
    assert_invalid_api_key(&stack.chat(MODEL, &[("authorization", &bearer(&tampered))]));

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
    // 297 left after her third call, or more: 300/min refills 5 a second
    // while bob spends his (however slow the machine), but never fewer.
    let remaining = resp
        .header("x-ratelimit-remaining")
        .and_then(|r| r.parse::<u32>().ok());
    assert!(
        remaining.is_some_and(|r| (297..300).contains(&r)),
        "alice was charged for bob's calls: {resp:?}"
    );
    assert_eq!(stack.upstream_requests(), before + 9 + 1 + 1);
}

#[test]
fn unknown_api_key_gets_401_and_never_reaches_the_upstream() {
    let stack = Stack::start(|_| {});
    let resp = stack.chat(MODEL, &[("x-api-key", "made-up-key")]);
    assert_invalid_api_key(&resp);
    assert!(
        !resp.body.contains("made-up-key"),
        "the answer echoes the key: {}",
        resp.body
    );
    assert_eq!(stack.upstream_requests(), 0);
}

/// A 401 as OpenAI sends it (SDKs raise `AuthenticationError`), from sluice
/// (`x-sluice-reason`), never Envoy's text/plain.
fn assert_invalid_api_key(resp: &Response) {
    assert_eq!(resp.status, 401, "{resp:?}");
    assert_eq!(
        resp.header("content-type"),
        Some("application/json"),
        "{resp:?}"
    );
    assert_eq!(resp.header("x-sluice-reason"), Some("unauthenticated"));
    let body = resp.json();
    let error = &body["error"];
    assert_eq!(error["code"], "invalid_api_key", "{body}");
    assert_eq!(error["type"], "invalid_request_error", "{body}");
    assert!(error["param"].is_null(), "{body}");
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

/// The OpenAI SDKs send `Authorization: Bearer <key>`: the shipped config
/// takes an API key there as in `x-api-key`, a verified JWT there by its
/// claims, and refuses (401 JSON) everything else that claims to be one.
#[test]
fn bearer_api_keys_and_jwts_share_the_authorization_header() {
    let key = fresh_key();
    let stack = Stack::start(|cfg| cfg.set_jwks_inline(jwks(&key)));
    let models =
        |headers: &[(&str, &str)]| sluice_tests::get(&stack.envoy.url("/v1/models"), headers);
    let tier_of = |resp: &Response| {
        assert_eq!(resp.status, 200, "{resp:?}\n{}", stack.envoy.log());
        (
            resp.header("x-ratelimit-limit").map(str::to_string),
            resp.header("x-ratelimit-remaining").map(str::to_string),
        )
    };
    let some = |a: &str, b: &str| (Some(a.to_string()), Some(b.to_string()));

    // One pro key, three spellings, one principal (pro: 60/min).
    let resp = stack.chat(MODEL, &[("authorization", "Bearer demo-pro-key")]);
    assert_eq!(tier_of(&resp), some("60", "59"));
    assert_eq!(
        tier_of(&models(&[("authorization", "bearer demo-pro-key")])),
        some("60", "58")
    );
    assert_eq!(
        tier_of(&models(&[("x-api-key", "demo-pro-key")])),
        some("60", "57")
    );
    // The same key in both places is one credential.
    let both = [
        ("authorization", "Bearer demo-pro-key"),
        ("x-api-key", "demo-pro-key"),
    ];
    assert_eq!(tier_of(&models(&both)), some("60", "56"));
    // x-api-key alone, another tier (free: 10/min).
    assert_eq!(
        tier_of(&models(&[("x-api-key", "demo-free-key")])),
        some("10", "9")
    );

    // A verified JWT: its own tier (enterprise: 300/min).
    let alice = format!("Bearer {}", mint(&key, &claims("alice", "enterprise")));
    assert_eq!(
        tier_of(&models(&[("authorization", &alice)])),
        some("300", "299")
    );
    // `bearer` is common enough for the shipped jwt_authn to read it too;
    // a rarer spelling is not verified by Envoy, so sluice refuses it.
    let lower = alice.replacen("Bearer", "bearer", 1);
    assert_eq!(
        tier_of(&models(&[("authorization", &lower)])),
        some("300", "298")
    );
    let upper = alice.replacen("Bearer", "BEARER", 1);
    assert_invalid_api_key(&models(&[("authorization", &upper)]));

    let before = stack.upstream_requests();
    let expired = {
        let mut c = claims("alice", "enterprise");
        c["exp"] = serde_json::json!(1_000_000_000);
        format!("Bearer {}", mint(&key, &c))
    };
    let other_key = format!(
        "Bearer {}",
        mint(&fresh_key(), &claims("eve", "enterprise"))
    );
    let refused: &[&[(&str, &str)]] = &[
        // An unknown bearer key; a made-up one with the OpenAI prefix.
        &[("authorization", "Bearer demo-platinum-key")],
        &[("authorization", "Bearer sk-proj-0123456789abcdef")],
        // Garbage in the shape of a JWT, and things jwt_authn tries as one.
        &[("authorization", "Bearer abc.def.ghi")],
        &[(
            "authorization",
            "Bearer eyJhbGciOiJub25lIn0.eyJzdWIiOiJldmUiLCJ0aWVyIjoiZW50ZXJwcmlzZSJ9.",
        )],
        &[("authorization", "Bearer demo-pro-key.x")],
        // Signed by another key; expired.
        &[("authorization", &other_key)],
        &[("authorization", &expired)],
        // A bad JWT is not rescued by a good key beside it.
        &[
            ("authorization", &other_key),
            ("x-api-key", "demo-enterprise-key"),
        ],
        // Two different keys, whichever is the good one.
        &[
            ("authorization", "Bearer demo-free-key"),
            ("x-api-key", "demo-enterprise-key"),
        ],
        &[
            ("authorization", "Bearer demo-enterprise-key"),
            ("x-api-key", "made-up"),
        ],
        // A verified JWT and a key: two credentials.
        &[("authorization", &alice), ("x-api-key", "demo-free-key")],
        // A credential header twice (Envoy gives sluice the first; the
        // upstream might read the other), even with one value.
        &[
            ("x-api-key", "demo-free-key"),
            ("x-api-key", "demo-enterprise-key"),
        ],
        &[("x-api-key", "demo-pro-key"), ("x-api-key", "demo-pro-key")],
        &[
            ("authorization", "Bearer demo-free-key"),
            ("authorization", "Bearer demo-enterprise-key"),
        ],
        // Empty credentials are not "no credential".
        &[("authorization", "Bearer")],
        &[("authorization", "Bearer   ")],
    ];
    for headers in refused {
        let resp = stack.chat(MODEL, headers);
        assert_invalid_api_key(&resp);
        for (_, value) in headers.iter() {
            let token = value.trim_start_matches("Bearer").trim();
            assert!(
                token.is_empty() || !resp.body.contains(token),
                "the answer echoes a credential: {}",
                resp.body
            );
        }
    }
    assert_eq!(
        stack.upstream_requests(),
        before,
        "a refused request went upstream"
    );

    // A JWT anywhere but the Authorization header is not read at all: the
    // caller is anonymous (free, by address), however valid the token.
    let token = mint(&key, &claims("alice", "enterprise"));
    let resp = sluice_tests::get(
        &stack.envoy.url(&format!("/v1/models?access_token={token}")),
        &[],
    );
    assert_eq!(tier_of(&resp).0.as_deref(), Some("10"));
}

/// Bytes 0x80–0xFF in a header value pass Envoy's codec. proxy-wasm's
/// string getters unwrap UTF-8, so one such byte in `x-api-key` used to
/// panic the VM of a worker: every later request on it got 503, and as many
/// requests as workers took sluice down. Now such a credential is a bad one.
#[test]
fn non_utf8_credentials_are_refused_without_killing_the_vm() {
    use std::io::{Read, Write};
    let stack = Stack::start(|_| {});
    let raw = |header: &[u8]| {
        let mut req = b"GET /v1/models HTTP/1.1\r\nhost: sluice\r\nconnection: close\r\n".to_vec();
        req.extend_from_slice(header);
        req.extend_from_slice(b"\r\n\r\n");
        let mut conn = std::net::TcpStream::connect(stack.envoy.addr()).unwrap();
        conn.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        conn.write_all(&req).unwrap();
        let mut answer = Vec::new();
        let _ = conn.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    };
    let bad: [&[u8]; 3] = [
        b"x-api-key: demo-pro-key\xff",
        b"authorization: Bearer demo-\xffpro-key",
        b"authorization: Bearer \xc3\x28.\xff.x",
    ];
    // More of each than Envoy has workers.
    for header in bad.iter().cycle().take(9) {
        let answer = raw(header);
        assert!(
            answer.starts_with("HTTP/1.1 401") && answer.contains("invalid_api_key"),
            "{answer}\n{}",
            stack.envoy.log()
        );
    }
    for _ in 0..4 {
        let answer = raw(b"x-api-key: demo-pro-key");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    assert!(
        !stack.envoy.log().contains("panicked"),
        "{}",
        stack.envoy.log()
    );
    assert_eq!(stack.upstream_requests(), 4);
}

/// Two identity providers (two `jwt_authn` providers, each pinned to its
/// issuer) may both have an `alice`: OpenID Connect makes a subject unique
/// only within its issuer. They are two callers: separate request limits,
/// and neither is served the other's cached answer. A token that names no
/// issuer (verified by a provider that pins none) is refused.
#[test]
fn the_same_subject_of_two_issuers_is_two_callers() {
    const ISSUER_B: &str = "https://idp-b.example/realms/b";
    let (key_a, key_b, key_any) = (fresh_key(), fresh_key(), fresh_key());
    let stack = Stack::start(|cfg| {
        let inline = |key: &[u8]| serde_json::json!({"inline_string": jwks(key)});
        let provider = |issuer: Option<&str>, key: &[u8]| {
            let mut p = serde_json::json!({
                "local_jwks": inline(key),
                "from_headers": [{"name": "authorization", "value_prefix": "Bearer "}],
                "forward": true,
                // One metadata key for every provider: sluice reads one.
                "payload_in_metadata": "jwt_payload",
            });
            if let Some(issuer) = issuer {
                p["issuer"] = issuer.into();
            }
            p
        };
        let jwt = serde_json::json!({
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {
                "a": provider(Some("sluice-demo"), &key_a),
                "b": provider(Some(ISSUER_B), &key_b),
                // Pins no issuer: it verifies a token without `iss`.
                "any": provider(None, &key_any),
            },
            "rules": [{"match": {"prefix": "/"}, "requires": {"requires_any": {"requirements": [
                {"provider_name": "a"},
                {"provider_name": "b"},
                {"provider_name": "any"},
                {"allow_missing_or_failed": {}},
            ]}}}],
        });
        cfg.http_filter_mut("envoy.filters.http.jwt_authn")["typed_config"] =
            serde_yaml::to_value(&jwt).unwrap();
        cfg.policy_mut()["cache"] = serde_yaml::to_value(serde_json::json!({
            "salt": "identity-test-salt-0123456789",
            "models": {MODEL: {"exact": true}},
        }))
        .unwrap();
    });
    let bearer = |token: String| format!("Bearer {token}");
    let alice_a = bearer(mint(&key_a, &claims("alice", "free")));
    let mut of_b = claims("alice", "free");
    of_b["iss"] = ISSUER_B.into();
    let alice_b = bearer(mint(&key_b, &of_b));
    let chat = |auth: &str, question: &str| {
        let mut body = sluice_tests::chat_body(MODEL);
        body["messages"] = serde_json::json!([{"role": "user", "content": question}]);
        body["temperature"] = 0.into();
        sluice_tests::post_json(
            &stack.envoy.url("/v1/chat/completions"),
            &[("authorization", auth)],
            &body,
        )
    };

    // alice of A asks; her answer is stored for her.
    let first = chat(&alice_a, "What is on my calendar?");
    assert_eq!(first.status, 200, "{first:?}\n{}", stack.envoy.log());
    assert_eq!(first.header("x-sluice-cache"), Some("miss"), "{first:?}");
    let again = chat(&alice_a, "What is on my calendar?");
    assert_eq!(again.header("x-sluice-cache"), Some("hit"), "{again:?}");
    // alice of B asking the same is not served A's alice's answer.
    let other = chat(&alice_b, "What is on my calendar?");
    assert_eq!(other.status, 200, "{other:?}");
    assert_eq!(
        other.header("x-sluice-cache"),
        Some("miss"),
        "issuer B's alice was served issuer A's alice's answer: {other:?}"
    );

    // alice of A spends her free 10/min (one went on the hit above, one on
    // the first ask); alice of B keeps her own.
    for i in 2..10 {
        let resp = chat(&alice_a, &format!("question {i}"));
        assert_eq!(resp.status, 200, "alice of A, call {i}: {resp:?}");
    }
    let resp = chat(&alice_a, "one too many");
    assert_eq!(resp.status, 429, "{resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), Some("user_rate_limit"));
    let resp = chat(&alice_b, "still mine?");
    assert_eq!(
        resp.status, 200,
        "alice of B shares A's alice's limit: {resp:?}"
    );
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("8"), "{resp:?}");

    // Verified by the provider that pins no issuer, but naming none.
    let mut anonymous = claims("alice", "free");
    anonymous.as_object_mut().unwrap().remove("iss");
    let resp = chat(&bearer(mint(&key_any, &anonymous)), "who am I?");
    assert_invalid_api_key(&resp);
    // The same provider with an issuer in the token: a caller again.
    let mut named = claims("alice", "free");
    named["iss"] = "https://idp-c.example".into();
    let resp = chat(&bearer(mint(&key_any, &named)), "who am I?");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("9"), "{resp:?}");
}

/// On an IPv6 listener an IPv6 client is one caller per `/64` (what a
/// provider hands one subscriber): two addresses of one `/64` share one
/// request limit and one cache scope; the next `/64` is someone else. An
/// IPv4 address mapped into IPv6 is that IPv4 address. Addresses come from
/// `x-forwarded-for` behind one trusted hop (loopback has one IPv6 address).
#[test]
fn an_ipv6_caller_is_its_64_on_an_ipv6_listener() {
    let stack = Stack::start(|cfg| {
        cfg.listener_mut()["address"]["socket_address"]["address"] = "::1".into();
        cfg.hcm_mut()["xff_num_trusted_hops"] = 1.into();
        cfg.policy_mut()["cache"] = serde_yaml::to_value(serde_json::json!({
            "salt": "identity-test-salt-0123456789",
            "models": {MODEL: {"exact": true}},
        }))
        .unwrap();
    });
    assert!(stack.envoy.addr().is_ipv6(), "{}", stack.envoy.addr());
    let chat = |from: &str, question: &str| {
        let mut body = sluice_tests::chat_body(MODEL);
        body["messages"] = serde_json::json!([{"role": "user", "content": question}]);
        body["temperature"] = 0.into();
        sluice_tests::post_json(
            &stack.envoy.url("/v1/chat/completions"),
            &[("x-forwarded-for", from)],
            &body,
        )
    };
    let (one, same_64, next_64) = (
        "2001:db8:1:2::1",
        "2001:db8:1:2:ffff:ffff:ffff:fffe",
        "2001:db8:1:3::1",
    );

    // One cache scope: the other address of the /64 hits the first's entry.
    let first = chat(one, "Which /64 am I?");
    assert_eq!(first.status, 200, "{first:?}\n{}", stack.envoy.log());
    assert_eq!(first.header("x-sluice-cache"), Some("miss"));
    let hit = chat(same_64, "Which /64 am I?");
    assert_eq!(hit.header("x-sluice-cache"), Some("hit"), "{hit:?}");
    let other = chat(next_64, "Which /64 am I?");
    assert_eq!(other.header("x-sluice-cache"), Some("miss"), "{other:?}");
    assert_eq!(
        other.header("x-ratelimit-remaining"),
        Some("9"),
        "{other:?}"
    );

    // One bucket: the free tier's 10/min for both addresses together.
    for i in 2..10 {
        let from = if i % 2 == 0 { one } else { same_64 };
        let resp = chat(from, &format!("question {i}"));
        assert_eq!(resp.status, 200, "call {i} from {from}: {resp:?}");
        assert_eq!(
            resp.header("x-ratelimit-remaining"),
            Some((9 - i).to_string().as_str()),
            "call {i} from {from}: {resp:?}"
        );
    }
    let resp = chat(same_64, "an eleventh from the /64");
    assert_eq!(resp.status, 429, "a /64 got more than 10/min: {resp:?}");
    assert_eq!(resp.header("x-sluice-reason"), Some("user_rate_limit"));
    let resp = chat("2001:db8:1:2:1234::1", "and another address of it");
    assert_eq!(resp.status, 429, "{resp:?}");
    // The next /64 still has its own.
    let resp = chat(next_64, "still mine");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("8"), "{resp:?}");

    // IPv4 mapped into IPv6 is the IPv4 address: one caller.
    let resp = chat("10.9.8.7", "v4");
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("9"), "{resp:?}");
    let resp = chat("::ffff:10.9.8.7", "v4 mapped");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.header("x-ratelimit-remaining"), Some("8"), "{resp:?}");
}
