//! Where the signals come from. GPUs through [`GpuSource`] (NVML, or the
//! simulated one for tests and the demo); inference servers through
//! [`BackendSource`] (vLLM and llama.cpp `/metrics`, Ollama `/api/ps`).

pub mod dcgm;
pub mod gpu;
pub mod llamacpp;
pub mod ollama;
pub mod prom;
pub mod vllm;

use std::time::Instant;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::breaker::Metric;

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Http(#[from] crate::http::HttpError),
    #[error("NVML: {0}")]
    Nvml(#[from] nvml_wrapper::error::NvmlError),
    #[error("{0}")]
    Other(String),
}

/// One GPU as read now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuReading {
    pub index: u32,
    pub name: String,
    /// Percent of the last sample period the GPU was busy.
    pub utilization: f64,
    pub memory_used_mb: f64,
    pub memory_total_mb: f64,
    /// °C, if the GPU reports it.
    pub temperature_c: Option<f64>,
    /// Watts, if the GPU reports it.
    pub power_w: Option<f64>,
}

impl GpuReading {
    /// Used memory as a fraction 0–1 (0 when the total is unknown).
    pub fn memory_fraction(&self) -> f64 {
        if self.memory_total_mb > 0.0 {
            self.memory_used_mb / self.memory_total_mb
        } else {
            0.0
        }
    }
}

/// The GPU signals of a set of GPUs, as the engine takes them: the worst
/// (highest) of each.
pub fn gpu_samples<'a>(gpus: impl IntoIterator<Item = &'a GpuReading>) -> Vec<(Metric, f64)> {
    let mut worst: Vec<(Metric, f64)> = Vec::new();
    let mut note = |m: Metric, v: f64| match worst.iter_mut().find(|(k, _)| *k == m) {
        Some((_, w)) => *w = w.max(v),
        None => worst.push((m, v)),
    };
    for g in gpus {
        note(Metric::GpuUtilization, g.utilization);
        note(Metric::GpuMemory, g.memory_fraction());
        if let Some(t) = g.temperature_c {
            note(Metric::GpuTemperature, t);
        }
        if let Some(p) = g.power_w {
            note(Metric::GpuPower, p);
        }
    }
    worst
}

/// Reads every GPU it knows. Synchronous: an NVML read takes microseconds.
pub trait GpuSource: Send {
    /// `nvml` or `simulated`, for logs, metrics and the status page.
    fn kind(&self) -> &'static str;
    fn read(&mut self) -> Result<Vec<GpuReading>, SourceError>;
}

/// What one poll of a backend found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BackendReading {
    pub samples: Vec<(Metric, f64)>,
    /// Models it has loaded, where it says (Ollama).
    pub models: Vec<String>,
}

/// An inference server polled over HTTP. Polls may keep state (latency
/// windows), hence `&mut self`.
pub trait BackendSource: Send {
    fn name(&self) -> &str;
    /// `vllm`, `llamacpp`, `ollama` or `dcgm`.
    fn kind(&self) -> &'static str;
    /// One poll; `at` is when it started.
    fn poll(&mut self, at: Instant) -> BoxFuture<'_, Result<BackendReading, SourceError>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_samples_take_the_worst_gpu() {
        let g = |index, utilization, used, temp| GpuReading {
            index,
            name: "x".into(),
            utilization,
            memory_used_mb: used,
            memory_total_mb: 1000.0,
            temperature_c: temp,
            power_w: None,
        };
        let s = gpu_samples(&[g(0, 30.0, 900.0, Some(40.0)), g(1, 95.0, 100.0, None)]);
        assert_eq!(
            s,
            vec![
                (Metric::GpuUtilization, 95.0),
                (Metric::GpuMemory, 0.9),
                (Metric::GpuTemperature, 40.0),
            ]
        );
        assert!(gpu_samples(&[]).is_empty());
    }
}
