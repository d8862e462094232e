#!/usr/bin/env bash
# Wheels the device machine's image lacks for the GPU check's serve stage (fastapi, uvicorn,
# pydantic and what they need), for its python (3.12, x86-64), into .whl/ (git-ignored through
# .git/info/exclude). Run here, where PyPI is reachable; then name ".whl" in the device run's
# carry. The image already has httpx, anyio, h11, click, typing-extensions, prometheus-client.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
mkdir -p .whl
py="${PYTHON:-.venv/bin/python}"
for pkg in fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn; do
  version=$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'))")
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$pkg==$version"
done
ls -la .whl
