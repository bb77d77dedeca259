//! `GET /metrics`: Prometheus text rendered from the telemetry snapshot and
//! the published state. Written by hand on purpose: every value already
//! lives in the snapshot, so a registry crate would only mirror it.

use std::fmt::Write as _;

use crate::breaker::Metric;
use crate::state::SidecarState;
use crate::watch::snapshot::{Snapshot, Telemetry};

/// The exposition, `text/plain; version=0.0.4`.
/// The response cache's families (see [`crate::cache`]).
pub fn render_cache(cache: &crate::cache::Cache) -> String {
    let mut out = Exposition::default();
    cache_families(cache, &mut out);
    out.text
}

fn cache_families(cache: &crate::cache::Cache, out: &mut Exposition) {
    use crate::cache::metrics::LOOKUP_BUCKETS;
    use std::sync::atomic::Ordering;
    let s = &cache.stats;
    out.family(
        "sluice_sidecar_cache_total",
        "counter",
        "Cache lookups and stores by result (hit, miss, store, skip, evict), kind and model.",
    );
    for (model, kind, result, n) in s.counts() {
        out.sample(
            "sluice_sidecar_cache_total",
            &[("result", result), ("kind", kind), ("model", &model)],
            n as f64,
        );
    }
    out.family(
        "sluice_sidecar_cache_saved_tokens_total",
        "counter",
        "Tokens (prompt + completion) of the answers served from the cache.",
    );
    out.family(
        "sluice_sidecar_cache_saved_spend_micros_total",
        "counter",
        "Spend (micro-currency) of the answers served from the cache.",
    );
    for (model, tokens, spend) in s.saved_by_model() {
        out.sample(
            "sluice_sidecar_cache_saved_tokens_total",
            &[("model", &model)],
            tokens as f64,
        );
        out.sample(
            "sluice_sidecar_cache_saved_spend_micros_total",
            &[("model", &model)],
            spend as f64,
        );
    }
    let gauges = [
        (
            "sluice_sidecar_cache_entries",
            "Entries held (in Redis, fleet mode: as Redis counts them).",
            s.entries.load(Ordering::Relaxed) as f64,
        ),
        (
            "sluice_sidecar_cache_bytes",
            "Bytes the entries take, as the bound counts them.",
            s.bytes.load(Ordering::Relaxed) as f64,
        ),
        (
            "sluice_sidecar_cache_vectors",
            "Vectors in this sidecar's semantic index.",
            cache.vectors() as f64,
        ),
    ];
    for (name, help, v) in gauges {
        out.family(name, "gauge", help);
        out.sample(name, &[], v);
    }
    let counters = [
        (
            "sluice_sidecar_cache_embedding_calls_total",
            "Calls to the embeddings endpoint.",
            &s.embedding_calls,
        ),
        (
            "sluice_sidecar_cache_embedding_failures_total",
            "Embedding calls that failed or timed out (each a semantic miss).",
            &s.embedding_failures,
        ),
        (
            "sluice_sidecar_cache_embedding_skipped_total",
            "Embeddings not asked for while the endpoint backs off after an outage \
             (each a semantic miss at once).",
            &s.embedding_skipped,
        ),
        (
            "sluice_sidecar_cache_unavailable_total",
            "Redis calls of the cache that failed (each a miss or an unstored answer).",
            &s.unavailable,
        ),
    ];
    for (name, help, c) in counters {
        out.family(name, "counter", help);
        out.sample(name, &[], c.load(Ordering::Relaxed) as f64);
    }
    cache_door(out);
    let h = "sluice_sidecar_cache_lookup_seconds";
    out.family(h, "histogram", "Time the sidecar took to answer a lookup.");
    let bucket = format!("{h}_bucket");
    let (buckets, count, micros) = s.lookup_histogram();
    for (le, n) in LOOKUP_BUCKETS.iter().zip(&buckets) {
        out.sample(&bucket, &[("le", &le.to_string())], *n as f64);
    }
    out.sample(&bucket, &[("le", "+Inf")], count as f64);
    out.sample(&format!("{h}_sum"), &[], micros as f64 / 1e6);
    out.sample(&format!("{h}_count"), &[], count as f64);
}

/// The Redis connection of the fleet agent and the cache tier
/// ([`crate::redis::link`]).
pub fn render_redis(redis: &crate::redis::Redis) -> String {
    let mut out = Exposition::default();
    let link = &redis.link;
    out.family(
        "sluice_sidecar_redis_up",
        "gauge",
        "1 when the last Redis call of the fleet agent succeeded (0 before the first).",
    );
    out.sample(
        "sluice_sidecar_redis_up",
        &[],
        f64::from(u8::from(link.up())),
    );
    out.family(
        "sluice_sidecar_redis_errors_total",
        "counter",
        "Redis calls of the fleet agent and the cache tier that failed: connect, TLS, \
         authentication, timeout or a refused command (the first of each outage is logged).",
    );
    out.sample(
        "sluice_sidecar_redis_errors_total",
        &[],
        link.errors() as f64,
    );
    out.text
}

