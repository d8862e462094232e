"""The rank pool: rank processes started ahead of need, weightless, that a grow takes instead
of starting new ones (`RankPool`).

Without warm spares a grow's Standby is mostly starting its rank processes (on Ray: an actor's
worker process, Python, Ray, `import torch` and the runtime, ~3 s of CPU a rank on the
development machine). `moe-runtime serve --rank-pool N` keeps N such processes started on free
rank slots (`moe_rank`), each a `RankWorker` with no weights, no KV cache and no group: the
cost of a warm spare without the weights (its RSS is the runtime's fixed part, docs/RESIZE.md).
A grow that warm spares do not cover takes pooled processes (`take`) for the ranks it would
start, then loads and transfers the weights as for any new rank; the runtime refills the pool
in the background afterwards. At tensor-parallel size T or pipeline-parallel size P above 1 a
pooled process is a whole DP rank (T x P actors in one placement group: its leader, its TP
followers, its pipeline stage actors and theirs, all weightless: `ray_start.start_ranks`); the
grow's `load_weights` on the leader loads every one of them (docs/PIPELINE-PARALLEL.md).

Upkeep (`maintain`, every `MAINTAIN_SECONDS` on the pool's thread): drop pooled processes that
died, start missing ones on free rank slots. Never while `busy()` (a resize or
a recovery owns the ranks and the slots); a pooled process starts below the serving ranks' CPU
priority once up and waits there (`Executor.add_ranks(spare=True)`), and a grow gives it the
serving ranks' priority back when it takes it (`Executor.promote`). The pool counts as free
capacity: a grow back after a recovery may start once free slots + pooled processes cover it.

A failed grow releases the pooled processes it took like the ranks it started (they may hold
weights or groups by then: the pool only keeps weightless ones) and the pool starts new ones.
Pooled processes are known by uid (`Executor.rank_infos()[label]["uid"]`: a switch relabels
workers, a uid follows its worker), like the warm spares (`spare_set`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from moe_runtime.executor import base as executor_base
from moe_runtime.executor import health as executor_health

log = logging.getLogger(__name__)

MAINTAIN_SECONDS = 0.5
#: Seconds `close` waits for a pass in progress (it may be starting processes).
CLOSE_TIMEOUT = 120.0


class RankPool:
    """`size` weightless rank processes kept started (see the module docstring).

    busy(): a resize or a recovery runs (no upkeep then); timeout: seconds to start processes.
    """

    def __init__(
        self,
        *,
        executor: executor_base.Executor,
        size: int,
        busy: Callable[[], bool],
        timeout: float,
    ) -> None:
        if size < 0:
            raise ValueError(f"rank_pool must be >= 0, got {size}")
        self.executor = executor
        self.size = size
        self._busy = busy
        self._timeout = timeout
        self._lock = threading.Lock()
        #: Held while the upkeep starts processes: a grow that takes meanwhile waits for them
        #: (they take the free rank slots it would otherwise wait for).
        self._starting = threading.Lock()
        #: Uids of the pooled processes, in the order they were started.
        self._uids: list[int] = []
        #: Processes started since the pool began (the first N, then every refill).
        self.started = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self.size < 1 or self._thread is not None or self._stop.is_set():
            return
        self._thread = threading.Thread(target=self._loop, name="rank-pool", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the upkeep; waits for a pass in progress (the processes it starts must not
        outlive the executor they run on)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_TIMEOUT)
            if self._thread.is_alive():
                log.warning("rank pool: the upkeep did not stop in %.0fs", CLOSE_TIMEOUT)

    def _loop(self) -> None:
        while not self._stop.wait(MAINTAIN_SECONDS):
            try:
                self.maintain()
            except Exception:  # noqa: BLE001 - the next pass starts over from what is live
                log.exception("rank pool: upkeep failed; retrying")

    # -- queries ---------------------------------------------------------------------------
    def _by_uid(self) -> dict[int, int]:
        return {
            int(info["uid"]): label
            for label, info in self.executor.rank_infos().items()
            if info.get("uid") is not None
        }

    def ready(self) -> list[int]:
        """Labels of the pooled processes a grow can take now (alive), in label order."""
        by_uid = self._by_uid()
        health = self.executor.health()
        with self._lock:
            uids = list(self._uids)
        labels = [by_uid[u] for u in uids if u in by_uid]
        return sorted(
            label
            for label in labels
            if health.get(label, executor_health.RankHealth()).state == executor_health.HEALTH_OK
        )

    def labels(self) -> set[int]:
        """Labels of every pooled process now (alive or not)."""
        by_uid = self._by_uid()
        with self._lock:
            return {by_uid[u] for u in self._uids if u in by_uid}

    # -- what a grow takes -----------------------------------------------------------------
    def take(self, most: int) -> list[int]:
        """Up to `most` alive pooled processes, in label order, at the serving ranks' CPU
        priority; they leave the pool (the grow owns them: it releases them if it fails)."""
        if most < 1:
            return []
        with self._starting:
            by_uid = self._by_uid()
            chosen = self.ready()[:most]
            with self._lock:
                taken = {u for u, label in by_uid.items() if label in chosen}
                self._uids = [u for u in self._uids if u not in taken]
        if not chosen:
            return []
        try:
            self.executor.promote(chosen)
        except Exception:  # noqa: BLE001 - the grow starts processes instead
            log.exception("rank pool: ranks %s did not answer; stopping them", chosen)
            self._remove(chosen)
            return []
        return chosen

    def _remove(self, labels: list[int]) -> None:
        """Stop processes that left the pool unused (best effort: a dead one is gone)."""
        live = set(self.executor.rank_infos())
        try:
            self.executor.remove_ranks([r for r in labels if r in live])
        except Exception:  # noqa: BLE001 - nothing else holds them
            log.exception("rank pool: stopping ranks %s failed", labels)

    # -- upkeep ----------------------------------------------------------------------------
    def maintain(self) -> None:
        """One pass: drop lost processes, then (unless busy) start missing ones on free rank
        slots."""
        if self._stop.is_set():
            return
        self._drop_lost()
        if self._busy():
            return
        self._start_missing()

    def _drop_lost(self) -> None:
        by_uid = self._by_uid()
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
            log.error("rank pool: process %s (rank %s) is lost: %s", uid, label, state)
            if label is not None:
                self._remove([label])

    def _start_missing(self) -> None:
        with self._lock:
            short = self.size - len(self._uids)
        if short < 1:
            return
        free = self.executor.free_rank_slots()
        count = short if free is None else min(short, int(free))
        if count < 1 or self._stop.is_set():
            return
        started = time.monotonic()
        with self._starting:
            labels = self.executor.add_ranks(count, timeout=self._timeout, spare=True)
            infos = self.executor.rank_infos()
            with self._lock:
                self._uids += [int(infos[label]["uid"]) for label in labels]
                self.started += count
        log.info(
            "rank pool: started ranks %s (pids %s) in %.2fs",
            labels,
            [infos[label].get("pid") for label in labels],
            time.monotonic() - started,
        )
