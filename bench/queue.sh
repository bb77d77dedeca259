#!/usr/bin/env bash
# Queue bench (issue #12): wake-up latency (a slot frees at the upstream ->
# the next queued request reaches it) p50/p99 and upstream utilisation while
# a backlog exists, Envoy --concurrency 4, a model with concurrency 4,
# QUEUE_BENCH_REQUESTS (default 400) requests of 50 ms from 16 tenants at once.
# mock-llm measures both (its /admin/stats: refill_gap_ms, seconds_at_level).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --target wasm32-wasip1 -p sluice-filter
cargo build --release -p mock-llm
cargo test --release -p sluice-tests --test integration queue::bench_wakeup_and_utilisation \
  -- --ignored --nocapture 2>&1 | grep -E '^queue bench|test result'
