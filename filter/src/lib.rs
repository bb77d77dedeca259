//! sluice as an Envoy proxy-wasm filter: the `.wasm` Envoy loads.
//!
//! This crate decides nothing. [`sluice_core`] holds every decision behind
//! its `Host` trait; `shim` (wasm32 only) implements that trait with
//! proxy-wasm hostcalls and forwards each Envoy callback to the core's
//! `flow` layer. Built natively, the crate holds only `map`
//! (the header map's reader), `pool` (the VM's allocator) and their
//! tests.

// The header map's reader is plain Rust, so its tests run natively.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
mod map;
// The VM's allocator; plain Rust, so its tests run natively too.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
mod pool;
#[cfg(target_arch = "wasm32")]
mod shim;

#[cfg(target_arch = "wasm32")]
#[global_allocator]
static ALLOCATOR: pool::Pool = pool::Pool::new();
