//! vLLM's `/metrics`: queue, KV cache, and recent TTFT / end-to-end latency
//! quantiles from the histogram bucket deltas over a sliding window.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::prom::{self, Sample};
use super::{BackendReading, BackendSource, SourceError};
use crate::breaker::Metric;
use crate::http::{self, Target};

const WAITING: &str = "vllm:num_requests_waiting";
const RUNNING: &str = "vllm:num_requests_running";
const KV_CACHE: &str = "vllm:kv_cache_usage_perc";
/// The older name of the KV-cache gauge, read when the new one is absent.
const KV_CACHE_OLD: &str = "vllm:gpu_cache_usage_perc";
const TTFT: &str = "vllm:time_to_first_token_seconds";
const E2E: &str = "vllm:e2e_request_latency_seconds";

/// A cumulative histogram, summed over all its series (engines, models),
/// as `(le, count)` sorted by `le`, ending with `+Inf`.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The histogram `name` in `samples`, if it has any bucket.
    pub fn from_samples(samples: &[Sample<'_>], name: &str) -> Option<Histogram> {
        let bucket_name = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for s in samples.iter().filter(|s| s.name == bucket_name) {
            let Some(le) = s.label("le").and_then(|le| match le {
                "+Inf" | "Inf" => Some(f64::INFINITY),
                le => le.parse::<f64>().ok(),
            }) else {
                continue;
            };
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some((_, count)) => *count += s.value,
                None => buckets.push((le, s.value)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        (buckets.last()?.0 == f64::INFINITY).then_some(Histogram { buckets })
    }

    /// What was observed between `older` and `self`. A counter that went
    /// down (the server restarted) or a changed bucket layout: all of `self`.
    pub fn since(&self, older: &Histogram) -> Histogram {
        let same_layout = older.buckets.len() == self.buckets.len()
            && older
                .buckets
                .iter()
                .zip(&self.buckets)
                .all(|(o, n)| o.0 == n.0);
        if !same_layout
            || older
                .buckets
                .iter()
                .zip(&self.buckets)
                .any(|(o, n)| n.1 < o.1)
        {
            return self.clone();
        }
        Histogram {
            buckets: older
                .buckets
                .iter()
                .zip(&self.buckets)
                .map(|(o, n)| (n.0, n.1 - o.1))
                .collect(),
        }
    }

    pub fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |b| b.1)
    }

    /// The `q` quantile by linear interpolation inside the bucket, as
    /// Prometheus' `histogram_quantile` does; `None` with no observations.
    /// In the `+Inf` bucket it answers the highest finite bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(le, count) in &self.buckets {
            if count >= rank {
                if le == f64::INFINITY {
                    return Some(lower.0);
                }
                let lower_bound = if lower.0 == 0.0 && le < 0.0 {
                    le
                } else {
                    lower.0
                };
                if count == lower.1 {
                    return Some(le);
                }
                return Some(
                    lower_bound + (le - lower_bound) * (rank - lower.1) / (count - lower.1),
                );
            }
            lower = (le, count);
        }
        Some(lower.0)
    }
}

/// Keeps the snapshots of one histogram over the window, to compare the
/// newest against the oldest.
#[derive(Debug, Clone)]
pub struct LatencyWindow {
    window: Duration,
    history: VecDeque<(Instant, Histogram)>,
}

impl LatencyWindow {
    pub fn new(window: Duration) -> Self {
        LatencyWindow {
            window,
            history: VecDeque::new(),
        }
    }

    /// Adds the snapshot taken at `at`; returns p50 and p99 of what was
    /// observed over the window (or since the first snapshot), `None` when
    /// nothing was.
    pub fn push(&mut self, at: Instant, h: Histogram) -> Option<(f64, f64)> {
        // Keep exactly one snapshot at or before `at - window`: the base.
        while self.history.len() >= 2
            && self
                .history
                .get(1)
                .is_some_and(|(t, _)| at.saturating_duration_since(*t) >= self.window)
        {
            self.history.pop_front();
        }
        let recent = match self.history.front() {
            Some((_, base)) => h.since(base),
            None => Histogram {
                buckets: h.buckets.iter().map(|&(le, _)| (le, 0.0)).collect(),
            },
        };
        self.history.push_back((at, h));
        Some((recent.quantile(0.5)?, recent.quantile(0.99)?))
    }
}

