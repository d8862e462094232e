"""The planner's vocabulary: the actions one reconcile executes in order, and the runtime's
answers to a scale request as the planner sees them. Data only."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final, Union

from moe_operator.api import rollout as rollout_
from moe_operator.api import status as status_


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
    #: The RayCluster (``None``: the one that serves, ``status.rayCluster``). One of another
    #: template revision than the spec only gets its replicas and ``workersToDelete``.
    cluster: str | None = None


@dataclasses.dataclass(frozen=True)
class DeleteRayCluster:
    """Delete a RayCluster of the deployment (a rollout's old or abandoned one)."""

    cluster: str


@dataclasses.dataclass(frozen=True)
class ApplyService:
    """Server-side apply the Service in front of the runtime API, selecting the head of
    ``cluster`` (``None``: the one that serves)."""

    cluster: str | None = None


@dataclasses.dataclass(frozen=True)
class ApplyNetworkPolicy:
    """Server-side apply the NetworkPolicy of the deployment's Ray pods."""


@dataclasses.dataclass(frozen=True)
class PatchSettings:
    """Bring the runtime's live settings to the spec (``PATCH /elastic_ep/config`` with these
    changes, ``plan.settings``); the runtime may refuse them (it then changes nothing)."""

    changes: Mapping[str, Any]
    #: The runtime of that RayCluster (``None``: the one that serves).
    cluster: str | None = None


@dataclasses.dataclass(frozen=True)
class ScaleRuntime:
    """Ask the runtime for a live resize (``POST /scale_elastic_ep``, no wait); fold the answer
    into the resize status with :func:`plan.scale_answer.after_scale`; ``cluster``: the
    runtime of that RayCluster (a rollout's; its answer is only reported)."""

    new_size: int
    cluster: str | None = None


@dataclasses.dataclass(frozen=True)
class SetResize:
    """``status.resize`` after this reconcile (before a ``ScaleRuntime`` answer is folded in)."""

    resize: status_.ResizeStatus | None


@dataclasses.dataclass(frozen=True)
class SetRollout:
    """``status.rollout``, ``status.rayCluster`` and ``status.revision`` after this
    reconcile."""

    rollout: rollout_.RolloutStatus | None
    ray_cluster: str | None
    revision: str | None


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
    PatchSettings,
    EnsureSecret,
    ApplyRayCluster,
    DeleteRayCluster,
    ApplyService,
    ApplyNetworkPolicy,
    ScaleRuntime,
    SetResize,
    SetRollout,
    Event,
    Requeue,
    SetPhase,
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
