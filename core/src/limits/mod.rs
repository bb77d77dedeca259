//! Bucket arithmetic and reservations: how much a caller may take, all or
//! nothing, and the fair shares of common buckets.

pub mod bucket;
pub mod lease;
pub mod record;
pub mod reservation;
pub mod run_table;
pub mod runs;
pub mod shares;
pub mod slot_table;