/// Refusals of the cache endpoints' door (`serve::cache`).
fn cache_door(out: &mut Exposition) {
    let r = "sluice_sidecar_cache_refused_total";
    out.family(
        r,
        "counter",
        "Calls to the cache endpoints refused: door (not loopback, an Origin, not JSON), \
         missing or wrong (the cache secret).",
    );
    for why in crate::serve::cache::Refused::ALL {
        out.sample(
            r,
            &[("reason", why.label())],
            crate::serve::cache::refused_count(why) as f64,
        );
    }
}

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
    out.family(
        "sluice_sidecar_gpu_source_info",
        "gauge",
        "The GPU source in use (nvml, simulated, none).",
    );
    out.sample(
        "sluice_sidecar_gpu_source_info",
        &[("source", snap.gpu_source.unwrap_or("none"))],
        1.0,
    );
    out.family(
        "sluice_sidecar_nvml_available",
        "gauge",
        "1 when NVML was loaded.",
    );
    out.sample(
        "sluice_sidecar_nvml_available",
        &[],
        f64::from(u8::from(snap.nvml_available)),
    );
    out.family(
        "sluice_sidecar_gpu_source_missing",
        "gauge",
        "1 when the GPU source asked for (NVML: sources.gpu auto or nvml) could not be \
         opened: no GPU readings, GPU rules see no data.",
    );
    out.sample(
        "sluice_sidecar_gpu_source_missing",
        &[],
        f64::from(u8::from(snap.gpu_missing.is_some())),
    );

    let gpu_families: [(&str, &str, GpuField); 5] = [
        (
            "sluice_sidecar_gpu_utilization_percent",
            "GPU busy time, percent.",
            |g| Some(g.utilization),
        ),
        (
            "sluice_sidecar_gpu_memory_used_bytes",
            "GPU memory used.",
            |g| Some(g.memory_used_mb * 1048576.0),
        ),
        (
            "sluice_sidecar_gpu_memory_total_bytes",
            "GPU memory in all.",
            |g| Some(g.memory_total_mb * 1048576.0),
        ),
        (
            "sluice_sidecar_gpu_temperature_celsius",
            "GPU temperature.",
            |g| g.temperature_c,
        ),
        ("sluice_sidecar_gpu_power_watts", "GPU power draw.", |g| {
            g.power_w
        }),
    ];
    for (name, help, get) in gpu_families {
        out.family(name, "gauge", help);
        for g in &snap.gpus {
            if let Some(v) = get(g) {
                let index = g.index.to_string();
                out.sample(name, &[("gpu", &index), ("name", &g.name)], v);
            }
        }
    }
}

/// Each backend: up, vLLM's queue and cache, latency quantiles.
fn backends(out: &mut Exposition, snap: &Snapshot) {
    out.family(
        "sluice_sidecar_backend_up",
        "gauge",
        "1 when the backend's last poll succeeded.",
    );
    for b in &snap.backends {
        out.sample(
            "sluice_sidecar_backend_up",
            &[("backend", &b.name), ("kind", b.kind)],
            f64::from(u8::from(b.up)),
        );
    }
    let gauges = [
        (
            "sluice_sidecar_vllm_requests_waiting",
            "vllm:num_requests_waiting of the backend.",
            Metric::VllmWaiting,
        ),
        (
            "sluice_sidecar_vllm_requests_running",
            "vllm:num_requests_running of the backend.",
            Metric::VllmRunning,
        ),
        (
            "sluice_sidecar_vllm_kv_cache_usage_ratio",
            "vLLM KV-cache usage, 0-1.",
            Metric::KvCache,
        ),
    ];
    for (name, help, metric) in gauges {
        out.family(name, "gauge", help);
        for b in &snap.backends {
            if let Some(v) = b.value(metric) {
                out.sample(name, &[("backend", &b.name)], v);
            }
        }
    }
    let quantiles = [
        (
            "sluice_sidecar_vllm_ttft_seconds",
            "Recent time to first token (vLLM histogram deltas).",
            Metric::TtftP50,
            Metric::TtftP99,
        ),
        (
            "sluice_sidecar_vllm_e2e_latency_seconds",
            "Recent end-to-end latency (vLLM histogram deltas).",
            Metric::E2eP50,
            Metric::E2eP99,
        ),
    ];
    for (name, help, p50, p99) in quantiles {
        out.family(name, "gauge", help);
        for b in &snap.backends {
            for (q, m) in [("0.5", p50), ("0.99", p99)] {
                if let Some(v) = b.value(m) {
                    out.sample(name, &[("backend", &b.name), ("quantile", q)], v);
                }
            }
        }
    }
}

