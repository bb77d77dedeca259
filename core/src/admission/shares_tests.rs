//! Fair shares through the engine: a route's bucket, the 429 an anonymous
//! caller gets past its share, and all-or-nothing across buckets.

use super::*;
use crate::state::store::MemStore;
use serde_json::json;

/// A caller by API key (declared or not) or, without one, by address.
struct Who(Option<&'static str>, &'static str);
impl RequestView for Who {
    fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        (name == "x-api-key")
            .then_some(self.0)
            .flatten()
            .map(str::to_string)
            .map(std::borrow::Cow::Owned)
    }
    fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
        None
    }
    fn client_address(&self) -> Option<String> {
        Some(self.1.to_string())
    }
}

fn engine() -> (Engine, MemStore) {
    let policy = json!({
        "default_tier": "free",
        "identity": {"sources": ["api_key", "client_address"],
                     "api_key": {"keys": {"k-pro": "pro", "k-free": "free"}}},
        "tiers": {"free": {"requests": "100/min"}, "pro": {"requests": "100/min"}},
        "routes": [{"name": "models", "path_prefix": "/v1/models",
                    "requests": {"rate": "1/day", "burst": 10},
                    "shares": {"pro": "30%", "anonymous": "20%"}}],
    });
    let e = Engine::new(Policy::from_value(policy).unwrap());
    let store = MemStore::default();
    e.prepare(&store).unwrap();
    (e, store)
}

fn admit(e: &Engine, store: &MemStore, who: &Who, now: u64) -> Verdict {
    let id = e.identify(who).unwrap();
    e.admit(store, &ctx(&id, Api::Other, "/v1/models", None, now))
}

#[test]
fn a_routes_bucket_caps_anonymous_keeps_pros_floor_and_says_what_is_left() {
    let (e, store) = engine();
    // pro asks once: active, 2 of its floor of 3 still unmet.
    assert!(admit(&e, &store, &Who(Some("k-pro"), "10.0.0.1:1"), 1)
        .reply()
        .is_none());
    // 50 anonymous addresses: 2 (20 % of 10), then the route's 429.
    let verdicts: Vec<Verdict> = (0..50)
        .map(|i| {
            admit(
                &e,
                &store,
                &Who(None, ["10.1.0.1:1", "10.1.0.2:1"][i % 2]),
                2,
            )
        })
        .collect();
    assert_eq!(verdicts.iter().filter(|v| v.reply().is_none()).count(), 2);
    let refused = verdicts.iter().find_map(|v| v.reply()).unwrap();
    assert_eq!(refused.header("x-sluice-reason"), Some("route_rate_limit"));
    assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        refused.header("x-ratelimit-limit"),
        Some("2"),
        "its share is its bucket"
    );
    // The declared free key (no share) borrows all but pro's unmet 2.
    let free: Vec<Verdict> = (0..10)
        .map(|_| admit(&e, &store, &Who(Some("k-free"), "10.0.0.2:1"), 3))
        .collect();
    assert_eq!(free.iter().filter(|v| v.reply().is_none()).count(), 5);
    // pro still finds its floor.
    let pro: Vec<Verdict> = (0..3)
        .map(|_| admit(&e, &store, &Who(Some("k-pro"), "10.0.0.1:1"), 4))
        .collect();
    assert_eq!(pro.iter().filter(|v| v.reply().is_none()).count(), 2);
}

#[test]
fn a_share_refusal_gives_back_the_buckets_already_taken() {
    let (e, store) = engine();
    for i in 0..2 {
        assert!(admit(&e, &store, &Who(None, "10.1.0.1:1"), i)
            .reply()
            .is_none());
    }
    // Refused by the route's share: the caller's own bucket (taken first)
    // is given back, so it still has 98 of 100.
    for _ in 0..20 {
        assert!(admit(&e, &store, &Who(None, "10.1.0.1:1"), 5)
            .reply()
            .is_some());
    }
    let v = e.admit(
        &store,
        &ctx(
            &e.identify(&Who(None, "10.1.0.1:1")).unwrap(),
            Api::Other,
            "/v1/other",
            None,
            6,
        ),
    );
    assert!(v.reply().is_none());
    let remaining: Vec<&str> = v
        .response_headers()
        .iter()
        .filter(|(n, _)| *n == "x-ratelimit-remaining")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(remaining, ["97"]);
}
