//! `tiers`, `teams`, `orgs` and `default_tier`: the limits of each level
//! of callers.

use serde::Deserialize;

use crate::policy::units::{MAX_UNITS, SCALE};
use crate::policy::{Budget, ConfigError, Limit, Policy};

/// Limits per caller of a tier. Token amounts count input + output unless
/// the name says otherwise.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConfig {
    /// Requests per caller.
    pub requests: Option<Limit>,
    /// Total tokens per caller, a token bucket (`20000/min`).
    pub tokens: Option<Limit>,
    pub input_tokens: Option<Limit>,
    pub output_tokens: Option<Limit>,
    /// Tokens per UTC day (resets 00:00 UTC).
    pub daily_tokens: Option<Budget>,
    /// Tokens per UTC calendar month (resets the 1st, 00:00 UTC).
    pub monthly_tokens: Option<Budget>,
    /// Spend per UTC day, in the currency of the model prices.
    pub daily_spend: Option<Budget>,
    pub monthly_spend: Option<Budget>,
    /// Limits on all callers of this tier together whose API key is not
    /// declared under `identity.api_key.keys` (JWT subjects, trusted
    /// headers, addresses, undeclared keys): the same fields as above,
    /// counted once for all of them (`anonymous_total: {requests: 600/min}`).
    /// A flood of new identities takes at most this.
    pub anonymous_total: Option<Box<TierConfig>>,
    /// The workload class of this tier's callers (a name under `classes`).
    pub class: Option<String>,
}

/// `default_tier` names a tier; only tiers have an anonymous total (one
/// level deep); every budget can be counted.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    if !p.tiers.contains_key(&p.default_tier) {
        return Err(ConfigError::at(
            "default_tier",
            format!("tier `{}` is not defined under `tiers`", p.default_tier),
        ));
    }
    for (name, t) in p
        .teams
        .iter()
        .map(|(n, t)| (format!("teams.{n}"), t))
        .chain(p.orgs.iter().map(|(n, t)| (format!("orgs.{n}"), t)))
    {
        if t.anonymous_total.is_some() {
            return Err(ConfigError::at(
                format!("{name}.anonymous_total"),
                "only tiers have an anonymous total (a team or org limit already counts all its members together)",
            ));
        }
    }
    let levels = p
        .tiers
        .iter()
        .map(|(n, t)| (format!("tiers.{n}"), t))
        .chain(p.teams.iter().map(|(n, t)| (format!("teams.{n}"), t)))
        .chain(p.orgs.iter().map(|(n, t)| (format!("orgs.{n}"), t)));
    for (level, t) in levels {
        let total = t.anonymous_total.as_deref();
        if total.is_some_and(|a| a.anonymous_total.is_some()) {
            return Err(ConfigError::at(
                format!("{level}.anonymous_total.anonymous_total"),
                "an anonymous total has no anonymous total of its own",
            ));
        }
        t.check_budgets(&level)?;
        if let Some(total) = total {
            total.check_budgets(&format!("{level}.anonymous_total"))?;
        }
    }
    Ok(())
}

impl TierConfig {
    /// Token budgets are whole numbers and every budget fits the counters.
    fn check_budgets(&self, prefix: &str) -> Result<(), ConfigError> {
        for (field, budget) in [
            ("daily_tokens", self.daily_tokens),
            ("monthly_tokens", self.monthly_tokens),
        ] {
            let Some(b) = budget else { continue };
            if b.limit.fract() != 0.0 {
                return Err(ConfigError::at(
                    format!("{prefix}.{field}.limit"),
                    "a token budget is a whole number",
                ));
            }
            if b.limit > MAX_UNITS as f64 {
                return Err(ConfigError::at(
                    format!("{prefix}.{field}.limit"),
                    format!("too large (at most {MAX_UNITS} tokens)"),
                ));
            }
        }
        // Spend is counted in millionths of the currency.
        let max_spend = (MAX_UNITS / SCALE) as f64;
        for (field, budget) in [
            ("daily_spend", self.daily_spend),
            ("monthly_spend", self.monthly_spend),
        ] {
            if budget.is_some_and(|b| b.limit > max_spend) {
                return Err(ConfigError::at(
                    format!("{prefix}.{field}.limit"),
                    format!("too large (at most {max_spend})"),
                ));
            }
        }
        Ok(())
    }
}
