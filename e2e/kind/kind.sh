#!/usr/bin/env bash
# The e2e tier on kind (docs/DEVELOPMENT.md): the tests of e2e/cluster on a kind cluster, where Docker can
# run privileged containers and pull images; a GPU variant on hosts with NVIDIA GPUs.
#
#   e2e/kind/kind.sh build        kind from its Go module into ~/.cache/elastic-moe/bin (cached)
#   e2e/kind/kind.sh up [--gpu]   kind cluster (cluster.yaml | cluster-gpu.yaml), KubeRay from its
#                                 Helm chart, our images loaded, our CRD + operator from manifests/;
#                                 --gpu: nvidia-container-toolkit in the GPU node, NVIDIA device
#                                 plugin, and a check that the node advertises nvidia.com/gpu
#   e2e/kind/kind.sh test [ARGS]  pytest e2e/cluster (and e2e/kind where GPUs are advertised) with
#                                 MOE_E2E_KUBECONFIG=.cluster/kind/kubeconfig; ARGS go to pytest
#   e2e/kind/kind.sh down         delete the cluster and its kubeconfig
#
# `up` checks first what it needs and stops with the reason, before it creates anything: a Docker
# daemon (DOCKER_HOST is honoured), `docker run --privileged` (kind runs every node as a
# privileged container), the registries (Docker Hub for the node image, quay.io for KubeRay,
# nvcr.io for the device plugin), our images (`make images`), and for --gpu the host's driver
# and container toolkit (see cluster-gpu.yaml). Every wait has a deadline.
#
# Environment: MOE_KIND_CLUSTER (name, default elastic-moe), MOE_KIND_VERSION (v0.32.0),
# MOE_KIND_SKIP_REGISTRY_CHECK=1 (behind a mirror the probes cannot see), MOE_CACHE.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$(pwd)"
HERE="$ROOT/e2e/kind"
CACHE="${MOE_CACHE:-$HOME/.cache/elastic-moe}"
BIN="$CACHE/bin"
# kind v0.32.0 is the release whose default node image is Kubernetes v1.36 (kindest/node:v1.36.1,
# pinned by digest in cluster.yaml); v0.33.0 moved to v1.37.
KIND_VERSION="${MOE_KIND_VERSION:-v0.32.0}"
KIND="$BIN/kind-$KIND_VERSION"
CLUSTER="${MOE_KIND_CLUSTER:-elastic-moe}"
STATE="$ROOT/.cluster/kind"
KUBECONFIG_FILE="$STATE/kubeconfig"
KUBERAY_CHART_REPO="https://ray-project.github.io/kuberay-helm/"
KUBERAY_CHART_VERSION="1.5.0"
KUBERAY_NAMESPACE="kuberay-system"
DEVICE_PLUGIN_VERSION="v0.20.0"
DEVICE_PLUGIN_URL="https://raw.githubusercontent.com/NVIDIA/k8s-device-plugin/$DEVICE_PLUGIN_VERSION/deployments/static/nvidia-device-plugin.yml"
OPERATOR_NAMESPACE="elastic-moe-system"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
REGISTRY="${MOE_IMAGE_REGISTRY:-ghcr.io/elastic-moe}"
PULL_TIMEOUT_S="${MOE_KIND_PULL_TIMEOUT:-900}"

log() { echo "[kind] $*" >&2; }
die() {
  echo "[kind] ERROR: $*" >&2
  exit 1
}
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0))s"; }

usage() {
  sed -n '/^#   e2e\/kind\/kind.sh build/,/^#   e2e\/kind\/kind.sh down/p' "$0" | sed 's/^# //' >&2
  exit 2
}

need() { # command... : each on PATH, or die naming it
  local c
  for c in "$@"; do
    command -v "$c" >/dev/null || die "'$c' not found on PATH"
  done
}

node_image() { # the node image the config pins
  sed -n 's/^ *image: *\(kindest\/node:[^ ]*\).*/\1/p' "$1" | head -n 1
}

