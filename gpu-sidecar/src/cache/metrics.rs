//! The cache's counters and their exposition in `/metrics`, beside the
//! sidecar's own families (same writer, `sluice_sidecar_cache_*`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use sluice_wire::cache::{Entry, Kind};

use super::entry::lock;

/// Distinct model labels kept; beyond, counted under `other`.
const MAX_MODELS: usize = 256;

/// Lookup latency buckets, seconds.
pub const LOOKUP_BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// (kind, result) → count.
type ByResult = BTreeMap<(&'static str, &'static str), u64>;

#[derive(Debug, Default)]
pub struct Stats {
    /// model → (kind, result) → count.
    counts: Mutex<BTreeMap<String, ByResult>>,
    /// model → (tokens, spend micros) a hit saved.
    saved: Mutex<BTreeMap<String, (u64, u64)>>,
    lookup_buckets: [AtomicU64; LOOKUP_BUCKETS.len()],
    lookup_count: AtomicU64,
    lookup_micros: AtomicU64,
    pub embedding_calls: AtomicU64,
    pub embedding_failures: AtomicU64,
    /// Embeddings not asked for: the endpoint was out ([`super::backoff`]).
    pub embedding_skipped: AtomicU64,
    /// Redis calls that failed (each a miss or an unstored answer).
    pub unavailable: AtomicU64,
    /// Entries and bytes, as of the last store, purge or sync.
    pub entries: AtomicU64,
    pub bytes: AtomicU64,
}

fn kind_label(k: Kind) -> &'static str {
    match k {
        Kind::Exact => "exact",
        Kind::Semantic => "semantic",
    }
}

fn model_label<V>(map: &BTreeMap<String, V>, model: &str) -> String {
    if map.contains_key(model) || map.len() < MAX_MODELS {
        model.to_string()
    } else {
        "other".into()
    }
}

impl Stats {
    pub fn count(&self, model: &str, kind: Kind, result: &'static str) {
        let mut c = lock(&self.counts);
        let m = model_label(&c, model);
        let n = c
            .entry(m)
            .or_default()
            .entry((kind_label(kind), result))
            .or_default();
        *n = n.saturating_add(1);
    }

    pub fn get(&self, model: &str, kind: Kind, result: &'static str) -> u64 {
        lock(&self.counts)
            .get(model)
            .and_then(|m| m.get(&(kind_label(kind), result)))
            .copied()
            .unwrap_or(0)
    }

    pub fn saved(&self, model: &str, e: &Entry) {
        let mut s = lock(&self.saved);
        let m = model_label(&s, model);
        let slot = s.entry(m).or_default();
        slot.0 = slot
            .0
            .saturating_add(e.prompt_tokens.saturating_add(e.completion_tokens));
        slot.1 = slot.1.saturating_add(e.spend_micros);
    }

    pub fn lookup_took(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (i, le) in LOOKUP_BUCKETS.iter().enumerate() {
            if s <= *le {
                self.lookup_buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.lookup_count.fetch_add(1, Ordering::Relaxed);
        self.lookup_micros.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    pub fn embedding_call(&self) {
        self.embedding_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// A failed embedding. `refused`: the endpoint refused this text (its
    /// reason), logged at the first and then every power of two, so an
    /// operator learns of it and a flood cannot fill the log; an outage
    /// (none) is logged by the backoff, once per run.
    pub fn embedding_failed(&self, refused: Option<&str>) {
        let n = self.embedding_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(why) = refused.filter(|_| n.is_power_of_two()) {
            eprintln!(
                "sluice-sidecar: cache: embedding refused ({why}): a miss; {n} failures so far"
            );
        }
    }

    pub fn embedding_skipped(&self) {
        self.embedding_skipped.fetch_add(1, Ordering::Relaxed);
    }

    /// (model, kind, result, count), for `/metrics`.
    pub fn counts(&self) -> Vec<(String, &'static str, &'static str, u64)> {
        lock(&self.counts)
            .iter()
            .flat_map(|(m, by)| by.iter().map(move |((k, r), n)| (m.clone(), *k, *r, *n)))
            .collect()
    }

    /// (model, tokens, spend micros) the hits saved.
    pub fn saved_by_model(&self) -> Vec<(String, u64, u64)> {
        lock(&self.saved)
            .iter()
            .map(|(m, (t, s))| (m.clone(), *t, *s))
            .collect()
    }

    /// Cumulative bucket counts, count, sum in µs of the lookup latency.
    pub fn lookup_histogram(&self) -> (Vec<u64>, u64, u64) {
        (
            self.lookup_buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            self.lookup_count.load(Ordering::Relaxed),
            self.lookup_micros.load(Ordering::Relaxed),
        )
    }

    pub fn unavailable(&self) {
        self.unavailable.fetch_add(1, Ordering::Relaxed);
    }
}
