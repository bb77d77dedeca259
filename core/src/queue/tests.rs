use super::*;
use crate::state::store::MemStore;

fn group(model_limit: u32, weights: &[(&str, u32)]) -> Group {
    Group {
        key: format!("{KEY_PREFIX}local"),
        backend_limit: None,
        model_limits: [("m".to_string(), Some(model_limit))].into(),
        weights: weights.iter().map(|(n, w)| (n.to_string(), *w)).collect(),
        fleet: false,
        shares: BTreeMap::new(),
    }
}

fn arrive(store: &MemStore, g: &Group, class: &str, principal: u64, now: u64) -> Entered {
    let a = Arrival {
        model: "m",
        class,
        wait: Some((10_000, 1_000)),
        max_per_principal: 0,
        principal,
        group: REST,
        wake: 7,
        saturated: false,
        now_ms: now,
    };
    enter(store, g, 8, &a).value
}

#[test]
fn slots_then_queue_then_grants_in_order() {
    let store = MemStore::default();
    let g = group(2, &[("batch", 1)]);
    assert_eq!(arrive(&store, &g, "batch", 1, 0), Entered::Go);
    assert_eq!(arrive(&store, &g, "batch", 1, 0), Entered::Go);
    let Entered::Queued {
        ticket,
        deadline_ms,
    } = arrive(&store, &g, "batch", 1, 5)
    else {
        panic!("queued")
    };
    assert_eq!(deadline_ms, 10_005);
    let done = release(&store, &g, 8, "m", &|_| false, 10);
    assert_eq!(done.grants.len(), 1);
    assert_eq!(done.grants[0].ticket, ticket);
    assert_eq!(done.state.unwrap().inflight("m"), 2);
    // Nothing waits: a release frees the slot.
    let done = release(&store, &g, 8, "m", &|_| false, 10);
    assert!(done.grants.is_empty());
    assert_eq!(done.state.unwrap().inflight("m"), 1);
}

#[test]
fn refusal_without_queue_and_full_queue() {
    let store = MemStore::default();
    let g = group(1, &[]);
    assert_eq!(arrive(&store, &g, "b", 1, 0), Entered::Go);
    let a = Arrival {
        model: "m",
        class: "i",
        wait: None,
        max_per_principal: 0,
        principal: 1,
        group: REST,
        wake: 1,
        saturated: false,
        now_ms: 0,
    };
    assert_eq!(
        enter(&store, &g, 8, &a).value,
        Entered::Refused(Blocked::Slot)
    );
    let a = Arrival {
        wait: Some((1000, 2)),
        max_per_principal: 0,
        ..a
    };
    assert!(matches!(
        enter(&store, &g, 8, &a).value,
        Entered::Queued { .. }
    ));
    assert!(matches!(
        enter(&store, &g, 8, &a).value,
        Entered::Queued { .. }
    ));
    assert_eq!(enter(&store, &g, 8, &a).value, Entered::Full);
}

#[test]
fn withdraw_tells_queued_from_granted() {
    let store = MemStore::default();
    let g = group(1, &[]);
    arrive(&store, &g, "b", 1, 0);
    let Entered::Queued { ticket: t1, .. } = arrive(&store, &g, "b", 1, 0) else {
        panic!()
    };
    let Entered::Queued { ticket: t2, .. } = arrive(&store, &g, "b", 1, 0) else {
        panic!()
    };
    assert!(withdraw(&store, &g, 8, t2).value);
    let done = release(&store, &g, 8, "m", &|_| false, 1);
    assert_eq!(done.grants[0].ticket, t1);
    // Granted: no longer in the queue.
    assert!(!withdraw(&store, &g, 8, t1).value);
    assert_eq!(done.state.unwrap().entries.len(), 0);
}

/// Principal 1 queues 100, then principal 2 queues 5: they alternate.
#[test]
fn round_robin_across_principals() {
    let store = MemStore::default();
    let g = group(1, &[]);
    arrive(&store, &g, "b", 1, 0);
    for _ in 0..100 {
        arrive(&store, &g, "b", 1, 0);
    }
    for _ in 0..5 {
        arrive(&store, &g, "b", 2, 1);
    }
    let mut order = Vec::new();
    let state = |s: &MemStore| State::decode(&s.get(&g.key).unwrap().0).unwrap();
    for _ in 0..12 {
        let before = state(&store);
        let done = release(&store, &g, 8, "m", &|_| false, 2);
        let t = done.grants[0].ticket;
        order.push(
            before
                .entries
                .iter()
                .find(|e| e.ticket == t)
                .unwrap()
                .principal,
        );
    }
    assert_eq!(order[..10], [1, 2, 1, 2, 1, 2, 1, 2, 1, 2]);
    assert_eq!(order[10..], [1, 1]);
}

