//! vLLM-shaped Prometheus metrics: gauges the tests set through
//! `POST /admin/metrics`, and TTFT / end-to-end histograms of served requests.
//!
//! The exposition is written by hand: it is a few fixed series whose names,
//! types, buckets and labels must match vLLM's byte for byte (`vllm:`
//! names, `engine` and `model_name` labels, written in sorted order as
//! prometheus_client does, so a bucket's `le` sits between them), which is
//! simpler to read here than to coax out of a registry. Names, types and
//! buckets as vLLM's PrometheusStatLogger declares them
//! (vllm/v1/metrics/loggers.py): gauges `vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and the
//! deprecated `vllm:gpu_cache_usage_perc`; histograms
//! `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Deserialize;

use crate::lock;

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `vllm:e2e_request_latency_seconds` buckets.
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A partial update from `POST /admin/metrics`; absent fields keep their value.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GaugeUpdate {
    pub num_requests_waiting: Option<f64>,
    /// Once set, replaces the live count of in-flight requests.
    pub num_requests_running: Option<f64>,
    /// A 0–1 fraction.
    pub kv_cache_usage_perc: Option<f64>,
    /// A 0–1 fraction; mirrors `kv_cache_usage_perc` unless set on its own
    /// (older vLLM exports only this name).
    pub gpu_cache_usage_perc: Option<f64>,
}

impl GaugeUpdate {
    pub fn validate(&self) -> Result<(), String> {
        let counts = [
            ("num_requests_waiting", self.num_requests_waiting),
            ("num_requests_running", self.num_requests_running),
        ];
        for (name, v) in counts {
            if v.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                return Err(format!("{name}: must be a finite number >= 0"));
            }
        }
        let fractions = [
            ("kv_cache_usage_perc", self.kv_cache_usage_perc),
            ("gpu_cache_usage_perc", self.gpu_cache_usage_perc),
        ];
        for (name, v) in fractions {
            if v.is_some_and(|v| !(0.0..=1.0).contains(&v)) {
                return Err(format!("{name}: must be a fraction between 0 and 1"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Gauges {
    waiting: f64,
    running: Option<f64>,
    kv_cache: f64,
    gpu_cache: Option<f64>,
}

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (not cumulative) counts; the last slot is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        let slot = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[slot] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// `engine` and `model` are the two labels; `le` goes between them, as
    /// prometheus_client (vLLM's exporter) writes labels in sorted order.
    fn render(&self, out: &mut String, name: &str, help: &str, engine: &str, model: &str) {
        let labels = format!("{engine},{model}");
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, n) in self.counts.iter().enumerate() {
            cumulative += n;
            let le = match self.bounds.get(i) {
                Some(b) => format!("{b:?}"),
                None => "+Inf".to_owned(),
            };
            let _ = writeln!(
                out,
                "{name}_bucket{{{engine},le=\"{le}\",{model}}} {:?}",
                cumulative as f64
            );
        }
        let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {:?}", self.count as f64);
    }
}

#[derive(Debug)]
pub struct Metrics {
    model: String,
    gauges: Mutex<Gauges>,
    ttft: Mutex<Histogram>,
    e2e: Mutex<Histogram>,
    in_flight: AtomicI64,
    /// Peak and time at each in-flight level (`/admin/stats`).
    pub load: crate::load::Load,
}

impl Metrics {
    pub fn new(model: String) -> Self {
        Metrics {
            model,
            gauges: Mutex::default(),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            e2e: Mutex::new(Histogram::new(E2E_BUCKETS)),
            in_flight: AtomicI64::new(0),
            load: crate::load::Load::default(),
        }
    }

    pub fn apply(&self, update: &GaugeUpdate) {
        let mut g = lock(&self.gauges);
        if let Some(v) = update.num_requests_waiting {
            g.waiting = v;
        }
        if let Some(v) = update.num_requests_running {
            g.running = Some(v);
        }
        if let Some(v) = update.kv_cache_usage_perc {
            g.kv_cache = v;
        }
        if let Some(v) = update.gpu_cache_usage_perc {
            g.gpu_cache = Some(v);
        }
    }

    /// Back to a fresh start: gauges unset, histograms empty.
    pub fn reset(&self) {
        *lock(&self.gauges) = Gauges::default();
        *lock(&self.ttft) = Histogram::new(TTFT_BUCKETS);
        *lock(&self.e2e) = Histogram::new(E2E_BUCKETS);
        self.load.reset();
    }

    /// Starts timing one served request; it counts as running until dropped.
    pub fn start_request(self: &Arc<Self>, started: Instant) -> RequestTimer {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.load.change(1);
        RequestTimer {
            metrics: Arc::clone(self),
            started,
            first_token_seen: false,
            finished: false,
        }
    }

    pub fn render(&self) -> String {
        let engine = "engine=\"0\"";
        let model = format!(
            "model_name=\"{}\"",
            self.model.replace('\\', "\\\\").replace('"', "\\\"")
        );
        let labels = format!("{engine},{model}");
        let (waiting, running, kv, gpu) = {
            let g = lock(&self.gauges);
            let live = self.in_flight.load(Ordering::Relaxed).max(0) as f64;
            (
                g.waiting,
                g.running.unwrap_or(live),
                g.kv_cache,
                g.gpu_cache.unwrap_or(g.kv_cache),
            )
        };
        let mut out = String::new();
        let gauges = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                kv,
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                gpu,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v:?}"
            );
        }
        lock(&self.ttft).render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            engine,
            &model,
        );
        lock(&self.e2e).render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            engine,
            &model,
        );
        out
    }
}

