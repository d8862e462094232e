"""``MoEDeployment.spec``: what the user asks for (README.md, "The MoEDeployment, field by field").

Every model forbids unknown fields; the CRD generated from these models makes the API server
prune and (with ``--validate=strict``) refuse them. CEL rules attached with ``json_schema_extra``
land in the CRD as ``x-kubernetes-validations``; the same rules are checked again in Python
(``model_validator``) so the operator never acts on a spec the API server would refuse.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Union

import pydantic
from pydantic import alias_generators

from moe_operator.api import mesh, storage

#: Largest data-parallel size the schema accepts (bounds CEL cost estimates too).
MAX_DATA_PARALLEL_SIZE = 1024
#: The runtime image `make images` builds (images/runtime/Dockerfile).
DEFAULT_IMAGE = "ghcr.io/elastic-moe/runtime:0.1.0"

Accelerator = Literal["cpu", "nvidia.com/gpu"]
MESH_LAYOUT_NEEDS: Final = "expertLayout mesh needs tensorParallelSize > 1"
ACCELERATOR_CPU: Final = "cpu"
ACCELERATOR_NVIDIA_GPU: Final = "nvidia.com/gpu"

#: A Kubernetes resource quantity (``"2"``, ``"500m"``, ``"4Gi"`` or an integer).
Quantity = Union[int, str]


def defaulted(model: type[Any]) -> Any:
    """A sub-object field that defaults to ``model()``; the CRD gets ``default: {}`` so the API
    server fills in the sub-object's own defaults too."""
    return pydantic.Field(default_factory=model, json_schema_extra={"default": {}})


class ApiModel(pydantic.BaseModel):
    """Base of every spec/status model: camelCase on the wire, unknown fields refused."""

    model_config = pydantic.ConfigDict(
        extra="forbid",
        alias_generator=alias_generators.to_camel,
        populate_by_name=True,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as the API server stores it (camelCase, ``None`` fields left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ModelSpec(ApiModel):
    """Which checkpoint to serve."""

    source: str = pydantic.Field(
        min_length=1,
        max_length=4096,
        description=(
            "synthetic://NAME?seed=N; pvc://CLAIM/PATH: the directory PATH of the "
            "PersistentVolumeClaim CLAIM in the deployment's namespace, mounted read-only in "
            "the head and every worker; or a directory inside the image. The directory holds "
            "a Hugging Face checkpoint of a supported family (Mixtral, Qwen2-MoE, Qwen3-MoE, "
            "OLMoE, DeepSeek-V2/V3, gpt-oss) as save_pretrained writes it (config.json + "
            "*.safetensors). A change rolls the deployment over to a new RayCluster, rank by "
            "rank (docs/ROLLOUTS.md)."
        ),
        json_schema_extra={"x-kubernetes-validations": [*storage.CEL_RULES]},
    )
    served_model_name: str | None = pydantic.Field(
        default=None,
        min_length=1,
        max_length=253,
        description="Name of the model in the OpenAI-compatible API (default: the deployment name).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = pydantic.Field(
        default="auto",
        description=(
            "Serving dtype. auto: the checkpoint's (config.json dtype / torch_dtype), else "
            "bfloat16 on GPUs and float32 on CPUs; a synthetic model on nvidia.com/gpu workers "
            "is served in bfloat16."
        ),
    )
    load_timeout_seconds: int = pydantic.Field(
        default=1800,
        ge=30,
        le=86_400,
        description=(
            "How long the head may take to load the model and start serving before Kubernetes "
            "restarts it (the head's startupProbe)."
        ),
    )

    @pydantic.field_validator("source")
    @classmethod
    def _pvc_source(cls, value: str) -> str:
        storage.parse_pvc(value)  # ValueError naming what is wrong (the CRD's CEL rules)
        return value


class EplbSpec(ApiModel):
    """Expert-parallel load balancer settings."""

    enabled: bool = pydantic.Field(default=True, description="Rebalance experts from live load.")
    window_size: int = pydantic.Field(
        default=1000, ge=1, le=1_000_000, description="Steps of expert load kept in the window."
    )
    step_interval: int = pydantic.Field(
        default=3000, ge=1, le=10_000_000, description="Steps between two rebalances."
    )


class ExpertParallelSpec(ApiModel):
    """How experts are spread over the ranks."""

    num_redundant_experts: int = pydantic.Field(
        default=0, ge=0, le=4096, description="Extra physical expert slots for hot experts."
    )
    eplb: EplbSpec = defaulted(EplbSpec)
    max_experts_per_rank: int | None = pydantic.Field(
        default=None,
        ge=1,
        le=1_000_000,
        description=(
            "Expert slots one rank can hold (memory). A size whose ranks would need more "
            "(ceil((experts + redundant) / size)) is refused by the runtime."
        ),
    )


class ElasticSpec(ApiModel):
    """Timeouts of live resizes."""

    drain_timeout_seconds: int = pydantic.Field(
        default=120,
        ge=0,
        le=86_400,
        description=(
            "How long a shrink lets the sequences on departing ranks finish there before it "
            "migrates the rest to the survivors (re-prefilled from prompt + generated tokens; "
            "none is aborted). 0: migrate at once."
        ),
    )
    resize_timeout_seconds: int = pydantic.Field(default=600, ge=1, le=86_400)
    warm_spare_ranks: int = pydantic.Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "Rank workers kept started beside the serving ones (a worker pod each, non-expert "
            "weights loaded, warmed up, in standby communication groups), so a grow by up to "
            "this many skips Provisioning and Standby. The RayCluster has dataParallelSize + "
            "this many workers; a spare a grow took is replaced. Changes apply live."
        ),
    )


