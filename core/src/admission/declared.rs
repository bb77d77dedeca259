//! Declared APIs on the request path (`policy/apis.rs` for the policy,
//! `usage/declared.rs` for reading one): a request to a declared path is
//! classified as that API before any `passthrough` rule is looked at, so
//! it is read, reserved, routed and settled like a built-in API.

use crate::admission::passthrough;
use crate::admission::Engine;
use crate::policy::Policy;
use crate::usage::declared::Declared;
use crate::usage::demand::{canonical_path, Api};

/// Cross-field checks of `apis`: (field path, problem). A declared path
/// must have one canonical form, be no built-in API (sluice reads those
/// its own way), no other declaration's, and no `passthrough` rule's (a
/// request there would be read or not by the order of two sections).
pub fn check(policy: &Policy) -> Result<(), (String, String)> {
    let rules = passthrough::compile(&policy.passthrough);
    let mut seen: Vec<(String, &[String])> = Vec::new();
    for (i, api) in policy.apis.iter().enumerate() {
        let at = format!("apis[{i}].path");
        let written = &api.path;
        if !written.starts_with('/') {
            return Err((at, "must start with `/`".into()));
        }
        let Ok(canonical) = canonical_path(written) else {
            return Err((
                at,
                "is ambiguous (see the README, \"Deny by default\")".into(),
            ));
        };
        if Api::of_path(&canonical) != Api::Other {
            return Err((
                at,
                format!("`{written}` is a built-in API: sluice already reads it"),
            ));
        }
        if let Some(method) = api
            .methods
            .iter()
            .find(|m| passthrough::find(&rules, m, &canonical).is_some())
        {
            return Err((
                at,
                format!("`{method} {written}` is opened by a `passthrough` rule too: keep one"),
            ));
        }
        if let Some((j, _)) = seen.iter().enumerate().find(|(_, (p, methods))| {
            *p == canonical
                && methods
                    .iter()
                    .any(|m| api.methods.iter().any(|n| n.eq_ignore_ascii_case(m)))
        }) {
            return Err((at, format!("`{written}` is declared by apis[{j}] too")));
        }
        seen.push((canonical.into_owned(), &api.methods));
    }
    Ok(())
}

/// The policy's declarations, compiled.
pub fn compile(policy: &Policy) -> Vec<Declared> {
    policy.apis.iter().filter_map(Declared::compile).collect()
}

impl Engine {
    /// The declared API a request to this canonical path is, if any.
    pub fn declared_api(&self, method: &str, canonical: &str) -> Option<Api> {
        let i = self
            .declared
            .iter()
            .position(|d| d.matches(method, canonical))?;
        u16::try_from(i).ok().map(Api::Declared)
    }

    /// The compiled declaration of a declared API.
    pub fn declared(&self, api: Api) -> Option<&Declared> {
        let Api::Declared(i) = api else {
            return None;
        };
        self.declared.get(usize::from(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn engine(apis: serde_json::Value) -> Result<Engine, crate::policy::ConfigError> {
        Policy::from_value(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_tokens": 1000}},
            "passthrough": [{"path": "/v1/audio/speech", "requests": "5/min"}],
            "apis": apis,
        }))
        .and_then(Engine::compile)
    }

    fn api(path: &str) -> serde_json::Value {
        json!({"path": path, "model": "/model", "input": ["/message"], "output_limit": "/max_tokens"})
    }

    #[test]
    fn a_declared_path_is_classified_in_canonical_form_by_method() {
        let e = engine(json!([api("/api/v1/ai/chat"), api("/api/v1/ai/summary")])).unwrap();
        let find = |m: &str, p: &str| e.declared_api(m, &canonical_path(p).unwrap());
        assert_eq!(find("POST", "/api/v1/ai/chat"), Some(Api::Declared(0)));
        assert_eq!(find("post", "/API/v1/ai/%63hat"), Some(Api::Declared(0)));
        assert_eq!(
            find("POST", "/api/v1/ai/summary?x=1"),
            Some(Api::Declared(1))
        );
        assert_eq!(find("PUT", "/api/v1/ai/chat"), None);
        assert_eq!(find("POST", "/api/v1/ai/chat/more"), None);
        assert!(e.declared(Api::Declared(1)).is_some());
        assert!(e.declared(Api::Other).is_none());
    }

    #[test]
    fn a_path_sluice_reads_otherwise_is_refused_at_load() {
        let cases = [
            (api("/v1/chat/completions"), "built-in API"),
            (api("/openai/v1/messages"), "built-in API"),
            (api("/v1/audio/speech"), "passthrough"),
            (api("api/chat2"), "start with `/`"),
            (api("/a/%2563"), "ambiguous"),
        ];
        for (declared, says) in cases {
            let err = engine(json!([declared])).err().unwrap();
            assert_eq!(err.path, "apis[0].path", "{err}");
            assert!(err.message.contains(says), "{err}");
        }
        let twice = engine(json!([api("/app/chat"), api("/APP/chat/")]))
            .err()
            .unwrap();
        assert_eq!(twice.path, "apis[1].path");
        assert!(twice.message.contains("apis[0]"), "{twice}");
        let mut get = api("/app/chat");
        get["methods"] = json!(["GET"]);
        assert!(
            engine(json!([api("/app/chat"), get])).is_ok(),
            "other methods"
        );
    }
}
