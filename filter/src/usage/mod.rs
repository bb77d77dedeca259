//! What a request costs: its demand (the parsed body), the estimate of its
//! tokens, the reconciliation with the real usage, and usage anomalies.

pub mod anomaly;
/// The response cache's keys and the answers it stores and renders (SPEC §9).
pub mod cache_answer;
pub mod cache_key;
pub mod cache_tier;
pub mod demand;
pub mod estimate;
pub mod output_limit;
pub mod reconcile;
pub mod spelling;