class FaultToleranceSpec(ApiModel):
    """What to do when a rank dies."""

    auto_recover: bool = pydantic.Field(
        default=True, description="Replace dead ranks (or shrink) without user action."
    )


class AutoscalingSpec(ApiModel):
    """The operator's own load-driven size policy (off by default): HPA's algorithm and
    stabilisation windows over the runtime's in-flight sequences, within
    ``[minDataParallelSize, maxDataParallelSize]``, written through the scale subresource."""

    enabled: bool = pydantic.Field(
        default=False,
        description="Let the operator set dataParallelSize from the load. It stands down while "
        "a HorizontalPodAutoscaler (or a KEDA ScaledObject, which makes one) targets this "
        "deployment.",
    )
    target_in_flight_per_rank: int = pydantic.Field(
        default=8,
        ge=1,
        le=100_000,
        description="Running + queued sequences per DP rank the size aims at: desired = "
        "ceil(in-flight / target).",
    )
    scale_up_stabilization_seconds: int = pydantic.Field(
        default=15,
        ge=0,
        le=3600,
        description="A grow needs every recommendation of this window above the current size "
        "(it takes the lowest).",
    )
    scale_down_stabilization_seconds: int = pydantic.Field(
        default=120,
        ge=0,
        le=3600,
        description="A shrink needs every recommendation of this window below the current size "
        "(it takes the highest).",
    )
    tolerance: float = pydantic.Field(
        default=0.1,
        ge=0,
        le=1,
        description="No change while in-flight per rank is within this fraction of the target "
        "(HPA's --horizontal-pod-autoscaler-tolerance).",
    )
    sync_period_seconds: int = pydantic.Field(
        default=5,
        ge=1,
        le=300,
        description="How often the operator reads the runtime's load and decides.",
    )


class ResourceRequirements(ApiModel):
    """Container resources (a subset of core/v1 ResourceRequirements)."""

    requests: dict[str, Quantity] | None = None
    limits: dict[str, Quantity] | None = None


