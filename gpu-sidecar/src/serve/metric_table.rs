//! Every family the sidecar's `/metrics` writes, declared once: its name,
//! its type, its help text and its label names. The renderer
//! (`serve::metrics`) names a [`Family`] of this table, never a string, so
//! no name is spelled twice and a sample cannot carry labels its family
//! does not declare. The book's metrics chapter is checked against it.

/// A Prometheus metric type, as the `# TYPE` line writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    /// Label names, in the order the renderer gives their values (a
    /// histogram's `le` is not listed: the renderer adds it).
    pub labels: &'static [&'static str],
}

const fn family(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Family {
    Family {
        name,
        kind,
        help,
        labels,
    }
}

use Kind::{Counter, Gauge, Histogram};

// The GPU source and each GPU's readings.
pub const GPU_SOURCE_INFO: Family = family(
    "sluice_sidecar_gpu_source_info",
    Gauge,
    &["source"],
    "The GPU source in use (nvml, simulated, none).",
);
pub const NVML_AVAILABLE: Family = family(
    "sluice_sidecar_nvml_available",
    Gauge,
    &[],
    "1 when NVML was loaded.",
);
pub const GPU_SOURCE_MISSING: Family = family(
    "sluice_sidecar_gpu_source_missing",
    Gauge,
    &[],
    "1 when the GPU source asked for (NVML: sources.gpu auto or nvml) could not be \
     opened: no GPU readings, GPU rules see no data.",
);
const GPU: &[&str] = &["gpu", "name"];
pub const GPU_UTILIZATION: Family = family(
    "sluice_sidecar_gpu_utilization_percent",
    Gauge,
    GPU,
    "GPU busy time, percent.",
);
pub const GPU_MEMORY_USED: Family = family(
    "sluice_sidecar_gpu_memory_used_bytes",
    Gauge,
    GPU,
    "GPU memory used.",
);
pub const GPU_MEMORY_TOTAL: Family = family(
    "sluice_sidecar_gpu_memory_total_bytes",
    Gauge,
    GPU,
    "GPU memory in all.",
);
pub const GPU_TEMPERATURE: Family = family(
    "sluice_sidecar_gpu_temperature_celsius",
    Gauge,
    GPU,
    "GPU temperature.",
);
pub const GPU_POWER: Family = family(
    "sluice_sidecar_gpu_power_watts",
    Gauge,
    GPU,
    "GPU power draw.",
);

// Each backend: up, vLLM's queue and cache, latency quantiles.
pub const BACKEND_UP: Family = family(
    "sluice_sidecar_backend_up",
    Gauge,
    &["backend", "kind"],
    "1 when the backend's last poll succeeded.",
);
pub const VLLM_WAITING: Family = family(
    "sluice_sidecar_vllm_requests_waiting",
    Gauge,
    &["backend"],
    "vllm:num_requests_waiting of the backend.",
);
pub const VLLM_RUNNING: Family = family(
    "sluice_sidecar_vllm_requests_running",
    Gauge,
    &["backend"],
    "vllm:num_requests_running of the backend.",
);
pub const VLLM_KV_CACHE: Family = family(
    "sluice_sidecar_vllm_kv_cache_usage_ratio",
    Gauge,
    &["backend"],
    "vLLM KV-cache usage, 0-1.",
);
pub const VLLM_TTFT: Family = family(
    "sluice_sidecar_vllm_ttft_seconds",
    Gauge,
    &["backend", "quantile"],
    "Recent time to first token (vLLM histogram deltas).",
);
pub const VLLM_E2E: Family = family(
    "sluice_sidecar_vllm_e2e_latency_seconds",
    Gauge,
    &["backend", "quantile"],
    "Recent end-to-end latency (vLLM histogram deltas).",
);

// Breakers and staleness per scope.
pub const BREAKER_STATE: Family = family(
    "sluice_sidecar_breaker_state",
    Gauge,
    &["scope"],
    "Breaker per scope: 0 closed, 1 half-open, 2 open.",
);
pub const BREAKER_TRANSITIONS: Family = family(
    "sluice_sidecar_breaker_transitions_total",
    Counter,
    &["scope", "to"],
    "Breaker state changes by scope and new state.",
);
pub const SCOPE_STALE: Family = family(
    "sluice_sidecar_scope_stale",
    Gauge,
    &["scope"],
    "1 when no source of the scope answered within stale_after.",
);
pub const STALE: Family = family(
    "sluice_sidecar_stale",
    Gauge,
    &[],
    "1 when some scope is stale (the `stale` of /v1/state).",
);

// The published state and its long polls.
pub const KILL_SWITCH_ACTIVE: Family = family(
    "sluice_sidecar_kill_switch_active",
    Gauge,
    &[],
    "1 when the kill switch is on.",
);
pub const STATE_VERSION: Family = family(
    "sluice_sidecar_state_version",
    Gauge,
    &[],
    "Version of the published state.",
);
pub const LONG_POLL_SUBSCRIBERS: Family = family(
    "sluice_sidecar_long_poll_subscribers",
    Gauge,
    &[],
    "Long polls of /v1/state being held.",
);
pub const LONG_POLL_REFUSED: Family = family(
    "sluice_sidecar_long_poll_refused_total",
    Counter,
    &["caller"],
    "Long polls answered 503 at the cap (long_poll.max_held), by caller: \
     local (loopback or admin token, may use the reserved slots) or remote.",
);

// The door: refused admin tokens and Host names.
pub const ADMIN_AUTH_FAILURES: Family = family(
    "sluice_sidecar_admin_auth_failures_total",
    Counter,
    &["endpoint", "reason"],
    "Admin calls refused for their token, by endpoint (kill_switch, simulate, \
     state: a long poll asking for the reserved slots) and reason: missing (no \
     bearer token), wrong (a guess: charged to the client), not_configured, \
     throttled (429: too many wrong tokens from that client).",
);
pub const HOST_REFUSED: Family = family(
    "sluice_sidecar_host_refused_total",
    Counter,
    &[],
    "Requests answered 421 because their Host is not one the sidecar answers \
     to (localhost, an IP address, sluice_sidecar, allowed_hosts).",
);

// The listener (`crate::listen`): open connections, what it refused or closed.
pub const CONNECTIONS: Family = family(
    "sluice_sidecar_connections",
    Gauge,
    &[],
    "Connections to the API open now (at most connections.max).",
);
pub const CONNECTIONS_REFUSED: Family = family(
    "sluice_sidecar_connections_refused_total",
    Counter,
    &["caller"],
    "Connections closed as accepted because the cap was reached, by caller: \
     local (loopback, may use connections.reserved) or remote.",
);
pub const CONNECTIONS_CLOSED: Family = family(
    "sluice_sidecar_connections_closed_total",
    Counter,
    &["reason"],
    "Connections closed for their request's head: header_timeout (not whole \
     within connections.header_timeout) or header_too_large (answered 431, \
     over connections.max_header_bytes).",
);

// Failed reads and alert deliveries.
pub const SCRAPE_ERRORS: Family = family(
    "sluice_sidecar_scrape_errors_total",
    Counter,
    &["source"],
    "Failed reads by source (gpu or a backend's name).",
);
pub const ALERTS_SENT: Family = family(
    "sluice_sidecar_alerts_sent_total",
    Counter,
    &[],
    "Webhook posts that succeeded.",
);
pub const ALERTS_FAILED: Family = family(
    "sluice_sidecar_alerts_failed_total",
    Counter,
    &[],
    "Webhook posts that failed.",
);
pub const ALERTS_SUPPRESSED: Family = family(
    "sluice_sidecar_alerts_suppressed_total",
    Counter,
    &[],
    "Changes not alerted: within the flap window of the previous change.",
);
pub const ALERTS_DROPPED: Family = family(
    "sluice_sidecar_alerts_dropped_total",
    Counter,
    &[],
    "Alert events dropped: queue full.",
);

// The response cache.
pub const CACHE_TOTAL: Family = family(
    "sluice_sidecar_cache_total",
    Counter,
    &["result", "kind", "model"],
    "Cache lookups and stores by result (hit, miss, store, skip, evict), kind and model.",
);
pub const CACHE_SAVED_TOKENS: Family = family(
    "sluice_sidecar_cache_saved_tokens_total",
    Counter,
    &["model"],
    "Tokens (prompt + completion) of the answers served from the cache.",
);
pub const CACHE_SAVED_SPEND: Family = family(
    "sluice_sidecar_cache_saved_spend_micros_total",
    Counter,
    &["model"],
    "Spend (micro-currency) of the answers served from the cache.",
);
pub const CACHE_ENTRIES: Family = family(
    "sluice_sidecar_cache_entries",
    Gauge,
    &[],
    "Entries held (in Redis, fleet mode: as Redis counts them).",
);
pub const CACHE_BYTES: Family = family(
    "sluice_sidecar_cache_bytes",
    Gauge,
    &[],
    "Bytes the entries take, as the bound counts them.",
);
pub const CACHE_VECTORS: Family = family(
    "sluice_sidecar_cache_vectors",
    Gauge,
    &[],
    "Vectors in this sidecar's semantic index.",
);
pub const CACHE_EMBEDDING_CALLS: Family = family(
    "sluice_sidecar_cache_embedding_calls_total",
    Counter,
    &[],
    "Calls to the embeddings endpoint.",
);
pub const CACHE_EMBEDDING_FAILURES: Family = family(
    "sluice_sidecar_cache_embedding_failures_total",
    Counter,
    &[],
    "Embedding calls that failed or timed out (each a semantic miss).",
);
pub const CACHE_EMBEDDING_SKIPPED: Family = family(
    "sluice_sidecar_cache_embedding_skipped_total",
    Counter,
    &[],
    "Embeddings not asked for while the endpoint backs off after an outage \
     (each a semantic miss at once).",
);
pub const CACHE_UNAVAILABLE: Family = family(
    "sluice_sidecar_cache_unavailable_total",
    Counter,
    &[],
    "Redis calls of the cache that failed (each a miss or an unstored answer).",
);
pub const CACHE_REFUSED: Family = family(
    "sluice_sidecar_cache_refused_total",
    Counter,
    &["reason"],
    "Calls to the cache endpoints refused: door (not loopback, an Origin, not JSON), \
     missing or wrong (the cache secret).",
);
pub const CACHE_LOOKUP_SECONDS: Family = family(
    "sluice_sidecar_cache_lookup_seconds",
    Histogram,
    &[],
    "Time the sidecar took to answer a lookup.",
);

// The Redis connection of the fleet agent and the cache tier.
pub const REDIS_UP: Family = family(
    "sluice_sidecar_redis_up",
    Gauge,
    &[],
    "1 when the last Redis call of the fleet agent succeeded (0 before the first).",
);
pub const REDIS_ERRORS: Family = family(
    "sluice_sidecar_redis_errors_total",
    Counter,
    &[],
    "Redis calls of the fleet agent and the cache tier that failed: connect, TLS, \
     authentication, timeout or a refused command (the first of each outage is logged).",
);

/// Every family, in the order `/metrics` writes them.
pub const ALL: &[Family] = &[
    GPU_SOURCE_INFO,
    NVML_AVAILABLE,
    GPU_SOURCE_MISSING,
    GPU_UTILIZATION,
    GPU_MEMORY_USED,
    GPU_MEMORY_TOTAL,
    GPU_TEMPERATURE,
    GPU_POWER,
    BACKEND_UP,
    VLLM_WAITING,
    VLLM_RUNNING,
    VLLM_KV_CACHE,
    VLLM_TTFT,
    VLLM_E2E,
    BREAKER_STATE,
    BREAKER_TRANSITIONS,
    SCOPE_STALE,
    STALE,
    KILL_SWITCH_ACTIVE,
    STATE_VERSION,
    LONG_POLL_SUBSCRIBERS,
    LONG_POLL_REFUSED,
    ADMIN_AUTH_FAILURES,
    HOST_REFUSED,
    CONNECTIONS,
    CONNECTIONS_REFUSED,
    CONNECTIONS_CLOSED,
    SCRAPE_ERRORS,
    ALERTS_SENT,
    ALERTS_FAILED,
    ALERTS_SUPPRESSED,
    ALERTS_DROPPED,
    CACHE_TOTAL,
    CACHE_SAVED_TOKENS,
    CACHE_SAVED_SPEND,
    CACHE_ENTRIES,
    CACHE_BYTES,
    CACHE_VECTORS,
    CACHE_EMBEDDING_CALLS,
    CACHE_EMBEDDING_FAILURES,
    CACHE_EMBEDDING_SKIPPED,
    CACHE_UNAVAILABLE,
    CACHE_REFUSED,
    CACHE_LOOKUP_SECONDS,
    REDIS_UP,
    REDIS_ERRORS,
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn names_are_unique_well_formed_and_typed() {
        let mut seen = BTreeSet::new();
        for f in ALL {
            assert!(seen.insert(f.name), "{} twice", f.name);
            assert!(f.name.starts_with("sluice_sidecar_"), "{}", f.name);
            assert!(
                f.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{}",
                f.name
            );
            assert_eq!(
                f.kind == Counter,
                f.name.ends_with("_total"),
                "{}: counters and only counters end in _total",
                f.name
            );
            assert!(!f.help.is_empty() && !f.help.contains('\n'), "{}", f.name);
        }
    }
}
