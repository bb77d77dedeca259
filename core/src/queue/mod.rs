//! Concurrency slots and the wait queue (docs/src/design.md, "Queue"): how many requests
//! a model (and its backend) has in flight across every worker of one Envoy,
//! and who waits, in what order, when none is free.
//!
//! State: one shared-data key per gated backend (`sluice:v1:queue:<backend>`,
//! a bounded set: backends come from the policy), holding the in-flight
//! count and provider pause of each of its models, the scheduler state of
//! each class, and the queued entries. Every change is one compare-and-swap
//! of that key, so a slot is taken, handed to a waiter or given back
//! atomically with the queue it belongs to.
//!
//! Invariant: a slot is held by exactly one request from the moment it is
//! counted (admitted at arrival, or *granted* to a queued entry, which
//! leaves the queue in the same write) until that request gives it back,
//! once. A queued entry is either in the queue (withdrawing it succeeds:
//! it holds nothing) or was granted (withdrawing it fails: the caller owns
//! a slot and must give it back). Nothing else holds a slot.
//!
//! Fair dispatch, each time a slot frees:
//! 1. Across classes, stride scheduling: every class has a `pass`; the
//!    class with waiting, dispatchable work and the lowest pass goes, and
//!    its pass grows by `STRIDE / weight`. A class that starts waiting
//!    begins at the current virtual time (the pass last served), so idle
//!    time is no credit. Shares follow the weights exactly over any window
//!    where classes stay backlogged, and a waiting class is served within
//!    `ceil(sum of weights / its weight)` dispatches: no starvation.
//! 2. Within a class, round-robin across principals: an entry's `round` is
//!    one past the later of the class's current round and its principal's
//!    last queued round; the lowest round goes first (ties: arrival order).
//!    A principal with 1,000 queued requests and one with 1 alternate: the
//!    k-th request of a principal that arrives while P principals are
//!    backlogged in its class is served within k·P of the class's turns.
//!
//! Fair places. `max_depth` counts one model's places in one class, all
//! principals together; one principal may hold at most its class's
//! `max_per_principal` of them (default: all). When the queue is full, a
//! newcomer takes the place of the principal holding the most, if that
//! one holds at least two more than the newcomer would before arriving
//! (its newest entry, the one it would be served last, is *evicted*: it
//! leaves the count at once and its worker answers it 429 `queue_full`).
//! So places are shared max-min fairly and work-conserving: alone, a
//! principal may fill the queue; with P principals asking, each can hold
//! at least `floor(max_depth / P)` places (capped by its own
//! `max_per_principal`), whoever came first. An evicted entry stays in the
//! state, marked, until its worker takes it out (so "not in the queue"
//! still means "granted"); it never counts, is never granted, and is
//! dropped by any writer [`EVICTED_GRACE_MS`] past its deadline.
//!
//! Shared places. Principals are cheap for an undeclared caller (one
//! address, one JWT subject each), so max-min per principal alone lets a
//! flood of one-request identities hold every place. Places are therefore
//! also shared by the groups of the model's fair shares (the same table
//! as its rate bucket, `limits::shares`: a declared tier named there, the
//! undeclared callers together as `anonymous`, the unnamed rest). In a
//! queue `max_depth` deep, a group with share s is entitled to
//! `floor(s × max_depth)` places: a tier's guaranteed floor, anonymous's
//! ceiling. Work-conserving: any group may take a free place; at a full
//! queue a declared newcomer takes the newest place of the undeclared
//! callers while they hold more than their ceiling, and a tier below its
//! floor takes one from the group most over its entitlement (the rest is
//! entitled to none). Only then does max-min per principal apply, and it
//! never takes a place from a tier at or below its floor, nor gives one
//! to the undeclared callers at their ceiling from anyone else. So with
//! `anonymous: 50%` (the default when keys are declared) a flood of
//! addresses leaves half of every queue to declared keys.
//!
//! Contention: a give-back (release, withdrawal) must not be lost, so it
//! retries `SETTLE_TRIES_FACTOR` times as often as a take; a take that
//! loses every race refuses the request (429 `model_concurrency`), counted
//! in `sluice_cas_exhausted_total`.

use std::collections::BTreeMap;

use crate::limits::shares::{ShareTable, REST};
use crate::policy::Policy;
use crate::state::codec::{Reader, Writer};
use crate::state::store::{self, Contention, SharedStore, Updated};

pub const KEY_PREFIX: &str = "sluice:v1:queue:";
/// Stride numerator: weights up to 1,000 keep integer strides distinct.
const STRIDE: u64 = 1 << 20;
const VERSION: u8 = 1;
/// An evicted entry whose worker did not take it out by its deadline plus
/// this (a worker gone) is dropped by the next writer.
pub const EVICTED_GRACE_MS: u64 = 60_000;

