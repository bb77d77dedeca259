//! All-or-nothing reservation across the buckets that apply to a request
//! (docs/src/design.md, "Admit"), on shared data with compare-and-swap so that
//! every Envoy worker sees one exact count.
//!
//! Records. The buckets of one scope live in one shared-data value, a
//! [`Bundle`](crate::limits::record::Bundle): a scope is a rule id's parent
//! (`tier/free` for `tier/free/requests`, `tier/free/daily_tokens`, …;
//! `model/m` for a model's requests and tokens; `route/v1`), so a request
//! reads and compare-and-swaps one key per scope it touches, at admission
//! and again at settlement, whatever the number of buckets in it.
//!
//! Key set. Envoy never frees a shared-data key, so the key set is fixed by
//! the policy, not by traffic, and every key is created up front by
//! [`prepare`]. A shared scope (per model, per route, a team, a tier's
//! anonymous total) is one key, `sluice:v1:rec:{scope}`. A per-caller scope
//! (a tier's per-caller limits) has:
//! - one *dedicated* record per API key declared in the policy for that
//!   tier (`sluice:v1:rec:{scope}:declared:{key}`): declared callers never
//!   compete for anything;
//! - `principal_slots` *hashed* records shared by every other caller (JWT
//!   subjects, trusted headers, addresses, undeclared keys),
//!   `sluice:v1:rec:{scope}:{slot}`: a caller hashes to a slot and probes
//!   up to [`PROBES`] slots from there;
//! - for each calendar budget (daily/monthly), a count-min sketch of the
//!   window's charges by hashed callers: [`SKETCH_DEPTH`] rows of
//!   `sketch_width` cells, one key each (`sluice:v1:{rule}:sketch:{r}:{c}`).
//!
//! Who may take a hashed record. It changes hands as a whole, when every
//! bucket in it may: a rate bucket once drained (handing it over loses
//! nothing), a budget once drained or when its owner has not touched the
//! record for `slot_hold` (what it was charged this window stays in the
//! sketch, and a caller who gets a record starts each budget from its
//! sketch estimate, which never under-counts: every take and charge is
//! added to the sketch, every give-back taken off it after the record). So
//! eviction can refuse a caller early, never let it past a hard budget. A
//! record in use is never taken: a flood of new identities cannot take an
//! active caller's capacity. When every probed record is in use the caller
//! falls back to the scope's *overflow* record
//! (`sluice:v1:rec:{scope}:overflow`), shared by every caller in that
//! position: its rates are one bucket for all of them, its budgets are each
//! caller's own sketch estimate (so a caller who did nothing is never
//! refused because others share its probe window, and no budget is
//! overshot). When the overflow's shared rate is spent too the caller is
//! refused with [`Refusal::NoSlot`] (429 `capacity_exhausted`, counted),
//! with the time until it refills as its Retry-After; never a misleading
//! budget refusal. Where a caller probes is keyed by the deployment's
//! hash key (`crate::policy::keys::HashKey`), so an outsider cannot
//! choose identities that share a victim's window. Each bucket's entry says when it will be
//! idle, so whether a record may change hands is read from the record
//! alone (for a limit changed by a reload, from the limit it was last
//! written under).
//!
//! Bounds. Keys per per-caller scope: `principal_slots` + declared keys of
//! the tier, + `SKETCH_DEPTH × sketch_width` per calendar budget. The
//! sketch over-counts a caller by at most `e/sketch_width` of everything
//! hashed callers were charged on that rule this window, with probability
//! at least `1 − e^−SKETCH_DEPTH` (≈ 98 %); a tier's `anonymous_total`
//! bounds that total.
//!
//! Contention. A CAS mismatch means another worker changed the record since
//! we read it; we re-read and retry, up to `cas_max_retries` times (every
//! mismatch means another request made progress, so exhaustion needs a
//! sustained storm on one key). Every loop is [`crate::state::store::retry`];
//! retries and exhaustion are counted (`sluice_cas_retries_total`,
//! `sluice_cas_exhausted_total`). On exhaustion a take refuses the request
//! by the record's first bucket, never lets it through unchecked. A
//! settlement tries [`SETTLE_TRIES_FACTOR`] times as long (its usage
//! already happened); a charge that still cannot be written is reported to
//! the caller, which counts and logs it; a give-back that cannot be written
//! over-counts until the bucket drains (the safe side).
//!
//! All or nothing. Within a record every bucket is taken in one write or
//! none is; across records they are taken one record after the other, and
//! when one refuses, the records already taken are given back and the
//! refusing bucket (the first of the request's buckets, in claim order,
//! that does not fit) decides the answer. Between the take and the
//! give-back a concurrent request may see those units in use and be
//! refused: the error is on the safe side.

use std::sync::Arc;

use crate::limits::bucket::{window_start, BucketState, Quota, Shortfall};
use crate::limits::record::{rule_hash, Bundle, Kept};
use crate::limits::shares::Pool;
use crate::limits::slot_table::{self, SlotClaim, SlotSeen, SlotTable};
use crate::policy::units::SCALE;
use crate::policy::Limit;
use crate::state::codec::{Reader, Record, Writer};
pub use crate::state::store::SETTLE_TRIES_FACTOR;
use crate::state::store::{self, Attempt, Contention, SharedStore, StoreError, Tries, Updated};

/// Slots probed from a principal's home slot.
pub const PROBES: u32 = 8;
/// Rows of a budget's count-min sketch: the chance that every row
/// over-counts by more than the bound is `e^−4`.
pub const SKETCH_DEPTH: u32 = 4;
const KEY_PREFIX: &str = "sluice:v1:";
const RECORD_PREFIX: &str = "sluice:v1:rec:";
pub(crate) const GLOBAL_OWNER: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// One bucket per principal.
    PerPrincipal,
    /// One bucket for everyone (per model, per route).
    Global,
    /// One bucket per run of a caller (`crate::limits::runs`).
    PerRun,
}

/// One bucket definition of the policy. `id` is stable across reloads, so
/// the live count survives a policy change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Shared by every hold of the bucket (a hold names its rule).
    pub id: Arc<str>,
    pub limit: Limit,
    pub scope: Scope,
    /// Known from the id at load, so a request computes neither: the
    /// entry's name in its record ([`rule_hash`]) and the key of its
    /// scope's shared record.
    hash: u64,
    global_key: Arc<str>,
    /// The length of the id's parent ([`scope_of`]): a reservation
    /// groups its claims by record, comparing each with the earlier ones.
    record_len: usize,
}

impl Rule {
    pub fn new(id: impl Into<Arc<str>>, limit: Limit, scope: Scope) -> Rule {
        let id: Arc<str> = id.into();
        Rule {
            hash: rule_hash(&id),
            global_key: global_key(scope_of(&id)).into(),
            record_len: scope_of(&id).len(),
            id,
            limit,
            scope,
        }
    }

    /// The entry's name in its record.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// The scope whose record holds this bucket: the id's parent.
    pub fn record(&self) -> &str {
        &self.id[..self.record_len]
    }
}

/// How the per-principal tables are sized (from `state` in the policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub slots: u32,
    pub sketch_width: u32,
    /// A budget slot untouched this long may go to another caller.
    pub hold_ms: u64,
    /// The run table (`crate::limits::runs`); no slots without `runs`.
    pub runs: crate::limits::run_table::RunTable,
}

/// Who takes: the principal's hash, and its name when the policy declares
/// it (an API key listed in the policy), which gives it dedicated keys.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    pub hash: u64,
    pub declared: Option<&'a str>,
    /// The caller's run, hashed with its identity (0: none).
    pub run: u64,
}

impl Caller<'_> {
    pub fn hashed(hash: u64) -> Caller<'static> {
        Caller {
            hash,
            declared: None,
            run: 0,
        }
    }
}

/// A bucket to take from for one request.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub rule: &'a Rule,
    pub amount: u64,
    /// A soft cap never refuses: past it the units are charged anyway and
    /// the reservation says so (`over_soft`).
    pub soft: bool,
    /// A global bucket's fair shares and the caller's group in them (see
    /// `crate::limits::shares`); `None`: one pool for everyone.
    pub share: Option<Share<'a>>,
    /// Take a worker lease on top, when the bucket is far from its end
    /// (`crate::limits::lease`); `None`: exactly `amount`.
    pub lease: Option<LeaseAsk>,
}

/// How big a worker lease may be: at most `left ÷ divisor` of what the
/// bucket has left after the request, and at most `max_permille` of its
/// capacity. Less than one unit: no lease (the strict path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseAsk {
    pub divisor: u64,
    pub max_permille: u32,
}

impl LeaseAsk {
    /// The extra units to lease when `left` units are left after the
    /// request, under `limit`.
    pub fn extra(&self, left: u64, limit: &Limit) -> u64 {
        let max = (limit.capacity() as u128 * u128::from(self.max_permille) / 1000) as u64;
        (left / self.divisor.max(1)).min(max)
    }
}

/// A shared bucket's shares, and the group the caller draws from.
#[derive(Debug, Clone, Copy)]
pub struct Share<'a> {
    pub table: &'a crate::limits::shares::ShareTable,
    pub group: u64,
}

impl<'a> Claim<'a> {
    pub fn hard(rule: &'a Rule, amount: u64) -> Claim<'a> {
        Claim {
            rule,
            amount,
            soft: false,
            share: None,
            lease: None,
        }
    }

    /// Asks for a worker lease on top (a soft cap never takes one).
    fn leases(&self) -> bool {
        self.lease.is_some() && !self.soft
    }
}

/// Where a bucket lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Global,
    /// A declared caller's own record.
    Dedicated,
    /// A record of the hashed table (may change hands).
    Hashed,
    /// The scope's overflow record, for callers whose probed records are
    /// all in use: rates shared, budgets in the sketch only.
    Overflow,
    /// A run's record (`crate::limits::runs`): never changes hands while
    /// the run is live.
    Run,
}

