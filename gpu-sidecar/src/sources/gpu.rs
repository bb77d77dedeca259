//! GPU sources: NVML for real GPUs, and a simulated one that tests and the
//! demo set over `POST /v1/simulate` or through a file.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use serde::{Deserialize, Serialize};

use super::{GpuReading, GpuSource, SourceError};

/// Real GPUs through the NVIDIA Management Library.
pub struct NvmlSource {
    nvml: Nvml,
}

impl NvmlSource {
    /// Loads NVML. Without the library (no driver: `LibloadingError`) or
    /// with a driver that does not answer, this fails; the caller says so
    /// once and runs on the other sources.
    pub fn open() -> Result<NvmlSource, NvmlError> {
        Ok(NvmlSource {
            nvml: Nvml::init()?,
        })
    }

    /// The sentence to log when [`NvmlSource::open`] failed.
    pub fn why_missing(e: &NvmlError) -> String {
        match e {
            NvmlError::LibloadingError(e) => format!("no NVML (libnvidia-ml not loadable: {e})"),
            e => format!("no NVML ({e})"),
        }
    }
}

impl GpuSource for NvmlSource {
    fn kind(&self) -> &'static str {
        "nvml"
    }

    fn read(&mut self) -> Result<Vec<GpuReading>, SourceError> {
        let count = self.nvml.device_count()?;
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let d = self.nvml.device_by_index(index)?;
            let util = d.utilization_rates()?;
            let mem = d.memory_info()?;
            const MB: f64 = 1024.0 * 1024.0;
            out.push(GpuReading {
                index,
                name: d.name().unwrap_or_else(|_| format!("GPU {index}")),
                utilization: f64::from(util.gpu),
                memory_used_mb: mem.used as f64 / MB,
                memory_total_mb: mem.total as f64 / MB,
                // Not every GPU reports these; a missing one is no error.
                temperature_c: d.temperature(TemperatureSensor::Gpu).ok().map(f64::from),
                power_w: d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
            });
        }
        Ok(out)
    }
}

/// What the simulated source reports: `POST /v1/simulate` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Simulation {
    pub gpus: Vec<SimGpu>,
    /// Make every read fail (to exercise the stale-data policy).
    #[serde(default)]
    pub fail: bool,
}

/// One simulated GPU; what is left out takes the default shown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimGpu {
    /// Percent, 0–100. Default 0.
    #[serde(default)]
    pub utilization: f64,
    /// Default 8192.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used_mb: Option<f64>,
    /// Default 81920.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_total_mb: Option<f64>,
    /// Default 35.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<f64>,
    /// Default 80.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    /// Default `Simulated GPU`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Default for Simulation {
    fn default() -> Self {
        Simulation {
            gpus: vec![SimGpu {
                utilization: 0.0,
                memory_used_mb: None,
                memory_total_mb: None,
                temperature_c: None,
                power_w: None,
                name: None,
            }],
            fail: false,
        }
    }
}

impl Simulation {
    /// Refuses values no GPU could report.
    pub fn check(&self) -> Result<(), String> {
        for (i, g) in self.gpus.iter().enumerate() {
            if !(0.0..=100.0).contains(&g.utilization) {
                return Err(format!(
                    "gpus[{i}].utilization: {} is not 0–100",
                    g.utilization
                ));
            }
            let fields = [
                ("memory_used_mb", g.memory_used_mb),
                ("memory_total_mb", g.memory_total_mb),
                ("temperature_c", g.temperature_c),
                ("power_w", g.power_w),
            ];
            for (name, v) in fields {
                if v.is_some_and(|v| !v.is_finite() || (name != "temperature_c" && v < 0.0)) {
                    return Err(format!("gpus[{i}].{name}: must be a finite number >= 0"));
                }
            }
        }
        Ok(())
    }

    fn readings(&self) -> Vec<GpuReading> {
        self.gpus
            .iter()
            .zip(0..)
            .map(|(g, index)| GpuReading {
                index,
                name: g.name.clone().unwrap_or_else(|| "Simulated GPU".into()),
                utilization: g.utilization,
                memory_used_mb: g.memory_used_mb.unwrap_or(8192.0),
                memory_total_mb: g.memory_total_mb.unwrap_or(81920.0),
                temperature_c: Some(g.temperature_c.unwrap_or(35.0)),
                power_w: Some(g.power_w.unwrap_or(80.0)),
            })
            .collect()
    }
}

