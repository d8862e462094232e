"""The upkeep of the warm spare pool (`Upkeep`, a part of `spares.SparePool`): one `maintain`
pass drops lost spares, stops extra ones, starts missing ones, (re)builds the standby groups
(`spare_set.Standby`) and runs the pre-staging passes, on the pool's `spare_set.SpareSet`.

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

import logging
import threading
import time
from collections.abc import Callable

from moe_runtime.elastic import prestage as prestage_mod
from moe_runtime.elastic import serving as serving_mod
from moe_runtime.elastic import spare_set
from moe_runtime.executor import health as executor_health
from moe_runtime.executor import weight_moves

log = logging.getLogger(__name__)

#: Seconds a standby rendezvous may take (a member that never comes must not hold the pool).
GROUP_TIMEOUT = 60.0


class Upkeep:
    """The maintenance of one spare set (see the module docstring).

    spares: the pool's membership; mechanics: the resize lock (standby groups and pre-staging
    take it); busy(): a resize or a recovery owns the ranks now; prestager: the pool's
    pre-staging; stop: set when the pool closes (a pass ends early then).
    """

    def __init__(
        self,
        *,
        spares: spare_set.SpareSet,
        config: serving_mod.ElasticConfig,
        mechanics: threading.Lock,
        busy: Callable[[], bool],
        prestager: prestage_mod.Prestager,
        stop: threading.Event,
    ) -> None:
        self.spares = spares
        self.executor = spares.executor
        self.serving = spares.serving
        self.config = config
        self.mechanics = mechanics
        self._busy = busy
        self.prestager = prestager
        self._stop = stop

    def maintain(self) -> None:
        """One pass: drop dead spares, stop extra ones, start missing ones, (re)build the
        standby groups."""
        if self._stop.is_set():
            return
        self._drop_lost()
        if self._busy():
            return  # never beside a resize or a recovery: they own the ranks and the slots
        self._drop_extra()
        if self.spares.size < 1:
            return
        self._start_missing()
        if self._busy() or self._stop.is_set():
            return
        self._rebuild_standby()
        while not self._stop.is_set() and self._prestage():
            pass  # batch after batch; the resize lock is let go between them

    def _prestage(self) -> bool:
        """One pre-staging pass (`prestage.Prestager.step`) when every spare is ready."""
        sb = self.spares.standby_current()
        if sb is None or self._busy():
            return False
        ready = self.spares.ready()
        if len(ready) != len(sb.spares):
            return False
        if not self.mechanics.acquire(blocking=False):
            return False
        try:
            if self._busy() or self.spares.standby_current() is not sb:
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
        spares = self.spares
        by_uid = spares.labels_by_uid()
        health = self.executor.health()
        with spares.lock:
            uids = list(spares.uids)
        for uid in uids:
            label = by_uid.get(uid)
            state = None if label is None else health.get(label)
            if label is not None and state is not None and state.state == executor_health.HEALTH_OK:
                continue
            with spares.lock:
                spares.drop({uid})
            log.error("warm spares: spare %s (rank %s) is lost: %s", uid, label, state)
            if label is not None:
                try:
                    self.executor.remove_ranks([label])
                except Exception:  # noqa: BLE001 - it is dead already; nothing else holds it
                    log.exception("warm spares: removing lost spare rank %s failed", label)

    def _drop_extra(self) -> None:
        """Stop the spares beyond `size` (after it was lowered), the newest first."""
        spares = self.spares
        with spares.lock:
            extra = spares.uids[spares.size :]
            if not extra:
                return
            spares.drop(set(extra))
            spares.forget_standby()  # the spare set changed
            size = spares.size
        by_uid = spares.labels_by_uid()
        labels = [by_uid[u] for u in extra if u in by_uid]
        if labels:
            self.executor.remove_ranks(labels)
        log.info("warm spares: stopped ranks %s (%d kept from now on)", labels, size)

    def _start_missing(self) -> None:
        spares = self.spares
        with spares.lock:
            short = spares.size - len(spares.uids)
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
        with spares.lock:
            spares.uids += uids
            if storage:
                spares.loaded |= set(uids)
            spares.forget_standby()  # the spare set changed
            spares.started += count
        log.info(
            "warm spares: started ranks %s in %.2fs (%s weights)",
            labels,
            time.monotonic() - started,
            "source" if storage else "peer",
        )

    def _rebuild_standby(self) -> None:
        spares = self.spares
        with spares.lock:
            need = bool(spares.uids) and spares.standby_current() is None
            need_drop = bool(spares.stale)
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
        spares = self.spares
        with spares.lock:
            stale, spares.stale = set(spares.stale), set()
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
        members = self.spares
        by_uid = members.labels_by_uid()
        with members.lock:
            spares = sorted((by_uid[u], u) for u in members.uids if u in by_uid)
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
            with members.lock:
                unloaded = [i for i, (_, u) in enumerate(spares) if u not in members.loaded]
            if unloaded:
                n = len(active)
                transfer = weight_moves.NonExpertTransfer(
                    epoch=epochs[len(labels)],
                    members=active + labels,
                    src_ranks=list(range(n)),
                    dst_ranks=[n + i for i in unloaded],
                )
                self.executor.weights.transfer_non_expert(transfer, timeout=self.config.rpc_timeout)
        except Exception:
            log.exception("warm spares: building standby groups over %s failed", active + labels)
            with members.lock:
                members.stale |= set(epochs.values())
            raise
        with members.lock:
            members.loaded |= {u for _, u in spares}
            members.standby = spare_set.Standby(
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
