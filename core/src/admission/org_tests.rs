//! Teams, orgs and budget windows in a named timezone, through the engine.

use super::*;
use crate::state::store::MemStore;
use crate::usage::reconcile::Usage;
use serde_json::json;

struct Key(&'static str);
impl RequestView for Key {
    fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        (name == "x-api-key")
            .then(|| self.0.to_string())
            .map(std::borrow::Cow::Owned)
    }
    fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
        None
    }
    fn client_address(&self) -> Option<String> {
        Some("10.0.0.1:1".into())
    }
}

fn engine_with(policy: Value) -> (Engine, MemStore) {
    let e = Engine::new(Policy::from_value(policy).unwrap());
    let store = MemStore::default();
    e.prepare(&store).unwrap();
    (e, store)
}

fn hierarchy() -> Value {
    json!({
        "default_tier": "pro",
        "identity": {"sources": ["api_key"], "api_key": {"keys": {
            "s1": {"tier": "pro", "team": "search", "org": "acme"},
            "s2": {"tier": "pro", "team": "search", "org": "acme"},
            "a1": {"tier": "pro", "team": "ads", "org": "acme"},
            "solo": "pro",
        }}},
        "tiers": {"pro": {"requests": "60/min"}},
        "teams": {"search": {"requests": "15/min"}, "ads": {"requests": "100/min"}},
        "orgs": {"acme": {"daily_spend": 0.01}},
        "models": {"paid": {"price": {"input_per_1k": 1.0, "output_per_1k": 1.0}}},
    })
}

#[test]
fn the_team_limit_binds_across_its_members_and_names_its_level() {
    let (e, store) = engine_with(hierarchy());
    let s1 = e.identify(&Key("s1")).unwrap();
    let s2 = e.identify(&Key("s2")).unwrap();
    assert_eq!(
        (s1.team.as_deref(), s1.org.as_deref()),
        (Some("search"), Some("acme"))
    );
    let admit = |id: &Identity| e.admit(&store, &ctx(id, Api::Other, "/v1/models", None, 1_000));
    let verdicts: Vec<Verdict> = (0..10).flat_map(|_| [admit(&s1), admit(&s2)]).collect();
    assert_eq!(verdicts.iter().filter(|v| v.reply().is_none()).count(), 15);
    let refused = verdicts.iter().find(|v| v.reply().is_some()).unwrap();
    assert_eq!(refused.labels().decision.reason_code(), "team_rate_limit");
    assert_eq!(refused.bucket(), Some("team/search/requests"));
    let body: Value = serde_json::from_slice(&refused.reply().as_ref().unwrap().body).unwrap();
    assert_eq!(body["error"]["code"], "team_rate_limit");
    assert_eq!(body["error"]["sluice"]["bucket"], "team/search/requests");
    assert_eq!(body["error"]["sluice"]["limit"], 15);
    // Another team, and a key in no team, are not affected.
    let a1 = e.identify(&Key("a1")).unwrap();
    assert!(admit(&a1).reply().is_none());
    let solo = e.identify(&Key("solo")).unwrap();
    assert_eq!(solo.team, None);
    assert!(admit(&solo).reply().is_none());
    // A refusal by the team gave back the tier units it had taken: s1 has
    // its 60/min less only what was admitted.
    let v = e.admit(&store, &ctx(&s1, Api::Other, "/v1/models", None, 61_000));
    assert!(
        v.reply().is_none(),
        "a minute later the team has room again"
    );
}

#[test]
fn an_org_spend_cap_is_shared_by_its_teams_to_the_micro_unit() {
    let (e, store) = engine_with(hierarchy());
    let s1 = e.identify(&Key("s1")).unwrap();
    let a1 = e.identify(&Key("a1")).unwrap();
    let body =
        json!({"model": "paid", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]});
    let asked = e
        .demand(&s1, Api::OpenAiChat, body.to_string().as_bytes())
        .unwrap()
        .unwrap();
    let mut spent = 0;
    let mut refused = None;
    for i in 0..200 {
        let id = if i % 2 == 0 { &s1 } else { &a1 };
        let v = e.admit(
            &store,
            &ctx(id, Api::OpenAiChat, "/v1/chat/completions", Some(&asked), 0),
        );
        if v.reply().is_some() {
            refused = Some(v);
            break;
        }
        let plan = v.plan().unwrap();
        let usage = Found::Usage(Usage {
            input: plan.input_estimate,
            output: 1,
        });
        let (s, _) = e.settle(&store, plan, usage, 0, true, 0);
        spent += s.cost;
    }
    let v = refused.expect("the org cap binds");
    assert_eq!(v.labels().decision.reason_code(), "org_budget_exceeded");
    assert_eq!(v.bucket(), Some("org/acme/daily_spend"));
    assert!(spent <= 10_000, "{spent} micro-units over a 0.01 cap");
    let per = e
        .price_of(Some("paid"))
        .bound_micros(asked_input(&e, &store, &asked), 1);
    assert!(
        10_000 - spent < per,
        "{spent}: the cap is used up to the last request that fits"
    );
}

/// What a hard spend cap reserves for the input: its bound.
fn asked_input(e: &Engine, store: &MemStore, asked: &Asked) -> u64 {
    let estimate = e.correction(store, "paid", "pro").apply(asked.input_raw);
    let model = &e.policy.models["paid"];
    asked
        .rendered
        .tokens(&model.input_bound, model.context_length)
        .max(estimate)
}

