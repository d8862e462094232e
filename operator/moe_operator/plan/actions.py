"""The planner's vocabulary: the actions one reconcile executes in order, and the runtime's
answers to a scale request as the planner sees them. Data only."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final, Union

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


@dataclasses.dataclass(frozen=True)
class ApplyService:
    """Server-side apply the Service in front of the runtime API."""


@dataclasses.dataclass(frozen=True)
class ApplyNetworkPolicy:
    """Server-side apply the NetworkPolicy of the deployment's Ray pods."""


@dataclasses.dataclass(frozen=True)
class PatchSettings:
    """Bring the runtime's live settings to the spec (``PATCH /elastic_ep/config`` with these
    changes, ``plan.settings``); the runtime may refuse them (it then changes nothing)."""

    changes: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ScaleRuntime:
    """Ask the runtime for a live resize (``POST /scale_elastic_ep``, no wait); fold the answer
    into the resize status with :func:`plan.scale_answer.after_scale`."""

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
    PatchSettings,
    EnsureSecret,
    ApplyRayCluster,
    ApplyService,
    ApplyNetworkPolicy,
    ScaleRuntime,
    SetResize,
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
