//! Every stat the filter defines, declared once: its name, its kind and
//! its labels, as Envoy declares its own stats. Labels ride inside the
//! name (`sluice_tokens_total_direction=input;.kind=actual;…`) and Envoy's
//! `stats_tags` (shipped in every `envoy/` config) turn them into
//! Prometheus labels; see docs/src/design.md, "Metrics and tags". A writer names
//! a [`Metric`] of this table, never a string, so the kind travels with it
//! (no lookup by name on the request path) and no name is spelled twice.

use super::{Host, MetricKind};

/// One stat (or one family of stats, one per label values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    pub name: &'static str,
    pub kind: MetricKind,
    /// Label names, in the order they ride in the name.
    pub labels: &'static [&'static str],
}

const fn counter(name: &'static str, labels: &'static [&'static str]) -> Metric {
    Metric {
        name,
        kind: MetricKind::Counter,
        labels,
    }
}

const fn gauge(name: &'static str, labels: &'static [&'static str]) -> Metric {
    Metric {
        name,
        kind: MetricKind::Gauge,
        labels,
    }
}

const fn histogram(name: &'static str, labels: &'static [&'static str]) -> Metric {
    Metric {
        name,
        kind: MetricKind::Histogram,
        labels,
    }
}

impl Metric {
    /// The stat's name for these label values (one per label, in order):
    /// `name_l1=v1;.l2=v2;`.
    pub fn named(&self, values: &[&str]) -> String {
        let mut out = String::new();
        self.write_name(&mut out, values);
        out
    }

    /// Writes [`Metric::named`] into `out` (cleared first), sized once.
    fn write_name(&self, out: &mut String, values: &[&str]) {
        let pairs = self.labels.iter().zip(values);
        let len = pairs
            .clone()
            .map(|(l, v)| l.len() + v.len() + 2)
            .sum::<usize>();
        out.clear();
        out.reserve(self.name.len() + len);
        out.push_str(self.name);
        for (i, (label, value)) in pairs.enumerate() {
            out.push_str(if i == 0 { "_" } else { "." });
            out.push_str(label);
            out.push('=');
            out.push_str(value);
            out.push(';');
        }
    }

    /// Runs `f` on the stat's name for these values, written into one
    /// buffer this thread keeps (a labelled stat costs no allocation per
    /// write; a nested use, which nothing does, gets its own buffer).
    fn with_name<R>(&self, values: &[&str], f: impl FnOnce(&str) -> R) -> R {
        thread_local! {
            static NAME: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
        }
        NAME.with(|buffer| match buffer.try_borrow_mut() {
            Ok(mut name) => {
                self.write_name(&mut name, values);
                f(&name)
            }
            Err(_) => f(&self.named(values)),
        })
    }

    /// Adds `by` (nothing for 0: no host call on the common path).
    pub fn add(&self, host: &dyn Host, by: i64) {
        if by != 0 {
            host.metric_add(self.kind, self.name, by);
        }
    }

    /// Adds `by` to the stat of these label values (nothing for 0).
    pub fn add_at(&self, host: &dyn Host, values: &[&str], by: i64) {
        if by != 0 {
            self.with_name(values, |name| host.metric_add(self.kind, name, by));
        }
    }

    /// Sets a gauge, or records a value in a histogram.
    pub fn record(&self, host: &dyn Host, value: u64) {
        host.metric_record(self.kind, self.name, value);
    }

    pub fn record_at(&self, host: &dyn Host, values: &[&str], value: u64) {
        self.with_name(values, |name| host.metric_record(self.kind, name, value));
    }

    /// Defines the stat at 0, so it exists (and its first change shows)
    /// before anything happens.
    pub fn define(&self, host: &dyn Host) {
        host.metric_add(self.kind, self.name, 0);
    }

    pub fn define_at(&self, host: &dyn Host, values: &[&str]) {
        self.with_name(values, |name| host.metric_add(self.kind, name, 0));
    }

    /// The label values of `name` when it is this stat's
    /// [`Metric::named`], `None` for any other name: the inverse of
    /// `named`, for a host whose stats take their labels apart (the native
    /// module's Envoy metrics), so the grammar stays in this one place.
    pub fn values_in<'n>(&self, name: &'n str) -> Option<Vec<&'n str>> {
        let mut rest = name.strip_prefix(self.name)?;
        let mut values = Vec::with_capacity(self.labels.len());
        for (i, label) in self.labels.iter().enumerate() {
            rest = rest.strip_prefix(if i == 0 { "_" } else { "." })?;
            rest = rest.strip_prefix(label)?.strip_prefix('=')?;
            let (value, after) = rest.split_once(';')?;
            values.push(value);
            rest = after;
        }
        rest.is_empty().then_some(values)
    }
}

/// The stat of [`ALL`] a name made by [`Metric::named`] belongs to, and
/// its label values; `None` for a name of no stat of the table.
pub fn find(name: &str) -> Option<(Metric, Vec<&str>)> {
    ALL.iter()
        .find_map(|m| m.values_in(name).map(|values| (*m, values)))
}

// ------------------------------------------------------------ decisions

/// `sluice_requests_total{decision, reason, tier, model}`.
pub const REQUESTS: Metric = counter(
    "sluice_requests_total",
    &["decision", "reason", "tier", "model"],
);
/// Decisions of callers in a team or an org (`none` for the level they
/// lack). Bounded: teams and orgs are declared; never the principal.
pub const TEAM_REQUESTS: Metric = counter(
    "sluice_team_requests_total",
    &["decision", "reason", "team", "org"],
);
/// `direction` input|output; `kind` estimated (reserved) | actual
/// (settled) | the parts of `actual` the upstream reported apart, priced
/// differently and already inside `actual` (never add them to it): input
/// `cached` (read from its prompt cache) and `cache_write` (written to
/// it), output `reasoning`.
pub const TOKENS: Metric = counter(
    "sluice_tokens_total",
    &["direction", "kind", "tier", "model"],
);
/// Which bucket refused (its rule id; bounded by the policy).
pub const REFUSALS: Metric = counter("sluice_refusals_total", &["bucket"]);
/// `kind`: downshift, static or cache (a cached answer while the primary is out).
pub const DEGRADED: Metric = counter("sluice_degraded_total", &["kind", "tier", "model"]);
/// The response cache as the filter saw it: `result` hit, miss, store,
/// skip (not cacheable, not stored), timeout (no answer in
/// `cache.lookup_timeout`: a miss) or refused (a hit its caller's buckets
/// refused); `kind` exact or semantic.
pub const CACHE: Metric = counter("sluice_cache_total", &["result", "kind", "model"]);
/// Tokens (prompt + completion) of the answers served from the cache, by
/// the caller's tier and the model: what the upstream was not asked for.
pub const CACHE_SAVED_TOKENS: Metric =
    counter("sluice_cache_saved_tokens_total", &["tier", "model"]);
/// What the answers served from the cache cost when they were first
/// asked (at the model's price), micro-currency: the spend a hit saved.
pub const CACHE_SAVED_SPEND: Metric =
    counter("sluice_cache_saved_spend_micros_total", &["tier", "model"]);
/// Requests refused 401 by identity, by why (`identity::AuthRefusal::code`).
pub const AUTH_FAILURES: Metric = counter("sluice_auth_failures_total", &["reason"]);
/// Body requests refused in the headers phase by their caller's own empty
/// bucket: their body was never buffered or parsed.
pub const REFUSED_BEFORE_BODY: Metric = counter("sluice_refused_before_body_total", &[]);

// ------------------------------------------------------------ latency

/// Milliseconds to the first response body byte, per model (bucket bounds
/// from the `histogram_bucket_settings` shipped in `envoy/`).
pub const TTFT_MS: Metric = histogram("sluice_ttft_milliseconds", &["model"]);
/// Milliseconds to the end of the response, per model.
pub const E2E_MS: Metric = histogram("sluice_e2e_milliseconds", &["model"]);
/// Microseconds from a request's arrival to sluice's verdict, by decision
/// (with `request.server_timing`: what `Server-Timing` says).
pub const DECISION_US: Metric = histogram("sluice_decision_microseconds", &["decision"]);

// ------------------------------------------------------------ the sidecar's state

pub const KILL_SWITCH: Metric = gauge("sluice_kill_switch_active", &[]);
pub const BREAKERS_OPEN: Metric = gauge("sluice_breakers_open", &[]);
/// The global spend breaker is open.
pub const GLOBAL_BREAKER: Metric = gauge("sluice_global_breaker_open", &[]);
/// Long polls of the sidecar answered, and failed.
pub const SIDECAR_POLLS: Metric = counter("sluice_sidecar_polls_total", &[]);
pub const SIDECAR_POLL_ERRORS: Metric = counter("sluice_sidecar_poll_errors_total", &[]);

// ------------------------------------------------------------ exactness and bounds

/// Compare-and-swap attempts lost to another worker and retried.
pub const CAS_RETRIES: Metric = counter("sluice_cas_retries_total", &[]);
/// Requests refused because every CAS attempt on a bucket was lost.
pub const CAS_EXHAUSTED: Metric = counter("sluice_cas_exhausted_total", &[]);
/// Requests refused 429 `capacity_exhausted`: every per-caller slot the
/// caller could use was held by an active caller.
pub const CAPACITY_EXHAUSTED: Metric = counter("sluice_capacity_exhausted_total", &[]);
/// Requests the loop guard could not count: every record it probed held
/// another body's live window (let through).
pub const LOOP_GUARD_UNTRACKED: Metric = counter("sluice_loop_guard_untracked_total", &[]);
/// Requests holding a token or spend reservation not yet settled.
pub const RESERVATIONS_OUTSTANDING: Metric = gauge("sluice_reservations_outstanding", &[]);
/// Settled cost, micro-currency.
pub const SPEND_MICROS: Metric = counter("sluice_spend_micros_total", &[]);
/// Settled cost by the caller's tier, micro-currency (the tier is one of
/// the policy's: an unknown one is the default).
pub const TIER_SPEND: Metric = counter("sluice_tier_spend_micros_total", &["tier"]);
/// Settled cost of callers in a team or an org (`none` for the level they
/// lack), micro-currency. Bounded: teams and orgs are declared.
pub const TEAM_SPEND: Metric = counter("sluice_team_spend_micros_total", &["team", "org"]);
/// The policy's spend budgets, micro-currency, set when it loads; `kind`
/// is the window, `daily` or `monthly`. A tier's is per caller; a team's,
/// an org's and a provider's count all of it together.
pub const TIER_SPEND_BUDGET: Metric = gauge("sluice_tier_spend_budget_micros", &["tier", "kind"]);
pub const TEAM_SPEND_BUDGET: Metric = gauge("sluice_team_spend_budget_micros", &["team", "kind"]);
pub const ORG_SPEND_BUDGET: Metric = gauge("sluice_org_spend_budget_micros", &["org", "kind"]);
pub const PROVIDER_SPEND_BUDGET: Metric =
    gauge("sluice_provider_spend_budget_micros", &["provider", "kind"]);
/// Responses whose usage fields could not be believed (settled from the
/// estimate).
pub const USAGE_INVALID: Metric = counter("sluice_usage_invalid_total", &[]);
/// Successful responses without usage (settled from the estimate).
pub const USAGE_MISSING: Metric = counter("sluice_usage_missing_total", &[]);
/// Settled requests by where their input figure came from: the
/// upstream's usage (`reported`), the bound a hard budget reserved
/// (`bounded`), or the estimate (`estimated`).
pub const INPUT_SOURCE: Metric = counter("sluice_input_source_total", &["kind"]);
/// Streams ended by sluice because they ran past their budget.
pub const STREAM_CUT: Metric = counter("sluice_stream_cut_total", &[]);
/// Cut streams whose upstream sent on past the cut, reset both ways.
pub const STREAM_RESET: Metric = counter("sluice_stream_reset_total", &[]);
/// Requests that crossed a budget's alert threshold.
pub const BUDGET_ALERTS: Metric = counter("sluice_budget_alerts_total", &[]);
/// Minutes in which tokens/min across all callers surged past the baseline.
pub const USAGE_SURGES: Metric = counter("sluice_usage_surge_total", &[]);
/// Policies refused at load.
pub const CONFIG_REJECTED: Metric = counter("sluice_config_rejected_total", &[]);

// ------------------------------------------------------------ routes and upstreams

/// Requests sent to a provider of the ladder (kill switch, or the primary
/// out).
pub const REROUTED: Metric = counter("sluice_rerouted_total", &[]);
/// Requests of each provider of the ladder, by `outcome`: `served` (sent
/// to it), `skipped_budget` (its own budget could not hold the request) or
/// `skipped_down` (the sidecar reports the rung down).
pub const PROVIDER_REQUESTS: Metric =
    counter("sluice_provider_requests_total", &["provider", "outcome"]);
/// Failover after dispatch, by `outcome`: `sent` (an attempt went to the
/// next rung), `rescued` (an attempt answered), `static` (the ladder ended
/// in the static answer), `exhausted` (no rung, attempt or time was left:
/// the failure reached the caller), `over_budget` (the attempt budget of
/// the second was spent).
pub const FAILOVER: Metric = counter("sluice_failover_total", &["outcome"]);
/// A provider's spend budget crossed its `alert_at`: once per window (per
/// Envoy); the sidecar sends it to its webhooks.
pub const PROVIDER_BUDGET_ALERTS: Metric =
    counter("sluice_provider_budget_alerts_total", &["provider"]);
/// Settled spend of the requests each provider served, micro-currency.
pub const PROVIDER_SPEND: Metric = counter("sluice_provider_spend_micros_total", &["provider"]);
/// Times a route's error breaker opened.
pub const ERROR_BREAKER_OPENED: Metric = counter("sluice_error_breaker_opened_total", &[]);
/// Upstream `Retry-After` pauses, by what they pause (`kind`: `route`, the
/// whole model route, or `credential`, one credential on it).
pub const UPSTREAM_PAUSES: Metric = counter("sluice_upstream_pauses_total", &["kind"]);
/// Upstream answers whose pause or breaker update was lost to contention.
pub const PUSHBACK_DROPPED: Metric = counter("sluice_upstream_unrecorded_total", &[]);

// ------------------------------------------------------------ penalty box

/// Blocks the penalty box started (each refused request is counted in
/// `sluice_requests_total{reason="temporarily_blocked"}`).
pub const ABUSE_BLOCKS: Metric = counter("sluice_abuse_blocks_total", &[]);
/// Requests over the threshold that found every block record of their key
/// holding a live block: refused by the count until its period ends.
pub const ABUSE_UNTRACKED: Metric = counter("sluice_abuse_untracked_total", &[]);

// ------------------------------------------------------------ queue

pub const QUEUE_DEPTH: Metric = gauge("sluice_queue_depth", &["model", "class"]);
pub const INFLIGHT: Metric = gauge("sluice_inflight", &["model"]);
pub const QUEUE_WAIT_MS: Metric = histogram("sluice_queue_wait_milliseconds", &["model", "class"]);
/// `outcome`: dispatched (reason immediate|queued), rejected, expired,
/// evicted, rerouted, abandoned, deferred.
pub const QUEUE_OUTCOMES: Metric = counter(
    "sluice_queue_total",
    &["outcome", "reason", "model", "class"],
);
/// Paused requests resumed, by what woke them (`message` or `tick`).
pub const QUEUE_RESUMED: Metric = counter("sluice_queue_resumed_total", &["via"]);

// ------------------------------------------------------------ fleet

pub const FLEET_TAKES: Metric = counter("sluice_fleet_takes_total", &[]);
pub const FLEET_REFUSED: Metric = counter("sluice_fleet_refused_total", &[]);
pub const FLEET_UNAVAILABLE: Metric = counter("sluice_fleet_unavailable_total", &[]);
pub const FLEET_DEGRADED: Metric = gauge("sluice_fleet_degraded", &[]);
pub const FLEET_OUTBOX_DROPPED: Metric = counter("sluice_fleet_outbox_dropped_total", &[]);
pub const FLEET_BATCHES: Metric = counter("sluice_fleet_batches_total", &[]);
/// 1 while the fleet's slots cannot be reported (gates on stand-ins).
pub const FLEET_SLOTS_DEGRADED: Metric = gauge("sluice_fleet_slots_degraded", &[]);
/// 1 while the sidecar refuses to count because the fleet's fingerprints
/// differ (salt, replicas or rules); the Envoy is on `on_unavailable`.
pub const FLEET_MISMATCH: Metric = gauge("sluice_fleet_mismatch", &[]);
/// 1 while the sidecar refuses hard budgets because Redis lost its data in
/// their window (FLUSHALL, a restart without persistence).
pub const FLEET_DATA_LOST: Metric = gauge("sluice_fleet_data_lost", &[]);

/// The whole table.
pub const ALL: &[Metric] = &[
    REQUESTS,
    TEAM_REQUESTS,
    TOKENS,
    REFUSALS,
    DEGRADED,
    AUTH_FAILURES,
    REFUSED_BEFORE_BODY,
    TTFT_MS,
    E2E_MS,
    KILL_SWITCH,
    BREAKERS_OPEN,
    GLOBAL_BREAKER,
    SIDECAR_POLLS,
    SIDECAR_POLL_ERRORS,
    CAS_RETRIES,
    CAS_EXHAUSTED,
    CAPACITY_EXHAUSTED,
    LOOP_GUARD_UNTRACKED,
    RESERVATIONS_OUTSTANDING,
    SPEND_MICROS,
    TIER_SPEND,
    TEAM_SPEND,
    TIER_SPEND_BUDGET,
    TEAM_SPEND_BUDGET,
    ORG_SPEND_BUDGET,
    PROVIDER_SPEND_BUDGET,
    USAGE_INVALID,
    USAGE_MISSING,
    INPUT_SOURCE,
    STREAM_CUT,
    STREAM_RESET,
    BUDGET_ALERTS,
    USAGE_SURGES,
    CONFIG_REJECTED,
    REROUTED,
    PROVIDER_REQUESTS,
    FAILOVER,
    PROVIDER_SPEND,
    PROVIDER_BUDGET_ALERTS,
    ERROR_BREAKER_OPENED,
    UPSTREAM_PAUSES,
    PUSHBACK_DROPPED,
    ABUSE_BLOCKS,
    ABUSE_UNTRACKED,
    QUEUE_DEPTH,
    INFLIGHT,
    QUEUE_WAIT_MS,
    DECISION_US,
    QUEUE_OUTCOMES,
    QUEUE_RESUMED,
    FLEET_TAKES,
    FLEET_REFUSED,
    FLEET_UNAVAILABLE,
    FLEET_DEGRADED,
    FLEET_OUTBOX_DROPPED,
    FLEET_BATCHES,
    FLEET_SLOTS_DEGRADED,
    FLEET_MISMATCH,
    FLEET_DATA_LOST,
    CACHE,
    CACHE_SAVED_TOKENS,
    CACHE_SAVED_SPEND,
];

/// Defines at 0 every stat of the table without labels (histograms are
/// made by their first value), so each exists before anything happens:
/// the alerts read them.
pub fn define_fixed(host: &dyn Host) {
    for m in ALL {
        if m.labels.is_empty() && m.kind != MetricKind::Histogram {
            m.define(host);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn every_metric_of_this_file_is_in_all() {
        // The tag and spelling tests read `ALL`: a metric left out of it
        // is checked by none of them.
        let src = include_str!("metrics.rs");
        let defined: BTreeSet<&str> = src
            .lines()
            .filter_map(|l| l.strip_prefix("pub const "))
            .filter_map(|l| l.split_once(": Metric ="))
            .map(|(name, _)| name)
            .collect();
        let body = src
            .split_once("pub const ALL: &[Metric] = &[")
            .and_then(|(_, rest)| rest.split_once("];"))
            .map(|(b, _)| b)
            .unwrap_or_default();
        let listed: BTreeSet<&str> = body
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        assert!(!defined.is_empty());
        let missing: Vec<_> = defined.difference(&listed).collect();
        assert!(missing.is_empty(), "not in ALL: {missing:?}");
    }

    #[test]
    fn find_reads_back_every_name_named_writes() {
        for m in ALL {
            let values: Vec<String> = (0..m.labels.len()).map(|i| format!("v.{i}:x")).collect();
            let refs: Vec<&str> = values.iter().map(String::as_str).collect();
            let name = m.named(&refs);
            assert_eq!(find(&name), Some((*m, refs.clone())), "{name}");
        }
        assert_eq!(find("sluice_no_such_stat"), None);
        assert_eq!(find("sluice_requests_total_decision=admit;"), None);
    }

    #[test]
    fn names_are_unique_snake_case_and_prefixed() {
        let mut seen = BTreeSet::new();
        for m in ALL {
            assert!(seen.insert(m.name), "{} twice", m.name);
            assert!(m.name.starts_with("sluice_"), "{}", m.name);
            assert!(
                m.name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{}",
                m.name
            );
        }
    }

    #[test]
    fn a_labelled_write_names_the_stat_as_named_does_one_after_another() {
        // The name is written into one buffer per thread: each write must
        // see its own labels, a longer name after a shorter one and back.
        let host = crate::host::mock::MockHost::default();
        let writes: [&[&str]; 3] = [
            &["admit", "none", "free", "llama3.1:8b"],
            &["refuse", "rate_limited", "a-much-longer-tier-name", "m"],
            &["admit", "none", "free", "llama3.1:8b"],
        ];
        for values in writes {
            REQUESTS.add_at(&host, values, 1);
        }
        assert_eq!(host.metric(&REQUESTS.named(writes[0])), Some(2));
        assert_eq!(host.metric(&REQUESTS.named(writes[1])), Some(1));
        UPSTREAM_PAUSES.define_at(&host, &["route"]);
        assert_eq!(
            host.metric("sluice_upstream_pauses_total_kind=route;"),
            Some(0)
        );
    }

    #[test]
    fn labels_ride_in_the_name_as_the_shipped_stats_tags_read_them() {
        assert_eq!(
            REQUESTS.named(&["admit", "none", "free", "llama3.1:8b"]),
            "sluice_requests_total_decision=admit;.reason=none;.tier=free;.model=llama3.1:8b;"
        );
        assert_eq!(
            UPSTREAM_PAUSES.named(&["route"]),
            "sluice_upstream_pauses_total_kind=route;"
        );
        assert_eq!(KILL_SWITCH.named(&[]), "sluice_kill_switch_active");
        // Every label name of the table has a tag in the shipped config.
        let shipped = include_str!("../../../envoy/sluice.yaml");
        for m in ALL {
            for label in m.labels {
                assert!(
                    shipped.contains(&format!("tag_name: {label}")),
                    "{}: no stats_tags entry for `{label}` in envoy/sluice.yaml",
                    m.name
                );
            }
        }
    }

    /// The table is the one place a stat is named: no other production
    /// file of the crate spells a `sluice_…` stat name.
    #[test]
    fn no_stat_name_is_spelled_outside_the_table() {
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
        let mut stack = vec![std::path::PathBuf::from(src)];
        let names: Vec<&str> = ALL.iter().map(|m| m.name).collect();
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let file = path.to_string_lossy().to_string();
                if file.ends_with("host/metrics.rs")
                    || file.contains("tests")
                    || file.contains("mock")
                {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let code = text.split("#[cfg(test)]").next().unwrap_or("");
                for name in &names {
                    assert!(
                        !code.contains(&format!("\"{name}")),
                        "{file} spells `{name}`: name it through host::metrics"
                    );
                }
            }
        }
    }
}
