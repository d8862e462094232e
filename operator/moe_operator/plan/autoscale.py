"""The operator's own autoscaler (``spec.autoscaling``): HPA's algorithm over the runtime's
in-flight sequences, with HPA's stabilisation windows. Pure functions, no side effects.

- **Metric**: sequences in flight (running + queued: ``load.in_flight`` of
  ``/elastic_ep/status``, read every reconcile) per serving rank.
- **Recommendation** (HPA's ``GetResourceReplicas``): within ``tolerance`` of the target, the
  serving size; else ``ceil(ranks × metric / target)`` = ``ceil(in_flight / target)``;
  clamped to ``[minDataParallelSize, maxDataParallelSize]``.
- **Stabilisation** (HPA's ``stabilizeRecommendationWithBehaviors``): the new size is the
  current one raised to the *lowest* recommendation of the last
  ``scaleUpStabilizationSeconds`` and lowered to the *highest* of the last
  ``scaleDownStabilizationSeconds``. A grow needs the load to have asked for more during the
  whole up window, a shrink during the whole down window: a load that alternates faster than
  a window resizes nothing.
- **Memory**: HPA keeps timestamped recommendations in memory; here they live in
  ``status.autoscaling.recommendations`` as *runs* of one size (``size``, ``since``,
  ``until``), so a restarted operator decides as the last one would, and a steady
  recommendation writes nothing. A run counts until the sample that changed it (up to one
  sync period longer than HPA's sampled view would hold it, which only delays a decision),
  and the current run until now. Runs that can no longer decide are dropped: those older than
  both windows, and dominated ones (a later run at least as high stands in for it in the down
  window's maximum, a later run at least as low in the up window's minimum): at most two runs
  per size remain. The windows start at the first sample (autoscaling just enabled, or handed
  back by another autoscaler): before it, the current size counts as recommended.
- **Never during a resize**: while a resize or a recovery runs (or ranks are lost), samples are
  kept but nothing is decided; the size is written through the scale subresource, as an HPA
  does, and the resize driver (:mod:`plan.resize`) takes it from there.
- **Never against another autoscaler**: a HorizontalPodAutoscaler whose ``scaleTargetRef``
  names the deployment (a KEDA ScaledObject makes one, ``keda-hpa-NAME``) owns the size; the
  operator's autoscaler stands down and says so (:func:`external`).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any, Final

from moe_operator.api import group
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import actions, clock, observe

#: ``decision`` label of the operator's autoscaler metric.
DECISION_SCALE_UP: Final = "scale_up"
DECISION_SCALE_DOWN: Final = "scale_down"
DECISION_EXTERNAL: Final = "external"
DECISION_FAILED: Final = "failed"
DECISIONS: Final = (DECISION_SCALE_UP, DECISION_SCALE_DOWN, DECISION_EXTERNAL, DECISION_FAILED)
#: KEDA labels the HPA it makes for a ScaledObject with the ScaledObject's name.
KEDA_LABEL: Final = "scaledobject.keda.sh/name"


@dataclasses.dataclass(frozen=True)
class Run:
    """``size`` was recommended from ``since`` until ``until`` (``None``: it still is)."""

    size: int
    since: datetime.datetime
    until: datetime.datetime | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the autoscaler decided in one reconcile."""

    #: ``status.autoscaling`` after this reconcile (``None``: autoscaling is off).
    status: status_.AutoscalingStatus | None
    #: Write ``spec.dataParallelSize`` (through the scale subresource) to this size.
    scale_to: int | None = None
    events: tuple[actions.Event, ...] = ()
    #: Reconcile again after this many seconds (the next sample).
    requeue: float | None = None
    #: The decision, for the operator's metric (``None``: nothing new was decided).
    decision: str | None = None


# -- the policy ----------------------------------------------------------------------------------


