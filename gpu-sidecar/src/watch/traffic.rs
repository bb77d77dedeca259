//! Requests admitted, degraded and refused per tier, per minute, as the
//! sidecar sees them from Envoy: it scrapes Envoy's admin
//! `/stats/prometheus` (`envoy_admin.url`, optional) for the filter's own
//! counter `sluice_requests_total{decision, tier, …}`, sums it by tier and
//! decision, and adds the difference since the previous scrape to the
//! current minute.
//!
//! Why this source: the filter already counts every decision in Envoy's
//! stats (summed over all workers by Envoy), and the long poll carries
//! nothing back from the filter. The first scrape is only a baseline (what
//! Envoy counted before the sidecar looked is not "the last minutes"); a
//! counter that went down means Envoy restarted, and its new value is the
//! delta. Bounded: [`MAX_TIERS`] tiers per minute (more are summed as
//! `(other)`), `envoy_admin.minutes` minutes.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tokio::sync::watch;

use crate::config::envoy_admin::{EnvoyAdminConfig, MAX_MINUTES};
use crate::http::Target;
use crate::sources::prom;

/// Tiers kept per minute; the rest are summed as [`OTHER`].
pub const MAX_TIERS: usize = 32;
pub const OTHER: &str = "(other)";
/// The counter read, as Envoy's `stats_tags` export it.
pub const COUNTER: &str = "sluice_requests_total";
/// The filter's count of provider budget alerts (once per window each),
/// read in the same scrape: each rise is a webhook alert.
pub const ALERTS_COUNTER: &str = "sluice_provider_budget_alerts_total";
/// The decisions, in the order of [`Counts`].
pub const DECISIONS: [&str; 3] = ["admit", "degrade", "refuse"];

/// Admitted, degraded, refused.
type Counts = [u64; 3];

#[derive(Debug, Default)]
struct Inner {
    /// The totals of the last good scrape, by (tier, decision index).
    last: Option<BTreeMap<(String, usize), f64>>,
    /// (minute since the epoch, counts by tier), oldest first.
    minutes: VecDeque<(u64, BTreeMap<String, Counts>)>,
    last_ok: Option<SystemTime>,
    error: Option<String>,
    /// The ladder's rungs as the last scrape of Envoy's clusters saw them.
    rungs: Vec<crate::watch::rungs::RungView>,
}

/// The per-minute counts. Disabled (no `envoy_admin`): the page says so.
#[derive(Debug)]
pub struct Traffic {
    cfg: Option<EnvoyAdminConfig>,
    inner: Mutex<Inner>,
    /// Spend and budgets, read in the same scrape.
    pub money: crate::watch::money::Money,
    /// The day's top spenders, from the audit log (`audit_log`).
    pub spenders: crate::watch::spenders::Spenders,
}

impl Traffic {
    pub fn disabled() -> Traffic {
        Traffic {
            cfg: None,
            inner: Mutex::default(),
            money: Default::default(),
            spenders: Default::default(),
        }
    }

