//! `request` and `defaults`: what one request may carry and what it gets
//! when it says nothing.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::policy::units::parse_size;
use crate::policy::{ConfigError, Policy};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestConfig {
    /// Bodies above this get 413 (`1MiB`, `512KiB` or bytes).
    #[serde(default = "default_max_body", deserialize_with = "de_size")]
    pub max_body_bytes: u64,
    /// The most output tokens one completion may ask for, any model (a
    /// model's own `max_output` may be lower). Above it: 400 naming the
    /// field. Bounds every reservation, so no client number can wrap it.
    #[serde(default = "default_output_cap")]
    pub max_output: u64,
    /// Which rate-limit fields answers carry besides `X-RateLimit-*`.
    #[serde(default)]
    pub rate_limit_headers: RateLimitHeaders,
    /// Admit Responses API requests that have the server add stored
    /// context (`previous_response_id`, `conversation`, a stored `prompt`,
    /// an input item by id: `item_reference`, or an `id` with no type and
    /// no content). Off: they are 400s naming the field,
    /// since that context is billed as input sluice cannot see or reserve.
    /// On: it is charged when the answer's usage settles, but not
    /// reserved, so a hard budget can be overshot by it.
    #[serde(default)]
    pub allow_stored_context: bool,
    /// Admit Responses API requests with `background: true`. The server
    /// answers `queued` at once and generates afterwards, so the answer
    /// carries no usage to settle. Off: a 400 naming `background`. On:
    /// such a request is charged its whole reservation.
    #[serde(default)]
    pub allow_background: bool,
    /// The most body bytes one worker holds for requests that wait (in a
    /// model's queue, or asleep until a bucket refills). A waiting request
    /// keeps its parsed body, which can weigh 15 times the bytes sent, in
    /// the worker's wasm memory, and that memory never shrinks: unbounded,
    /// a burst of large queued bodies grew a worker past 800 MB and
    /// crashed its VM. A request that must wait and whose body would go
    /// past it is refused 429 `queue_full` instead.
    #[serde(default = "default_max_waiting_body", deserialize_with = "de_size")]
    pub max_waiting_body_bytes: u64,
    /// The path where a caller reads its own limits and budgets (`GET`,
    /// answered by sluice, never sent upstream; see
    /// `admission/own_limits.rs`); `null` turns the endpoint off.
    #[serde(default = "default_limits_path")]
    pub limits_path: Option<String>,
    /// Answers carry `Server-Timing: sluice;dur=<ms>` (the time from the
    /// request's arrival to sluice's verdict), and the time is recorded in
    /// `sluice_decision_microseconds`. Off by default: a clock read, a
    /// histogram and a header per request.
    #[serde(default)]
    pub server_timing: bool,
}

impl Default for RequestConfig {
    fn default() -> Self {
        RequestConfig {
            max_body_bytes: default_max_body(),
            max_output: default_output_cap(),
            rate_limit_headers: RateLimitHeaders::default(),
            allow_stored_context: false,
            allow_background: false,
            max_waiting_body_bytes: default_max_waiting_body(),
            limits_path: default_limits_path(),
            server_timing: false,
        }
    }
}

/// Where a caller reads its own limits unless the policy says otherwise.
pub const DEFAULT_LIMITS_PATH: &str = "/v1/sluice/limits";

fn default_limits_path() -> Option<String> {
    Some(DEFAULT_LIMITS_PATH.to_string())
}

/// 16 MiB: sixteen requests at the default body cap, a few hundred MB of
/// parsed bodies at worst (measured: about 14 MB per 950 KB body of many
/// small messages), far below where a VM failed (866 MB).
fn default_max_waiting_body() -> u64 {
    16 << 20
}

/// `request.rate_limit_headers`: the IETF `RateLimit-Policy` / `RateLimit`
/// fields (draft-ietf-httpapi-ratelimit-headers-11) of the bucket that
/// `X-RateLimit-*` reports, on admitted answers and on a bucket's 429.
/// Off by default: two more headers on every answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitHeaders {
    #[serde(default)]
    pub ietf: bool,
}

/// The highest `request.max_output` accepted: with at most 128 choices and
/// a body-bounded input, every reservation stays far from `u64::MAX`.
pub const MAX_OUTPUT_CAP: u64 = 1 << 32;

fn default_output_cap() -> u64 {
    1 << 20
}

fn default_max_body() -> u64 {
    1 << 20
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Defaults {
    /// Output reserved when neither the request nor the model says.
    #[serde(default = "default_max_output")]
    pub max_output_tokens: u64,
    /// The shares of every model and route bucket that writes none;
    /// absent: `anonymous: 50%` when the policy declares API keys (see
    /// `shares`), `{}` turns that off.
    pub shares: Option<crate::policy::shares::SharesConfig>,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            max_output_tokens: default_max_output(),
            shares: None,
        }
    }
}

fn default_max_output() -> u64 {
    1024
}

fn de_size<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    struct SizeVisitor;
    impl Visitor<'_> for SizeVisitor {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a size like `1MiB` or a number of bytes")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            parse_size(v).map_err(E::custom)
        }
    }
    deserializer.deserialize_any(SizeVisitor)
}

/// The output cap bounds every reservation; the default output fits it.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    if p.request.max_output == 0 || p.request.max_output > MAX_OUTPUT_CAP {
        return Err(ConfigError::at(
            "request.max_output",
            format!("must be between 1 and {MAX_OUTPUT_CAP}"),
        ));
    }
    if p.defaults.max_output_tokens > p.request.max_output {
        return Err(ConfigError::at(
            "defaults.max_output_tokens",
            "must not be above request.max_output",
        ));
    }
    if p.defaults.max_output_tokens == 0 {
        return Err(ConfigError::at(
            "defaults.max_output_tokens",
            "must be at least 1",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::policy::Policy;
    use serde_json::json;

    fn with_request(request: serde_json::Value) -> Result<Policy, crate::policy::ConfigError> {
        Policy::from_value(json!({
            "default_tier": "free",
            "tiers": {"free": {"requests": "10/min"}},
            "request": request,
        }))
    }

    #[test]
    fn ietf_rate_limit_headers_are_off_by_default_and_named_by_their_path() {
        let p = with_request(json!({})).unwrap();
        assert!(!p.request.rate_limit_headers.ietf);
        let p = with_request(json!({"rate_limit_headers": {"ietf": true}})).unwrap();
        assert!(p.request.rate_limit_headers.ietf);
        let err = with_request(json!({"rate_limit_headers": {"ietf": "yes"}})).unwrap_err();
        assert_eq!(err.path, "request.rate_limit_headers.ietf", "{err:?}");
        let err =
            with_request(json!({"rate_limit_headers": {"ietf": true, "draft": 3}})).unwrap_err();
        assert!(
            err.path.starts_with("request.rate_limit_headers"),
            "{err:?}"
        );
        assert!(err.message.contains("draft"), "{err:?}");
    }

    #[test]
    fn stored_context_is_refused_unless_allowed_and_the_field_is_a_boolean() {
        assert!(
            !with_request(json!({}))
                .unwrap()
                .request
                .allow_stored_context
        );
        let p = with_request(json!({"allow_stored_context": true})).unwrap();
        assert!(p.request.allow_stored_context);
        let err = with_request(json!({"allow_stored_context": "yes"})).unwrap_err();
        assert_eq!(err.path, "request.allow_stored_context", "{err:?}");
        let err = with_request(json!({"allow_stored_contexts": true})).unwrap_err();
        assert!(err.message.contains("allow_stored_contexts"), "{err:?}");
    }
}
