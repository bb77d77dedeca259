//! Fair shares of a shared bucket (docs/src/design.md, "Guarantees"): a model's or a
//! route's rate bucket is a commons that no group of callers may drain for the others.
//!
//! Groups. Each tier named in a bucket's `shares` is a group of that tier's
//! *declared* callers (API keys listed in the policy); `anonymous` is every
//! undeclared caller together (addresses, JWT subjects, trusted headers,
//! undeclared keys: the same set as a tier's `anonymous_total`). Declared
//! callers of a tier without a share form the unnamed rest: no guarantee,
//! no cap, they borrow what is free.
//!
//! Mechanism: one bucket, guaranteed floors, one record. The bucket keeps
//! its total (`used` U, capacity C, rate r, exactly as without shares)
//! and, in the same shared-data record, per named group what it holds
//! (u_g), when it last asked, and how much of its floor is still *lent*
//! (l_g, below). A group is *active* when it asked (admitted or refused)
//! within the time the bucket takes to refill from empty (C ÷ r, 1 s to a
//! day; a calendar bucket: the same window). With share s_g a tier's floor
//! is G_g = s_g × C, its unmet floor m_g = max(0, G_g − u_g). `anonymous`
//! has a *ceiling* s_anon × C and no floor: its callers never hold room
//! back from declared keys (else one anonymous request a minute would keep
//! its share idle), they only borrow. A request of group g for a units is
//! admitted when
//! 1. the total fits: U + a ≤ C (the bucket, unchanged);
//! 2. `anonymous` only: u_anon + a ≤ s_anon × C (undeclared callers
//!    together never hold more than their share, busy or idle);
//! 3. a ≤ m_g − l_g (a tier within its floor, less what of it is lent), or
//!    the free room still covers every active tier's floor, lent parts
//!    included: C − U − a ≥ Σ_{h≠g active} m_h (borrowing).
//!
//! Lent parts: l_g is kept equal, over the active groups, to the deficit
//! D = max(0, Σ m_h − (C − U)): a group that returns to a floor others
//! borrowed while it was idle takes the growth of D as its own l_g; as the
//! borrowed units drain, D shrinks and the lent parts are repaid (in table
//! order). Refill drains the total at r, and each group's holding in
//! proportion (u_g × drain ÷ U, rounded down, then trimmed so the groups
//! never sum past the total: they never lose more than the total did).
//!
//! Why this and not private per-group sub-buckets: one key keeps admission
//! all-or-nothing and exact with the one compare-and-swap every global
//! bucket already uses (exact across Envoy's workers); floors instead of
//! private sub-buckets make it work-conserving (a share nobody asks for is
//! free to borrow: condition 3 reserves only for active groups); the
//! proportional drain turns a floor of capacity into a floor of rate; the
//! lent parts make a returning owner's deficit its own, never its
//! neighbours'.
//!
//! Bounds. Always: U ≤ C after every admission (1), and u_anon ≤
//! s_anon × C (2). Invariant I′: C − U ≥ Σ_{h active tier} (m_h − l_h) —
//! the free room covers every active floor not lent (property-tested). So:
//! - *with share s, an active tier may hold s × C whenever it asks, less
//!   what of its floor was lent when it returned and has not drained yet*;
//!   a tier active before the others return never loses anything to them.
//! - Rate: a tier at its floor drains at r × u_g ÷ U ≥ r × s (U ≤ C), and
//!   what drained is room under its own floor, covered by I′: *a tier that
//!   keeps asking is admitted at least s × r × T over any interval T, less
//!   one request per refill time C ÷ r (its floor is held in whole
//!   requests) and one more, whatever the others send* (property-tested).
//! - Work-conserving: a group alone (the others idle) may use the whole
//!   bucket (anonymous: up to its share); a floor nobody asked for within
//!   a refill time is lent. (A tier that asks once per refill time keeps
//!   its floor reserved: floors are for the operator's declared tiers.)
//! - Taking back: from a returning tier's first request (a refusal marks
//!   it active too, at most one write a second per tier) nobody borrows
//!   until its lent part is repaid, and the lent part falls with the
//!   borrowers' drain, at least at r × D ÷ C (they hold at least D): the
//!   share comes back as the borrowed units drain, most of it within one
//!   refill time C ÷ r, all of it when the borrowers' units are gone.
//!
//! Cost: the record grows by 32 bytes per named group (bounded by
//! [`MAX_GROUPS`]); no extra key, no extra write on admission, at most one
//! write a second per refused tier. Default (`defaults.shares`): when the
//! policy declares API keys and writes no shares, every shared rate bucket
//! caps `anonymous` at [`DEFAULT_ANONYMOUS_PERMILLE`] (50 %), so a flood
//! of new identities leaves half of any model or route to declared keys.
//! In fleet mode the shares hold in each Envoy's local bucket; the fleet's
//! lease still bounds the total (see docs/src/limits.md, "Fair shares").

