//! `alerts:`: the webhooks told of breaker and kill switch changes.

use std::time::Duration;

use serde::Deserialize;

use super::field::{duration, invalid, ConfigError};

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

impl AlertsConfig {
    pub fn check(&self) -> Result<(), ConfigError> {
        for (i, w) in self.webhooks.iter().enumerate() {
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
        Ok(())
    }
}
