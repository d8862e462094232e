"""Warm spare ranks: workers started ahead of need, so that a grow skips Standby.

`SparePool(size=K)` keeps K workers beside the active ranks, each:
1. started (`Executor.add_ranks`) on a free rank slot (`moe_rank`: a worker pod the operator
   keeps beside the active ones; a local Ray instance offers them up front);
2. holding the non-expert weights (read from the model source with `weight_source="storage"`,
   else sent by the active ranks over a standby group: shared memory on one node) and no
   expert;
3. warmed up: its first compiled graph paid (`Executor.warm_up`, compiled step mode);
4. a member of the standby groups: for every k in 1..K, the step and transfer groups of one
   epoch over the active ranks + the first k spares (in label order), kept ready while the
   active ranks serve (rebuilt in the background whenever the active ranks, their epoch or the
   spares change);
5. holding, pre-staged, the experts every grow by k would give it (`prestage.Prestager`,
   in the background once the standby groups are ready).

A grow by k <= K ready spares (`claim(k)`) then needs no new worker and no rendezvous: the
resize is Transferring (experts staged over the claimed epoch's transfer group; with the
pre-staged target nothing, or only what the spares still lack, moves) + Switching (that
epoch's step group becomes active). A grow by more takes the ready spares it can (`take`) and
starts the rest in Standby.

The pool is one object made of parts: its membership (`spare_set.SpareSet`), the upkeep that
keeps it full (`spare_upkeep.Upkeep`: starting, replacing and dropping spares, the standby
groups, the pre-staging passes; its module docstring says when it runs and how each of its
steps fails) and the pre-staging (`prestage.Prestager`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from moe_runtime.elastic import prestage as prestage_mod
from moe_runtime.elastic import serving as serving_mod
from moe_runtime.elastic import spare_set, spare_upkeep
from moe_runtime.eplb import policy
from moe_runtime.executor import base as executor_base
from moe_runtime.executor import health as executor_health

log = logging.getLogger(__name__)

MAINTAIN_SECONDS = 0.5
#: Seconds `close` waits for a maintenance pass to end.
CLOSE_TIMEOUT = 120.0


@dataclasses.dataclass(frozen=True)
class Claim:
    """Spares handed to a grow: their labels (in group order) and the standby epoch whose
    step and transfer groups cover the active ranks and them (None: no standby group); the
    pre-staged target of this grow (None: none) and the keys each spare holds pre-staged."""

    labels: list[int]
    epoch: int | None
    target: policy.Placement | None = None
    prestaged: dict[int, set[prestage_mod.Key]] = dataclasses.field(default_factory=dict)


class SparePool:
    """K warm spare ranks (see the module docstring). `start()` runs the maintenance loop."""

    def __init__(
        self,
        *,
        executor: executor_base.Executor,
        serving: serving_mod.Serving,
        config: serving_mod.ElasticConfig,
        mechanics: threading.Lock,
        busy: Callable[[], bool],
    ) -> None:
        self.executor = executor
        self.serving = serving
        self._spares = spare_set.SpareSet(
            executor=executor, serving=serving, size=config.warm_spare_ranks
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: called after each failed maintenance pass (the server counts them:
        #: `moe_warm_spare_failures_total`)
        self.on_failure: Callable[[], None] | None = None
        #: Pre-staging (its target_for and max_size are set by whoever owns the resizes).
        self.prestager = prestage_mod.Prestager(
            executor=executor,
            num_layers=serving.placement.num_layers,
            timeout=config.rpc_timeout,
        )
        self.upkeep = spare_upkeep.Upkeep(
            spares=self._spares,
            config=config,
            mechanics=mechanics,
            busy=busy,
            prestager=self.prestager,
            stop=self._stop,
        )

    @property
    def size(self) -> int:
        """How many spares the pool keeps."""
        return self._spares.size

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self.size < 1 or self._thread is not None or self._stop.is_set():
            return
        self._thread = threading.Thread(target=self._loop, name="warm-spares", daemon=True)
        self._thread.start()

    def set_size(self, size: int) -> None:
        """Keep `size` spares from now on (PATCH /elastic_ep/config `warm_spare_ranks`): the
        next pass starts the missing ones or stops the extra ones (the newest first); spares a
        grow has claimed are not the pool's any more."""
        if size < 0:
            raise ValueError(f"warm_spare_ranks must be >= 0, got {size}")
        with self._spares.lock:
            self._spares.size = size
        self.start()

    def close(self) -> None:
        """Stop the upkeep; waits for a pass in progress (it may be starting a spare, which
        must not outlive the executor it runs on)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_TIMEOUT)
            if self._thread.is_alive():
                log.warning("warm spares: the upkeep did not stop in %.0fs", CLOSE_TIMEOUT)

    def _loop(self) -> None:
        while not self._stop.wait(MAINTAIN_SECONDS):
            try:
                self.upkeep.maintain()
            except Exception:  # noqa: BLE001 - the next pass starts over from what is live
                log.exception("warm spares: maintenance failed; retrying")
                if self.on_failure is not None:
                    self.on_failure()

    # -- queries ---------------------------------------------------------------------------
    def labels(self) -> set[int]:
        """Labels of every pool member now (ready or not)."""
        return self._spares.labels()

    def ready(self) -> list[int]:
        """Labels of the spares a grow can use at once (loaded, warm, in standby groups)."""
        return self._spares.ready()

    def covers(self, count: int) -> bool:
        """A grow by `count` ranks can run on ready spares (no Standby)."""
        return 0 < count <= len(self.ready())

    def status(self) -> dict[str, Any]:
        """`warm_spare_ranks` and `spares` of GET /elastic_ep/status (no rank is called)."""
        infos = self.executor.rank_infos()
        by_uid = {int(i["uid"]): label for label, i in infos.items() if i.get("uid") is not None}
        health = self.executor.health()
        ready = set(self.ready())
        with self._spares.lock:
            uids = list(self._spares.uids)
        spares = []
        for uid in uids:
            label = by_uid.get(uid)
            if label is None:
                continue
            info, h = infos[label], health.get(label)
            spares.append(
                {
                    "rank": label,
                    "pod": info.get("pod"),
                    "node_id": info.get("node_id"),
                    "pid": info.get("pid"),
                    "tp_pids": list(info.get("tp_pids") or []),
                    "pp_pids": list(info.get("pp_pids") or []),
                    "healthy": h is not None and h.state == executor_health.HEALTH_OK,
                    "ready": label in ready,
                    "prestaged": self._prestaged_count(label),
                }
            )
        return {"warm_spare_ranks": self.size, "spares": spares}

    def _prestaged_count(self, label: int) -> dict[str, int] | None:
        plan = self.prestager.plan
        if plan is None or label not in plan.spares:
            return None
        wanted = plan.wanted.get(label, set())
        return {"held": len(wanted & plan.have.get(label, set())), "wanted": len(wanted)}

    # -- what a grow takes -----------------------------------------------------------------
    def claim(self, count: int) -> Claim | None:
        """The first `count` ready spares and the standby epoch over the active ranks and them,
        or None when they do not cover it. They leave the pool."""
        spares = self._spares
        with spares.lock:
            ready = spares.ready()
            sb = spares.standby_current()
            if sb is None or not 0 < count <= len(ready):
                return None
            taken = list(sb.spares[:count])
            spares.uids = [u for u in spares.uids if u not in taken]
            spares.loaded -= set(taken)
            spares.stale |= {e for k, e in sb.epochs.items() if k != count}
            spares.standby = None
            labels = ready[:count]
            target, held = self.prestager.take(
                labels, active=sb.active, live=self.serving.placement
            )
            return Claim(labels=labels, epoch=sb.epochs[count], target=target, prestaged=held)

    def take(self, most: int) -> list[int]:
        """Up to `most` spares whose weights are loaded (standby groups or not), in label
        order; they leave the pool (a grow by more than the ready spares uses them too)."""
        spares = self._spares
        by_uid = spares.labels_by_uid()
        health = self.executor.health()
        with spares.lock:
            loaded = [
                (by_uid[u], u)
                for u in spares.uids
                if u in spares.loaded
                and u in by_uid
                and health.get(by_uid[u], executor_health.RankHealth()).state
                == executor_health.HEALTH_OK
            ]
            chosen = sorted(loaded)[: max(0, most)]
            spares.drop({u for _, u in chosen})
            return [label for label, _ in chosen]

    def give_back(self, labels: Sequence[int]) -> None:
        """Spares a failed grow had taken come back (their weights are still loaded)."""
        infos = self.executor.rank_infos()
        spares = self._spares
        with spares.lock:
            for label in labels:
                uid = infos.get(label, {}).get("uid")
                if uid is not None and uid not in spares.uids:
                    spares.uids.append(int(uid))
                    spares.loaded.add(int(uid))
        log.info("warm spares: ranks %s back in the pool", list(labels))
