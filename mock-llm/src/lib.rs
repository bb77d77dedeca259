//! mock-llm: a fake OpenAI- and Ollama-compatible inference server for the
//! sluice demo and for integration tests that drive a real Envoy. Like vLLM
//! it also serves `/invocations` (chat, completion or embedding by the
//! body's shape), Anthropic's `/v1/messages` (JSON and SSE), Ollama's
//! `/api/embed`, and the scoring family (`/v1/score`, `/rerank`,
//! `/pooling`, `/classify`, `/tokenize`); a prompt array is answered with
//! one choice per prompt × `n`, the usage summed over all of them.
//!
//! `--personality vllm|openai|ollama|anthropic` makes it play one real
//! server faithfully (see [`personality`]); the default, `mock`, serves
//! everything and reads every limit field.
//!
//! Answers are deterministic (see [`tokens`] for the token rule) and bent
//! per request by the knobs in [`knobs`]. `/admin/stats` shows what reached
//! the server; `/metrics` speaks vLLM's Prometheus names. A server-wide
//! scripted fault ([`fault`], `--fault` or `PUT /admin/fault`) makes the
//! whole process fail in one chosen way, whatever the request says.

pub mod embed;
pub mod fault;
pub mod framing;
pub mod generate;
pub mod go_json;
pub mod knobs;
pub mod load;
pub mod metrics;
pub mod personality;
pub mod stats;
pub mod store;
pub mod tokens;
pub mod usage;

mod anthropic;
mod ollama;
mod openai;
mod pooling;
mod server;

use std::sync::{Mutex, MutexGuard, PoisonError};

pub use personality::Personality;
pub use server::{app, serve, Config, DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL};

/// Locks a mutex; a panic elsewhere leaves plain counters usable, so a
/// poisoned lock is taken over rather than propagated.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
