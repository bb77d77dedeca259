//! The cache's counters and their exposition in `/metrics`, beside the
//! sidecar's own families (same writer, `sluice_sidecar_cache_*`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use sluice_wire::cache::{Entry, Kind};

use super::{lock, Cache};
use crate::metrics::Exposition;

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

    pub fn embedding_failed(&self, why: &str) {
        let n = self.embedding_failures.fetch_add(1, Ordering::Relaxed) + 1;
        // The first and then every power of two: an operator learns of it,
        // a flood cannot fill the log.
        if n.is_power_of_two() {
            eprintln!("sluice-sidecar: cache: embedding failed ({why}): a miss; {n} so far");
        }
    }

    pub fn unavailable(&self) {
        self.unavailable.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) fn render(cache: &Cache, out: &mut Exposition) {
    let s = &cache.stats;
    out.family(
        "sluice_sidecar_cache_total",
        "counter",
        "Cache lookups and stores by result (hit, miss, store, skip, evict), kind and model.",
    );
    for (model, by) in lock(&s.counts).iter() {
        for ((kind, result), n) in by {
            out.sample(
                "sluice_sidecar_cache_total",
                &[("result", result), ("kind", kind), ("model", model)],
                *n as f64,
            );
        }
    }
    out.family(
        "sluice_sidecar_cache_saved_tokens_total",
        "counter",
        "Tokens (prompt + completion) of the answers served from the cache.",
    );
    out.family(
        "sluice_sidecar_cache_saved_spend_micros_total",
        "counter",
        "Spend (micro-currency) of the answers served from the cache.",
    );
    for (model, (tokens, spend)) in lock(&s.saved).iter() {
        out.sample(
            "sluice_sidecar_cache_saved_tokens_total",
            &[("model", model)],
            *tokens as f64,
        );
        out.sample(
            "sluice_sidecar_cache_saved_spend_micros_total",
            &[("model", model)],
            *spend as f64,
        );
    }
    let gauges = [
        (
            "sluice_sidecar_cache_entries",
            "Entries held (in Redis, fleet mode: as Redis counts them).",
            s.entries.load(Ordering::Relaxed) as f64,
        ),
        (
            "sluice_sidecar_cache_bytes",
            "Bytes the entries take, as the bound counts them.",
            s.bytes.load(Ordering::Relaxed) as f64,
        ),
        (
            "sluice_sidecar_cache_vectors",
            "Vectors in this sidecar's semantic index.",
            cache.vectors() as f64,
        ),
    ];
    for (name, help, v) in gauges {
        out.family(name, "gauge", help);
        out.sample(name, &[], v);
    }
    let counters = [
        (
            "sluice_sidecar_cache_embedding_calls_total",
            "Calls to the embeddings endpoint.",
            &s.embedding_calls,
        ),
        (
            "sluice_sidecar_cache_embedding_failures_total",
            "Embedding calls that failed or timed out (each a semantic miss).",
            &s.embedding_failures,
        ),
        (
            "sluice_sidecar_cache_unavailable_total",
            "Redis calls of the cache that failed (each a miss or an unstored answer).",
            &s.unavailable,
        ),
    ];
    for (name, help, c) in counters {
        out.family(name, "counter", help);
        out.sample(name, &[], c.load(Ordering::Relaxed) as f64);
    }
    let h = "sluice_sidecar_cache_lookup_seconds";
    out.family(h, "histogram", "Time the sidecar took to answer a lookup.");
    let bucket = format!("{h}_bucket");
    for (i, le) in LOOKUP_BUCKETS.iter().enumerate() {
        out.sample(
            &bucket,
            &[("le", &le.to_string())],
            s.lookup_buckets[i].load(Ordering::Relaxed) as f64,
        );
    }
    let count = s.lookup_count.load(Ordering::Relaxed) as f64;
    out.sample(&bucket, &[("le", "+Inf")], count);
    out.sample(
        &format!("{h}_sum"),
        &[],
        s.lookup_micros.load(Ordering::Relaxed) as f64 / 1e6,
    );
    out.sample(&format!("{h}_count"), &[], count);
}
