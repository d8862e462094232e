"""The reconcile planner: from (spec, status, observed) to an ordered list of actions.

Purely computational, with no side effects (like kopf's ``detect_changing_cause``):
``moe_operator.execution`` executes the actions one after the other in the order given, then
``moe_operator.reconcile`` writes the status once. Because every input is read back
from the cluster and the runtime, a restarted operator plans the same next step: the resize is
driven from ``status.resize``, not from memory.

Live resize (docs/RESIZE.md), one step per reconcile, while the deployment keeps serving:

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

from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, clock, decide, observe, recovery


def _follow(
    r: status_.ResizeStatus,
    *,
    previous: decide.Stage | None,
    spec: spec_.MoEDeploymentSpec,
    observed: observe.Observed,
    timed_out: bool,
) -> decide.Decision:
    """The runtime was asked (``r.resize_id`` is set): mirror its record."""
    assert r.resize_id is not None
    if r.kind == status_.KIND_RECOVERY:
        return recovery.follow(r, previous=previous, spec=spec, observed=observed)
    runtime = observed.runtime
    up = r.to_size > r.from_size
    timeout = spec.elastic.resize_timeout_seconds
    if runtime is None:
        if timed_out:
            return decide.fail(
                r,
                f"timed out after {timeout}s in stage {r.stage.value} (the runtime does not "
                "answer)",
                observed=observed,
                ready=True,
            )
        held = r.to_size if up else max(decide.hold(observed, r.from_size), r.from_size)
        return decide.Decision(
            replicas=held,
            workers_to_delete=decide.pending(observed),
            resize=r,
            requeue=decide.REQUEUE_SECONDS,
            phase=decide.resizing_phase(r, ready=True),
        )
    record = runtime.find(r.resize_id)
    if record is None:
        # The runtime restarted under the resize (its head container, and Ray's GCS with it):
        # this one is gone, and a new one is asked for at once (retry), not only for a new spec.
        decision = decide.fail(
            r,
            f"the runtime restarted and no longer knows resize {r.resize_id}; it serves "
            f"{runtime.data_parallel_size} ranks: resizing again to {spec.data_parallel_size}",
            observed=observed,
            ready=True,
        )
        if decision.resize is not None:
            decision.resize = decision.resize.model_copy(update={"retry": True})
        return decision
    stage = decide.stage_of(record.stage) or r.stage
    mirrored = r.model_copy(
        update={
            "stage": stage,
            "message": record.message or None,
            "stage_durations": decide.durations(r, record),
            "stage_started_at": (
                clock.rfc3339(clock.from_epoch(record.stage_started_at))
                if record.stage_started_at is not None
                else r.stage_started_at
            ),
        }
    )
    events = [
        decide.stage_event(
            mirrored,
            s,
            record.message if s in (decide.Stage.COMPLETED, decide.Stage.FAILED) else "",
        )
        for s in decide.stages_entered(previous, record)
    ]
    if stage is decide.Stage.FAILED or record.stage == "Idle":
        decision = decide.fail(
            r,
            record.message or f"the runtime reports resize {r.resize_id} {record.stage}",
            observed=observed,
            ready=True,
        )
        decision.events = [
            e for e in events if e.reason != decide.Stage.FAILED.value
        ] + decision.events
        if decision.resize is not None:
            decision.resize = decision.resize.model_copy(
                update={"stage_durations": mirrored.stage_durations}
            )
        return decision
    if stage is decide.Stage.COMPLETED:
        done = mirrored.model_copy(
            update={
                "finished_at": clock.rfc3339(observed.now),
                "freed_pods": list(record.freed_pods) or None,
            }
        )
        target = spec.data_parallel_size
        return decide.Decision(
            replicas=r.to_size,
            # A scale-down names exactly the pods the runtime freed.
            workers_to_delete=decide.merge(
                decide.pending(observed), () if up else record.freed_pods
            ),
            resize=done,
            events=events,
            requeue=decide.REQUEUE_SECONDS if target != r.to_size else None,
            phase=(
                actions.SetPhase(
                    status_.Phase.SERVING,
                    status_.REASON_RESIZE_COMPLETED,
                    f"serving {r.to_size} ranks (resize {decide.arrow(r)} completed)",
                    ready=True,
                )
                if target == r.to_size
                else decide.resizing_phase(done, ready=True)
            ),
        )
    if timed_out:
        decision = decide.fail(
            mirrored,
            f"timed out after {timeout}s in stage {stage.value}",
            observed=observed,
            ready=True,
        )
        decision.events = events + decision.events
        return decision
    held = r.to_size if up else max(decide.hold(observed, r.from_size), r.from_size)
    return decide.Decision(
        replicas=held,
        workers_to_delete=decide.pending(observed),
        resize=mirrored,
        events=events,
        requeue=decide.REQUEUE_SECONDS,
        phase=decide.resizing_phase(mirrored, ready=True),
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
        and last.stage == decide.Stage.COMPLETED.value
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
    previous: decide.Stage | None,
    spec: spec_.MoEDeploymentSpec,
    observed: observe.Observed,
) -> decide.Decision:
    """One step of the active resize ``r`` (``previous``: its stage as stored; ``None`` for a
    resize that starts now)."""
    timeout = spec.elastic.resize_timeout_seconds
    timed_out = decide.elapsed(r, observed.now) > timeout
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
            return decide.Decision(
                replicas=max(decide.hold(observed, r.from_size), r.from_size),
                workers_to_delete=decide.pending(observed),
                resize=waiting,
                events=[decide.stage_event(waiting, waiting.stage)] if previous is None else [],
                requeue=decide.REQUEUE_SECONDS,
                phase=decide.resizing_phase(waiting, ready=True),
            )
    if timed_out:
        ray = observed.raycluster
        detail = (
            f"{ray.ready_workers if ray else 0} of {r.to_size} workers ready"
            if r.stage is decide.Stage.PROVISIONING
            else "the runtime was never asked"
        )
        return decide.fail(
            r,
            f"timed out after {timeout}s in stage {r.stage.value}: {detail}",
            observed=observed,
            ready=runtime is not None,
        )
    now = clock.rfc3339(observed.now)
    events: list[actions.Event] = []
    target = spec.data_parallel_size
    if target != r.to_size:
        # A new target before the runtime was asked: aim there instead.
        base = runtime.data_parallel_size if runtime is not None else r.from_size
        if target == base:
            done = r.model_copy(
                update={
                    "stage": decide.Stage.COMPLETED,
                    "message": f"target back to {target} before the runtime was asked; "
                    "nothing resized",
                    "stage_started_at": now,
                    "finished_at": now,
                    "generation": observed.generation,
                }
            )
            replicas, delete = (
                decide.settle(observed, size=base)
                if runtime is not None
                else (decide.hold(observed, base), decide.pending(observed))
            )
            return decide.Decision(
                replicas=replicas,
                workers_to_delete=delete,
                resize=done,
                events=[decide.stage_event(done, decide.Stage.COMPLETED, done.message or "")],
                phase=None,
            )
        stage = decide.Stage.PROVISIONING if target > base else decide.FIRST_DOWN_STAGE
        r = r.model_copy(
            update={
                "from_size": base,
                "to_size": target,
                "generation": observed.generation,
                "stage": stage,
                "stage_started_at": now if stage is not r.stage else r.stage_started_at,
            }
        )
        events.append(decide.stage_event(r, stage, "new target"))
    elif previous is None:
        events.append(decide.stage_event(r, r.stage))
    decision = decide.Decision(
        replicas=r.to_size, resize=r, events=events, requeue=decide.REQUEUE_SECONDS, phase=None
    )
    ray = observed.raycluster
    if r.to_size > r.from_size:
        decision.replicas = r.to_size
        decision.workers_to_delete = decide.pending(observed)
        ready = ray.ready_workers if ray is not None else 0
        message = f"{min(ready, r.to_size)} of {r.to_size} workers ready"
        if observed.leaving_pods:
            # KubeRay creates no worker while a pod it deleted still terminates.
            message += f"; {len(observed.leaving_pods)} leaving"
        if ray is not None and ready >= r.to_size and not decide.pending(observed):
            if runtime is not None:
                decision.scale = r.to_size
                if previous is None:
                    # The workers were there already (warm spares' pods, or idle ones):
                    # nothing was provisioned, so no Provisioning stage is reported.
                    events = [e for e in events if e.reason != decide.Stage.PROVISIONING.value]
                    decision.events = events
            else:
                message += "; waiting for the runtime to answer"
        r = r.model_copy(update={"message": message})
    else:
        decision.replicas = max(decide.hold(observed, r.from_size), r.from_size)
        decision.workers_to_delete = decide.pending(observed)
        if runtime is not None:
            decision.scale = r.to_size
            r = r.model_copy(update={"message": None})
        else:
            r = r.model_copy(update={"message": "waiting for the runtime to answer"})
    decision.resize = r
    decision.phase = decide.resizing_phase(r, ready=runtime is not None)
    return decision


def _idle(
    *,
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
) -> decide.Decision:
    """No resize is active: start one when the runtime serves another size than the spec."""
    last = status.resize
    target = spec.data_parallel_size
    runtime = observed.runtime
    if runtime is None:
        if not decide.served(
            status
        ):  # first provisioning: the worker group simply follows the spec
            return decide.Decision(
                replicas=target, workers_to_delete=decide.pending(observed), resize=last
            )
        return decide.Decision(
            replicas=decide.hold(observed, status.data_parallel_size or target),
            workers_to_delete=decide.pending(observed),
            resize=last,
            requeue=decide.REQUEUE_UNREACHABLE_SECONDS if observed.raycluster else None,
        )
    live = runtime.data_parallel_size
    failed_here = (
        last is not None
        and last.stage is decide.Stage.FAILED
        and last.generation == observed.generation
        and not last.retry
    )
    lost = recovery.unseen(status, runtime)
    if lost is not None:  # the runtime shrank around lost ranks by itself: mirror it
        return recovery.follow(
            recovery.adopt(lost, observed=observed), previous=None, spec=spec, observed=observed
        )
    held = recovery.hold_after_loss(spec=spec, status=status, observed=observed)
    if held is not None:
        return held
    running = runtime.running
    if running is not None:
        if running.to_size == target and not failed_here:
            adopted = status_.ResizeStatus(
                from_size=running.from_size,
                to_size=running.to_size,
                stage=decide.stage_of(running.stage) or decide.Stage.PROVISIONING,
                started_at=clock.rfc3339(observed.now),
                stage_started_at=clock.rfc3339(observed.now),
                resize_id=running.resize_id,
                generation=observed.generation,
            )
            return _drive(adopted, previous=None, spec=spec, observed=observed)
        # Someone else's resize (or one we gave up on): let it end first.
        return decide.Decision(
            replicas=max(decide.hold(observed, live), running.to_size),
            workers_to_delete=decide.pending(observed),
            resize=last,
            requeue=decide.REQUEUE_SECONDS,
            phase=actions.SetPhase(
                status_.Phase.RESIZING,
                status_.REASON_RUNTIME_BUSY,
                f"the runtime runs resize {running.resize_id} {running.from_size}->"
                f"{running.to_size} ({running.stage}); waiting for it to end",
                ready=True,
            ),
        )
    if live == target or failed_here:
        replicas, delete = decide.settle(observed, size=live)
        phase = None
        if live != target and last is not None:
            phase = decide.failed_phase(last, ready=True)
        return decide.Decision(
            replicas=replicas, workers_to_delete=delete, resize=last, phase=phase
        )
    now = clock.rfc3339(observed.now)
    fresh = status_.ResizeStatus(
        from_size=live,
        to_size=target,
        stage=decide.Stage.PROVISIONING if target > live else decide.FIRST_DOWN_STAGE,
        started_at=now,
        stage_started_at=now,
        generation=observed.generation,
    )
    decision = _drive(fresh, previous=None, spec=spec, observed=observed)
    if runtime.lost and target > live and decision.resize is not None:
        # The grow back after a loss (autoRecover): say so where people look.
        why = f"growing back after losing {recovery.lost_text(runtime.lost)}"
        note = decision.resize.message
        decision.resize = decision.resize.model_copy(
            update={"message": f"{why}; {note}" if note else why}
        )
    return decision


def plan_resize(
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
) -> list[actions.Action]:
    """The actions of one reconcile, in order; the last one is always a ``actions.SetPhase``."""
    # Replicas are planned in ranks; the warm spares' pods ride on top of every count.
    observed = dataclasses.replace(observed, warm_spares=spec.elastic.warm_spare_ranks)
    r = status.resize
    if r is not None and r.active:
        decision = _drive(r, previous=r.stage, spec=spec, observed=observed)
    else:
        decision = _idle(spec=spec, status=status, observed=observed)
    ray = observed.raycluster
    # The RayCluster first: it is the slowest to come up (KubeRay makes its pods); the Secret
    # its pods mount follows at once, long before a pod of it is scheduled.
    planned: list[actions.Action] = [
        actions.ApplyRayCluster(
            worker_replicas=decision.replicas + observed.warm_spares,
            workers_to_delete=decision.workers_to_delete,
            head_size=ray.head_size if ray is not None else None,
        )
    ]
    if not observed.secret_exists:
        planned.append(actions.EnsureSecret())
    planned.append(actions.ApplyService())
    planned.append(actions.ApplyNetworkPolicy())
    if decision.scale is not None:
        planned.append(actions.ScaleRuntime(new_size=decision.scale))
    planned.append(actions.SetResize(decision.resize))
    planned.extend(decision.events)
    restarts, seen = observed.head_restarts, status.head_restarts
    # A head that never served and restarts is a failed start (``plan.load_report``).
    if restarts is not None and seen is not None and restarts > seen and decide.served(status):
        planned.append(
            actions.Event(
                status_.REASON_RUNTIME_RESTARTED,
                f"the head container restarted (restarts: {restarts}): the runtime and Ray's GCS "
                f"with it; serving again at the size it starts with, then resizing to "
                f"{spec.data_parallel_size}",
            )
        )
    if decision.requeue is not None:
        planned.append(actions.Requeue(decision.requeue))
    planned.append(
        decision.phase or decide.default_phase(spec=spec, status=status, observed=observed)
    )
    return planned
