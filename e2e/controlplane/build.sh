#!/usr/bin/env bash
# Build (or reuse) the Kubernetes pieces the tests run: kube-apiserver, kube-controller-manager,
# kube-scheduler and kubelet (one Kubernetes version, one Go module), etcd, KubeRay's CRDs, helm.
# The node also gets CoreDNS and kube-router (its network-policy controller).
#
#   build.sh            the control plane only (kube-apiserver + etcd + CRDs): tests/integration
#   build.sh --node     also kube-controller-manager, kube-scheduler, kubelet, kube-proxy,
#                       CoreDNS and kube-router (the real node tier, e2e/node)
#
# Everything lands in ${MOE_CACHE:-~/.cache/elastic-moe}; stamp files holding the versions make
# a second run a no-op. Safe to run concurrently from several shells (flock). Builds run under
# `nice` and print one line per step with its duration.
set -euo pipefail

K8S_VERSION="${MOE_K8S_VERSION:-v1.36.3}"
KUBERAY_VERSION="${MOE_KUBERAY_VERSION:-v1.5.0}"
ETCD_GO_VERSION="${MOE_ETCD_GO_VERSION:-v3.6.5}"
HELM_VERSION="${MOE_HELM_VERSION:-v3.22.0}"
CACHE="${MOE_CACHE:-$HOME/.cache/elastic-moe}"
BIN="$CACHE/bin"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"

NODE=0
[[ "${1:-}" == "--node" ]] && NODE=1

mkdir -p "$BIN" "$CACHE/crds"
exec 9>"$CACHE/controlplane.lock"
flock 9

log() { echo "[build] $*" >&2; }
t_start=0
begin() { t_start=$(date +%s); log "$*"; }
done_in() { log "  done in $(($(date +%s) - t_start))s"; }

# --- helm (to render the chart in tests; best effort) ------------------------------------------
if [[ ! -x "$BIN/helm-$HELM_VERSION" ]]; then
  begin "building helm $HELM_VERSION from helm.sh/helm/v3 (about 2 minutes)"
  helm_tmp="$(mktemp -d)"
  if GOBIN="$helm_tmp" nice -n 10 go install -trimpath -ldflags="-s -w" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2; then
    mv "$helm_tmp/helm" "$BIN/helm-$HELM_VERSION"
    done_in
  else
    log "WARNING: helm $HELM_VERSION did not build; the chart test will be skipped"
  fi
  rm -rf "$helm_tmp"
fi
[[ -x "$BIN/helm-$HELM_VERSION" ]] && ln -sfn "$BIN/helm-$HELM_VERSION" "$BIN/helm"

# --- KubeRay's CRDs (RayCluster, RayJob, RayService: its controllers watch all three) ----------
module_dir() { # module@version -> its directory in the module cache
  (cd "$CACHE" && go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
}
if [[ ! -s "$CACHE/crds/$KUBERAY_VERSION/ray.io_rayservices.yaml" ]]; then
  begin "fetching KubeRay $KUBERAY_VERSION CRDs (module github.com/ray-project/kuberay/ray-operator)"
  dir="$(module_dir "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION")"
  mkdir -p "$CACHE/crds/$KUBERAY_VERSION"
  for crd in rayclusters rayjobs rayservices; do
    install -m 0644 "$dir/config/crd/bases/ray.io_$crd.yaml" "$CACHE/crds/$KUBERAY_VERSION/"
  done
  done_in
fi
for crd in rayclusters rayjobs rayservices; do
  ln -sfn "$KUBERAY_VERSION/ray.io_$crd.yaml" "$CACHE/crds/ray.io_$crd.yaml"
done

# --- etcd (Debian's, or built from its Go module) ----------------------------------------------
install_etcd() {
  local found=""
  if [[ "${MOE_ETCD_FROM_GO:-0}" != 1 ]]; then
    found="$(command -v etcd || true)"
  fi
  if [[ -z "$found" && "${MOE_ETCD_FROM_GO:-0}" != 1 && "$(id -u)" == 0 ]] &&
    command -v apt-get >/dev/null; then
    begin "installing etcd-server with apt"
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1; }; then
      found="$(command -v etcd || true)"
      done_in
    fi
  fi
  if [[ -n "$found" ]]; then
    ln -sfn "$found" "$BIN/etcd"
    return
  fi
  begin "building etcd $ETCD_GO_VERSION from the Go module go.etcd.io/etcd/server/v3"
  local src="$CACHE/src/etcd-$ETCD_GO_VERSION"
  mkdir -p "$src"
  # `go install module@version` refuses modules whose go.mod has replace lines (etcd's has), so
  # build a tiny main module that requires the server module instead.
  cat >"$src/go.mod" <<GOMOD
module elasticmoe.local/etcd

go 1.24

require go.etcd.io/etcd/server/v3 $ETCD_GO_VERSION
GOMOD
  cat >"$src/main.go" <<'GO'
// Command etcd is the upstream etcd server, built from the go.etcd.io/etcd/server/v3 module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
GO
  (cd "$src" && go mod tidy && nice -n 10 go build -trimpath -ldflags="-s -w" \
    -o "$BIN/etcd-$ETCD_GO_VERSION.tmp" .)
  mv "$BIN/etcd-$ETCD_GO_VERSION.tmp" "$BIN/etcd-$ETCD_GO_VERSION"
  ln -sfn "$BIN/etcd-$ETCD_GO_VERSION" "$BIN/etcd"
  done_in
}
[[ -x "$BIN/etcd" ]] || install_etcd

