//! `rules:`, `saturation:`, `breaker:` and `scopes:`: the breaker rules per
//! scope, compiled into the [`crate::breaker`] engine's own types (the check
//! is the compilation).

use std::collections::BTreeSet;
use std::time::Duration;

use serde::Deserialize;

use super::field::{duration, invalid, ConfigError};
use super::sources::{BackendConfig, BackendKind};
use crate::breaker::{Metric, OnStale, Policy, Rule};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    pub metric: Metric,
    pub open_at: f64,
    /// Defaults to `open_at` (no hysteresis band).
    pub close_below: Option<f64>,
    #[serde(deserialize_with = "duration", default = "default_open_for")]
    pub open_for: Duration,
    #[serde(deserialize_with = "duration", default = "default_close_after")]
    pub close_after: Duration,
}

fn default_open_for() -> Duration {
    Duration::from_secs(30)
}

fn default_close_after() -> Duration {
    Duration::from_secs(10)
}

impl From<Rule> for RuleConfig {
    fn from(r: Rule) -> Self {
        RuleConfig {
            metric: r.metric,
            open_at: r.open_at,
            close_below: Some(r.close_below),
            open_for: r.open_for,
            close_after: r.close_after,
        }
    }
}

impl RuleConfig {
    fn to_rule(&self, path: &str) -> Result<Rule, ConfigError> {
        let close_below = self.close_below.unwrap_or(self.open_at);
        if !self.open_at.is_finite() || !close_below.is_finite() {
            return Err(invalid(path, "thresholds must be finite numbers"));
        }
        if close_below > self.open_at {
            return Err(invalid(
                format!("{path}.close_below"),
                format!(
                    "{close_below} is above open_at {}: hysteresis needs close_below <= open_at",
                    self.open_at
                ),
            ));
        }
        Ok(Rule {
            metric: self.metric,
            open_at: self.open_at,
            close_below,
            open_for: self.open_for,
            close_after: self.close_after,
        })
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    pub half_open_fraction: f64,
    #[serde(deserialize_with = "duration")]
    pub half_open_for: Duration,
    #[serde(deserialize_with = "duration")]
    pub retry_after: Duration,
    #[serde(deserialize_with = "duration")]
    pub stale_after: Duration,
    pub on_stale: OnStale,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        let p = Policy::default();
        BreakerConfig {
            half_open_fraction: p.half_open_fraction,
            half_open_for: p.half_open_for,
            retry_after: p.retry_after,
            stale_after: p.stale_after,
            on_stale: p.on_stale,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeConfig {
    /// `backend:NAME` or `model:NAME`, as the filter looks it up.
    pub scope: String,
    /// Backends whose signals feed it.
    #[serde(default)]
    pub backends: Vec<String>,
    /// GPU indexes that feed it; absent: all; `[]`: none.
    #[serde(default)]
    pub gpus: Option<Vec<u32>>,
    /// Its own rules instead of the top-level ones.
    #[serde(default)]
    pub rules: Option<Vec<RuleConfig>>,
}

/// One scope ready for the engine and the monitor.
#[derive(Debug, Clone, PartialEq)]
pub struct ScopePlan {
    pub scope: String,
    /// Indexes into [`Config::backends`].
    pub backends: Vec<usize>,
    pub gpus: Option<Vec<u32>>,
    pub rules: Vec<Rule>,
}

impl BreakerConfig {
    pub fn check(&self) -> Result<(), ConfigError> {
        let f = self.half_open_fraction;
        if !(0.0..=1.0).contains(&f) {
            return Err(invalid(
                "breaker.half_open_fraction",
                format!("{f} is not between 0 and 1"),
            ));
        }
        Ok(())
    }
}

/// Every scope `backend:NAME` or `model:NAME`, each once.
pub fn check_scopes(scopes: &[ScopeConfig]) -> Result<(), ConfigError> {
    let mut seen = BTreeSet::new();
    for (i, s) in scopes.iter().enumerate() {
        let at = format!("scopes[{i}].scope");
        let well_named = ["backend:", "model:"]
            .iter()
            .any(|p| s.scope.strip_prefix(p).is_some_and(|rest| !rest.is_empty()));
        if !well_named {
            return Err(invalid(
                at,
                format!("`{}` is not `backend:NAME` or `model:NAME`", s.scope),
            ));
        }
        if !seen.insert(s.scope.as_str()) {
            return Err(invalid(at, format!("`{}` is used twice", s.scope)));
        }
    }
    Ok(())
}

impl BreakerConfig {
    /// The engine's policy.
    pub fn policy(&self) -> Policy {
        Policy {
            half_open_fraction: self.half_open_fraction,
            half_open_for: self.half_open_for,
            retry_after: self.retry_after,
            stale_after: self.stale_after,
            on_stale: self.on_stale,
        }
    }
}

/// The saturation rules, checked.
pub fn saturation_rules(saturation: &[RuleConfig]) -> Result<Vec<Rule>, ConfigError> {
    saturation
        .iter()
        .enumerate()
        .map(|(i, r)| r.to_rule(&format!("saturation[{i}]")))
        .collect()
}

/// The scopes, explicit or derived (see [`Config::scopes`](super::Config)):
/// `rules` for every scope without its own, `backends` as
/// [`Config::backends`](super::Config::backends) lists them.
pub fn scope_plans(
    rules: &[RuleConfig],
    scopes: &[ScopeConfig],
    backends: &[(BackendKind, &BackendConfig)],
) -> Result<Vec<ScopePlan>, ConfigError> {
    {
        let rules = rules
            .iter()
            .enumerate()
            .map(|(i, r)| r.to_rule(&format!("rules[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        if scopes.is_empty() {
            if backends.is_empty() {
                return Ok(vec![ScopePlan {
                    scope: "backend:local".into(),
                    backends: Vec::new(),
                    gpus: None,
                    rules,
                }]);
            }
            let mut plans = Vec::new();
            for (i, (_, b)) in backends.iter().enumerate() {
                plans.push(ScopePlan {
                    scope: format!("backend:{}", b.name),
                    backends: vec![i],
                    gpus: None,
                    rules: rules.clone(),
                });
                for m in &b.models {
                    plans.push(ScopePlan {
                        scope: format!("model:{m}"),
                        backends: vec![i],
                        gpus: None,
                        rules: rules.clone(),
                    });
                }
            }
            return Ok(plans);
        }
        scopes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let at = format!("scopes[{i}]");
                let backends = s
                    .backends
                    .iter()
                    .enumerate()
                    .map(|(j, name)| {
                        backends
                            .iter()
                            .position(|(_, b)| &b.name == name)
                            .ok_or_else(|| {
                                invalid(
                                    format!("{at}.backends[{j}]"),
                                    format!("no backend named `{name}`"),
                                )
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let rules = match &s.rules {
                    None => rules.clone(),
                    Some(own) => own
                        .iter()
                        .enumerate()
                        .map(|(j, r)| r.to_rule(&format!("{at}.rules[{j}]")))
                        .collect::<Result<Vec<_>, _>>()?,
                };
                Ok(ScopePlan {
                    scope: s.scope.clone(),
                    backends,
                    gpus: s.gpus.clone(),
                    rules,
                })
            })
            .collect()
    }
}
