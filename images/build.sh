#!/usr/bin/env bash
# Build the project's container images with Docker, offline (`make images`):
#
#   ghcr.io/elastic-moe/runtime:VERSION      Ray + PyTorch + moe-runtime (head and worker pods)
#   ghcr.io/elastic-moe/runtime:VERSION-gpu  the same + cupy (GPU nodes; MOE_IMAGE_VARIANTS=cpu,gpu)
#   ghcr.io/elastic-moe/operator:VERSION     kopf + moe-operator
#   quay.io/kuberay/operator:KUBERAY         KubeRay's operator, built from its Go module
#   registry.k8s.io/pause:3.10               the pod sandbox, from Kubernetes' pause.c
#
# No registry can be reached here, so the base is made locally (debootstrap, `docker import`)
# and wheels come from PyPI into a cache (the versions of the project's virtual environment).
# Each image is saved as a tarball under $MOE_CACHE/images/ beside a stamp of its inputs; a
# run whose inputs did not change builds nothing. The Docker daemon is our own (data under
# $MOE_CACHE/docker, no bridge, no iptables rules): started for the build, stopped after it.
#
# Environment: MOE_IMAGE_BASE (default: the local debootstrap base; production:
# rayproject/ray:2.60.0-py311-cpu with MOE_PIP_ONLINE=1), MOE_IMAGE_VARIANTS (cpu | cpu,gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
CACHE="${MOE_CACHE:-$HOME/.cache/elastic-moe}"
OUT="$CACHE/images"
PY="$ROOT/.venv/bin/python"
VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("elastic-moe"))')"
KUBERAY_VERSION="${MOE_KUBERAY_VERSION:-v1.5.0}"
VARIANTS="${MOE_IMAGE_VARIANTS:-cpu}"
REGISTRY="${MOE_IMAGE_REGISTRY:-ghcr.io/elastic-moe}"
DOCKER_DIR="$CACHE/docker"
SOCK="$DOCKER_DIR/docker.sock"
DOCKER=(/usr/bin/docker -H "unix://$SOCK")
export DOCKER_BUILDKIT=1
mkdir -p "$OUT" "$DOCKER_DIR"
exec 8>"$OUT/.lock"
flock 8

log() { echo "[images] $*" >&2; }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0))s"; }

# --- inputs and their stamps -------------------------------------------------------------------
hash_files() { sha256sum "$@" | sha256sum | cut -c1-16; }
app_hash="$(cd "$ROOT" && git ls-files -z -- pyproject.toml contract runtime operator 2>/dev/null |
  xargs -0 sha256sum | sha256sum | cut -c1-16)"
freeze="$("$ROOT/.venv/bin/pip" freeze --exclude-editable 2>/dev/null | grep -v -i '^elastic-moe')"
deps_hash="$(printf '%s\n' "$freeze" | sha256sum | cut -c1-16)"
base_image="${MOE_IMAGE_BASE:-elastic-moe/base:bookworm}"

