#!/usr/bin/env python3
"""A long soak with every feature on (issue 29, item 15): does Envoy's memory
grow with the requests it serves, or plateau?

    make soak                                  # 25 minutes, target/bench/soak.md
    python3 bench/soak.py --duration 120       # two minutes
    python3 bench/soak.py --smoke              # seconds: checks the script, not figures
    python3 bench/soak.py --features cache,reload   # bisect: only some of the mix

The stack is the shipped one (envoy/sluice.yaml, jwt_authn + sluice, two
workers) with its policy plus what `make demo` and `make demo-fleet` add:
the exact cache on llama3.1:8b and exact + semantic on mistral:7b
(embeddings from mock-llm), a cache salt and secret, a fleet section
(Redis on loopback, a fleet salt and secret; with it, cache entries live in
Redis through the sidecar; `--features` without `fleet`: no fleet, exact
entries in Envoy's shared data, the `cache.in_envoy` tier), the queue
(mistral:7b: 2 in flight, batch and standard callers wait), the penalty box
and streaming. The listener comes from a file (LDS), so the policy can be
reloaded in the middle, as operators do (each reload closes the old
listener's connections 2 s later: `--drain-time-s 2`). The model rate
limits are raised (llama3.1:8b 6,000/min, mistral:7b 3,000/min) so the
load reaches the upstream instead of being refused at the door; every
other limit is the shipped one.

The load (--rate requests a second, --workers at once, each request on a
fresh connection): declared API keys of every tier (--keys of them),
JWT subjects (a pool and ever-new ones; a subject no key declares is
anonymous), anonymous callers by client address (loopback source addresses
127.x.y.z, ever-new ones and a pool), one flooding address at a time
(rotated every minute: the penalty box blocks it), cache repeats and
ever-new prompts, paraphrases for the semantic cache, queued requests with
deadlines (x-sluice-max-wait-ms) and clients that give up while queued,
streaming (some read to the end, some dropped mid-stream), refusals (429s of
every kind, 401 unknown keys, 400 hostile bodies, 404 unknown endpoints,
413 oversize bodies) and, every --reload-every seconds, a policy reload.
--features picks parts of the mix (bisecting a growth). --burst-every adds,
off the steady mix, bursts of big bodies at once (what a peak costs and
whether it comes back); --release-memory turns on tcmalloc's background
release in Envoy's bootstrap.

Every --sample seconds: Envoy's VmRSS (/proc/<pid>/status), the resident
part of its wasm VMs' linear memories (/proc/<pid>/smaps, see
`wasm_memories`), tcmalloc's allocated and heap bytes (admin /memory), the
number of stats; the sidecar's and Redis' VmRSS (samples.json in the work
dir also has Redis' used_memory, live wasm VMs and draining listeners).
The verdict: growth per 100,000 requests (least squares over the samples)
in the second half against the first, of Envoy's RSS, its live heap and
its wasm memories (see `report`).

Standard library only; reuses bench/run.py's process helpers.
"""

import argparse
import base64
import copy
import hashlib
import hmac
import http.client
import json
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (bench/run.py)

ROOT = run.ROOT
SIDECAR = ROOT / "target/release/sluice-sidecar"
ISSUER = "sluice-demo"  # the shipped jwt_authn provider's issuer
FEATURES = ("keys", "jwt", "anon", "flood", "cache", "semantic", "queue", "stream",
            "refuse", "reload", "fleet")
TIERS = ("free", "pro", "enterprise")
WORDS = ("invoice webhook password export ledger quota token region cluster shard "
         "backup replica tenant billing audit session cookie schema index cursor").split()


def b64(raw):
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Jwt:
    """A signing key for this run (HS256, a JWKS file jwt_authn reads) and
    tokens signed with it."""

    def __init__(self, path):
        self.key = secrets.token_bytes(32)
        path.write_text(json.dumps({"keys": [
            {"kty": "oct", "alg": "HS256", "kid": "soak", "k": b64(self.key)}]}))
        self.cache = {}

    def token(self, sub, tier):
        if (sub, tier) in self.cache:
            return self.cache[(sub, tier)]
        part = lambda o: b64(json.dumps(o, separators=(",", ":")).encode())
        head = part({"alg": "HS256", "typ": "JWT", "kid": "soak"})
        claims = part({"iss": ISSUER, "sub": sub, "tier": tier,
                       "exp": int(time.time()) + 86400})
        sig = hmac.new(self.key, f"{head}.{claims}".encode(), hashlib.sha256).digest()
        tok = f"{head}.{claims}.{b64(sig)}"
        if len(self.cache) < 4096:
            self.cache[(sub, tier)] = tok
        return tok


# ---------------------------------------------------------------------------
# The stack
# ---------------------------------------------------------------------------


def jwt_providers(v):
    """Every jwt_authn `providers` map in an Envoy config."""
    if isinstance(v, dict):
        for k, x in v.items():
            if k == "providers" and isinstance(x, dict):
                yield x
            else:
                yield from jwt_providers(x)
    elif isinstance(v, list):
        for x in v:
            yield from jwt_providers(x)


