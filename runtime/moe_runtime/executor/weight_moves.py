"""The weight moves of a resize as executor calls (`WeightMoves`, a part of every executor):
expert staging, pre-staging and the non-expert transfer, here over the members' transfer group
through `collective_rpc`. `RayExecutor` carries the moves between ranks of one node another way
(shared memory: `ray_weights.SharedMemoryMoves`, which falls back on these for the rest)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy


@dataclasses.dataclass(frozen=True)
class Staging:
    """One staging of `target` on the members of `epoch`'s transfer group (`RankWorker`'s
    `stage_experts`): member i (a label) is rank i of that group and of the target, i >=
    new_num_ranks leaves and only sends; `moves` index members. staging_id: the id an EPLB
    commit names (None: the epoch's, activated by a switch); from_source: experts nobody holds
    any more are read from the model source (recovery)."""

    epoch: int
    moves: Sequence[moves_mod.ExpertMove]
    target: policy.Placement
    members: Sequence[int]
    new_num_ranks: int
    staging_id: int | None = None
    from_source: bool = False

    def new_rank(self, index: int) -> int | None:
        """Member `index`'s rank under the target (None: it leaves)."""
        return index if index < self.new_num_ranks else None


class WeightMoves:
    """Weight moves over the transfer group (see the module docstring); rpc: the executor's
    `collective_rpc`."""

    def __init__(self, rpc: Callable[..., list[Any]]) -> None:
        self._rpc = rpc

    def stage_experts(
        self, staging: Staging, *, timeout: float | None = None, background: bool = True
    ) -> int:
        """Every member stages its slots of the target; returns the bytes all received."""
        members = list(staging.members)
        received = self._rpc(
            "stage_experts",
            staging.epoch,
            list(staging.moves),
            staging.target,
            ranks=members,
            timeout=timeout,
            background=background,
            per_rank={r: {"new_rank": staging.new_rank(i)} for i, r in enumerate(members)},
            new_num_ranks=staging.new_num_ranks,
            stage=staging.staging_id,
            from_source=staging.from_source,
        )
        return _total(received)

    def prestage_experts(
        self,
        epoch: int,
        moves: Sequence[moves_mod.ExpertMove],
        *,
        members: Sequence[int],
        timeout: float | None = None,
    ) -> int:
        """Every member runs its part of `moves` (which index members) and keeps what it
        receives pre-staged (`RankWorker`'s `prestage_experts`), in the background; returns the
        bytes received."""
        received = self._rpc(
            "prestage_experts",
            epoch,
            list(moves),
            ranks=list(members),
            timeout=timeout,
            background=True,
        )
        return _total(received)

    def transfer_non_expert(
        self,
        epoch: int,
        *,
        members: Sequence[int],
        src_ranks: Sequence[int],
        dst_ranks: Sequence[int],
        timeout: float | None = None,
    ) -> int:
        """Non-expert weights from src_ranks to dst_ranks (ranks of epoch's transfer group
        over `members`), in the background; returns the bytes received."""
        received = self._rpc(
            "transfer_non_expert",
            epoch,
            ranks=list(members),
            timeout=timeout,
            background=True,
            src_ranks=list(src_ranks),
            dst_ranks=list(dst_ranks),
        )
        return _total(received)


def _total(received: Sequence[Any]) -> int:
    return int(sum(int(b) for b in received))
