//! Upstream pushback as the policy sets it up (docs/src/design.md, "Route"): which shared
//! record a request's model route uses, whose credential a 429 is about,
//! and the three moments [`crate::flow`] reports (arrival, admission, answer).
//! The record itself and its rules are in [`crate::admission::route`].
//!
//! Who can pause or break what:
//! - A 429 with `Retry-After` on a pass-through route (the client's own
//!   credential goes upstream) pauses that credential on that route only,
//!   in one of `credential_slots` hashed slots; on an `injected` route it
//!   pauses the route. A 503 with `Retry-After` speaks for the upstream and
//!   pauses the route. Every pause is capped by `max_pause` (+ jitter).
//! - The error breaker opens on `failures_to_open` failures in a row within
//!   `failure_window` from at least `min_callers` distinct principals.
//! - The half-open probe is claimed after admission, so a refused request
//!   never holds it; a caller whose probe failed waits a cooldown before it
//!   may probe again.
//!
//! Key set: one record per configured model, one for requests without a
//! model, `unlisted_slots` for every other model name (placed by hash:
//! unlisted models in one slot share a breaker and pauses), and
//! `credential_slots` pause slots. Nothing grows with traffic.

use sha2::{Digest, Sha256};

use crate::admission::answer::{Reason, Refused};
use crate::admission::identity::{Identity, RequestView};
use crate::admission::route::{self, Answer, Protection, Pushback, Recorded};
use crate::admission::{Engine, Routed, Verdict};
use crate::limits::slot_table::SlotTable;
use crate::policy::protection::Credentials;
use crate::state::codec::Record;
use crate::state::store::{Cas, SharedStore};

const UPSTREAM_KEY: &str = "sluice:v1:upstream/";
const PAUSE_KEY: &str = "sluice:v1:pause/";
/// The breakers shared by models the policy does not list
/// (`{UPSTREAM_KEY}other#{slot}`).
const UNLISTED_KEY: &str = "sluice:v1:upstream/other#";
/// Claim attempts when the probe changes hands under a request.
const PROBE_TRIES: u32 = 4;

impl Engine {
    pub fn protection(&self) -> Protection {
        let p = &self.policy.protection;
        Protection {
            failures_to_open: p.failures_to_open,
            min_callers: p.min_callers,
            failure_window_ms: p.failure_window_ms,
            cooldown_ms: p.cooldown_ms,
            backoff: p.backoff,
            max_cooldown_ms: p.max_cooldown_ms,
            max_jitter_ms: p.pause_jitter_ms,
            max_pause_ms: p.max_pause_ms,
        }
    }

    /// Whose credential the model's upstream sees.
    pub fn credentials_of(&self, model: Option<&str>) -> Credentials {
        model
            .and_then(|m| self.policy.models.get(m))
            .and_then(|m| m.credentials)
            .unwrap_or(self.policy.protection.credentials)
    }

    /// The shared-data key of a model route's record.
    pub fn upstream_key(&self, model: Option<&str>) -> String {
        match model {
            None => [UPSTREAM_KEY, "none"].concat(),
            Some(m) if self.policy.models.contains_key(m) => [UPSTREAM_KEY, m].concat(),
            Some(m) => {
                // Placed under the deployment's key: an outsider cannot
                // pick a name that shares a given unlisted model's slot
                // (and so its breaker); a chance collision still needs
                // `min_callers` callers' 5xx to open it.
                SlotTable::flat(UNLISTED_KEY, self.policy.protection.unlisted_slots, 1)
                    .place(self.hash_key.hash(m.as_bytes()))
            }
        }
    }

    /// On arrival: the request's pushback state. Reads the route's record,
    /// and its credential's slot only while some credential on the route is
    /// paused (the common path costs one read).
    pub fn pushback(
        &self,
        store: &dyn SharedStore,
        model: Option<&str>,
        req: &dyn RequestView,
        identity: &Identity,
        now_ms: u64,
    ) -> Pushback {
        let route_key = self.upstream_key(model);
        let credentials = self.credentials_of(model);
        let (record, _) = route::read(store, &route_key);
        let credential = (credentials == Credentials::PassThrough).then(|| {
            let fingerprint = self.credential_fingerprint(&route_key, req, identity);
            let slots = SlotTable::flat(PAUSE_KEY, self.policy.protection.credential_slots, 1);
            (slots.place(fingerprint), fingerprint)
        });
        let credential_paused_until_ms = match &credential {
            Some((slot, fingerprint)) if record.credential_pauses_until_ms > now_ms => {
                store.get(slot).map_or(0, |(b, _)| {
                    route::CredentialPause::decode(&b).until_for(*fingerprint, now_ms)
                })
            }
            _ => 0,
        };
        Pushback {
            route_key,
            credential,
            credentials,
            caller: caller_fingerprint(identity),
            record,
            credential_paused_until_ms,
        }
    }

