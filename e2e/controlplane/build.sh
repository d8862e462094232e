#!/usr/bin/env bash
# Build (or reuse) the local control plane: kube-apiserver, etcd and KubeRay's RayCluster CRD.
#
# Everything lands in ${MOE_CACHE:-~/.cache/elastic-moe}; a stamp file holding the versions makes
# a second run a no-op. Safe to run concurrently from several shells (flock).
set -euo pipefail

K8S_VERSION="${MOE_K8S_VERSION:-v1.36.3}"
KUBERAY_VERSION="${MOE_KUBERAY_VERSION:-v1.5.0}"
ETCD_GO_VERSION="${MOE_ETCD_GO_VERSION:-v3.6.5}"
CACHE="${MOE_CACHE:-$HOME/.cache/elastic-moe}"
BIN="$CACHE/bin"
STAMP="$CACHE/controlplane.stamp"
WANT="kube-apiserver=$K8S_VERSION kuberay=$KUBERAY_VERSION"

mkdir -p "$BIN" "$CACHE/crds"
exec 9>"$CACHE/controlplane.lock"
flock 9

log() { echo "[controlplane/build] $*" >&2; }

have_all() {
  [[ -f "$STAMP" && "$(head -n1 "$STAMP")" == "$WANT" ]] &&
    [[ -x "$BIN/kube-apiserver" && -x "$BIN/etcd" ]] &&
    [[ -s "$CACHE/crds/ray.io_rayclusters.yaml" ]]
}

# helm, to render the chart in tests (best effort: without it that one test is skipped).
HELM_VERSION="${MOE_HELM_VERSION:-v3.22.0}"
if [[ ! -x "$BIN/helm-$HELM_VERSION" ]]; then
  log "building helm $HELM_VERSION (about 2 minutes)"
  helm_tmp="$(mktemp -d)"
  if GOBIN="$helm_tmp" go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2; then
    mv "$helm_tmp/helm" "$BIN/helm-$HELM_VERSION"
  else
    log "WARNING: helm $HELM_VERSION did not build; the chart test will be skipped"
  fi
  rm -rf "$helm_tmp"
fi
[[ -x "$BIN/helm-$HELM_VERSION" ]] && ln -sfn "$BIN/helm-$HELM_VERSION" "$BIN/helm"

if have_all; then
  log "cached: $(cat "$STAMP" | tr '\n' ' ')"
  exit 0
fi

build_kube_apiserver() {
  local want_bin="$BIN/kube-apiserver-$K8S_VERSION"
  if [[ -x "$want_bin" ]]; then
    ln -sfn "$want_bin" "$BIN/kube-apiserver"
    return
  fi
  local src="$CACHE/src/kube-apiserver-$K8S_VERSION"
  local staging_version="v0.${K8S_VERSION#v1.}"
  mkdir -p "$src"
  log "building kube-apiserver $K8S_VERSION in $src (several minutes, ~2 GB RAM)"
  local gomod
  gomod="$(cd "$src" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  [[ -f "$gomod" ]] || { log "cannot find go.mod of k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
  {
    echo "module elasticmoe.local/kube-apiserver"
    echo
    echo "go $(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod")"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    # Map every staging module (k8s.io/x => ./staging/src/k8s.io/x) to its published version.
    sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._/-]*\) => \./staging/src/.*$#\t\1 => \1 '"$staging_version"'#p' "$gomod"
    echo ")"
  } >"$src/go.mod"
  cat >"$src/main.go" <<'GO'
// Command kube-apiserver is the upstream API server, built from the k8s.io/kubernetes module.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
GO
  (cd "$src" && go mod tidy && GOFLAGS=-buildvcs=false go build -trimpath -ldflags="-s -w" -o "$want_bin.tmp" .)
  mv "$want_bin.tmp" "$want_bin"
  ln -sfn "$want_bin" "$BIN/kube-apiserver"
}

install_etcd() {
  if [[ -x "$BIN/etcd" ]]; then return; fi
  local found=""
  if [[ "${MOE_ETCD_FROM_GO:-0}" != 1 ]]; then
    found="$(command -v etcd || true)"
  fi
  if [[ -z "$found" && "${MOE_ETCD_FROM_GO:-0}" != 1 && "$(id -u)" == 0 ]] &&
    command -v apt-get >/dev/null; then
    log "installing etcd-server with apt"
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1; }; then
      found="$(command -v etcd || true)"
    fi
  fi
  if [[ -n "$found" ]]; then
    ln -sfn "$found" "$BIN/etcd"
    return
  fi
  log "building etcd $ETCD_GO_VERSION from the Go module go.etcd.io/etcd/server/v3"
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
  (cd "$src" && go mod tidy && go build -trimpath -ldflags="-s -w" -o "$BIN/etcd-$ETCD_GO_VERSION.tmp" .)
  mv "$BIN/etcd-$ETCD_GO_VERSION.tmp" "$BIN/etcd-$ETCD_GO_VERSION"
  ln -sfn "$BIN/etcd-$ETCD_GO_VERSION" "$BIN/etcd"
}

fetch_raycluster_crd() {
  local dir
  dir="$(cd "$CACHE" && go mod download -json "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
  local crd="$dir/config/crd/bases/ray.io_rayclusters.yaml"
  [[ -f "$crd" ]] || { log "RayCluster CRD not found under $dir"; exit 1; }
  cp "$crd" "$CACHE/crds/ray.io_rayclusters.yaml"
  chmod u+w "$CACHE/crds/ray.io_rayclusters.yaml"
}

fetch_raycluster_crd
install_etcd
build_kube_apiserver
{
  echo "$WANT"
  echo "etcd=$("$BIN/etcd" --version 2>/dev/null | head -n1)"
} >"$STAMP"
log "ready: $(tr '\n' ' ' <"$STAMP")"
