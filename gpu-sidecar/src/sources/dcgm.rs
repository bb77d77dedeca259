//! NVIDIA's DCGM exporter (`dcgm-exporter`, `GET :9400/metrics`) as a
//! source of GPU signals for GPUs that are not local: on Kubernetes the
//! gateway rarely runs on the GPU node.
//!
//! One `sources.dcgm[]` entry is one backend of the monitor (scope
//! `backend:NAME`, plus `model:M` per listed model), fed the same GPU
//! metrics NVML feeds (`gpu_utilization`, `gpu_memory`, `gpu_temperature`,
//! `gpu_power`: the worst GPU of its selection) and one NVML has not,
//! `gpu_xid_errors`: new XID errors within `xid.window`.
//!
//! What it reads, per GPU (labels `gpu`, `UUID`, `Hostname`, `GPU_I_ID` for
//! MIG instances; `pod`/`namespace`/`container` when the exporter maps
//! pods), from the exporter's default counters:
//! `DCGM_FI_DEV_GPU_UTIL` (%), `DCGM_FI_DEV_FB_USED` / `DCGM_FI_DEV_FB_FREE`
//! (MiB), `DCGM_FI_DEV_GPU_TEMP` (°C), `DCGM_FI_DEV_POWER_USAGE` (W),
//! `DCGM_FI_DEV_XID_ERRORS` (the *last* XID, sticky until the exporter
//! restarts) and, when enabled, `DCGM_EXP_XID_ERRORS_COUNT` (XIDs within
//! the exporter's window, label `xid`).
//!
//! A scrape that fails (no answer, timeout, non-2xx, no DCGM series, no GPU
//! matching `select`, nothing readable) feeds nothing, as a failed NVML read
//! does: the scope goes stale after `breaker.stale_after` unless another
//! source feeds it, and `breaker.on_stale` decides.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::prom::{self, Sample};
use super::{BackendReading, BackendSource, SourceError};
use crate::breaker::Metric;
use crate::config::sources::{DcgmConfig, XidConfig};
use crate::http::{self, Target};

pub const GPU_UTIL: &str = "DCGM_FI_DEV_GPU_UTIL";
pub const FB_USED: &str = "DCGM_FI_DEV_FB_USED";
pub const FB_FREE: &str = "DCGM_FI_DEV_FB_FREE";
pub const GPU_TEMP: &str = "DCGM_FI_DEV_GPU_TEMP";
pub const POWER: &str = "DCGM_FI_DEV_POWER_USAGE";
pub const XID: &str = "DCGM_FI_DEV_XID_ERRORS";
pub const XID_COUNT: &str = "DCGM_EXP_XID_ERRORS_COUNT";

const FIELDS: [&str; 7] = [GPU_UTIL, FB_USED, FB_FREE, GPU_TEMP, POWER, XID, XID_COUNT];

/// An answer listing more GPUs than this is refused: a per-node exporter
/// lists a handful (8 GPUs × 7 MIG instances at most), and what is kept
/// between scrapes grows with it.
pub const MAX_GPUS: usize = 4096;

/// XID events remembered per source; the count saturates there.
const MAX_EVENTS: usize = 4096;

/// DCGM writes "blank" sentinels (not supported, not found, no permission)
/// instead of values: from `DCGM_INT32_BLANK` (0x7ffffff0) up for 32-bit
/// fields, far higher for 64-bit and floating ones. No real reading of the
/// fields read here comes near it.
const BLANK: f64 = 2_147_483_632.0;

/// One GPU (or MIG instance) as one answer lists it; what it does not
/// report, or reports as NaN, a DCGM blank or out of range, is `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DcgmGpu {
    pub utilization: Option<f64>,
    pub fb_used_mib: Option<f64>,
    pub fb_free_mib: Option<f64>,
    pub temperature_c: Option<f64>,
    pub power_w: Option<f64>,
    /// `DCGM_FI_DEV_XID_ERRORS`, 0 when the last XID is an ignored one.
    pub last_xid: Option<u32>,
    /// `DCGM_EXP_XID_ERRORS_COUNT` per `xid` label (ignored codes left out).
    pub xid_counts: BTreeMap<String, f64>,
}

