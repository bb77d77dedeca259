//! `runs:` — a budget per session or agent run, beside the caller's own —
//! and `loop_guard:` — the same body from the same caller too often.
//!
//! A run is named by the client (a header or a body field) and counted per
//! caller: the run's key is the caller's identity and the run id together,
//! hashed under the deployment's key, so one caller never reaches another's
//! run by guessing its id. A run's counts vanish once it has gone unused
//! for `ttl`; a run in use never loses them.

use serde::Deserialize;

use crate::policy::units::{MAX_UNITS, SCALE};
use crate::policy::{de_duration, default_true, Budget, ConfigError, Mode, Policy};

/// The longest run id taken, in bytes.
pub const MAX_RUN_ID: usize = 128;
/// The shortest and longest `ttl`.
const MIN_TTL_MS: u64 = 1_000;
const MAX_TTL_MS: u64 = 30 * 86_400_000;
/// Bounds of the run table (one shared-data key a slot).
const MAX_LIVE: u32 = 65_536;
const MAX_PER_CALLER: u32 = 64;
/// Bounds of the loop guard's table.
const MAX_LOOP_SLOTS: u32 = 65_536;

/// `runs: {id: {header: x-session-id}, ttl: 1h, tokens: 100000}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunsConfig {
    /// Where a request names its run.
    pub id: RunIdSource,
    /// A request that names no run is refused (400 naming the field);
    /// `false`: it is counted against no run (the caller's own budgets
    /// still bind).
    #[serde(default = "default_true")]
    pub required: bool,
    /// A run unused this long is forgotten: its counts and its slot.
    #[serde(deserialize_with = "de_duration", rename = "ttl")]
    pub ttl_ms: u64,
    /// Tokens (input + output) per run.
    pub tokens: Option<Budget>,
    /// Spend per run, in the currency of the model prices.
    pub spend: Option<Budget>,
    /// Runs counted at once, all callers together: the table's size.
    #[serde(default = "default_max_live")]
    pub max_live: u32,
    /// Runs one caller may have counted at once.
    #[serde(default = "default_max_per_caller")]
    pub max_per_caller: u32,
}

/// `{header: x-session-id}` or `{body: metadata.session_id}`: exactly one.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RunIdSource {
    pub header: Option<String>,
    pub body: Option<String>,
}

impl RunIdSource {
    /// The field as a client is told of it (`x-session-id`,
    /// `metadata.session_id`).
    pub fn field(&self) -> &str {
        self.header
            .as_deref()
            .or(self.body.as_deref())
            .unwrap_or_default()
    }
}

/// `loop_guard: {max_repeats: 5, window: 1m}`: the same body from the same
/// caller more than `max_repeats` times within `window` is refused.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoopGuardConfig {
    pub max_repeats: u32,
    #[serde(deserialize_with = "de_duration", rename = "window")]
    pub window_ms: u64,
    /// Bodies tracked at once (one shared-data key each).
    #[serde(default = "default_loop_slots")]
    pub slots: u32,
}

fn default_max_live() -> u32 {
    4096
}
fn default_max_per_caller() -> u32 {
    16
}
fn default_loop_slots() -> u32 {
    4096
}

/// The sections' own rules.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    if let Some(runs) = &p.runs {
        check_runs(runs)?;
    }
    if let Some(guard) = &p.loop_guard {
        if guard.max_repeats == 0 {
            return Err(ConfigError::at(
                "loop_guard.max_repeats",
                "must be at least 1 (the first request of a body is never a loop)",
            ));
        }
        if !(MIN_TTL_MS..=86_400_000).contains(&guard.window_ms) {
            return Err(ConfigError::at(
                "loop_guard.window",
                "must be between 1s and 1d",
            ));
        }
        if !(1..=MAX_LOOP_SLOTS).contains(&guard.slots) {
            return Err(ConfigError::at(
                "loop_guard.slots",
                format!("must be between 1 and {MAX_LOOP_SLOTS}"),
            ));
        }
    }
    Ok(())
}

