//! The operator page's memory: what the sidecar saw over the last minutes,
//! served as `GET /v1/history` and drawn by the page at `/`.
//!
//! Everything here is a bounded ring, sized by config and capped in code:
//! - per GPU, one point per `history.sample_every` over `history.window`
//!   (each point is the worst reading of its period, so a short spike
//!   between two points still shows); at most [`MAX_GPUS`] GPUs and
//!   [`MAX_POINTS`] points each;
//! - the timeline: the last `history.events` breaker transitions and kill
//!   switch changes, with their reasons;
//! - requests per tier and decision per minute ([`crate::watch::traffic`]).
//!
//! Nothing here reads a clock: callers pass `now`, so tests run any time.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::breaker::{num, Rule, Transition, View};
use crate::config::history::{HistoryConfig, MAX_POINTS};
use crate::config::ScopePlan;
use crate::sources::GpuReading;
use crate::state::{KillSwitch, SidecarState, StateStore};
use crate::watch::traffic::Traffic;

/// GPUs kept; readings of more are not charted.
pub const MAX_GPUS: usize = 64;
/// Longest reason kept in a timeline entry.
const MAX_EVENT_REASON: usize = 500;

/// One chart point: the worst of its period.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Point {
    /// Start of the period, Unix ms.
    t: u64,
    utilization: f64,
    memory_pct: f64,
    temperature_c: Option<f64>,
}

impl Point {
    fn merge(&mut self, o: &Point) {
        self.utilization = self.utilization.max(o.utilization);
        self.memory_pct = self.memory_pct.max(o.memory_pct);
        self.temperature_c = match (self.temperature_c, o.temperature_c) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }

    fn to_json(self) -> Value {
        json!([
            self.t,
            round(self.utilization),
            round(self.memory_pct),
            self.temperature_c.map(round)
        ])
    }
}

/// Two decimals are plenty for a chart and keep the JSON short.
fn round(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[derive(Debug, Default)]
struct Series {
    name: String,
    points: VecDeque<Point>,
}

/// One timeline entry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    #[serde(serialize_with = "rfc3339")]
    pub at: SystemTime,
    /// `breaker` or `kill_switch`.
    pub kind: &'static str,
    /// The breaker's scope; empty for the kill switch.
    pub scope: String,
    pub from: String,
    pub to: String,
    pub reason: Option<String>,
}

fn rfc3339<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_seconds(*t))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[derive(Debug, Default)]
struct Inner {
    gpus: BTreeMap<u32, Series>,
    events: VecDeque<Event>,
    rules: BTreeMap<String, Vec<Rule>>,
}

/// The rings, shared by the monitor (writes), the traffic scraper (writes)
/// and the API (reads). One mutex: each holder does a few pushes or one
/// copy, far below a millisecond.
#[derive(Debug)]
pub struct History {
    cfg: HistoryConfig,
    inner: Mutex<Inner>,
    /// Shared with the scraper that fills it ([`crate::watch::traffic::run`]).
    pub traffic: Arc<Traffic>,
}

impl Default for History {
    fn default() -> Self {
        History::new(HistoryConfig::default(), Traffic::disabled())
    }
}

