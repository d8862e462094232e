"""The upkeep of the warm spare pool (`SpareUpkeep`, inherited by `spares.SparePool`): one
`maintain` pass drops lost spares, stops extra ones, starts missing ones, (re)builds the
standby groups (`Standby`) and runs the pre-staging passes.

Replacement: after a grow used spares, the pool starts new ones as soon as free rank slots
exist again (on Kubernetes: the pods the operator adds), never while a resize or a recovery
runs. A shrink never keeps a released rank as a spare: its pod is freed like any other (the
operator's count stays active + K). A spare that dies is removed and replaced.

Every step of the maintenance is best effort and ends in a known state: a spare whose
preparation failed is removed; standby groups that could not be built are simply absent (a
grow then runs Standby as without spares). Building groups over active ranks takes the
resize lock (`mechanics`), so it never overlaps a resize or a rebalance.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from moe_runtime.elastic import prestage as prestage_mod
from moe_runtime.elastic import serving as serving_mod
from moe_runtime.executor import base as executor_base
from moe_runtime.executor import health as executor_health

log = logging.getLogger(__name__)

#: Seconds a standby rendezvous may take (a member that never comes must not hold the pool).
GROUP_TIMEOUT = 60.0


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


class SpareUpkeep:
    """The maintenance half of `spares.SparePool` (see the module docstring); the state is
    the pool's."""

    executor: executor_base.Executor
    serving: serving_mod.Serving
    config: serving_mod.ElasticConfig
    size: int
    mechanics: threading.Lock
    prestager: prestage_mod.Prestager
    started: int
    _busy: Callable[[], bool]
    _lock: threading.RLock
    _uids: list[int]
    _loaded: set[int]
    _standby: Standby | None
    _stale: set[int]
    _stop: threading.Event

    def _labels_by_uid(self) -> dict[int, int]:
        raise NotImplementedError

    def _standby_current(self) -> Standby | None:
        raise NotImplementedError

    def ready(self) -> list[int]:
        raise NotImplementedError

    def maintain(self) -> None:
        """One pass: drop dead spares, stop extra ones, start missing ones, (re)build the
        standby groups."""
        if self._stop.is_set():
            return
        self._drop_lost()
        if self._busy():
            return  # never beside a resize or a recovery: they own the ranks and the slots
        self._drop_extra()
        if self.size < 1:
            return
        self._start_missing()
        if self._busy() or self._stop.is_set():
            return
        self._rebuild_standby()
        while not self._stop.is_set() and self._prestage():
            pass  # batch after batch; the resize lock is let go between them

    def _prestage(self) -> bool:
        """One pre-staging pass (`prestage.Prestager.step`) when every spare is ready."""
        sb = self._standby_current()
        if sb is None or self._busy():
            return False
        ready = self.ready()
        if len(ready) != len(sb.spares):
            return False
        if not self.mechanics.acquire(blocking=False):
            return False
        try:
            if self._busy() or self._standby_current() is not sb:
                return False
            return self.prestager.step(
                active=sb.active,
                live=self.serving.placement,
                spares=ready,
                epoch=sb.epochs[len(sb.spares)],
            )
        finally:
            self.mechanics.release()

    def _drop_lost(self) -> None:
        by_uid = self._labels_by_uid()
        health = self.executor.health()
        with self._lock:
            uids = list(self._uids)
        for uid in uids:
            label = by_uid.get(uid)
            state = None if label is None else health.get(label)
            if label is not None and state is not None and state.state == executor_health.HEALTH_OK:
                continue
            with self._lock:
                self._uids = [u for u in self._uids if u != uid]
                self._loaded.discard(uid)
                if self._standby is not None and uid in self._standby.spares:
                    self._stale |= set(self._standby.epochs.values())
                    self._standby = None
            log.error("warm spares: spare %s (rank %s) is lost: %s", uid, label, state)
            if label is not None:
                try:
                    self.executor.remove_ranks([label])
                except Exception:  # noqa: BLE001 - it is dead already; nothing else holds it
                    log.exception("warm spares: removing lost spare rank %s failed", label)

    def _drop_extra(self) -> None:
        """Stop the spares beyond `size` (after it was lowered), the newest first."""
        with self._lock:
            extra = self._uids[self.size :]
            if not extra:
                return
            self._uids = self._uids[: self.size]
            self._loaded -= set(extra)
            if self._standby is not None:
                self._stale |= set(self._standby.epochs.values())
                self._standby = None  # the spare set changed
        by_uid = self._labels_by_uid()
        labels = [by_uid[u] for u in extra if u in by_uid]
        if labels:
            self.executor.remove_ranks(labels)
        log.info("warm spares: stopped ranks %s (%d kept from now on)", labels, self.size)

    def _start_missing(self) -> None:
        with self._lock:
            short = self.size - len(self._uids)
        if short < 1:
            return
        free = self.executor.free_rank_slots()
        count = short if free is None else min(short, int(free))
        if count < 1:
            return
        if self._stop.is_set():
            return
        started = time.monotonic()
        labels = self.executor.add_ranks(count, timeout=self.config.rpc_timeout, spare=True)
        infos = self.executor.rank_infos()
        uids = [int(infos[label]["uid"]) for label in labels]
        storage = self.config.weight_source == "storage"
        try:
            self.executor.collective_rpc(
                "load_weights",
                ranks=labels,
                timeout=self.config.rpc_timeout,
                source=self.config.source,
                rank=0,
                num_ranks=1,
                placement=None,
                placeholder=not storage,  # "peer": the active ranks send them (standby group)
            )
            self.executor.warm_up(labels)
            self.executor.prepare_switch()  # waits for the warm-up (this thread only)
        except Exception:
            log.exception("warm spares: preparing new spares %s failed; removing them", labels)
            self.executor.remove_ranks(labels)
            raise
        with self._lock:
            self._uids += uids
            if storage:
                self._loaded |= set(uids)
            if self._standby is not None:
                self._stale |= set(self._standby.epochs.values())
                self._standby = None  # the spare set changed
            self.started += count
        log.info(
            "warm spares: started ranks %s in %.2fs (%s weights)",
            labels,
            time.monotonic() - started,
            "source" if storage else "peer",
        )

    def _rebuild_standby(self) -> None:
        with self._lock:
            need = bool(self._uids) and self._standby_current() is None
            need_drop = bool(self._stale)
        if not (need or need_drop):
            return
        if not self.mechanics.acquire(blocking=False):
            return  # a resize or a rebalance runs: the next pass
        try:
            if self._busy():
                return
            self._drop_stale()
            if need:
                self._build()
        finally:
            self.mechanics.release()

    def _drop_stale(self) -> None:
        with self._lock:
            stale, self._stale = set(self._stale), set()
        stale.discard(self.serving.epoch)
        live = [
            label
            for label, h in self.executor.health().items()
            if h.state == executor_health.HEALTH_OK
        ]
        for epoch in sorted(stale):
            try:
                self.executor.collective_rpc(
                    "drop_epoch",
                    epoch,
                    ranks=live,
                    timeout=self.config.rpc_timeout,
                    background=True,
                )
            except Exception:  # noqa: BLE001 - a group left behind only costs its sockets
                log.exception("warm spares: dropping standby epoch %d failed", epoch)

    def _build(self) -> None:
        by_uid = self._labels_by_uid()
        with self._lock:
            spares = sorted((by_uid[u], u) for u in self._uids if u in by_uid)
        if not spares:
            return
        active = self.executor.ranks
        active_epoch = self.serving.epoch
        labels = [label for label, _ in spares]
        started = time.monotonic()
        epochs: dict[int, int] = {}
        try:
            for k in range(1, len(labels) + 1):
                epoch = self.serving.take_epoch()
                epochs[k] = epoch
                self.executor.build_groups(active + labels[:k], epoch=epoch, timeout=GROUP_TIMEOUT)
            with self._lock:
                unloaded = [i for i, (_, u) in enumerate(spares) if u not in self._loaded]
            if unloaded:
                n = len(active)
                self.executor.weights.transfer_non_expert(
                    epochs[len(labels)],
                    members=active + labels,
                    src_ranks=list(range(n)),
                    dst_ranks=[n + i for i in unloaded],
                    timeout=self.config.rpc_timeout,
                )
        except Exception:
            log.exception("warm spares: building standby groups over %s failed", active + labels)
            with self._lock:
                self._stale |= set(epochs.values())
            raise
        with self._lock:
            self._loaded |= {u for _, u in spares}
            self._standby = Standby(
                active=tuple(active),
                active_epoch=active_epoch,
                spares=tuple(u for _, u in spares),
                epochs=epochs,
            )
        log.info(
            "warm spares: ranks %s ready; standby epochs %s over active ranks %s (%.2fs)",
            labels,
            epochs,
            active,
            time.monotonic() - started,
        )
