//! The state loop: every scrape interval, read every source, feed each
//! scope's breaker, publish the breakers into the [`StateStore`] (which
//! wakes the filter's long poll on a real change), refresh the telemetry
//! and hand transitions to the alerts.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures_util::future::join_all;
use tokio::sync::watch;

use crate::breaker::{At, Engine, Policy, Transition, View};
use crate::config::ScopePlan;
use crate::sources::{
    gpu_samples, BackendReading, BackendSource, GpuReading, GpuSource, SourceError,
};
use crate::state::{Breaker, BreakerState, StateStore};
use crate::watch::alerts::{AlertEvent, Alerts};
use crate::watch::history::History;
use crate::watch::snapshot::{BackendStatus, Snapshot, Telemetry};

/// Where a monitor's results go.
pub struct Outputs {
    pub store: StateStore,
    pub telemetry: Arc<Telemetry>,
    pub alerts: Option<Alerts>,
    /// The operator page's rings, when it runs.
    pub history: Option<Arc<History>>,
}

pub struct Monitor {
    gpu: Option<Box<dyn GpuSource>>,
    backends: Vec<Box<dyn BackendSource>>,
    plans: Vec<ScopePlan>,
    engine: Engine,
    /// The saturation rules' own engine (same scopes and samples): its
    /// open scopes are published as `saturated` while their breaker is
    /// closed. `None`: no saturation rules.
    saturation: Option<Engine>,
    store: StateStore,
    telemetry: Arc<Telemetry>,
    alerts: Option<Alerts>,
    history: Option<Arc<History>>,
    snapshot: Snapshot,
}

/// Whether any source can feed `plan`'s scope: a backend, or the GPUs
/// when there is a GPU source and the scope takes some (see `observe`).
fn fed(plan: &ScopePlan, has_gpu_source: bool) -> bool {
    let takes_gpus = plan.gpus.as_ref().is_none_or(|sel| !sel.is_empty());
    !plan.backends.is_empty() || (has_gpu_source && takes_gpus)
}

impl Monitor {
    pub fn new(
        gpu: Option<Box<dyn GpuSource>>,
        backends: Vec<Box<dyn BackendSource>>,
        plans: Vec<ScopePlan>,
        policy: Policy,
        out: Outputs,
        start: At,
    ) -> Monitor {
        let Outputs {
            store,
            telemetry,
            alerts,
            history,
        } = out;
        let mut engine = Engine::new(
            policy,
            plans
                .iter()
                .map(|p| (p.scope.clone(), p.rules.clone()))
                .collect(),
            start,
        );
        for plan in plans.iter().filter(|p| !fed(p, gpu.is_some())) {
            eprintln!(
                "sluice-sidecar: scope {}: no source feeds it (no GPU source, no backend): \
                 its breaker stays closed and it is not reported stale",
                plan.scope
            );
            engine.unwatched(&plan.scope);
        }
        let mut snapshot = telemetry.snapshot();
        snapshot.gpu_source = gpu.as_ref().map(|g| g.kind());
        snapshot.nvml_available = gpu.as_ref().is_some_and(|g| g.kind() == "nvml");
        snapshot.backends = backends
            .iter()
            .map(|b| BackendStatus {
                name: b.name().to_string(),
                kind: b.kind(),
                up: false,
                samples: Vec::new(),
                models: Vec::new(),
                error: None,
            })
            .collect();
        snapshot.breakers = engine.views();
        telemetry.replace(snapshot.clone());
        Monitor {
            gpu,
            backends,
            plans,
            engine,
            saturation: None,
            store,
            telemetry,
            alerts,
            history,
            snapshot,
        }
    }

