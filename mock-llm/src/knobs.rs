//! Per-request behaviour knobs. Each is read from a request header or, if the
//! header is absent, from a query parameter of the same name.

use std::collections::HashMap;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode};

pub const LATENCY_MS: &str = "x-mock-latency-ms";
pub const CHUNK_DELAY_MS: &str = "x-mock-chunk-delay-ms";
pub const OUTPUT_TOKENS: &str = "x-mock-output-tokens";
pub const STATUS: &str = "x-mock-status";
pub const RETRY_AFTER: &str = "x-mock-retry-after";
pub const RESET_AFTER_CHUNKS: &str = "x-mock-reset-after-chunks";
pub const USAGE: &str = "x-mock-usage";
pub const SSE_NEWLINE: &str = "x-mock-sse-newline";
pub const CACHED_TOKENS: &str = "x-mock-cached-tokens";
pub const CACHE_CREATION_TOKENS: &str = "x-mock-cache-creation-tokens";
pub const REASONING_TOKENS: &str = "x-mock-reasoning-tokens";
pub const CACHE_COUNTING: &str = "x-mock-cache-counting";
/// Not a behaviour: recorded in `/stats` `tags`, in arrival order.
pub const TAG: &str = "x-mock-tag";

/// Output longer than this would only exhaust the mock's memory.
const MAX_OUTPUT_TOKENS: u64 = 1_000_000;

/// How the `usage` numbers of a response are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UsageMode {
    /// Real counts.
    #[default]
    Normal,
    /// No usage at all.
    Missing,
    /// Usage present, with strings where numbers belong.
    Garbage,
    /// Negated counts.
    Negative,
    /// Counts around 1e15.
    Huge,
}

/// The line end of streamed SSE events (the SSE spec allows all three).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Newline {
    #[default]
    Lf,
    CrLf,
    Cr,
    /// CRLF, with every frame boundary between a CR and its LF.
    CrLfSplit,
}

#[derive(Debug, Clone, Default)]
pub struct Knobs {
    /// Delay before the response headers.
    pub latency: Duration,
    /// Delay between stream chunks.
    pub chunk_delay: Duration,
    pub output_tokens: Option<u64>,
    /// `x-mock-output-tokens: allowed`: generate all the server allows,
    /// i.e. the limit field it obeys, else what the context leaves.
    pub generate_allowed: bool,
    /// Answer with this error status instead of a completion.
    pub status: Option<StatusCode>,
    pub retry_after: Option<HeaderValue>,
    /// Reset the connection after this many stream chunks.
    pub reset_after_chunks: Option<usize>,
    pub usage: UsageMode,
    pub sse_newline: Newline,
    /// Prompt tokens served from the prefix cache, reasoning tokens inside
    /// the output, and the cache counting of older Ollama.
    pub details: crate::usage::Details,
}

/// A knob whose value cannot be used; the message names the knob.
#[derive(Debug)]
pub struct KnobError(pub String);

