//! Deny by default (docs/src/design.md, "Guarantees"): a request on the LLM listener
//! is either classified (its API known, its whole demand reserved: `request::Api`)
//! or let through by one of these rules, or refused with 404
//! `unknown_endpoint`. A bodyless GET/HEAD/OPTIONS/DELETE to an unknown
//! path (`/v1/models`, `/healthz`) carries no work and goes on under the
//! request buckets; anything with a body, and every POST, needs a rule.
//!
//! A rule names a path (or a prefix) sluice does not read, the methods it
//! opens, its own request limit (all callers together) and optionally a
//! model whose request limits and concurrency it counts against. No token
//! is reserved for it: what such a request makes the upstream do is not
//! bounded by any budget. That is the price of opening a path.

use crate::policy::passthrough::PassthroughRule;
use crate::policy::Policy;
use crate::usage::demand::{canonical_path, Api};

/// A rule as requests are matched against it.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// Canonical path or prefix.
    path: String,
    prefix: bool,
    /// Upper-cased.
    methods: Vec<String>,
    pub model: Option<String>,
}

impl Compiled {
    fn matches(&self, method: &str, canonical: &str) -> bool {
        let path_ok = if self.prefix {
            canonical == self.path
                || canonical
                    .strip_prefix(self.path.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
        } else {
            canonical == self.path
        };
        path_ok && self.methods.iter().any(|m| m.eq_ignore_ascii_case(method))
    }
}

/// The rules of a policy, compiled once (see [`check`] for what is refused).
pub fn compile(rules: &[PassthroughRule]) -> Vec<Compiled> {
    rules
        .iter()
        .filter_map(|r| {
            let (written, prefix) = match (&r.path, &r.prefix) {
                (Some(p), None) => (p, false),
                (None, Some(p)) => (p, true),
                _ => return None,
            };
            let path = canonical_path(written).ok()?.into_owned();
            Some(Compiled {
                path,
                prefix,
                methods: r.methods.iter().map(|m| m.to_ascii_uppercase()).collect(),
                model: r.model.clone(),
            })
        })
        .collect()
}

/// The first rule that opens `method` on this canonical path, as the API
/// sluice then gives the request.
pub fn find<'a>(
    rules: impl IntoIterator<Item = &'a Compiled>,
    method: &str,
    canonical: &str,
) -> Option<Api> {
    rules
        .into_iter()
        .position(|r| r.matches(method, canonical))
        .and_then(|i| u16::try_from(i).ok())
        .map(Api::Passthrough)
}

/// The most rules a policy may list (an index fits the API's `u16`).
const MAX_RULES: usize = 256;

