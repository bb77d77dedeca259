//! The state the sidecar publishes to the filter: kill switch and breakers,
//! versioned so the filter's long poll can ask "anything newer than N?".
//!
//! One [`StateStore`] owns it in a `tokio::sync::watch` channel: writers go
//! through [`StateStore::update`], which bumps the version only on a real
//! change; readers either take the [`StateStore::current`] snapshot or wait
//! with [`StateStore::next_after`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize, Serializer};
use tokio::sync::watch;

/// What `GET /v1/state` returns.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SidecarState {
    /// +1 on every change. Starts at 1 in tests; `serve` starts it at the
    /// start time in Unix milliseconds, so a restarted sidecar never answers
    /// a version a filter already holds from the previous run.
    pub version: u64,
    /// When `version` last changed, as RFC 3339.
    #[serde(serialize_with = "rfc3339")]
    pub updated_at: SystemTime,
    pub kill_switch: KillSwitch,
    /// Breakers that are not plainly closed (open or half-open), in scope
    /// order; empty when all is healthy.
    pub breakers: Vec<Breaker>,
    /// Some scope has had no fresh data for `stale_after` (and follows the
    /// stale-data policy: by default its breaker is closed).
    pub stale: bool,
    /// Changes on every cache purge: the filter serves the entries it
    /// keeps in Envoy only while they were stored under the current one.
    /// `serve` starts it at the start time (as `version`), so a restart
    /// never brings back a generation purged before it.
    pub cache_generation: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KillSwitch {
    pub active: bool,
    pub reason: Option<String>,
    /// When it was last turned on or off; null if never.
    #[serde(with = "rfc3339_opt")]
    pub since: Option<SystemTime>,
}

/// One breaker's verdict for a scope (`backend:NAME` or `model:NAME`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Breaker {
    pub scope: String,
    pub state: BreakerState,
    /// The share of requests the filter may let through now: the configured
    /// trickle when half-open, 0 when open.
    pub half_open_fraction: f64,
    /// What refused clients are told to wait.
    pub retry_after_seconds: u64,
    pub reason: Option<String>,
    /// When it entered this state.
    #[serde(serialize_with = "rfc3339")]
    pub since: SystemTime,
    /// Opened by another sidecar of the fleet (see `fleet`), not here.
    #[serde(skip)]
    pub from_fleet: bool,
}

/// A scope's state, as the filter reads it (`closed`, `open`, `half_open`,
/// `saturated`): one enum for both, defined in `sluice-wire`.
pub use sluice_wire::state::BreakerState;

/// The scope prefix of a ladder rung's breaker (`provider:<name>`).
pub const RUNG_SCOPE: &str = "provider:";

/// The `/metrics` value: 0 closed, 1 half-open, 2 open.
pub fn gauge(state: BreakerState) -> u8 {
    match state {
        BreakerState::Closed => 0,
        BreakerState::HalfOpen => 1,
        BreakerState::Open => 2,
        // Not a breaker state: breakers never report it (see `Monitor`).
        BreakerState::Saturated => 0,
        // Never made here: only read from a newer peer.
        BreakerState::Unknown => 0,
    }
}

fn rfc3339<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_seconds(*t))
}

mod rfc3339_opt {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.collect_str(&humantime::format_rfc3339_seconds(*t)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SystemTime>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| humantime::parse_rfc3339(&text).map_err(serde::de::Error::custom))
            .transpose()
    }
}

impl SidecarState {
    /// Version 1: kill switch off, no breakers.
    pub fn initial(now: SystemTime) -> Self {
        SidecarState {
            version: 1,
            kill_switch: KillSwitch::default(),
            breakers: Vec::new(),
            updated_at: now,
            stale: false,
            cache_generation: 1,
        }
    }

    /// Equal apart from version and timestamp.
    fn same_content(&self, other: &SidecarState) -> bool {
        self.kill_switch == other.kill_switch
            && self.breakers == other.breakers
            && self.stale == other.stale
            && self.cache_generation == other.cache_generation
    }
}

/// The single owner of the published state. Cheap to clone; all clones share
/// one channel.
#[derive(Debug, Clone)]
pub struct StateStore {
    tx: Arc<watch::Sender<Arc<SidecarState>>>,
    /// Breakers other sidecars of the fleet hold open: merged into every
    /// update, under the local ones of the same scope.
    fleet_breakers: Arc<std::sync::Mutex<Vec<Breaker>>>,
    /// The ladder's rungs that are down (`provider:<name>`, see
    /// `watch::rungs`): merged into every update.
    rung_breakers: Arc<std::sync::Mutex<Vec<Breaker>>>,
}

impl StateStore {
    pub fn new(now: SystemTime) -> Self {
        StateStore::starting(SidecarState::initial(now))
    }

    /// Starts from `state` (e.g. with the kill switch read back from the
    /// state file, and a first version no earlier run can have reached).
    pub fn starting(state: SidecarState) -> Self {
        let (tx, _) = watch::channel(Arc::new(state));
        StateStore {
            tx: Arc::new(tx),
            fleet_breakers: Arc::default(),
            rung_breakers: Arc::default(),
        }
    }

    /// The state as of now.
    pub fn current(&self) -> Arc<SidecarState> {
        self.tx.borrow().clone()
    }

