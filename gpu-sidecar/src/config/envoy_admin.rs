//! `envoy_admin:`: Envoy's admin, read for requests per tier (see
//! [`crate::watch::traffic`]) and for the health of the ladder's rungs
//! (see [`crate::watch::rungs`]).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::field::{duration, invalid, ConfigError};
use crate::http::Target;

/// The most minutes kept.
pub const MAX_MINUTES: usize = 24 * 60;
/// `envoy_admin:` in the sidecar config.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyAdminConfig {
    /// Envoy's admin address, plain HTTP (`http://127.0.0.1:9901`).
    pub url: String,
    /// How often its stats are read.
    #[serde(deserialize_with = "duration", default = "default_scrape_every")]
    pub scrape_every: Duration,
    /// Minutes kept and shown.
    #[serde(default = "default_minutes")]
    pub minutes: usize,
    /// The filter's providers (the names of its policy's `providers`) →
    /// the Envoy cluster each one's route goes to: a rung whose cluster
    /// has no host passing Envoy's health checks is reported down.
    #[serde(default)]
    pub rungs: BTreeMap<String, String>,
    /// The audit access log Envoy writes (JSON lines), read for the day's
    /// top spenders (see [`crate::watch::spenders`]); absent: not shown.
    #[serde(default)]
    pub audit_log: Option<std::path::PathBuf>,
}

/// The most rungs watched.
pub const MAX_RUNGS: usize = 32;

fn default_scrape_every() -> Duration {
    Duration::from_secs(10)
}

fn default_minutes() -> usize {
    15
}

impl EnvoyAdminConfig {
    pub fn from_url(url: &str) -> EnvoyAdminConfig {
        EnvoyAdminConfig {
            url: url.into(),
            scrape_every: default_scrape_every(),
            minutes: default_minutes(),
            rungs: BTreeMap::new(),
            audit_log: None,
        }
    }

    /// `Err(invalid(field, message))`.
    pub fn check(&self) -> Result<(), ConfigError> {
        Target::parse(&self.url).map_err(|e| invalid("envoy_admin.url", e.to_string()))?;
        if self.scrape_every < Duration::from_millis(10)
            || self.scrape_every > Duration::from_secs(60)
        {
            return Err(invalid(
                "envoy_admin.scrape_every",
                "must be between 10ms and 60s (the counts are per minute)",
            ));
        }
        if self.rungs.len() > MAX_RUNGS {
            return Err(invalid(
                "envoy_admin.rungs",
                format!("{} rungs; at most {MAX_RUNGS}", self.rungs.len()),
            ));
        }
        for (provider, cluster) in &self.rungs {
            if provider.is_empty() || cluster.is_empty() {
                return Err(invalid(
                    format!("envoy_admin.rungs.{provider}"),
                    "a provider and its Envoy cluster are both names, not empty",
                ));
            }
        }
        if self.minutes == 0 || self.minutes > MAX_MINUTES {
            return Err(invalid(
                "envoy_admin.minutes",
                format!("{} is not between 1 and {MAX_MINUTES}", self.minutes),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_checks() {
        let ok = EnvoyAdminConfig::from_url("http://127.0.0.1:9901");
        assert!(ok.check().is_ok());
        let bad = |c: EnvoyAdminConfig| c.check().unwrap_err().path().to_string();
        assert_eq!(
            bad(EnvoyAdminConfig::from_url("https://x")),
            "envoy_admin.url"
        );
        assert_eq!(
            bad(EnvoyAdminConfig {
                scrape_every: Duration::from_secs(120),
                ..ok.clone()
            }),
            "envoy_admin.scrape_every"
        );
        assert_eq!(
            bad(EnvoyAdminConfig { minutes: 0, ..ok }),
            "envoy_admin.minutes"
        );
    }
}
