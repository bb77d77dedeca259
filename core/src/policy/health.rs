//! What `sidecar.on_stale` and `protection.credentials` say, and how many
//! failing callers a route record may be asked to count.

use serde::Deserialize;

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
