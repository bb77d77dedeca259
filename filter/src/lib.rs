//! sluice: admission control for LLM traffic, as an Envoy proxy-wasm filter.
//!
//! The request path (SPEC §2) is [`engine`]: identity ([`principal`]) →
//! demand ([`request`]) → admission ([`reservation`] over [`bucket`]s in
//! shared data) → answer ([`answer`]). [`flow`] drives it, one method per
//! Envoy event, against the [`host::Host`] trait; everything but `shim` is
//! tested natively (the whole path through [`host::mock::MockHost`]).
//! `shim` only implements `Host` with proxy-wasm hostcalls and forwards
//! callbacks; it is built only for wasm32.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod abuse;
pub mod anomaly;
pub mod answer;
pub mod bucket;
pub mod cache;
pub mod codec;
pub mod config;
pub mod engine;
pub mod estimate;
pub mod fleet;
pub mod flow;
pub mod health;
pub mod host;
pub mod metrics;
pub mod passthrough;
pub mod principal;
mod proto_struct;
mod pushback;
pub mod queue;
pub mod reconcile;
pub mod request;
pub mod reservation;
pub mod shares;
pub mod store;
pub mod units;
pub mod zone;

#[cfg(target_arch = "wasm32")]
mod shim;
