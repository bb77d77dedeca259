//! The breaker engine: per scope (a backend or a model route), rules with a
//! threshold, a sustain time and hysteresis decide whether the filter should
//! stop sending work there; a half-open state trickles a fraction of traffic
//! before closing; a stale-data policy decides what no data means.
//!
//! Pure: it is fed samples and `now` and never reads a clock, so the tests
//! below run in simulated time.
//!
//! The state machine of one scope:
//! - closed → open: some rule's metric stayed `>= open_at` for `open_for`;
//! - open → half-open: every rule's metric stayed `< close_below` for
//!   `close_after` (a rule without fresh data does not hold it open);
//! - half-open → open: any fresh sample `>= open_at` (the trickle hurt);
//! - half-open → closed: `half_open_for` passed without that. With a
//!   half-open fraction or duration of 0, open goes straight to closed;
//! - stale (no source of the scope answered for `stale_after`): fail closed
//!   → open; fail open → a closed breaker stays closed, but an open (or
//!   half-open) one stays open until fresh data lets it close: a GPU that
//!   falls off the bus often takes its exporter with it, and a breaker
//!   opened for that GPU must not reopen traffic because the data stopped.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use crate::state::BreakerState;

/// A signal a rule can watch. GPU signals of a scope are the maximum over
/// its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Percent, 0–100.
    GpuUtilization,
    /// Used memory as a fraction, 0–1.
    GpuMemory,
    /// Degrees Celsius.
    GpuTemperature,
    /// Watts.
    GpuPower,
    /// New XID errors seen on the scope's GPUs within the DCGM source's
    /// `xid.window` (DCGM exporter only; see `sources/dcgm.rs`).
    GpuXidErrors,
    /// `vllm:num_requests_waiting`.
    VllmWaiting,
    /// `vllm:num_requests_running`.
    VllmRunning,
    /// `vllm:kv_cache_usage_perc`, a fraction 0–1.
    KvCache,
    /// Recent time to first token, seconds.
    TtftP50,
    TtftP99,
    /// Recent end-to-end request latency, seconds.
    E2eP50,
    E2eP99,
}

impl Metric {
    pub const ALL: [Metric; 12] = [
        Metric::GpuUtilization,
        Metric::GpuMemory,
        Metric::GpuTemperature,
        Metric::GpuPower,
        Metric::GpuXidErrors,
        Metric::VllmWaiting,
        Metric::VllmRunning,
        Metric::KvCache,
        Metric::TtftP50,
        Metric::TtftP99,
        Metric::E2eP50,
        Metric::E2eP99,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::GpuUtilization => "gpu_utilization",
            Metric::GpuMemory => "gpu_memory",
            Metric::GpuTemperature => "gpu_temperature",
            Metric::GpuPower => "gpu_power",
            Metric::GpuXidErrors => "gpu_xid_errors",
            Metric::VllmWaiting => "vllm_waiting",
            Metric::VllmRunning => "vllm_running",
            Metric::KvCache => "kv_cache",
            Metric::TtftP50 => "ttft_p50",
            Metric::TtftP99 => "ttft_p99",
            Metric::E2eP50 => "e2e_p50",
            Metric::E2eP99 => "e2e_p99",
        }
    }
}

impl fmt::Display for Metric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Open when `metric >= open_at` for `open_for`; count as recovered when
/// `metric < close_below` for `close_after`. Between the two nothing moves:
/// that band is the hysteresis.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub metric: Metric,
    pub open_at: f64,
    pub close_below: f64,
    pub open_for: Duration,
    pub close_after: Duration,
}

impl Rule {
    /// The default rules (docs/src/design.md, "Sidecar"): GPU ≥ 90 %, waiting ≥ 50,
    /// KV cache ≥ 0.9, each for 30 s; recovered under 80 % / 40 / 0.8 for 10 s.
    pub fn defaults() -> Vec<Rule> {
        let rule = |metric, open_at, close_below| Rule {
            metric,
            open_at,
            close_below,
            open_for: Duration::from_secs(30),
            close_after: Duration::from_secs(10),
        };
        vec![
            rule(Metric::GpuUtilization, 90.0, 80.0),
            rule(Metric::VllmWaiting, 50.0, 40.0),
            rule(Metric::KvCache, 0.9, 0.8),
        ]
    }
}

/// What a scope whose sources all went quiet does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStale {
    /// Closed: a breaker that blocks on no data takes the service down with
    /// the sidecar (docs/src/design.md, "Sidecar").
    #[default]
    FailOpen,
    /// Open until data comes back.
    FailClosed,
}