use crate::limits::bucket::{
    next_window, same_window, window_start, BucketState, Quota, Shortfall, MAX_WAIT_MS,
};
use crate::policy::shares::{SharesConfig, ANONYMOUS, MAX_GROUPS};
use crate::policy::units::SCALE;
use crate::policy::Limit;
use crate::state::codec::{Reader, Record, Writer};

/// A refused group refreshes its `seen` at most this often.
const MARK_EVERY_MS: u64 = 1_000;

/// One named group of a compiled table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupShare {
    pub id: u64,
    pub name: String,
    pub permille: u32,
    /// `anonymous`: the share is also a ceiling.
    pub capped: bool,
}

/// A bucket's shares, compiled once per policy load.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShareTable {
    pub groups: Vec<GroupShare>,
}

/// The unnamed rest (declared callers of tiers without a share).
pub const REST: u64 = 0;

impl ShareTable {
    /// `None` when there is nothing to share (an empty map).
    pub fn compile(cfg: &SharesConfig) -> Option<ShareTable> {
        let groups: Vec<GroupShare> = cfg
            .0
            .iter()
            .take(MAX_GROUPS)
            .map(|(name, &permille)| GroupShare {
                id: group_id(name),
                name: name.clone(),
                permille,
                capped: name == ANONYMOUS,
            })
            .collect();
        (!groups.is_empty()).then_some(ShareTable { groups })
    }

    /// The group of a caller: `anonymous` when undeclared, its tier when
    /// declared and named, else [`REST`]. An undeclared caller counts as
    /// `anonymous` even when `anonymous` has no share (then it is tracked
    /// nowhere: the rest).
    pub fn group_of(&self, tier: &str, declared: bool) -> u64 {
        let name = if declared { tier } else { ANONYMOUS };
        self.groups
            .iter()
            // (A tier named `anonymous` gets no share: the name means the
            // undeclared callers.)
            .find(|g| g.name == name && g.capped != declared)
            .map_or(REST, |g| g.id)
    }
}

/// Stable across reloads (the record keeps accounts by it): FNV-1a of the
/// name, never 0 ([`REST`]).
fn group_id(name: &str) -> u64 {
    crate::policy::keys::fnv1a(name.as_bytes()).max(1)
}

/// What one named group holds of a shared bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Account {
    pub id: u64,
    /// Millionths, drained with the total in proportion.
    pub used: u64,
    /// When the group last asked (admitted or refused).
    pub seen_ms: u64,
    /// Millionths of its unmet floor still lent to borrowers since it
    /// returned: repaid from the borrowers' drain only.
    pub lent: u64,
}

/// Bytes of one account in the record.
const ACCOUNT_LEN: usize = 32;

/// A shared bucket's record: the bucket and its groups' accounts. Without
/// accounts it is byte for byte a [`BucketState`] (24 bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pool {
    pub state: BucketState,
    pub accounts: Vec<Account>,
}

/// The bucket as group `mine` is told it (`X-RateLimit-Limit`): a capped
/// group's share, anyone else's the whole bucket.
fn group_limit(table: &ShareTable, mine: Option<usize>, capacity: u64, limit: &Limit) -> u64 {
    match mine {
        Some(i) if table.groups[i].capped => floor(capacity, table.groups[i].permille) / SCALE,
        _ => limit.capacity(),
    }
}

/// Guaranteed floors (millionths), per group of `table`: a tier's share.
/// `anonymous` has none: its share is only a ceiling, so its callers never
/// hold room back from declared keys. Written into `into` (on the stack:
/// no allocation per take), the table's groups first.
fn floors<'a>(table: &ShareTable, capacity: u64, into: &'a mut [u64; MAX_GROUPS]) -> &'a [u64] {
    for (f, g) in into.iter_mut().zip(&table.groups) {
        *f = if g.capped {
            0
        } else {
            floor(capacity, g.permille)
        };
    }
    &into[..table.groups.len().min(MAX_GROUPS)]
}

