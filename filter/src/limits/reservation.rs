//! All-or-nothing reservation across the buckets that apply to a request
//! (SPEC §2.3), on shared data with compare-and-swap so that every Envoy
//! worker sees one exact count.
//!
//! Key set. Envoy never frees a shared-data key, so the key set is fixed by
//! the policy, not by traffic, and every key is created up front by
//! [`prepare`]. A global rule (per model, per route, a tier's anonymous
//! total) is one key. A per-principal rule (per tier) has:
//! - one *dedicated* key per API key declared in the policy for that tier:
//!   declared callers never compete for anything;
//! - `principal_slots` *hashed* slots shared by every other caller (JWT
//!   subjects, trusted headers, addresses, undeclared keys): a caller hashes
//!   to a slot and probes up to [`PROBES`] slots from there;
//! - for calendar budgets (daily/monthly), a count-min sketch of the
//!   window's charges by hashed callers: [`SKETCH_DEPTH`] rows of
//!   `sketch_width` cells, one key each.
//!
//! Who may take a hashed slot. A slot whose bucket has drained is idle:
//! handing it over loses nothing. A budget slot is also handed over when
//! its owner has not touched it for `slot_hold` (then it is not active):
//! what it was charged this window stays in the sketch, and a caller who
//! gets a slot starts from its sketch estimate, which never under-counts
//! (every take and charge is added to the sketch, every give-back taken
//! off it after the slot). So eviction can refuse a caller early, never
//! let it past a hard budget. A slot in use (a rate bucket not drained, a
//! budget touched within `slot_hold`) is never taken: a flood of new
//! identities cannot take an active caller's capacity. When every probed
//! slot is in use the caller is refused with [`Refusal::NoSlot`]
//! (429 `capacity_exhausted`, counted), with the time until a probed slot
//! frees as its Retry-After; never a misleading budget refusal.
//!
//! Bounds. Keys per per-principal rule: `principal_slots` + declared keys
//! of the tier, + `SKETCH_DEPTH × sketch_width` for calendar budgets. The
//! sketch over-counts a caller by at most `e/sketch_width` of everything
//! hashed callers were charged on that rule this window, with probability
//! at least `1 − e^−SKETCH_DEPTH` (≈ 98 %); a tier's `anonymous_total`
//! bounds that total.
//!
//! Contention. A CAS mismatch means another worker changed the bucket since
//! we read it; we re-read and retry, up to `cas_max_retries` times (every
//! mismatch means another request made progress, so exhaustion needs a
//! sustained storm on one key). Every loop is [`crate::state::store::retry`];
//! retries and exhaustion are counted (`sluice_cas_retries_total`,
//! `sluice_cas_exhausted_total`). On exhaustion a take refuses the request
//! by that bucket, never lets it through unchecked. A settlement tries
//! [`SETTLE_TRIES_FACTOR`] times as long (its usage already happened); a
//! charge that still cannot be written is reported to the caller, which
//! counts and logs it; a give-back that cannot be written over-counts
//! until the bucket drains (the safe side).
//!
//! Partial failure. Buckets are taken one after the other; when one refuses,
//! those already taken are given back and the refusing bucket decides the
//! answer. Between the take and the give-back a concurrent request may see
//! those units in use and be refused: the error is on the safe side.

use crate::limits::bucket::{window_start, BucketState, Quota, Shortfall};
use crate::limits::shares::Pool;
use crate::limits::slots::{self, Found, Seen, Table};
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
const GLOBAL_OWNER: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// One bucket per principal.
    PerPrincipal,
    /// One bucket for everyone (per model, per route).
    Global,
}

/// One bucket definition of the policy. `id` is stable across reloads, so
/// the live count survives a policy change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub id: String,
    pub limit: Limit,
    pub scope: Scope,
}

/// How the per-principal tables are sized (from `state` in the policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub slots: u32,
    pub sketch_width: u32,
    /// A budget slot untouched this long may go to another caller.
    pub hold_ms: u64,
}

