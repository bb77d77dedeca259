//! `sources:`: the GPU source and the backends to scrape.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::field::{duration, invalid, ConfigError};

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

/// A backend of either kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Vllm,
    Ollama,
}

impl Sources {
    /// Names unique and not empty, URLs plain HTTP.
    pub fn check(&self) -> Result<(), ConfigError> {
        let mut names = BTreeSet::new();
        for (list, backends) in [("vllm", &self.vllm), ("ollama", &self.ollama)] {
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
        Ok(())
    }
}