/// Times one request; holds its slot in the live running count.
#[derive(Debug)]
pub struct RequestTimer {
    metrics: Arc<Metrics>,
    started: Instant,
    first_token_seen: bool,
    finished: bool,
}

impl RequestTimer {
    /// The first token left the server (observed once).
    pub fn first_token(&mut self) {
        if !self.first_token_seen {
            self.first_token_seen = true;
            let secs = self.started.elapsed().as_secs_f64();
            lock(&self.metrics.ttft).observe(secs);
        }
    }

    /// The request completed normally (observed once). A request dropped
    /// before this (reset, client gone) is not a completed request in vLLM's
    /// sense and is left out of the E2E histogram.
    pub fn finish(&mut self) {
        self.first_token();
        if !self.finished {
            self.finished = true;
            let secs = self.started.elapsed().as_secs_f64();
            lock(&self.metrics.e2e).observe(secs);
        }
    }
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.metrics.load.change(-1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_and_cumulative_buckets() {
        let m = Arc::new(Metrics::new("m1".into()));
        m.apply(&GaugeUpdate {
            num_requests_waiting: Some(12.0),
            kv_cache_usage_perc: Some(0.95),
            ..Default::default()
        });
        {
            let mut t = m.start_request(Instant::now());
            t.finish();
        }
        let text = m.render();
        assert!(text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"m1\"} 12.0"));
        assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"m1\"} 0.0"));
        assert!(text.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m1\"} 0.95"));
        assert!(text.contains("vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m1\"} 0.95"));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m1\"} 1.0"
        ));
        assert!(text.contains(
            "vllm:e2e_request_latency_seconds_count{engine=\"0\",model_name=\"m1\"} 1.0"
        ));
    }

    #[test]
    fn running_is_live_until_overridden() {
        let m = Arc::new(Metrics::new("m".into()));
        let _t = m.start_request(Instant::now());
        assert!(m
            .render()
            .contains("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1.0"));
        m.apply(&GaugeUpdate {
            num_requests_running: Some(3.0),
            ..Default::default()
        });
        assert!(m
            .render()
            .contains("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0"));
    }

    #[test]
    fn rejects_out_of_range_values() {
        let bad = GaugeUpdate {
            kv_cache_usage_perc: Some(95.0),
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("kv_cache_usage_perc"));
    }
}
