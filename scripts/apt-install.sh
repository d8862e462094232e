#!/usr/bin/env bash
# Install Debian packages that are missing (no-op for the ones present); `apt-get update` once
# when an install fails (a fresh machine may have no package lists). Needs root.
#   scripts/apt-install.sh PACKAGE...
set -euo pipefail
missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
((${#missing[@]})) || exit 0
if [[ "$(id -u)" != 0 ]]; then
  echo "[apt] need root to install: ${missing[*]}" >&2
  exit 1
fi
echo "[apt] installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >/tmp/elastic-moe-apt.log 2>&1; then
  apt-get update -q >>/tmp/elastic-moe-apt.log 2>&1 || true
  apt-get install -y -q --no-install-recommends "${missing[@]}" >>/tmp/elastic-moe-apt.log 2>&1 || {
    tail -n 20 /tmp/elastic-moe-apt.log >&2
    echo "[apt] could not install ${missing[*]} (log: /tmp/elastic-moe-apt.log)" >&2
    exit 1
  }
fi