    /// Applies `change`. Only a real change bumps the version, stamps
    /// `updated_at` with `now` and wakes waiting pollers; returns whether it did.
    pub fn update(&self, now: SystemTime, change: impl FnOnce(&mut SidecarState)) -> bool {
        self.tx.send_if_modified(|state| {
            let mut next = SidecarState::clone(state);
            change(&mut next);
            next.breakers
                .retain(|b| !b.from_fleet && !b.scope.starts_with(RUNG_SCOPE));
            if let Ok(rungs) = self.rung_breakers.lock() {
                next.breakers.extend(rungs.iter().cloned());
            }
            if let Ok(fleet) = self.fleet_breakers.lock() {
                for b in fleet.iter() {
                    if !next.breakers.iter().any(|l| l.scope == b.scope) {
                        next.breakers.push(b.clone());
                    }
                }
            }
            if next.same_content(state) {
                return false;
            }
            next.version = state.version + 1;
            next.updated_at = now;
            *state = Arc::new(next);
            true
        })
    }

    /// The long poll: the current state at once if its version is not
    /// `since`; otherwise the next state, or the current one when `wait`
    /// passes without a change.
    /// The rungs down are now `breakers` (scopes `provider:<name>`).
    pub fn set_rung_breakers(&self, now: SystemTime, breakers: Vec<Breaker>) -> bool {
        if let Ok(mut rungs) = self.rung_breakers.lock() {
            *rungs = breakers;
        }
        self.update(now, |_| {})
    }

    /// The fleet's breakers (from other sidecars) are now `breakers`.
    pub fn set_fleet_breakers(&self, now: SystemTime, breakers: Vec<Breaker>) -> bool {
        if let Ok(mut fleet) = self.fleet_breakers.lock() {
            *fleet = breakers;
        }
        self.update(now, |_| {})
    }

    pub async fn next_after(&self, since: u64, wait: Duration) -> Arc<SidecarState> {
        let mut rx = self.tx.subscribe();
        let current = rx.borrow_and_update().clone();
        if current.version != since {
            return current;
        }
        // `changed` fails only when the sender is gone, and `self` holds it.
        let _ = tokio::time::timeout(wait, rx.changed()).await;
        let latest = rx.borrow().clone();
        latest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn starts_healthy_at_version_one() {
        let store = StateStore::new(t(0));
        let v = serde_json::to_value(&*store.current()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "version": 1,
                "kill_switch": {"active": false, "reason": null, "since": null},
                "breakers": [],
                "updated_at": "1970-01-01T00:00:00Z",
                "stale": false,
                "cache_generation": 1,
            })
        );
    }

    /// What this sidecar serves is what the filter reads (`sluice-wire`),
    /// field for field.
    #[test]
    fn the_served_state_reads_as_the_wire_message() {
        let state = SidecarState {
            version: 9,
            updated_at: t(5),
            kill_switch: KillSwitch {
                active: true,
                reason: Some("drill".into()),
                since: Some(t(4)),
            },
            breakers: vec![Breaker {
                scope: "model:m".into(),
                state: BreakerState::HalfOpen,
                half_open_fraction: 0.25,
                retry_after_seconds: 30,
                reason: Some("recovered".into()),
                since: t(3),
                from_fleet: true,
            }],
            stale: true,
            cache_generation: 77,
        };
        let text = serde_json::to_string(&state).unwrap();
        let read: sluice_wire::state::State = serde_json::from_str(&text).unwrap();
        assert_eq!(
            read,
            sluice_wire::state::State {
                version: 9,
                kill_switch: sluice_wire::state::KillSwitch {
                    active: true,
                    reason: Some("drill".into()),
                },
                breakers: vec![sluice_wire::state::Breaker {
                    scope: "model:m".into(),
                    state: BreakerState::HalfOpen,
                    half_open_fraction: 0.25,
                    retry_after_seconds: Some(30),
                    reason: Some("recovered".into()),
                }],
                stale: true,
                cache_generation: 77,
            }
        );
    }

    #[test]
    fn only_real_changes_bump_the_version() {
        let store = StateStore::new(t(0));
        assert!(!store.update(t(5), |s| s.kill_switch.active = false));
        assert_eq!(store.current().version, 1);
        assert_eq!(store.current().updated_at, t(0));
        assert!(store.update(t(7), |s| {
            s.kill_switch = KillSwitch {
                active: true,
                reason: Some("drill".into()),
                since: Some(t(7)),
            }
        }));
        let now = store.current();
        assert_eq!(now.version, 2);
        assert_eq!(now.updated_at, t(7));
        assert!(now.kill_switch.active);
    }

    #[tokio::test(start_paused = true)]
    async fn next_after_answers_at_once_for_an_old_version() {
        let store = StateStore::new(t(0));
        let start = tokio::time::Instant::now();
        assert_eq!(
            store.next_after(0, Duration::from_secs(30)).await.version,
            1
        );
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn next_after_wakes_on_change() {
        let store = StateStore::new(t(0));
        let writer = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            writer.update(t(2), |s| s.kill_switch.active = true);
        });
        let start = tokio::time::Instant::now();
        let state = store.next_after(1, Duration::from_secs(30)).await;
        assert_eq!(state.version, 2);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn next_after_times_out_with_the_current_state() {
        let store = StateStore::new(t(0));
        let start = tokio::time::Instant::now();
        assert_eq!(store.next_after(1, Duration::from_secs(5)).await.version, 1);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }
}
