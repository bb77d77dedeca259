//! The messages the filter (wasm) and the sidecar (native) exchange over
//! HTTP, defined once and used by both crates: a field renamed here is
//! renamed on both sides, and a state is an enum on both sides, never a
//! string compared with a literal; a header name or an error code is a
//! constant here, spelled once. Serde only: this crate builds for
//! wasm32-wasip1 and natively, and holds no logic beyond (de)serialising.
#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod cache;
pub mod fleet;
pub mod state;
