#!/usr/bin/env bash
# The prepared GPU check: one command, under 10 minutes on one H200 (bench/gpu_check.py says
# what each stage measures; docs/GPU.md the figures and how to run it through the
# device tool). `--dry-run` runs every stage on the CPU (make test does: never rots).
#
#   bash bench/gpu_check.sh [--dry-run] [--family mixtral] [--only forward,step]
#
# Python: $PYTHON, else the first of .venv/bin/python, python3, python that imports torch (the
# device image's python3 holds torch, transformers, httpx; nothing can be installed there).
# What that image lacks for the serve stage (fastapi, uvicorn, pydantic) comes as wheels in
# .whl/ (bench/gpu_wheels.sh fetches them here; carry ".whl"), installed into /tmp only.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  for candidate in .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" 2>/dev/null; then
      py="$candidate"
      break
    fi
  done
fi
if [ -z "$py" ]; then
  echo "gpu_check: no python that imports torch (set PYTHON)" >&2
  exit 2
fi
site=""
if [ -d .whl ] && ! "$py" -c "import fastapi, uvicorn, pydantic" 2>/dev/null; then
  site="/tmp/gpu-check-site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
fi
export PYTHONPATH="$PWD/contract:$PWD/operator:$PWD/runtime:$PWD${site:+:$site}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec timeout "${GPU_CHECK_TIMEOUT:-570}" "$py" -m bench.gpu_check "$@"
