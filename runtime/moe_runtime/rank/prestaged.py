"""A rank's pre-staged experts (`Prestaged`, a part of `slots.ExpertSlots`): experts a future
placement will give it, fetched ahead of a resize (a warm spare, in the background:
`prestage_experts`), kept beside the live slots; `ExpertSlots.stage_experts` takes them from
there instead of moving them again, and they are forgotten when the rank is activated
(`clear`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from moe_runtime.eplb import moves as moves_mod
from moe_runtime.model import experts as experts_mod
from moe_runtime.rank import context as context_mod
from moe_runtime.rank import groups as groups_mod
from moe_runtime.rank import staging as staging_mod

if TYPE_CHECKING:
    from moe_runtime.rank import pipeline_group

log = logging.getLogger(__name__)


class Prestaged:
    """The pre-staged experts of one rank by (layer, logical). ctx, groups: the rank's (moves
    over the transfer group); stages: its pipeline stages at P > 1 (they pre-stage their
    layers' experts); held(keys): what the rank holds, with those of `keys` its mesh layout
    followers hold (what it sends)."""

    def __init__(
        self,
        ctx: context_mod.RankContext,
        *,
        groups: groups_mod.RankGroups,
        stages: pipeline_group.PipelineLeader | None,
        held: Callable[[Sequence[tuple[int, int]]], staging_mod.Experts],
    ) -> None:
        self._ctx = ctx
        self._groups = groups
        self._stages = stages
        self._held = held
        self._lock = threading.Lock()
        self.experts: dict[tuple[int, int], experts_mod.ExpertWeights] = {}

    def snapshot(self) -> dict[tuple[int, int], experts_mod.ExpertWeights]:
        with self._lock:
            return dict(self.experts)

    def clear(self) -> None:
        with self._lock:
            self.experts = {}

    def prestage_experts(
        self,
        epoch: int,
        moves: Sequence[moves_mod.ExpertMove],
        *,
        provided: Mapping[tuple[int, int], experts_mod.ExpertWeights] | None = None,
        every_move: Sequence[moves_mod.ExpertMove] | None = None,
    ) -> int:
        """Keep the experts `moves` bring to this rank (and `provided`: brought by the executor
        another way) beside the live slots, for a later `stage_experts`; returns the bytes
        received. Every member of epoch's transfer group that a move names calls it with the
        same `moves` (as `stage_experts`); a move's dst_slot is not used. every_move: the
        pre-staging's moves, also those `provided` brought (default: `moves`): at P > 1 the
        pipeline stages of every member run those of their layers (`PipelineLeader.prestage`)."""
        _, model = self._ctx.loaded.require(self._ctx.where())
        grp, me = self._groups.group(epoch, groups_mod.TRANSFER)
        every = moves if every_move is None else every_move
        # later pipeline stages' layers: not moved (`staging.run_moves`), held as the zero expert;
        # the stages move (or read) their layers' meanwhile (`PipelineLeader.prestage`)
        elsewhere = staging_mod.elsewhere(model, dtype=self._ctx.dtype, device=self._ctx.device)
        zeros = {
            (m.layer, m.logical): elsewhere[(m.layer, m.logical)]
            for m in every
            if m.dst_rank == me and (m.layer, m.logical) in elsewhere
        }
        later = any((m.layer, m.logical) in elsewhere for m in every)
        stages = self._stages if later else None
        reading = None if stages is None else stages.prestage(sorted(zeros), epoch, every)
        ctx = self._ctx
        held = self._held([(m.layer, m.logical) for m in moves if m.src_rank == me])
        stats, received = staging_mod.run_moves(
            grp, moves, held, model, dtype=ctx.dtype, device=ctx.device, where=ctx.where()
        )
        if stages is not None:
            stages.finish_prefetch(reading)  # reads ahead of a switch, as a prefetch's
        extra = {
            k: w.to(dtype=self._ctx.dtype, device=self._ctx.device)
            for k, w in (provided or {}).items()
        }
        with self._lock:
            self.experts.update(zeros)
            self.experts.update(received)
            self.experts.update(extra)
            count = len(self.experts)
        got = len(received) + len(extra) + len(zeros)
        log.log(
            logging.INFO if got else logging.DEBUG,
            "pre-staged %d experts (%d held now) (%s)",
            got,
            count,
            self._ctx.where(),
        )  # none: a sender (its stages' moves)
        return stats.bytes_received

    def prestaged_keys(self) -> list[tuple[int, int]]:
        """The (layer, logical) keys of the pre-staged experts."""
        with self._lock:
            return sorted(self.experts)

    def drop_prestaged(self, keep: Sequence[tuple[int, int]] = ()) -> int:
        """Forget the pre-staged experts not in `keep`; returns how many are left."""
        wanted = {(int(a), int(b)) for a, b in keep}
        if self._stages is not None:
            self._stages.drop_prestaged(sorted(wanted))
        with self._lock:
            self.experts = {k: w for k, w in self.experts.items() if k in wanted}
            return len(self.experts)