impl DcgmGpu {
    /// Used memory as a fraction 0–1, when both used and free are known.
    pub fn memory_fraction(&self) -> Option<f64> {
        let (used, free) = (self.fb_used_mib?, self.fb_free_mib?);
        let total = used + free;
        (total > 0.0).then(|| used / total)
    }

    fn xid_count(&self) -> Option<f64> {
        (!self.xid_counts.is_empty()).then(|| self.xid_counts.values().sum())
    }

    fn has_reading(&self) -> bool {
        self.utilization.is_some()
            || self.memory_fraction().is_some()
            || self.temperature_c.is_some()
            || self.power_w.is_some()
    }
}

/// Who a GPU is: its node, its UUID (else its index) and its MIG instance.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuKey {
    pub host: String,
    pub id: String,
    pub instance: String,
}

impl GpuKey {
    fn of(s: &Sample<'_>) -> Option<GpuKey> {
        let id = match s.label("UUID").or_else(|| s.label("uuid")) {
            Some(u) if !u.is_empty() => u.to_string(),
            _ => format!("gpu {}", s.label("gpu").filter(|g| !g.is_empty())?),
        };
        Some(GpuKey {
            host: s.label("Hostname").unwrap_or_default().to_string(),
            id,
            instance: s.label("GPU_I_ID").unwrap_or_default().to_string(),
        })
    }
}

/// What one answer holds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    /// GPUs the answer lists, selected or not.
    pub listed: usize,
    /// The selected ones.
    pub gpus: BTreeMap<GpuKey, DcgmGpu>,
}

fn matches(select: &BTreeMap<String, String>, s: &Sample<'_>) -> bool {
    select.iter().all(|(key, want)| {
        s.label(key).is_some_and(|v| match want.strip_suffix('*') {
            Some(prefix) => v.starts_with(prefix),
            None => v == want,
        })
    })
}

/// A reading DCGM could have meant: finite, not negative, below the blanks.
fn plausible(v: f64) -> Option<f64> {
    (v.is_finite() && (0.0..BLANK).contains(&v)).then_some(v)
}

fn keep_max(slot: &mut Option<f64>, v: Option<f64>) {
    if let Some(v) = v {
        *slot = Some(slot.map_or(v, |old| old.max(v)));
    }
}

fn keep_min(slot: &mut Option<f64>, v: Option<f64>) {
    if let Some(v) = v {
        *slot = Some(slot.map_or(v, |old| old.min(v)));
    }
}

/// The series of `text` this source reads, each line parsed on its own
/// (other metrics are not even parsed). Duplicated series of one GPU (the
/// same GPU mapped to several pods, or listed twice) count with their worst
/// value.
pub fn parse(
    text: &str,
    select: &BTreeMap<String, String>,
    ignore: &[u32],
) -> Result<Scrape, String> {
    let mut listed: BTreeSet<GpuKey> = BTreeSet::new();
    let mut gpus: BTreeMap<GpuKey, DcgmGpu> = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim_start();
        let end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .unwrap_or(line.len());
        let Some(&field) = FIELDS.iter().find(|f| **f == &line[..end]) else {
            continue;
        };
        let Some(s) = prom::parse(line).into_iter().next() else {
            continue;
        };
        let Some(key) = GpuKey::of(&s) else {
            continue; // no `UUID` and no `gpu`: nobody's reading
        };
        if !listed.contains(&key) {
            if listed.len() >= MAX_GPUS {
                return Err(format!(
                    "the answer lists more than {MAX_GPUS} GPUs: not one node's exporter"
                ));
            }
            listed.insert(key.clone());
        }
        if !matches(select, &s) {
            continue;
        }
        let g = gpus.entry(key).or_default();
        let v = plausible(s.value);
        match field {
            GPU_UTIL => keep_max(&mut g.utilization, v.filter(|u| *u <= 100.0)),
            FB_USED => keep_max(&mut g.fb_used_mib, v),
            FB_FREE => keep_min(&mut g.fb_free_mib, v),
            GPU_TEMP => keep_max(&mut g.temperature_c, v),
            POWER => keep_max(&mut g.power_w, v),
            XID => {
                let Some(code) = v.filter(|c| c.fract() == 0.0) else {
                    continue;
                };
                // Below BLANK, so it fits.
                let code = code as u32;
                let code = if ignore.contains(&code) { 0 } else { code };
                g.last_xid = Some(g.last_xid.map_or(code, |old| old.max(code)));
            }
            _ => {
                let Some(n) = v else { continue };
                let xid = s.label("xid").unwrap_or_default();
                if xid.parse::<u32>().is_ok_and(|c| ignore.contains(&c)) {
                    continue;
                }
                let slot = g.xid_counts.entry(xid.to_string()).or_insert(n);
                *slot = slot.max(n);
            }
        }
    }
    if listed.is_empty() {
        return Err(format!(
            "no DCGM GPU series ({GPU_UTIL}, {FB_USED}, …) in the answer: is this a DCGM exporter's /metrics?"
        ));
    }
    if gpus.is_empty() {
        return Err(format!(
            "none of the {} GPUs listed matches `select`",
            listed.len()
        ));
    }
    Ok(Scrape {
        listed: listed.len(),
        gpus,
    })
}

