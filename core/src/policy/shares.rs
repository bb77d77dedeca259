//! `shares:` — what each tier (and `anonymous`) may hold of a shared
//! bucket — and its check.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use crate::policy::units::parse_permille as parse_share;
use crate::policy::{ConfigError, Policy};

/// The group of every undeclared caller in `shares`.
pub const ANONYMOUS: &str = "anonymous";

/// What `anonymous` may hold of a shared bucket when the policy declares
/// API keys and writes no shares: half.
pub const DEFAULT_ANONYMOUS_PERMILLE: u32 = 500;

/// Most named groups in one `shares` map (and accounts read from a record).
pub const MAX_GROUPS: usize = 64;

/// `shares:` as written: group name → share, in thousandths (`20%` → 200).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharesConfig(pub BTreeMap<String, u32>);

impl<'de> Deserialize<'de> for SharesConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SharesVisitor;
        impl<'de> Visitor<'de> for SharesVisitor {
            type Value = SharesConfig;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of tier (or `anonymous`) to a share like `20%`")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SharesConfig, A::Error> {
                let mut out = BTreeMap::new();
                while let Some((name, value)) = map.next_entry::<String, serde_json::Value>()? {
                    let permille = parse_share(&value).ok_or_else(|| {
                        de::Error::custom(format!(
                            "{name}: a share must be a percentage like `20%` (or a fraction like 0.2), above 0 and at most 100%"
                        ))
                    })?;
                    if out.insert(name.clone(), permille).is_some() {
                        return Err(de::Error::custom(format!("{name}: listed twice")));
                    }
                }
                Ok(SharesConfig(out))
            }
        }
        deserializer.deserialize_map(SharesVisitor)
    }
}

/// Checks every `shares` map (models, routes, `defaults.shares`): names
/// are tiers or `anonymous`, and a map sums to at most 100 %.
pub fn check(p: &Policy) -> Result<(), ConfigError> {
    let mut maps: Vec<(String, &SharesConfig)> = Vec::new();
    if let Some(s) = &p.defaults.shares {
        maps.push(("defaults.shares".into(), s));
    }
    for (name, m) in &p.models {
        if let Some(s) = &m.shares {
            if m.requests.is_none() && m.tokens.is_none() {
                return Err(ConfigError::at(
                    format!("models.{name}.shares"),
                    "the model has no `requests` or `tokens` bucket to share",
                ));
            }
            maps.push((format!("models.{name}.shares"), s));
        }
    }
    for (i, r) in p.routes.iter().enumerate() {
        if let Some(s) = &r.shares {
            maps.push((format!("routes[{i}].shares"), s));
        }
    }
    for (path, shares) in maps {
        if shares.0.len() > MAX_GROUPS {
            return Err(ConfigError::at(
                path,
                format!("at most {MAX_GROUPS} groups"),
            ));
        }
        for name in shares.0.keys() {
            if name != ANONYMOUS && !p.tiers.contains_key(name) {
                return Err(ConfigError::at(
                    format!("{path}.{name}"),
                    format!("`{name}` is neither a tier under `tiers` nor `{ANONYMOUS}`"),
                ));
            }
        }
        let sum: u32 = shares.0.values().sum();
        if sum > 1000 {
            return Err(ConfigError::at(
                path,
                format!("shares sum to {}.{}%, more than 100%", sum / 10, sum % 10),
            ));
        }
    }
    Ok(())
}

/// The shares a bucket gets when it writes none: `defaults.shares` if
/// written, else `anonymous: 50%` when the policy declares API keys (there
/// is someone to protect), else none.
pub fn default_for(p: &Policy) -> SharesConfig {
    if let Some(s) = &p.defaults.shares {
        return s.clone();
    }
    let declares = p
        .identity
        .api_key
        .as_ref()
        .is_some_and(|k| !k.keys.is_empty());
    if declares {
        SharesConfig(BTreeMap::from([(
            ANONYMOUS.to_string(),
            DEFAULT_ANONYMOUS_PERMILLE,
        )]))
    } else {
        SharesConfig::default()
    }
}
