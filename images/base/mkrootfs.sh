#!/usr/bin/env bash
# Make the local base image's root filesystem with debootstrap, as a tarball that
# `docker import` takes (no registry can be reached here, so no image is pulled).
#
#   mkrootfs.sh OUT.tar.gz
#
# Debian bookworm minbase + what KubeRay's pods and our runtime need: bash, wget (KubeRay's
# probes), ca-certificates, procps, iproute2, netbase, Python 3.11 with venv. A virtual
# environment at /opt/venv is the image's Python (the images' Dockerfiles install into it with
# `python3 -m pip`), on PATH for every shell, login shells included (/etc/profile.d), because
# KubeRay can run commands through `bash -l` (ENABLE_LOGIN_SHELL) and Debian's /etc/profile
# resets PATH. A user `ray` (uid 1000, gid 100) as in rayproject/ray.
set -euo pipefail
OUT="$1"
SUITE="${MOE_DEBIAN_SUITE:-bookworm}"
MIRROR="${MOE_DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
PACKAGES=wget,ca-certificates,procps,iproute2,netbase,python3,python3-venv,libgomp1

command -v debootstrap >/dev/null || bash "$(dirname "$0")/../../scripts/apt-install.sh" debootstrap
work="$(mktemp -d "${TMPDIR:-/tmp}/elastic-moe-rootfs.XXXXXX")"
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
echo "[images] debootstrap $SUITE (minbase + ${PACKAGES//,/ }) from $MIRROR (about a minute)" >&2
nice -n 10 debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" \
  >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

chroot "$root" /usr/bin/python3 -m venv /opt/venv
chroot "$root" /opt/venv/bin/python -m pip --version >/dev/null
chroot "$root" groupadd -f -g 100 users
chroot "$root" useradd -m -u 1000 -g 100 -s /bin/bash ray
cat >"$root/etc/profile.d/00-venv.sh" <<'SH'
# The image's Python environment comes first, also for login shells.
case ":$PATH:" in *:/opt/venv/bin:*) ;; *) PATH="/opt/venv/bin:$PATH" ;; esac
export PATH
SH
# Smaller image: no apt lists, caches, docs or man pages.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/var/log/*.log
tar --numeric-owner -C "$root" -czf "$OUT.tmp" .
mv "$OUT.tmp" "$OUT"
echo "[images] base rootfs: $(du -h "$OUT" | cut -f1) compressed" >&2
