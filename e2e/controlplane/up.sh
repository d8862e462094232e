#!/usr/bin/env bash
# Start (or reuse) the local control plane; writes .cluster/kubeconfig. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
exec "$PY" -m e2e.controlplane.cluster up --dir .cluster "$@"
