"""The switch of `RayExecutor` to a new rank set, and the warm-up of new actors before it
(inherited by `RayExecutor`; the state is the executor's).

- `warm_up(ranks)`: a fresh actor's first compiled graph (~2.5 s) is paid ahead, in a thread,
  over a throwaway graph of the pending workers only (never over stepped ones); `switch`,
  `remove_ranks` and `prepare_switch` (outside the pause) wait for it.
- `switch(ranks, epoch=...)`: the pause: the workers `activate` the epoch, labels follow the
  new order, and the new rank set steps through plain calls at once while its graph compiles
  in the background (`ray_step`). A failure goes back to the old step path as it was
  (`_switch_back`: workers that activated revert).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moe_runtime.executor import base, ray_actor, ray_graph, ray_step
from moe_runtime.executor import health as health_mod

log = logging.getLogger(__name__)


class SwitchAndWarmUp:
    """Mixin of `RayExecutor` (see the module docstring)."""

    _lock: threading.RLock
    _ranks: dict[int, ray_actor.Rank]
    _active: list[int]
    _starting: set[int]
    _path: ray_step.StepPath
    _switching: bool
    _warming: threading.Thread | None
    _ready_timeout: float
    _switch_timeout: float
    last_switch: dict[str, float]

    # The executor's, called here (annotations only: nothing is shadowed at run time).
    collective_rpc: Callable[..., list[Any]]
    rank_infos: Callable[[], dict[int, dict[str, Any]]]
    lost_ranks: Callable[[], dict[int, health_mod.RankHealth]]
    _set_path: Callable[[], None]

    def warm_up(self, ranks: Sequence[int]) -> None:
        """Pay the first compiled graph of pending workers now, in a thread (compiled mode;
        a no-op otherwise): a throwaway graph over them only, never over stepped workers.
        `switch` and `remove_ranks` wait for it; `prepare_switch` does so outside the pause."""
        if not self._path.compiled or not ranks:
            return
        with self._lock:
            stepped = set(self._path.ranks or [])
            if stepped & set(ranks):
                raise ValueError(f"warm_up: ranks {sorted(stepped & set(ranks))} are stepped")
            actors = [self._ranks[r].actor for r in ranks]
        self._join_warm_up()
        self._warming = threading.Thread(
            target=ray_graph.warm_up,
            args=(actors,),
            kwargs={"timeout": self._ready_timeout},
            name="rank-warm-up",
            daemon=True,
        )
        self._warming.start()

    def prepare_switch(self) -> None:
        self._join_warm_up()

    def _join_warm_up(self, timeout: float | None = None) -> None:
        """Wait for the warm-up of the last added actors (a switch must not overlap it)."""
        warming, self._warming = self._warming, None
        if warming is not None:
            warming.join(timeout=self._ready_timeout if timeout is None else timeout)

    def switch(
        self,
        ranks: Sequence[int],
        *,
        epoch: int | None = None,
        placement: Any = None,
        timeout: float | None = None,
    ) -> None:
        deadline = time.monotonic() + (self._switch_timeout if timeout is None else timeout)

        def left() -> float:
            return max(0.5, deadline - time.monotonic())

        self._join_warm_up(timeout=left())
        ranks = list(ranks)
        with self._lock:
            reserved = max(self._starting, default=-1) + 1
            mapping = base.check_switch(ranks, live=list(self._ranks), reserved=reserved)
            old_active = list(self._active)
            self._switching = True
        t0 = time.monotonic()
        try:
            # The step path in place (the old graph too) is untouched until the new one is set:
            # a failure here goes back to it as it is.
            if epoch is not None:
                self.collective_rpc(
                    "activate",
                    epoch,
                    ranks=ranks,
                    timeout=left(),
                    per_rank={r: {"rank": i} for i, r in enumerate(ranks)},
                    num_ranks=len(ranks),
                    placement=placement,
                )
            t1 = time.monotonic()
            self._relabel(mapping, active=range(len(ranks)))
            self._set_path()  # plain calls from the next step on; the graph in the background
        except BaseException as exc:
            log.error("switch to ranks %s (epoch %s) failed: %s; going back", ranks, epoch, exc)
            self._switch_back(
                old_active=old_active,
                members=ranks,
                epoch=epoch,
                timeout=self._switch_timeout,  # its own bound: the switch's deadline has passed
            )
            raise
        finally:
            with self._lock:
                self._switching = False
        t2 = time.monotonic()
        self.last_switch = {"activate_s": t1 - t0, "switch_s": t2 - t0}
        log.info(
            "switched to ranks %s (old labels) in %.3fs (activate %.3fs); %s",
            ranks,
            t2 - t0,
            t1 - t0,
            "the step graph compiles in the background" if self._path.compiled else "plain calls",
        )

    def _switch_back(
        self,
        *,
        old_active: list[int],
        members: list[int],
        epoch: int | None,
        timeout: float,
    ) -> None:
        """The old step path again after a failed switch: workers that activated `epoch`
        revert; the step path was not replaced (labels neither), so it serves as it was unless
        one of its ranks is lost. Failures here are logged: the state is then "no step path"
        (has_step_path() False)."""
        if epoch is not None:
            live = [r for r in members if r in self.rank_infos() and r not in self.lost_ranks()]
            try:
                reverted = self.collective_rpc("revert", epoch, ranks=live, timeout=timeout)
                log.info("switch back: ranks %s reverted epoch %d: %s", live, epoch, reverted)
            except Exception:  # noqa: BLE001 - the state is logged as having no step path
                log.exception("switch back: reverting epoch %d on ranks %s failed", epoch, live)
                self._path.clear()
                return
        if any(r in self.lost_ranks() for r in old_active):
            log.warning("switch back: no step path over ranks %s until the next switch", old_active)
            self._path.clear()

    def _relabel(self, mapping: Mapping[int, int], *, active: Any) -> None:
        """Rank labels per `mapping` (labels not in it stay), active ranks = `active`."""
        with self._lock:
            relabelled = {}
            for old, r in self._ranks.items():
                r.label = mapping.get(old, old)
                r.info["label"] = r.label
                relabelled[r.label] = r
            self._ranks = relabelled
            self._active = list(active)
            healthy = [r for r in relabelled.values() if r.health.state == health_mod.HEALTH_OK]
        # Labels only name workers in their logs: sent, not awaited (they run before any later
        # call on the same lane).
        for r in healthy:
            r.actor.execute_method.remote("set_label", r.label)
