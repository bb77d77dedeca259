//! Where the money goes, as the sidecar sees it from Envoy's stats (read in
//! the same scrape as the traffic, see [`crate::watch::traffic`]): the
//! filter's settled spend by tier (`sluice_tier_spend_micros_total`), by
//! team and org (`sluice_team_spend_micros_total{team,org}`) and by
//! provider (`sluice_provider_spend_micros_total`), the policy's spend
//! budgets (`sluice_*_spend_budget_micros{…,kind}`), and what the response
//! cache saved (`sluice_cache_saved_*_total{tier,model}`).
//!
//! Envoy's counters run from Envoy's start; the sidecar turns them into
//! spend *today* (the UTC day) by adding up their rises between scrapes,
//! as the traffic does: the first scrape is a baseline (what Envoy counted
//! before the sidecar looked is not known to be today's; `since` says from
//! when the day is counted), a counter that went down means Envoy
//! restarted and its new value is new. The burn rate is the spend of the
//! last hour of those rises (less when the sidecar has looked for less);
//! the run-out is when a budget's remainder is spent at that rate.
//! Bounded: [`MAX_NAMES`] names per level (the rest summed as
//! [`OTHER`]); every name is the policy's.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::sources::prom;

/// The row of the names past [`MAX_NAMES`] (as the traffic's tiers).
pub const OTHER: &str = "(other)";

/// Names kept per level (tiers, teams, orgs, providers, cache rows).
pub const MAX_NAMES: usize = 64;
/// The window of the burn rate.
pub const BURN_WINDOW: Duration = Duration::from_secs(3600);
/// Less history than this gives no burn rate (a rate of one scrape is noise).
pub const MIN_BURN_SPAN: Duration = Duration::from_secs(60);
/// Envoy's `filter` for the stats read here (a regular expression over
/// stat names, matched anywhere in the name).
pub const STATS_FILTER: &str =
    "sluice_((tier|team|provider)_spend_micros_total|(tier|team|org|provider)_spend_budget_micros|cache_saved_(tokens|spend_micros)_total)";

/// The levels a budget is set at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Tier,
    Team,
    Org,
    Provider,
}

impl Level {
    pub const ALL: [Level; 4] = [Level::Tier, Level::Team, Level::Org, Level::Provider];

    pub fn as_str(self) -> &'static str {
        match self {
            Level::Tier => "tier",
            Level::Team => "team",
            Level::Org => "org",
            Level::Provider => "provider",
        }
    }

    fn budget_metric(self) -> &'static str {
        match self {
            Level::Tier => "sluice_tier_spend_budget_micros",
            Level::Team => "sluice_team_spend_budget_micros",
            Level::Org => "sluice_org_spend_budget_micros",
            Level::Provider => "sluice_provider_spend_budget_micros",
        }
    }
}

/// When a budget runs out at the current burn rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOut {
    /// No daily budget to run out.
    NoBudget,
    /// Not enough history for a rate yet.
    Unknown,
    /// Already spent.
    Spent,
    /// Nothing burning.
    Never,
    /// At this time, before the budget's window resets.
    At(SystemTime),
    /// Not before the window resets (the rate would need longer).
    AfterReset,
}

/// When `budget` (micros) runs out, `spent` of it spent, burning
/// `per_hour` (micros an hour; `None`: not known yet), at `now`, the
/// window resetting at `reset`.
pub fn run_out(
    spent: f64,
    budget: Option<u64>,
    per_hour: Option<f64>,
    now: SystemTime,
    reset: SystemTime,
) -> RunOut {
    let Some(budget) = budget else {
        return RunOut::NoBudget;
    };
    let left = budget as f64 - spent;
    if left <= 0.0 {
        return RunOut::Spent;
    }
    let Some(rate) = per_hour else {
        return RunOut::Unknown;
    };
    if rate <= 0.0 {
        return RunOut::Never;
    }
    let secs = left / rate * 3600.0;
    let until = reset.duration_since(now).unwrap_or_default();
    if secs >= until.as_secs_f64() {
        return RunOut::AfterReset;
    }
    RunOut::At(now + Duration::from_secs_f64(secs))
}

