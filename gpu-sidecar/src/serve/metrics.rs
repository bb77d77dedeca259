//! `GET /metrics`: Prometheus text rendered from the telemetry snapshot and
//! the published state. Written by hand on purpose: every value already
//! lives in the snapshot, so a registry crate would only mirror it. Every
//! family is declared once, in [`crate::serve::metric_table`].

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use crate::breaker::Metric;
use crate::serve::metric_table::{self as m, Family};
use crate::state::SidecarState;
use crate::watch::snapshot::{Snapshot, Telemetry};

/// The response cache's families (see [`crate::cache`]).
pub fn render_cache(cache: &crate::cache::Cache) -> String {
    let mut out = Exposition::default();
    cache_families(cache, &mut out);
    out.text
}

fn cache_families(cache: &crate::cache::Cache, out: &mut Exposition) {
    use crate::cache::metrics::LOOKUP_BUCKETS;
    let s = &cache.stats;
    out.family(&m::CACHE_TOTAL);
    for (model, kind, result, n) in s.counts() {
        out.sample(&m::CACHE_TOTAL, &[result, kind, &model], n as f64);
    }
    out.family(&m::CACHE_SAVED_TOKENS);
    out.family(&m::CACHE_SAVED_SPEND);
    for (model, tokens, spend) in s.saved_by_model() {
        out.sample(&m::CACHE_SAVED_TOKENS, &[&model], tokens as f64);
        out.sample(&m::CACHE_SAVED_SPEND, &[&model], spend as f64);
    }
    out.single(&m::CACHE_ENTRIES, s.entries.load(Ordering::Relaxed) as f64);
    out.single(&m::CACHE_BYTES, s.bytes.load(Ordering::Relaxed) as f64);
    out.single(&m::CACHE_VECTORS, cache.vectors() as f64);
    for (family, c) in [
        (&m::CACHE_EMBEDDING_CALLS, &s.embedding_calls),
        (&m::CACHE_EMBEDDING_FAILURES, &s.embedding_failures),
        (&m::CACHE_EMBEDDING_SKIPPED, &s.embedding_skipped),
        (&m::CACHE_UNAVAILABLE, &s.unavailable),
    ] {
        out.single(family, c.load(Ordering::Relaxed) as f64);
    }
    cache_door(out);
    let (buckets, count, micros) = s.lookup_histogram();
    let les: Vec<String> = LOOKUP_BUCKETS.iter().map(|le| le.to_string()).collect();
    let counts: Vec<(&str, u64)> = les.iter().map(String::as_str).zip(buckets).collect();
    out.histogram(
        &m::CACHE_LOOKUP_SECONDS,
        &counts,
        count,
        micros as f64 / 1e6,
    );
}

/// The Redis connection of the fleet agent and the cache tier
/// ([`crate::redis::link`]).
pub fn render_redis(redis: &crate::redis::Redis) -> String {
    let mut out = Exposition::default();
    let link = &redis.link;
    out.single(&m::REDIS_UP, f64::from(u8::from(link.up())));
    out.single(&m::REDIS_ERRORS, link.errors() as f64);
    out.text
}

/// Refusals of the cache endpoints' door (`serve::cache`).
fn cache_door(out: &mut Exposition) {
    out.family(&m::CACHE_REFUSED);
    for why in crate::serve::cache::Refused::ALL {
        out.sample(
            &m::CACHE_REFUSED,
            &[why.label()],
            crate::serve::cache::refused_count(why) as f64,
        );
    }
}

/// The exposition, `text/plain; version=0.0.4`.
pub fn render(state: &SidecarState, snap: &Snapshot, tel: &Telemetry) -> String {
    let mut out = Exposition::default();
    gpus(&mut out, snap);
    backends(&mut out, snap);
    breakers(&mut out, state, snap);
    published(&mut out, state, tel);
    door(&mut out, tel);
    watch(&mut out, snap, tel);
    out.text
}