#[test]
fn weights_share_dispatches() {
    let store = MemStore::default();
    let g = group(1, &[("gold", 3), ("lead", 1)]);
    arrive(&store, &g, "gold", 1, 0);
    for i in 0..200 {
        arrive(&store, &g, "gold", 1 + i % 3, 0);
        arrive(&store, &g, "lead", 9, 0);
    }
    let mut gold = 0;
    for _ in 0..100 {
        let done = release(&store, &g, 8, "m", &|_| false, 1);
        gold += usize::from(done.grants[0].class == "gold");
    }
    assert!((74..=76).contains(&gold), "{gold}");
}

#[test]
fn paused_model_waits_for_the_reset() {
    let store = MemStore::default();
    let g = group(4, &[]);
    pause(&store, &g, 8, "m", 2_000);
    let Entered::Queued { .. } = arrive(&store, &g, "b", 1, 0) else {
        panic!()
    };
    assert!(pump(&store, &g, 8, &|_| false, 1_999).grants.is_empty());
    assert_eq!(pump(&store, &g, 8, &|_| false, 2_000).grants.len(), 1);
    // A pause longer than the wait: refused at once.
    pause(&store, &g, 8, "m", 50_000);
    assert_eq!(
        arrive(&store, &g, "b", 1, 3_000),
        Entered::Refused(Blocked::Paused(50_000))
    );
}

#[test]
fn saturation_holds_the_queue() {
    let store = MemStore::default();
    let g = group(4, &[]);
    let a = Arrival {
        model: "m",
        class: "b",
        wait: Some((1000, 10)),
        max_per_principal: 0,
        principal: 1,
        group: REST,
        wake: 1,
        saturated: true,
        now_ms: 0,
    };
    assert!(matches!(
        enter(&store, &g, 8, &a).value,
        Entered::Queued { .. }
    ));
    assert!(pump(&store, &g, 8, &|_| true, 1).grants.is_empty());
    assert_eq!(pump(&store, &g, 8, &|_| false, 1).grants.len(), 1);
}

#[test]
fn codec_round_trips() {
    let store = MemStore::default();
    let g = group(1, &[]);
    arrive(&store, &g, "b", 1, 0);
    arrive(&store, &g, "b", 1, 0);
    let bytes = store.get(&g.key).unwrap().0;
    let s = State::decode(&bytes).unwrap();
    assert_eq!(s.encode(), bytes);
    assert!(State::decode(&bytes[..bytes.len() - 1]).is_none());
    assert_eq!(State::decode(&[]), Some(State::default()));
}

#[test]
fn reset_durations() {
    assert_eq!(parse_reset("2s"), Some(2_000));
    assert_eq!(parse_reset("6m0s"), Some(360_000));
    assert_eq!(parse_reset("20ms"), Some(20));
    assert_eq!(parse_reset("1.5s"), Some(1_500));
    assert_eq!(parse_reset("3"), Some(3_000));
    assert_eq!(parse_reset("1h2m3s"), Some(3_723_000));
    assert_eq!(parse_reset("soon"), None);
    assert_eq!(parse_reset("-1"), None);
    assert_eq!(parse_reset(""), None);
}

fn arrive_in(store: &MemStore, g: &Group, principal: u64, depth: u32, cap: u32) -> Entered {
    let a = Arrival {
        model: "m",
        class: "b",
        wait: Some((10_000, depth)),
        max_per_principal: cap,
        principal,
        group: REST,
        wake: 7,
        saturated: false,
        now_ms: 0,
    };
    enter(store, g, 8, &a).value
}

fn state(store: &MemStore, g: &Group) -> State {
    State::decode(&store.get(&g.key).unwrap().0).unwrap()
}

