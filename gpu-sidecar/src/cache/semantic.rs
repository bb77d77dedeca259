//! The semantic index and the embeddings client.
//!
//! The index holds, per context hash (scope, model, output parameters and
//! the conversation before the last user message, salted by the filter),
//! the embeddings of the last user messages stored under it. A search
//! looks only inside the request's own context, so a semantic hit can
//! never cross a scope or a conversation: similarity decides only among
//! entries that already agree on everything else. Exact cosine search
//! (vectors are L2-normalised: a dot product): the cost is linear in the
//! partition's size (figure in BENCHMARKS.md, "Cache"), and the whole
//! index is bounded by `max_entries` vectors, oldest first out.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use serde::Deserialize;

pub use crate::config::cache::EmbeddingsConfig;

use crate::http::{self, Target};

/// One context's vectors, side by side in one allocation (a search reads
/// them in order: no hashing, no pointer chasing per candidate).
#[derive(Default)]
struct Partition {
    dims: usize,
    keys: Vec<String>,
    expires: Vec<u64>,
    flat: Vec<f32>,
}

impl Partition {
    fn swap_remove(&mut self, at: usize) -> Option<String> {
        let last = self.keys.len().checked_sub(1)?;
        self.keys.swap(at, last);
        self.expires.swap(at, last);
        if at != last {
            let (head, tail) = self.flat.split_at_mut(last * self.dims);
            head[at * self.dims..(at + 1) * self.dims].copy_from_slice(&tail[..self.dims]);
        }
        self.keys.pop();
        self.expires.pop();
        self.flat.truncate(last * self.dims);
        // The key now at `at` (moved from the end), if any.
        self.keys.get(at).cloned()
    }
}

/// Bounded: at most `max` vectors; the oldest learned goes first.
pub struct Index {
    max: usize,
    /// key → (context, position in its partition).
    by_key: HashMap<String, (String, usize)>,
    partitions: HashMap<String, Partition>,
    order: VecDeque<String>,
}

/// A candidate: the entry's key and its similarity.
#[derive(Debug, Clone, PartialEq)]
pub struct Near {
    pub key: String,
    pub similarity: f32,
}

pub fn normalise(mut v: Vec<f32>) -> Option<Vec<f32>> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if !norm.is_finite() || norm == 0.0 {
        return None;
    }
    for x in &mut v {
        *x /= norm;
    }
    Some(v)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Chunks of 8 independent sums: the compiler turns this into SIMD.
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

