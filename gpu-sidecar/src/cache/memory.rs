//! The in-memory store: entries by key, bounded by count and bytes, least
//! recently used evicted first, each with its own expiry. Time is given
//! (`now_ms`), never read here. One mutex around it (lookups and stores
//! are O(1) here; the semantic search is in [`super::semantic`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub use super::entry::Limits;
use super::entry::Stored;

struct Slot {
    stored: Arc<Stored>,
    bytes: u64,
    tick: u64,
}

/// What a `put` or `get` removed, so the semantic index forgets it too.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// Pushed out by the bounds.
    pub evicted: Vec<(String, String)>,
    /// Found past their expiry.
    pub expired: Vec<(String, String)>,
}

pub struct MemoryStore {
    limits: Limits,
    slots: HashMap<String, Slot>,
    /// Use order: tick → key; the first is the least recently used.
    lru: BTreeMap<u64, String>,
    tick: u64,
    bytes: u64,
}

impl MemoryStore {
    pub fn new(limits: Limits) -> MemoryStore {
        MemoryStore {
            limits,
            slots: HashMap::new(),
            lru: BTreeMap::new(),
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

    fn next_tick(&mut self) -> u64 {
        self.tick = self.tick.wrapping_add(1);
        self.tick
    }

    fn remove(&mut self, key: &str) -> Option<Slot> {
        let slot = self.slots.remove(key)?;
        self.lru.remove(&slot.tick);
        self.bytes = self.bytes.saturating_sub(slot.bytes);
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
        let stored = slot.stored.clone();
        self.lru.remove(&old);
        self.lru.insert(tick, key.to_string());
        Some(stored)
    }

    /// Stores (replacing any entry under `key`), then evicts least
    /// recently used entries until both bounds hold. An entry larger than
    /// `max_bytes` alone is not stored (`false`).
    pub fn put(&mut self, key: String, stored: Arc<Stored>, removed: &mut Removed) -> bool {
        let bytes = stored.bytes(&key);
        if bytes > self.limits.max_bytes || self.limits.max_entries == 0 {
            return false;
        }
        self.remove(&key);
        let tick = self.next_tick();
        self.lru.insert(tick, key.clone());
        self.bytes = self.bytes.saturating_add(bytes);
        self.slots.insert(
            key.clone(),
            Slot {
                stored,
                bytes,
                tick,
            },
        );
        while self.slots.len() > self.limits.max_entries || self.bytes > self.limits.max_bytes {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            if let Some(slot) = self.slots.remove(&oldest) {
                self.bytes = self.bytes.saturating_sub(slot.bytes);
                removed.evicted.push((oldest, slot.stored.model.clone()));
            }
        }
        true
    }

    /// Removes every entry `which` selects; how many.
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

    #[test]
    fn ttl_expires() {
        let mut s = MemoryStore::new(Limits {
            max_entries: 10,
            max_bytes: 1 << 20,
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
        });
        let mut r = Removed::default();
        s.put("a".into(), stored("m1", 1, 500), &mut r);
        s.put("b".into(), stored("m2", 1, 500), &mut r);
        assert_eq!(s.purge(|e| e.model == "m1"), ["a"]);
        assert_eq!(s.len(), 1);
    }
}