/// A full queue gives a newcomer the newest place of the principal
/// holding the most, while that one holds two more than the newcomer; the
/// evicted entry counts for nothing, is never granted, and withdraws.
#[test]
fn a_newcomer_takes_the_place_of_the_largest_holder() {
    let store = MemStore::default();
    let g = group(1, &[]);
    assert_eq!(arrive_in(&store, &g, 1, 4, 0), Entered::Go);
    let tickets: Vec<u64> = (0..4)
        .map(|_| match arrive_in(&store, &g, 1, 4, 0) {
            Entered::Queued { ticket, .. } => ticket,
            other => panic!("{other:?}"),
        })
        .collect();
    // Alone, A may fill the queue (work-conserving).
    assert_eq!(arrive_in(&store, &g, 1, 4, 0), Entered::Full);
    // B: A holds 4 ≥ 0 + 2, so A's newest goes.
    assert!(matches!(
        arrive_in(&store, &g, 2, 4, 0),
        Entered::Queued { .. }
    ));
    let s = state(&store, &g);
    assert!(s.evicted(tickets[3]));
    assert_eq!(s.depth("m", "b"), 4);
    // B again: A 3, B 1 → A's newest again; then A 2, B 2: full for B.
    assert!(matches!(
        arrive_in(&store, &g, 2, 4, 0),
        Entered::Queued { .. }
    ));
    assert!(state(&store, &g).evicted(tickets[2]));
    assert_eq!(arrive_in(&store, &g, 2, 4, 0), Entered::Full);
    // A third principal gets a place from A or B (each holds 2 ≥ 0 + 2).
    assert!(matches!(
        arrive_in(&store, &g, 3, 4, 0),
        Entered::Queued { .. }
    ));
    let s = state(&store, &g);
    assert_eq!(s.depth("m", "b"), 4);
    assert_eq!(s.entries.iter().filter(|e| e.evicted).count(), 3);
    // Evicted entries are never granted: the next four slots go to the
    // four live entries.
    let mut granted = Vec::new();
    for _ in 0..5 {
        granted.extend(release(&store, &g, 8, "m", &|_| false, 1).grants);
    }
    assert_eq!(granted.len(), 4);
    assert!(granted
        .iter()
        .all(|gr| gr.ticket != tickets[3] && gr.ticket != tickets[2]));
    // Its worker takes an evicted entry out (it holds nothing).
    assert!(withdraw(&store, &g, 8, tickets[3]).value);
    assert!(!state(&store, &g)
        .entries
        .iter()
        .any(|e| e.ticket == tickets[3]));
}

/// `max_per_principal` caps one principal's places below `max_depth`.
#[test]
fn max_per_principal_caps_one_principals_places() {
    let store = MemStore::default();
    let g = group(1, &[]);
    assert_eq!(arrive_in(&store, &g, 1, 10, 2), Entered::Go);
    for _ in 0..2 {
        assert!(matches!(
            arrive_in(&store, &g, 1, 10, 2),
            Entered::Queued { .. }
        ));
    }
    assert_eq!(arrive_in(&store, &g, 1, 10, 2), Entered::Full);
    assert!(matches!(
        arrive_in(&store, &g, 2, 10, 2),
        Entered::Queued { .. }
    ));
}

/// A declined check writes nothing and evicts no one; it is asked only
/// for a request that would wait, with the places its principal holds.
#[test]
fn a_declined_check_takes_no_place_and_evicts_no_one() {
    let store = MemStore::default();
    let g = group(1, &[]);
    let mut asked = Vec::new();
    let a = |principal| Arrival {
        model: "m",
        class: "b",
        wait: Some((10_000, 2)),
        max_per_principal: 0,
        principal,
        group: REST,
        wake: 7,
        saturated: false,
        now_ms: 0,
    };
    let mut yes = |held: u32| {
        asked.push(held);
        true
    };
    assert_eq!(
        enter_checked(&store, &g, 8, &a(1), &mut yes).value,
        Entered::Go
    );
    for _ in 0..2 {
        let out = enter_checked(&store, &g, 8, &a(1), &mut yes).value;
        assert!(matches!(out, Entered::Queued { .. }));
    }
    assert_eq!(asked, vec![0, 1], "not asked for the one that went at once");
    let before = store.get(&g.key).unwrap();
    let out = enter_checked(&store, &g, 8, &a(2), &mut |_| false);
    assert_eq!(out.value, Entered::Declined);
    assert_eq!(store.get(&g.key).unwrap(), before, "nothing written");
    assert!(!state(&store, &g).entries.iter().any(|e| e.evicted));
}

