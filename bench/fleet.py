#!/usr/bin/env python3
"""The fleet section of `make bench` (issue 11): the same policy local vs
fleet, on one Envoy (--concurrency 1) with its sidecar and a real Redis on
loopback.

    python3 bench/fleet.py            # writes target/bench/fleet.md
    python3 bench/fleet.py --smoke    # seconds: checks the script, not figures

Variants, all with bench/run.py's FULL_POLICY (8 buckets per request: per
caller requests, tokens, input tokens, daily tokens, daily spend; per model
requests and tokens; the route):
  local   no `fleet` section: shared data only
  lease   `fleet: {expected_replicas: 1}`: leases, the common path
  strict  `fleet: {lease: {max: 0}}`: every request waits for one exact
          take in Redis (the path near the end of a bucket)

Figures: Envoy CPU per request (wrk, 16 connections), p50/p99 latency at one
connection, sidecar + Redis CPU per request, and Redis commands per 1,000
admitted requests (INFO commandstats; the fleet scripts apart from the kill
switch sync, which costs 10 GETs a second per sidecar whatever the load).
Standard library only; reuses bench/run.py's process and load helpers.
"""

import argparse
import copy
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (bench/run.py)

ROOT = run.ROOT
SIDECAR = ROOT / "target/release/sluice-sidecar"