/// Everything one scrape tells.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VllmSignals {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub kv_cache: Option<f64>,
    pub ttft: Option<Histogram>,
    pub e2e: Option<Histogram>,
}

impl VllmSignals {
    /// Gauges summed over series (several engines add up); the KV cache is
    /// the fullest engine's.
    pub fn parse(text: &str) -> VllmSignals {
        let samples = prom::parse(text);
        let values = |name: &str| -> Vec<f64> {
            samples
                .iter()
                .filter(|s| s.name == name)
                .map(|s| s.value)
                .collect()
        };
        let sum = |name: &str| values(name).into_iter().reduce(|a, b| a + b);
        let max = |name: &str| values(name).into_iter().reduce(f64::max);
        VllmSignals {
            waiting: sum(WAITING),
            running: sum(RUNNING),
            kv_cache: max(KV_CACHE).or_else(|| max(KV_CACHE_OLD)),
            ttft: Histogram::from_samples(&samples, TTFT),
            e2e: Histogram::from_samples(&samples, E2E),
        }
    }
}

/// Scrapes one vLLM server.
pub struct VllmSource {
    name: String,
    target: Target,
    timeout: Duration,
    ttft: LatencyWindow,
    e2e: LatencyWindow,
}

impl VllmSource {
    pub fn new(name: String, base: &Target, timeout: Duration, latency_window: Duration) -> Self {
        VllmSource {
            name,
            target: base.join("/metrics"),
            timeout,
            ttft: LatencyWindow::new(latency_window),
            e2e: LatencyWindow::new(latency_window),
        }
    }

    /// Turns one scrape's text into samples for the engine.
    pub fn read(&mut self, text: &str, at: Instant) -> BackendReading {
        let s = VllmSignals::parse(text);
        let mut samples = Vec::new();
        let mut push = |m, v: Option<f64>| {
            if let Some(v) = v {
                samples.push((m, v));
            }
        };
        push(Metric::VllmWaiting, s.waiting);
        push(Metric::VllmRunning, s.running);
        push(Metric::KvCache, s.kv_cache);
        if let Some((p50, p99)) = s.ttft.and_then(|h| self.ttft.push(at, h)) {
            push(Metric::TtftP50, Some(p50));
            push(Metric::TtftP99, Some(p99));
        }
        if let Some((p50, p99)) = s.e2e.and_then(|h| self.e2e.push(at, h)) {
            push(Metric::E2eP50, Some(p50));
            push(Metric::E2eP99, Some(p99));
        }
        BackendReading {
            samples,
            models: Vec::new(),
        }
    }
}