/// Settings shared by every scope.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Share of requests the filter lets through while half-open.
    pub half_open_fraction: f64,
    /// How long half-open lasts before closing.
    pub half_open_for: Duration,
    /// What the filter tells refused clients to wait.
    pub retry_after: Duration,
    /// No answer from any source of a scope for this long: stale.
    pub stale_after: Duration,
    pub on_stale: OnStale,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            half_open_fraction: 0.1,
            half_open_for: Duration::from_secs(10),
            retry_after: Duration::from_secs(30),
            stale_after: Duration::from_secs(30),
            on_stale: OnStale::FailOpen,
        }
    }
}

/// A point in time on both clocks: monotonic for sustain times, wall for
/// what is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct At {
    pub mono: Instant,
    pub wall: SystemTime,
}

impl At {
    /// `self` moved on by `d` (for tests and simulated time).
    pub fn plus(self, d: Duration) -> At {
        At {
            mono: self.mono + d,
            wall: self.wall + d,
        }
    }
}

/// A breaker changed state.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub scope: String,
    pub from: BreakerState,
    pub to: BreakerState,
    pub reason: String,
    pub at: SystemTime,
}

/// One scope's breaker as it stands.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub scope: String,
    pub state: BreakerState,
    /// Why it is in this state (set on every transition).
    pub reason: Option<String>,
    pub since: SystemTime,
    /// No source of the scope answered for `stale_after`.
    pub stale: bool,
    /// The latest fresh value of each watched metric.
    pub values: Vec<(Metric, f64)>,
}

#[derive(Debug, Clone)]
struct Track {
    rule: Rule,
    last: Option<(f64, Instant)>,
    /// Since when the metric has been `>= open_at` without a break.
    above_since: Option<Instant>,
    /// Since when the metric has been `< close_below` without a break.
    below_since: Option<Instant>,
}

impl Track {
    fn record(&mut self, value: f64, at: Instant) {
        if value >= self.rule.open_at {
            self.above_since.get_or_insert(at);
            self.below_since = None;
        } else if value < self.rule.close_below {
            self.below_since.get_or_insert(at);
            self.above_since = None;
        } else {
            self.above_since = None;
            self.below_since = None;
        }
        self.last = Some((value, at));
    }

    /// Forgets data older than `stale_after`, so a metric that comes back
    /// after a gap starts its sustain time anew.
    fn expire(&mut self, now: Instant, stale_after: Duration) {
        if self
            .last
            .is_some_and(|(_, t)| now.saturating_duration_since(t) >= stale_after)
        {
            self.last = None;
            self.above_since = None;
            self.below_since = None;
        }
    }

    fn firing(&self, now: Instant) -> bool {
        self.above_since
            .is_some_and(|t| now.saturating_duration_since(t) >= self.rule.open_for)
    }

    fn recovered(&self, now: Instant) -> bool {
        self.last.is_none()
            || self
                .below_since
                .is_some_and(|t| now.saturating_duration_since(t) >= self.rule.close_after)
    }

    fn hot(&self) -> bool {
        self.last.is_some_and(|(v, _)| v >= self.rule.open_at)
    }

    fn value(&self) -> f64 {
        self.last.map_or(f64::NAN, |(v, _)| v)
    }
}

#[derive(Debug, Clone)]
struct Scope {
    tracks: Vec<Track>,
    state: BreakerState,
    reason: Option<String>,
    since: SystemTime,
    entered: Instant,
    last_fresh: Instant,
    stale: bool,
    /// Some source can feed it. A scope nothing feeds (no GPU source and
    /// no backend) is never stale: no data is what is expected of it, and
    /// a stale report would raise the stale alert for as long as it runs.
    watched: bool,
}

/// All breakers.
#[derive(Debug, Clone)]
pub struct Engine {
    policy: Policy,
    scopes: BTreeMap<String, Scope>,
}

