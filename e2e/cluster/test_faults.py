"""Faults on the real node, under checked load: a worker pod deleted (with and without
`faultTolerance.autoRecover`), our operator's pod killed at every stage boundary of a resize,
kube-apiserver restarted mid-resize, the head container restarted.

The load reaches the Service's ClusterIP directly (the node routes its Service range to this
machine), so an API server restart does not cut the clients' connections the way it cuts
`kubectl port-forward`: what is measured is the deployment, not the test's plumbing. Every
answer is checked token for token; detection and recovery times are printed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e import kube
from e2e import load as load_mod
from e2e.cluster import conftest
from e2e.node import config, lifecycle, stack

pytestmark = pytest.mark.cluster

NAME = "tiny"
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def dep(node: kube.Kubectl, namespace: str) -> kube.Deployment:
    doc: dict[str, Any] = yaml.safe_load(conftest.SAMPLE.read_text())
    # Workers whose head vanished give up on its old GCS after 10 s (60 s by default) and
    # restart into the new one: the head-restart test waits for that.
    doc["spec"]["ray"]["env"].append(
        {"name": "RAY_gcs_rpc_server_reconnect_timeout_s", "value": "10"}
    )
    node.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    service = kube.ServiceUrl(node, namespace=namespace, name=f"{NAME}-api", port=8000)
    d = kube.Deployment(cluster=node, name=NAME, namespace=namespace, endpoint=service.url)
    kube.wait_for(lambda: d.serving(2), timeout_s=TIMEOUT_S, what="DP=2 Serving")
    return d


@pytest.fixture
def load(
    dep: kube.Deployment, reference: dict[tuple[int, int, int | None], list[int]]
) -> Iterator[load_mod.Load]:
    with load_mod.Load(dep.endpoint, model_name=NAME, reference=reference, clients=4) as lg:
        try:
            kube.wait_for(lambda: lg.ok >= 4 or lg.failed, timeout_s=180, what="first answers")
            yield lg
        finally:
            lg.stop()
            print(f"\n[faults] {lg.summary()}")
            for failure in lg.failures[:10]:
                print(f"[faults] failure: {failure}")


def _patch(dep: kube.Deployment, spec: dict[str, Any]) -> None:
    body = json.dumps({"spec": spec})
    dep.kubectl("patch", "moed", NAME, "-n", dep.namespace, "--type=merge", "-p", body)


def _rank_pod(dep: kube.Deployment) -> str:
    """A worker pod that runs a serving rank."""
    ranks = dep.runtime_status()["ranks"]
    pods = [r["pod"] for r in ranks if r.get("active") and r.get("pod")]
    assert pods, ranks
    return str(pods[-1])


def _recoveries(dep: kube.Deployment) -> list[dict[str, Any]]:
    return [r for r in dep.runtime_status()["history"] if r.get("kind") == "recovery"]


def _print_recovery(record: dict[str, Any], deleted_at: float) -> None:
    info = record["recovery"]
    print(
        f"\n[faults] recovery {record['from']}->{record['to']}: detected "
        f"{info['detected_at'] - deleted_at:.1f}s after the delete (heartbeat gap "
        f"{info['detection_s']}), serving again {info['recovery_s']:.2f}s after detection, "
        f"{info['requests_rerun']} requests re-run, experts restored {info['experts_restored']}"
    )


def _events(dep: kube.Deployment, reason: str) -> list[str]:
    return [e["message"] for e in dep.events() if e["reason"] == reason]


def test_a_deleted_worker_pod_is_recovered_with_no_failed_request(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    before = len(_recoveries(dep))
    pod = _rank_pod(dep)
    deleted_at = time.time()
    dep.kubectl("delete", "pod", pod, "-n", dep.namespace, "--wait=false")
    record = kube.wait_for(
        lambda: next((r for r in _recoveries(dep)[before:] if r["stage"] == "Completed"), None),
        timeout_s=TIMEOUT_S,
        what="the runtime's recovery",
    )
    assert [r["pod"] for r in record["recovery"]["ranks_lost"]] == [pod]
    _print_recovery(record, deleted_at)
    # back at the spec's size with the pod KubeRay made in its place, within 5 minutes
    kube.wait_for(
        lambda: dep.serving(2) and len(dep.ready_worker_pods()) == 2,
        timeout_s=TIMEOUT_S,
        what="DP=2 Serving again",
    )
    print(f"[faults] back at DP=2 {time.time() - deleted_at:.1f}s after the delete")
    assert pod not in dep.worker_pods()
    assert any(pod in m for m in _events(dep, "RankLost"))
    kube.wait_for(lambda: load.ok >= 8, timeout_s=120, what="answers after the recovery")
    assert load.failures == []


def test_without_auto_recover_a_lost_rank_leaves_the_deployment_degraded(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    _patch(dep, {"faultTolerance": {"autoRecover": False}})
    pod = _rank_pod(dep)
    dep.kubectl("delete", "pod", pod, "-n", dep.namespace, "--wait=false")

    def degraded() -> dict[str, Any] | None:
        status = dep.status()
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        ok = (
            status.get("dataParallelSize") == 1
            and status.get("phase") == "Degraded"
            and conditions.get("Degraded", {}).get("reason") == "RankLost"
        )
        return status if ok else None

    status = kube.wait_for(degraded, timeout_s=TIMEOUT_S, what="Degraded at DP=1")
    assert "autoRecover is off" in status["conditions"][-1]["message"] or any(
        "autoRecover is off" in c["message"] for c in status["conditions"]
    )
    lost = [r for r in dep.runtime_status()["ranks"] if r.get("pod") == pod]
    assert lost and lost[0]["healthy"] is False
    # KubeRay replaces the pod; the deployment still stays at 1 (nobody asked for 2 back)
    kube.wait_for(lambda: len(dep.ready_worker_pods()) == 2, timeout_s=TIMEOUT_S, what="2 pods")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert degraded() is not None, dep.status()
        assert dep.runtime_status()["data_parallel_size"] == 1
        time.sleep(0.5)  # watching that it stays: the deadline bounds it
    _patch(dep, {"faultTolerance": {"autoRecover": True}})
    kube.wait_for(lambda: dep.serving(2), timeout_s=TIMEOUT_S, what="DP=2 after autoRecover on")
    assert load.failures == []


def test_the_operator_killed_at_every_stage_boundary_resizes_once(
    node: kube.Kubectl, dep: kube.Deployment, load: load_mod.Load
) -> None:
    asked = len([r for r in dep.runtime_status()["history"] if r["to"] == 3])
    _resize_to = 3
    _patch(dep, {"dataParallelSize": _resize_to})
    seen: list[str] = []
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if dep.serving(_resize_to):
            break
        stage = dep.resize().get("stage")
        if dep.resize().get("toSize") == _resize_to and stage and stage not in seen:
            seen.append(stage)
            node.kubectl(
                "delete", "pod", "-n", config.OPERATOR_NAMESPACE,
                "-l", "app.kubernetes.io/name=moe-operator", "--wait=false",
            )  # fmt: skip
        time.sleep(0.3)  # polling the stage; the deadline bounds the loop
    else:
        raise AssertionError(f"DP=3 not reached; stages seen {seen}; {dep.status()}")
    print(f"\n[faults] operator pod killed at the stages {seen}")
    assert len(seen) >= 2
    records = [r for r in dep.runtime_status()["history"] if r["to"] == 3][asked:]
    assert len(records) == 1, records  # asked once, whatever the restarts
    assert records[0]["stage"] == "Completed"
    assert load.failures == []


def test_a_kube_apiserver_restart_mid_resize(
    node: kube.Kubectl, dep: kube.Deployment, load: load_mod.Load
) -> None:
    if conftest.EXTERNAL_KUBECONFIG or not isinstance(node, stack.Node):
        pytest.skip("restarts the local node's kube-apiserver")
    before = set(dep.worker_pods())
    dep.kubectl("scale", "moed", NAME, "-n", dep.namespace, "--replicas=2")
    kube.wait_for(
        lambda: dep.resize().get("toSize") == 2 and dep.resize().get("resizeId"),
        timeout_s=TIMEOUT_S,
        what="the shrink asked",
    )
    away = lifecycle.restart(node, "kube-apiserver")
    print(f"\n[faults] kube-apiserver away for {away:.1f}s mid-resize")
    kube.wait_for(
        lambda: dep.serving(2) and len(dep.worker_pods()) == 2,
        timeout_s=TIMEOUT_S,
        what="DP=2 after the API server came back",
    )
    freed = set(dep.resize()["freedPods"])
    assert set(dep.worker_pods()) == before - freed
    assert load.failures == []


def test_a_restarted_head_container_is_brought_back_to_serving(dep: kube.Deployment) -> None:
    """The runtime's process ends (as a crash would): the kubelet restarts the head
    container, Ray's GCS restarts with it, the workers rejoin, and the operator says so."""
    restarts = dep.status().get("headRestarts") or 0
    (head,) = [p["metadata"]["name"] for p in dep.pods("head")]
    dep.kubectl("exec", "-n", dep.namespace, head, "-c", "ray-head", "--", "kill", "-TERM", "1")
    started = time.monotonic()
    kube.wait_for(
        lambda: (dep.status().get("headRestarts") or 0) > restarts,
        timeout_s=TIMEOUT_S,
        what="status.headRestarts",
    )
    kube.wait_for(lambda: dep.serving(2), timeout_s=TIMEOUT_S, what="DP=2 after the restart")
    print(f"\n[faults] serving again {time.monotonic() - started:.0f}s after the head restarted")
    assert _events(dep, "RuntimeRestarted")
    answer = dep.runtime_status()
    assert answer["data_parallel_size"] == 2
