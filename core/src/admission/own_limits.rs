//! A caller's own limits (`GET /v1/sluice/limits` unless the policy's
//! `request.limits_path` says otherwise): what sluice answers itself, so an
//! agent can check before it spends.
//!
//! What it shows, and why nothing more: every bucket the caller is subject
//! to — its tier's per-caller limits (its own count: its own record, or its
//! sketch estimate), its tier's anonymous total when it has no declared key,
//! its team's and org's, each listed model's and route's, each passthrough
//! rule's — with the figure of that bucket alone. A shared bucket (team,
//! org, anonymous total, model, route) shows the one total every member
//! sees; no bucket is per anyone else, so no other caller's name or count
//! can be read here. A provider's budget is the operator's (a caller is
//! never told it, as `admitted_headers` already keeps it from the budget
//! alert), so it is left out. A run's budgets (`runs`) show the run the
//! request names in the run header, or, when it names none, what a new
//! run starts with.
//!
//! Reading is a peek: nothing is reserved or written for the figures. The
//! request itself is admitted like any bodyless request (its request
//! buckets each take one, so the endpoint cannot be used to flood), by the
//! flow (`flow/own_limits.rs`), before the figures are read.

use serde_json::{json, Value};

use super::*;
use crate::admission::answer::rfc3339;
use crate::policy::ConfigError;

/// The level of a bucket, as the answer names it.
fn level_of(id: &str) -> &str {
    id.split('/').next().unwrap_or("")
}

impl Engine {
    /// The limits path, if it is one sluice can answer at: a path in its
    /// canonical form (the form requests are matched in), not one sluice
    /// reads as an LLM API, a declared API or a passthrough rule.
    pub(super) fn check_limits_path(&self) -> Result<(), ConfigError> {
        let Some(path) = self.policy.request.limits_path.as_deref() else {
            return Ok(());
        };
        let at = |why: &str| Err(ConfigError::at("request.limits_path", why));
        if demand::canonical_path(path).ok().as_deref() != Some(path) {
            return at("must be a path in canonical form: starting with `/`, lower case, no escapes, query, empty or dot segment, or trailing slash (e.g. `/v1/sluice/limits`)");
        }
        if Api::of_path(path) != Api::Other {
            return at("is a path sluice reads as an LLM API");
        }
        let declared = ["GET", "POST"]
            .iter()
            .any(|m| self.declared_api(m, path).is_some());
        let passthrough = ["GET", "POST"]
            .iter()
            .any(|m| self.passthrough(m, path) != Api::Other);
        if declared || passthrough {
            return at("is a path the policy's `apis` or `passthrough` already opens");
        }
        Ok(())
    }

    /// Is `canonical` the limits path?
    pub fn is_limits_path(&self, canonical: &str) -> bool {
        self.policy.request.limits_path.as_deref() == Some(canonical)
    }

    /// 405 for any method but `GET` at the limits path (nothing is taken).
    pub fn limits_method_not_allowed(&self, identity: &Identity, method: &str) -> Verdict {
        let shown: String = method
            .chars()
            .filter(char::is_ascii_alphabetic)
            .take(16)
            .collect();
        let refused = Refused::rejected(
            Reason::MethodNotAllowed,
            format!("{shown} is not allowed here: read your limits with GET."),
            None,
        );
        let mut verdict = self.refuse(refused, &identity.tier, None);
        verdict.push_header("allow", "GET");
        verdict
    }

    /// The caller's limits as JSON: each bucket it is subject to, read
    /// without taking anything, and the models it may ask for.
    pub fn own_limits(&self, store: &dyn SharedStore, identity: &Identity, now_ms: u64) -> Value {
        let reserver = self.reserver(store);
        let none = Vec::new();
        let mine = |map: &HashMap<String, Vec<usize>>, name: Option<&str>| {
            name.and_then(|n| map.get(n)).unwrap_or(&none).clone()
        };
        let tier = self.tier_buckets.get(&identity.tier).unwrap_or(&none);
        let mut indexes: Vec<usize> = tier
            .iter()
            .copied()
            .filter(|&i| !(identity.declared && self.buckets[i].anonymous))
            .collect();
        indexes.extend(mine(&self.team_buckets, identity.team.as_deref()));
        indexes.extend(mine(&self.org_buckets, identity.org.as_deref()));
        for model in self.policy.models.keys() {
            indexes.extend(mine(&self.model_buckets, Some(model)));
        }
        indexes.extend(self.route_buckets.iter().map(|(_, i)| *i));
        indexes.extend(self.passthrough.iter().map(|(_, i)| *i));
        // A run's budgets: the run the request names (its record), or what
        // a new run starts with.
        indexes.extend(self.run_buckets.iter().copied());
        let limits: Vec<Value> = indexes
            .into_iter()
            .filter(|&i| !self.is_provider_bucket(i))
            .map(|i| self.limit_entry(&reserver, i, identity, now_ms))
            .collect();
        json!({
            "object": "sluice.limits",
            "at": rfc3339(now_ms),
            "tier": identity.tier,
            "team": identity.team,
            "org": identity.org,
            "declared_key": identity.declared,
            "run_named": identity.run.is_some(),
            "limits": limits,
            "models": self.policy.models.keys().collect::<Vec<_>>(),
            "unlisted_models": self.policy.unlisted_models.is_some(),
        })
    }

    /// One bucket as the caller sees it.
    fn limit_entry(
        &self,
        reserver: &Reserver,
        i: usize,
        identity: &Identity,
        now_ms: u64,
    ) -> Value {
        let b = &self.buckets[i];
        let claim = Claim::hard(&b.rule, 1);
        let q = reserver.peek(&claim, admit::caller(identity), now_ms);
        // A run's budget comes back whole once the run goes unused for
        // its `ttl` (`limits/run_table.rs`): at the latest, ttl from now.
        let reset_ms = match b.rule.scope {
            Scope::PerRun => self.policy.runs.as_ref().map_or(0, |r| r.ttl_ms),
            _ => q.reset_ms,
        };
        let reset_s = reset_ms.div_ceil(1000);
        let (unit, amount): (&str, fn(u64) -> Value) = match b.meter {
            Meter::Requests => ("requests", |n| json!(n)),
            Meter::Tokens => ("tokens", |n| json!(n)),
            Meter::InputTokens => ("input_tokens", |n| json!(n)),
            Meter::OutputTokens => ("output_tokens", |n| json!(n)),
            // Millionths of the prices' currency, shown in the currency.
            Meter::Spend => ("currency", |n| json!(n as f64 / 1e6)),
        };
        let kind = match b.rule.limit.window {
            None if b.rule.scope == Scope::PerRun => "run",
            None => "rate",
            Some(Window::Day(_)) => "daily",
            Some(Window::Month(_)) => "monthly",
        };
        let scope = match b.rule.scope {
            Scope::PerPrincipal => "caller",
            Scope::Global => "shared",
            Scope::PerRun => "run",
        };
        json!({
            "id": &*b.rule.id,
            "name": b.name,
            "level": level_of(&b.rule.id),
            "scope": scope,
            "kind": kind,
            "limit_text": b.rule.limit.describe(),
            "unit": unit,
            "limit": amount(q.limit),
            "remaining": amount(q.remaining),
            "reset_at": rfc3339(now_ms.saturating_add(reset_s.saturating_mul(1000))),
            "reset_seconds": reset_s,
            "hard": !b.soft,
            "refuse_with": b.refuse_with,
        })
    }
}