def vm_configs(v):
    if isinstance(v, dict):
        for k, x in v.items():
            if k == "vm_config":
                yield x
            else:
                yield from vm_configs(x)
    elif isinstance(v, list):
        for x in v:
            yield from vm_configs(x)


def sluice_filter(cfg):
    hcm = run._hcm(cfg)
    return run._named(hcm["http_filters"], "sluice", "http filter")["typed_config"]["config"]


def soak_policy(shipped, keys, secrets_, fleet):
    """The shipped policy with the demo's cache, the fleet (unless not
    `fleet`: then the exact entries live in Envoy's shared data, the
    `cache.in_envoy` tier), many keys and the model rate limits raised."""
    p = copy.deepcopy(run.shipped_policy(shipped))
    p["identity"]["api_key"]["keys"].update({k: t for k, t in keys})
    p["models"]["llama3.1:8b"]["requests"] = "6000/min"
    p["models"]["mistral:7b"]["requests"] = "3000/min"
    p["cache"] = {"salt": secrets_["cache_salt"], "secret_env": "SLUICE_CACHE_SECRET",
                  "models": {"llama3.1:8b": {"exact": True},
                             "mistral:7b": {"exact": True, "semantic": True}}}
    if not fleet:
        return p
    p["fleet"] = {"expected_replicas": 1, "lease": {"idle": "2s", "ttl": "30s"},
                  "on_unavailable": {"requests": "local_share", "budgets": "local_share"},
                  "salt": secrets_["fleet_salt"]}
    return p


def reloaded(policy, n):
    """The policy of reload `n`: the pro tier's rate alternates (the counts
    carry over), and the static answers change."""
    p = copy.deepcopy(policy)
    p["tiers"]["pro"]["requests"] = "60/min" if n % 2 == 0 else "61/min"
    p["static_fallback"]["answers"][f"soak reload {n % 7}"] = f"answer {n}"
    return p


