//! Worker-local leases (issue 21, lever 2), `state.worker_leases`. Each
//! Envoy worker runs its own wasm VM: its memory is its own, shared data is
//! the whole Envoy's. A worker that takes from a shared bucket (a caller's
//! declared record, a model's, a route's) far from its end takes a little
//! more, a *lease*, and admits the next requests against it in its own
//! memory, with no host call. This is the fleet's lease (`crate::fleet`,
//! [`FleetLease`](crate::fleet): Redis → Envoy) one level down (shared
//! data → worker), with the same bound — a grant is at most a fair share
//! of what is left, so near the end of a bucket every take is exact
//! again — but its own sizing
//! ([`LeaseAsk::extra`](crate::limits::reservation::LeaseAsk::extra)): the fleet's grant
//! follows demand (the last grant doubled, at most `lease.max` beyond the
//! need and `left ÷ expected_replicas`), a worker's is a fixed fraction,
//! at most `left ÷ (2 × workers)` and at most `max_permille` of the
//! capacity; once that is under one unit the take is the strict path
//! (one compare-and-swap per record, as without leases). The fleet's
//! leases are sub-leased to its workers with this type and this sizing. Hashed per-caller records (which may change hands)
//! and soft caps are never leased.
//!
//! Exactness: 0 overshoot. Every unit admitted from a lease was first
//! taken from the shared bucket; a settlement's give-back goes to the
//! lease while it is held (else to the shared bucket), an extra charge is
//! paid from the lease as far as it goes and the rest charged to the
//! shared bucket at once (so other workers see it).
//!
//! Time. A lease is given back `ttl` after it was taken at the latest,
//! and never outlives its calendar window (a daily budget's lease ends at
//! midnight of its zone; its units were that day's). The give-back runs on
//! the worker's next request or tick, whichever comes first. A lease of a
//! refilling bucket (a rate) counts its units as used from the moment it
//! was taken: over any interval the worker may admit units taken up to
//! `ttl` earlier, so a rate of `r` admits at most `C + r × (t + ttl)` in
//! an interval of length `t` (`C + r × t` without leases).
//!
//! Stranding (units one worker holds while another refuses): per bucket
//! (and per declared caller), each other worker holds at most one lease,
//! at most `max_permille × C` and at most `left ÷ (2 × workers)` of what
//! was left when it was taken, for at most `ttl`. A worker VM that is
//! restarted loses its leases: they count as used until the bucket refills
//! them or their window ends (under-admission, never over).

use crate::limits::bucket::{same_window, Quota};
use crate::limits::reservation::Held;

/// Most leases one worker holds; beyond, the oldest is given back.
pub const MAX_LEASES: usize = 256;

/// One lease: where its units live (`held`: key, rule, owner, limit; its
/// `amount` the units granted so far), what is left of them, the bucket's
/// quota as this worker last saw it, when it is given back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLease {
    pub held: Held,
    pub balance: u64,
    pub quota: Quota,
    pub expires_ms: u64,
}

/// What a settlement did to a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseSettled {
    /// No live lease of that bucket: settle the shared bucket.
    NotHeld,
    /// Taken by the lease; this many units are still to charge to the
    /// shared bucket (the lease could not pay them).
    Absorbed(u64),
}

/// One worker's leases.
#[derive(Debug, Default)]
pub struct Leases {
    list: Vec<WorkerLease>,
    /// Drained for good (the policy that took them was replaced): a lease
    /// added now is handed straight back, so a request of the old policy
    /// still in flight cannot strand one where no tick looks.
    closed: bool,
}