/// How long until a rate bucket's room grows by `need`: the total drains
/// by it, or, when the group's own ceiling binds (`own`: what the group
/// holds of the total `used`), its own holding does (`r × u_g ÷ U`).
fn drain_wait(need: u64, used: u64, own: Option<u64>, limit: &Limit) -> u64 {
    let total_need = match own {
        Some(own) if own > 0 => {
            (need as u128 * used as u128 / own as u128).min(u64::MAX as u128) as u64
        }
        _ => need,
    };
    crate::limits::bucket::drain_ms(total_need, limit)
}

impl Pool {
    /// A named group's account (the rest, [`REST`], has none of its own).
    fn account_mut(&mut self, group: u64) -> Option<&mut Account> {
        if group == REST {
            return None;
        }
        self.accounts.iter_mut().find(|a| a.id == group)
    }

    #[cfg(test)]
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(BucketState::LEN + ACCOUNT_LEN * self.accounts.len());
        self.write(&mut w);
        w.into_bytes()
    }

    pub fn write(&self, w: &mut Writer) {
        self.state.write(w);
        for a in &self.accounts {
            w.u64(a.id).u64(a.used).u64(a.seen_ms).u64(a.lent);
        }
    }

    /// By prefix: a plain bucket reads with no accounts; a short value as
    /// empty; at most [`MAX_GROUPS`] accounts, the rest ignored.
    pub fn decode(bytes: &[u8]) -> Pool {
        if bytes.len() < BucketState::LEN {
            return Pool::default();
        }
        let mut r = Reader::new(bytes);
        let state = BucketState::read(&mut r);
        let mut accounts = Vec::with_capacity((r.rest().len() / ACCOUNT_LEN).min(MAX_GROUPS));
        while accounts.len() < MAX_GROUPS && r.rest().len() >= ACCOUNT_LEN {
            accounts.push(Account {
                id: r.u64(),
                used: r.u64(),
                seen_ms: r.u64(),
                lent: r.u64(),
            });
        }
        Pool { state, accounts }
    }

    /// The record at `now_ms`: the bucket refilled, each account drained
    /// in proportion, never summing past the total.
    pub fn at(self, limit: &Limit, now_ms: u64) -> Pool {
        let before = self.state.used;
        let state = self.state.at(limit, now_ms);
        let mut accounts = self.accounts;
        if state.used < before {
            // Each account drains its part of the drain, rounded down, so
            // the accounts together never lose more than the total did
            // (what they lose is room under their floors; the room the
            // total gained covers it, to the millionth: invariant I).
            let drained = (before - state.used) as u128;
            for a in &mut accounts {
                let part = (a.used as u128 * drained)
                    .checked_div(before as u128)
                    .unwrap_or(0) as u64;
                a.used = a.used.saturating_sub(part);
            }
        }
        let mut pool = Pool { state, accounts };
        pool.clamp();
        pool
    }

    /// Accounts never hold more than the total (a settlement's rounding, a
    /// garbled record): trimmed from the last.
    fn clamp(&mut self) {
        let mut left = self.state.used;
        for a in &mut self.accounts {
            a.used = a.used.min(left);
            left -= a.used;
        }
    }

    /// Accounts for exactly the table's groups (a reload may add or drop
    /// some: a dropped group's units stay in the total, as the rest's).
    fn aligned(mut self, table: &ShareTable) -> Pool {
        let ids = self.accounts.iter().map(|a| a.id);
        if ids.eq(table.groups.iter().map(|g| g.id)) {
            return self; // as nearly always: the record is the table's
        }
        let mut accounts = Vec::with_capacity(table.groups.len());
        for g in &table.groups {
            let found = self.accounts.iter().find(|a| a.id == g.id).copied();
            accounts.push(found.unwrap_or(Account {
                id: g.id,
                ..Account::default()
            }));
        }
        self.accounts = accounts;
        self.clamp();
        self
    }

    /// Keeps the lent parts equal to the deficit D = Σ unmet − free (0
    /// when the free room covers every active floor), so that the free
    /// room always covers what is *not* lent (invariant I′). D shrinks as
    /// borrowed units drain: lents are repaid (in table order). D grows
    /// when a group returns to a lent floor (the `newcomer`: the growth
    /// is its own lent part), or by a settlement past its reservation or
    /// a reload (then the first groups with room take it).
    fn settle_lents(
        &mut self,
        floors: &[u64],
        free: u64,
        limit: &Limit,
        now_ms: u64,
        newcomer: Option<usize>,
    ) {
        let mut unmet_sum = 0u64;
        for (a, &f) in self.accounts.iter_mut().zip(floors) {
            if !active(a, limit, now_ms) {
                a.lent = 0;
                continue;
            }
            let unmet = f.saturating_sub(a.used);
            a.lent = a.lent.min(unmet);
            unmet_sum = unmet_sum.saturating_add(unmet);
        }
        let target = unmet_sum.saturating_sub(free);
        let mut lent_sum: u64 = self.accounts.iter().map(|a| a.lent).sum();
        if lent_sum > target {
            for a in &mut self.accounts {
                let cut = a.lent.min(lent_sum - target);
                a.lent -= cut;
                lent_sum -= cut;
            }
            return;
        }
        let order = newcomer.into_iter().chain(0..self.accounts.len());
        for i in order {
            if lent_sum >= target {
                break;
            }
            let a = &mut self.accounts[i];
            if !active(a, limit, now_ms) {
                continue;
            }
            let add = floors[i]
                .saturating_sub(a.used)
                .saturating_sub(a.lent)
                .min(target - lent_sum);
            a.lent += add;
            lent_sum += add;
        }
    }

    /// What `group` may take now (millionths), and whether its own
    /// ceiling is what binds: conditions 1–3 of the module comment, on a
    /// record whose lent parts are settled.
    fn room(
        &self,
        table: &ShareTable,
        floors: &[u64],
        mine: Option<usize>,
        free: u64,
        limit: &Limit,
        now_ms: u64,
    ) -> (u64, bool) {
        let mut room = free;
        let mut own_drain_only = false;
        let mut covered = 0u64;
        let mut unmet_others = 0u64;
        let capacity = limit.capacity().saturating_mul(SCALE);
        for (i, a) in self.accounts.iter().enumerate() {
            let unmet = floors[i].saturating_sub(a.used);
            if Some(i) == mine {
                // What of its own floor is free for it (not lent).
                covered = unmet.saturating_sub(a.lent);
                let g = &table.groups[i];
                let headroom = floor(capacity, g.permille).saturating_sub(a.used);
                if g.capped && headroom < room {
                    room = headroom;
                    own_drain_only = true;
                }
            } else if active(a, limit, now_ms) {
                unmet_others = unmet_others.saturating_add(unmet);
            }
        }
        // Within its unlent floor: always (I′ keeps that room free).
        // Borrowing: only while every other active floor stays covered,
        // lent parts included (they are owed to their owners).
        let policy_room = covered.max(free.saturating_sub(unmet_others));
        if policy_room < room {
            room = policy_room;
            own_drain_only = false;
        }
        (room.min(free), own_drain_only)
    }

    /// Takes `amount` units for `group` if the bucket, the group's ceiling
    /// and the others' active floors allow it (module comment); with what
    /// the bucket's quota as the group sees it (its `X-RateLimit-*`).
    pub fn take(
        self,
        table: &ShareTable,
        group: u64,
        amount: u64,
        limit: &Limit,
        now_ms: u64,
    ) -> Result<(Pool, Quota), NoShare> {
        let mut pool = self.at(limit, now_ms).aligned(table);
        let capacity = limit.capacity().saturating_mul(SCALE);
        let want = amount.saturating_mul(SCALE);
        let used = pool.state.used;
        let free = capacity.saturating_sub(used);
        let mut buffer = [0; MAX_GROUPS];
        let floors = floors(table, capacity, &mut buffer);
        let mine = pool
            .accounts
            .iter()
            .position(|a| a.id == group && group != REST);
        // Asking makes the group active (its floor is no longer lent out
        // to new borrowers); a return to a lent floor records the lent part.
        let last_seen = mine.map_or(u64::MAX, |i| pool.accounts[i].seen_ms);
        let newcomer = mine.filter(|&i| !active(&pool.accounts[i], limit, now_ms));
        if let Some(i) = mine {
            pool.accounts[i].seen_ms = now_ms;
        }
        pool.settle_lents(floors, free, limit, now_ms, newcomer);

        let (room, own_drain_only) = pool.room(table, floors, mine, free, limit, now_ms);
        // What the client is told: for `anonymous` its share is its whole
        // bucket (`X-RateLimit-Limit`), for a tier the bucket; remaining is
        // what its group may still take.
        let group_limit = group_limit(table, mine, capacity, limit);
        if want <= room {
            pool.record_take(mine, want, floors);
            let quota_now = pool.state.quota(limit, now_ms);
            let (left, _) = pool.room(table, floors, mine, free - want, limit, now_ms);
            return Ok((
                pool,
                Quota {
                    limit: group_limit,
                    remaining: left / SCALE,
                    ..quota_now
                },
            ));
        }
        // Refused: when, and what the caller may see. The room grows with
        // the drain of the total (r), or of the group's own holding
        // (r × u_g ÷ U) when its ceiling binds.
        let quota = Quota {
            limit: group_limit,
            remaining: room / SCALE,
            ..pool.state.quota(limit, now_ms)
        };
        let own = mine
            .map(|i| pool.accounts[i].used)
            .filter(|_| own_drain_only);
        let retry_after_ms = match limit.window {
            Some(w) => next_window(w, now_ms).saturating_sub(now_ms),
            None if want > capacity => quota.reset_ms,
            None => drain_wait(want.saturating_sub(room), used, own, limit),
        }
        .min(MAX_WAIT_MS);
        let shortfall = Shortfall {
            quota,
            retry_after_ms,
        };
        // A refused group is active all the same (its floor is no longer
        // lent): written at most once a second.
        let floored = mine.is_some_and(|i| floors[i] > 0);
        let mark = (floored && last_seen.saturating_add(MARK_EVERY_MS) <= now_ms).then_some(pool);
        Err(NoShare { shortfall, mark })
    }

    /// Counts `want` (scaled) taken, by group `mine` if it has an account:
    /// its lent part shrinks to what its floor still leaves unused.
    fn record_take(&mut self, mine: Option<usize>, want: u64, floors: &[u64]) {
        self.state = BucketState {
            used: self.state.used.saturating_add(want),
            ..self.state
        };
        if let Some(i) = mine {
            let a = &mut self.accounts[i];
            a.used = a.used.saturating_add(want);
            a.lent = a.lent.min(floors[i].saturating_sub(a.used));
        }
    }

    /// Gives back `amount` units taken at `taken_ms` by `group` (nothing
    /// when a calendar window rolled over since).
    pub fn give_back(
        self,
        group: u64,
        amount: u64,
        limit: &Limit,
        taken_ms: u64,
        now_ms: u64,
    ) -> Pool {
        let mut pool = self.at(limit, now_ms);
        let rolled = !same_window(limit, taken_ms, now_ms);
        pool.state = pool.state.give_back(amount, limit, taken_ms, now_ms);
        if !rolled {
            if let Some(a) = pool.account_mut(group) {
                a.used = a.used.saturating_sub(amount.saturating_mul(SCALE));
            }
        }
        pool.clamp();
        pool
    }

    /// Charges `amount` units of usage that already happened to `group`
    /// (may go past capacity, as a plain bucket's charge).
    pub fn charge(self, group: u64, amount: u64, limit: &Limit, now_ms: u64) -> Pool {
        let mut pool = self.at(limit, now_ms);
        pool.state = pool.state.charge(amount, limit, now_ms);
        if let Some(a) = pool.account_mut(group) {
            a.used = a.used.saturating_add(amount.saturating_mul(SCALE));
        }
        pool.clamp();
        pool
    }

    /// What `group` holds now, in millionths (tests, the operator's view).
    #[cfg(test)]
    pub fn held_by(&self, group: u64) -> u64 {
        self.accounts
            .iter()
            .find(|a| a.id == group)
            .map_or(0, |a| a.used)
    }
}