impl Engine {
    /// Every scope starts closed and counts as fresh at `start`.
    pub fn new(policy: Policy, scopes: Vec<(String, Vec<Rule>)>, start: At) -> Engine {
        let scopes = scopes
            .into_iter()
            .map(|(name, rules)| {
                let scope = Scope {
                    tracks: rules
                        .into_iter()
                        .map(|rule| Track {
                            rule,
                            last: None,
                            above_since: None,
                            below_since: None,
                        })
                        .collect(),
                    state: BreakerState::Closed,
                    reason: None,
                    since: start.wall,
                    entered: start.mono,
                    last_fresh: start.mono,
                    stale: false,
                    watched: true,
                };
                (name, scope)
            })
            .collect();
        Engine { policy, scopes }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Marks `scope` as fed by no source: it stays as it is (closed) and
    /// is never stale.
    pub fn unwatched(&mut self, scope: &str) {
        if let Some(s) = self.scopes.get_mut(scope) {
            s.watched = false;
        }
    }

    /// A source of `scope` answered at `at` with these samples (possibly
    /// none: an answer without data still proves the source alive). Metrics
    /// no rule of the scope watches, and NaNs, are ignored.
    pub fn observe(&mut self, scope: &str, samples: &[(Metric, f64)], at: Instant) {
        let Some(s) = self.scopes.get_mut(scope) else {
            return;
        };
        s.last_fresh = s.last_fresh.max(at);
        for &(metric, value) in samples {
            if value.is_nan() {
                continue;
            }
            for t in s.tracks.iter_mut().filter(|t| t.rule.metric == metric) {
                t.record(value, at);
            }
        }
    }

    /// Moves every breaker as the rules say at `now`; returns what changed.
    pub fn evaluate(&mut self, now: At) -> Vec<Transition> {
        let policy = &self.policy;
        let mut changes = Vec::new();
        for (name, s) in &mut self.scopes {
            for t in &mut s.tracks {
                t.expire(now.mono, policy.stale_after);
            }
            let stale =
                s.watched && now.mono.saturating_duration_since(s.last_fresh) >= policy.stale_after;
            s.stale = stale;
            let next = if stale {
                let why = format!(
                    "no fresh data for {}",
                    humantime::format_duration(policy.stale_after)
                );
                match policy.on_stale {
                    OnStale::FailOpen if s.state == BreakerState::Closed => {
                        Some((BreakerState::Closed, format!("{why}: fail open")))
                    }
                    // Open when its data stopped: held open while stale.
                    OnStale::FailOpen => Some((
                        BreakerState::Open,
                        format!("{why}: held open (it was open when its data stopped)"),
                    )),
                    OnStale::FailClosed => {
                        Some((BreakerState::Open, format!("{why}: fail closed")))
                    }
                }
            } else {
                decide(s, policy, now.mono)
            };
            if let Some((to, reason)) = next {
                if to != s.state {
                    changes.push(Transition {
                        scope: name.clone(),
                        from: s.state,
                        to,
                        reason: reason.clone(),
                        at: now.wall,
                    });
                    s.state = to;
                    s.reason = Some(reason);
                    s.since = now.wall;
                    s.entered = now.mono;
                }
            }
        }
        changes
    }

    /// Every scope, in name order.
    pub fn views(&self) -> Vec<View> {
        self.scopes
            .iter()
            .map(|(name, s)| View {
                scope: name.clone(),
                state: s.state,
                reason: s.reason.clone(),
                since: s.since,
                stale: s.stale,
                values: s
                    .tracks
                    .iter()
                    .filter(|t| t.last.is_some())
                    .map(|t| (t.rule.metric, t.value()))
                    .collect(),
            })
            .collect()
    }
}

/// The next state of a fresh scope, with the reason, if it moves.
fn decide(s: &Scope, policy: &Policy, now: Instant) -> Option<(BreakerState, String)> {
    match s.state {
        BreakerState::Closed => s.tracks.iter().find(|t| t.firing(now)).map(|t| {
            (
                BreakerState::Open,
                format!(
                    "{} {} >= {} for {}",
                    t.rule.metric,
                    num(t.value()),
                    num(t.rule.open_at),
                    humantime::format_duration(t.rule.open_for)
                ),
            )
        }),
        BreakerState::Open => {
            if !s.tracks.iter().all(|t| t.recovered(now)) {
                return None;
            }
            let why = recovered_reason(s);
            if policy.half_open_fraction > 0.0 && !policy.half_open_for.is_zero() {
                Some((BreakerState::HalfOpen, why))
            } else {
                Some((BreakerState::Closed, why))
            }
        }
        // Never a breaker's own state (the monitor publishes it; `Unknown`
        // is only ever read from a newer peer).
        BreakerState::Saturated | BreakerState::Unknown => None,
        BreakerState::HalfOpen => {
            if let Some(t) = s.tracks.iter().find(|t| t.hot()) {
                return Some((
                    BreakerState::Open,
                    format!(
                        "{} {} >= {} while half-open",
                        t.rule.metric,
                        num(t.value()),
                        num(t.rule.open_at)
                    ),
                ));
            }
            (now.saturating_duration_since(s.entered) >= policy.half_open_for).then(|| {
                (
                    BreakerState::Closed,
                    format!(
                        "half-open for {} without relapse",
                        humantime::format_duration(policy.half_open_for)
                    ),
                )
            })
        }
    }
}

fn recovered_reason(s: &Scope) -> String {
    let parts: Vec<String> = s
        .tracks
        .iter()
        .filter(|t| t.last.is_some())
        .map(|t| {
            format!(
                "{} {} < {} for {}",
                t.rule.metric,
                num(t.value()),
                num(t.rule.close_below),
                humantime::format_duration(t.rule.close_after)
            )
        })
        .collect();
    if parts.is_empty() {
        "recovered: no rule has fresh data".into()
    } else {
        format!("recovered: {}", parts.join(", "))
    }
}

/// A number as people write it: `95`, `0.93`, `1.25`.
pub fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use BreakerState::{Closed, HalfOpen, Open};

