#!/usr/bin/env bash
# Failover bench: the time to rescue a request from a dead primary (connect
# refused) with the shipped envoy/sluice.yaml, against a healthy primary
# measured in the same run (tests/tests/provider_faults.rs,
# bench_time_to_rescue_a_dead_primary). Prints a table; also written to
# target/failover-bench.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --target wasm32-wasip1 -p sluice-filter
cargo build --release -p mock-llm
cargo test -p sluice-tests --test integration provider_faults::bench_time_to_rescue_a_dead_primary \
  -- --ignored --nocapture 2>&1 | grep -vE '^(running|test |$)'