/// Scrapes one DCGM exporter.
pub struct DcgmSource {
    name: String,
    target: Target,
    interval: Duration,
    timeout: Duration,
    select: BTreeMap<String, String>,
    xid: XidConfig,
    /// Per GPU at the last good scrape: the last XID and the XID count,
    /// to tell a new XID from the sticky last one.
    seen: HashMap<GpuKey, (u32, f64)>,
    /// When new XIDs were seen, oldest first.
    events: VecDeque<Instant>,
    last: Option<LastScrape>,
}

/// The last good scrape.
struct LastScrape {
    at: Instant,
    /// Its GPU samples, XIDs apart.
    samples: Vec<(Metric, f64)>,
    /// Whether any selected GPU reported XIDs.
    reports_xid: bool,
}

impl DcgmSource {
    pub fn new(
        config: &DcgmConfig,
        scrape_interval: Duration,
        scrape_timeout: Duration,
    ) -> Result<DcgmSource, http::HttpError> {
        Ok(DcgmSource {
            name: config.backend.name.clone(),
            target: config.target()?,
            interval: config.interval.unwrap_or(scrape_interval),
            timeout: config.timeout.unwrap_or(scrape_timeout),
            select: config.select.clone(),
            xid: config.xid.clone(),
            seen: HashMap::new(),
            events: VecDeque::new(),
            last: None,
        })
    }

    /// Turns one answer's text, read at `at`, into samples for the engine.
    pub fn read(&mut self, text: &str, at: Instant) -> Result<BackendReading, SourceError> {
        let scrape = parse(text, &self.select, &self.xid.ignore).map_err(SourceError::Other)?;
        if !scrape.gpus.values().any(DcgmGpu::has_reading) {
            return Err(SourceError::Other(format!(
                "the {} selected GPUs report no readable value",
                scrape.gpus.len()
            )));
        }
        let mut samples: Vec<(Metric, f64)> = Vec::new();
        let mut worst = |m: Metric, v: Option<f64>| {
            let Some(v) = v else { return };
            match samples.iter_mut().find(|(k, _)| *k == m) {
                Some((_, w)) => *w = w.max(v),
                None => samples.push((m, v)),
            }
        };
        for g in scrape.gpus.values() {
            worst(Metric::GpuUtilization, g.utilization);
            worst(Metric::GpuMemory, g.memory_fraction());
            worst(Metric::GpuTemperature, g.temperature_c);
            worst(Metric::GpuPower, g.power_w);
        }
        let mut new = 0usize;
        let mut reports_xid = false;
        let mut seen = HashMap::with_capacity(scrape.gpus.len());
        for (key, g) in scrape.gpus {
            let before = self.seen.get(&key).copied();
            let code = g.last_xid.or(before.map(|b| b.0)).unwrap_or(0);
            let count = g.xid_count().or(before.map(|b| b.1)).unwrap_or(0.0);
            reports_xid |= g.last_xid.is_some() || !g.xid_counts.is_empty();
            // A GPU seen for the first time sets the baseline: the last XID
            // is sticky and may be days old.
            if let Some((code_before, count_before)) = before {
                let by_code = usize::from(code != 0 && code != code_before);
                let by_count = (count - count_before).clamp(0.0, MAX_EVENTS as f64) as usize;
                new = new.saturating_add(by_code.max(by_count));
            }
            seen.insert(key, (code, count));
        }
        self.seen = seen;
        for _ in 0..new.min(MAX_EVENTS) {
            if self.events.len() >= MAX_EVENTS {
                self.events.pop_front();
            }
            self.events.push_back(at);
        }
        self.last = Some(LastScrape {
            at,
            samples,
            reports_xid,
        });
        Ok(self.reading(at))
    }

