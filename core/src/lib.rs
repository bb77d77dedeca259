//! sluice's policy core: admission control for LLM traffic, with no proxy
//! dependency. A host (the proxy-wasm filter in `filter/`, the native
//! module in `native/`) implements [`Host`] and forwards each proxy event
//! to a [`Poller`] (the root) or a [`Request`] (a stream); everything that
//! is decided is decided here.
//!
//! The front door is this file: the names re-exported below are what the
//! hosts and the sidecar use, and [`fleet_contract`] is what the sidecar
//! shares with the filter's fleet gate. The folders are the crate's own;
//! benches and tests that measure inside reach them through the hidden
//! `bench` module.
//!
//! One folder per layer; each imports only the layers below it (the order
//! is declared once, in `tests/tests/layers.rs`, which fails on an import
//! that points up or on a cycle):
//!
//! - `flow` — one method per Envoy event (root, stream, the pre-check
//!   before the body, waiting, fleet slots, failover, the cache's lookup and
//!   store, the audit record, the stats a policy load defines), driving the
//!   layers below against the `Host` trait;
//! - `fleet` — the fleet's leases from Redis through the sidecar;
//! - `admission` — every decision that produces a verdict: identity,
//!   compile, admit, the refusal before the body, rewrite, settle, penalty
//!   box, route health and the ladder, answers;
//! - `cache` — the response cache: keys, storable and rendered answers,
//!   the exact tier in shared data; [`fleet_contract`] — the fleet's
//!   buckets, slots, fingerprint and window ends, from the policy alone;
//! - `queue`, `limits`, `usage`, `host` — the queue's places; bucket
//!   arithmetic and reservations; demand, estimate, reconcile; the `Host`
//!   trait and the mock host;
//! - `state` — the shared-data store and the one codec;
//! - `policy` — the policy model and its checks, importing nothing else.
//!
//! The host is the seam: the wasm filter (crate `sluice-filter`) implements
//! `Host` with proxy-wasm hostcalls; the tests drive the whole path through
//! the mock host (`host/mock.rs`), a deterministic host with a settable clock.
#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

// Public (hidden) only until `admission/route.rs` drops two re-exports
// nothing uses (`Breaker as BreakerView`, `KillSwitch`): crate-private, they
// would fail the build as unused. Reached from outside only through the
// front door below.
#[doc(hidden)]
pub mod admission;
mod cache;
mod fleet;
pub mod fleet_contract;
mod flow;
mod host;
mod limits;
mod policy;
mod queue;
mod state;
mod usage;

// The front door: what the hosts (the wasm filter, the native module) and
// the sidecar use. Everything else is the crate's own.

/// A host's root and stream contexts, and what a VM's roots share.
pub use flow::{Poller, Request, Vm};
/// Every stat the core writes (a host that declares stats by name reads
/// the table).
pub use host::metrics;
/// The trait a host implements, and what crosses it.
pub use host::{Action, Headers, Host, MetricKind};
/// Whether a bucket counts per caller or for everyone.
pub use limits::reservation::Scope;
/// The policy, its errors, and the parts the sidecar reads.
pub use policy::fleet::MIN_SECRET;
pub use policy::{ConfigError, IdentitySource, Limit, Policy};
/// Shared data: the store a host implements, and the in-memory one.
pub use state::store::{MemStore, SharedStore, StoreError};

/// What the benchmarks, the bench tools and the integration tests measure
/// or drive inside the core, reached past the front door. Not an API: it
/// follows the code.
#[doc(hidden)]
pub mod bench {
    pub use crate::admission::identity::RequestView;
    pub use crate::admission::{Engine, RequestContext, MIN_LOWERED_OUTPUT};
    #[cfg(not(target_arch = "wasm32"))]
    pub use crate::host::mock::MockHost;
    pub use crate::policy::bound::InputBound;
    pub use crate::policy::keys::sha256_hex;
    pub use crate::usage::bound::rendered;
    pub use crate::usage::demand::Api;
    pub use crate::usage::estimate::{input_tokens, text_tokens};
    pub use crate::usage::reconcile::{Format, Found, ResponseMeter, Usage};
    pub use crate::usage::splice::splice;
}

impl Policy {
    /// A policy as a host loads it: parsed and checked, then compiled once
    /// for the checks only the compiled buckets can make (a passthrough
    /// rule that opens a path sluice classifies, a `fleet.local` entry that
    /// names no bucket). The sidecar's `check-config` and its fleet agent
    /// read policies with it, so they refuse a policy exactly when Envoy
    /// would.
    pub fn load(value: serde_json::Value) -> Result<Policy, ConfigError> {
        admission::Engine::compile(Policy::from_value(value)?).map(|engine| engine.policy)
    }
}
