//! `abuse:` — the penalty box as operators write it — and its check.

use std::collections::HashSet;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::policy::keys::principal_of_key;
use crate::policy::units::{parse_duration, parse_rate, Rate};
use crate::policy::{ConfigError, Policy};

/// The longest block or period the box accepts.
const MAX_MS: u64 = 7 * 86_400_000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum By {
    /// The connection's address (port dropped; IPv6 by
    /// `identity.ipv6_prefix`, as everywhere).
    #[default]
    ClientAddress,
    /// The resolved principal (key, JWT subject, header, or address).
    Principal,
}

/// `abuse: {threshold: 60/min, block_for: 10m, by: client_address}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbuseConfig {
    /// Requests one caller may send within the period.
    #[serde(deserialize_with = "de_rate")]
    pub threshold: Rate,
    /// How long a caller over the threshold is refused.
    #[serde(deserialize_with = "de_duration", rename = "block_for")]
    pub block_for_ms: u64,
    #[serde(default)]
    pub by: By,
    /// Declared API keys (raw or `sha256:<hex>`) never counted or blocked.
    #[serde(default)]
    pub exempt: Vec<String>,
    /// Every declared API key is exempt.
    #[serde(default)]
    pub exempt_declared: bool,
    /// Accepted so older configs load; the storage is fixed (see the
    /// module comment), so this no longer sizes or places anything.
    #[serde(default = "default_slots")]
    pub slots: u32,
    /// Where older configs wrote `identity.ipv6_prefix` (the penalty box
    /// was once alone in counting IPv6 by prefix); the same value for
    /// everything either way (`policy::identity::ipv6_prefix`).
    #[serde(default)]
    pub ipv6_prefix: Option<u8>,
}

fn default_slots() -> u32 {
    4096
}

fn de_rate<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Rate, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse_rate(&text, &["requests", "request"]).map_err(de::Error::custom)
}

fn de_duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse_duration(&text).map_err(de::Error::custom)
}

/// Thresholds and slots are bounded; only declared keys are exempt.
pub(crate) fn check(policy: &Policy) -> Result<(), ConfigError> {
    match &policy.abuse {
        Some(abuse) => abuse.check(policy),
        None => Ok(()),
    }
}

impl AbuseConfig {
    fn check(&self, policy: &Policy) -> Result<(), ConfigError> {
        let t = self.threshold;
        if t.amount == 0 || t.period_ms == 0 || t.period_ms > MAX_MS {
            return Err(ConfigError::at(
                "abuse.threshold",
                "must be at least 1 request per period, and the period at most 7 days",
            ));
        }
        if t.amount > u64::from(u32::MAX / 2) {
            return Err(ConfigError::at(
                "abuse.threshold",
                "must be at most 2147483647 requests per period",
            ));
        }
        if self.block_for_ms < 1_000 || self.block_for_ms > MAX_MS {
            return Err(ConfigError::at(
                "abuse.block_for",
                "must be between 1s and 7 days",
            ));
        }
        if self.slots == 0 || self.slots > 1 << 16 {
            return Err(ConfigError::at(
                "abuse.slots",
                "must be between 1 and 65536",
            ));
        }
        let declared: HashSet<String> = policy
            .identity
            .api_key
            .iter()
            .flat_map(|k| k.keys.keys())
            .map(|k| principal_of_key(k))
            .collect();
        for (i, key) in self.exempt.iter().enumerate() {
            if !declared.contains(&principal_of_key(key)) {
                return Err(ConfigError::at(
                    format!("abuse.exempt[{i}]"),
                    format!(
                        "{} is not declared under identity.api_key.keys (only declared keys can be exempt)",
                        crate::policy::redact_key(key)
                    ),
                ));
            }
        }
        Ok(())
    }
}
