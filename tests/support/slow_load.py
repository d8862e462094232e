"""Rank hooks that slow or hold a rank's weight load (`moe_runtime.rank.hooks`, point
"load_tensor": before each tensor or expert `load_weights` reads), so a test sees load
progress part-way.

- `SlowLoad`: each read waits `$MOE_TEST_LOAD_DELAY_S` seconds first (a slow volume); for
  `moe-runtime serve`: `MOE_RANK_HOOKS=tests.support.slow_load:SlowLoad` (`PATH`).
- `HeldLoad(at)`: the `at`-th read waits until `release` is set (`reached` says it is there).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

#: What `MOE_RANK_HOOKS` names to slow a `moe-runtime serve`'s loads.
PATH: Final = "tests.support.slow_load:SlowLoad"
#: Seconds each read of a slowed load waits.
DELAY_ENV: Final = "MOE_TEST_LOAD_DELAY_S"
#: Seconds a held load waits for its release at most (a test that fails never hangs).
HOLD_LIMIT_S: Final = 60.0


class SlowLoad:
    """Every "load_tensor" point waits `$MOE_TEST_LOAD_DELAY_S` seconds (0: none)."""

    def __init__(self) -> None:
        self.delay = float(os.environ.get(DELAY_ENV, "0") or 0)

    def check(self, point: str, where: str) -> None:
        if point == "load_tensor" and self.delay > 0:
            time.sleep(self.delay)  # the slow read itself, not a wait for a condition

    def controls(self) -> Mapping[str, Callable[..., Any]]:
        return {}


class HeldLoad:
    """The `at`-th "load_tensor" point of this rank waits for `release`."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.count = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    def check(self, point: str, where: str) -> None:
        if point != "load_tensor":
            return
        self.count += 1
        if self.count == self.at:
            self.reached.set()
            self.release.wait(HOLD_LIMIT_S)

    def controls(self) -> Mapping[str, Callable[..., Any]]:
        return {}