impl Leases {
    fn find(&mut self, key: &str, rule: &str, owner: u64, now_ms: u64) -> Option<&mut WorkerLease> {
        self.list.iter_mut().find(|l| {
            l.expires_ms > now_ms
                && l.held.owner == owner
                && *l.held.rule == *rule
                && *l.held.key == *key
                && same_window(&l.held.limit, l.held.taken_ms, now_ms)
        })
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.list.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Units this worker holds of `rule`, all owners.
    pub fn held_of(&self, rule: &str) -> u64 {
        self.list
            .iter()
            .filter(|l| *l.held.rule == *rule)
            .map(|l| l.balance)
            .sum()
    }

    /// What a live lease of the bucket has left (`None`: none held).
    pub fn balance(&mut self, key: &str, rule: &str, owner: u64, now_ms: u64) -> Option<u64> {
        self.find(key, rule, owner, now_ms).map(|l| l.balance)
    }

    /// Takes `amount` from a live lease of the bucket, if it covers it:
    /// what the request holds (the lease's place, `amount`, taken now) and
    /// the bucket's quota as this worker sees it.
    pub fn debit(
        &mut self,
        key: &str,
        rule: &str,
        owner: u64,
        amount: u64,
        now_ms: u64,
    ) -> Option<(Held, Quota)> {
        let lease = self.find(key, rule, owner, now_ms)?;
        if lease.balance < amount {
            return None;
        }
        lease.balance -= amount;
        lease.quota.remaining = lease.quota.remaining.saturating_sub(amount);
        let held = Held {
            amount,
            taken_ms: now_ms,
            ..lease.held.clone()
        };
        Some((held, lease.quota))
    }

    /// [`Leases::debit`] from a live lease of `rule` for `owner`, wherever
    /// it lives (a fleet lease's slot, found when it was taken).
    pub fn debit_by(&mut self, rule: &str, owner: u64, amount: u64, now_ms: u64) -> Option<Held> {
        let lease = self.list.iter_mut().find(|l| {
            l.expires_ms > now_ms
                && l.held.owner == owner
                && *l.held.rule == *rule
                && same_window(&l.held.limit, l.held.taken_ms, now_ms)
        })?;
        if lease.balance < amount {
            return None;
        }
        lease.balance -= amount;
        Some(Held {
            amount,
            taken_ms: now_ms,
            ..lease.held.clone()
        })
    }

    /// Puts back what [`Leases::debit`] took (the request was refused by
    /// another bucket); `false`: the lease is gone, give it to the shared
    /// bucket.
    pub fn credit(&mut self, h: &Held, now_ms: u64) -> bool {
        match self.find(&h.key, &h.rule, h.owner, now_ms) {
            Some(lease) => {
                lease.balance = lease.balance.saturating_add(h.amount);
                lease.quota.remaining = lease.quota.remaining.saturating_add(h.amount);
                true
            }
            None => false,
        }
    }

    /// Adds a lease just taken (`held.amount` units), merged into a live
    /// one of the same bucket (whose give-back time stays). Returns the
    /// lease that no longer fits, to give back.
    pub fn add(
        &mut self,
        held: Held,
        quota: Quota,
        expires_ms: u64,
        now_ms: u64,
    ) -> Option<WorkerLease> {
        if self.closed {
            return Some(WorkerLease {
                balance: held.amount,
                held,
                quota,
                expires_ms,
            });
        }
        if let Some(lease) = self.find(&held.key, &held.rule, held.owner, now_ms) {
            lease.balance = lease.balance.saturating_add(held.amount);
            lease.held.amount = lease.held.amount.saturating_add(held.amount);
            lease.quota = quota;
            return None;
        }
        self.list.push(WorkerLease {
            balance: held.amount,
            held,
            quota,
            expires_ms,
        });
        (self.list.len() > MAX_LEASES).then(|| self.list.remove(0))
    }

    /// A request's settlement (`actual` for the `h.amount` it reserved)
    /// into the live lease of its bucket, if this worker holds one.
    pub fn settle(
        &mut self,
        h: &Held,
        actual: u64,
        window_moved: bool,
        now_ms: u64,
    ) -> LeaseSettled {
        let Some(lease) = self.find(&h.key, &h.rule, h.owner, now_ms) else {
            return LeaseSettled::NotHeld;
        };
        if actual <= h.amount {
            // A give-back from an earlier window is owed nothing (as in the
            // shared bucket).
            if !window_moved {
                lease.balance = lease.balance.saturating_add(h.amount - actual);
            }
            return LeaseSettled::Absorbed(0);
        }
        let charge = actual - h.amount;
        let paid = charge.min(lease.balance);
        lease.balance -= paid;
        lease.quota.remaining = lease.quota.remaining.saturating_sub(paid);
        LeaseSettled::Absorbed(charge - paid)
    }

    /// The leases due back at `now_ms` (expired), removed: each as the
    /// units to give back to its bucket (`amount` = the unused balance).
    pub fn due(&mut self, now_ms: u64) -> Vec<Held> {
        let mut out = Vec::new();
        self.list.retain(|l| {
            let keep = l.expires_ms > now_ms;
            if !keep {
                out.push(WorkerLease::returned(l));
            }
            keep
        });
        out
    }

    /// Every lease, removed (a policy reload, a shutdown).
    pub fn drain(&mut self) -> Vec<Held> {
        self.list
            .drain(..)
            .map(|l| WorkerLease::returned(&l))
            .collect()
    }

    /// [`Leases::drain`], for good: every later [`Leases::add`] hands its
    /// lease straight back.
    pub fn close(&mut self) -> Vec<Held> {
        self.closed = true;
        self.drain()
    }

    /// The earliest time a lease is due back (`u64::MAX`: none).
    pub fn next_due(&self) -> u64 {
        self.list
            .iter()
            .map(|l| l.expires_ms)
            .min()
            .unwrap_or(u64::MAX)
    }
}

impl WorkerLease {
    /// What giving the lease back returns: its unused balance.
    pub fn returned(l: &WorkerLease) -> Held {
        Held {
            amount: l.balance,
            ..l.held.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::reservation::Placement;
    use crate::policy::units::Rate;
    use crate::policy::Limit;

    fn held(amount: u64) -> Held {
        Held {
            key: "sluice:v1:rec:model/m".into(),
            rule: "model/m/tokens".into(),
            placement: Placement::Global,
            owner: 0,
            amount,
            limit: Limit {
                rate: Rate {
                    amount: 1_000,
                    period_ms: 60_000,
                },
                burst: 1_000,
                window: None,
            },
            taken_ms: 0,
        }
    }

    fn quota() -> Quota {
        Quota {
            limit: 1_000,
            remaining: 500,
            reset_ms: 0,
        }
    }

    #[test]
    fn a_lease_pays_what_it_can_and_the_rest_goes_to_the_shared_bucket() {
        let mut l = Leases::default();
        assert!(l.add(held(50), quota(), 1_000, 0).is_none());
        let (h, q) = l.debit(&held(0).key, "model/m/tokens", 0, 30, 1).unwrap();
        assert_eq!((h.amount, q.remaining), (30, 470));
        assert!(l.debit(&h.key, &h.rule, 0, 21, 1).is_none(), "20 left");
        // Used 10 of 30: 20 back into the lease.
        assert_eq!(l.settle(&h, 10, false, 2), LeaseSettled::Absorbed(0));
        assert_eq!(l.held_of("model/m/tokens"), 40);
        // Used 100 of 30: the lease pays 40, 30 go to the shared bucket.
        assert_eq!(l.settle(&h, 100, false, 3), LeaseSettled::Absorbed(30));
        assert_eq!(l.held_of("model/m/tokens"), 0);
        // A give-back from an earlier window is owed nothing.
        assert_eq!(l.settle(&h, 0, true, 4), LeaseSettled::Absorbed(0));
        assert_eq!(l.held_of("model/m/tokens"), 0);
    }

    #[test]
    fn a_lease_is_due_at_its_time_and_bounded_in_number() {
        let mut l = Leases::default();
        l.add(held(50), quota(), 1_000, 0);
        assert_eq!(l.next_due(), 1_000);
        assert!(l.due(999).is_empty());
        assert!(
            l.debit(&held(0).key, "model/m/tokens", 0, 1, 1_000)
                .is_none(),
            "expired"
        );
        let back = l.due(1_000);
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].amount, 50, "its unused balance");
        assert_eq!(l.settle(&held(1), 0, false, 1_000), LeaseSettled::NotHeld);
        for owner in 0..(MAX_LEASES as u64 + 1) {
            let h = Held { owner, ..held(1) };
            let evicted = l.add(h, quota(), 5_000, 0);
            assert_eq!(evicted.is_some(), owner == MAX_LEASES as u64);
        }
        assert_eq!(l.len(), MAX_LEASES);
        assert_eq!(l.drain().len(), MAX_LEASES);
        assert!(l.is_empty());
    }

