//! sluice: admission control for LLM traffic, as an Envoy proxy-wasm filter.
//!
//! The request path (SPEC §2) is [`engine`]: identity ([`principal`]) →
//! demand ([`request`]) → admission ([`reservation`] over [`bucket`]s in
//! shared data) → answer ([`answer`]). Everything but [`shim`] is pure and
//! tested natively; [`shim`] is the thin proxy-wasm adapter, built only for
//! wasm32.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod anomaly;
pub mod answer;
pub mod bucket;
pub mod config;
pub mod engine;
pub mod estimate;
pub mod health;
pub mod metrics;
pub mod principal;
mod proto_struct;
mod pushback;
pub mod reconcile;
pub mod request;
pub mod reservation;
pub mod store;
pub mod units;

#[cfg(target_arch = "wasm32")]
mod shim;