fn check_runs(r: &RunsConfig) -> Result<(), ConfigError> {
    match (&r.id.header, &r.id.body) {
        (Some(h), None) => {
            if h.is_empty() || h.bytes().any(|b| !(b.is_ascii_graphic()) || b == b':') {
                return Err(ConfigError::at("runs.id.header", "not a header name"));
            }
        }
        (None, Some(b)) => {
            if b.is_empty() || b.split('.').any(str::is_empty) {
                return Err(ConfigError::at(
                    "runs.id.body",
                    "a dotted field path like `metadata.session_id`",
                ));
            }
        }
        _ => {
            return Err(ConfigError::at(
                "runs.id",
                "name exactly one of `header` or `body`",
            ))
        }
    }
    if !(MIN_TTL_MS..=MAX_TTL_MS).contains(&r.ttl_ms) {
        return Err(ConfigError::at("runs.ttl", "must be between 1s and 30d"));
    }
    if r.tokens.is_none() && r.spend.is_none() {
        return Err(ConfigError::at(
            "runs",
            "set `tokens` or `spend` (or both): the budget of each run",
        ));
    }
    check_budget("runs.tokens", r.tokens, MAX_UNITS as f64, true)?;
    check_budget("runs.spend", r.spend, (MAX_UNITS / SCALE) as f64, false)?;
    if !(1..=MAX_LIVE).contains(&r.max_live) {
        return Err(ConfigError::at(
            "runs.max_live",
            format!("must be between 1 and {MAX_LIVE}"),
        ));
    }
    if !(1..=MAX_PER_CALLER.min(r.max_live)).contains(&r.max_per_caller) {
        return Err(ConfigError::at(
            "runs.max_per_caller",
            format!("must be between 1 and {MAX_PER_CALLER}, and at most `max_live`"),
        ));
    }
    Ok(())
}

fn check_budget(
    path: &str,
    budget: Option<Budget>,
    max: f64,
    whole: bool,
) -> Result<(), ConfigError> {
    let Some(b) = budget else { return Ok(()) };
    if b.mode == Mode::Soft {
        return Err(ConfigError::at(
            format!("{path}.mode"),
            "a run budget is hard (a soft cap downshifts by model, which a run has none of)",
        ));
    }
    if whole && b.limit.fract() != 0.0 {
        return Err(ConfigError::at(
            format!("{path}.limit"),
            "a token budget is a whole number",
        ));
    }
    if b.limit > max {
        return Err(ConfigError::at(
            format!("{path}.limit"),
            format!("too large (at most {max})"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::policy::Policy;

    fn with(extra: Value) -> Result<Policy, crate::policy::ConfigError> {
        let mut p = json!({"default_tier": "free", "tiers": {"free": {"requests": "10/min"}}});
        for (k, v) in extra.as_object().unwrap() {
            p[k] = v.clone();
        }
        Policy::from_value(p)
    }

    fn error_at(extra: Value) -> String {
        with(extra).expect_err("refused").path
    }

    #[test]
    fn a_run_section_reads_with_its_defaults() {
        let p =
            with(json!({"runs": {"id": {"header": "x-session-id"}, "ttl": "1h", "tokens": 5000}}))
                .unwrap();
        let r = p.runs.unwrap();
        assert_eq!(r.ttl_ms, 3_600_000);
        assert!(r.required);
        assert_eq!((r.max_live, r.max_per_caller), (4096, 16));
        assert_eq!(r.id.field(), "x-session-id");
    }

    #[test]
    fn each_wrong_field_is_named() {
        let base = |f: &str, v: Value| {
            let mut r = json!({"id": {"body": "metadata.session_id"}, "ttl": "10m", "tokens": 100});
            r[f] = v;
            error_at(json!({ "runs": r }))
        };
        assert_eq!(base("id", json!({"header": "a", "body": "b"})), "runs.id");
        assert_eq!(base("id", json!({"body": "metadata..x"})), "runs.id.body");
        assert_eq!(base("ttl", json!("10ms")), "runs.ttl");
        assert_eq!(base("max_live", json!(0)), "runs.max_live");
        assert_eq!(base("max_per_caller", json!(65)), "runs.max_per_caller");
        assert_eq!(base("tokens", json!(1.5)), "runs.tokens.limit");
        assert_eq!(
            base("tokens", json!({"limit": 10, "mode": "soft"})),
            "runs.tokens.mode"
        );
        assert_eq!(
            error_at(json!({"runs": {"id": {"header": "x-run"}, "ttl": "1m"}})),
            "runs"
        );
        let guard = |g: Value| error_at(json!({ "loop_guard": g }));
        assert_eq!(
            guard(json!({"max_repeats": 0, "window": "1m"})),
            "loop_guard.max_repeats"
        );
        assert_eq!(
            guard(json!({"max_repeats": 3, "window": "2d"})),
            "loop_guard.window"
        );
    }
}
