//! Admission against this worker's leases (`crate::limits::lease`, policy
//! `state.worker_leases`): the claims a live lease covers are taken from
//! it in memory; the rest go to shared data as before, asking for a lease
//! on top; settlements and give-backs go to the lease while it is held.

use super::*;
use crate::limits::bucket::{next_window, same_window};
use crate::limits::lease::{self, Leases};
use crate::limits::reservation::{assemble, LeaseAsk, Reservation, Share};

impl Engine {
    /// The lease every strict take asks for, when leases are on, and how
    /// long a lease is held at most (the fleet's leases are sub-leased to
    /// workers the same way).
    pub fn worker_lease(&self) -> Option<(LeaseAsk, u64)> {
        let ttl = self.policy.state.worker_leases.ttl_ms;
        self.lease_ask().map(|ask| (ask, ttl))
    }

    /// The lease every strict take asks for, when leases are on.
    fn lease_ask(&self) -> Option<LeaseAsk> {
        let w = &self.policy.state.worker_leases;
        w.enabled.then(|| LeaseAsk {
            divisor: u64::from(w.workers).saturating_mul(2),
            max_permille: w.max_permille,
        })
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, Leases> {
        // One VM is one thread: the lock is never contended, and a
        // poisoned one (a panic, which the build denies) still holds
        // consistent leases.
        self.leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// [`Reserver::reserve`] with this worker's leases: every claim or none.
    pub(super) fn reserve_leased(
        &self,
        reserver: &Reserver,
        claims: &[Claim],
        caller: Caller,
        now_ms: u64,
        effort: &mut Contention,
    ) -> Result<Reservation, Refusal> {
        let Some(ask) = self.lease_ask() else {
            return reserver.reserve(claims, caller, now_ms, effort);
        };
        self.return_due(reserver, now_ms, effort);
        let mut covered: Vec<Option<(Held, Quota)>> = vec![None; claims.len()];
        {
            let mut table = self.leases();
            for (c, slot) in claims.iter().zip(covered.iter_mut()) {
                if c.soft {
                    continue;
                }
                if let Some((key, owner, _)) = reserver.lease_place(c, caller) {
                    *slot = table.debit(&key, &c.rule.id, owner, c.amount, now_ms);
                }
            }
        }
        let rest: Vec<usize> = (0..claims.len())
            .filter(|&i| covered[i].is_none())
            .collect();
        let asked: Vec<Claim> = rest
            .iter()
            .map(|&i| Claim {
                lease: (!claims[i].soft).then_some(ask),
                ..claims[i]
            })
            .collect();
        let strict = match asked.is_empty() {
            true => Reservation::default(),
            false => match reserver.reserve(&asked, caller, now_ms, effort) {
                Ok(r) => r,
                Err(refusal) => {
                    self.credit(reserver, &covered, now_ms, effort);
                    return Err(reindex(refusal, &rest));
                }
            },
        };
        self.keep_leases(reserver, &strict, now_ms, effort);
        let mut taken: Vec<Option<(Held, Quota, bool)>> = covered
            .into_iter()
            .map(|c| c.map(|(h, q)| (h, q, false)))
            .collect();
        let over: Vec<usize> = strict.over_soft.iter().map(|&j| rest[j]).collect();
        for (j, (h, q)) in strict.held.into_iter().zip(strict.quotas).enumerate() {
            taken[rest[j]] = Some((h, q, over.contains(&rest[j])));
        }
        Ok(assemble(taken))
    }

    /// Puts back the units a refused request had taken from leases.
    fn credit(
        &self,
        reserver: &Reserver,
        covered: &[Option<(Held, Quota)>],
        now_ms: u64,
        effort: &mut Contention,
    ) {
        let gone: Vec<Held> = {
            let mut table = self.leases();
            covered
                .iter()
                .flatten()
                .filter(|(h, _)| !table.credit(h, now_ms))
                .map(|(h, _)| h.clone())
                .collect()
        };
        reserver.release(&gone, now_ms, effort);
    }

    /// Keeps the leases a strict take brought (each until `ttl`, never past
    /// its calendar window); one that no longer fits goes back at once.
    fn keep_leases(
        &self,
        reserver: &Reserver,
        r: &Reservation,
        now_ms: u64,
        effort: &mut Contention,
    ) {
        let ttl = self.policy.state.worker_leases.ttl_ms;
        let evicted: Vec<Held> = {
            let mut table = self.leases();
            r.leases
                .iter()
                .filter_map(|(_, h, q)| {
                    let by_ttl = now_ms.saturating_add(ttl);
                    let expires = match h.limit.window {
                        Some(w) => by_ttl.min(next_window(w, now_ms)),
                        None => by_ttl,
                    };
                    table.add(h.clone(), *q, expires, now_ms)
                })
                .map(|l| lease::WorkerLease::returned(&l))
                .collect()
        };
        reserver.release(&evicted, now_ms, effort);
    }

    /// Settles each held bucket (`actual` for what it reserved): into this
    /// worker's lease of it while held, else the shared bucket. Returns the
    /// charges that could not be written (see [`Reserver::settle_all`]).
    pub(super) fn settle_leased(
        &self,
        reserver: &Reserver,
        items: &[(&Held, u64)],
        now_ms: u64,
        effort: &mut Contention,
    ) -> u32 {
        if self.lease_ask().is_none() {
            return reserver.settle_all(items, now_ms, effort);
        }
        let mut shared: Vec<(Held, u64)> = Vec::new();
        {
            let mut table = self.leases();
            for &(h, actual) in items {
                let moved = !same_window(&h.limit, h.taken_ms, now_ms);
                match table.settle(h, actual, moved, now_ms) {
                    lease::LeaseSettled::NotHeld => shared.push((h.clone(), actual)),
                    lease::LeaseSettled::Absorbed(0) => {}
                    // What the lease could not pay: charged at once.
                    lease::LeaseSettled::Absorbed(rest) => shared.push((
                        Held {
                            amount: 0,
                            ..h.clone()
                        },
                        rest,
                    )),
                }
            }
        }
        let items: Vec<(&Held, u64)> = shared.iter().map(|(h, a)| (h, *a)).collect();
        let unwritten = reserver.settle_all(&items, now_ms, effort);
        unwritten.saturating_add(self.return_due(reserver, now_ms, effort))
    }

    /// Gives back the leases due (expired); the charges not written.
    fn return_due(&self, reserver: &Reserver, now_ms: u64, effort: &mut Contention) -> u32 {
        let due = {
            let mut table = self.leases();
            if table.next_due() > now_ms {
                return 0;
            }
            table.due(now_ms)
        };
        let items: Vec<(&Held, u64)> = due.iter().map(|h| (h, 0)).collect();
        reserver.settle_all(&items, now_ms, effort)
    }

    /// The worker's tick: gives back the leases due.
    pub fn leases_tick(&self, store: &dyn SharedStore, now_ms: u64) -> Contention {
        let mut effort = Contention::default();
        if self.lease_ask().is_some() {
            self.return_due(&self.reserver(store), now_ms, &mut effort);
        }
        effort
    }

    /// Gives back every lease this worker holds (its policy is replaced).
    pub fn return_leases(&self, store: &dyn SharedStore, now_ms: u64) -> Contention {
        let mut effort = Contention::default();
        // For good: a request of this policy still in flight that takes a
        // lease after this gives it straight back.
        let all = self.leases().close();
        self.reserver(store).release(&all, now_ms, &mut effort);
        effort
    }

    /// Does a live lease of this worker cover `claim` now? (A peek: the
    /// bucket's group in its shares, if any, as admission would take it.)
    pub(super) fn lease_covers(
        &self,
        reserver: &Reserver,
        claim: &Claim,
        identity: &Identity,
        now_ms: u64,
    ) -> bool {
        if self.lease_ask().is_none() {
            return false;
        }
        let b = self.buckets.iter().find(|b| b.rule.id == claim.rule.id);
        let share = b.and_then(|b| b.shares.as_ref()).map(|table| Share {
            table,
            group: table.group_of(&identity.tier, identity.declared),
        });
        let claim = Claim { share, ..*claim };
        let caller = admit::caller(identity);
        let Some((key, owner, _)) = reserver.lease_place(&claim, caller) else {
            return false;
        };
        self.leases()
            .balance(&key, &claim.rule.id, owner, now_ms)
            .is_some_and(|left| left >= claim.amount)
    }

    /// Units of `rule` this worker holds in leases (tests, tools).
    pub fn leased_units(&self, rule: &str) -> u64 {
        self.leases().held_of(rule)
    }
}

/// A refusal of the claims `rest` picked out, as an index into them all.
fn reindex(refusal: Refusal, rest: &[usize]) -> Refusal {
    let at = |i: usize| rest.get(i).copied().unwrap_or(i);
    match refusal {
        Refusal::Full { index, shortfall } => Refusal::Full {
            index: at(index),
            shortfall,
        },
        Refusal::NoSlot {
            index,
            retry_after_ms,
        } => Refusal::NoSlot {
            index: at(index),
            retry_after_ms,
        },
        Refusal::Contended { index } => Refusal::Contended { index: at(index) },
        Refusal::Host { index, message } => Refusal::Host {
            index: at(index),
            message,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::store::MemStore;
    use proptest::prelude::*;
    use serde_json::json;

    const C: u64 = 40;

    /// `workers` VMs of one Envoy: one engine each over one shared store.
    fn workers(workers: u32) -> (Vec<Engine>, MemStore) {
        let policy = json!({
            "default_tier": "free",
            "identity": {"sources": ["api_key"],
                         "api_key": {"header": "x-api-key", "keys": {"k": "pro"}}},
            "tiers": {"free": {}, "pro": {"requests": format!("{C}/day")}},
            "routes": [{"name": "v1", "path_prefix": "/v1/", "requests": "100000/day"}],
            "state": {"worker_leases": {"enabled": true, "workers": workers,
                                        "max_permille": 200, "ttl": "1s"}},
        });
        let store = MemStore::default();
        let engines: Vec<Engine> = (0..workers)
            .map(|_| Engine::new(Policy::from_value(policy.clone()).unwrap()))
            .collect();
        engines[0].prepare(&store).unwrap();
        (engines, store)
    }

    struct Keyed;
    impl RequestView for Keyed {
        fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
            (name == "x-api-key")
                .then(|| "k".to_string())
                .map(std::borrow::Cow::Owned)
        }
        fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
        fn client_address(&self) -> Option<String> {
            Some("1.2.3.4:5".into())
        }
    }

    /// A GET on worker `e`: admitted (its hold released at once) or not.
    fn get(e: &Engine, store: &MemStore, now: u64) -> bool {
        let id = e.identify(&Keyed).unwrap();
        let ctx = RequestContext {
            identity: &id,
            api: Api::Other,
            path: "/v1/models",
            asked: None,
            now_ms: now,
        };
        let v = e.admit(store, &ctx);
        v.reply().is_none()
    }

    #[test]
    fn a_worker_admits_from_its_lease_without_a_host_call() {
        let (engines, _) = workers(1);
        let host = crate::host::mock::MockHost::new(0);
        engines[0].prepare(&host).unwrap();
        let get = |now| {
            let id = engines[0].identify(&Keyed).unwrap();
            let ctx = RequestContext {
                identity: &id,
                api: Api::Other,
                path: "/v1/models",
                asked: None,
                now_ms: now,
            };
            engines[0].admit(&host, &ctx).reply().is_none()
        };
        assert!(get(0));
        let held = engines[0].leased_units("tier/pro/requests");
        assert!(held > 0, "a lease was taken far from the end");
        // Within ttl the next requests come from the leases: no shared-data
        // call at all (the route's lease covers them too).
        host.take_calls();
        for _ in 0..held {
            assert!(get(1));
        }
        let calls = host.take_calls();
        assert_eq!(calls.get("get").copied().unwrap_or(0), 0, "{calls:?}");
        assert_eq!(calls.get("set").copied().unwrap_or(0), 0, "{calls:?}");
        assert_eq!(engines[0].leased_units("tier/pro/requests"), 0);
        // Past the ttl the lease is gone: the next take is strict again.
        engines[0].leases_tick(&host, 2_000);
        assert!(get(2_000));
        assert!(host.take_calls().get("set").copied().unwrap_or(0) >= 1);
    }

    #[test]
    fn a_worker_uses_its_lease_after_the_shared_bucket_is_empty() {
        let (engines, store) = workers(2);
        let (a, b) = (&engines[0], &engines[1]);
        assert!(get(a, &store, 0));
        let held = a.leased_units("tier/pro/requests");
        assert!(held > 0);
        // Worker b takes what is left (its own leases included).
        while get(b, &store, 0) {}
        // Worker a is not refused before the body: its lease still covers
        // a request, and admission takes it from there.
        let id = a.identify(&Keyed).unwrap();
        assert!(a
            .refusal_before_body(&store, &id, "/v1/chat/completions", 0, 0)
            .is_none());
        for _ in 0..held {
            assert!(get(a, &store, 0));
        }
        assert!(!get(a, &store, 0));
        assert!(a
            .refusal_before_body(&store, &id, "/v1/chat/completions", 0, 0)
            .is_some());
    }

    proptest! {
        /// N workers interleaved on one store: never more than C admitted;
        /// while one is refused, the others hold at most the stated bound;
        /// once every lease is back, demand gets exactly C.
        #[test]
        fn interleaved_workers_admit_at_most_and_then_exactly_the_limit(
            n in 1u32..=4,
            ops in prop::collection::vec((0u32..4, 0u64..400), 1..150)
        ) {
            let (engines, store) = workers(n);
            let mut now = 0u64;
            let mut admitted = 0u64;
            let bound = |e: &[Engine], me: usize| -> u64 {
                e.iter().enumerate().filter(|(i, _)| *i != me)
                    .map(|(_, w)| w.leased_units("tier/pro/requests")).sum()
            };
            for (w, step) in ops {
                now += step;
                let w = (w % n) as usize;
                if get(&engines[w], &store, now) {
                    admitted += 1;
                } else {
                    // Stranded by the others: at most max_permille × C each.
                    prop_assert!(bound(&engines, w) <= u64::from(n - 1) * C * 200 / 1000);
                }
                prop_assert!(admitted <= C, "{} admitted of {}", admitted, C);
            }
            // Every lease due back: ticks past the ttl.
            now += 1_000;
            for e in &engines {
                e.leases_tick(&store, now);
            }
            let mut refused_everywhere = false;
            while !refused_everywhere {
                refused_everywhere = true;
                for e in &engines {
                    if get(e, &store, now) {
                        admitted += 1;
                        refused_everywhere = false;
                    }
                }
                prop_assert!(admitted <= C);
            }
            // What is still leased was taken and not used: given back at
            // ttl, it is admitted then.
            now += 1_000;
            for e in &engines {
                e.leases_tick(&store, now);
            }
            while engines.iter().any(|e| get(e, &store, now)) {
                admitted += 1;
            }
            prop_assert_eq!(admitted, C);
        }
    }
}

#[cfg(test)]
mod settlement_tests {
    use super::*;
    use crate::state::store::MemStore;
    use crate::usage::reconcile::Usage;
    use proptest::prelude::*;
    use serde_json::json;

    const BUDGET: u64 = 20_000;

    struct Keyed;
    impl RequestView for Keyed {
        fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
            (name == "x-api-key")
                .then(|| "k".to_string())
                .map(std::borrow::Cow::Owned)
        }
        fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
        fn client_address(&self) -> Option<String> {
            Some("1.2.3.4:5".into())
        }
    }

    proptest! {
        /// Workers admitting and settling (under or over what they
        /// reserved) through their leases: once every lease is back, the
        /// shared budget holds exactly the sum of what was really used.
        /// (Leases of at most 40 tokens: settlements overrun them.)
        #[test]
        fn settlements_through_leases_are_exact(
            n in 1u32..=3,
            ops in prop::collection::vec((0u32..3, any::<bool>(), 1u64..120), 1..80)
        ) {
            let policy = json!({
                "default_tier": "free",
                "identity": {"sources": ["api_key"],
                             "api_key": {"header": "x-api-key", "keys": {"k": "pro"}}},
                "tiers": {"free": {}, "pro": {"daily_tokens": BUDGET}},
                "state": {"worker_leases": {"enabled": true, "workers": n,
                                            "max_permille": 2}},
            });
            let store = MemStore::default();
            let engines: Vec<Engine> = (0..n)
                .map(|_| Engine::new(Policy::from_value(policy.clone()).unwrap()))
                .collect();
            engines[0].prepare(&store).unwrap();
            let body = json!({"model": "m", "max_tokens": 50,
                              "messages": [{"role": "user", "content": "hi"}]}).to_string();
            let mut pending: Vec<(usize, Plan)> = Vec::new();
            let mut used = 0u64;
            for (w, settle, actual) in ops {
                let w = (w % n) as usize;
                let e = &engines[w];
                if settle && !pending.is_empty() {
                    let (at, plan) = pending.remove(0);
                    // Input of at least 1: a reported 0 for a prompt settles from the
                    // estimate (see `Engine::settle`).
                    let usage = Found::Usage(Usage { input: actual - actual / 2, output: actual / 2 });
                    engines[at].settle(&store, &plan, usage, 0, true, 1);
                    used += actual;
                    continue;
                }
                let id = e.identify(&Keyed).unwrap();
                let asked = e.demand(&id, Api::OpenAiChat, body.as_bytes()).unwrap();
                let ctx = ctx(&id, Api::OpenAiChat, "/v1/chat/completions", asked.as_ref(), 1);
                let v = e.admit(&store, &ctx);
                if let (None, Some(plan)) = (v.reply(), v.into_plan()) {
                    pending.push((w, plan));
                }
            }
            for (at, plan) in pending {
                engines[at].settle(&store, &plan, Found::Usage(Usage { input: 1, output: 1 }), 0, true, 1);
                used += 2;
            }
            for e in &engines {
                e.leases_tick(&store, 10_000);
            }
            let e = &engines[0];
            let b = e.buckets.iter().find(|b| &*b.rule.id == "tier/pro/daily_tokens").unwrap();
            let id = e.identify(&Keyed).unwrap();
            let left = e.reserver(&store).peek(&Claim::hard(&b.rule, 0), admit::caller(&id), 10_000);
            prop_assert_eq!(BUDGET.saturating_sub(used), left.remaining, "used {}", used);
        }
    }
}

#[cfg(test)]
mod config_tests {
    use crate::policy::Policy;
    use serde_json::json;

    #[test]
    fn worker_leases_are_checked_with_field_paths() {
        let with = |leases| {
            Policy::from_value(json!({"default_tier": "t", "tiers": {"t": {}},
                                      "state": {"worker_leases": leases}}))
            .map(|_| ())
            .map_err(|e| e.to_string())
        };
        assert!(with(json!({"enabled": true})).is_ok());
        for (bad, field) in [
            (json!({"workers": 0}), "state.worker_leases.workers"),
            (
                json!({"max_permille": 501}),
                "state.worker_leases.max_permille",
            ),
            (json!({"ttl": "5ms"}), "state.worker_leases.ttl"),
            (json!({"wrkers": 2}), "state.worker_leases"),
        ] {
            let err = with(bad).unwrap_err();
            assert!(err.contains(field), "{err}");
        }
    }
}