impl BackendSource for VllmSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "vllm"
    }

    fn poll(&mut self, at: Instant) -> BoxFuture<'_, Result<BackendReading, SourceError>> {
        Box::pin(async move {
            let body = http::get(&self.target, self.timeout).await?;
            let text = String::from_utf8_lossy(&body);
            Ok(self.read(&text, at))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(buckets: &[(f64, f64)]) -> Histogram {
        Histogram {
            buckets: buckets.to_vec(),
        }
    }

    const INF: f64 = f64::INFINITY;

    #[test]
    fn gauges_with_the_kv_cache_fallback() {
        let text = "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 7\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 5\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3\n\
                    vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.4\n\
                    vllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.7\n";
        let s = VllmSignals::parse(text);
        assert_eq!(s.waiting, Some(12.0));
        assert_eq!(s.running, Some(3.0));
        assert_eq!(s.kv_cache, Some(0.7));
        assert_eq!(s.ttft, None);
        let text = format!("{text}vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.2\n");
        assert_eq!(VllmSignals::parse(&text).kv_cache, Some(0.2));
        assert_eq!(VllmSignals::parse("").waiting, None);
    }

    #[test]
    fn histograms_sum_their_series() {
        let text = "vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"1.0\"} 2\n\
                    vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"+Inf\"} 3\n\
                    vllm:e2e_request_latency_seconds_bucket{engine=\"1\",le=\"1.0\"} 1\n\
                    vllm:e2e_request_latency_seconds_bucket{engine=\"1\",le=\"+Inf\"} 1\n\
                    vllm:e2e_request_latency_seconds_count{engine=\"0\"} 3\n";
        let s = VllmSignals::parse(text);
        assert_eq!(s.e2e, Some(hist(&[(1.0, 3.0), (INF, 4.0)])));
    }

    #[test]
    fn quantiles_interpolate_like_prometheus() {
        let h = hist(&[(0.1, 0.0), (0.5, 50.0), (1.0, 100.0), (INF, 100.0)]);
        assert_eq!(h.quantile(0.5), Some(0.5));
        let p99 = h.quantile(0.99).unwrap();
        assert!((p99 - 0.99).abs() < 1e-9, "{p99}");
        let p25 = h.quantile(0.25).unwrap();
        assert!((p25 - 0.3).abs() < 1e-9, "{p25}");
        // Everything above the last finite bound: that bound.
        let h = hist(&[(1.0, 0.0), (2.0, 0.0), (INF, 10.0)]);
        assert_eq!(h.quantile(0.99), Some(2.0));
        assert_eq!(hist(&[(1.0, 0.0), (INF, 0.0)]).quantile(0.5), None);
    }

    #[test]
    fn deltas_and_resets() {
        let a = hist(&[(1.0, 10.0), (INF, 20.0)]);
        let b = hist(&[(1.0, 12.0), (INF, 30.0)]);
        assert_eq!(b.since(&a), hist(&[(1.0, 2.0), (INF, 10.0)]));
        let reset = hist(&[(1.0, 1.0), (INF, 1.0)]);
        assert_eq!(reset.since(&a), reset);
    }

    #[test]
    fn the_window_reports_recent_latency_only() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = LatencyWindow::new(s(60));
        // The first snapshot is the base: old history does not count.
        assert_eq!(
            w.push(t0, hist(&[(1.0, 1000.0), (10.0, 1000.0), (INF, 1000.0)])),
            None
        );
        // 10 slow requests (1–10 s) arrive.
        let (p50, p99) = w
            .push(
                t0 + s(10),
                hist(&[(1.0, 1000.0), (10.0, 1010.0), (INF, 1010.0)]),
            )
            .unwrap();
        assert!(p50 > 1.0 && p99 > 9.0, "{p50} {p99}");
        // 70 s later, 100 fast ones and no slow ones within the window.
        let (p50, p99) = w
            .push(
                t0 + s(80),
                hist(&[(1.0, 1100.0), (10.0, 1110.0), (INF, 1110.0)]),
            )
            .unwrap();
        assert!(
            p50 < 1.0 && p99 < 1.0,
            "the slow ones were before 80 − 60 s: {p50} {p99}"
        );
        let r = w.push(
            t0 + s(200),
            hist(&[(1.0, 1100.0), (10.0, 1110.0), (INF, 1110.0)]),
        );
        assert_eq!(r, None, "nothing new in the last 60 s");
        let (p50, p99) = w
            .push(
                t0 + s(201),
                hist(&[(1.0, 1101.0), (10.0, 1111.0), (INF, 1111.0)]),
            )
            .unwrap();
        assert!(p50 < 1.0 && p99 < 1.0, "{p50} {p99}");
    }

    #[test]
    fn a_scrape_becomes_samples() {
        let mut src = VllmSource::new(
            "a".into(),
            &Target::parse("http://127.0.0.1:1").unwrap(),
            Duration::from_secs(1),
            Duration::from_secs(60),
        );
        let text = "vllm:num_requests_waiting 60\nvllm:num_requests_running 4\nvllm:kv_cache_usage_perc 0.95\n";
        let r = src.read(text, Instant::now());
        assert_eq!(
            r.samples,
            vec![
                (Metric::VllmWaiting, 60.0),
                (Metric::VllmRunning, 4.0),
                (Metric::KvCache, 0.95)
            ]
        );
    }
}