impl RunOut {
    pub fn to_json(self) -> Value {
        match self {
            RunOut::At(t) => json!({"state": "at", "at": rfc3339(t)}),
            RunOut::NoBudget => json!({"state": "no_budget"}),
            RunOut::Unknown => json!({"state": "unknown"}),
            RunOut::Spent => json!({"state": "spent"}),
            RunOut::Never => json!({"state": "never"}),
            RunOut::AfterReset => json!({"state": "after_reset"}),
        }
    }
}

/// One counter's rises, as spend today and samples for the burn rate.
#[derive(Debug, Default, Clone)]
struct Series {
    /// Envoy's value at the last scrape.
    last: Option<f64>,
    /// Everything it rose since the sidecar looked first.
    acc: f64,
    /// What of `acc` was today.
    today: f64,
    /// (seconds since the epoch, `acc`), oldest first, the last
    /// [`BURN_WINDOW`] and one before.
    samples: VecDeque<(u64, f64)>,
}

impl Series {
    /// `value` at `now_s`; `new`: first seen after the sidecar's first
    /// look (counted from 0, as Envoy made it at its first write).
    fn observe(&mut self, now_s: u64, value: f64, new: bool) {
        if new && self.last.is_none() {
            self.last = Some(0.0);
        }
        if let Some(last) = self.last {
            // Lower than before: Envoy restarted and counts from 0.
            let rise = if value >= last { value - last } else { value };
            self.acc += rise;
            self.today += rise;
        }
        self.last = Some(value);
        self.samples.push_back((now_s, self.acc));
        let from = now_s.saturating_sub(BURN_WINDOW.as_secs());
        while self.samples.len() > 2 && self.samples[1].0 <= from {
            self.samples.pop_front();
        }
    }

    /// Micros an hour over the last hour (or what of it was seen).
    fn per_hour(&self) -> Option<f64> {
        let (t1, a1) = *self.samples.back()?;
        let from = t1.saturating_sub(BURN_WINDOW.as_secs());
        let &(t0, a0) = self.samples.iter().find(|(t, _)| *t >= from)?;
        let span = t1.saturating_sub(t0);
        (span >= MIN_BURN_SPAN.as_secs()).then(|| (a1 - a0) / span as f64 * 3600.0)
    }
}

/// Budgets of one name, micros: (daily, monthly).
type Budgets = (Option<u64>, Option<u64>);

#[derive(Debug, Default)]
struct Inner {
    spend: BTreeMap<(Level, String), Series>,
    budgets: BTreeMap<(Level, String), Budgets>,
    /// (tier, model) → (tokens, spend micros) saved, as Envoy counts them.
    saved: BTreeMap<(String, String), (f64, f64)>,
    /// The UTC day counted, and since when.
    day: Option<(u64, SystemTime)>,
    last_ok: Option<SystemTime>,
}

/// The money panel's data.
#[derive(Debug, Default)]
pub struct Money {
    inner: Mutex<Inner>,
}

fn day_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400)
}

fn secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// A name as kept: at most 64 characters, [`OTHER`] past [`MAX_NAMES`].
fn keep<V>(map: &BTreeMap<(Level, String), V>, level: Level, name: &str) -> String {
    let name: String = name.chars().take(64).collect();
    let count = map.keys().filter(|(l, _)| *l == level).count();
    if map.contains_key(&(level, name.clone())) || count < MAX_NAMES {
        name
    } else {
        OTHER.to_string()
    }
}

/// What one scrape says: spend totals by level and name, budgets, savings.
#[derive(Debug, Default)]
struct Scraped {
    spend: BTreeMap<(Level, String), f64>,
    budgets: BTreeMap<(Level, String), Budgets>,
    saved: BTreeMap<(String, String), (f64, f64)>,
}