# --- build -------------------------------------------------------------------------------------
cmd_build() {
  if [[ -x "$KIND" ]] && "$KIND" version >/dev/null 2>&1; then
    log "cached: $KIND ($("$KIND" version))"
    return 0
  fi
  need go
  log "building kind $KIND_VERSION from sigs.k8s.io/kind (go install; about a minute)"
  local gobin
  gobin="$(mktemp -d)"
  CGO_ENABLED=0 GOBIN="$gobin" GOFLAGS=-buildvcs=false nice -n 10 go install -trimpath \
    -ldflags="-s -w" "sigs.k8s.io/kind@$KIND_VERSION" ||
    { rm -rf "$gobin"; die "go install sigs.k8s.io/kind@$KIND_VERSION failed (is the Go proxy reachable?)"; }
  mkdir -p "$BIN"
  mv "$gobin/kind" "$KIND"
  rm -rf "$gobin"
  ln -sfn "$KIND" "$BIN/kind"
  log "built $KIND ($("$KIND" version)) in $(elapsed); configs pin $(node_image "$HERE/cluster.yaml")"
}

# --- preflight ---------------------------------------------------------------------------------
check_docker() {
  need docker
  local out
  if ! out="$(timeout 20 docker info --format '{{.ServerVersion}}' 2>&1)"; then
    die "no Docker daemon answers at ${DOCKER_HOST:-unix:///var/run/docker.sock}: $(first_error "$out")
  kind runs each Kubernetes node as a Docker container: start Docker (or set DOCKER_HOST) first."
  fi
  log "Docker $out at ${DOCKER_HOST:-unix:///var/run/docker.sock}"
}

check_privileged() {
  # An empty image and a command that does not exist: where privileged containers are allowed,
  # the runtime gets as far as exec and reports the missing file; where they are refused, it
  # stops before, at the capabilities or devices of a privileged container. No registry needed.
  local image="elastic-moe/kind-preflight:empty" name="elastic-moe-kind-preflight-$$" out
  if ! docker image inspect "$image" >/dev/null 2>&1 &&
    ! tar -cf - -T /dev/null | timeout 60 docker import - "$image" >/dev/null; then
    log "WARNING: no empty image for the --privileged check (docker import failed); kind will say"
    return 0
  fi
  out="$(timeout 60 docker run --name "$name" --privileged --network none \
    --entrypoint /elastic-moe-preflight "$image" 2>&1)" || true
  timeout 30 docker rm -f "$name" >/dev/null 2>&1 || true
  timeout 30 docker rmi "$image" >/dev/null 2>&1 || true
  if grep -q -E 'no such file or directory|executable file not found' <<<"$out"; then
    log "docker run --privileged works"
    return 0
  fi
  die "docker run --privileged is refused on this host:
  $(first_error "$out")
  kind runs every node as a privileged container, so it cannot start a node here. On such a
  machine use the real-node tier instead: make cluster-up && make e2e (e2e/node, e2e/cluster)."
}

first_error() { # output: its first line that reports an error (else its first line)
  grep -m 1 -i -E 'error|denied|not permitted' <<<"$1" || grep -m 1 -v '^$' <<<"$1" || true
}

probe() { # url: reachable (any HTTP answer) within 10 s
  local code
  code="$(curl -sS -o /dev/null -w '%{http_code}' --max-time 10 "$1" 2>/dev/null)" || true
  [[ -n "$code" && "$code" != 000 ]]
}

