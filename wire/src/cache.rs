//! The response cache's messages (docs/src/design.md, "Response cache"): the filter asks
//! its sidecar `POST /v1/cache/lookup` before admission and `POST /v1/cache/store`
//! after a complete successful answer. Keys are the filter's salted
//! SHA-256s (hex); the sidecar never sees a principal, only the hashes, so
//! it cannot put one scope's entry into another's answer: the scope is in
//! every key, and the semantic index is partitioned by `context`, which is
//! itself salted over the scope.

use serde::{Deserialize, Serialize};

pub const LOOKUP_PATH: &str = "/v1/cache/lookup";
pub const STORE_PATH: &str = "/v1/cache/store";
pub const PURGE_PATH: &str = "/v1/cache/purge";

/// Which of the two caches answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Exact,
    Semantic,
}

/// The semantic part of a lookup or store: the text embedded (the last
/// user message) and the exact hash of everything else that must match.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Semantic {
    /// Salted SHA-256 (hex) of scope, model, output parameters, system
    /// prompt and every message before the last user message.
    pub context: String,
    /// The last user message.
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupRequest {
    /// Salted SHA-256 (hex) of scope, model and the canonical request.
    pub key: String,
    /// The model (a metric label and a purge selector).
    pub model: String,
    /// Present only for models with the semantic cache on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub semantic: Option<Semantic>,
    /// Whether an entry stored under `key` itself may answer (`false`: a
    /// model with `exact: false`, served by the semantic cache only).
    #[serde(default = "yes", skip_serializing_if = "is_yes")]
    pub exact: bool,
    /// Cosine similarity at least this (semantic only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f32>,
    /// Among this many nearest (semantic only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
}

fn yes() -> bool {
    true
}

fn is_yes(b: &bool) -> bool {
    *b
}

/// The header that carries the secret the filter and its sidecar share
/// for the cache endpoints (`cache.secret_env` in the policy, the
/// sidecar's `cache.secret_file` / `cache.secret_env`).
pub const SECRET_HEADER: &str = "x-sluice-cache-secret";

/// A stored answer: the completion as a non-streaming request gets it,
/// and its usage (what a hit saves).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// The JSON body (OpenAI or Ollama, non-streaming shape).
    pub body: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Spend the upstream call cost, micro-currency.
    #[serde(default)]
    pub spend_micros: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hit {
    pub kind: Kind,
    /// Seconds since it was stored (the `age` header).
    pub age_s: u64,
    /// Semantic hits: the similarity found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub similarity: Option<f32>,
    pub entry: Entry,
}

