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

/// An in-process store with Envoy's semantics, for native tests and tools.
#[derive(Default)]
pub struct MemStore {
    inner: std::sync::Mutex<MemInner>,
}

#[derive(Default)]
struct MemInner {
    map: std::collections::HashMap<String, (Vec<u8>, u32)>,
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
