"""Decisions shared by the resize driver (:mod:`plan.resize`) and the recovery follower
(:mod:`plan.recovery`): what a reconcile decided, the worker replicas to hold or settle at,
the ``workersToDelete`` names still pending, phases and stage events. Pure functions."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Final

from moe_contract import stages
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, clock, observe

Stage = stages.Stage

#: Seconds between two reconciles while a resize runs.
REQUEUE_SECONDS: Final = 1.0
#: Seconds between two looks at a runtime that stopped answering.
REQUEUE_UNREACHABLE_SECONDS: Final = 5.0
#: The first stage of a scale-down, shown from the moment the runtime is asked.
FIRST_DOWN_STAGE: Final = Stage.RESHUFFLING


def was_serving(status: status_.MoEDeploymentStatus) -> bool:
    return status.phase in (status_.Phase.SERVING, status_.Phase.DEGRADED)


def served(status: status_.MoEDeploymentStatus) -> bool:
    """The runtime has served at least once (a live resize, not a re-provisioning, follows)."""
    return (
        status.phase in (status_.Phase.SERVING, status_.Phase.RESIZING, status_.Phase.DEGRADED)
        or status.resize is not None
    )


def default_phase(
    *,
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
) -> actions.SetPhase:
    ray = observed.raycluster
    target = spec.data_parallel_size
    if ray is None and was_serving(status):
        return actions.SetPhase(
            status_.Phase.DEGRADED,
            status_.REASON_RANKS_MISSING,
            "the RayCluster disappeared; re-creating it",
        )
    if ray is None or (not ray.head_ready and not was_serving(status)):
        # The same words whether the RayCluster is being created now or exists without a
        # ready head: a restarted operator must compute the very same status.
        return actions.SetPhase(
            status_.Phase.PROVISIONING,
            status_.REASON_WAITING_FOR_RAY_CLUSTER,
            "waiting for the Ray head",
        )
    runtime = observed.runtime
    if runtime is not None and runtime.unhealthy:
        # A rank whose heartbeat is late: the runtime fences it and recovers if it stays so.
        late = ", ".join(f"{r.pod or 'a rank'} ({r.reason})" for r in runtime.unhealthy)
        return actions.SetPhase(
            status_.Phase.DEGRADED,
            status_.REASON_RANK_UNHEALTHY,
            f"rank unhealthy: {late}; the runtime recovers around it if it does not answer",
            ready=True,
        )
    if ray.head_ready and ray.ready_workers >= target:  # ray is not None from here on
        return actions.SetPhase(
            status_.Phase.SERVING,
            status_.REASON_ALL_RANKS_READY,
            f"{target} of {target} ranks ready",
        )
    if was_serving(status):
        return actions.SetPhase(
            status_.Phase.DEGRADED,
            status_.REASON_RANKS_MISSING,
            f"{ray.ready_workers} of {target} ranks ready"
            + ("" if ray.head_ready else "; head not ready"),
        )
    return actions.SetPhase(
        status_.Phase.PROVISIONING,
        status_.REASON_WAITING_FOR_WORKERS,
        f"{ray.ready_workers} of {target} ranks ready",
    )


@dataclasses.dataclass
class Decision:
    """What the resize driver decided (assembled into actions by :func:`plan_resize`)."""

    replicas: int
    workers_to_delete: tuple[str, ...] = ()
    resize: status_.ResizeStatus | None = None
    scale: int | None = None
    events: list[actions.Event] = dataclasses.field(default_factory=list)
    requeue: float | None = None
    phase: actions.SetPhase | None = None


def stage_of(value: str) -> Stage | None:
    """The resize stage the runtime names (``None``: ``Idle``, or one this operator does not
    know)."""
    try:
        stage = Stage(value)
    except ValueError:
        return None
    return stage if stage in stages.RESIZE_STAGES else None


def arrow(r: status_.ResizeStatus) -> str:
    return f"{r.from_size}->{r.to_size}"


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def stage_event(r: status_.ResizeStatus, stage: Stage, message: str = "") -> actions.Event:
    what = "recovery" if r.kind == status_.KIND_RECOVERY else "resize"
    text = f"{what} {arrow(r)}: {stage.value}"
    if message:
        text += f": {message}"
    return actions.Event(reason=stage.value, message=text)


def pending(observed: observe.Observed) -> tuple[str, ...]:
    """The ``workersToDelete`` names whose pod still exists (terminating ones included).

    KubeRay deletes the named pods but never clears the list (``reconcilePods`` empties only
    its loop copy; raycluster_controller.go): the operator owns it. A name stays in every
    apply while its pod exists, so a write of ours never drops it before KubeRay acted (it
    would then delete random pods); it goes once the pod is gone. When the pods could not be
    listed, every name stays.
    """
    ray = observed.raycluster
    if ray is None:
        return ()
    if observed.worker_pods is None:
        return ray.workers_to_delete
    existing = {*observed.worker_pods, *observed.leaving_pods}
    return tuple(name for name in ray.workers_to_delete if name in existing)


def merge(*groups: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted({name for group in groups for name in group}))


def excess_pods(observed: observe.Observed) -> tuple[str, ...]:
    """Worker pods neither a serving rank nor a warm spare runs on (empty when either side
    is unknown)."""
    runtime, pods = observed.runtime, observed.worker_pods
    if runtime is None or runtime.active_pods is None or pods is None:
        return ()
    used = {*runtime.active_pods, *runtime.spare_pods}
    return tuple(p for p in pods if p not in used)


def hold(observed: observe.Observed, default: int) -> int:
    """The worker replicas as they are, in ranks (the warm spares' pods not counted;
    ``default`` when there is no RayCluster)."""
    ray = observed.raycluster
    if ray is None:
        return default
    return max(ray.worker_replicas - observed.warm_spares, 0)


def settle(observed: observe.Observed, *, size: int) -> tuple[int, tuple[str, ...]]:
    """Worker replicas back to ``size`` serving ranks (and the warm spares' pods). A shrink
    names pods that neither serve nor hold a spare, so KubeRay deletes those and no random
    serving one; when not enough can be named (pods or the runtime's ranks unknown), the
    replicas stay as they are: idle pods are cheaper than a killed rank."""
    current = hold(observed, size)
    if current <= size:
        return size, pending(observed)
    pods = observed.worker_pods
    excess = excess_pods(observed)
    surplus = len(pods) - (size + observed.warm_spares) if pods is not None else 0
    if pods is None or surplus > len(excess):
        return current, pending(observed)
    return size, merge(pending(observed), excess[: max(surplus, 0)])


def elapsed(r: status_.ResizeStatus, now: datetime.datetime) -> float:
    started = clock.parse(r.started_at)
    return (now - started).total_seconds() if started is not None else 0.0


def resizing_phase(r: status_.ResizeStatus, *, ready: bool) -> actions.SetPhase:
    message = f"resizing {arrow(r)}: {r.stage.value}"
    if r.message:
        message += f" ({r.message})"
    return actions.SetPhase(
        status_.Phase.RESIZING, status_.REASON_RESIZE_IN_PROGRESS, message, ready=ready
    )


def failed_phase(r: status_.ResizeStatus, *, ready: bool) -> actions.SetPhase:
    return actions.SetPhase(
        status_.Phase.DEGRADED,
        status_.REASON_RESIZE_FAILED,
        f"resize {arrow(r)} failed: {r.message or 'no message'}",
        ready=ready,
    )


def fail(
    r: status_.ResizeStatus,
    message: str,
    *,
    observed: observe.Observed,
    ready: bool,
) -> Decision:
    """End ``r`` Failed; replicas go back to the serving size."""
    now = clock.rfc3339(observed.now)
    failed = r.model_copy(
        update={
            "stage": Stage.FAILED,
            "message": message,
            "stage_started_at": now,
            "finished_at": now,
        }
    )
    runtime = observed.runtime
    if runtime is not None and runtime.running is None:
        replicas, delete = settle(observed, size=runtime.data_parallel_size)
    else:  # the runtime is away or still busy: settle once it answers (the idle path does)
        replicas, delete = hold(observed, r.from_size), pending(observed)
    return Decision(
        replicas=replicas,
        workers_to_delete=delete,
        resize=failed,
        events=[actions.Event(Stage.FAILED.value, f"resize {arrow(r)} failed: {message}")],
        requeue=REQUEUE_SECONDS,
        phase=failed_phase(failed, ready=ready),
    )


def durations(r: status_.ResizeStatus, record: observe.RuntimeResize) -> dict[str, float] | None:
    out = dict(r.stage_durations or {})
    for stage, seconds in record.stages:
        if seconds is not None:
            out[stage] = round(seconds, 3)
    return out or None


def stages_entered(previous: Stage | None, record: observe.RuntimeResize) -> list[Stage]:
    """Stages of ``record`` entered after ``previous`` (all of them when it is not among
    them), then its terminal stage, in order."""
    names = [name for name, _ in record.stages]
    start = 0
    if previous is not None and previous.value in names:
        start = names.index(previous.value) + 1
    entered = [s for s in (stage_of(n) for n in names[start:]) if s is not None]
    final = stage_of(record.stage)
    if record.done and final is not None and final is not previous and final not in entered:
        entered.append(final)
    return [s for s in entered if s is not previous]
