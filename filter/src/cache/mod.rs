//! The response cache's filter side (SPEC §9), pure: the `cache:` policy
//! ([`policy`]), the keys ([`key`]: exact, and the semantic context), and
//! the answers ([`answer`]: what may be stored, `Cache-Control`, rendering
//! a hit as JSON, SSE or NDJSON). It imports nothing else of the crate and
//! touches no host: the request path calls it, the sidecar holds the
//! entries (`sluice_wire::cache` is the channel between them).
//!
//! The isolation rule: every key and every semantic context hash includes
//! the scope's value (the principal by default), so an entry is found only
//! by a request of the same scope; the sidecar sees only salted hashes.

pub mod answer;
pub mod key;
pub mod policy;
