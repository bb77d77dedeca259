//! Every integration test of sluice, one module per file, in one test
//! binary: they share one build and one pool of test threads (`make test`
//! sets how many). Run one file's tests with its module name as the filter,
//! e.g. `cargo test -p sluice-tests --test integration -- pushback::`.
//!
//! A file added to this folder is compiled only once it is named here;
//! `harness_smoke::every_test_file_is_a_module_of_the_binary` fails until
//! it is.

mod admission;
mod audit_record;
mod bench_smoke;
mod bounded;
mod cache;
mod cache_ops;
mod cache_tier;
mod cache_worth;
mod clients;
mod config_reload;
mod conformance;
mod dcgm;
mod declared_apis;
mod deploy;
mod docs;
mod endpoints;
mod failover;
mod fairness;
mod fleet;
mod fleet_trust;
mod flood;
mod harness_smoke;
mod hostile;
mod identity;
mod instructions;
mod layers;
mod limits_endpoint;
mod llamacpp;
mod model_names;
mod native;
mod observability;
mod operator_page;
mod org;
mod output_limits;
mod parsing;
mod penalty;
mod provider_faults;
mod provider_pushback;
mod pushback;
mod queue;
mod queue_fairness;
mod ratelimit_headers;
mod retry_signals;
mod run_budgets;
mod server_timing;
mod sidecar;
mod sidecar_door;
mod sidecar_faults;
mod sidecar_heads;
mod third_party;
mod tokens;
mod usage_details;
mod worker_leases;
