"""The reconcile planner and the status computation: pure functions, no cluster."""

from __future__ import annotations

from typing import Any

import pytest

from moe_contract import status as runtime_status
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, builders, diff, observe, resize
from moe_operator.plan import status as plan_status

SPEC = spec_.MoEDeploymentSpec.model_validate(
    {"model": {"source": "synthetic://tiny"}, "dataParallelSize": 2, "maxDataParallelSize": 4}
)
EMPTY = status_.MoEDeploymentStatus()
T0 = "2026-01-01T00:00:00Z"
T1 = "2026-01-01T00:05:00Z"


def ray(*, ready: int, head: bool = True, replicas: int = 2) -> observe.RayClusterObservation:
    return observe.RayClusterObservation(
        worker_replicas=replicas, ready_workers=ready, head_ready=head
    )


def phase_of(steps: list[actions.Action]) -> actions.SetPhase:
    last = steps[-1]
    assert isinstance(last, actions.SetPhase)
    return last


def test_first_reconcile_creates_every_child() -> None:
    steps = resize.plan_resize(SPEC, EMPTY, observe.Observed())
    assert steps[:3] == [
        actions.ApplyRayCluster(worker_replicas=2),
        actions.EnsureSecret(),
        actions.ApplyService(),
    ]
    assert phase_of(steps).phase == status_.Phase.PROVISIONING


def test_an_existing_secret_is_never_recreated() -> None:
    steps = resize.plan_resize(
        SPEC, EMPTY, observe.Observed(raycluster=ray(ready=0), secret_exists=True)
    )
    assert not any(isinstance(a, actions.EnsureSecret) for a in steps)


@pytest.mark.parametrize(
    ("current", "observed", "phase", "reason"),
    [
        (None, ray(ready=0, head=False), status_.Phase.PROVISIONING, "WaitingForRayCluster"),
        (None, ray(ready=1), status_.Phase.PROVISIONING, "WaitingForWorkers"),
        (None, ray(ready=2), status_.Phase.SERVING, "AllRanksReady"),
        (status_.Phase.SERVING, ray(ready=1), status_.Phase.DEGRADED, "RanksMissing"),
        (status_.Phase.DEGRADED, ray(ready=2), status_.Phase.SERVING, "AllRanksReady"),
    ],
    ids=["head-pending", "workers-pending", "serving", "lost-a-rank", "recovered"],
)
def test_phase_follows_the_raycluster(
    current: status_.Phase | None,
    observed: observe.RayClusterObservation,
    phase: status_.Phase,
    reason: str,
) -> None:
    status = status_.MoEDeploymentStatus(phase=current)
    got = phase_of(resize.plan_resize(SPEC, status, observe.Observed(raycluster=observed)))
    assert (got.phase, got.reason) == (phase, reason)


def test_a_new_target_resizes_the_worker_group() -> None:
    spec = SPEC.model_copy(update={"data_parallel_size": 3})
    steps = resize.plan_resize(spec, EMPTY, observe.Observed(raycluster=ray(ready=2)))
    assert actions.ApplyRayCluster(worker_replicas=3) in steps


def status_after(
    *, current: status_.MoEDeploymentStatus, observed: observe.Observed, now: str
) -> status_.MoEDeploymentStatus:
    phase = phase_of(resize.plan_resize(SPEC, current, observed))
    return plan_status.next_status(
        name="tiny",
        namespace="ml",
        generation=1,
        target=2,
        current=current,
        observed=observed,
        phase=phase,
        now=now,
    )


def test_status_fields() -> None:
    new = status_after(
        current=EMPTY, observed=observe.Observed(raycluster=ray(ready=2)), now=T0
    ).to_wire()
    assert new["phase"] == "Serving"
    assert new["dataParallelSize"] == 2
    assert new["targetDataParallelSize"] == 2
    assert new["selector"] == "elasticmoe.io/deployment=tiny"
    assert new["endpoint"] == "http://tiny-api.ml.svc:8000"
    assert new["observedGeneration"] == 1
    conditions = {c["type"]: c for c in new["conditions"]}
    assert [c["type"] for c in new["conditions"]] == ["Ready", "Resizing", "Degraded"]
    assert conditions["Ready"] == {
        "type": "Ready",
        "status": "True",
        "reason": "AllRanksReady",
        "message": "2 of 2 ranks ready",
        "lastTransitionTime": T0,
        "observedGeneration": 1,
    }