#[test]
fn evictions_survive_the_codec() {
    let store = MemStore::default();
    let g = group(1, &[]);
    arrive_in(&store, &g, 1, 2, 0);
    arrive_in(&store, &g, 1, 2, 0);
    arrive_in(&store, &g, 1, 2, 0);
    arrive_in(&store, &g, 2, 2, 0);
    let bytes = store.get(&g.key).unwrap().0;
    let s = State::decode(&bytes).unwrap();
    assert_eq!(s.entries.iter().filter(|e| e.evicted).count(), 1);
    assert_eq!(s.encode(), bytes);
    // Past its deadline and the grace, a writer drops it.
    let mut s2 = s.clone();
    let mut grants = Vec::new();
    s2.pump(&g, &|_| false, 10_000 + EVICTED_GRACE_MS + 1, &mut grants);
    assert!(!s2.entries.iter().any(|e| e.evicted));
}

#[test]
fn max_per_principal_is_checked_against_max_depth() {
    let policy = |cap: u32| {
        serde_json::json!({
            "default_tier": "t", "tiers": {"t": {"class": "b"}},
            "classes": {"b": {"max_wait": "5s", "max_depth": 10, "max_per_principal": cap}},
            "models": {"m": {"concurrency": 1}},
        })
    };
    for bad in [0, 11] {
        let err = Policy::from_value(policy(bad)).unwrap_err().to_string();
        assert!(err.contains("classes.b.max_per_principal"), "{err}");
    }
    let ok = Policy::from_value(policy(3)).unwrap();
    assert_eq!(ok.classes["b"].principal_cap(), 3);
}

/// A group with `permille` of the places of model `m`, and anonymous 50 %.
fn shared(pro_permille: Option<u32>) -> (Group, ShareTable) {
    let mut cfg = BTreeMap::from([(crate::policy::shares::ANONYMOUS.to_string(), 500)]);
    if let Some(p) = pro_permille {
        cfg.insert("pro".to_string(), p);
    }
    let table = ShareTable::compile(&crate::policy::shares::SharesConfig(cfg)).unwrap();
    let mut g = group(1, &[]);
    g.shares.insert("m".into(), table.clone());
    (g, table)
}

fn arrive_as(store: &MemStore, g: &Group, principal: u64, group: u64, depth: u32) -> Entered {
    let a = Arrival {
        model: "m",
        class: "b",
        wait: Some((10_000, depth)),
        max_per_principal: 0,
        principal,
        group,
        wake: 7,
        saturated: false,
        now_ms: 0,
    };
    enter(store, g, 8, &a).value
}

/// Issue 29 item 5: 150 one-request anonymous principals fill a queue of
/// 10; a declared caller still gets a place (the newest anonymous one),
/// and every declared newcomer does until anonymous holds its ceiling
/// (5); then a declared newcomer is `Full` like anyone at a full queue.
/// Before, the flood held every place and declared callers got `Full`.
#[test]
fn an_anonymous_flood_leaves_declared_callers_their_places() {
    let store = MemStore::default();
    let (g, t) = shared(None);
    let anon = t.group_of("free", false);
    let declared = t.group_of("free", true);
    assert_eq!(declared, REST);
    assert_eq!(arrive_as(&store, &g, 1_000, declared, 10), Entered::Go);
    let mut queued = 0;
    for p in 0..150 {
        if matches!(arrive_as(&store, &g, p, anon, 10), Entered::Queued { .. }) {
            queued += 1;
        }
    }
    assert_eq!(queued, 10, "alone, anonymous may fill the queue");
    for k in 0..5 {
        let got = arrive_as(&store, &g, 2_000 + k, declared, 10);
        assert!(
            matches!(got, Entered::Queued { .. }),
            "declared #{k}: {got:?}"
        );
    }
    let s = state(&store, &g);
    let live = |grp: u64| {
        s.entries
            .iter()
            .filter(|e| !e.evicted && e.group == grp)
            .count()
    };
    assert_eq!((live(anon), live(declared)), (5, 5));
    // The newest anonymous places went: the first five still wait.
    let evicted: Vec<u64> = s
        .entries
        .iter()
        .filter(|e| e.evicted)
        .map(|e| e.principal)
        .collect();
    assert!(evicted.iter().all(|p| (5..10).contains(p)), "{evicted:?}");
    assert_eq!(arrive_as(&store, &g, 3_000, declared, 10), Entered::Full);
    // Anonymous at its ceiling never takes a declared place back.
    assert_eq!(arrive_as(&store, &g, 500, anon, 10), Entered::Full);
    assert_eq!(
        State::decode(&s.encode()),
        Some(s.clone()),
        "groups survive the codec"
    );
}

