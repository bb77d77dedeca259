//! What the monitor last saw, for `/metrics` and the status page. The
//! monitor replaces the snapshot after every round; counters that other
//! tasks bump are atomics beside it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

use crate::breaker::{Metric, View};
use crate::sources::GpuReading;

#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// `nvml`, `simulated`, or none.
    pub gpu_source: Option<&'static str>,
    /// NVML was loaded.
    pub nvml_available: bool,
    /// The last good GPU read (empty when the last read failed).
    pub gpus: Vec<GpuReading>,
    pub gpu_error: Option<String>,
    pub backends: Vec<BackendStatus>,
    /// Every scope, closed ones too.
    pub breakers: Vec<View>,
    /// Failed reads by source (`gpu`, or a backend's name).
    pub scrape_errors: BTreeMap<String, u64>,
    /// Transitions by scope and new state.
    pub transitions: BTreeMap<(String, &'static str), u64>,
    pub last_round: Option<SystemTime>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BackendStatus {
    pub name: String,
    pub kind: &'static str,
    pub up: bool,
    /// The last good poll's samples.
    pub samples: Vec<(Metric, f64)>,
    pub models: Vec<String>,
    pub error: Option<String>,
}

impl BackendStatus {
    pub fn value(&self, m: Metric) -> Option<f64> {
        self.samples.iter().find(|(k, _)| *k == m).map(|(_, v)| *v)
    }
}

#[derive(Debug, Default)]
pub struct Telemetry {
    snapshot: Mutex<Snapshot>,
    /// Long polls being held now.
    pub subscribers: AtomicI64,
    pub alerts_sent: AtomicU64,
    pub alerts_failed: AtomicU64,
    /// Changes not sent because they came within the flap window.
    pub alerts_suppressed: AtomicU64,
    /// Events dropped because the alert queue was full.
    pub alerts_dropped: AtomicU64,
}

impl Telemetry {
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn replace(&self, s: Snapshot) {
        *self.snapshot.lock().unwrap_or_else(PoisonError::into_inner) = s;
    }

    pub fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Counts a held long poll for as long as it lives.
pub struct Subscriber<'a>(&'a AtomicI64);

impl<'a> Subscriber<'a> {
    pub fn enter(gauge: &'a AtomicI64) -> Self {
        gauge.fetch_add(1, Ordering::Relaxed);
        Subscriber(gauge)
    }
}

impl Drop for Subscriber<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