/// The GPU source and each GPU's readings.
fn gpus(out: &mut Exposition, snap: &Snapshot) {
    out.family(&m::GPU_SOURCE_INFO);
    out.sample(
        &m::GPU_SOURCE_INFO,
        &[snap.gpu_source.unwrap_or("none")],
        1.0,
    );
    out.single(&m::NVML_AVAILABLE, f64::from(u8::from(snap.nvml_available)));
    out.single(
        &m::GPU_SOURCE_MISSING,
        f64::from(u8::from(snap.gpu_missing.is_some())),
    );
    let gpu_families: [(&Family, GpuField); 5] = [
        (&m::GPU_UTILIZATION, |g| Some(g.utilization)),
        (&m::GPU_MEMORY_USED, |g| Some(g.memory_used_mb * 1048576.0)),
        (&m::GPU_MEMORY_TOTAL, |g| {
            Some(g.memory_total_mb * 1048576.0)
        }),
        (&m::GPU_TEMPERATURE, |g| g.temperature_c),
        (&m::GPU_POWER, |g| g.power_w),
    ];
    for (family, get) in gpu_families {
        out.family(family);
        for g in &snap.gpus {
            if let Some(v) = get(g) {
                out.sample(family, &[&g.index.to_string(), &g.name], v);
            }
        }
    }
}

/// Each backend: up, vLLM's queue and cache, latency quantiles.
fn backends(out: &mut Exposition, snap: &Snapshot) {
    out.family(&m::BACKEND_UP);
    for b in &snap.backends {
        out.sample(
            &m::BACKEND_UP,
            &[&b.name, b.kind],
            f64::from(u8::from(b.up)),
        );
    }
    for (family, metric) in [
        (&m::VLLM_WAITING, Metric::VllmWaiting),
        (&m::VLLM_RUNNING, Metric::VllmRunning),
        (&m::VLLM_KV_CACHE, Metric::KvCache),
    ] {
        out.family(family);
        for b in &snap.backends {
            if let Some(v) = b.value(metric) {
                out.sample(family, &[&b.name], v);
            }
        }
    }
    for (family, p50, p99) in [
        (&m::VLLM_TTFT, Metric::TtftP50, Metric::TtftP99),
        (&m::VLLM_E2E, Metric::E2eP50, Metric::E2eP99),
    ] {
        out.family(family);
        for b in &snap.backends {
            for (q, metric) in [("0.5", p50), ("0.99", p99)] {
                if let Some(v) = b.value(metric) {
                    out.sample(family, &[&b.name, q], v);
                }
            }
        }
    }
}

/// Breakers and staleness per scope.
fn breakers(out: &mut Exposition, state: &SidecarState, snap: &Snapshot) {
    out.family(&m::BREAKER_STATE);
    for v in &snap.breakers {
        let gauge = f64::from(crate::state::gauge(v.state));
        out.sample(&m::BREAKER_STATE, &[&v.scope], gauge);
    }
    out.family(&m::BREAKER_TRANSITIONS);
    for ((scope, to), n) in &snap.transitions {
        out.sample(&m::BREAKER_TRANSITIONS, &[scope, to], *n as f64);
    }
    out.family(&m::SCOPE_STALE);
    for v in &snap.breakers {
        out.sample(&m::SCOPE_STALE, &[&v.scope], f64::from(u8::from(v.stale)));
    }
    out.single(&m::STALE, f64::from(u8::from(state.stale)));
}

/// The published state and its long polls.
fn published(out: &mut Exposition, state: &SidecarState, tel: &Telemetry) {
    out.single(
        &m::KILL_SWITCH_ACTIVE,
        f64::from(u8::from(state.kill_switch.active)),
    );
    out.single(&m::STATE_VERSION, state.version as f64);
    out.single(
        &m::LONG_POLL_SUBSCRIBERS,
        tel.subscribers.load(Ordering::Relaxed) as f64,
    );
    out.family(&m::LONG_POLL_REFUSED);
    for (caller, counter) in [
        ("local", &tel.polls_refused_local),
        ("remote", &tel.polls_refused_remote),
    ] {
        out.sample(
            &m::LONG_POLL_REFUSED,
            &[caller],
            Telemetry::get(counter) as f64,
        );
    }
}