    /// Adds saturation rules to every scope. Saturation has no half-open
    /// trickle and fails open on stale data (a full backend that stops
    /// answering is the breaker's business).
    pub fn with_saturation(mut self, rules: Vec<crate::breaker::Rule>) -> Monitor {
        if rules.is_empty() {
            return self;
        }
        let policy = Policy {
            half_open_fraction: 0.0,
            on_stale: crate::breaker::OnStale::FailOpen,
            ..self.engine.policy().clone()
        };
        let scopes = self
            .plans
            .iter()
            .map(|p| (p.scope.clone(), rules.clone()))
            .collect();
        let start = At {
            mono: std::time::Instant::now(),
            wall: std::time::SystemTime::now(),
        };
        self.saturation = Some(Engine::new(policy, scopes, start));
        self
    }

    /// One round at `now`: read every source, feed the rules, announce
    /// the transitions, publish the state.
    pub async fn tick(&mut self, now: At) {
        let gpus = self.gpu.as_mut().map(|g| g.read());
        let polls = join_all(self.backends.iter_mut().map(|b| b.poll(now.mono))).await;
        self.record_reads(gpus.as_ref(), &polls, now);
        self.observe(gpus.as_ref(), &polls, now);
        let transitions = self.engine.evaluate(now);
        self.announce(&transitions);
        let saturated = Self::saturation_round(self.saturation.as_mut(), now);
        let views = self.engine.views();
        let breakers = published(&views, saturated, self.engine.policy());
        let stale = views.iter().any(|v| v.stale);
        self.store.update(now.wall, |s| {
            s.breakers = breakers;
            s.stale = stale;
        });
        let snap = &mut self.snapshot;
        snap.breakers = views;
        snap.last_round = Some(now.wall);
        self.telemetry.replace(snap.clone());
    }

    /// The round's reads into the snapshot (and the GPUs into the
    /// history); a source that fails or recovers is said once.
    fn record_reads(
        &mut self,
        gpus: Option<&Result<Vec<GpuReading>, SourceError>>,
        polls: &[Result<BackendReading, SourceError>],
        now: At,
    ) {
        let snap = &mut self.snapshot;
        // Every source's error counter exists from the first round, at 0, so
        // the first error shows in rate()/increase().
        if gpus.is_some() {
            snap.scrape_errors.entry("gpu".into()).or_default();
        }
        for status in &snap.backends {
            snap.scrape_errors.entry(status.name.clone()).or_default();
        }
        match gpus {
            Some(Ok(g)) => {
                if snap.gpu_error.take().is_some() {
                    eprintln!("sluice-sidecar: GPU source reads again");
                }
                snap.gpus = g.clone();
                if let Some(h) = &self.history {
                    h.record_gpus(now.wall, g);
                }
            }
            Some(Err(e)) => {
                let e = e.to_string();
                *snap.scrape_errors.entry("gpu".into()).or_default() += 1;
                if snap.gpu_error.as_deref() != Some(e.as_str()) {
                    eprintln!("sluice-sidecar: GPU source failed: {e}");
                }
                snap.gpus.clear();
                snap.gpu_error = Some(e);
            }
            None => {}
        }
        for (status, poll) in snap.backends.iter_mut().zip(polls) {
            match poll {
                Ok(r) => {
                    if status.error.take().is_some() {
                        eprintln!(
                            "sluice-sidecar: {} {} answers again",
                            status.kind, status.name
                        );
                    }
                    status.up = true;
                    status.samples = r.samples.clone();
                    status.models = r.models.clone();
                }
                Err(e) => {
                    let e = e.to_string();
                    *snap.scrape_errors.entry(status.name.clone()).or_default() += 1;
                    if status.error.as_deref() != Some(e.as_str()) {
                        eprintln!(
                            "sluice-sidecar: {} {} failed: {e}",
                            status.kind, status.name
                        );
                    }
                    status.up = false;
                    status.samples.clear();
                    status.error = Some(e);
                }
            }
        }
    }

