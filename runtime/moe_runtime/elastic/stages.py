"""The order each kind of resize goes through; the stage names are ``moe_contract.stages``
(docs/RESIZE.md)."""

from __future__ import annotations

from moe_contract import stages as contract

#: The stage names are the contract shared with the operator's status (``moe_contract``).
Stage = contract.Stage

SCALE_UP: tuple[Stage, ...] = (
    Stage.STANDBY,
    Stage.TRANSFERRING,
    Stage.SWITCHING,
    Stage.RESHUFFLING,
    Stage.COMPLETED,
)
"""Runtime stages of N→M with M > N (the operator puts PROVISIONING before them)."""

SCALE_UP_WARM: tuple[Stage, ...] = (
    Stage.TRANSFERRING,
    Stage.SWITCHING,
    Stage.RESHUFFLING,
    Stage.COMPLETED,
)
"""Runtime stages of N→M when warm spare ranks cover M-N: no Standby (nor Provisioning)."""

SCALE_DOWN: tuple[Stage, ...] = (
    Stage.RESHUFFLING,
    Stage.MIGRATING,
    Stage.SWITCHING,
    Stage.RELEASING,
    Stage.COMPLETED,
)
"""Runtime stages of M→N with N < M."""

RECOVERY: tuple[Stage, ...] = (Stage.RECOVERING, Stage.COMPLETED)
"""Stages of a recovery (the grow back, with autoRecover, is a normal SCALE_UP resize)."""

TERMINAL: frozenset[Stage] = contract.TERMINAL
"""Stages after which a resize record no longer changes."""


def stages_for(from_size: int, to_size: int) -> tuple[Stage, ...]:
    """The stages a resize from `from_size` to `to_size` ranks passes through, in order."""
    if to_size > from_size:
        return SCALE_UP
    if to_size < from_size:
        return SCALE_DOWN
    return (Stage.COMPLETED,)
