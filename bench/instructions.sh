#!/usr/bin/env bash
# Instructions per request of the filter's whole request path, natively
# (core/examples/path_loop.rs on the mock host, under valgrind's
# callgrind): a deterministic count a loaded machine cannot blur. Only the
# filter's callbacks are counted (--toggle-collect on the harness's
# request_part and response_part, core/benches/shapes: the mock host's
# answers to them included, the harness building each request not). Each shape runs twice (N and N + 500
# requests); the difference over 500 is the per-request figure, the
# policy load and warm-up cancelled out.
#
# The second column splits off what the mock host itself runs to answer
# (every `MockHost as Host`/`SharedStore` method, inclusive: its maps, its
# call counting, its copies). In Envoy that work is the host's, outside
# the wasm VM, and costs what Envoy's own code costs; the third column,
# the rest, is the filter's own code.
# Usage: bench/instructions.sh [get post full]   (needs valgrind)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind missing: apt-get install -y valgrind" >&2; exit 1; }
cargo build -q --release -p sluice-core --example path_loop
bin=target/release/examples/path_loop
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
count() { # shape n: total instructions, then the mock host's (inclusive)
  valgrind --tool=callgrind --callgrind-out-file="$tmp/$1.$2" \
    --toggle-collect='*shapes::request_part' \
    --toggle-collect='*shapes::response_part' "$bin" "$1" "$2" 2>&1 \
    | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
  callgrind_annotate --inclusive=yes --threshold=100 "$tmp/$1.$2" 2>/dev/null \
    | awk '/MockHost as / { gsub(",", "", $1); s += $1 } END { print s + 0 }'
}
echo "| shape | instructions per request | of which the mock host's answers | the filter's own |"
echo "|---|---:|---:|---:|"
for shape in "${@:-get post full}"; do
  for s in $shape; do
    read -r -d '' a am < <(count "$s" 100) || true
    read -r -d '' b bm < <(count "$s" 600) || true
    total=$(( (b - a) / 500 ))
    mock=$(( (bm - am) / 500 ))
    echo "| $s | $total | $mock | $(( total - mock )) |"
  done
done
