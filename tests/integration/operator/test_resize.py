"""Live resizes driven by the real operator process against a real kube-apiserver and a fake
runtime HTTP server (tests/support/fake_cluster.py: the admin routes of docs/RUNTIME.md with a
scripted stage progression, its status built from ``moe_contract.status``). The test plays
KubeRay and the kubelet: it creates the Ray pods (Ready) and deletes the ones named in
workersToDelete; like the real KubeRay it never clears that list (the real-node tier runs the
real thing).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e import kube
from e2e.controlplane import cluster
from tests.support import fake_cluster
from tests.support import operator_ops as ops

pytestmark = pytest.mark.controlplane

NAME = fake_cluster.NAME
MAX_EXPERTS_PER_RANK = fake_cluster.MAX_EXPERTS_PER_RANK
UP = ["Provisioning", "Standby", "Transferring", "Switching", "Reshuffling", "Completed"]
DOWN = ["Reshuffling", "Migrating", "Switching", "Releasing", "Completed"]


@pytest.fixture
def deployment(
    control_plane: cluster.ControlPlane, operator: ops.OperatorProcess, namespace: str
) -> Iterator[fake_cluster.Deployment]:
    """A MoEDeployment serving at DP 2 through the fake runtime."""
    runtime = fake_cluster.FakeRuntime(size=2)
    runtime.start()
    doc = yaml.safe_load(ops.SAMPLE.read_text())
    doc["metadata"]["annotations"] = {"elasticmoe.io/runtime-url": runtime.url}
    doc["spec"]["expertParallel"] = {"maxExpertsPerRank": MAX_EXPERTS_PER_RANK}
    doc["spec"]["elastic"] = {"resizeTimeoutSeconds": 120}
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    dep = fake_cluster.Deployment(plane=control_plane, namespace=namespace, runtime=runtime)
    ops.wait_for(
        lambda: ops.get_json(control_plane, "raycluster", NAME, namespace=namespace),
        what="the RayCluster",
    )
    dep.set_ready_workers(2)
    ops.wait_for(lambda: dep.status().get("phase") == "Serving", what="phase Serving")
    try:
        yield dep
    finally:
        control_plane.kubectl("delete", "moed", NAME, "-n", namespace, "--wait=false")
        runtime.stop()


def test_head_gets_the_elastic_flags(deployment: fake_cluster.Deployment) -> None:
    args = deployment.raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "args"
    ][0]
    for flag in ("--max-experts-per-rank 4", "--min-data-parallel-size 1",
                 "--max-data-parallel-size 4", "--eplb ", "--num-redundant-experts 0"):  # fmt: skip
        assert flag in args


def test_scale_up_then_down_mirrors_every_stage(deployment: fake_cluster.Deployment) -> None:
    dep = deployment
    done = dep.plane.kubectl(
        "wait", "--for=condition=Ready", f"moed/{NAME}", "-n", dep.namespace, "--timeout=30s"
    )
    assert done.returncode == 0
    watch = kube.StageWatch(dep.plane, NAME, dep.namespace)
    try:
        dep.scale(4)
        ops.wait_for(
            lambda: dep.workers()["replicas"] == 4 and dep.resize().get("stage") == "Provisioning",
            what="Provisioning with 4 worker replicas",
        )
        assert dep.runtime.posts == []  # the runtime waits for the workers
        ready = {c["type"]: c for c in dep.status()["conditions"]}
        assert ready["Ready"]["status"] == "True"
        assert (ready["Resizing"]["status"], ready["Resizing"]["reason"]) == (
            "True",
            "Provisioning",
        )
        dep.set_ready_workers(4)
        status = dep.wait_completed(4)
        assert status["resize"]["resizeId"] == dep.runtime.history[-1].resize_id
        assert set(status["resize"]["stageDurations"]) >= {"Provisioning", "Standby"}
        ops.wait_for(lambda: watch.stages(4)[-1:] == ["Completed"], what="the watch to catch up")
        assert watch.stages(4) == UP
        assert dep.runtime.posts == [4]

        dep.scale(2)
        status = dep.wait_completed(2)
        ops.wait_for(lambda: watch.stages(2)[-1:] == ["Completed"], what="the watch to catch up")
        assert watch.stages(2) == DOWN
        assert dep.runtime.posts == [4, 2]
        (record,) = dep.runtime.records_for(4, 2)
        freed = sorted(f["pod"] for f in record["freed"])
        workers = dep.workers()
        assert workers["replicas"] == 2
        assert sorted(workers["scaleStrategy"]["workersToDelete"]) == freed
        assert sorted(status["resize"]["freedPods"]) == freed
        # once KubeRay deleted those pods, the operator drops their names (KubeRay never does)
        assert sorted(dep.kuberay_deletes()) == freed
        ops.wait_for(
            lambda: dep.workers()["scaleStrategy"]["workersToDelete"] == [],
            what="workersToDelete emptied by the operator",
        )
        # and a grow after that shrink is not held back by stale names
        dep.scale(3)
        dep.set_ready_workers(3)
        dep.wait_completed(3)
        assert dep.runtime.posts == [4, 2, 3]
    finally:
        watch.stop()
    reasons = dep.events()
    for stage in dict.fromkeys(UP + DOWN):
        assert stage in reasons
    done = dep.plane.kubectl(
        "wait", "--for=condition=Ready", f"moed/{NAME}", "-n", dep.namespace, "--timeout=30s"
    )
    assert done.returncode == 0
    assert dep.status()["phase"] == "Serving"


def test_a_restarted_operator_resumes_without_asking_twice(
    deployment: fake_cluster.Deployment, operator: ops.OperatorProcess
) -> None:
    dep = deployment
    dep.runtime.dwell = 1.0
    dep.set_ready_workers(4)  # workers already there: the runtime is asked at once
    dep.scale(4)
    ops.wait_for(lambda: dep.resize().get("resizeId"), what="status.resize.resizeId")
    assert dep.resize()["stage"] not in ("Completed", "Failed")
    assert operator.proc is not None
    operator.proc.kill()  # no goodbye: mid-resize
    operator.proc.wait(timeout=10)
    operator.proc = None
    operator.start()
    dep.wait_completed(4)
    assert dep.runtime.posts == [4]
    assert len(dep.runtime.records_for(2, 4)) == 1
    assert dep.workers()["replicas"] == 4


def test_a_new_target_during_a_resize_is_applied_after_it(
    deployment: fake_cluster.Deployment,
) -> None:
    dep = deployment
    dep.runtime.dwell = 1.0
    dep.set_ready_workers(4)
    dep.scale(4)
    ops.wait_for(lambda: dep.resize().get("resizeId"), what="the runtime to be asked for 4")
    dep.scale(3)
    dep.wait_completed(3)
    assert dep.runtime.posts == [4, 3]
    assert 409 not in dep.runtime.answers
    assert [len(dep.runtime.records_for(*step)) for step in ((2, 4), (4, 3))] == [1, 1]
    workers = dep.workers()
    assert workers["replicas"] == 3
    assert workers["scaleStrategy"]["workersToDelete"] == [
        f["pod"] for f in dep.runtime.records_for(4, 3)[0]["freed"]
    ]


def test_a_refused_size_fails_once_and_keeps_serving(deployment: fake_cluster.Deployment) -> None:
    dep = deployment
    dep.scale(1)

    def failed() -> dict[str, Any] | None:
        status = dep.status()
        return status if (status.get("resize") or {}).get("stage") == "Failed" else None

    status = ops.wait_for(failed, what="a Failed resize")
    assert "too small to hold every expert" in status["resize"]["message"]
    assert status["phase"] == "Degraded"
    assert status["dataParallelSize"] == 2
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == (
        "True",
        "ResizeFailed",
    )
    assert "too small to hold every expert" in conditions["Degraded"]["message"]
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Resizing"]["status"] == "False"
    # No retry loop: over several reconcile periods the runtime is asked once.
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert dep.runtime.posts == [1]
        time.sleep(0.2)
    assert dep.workers()["replicas"] == 2
    assert "Failed" in dep.events()
    # A new generation (another target) is tried.
    dep.scale(3)
    dep.set_ready_workers(3)
    dep.wait_completed(3)
    assert dep.runtime.posts == [1, 3]
