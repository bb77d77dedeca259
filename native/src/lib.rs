//! sluice as an Envoy dynamic module (issue 32, prototype): the native
//! `.so` Envoy 1.40 loads through its C ABI, running the same policy core
//! as the wasm filter.
//!
//! This crate decides nothing. `abi` holds every `unsafe` line: the
//! declarations of the Envoy callbacks it uses and the exported event
//! hooks, each behind `catch_unwind`. `filter` implements the core's
//! `Host` trait on top of it in safe code and forwards each hook to
//! the core (`Poller`, `Request`), as the wasm filter's shim does. `load` decides
//! what policy the module accepts: one it can run, loaded by the core as
//! the wasm host loads it. `log_lines` takes the core's `log` lines to
//! Envoy's log.

#![deny(unsafe_code)]

mod abi;
mod filter;
mod load;
mod log_lines;
