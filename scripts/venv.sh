#!/usr/bin/env bash
# Create or reuse the project's virtual environment and link it at .venv.
#
# The environment itself lives in a per-machine cache (PyTorch from PyPI is several GB), keyed by
# the Python version; it is (re)installed only when the dependency lists in pyproject.toml change,
# and the project is always re-pointed (editable) at the checkout that runs this script.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
CACHE="${MOE_CACHE:-$HOME/.cache/elastic-moe}"
PYVER="$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')"
VENV="${MOE_VENV:-$CACHE/venv-$PYVER}"
EXTRAS="${MOE_EXTRAS:-operator,runtime,test}"
mkdir -p "$CACHE"

if [ ! -x "$VENV/bin/python" ]; then
    echo "venv: creating $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi

# .venv in the checkout is a link to the cached environment (or a real directory if one exists).
if [ ! -e .venv ] || [ -L .venv ]; then
    ln -sfn "$VENV" .venv
fi

# Every package at the version constraints.txt names (the suite's last pass: scripts/constraints.sh
# says how to move on), so a fresh machine installs what this one tested.
STAMP="$VENV/.elastic-moe-deps"
WANT="$({ sed -n '/^dependencies = \[/,/^\[tool/p' pyproject.toml; cat constraints.txt; } |
    sha256sum | cut -c1-16)-$EXTRAS"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
    echo "venv: installing dependencies ($EXTRAS, pinned by constraints.txt) into $VENV (first run downloads PyTorch, several GB)"
    "$VENV/bin/pip" install -q -c constraints.txt -e ".[$EXTRAS]"
    echo "$WANT" > "$STAMP"
fi

# Point the editable install at this checkout (cheap when it already does); an install made
# before a package was added (moe_contract) cannot import it and is made again.
WHERE="$("$VENV/bin/python" -c 'import moe_contract, moe_runtime, os; print(os.path.dirname(os.path.dirname(os.path.abspath(moe_runtime.__file__))))' 2>/dev/null || true)"
if [ "$WHERE" != "$ROOT/runtime" ] || [ ! -x "$VENV/bin/moe-runtime" ]; then
    echo "venv: pointing the editable install at $ROOT"
    "$VENV/bin/pip" install -q --no-deps -e .
fi
