# elastic-moe — see README.md. Every target creates or reuses .venv first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
PYTEST_ARGS ?=

.PHONY: setup test lint typecheck importlint crds crds-check unit integration e2e demo demo-runtime bench \
        controlplane cluster-up cluster-down clean

setup:
	@bash scripts/venv.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

importlint: setup
	$(VENV)/bin/lint-imports

## crds: regenerate crds/ from the pydantic models
crds: setup
	$(VENV)/bin/moe-operator crd --out crds/

## crds-check: fail when crds/ is not what the models generate
crds-check: setup
	@tmp=$$(mktemp -d); $(VENV)/bin/moe-operator crd --out $$tmp >/dev/null && \
	  diff -ru crds/ $$tmp || { echo "crds/ is stale: run 'make crds'"; exit 1; }

## controlplane: build (or reuse the cached) kube-apiserver + etcd
controlplane: setup
	@bash e2e/controlplane/build.sh

cluster-up: controlplane
	@bash e2e/controlplane/up.sh

cluster-down:
	@bash e2e/controlplane/down.sh

## test: lint, types, layers, CRDs, then every test tier (unit, integration, e2e/local)
test: lint typecheck importlint crds-check controlplane
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

integration: setup controlplane
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

e2e: setup controlplane
	$(PY) -m pytest -q e2e/local $(PYTEST_ARGS)

## demo: the operator on a local control plane resizes a live deployment 2->4->2 under load
demo: setup controlplane
	$(PY) -m e2e.local.demo

## demo-runtime: the runtime alone (no Kubernetes): moe-runtime serve at DP=2
demo-runtime: setup
	$(PY) -m e2e.local.demo_runtime

## bench: every benchmark, one after the other (prints figures; asserts nothing)
bench: setup controlplane
	$(PY) bench/forward.py
	$(PY) bench/serve.py
	$(PY) bench/resize.py
	$(PY) bench/operator.py

clean: cluster-down
	rm -rf .cluster .pytest_cache .mypy_cache .ruff_cache
