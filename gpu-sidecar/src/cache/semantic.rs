//! The semantic index and the embeddings client.
//!
//! The index holds, per context hash (scope, model, output parameters and
//! the conversation before the last user message, salted by the filter),
//! the embeddings of the last user messages stored under it. A search
//! looks only inside the request's own context, so a semantic hit can
//! never cross a scope or a conversation: similarity decides only among
//! entries that already agree on everything else.
//!
//! Search: vectors are L2-normalised (cosine is a dot product). A context
//! of at most [`EXACT_UP_TO`] vectors is searched exactly (every f32
//! vector read). A larger one is searched in two steps: each vector's
//! sign bits (one bit a dimension, 48 bytes at 384 dimensions, kept beside
//! it) are compared with the query's by Hamming distance, the
//! [`RESCORE`] (at least 16 × `top_k`) nearest by that measure are then
//! scored exactly in f32, and only an exact similarity ≥ the threshold is
//! a hit. The sign bits only choose which vectors are scored: a hit's
//! similarity is always the exact one, so the prefilter can cost a miss,
//! never a wrong hit. Figures (time, recall against exact search, memory)
//! in docs/src/benchmark-history.md, "The semantic index". The whole
//! index is bounded by `max_vectors`, oldest first out; removed and
//! expired entries leave it.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use serde::Deserialize;

pub use crate::config::cache::EmbeddingsConfig;

use crate::http::{self, Target};

/// Contexts up to this many vectors are searched exactly (no prefilter):
/// at 384 dimensions about 0.8 ms on the machine of
/// docs/src/benchmark-history.md, "The semantic index".
pub const EXACT_UP_TO: usize = 4096;

/// How many candidates the sign-bit prefilter passes to the exact scoring
/// (at least; 16 × `top_k` when that is more).
pub const RESCORE: usize = 256;

/// One context's vectors, side by side in one allocation (a search reads
/// them in order: no hashing, no pointer chasing per candidate), and their
/// sign bits, side by side in another.
#[derive(Default)]
struct Partition {
    dims: usize,
    /// u64 words of sign bits per vector.
    words: usize,
    keys: Vec<String>,
    expires: Vec<u64>,
    flat: Vec<f32>,
    bits: Vec<u64>,
}

fn words_for(dims: usize) -> usize {
    dims.div_ceil(64)
}

/// The sign bits of `v` (bit set: the component is positive), appended.
fn push_signs(out: &mut Vec<u64>, v: &[f32]) {
    for chunk in v.chunks(64) {
        let mut w = 0u64;
        for (i, x) in chunk.iter().enumerate() {
            if *x > 0.0 {
                w |= 1 << i;
            }
        }
        out.push(w);
    }
}

fn hamming(a: &[u64], b: &[u64]) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

impl Partition {
    fn len(&self) -> usize {
        self.keys.len()
    }

    fn swap_remove(&mut self, at: usize) -> Option<String> {
        let last = self.keys.len().checked_sub(1)?;
        self.keys.swap(at, last);
        self.expires.swap(at, last);
        if at != last {
            let (head, tail) = self.flat.split_at_mut(last * self.dims);
            head[at * self.dims..(at + 1) * self.dims].copy_from_slice(&tail[..self.dims]);
            let (head, tail) = self.bits.split_at_mut(last * self.words);
            head[at * self.words..(at + 1) * self.words].copy_from_slice(&tail[..self.words]);
        }
        self.keys.pop();
        self.expires.pop();
        self.flat.truncate(last * self.dims);
        self.bits.truncate(last * self.words);
        // The key now at `at` (moved from the end), if any.
        self.keys.get(at).cloned()
    }

    fn vector(&self, i: usize) -> Option<&[f32]> {
        self.flat.get(i * self.dims..(i + 1) * self.dims)
    }