    /// After admission, for a request routed as the half-open probe: claim
    /// it. Returns the verdict to apply and the probe lease when claimed. If
    /// another request took the probe first, what this one reserved is given
    /// back and it is answered as the route now stands.
    pub fn take_probe(
        &self,
        store: &dyn SharedStore,
        pb: &mut Pushback,
        verdict: Verdict,
        identity: &Identity,
        now_ms: u64,
        reroute: impl Fn(&Pushback) -> Routed,
    ) -> (Verdict, Option<u64>) {
        if !verdict.is_admitted() {
            return (verdict, None); // refused: it never holds the probe
        }
        // The claim's (and a give-back's) lost races are counted with the
        // admission's, on whichever verdict is applied.
        let mut cas = Cas::new(store, self.tries().take());
        cas.contention = verdict.contention();
        let give_back = |verdict: &Verdict, cas: &mut Cas| {
            if let Some(plan) = verdict.plan() {
                cas.contention.add(self.release(store, plan, now_ms));
            }
        };
        let with = |mut applied: Verdict, cas: &Cas| {
            *applied.contention_mut() = cas.contention;
            applied
        };
        for _ in 0..PROBE_TRIES {
            if let Some(lease) = route::claim_probe(&mut cas, &pb.route_key, pb.caller, now_ms) {
                return (with(verdict, &cas), Some(lease));
            }
            pb.record = route::read(store, &pb.route_key).0;
            match reroute(pb) {
                Routed::Probe => continue,
                Routed::Answered(answer) => {
                    give_back(&verdict, &mut cas);
                    return (with(*answer, &cas), None);
                }
                // The breaker closed meanwhile (the sidecar view is the
                // same snapshot, so no kill switch can appear here).
                Routed::Primary => return (with(verdict, &cas), None),
                // Another caller took the probe and the ladder would take
                // this one: it was admitted for the primary, so it is
                // refused like a request that found no probe.
                Routed::Rung(_) => break,
            }
        }
        give_back(&verdict, &mut cas);
        let probing = Refused::unavailable(
            Reason::UpstreamUnhealthy,
            "another request is probing the upstream",
            1,
        );
        let model = verdict.plan().and_then(|p| p.model.as_deref());
        let refused = self.refuse(probing, &identity.tier, model);
        (with(refused, &cas), None)
    }

    /// On the answer: feed the route's record (and a credential pause).
    /// `dice` in 0..1000 draws the pause jitter.
    pub fn observe_upstream(
        &self,
        store: &dyn SharedStore,
        pb: &Pushback,
        reply: &UpstreamReply,
        dice: u32,
        now_ms: u64,
    ) -> Recorded {
        let UpstreamReply {
            status,
            from_upstream,
            retry_after,
            lease,
        } = *reply;
        let p = self.protection();
        // A 429 without a (readable) `Retry-After` pauses too, for
        // `pause_without_retry_after`: pushback all the same.
        let asked = retry_after.and_then(|v| route::parse_retry_after(v, now_ms));
        let asked = match (asked, status) {
            (None, 429) => {
                Some(self.policy.protection.pause_without_retry_after_ms).filter(|ms| *ms > 0)
            }
            (asked, _) => asked,
        };
        let pause_ms = asked.and_then(|ms| route::pause_ms(ms, &p, dice));
        let answer = Answer {
            status,
            pause_ms,
            lease,
            from_upstream,
        };
        let mut cas = Cas::new(store, self.tries().take());
        route::record(&mut cas, pb, &p, answer, now_ms)
    }

