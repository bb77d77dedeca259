//! The sidecar's own config file (YAML): where to listen, what to watch,
//! the breaker rules and scopes, admin, alerts. Every field has a default,
//! so no file at all is a working config. Unknown fields are refused and
//! every error names the field path (`sources.vllm[0].url: …`).

pub mod admin;
pub mod alerts;
pub mod breaker;
pub mod cache;
pub mod envoy_admin;
pub mod field;
pub mod fleet;
pub mod history;
pub mod policy;
pub mod sources;

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

pub use self::admin::{AdminConfig, ConnectionsConfig, LongPollConfig};
pub use self::alerts::{AlertsConfig, WebhookConfig, WebhookFormat};
pub use self::breaker::{BreakerConfig, RuleConfig, ScopeConfig, ScopePlan};
pub use self::field::ConfigError;
use self::field::{duration, invalid};
pub use self::sources::{BackendConfig, BackendKind, GpuMode, Sources};
use crate::breaker::{Policy, Rule};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `host:port`; port 0 picks a free one.
    pub listen: String,
    /// How often every source is read and the breakers evaluated.
    #[serde(deserialize_with = "duration")]
    pub scrape_interval: Duration,
    /// Per HTTP scrape.
    #[serde(deserialize_with = "duration")]
    pub scrape_timeout: Duration,
    pub sources: Sources,
    /// Rules for every scope that does not list its own.
    pub rules: Vec<RuleConfig>,
    /// Saturation rules, for every scope (e.g. `vllm_requests_waiting`
    /// ≥ 20): past one, the scope is reported `saturated` (beside `open`),
    /// and sluice queues batch traffic and refuses interactive traffic
    /// instead of refusing all. Empty: no saturation state.
    pub saturation: Vec<RuleConfig>,
    pub breaker: BreakerConfig,
    /// Empty: one scope `backend:NAME` per backend plus `model:M` per model
    /// it lists; with no backends at all, one scope `backend:local` fed by
    /// the GPUs.
    pub scopes: Vec<ScopeConfig>,
    pub admin: AdminConfig,
    /// How many `/v1/state` long polls may be held at once.
    pub long_poll: LongPollConfig,
    /// How many connections the API holds, and how long and how large a
    /// request's head may be (see [`crate::listen`]).
    pub connections: ConnectionsConfig,
    /// Where the kill switch is kept across restarts; none: not kept.
    pub state_file: Option<PathBuf>,
    pub alerts: AlertsConfig,
    /// What the operator page keeps (see [`crate::watch::history`]).
    pub history: history::HistoryConfig,
    /// Envoy's admin, read for requests per tier (see [`crate::watch::traffic`]).
    pub envoy_admin: Option<envoy_admin::EnvoyAdminConfig>,
    /// Redis, for the fleet (see `fleet`); none: this sidecar is no fleet agent.
    pub fleet: Option<fleet::FleetConfig>,
    /// The response cache's store (see `crate::cache`); none: no cache endpoints.
    pub cache: Option<cache::CacheConfig>,
    /// Host names the API answers to besides `localhost`, IP addresses and
    /// `sluice_sidecar` (see [`crate::door`]); any other `Host` gets 421.
    pub allowed_hosts: Vec<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:9911".into(),
            scrape_interval: Duration::from_secs(2),
            scrape_timeout: Duration::from_secs(1),
            sources: Sources::default(),
            rules: Rule::defaults().into_iter().map(RuleConfig::from).collect(),
            saturation: Vec::new(),
            breaker: BreakerConfig::default(),
            scopes: Vec::new(),
            admin: AdminConfig::default(),
            long_poll: LongPollConfig::default(),
            connections: ConnectionsConfig::default(),
            state_file: None,
            alerts: AlertsConfig::default(),
            history: Default::default(),
            envoy_admin: None,
            fleet: None,
            cache: None,
            allowed_hosts: Vec::new(),
        }
    }
}

