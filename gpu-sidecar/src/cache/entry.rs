//! What the stores keep: an entry ([`Stored`]), what it costs against the
//! byte bound, and the bounds themselves. A leaf: the stores, the index
//! and the counters import it, it imports none of them.

use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};
use sluice_wire::cache::Entry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_entries: usize,
    pub max_bytes: u64,
    /// Entries per scope that other scopes' stores never evict (memory).
    pub scope_floor: usize,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An entry as kept: the answer, who it is for (only the model, for
/// purges and metrics; the scope is in the key), when, and its vector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    pub model: String,
    pub entry: Entry,
    pub stored_at_ms: u64,
    pub expires_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vector: Option<Vec<f32>>,
    /// The filter's scope id (hex SHA-256 of the scope value, e.g. of
    /// `team:blue`), for the bounds per scope and purges by scope; never
    /// part of matching (the scope is in the key already).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
}

/// Per entry beyond what it holds (map slots, the use orders, global and
/// per scope, each with a copy of the key; counters).
const OVERHEAD: u64 = 256;

impl Stored {
    /// What it costs to keep, for the byte bound.
    pub fn bytes(&self, key: &str) -> u64 {
        let vector = self.vector.as_ref().map_or(0, |v| v.len() * 4);
        let n = key.len()
            + self.model.len()
            + self.entry.body.len()
            + self.context.as_ref().map_or(0, String::len)
            + self.scope.as_ref().map_or(0, String::len)
            + vector;
        (n as u64).saturating_add(OVERHEAD)
    }
}