/// Refused admin tokens and Host names.
fn door(out: &mut Exposition, tel: &Telemetry) {
    out.family(&m::ADMIN_AUTH_FAILURES);
    for endpoint in crate::door::Endpoint::ALL {
        for failure in crate::door::Failure::ALL {
            out.sample(
                &m::ADMIN_AUTH_FAILURES,
                &[endpoint.label(), failure.label()],
                tel.door.failures(endpoint, failure) as f64,
            );
        }
    }
    out.single(
        &m::HOST_REFUSED,
        Telemetry::get(&tel.door.host_refused) as f64,
    );
    connections(out, &tel.connections);
}

/// The listener's connections, and what it refused or closed.
fn connections(out: &mut Exposition, c: &crate::listen::ConnectionCounters) {
    use std::sync::atomic::Ordering::Relaxed;
    out.single(&m::CONNECTIONS, c.open.load(Relaxed) as f64);
    out.family(&m::CONNECTIONS_REFUSED);
    for (caller, n) in [("local", &c.refused_local), ("remote", &c.refused_remote)] {
        out.sample(&m::CONNECTIONS_REFUSED, &[caller], Telemetry::get(n) as f64);
    }
    out.family(&m::CONNECTIONS_CLOSED);
    for (reason, n) in [
        ("header_timeout", &c.header_timeouts),
        ("header_too_large", &c.header_too_large),
    ] {
        out.sample(&m::CONNECTIONS_CLOSED, &[reason], Telemetry::get(n) as f64);
    }
}

/// Failed reads and alert deliveries.
fn watch(out: &mut Exposition, snap: &Snapshot, tel: &Telemetry) {
    out.family(&m::SCRAPE_ERRORS);
    for (source, n) in &snap.scrape_errors {
        out.sample(&m::SCRAPE_ERRORS, &[source], *n as f64);
    }
    for (family, counter) in [
        (&m::ALERTS_SENT, &tel.alerts_sent),
        (&m::ALERTS_FAILED, &tel.alerts_failed),
        (&m::ALERTS_SUPPRESSED, &tel.alerts_suppressed),
        (&m::ALERTS_DROPPED, &tel.alerts_dropped),
    ] {
        out.single(family, Telemetry::get(counter) as f64);
    }
}

type GpuField = fn(&crate::sources::GpuReading) -> Option<f64>;

#[derive(Default)]
pub(crate) struct Exposition {
    text: String,
}

impl Exposition {
    /// The `# HELP` and `# TYPE` lines of `family`.
    pub(crate) fn family(&mut self, family: &Family) {
        // Writing to a String cannot fail.
        let _ = writeln!(
            self.text,
            "# HELP {name} {}\n# TYPE {name} {}",
            family.help,
            family.kind.as_str(),
            name = family.name
        );
    }

    /// A family without labels and its one sample.
    pub(crate) fn single(&mut self, family: &Family, value: f64) {
        self.family(family);
        self.sample(family, &[], value);
    }

    /// One sample of `family`, a value for each of its labels in order.
    pub(crate) fn sample(&mut self, family: &Family, values: &[&str], value: f64) {
        debug_assert_eq!(values.len(), family.labels.len(), "{}", family.name);
        let labels: Vec<(&str, &str)> = family
            .labels
            .iter()
            .copied()
            .zip(values.iter().copied())
            .collect();
        self.series(family.name, "", &labels, value);
    }

