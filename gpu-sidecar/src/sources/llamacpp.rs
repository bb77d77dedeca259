//! llama.cpp's server (`llama-server --metrics`) `/metrics`: its queue, what
//! it is decoding, and its KV cache where the build still says.
//!
//! The names are llama.cpp's (`tools/server/server-task.cpp`,
//! `server_task_result_metrics::to_metrics`: every name is prefixed
//! `llamacpp:`, one gauge a line, no labels):
//! - `llamacpp:requests_deferred`: requests waiting for a free slot. It
//!   feeds `vllm_waiting`, the queue rules watch (the default rule: 50).
//! - `llamacpp:requests_processing`: slots busy with a request. It feeds
//!   `vllm_running`.
//! - `llamacpp:kv_cache_usage_ratio` (0–1): feeds `kv_cache`. llama.cpp
//!   removed it from `/metrics` (ggml-org/llama.cpp#13660, May 2025) along
//!   with `kv_cache_tokens`; builds before that have it, later ones do not,
//!   so a missing gauge feeds nothing rather than a 0 that looks healthy.
//!
//! The breaker metrics keep vLLM's names because they are the same signals
//! (requests queued, requests running, KV cache used) and one rule covers
//! both servers. A server started without `--metrics` answers 501: the
//! scrape fails and the scope goes stale, as for any dead source.

use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::prom;
use super::{BackendReading, BackendSource, SourceError};
use crate::breaker::Metric;
use crate::http::{self, Target};

const DEFERRED: &str = "llamacpp:requests_deferred";
const PROCESSING: &str = "llamacpp:requests_processing";
const KV_CACHE: &str = "llamacpp:kv_cache_usage_ratio";

/// Which llama.cpp gauge feeds which breaker metric, in that order.
const GAUGES: [(&str, Metric); 3] = [
    (DEFERRED, Metric::VllmWaiting),
    (PROCESSING, Metric::VllmRunning),
    (KV_CACHE, Metric::KvCache),
];

/// The breaker samples in one scrape's text: each gauge that is there with
/// a finite value (summed, should a build ever label them per model).
pub fn samples(text: &str) -> Vec<(Metric, f64)> {
    let parsed = prom::parse(text);
    GAUGES
        .iter()
        .filter_map(|&(name, metric)| {
            let value = parsed
                .iter()
                .filter(|s| s.name == name && s.value.is_finite())
                .map(|s| s.value)
                .reduce(|a, b| a + b)?;
            Some((metric, value))
        })
        .collect()
}

/// Scrapes one llama.cpp server.
pub struct LlamaCppSource {
    name: String,
    target: Target,
    timeout: Duration,
}

impl LlamaCppSource {
    pub fn new(name: String, base: &Target, timeout: Duration) -> Self {
        LlamaCppSource {
            name,
            target: base.join("/metrics"),
            timeout,
        }
    }
}

impl BackendSource for LlamaCppSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        "llamacpp"
    }

    fn poll(&mut self, _at: Instant) -> BoxFuture<'_, Result<BackendReading, SourceError>> {
        Box::pin(async move {
            let body = http::get(&self.target, self.timeout).await?;
            let text = String::from_utf8_lossy(&body);
            let samples = samples(&text);
            // Not llama.cpp's /metrics (another server on the port, a
            // proxy's page): no data, so the scope goes stale, not healthy.
            if samples.is_empty() {
                return Err(SourceError::Other(format!(
                    "http://{}{} has neither {DEFERRED} nor {PROCESSING}",
                    self.target.authority, self.target.path_and_query
                )));
            }
            Ok(BackendReading {
                samples,
                models: Vec::new(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scraped from the pinned server (xllamacpp 2026.10.11549, SmolLM2,
    /// `--metrics`, 2 slots) with four requests in flight: two decoding,
    /// two waiting for a slot. Verbatim.
    const SCRAPED: &str = "\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 62
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 144
# HELP llamacpp:prompt_seconds_total Total time spent processing prompts
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 11.2676
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 31
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 11.7515
# HELP llamacpp:n_decode_total Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 32
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 49
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 0
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 0
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 0
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2.42421
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 0
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1
";

    #[test]
    fn the_pinned_servers_scrape_feeds_the_queue_and_running_but_no_kv_cache() {
        assert_eq!(
            samples(SCRAPED),
            vec![(Metric::VllmWaiting, 2.0), (Metric::VllmRunning, 2.0)]
        );
    }

    #[test]
    fn an_older_build_with_the_kv_cache_gauge_feeds_it() {
        // Builds before ggml-org/llama.cpp#13660 printed these two lines too.
        let text = format!(
            "{SCRAPED}# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.\n\
             # TYPE llamacpp:kv_cache_usage_ratio gauge\n\
             llamacpp:kv_cache_usage_ratio 0.93\n\
             llamacpp:kv_cache_tokens 1904\n"
        );
        assert_eq!(
            samples(&text),
            vec![
                (Metric::VllmWaiting, 2.0),
                (Metric::VllmRunning, 2.0),
                (Metric::KvCache, 0.93)
            ]
        );
    }

    #[test]
    fn other_servers_and_nan_feed_nothing() {
        // vLLM's names are not llama.cpp's; a NaN is no reading.
        let text = "vllm:num_requests_waiting 7\nllamacpp:requests_deferred NaN\n";
        assert!(samples(text).is_empty());
        assert!(samples("").is_empty());
        // An idle server reads 0 (a reading, not a missing one).
        assert_eq!(
            samples("llamacpp:requests_deferred 0\nllamacpp:requests_processing 0\n"),
            vec![(Metric::VllmWaiting, 0.0), (Metric::VllmRunning, 0.0)]
        );
    }
}