/// The gates of one policy: which models wait for a slot, and under which
/// shared-data key.
#[derive(Debug, Clone, Default)]
pub struct Gates {
    /// Model → its backend, for every gated model.
    models: BTreeMap<String, String>,
    /// Backend → its limits and its gated models' limits.
    groups: BTreeMap<String, Group>,
}

#[derive(Debug, Clone, Default)]
pub struct Group {
    pub key: String,
    pub backend_limit: Option<u32>,
    pub model_limits: BTreeMap<String, Option<u32>>,
    /// Class → weight.
    pub weights: BTreeMap<String, u32>,
    /// Fleet-wide: this Envoy may use only the slots it leased (see
    /// `flow::fleet_slots`), never more than the limits above.
    pub fleet: bool,
    /// Model → the fair shares of its places (its rate bucket's table:
    /// the model's `shares`, else the policy's default).
    pub shares: BTreeMap<String, ShareTable>,
}

impl Group {
    fn dispatchable(&self, s: &State, model: usize, saturated: Saturated, now_ms: u64) -> Blocked {
        let m = &s.models[model];
        if saturated(&m.name) {
            return Blocked::Saturated;
        }
        if m.paused_until_ms > now_ms {
            return Blocked::Paused(m.paused_until_ms);
        }
        let leased = |limit: u32, lease: u32| if self.fleet { limit.min(lease) } else { limit };
        let limit = self.model_limits.get(&m.name).copied().flatten();
        if limit.is_some_and(|l| m.inflight >= leased(l, m.leased)) {
            return Blocked::Slot;
        }
        let total: u64 = s.models.iter().map(|m| u64::from(m.inflight)).sum();
        if self
            .backend_limit
            .is_some_and(|l| total >= u64::from(leased(l, s.leased)))
        {
            return Blocked::Slot;
        }
        Blocked::Free
    }

    fn weight(&self, class: &str) -> u64 {
        u64::from(self.weights.get(class).copied().unwrap_or(1).max(1))
    }
}