/// Units held in one bucket, enough to give them back later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The record's key.
    pub key: Arc<str>,
    pub rule: Arc<str>,
    pub placement: Placement,
    /// Principal hash that owns the record; for a shared bucket the
    /// caller's group in its shares (0: none, see
    /// `crate::limits::shares::REST`).
    pub owner: u64,
    pub amount: u64,
    pub limit: Limit,
    pub taken_ms: u64,
}

/// What a successful reservation holds, and the tightest bucket's quota.
#[derive(Debug, Clone, Default)]
pub struct Reservation {
    /// One per claim, in claim order.
    pub held: Vec<Held>,
    /// The quota of each claim's bucket after the take, in claim order.
    pub quotas: Vec<Quota>,
    /// Index into the claims of the bucket with the smallest share left.
    pub tightest: Option<(usize, Quota)>,
    /// Indexes of soft claims that were past their cap.
    pub over_soft: Vec<usize>,
    /// Worker leases taken on top (claims with a [`LeaseAsk`]): the claim's
    /// index, the units held (`amount`), the bucket's quota then.
    pub leases: Vec<(usize, Held, Quota)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Claim `index` does not fit.
    Full { index: usize, shortfall: Shortfall },
    /// Claim `index` found every probed slot in use by other callers.
    NoSlot { index: usize, retry_after_ms: u64 },
    /// Claim `index` lost every compare-and-swap attempt.
    Contended { index: usize },
    /// The host refused a write.
    Host { index: usize, message: String },
}

pub struct Reserver<'a> {
    pub store: &'a dyn SharedStore,
    pub layout: Layout,
    /// Compare-and-swap attempts per record update (`state.cas_max_retries`;
    /// a settlement [`SETTLE_TRIES_FACTOR`] times as many).
    pub tries: Tries,
}

/// Creates every key a rule can use, empty, unless it exists: the hot path
/// then only ever updates keys under CAS (Envoy ignores CAS on a missing
/// key, so creating keys there could lose a concurrent count). Each rule
/// comes with the declared principals that get dedicated records in it.
pub fn prepare(
    store: &dyn SharedStore,
    rules: &[(Rule, Vec<String>)],
    layout: &Layout,
) -> Result<usize, StoreError> {
    let empty = Bundle::default().encode();
    let cell = SketchCell::default().encode();
    let mut keys: Vec<(String, &[u8])> = Vec::new();
    for (rule, declared) in rules {
        let scope = rule.record();
        match rule.scope {
            Scope::Global => keys.push((global_key(scope), &empty)),
            Scope::PerRun => keys.extend(
                crate::limits::run_table::table(&layout.runs)
                    .keys()
                    .map(|k| (k, &empty[..])),
            ),
            Scope::PerPrincipal => {
                keys.extend(slot_table(scope, layout).keys().map(|k| (k, &empty[..])));
                keys.push((overflow_key(scope), &empty[..]));
                keys.extend(
                    declared
                        .iter()
                        .map(|p| (dedicated_key(scope, p), &empty[..])),
                );
                if rule.limit.window.is_some() {
                    for row in 0..SKETCH_DEPTH {
                        keys.extend(
                            (0..layout.sketch_width)
                                .map(|col| (cell_key(&rule.id, row, col), &cell[..])),
                        );
                    }
                }
            }
        }
    }
    // A scope's records are listed once per rule in it: created once.
    let mut seen = std::collections::HashSet::new();
    let mut created = 0;
    for (key, value) in keys {
        if seen.insert(key.clone()) && store.get(&key).is_none() {
            store.set(&key, value, 0)?;
            created += 1;
        }
    }
    Ok(created)
}

fn global_key(scope: &str) -> String {
    [RECORD_PREFIX, scope].concat()
}
/// The hashed records of a per-caller scope (`{RECORD_PREFIX}{scope}:{slot}`).
fn slot_table<'a>(scope: &'a str, layout: &Layout) -> SlotTable<'a> {
    SlotTable::named(RECORD_PREFIX, scope, layout.slots, PROBES)
}
fn overflow_key(scope: &str) -> String {
    [RECORD_PREFIX, scope, ":overflow"].concat()
}
fn dedicated_key(scope: &str, principal: &str) -> String {
    [RECORD_PREFIX, scope, ":declared:", principal].concat()
}
fn cell_key(rule: &str, row: u32, col: u32) -> String {
    format!("{KEY_PREFIX}{rule}:sketch:{row}:{col}")
}

/// One sketch cell: millionths charged in the window starting at `window`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SketchCell {
    pub window: u64,
    pub used: u64,
}

/// Column of `principal` in sketch row `row`: an independent mix per row
/// (SplitMix64's finalizer over the principal hash and the row).
fn column(principal: u64, row: u32, width: u32) -> u32 {
    let mut z = principal ^ (u64::from(row) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z % u64::from(width.max(1))) as u32
}

/// Where a scope's record lives right now, and what it holds.
pub(crate) struct Located {
    pub(crate) key: Arc<str>,
    pub(crate) bundle: Bundle,
    pub(crate) cas: u32,
    pub(crate) owner: u64,
    pub(crate) placement: Placement,
}

/// What one record's take gave each of its claims: the claim's index, what
/// it holds, its quota, whether past a soft cap, a worker lease on top.
type Taken = Vec<(usize, Held, Quota, bool, Option<Held>)>;

/// The usage a read of the committed count in shared data reports for a
/// shared bucket (tests and tools): millionths in use, as last written.
#[cfg(test)]
pub fn shared_used(store: &dyn SharedStore, rule_id: &str) -> u64 {
    let (bytes, _) = store
        .get(&global_key(scope_of(rule_id)))
        .unwrap_or_default();
    let bundle = Bundle::decode(bytes);
    bundle
        .get(rule_hash(rule_id))
        .map_or(0, |b| Pool::decode(b).state.used)
}

