//! Metric names. Labels ride inside the name (`_decision=admit;` …) and
//! Envoy's `stats_tags` (shipped in every `envoy/` config) turn them into
//! Prometheus labels; see ENVOY-FACTS.

use crate::admission::answer::Decision;
use crate::admission::Labels;

/// `sluice_requests_total{decision, reason, tier, model}`.
pub fn requests_total(l: &Labels) -> String {
    format!(
        "sluice_requests_total_decision={};.reason={};.tier={};.model={};",
        l.decision.code(),
        l.decision.reason_code(),
        l.tier,
        l.model
    )
}

/// `sluice_team_requests_total{decision, reason, team, org}`: decisions
/// of callers in a team or an org (`none` for the level they lack).
/// Bounded: teams and orgs are declared; never the principal.
pub fn team_requests_total(decision: Decision, team: Option<&str>, org: Option<&str>) -> String {
    format!(
        "sluice_team_requests_total_decision={};.reason={};.team={};.org={};",
        decision.code(),
        decision.reason_code(),
        team.unwrap_or("none"),
        org.unwrap_or("none")
    )
}

/// `sluice_tokens_total{direction, kind, tier, model}`: `direction` is
/// `input` or `output`; `kind` is `estimated` (what admission reserved) or
/// `actual` (what settlement charged).
pub fn tokens_total(direction: &str, kind: &str, tier: &str, model: &str) -> String {
    format!("sluice_tokens_total_direction={direction};.kind={kind};.tier={tier};.model={model};")
}

/// `sluice_refusals_total{bucket}`: which bucket refused (its rule id, e.g.
/// `tier/free/requests`; bounded by the policy).
pub fn refusals_total(bucket: &str) -> String {
    format!("sluice_refusals_total_bucket={bucket};")
}

/// `sluice_degraded_total{kind, tier, model}`: `downshift` or `static`.
/// The response cache as the filter saw it: `result` hit, miss, store,
/// skip (not cacheable, not stored) or timeout (the sidecar did not answer
/// in `cache.lookup_timeout`: a miss); `kind` exact or semantic.
pub fn cache_total(result: &str, kind: &str, model: &str) -> String {
    format!("sluice_cache_total_result={result};.kind={kind};.model={model};")
}

/// Tokens a cache hit did not spend upstream, per model.
pub fn cache_saved_tokens(model: &str) -> String {
    format!("sluice_cache_saved_tokens_total_model={model};")
}

pub fn degraded_total(kind: &str, tier: &str, model: &str) -> String {
    format!("sluice_degraded_total_kind={kind};.tier={tier};.model={model};")
}

/// Histograms in milliseconds, per model: time to the first response body
/// byte, and to the end of the response. Bucket bounds come from the
/// `histogram_bucket_settings` shipped in `envoy/` (10 ms … 120 s).
pub fn ttft_ms(model: &str) -> String {
    format!("sluice_ttft_milliseconds_model={model};")
}
pub fn e2e_ms(model: &str) -> String {
    format!("sluice_e2e_milliseconds_model={model};")
}

/// The sidecar state as the filter sees it (gauges, set by the polling VM).
pub const KILL_SWITCH: &str = "sluice_kill_switch_active";
pub const BREAKERS_OPEN: &str = "sluice_breakers_open";

