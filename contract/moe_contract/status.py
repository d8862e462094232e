"""The body of ``GET /elastic_ep/status`` (docs/RUNTIME.md): built by the runtime
(``moe_runtime.elastic.service.ElasticService.status``), read by the operator
(``moe_operator.plan.observe.runtime``) and by the operator tests' fake runtime.

The keys are snake_case, like vLLM's. A reader tolerates what it does not know (an operator
may talk to a newer or older runtime: unknown keys are ignored, missing ones take the
defaults below, which say how an older runtime is read). The runtime builds the payload
strictly: :meth:`Payload.exact` refuses a key these models do not declare, so a field renamed
on one side only fails the runtime's own tests instead of vanishing from the payload.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, TypeVar

import pydantic

#: ``kind`` of a resize record: asked for (``POST /scale_elastic_ep``), or the runtime's own
#: shrink around lost ranks.
KIND_RESIZE: Final = "resize"
KIND_RECOVERY: Final = "recovery"
#: ``trigger`` of a resize record.
TRIGGER_API: Final = "api"
TRIGGER_AUTO_RECOVER: Final = "auto_recover"
TRIGGER_RANK_LOST: Final = "rank_lost"

#: ``model_validate(..., context={EXACT: True})`` refuses unknown keys (see :meth:`Payload.exact`).
EXACT: Final = "moe_contract_exact"

P = TypeVar("P", bound="Payload")


class Payload(pydantic.BaseModel):
    """Base of every part of the payload: unknown keys ignored when read, refused when built."""

    model_config = pydantic.ConfigDict(extra="ignore", populate_by_name=True)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any, info: pydantic.ValidationInfo) -> Any:
        if not isinstance(data, Mapping) or not (info.context or {}).get(EXACT):
            return data
        if cls.model_config.get("extra") == "allow":
            return data
        known = set(cls.model_fields) | {
            f.alias for f in cls.model_fields.values() if f.alias is not None
        }
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {unknown} (moe_contract.status)")
        return data

    @classmethod
    def exact(cls: type[P], data: Any) -> P:
        """Validate ``data`` refusing any key the contract does not declare (the runtime's
        side: what it sends must be what the operator reads)."""
        return cls.model_validate(data, context={EXACT: True})

    def to_json(self) -> dict[str, Any]:
        """The JSON object as sent (aliases, every field)."""
        return self.model_dump(mode="json", by_alias=True)


class StageTiming(Payload):
    """One stage of a resize: wall-clock start (``time.time()``) and duration in seconds
    (``None`` while it runs)."""

    stage: str
    started_at: float | None = None
    duration_s: float | None = None


class BytesMoved(Payload):
    non_expert: int = 0
    expert: int = 0


class Balancedness(Payload):
    """Mean over max tokens per EP rank before and after a resize (1 = perfect)."""

    before: float | None = None
    after: float | None = None


class FreedRank(Payload):
    """A rank a shrink (or recovery) released: the executor's rank info as it reports it
    (pid, host, ip, device, epoch, ... are kept as they come); the operator reads ``pod``."""

    model_config = pydantic.ConfigDict(extra="allow")

    rank: int | None = None
    pod: str | None = None


class LostRank(Payload):
    """A rank a recovery lost (labels before the recovery)."""

    rank: int | None = None
    pod: str | None = None
    node_id: str | None = None
    pid: int | None = None
    reason: str | None = None


class ExpertsRestored(Payload):
    """Where a recovery got the experts only the lost ranks held."""

    from_replicas: int = 0
    from_source: int = 0
    from_retained: int = 0


class Recovery(Payload):
    """What a recovery (kind ``recovery``) did; wall-clock times."""

    last_heartbeat_at: float | None = None
    detected_at: float | None = None
    recovered_at: float | None = None
    detection_s: float | None = None
    recovery_s: float | None = None
    ranks_lost: list[LostRank] = pydantic.Field(default_factory=list)
    experts_restored: ExpertsRestored = pydantic.Field(default_factory=ExpertsRestored)
    requests_rerun: int = 0


class Resize(Payload):
    """One resize (or recovery) record: ``resize`` (the running one, else the last) and the
    entries of ``history``."""

    resize_id: str
    kind: str = KIND_RESIZE
    trigger: str = TRIGGER_API
    from_size: int = pydantic.Field(alias="from")
    to_size: int = pydantic.Field(alias="to")
    #: A :class:`moe_contract.stages.Stage` value (a string here: an older operator reads a
    #: stage it does not know as "not one of mine" instead of failing).
    stage: str
    started_at: float | None = None
    stage_started_at: float | None = None
    finished_at: float | None = None
    duration_s: float | None = None
    message: str = ""
    stages: list[StageTiming] = pydantic.Field(default_factory=list)
    bytes_moved: BytesMoved = pydantic.Field(default_factory=BytesMoved)
    expert_moves: int = 0
    expert_moves_lower_bound: int = 0
    experts_prestaged: int = 0
    experts_retained: int = 0
    blackout_s: float = 0.0
    balancedness: Balancedness = pydantic.Field(default_factory=Balancedness)
    freed: list[FreedRank] = pydantic.Field(default_factory=list)
    sequences_migrated: int = 0
    drain_timeout_s: float = 0.0
    sequences_drained: int = 0
    switch_pause_s: float | None = None
    warm_spares: int = 0
    recovery: Recovery | None = None


class Rank(Payload):
    """A rank of ``ranks``: a serving (``active``) or pending one, or one lost since the
    runtime last served at its full size (``rank`` ``None``, ``lost_rank`` its old label,
    ``healthy`` false). An older runtime said neither ``active`` nor ``healthy``: both default
    to true."""

    rank: int | None = None
    lost_rank: int | None = None
    active: bool = True
    node_id: str | None = None
    pod: str | None = None
    pid: int | None = None
    #: The processes of the rank's tensor-parallel followers (TP ranks 1..T-1; ``pid`` is
    #: its leader's), empty at tensor-parallel size 1.
    tp_pids: list[int] = pydantic.Field(default_factory=list)
    #: The processes of the rank's pipeline stages 1..P-1 (``pid`` is stage 0's, its
    #: leader), empty at pipeline-parallel size 1.
    pp_pids: list[int] = pydantic.Field(default_factory=list)
    healthy: bool = True
    #: The executor's heartbeat state (``ok``, ``dead``, ``unresponsive``, ...).
    state: str | None = None
    num_experts: int | None = None


class Prestaged(Payload):
    """Of a warm spare: experts it holds of those it would hold in its next grow's target."""

    held: int = 0
    wanted: int = 0


