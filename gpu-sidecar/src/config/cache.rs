//! The sidecar's `cache:` section: where the response cache's entries
//! live (memory, or Redis in fleet mode), its bounds, and the embeddings
//! endpoint of the semantic cache (see `crate::cache`).

use std::time::Duration;

use serde::Deserialize;

/// Where entries live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// Redis when this sidecar is a fleet agent (`fleet:` set), else memory.
    #[default]
    Auto,
    Memory,
    Redis,
}

/// The sidecar's `cache:` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    pub backend: Backend,
    pub max_entries: usize,
    /// Bytes of all entries together (answers, keys, vectors).
    pub max_bytes: u64,
    /// One entry's answer at most (bytes); larger ones are not stored.
    pub max_entry_bytes: u64,
    /// The longest TTL any entry gets, whatever the filter asks.
    #[serde(deserialize_with = "crate::config::field::duration")]
    pub max_ttl: Duration,
    /// Vectors the semantic index holds at most (default `max_entries`).
    pub max_vectors: Option<usize>,
    /// Absent: no semantic cache (semantic lookups are misses).
    pub embeddings: Option<EmbeddingsConfig>,
    /// The lowest similarity a semantic lookup is searched with, whatever
    /// the request asks (a lower `threshold` is raised to this).
    pub min_threshold: f32,
    /// Entries of a scope that another scope's store never evicts (see
    /// `crate::cache::memory`; Redis keeps the same rule): the largest scope above this
    /// loses its oldest; when no other scope is above it, an answer that
    /// would need one of them is not stored.
    /// Default: 4, or a tenth of `max_entries` when that is less (at
    /// least 1); 0: no floor (the largest scope always gives way).
    pub scope_floor: Option<usize>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            backend: Backend::Auto,
            max_entries: 10_000,
            max_bytes: 64 << 20,
            max_entry_bytes: 1 << 20,
            max_ttl: Duration::from_secs(30 * 86_400),
            max_vectors: None,
            embeddings: None,
            min_threshold: 0.9,
            scope_floor: None,
        }
    }
}

/// Absurd bounds are refused rather than believed.
const MAX_ENTRIES: usize = 10_000_000;
const MAX_BYTES: u64 = 64 << 30;

impl CacheConfig {
    /// The floor per scope in entries (see `scope_floor`).
    pub fn scope_floor(&self) -> usize {
        self.scope_floor
            .unwrap_or_else(|| 4.min(self.max_entries / 10).max(1))
            .min(self.max_entries)
    }

    /// Checks the section; `fleet`: whether a `fleet:` section is there.
    pub fn check(&self, fleet: bool) -> Result<(), (String, String)> {
        let bad = |p: &str, m: String| Err((format!("cache.{p}"), m));
        if self.max_entries == 0 || self.max_entries > MAX_ENTRIES {
            return bad("max_entries", format!("between 1 and {MAX_ENTRIES}"));
        }
        if self.max_bytes == 0 || self.max_bytes > MAX_BYTES {
            return bad("max_bytes", format!("between 1 and {MAX_BYTES}"));
        }
        if self.max_entry_bytes == 0 || self.max_entry_bytes > self.max_bytes {
            return bad(
                "max_entry_bytes",
                format!("between 1 and max_bytes ({})", self.max_bytes),
            );
        }
        if self.scope_floor.is_some_and(|f| f > self.max_entries) {
            return bad(
                "scope_floor",
                format!("at most max_entries ({})", self.max_entries),
            );
        }
        if self.max_ttl.as_secs() == 0 {
            return bad("max_ttl", "at least 1s".into());
        }
        if self.max_vectors.is_some_and(|v| v > MAX_ENTRIES) {
            return bad("max_vectors", format!("at most {MAX_ENTRIES}"));
        }
        if !(self.min_threshold > 0.0 && self.min_threshold <= 1.0) {
            return bad(
                "min_threshold",
                format!("a cosine similarity in (0, 1], not {}", self.min_threshold),
            );
        }
        if self.backend == Backend::Redis && !fleet {
            return bad(
                "backend",
                "redis needs the fleet: section (the cache uses the fleet agent's Redis)".into(),
            );
        }
        if let Some(e) = &self.embeddings {
            crate::http::Target::parse(&e.url)
                .map_err(|err| ("cache.embeddings.url".to_string(), err.to_string()))?;
            if e.model.trim().is_empty() {
                return bad("embeddings.model", "must name the embedding model".into());
            }
            if e.timeout.is_zero() {
                return bad("embeddings.timeout", "must be more than 0".into());
            }
        }
        Ok(())
    }
}

/// The sidecar's `cache.embeddings`: an OpenAI-compatible endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingsConfig {
    /// The full URL, e.g. `http://127.0.0.1:8000/v1/embeddings` (vLLM,
    /// Ollama's OpenAI endpoint, a provider behind a local proxy).
    pub url: String,
    /// The embedding model it is asked for.
    pub model: String,
    /// Per call; a slower answer is a miss (default 2s).
    #[serde(
        default = "default_timeout",
        deserialize_with = "crate::config::field::duration"
    )]
    pub timeout: Duration,
    /// Environment variable holding a bearer token, if the endpoint wants one.
    #[serde(default)]
    pub api_key_env: Option<String>,
}

fn default_timeout() -> Duration {
    Duration::from_secs(2)
}