    const GPU: &str = "backend:gpu";

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    struct Sim {
        engine: Engine,
        start: At,
        now: Duration,
        log: Vec<Transition>,
    }

    impl Sim {
        fn new(policy: Policy) -> Sim {
            Sim::with_scopes(policy, vec![(GPU.to_string(), Rule::defaults())])
        }

        fn with_scopes(policy: Policy, scopes: Vec<(String, Vec<Rule>)>) -> Sim {
            let start = At {
                mono: Instant::now(),
                wall: SystemTime::UNIX_EPOCH + secs(1_000_000),
            };
            Sim {
                engine: Engine::new(policy, scopes, start),
                start,
                now: Duration::ZERO,
                log: Vec::new(),
            }
        }

        fn at(&self) -> At {
            self.start.plus(self.now)
        }

        /// Feeds `samples` to `scope` every second for `dur`, evaluating
        /// after each.
        fn feed(&mut self, scope: &str, samples: &[(Metric, f64)], dur: u64) {
            for _ in 0..dur {
                self.now += secs(1);
                let at = self.at();
                self.engine.observe(scope, samples, at.mono);
                self.log.extend(self.engine.evaluate(at));
            }
        }

        fn gpu(&mut self, util: f64, dur: u64) {
            self.feed(GPU, &[(Metric::GpuUtilization, util)], dur);
        }

        /// Time passes with no samples at all.
        fn silence(&mut self, dur: u64) {
            for _ in 0..dur {
                self.now += secs(1);
                let at = self.at();
                self.log.extend(self.engine.evaluate(at));
            }
        }

        fn view(&self, scope: &str) -> View {
            self.engine
                .views()
                .into_iter()
                .find(|v| v.scope == scope)
                .unwrap()
        }

        fn state(&self) -> BreakerState {
            self.view(GPU).state
        }
    }

    #[test]
    fn opens_only_after_the_sustain_time() {
        let mut sim = Sim::new(Policy::default());
        // First sample at t=1; 30 s later (t=31) it has been hot for 30 s.
        sim.gpu(95.0, 30);
        assert_eq!(sim.state(), Closed);
        sim.gpu(95.0, 1);
        assert_eq!(sim.state(), Open);
        let v = sim.view(GPU);
        assert_eq!(
            v.reason.as_deref(),
            Some("gpu_utilization 95 >= 90 for 30s")
        );
        assert_eq!(v.since, sim.start.wall + secs(31));
        assert_eq!(sim.log.len(), 1);
        assert_eq!((sim.log[0].from, sim.log[0].to), (Closed, Open));
    }

    #[test]
    fn a_dip_restarts_the_sustain_time() {
        let mut sim = Sim::new(Policy::default());
        sim.gpu(95.0, 25);
        sim.gpu(85.0, 1); // inside the hysteresis band: breaks the run
        sim.gpu(95.0, 30);
        assert_eq!(sim.state(), Closed);
        sim.gpu(95.0, 1);
        assert_eq!(sim.state(), Open);
    }