/// Who takes: the principal's hash, and its name when the policy declares
/// it (an API key listed in the policy), which gives it dedicated keys.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    pub hash: u64,
    pub declared: Option<&'a str>,
}

impl Caller<'_> {
    pub fn hashed(hash: u64) -> Caller<'static> {
        Caller {
            hash,
            declared: None,
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
}

/// A shared bucket's shares, and the group the caller draws from.
#[derive(Debug, Clone, Copy)]
pub struct Share<'a> {
    pub table: &'a crate::limits::shares::Table,
    pub group: u64,
}

impl<'a> Claim<'a> {
    pub fn hard(rule: &'a Rule, amount: u64) -> Claim<'a> {
        Claim {
            rule,
            amount,
            soft: false,
            share: None,
        }
    }
}

/// Where a bucket lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Global,
    /// A declared caller's own key.
    Dedicated,
    /// A slot of the hashed table (may change hands).
    Hashed,
}

/// Units held in one bucket, enough to give them back later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub key: String,
    pub rule: String,
    pub placement: Placement,
    /// Principal hash that owns the slot; for a shared bucket the caller's
    /// group in its shares (0: none, see `crate::limits::shares::REST`).
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
    /// Compare-and-swap attempts per bucket update (`state.cas_max_retries`;
    /// a settlement [`SETTLE_TRIES_FACTOR`] times as many).
    pub tries: Tries,
}

/// Creates every key a rule can use, empty, unless it exists: the hot path
/// then only ever updates keys under CAS (Envoy ignores CAS on a missing
/// key, so creating keys there could lose a concurrent count). Each rule
/// comes with the declared principals that get dedicated keys in it.
pub fn prepare(
    store: &dyn SharedStore,
    rules: &[(Rule, Vec<String>)],
    layout: &Layout,
) -> Result<usize, StoreError> {
    let empty = BucketState::default().encode();
    let mut created = 0;
    for (rule, declared) in rules {
        let mut keys: Vec<String> = Vec::new();
        match rule.scope {
            Scope::Global => keys.push(global_key(&rule.id)),
            Scope::PerPrincipal => {
                keys.extend(slot_table(&rule.id, layout).keys());
                keys.extend(declared.iter().map(|p| dedicated_key(&rule.id, p)));
                if rule.limit.window.is_some() {
                    for row in 0..SKETCH_DEPTH {
                        keys.extend(
                            (0..layout.sketch_width).map(|col| cell_key(&rule.id, row, col)),
                        );
                    }
                }
            }
        }
        for key in keys {
            if store.get(&key).is_none() {
                store.set(&key, &empty, 0)?;
                created += 1;
            }
        }
    }
    Ok(created)
}

fn global_key(rule: &str) -> String {
    format!("{KEY_PREFIX}{rule}")
}
/// The hashed slots of a per-principal rule (`{KEY_PREFIX}{rule}:{slot}`).
fn slot_table<'a>(rule: &'a str, layout: &Layout) -> Table<'a> {
    Table::named(KEY_PREFIX, rule, layout.slots, PROBES)
}
fn dedicated_key(rule: &str, principal: &str) -> String {
    format!("{KEY_PREFIX}{rule}:declared:{principal}")
}
fn cell_key(rule: &str, row: u32, col: u32) -> String {
    format!("{KEY_PREFIX}{rule}:sketch:{row}:{col}")
}

/// A hashed slot: the bucket and when its owner last took or settled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Slot {
    pub state: BucketState,
    pub touched_ms: u64,
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

/// Where a claim's bucket lives right now.
struct Located {
    key: String,
    state: BucketState,
    cas: u32,
    owner: u64,
    placement: Placement,
}