class Toleration(ApiModel):
    """A core/v1 Toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(ApiModel):
    """An environment variable of the Ray containers (head and workers)."""

    name: str = pydantic.Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
    )
    value: str = pydantic.Field(default="", max_length=32_768)


class RaySpec(ApiModel):
    """The RayCluster the deployment runs on."""

    image: str = pydantic.Field(default=DEFAULT_IMAGE, min_length=1, max_length=1024)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    accelerator: Accelerator = pydantic.Field(
        default="cpu",
        description=(
            "nvidia.com/gpu gives each worker pod (one per data-parallel rank) "
            "tensorParallelSize x pipelineParallelSize GPUs."
        ),
    )
    head_resources: ResourceRequirements | None = None
    worker_resources: ResourceRequirements | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] | None = None
    service_account_name: str | None = pydantic.Field(default=None, max_length=253)
    shared_memory_size: Quantity = pydantic.Field(
        default="1Gi",
        description=(
            "Size of /dev/shm in the Ray pods (Ray's object store; NCCL on GPUs): a memory-backed "
            "emptyDir, since a container's own /dev/shm is 64 MiB."
        ),
    )
    env: list[EnvVar] | None = pydantic.Field(
        default=None,
        max_length=64,
        description=(
            "Extra environment of the head and worker containers (e.g. NCCL settings, "
            "MOE_STEP_MODE=remote where ranks outnumber CPU cores)."
        ),
    )


class RolloutSpec(ApiModel):
    """How a change that needs new pods (the image, the model source, the pods' resources,
    env, placement, dtype: ``plan.revision``) rolls over: a second RayCluster beside the
    serving one, capacity moved rank by rank (docs/ROLLOUTS.md)."""

    max_surge_ranks: int = pydantic.Field(
        default=0,
        ge=0,
        le=MAX_DATA_PARALLEL_SIZE,
        description=(
            "Ranks a rollout may run beyond dataParallelSize while it moves capacity (the new "
            "RayCluster's head comes on top). The new RayCluster starts at "
            "max(minDataParallelSize, min(maxSurgeRanks, dataParallelSize)) ranks; with 0 the "
            "serving one first gives up as many (at least 1 surge rank when it serves at "
            "minDataParallelSize already)."
        ),
    )
    ready_timeout_seconds: int = pydantic.Field(
        default=600,
        ge=10,
        le=86_400,
        description=(
            "How long the new RayCluster may take to serve; after that the rollout is rolled "
            "back (the new RayCluster deleted, the serving one grown back) and the Rollout "
            "condition says why. Retried only for another template."
        ),
    )
    paused: bool = pydantic.Field(
        default=False,
        description="Hold a rollout where it is (no rank moves, no rollback) until unset.",
    )


_SPEC_RULES: list[pydantic.JsonValue] = [
    {
        "rule": "self.minDataParallelSize <= self.maxDataParallelSize",
        "message": "minDataParallelSize must be less than or equal to maxDataParallelSize",
        "fieldPath": ".minDataParallelSize",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.dataParallelSize >= self.minDataParallelSize",
        "message": "dataParallelSize must be at least minDataParallelSize",
        "fieldPath": ".dataParallelSize",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.dataParallelSize <= self.maxDataParallelSize",
        "message": "dataParallelSize must be at most maxDataParallelSize",
        "fieldPath": ".dataParallelSize",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.elastic) || !has(self.elastic.warmSpareRanks) || "
        "self.elastic.warmSpareRanks <= self.maxDataParallelSize",
        "message": "elastic.warmSpareRanks must be at most maxDataParallelSize (a grow never "
        "uses more spares)",
        "fieldPath": ".elastic.warmSpareRanks",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.expertLayout) || self.expertLayout != 'mesh' || "
        "self.tensorParallelSize > 1",
        "message": MESH_LAYOUT_NEEDS,
        "fieldPath": ".expertLayout",
        "reason": "FieldValueInvalid",
    },
    *mesh.FIT_RULES,
]


class MoEDeploymentSpec(ApiModel):
    """What the user asks for: the model, the data-parallel size and its bounds, and how to run it."""

    model_config = pydantic.ConfigDict(json_schema_extra={"x-kubernetes-validations": _SPEC_RULES})

    model: ModelSpec
    data_parallel_size: int = pydantic.Field(
        ge=1,
        le=MAX_DATA_PARALLEL_SIZE,
        description="DP ranks (one worker pod each); the expert-parallel size is DP x TP.",
    )
    min_data_parallel_size: int = pydantic.Field(default=1, ge=1, le=MAX_DATA_PARALLEL_SIZE)
    max_data_parallel_size: int = pydantic.Field(default=8, ge=1, le=MAX_DATA_PARALLEL_SIZE)
    tensor_parallel_size: int = pydantic.Field(
        default=1,
        ge=1,
        le=mesh.MAX_TENSOR_PARALLEL_SIZE,
        description=(
            "Devices per data-parallel rank that shard its attention and dense layers (one "
            "rank actor each, in the rank's one worker pod); the expert-parallel size is DP x "
            "TP. A change rolls the deployment over (docs/ROLLOUTS.md)."
        ),
    )
    pipeline_parallel_size: int = pydantic.Field(
        default=1,
        ge=1,
        le=mesh.MAX_PIPELINE_PARALLEL_SIZE,
        description=(
            "Pipeline stages per data-parallel rank: the decoder layers split into this many "
            "contiguous stages, one rank actor each, in the rank's one worker pod (it holds "
            "TP x PP devices). A change rolls the deployment over (docs/ROLLOUTS.md)."
        ),
    )
    pipeline_micro_batch_tokens: int | None = pydantic.Field(
        default=None,
        ge=0,
        le=1_000_000,
        description=(
            "At pipelineParallelSize > 1: a step whose busiest data-parallel rank has at least "
            "this many new tokens (a prefill) goes through the stages as micro-batches, the "
            "stages working at once; 0: every step whole. Unset: the runtime's default (256). "
            "A change rolls the deployment over (docs/ROLLOUTS.md)."
        ),
    )
    pipeline_interleave: bool | None = pydantic.Field(
        default=None,
        description=(
            "At pipelineParallelSize > 1: consecutive steps take alternate halves of the "
            "running sequences, a step's first stage running while the step before is in the "
            "later stages (vLLM's virtual engines; docs/PIPELINE-PARALLEL.md). Unset: the "
            "runtime's default. A change rolls the deployment over (docs/ROLLOUTS.md)."
        ),
    )
    expert_layout: Literal["leader", "mesh"] | None = pydantic.Field(
        default=None,
        description=(
            "At tensorParallelSize > 1, where the routed experts live: on each data-parallel "
            "rank's first device (leader), or a part of its expert slots on each of its "
            "devices, the expert-parallel group being every device of every rank (mesh; at "
            "pipelineParallelSize > 1 per stage; docs/TENSOR-PARALLEL.md). Unset: the runtime's "
            "default (leader). A change rolls the deployment over (docs/ROLLOUTS.md)."
        ),
    )
    max_queued_requests: int = pydantic.Field(
        default=1024,
        ge=0,
        le=1_000_000,
        description=(
            "Requests the runtime queues before it answers 429 with Retry-After (0: no bound). "
            "Never applied to requests that arrive during a resize: those always queue."
        ),
    )
    expert_parallel: ExpertParallelSpec = defaulted(ExpertParallelSpec)
    elastic: ElasticSpec = defaulted(ElasticSpec)
    fault_tolerance: FaultToleranceSpec = defaulted(FaultToleranceSpec)
    autoscaling: AutoscalingSpec = defaulted(AutoscalingSpec)
    ray: RaySpec = defaulted(RaySpec)
    rollout: RolloutSpec = defaulted(RolloutSpec)

    @pydantic.model_validator(mode="after")
    def _sizes_consistent(self) -> MoEDeploymentSpec:
        workers = self.ray.worker_resources
        mesh.check_fit(
            devices=self.devices_per_rank,
            accelerator=self.ray.accelerator,
            requests=workers.requests if workers is not None else None,
            limits=workers.limits if workers is not None else None,
        )
        if self.min_data_parallel_size > self.max_data_parallel_size:
            raise ValueError(
                "minDataParallelSize must be less than or equal to maxDataParallelSize "
                f"(got {self.min_data_parallel_size} > {self.max_data_parallel_size})"
            )
        if not (
            self.min_data_parallel_size <= self.data_parallel_size <= self.max_data_parallel_size
        ):
            raise ValueError(
                f"dataParallelSize must be within [minDataParallelSize, maxDataParallelSize] = "
                f"[{self.min_data_parallel_size}, {self.max_data_parallel_size}] "
                f"(got {self.data_parallel_size})"
            )
        if self.expert_layout == "mesh" and self.tensor_parallel_size == 1:
            raise ValueError(f"{MESH_LAYOUT_NEEDS} (got tensorParallelSize 1)")
        if self.elastic.warm_spare_ranks > self.max_data_parallel_size:
            raise ValueError(
                "elastic.warmSpareRanks must be at most maxDataParallelSize (a grow never uses "
                f"more spares; got {self.elastic.warm_spare_ranks} > "
                f"{self.max_data_parallel_size})"
            )
        return self

    @property
    def devices_per_rank(self) -> int:
        """Devices (rank actors) of one data-parallel rank: T x P, all in its worker pod."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def wants_gpus(self) -> bool:
        return self.ray.accelerator == ACCELERATOR_NVIDIA_GPU
