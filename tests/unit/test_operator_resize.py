"""The live-resize planner (``plan.resize``): pure, table-driven, no cluster and no runtime."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from moe_contract import status as runtime_status
from moe_operator.api import status as status_
from moe_operator.plan import actions, observe, scale_answer
from moe_operator.plan import status as plan_status
from tests.support import resize_plan as base


# -- scale up ------------------------------------------------------------------------------------
def test_up_starts_by_provisioning_workers() -> None:
    p = base.plan(4, base.serving(2), base.observed(raycluster=base.ray(2), rt=base.runtime(2)))
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=4)
    assert p.scale is None
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (2, 4, base.Stage.PROVISIONING)
    assert (p.resize.generation, p.resize.resize_id) == (1, None)
    assert p.events == ["Provisioning"]
    assert p.requeue
    assert (p.phase.phase, p.phase.ready) == (base.Phase.RESIZING, True)


@pytest.mark.parametrize(
    ("ready", "pending", "leaving", "asks"),
    [
        (3, (), (), False),
        (4, (), (), True),
        # KubeRay never clears workersToDelete: a name whose pod is gone blocks nothing.
        (4, ("old-pod",), (), True),
        # ... but while that pod still terminates, it does.
        (4, ("old-pod",), ("old-pod",), False),
    ],
    ids=["three-of-four", "all-ready", "stale-name", "deleted-pod-still-terminating"],
)
def test_up_asks_the_runtime_once_every_worker_is_ready(
    ready: int, pending: tuple[str, ...], leaving: tuple[str, ...], asks: bool
) -> None:
    obs = dataclasses.replace(
        base.observed(raycluster=base.ray(4, ready, delete=pending), rt=base.runtime(2)),
        leaving_pods=leaving,
    )
    p = base.plan(4, base.serving(2, base.active(2, 4, base.Stage.PROVISIONING)), obs)
    assert p.scale == (4 if asks else None)
    assert p.raycluster.worker_replicas == 4
    # the operator keeps a name only while its pod exists, and writes the list explicitly
    assert p.raycluster.workers_to_delete == tuple(n for n in pending if n in leaving)
    suffix = f"; {len(leaving)} leaving" if leaving else ""
    assert p.resize.message == f"{ready} of 4 workers ready{suffix}"
    assert p.events == []


def test_up_mirrors_every_runtime_stage_entered_since_the_last_look() -> None:
    rec = base.record(
        2, 4, "Switching", stages=(("Standby", 0.3), ("Transferring", 0.2), ("Switching", None))
    )
    p = base.plan(
        4,
        base.serving(2, base.active(2, 4, base.Stage.STANDBY, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=base.runtime(2, rec)),
    )
    assert p.scale is None
    assert p.resize.stage is base.Stage.SWITCHING
    assert p.resize.stage_durations == {"Standby": 0.3, "Transferring": 0.2}
    assert p.events == ["Transferring", "Switching"]
    assert p.raycluster.worker_replicas == 4


def test_up_completes_when_the_runtime_record_does() -> None:
    rec = base.record(2, 4, "Completed", stages=(("Standby", 1.0), ("Reshuffling", 1.0)))
    p = base.plan(
        4,
        base.serving(2, base.active(2, 4, base.Stage.RESHUFFLING, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=base.runtime(4, rec)),
    )
    assert p.resize.stage is base.Stage.COMPLETED and p.resize.finished_at
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=4)
    assert p.events == ["Completed"]
    assert (p.phase.phase, p.phase.ready) == (base.Phase.SERVING, True)
    assert not p.requeue


# -- scale down ----------------------------------------------------------------------------------
def test_down_asks_the_runtime_first_and_keeps_the_workers() -> None:
    p = base.plan(2, base.serving(4), base.observed(raycluster=base.ray(4), rt=base.runtime(4)))
    assert p.scale == 2
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=4)
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (4, 2, base.Stage.RESHUFFLING)


def test_down_completes_by_deleting_exactly_the_freed_pods() -> None:
    freed = (base.PODS[3], base.PODS[2])
    rec = base.record(4, 2, "Completed", freed=freed, stages=(("Releasing", 0.1),))
    p = base.plan(
        2,
        base.serving(4, base.active(4, 2, base.Stage.RELEASING, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=base.runtime(2, rec)),
    )
    assert p.raycluster == actions.ApplyRayCluster(
        worker_replicas=2, workers_to_delete=tuple(sorted(freed))
    )
    assert p.resize.stage is base.Stage.COMPLETED
    assert p.resize.freed_pods == list(freed)


def test_a_tp2_shrink_deletes_exactly_the_pods_of_the_freed_ranks() -> None:
    """At T = 2 a DP rank is two rank actors in one worker pod: a shrink 4 -> 2 frees two
    pods, named once each in workersToDelete and status.resize.freedPods, whether the runtime
    reports a freed rank once or once per actor."""
    freed = [
        runtime_status.FreedRank(rank=rank, pod=base.PODS[rank], tp_rank=tp_rank)
        for rank in (3, 2)
        for tp_rank in (0, 1)
    ]
    payload = runtime_status.ElasticStatus(
        data_parallel_size=2,
        target_data_parallel_size=2,
        stage="Completed",
        resize=runtime_status.Resize(
            resize_id="r1",
            from_size=4,
            to_size=2,
            stage="Completed",
            started_at=base.T0.timestamp(),
            stages=[runtime_status.StageTiming(stage="Releasing", duration_s=0.1)],
            freed=freed,
        ),
        ranks=[runtime_status.Rank(rank=r, pod=base.PODS[r]) for r in (0, 1)],
    ).to_json()
    rt = observe.runtime(payload)
    assert rt is not None
    p = base.plan(
        2,
        base.serving(4, base.active(4, 2, base.Stage.RELEASING, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=rt),
        tp=2,
    )
    assert p.raycluster == actions.ApplyRayCluster(
        worker_replicas=2, workers_to_delete=(base.PODS[2], base.PODS[3])
    )
    assert p.resize.stage is base.Stage.COMPLETED
    assert p.resize.freed_pods == [base.PODS[3], base.PODS[2]]


@pytest.mark.parametrize(
    ("worker_pods", "leaving", "kept"),
    [
        (
            base.PODS[:2],
            (base.PODS[2],),
            (base.PODS[2],),
        ),  # KubeRay deleted it; it still terminates
        (base.PODS[:3], (), (base.PODS[2],)),  # KubeRay has not acted yet
        (base.PODS[:2], (), ()),  # gone: the operator drops the name (KubeRay never would)
        (None, (), (base.PODS[2],)),  # pods not listed: keep every name
    ],
    ids=["terminating", "not-yet-deleted", "gone", "pods-unknown"],
)
def test_workers_to_delete_keeps_a_name_exactly_while_its_pod_exists(
    worker_pods: tuple[str, ...] | None, leaving: tuple[str, ...], kept: tuple[str, ...]
) -> None:
    obs = dataclasses.replace(
        base.observed(raycluster=base.ray(2, delete=(base.PODS[2],)), rt=base.runtime(2)),
        worker_pods=worker_pods,
        leaving_pods=leaving,
    )
    p = base.plan(2, base.serving(2), obs)
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=2, workers_to_delete=kept)


# -- restarts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stage", [base.Stage.STANDBY, base.Stage.TRANSFERRING, base.Stage.PROVISIONING]
)
def test_a_recorded_resize_id_is_never_asked_for_again(stage: base.Stage) -> None:
    rec = base.record(2, 4, "Transferring", stages=(("Standby", 0.1), ("Transferring", None)))
    p = base.plan(
        4,
        base.serving(2, base.active(2, 4, stage, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=base.runtime(2, rec)),
    )
    assert p.scale is None
    assert p.resize.stage is base.Stage.TRANSFERRING and p.resize.resize_id == "r1"


@pytest.mark.parametrize(
    ("stored", "rec", "dp"),
    [
        (base.active(2, 4, base.Stage.PROVISIONING), base.record(2, 4, "Standby", rid="lost"), 2),
        (base.active(2, 4, base.Stage.PROVISIONING), base.record(2, 4, "Completed", rid="lost"), 4),
        (None, base.record(4, 2, "Migrating", rid="lost"), 4),
    ],
    ids=["running", "finished", "status-never-written"],
)
def test_a_resize_whose_answer_was_lost_is_adopted(
    stored: status_.ResizeStatus | None, rec: observe.RuntimeResize, dp: int
) -> None:
    target = rec.to_size
    p = base.plan(
        target,
        base.serving(rec.from_size, stored),
        base.observed(raycluster=base.ray(4), rt=base.runtime(dp, rec)),
    )
    assert p.scale is None
    assert p.resize.resize_id == "lost"


# -- a new target --------------------------------------------------------------------------------
def test_a_new_target_waits_for_the_running_resize() -> None:
    rec = base.record(2, 4, "Standby", stages=(("Standby", None),))
    p = base.plan(
        3,
        base.serving(2, base.active(2, 4, base.Stage.STANDBY, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=base.runtime(2, rec)),
    )
    assert p.scale is None and p.resize.to_size == 4


def test_the_latest_target_follows_a_completed_resize() -> None:
    rec = base.record(2, 4, "Completed")
    first = base.plan(
        3,
        base.serving(2, base.active(2, 4, base.Stage.SWITCHING, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=base.runtime(4, rec)),
    )
    assert first.resize.stage is base.Stage.COMPLETED and first.requeue
    assert first.phase.phase is base.Phase.RESIZING
    after = base.serving(4, first.resize)
    second = base.plan(3, after, base.observed(raycluster=base.ray(4), rt=base.runtime(4, rec)))
    assert second.scale == 3
    assert (second.resize.from_size, second.resize.to_size, second.resize.resize_id) == (4, 3, None)


def test_a_new_target_while_provisioning_retargets_without_a_second_runtime_resize() -> None:
    p = base.plan(
        3,
        base.serving(2, base.active(2, 4, base.Stage.PROVISIONING)),
        base.observed(raycluster=base.ray(4, 2), rt=base.runtime(2)),
    )
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (2, 3, base.Stage.PROVISIONING)
    assert p.raycluster.worker_replicas == 3


def test_a_target_back_to_the_serving_size_while_provisioning_ends_the_resize() -> None:
    p = base.plan(
        2,
        base.serving(2, base.active(2, 4, base.Stage.PROVISIONING)),
        base.observed(raycluster=base.ray(4, 3), rt=base.runtime(2), pods=base.PODS),
    )
    assert p.resize.stage is base.Stage.COMPLETED
    assert p.scale is None
    assert p.raycluster == actions.ApplyRayCluster(
        worker_replicas=2, workers_to_delete=base.PODS[2:]
    )


def test_a_down_target_while_provisioning_turns_into_a_scale_down() -> None:
    p = base.plan(
        1,
        base.serving(2, base.active(2, 4, base.Stage.PROVISIONING)),
        base.observed(raycluster=base.ray(4, 3), rt=base.runtime(2)),
    )
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (2, 1, base.Stage.RESHUFFLING)
    assert p.scale == 1


# -- failures ------------------------------------------------------------------------------------
def test_a_refusal_fails_the_resize_with_the_runtime_message() -> None:
    r = base.active(2, 1, base.Stage.RESHUFFLING)
    failed, events = scale_answer.after_scale(
        r, actions.ScaleRefused("too small to hold every expert"), now=base.LATER
    )
    assert failed.stage is base.Stage.FAILED
    assert failed.message is not None and "too small to hold every expert" in failed.message
    assert [e.reason for e in events] == ["Failed"]
    phase = scale_answer.phase_after_scale(failed, actions.SetPhase(base.Phase.RESIZING, "x", "y"))
    assert (phase.phase, phase.reason, phase.ready) == (base.Phase.DEGRADED, "ResizeFailed", True)


@pytest.mark.parametrize(("generation", "retried"), [(1, False), (2, True)], ids=["same", "new"])
def test_a_failed_target_is_retried_only_for_a_new_generation(
    generation: int, retried: bool
) -> None:
    failed = base.active(2, 1, base.Stage.FAILED, generation=1, message="too small")
    p = base.plan(
        1,
        base.serving(2, failed),
        base.observed(raycluster=base.ray(2), rt=base.runtime(2), generation=generation),
    )
    assert (p.scale == 1) is retried
    if not retried:
        assert (p.phase.phase, p.phase.reason, p.phase.ready) == (
            base.Phase.DEGRADED,
            "ResizeFailed",
            True,
        )
        assert p.resize == failed


def test_a_failed_scale_up_gives_back_the_workers_that_do_not_serve() -> None:
    failed = base.active(2, 4, base.Stage.FAILED, message="boom")
    p = base.plan(
        4,
        base.serving(2, failed),
        base.observed(raycluster=base.ray(4), rt=base.runtime(2), pods=base.PODS),
    )
    assert p.raycluster == actions.ApplyRayCluster(
        worker_replicas=2, workers_to_delete=base.PODS[2:]
    )
    assert p.scale is None


def test_a_failed_runtime_record_fails_the_resize() -> None:
    rec = base.record(
        2, 4, "Failed", message="Standby failed: no node; serving at data parallel size 2"
    )
    p = base.plan(
        4,
        base.serving(2, base.active(2, 4, base.Stage.STANDBY, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=base.runtime(2, rec), pods=base.PODS),
    )
    assert p.resize.stage is base.Stage.FAILED
    assert p.resize.message == rec.message
    assert p.events == ["Failed"]
    assert p.phase.phase is base.Phase.DEGRADED
    assert p.raycluster == actions.ApplyRayCluster(
        worker_replicas=2, workers_to_delete=base.PODS[2:]
    )


@pytest.mark.parametrize(
    ("stored", "rt"),
    [
        (base.active(2, 4, base.Stage.PROVISIONING), base.runtime(2)),
        (
            base.active(2, 4, base.Stage.STANDBY, rid="r1"),
            base.runtime(2, base.record(2, 4, "Standby")),
        ),
        (base.active(2, 4, base.Stage.STANDBY, rid="r1"), None),
    ],
    ids=["provisioning", "runtime-stage", "runtime-unreachable"],
)
def test_a_resize_past_its_timeout_fails(
    stored: status_.ResizeStatus, rt: observe.RuntimeObservation | None
) -> None:
    p = base.plan(
        4,
        base.serving(2, stored),
        base.observed(
            raycluster=base.ray(4, 3), rt=rt, now=base.T0 + datetime.timedelta(seconds=61)
        ),
        timeout=60,
    )
    assert p.resize.stage is base.Stage.FAILED
    assert p.resize.message is not None and "timed out after 60s" in p.resize.message
    assert p.phase.phase is base.Phase.DEGRADED


def test_an_unreachable_runtime_does_not_fail_the_resize_before_its_timeout() -> None:
    p = base.plan(
        4,
        base.serving(2, base.active(2, 4, base.Stage.SWITCHING, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=None),
    )
    assert p.resize.stage is base.Stage.SWITCHING
    assert p.scale is None and p.requeue
    assert p.raycluster.worker_replicas == 4
    assert (p.phase.phase, p.phase.ready) == (base.Phase.RESIZING, True)


def test_a_runtime_that_forgot_the_resize_fails_it() -> None:
    p = base.plan(
        4,
        base.serving(2, base.active(2, 4, base.Stage.STANDBY, rid="r1")),
        base.observed(raycluster=base.ray(4), rt=base.runtime(2)),
    )
    assert p.resize.stage is base.Stage.FAILED
    assert p.resize.message is not None and "no longer knows resize r1" in p.resize.message


def test_someone_elses_resize_is_waited_for() -> None:
    rec = base.record(2, 3, "Standby", rid="theirs")
    p = base.plan(
        4, base.serving(2), base.observed(raycluster=base.ray(2), rt=base.runtime(2, rec))
    )
    assert p.scale is None and p.requeue
    assert p.phase.phase is base.Phase.RESIZING and p.phase.reason == "RuntimeBusy"


def test_first_provisioning_follows_the_spec_without_a_resize() -> None:
    p = base.plan(
        3,
        status_.MoEDeploymentStatus(phase=base.Phase.PROVISIONING),
        base.observed(raycluster=base.ray(2, 1), rt=None),
    )
    assert p.raycluster.worker_replicas == 3
    assert p.one(actions.SetResize).resize is None and p.scale is None


def test_a_runtime_first_seen_at_another_size_is_resized() -> None:
    p = base.plan(
        3,
        status_.MoEDeploymentStatus(phase=base.Phase.PROVISIONING),
        base.observed(raycluster=base.ray(3), rt=base.runtime(2)),
    )
    assert p.scale == 3 and p.resize.from_size == 2


# -- folding the runtime's answer ---------------------------------------------------------------------
def test_an_accepted_scale_records_the_resize_id_and_the_provisioning_time() -> None:
    r = base.active(2, 4, base.Stage.PROVISIONING)
    got, events = scale_answer.after_scale(
        r, actions.ScaleAccepted("abc", "Standby"), now=base.LATER
    )
    assert (got.resize_id, got.stage) == ("abc", base.Stage.STANDBY)
    assert got.stage_durations == {"Provisioning": 30.0}
    assert [e.reason for e in events] == ["Standby"]


def test_a_deferred_scale_keeps_the_stage_and_asks_again_later() -> None:
    r = base.active(4, 2, base.Stage.RESHUFFLING)
    got, events = scale_answer.after_scale(r, actions.ScaleDeferred("busy"), now=base.LATER)
    assert (got.stage, got.resize_id, events) == (base.Stage.RESHUFFLING, None, [])


# -- status --------------------------------------------------------------------------------------
def test_resizing_condition_names_the_stage_and_ready_stays_true() -> None:
    r = base.active(2, 4, base.Stage.TRANSFERRING, rid="r1")
    obs = base.observed(
        raycluster=base.ray(4), rt=base.runtime(2, base.record(2, 4, "Transferring"))
    )
    p = base.plan(4, base.serving(2, r), obs)
    new = plan_status.next_status(
        name="tiny", namespace="ml", generation=1, target=4, current=base.serving(2, r),
        observed=obs, phase=p.phase, now=base.T0_TEXT, resize_status=p.resize,
    )  # fmt: skip
    resizing, ready = new.condition("Resizing"), new.condition("Ready")
    assert resizing is not None and (resizing.status, resizing.reason) == ("True", "Transferring")
    assert ready is not None and ready.status == "True"
    assert new.phase is base.Phase.RESIZING and new.data_parallel_size == 2


def test_merge_patch_nulls_nested_keys_that_went_away() -> None:
    old = {"resize": {"resizeId": "old", "stage": "Completed", "fromSize": 2, "toSize": 4}}
    new = status_.MoEDeploymentStatus(
        resize=status_.ResizeStatus(from_size=4, to_size=2, stage=base.Stage.RESHUFFLING)
    )
    patch = plan_status.merge_patch(old, new)
    assert patch["resize"]["resizeId"] is None
    assert patch["resize"]["stage"] == "Reshuffling"


def test_observe_parses_runtime_records() -> None:
    releasing = runtime_status.Resize(
        resize_id="r9",
        from_size=4,
        to_size=2,
        stage="Releasing",
        started_at=1.0,
        stage_started_at=2.0,
        stages=[
            runtime_status.StageTiming(stage="Reshuffling", started_at=1.0, duration_s=0.5),
            runtime_status.StageTiming(stage="Releasing", started_at=2.0, duration_s=None),
        ],
        freed=[runtime_status.FreedRank(pod="p3", rank=3), runtime_status.FreedRank(pod=None)],
    )
    got = observe.runtime(
        runtime_status.ElasticStatus(
            data_parallel_size=4,
            target_data_parallel_size=2,
            stage="Releasing",
            resize=releasing,
            ranks=[
                runtime_status.Rank(rank=0, pod="p0", active=True),
                runtime_status.Rank(rank=3, pod="p3", active=False),
            ],
        ).to_json()
    )
    assert got is not None and got.running is not None
    assert got.running.stages == (("Reshuffling", 0.5), ("Releasing", None))
    assert got.running.freed_pods == ("p3",)
    assert got.active_pods == ("p0",)
    assert got.find("r9") is got.resize and got.find("nope") is None


def test_a_resize_not_yet_asked_for_waits_while_the_runtime_runs_another() -> None:
    rec = base.record(2, 3, "Standby", rid="theirs")
    p = base.plan(
        4,
        base.serving(2, base.active(2, 4, base.Stage.PROVISIONING)),
        base.observed(raycluster=base.ray(4), rt=base.runtime(2, rec)),
    )
    assert p.scale is None and p.requeue
    assert p.resize.resize_id is None and "theirs" in (p.resize.message or "")


@pytest.mark.parametrize(
    ("pods", "active_pods", "replicas", "delete"),
    [
        (base.PODS, base.PODS[:2], 2, base.PODS[2:]),
        (None, base.PODS[:2], 4, ()),
        (base.PODS, None, 4, ()),
        ((), base.PODS[:2], 2, ()),
    ],
    ids=["named", "pods-unknown", "ranks-unknown", "no-pods-yet"],
)
def test_a_shrink_after_a_failure_never_leaves_kuberay_to_pick_pods(
    pods: tuple[str, ...] | None,
    active_pods: tuple[str, ...] | None,
    replicas: int,
    delete: tuple[str, ...],
) -> None:
    failed = base.active(2, 4, base.Stage.FAILED, message="boom")
    rt = dataclasses.replace(base.runtime(2), active_pods=active_pods)
    obs = dataclasses.replace(base.observed(raycluster=base.ray(4), rt=rt), worker_pods=pods)
    p = base.plan(4, base.serving(2, failed), obs)
    assert p.raycluster == actions.ApplyRayCluster(
        worker_replicas=replicas, workers_to_delete=delete
    )
