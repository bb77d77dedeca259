//! The policy as operators write it (SPEC §4), its parsing from the two forms
//! Envoy hands the plugin (protobuf `Struct` bytes or a JSON string), and the
//! checks that span fields. Every error names the field path.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use crate::units::{parse_rate, parse_size, Rate};

/// A policy that could not be loaded: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sluice policy: {path}: {message}")]
pub struct ConfigError {
    /// Dotted field path, e.g. `tiers.free.requests`; `.` is the whole policy.
    pub path: String,
    pub message: String,
}

impl ConfigError {
    fn at(path: impl Into<String>, message: impl Into<String>) -> Self {
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
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub request: RequestConfig,
    #[serde(default)]
    pub state: StateConfig,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdentitySource {
    Jwt,
    TrustedHeader,
    ApiKey,
    ClientAddress,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    /// Where the principal comes from, first match wins.
    #[serde(default = "default_sources")]
    pub sources: Vec<IdentitySource>,
    pub jwt: Option<JwtConfig>,
    pub trusted_header: Option<TrustedHeaderConfig>,
    pub api_key: Option<ApiKeyConfig>,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            sources: default_sources(),
            jwt: None,
            trusted_header: None,
            api_key: None,
        }
    }
}

fn default_sources() -> Vec<IdentitySource> {
    vec![IdentitySource::ClientAddress]
}

/// Claims of a JWT verified by Envoy's `jwt_authn` filter, read from the
/// dynamic metadata it writes with `payload_in_metadata`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    #[serde(default = "default_jwt_namespace")]
    pub metadata_namespace: String,
    #[serde(default = "default_jwt_payload_key")]
    pub payload_key: String,
    #[serde(default = "default_principal_claim")]
    pub principal_claim: String,
    pub tier_claim: Option<String>,
}

fn default_jwt_namespace() -> String {
    "envoy.filters.http.jwt_authn".into()
}
fn default_jwt_payload_key() -> String {
    "jwt_payload".into()
}
fn default_principal_claim() -> String {
    "sub".into()
}

/// Headers set by an auth filter in front of sluice. Only these names are
/// trusted; any other identity header a client sends is ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustedHeaderConfig {
    pub principal: String,
    pub tier: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Header carrying the key; `authorization` reads a `Bearer` token.
    #[serde(default = "default_api_key_header")]
    pub header: String,
    /// Key → tier. A key may be written raw or as `sha256:<hex>`; either way
    /// only its hash is kept in memory.
    #[serde(default)]
    pub keys: BTreeMap<String, String>,
    /// What a key missing from `keys` gets.
    #[serde(default)]
    pub unknown_keys: UnknownKeys,
}

fn default_api_key_header() -> String {
    "x-api-key".into()
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownKeys {
    /// 401: otherwise every made-up key would be a fresh principal with a
    /// fresh budget.
    #[default]
    Reject,
    /// The key's hash is the principal, in the default tier.
    DefaultTier,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConfig {
    /// Requests per principal of this tier.
    pub requests: Option<Limit>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Requests to this model, all principals together.
    pub requests: Option<Limit>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    pub path_prefix: String,
    /// Requests on this route, all principals together.
    pub requests: Limit,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestConfig {
    /// Bodies above this get 413 (`1MiB`, `512KiB` or bytes).
    #[serde(default = "default_max_body", deserialize_with = "de_size")]
    pub max_body_bytes: u64,
}

impl Default for RequestConfig {
    fn default() -> Self {
        RequestConfig {
            max_body_bytes: default_max_body(),
        }
    }
}

fn default_max_body() -> u64 {
    1 << 20
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    /// Shared-data slots per per-principal rule: the bound on the key set.
    #[serde(default = "default_slots")]
    pub principal_slots: u32,
    /// Compare-and-swap attempts on one bucket before the request is refused.
    #[serde(default = "default_cas_retries")]
    pub cas_max_retries: u32,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            principal_slots: default_slots(),
            cas_max_retries: default_cas_retries(),
        }
    }
}

fn default_slots() -> u32 {
    4096
}
fn default_cas_retries() -> u32 {
    64
}

/// A token bucket: refills at `rate`, holds at most `burst` (default: the
/// rate's amount). Written `10/min` or `{rate: 10/min, burst: 15}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub rate: Rate,
    pub burst: u64,
}

impl Limit {
    pub fn capacity(&self) -> u64 {
        self.burst
    }
}

impl<'de> Deserialize<'de> for Limit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct LimitVisitor;

        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            rate: String,
            burst: Option<u64>,
        }

        impl<'de> Visitor<'de> for LimitVisitor {
            type Value = Limit;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a rate like `10/min` or a map `{rate: 10/min, burst: 15}`")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Limit, E> {
                let rate = parse_rate(text, &["requests", "request"]).map_err(E::custom)?;
                Ok(Limit {
                    rate,
                    burst: rate.amount,
                })
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Limit, A::Error> {
                let full = Full::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let rate =
                    parse_rate(&full.rate, &["requests", "request"]).map_err(de::Error::custom)?;
                let burst = full.burst.unwrap_or(rate.amount);
                if burst == 0 {
                    return Err(de::Error::custom("burst must be at least 1"));
                }
                Ok(Limit { rate, burst })
            }
        }

        deserializer.deserialize_any(LimitVisitor)
    }
}

