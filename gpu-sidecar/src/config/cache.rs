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
    /// A file holding the secret the Envoy beside this sidecar sends on
    /// every lookup and store (`x-sluice-cache-secret`; the policy's
    /// `cache.secret_env`). Set, or `secret_env`: a call without it is
    /// refused 401, whatever its address (under a mesh every pod's call
    /// arrives from loopback). In fleet mode the fleet secret does this.
    pub secret_file: Option<std::path::PathBuf>,
    /// The environment variable holding that secret (instead of a file).
    pub secret_env: Option<String>,
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
            secret_file: None,
            secret_env: None,
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
        if self.secret_file.is_some() && self.secret_env.is_some() {
            return bad(
                "secret_env",
                "give the secret once: secret_file or secret_env, not both".into(),
            );
        }
        if self.secret_env.as_deref().is_some_and(|n| !env_name(n)) {
            return bad(
                "secret_env",
                "an environment variable's name (letters, digits, `_`)".into(),
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

/// The shortest cache secret taken (bytes), as for the fleet secret.
pub const MIN_SECRET: usize = 16;

fn env_name(n: &str) -> bool {
    !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

impl CacheConfig {
    /// The secret the cache endpoints require, when one is configured:
    /// read from `secret_file` or `secret_env` (trimmed), at least
    /// [`MIN_SECRET`] bytes; the error names the field.
    pub fn secret(&self) -> Result<Option<String>, (String, String)> {
        let (field, text) = match (&self.secret_file, &self.secret_env) {
            (Some(p), _) => (
                "cache.secret_file",
                std::fs::read_to_string(p).map_err(|e| {
                    (
                        "cache.secret_file".to_string(),
                        format!("reading {}: {e}", p.display()),
                    )
                })?,
            ),
            (None, Some(n)) => ("cache.secret_env", std::env::var(n).unwrap_or_default()),
            (None, None) => return Ok(None),
        };
        let text = text.trim();
        if text.len() < MIN_SECRET {
            return Err((
                field.to_string(),
                format!(
                    "the secret shared with the Envoy beside this sidecar must be at least \
                     {MIN_SECRET} bytes (`openssl rand -hex 16` makes one)"
                ),
            ));
        }
        Ok(Some(text.to_string()))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> CacheConfig {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn the_secret_is_checked_and_read() {
        assert_eq!(parse("{}").secret(), Ok(None));
        let both = parse("{secret_file: /x, secret_env: X}");
        assert_eq!(both.check(false).unwrap_err().0, "cache.secret_env");
        let bad = parse("{secret_env: \"not a name\"}");
        assert_eq!(bad.check(false).unwrap_err().0, "cache.secret_env");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s");
        std::fs::write(&file, "short\n").unwrap();
        let c = CacheConfig {
            secret_file: Some(file.clone()),
            ..CacheConfig::default()
        };
        assert_eq!(c.secret().unwrap_err().0, "cache.secret_file");
        std::fs::write(&file, "0123456789abcdef0123\n").unwrap();
        assert_eq!(c.secret().unwrap().as_deref(), Some("0123456789abcdef0123"));
        let gone = CacheConfig {
            secret_file: Some(dir.path().join("none")),
            ..CacheConfig::default()
        };
        assert_eq!(gone.secret().unwrap_err().0, "cache.secret_file");
        let unset = CacheConfig {
            secret_env: Some("SLUICE_TEST_UNSET_CACHE_SECRET".into()),
            ..CacheConfig::default()
        };
        assert_eq!(unset.secret().unwrap_err().0, "cache.secret_env");
    }
}
