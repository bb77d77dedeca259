//! The HTTP API the Envoy filter and the operators call: the routes and
//! their handlers ([`api`]), the admin token ([`admin`]), `/metrics`
//! ([`metrics`]) and the operator page ([`page`]). Imports every layer
//! below it; nothing below imports it. [`Api`], what every handler
//! shares, is here so that the routes ([`api`]) and the page ([`page`])
//! both import it and not each other.

pub mod admin;
pub mod api;
pub mod cache;
pub mod metric_table;
pub mod metrics;
pub mod page;

use std::sync::Arc;

use tokio::sync::watch;

use crate::config::LongPollConfig;
use crate::door::FailureGate;
use crate::serve::admin::AdminToken;
use crate::sources::gpu::SimHandle;
use crate::state::StateStore;
use crate::watch::history::History;
use crate::watch::kill_switch::KillSwitchControl;
use crate::watch::snapshot::Telemetry;

/// Everything the handlers share.
#[derive(Debug, Clone)]
pub struct Api {
    pub store: StateStore,
    /// Turns true when the server shuts down, releasing held polls.
    pub closing: watch::Receiver<bool>,
    pub telemetry: Arc<Telemetry>,
    pub token: AdminToken,
    /// Admin calls from other than loopback are accepted.
    pub allow_remote: bool,
    pub kill_switch: Arc<KillSwitchControl>,
    /// Set when the simulated GPU source runs.
    pub sim: Option<SimHandle>,
    pub long_poll: LongPollConfig,
    /// What the operator page draws (`/v1/history`).
    pub history: Arc<History>,
    /// Wrong admin tokens per client.
    pub failures: Arc<FailureGate>,
    /// The response cache, when this sidecar runs one (its `/metrics`).
    pub cache: Option<Arc<crate::cache::Cache>>,
    /// The Redis connection, when this sidecar is a fleet agent (in `/metrics`).
    pub redis: Option<Arc<crate::redis::Redis>>,
}
