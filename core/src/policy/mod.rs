//! The policy as operators write it (docs/src/design.md, "Policy"), its parsing
//! from the two forms Envoy hands the plugin (protobuf `Struct` bytes or a JSON
//! string), and the checks that span fields. Every error names the field path.

//!
//! One file per section: its types, their defaults, and its
//! `check(policy) -> Result<(), ConfigError>` for the rules serde cannot see
//! (called in turn by [`Policy::check`]). [`limit`] holds how a limit is
//! written in any section.

pub mod abuse;
pub mod anomaly_audit;
pub mod apis;
pub mod bound;
pub mod cache;
pub mod failover;
pub mod fallback;
pub mod fleet;
pub mod identity;
pub mod keys;
pub mod limit;
pub mod model_name;
pub mod models;
pub mod passthrough;
pub mod prices;
pub mod protection;
pub(crate) mod proto_struct;
pub mod providers;
pub mod queue;
pub mod request;
pub mod routes;
pub mod runs;
pub mod shares;
pub mod sidecar;
pub mod state;
pub mod tiers;
pub mod units;
pub mod zone;

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

pub use crate::policy::anomaly_audit::{AnomalyConfig, AuditConfig};
pub use crate::policy::fallback::{FallbackConfig, StaticFallback};
pub(crate) use crate::policy::identity::redact_key;
pub use crate::policy::identity::{IdentityConfig, IdentitySource, KeyEntry, UnknownKeys};
pub use crate::policy::limit::{Budget, Limit, Mode, Window};
pub use crate::policy::models::ModelConfig;
pub use crate::policy::protection::ProtectionConfig;
pub use crate::policy::request::{Defaults, RequestConfig};
pub use crate::policy::routes::RouteConfig;
pub use crate::policy::sidecar::SidecarConfig;
pub use crate::policy::state::StateConfig;
pub use crate::policy::tiers::TierConfig;

/// A policy that could not be loaded: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sluice policy: {path}: {message}")]
pub struct ConfigError {
    /// Dotted field path, e.g. `tiers.free.requests`; `.` is the whole policy.
    pub path: String,
    pub message: String,
}