impl Config {
    /// Parses and checks a YAML config.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let de = serde_yaml::Deserializer::from_str(text);
        let config: Config = match serde_path_to_error::deserialize(de) {
            Ok(c) => c,
            Err(e) => {
                let path = e.path().to_string();
                let inner = e.into_inner();
                return Err(ConfigError::Parse(if path == "." {
                    inner.to_string()
                } else {
                    format!("{path}: {inner}")
                }));
            }
        };
        config.validate()?;
        Ok(config)
    }

    /// Every backend, vLLM ones first, then Ollama, llama.cpp, DCGM, with its kind.
    pub fn backends(&self) -> Vec<(BackendKind, &BackendConfig)> {
        let vllm = self.sources.vllm.iter().map(|b| (BackendKind::Vllm, b));
        let ollama = self.sources.ollama.iter().map(|b| (BackendKind::Ollama, b));
        let llamacpp = (self.sources.llamacpp.iter()).map(|b| (BackendKind::LlamaCpp, b));
        let dcgm =
            (self.sources.dcgm.iter().enumerate()).map(|(i, d)| (BackendKind::Dcgm(i), &d.backend));
        vllm.chain(ollama).chain(llamacpp).chain(dcgm).collect()
    }

    pub fn policy(&self) -> Policy {
        self.breaker.policy()
    }

    /// The saturation rules, checked.
    pub fn saturation_rules(&self) -> Result<Vec<Rule>, ConfigError> {
        breaker::saturation_rules(&self.saturation)
    }

    /// The scopes, explicit or derived (see [`Config::scopes`]).
    pub fn scope_plans(&self) -> Result<Vec<ScopePlan>, ConfigError> {
        breaker::scope_plans(&self.rules, &self.scopes, &self.backends())
    }

    /// Each section's own check, then the checks across sections.
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(c) = &self.cache {
            c.check(self.fleet.is_some())
                .map_err(|(path, message)| ConfigError::Invalid { path, message })?;
        }
        self.saturation_rules()?;
        if self.scrape_interval.is_zero() {
            return Err(invalid("scrape_interval", "must be more than 0"));
        }
        if self.scrape_timeout.is_zero() {
            return Err(invalid("scrape_timeout", "must be more than 0"));
        }
        if self.breaker.stale_after <= self.scrape_interval {
            return Err(invalid(
                "breaker.stale_after",
                format!(
                    "{} is not longer than scrape_interval {}: every scope would go stale between scrapes",
                    humantime::format_duration(self.breaker.stale_after),
                    humantime::format_duration(self.scrape_interval)
                ),
            ));
        }
        self.breaker.check()?;
        self.long_poll.check()?;
        self.connections.check()?;
        self.sources.check()?;
        self.sources
            .check_dcgm(self.breaker.stale_after)
            .map_err(|(at, m)| field::invalid(at, m))?;
        breaker::check_scopes(&self.scopes)?;
        self.alerts.check()?;
        self.history.check()?;
        if let Some(e) = &self.envoy_admin {
            e.check()?;
        }
        admin::check_allowed_hosts(&self.allowed_hosts)?;
        self.scope_plans().map(|_| ())
    }
}

