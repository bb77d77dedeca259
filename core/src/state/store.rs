//! The one piece of host state the policy core touches: Envoy's shared data,
//! a process-wide map with compare-and-swap, seen alike by every worker.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StoreError {
    /// Another writer changed the key since it was read.
    #[error("compare-and-swap mismatch")]
    CasMismatch,
    #[error("shared data: {0}")]
    Host(String),
}

pub trait SharedStore {
    /// The value and its CAS token, `None` when the key does not exist.
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes when `cas` still matches the key's token. As in Envoy, a key
    /// that does not exist yet is written whatever `cas` says, so keys are
    /// created up front (see `reservation::prepare`), never on the hot path.
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError>;
}

/// How often compare-and-swap lost, for `sluice_cas_retries_total` and
/// `sluice_cas_exhausted_total`. Summed over every update of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Contention {
    /// Writes lost to another worker and tried again.
    pub cas_retries: u32,
    /// Updates that lost every attempt (each counted once).
    pub cas_exhausted: u32,
}

impl Contention {
    pub fn add(&mut self, other: Contention) {
        self.cas_retries = self.cas_retries.saturating_add(other.cas_retries);
        self.cas_exhausted = self.cas_exhausted.saturating_add(other.cas_exhausted);
    }
}

/// One attempt of a compare-and-swap loop.
pub enum Attempt<T> {
    /// Finished (written, or nothing to write).
    Done(T),
    /// Another writer changed the key since it was read: read again.
    Lost,
}

/// How an [`update`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Updated {
    Written,
    /// `f` left the value as it is (nothing to change, or not ours).
    Unchanged,
    /// Every attempt lost a race; counted in `cas_exhausted`.
    Exhausted,
    /// The host refused the write.
    Failed,
}

/// The one compare-and-swap loop: runs `attempt` until it is done, at most
/// `max_tries` times (at least once), counting each lost race and the
/// exhaustion in `contention`. `None`: exhausted. Every lost race means
/// another writer made progress, so exhaustion needs a storm on one key;
/// what the caller does then is its own documented decision.
pub fn retry<T>(
    max_tries: u32,
    contention: &mut Contention,
    mut attempt: impl FnMut() -> Attempt<T>,
) -> Option<T> {
    for _ in 0..max_tries.max(1) {
        match attempt() {
            Attempt::Done(value) => return Some(value),
            Attempt::Lost => contention.cas_retries = contention.cas_retries.saturating_add(1),
        }
    }
    contention.cas_exhausted = contention.cas_exhausted.saturating_add(1);
    None
}

/// Read-modify-write of one key: `f` gets the current value (`None`: the
/// key does not exist) and returns the next one, or `None` to leave it.
/// Written with the token read, re-read and retried when another writer
/// came first (see [`retry`]). A missing key is written unconditionally,
/// as Envoy does.
pub fn update(
    store: &dyn SharedStore,
    key: &str,
    max_tries: u32,
    contention: &mut Contention,
    mut f: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>,
) -> Updated {
    retry(max_tries, contention, || {
        let current = store.get(key);
        let Some(next) = f(current.as_ref().map(|(bytes, _)| bytes.as_slice())) else {
            return Attempt::Done(Updated::Unchanged);
        };
        match store.set(key, &next, current.map_or(0, |(_, cas)| cas)) {
            Ok(()) => Attempt::Done(Updated::Written),
            Err(StoreError::CasMismatch) => Attempt::Lost,
            Err(StoreError::Host(_)) => Attempt::Done(Updated::Failed),
        }
    })
    .unwrap_or(Updated::Exhausted)
}

/// A settlement or a give-back gets this many times the attempts of a take:
/// the usage it records already happened (giving up would under-charge),
/// the units it returns would otherwise be held until they drain.
pub const SETTLE_TRIES_FACTOR: u32 = 8;

/// The compare-and-swap bound of a loaded policy (`state.cas_max_retries`,
/// at least 1 by its check): read from the policy in one place,
/// `Engine::tries`, and handed down as this value to every update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tries(u32);

impl Tries {
    pub const fn new(per_update: u32) -> Tries {
        Tries(per_update)
    }

    /// Attempts of one take or update of a key.
    pub fn take(self) -> u32 {
        self.0
    }