impl Gates {
    pub fn new(p: &Policy) -> Gates {
        let mut gates = Gates::default();
        let default_shares = crate::policy::shares::default_for(p);
        let fleet = |backend: &str| {
            p.fleet
                .as_ref()
                .is_some_and(|f| !f.local.iter().any(|id| *id == slots_scope(backend, None)))
        };
        for (name, m) in &p.models {
            let backend_limit = p.backends.get(&m.backend).and_then(|b| b.concurrency);
            if m.concurrency.is_none() && backend_limit.is_none() {
                continue;
            }
            gates.models.insert(name.clone(), m.backend.clone());
            let group = gates
                .groups
                .entry(m.backend.clone())
                .or_insert_with(|| Group {
                    key: format!("{KEY_PREFIX}{}", m.backend),
                    backend_limit,
                    model_limits: BTreeMap::new(),
                    weights: p
                        .classes
                        .iter()
                        .map(|(n, c)| (n.clone(), c.weight))
                        .collect(),
                    fleet: fleet(&m.backend),
                    shares: BTreeMap::new(),
                });
            group.model_limits.insert(name.clone(), m.concurrency);
            let written = m.shares.clone().unwrap_or_else(|| default_shares.clone());
            if let Some(table) = ShareTable::compile(&written) {
                group.shares.insert(name.clone(), table);
            }
        }
        gates
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The group (backend) gating a model, if any.
    pub fn group_of(&self, model: &str) -> Option<(&str, &Group)> {
        let backend = self.models.get(model)?;
        let group = self.groups.get(backend)?;
        Some((backend.as_str(), group))
    }

    pub fn group(&self, backend: &str) -> Option<&Group> {
        self.groups.get(backend)
    }

    pub fn groups(&self) -> impl Iterator<Item = (&str, &Group)> {
        self.groups.iter().map(|(b, g)| (b.as_str(), g))
    }

    /// Creates the keys (a missing key is written unconditionally, so
    /// keys are made at load, never on the request path); live state of a
    /// previous policy is kept.
    pub fn prepare(&self, store: &dyn SharedStore) -> usize {
        let mut created = 0;
        for group in self.groups.values() {
            if store.get(&group.key).is_none() {
                let _ = store.set(&group.key, &State::default().encode(), 0);
                created += 1;
            }
        }
        created
    }
}

/// Which models the sidecar reports saturated (by model or backend scope).
pub type Saturated<'a> = &'a dyn Fn(&str) -> bool;

/// Why a request cannot go now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    Free,
    /// No concurrency slot (model or backend).
    Slot,
    /// The sidecar reports the backend saturated.
    Saturated,
    /// The provider said it has nothing left until then (ms).
    Paused(u64),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelState {
    pub name: String,
    pub inflight: u32,
    pub paused_until_ms: u64,
    /// Fleet-wide gates: the model's slots this Envoy holds in Redis.
    pub leased: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClassState {
    pub name: String,
    pub pass: u64,
    pub round: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub ticket: u64,
    /// The wake-up queue of the worker that holds the paused request.
    pub wake: u32,
    pub model: u16,
    pub class: u16,
    pub principal: u64,
    pub round: u64,
    pub enqueued_ms: u64,
    pub deadline_ms: u64,
    /// Lost its place to a newcomer (fair places): counts for nothing,
    /// never granted; its worker answers `queue_full` and takes it out.
    pub evicted: bool,
    /// The caller's group in the model's fair shares (`REST`: none).
    pub group: u64,
}

/// One backend's slots and queue, as stored. Models and classes are kept
/// by name, so a policy reload that reorders them changes nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    pub models: Vec<ModelState>,
    pub classes: Vec<ClassState>,
    /// The pass of the class served last (stride scheduling's clock).
    pub vtime: u64,
    pub next_ticket: u64,
    pub entries: Vec<Entry>,
    /// Fleet-wide gates: the backend's slots this Envoy holds in Redis.
    pub leased: u32,
}

/// At most 255 bytes of the name (a policy name is far shorter), after
/// its length.
fn put_name(w: &mut Writer, name: &str) {
    let bytes = &name.as_bytes()[..name.len().min(255)];
    w.u8(bytes.len() as u8).bytes(bytes);
}

fn name(r: &mut Reader) -> Option<String> {
    let n = usize::from(r.try_u8()?);
    String::from_utf8(r.try_bytes(n)?.to_vec()).ok()
}

impl State {
    /// Variable length (see the table in `crate::state::codec`): the
    /// version, then models, classes, the clock, the entries, the leases
    /// and the evicted tickets, little-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(64 + self.entries.len() * 52);
        w.u8(VERSION);
        w.u16(self.models.len() as u16);
        for m in &self.models {
            put_name(&mut w, &m.name);
            w.u32(m.inflight).u64(m.paused_until_ms);
        }
        w.u16(self.classes.len() as u16);
        for c in &self.classes {
            put_name(&mut w, &c.name);
            w.u64(c.pass).u64(c.round);
        }
        w.u64(self.vtime).u64(self.next_ticket);
        w.u32(self.entries.len() as u32);
        for e in &self.entries {
            w.u64(e.ticket)
                .u32(e.wake)
                .u16(e.model)
                .u16(e.class)
                .u64(e.principal)
                .u64(e.round)
                .u64(e.enqueued_ms)
                .u64(e.deadline_ms);
        }
        // Leases last, so a state written before they existed still reads.
        w.u32(self.leased);
        for m in &self.models {
            w.u32(m.leased);
        }
        // Evicted tickets after the leases, for the same reason.
        let evicted: Vec<u64> = self
            .entries
            .iter()
            .filter(|e| e.evicted)
            .map(|e| e.ticket)
            .collect();
        w.u32(evicted.len() as u32);
        for t in evicted {
            w.u64(t);
        }
        // Each entry's group, in entry order, last for the same reason.
        w.u32(self.entries.len() as u32);
        for e in &self.entries {
            w.u64(e.group);
        }
        w.into_bytes()
    }

    /// `None`: not a state this version wrote (a blank key reads as empty).
    pub fn decode(bytes: &[u8]) -> Option<State> {
        if bytes.is_empty() {
            return Some(State::default());
        }
        let mut r = Reader::new(bytes);
        if r.try_u8()? != VERSION {
            return None;
        }
        let mut s = State::default();
        for _ in 0..r.try_u16()? {
            s.models.push(ModelState {
                name: name(&mut r)?,
                inflight: r.try_u32()?,
                paused_until_ms: r.try_u64()?,
                leased: 0,
            });
        }
        for _ in 0..r.try_u16()? {
            s.classes.push(ClassState {
                name: name(&mut r)?,
                pass: r.try_u64()?,
                round: r.try_u64()?,
            });
        }
        s.vtime = r.try_u64()?;
        s.next_ticket = r.try_u64()?;
        for _ in 0..r.try_u32()? {
            s.entries.push(Entry {
                ticket: r.try_u64()?,
                wake: r.try_u32()?,
                model: r.try_u16()?,
                class: r.try_u16()?,
                principal: r.try_u64()?,
                round: r.try_u64()?,
                enqueued_ms: r.try_u64()?,
                deadline_ms: r.try_u64()?,
                evicted: false,
                group: REST,
            });
        }
        if let Some(leased) = r.try_u32() {
            s.leased = leased;
            for m in &mut s.models {
                m.leased = r.try_u32()?;
            }
        }
        if !r.rest().is_empty() {
            for _ in 0..r.try_u32()? {
                let ticket = r.try_u64()?;
                if let Some(e) = s.entries.iter_mut().find(|e| e.ticket == ticket) {
                    e.evicted = true;
                }
            }
        }
        if !r.rest().is_empty() {
            let n = r.try_u32()? as usize;
            if n != s.entries.len() {
                return None;
            }
            for e in &mut s.entries {
                e.group = r.try_u64()?;
            }
        }
        Some(s)
    }

