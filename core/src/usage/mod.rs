//! What a request costs: its demand (the parsed body), the estimate of its
//! tokens, the reconciliation with the real usage, and usage anomalies.

pub mod anomaly;
/// The response cache's keys and stored answers (docs/design.md, "Response cache").
pub mod cache_answer;
pub mod cache_key;
pub mod cache_tier;
pub mod demand;
pub mod estimate;
pub mod output_limit;
pub mod reconcile;
pub mod spelling;