@pytest.mark.parametrize(
    ("tp", "pp_annotation", "want"),
    [(1, None, (1, 1)), (2, None, (2, 1)), (2, "3", (2, 3))],
    ids=["tp1", "tp2", "tp2-pp3"],
)
def test_status_shows_the_mesh_of_the_serving_raycluster(
    tp: int, pp_annotation: str | None, want: tuple[int, int]
) -> None:
    """``kubectl get moed -o wide`` prints TP and PP from the status; the status reads them
    from the RayCluster the operator built (PP is refused above 1 today: its annotation is
    written by hand here, as a RayCluster of a later operator would carry it)."""
    spec = SPEC.model_copy(update={"tensor_parallel_size": tp})
    built = builders.build_raycluster(
        owner=builders.Owner(name="tiny", namespace="ml", uid="u"), spec=spec
    )
    if pp_annotation is not None:
        annotations = built["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
        annotations["elasticmoe.io/pipeline-parallel-size"] = pp_annotation
    built["status"] = {
        "readyWorkerReplicas": 2,
        "conditions": [{"type": "HeadPodReady", "status": "True"}],
    }
    observed = observe.Observed(raycluster=observe.raycluster(built))
    new = status_after(current=EMPTY, observed=observed, now=T0).to_wire()
    assert (new["tensorParallelSize"], new["pipelineParallelSize"]) == want
    # a serving RayCluster keeps showing its own mesh while the spec asks another (a rollout)
    other = plan_status.next_status(
        name="tiny", namespace="ml", generation=2, target=2, current=EMPTY, observed=observed,
        phase=actions.SetPhase(status_.Phase.SERVING, "Serving", ""), now=T0, mesh=(4, 1),
    )  # fmt: skip
    assert (other.tensor_parallel_size, other.pipeline_parallel_size) == want
    # no RayCluster yet: the spec's, which the one created next carries
    first = plan_status.next_status(
        name="tiny", namespace="ml", generation=1, target=2, current=EMPTY,
        observed=observe.Observed(), phase=actions.SetPhase(status_.Phase.PENDING, "Pending", ""), now=T0,
        mesh=(tp, 1),
    )  # fmt: skip
    assert (first.tensor_parallel_size, first.pipeline_parallel_size) == (tp, 1)


def test_transition_time_moves_only_when_the_status_flips() -> None:
    observed = observe.Observed(raycluster=ray(ready=2))
    first = status_after(current=EMPTY, observed=observed, now=T0)
    again = status_after(current=first, observed=observed, now=T1)
    assert again == first
    assert not plan_status.needs_write(first.to_wire(), again)
    degraded = status_after(
        current=first, observed=observe.Observed(raycluster=ray(ready=1)), now=T1
    )
    ready = degraded.condition("Ready")
    assert ready is not None and (ready.status, ready.last_transition_time) == ("False", T1)
    resizing = degraded.condition("Resizing")
    assert resizing is not None and resizing.last_transition_time == T0


def test_timestamps_alone_do_not_need_a_write() -> None:
    observed = observe.Observed(raycluster=ray(ready=2))
    stored = status_after(current=EMPTY, observed=observed, now=T0).to_wire()
    fresh = status_after(current=EMPTY, observed=observed, now=T1)
    assert not plan_status.needs_write(stored, fresh)
    assert plan_status.needs_write({}, fresh)


def test_merge_patch_nulls_removed_keys() -> None:
    new = status_.MoEDeploymentStatus(phase=status_.Phase.SERVING)
    patch: dict[str, Any] = plan_status.merge_patch({"phase": "Resizing", "endpoint": "x"}, new)
    assert patch == {"phase": "Serving", "endpoint": None}


def test_serving_size_prefers_the_runtime() -> None:
    runtime = observe.RuntimeObservation(data_parallel_size=3, target_data_parallel_size=3)
    observed = observe.Observed(raycluster=ray(ready=2), runtime=runtime)
    assert plan_status.serving_size(observed=observed, target=2) == 3
    assert plan_status.serving_size(observed=observe.Observed(), target=2) == 0


def test_observe_parses_a_raycluster() -> None:
    obj = {
        "spec": {"workerGroupSpecs": [{"groupName": "ranks", "replicas": 3}]},
        "status": {
            "readyWorkerReplicas": 2,
            "state": "ready",
            "conditions": [{"type": "HeadPodReady", "status": "True"}],
        },
    }
    assert observe.raycluster(obj) == observe.RayClusterObservation(
        worker_replicas=3, ready_workers=2, head_ready=True, state="ready"
    )
    assert observe.raycluster(None) is None
    assert observe.raycluster({"spec": {}}) == observe.RayClusterObservation(
        worker_replicas=0, ready_workers=0, head_ready=False
    )


def test_observe_parses_the_runtime_status() -> None:
    sent = runtime_status.ElasticStatus(
        data_parallel_size=2,
        target_data_parallel_size=4,
        stage="Standby",
        eplb=runtime_status.Eplb(balancedness=0.8),
    )
    got = observe.runtime(sent.to_json())
    assert got == observe.RuntimeObservation(2, 4, "Standby", 0.8)


@pytest.mark.parametrize(
    ("actual", "desired", "expected"),
    [
        ({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": 2}}, True),
        ({"a": 1}, {"a": 2}, False),
        ({"a": [{"x": 1, "y": 2}]}, {"a": [{"x": 1}]}, True),
        ({"a": [{"x": 1}, {"x": 2}]}, {"a": [{"x": 1}]}, False),
        ({"a": 1}, {"a": True}, False),
        ({}, {"a": None}, False),
    ],
    ids=["nested-subset", "changed", "list-of-subsets", "list-length", "bool-vs-int", "missing"],
)
def test_contains(actual: Any, desired: Any, expected: bool) -> None:
    assert diff.contains(actual, desired) is expected


def test_status_is_the_same_before_and_after_the_raycluster_exists() -> None:
    """A restarted operator sees the RayCluster it created; it must not compute a new status."""
    first = status_after(current=EMPTY, observed=observe.Observed(), now=T0)
    resumed = status_after(
        current=first, observed=observe.Observed(raycluster=ray(ready=0, head=False)), now=T1
    )
    assert not plan_status.needs_write(first.to_wire(), resumed)


def test_a_vanished_raycluster_degrades_a_serving_deployment() -> None:
    serving = status_.MoEDeploymentStatus(phase=status_.Phase.SERVING)
    got = phase_of(resize.plan_resize(SPEC, serving, observe.Observed()))
    assert (got.phase, got.reason) == (status_.Phase.DEGRADED, "RanksMissing")
