# berth: `make run` serves the default models, `make test` runs the suite.
# Both set up .venv first on a fresh machine.

VENV   ?= .venv
PY     := $(VENV)/bin/python
BERTH  := $(VENV)/bin/berth
REPO   ?= model_repository
# CPU-only machines get the CPU build of torch (a plain `torch` requirement
# would pull a multi-GB CUDA build); machines with an NVIDIA driver get the
# default build.
TORCH_CPU ?= torch==2.13.0
# Every install takes its versions from constraints.txt, the build of berth
# too (--build-constraint: the grpcio-tools that generates the stubs).
PINNED := -c constraints.txt --build-constraint constraints.txt

.PHONY: run test lint venv models bench mutations constraints floors clean prometheus netns-tools

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py constraints.txt protos/berth/v1/*.proto batcher/_core_c.pyx
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt --upgrade pip setuptools
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q $(PINNED) torch; \
	else \
	  $(PY) -m pip install -q $(PINNED) $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q $(PINNED) -e '.[dev]'
	touch $@

# Re-resolve constraints.txt from nothing: the newest releases pyproject.toml's
# floors allow (scripts/constraints.py, with the newest pip in a venv of its
# own, so that floors raised past the old pins are no obstacle). Then
# `make test` installs them.
CONSTRAINTS_VENV := build/constraints-venv
constraints:
	rm -rf $(CONSTRAINTS_VENV)
	python3 -m venv $(CONSTRAINTS_VENV)
	$(CONSTRAINTS_VENV)/bin/python -m pip install -q --upgrade pip
	$(CONSTRAINTS_VENV)/bin/python scripts/constraints.py $(TORCH_CPU)

models: $(REPO)/minilm/fallback.safetensors

# The default models and their CPU fallbacks (the fallback is built last).
# Rebuilt when their definition changes too (build-models rewrites only what
# is out of date; touch: it may have found nothing to rewrite).
$(REPO)/minilm/fallback.safetensors: $(VENV)/.installed services/cli/default_models.py
	$(BERTH) build-models --model-repository $(REPO)
	touch $@

run: venv models
	$(BERTH) serve --model-repository $(REPO)

# buf, pinned in tools/buf (npm): the public protos stay lint-clean and
# compatible with the last release's (api/released/).
BUF := tools/buf/node_modules/.bin/buf
RELEASED_PROTOS := api/released/0.1.0

$(BUF): tools/buf/package.json tools/buf/package-lock.json
	npm ci --prefix tools/buf --silent --no-audit --no-fund
	touch $@

lint: venv $(BUF)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(BUF) lint
	$(BUF) breaking protos --against $(RELEASED_PROTOS)

# Debian's prometheus, which tests/test_prometheus.py runs as a plain process
# of its own; where systemd started the package's service, it is stopped.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
prometheus:
	command -v prometheus >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends prometheus && \
	  if command -v systemctl >/dev/null 2>&1; then \
	    $(SUDO) systemctl disable --now prometheus >/dev/null 2>&1 || true; \
	  fi; }

# iproute2's ip, with which tests/chaos/test_hosts.py puts gateway, batcher
# and engines in network namespaces of their own (as root).
netns-tools:
	command -v ip >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends iproute2; }

test: venv models lint prometheus netns-tools
	HF_HUB_OFFLINE=1 BERTH_MODEL_REPOSITORY=$(abspath $(REPO)) $(PY) -m pytest -q

# The serving tests with every runtime dependency at exactly its floor in
# pyproject.toml, in a venv of their own (build/floors-venv; torch: TORCH_CPU).
floors: venv
	$(PY) scripts/floors.py $(TORCH_CPU)

# Break one behaviour at a time (tests/mutations.toml); each must fail its tests.
mutations: venv models
	HF_HUB_OFFLINE=1 BERTH_MODEL_REPOSITORY=$(abspath $(REPO)) $(PY) scripts/mutations.py

bench: venv models
	$(PY) benchmarks/batcher.py

clean:
	rm -rf build *.egg-info batcher/*.so batcher/*.c services/proto
