//! sluice as an Envoy proxy-wasm filter: the `.wasm` Envoy loads.
//!
//! This crate decides nothing. [`sluice_core`] holds every decision behind
//! its `Host` trait; `shim` (wasm32 only) implements that trait with
//! proxy-wasm hostcalls and forwards each Envoy callback to the core's
//! `flow` layer. Built natively, the crate is empty.

#[cfg(target_arch = "wasm32")]
mod shim;
