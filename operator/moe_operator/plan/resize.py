"""The reconcile planner: from (spec, status, observed) to an ordered list of actions.

Purely computational, with no side effects (like kopf's ``detect_changing_cause``): the handler
executes the actions in order, then writes the status once. Because every input is read back
from the cluster, a restarted operator plans the same next step: the resize is driven from
status, not from memory.

Base cases handled here: create or re-apply the children (Secret, RayCluster, Service) and set
the phase from what the RayCluster reports. The live-resize stages (DESIGN §3) slot in as more
action types (``ScaleRuntime``) planned from ``status.resize`` and ``observed.runtime``.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import observe


@dataclasses.dataclass(frozen=True)
class EnsureSecret:
    """Create the admin-token Secret when it is missing (an existing one is never rotated)."""


@dataclasses.dataclass(frozen=True)
class ApplyRayCluster:
    """Server-side apply the RayCluster with this many worker replicas."""

    worker_replicas: int


@dataclasses.dataclass(frozen=True)
class ApplyService:
    """Server-side apply the Service in front of the runtime API."""


@dataclasses.dataclass(frozen=True)
class ScaleRuntime:
    """Ask the runtime for a live resize (``POST /scale_elastic_ep``); planned by the resize
    driver once the runtime is observed."""

    new_size: int


@dataclasses.dataclass(frozen=True)
class SetPhase:
    """The phase (and Ready reason/message) the status write that ends the reconcile reports."""

    phase: status_.Phase
    reason: str
    message: str


Action = Union[EnsureSecret, ApplyRayCluster, ApplyService, ScaleRuntime, SetPhase]


def was_serving(status: status_.MoEDeploymentStatus) -> bool:
    return status.phase in (status_.Phase.SERVING, status_.Phase.DEGRADED)


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


def plan_resize(
    spec: spec_.MoEDeploymentSpec,
    status: status_.MoEDeploymentStatus,
    observed: observe.Observed,
) -> list[Action]:
    """The actions of one reconcile, in order; the last one is always a ``SetPhase``."""
    actions: list[Action] = []
    if not observed.secret_exists:
        actions.append(EnsureSecret())
    actions.append(ApplyRayCluster(worker_replicas=spec.data_parallel_size))
    actions.append(ApplyService())
    actions.append(_phase(spec=spec, status=status, observed=observed))
    return actions