check_registries() { # gpu(0|1)
  if [[ "${MOE_KIND_SKIP_REGISTRY_CHECK:-0}" == 1 ]]; then
    log "registry probes skipped (MOE_KIND_SKIP_REGISTRY_CHECK=1)"
    return 0
  fi
  need curl
  local -a urls=(
    "https://registry-1.docker.io/v2/"  # kindest/node
    "https://quay.io/v2/"               # quay.io/kuberay/operator (the chart's image)
    "${KUBERAY_CHART_REPO}index.yaml"   # the KubeRay Helm chart
  )
  if [[ "$1" == 1 ]]; then
    urls+=("https://nvcr.io/v2/" "$DEVICE_PLUGIN_URL"
      "https://nvidia.github.io/libnvidia-container/gpgkey")
  fi
  local url missing=()
  for url in "${urls[@]}"; do
    probe "$url" || missing+=("$url")
  done
  if ((${#missing[@]})); then
    die "not reachable from this host (10 s each): ${missing[*]}
  The kind tier pulls the node image, KubeRay and (--gpu) the device plugin and toolkit. Behind
  a registry mirror the probes cannot see, set MOE_KIND_SKIP_REGISTRY_CHECK=1."
  fi
  log "registries reachable: ${#urls[@]} probed"
}

pull_node_image() { # config
  local image
  image="$(node_image "$1")"
  [[ -n "$image" ]] || die "no kindest/node image pinned in $1"
  if docker image inspect "$image" >/dev/null 2>&1; then
    log "node image present: $image"
    return 0
  fi
  log "docker pull $image (at most ${PULL_TIMEOUT_S}s)"
  timeout "$PULL_TIMEOUT_S" docker pull -q "$image" >/dev/null ||
    die "docker pull $image failed or took over ${PULL_TIMEOUT_S}s (MOE_KIND_PULL_TIMEOUT)"
}

check_gpu_host() { # the driver answers, Docker's default runtime is NVIDIA's
  command -v nvidia-smi >/dev/null ||
    die "--gpu: nvidia-smi not found: the host needs an NVIDIA driver (R580+ for CUDA 13)"
  local gpus
  gpus="$(timeout 30 nvidia-smi -L 2>&1)" || die "nvidia-smi -L failed: $gpus (is the NVIDIA driver loaded?)"
  [[ "$gpus" == *GPU* ]] || die "nvidia-smi -L lists no GPU"
  log "host GPUs: $(grep -c '^GPU' <<<"$gpus")"
  local runtime
  runtime="$(timeout 20 docker info --format '{{.DefaultRuntime}}')"
  [[ "$runtime" == nvidia ]] || die "Docker's default runtime is '$runtime', not nvidia: run
  sudo nvidia-ctk runtime configure --runtime=docker --set-as-default --cdi.enabled
  sudo nvidia-ctk config --set accept-nvidia-visible-devices-as-volume-mounts=true --in-place
  sudo systemctl restart docker"
}

check_gpu_container() { # config: its node image (pulled) sees the GPUs the way kind's node will
  local out
  out="$(timeout 120 docker run --rm -v /dev/null:/var/run/nvidia-container-devices/all \
    --entrypoint nvidia-smi "$(node_image "$1")" -L 2>&1)" ||
    die "a container given /var/run/nvidia-container-devices/all sees no GPU: $out
  set accept-nvidia-visible-devices-as-volume-mounts = true in
  /etc/nvidia-container-runtime/config.toml and restart Docker (see e2e/kind/cluster-gpu.yaml)"
  log "a container sees the host's GPUs through the volume-mount device list"
}

# Where each image comes from: the tarball `make images` saved (stamped with its inputs; built by
# the project's own dockerd, so not in the Docker that runs kind), else Docker's store.
image_tarball() { echo "$CACHE/images/$(echo "$1" | tr '/:' '__').tar"; }
images_wanted() { # gpu(0|1)
  echo "$REGISTRY/operator:$VERSION"
  echo "$REGISTRY/runtime:$VERSION"
  [[ "$1" == 1 ]] && echo "$REGISTRY/runtime:$VERSION-gpu"
  return 0
}
check_images() { # gpu(0|1)
  local image missing=()
  while read -r image; do
    [[ -s "$(image_tarball "$image")" ]] || docker image inspect "$image" >/dev/null 2>&1 ||
      missing+=("$image")
  done < <(images_wanted "$1")
  if ((${#missing[@]})); then
    local hint="make images"
    [[ "$1" == 1 ]] && hint="MOE_IMAGE_VARIANTS=cpu,gpu make images"
    die "not under $CACHE/images/ nor in Docker: ${missing[*]}; build them: $hint"
  fi
  log "images found: $(images_wanted "$1" | tr '\n' ' ')"
}

# --- up ----------------------------------------------------------------------------------------
kubectl_() { timeout "${KUBECTL_TIMEOUT:-300}" kubectl --kubeconfig "$KUBECONFIG_FILE" "$@"; }

helm_bin() {
  if command -v helm >/dev/null; then
    command -v helm
  elif [[ -x "$BIN/helm" ]]; then
    echo "$BIN/helm"
  else
    die "helm not found: install it, or 'make controlplane' builds it into $BIN"
  fi
}

cluster_exists() {
  timeout 30 "$KIND" get clusters 2>/dev/null | grep -qx "$CLUSTER"
}

load_images() { # gpu(0|1)
  local image tar
  while read -r image; do
    tar="$(image_tarball "$image")"
    if [[ -s "$tar" ]]; then
      log "kind load image-archive $tar ($(du -h "$tar" | cut -f1))"
      timeout 900 "$KIND" load image-archive --name "$CLUSTER" "$tar" >&2
    else
      log "kind load docker-image $image"
      timeout 900 "$KIND" load docker-image --name "$CLUSTER" "$image" >&2
    fi || die "loading $image into the kind nodes failed (output above)"
  done < <(images_wanted "$1")
}

gpu_worker_nodes() { # the node containers given GPUs (the config's extraMounts)
  local node
  for node in $(timeout 30 "$KIND" get nodes --name "$CLUSTER"); do
    if timeout 30 docker exec "$node" test -d /var/run/nvidia-container-devices; then
      echo "$node"
    fi
  done
}

setup_gpu_node() { # node: nvidia-container-toolkit in it, `nvidia` its containerd's default
  local node=$1
  log "$node: installing nvidia-container-toolkit (apt, from nvidia.github.io)"
  timeout 600 docker exec "$node" bash -euo pipefail -c '
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q gpg >/dev/null
    curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey |
      gpg --batch --yes --dearmor -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
    curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list |
      sed "s#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] https://#g" \
      >/etc/apt/sources.list.d/nvidia-container-toolkit.list
    apt-get update -q >/dev/null
    apt-get install -y -q nvidia-container-toolkit >/dev/null
    nvidia-ctk runtime configure --runtime=containerd --config-source=file --set-as-default
    systemctl restart containerd
    nvidia-smi -L
  ' >&2 || die "$node: setting up nvidia-container-toolkit failed (output above)"
  kubectl_ wait --for=condition=Ready "node/$node" --timeout=180s >/dev/null ||
    die "$node: not Ready after containerd's restart"
}

wait_for_gpus() { # node...: each advertises nvidia.com/gpu within 180 s
  local node n deadline=$(($(date +%s) + 180))
  for node in "$@"; do
    while :; do
      n="$(kubectl_ get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')"
      [[ -n "$n" && "$n" != 0 ]] && break
      (($(date +%s) < deadline)) ||
        die "$node advertises no nvidia.com/gpu after 180s: kubectl -n kube-system logs ds/nvidia-device-plugin-daemonset"
      sleep 2
    done
    log "$node: nvidia.com/gpu = $n"
  done
}

cmd_up() {
  local gpu=0 config="$HERE/cluster.yaml"
  while (($#)); do
    case "$1" in
      --gpu) gpu=1 config="$HERE/cluster-gpu.yaml" ;;
      *) die "up: unknown option '$1' (only --gpu)" ;;
    esac
    shift
  done
  need kubectl timeout
  cmd_build
  log "preflight ($(basename "$config"))"
  check_docker
  check_privileged
  [[ "$gpu" == 1 ]] && check_gpu_host
  check_registries "$gpu"
  check_images "$gpu"
  local helm
  helm="$(helm_bin)"
  pull_node_image "$config"
  [[ "$gpu" == 1 ]] && check_gpu_container "$config"

  mkdir -p "$STATE"
  if cluster_exists; then
    log "cluster '$CLUSTER' exists: reusing it"
    timeout 60 "$KIND" export kubeconfig --name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE" >&2
  else
    log "kind create cluster --name $CLUSTER --config $(basename "$config") (at most 10 min)"
    timeout 900 "$KIND" create cluster --name "$CLUSTER" --config "$config" \
      --kubeconfig "$KUBECONFIG_FILE" --wait 10m >&2 ||
      die "kind create cluster failed (output above); 'e2e/kind/kind.sh down' removes what is left"
  fi

  local gpu_nodes=()
  if [[ "$gpu" == 1 ]]; then
    mapfile -t gpu_nodes < <(gpu_worker_nodes)
    ((${#gpu_nodes[@]})) || die "no node of '$CLUSTER' has the GPU mount: was it created without --gpu?"
    local node
    for node in "${gpu_nodes[@]}"; do setup_gpu_node "$node"; done
  fi

  load_images "$gpu"

  log "KubeRay $KUBERAY_CHART_VERSION from its Helm chart (kuberay/kuberay-operator, $KUBERAY_CHART_REPO)"
  timeout 600 "$helm" upgrade --install kuberay-operator kuberay-operator \
    --repo "$KUBERAY_CHART_REPO" --version "$KUBERAY_CHART_VERSION" \
    --namespace "$KUBERAY_NAMESPACE" --create-namespace \
    --kubeconfig "$KUBECONFIG_FILE" --wait --timeout 5m >&2 ||
    die "helm install of kuberay-operator $KUBERAY_CHART_VERSION failed (output above)"

  log "our CRD and operator: kubectl apply --server-side -k manifests/"
  kubectl_ apply --server-side -k manifests/ >&2
  kubectl_ -n "$OPERATOR_NAMESPACE" rollout status deploy/moe-operator --timeout=180s >&2 ||
    die "the operator did not become ready: kubectl -n $OPERATOR_NAMESPACE logs deploy/moe-operator"

  if [[ "$gpu" == 1 ]]; then
    log "NVIDIA device plugin $DEVICE_PLUGIN_VERSION ($DEVICE_PLUGIN_URL)"
    kubectl_ apply -f "$DEVICE_PLUGIN_URL" >&2
    kubectl_ -n kube-system rollout status ds/nvidia-device-plugin-daemonset --timeout=300s >&2 ||
      die "the device plugin DaemonSet did not roll out"
    wait_for_gpus "${gpu_nodes[@]}"
  fi
  log "up in $(elapsed): KUBECONFIG=$KUBECONFIG_FILE; next: e2e/kind/kind.sh test"
}

# --- test / down -------------------------------------------------------------------------------
cmd_test() {
  [[ -s "$KUBECONFIG_FILE" ]] || die "no $KUBECONFIG_FILE: run 'e2e/kind/kind.sh up' first"
  [[ -x "$ROOT/.venv/bin/python" ]] || die "no .venv: run 'make setup' first"
  kubectl_ get --raw /readyz >/dev/null 2>&1 ||
    die "the kind cluster does not answer at $KUBECONFIG_FILE: is it up? (e2e/kind/kind.sh up)"
  local paths=(e2e/cluster)
  if [[ -n "$(kubectl_ get nodes -o jsonpath='{.items[*].status.allocatable.nvidia\.com/gpu}')" ]]; then
    paths+=(e2e/kind)  # the GPU sample: only where a node advertises GPUs
  fi
  log "pytest ${paths[*]} against $KUBECONFIG_FILE"
  MOE_E2E_KUBECONFIG="$KUBECONFIG_FILE" "$ROOT/.venv/bin/python" -m pytest -q -ra "${paths[@]}" "$@"
}

cmd_down() {
  if [[ ! -x "$KIND" ]]; then
    log "kind $KIND_VERSION not built: no cluster of ours to delete"
  elif ! timeout 20 docker info >/dev/null 2>&1; then
    log "no Docker daemon answers: no kind cluster can be running"
  elif cluster_exists; then
    log "kind delete cluster --name $CLUSTER"
    timeout 300 "$KIND" delete cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE" >&2
  else
    log "no kind cluster '$CLUSTER'"
  fi
  rm -f "$KUBECONFIG_FILE"
}

(($#)) || usage
sub=$1
shift
case "$sub" in
  build) cmd_build "$@" ;;
  up) cmd_up "$@" ;;
  test) cmd_test "$@" ;;
  down) cmd_down "$@" ;;
  -h | --help | help) usage ;;
  *) die "unknown command '$sub' (build | up [--gpu] | test | down)" ;;
esac
