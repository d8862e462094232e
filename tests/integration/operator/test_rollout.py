"""A rollout driven by the real operator process against a real kube-apiserver, with the
operator's own RBAC: KubeRay and the kubelet played for every RayCluster
(``tests/support/fake_kuberay.py``, one fake runtime each). An image change makes a second
RayCluster; the Service's selector moves to its head; the old RayCluster is deleted; status,
the condition, the events and ``kubectl get moed -o wide`` say so."""

from __future__ import annotations

import json

import pytest
import yaml

from e2e.controlplane import cluster
from tests.support import fake_cluster, fake_kuberay
from tests.support import operator_ops as ops

pytestmark = pytest.mark.controlplane

NAME = fake_cluster.NAME
NEW_IMAGE = "ghcr.io/elastic-moe/runtime:0.1.0-b"


def _status(plane: cluster.ControlPlane, namespace: str) -> dict[str, object]:
    obj = ops.get_json(plane, "moed", NAME, namespace=namespace) or {}
    status: dict[str, object] = obj.get("status") or {}
    return status


def test_an_image_change_rolls_over_to_a_second_raycluster(
    control_plane: cluster.ControlPlane, operator: ops.OperatorProcess, namespace: str
) -> None:
    doc = yaml.safe_load(ops.SAMPLE.read_text())
    # size 1 is refused by the fake runtime (too few expert slots): the new RayCluster
    # starts at 2 beside the old 2 (minDataParallelSize 2 makes that the surge)
    doc["spec"]["minDataParallelSize"] = 2
    doc["spec"]["expertParallel"] = {"maxExpertsPerRank": fake_cluster.MAX_EXPERTS_PER_RANK}
    with fake_kuberay.FakeKubeRay(control_plane, namespace) as kuberay:
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
        ops.wait_for(lambda: _status(control_plane, namespace).get("phase") == "Serving"
                     or kuberay.errors, timeout=90, what="phase Serving")  # fmt: skip
        assert kuberay.errors == []
        first = _status(control_plane, namespace)["revision"]
        patch = json.dumps({"spec": {"ray": {"image": NEW_IMAGE}}})
        control_plane.kubectl("patch", "moed", NAME, "-n", namespace, "--type=merge", "-p", patch)

        def completed() -> dict[str, object] | None:
            status = _status(control_plane, namespace)
            rollout = status.get("rollout") or {}
            assert isinstance(rollout, dict)
            return status if rollout.get("stage") == "Completed" else None

        status = ops.wait_for(completed, timeout=120, what="the rollout to complete")
        assert kuberay.errors == []
        assert kuberay.max_workers <= 4  # dataParallelSize + the 2 surge ranks
    rollout = status["rollout"]
    assert isinstance(rollout, dict)
    new = f"{NAME}-{rollout['toRevision']}"
    assert rollout["fromRevision"] == first and status["rayCluster"] == new
    ops.wait_for(
        lambda: ops.get_json(control_plane, "raycluster", NAME, namespace=namespace) is None,
        what="the old RayCluster deleted",
    )
    ray = ops.get_json(control_plane, "raycluster", new, namespace=namespace)
    assert ray is not None
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == NEW_IMAGE
    service = ops.get_json(control_plane, "service", f"{NAME}-api", namespace=namespace)
    assert service is not None and service["spec"]["selector"]["ray.io/cluster"] == new
    wide = control_plane.kubectl("get", "moed", NAME, "-n", namespace, "-o", "wide").stdout
    assert "ROLLOUT" in wide and "Completed" in wide and rollout["toRevision"] in wide
    events = ops.get_json(control_plane, "events", "--field-selector",
                          f"involvedObject.name={NAME}", namespace=namespace)  # fmt: skip
    assert events is not None
    reasons = {e["reason"] for e in events["items"]}
    assert {"RolloutStarted", "RolloutSwitched", "RolloutOldDeleted", "RolloutCompleted"} <= reasons
