//! What every Envoy of a fleet and every sidecar beside them must agree
//! on, compiled from the policy alone: the fleet's buckets (each with its
//! limit, scope and softness), its concurrency scopes, the fingerprint of
//! both, and where a calendar window ends. The filter's fleet gate
//! (`crate::fleet`) claims by these; the sidecar checks each claim
//! against the same functions, run on its own copy of the policy, so the
//! two never hold a second spelling of the rules.
//!
//! Below admission on purpose: a sidecar learns the contract without
//! compiling the admission engine.

use crate::limits::bucket::next_window;
use crate::limits::reservation::{Rule, Scope};
use crate::policy::keys::hex;
use crate::policy::zone::Zone;
use crate::policy::{Budget, Limit, Mode, Policy, TierConfig, Window};

/// The end of `limit`'s calendar window at `now_ms`; 0 for a token bucket.
pub fn window_end(limit: &Limit, now_ms: u64) -> u64 {
    limit.window.map_or(0, |w| next_window(w, now_ms))
}

/// One fleet bucket as the policy defines it: what the filter claims and
/// what the sidecar checks each claim against.
#[derive(Debug, Clone)]
pub struct FleetRuleDef {
    pub rule: Rule,
    /// A soft cap: taken even past its limit (it never refuses).
    pub soft: bool,
}

/// The fleet buckets of a policy: every bucket it defines but the
/// `fleet.local` ones and the run budgets (each Envoy counts its own
/// runs: a run's record is placed by this Envoy's hash key); none without
/// a `fleet` section.
pub fn fleet_rules(policy: &Policy) -> Vec<FleetRuleDef> {
    let Some(config) = policy.fleet.as_ref() else {
        return Vec::new();
    };
    buckets(policy)
        .into_iter()
        .filter(|d| d.rule.scope != Scope::PerRun)
        .filter(|d| !config.local.iter().any(|l| **l == *d.rule.id))
        .collect()
}

/// The fleet-wide concurrency scopes of a policy and their limits
/// (`concurrency/<backend>`, `concurrency/<backend>/<model>`).
pub fn fleet_slots(policy: &Policy) -> Vec<(String, u32)> {
    let gates = crate::queue::Gates::new(policy);
    let mut out = Vec::new();
    for (backend, g) in gates.groups().filter(|(_, g)| g.fleet) {
        if let Some(l) = g.backend_limit {
            out.push((crate::queue::slots_scope(backend, None), l));
        }
        for (m, l) in &g.model_limits {
            if let Some(l) = l {
                out.push((crate::queue::slots_scope(backend, Some(m)), *l));
            }
        }
    }
    out
}

/// A hash of what must be equal on every Envoy of a fleet for its counts
/// to mean one thing: the salt (it names the keys), the expected replicas
/// (the fair share) and every fleet bucket and slot scope with its limit.
/// Envoys whose fingerprints differ would count in parallel universes (a
/// salt on one Envoy only doubles every limit): their sidecars refuse to
/// count and the Envoys follow `on_unavailable`.
pub fn fingerprint(policy: &Policy) -> String {
    use sha2::Digest;
    let Some(config) = policy.fleet.as_ref() else {
        return String::new();
    };
    let mut lines: Vec<String> = fleet_rules(policy)
        .iter()
        .map(|d| {
            let l = &d.rule.limit;
            format!(
                "rule {} {} {} {} {:?} {:?} {}",
                d.rule.id,
                l.capacity(),
                l.rate.amount,
                l.rate.period_ms,
                l.window,
                d.rule.scope,
                d.soft
            )
        })
        .chain(
            fleet_slots(policy)
                .into_iter()
                .map(|(id, l)| format!("slots {id} {l}")),
        )
        .collect();
    lines.sort();
    let mut h = sha2::Sha256::new();
    h.update(b"sluice-fleet-fingerprint\0");
    h.update(config.salt.as_bytes());
    h.update(b"\0");
    h.update(config.expected_replicas.to_le_bytes());
    for line in lines {
        h.update(line.as_bytes());
        h.update(b"\n");
    }
    hex(&h.finalize()[..16])
}