impl ConfigError {
    pub(crate) fn at(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            path: path.into(),
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Tier of callers whose identity names no (known) tier.
    pub default_tier: String,
    #[serde(default)]
    pub identity: IdentityConfig,
    pub tiers: BTreeMap<String, TierConfig>,
    #[serde(default)]
    pub models: BTreeMap<String, ModelConfig>,
    /// Lets models `models` does not list through, at a stated price;
    /// absent: a request for one is a 400 (when `models` lists any).
    pub unlisted_models: Option<crate::policy::models::UnlistedModels>,
    /// `models`' keys by the name Ollama resolves each to, built at load.
    #[serde(skip)]
    pub model_names: crate::policy::models::ModelNames,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub request: RequestConfig,
    #[serde(default)]
    pub defaults: Defaults,
    #[serde(default)]
    pub state: StateConfig,
    /// Where the GPU sidecar is; absent: no sidecar, no breakers.
    pub sidecar: Option<SidecarConfig>,
    /// How the kill switch reroutes; absent: the kill switch serves the
    /// static fallback.
    pub fallback: Option<FallbackConfig>,
    /// The other upstreams a request may be served by (see
    /// `policy/providers.rs`), each reached by its route.
    #[serde(default)]
    pub providers: BTreeMap<String, crate::policy::providers::ProviderConfig>,
    /// The providers tried, in order, when the primary cannot serve a
    /// request (kill switch, open breakers, a paused or failing upstream);
    /// the static answer is the last rung.
    #[serde(default)]
    pub ladder: Vec<String>,
    /// The ladder takes a request whose primary is out, not only under
    /// the kill switch (`false`: open breakers and pauses answer 503 or
    /// static, as without a ladder).
    #[serde(default = "default_true")]
    pub ladder_when_out: bool,
    #[serde(default)]
    pub protection: ProtectionConfig,
    /// A request whose rung fails before its answer starts is sent down
    /// the ladder (see `policy/failover.rs`); absent: it is not.
    pub failover: Option<crate::policy::failover::FailoverConfig>,
    pub static_fallback: Option<StaticFallback>,
    /// Absent: no audit record is written (one host call per request).
    pub audit: Option<AuditConfig>,
    pub anomaly: Option<AnomalyConfig>,
    /// The response cache (see `policy/cache.rs`); absent: no cache.
    pub cache: Option<crate::policy::cache::CacheConfig>,
    /// `cache`, compiled at load.
    #[serde(skip)]
    pub cache_compiled: Option<crate::policy::cache::CachePolicy>,
    /// Workload classes: who waits for capacity and how long (see `queue`).
    #[serde(default)]
    pub classes: BTreeMap<String, crate::policy::queue::ClassConfig>,
    /// The class of callers whose tier, claim or header names none;
    /// absent: such callers are refused at once when capacity is out.
    pub default_class: Option<String>,
    /// Limits per backend, all its models together.
    #[serde(default)]
    pub backends: BTreeMap<String, crate::policy::queue::BackendConfig>,
    /// Limits of each team, all its members together (see `hierarchy`).
    #[serde(default)]
    pub teams: BTreeMap<String, TierConfig>,
    /// Limits of each organisation, all its teams and members together.
    #[serde(default)]
    pub orgs: BTreeMap<String, TierConfig>,
    /// What all calendar budgets share (the timezone of their midnight).
    #[serde(default)]
    pub budgets: crate::policy::zone::BudgetsConfig,
    /// The penalty box: callers over a threshold are blocked for a while.
    pub abuse: Option<crate::policy::abuse::AbuseConfig>,
    /// Limits shared by every Envoy of a fleet (see `fleet`); absent: each
    /// Envoy counts alone (the embedded default).
    pub fleet: Option<crate::policy::fleet::FleetConfig>,
    /// Paths sluice does not read that may still go upstream, each with
    /// its own limits (see `passthrough`); every other unknown path with a
    /// body is refused (deny by default).
    #[serde(default)]
    pub passthrough: Vec<crate::policy::passthrough::PassthroughRule>,
    /// An application's own endpoints, read and reserved like the
    /// built-in APIs (see `apis`).
    #[serde(default)]
    pub apis: Vec<crate::policy::apis::DeclaredApi>,
    /// A budget per session or agent run (see `runs`).
    pub runs: Option<crate::policy::runs::RunsConfig>,
    /// The same body from the same caller too often (see `runs`).
    pub loop_guard: Option<crate::policy::runs::LoopGuardConfig>,
}

pub(crate) fn default_true() -> bool {
    true
}

pub(crate) fn de_duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let text = String::deserialize(deserializer)?;
    crate::policy::units::parse_duration(&text).map_err(de::Error::custom)
}

/// A number, also when a YAML tool quoted it (`"4.0"`).
pub(crate) fn de_number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    struct NumberVisitor;
    impl Visitor<'_> for NumberVisitor {
        type Value = f64;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a number")
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
            Ok(v)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|n| n.is_finite())
                .ok_or_else(|| E::custom(format!("`{v}` is not a number")))
        }
    }
    deserializer.deserialize_any(NumberVisitor)
}

impl Policy {
    /// Parses the plugin configuration as Envoy delivers it: the protobuf
    /// bytes of a `google.protobuf.Struct` (native YAML in the Envoy config)
    /// or a JSON document (`google.protobuf.StringValue`).
    pub fn from_plugin_config(bytes: &[u8]) -> Result<Policy, ConfigError> {
        let value = match serde_json::from_slice::<serde_json::Value>(bytes) {
            Ok(value) => value,
            Err(json_err) => match crate::policy::proto_struct::decode(bytes) {
                Some(value) => value,
                None if looks_like_json(bytes) => {
                    return Err(ConfigError::at(".", format!("invalid JSON: {json_err}")))
                }
                None => {
                    return Err(ConfigError::at(
                        ".",
                        "neither a google.protobuf.Struct nor a JSON document",
                    ))
                }
            },
        };
        Policy::from_value(value)
    }

