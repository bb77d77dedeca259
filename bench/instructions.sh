#!/usr/bin/env bash
# Instructions per request of the filter's whole request path, natively
# (core/examples/path_loop.rs on the mock host, under valgrind's
# callgrind): a deterministic count a loaded machine cannot blur. Only the
# filter's callbacks are counted (--toggle-collect on the harness's
# request_part and response_part, core/benches/shapes: the mock host's
# answers to them included, the harness building each request not). Each shape runs twice (N and N + 500
# requests); the difference over 500 is the per-request figure, the
# policy load and warm-up cancelled out.
# Usage: bench/instructions.sh [get post full]   (needs valgrind)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind missing: apt-get install -y valgrind" >&2; exit 1; }
cargo build -q --release -p sluice-core --example path_loop
bin=target/release/examples/path_loop
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
count() { # shape n
  valgrind --tool=callgrind --callgrind-out-file="$tmp/out" \
    --toggle-collect='*shapes::request_part' \
    --toggle-collect='*shapes::response_part' "$bin" "$1" "$2" 2>&1 \
    | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
echo "| shape | instructions per request |"
echo "|---|---:|"
for shape in "${@:-get post full}"; do
  for s in $shape; do
    a=$(count "$s" 100)
    b=$(count "$s" 600)
    echo "| $s | $(( (b - a) / 500 )) |"
  done
done