/// Every bucket a policy defines, in the order admission compiles them
/// (tiers, teams, orgs, models, routes, passthrough rules, providers),
/// with the ids admission gives them. The engine's own list is held equal
/// to this one by the tests below.
fn buckets(policy: &Policy) -> Vec<FleetRuleDef> {
    let zone = policy.budgets.reset_timezone;
    let mut out = Vec::new();
    let mut add = |id: String, limit: Limit, scope: Scope, budget: Option<Budget>| {
        out.push(FleetRuleDef {
            rule: Rule::new(id, limit, scope),
            soft: budget.is_some_and(|b| b.mode == Mode::Soft),
        });
    };
    for (tier, t) in &policy.tiers {
        for (what, limit, budget) in t.anonymous_total.iter().flat_map(|a| limits(a, zone)) {
            add(
                format!("tier/{tier}/anonymous/{what}"),
                limit,
                Scope::Global,
                budget,
            );
        }
        for (what, limit, budget) in limits(t, zone) {
            add(
                format!("tier/{tier}/{what}"),
                limit,
                Scope::PerPrincipal,
                budget,
            );
        }
    }
    for (level, configs) in [("team", &policy.teams), ("org", &policy.orgs)] {
        for (name, t) in configs {
            for (what, limit, budget) in limits(t, zone) {
                add(
                    format!("{level}/{name}/{what}"),
                    limit,
                    Scope::Global,
                    budget,
                );
            }
        }
    }
    for (model, m) in &policy.models {
        for (what, limit) in [("requests", m.requests), ("tokens", m.tokens)] {
            if let Some(limit) = limit {
                add(format!("model/{model}/{what}"), limit, Scope::Global, None);
            }
        }
    }
    for route in &policy.routes {
        let id = format!("route/{}/requests", route.name);
        add(id, route.requests, Scope::Global, None);
    }
    for (n, rule) in policy.passthrough.iter().enumerate() {
        let id = format!("passthrough/{n}/requests");
        add(id, rule.requests, Scope::Global, None);
    }
    for (name, provider) in &policy.providers {
        let spend = TierConfig {
            daily_spend: provider.daily_spend,
            monthly_spend: provider.monthly_spend,
            ..Default::default()
        };
        for (what, limit, budget) in limits(&spend, zone) {
            add(
                format!("provider/{name}/{what}"),
                limit,
                Scope::Global,
                budget,
            );
        }
    }
    for (what, limit, budget) in crate::limits::run_table::run_budgets(policy) {
        add(format!("run/{what}"), limit, Scope::PerRun, Some(budget));
    }
    out
}