    /// The last good scrape's samples, with the XIDs within the window at `at`.
    fn reading(&mut self, at: Instant) -> BackendReading {
        let window = self.xid.window;
        while self
            .events
            .front()
            .is_some_and(|t| at.saturating_duration_since(*t) >= window)
        {
            self.events.pop_front();
        }
        let mut samples = Vec::new();
        if let Some(last) = &self.last {
            samples.clone_from(&last.samples);
            if last.reports_xid || !self.events.is_empty() {
                samples.push((Metric::GpuXidErrors, self.events.len() as f64));
            }
        }
        BackendReading {
            samples,
            models: Vec::new(),
        }
    }
}

impl BackendSource for DcgmSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "dcgm"
    }

    fn poll(&mut self, at: Instant) -> BoxFuture<'_, Result<BackendReading, SourceError>> {
        Box::pin(async move {
            let fresh = self
                .last
                .as_ref()
                .is_some_and(|l| at.saturating_duration_since(l.at) < self.interval);
            if fresh {
                return Ok(self.reading(at));
            }
            let answer = http::get(&self.target, self.timeout).await;
            let result = match answer {
                Ok(body) => self.read(&String::from_utf8_lossy(&body), at),
                Err(e) => Err(SourceError::from(e)),
            };
            if result.is_err() {
                self.last = None;
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::dcgm_warnings as warnings;
    use crate::config::Config;

    /// A DCGM exporter's answer as it writes it (default counters, pod
    /// mapping on): 4 H100s on `gpu-node-7`, GPUs 0–1 in pod
    /// `llm/vllm-llama-0`, 2 in `llm/vllm-mistral-0`, 3 unassigned.
    const FIXTURE: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/testdata/dcgm-exporter.txt"
    ));

    fn sel(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// `FIXTURE` with `metric` of GPU `gpu` set to `value`.
    fn with(text: &str, metric: &str, gpu: u32, value: &str) -> String {
        let prefix = format!("{metric}{{gpu=\"{gpu}\",");
        text.lines()
            .map(|l| match l.strip_prefix(&prefix) {
                Some(_) => {
                    let (head, _) = l.rsplit_once(' ').unwrap();
                    format!("{head} {value}")
                }
                None => l.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn source(select: &[(&str, &str)]) -> DcgmSource {
        let config: DcgmConfig = serde_yaml::from_str(&format!(
            "{{name: d, url: 'http://127.0.0.1:9400', select: {{{}}}}}",
            select
                .iter()
                .map(|(k, v)| format!("{k}: '{v}'"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .unwrap();
        DcgmSource::new(&config, Duration::from_secs(2), Duration::from_secs(1)).unwrap()
    }

    fn value(r: &BackendReading, m: Metric) -> Option<f64> {
        r.samples.iter().find(|(k, _)| *k == m).map(|(_, v)| *v)
    }

    #[test]
    fn reads_the_exporters_own_format() {
        let s = parse(FIXTURE, &BTreeMap::new(), &[]).unwrap();
        assert_eq!(s.listed, 4);
        let g0 = &s.gpus[&GpuKey {
            host: "gpu-node-7".into(),
            id: "GPU-5a9e3f4c-1b2d-4e6f-8a9b-0c1d2e3f4a5b".into(),
            instance: String::new(),
        }];
        assert_eq!(g0.utilization, Some(43.0));
        assert_eq!(
            (g0.fb_used_mib, g0.fb_free_mib),
            (Some(71912.0), Some(9121.0))
        );
        assert_eq!(g0.temperature_c, Some(61.0));
        assert_eq!(g0.power_w, Some(412.117));
        assert_eq!(g0.last_xid, Some(0));
        let f = g0.memory_fraction().unwrap();
        assert!((f - 71912.0 / 81033.0).abs() < 1e-9, "{f}");
    }

    #[test]
    fn the_selection_takes_the_worst_of_its_gpus() {
        let mut src = source(&[("namespace", "llm"), ("pod", "vllm-llama-0")]);
        let r = src.read(FIXTURE, Instant::now()).unwrap();
        // GPUs 0 and 1 only: 47 %, not GPU 2's or 3's.
        assert_eq!(value(&r, Metric::GpuUtilization), Some(47.0));
        assert_eq!(value(&r, Metric::GpuTemperature), Some(63.0));
        assert_eq!(value(&r, Metric::GpuPower), Some(431.846));
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(0.0));
        let m = value(&r, Metric::GpuMemory).unwrap();
        assert!((m - 71944.0 / 81033.0).abs() < 1e-9, "{m}");

        let mut src = source(&[("pod", "vllm-mistral-*")]);
        let r = src.read(FIXTURE, Instant::now()).unwrap();
        assert_eq!(value(&r, Metric::GpuUtilization), Some(21.0));
        let mut src = source(&[("Hostname", "gpu-node-7"), ("gpu", "3")]);
        let r = src.read(FIXTURE, Instant::now()).unwrap();
        assert_eq!(value(&r, Metric::GpuUtilization), Some(0.0));
        // No selection: all four.
        let r = source(&[]).read(FIXTURE, Instant::now()).unwrap();
        assert_eq!(value(&r, Metric::GpuUtilization), Some(47.0));
    }

    #[test]
    fn no_match_and_no_dcgm_are_failures_not_healthy_answers() {
        let e = source(&[("pod", "gone-0")])
            .read(FIXTURE, Instant::now())
            .unwrap_err();
        assert!(e.to_string().contains("none of the 4 GPUs"), "{e}");
        // A label the unassigned GPU lacks: it is not selected.
        let e = source(&[("namespace", "")])
            .read(FIXTURE, Instant::now())
            .unwrap_err();
        assert!(e.to_string().contains("matches"), "{e}");
        let vllm = "vllm:num_requests_waiting 3\n# HELP x\n";
        let e = source(&[]).read(vllm, Instant::now()).unwrap_err();
        assert!(e.to_string().contains("no DCGM GPU series"), "{e}");
        assert!(source(&[]).read("", Instant::now()).is_err());
        // Listed, selected, but nothing readable.
        let text = "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\"} NaN\n\
                    DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",UUID=\"GPU-a\"} 9223372036854775794\n";
        let e = source(&[]).read(text, Instant::now()).unwrap_err();
        assert!(e.to_string().contains("no readable value"), "{e}");
    }

    #[test]
    fn hostile_values_are_no_readings() {
        let text = "\
DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\"} NaN
DCGM_FI_DEV_GPU_UTIL{gpu=\"1\",UUID=\"GPU-b\"} +Inf
DCGM_FI_DEV_GPU_UTIL{gpu=\"2\",UUID=\"GPU-c\"} 250
DCGM_FI_DEV_GPU_UTIL{gpu=\"3\",UUID=\"GPU-d\"} -5
DCGM_FI_DEV_GPU_UTIL{gpu=\"4\",UUID=\"GPU-e\"} 12
DCGM_FI_DEV_GPU_TEMP{gpu=\"4\",UUID=\"GPU-e\"} 9223372036854775794
DCGM_FI_DEV_POWER_USAGE{gpu=\"4\",UUID=\"GPU-e\"} 140737488355328.000000
DCGM_FI_DEV_FB_USED{gpu=\"4\",UUID=\"GPU-e\"} 2147483647
DCGM_FI_DEV_XID_ERRORS{gpu=\"4\",UUID=\"GPU-e\"} 79.5
";
        let s = parse(text, &BTreeMap::new(), &[]).unwrap();
        assert_eq!(s.listed, 5);
        let utils: Vec<_> = s.gpus.values().map(|g| g.utilization).collect();
        assert_eq!(utils, vec![None, None, None, None, Some(12.0)]);
        let e = s.gpus.values().last().unwrap();
        assert_eq!(
            (e.temperature_c, e.power_w, e.fb_used_mib, e.last_xid),
            (None, None, None, None)
        );
    }

    #[test]
    fn missing_labels_broken_lines_and_duplicates() {
        let text = "\
DCGM_FI_DEV_GPU_UTIL 99
DCGM_FI_DEV_GPU_UTIL{Hostname=\"n\",modelName=\"x\"} 98
DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\",modelName=\"NVIDIA \"H100\"\"} 97
DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\"
DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\",pod=\"a\"} 40
DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\",pod=\"b\"} 60
DCGM_FI_DEV_FB_FREE{gpu=\"0\",UUID=\"GPU-a\",pod=\"a\"} 100
DCGM_FI_DEV_FB_FREE{gpu=\"0\",UUID=\"GPU-a\",pod=\"b\"} 50
DCGM_FI_DEV_FB_USED{gpu=\"0\",UUID=\"GPU-a\",pod=\"a\"} 950
DCGM_FI_DEV_FB_USED{gpu=\"0\",UUID=\"GPU-a\",pod=\"b\"} 950
DCGM_FI_DEV_GPU_UTIL{gpu=\"1\"} 10
DCGM_FI_DEV_GPU_UTIL_EXTRA{gpu=\"2\",UUID=\"GPU-c\"} 100
";
        let s = parse(text, &BTreeMap::new(), &[]).unwrap();
        // No `UUID` nor `gpu`: skipped; the unterminated label and the
        // broken line: skipped; `gpu` alone identifies GPU 1.
        assert_eq!(s.listed, 2, "{s:?}");
        let a = s.gpus.values().next().unwrap();
        // Duplicates (one GPU in two pods) count with the worst value.
        assert_eq!(a.utilization, Some(60.0));
        assert_eq!(a.memory_fraction(), Some(0.95));
        let only_a = parse(text, &sel(&[("pod", "a")]), &[]).unwrap();
        assert_eq!(only_a.gpus.len(), 1);
        assert_eq!(only_a.gpus.values().next().unwrap().utilization, Some(40.0));
    }

    #[test]
    fn huge_and_many_lines_stay_bounded() {
        // A 4 MiB label value: read (or skipped) without trouble.
        let big = "x".repeat(4 << 20);
        let text = format!(
            "DCGM_FI_DEV_GPU_UTIL{{gpu=\"0\",UUID=\"GPU-a\",modelName=\"{big}\"}} 55\n\
             # HELP {big}\n{big} 1\n"
        );
        let s = parse(&text, &BTreeMap::new(), &[]).unwrap();
        assert_eq!(s.gpus.values().next().unwrap().utilization, Some(55.0));
        // More GPUs than a node has: refused, not kept.
        let many: String = (0..=MAX_GPUS)
            .map(|i| format!("DCGM_FI_DEV_GPU_UTIL{{gpu=\"{i}\",UUID=\"GPU-{i}\"}} 1\n"))
            .collect();
        let e = parse(&many, &BTreeMap::new(), &[]).unwrap_err();
        assert!(e.contains("more than 4096 GPUs"), "{e}");
    }

    #[test]
    fn a_new_xid_counts_the_sticky_one_does_not() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut src = source(&[("pod", "vllm-llama-0")]);
        // Already showing at the first scrape: the baseline, not a fault.
        let old = with(FIXTURE, XID, 1, "31");
        let r = src.read(&old, t0).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(0.0));
        let r = src.read(&old, t0 + s(2)).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(0.0));
        // A new one on GPU 0: counted, for the window (5 min).
        let new = with(&old, XID, 0, "79");
        let r = src.read(&new, t0 + s(4)).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(1.0));
        let r = src.read(&new, t0 + s(200)).unwrap();
        assert_eq!(
            value(&r, Metric::GpuXidErrors),
            Some(1.0),
            "sticky: no new one"
        );
        let r = src.read(&new, t0 + s(304)).unwrap();
        assert_eq!(
            value(&r, Metric::GpuXidErrors),
            Some(0.0),
            "out of the window"
        );
        // A GPU outside the selection: not this source's fault.
        let other = with(&new, XID, 2, "79");
        let r = src.read(&other, t0 + s(306)).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(0.0));
        // The exporter restarted (0), then the same XID again: new.
        src.read(&with(&other, XID, 0, "0"), t0 + s(308)).unwrap();
        let r = src.read(&other, t0 + s(310)).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(1.0));
    }

    #[test]
    fn ignored_xids_and_the_xid_counter() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let config: DcgmConfig = serde_yaml::from_str(
            "{name: d, url: 'http://127.0.0.1:9400', xid: {window: 1m, ignore: [43]}}",
        )
        .unwrap();
        let mut src = DcgmSource::new(&config, s(2), s(1)).unwrap();
        src.read(FIXTURE, t0).unwrap();
        let r = src.read(&with(FIXTURE, XID, 0, "43"), t0 + s(1)).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(0.0), "43 is ignored");
        let counted = |n43: u32, n48: u32| {
            format!(
                "{FIXTURE}# HELP {XID_COUNT} Count of XID Errors within user-specified time window (see xid-count-window-size param).\n\
                 # TYPE {XID_COUNT} gauge\n\
                 {XID_COUNT}{{gpu=\"3\",UUID=\"GPU-9b8a7f6e-5d4c-4b3a-a291-807f6e5d4c3b\",device=\"nvidia3\",Hostname=\"gpu-node-7\",window_size_in_ms=\"300000\",xid=\"43\"}} {n43}\n\
                 {XID_COUNT}{{gpu=\"3\",UUID=\"GPU-9b8a7f6e-5d4c-4b3a-a291-807f6e5d4c3b\",device=\"nvidia3\",Hostname=\"gpu-node-7\",window_size_in_ms=\"300000\",xid=\"48\"}} {n48}\n"
            )
        };
        src.read(&counted(0, 0), t0 + s(2)).unwrap();
        // The same code twice, which the sticky gauge cannot show: counted.
        let r = src.read(&counted(5, 2), t0 + s(3)).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(2.0));
        // The exporter's window slid (fewer): nothing new.
        let r = src.read(&counted(5, 1), t0 + s(4)).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(2.0));
        let r = src.read(&counted(5, 1), t0 + s(64)).unwrap();
        assert_eq!(value(&r, Metric::GpuXidErrors), Some(0.0));
    }

    #[test]
    fn config_paths_and_checks() {
        let err = |yaml: &str| Config::from_yaml(yaml).unwrap_err().to_string();
        let ok = Config::from_yaml(
            "sources:\n  gpu: none\n  dcgm:\n    - {name: g, url: 'http://10.0.0.7:9400', models: [m], \
             select: {namespace: llm, pod: 'vllm-*'}, interval: 10s, timeout: 2s, xid: {window: 2m, ignore: [13, 31]}}\n",
        )
        .unwrap();
        let d = &ok.sources.dcgm[0];
        assert_eq!(d.target().unwrap().path_and_query, "/metrics");
        assert_eq!(d.interval, Some(Duration::from_secs(10)));
        assert_eq!(d.xid.ignore, vec![13, 31]);
        let scopes: Vec<_> = ok
            .scope_plans()
            .unwrap()
            .into_iter()
            .map(|p| (p.scope, p.backends))
            .collect();
        assert_eq!(
            scopes,
            vec![("backend:g".into(), vec![0]), ("model:m".into(), vec![0])]
        );
        let path = Config::from_yaml(
            "sources:\n  dcgm:\n    - {name: g, url: 'http://h:9400/custom/metrics'}\n",
        )
        .unwrap();
        assert_eq!(
            path.sources.dcgm[0].target().unwrap().path_and_query,
            "/custom/metrics"
        );
        for (yaml, at) in [
            ("{name: g, url: 'http://h:1', selct: {}}", "sources.dcgm[0]"),
            ("{name: g}", "sources.dcgm[0]"),
            ("{name: g, url: 'https://h:1'}", "sources.dcgm[0].url"),
            ("{name: '', url: 'http://h:1'}", "sources.dcgm[0].name"),
            (
                "{name: g, url: 'http://h:1', select: {'pod-name': x}}",
                "sources.dcgm[0].select.pod-name",
            ),
            (
                "{name: g, url: 'http://h:1', interval: 0s}",
                "sources.dcgm[0].interval",
            ),
            (
                "{name: g, url: 'http://h:1', interval: 30s}",
                "sources.dcgm[0].interval",
            ),
            (
                "{name: g, url: 'http://h:1', timeout: soon}",
                "sources.dcgm[0].timeout",
            ),
            (
                "{name: g, url: 'http://h:1', xid: {window: 0s}}",
                "sources.dcgm[0].xid.window",
            ),
            (
                "{name: g, url: 'http://h:1', xid: {ignore: [0]}}",
                "sources.dcgm[0].xid.ignore[0]",
            ),
            (
                "{name: g, url: 'http://h:1', xid: {ignor: [1]}}",
                "sources.dcgm[0].xid",
            ),
        ] {
            let e = err(&format!("sources:\n  dcgm:\n    - {yaml}\n"));
            assert!(e.starts_with(at), "{yaml}: {e}");
        }
        let e = err("sources:\n  vllm:\n    - {name: a, url: 'http://h:1'}\n  dcgm:\n    - {name: a, url: 'http://h:2'}\n");
        assert!(e.starts_with("sources.dcgm[0].name"), "{e}");
        let e = err("sources:\n  dcgm:\n    - {name: a, url: 'http://h:1'}\n    - {name: a, url: 'http://h:2'}\n");
        assert!(e.starts_with("sources.dcgm[1].name"), "{e}");
    }

    #[test]
    fn warns_when_no_rule_watches_xids() {
        let c = Config::from_yaml(
            "sources:\n  dcgm:\n    - {name: g, url: 'http://h:1', models: [m]}\n",
        )
        .unwrap();
        let w = warnings(&c, &c.scope_plans().unwrap());
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[0].contains("backend:g") && w[0].contains("gpu_xid_errors"),
            "{w:?}"
        );
        let c = Config::from_yaml(
            "sources:\n  dcgm:\n    - {name: g, url: 'http://h:1'}\n\
             rules:\n  - {metric: gpu_xid_errors, open_at: 1, open_for: 0s}\n",
        )
        .unwrap();
        assert!(warnings(&c, &c.scope_plans().unwrap()).is_empty());
    }

    #[tokio::test]
    async fn polls_scrape_every_interval_and_a_failure_feeds_nothing() {
        use std::sync::{Arc, Mutex};
        let body = Arc::new(Mutex::new((200u16, FIXTURE.to_string())));
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = {
            let (body, hits) = (body.clone(), hits.clone());
            axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || {
                    let (status, text) = body.lock().unwrap().clone();
                    hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async move { (axum::http::StatusCode::from_u16(status).unwrap(), text) }
                }),
            )
        };
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let config: DcgmConfig = serde_yaml::from_str(&format!(
            "{{name: d, url: 'http://{addr}', interval: 10s, select: {{pod: vllm-llama-0}}}}"
        ))
        .unwrap();
        let mut src =
            DcgmSource::new(&config, Duration::from_secs(2), Duration::from_secs(1)).unwrap();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let r = src.poll(t0).await.unwrap();
        assert_eq!(value(&r, Metric::GpuUtilization), Some(47.0));
        *body.lock().unwrap() = (200, with(FIXTURE, GPU_UTIL, 1, "99"));
        // Within the interval: the last reading, no new scrape.
        let r = src.poll(t0 + s(5)).await.unwrap();
        assert_eq!(value(&r, Metric::GpuUtilization), Some(47.0));
        assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
        let r = src.poll(t0 + s(10)).await.unwrap();
        assert_eq!(value(&r, Metric::GpuUtilization), Some(99.0));
        // A failed scrape is an error, and the cache is gone with it.
        *body.lock().unwrap() = (500, String::new());
        let e = src.poll(t0 + s(20)).await.unwrap_err();
        assert!(e.to_string().contains("500"), "{e}");
        assert!(src.poll(t0 + s(21)).await.is_err());
        assert_eq!(src.kind(), "dcgm");
    }
}