/// A tier with a floor (40 % of 10 places) takes its places back from the
/// rest (no share) at a full queue; past its floor it is one of many, and
/// max-min per principal never takes a place of a tier at its floor.
#[test]
fn a_tier_keeps_its_floor_of_places() {
    let store = MemStore::default();
    let (g, t) = shared(Some(400));
    let pro = t.group_of("pro", true);
    let rest = t.group_of("free", true);
    assert_eq!(arrive_as(&store, &g, 1_000, rest, 10), Entered::Go);
    for _ in 0..10 {
        assert!(matches!(
            arrive_as(&store, &g, 1, rest, 10),
            Entered::Queued { .. }
        ));
    }
    for k in 0..4 {
        let got = arrive_as(&store, &g, 100 + k, pro, 10);
        assert!(matches!(got, Entered::Queued { .. }), "pro #{k}: {got:?}");
    }
    let s = state(&store, &g);
    assert_eq!(s.held_by_group(0, 0, pro), 4);
    // Principal 1 (rest) still holds 6; a newcomer of the rest holding 0
    // takes one of its places by max-min, never one of pro's four.
    assert!(matches!(
        arrive_as(&store, &g, 2, rest, 10),
        Entered::Queued { .. }
    ));
    let s = state(&store, &g);
    assert_eq!(s.held_by_group(0, 0, pro), 4);
    assert_eq!(s.held_by(0, 0, 1), 5);
}

/// Without shares (no declared keys: nobody to protect) places behave as
/// before: max-min per principal only.
#[test]
fn without_shares_places_are_max_min_per_principal() {
    let store = MemStore::default();
    let g = group(1, &[]);
    assert_eq!(arrive_as(&store, &g, 1, REST, 3), Entered::Go);
    for p in 10..13 {
        assert!(matches!(
            arrive_as(&store, &g, p, REST, 3),
            Entered::Queued { .. }
        ));
    }
    assert_eq!(arrive_as(&store, &g, 99, REST, 3), Entered::Full);
}

#[test]
fn a_providers_reset_in_either_dialect() {
    let headers = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    };
    // 2026-12-01T00:00:00Z
    let now = 1_796_083_200_000;
    let openai = headers(&[
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "6m0s"),
        ("x-ratelimit-remaining-tokens", "10"),
        ("x-ratelimit-reset-tokens", "1h"),
    ]);
    assert_eq!(provider_reset_ms(&openai, now), Some(360_000));
    let anthropic = headers(&[
        ("anthropic-ratelimit-requests-remaining", "0"),
        (
            "anthropic-ratelimit-requests-reset",
            "2026-12-01T00:00:01.500Z",
        ),
        ("anthropic-ratelimit-output-tokens-remaining", "0"),
        (
            "anthropic-ratelimit-output-tokens-reset",
            "2026-12-01T00:00:03Z",
        ),
        ("anthropic-ratelimit-tokens-remaining", "5"),
        ("anthropic-ratelimit-tokens-reset", "2026-12-01T01:00:00Z"),
    ]);
    assert_eq!(provider_reset_ms(&anthropic, now), Some(3_000));
    // A reset already past waits for nothing; a malformed one pauses nothing.
    let past = headers(&[
        ("anthropic-ratelimit-requests-remaining", "0"),
        ("anthropic-ratelimit-requests-reset", "2026-11-30T23:00:00Z"),
    ]);
    assert_eq!(provider_reset_ms(&past, now), Some(0));
    let bad = headers(&[
        ("anthropic-ratelimit-requests-remaining", "0"),
        ("anthropic-ratelimit-requests-reset", "soon"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "forever"),
    ]);
    assert_eq!(provider_reset_ms(&bad, now), None);
    assert_eq!(provider_reset_ms(&headers(&[]), now), None);
}
