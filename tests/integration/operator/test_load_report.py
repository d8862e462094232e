"""A head that loads or fails to start, reported by the real operator on a real API server
(``plan.load_report``): the head's termination message becomes the Ready condition's message
(reason ``LoadFailed``, phase ``Failed``), with one warning event and in ``kubectl get moed``;
load progress from the runtime's ``GET /ready`` becomes ``LoadingModel`` and
``status.loading``. The test plays KubeRay and the kubelet (the head pod and its status); the
runtime is the fake one, answering with the contract's models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.controlplane import cluster
from moe_contract import loading
from tests.support import fake_cluster
from tests.support import operator_ops as ops

NAME = fake_cluster.NAME
REFUSED = (
    "cannot open model /models/m/tiny: /models/m/tiny/config.json: model_type 'llama' "
    "is not supported"
)


def _container(state: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"name": "ray-head", "image": "none", "imageID": "", "ready": False,
            "restartCount": 0, "state": state, **more}  # fmt: skip


def _head(container: dict[str, Any]) -> dict[str, Any]:
    return {
        "phase": "Running",
        "podIP": "10.9.9.9",
        "podIPs": [{"ip": "10.9.9.9"}],
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [container],
    }


@pytest.fixture
def deployment(
    control_plane: cluster.ControlPlane, operator: ops.OperatorProcess, namespace: str
) -> Iterator[fake_cluster.Deployment]:
    """A MoEDeployment whose RayCluster exists and whose head has not started serving."""
    runtime = fake_cluster.FakeRuntime(size=2)
    runtime.start()
    doc = yaml.safe_load(ops.SAMPLE.read_text())
    doc["metadata"]["annotations"] = {"elasticmoe.io/runtime-url": runtime.url}
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    dep = fake_cluster.Deployment(plane=control_plane, namespace=namespace, runtime=runtime)
    ops.wait_for(
        lambda: ops.get_json(control_plane, "raycluster", NAME, namespace=namespace),
        what="the RayCluster",
    )
    try:
        yield dep
    finally:
        control_plane.kubectl("delete", "moed", NAME, "-n", namespace, "--wait=false")
        runtime.stop()


def _ready(dep: fake_cluster.Deployment) -> dict[str, Any]:
    conditions = dep.status().get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), {})


def test_a_head_in_a_crash_loop_is_reported_with_its_termination_message(
    control_plane: cluster.ControlPlane, deployment: fake_cluster.Deployment
) -> None:
    dep = deployment
    stopped = {"terminated": {"exitCode": 1, "reason": "Error", "message": REFUSED + "\n"}}
    dep.set_head(
        _head(
            _container(
                {"waiting": {"reason": "CrashLoopBackOff"}}, restartCount=2, lastState=stopped
            )
        )
    )
    ready = ops.wait_for(
        lambda: (c := _ready(dep)).get("reason") == "LoadFailed" and c,
        what="a LoadFailed condition",
    )
    assert ready["status"] == "False" and REFUSED in ready["message"]
    assert "CrashLoopBackOff" in ready["message"]
    assert dep.status()["phase"] == "Failed"
    ops.wait_for(lambda: "LoadFailed" in dep.events(), what="a LoadFailed event")
    out = control_plane.kubectl("get", "moed", NAME, "-n", dep.namespace).stdout
    assert "model_type 'llama' is not supported" in out  # the MESSAGE column


def test_load_progress_is_shown_while_the_head_loads(
    control_plane: cluster.ControlPlane, deployment: fake_cluster.Deployment
) -> None:
    dep = deployment
    progress = loading.LoadProgress(
        activity=loading.ACTIVITY_WEIGHTS,
        ranks_total=2,
        ranks=[
            loading.RankLoad(rank=0, bytes_loaded=12_400_000, bytes_total=30_000_000),
            loading.RankLoad(rank=1, bytes_loaded=2_000_000, bytes_total=30_100_000),
        ],
    )
    with dep.runtime.lock:
        dep.runtime.loading = progress
    dep.set_head(_head(_container({"running": {"startedAt": "2026-01-01T00:00:00Z"}})))
    ready = ops.wait_for(
        lambda: (c := _ready(dep)).get("reason") == "LoadingModel" and c,
        what="a LoadingModel condition",
    )
    assert ready["message"] == progress.message()
    assert dep.status()["phase"] == "Provisioning"
    assert dep.status()["loading"] == {
        "bytesLoaded": 14_400_000, "bytesTotal": 60_100_000, "ranksReady": 0, "ranksTotal": 2,
    }  # fmt: skip
    ops.wait_for(lambda: "LoadingModel" in dep.events(), what="a LoadingModel event")
    out = control_plane.kubectl("get", "moed", NAME, "-n", dep.namespace).stdout
    assert "loading weights 14.4/60.1 MB, rank 1/2" in out
