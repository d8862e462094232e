"""The GPU sample on a kind cluster whose nodes advertise nvidia.com/gpu.

`e2e/kind/kind.sh up --gpu` makes the cluster (NVIDIA device plugin, KubeRay from its Helm
chart, our operator from manifests/); `e2e/kind/kind.sh test` runs this module there after
e2e/cluster. `kubectl apply` of `manifests/samples/moedeployment-gpu.yaml` into a namespace
that enforces Pod Security `restricted`; each worker pod gets its own GPU from the device
plugin and holds its rank's experts in GPU memory; the deployment is resized one rank up (or
down, where no GPU is free) and back under load, and every request is answered in full.

Answers are not compared token for token with e2e/load's reference: that one is computed on
this machine's CPU, and CUDA kernels need not match it bit for bit.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e import kube
from e2e import load as load_mod

pytestmark = pytest.mark.cluster

REPO = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = REPO / "manifests" / "samples" / "moedeployment-gpu.yaml"
NAMESPACE = "moe-e2e-gpu"
GPU = "nvidia.com/gpu"
READY_TIMEOUT_S = 900.0
RESIZE_TIMEOUT_S = 600.0


def _sample() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    return doc


NAME = str(_sample()["metadata"]["name"])
SIZE = int(_sample()["spec"]["dataParallelSize"])


def _allocatable_gpus(cluster: kube.Kubectl) -> int:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return sum(int((n["status"].get("allocatable") or {}).get(GPU, "0")) for n in nodes)


@pytest.fixture(scope="module")
def cluster() -> kube.Kubectl:
    kubeconfig = os.environ.get("MOE_E2E_KUBECONFIG")
    if not kubeconfig:
        pytest.skip("needs a kind cluster with GPUs: e2e/kind/kind.sh up --gpu && kind.sh test")
    c = kube.ExternalCluster(kubeconfig)
    gpus = _allocatable_gpus(c)
    if gpus < SIZE:
        pytest.skip(f"the GPU sample needs {SIZE} GPUs (DP={SIZE}, TP=1); nodes advertise {gpus}")
    return c


@pytest.fixture(scope="module")
def namespace(cluster: kube.Kubectl) -> Iterator[str]:
    cluster.kubectl(
        "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", timeout=300
    )
    labels = {f"pod-security.kubernetes.io/{m}": "restricted" for m in ("enforce", "audit", "warn")}
    body = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NAMESPACE, "labels": labels},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    yield NAMESPACE
    cluster.kubectl(
        "delete", "moed", "--all", "-n", NAMESPACE, "--wait=true", check=False, timeout=300
    )
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


@pytest.fixture(scope="module")
def dep(cluster: kube.Kubectl, namespace: str) -> Iterator[kube.Deployment]:
    forward = kube.PortForward(cluster, namespace=namespace, target=f"svc/{NAME}-api", port=8000)
    cluster.kubectl("apply", "-n", namespace, "-f", str(SAMPLE))
    d = kube.Deployment(cluster=cluster, name=NAME, namespace=namespace, endpoint=forward.url)
    kube.wait_for(lambda: d.serving(SIZE), timeout_s=READY_TIMEOUT_S, what=f"DP={SIZE} Serving")
    yield d
    forward.stop()


def _exec(dep: kube.Deployment, pod: str, *cmd: str) -> str:
    return dep.kubectl("exec", "-n", dep.namespace, pod, "--", *cmd).stdout.strip()


def _settled(dep: kube.Deployment, size: int) -> dict[str, Any] | None:
    """Serving ``size`` ranks with exactly ``size`` worker pods (none terminating)."""
    status = dep.serving(size)
    pods = dep.pods()
    if status is None or len(pods) != size:
        return None
    return None if any(p["metadata"].get("deletionTimestamp") for p in pods) else status


def test_each_worker_pod_holds_its_own_gpu(dep: kube.Deployment) -> None:
    pods = dep.pods()
    assert len(dep.ready_worker_pods()) == SIZE
    uuids = set()
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"][GPU] in (1, "1")
        name = pod["metadata"]["name"]
        (line,) = _exec(dep, name, "nvidia-smi", "-L").splitlines()  # the device plugin's one
        uuids.add(line)
        used = _exec(
            dep, name, "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"
        )
        # A CUDA context alone takes a few hundred MiB; an unused GPU shows (almost) none.
        assert int(used) > 100, f"{name}: {used} MiB used on its GPU: the rank is not on it"
    assert len(uuids) == SIZE  # no GPU shared by two ranks
    ranks = dep.runtime_status()["ranks"]
    assert len(ranks) == SIZE and all(r["healthy"] for r in ranks)


def test_resize_and_back_under_load(dep: kube.Deployment, cluster: kube.Kubectl) -> None:
    free = _allocatable_gpus(cluster) - SIZE
    other = SIZE + 1 if free >= 1 else SIZE - 1
    with load_mod.Load(dep.endpoint, model_name=NAME, reference=None, clients=4) as lg:
        kube.wait_for(lambda: lg.ok >= 4 or lg.failed, timeout_s=300, what="first answers")
        for size in (other, SIZE):
            dep.kubectl("scale", "moed", NAME, "-n", dep.namespace, f"--replicas={size}")
            settled = functools.partial(_settled, dep, size)
            kube.wait_for(settled, timeout_s=RESIZE_TIMEOUT_S, what=f"DP={size}")
            assert len(dep.ready_worker_pods()) == size
    print(f"\n[kind-gpu] {SIZE}->{other}->{SIZE}: {lg.summary()}")
    assert lg.failures == []
    assert lg.ok > 0