/// Compare-and-swap attempts lost to another worker and retried.
pub const CAS_RETRIES: &str = "sluice_cas_retries_total";
/// Requests refused because every CAS attempt on a bucket was lost.
pub const CAS_EXHAUSTED: &str = "sluice_cas_exhausted_total";
/// Requests refused 429 `capacity_exhausted`: every per-caller slot the
/// caller could use was held by an active caller.
pub const CAPACITY_EXHAUSTED: &str = "sluice_capacity_exhausted_total";
/// Requests holding a token or spend reservation not yet settled (gauge).
pub const RESERVATIONS_OUTSTANDING: &str = "sluice_reservations_outstanding";
/// The metrics above that are gauges; every other is a counter.
pub const GAUGES: &[&str] = &[
    RESERVATIONS_OUTSTANDING,
    KILL_SWITCH,
    BREAKERS_OPEN,
    GLOBAL_BREAKER,
    crate::fleet::M_DEGRADED,
    crate::flow::slots::M_DEGRADED,
    crate::fleet::M_MISMATCH,
    crate::fleet::M_DATA_LOST,
];
/// Settled cost, micro-currency.
pub const SPEND_MICROS: &str = "sluice_spend_micros_total";
/// Responses whose usage fields could not be believed (settled from the
/// estimate).
pub const USAGE_INVALID: &str = "sluice_usage_invalid_total";
/// Successful responses without usage (settled from the estimate).
pub const USAGE_MISSING: &str = "sluice_usage_missing_total";
/// Streams ended by sluice because they ran past their budget.
pub const STREAM_CUT: &str = "sluice_stream_cut_total";
/// Requests that crossed a budget's alert threshold.
pub const BUDGET_ALERTS: &str = "sluice_budget_alerts_total";
/// Long polls of the sidecar answered, and failed.
pub const SIDECAR_POLLS: &str = "sluice_sidecar_polls_total";
pub const SIDECAR_POLL_ERRORS: &str = "sluice_sidecar_poll_errors_total";
/// Requests sent to the fallback provider by the kill switch.
pub const REROUTED: &str = "sluice_rerouted_total";
/// Times a route's error breaker opened.
pub const ERROR_BREAKER_OPENED: &str = "sluice_error_breaker_opened_total";
/// Upstream `Retry-After` pauses, by what they pause (`kind`: the whole
/// model route, or one credential on it).
pub const PAUSES_ROUTE: &str = "sluice_upstream_pauses_total_kind=route;";
pub const PAUSES_CREDENTIAL: &str = "sluice_upstream_pauses_total_kind=credential;";
/// Upstream answers whose pause or breaker update was lost to contention.
pub const PUSHBACK_DROPPED: &str = "sluice_upstream_unrecorded_total";
/// Minutes in which tokens/min across all callers surged past the baseline.
pub const USAGE_SURGES: &str = "sluice_usage_surge_total";
/// The global spend breaker is open (gauge).
pub const GLOBAL_BREAKER: &str = "sluice_global_breaker_open";
/// Policies refused at load.
pub const CONFIG_REJECTED: &str = "sluice_config_rejected_total";
/// Blocks the penalty box started (each refused request is counted in
/// `sluice_requests_total{reason="temporarily_blocked"}`).
pub const ABUSE_BLOCKS: &str = "sluice_abuse_blocks_total";
/// Requests over the penalty box's threshold that found every block
/// record of their key holding a live block: refused by the count until
/// its period ends, not for `block_for`.
pub const ABUSE_UNTRACKED: &str = "sluice_abuse_untracked_total";
/// Body requests refused in the headers phase by their caller's own empty
/// bucket: their body was never buffered or parsed.
pub const REFUSED_BEFORE_BODY: &str = "sluice_refused_before_body_total";
/// `sluice_auth_failures_total{reason}`: requests refused 401 by the
/// identity step, by why (`principal::Refusal::code`); each also counts
/// toward the penalty box of its address.
pub fn auth_failures_total(reason: &str) -> String {
    format!("sluice_auth_failures_total_reason={reason};")
}

/// Every metric with a fixed name: defined at 0 when a policy loads, so
/// each exists (and its first increment is a visible change) before
/// anything happens.
pub const FIXED: &[&str] = &[
    KILL_SWITCH,
    BREAKERS_OPEN,
    CAS_RETRIES,
    CAS_EXHAUSTED,
    CAPACITY_EXHAUSTED,
    RESERVATIONS_OUTSTANDING,
    SPEND_MICROS,
    USAGE_INVALID,
    USAGE_MISSING,
    STREAM_CUT,
    BUDGET_ALERTS,
    SIDECAR_POLLS,
    SIDECAR_POLL_ERRORS,
    REROUTED,
    ERROR_BREAKER_OPENED,
    PAUSES_ROUTE,
    PAUSES_CREDENTIAL,
    PUSHBACK_DROPPED,
    USAGE_SURGES,
    GLOBAL_BREAKER,
    CONFIG_REJECTED,
    ABUSE_BLOCKS,
    ABUSE_UNTRACKED,
    REFUSED_BEFORE_BODY,
    // `auth_failures_total` of every `principal::Refusal` (the alert reads
    // them; a test keeps the list whole).
    "sluice_auth_failures_total_reason=unknown_key;",
    "sluice_auth_failures_total_reason=unverified_jwt;",
    "sluice_auth_failures_total_reason=conflicting_credentials;",
    "sluice_auth_failures_total_reason=empty_credential;",
    // The fleet's (`crate::fleet`), also without one: the alerts read them.
    crate::fleet::M_TAKES,
    crate::fleet::M_REFUSED,
    crate::fleet::M_UNAVAILABLE,
    crate::fleet::M_DEGRADED,
    crate::fleet::M_OUTBOX_DROPPED,
    crate::fleet::M_BATCHES,
    crate::flow::slots::M_DEGRADED,
    crate::fleet::M_MISMATCH,
    crate::fleet::M_DATA_LOST,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_auth_failure_reason_is_defined_at_load() {
        use crate::admission::identity::Refusal;
        for why in [
            Refusal::UnknownKey,
            Refusal::UnverifiedJwt,
            Refusal::ConflictingCredentials,
            Refusal::EmptyCredential,
        ] {
            let name = auth_failures_total(why.code());
            assert!(FIXED.contains(&name.as_str()), "{name}");
        }
    }

    #[test]
    fn every_gauge_is_a_fixed_name_and_fixed_names_are_unique() {
        for gauge in GAUGES {
            assert!(FIXED.contains(gauge), "{gauge}");
        }
        let mut names = FIXED.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FIXED.len());
    }

    #[test]
    fn label_encoding_matches_the_shipped_stats_tags() {
        let l = Labels {
            decision: crate::admission::answer::Decision::Admit,
            tier: "free".into(),
            model: "llama3.1:8b".into(),
        };
        assert_eq!(
            requests_total(&l),
            "sluice_requests_total_decision=admit;.reason=none;.tier=free;.model=llama3.1:8b;"
        );
    }
}