class Spare(Payload):
    """A warm spare rank (``spares``): started, loaded, outside the step graph."""

    rank: int | None = None
    pod: str | None = None
    node_id: str | None = None
    pid: int | None = None
    #: Its tensor-parallel followers' processes (TP ranks 1..T-1 of each pipeline stage,
    #: started and loaded with its leader ``pid``: a spare is a whole DP rank), empty at
    #: tensor-parallel size 1.
    tp_pids: list[int] = pydantic.Field(default_factory=list)
    #: Its pipeline stages 1..P-1's processes, empty at pipeline-parallel size 1.
    pp_pids: list[int] = pydantic.Field(default_factory=list)
    healthy: bool = True
    ready: bool = False
    prestaged: Prestaged | None = None


class AutoRecover(Payload):
    """``auto_recover``: whether the runtime grows back by itself after a loss, and to what."""

    enabled: bool = False
    target: int | None = None


class Load(Payload):
    """``load``: engine sequences. An older runtime said ``running`` and ``waiting`` only."""

    running: int | None = None
    waiting: int | None = None
    in_flight: int | None = None


class Eplb(Payload):
    balancedness: float | None = None
    num_physical_experts: int | None = None
    rebalances: int | None = None
    #: The last periodic rebalance's figures (before, after, applied, moves, ...), as it
    #: reports them.
    last_rebalance: dict[str, Any] | None = None


class ElasticStatus(Payload):
    """``GET /elastic_ep/status``."""

    data_parallel_size: int
    #: ``None`` (an older runtime): the serving size.
    target_data_parallel_size: int | None = None
    is_scaling: bool = False
    #: The running resize's stage, else the last one's (``Idle``: none ran).
    stage: str | None = None
    resize: Resize | None = None
    history: list[Resize] = pydantic.Field(default_factory=list)
    ranks: list[Rank] = pydantic.Field(default_factory=list)
    #: Whether a step path serves (``GET /ready``), and why not.
    ready: bool | None = None
    ready_reason: str | None = None
    auto_recover: AutoRecover | None = None
    warm_spare_ranks: int = 0
    spares: list[Spare] = pydantic.Field(default_factory=list)
    load: Load | None = None
    eplb: Eplb | None = None
