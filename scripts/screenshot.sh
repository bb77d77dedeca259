#!/usr/bin/env bash
# `make screenshot`: docs/src/operator-page.png, the operator page as `make demo`
# shows it. Starts the demo (scripts/demo.sh: mock-llm, the sidecar with its
# simulated GPU, Envoy), sends it a minute of mixed traffic and GPU load
# (POST /v1/simulate, as an operator would), and takes the page with headless
# Chromium (Debian `chromium`; `make browser` installs it). Stops the demo.
# Needs the demo's ports free (8000, 8001, 9911, 10000, 9901).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-docs/src/operator-page.png}
chromium=$(command -v chromium || command -v chromium-browser || true)
[ -n "$chromium" ] || { echo "screenshot: no chromium (make browser installs it)" >&2; exit 1; }
logs=target/demo
mkdir -p "$logs"

# The demo takes its admin token from here (else it makes a random one).
export SLUICE_ADMIN_TOKEN
SLUICE_ADMIN_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
./scripts/demo.sh >"$logs/screenshot-demo.log" 2>&1 &
demo=$!
stop() { kill "$demo" 2>/dev/null || true; wait "$demo" 2>/dev/null || true; }
trap stop EXIT

for _ in $(seq 1 300); do
  curl -s -m 1 http://127.0.0.1:9901/ready 2>/dev/null | grep -q LIVE && break
  kill -0 "$demo" 2>/dev/null || { cat "$logs/screenshot-demo.log" >&2; exit 1; }
  sleep 0.2
done
curl -s -m 1 http://127.0.0.1:9911/healthz >/dev/null || { echo "screenshot: the demo did not come up" >&2; exit 1; }

token=$SLUICE_ADMIN_TOKEN
simulate() {
  curl -s -o /dev/null -H "authorization: Bearer $token" -H 'content-type: application/json' \
    http://127.0.0.1:9911/v1/simulate -d "{\"gpus\": [
      {\"name\": \"Simulated H100 80GB\", \"utilization\": $1, \"memory_used_mb\": $2, \"memory_total_mb\": 81920, \"temperature_c\": $3, \"power_w\": $4},
      {\"name\": \"Simulated H100 80GB\", \"utilization\": $5, \"memory_used_mb\": 30000, \"memory_total_mb\": 81920, \"temperature_c\": 48, \"power_w\": 210}]}"
}
chat() {
  curl -s -o /dev/null -H "x-api-key: $1" http://127.0.0.1:10000/v1/chat/completions \
    -d "{\"model\":\"$2\",\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}],\"max_tokens\":16}" || true
}

# Ninety seconds of traffic: pro and enterprise keys admitted, the free tier
# over its 10/min (refused), llama3.1:70b over its 5/min (refused); GPU 0
# climbing past the breaker's 90 % long enough to open it (30 s), then
# cooling down so it closes again (the timeline shows both).
echo "screenshot: sending ninety seconds of traffic and GPU load to the demo"
for step in $(seq 1 40); do
  util=$(( step < 9 ? 40 + step * 6 : (step < 29 ? 97 : 55) ))
  simulate "$util" $((40000 + step * 1000)) $((50 + step / 2)) $((250 + util * 3)) $((20 + step))
  chat demo-pro-key llama3.1:8b
  chat demo-enterprise-key mistral:7b
  chat demo-free-key llama3.1:8b
  chat demo-pro-key llama3.1:70b
  chat demo-search-key-1 llama3.1:70b
  sleep 2
done
# The page's charts, per-tier counts and money refresh every 5 s and 10 s.
sleep 12

# --virtual-time-budget lets the page's script fetch /v1/history and draw.
"$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars \
  --window-size=1280,2400 --virtual-time-budget=8000 \
  --screenshot="$out" http://127.0.0.1:9911/ >"$logs/screenshot-chromium.log" 2>&1
echo "screenshot: wrote $out"
