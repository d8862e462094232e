"""Recoveries, as the operator sees them: the runtime lost a rank (dead or hung) and shrank
around it by itself (stage ``Recovering``, docs/RESIZE.md). Pure functions.

The operator mirrors the runtime's recovery record in ``status.resize`` (kind ``recovery``)
with a ``RankLost`` warning, and never touches the worker group for it: KubeRay replaces a
deleted pod by itself, and a pod that survived its rank keeps its slot for the grow back.
Once the recovery has ended, ``spec.faultTolerance.autoRecover`` decides (the operator owns
that policy; the runtime runs with ``--no-auto-recover``): on, the normal grow back to the
spec's size follows (:mod:`plan.resize`, Provisioning waits for the replacement pod); off,
the deployment stays ``Degraded`` at the smaller size until the user acts.
"""

from __future__ import annotations

from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, clock, decide, observe

Stage = status_.Stage


def unseen(
    status: status_.MoEDeploymentStatus, runtime: observe.RuntimeObservation
) -> observe.RuntimeResize | None:
    """The runtime's running or last record when it is a recovery ``status`` does not hold
    yet (it may have ended between two reconciles: they take seconds)."""
    record = runtime.running or runtime.resize
    if record is None or not record.is_recovery:
        return None
    known = status.resize.resize_id if status.resize is not None else None
    return record if record.resize_id != known else None


def adopt(record: observe.RuntimeResize, *, observed: observe.Observed) -> status_.ResizeStatus:
    """``status.resize`` for a recovery the runtime started by itself."""
    started = clock.from_epoch(record.started_at) if record.started_at else observed.now
    return status_.ResizeStatus(
        from_size=record.from_size,
        to_size=record.to_size,
        stage=Stage.RECOVERING,
        started_at=clock.rfc3339(started),
        stage_started_at=clock.rfc3339(started),
        resize_id=record.resize_id,
        generation=observed.generation,
        kind=status_.KIND_RECOVERY,
    )


def lost_text(lost: tuple[observe.LostRank, ...]) -> str:
    if not lost:
        return "a rank"
    return ", ".join(f"{r.pod or 'a rank'} ({r.reason})" for r in lost)


def follow(
    r: status_.ResizeStatus,
    *,
    previous: Stage | None,
    spec: spec_.MoEDeploymentSpec,
    observed: observe.Observed,
) -> decide.Decision:
    """One look at the recovery ``r`` (kind ``recovery``, ``resize_id`` set): mirror its stages;
    the worker group is held as it is."""
    assert r.resize_id is not None
    runtime = observed.runtime
    held = max(decide.hold(observed, spec.data_parallel_size), spec.data_parallel_size)
    pending = decide.pending(observed)
    record = runtime.find(r.resize_id) if runtime is not None else None
    if record is None:
        # The runtime is away or restarted: nothing to mirror; the idle path takes over.
        done = r.model_copy(
            update={
                "stage": Stage.COMPLETED if runtime is not None else r.stage,
                "finished_at": clock.rfc3339(observed.now) if runtime is not None else None,
            }
        )
        return decide.Decision(
            replicas=held, workers_to_delete=pending, resize=done, requeue=decide.REQUEUE_SECONDS
        )
    stage = decide.stage_of(record.stage) or r.stage
    who = lost_text(record.lost)
    message = record.message or None
    if stage is Stage.COMPLETED:
        figures = (f" in {record.recovery_s:.1f}s" if record.recovery_s is not None else "") + (
            f", {record.requests_rerun} requests re-run" if record.requests_rerun else ""
        )
        message = f"lost {who}; serving {decide.ranks(record.to_size)} again{figures}"
    mirrored = r.model_copy(
        update={
            "stage": stage,
            "message": message,
            "stage_durations": decide.durations(r, record),
            "finished_at": clock.rfc3339(observed.now) if record.done else None,
        }
    )
    events = []
    if previous is None:
        events.append(
            actions.Event(
                status_.REASON_RANK_LOST,
                f"lost {who}: the runtime shrinks {record.from_size}->{record.to_size} around "
                "it by itself; requests on it re-run on the survivors",
            )
        )
    events += [
        decide.stage_event(mirrored, s, message or "" if s is Stage.COMPLETED else "")
        for s in decide.stages_entered(previous, record)
    ]
    phase = degraded_phase(
        live=record.to_size if record.done else record.from_size,
        spec=spec,
        lost=record.lost,
        recovering=not record.done,
    )
    return decide.Decision(
        replicas=held,
        workers_to_delete=pending,
        resize=mirrored,
        events=events,
        requeue=decide.REQUEUE_SECONDS,
        phase=phase,
    )


def degraded_phase(
    *,
    live: int,
    spec: spec_.MoEDeploymentSpec,
    lost: tuple[observe.LostRank, ...],
    recovering: bool = False,
) -> actions.SetPhase:
    """Serving on fewer ranks than asked after losing some: what comes next."""
    target = spec.data_parallel_size
    who = lost_text(lost)
    if recovering:
        text = f"lost {who}: recovering on the survivors (requests queue, none fails)"
        reason = status_.REASON_RECOVERING
    elif spec.fault_tolerance.auto_recover:
        text = (
            f"serving {live} of {decide.ranks(target)} after losing {who}; growing back to {target} "
            "once a replacement worker is ready (faultTolerance.autoRecover)"
        )
        reason = status_.REASON_RANK_LOST
    else:
        text = (
            f"serving {live} of {decide.ranks(target)} after losing {who}; faultTolerance.autoRecover is "
            f"off: set it to true to grow back, or dataParallelSize to {live} to accept the size"
        )
        reason = status_.REASON_RANK_LOST
    return actions.SetPhase(status_.Phase.DEGRADED, reason, text, ready=True)


def hold_after_loss(
    *,
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
) -> decide.Decision | None:
    """With ``autoRecover`` off, a deployment that lost ranks stays at its smaller size (the
    worker group untouched) until the user acts; ``None`` when that does not apply."""
    runtime = observed.runtime
    if (
        runtime is None
        or spec.fault_tolerance.auto_recover
        or not runtime.lost
        or runtime.data_parallel_size >= spec.data_parallel_size
    ):
        return None
    return decide.Decision(
        replicas=decide.hold(observed, spec.data_parallel_size),
        workers_to_delete=decide.pending(observed),
        resize=status.resize,
        phase=degraded_phase(live=runtime.data_parallel_size, spec=spec, lost=runtime.lost),
    )