/// Cross-field checks of `passthrough`: (field path, problem). Checked
/// against what the filter compiles: the path's canonical form and the
/// classification the request path uses.
pub fn check(policy: &Policy) -> Result<(), (String, String)> {
    let rules = &policy.passthrough;
    if rules.len() > MAX_RULES {
        return Err(("passthrough".into(), format!("at most {MAX_RULES} rules")));
    }
    for (i, rule) in rules.iter().enumerate() {
        let at = |field: &str| format!("passthrough[{i}].{field}");
        let (field, written) = match (&rule.path, &rule.prefix) {
            (Some(p), None) => ("path", p),
            (None, Some(p)) => ("prefix", p),
            _ => {
                return Err((
                    format!("passthrough[{i}]"),
                    "give exactly one of `path` and `prefix`".into(),
                ))
            }
        };
        if !written.starts_with('/') {
            return Err((at(field), "must start with `/`".into()));
        }
        let Ok(canonical) = canonical_path(written) else {
            return Err((
                at(field),
                "is ambiguous (see the README, \"Deny by default\")".into(),
            ));
        };
        if canonical == "/" && field == "prefix" {
            return Err((
                at(field),
                "`/` would open every path: list the paths to open".into(),
            ));
        }
        if Api::of_path(&canonical) != Api::Other {
            return Err((
                at(field),
                format!("`{written}` is an LLM API sluice reads and reserves; it cannot be passed through"),
            ));
        }
        if rule.methods.is_empty() {
            return Err((at("methods"), "list at least one method".into()));
        }
        for (j, method) in rule.methods.iter().enumerate() {
            if method.is_empty() || !method.bytes().all(|b| b.is_ascii_alphabetic()) {
                return Err((
                    format!("passthrough[{i}].methods[{j}]"),
                    format!("`{method}` is not an HTTP method"),
                ));
            }
        }
        if let Some(model) = rule
            .model
            .as_ref()
            .filter(|m| !policy.models.contains_key(*m))
        {
            return Err((
                at("model"),
                format!("model `{model}` is not listed under `models`"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(
        rules: serde_json::Value,
    ) -> Result<crate::admission::Engine, crate::policy::ConfigError> {
        Policy::from_value(serde_json::json!({
            "default_tier": "free",
            "identity": {"sources": ["client_address"]},
            "tiers": {"free": {"requests": "10/min"}},
            "models": {"whisper": {"requests": "5/min"}},
            "passthrough": rules,
        }))
        .and_then(crate::admission::Engine::compile)
    }

    #[test]
    fn rules_match_canonical_paths_methods_and_prefixes_at_a_boundary() {
        let p = policy(serde_json::json!([
            {"path": "/v1/audio/transcriptions", "requests": "10/min", "model": "whisper"},
            {"prefix": "/v1/images", "methods": ["post", "PUT"], "requests": "5/min"},
        ]))
        .unwrap();
        let rules = compile(&p.policy.passthrough);
        let find = |m: &str, path: &str| find(&rules, m, &canonical_path(path).unwrap());
        assert_eq!(
            find("POST", "/v1/audio/transcriptions"),
            Some(Api::Passthrough(0))
        );
        assert_eq!(
            find("POST", "/V1/audio/%74ranscriptions/"),
            Some(Api::Passthrough(0))
        );
        assert_eq!(find("PUT", "/v1/audio/transcriptions"), None);
        assert_eq!(find("POST", "/v1/audio/transcriptions/x"), None);
        assert_eq!(
            find("POST", "/v1/images/generations"),
            Some(Api::Passthrough(1))
        );
        assert_eq!(find("put", "/v1/images"), Some(Api::Passthrough(1)));
        assert_eq!(find("POST", "/v1/imagesx"), None);
        assert_eq!(find("POST", "/v1/audio/speech"), None);
    }

    #[test]
    fn bad_rules_are_refused_by_field_path() {
        for (rules, path) in [
            (serde_json::json!([{"requests": "1/min"}]), "passthrough[0]"),
            (
                serde_json::json!([{"path": "/a", "prefix": "/b", "requests": "1/min"}]),
                "passthrough[0]",
            ),
            (
                serde_json::json!([{"path": "v1/x", "requests": "1/min"}]),
                "passthrough[0].path",
            ),
            (
                serde_json::json!([{"path": "/v1/chat/completions", "requests": "1/min"}]),
                "passthrough[0].path",
            ),
            (
                serde_json::json!([{"path": "/v1/%2563hat", "requests": "1/min"}]),
                "passthrough[0].path",
            ),
            (
                serde_json::json!([{"prefix": "/", "requests": "1/min"}]),
                "passthrough[0].prefix",
            ),
            (
                serde_json::json!([{"path": "/x", "methods": [], "requests": "1/min"}]),
                "passthrough[0].methods",
            ),
            (
                serde_json::json!([{"path": "/x", "methods": ["PO ST"], "requests": "1/min"}]),
                "passthrough[0].methods[0]",
            ),
            (
                serde_json::json!([{"path": "/x", "requests": "1/min", "model": "nope"}]),
                "passthrough[0].model",
            ),
            (serde_json::json!([{"path": "/x"}]), "passthrough[0]"),
            (
                serde_json::json!([{"path": "/x", "requests": "1/min", "bogus": 1}]),
                "passthrough[0].bogus",
            ),
        ] {
            let e = policy(rules.clone()).map(|_| ()).unwrap_err();
            assert_eq!(e.path, path, "{rules}: {e}");
        }
    }
}
