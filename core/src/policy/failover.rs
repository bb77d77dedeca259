//! `failover`: a request whose rung fails before its answer starts is
//! sent again, down the same ladder (see `flow/failover.rs`).

use serde::Deserialize;

use crate::policy::{de_duration, ConfigError, Policy};

/// The statuses that send a request down the ladder unless the policy
/// says otherwise: pushback and the upstream's own failures. A 4xx other
/// than 429 is the caller's own error (a content filter, a bad field):
/// another rung would refuse it too.
pub const DEFAULT_ON: [u32; 5] = [429, 500, 502, 503, 504];

/// The most rungs one request may be sent to, the first included.
pub const MAX_ATTEMPTS: u32 = 8;

/// How a failed attempt is sent on (docs/src/gpu-health.md, "When a
/// provider fails").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailoverConfig {
    /// The rungs one request may be sent to, the first included (`1`
    /// turns failover off).
    #[serde(default = "default_attempts")]
    pub attempts: u32,
    /// From the request's arrival: no attempt starts after it, and an
    /// attempt's answer is awaited at most until then.
    #[serde(
        default = "default_deadline",
        deserialize_with = "de_duration",
        rename = "deadline"
    )]
    pub deadline_ms: u64,
    /// The upstream statuses that fail over. Envoy's own answers for an
    /// upstream that never answered (connect failure, reset, timeout)
    /// always do.
    #[serde(default = "default_on")]
    pub on: Vec<u32>,
    /// Attempts after the first, per second, for the whole Envoy (every
    /// worker): past it a failure reaches the caller as it came, so a
    /// failing provider never doubles the traffic sluice sends.
    #[serde(default = "default_per_second")]
    pub per_second: u32,
    /// The Envoy cluster that leads back into this listener: an attempt
    /// goes through Envoy's routes (the rung's credentials, retries and
    /// timeouts), marked so sluice lets it pass unadmitted.
    #[serde(default = "default_cluster")]
    pub cluster: String,
}

impl Default for FailoverConfig {
    fn default() -> Self {
        FailoverConfig {
            attempts: default_attempts(),
            deadline_ms: default_deadline(),
            on: default_on(),
            per_second: default_per_second(),
            cluster: default_cluster(),
        }
    }
}

impl FailoverConfig {
    /// Does an answer of `status` fail over? `local`: Envoy answered it
    /// itself (no upstream answer: connect failure, reset, timeout).
    pub fn fails_over(&self, status: u32, local: bool) -> bool {
        (local && status >= 500) || status == 0 || self.on.contains(&status)
    }
}

fn default_attempts() -> u32 {
    3
}
fn default_deadline() -> u64 {
    120_000
}
fn default_on() -> Vec<u32> {
    DEFAULT_ON.to_vec()
}
fn default_per_second() -> u32 {
    50
}
fn default_cluster() -> String {
    "sluice_self".into()
}

/// Attempts bounded, statuses errors, a cluster named.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    let Some(f) = &p.failover else {
        return Ok(());
    };
    if f.attempts == 0 || f.attempts > MAX_ATTEMPTS {
        return Err(ConfigError::at(
            "failover.attempts",
            format!("must be between 1 and {MAX_ATTEMPTS}"),
        ));
    }
    if f.deadline_ms == 0 {
        return Err(ConfigError::at(
            "failover.deadline",
            "must be longer than 0s",
        ));
    }
    if let Some(i) = f.on.iter().position(|s| !(400..=599).contains(s)) {
        return Err(ConfigError::at(
            format!("failover.on[{i}]"),
            "must be an error status (400 to 599)",
        ));
    }
    if f.cluster.is_empty() {
        return Err(ConfigError::at(
            "failover.cluster",
            "must name the cluster that leads back into this listener",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(failover: serde_json::Value) -> Result<Policy, ConfigError> {
        Policy::from_value(json!({
            "default_tier": "t", "tiers": {"t": {}}, "failover": failover,
        }))
    }

    #[test]
    fn defaults_and_bad_values_name_the_field() {
        let f = policy(json!({})).unwrap().failover.unwrap();
        assert_eq!((f.attempts, f.deadline_ms, f.per_second), (3, 120_000, 50));
        assert_eq!(f.cluster, "sluice_self");
        assert!(f.fails_over(503, false) && f.fails_over(429, false));
        assert!(f.fails_over(0, false) && f.fails_over(504, true));
        assert!(!f.fails_over(400, false) && !f.fails_over(404, true));
        for (field, value) in [
            ("attempts", json!(0)),
            ("attempts", json!(9)),
            ("deadline", json!("0s")),
            ("on", json!([200])),
            ("cluster", json!("")),
        ] {
            let err = policy(json!({ field: value })).unwrap_err();
            assert!(err.path.starts_with(&format!("failover.{field}")), "{err}");
        }
    }
}
