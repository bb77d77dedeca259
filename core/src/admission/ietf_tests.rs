//! The IETF `RateLimit-Policy` / `RateLimit` fields through the engine:
//! the bucket `X-RateLimit-*` reports, on an admission and on its 429, and
//! nothing when the policy leaves them off.

use super::*;
use crate::state::store::MemStore;
use serde_json::json;

struct Anonymous(&'static str);
impl RequestView for Anonymous {
    fn header(&self, _: &str) -> Option<std::borrow::Cow<'_, str>> {
        None
    }
    fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
        None
    }
    fn client_address(&self) -> Option<String> {
        Some(self.0.to_string())
    }
}

fn engine(ietf: bool) -> (Engine, MemStore) {
    let policy = json!({
        "default_tier": "free",
        "tiers": {"free": {"requests": "100/min"}},
        "routes": [{"name": "models", "path_prefix": "/v1/models",
                    "requests": {"rate": "1/min", "burst": 2}}],
        "request": {"rate_limit_headers": {"ietf": ietf}},
    });
    let e = Engine::new(Policy::from_value(policy).unwrap());
    let store = MemStore::default();
    e.prepare(&store).unwrap();
    (e, store)
}

fn admit(e: &Engine, store: &MemStore, now: u64) -> Verdict {
    let id = e.identify(&Anonymous("10.0.0.1:1")).unwrap();
    e.admit(store, &ctx(&id, Api::Other, "/v1/models", None, now))
}

fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
}

#[test]
fn the_binding_bucket_is_named_by_its_rule_id_on_admission_and_refusal() {
    let (e, store) = engine(true);
    let first = admit(&e, &store, 1_000);
    assert!(first.reply().is_none());
    let h = &first.response_headers();
    // The route's 2-burst bucket is tighter than the caller's 100/min.
    assert_eq!(header(h, "x-ratelimit-limit"), Some("2"));
    assert_eq!(header(h, "x-ratelimit-remaining"), Some("1"));
    let reset = header(h, "x-ratelimit-reset").unwrap();
    assert_eq!(
        header(h, "ratelimit-policy"),
        Some(r#""route/models/requests";q=2;w=120"#),
        "2 units at 1/min come back in 120 s"
    );
    assert_eq!(
        header(h, "ratelimit"),
        Some(format!(r#""route/models/requests";r=1;t={reset}"#).as_str())
    );

    assert!(admit(&e, &store, 1_001).reply().is_none());
    let refused = admit(&e, &store, 1_002);
    let reply = refused.reply().unwrap();
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header("x-sluice-reason"), Some("route_rate_limit"));
    let retry_after = reply.header("retry-after").unwrap();
    assert_eq!(
        reply.header("ratelimit"),
        Some(format!(r#""route/models/requests";r=0;t={retry_after}"#).as_str())
    );
    assert_eq!(
        reply.header("ratelimit-policy"),
        Some(r#""route/models/requests";q=2;w=120"#)
    );
}

#[test]
fn off_by_default_neither_field_is_sent() {
    let (e, store) = engine(false);
    let admitted = admit(&e, &store, 1_000);
    assert!(header(admitted.response_headers(), "x-ratelimit-limit").is_some());
    assert!(header(admitted.response_headers(), "ratelimit").is_none());
    assert!(header(admitted.response_headers(), "ratelimit-policy").is_none());
    admit(&e, &store, 1_001);
    let refused = admit(&e, &store, 1_002);
    let reply = refused.reply().unwrap();
    assert_eq!(reply.status, 429);
    assert!(reply.header("ratelimit").is_none());
    assert!(reply.header("ratelimit-policy").is_none());
}