/// Breakers and staleness per scope.
fn breakers(out: &mut Exposition, state: &SidecarState, snap: &Snapshot) {
    out.family(
        "sluice_sidecar_breaker_state",
        "gauge",
        "Breaker per scope: 0 closed, 1 half-open, 2 open.",
    );
    for v in &snap.breakers {
        out.sample(
            "sluice_sidecar_breaker_state",
            &[("scope", &v.scope)],
            f64::from(crate::state::gauge(v.state)),
        );
    }
    out.family(
        "sluice_sidecar_breaker_transitions_total",
        "counter",
        "Breaker state changes by scope and new state.",
    );
    for ((scope, to), n) in &snap.transitions {
        out.sample(
            "sluice_sidecar_breaker_transitions_total",
            &[("scope", scope), ("to", to)],
            *n as f64,
        );
    }
    out.family(
        "sluice_sidecar_scope_stale",
        "gauge",
        "1 when no source of the scope answered within stale_after.",
    );
    for v in &snap.breakers {
        out.sample(
            "sluice_sidecar_scope_stale",
            &[("scope", &v.scope)],
            f64::from(u8::from(v.stale)),
        );
    }
    out.family(
        "sluice_sidecar_stale",
        "gauge",
        "1 when some scope is stale (the `stale` of /v1/state).",
    );
    out.sample(
        "sluice_sidecar_stale",
        &[],
        f64::from(u8::from(state.stale)),
    );
}

/// The published state and its long polls.
fn published(out: &mut Exposition, state: &SidecarState, tel: &Telemetry) {
    out.family(
        "sluice_sidecar_kill_switch_active",
        "gauge",
        "1 when the kill switch is on.",
    );
    out.sample(
        "sluice_sidecar_kill_switch_active",
        &[],
        f64::from(u8::from(state.kill_switch.active)),
    );
    out.family(
        "sluice_sidecar_state_version",
        "gauge",
        "Version of the published state.",
    );
    out.sample("sluice_sidecar_state_version", &[], state.version as f64);
    out.family(
        "sluice_sidecar_long_poll_subscribers",
        "gauge",
        "Long polls of /v1/state being held.",
    );
    out.sample(
        "sluice_sidecar_long_poll_subscribers",
        &[],
        tel.subscribers.load(std::sync::atomic::Ordering::Relaxed) as f64,
    );
    out.family(
        "sluice_sidecar_long_poll_refused_total",
        "counter",
        "Long polls answered 503 at the cap (long_poll.max_held), by caller: \
         local (loopback or admin token, may use the reserved slots) or remote.",
    );
    for (caller, counter) in [
        ("local", &tel.polls_refused_local),
        ("remote", &tel.polls_refused_remote),
    ] {
        out.sample(
            "sluice_sidecar_long_poll_refused_total",
            &[("caller", caller)],
            Telemetry::get(counter) as f64,
        );
    }
}

/// Refused admin tokens and Host names.
fn door(out: &mut Exposition, tel: &Telemetry) {
    out.family(
        "sluice_sidecar_admin_auth_failures_total",
        "counter",
        "Admin calls refused for their token, by endpoint (kill_switch, simulate, \
         state: a long poll asking for the reserved slots) and reason: missing (no \
         bearer token), wrong (a guess: charged to the client), not_configured, \
         throttled (429: too many wrong tokens from that client).",
    );
    for endpoint in crate::door::Endpoint::ALL {
        for failure in crate::door::Failure::ALL {
            out.sample(
                "sluice_sidecar_admin_auth_failures_total",
                &[("endpoint", endpoint.label()), ("reason", failure.label())],
                tel.door.failures(endpoint, failure) as f64,
            );
        }
    }
    out.family(
        "sluice_sidecar_host_refused_total",
        "counter",
        "Requests answered 421 because their Host is not one the sidecar answers \
         to (localhost, an IP address, sluice_sidecar, allowed_hosts).",
    );
    out.sample(
        "sluice_sidecar_host_refused_total",
        &[],
        Telemetry::get(&tel.door.host_refused) as f64,
    );
}

/// Failed reads and alert deliveries.
fn watch(out: &mut Exposition, snap: &Snapshot, tel: &Telemetry) {
    out.family(
        "sluice_sidecar_scrape_errors_total",
        "counter",
        "Failed reads by source (gpu or a backend's name).",
    );
    for (source, n) in &snap.scrape_errors {
        out.sample(
            "sluice_sidecar_scrape_errors_total",
            &[("source", source)],
            *n as f64,
        );
    }
    let alerts = [
        (
            "sluice_sidecar_alerts_sent_total",
            "Webhook posts that succeeded.",
            &tel.alerts_sent,
        ),
        (
            "sluice_sidecar_alerts_failed_total",
            "Webhook posts that failed.",
            &tel.alerts_failed,
        ),
        (
            "sluice_sidecar_alerts_suppressed_total",
            "Changes not alerted: within the flap window of the previous change.",
            &tel.alerts_suppressed,
        ),
        (
            "sluice_sidecar_alerts_dropped_total",
            "Alert events dropped: queue full.",
            &tel.alerts_dropped,
        ),
    ];
    for (name, help, counter) in alerts {
        out.family(name, "counter", help);
        out.sample(name, &[], Telemetry::get(counter) as f64);
    }
}

type GpuField = fn(&crate::sources::GpuReading) -> Option<f64>;

#[derive(Default)]
pub(crate) struct Exposition {
    text: String,
}

impl Exposition {
    pub(crate) fn family(&mut self, name: &str, kind: &str, help: &str) {
        // Writing to a String cannot fail.
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    pub(crate) fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.text.push_str(name);
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
mod tests {
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
}