impl Reserver<'_> {
    /// Takes every claim or none: one record after the other, each in one
    /// write.
    pub fn reserve(
        &self,
        claims: &[Claim],
        caller: Caller,
        now_ms: u64,
        effort: &mut Contention,
    ) -> Result<Reservation, Refusal> {
        let mut taken: Vec<Option<(Held, Quota, bool)>> = vec![None; claims.len()];
        let mut leases = Vec::new();
        let mut group = Vec::with_capacity(claims.len());
        for first in 0..claims.len() {
            if !next_group(claims, first, &mut group) {
                continue;
            }
            match self.take_record(claims, &group, caller, now_ms, effort) {
                Ok(items) => {
                    for (i, held, quota, over, lease) in items {
                        if let Some(lease) = lease {
                            leases.push((i, lease, quota));
                        }
                        taken[i] = Some((held, quota, over));
                    }
                }
                Err((index, refusal)) => {
                    // Everything taken so far goes back: the claims' holds
                    // and the leases on top of them.
                    let held_so_far: Vec<(&Held, u64)> = taken
                        .iter()
                        .flatten()
                        .map(|(held, _, _)| held)
                        .chain(leases.iter().map(|(_, lease, _)| lease))
                        .map(|h| (h, 0))
                        .collect();
                    self.settle_all(&held_so_far, now_ms, effort);
                    return Err(match refusal {
                        TakeError::Full(shortfall) => Refusal::Full { index, shortfall },
                        TakeError::NoSlot(retry_after_ms) => Refusal::NoSlot {
                            index,
                            retry_after_ms,
                        },
                        TakeError::Contended => Refusal::Contended { index },
                        TakeError::Host(message) => Refusal::Host { index, message },
                    });
                }
            }
        }
        let mut reservation = assemble(taken);
        reservation.leases = leases;
        Ok(reservation)
    }

    /// Gives back what `held` took.
    pub fn release(&self, held: &[Held], now_ms: u64, effort: &mut Contention) {
        let all: Vec<(&Held, u64)> = held.iter().map(|h| (h, 0)).collect();
        self.settle_all(&all, now_ms, effort);
    }

    /// Replaces what `h` reserved with what was really used (see
    /// [`Self::settle_all`]). `false`: not written (counted in
    /// `cas_exhausted`); for a charge the caller must say so.
    pub fn settle(&self, h: &Held, actual: u64, now_ms: u64, effort: &mut Contention) -> bool {
        self.settle_all(&[(h, actual)], now_ms, effort) == 0
    }

    /// Replaces what each held bucket reserved with what was really used:
    /// gives back the difference, or charges the shortfall (which may take
    /// the bucket over its capacity: the usage already happened). One
    /// update per record. Under contention it tries
    /// [`SETTLE_TRIES_FACTOR`] times as often as a take. Returns how many
    /// buckets could still not be written (counted in `cas_exhausted`):
    /// charges the caller must report; a give-back not written merely
    /// over-counts until the bucket drains (the safe side).
    pub fn settle_all(&self, items: &[(&Held, u64)], now_ms: u64, effort: &mut Contention) -> u32 {
        let changed: Vec<(&Held, u64)> = items
            .iter()
            .copied()
            .filter(|(h, actual)| *actual != h.amount)
            .collect();
        let mut unwritten = 0u32;
        let mut done = vec![false; changed.len()];
        for i in 0..changed.len() {
            if done[i] {
                continue;
            }
            let mut group: Vec<(&Held, u64)> = Vec::new();
            for j in i..changed.len() {
                if !done[j] && changed[j].0.key == changed[i].0.key {
                    done[j] = true;
                    group.push(changed[j]);
                }
            }
            unwritten = unwritten.saturating_add(self.settle_record(&group, now_ms, effort));
        }
        unwritten
    }

    /// [`Self::settle_all`] for the buckets of one record.
    fn settle_record(&self, group: &[(&Held, u64)], now_ms: u64, effort: &mut Contention) -> u32 {
        let Some(&(first, _)) = group.first() else {
            return 0;
        };
        match first.placement {
            Placement::Hashed => {}
            Placement::Run => return self.settle_run(group, now_ms, effort),
            // The overflow's budgets live in the sketch alone; its shared
            // rates are settled in place like any record's.
            Placement::Overflow => {
                let mut rates: Vec<(&Held, u64)> = Vec::new();
                for &(h, actual) in group {
                    match h.limit.window {
                        Some(_) => self.settle_sketch(h, actual, now_ms, effort),
                        None => rates.push((h, actual)),
                    }
                }
                return self.settle_in_place(&rates, now_ms, effort);
            }
            _ => return self.settle_in_place(group, now_ms, effort),
        }
        let mine = |bytes: &[u8]| {
            let mut bundle = Bundle::decode(bytes);
            (bundle.owner == first.owner).then(|| {
                for &(h, actual) in group {
                    let seed = || self.seed(h, now_ms);
                    apply_settlement(&mut bundle, h, actual, Some(&seed), now_ms);
                }
                bundle.touched_ms = bundle.touched_ms.max(now_ms);
                bundle.encode()
            })
        };
        let written = self.update(&first.key, self.tries.settle(), effort, mine);
        let unwritten = match written {
            Updated::Written => 0,
            Updated::Exhausted | Updated::Failed => lost_charges(group, written),
            // The record changed hands since the take (it drained, or a
            // budget went untouched): settle where the caller lives now.
            Updated::Unchanged => group
                .iter()
                .filter(|&&(h, actual)| !self.settle_moved(h, actual, now_ms, effort))
                .count() as u32,
        };
        // Whether or not the record could be written: a charge follows the
        // caller into its sketch, never dropped with a record it lost.
        for &(h, actual) in group {
            self.settle_sketch(h, actual, now_ms, effort);
        }
        unwritten.min(group.len() as u32)
    }

    /// Settles the buckets of one record that never changes hands (a
    /// shared, dedicated or overflow record) in one update; the charges
    /// that could not be written.
    fn settle_in_place(&self, group: &[(&Held, u64)], now_ms: u64, effort: &mut Contention) -> u32 {
        let Some(&(first, _)) = group.first() else {
            return 0;
        };
        let written = self.update(&first.key, self.tries.settle(), effort, |bytes| {
            let mut bundle = Bundle::decode(bytes);
            for &(h, actual) in group {
                apply_settlement(&mut bundle, h, actual, None, now_ms);
            }
            Some(bundle.encode())
        });
        lost_charges(group, written)
    }

    /// A hashed budget's sketch after its record was settled: a give-back
    /// leaves the sketch ahead meanwhile, never behind.
    fn settle_sketch(&self, h: &Held, actual: u64, now_ms: u64, effort: &mut Contention) {
        let Some(window) = h.limit.window else {
            return;
        };
        let delta = actual.abs_diff(h.amount);
        if actual > h.amount {
            let start = window_start(window, now_ms);
            let tries = self.tries.settle();
            self.sketch_add(&h.rule, h.owner, delta, start, tries, effort);
        } else {
            self.sketch_sub(&h.rule, h.owner, delta, &h.limit, h.taken_ms, now_ms);
        }
    }

    /// Settles one bucket whose hashed record changed hands: where the
    /// caller lives now, taking a record for a charge rather than forget
    /// it. `false`: a charge with nowhere to go (counted like an exhausted
    /// write).
    fn settle_moved(&self, h: &Held, actual: u64, now_ms: u64, effort: &mut Contention) -> bool {
        let charge = actual > h.amount;
        let scope = scope_of(&h.rule);
        let found = self
            .locate_caller(scope, Caller::hashed(h.owner), now_ms)
            .ok()
            .filter(|at| charge || at.bundle.owner == h.owner)
            .map(|at| at.key);
        let Some(key) = found else {
            if charge {
                effort.cas_exhausted = effort.cas_exhausted.saturating_add(1);
            }
            return !charge;
        };
        let tries = self.tries.settle();
        let written = self.update(&key, tries, effort, |bytes| {
            let mut bundle = Bundle::decode(bytes);
            if bundle.owner != h.owner {
                if !self.takeable(&bundle, now_ms) {
                    return None;
                }
                bundle = Bundle::new(h.owner, now_ms);
            }
            let seed = || self.seed(h, now_ms);
            apply_settlement(&mut bundle, h, actual, Some(&seed), now_ms);
            bundle.touched_ms = now_ms;
            Some(bundle.encode())
        });
        if written == Updated::Unchanged && charge {
            // Taken by another caller between locate and write: the charge
            // has nowhere to go, counted like an exhausted write.
            effort.cas_exhausted = effort.cas_exhausted.saturating_add(1);
        }
        written == Updated::Written || (written == Updated::Unchanged && !charge)
    }

    /// [`store::update`] on a prepared key: a missing key (not prepared,
    /// so not ours to create on the hot path) is left alone.
    pub(crate) fn update(
        &self,
        key: &str,
        tries: u32,
        effort: &mut Contention,
        f: impl Fn(&[u8]) -> Option<Vec<u8>>,
    ) -> Updated {
        store::update(self.store, key, tries, effort, |bytes| f(bytes?))
    }

    /// Where a worker lease of this claim's bucket lives, known without a
    /// read: a shared record (the caller's group in its shares) or a
    /// declared caller's own; `None`: never leased (a hashed record).
    pub fn lease_place(&self, claim: &Claim, caller: Caller) -> Option<(String, u64, Placement)> {
        let scope = claim.rule.record();
        match (claim.rule.scope, caller.declared) {
            (Scope::Global, _) => {
                let group = claim.share.filter(|_| !claim.soft).map_or(0, |s| s.group);
                Some((global_key(scope), group, Placement::Global))
            }
            (Scope::PerPrincipal, Some(name)) => Some((
                dedicated_key(scope, name),
                caller.hash.max(GLOBAL_OWNER + 1),
                Placement::Dedicated,
            )),
            (Scope::PerPrincipal, None) | (Scope::PerRun, _) => None,
        }
    }

    /// What a claim's bucket holds now, without taking anything.
    pub fn peek(&self, claim: &Claim, caller: Caller, now_ms: u64) -> Quota {
        let rule = claim.rule;
        let state = match self.locate(rule, caller, now_ms) {
            Ok(at) => self.current(&at, rule, now_ms),
            Err(_) => self.seed_rule(
                &rule.id,
                &rule.limit,
                caller.hash.max(GLOBAL_OWNER + 1),
                now_ms,
            ),
        };
        state.at(&rule.limit, now_ms).quota(&rule.limit, now_ms)
    }

    /// Would the claim be refused now? A peek, not a reservation: the
    /// shortfall the bucket would answer with, or `None` (it fits, or the
    /// caller has no slot to read: only a reservation can tell then).
    pub fn shortfall(&self, claim: &Claim, caller: Caller, now_ms: u64) -> Option<Shortfall> {
        let rule = claim.rule;
        let at = self.locate(rule, caller, now_ms).ok()?;
        // The overflow's shared rate is not the caller's own limit: only a
        // reservation answers for it (`capacity_exhausted`).
        if at.placement == Placement::Overflow && rule.limit.window.is_none() {
            return None;
        }
        let state = self.current(&at, rule, now_ms);
        state.take(claim.amount, &rule.limit, now_ms).err()
    }

    /// The state of `rule`'s bucket in a located record (a budget missing
    /// from a hashed record: its sketch estimate).
    fn current(&self, at: &Located, rule: &Rule, now_ms: u64) -> BucketState {
        match (at.placement, at.bundle.get(rule.hash())) {
            (Placement::Global, bytes) => Pool::decode(bytes.unwrap_or_default()).state,
            // An overflow budget is the caller's own, in the sketch.
            (Placement::Overflow, _) if rule.limit.window.is_some() => {
                self.seed_rule(&rule.id, &rule.limit, at.owner, now_ms)
            }
            (_, Some(bytes)) => Kept::decode(bytes).state(at.owner),
            (Placement::Hashed, None) => self.seed_rule(&rule.id, &rule.limit, at.owner, now_ms),
            (Placement::Dedicated | Placement::Overflow | Placement::Run, None) => BucketState {
                owner: at.owner,
                ..BucketState::default()
            },
        }
    }

    /// Takes the claims `group` (indexes into `claims`, all of one record)
    /// in one write, all or none. `Err`: the first claim that refused.
    fn take_record(
        &self,
        claims: &[Claim],
        group: &[usize],
        caller: Caller,
        now_ms: u64,
        effort: &mut Contention,
    ) -> Result<Taken, (usize, TakeError)> {
        let first = group.first().map_or(0, |&i| i);
        let Some(rule) = claims.get(first).map(|c| c.rule) else {
            return Ok(Vec::new());
        };
        // The read spans several keys (the probed slots), so the loop is
        // `store::retry` around locate-then-write, not a one-key update.
        let taken = store::retry(self.tries.take(), effort, || {
            let mut at = match self.locate(rule, caller, now_ms) {
                Ok(at) => at,
                Err(frees_in) => return Attempt::Done(Err((first, TakeError::NoSlot(frees_in)))),
            };
            // Only a shared bucket with fair shares writes on a refusal
            // (from the record as read): only then is a copy kept.
            let shared = at.placement == Placement::Global;
            let original = (shared && group.iter().any(|&i| claims[i].share.is_some()))
                .then(|| at.bundle.clone());
            let (outcome, write) = self.fill(&mut at, claims, group, now_ms);
            let bytes = match (&outcome, write, original) {
                (Ok(_), _, _) => at.bundle.encode(),
                // A refusal that marks a group of shares active.
                (Err(_), Some((id, pool)), Some(mut marked)) => {
                    marked.put_with(id, |w| pool.write(w));
                    marked.encode()
                }
                (Err(_), _, _) => return Attempt::Done(outcome.map(|q| (at, q))),
            };
            match self.store.set(&at.key, &bytes, at.cas) {
                Ok(()) => Attempt::Done(outcome.map(|q| (at, q))),
                Err(StoreError::CasMismatch) => Attempt::Lost,
                Err(StoreError::Host(message)) => match outcome {
                    // Only the activity mark was lost: the refusal stands.
                    Err(refused) => Attempt::Done(Err(refused)),
                    Ok(_) => Attempt::Done(Err((first, TakeError::Host(message)))),
                },
            }
        });
        let (at, quotas) = taken.ok_or((first, TakeError::Contended))??;
        let items: Taken = group
            .iter()
            .zip(quotas)
            .map(|(&i, (quota, over, extra))| {
                let c = &claims[i];
                let held = Held {
                    key: at.key.clone(),
                    rule: c.rule.id.clone(),
                    placement: at.placement,
                    owner: match (at.placement, c.share) {
                        (Placement::Global, Some(share)) if !c.soft => share.group,
                        (Placement::Global, _) => 0,
                        _ => at.owner,
                    },
                    amount: c.amount,
                    limit: c.rule.limit,
                    taken_ms: now_ms,
                };
                let lease = (extra > 0).then(|| Held {
                    amount: extra,
                    ..held.clone()
                });
                (i, held, quota, over, lease)
            })
            .collect();
        // After the record (just touched, so nobody takes it meanwhile):
        // the sketch never lags a budget's count.
        let sketched = matches!(at.placement, Placement::Hashed | Placement::Overflow);
        if sketched && !self.sketch_takes(&items, now_ms, effort) {
            let held: Vec<Held> = items.into_iter().map(|(_, h, _, _, _)| h).collect();
            self.release(&held, now_ms, effort);
            return Err((first, TakeError::Contended));
        }
        Ok(items)
    }

    /// Adds each budget take of a hashed record to its sketch; `false`
    /// (what was added taken off again) when a cell could not be written.
    fn sketch_takes(&self, items: &Taken, now_ms: u64, effort: &mut Contention) -> bool {
        let tries = self.tries.take();
        let mut added: Vec<&Held> = Vec::new();
        for (_, h, _, _, _) in items {
            let Some(window) = h.limit.window else {
                continue;
            };
            let start = window_start(window, now_ms);
            if !self.sketch_add(&h.rule, h.owner, h.amount, start, tries, effort) {
                for a in added {
                    self.sketch_sub(&a.rule, a.owner, a.amount, &a.limit, now_ms, now_ms);
                }
                return false;
            }
            added.push(h);
        }
        true
    }

    /// Applies the group's takes to the located record. `Err`: the first
    /// claim that does not fit, with the shares' activity mark to write
    /// anyway, if any.
    #[allow(clippy::type_complexity)]
    fn fill(
        &self,
        at: &mut Located,
        claims: &[Claim],
        group: &[usize],
        now_ms: u64,
    ) -> (
        Result<Vec<(Quota, bool, u64)>, (usize, TakeError)>,
        Option<(u64, Pool)>,
    ) {
        let mut quotas = Vec::with_capacity(group.len());
        for &i in group {
            let c = &claims[i];
            let (limit, id) = (&c.rule.limit, c.rule.hash());
            if at.placement == Placement::Global {
                let pool = Pool::decode(at.bundle.get(id).unwrap_or_default());
                // The record as read is kept only for a lease's second take.
                let before = c.leases().then(|| pool.clone());
                match take_pool(pool, c, now_ms) {
                    Ok((next, quota, over)) => {
                        let (next, quota, extra) = match before {
                            Some(pool) => lease_pool(pool, next, quota, c, now_ms),
                            None => (next, quota, 0),
                        };
                        at.bundle.put_with(id, |w| next.write(w));
                        quotas.push((quota, over, extra));
                    }
                    Err((shortfall, mark)) => {
                        return (Err((i, TakeError::Full(shortfall))), mark.map(|m| (id, m)))
                    }
                }
                continue;
            }
            let state = self.current(at, c.rule, now_ms);
            let shared_rate = at.placement == Placement::Overflow && limit.window.is_none();
            let (next, over) = match self.take_in(at.placement, state, c, now_ms) {
                Ok(next) => (next, false),
                Err(_) if c.soft => (state.charge(c.amount, limit, now_ms), true),
                // The overflow's rate is everyone's there: not this
                // caller's own limit, so not its refusal.
                Err(shortfall) if shared_rate => {
                    return (Err((i, TakeError::NoSlot(shortfall.retry_after_ms))), None)
                }
                Err(shortfall) => return (Err((i, TakeError::Full(shortfall))), None),
            };
            // A lease on top, never from a hashed record (it may change
            // hands) nor past a soft cap.
            let extra = match (c.lease, at.placement, over) {
                (Some(ask), Placement::Dedicated, false) => {
                    let left = next.quota(limit, now_ms).remaining;
                    ask.extra(left, limit)
                }
                _ => 0,
            };
            // A lease is only what was really taken: if the larger take
            // does not fit after all, no lease (never one not taken).
            let (next, extra) = match state.take(c.amount.saturating_add(extra), limit, now_ms) {
                Ok(leased) if extra > 0 => (leased, extra),
                _ => (next, 0),
            };
            // An overflow budget lives in the sketch alone (added after
            // the record is written, like a hashed record's).
            if !(at.placement == Placement::Overflow && limit.window.is_some()) {
                at.bundle
                    .put_with(id, |w| Kept::of(next, limit, now_ms).write(w));
            }
            let mut quota = self.run_reset(at.placement, next.quota(limit, now_ms));
            // The leased units are still this caller's to use.
            quota.remaining = quota.remaining.saturating_add(extra);
            quotas.push((quota, over, extra));
        }
        at.bundle.owner = match at.placement {
            Placement::Overflow => GLOBAL_OWNER,
            _ => at.owner,
        };
        if matches!(at.placement, Placement::Hashed | Placement::Run) {
            at.bundle.touched_ms = now_ms;
        }
        (Ok(quotas), None)
    }

    /// The record of `scope` for `caller`: the shared key, its dedicated
    /// record, its hashed record, or a record it may take (empty: each
    /// budget in it then starts from the sketch). `Err`: every probed
    /// record is in use; the value is when one frees.
    fn locate(&self, rule: &Rule, caller: Caller, now_ms: u64) -> Result<Located, u64> {
        if rule.scope == Scope::Global {
            let key = rule.global_key.clone();
            let (bytes, cas) = self.store.get(&key).unwrap_or_default();
            return Ok(Located {
                key,
                bundle: Bundle::decode(bytes),
                cas,
                owner: GLOBAL_OWNER,
                placement: Placement::Global,
            });
        }
        if rule.scope == Scope::PerRun {
            return self.locate_run(caller, now_ms);
        }
        self.locate_caller(rule.record(), caller, now_ms)
    }

    /// The record of a per-caller `scope` for `caller` (see [`Self::locate`]).
    fn locate_caller(&self, scope: &str, caller: Caller, now_ms: u64) -> Result<Located, u64> {
        let read = |key: &str| self.store.get(key);
        let owner = caller.hash.max(GLOBAL_OWNER + 1);
        if let Some(name) = caller.declared {
            let key = dedicated_key(scope, name);
            // A declared caller whose record was not prepared (a tier it
            // does not belong to) is placed like anyone else.
            if let Some((bytes, cas)) = read(&key) {
                return Ok(Located {
                    key: key.into(),
                    bundle: Bundle::decode(bytes),
                    cas,
                    owner,
                    placement: Placement::Dedicated,
                });
            }
        }
        self.probe(scope, owner, now_ms)
    }

    /// The hashed record `owner` holds or may take: a free one first, else
    /// the one untouched longest.
    fn probe(&self, scope: &str, owner: u64, now_ms: u64) -> Result<Located, u64> {
        let mut frees_in = u64::MAX;
        let table = slot_table(scope, &self.layout);
        let probed = table.probe(owner).map(|key| {
            let (bytes, cas) = self.store.get(&key).unwrap_or_default();
            (key, cas, Bundle::decode(bytes))
        });
        let found = slot_table::claim(probed, |(_, _, bundle)| {
            if bundle.owner == owner {
                return SlotSeen::Mine;
            }
            // A never-used record ends the chain: the principal would hold
            // it or an earlier one if it had a record.
            if bundle.owner == 0 {
                return SlotSeen::Last((0u8, 0));
            }
            let hold = self.layout.hold_ms;
            if bundle
                .entries()
                .all(|e| Kept::decode(e).idle_at_ms <= now_ms)
            {
                return SlotSeen::Free((0, 0));
            }
            if self.takeable(bundle, now_ms) {
                return SlotSeen::Free((1, bundle.touched_ms));
            }
            let wait = bundle
                .entries()
                .map(|e| Kept::decode(e).frees_in(bundle.touched_ms, hold, now_ms))
                .max()
                .unwrap_or(0);
            frees_in = frees_in.min(wait);
            SlotSeen::Busy
        });
        match found {
            SlotClaim::Mine((key, cas, bundle)) => Ok(Located {
                key: key.into(),
                bundle,
                cas,
                owner,
                placement: Placement::Hashed,
            }),
            SlotClaim::Free((key, cas, _)) => Ok(Located {
                key: key.into(),
                bundle: Bundle::new(owner, now_ms),
                cas,
                owner,
                placement: Placement::Hashed,
            }),
            SlotClaim::Full => self.overflow(scope, owner).ok_or(frees_in),
        }
    }

    /// The scope's overflow record for `owner` (`None`: not prepared, a
    /// scope made by a policy this VM has not loaded).
    fn overflow(&self, scope: &str, owner: u64) -> Option<Located> {
        let key = overflow_key(scope);
        let (bytes, cas) = self.store.get(&key)?;
        Some(Located {
            bundle: Bundle::decode(bytes),
            key: key.into(),
            cas,
            owner,
            placement: Placement::Overflow,
        })
    }

    /// May another caller take this record? Never used, or every bucket
    /// in it drained or (a budget) untouched for `hold_ms` (its charges
    /// are in the sketch).
    fn takeable(&self, bundle: &Bundle, now_ms: u64) -> bool {
        let hold = self.layout.hold_ms;
        bundle.owner == 0
            || bundle
                .entries()
                .all(|e| Kept::decode(e).takeable(bundle.touched_ms, hold, now_ms))
    }

    /// A fresh bucket for the holder of `h`: see [`Self::seed_rule`].
    fn seed(&self, h: &Held, now_ms: u64) -> BucketState {
        self.seed_rule(&h.rule, &h.limit, h.owner, now_ms)
    }

    /// A fresh bucket for `owner`: empty for a rate, and for a budget what
    /// the sketch says it was charged this window (never less than the
    /// truth).
    fn seed_rule(&self, id: &str, limit: &Limit, owner: u64, now_ms: u64) -> BucketState {
        let used = match limit.window {
            Some(window) => {
                let start = window_start(window, now_ms);
                (0..SKETCH_DEPTH)
                    .map(|row| {
                        let key = cell_key(id, row, column(owner, row, self.layout.sketch_width));
                        let (bytes, _) = self.store.get(&key).unwrap_or_default();
                        let cell = SketchCell::decode(&bytes);
                        if cell.window == start {
                            cell.used
                        } else {
                            0
                        }
                    })
                    .min()
                    .unwrap_or(0)
            }
            None => 0,
        };
        BucketState {
            owner,
            used,
            updated_ms: now_ms,
        }
    }

    /// Adds `amount` units to `owner`'s cells for the window starting at
    /// `start`. `false`: a cell could not be written, and what was added is
    /// taken off again.
    fn sketch_add(
        &self,
        rule: &str,
        owner: u64,
        amount: u64,
        start: u64,
        tries: u32,
        effort: &mut Contention,
    ) -> bool {
        let scaled = amount.saturating_mul(SCALE);
        for row in 0..SKETCH_DEPTH {
            let key = cell_key(rule, row, column(owner, row, self.layout.sketch_width));
            let added = self.update(&key, tries, effort, |bytes| {
                let cell = SketchCell::decode(bytes);
                let used = if cell.window == start { cell.used } else { 0 };
                Some(
                    SketchCell {
                        window: start,
                        used: used.saturating_add(scaled),
                    }
                    .encode(),
                )
            });
            if added != Updated::Written {
                for undo in 0..row {
                    let key = cell_key(rule, undo, column(owner, undo, self.layout.sketch_width));
                    self.cell_sub(&key, start, scaled);
                }
                return false;
            }
        }
        true
    }

    /// Takes `amount` units taken at `taken_ms` off `owner`'s cells (a
    /// window that has rolled over since owes nothing). Best effort: a
    /// write lost leaves an over-count, the safe side.
    fn sketch_sub(
        &self,
        rule: &str,
        owner: u64,
        amount: u64,
        limit: &Limit,
        taken_ms: u64,
        now_ms: u64,
    ) {
        let Some(window) = limit.window else {
            return;
        };
        let start = window_start(window, now_ms);
        if window_start(window, taken_ms) != start {
            return;
        }
        for row in 0..SKETCH_DEPTH {
            let key = cell_key(rule, row, column(owner, row, self.layout.sketch_width));
            self.cell_sub(&key, start, amount.saturating_mul(SCALE));
        }
    }

    fn cell_sub(&self, key: &str, start: u64, scaled: u64) {
        self.update(
            key,
            self.tries.settle(),
            &mut Contention::default(),
            |bytes| {
                let cell = SketchCell::decode(bytes);
                (cell.window == start).then(|| {
                    SketchCell {
                        window: start,
                        used: cell.used.saturating_sub(scaled),
                    }
                    .encode()
                })
            },
        );
    }
}

