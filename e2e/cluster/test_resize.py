"""The sample MoEDeployment on the real node, resized 2→1→3→2 under checked load.

Everything is real: `kubectl apply` of `manifests/samples/moedeployment.yaml` into a namespace
that enforces Pod Security `restricted`; our operator (a pod, with the RBAC of `manifests/`)
writes the RayCluster; the real KubeRay v1.5.0 operator makes the pods; the kubelet runs our
runtime image in containerd. The load goes through `kubectl port-forward svc/tiny-api`; every
answer (greedy, seeded, streamed, up to 96 tokens) is checked token for token.

The tests run in order and share the deployment: apply → serve at 2 → shrink to 1 (the pods
KubeRay deletes are exactly the freed ones) → grow to 3 (a grow after a shrink: KubeRay never
clears workersToDelete) with our operator's pod deleted mid-resize (the resize completes once,
the runtime is asked once) → shrink to 2 → zero failed requests, no resize Failed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e import kube
from e2e import load as load_mod
from e2e.cluster import conftest
from e2e.node import config
from moe_operator.plan import builders, probes

pytestmark = pytest.mark.cluster

NAME = "tiny"
READY_TIMEOUT_S = 420.0
RESIZE_TIMEOUT_S = 420.0


@pytest.fixture(scope="module")
def dep(node: kube.Kubectl, namespace: str, port_forward: kube.PortForward) -> kube.Deployment:
    started = time.monotonic()
    node.kubectl("apply", "-n", namespace, "-f", str(conftest.SAMPLE))
    d = kube.Deployment(cluster=node, name=NAME, namespace=namespace, endpoint=port_forward.url)
    kube.wait_for(lambda: d.serving(2), timeout_s=READY_TIMEOUT_S, what="DP=2 Serving")
    print(f"\n[cluster] kubectl apply -> Serving at DP=2: {time.monotonic() - started:.1f}s")
    return d


@pytest.fixture(scope="module")
def watch(dep: kube.Deployment) -> Iterator[kube.StageWatch]:
    w = dep.watch()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def load(
    dep: kube.Deployment, reference: dict[tuple[int, int, int | None], list[int]]
) -> Iterator[load_mod.Load]:
    with kube.checked_load(dep, model_name=NAME, reference=reference, tag="cluster") as lg:
        yield lg


def _history(dep: kube.Deployment) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = dep.runtime_status()["history"]
    return records


def _resize(dep: kube.Deployment, to: int, *, how: str) -> None:
    if how == "scale":
        dep.kubectl("scale", "moed", NAME, "-n", dep.namespace, f"--replicas={to}")
    else:
        body = json.dumps({"spec": {"dataParallelSize": to}})
        dep.kubectl("patch", "moed", NAME, "-n", dep.namespace, "--type=merge", "-p", body)


def _settled(dep: kube.Deployment, size: int) -> dict[str, Any] | None:
    """Serving ``size`` ranks, with exactly ``size`` worker pods left (none terminating)."""
    status = dep.serving(size)
    if status is None:
        return None
    pods = dep.pods()
    if len(pods) != size or any(p["metadata"].get("deletionTimestamp") for p in pods):
        return None
    return status


UP = ["Provisioning", "Standby", "Transferring", "Switching", "Reshuffling", "Completed"]
DOWN = ["Reshuffling", "Migrating", "Switching", "Releasing", "Completed"]


def _assert_stages(
    dep: kube.Deployment, watch: kube.StageWatch, frm: int, to: int, expected: list[str]
) -> None:
    """Every stage happened, in order: the runtime timed each (``stageDurations``), the
    operator posted an event for each (``kubectl describe``), and ``kubectl get -w`` saw an
    ordered part of them (a stage can pass between two reconciles)."""
    durations = dep.status()["resize"].get("stageDurations") or {}
    assert set(expected) - {"Completed"} <= set(durations), durations
    messages = [e["message"] for e in dep.events()]
    for stage in expected:
        assert any(m.startswith(f"resize {frm}->{to}: {stage}") for m in messages), (
            stage,
            messages,
        )
    seen = watch.stages(to)
    assert seen and seen[-1] == "Completed", seen
    positions = [expected.index(s) for s in seen]
    assert positions == sorted(positions), seen


def _ready_by_our_probe(pod: dict[str, Any]) -> None:
    """The pod is Ready, through the readiness probe the operator gives its Ray container:
    the raylet's health check, first tried 1 s after the start, not KubeRay's injected probe
    that waits 10 s first (KubeRay injects its probes only into containers that have none).
    How long it took is a figure `make demo` prints (e2e/cluster/demo.py)."""
    (ready,) = [c for c in pod["status"]["conditions"] if c["type"] == "Ready"]
    assert ready["status"] == "True", ready
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == builders.WORKER_CONTAINER]
    probe = container["readinessProbe"]
    assert probe["httpGet"]["path"] == probes.RAYLET_HEALTH_PATH, probe
    assert probe["httpGet"]["port"] == probes.DASHBOARD_AGENT_PORT, probe
    assert probe.get("initialDelaySeconds", 0) == probes.WORKER_READY_DELAY_SECONDS, probe
    assert probe["periodSeconds"] == probes.WORKER_READY_PERIOD_SECONDS, probe


def _workers_to_delete(dep: kube.Deployment) -> list[str]:
    group = dep.raycluster()["spec"]["workerGroupSpecs"][0]
    names: list[str] = (group.get("scaleStrategy") or {}).get("workersToDelete") or []
    return names


def test_the_node_runs_the_real_stack(node: kube.Kubectl) -> None:
    if conftest.EXTERNAL_KUBECONFIG:
        pytest.skip("checks the local node (e2e/node); another cluster is in use")
    nodes = json.loads(node.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    (only,) = nodes
    assert only["metadata"]["name"] == config.NODE_NAME
    assert only["status"]["nodeInfo"]["kubeletVersion"] == config.K8S_VERSION
    ready = {c["type"]: c["status"] for c in only["status"]["conditions"]}
    assert ready["Ready"] == "True"
    pods = json.loads(node.kubectl("get", "pods", "-A", "-o", "json").stdout)["items"]

    def running(namespace: str, image_prefix: str) -> list[dict[str, Any]]:
        return [
            p
            for p in pods
            if p["metadata"]["namespace"] == namespace
            and p["status"].get("phase") == "Running"
            and p["spec"]["containers"][0]["image"].startswith(image_prefix)
        ]

    assert running(config.KUBERAY_NAMESPACE, "quay.io/kuberay/operator:v1.5.0")
    (operator,) = running(config.OPERATOR_NAMESPACE, "ghcr.io/elastic-moe/operator:")
    assert operator["spec"]["serviceAccountName"] == "moe-operator"


def test_apply_serves_at_two_ranks_in_a_restricted_namespace(
    dep: kube.Deployment, load: load_mod.Load, namespace: str
) -> None:
    labels = json.loads(dep.kubectl("get", "namespace", namespace, "-o", "json").stdout)
    assert labels["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert len(dep.ready_worker_pods()) == 2
    status = dep.status()
    assert status["phase"] == "Serving"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Ready"] == "True"
    kube.wait_for(lambda: load.ok >= 8, timeout_s=180, what="8 checked answers")
    assert load.failures == []


def test_shrink_to_one_deletes_exactly_the_freed_pod(
    dep: kube.Deployment, load: load_mod.Load, watch: kube.StageWatch
) -> None:
    before = set(dep.worker_pods())
    _resize(dep, 1, how="scale")
    status = kube.wait_for(lambda: _settled(dep, 1), timeout_s=RESIZE_TIMEOUT_S, what="DP=1")
    freed = set(status["resize"]["freedPods"])
    assert len(freed) == 1 and freed < before
    assert set(dep.worker_pods()) == before - freed  # KubeRay deleted those, and no other
    _assert_stages(dep, watch, 2, 1, DOWN)
    # the operator clears workersToDelete itself once the pod is gone (KubeRay never does)
    kube.wait_for(lambda: _workers_to_delete(dep) == [], timeout_s=60, what="workersToDelete []")
    assert load.failures == []


def test_grow_to_three_after_a_shrink_survives_the_operator_pod_being_deleted(
    node: kube.Kubectl, dep: kube.Deployment, load: load_mod.Load, watch: kube.StageWatch
) -> None:
    asked_before = len(_history(dep))
    before = set(dep.worker_pods())
    _resize(dep, 3, how="patch")
    # once the runtime was asked (resizeId recorded), kill our operator's pod
    kube.wait_for(
        lambda: dep.resize().get("resizeId") and dep.resize().get("toSize") == 3,
        timeout_s=RESIZE_TIMEOUT_S,
        what="the runtime asked for 3",
    )
    deleted = node.kubectl(
        "delete", "pod", "-n", config.OPERATOR_NAMESPACE,
        "-l", "app.kubernetes.io/name=moe-operator", "--wait=false", "-o", "name",
    ).stdout.split()  # fmt: skip
    assert deleted
    status = kube.wait_for(lambda: _settled(dep, 3), timeout_s=RESIZE_TIMEOUT_S, what="DP=3")
    records = [r for r in _history(dep)[asked_before:] if r["to"] == 3]
    assert len(records) == 1, records  # asked once: the restarted operator adopted it
    assert records[0]["resize_id"] == status["resize"]["resizeId"]
    assert records[0]["stage"] == "Completed"
    _assert_stages(dep, watch, 1, 3, UP)
    assert watch.stages(3)[0] == "Provisioning"
    assert len(dep.ready_worker_pods()) == 3
    # The new pods are Ready as soon as their raylet answers, through our own probe, not after
    # KubeRay's 10 s probe delay (its probes are injected only into containers that have none).
    new_pods = [p for p in dep.pods() if p["metadata"]["name"] not in before]
    assert new_pods
    for pod in new_pods:
        _ready_by_our_probe(pod)
    assert load.failures == []


def test_shrink_to_two_deletes_exactly_the_freed_pod(
    dep: kube.Deployment, load: load_mod.Load, watch: kube.StageWatch
) -> None:
    before = set(dep.worker_pods())
    _resize(dep, 2, how="scale")
    status = kube.wait_for(lambda: _settled(dep, 2), timeout_s=RESIZE_TIMEOUT_S, what="DP=2")
    freed = set(status["resize"]["freedPods"])
    assert len(freed) == 1 and freed < before
    assert set(dep.worker_pods()) == before - freed
    _assert_stages(dep, watch, 3, 2, DOWN)
    assert load.failures == []


def test_no_request_failed_and_no_resize_failed(dep: kube.Deployment, load: load_mod.Load) -> None:
    settled = load.ok + 8
    kube.wait_for(lambda: load.ok >= settled, timeout_s=180, what="answers at the final size")
    load.stop()
    print(f"\n[cluster] {load.summary()}")
    for record in _history(dep):
        stages = " ".join(f"{s['stage']} {s['duration_s']:.1f}s" for s in record["stages"])
        print(f"[cluster] {record['from']}->{record['to']} {record['duration_s']:.1f}s: {stages}")
    assert load.failures == []
    assert load.ok >= 20
    assert all(r["stage"] == "Completed" for r in _history(dep))
    assert not [e for e in dep.events() if e["reason"] == "Failed"]
    kinds = set(load.by_kind)
    assert {"greedy", "seeded", "greedy-stream", "seeded-stream"} <= kinds
