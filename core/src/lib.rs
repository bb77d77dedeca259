//! sluice's policy core: admission control for LLM traffic, with no proxy
//! dependency. A host (the proxy-wasm filter in `filter/`) implements
//! [`host::Host`] and forwards each proxy event to [`flow`]; everything
//! that is decided is decided here.
//!
//! One folder per layer; each imports only the layers below it (the order
//! is declared once, in `tests/tests/layers.rs`, which fails on an import
//! that points up or on a cycle):
//!
//! - [`flow`] — one method per Envoy event (root, stream, the pre-check
//!   before the body, waiting, fleet slots, failover, the cache's lookup and
//!   store, the audit record, the stats a policy load defines), driving the
//!   layers below against the [`host::Host`] trait;
//! - [`fleet`] — the fleet's leases from Redis through the sidecar;
//! - [`admission`] — every decision that produces a verdict: identity,
//!   compile, admit, the refusal before the body, rewrite, settle, penalty
//!   box, route health and the ladder, answers;
//! - [`cache`] — the response cache: keys, storable and rendered answers,
//!   the exact tier in shared data;
//! - [`queue`], [`limits`], [`usage`], [`host`] — the queue's places; bucket
//!   arithmetic and reservations; demand, estimate, reconcile; the `Host`
//!   trait and the mock host;
//! - [`state`] — the shared-data store and the one codec;
//! - [`policy`] — the policy model and its checks, importing nothing else.
//!
//! The host is the seam: the wasm filter (crate `sluice-filter`) implements
//! `Host` with proxy-wasm hostcalls; the tests drive the whole path through
//! [`host::mock::MockHost`], a deterministic host with a settable clock.
#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod admission;
pub mod cache;
pub mod fleet;
pub mod fleet_contract;
pub mod flow;
pub mod host;
pub mod limits;
pub mod policy;
pub mod queue;
pub mod state;
pub mod usage;
