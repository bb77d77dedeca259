//! Ollama has no Prometheus endpoint: `GET /api/ps` proves it alive and
//! lists the loaded models. Liveness keeps its scopes fresh; it feeds no
//! rule metric.

use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use serde::Deserialize;

use super::{BackendReading, BackendSource, SourceError};
use crate::http::{self, Target};

pub struct OllamaSource {
    name: String,
    target: Target,
    timeout: Duration,
}

impl OllamaSource {
    pub fn new(name: String, base: &Target, timeout: Duration) -> Self {
        OllamaSource {
            name,
            target: base.join("/api/ps"),
            timeout,
        }
    }
}

#[derive(Deserialize)]
struct Ps {
    #[serde(default)]
    models: Vec<PsModel>,
}

#[derive(Deserialize)]
struct PsModel {
    #[serde(default)]
    name: String,
}

/// The loaded models in an `/api/ps` answer.
pub fn loaded_models(body: &[u8]) -> Result<Vec<String>, SourceError> {
    let ps: Ps = serde_json::from_slice(body)
        .map_err(|e| SourceError::Other(format!("/api/ps is not the expected JSON: {e}")))?;
    Ok(ps.models.into_iter().map(|m| m.name).collect())
}

impl BackendSource for OllamaSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "ollama"
    }

    fn poll(&mut self, _at: Instant) -> BoxFuture<'_, Result<BackendReading, SourceError>> {
        Box::pin(async move {
            let body = http::get(&self.target, self.timeout).await?;
            Ok(BackendReading {
                samples: Vec::new(),
                models: loaded_models(&body)?,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_api_ps() {
        let body = br#"{"models":[{"name":"llama3.1:8b","size":1},{"name":"qwen"}]}"#;
        assert_eq!(loaded_models(body).unwrap(), vec!["llama3.1:8b", "qwen"]);
        assert_eq!(loaded_models(b"{}").unwrap(), Vec::<String>::new());
        assert!(loaded_models(b"<html>").is_err());
    }
}
