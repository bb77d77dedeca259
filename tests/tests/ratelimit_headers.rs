//! The IETF `RateLimit-Policy` / `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers-11) against a real Envoy: off by
//! default; on (`request.rate_limit_headers.ietf: true`) they name the
//! bucket `X-RateLimit-*` reports by its rule id and agree with it on the
//! same response, admitted or refused; `check-config` refuses a bad value
//! with its field path.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the fields are
//! sluice's answer, whatever server is behind.

use std::collections::BTreeMap;

use sluice_tests::{bin_path, EnvoyConfig, Response, Stack};

const SMALL: &str = "llama3.1:8b";
const BIG: &str = "llama3.1:70b";

fn int_header(resp: &Response, name: &str) -> u64 {
    let value = resp
        .header(name)
        .unwrap_or_else(|| panic!("no `{name}` header in {resp:?}"));
    value
        .parse()
        .unwrap_or_else(|_| panic!("`{name}: {value}` is not an integer"))
}

/// One sf-list member `"name";k=v;…` (RFC 9651): its string and its
/// parameters, each an sf-integer or an sf-string; panics on anything
/// else, so a malformed field fails the test.
fn sf_item(field: &str) -> (String, BTreeMap<String, String>) {
    let rest = field
        .strip_prefix('"')
        .unwrap_or_else(|| panic!("`{field}`: the item is not an sf-string"));
    let mut name = String::new();
    let mut chars = rest.chars();
    loop {
        match chars.next() {
            Some('"') => break,
            Some('\\') => name.push(chars.next().expect("escape at the end")),
            Some(c) if (' '..='~').contains(&c) => name.push(c),
            other => panic!("`{field}`: bad string character {other:?}"),
        }
    }
    let params: String = chars.collect();
    assert!(
        !params.contains(','),
        "`{field}`: one item, not a list of several"
    );
    let mut out = BTreeMap::new();
    for param in params.split(';').skip(1) {
        let (key, value) = param
            .split_once('=')
            .unwrap_or_else(|| panic!("`{field}`: parameter `{param}` has no value"));
        assert!(
            key.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && key
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_-.*".contains(c)),
            "`{field}`: `{key}` is not an sf-key"
        );
        let ok_int = value.len() <= 15 && value.chars().all(|c| c.is_ascii_digit());
        let ok_str = value.len() >= 2 && value.starts_with('"') && value.ends_with('"');
        assert!(ok_int || ok_str, "`{field}`: `{value}` is not a bare item");
        assert!(
            out.insert(key.to_string(), value.to_string()).is_none(),
            "`{field}`: `{key}` twice"
        );
    }
    (name, out)
}

/// The two fields of `resp`, checked against its `X-RateLimit-*`; `t` is
/// `X-RateLimit-Reset` on an admission, `Retry-After` on a 429. Returns the
/// policy name.
fn assert_agrees(resp: &Response, t_header: &str) -> String {
    let policy = resp
        .header("ratelimit-policy")
        .unwrap_or_else(|| panic!("no RateLimit-Policy in {resp:?}"));
    let limit = resp
        .header("ratelimit")
        .unwrap_or_else(|| panic!("no RateLimit in {resp:?}"));
    let (p_name, p) = sf_item(policy);
    let (l_name, l) = sf_item(limit);
    assert_eq!(p_name, l_name, "{resp:?}");
    assert_eq!(
        p["q"],
        int_header(resp, "x-ratelimit-limit").to_string(),
        "{resp:?}"
    );
    assert!(p["w"].parse::<u64>().is_ok_and(|w| w >= 1), "{resp:?}");
    assert!(!p.contains_key("pk") && !l.contains_key("pk"), "{resp:?}");
    assert_eq!(
        l["r"],
        int_header(resp, "x-ratelimit-remaining").to_string(),
        "{resp:?}"
    );
    assert_eq!(l["t"], int_header(resp, t_header).to_string(), "{resp:?}");
    p_name
}

fn ietf_on(cfg: &mut EnvoyConfig) {
    cfg.policy_mut()["request"]["rate_limit_headers"] =
        serde_yaml::from_str("{ietf: true}").expect("yaml");
}

#[test]
fn off_by_default_no_ratelimit_fields() {
    let stack = Stack::start(|_| {});
    let resp = stack.chat(SMALL, &[]);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(resp.header("x-ratelimit-limit").is_some(), "{resp:?}");
    assert_eq!(resp.header("ratelimit"), None, "{resp:?}");
    assert_eq!(resp.header("ratelimit-policy"), None, "{resp:?}");
}