    fn model(&mut self, name: &str) -> usize {
        if let Some(i) = self.models.iter().position(|m| m.name == name) {
            return i;
        }
        self.models.push(ModelState {
            name: name.to_string(),
            ..ModelState::default()
        });
        self.models.len() - 1
    }

    fn class(&mut self, name: &str) -> usize {
        if let Some(i) = self.classes.iter().position(|c| c.name == name) {
            return i;
        }
        self.classes.push(ClassState {
            name: name.to_string(),
            ..ClassState::default()
        });
        self.classes.len() - 1
    }

    /// Requests waiting for one model in one class (evicted ones do not
    /// count).
    pub fn depth(&self, model: &str, class: &str) -> usize {
        self.entries
            .iter()
            .filter(|e| !e.evicted)
            .filter(|e| {
                self.models
                    .get(usize::from(e.model))
                    .is_some_and(|m| m.name == model)
                    && self
                        .classes
                        .get(usize::from(e.class))
                        .is_some_and(|c| c.name == class)
            })
            .count()
    }

    pub fn inflight(&self, model: &str) -> u32 {
        self.models
            .iter()
            .find(|m| m.name == model)
            .map_or(0, |m| m.inflight)
    }

    /// Places held for one model in one class by the entries `whose`
    /// picks.
    fn held(&self, model: usize, class: usize, whose: impl Fn(&Entry) -> bool) -> u32 {
        let n = self
            .entries
            .iter()
            .filter(|e| {
                !e.evicted
                    && usize::from(e.model) == model
                    && usize::from(e.class) == class
                    && whose(e)
            })
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Places one principal holds for one model in one class.
    fn held_by(&self, model: usize, class: usize, principal: u64) -> u32 {
        self.held(model, class, |e| e.principal == principal)
    }

    /// The queue (model, class) is full: among the entries of the groups
    /// `allowed`, the principal holding the most gives up its newest place
    /// when it holds at least `least` (a newcomer holding `mine`: `mine +
    /// 2`, see the module comment). `true`: a place was freed.
    fn evict_for(
        &mut self,
        model: usize,
        class: usize,
        least: u32,
        allowed: &dyn Fn(u64) -> bool,
    ) -> bool {
        let here = |e: &Entry| {
            !e.evicted
                && usize::from(e.model) == model
                && usize::from(e.class) == class
                && allowed(e.group)
        };
        let mut counts: BTreeMap<u64, (u32, u64)> = BTreeMap::new();
        for e in self.entries.iter().filter(|e| here(e)) {
            let c = counts.entry(e.principal).or_default();
            c.0 = c.0.saturating_add(1);
            c.1 = c.1.max(e.ticket);
        }
        // The most places; among equals, the one that queued last.
        let Some((&victim, &(most, _))) = counts.iter().max_by_key(|(_, (n, last))| (*n, *last))
        else {
            return false;
        };
        if most < least.max(1) {
            return false;
        }
        let newest = self
            .entries
            .iter_mut()
            .filter(|e| here(e) && e.principal == victim)
            .max_by_key(|e| (e.round, e.ticket));
        match newest {
            Some(e) => {
                e.evicted = true;
                true
            }
            None => false,
        }
    }

    /// Places a group holds for one model in one class.
    fn held_by_group(&self, model: usize, class: usize, group: u64) -> u32 {
        self.held(model, class, |e| e.group == group)
    }

    /// The queue (model, class) is full and a caller of `group` asks for a
    /// place: a group over its entitlement gives up the newest place of
    /// its principal holding the most, when the newcomer has a claim on it
    /// (see "Shared places" in the module comment). `true`: a place was
    /// freed.
    /// The round a new entry of `principal` in `class` joins: after the
    /// class's current round and after the principal's last waiting entry.
    fn next_round(&self, class: usize, principal: u64) -> u64 {
        let last = self
            .entries
            .iter()
            .filter(|e| !e.evicted && usize::from(e.class) == class && e.principal == principal)
            .map(|e| e.round)
            .max()
            .unwrap_or(0);
        self.classes[class].round.max(last).saturating_add(1)
    }

    /// Frees a place at a full queue for an arrival of `group` holding
    /// `mine`: first by the groups' entitlements, then max-min per
    /// principal within what the groups allow (never a place of a tier at
    /// or below its floor, never one more for the undeclared callers at
    /// their ceiling). Whether a place was freed.
    fn make_room(
        &mut self,
        model: usize,
        class: usize,
        group: u64,
        mine: u32,
        places: &Places,
    ) -> bool {
        if self.evict_for_group(model, class, group, places) {
            return true;
        }
        let anon_full = places.is_anonymous(group)
            && self.held_by_group(model, class, group) >= places.entitled(group);
        let held: BTreeMap<u64, u32> = places
            .groups()
            .map(|v| (v, self.held_by_group(model, class, v)))
            .collect();
        let at_floor =
            |v: u64| places.is_tier(v) && held.get(&v).copied().unwrap_or(0) <= places.entitled(v);
        let allowed = |v: u64| v == group || !(anon_full || at_floor(v));
        self.evict_for(model, class, mine.saturating_add(2), &allowed)
    }

    fn evict_for_group(&mut self, model: usize, class: usize, group: u64, places: &Places) -> bool {
        let mine = self.held_by_group(model, class, group);
        let below_floor = places.is_tier(group) && mine < places.entitled(group);
        let mut groups: Vec<u64> = self
            .entries
            .iter()
            .filter(|e| {
                !e.evicted && usize::from(e.model) == model && usize::from(e.class) == class
            })
            .map(|e| e.group)
            .filter(|g| *g != group)
            .collect();
        groups.sort_unstable();
        groups.dedup();
        let victim = groups
            .into_iter()
            .filter(|g| below_floor || (places.is_anonymous(*g) && !places.is_anonymous(group)))
            .map(|g| {
                let held = self.held_by_group(model, class, g);
                (held.saturating_sub(places.entitled(g)), g)
            })
            .filter(|(excess, _)| *excess > 0)
            .max();
        match victim {
            Some((_, v)) => self.evict_for(model, class, 1, &|g| g == v),
            None => false,
        }
    }

    /// Was the entry of `ticket` evicted (see the module comment)?
    pub fn evicted(&self, ticket: u64) -> bool {
        self.entries.iter().any(|e| e.ticket == ticket && e.evicted)
    }

    /// Hands free slots to waiting entries, in fair order (see the module
    /// comment); the grants leave the queue holding their slot.
    fn pump(&mut self, g: &Group, saturated: Saturated, now_ms: u64, grants: &mut Vec<Grant>) {
        // Evicted entries whose worker never came for them.
        self.entries
            .retain(|e| !(e.evicted && e.deadline_ms.saturating_add(EVICTED_GRACE_MS) < now_ms));
        loop {
            let free: Vec<bool> = (0..self.models.len())
                .map(|m| g.dispatchable(self, m, saturated, now_ms) == Blocked::Free)
                .collect();
            // The class with the lowest pass among those with work that can go.
            let Some(class) = self
                .entries
                .iter()
                .filter(|e| !e.evicted)
                .filter(|e| free.get(usize::from(e.model)).copied().unwrap_or(false))
                .map(|e| usize::from(e.class))
                .min_by_key(|&c| (self.classes.get(c).map_or(u64::MAX, |c| c.pass), c))
            else {
                return;
            };
            let Some((pos, _)) = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| {
                    !e.evicted
                        && usize::from(e.class) == class
                        && free.get(usize::from(e.model)).copied().unwrap_or(false)
                })
                .min_by_key(|(_, e)| (e.round, e.ticket))
            else {
                return;
            };
            let e = self.entries.remove(pos);
            let weight = g.weight(&self.classes[class].name);
            let c = &mut self.classes[class];
            self.vtime = c.pass;
            c.pass = c.pass.saturating_add(STRIDE / weight);
            c.round = c.round.max(e.round);
            let m = &mut self.models[usize::from(e.model)];
            m.inflight = m.inflight.saturating_add(1);
            grants.push(Grant {
                ticket: e.ticket,
                wake: e.wake,
                enqueued_ms: e.enqueued_ms,
                model: m.name.clone(),
                class: self.classes[class].name.clone(),
            });
        }
    }
}