class Stack:
    def __init__(self, procs, workdir, keys, workers, release_memory=0, fleet=True):
        self.workdir = workdir
        self.release_memory = release_memory
        self.secrets = {k: secrets.token_hex(24) for k in
                        ("cache_salt", "fleet_salt", "SLUICE_CACHE_SECRET",
                         "SLUICE_FLEET_SECRET")}
        env = dict(os.environ, SLUICE_CACHE_SECRET=self.secrets["SLUICE_CACHE_SECRET"],
                   SLUICE_FLEET_SECRET=self.secrets["SLUICE_FLEET_SECRET"],
                   SLUICE_ADMIN_TOKEN="soak-admin-token")
        # Redis as demo-fleet runs it, without the append-only file.
        self.redis_port = run.free_port()
        self.redis = procs.spawn("redis", [
            "redis-server", "--port", self.redis_port, "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir], workdir / "redis.log")
        run.wait_until("redis", lambda: self.redis_cmd("PING") == "PONG", 15, self.redis)
        self.mock = self.mock_llm(procs, "primary")
        self.fallback = self.mock_llm(procs, "fallback")
        self.jwt = Jwt(workdir / "jwks.json")
        shipped = run.load_shipped()
        self.policy = soak_policy(shipped, keys, self.secrets, fleet)
        self.admin_port, self.port = run.free_port(), run.free_port()
        (workdir / "policy.json").write_text(json.dumps(self.policy))
        (workdir / "sidecar.yaml").write_text(
            (f"fleet:\n  redis: redis://127.0.0.1:{self.redis_port}\n"
             f"  policy: {workdir / 'policy.json'}\n" if fleet else "") +
            f"cache:\n  embeddings: {{url: \"http://127.0.0.1:{self.mock}/v1/embeddings\", "
            f"model: mock-embed, timeout: 2s}}\n  secret_env: SLUICE_CACHE_SECRET\n")
        self.sidecar = procs.spawn("sidecar", [
            SIDECAR, "serve", "--listen", "127.0.0.1:0", "--simulate",
            "--config", workdir / "sidecar.yaml",
            "--envoy-admin", f"http://127.0.0.1:{self.admin_port}"],
            workdir / "sidecar.log", env=env)
        self.sidecar_port = run.wait_until("sidecar", lambda: self.announced("sidecar.log"),
                                           15, self.sidecar)
        self.bootstrap, self.listeners = self.envoy_config(shipped)
        self.reloads = 0
        self.write_lds(self.policy)
        (workdir / "envoy.json").write_text(json.dumps(self.bootstrap, indent=1))
        self.envoy = procs.spawn("envoy", [
            run.envoy_bin(), "-c", workdir / "envoy.json", "--disable-hot-restart",
            "--concurrency", workers, "-l", "info",
            # A reload's old listener closes its connections after 2 s.
            "--drain-strategy", "immediate", "--drain-time-s", "2"],
            workdir / "envoy.log", env=env, cwd=workdir)
        run.wait_until("Envoy", self.ready, 60, self.envoy)

    def redis_cmd(self, *args):
        r = subprocess.run(["redis-cli", "-p", str(self.redis_port), *args],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip()

    def announced(self, log):
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", (self.workdir / log).read_text())
        return int(m.group(1)) if m else None

    def mock_llm(self, procs, name):
        log = f"mock-llm-{name}.log"
        p = procs.spawn(f"mock-llm-{name}", [run.MOCK_LLM, "--listen", "127.0.0.1:0",
                                              "--name", name], self.workdir / log)
        return run.wait_until(f"mock-llm {name}", lambda: self.announced(log), 15, p)

    def envoy_config(self, shipped):
        cfg = copy.deepcopy(shipped)
        run._access_logs(cfg, True)  # the audit line is formatted, written to /dev/null
        cfg["admin"]["address"]["socket_address"]["port_value"] = self.admin_port
        clusters = cfg["static_resources"]["clusters"]
        for name, port in (("llm_upstream", self.mock), ("llm_fallback", self.fallback),
                           ("sluice_sidecar", self.sidecar_port)):
            c = run._named(clusters, name, "cluster")
            c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] = {
                "socket_address": {"address": "127.0.0.1", "port_value": port}}
        for providers in jwt_providers(cfg):
            for prov in providers.values():
                prov["local_jwks"] = {"filename": str(self.workdir / "jwks.json")}
        for vm in vm_configs(cfg):
            vm["environment_variables"] = {"host_env_keys": [
                "SLUICE_CACHE_SECRET", "SLUICE_FLEET_SECRET"]}
        run._absolutize(cfg)
        listeners = cfg["static_resources"].pop("listeners")
        listeners[0]["address"]["socket_address"]["port_value"] = self.port
        cfg["dynamic_resources"] = {"lds_config": {"resource_api_version": "V3",
                                                   "path_config_source": {
                                                       "path": str(self.workdir / "lds.json")}}}
        cfg.setdefault("node", {"id": "sluice-soak", "cluster": "sluice-soak"})
        if self.release_memory:
            cfg["memory_allocator_manager"] = {"bytes_to_release": str(self.release_memory),
                                               "memory_release_interval": "1s"}
        return cfg, listeners

    def write_lds(self, policy):
        listeners = copy.deepcopy(self.listeners)
        cfg = {"static_resources": {"listeners": listeners}}
        sluice_filter(cfg)["configuration"]["value"] = policy
        resources = [dict({"@type": "type.googleapis.com/envoy.config.listener.v3.Listener"},
                          **l) for l in listeners]
        tmp = self.workdir / "lds.json.tmp"
        tmp.write_text(json.dumps({"resources": resources}))
        os.rename(tmp, self.workdir / "lds.json")  # Envoy watches for the move
        # The sidecar checks fleet calls against the same policy (it reads
        # the file again when it changes).
        tmp = self.workdir / "policy.json.tmp"
        tmp.write_text(json.dumps(policy))
        os.rename(tmp, self.workdir / "policy.json")

    def reload(self):
        before = self.stat("listener_manager.lds.update_success") or 0
        self.reloads += 1
        self.write_lds(reloaded(self.policy, self.reloads))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if (self.stat("listener_manager.lds.update_success") or 0) > before:
                return True
            if (self.stat("listener_manager.lds.update_rejected") or 0) > 0:
                raise RuntimeError("Envoy rejected a reload:\n" +
                                   run.log_tail(self.workdir / "envoy.log"))
            time.sleep(0.2)
        return False

    def admin(self, path, timeout=10):
        return run.http_get(f"http://127.0.0.1:{self.admin_port}{path}", timeout=timeout)[1]

    def ready(self):
        if self.admin("/ready", 2).strip() != "LIVE":
            return False
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True

    def stat(self, name):
        try:
            s = json.loads(self.admin(f"/stats?format=json&filter=^{re.escape(name)}$"))
            return s["stats"][0]["value"]
        except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException):
            return None


# ---------------------------------------------------------------------------
# The load
# ---------------------------------------------------------------------------


class Mix:
    """Picks and sends one request; every choice from one seeded dice per
    worker. Callers' recent prompts are kept (bounded) for cache repeats."""

    def __init__(self, stack, args, keys):
        self.stack, self.args, self.keys = stack, args, keys
        self.features = set(args.features)
        self.lock = threading.Lock()
        self.asked = {}  # caller → its last prompts
        self.counter = 0
        self.started = time.monotonic()
        kinds = [
            ("key_repeat", 14, {"keys", "cache"}), ("key_new", 14, {"keys"}),
            ("key_stream", 8, {"keys", "stream"}), ("stream_drop", 3, {"keys", "stream"}),
            ("jwt", 10, {"jwt"}), ("anon_new", 9, {"anon"}), ("anon_pool", 7, {"anon"}),
            ("flood", 8, {"flood"}), ("queued", 10, {"queue"}),
            ("queue_give_up", 2, {"queue"}), ("semantic", 5, {"semantic"}),
            ("big_model", 3, {"refuse"}), ("hostile", 5, {"refuse"}),
            ("bad_key", 2, {"refuse"}), ("unknown_path", 2, {"refuse"}),
            ("oversize", 0.3, {"refuse"}),
        ]
        self.kinds = [(k, w) for k, w, need in kinds if need & self.features]
        if not self.kinds:  # e.g. only `reload`: plain keyed requests carry it
            self.kinds = [("key_new", 1)]
        self.total_w = sum(w for _, w in self.kinds)

    def pick(self, rng):
        x = rng.random() * self.total_w
        for k, w in self.kinds:
            x -= w
            if x < 0:
                return k
        return self.kinds[-1][0]

    def fresh(self, rng):
        with self.lock:
            self.counter += 1
            n = self.counter
        words = " ".join(rng.choice(WORDS) for _ in range(6))
        return f"Question {n}: how do I configure the {words}?"

    def remember(self, caller, prompt):
        with self.lock:
            recent = self.asked.setdefault(caller, [])
            recent.append(prompt)
            del recent[:-6]
            if len(self.asked) > 20000:  # a bounded driver: forget the oldest half
                for k in list(self.asked)[:10000]:
                    del self.asked[k]

    def recent(self, caller, rng):
        with self.lock:
            r = self.asked.get(caller)
            return rng.choice(r) if r else None

    def flooder(self):
        """One address at a time floods (2+ requests a second); a new one
        every minute, so blocks keep being made."""
        minute = int((time.monotonic() - self.started) // 60)
        return f"127.200.{minute // 250 % 250 + 1}.{minute % 250 + 1}"

    def send(self, rng):
        kind = self.pick(rng)
        return kind, getattr(self, f"do_{kind}")(rng)

    # -- callers ------------------------------------------------------------

    def key(self, rng, tier=None):
        pool = [k for k, t in self.keys if tier is None or t == tier]
        return rng.choice(pool)

    def chat(self, rng, model, prompt, headers, source=None, stream=False, drop=False,
             timeout=45, max_tokens=None):
        body = {"model": model, "max_tokens": max_tokens or rng.choice((8, 16, 24)),
                "temperature": 0, "messages": [{"role": "user", "content": prompt}]}
        if stream:
            body["stream"] = True
        h = {"content-type": "application/json", **headers}
        if stream:
            h.setdefault("x-mock-chunk-delay-ms", str(rng.choice((0, 5, 20))))
        return request(self.stack.port, "POST", "/v1/chat/completions",
                       json.dumps(body).encode(), h, source, timeout, drop)

    def regular(self, rng):
        """A key from the first tenth: callers who come back (cache hits)."""
        return rng.choice(self.keys[: max(3, len(self.keys) // 10)])[0]

    def do_key_repeat(self, rng):
        k = self.regular(rng)
        prompt = self.recent(k, rng)
        if prompt is None:
            prompt = self.fresh(rng)
            self.remember(k, prompt)
        return self.chat(rng, "llama3.1:8b", prompt, {"x-api-key": k})

    def do_key_new(self, rng):
        k = self.key(rng)
        prompt = self.fresh(rng)
        self.remember(k, prompt)
        # The OpenAI SDKs' spelling half the time.
        h = {"x-api-key": k} if rng.random() < 0.5 else {"authorization": f"Bearer {k}"}
        return self.chat(rng, "llama3.1:8b", prompt, h)

    def do_key_stream(self, rng):
        k = self.regular(rng)
        prompt = self.recent(k, rng) if rng.random() < 0.3 else None
        if prompt is None:
            prompt = self.fresh(rng)
            self.remember(k, prompt)
        return self.chat(rng, "llama3.1:8b", prompt, {"x-api-key": k}, stream=True,
                         max_tokens=rng.choice((16, 48)))

    def do_stream_drop(self, rng):
        k = self.key(rng)
        return self.chat(rng, "llama3.1:8b", self.fresh(rng),
                         {"x-api-key": k, "x-mock-chunk-delay-ms": "30"}, stream=True,
                         drop=True, max_tokens=64)

    def do_jwt(self, rng):
        # A pool of subjects (some repeat, cache hits), and ever-new ones.
        if rng.random() < 0.3:
            sub = f"new-{secrets.token_hex(6)}"
        else:
            sub = f"user-{rng.randrange(2000)}"
        tier = TIERS[zlib.crc32(sub.encode()) % 3]
        tok = self.stack.jwt.token(sub, tier)
        prompt = self.recent(sub, rng) if rng.random() < 0.4 else None
        if prompt is None:
            prompt = self.fresh(rng)
            self.remember(sub, prompt)
        stream = "stream" in self.features and rng.random() < 0.3
        # Each subject from its own address: a subject no key declares is
        # anonymous, and the penalty box counts it by address.
        h = zlib.crc32(sub.encode())
        return self.chat(rng, "llama3.1:8b", prompt, {"authorization": f"Bearer {tok}"},
                         source=f"127.202.{h >> 8 & 255}.{h % 254 + 1}", stream=stream)

    @staticmethod
    def anon(rng, b):
        """One of 1,000 addresses in 127.<b>.0.0/16."""
        i = rng.randrange(1000)
        return f"127.{b}.{i // 250}.{i % 250 + 1}"

    def do_anon_new(self, rng):
        addr = f"127.{rng.randrange(1, 200)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
        return self.chat(rng, "llama3.1:8b", self.fresh(rng), {}, source=addr)

    def do_anon_pool(self, rng):
        i = rng.randrange(3000)
        addr = f"127.201.{i // 250}.{i % 250 + 1}"
        prompt = self.recent(addr, rng) if rng.random() < 0.4 else None
        if prompt is None:
            prompt = self.fresh(rng)
            self.remember(addr, prompt)
        return self.chat(rng, "llama3.1:8b", prompt, {}, source=addr)

    def do_flood(self, rng):
        return self.chat(rng, "llama3.1:8b", self.fresh(rng), {}, source=self.flooder())

    def do_queued(self, rng):
        # mistral:7b: 2 in flight; enterprise (batch) and free (standard)
        # callers wait, pro (interactive) ones are refused at once.
        tier = rng.choice(("enterprise", "enterprise", "free", "pro"))
        h = {"x-api-key": self.key(rng, tier),
             "x-mock-latency-ms": str(rng.choice((100, 200, 400)))}
        if rng.random() < 0.4:
            h["x-sluice-max-wait-ms"] = str(rng.choice((200, 800, 2000)))
        return self.chat(rng, "mistral:7b", self.fresh(rng), h)

    def do_queue_give_up(self, rng):
        h = {"x-api-key": self.key(rng, "enterprise"), "x-mock-latency-ms": "2000"}
        return self.chat(rng, "mistral:7b", self.fresh(rng), h, timeout=0.3)

    def do_semantic(self, rng):
        k = self.key(rng, "enterprise")
        prompt = self.recent(("sem", k), rng)
        if prompt is None or rng.random() < 0.3:
            prompt = self.fresh(rng)
            self.remember(("sem", k), prompt)
        else:  # the same words, reordered, other case (cosine 1.0 in mock-llm's embedding)
            words = prompt.rstrip("?").split()
            cut = rng.randrange(1, len(words))
            prompt = " ".join(words[cut:] + words[:cut]).lower()
        return self.chat(rng, "mistral:7b", prompt, {"x-api-key": k})

    def do_big_model(self, rng):
        # llama3.1:70b: 5/min (429), pro past its soft budget downshifts.
        return self.chat(rng, "llama3.1:70b", self.fresh(rng), {"x-api-key": self.key(rng)})

    HOSTILE = [
        b"{not json",
        b'{"model": "llama3.1:8b", "messages": "not a list"}',
        b'{"model": 7, "messages": []}',
        b'{"model": "llama3.1:8b", "max_tokens": -5, "messages": []}',
        b'{"model": "llama3.1:8b", "max_tokens": 1e309, "messages": []}',
        b'{"model": "llama3.1:8b", "messages": [' + b"[" * 400 + b"]" * 400 + b"]}",
        b'{"model": "llama3.1:8b", "model": "llama3.1:70b", "messages": []}',
        b'{"model": "made-up-model-%d", "messages": [{"role": "user", "content": "x"}]}',
        b"\xff\xfe\x00garbage",
        b"",
    ]

    def do_hostile(self, rng):
        body = rng.choice(self.HOSTILE)
        if b"%d" in body:
            body = body.replace(b"%d", str(rng.randrange(10**9)).encode())
        h = {"content-type": "application/json", "x-api-key": self.key(rng)}
        return request(self.stack.port, "POST", "/v1/chat/completions", body, h, None, 10)

    def do_bad_key(self, rng):
        h = {"x-api-key": f"sk-guess-{secrets.token_hex(8)}"}
        return self.chat(rng, "llama3.1:8b", self.fresh(rng), h, source=self.anon(rng, 203))

    def do_unknown_path(self, rng):
        path = rng.choice(("/v1/fine_tuning/jobs", "/admin", f"/v1/x{rng.randrange(10**6)}"))
        return request(self.stack.port, "POST", path, b'{"a":1}',
                       {"content-type": "application/json"}, self.anon(rng, 204), 10)

    def do_oversize(self, rng):
        body = json.dumps({"model": "llama3.1:8b", "messages": [
            {"role": "user", "content": "x" * (1 << 20)}]}).encode()
        return request(self.stack.port, "POST", "/v1/chat/completions", body,
                       {"content-type": "application/json", "x-api-key": self.key(rng)},
                       None, 20)


def burst(stack, args, keys, rng):
    """--burst-size requests at once, each with a body of --burst-bytes:
    half to llama3.1:8b (the upstream answers after 2 s), half queued for
    mistral:7b (batch callers, 2 in flight). What the peak of bodies held
    at once costs, and whether that memory comes back."""
    filler = " ".join(rng.choice(WORDS) for _ in range(args.burst_bytes // 7))
    filler = filler[: args.burst_bytes]
    enterprise = [k for k, t in keys if t == "enterprise"]
    out = []

    def one(i):
        model = {"both": ("llama3.1:8b", "mistral:7b")[i % 2], "direct": "llama3.1:8b",
                 "queued": "mistral:7b"}[args.burst_to]
        if args.burst_shape == "messages":  # the same bytes as many small messages
            one = {"role": "user", "content": "hi"}
            n = args.burst_bytes // len(json.dumps(one))
            msgs = [{"role": "user", "content": f"burst {i} {time.time()}"}] + [one] * n
        else:
            msgs = [{"role": "user", "content": f"burst {i} {time.time()} {filler}"}]
        body = json.dumps({"model": model, "max_tokens": 8, "messages": msgs}).encode()
        h = {"content-type": "application/json", "x-api-key": rng.choice(enterprise),
             "x-mock-latency-ms": "2000" if model == "llama3.1:8b" else "300"}
        out.append(request(stack.port, "POST", "/v1/chat/completions", body, h, None, 60)[0])

    threads = [threading.Thread(target=one, args=(i,), daemon=True)
               for i in range(args.burst_size)]
    for t in threads:
        t.start()
    return threads, out


def request(port, method, path, body, headers, source, timeout, drop=False):
    """One request on a fresh connection; returns (status, cache header or
    refusal reason), status 0 for a transport error (a reload's drain, a
    give-up)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body, headers)
        resp = conn.getresponse()
        if drop and resp.status < 400:
            resp.read(200)  # a client that leaves mid-stream
            return resp.status, "dropped"
        resp.read()
        if resp.status >= 400:
            return resp.status, resp.getheader("x-sluice-reason") or ""
        return resp.status, resp.getheader("x-sluice-cache") or ""
    except (OSError, http.client.HTTPException):
        return 0, ""
    finally:
        conn.close()


class Load:
    """--workers threads, paced to --rate requests a second overall."""

    def __init__(self, mix, args):
        self.mix, self.args = mix, args
        self.lock = threading.Lock()
        self.done = 0
        self.status = {}
        self.kinds = {}
        self.hits = 0
        self.stop = threading.Event()
        self.next_at = time.monotonic()
        self.threads = [threading.Thread(target=self.worker, args=(i,), daemon=True)
                        for i in range(args.workers)]

    def start(self):
        for t in self.threads:
            t.start()

    def slot(self):
        with self.lock:
            now = time.monotonic()
            self.next_at = max(self.next_at + 1.0 / self.args.rate, now - 1.0)
            return self.next_at

    def worker(self, i):
        rng = random.Random(self.args.seed * 1000 + i)
        while not self.stop.is_set():
            wait = self.slot() - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            kind, (status, note) = self.mix.send(rng)
            with self.lock:
                self.done += 1
                self.status[status] = self.status.get(status, 0) + 1
                per = self.kinds.setdefault(kind, {})
                label = f"{status} {note}" if status >= 400 and note else str(status or "err")
                per[label] = per.get(label, 0) + 1
                self.hits += note == "hit"

    def snapshot(self):
        with self.lock:
            return self.done, dict(self.status), self.hits


# ---------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------


def vm_rss_kb(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def wasm_memories(pid):
    """(count, resident kB) of the VMs' linear memories: V8 reserves about
    8 GiB per wasm memory (guard pages, `---p`) and makes its first pages
    read-write as the memory grows, which splits the mapping: a memory is
    the `rw-p` mapping just below such a reservation (checked in
    /proc/<pid>/smaps of Envoy 1.40 here)."""
    maps = []  # (start, end, perms, size kB, rss kB)
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    maps.append([lo, hi, head[1], 0, 0])
                elif head[0] == "Size:" and maps:
                    maps[-1][3] = int(head[1])
                elif head[0] == "Rss:" and maps:
                    maps[-1][4] = int(head[1])
    except OSError:
        pass
    count = rss = 0
    for below, m in zip(maps, maps[1:]):
        if m[2] == "---p" and m[3] >= 4 << 20:
            count += 1
            if below[1] == m[0] and below[2] == "rw-p":
                rss += below[4]
    return count, rss


def sample(stack, load, t0):
    done, status, hits = load.snapshot()
    res_n, res_kb = wasm_memories(stack.envoy.pid)
    try:
        mem = json.loads(stack.admin("/memory"))
    except (OSError, ValueError, http.client.HTTPException):
        mem = {}
    try:
        nstats = len(stack.admin("/stats", 20).splitlines())
    except (OSError, http.client.HTTPException):
        nstats = 0
    try:
        redis_mem = int(re.search(r"used_memory:(\d+)", stack.redis_cmd("INFO", "memory")).group(1))
    except (AttributeError, ValueError, subprocess.SubprocessError):
        redis_mem = 0
    return {
        "t": time.monotonic() - t0, "requests": done, "hits": hits,
        "ok": status.get(200, 0), "refused": sum(v for k, v in status.items() if k >= 400),
        "transport": status.get(0, 0),
        "envoy_kb": vm_rss_kb(stack.envoy.pid), "sidecar_kb": vm_rss_kb(stack.sidecar.pid),
        "redis_kb": vm_rss_kb(stack.redis.pid), "redis_used": redis_mem,
        "wasm_regions": res_n, "wasm_rss_kb": res_kb,
        "allocated": int(mem.get("allocated", 0)), "heap": int(mem.get("heap_size", 0)),
        "stats": nstats,
        "vms": stack.stat("wasm.envoy.wasm.runtime.v8.active"),
        "draining": stack.stat("listener_manager.total_listeners_draining"),
        "reloads": stack.reloads,
    }


def mb(kb):
    return kb / 1024


def row(s):
    return (f"| {s['t'] / 60:5.1f} | {s['requests']:,} | {s['ok']:,} | {s['hits']:,} "
            f"| {s['refused']:,} | {s['reloads']} | {mb(s['envoy_kb']):.1f} "
            f"| {mb(s['wasm_rss_kb']):.1f} ({s['wasm_regions']}) "
            f"| {s['allocated'] / 2**20:.1f} / {s['heap'] / 2**20:.1f} | {s['stats']:,} "
            f"| {mb(s['sidecar_kb']):.1f} | {mb(s['redis_kb']):.1f} |")


HEADER = ("| min | requests | 200 | cache hits | 4xx/5xx | reloads | Envoy RSS MB "
          "| wasm RSS MB (regions) | tcmalloc alloc / heap MB | stats | sidecar RSS MB "
          "| Redis RSS MB |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def slope(points):
    """Least-squares slope of (x, y); None with fewer than 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def verdict(samples, field="envoy_kb", scale=1.0):
    """MB per 100k requests in each half (by time), least squares."""
    half = samples[-1]["t"] / 2
    first = [(s["requests"], s[field] * scale) for s in samples if s["t"] <= half]
    second = [(s["requests"], s[field] * scale) for s in samples if s["t"] >= half]
    per = lambda x: None if x is None else x * 100_000
    return per(slope(first)), per(slope(second))


def fmt_rate(x):
    return "n/a" if x is None else f"{x:+.1f}"


def report(args, samples, load, stack, started_utc):
    lines = [HEADER] + [row(s) for s in samples]
    kb = 1 / 1024
    a, b = verdict(samples, "envoy_kb", kb)
    wa, wb = verdict(samples, "wasm_rss_kb", kb)
    ha, hb = verdict(samples, "allocated", 1 / 2**20)
    sa, sb = verdict(samples, "sidecar_kb", kb)
    first, last = samples[0], samples[-1]
    peak = max(s["envoy_kb"] for s in samples)
    small = lambda x, limit: x is not None and x < limit
    # Bounded: nothing grows by 2 MB per 100k requests in the second half.
    # Live memory flat: what Envoy's heap holds (tcmalloc's allocated bytes)
    # and the wasm memories grow by under 1 MB per 100k, while the RSS still
    # steps up (the heap reserving pages it keeps).
    if small(b, 2.0) and small(hb, 2.0) and small(wb, 2.0):
        bounded, line = True, ("bounded — in the second half Envoy's RSS, its live heap and "
                               "its wasm memories each grow by under 2 MB per 100k requests.")
    elif small(hb, 1.0) and small(wb, 1.0):
        bounded, line = True, ("live memory flat, RSS stepping — in the second half Envoy's "
                               "live heap (tcmalloc allocated) and its wasm memories grow by "
                               "under 1 MB per 100k requests; the RSS steps come from pages "
                               "the heap reserved and keeps (tcmalloc heap column).")
    else:
        bounded, line = False, "GROWING — the second half still grows (see the table)."
    done, status, hits = load.snapshot()
    out = [
        f"`python3 bench/soak.py {' '.join(args.argv)}` — started {started_utc} UTC, "
        f"{last['t'] / 60:.1f} min, {done:,} requests ({done / max(last['t'], 1):.1f}/s, "
        f"{args.workers} client threads, fresh connection each), Envoy --concurrency "
        f"{args.concurrency}, features: {','.join(args.features)}; {stack.reloads} policy "
        f"reloads (every {args.reload_every:g} s).",
        "",
        "Statuses: " + ", ".join(f"{k or 'transport error'}: {v:,}"
                                 for k, v in sorted(status.items())) +
        f"; cache hits: {hits:,}. Requests by kind (status: count): " +
        "; ".join(f"{k} " + ", ".join(f"{s}: {n:,}" for s, n in sorted(v.items()))
                  for k, v in sorted(load.kinds.items())) + ".",
        "",
        *([f"Bursts: {args.bursts_sent} × "
           f"{args.burst_size} requests at once with {args.burst_bytes:,}-byte bodies "
           f"({args.burst_shape}, to {args.burst_to}), every "
           f"{args.burst_every:g} s; statuses: " +
           ", ".join(f"{k or 'transport error'}: {v:,}"
                     for k, v in sorted(args.burst_statuses.items())) + ".", ""]
          if args.burst_every else []),
        *([f"Envoy's bootstrap has `memory_allocator_manager: {{bytes_to_release: "
           f"{args.release_memory}, memory_release_interval: 1s}}`.", ""]
          if args.release_memory else []),
        *lines,
        "",
        f"Envoy RSS: {mb(first['envoy_kb']):.1f} MB at the first sample, {mb(last['envoy_kb']):.1f} "
        f"MB at the last, peak {mb(peak):.1f} MB. Growth per 100k requests (least squares): "
        f"first half {fmt_rate(a)} MB, second half {fmt_rate(b)} MB; Envoy's live heap "
        f"(tcmalloc allocated) {fmt_rate(ha)} / {fmt_rate(hb)} MB; wasm memories "
        f"{fmt_rate(wa)} / {fmt_rate(wb)} MB; sidecar RSS {fmt_rate(sa)} / {fmt_rate(sb)} MB.",
        "",
        "Verdict: " + line,
    ]
    return "\n".join(out), bounded


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1500, help="seconds (default 25 min)")
    ap.add_argument("--sample", type=float, default=30, help="seconds between samples")
    ap.add_argument("--rate", type=float, default=40, help="requests a second, overall")
    ap.add_argument("--workers", type=int, default=24, help="client threads")
    ap.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    ap.add_argument("--keys", type=int, default=400, help="declared API keys")
    ap.add_argument("--reload-every", type=float, default=60, help="seconds; 0: never")
    ap.add_argument("--burst-every", type=float, default=0,
                    help="seconds between bursts of big bodies at once; 0: never (default)")
    ap.add_argument("--burst-size", type=int, default=40, help="requests in a burst")
    ap.add_argument("--burst-bytes", type=int, default=900_000, help="body bytes in a burst")
    ap.add_argument("--burst-shape", choices=("text", "messages"), default="text",
                    help="a burst body: one long message, or many small ones")
    ap.add_argument("--burst-to", choices=("both", "direct", "queued"), default="both",
                    help="a burst's model: llama3.1:8b (direct), mistral:7b (queued), or half each")
    ap.add_argument("--release-memory", type=int, default=0, metavar="BYTES",
                    help="bootstrap memory_allocator_manager: tcmalloc gives back up to BYTES "
                         "of free memory a second (0: off, Envoy's default)")
    ap.add_argument("--features", default=",".join(FEATURES),
                    help=f"comma-separated, of {','.join(FEATURES)}")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--smoke", action="store_true", help="20 s, samples every 4 s")
    ap.add_argument("--out", type=Path, default=ROOT / "target/bench/soak.md")
    ap.add_argument("--workdir", type=Path, default=ROOT / "target/bench/soak")
    args = ap.parse_args(argv)
    args.argv = argv
    args.workdir = args.workdir.resolve()
    args.features = [f for f in args.features.split(",") if f]
    unknown = set(args.features) - set(FEATURES)
    if unknown:
        ap.error(f"unknown features: {sorted(unknown)}")
    if args.smoke:
        args.duration, args.sample, args.reload_every = 20, 4, 8
    if "reload" not in args.features:
        args.reload_every = 0
    return args


def main(argv):
    args = parse_args(argv)
    started_utc = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    keys = [(f"soak-key-{i:04d}", TIERS[i % 3]) for i in range(args.keys)]
    procs = run.Procs()
    samples = []
    try:
        stack = Stack(procs, args.workdir, keys, args.concurrency, args.release_memory,
                      "fleet" in args.features)
        load = Load(Mix(stack, args, keys), args)
        t0 = time.monotonic()
        samples.append(sample(stack, load, t0))
        print(HEADER + "\n" + row(samples[-1]), flush=True)
        load.start()
        next_sample, next_reload = t0 + args.sample, t0 + (args.reload_every or 1e12)
        # Half a period after the reloads (each closes the old listener's
        # connections 2 s later): a burst is not cut short by one.
        next_burst = t0 + (args.burst_every or 1e12) + (args.reload_every or 60) / 2
        bursts = []
        burst_rng = random.Random(args.seed)
        while time.monotonic() < t0 + args.duration:
            for p in (stack.envoy, stack.sidecar, stack.redis):
                if p.poll() is not None:
                    raise RuntimeError(f"{p.bench_name} exited ({p.returncode}):\n"
                                       f"{run.log_tail(p.log_path)}")
            now = time.monotonic()
            if now >= next_burst:
                bursts.append(burst(stack, args, keys, burst_rng))
                next_burst += args.burst_every
            if now >= next_reload:
                if not stack.reload():
                    print("soak: a reload was not applied within 20 s", flush=True)
                next_reload += args.reload_every
            if now >= next_sample:
                samples.append(sample(stack, load, t0))
                print(row(samples[-1]), flush=True)
                next_sample += args.sample
            time.sleep(0.2)
        load.stop.set()
        statuses = {}
        for threads, out in bursts:
            for t in threads:
                t.join(60)
            for st in out:
                statuses[st] = statuses.get(st, 0) + 1
        args.burst_statuses, args.bursts_sent = statuses, len(bursts)
        samples.append(sample(stack, load, t0))
        print(row(samples[-1]), flush=True)
        text, bounded = report(args, samples, load, stack, started_utc)
        (args.workdir / "samples.json").write_text(json.dumps(samples, indent=1))
    finally:
        procs.stop_all()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print("\n" + text)
    return 0 if bounded or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
