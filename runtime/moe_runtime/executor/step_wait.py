"""How long the driver sleeps before it reads a compiled graph's step output (`StepWait`).

Reading a compiled graph's output spins: Ray 2.60's shared-memory channel read is a
``sched_yield`` loop (``PlasmaObjectHeader::ReadAcquire``, `ray_step`'s docstring), so the
engine's step thread burns a core for the whole of every step it waits for. On a machine with
as many cores as processes that want one (2 here: the engine and one rank), the spinning
thread and the rank's forward pass then share the cores with everything else the engine does
and the scheduler moves them about: measured with `bench/engine_vs_hf.py` (64 streams, DP = 1),
the driver used 0.7-1.0 of a core over a run whose real work is ~5 % of one, and the rank's
decode step took 24-30 ms against 20-24 ms with the processes pinned apart.

The wait sleeps through most of a step instead and spins only for its end: a step's duration
is estimated from the ranks' own time (`StepOutput.seconds`) on recent steps of about the same
number of new tokens (a decode like the decodes before it; a prefill has none to go by and
is not slept on), and the driver sleeps until `fraction` of it has passed since the step can
have started (when it was sent, or when the step before it landed, whichever is later). A
step that ends earlier than estimated waits at most the difference (the estimate is the
fastest of the comparable recent steps, so this is rare and small). `fraction` 0 spins from
the start, as before (env `MOE_STEP_GRAPH_WAIT_FRACTION`).
"""

from __future__ import annotations

import collections
import threading
import time

from moe_runtime.executor import guards

#: The part of a step's estimated duration the driver sleeps through (default; env
#: `WAIT_FRACTION_ENV`; 0: spin from the start).
WAIT_FRACTION = 0.85
WAIT_FRACTION_ENV = "MOE_STEP_GRAPH_WAIT_FRACTION"
#: Recent steps kept to estimate from.
HISTORY = 8
#: Steps of new-token counts within this factor of each other are comparable.
COMPARABLE = 1.25
#: Shorter sleeps are not worth the system call.
MIN_SLEEP_SECONDS = 0.001


def fraction_from_env() -> float:
    """`WAIT_FRACTION`, or the env's MOE_STEP_GRAPH_WAIT_FRACTION (0 <= f < 1)."""
    return guards.float_from_env(
        WAIT_FRACTION_ENV, WAIT_FRACTION, valid=lambda v: 0 <= v < 1, wanted="a number in [0, 1)"
    )


class StepWait:
    """The estimate of the next step's end from the steps before it (module docstring)."""

    def __init__(self, fraction: float = WAIT_FRACTION, *, history: int = HISTORY) -> None:
        if not 0 <= fraction < 1:
            raise ValueError(f"fraction must be in [0, 1), got {fraction}")
        self.fraction = fraction
        self._lock = threading.Lock()
        #: (new tokens, the slowest rank's seconds) of the last steps that landed.
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=history)
        #: Monotonic time the last step landed.
        self._landed_at = 0.0
        #: Seconds slept in all (benchmarks, tests).
        self.slept = 0.0

    def estimate(self, tokens: int) -> float | None:
        """The fastest recent step of about `tokens` new tokens (None: none comparable)."""
        with self._lock:
            seconds = [
                s
                for t, s in self._recent
                if t and tokens and 1 / COMPARABLE <= tokens / t <= COMPARABLE
            ]
        return min(seconds) if seconds else None

    def delay(self, tokens: int, sent_at: float, now: float | None = None) -> float:
        """Seconds to sleep before reading the output of a step of `tokens` new tokens sent
        at `sent_at` (monotonic); 0 when there is nothing to go by."""
        if self.fraction <= 0:
            return 0.0
        est = self.estimate(tokens)
        if est is None:
            return 0.0
        with self._lock:
            started = max(sent_at, self._landed_at)
        now = time.monotonic() if now is None else now
        wait = started + self.fraction * est - now
        return wait if wait >= MIN_SLEEP_SECONDS else 0.0

    def wait(self, tokens: int, sent_at: float) -> float:
        """Sleep `delay(tokens, sent_at)`; returns the seconds slept."""
        pause = self.delay(tokens, sent_at)
        if pause:
            time.sleep(pause)
            self.slept += pause
        return pause

    def landed(self, tokens: int, seconds: float, at: float | None = None) -> None:
        """A step of `tokens` new tokens landed; its slowest rank ran `seconds`."""
        with self._lock:
            self._landed_at = time.monotonic() if at is None else at
            if tokens and seconds > 0:
                self._recent.append((tokens, seconds))