/// The fair shares of one queue's places (see "Shared places" in the
/// module comment): no table, no groups (everyone is the rest).
struct Places<'a> {
    table: Option<&'a ShareTable>,
    depth: u32,
}

impl Places<'_> {
    fn share(&self, group: u64) -> Option<&crate::limits::shares::GroupShare> {
        self.table?.groups.iter().find(|g| g.id == group)
    }

    /// A tier's floor, anonymous's ceiling, in places; the rest: none.
    fn entitled(&self, group: u64) -> u32 {
        self.share(group).map_or(0, |g| {
            let places = u64::from(self.depth) * u64::from(g.permille) / 1000;
            u32::try_from(places).unwrap_or(u32::MAX)
        })
    }

    fn is_anonymous(&self, group: u64) -> bool {
        self.share(group).is_some_and(|g| g.capped)
    }

    /// A declared tier with a share (a floor).
    fn is_tier(&self, group: u64) -> bool {
        self.share(group).is_some_and(|g| !g.capped)
    }

    /// The named groups.
    fn groups(&self) -> impl Iterator<Item = u64> + '_ {
        self.table
            .into_iter()
            .flat_map(|t| t.groups.iter().map(|g| g.id))
    }
}

/// A queued entry handed a slot: its worker is woken with the ticket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub ticket: u64,
    pub wake: u32,
    pub enqueued_ms: u64,
    pub model: String,
    pub class: String,
}

