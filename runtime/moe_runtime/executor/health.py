"""Rank health: what the heartbeat knows of each worker (`RankHealth`), the step deadline
(`StepClock`) and the heartbeat itself (`Heartbeat`, inherited by `base.Executor`).

Heartbeat (`start_heartbeat`): every worker is pinged every `interval` on a lane that no step
or transfer blocks. A ping that fails because the worker is gone makes it "dead"; one that
stays unanswered for `hang_timeout` (or for `step_grace` once a step is past its deadline)
makes it "unresponsive", and the worker is fenced (killed) at once, so no collective waits on
it. A pending worker (starting, loading, a warm spare: in no step) gets `pending_hang_timeout`
(30 s) instead: it blocks no step, and on a loaded node its first imports and weight loads
can hold its interpreter for seconds. `on_lost` is then called; the caller shrinks around it
(`moe_runtime.elastic.recovery`).

Step deadline: derived from observed step times (`step_deadline`), not a fixed timeout.

The executor provides the members (`_health_members`), the pings (`_send_ping`, `_poll_ping`)
and the fence (`fence`); the rounds, and judging what a late answer means, are here.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

HEALTH_OK = "ok"
HEALTH_DEAD = "dead"
HEALTH_UNRESPONSIVE = "unresponsive"

#: Limits of the step deadline (seconds): at least MIN, DEADLINE_FACTOR x the slowest recent
#: step otherwise. Past it, a rank whose ping is older than `step_grace` counts as hung.
MIN_STEP_DEADLINE = 2.0
DEADLINE_FACTOR = 5.0
RECENT_STEPS = 100

LostCallback = Callable[[dict[int, str]], None]


@dataclasses.dataclass
class RankHealth:
    """What the heartbeat knows of one worker (kept with the worker, so relabels follow it).

    state: HEALTH_OK, HEALTH_DEAD or HEALTH_UNRESPONSIVE; last_ok: monotonic time of the last
    answered ping; lost_at: when it stopped being ok; ping: the outstanding ping (the
    executor's handle) and when it was sent.
    """

    state: str = HEALTH_OK
    last_ok: float = dataclasses.field(default_factory=time.monotonic)
    lost_at: float | None = None
    reason: str = ""
    ping: Any = None
    ping_sent: float = 0.0
    fenced: bool = False

    def lose(self, state: str, reason: str, now: float) -> bool:
        """Mark it lost; True the first time."""
        first = self.state == HEALTH_OK
        if first:
            self.state, self.reason = state, reason  # the first reason is the telling one
        elif state == HEALTH_DEAD:
            self.state = state
        if self.lost_at is None:
            self.lost_at = now
        return first


class StepClock:
    """Observed step durations and the deadline derived from them (see `MIN_STEP_DEADLINE`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self.started: float | None = None

    def begin(self) -> None:
        with self._lock:
            self.started = time.monotonic()

    def end(self, *, ok: bool) -> None:
        with self._lock:
            if ok and self.started is not None:
                self._recent.append(time.monotonic() - self.started)
            self.started = None

    def deadline(self) -> float:
        """Seconds a step may run before its ranks are checked for a hang."""
        with self._lock:
            slowest = max(self._recent, default=0.0)
        return max(MIN_STEP_DEADLINE, DEADLINE_FACTOR * slowest)

    def overdue(self, now: float) -> bool:
        """A step is running and has passed its deadline."""
        with self._lock:
            started = self.started
        return started is not None and now - started > self.deadline()


class Heartbeat(abc.ABC):
    """The health half of `base.Executor` (see the module docstring); the state is the
    executor's."""

    _heartbeat: threading.Thread | None = None
    _heartbeat_stop: threading.Event | None = None
    #: Seconds a ping may stay unanswered once a step is past its deadline.
    step_grace: float = 1.0
    #: Seconds a pending worker's ping may stay unanswered (it is in no step).
    pending_hang_timeout: float = 30.0
    #: Observed step durations and the step deadline; every executor sets its own.
    clock: StepClock

    @property
    def ranks(self) -> list[int]:
        raise NotImplementedError

    @abc.abstractmethod
    def _health_members(self) -> dict[int, RankHealth]:
        """The RankHealth of every live worker, by its current label."""

    @abc.abstractmethod
    def _send_ping(self, label: int) -> Any:
        """Start a ping of worker `label` on its health lane; returns a handle for _poll_ping."""

    @abc.abstractmethod
    def _poll_ping(self, handle: Any) -> str | None:
        """None while pending, else HEALTH_OK or HEALTH_DEAD (the worker is gone)."""

    @abc.abstractmethod
    def fence(self, ranks: Sequence[int], *, reason: str = "fenced") -> None:
        """Kill those workers now (a hung worker must not hold its peers in a collective);
        they stay listed (state dead) until `remove_ranks`."""

    def health(self) -> dict[int, RankHealth]:
        """A copy of what the heartbeat knows, by label (no call is made)."""
        return {
            label: dataclasses.replace(h, ping=None) for label, h in self._health_members().items()
        }

    def lost_ranks(self) -> dict[int, RankHealth]:
        """Live workers the heartbeat (or a failed step) found dead or unresponsive."""
        return {label: h for label, h in self.health().items() if h.state != HEALTH_OK}

    def start_heartbeat(
        self,
        *,
        interval: float = 0.1,
        hang_timeout: float = 3.0,
        on_lost: LostCallback | None = None,
    ) -> None:
        """Ping every worker every `interval` s in a thread (see the module docstring)."""
        if self._heartbeat is not None:
            return
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval):
                try:
                    lost = self.heartbeat_round(hang_timeout=hang_timeout)
                except Exception:  # noqa: BLE001 - the heartbeat must outlive one bad round
                    log.exception("heartbeat round failed")
                    continue
                if lost and on_lost is not None:
                    try:
                        on_lost(lost)
                    except Exception:  # noqa: BLE001 - the handler logs its own failure
                        log.exception("heartbeat: on_lost handler failed for %s", lost)

        self._heartbeat_stop = stop
        self._heartbeat = threading.Thread(target=run, name="rank-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        if self._heartbeat_stop is not None:
            self._heartbeat_stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=1.0)  # one round is short (non-blocking polls)
        self._heartbeat = self._heartbeat_stop = None

    def heartbeat_round(self, *, hang_timeout: float) -> dict[int, str]:
        """One round: collect answered pings, send new ones, judge; fence hung workers.

        Returns {label: state} of the workers found lost in this round.
        """
        now = time.monotonic()
        overdue = self.clock.overdue(now)
        newly: dict[int, str] = {}
        hung: list[int] = []
        stepping = set(self.ranks)
        for label, h in self._health_members().items():
            if h.state == HEALTH_DEAD:
                continue
            if h.ping is not None:
                result = self._poll_ping(h.ping)
                if result == HEALTH_OK:
                    h.ping = None
                    if h.state == HEALTH_OK:
                        h.last_ok = now
                elif result == HEALTH_DEAD:
                    h.ping = None
                    if h.lose(HEALTH_DEAD, h.reason or "its process died", now):
                        newly[label] = HEALTH_DEAD
                else:
                    waited = now - h.ping_sent
                    if label not in stepping:
                        limit = max(hang_timeout, self.pending_hang_timeout)
                    elif overdue:
                        limit = min(hang_timeout, self.step_grace)
                    else:
                        limit = hang_timeout
                    if waited > limit and h.state == HEALTH_OK:
                        h.lose(HEALTH_UNRESPONSIVE, f"no heartbeat answer for {waited:.1f}s", now)
                        newly[label] = HEALTH_UNRESPONSIVE
                        hung.append(label)
            if h.ping is None and h.state == HEALTH_OK:
                h.ping, h.ping_sent = self._send_ping(label), now
        if hung:
            log.error("heartbeat: ranks %s do not answer: fencing them", hung)
            self.fence(hung, reason="unresponsive")
        return newly