/// A take the shares refused, and the record to write anyway to mark the
/// group active (`None`: nothing to write).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoShare {
    pub shortfall: Shortfall,
    pub mark: Option<Pool>,
}

/// s × C, in millionths.
fn floor(capacity: u64, permille: u32) -> u64 {
    (capacity as u128 * u128::from(permille) / 1000) as u64
}

/// Asked within the time the bucket refills from empty (C ÷ r, at least
/// a second, at most a day); a calendar bucket: within the same window.
fn active(a: &Account, limit: &Limit, now_ms: u64) -> bool {
    if a.seen_ms == 0 {
        return false;
    }
    if let Some(w) = limit.window {
        return window_start(w, a.seen_ms) == window_start(w, now_ms);
    }
    let refill = crate::limits::bucket::drain_ms(limit.capacity().saturating_mul(SCALE), limit)
        .clamp(1_000, 86_400_000);
    a.seen_ms.saturating_add(refill) > now_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::shares::*;
    use crate::policy::units::parse_permille as parse_share;
    use crate::policy::units::Rate;
    use crate::policy::Policy;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn limit(amount: u64, period_ms: u64) -> Limit {
        Limit {
            rate: Rate { amount, period_ms },
            burst: amount,
            window: None,
        }
    }

    fn table(shares: &[(&str, u32)]) -> ShareTable {
        ShareTable::compile(&SharesConfig(
            shares.iter().map(|(n, p)| (n.to_string(), *p)).collect(),
        ))
        .unwrap()
    }

    fn take(p: &mut Pool, t: &ShareTable, g: u64, l: &Limit, now: u64) -> bool {
        match p.clone().take(t, g, 1, l, now) {
            Ok((next, _)) => {
                *p = next;
                true
            }
            Err(r) => {
                if let Some(m) = r.mark {
                    *p = m;
                }
                false
            }
        }
    }

    #[test]
    fn anonymous_never_holds_more_than_its_share_and_declared_keys_find_the_rest() {
        let l = limit(200, 60_000);
        let t = table(&[("anonymous", 500)]);
        let anon = t.group_of("free", false);
        let free = t.group_of("free", true);
        assert_eq!(free, REST);
        let mut p = Pool::default();
        let got = (0..6_000)
            .filter(|_| take(&mut p, &t, anon, &l, 1_000))
            .count();
        assert_eq!(got, 100, "half of 200");
        let refused = p.clone().take(&t, anon, 1, &l, 1_000).unwrap_err();
        assert_eq!(refused.shortfall.quota.remaining, 0);
        // Its own holding drains at r × 100/100 here: one unit in 300 ms.
        assert_eq!(refused.shortfall.retry_after_ms, 300);
        let got = (0..200)
            .filter(|_| take(&mut p, &t, free, &l, 1_000))
            .count();
        assert_eq!(got, 100, "the declared rest gets the other half");
    }

    #[test]
    fn an_idle_share_is_lent_and_taken_back_as_its_owner_returns() {
        let l = limit(100, 60_000);
        let t = table(&[("pro", 400), ("anonymous", 200)]);
        let pro = t.group_of("pro", true);
        let rest = t.group_of("free", true);
        let mut p = Pool::default();
        // pro idle: the rest borrows everything.
        let got = (0..150)
            .filter(|_| take(&mut p, &t, rest, &l, 1_000))
            .count();
        assert_eq!(got, 100, "work-conserving");
        // pro returns: refused (full), but now active; the rest may not
        // take again until pro's floor (40) is back, pro gets what drains.
        assert!(!take(&mut p, &t, pro, &l, 1_000));
        let mut pro_got = 0;
        let mut rest_got = 0;
        for step in 1..=40 {
            let now = 2_000 + step * 600; // one unit drains every 600 ms
            rest_got += usize::from(take(&mut p, &t, rest, &l, now));
            pro_got += usize::from(take(&mut p, &t, pro, &l, now));
        }
        assert_eq!(rest_got, 0, "no borrowing while pro's floor is lent");
        assert!(pro_got >= 39, "pro took back its floor: {pro_got}");
        // At its floor, pro keeps at least 40 % of the rate; the rest
        // borrows what pro leaves.
        let (mut pro_more, mut rest_more) = (0, 0);
        for step in 1..=100 {
            let now = 26_000 + step * 600;
            rest_more += usize::from(take(&mut p, &t, rest, &l, now));
            pro_more += usize::from(take(&mut p, &t, pro, &l, now));
        }
        assert!(pro_more >= 40, "{pro_more}");
        assert!(rest_more > 0, "{rest_more}");
    }

    #[test]
    fn a_refused_group_writes_at_most_once_a_second() {
        let l = limit(10, 60_000);
        let t = table(&[("anonymous", 500)]);
        let anon = t.group_of("x", false);
        let mut p = Pool::default();
        for _ in 0..5 {
            take(&mut p, &t, anon, &l, 1_000);
        }
        // anonymous has no floor to claim back: its refusals write nothing.
        assert!(p.take(&t, anon, 1, &l, 2_000).unwrap_err().mark.is_none());
        let t = table(&[("pro", 500)]);
        let pro = t.group_of("pro", true);
        let mut p = Pool::default();
        for _ in 0..10 {
            take(&mut p, &t, REST, &l, 1_000);
        }
        assert!(
            p.clone()
                .take(&t, pro, 1, &l, 1_000)
                .unwrap_err()
                .mark
                .is_some(),
            "returns"
        );
        let marked = p.take(&t, pro, 1, &l, 1_000).unwrap_err().mark.unwrap();
        assert!(marked
            .clone()
            .take(&t, pro, 1, &l, 1_500)
            .unwrap_err()
            .mark
            .is_none());
        assert!(marked
            .take(&t, pro, 1, &l, 2_000)
            .unwrap_err()
            .mark
            .is_some());
    }

    #[test]
    fn settlement_moves_the_group_and_the_total_together() {
        let l = limit(1_000, 60_000);
        let t = table(&[("pro", 500)]);
        let pro = t.group_of("pro", true);
        let (p, q) = Pool::default().take(&t, pro, 100, &l, 0).unwrap();
        assert_eq!(
            (q.limit, q.remaining),
            (1_000, 900),
            "alone, pro may borrow the rest"
        );
        let anon =
            ShareTable::compile(&SharesConfig(BTreeMap::from([(ANONYMOUS.into(), 500)]))).unwrap();
        let (_, q) = Pool::default()
            .take(&anon, anon.groups[0].id, 100, &l, 0)
            .unwrap();
        assert_eq!(
            (q.limit, q.remaining),
            (500, 400),
            "anonymous: its share is its bucket"
        );
        let p = p.give_back(pro, 60, &l, 0, 0).charge(pro, 10, &l, 0);
        assert_eq!(p.state.used, 50 * SCALE);
        assert_eq!(p.held_by(pro), 50 * SCALE);
        assert_eq!(Pool::decode(&p.encode()), p);
        let plain = BucketState::default().encode();
        assert_eq!(
            Pool::decode(&plain).encode(),
            plain,
            "a plain bucket stays plain"
        );
    }

    #[test]
    fn shares_parse_and_names_are_checked() {
        assert_eq!(parse_share(&serde_json::json!("20%")), Some(200));
        assert_eq!(parse_share(&serde_json::json!("12.5 %")), Some(125));
        assert_eq!(parse_share(&serde_json::json!(0.3)), Some(300));
        for bad in [
            serde_json::json!("0%"),
            serde_json::json!("150%"),
            serde_json::json!(20),
            serde_json::json!("x"),
        ] {
            assert_eq!(parse_share(&bad), None, "{bad}");
        }
    }

    #[test]
    fn policies_name_the_field_of_a_bad_share_and_default_to_half_for_anonymous() {
        let base = || {
            serde_json::json!({"default_tier": "free",
                "tiers": {"free": {}, "pro": {}},
                "identity": {"sources": ["api_key", "client_address"],
                             "api_key": {"keys": {"k1": "pro"}}},
                "models": {"m": {"requests": "10/min"}},
                "routes": [{"name": "chat", "path_prefix": "/v1/chat", "requests": "10/min"}]})
        };
        let err = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = base();
            edit(&mut v);
            Policy::from_value(v).unwrap_err()
        };
        let e = err(&|v| v["models"]["m"]["shares"] = serde_json::json!({"gold": "10%"}));
        assert_eq!(e.path, "models.m.shares.gold", "{e}");
        let e = err(&|v| {
            v["routes"][0]["shares"] = serde_json::json!({"free": "60%", "anonymous": "50%"})
        });
        assert_eq!(e.path, "routes[0].shares", "{e}");
        assert!(e.message.contains("110.0%"), "{e}");
        let e = err(&|v| v["defaults"] = serde_json::json!({"shares": {"pro": "0%"}}));
        assert!(e.path.starts_with("defaults"), "{e}");
        let e = err(&|v| v["models"]["n"] = serde_json::json!({"shares": {"pro": "10%"}}));
        assert_eq!(e.path, "models.n.shares", "{e}");

        let p = Policy::from_value(base()).unwrap();
        assert_eq!(default_for(&p).0[ANONYMOUS], DEFAULT_ANONYMOUS_PERMILLE);
        let mut v = base();
        v["defaults"] = serde_json::json!({"shares": {}});
        assert!(ShareTable::compile(&default_for(&Policy::from_value(v).unwrap())).is_none());
        let mut v = base();
        v["identity"] = serde_json::json!({"sources": ["client_address"]});
        assert!(
            default_for(&Policy::from_value(v).unwrap()).0.is_empty(),
            "nobody to protect"
        );
    }

    /// Arrivals per step of each group: `asks[g]` requests (one unit each).
    fn run(t: &ShareTable, ids: &[u64], l: &Limit, steps: &[(Vec<u8>, u64)]) -> (Vec<u64>, bool) {
        let mut p = Pool::default();
        let mut now = 1u64;
        let mut got = vec![0u64; ids.len()];
        let mut ok = true;
        for (asks, dt) in steps {
            now += dt;
            for (g, &n) in asks.iter().enumerate() {
                for _ in 0..n {
                    if take(&mut p, t, ids[g], l, now) {
                        got[g] += 1;
                    }
                    ok &= p.state.used <= l.capacity() * SCALE;
                    ok &= p.accounts.iter().map(|a| a.used).sum::<u64>() <= p.state.used;
                }
            }
        }
        (got, ok)
    }

    proptest! {
        /// Any arrivals of three named groups and the rest, any clock: the
        /// total never passes the bucket, anonymous never its share, and
        /// admissions never exceed capacity + refill.
        #[test]
        fn total_and_ceiling_always_hold(
            cap in 1u64..200,
            s in prop::collection::vec(1u32..400, 3),
            steps in prop::collection::vec((prop::collection::vec(0u8..6, 4), 0u64..8_000), 1..120),
        ) {
            let l = limit(cap, 60_000);
            let t = table(&[("anonymous", s[0]), ("free", s[1]), ("pro", s[2])]);
            let ids = [t.group_of("x", false), t.group_of("free", true), t.group_of("pro", true), REST];
            let mut p = Pool::default();
            let mut now = 1u64;
            let mut admitted = 0u64;
            for (asks, dt) in &steps {
                now += dt;
                for (g, &n) in asks.iter().enumerate() {
                    for _ in 0..n {
                        admitted += u64::from(take(&mut p, &t, ids[g], &l, now));
                        prop_assert!(p.state.used <= cap * SCALE);
                        prop_assert!(p.held_by(ids[0]) <= floor(cap * SCALE, s[0]));
                        prop_assert!(p.accounts.iter().map(|a| a.used).sum::<u64>() <= p.state.used);
                        // I′: the free room covers every active group's
                        // unlent floor (what it may take at once).
                        let free = cap * SCALE - p.state.used;
                        let owed: u64 = t.groups.iter().zip(&p.accounts)
                            .filter(|(g, a)| !g.capped && active(a, &l, now))
                            .map(|(g, a)| floor(cap * SCALE, g.permille).saturating_sub(a.used).saturating_sub(a.lent))
                            .sum();
                        prop_assert!(free >= owed, "free {} owed {}", free, owed);
                    }
                }
            }
            prop_assert!(admitted <= cap + (now * cap).div_ceil(60_000));
        }

        /// A tier that asks continuously (5 requests every 100 ms, more
        /// than it can get) is admitted at least its share of the rate
        /// over a minute, less one request, whatever the others send and
        /// even when they ask first in every step.
        #[test]
        fn a_tier_asking_continuously_gets_its_share(
            share in 50u32..700,
            others in prop::collection::vec((0u8..20, 0u8..20), 600),
        ) {
            let cap = 100u64;
            let l = limit(cap, 60_000); // one unit every 600 ms
            let t = table(&[("pro", share), ("anonymous", 1000 - share)]);
            let order = [t.group_of("x", false), REST, t.group_of("pro", true)];
            // pro asks first once (active from the start: its floor is
            // not lent when it arrives), then last in every step, the
            // worst order for it, while anonymous arrives whenever the
            // strategy says (possibly to a floor the rest borrowed).
            let steps: Vec<(Vec<u8>, u64)> = std::iter::once((vec![0, 0, 5], 0))
                .chain(others.iter().map(|&(a, r)| (vec![a, r, 5], 100)))
                .collect();
            let (got, ok) = run(&t, &order, &l, &steps);
            prop_assert!(ok);
            // Its floor at once (g whole requests), then 60 s (one refill
            // time) at r × (g − 1) ÷ C, the floor being held in whole
            // requests less the one in flight.
            let g = u64::from(share) * cap / 1000;
            let floor_units = g + (g - 1);
            prop_assert!(got[2] + 1 >= floor_units, "pro got {} of at least {}", got[2], floor_units);
        }

        /// Only one group asking: it may use the whole bucket (anonymous:
        /// its share), whatever shares the others have.
        #[test]
        fn one_active_tier_uses_the_whole_bucket(
            cap in 1u64..300,
            s in prop::collection::vec(1u32..333, 3),
            who in 0usize..3,
        ) {
            let l = limit(cap, 60_000);
            let t = table(&[("free", s[0]), ("pro", s[1]), ("anonymous", s[2])]);
            let ids = [t.group_of("free", true), t.group_of("pro", true), REST];
            let mut p = Pool::default();
            let got = (0..cap + 10).filter(|_| take(&mut p, &t, ids[who], &l, 1)).count() as u64;
            prop_assert_eq!(got, cap);
            let anon = t.group_of("x", false);
            let mut p = Pool::default();
            let got = (0..cap + 10).filter(|_| take(&mut p, &t, anon, &l, 1)).count() as u64;
            prop_assert_eq!(got, cap * u64::from(s[2]) / 1000);
        }
    }
}
