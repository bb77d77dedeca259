//! `sources:`: the GPU source and the backends to scrape.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::http::{self, Target};

use super::field::{duration, invalid, ConfigError};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuMode {
    /// NVML; when it is missing, say so once (an error) and run on the
    /// other sources, without GPU readings. Never the simulated source:
    /// that takes `simulated` or `--simulate`. (Once, `auto` fell back to
    /// it: a host whose driver was gone looked healthy.)
    #[default]
    Auto,
    /// The same as `auto`.
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
    /// llama.cpp servers started with `--metrics` (`crate::sources::llamacpp`).
    pub llamacpp: Vec<BackendConfig>,
    /// NVIDIA DCGM exporters (GPUs that are not local; see
    /// `crate::sources::dcgm`): each is a backend of its own.
    pub dcgm: Vec<DcgmConfig>,
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
    /// `/api/ps` (Ollama) is appended; `/metrics` for llama.cpp too.
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
    LlamaCpp,
    /// `sources.dcgm[i]`.
    Dcgm(usize),
}

impl Sources {
    /// Names unique and not empty, URLs plain HTTP.
    pub fn check(&self) -> Result<(), ConfigError> {
        let mut names = BTreeSet::new();
        for (list, backends) in [
            ("vllm", &self.vllm),
            ("ollama", &self.ollama),
            ("llamacpp", &self.llamacpp),
        ] {
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

/// One `sources.dcgm[]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(from = "Raw")]
pub struct DcgmConfig {
    /// `name`, `url` (the exporter's endpoint; `/metrics` when the URL has
    /// no path) and `models`, as for every backend.
    pub backend: BackendConfig,
    /// Labels every series of a selected GPU carries, e.g.
    /// `{namespace: llm, pod: "vllm-llama-*"}`; a value ending in `*`
    /// matches by prefix. Empty: every GPU the exporter lists.
    pub select: BTreeMap<String, String>,
    /// How often the exporter is scraped (at most once per round); default
    /// `scrape_interval`. Between scrapes the last reading is fed again.
    pub interval: Option<Duration>,
    /// Per scrape; default `scrape_timeout`.
    pub timeout: Option<Duration>,
    pub xid: XidConfig,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    name: String,
    url: String,
    #[serde(default)]
    models: Vec<String>,
    #[serde(default)]
    select: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "opt_duration")]
    interval: Option<Duration>,
    #[serde(default, deserialize_with = "opt_duration")]
    timeout: Option<Duration>,
    #[serde(default)]
    xid: XidConfig,
}

impl From<Raw> for DcgmConfig {
    fn from(r: Raw) -> Self {
        DcgmConfig {
            backend: BackendConfig {
                name: r.name,
                url: r.url,
                models: r.models,
            },
            select: r.select,
            interval: r.interval,
            timeout: r.timeout,
            xid: r.xid,
        }
    }
}

/// What counts as a new XID error.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct XidConfig {
    /// `gpu_xid_errors` counts the new XIDs seen within this long.
    #[serde(deserialize_with = "duration")]
    pub window: Duration,
    /// XID codes that are no GPU fault here (e.g. 13, 31, 43, 45: mostly
    /// an application's own fault).
    pub ignore: Vec<u32>,
}

impl Default for XidConfig {
    fn default() -> Self {
        XidConfig {
            window: Duration::from_secs(300),
            ignore: Vec::new(),
        }
    }
}

fn opt_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

impl DcgmConfig {
    /// The URL scraped: the configured one, with `/metrics` when it has no
    /// path.
    pub fn target(&self) -> Result<Target, http::HttpError> {
        let t = Target::parse(&self.backend.url)?;
        Ok(if t.path_and_query == "/" {
            t.join("/metrics")
        } else {
            t
        })
    }
}

fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl Sources {
    /// Checks every `sources.dcgm[]` entry (names unique among all backends,
    /// scrapes shorter than `breaker.stale_after`); errors as
    /// `(field path, message)`.
    pub fn check_dcgm(&self, stale_after: Duration) -> Result<(), (String, String)> {
        let mut names: BTreeSet<&str> = (self.vllm.iter())
            .chain(&self.ollama)
            .chain(&self.llamacpp)
            .map(|b| b.name.as_str())
            .collect();
        for (i, d) in self.dcgm.iter().enumerate() {
            let at = format!("sources.dcgm[{i}]");
            let fail = |field: &str, m: String| Err((format!("{at}.{field}"), m));
            let name = d.backend.name.as_str();
            if name.is_empty() {
                return fail("name", "must not be empty".into());
            }
            if !names.insert(name) {
                return fail("name", format!("`{name}` is used twice"));
            }
            if let Err(e) = d.target() {
                return fail("url", e.to_string());
            }
            for key in d.select.keys() {
                if !is_label_name(key) {
                    return fail(
                        &format!("select.{key}"),
                        "is not a Prometheus label name".into(),
                    );
                }
            }
            for (field, value) in [("interval", d.interval), ("timeout", d.timeout)] {
                let Some(v) = value else { continue };
                if v.is_zero() {
                    return fail(field, "must be more than 0".into());
                }
                if v >= stale_after {
                    return fail(
                    field,
                    format!(
                        "{} is not shorter than breaker.stale_after {}: the scope would go stale between scrapes",
                        humantime::format_duration(v),
                        humantime::format_duration(stale_after)
                    ),
                );
                }
            }
            if d.xid.window.is_zero() {
                return fail("xid.window", "must be more than 0".into());
            }
            if let Some(j) = d.xid.ignore.iter().position(|&c| c == 0) {
                return fail(&format!("xid.ignore[{j}]"), "0 is no XID".into());
            }
        }
        Ok(())
    }
}