    /// 64 bits of SHA-256 over the deployment's hash key, the route and the
    /// credential headers the upstream receives (or, without any, the
    /// principal). Per route: an upstream's 429 for one model says nothing
    /// about another. Not reversible, not forgeable without the credential
    /// itself, and (the key) not computable from outside, so nobody can
    /// pick a credential whose pause slot is a known principal's.
    fn credential_fingerprint(
        &self,
        route_key: &str,
        req: &dyn RequestView,
        identity: &Identity,
    ) -> u64 {
        // The exact bytes hashed: route, then each credential header sent.
        let mut input = Vec::with_capacity(144);
        input.extend_from_slice(self.hash_key.bytes());
        input.extend_from_slice(route_key.as_bytes());
        let mut any = false;
        for name in &self.policy.protection.credential_headers {
            if let Some(value) = req.header(name) {
                any = true;
                for part in [b"\0".as_slice(), name.as_bytes(), b"\0", value.as_bytes()] {
                    input.extend_from_slice(part);
                }
            }
        }
        if !any {
            input.extend_from_slice(b"\0\0principal\0");
            input.extend_from_slice(identity.principal.as_bytes());
        }
        fingerprint_of(input)
    }
}

/// Bound of the per-VM memo of credential fingerprints.
const FINGERPRINT_CACHE: usize = 1024;

thread_local! {
    /// Hashed bytes → fingerprint. A pure function of its key, so one memo
    /// per thread (per VM in Envoy) is shared safely by every engine on it:
    /// a caller's SHA-256 runs once per VM instead of on every request.
    static FINGERPRINTS: std::cell::RefCell<std::collections::HashMap<Vec<u8>, u64>> =
        std::cell::RefCell::default();
}

/// The first 64 bits of SHA-256 over `input`, memoised (bounded: the memo
/// is emptied when full, as the key-hash cache is).
fn fingerprint_of(input: Vec<u8>) -> u64 {
    let cached = FINGERPRINTS.with(|memo| memo.try_borrow().ok()?.get(&input).copied());
    if let Some(fingerprint) = cached {
        return fingerprint;
    }
    let digest = Sha256::digest(&input);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let fingerprint = u64::from_le_bytes(first);
    FINGERPRINTS.with(|memo| {
        if let Ok(mut memo) = memo.try_borrow_mut() {
            if memo.len() >= FINGERPRINT_CACHE {
                memo.clear();
            }
            memo.insert(input, fingerprint);
        }
    });
    fingerprint
}

/// What came back for a request sent upstream, as the pushback state
/// reads it.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamReply<'a> {
    /// 0: no answer (reset, timeout).
    pub status: u32,
    /// Envoy's `response.code_details` is `via_upstream`.
    pub from_upstream: bool,
    pub retry_after: Option<&'a str>,
    /// The probe claim the request held.
    pub lease: Option<u64>,
}

impl Pushback {
    /// Whether an answer can change the record: failures, pushback, a probe
    /// answer, or any answer while something is recorded.
    pub fn must_record(&self, status: u32, lease: Option<u64>) -> bool {
        status == 0 || status == 429 || status >= 500 || lease.is_some() || !self.record.is_blank()
    }
}