    #[test]
    fn a_budget_lease_never_serves_nor_takes_back_for_another_window() {
        const DAY: u64 = 86_400_000;
        let mut daily = held(100);
        daily.limit.window = Some(crate::policy::Window::Day(crate::policy::zone::Zone::UTC));
        daily.taken_ms = DAY - 10;
        let mut l = Leases::default();
        // Live for a minute by its ttl, but the day ends in 10 ms.
        assert!(l
            .add(daily.clone(), quota(), DAY + 60_000, DAY - 10)
            .is_none());
        assert!(l.debit_by(&daily.rule, 0, 10, DAY - 5).is_some());
        assert!(
            l.debit_by(&daily.rule, 0, 10, DAY + 5).is_none(),
            "yesterday's units"
        );
        assert!(l.debit(&daily.key, &daily.rule, 0, 10, DAY + 5).is_none());
        // A request of yesterday settled today gives nothing to a lease.
        let asked = Held {
            amount: 50,
            taken_ms: DAY - 5,
            ..daily.clone()
        };
        assert_eq!(l.settle(&asked, 0, true, DAY + 5), LeaseSettled::NotHeld);
    }

    #[test]
    fn a_closed_table_hands_every_new_lease_straight_back() {
        let mut l = Leases::default();
        assert!(l.add(held(50), quota(), 1_000, 0).is_none());
        assert_eq!(l.close().iter().map(|h| h.amount).sum::<u64>(), 50);
        let back = l.add(held(20), quota(), 1_000, 1).expect("handed back");
        assert_eq!(back.balance, 20);
        assert!(l.debit(&held(0).key, "model/m/tokens", 0, 1, 2).is_none());
        assert_eq!(l.len(), 0);
    }
}