impl Index {
    pub fn new(max: usize) -> Index {
        Index {
            max,
            by_key: HashMap::new(),
            partitions: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn contains(&self, key: &str) -> bool {
        self.by_key.contains_key(key)
    }

    /// Bytes the vectors and their keys take (for the `bytes` gauge).
    pub fn bytes(&self) -> u64 {
        let parts: usize = self
            .partitions
            .iter()
            .map(|(c, p)| {
                c.len() + p.flat.len() * 4 + p.keys.iter().map(|k| k.len() + 32).sum::<usize>()
            })
            .sum();
        (parts + self.by_key.len() * 96) as u64
    }

    /// Learns (or replaces) `key`'s vector; a vector of another dimension
    /// than its partition's is refused (its cosine would mean nothing).
    pub fn insert(
        &mut self,
        key: String,
        context: String,
        v: Vec<f32>,
        expires_at_ms: u64,
    ) -> bool {
        if self.max == 0 || v.is_empty() {
            return false;
        }
        self.remove(&key);
        if self
            .partitions
            .get(&context)
            .is_some_and(|p| !p.keys.is_empty() && p.dims != v.len())
        {
            return false;
        }
        while self.by_key.len() >= self.max {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.remove(&old);
        }
        let p = self.partitions.entry(context.clone()).or_default();
        p.dims = v.len();
        let at = p.keys.len();
        p.keys.push(key.clone());
        p.expires.push(expires_at_ms);
        p.flat.extend_from_slice(&v);
        self.order.push_back(key.clone());
        self.by_key.insert(key, (context, at));
        true
    }

    pub fn remove(&mut self, key: &str) {
        let Some((context, at)) = self.by_key.remove(key) else {
            return;
        };
        if let Some(p) = self.partitions.get_mut(&context) {
            if let Some(moved) = p.swap_remove(at) {
                if let Some(slot) = self.by_key.get_mut(&moved) {
                    slot.1 = at;
                }
            }
            if p.keys.is_empty() {
                self.partitions.remove(&context);
            }
        }
        // `order` keeps the key until it reaches the front; it is skipped
        // there (removing from the middle would be linear every time).
        if self.order.len() > self.max.saturating_mul(2).max(16) {
            let live = &self.by_key;
            self.order.retain(|k| live.contains_key(k));
        }
    }

    pub fn clear(&mut self) {
        self.by_key.clear();
        self.partitions.clear();
        self.order.clear();
    }

    /// The `top_k` nearest live vectors of `context` with similarity at
    /// least `threshold`, best first.
    pub fn search(
        &self,
        context: &str,
        query: &[f32],
        threshold: f32,
        top_k: usize,
        now_ms: u64,
    ) -> Vec<Near> {
        let Some(p) = self.partitions.get(context) else {
            return Vec::new();
        };
        if p.dims != query.len() || top_k == 0 {
            return Vec::new();
        }
        let mut best: Vec<(usize, f32)> = Vec::with_capacity(top_k + 1);
        for (i, v) in p.flat.chunks_exact(p.dims).enumerate() {
            let s = dot(v, query);
            if s < threshold || (best.len() == top_k && best.last().is_some_and(|b| b.1 >= s)) {
                continue;
            }
            if p.expires.get(i).is_none_or(|&x| x <= now_ms) {
                continue;
            }
            let at = best.partition_point(|b| b.1 >= s);
            best.insert(at, (i, s));
            best.truncate(top_k);
        }
        best.into_iter()
            .filter_map(|(i, s)| {
                Some(Near {
                    key: p.keys.get(i)?.clone(),
                    similarity: s,
                })
            })
            .collect()
    }
}

#[derive(Deserialize)]
struct EmbeddingsAnswer {
    data: Vec<EmbeddingItem>,
}

#[derive(Deserialize)]
struct EmbeddingItem {
    embedding: Vec<f32>,
}

/// Longest text embedded (bytes). A longer last user message gets no
/// semantic lookup or store, only its exact key: cutting it would make two
/// long messages that share their first `MAX_TEXT_BYTES` embed the same.
pub const MAX_TEXT_BYTES: usize = 32 << 10;

/// Whether `text` is short enough to be embedded whole.
pub fn embeddable(text: &str) -> bool {
    text.len() <= MAX_TEXT_BYTES
}

pub struct Embedder {
    target: Target,
    model: String,
    timeout: Duration,
    key: Option<String>,
}

impl Embedder {
    pub fn new(c: &EmbeddingsConfig) -> Result<Embedder, String> {
        let target = Target::parse(&c.url).map_err(|e| format!("cache.embeddings.url: {e}"))?;
        let key = match &c.api_key_env {
            Some(name) => Some(std::env::var(name).map_err(|_| {
                format!("cache.embeddings.api_key_env: the environment variable {name} is not set")
            })?),
            None => None,
        };
        Ok(Embedder {
            target,
            model: c.model.clone(),
            timeout: c.timeout,
            key,
        })
    }

    /// The normalised embedding of `text`; any failure is an error (the
    /// caller counts it and treats it as a miss).
    pub async fn embed(&self, text: &str) -> Result<Vec<f32>, String> {
        if !embeddable(text) {
            return Err(format!("text over {MAX_TEXT_BYTES} bytes"));
        }
        let body = serde_json::json!({"model": self.model, "input": text});
        let auth = self.key.as_ref().map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = auth
            .as_deref()
            .map(|a| vec![("authorization", a)])
            .unwrap_or_default();
        let (status, bytes) = http::request(
            &self.target,
            http::Method::POST,
            &headers,
            Some(body.to_string().into_bytes()),
            self.timeout,
        )
        .await
        .map_err(|e| e.to_string())?;
        if status != 200 {
            return Err(format!("status {status}"));
        }
        let a: EmbeddingsAnswer =
            serde_json::from_slice(&bytes).map_err(|e| format!("not an embeddings answer: {e}"))?;
        let v = a
            .data
            .into_iter()
            .next()
            .ok_or("no embedding in the answer")?
            .embedding;
        normalise(v).ok_or_else(|| "a zero or non-finite embedding".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(v: &[f32]) -> Vec<f32> {
        normalise(v.to_vec()).unwrap()
    }

    #[test]
    fn search_stays_in_its_context() {
        let mut i = Index::new(100);
        i.insert("a".into(), "ctx1".into(), unit(&[1.0, 0.0]), 1000);
        i.insert("b".into(), "ctx2".into(), unit(&[1.0, 0.0]), 1000);
        i.insert("c".into(), "ctx1".into(), unit(&[0.0, 1.0]), 1000);
        let q = unit(&[1.0, 0.1]);
        let found = i.search("ctx1", &q, 0.9, 5, 0);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].key, "a");
        assert!(i.search("ctx3", &q, 0.0, 5, 0).is_empty());
        // Expired vectors are not found; other dimensions neither.
        assert!(i.search("ctx1", &q, 0.9, 5, 1000).is_empty());
        assert!(i.search("ctx1", &[1.0, 0.0, 0.0], 0.0, 5, 0).is_empty());
        assert!(!i.insert("d".into(), "ctx1".into(), unit(&[1.0, 0.0, 0.0]), 1000));
    }

    #[test]
    fn top_k_best_first() {
        let mut i = Index::new(100);
        for n in 0..10 {
            let x = n as f32 / 10.0;
            i.insert(format!("k{n}"), "c".into(), unit(&[1.0, x]), 1000);
        }
        let found = i.search("c", &unit(&[1.0, 0.0]), 0.0, 3, 0);
        let keys: Vec<_> = found.iter().map(|n| n.key.as_str()).collect();
        assert_eq!(keys, ["k0", "k1", "k2"]);
        assert!(found[0].similarity >= found[1].similarity);
    }

    #[test]
    fn bounded_oldest_first() {
        let mut i = Index::new(3);
        for n in 0..10 {
            i.insert(format!("k{n}"), "c".into(), unit(&[1.0, 0.0]), 1000);
        }
        assert_eq!(i.len(), 3);
        assert!(i.contains("k9") && !i.contains("k6"));
        for n in 0..1000 {
            i.insert(format!("x{n}"), format!("c{n}"), unit(&[1.0]), 1000);
            i.remove(&format!("x{n}"));
        }
        assert!(i.order.len() <= 16);
    }

    #[test]
    fn removal_keeps_the_others_findable() {
        let mut i = Index::new(100);
        for n in 0..5 {
            let x = n as f32;
            i.insert(format!("k{n}"), "c".into(), unit(&[1.0, x]), 1000);
        }
        i.remove("k1");
        i.remove("k0");
        for n in 2..5 {
            let x = n as f32;
            let found = i.search("c", &unit(&[1.0, x]), 0.9999, 1, 0);
            assert_eq!(found[0].key, format!("k{n}"));
        }
        assert_eq!(i.len(), 3);
        for n in 2..5 {
            i.remove(&format!("k{n}"));
        }
        assert!(i.is_empty() && i.partitions.is_empty());
    }

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..389).map(|i| (i as f32).sin()).collect();
        let b: Vec<f32> = (0..389).map(|i| (i as f32).cos()).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-3);
    }

    #[tokio::test]
    async fn embeds_through_mock_llm() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = mock_llm::app(mock_llm::Config::default()).unwrap();
        tokio::spawn(mock_llm::serve(listener, app, std::future::pending()));
        let e = Embedder::new(&EmbeddingsConfig {
            url: format!("http://{addr}/v1/embeddings"),
            model: "mock-embed".into(),
            timeout: Duration::from_secs(5),
            api_key_env: None,
        })
        .unwrap();
        let a = e.embed("How do I enable 2FA on my account?").await.unwrap();
        let b = e.embed("how do I enable 2FA on my account").await.unwrap();
        let c = e
            .embed("How do I disable 2FA on my account?")
            .await
            .unwrap();
        assert_eq!(a.len(), 384);
        assert!(dot(&a, &b) > 0.95);
        assert!(dot(&a, &c) < 0.95);
        let down = Embedder::new(&EmbeddingsConfig {
            url: "http://127.0.0.1:1/v1/embeddings".into(),
            model: "m".into(),
            timeout: Duration::from_millis(500),
            api_key_env: None,
        })
        .unwrap();
        assert!(down.embed("x").await.is_err());
    }
}