    #[test]
    fn hysteresis_keeps_it_open_between_the_thresholds() {
        let mut sim = Sim::new(Policy::default());
        sim.gpu(95.0, 31);
        assert_eq!(sim.state(), Open);
        sim.gpu(85.0, 120);
        assert_eq!(sim.state(), Open, "85 is not below 80");
        sim.gpu(79.0, 10);
        assert_eq!(sim.state(), Open, "below 80 for 9 s only");
        sim.gpu(79.0, 1);
        assert_eq!(sim.state(), HalfOpen);
        let v = sim.view(GPU);
        assert_eq!(
            v.reason.as_deref(),
            Some("recovered: gpu_utilization 79 < 80 for 10s")
        );
        sim.gpu(70.0, 9);
        assert_eq!(sim.state(), HalfOpen);
        sim.gpu(70.0, 1);
        assert_eq!(sim.state(), Closed);
        let states: Vec<_> = sim.log.iter().map(|t| t.to).collect();
        assert_eq!(states, vec![Open, HalfOpen, Closed]);
    }

    #[test]
    fn half_open_reopens_on_a_hot_sample() {
        let mut sim = Sim::new(Policy::default());
        sim.gpu(95.0, 31);
        sim.gpu(50.0, 11);
        assert_eq!(sim.state(), HalfOpen);
        sim.gpu(91.0, 1);
        assert_eq!(sim.state(), Open);
        assert_eq!(
            sim.view(GPU).reason.as_deref(),
            Some("gpu_utilization 91 >= 90 while half-open")
        );
        // And it must recover anew.
        sim.gpu(50.0, 10);
        assert_eq!(sim.state(), Open);
        sim.gpu(50.0, 1);
        assert_eq!(sim.state(), HalfOpen);
    }

    #[test]
    fn without_a_trickle_open_goes_straight_to_closed() {
        let mut sim = Sim::new(Policy {
            half_open_fraction: 0.0,
            ..Policy::default()
        });
        sim.gpu(95.0, 31);
        sim.gpu(50.0, 11);
        assert_eq!(sim.state(), Closed);
    }

    #[test]
    fn flapping_load_never_opens() {
        let mut sim = Sim::new(Policy::default());
        for _ in 0..20 {
            sim.gpu(95.0, 20);
            sim.gpu(60.0, 5);
        }
        assert_eq!(sim.state(), Closed);
        assert!(sim.log.is_empty());
    }

    #[test]
    fn flapping_while_open_does_not_close() {
        let mut sim = Sim::new(Policy::default());
        sim.gpu(95.0, 31);
        for _ in 0..20 {
            sim.gpu(70.0, 9);
            sim.gpu(95.0, 1);
        }
        assert_eq!(sim.state(), Open);
        assert_eq!(sim.log.len(), 1);
    }

    #[test]
    fn any_rule_opens_and_all_must_recover() {
        let mut sim = Sim::new(Policy {
            half_open_fraction: 0.0,
            ..Policy::default()
        });
        let hot = [
            (Metric::GpuUtilization, 40.0),
            (Metric::VllmWaiting, 60.0),
            (Metric::KvCache, 0.5),
        ];
        sim.feed(GPU, &hot, 31);
        assert_eq!(sim.state(), Open);
        assert_eq!(
            sim.view(GPU).reason.as_deref(),
            Some("vllm_waiting 60 >= 50 for 30s")
        );
        let half = [
            (Metric::GpuUtilization, 40.0),
            (Metric::VllmWaiting, 10.0),
            (Metric::KvCache, 0.85),
        ];
        sim.feed(GPU, &half, 60);
        assert_eq!(sim.state(), Open, "KV cache is still in the band");
        let calm = [
            (Metric::GpuUtilization, 40.0),
            (Metric::VllmWaiting, 10.0),
            (Metric::KvCache, 0.5),
        ];
        sim.feed(GPU, &calm, 11);
        assert_eq!(sim.state(), Closed);
    }

    #[test]
    fn kv_cache_reason_reads_as_a_fraction() {
        let mut sim = Sim::new(Policy::default());
        sim.feed(GPU, &[(Metric::KvCache, 0.93)], 31);
        assert_eq!(
            sim.view(GPU).reason.as_deref(),
            Some("kv_cache 0.93 >= 0.9 for 30s")
        );
    }

    #[test]
    fn stale_data_fails_open_by_default() {
        let mut sim = Sim::new(Policy::default());
        sim.gpu(50.0, 5);
        assert_eq!(sim.state(), Closed);
        sim.silence(30);
        let v = sim.view(GPU);
        assert_eq!(v.state, Closed);
        assert!(v.stale);
        // Data comes back hot: the sustain time starts over.
        sim.gpu(95.0, 1);
        assert!(!sim.view(GPU).stale);
        sim.gpu(95.0, 29);
        assert_eq!(sim.state(), Closed);
        sim.gpu(95.0, 1);
        assert_eq!(sim.state(), Open);
    }

