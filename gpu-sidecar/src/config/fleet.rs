//! `fleet:`: Redis, for the fleet agent (see [`crate::fleet`]); what it
//! names outside the file (policy, secret, password, CA) is read by
//! [`FleetConfig::load`](crate::fleet), where the client is made.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::field::duration;

/// The sidecar's `fleet:` section.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// `redis://host:port[/db]`, or `rediss://` for TLS (rustls). A
    /// password is never taken from the URL: see `password_file`.
    pub redis: String,
    /// Per Redis command, connection included.
    #[serde(deserialize_with = "duration")]
    pub timeout: Duration,
    /// How often the fleet-wide kill switch and the fingerprints are
    /// compared with Redis.
    #[serde(deserialize_with = "duration")]
    pub sync_interval: Duration,
    /// The policy the Envoy beside this sidecar loads: a policy file or the
    /// Envoy config embedding it (required). Limits, kinds, windows, the
    /// salt and the replicas come from here, never from the filter's calls.
    pub policy: Option<PathBuf>,
    /// File holding the secret shared with the Envoy beside this sidecar
    /// (at least 16 bytes); else the environment variable `secret_env`.
    pub secret_file: Option<PathBuf>,
    pub secret_env: String,
    /// Redis' password (AUTH), from a file or an environment variable.
    pub password_file: Option<PathBuf>,
    pub password_env: Option<String>,
    /// PEM file of the CA that signed Redis' certificate (`rediss://`);
    /// default: the system's roots.
    pub tls_ca_file: Option<PathBuf>,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            redis: "redis://127.0.0.1:6379".into(),
            timeout: Duration::from_millis(250),
            sync_interval: Duration::from_millis(100),
            policy: None,
            secret_file: None,
            secret_env: sluice_wire::fleet::DEFAULT_SECRET_ENV.into(),
            password_file: None,
            password_env: None,
            tls_ca_file: None,
        }
    }
}