    /// The positions of the `want` vectors nearest `query` by sign bits
    /// (ties at the cut-off taken in order).
    fn prefilter(&self, query: &[f32], want: usize) -> Vec<usize> {
        let mut q = Vec::with_capacity(self.words);
        push_signs(&mut q, query);
        let distances: Vec<u32> = self
            .bits
            .chunks_exact(self.words.max(1))
            .map(|b| hamming(b, &q))
            .collect();
        // A histogram of the distances finds the cut-off in one pass more.
        let mut histogram = vec![0usize; self.dims + 2];
        for &d in &distances {
            if let Some(h) = histogram.get_mut(d as usize) {
                *h += 1;
            }
        }
        let (mut cut, mut below) = (0usize, 0usize);
        for (d, n) in histogram.iter().enumerate() {
            cut = d;
            if below + n >= want {
                break;
            }
            below += n;
        }
        // All under the cut-off, then those at it until `want`.
        let mut at_cut = want.saturating_sub(below);
        let mut out = Vec::with_capacity(want);
        for (i, &d) in distances.iter().enumerate() {
            let d = d as usize;
            if d < cut {
                out.push(i);
            } else if d == cut && at_cut > 0 {
                at_cut -= 1;
                out.push(i);
            }
        }
        out
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
                c.len()
                    + p.flat.len() * 4
                    + p.bits.len() * 8
                    + p.expires.len() * 8
                    + p.keys.iter().map(|k| k.len() + 24).sum::<usize>()
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
        p.words = words_for(v.len());
        let at = p.keys.len();
        p.keys.push(key.clone());
        p.expires.push(expires_at_ms);
        p.flat.extend_from_slice(&v);
        push_signs(&mut p.bits, &v);
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

    /// Forgets every vector past its expiry; how many.
    pub fn sweep(&mut self, now_ms: u64) -> usize {
        let gone: Vec<String> = self
            .partitions
            .values()
            .flat_map(|p| {
                p.keys
                    .iter()
                    .zip(&p.expires)
                    .filter(|(_, &x)| x <= now_ms)
                    .map(|(k, _)| k.clone())
            })
            .collect();
        for k in &gone {
            self.remove(k);
        }
        gone.len()
    }

    pub fn clear(&mut self) {
        self.by_key.clear();
        self.partitions.clear();
        self.order.clear();
    }

    /// The `top_k` nearest live vectors of `context` with similarity at
    /// least `threshold`, best first: exact below [`EXACT_UP_TO`] vectors,
    /// sign-bit prefilter then exact scoring above.
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
        let want = RESCORE.max(top_k.saturating_mul(16));
        if p.len() <= EXACT_UP_TO.max(want) {
            return best_of(p, 0..p.len(), query, threshold, top_k, now_ms);
        }
        let candidates = p.prefilter(query, want);
        best_of(p, candidates.into_iter(), query, threshold, top_k, now_ms)
    }

    /// Exact search whatever the context's size (the reference the
    /// prefilter's recall is measured against).
    pub fn search_exact(
        &self,
        context: &str,
        query: &[f32],
        threshold: f32,
        top_k: usize,
        now_ms: u64,
    ) -> Vec<Near> {
        match self.partitions.get(context) {
            Some(p) => best_of(p, 0..p.len(), query, threshold, top_k, now_ms),
            None => Vec::new(),
        }
    }
}

