"""Status computation: the next ``MoEDeployment.status`` from the planned phase and what was
observed, with Kubernetes-convention conditions, and the "is a write needed" test that ignores
timestamps."""

from __future__ import annotations

import datetime
from typing import Any

from moe_operator.api import rollout as rollout_
from moe_operator.api import status as status_
from moe_operator.plan import actions, builders, clock, decide, load_report, observe

C = status_.ConditionStatus


def now_rfc3339(now: datetime.datetime | None = None) -> str:
    return clock.rfc3339(now or datetime.datetime.now(datetime.timezone.utc))


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


def serving_size(*, observed: observe.Observed, target: int, previous: int | None = None) -> int:
    """Ranks serving now: the runtime's word when it answers; else ``previous`` (the size it
    last reported, for a deployment that served) or what Ray reports ready."""
    if observed.runtime is not None:
        return observed.runtime.data_parallel_size
    if previous is not None:
        return previous
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
    phase: actions.SetPhase,
    now: str,
    resize_status: status_.ResizeStatus | None | actions.Keep = actions.KEEP,
    autoscaling: status_.AutoscalingStatus | None | actions.Keep = actions.KEEP,
    mesh: tuple[int, int] = (1, 1),
) -> status_.MoEDeploymentStatus:
    """The status the reconcile ends with (``resize_status``: ``status.resize`` as planned,
    ``autoscaling``: ``status.autoscaling`` as the autoscaler left it; by default the
    current ones are kept). ``mesh``: the spec's (tensor, pipeline) parallel sizes, shown
    until a RayCluster is seen; then the serving RayCluster's are (a change of the mesh rolls
    over to a new RayCluster: the serving one keeps its own until the rollout ends)."""
    running = current.resize if isinstance(resize_status, actions.Keep) else resize_status

    def cond(type_: str, value: status_.ConditionStatus, reason: str, message: str) -> Any:
        return status_.Condition(
            type=type_,
            status=value,
            reason=reason,
            message=message,
            last_transition_time=now,
            observed_generation=generation,
        )

    ready = phase.ready if phase.ready is not None else phase.phase == status_.Phase.SERVING
    resizing = phase.phase == status_.Phase.RESIZING
    active = running is not None and running.active
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
            (
                running.stage.value
                if active and running is not None
                else status_.REASON_RESIZE_IN_PROGRESS
                if resizing
                else status_.REASON_NO_RESIZE
            ),
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
    spares = current.spares
    if observed.runtime is not None:
        rt = observed.runtime
        spares = (
            status_.SparesStatus(
                desired=rt.warm_spare_ranks,
                ready=rt.spares_ready,
                pods=list(rt.spare_pods) or None,
            )
            if rt.warm_spare_ranks or rt.spare_pods
            else None
        )
    ray = observed.raycluster
    return status_.MoEDeploymentStatus(
        observed_generation=generation,
        phase=phase.phase,
        data_parallel_size=serving_size(
            observed=observed,
            target=target,
            previous=current.data_parallel_size if decide.served(current) else None,
        ),
        target_data_parallel_size=target,
        tensor_parallel_size=ray.tensor_parallel_size if ray else mesh[0],
        pipeline_parallel_size=ray.pipeline_parallel_size if ray else mesh[1],
        selector=builders.selector(name),
        resize=running,
        experts=experts,
        endpoint=builders.endpoint(owner_name=name, namespace=namespace),
        autoscaling=current.autoscaling if isinstance(autoscaling, actions.Keep) else autoscaling,
        spares=spares,
        loading=load_report.loading_status(observed),
        head_restarts=(
            observed.head_restarts if observed.head_restarts is not None else current.head_restarts
        ),
        conditions=conditions,
    )


def with_rollout(
    new: status_.MoEDeploymentStatus,
    *,
    rollout: rollout_.RolloutStatus | None,
    ray_cluster: str | None,
    revision: str | None,
    generation: int,
    now: str,
) -> status_.MoEDeploymentStatus:
    """``new`` with the rollout's parts: ``status.rollout``, ``rayCluster``, ``revision``
    and the ``Rollout`` condition (True while one runs; none before the first rollout)."""
    if rollout is None:
        return new.model_copy(
            update={"rollout": None, "ray_cluster": ray_cluster, "revision": revision}
        )
    if rollout.active:
        value = C.TRUE
        reason = rollout_.REASON_ROLLING
        message = (
            f"{rollout.from_revision}->{rollout.to_revision}: {rollout.stage.value} "
            f"{rollout.progress}" + (f" ({rollout.message})" if rollout.message else "")
        )
    elif rollout.stage is rollout_.RolloutStage.ROLLED_BACK:
        value, reason = C.FALSE, rollout_.REASON_ROLLED_BACK
        message = f"{rollout.from_revision}->{rollout.to_revision}: {rollout.message or ''}"
    else:
        value, reason = C.FALSE, rollout_.REASON_ROLLED_OUT
        message = f"{rollout.from_revision}->{rollout.to_revision} completed"
    condition = status_.Condition(
        type=status_.CONDITION_ROLLOUT,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=now,
        observed_generation=generation,
    )
    return new.model_copy(
        update={
            "rollout": rollout,
            "ray_cluster": ray_cluster,
            "revision": revision,
            "conditions": set_condition(list(new.conditions or []), condition),
        }
    )


_TIMESTAMP_KEYS = frozenset(
    {"lastTransitionTime", "startedAt", "stageStartedAt", "finishedAt", "drainStartedAt"}
)


def _without_timestamps(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timestamps(v) for k, v in value.items() if k not in _TIMESTAMP_KEYS}
    if isinstance(value, list):
        return [_without_timestamps(v) for v in value]
    return value


def needs_write(old: dict[str, Any] | None, new: status_.MoEDeploymentStatus) -> bool:
    """True when ``new`` differs from the stored status in more than timestamps."""
    return bool(_without_timestamps(old or {}) != _without_timestamps(new.to_wire()))


def _merge_patch(old: Any, new: Any) -> Any:
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        patch[key] = _merge_patch(old.get(key), value)
    return patch


def merge_patch(old: dict[str, Any] | None, new: status_.MoEDeploymentStatus) -> dict[str, Any]:
    """A JSON merge patch turning the stored status into ``new``: keys removed at any depth
    are set to null (a merge patch merges nested objects; lists are replaced whole)."""
    patch: dict[str, Any] = _merge_patch(old or {}, new.to_wire())
    return patch
