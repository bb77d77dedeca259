//! `admin:`, `long_poll:` and `allowed_hosts:`: who may call the API.

use std::path::PathBuf;

use serde::Deserialize;

use super::field::{invalid, ConfigError};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// File holding the bearer token for `POST /v1/kill-switch`; else the
    /// `SLUICE_ADMIN_TOKEN` environment variable.
    pub token_file: Option<PathBuf>,
    /// Accept admin calls from non-loopback clients.
    pub allow_remote: bool,
}

/// Held long polls cost a connection, a task and buffers each: they are
/// capped, and past the cap a poll is answered 503 at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LongPollConfig {
    /// Held polls, all callers together.
    pub max_held: usize,
    /// Of `max_held`, the slots only loopback callers (the co-located
    /// Envoy) and callers with the admin token may take: remote pollers
    /// cannot starve the filter's own poll.
    pub reserved: usize,
}

impl Default for LongPollConfig {
    fn default() -> Self {
        LongPollConfig {
            max_held: 256,
            reserved: 16,
        }
    }
}

impl LongPollConfig {
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.max_held == 0 || self.max_held > 1_000_000 {
            return Err(invalid(
                "long_poll.max_held",
                format!("{} is not between 1 and 1000000", self.max_held),
            ));
        }
        if self.reserved >= self.max_held {
            return Err(invalid(
                "long_poll.reserved",
                format!(
                    "{} leaves no slot for other pollers: it must be below max_held {}",
                    self.reserved, self.max_held
                ),
            ));
        }
        Ok(())
    }
}

/// `allowed_hosts`, checked by compiling them as the door does.
pub fn check_allowed_hosts(hosts: &[String]) -> Result<(), ConfigError> {
    crate::door::AllowedHosts::with(hosts)
        .map(|_| ())
        .map_err(|(i, m)| invalid(format!("allowed_hosts[{i}]"), m))
}