/// The handle the API sets the simulation through.
#[derive(Debug, Clone, Default)]
pub struct SimHandle(Arc<Mutex<Simulation>>);

impl SimHandle {
    pub fn set(&self, sim: Simulation) -> Result<(), String> {
        sim.check()?;
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = sim;
        Ok(())
    }

    pub fn get(&self) -> Simulation {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Reports what its [`SimHandle`] was set to, or what `file` says when that
/// file exists (read at every scrape, so a demo can edit it live).
pub struct SimulatedGpus {
    handle: SimHandle,
    file: Option<PathBuf>,
}

impl SimulatedGpus {
    pub fn new(handle: SimHandle, file: Option<PathBuf>) -> Self {
        SimulatedGpus { handle, file }
    }
}

impl GpuSource for SimulatedGpus {
    fn kind(&self) -> &'static str {
        "simulated"
    }

    fn read(&mut self) -> Result<Vec<GpuReading>, SourceError> {
        if let Some(path) = &self.file {
            match std::fs::read(path) {
                Ok(bytes) => {
                    let sim: Simulation = serde_json::from_slice(&bytes).map_err(|e| {
                        SourceError::Other(format!("simulation file {}: {e}", path.display()))
                    })?;
                    self.handle.set(sim).map_err(|e| {
                        SourceError::Other(format!("simulation file {}: {e}", path.display()))
                    })?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(SourceError::Other(format!(
                        "simulation file {}: {e}",
                        path.display()
                    )))
                }
            }
        }
        let sim = self.handle.get();
        if sim.fail {
            return Err(SourceError::Other("simulated failure".into()));
        }
        Ok(sim.readings())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_defaults_and_settings() {
        let handle = SimHandle::default();
        let mut src = SimulatedGpus::new(handle.clone(), None);
        let r = src.read().unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].utilization, 0.0);
        assert_eq!(r[0].memory_total_mb, 81920.0);
        let sim: Simulation = serde_json::from_str(
            r#"{"gpus":[{"utilization":95,"memory_used_mb":70000},{"utilization":10}]}"#,
        )
        .unwrap();
        handle.set(sim).unwrap();
        let r = src.read().unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].utilization, r[0].memory_used_mb), (95.0, 70000.0));
        assert_eq!(r[1].index, 1);
        handle
            .set(Simulation {
                gpus: vec![],
                fail: true,
            })
            .unwrap();
        assert!(src.read().is_err());
    }

    #[test]
    fn simulated_values_are_checked() {
        let bad: Simulation = serde_json::from_str(r#"{"gpus":[{"utilization":150}]}"#).unwrap();
        assert!(SimHandle::default()
            .set(bad)
            .unwrap_err()
            .contains("gpus[0].utilization"));
        assert!(serde_json::from_str::<Simulation>(r#"{"gpus":[{"utilisation":1}]}"#).is_err());
    }

    #[test]
    fn the_file_wins_when_it_exists() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sim.json");
        let mut src = SimulatedGpus::new(SimHandle::default(), Some(path.clone()));
        assert_eq!(src.read().unwrap()[0].utilization, 0.0);
        std::fs::write(&path, r#"{"gpus":[{"utilization":91}]}"#).unwrap();
        assert_eq!(src.read().unwrap()[0].utilization, 91.0);
        std::fs::write(&path, "{").unwrap();
        assert!(src.read().is_err());
    }

    #[test]
    fn nvml_is_missing_here_or_reads() {
        // On a machine without the driver this is the "no NVML" path; on a
        // GPU machine it reads real devices. Either way: no panic.
        match NvmlSource::open() {
            Ok(mut src) => {
                let gpus = src.read().unwrap();
                assert!(gpus.iter().all(|g| (0.0..=100.0).contains(&g.utilization)));
            }
            Err(e) => assert!(NvmlSource::why_missing(&e).starts_with("no NVML")),
        }
    }
}
