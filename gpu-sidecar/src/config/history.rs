//! `history:`: what the operator page keeps (see [`crate::watch::history`]).

use std::time::Duration;

use serde::Deserialize;

use super::field::{duration, invalid, ConfigError};

/// Points kept per GPU, whatever window ÷ sample_every says.
pub const MAX_POINTS: usize = 4096;
/// Timeline entries kept at most.
pub const MAX_EVENTS: usize = 10_000;
/// `history:` in the sidecar config.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HistoryConfig {
    /// One chart point per this long (the worst reading of the period).
    #[serde(deserialize_with = "duration")]
    pub sample_every: Duration,
    /// How far back the charts go.
    #[serde(deserialize_with = "duration")]
    pub window: Duration,
    /// Timeline entries kept (breaker transitions and kill switch changes).
    pub events: usize,
}

impl Default for HistoryConfig {
    fn default() -> Self {
        HistoryConfig {
            sample_every: Duration::from_secs(5),
            window: Duration::from_secs(15 * 60),
            events: 200,
        }
    }
}

impl HistoryConfig {
    /// Points per GPU this config keeps.
    pub fn points(&self) -> usize {
        let every = self.sample_every.as_millis().max(1);
        usize::try_from(self.window.as_millis().div_ceil(every)).unwrap_or(usize::MAX)
    }

    /// `Err(invalid(field, message))`.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.sample_every < Duration::from_millis(10) {
            return Err(invalid("history.sample_every", "must be at least 10ms"));
        }
        if self.window < self.sample_every {
            return Err(invalid(
                "history.window",
                "must be at least history.sample_every",
            ));
        }
        if self.points() > MAX_POINTS {
            return Err(invalid(
                "history.window",
                format!(
                    "{} ÷ sample_every {} is {} points per GPU; at most {MAX_POINTS} are kept",
                    humantime::format_duration(self.window),
                    humantime::format_duration(self.sample_every),
                    self.points()
                ),
            ));
        }
        if self.events == 0 || self.events > MAX_EVENTS {
            return Err(invalid(
                "history.events",
                format!("{} is not between 1 and {MAX_EVENTS}", self.events),
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
        assert!(HistoryConfig::default().check().is_ok());
        assert_eq!(HistoryConfig::default().points(), 180);
        let bad = |c: HistoryConfig| c.check().unwrap_err().path().to_string();
        let d = HistoryConfig::default;
        assert_eq!(
            bad(HistoryConfig {
                sample_every: Duration::ZERO,
                ..d()
            }),
            "history.sample_every"
        );
        assert_eq!(
            bad(HistoryConfig {
                sample_every: Duration::from_millis(10),
                window: Duration::from_secs(3600),
                ..d()
            }),
            "history.window"
        );
        assert_eq!(bad(HistoryConfig { events: 0, ..d() }), "history.events");
    }
}
