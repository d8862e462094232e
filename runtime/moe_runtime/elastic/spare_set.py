"""The warm spares' membership (`SpareSet`): which workers are spares, which hold their
non-expert weights, the standby groups over the active ranks and them (`Standby`), and the
standby epochs to drop. One object, shared by the pool (`spares.SparePool`: what a grow takes)
and its upkeep (`spare_upkeep.Upkeep`: what keeps it full); both change it under its `lock`.

Spares are known by uid (`Executor.rank_infos()[label]["uid"]`): a switch relabels workers,
a uid follows its worker.
"""

from __future__ import annotations

import dataclasses
import threading

from moe_runtime.elastic import serving as serving_mod
from moe_runtime.executor import base as executor_base
from moe_runtime.executor import health as executor_health


@dataclasses.dataclass(frozen=True)
class Standby:
    """Standby groups over the active ranks and the spares.

    active: labels of the active ranks then; active_epoch: their epoch then; spares: uids of
    the spares in group order (active ranks first, then these); epochs: k -> the epoch whose
    groups cover the active ranks and spares[:k].
    """

    active: tuple[int, ...]
    active_epoch: int
    spares: tuple[int, ...]
    epochs: dict[int, int]


class SpareSet:
    """The spares of one pool (see the module docstring). size: how many to keep."""

    def __init__(
        self,
        *,
        executor: executor_base.Executor,
        serving: serving_mod.Serving,
        size: int,
    ) -> None:
        self.executor = executor
        self.serving = serving
        self.lock = threading.RLock()
        #: How many spares to keep (live: `SparePool.set_size`).
        self.size = size
        #: Uids of the spares (ready or being prepared), in the order they were started.
        self.uids: list[int] = []
        #: Uids whose non-expert weights are loaded and whose warm-up is done.
        self.loaded: set[int] = set()
        self.standby: Standby | None = None
        #: Standby epochs no longer used (dropped on every live worker by the next pass).
        self.stale: set[int] = set()
        #: Spares started since the pool began (the first K, then every replacement).
        self.started = 0

    def labels_by_uid(self) -> dict[int, int]:
        return {
            int(info["uid"]): label
            for label, info in self.executor.rank_infos().items()
            if info.get("uid") is not None
        }

    def labels(self) -> set[int]:
        """Labels of every spare now (ready or not)."""
        by_uid = self.labels_by_uid()
        with self.lock:
            return {by_uid[u] for u in self.uids if u in by_uid}

    def standby_current(self) -> Standby | None:
        """The standby groups if they still cover today's active ranks and their epoch."""
        with self.lock:
            sb = self.standby
        if sb is None:
            return None
        if sb.active != tuple(self.executor.ranks) or sb.active_epoch != self.serving.epoch:
            return None
        return sb

    def ready(self) -> list[int]:
        """Labels of the spares a grow can use at once (loaded, warm, in standby groups)."""
        sb = self.standby_current()
        if sb is None:
            return []
        by_uid = self.labels_by_uid()
        health = self.executor.health()
        with self.lock:
            members = set(self.uids)
        ok: list[int] = []
        for uid in sb.spares:  # the standby epoch for k covers the first k: a healthy prefix
            label = by_uid.get(uid)
            h = None if label is None else health.get(label)
            if label is None or uid not in members or h is None:
                break
            if h.state != executor_health.HEALTH_OK:
                break
            ok.append(label)
        return ok

    def forget_standby(self) -> None:
        """The spares changed: the standby groups are of no use any more (their epochs are
        dropped by the next pass). Call it holding `lock`."""
        if self.standby is not None:
            self.stale |= set(self.standby.epochs.values())
            self.standby = None

    def drop(self, uids: set[int]) -> None:
        """Those spares leave the pool (a grow took them, they died, there are too many);
        the standby groups go when they covered one. Call it holding `lock`."""
        self.uids = [u for u in self.uids if u not in uids]
        self.loaded -= uids
        if self.standby is not None and uids & set(self.standby.spares):
            self.forget_standby()
