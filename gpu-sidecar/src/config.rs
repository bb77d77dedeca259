//! The sidecar's own config file (YAML): where to listen, what to watch,
//! the breaker rules and scopes, admin, alerts. Every field has a default,
//! so no file at all is a working config. Unknown fields are refused and
//! every error names the field path (`sources.vllm[0].url: …`).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::breaker::{Metric, OnStale, Policy, Rule};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not YAML, or a field of the wrong type or name.
    #[error("{0}")]
    Parse(String),
    /// Well-formed but inconsistent.
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

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
    /// Where the kill switch is kept across restarts; none: not kept.
    pub state_file: Option<PathBuf>,
    pub alerts: AlertsConfig,
    /// What the operator page keeps (see [`crate::history`]).
    pub history: crate::history::HistoryConfig,
    /// Envoy's admin, read for requests per tier (see [`crate::traffic`]).
    pub envoy_admin: Option<crate::traffic::EnvoyAdminConfig>,
    /// Redis, for the fleet (see `fleet`); none: this sidecar is no fleet agent.
    pub fleet: Option<crate::fleet::FleetConfig>,
    /// The response cache's store (see `cache`); none: no cache endpoints.
    pub cache: Option<crate::cache::CacheConfig>,
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

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuMode {
    /// NVML; when it is missing, say so once and use the simulated source.
    #[default]
    Auto,
    /// NVML only; when missing, say so once and run without GPU signals.
    Nvml,
    /// The simulated source (settable by `POST /v1/simulate` or a file).
    Simulated,
    None,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sources {
    pub gpu: GpuMode,
    /// JSON file read at every scrape by the simulated source (same shape as
    /// `POST /v1/simulate`), if it exists.
    pub simulated_file: Option<PathBuf>,
    pub vllm: Vec<BackendConfig>,
    pub ollama: Vec<BackendConfig>,
    /// The window over which TTFT and E2E p50/p99 are computed.
    #[serde(deserialize_with = "duration", default = "default_latency_window")]
    pub latency_window: Duration,
}

fn default_latency_window() -> Duration {
    Duration::from_secs(60)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Unique among all backends; the scope is `backend:NAME`.
    pub name: String,
    /// Base URL, plain HTTP (`http://127.0.0.1:8000`); `/metrics` (vLLM) or
    /// `/api/ps` (Ollama) is appended.
    pub url: String,
    /// Models it serves; each gets a `model:M` scope by default.
    #[serde(default)]
    pub models: Vec<String>,
}

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

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// File holding the bearer token for `POST /v1/kill-switch`; else the
    /// `SLUICE_ADMIN_TOKEN` environment variable.
    pub token_file: Option<PathBuf>,
    /// Accept admin calls from non-loopback clients.
    pub allow_remote: bool,
}

/// Held long polls cost a connection, a task and buffers each: they are
/// capped, and past the cap a poll is answered 503 at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LongPollConfig {
    /// Held polls, all callers together.
    pub max_held: usize,
    /// Of `max_held`, the slots only loopback callers (the co-located
    /// Envoy) and callers with the admin token may take: remote pollers
    /// cannot starve the filter's own poll.
    pub reserved: usize,
}

