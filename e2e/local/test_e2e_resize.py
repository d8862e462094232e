"""End to end on this machine: kubectl → operator → RayCluster (local KubeRay) → runtime.

One MoEDeployment (the sample, with `expertParallel.maxExpertsPerRank: 4`) for the module,
under continuous load whose every answer is checked token for token. In order: `kubectl patch`
2→4, `kubectl scale` 4→2, a new target during a resize, the operator killed mid-resize, a size
the runtime refuses; then no request may have failed.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e import kube
from e2e import load as load_mod
from e2e.controlplane import cluster
from e2e.local import stack as stack_mod
from e2e.local.operator_proc import wait_for

pytestmark = [pytest.mark.controlplane, pytest.mark.ray]

NAMESPACE = "e2e-elastic"
NAME = "tiny"
UP = ["Provisioning", "Standby", "Transferring", "Switching", "Reshuffling", "Completed"]
DOWN = ["Reshuffling", "Migrating", "Switching", "Releasing", "Completed"]
RESIZE_TIMEOUT = 420.0


def is_subsequence(seen: list[str], order: list[str]) -> bool:
    it = iter(order)
    return all(stage in it for stage in seen)


@pytest.fixture(scope="module")
def stack(
    control_plane: cluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack_mod.LocalStack]:
    s = stack_mod.LocalStack(
        plane=control_plane,
        workdir=pathlib.Path(tmp_path_factory.mktemp("e2e-stack")),
        namespace=NAMESPACE,
    ).start()
    try:
        yield s
    finally:
        s.stop()
        assert s.kuberay is not None and s.kuberay.leftover_pids() == []


@pytest.fixture(scope="module")
def dep(stack: stack_mod.LocalStack) -> Iterator[kube.Deployment]:
    sample = yaml.safe_load(stack_mod.SAMPLE.read_text())
    sample["spec"].setdefault("expertParallel", {})["maxExpertsPerRank"] = 4
    path = stack.workdir / "sample.yaml"
    path.write_text(yaml.safe_dump(sample))
    stack.kubectl("apply", "-n", NAMESPACE, "-f", str(path))
    d = stack.deployment(NAME)
    try:
        wait_for(lambda: d.serving(2), timeout=RESIZE_TIMEOUT, interval=0.5, what="DP=2 serving")
        wait_for(d.endpoint, timeout=60, what="the runtime endpoint")
        yield d
    finally:
        stack.kubectl("delete", "moed", NAME, "-n", NAMESPACE, "--wait=false", check=False)
        stack.kubectl("delete", "raycluster", NAME, "-n", NAMESPACE, "--wait=false", check=False)


@pytest.fixture(scope="module")
def load(dep: kube.Deployment) -> Iterator[load_mod.Load]:
    reference = load_mod.reference_tokens(
        yaml.safe_load(stack_mod.SAMPLE.read_text())["spec"]["model"]["source"]
    )
    with load_mod.Load(dep.endpoint, model_name=NAME, reference=reference, clients=4) as lg:
        wait_for(lambda: lg.ok >= 4, timeout=120, interval=0.2, what="the first answers")
        yield lg


def patch_size(dep: kube.Deployment, size: int) -> None:
    body = json.dumps({"spec": {"dataParallelSize": size}})
    dep.stack.kubectl("patch", "moed", NAME, "-n", NAMESPACE, "--type=merge", "-p", body)


def wait_serving(dep: kube.Deployment, size: int) -> dict[str, Any]:
    return wait_for(
        lambda: dep.serving(size), timeout=RESIZE_TIMEOUT, interval=0.3, what=f"DP={size}"
    )


def test_patch_grows_through_every_stage(dep: kube.Deployment, load: load_mod.Load) -> None:
    watch = dep.watch()
    try:
        patch_size(dep, 4)
        status = wait_serving(dep, 4)
    finally:
        watch.stop()
    seen = watch.stages(4)
    assert seen[0] == "Provisioning" and seen[-1] == "Completed", seen
    assert is_subsequence(seen, UP), seen
    durations = status["resize"].get("stageDurations") or {}
    assert set(UP[:-1]) <= set(seen) | set(durations), (seen, durations)
    runtime = dep.runtime_status()["history"][-1]
    assert (runtime["from"], runtime["to"]) == (2, 4)
    assert [s["stage"] for s in runtime["stages"]] == UP[1:-1]
    assert dep.raycluster()["spec"]["workerGroupSpecs"][0]["replicas"] == 4
    assert len(dep.worker_pods()) == 4
    assert load.failures == []


def test_scale_shrinks_and_frees_exactly_the_named_pods(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    before = set(dep.worker_pods())
    watch = dep.watch()
    try:
        dep.stack.kubectl("scale", "moed", NAME, "-n", NAMESPACE, "--replicas=2")
        status = wait_serving(dep, 2)
    finally:
        watch.stop()
    seen = watch.stages(2)
    assert seen[-1] == "Completed" and is_subsequence(seen, DOWN), seen
    runtime = dep.runtime_status()["history"][-1]
    assert [s["stage"] for s in runtime["stages"]] == DOWN[:-1]
    freed = set(status["resize"]["freedPods"])
    assert freed == {f["pod"] for f in runtime["freed"]} and len(freed) == 2
    assert freed <= before
    wait_for(
        lambda: set(dep.worker_pods()) == before - freed,
        timeout=120,
        what="exactly the freed pods to be gone",
    )
    assert dep.raycluster()["spec"]["workerGroupSpecs"][0]["replicas"] == 2
    assert load.failures == []


def test_new_target_during_a_resize_converges_on_the_latest(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    patch_size(dep, 4)
    wait_for(
        lambda: dep.resize().get("toSize") == 4 and dep.resize().get("stage") != "Completed",
        timeout=60,
        interval=0.1,
        what="the resize to 4 to start",
    )
    patch_size(dep, 3)
    wait_serving(dep, 3)
    assert dep.runtime_status()["data_parallel_size"] == 3
    assert dep.raycluster()["spec"]["workerGroupSpecs"][0]["replicas"] == 3
    wait_for(lambda: len(dep.worker_pods()) == 3, timeout=120, what="3 worker pods")
    assert load.failures == []


def test_operator_killed_mid_resize_resumes_without_asking_twice(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    assert dep.stack.operator is not None
    patch_size(dep, 2)
    wait_for(
        lambda: dep.resize().get("resizeId") and dep.resize().get("toSize") == 2,
        timeout=60,
        interval=0.05,
        what="the runtime to be asked for 3->2",
    )
    dep.stack.operator.kill()
    dep.stack.operator.start()
    wait_serving(dep, 2)
    history = dep.runtime_status()["history"]
    assert [(h["from"], h["to"]) for h in history].count((3, 2)) == 1
    assert load.failures == []


def test_a_size_the_runtime_refuses_fails_and_keeps_serving(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    ok_before = load.ok
    patch_size(dep, 1)
    status = wait_for(
        lambda: (s := dep.status()).get("resize", {}).get("stage") == "Failed" and s,
        timeout=120,
        what="the refused resize to fail",
    )
    assert "too small to hold every expert" in status["resize"]["message"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Degraded"]["status"] == "True"
    assert conditions["Ready"]["status"] == "True"
    assert status["dataParallelSize"] == 2 and status["phase"] == "Degraded"
    assert dep.runtime_status()["data_parallel_size"] == 2
    wait_for(lambda: load.ok > ok_before + 4, timeout=120, what="answers after the refusal")
    patch_size(dep, 2)
    wait_for(lambda: dep.status().get("phase") == "Serving", timeout=60, what="Serving again")
    reasons = [e["reason"] for e in dep.events()]
    for stage in ("Provisioning", "Standby", "Switching", "Migrating", "Releasing", "Failed"):
        assert stage in reasons, reasons


def test_no_request_failed(load: load_mod.Load) -> None:
    load.stop()
    assert load.failures == []
    assert load.ok >= 20
