//! The one hashed slot table: a fixed set of shared-data keys (Envoy never
//! frees a key, so the set is bounded by the policy or by a constant, never
//! by traffic), a caller's home slot from its hash, the slots probed from
//! there, and the claim: the caller's own slot if a probed one is, else the
//! best free one, else none (the table is full for this caller).
//!
//! Used by the per-caller buckets (`crate::limits::reservation`: `PROBES`
//! slots of `state.principal_slots`), the fleet's leases (`crate::fleet`:
//! 4 of `fleet.lease.slots`) and the penalty box's block records
//! (`crate::admission::penalty`: one key of 2,048, then one of its 8
//! records); route health places unlisted models' breakers and credential
//! pauses by hash alone (`crate::admission::pushback`: no probing, no
//! claim). What "mine", "free" and "in use" mean is each user's own.
//!
//! Key names. `{prefix}{name}:{slot}` for a table per rule (the rule id is
//! `name`), `{prefix}{slot}` for a fixed table: the names running Envoys
//! hold, byte for byte.

use crate::state::store::{SharedStore, StoreError};

/// One table of hashed slot keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotTable<'a> {
    prefix: &'static str,
    name: Option<&'a str>,
    /// At least 1.
    slots: u32,
    probes: u32,
}

impl<'a> SlotTable<'a> {
    /// The table of rule `name`: keys `{prefix}{name}:{slot}`.
    pub fn named(prefix: &'static str, name: &'a str, slots: u32, probes: u32) -> SlotTable<'a> {
        SlotTable {
            prefix,
            name: Some(name),
            slots: slots.max(1),
            probes,
        }
    }

    /// A table of the whole filter: keys `{prefix}{slot}`.
    pub const fn flat(prefix: &'static str, slots: u32, probes: u32) -> SlotTable<'static> {
        SlotTable {
            prefix,
            name: None,
            slots: if slots == 0 { 1 } else { slots },
            probes,
        }
    }

    /// The key of `slot` (on every request that claims one: written into
    /// a buffer of its size, the formatter only for the number).
    pub fn key(&self, slot: u32) -> String {
        use std::fmt::Write as _;
        let name = self.name.unwrap_or_default();
        let mut key = String::with_capacity(self.prefix.len() + name.len() + 11);
        key.push_str(self.prefix);
        if self.name.is_some() {
            key.push_str(name);
            key.push(':');
        }
        let _ = write!(key, "{slot}"); // writing to a String cannot fail
        key
    }

    /// Every key of the table, in slot order.
    pub fn keys(&self) -> impl Iterator<Item = String> + '_ {
        (0..self.slots).map(|s| self.key(s))
    }

    /// The slot a hash lives at first.
    pub fn home(&self, hash: u64) -> u32 {
        (hash % u64::from(self.slots)) as u32
    }

    /// The key of a hash's home slot (a table placed by hash alone).
    pub fn place(&self, hash: u64) -> String {
        self.key(self.home(hash))
    }

    /// The keys probed for a hash, from its home slot on (wrapping), at
    /// most `probes` and never a slot twice.
    pub fn probe(&self, hash: u64) -> impl Iterator<Item = String> + '_ {
        let home = self.home(hash);
        (0..self.probes.min(self.slots)).map(move |p| self.key((home + p) % self.slots))
    }

    /// Creates every key with `empty` unless it exists (a live slot of an
    /// earlier policy is kept); how many were created.
    pub fn prepare(&self, store: &dyn SharedStore, empty: &[u8]) -> Result<usize, StoreError> {
        let mut created = 0;
        for key in self.keys() {
            if store.get(&key).is_none() {
                store.set(&key, empty, 0)?;
                created += 1;
            }
        }
        Ok(created)
    }
}

/// What a claim sees in one probed slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotSeen<R> {
    /// The caller's own: taken at once, nothing further is probed.
    Mine,
    /// Free for the caller, ranked: the lowest rank wins, the first of
    /// equals.
    Free(R),
    /// Free and never used: nothing after it can be the caller's (a chain
    /// ends here), so probing stops.
    Last(R),
    /// In use by another caller.
    Busy,
}

