"""The runtime's answer to ``POST /scale_elastic_ep`` folded into the resize status (pure).

``plan.resize`` plans a ``actions.ScaleRuntime``; ``reconcile`` sends it and hands the outcome
(``ScaleAccepted``, ``ScaleRefused``, ``ScaleDeferred``) to :func:`after_scale`, then takes the
phase from :func:`phase_after_scale`.
"""

from __future__ import annotations

import datetime

from moe_operator.api import status as status_
from moe_operator.plan import actions, clock, decide


def after_scale(
    resize: status_.ResizeStatus,
    outcome: actions.ScaleOutcome,
    *,
    now: datetime.datetime,
) -> tuple[status_.ResizeStatus, list[actions.Event]]:
    """Fold the runtime's answer to ``POST /scale_elastic_ep`` into the resize status."""
    stamp = clock.rfc3339(now)
    if isinstance(outcome, actions.ScaleAccepted):
        update: dict[str, object] = {"resize_id": outcome.resize_id, "message": None}
        events: list[actions.Event] = []
        stage = decide.stage_of(outcome.stage or "")
        if resize.stage is decide.Stage.PROVISIONING:
            began = clock.parse(resize.stage_started_at)
            seconds = round((now - began).total_seconds()) if began is not None else 0
            if seconds > 0:  # under half a second: asked in the reconcile that began it
                durations = dict(resize.stage_durations or {})
                durations[decide.Stage.PROVISIONING.value] = float(seconds)
                update["stage_durations"] = durations
        if (
            stage is not None
            and stage not in (decide.Stage.COMPLETED, decide.Stage.FAILED)
            and stage is not resize.stage
        ):
            update["stage"] = stage
            update["stage_started_at"] = stamp
            events.append(decide.stage_event(resize, stage))
        return resize.model_copy(update=update), events
    if isinstance(outcome, actions.ScaleRefused):
        message = f"the runtime refused {decide.arrow(resize)}: {outcome.message}"
        failed = resize.model_copy(
            update={
                "stage": decide.Stage.FAILED,
                "message": message,
                "stage_started_at": stamp,
                "finished_at": stamp,
            }
        )
        return failed, [
            actions.Event(
                decide.Stage.FAILED.value, f"resize {decide.arrow(resize)} failed: {message}"
            )
        ]
    return resize.model_copy(update={"message": f"will ask again: {outcome.message}"}), []


def phase_after_scale(resize: status_.ResizeStatus, phase: actions.SetPhase) -> actions.SetPhase:
    """The phase once a ``actions.ScaleRuntime`` answer was folded in (a refusal degrades it)."""
    if resize.stage is decide.Stage.FAILED:
        return decide.failed_phase(resize, ready=True)
    if resize.active:
        return decide.resizing_phase(resize, ready=True)
    return phase