declare -A WANT  # image name -> stamp of its inputs
# What goes into an image: its Dockerfile and the inputs named; bump BUILD_FORMAT when this
# script changes what it puts in a build context (a change of how the daemon runs rebuilds nothing).
BUILD_FORMAT=1
stamp_of() { # name dockerfile extra...
  local name=$1 dockerfile=$2; shift 2
  echo "$BUILD_FORMAT-$(hash_files "$dockerfile")-$*"
}
WANT["$REGISTRY/operator:$VERSION"]="$(stamp_of operator images/operator/Dockerfile "$deps_hash" "$app_hash" "$base_image")"
for v in ${VARIANTS//,/ }; do
  tag="$VERSION"
  [[ "$v" == gpu ]] && tag="$VERSION-gpu"
  WANT["$REGISTRY/runtime:$tag"]="$(stamp_of runtime images/runtime/Dockerfile "$deps_hash" "$app_hash" "$base_image" "$v")"
done
K8S_VERSION="${MOE_K8S_VERSION:-v1.36.3}"
WANT["registry.k8s.io/pause:3.10"]="$(stamp_of pause images/pause/Dockerfile "$K8S_VERSION")"
WANT["quay.io/kuberay/operator:$KUBERAY_VERSION"]="$(stamp_of kuberay images/kuberay/Dockerfile "$KUBERAY_VERSION")"

tarball() { echo "$OUT/$(echo "$1" | tr '/:' '__').tar"; }
todo=()
for name in "${!WANT[@]}"; do
  tar="$(tarball "$name")"
  if [[ -s "$tar" && "$(cat "$tar.stamp" 2>/dev/null)" == "${WANT[$name]}" ]]; then
    continue
  fi
  todo+=("$name")
done
if ((${#todo[@]} == 0)); then
  log "cached: ${!WANT[*]}"
  exit 0
fi
log "to build: ${todo[*]}"

# --- our own Docker daemon ---------------------------------------------------------------------
command -v dockerd >/dev/null || bash scripts/apt-install.sh docker.io
dockerd_pid=""
stop_dockerd() {
  [[ -n "$dockerd_pid" ]] || return 0
  kill -TERM "$dockerd_pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$dockerd_pid" 2>/dev/null || true
  dockerd_pid=""
}
trap stop_dockerd EXIT
if ! "${DOCKER[@]}" info >/dev/null 2>&1; then
  log "starting dockerd (data root $DOCKER_DIR/root; no bridge, no iptables)"
  rm -f "$SOCK"
  # 8>&-: the daemon must not inherit the build lock (a dockerd left by an interrupted build
  # would hold it and the next build would wait forever)
  setsid dockerd --host "unix://$SOCK" --data-root "$DOCKER_DIR/root" \
    --exec-root /run/elastic-moe-docker --pidfile "$DOCKER_DIR/dockerd.pid" \
    --bridge=none --iptables=false --ip-masq=false --ip-forward=false \
    >>"$DOCKER_DIR/dockerd.log" 2>&1 </dev/null 8>&- &
  dockerd_pid=$!
  for _ in $(seq 1 200); do
    "${DOCKER[@]}" info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { tail -n 20 "$DOCKER_DIR/dockerd.log" >&2; exit 1; }
    sleep 0.1
  done
  "${DOCKER[@]}" info >/dev/null
fi

# --- the local base ----------------------------------------------------------------------------
if [[ -z "${MOE_IMAGE_BASE:-}" ]]; then
  rootfs="$CACHE/images/base-bookworm.tar.gz"
  base_stamp="$(hash_files images/base/mkrootfs.sh)"
  if [[ ! -s "$rootfs" || "$(cat "$rootfs.stamp" 2>/dev/null)" != "$base_stamp" ]]; then
    bash images/base/mkrootfs.sh "$rootfs"
    echo "$base_stamp" >"$rootfs.stamp"
  fi
  if [[ "$("${DOCKER[@]}" image inspect -f '{{index .Config.Labels "elasticmoe.io/base"}}' "$base_image" 2>/dev/null)" != "$base_stamp" ]]; then
    log "docker import $base_image"
    "${DOCKER[@]}" import \
      --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV HOME=/home/ray LANG=C.UTF-8' \
      --change "LABEL elasticmoe.io/base=$base_stamp" \
      --change 'CMD ["/bin/bash"]' \
      "$rootfs" "$base_image" >/dev/null
  fi
fi

# --- build contexts ----------------------------------------------------------------------------
ctx="$CACHE/images/context"
mkdir -p "$ctx"
pip_args=(--no-index --find-links=/deps)
[[ "${MOE_PIP_ONLINE:-0}" == 1 ]] && pip_args=()

prepare_context() { # name extras -> $ctx/name with deps/ (pinned wheels) and app/ (our wheel)
  local name=$1 extras=$2 dir="$ctx/$1"
  mkdir -p "$dir/deps" "$dir/app"
  local want="$deps_hash-$extras"
  if [[ "$(cat "$dir/deps/.stamp" 2>/dev/null)" != "$want" ]]; then
    log "resolving the $extras dependencies (pinned to the virtual environment's versions)"
    printf '%s\n' "$freeze" >"$dir/constraints.txt"
    "$ROOT/.venv/bin/pip" install -q --dry-run --ignore-installed --report "$dir/report.json" \
      -c "$dir/constraints.txt" "$ROOT[$extras]" >/dev/null
    "$PY" - "$dir/report.json" >"$dir/deps/requirements.txt" <<'PYCODE'
import json, sys
report = json.load(open(sys.argv[1]))
for item in report["install"]:
    meta = item["metadata"]
    if meta["name"].lower().replace("_", "-") != "elastic-moe":
        print(f'{meta["name"]}=={meta["version"]}')
PYCODE
    log "downloading $(wc -l <"$dir/deps/requirements.txt") wheels into the cache (the runtime's are ~3.5 GB)"
    # One shared wheel store: the runtime's and the operator's sets overlap.
    mkdir -p "$CACHE/wheels"
    "$ROOT/.venv/bin/pip" download -q --only-binary=:all: --no-deps -d "$CACHE/wheels" \
      -r "$dir/deps/requirements.txt"
    find "$dir/deps" -name '*.whl' -delete
    "$PY" - "$dir/deps/requirements.txt" "$CACHE/wheels" "$dir/deps" <<'PYCODE'
import os, re, sys
from packaging.utils import canonicalize_name, parse_wheel_filename
reqs, store, dest = sys.argv[1:]
want = {}
for line in open(reqs):
    name, version = line.strip().split("==")
    want[canonicalize_name(name)] = version
found = set()
for fn in os.listdir(store):
    if not fn.endswith(".whl"):
        continue
    name, version, _, _ = parse_wheel_filename(fn)
    if want.get(name) == str(version):
        os.link(os.path.join(store, fn), os.path.join(dest, fn))
        found.add(name)
missing = sorted(set(want) - found)
if missing:
    sys.exit(f"wheels missing from {store}: {missing}")
PYCODE
    echo "$want" >"$dir/deps/.stamp"
  fi
  rm -rf "$dir/app" && mkdir -p "$dir/app"
  "$ROOT/.venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$dir/app" "$ROOT" >/dev/null
  rm -rf "$ROOT/build"  # setuptools' in-tree scratch
}

build() { # name tag dockerfile-dir [--build-arg ...]
  local name=$1 dir=$2; shift 2
  local tar
  tar="$(tarball "$name")"
  log "docker build $name ($(elapsed) so far)"
  "${DOCKER[@]}" build -q --network=none -t "$name" "$@" "$dir" >/dev/null
  log "docker save $name ($("${DOCKER[@]}" image inspect -f '{{.Size}}' "$name" | awk '{printf "%.2f GB", $1/1e9}'))"
  "${DOCKER[@]}" save -o "$tar.tmp" "$name"
  mv "$tar.tmp" "$tar"
  "${DOCKER[@]}" image inspect -f '{{.Id}}' "$name" >"$tar.id"
  echo "${WANT[$name]}" >"$tar.stamp"
}

for name in "${todo[@]}"; do
  case "$name" in
    "$REGISTRY"/runtime:*)
      extras=runtime
      [[ "$name" == *-gpu ]] && extras=runtime,gpu
      prepare_context "runtime-${extras//,/-}" "$extras"
      cp images/runtime/Dockerfile "$ctx/runtime-${extras//,/-}/Dockerfile"
      build "$name" "$ctx/runtime-${extras//,/-}" --build-arg "BASE_IMAGE=$base_image" \
        --build-arg "EXTRAS=$extras" --build-arg "PIP_ARGS=${pip_args[*]}"
      ;;
    "$REGISTRY"/operator:*)
      prepare_context operator operator
      cp images/operator/Dockerfile "$ctx/operator/Dockerfile"
      build "$name" "$ctx/operator" --build-arg "BASE_IMAGE=$base_image" \
        --build-arg "PIP_ARGS=${pip_args[*]}"
      ;;
    registry.k8s.io/pause:*)
      dir="$ctx/pause"
      mkdir -p "$dir"
      src="$(cd "$CACHE" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
        sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')/build/pause/linux/pause.c"
      gcc -Os -Wall -Werror -static -DVERSION="$K8S_VERSION-elastic-moe" -o "$dir/pause" "$src"
      strip "$dir/pause"
      cp images/pause/Dockerfile "$dir/Dockerfile"
      build "$name" "$dir"
      ;;
    quay.io/kuberay/operator:*)
      dir="$ctx/kuberay"
      mkdir -p "$dir"
      if [[ ! -x "$CACHE/bin/ray-operator-$KUBERAY_VERSION" ]]; then
        log "building the KubeRay operator $KUBERAY_VERSION from its Go module (about 2 minutes)"
        gobin="$(mktemp -d)"
        CGO_ENABLED=0 GOBIN="$gobin" GOFLAGS=-buildvcs=false nice -n 10 go install -trimpath \
          -ldflags="-s -w" "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"
        mkdir -p "$CACHE/bin"
        mv "$gobin/ray-operator" "$CACHE/bin/ray-operator-$KUBERAY_VERSION"
        rm -rf "$gobin"
      fi
      install -m 0755 "$CACHE/bin/ray-operator-$KUBERAY_VERSION" "$dir/manager"
      cp images/kuberay/Dockerfile "$dir/Dockerfile"
      build "$name" "$dir"
      ;;
  esac
done
log "built ${todo[*]} in $(elapsed)"
