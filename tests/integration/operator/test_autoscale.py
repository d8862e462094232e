"""The operator's autoscaler against a real kube-apiserver, the real operator process (with the
RBAC of ``manifests/``) and a fake runtime whose load the test sets: the size is written
through the scale subresource, a resize runs, the load going away shrinks it back, an HPA on
the deployment makes the autoscaler stand down, and the operator's ``/metrics`` holds the
reconcile, resize and decision series. Short windows (2 s up, 6 s down, 1 s sync): the
policy's timing is unit-tested (tests/unit/test_operator_autoscale.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from e2e.controlplane import cluster
from tests.support import fake_cluster
from tests.support import operator_ops as ops

pytestmark = pytest.mark.controlplane

NAME = fake_cluster.NAME


@pytest.fixture
def deployment(
    control_plane: cluster.ControlPlane, operator: ops.OperatorProcess, namespace: str
) -> Iterator[fake_cluster.Deployment]:
    """The sample at DP 2 (its minimum: the fake runtime refuses 1) with autoscaling on,
    serving through the fake runtime."""
    runtime = fake_cluster.FakeRuntime(size=2, dwell=0.2)
    runtime.in_flight = 0
    runtime.start()
    doc = yaml.safe_load(ops.SAMPLE.read_text())
    doc["metadata"]["annotations"] = {"elasticmoe.io/runtime-url": runtime.url}
    doc["spec"]["dataParallelSize"] = 2
    doc["spec"]["minDataParallelSize"] = 2
    doc["spec"]["autoscaling"] = {
        "enabled": True,
        "targetInFlightPerRank": 8,
        "scaleUpStabilizationSeconds": 2,
        "scaleDownStabilizationSeconds": 6,
        "syncPeriodSeconds": 1,
    }
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


def _spec_size(dep: fake_cluster.Deployment) -> int:
    size: int = dep.get()["spec"]["dataParallelSize"]
    return size


def _autoscaling(dep: fake_cluster.Deployment) -> dict[str, Any]:
    auto: dict[str, Any] = dep.status().get("autoscaling") or {}
    return auto


def _size_manager(dep: fake_cluster.Deployment) -> str | None:
    """The field manager that owns spec.dataParallelSize (managedFields: the last writer)."""
    done = dep.plane.kubectl(
        "get", "moed", NAME, "-n", dep.namespace, "-o", "json", "--show-managed-fields"
    )
    for entry in json.loads(done.stdout)["metadata"].get("managedFields") or []:
        if "f:dataParallelSize" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
            manager: str = entry["manager"]
            return manager
    return None


def test_load_grows_it_and_its_absence_shrinks_it_back(
    deployment: fake_cluster.Deployment, operator: ops.OperatorProcess
) -> None:
    dep = deployment
    dep.runtime.in_flight = 20  # ceil(20 / 8) = 3
    ops.wait_for(lambda: _spec_size(dep) == 3, timeout=60, what="the autoscaler to ask for 3")
    assert _size_manager(dep) == "elastic-moe-autoscaler"
    auto = _autoscaling(dep)
    assert auto["reason"] in ("ScaledUp", "WaitingForResize")
    assert "2->3" in auto["lastDecision"] and auto["lastDecisionTime"]
    dep.set_ready_workers(3)  # play KubeRay: the new worker pods
    dep.wait_completed(3)
    assert dep.runtime.posts == [3]  # one resize; no decision while it ran

    dep.runtime.in_flight = 0
    ops.wait_for(lambda: _spec_size(dep) == 2, timeout=60, what="the autoscaler to ask for 2")
    dep.wait_completed(2)
    dep.kuberay_deletes()
    assert dep.runtime.posts == [3, 2]
    reasons = dep.events()
    assert reasons.count("ScaledUp") == 1 and reasons.count("ScaledDown") == 1
    wide = dep.plane.kubectl("get", "moed", NAME, "-n", dep.namespace, "-o", "wide").stdout
    assert "AUTOSCALER" in wide.splitlines()[0] and "DESIRED" in wide.splitlines()[0]
    described = dep.plane.kubectl("describe", "moed", NAME, "-n", dep.namespace).stdout
    assert "ScaledDown" in described and "dataParallelSize 3->2" in described

    text = httpx.get(ops.metrics_url(operator), timeout=10).text
    assert 'moe_operator_reconciles_total{result="ok"}' in text
    for direction in ("up", "down"):
        series = f'moe_operator_resizes_total{{direction="{direction}",kind="resize",outcome="completed"}}'
        assert series in text, series
    assert "moe_operator_reconcile_seconds_bucket" in text
    assert "moe_operator_resize_stage_seconds_count" in text
    for decision in ("scale_up", "scale_down"):
        assert (
            f'moe_operator_autoscaler_decisions_total{{decision="{decision}",deployment="{NAME}",'
            f'namespace="{dep.namespace}"}} 1.0'
        ) in text
    assert (
        f'moe_operator_runtime_reachable{{deployment="{NAME}",namespace="{dep.namespace}"}} 1.0'
        in text
    )


def test_an_hpa_on_the_deployment_makes_it_stand_down(
    deployment: fake_cluster.Deployment,
) -> None:
    dep = deployment
    hpa = yaml.safe_load((ops.REPO / "manifests" / "samples" / "hpa.yaml").read_text())
    dep.plane.kubectl("apply", "-n", dep.namespace, "-f", "-", input=yaml.safe_dump(hpa))
    ops.wait_for(
        lambda: _autoscaling(dep).get("reason") == "ExternalAutoscaler",
        timeout=30,
        what="the autoscaler to stand down",
    )
    dep.runtime.in_flight = 40
    # it keeps looking (the metric follows the load) but never writes the size
    ops.wait_for(lambda: _autoscaling(dep).get("inFlight") == 40, timeout=30, what="a new sample")
    assert _autoscaling(dep)["reason"] == "ExternalAutoscaler"
    assert _spec_size(dep) == 2 and dep.runtime.posts == []
    assert "HorizontalPodAutoscaler tiny" in _autoscaling(dep)["message"]
    assert dep.events().count("ExternalAutoscaler") == 1
    # the HPA gone, the operator's autoscaler takes over again (its windows start afresh)
    dep.plane.kubectl("delete", "hpa", "tiny", "-n", dep.namespace)
    ops.wait_for(lambda: _spec_size(dep) == 4, timeout=60, what="the autoscaler back")
