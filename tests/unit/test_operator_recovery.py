"""Recoveries in the planner: a rank the runtime lost, mirrored without touching the worker
group; the grow back decided by faultTolerance.autoRecover; a runtime that restarted under a
resize; the head's restarts and unhealthy ranks in status. Pure, no cluster."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from moe_contract import status as runtime_status
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, observe, resize
from moe_operator.plan import status as plan_status
from tests.support.resize_plan import (
    LATER,
    PODS,
    Plan,
    active,
    observed,
    ray,
    record,
    runtime,
    serving,
)

Stage = status_.Stage
Phase = status_.Phase
LOST = (observe.LostRank(pod=PODS[1], reason="dead"),)


def spec(dp: int, *, auto_recover: bool = True) -> spec_.MoEDeploymentSpec:
    return spec_.MoEDeploymentSpec.model_validate(
        {
            "model": {"source": "synthetic://tiny"},
            "dataParallelSize": dp,
            "maxDataParallelSize": 4,
            "faultTolerance": {"autoRecover": auto_recover},
        }
    )


def plan(
    target: int, status: status_.MoEDeploymentStatus, obs: observe.Observed, **kw: Any
) -> Plan:
    return Plan(resize.plan_resize(spec(target, **kw), status, obs))


def recovering(stage: str, *, rid: str = "rec1") -> observe.RuntimeResize:
    base = record(
        3, 2, stage, rid=rid, stages=(("Recovering", 1.2 if stage == "Completed" else None),)
    )
    return dataclasses.replace(base, kind="recovery", lost=LOST, recovery_s=1.2, requests_rerun=4)


def after_loss(last: observe.RuntimeResize) -> observe.RuntimeObservation:
    """The runtime at 2 ranks after losing PODS[1], which it keeps listing as lost."""
    rt = runtime(2 if last.done else 3, last, pods=(PODS[0], PODS[2]))
    return dataclasses.replace(rt, lost=LOST)


@pytest.mark.parametrize("stage", ["Recovering", "Completed"], ids=["running", "already-ended"])
def test_a_recovery_is_mirrored_and_the_worker_group_left_alone(stage: str) -> None:
    p = plan(3, serving(3), observed(raycluster=ray(3), rt=after_loss(recovering(stage))))
    assert p.resize.kind == "recovery" and p.resize.resize_id == "rec1"
    assert (p.resize.from_size, p.resize.to_size) == (3, 2)
    assert p.resize.stage is (Stage.RECOVERING if stage == "Recovering" else Stage.COMPLETED)
    # KubeRay replaces a lost pod by itself: no replica change, no pod named for deletion
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=3)
    assert p.scale is None
    assert p.events[0] == "RankLost"
    assert (p.phase.phase, p.phase.ready) == (Phase.DEGRADED, True)
    if stage == "Completed":
        assert (
            p.resize.message
            == f"lost {PODS[1]} (dead); serving 2 ranks again in 1.2s, 4 requests re-run"
        )
        assert "Completed" in p.events


def test_the_grow_back_waits_for_the_replacement_worker_then_asks_once() -> None:
    done = active(3, 2, Stage.COMPLETED, rid="rec1", kind="recovery")
    obs = observed(raycluster=ray(3, ready=2), rt=after_loss(recovering("Completed")))
    p = plan(3, serving(2, done), obs)
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (2, 3, Stage.PROVISIONING)
    assert p.resize.message.startswith(f"growing back after losing {PODS[1]} (dead)")
    assert p.scale is None  # KubeRay has not replaced the pod yet
    assert p.raycluster.worker_replicas == 3
    p = plan(
        3, serving(2, p.resize), observed(raycluster=ray(3), rt=after_loss(recovering("Completed")))
    )
    assert p.scale == 3


def test_without_auto_recover_the_smaller_size_stays_degraded() -> None:
    done = active(3, 2, Stage.COMPLETED, rid="rec1", kind="recovery")
    obs = observed(raycluster=ray(3), rt=after_loss(recovering("Completed")))
    p = plan(3, serving(2, done), obs, auto_recover=False)
    assert p.scale is None
    assert p.resize == done  # no resize starts
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=3)
    assert (p.phase.phase, p.phase.reason) == (Phase.DEGRADED, "RankLost")
    assert "autoRecover is off" in p.phase.message


def test_a_runtime_that_restarted_under_a_resize_is_asked_again_without_a_new_spec() -> None:
    r = active(2, 4, Stage.STANDBY, rid="r1")
    fresh_runtime = runtime(2)  # the restarted runtime knows no resize at all
    p = plan(4, serving(2, r), observed(raycluster=ray(4), rt=fresh_runtime))
    assert p.resize.stage is Stage.FAILED and p.resize.retry is True
    assert "restarted" in (p.resize.message or "")
    p = plan(4, serving(2, p.resize), observed(raycluster=ray(4), rt=fresh_runtime))
    assert p.scale == 4  # the same generation is tried again


def test_a_head_restart_is_reported_once() -> None:
    obs = dataclasses.replace(observed(raycluster=ray(2), rt=runtime(2)), head_restarts=1)
    status = serving(2).model_copy(update={"head_restarts": 0})
    p = plan(2, status, obs)
    assert "RuntimeRestarted" in p.events
    new = plan_status.next_status(
        name="tiny", namespace="ml", generation=1, target=2, current=status, observed=obs,
        phase=p.phase, now="2026-01-01T00:00:30Z",
    )  # fmt: skip
    assert new.head_restarts == 1
    assert "RuntimeRestarted" not in plan(2, new, obs).events


def test_an_unhealthy_rank_degrades_the_deployment() -> None:
    rt = dataclasses.replace(
        runtime(2), unhealthy=(observe.LostRank(pod=PODS[0], reason="suspect"),)
    )
    p = plan(2, serving(2), observed(raycluster=ray(2), rt=rt, now=LATER))
    assert (p.phase.phase, p.phase.reason, p.phase.ready) == (Phase.DEGRADED, "RankUnhealthy", True)
    assert PODS[0] in p.phase.message


def test_the_runtime_status_of_a_recovery_parses() -> None:
    payload = runtime_status.ElasticStatus(
        data_parallel_size=2,
        resize=runtime_status.Resize(
            resize_id="rec1",
            kind="recovery",
            from_size=3,
            to_size=2,
            stage="Completed",
            stages=[runtime_status.StageTiming(stage="Recovering", duration_s=1.2)],
            recovery=runtime_status.Recovery(
                recovery_s=1.2,
                requests_rerun=4,
                ranks_lost=[runtime_status.LostRank(rank=1, pod=PODS[1], reason="dead")],
            ),
        ),
        ranks=[
            runtime_status.Rank(rank=0, active=True, pod=PODS[0], healthy=True),
            runtime_status.Rank(rank=1, active=True, pod=PODS[2], healthy=False, state="suspect"),
            runtime_status.Rank(
                rank=None, lost_rank=1, active=False, pod=PODS[1], healthy=False, state="dead"
            ),
        ],
        ready=True,
    ).to_json()
    obs = observe.runtime(payload)
    assert obs is not None and obs.resize is not None
    assert obs.resize.is_recovery and obs.resize.lost == LOST and obs.resize.requests_rerun == 4
    assert obs.lost == LOST
    assert obs.unhealthy == (observe.LostRank(pod=PODS[2], reason="suspect"),)
    assert obs.active_pods == (PODS[0], PODS[2])
