"""The weight moves of a resize as executor calls (`WeightMoves`, a part of every executor):
expert staging, pre-staging and the non-expert transfer, over the members' transfer group
through `collective_rpc`, or another way where the executor has one (`Shared`: `RayExecutor`
moves weights between ranks of one node through shared memory, `ray_weights.SharedMemory`).

Each move is described by a value: `Staging` (a target placement staged on every member),
`Prestaging` (experts kept beside the live slots, ahead of a resize) and `NonExpertTransfer`
(non-expert weights from serving ranks to new ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

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


@dataclasses.dataclass(frozen=True)
class Prestaging:
    """Experts that `moves` (which index `members`, the ranks of `epoch`'s transfer group)
    bring to their destinations, kept there beside the live slots (`prestage_experts`)."""

    epoch: int
    moves: Sequence[moves_mod.ExpertMove]
    members: Sequence[int]


@dataclasses.dataclass(frozen=True)
class NonExpertTransfer:
    """Non-expert weights from `src_ranks` to `dst_ranks` (ranks of `epoch`'s transfer group
    over `members`)."""

    epoch: int
    members: Sequence[int]
    src_ranks: Sequence[int]
    dst_ranks: Sequence[int]


class Shared(Protocol):
    """Moves an executor carries another way than the transfer group (see the module
    docstring); `non_expert` answers None when it cannot carry that transfer."""

    def stage(self, staging: Staging, *, timeout: float | None, background: bool) -> int: ...

    def prestage(self, prestaging: Prestaging, *, timeout: float | None) -> int: ...

    def non_expert(self, transfer: NonExpertTransfer, *, timeout: float | None) -> int | None: ...


class WeightMoves:
    """Weight moves (see the module docstring); rpc: the executor's `collective_rpc`; shared:
    the other way it has, if any. Each returns the bytes all members received."""

    def __init__(self, rpc: Callable[..., list[Any]], *, shared: Shared | None = None) -> None:
        self._rpc = rpc
        self._shared = shared

    def stage_experts(
        self, staging: Staging, *, timeout: float | None = None, background: bool = True
    ) -> int:
        """Every member stages its slots of the target (in the background by default)."""
        if self._shared is not None:
            return self._shared.stage(staging, timeout=timeout, background=background)
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

    def prestage_experts(self, prestaging: Prestaging, *, timeout: float | None = None) -> int:
        """Every member runs its part of the moves and keeps what it receives pre-staged
        (`RankWorker`'s `prestage_experts`), in the background."""
        if self._shared is not None:
            return self._shared.prestage(prestaging, timeout=timeout)
        received = self._rpc(
            "prestage_experts",
            prestaging.epoch,
            list(prestaging.moves),
            ranks=list(prestaging.members),
            timeout=timeout,
            background=True,
        )
        return _total(received)

    def transfer_non_expert(
        self, transfer: NonExpertTransfer, *, timeout: float | None = None
    ) -> int:
        """The non-expert weights to the new ranks, in the background."""
        if self._shared is not None:
            carried = self._shared.non_expert(transfer, timeout=timeout)
            if carried is not None:
                return carried
        received = self._rpc(
            "transfer_non_expert",
            transfer.epoch,
            ranks=list(transfer.members),
            timeout=timeout,
            background=True,
            src_ranks=list(transfer.src_ranks),
            dst_ranks=list(transfer.dst_ranks),
        )
        return _total(received)


def _total(received: Sequence[Any]) -> int:
    return int(sum(int(b) for b in received))
