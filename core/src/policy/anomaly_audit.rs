//! `anomaly` and `audit`: what sluice watches and writes about traffic.

use serde::Deserialize;

use crate::policy::{de_number, Budget, ConfigError, Policy};

/// Consumption across all callers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnomalyConfig {
    /// Tokens this minute above this multiple of the trailing average count
    /// as a surge (`sluice_usage_surge_total`).
    #[serde(default = "default_surge_ratio", deserialize_with = "de_number")]
    pub surge_ratio: f64,
    /// Minutes the trailing average looks back over.
    #[serde(default = "default_baseline_minutes")]
    pub baseline_minutes: u32,
    /// Spend in the last hour (model prices' currency) at which the global
    /// breaker refuses new requests (503 `global_breaker_open`) until the
    /// hour slides under it again (or the ceiling is raised).
    pub max_spend_per_hour: Option<Budget>,
}

fn default_surge_ratio() -> f64 {
    1.5
}
fn default_baseline_minutes() -> u32 {
    15
}

/// The per-request audit record Envoy's access log reads from filter state
/// (`%FILTER_STATE(wasm.sluice_audit:PLAIN)%`, one value: `flow/audit.rs`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    /// Mixed into the principal's hash so the log cannot be joined with
    /// other data by hashing known addresses or keys. Set your own.
    #[serde(default)]
    pub salt: String,
    /// Also record the SHA-256 of the request and response bodies.
    #[serde(default)]
    pub hash_bodies: bool,
}

/// A surge is above the average, measured over at most the last hour.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    if let Some(a) = &p.anomaly {
        if a.surge_ratio.is_nan()
            || a.surge_ratio <= 1.0
            || a.baseline_minutes == 0
            || a.baseline_minutes > 59
        {
            return Err(ConfigError::at(
                "anomaly",
                "surge_ratio must be above 1 and baseline_minutes between 1 and 59",
            ));
        }
    }
    Ok(())
}
