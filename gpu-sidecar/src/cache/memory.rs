//! The in-memory store: entries by key, bounded by count and bytes, each
//! with its own expiry. Time is given (`now_ms`), never read here. One
//! mutex around it (lookups and stores are O(log scopes) here; the
//! semantic search is in [`super::semantic`]).
//!
//! Bounds per scope (the filter's scope id, [`Stored::scope`]; entries
//! without one share the scope `""`): when a store takes the cache over
//! `max_entries`, the entry evicted is the least recently used of the
//! scope holding the **most entries** (over `max_bytes`: the most bytes);
//! among scopes holding as much, the one whose oldest entry is the least
//! recently used. So one scope's stores never push out an entry of a scope
//! holding less than the largest, and a scope within its fair share
//! (`max_entries / scopes holding entries`, likewise for bytes) never
//! loses an entry to another scope's store: only to its own stores, its
//! TTL and purges. A single caller flooding the cache ends up evicting its
//! own oldest entries. The entry being stored is never the one evicted.
//!
//! The floor (`scope_floor`, default 4): a scope holding at most
//! `scope_floor` entries never loses one to another scope's store over
//! the entry bound, nor, holding at most the same share of `max_bytes`
//! (`max_bytes × scope_floor / max_entries`), over the byte bound.
//! Only scopes holding more are chosen as above; when none does, the
//! storing scope makes room from its own older entries, and if it has
//! none the answer is not stored (a later miss for that caller, never an
//! eviction of someone else's floor). At most `max_entries / scope_floor`
//! scopes can hold a full floor at once: a flood of more new scopes than
//! that leaves the floors of those already there, and stores nothing more
//! for newcomers until entries expire or are purged.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

pub use super::entry::Limits;
use super::entry::Stored;

struct Slot {
    stored: Arc<Stored>,
    scope: String,
    bytes: u64,
    tick: u64,
}

/// What one scope holds, and its use order (tick → key; first: least
/// recently used).
#[derive(Default)]
struct ScopeUse {
    entries: usize,
    bytes: u64,
    lru: BTreeMap<u64, String>,
}

impl ScopeUse {
    fn oldest(&self) -> u64 {
        self.lru.keys().next().copied().unwrap_or(0)
    }
}

/// What a `put` or `get` removed, so the semantic index forgets it too.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// Pushed out by the bounds.
    pub evicted: Vec<(String, String)>,
    /// Found past their expiry.
    pub expired: Vec<(String, String)>,
}

/// Scopes ranked by what they hold, then by how long their oldest entry
/// has gone unused: the last is the next to lose an entry.
type Ranking<T> = BTreeSet<(T, Reverse<u64>, String)>;

pub struct MemoryStore {
    limits: Limits,
    slots: HashMap<String, Slot>,
    scopes: HashMap<String, ScopeUse>,
    by_entries: Ranking<usize>,
    by_bytes: Ranking<u64>,
    tick: u64,
    bytes: u64,
}

