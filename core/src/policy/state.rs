//! `state`: the bounds of the shared-data key set and of contention.

use serde::Deserialize;

use crate::policy::{de_duration, ConfigError, Policy};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    /// Shared-data slots (records) per per-caller scope (a tier's per-caller
    /// limits, all in one record): the bound on the key set.
    #[serde(default = "default_slots")]
    pub principal_slots: u32,
    /// Compare-and-swap attempts on one bucket before the request is refused.
    #[serde(default = "default_cas_retries")]
    pub cas_max_retries: u32,
    /// Cells per row of the count-min sketch that remembers what callers
    /// without a slot were charged against a daily/monthly budget.
    #[serde(default = "default_sketch_width")]
    pub sketch_width: u32,
    /// A budget slot untouched this long may go to another caller (its
    /// charges stay in the sketch); touched more recently, it is active and
    /// never taken.
    #[serde(
        default = "default_slot_hold",
        deserialize_with = "de_duration",
        rename = "slot_hold"
    )]
    pub slot_hold_ms: u64,
    /// Worker-local leases (`crate::limits::lease`): off unless enabled.
    #[serde(default)]
    pub worker_leases: WorkerLeases,
}

/// `state.worker_leases`: each Envoy worker admits from small leases taken
/// from the shared buckets, in its own memory, and turns strict near the
/// end of a bucket (see `crate::limits::lease`).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkerLeases {
    #[serde(default)]
    pub enabled: bool,
    /// Envoy's `--concurrency`: a lease is at most what is left ÷ (2 ×
    /// workers), so the workers together never hold more than about
    /// 40 % of what is left.
    #[serde(default = "default_lease_workers")]
    pub workers: u32,
    /// A lease is at most this share of the bucket's capacity, in
    /// thousandths: what one worker may strand.
    #[serde(default = "default_lease_max_permille")]
    pub max_permille: u32,
    /// A lease is given back this long after it was taken, at the latest
    /// (and at the end of its calendar window).
    #[serde(
        default = "default_lease_ttl",
        deserialize_with = "de_duration",
        rename = "ttl"
    )]
    pub ttl_ms: u64,
}

impl Default for WorkerLeases {
    fn default() -> Self {
        WorkerLeases {
            enabled: false,
            workers: default_lease_workers(),
            max_permille: default_lease_max_permille(),
            ttl_ms: default_lease_ttl(),
        }
    }
}

fn default_lease_workers() -> u32 {
    4
}
fn default_lease_max_permille() -> u32 {
    50
}
fn default_lease_ttl() -> u64 {
    1_000
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            principal_slots: default_slots(),
            cas_max_retries: default_cas_retries(),
            sketch_width: default_sketch_width(),
            slot_hold_ms: default_slot_hold(),
            worker_leases: WorkerLeases::default(),
        }
    }
}

fn default_sketch_width() -> u32 {
    2048
}
fn default_slot_hold() -> u64 {
    60_000
}

fn default_slots() -> u32 {
    4096
}
fn default_cas_retries() -> u32 {
    64
}

/// The key set and the sketch are bounded, a slot is held long enough to
/// matter, and a contended bucket is retried at least once.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    let s = &p.state;
    if s.principal_slots == 0 || s.principal_slots > 1 << 20 {
        return Err(ConfigError::at(
            "state.principal_slots",
            "must be between 1 and 1048576",
        ));
    }
    if !(64..=1 << 20).contains(&s.sketch_width) {
        return Err(ConfigError::at(
            "state.sketch_width",
            "must be between 64 and 1048576",
        ));
    }
    if s.slot_hold_ms < 1_000 {
        return Err(ConfigError::at("state.slot_hold", "must be at least 1s"));
    }
    if s.cas_max_retries == 0 {
        return Err(ConfigError::at(
            "state.cas_max_retries",
            "must be at least 1",
        ));
    }
    let w = &s.worker_leases;
    if !(1..=1024).contains(&w.workers) {
        return Err(ConfigError::at(
            "state.worker_leases.workers",
            "must be between 1 and 1024",
        ));
    }
    if !(1..=500).contains(&w.max_permille) {
        return Err(ConfigError::at(
            "state.worker_leases.max_permille",
            "must be between 1 and 500",
        ));
    }
    if !(10..=60_000).contains(&w.ttl_ms) {
        return Err(ConfigError::at(
            "state.worker_leases.ttl",
            "must be between 10ms and 60s",
        ));
    }
    Ok(())
}
