//! `fallback` and `static_fallback`: where a request goes, or what it is
//! answered, when the primary cannot serve it.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::policy::{default_true, ConfigError, Policy};

/// The kill switch sets `header: value` on the request and refreshes the
/// route, so a route matching that header sends it to the fallback cluster
/// (whose credentials Envoy injects). Clients cannot set the header: sluice
/// removes it from every request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FallbackConfig {
    #[serde(default = "default_fallback_header")]
    pub header: String,
    #[serde(default = "default_fallback_value")]
    pub value: String,
    /// Provider name in `x-sluice-provider`.
    #[serde(default = "default_fallback_value")]
    pub provider: String,
}

fn default_fallback_header() -> String {
    "x-sluice-upstream".into()
}
fn default_fallback_value() -> String {
    "fallback".into()
}

/// Canned answers when nothing upstream can serve a request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticFallback {
    /// Also when the primary is out (open breaker, error breaker), not only
    /// under a kill switch without a fallback provider.
    #[serde(default = "default_true")]
    pub when_primary_out: bool,
    /// Normalized prompt (lower case, words) → answer.
    #[serde(default)]
    pub answers: BTreeMap<String, String>,
    /// The answer to anything else.
    #[serde(default = "default_static_message")]
    pub message: String,
}

impl StaticFallback {
    pub fn default_message() -> String {
        default_static_message()
    }
}

fn default_static_message() -> String {
    "The assistant is temporarily unavailable. Please try again in a few minutes.".into()
}

/// The kill switch's header is one Envoy can match.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    if let Some(f) = &p.fallback {
        if f.header.is_empty() || f.header.chars().any(|c| c.is_ascii_uppercase() || c == ':') {
            return Err(ConfigError::at(
                "fallback.header",
                "must be a lower-case header name",
            ));
        }
    }
    Ok(())
}
