//! What a request costs: its demand (the parsed body), the estimate of its
//! tokens, the reconciliation with the real usage, and usage anomalies.

pub mod anomaly;
pub mod bound;
pub mod declared;
pub mod demand;
pub mod estimate;
pub mod output_limit;
pub mod reconcile;
pub mod shared;
pub mod spelling;
pub mod splice;
pub mod tape;
pub mod view;