impl Reserver<'_> {
    /// Takes every claim or none.
    pub fn reserve(
        &self,
        claims: &[Claim],
        caller: Caller,
        now_ms: u64,
        effort: &mut Contention,
    ) -> Result<Reservation, Refusal> {
        let mut reservation = Reservation::default();
        for (index, claim) in claims.iter().enumerate() {
            match self.take(claim, caller, now_ms, effort) {
                Ok((held, quota, over)) => {
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
                Err(refusal) => {
                    self.release(&reservation.held, now_ms, effort);
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
        Ok(reservation)
    }

    /// Gives back what `held` took.
    pub fn release(&self, held: &[Held], now_ms: u64, effort: &mut Contention) {
        for h in held.iter().rev() {
            self.settle(h, 0, now_ms, effort);
        }
    }

    /// Replaces what `h` reserved with what was really used: gives back the
    /// difference, or charges the shortfall (which may take the bucket over
    /// its capacity: the usage already happened). Under contention it tries
    /// [`SETTLE_TRIES_FACTOR`] times as often as a take. `false`: the
    /// bucket could still not be written (counted in `cas_exhausted`); for a
    /// charge the caller must say so, for a give-back the bucket merely
    /// over-counts until it drains (the safe side).
    pub fn settle(&self, h: &Held, actual: u64, now_ms: u64, effort: &mut Contention) -> bool {
        if actual == h.amount {
            return true;
        }
        let written = self.settle_bucket(h, actual, now_ms, effort);
        if let (Placement::Hashed, Some(window)) = (h.placement, h.limit.window) {
            // After the slot: a give-back leaves the sketch ahead meanwhile,
            // never behind.
            let delta = actual.abs_diff(h.amount);
            if actual > h.amount {
                let tries = self.settle_tries();
                let start = window_start(window, now_ms);
                self.sketch_add(&h.rule, h.owner, delta, start, tries, effort);
            } else {
                self.sketch_sub(&h.rule, h.owner, delta, &h.limit, h.taken_ms, now_ms);
            }
        }
        written
    }

    fn settle_tries(&self) -> u32 {
        self.tries.settle()
    }

    /// The bucket part of [`Self::settle`]; `false` when every write was
    /// lost or refused.
    fn settle_bucket(&self, h: &Held, actual: u64, now_ms: u64, effort: &mut Contention) -> bool {
        let charge = actual > h.amount;
        let delta = actual.abs_diff(h.amount);
        let apply = |state: BucketState| {
            if charge {
                state.charge(delta, &h.limit, now_ms)
            } else {
                state.give_back(delta, &h.limit, h.taken_ms, now_ms)
            }
        };
        let tries = self.settle_tries();
        if h.placement == Placement::Global {
            // A shared bucket may carry its groups' accounts (`shares`):
            // the total and the group move together.
            let written = self.update(&h.key, tries, effort, |bytes| {
                let pool = Pool::decode(bytes);
                let next = if charge {
                    pool.charge(h.owner, delta, &h.limit, now_ms)
                } else {
                    pool.give_back(h.owner, delta, &h.limit, h.taken_ms, now_ms)
                };
                Some(next.encode())
            });
            return written != Updated::Exhausted && written != Updated::Failed;
        }
        if h.placement != Placement::Hashed {
            let written = self.update(&h.key, tries, effort, |bytes| {
                let state = BucketState::decode(bytes);
                Some(apply(state).encode())
            });
            return written != Updated::Exhausted && written != Updated::Failed;
        }
        let mine = |bytes: &[u8]| {
            let slot = Slot::decode(bytes);
            (slot.state.owner == h.owner).then(|| {
                Slot {
                    state: apply(slot.state),
                    touched_ms: slot.touched_ms.max(now_ms),
                }
                .encode()
            })
        };
        match self.update(&h.key, tries, effort, mine) {
            Updated::Written => return true,
            Updated::Exhausted | Updated::Failed => return false,
            Updated::Unchanged => {}
        }
        // The slot changed hands since the take (it drained, or a budget
        // slot went untouched): settle where the caller lives now, and take
        // a slot for a charge rather than forget it.
        let rule = Rule {
            id: h.rule.clone(),
            limit: h.limit,
            scope: Scope::PerPrincipal,
        };
        let found = if charge {
            self.locate(&rule, Caller::hashed(h.owner), now_ms)
                .ok()
                .map(|at| at.key)
        } else {
            self.owned(&rule, h.owner, now_ms)
        };
        let Some(key) = found else {
            // Nowhere to charge (every probed slot in use): the usage is
            // lost to this bucket; counted like an exhausted write.
            if charge {
                effort.cas_exhausted = effort.cas_exhausted.saturating_add(1);
            }
            return !charge;
        };
        let written = self.update(&key, tries, effort, |bytes| {
            let slot = Slot::decode(bytes);
            let state = if slot.state.owner == h.owner {
                slot.state
            } else if self.takeable(&slot, &h.limit, now_ms) {
                self.seed(&rule, h.owner, now_ms)
            } else {
                return None;
            };
            Some(
                Slot {
                    state: apply(state),
                    touched_ms: now_ms,
                }
                .encode(),
            )
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
    fn update(
        &self,
        key: &str,
        tries: u32,
        effort: &mut Contention,
        f: impl Fn(&[u8]) -> Option<Vec<u8>>,
    ) -> Updated {
        store::update(self.store, key, tries, effort, |bytes| f(bytes?))
    }

    /// What a claim's bucket holds now, without taking anything.
    pub fn peek(&self, claim: &Claim, caller: Caller, now_ms: u64) -> Quota {
        let state = match self.locate(claim.rule, caller, now_ms) {
            Ok(at) => at.state,
            Err(_) => self.seed(claim.rule, caller.hash, now_ms),
        };
        state
            .at(&claim.rule.limit, now_ms)
            .quota(&claim.rule.limit, now_ms)
    }

    /// Would the claim be refused now? A peek, not a reservation: the
    /// shortfall the bucket would answer with, or `None` (it fits, or the
    /// caller has no slot to read: only a reservation can tell then).
    pub fn shortfall(&self, claim: &Claim, caller: Caller, now_ms: u64) -> Option<Shortfall> {
        let state = self.locate(claim.rule, caller, now_ms).ok()?.state;
        state.take(claim.amount, &claim.rule.limit, now_ms).err()
    }

    fn take(
        &self,
        claim: &Claim,
        caller: Caller,
        now_ms: u64,
        effort: &mut Contention,
    ) -> Result<(Held, Quota, bool), TakeError> {
        let limit = &claim.rule.limit;
        if let (Some(share), Scope::Global, false) = (claim.share, claim.rule.scope, claim.soft) {
            return self.take_shared(claim, share, now_ms, effort);
        }
        // The read spans several keys (the probed slots), so the loop is
        // `store::retry` around locate-then-write, not a one-key update.
        let taken = store::retry(self.tries.take(), effort, || {
            let at = match self.locate(claim.rule, caller, now_ms) {
                Ok(at) => at,
                Err(frees_in) => return Attempt::Done(Err(TakeError::NoSlot(frees_in))),
            };
            let (next, over) = match at.state.take(claim.amount, limit, now_ms) {
                Ok(next) => (next, false),
                Err(_) if claim.soft => (at.state.charge(claim.amount, limit, now_ms), true),
                Err(shortfall) => return Attempt::Done(Err(TakeError::Full(shortfall))),
            };
            let bytes = match at.placement {
                Placement::Hashed => Slot {
                    state: next,
                    touched_ms: now_ms,
                }
                .encode(),
                _ => next.encode(),
            };
            match self.store.set(&at.key, &bytes, at.cas) {
                Ok(()) => Attempt::Done(Ok((at, next, over))),
                Err(StoreError::CasMismatch) => Attempt::Lost,
                Err(StoreError::Host(message)) => Attempt::Done(Err(TakeError::Host(message))),
            }
        });
        let (at, next, over) = taken.ok_or(TakeError::Contended)??;
        let held = Held {
            key: at.key,
            rule: claim.rule.id.clone(),
            placement: at.placement,
            owner: at.owner,
            amount: claim.amount,
            limit: *limit,
            taken_ms: now_ms,
        };
        // After the slot (just touched, so nobody takes it meanwhile): the
        // sketch never lags a budget's count.
        let window = limit.window.filter(|_| at.placement == Placement::Hashed);
        if let Some(window) = window {
            let start = window_start(window, now_ms);
            let tries = self.tries.take();
            if !self.sketch_add(&claim.rule.id, at.owner, claim.amount, start, tries, effort) {
                self.settle_bucket(&held, 0, now_ms, effort);
                return Err(TakeError::Contended);
            }
        }
        Ok((held, next.quota(limit, now_ms), over))
    }

    /// A take from a shared bucket with fair shares: the bucket and the
    /// group's account in one record, one compare-and-swap (see
    /// `crate::limits::shares`). A refusal may still write, to mark the group
    /// active (its floor is no longer lent).
    fn take_shared(
        &self,
        claim: &Claim,
        share: Share,
        now_ms: u64,
        effort: &mut Contention,
    ) -> Result<(Held, Quota, bool), TakeError> {
        let limit = &claim.rule.limit;
        let key = global_key(&claim.rule.id);
        let taken = store::retry(self.tries.take(), effort, || {
            let (bytes, cas) = self.store.get(&key).unwrap_or_default();
            let pool = Pool::decode(&bytes);
            let (write, outcome) =
                match pool.take(share.table, share.group, claim.amount, limit, now_ms) {
                    // An admission reports the bucket, as without shares
                    // (the tightest bucket's X-RateLimit-*); a refusal
                    // reports what the caller's group may take.
                    Ok((next, _group_view)) => {
                        let quota = next.state.quota(limit, now_ms);
                        (Some(next), Ok(quota))
                    }
                    Err(refused) => (refused.mark, Err(TakeError::Full(refused.shortfall))),
                };
            let Some(write) = write else {
                return Attempt::Done(outcome);
            };
            match self.store.set(&key, &write.encode(), cas) {
                Ok(()) => Attempt::Done(outcome),
                Err(StoreError::CasMismatch) => Attempt::Lost,
                Err(StoreError::Host(message)) => match outcome {
                    // Only the activity mark was lost: the refusal stands.
                    Err(refused) => Attempt::Done(Err(refused)),
                    Ok(_) => Attempt::Done(Err(TakeError::Host(message))),
                },
            }
        });
        let quota = taken.ok_or(TakeError::Contended)??;
        let held = Held {
            key,
            rule: claim.rule.id.clone(),
            placement: Placement::Global,
            owner: share.group,
            amount: claim.amount,
            limit: *limit,
            taken_ms: now_ms,
        };
        Ok((held, quota, false))
    }

    /// The bucket for `caller` under `rule`: the global key, its dedicated
    /// key, its hashed slot, or a slot it may take (seeded from the sketch).
    /// `Err`: every probed slot is in use; the value is when one frees.
    fn locate(&self, rule: &Rule, caller: Caller, now_ms: u64) -> Result<Located, u64> {
        let read = |key: &str| self.store.get(key);
        if rule.scope == Scope::Global {
            let key = global_key(&rule.id);
            let (bytes, cas) = read(&key).unwrap_or_default();
            return Ok(Located {
                key,
                // By prefix: the record may carry fair-share accounts.
                state: Pool::decode(&bytes).state,
                cas,
                owner: 0,
                placement: Placement::Global,
            });
        }
        let owner = caller.hash.max(GLOBAL_OWNER + 1);
        if let Some(name) = caller.declared {
            let key = dedicated_key(&rule.id, name);
            // A declared caller whose key was not prepared (a tier it does
            // not belong to) is placed like anyone else.
            if let Some((bytes, cas)) = read(&key) {
                return Ok(Located {
                    key,
                    state: BucketState::decode(&bytes),
                    cas,
                    owner,
                    placement: Placement::Dedicated,
                });
            }
        }
        // The best slot to take: a free one first, else the one untouched
        // longest.
        let mut frees_in = u64::MAX;
        let table = slot_table(&rule.id, &self.layout);
        let probed = table.probe(owner).map(|key| {
            let (bytes, cas) = read(&key).unwrap_or_default();
            (key, cas, Slot::decode(&bytes))
        });
        let found = slots::claim(probed, |(_, _, slot)| {
            if slot.state.owner == owner {
                return Seen::Mine;
            }
            // A never-used slot ends the chain: the principal would hold it
            // or an earlier one if it had a bucket.
            if slot.state.owner == 0 {
                return Seen::Last((0u8, 0));
            }
            if slot.state.is_idle(&rule.limit, now_ms) {
                return Seen::Free((0, 0));
            }
            if self.takeable(slot, &rule.limit, now_ms) {
                return Seen::Free((1, slot.touched_ms));
            }
            frees_in = frees_in.min(self.frees_in(slot, &rule.limit, now_ms));
            Seen::Busy
        });
        match found {
            Found::Mine((key, cas, slot)) => Ok(Located {
                key,
                state: slot.state,
                cas,
                owner,
                placement: Placement::Hashed,
            }),
            Found::Free((key, cas, _)) => Ok(Located {
                key,
                state: self.seed(rule, owner, now_ms),
                cas,
                owner,
                placement: Placement::Hashed,
            }),
            Found::Full => Err(frees_in),
        }
    }

    /// The key of the slot `owner` holds under `rule`, if any.
    fn owned(&self, rule: &Rule, owner: u64, now_ms: u64) -> Option<String> {
        self.locate(rule, Caller::hashed(owner), now_ms)
            .ok()
            .filter(|at| at.state.owner == owner)
            .map(|at| at.key)
    }

    /// May another caller take this slot? Drained, or a budget slot whose
    /// owner has not touched it for `hold_ms` (its charges are in the
    /// sketch).
    fn takeable(&self, slot: &Slot, limit: &Limit, now_ms: u64) -> bool {
        slot.state.owner == 0
            || slot.state.is_idle(limit, now_ms)
            || (limit.window.is_some()
                && slot.touched_ms.saturating_add(self.layout.hold_ms) <= now_ms)
    }

    /// Milliseconds until a slot in use may be taken.
    fn frees_in(&self, slot: &Slot, limit: &Limit, now_ms: u64) -> u64 {
        let state = slot.state.at(limit, now_ms);
        match limit.window {
            Some(_) => slot
                .touched_ms
                .saturating_add(self.layout.hold_ms)
                .saturating_sub(now_ms),
            None => state.quota(limit, now_ms).reset_ms,
        }
    }

    /// A fresh bucket for `owner`: empty for a rate, and for a budget what
    /// the sketch says it was charged this window (never less than the
    /// truth).
    fn seed(&self, rule: &Rule, owner: u64, now_ms: u64) -> BucketState {
        let used = match rule.limit.window {
            Some(window) => {
                let start = window_start(window, now_ms);
                (0..SKETCH_DEPTH)
                    .map(|row| {
                        let key =
                            cell_key(&rule.id, row, column(owner, row, self.layout.sketch_width));
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
            self.settle_tries(),
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

impl Record for Slot {
    const LEN: usize = BucketState::LEN + 8;

    fn write(&self, w: &mut Writer) {
        self.state.write(w);
        w.u64(self.touched_ms);
    }

    fn read(r: &mut Reader) -> Self {
        let state = BucketState::read(r);
        Slot {
            state,
            touched_ms: r.try_u64().unwrap_or(state.updated_ms),
        }
    }

    /// Slot keys are prepared with an empty [`BucketState`] (24 bytes): the
    /// state is read from any value that holds one.
    fn decode(bytes: &[u8]) -> Self {
        if bytes.len() < BucketState::LEN {
            return Slot::default();
        }
        Self::read(&mut Reader::new(bytes))
    }
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
        Rule {
            id: id.into(),
            limit: Limit {
                rate: Rate {
                    amount,
                    period_ms: 60_000,
                },
                burst: amount,
                window: None,
            },
            scope,
        }
    }

    fn layout(slots: u32) -> Layout {
        Layout {
            slots,
            sketch_width: 64,
            hold_ms: 60_000,
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
    fn prepare_bounds_the_key_set() {
        let store = MemStore::default();
        let rules = [
            rule("tier/free", 10, Scope::PerPrincipal),
            rule("model/m", 5, Scope::Global),
        ];
        assert_eq!(
            prepare(&store, &plain(&rules), &layout(16)).unwrap(),
            16 + 1
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
        assert_eq!(store.len(), 17);
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
        // Principal 200 finds the only slot in use: refused, told when the
        // slot drains (one unit of 2/min: 30 s), never counted elsewhere.
        let refused = r.reserve(&c, by(200), 0, &mut e).unwrap_err();
        assert_eq!(
            refused,
            Refusal::NoSlot {
                index: 0,
                retry_after_ms: 30_000
            }
        );
        // Once principal 100's bucket drained, 200 may take its slot.
        let mut e = Contention::default();
        assert!(r.reserve(&c, by(200), 30_000, &mut e).is_ok());
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
        let used = |store: &Contended| {
            BucketState::decode(&store.inner.get("sluice:v1:model/m/tokens").unwrap().0).used
        };
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
        Rule {
            id: id.into(),
            limit: Limit::windowed(
                amount,
                crate::policy::Window::Day(crate::policy::zone::Zone::UTC),
            ),
            scope: Scope::PerPrincipal,
        }
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
    fn a_full_table_refuses_new_callers_with_no_slot_not_a_budget() {
        let store = MemStore::default();
        let budget = day_budget("tier/free/daily_tokens", 5_000);
        prepare(&store, &plain(std::slice::from_ref(&budget)), &layout(8)).unwrap();
        let r = reserver(&store, 8);
        let c = [Claim::hard(&budget, 10)];
        let mut e = Contention::default();
        for p in 0..200u64 {
            let _ = r.reserve(&c, by(p * 8), 0, &mut e);
        }
        // Every slot of a fresh caller's chain is active (touched now).
        let refused = r.reserve(&c, by(5_000_000), 1_000, &mut e).unwrap_err();
        assert_eq!(
            refused,
            Refusal::NoSlot {
                index: 0,
                retry_after_ms: 59_000
            }
        );
        // After `slot_hold` the oldest goes to the new caller, seeded from
        // the sketch (it never called: nothing, up to sketch collisions).
        let res = r.reserve(&c, by(5_000_000), 61_000, &mut e).unwrap();
        assert!(res.quotas[0].remaining <= 4_990);
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
        assert!(matches!(
            take(1, 2, 1_000, &mut e),
            Err(Refusal::NoSlot { .. })
        ));
        // Caller 1 went quiet: caller 2 takes the slot.
        assert!(take(1, 2, 61_000, &mut e).is_ok());
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
        /// of the day pass its budget.
        #[test]
        fn eviction_never_lets_a_budget_be_exceeded(
            ops in prop::collection::vec((0u64..6, 1u64..40, 0u8..3, 0u64..90_000), 1..200)
        ) {
            let store = MemStore::default();
            let budget = day_budget("tier/t/daily_tokens", 100);
            prepare(&store, &plain(std::slice::from_ref(&budget)), &layout(2)).unwrap();
            let r = Reserver {
                store: &store,
                layout: Layout { slots: 2, sketch_width: 64, hold_ms: 1_000 },
                tries: Tries::new(8),
            };
            let mut now = 0u64;
            // Per caller: real use (settled actuals + pending reservations).
            let mut used = [0u64; 6];
            let mut pending: Vec<(u64, Held, u64)> = Vec::new();
            for (p, amount, action, step) in ops {
                now += step;
                prop_assume!(now < 86_400_000);
                match action {
                    0 | 1 => {
                        if let Ok(res) = r.reserve(&[Claim::hard(&budget, amount)], by(p + 10), now, &mut Contention::default()) {
                            prop_assert!(used[p as usize] + amount <= 100, "caller {} had {} and got {}", p, used[p as usize], amount);
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

        /// Reserve/settle sequences: admission never takes a bucket over its
        /// capacity nor below empty, and once everything is settled the
        /// bucket holds exactly the sum of actual usage.
        #[test]
        fn settled_charges_equal_actual_usage(
            ops in prop::collection::vec((1u64..400, 0u64..400), 1..60)
        ) {
            let store = MemStore::default();
            let tokens = rule("tier/t/tokens", 10_000, Scope::PerPrincipal);
            prepare(&store, &plain(std::slice::from_ref(&tokens)), &layout(2)).unwrap();
            let r = Reserver { store: &store, layout: layout(2), tries: Tries::new(8) };
            let mut actual_total = 0u64;
            let mut pending = Vec::new();
            let used = || {
                let key = (0..2).map(|s| format!("sluice:v1:tier/t/tokens:{s}"))
                    .find_map(|k| store.get(&k).map(|(b, _)| Slot::decode(&b).state).filter(|b| b.owner != 0));
                key.map_or(0, |b| b.used)
            };
            for (reserve, actual) in ops {
                let c = [Claim::hard(&tokens, reserve)];
                let before = used();
                match r.reserve(&c, by(5), 0, &mut Contention::default()) {
                    Ok(res) => {
                        prop_assert!(used() <= 10_000 * crate::policy::units::SCALE || before > 10_000 * crate::policy::units::SCALE);
                        pending.push((res.held, actual.min(reserve)));
                    }
                    Err(_) => prop_assert_eq!(used(), before),
                }
                // Settle the oldest half the time, to interleave.
                if pending.len() > 2 {
                    let (held, actual) = pending.remove(0);
                    r.settle(&held[0], actual, 0, &mut Contention::default());
                    actual_total += actual;
                }
            }
            for (held, actual) in pending {
                r.settle(&held[0], actual, 0, &mut Contention::default());
                actual_total += actual;
            }
            prop_assert_eq!(used(), actual_total * crate::policy::units::SCALE);
        }

        /// Random reserve/release sequences across principals: no bucket
        /// ever exceeds its capacity, and a principal never gets more than
        /// its capacity at one instant.
        #[test]
        fn reserve_release_sequences_stay_in_bounds(
            ops in prop::collection::vec((0u64..6, any::<bool>()), 1..300)
        ) {
            let store = MemStore::default();
            let user = rule("tier/t", 3, Scope::PerPrincipal);
            let model = rule("model/m", 10, Scope::Global);
            prepare(&store, &plain(&[user.clone(), model.clone()]), &layout(4)).unwrap();
            let r = Reserver { store: &store, layout: layout(4), tries: Tries::new(8) };
            let claims = [Claim::hard(&user, 1), Claim::hard(&model, 1)];
            let mut held: Vec<(u64, Vec<Held>)> = Vec::new();
            for (p, release) in ops {
                if release {
                    if let Some(pos) = held.iter().position(|(q, _)| *q == p) {
                        let (_, h) = held.remove(pos);
                        r.release(&h, 0, &mut Contention::default());
                    }
                } else if let Ok(res) = r.reserve(&claims, by(p), 0, &mut Contention::default()) {
                    held.push((p, res.held));
                }
                let per_model = held.len();
                prop_assert!(per_model <= 10);
                for q in 0..6 {
                    prop_assert!(held.iter().filter(|(x, _)| *x == q).count() <= 3);
                }
                let (bytes, _) = store.get("sluice:v1:model/m").unwrap();
                let state = BucketState::decode(&bytes);
                prop_assert_eq!(state.used, per_model as u64 * crate::policy::units::SCALE);
            }
        }
    }
}