/// The `top_k` best of the vectors at `positions` of `p`, scored exactly.
fn best_of(
    p: &Partition,
    positions: impl Iterator<Item = usize>,
    query: &[f32],
    threshold: f32,
    top_k: usize,
    now_ms: u64,
) -> Vec<Near> {
    if p.dims != query.len() || top_k == 0 {
        return Vec::new();
    }
    let mut best: Vec<(usize, f32)> = Vec::with_capacity(top_k + 1);
    for i in positions {
        let Some(v) = p.vector(i) else {
            continue;
        };
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

    /// How long one call may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The normalised embedding of `text`; any failure is an error (the
    /// caller counts it and treats it as a miss), told apart by whether the
    /// endpoint is out or only refused this text (see [`super::backoff`]).
    pub async fn embed(&self, text: &str) -> Result<Vec<f32>, EmbedError> {
        if !embeddable(text) {
            return Err(EmbedError::Refused(format!(
                "text over {MAX_TEXT_BYTES} bytes"
            )));
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
        .map_err(|e| EmbedError::Out(e.to_string()))?;
        match status {
            200 => {}
            // A 4xx other than these is about this text, not the endpoint.
            400..=499 if status != 408 && status != 429 => {
                return Err(EmbedError::Refused(format!("status {status}")))
            }
            _ => return Err(EmbedError::Out(format!("status {status}"))),
        }
        let a: EmbeddingsAnswer = serde_json::from_slice(&bytes)
            .map_err(|e| EmbedError::Out(format!("not an embeddings answer: {e}")))?;
        let v = a
            .data
            .into_iter()
            .next()
            .ok_or_else(|| EmbedError::Out("no embedding in the answer".into()))?
            .embedding;
        normalise(v).ok_or_else(|| EmbedError::Refused("a zero or non-finite embedding".into()))
    }
}

/// Why an embedding failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EmbedError {
    /// The endpoint is out: unreachable, timed out, a 5xx, 408 or 429, an
    /// answer that is not an embedding. Semantic lookups back off.
    #[error("{0}")]
    Out(String),
    /// The endpoint refused this text (another 4xx, a zero vector): no
    /// outage, nothing backs off.
    #[error("{0}")]
    Refused(String),
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

    /// Pseudo-random unit vectors (deterministic).
    fn random_unit(seed: u64, dims: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let v: Vec<f32> = (0..dims)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        unit(&v)
    }

    #[test]
    fn prefiltered_search_agrees_with_exact_and_forgets_removed() {
        let (dims, n) = (96, EXACT_UP_TO + 1000);
        let mut i = Index::new(n + 10);
        for k in 0..n {
            i.insert(
                format!("k{k}"),
                "c".into(),
                random_unit(k as u64, dims),
                1000,
            );
        }
        // Other contexts are never searched, however near.
        i.insert("other".into(), "c2".into(), random_unit(7, dims), 1000);
        assert!(i.partitions["c"].len() > EXACT_UP_TO);
        for k in [3usize, 77, 4500, n - 1] {
            // A near-duplicate (cosine about 0.97) of entry k.
            let mut q = random_unit(k as u64, dims);
            let noise = random_unit(1_000_000 + k as u64, dims);
            for (a, b) in q.iter_mut().zip(&noise) {
                *a += 0.25 * b;
            }
            let q = unit(&q);
            let found = i.search("c", &q, 0.9, 5, 0);
            assert_eq!(found, i.search_exact("c", &q, 0.9, 5, 0));
            assert_eq!(found[0].key, format!("k{k}"));
            assert!(found[0].similarity > 0.9);
            // Removed: gone, and the vector moved into its slot is still
            // found under its own key.
            i.remove(&format!("k{k}"));
            assert!(i.search("c", &q, 0.9, 5, 0).is_empty());
            let moved = i.search("c", &random_unit(n as u64 - 2, dims), 0.99, 1, 0);
            assert_eq!(moved[0].key, format!("k{}", n - 2));
        }
        // Expired: not found through the prefilter either.
        assert!(i
            .search("c", &random_unit(5, dims), 0.9, 5, 1000)
            .is_empty());
        assert!(i.search("c2", &random_unit(5, dims), 0.9, 5, 0).is_empty());
    }

    #[test]
    fn sweep_forgets_the_expired() {
        let mut i = Index::new(100);
        for n in 0..10u64 {
            let x = n as f32;
            i.insert(
                format!("k{n}"),
                format!("c{}", n % 3),
                unit(&[1.0, x]),
                n * 100,
            );
        }
        assert_eq!(i.sweep(450), 5);
        assert_eq!(i.len(), 5);
        assert!(!i.contains("k4") && i.contains("k5"));
        let found = i.search("c0", &unit(&[1.0, 6.0]), 0.999, 1, 0);
        assert_eq!(found[0].key, "k6");
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
        assert!(matches!(down.embed("x").await, Err(EmbedError::Out(_))));
    }
}
