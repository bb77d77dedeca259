//! The policy's `fleet:` section and its checks. That `fleet.local` names
//! buckets the policy makes is checked where the buckets are compiled
//! (`admission::Engine::compile`), against the compiled ids.

use serde::Deserialize;

use crate::policy::{ConfigError, Policy};

/// The fleet secret's shortest length and default variable: shared with
/// the sidecar, so defined in `sluice-wire`.
pub use sluice_wire::fleet::{DEFAULT_SECRET_ENV, MIN_SECRET};

/// The policy's `fleet:` section.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// The sidecar's Envoy cluster; default: `sidecar.cluster`.
    pub cluster: Option<String>,
    /// `:authority` of the calls; default: the sidecar's (`sidecar.authority`),
    /// else `localhost`.
    pub authority: Option<String>,
    /// How many Envoys share the limits: the fair share of a lease and the
    /// `local_share` divisor.
    #[serde(default = "one")]
    pub expected_replicas: u64,
    #[serde(default)]
    pub lease: LeaseConfig,
    /// Longest a request waits for the sidecar.
    #[serde(
        default = "default_timeout",
        deserialize_with = "crate::policy::de_duration",
        rename = "timeout"
    )]
    pub timeout_ms: u64,
    #[serde(default)]
    pub on_unavailable: OnUnavailable,
    /// Bucket ids that stay per Envoy (`scope: local`), e.g.
    /// `tier/free/requests`, `model/llama3/tokens`, `route/chat/requests`.
    #[serde(default)]
    pub local: Vec<String>,
    /// Mixed into every Redis key name, so that someone who can read Redis
    /// cannot test a known address or subject against the names. The same
    /// secret on every Envoy of the fleet (else their keys differ).
    /// Required (at least [`MIN_SECRET`] bytes): an empty salt makes key
    /// names computable from an address or subject.
    #[serde(default)]
    pub salt: String,
    /// The environment variable holding the secret this Envoy and its
    /// sidecar share (at least [`MIN_SECRET`] bytes), sent on every fleet
    /// call. Envoy hands it to the wasm VM through the filter's
    /// `vm_config.environment_variables` (`host_env_keys` or
    /// `key_values`): the policy never holds it.
    #[serde(default = "default_secret_env")]
    pub secret_env: String,
}

fn default_secret_env() -> String {
    DEFAULT_SECRET_ENV.to_string()
}

fn one() -> u64 {
    1
}
fn default_timeout() -> u64 {
    1_000
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LeaseConfig {
    /// A lease unused this long is given back.
    #[serde(
        default = "default_idle",
        deserialize_with = "crate::policy::de_duration",
        rename = "idle"
    )]
    pub idle_ms: u64,
    /// A lease serves at most this long after its last grant: what an Envoy
    /// cut off from its sidecar may still admit.
    #[serde(
        default = "default_ttl",
        deserialize_with = "crate::policy::de_duration",
        rename = "ttl"
    )]
    pub ttl_ms: u64,
    /// Lease slots per per-caller bucket (bounded shared data); callers
    /// who find none free take the strict path.
    #[serde(default = "default_slots")]
    pub slots: u32,
    /// First lease asked for, beyond the request's own need, in requests'
    /// worth (`initial × need`).
    #[serde(default = "default_initial")]
    pub initial: u64,
    /// Most units a lease holds beyond the request that takes it: bounds
    /// what one Envoy can strand. 0: every bucket strict (one Redis round
    /// trip per request, nothing held). Default: no bound but the fair
    /// share.
    #[serde(default)]
    pub max: Option<u64>,
}

fn default_idle() -> u64 {
    2_000
}
fn default_ttl() -> u64 {
    30_000
}
fn default_slots() -> u32 {
    64
}
fn default_initial() -> u64 {
    4
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            idle_ms: default_idle(),
            ttl_ms: default_ttl(),
            slots: default_slots(),
            initial: default_initial(),
            max: None,
        }
    }
}

/// What a bucket does while the fleet cannot be asked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unavailable {
    /// `limit ÷ expected_replicas`, enforced here exactly: a rate on a
    /// local stand-in bucket, a budget on this Envoy's own count of the
    /// window (what it admitted before the fleet went away included).
    #[default]
    LocalShare,
    FailClosed,
    FailOpen,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnUnavailable {
    /// Rate buckets (requests, tokens per minute …).
    #[serde(default)]
    pub requests: Unavailable,
    /// Daily and monthly budgets.
    #[serde(default)]
    pub budgets: Unavailable,
    /// Hard budgets of a window in which Redis lost its data (the sidecar
    /// answers `fleet_data_lost`): what the fleet admitted before the loss
    /// is unknown, so only refusing cannot overshoot (the default). Its
    /// `local_share` counts what this Envoy admitted in the window, before
    /// the loss too, against `limit ÷ expected_replicas`.
    #[serde(default = "fail_closed")]
    pub data_lost: Unavailable,
}

fn fail_closed() -> Unavailable {
    Unavailable::FailClosed
}

impl Default for OnUnavailable {
    fn default() -> Self {
        OnUnavailable {
            requests: Unavailable::default(),
            budgets: Unavailable::default(),
            data_lost: fail_closed(),
        }
    }
}

/// The fleet has a sidecar to be its agent, bounded counts and windows, a
/// salt and a secret's variable name.
pub(crate) fn check(policy: &Policy) -> Result<(), ConfigError> {
    match &policy.fleet {
        Some(fleet) => fleet.check(policy),
        None => Ok(()),
    }
}

impl FleetConfig {
    fn check(&self, policy: &Policy) -> Result<(), ConfigError> {
        if self.cluster.is_none() && policy.sidecar.is_none() {
            return Err(ConfigError::at(
                "fleet.cluster",
                "no cluster given and no `sidecar` section to take it from",
            ));
        }
        if policy.sidecar.is_none() {
            return Err(ConfigError::at(
                "fleet",
                "needs a `sidecar` section: the sidecar is the fleet agent",
            ));
        }
        if !(1..=10_000).contains(&self.expected_replicas) {
            return Err(ConfigError::at(
                "fleet.expected_replicas",
                "must be 1 to 10000",
            ));
        }
        if !(1..=4096).contains(&self.lease.slots) {
            return Err(ConfigError::at("fleet.lease.slots", "must be 1 to 4096"));
        }
        if self.lease.ttl_ms == 0 || self.lease.idle_ms == 0 {
            return Err(ConfigError::at(
                "fleet.lease",
                "idle and ttl must be above 0",
            ));
        }
        if self.timeout_ms == 0 || self.timeout_ms > 60_000 {
            return Err(ConfigError::at(
                "fleet.timeout",
                "must be above 0 and at most 60s",
            ));
        }
        if self.salt.len() < MIN_SECRET {
            return Err(ConfigError::at("fleet.salt", format!(
                    "required: at least {MIN_SECRET} bytes, the same on every Envoy of the fleet \
                     (it names the Redis keys; empty, they are computable from an address or subject)"
                ),
            ));
        }
        if self.secret_env.is_empty()
            || !self
                .secret_env
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(ConfigError::at(
                "fleet.secret_env",
                "an environment variable name (letters, digits, `_`)",
            ));
        }
        Ok(())
    }
}
