//! The response cache's store (docs/src/design.md, "Response cache"): the filter asks
//! here before admission (`POST /v1/cache/lookup`) and after a complete successful
//! answer (`POST /v1/cache/store`), over the HTTP channel it already has
//! (messages: `sluice_wire::cache`).
//!
//! - Where: this sidecar's memory by default ([`memory`]: bounded by
//!   `max_entries` and `max_bytes`, LRU, a TTL per entry); in fleet mode
//!   Redis ([`redis`], through the fleet agent's connection), so one
//!   Envoy's answer serves every Envoy.
//! - Semantic: the last user message is embedded by the operator's
//!   OpenAI-compatible endpoint (`cache.embeddings`) and searched in
//!   [`semantic::Index`] inside its context only (scope, model, output
//!   parameters and earlier conversation: the filter's salted hash). In
//!   fleet mode every sidecar learns the vectors others stored.
//! - Never an error for the request: an unreachable Redis or embeddings
//!   endpoint is a miss (counted), never a failure.
//! - Trust: only the Envoy beside this sidecar (loopback, no `Origin`,
//!   JSON; in fleet mode the fleet secret too). Keys are salted hashes:
//!   whoever cannot compute them can neither read nor plant an answer for
//!   a given caller's question.

pub mod backoff;
pub mod entry;
pub mod memory;
pub mod metrics;
pub mod recent;
pub mod redis;
pub mod semantic;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use sluice_wire::cache::{
    Hit, Kind, LookupAnswer, LookupRequest, NotStored, StoreAnswer, StoreRequest,
};

use self::entry::lock;
pub use self::entry::{Limits, Stored};
use self::memory::{MemoryStore, Removed};
use self::metrics::Stats;
use self::recent::Recent;
use self::semantic::{EmbedError, Embedder, Index};
pub use crate::config::cache::{Backend, CacheConfig, EmbeddingsConfig};

fn limits(c: &CacheConfig) -> Limits {
    Limits {
        max_entries: c.max_entries,
        max_bytes: c.max_bytes,
        scope_floor: c.scope_floor(),
    }
}

enum Store {
    Memory(Mutex<MemoryStore>),
    Redis(redis::RedisStore),
}

/// Keys are the filter's hex SHA-256s; anything else is refused.
fn valid_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The scope id of a scope value: what a store's `scope` carries (the
/// lower-case hex SHA-256 of `principal:…`, `team:…`, `org:…`, `tier:…`,
/// `global`). Only the bounds per scope and purges by scope use it;
/// matching never does (the scope is in every key).
pub fn scope_id(value: &str) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(value.as_bytes()))
}

/// The longest model name taken (a metric label).
const MAX_MODEL: usize = 256;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CacheError {
    #[error("{0}")]
    Invalid(String),
}

/// The most vectors one semantic lookup compares, whatever the request's
/// `top_k` (the filter's policy allows more; more is searched as this).
pub const MAX_TOP_K: u32 = 20;

/// The similarity and breadth a semantic lookup is searched with: the
/// request's, but never below the sidecar's `min_threshold` nor wider
/// than [`MAX_TOP_K`] (a caller that reaches the endpoint cannot ask for
/// "the nearest entry, however far").
fn search_bounds(threshold: Option<f32>, top_k: Option<u32>, min_threshold: f32) -> (f32, usize) {
    let t = threshold.unwrap_or(0.95);
    let t = if t.is_nan() { 1.0 } else { t };
    let t = t.max(min_threshold).clamp(f32::MIN_POSITIVE, 1.0);
    let k = top_k.unwrap_or(5).clamp(1, MAX_TOP_K);
    (t, k as usize)
}

pub struct Cache {
    config: CacheConfig,
    store: Store,
    index: Mutex<Index>,
    embedder: Option<Embedder>,
    /// Pauses semantic lookups while the embeddings endpoint is out.
    backoff: backoff::Backoff,
    /// Recently embedded texts (by SHA-256), so the store after a miss
    /// does not embed the same question again.
    recent: Mutex<Recent>,
    /// Stores so far (for the sweep of expired entries).
    stores: std::sync::atomic::AtomicU64,
    pub stats: Stats,
}

