"""The switch of an executor to a new rank set (`Switch`), shared by both executors.

`switch(ranks, epoch=...)` is the pause of a resize: the workers `activate` the epoch (worker
`ranks[i]` becomes rank i of the new step group), labels follow the new order, and the new rank
set steps from the next step on (`set_path`: on Ray through plain calls at once while its
compiled graph is built in the background, `ray_step`). Called between two steps.

A failure goes back to the old step path as it was (`_switch_back`): workers that activated the
epoch `revert` (they kept their previous state), and the step path, never replaced, serves
again; where that cannot be (the revert failed, or one of the old ranks is lost) the executor
is left with no step path (`clear_path`), a state the recovery repairs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from moe_runtime.executor import health as health_mod
from moe_runtime.executor import roster as roster_mod

log = logging.getLogger(__name__)


class Switch:
    """The switch of one executor (see the module docstring).

    roster: its workers; rpc: its `collective_rpc`; lost(): the labels its heartbeat lost;
    set_path() / clear_path(): step the roster's active ranks from the next step on / no
    step path; tell(members): let relabelled workers know their labels (logs); prepare(left):
    finish what must not overlap a switch (Ray: the warm-up of new actors), within `left`
    seconds (None: no bound); timeout: the bound of a switch called without one (None: none).
    """

    def __init__(
        self,
        *,
        roster: roster_mod.Roster[Any],
        rpc: Callable[..., list[Any]],
        lost: Callable[[], Collection[int]],
        set_path: Callable[[], None],
        clear_path: Callable[[], None],
        tell: Callable[[list[roster_mod.Member[Any]]], None],
        prepare: Callable[[float | None], None] = lambda left: None,
        timeout: float | None = None,
    ) -> None:
        self._roster = roster
        self._rpc = rpc
        self._lost = lost
        self._set_path = set_path
        self._clear_path = clear_path
        self._tell = tell
        self._prepare = prepare
        self.timeout = timeout
        self._lock = threading.Lock()
        self._switching = False
        #: Seconds of the last switch: activate (the workers) and the whole switch.
        self.last: dict[str, float] = {}

    @property
    def switching(self) -> bool:
        """A switch is in progress (it counts as a step path)."""
        with self._lock:
            return self._switching

    def switch(
        self, ranks: Sequence[int], *, epoch: int | None, placement: Any, timeout: float | None
    ) -> None:
        """See `base.Executor.switch`."""
        bound = self.timeout if timeout is None else timeout
        deadline = None if bound is None else time.monotonic() + bound

        def left() -> float | None:
            return None if deadline is None else max(0.5, deadline - time.monotonic())

        self._prepare(left())
        ranks = list(ranks)
        mapping = self._roster.mapping_for(ranks)
        old_active = self._roster.active()
        with self._lock:
            self._switching = True
        t0 = time.monotonic()
        try:
            # The step path in place is untouched until the new one is set: a failure here
            # goes back to it as it is.
            if epoch is not None:
                self._rpc(
                    "activate",
                    epoch,
                    ranks=ranks,
                    timeout=left(),
                    per_rank={r: {"rank": i} for i, r in enumerate(ranks)},
                    num_ranks=len(ranks),
                    placement=placement,
                )
            t1 = time.monotonic()
            members = self._roster.relabel(mapping, num_active=len(ranks))
            self._tell([m for m in members if m.health.state == health_mod.HEALTH_OK])
            self._set_path()
        except BaseException as exc:
            log.error("switch to ranks %s (epoch %s) failed: %s; going back", ranks, epoch, exc)
            # Its own bound: the switch's deadline has passed.
            self._switch_back(old_active=old_active, members=ranks, epoch=epoch)
            raise
        finally:
            with self._lock:
                self._switching = False
        t2 = time.monotonic()
        self.last = {"activate_s": t1 - t0, "switch_s": t2 - t0}
        log.info(
            "switched to ranks %s (old labels) in %.3fs (activate %.3fs)", ranks, t2 - t0, t1 - t0
        )

    def _switch_back(self, *, old_active: list[int], members: list[int], epoch: int | None) -> None:
        """The old step path again after a failed switch: workers that activated `epoch`
        revert; the step path was not replaced (labels neither), so it serves as it was unless
        one of its ranks is lost. Failures here are logged: the state is then "no step path"."""
        lost = set(self._lost())
        if epoch is not None:
            live = [r for r in members if r in self._roster.members() and r not in lost]
            try:
                reverted = self._rpc("revert", epoch, ranks=live, timeout=self.timeout)
                log.info("switch back: ranks %s reverted epoch %d: %s", live, epoch, reverted)
            except Exception:  # noqa: BLE001 - the state is logged as having no step path
                log.exception("switch back: reverting epoch %d on ranks %s failed", epoch, live)
                self._clear_path()
                return
        if any(r in self._lost() for r in old_active):
            log.warning("switch back: no step path over ranks %s until the next switch", old_active)
            self._clear_path()
