"""What a rank serves with, as values: the live state (`Live`: kept whole as the previous
state when a change replaces it), a staged slot set (`Staged`), and the expert-parallel backend
over a step group (`make_backend`). `slots.ExpertSlots` holds them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from moe_runtime.comm import ep as ep_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.model import experts as experts_mod


@dataclasses.dataclass
class Staged:
    """Expert slots prepared for a future placement; the live slots keep serving meanwhile."""

    stage: int
    placement: policy.Placement
    rank: int
    num_ranks: int
    experts: dict[tuple[int, int], experts_mod.ExpertWeights]


@dataclasses.dataclass(frozen=True)
class Live:
    """What a rank serves with, as one value: kept as the previous state when it is replaced.

    origin: the epoch (`activate`) or staging id (EPLB commit) this state came from.
    """

    placement: policy.Placement | None
    rank: int | None
    num_ranks: int | None
    experts: dict[tuple[int, int], experts_mod.ExpertWeights]
    epoch: int | None
    backend: experts_mod.ExpertBackend | None
    origin: int | None

    def serves(self, placement: policy.Placement, rank: int, num_ranks: int) -> bool:
        return (
            self.placement is not None
            and self.placement.equals(placement)
            and (self.rank, self.num_ranks) == (rank, num_ranks)
        )


def make_backend(
    grp: group_mod.StatelessGroup,
    placement: policy.Placement | None,
    rank: int | None,
    num_ranks: int | None,
    experts: Mapping[tuple[int, int], experts_mod.ExpertWeights],
) -> experts_mod.ExpertBackend:
    """The expert-parallel backend over the step group (it keys slots by global index)."""
    if placement is None or rank is None or num_ranks is None:
        raise RuntimeError("no placement to serve")
    base = placement.slots_of_rank(rank, num_ranks).start
    slots = {(layer, base + slot): w for (layer, slot), w in experts.items()}
    return ep_mod.ExpertParallelBackend(grp, placement, slots, rank=rank)