/// Stores between two sweeps of expired entries and vectors.
pub const SWEEP_EVERY: u64 = 1024;

impl Cache {
    /// The cache for this sidecar: in Redis when this sidecar has a Redis
    /// connection (it is a fleet agent) and the backend is `auto` or `redis`.
    pub fn new(
        config: CacheConfig,
        redis: Option<Arc<crate::redis::Redis>>,
    ) -> Result<Arc<Cache>, String> {
        config
            .check(redis.is_some())
            .map_err(|(p, m)| format!("{p}: {m}"))?;
        let store = match (config.backend, redis) {
            (Backend::Memory, _) | (Backend::Auto, None) => {
                Store::Memory(Mutex::new(MemoryStore::new(limits(&config))))
            }
            (_, Some(r)) => Store::Redis(redis::RedisStore::new(r, limits(&config))),
            (Backend::Redis, None) => return Err("cache.backend: redis needs fleet:".into()),
        };
        let embedder = config.embeddings.as_ref().map(Embedder::new).transpose()?;
        let vectors = config.max_vectors.unwrap_or(config.max_entries);
        Ok(Arc::new(Cache {
            index: Mutex::new(Index::new(vectors)),
            embedder,
            backoff: backoff::Backoff::default(),
            recent: Mutex::new(Recent::default()),
            stores: std::sync::atomic::AtomicU64::new(0),
            store,
            stats: Stats::default(),
            config,
        }))
    }

    /// The largest answer stored (bytes).
    pub fn max_entry_bytes(&self) -> u64 {
        self.config.max_entry_bytes
    }

