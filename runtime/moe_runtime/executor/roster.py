"""The rank workers of an executor by label (`Roster`), shared by `LocalExecutor` (a worker
object per member) and `RayExecutor` (an actor and its placement group per member).

Labels: the active ranks (stepped) are always 0..n-1 in step order. A pending worker keeps the
label `reserve` gave it (n, n+1, ...) or the one it had when a switch left it out, until it is
removed or switched in (`mapping_for`, `relabel`). A member's `health` (what the heartbeat
knows of it) and `info` (what it said when it started, plus a `uid` that follows it through
relabels) travel with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from moe_runtime.executor import health as health_mod

H = TypeVar("H")


@dataclasses.dataclass
class Member(Generic[H]):
    """One rank worker: its label, its handle (how the executor reaches it), what it said when
    it started, its health."""

    label: int
    handle: H
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    health: health_mod.RankHealth = dataclasses.field(default_factory=health_mod.RankHealth)


class Roster(Generic[H]):
    """The live members by label, which of them are active, and labels still being started."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._members: dict[int, Member[H]] = {}
        self._active: list[int] = []
        #: Labels held by workers that are still starting (concurrent `reserve`s).
        self._starting: set[int] = set()
        self._uids = itertools.count()

    # -- reading ---------------------------------------------------------------------------
    def active(self) -> list[int]:
        """The labels in the step graph, in step order (always 0..n-1)."""
        with self._lock:
            return list(self._active)

    def pending(self) -> list[int]:
        """Live members that are not in the step graph (added, or left out by a switch)."""
        with self._lock:
            return sorted(r for r in self._members if r not in self._active)

    def members(self) -> dict[int, Member[H]]:
        """Every live member by label (a copy of the mapping)."""
        with self._lock:
            return dict(self._members)

    def member(self, label: int) -> Member[H]:
        """The member labelled `label`; KeyError when there is none."""
        with self._lock:
            return self._members[label]

    def infos(self) -> dict[int, dict[str, Any]]:
        """What every live member said when it started, with its label, by label."""
        with self._lock:
            return {label: {**m.info, "label": label} for label, m in sorted(self._members.items())}

    def health(self) -> dict[int, health_mod.RankHealth]:
        """The RankHealth of every live member, by label (the objects themselves)."""
        with self._lock:
            return {label: m.health for label, m in self._members.items()}

    def targets(self, what: str, ranks: Sequence[int] | None) -> list[Member[H]]:
        """The members `ranks` (default: the active ones, in step order) for a call of `what`.

        Raises ValueError naming the labels that have no worker.
        """
        with self._lock:
            labels = list(self._active if ranks is None else ranks)
            unknown = [r for r in labels if r not in self._members]
            if unknown:
                raise ValueError(f"{what}: no worker for ranks {unknown}")
            return [self._members[r] for r in labels]

    # -- changing ------------------------------------------------------------------------
    def reserve(self, count: int) -> list[int]:
        """`count` new labels above every label in use or reserved (workers being started)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._lock:
            first = max([-1, *self._members, *self._starting]) + 1
            labels = list(range(first, first + count))
            self._starting.update(labels)
            return labels

    def unreserve(self, labels: Sequence[int]) -> None:
        with self._lock:
            self._starting.difference_update(labels)

    def add(self, members: Sequence[Member[H]], *, active: bool = False) -> list[Member[H]]:
        """Members started (pending, or `active` in the given order: the first ranks only);
        each gets a uid that follows it through relabels. A pending member whose reserved
        label a switch gave to a live member while it started (a grow makes labels 0..n-1
        the active ranks': a rank pool's process started at label n, a grow onto a warm
        spare took n) takes the next label above every one in use or reserved instead.
        Returns the members relabelled so (the caller tells them their label)."""
        moved: list[Member[H]] = []
        with self._lock:
            for m in members:
                if m.label in self._members:
                    taken = [*self._members, *self._starting, *(x.label for x in members)]
                    m.label = max(taken) + 1
                    moved.append(m)
                m.info.update(uid=next(self._uids), label=m.label)
                self._members[m.label] = m
            if active:
                self._active += [m.label for m in members]
        return moved

    def remove(self, labels: Sequence[int]) -> list[Member[H]]:
        """Take those members out (ValueError naming unknown labels; nothing changes then)."""
        with self._lock:
            unknown = [r for r in labels if r not in self._members]
            if unknown:
                raise ValueError(f"remove_ranks: no worker for ranks {unknown}")
            removed = [self._members.pop(r) for r in labels]
            self._active = [r for r in self._active if r not in labels]
            return removed

    def clear(self) -> list[Member[H]]:
        """Take every member out (the executor shuts down)."""
        with self._lock:
            members = list(self._members.values())
            self._members, self._active = {}, []
            return members

    def mapping_for(self, ranks: Sequence[int]) -> dict[int, int]:
        """{old label: new label} of every live member for a switch to `ranks`
        (`check_switch`, with the labels of workers still starting kept free)."""
        with self._lock:
            reserved = max(self._starting, default=-1) + 1
            return check_switch(ranks, live=list(self._members), reserved=reserved)

    def relabel(self, mapping: Mapping[int, int], *, num_active: int) -> list[Member[H]]:
        """Labels per `mapping` (labels not in it stay); the active ranks are 0..num_active-1.
        Returns every member, relabelled."""
        with self._lock:
            relabelled: dict[int, Member[H]] = {}
            for old, m in self._members.items():
                m.label = m.info["label"] = mapping.get(old, old)
                relabelled[m.label] = m
            self._members = relabelled
            self._active = list(range(num_active))
            return list(relabelled.values())


def check_switch(ranks: Sequence[int], *, live: Sequence[int], reserved: int = 0) -> dict[int, int]:
    """Validate a switch and return {old label: new label} for every live worker.

    Workers left out keep their label, unless the new ranks 0..len(ranks)-1 take it: then
    they get the next labels above every label in use and below `reserved` (labels handed out
    to workers still starting), in the order of their old labels, so pending workers (warm
    spares, workers being prepared) never block a switch. Pure.
    """
    if not ranks:
        raise ValueError("switch needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"switch ranks must be distinct, got {list(ranks)}")
    unknown = sorted(set(ranks) - set(live))
    if unknown:
        raise ValueError(f"switch names ranks {unknown} that are not live workers {sorted(live)}")
    mapping = {old: new for new, old in enumerate(ranks)}
    left_out = [r for r in live if r not in mapping]
    clash = sorted(r for r in left_out if r < len(ranks))
    mapping.update({r: r for r in left_out if r not in clash})
    free = max([len(ranks) - 1, reserved - 1, *live]) + 1
    mapping.update({r: free + i for i, r in enumerate(clash)})
    return mapping
