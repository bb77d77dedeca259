//! Recently embedded texts, so the store after a miss does not embed the
//! same question again. Keyed by the SHA-256 of the text (never the text:
//! a text can be as long as the embedder takes), bounded by entries and
//! by bytes; cleared when either bound would be passed.

use std::collections::HashMap;

/// Entries kept at most.
pub const RECENT_ENTRIES: usize = 1024;
/// Bytes of vectors and keys kept at most (1024 vectors of 1024 dims).
pub const RECENT_BYTES: usize = 4 << 20;

/// What one entry costs: its key (64 hex digits) and its vector.
fn cost(v: &[f32]) -> usize {
    64usize.saturating_add(v.len().saturating_mul(4))
}

pub struct Recent {
    map: HashMap<String, Vec<f32>>,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
}

impl Default for Recent {
    fn default() -> Self {
        Recent::new(RECENT_ENTRIES, RECENT_BYTES)
    }
}

impl Recent {
    pub fn new(max_entries: usize, max_bytes: usize) -> Recent {
        Recent {
            map: HashMap::new(),
            bytes: 0,
            max_entries,
            max_bytes,
        }
    }

    fn key(text: &str) -> String {
        use sha2::Digest;
        format!("{:x}", sha2::Sha256::digest(text.as_bytes()))
    }

    pub fn get(&self, text: &str) -> Option<Vec<f32>> {
        self.map.get(&Self::key(text)).cloned()
    }

    /// Remembers `text`'s vector; one larger than the whole bound is not kept.
    pub fn put(&mut self, text: &str, v: Vec<f32>) {
        let c = cost(&v);
        if c > self.max_bytes || self.max_entries == 0 {
            return;
        }
        if self.map.len() >= self.max_entries || self.bytes.saturating_add(c) > self.max_bytes {
            self.map.clear();
            self.bytes = 0;
        }
        if let Some(old) = self.map.insert(Self::key(text), v) {
            self.bytes = self.bytes.saturating_sub(cost(&old));
        }
        self.bytes = self.bytes.saturating_add(c);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes held: keys and vectors, counted as they are in memory.
    pub fn bytes(&self) -> usize {
        self.map
            .iter()
            .map(|(k, v)| k.len().saturating_add(v.len().saturating_mul(4)))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_by_hash_not_text() {
        let mut r = Recent::default();
        let long = "x".repeat(30 << 10);
        for i in 0..64 {
            r.put(&format!("{long}{i}"), vec![1.0; 384]);
        }
        assert_eq!(r.len(), 64);
        // 64 × (64 + 1536): no text is held.
        assert!(r.bytes() <= 64 * (64 + 384 * 4), "{}", r.bytes());
        assert!(r.get(&format!("{long}7")).is_some());
        assert!(r.get(&long).is_none());
    }

    #[test]
    fn bounded_by_bytes_and_entries() {
        let mut r = Recent::new(1000, 10_000);
        for i in 0..100 {
            r.put(&format!("t{i}"), vec![0.5; 1000]);
            assert!(r.bytes() <= 10_000, "{}", r.bytes());
        }
        assert!(r.get("t99").is_some());
        // One vector over the whole bound is not kept.
        r.put("huge", vec![0.5; 3000]);
        assert!(r.get("huge").is_none());
        let mut r = Recent::new(3, 1 << 20);
        for i in 0..10 {
            r.put(&format!("t{i}"), vec![1.0]);
            assert!(r.len() <= 3);
        }
        // The same text again replaces, never double counts.
        let mut r = Recent::new(10, 10_000);
        for _ in 0..100 {
            r.put("same", vec![0.5; 1000]);
        }
        assert_eq!((r.len(), r.bytes), (1, 64 + 4000));
    }
}
