"""The reconcile planner: from (spec, status, observed) to an ordered list of actions.

Purely computational, with no side effects (like kopf's ``detect_changing_cause``): the handler
executes the actions in order, then writes the status once. Because every input is read back
from the cluster and the runtime, a restarted operator plans the same next step: the resize is
driven from ``status.resize``, not from memory.

Live resize (DESIGN §3), one step per reconcile, while the deployment keeps serving:

- **Up N→M**: ``Provisioning`` (worker replicas → M; wait until KubeRay reports M ready
  workers), then ``POST /scale_elastic_ep`` once; its ``resize_id`` is stored in
  ``status.resize.resizeId`` and from then on the runtime's record (found by that id in
  ``/elastic_ep/status``) is mirrored until it is ``Completed``.
- **Down M→N**: the runtime first (replicas stay M); once its record is ``Completed``, the
  RayCluster gets replicas N and ``workersToDelete`` = exactly the pods the runtime freed
  (KubeRay deletes random pods otherwise).
- A step whose ``resizeId`` is recorded is never asked for again; a resize the runtime runs
  towards the same target without a recorded id (the answer was lost) is adopted.
- A new target during a resize is taken once the running one ends (or at once while the
  runtime has not been asked). A resize that the runtime refuses or fails, or that outlives
  ``spec.elastic.resizeTimeoutSeconds``, ends ``Failed``; it is retried only for a new
  ``metadata.generation``. After a failure the worker replicas go back to the serving size,
  naming the pods that do not serve.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Final, Union

from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import clock, observe

Stage = status_.Stage

#: Seconds between two reconciles while a resize runs.
REQUEUE_SECONDS: Final = 1.0
#: Seconds between two looks at a runtime that stopped answering.
REQUEUE_UNREACHABLE_SECONDS: Final = 5.0
#: The first stage of a scale-down, shown from the moment the runtime is asked.
FIRST_DOWN_STAGE: Final = Stage.RESHUFFLING


@dataclasses.dataclass(frozen=True)
class EnsureSecret:
    """Create the admin-token Secret when it is missing (an existing one is never rotated)."""


@dataclasses.dataclass(frozen=True)
class ApplyRayCluster:
    """Server-side apply the RayCluster with this many worker replicas.

    ``workers_to_delete``: pods KubeRay must delete (``scaleStrategy.workersToDelete``);
    ``head_size``: the head's runtime size (``None``: ``spec.dataParallelSize``).
    """

    worker_replicas: int
    workers_to_delete: tuple[str, ...] = ()
    head_size: int | None = None


@dataclasses.dataclass(frozen=True)
class ApplyService:
    """Server-side apply the Service in front of the runtime API."""


@dataclasses.dataclass(frozen=True)
class ScaleRuntime:
    """Ask the runtime for a live resize (``POST /scale_elastic_ep``, no wait); fold the answer
    into the resize status with :func:`after_scale`."""

    new_size: int


@dataclasses.dataclass(frozen=True)
class SetResize:
    """``status.resize`` after this reconcile (before a ``ScaleRuntime`` answer is folded in)."""

    resize: status_.ResizeStatus | None


@dataclasses.dataclass(frozen=True)
class Event:
    """A Kubernetes event on the MoEDeployment (reason = stage for stage transitions)."""

    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Requeue:
    """Reconcile again after this many seconds (a resize is being driven)."""

    seconds: float


@dataclasses.dataclass(frozen=True)
class SetPhase:
    """The phase (and Ready reason/message) the status write that ends the reconcile reports.

    ``ready``: whether the deployment serves (``None``: only when the phase is Serving); it
    stays True during a resize and after a failed one, which leave it serving.
    """

    phase: status_.Phase
    reason: str
    message: str
    ready: bool | None = None


Action = Union[
    EnsureSecret, ApplyRayCluster, ApplyService, ScaleRuntime, SetResize, Event, Requeue, SetPhase
]


# -- answers of POST /scale_elastic_ep, as the planner sees them ------------------------------
@dataclasses.dataclass(frozen=True)
class ScaleAccepted:
    resize_id: str
    stage: str | None = None


@dataclasses.dataclass(frozen=True)
class ScaleRefused:
    """400/422: the runtime will not take this size (its message says why)."""

    message: str


@dataclasses.dataclass(frozen=True)
class ScaleDeferred:
    """409 (another resize runs), unreachable, or a server error: ask again later."""

    message: str


ScaleOutcome = Union[ScaleAccepted, ScaleRefused, ScaleDeferred]


class Keep:
    """Marker: keep ``status.resize`` as it is."""


KEEP: Final = Keep()


def was_serving(status: status_.MoEDeploymentStatus) -> bool:
    return status.phase in (status_.Phase.SERVING, status_.Phase.DEGRADED)


def served(status: status_.MoEDeploymentStatus) -> bool:
    """The runtime has served at least once (a live resize, not a re-provisioning, follows)."""
    return (
        status.phase in (status_.Phase.SERVING, status_.Phase.RESIZING, status_.Phase.DEGRADED)
        or status.resize is not None
    )


def _phase(
    *,
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
) -> SetPhase:
    ray = observed.raycluster
    target = spec.data_parallel_size
    if ray is None and was_serving(status):
        return SetPhase(
            status_.Phase.DEGRADED,
            status_.REASON_RANKS_MISSING,
            "the RayCluster disappeared; re-creating it",
        )
    if ray is None or (not ray.head_ready and not was_serving(status)):
        # The same words whether the RayCluster is being created now or exists without a
        # ready head: a restarted operator must compute the very same status.
        return SetPhase(
            status_.Phase.PROVISIONING,
            status_.REASON_WAITING_FOR_RAY_CLUSTER,
            "waiting for the Ray head",
        )
    if ray.head_ready and ray.ready_workers >= target:  # ray is not None from here on
        return SetPhase(
            status_.Phase.SERVING,
            status_.REASON_ALL_RANKS_READY,
            f"{target} of {target} ranks ready",
        )
    if was_serving(status):
        return SetPhase(
            status_.Phase.DEGRADED,
            status_.REASON_RANKS_MISSING,
            f"{ray.ready_workers} of {target} ranks ready"
            + ("" if ray.head_ready else "; head not ready"),
        )
    return SetPhase(
        status_.Phase.PROVISIONING,
        status_.REASON_WAITING_FOR_WORKERS,
        f"{ray.ready_workers} of {target} ranks ready",
    )


@dataclasses.dataclass
class _Decision:
    """What the resize driver decided (assembled into actions by :func:`plan_resize`)."""

    replicas: int
    workers_to_delete: tuple[str, ...] = ()
    resize: status_.ResizeStatus | None = None
    scale: int | None = None
    events: list[Event] = dataclasses.field(default_factory=list)
    requeue: float | None = None
    phase: SetPhase | None = None


def _stage(value: str) -> Stage | None:
    try:
        return Stage(value)
    except ValueError:
        return None


def _arrow(r: status_.ResizeStatus) -> str:
    return f"{r.from_size}->{r.to_size}"


def _stage_event(r: status_.ResizeStatus, stage: Stage, message: str = "") -> Event:
    text = f"resize {_arrow(r)}: {stage.value}"
    if message:
        text += f": {message}"
    return Event(reason=stage.value, message=text)


def _pending(observed: observe.Observed) -> tuple[str, ...]:
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


def _merge(*groups: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted({name for group in groups for name in group}))


def _excess_pods(observed: observe.Observed) -> tuple[str, ...]:
    """Worker pods no serving rank runs on (empty when either side is unknown)."""
    runtime, pods = observed.runtime, observed.worker_pods
    if runtime is None or runtime.active_pods is None or pods is None:
        return ()
    serving = set(runtime.active_pods)
    return tuple(p for p in pods if p not in serving)


def _hold(observed: observe.Observed, default: int) -> int:
    """The worker replicas as they are (``default`` when there is no RayCluster)."""
    ray = observed.raycluster
    return ray.worker_replicas if ray is not None else default


def _settle(observed: observe.Observed, *, size: int) -> tuple[int, tuple[str, ...]]:
    """Worker replicas back to ``size`` serving ranks. A shrink names the pods that do not
    serve, so KubeRay deletes those and no random serving one; when they cannot all be named
    (pods or the runtime's ranks unknown), the replicas stay as they are: idle pods are
    cheaper than a killed rank."""
    current = _hold(observed, size)
    if current <= size:
        return size, _pending(observed)
    pods = observed.worker_pods
    excess = _excess_pods(observed)
    if pods is None or len(pods) - len(excess) > size:
        return current, _pending(observed)
    return size, _merge(_pending(observed), excess)


def _elapsed(r: status_.ResizeStatus, now: datetime.datetime) -> float:
    started = clock.parse(r.started_at)
    return (now - started).total_seconds() if started is not None else 0.0


def _resizing_phase(r: status_.ResizeStatus, *, ready: bool) -> SetPhase:
    message = f"resizing {_arrow(r)}: {r.stage.value}"
    if r.message:
        message += f" ({r.message})"
    return SetPhase(status_.Phase.RESIZING, status_.REASON_RESIZE_IN_PROGRESS, message, ready=ready)


def _failed_phase(r: status_.ResizeStatus, *, ready: bool) -> SetPhase:
    return SetPhase(
        status_.Phase.DEGRADED,
        status_.REASON_RESIZE_FAILED,
        f"resize {_arrow(r)} failed: {r.message or 'no message'}",
        ready=ready,
    )


def _fail(
    r: status_.ResizeStatus,
    message: str,
    *,
    observed: observe.Observed,
    ready: bool,
) -> _Decision:
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
        replicas, delete = _settle(observed, size=runtime.data_parallel_size)
    else:  # the runtime is away or still busy: settle once it answers (the idle path does)
        replicas, delete = _hold(observed, r.from_size), _pending(observed)
    return _Decision(
        replicas=replicas,
        workers_to_delete=delete,
        resize=failed,
        events=[Event(Stage.FAILED.value, f"resize {_arrow(r)} failed: {message}")],
        requeue=REQUEUE_SECONDS,
        phase=_failed_phase(failed, ready=ready),
    )


def _durations(r: status_.ResizeStatus, record: observe.RuntimeResize) -> dict[str, float] | None:
    out = dict(r.stage_durations or {})
    for stage, seconds in record.stages:
        if seconds is not None:
            out[stage] = round(seconds, 3)
    return out or None


def _stages_entered(previous: Stage | None, record: observe.RuntimeResize) -> list[Stage]:
    """Stages of ``record`` entered after ``previous`` (all of them when it is not among
    them), then its terminal stage, in order."""
    names = [name for name, _ in record.stages]
    start = 0
    if previous is not None and previous.value in names:
        start = names.index(previous.value) + 1
    entered = [s for s in (_stage(n) for n in names[start:]) if s is not None]
    final = _stage(record.stage)
    if record.done and final is not None and final is not previous and final not in entered:
        entered.append(final)
    return [s for s in entered if s is not previous]


def _follow(
    r: status_.ResizeStatus,
    *,
    previous: Stage | None,
    spec: spec_.MoEDeploymentSpec,
    observed: observe.Observed,
    timed_out: bool,
) -> _Decision:
    """The runtime was asked (``r.resize_id`` is set): mirror its record."""
    assert r.resize_id is not None
    runtime = observed.runtime
    up = r.to_size > r.from_size
    timeout = spec.elastic.resize_timeout_seconds
    if runtime is None:
        if timed_out:
            return _fail(
                r,
                f"timed out after {timeout}s in stage {r.stage.value} (the runtime does not "
                "answer)",
                observed=observed,
                ready=True,
            )
        held = r.to_size if up else max(_hold(observed, r.from_size), r.from_size)
        return _Decision(
            replicas=held,
            workers_to_delete=_pending(observed),
            resize=r,
            requeue=REQUEUE_SECONDS,
            phase=_resizing_phase(r, ready=True),
        )
    record = runtime.find(r.resize_id)
    if record is None:
        return _fail(
            r,
            f"the runtime no longer knows resize {r.resize_id} (did it restart?); it serves "
            f"{runtime.data_parallel_size} ranks",
            observed=observed,
            ready=True,
        )
    stage = _stage(record.stage) or r.stage
    mirrored = r.model_copy(
        update={
            "stage": stage,
            "message": record.message or None,
            "stage_durations": _durations(r, record),
            "stage_started_at": (
                clock.rfc3339(clock.from_epoch(record.stage_started_at))
                if record.stage_started_at is not None
                else r.stage_started_at
            ),
        }
    )
    events = [
        _stage_event(mirrored, s, record.message if s in (Stage.COMPLETED, Stage.FAILED) else "")
        for s in _stages_entered(previous, record)
    ]
    if stage is Stage.FAILED or record.stage == "Idle":
        decision = _fail(
            r,
            record.message or f"the runtime reports resize {r.resize_id} {record.stage}",
            observed=observed,
            ready=True,
        )
        decision.events = [e for e in events if e.reason != Stage.FAILED.value] + decision.events
        if decision.resize is not None:
            decision.resize = decision.resize.model_copy(
                update={"stage_durations": mirrored.stage_durations}
            )
        return decision
    if stage is Stage.COMPLETED:
        done = mirrored.model_copy(
            update={
                "finished_at": clock.rfc3339(observed.now),
                "freed_pods": list(record.freed_pods) or None,
            }
        )
        target = spec.data_parallel_size
        return _Decision(
            replicas=r.to_size,
            # A scale-down names exactly the pods the runtime freed.
            workers_to_delete=_merge(_pending(observed), () if up else record.freed_pods),
            resize=done,
            events=events,
            requeue=REQUEUE_SECONDS if target != r.to_size else None,
            phase=(
                SetPhase(
                    status_.Phase.SERVING,
                    status_.REASON_RESIZE_COMPLETED,
                    f"serving {r.to_size} ranks (resize {_arrow(r)} completed)",
                    ready=True,
                )
                if target == r.to_size
                else _resizing_phase(done, ready=True)
            ),
        )
    if timed_out:
        decision = _fail(
            mirrored,
            f"timed out after {timeout}s in stage {stage.value}",
            observed=observed,
            ready=True,
        )
        decision.events = events + decision.events
        return decision
    held = r.to_size if up else max(_hold(observed, r.from_size), r.from_size)
    return _Decision(
        replicas=held,
        workers_to_delete=_pending(observed),
        resize=mirrored,
        events=events,
        requeue=REQUEUE_SECONDS,
        phase=_resizing_phase(mirrored, ready=True),
    )


def _adopt(r: status_.ResizeStatus, runtime: observe.RuntimeObservation) -> str | None:
    """The id of a resize the runtime runs (or just finished) towards ``r.to_size`` that status
    does not record: our own request, whose answer was lost."""
    running = runtime.running
    if running is not None:
        return running.resize_id if running.to_size == r.to_size else None
    last = runtime.resize
    started = clock.parse(r.started_at)
    if (
        last is not None
        and last.stage == Stage.COMPLETED.value
        and last.to_size == r.to_size
        and last.from_size == r.from_size
        and runtime.data_parallel_size == r.to_size
        and started is not None
        and last.started_at is not None
        and last.started_at >= started.timestamp() - 1.0
    ):
        return last.resize_id
    return None


def _drive(
    r: status_.ResizeStatus,
    *,
    previous: Stage | None,
    spec: spec_.MoEDeploymentSpec,
    observed: observe.Observed,
) -> _Decision:
    """One step of the active resize ``r`` (``previous``: its stage as stored; ``None`` for a
    resize that starts now)."""
    timeout = spec.elastic.resize_timeout_seconds
    timed_out = _elapsed(r, observed.now) > timeout
    runtime = observed.runtime
    if r.resize_id is not None:
        return _follow(r, previous=previous, spec=spec, observed=observed, timed_out=timed_out)
    if runtime is not None:
        adopted = _adopt(r, runtime)
        if adopted is not None:
            r = r.model_copy(update={"resize_id": adopted})
            return _follow(r, previous=previous, spec=spec, observed=observed, timed_out=timed_out)
        running = runtime.running
        if running is not None and not timed_out:
            # Another resize runs in the runtime (asking now would only get a 409): wait.
            waiting = r.model_copy(
                update={
                    "message": f"waiting for the runtime's resize {running.resize_id} "
                    f"{running.from_size}->{running.to_size} to end"
                }
            )
            return _Decision(
                replicas=max(_hold(observed, r.from_size), r.from_size),
                workers_to_delete=_pending(observed),
                resize=waiting,
                events=[_stage_event(waiting, waiting.stage)] if previous is None else [],
                requeue=REQUEUE_SECONDS,
                phase=_resizing_phase(waiting, ready=True),
            )
    if timed_out:
        ray = observed.raycluster
        detail = (
            f"{ray.ready_workers if ray else 0} of {r.to_size} workers ready"
            if r.stage is Stage.PROVISIONING
            else "the runtime was never asked"
        )
        return _fail(
            r,
            f"timed out after {timeout}s in stage {r.stage.value}: {detail}",
            observed=observed,
            ready=runtime is not None,
        )
    now = clock.rfc3339(observed.now)
    events: list[Event] = []
    target = spec.data_parallel_size
    if target != r.to_size:
        # A new target before the runtime was asked: aim there instead.
        base = runtime.data_parallel_size if runtime is not None else r.from_size
        if target == base:
            done = r.model_copy(
                update={
                    "stage": Stage.COMPLETED,
                    "message": f"target back to {target} before the runtime was asked; "
                    "nothing resized",
                    "stage_started_at": now,
                    "finished_at": now,
                    "generation": observed.generation,
                }
            )
            replicas, delete = (
                _settle(observed, size=base)
                if runtime is not None
                else (_hold(observed, base), _pending(observed))
            )
            return _Decision(
                replicas=replicas,
                workers_to_delete=delete,
                resize=done,
                events=[_stage_event(done, Stage.COMPLETED, done.message or "")],
                phase=None,
            )
        stage = Stage.PROVISIONING if target > base else FIRST_DOWN_STAGE
        r = r.model_copy(
            update={
                "from_size": base,
                "to_size": target,
                "generation": observed.generation,
                "stage": stage,
                "stage_started_at": now if stage is not r.stage else r.stage_started_at,
            }
        )
        events.append(_stage_event(r, stage, "new target"))
    elif previous is None:
        events.append(_stage_event(r, r.stage))
    decision = _Decision(
        replicas=r.to_size, resize=r, events=events, requeue=REQUEUE_SECONDS, phase=None
    )
    ray = observed.raycluster
    if r.to_size > r.from_size:
        decision.replicas = r.to_size
        decision.workers_to_delete = _pending(observed)
        ready = ray.ready_workers if ray is not None else 0
        message = f"{min(ready, r.to_size)} of {r.to_size} workers ready"
        if observed.leaving_pods:
            # KubeRay creates no worker while a pod it deleted still terminates.
            message += f"; {len(observed.leaving_pods)} leaving"
        if ray is not None and ready >= r.to_size and not _pending(observed):
            if runtime is not None:
                decision.scale = r.to_size
            else:
                message += "; waiting for the runtime to answer"
        r = r.model_copy(update={"message": message})
    else:
        decision.replicas = max(_hold(observed, r.from_size), r.from_size)
        decision.workers_to_delete = _pending(observed)
        if runtime is not None:
            decision.scale = r.to_size
            r = r.model_copy(update={"message": None})
        else:
            r = r.model_copy(update={"message": "waiting for the runtime to answer"})
    decision.resize = r
    decision.phase = _resizing_phase(r, ready=runtime is not None)
    return decision


def _idle(
    *,
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
) -> _Decision:
    """No resize is active: start one when the runtime serves another size than the spec."""
    last = status.resize
    target = spec.data_parallel_size
    runtime = observed.runtime
    if runtime is None:
        if not served(status):  # first provisioning: the worker group simply follows the spec
            return _Decision(replicas=target, workers_to_delete=_pending(observed), resize=last)
        return _Decision(
            replicas=_hold(observed, status.data_parallel_size or target),
            workers_to_delete=_pending(observed),
            resize=last,
            requeue=REQUEUE_UNREACHABLE_SECONDS if observed.raycluster else None,
        )
    live = runtime.data_parallel_size
    failed_here = (
        last is not None and last.stage is Stage.FAILED and last.generation == observed.generation
    )
    running = runtime.running
    if running is not None:
        if running.to_size == target and not failed_here:
            adopted = status_.ResizeStatus(
                from_size=running.from_size,
                to_size=running.to_size,
                stage=_stage(running.stage) or Stage.PROVISIONING,
                started_at=clock.rfc3339(observed.now),
                stage_started_at=clock.rfc3339(observed.now),
                resize_id=running.resize_id,
                generation=observed.generation,
            )
            return _drive(adopted, previous=None, spec=spec, observed=observed)
        # Someone else's resize (or one we gave up on): let it end first.
        return _Decision(
            replicas=max(_hold(observed, live), running.to_size),
            workers_to_delete=_pending(observed),
            resize=last,
            requeue=REQUEUE_SECONDS,
            phase=SetPhase(
                status_.Phase.RESIZING,
                status_.REASON_RUNTIME_BUSY,
                f"the runtime runs resize {running.resize_id} {running.from_size}->"
                f"{running.to_size} ({running.stage}); waiting for it to end",
                ready=True,
            ),
        )
    if live == target or failed_here:
        replicas, delete = _settle(observed, size=live)
        phase = None
        if live != target and last is not None:
            phase = _failed_phase(last, ready=True)
        return _Decision(replicas=replicas, workers_to_delete=delete, resize=last, phase=phase)
    now = clock.rfc3339(observed.now)
    fresh = status_.ResizeStatus(
        from_size=live,
        to_size=target,
        stage=Stage.PROVISIONING if target > live else FIRST_DOWN_STAGE,
        started_at=now,
        stage_started_at=now,
        generation=observed.generation,
    )
    return _drive(fresh, previous=None, spec=spec, observed=observed)


def plan_resize(
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
) -> list[Action]:
    """The actions of one reconcile, in order; the last one is always a ``SetPhase``."""
    actions: list[Action] = []
    if not observed.secret_exists:
        actions.append(EnsureSecret())
    r = status.resize
    if r is not None and r.active:
        decision = _drive(r, previous=r.stage, spec=spec, observed=observed)
    else:
        decision = _idle(spec=spec, status=status, observed=observed)
    ray = observed.raycluster
    actions.append(
        ApplyRayCluster(
            worker_replicas=decision.replicas,
            workers_to_delete=decision.workers_to_delete,
            head_size=ray.head_size if ray is not None else None,
        )
    )
    actions.append(ApplyService())
    if decision.scale is not None:
        actions.append(ScaleRuntime(new_size=decision.scale))
    actions.append(SetResize(decision.resize))
    actions.extend(decision.events)
    if decision.requeue is not None:
        actions.append(Requeue(decision.requeue))
    actions.append(decision.phase or _phase(spec=spec, status=status, observed=observed))
    return actions


def after_scale(
    resize: status_.ResizeStatus,
    outcome: ScaleOutcome,
    *,
    now: datetime.datetime,
) -> tuple[status_.ResizeStatus, list[Event]]:
    """Fold the runtime's answer to ``POST /scale_elastic_ep`` into the resize status."""
    stamp = clock.rfc3339(now)
    if isinstance(outcome, ScaleAccepted):
        update: dict[str, object] = {"resize_id": outcome.resize_id, "message": None}
        events: list[Event] = []
        stage = _stage(outcome.stage or "")
        if resize.stage is Stage.PROVISIONING:
            began = clock.parse(resize.stage_started_at)
            if began is not None:
                durations = dict(resize.stage_durations or {})
                durations[Stage.PROVISIONING.value] = float(round((now - began).total_seconds()))
                update["stage_durations"] = durations
        if (
            stage is not None
            and stage not in (Stage.COMPLETED, Stage.FAILED)
            and stage is not resize.stage
        ):
            update["stage"] = stage
            update["stage_started_at"] = stamp
            events.append(_stage_event(resize, stage))
        return resize.model_copy(update=update), events
    if isinstance(outcome, ScaleRefused):
        message = f"the runtime refused {_arrow(resize)}: {outcome.message}"
        failed = resize.model_copy(
            update={
                "stage": Stage.FAILED,
                "message": message,
                "stage_started_at": stamp,
                "finished_at": stamp,
            }
        )
        return failed, [Event(Stage.FAILED.value, f"resize {_arrow(resize)} failed: {message}")]
    return resize.model_copy(update={"message": f"will ask again: {outcome.message}"}), []


def phase_after_scale(resize: status_.ResizeStatus, phase: SetPhase) -> SetPhase:
    """The phase once a ``ScaleRuntime`` answer was folded in (a refusal degrades it)."""
    if resize.stage is Stage.FAILED:
        return _failed_phase(resize, ready=True)
    if resize.active:
        return _resizing_phase(resize, ready=True)
    return phase
