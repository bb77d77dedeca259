#!/usr/bin/env bash
# Body attack bench (issue 18, item 3): an unrelated caller's p50/p99 while
# a spent key sends 1 MB `/v1/embeddings` bodies (`[[1],[1],…]`) on 4
# connections, Envoy --concurrency 2, the shipped policy. Runs this build
# and, with BASE_WASM=path (e.g. today's main's
# target/wasm32-wasip1/release/sluice_filter.wasm), that build too.
# BODY_ATTACK_SECS (default 10) per measurement; BODY_ATTACK_RATES (default
# "39 0"): bodies/s of the 4 connections together, 0 = as fast as answered;
# BODY_ATTACKER=room: the attacking key is not spent (its bodies are read and
# refused 400 at the parse bounds).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --target wasm32-wasip1 -p sluice-filter
cargo build --release -p mock-llm
run() {
  for rate in ${BODY_ATTACK_RATES:-39 0}; do
    SLUICE_BENCH_LABEL="$1" SLUICE_BENCH_WASM="${2:-}" SLUICE_BENCH_SECS="${BODY_ATTACK_SECS:-10}" \
      SLUICE_BENCH_RATE="$rate" SLUICE_BENCH_ATTACKER="${BODY_ATTACKER:-spent}" cargo test -p sluice-tests --test integration penalty::bench_body_attack \
      -- --ignored --nocapture 2>&1 | grep -E '^body attack|panicked'
  done
}
if [ -n "${BASE_WASM:-}" ]; then
  run "base ($BASE_WASM)" "$(realpath "$BASE_WASM")"
fi
run "this build" ""
