# elastic-moe — see README.md. Every target creates or reuses .venv first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
PYTEST_ARGS ?=

.PHONY: setup test lint typecheck importlint crds crds-check unit integration e2e demo \
        demo-runtime bench controlplane node-build images cluster-up cluster-down clean \
        constraints

setup:
	@bash scripts/venv.sh

## constraints: pin constraints.txt to the virtual environment's versions (after an upgrade)
constraints: setup
	@bash scripts/constraints.sh

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

## node-build: also kube-controller-manager, kube-scheduler, kubelet, kube-proxy, CoreDNS,
## kube-router (NetworkPolicy enforcement)
node-build: setup
	@bash e2e/controlplane/build.sh --node

## images: the runtime, operator, KubeRay and pause images (Docker, offline; cached)
images: setup node-build
	@bash images/build.sh

## cluster-up: a real single-node cluster (KubeRay and our operator as pods); .cluster/kubeconfig
cluster-up: images
	$(PY) -m e2e.node up

## cluster-down: stop everything cluster-up started; no container, no host state left
cluster-down:
	@if [ -x $(PY) ]; then $(PY) -m e2e.node down; else python3 -m e2e.node down; fi

## kind-up: a kind cluster where Docker runs --privileged and pulls images (e2e/kind/kind.sh);
## KIND_GPU=1: GPU nodes (NVIDIA device plugin). kind-test (e2e-kind): e2e/cluster on it
.PHONY: kind-up kind-test e2e-kind kind-down
KIND_GPU ?=
kind-up: setup
	@bash e2e/kind/kind.sh up $(if $(KIND_GPU),--gpu)

kind-test e2e-kind: setup
	@bash e2e/kind/kind.sh test $(PYTEST_ARGS)

## kind-down: delete the kind cluster
kind-down:
	@bash e2e/kind/kind.sh down

## test: lint, types, layers, CRDs, then every test tier (unit, integration, e2e/cluster)
test: lint typecheck importlint crds-check controlplane images
	$(PY) -m pytest -q -ra --durations=30 $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

integration: setup controlplane
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

## fuzz: the runtime API against its OpenAPI schema, long (make test runs 25 examples a case)
.PHONY: fuzz
FUZZ_EXAMPLES ?= 1000
fuzz: setup
	MOE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/integration/test_fuzz.py $(PYTEST_ARGS)

## e2e: the real-node tier (starts the node, or reuses the one cluster-up started)
e2e: setup images
	$(PY) -m pytest -q e2e/cluster $(PYTEST_ARGS)

## demo: on the real node, a live deployment resized 2->4->2 under checked load
demo: setup images
	$(PY) -m e2e.cluster.demo

## demo-runtime: the runtime alone (no Kubernetes): moe-runtime serve at DP=2
demo-runtime: setup
	$(PY) -m e2e.demo_runtime

## bench: every benchmark, one after the other (prints figures; asserts nothing)
bench: setup controlplane
	$(PY) bench/forward.py
	$(PY) bench/serve.py
	$(PY) bench/resize.py
	$(PY) bench/operator.py
	$(PY) bench/eplb.py
	$(PY) bench/engine.py
	$(PY) bench/step.py
	$(PY) bench/families.py
	$(PY) -m bench.memory

clean: cluster-down
	rm -rf .cluster .pytest_cache .mypy_cache .ruff_cache
