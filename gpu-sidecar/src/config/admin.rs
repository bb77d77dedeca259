//! `admin:`, `long_poll:`, `connections:` and `allowed_hosts:`: who may
//! call the API, and how much of the sidecar a caller may hold.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::field::{duration, invalid, ConfigError};

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

/// The listener's bounds (see [`crate::listen`]): open connections, and
/// how long and how large a request's head may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionsConfig {
    /// Open connections, all clients together.
    pub max: usize,
    /// Of `max`, the connections only loopback clients (the co-located
    /// Envoy) may hold: remote clients get at most `max - reserved`.
    pub reserved: usize,
    /// A request's head must arrive whole within this; else the
    /// connection is closed.
    #[serde(deserialize_with = "duration")]
    pub header_timeout: Duration,
    /// A longer head (first line and headers) is answered 431 and the
    /// connection closed.
    pub max_header_bytes: usize,
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        // The co-located Envoy holds one long poll per worker and one
        // connection per callout in flight (fleet, cache): hundreds at
        // most. Its heads are under 2 KiB.
        ConnectionsConfig {
            max: 1024,
            reserved: 256,
            header_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
        }
    }
}

impl ConnectionsConfig {
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.max == 0 || self.max > 1_000_000 {
            return Err(invalid(
                "connections.max",
                format!("{} is not between 1 and 1000000", self.max),
            ));
        }
        if self.reserved >= self.max {
            return Err(invalid(
                "connections.reserved",
                format!(
                    "{} leaves no connection for remote clients: it must be below max {}",
                    self.reserved, self.max
                ),
            ));
        }
        if self.header_timeout < Duration::from_millis(100)
            || self.header_timeout > Duration::from_secs(300)
        {
            return Err(invalid(
                "connections.header_timeout",
                format!(
                    "{} is not between 100ms and 5m",
                    humantime::format_duration(self.header_timeout)
                ),
            ));
        }
        if !(1024..=1024 * 1024).contains(&self.max_header_bytes) {
            return Err(invalid(
                "connections.max_header_bytes",
                format!("{} is not between 1024 and 1048576", self.max_header_bytes),
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
