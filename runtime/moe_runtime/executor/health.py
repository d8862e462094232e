"""Rank health: what the heartbeat knows of each worker (`RankHealth`), the step deadline
(`StepClock`) and the heartbeat itself (`Heartbeat`, a part of every executor).

Heartbeat (`Heartbeat.start`): every worker is pinged every `interval` on a lane that no step
or transfer blocks. A ping that fails because the worker is gone makes it "dead"; one that
stays unanswered for `hang_timeout` (or for `grace` once a step is past its deadline: one
second, or five times the slowest recent ping answer on a loaded host) makes it
"unresponsive", and the worker is fenced (killed) at once, so no collective waits on it. A
pending worker (starting, loading, a warm spare: in no step) gets `pending_hang_timeout`
(30 s) instead: it blocks no step, and on a loaded node its first imports and weight loads
can hold its interpreter for seconds; a worker that joins the step graph gets the shorter
limit from then on, not from a ping it was sent while pending. The stepped workers are never
all fenced for a hang: when none of them answers (a starved host, or the only rank of a
one-rank deployment busy with its first compile), a recovery would have no survivor to shrink
to, so the heartbeat warns and waits (a worker that died still fails its ping and is found
dead). `on_lost` is then called; the caller shrinks around it
(`moe_runtime.elastic.recovery`).

Step deadline: derived from observed step times (`step_deadline`), not a fixed timeout; so is
the op timeout of a new step group (`StepClock.group_timeout`: a collective that waits longer
fails its group). A stepped worker found lost makes its peers abort their live groups at once
(`abort_peers`): NCCL notices no dead peer by itself, a collective waiting for it would wait
for the group's op timeout.

The executor gives the heartbeat its members, the pings and the fence (constructor arguments);
the rounds, and judging what a late answer means, are here.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

log = logging.getLogger(__name__)

HEALTH_OK = "ok"
HEALTH_DEAD = "dead"
HEALTH_UNRESPONSIVE = "unresponsive"

#: Limits of the step deadline (seconds): at least MIN, DEADLINE_FACTOR x the slowest recent
#: step otherwise. Past it, a rank whose ping is older than `step_grace` counts as hung.
MIN_STEP_DEADLINE = 2.0
DEADLINE_FACTOR = 5.0
#: Once a step is past its deadline, a stepped worker's ping counts as late after `step_grace`
#: or GRACE_FACTOR x the slowest ping answered in the last RECENT_PING_SECONDS, whichever is
#: longer: a host with more busy processes than cores answers every ping slowly, and a rank
#: starved there for a moment is not hung (a hung rank's peers, waiting in a collective for
#: it, keep answering at once, so the grace stays short where it matters).
GRACE_FACTOR = 5.0
RECENT_PING_SECONDS = 10.0
RECENT_STEPS = 100
#: Limits of a step group's op timeout (seconds): at least MIN, GROUP_TIMEOUT_FACTOR x the
#: slowest recent step otherwise (a collective waits at most for its slowest peer's step; the
#: margin covers a peer held by a transfer or a loaded host).
MIN_GROUP_TIMEOUT = 30.0
GROUP_TIMEOUT_FACTOR = 20.0

#: Seconds between two warnings that no stepped rank answers (see `Heartbeat.round`).
WAITING_LOG_INTERVAL = 5.0

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
    #: Since when it is in the step graph (None: pending); a stepped worker's shorter
    #: `hang_timeout` counts from then, not from a ping sent while it was pending.
    stepping_since: float | None = None

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
        #: The floor of `group_timeout` (tests lower it).
        self.min_group_timeout = MIN_GROUP_TIMEOUT

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

    def group_timeout(self) -> float:
        """Seconds one collective of a new step group may take (see `MIN_GROUP_TIMEOUT`)."""
        with self._lock:
            slowest = max(self._recent, default=0.0)
        return max(self.min_group_timeout, GROUP_TIMEOUT_FACTOR * slowest)

    def overdue(self, now: float) -> bool:
        """A step is running and has passed its deadline."""
        with self._lock:
            started = self.started
        return started is not None and now - started > self.deadline()


class Heartbeat:
    """The executor's heartbeat (see the module docstring), built with what it watches.

    members(): the RankHealth of every live worker by its current label (the objects the
    heartbeat updates); stepping(): the labels in the step graph; send_ping(label) starts a
    ping on the worker's health lane and returns a handle; poll_ping(handle): None while it
    is pending, else HEALTH_OK or HEALTH_DEAD (the worker is gone); fence(labels, reason=...)
    kills hung workers; abort_peers(labels): the stepped workers were lost, their peers must
    leave the live groups (see the module docstring); ping_error(handle): why a dead ping's
    worker cannot serve when it said so (`RankFailed`), else None; clock: the observed step
    times; now: the monotonic clock (tests give their own).
    """

    def __init__(
        self,
        *,
        members: Callable[[], Mapping[int, RankHealth]],
        stepping: Callable[[], Collection[int]],
        send_ping: Callable[[int], Any],
        poll_ping: Callable[[Any], str | None],
        fence: Callable[..., None],
        clock: StepClock,
        abort_peers: Callable[[list[int]], None] = lambda labels: None,
        ping_error: Callable[[Any], str | None] = lambda handle: None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._members = members
        self._stepping = stepping
        self._send_ping = send_ping
        self._poll_ping = poll_ping
        self._fence = fence
        self._abort_peers = abort_peers
        self._ping_error = ping_error
        self.clock = clock
        self._now = now
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        #: Seconds a ping may stay unanswered once a step is past its deadline (at least:
        #: `grace`).
        self.step_grace = 1.0
        #: (answered at, seconds it took) of recent pings (`grace`)
        self._answers: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        #: Seconds a pending worker's ping may stay unanswered (it is in no step).
        self.pending_hang_timeout = 30.0
        self._waiting_logged = float("-inf")

    @staticmethod
    def _hung(
        h: RankHealth,
        label: int,
        waited: float,
        now: float,
        newly: dict[int, str],
        hung: list[int],
    ) -> None:
        h.lose(HEALTH_UNRESPONSIVE, f"no heartbeat answer for {waited:.1f}s", now)
        newly[label] = HEALTH_UNRESPONSIVE
        hung.append(label)

    def health(self) -> dict[int, RankHealth]:
        """A copy of what the heartbeat knows, by label (no call is made)."""
        return {label: dataclasses.replace(h, ping=None) for label, h in self._members().items()}

    def lost_ranks(self) -> dict[int, RankHealth]:
        """Live workers the heartbeat (or a failed step) found dead or unresponsive."""
        return {label: h for label, h in self.health().items() if h.state != HEALTH_OK}

    def start(
        self,
        *,
        interval: float = 0.1,
        hang_timeout: float = 3.0,
        on_lost: LostCallback | None = None,
    ) -> None:
        """Ping every worker every `interval` s in a thread (see the module docstring)."""
        if self._thread is not None:
            return
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval):
                try:
                    lost = self.round(hang_timeout=hang_timeout)
                except Exception:  # noqa: BLE001 - the heartbeat must outlive one bad round
                    log.exception("heartbeat round failed")
                    continue
                if lost and on_lost is not None:
                    try:
                        on_lost(lost)
                    except Exception:  # noqa: BLE001 - the handler logs its own failure
                        log.exception("heartbeat: on_lost handler failed for %s", lost)

        self._stop = stop
        self._thread = threading.Thread(target=run, name="rank-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)  # one round is short (non-blocking polls)
        self._thread = self._stop = None

    def grace(self, now: float) -> float:
        """Seconds a stepped worker's ping may stay unanswered once a step is past its
        deadline: `step_grace`, longer on a host that answers every ping slowly (see
        GRACE_FACTOR)."""
        recent = [took for at, took in self._answers if now - at <= RECENT_PING_SECONDS]
        return max(self.step_grace, GRACE_FACTOR * max(recent, default=0.0))

    def round(self, *, hang_timeout: float) -> dict[int, str]:
        """One round: collect answered pings, send new ones, judge; fence hung workers.

        Returns {label: state} of the workers found lost in this round.
        """
        now = self._now()
        overdue = self.clock.overdue(now)
        newly: dict[int, str] = {}
        hung: list[int] = []
        late: dict[int, float] = {}  # stepped workers past their limit: {label: waited}
        stepping = set(self._stepping())
        members = self._members()
        for label, h in members.items():
            if label not in stepping:
                h.stepping_since = None
            elif h.stepping_since is None:
                h.stepping_since = now
            if h.state == HEALTH_DEAD:
                continue
            if h.ping is not None:
                result = self._poll_ping(h.ping)
                if result == HEALTH_OK:
                    h.ping = None
                    if h.state == HEALTH_OK:
                        h.last_ok = now
                        self._answers.append((now, now - h.ping_sent))
                elif result == HEALTH_DEAD:
                    why = self._ping_error(h.ping) or "its process died"
                    h.ping = None
                    if h.lose(HEALTH_DEAD, h.reason or why, now):
                        newly[label] = HEALTH_DEAD
                elif h.state == HEALTH_OK:
                    waited = now - h.ping_sent
                    if label not in stepping:
                        if waited > max(hang_timeout, self.pending_hang_timeout):
                            self._hung(h, label, waited, now, newly, hung)
                    else:
                        limit = min(hang_timeout, self.grace(now)) if overdue else hang_timeout
                        since = max(h.ping_sent, h.stepping_since or h.ping_sent)
                        if now - since > limit:
                            late[label] = waited
            if h.ping is None and h.state == HEALTH_OK:
                h.ping, h.ping_sent = self._send_ping(label), now
        answering = [
            label
            for label in stepping
            if label in members and members[label].state == HEALTH_OK and label not in late
        ]
        if late and not answering:
            # No stepped worker answers: fencing them all leaves nothing to shrink to (a
            # recovery needs a survivor), and on a starved host (more busy processes than
            # cores) it would kill a deployment whose ranks are only slow. Wait for them; a
            # worker that died still fails its ping and is found dead.
            if now - self._waiting_logged >= WAITING_LOG_INTERVAL:
                self._waiting_logged = now
                log.warning(
                    "heartbeat: no stepped rank answers (%s): not fencing the last ranks; "
                    "waiting for them",
                    ", ".join(f"rank {k} for {v:.1f}s" for k, v in sorted(late.items())),
                )
        else:
            for label, waited in late.items():
                self._hung(members[label], label, waited, now, newly, hung)
        if hung:
            log.error("heartbeat: ranks %s do not answer: fencing them", hung)
            self._fence(hung, reason="unresponsive")
        lost_stepped = sorted(label for label in newly if label in stepping)
        if lost_stepped:
            self._abort_peers(lost_stepped)
        return newly
