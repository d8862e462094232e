"""Experts a rank served before and serves no more, kept for the next change that wants them.

A grow hands part of each old rank's experts to the new ranks; a shrink back to the old size
(the usual next resize: load goes up, then down) would copy the same experts back from the
departing ranks. Expert weights never change while a model serves, so a rank keeps the
experts that a confirmed change took off its live slots (`Retained.absorb`, called by
`ExpertSlots.retire_previous`). `stage_experts` fills slots from them like from its own live
slots, and the resize stages leave out every move to a rank that retains the expert
(`elastic.resize.ResizeContext.stage_experts`, through `retained_keys`).

Memory: a rank never holds more distinct experts (live + retained) than it held at once at
its largest (`peak`: its live slots, or at a change the live slots before and after it, which
it held together until the change was confirmed): the rank already held that much. When a
change leaves more, the experts retained longest ago go first. Placeholder weights (the zeros
of a rank loaded to receive its experts from peers) are never retained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from moe_runtime.model import experts as experts_mod

Key = tuple[int, int]


class Retained:
    """The retained experts of one rank: (layer, logical) -> weights, oldest first."""

    def __init__(self) -> None:
        self.experts: dict[Key, experts_mod.ExpertWeights] = {}
        #: the most distinct experts the rank held at once (module docstring)
        self.peak = 0
        #: ids of placeholder weights (zeros), never retained
        self._placeholders: set[int] = set()

    def absorb(
        self, previous: Mapping[Key, experts_mod.ExpertWeights], live: Mapping[Key, object]
    ) -> int:
        """A change from `previous` to `live` ((layer, logical) -> weights of the live slots,
        before and after) is confirmed: keep what left the live slots, within the bound.
        Returns how many experts are retained now."""
        self.peak = max(self.peak, len(previous.keys() | live.keys()))
        kept = {k: w for k, w in self.experts.items() if k not in live and k not in previous}
        kept.update(
            (k, w) for k, w in previous.items() if k not in live and id(w) not in self._placeholders
        )
        room = max(0, self.peak - len(live))
        dropped = len(kept) - room
        if dropped > 0:
            kept = dict(list(kept.items())[dropped:])
        self.experts = kept
        return len(kept)

    def reset(self, placeholders: Iterable[experts_mod.ExpertWeights] = ()) -> None:
        """Forget everything (the rank loaded its weights again); `placeholders`: the zeros it
        holds live now, which a later change must not retain as experts."""
        self.experts, self.peak = {}, 0
        self._placeholders = {id(w) for w in placeholders}

    def keys(self) -> list[Key]:
        return sorted(self.experts)

    def __len__(self) -> int:
        return len(self.experts)