impl MemoryStore {
    pub fn new(limits: Limits) -> MemoryStore {
        MemoryStore {
            limits,
            slots: HashMap::new(),
            scopes: HashMap::new(),
            by_entries: BTreeSet::new(),
            by_bytes: BTreeSet::new(),
            tick: 0,
            bytes: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Scopes holding at least one entry.
    pub fn scopes(&self) -> usize {
        self.scopes.len()
    }

    /// Entries and bytes `scope` holds.
    pub fn scope_use(&self, scope: &str) -> (usize, u64) {
        self.scopes
            .get(scope)
            .map_or((0, 0), |u| (u.entries, u.bytes))
    }

    fn next_tick(&mut self) -> u64 {
        self.tick = self.tick.wrapping_add(1);
        self.tick
    }

    /// Changes `scope`'s use through `change`, keeping the rankings.
    fn with_scope(&mut self, scope: &str, change: impl FnOnce(&mut ScopeUse)) {
        let u = self.scopes.entry(scope.to_string()).or_default();
        let old = Reverse(u.oldest());
        self.by_entries.remove(&(u.entries, old, scope.to_string()));
        self.by_bytes.remove(&(u.bytes, old, scope.to_string()));
        change(u);
        if u.entries == 0 {
            self.scopes.remove(scope);
            return;
        }
        let old = Reverse(u.oldest());
        self.by_entries.insert((u.entries, old, scope.to_string()));
        self.by_bytes.insert((u.bytes, old, scope.to_string()));
    }

    fn remove(&mut self, key: &str) -> Option<Slot> {
        let slot = self.slots.remove(key)?;
        self.bytes = self.bytes.saturating_sub(slot.bytes);
        let (tick, bytes) = (slot.tick, slot.bytes);
        self.with_scope(&slot.scope, |u| {
            u.entries = u.entries.saturating_sub(1);
            u.bytes = u.bytes.saturating_sub(bytes);
            u.lru.remove(&tick);
        });
        Some(slot)
    }

    /// The live entry under `key`, marked used; an expired one is removed.
    pub fn get(&mut self, key: &str, now_ms: u64, removed: &mut Removed) -> Option<Arc<Stored>> {
        let expired = self.slots.get(key)?.stored.expires_at_ms <= now_ms;
        if expired {
            if let Some(s) = self.remove(key) {
                removed
                    .expired
                    .push((key.to_string(), s.stored.model.clone()));
            }
            return None;
        }
        let tick = self.next_tick();
        let slot = self.slots.get_mut(key)?;
        let old = std::mem::replace(&mut slot.tick, tick);
        let (stored, scope) = (slot.stored.clone(), slot.scope.clone());
        self.with_scope(&scope, |u| {
            u.lru.remove(&old);
            u.lru.insert(tick, key.to_string());
        });
        Some(stored)
    }

    /// Stores (replacing any entry under `key`), then evicts until both
    /// bounds hold (see the module's rule). An entry larger than
    /// `max_bytes` alone is not stored (`false`).
    pub fn put(&mut self, key: String, stored: Arc<Stored>, removed: &mut Removed) -> bool {
        let bytes = stored.bytes(&key);
        if bytes > self.limits.max_bytes || self.limits.max_entries == 0 {
            return false;
        }
        self.remove(&key);
        let tick = self.next_tick();
        let scope = stored.scope.clone().unwrap_or_default();
        self.bytes = self.bytes.saturating_add(bytes);
        self.with_scope(&scope, |u| {
            u.entries += 1;
            u.bytes = u.bytes.saturating_add(bytes);
            u.lru.insert(tick, key.clone());
        });
        self.slots.insert(
            key.clone(),
            Slot {
                stored,
                scope: scope.clone(),
                bytes,
                tick,
            },
        );
        while self.slots.len() > self.limits.max_entries {
            let Some(victim) = self.victim(&scope, &key, true) else {
                return self.refuse(&key);
            };
            self.evict(&victim, removed);
        }
        while self.bytes > self.limits.max_bytes {
            let Some(victim) = self.victim(&scope, &key, false) else {
                return self.refuse(&key);
            };
            self.evict(&victim, removed);
        }
        true
    }

    /// The floor in bytes: the same share of `max_bytes` as `scope_floor`
    /// is of `max_entries`.
    fn floor_bytes(&self) -> u64 {
        let (f, n) = (
            self.limits.scope_floor as u64,
            self.limits.max_entries as u64,
        );
        u64::try_from(u128::from(self.limits.max_bytes) * u128::from(f) / u128::from(n.max(1)))
            .unwrap_or(u64::MAX)
    }

    /// Takes back the entry just stored: no scope may give way for it.
    fn refuse(&mut self, key: &str) -> bool {
        self.remove(key);
        false
    }

    /// The scope to lose an entry: the largest (by entries or by bytes)
    /// of those holding more than the floor, else the storing scope itself
    /// (when it holds more than the entry being stored), else none. The
    /// entry being stored is never the one evicted.
    fn victim(&self, storing: &str, key: &str, by_entries: bool) -> Option<String> {
        let floor = self.limits.scope_floor;
        let floor_bytes = self.floor_bytes();
        // Never the entry being stored: a scope whose only entry it is
        // is passed over.
        let over = |scope: &str| {
            self.scopes.get(scope).is_some_and(|u| {
                let only_new = scope == storing && u.lru.values().all(|k| k == key);
                !only_new
                    && if by_entries {
                        u.entries > floor
                    } else {
                        u.bytes > floor_bytes
                    }
            })
        };
        let largest = if by_entries {
            self.by_entries
                .iter()
                .rev()
                .map(|(_, _, s)| s)
                .find(|s| over(s))
        } else {
            self.by_bytes
                .iter()
                .rev()
                .map(|(_, _, s)| s)
                .find(|s| over(s))
        };
        if let Some(s) = largest {
            return Some(s.clone());
        }
        // Every scope within the floor: the storing one makes room from
        // its own older entries, or the answer is not kept.
        let own = self
            .scopes
            .get(storing)
            .is_some_and(|u| u.lru.values().any(|k| k != key));
        own.then(|| storing.to_string())
    }

    /// Evicts `scope`'s least recently used entry.
    fn evict(&mut self, scope: &str, removed: &mut Removed) {
        let Some(oldest) = self
            .scopes
            .get(scope)
            .and_then(|u| u.lru.values().next().cloned())
        else {
            return;
        };
        if let Some(slot) = self.remove(&oldest) {
            removed.evicted.push((oldest, slot.stored.model.clone()));
        }
    }

    /// Removes every entry past its expiry (into `removed.expired`).
    pub fn sweep(&mut self, now_ms: u64, removed: &mut Removed) {
        let gone: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| s.stored.expires_at_ms <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            if let Some(s) = self.remove(&k) {
                removed.expired.push((k, s.stored.model.clone()));
            }
        }
    }

    /// Removes every entry `which` selects; their keys.
    pub fn purge(&mut self, which: impl Fn(&Stored) -> bool) -> Vec<String> {
        let keys: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| which(&s.stored))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            self.remove(k);
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_wire::cache::Entry;

    fn stored(model: &str, body_len: usize, ttl_ms: u64) -> Arc<Stored> {
        Arc::new(Stored {
            model: model.into(),
            entry: Entry {
                body: "x".repeat(body_len),
                prompt_tokens: 1,
                completion_tokens: 1,
                spend_micros: 0,
            },
            stored_at_ms: 0,
            expires_at_ms: ttl_ms,
            context: None,
            vector: None,
            scope: None,
        })
    }

    fn keys(r: &[(String, String)]) -> Vec<&str> {
        r.iter().map(|(k, _)| k.as_str()).collect()
    }

    #[test]
    fn lru_by_count() {
        let mut s = MemoryStore::new(Limits {
            max_entries: 2,
            max_bytes: 1 << 20,
            scope_floor: 4,
        });
        let mut r = Removed::default();
        assert!(s.put("a".into(), stored("m", 10, 1000), &mut r));
        assert!(s.put("b".into(), stored("m", 10, 1000), &mut r));
        // a is used, so b is the least recently used when c comes.
        assert!(s.get("a", 0, &mut r).is_some());
        assert!(s.put("c".into(), stored("m", 10, 1000), &mut r));
        assert_eq!(keys(&r.evicted), ["b"]);
        assert!(s.get("b", 0, &mut r).is_none());
        assert!(s.get("a", 0, &mut r).is_some() && s.get("c", 0, &mut r).is_some());
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn bytes_bound_holds() {
        let one = stored("m", 1000, 1000).bytes("k000");
        let mut s = MemoryStore::new(Limits {
            max_entries: 1000,
            max_bytes: one * 3,
            scope_floor: 4,
        });
        let mut r = Removed::default();
        for i in 0..50 {
            assert!(s.put(format!("k{i:03}"), stored("m", 1000, 1000), &mut r));
            assert!(s.bytes() <= one * 3);
        }
        assert_eq!(s.len(), 3);
        assert_eq!(r.evicted.len(), 47);
        // Too large alone: refused, nothing evicted for it.
        let n = r.evicted.len();
        assert!(!s.put("big".into(), stored("m", 10_000, 1000), &mut r));
        assert_eq!(r.evicted.len(), n);
        // Replacing a key does not double count.
        assert!(s.put("k049".into(), stored("m", 1000, 1000), &mut r));
        assert_eq!(s.bytes(), one * 3);
    }

    fn scoped(scope: &str, body_len: usize) -> Arc<Stored> {
        let mut s = (*stored("m", body_len, 1000)).clone();
        s.scope = Some(scope.into());
        Arc::new(s)
    }

    #[test]
    fn the_entry_being_stored_is_never_the_one_evicted() {
        // No floor, every scope holding one entry: a new scope's store
        // evicts the least recently used other scope's, never its own.
        let mut s = MemoryStore::new(Limits {
            max_entries: 3,
            max_bytes: 1 << 20,
            scope_floor: 0,
        });
        let mut r = Removed::default();
        for (k, scope) in [("a", "s1"), ("b", "s2"), ("c", "s3"), ("d", "s4")] {
            assert!(s.put(k.into(), scoped(scope, 10), &mut r));
            assert!(s.get(k, 0, &mut r).is_some(), "{k} kept");
        }
        assert_eq!(keys(&r.evicted), ["a"]);
        // A larger answer than any other, bytes bound: others give way.
        let one = scoped("s", 100).bytes("k");
        let mut s = MemoryStore::new(Limits {
            max_entries: 100,
            max_bytes: one * 4,
            scope_floor: 0,
        });
        for (k, scope) in [("a", "s1"), ("b", "s2"), ("c", "s3")] {
            assert!(s.put(k.into(), scoped(scope, 100), &mut r));
        }
        assert!(s.put("big".into(), scoped("s4", 250), &mut r));
        assert!(s.get("big", 0, &mut r).is_some());
        assert!(s.bytes() <= one * 4);
        assert_eq!(s.scope_use("s4").0, 1);
    }

    #[test]
    fn ttl_expires() {
        let mut s = MemoryStore::new(Limits {
            max_entries: 10,
            max_bytes: 1 << 20,
            scope_floor: 4,
        });
        let mut r = Removed::default();
        s.put("a".into(), stored("m", 1, 500), &mut r);
        assert!(s.get("a", 499, &mut r).is_some());
        assert!(s.get("a", 500, &mut r).is_none());
        assert_eq!(keys(&r.expired), ["a"]);
        assert!(s.is_empty());
        assert_eq!(s.bytes(), 0);
    }

    #[test]
    fn purge_by_model() {
        let mut s = MemoryStore::new(Limits {
            max_entries: 10,
            max_bytes: 1 << 20,
            scope_floor: 4,
        });
        let mut r = Removed::default();
        s.put("a".into(), stored("m1", 1, 500), &mut r);
        s.put("b".into(), stored("m2", 1, 500), &mut r);
        assert_eq!(s.purge(|e| e.model == "m1"), ["a"]);
        assert_eq!(s.len(), 1);
    }
}