    pub fn new(cfg: Option<EnvoyAdminConfig>) -> Traffic {
        let log = cfg.as_ref().and_then(|c| c.audit_log.clone());
        Traffic {
            cfg,
            inner: Mutex::default(),
            money: Default::default(),
            spenders: crate::watch::spenders::Spenders::new(log),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A scrape's body at `now`.
    pub fn observe_text(&self, now: SystemTime, text: &str) {
        self.money.observe_text(now, text);
        let mut totals: BTreeMap<(String, usize), f64> = BTreeMap::new();
        let mut seen = false;
        for s in prom::parse(text) {
            if s.name != COUNTER || !s.value.is_finite() {
                continue;
            }
            let (Some(d), Some(tier)) = (s.label("decision"), s.label("tier")) else {
                continue;
            };
            seen = true;
            let Some(d) = DECISIONS.iter().position(|x| *x == d) else {
                continue;
            };
            *totals
                .entry((tier.chars().take(64).collect(), d))
                .or_default() += s.value;
        }
        self.observe(now, totals);
        // Envoy creates the counter at the first request, so an empty
        // answer is normal on an idle Envoy; say what we looked for.
        self.lock().error = (!seen).then(|| {
            format!("no {COUNTER}{{decision,tier}} in Envoy's stats yet (no request, or the Envoy config lacks sluice's stats_tags)")
        });
    }

    /// Totals by (tier, decision) at `now`.
    fn observe(&self, now: SystemTime, totals: BTreeMap<(String, usize), f64>) {
        let keep = self.cfg.as_ref().map_or(15, |c| c.minutes).min(MAX_MINUTES);
        let minute = minute_of(now);
        let mut inner = self.lock();
        inner.last_ok = Some(now);
        let Some(last) = inner.last.replace(totals.clone()) else {
            return; // the baseline
        };
        let mut deltas: Vec<(&String, usize, u64)> = Vec::new();
        for ((tier, d), v) in &totals {
            let before = last.get(&(tier.clone(), *d)).copied().unwrap_or(0.0);
            // Lower than before: Envoy restarted and counts from 0.
            let delta = if *v >= before { v - before } else { *v };
            // Saturating float → integer cast, on purpose.
            let delta = delta.round() as u64;
            if delta > 0 {
                deltas.push((tier, *d, delta));
            }
        }
        if inner.minutes.back().is_none_or(|(m, _)| *m < minute) {
            inner.minutes.push_back((minute, BTreeMap::new()));
        }
        // A clock that went back lands in the newest minute.
        if let Some((_, counts)) = inner.minutes.back_mut() {
            for (tier, d, delta) in deltas {
                let key = if counts.contains_key(tier) || counts.len() < MAX_TIERS {
                    tier.clone()
                } else {
                    OTHER.to_string()
                };
                let c = counts.entry(key).or_default();
                c[d] = c[d].saturating_add(delta);
            }
        }
        while inner.minutes.len() > keep {
            inner.minutes.pop_front();
        }
    }

    /// The rungs as the last reading of Envoy's clusters saw them.
    pub fn set_rungs(&self, views: Vec<crate::watch::rungs::RungView>) {
        self.lock().rungs = views;
    }

    /// The rungs' rows of the page's breakers table.
    pub fn rung_rows(&self) -> Vec<Value> {
        self.lock().rungs.iter().map(|r| r.row()).collect()
    }

    /// `money` of `GET /v1/history`: spend by level against budgets, the
    /// rungs with their state, the cache's savings.
    pub fn money_json(&self, now: SystemTime) -> Value {
        if self.cfg.is_none() {
            return json!({"enabled": false});
        }
        let mut money = self.money.to_json(now, &self.rung_rows());
        money["top_spenders"] = self.spenders.to_json(now, &self.money.tier_budgets());
        money
    }

    /// A failed scrape: shown on the page; the baseline stays.
    pub fn failed(&self, error: String) {
        self.lock().error = Some(error);
    }

    /// `traffic` of `GET /v1/history`: one entry per minute of the window,
    /// oldest first, zeros where nothing was counted.
    pub fn to_json(&self, now: SystemTime) -> Value {
        let Some(cfg) = &self.cfg else {
            return json!({"enabled": false, "tiers": [], "minutes": [], "decisions": DECISIONS});
        };
        let inner = self.lock();
        let newest = minute_of(now);
        let first =
            newest.saturating_sub(u64::try_from(cfg.minutes).unwrap_or(0).saturating_sub(1));
        let mut tiers: Vec<&String> = inner
            .minutes
            .iter()
            .filter(|(m, _)| *m >= first)
            .flat_map(|(_, c)| c.keys())
            .collect();
        tiers.sort();
        tiers.dedup();
        let minutes: Vec<Value> = (first..=newest)
            .map(|m| {
                let counts = inner.minutes.iter().find(|(k, _)| *k == m).map(|(_, c)| c);
                let by_tier: serde_json::Map<String, Value> = tiers
                    .iter()
                    .map(|t| {
                        let c = counts.and_then(|c| c.get(*t)).copied().unwrap_or_default();
                        ((*t).clone(), json!(c))
                    })
                    .collect();
                json!({
                    "start": humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(m * 60)).to_string(),
                    "tiers": by_tier,
                })
            })
            .collect();
        json!({
            "enabled": true,
            "source": "envoy admin /stats/prometheus (sluice_requests_total)",
            "decisions": DECISIONS,
            "tiers": tiers,
            "minutes": minutes,
            "last_scrape": inner.last_ok.map(|t| humantime::format_rfc3339_seconds(t).to_string()),
            "error": inner.error,
        })
    }
}

fn minute_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() / 60)
}

/// The rises of `sluice_provider_budget_alerts_total{provider}` between
/// scrapes. The first scrape is a baseline (an alert Envoy counted before
/// the sidecar looked was not seen: it is in Envoy's log and stats); a
/// provider first seen later counts from 0; a counter that went down means
/// Envoy restarted, and its new value is new.
#[derive(Debug, Default)]
pub struct ProviderAlerts {
    last: Option<BTreeMap<String, f64>>,
}

