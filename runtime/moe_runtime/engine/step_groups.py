"""Interleaved step groups (vLLM's virtual engines): the running sequences split into `groups`
sets, each step taking the sequences of one set, the sets in turn (a part of `Scheduler`).

Why: over pipeline stages a step's sequences cannot enter stage 0 again before the last
stage sampled them, so with one set the stages of consecutive steps never work at once. With
P sets, step N + 1 (another set) needs nothing of step N: an executor that runs a step's
stage 0 while the earlier steps are in later stages (`RayExecutor` at
`--pipeline-interleave`, which says so by `step_groups` = P) keeps every stage busy. The
engine keeps a step of each set in flight (`flight.Aheads`: `groups` steps in flight with
`EngineConfig.overlap_steps`), so the next step is there in time.

- A new sequence joins the set with the fewest running sequences (`join`); a migration, a
  retry or a wait for room keeps its set.
- A step takes the first set after the last step's that has work (`pick`); when only the
  sets of steps in flight have work, it takes the next of those (its tokens then wait for
  that step: placeholders, in the first step ahead only). One set (`groups` 1) is the
  scheduler as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


class Grouped(Protocol):
    group: int


G = TypeVar("G", bound=Grouped)


def join(running: Iterable[Grouped], groups: int) -> int:
    """The set a new sequence joins: the one with the fewest running sequences (the lowest
    of those)."""
    counts = [0] * groups
    for seq in running:
        counts[seq.group % groups] += 1
    return min(range(groups), key=lambda g: (counts[g], g))


def pick(views: Sequence[tuple[Grouped, int, int]], groups: int, last: int) -> int | None:
    """The set the next step takes, given (seq, tokens computed, tokens) of each sequence and
    the set of the last step made (`last`); None: every sequence is in it (one set)."""
    if groups <= 1:
        return None
    busy = {seq.group % groups for seq, computed, length in views if length > computed}
    for k in range(1, groups + 1):
        group = (last + k) % groups
        if group in busy:
            return group
    return None


def of(views: Sequence[tuple[G, int, int]], group: int | None) -> list[tuple[G, int, int]]:
    """The views of the sequences in `group` (all of them: None)."""
    if group is None:
        return list(views)
    return [v for v in views if v[0].group == group]
