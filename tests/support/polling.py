"""Waiting for a condition with a deadline (tests poll; they never sleep a fixed time)."""

from __future__ import annotations

import time
from collections.abc import Callable


def poll(
    condition: Callable[[], object],
    what: str | Callable[[], object],
    deadline: float,
    *,
    every: float = 0.005,
) -> None:
    """Returns once `condition()` is true; AssertionError naming `what` after `deadline` s
    (a callable: called then, e.g. for the state that did not come)."""
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(every)