    /// Parses and checks a policy given as a JSON value.
    pub fn from_value(value: serde_json::Value) -> Result<Policy, ConfigError> {
        if !value.is_object() {
            return Err(ConfigError::at(".", "the policy must be a map"));
        }
        let policy: Policy = serde_path_to_error::deserialize(value).map_err(|err| {
            let path = err.path().to_string();
            ConfigError::at(path, err.into_inner().to_string())
        })?;
        let mut policy = policy;
        models::read_prices(&mut policy)?;
        models::index_names(&mut policy)?;
        providers::read_prices(&mut policy)?;
        policy.check()?;
        if let Some(c) = &policy.cache {
            let compiled = c.check().map_err(|e| ConfigError::at(e.path, e.message))?;
            if let Some(name) = compiled
                .routes
                .keys()
                .find(|n| !policy.routes.iter().any(|r| &r.name == *n))
            {
                return Err(ConfigError::at(
                    format!("cache.routes.{name}"),
                    "no route of this name under `routes`",
                ));
            }
            let enabled = !(compiled.models.is_empty() && compiled.routes.is_empty());
            if enabled && policy.sidecar.is_none() {
                return Err(ConfigError::at(
                    "cache",
                    "the cache's entries live in the sidecar: set `sidecar`",
                ));
            }
            policy.cache_compiled = Some(compiled);
        }
        Ok(policy)
    }

    /// Rules that span fields, which serde cannot see: each section checks
    /// itself against the rest of the policy with its own
    /// `check(policy)`, in its own file; the first error found is the one
    /// reported.
    fn check(&self) -> Result<(), ConfigError> {
        fleet::check(self)?;
        tiers::check(self)?;
        limit::check(self)?;
        identity::check(self)?;
        routes::check(self)?;
        check_names(self)?;
        models::check(self)?;
        sidecar::check(self)?;
        fallback::check(self)?;
        providers::check(self)?;
        protection::check(self)?;
        failover::check(self)?;
        abuse::check(self)?;
        anomaly_audit::check(self)?;
        request::check(self)?;
        state::check(self)?;
        shares::check(self)?;
        apis::check(self)?;
        runs::check(self)?;
        queue::check(self)
    }
}

/// The names of tiers, models, routes, teams and orgs end up in metric
/// labels and shared-data keys (`;` and `=` separate their parts).
fn check_names(p: &Policy) -> Result<(), ConfigError> {
    for (name, what) in p
        .tiers
        .keys()
        .map(|t| (t, "tiers"))
        .chain(p.models.keys().map(|m| (m, "models")))
        .chain(p.routes.iter().map(|r| (&r.name, "routes")))
        .chain(p.teams.keys().map(|t| (t, "teams")))
        .chain(p.orgs.keys().map(|o| (o, "orgs")))
    {
        if name.is_empty() || name.contains(';') || name.contains('=') {
            return Err(ConfigError::at(
                format!("{what}.{name}"),
                "names must be non-empty and contain neither `;` nor `=`",
            ));
        }
    }
    Ok(())
}