/// How a claim ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotClaim<T> {
    Mine(T),
    Free(T),
    /// Every probed slot is in use.
    Full,
}

impl<T> SlotClaim<T> {
    /// The slot claimed, the caller's own or a free one.
    pub fn slot(self) -> Option<T> {
        match self {
            SlotClaim::Mine(t) | SlotClaim::Free(t) => Some(t),
            SlotClaim::Full => None,
        }
    }
}

/// The claim over probed slots (keys, or records of one key), in probe
/// order: the caller's own as soon as it is seen, else the best free one.
/// `look` may read and write (it is called once per slot, in order, and
/// not past the slot that ends the claim).
pub fn claim<T, R: Ord>(
    candidates: impl IntoIterator<Item = T>,
    mut look: impl FnMut(&T) -> SlotSeen<R>,
) -> SlotClaim<T> {
    let mut best: Option<(R, T)> = None;
    for candidate in candidates {
        let (rank, last) = match look(&candidate) {
            SlotSeen::Mine => return SlotClaim::Mine(candidate),
            SlotSeen::Busy => continue,
            SlotSeen::Free(rank) => (rank, false),
            SlotSeen::Last(rank) => (rank, true),
        };
        if best.as_ref().is_none_or(|(b, _)| rank < *b) {
            best = Some((rank, candidate));
        }
        if last {
            break;
        }
    }
    best.map_or(SlotClaim::Full, |(_, c)| SlotClaim::Free(c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::store::MemStore;

    #[test]
    fn key_names_are_the_ones_envoys_hold() {
        let per_rule = SlotTable::named("sluice:v1:", "tier/free/requests", 4, 8);
        assert_eq!(per_rule.key(3), "sluice:v1:tier/free/requests:3");
        let fleet = SlotTable::named("sluice:v1:fleet:lease:", "r", 2, 4);
        assert_eq!(fleet.key(1), "sluice:v1:fleet:lease:r:1");
        let flat = SlotTable::flat("sluice:v2:abuse:block:", 2048, 1);
        assert_eq!(flat.key(7), "sluice:v2:abuse:block:7");
        assert_eq!(flat.keys().count(), 2048);
    }

    #[test]
    fn probes_wrap_from_home_and_never_repeat() {
        let t = SlotTable::named("p:", "r", 5, 8);
        let keys: Vec<String> = t.probe(13).collect();
        assert_eq!(keys, ["p:r:3", "p:r:4", "p:r:0", "p:r:1", "p:r:2"]);
        let t = SlotTable::named("p:", "r", 0, 8);
        assert_eq!(t.probe(99).collect::<Vec<_>>(), ["p:r:0"], "0 slots is 1");
    }

    #[test]
    fn claim_takes_mine_else_the_lowest_free_else_none() {
        let seen = |s: &[(u32, SlotSeen<u8>)]| {
            let s = s.to_vec();
            claim(s.iter().map(|(i, _)| *i), |i| s[*i as usize].1)
        };
        use SlotSeen::*;
        assert_eq!(seen(&[(0, Free(1)), (1, Mine)]), SlotClaim::Mine(1));
        assert_eq!(
            seen(&[(0, Free(2)), (1, Free(1)), (2, Free(1))]),
            SlotClaim::Free(1)
        );
        assert_eq!(
            seen(&[(0, Busy), (1, Last(5)), (2, Mine)]),
            SlotClaim::Free(1)
        );
        assert_eq!(seen(&[(0, Busy), (1, Busy)]), SlotClaim::Full);
    }

    #[test]
    fn prepare_keeps_live_slots() {
        let store = MemStore::default();
        let t = SlotTable::named("p:", "r", 3, 1);
        store.set("p:r:1", b"live", 0).unwrap();
        assert_eq!(t.prepare(&store, b"empty").unwrap(), 2);
        assert_eq!(store.get("p:r:1").unwrap().0, b"live");
        assert_eq!(t.prepare(&store, b"empty").unwrap(), 0);
    }
}
