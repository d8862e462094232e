"""Waiting for the members of a group join (`gather_joins`), shared by the executors.

A join needs every member inside it at once. When one member fails (its process died, its pod
was lost, the heartbeat found it unresponsive, its join raised), waiting for all results would
keep the others in their rendezvous until the group timeout (300 s for a resize), holding their
control lanes, and then blame the members that did wait. Instead the first failure calls the
others' joins off (`RankGroups.abort_join`, in a lane nothing queues in), waits a moment for
them to let go, and raises the failure naming the member at fault.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from typing import Generic, TypeVar

from moe_runtime.executor import base

H = TypeVar("H")

#: Seconds between looks at the heartbeat while members join.
POLL_SECONDS = 0.1
#: Seconds the members whose join was called off get to return (their lanes are free then).
ABORT_GRACE_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class JoinCalls(Generic[H]):
    """How one executor waits on its calls.

    wait(pending, timeout): those of `pending` that finished (maybe none); result(label,
    handle): returns, or raises the executor's error for that member (RankDied for a dead one);
    abort(labels): calls those members' joins off without queueing behind them; lost(): the
    members the heartbeat found dead or unresponsive.
    """

    wait: Callable[[list[H], float], list[H]]
    result: Callable[[int, H], object]
    abort: Callable[[list[int]], None]
    lost: Callable[[], Collection[int]]


def gather_joins(
    handles: Mapping[int, H],
    calls: JoinCalls[H],
    *,
    what: str,
    timeout: float | None,
) -> None:
    """Wait for every member's join (`handles`: label -> its call); the first failure calls the
    rest off and is raised (see the module docstring). timeout: TimeoutError naming the members
    still joining past it (their joins are called off too)."""
    label_of = {h: label for label, h in handles.items()}  # refs and futures hash
    pending = list(handles.values())
    deadline = None if timeout is None else time.monotonic() + timeout
    failure: BaseException | None = None
    while pending and failure is None:
        left = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - time.monotonic())
        if left <= 0:
            late = sorted(label_of[h] for h in pending)
            failure = TimeoutError(f"{what}: ranks {late} did not join within {timeout}s")
            break
        done = calls.wait(pending, left)
        pending = _without(pending, done)
        for handle in done:
            try:
                calls.result(label_of[handle], handle)
            except Exception as exc:  # noqa: BLE001 - raised below, once the rest let go
                failure = exc
                break
        if failure is None:
            lost = sorted(set(calls.lost()) & {label_of[h] for h in pending})
            if lost:
                failure = base.RankDied(f"{what}: ranks {lost} were lost while joining", ranks=lost)
    if failure is None:
        return
    if pending:
        calls.abort(sorted(label_of[h] for h in pending))
        grace = time.monotonic() + ABORT_GRACE_SECONDS
        while pending and time.monotonic() < grace:
            pending = _without(pending, calls.wait(pending, POLL_SECONDS))
    raise failure


def _without(pending: list[H], done: list[H]) -> list[H]:
    finished = set(done)
    return [h for h in pending if h not in finished]
