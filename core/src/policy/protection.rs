//! `protection`: how sluice reacts to what the upstream says.

use serde::Deserialize;

use crate::policy::{de_duration, ConfigError, Policy};

/// How sluice reacts to what the upstream says (docs/src/design.md, "Route"): pauses on
/// `Retry-After`, the per-route error breaker. One caller cannot pause,
/// break or probe-block a route for the others; see `admission/route.rs`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProtectionConfig {
    /// Upstream failures in a row (5xx, reset, timeout) that open the
    /// route's error breaker, if they come from `min_callers` callers.
    #[serde(default = "default_failures")]
    pub failures_to_open: u32,
    /// Distinct principals whose failures it takes to open the breaker
    /// (1 to 8): one caller's requests alone never open it.
    #[serde(default = "default_min_callers")]
    pub min_callers: u32,
    /// The failures that open the breaker all fall within this window.
    #[serde(
        default = "default_failure_window",
        deserialize_with = "de_duration",
        rename = "failure_window"
    )]
    pub failure_window_ms: u64,
    #[serde(
        default = "default_cooldown",
        deserialize_with = "de_duration",
        rename = "cooldown"
    )]
    pub cooldown_ms: u64,
    /// Each reopening multiplies the cooldown by this.
    #[serde(default = "default_backoff")]
    pub backoff: u32,
    #[serde(
        default = "default_max_cooldown",
        deserialize_with = "de_duration",
        rename = "max_cooldown"
    )]
    pub max_cooldown_ms: u64,
    /// Added at random to an upstream's `Retry-After` pause.
    #[serde(
        default = "default_jitter",
        deserialize_with = "de_duration",
        rename = "pause_jitter"
    )]
    pub pause_jitter_ms: u64,
    /// The longest pause an upstream's `Retry-After` can cause (before
    /// jitter); `0s` ignores `Retry-After`.
    #[serde(
        default = "default_max_pause",
        deserialize_with = "de_duration",
        rename = "max_pause"
    )]
    pub max_pause_ms: u64,
    /// The pause a 429 without `Retry-After` causes (capped and jittered
    /// as any pause); `0s`: it pauses nothing.
    #[serde(
        default = "default_pause_without_retry_after",
        deserialize_with = "de_duration",
        rename = "pause_without_retry_after"
    )]
    pub pause_without_retry_after_ms: u64,
    /// Whose credential the upstream sees, for every model that does not
    /// say: `pass_through` (the client's own `Authorization`/`x-api-key`:
    /// a 429 pauses that credential only) or `injected` (Envoy's, one for
    /// everyone: a 429 pauses the route).
    #[serde(default)]
    pub credentials: Credentials,
    /// The request headers that carry a pass-through credential.
    #[serde(default = "default_credential_headers")]
    pub credential_headers: Vec<String>,
    /// Shared-data slots holding per-credential pauses (the bound on their
    /// key set).
    #[serde(default = "default_credential_slots")]
    pub credential_slots: u32,
    /// Breaker slots shared by models the policy does not list, placed by a
    /// hash of the name (unlisted models in one slot share a breaker and a
    /// pause); `1` puts every unlisted model behind one breaker.
    #[serde(default = "default_unlisted_slots")]
    pub unlisted_slots: u32,
}

impl Default for ProtectionConfig {
    fn default() -> Self {
        ProtectionConfig {
            failures_to_open: default_failures(),
            min_callers: default_min_callers(),
            failure_window_ms: default_failure_window(),
            cooldown_ms: default_cooldown(),
            backoff: default_backoff(),
            max_cooldown_ms: default_max_cooldown(),
            pause_jitter_ms: default_jitter(),
            max_pause_ms: default_max_pause(),
            pause_without_retry_after_ms: default_pause_without_retry_after(),
            credentials: Credentials::default(),
            credential_headers: default_credential_headers(),
            credential_slots: default_credential_slots(),
            unlisted_slots: default_unlisted_slots(),
        }
    }
}

fn default_failures() -> u32 {
    3
}
fn default_min_callers() -> u32 {
    2
}
fn default_failure_window() -> u64 {
    60_000
}
fn default_cooldown() -> u64 {
    60_000
}
fn default_backoff() -> u32 {
    2
}
fn default_max_cooldown() -> u64 {
    600_000
}
fn default_jitter() -> u64 {
    1_000
}
fn default_max_pause() -> u64 {
    300_000
}
fn default_pause_without_retry_after() -> u64 {
    1_000
}
fn default_credential_headers() -> Vec<String> {
    vec!["authorization".into(), "x-api-key".into()]
}
fn default_credential_slots() -> u32 {
    4096
}
fn default_unlisted_slots() -> u32 {
    64
}

/// Counts and windows are positive, slot counts bounded, and credential
/// headers lower-case names.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    let pr = &p.protection;
    if pr.failures_to_open == 0 || pr.backoff == 0 {
        return Err(ConfigError::at(
            "protection",
            "failures_to_open and backoff must be at least 1",
        ));
    }
    if pr.min_callers == 0 || pr.min_callers as usize > MAX_CALLERS {
        return Err(ConfigError::at(
            "protection.min_callers",
            format!("must be between 1 and {MAX_CALLERS}"),
        ));
    }
    if pr.failure_window_ms == 0 {
        return Err(ConfigError::at(
            "protection.failure_window",
            "must be longer than 0s",
        ));
    }
    if pr.credential_slots == 0 || pr.credential_slots > 1 << 16 {
        return Err(ConfigError::at(
            "protection.credential_slots",
            "must be between 1 and 65536",
        ));
    }
    if pr.unlisted_slots == 0 || pr.unlisted_slots > 4096 {
        return Err(ConfigError::at(
            "protection.unlisted_slots",
            "must be between 1 and 4096",
        ));
    }
    if let Some(i) = pr.credential_headers.iter().position(|h| {
        h.is_empty() || h.starts_with(':') || h.chars().any(|c| c.is_ascii_uppercase())
    }) {
        return Err(ConfigError::at(
            format!("protection.credential_headers[{i}]"),
            "must be a lower-case header name",
        ));
    }
    Ok(())
}

/// Whose credential an upstream sees (`protection.credentials`, per model
/// `models.<name>.credentials`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Credentials {
    /// The client's own `Authorization`/`x-api-key` goes upstream: a 429 is
    /// about that credential.
    #[default]
    PassThrough,
    /// Envoy injects one credential for everyone: a 429 is about the route.
    Injected,
}

/// Distinct failing callers one route record remembers; the most
/// `protection.min_callers` may ask for.
pub const MAX_CALLERS: usize = 8;
