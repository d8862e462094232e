"""Weight moves between `RayExecutor`'s rank actors (`SharedMemory`, the other way its
`weight_moves.WeightMoves` has).

Between ranks of one Ray node (CPU) the weights go through Ray's object store (`ray_transfer`:
shared memory, one copy in and one out); the other expert moves go over the transfer group in
the same call of each member (`RankActor.stage_experts_shared`); a non-expert transfer whose
receivers have no sender on their node, or whose DP ranks are several processes (TP
followers, pipeline stages: each gets its tensors over groups of its own,
`RankGroups.transfer_non_expert`), is left to the transfer group (`non_expert` answers None).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from moe_runtime.eplb import moves as moves_mod
from moe_runtime.executor import ray_actor, ray_calls, ray_transfer, roster, weight_moves

log = logging.getLogger(__name__)

MemberCall = Callable[[Any, int, dict[str, Any], list[Any], list[Any]], Any]


class SharedMemory:
    """Weight moves through shared memory where ranks share a node (see the module docstring).

    members: the executor's roster; enabled: whether co-located ranks use the object store at
    all (not on GPUs: NCCL); the experts still go through each member's one call then;
    pipelined: DP ranks have pipeline stages (P > 1), which move their layers' experts
    between themselves in every member's call (so every member is called); split: a DP rank
    is several processes (T > 1 or P > 1), each of which gets its own non-expert tensors
    from its peers over groups of their own (so a non-expert transfer is the group's).
    """

    def __init__(
        self,
        *,
        members: roster.Roster[ray_actor.RankHandle],
        enabled: bool,
        pipelined: bool = False,
        split: bool = False,
    ) -> None:
        self._members = members
        self.enabled = enabled
        self.pipelined = pipelined
        self.split = split or pipelined

    # -- weight moves ----------------------------------------------------------------------
    def _actors_and_nodes(self, labels: Sequence[int]) -> tuple[dict[int, Any], dict[int, str]]:
        members = self._members.targets("weights", labels)
        actors = {m.label: m.handle.actor for m in members}
        nodes = {m.label: str(m.info["node_id"]) for m in members}
        return actors, nodes

    def stage(
        self, staging: weight_moves.Staging, *, timeout: float | None, background: bool
    ) -> int:
        def call(
            actor: Any, i: int, lane: dict[str, Any], rest: list[Any], parts: list[Any]
        ) -> Any:
            return actor.stage_experts_shared.options(**lane).remote(
                staging.epoch,
                rest,
                staging.target,
                parts,
                every_move=list(staging.moves),
                new_rank=staging.new_rank(i),
                new_num_ranks=staging.new_num_ranks,
                stage=staging.staging_id,
                from_source=staging.from_source,
            )

        return self._move_experts(
            "stage_experts",
            staging.epoch,
            staging.moves,
            members=list(staging.members),
            call_all=True,
            timeout=timeout,
            background=background,
            call=call,
        )

    def prestage(self, prestaging: weight_moves.Prestaging, *, timeout: float | None) -> int:
        epoch = prestaging.epoch

        def call(
            actor: Any, _i: int, lane: dict[str, Any], rest: list[Any], parts: list[Any]
        ) -> Any:
            # every move, also those the exports leave out (a later pipeline stage's layers,
            # which the members' stages move between themselves)
            return actor.prestage_experts_shared.options(**lane).remote(
                epoch, rest, parts, list(prestaging.moves)
            )

        return self._move_experts(
            "prestage_experts",
            epoch,
            prestaging.moves,
            members=list(prestaging.members),
            call_all=self.pipelined,  # the senders' stages send too
            timeout=timeout,
            background=True,
            call=call,
        )

    def _move_experts(
        self,
        what: str,
        epoch: int,
        moves: Sequence[moves_mod.ExpertMove],
        *,
        members: list[int],
        call_all: bool,
        timeout: float | None,
        background: bool,
        call: MemberCall,
    ) -> int:
        """The moves between co-located members through the object store (exports on the
        senders' `EXPORT_LANE`), the rest over epoch's transfer group; `call(actor, member
        index, its lane options, the other moves, export refs for it)` starts each member's part. Members are
        all called (`call_all`, or when some moves use the transfer group), else only the
        destinations of the moves. Returns the bytes received."""
        actors, nodes = self._actors_and_nodes(members)
        if self.enabled:
            shared, rest = ray_transfer.split_moves(moves, members, nodes.__getitem__)
        else:
            shared, rest = {}, list(moves)
        lane: dict[str, Any] = {"concurrency_group": ray_actor.CTL_LANE} if background else {}
        export = {"concurrency_group": ray_actor.EXPORT_LANE}
        started = time.monotonic()
        refs = [
            (pair, actors[pair[0]].export_experts.options(**export).remote(keys))
            for pair, keys in ray_transfer.exporters(shared)
        ]
        if call_all or rest:
            called = list(members)
        else:
            wanted = {dst for (_, dst) in shared}
            called = [r for r in members if r in wanted]
        calls = [
            call(actors[r], i, lane, rest, ray_transfer.received_by(refs, r))
            for i, r in enumerate(members)
            if r in called
        ]
        received = ray_calls.get_all(calls, called, what=what, timeout=timeout)
        log.info(
            "%s on ranks %s in %.2fs: %d moves through shared memory (%d exports), %d over the "
            "transfer group of epoch %d",
            what,
            called,
            time.monotonic() - started,
            sum(len(m) for m in shared.values()),
            len(refs),
            len(rest),
            epoch,
        )
        return int(sum(int(b) for b in received))

    def non_expert(
        self, transfer: weight_moves.NonExpertTransfer, *, timeout: float | None
    ) -> int | None:
        members = list(transfer.members)
        actors, nodes = self._actors_and_nodes(members)
        senders = [members[i] for i in transfer.src_ranks]
        receivers = [members[i] for i in transfer.dst_ranks]
        local = {r: next((s for s in senders if nodes[s] == nodes[r]), None) for r in receivers}
        if not self.enabled or self.split or any(s is None for s in local.values()):
            return None  # the transfer group carries it (a split rank's other processes too)
        lane = {"concurrency_group": ray_actor.CTL_LANE}
        exports = {
            s: actors[s].export_non_expert.options(**lane).remote()
            for s in set(local.values())
            if s is not None
        }
        calls = [
            actors[r].load_non_expert_shared.options(**lane).remote(exports[s])
            for r, s in local.items()
            if s is not None
        ]
        received = ray_calls.get_all(calls, receivers, what="load_non_expert", timeout=timeout)
        return int(sum(int(b) for b in received))