    /// Feeds each scope's rules (breaker and saturation) the samples of
    /// its GPUs and backends.
    fn observe(
        &mut self,
        gpus: Option<&Result<Vec<GpuReading>, SourceError>>,
        polls: &[Result<BackendReading, SourceError>],
        now: At,
    ) {
        for plan in &self.plans {
            if let Some(Ok(all)) = gpus {
                let mine: Vec<&GpuReading> = all
                    .iter()
                    .filter(|g| plan.gpus.as_ref().is_none_or(|sel| sel.contains(&g.index)))
                    .collect();
                // A scope that takes no GPU is not kept fresh by them.
                if plan.gpus.as_ref().is_none_or(|sel| !sel.is_empty()) {
                    let samples = gpu_samples(mine);
                    self.engine.observe(&plan.scope, &samples, now.mono);
                    if let Some(sat) = self.saturation.as_mut() {
                        sat.observe(&plan.scope, &samples, now.mono);
                    }
                }
            }
            for &i in &plan.backends {
                if let Some(Ok(r)) = polls.get(i) {
                    self.engine.observe(&plan.scope, &r.samples, now.mono);
                    if let Some(sat) = self.saturation.as_mut() {
                        sat.observe(&plan.scope, &r.samples, now.mono);
                    }
                }
            }
        }
    }

    /// Logs, counts, records and alerts each breaker transition.
    fn announce(&mut self, transitions: &[Transition]) {
        for t in transitions {
            eprintln!(
                "sluice-sidecar: breaker {} {} -> {} ({})",
                t.scope,
                t.from.as_str(),
                t.to.as_str(),
                t.reason
            );
            *self
                .snapshot
                .transitions
                .entry((t.scope.clone(), t.to.as_str()))
                .or_default() += 1;
            if let Some(h) = &self.history {
                h.record_transition(t);
            }
            if let Some(a) = &self.alerts {
                a.send(AlertEvent::Breaker {
                    scope: t.scope.clone(),
                    from: t.from,
                    to: t.to,
                    reason: t.reason.clone(),
                    at: t.at,
                });
            }
        }
    }

    /// Evaluates the saturation rules; the scopes saturated now.
    fn saturation_round(saturation: Option<&mut Engine>, now: At) -> Vec<crate::breaker::View> {
        let Some(sat) = saturation else {
            return Vec::new();
        };
        for t in sat.evaluate(now) {
            let word = if t.to == BreakerState::Closed {
                "no longer saturated"
            } else {
                "saturated"
            };
            eprintln!("sluice-sidecar: {} {word} ({})", t.scope, t.reason);
        }
        sat.views()
            .into_iter()
            .filter(|v| v.state != BreakerState::Closed)
            .collect()
    }

    /// Rounds every `interval` until `closing` turns true.
    pub async fn run(mut self, interval: Duration, mut closing: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    self.tick(At { mono: Instant::now(), wall: SystemTime::now() }).await;
                }
                // The guard `wait_for` yields is not Send: drop it inside.
                () = async { let _ = closing.wait_for(|c| *c).await; } => return,
            }
        }
    }
}

