//! `passthrough:` — the paths sluice does not read that a policy opens. The
//! rules are checked against the classification where they are compiled
//! (`admission::passthrough::check`).

use serde::Deserialize;

use crate::policy::Limit;

/// `passthrough: [{path: /v1/audio/transcriptions, requests: 10/min}]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassthroughRule {
    /// The one path this rule opens (compared in canonical form).
    pub path: Option<String>,
    /// Or every path under this prefix, at a segment boundary.
    pub prefix: Option<String>,
    /// The methods it opens (default: `[POST]`).
    #[serde(default = "default_methods")]
    pub methods: Vec<String>,
    /// Requests through this rule, all callers together.
    pub requests: Limit,
    /// A model (under `models`) whose request limits and concurrency these
    /// requests count against too.
    pub model: Option<String>,
}

fn default_methods() -> Vec<String> {
    vec!["POST".into()]
}