    /// Attempts of a settlement or give-back: [`SETTLE_TRIES_FACTOR`] times
    /// as many.
    pub fn settle(self) -> u32 {
        self.0.saturating_mul(SETTLE_TRIES_FACTOR)
    }
}

/// A store with a retry bound, summing the contention of the updates made
/// through it (for one request, one answer, one tick).
pub struct Cas<'a> {
    pub store: &'a dyn SharedStore,
    pub max_tries: u32,
    pub contention: Contention,
}

impl<'a> Cas<'a> {
    pub fn new(store: &'a dyn SharedStore, max_tries: u32) -> Cas<'a> {
        Cas {
            store,
            max_tries,
            contention: Contention::default(),
        }
    }

    /// [`update`] with this bound, counted here.
    pub fn update(
        &mut self,
        key: &str,
        f: impl FnMut(Option<&[u8]>) -> Option<Vec<u8>>,
    ) -> Updated {
        update(self.store, key, self.max_tries, &mut self.contention, f)
    }
}

/// An in-process store with Envoy's semantics, for native tests and tools,
/// and the native Envoy module's shared data.
#[derive(Default)]
pub struct MemStore {
    inner: std::sync::Mutex<MemInner>,
}

#[derive(Default)]
struct MemInner {
    // Every shared-data read and write of a request goes through this map:
    // hashbrown's foldhash over std's SipHash saved about 1,000 (GET) to
    // 2,000 (full POST) instructions a request on the mock host (the
    // benchmark history's same-run A/B). The keys are the core's record
    // names (policy names and hashed slots, a bounded set no caller
    // chooses), so SipHash's defence against chosen keys buys nothing.
    map: hashbrown::HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl MemStore {
    pub fn len(&self) -> usize {
        self.inner.lock().map(|g| g.map.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl SharedStore for MemStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let guard = self.inner.lock().ok()?;
        guard.map.get(key).cloned()
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let mut guard = self
            .inner
            .lock()
            .map_err(|_| StoreError::Host("poisoned".into()))?;
        guard.next_cas = guard.next_cas.wrapping_add(1).max(1);
        let token = guard.next_cas;
        match guard.map.get_mut(key) {
            Some(entry) if cas != 0 && cas != entry.1 => Err(StoreError::CasMismatch),
            Some(entry) => {
                *entry = (value.to_vec(), token);
                Ok(())
            }
            None => {
                guard.map.insert(key.to_string(), (value.to_vec(), token));
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Loses the first `lose` writes to a phantom writer.
    struct Contended {
        inner: MemStore,
        lose: Cell<u32>,
    }

    impl SharedStore for Contended {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if self.lose.get() > 0 {
                self.lose.set(self.lose.get() - 1);
                return Err(StoreError::CasMismatch);
            }
            self.inner.set(key, value, cas)
        }
    }

    fn bump(current: Option<&[u8]>) -> Option<Vec<u8>> {
        Some(vec![
            current.and_then(|b| b.first().copied()).unwrap_or(0) + 1,
        ])
    }

    #[test]
    fn a_settlement_gets_the_factor_times_the_attempts_of_a_take() {
        let t = Tries::new(3);
        assert_eq!((t.take(), t.settle()), (3, 3 * SETTLE_TRIES_FACTOR));
        assert_eq!(Tries::new(u32::MAX).settle(), u32::MAX, "saturates");
    }

    #[test]
    fn update_retries_lost_races_and_counts_exhaustion() {
        let store = Contended {
            inner: MemStore::default(),
            lose: Cell::new(2),
        };
        let mut c = Contention::default();
        assert_eq!(update(&store, "k", 3, &mut c, bump), Updated::Written);
        assert_eq!(store.get("k").unwrap().0, vec![1]);
        assert_eq!(
            c,
            Contention {
                cas_retries: 2,
                cas_exhausted: 0
            }
        );
        store.lose.set(3);
        assert_eq!(update(&store, "k", 3, &mut c, bump), Updated::Exhausted);
        assert_eq!(store.get("k").unwrap().0, vec![1], "nothing half-written");
        assert_eq!(
            c,
            Contention {
                cas_retries: 5,
                cas_exhausted: 1
            }
        );
        assert_eq!(update(&store, "k", 3, &mut c, |_| None), Updated::Unchanged);
        // A bound of 0 still tries once.
        assert_eq!(update(&store, "k", 0, &mut c, bump), Updated::Written);
    }
}