def recommend(
    *, in_flight: int, ranks: int, target: int, tolerance: float, min_size: int, max_size: int
) -> int:
    """HPA's recommendation for ``in_flight`` sequences on ``ranks`` serving ranks, clamped."""
    if ranks > 0 and abs(in_flight / (ranks * target) - 1.0) <= tolerance:
        raw = ranks
    else:
        raw = -(-in_flight // target)
    return min(max(raw, min_size), max_size)


def remember(
    runs: Sequence[Run], size: int, *, now: datetime.datetime, up_s: float, down_s: float
) -> list[Run]:
    """``runs`` with this reconcile's recommendation ``size`` added, and the runs that can no
    longer decide dropped."""
    out = list(runs)
    if not out or out[-1].until is not None or out[-1].size != size:
        if out and out[-1].until is None:
            out[-1] = dataclasses.replace(out[-1], until=now)
        out.append(Run(size=size, since=now))
    return prune(out, now=now, up_s=up_s, down_s=down_s)


def prune(runs: Sequence[Run], *, now: datetime.datetime, up_s: float, down_s: float) -> list[Run]:
    """The runs that can still be a window's extreme, now or later. A later run overlaps every
    window an earlier one overlaps, so a later run at least as high makes an earlier one
    useless to the down window's maximum, and one at least as low to the up window's
    minimum."""
    up_cut = now - datetime.timedelta(seconds=up_s)
    down_cut = now - datetime.timedelta(seconds=down_s)
    kept: list[Run] = []
    for i, run in enumerate(runs):
        if run.until is None:
            kept.append(run)
            continue
        later = runs[i + 1 :]
        for_max = run.until > down_cut and not any(r.size >= run.size for r in later)
        for_min = run.until > up_cut and not any(r.size <= run.size for r in later)
        if for_max or for_min:
            kept.append(run)
    return kept


def _within(runs: Sequence[Run], cut: datetime.datetime) -> list[int]:
    return [r.size for r in runs if r.until is None or r.until > cut]


def stabilize(
    runs: Sequence[Run], *, current: int, now: datetime.datetime, up_s: float, down_s: float
) -> int:
    """The size after the windows: ``current`` raised to the lowest recommendation of the up
    window, lowered to the highest of the down window (HPA). ``runs`` must not be empty."""
    lowest = min(_within(runs, now - datetime.timedelta(seconds=up_s)))
    highest = max(_within(runs, now - datetime.timedelta(seconds=down_s)))
    size = current
    if size < lowest:
        size = lowest
    if size > highest:
        size = highest
    return size


def external(hpas: Sequence[dict[str, Any]], *, name: str) -> str | None:
    """The autoscaler that owns this deployment's size instead of the operator: the first
    HorizontalPodAutoscaler of the namespace whose ``scaleTargetRef`` is the MoEDeployment
    ``name`` (``None``: there is none)."""
    for hpa in sorted(hpas, key=lambda h: str((h.get("metadata") or {}).get("name"))):
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        api_group = str(ref.get("apiVersion") or "").split("/", 1)[0]
        if ref.get("kind") == group.KIND and api_group == group.GROUP and ref.get("name") == name:
            meta = hpa.get("metadata") or {}
            scaled_object = (meta.get("labels") or {}).get(KEDA_LABEL)
            if scaled_object:
                return f"KEDA ScaledObject {scaled_object} (HorizontalPodAutoscaler {meta.get('name')})"
            return f"HorizontalPodAutoscaler {meta.get('name')}"
    return None


# -- one reconcile -------------------------------------------------------------------------------


def _runs(recorded: Sequence[status_.Recommendation] | None) -> list[Run]:
    out: list[Run] = []
    for r in recorded or ():
        since = clock.parse(r.since)
        if since is None:
            continue
        out.append(Run(size=r.size, since=since, until=clock.parse(r.until)))
    return out


def _wire(runs: Sequence[Run]) -> list[status_.Recommendation]:
    return [
        status_.Recommendation(
            size=r.size,
            since=clock.rfc3339(r.since),
            until=clock.rfc3339(r.until) if r.until is not None else None,
        )
        for r in runs
    ]


def busy(
    *, resize: status_.ResizeStatus | None, runtime: observe.RuntimeObservation | None
) -> str | None:
    """Why no decision may start now (``None``: one may): a resize or recovery runs, or ranks
    were lost and are not back."""
    if resize is not None and resize.active:
        kind = "recovery" if resize.kind == status_.KIND_RECOVERY else "resize"
        return f"{kind} {resize.from_size}->{resize.to_size} is in stage {resize.stage.value}"
    if runtime is not None and runtime.running is not None:
        r = runtime.running
        return f"the runtime runs {r.kind} {r.from_size}->{r.to_size} ({r.stage})"
    if runtime is not None and runtime.lost:
        return "ranks were lost and are not back"
    return None


def _load_text(in_flight: int, ranks: int, target: int) -> str:
    return (
        f"{in_flight / ranks:.2f} in flight per rank ({in_flight} sequences on {ranks} "
        f"rank{'s' if ranks != 1 else ''}), target {target}"
    )


def decide(
    *,
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
    resize: status_.ResizeStatus | None,
    external_autoscaler: str | None = None,
) -> Decision:
    """One look of the autoscaler.

    ``status``: the stored status (its ``autoscaling`` holds the windows' memory);
    ``resize``: ``status.resize`` as this reconcile planned it; ``external_autoscaler``: what
    :func:`external` found (the caller lists the namespace's HPAs).
    """
    auto = spec.autoscaling
    if not auto.enabled:
        return Decision(status=None)
    before = status.autoscaling or status_.AutoscalingStatus()
    now = observed.now
    sync = float(auto.sync_period_seconds)
    current = spec.data_parallel_size
    runtime = observed.runtime
    in_flight = runtime.in_flight if runtime is not None else None
    ranks = runtime.data_parallel_size if runtime is not None else 0
    runs = _runs(before.recommendations)

    def seen(
        reason: str,
        message: str,
        *,
        desired: int | None,
        decided: bool = False,
    ) -> status_.AutoscalingStatus:
        return status_.AutoscalingStatus(
            metric=round(in_flight / ranks, 2) if in_flight is not None and ranks > 0 else None,
            in_flight=in_flight,
            desired_size=desired,
            reason=reason,
            message=message,
            last_decision_time=clock.rfc3339(now) if decided else before.last_decision_time,
            last_decision=message if decided else before.last_decision,
            recommendations=_wire(runs) or None,
        )

    if external_autoscaler is not None:
        message = (
            f"{external_autoscaler} sets dataParallelSize through the scale subresource; the "
            "operator's autoscaler stands down (set spec.autoscaling.enabled to false, or "
            "delete that autoscaler)"
        )
        new = before.reason != status_.REASON_EXTERNAL_AUTOSCALER
        runs = []  # the windows start afresh if the operator's autoscaler takes over again
        return Decision(
            status=seen(status_.REASON_EXTERNAL_AUTOSCALER, message, desired=current),
            events=(actions.Event(status_.REASON_EXTERNAL_AUTOSCALER, message),) if new else (),
            requeue=sync,
            decision=DECISION_EXTERNAL if new else None,
        )
    if in_flight is None or ranks < 1:
        message = (
            "the runtime does not answer"
            if runtime is None
            else "the runtime does not report its load (load.in_flight of /elastic_ep/status)"
        )
        return Decision(
            status=seen(status_.REASON_METRIC_UNAVAILABLE, message, desired=before.desired_size),
            requeue=sync,
        )
    up_s = float(auto.scale_up_stabilization_seconds)
    down_s = float(auto.scale_down_stabilization_seconds)
    target = auto.target_in_flight_per_rank
    raw = recommend(
        in_flight=in_flight,
        ranks=ranks,
        target=target,
        tolerance=auto.tolerance,
        min_size=spec.min_data_parallel_size,
        max_size=spec.max_data_parallel_size,
    )
    if not runs:
        # The windows start at the first sample: the current size counts as recommended until
        # now. (HPA starts with no memory, so a restarted controller may act at once.)
        runs = [Run(size=current, since=now, until=now)]
    runs = remember(runs, raw, now=now, up_s=up_s, down_s=down_s)
    desired = stabilize(runs, current=current, now=now, up_s=up_s, down_s=down_s)
    load = _load_text(in_flight, ranks, target)
    why_busy = busy(resize=resize, runtime=runtime)
    if why_busy is not None:
        return Decision(
            status=seen(
                status_.REASON_WAITING_FOR_RESIZE,
                f"no decision while a {why_busy}; {load}",
                desired=desired,
            ),
            requeue=sync,
        )
    if desired != current:
        up = desired > current
        window = up_s if up else down_s
        reason = status_.REASON_SCALED_UP if up else status_.REASON_SCALED_DOWN
        message = (
            f"dataParallelSize {current}->{desired}: {load}; "
            f"{'above' if up else 'below'} {current} for {window:.0f}s"
        )
        return Decision(
            status=seen(reason, message, desired=desired, decided=True),
            scale_to=desired,
            events=(actions.Event(reason, message),),
            requeue=sync,
            decision=DECISION_SCALE_UP if up else DECISION_SCALE_DOWN,
        )
    since = clock.rfc3339(runs[-1].since)
    if raw > current:
        reason = status_.REASON_SCALE_UP_STABILIZING
        message = (
            f"{load}: {raw} recommended since {since}; grows once every recommendation of "
            f"the last {up_s:.0f}s is above {current}"
        )
    elif raw < current:
        reason = status_.REASON_SCALE_DOWN_STABILIZING
        message = (
            f"{load}: {raw} recommended since {since}; shrinks once every recommendation of "
            f"the last {down_s:.0f}s is below {current}"
        )
    else:
        reason = status_.REASON_STABLE
        message = (
            f"{load}: {current} ranks (limits [{spec.min_data_parallel_size}, "
            f"{spec.max_data_parallel_size}], tolerance {auto.tolerance:g})"
        )
    return Decision(status=seen(reason, message, desired=desired), requeue=sync)


def scale_failed(
    decision: Decision, message: str, *, before: status_.AutoscalingStatus | None
) -> Decision:
    """The scale subresource refused the write (a conflict, RBAC): nothing was decided (the
    last decision stays the one before); the next sample decides again."""
    assert decision.status is not None
    text = f"could not set dataParallelSize to {decision.scale_to}: {message}"
    return Decision(
        status=decision.status.model_copy(
            update={
                "reason": status_.REASON_SCALE_FAILED,
                "message": text,
                "last_decision_time": before.last_decision_time if before else None,
                "last_decision": before.last_decision if before else None,
            }
        ),
        events=(actions.Event(status_.REASON_SCALE_FAILED, text),),
        requeue=decision.requeue,
        decision=DECISION_FAILED,
    )