# --- Kubernetes components, one module ----------------------------------------------------------
# A main module that requires k8s.io/kubernetes (staging modules mapped to their published
# versions, as upstream's own go.mod maps them to ./staging) and holds each component's upstream
# main package under cmd/. Building every wanted component in one `go build` compiles shared
# packages once. The version is stamped in, so `kubectl version` and the node report it.
COMPONENTS=(kube-apiserver)
((NODE)) && COMPONENTS+=(kube-controller-manager kube-scheduler kubelet kube-proxy)
missing=()
for c in "${COMPONENTS[@]}"; do
  [[ -x "$BIN/$c-$K8S_VERSION" ]] || missing+=("$c")
done
if ((${#missing[@]})); then
  src="$CACHE/src/kubernetes-$K8S_VERSION"
  mkdir -p "$src"
  if [[ ! -f "$src/go.mod" ]]; then
    gomod="$(cd "$src" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
      sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
    [[ -f "$gomod" ]] || { log "cannot find go.mod of k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
    staging_version="v0.${K8S_VERSION#v1.}"
    {
      echo "module elasticmoe.local/kubernetes"
      echo
      echo "go $(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod")"
      echo
      echo "require k8s.io/kubernetes $K8S_VERSION"
      echo
      echo "replace ("
      sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._/-]*\) => \./staging/src/.*$#\t\1 => \1 '"$staging_version"'#p' "$gomod"
      echo ")"
    } >"$src/go.mod.tmp"
    mv "$src/go.mod.tmp" "$src/go.mod"
  fi
  added=0
  for c in "${missing[@]}"; do
    [[ -d "$src/cmd/$c" ]] && continue
    kdir="${kdir:-$(module_dir "k8s.io/kubernetes@$K8S_VERSION")}"
    mkdir -p "$src/cmd/$c"
    # each upstream cmd/<component> is one main package (apiserver.go, kubelet.go, ...)
    for f in "$kdir/cmd/$c"/*.go; do
      [[ "$f" == *_test.go ]] && continue
      install -m 0644 "$f" "$src/cmd/$c/"
    done
    added=1
  done
  if ((added)) || [[ ! -f "$src/go.sum" ]]; then
    begin "resolving k8s.io/kubernetes $K8S_VERSION dependencies (go mod tidy)"
    (cd "$src" && go mod tidy >&2)
    done_in
  fi
  V=k8s.io/component-base/version
  CV=k8s.io/client-go/pkg/version
  minor="${K8S_VERSION#v1.}"
  minor="${minor%%.*}"
  LD="-s -w"
  for p in $V $CV; do
    LD+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    LD+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  out="$src/out"
  mkdir -p "$out"
  targets=()
  for c in "${missing[@]}"; do targets+=("./cmd/$c"); done
  begin "building ${missing[*]} $K8S_VERSION (cold: about 5 min for the apiserver, 4 more for the node's; ~2 GB RAM)"
  (cd "$src" && nice -n 10 go build -trimpath -ldflags="$LD" -o "$out/" "${targets[@]}")
  for c in "${missing[@]}"; do
    mv "$out/$c" "$BIN/$c-$K8S_VERSION"
  done
  done_in
fi
for c in "${COMPONENTS[@]}"; do
  ln -sfn "$c-$K8S_VERSION" "$BIN/$c"
done
# --- CoreDNS (the node's cluster DNS; a plain `go install`, its go.mod has no replace lines) ----
COREDNS_VERSION="${MOE_COREDNS_VERSION:-v1.15.0}"
if ((NODE)) && [[ ! -x "$BIN/coredns-$COREDNS_VERSION" ]]; then
  begin "building CoreDNS $COREDNS_VERSION from github.com/coredns/coredns (about 3 minutes)"
  gobin="$(mktemp -d)"
  CGO_ENABLED=0 GOBIN="$gobin" nice -n 10 go install -trimpath -ldflags="-s -w" \
    "github.com/coredns/coredns@$COREDNS_VERSION"
  mv "$gobin/coredns" "$BIN/coredns-$COREDNS_VERSION"
  rm -rf "$gobin"
  done_in
fi
((NODE)) && ln -sfn "coredns-$COREDNS_VERSION" "$BIN/coredns"
# --- kube-router (the node's NetworkPolicy enforcement: only its policy controller runs) -----
# A plain `go install` (its go.mod has no replace lines). v2.1.0 is the version the Go proxy
# serves here; its reported advisory (GHSA-phqm-jgc3-qf8g) is in the service proxy, which the
# node never runs (--run-service-proxy=false). Cold: about 3.5 minutes, ~1 GB RAM.
KUBE_ROUTER_VERSION="${MOE_KUBE_ROUTER_VERSION:-v2.1.0}"
if ((NODE)) && [[ ! -x "$BIN/kube-router-$KUBE_ROUTER_VERSION" ]]; then
  begin "building kube-router $KUBE_ROUTER_VERSION from github.com/cloudnativelabs/kube-router/v2 (about 3.5 minutes)"
  gobin="$(mktemp -d)"
  CGO_ENABLED=0 GOBIN="$gobin" nice -n 10 go install -trimpath -ldflags="-s -w" \
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
  mv "$gobin/kube-router" "$BIN/kube-router-$KUBE_ROUTER_VERSION"
  rm -rf "$gobin"
  done_in
fi
((NODE)) && ln -sfn "kube-router-$KUBE_ROUTER_VERSION" "$BIN/kube-router"
log "ready: ${COMPONENTS[*]} $K8S_VERSION, etcd ($("$BIN/etcd" --version 2>/dev/null | head -n1)), KubeRay $KUBERAY_VERSION CRDs"