impl Knobs {
    pub fn parse(headers: &HeaderMap, query: &HashMap<String, String>) -> Result<Self, KnobError> {
        let get = |name: &str| -> Result<Option<String>, KnobError> {
            match headers.get(name) {
                Some(v) => v
                    .to_str()
                    .map(|s| Some(s.trim().to_owned()))
                    .map_err(|_| KnobError(format!("{name}: value is not visible ASCII"))),
                None => Ok(query.get(name).map(|s| s.trim().to_owned())),
            }
        };
        let number = |name: &str| -> Result<Option<u64>, KnobError> {
            get(name)?
                .map(|s| {
                    s.parse::<u64>().map_err(|_| {
                        KnobError(format!(
                            "{name}: expected a non-negative integer, got {s:?}"
                        ))
                    })
                })
                .transpose()
        };

        let generate_allowed = get(OUTPUT_TOKENS)?.as_deref() == Some("allowed");
        let output_tokens = if generate_allowed {
            None
        } else {
            number(OUTPUT_TOKENS)?
        };
        if let Some(n) = output_tokens {
            if n > MAX_OUTPUT_TOKENS {
                return Err(KnobError(format!(
                    "{OUTPUT_TOKENS}: at most {MAX_OUTPUT_TOKENS}, got {n}"
                )));
            }
        }
        let status = number(STATUS)?
            .map(|n| {
                u16::try_from(n)
                    .ok()
                    .and_then(|n| StatusCode::from_u16(n).ok())
                    .ok_or_else(|| KnobError(format!("{STATUS}: {n} is not an HTTP status")))
            })
            .transpose()?
            // Only error statuses replace the answer; 1xx-3xx are ignored.
            .filter(|s| s.is_client_error() || s.is_server_error());
        let retry_after = get(RETRY_AFTER)?
            .map(|s| {
                HeaderValue::from_str(&s)
                    .map_err(|_| KnobError(format!("{RETRY_AFTER}: not a header value")))
            })
            .transpose()?;
        let reset_after_chunks =
            number(RESET_AFTER_CHUNKS)?.map(|n| usize::try_from(n).unwrap_or(usize::MAX));
        let usage = match get(USAGE)?.as_deref() {
            None | Some("normal") => UsageMode::Normal,
            Some("missing") => UsageMode::Missing,
            Some("garbage") => UsageMode::Garbage,
            Some("negative") => UsageMode::Negative,
            Some("huge") => UsageMode::Huge,
            Some(other) => {
                return Err(KnobError(format!(
                    "{USAGE}: expected normal, missing, garbage, negative or huge, got {other:?}"
                )))
            }
        };
        let sse_newline = match get(SSE_NEWLINE)?.as_deref() {
            None | Some("lf") => Newline::Lf,
            Some("crlf") => Newline::CrLf,
            Some("cr") => Newline::Cr,
            Some("crlf-split") => Newline::CrLfSplit,
            Some(other) => {
                return Err(KnobError(format!(
                    "{SSE_NEWLINE}: expected lf, crlf, cr or crlf-split, got {other:?}"
                )))
            }
        };

        let ollama_uncounted_cache = match get(CACHE_COUNTING)?.as_deref() {
            None | Some("included") => false,
            Some("excluded") => true,
            Some(other) => {
                return Err(KnobError(format!(
                    "{CACHE_COUNTING}: expected included or excluded, got {other:?}"
                )))
            }
        };
        let details = crate::usage::Details {
            cached: number(CACHED_TOKENS)?.unwrap_or(0),
            cache_write: number(CACHE_CREATION_TOKENS)?.unwrap_or(0),
            reasoning: number(REASONING_TOKENS)?.unwrap_or(0),
            ollama_uncounted_cache,
        };

        Ok(Knobs {
            generate_allowed,
            details,
            latency: Duration::from_millis(number(LATENCY_MS)?.unwrap_or(0)),
            chunk_delay: Duration::from_millis(number(CHUNK_DELAY_MS)?.unwrap_or(0)),
            output_tokens,
            status,
            retry_after,
            reset_after_chunks,
            usage,
            sse_newline,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(
        headers: &[(&'static str, &'static str)],
        query: &[(&str, &str)],
    ) -> Result<Knobs, KnobError> {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(*k, HeaderValue::from_static(v));
        }
        let q = query
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Knobs::parse(&h, &q)
    }

    #[test]
    fn header_wins_over_query() {
        let k = parse(
            &[(OUTPUT_TOKENS, "3")],
            &[(OUTPUT_TOKENS, "9"), (LATENCY_MS, "20")],
        )
        .unwrap();
        assert_eq!(k.output_tokens, Some(3));
        assert_eq!(k.latency, Duration::from_millis(20));
    }

    #[test]
    fn parses_every_knob() {
        let k = parse(
            &[
                (STATUS, "429"),
                (RETRY_AFTER, "7"),
                (RESET_AFTER_CHUNKS, "2"),
                (USAGE, "huge"),
                (CHUNK_DELAY_MS, "5"),
                (SSE_NEWLINE, "crlf-split"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(k.status, Some(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(k.retry_after, Some(HeaderValue::from_static("7")));
        assert_eq!(k.reset_after_chunks, Some(2));
        assert_eq!(k.usage, UsageMode::Huge);
        assert_eq!(k.chunk_delay, Duration::from_millis(5));
        assert_eq!(k.sse_newline, Newline::CrLfSplit);
    }

    #[test]
    fn success_status_is_ignored_and_bad_values_are_named() {
        assert_eq!(parse(&[(STATUS, "200")], &[]).unwrap().status, None);
        let err = parse(&[(STATUS, "abc")], &[]).unwrap_err();
        assert!(err.0.contains(STATUS), "{}", err.0);
        let err = parse(&[], &[(USAGE, "weird")]).unwrap_err();
        assert!(err.0.contains(USAGE), "{}", err.0);
        let err = parse(&[(SSE_NEWLINE, "nel")], &[]).unwrap_err();
        assert!(err.0.contains(SSE_NEWLINE), "{}", err.0);
        let err = parse(&[(CACHED_TOKENS, "-1")], &[]).unwrap_err();
        assert!(err.0.contains(CACHED_TOKENS), "{}", err.0);
        let err = parse(&[(CACHE_COUNTING, "maybe")], &[]).unwrap_err();
        assert!(err.0.contains(CACHE_COUNTING), "{}", err.0);
    }

    #[test]
    fn allowed_and_detail_knobs() {
        let k = parse(
            &[(OUTPUT_TOKENS, "allowed"), (CACHED_TOKENS, "7")],
            &[(REASONING_TOKENS, "2"), (CACHE_COUNTING, "excluded")],
        )
        .unwrap();
        assert!(k.generate_allowed);
        assert_eq!(k.output_tokens, None);
        assert_eq!(k.details.cached, 7);
        assert_eq!(k.details.reasoning, 2);
        assert!(k.details.ollama_uncounted_cache);
    }
}
