//! The response cache (docs/src/design.md, "Response cache"): the keys a
//! request is looked up by, which answers may be stored and how a hit is
//! written back, and the exact tier inside Envoy. The request path that
//! drives it is `flow/cache.rs`; the policy's `cache:` section is
//! `policy/cache.rs`.

pub mod answer;
pub mod key;
pub mod tier;
