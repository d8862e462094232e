"""``MoEDeployment.status``: what the operator observed (README.md, "Observability"), plus the typed constants of
phases, condition types and condition reasons; resize stages (docs/RESIZE.md) are the contract's
(``moe_contract.stages``)."""

from __future__ import annotations

import enum
from typing import Final, Literal

import pydantic

from moe_contract import stages
from moe_contract import status as runtime_status
from moe_operator.api import rollout as rollout_
from moe_operator.api import spec as spec_


class Phase(str, enum.Enum):
    """Coarse lifecycle of a deployment."""

    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    SERVING = "Serving"
    RESIZING = "Resizing"
    DEGRADED = "Degraded"
    FAILED = "Failed"


#: The stages of a live resize (docs/RESIZE.md): the contract's, shared with the runtime.
Stage = stages.Stage

#: ``status.resize.stage`` takes every stage but ``Idle`` (the runtime's "no resize yet").
_RESIZE_STAGE_SCHEMA: Final[dict[str, pydantic.JsonValue]] = {
    "enum": [s.value for s in stages.RESIZE_STAGES]
}


class ConditionStatus(str, enum.Enum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


# Condition types.
CONDITION_READY: Final = "Ready"
CONDITION_RESIZING: Final = "Resizing"
CONDITION_DEGRADED: Final = "Degraded"
CONDITION_ROLLOUT: Final = rollout_.CONDITION_ROLLOUT
CONDITION_TYPES: Final = (
    CONDITION_READY,
    CONDITION_RESIZING,
    CONDITION_DEGRADED,
    CONDITION_ROLLOUT,
)

# Condition reasons (CamelCase, as the API conventions ask).
REASON_CHILDREN_CREATED: Final = "ChildrenCreated"
REASON_WAITING_FOR_RAY_CLUSTER: Final = "WaitingForRayCluster"
REASON_WAITING_FOR_WORKERS: Final = "WaitingForWorkers"
REASON_ALL_RANKS_READY: Final = "AllRanksReady"
REASON_RANKS_MISSING: Final = "RanksMissing"
REASON_NO_RESIZE: Final = "NoResize"
REASON_RESIZE_IN_PROGRESS: Final = "ResizeInProgress"
REASON_RESIZE_FAILED: Final = "ResizeFailed"
REASON_HEALTHY: Final = "Healthy"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_SERVING: Final = "Serving"
REASON_RUNTIME_BUSY: Final = "RuntimeBusy"
REASON_RESIZE_COMPLETED: Final = "ResizeCompleted"
REASON_RANK_LOST: Final = "RankLost"
REASON_RANK_UNHEALTHY: Final = "RankUnhealthy"
REASON_RECOVERING: Final = "Recovering"
REASON_RUNTIME_RESTARTED: Final = "RuntimeRestarted"
#: The model cannot be served from here (a ``pvc://`` claim that does not exist): nothing is
#: created until it can (``plan.availability``).
REASON_MODEL_UNAVAILABLE: Final = "ModelUnavailable"
#: The head runs and loads the model (``status.loading``, ``plan.loading``).
REASON_LOADING_MODEL: Final = "LoadingModel"
#: The head stopped before it served: its termination message is the condition's message.
REASON_LOAD_FAILED: Final = "LoadFailed"
# Autoscaler reasons (``status.autoscaling.reason``; the first three are also event reasons).
REASON_SCALED_UP: Final = "ScaledUp"
REASON_SCALED_DOWN: Final = "ScaledDown"
REASON_EXTERNAL_AUTOSCALER: Final = "ExternalAutoscaler"
REASON_SCALE_FAILED: Final = "AutoscaleFailed"
REASON_STABLE: Final = "Stable"
REASON_SCALE_UP_STABILIZING: Final = "ScaleUpStabilizing"
REASON_SCALE_DOWN_STABILIZING: Final = "ScaleDownStabilizing"
REASON_METRIC_UNAVAILABLE: Final = "MetricUnavailable"
REASON_WAITING_FOR_RESIZE: Final = "WaitingForResize"
#: Event reasons that are warnings (the others are Normal).
WARNING_REASONS: Final = frozenset(
    {
        "Failed",
        "RuntimeUrlIgnored",
        "SettingsRefused",
        REASON_RESIZE_FAILED,
        REASON_INVALID_SPEC,
        REASON_RANK_LOST,
        REASON_RANK_UNHEALTHY,
        REASON_RUNTIME_RESTARTED,
        REASON_MODEL_UNAVAILABLE,
        REASON_LOAD_FAILED,
        REASON_EXTERNAL_AUTOSCALER,
        REASON_SCALE_FAILED,
        rollout_.REASON_ROLLED_BACK,
    }
)
#: ``ResizeStatus.kind``: asked for (a spec change), or the runtime's own recovery (the values
#: of the runtime's records, ``moe_contract.status``).
KIND_RESIZE: Final = runtime_status.KIND_RESIZE
KIND_RECOVERY: Final = runtime_status.KIND_RECOVERY

DATE_TIME: Final[dict[str, pydantic.JsonValue]] = {"format": "date-time"}


class Condition(spec_.ApiModel):
    """A condition following the Kubernetes API conventions."""

    type: str = pydantic.Field(min_length=1, max_length=316)
    status: ConditionStatus
    reason: str = pydantic.Field(min_length=1, max_length=1024)
    message: str = pydantic.Field(default="", max_length=32768)
    last_transition_time: str = pydantic.Field(json_schema_extra=DATE_TIME)
    observed_generation: int | None = pydantic.Field(default=None, ge=0)


class ResizeStatus(spec_.ApiModel):
    """Progress of the running (or last) live resize."""

    from_size: int = pydantic.Field(ge=0)
    to_size: int = pydantic.Field(ge=0)
    stage: Stage = pydantic.Field(json_schema_extra=_RESIZE_STAGE_SCHEMA)
    started_at: str | None = pydantic.Field(default=None, json_schema_extra=DATE_TIME)
    stage_started_at: str | None = pydantic.Field(default=None, json_schema_extra=DATE_TIME)
    message: str | None = None
    # Added later (nothing above renamed):
    resize_id: str | None = pydantic.Field(
        default=None,
        max_length=256,
        description="The runtime's id of this resize, recorded right after it was asked for: "
        "a restarted operator finds the resize by it and never asks twice.",
    )
    generation: int | None = pydantic.Field(
        default=None,
        ge=0,
        description="metadata.generation of the spec this resize aims at; a Failed resize is "
        "retried only once the generation changes.",
    )
    finished_at: str | None = pydantic.Field(default=None, json_schema_extra=DATE_TIME)
    stage_durations: dict[str, float] | None = pydantic.Field(
        default=None, description="Seconds spent in each finished stage."
    )
    freed_pods: list[str] | None = pydantic.Field(
        default=None,
        description="Worker pods a scale-down released (RayCluster workersToDelete).",
    )
    kind: Literal["resize", "recovery"] | None = pydantic.Field(
        default=None,
        description="recovery: the runtime shrank around ranks it lost, by itself (no pod is "
        "released for it); otherwise a resize to the spec's size.",
    )
    retry: bool | None = pydantic.Field(
        default=None,
        description="A Failed resize that is tried again without a spec change (the runtime "
        "restarted under it).",
    )

    @pydantic.field_validator("stage")
    @classmethod
    def _a_resize_stage(cls, stage: Stage) -> Stage:
        if stage not in stages.RESIZE_STAGES:
            raise ValueError(f"{stage.value!r} is not a resize stage")
        return stage

    @property
    def active(self) -> bool:
        return self.stage not in (Stage.COMPLETED, Stage.FAILED)


class ExpertsStatus(spec_.ApiModel):
    """Expert placement as the runtime reports it."""

    balancedness: float | None = pydantic.Field(default=None, ge=0, le=1)
    redundant_experts: int | None = pydantic.Field(default=None, ge=0)


class Recommendation(spec_.ApiModel):
    """One run of equal size recommendations of the autoscaler: ``size`` from ``since`` until
    ``until`` (the sample that changed it; ``None``: still recommended)."""

    size: int = pydantic.Field(ge=0)
    since: str = pydantic.Field(json_schema_extra=DATE_TIME)
    until: str | None = pydantic.Field(default=None, json_schema_extra=DATE_TIME)


class AutoscalingStatus(spec_.ApiModel):
    """What the operator's autoscaler saw and decided (``spec.autoscaling``)."""

    metric: float | None = pydantic.Field(
        default=None, ge=0, description="In-flight sequences (running + queued) per serving rank."
    )
    desired_size: int | None = pydantic.Field(
        default=None,
        ge=0,
        description="The size the autoscaler wants now (after the stabilisation windows).",
    )
    last_decision_time: str | None = pydantic.Field(
        default=None,
        json_schema_extra=DATE_TIME,
        description="When the autoscaler last set dataParallelSize.",
    )
    reason: str | None = pydantic.Field(
        default=None, description="Why desiredSize is what it is (a CamelCase reason)."
    )
    # Added later (nothing above renamed):
    message: str | None = pydantic.Field(default=None, description="reason, in words.")
    in_flight: int | None = pydantic.Field(
        default=None, ge=0, description="Running + queued sequences of the whole deployment."
    )
    last_decision: str | None = pydantic.Field(
        default=None, description="The last size the autoscaler set, and why."
    )
    recommendations: list[Recommendation] | None = pydantic.Field(
        default=None,
        description="The stabilisation windows' memory: past recommendations that can still "
        "decide (kept here so a restarted operator decides as the last one would).",
    )


class SparesStatus(spec_.ApiModel):
    """Warm spare ranks (``spec.elastic.warmSpareRanks``) as the runtime reports them."""

    desired: int = pydantic.Field(default=0, ge=0, description="Spares the runtime keeps.")
    ready: int = pydantic.Field(
        default=0, ge=0, description="Spares loaded, warmed up and in standby groups."
    )
    pods: list[str] | None = pydantic.Field(
        default=None, description="Worker pods the spares run on (kept by every shrink)."
    )


class LoadingStatus(spec_.ApiModel):
    """The model's load while the head does not serve yet (``GET /ready`` of the runtime)."""

    bytes_loaded: int = pydantic.Field(
        default=0, ge=0, description="Bytes read so far, over every rank (in the served dtype)."
    )
    bytes_total: int = pydantic.Field(
        default=0, ge=0, description="Bytes the ranks that answered hold once loaded."
    )
    ranks_ready: int = pydantic.Field(default=0, ge=0, description="Ranks whose load is done.")
    ranks_total: int = pydantic.Field(default=0, ge=0, description="Ranks being loaded.")


class MoEDeploymentStatus(spec_.ApiModel):
    """What the operator observed; written only when more than timestamps changed."""

    observed_generation: int | None = None
    phase: Phase | None = None
    data_parallel_size: int | None = pydantic.Field(
        default=None, ge=0, description="Ranks serving now."
    )
    target_data_parallel_size: int | None = pydantic.Field(default=None, ge=0)
    tensor_parallel_size: int | None = pydantic.Field(
        default=None,
        ge=1,
        description="Devices per data-parallel rank (TP) the serving RayCluster runs.",
    )
    pipeline_parallel_size: int | None = pydantic.Field(
        default=None,
        ge=1,
        description="Pipeline stages per data-parallel rank (PP) the serving RayCluster runs.",
    )
    selector: str | None = None
    resize: ResizeStatus | None = None
    experts: ExpertsStatus | None = None
    endpoint: str | None = None
    autoscaling: AutoscalingStatus | None = None
    spares: SparesStatus | None = None
    loading: LoadingStatus | None = None
    head_restarts: int | None = pydantic.Field(
        default=None,
        ge=0,
        description="Restarts of the head pod's containers seen so far (each takes the "
        "runtime and Ray's GCS down; the operator brings the deployment back to its size).",
    )
    ray_cluster: str | None = pydantic.Field(
        default=None,
        max_length=253,
        description="The RayCluster the Service sends requests to (default: the deployment's "
        "name; a rollout moves it to the RayCluster of the new revision).",
    )
    revision: str | None = pydantic.Field(
        default=None,
        max_length=64,
        description="Template revision of rayCluster (a hash of the spec fields its pods are "
        "made from).",
    )
    rollout: rollout_.RolloutStatus | None = None
    conditions: list[Condition] | None = pydantic.Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )

    def condition(self, type_: str) -> Condition | None:
        for cond in self.conditions or ():
            if cond.type == type_:
                return cond
        return None
