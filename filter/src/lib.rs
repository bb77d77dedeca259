//! sluice as an Envoy proxy-wasm filter: the `.wasm` Envoy loads.
//!
//! This crate decides nothing. [`sluice_core`] holds every decision behind
//! its `Host` trait; `shim` (wasm32 only) implements that trait with
//! proxy-wasm hostcalls and forwards each Envoy callback to the core's
//! `flow` layer. Built natively, the crate holds only `map`
//! (the header map's reader) and its tests.

// The header map's reader is plain Rust, so its tests run natively.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
mod map;
#[cfg(target_arch = "wasm32")]
mod shim;
