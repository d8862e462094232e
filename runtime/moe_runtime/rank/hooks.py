"""The rank's one seam for tests: an optional `Hooks` object given to `RankWorker`.

The product installs none. Tests install the fault hooks of `tests/support/faults.py` (fail or
stall the next call of an operation), through the executors' `rank_hooks` factory
(`LocalExecutor(..., rank_hooks=...)`, `RayExecutor(..., rank_hooks=...)`: a Ray actor builds
its hooks from the factory, which is pickled by reference, so its module must be importable
there) or, for `moe-runtime serve`, through `MOE_RANK_HOOKS=module:attribute` (`from_env`).

- `check(point, where)` runs at every fault point (`POINTS`) with the rank's log context; it may
  sleep (a hung rank) or raise (a failed operation). Collective operations reach their point
  after their collective part, so peers never hang.
- `controls()`: more control methods by name, callable through `Executor.collective_rpc`
  (the fault hooks' `fail_next`, `stall_next`, `disarm`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

#: Where the rank calls `Hooks.check`: the name of the operation (a control method,
#: "commit_staged" for the EPLB commit inside a step, "forward" just before a step's forward
#: pass, where its peers are about to wait for it in the expert collectives, "load_tensor"
#: before each tensor (or expert) `load_weights` reads: a test slows a load there).
POINTS = (
    "load_weights",
    "load_tensor",
    "execute_step",
    "forward",
    "join_group",
    "transfer_non_expert",
    "stage_experts",
    "activate",
    "commit_staged",
)
#: The environment variable `moe-runtime serve` reads a hooks factory from.
ENV = "MOE_RANK_HOOKS"


class Hooks(Protocol):
    """What a rank calls of its hooks (see the module docstring)."""

    def check(self, point: str, where: str) -> None: ...

    def controls(self) -> Mapping[str, Callable[..., Any]]: ...


HooksFactory = Callable[[], Hooks]


def load(path: str) -> HooksFactory:
    """The factory named by `path` ("module:attribute"); ValueError naming it when it is not."""
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ValueError(f"{ENV} must be 'module:attribute', got {path!r}")
    try:
        factory = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{ENV}={path!r}: {exc}") from exc
    if not callable(factory):
        raise ValueError(f"{ENV}={path!r} is not callable")
    made: HooksFactory = factory
    return made


def from_env() -> HooksFactory | None:
    """The factory `MOE_RANK_HOOKS` names, or None when it is unset."""
    path = os.environ.get(ENV)
    return load(path) if path else None