impl ProviderAlerts {
    /// The providers whose alert count rose, once each.
    pub fn observe(&mut self, text: &str) -> Vec<String> {
        let mut now: BTreeMap<String, f64> = BTreeMap::new();
        for s in prom::parse(text) {
            if s.name == ALERTS_COUNTER && s.value.is_finite() {
                if let Some(p) = s.label("provider") {
                    *now.entry(p.to_string()).or_default() += s.value;
                }
            }
        }
        let risen = match &self.last {
            None => Vec::new(),
            Some(last) => now
                .iter()
                .filter(|(p, v)| {
                    let before = last.get(*p).copied().unwrap_or(0.0);
                    **v > before || (**v < before && **v > 0.0)
                })
                .map(|(p, _)| p.clone())
                .collect(),
        };
        self.last = Some(now);
        risen
    }
}

/// Scrapes Envoy every `scrape_every` until `closing` turns true, for the
/// traffic and the provider alerts (handed to `alerts`), and, with
/// `rungs`, its clusters' health for the ladder's rungs (published in
/// `store`, see [`crate::watch::rungs`]). Each scrape is bounded by
/// `timeout` and the HTTP client's body cap; the `filter` query keeps
/// Envoy's answer to sluice's counters read here and in
/// [`crate::watch::money`].
pub async fn run(
    (traffic, timeout): (Arc<Traffic>, Duration),
    alerts: Option<crate::watch::alerts::Alerts>,
    store: crate::state::StateStore,
    mut closing: watch::Receiver<bool>,
) {
    let Some(cfg) = traffic.cfg.clone() else {
        return;
    };
    let Ok(base) = Target::parse(&cfg.url) else {
        return; // refused when the config was read
    };
    // Envoy's `filter` is a regular expression over stat names.
    let target = base.join(&format!(
        "/stats/prometheus?filter=sluice_(requests|provider_budget_alerts)_total|{}",
        crate::watch::money::STATS_FILTER
    ));
    let clusters = base.join("/clusters?format=json");
    let checks = base.join(crate::watch::first_check::STATS_PATH);
    let mut rungs = crate::watch::rungs::Rungs::default();
    let mut provider_alerts = ProviderAlerts::default();
    let mut ticker = tokio::time::interval(cfg.scrape_every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = async { let _ = closing.wait_for(|c| *c).await; } => return,
        }
        match crate::http::get(&target, timeout).await {
            Ok(body) => {
                let text = String::from_utf8_lossy(&body);
                traffic.observe_text(SystemTime::now(), &text);
                for provider in provider_alerts.observe(&text) {
                    if let Some(a) = &alerts {
                        a.send(crate::watch::alerts::AlertEvent::ProviderBudget {
                            provider,
                            at: SystemTime::now(),
                        });
                    }
                }
            }
            Err(e) => traffic.failed(format!("reading Envoy's stats: {e}")),
        }
        traffic.spenders.poll(SystemTime::now());
        if !cfg.rungs.is_empty() {
            // The health checks each cluster has finished, to tell a host
            // not checked yet from one that failed (none: as failed).
            let done = crate::http::get(&checks, timeout).await.ok().map(|body| {
                crate::watch::first_check::checks_done(&String::from_utf8_lossy(&body))
            });
            let health = match crate::http::get(&clusters, timeout).await {
                Ok(body) => serde_json::from_slice::<Value>(&body)
                    .ok()
                    .map(|v| crate::watch::rungs::cluster_health(&v, done.as_ref())),
                Err(_) => None,
            };
            let connect = match &health {
                Some(h) => crate::watch::rungs::connect_times(&cfg.rungs, h, timeout).await,
                None => BTreeMap::new(),
            };
            let now = SystemTime::now();
            let down = rungs.observe(&cfg.rungs, health.as_ref(), now);
            store.set_rung_breakers(now, down);
            traffic.set_rungs(rungs.views(&cfg.rungs, health.as_ref(), &connect));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(s)
    }

    fn text(free_admit: u64, free_refuse: u64, pro_admit: u64) -> String {
        format!(
            "# TYPE sluice_requests_total counter\n\
             sluice_requests_total{{decision=\"admit\",reason=\"none\",tier=\"free\",model=\"a\"}} {free_admit}\n\
             sluice_requests_total{{decision=\"admit\",reason=\"none\",tier=\"free\",model=\"b\"}} 1\n\
             sluice_requests_total{{decision=\"refuse\",reason=\"user_rate_limit\",tier=\"free\",model=\"a\"}} {free_refuse}\n\
             sluice_requests_total{{decision=\"admit\",reason=\"none\",tier=\"pro\",model=\"a\"}} {pro_admit}\n\
             sluice_requests_total{{decision=\"weird\",tier=\"pro\"}} 1000\n\
             sluice_requests_total_other{{decision=\"admit\",tier=\"pro\"}} 1000\n"
        )
    }

    fn traffic(minutes: usize) -> Traffic {
        Traffic::new(Some(EnvoyAdminConfig {
            minutes,
            ..EnvoyAdminConfig::from_url("http://127.0.0.1:9901")
        }))
    }

    #[test]
    fn per_minute_deltas_by_tier_and_decision() {
        let tr = traffic(3);
        // What Envoy counted before the first look is not counted.
        tr.observe_text(t(600), &text(100, 50, 7));
        tr.observe_text(t(610), &text(103, 51, 7));
        tr.observe_text(t(650), &text(105, 51, 9));
        tr.observe_text(t(661), &text(106, 54, 9));
        let v = tr.to_json(t(670));
        assert_eq!(v["enabled"], true);
        assert_eq!(v["tiers"], json!(["free", "pro"]));
        let m = v["minutes"].as_array().unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[0]["start"], "1970-01-01T00:09:00Z");
        assert_eq!(m[0]["tiers"]["free"], json!([0, 0, 0]));
        assert_eq!(m[1]["tiers"]["free"], json!([5, 0, 1]));
        assert_eq!(m[1]["tiers"]["pro"], json!([2, 0, 0]));
        assert_eq!(m[2]["tiers"]["free"], json!([1, 0, 3]));
        assert_eq!(v["error"], Value::Null);
        // Minutes age out of the window.
        let v = tr.to_json(t(60 * 30));
        assert_eq!(v["tiers"], json!([]));
        assert!(v["minutes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["tiers"] == json!({})));
    }

    #[test]
    fn each_rise_of_a_providers_alert_count_is_one_alert() {
        let text = |openai: u64, together: Option<u64>| {
            let mut t =
                format!("sluice_provider_budget_alerts_total{{provider=\"openai\"}} {openai}\n");
            if let Some(n) = together {
                t.push_str(&format!(
                    "sluice_provider_budget_alerts_total{{provider=\"together\"}} {n}\n"
                ));
            }
            t
        };
        let mut pa = ProviderAlerts::default();
        assert!(
            pa.observe(&text(3, None)).is_empty(),
            "the first look is a baseline"
        );
        assert!(pa.observe(&text(3, None)).is_empty());
        assert_eq!(pa.observe(&text(4, None)), vec!["openai".to_string()]);
        assert_eq!(
            pa.observe(&text(4, Some(1))),
            vec!["together".to_string()],
            "new: from 0"
        );
        assert_eq!(
            pa.observe(&text(1, Some(1))),
            vec!["openai".to_string()],
            "Envoy restarted"
        );
        assert!(pa.observe(&text(1, Some(1))).is_empty());
    }

    #[test]
    fn a_restarted_envoy_counts_from_zero() {
        let tr = traffic(5);
        tr.observe_text(t(600), &text(100, 0, 0));
        tr.observe_text(t(601), &text(4, 0, 0));
        let v = tr.to_json(t(602));
        // The sum went 101 → 5: everything Envoy counts now came after
        // its restart (4 on model a, 1 on model b).
        assert_eq!(v["minutes"][4]["tiers"]["free"], json!([5, 0, 0]));
    }

    #[test]
    fn tiers_are_capped() {
        let tr = traffic(5);
        let body = |n: u64| {
            (0..100)
                .map(|i| {
                    format!("sluice_requests_total{{decision=\"admit\",tier=\"t{i:03}\"}} {n}\n")
                })
                .collect::<String>()
        };
        tr.observe_text(t(600), &body(0));
        tr.observe_text(t(601), &body(2));
        let v = tr.to_json(t(602));
        let tiers = v["tiers"].as_array().unwrap();
        assert_eq!(tiers.len(), MAX_TIERS + 1);
        assert!(tiers.contains(&json!(OTHER)));
        assert_eq!(v["minutes"][4]["tiers"][OTHER], json!([2 * 68, 0, 0]));
    }

    #[test]
    fn says_when_nothing_is_there_and_when_disabled() {
        let tr = traffic(5);
        tr.observe_text(t(0), "envoy_cluster_upstream_rq{x=\"y\"} 3\n");
        let v = tr.to_json(t(0));
        assert!(v["error"].as_str().unwrap().contains("stats_tags"));
        tr.failed("reading Envoy's stats: connecting".into());
        assert!(tr.to_json(t(0))["error"]
            .as_str()
            .unwrap()
            .contains("connecting"));
        assert_eq!(Traffic::disabled().to_json(t(0))["enabled"], false);
    }
}