/// Lines to say about a config whose DCGM sources feed scopes that watch
/// no `gpu_xid_errors` (XIDs then open nothing).
pub fn dcgm_warnings(config: &Config, plans: &[ScopePlan]) -> Vec<String> {
    let backends = config.backends();
    let mut out = Vec::new();
    for plan in plans {
        let fed_by = plan.backends.iter().find_map(|&i| match backends.get(i) {
            Some((crate::config::BackendKind::Dcgm(_), b)) => Some(b.name.as_str()),
            _ => None,
        });
        let Some(source) = fed_by else { continue };
        if !plan
            .rules
            .iter()
            .any(|r| r.metric == crate::breaker::Metric::GpuXidErrors)
        {
            out.push(format!(
                "scope {} takes DCGM source `{source}` but no rule watches gpu_xid_errors: XID errors open no breaker there",
                plan.scope
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::{Metric, Policy};

    fn err(text: &str) -> String {
        Config::from_yaml(text).unwrap_err().to_string()
    }

    #[test]
    fn empty_is_the_defaults() {
        let c = Config::from_yaml("{}").unwrap();
        assert_eq!(c.listen, "127.0.0.1:9911");
        assert_eq!(c.sources.gpu, GpuMode::Auto);
        assert_eq!(c.policy(), Policy::default());
        let plans = c.scope_plans().unwrap();
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].scope, "backend:local");
        assert_eq!(plans[0].rules, Rule::defaults());
    }

    #[test]
    fn the_shipped_example_parses() {
        let c = Config::from_yaml(include_str!("../../sidecar.example.yaml")).unwrap();
        assert!(!c.sources.vllm.is_empty());
        assert!(!c.scope_plans().unwrap().is_empty());
    }

    #[test]
    fn default_scopes_come_from_backends_and_models() {
        let c = Config::from_yaml(
            "sources:\n  vllm:\n    - {name: a, url: 'http://127.0.0.1:8000', models: ['llama3.1:70b']}\n  ollama:\n    - {name: o, url: 'http://127.0.0.1:11434'}\n",
        )
        .unwrap();
        let names: Vec<_> = c
            .scope_plans()
            .unwrap()
            .into_iter()
            .map(|p| (p.scope, p.backends))
            .collect();
        assert_eq!(
            names,
            vec![
                ("backend:a".into(), vec![0]),
                ("model:llama3.1:70b".into(), vec![0]),
                ("backend:o".into(), vec![1]),
            ]
        );
    }

    #[test]
    fn a_llamacpp_backend_is_a_scope_and_shares_the_name_space() {
        let c = Config::from_yaml(
            "sources:\n  vllm:\n    - {name: a, url: 'http://127.0.0.1:8000'}\n  llamacpp:\n    - {name: l, url: 'http://127.0.0.1:8080', models: [smollm2]}\n",
        )
        .unwrap();
        let kinds: Vec<_> = c
            .backends()
            .into_iter()
            .map(|(k, b)| (k, b.name.as_str()))
            .collect();
        assert_eq!(
            kinds,
            vec![(BackendKind::Vllm, "a"), (BackendKind::LlamaCpp, "l")]
        );
        let scopes: Vec<_> = (c.scope_plans().unwrap().into_iter())
            .map(|p| (p.scope, p.backends))
            .collect();
        assert_eq!(
            scopes,
            vec![
                ("backend:a".into(), vec![0]),
                ("backend:l".into(), vec![1]),
                ("model:smollm2".into(), vec![1]),
            ]
        );
        let e = err("sources:\n  vllm:\n    - {name: a, url: 'http://x:1'}\n  llamacpp:\n    - {name: a, url: 'http://x:2'}\n");
        assert!(e.starts_with("sources.llamacpp[0].name"), "{e}");
        let e = err("sources:\n  llamacpp:\n    - {name: l, url: 'https://x'}\n");
        assert!(e.starts_with("sources.llamacpp[0].url"), "{e}");
    }

    #[test]
    fn rule_defaults_fill_in() {
        let c = Config::from_yaml("rules:\n  - {metric: ttft_p99, open_at: 5}\n").unwrap();
        let plans = c.scope_plans().unwrap();
        assert_eq!(
            plans[0].rules,
            vec![Rule {
                metric: Metric::TtftP99,
                open_at: 5.0,
                close_below: 5.0,
                open_for: Duration::from_secs(30),
                close_after: Duration::from_secs(10),
            }]
        );
    }

    #[test]
    fn errors_name_the_field_path() {
        assert!(
            err("listen: 1\nlisen: x\n").contains("lisen"),
            "{}",
            err("lisen: x\n")
        );
        let e = err("sources:\n  vllm:\n    - {name: a, url: 'http://x:1', modles: []}\n");
        assert!(e.starts_with("sources.vllm[0]"), "{e}");
        assert!(e.contains("modles"), "{e}");
        let e = err("rules:\n  - {metric: gpu_utilisation, open_at: 90}\n");
        assert!(e.starts_with("rules[0].metric"), "{e}");
        let e = err("breaker:\n  stale_after: soon\n");
        assert!(e.starts_with("breaker.stale_after"), "{e}");
        let e = err("rules:\n  - {metric: kv_cache, open_at: 0.8, close_below: 0.9}\n");
        assert!(e.starts_with("rules[0].close_below"), "{e}");
        let e = err("scopes:\n  - {scope: 'model:x', backends: [nope]}\n");
        assert!(e.starts_with("scopes[0].backends[0]"), "{e}");
        let e = err("scopes:\n  - {scope: 'gpu'}\n");
        assert!(e.starts_with("scopes[0].scope"), "{e}");
        let e = err("sources:\n  vllm:\n    - {name: a, url: 'https://x'}\n");
        assert!(e.starts_with("sources.vllm[0].url"), "{e}");
        let e = err("alerts:\n  webhooks:\n    - {url: 'http://x:1/', format: telegram}\n");
        assert!(e.starts_with("alerts.webhooks[0].chat_id"), "{e}");
        let e = err("scrape_interval: 30s\n");
        assert!(e.starts_with("breaker.stale_after"), "{e}");
        let e = err("breaker: {half_open_fraction: 2}\n");
        assert!(e.starts_with("breaker.half_open_fraction"), "{e}");
        let e = err("sources:\n  vllm:\n    - {name: a, url: 'http://x:1'}\n  ollama:\n    - {name: a, url: 'http://x:2'}\n");
        assert!(e.starts_with("sources.ollama[0].name"), "{e}");
        let e = err("long_poll: {max_held: 0}\n");
        assert!(e.starts_with("long_poll.max_held"), "{e}");
        let e = err("long_poll: {max_held: 8, reserved: 8}\n");
        assert!(e.starts_with("long_poll.reserved"), "{e}");
        let e = err("connections: {max: 8, reserved: 8}\n");
        assert!(e.starts_with("connections.reserved"), "{e}");
        let e = err("connections: {header_timeout: 10m}\n");
        assert!(e.starts_with("connections.header_timeout"), "{e}");
        let e = err("connections: {max_header_bytes: 100}\n");
        assert!(e.starts_with("connections.max_header_bytes"), "{e}");
        let e = err("connections: {max: 0}\n");
        assert!(e.starts_with("connections.max"), "{e}");
        let e = err("long_poll: {max_held: 8, spare: 1}\n");
        assert!(e.starts_with("long_poll"), "{e}");
    }

    #[test]
    fn long_poll_defaults() {
        let c = Config::from_yaml("{}").unwrap();
        assert_eq!(
            c.long_poll,
            LongPollConfig {
                max_held: 256,
                reserved: 16
            }
        );
        let c = Config::from_yaml("long_poll: {max_held: 4, reserved: 1}").unwrap();
        assert_eq!(c.long_poll.max_held, 4);
    }
}
