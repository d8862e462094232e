"""Warm spare ranks in the operator (``spec.elastic.warmSpareRanks``): the RayCluster keeps
that many worker pods beside the ranks, a grow they cover is asked for at once (no
Provisioning), every shrink keeps the spares' pods, and the status reports them."""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_contract import status as runtime_status
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, builders, observe, resize, scale_answer
from moe_operator.plan import status as plan_status
from tests.support import resize_plan as base

Stage = status_.Stage
PODS = base.PODS + ("tiny-ranks-worker-e", "tiny-ranks-worker-f")


def spec(dp: int, spares: int) -> spec_.MoEDeploymentSpec:
    return spec_.MoEDeploymentSpec.model_validate(
        {
            "model": {"source": "synthetic://tiny"},
            "dataParallelSize": dp,
            "maxDataParallelSize": 4,
            "elastic": {"warmSpareRanks": spares},
        }
    )


def runtime(
    dp: int,
    last: observe.RuntimeResize | None = None,
    *,
    active: tuple[str, ...],
    spares: tuple[str, ...],
    ready: int | None = None,
) -> observe.RuntimeObservation:
    return dataclasses.replace(
        base.runtime(dp, last, pods=active),
        warm_spare_ranks=len(spares),
        spare_pods=spares,
        spares_ready=len(spares) if ready is None else ready,
    )


def plan(
    target: int, spares: int, status: status_.MoEDeploymentStatus, obs: observe.Observed
) -> base.Plan:
    return base.Plan(resize.plan_resize(spec(target, spares), status, obs))


def test_the_raycluster_has_a_worker_per_rank_and_per_spare() -> None:
    owner = builders.Owner(name="tiny", namespace="ns", uid="u1")
    ray = builders.build_raycluster(owner=owner, spec=spec(2, 2))
    (group,) = ray["spec"]["workerGroupSpecs"]
    # KubeRay clamps replicas into [minReplicas, maxReplicas]: the spares ride on top of max.
    assert (group["replicas"], group["maxReplicas"]) == (4, 6)
    command = builders.serve_command(owner_name="tiny", spec=spec(2, 2))
    assert command[command.index("--warm-spare-ranks") + 1] == "2"
    assert "--warm-spare-ranks" not in builders.serve_command(owner_name="tiny", spec=spec(2, 0))


def test_first_provisioning_asks_for_the_spares_pods_too() -> None:
    p = plan(2, 1, status_.MoEDeploymentStatus(), base.observed(raycluster=None, rt=None))
    assert p.raycluster.worker_replicas == 3


def test_idle_keeps_the_spares_pods_and_names_only_idle_ones() -> None:
    rt = runtime(2, active=PODS[:2], spares=(PODS[2],))
    # 4 pods for 2 ranks + 1 spare: the one neither serving nor spare goes, never the spare.
    obs = base.observed(raycluster=base.ray(4), rt=rt, pods=PODS[:4])
    p = plan(2, 1, base.serving(2), obs)
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=3, workers_to_delete=(PODS[3],))
    # At 2 + 1 pods nothing is deleted.
    obs = base.observed(raycluster=base.ray(3), rt=rt, pods=PODS[:3])
    assert plan(2, 1, base.serving(2), obs).raycluster == actions.ApplyRayCluster(worker_replicas=3)


def test_a_grow_the_spares_cover_is_asked_for_at_once_without_provisioning() -> None:
    rt = runtime(2, active=PODS[:2], spares=(PODS[2],))
    obs = base.observed(raycluster=base.ray(3), rt=rt, pods=PODS[:3])
    p = plan(3, 1, base.serving(2), obs)
    assert p.scale == 3
    # 3 ranks + a replacement spare
    assert p.raycluster.worker_replicas == 4
    assert "Provisioning" not in p.events
    accepted = actions.ScaleAccepted(resize_id="r1", stage="Transferring")
    folded, events = scale_answer.after_scale(p.resize, accepted, now=base.LATER)
    assert folded.stage is Stage.TRANSFERRING and [e.reason for e in events] == ["Transferring"]
    assert "Provisioning" not in (folded.stage_durations or {})


def test_a_grow_past_the_spares_provisions_the_rest() -> None:
    rt = runtime(2, active=PODS[:2], spares=(PODS[2],))
    obs = base.observed(raycluster=base.ray(3), rt=rt, pods=PODS[:3])
    p = plan(4, 1, base.serving(2), obs)
    assert p.scale is None and p.raycluster.worker_replicas == 5
    assert p.resize.stage is Stage.PROVISIONING and p.events == ["Provisioning"]
    # Once a 4th pod is ready (2 serving + the spare + 1 new), the runtime is asked.
    obs = base.observed(raycluster=base.ray(5, ready=4), rt=rt, pods=PODS[:5])
    assert plan(4, 1, base.serving(2, p.resize), obs).scale == 4


def test_a_completed_shrink_deletes_the_freed_pod_and_keeps_the_spare() -> None:
    done = base.record(3, 2, "Completed", stages=(("Releasing", 0.1),), freed=(PODS[2],))
    rt = runtime(2, done, active=PODS[:2], spares=(PODS[3],))
    obs = base.observed(raycluster=base.ray(4), rt=rt, pods=PODS[:4])
    p = plan(2, 1, base.serving(3, base.active(3, 2, Stage.RELEASING, rid="r1")), obs)
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=3, workers_to_delete=(PODS[2],))


def test_status_reports_the_spares() -> None:
    rt = runtime(2, active=PODS[:2], spares=(PODS[2], PODS[3]), ready=1)
    obs = base.observed(raycluster=base.ray(4), rt=rt, pods=PODS[:4])
    phase = actions.SetPhase(status_.Phase.SERVING, "Serving", "serving 2 ranks", ready=True)
    st = plan_status.next_status(
        name="tiny",
        namespace="ns",
        generation=1,
        target=2,
        current=status_.MoEDeploymentStatus(),
        observed=obs,
        phase=phase,
        now=base.T0_TEXT,
    )
    assert st.spares == status_.SparesStatus(desired=2, ready=1, pods=[PODS[2], PODS[3]])
    wire: dict[str, Any] = st.to_wire()
    assert wire["spares"] == {"desired": 2, "ready": 1, "pods": [PODS[2], PODS[3]]}


def test_the_runtime_payload_names_the_spares_pods() -> None:
    payload = runtime_status.ElasticStatus(
        data_parallel_size=2,
        ranks=[runtime_status.Rank(rank=0, pod=PODS[0]), runtime_status.Rank(rank=1, pod=PODS[1])],
        warm_spare_ranks=1,
        spares=[runtime_status.Spare(rank=2, pod=PODS[2], ready=True, healthy=True)],
    )
    rt = observe.runtime(payload.to_json())
    assert rt is not None
    assert (rt.active_pods, rt.spare_pods, rt.spares_ready) == (PODS[:2], (PODS[2],), 1)
