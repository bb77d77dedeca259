//! `identity`: where a caller's principal, tier, class, team and org come
//! from, and the declared API keys.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use crate::policy::{default_true, ConfigError, Policy};

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
    /// An IPv6 client address is one caller per this prefix (bits), in
    /// every place that tells callers apart by address: principal,
    /// buckets, cache scope, penalty box. A provider hands a subscriber a
    /// `/64` (or a `/56`, `/48`): counting whole addresses would give one
    /// subscriber 2^64 callers. Unset: `abuse.ipv6_prefix` if written,
    /// else 64. See [`ipv6_prefix`].
    pub ipv6_prefix: Option<u8>,
    /// The environment variable (given to the VM with
    /// `vm_config.environment_variables`) holding the secret every hash of
    /// a caller-chosen name is keyed with (slots, sketches, penalty box,
    /// fleet keys). Unset: `SLUICE_HASH_KEY`; when that is not set either,
    /// a fleet derives the key from its secret, and a single Envoy
    /// generates one (see `admission::hash_key`).
    pub hash_key_env: Option<String>,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            sources: default_sources(),
            jwt: None,
            trusted_header: None,
            api_key: None,
            ipv6_prefix: None,
            hash_key_env: None,
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
    /// The claim naming the caller within its issuer; the principal is it
    /// together with the token's `iss`.
    #[serde(default = "default_principal_claim")]
    pub principal_claim: String,
    pub tier_claim: Option<String>,
    /// A verified claim naming the caller's workload class.
    pub class_claim: Option<String>,
    /// Claims naming the caller's team and organisation (declared under
    /// `teams`/`orgs`; others count as none).
    pub team_claim: Option<String>,
    pub org_claim: Option<String>,
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
    /// A trusted header naming the caller's workload class.
    pub class: Option<String>,
    /// Headers naming the caller's team and organisation.
    pub team: Option<String>,
    pub org: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Header carrying the key; `authorization` reads a `Bearer` token.
    #[serde(default = "default_api_key_header")]
    pub header: String,
    /// Also take the key from `Authorization: Bearer <key>`, as every
    /// OpenAI SDK sends it. A bearer token shaped like a JWT is never looked
    /// up as a key: it counts only once `jwt_authn` has verified it.
    #[serde(default = "default_true")]
    pub bearer: bool,
    /// Key → tier, or `{tier, team, org}`. A key may be written raw or as
    /// `sha256:<hex>`; either way only its hash is kept in memory.
    #[serde(default)]
    pub keys: BTreeMap<String, KeyEntry>,
    /// What a key missing from `keys` gets.
    #[serde(default)]
    pub unknown_keys: UnknownKeys,
}

/// What a declared API key stands for: `pro`, or
/// `{tier: pro, team: search, org: acme}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyEntry {
    pub tier: String,
    pub team: Option<String>,
    pub org: Option<String>,
}

impl<'de> Deserialize<'de> for KeyEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct KeyEntryFields {
            tier: String,
            team: Option<String>,
            org: Option<String>,
        }
        struct EntryVisitor;
        impl<'de> Visitor<'de> for EntryVisitor {
            type Value = KeyEntry;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a tier name or a map `{tier: pro, team: search, org: acme}`")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyEntry, E> {
                Ok(KeyEntry {
                    tier: v.to_string(),
                    team: None,
                    org: None,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<KeyEntry, A::Error> {
                let full = KeyEntryFields::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(KeyEntry {
                    tier: full.tier,
                    team: full.team,
                    org: full.org,
                })
            }
        }
        deserializer.deserialize_any(EntryVisitor)
    }
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

/// Names a configured key in an error without printing the key itself.
pub(crate) fn redact_key(key: &str) -> String {
    if key.starts_with("sha256:") {
        key.chars().take(15).collect::<String>() + "…"
    } else {
        format!("<key of {} chars>", key.chars().count())
    }
}

/// The prefix an IPv6 client address counts by: `identity.ipv6_prefix`,
/// else `abuse.ipv6_prefix` (where older configs wrote it), else 64. One
/// value for everything, so that no part of sluice counts a `/64` as many
/// callers while another counts it as one.
pub fn ipv6_prefix(p: &Policy) -> u8 {
    p.identity
        .ipv6_prefix
        .or(p.abuse.as_ref().and_then(|a| a.ipv6_prefix))
        .unwrap_or(DEFAULT_IPV6_PREFIX)
}

/// What an IPv6 subscriber is usually given.
pub const DEFAULT_IPV6_PREFIX: u8 = 64;

/// Every listed source is configured; every declared key names a declared
/// tier, team and org, and a `sha256:` key is a whole digest.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    let id = &p.identity;
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
    for (path, bits) in [
        ("identity.ipv6_prefix", id.ipv6_prefix),
        (
            "abuse.ipv6_prefix",
            p.abuse.as_ref().and_then(|a| a.ipv6_prefix),
        ),
    ] {
        if bits.is_some_and(|b| !(1..=128).contains(&b)) {
            return Err(ConfigError::at(
                path,
                "must be between 1 and 128 (bits of an IPv6 address counted as one caller)",
            ));
        }
    }
    if let (Some(a), Some(b)) = (id.ipv6_prefix, p.abuse.as_ref().and_then(|a| a.ipv6_prefix)) {
        if a != b {
            return Err(ConfigError::at(
                "abuse.ipv6_prefix",
                format!(
                    "is {b} while identity.ipv6_prefix is {a}: an IPv6 caller is one prefix \
                     everywhere; write it once, under identity"
                ),
            ));
        }
    }
    match &id.api_key {
        Some(keys) => check_keys(keys, p),
        None => Ok(()),
    }
}

fn check_keys(keys: &ApiKeyConfig, p: &Policy) -> Result<(), ConfigError> {
    for (key, entry) in &keys.keys {
        let tier = &entry.tier;
        for (field, name, declared) in [
            ("team", &entry.team, &p.teams),
            ("org", &entry.org, &p.orgs),
        ] {
            if let Some(name) = name.as_ref().filter(|n| !declared.contains_key(*n)) {
                return Err(ConfigError::at(
                    format!("identity.api_key.keys.{}.{field}", redact_key(key)),
                    format!("{field} `{name}` is not declared under `{field}s`"),
                ));
            }
        }
        if !p.tiers.contains_key(tier) {
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
    Ok(())
}