#[test]
fn undeclared_teams_and_levels_in_config_are_refused_with_their_path() {
    let mut v = hierarchy();
    v["identity"]["api_key"]["keys"]["s3"] = json!({"tier": "pro", "team": "nope"});
    let err = Policy::from_value(v).unwrap_err();
    assert!(err.path.ends_with(".team"), "{err}");
    assert!(!err.to_string().contains("s3"), "never echo a key: {err}");
    let mut v = hierarchy();
    v["teams"]["search"]["anonymous_total"] = json!({"requests": "1/min"});
    assert_eq!(
        Policy::from_value(v).unwrap_err().path,
        "teams.search.anonymous_total"
    );
    let mut v = hierarchy();
    v["orgs"]["acme"]["requets"] = json!("1/min");
    assert_eq!(Policy::from_value(v).unwrap_err().path, "orgs.acme.requets");
    let mut v = hierarchy();
    v["orgs"]["acme"]["daily_spend"] = json!(1e30);
    assert_eq!(
        Policy::from_value(v).unwrap_err().path,
        "orgs.acme.daily_spend.limit"
    );
    let mut v = hierarchy();
    v["budgets"] = json!({"reset_timezone": "Europe/Atlantis"});
    assert_eq!(
        Policy::from_value(v).unwrap_err().path,
        "budgets.reset_timezone"
    );
}

/// ms of a UTC civil time.
fn utc(y: i16, mo: i8, d: i8, h: i8, mi: i8) -> u64 {
    jiff::civil::date(y, mo, d)
        .at(h, mi, 0, 0)
        .to_zoned_datetime(jiff::tz::TimeZone::UTC)
        .unwrap()
        .timestamp()
        .as_millisecond() as u64
}

/// A daily budget of 3 requests-worth of tokens in Rome: spent just before
/// local midnight, back just after it; `reset_at` in UTC.
fn resets_at_rome_midnight(midnight_utc: u64) {
    let (e, store) = engine_with(json!({
        "default_tier": "t",
        // Each request reserves its input's bound (57) and its output (9).
        "tiers": {"t": {"daily_tokens": 200}},
        "budgets": {"reset_timezone": "Europe/Rome"},
    }));
    let id = e.identify(&Key("x")).unwrap();
    let body =
        json!({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]});
    let asked = e
        .demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
        .unwrap()
        .unwrap();
    let admit = |t: u64| {
        e.admit(
            &store,
            &ctx(
                &id,
                Api::OpenAiChat,
                "/v1/chat/completions",
                Some(&asked),
                t,
            ),
        )
    };
    let before = midnight_utc - 60_000;
    let mut admitted = 0;
    let refusal = loop {
        let v = admit(before);
        if v.reply().is_some() {
            break v;
        }
        admitted += 1;
        assert!(admitted < 100);
    };
    assert!(admitted >= 2, "{admitted}");
    let body: Value = serde_json::from_slice(&refusal.reply().unwrap().body).unwrap();
    let reset_at = body["error"]["sluice"]["reset_at"]
        .as_str()
        .unwrap()
        .to_string();
    let expected = jiff::Timestamp::from_millisecond(midnight_utc as i64).unwrap();
    assert_eq!(
        reset_at,
        expected.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
    );
    assert!(
        admit(midnight_utc - 1).reply().is_some(),
        "still the old day"
    );
    assert!(admit(midnight_utc).reply().is_none(), "a new local day");
}

#[test]
fn rome_daily_budget_resets_at_local_midnight_on_a_normal_day() {
    // 2026-06-16 00:00 CEST = 2026-06-15 22:00 UTC.
    resets_at_rome_midnight(utc(2026, 6, 15, 22, 0));
}

#[test]
fn rome_daily_budget_resets_at_local_midnight_across_the_spring_changeover() {
    // 29 Mar 2026 is 23 h long: its midnight is CET, the next is CEST.
    resets_at_rome_midnight(utc(2026, 3, 28, 23, 0));
    resets_at_rome_midnight(utc(2026, 3, 29, 22, 0));
}

#[test]
fn rome_daily_budget_resets_at_local_midnight_across_the_autumn_changeover() {
    // 25 Oct 2026 is 25 h long: its midnight is CEST, the next is CET.
    resets_at_rome_midnight(utc(2026, 10, 24, 22, 0));
    resets_at_rome_midnight(utc(2026, 10, 25, 23, 0));
}

/// `fleet.local` is checked against the compiled bucket ids: a team's or an
/// organisation's bucket can be kept per Envoy (the old check re-derived
/// the ids with its own grammar, knew no team or org, and refused these
/// policies at load); a bucket the policy does not make is still refused.
#[test]
fn fleet_local_may_name_team_and_org_buckets() {
    let with_local = |local: Value| {
        let mut p = hierarchy();
        p["sidecar"] = json!({"cluster": "sc"});
        p["fleet"] = json!({"salt": "0123456789abcdef0123", "local": local});
        Policy::from_value(p).and_then(Engine::compile).map(|_| ())
    };
    with_local(json!(["team/search/requests", "org/acme/daily_spend"])).unwrap();
    let err = with_local(json!(["team/nope/requests"])).unwrap_err();
    assert_eq!(err.path, "fleet.local[0]", "{err}");
    let err = with_local(json!(["tier/pro/requests", "org/acme/requests"])).unwrap_err();
    assert_eq!(err.path, "fleet.local[1]", "{err}");
}
