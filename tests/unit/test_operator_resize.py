"""The live-resize planner (``plan.resize``): pure, table-driven, no cluster and no runtime."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest

from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, observe, resize, scale_answer
from moe_operator.plan import status as plan_status

Stage = status_.Stage
Phase = status_.Phase
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
T0_TEXT = "2026-01-01T00:00:00Z"
LATER = T0 + datetime.timedelta(seconds=30)
PODS = ("tiny-ranks-worker-a", "tiny-ranks-worker-b", "tiny-ranks-worker-c", "tiny-ranks-worker-d")


def spec(dp: int, *, timeout: int = 600) -> spec_.MoEDeploymentSpec:
    return spec_.MoEDeploymentSpec.model_validate(
        {
            "model": {"source": "synthetic://tiny"},
            "dataParallelSize": dp,
            "maxDataParallelSize": 4,
            "elastic": {"resizeTimeoutSeconds": timeout},
        }
    )


def ray(
    replicas: int, ready: int | None = None, *, delete: tuple[str, ...] = ()
) -> observe.RayClusterObservation:
    return observe.RayClusterObservation(
        worker_replicas=replicas,
        ready_workers=replicas if ready is None else ready,
        head_ready=True,
        workers_to_delete=delete,
    )


def record(
    frm: int,
    to: int,
    stage: str,
    *,
    rid: str = "r1",
    stages: tuple[tuple[str, float | None], ...] = (),
    freed: tuple[str, ...] = (),
    message: str = "",
    started: float | None = None,
) -> observe.RuntimeResize:
    return observe.RuntimeResize(
        resize_id=rid,
        from_size=frm,
        to_size=to,
        stage=stage,
        message=message,
        started_at=started if started is not None else T0.timestamp(),
        stage_started_at=T0.timestamp() + 5,
        stages=stages,
        freed_pods=freed,
    )


def runtime(
    dp: int, last: observe.RuntimeResize | None = None, *, pods: tuple[str, ...] | None = None
) -> observe.RuntimeObservation:
    history = (last,) if last is not None and last.done else ()
    return observe.RuntimeObservation(
        data_parallel_size=dp,
        target_data_parallel_size=last.to_size if last is not None and not last.done else dp,
        stage=last.stage if last is not None else "Idle",
        resize=last,
        history=history,
        active_pods=pods if pods is not None else PODS[:dp],
    )


def observed(
    *,
    raycluster: observe.RayClusterObservation | None,
    rt: observe.RuntimeObservation | None,
    generation: int = 1,
    now: datetime.datetime = LATER,
    pods: tuple[str, ...] | None = None,
) -> observe.Observed:
    return observe.Observed(
        raycluster=raycluster,
        secret_exists=True,
        service_exists=True,
        runtime=rt,
        worker_pods=pods
        if pods is not None
        else PODS[: raycluster.worker_replicas if raycluster else 0],
        generation=generation,
        now=now,
    )


def serving(dp: int, r: status_.ResizeStatus | None = None) -> status_.MoEDeploymentStatus:
    phase = Phase.RESIZING if r is not None and r.active else Phase.SERVING
    return status_.MoEDeploymentStatus(phase=phase, data_parallel_size=dp, resize=r)


def active(
    frm: int,
    to: int,
    stage: Stage,
    *,
    rid: str | None = None,
    generation: int = 1,
    started: str = T0_TEXT,
    **extra: Any,
) -> status_.ResizeStatus:
    return status_.ResizeStatus(
        from_size=frm,
        to_size=to,
        stage=stage,
        started_at=started,
        stage_started_at=started,
        resize_id=rid,
        generation=generation,
        **extra,
    )


@dataclasses.dataclass
class Plan:
    actions: list[actions.Action]

    def one(self, kind: type[Any]) -> Any:
        found = [a for a in self.actions if isinstance(a, kind)]
        assert len(found) == 1, (kind, self.actions)
        return found[0]

    @property
    def raycluster(self) -> actions.ApplyRayCluster:
        result: actions.ApplyRayCluster = self.one(actions.ApplyRayCluster)
        return result

    @property
    def resize(self) -> status_.ResizeStatus:
        r = self.one(actions.SetResize).resize
        assert r is not None
        return r  # type: ignore[no-any-return]

    @property
    def scale(self) -> int | None:
        found = [a.new_size for a in self.actions if isinstance(a, actions.ScaleRuntime)]
        assert len(found) <= 1
        return found[0] if found else None

    @property
    def phase(self) -> actions.SetPhase:
        last = self.actions[-1]
        assert isinstance(last, actions.SetPhase)
        return last

    @property
    def events(self) -> list[str]:
        return [a.reason for a in self.actions if isinstance(a, actions.Event)]

    @property
    def requeue(self) -> bool:
        return any(isinstance(a, actions.Requeue) for a in self.actions)


def plan(
    target: int, status: status_.MoEDeploymentStatus, obs: observe.Observed, **kw: Any
) -> Plan:
    return Plan(resize.plan_resize(spec(target, **kw), status, obs))


# -- scale up ------------------------------------------------------------------------------------
def test_up_starts_by_provisioning_workers() -> None:
    p = plan(4, serving(2), observed(raycluster=ray(2), rt=runtime(2)))
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=4)
    assert p.scale is None
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (2, 4, Stage.PROVISIONING)
    assert (p.resize.generation, p.resize.resize_id) == (1, None)
    assert p.events == ["Provisioning"]
    assert p.requeue
    assert (p.phase.phase, p.phase.ready) == (Phase.RESIZING, True)


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
        observed(raycluster=ray(4, ready, delete=pending), rt=runtime(2)), leaving_pods=leaving
    )
    p = plan(4, serving(2, active(2, 4, Stage.PROVISIONING)), obs)
    assert p.scale == (4 if asks else None)
    assert p.raycluster.worker_replicas == 4
    # the operator keeps a name only while its pod exists, and writes the list explicitly
    assert p.raycluster.workers_to_delete == tuple(n for n in pending if n in leaving)
    suffix = f"; {len(leaving)} leaving" if leaving else ""
    assert p.resize.message == f"{ready} of 4 workers ready{suffix}"
    assert p.events == []


def test_up_mirrors_every_runtime_stage_entered_since_the_last_look() -> None:
    rec = record(
        2, 4, "Switching", stages=(("Standby", 0.3), ("Transferring", 0.2), ("Switching", None))
    )
    p = plan(
        4,
        serving(2, active(2, 4, Stage.STANDBY, rid="r1")),
        observed(raycluster=ray(4), rt=runtime(2, rec)),
    )
    assert p.scale is None
    assert p.resize.stage is Stage.SWITCHING
    assert p.resize.stage_durations == {"Standby": 0.3, "Transferring": 0.2}
    assert p.events == ["Transferring", "Switching"]
    assert p.raycluster.worker_replicas == 4


def test_up_completes_when_the_runtime_record_does() -> None:
    rec = record(2, 4, "Completed", stages=(("Standby", 1.0), ("Reshuffling", 1.0)))
    p = plan(
        4,
        serving(2, active(2, 4, Stage.RESHUFFLING, rid="r1")),
        observed(raycluster=ray(4), rt=runtime(4, rec)),
    )
    assert p.resize.stage is Stage.COMPLETED and p.resize.finished_at
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=4)
    assert p.events == ["Completed"]
    assert (p.phase.phase, p.phase.ready) == (Phase.SERVING, True)
    assert not p.requeue


# -- scale down ----------------------------------------------------------------------------------
def test_down_asks_the_runtime_first_and_keeps_the_workers() -> None:
    p = plan(2, serving(4), observed(raycluster=ray(4), rt=runtime(4)))
    assert p.scale == 2
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=4)
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (4, 2, Stage.RESHUFFLING)


def test_down_completes_by_deleting_exactly_the_freed_pods() -> None:
    freed = (PODS[3], PODS[2])
    rec = record(4, 2, "Completed", freed=freed, stages=(("Releasing", 0.1),))
    p = plan(
        2,
        serving(4, active(4, 2, Stage.RELEASING, rid="r1")),
        observed(raycluster=ray(4), rt=runtime(2, rec)),
    )
    assert p.raycluster == actions.ApplyRayCluster(
        worker_replicas=2, workers_to_delete=tuple(sorted(freed))
    )
    assert p.resize.stage is Stage.COMPLETED
    assert p.resize.freed_pods == list(freed)


@pytest.mark.parametrize(
    ("worker_pods", "leaving", "kept"),
    [
        (PODS[:2], (PODS[2],), (PODS[2],)),  # KubeRay deleted it; it still terminates
        (PODS[:3], (), (PODS[2],)),  # KubeRay has not acted yet
        (PODS[:2], (), ()),  # gone: the operator drops the name (KubeRay never would)
        (None, (), (PODS[2],)),  # pods not listed: keep every name
    ],
    ids=["terminating", "not-yet-deleted", "gone", "pods-unknown"],
)
def test_workers_to_delete_keeps_a_name_exactly_while_its_pod_exists(
    worker_pods: tuple[str, ...] | None, leaving: tuple[str, ...], kept: tuple[str, ...]
) -> None:
    obs = dataclasses.replace(
        observed(raycluster=ray(2, delete=(PODS[2],)), rt=runtime(2)),
        worker_pods=worker_pods,
        leaving_pods=leaving,
    )
    p = plan(2, serving(2), obs)
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=2, workers_to_delete=kept)


# -- restarts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [Stage.STANDBY, Stage.TRANSFERRING, Stage.PROVISIONING])
def test_a_recorded_resize_id_is_never_asked_for_again(stage: Stage) -> None:
    rec = record(2, 4, "Transferring", stages=(("Standby", 0.1), ("Transferring", None)))
    p = plan(
        4,
        serving(2, active(2, 4, stage, rid="r1")),
        observed(raycluster=ray(4), rt=runtime(2, rec)),
    )
    assert p.scale is None
    assert p.resize.stage is Stage.TRANSFERRING and p.resize.resize_id == "r1"


@pytest.mark.parametrize(
    ("stored", "rec", "dp"),
    [
        (active(2, 4, Stage.PROVISIONING), record(2, 4, "Standby", rid="lost"), 2),
        (active(2, 4, Stage.PROVISIONING), record(2, 4, "Completed", rid="lost"), 4),
        (None, record(4, 2, "Migrating", rid="lost"), 4),
    ],
    ids=["running", "finished", "status-never-written"],
)
def test_a_resize_whose_answer_was_lost_is_adopted(
    stored: status_.ResizeStatus | None, rec: observe.RuntimeResize, dp: int
) -> None:
    target = rec.to_size
    p = plan(
        target, serving(rec.from_size, stored), observed(raycluster=ray(4), rt=runtime(dp, rec))
    )
    assert p.scale is None
    assert p.resize.resize_id == "lost"


# -- a new target --------------------------------------------------------------------------------
def test_a_new_target_waits_for_the_running_resize() -> None:
    rec = record(2, 4, "Standby", stages=(("Standby", None),))
    p = plan(
        3,
        serving(2, active(2, 4, Stage.STANDBY, rid="r1")),
        observed(raycluster=ray(4), rt=runtime(2, rec)),
    )
    assert p.scale is None and p.resize.to_size == 4


def test_the_latest_target_follows_a_completed_resize() -> None:
    rec = record(2, 4, "Completed")
    first = plan(
        3,
        serving(2, active(2, 4, Stage.SWITCHING, rid="r1")),
        observed(raycluster=ray(4), rt=runtime(4, rec)),
    )
    assert first.resize.stage is Stage.COMPLETED and first.requeue
    assert first.phase.phase is Phase.RESIZING
    after = serving(4, first.resize)
    second = plan(3, after, observed(raycluster=ray(4), rt=runtime(4, rec)))
    assert second.scale == 3
    assert (second.resize.from_size, second.resize.to_size, second.resize.resize_id) == (4, 3, None)


def test_a_new_target_while_provisioning_retargets_without_a_second_runtime_resize() -> None:
    p = plan(
        3,
        serving(2, active(2, 4, Stage.PROVISIONING)),
        observed(raycluster=ray(4, 2), rt=runtime(2)),
    )
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (2, 3, Stage.PROVISIONING)
    assert p.raycluster.worker_replicas == 3


def test_a_target_back_to_the_serving_size_while_provisioning_ends_the_resize() -> None:
    p = plan(
        2,
        serving(2, active(2, 4, Stage.PROVISIONING)),
        observed(raycluster=ray(4, 3), rt=runtime(2), pods=PODS),
    )
    assert p.resize.stage is Stage.COMPLETED
    assert p.scale is None
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=2, workers_to_delete=PODS[2:])


def test_a_down_target_while_provisioning_turns_into_a_scale_down() -> None:
    p = plan(
        1,
        serving(2, active(2, 4, Stage.PROVISIONING)),
        observed(raycluster=ray(4, 3), rt=runtime(2)),
    )
    assert (p.resize.from_size, p.resize.to_size, p.resize.stage) == (2, 1, Stage.RESHUFFLING)
    assert p.scale == 1


# -- failures ------------------------------------------------------------------------------------
def test_a_refusal_fails_the_resize_with_the_runtime_message() -> None:
    r = active(2, 1, Stage.RESHUFFLING)
    failed, events = scale_answer.after_scale(
        r, actions.ScaleRefused("too small to hold every expert"), now=LATER
    )
    assert failed.stage is Stage.FAILED
    assert failed.message is not None and "too small to hold every expert" in failed.message
    assert [e.reason for e in events] == ["Failed"]
    phase = scale_answer.phase_after_scale(failed, actions.SetPhase(Phase.RESIZING, "x", "y"))
    assert (phase.phase, phase.reason, phase.ready) == (Phase.DEGRADED, "ResizeFailed", True)


@pytest.mark.parametrize(("generation", "retried"), [(1, False), (2, True)], ids=["same", "new"])
def test_a_failed_target_is_retried_only_for_a_new_generation(
    generation: int, retried: bool
) -> None:
    failed = active(2, 1, Stage.FAILED, generation=1, message="too small")
    p = plan(
        1, serving(2, failed), observed(raycluster=ray(2), rt=runtime(2), generation=generation)
    )
    assert (p.scale == 1) is retried
    if not retried:
        assert (p.phase.phase, p.phase.reason, p.phase.ready) == (
            Phase.DEGRADED,
            "ResizeFailed",
            True,
        )
        assert p.resize == failed


def test_a_failed_scale_up_gives_back_the_workers_that_do_not_serve() -> None:
    failed = active(2, 4, Stage.FAILED, message="boom")
    p = plan(4, serving(2, failed), observed(raycluster=ray(4), rt=runtime(2), pods=PODS))
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=2, workers_to_delete=PODS[2:])
    assert p.scale is None


def test_a_failed_runtime_record_fails_the_resize() -> None:
    rec = record(2, 4, "Failed", message="Standby failed: no node; serving at data parallel size 2")
    p = plan(
        4,
        serving(2, active(2, 4, Stage.STANDBY, rid="r1")),
        observed(raycluster=ray(4), rt=runtime(2, rec), pods=PODS),
    )
    assert p.resize.stage is Stage.FAILED
    assert p.resize.message == rec.message
    assert p.events == ["Failed"]
    assert p.phase.phase is Phase.DEGRADED
    assert p.raycluster == actions.ApplyRayCluster(worker_replicas=2, workers_to_delete=PODS[2:])


@pytest.mark.parametrize(
    ("stored", "rt"),
    [
        (active(2, 4, Stage.PROVISIONING), runtime(2)),
        (active(2, 4, Stage.STANDBY, rid="r1"), runtime(2, record(2, 4, "Standby"))),
        (active(2, 4, Stage.STANDBY, rid="r1"), None),
    ],
    ids=["provisioning", "runtime-stage", "runtime-unreachable"],
)
def test_a_resize_past_its_timeout_fails(
    stored: status_.ResizeStatus, rt: observe.RuntimeObservation | None
) -> None:
    p = plan(
        4,
        serving(2, stored),
        observed(raycluster=ray(4, 3), rt=rt, now=T0 + datetime.timedelta(seconds=61)),
        timeout=60,
    )
    assert p.resize.stage is Stage.FAILED
    assert p.resize.message is not None and "timed out after 60s" in p.resize.message
    assert p.phase.phase is Phase.DEGRADED


def test_an_unreachable_runtime_does_not_fail_the_resize_before_its_timeout() -> None:
    p = plan(
        4, serving(2, active(2, 4, Stage.SWITCHING, rid="r1")), observed(raycluster=ray(4), rt=None)
    )
    assert p.resize.stage is Stage.SWITCHING
    assert p.scale is None and p.requeue
    assert p.raycluster.worker_replicas == 4
    assert (p.phase.phase, p.phase.ready) == (Phase.RESIZING, True)


def test_a_runtime_that_forgot_the_resize_fails_it() -> None:
    p = plan(
        4,
        serving(2, active(2, 4, Stage.STANDBY, rid="r1")),
        observed(raycluster=ray(4), rt=runtime(2)),
    )
    assert p.resize.stage is Stage.FAILED
    assert p.resize.message is not None and "no longer knows resize r1" in p.resize.message


def test_someone_elses_resize_is_waited_for() -> None:
    rec = record(2, 3, "Standby", rid="theirs")
    p = plan(4, serving(2), observed(raycluster=ray(2), rt=runtime(2, rec)))
    assert p.scale is None and p.requeue
    assert p.phase.phase is Phase.RESIZING and p.phase.reason == "RuntimeBusy"


def test_first_provisioning_follows_the_spec_without_a_resize() -> None:
    p = plan(
        3,
        status_.MoEDeploymentStatus(phase=Phase.PROVISIONING),
        observed(raycluster=ray(2, 1), rt=None),
    )
    assert p.raycluster.worker_replicas == 3
    assert p.one(actions.SetResize).resize is None and p.scale is None


def test_a_runtime_first_seen_at_another_size_is_resized() -> None:
    p = plan(
        3,
        status_.MoEDeploymentStatus(phase=Phase.PROVISIONING),
        observed(raycluster=ray(3), rt=runtime(2)),
    )
    assert p.scale == 3 and p.resize.from_size == 2


# -- folding the runtime's answer ----------------------------------------------------------------
def test_an_accepted_scale_records_the_resize_id_and_the_provisioning_time() -> None:
    r = active(2, 4, Stage.PROVISIONING)
    got, events = scale_answer.after_scale(r, actions.ScaleAccepted("abc", "Standby"), now=LATER)
    assert (got.resize_id, got.stage) == ("abc", Stage.STANDBY)
    assert got.stage_durations == {"Provisioning": 30.0}
    assert [e.reason for e in events] == ["Standby"]


def test_a_deferred_scale_keeps_the_stage_and_asks_again_later() -> None:
    r = active(4, 2, Stage.RESHUFFLING)
    got, events = scale_answer.after_scale(r, actions.ScaleDeferred("busy"), now=LATER)
    assert (got.stage, got.resize_id, events) == (Stage.RESHUFFLING, None, [])


# -- status --------------------------------------------------------------------------------------
def test_resizing_condition_names_the_stage_and_ready_stays_true() -> None:
    r = active(2, 4, Stage.TRANSFERRING, rid="r1")
    obs = observed(raycluster=ray(4), rt=runtime(2, record(2, 4, "Transferring")))
    p = plan(4, serving(2, r), obs)
    new = plan_status.next_status(
        name="tiny", namespace="ml", generation=1, target=4, current=serving(2, r),
        observed=obs, phase=p.phase, now=T0_TEXT, resize_status=p.resize,
    )  # fmt: skip
    resizing, ready = new.condition("Resizing"), new.condition("Ready")
    assert resizing is not None and (resizing.status, resizing.reason) == ("True", "Transferring")
    assert ready is not None and ready.status == "True"
    assert new.phase is Phase.RESIZING and new.data_parallel_size == 2


def test_merge_patch_nulls_nested_keys_that_went_away() -> None:
    old = {"resize": {"resizeId": "old", "stage": "Completed", "fromSize": 2, "toSize": 4}}
    new = status_.MoEDeploymentStatus(
        resize=status_.ResizeStatus(from_size=4, to_size=2, stage=Stage.RESHUFFLING)
    )
    patch = plan_status.merge_patch(old, new)
    assert patch["resize"]["resizeId"] is None
    assert patch["resize"]["stage"] == "Reshuffling"


def test_observe_parses_runtime_records() -> None:
    got = observe.runtime(
        {
            "data_parallel_size": 4,
            "target_data_parallel_size": 2,
            "stage": "Releasing",
            "resize": {
                "resize_id": "r9", "from": 4, "to": 2, "stage": "Releasing", "message": "",
                "started_at": 1.0, "stage_started_at": 2.0,
                "stages": [{"stage": "Reshuffling", "started_at": 1.0, "duration_s": 0.5},
                           {"stage": "Releasing", "started_at": 2.0, "duration_s": None}],
                "freed": [{"pod": "p3", "rank": 3}, {"pod": None}],
            },
            "history": [],
            "ranks": [{"rank": 0, "pod": "p0", "active": True}, {"rank": 3, "pod": "p3", "active": False}],
        }
    )  # fmt: skip
    assert got is not None and got.running is not None
    assert got.running.stages == (("Reshuffling", 0.5), ("Releasing", None))
    assert got.running.freed_pods == ("p3",)
    assert got.active_pods == ("p0",)
    assert got.find("r9") is got.resize and got.find("nope") is None


def test_a_resize_not_yet_asked_for_waits_while_the_runtime_runs_another() -> None:
    rec = record(2, 3, "Standby", rid="theirs")
    p = plan(
        4,
        serving(2, active(2, 4, Stage.PROVISIONING)),
        observed(raycluster=ray(4), rt=runtime(2, rec)),
    )
    assert p.scale is None and p.requeue
    assert p.resize.resize_id is None and "theirs" in (p.resize.message or "")


@pytest.mark.parametrize(
    ("pods", "active_pods", "replicas", "delete"),
    [
        (PODS, PODS[:2], 2, PODS[2:]),
        (None, PODS[:2], 4, ()),
        (PODS, None, 4, ()),
        ((), PODS[:2], 2, ()),
    ],
    ids=["named", "pods-unknown", "ranks-unknown", "no-pods-yet"],
)
def test_a_shrink_after_a_failure_never_leaves_kuberay_to_pick_pods(
    pods: tuple[str, ...] | None,
    active_pods: tuple[str, ...] | None,
    replicas: int,
    delete: tuple[str, ...],
) -> None:
    failed = active(2, 4, Stage.FAILED, message="boom")
    rt = dataclasses.replace(runtime(2), active_pods=active_pods)
    obs = dataclasses.replace(observed(raycluster=ray(4), rt=rt), worker_pods=pods)
    p = plan(4, serving(2, failed), obs)
    assert p.raycluster == actions.ApplyRayCluster(
        worker_replicas=replicas, workers_to_delete=delete
    )