/// The breakers the filter is told of: every breaker not closed, and a
/// saturated scope whose breaker is closed as `saturated`; in scope order.
fn published(views: &[View], saturated: Vec<View>, policy: &Policy) -> Vec<Breaker> {
    let mut breakers: Vec<Breaker> = views
        .iter()
        .filter(|v| v.state != BreakerState::Closed)
        .map(|v| Breaker {
            scope: v.scope.clone(),
            state: v.state,
            half_open_fraction: if v.state == BreakerState::HalfOpen {
                policy.half_open_fraction
            } else {
                0.0
            },
            retry_after_seconds: policy.retry_after.as_secs().max(1),
            reason: v.reason.clone(),
            since: v.since,
            from_fleet: false,
        })
        .collect();
    for v in saturated {
        if views
            .iter()
            .any(|b| b.scope == v.scope && b.state != BreakerState::Closed)
        {
            continue;
        }
        breakers.push(Breaker {
            scope: v.scope.clone(),
            state: BreakerState::Saturated,
            half_open_fraction: 0.0,
            retry_after_seconds: policy.retry_after.as_secs().max(1),
            reason: v.reason.clone(),
            since: v.since,
            from_fleet: false,
        });
    }
    breakers.sort_by(|a, b| a.scope.cmp(&b.scope));
    breakers
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::Metric;
    use crate::breaker::Rule;
    use crate::sources::gpu::{SimGpu, SimHandle, SimulatedGpus, Simulation};
    use crate::sources::{BackendReading, SourceError};
    use futures_util::future::BoxFuture;
    use std::sync::Mutex;

    type Script = Arc<Mutex<Result<Vec<(Metric, f64)>, String>>>;

    /// A backend whose answers a test sets.
    struct Scripted {
        next: Script,
    }

    impl BackendSource for Scripted {
        fn name(&self) -> &str {
            "fake"
        }
        fn kind(&self) -> &'static str {
            "vllm"
        }
        fn poll(&mut self, _at: Instant) -> BoxFuture<'_, Result<BackendReading, SourceError>> {
            let r = self.next.lock().unwrap().clone();
            Box::pin(async move {
                r.map(|samples| BackendReading {
                    samples,
                    models: vec![],
                })
                .map_err(SourceError::Other)
            })
        }
    }

    fn sim(util: f64) -> Simulation {
        Simulation {
            gpus: vec![SimGpu {
                utilization: util,
                memory_used_mb: None,
                memory_total_mb: None,
                temperature_c: None,
                power_w: None,
                name: None,
            }],
            fail: false,
        }
    }

    #[tokio::test]
    async fn saturation_is_published_beside_the_breakers() {
        let next = Arc::new(Mutex::new(Ok(vec![(Metric::VllmWaiting, 20.0)])));
        let store = StateStore::new(SystemTime::UNIX_EPOCH);
        let plans = vec![ScopePlan {
            scope: "backend:fake".into(),
            backends: vec![0],
            gpus: Some(vec![]),
            rules: Rule::defaults(),
        }];
        let start = At {
            mono: Instant::now(),
            wall: SystemTime::UNIX_EPOCH,
        };
        let rule = Rule {
            metric: Metric::VllmWaiting,
            open_at: 10.0,
            close_below: 10.0,
            open_for: Duration::ZERO,
            close_after: Duration::ZERO,
        };
        let mut m = Monitor::new(
            None,
            vec![Box::new(Scripted { next: next.clone() })],
            plans,
            Policy::default(),
            Outputs {
                store: store.clone(),
                telemetry: Arc::new(Telemetry::default()),
                alerts: None,
                history: None,
            },
            start,
        )
        .with_saturation(vec![rule]);
        m.tick(start.plus(Duration::from_secs(1))).await;
        m.tick(start.plus(Duration::from_secs(2))).await;
        let state = store.current();
        assert_eq!(state.breakers.len(), 1, "{state:?}");
        assert_eq!(state.breakers[0].scope, "backend:fake");
        assert_eq!(state.breakers[0].state, BreakerState::Saturated);
        let json = serde_json::to_value(&state).unwrap();
        assert_eq!(json["breakers"][0]["state"], "saturated");
        *next.lock().unwrap() = Ok(vec![(Metric::VllmWaiting, 2.0)]);
        m.tick(start.plus(Duration::from_secs(3))).await;
        m.tick(start.plus(Duration::from_secs(4))).await;
        assert!(store.current().breakers.is_empty());
    }

    #[tokio::test]
    async fn a_scope_no_source_feeds_is_never_stale_but_a_silent_backend_still_is() {
        let next = Arc::new(Mutex::new(Err::<Vec<(Metric, f64)>, _>("down".into())));
        let store = StateStore::new(SystemTime::UNIX_EPOCH);
        let plan = |scope: &str, backends: Vec<usize>| ScopePlan {
            scope: scope.into(),
            backends,
            gpus: None,
            rules: Rule::defaults(),
        };
        let start = At {
            mono: Instant::now(),
            wall: SystemTime::UNIX_EPOCH,
        };
        let outputs = || Outputs {
            store: store.clone(),
            telemetry: Arc::new(Telemetry::default()),
            alerts: None,
            history: None,
        };
        // No GPU source, no backend: the shipped default scope on a node
        // without GPUs (`sources.gpu: none`).
        let mut alone = Monitor::new(
            None,
            vec![],
            vec![plan("backend:local", vec![])],
            Policy::default(),
            outputs(),
            start,
        );
        for s in 0..=90 {
            alone.tick(start.plus(Duration::from_secs(s))).await;
        }
        assert!(!store.current().stale, "{:?}", store.current());
        assert!(
            store.current().breakers.is_empty(),
            "closed: {:?}",
            store.current()
        );
        // A scope a backend feeds, silent past stale_after, is stale.
        let mut fed = Monitor::new(
            None,
            vec![Box::new(Scripted { next: next.clone() })],
            vec![plan("backend:fake", vec![0]), plan("backend:local", vec![])],
            Policy::default(),
            outputs(),
            start,
        );
        for s in 0..=90 {
            fed.tick(start.plus(Duration::from_secs(s))).await;
        }
        assert!(store.current().stale, "{:?}", store.current());
    }

    #[tokio::test]
    async fn rounds_publish_breakers_and_telemetry() {
        let handle = SimHandle::default();
        let next = Arc::new(Mutex::new(Ok(vec![(Metric::VllmWaiting, 5.0)])));
        let store = StateStore::new(SystemTime::UNIX_EPOCH);
        let telemetry = Arc::new(Telemetry::default());
        let plans = vec![
            ScopePlan {
                scope: "backend:fake".into(),
                backends: vec![0],
                gpus: Some(vec![]),
                rules: Rule::defaults(),
            },
            ScopePlan {
                scope: "backend:local".into(),
                backends: vec![],
                gpus: None,
                rules: Rule::defaults(),
            },
        ];
        let start = At {
            mono: Instant::now(),
            wall: SystemTime::UNIX_EPOCH,
        };
        let mut m = Monitor::new(
            Some(Box::new(SimulatedGpus::new(handle.clone(), None))),
            vec![Box::new(Scripted { next: next.clone() })],
            plans,
            Policy::default(),
            Outputs {
                store: store.clone(),
                telemetry: telemetry.clone(),
                alerts: None,
                history: None,
            },
            start,
        );
        handle.set(sim(95.0)).unwrap();
        for s in 0..=30 {
            m.tick(start.plus(Duration::from_secs(s))).await;
        }
        let state = store.current();
        assert_eq!(state.breakers.len(), 1, "{state:?}");
        let b = &state.breakers[0];
        assert_eq!(b.scope, "backend:local");
        assert_eq!(b.state, BreakerState::Open);
        assert_eq!(b.half_open_fraction, 0.0);
        assert_eq!(b.retry_after_seconds, 30);
        let version = state.version;
        // Nothing changes: the version holds.
        m.tick(start.plus(Duration::from_secs(31))).await;
        assert_eq!(store.current().version, version);

        // The backend fails: counted, shown down; its scope goes stale later.
        *next.lock().unwrap() = Err("boom".into());
        m.tick(start.plus(Duration::from_secs(32))).await;
        let snap = telemetry.snapshot();
        assert_eq!(snap.scrape_errors.get("fake"), Some(&1));
        assert!(!snap.backends[0].up);
        assert_eq!(snap.gpus[0].utilization, 95.0);
        assert!(!store.current().stale);
        m.tick(start.plus(Duration::from_secs(61))).await;
        assert!(store.current().stale, "backend:fake last answered at 31");

        // GPU calm: open → half-open after 10 s.
        handle.set(sim(10.0)).unwrap();
        for s in 62..=72 {
            m.tick(start.plus(Duration::from_secs(s))).await;
        }
        let state = store.current();
        assert_eq!(state.breakers[0].state, BreakerState::HalfOpen);
        assert_eq!(state.breakers[0].half_open_fraction, 0.1);
        assert_eq!(
            telemetry
                .snapshot()
                .transitions
                .get(&("backend:local".to_string(), "half_open")),
            Some(&1)
        );
    }
}