    /// Issue 29, item 9: the exporter of a hot GPU hangs after the breaker
    /// opened; fail open used to close it 30 s later.
    #[test]
    fn an_open_breaker_stays_open_while_its_data_is_stale() {
        let mut sim = Sim::new(Policy::default());
        sim.gpu(95.0, 31);
        assert_eq!(sim.state(), Open);
        sim.silence(30);
        let v = sim.view(GPU);
        assert!(v.stale);
        assert_eq!(v.state, Open, "held open while stale");
        assert!(
            v.reason.as_deref().is_some_and(|r| r.contains(">= 90")),
            "still open for its reason: {v:?}"
        );
        sim.silence(600);
        assert_eq!(sim.state(), Open);
        // Fresh and cool again: the rules close it as usual.
        sim.gpu(50.0, 120);
        assert_eq!(sim.state(), Closed);
    }

    #[test]
    fn stale_from_the_start_counts_from_start() {
        let mut sim = Sim::new(Policy::default());
        sim.silence(29);
        assert!(!sim.view(GPU).stale);
        sim.silence(1);
        let v = sim.view(GPU);
        assert!(v.stale);
        assert_eq!(v.state, Closed);
        assert!(sim.log.is_empty(), "closed to closed is no transition");
    }

    #[test]
    fn fail_closed_opens_on_stale_data_and_recovers() {
        let mut sim = Sim::new(Policy {
            on_stale: OnStale::FailClosed,
            half_open_fraction: 0.0,
            ..Policy::default()
        });
        sim.gpu(50.0, 5);
        sim.silence(30);
        assert_eq!(sim.state(), Open);
        assert_eq!(
            sim.view(GPU).reason.as_deref(),
            Some("no fresh data for 30s: fail closed")
        );
        sim.gpu(50.0, 10);
        assert_eq!(sim.state(), Open);
        sim.gpu(50.0, 1);
        assert_eq!(sim.state(), Closed);
    }

    #[test]
    fn a_quiet_metric_does_not_hold_a_breaker_open() {
        // vLLM went away while the GPU source still answers.
        let mut sim = Sim::new(Policy {
            half_open_fraction: 0.0,
            ..Policy::default()
        });
        sim.feed(GPU, &[(Metric::VllmWaiting, 80.0)], 31);
        assert_eq!(sim.state(), Open);
        sim.gpu(50.0, 29);
        assert_eq!(sim.state(), Open, "the waiting count is not stale yet");
        sim.gpu(50.0, 2);
        assert_eq!(sim.state(), Closed);
        assert!(!sim.view(GPU).stale);
        assert_eq!(sim.view(GPU).values, vec![(Metric::GpuUtilization, 50.0)]);
    }

    #[test]
    fn an_answer_without_samples_keeps_the_scope_fresh() {
        let mut sim = Sim::new(Policy::default());
        sim.feed(GPU, &[], 100);
        assert!(!sim.view(GPU).stale);
        assert_eq!(sim.state(), Closed);
    }

    #[test]
    fn scopes_are_independent() {
        let mut sim = Sim::with_scopes(
            Policy::default(),
            vec![
                ("backend:a".into(), Rule::defaults()),
                ("model:b".into(), Rule::defaults()),
            ],
        );
        for _ in 0..31 {
            sim.now += secs(1);
            let at = sim.at();
            sim.engine
                .observe("backend:a", &[(Metric::GpuUtilization, 99.0)], at.mono);
            sim.engine
                .observe("model:b", &[(Metric::GpuUtilization, 10.0)], at.mono);
            sim.engine
                .observe("unknown", &[(Metric::GpuUtilization, 99.0)], at.mono);
            sim.log.extend(sim.engine.evaluate(at));
        }
        assert_eq!(sim.view("backend:a").state, Open);
        assert_eq!(sim.view("model:b").state, Closed);
        assert_eq!(sim.engine.views().len(), 2);
    }

    #[test]
    fn nan_and_unwatched_metrics_are_ignored() {
        let mut sim = Sim::new(Policy::default());
        sim.feed(
            GPU,
            &[
                (Metric::GpuUtilization, f64::NAN),
                (Metric::GpuPower, 999.0),
            ],
            40,
        );
        assert_eq!(sim.state(), Closed);
        assert!(sim.view(GPU).values.is_empty());
    }

    #[test]
    fn numbers_read_plainly() {
        assert_eq!(num(95.0), "95");
        assert_eq!(num(0.9), "0.9");
        assert_eq!(num(0.93456), "0.935");
        assert_eq!(num(-2.5), "-2.5");
    }
}