/// `hit: null` is a miss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupAnswer {
    pub hit: Option<Hit>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreRequest {
    pub key: String,
    pub model: String,
    /// How long the entry lives (the sidecar caps it at its own maximum).
    pub ttl_s: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub semantic: Option<Semantic>,
    pub entry: Entry,
    /// The answer's scope id: lower-case hex SHA-256 of the scope value
    /// (`principal:…`, `team:…`, `org:…`, `tier:…`, `global`). The
    /// sidecar's bounds per scope and purges by scope go by it; matching
    /// never does (the scope is in every key). Absent: one scope shared
    /// by every entry without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// The sidecar's `cache_generation` the filter had seen when it looked
    /// the request up: an answer that comes back after a purge (a long
    /// stream in flight across it) is not stored. Absent: not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

/// Why a store was not kept, when it was not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NotStored {
    /// Larger than the sidecar's `cache.max_entry_bytes`.
    TooLarge,
    /// The store (Redis) did not answer in time.
    Unavailable,
    /// The sidecar's bounds are taken by scopes each within their floor
    /// (`cache.scope_floor`), and this answer's scope has no older entry
    /// to make room from.
    Full,
    /// Asked for before a purge (its `generation` is older than the
    /// sidecar's): what was in flight at a purge is not kept.
    Purged,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreAnswer {
    pub stored: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<NotStored>,
}

/// Admin purge: everything, or only a model's entries, or only a scope's
/// (both: the entries of that model in that scope).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PurgeRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The scope value as the filter computes it: `principal:<principal>`
    /// (e.g. `principal:jwt:alice`), `team:<team>`, `org:<org>`,
    /// `tier:<tier>` or `global`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// The sidecar's `cache_generation` the filter had seen when it looked
    /// the request up: an answer that comes back after a purge (a long
    /// stream in flight across it) is not stored. Absent: not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn entry() -> Entry {
        Entry {
            body: r#"{"id":"x"}"#.into(),
            prompt_tokens: 12,
            completion_tokens: 7,
            spend_micros: 30,
        }
    }

    #[test]
    fn lookup_request_json() {
        let exact = LookupRequest {
            key: "ab".into(),
            model: "m".into(),
            semantic: None,
            exact: true,
            threshold: None,
            top_k: None,
        };
        assert_eq!(
            serde_json::to_value(&exact).unwrap(),
            json!({"key": "ab", "model": "m"})
        );
        let only_semantic = LookupRequest {
            exact: false,
            ..exact.clone()
        };
        let v = serde_json::to_value(&only_semantic).unwrap();
        assert_eq!(v, json!({"key": "ab", "model": "m", "exact": false}));
        assert_eq!(
            serde_json::from_value::<LookupRequest>(v).unwrap(),
            only_semantic
        );
        let sem = LookupRequest {
            semantic: Some(Semantic {
                context: "cd".into(),
                text: "hi".into(),
            }),
            threshold: Some(0.95),
            top_k: Some(5),
            ..exact
        };
        let v = serde_json::to_value(&sem).unwrap();
        assert_eq!(
            v,
            json!({"key": "ab", "model": "m", "semantic": {"context": "cd", "text": "hi"},
                   "threshold": 0.949999988079071, "top_k": 5})
        );
        assert_eq!(serde_json::from_value::<LookupRequest>(v).unwrap(), sem);
        assert!(
            serde_json::from_value::<LookupRequest>(json!({"key": "a", "model": "m", "x": 1}))
                .is_err()
        );
    }

    #[test]
    fn lookup_answer_json() {
        let miss = LookupAnswer { hit: None };
        assert_eq!(serde_json::to_value(&miss).unwrap(), json!({"hit": null}));
        let hit = LookupAnswer {
            hit: Some(Hit {
                kind: Kind::Semantic,
                age_s: 3,
                similarity: Some(0.5),
                entry: entry(),
            }),
        };
        let v = serde_json::to_value(&hit).unwrap();
        assert_eq!(
            v,
            json!({"hit": {"kind": "semantic", "age_s": 3, "similarity": 0.5,
                   "entry": {"body": "{\"id\":\"x\"}", "prompt_tokens": 12,
                             "completion_tokens": 7, "spend_micros": 30}}})
        );
        assert_eq!(serde_json::from_value::<LookupAnswer>(v).unwrap(), hit);
    }

    #[test]
    fn store_json() {
        let req = StoreRequest {
            key: "ab".into(),
            model: "m".into(),
            ttl_s: 86400,
            semantic: None,
            entry: entry(),
            scope: None,
            generation: None,
        };
        let v = serde_json::to_value(&req).unwrap();
        assert_eq!(
            v,
            json!({"key": "ab", "model": "m", "ttl_s": 86400,
                   "entry": {"body": "{\"id\":\"x\"}", "prompt_tokens": 12,
                             "completion_tokens": 7, "spend_micros": 30}})
        );
        assert_eq!(serde_json::from_value::<StoreRequest>(v).unwrap(), req);
        let scoped = StoreRequest {
            scope: Some("cd".into()),
            ..req.clone()
        };
        let v = serde_json::to_value(&scoped).unwrap();
        assert_eq!(v["scope"], "cd");
        assert_eq!(serde_json::from_value::<StoreRequest>(v).unwrap(), scoped);
        let no = StoreAnswer {
            stored: false,
            reason: Some(NotStored::TooLarge),
        };
        assert_eq!(
            serde_json::to_value(&no).unwrap(),
            json!({"stored": false, "reason": "too_large"})
        );
        assert_eq!(
            serde_json::to_value(PurgeRequest::default()).unwrap(),
            json!({})
        );
    }
}