class Redis:
    def __init__(self, procs, workdir):
        self.port = run.free_port()
        self.proc = procs.spawn("redis", [
            "redis-server", "--port", self.port, "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir], workdir / "redis.log")
        run.wait_until("redis", lambda: self.cmd("PING") == "PONG", 15, self.proc)

    def cmd(self, *args):
        r = subprocess.run(["redis-cli", "-p", str(self.port), *args],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip()

    def calls(self):
        """{command: calls} from INFO commandstats."""
        out = {}
        for line in self.cmd("INFO", "commandstats").splitlines():
            m = re.match(r"cmdstat_([\w|]+):calls=(\d+)", line)
            if m:
                out[m.group(1)] = int(m.group(2))
        return out


# The fleet secret each Envoy VM and its sidecar share (not a real one).
FLEET_SECRET = "bench-fleet-secret-0123456789"


class Sidecar:
    def __init__(self, procs, workdir, redis_port, fleet_policy=None):
        d = workdir / "sidecar"
        d.mkdir(parents=True, exist_ok=True)
        fleet = ""
        if fleet_policy is not None:
            # The sidecar checks each fleet call against its Envoy's policy.
            (d / "policy.json").write_text(json.dumps(fleet_policy))
            (d / "secret").write_text(FLEET_SECRET)
            fleet = (f"fleet:\n  redis: redis://127.0.0.1:{redis_port}\n"
                     f"  policy: {d / 'policy.json'}\n  secret_file: {d / 'secret'}\n")
        (d / "sidecar.yaml").write_text(fleet)
        self.proc = procs.spawn("sidecar", [
            SIDECAR, "serve", "--listen", "127.0.0.1:0", "--simulate",
            "--config", d / "sidecar.yaml"], d / "sidecar.log")

        def port():
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", (d / "sidecar.log").read_text())
            return int(m.group(1)) if m else None

        self.port = run.wait_until("sidecar", port, 15, self.proc)


def policy(variant):
    p = copy.deepcopy(run.FULL_POLICY)
    p["sidecar"] = {"cluster": "sluice_sidecar", "on_stale": "fail_open"}
    if variant == "lease":
        p["fleet"] = {"expected_replicas": 1}
    elif variant == "strict":
        p["fleet"] = {"expected_replicas": 1, "lease": {"max": 0}}
    if "fleet" in p:
        p["fleet"]["salt"] = "bench-fleet-salt-0123456789"
    return p


def vm_configs(v):
    """Every `vm_config` in an Envoy config."""
    if isinstance(v, dict):
        for k, x in v.items():
            if k == "vm_config":
                yield x
            else:
                yield from vm_configs(x)
    elif isinstance(v, list):
        for x in v:
            yield from vm_configs(x)


def config(shipped, upstream_port, sidecar_port, variant):
    cfg = run.envoy_config(shipped, upstream_port, "sluice", policy(variant), access_log=False)
    sc = run._named(cfg["static_resources"]["clusters"], "sluice_sidecar", "cluster")
    sc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] = {
        "socket_address": {"address": "127.0.0.1", "port_value": sidecar_port}}
    for vm in vm_configs(cfg):
        vm["environment_variables"] = {"key_values": {"SLUICE_FLEET_SECRET": FLEET_SECRET}}
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "target/bench/fleet.md")
    args = ap.parse_args()
    if args.smoke:
        args.duration, args.reps = 1, 1
    args.threads = 1
    load = run.run_wrk if subprocess.run(["which", "wrk"], capture_output=True).returncode == 0 \
        else run.run_python_load
    wl = run.WORKLOADS["chat"]
    workdir = ROOT / "target/bench/fleet"
    # Fresh: run.Envoy reads admin.txt as soon as it exists, and a stale
    # one from an earlier run names a dead admin.
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    procs = run.Procs()
    rows = {}
    try:
        shipped = run.load_shipped()
        mock = run.MockLlm(procs, workdir)
        for variant in ("local", "lease", "strict"):
            vdir = workdir / variant
            vdir.mkdir(parents=True, exist_ok=True)
            redis = Redis(procs, vdir)
            fleet_policy = policy(variant) if variant != "local" else None
            sidecar = Sidecar(procs, vdir, redis.port, fleet_policy)
            envoy = run.Envoy(procs, vdir, variant,
                              config(shipped, mock.port, sidecar.port, variant), 1)
            load(args, vdir, envoy.port, wl, 1, args.connections)  # warm-up
            reps = []
            for _ in range(args.reps):
                c0 = run.cpu_seconds(envoy.proc.pid)
                s0 = run.cpu_seconds(sidecar.proc.pid) + run.cpu_seconds(redis.proc.pid)
                k0 = redis.calls()
                r = load(args, vdir, envoy.port, wl, args.duration, args.connections)
                k1 = redis.calls()
                n = max(1, r["requests"])
                admitted = max(1, r["requests"] - r["non2xx"])
                scripts = sum(v - k0.get(k, 0) for k, v in k1.items()
                              if k.startswith("eval"))
                total = sum(v - k0.get(k, 0) for k, v in k1.items())
                reps.append({
                    "rps": r["requests"] / r["duration_s"],
                    "cpu_us": (run.cpu_seconds(envoy.proc.pid) - c0) / n * 1e6,
                    "side_us": (run.cpu_seconds(sidecar.proc.pid)
                                + run.cpu_seconds(redis.proc.pid) - s0) / n * 1e6,
                    "scripts_per_1k": scripts / admitted * 1000,
                    "cmds_per_1k": total / admitted * 1000,
                    "non2xx": r["non2xx"], "errors": r["errors"],
                })
            lat = [load(args, vdir, envoy.port, wl, args.duration, 1) for _ in range(args.reps)]
            med = lambda xs, f: statistics.median(x[f] for x in xs)
            rows[variant] = {
                "rps": med(reps, "rps"), "cpu_us": med(reps, "cpu_us"),
                "side_us": med(reps, "side_us"),
                "scripts_per_1k": med(reps, "scripts_per_1k"),
                "cmds_per_1k": med(reps, "cmds_per_1k"),
                "p50_us": med(lat, "p50_us"), "p99_us": med(lat, "p99_us"),
                "non2xx": sum(x["non2xx"] for x in reps), "errors": sum(x["errors"] for x in reps),
            }
            print(f"bench fleet: {variant}: {json.dumps(rows[variant])}", flush=True)
            for p in (envoy.proc, sidecar.proc, redis.proc):
                procs.stop(p)
    finally:
        procs.stop_all()
    base = rows["local"]
    lines = [
        "## Fleet: the same policy local vs fleet (issue 11)",
        "",
        f"`{'make bench BENCH_SMOKE=1' if args.smoke else 'make bench'}` → bench/fleet.py; "
        f"one Envoy (--concurrency 1), its sidecar, Redis on loopback; "
        f"{wl['label']}, bench/run.py's FULL_POLICY (8 buckets a request); "
        f"{args.connections} connections for CPU, 1 for latency; medians of {args.reps} × "
        f"{args.duration:g} s.",
        "",
        "| variant | req/s | Envoy CPU µs/req | vs local | p50 µs | p99 µs | added p99 µs "
        "| sidecar+Redis CPU µs/req | Redis scripts /1k admitted | all Redis commands /1k |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in rows.items():
        lines.append(
            f"| {v} | {r['rps']:,.0f} | {r['cpu_us']:.1f} | {r['cpu_us'] - base['cpu_us']:+.1f} "
            f"| {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['p99_us'] - base['p99_us']:+.0f} "
            f"| {r['side_us']:.1f} | {r['scripts_per_1k']:.1f} | {r['cmds_per_1k']:.1f} |")
    bad = {v: (r["non2xx"], r["errors"]) for v, r in rows.items() if r["non2xx"] or r["errors"]}
    lines += ["", "Goals: lease path ≤ +10 µs Envoy CPU per request over local; strict p99 "
              "≤ 1 ms with Redis on loopback; ≤ 50 Redis commands per 1,000 admitted in steady "
              "state (all commands counted, the kill-switch sync's GETs included).",
              f"Refused or failed requests during the runs: {bad or 'none'}.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
