//! What every section shares: the error that names the field path, and
//! durations written as text.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not YAML, or a field of the wrong type or name.
    #[error("{0}")]
    Parse(String),
    /// Well-formed but inconsistent.
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

impl ConfigError {
    /// The field path of an inconsistency (`history.window`); empty for a
    /// parse error.
    pub fn path(&self) -> &str {
        match self {
            ConfigError::Parse(_) => "",
            ConfigError::Invalid { path, .. } => path,
        }
    }

    pub fn message(&self) -> String {
        match self {
            ConfigError::Parse(m) => m.clone(),
            ConfigError::Invalid { message, .. } => message.clone(),
        }
    }
}

pub(crate) fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

/// `30s`, `1m 30s`, `250ms`.
pub fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!("`{text}` is not a duration like `30s`: {e}"))
    })
}
