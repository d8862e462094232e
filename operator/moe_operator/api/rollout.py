"""``status.rollout``: a template change rolling over to a second RayCluster, rank by rank
(docs/ROLLOUTS.md); its stages, and the ``Rollout`` condition's type and reasons."""

from __future__ import annotations

import enum
from typing import Final

import pydantic

from moe_operator.api import spec as spec_

DATE_TIME: Final[dict[str, pydantic.JsonValue]] = {"format": "date-time"}

CONDITION_ROLLOUT: Final = "Rollout"
REASON_ROLLING: Final = "Rolling"
REASON_ROLLED_OUT: Final = "RolledOut"
REASON_ROLLED_BACK: Final = "RolledBack"
#: Event reasons (Normal, but RolledBack).
EVENT_STARTED: Final = "RolloutStarted"
EVENT_SWITCHED: Final = "RolloutSwitched"
EVENT_RANK_MOVED: Final = "RolloutRankMoved"
EVENT_OLD_DELETED: Final = "RolloutOldDeleted"
EVENT_COMPLETED: Final = "RolloutCompleted"
EVENT_RESTARTED: Final = "RolloutRestarted"


class RolloutStage(str, enum.Enum):
    """Where a rollout stands (one value per reconcile; the resize stages of each RayCluster's
    runtime are its own, ``status.resize`` keeps describing the serving one's)."""

    #: The new RayCluster is being created (the serving one first gives up ranks when the
    #: surge does not cover the new one's first ranks); requests still go to the old one.
    STARTING = "Starting"
    #: The Service selects the new RayCluster; capacity moves one rank at a time.
    MOVING = "Moving"
    #: The old RayCluster serves no new request; its in-flight requests finish, then it goes.
    DRAINING = "Draining"
    COMPLETED = "Completed"
    #: The new RayCluster did not serve in time: deleted; the old one grows back.
    ROLLED_BACK = "RolledBack"

    @property
    def active(self) -> bool:
        return self not in (RolloutStage.COMPLETED, RolloutStage.ROLLED_BACK)


class RolloutStatus(spec_.ApiModel):
    """Progress of the running (or last) rollout."""

    from_revision: str = pydantic.Field(description="Template revision that served before.")
    to_revision: str = pydantic.Field(description="Template revision of the spec.")
    from_cluster: str = pydantic.Field(description="The RayCluster of fromRevision.")
    to_cluster: str = pydantic.Field(description="The RayCluster of toRevision.")
    stage: RolloutStage
    ranks_moved: int = pydantic.Field(
        default=0, ge=0, description="Ranks serving on the new RayCluster."
    )
    ranks_total: int = pydantic.Field(default=0, ge=0, description="dataParallelSize.")
    started_at: str | None = pydantic.Field(default=None, json_schema_extra=DATE_TIME)
    stage_started_at: str | None = pydantic.Field(default=None, json_schema_extra=DATE_TIME)
    finished_at: str | None = pydantic.Field(default=None, json_schema_extra=DATE_TIME)
    message: str | None = None
    move_cluster: str | None = pydantic.Field(
        default=None, description="The RayCluster being resized by one rank now."
    )
    move_to: int | None = pydantic.Field(default=None, ge=0, description="Its size after it.")
    drain_started_at: str | None = pydantic.Field(
        default=None,
        json_schema_extra=DATE_TIME,
        description="When the RayCluster being drained stopped getting new requests.",
    )

    @property
    def active(self) -> bool:
        return self.stage.active

    @property
    def progress(self) -> str:
        return f"{self.ranks_moved}/{self.ranks_total}"