    /// A histogram without labels: its `le` buckets (cumulative counts),
    /// `+Inf`, `_sum` and `_count`.
    pub(crate) fn histogram(
        &mut self,
        family: &Family,
        buckets: &[(&str, u64)],
        count: u64,
        sum: f64,
    ) {
        self.family(family);
        for (le, n) in buckets {
            self.series(family.name, "_bucket", &[("le", le)], *n as f64);
        }
        self.series(family.name, "_bucket", &[("le", "+Inf")], count as f64);
        self.series(family.name, "_sum", &[], sum);
        self.series(family.name, "_count", &[], count as f64);
    }

    fn series(&mut self, name: &str, suffix: &str, labels: &[(&str, &str)], value: f64) {
        self.text.push_str(name);
        self.text.push_str(suffix);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{}\"", escape(v));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {}", number(value));
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::breaker::View;
    use crate::sources::prom;
    use crate::sources::GpuReading;
    use crate::state::BreakerState;
    use crate::watch::snapshot::BackendStatus;
    use std::time::SystemTime;

    #[test]
    fn renders_everything_and_parses_back() {
        let mut snap = Snapshot {
            gpu_source: Some("simulated"),
            ..Snapshot::default()
        };
        snap.gpus.push(GpuReading {
            index: 0,
            name: "H200 \"x\"".into(),
            utilization: 95.0,
            memory_used_mb: 1.0,
            memory_total_mb: 2.0,
            temperature_c: Some(50.0),
            power_w: None,
        });
        snap.backends.push(BackendStatus {
            name: "vllm-a".into(),
            kind: "vllm",
            up: true,
            samples: vec![(Metric::VllmWaiting, 60.0), (Metric::TtftP99, 1.5)],
            models: vec![],
            error: None,
        });
        snap.breakers.push(View {
            scope: "model:llama3.1:70b".into(),
            state: BreakerState::Open,
            reason: None,
            since: SystemTime::UNIX_EPOCH,
            stale: false,
            values: vec![],
        });
        snap.scrape_errors.insert("gpu".into(), 3);
        let mut state = SidecarState::initial(SystemTime::UNIX_EPOCH);
        state.kill_switch.active = true;
        let text = render(&state, &snap, &Telemetry::default());
        let samples = prom::parse(&text);
        let find = |name: &str| {
            samples
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("{name} in\n{text}"))
        };
        assert_eq!(
            find("sluice_sidecar_gpu_utilization_percent").label("name"),
            Some("H200 \"x\"")
        );
        assert_eq!(
            find("sluice_sidecar_gpu_memory_total_bytes").value,
            2.0 * 1048576.0
        );
        assert_eq!(find("sluice_sidecar_vllm_requests_waiting").value, 60.0);
        assert_eq!(
            find("sluice_sidecar_vllm_ttft_seconds").label("quantile"),
            Some("0.99")
        );
        let b = find("sluice_sidecar_breaker_state");
        assert_eq!(
            (b.label("scope"), b.value),
            (Some("model:llama3.1:70b"), 2.0)
        );
        assert_eq!(find("sluice_sidecar_kill_switch_active").value, 1.0);
        assert_eq!(find("sluice_sidecar_scrape_errors_total").value, 3.0);
        assert_eq!(find("sluice_sidecar_long_poll_subscribers").value, 0.0);
        assert!(
            !text.contains("sluice_sidecar_gpu_power_watts{"),
            "no power reported"
        );
    }

    /// The families a text declares (its `# TYPE` lines), in order.
    pub(crate) fn declared(text: &str) -> Vec<&str> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect()
    }

    #[test]
    fn the_state_exposition_declares_each_family_of_the_table_once() {
        let text = render(
            &SidecarState::initial(SystemTime::UNIX_EPOCH),
            &Snapshot::default(),
            &Telemetry::default(),
        );
        let expected: Vec<&str> = m::ALL
            .iter()
            .map(|f| f.name)
            .filter(|n| {
                !n.starts_with("sluice_sidecar_cache_") && !n.starts_with("sluice_sidecar_redis_")
            })
            .collect();
        assert_eq!(declared(&text), expected);
    }
}
