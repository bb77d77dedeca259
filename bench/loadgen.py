#!/usr/bin/env python3
"""A real LLM load generator through sluice (issue 27, item 4): NVIDIA's
aiperf (PyPI `aiperf`, pinned in bench/third-party/aiperf.txt) drives
streaming chat at guidellm's mock-server (PyPI `guidellm`, `make
third-party`), in one run, three ways: straight to the server, through a
bare Envoy (the shipped bootstrap without sluice), and through Envoy with
sluice (a policy that admits everything: the cost measured is the filter's
work, not refusals). Same workload, same server process, one after another.

    python3 bench/loadgen.py --install-aiperf   # writes target/bench/loadgen.md
    python3 bench/loadgen.py --smoke            # seconds of load: checks the script

Figures (aiperf's own, from its profile_export_aiperf.json): time to first
token, inter-token latency and request latency, p50 and p99, and request
throughput. aiperf needs a tokenizer for its synthetic prompts; nothing may
be downloaded here, so bench/third-party/make_tokenizer.py trains a small
byte-level BPE with the `tokenizers` package on generated text and saves
it where aiperf loads it from (a local directory). `--use-server-token-count`
makes aiperf count output tokens from guidellm's usage, as sluice settles.

Reuses bench/run.py's process helpers.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (bench/run.py)

ROOT = run.ROOT
AIPERF_VERSION = "0.13.0"
AIPERF_REQS = ROOT / "bench/third-party/aiperf.txt"
AIPERF_VENV = ROOT / "target/bench/venv-aiperf"
GUIDELLM = ROOT / ".venv/third-party/bin/guidellm"
MODEL = "bench-model"


def install_aiperf():
    if not (AIPERF_VENV / "bin/python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
    stamp = AIPERF_VENV / ".installed"
    want = AIPERF_REQS.read_text()
    if stamp.exists() and stamp.read_text() == want:
        return
    subprocess.run([str(AIPERF_VENV / "bin/pip"), "install", "--quiet",
                    "--disable-pip-version-check", "--no-deps", "-r", str(AIPERF_REQS)],
                   check=True)
    stamp.write_text(want)


def aiperf_bin():
    return AIPERF_VENV / "bin/aiperf"


def run_env():
    env = dict(os.environ)
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(k, None)
    return env


def make_tokenizer(workdir):
    out = workdir / "tokenizer"
    subprocess.run([str(AIPERF_VENV / "bin/python"),
                    str(ROOT / "bench/third-party/make_tokenizer.py"), str(out)],
                   check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return out


class Guidellm:
    def __init__(self, procs, workdir, args):
        self.port = run.free_port()
        log = workdir / "guidellm.log"
        self.proc = procs.spawn("guidellm", [
            GUIDELLM, "mock-server", "--host", "127.0.0.1", "--port", self.port,
            "--model", MODEL, "--workers", "1", "--ttft-ms", args.ttft_ms,
            "--itl-ms", args.itl_ms, "--output-tokens", args.output_tokens], log,
            env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
        run.wait_until("guidellm mock-server",
                       lambda: run.http_get(f"http://127.0.0.1:{self.port}/v1/models")[0] == 200,
                       120, self.proc)


def policy():
    return {
        "default_tier": "bench",
        "identity": {"sources": ["client_address"]},
        "tiers": {"bench": {"requests": "1000000/min", "daily_tokens": 10_000_000_000}},
        "models": {},
        "defaults": {"max_output_tokens": 1024},
    }


def profile(args, workdir, name, port, tokenizer):
    out = workdir / f"aiperf-{name}"
    shutil.rmtree(out, ignore_errors=True)
    argv = [aiperf_bin(), "profile", "--model", MODEL, "--url", f"http://127.0.0.1:{port}",
            "--endpoint-type", "chat", "--streaming", "--tokenizer", tokenizer,
            "--concurrency", args.concurrency, "--request-count", args.requests,
            "--warmup-request-count", args.warmup,
            "--synthetic-input-tokens-mean", args.input_tokens,
            "--synthetic-input-tokens-stddev", 0,
            "--output-tokens-mean", args.output_tokens, "--output-tokens-stddev", 0,
            "--use-server-token-count", "--random-seed", 27, "--artifact-dir", out]
    log = workdir / f"aiperf-{name}.log"
    started = time.monotonic()
    with open(log, "wb") as f:
        r = subprocess.run([str(a) for a in argv], stdout=f, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, timeout=args.timeout,
                           # Not HF_HUB_OFFLINE: aiperf 0.13 then takes the local
                           # directory for a hub repo id and fails (HFValidationError).
                           # A local directory is loaded without the network.
                           env=run_env())
    if r.returncode != 0:
        raise RuntimeError(f"aiperf ({name}) exited {r.returncode}:\n{run.log_tail(log)}")
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    row = {"wall_s": time.monotonic() - started}
    for key in ("time_to_first_token", "inter_token_latency", "request_latency"):
        m = data.get(key) or {}
        row[key] = (m.get("p50"), m.get("p99"))
    row["throughput"] = (data.get("request_throughput") or {}).get("avg")
    row["count"] = (data.get("request_count") or {}).get("avg")
    errors = data.get("error_summary") or []
    row["errors"] = sum(e.get("count", 0) for e in errors) if isinstance(errors, list) else errors
    return row


def fmt(v):
    return "–" if v is None else f"{v:.1f}"


def table(rows):
    lines = ["| path | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | request p50 | request p99 "
             "| req/s | requests | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        t, i, q = r["time_to_first_token"], r["inter_token_latency"], r["request_latency"]
        lines.append(f"| {name} | {fmt(t[0])} | {fmt(t[1])} | {fmt(i[0])} | {fmt(i[1])} "
                     f"| {fmt(q[0])} | {fmt(q[1])} | {fmt(r['throughput'])} "
                     f"| {int(r['count']) if r['count'] is not None else '–'} | {r['errors']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--install-aiperf", action="store_true",
                    help=f"create {AIPERF_VENV.relative_to(ROOT)} (aiperf=={AIPERF_VERSION}, pinned)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--ttft-ms", type=int, default=50, help="guidellm's time to first token")
    ap.add_argument("--itl-ms", type=int, default=10, help="guidellm's inter-token latency")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per aiperf run")
    ap.add_argument("--out", type=Path, default=ROOT / "target/bench/loadgen.md")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.warmup, args.concurrency, args.output_tokens = 12, 2, 2, 8
    if args.install_aiperf:
        install_aiperf()
    if not aiperf_bin().exists() or not GUIDELLM.exists():
        missing = [str(p.relative_to(ROOT)) for p in (aiperf_bin(), GUIDELLM) if not p.exists()]
        msg = (f"loadgen: {', '.join(missing)} missing (`--install-aiperf`, `make third-party`)")
        if args.smoke:
            print(msg + "; skipped")
            return 0
        print(msg, file=sys.stderr)
        return 1

    workdir = ROOT / "target/bench/loadgen"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.time()
    procs = run.Procs()
    rows = {}
    try:
        tokenizer = make_tokenizer(workdir)
        server = Guidellm(procs, workdir, args)
        shipped = run.load_shipped()
        bare = run.Envoy(procs, workdir, "bare",
                         run.envoy_config(shipped, server.port, "none"), 2)
        sluice = run.Envoy(procs, workdir, "sluice",
                           run.envoy_config(shipped, server.port, "sluice",
                                            run.bench_policy(shipped, policy(), True)), 2)
        for name, port in (("direct to guidellm", server.port),
                           ("bare Envoy", bare.port),
                           ("Envoy + sluice", sluice.port)):
            rows[name] = profile(args, workdir, name.split()[0].lower(), port, tokenizer)
            print(f"loadgen: {name}: {rows[name]}", flush=True)
        settled = run.prom_sum(sluice.prometheus(), "sluice_tokens_total", 'kind="actual"')
    finally:
        procs.stop_all()
    load_after = os.getloadavg()
    text = "\n".join([
        "## aiperf through sluice: streaming chat, TTFT / ITL / request latency",
        "",
        f"`python3 bench/loadgen.py{' --smoke' if args.smoke else ''}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}; "
        f"{run.git_state()}). aiperf {AIPERF_VERSION} (`profile --endpoint-type chat "
        f"--streaming --concurrency {args.concurrency} --request-count {args.requests} "
        f"--warmup-request-count {args.warmup}`, {args.input_tokens} input tokens, "
        f"{args.output_tokens} output tokens, `--use-server-token-count`) against "
        f"guidellm 0.8.1's mock-server (`--ttft-ms {args.ttft_ms} --itl-ms {args.itl_ms} "
        f"--output-tokens {args.output_tokens}`, one worker), Envoy `--concurrency 2`. "
        f"Milliseconds. Machine: {run.machine()}; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after.",
        "",
        table(rows),
        "",
        f"sluice settled {settled:.0f} tokens (input + output, guidellm's usage) "
        f"over its run.",
        "",
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