enum TakeError {
    Full(Shortfall),
    NoSlot(u64),
    Contended,
    Host(String),
}

/// The charges of `group` a failed write lost (give-backs lost only
/// over-count, the safe side).
pub(crate) fn lost_charges(group: &[(&Held, u64)], written: Updated) -> u32 {
    let lost = matches!(written, Updated::Exhausted | Updated::Failed);
    group
        .iter()
        .filter(|(h, actual)| lost && *actual > h.amount)
        .count() as u32
}

/// The scope of a rule id: its parent (`tier/free` of `tier/free/tokens`).
fn scope_of(id: &str) -> &str {
    id.rsplit_once('/').map_or(id, |(parent, _)| parent)
}

/// The claims of one record, in claim order, into `group`, when claim
/// `first` is the first of its record (`false`: an earlier claim's
/// record, taken with it). Called for each claim in turn, it gives the
/// groups in the order of their first claim, in one buffer.
fn next_group<'a>(claims: &[Claim<'a>], first: usize, group: &mut Vec<usize>) -> bool {
    fn record<'a>(c: &Claim<'a>) -> (&'a str, Scope) {
        (c.rule.record(), c.rule.scope)
    }
    let key = record(&claims[first]);
    if claims[..first].iter().any(|c| record(c) == key) {
        return false;
    }
    group.clear();
    group.extend((first..claims.len()).filter(|&i| record(&claims[i]) == key));
    true
}