/// The caller as the breaker counts it (never 0, which marks a free entry).
fn caller_fingerprint(identity: &Identity) -> u32 {
    (((identity.hash >> 32) ^ identity.hash) as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::ctx;

    use crate::admission::route::{RouteHealth, SidecarSeen};
    use crate::policy::Policy;
    use crate::state::store::MemStore;
    use crate::usage::demand::Api;
    use serde_json::{json, Value};

    #[test]
    fn fingerprints_are_sha256_of_their_bytes_memoised_and_bounded() {
        let of = |bytes: &[u8]| {
            let digest = Sha256::digest(bytes);
            u64::from_le_bytes(digest[..8].try_into().unwrap())
        };
        let input = b"sluice:v1:upstream/m\0authorization\0Bearer k".to_vec();
        assert_eq!(fingerprint_of(input.clone()), of(&input));
        assert_eq!(fingerprint_of(input.clone()), of(&input)); // from the memo
        for i in 0..FINGERPRINT_CACHE + 10 {
            let other = format!("route\0x-api-key\0{i}").into_bytes();
            assert_eq!(fingerprint_of(other.clone()), of(&other));
        }
        assert!(FINGERPRINTS.with(|m| m.borrow().len()) <= FINGERPRINT_CACHE);
        assert_eq!(fingerprint_of(input.clone()), of(&input));
    }

    struct Req {
        addr: &'static str,
        key: Option<&'static str>,
    }
    impl RequestView for Req {
        fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
            (name == "x-api-key")
                .then_some(self.key?.to_string())
                .map(std::borrow::Cow::Owned)
        }
        fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
        fn client_address(&self) -> Option<String> {
            Some(self.addr.into())
        }
    }

    const ALICE: Req = Req {
        addr: "10.0.0.1:1",
        key: Some("sk-alice"),
    };
    const BOB: Req = Req {
        addr: "10.0.0.2:1",
        key: Some("sk-bob"),
    };

    fn engine_with(extra: Value) -> (Engine, MemStore) {
        let mut policy = json!({
            "default_tier": "free",
            "tiers": {"free": {"requests": "100/min"}},
            "models": {"big": {"requests": "3/min"}},
            "protection": {"pause_jitter": "0s"},
        });
        if let (Some(p), Some(extra)) = (policy.as_object_mut(), extra.as_object()) {
            for (k, v) in extra {
                p.insert(k.clone(), v.clone());
            }
        }
        let e = Engine::new(Policy::from_value(policy).unwrap());
        let store = MemStore::default();
        e.prepare(&store).unwrap();
        (e, store)
    }

    fn pushback(e: &Engine, store: &MemStore, model: &str, req: &Req, now: u64) -> Pushback {
        let id = e.identify(req).unwrap();
        e.pushback(store, Some(model), req, &id, now)
    }

    fn routed(e: &Engine, pb: &Pushback, req: &Req, model: &str, now: u64) -> Routed {
        let id = e.identify(req).unwrap();
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        let asked = e
            .demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
            .unwrap();
        e.route(
            &ctx(&id, Api::OpenAiChat, "", asked.as_ref(), now),
            &SidecarSeen::default(),
            pb,
            0,
        )
    }

    fn code(r: &Routed) -> Option<&str> {
        match r {
            Routed::Answered(v) => Some(v.labels().decision.reason_code()),
            _ => None,
        }
    }

    /// The slot table names the keys running Envoys hold.
    #[test]
    fn unlisted_and_pause_keys_keep_their_names() {
        let (e, _) = engine_with(json!({}));
        let n = u64::from(e.policy.protection.unlisted_slots);
        for m in ["gpt-a", "made-up-7", ""] {
            let slot = e.hash_key.hash(m.as_bytes()) % n;
            assert_eq!(
                e.upstream_key(Some(m)),
                format!("{UPSTREAM_KEY}other#{slot}")
            );
        }
        let n = e.policy.protection.credential_slots;
        let pauses = SlotTable::flat(PAUSE_KEY, n, 1);
        assert_eq!(
            pauses.place(12_345),
            format!("{PAUSE_KEY}{}", 12_345 % u64::from(n))
        );
    }

    #[test]
    fn unlisted_models_do_not_share_a_breaker_unless_configured() {
        let free = json!({"input": 0, "output": 0});
        let (e, store) = engine_with(json!({"unlisted_models": {"price": free}}));
        assert_eq!(e.upstream_key(Some("big")), "sluice:v1:upstream/big");
        assert_eq!(e.upstream_key(None), "sluice:v1:upstream/none");
        let (a, b) = (e.upstream_key(Some("gpt-a")), e.upstream_key(Some("gpt-b")));
        assert!(a.starts_with("sluice:v1:upstream/other#"));
        assert_ne!(a, b);
        // Every unlisted name lands in one of `unlisted_slots` keys.
        let keys: std::collections::BTreeSet<String> = (0..5000)
            .map(|i| e.upstream_key(Some(&format!("made-up-{i}"))))
            .collect();
        assert_eq!(keys.len(), 64);

        // Two callers break gpt-a; gpt-b still flows.
        for (req, t) in [(&ALICE, 0), (&BOB, 1), (&ALICE, 2)] {
            let pb = pushback(&e, &store, "gpt-a", req, t);
            e.observe_upstream(
                &store,
                &pb,
                &UpstreamReply {
                    status: 500,
                    from_upstream: true,
                    retry_after: None,
                    lease: None,
                },
                0,
                t,
            );
        }
        let pb = pushback(&e, &store, "gpt-a", &ALICE, 3);
        assert_eq!(
            code(&routed(&e, &pb, &ALICE, "gpt-a", 3)),
            Some("upstream_unhealthy")
        );
        let pb = pushback(&e, &store, "gpt-b", &ALICE, 3);
        assert!(matches!(
            routed(&e, &pb, &ALICE, "gpt-b", 3),
            Routed::Primary
        ));

        let (one, _) = engine_with(json!({"protection": {"unlisted_slots": 1}}));
        assert_eq!(
            one.upstream_key(Some("gpt-a")),
            one.upstream_key(Some("gpt-b"))
        );
    }

    #[test]
    fn a_429_without_retry_after_pauses_and_on_an_injected_route_counts_as_a_failure() {
        let quiet = |credentials: &str| {
            let (e, store) = engine_with(json!({"protection": {
                "pause_jitter": "0s", "credentials": credentials, "min_callers": 1,
            }}));
            let pb = pushback(&e, &store, "big", &ALICE, 1_000);
            let r = e.observe_upstream(
                &store,
                &pb,
                &UpstreamReply {
                    status: 429,
                    from_upstream: true,
                    retry_after: None,
                    lease: None,
                },
                0,
                1_000,
            );
            let after = pushback(&e, &store, "big", &ALICE, 1_500);
            (r.paused, after)
        };
        // Pass-through: the caller's own credential, for the default 1 s;
        // the route's record is untouched.
        let (paused, after) = quiet("pass_through");
        assert_eq!(paused, Some(route::PauseScope::Credential));
        assert_eq!(after.credential_paused_until_ms, 2_000);
        assert_eq!(after.record.failures, 0);
        // Injected: the route pauses, and the 429 is a failure of it.
        let (paused, after) = quiet("injected");
        assert_eq!(paused, Some(route::PauseScope::Route));
        assert_eq!(after.record.paused_until_ms, 2_000);
        assert_eq!(after.record.failures, 1);
    }

    #[test]
    fn one_callers_429_pauses_only_its_own_credential() {
        let (e, store) = engine_with(json!({}));
        let pb = pushback(&e, &store, "big", &ALICE, 1_000);
        assert_eq!(pb.credentials, Credentials::PassThrough);
        let r = e.observe_upstream(
            &store,
            &pb,
            &UpstreamReply {
                status: 429,
                from_upstream: true,
                retry_after: Some("3600"),
                lease: None,
            },
            0,
            1_000,
        );
        assert_eq!(r.paused, Some(route::PauseScope::Credential));

        let mine = pushback(&e, &store, "big", &ALICE, 2_000);
        assert_eq!(mine.credential_paused_until_ms, 301_000, "capped at 5 min");
        let r = routed(&e, &mine, &ALICE, "big", 2_000);
        assert_eq!(code(&r), Some("upstream_paused"));
        // The same key from another address is the same credential.
        let moved = Req {
            addr: "10.9.9.9:1",
            ..ALICE
        };
        let pb = pushback(&e, &store, "big", &moved, 2_000);
        assert_eq!(pb.credential_paused_until_ms, 301_000);
        // Bob, and Alice on another model, are served.
        let bob = pushback(&e, &store, "big", &BOB, 2_000);
        assert_eq!(bob.credential_paused_until_ms, 0);
        assert!(matches!(
            routed(&e, &bob, &BOB, "big", 2_000),
            Routed::Primary
        ));
        let other = pushback(&e, &store, "gpt-a", &ALICE, 2_000);
        assert_eq!(other.credential_paused_until_ms, 0);
        // Without a credential header the principal stands in for it.
        let anon = Req {
            addr: "10.0.0.3:1",
            key: None,
        };
        let pb = pushback(&e, &store, "big", &anon, 2_000);
        assert_ne!(pb.credential, mine.credential);
        // After the pause, Alice is served again.
        let later = pushback(&e, &store, "big", &ALICE, 301_001);
        assert!(matches!(
            routed(&e, &later, &ALICE, "big", 301_001),
            Routed::Primary
        ));
    }

    #[test]
    fn an_injected_credential_pauses_the_route() {
        let (e, store) = engine_with(json!({
            "models": {"big": {"requests": "3/min", "credentials": "injected"},
                       "small": {}},
            "protection": {"pause_jitter": "0s", "credentials": "pass_through"},
        }));
        let pb = pushback(&e, &store, "big", &ALICE, 0);
        assert_eq!(
            (pb.credentials, pb.credential.is_none()),
            (Credentials::Injected, true)
        );
        e.observe_upstream(
            &store,
            &pb,
            &UpstreamReply {
                status: 429,
                from_upstream: true,
                retry_after: Some("10"),
                lease: None,
            },
            0,
            0,
        );
        let bob = pushback(&e, &store, "big", &BOB, 1_000);
        assert_eq!(
            code(&routed(&e, &bob, &BOB, "big", 1_000)),
            Some("upstream_paused")
        );
        let small = pushback(&e, &store, "small", &BOB, 1_000);
        assert_eq!(small.credentials, Credentials::PassThrough);
        assert!(matches!(
            routed(&e, &small, &BOB, "small", 1_000),
            Routed::Primary
        ));
    }

    #[test]
    fn a_request_that_loses_the_probe_gives_its_reservation_back() {
        let (e, store) = engine_with(json!({}));
        let open = RouteHealth {
            open_until_ms: 10,
            cooldown_ms: 10,
            ..RouteHealth::default()
        };
        store
            .set("sluice:v1:upstream/big", &open.encode(), 0)
            .unwrap();
        let id = e.identify(&ALICE).unwrap();
        let body = json!({"model": "big", "messages": [{"role": "user", "content": "hi"}]});
        let asked = e
            .demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
            .unwrap();
        let mut pb = e.pushback(&store, Some("big"), &ALICE, &id, 20);
        let reroute = |pb: &Pushback| {
            e.route(
                &ctx(&id, Api::OpenAiChat, "", asked.as_ref(), 20),
                &SidecarSeen::default(),
                pb,
                0,
            )
        };
        assert!(matches!(reroute(&pb), Routed::Probe));
        // Bob's request, admitted first, holds the probe.
        let bob = e.identify(&BOB).unwrap();
        let bob_pb = e.pushback(&store, Some("big"), &BOB, &bob, 20);
        assert!(route::claim_probe(
            &mut Cas::new(&store, 16),
            &bob_pb.route_key,
            bob_pb.caller,
            20
        )
        .is_some());

        let admit = || {
            e.admit(
                &store,
                &ctx(
                    &id,
                    Api::OpenAiChat,
                    "/v1/chat/completions",
                    asked.as_ref(),
                    20,
                ),
            )
        };
        let verdict = admit();
        assert!(verdict.reply().is_none());
        let (verdict, lease) = e.take_probe(&store, &mut pb, verdict, &id, 20, reroute);
        assert_eq!(
            (verdict.labels().decision.reason_code(), lease),
            ("upstream_unhealthy", None)
        );
        // Its model request was given back: 3/min still admits three.
        for _ in 0..3 {
            assert!(admit().reply().is_none());
        }
        assert!(admit().reply().is_some());
    }

    #[test]
    fn a_refused_request_never_claims_the_probe() {
        let (e, store) = engine_with(json!({}));
        let open = RouteHealth {
            open_until_ms: 10,
            cooldown_ms: 10,
            ..RouteHealth::default()
        };
        store
            .set("sluice:v1:upstream/big", &open.encode(), 0)
            .unwrap();
        let id = e.identify(&ALICE).unwrap();
        let body = json!({"model": "big", "messages": [{"role": "user", "content": "hi"}]});
        let asked = e
            .demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
            .unwrap();
        let admit = || {
            e.admit(
                &store,
                &ctx(
                    &id,
                    Api::OpenAiChat,
                    "/v1/chat/completions",
                    asked.as_ref(),
                    20,
                ),
            )
        };
        for _ in 0..3 {
            assert!(admit().reply().is_none());
        }
        let refused = admit();
        assert!(refused.reply().is_some(), "the model's 3/min is spent");
        let mut pb = e.pushback(&store, Some("big"), &ALICE, &id, 20);
        let reroute = |pb: &Pushback| {
            e.route(
                &ctx(&id, Api::OpenAiChat, "", asked.as_ref(), 20),
                &SidecarSeen::default(),
                pb,
                0,
            )
        };
        let (verdict, lease) = e.take_probe(&store, &mut pb, refused, &id, 20, reroute);
        assert_eq!(
            (verdict.labels().decision.reason_code(), lease),
            ("model_rate_limit", None)
        );
        // The probe is still there for the next admitted request.
        let bob = e.identify(&BOB).unwrap();
        let pb = e.pushback(&store, Some("big"), &BOB, &bob, 21);
        let r = e.route(
            &ctx(&bob, Api::OpenAiChat, "", asked.as_ref(), 21),
            &SidecarSeen::default(),
            &pb,
            0,
        );
        assert!(matches!(r, Routed::Probe));
    }
}