/// What a request asks of the gate when it arrives.
#[derive(Debug, Clone)]
pub struct Arrival<'a> {
    pub model: &'a str,
    pub class: &'a str,
    /// `Some`: it may wait this long (ms) in a queue this deep.
    pub wait: Option<(u64, u32)>,
    /// The most places of that queue one principal may hold (0: all).
    pub max_per_principal: u32,
    pub principal: u64,
    /// Its group in the model's fair shares (`ShareTable::group_of`; `REST`
    /// when the model has none).
    pub group: u64,
    /// This worker's wake-up queue.
    pub wake: u32,
    pub saturated: bool,
    pub now_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entered {
    /// Holds a slot: go.
    Go,
    /// Waits; the ticket comes back in a wake-up, or the deadline passes.
    Queued { ticket: u64, deadline_ms: u64 },
    /// May not wait (or would surely outwait its deadline).
    Refused(Blocked),
    /// Its class's queue for this model is full (or it holds its share).
    Full,
    /// The check before taking a place said no (its buckets, see
    /// [`enter_checked`]); nothing was written.
    Declined,
    /// Every compare-and-swap lost.
    Contended,
}

/// The outcome of one change, with the state written (for gauges).
pub struct Changed<T> {
    pub value: T,
    /// `Exhausted`/`Failed`: nothing changed and `value` is the fallback.
    pub written: Updated,
    pub grants: Vec<Grant>,
    pub state: Option<State>,
    pub contention: Contention,
}

fn change<T: Clone>(
    store: &dyn SharedStore,
    g: &Group,
    tries: u32,
    mut f: impl FnMut(&mut State, &mut Vec<Grant>) -> Option<T>,
    unchanged: T,
) -> Changed<T> {
    let mut contention = Contention::default();
    let mut out: Option<(T, Vec<Grant>, State)> = None;
    let written = store::update(store, &g.key, tries, &mut contention, |bytes| {
        let mut state = bytes.and_then(State::decode).unwrap_or_default();
        let mut grants = Vec::new();
        let value = f(&mut state, &mut grants)?;
        let encoded = state.encode();
        out = Some((value, grants, state));
        Some(encoded)
    });
    match (written, out) {
        (Updated::Written, Some((value, grants, state))) => Changed {
            value,
            written,
            grants,
            state: Some(state),
            contention,
        },
        _ => Changed {
            value: unchanged,
            written,
            grants: Vec::new(),
            state: None,
            contention,
        },
    }
}

/// A request arrives for a gated model: take a slot, queue, or refuse.
/// It goes at once only when nothing waits ahead of it (else arrivals
/// would overtake the queue).
#[cfg(test)]
pub fn enter(store: &dyn SharedStore, g: &Group, tries: u32, a: &Arrival) -> Changed<Entered> {
    enter_checked(store, g, tries, a, &mut |_| true)
}

/// [`enter`], asking `may_wait` before the request takes a place in the
/// queue (never before it goes at once): given how many places its
/// principal already holds for this model, `false` declines
/// ([`Entered::Declined`], nothing written, no one evicted). Called inside
/// the compare-and-swap loop, so possibly more than once: it must only read.
pub fn enter_checked(
    store: &dyn SharedStore,
    g: &Group,
    tries: u32,
    a: &Arrival,
    may_wait: &mut dyn FnMut(u32) -> bool,
) -> Changed<Entered> {
    let mut declined = false;
    let mut changed = change(
        store,
        g,
        tries,
        |s, _| arrive(s, g, a, &mut *may_wait, &mut declined),
        Entered::Contended,
    );
    if declined && changed.written == Updated::Unchanged {
        changed.value = Entered::Declined;
    }
    changed
}