fn de_size<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    struct SizeVisitor;
    impl Visitor<'_> for SizeVisitor {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a size like `1MiB` or a number of bytes")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            parse_size(v).map_err(E::custom)
        }
    }
    deserializer.deserialize_any(SizeVisitor)
}

impl Policy {
    /// Parses the plugin configuration as Envoy delivers it: the protobuf
    /// bytes of a `google.protobuf.Struct` (native YAML in the Envoy config)
    /// or a JSON document (`google.protobuf.StringValue`).
    pub fn from_plugin_config(bytes: &[u8]) -> Result<Policy, ConfigError> {
        let value = match serde_json::from_slice::<serde_json::Value>(bytes) {
            Ok(value) => value,
            Err(json_err) => match crate::proto_struct::decode(bytes) {
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
        policy.check()?;
        Ok(policy)
    }

    /// Rules that span fields, which serde cannot see.
    fn check(&self) -> Result<(), ConfigError> {
        if !self.tiers.contains_key(&self.default_tier) {
            return Err(ConfigError::at(
                "default_tier",
                format!("tier `{}` is not defined under `tiers`", self.default_tier),
            ));
        }
        let id = &self.identity;
        if id.sources.is_empty() {
            return Err(ConfigError::at(
                "identity.sources",
                "list at least one source",
            ));
        }
        for (i, source) in id.sources.iter().enumerate() {
            let missing = match source {
                IdentitySource::Jwt => id.jwt.is_none().then_some("jwt"),
                IdentitySource::TrustedHeader => {
                    id.trusted_header.is_none().then_some("trusted_header")
                }
                IdentitySource::ApiKey => id.api_key.is_none().then_some("api_key"),
                IdentitySource::ClientAddress => None,
            };
            if let Some(section) = missing {
                return Err(ConfigError::at(
                    format!("identity.sources[{i}]"),
                    format!("`{section}` is listed but `identity.{section}` is not configured"),
                ));
            }
        }
        if let Some(keys) = &id.api_key {
            for (key, tier) in &keys.keys {
                if !self.tiers.contains_key(tier) {
                    return Err(ConfigError::at(
                        format!("identity.api_key.keys.{}", redact_key(key)),
                        format!("tier `{tier}` is not defined under `tiers`"),
                    ));
                }
                if let Some(hex) = key.strip_prefix("sha256:") {
                    if hex.len() != 64 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
                        return Err(ConfigError::at(
                            format!("identity.api_key.keys.{}", redact_key(key)),
                            "a `sha256:` key needs 64 hex digits",
                        ));
                    }
                }
            }
            if keys.header.trim().is_empty() {
                return Err(ConfigError::at(
                    "identity.api_key.header",
                    "must not be empty",
                ));
            }
        }
        for (i, route) in self.routes.iter().enumerate() {
            if !route.path_prefix.starts_with('/') {
                return Err(ConfigError::at(
                    format!("routes[{i}].path_prefix"),
                    "must start with `/`",
                ));
            }
            if self.routes[..i].iter().any(|r| r.name == route.name) {
                return Err(ConfigError::at(
                    format!("routes[{i}].name"),
                    format!("route name `{}` is used twice", route.name),
                ));
            }
        }
        for (name, what) in self
            .tiers
            .keys()
            .map(|t| (t, "tiers"))
            .chain(self.models.keys().map(|m| (m, "models")))
            .chain(self.routes.iter().map(|r| (&r.name, "routes")))
        {
            if name.is_empty() || name.contains(';') || name.contains('=') {
                return Err(ConfigError::at(
                    format!("{what}.{name}"),
                    "names must be non-empty and contain neither `;` nor `=`",
                ));
            }
        }
        if self.state.principal_slots == 0 || self.state.principal_slots > 1 << 20 {
            return Err(ConfigError::at(
                "state.principal_slots",
                "must be between 1 and 1048576",
            ));
        }
        if self.state.cas_max_retries == 0 {
            return Err(ConfigError::at(
                "state.cas_max_retries",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

fn looks_like_json(bytes: &[u8]) -> bool {
    matches!(
        bytes.iter().find(|b| !b.is_ascii_whitespace()),
        Some(b'{') | Some(b'[')
    )
}

/// Names a configured key in an error without printing the key itself.
fn redact_key(key: &str) -> String {
    if key.starts_with("sha256:") {
        key.chars().take(15).collect::<String>() + "…"
    } else {
        format!("<key of {} chars>", key.chars().count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
