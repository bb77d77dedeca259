//! What the filter keeps in Envoy and how: the shared-data store with
//! compare-and-swap, and the one codec every record goes through.

pub mod codec;
pub mod store;