/// The reservation of every claim taken, in claim order.
pub fn assemble(taken: Vec<Option<(Held, Quota, bool)>>) -> Reservation {
    let mut reservation = Reservation {
        held: Vec::with_capacity(taken.len()),
        quotas: Vec::with_capacity(taken.len()),
        ..Reservation::default()
    };
    for (index, (held, quota, over)) in taken.into_iter().flatten().enumerate() {
        reservation.held.push(held);
        reservation.quotas.push(quota);
        if over {
            reservation.over_soft.push(index);
        }
        // Compare shares left: remaining/limit, cross-multiplied.
        let tighter = reservation.tightest.is_none_or(|(_, q)| {
            (
                quota.remaining as u128 * q.limit as u128,
                std::cmp::Reverse(quota.reset_ms),
            ) < (
                q.remaining as u128 * quota.limit as u128,
                std::cmp::Reverse(q.reset_ms),
            )
        });
        if tighter {
            reservation.tightest = Some((index, quota));
        }
    }
    reservation
}

/// A take from a shared bucket: through its fair shares when it has them
/// (the bucket and the group's account move together, see
/// `crate::limits::shares`), else from the bucket alone. `Err`: the
/// shortfall, and the record to write anyway to mark the group active.
#[allow(clippy::type_complexity)]
fn take_pool(
    pool: Pool,
    claim: &Claim,
    now_ms: u64,
) -> Result<(Pool, Quota, bool), (Shortfall, Option<Pool>)> {
    let limit = &claim.rule.limit;
    if let (Some(share), false) = (claim.share, claim.soft) {
        // An admission reports the bucket, as without shares (the
        // tightest bucket's X-RateLimit-*); a refusal reports what the
        // caller's group may take.
        return match pool.take(share.table, share.group, claim.amount, limit, now_ms) {
            Ok((next, _group_view)) => {
                let quota = next.state.quota(limit, now_ms);
                Ok((next, quota, false))
            }
            Err(refused) => Err((refused.shortfall, refused.mark)),
        };
    }
    let pool = pool.at(limit, now_ms);
    let (state, over) = match pool.state.take(claim.amount, limit, now_ms) {
        Ok(next) => (next, false),
        Err(_) if claim.soft => (pool.state.charge(claim.amount, limit, now_ms), true),
        Err(shortfall) => return Err((shortfall, None)),
    };
    let quota = state.quota(limit, now_ms);
    Ok((Pool { state, ..pool }, quota, over))
}

/// A lease on top of a shared bucket's take (`next`, from `pool`), when the
/// claim asks for one and the bucket is far from its end: the record, the
/// quota (the leased units counted as still there), the units leased.
fn lease_pool(pool: Pool, next: Pool, quota: Quota, c: &Claim, now_ms: u64) -> (Pool, Quota, u64) {
    let Some(ask) = c.lease.filter(|_| !c.soft) else {
        return (next, quota, 0);
    };
    let extra = ask.extra(quota.remaining, &c.rule.limit);
    if extra == 0 {
        return (next, quota, 0);
    }
    let bigger = Claim {
        amount: c.amount.saturating_add(extra),
        ..*c
    };
    match take_pool(pool, &bigger, now_ms) {
        Ok((leased, mut q, _)) => {
            q.remaining = q.remaining.saturating_add(extra);
            (leased, q, extra)
        }
        // The group's share allows the request, not the lease on top.
        Err(_) => (next, quota, 0),
    }
}

/// Replaces what `h` reserved with `actual` in its record: gives back the
/// difference or charges it. A per-caller bucket missing from the record
/// starts from `seed` (a hashed record: the sketch), else empty.
pub(crate) fn apply_settlement(
    bundle: &mut Bundle,
    h: &Held,
    actual: u64,
    seed: Option<&dyn Fn() -> BucketState>,
    now_ms: u64,
) {
    let id = rule_hash(&h.rule);
    let charge = actual > h.amount;
    let delta = actual.abs_diff(h.amount);
    let limit = &h.limit;
    if h.placement == Placement::Global {
        let pool = Pool::decode(bundle.get(id).unwrap_or_default());
        let next = if charge {
            pool.charge(h.owner, delta, limit, now_ms)
        } else {
            pool.give_back(h.owner, delta, limit, h.taken_ms, now_ms)
        };
        bundle.put_with(id, |w| next.write(w));
        return;
    }
    let state = match bundle.get(id) {
        Some(bytes) => Kept::decode(bytes).state(bundle.owner),
        None => seed.map_or_else(BucketState::default, |s| s()),
    };
    let next = if charge {
        state.charge(delta, limit, now_ms)
    } else {
        state.give_back(delta, limit, h.taken_ms, now_ms)
    };
    bundle.put_with(id, |w| Kept::of(next, limit, now_ms).write(w));
}