impl History {
    pub fn new(cfg: HistoryConfig, traffic: Traffic) -> History {
        History {
            cfg,
            inner: Mutex::new(Inner::default()),
            traffic: Arc::new(traffic),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The rules of every scope, shown next to each breaker's values.
    pub fn set_rules(&self, plans: &[ScopePlan]) {
        self.lock().rules = plans
            .iter()
            .map(|p| (p.scope.clone(), p.rules.clone()))
            .collect();
    }

    /// A GPU round at `now`: merged into the point of its period.
    pub fn record_gpus(&self, now: SystemTime, gpus: &[GpuReading]) {
        let every = u64::try_from(self.cfg.sample_every.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let ms = unix_ms(now);
        let t = ms - ms % every;
        let keep = self.cfg.points().min(MAX_POINTS);
        let mut inner = self.lock();
        for g in gpus {
            if !inner.gpus.contains_key(&g.index) && inner.gpus.len() >= MAX_GPUS {
                continue;
            }
            let p = Point {
                t,
                utilization: finite_or_zero(g.utilization),
                memory_pct: finite_or_zero(g.memory_fraction() * 100.0),
                temperature_c: g.temperature_c.filter(|v| v.is_finite()),
            };
            let series = inner.gpus.entry(g.index).or_default();
            if series.name != g.name {
                series.name = g.name.chars().take(200).collect();
            }
            match series.points.back_mut() {
                Some(last) if last.t == t => last.merge(&p),
                // A clock that stepped back: start again rather than draw
                // a line that runs backwards.
                Some(last) if last.t > t => {
                    series.points.clear();
                    series.points.push_back(p);
                }
                _ => series.points.push_back(p),
            }
            while series.points.len() > keep {
                series.points.pop_front();
            }
        }
    }

    /// A breaker transition, for the timeline.
    pub fn record_transition(&self, t: &Transition) {
        self.push_event(Event {
            at: t.at,
            kind: "breaker",
            scope: t.scope.clone(),
            from: t.from.as_str().into(),
            to: t.to.as_str().into(),
            reason: Some(t.reason.clone()),
        });
    }

    /// A kill switch change (on, off, or a new reason), for the timeline.
    pub fn record_kill_switch(&self, old: &KillSwitch, new: &KillSwitch, at: SystemTime) {
        let word = |on: bool| if on { "on" } else { "off" };
        self.push_event(Event {
            at: new.since.filter(|_| old.active != new.active).unwrap_or(at),
            kind: "kill_switch",
            scope: String::new(),
            from: word(old.active).into(),
            to: word(new.active).into(),
            reason: new.reason.clone(),
        });
    }

    fn push_event(&self, mut e: Event) {
        e.reason = e.reason.map(|r| r.chars().take(MAX_EVENT_REASON).collect());
        let mut inner = self.lock();
        inner.events.push_back(e);
        while inner.events.len() > self.cfg.events {
            inner.events.pop_front();
        }
    }

    /// `GET /v1/history`: the published state, each breaker with its rules
    /// and latest values, the GPU charts' points, the timeline (newest
    /// first) and the traffic per tier, as of `now`.
    pub fn to_json(&self, now: SystemTime, state: &SidecarState, breakers: &[View]) -> Value {
        let since = unix_ms(now)
            .saturating_sub(u64::try_from(self.cfg.window.as_millis()).unwrap_or(u64::MAX));
        let inner = self.lock();
        let gpus: Vec<Value> = inner
            .gpus
            .iter()
            .map(|(index, s)| {
                let points: Vec<Value> = s
                    .points
                    .iter()
                    .filter(|p| p.t >= since)
                    .map(|p| p.to_json())
                    .collect();
                json!({"index": index, "name": s.name, "points": points})
            })
            .filter(|g| g["points"].as_array().is_some_and(|p| !p.is_empty()))
            .collect();
        let mut breakers: Vec<Value> = breakers
            .iter()
            .map(|v| {
                let rules = inner.rules.get(&v.scope).map_or(&[][..], Vec::as_slice);
                breaker_row(v, rules)
            })
            .collect();
        // The ladder's rungs, up or down (Envoy's health checks and the
        // sidecar's connect time, see `watch::rungs`): rows of their own,
        // with no rule.
        breakers.extend(self.traffic.rung_rows());
        // Another sidecar of the fleet's verdict on a rung this one does
        // not watch.
        breakers.extend(
            state
                .breakers
                .iter()
                .filter(|b| b.from_fleet && b.scope.starts_with(crate::state::RUNG_SCOPE))
                .map(|b| {
                    json!({
                        "scope": b.scope,
                        "state": b.state.as_str(),
                        "since": humantime::format_rfc3339_seconds(b.since).to_string(),
                        "reason": b.reason,
                        "stale": false,
                        "rules": [],
                    })
                }),
        );
        let events: Vec<&Event> = inner.events.iter().rev().collect();
        json!({
            "now": humantime::format_rfc3339_seconds(now).to_string(),
            "now_ms": unix_ms(now),
            "state": state,
            "gpu_columns": ["t_ms", "utilization_pct", "memory_pct", "temperature_c"],
            "sample_every_ms": u64::try_from(self.cfg.sample_every.as_millis()).unwrap_or(u64::MAX),
            "window_ms": u64::try_from(self.cfg.window.as_millis()).unwrap_or(u64::MAX),
            "gpus": gpus,
            "breakers": breakers,
            "events": events,
            "traffic": self.traffic.to_json(now),
            "money": self.traffic.money_json(now),
        })
    }
}

/// One breaker's row of `GET /v1/history`: its state and each of its
/// `rules` with the latest value of the rule's metric (and whether it is
/// at or over the opening threshold).
fn breaker_row(v: &View, rules: &[Rule]) -> Value {
    let rules: Vec<Value> = rules
        .iter()
        .map(|r| {
            let value = v
                .values
                .iter()
                .find(|(m, _)| *m == r.metric)
                .map(|(_, x)| *x);
            json!({
                "metric": r.metric,
                "open_at": r.open_at,
                "close_below": r.close_below,
                "open_for_seconds": r.open_for.as_secs_f64(),
                "close_after_seconds": r.close_after.as_secs_f64(),
                "text": rule_text(r),
                "value": value.filter(|x| x.is_finite()),
                "hot": value.is_some_and(|x| x >= r.open_at),
            })
        })
        .collect();
    json!({
        "scope": v.scope,
        "state": v.state.as_str(),
        "since": humantime::format_rfc3339_seconds(v.since).to_string(),
        "reason": v.reason,
        "stale": v.stale,
        "rules": rules,
    })
}

/// Puts every kill switch change published in `store` on the timeline,
/// until `closing` turns true. It watches the published state rather than
/// the admin handler, so a change from any path (the API, a fleet) shows.
pub async fn watch_kill_switch(
    store: StateStore,
    history: Arc<History>,
    mut closing: watch::Receiver<bool>,
) {
    let mut seen = store.current();
    loop {
        let next = tokio::select! {
            s = store.next_after(seen.version, Duration::from_secs(60)) => s,
            () = async { let _ = closing.wait_for(|c| *c).await; } => return,
        };
        if next.kill_switch != seen.kill_switch {
            history.record_kill_switch(&seen.kill_switch, &next.kill_switch, next.updated_at);
        }
        seen = next;
    }
}

fn finite_or_zero(v: f64) -> f64 {
    if v.is_finite() {
        v
    } else {
        0.0
    }
}

/// `gpu_utilization ≥ 90 for 30s opens · < 80 for 10s closes`.
pub fn rule_text(r: &Rule) -> String {
    format!(
        "{} ≥ {} for {} opens · < {} for {} closes",
        r.metric,
        num(r.open_at),
        humantime::format_duration(r.open_for),
        num(r.close_below),
        humantime::format_duration(r.close_after)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::Metric;
    use crate::state::BreakerState;

    fn t(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    fn gpu(index: u32, util: f64) -> GpuReading {
        GpuReading {
            index,
            name: format!("GPU {index}"),
            utilization: util,
            memory_used_mb: 20.0,
            memory_total_mb: 80.0,
            temperature_c: Some(40.0 + util / 10.0),
            power_w: None,
        }
    }

    fn history(sample_every_s: u64, window_s: u64, events: usize) -> History {
        History::new(
            HistoryConfig {
                sample_every: Duration::from_secs(sample_every_s),
                window: Duration::from_secs(window_s),
                events,
            },
            Traffic::disabled(),
        )
    }

    fn doc(h: &History, now: SystemTime) -> Value {
        let state = StateStore::new(now).current();
        h.to_json(now, &state, &[])
    }

    #[test]
    fn one_point_per_period_keeping_the_worst() {
        let h = history(5, 60, 10);
        // Rounds every 2 s: 0, 2, 4 fall in the first period, 6, 8 in the next.
        for (s, u) in [(0, 10.0), (2, 95.0), (4, 20.0), (6, 30.0), (8, 31.0)] {
            h.record_gpus(t(1_000_000 + s * 1000), &[gpu(0, u)]);
        }
        let v = doc(&h, t(1_009_000));
        let points = v["gpus"][0]["points"].as_array().unwrap();
        assert_eq!(points.len(), 2);
        assert_eq!(
            points[0],
            json!([1_000_000, 95.0, 25.0, 49.5]),
            "the spike stays"
        );
        assert_eq!(points[1], json!([1_005_000, 31.0, 25.0, 43.1]));
        assert_eq!(v["gpus"][0]["name"], "GPU 0");
    }

    #[test]
    fn the_ring_is_bounded_by_the_window() {
        let h = history(5, 60, 10);
        for i in 0..1000 {
            h.record_gpus(t(i * 5000), &[gpu(0, 1.0), gpu(1, 2.0)]);
        }
        let inner = h.lock();
        for s in inner.gpus.values() {
            assert_eq!(s.points.len(), 12);
            assert_eq!(s.points.back().unwrap().t, 999 * 5000);
        }
        drop(inner);
        // Read later, old points are left out even if no round came since.
        // The last 60 s as of 30 s after the last point: 7 points.
        let v = doc(&h, t(999 * 5000 + 30_000));
        assert_eq!(v["gpus"][0]["points"].as_array().unwrap().len(), 7);
        let v = doc(&h, t(999 * 5000 + 3_600_000));
        assert_eq!(v["gpus"], json!([]), "nothing fresh: no chart");
    }

    #[test]
    fn gpus_are_capped() {
        let h = history(5, 60, 10);
        let many: Vec<GpuReading> = (0..200).map(|i| gpu(i, 1.0)).collect();
        h.record_gpus(t(0), &many);
        assert_eq!(h.lock().gpus.len(), MAX_GPUS);
    }

    #[test]
    fn odd_readings_do_not_break_the_json() {
        let h = history(5, 60, 10);
        let mut g = gpu(0, f64::NAN);
        g.temperature_c = Some(f64::INFINITY);
        g.memory_total_mb = 0.0;
        h.record_gpus(t(0), &[g]);
        let v = doc(&h, t(1000));
        assert_eq!(v["gpus"][0]["points"][0], json!([0, 0.0, 0.0, null]));
    }

    #[test]
    fn the_timeline_is_bounded_and_newest_first() {
        let h = history(5, 60, 3);
        for i in 0..5u64 {
            h.record_transition(&Transition {
                scope: "backend:local".into(),
                from: BreakerState::Closed,
                to: BreakerState::Open,
                reason: format!("r{i}"),
                at: t(i * 1000),
            });
        }
        let on = KillSwitch {
            active: true,
            reason: Some("x".repeat(2000)),
            since: Some(t(9000)),
        };
        h.record_kill_switch(&KillSwitch::default(), &on, t(9500));
        let v = doc(&h, t(10_000));
        let events = v["events"].as_array().unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0]["kind"], "kill_switch");
        assert_eq!(events[0]["from"], "off");
        assert_eq!(events[0]["to"], "on");
        assert_eq!(events[0]["at"], "1970-01-01T00:00:09Z");
        assert_eq!(
            events[0]["reason"].as_str().unwrap().len(),
            MAX_EVENT_REASON
        );
        assert_eq!(events[1]["reason"], "r4");
        assert_eq!(events[2]["reason"], "r3");
    }

    #[test]
    fn breakers_come_with_their_rules_and_values() {
        let h = history(5, 60, 10);
        h.set_rules(&[ScopePlan {
            scope: "backend:local".into(),
            backends: vec![],
            gpus: None,
            rules: Rule::defaults(),
        }]);
        let view = View {
            scope: "backend:local".into(),
            state: BreakerState::Open,
            reason: Some("gpu_utilization 95 >= 90 for 30s".into()),
            since: t(0),
            stale: false,
            values: vec![(Metric::GpuUtilization, 95.0)],
        };
        let state = StateStore::new(t(0)).current();
        let v = h.to_json(t(1000), &state, &[view]);
        let b = &v["breakers"][0];
        assert_eq!(b["state"], "open");
        let rule = &b["rules"][0];
        assert_eq!(rule["metric"], "gpu_utilization");
        assert_eq!(rule["value"], 95.0);
        assert_eq!(rule["hot"], true);
        assert_eq!(
            rule["text"],
            "gpu_utilization ≥ 90 for 30s opens · < 80 for 10s closes"
        );
        assert_eq!(b["rules"][1]["value"], Value::Null, "no vLLM data");
        assert_eq!(v["state"]["kill_switch"]["active"], false);
    }

    #[tokio::test(start_paused = true)]
    async fn kill_switch_changes_reach_the_timeline() {
        let store = StateStore::new(t(0));
        let h = Arc::new(history(5, 60, 10));
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(watch_kill_switch(store.clone(), h.clone(), rx));
        tokio::task::yield_now().await;
        let on = |reason: &str| KillSwitch {
            active: true,
            reason: Some(reason.into()),
            since: Some(t(5000)),
        };
        store.update(t(5000), |s| s.kill_switch = on("drill"));
        tokio::time::sleep(Duration::from_millis(10)).await;
        // Not a kill switch change: not on the timeline.
        store.update(t(6000), |s| s.stale = true);
        tokio::time::sleep(Duration::from_millis(10)).await;
        store.update(t(7000), |s| s.kill_switch = on("still drilling"));
        tokio::time::sleep(Duration::from_millis(10)).await;
        let _ = tx.send(true);
        task.await.unwrap();
        let v = doc(&h, t(8000));
        let events = v["events"].as_array().unwrap();
        assert_eq!(events.len(), 2, "{events:?}");
        assert_eq!(events[0]["reason"], "still drilling");
        assert_eq!(
            (events[0]["from"].as_str(), events[0]["to"].as_str()),
            (Some("on"), Some("on"))
        );
        assert_eq!(events[0]["at"], "1970-01-01T00:00:07Z");
        assert_eq!(events[1]["to"], "on");
        assert_eq!(events[1]["at"], "1970-01-01T00:00:05Z");
    }
}