/// One try of [`enter_checked`] on the queue's state: go at once, be
/// refused, decline (`*declined`: nothing to write) or take a place,
/// making room by eviction where the queue is full.
fn arrive(
    s: &mut State,
    g: &Group,
    a: &Arrival,
    may_wait: &mut dyn FnMut(u32) -> bool,
    declined: &mut bool,
) -> Option<Entered> {
    let model = s.model(a.model);
    let arriving = |name: &str| a.saturated && name == a.model;
    let blocked = g.dispatchable(s, model, &arriving, a.now_ms);
    let ahead = s
        .entries
        .iter()
        .any(|e| !e.evicted && (usize::from(e.model) == model || g.backend_limit.is_some()));
    if blocked == Blocked::Free && !ahead {
        s.models[model].inflight = s.models[model].inflight.saturating_add(1);
        return Some(Entered::Go);
    }
    let blocked = if blocked == Blocked::Free {
        Blocked::Slot
    } else {
        blocked
    };
    let Some((max_wait, max_depth)) = a.wait else {
        return Some(Entered::Refused(blocked));
    };
    let deadline_ms = a.now_ms.saturating_add(max_wait);
    if let Blocked::Paused(until) = blocked {
        if until > deadline_ms {
            return Some(Entered::Refused(blocked));
        }
    }
    let class = s.class(a.class);
    let mine = s.held_by(model, class, a.principal);
    *declined = !may_wait(mine);
    if *declined {
        return None; // nothing to write
    }
    let cap = if a.max_per_principal == 0 {
        max_depth
    } else {
        a.max_per_principal
    };
    if mine >= cap {
        return Some(Entered::Full);
    }
    if s.depth(a.model, a.class) >= max_depth as usize {
        let places = Places {
            table: g.shares.get(a.model),
            depth: max_depth,
        };
        if !s.make_room(model, class, a.group, mine, &places) {
            return Some(Entered::Full);
        }
    }
    Some(join_queue(s, a, model, class, deadline_ms))
}

/// Puts the arrival at the end of its class's queue (room already made).
fn join_queue(s: &mut State, a: &Arrival, model: usize, class: usize, deadline_ms: u64) -> Entered {
    let waiting = s
        .entries
        .iter()
        .any(|e| !e.evicted && usize::from(e.class) == class);
    let vtime = s.vtime;
    let c = &mut s.classes[class];
    if !waiting {
        // No credit for idle time.
        c.pass = c.pass.max(vtime);
    }
    let round = s.next_round(class, a.principal);
    s.next_ticket = s.next_ticket.wrapping_add(1).max(1);
    let ticket = s.next_ticket;
    s.entries.push(Entry {
        ticket,
        wake: a.wake,
        model: model as u16,
        class: class as u16,
        principal: a.principal,
        round,
        enqueued_ms: a.now_ms,
        deadline_ms,
        evicted: false,
        group: a.group,
    });
    Entered::Queued {
        ticket,
        deadline_ms,
    }
}

/// Gives a slot back and hands free slots to waiters.
pub fn release(
    store: &dyn SharedStore,
    g: &Group,
    tries: u32,
    model: &str,
    saturated: Saturated,
    now_ms: u64,
) -> Changed<bool> {
    change(
        store,
        g,
        tries,
        |s, grants| {
            let m = s.model(model);
            s.models[m].inflight = s.models[m].inflight.saturating_sub(1);
            s.pump(g, saturated, now_ms, grants);
            Some(true)
        },
        false,
    )
}

/// Takes an entry out of the queue (deadline, client gone). `false`: it
/// is not there — it was granted a slot, which the caller now owns.
pub fn withdraw(store: &dyn SharedStore, g: &Group, tries: u32, ticket: u64) -> Changed<bool> {
    change(
        store,
        g,
        tries,
        |s, _| {
            let pos = s.entries.iter().position(|e| e.ticket == ticket);
            match pos {
                Some(pos) => {
                    s.entries.remove(pos);
                    Some(true)
                }
                None => None,
            }
        },
        false,
    )
}

/// Hands free slots to waiters when something other than a release
/// freed them (a pause ended, saturation cleared). Writes nothing when
/// there is nothing to hand.
pub fn pump(
    store: &dyn SharedStore,
    g: &Group,
    tries: u32,
    saturated: Saturated,
    now_ms: u64,
) -> Changed<()> {
    change(
        store,
        g,
        tries,
        |s, grants| {
            s.pump(g, saturated, now_ms, grants);
            (!grants.is_empty()).then_some(())
        },
        (),
    )
}