    /// Updates the entries and bytes gauges.
    pub async fn note_size(&self) {
        let (n, b) = self.size().await;
        self.stats
            .entries
            .store(n, std::sync::atomic::Ordering::Relaxed);
        self.stats
            .bytes
            .store(b, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn in_redis(&self) -> bool {
        matches!(self.store, Store::Redis(_))
    }

    fn forget(&self, removed: Removed) {
        if removed.evicted.is_empty() && removed.expired.is_empty() {
            return;
        }
        let mut index = lock(&self.index);
        for (k, model) in &removed.evicted {
            index.remove(k);
            self.stats.count(model, Kind::Exact, "evict");
        }
        for (k, _) in &removed.expired {
            index.remove(k);
        }
    }

    async fn get(&self, key: &str, now_ms: u64) -> Result<Option<Stored>, ()> {
        match &self.store {
            Store::Memory(m) => {
                let mut removed = Removed::default();
                let found = lock(m).get(key, now_ms, &mut removed);
                self.forget(removed);
                Ok(found.map(|s| (*s).clone()))
            }
            Store::Redis(r) => r.get(key, now_ms).await.map_err(|_| {
                self.stats.unavailable();
            }),
        }
    }

    async fn embed(&self, text: &str) -> Option<Vec<f32>> {
        let e = self.embedder.as_ref()?;
        if let Some(v) = lock(&self.recent).get(text) {
            return Some(v);
        }
        let Some(call) = self.backoff.call(Instant::now(), e.timeout()) else {
            self.stats.embedding_skipped();
            return None;
        };
        self.stats.embedding_call();
        let (line, v) = match e.embed(text).await {
            Ok(v) => {
                lock(&self.recent).put(text, v.clone());
                (call.answered(), Some(v))
            }
            Err(EmbedError::Out(why)) => {
                self.stats.embedding_failed(None);
                (call.out(&why, Instant::now()), None)
            }
            Err(EmbedError::Refused(why)) => {
                self.stats.embedding_failed(Some(&why));
                (call.answered(), None)
            }
        };
        if let Some(line) = line {
            eprintln!("{line}");
        }
        v
    }

    fn hit(&self, kind: Kind, s: Stored, similarity: Option<f32>, now_ms: u64) -> LookupAnswer {
        self.stats.count(&s.model, kind, "hit");
        self.stats.saved(&s.model, &s.entry);
        LookupAnswer {
            hit: Some(Hit {
                kind,
                age_s: now_ms.saturating_sub(s.stored_at_ms) / 1000,
                similarity,
                entry: s.entry,
            }),
        }
    }

    /// Exact first, then (when asked and configured) semantic.
    pub async fn lookup(
        &self,
        req: &LookupRequest,
        now_ms: u64,
    ) -> Result<LookupAnswer, CacheError> {
        let started = Instant::now();
        check_request(&req.key, &req.model, req.semantic.as_ref())?;
        let answer = self.lookup_inner(req, now_ms).await;
        self.stats.lookup_took(started.elapsed());
        Ok(answer)
    }

    async fn lookup_inner(&self, req: &LookupRequest, now_ms: u64) -> LookupAnswer {
        // `exact: false`: a semantic-only model; its own key never answers.
        if req.exact {
            if let Ok(Some(s)) = self.get(&req.key, now_ms).await {
                return self.hit(Kind::Exact, s, None, now_ms);
            }
            self.stats.count(&req.model, Kind::Exact, "miss");
        }
        let Some(sem) = &req.semantic else {
            return LookupAnswer { hit: None };
        };
        if !semantic::embeddable(&sem.text) {
            // Too long to embed whole: exact only (a cut text would make
            // two questions sharing their start look the same).
            self.stats.count(&req.model, Kind::Semantic, "skip");
            return LookupAnswer { hit: None };
        }
        let (threshold, top_k) = search_bounds(req.threshold, req.top_k, self.config.min_threshold);
        let found = match self.embed(&sem.text).await {
            Some(q) => lock(&self.index).search(&sem.context, &q, threshold, top_k, now_ms),
            None => Vec::new(),
        };
        for near in found {
            match self.get(&near.key, now_ms).await {
                // The entry's own context must be the request's: a vector
                // learned under one context never answers another.
                Ok(Some(s)) if s.context.as_deref() == Some(sem.context.as_str()) => {
                    return self.hit(Kind::Semantic, s, Some(near.similarity), now_ms);
                }
                Ok(_) => lock(&self.index).remove(&near.key),
                Err(()) => break,
            }
        }
        self.stats.count(&req.model, Kind::Semantic, "miss");
        LookupAnswer { hit: None }
    }

    /// Stores an answer under its scope id (`req.scope`: hex SHA-256 of
    /// the scope value), which the bounds per scope and purges by scope go
    /// by; without one it shares the bounds of every other entry without.
    pub async fn store(&self, req: StoreRequest, now_ms: u64) -> Result<StoreAnswer, CacheError> {
        let scope = req.scope.clone();
        self.store_scoped(req, scope.as_deref(), now_ms).await
    }

    async fn store_scoped(
        &self,
        req: StoreRequest,
        scope: Option<&str>,
        now_ms: u64,
    ) -> Result<StoreAnswer, CacheError> {
        check_store(&req, scope)?;
        if req.entry.body.len() as u64 > self.config.max_entry_bytes {
            self.stats.count(&req.model, Kind::Exact, "skip");
            return Ok(StoreAnswer {
                stored: false,
                reason: Some(NotStored::TooLarge),
            });
        }
        let ttl_ms = req
            .ttl_s
            .min(self.config.max_ttl.as_secs())
            .saturating_mul(1000);
        let (context, vector) = match &req.semantic {
            Some(sem) if !semantic::embeddable(&sem.text) => {
                self.stats.count(&req.model, Kind::Semantic, "skip");
                (None, None)
            }
            Some(sem) => match self.embed(&sem.text).await {
                Some(v) => (Some(sem.context.clone()), Some(v)),
                None => (None, None),
            },
            None => (None, None),
        };
        let stored = Stored {
            model: req.model.clone(),
            entry: req.entry,
            stored_at_ms: now_ms,
            expires_at_ms: now_ms.saturating_add(ttl_ms),
            context,
            vector,
            scope: scope.map(str::to_ascii_lowercase),
        };
        self.sweep_now_and_then(now_ms);
        let Some(kept) = self.put(&req.key, &stored, now_ms).await else {
            return Ok(StoreAnswer {
                stored: false,
                reason: Some(NotStored::Unavailable),
            });
        };
        if !kept {
            self.stats.count(&req.model, Kind::Exact, "skip");
            // Not too large alone: every other scope is within its floor.
            let reason = if stored.bytes(&req.key) > self.config.max_bytes {
                NotStored::TooLarge
            } else {
                NotStored::Full
            };
            return Ok(StoreAnswer {
                stored: false,
                reason: Some(reason),
            });
        }
        self.stats.count(&req.model, Kind::Exact, "store");
        if !self.in_redis() {
            self.note_size().await;
        }
        if let (Some(c), Some(v)) = (stored.context, stored.vector) {
            lock(&self.index).insert(req.key, c, v, stored.expires_at_ms);
            self.stats.count(&req.model, Kind::Semantic, "store");
        }
        Ok(StoreAnswer {
            stored: true,
            reason: None,
        })
    }

    /// Puts `stored` under `key`, in memory or in Redis: whether the
    /// bounds kept it; `None` when Redis is unavailable (counted).
    async fn put(&self, key: &str, stored: &Stored, now_ms: u64) -> Option<bool> {
        match &self.store {
            Store::Memory(m) => {
                let mut removed = Removed::default();
                let kept = lock(m).put(key.to_string(), Arc::new(stored.clone()), &mut removed);
                self.forget(removed);
                Some(kept)
            }
            Store::Redis(r) => match r.put(key, stored, now_ms).await {
                Ok((kept, evicted)) => {
                    for model in evicted {
                        self.stats.count(&model, Kind::Exact, "evict");
                    }
                    Some(kept)
                }
                Err(_) => {
                    self.stats.unavailable();
                    None
                }
            },
        }
    }

    /// Every [`SWEEP_EVERY`] stores: expired entries leave the memory store
    /// and expired vectors the index (in Redis, entries expire there on
    /// their own). Linear in what is held, so amortised over the stores.
    fn sweep_now_and_then(&self, now_ms: u64) {
        let n = self
            .stores
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n % SWEEP_EVERY != SWEEP_EVERY - 1 {
            return;
        }
        if let Store::Memory(m) = &self.store {
            let mut removed = Removed::default();
            lock(m).sweep(now_ms, &mut removed);
            self.forget(removed);
        }
        lock(&self.index).sweep(now_ms);
    }

    /// Removes every entry, or a model's; how many.
    pub async fn purge(&self, model: Option<&str>) -> Result<u64, CacheError> {
        self.purge_where(model, None).await
    }

    /// Removes the entries of `model` (any when `None`) and of `scope`
    /// (the scope value as the filter writes it, e.g. `team:blue`,
    /// `principal:key:…`; any when `None`); how many. Their vectors leave
    /// this sidecar's index too (in fleet mode the other sidecars' indexes
    /// drop them at their next match: the entry is gone from Redis).
    pub async fn purge_where(
        &self,
        model: Option<&str>,
        scope: Option<&str>,
    ) -> Result<u64, CacheError> {
        let scope = scope.map(scope_id);
        match &self.store {
            Store::Memory(m) => {
                let keys = lock(m).purge(|s| {
                    model.is_none_or(|want| s.model == want)
                        && scope
                            .as_deref()
                            .is_none_or(|want| s.scope.as_deref() == Some(want))
                });
                let mut index = lock(&self.index);
                for k in &keys {
                    index.remove(k);
                }
                Ok(keys.len() as u64)
            }
            Store::Redis(r) => {
                let removed = r.purge(model, scope.as_deref()).await.map_err(|e| {
                    self.stats.unavailable();
                    CacheError::Invalid(format!("redis: {e}"))
                })?;
                let mut index = lock(&self.index);
                if model.is_none() && scope.is_none() {
                    index.clear();
                }
                for k in &removed {
                    index.remove(k);
                }
                Ok(removed.len() as u64)
            }
        }
    }

    /// Scopes holding entries (memory; `None` in Redis).
    pub fn scopes(&self) -> Option<usize> {
        match &self.store {
            Store::Memory(m) => Some(lock(m).scopes()),
            Store::Redis(_) => None,
        }
    }

    /// Entries and bytes held (memory), or as Redis counts them.
    pub async fn size(&self) -> (u64, u64) {
        let vectors = lock(&self.index).bytes();
        match &self.store {
            Store::Memory(m) => {
                let m = lock(m);
                (m.len() as u64, m.bytes())
            }
            Store::Redis(r) => r.size().await.unwrap_or((0, vectors)),
        }
    }

    pub fn vectors(&self) -> usize {
        lock(&self.index).len()
    }

    /// What the operator page shows (`/v1/history`'s `cache`): counts
    /// since start, entries and bytes as of the last store, purge or sync
    /// (no Redis call per page refresh).
    pub fn summary(&self) -> serde_json::Value {
        use std::sync::atomic::Ordering::Relaxed;
        let (mut hits_exact, mut hits_semantic, mut lookups) = (0u64, 0u64, 0u64);
        for (_, kind, result, n) in self.stats.counts() {
            match (kind, result) {
                ("exact", "hit") => {
                    hits_exact += n;
                    lookups += n;
                }
                ("exact", "miss") => lookups += n,
                ("semantic", "hit") => hits_semantic += n,
                _ => {}
            }
        }
        let hits = hits_exact.saturating_add(hits_semantic);
        let (tokens, spend) = self
            .stats
            .saved_by_model()
            .iter()
            .fold((0u64, 0u64), |(t, s), (_, a, b)| {
                (t.saturating_add(*a), s.saturating_add(*b))
            });
        let hit_rate = (lookups > 0).then(|| hits as f64 / lookups as f64);
        serde_json::json!({
            "where": if self.in_redis() { "redis" } else { "memory" },
            "lookups": lookups,
            "hits": hits,
            "hits_exact": hits_exact,
            "hits_semantic": hits_semantic,
            "hit_rate": hit_rate,
            "entries": self.stats.entries.load(Relaxed),
            "bytes": self.stats.bytes.load(Relaxed),
            "max_entries": self.config.max_entries,
            "max_bytes": self.config.max_bytes,
            "vectors": self.vectors(),
            "scopes": self.scopes(),
            "saved_tokens": tokens,
            "saved_spend_micros": spend,
            "embedding_failures": self.stats.embedding_failures.load(Relaxed),
            "embedding_skipped": self.stats.embedding_skipped.load(Relaxed),
        })
    }

    /// Fleet mode: learns the vectors other sidecars stored, every sync
    /// interval, until closing. Redis down: tried again next round.
    pub async fn learn(self: Arc<Self>, mut closing: tokio::sync::watch::Receiver<bool>) {
        let Store::Redis(r) = &self.store else {
            return;
        };
        let every = r.redis().sync_interval();
        let mut after = "0".to_string();
        loop {
            self.note_size().await;
            if let Ok((learned, last)) = r.learn(&after).await {
                after = last;
                let now = now_ms();
                let mut index = lock(&self.index);
                for l in learned {
                    if l.expires_at_ms > now && !index.contains(&l.key) {
                        if let Some(v) = semantic::normalise(l.vector) {
                            index.insert(l.key, l.context, v, l.expires_at_ms);
                        }
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = closing.changed() => return,
            }
        }
    }
}

/// Wall-clock milliseconds (entries are shared across sidecars in Redis,
/// so ages and expiries are in wall time).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("config", &self.config)
            .field("in_redis", &self.in_redis())
            .finish()
    }
}

fn check_request(
    key: &str,
    model: &str,
    semantic: Option<&sluice_wire::cache::Semantic>,
) -> Result<(), CacheError> {
    if !valid_hash(key) {
        return Err(CacheError::Invalid("key: 64 hex digits expected".into()));
    }
    if model.is_empty() || model.len() > MAX_MODEL {
        return Err(CacheError::Invalid(format!(
            "model: 1 to {MAX_MODEL} bytes expected"
        )));
    }
    if let Some(s) = semantic {
        if !valid_hash(&s.context) {
            return Err(CacheError::Invalid(
                "semantic.context: 64 hex digits expected".into(),
            ));
        }
    }
    Ok(())
}

/// A store's request as the lookup's, plus its scope id (when one is
/// given) and a TTL of at least a second.
fn check_store(req: &StoreRequest, scope: Option<&str>) -> Result<(), CacheError> {
    check_request(&req.key, &req.model, req.semantic.as_ref())?;
    if scope.is_some_and(|s| !valid_hash(s)) {
        return Err(CacheError::Invalid(
            "scope: 64 hex digits expected (SHA-256 of the scope value)".into(),
        ));
    }
    if req.ttl_s == 0 {
        return Err(CacheError::Invalid("ttl_s: at least 1".into()));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests;
