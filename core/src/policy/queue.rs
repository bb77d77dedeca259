//! The `classes`, `default_class` and `backends` sections (the queue), and
//! their checks.

use serde::Deserialize;

use crate::policy::{ConfigError, Policy};

fn default_true() -> bool {
    true
}

fn default_depth() -> u32 {
    1_000
}

fn default_weight() -> u32 {
    1
}

/// A workload class as operators write it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// `false`: refused at once when capacity is out (interactive).
    #[serde(default = "default_true")]
    pub queue: bool,
    /// The longest a request waits before 429 `queue_deadline`.
    #[serde(
        default,
        deserialize_with = "crate::policy::de_duration",
        rename = "max_wait"
    )]
    pub max_wait_ms: u64,
    /// The most requests of this class waiting for one model; past it, 429
    /// `queue_full`.
    #[serde(default = "default_depth")]
    pub max_depth: u32,
    /// Share of dispatches while several classes wait.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// The most of this class's places (for one model) one principal may
    /// hold; default `max_depth`. Whatever it is, a full queue gives a
    /// newcomer the place of the principal holding the most (see the
    /// module comment).
    #[serde(default)]
    pub max_per_principal: Option<u32>,
}

impl ClassConfig {
    /// The most places one principal may hold (`max_per_principal`, at
    /// most `max_depth`).
    pub fn principal_cap(&self) -> u32 {
        self.max_per_principal
            .unwrap_or(self.max_depth)
            .min(self.max_depth)
    }
}

/// Limits of one backend, all its models together.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub concurrency: Option<u32>,
}

/// The longest `max_wait` a class may have (a paused request holds an
/// Envoy stream and its buffered body).
pub const MAX_WAIT_CAP_MS: u64 = 3_600_000;

/// Checks of `classes`, `default_class`, `tiers.*.class`, `backends` and
/// `models.*.concurrency`.
pub fn check(p: &Policy) -> Result<(), ConfigError> {
    for (name, c) in &p.classes {
        if name.is_empty() || name.contains(';') || name.contains('=') {
            return Err(ConfigError::at(
                format!("classes.{name}"),
                "names must be non-empty and contain neither `;` nor `=`",
            ));
        }
        if !(1..=1_000).contains(&c.weight) {
            return Err(ConfigError::at(
                format!("classes.{name}.weight"),
                "must be between 1 and 1000",
            ));
        }
        if c.queue && !(1..=100_000).contains(&c.max_depth) {
            return Err(ConfigError::at(
                format!("classes.{name}.max_depth"),
                "must be between 1 and 100000",
            ));
        }
        if let Some(cap) = c.max_per_principal {
            if !(1..=c.max_depth).contains(&cap) {
                return Err(ConfigError::at(
                    format!("classes.{name}.max_per_principal"),
                    format!("must be between 1 and max_depth ({})", c.max_depth),
                ));
            }
        }
        if c.queue && !(1..=MAX_WAIT_CAP_MS).contains(&c.max_wait_ms) {
            return Err(ConfigError::at(
                format!("classes.{name}.max_wait"),
                "a class that queues needs a max_wait between 1ms and 1h",
            ));
        }
    }
    let known = |c: &String| p.classes.contains_key(c);
    if let Some(c) = p.default_class.as_ref().filter(|c| !known(c)) {
        return Err(ConfigError::at(
            "default_class",
            format!("class `{c}` is not defined under `classes`"),
        ));
    }
    for (tier, t) in &p.tiers {
        if let Some(c) = t.class.as_ref().filter(|c| !known(c)) {
            return Err(ConfigError::at(
                format!("tiers.{tier}.class"),
                format!("class `{c}` is not defined under `classes`"),
            ));
        }
    }
    for (name, m) in &p.models {
        if m.concurrency == Some(0) {
            return Err(ConfigError::at(
                format!("models.{name}.concurrency"),
                "must be at least 1",
            ));
        }
    }
    for (name, b) in &p.backends {
        if b.concurrency == Some(0) {
            return Err(ConfigError::at(
                format!("backends.{name}.concurrency"),
                "must be at least 1",
            ));
        }
        if !p.models.values().any(|m| &m.backend == name) {
            return Err(ConfigError::at(
                format!("backends.{name}"),
                "no model under `models` names this backend",
            ));
        }
    }
    Ok(())
}
