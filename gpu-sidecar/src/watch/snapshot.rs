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
    /// Why the GPU source asked for (NVML: `sources.gpu` `auto` or `nvml`)
    /// could not be opened; none when it runs or none was asked for.
    pub gpu_missing: Option<String>,
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
    /// The most held at once since memory was last handed back.
    pub subscribers_peak: AtomicI64,
    /// Long polls answered 503 because the cap was reached, by caller
    /// class: loopback or token holders (`local`), anyone else (`remote`).
    pub polls_refused_local: AtomicU64,
    pub polls_refused_remote: AtomicU64,
    pub alerts_sent: AtomicU64,
    pub alerts_failed: AtomicU64,
    /// Changes not sent because they came within the flap window.
    pub alerts_suppressed: AtomicU64,
    /// Events dropped because the alert queue was full.
    pub alerts_dropped: AtomicU64,
    /// Refused admin tokens and `Host` names ([`crate::door`]).
    pub door: crate::door::DoorCounters,
    /// The listener's open connections and what it refused or closed
    /// ([`crate::listen`]).
    pub connections: std::sync::Arc<crate::listen::ConnectionCounters>,
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

/// A held long poll's slot, counted for as long as it lives.
pub struct Subscriber<'a>(&'a AtomicI64);

impl<'a> Subscriber<'a> {
    /// Takes a slot if fewer than `limit` are held. The count is the cap
    /// itself (one atomic), so concurrent polls cannot overshoot it.
    pub fn try_enter(tel: &'a Telemetry, limit: usize) -> Option<Self> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let before = tel
            .subscribers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()?;
        tel.subscribers_peak
            .fetch_max(before + 1, Ordering::Relaxed);
        Some(Subscriber(&tel.subscribers))
    }
}

impl Drop for Subscriber<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_holds_and_slots_come_back() {
        let tel = Telemetry::default();
        let held: Vec<_> = (0..3)
            .filter_map(|_| Subscriber::try_enter(&tel, 3))
            .collect();
        assert_eq!(held.len(), 3);
        assert!(Subscriber::try_enter(&tel, 3).is_none());
        // A larger limit (a privileged caller) still gets in.
        let extra = Subscriber::try_enter(&tel, 4);
        assert!(extra.is_some());
        assert!(Subscriber::try_enter(&tel, 4).is_none());
        drop(held);
        drop(extra);
        assert_eq!(tel.subscribers.load(Ordering::Relaxed), 0);
        assert_eq!(tel.subscribers_peak.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn concurrent_entries_never_overshoot() {
        let tel = std::sync::Arc::new(Telemetry::default());
        let taken = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let mine: Vec<_> = (0..100)
                        .filter_map(|_| Subscriber::try_enter(&tel, 50))
                        .collect();
                    taken.fetch_add(mine.len(), Ordering::Relaxed);
                    assert!(tel.subscribers.load(Ordering::Relaxed) <= 50);
                    std::mem::forget(mine);
                });
            }
        });
        assert_eq!(taken.load(Ordering::Relaxed), 50);
    }
}