/// The limits a tier-like section sets, in the order admission takes
/// them: the rates, then the calendar budgets (spend in micro-currency).
fn limits(t: &TierConfig, zone: Zone) -> Vec<(&'static str, Limit, Option<Budget>)> {
    let rates = [
        ("requests", t.requests),
        ("tokens", t.tokens),
        ("input_tokens", t.input_tokens),
        ("output_tokens", t.output_tokens),
    ];
    let budgets = [
        ("daily_tokens", t.daily_tokens, Window::Day(zone), false),
        (
            "monthly_tokens",
            t.monthly_tokens,
            Window::Month(zone),
            false,
        ),
        ("daily_spend", t.daily_spend, Window::Day(zone), true),
        ("monthly_spend", t.monthly_spend, Window::Month(zone), true),
    ];
    let mut out: Vec<_> = rates
        .into_iter()
        .filter_map(|(what, limit)| Some((what, limit?, None)))
        .collect();
    out.extend(
        budgets
            .into_iter()
            .filter_map(|(what, budget, window, spend)| {
                let b = budget?;
                let units = if spend {
                    (b.limit * 1e6).round() as u64
                } else {
                    b.limit as u64
                };
                Some((what, Limit::windowed(units.max(1), window), Some(b)))
            }),
    );
    out
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::admission::Engine;

    const SALT: &str = "fleet-contract-test-salt";

    fn policy(tiers: Value, mut fleet: Value) -> Policy {
        if let Some(f) = fleet.as_object_mut() {
            f.entry("salt").or_insert(json!(SALT));
        }
        Policy::from_value(json!({
            "default_tier": "t",
            "identity": {"sources": ["client_address"]},
            "tiers": {"t": tiers},
            "sidecar": {"cluster": "sc"},
            "fleet": fleet,
        }))
        .unwrap()
    }

    /// A policy with a bucket of every kind admission compiles.
    fn every_section() -> Value {
        json!({
            "default_tier": "pro",
            "identity": {"sources": ["api_key"], "api_key": {"keys": {
                "s1": {"tier": "pro", "team": "search", "org": "acme"},
                "solo": "free",
            }}},
            "budgets": {"reset_timezone": "Europe/Paris"},
            "tiers": {
                "pro": {"requests": "60/min", "tokens": "10000/min",
                        "input_tokens": "5000/min", "output_tokens": "2000/min",
                        "daily_tokens": {"limit": 1_000, "mode": "soft", "alert_at": "50%"},
                        "monthly_tokens": 100_000, "daily_spend": 1.5, "monthly_spend": 20,
                        "anonymous_total": {"requests": "100/min", "daily_spend": 3}},
                "free": {"requests": "5/min"},
            },
            "teams": {"search": {"requests": "15/min", "daily_tokens": 500}},
            "orgs": {"acme": {"daily_spend": 0.01, "monthly_tokens": {"limit": 9, "mode": "soft"}}},
            "models": {"m": {"requests": "10/s", "tokens": "100/s"}, "free-model": {}},
            "routes": [{"name": "chat", "path_prefix": "/v1/chat", "requests": "10/min"}],
            "passthrough": [{"path": "/v1/audio/transcriptions", "requests": "1/min"}],
            "sidecar": {"cluster": "sc"},
            "providers": {"openai": {
                "models": {"m": "gpt-4o-mini"},
                "prices": {"gpt-4o-mini": {"input": "0.15", "output": "0.60"}},
                "daily_spend": 5, "monthly_spend": 50,
            }},
            "ladder": ["openai"],
            "runs": {"id": {"header": "x-run"}, "ttl": "1h", "tokens": 900, "spend": 0.5},
        })
    }

    /// A bucket as both sides compile it: id, limit and scope.
    fn spelled(rule: &Rule) -> String {
        format!("{} {:?} {:?}", rule.id, rule.limit, rule.scope)
    }

    #[test]
    fn the_contract_names_every_bucket_admission_compiles_with_its_limit_and_scope() {
        let policy = Policy::from_value(every_section()).unwrap();
        let engine = Engine::compile(policy.clone()).unwrap();
        let contract = buckets(&policy);
        let spelled_here: Vec<String> = contract.iter().map(|d| spelled(&d.rule)).collect();
        let compiled: Vec<String> = engine.rules().iter().map(spelled).collect();
        assert_eq!(spelled_here.len(), 23, "{spelled_here:#?}");
        assert_eq!(spelled_here, compiled);
        let soft: Vec<&str> = contract
            .iter()
            .filter(|d| d.soft)
            .map(|d| &*d.rule.id)
            .collect();
        assert_eq!(soft, ["tier/pro/daily_tokens", "org/acme/monthly_tokens"]);
    }

    #[test]
    fn fleet_rules_leave_out_the_local_buckets_and_need_a_fleet_section() {
        let p = policy(
            json!({"requests": "10/min", "daily_tokens": 100}),
            json!({"local": ["tier/t/requests"]}),
        );
        let ids: Vec<String> = fleet_rules(&p)
            .iter()
            .map(|d| d.rule.id.to_string())
            .collect();
        assert_eq!(ids, ["tier/t/daily_tokens"]);
        let mut v = every_section();
        v["tiers"]["free"]["requests"] = json!("6/min");
        assert!(fleet_rules(&Policy::from_value(v).unwrap()).is_empty());
    }

    #[test]
    fn the_fingerprint_changes_with_the_salt_the_replicas_and_the_rules() {
        let fp = |tiers: Value, fleet: Value| fingerprint(&policy(tiers, fleet));
        let base = fp(json!({"requests": "10/min"}), json!({}));
        assert_eq!(base.len(), 32);
        assert_eq!(base, fp(json!({"requests": "10/min"}), json!({})));
        assert_ne!(
            base,
            fp(
                json!({"requests": "10/min"}),
                json!({"salt": "another-salt-0123456789"})
            )
        );
        assert_ne!(
            base,
            fp(
                json!({"requests": "10/min"}),
                json!({"expected_replicas": 2})
            )
        );
        assert_ne!(base, fp(json!({"requests": "11/min"}), json!({})));
        // A bucket kept per Envoy is no fleet rule.
        assert_ne!(
            base,
            fp(
                json!({"requests": "10/min"}),
                json!({"local": ["tier/t/requests"]})
            )
        );
    }
}
