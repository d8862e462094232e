"""What a deployment says while its head starts and does not serve yet (pure): the model's
load progress (Ready False, reason ``LoadingModel``, the runtime's own words from ``GET
/ready``: "loading weights 12.4/60.1 MB, rank 1/2 (1 of 2 ranks loaded)") and a head that
stopped on an error (``LoadFailed``, with its termination message: a wrong path, a path
without ``config.json``, a refused ``model_type``, a rank that ran out of memory).

A failed start is phase ``Failed`` for a deployment that never served, with one warning event
per new reason, until the head serves: the kubelet keeps restarting it (CrashLoopBackOff), and
a fixed spec or volume lets it start. A deployment that served and whose head stopped on an
error is ``Degraded`` with that reason while the head does not run, and shows its load again
while it starts over. Only the phase of a deployment whose head is not ready is changed, never
a resize's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from moe_operator.api import status as status_
from moe_operator.plan import actions, decide, observe

#: Seconds between two looks at a loading head (its progress changes with no event).
LOADING_REQUEUE_SECONDS: Final = 2.0
#: Seconds between two looks at a head that failed to start.
FAILED_REQUEUE_SECONDS: Final = 10.0
#: Phases this report may replace: a head that is not ready while nothing else is going on.
_REPLACED: Final = (status_.Phase.PROVISIONING, status_.Phase.DEGRADED)


def failure_text(failure: observe.HeadFailure, *, served: bool = False) -> str:
    """``the head did not start (restarts: 3, CrashLoopBackOff): <termination message>``
    (``the head stopped`` for a deployment that served)."""
    how = f"restarts: {failure.restarts}"
    if failure.waiting:
        how += f", {failure.waiting}"
    if failure.reason == "OOMKilled":
        how += ", out of memory: its memory limit is below what it needs"
    what = "stopped" if served else "did not start"
    return f"the head {what} ({how}): {failure.message}"


def report(
    steps: Sequence[actions.Action],
    *,
    observed: observe.Observed,
    status: status_.MoEDeploymentStatus,
) -> list[actions.Action]:
    """``steps`` (the resize planner's, ending in a ``SetPhase``) with the phase, an event and
    a requeue of a head that loads or failed to start; unchanged otherwise."""
    out = list(steps)
    ray = observed.raycluster
    if not out or not isinstance(out[-1], actions.SetPhase) or ray is None or ray.head_ready:
        return out
    if out[-1].phase not in _REPLACED or (status.resize is not None and status.resize.active):
        return out
    ready = status.condition(status_.CONDITION_READY)
    failure, progress = observed.head_failure, observed.loading
    served = decide.was_serving(status)
    if failure is not None and served and failure.running:
        failure = None  # a head that served and stopped, starting again: its load shows
    if failure is not None:
        reason = status_.REASON_LOAD_FAILED
        message = failure_text(failure, served=served)
        if progress is not None:
            message += f"; trying again: {progress.message()}"
        phase = status_.Phase.DEGRADED if served else status_.Phase.FAILED
        known = ready is not None and ready.reason == reason and failure.message in ready.message
        event = None if known else actions.Event(reason, failure_text(failure, served=served))
        requeue = FAILED_REQUEUE_SECONDS
    elif progress is not None:
        reason = status_.REASON_LOADING_MODEL
        message = progress.message()
        phase = out[-1].phase
        known = ready is not None and ready.reason == reason
        event = None if known else actions.Event(reason, f"loading the model: {message}")
        requeue = LOADING_REQUEUE_SECONDS
    elif observed.head_loading_ip is not None:
        # The head runs but does not say what it loads (yet: ``ray start``, imports): look
        # again soon, nothing else would wake the reconcile before the head is Ready.
        return _requeue(out, LOADING_REQUEUE_SECONDS)
    else:
        return out
    final = actions.SetPhase(phase, reason, message, ready=False)
    return _requeue([*out[:-1], *([event] if event is not None else []), final], requeue)


def _requeue(steps: list[actions.Action], seconds: float) -> list[actions.Action]:
    """``steps`` with one requeue, after ``seconds`` or sooner when one asked for that,
    just before their final ``SetPhase``."""
    shortest = min([seconds, *(a.seconds for a in steps if isinstance(a, actions.Requeue))])
    kept = [a for a in steps[:-1] if not isinstance(a, actions.Requeue)]
    return [*kept, actions.Requeue(shortest), steps[-1]]


def loading_status(observed: observe.Observed) -> status_.LoadingStatus | None:
    """``status.loading`` while a head that is not ready loads (``None`` otherwise)."""
    progress = observed.loading
    ray = observed.raycluster
    if progress is None or ray is None or ray.head_ready:
        return None
    return status_.LoadingStatus(
        bytes_loaded=progress.bytes_loaded,
        bytes_total=progress.bytes_total,
        ranks_ready=progress.ranks_ready,
        ranks_total=progress.ranks_total,
    )