impl Record for SketchCell {
    const LEN: usize = 16;

    fn write(&self, w: &mut Writer) {
        w.u64(self.window).u64(self.used);
    }

    fn read(r: &mut Reader) -> Self {
        SketchCell {
            window: r.u64(),
            used: r.u64(),
        }
    }

    /// By prefix: a prepared (zeroed) key of any length reads as empty.
    fn decode(bytes: &[u8]) -> Self {
        Self::read(&mut Reader::new(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::units::Rate;
    use crate::state::store::MemStore;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn rule(id: &str, amount: u64, scope: Scope) -> Rule {
        Rule::new(
            id,
            Limit {
                rate: Rate {
                    amount,
                    period_ms: 60_000,
                },
                burst: amount,
                window: None,
            },
            scope,
        )
    }

    fn layout(slots: u32) -> Layout {
        Layout {
            slots,
            sketch_width: 64,
            hold_ms: 60_000,
            runs: Default::default(),
        }
    }

    fn reserver(store: &dyn SharedStore, slots: u32) -> Reserver<'_> {
        Reserver {
            store,
            layout: layout(slots),
            tries: Tries::new(64),
        }
    }

    fn plain(rules: &[Rule]) -> Vec<(Rule, Vec<String>)> {
        rules.iter().map(|r| (r.clone(), Vec::new())).collect()
    }

    fn by(p: u64) -> Caller<'static> {
        Caller::hashed(p)
    }

    #[test]
    fn a_rule_names_its_record_by_the_ids_parent() {
        for (id, record) in [
            ("tier/free/tokens", "tier/free"),
            ("route/requests", "route"),
            ("model/llama3.1:8b/requests", "model/llama3.1:8b"),
            ("flat", "flat"),
        ] {
            assert_eq!(rule(id, 1, Scope::Global).record(), record);
            assert_eq!(rule(id, 1, Scope::Global).record(), scope_of(id));
        }
    }

    #[test]
    fn prepare_bounds_the_key_set() {
        let store = MemStore::default();
        let rules = [
            rule("tier/free", 10, Scope::PerPrincipal),
            rule("model/m", 5, Scope::Global),
        ];
        assert_eq!(
            prepare(&store, &plain(&rules), &layout(16)).unwrap(),
            16 + 1 + 1,
            "16 slots and the overflow record of tier/free, model/m's record"
        );
        assert_eq!(
            prepare(&store, &plain(&rules), &layout(16)).unwrap(),
            0,
            "idempotent"
        );
        // Ten thousand principals later the key set is unchanged.
        let r = reserver(&store, 16);
        for p in 0..10_000u64 {
            let _ = r.reserve(
                &[Claim::hard(&rules[0], 1)],
                by(p * 7919 + 3),
                0,
                &mut Contention::default(),
            );
        }
        assert_eq!(store.len(), 18);
    }

    /// Counts the calls made through it.
    #[derive(Default)]
    struct Counted {
        inner: MemStore,
        gets: std::cell::Cell<u32>,
        sets: std::cell::Cell<u32>,
    }
    impl SharedStore for Counted {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.gets.set(self.gets.get() + 1);
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            self.sets.set(self.sets.get() + 1);
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn one_read_and_one_write_per_record_at_admission_and_settlement() {
        let store = Counted::default();
        let mine = ["requests", "tokens", "input_tokens"]
            .map(|w| rule(&format!("tier/pro/{w}"), 1_000, Scope::PerPrincipal));
        let model =
            ["requests", "tokens"].map(|w| rule(&format!("model/m/{w}"), 1_000, Scope::Global));
        let all: Vec<Rule> = mine.iter().chain(&model).cloned().collect();
        let declared = vec![(mine[0].clone(), vec!["key:a".to_string()])];
        let mut prepared = plain(&all);
        prepared.extend(declared);
        prepare(&store.inner, &prepared, &layout(4)).unwrap();
        let r = reserver(&store, 4);
        let claims: Vec<Claim> = all.iter().map(|rule| Claim::hard(rule, 10)).collect();
        let caller = Caller {
            hash: 5,
            declared: Some("key:a"),
            run: 0,
        };
        let mut e = Contention::default();
        let res = r.reserve(&claims, caller, 0, &mut e).unwrap();
        assert_eq!((store.gets.get(), store.sets.get()), (2, 2), "two records");
        assert_eq!(res.held.len(), 5);
        let items: Vec<(&Held, u64)> = res.held.iter().map(|h| (h, 4)).collect();
        assert_eq!(r.settle_all(&items, 0, &mut e), 0);
        assert_eq!((store.gets.get(), store.sets.get()), (4, 4));
        // A hashed caller: its home record, and no more.
        let claims: Vec<Claim> = mine.iter().map(|rule| Claim::hard(rule, 10)).collect();
        r.reserve(&claims, by(6), 0, &mut e).unwrap();
        assert_eq!((store.gets.get(), store.sets.get()), (4 + 1, 4 + 1));
        assert_eq!(shared_used(&store.inner, "model/m/tokens"), 4 * SCALE);
    }

    #[test]
    fn a_record_changes_hands_only_when_every_bucket_in_it_may() {
        let store = MemStore::default();
        let requests = rule("tier/t/requests", 1_000, Scope::PerPrincipal);
        let tokens = rule("tier/t/tokens", 10, Scope::PerPrincipal);
        prepare(
            &store,
            &plain(&[requests.clone(), tokens.clone()]),
            &layout(1),
        )
        .unwrap();
        let r = reserver(&store, 1);
        let mut e = Contention::default();
        // Caller 1 takes 6 of 10 tokens/min (drains in 36 s), then 1 request
        // (drains in 60 ms): a request-only claim later must not see the
        // record as idle while its token bucket is not.
        r.reserve(&[Claim::hard(&tokens, 6)], by(10), 0, &mut e)
            .unwrap();
        r.reserve(&[Claim::hard(&requests, 1)], by(10), 0, &mut e)
            .unwrap();
        let elsewhere = r.reserve(&[Claim::hard(&requests, 1)], by(20), 1_000, &mut e);
        assert_eq!(elsewhere.unwrap().held[0].placement, Placement::Overflow);
        // Once both drained the record goes to caller 2, empty.
        let got = r.reserve(&[Claim::hard(&tokens, 10)], by(20), 36_000, &mut e);
        assert_eq!(got.unwrap().quotas[0].remaining, 0);
    }

    #[test]
    fn all_or_nothing_releases_on_partial_failure() {
        let store = MemStore::default();
        let user = rule("tier/free", 10, Scope::PerPrincipal);
        let model = rule("model/big", 2, Scope::Global);
        prepare(&store, &plain(&[user.clone(), model.clone()]), &layout(16)).unwrap();
        let r = reserver(&store, 16);
        let claims = [Claim::hard(&user, 1), Claim::hard(&model, 1)];
        let mut e = Contention::default();
        assert!(r.reserve(&claims, by(42), 0, &mut e).is_ok());
        assert!(r.reserve(&claims, by(42), 0, &mut e).is_ok());
        let refused = r.reserve(&claims, by(42), 0, &mut e).unwrap_err();
        assert!(matches!(refused, Refusal::Full { index: 1, .. }));
        // The user bucket got its unit back: 8 left, not 7.
        let only_user = [Claim::hard(&user, 1)];
        let res = r.reserve(&only_user, by(42), 0, &mut e).unwrap();
        assert_eq!(res.tightest.unwrap().1.remaining, 7);
    }

    #[test]
    fn principals_are_isolated_and_slots_are_reused_when_idle() {
        let store = MemStore::default();
        let user = rule("tier/free", 2, Scope::PerPrincipal);
        prepare(&store, &plain(std::slice::from_ref(&user)), &layout(1)).unwrap();
        let r = Reserver {
            store: &store,
            layout: layout(1),
            tries: Tries::new(8),
        };
        let c = [Claim::hard(&user, 1)];
        let mut e = Contention::default();
        assert!(r.reserve(&c, by(100), 0, &mut e).is_ok());
        // Principals 200 and 300 find the only slot in use: they share the
        // overflow record's 2/min; 400 is refused, told when it refills
        // (one unit of 2/min: 30 s), never counted in 100's bucket.
        for p in [200, 300] {
            let got = r.reserve(&c, by(p), 0, &mut e).unwrap();
            assert_eq!(got.held[0].placement, Placement::Overflow);
        }
        let refused = r.reserve(&c, by(400), 0, &mut e).unwrap_err();
        assert_eq!(
            refused,
            Refusal::NoSlot {
                index: 0,
                retry_after_ms: 30_000
            }
        );
        // Once principal 100's bucket drained, 200 may take its slot.
        let mut e = Contention::default();
        let got = r.reserve(&c, by(200), 30_000, &mut e).unwrap();
        assert_eq!(got.held[0].placement, Placement::Hashed);
    }

    #[test]
    fn concurrent_workers_admit_exactly_capacity() {
        let store = Arc::new(MemStore::default());
        let model = Arc::new(rule("model/m", 50, Scope::Global));
        let user = Arc::new(rule("tier/t", 1_000, Scope::PerPrincipal));
        prepare(
            store.as_ref(),
            &plain(&[(*model).clone(), (*user).clone()]),
            &layout(64),
        )
        .unwrap();
        let admitted = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (store, model, user, admitted) =
                    (store.clone(), model.clone(), user.clone(), admitted.clone());
                std::thread::spawn(move || {
                    let r = Reserver {
                        store: store.as_ref(),
                        layout: layout(64),
                        tries: Tries::new(1_000),
                    };
                    for i in 0..25u64 {
                        let claims = [Claim::hard(&user, 1), Claim::hard(&model, 1)];
                        if r.reserve(&claims, by(t * 100 + i), 0, &mut Contention::default())
                            .is_ok()
                        {
                            admitted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(admitted.load(std::sync::atomic::Ordering::SeqCst), 50);
    }

    /// A store whose first `fail` writes lose the race.
    struct Contended {
        inner: MemStore,
        fail: std::cell::Cell<u32>,
    }
    impl SharedStore for Contended {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if self.fail.get() > 0 {
                self.fail.set(self.fail.get() - 1);
                return Err(StoreError::CasMismatch);
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn contention_is_retried_counted_and_never_admits_blindly() {
        let store = Contended {
            inner: MemStore::default(),
            fail: 0.into(),
        };
        let model = rule("model/m", 5, Scope::Global);
        prepare(
            &store.inner,
            &plain(std::slice::from_ref(&model)),
            &layout(1),
        )
        .unwrap();
        let r = Reserver {
            store: &store,
            layout: layout(1),
            tries: Tries::new(4),
        };
        let c = [Claim::hard(&model, 1)];
        store.fail.set(3);
        let mut e = Contention::default();
        assert!(r.reserve(&c, by(1), 0, &mut e).is_ok());
        assert_eq!(e.cas_retries, 3);
        store.fail.set(4);
        let refused = r
            .reserve(&c, by(1), 0, &mut Contention::default())
            .unwrap_err();
        assert_eq!(refused, Refusal::Contended { index: 0 });
    }

    #[test]
    fn a_charge_outlasts_contention_a_take_gives_up_on_and_says_when_it_cannot() {
        let store = Contended {
            inner: MemStore::default(),
            fail: 0.into(),
        };
        let tokens = rule("model/m/tokens", 100, Scope::Global);
        prepare(
            &store.inner,
            &plain(std::slice::from_ref(&tokens)),
            &layout(1),
        )
        .unwrap();
        let r = Reserver {
            store: &store,
            layout: layout(1),
            tries: Tries::new(4),
        };
        let held = r
            .reserve(
                &[Claim::hard(&tokens, 10)],
                by(1),
                0,
                &mut Contention::default(),
            )
            .unwrap()
            .held;
        // Four lost races refuse a take; a settlement keeps going.
        store.fail.set(4 * SETTLE_TRIES_FACTOR - 1);
        let mut e = Contention::default();
        assert!(r.settle(&held[0], 60, 0, &mut e), "charged");
        assert_eq!(
            e,
            Contention {
                cas_retries: 4 * SETTLE_TRIES_FACTOR - 1,
                cas_exhausted: 0
            }
        );
        let used = |store: &Contended| shared_used(&store.inner, &tokens.id);
        assert_eq!(used(&store), 60 * SCALE);
        // Past even that bound: not written, and the caller is told.
        store.fail.set(4 * SETTLE_TRIES_FACTOR);
        let mut e = Contention::default();
        assert!(!r.settle(&held[0], 70, 0, &mut e));
        assert_eq!(e.cas_exhausted, 1);
        assert_eq!(used(&store), 60 * SCALE);
    }

    #[test]
    fn settlement_gives_back_or_charges_the_difference() {
        let store = MemStore::default();
        let tokens = rule("tier/t/tokens", 1_000, Scope::PerPrincipal);
        prepare(&store, &plain(std::slice::from_ref(&tokens)), &layout(4)).unwrap();
        let r = Reserver {
            store: &store,
            layout: layout(4),
            tries: Tries::new(8),
        };
        let mut e = Contention::default();
        let c = [Claim::hard(&tokens, 500)];
        let a = r.reserve(&c, by(9), 0, &mut e).unwrap();
        let b = r.reserve(&c, by(9), 0, &mut e).unwrap();
        assert!(r.reserve(&c, by(9), 0, &mut e).is_err(), "1000 reserved");
        r.settle(&a.held[0], 120, 0, &mut e);
        r.settle(&b.held[0], 600, 0, &mut e);
        // 720 really used: 280 left.
        let probe = [Claim::hard(&tokens, 280)];
        assert!(r.reserve(&probe, by(9), 0, &mut e).is_ok());
        let one = [Claim::hard(&tokens, 1)];
        assert!(r.reserve(&one, by(9), 0, &mut e).is_err());
    }

    fn day_budget(id: &str, amount: u64) -> Rule {
        let limit = Limit::windowed(
            amount,
            crate::policy::Window::Day(crate::policy::zone::Zone::UTC),
        );
        Rule::new(id, limit, Scope::PerPrincipal)
    }

    /// Admissions of the declared caller `key:d` and of the hashed caller 7
    /// (active: it took one before), 10 tries each, with `flood` distinct
    /// new callers (one request each) in between.
    fn admissions_under_flood(flood: &[u64]) -> (usize, usize) {
        let store = MemStore::default();
        let user = rule("tier/free/requests", 10, Scope::PerPrincipal);
        let prepared = vec![(user.clone(), vec!["key:d".to_string()])];
        prepare(&store, &prepared, &layout(8)).unwrap();
        let r = reserver(&store, 8);
        let c = [Claim::hard(&user, 1)];
        let declared = Caller {
            hash: 99,
            declared: Some("key:d"),
            run: 0,
        };
        let mut e = Contention::default();
        assert!(r.reserve(&c, by(7), 0, &mut e).is_ok());
        for &p in flood {
            let _ = r.reserve(&c, by(p), 1, &mut e);
        }
        let mut got = (0, 0);
        for i in 0..10 {
            got.0 += usize::from(r.reserve(&c, declared, 2 + i, &mut e).is_ok());
            got.1 += usize::from(r.reserve(&c, by(7), 2 + i, &mut e).is_ok());
        }
        (got.0, got.1)
    }

    #[test]
    fn a_flood_takes_neither_declared_nor_active_capacity() {
        let flood: Vec<u64> = (0..6_000u64).map(|p| p * 7919 + 1_000).collect();
        // Without a flood: 10 of 10 for the declared key, 9 more for 7.
        assert_eq!(admissions_under_flood(&[]), (10, 9));
        assert_eq!(admissions_under_flood(&flood), (10, 9));
    }

    #[test]
    fn a_full_probe_window_falls_back_to_the_shared_overflow_record() {
        let store = MemStore::default();
        let budget = day_budget("tier/free/daily_tokens", 5_000);
        let requests = rule("tier/free/requests", 3, Scope::PerPrincipal);
        let rules = [budget.clone(), requests.clone()];
        prepare(&store, &plain(&rules), &layout(8)).unwrap();
        let r = reserver(&store, 8);
        let c = [Claim::hard(&budget, 10), Claim::hard(&requests, 1)];
        let mut e = Contention::default();
        // Every slot of the table is active (a budget's record is held
        // for `slot_hold` after its last charge).
        for p in 0..200u64 {
            let _ = r.reserve(&c[..1], by(p * 8), 0, &mut e);
        }
        // A caller who did nothing is not refused for its neighbours: it
        // draws on the overflow record (one shared rate, its own budget).
        let first = r.reserve(&c, by(5_000_000), 1_000, &mut e).unwrap();
        assert_eq!(first.held[0].placement, Placement::Overflow);
        assert_eq!(&*first.held[0].key, "sluice:v1:rec:tier/free:overflow");
        assert!(first.quotas[0].remaining <= 4_990, "its own budget");
        assert!(r.reserve(&c, by(5_000_001), 1_000, &mut e).is_ok());
        assert!(r.reserve(&c, by(5_000_002), 1_000, &mut e).is_ok());
        // The shared rate spent: capacity, not the caller's own limit (and
        // no early refusal names it as the caller's).
        assert_eq!(r.shortfall(&c[1], by(5_000_003), 1_000), None);
        assert_eq!(
            r.reserve(&c, by(5_000_003), 1_000, &mut e).unwrap_err(),
            Refusal::NoSlot {
                index: 1,
                retry_after_ms: 20_000
            }
        );
        // Given back at settlement: the overflow's rate is whole again
        // for one more, and the budget charged in the sketch.
        for h in &first.held {
            r.settle(
                h,
                if h.limit.window.is_some() { 4_000 } else { 0 },
                1_001,
                &mut e,
            );
        }
        let again = r.reserve(&c, by(5_000_000), 1_002, &mut e).unwrap();
        assert!(again.quotas[0].remaining <= 990, "{again:?}");
        // Its own budget refuses it (a budget refusal, never past the hard
        // budget); the shared rate is not what answers.
        let big = [Claim::hard(&budget, 1_000), Claim::hard(&requests, 1)];
        assert!(matches!(
            r.reserve(&big, by(5_000_000), 1_003, &mut e),
            Err(Refusal::Full { index: 0, .. })
        ));
    }

    #[test]
    fn an_evicted_budget_is_remembered_by_the_sketch() {
        let store = MemStore::default();
        let budget = day_budget("tier/free/daily_tokens", 100);
        prepare(&store, &plain(std::slice::from_ref(&budget)), &layout(1)).unwrap();
        let r = reserver(&store, 1);
        let mut e = Contention::default();
        let take = |amount, p: u64, t: u64, e: &mut Contention| {
            r.reserve(&[Claim::hard(&budget, amount)], by(p + 10), t, e)
        };
        let held = take(60, 1, 0, &mut e).unwrap();
        // The one slot is held: caller 2 is served from the overflow.
        let overflowed = take(1, 2, 1_000, &mut e).unwrap();
        assert_eq!(overflowed.held[0].placement, Placement::Overflow);
        r.release(&overflowed.held, 1_000, &mut e);
        // Caller 1 went quiet: caller 2 takes the slot.
        let moved = take(1, 2, 61_000, &mut e).unwrap();
        assert_eq!(moved.held[0].placement, Placement::Hashed);
        // Caller 1's request settles late, over its reservation: the charge
        // follows it (into the sketch), it is not dropped with the slot.
        r.settle(&held.held[0], 90, 62_000, &mut e);
        // Caller 1 gets the slot back later: 90 used, 10 left, not 100.
        assert!(matches!(
            take(11, 1, 200_000, &mut e),
            Err(Refusal::Full { .. })
        ));
        assert!(take(10, 1, 200_000, &mut e).is_ok());
    }

    proptest! {
        /// Random takes, settlements (under or over the reservation) and
        /// clock steps on a one-slot table with a narrow sketch, so callers
        /// keep evicting each other: no take ever lets a caller's real use
        /// of the day pass its budget. Nor is a take that fits refused while
        /// one caller has the table to itself (no eviction, no sketch
        /// between it and its bucket): there, admitted if and only if its
        /// use plus the take is within the budget, so a reserver refusing
        /// everything fails here.
        #[test]
        fn eviction_never_lets_a_budget_be_exceeded(
            ops in prop::collection::vec((0u64..6, 1u64..40, 0u8..3, 0u64..90_000), 1..200)
        ) {
            let store = MemStore::default();
            let budget = day_budget("tier/t/daily_tokens", 100);
            prepare(&store, &plain(std::slice::from_ref(&budget)), &layout(2)).unwrap();
            let r = Reserver {
                store: &store,
                layout: Layout { slots: 2, sketch_width: 64, hold_ms: 1_000, runs: Default::default() },
                tries: Tries::new(8),
            };
            let mut now = 0u64;
            // Per caller: real use (settled actuals + pending reservations).
            let mut used = [0u64; 6];
            let mut pending: Vec<(u64, Held, u64)> = Vec::new();
            // The one caller that has taken so far, until another tries.
            let mut alone: Option<Option<u64>> = Some(None);
            for (p, amount, action, step) in ops {
                now += step;
                prop_assume!(now < 86_400_000);
                match action {
                    0 | 1 => {
                        alone = alone.filter(|first| first.is_none_or(|q| q == p)).map(|_| Some(p));
                        let fits = used[p as usize] + amount <= 100;
                        let taken = r.reserve(&[Claim::hard(&budget, amount)], by(p + 10), now, &mut Contention::default());
                        if alone.is_some() {
                            prop_assert_eq!(taken.is_ok(), fits, "caller {} alone had {} and asked {}", p, used[p as usize], amount);
                        }
                        if let Ok(res) = taken {
                            prop_assert!(fits, "caller {} had {} and got {}", p, used[p as usize], amount);
                            used[p as usize] += amount;
                            let held = res.held.into_iter().next().unwrap();
                            pending.push((p, held, amount));
                        }
                    }
                    _ => {
                        if !pending.is_empty() {
                            let (q, held, reserved) = pending.remove(0);
                            // Actual use from nothing to twice the reservation.
                            let actual = amount * reserved / 20;
                            r.settle(&held, actual, now, &mut Contention::default());
                            used[q as usize] = used[q as usize] - reserved + actual;
                        }
                    }
                }
            }
        }

        /// Whatever the flood's identities, a declared caller and an active
        /// one get exactly what they get without it.
        #[test]
        fn no_flood_changes_declared_or_active_admissions(
            flood in prop::collection::vec(any::<u64>(), 0..400)
        ) {
            // (Caller 7 itself in the flood would be its own request.)
            let flood: Vec<u64> = flood.into_iter().filter(|&p| p != 7).collect();
            prop_assert_eq!(admissions_under_flood(&flood), (10, 9));
        }

        /// Reserve/settle sequences on one caller's bucket (10,000, the
        /// clock still: nothing refills), exact both ways: a reservation is
        /// admitted if and only if what is in use (reservations pending
        /// plus actuals settled) leaves room for it, a refusal is `Full`
        /// and changes nothing, the bucket holds exactly what is in use
        /// after every step, and once everything is settled exactly the
        /// sum of actual usage. (A reserver that refused everything fails
        /// the first reservation: every one asks for at most 399.)
        #[test]
        fn settled_charges_equal_actual_usage(
            ops in prop::collection::vec((1u64..400, 0u64..400), 1..60)
        ) {
            const CAPACITY: u64 = 10_000;
            let scale = crate::policy::units::SCALE;
            let store = MemStore::default();
            let tokens = rule("tier/t/tokens", CAPACITY, Scope::PerPrincipal);
            prepare(&store, &plain(std::slice::from_ref(&tokens)), &layout(2)).unwrap();
            let r = Reserver { store: &store, layout: layout(2), tries: Tries::new(8) };
            let used = || {
                let key = (0..2).map(|s| format!("sluice:v1:rec:tier/t:{s}"))
                    .find_map(|k| store.get(&k).map(|(b, _)| Bundle::decode(b)).filter(|b| b.owner != 0));
                key.and_then(|b| b.get(rule_hash("tier/t/tokens")).map(|e| Kept::decode(e).used)).unwrap_or(0)
            };
            // The model: units in use, and the totals.
            let mut in_use = 0u64;
            let (mut admitted, mut fitting, mut actual_total) = (0u64, 0u64, 0u64);
            let mut pending: Vec<(Vec<Held>, u64, u64)> = Vec::new();
            for (reserve, actual) in ops {
                let c = [Claim::hard(&tokens, reserve)];
                let fits = in_use + reserve <= CAPACITY;
                fitting += u64::from(fits);
                match r.reserve(&c, by(5), 0, &mut Contention::default()) {
                    Ok(res) => {
                        prop_assert!(fits, "admitted {} with {} of {} in use", reserve, in_use, CAPACITY);
                        admitted += 1;
                        in_use += reserve;
                        pending.push((res.held, reserve, actual.min(reserve)));
                    }
                    Err(refusal) => {
                        prop_assert!(!fits, "refused {} with only {} of {} in use: {:?}", reserve, in_use, CAPACITY, refusal);
                        prop_assert!(matches!(refusal, Refusal::Full { index: 0, .. }), "{:?}", refusal);
                    }
                }
                prop_assert_eq!(used(), in_use * scale);
                // Settle the oldest now and then, to interleave.
                if pending.len() > 2 {
                    let (held, reserved, actual) = pending.remove(0);
                    prop_assert!(r.settle(&held[0], actual, 0, &mut Contention::default()));
                    in_use = in_use - reserved + actual;
                    actual_total += actual;
                    prop_assert_eq!(used(), in_use * scale);
                }
            }
            prop_assert_eq!(admitted, fitting);
            for (held, _, actual) in pending {
                prop_assert!(r.settle(&held[0], actual, 0, &mut Contention::default()));
                actual_total += actual;
            }
            prop_assert_eq!(used(), actual_total * scale);
        }

        /// Random reserve/release sequences across principals, exact both
        /// ways: a request is admitted if and only if its principal holds
        /// fewer than 3 and all of them fewer than 10 (so no bucket ever
        /// exceeds its capacity, and none refuses what fits), a refusal is
        /// `Full`, and the shared bucket holds exactly what is held. Each
        /// principal has a slot of its own (hashes 10 to 15 on 8 slots: 6
        /// distinct homes), so what it gets is its own bucket's, never a
        /// neighbour's nor the overflow's.
        #[test]
        fn reserve_release_sequences_stay_in_bounds(
            ops in prop::collection::vec((0u64..6, any::<bool>()), 1..300)
        ) {
            let store = MemStore::default();
            let user = rule("tier/t", 3, Scope::PerPrincipal);
            let model = rule("model/m", 10, Scope::Global);
            prepare(&store, &plain(&[user.clone(), model.clone()]), &layout(8)).unwrap();
            let r = Reserver { store: &store, layout: layout(8), tries: Tries::new(8) };
            let claims = [Claim::hard(&user, 1), Claim::hard(&model, 1)];
            let mut held: Vec<(u64, Vec<Held>)> = Vec::new();
            let (mut admitted, mut fitting) = (0u32, 0u32);
            for (p, release) in ops {
                if release {
                    if let Some(pos) = held.iter().position(|(q, _)| *q == p) {
                        let (_, h) = held.remove(pos);
                        r.release(&h, 0, &mut Contention::default());
                    }
                } else {
                    let mine = held.iter().filter(|(q, _)| *q == p).count();
                    let fits = mine < 3 && held.len() < 10;
                    fitting += u32::from(fits);
                    match r.reserve(&claims, by(p + 10), 0, &mut Contention::default()) {
                        Ok(res) => {
                            prop_assert!(fits, "caller {} holding {} of {} admitted", p, mine, held.len());
                            admitted += 1;
                            held.push((p, res.held));
                        }
                        Err(refusal) => {
                            prop_assert!(!fits, "caller {} holding {} of {} refused: {:?}", p, mine, held.len(), refusal);
                            // The principal's bucket answers first, then the model's.
                            let index = if mine < 3 { 1 } else { 0 };
                            prop_assert!(matches!(refusal, Refusal::Full { index: i, .. } if i == index), "{:?}", refusal);
                        }
                    }
                }
                prop_assert!(held.len() <= 10);
                for q in 0..6 {
                    prop_assert!(held.iter().filter(|(x, _)| *x == q).count() <= 3);
                }
                prop_assert_eq!(shared_used(&store, &model.id), held.len() as u64 * crate::policy::units::SCALE);
            }
            prop_assert_eq!(admitted, fitting);
        }
    }
}
