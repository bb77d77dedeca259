//! `sidecar`: where the GPU sidecar is and how long its word counts.

use serde::Deserialize;

use crate::policy::{de_duration, ConfigError, Policy};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarConfig {
    /// The Envoy cluster of the sidecar.
    pub cluster: String,
    /// `:authority` of the poll; default: the cluster name.
    pub authority: Option<String>,
    /// How long the sidecar may hold a long poll.
    #[serde(
        default = "default_poll_wait",
        deserialize_with = "de_duration",
        rename = "poll_wait"
    )]
    pub poll_wait_ms: u64,
    /// How long the last state counts when the sidecar is unreachable.
    #[serde(
        default = "default_stale_after",
        deserialize_with = "de_duration",
        rename = "stale_after"
    )]
    pub stale_after_ms: u64,
    #[serde(default)]
    pub on_stale: OnStale,
    /// `Retry-After` of a `gpu_overloaded` 503 when the sidecar gives none.
    #[serde(
        default = "default_breaker_retry",
        deserialize_with = "de_duration",
        rename = "retry_after"
    )]
    pub retry_after_ms: u64,
}

fn default_poll_wait() -> u64 {
    30_000
}
fn default_stale_after() -> u64 {
    60_000
}
fn default_breaker_retry() -> u64 {
    30_000
}

/// The sidecar names a cluster and is not called stale while healthy.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    let Some(sc) = &p.sidecar else { return Ok(()) };
    if sc.cluster.trim().is_empty() {
        return Err(ConfigError::at(
            "sidecar.cluster",
            "must name an Envoy cluster",
        ));
    }
    // A quiet sidecar answers a poll once a second at the most:
    // a shorter window would call a healthy sidecar stale.
    if sc.stale_after_ms < 2_000 {
        return Err(ConfigError::at(
            "sidecar.stale_after",
            "must be at least 2s (the long poll is held up to half of it, 1s at least)",
        ));
    }
    Ok(())
}

/// What the sidecar's silence means once its last state is older than
/// `stale_after`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStale {
    /// Ignore the breakers (a breaker that blocks on no data takes the
    /// service down with the sidecar). The kill switch keeps its last value:
    /// it is an operator's decision, not a measurement.
    #[default]
    FailOpen,
    /// Keep refusing what the last state refused.
    FailClosed,
}
