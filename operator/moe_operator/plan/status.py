"""Status computation: the next ``MoEDeployment.status`` from the planned phase and what was
observed, with Kubernetes-convention conditions, and the "is a write needed" test that ignores
timestamps."""

from __future__ import annotations

import datetime
from typing import Any

from moe_operator.api import status as status_
from moe_operator.plan import builders, observe, resize

C = status_.ConditionStatus


def now_rfc3339(now: datetime.datetime | None = None) -> str:
    moment = now or datetime.datetime.now(datetime.timezone.utc)
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[status_.Condition],
    new: status_.Condition,
) -> list[status_.Condition]:
    """Replace the condition of ``new.type``, keeping its ``lastTransitionTime`` when its status
    did not change (API conventions)."""
    out: list[status_.Condition] = []
    replaced = False
    for cond in conditions:
        if cond.type != new.type:
            out.append(cond)
            continue
        replaced = True
        if cond.status == new.status:
            new = new.model_copy(update={"last_transition_time": cond.last_transition_time})
        out.append(new)
    if not replaced:
        out.append(new)
    order = {t: i for i, t in enumerate(status_.CONDITION_TYPES)}
    return sorted(out, key=lambda c: (order.get(c.type, len(order)), c.type))


def serving_size(*, observed: observe.Observed, target: int) -> int:
    """Ranks serving now: the runtime's word when it answers, else what Ray reports ready."""
    if observed.runtime is not None:
        return observed.runtime.data_parallel_size
    ray = observed.raycluster
    if ray is None or not ray.head_ready:
        return 0
    return min(ray.ready_workers, target)


def next_status(
    *,
    name: str,
    namespace: str,
    generation: int,
    target: int,
    current: status_.MoEDeploymentStatus,
    observed: observe.Observed,
    phase: resize.SetPhase,
    now: str,
) -> status_.MoEDeploymentStatus:
    """The status the reconcile ends with."""

    def cond(type_: str, value: status_.ConditionStatus, reason: str, message: str) -> Any:
        return status_.Condition(
            type=type_,
            status=value,
            reason=reason,
            message=message,
            last_transition_time=now,
            observed_generation=generation,
        )

    ready = phase.phase == status_.Phase.SERVING
    resizing = phase.phase == status_.Phase.RESIZING
    degraded = phase.phase in (status_.Phase.DEGRADED, status_.Phase.FAILED)
    conditions = list(current.conditions or [])
    conditions = set_condition(
        conditions,
        cond(status_.CONDITION_READY, C.TRUE if ready else C.FALSE, phase.reason, phase.message),
    )
    conditions = set_condition(
        conditions,
        cond(
            status_.CONDITION_RESIZING,
            C.TRUE if resizing else C.FALSE,
            status_.REASON_RESIZE_IN_PROGRESS if resizing else status_.REASON_NO_RESIZE,
            phase.message if resizing else "",
        ),
    )
    conditions = set_condition(
        conditions,
        cond(
            status_.CONDITION_DEGRADED,
            C.TRUE if degraded else C.FALSE,
            phase.reason if degraded else status_.REASON_HEALTHY,
            phase.message if degraded else "",
        ),
    )
    experts = current.experts
    if observed.runtime is not None and observed.runtime.balancedness is not None:
        experts = status_.ExpertsStatus(
            balancedness=observed.runtime.balancedness,
            redundant_experts=experts.redundant_experts if experts else None,
        )
    return status_.MoEDeploymentStatus(
        observed_generation=generation,
        phase=phase.phase,
        data_parallel_size=serving_size(observed=observed, target=target),
        target_data_parallel_size=target,
        selector=builders.selector(name),
        resize=current.resize,
        experts=experts,
        endpoint=builders.endpoint(owner_name=name, namespace=namespace),
        conditions=conditions,
    )


_TIMESTAMP_KEYS = frozenset({"lastTransitionTime", "startedAt", "stageStartedAt"})


def _without_timestamps(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timestamps(v) for k, v in value.items() if k not in _TIMESTAMP_KEYS}
    if isinstance(value, list):
        return [_without_timestamps(v) for v in value]
    return value


def needs_write(old: dict[str, Any] | None, new: status_.MoEDeploymentStatus) -> bool:
    """True when ``new`` differs from the stored status in more than timestamps."""
    return bool(_without_timestamps(old or {}) != _without_timestamps(new.to_wire()))


def merge_patch(old: dict[str, Any] | None, new: status_.MoEDeploymentStatus) -> dict[str, Any]:
    """A JSON merge patch turning the stored status into ``new`` (removed keys set to null)."""
    wire = new.to_wire()
    patch: dict[str, Any] = {key: None for key in (old or {}) if key not in wire}
    patch.update(wire)
    return patch