/// Reads the money of a scrape's body.
fn scrape(text: &str) -> Scraped {
    let mut out = Scraped::default();
    for s in prom::parse(text)
        .into_iter()
        .filter(|s| s.value.is_finite())
    {
        let mut spend = |level: Level, name: Option<&str>| {
            if let Some(n) = name.filter(|n| *n != "none") {
                *out.spend.entry((level, n.to_string())).or_default() += s.value;
            }
        };
        match s.name {
            "sluice_tier_spend_micros_total" => spend(Level::Tier, s.label("tier")),
            "sluice_provider_spend_micros_total" => spend(Level::Provider, s.label("provider")),
            "sluice_team_spend_micros_total" => {
                spend(Level::Team, s.label("team"));
                spend(Level::Org, s.label("org"));
            }
            "sluice_cache_saved_tokens_total" | "sluice_cache_saved_spend_micros_total" => {
                let (Some(t), Some(m)) = (s.label("tier"), s.label("model")) else {
                    continue;
                };
                let slot = out.saved.entry((t.to_string(), m.to_string())).or_default();
                match s.name.contains("spend") {
                    true => slot.1 += s.value,
                    false => slot.0 += s.value,
                }
            }
            name => {
                let Some(level) = Level::ALL.into_iter().find(|l| l.budget_metric() == name) else {
                    continue;
                };
                let (Some(n), Some(kind)) = (s.label(level.as_str()), s.label("kind")) else {
                    continue;
                };
                let slot = out.budgets.entry((level, n.to_string())).or_default();
                // Saturating float → integer cast, on purpose.
                let micros = Some(s.value.max(0.0).round() as u64);
                match kind {
                    "daily" => slot.0 = micros,
                    "monthly" => slot.1 = micros,
                    _ => {}
                }
            }
        }
    }
    out
}

impl Money {
    /// A scrape's body at `now`.
    pub fn observe_text(&self, now: SystemTime, text: &str) {
        let scraped = scrape(text);
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let today = day_of(now);
        match inner.day {
            Some((d, _)) if d == today => {}
            Some(_) => {
                // A new day: counted from its midnight.
                let midnight = UNIX_EPOCH + Duration::from_secs(today * 86_400);
                inner.day = Some((today, midnight));
                inner.spend.values_mut().for_each(|s| s.today = 0.0);
            }
            None => inner.day = Some((today, now)),
        }
        // Names past the cap summed first, then each kept name once.
        let mut totals: BTreeMap<(Level, String), f64> = BTreeMap::new();
        for ((level, name), total) in scraped.spend {
            let name: String = name.chars().take(64).collect();
            let key = (level, name.clone());
            let seen = |l: Level| {
                let old = inner
                    .spend
                    .keys()
                    .filter(|(x, n)| *x == l && !totals.contains_key(&(l, n.clone())));
                old.count() + totals.keys().filter(|(x, _)| *x == l).count()
            };
            let known = inner.spend.contains_key(&key) || totals.contains_key(&key);
            let kept = match known || seen(level) < MAX_NAMES {
                true => name,
                false => OTHER.to_string(),
            };
            *totals.entry((level, kept)).or_default() += total;
        }
        let looked = inner.last_ok.is_some();
        for (key, total) in totals {
            let series = inner.spend.entry(key).or_default();
            series.observe(secs(now), total, looked);
        }
        let mut budgets = BTreeMap::new();
        for ((level, name), b) in scraped.budgets {
            let name = keep(&budgets, level, &name);
            budgets.insert((level, name), b);
        }
        inner.budgets = budgets;
        inner.saved = scraped.saved.into_iter().take(MAX_NAMES * 4).collect();
        inner.last_ok = Some(now);
    }