fn looks_like_json(bytes: &[u8]) -> bool {
    matches!(
        bytes.iter().find(|b| !b.is_ascii_whitespace()),
        Some(b'{') | Some(b'[')
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::protection::Credentials;
    use crate::policy::units::MAX_UNITS;
    use serde_json::json;

    fn minimal() -> serde_json::Value {
        json!({"default_tier": "free", "tiers": {"free": {"requests": "10/min"}}})
    }

    #[test]
    fn minimal_policy_loads_with_defaults() {
        let p = Policy::from_value(minimal()).unwrap();
        assert_eq!(p.tiers["free"].requests.unwrap().capacity(), 10);
        assert_eq!(p.request.max_body_bytes, 1 << 20);
        assert_eq!(p.identity.sources, vec![IdentitySource::ClientAddress]);
    }

    #[test]
    fn protection_defaults_and_bad_values_name_the_field() {
        let p = Policy::from_value(minimal()).unwrap().protection;
        assert_eq!((p.min_callers, p.max_pause_ms), (2, 300_000));
        assert_eq!(p.credentials, Credentials::PassThrough);
        assert_eq!((p.credential_slots, p.unlisted_slots), (4096, 64));
        for (field, value) in [
            ("min_callers", json!(0)),
            ("min_callers", json!(9)),
            ("credential_slots", json!(0)),
            ("unlisted_slots", json!(5000)),
            ("failure_window", json!("0s")),
            ("credential_headers", json!(["Authorization"])),
        ] {
            let mut v = minimal();
            v["protection"] = json!({ field: value });
            let err = Policy::from_value(v).unwrap_err();
            assert!(
                err.path.starts_with(&format!("protection.{field}")),
                "{err}"
            );
        }
        let mut v = minimal();
        v["protection"] = json!({"credentials": "shared"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "protection.credentials"
        );
        let mut v = minimal();
        v["models"] = json!({"m": {"credentials": "injected"}});
        let p = Policy::from_value(v).unwrap();
        assert_eq!(p.models["m"].credentials, Some(Credentials::Injected));
    }

    #[test]
    fn unknown_field_is_named_with_its_path() {
        let mut v = minimal();
        v["tiers"]["free"]["requets"] = json!("5/min");
        let err = Policy::from_value(v).unwrap_err();
        assert_eq!(err.path, "tiers.free.requets");
        assert!(err.message.contains("unknown field `requets`"), "{err}");
        assert!(err.to_string().contains("tiers.free.requets"));
    }

    #[test]
    fn bad_rate_is_named_with_its_path() {
        let mut v = minimal();
        v["tiers"]["free"]["requests"] = json!("10/fortnight");
        let err = Policy::from_value(v).unwrap_err();
        assert_eq!(err.path, "tiers.free.requests");
        assert!(err.message.contains("fortnight"));
    }

    #[test]
    fn zero_and_absurd_rates_are_refused_with_their_path() {
        let cases = [
            (
                json!({"tiers": {"free": {"requests": "0/min"}}}),
                "tiers.free.requests",
                "at least 1",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "tokens": "0 tokens/day"}}}),
                "tiers.free.tokens",
                "at least 1",
            ),
            (
                json!({"tiers": {"free": {"requests": {"rate": "0/s", "burst": 5}}}}),
                "tiers.free.requests",
                "at least 1",
            ),
            (
                json!({"tiers": {"free": {"requests": {"rate": "5/s", "burst": 0}}}}),
                "tiers.free.requests",
                "burst",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "output_tokens": "18446744073709551615/min"}}}),
                "tiers.free.output_tokens",
                "too large",
            ),
            (
                json!({"tiers": {"free": {"requests": {"rate": "1/s", "burst": 18446744073709551615u64}}}}),
                "tiers.free.requests",
                "too large",
            ),
            (
                json!({"tiers": {"free": {"requests": "1/400d"}}}),
                "tiers.free.requests",
                "366 days",
            ),
            (
                json!({"tiers": {"free": {"requests": "1/0ms"}}}),
                "tiers.free.requests",
                "longer than zero",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "daily_tokens": 0}}}),
                "tiers.free.daily_tokens",
                "greater than zero",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "daily_tokens": 1e30}}}),
                "tiers.free.daily_tokens.limit",
                "too large",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "daily_spend": 1e12}}}),
                "tiers.free.daily_spend.limit",
                "too large",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min"}}, "models": {"m": {"requests": "0/min"}}}),
                "models.m.requests",
                "at least 1",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min"}}, "routes": [{"name": "r", "path_prefix": "/v1", "requests": "0/s"}]}),
                "routes[0].requests",
                "at least 1",
            ),
        ];
        for (mut v, path, says) in cases {
            v["default_tier"] = json!("free");
            let err = Policy::from_value(v.clone()).unwrap_err();
            assert_eq!(err.path, path, "{v}: {err:?}");
            assert!(err.message.contains(says), "{v}: {err:?}");
        }
        // The largest countable amount still loads.
        let mut v = minimal();
        v["tiers"]["free"]["tokens"] = json!(format!("{MAX_UNITS} tokens/day"));
        assert!(Policy::from_value(v).is_ok());
    }

    #[test]
    fn limit_in_long_form_with_burst() {
        let mut v = minimal();
        v["tiers"]["free"]["requests"] = json!({"rate": "10/min", "burst": 15});
        let p = Policy::from_value(v).unwrap();
        let limit = p.tiers["free"].requests.unwrap();
        assert_eq!((limit.rate.amount, limit.burst), (10, 15));
        let mut v = minimal();
        v["tiers"]["free"]["requests"] = json!({"rate": "10/min", "brust": 15});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.requests.brust"
        );
    }

    #[test]
    fn cross_field_rules() {
        let mut v = minimal();
        v["default_tier"] = json!("gold");
        assert_eq!(Policy::from_value(v).unwrap_err().path, "default_tier");

        let mut v = minimal();
        v["identity"] = json!({"sources": ["api_key"]});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "identity.sources[0]"
        );

        let mut v = minimal();
        v["identity"] = json!({"sources": ["api_key"],
            "api_key": {"keys": {"secret-123": "gold"}}});
        let err = Policy::from_value(v).unwrap_err();
        assert!(err.path.starts_with("identity.api_key.keys."));
        assert!(!err.to_string().contains("secret-123"), "never echo a key");

        let mut v = minimal();
        v["sidecar"] = json!({"cluster": "sc", "stale_after": "1500ms"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "sidecar.stale_after"
        );
        let mut v = minimal();
        v["sidecar"] = json!({"cluster": "sc", "stale_after": "2s"});
        assert_eq!(
            Policy::from_value(v)
                .unwrap()
                .sidecar
                .unwrap()
                .stale_after_ms,
            2_000
        );
    }

    #[test]
    fn slot_settings_and_anonymous_totals_are_checked() {
        let mut v = minimal();
        v["tiers"]["free"]["anonymous_total"] =
            json!({"requests": "600/min", "daily_tokens": 100_000});
        let p = Policy::from_value(v).unwrap();
        let total = p.tiers["free"].anonymous_total.as_deref().unwrap();
        assert_eq!(total.requests.unwrap().capacity(), 600);
        assert_eq!((p.state.sketch_width, p.state.slot_hold_ms), (2048, 60_000));
        let mut v = minimal();
        v["tiers"]["free"]["anonymous_total"] = json!({"reqests": "600/min"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.anonymous_total.reqests"
        );
        let mut v = minimal();
        v["tiers"]["free"]["anonymous_total"] = json!({"anonymous_total": {}});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.anonymous_total.anonymous_total"
        );
        let mut v = minimal();
        v["tiers"]["free"]["anonymous_total"] = json!({"daily_tokens": 10.5});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.anonymous_total.daily_tokens.limit"
        );
        for (field, value) in [("sketch_width", json!(8)), ("slot_hold", json!("10ms"))] {
            let mut v = minimal();
            v["state"] = json!({ field: value });
            assert_eq!(
                Policy::from_value(v).unwrap_err().path,
                format!("state.{field}")
            );
        }
    }

    #[test]
    fn token_budgets_and_models() {
        let mut v = minimal();
        v["tiers"]["free"]["daily_tokens"] = json!(5000);
        v["tiers"]["free"]["monthly_tokens"] = json!("1,000,000 tokens");
        v["tiers"]["free"]["daily_spend"] =
            json!({"limit": 2.5, "mode": "soft", "alert_at": "80%"});
        v["tiers"]["free"]["tokens"] = json!("20000 tokens/min");
        v["models"] = json!({"big": {"downshift_to": "small", "price": {"input_per_1k": 0.5, "output_per_1k": 1.5}},
                             "small": {"gpu": {"cost_per_hour": 4.0, "tokens_per_second": 2000}}});
        let p = Policy::from_value(v).unwrap();
        let free = &p.tiers["free"];
        assert_eq!(free.daily_tokens.unwrap().limit, 5000.0);
        assert_eq!(free.monthly_tokens.unwrap().limit, 1_000_000.0);
        let spend = free.daily_spend.unwrap();
        assert_eq!(
            (spend.limit, spend.mode, spend.alert_at_permille),
            (2.5, Mode::Soft, Some(800))
        );
        assert_eq!(free.tokens.unwrap().capacity(), 20_000);

        let mut v = minimal();
        v["models"] = json!({"big": {"downshift_to": "nowhere"}});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "models.big.downshift_to"
        );
        let mut v = minimal();
        v["tiers"]["free"]["daily_tokens"] = json!({"limit": 10, "mode": "sometimes"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.daily_tokens.mode"
        );
        let mut v = minimal();
        v["tiers"]["free"]["daily_tokens"] = json!({"limit": 10, "alert_at": "180%"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.daily_tokens"
        );
        let mut v = minimal();
        v["tiers"]["free"]["daily_tokens"] = json!(-3);
        assert!(Policy::from_value(v).is_err());
    }

    #[test]
    fn sizes_and_numbers() {
        let mut v = minimal();
        v["request"] = json!({"max_body_bytes": "64KiB"});
        assert_eq!(Policy::from_value(v).unwrap().request.max_body_bytes, 65536);
        let mut v = minimal();
        v["request"] = json!({"max_body_bytes": 1000});
        assert_eq!(Policy::from_value(v).unwrap().request.max_body_bytes, 1000);
    }

    #[test]
    fn json_string_form() {
        let bytes = serde_json::to_vec(&minimal()).unwrap();
        assert!(Policy::from_plugin_config(&bytes).is_ok());
        let err = Policy::from_plugin_config(b"{\"default_tier\": ").unwrap_err();
        assert!(err.message.contains("invalid JSON"));
    }
}
