"""Resize stages (docs/RESIZE.md; the names are a contract): the runtime reports them in
``/elastic_ep/status``, the operator mirrors them into ``MoEDeployment.status.resize.stage``."""

from __future__ import annotations

import enum
from typing import Final


class Stage(str, enum.Enum):
    """Stages of a live resize; the names are a contract (docs/RESIZE.md)."""

    #: No resize has run yet: the runtime's ``stage`` only, never a MoEDeployment's.
    IDLE = "Idle"
    #: The operator's: RayCluster workers added, waiting for their pods (skipped by a grow
    #: that warm spares cover).
    PROVISIONING = "Provisioning"
    STANDBY = "Standby"
    TRANSFERRING = "Transferring"
    SWITCHING = "Switching"
    RESHUFFLING = "Reshuffling"
    MIGRATING = "Migrating"
    RELEASING = "Releasing"
    #: A rank died or hung: the runtime shrinks around it by itself (docs/RESIZE.md, "Failures and recovery").
    RECOVERING = "Recovering"
    COMPLETED = "Completed"
    FAILED = "Failed"


#: The stages ``status.resize.stage`` of a MoEDeployment takes (every one but ``Idle``), in
#: the order the CRD lists them.
RESIZE_STAGES: Final = tuple(s for s in Stage if s is not Stage.IDLE)

#: Stages after which a resize record no longer changes.
TERMINAL: Final = frozenset({Stage.IDLE, Stage.COMPLETED, Stage.FAILED})
