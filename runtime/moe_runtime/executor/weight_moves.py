"""The weight moves of a resize as executor calls (inherited by `base.Executor`): expert
staging and the non-expert transfer, done here over the transfer group through
`collective_rpc`; an executor may carry some of them another way (`RayExecutor`: shared
memory between ranks of one node, `ray_weights`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class WeightMoves:
    """Default weight moves over the transfer group (see the module docstring)."""

    def collective_rpc(
        self,
        method: str,
        *args: Any,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        background: bool = False,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        raise NotImplementedError

    def stage_experts(
        self,
        epoch: int,
        moves: Sequence[Any],
        target: Any,
        *,
        members: Sequence[int],
        new_num_ranks: int,
        staging_id: int | None = None,
        timeout: float | None = None,
        background: bool = True,
        from_source: bool = False,
    ) -> int:
        """Every member stages its slots of `target` (`RankWorker.stage_experts`): member i is
        rank i of epoch's transfer group and of the target (i >= new_num_ranks leaves and only
        sends); `moves` index members. Returns the bytes all members received. Here over the
        transfer group; an executor may carry some moves another way (`RayExecutor`: shared
        memory between ranks of one node)."""
        received = self.collective_rpc(
            "stage_experts",
            epoch,
            list(moves),
            target,
            ranks=list(members),
            timeout=timeout,
            background=background,
            per_rank={
                r: {"new_rank": (i if i < new_num_ranks else None)} for i, r in enumerate(members)
            },
            new_num_ranks=new_num_ranks,
            stage=staging_id,
            from_source=from_source,
        )
        return int(sum(int(b) for b in received))

    def prestage_experts(
        self,
        epoch: int,
        moves: Sequence[Any],
        *,
        members: Sequence[int],
        timeout: float | None = None,
    ) -> int:
        """Every member runs its part of `moves` (which index members) and keeps what it
        receives pre-staged (`RankWorker.prestage_experts`), in the background; returns the
        bytes received. Here over epoch's transfer group (every member is called)."""
        received = self.collective_rpc(
            "prestage_experts",
            epoch,
            list(moves),
            ranks=list(members),
            timeout=timeout,
            background=True,
        )
        return int(sum(int(b) for b in received))

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
        over `members`, in the background); returns the bytes received."""
        received = self.collective_rpc(
            "transfer_non_expert",
            epoch,
            ranks=list(members),
            timeout=timeout,
            background=True,
            src_ranks=list(src_ranks),
            dst_ranks=list(dst_ranks),
        )
        return int(sum(int(b) for b in received))