/// The free tier (10/min per caller): ten admissions carry the fields of
/// `tier/free/requests`, counting down with `X-RateLimit-Remaining`; the
/// eleventh call's 429 carries `r=0` and `t` = `Retry-After`.
#[test]
fn admitted_and_refused_answers_carry_fields_that_agree_with_x_ratelimit() {
    let stack = Stack::start(ietf_on);
    for i in 0..10u64 {
        let resp = stack.chat(SMALL, &[]);
        assert_eq!(resp.status, 200, "call {i}: {resp:?}");
        assert_eq!(int_header(&resp, "x-ratelimit-remaining"), 9 - i);
        assert_eq!(
            assert_agrees(&resp, "x-ratelimit-reset"),
            "tier/free/requests"
        );
        assert_eq!(
            resp.header("ratelimit-policy"),
            Some(r#""tier/free/requests";q=10;w=60"#),
            "{resp:?}"
        );
    }
    let refused = stack.chat(SMALL, &[]);
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.header("x-sluice-reason"), Some("user_rate_limit"));
    assert_eq!(assert_agrees(&refused, "retry-after"), "tier/free/requests");
    let (_, l) = sf_item(refused.header("ratelimit").unwrap_or_default());
    assert_eq!(l["r"], "0", "{refused:?}");
    assert_eq!(stack.upstream_requests(), 10, "{}", stack.upstream.stats());
}

/// A shared bucket (the 70b model's 5/min, all callers) binds: the item is
/// the model's rule id, never the caller's key; and one caller's fields of
/// its own bucket say nothing of another caller's spending.
#[test]
fn the_item_is_the_rule_id_never_the_caller_and_counts_stay_per_caller() {
    let stack = Stack::start(ietf_on);
    let pro = [("x-api-key", "demo-pro-key")];
    for i in 0..5u64 {
        let resp = stack.chat(BIG, &pro);
        assert_eq!(resp.status, 200, "70b call {i}: {resp:?}");
        assert_eq!(
            assert_agrees(&resp, "x-ratelimit-reset"),
            format!("model/{BIG}/requests")
        );
        for field in ["ratelimit", "ratelimit-policy"] {
            let value = resp.header(field).unwrap_or_default();
            assert!(
                !value.contains("demo-pro-key") && !value.contains("127.0.0.1"),
                "{field}: {value}"
            );
        }
    }
    let refused = stack.chat(BIG, &pro);
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(
        assert_agrees(&refused, "retry-after"),
        format!("model/{BIG}/requests")
    );

    // Anonymous callers of the free tier: the pro caller's spending above
    // shows nowhere in their own bucket's fields.
    let resp = stack.chat(SMALL, &[]);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(
        assert_agrees(&resp, "x-ratelimit-reset"),
        "tier/free/requests"
    );
    let (_, l) = sf_item(resp.header("ratelimit").unwrap_or_default());
    assert_eq!(l["r"], "9", "{resp:?}");
}

/// `check-config` (what Envoy would load) accepts the switch and refuses a
/// bad value or an unknown key with the field path.
#[test]
fn check_config_refuses_a_bad_value_with_its_field_path() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |value: &str| {
        let mut cfg = EnvoyConfig::load_shipped();
        cfg.policy_mut()["request"]["rate_limit_headers"] =
            serde_yaml::from_str(value).expect("yaml");
        let file = dir.path().join("policy.yaml");
        let text = serde_yaml::to_string(cfg.policy_mut()).expect("yaml");
        std::fs::write(&file, text).expect("policy file");
        let out = std::process::Command::new(bin_path("sluice-sidecar"))
            .arg("check-config")
            .arg(&file)
            .output()
            .expect("running check-config");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, out) = run("{ietf: true}");
    assert!(ok, "{out}");
    let (ok, out) = run("{ietf: false}");
    assert!(ok, "{out}");
    let (ok, out) = run("{ietf: sometimes}");
    assert!(!ok, "check-config accepted `ietf: sometimes`: {out}");
    assert!(out.contains("request.rate_limit_headers.ietf"), "{out}");
    let (ok, out) = run("{ietf: true, draft: 9}");
    assert!(!ok, "check-config accepted an unknown key: {out}");
    assert!(out.contains("request.rate_limit_headers"), "{out}");
    assert!(out.contains("draft"), "{out}");
}