/// The provider has nothing left for `model` until `until_ms`: no waiter
/// of it is dispatched before then.
pub fn pause(
    store: &dyn SharedStore,
    g: &Group,
    tries: u32,
    model: &str,
    until_ms: u64,
) -> Changed<bool> {
    change(
        store,
        g,
        tries,
        |s, _| {
            let m = s.model(model);
            if s.models[m].paused_until_ms >= until_ms {
                return None;
            }
            s.models[m].paused_until_ms = until_ms;
            Some(true)
        },
        false,
    )
}

/// The fleet scope of a backend's slots (`fleet.local` names it to keep
/// them per Envoy), or of one of its models' slots.
pub fn slots_scope(backend: &str, model: Option<&str>) -> String {
    match model {
        Some(m) => format!("concurrency/{backend}/{m}"),
        None => format!("concurrency/{backend}"),
    }
}

/// Sets the fleet leases of a backend (`None`: the backend's own, else a
/// model's) with `f`, then hands what they free to waiters. `f` gets the
/// state and answers the new leases; nothing is written when none changes.
pub fn lease(
    store: &dyn SharedStore,
    g: &Group,
    tries: u32,
    saturated: Saturated,
    now_ms: u64,
    mut f: impl FnMut(&State) -> Vec<(Option<String>, u32)>,
) -> Changed<()> {
    change(
        store,
        g,
        tries,
        |s, grants| {
            let mut changed = false;
            for (model, n) in f(s) {
                let slot = match model {
                    Some(m) => {
                        let i = s.model(&m);
                        &mut s.models[i].leased
                    }
                    None => &mut s.leased,
                };
                changed |= *slot != n;
                *slot = n;
            }
            s.pump(g, saturated, now_ms, grants);
            (changed || !grants.is_empty()).then_some(())
        },
        (),
    )
}

/// How long (ms) a provider says it has nothing left, from its answer's
/// headers, in either dialect:
/// - OpenAI: `x-ratelimit-remaining-{requests,tokens}: 0` with
///   `x-ratelimit-reset-{requests,tokens}` a duration (`6m0s`, `1.5s`);
///   OpenAI's rate-limits guide, "Rate limits in headers".
/// - Anthropic: `anthropic-ratelimit-{requests,tokens,input-tokens,
///   output-tokens}-remaining: 0` with `…-reset` an RFC 3339 time (when the
///   limit is fully replenished); Anthropic's API reference, "Rate limits",
///   response headers.
///
/// The longest wait of the exhausted limits; `None` when none is, or its
/// reset does not parse (a malformed header never pauses anything).
pub fn provider_reset_ms(header: &dyn Fn(&str) -> Option<String>, now_ms: u64) -> Option<u64> {
    let openai = ["requests", "tokens"].into_iter().filter_map(|kind| {
        exhausted(header(&format!("x-ratelimit-remaining-{kind}")))?;
        parse_reset(&header(&format!("x-ratelimit-reset-{kind}"))?)
    });
    let anthropic = ["requests", "tokens", "input-tokens", "output-tokens"]
        .into_iter()
        .filter_map(|kind| {
            exhausted(header(&format!("anthropic-ratelimit-{kind}-remaining")))?;
            let at = header(&format!("anthropic-ratelimit-{kind}-reset"))?;
            let at: jiff::Timestamp = at.trim().parse().ok()?;
            let at_ms = u64::try_from(at.as_millisecond()).ok()?;
            Some(at_ms.saturating_sub(now_ms))
        });
    openai.chain(anthropic).max()
}

fn exhausted(remaining: Option<String>) -> Option<()> {
    (remaining?.trim() == "0").then_some(())
}

/// Parses an OpenAI-style reset (`1s`, `6m0s`, `20ms`, `1h2m3.5s`) or a
/// plain number of seconds, in ms. `None`: not a duration.
pub fn parse_reset(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() || text.len() > 32 {
        return None;
    }
    if let Ok(secs) = text.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| (secs * 1000.0).ceil() as u64);
    }
    let mut total = 0f64;
    let mut rest = text;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&i| i > 0)?;
        let value: f64 = rest[..split].parse().ok()?;
        rest = &rest[split..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ms" => 1.0,
            "s" => 1_000.0,
            "m" => 60_000.0,
            "h" => 3_600_000.0,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    (total.is_finite() && total >= 0.0).then(|| total.ceil() as u64)
}

#[cfg(test)]
mod tests;