    /// Each tier's daily budget per caller, micros.
    pub fn tier_budgets(&self) -> BTreeMap<String, u64> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner
            .budgets
            .iter()
            .filter(|((l, _), _)| *l == Level::Tier)
            .filter_map(|((_, n), (daily, _))| Some((n.clone(), (*daily)?)))
            .collect()
    }

    /// `money` of `GET /v1/history` at `now`; `rungs`: the ladder's rows
    /// of the breakers table (`scope` `provider:<name>`), for their state.
    pub fn to_json(&self, now: SystemTime, rungs: &[Value]) -> Value {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((_, since)) = inner.day else {
            return json!({"enabled": inner.last_ok.is_some(), "levels": [], "rungs": [], "saved": []});
        };
        let reset = UNIX_EPOCH + Duration::from_secs((day_of(now) + 1) * 86_400);
        let row = |level: Level, name: &str| {
            let key = (level, name.to_string());
            let series = inner.spend.get(&key);
            let (daily, monthly) = inner.budgets.get(&key).copied().unwrap_or_default();
            let spent = series.map_or(0.0, |s| s.today);
            let per_hour = series.and_then(Series::per_hour);
            // A tier's budget is each caller's: the tier's total never
            // runs out of it (its top spenders do).
            let budget = daily.filter(|_| level != Level::Tier);
            json!({
                "level": level.as_str(),
                "name": name,
                "spent_today_micros": spent.round(),
                "daily_budget_micros": daily,
                "monthly_budget_micros": monthly,
                "per_caller": level == Level::Tier,
                "burn_per_hour_micros": per_hour.map(f64::round),
                "run_out": run_out(spent, budget, per_hour, now, reset).to_json(),
            })
        };
        let mut names: Vec<(Level, String)> = inner.spend.keys().cloned().collect();
        names.extend(inner.budgets.keys().cloned());
        names.sort();
        names.dedup();
        let levels: Vec<Value> = names.iter().map(|(l, n)| row(*l, n)).collect();
        let rungs: Vec<Value> = rungs
            .iter()
            .filter_map(|r| {
                let provider = r["scope"].as_str()?.strip_prefix("provider:")?;
                let mut money = row(Level::Provider, provider);
                money["state"] = r["state"].clone();
                money["reason"] = r["reason"].clone();
                Some(money)
            })
            .collect();
        let saved: Vec<Value> = inner
            .saved
            .iter()
            .map(|((t, m), (tokens, spend))| {
                json!({"tier": t, "model": m, "tokens": tokens, "spend_micros": spend})
            })
            .collect();
        json!({
            "enabled": true,
            "source": "envoy admin /stats/prometheus (sluice_*_spend_*, sluice_cache_saved_*)",
            "day": "UTC",
            "since": rfc3339(since),
            "resets_at": rfc3339(reset),
            "last_scrape": inner.last_ok.map(rfc3339),
            "levels": levels,
            "rungs": rungs,
            "saved": saved,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(s)
    }

    /// 2025-12-07T00:00:00Z, a day boundary.
    const DAY: u64 = 20_429 * 86_400;

    #[test]
    fn run_out_at_the_burn_rate_before_or_after_the_reset() {
        let (now, reset) = (t(DAY + 6 * 3600), t(DAY + 86_400));
        // 1,000 of 10,000 spent at 1,500 an hour: 6 hours left.
        let at = run_out(1000.0, Some(10_000), Some(1500.0), now, reset);
        assert_eq!(at, RunOut::At(t(DAY + 12 * 3600)));
        // At 100 an hour the 9,000 left last 90 hours: past midnight.
        assert_eq!(
            run_out(1000.0, Some(10_000), Some(100.0), now, reset),
            RunOut::AfterReset
        );
        assert_eq!(
            run_out(1000.0, Some(10_000), Some(0.0), now, reset),
            RunOut::Never
        );
        assert_eq!(
            run_out(10_000.0, Some(10_000), Some(5.0), now, reset),
            RunOut::Spent
        );
        assert_eq!(
            run_out(1000.0, Some(10_000), None, now, reset),
            RunOut::Unknown
        );
        assert_eq!(
            run_out(1000.0, None, Some(5.0), now, reset),
            RunOut::NoBudget
        );
    }

    #[test]
    fn burn_rate_is_the_last_hours_rise_per_hour() {
        let mut s = Series::default();
        s.observe(DAY, 500.0, false); // the baseline
        assert_eq!(s.per_hour(), None);
        s.observe(DAY + 30, 530.0, false);
        assert_eq!(s.per_hour(), None, "under a minute of history");
        // 600 in the first 30 minutes: 1,200 an hour.
        s.observe(DAY + 1800, 1100.0, false);
        assert_eq!(s.per_hour(), Some(1200.0));
        // Then nothing for an hour: the hour before now saw 0.
        s.observe(DAY + 1800 + 3600, 1100.0, false);
        assert_eq!(s.per_hour(), Some(0.0));
        assert!(s.samples.len() <= 3, "{:?}", s.samples);
        // Envoy restarted: its new value is new spend.
        s.observe(DAY + 1800 + 3660, 60.0, false);
        assert_eq!(s.today, 660.0);
    }

    fn text(tier: u64, team: u64, provider: u64) -> String {
        format!(
            "sluice_tier_spend_micros_total{{tier=\"pro\"}} {tier}\n\
             sluice_team_spend_micros_total{{team=\"search\",org=\"demo\"}} {team}\n\
             sluice_team_spend_micros_total{{team=\"none\",org=\"demo\"}} 5\n\
             sluice_provider_spend_micros_total{{provider=\"openai\"}} {provider}\n\
             sluice_tier_spend_budget_micros{{tier=\"pro\",kind=\"daily\"}} 2000000\n\
             sluice_org_spend_budget_micros{{org=\"demo\",kind=\"daily\"}} 50000000\n\
             sluice_org_spend_budget_micros{{org=\"demo\",kind=\"monthly\"}} 900000000\n\
             sluice_provider_spend_budget_micros{{provider=\"openai\",kind=\"daily\"}} 1000000\n\
             sluice_cache_saved_tokens_total{{tier=\"pro\",model=\"m\"}} 42\n\
             sluice_cache_saved_spend_micros_total{{tier=\"pro\",model=\"m\"}} 900\n\
             sluice_requests_total{{tier=\"pro\",decision=\"admit\"}} 7\n"
        )
    }

    fn level<'v>(v: &'v Value, level: &str, name: &str) -> &'v Value {
        v["levels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["level"] == level && r["name"] == name)
            .unwrap_or_else(|| panic!("no {level} {name} in {v}"))
    }

    #[test]
    fn spend_today_by_level_against_budgets_and_the_rungs() {
        let m = Money::default();
        let start = DAY + 8 * 3600;
        m.observe_text(t(start), &text(1000, 700, 50));
        m.observe_text(t(start + 600), &text(1600, 900, 250_050));
        let rungs = [json!({"scope": "provider:openai", "state": "closed", "reason": "ok"})];
        let v = m.to_json(t(start + 600), &rungs);
        assert_eq!(
            v["since"], "2025-12-07T08:00:00Z",
            "counted from the first look"
        );
        let pro = level(&v, "tier", "pro");
        assert_eq!(pro["spent_today_micros"], 600.0);
        assert_eq!(pro["per_caller"], true);
        assert_eq!(
            pro["run_out"]["state"], "no_budget",
            "per caller: not the tier's total"
        );
        assert_eq!(level(&v, "team", "search")["spent_today_micros"], 200.0);
        let demo = level(&v, "org", "demo");
        assert_eq!(demo["spent_today_micros"], 200.0);
        assert_eq!(demo["daily_budget_micros"], 50_000_000);
        assert_eq!(demo["monthly_budget_micros"], 900_000_000);
        assert_eq!(demo["burn_per_hour_micros"], 1200.0);
        assert_eq!(demo["run_out"]["state"], "after_reset");
        // The rung: 250,000 in 10 minutes of a 1,000,000 budget: the
        // 750,000 left go in 30 minutes.
        let rung = &v["rungs"][0];
        assert_eq!(rung["name"], "openai");
        assert_eq!(rung["state"], "closed");
        assert_eq!(rung["run_out"]["at"], "2025-12-07T08:40:00Z");
        assert_eq!(
            v["saved"][0],
            json!({"tier": "pro", "model": "m", "tokens": 42.0, "spend_micros": 900.0})
        );
        // The next day counts from its midnight.
        m.observe_text(t(DAY + 86_400 + 60), &text(1700, 900, 250_050));
        let v = m.to_json(t(DAY + 86_400 + 60), &[]);
        assert_eq!(v["since"], "2025-12-08T00:00:00Z");
        assert_eq!(level(&v, "tier", "pro")["spent_today_micros"], 100.0);
    }

    #[test]
    fn a_counter_first_seen_after_the_first_look_counts_from_zero() {
        // Envoy makes a team's counter at its first spend: all of it is new.
        let m = Money::default();
        m.observe_text(t(DAY), "sluice_tier_spend_micros_total{tier=\"pro\"} 0\n");
        m.observe_text(
            t(DAY + 10),
            "sluice_team_spend_micros_total{team=\"search\",org=\"demo\"} 870\n",
        );
        let v = m.to_json(t(DAY + 10), &[]);
        assert_eq!(level(&v, "team", "search")["spent_today_micros"], 870.0);
        assert_eq!(level(&v, "org", "demo")["spent_today_micros"], 870.0);
    }

    #[test]
    fn names_per_level_are_capped() {
        let m = Money::default();
        let body = |n: u64| {
            (0..100)
                .map(|i| format!("sluice_tier_spend_micros_total{{tier=\"t{i:03}\"}} {n}\n"))
                .collect::<String>()
        };
        m.observe_text(t(DAY), &body(0));
        m.observe_text(t(DAY + 60), &body(2));
        let v = m.to_json(t(DAY + 60), &[]);
        let levels = v["levels"].as_array().unwrap();
        assert_eq!(levels.len(), MAX_NAMES + 1);
        assert_eq!(level(&v, "tier", OTHER)["spent_today_micros"], 2.0 * 36.0);
    }
}
