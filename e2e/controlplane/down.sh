#!/usr/bin/env bash
# Stop the local control plane started by up.sh (the pids recorded in .cluster/state.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
exec "$PY" -m e2e.controlplane.cluster down --dir .cluster "$@"