impl Default for LongPollConfig {
    fn default() -> Self {
        LongPollConfig {
            max_held: 256,
            reserved: 16,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertsConfig {
    pub webhooks: Vec<WebhookConfig>,
    /// A change within this long of the previous change of the same scope
    /// is not sent (the settled state is sent once it has held this long).
    #[serde(deserialize_with = "duration")]
    pub flap_window: Duration,
    #[serde(deserialize_with = "duration")]
    pub timeout: Duration,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        AlertsConfig {
            webhooks: Vec::new(),
            flap_window: Duration::from_secs(60),
            timeout: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookFormat {
    /// `{"event", "scope", "state", "reason", "at", "text"}`.
    #[default]
    Generic,
    /// `{"chat_id", "text"}`, as Telegram's `sendMessage` takes it.
    Telegram,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// Plain HTTP URL.
    pub url: String,
    #[serde(default)]
    pub format: WebhookFormat,
    /// Required for `telegram`.
    #[serde(default)]
    pub chat_id: Option<String>,
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

/// A backend of either kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Vllm,
    Ollama,
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

    /// Every backend, vLLM ones first, with its kind.
    pub fn backends(&self) -> Vec<(BackendKind, &BackendConfig)> {
        let vllm = self.sources.vllm.iter().map(|b| (BackendKind::Vllm, b));
        let ollama = self.sources.ollama.iter().map(|b| (BackendKind::Ollama, b));
        vllm.chain(ollama).collect()
    }

    pub fn policy(&self) -> Policy {
        Policy {
            half_open_fraction: self.breaker.half_open_fraction,
            half_open_for: self.breaker.half_open_for,
            retry_after: self.breaker.retry_after,
            stale_after: self.breaker.stale_after,
            on_stale: self.breaker.on_stale,
        }
    }

    /// The saturation rules, checked.
    pub fn saturation_rules(&self) -> Result<Vec<Rule>, ConfigError> {
        self.saturation
            .iter()
            .enumerate()
            .map(|(i, r)| r.to_rule(&format!("saturation[{i}]")))
            .collect()
    }

    /// The scopes, explicit or derived (see [`Config::scopes`]).
    pub fn scope_plans(&self) -> Result<Vec<ScopePlan>, ConfigError> {
        let rules = self
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| r.to_rule(&format!("rules[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        let backends = self.backends();
        if self.scopes.is_empty() {
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
        self.scopes
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

    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(c) = &self.cache {
            c.check(self.fleet.is_some())
                .map_err(|(path, message)| invalid(path, message))?;
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
        let f = self.breaker.half_open_fraction;
        if !(0.0..=1.0).contains(&f) {
            return Err(invalid(
                "breaker.half_open_fraction",
                format!("{f} is not between 0 and 1"),
            ));
        }
        let lp = self.long_poll;
        if lp.max_held == 0 || lp.max_held > 1_000_000 {
            return Err(invalid(
                "long_poll.max_held",
                format!("{} is not between 1 and 1000000", lp.max_held),
            ));
        }
        if lp.reserved >= lp.max_held {
            return Err(invalid(
                "long_poll.reserved",
                format!(
                    "{} leaves no slot for other pollers: it must be below max_held {}",
                    lp.reserved, lp.max_held
                ),
            ));
        }
        let mut names = BTreeSet::new();
        for (list, backends) in [
            ("vllm", &self.sources.vllm),
            ("ollama", &self.sources.ollama),
        ] {
            for (i, b) in backends.iter().enumerate() {
                let at = format!("sources.{list}[{i}]");
                if b.name.is_empty() {
                    return Err(invalid(format!("{at}.name"), "must not be empty"));
                }
                if !names.insert(b.name.as_str()) {
                    return Err(invalid(
                        format!("{at}.name"),
                        format!("`{}` is used twice", b.name),
                    ));
                }
                crate::http::Target::parse(&b.url)
                    .map_err(|e| invalid(format!("{at}.url"), e.to_string()))?;
            }
        }
        let mut scopes = BTreeSet::new();
        for (i, s) in self.scopes.iter().enumerate() {
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
            if !scopes.insert(s.scope.as_str()) {
                return Err(invalid(at, format!("`{}` is used twice", s.scope)));
            }
        }
        for (i, w) in self.alerts.webhooks.iter().enumerate() {
            let at = format!("alerts.webhooks[{i}]");
            crate::http::Target::parse(&w.url)
                .map_err(|e| invalid(format!("{at}.url"), e.to_string()))?;
            if w.format == WebhookFormat::Telegram && w.chat_id.is_none() {
                return Err(invalid(
                    format!("{at}.chat_id"),
                    "required for the telegram format",
                ));
            }
        }
        self.history.check().map_err(|(at, m)| invalid(at, m))?;
        if let Some(e) = &self.envoy_admin {
            e.check().map_err(|(at, m)| invalid(at, m))?;
        }
        crate::door::AllowedHosts::with(&self.allowed_hosts)
            .map_err(|(i, m)| invalid(format!("allowed_hosts[{i}]"), m))?;
        self.scope_plans().map(|_| ())
    }
}

/// `30s`, `1m 30s`, `250ms`.
pub(crate) fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!("`{text}` is not a duration like `30s`: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let c = Config::from_yaml(include_str!("../sidecar.example.yaml")).unwrap();
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
