//! Where the money goes, in Envoy's stats: settled spend by tier and by
//! team and org, and the policy's spend budgets as gauges, so a reader of
//! the stats alone (the sidecar's operator page, a dashboard) can set
//! each level's spend against its budget. Every label comes from the
//! policy: a caller cannot add a series.

use crate::admission::identity::Identity;
use crate::host::metrics::{self, Metric};
use crate::host::Host;
use crate::policy::{Budget, Policy};

/// A settled request's spend, by its caller's tier and, when it has them,
/// team and org.
pub(super) fn count_spend(host: &dyn Host, tier: &str, identity: Option<&Identity>, cost: u64) {
    let cost = i64::try_from(cost).unwrap_or(i64::MAX);
    metrics::TIER_SPEND.add_at(host, &[tier], cost);
    if let Some(id) = identity.filter(|id| id.team.is_some() || id.org.is_some()) {
        let team = id.team.as_deref().unwrap_or("none");
        let org = id.org.as_deref().unwrap_or("none");
        metrics::TEAM_SPEND.add_at(host, &[team, org], cost);
    }
}

/// A budget's amount in micro-currency (the policy caps amounts far
/// below what a `u64` holds).
fn micros(b: &Budget) -> u64 {
    (b.limit * 1e6).round().max(0.0) as u64
}

/// Sets the gauge of each spend budget the policy declares, and defines
/// each level's spend counter at 0, so the page and the dashboards show
/// every budget before anything is spent.
pub fn define_budgets(host: &dyn Host, policy: &Policy) {
    let set = |gauge: Metric, name: &str, daily: &Option<Budget>, monthly: &Option<Budget>| {
        for (kind, budget) in [("daily", daily), ("monthly", monthly)] {
            if let Some(b) = budget {
                gauge.record_at(host, &[name, kind], micros(b));
            }
        }
    };
    for (name, t) in &policy.tiers {
        set(
            metrics::TIER_SPEND_BUDGET,
            name,
            &t.daily_spend,
            &t.monthly_spend,
        );
        metrics::TIER_SPEND.define_at(host, &[name]);
    }
    for (name, t) in &policy.teams {
        set(
            metrics::TEAM_SPEND_BUDGET,
            name,
            &t.daily_spend,
            &t.monthly_spend,
        );
    }
    for (name, o) in &policy.orgs {
        set(
            metrics::ORG_SPEND_BUDGET,
            name,
            &o.daily_spend,
            &o.monthly_spend,
        );
    }
    // The teams and orgs the declared keys name, and what the cache may
    // save by tier and cached model: each at 0 before it happens.
    let keys = policy.identity.api_key.as_ref().map(|k| &k.keys);
    for entry in keys.into_iter().flat_map(|k| k.values()) {
        if entry.team.is_some() || entry.org.is_some() {
            let team = entry.team.as_deref().unwrap_or("none");
            metrics::TEAM_SPEND.define_at(host, &[team, entry.org.as_deref().unwrap_or("none")]);
        }
    }
    let cached = policy.cache_compiled.as_ref().map(|c| &c.models);
    for model in cached.into_iter().flat_map(|m| m.keys()) {
        for tier in policy.tiers.keys() {
            metrics::CACHE_SAVED_TOKENS.define_at(host, &[tier, model]);
            metrics::CACHE_SAVED_SPEND.define_at(host, &[tier, model]);
        }
    }
    for (name, p) in &policy.providers {
        set(
            metrics::PROVIDER_SPEND_BUDGET,
            name,
            &p.daily_spend,
            &p.monthly_spend,
        );
        metrics::PROVIDER_SPEND.define_at(host, &[name]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;
    use serde_json::json;

    #[test]
    fn every_spend_budget_of_the_policy_is_a_gauge_in_micros() {
        let policy = Policy::load(json!({
            "default_tier": "free",
            "tiers": {"free": {"daily_spend": "2.50"}, "pro": {"monthly_spend": 100}},
            "teams": {"search": {"daily_spend": 10}},
            "orgs": {"demo": {"daily_spend": {"limit": 50, "alert_at": "80%"}}},
            "identity": {"api_key": {"keys": {"k1": {"tier": "pro", "team": "search", "org": "demo"}}}},
        }))
        .unwrap();
        let host = MockHost::new(0);
        define_budgets(&host, &policy);
        let at = |m: Metric, v: &[&str]| host.metric(&m.named(v));
        assert_eq!(
            at(metrics::TIER_SPEND_BUDGET, &["free", "daily"]),
            Some(2_500_000)
        );
        assert_eq!(
            at(metrics::TIER_SPEND_BUDGET, &["pro", "monthly"]),
            Some(100_000_000)
        );
        assert_eq!(at(metrics::TIER_SPEND_BUDGET, &["pro", "daily"]), None);
        assert_eq!(
            at(metrics::TEAM_SPEND_BUDGET, &["search", "daily"]),
            Some(10_000_000)
        );
        assert_eq!(
            at(metrics::ORG_SPEND_BUDGET, &["demo", "daily"]),
            Some(50_000_000)
        );
        assert_eq!(at(metrics::TIER_SPEND, &["pro"]), Some(0));
        assert_eq!(at(metrics::TEAM_SPEND, &["search", "demo"]), Some(0));
    }

    #[test]
    fn spend_is_counted_by_tier_and_by_team_and_org() {
        let host = MockHost::new(0);
        let mut id = Identity {
            principal: "key:ab".into(),
            hash: 1,
            tier: "pro".into(),
            source: None,
            declared: true,
            team: Some("search".into()),
            org: None,
            run: None,
        };
        count_spend(&host, "pro", Some(&id), 300);
        id.team = None;
        count_spend(&host, "pro", Some(&id), 7);
        assert_eq!(host.metric(&metrics::TIER_SPEND.named(&["pro"])), Some(307));
        let team = |v: &[&str]| host.metric(&metrics::TEAM_SPEND.named(v));
        assert_eq!(team(&["search", "none"]), Some(300));
        assert_eq!(
            team(&["none", "none"]),
            None,
            "no team and no org: not counted there"
        );
    }
}
