"""`LocalExecutor`'s threads: a collective needs every member inside it at once."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from moe_runtime.executor import local
from moe_runtime.rank import groups as groups_mod

#: More calls held at once than the bounded pool the executor once ran every call on (64).
HELD_PER_RANK = 40


class Holding:
    """Rank hooks with one more control method, `hold`: a slow call (an export, a staging, a
    ping of a busy deployment) that waits until the test releases it, then names its rank."""

    def __init__(self, index: int, held: threading.Semaphore, release: threading.Event) -> None:
        self.index, self.held, self.release = index, held, release

    def check(self, point: str, where: str) -> None:
        return None

    def controls(self) -> Mapping[str, Callable[..., Any]]:
        return {"hold": self.hold}

    def hold(self) -> int:
        self.held.release()
        self.release.wait(120)
        return self.index


@pytest.fixture()
def held() -> threading.Semaphore:
    return threading.Semaphore(0)


@pytest.fixture()
def release() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture()
def two_ranks(held: threading.Semaphore, release: threading.Event) -> Iterator[local.LocalExecutor]:
    index = itertools.count()
    ex = local.LocalExecutor(2, rank_hooks=lambda: Holding(next(index), held, release))
    yield ex
    release.set()
    ex.shutdown()


def test_a_group_builds_while_many_calls_are_held_on_every_rank(
    two_ranks: local.LocalExecutor, held: threading.Semaphore, release: threading.Event
) -> None:
    """Many slow control calls in flight never keep a rendezvous from gathering its members:
    before, the members of a group join queued behind them and the build waited out its
    whole timeout."""
    callers = [
        threading.Thread(target=two_ranks.collective_rpc, args=("hold",), daemon=True)
        for _ in range(HELD_PER_RANK)
    ]
    try:
        for t in callers:
            t.start()
        for _ in range(HELD_PER_RANK * 2):
            assert held.acquire(timeout=10), "calls queued behind the held ones"
        two_ranks.build_groups([0, 1], epoch=1, timeout=10)
        for rank in (0, 1):
            built = {role for epoch, role in two_ranks.worker(rank).groups.groups() if epoch == 1}
            assert built == set(groups_mod.ROLES)
    finally:
        release.set()
        for t in callers:
            t.join(30)
    results: list[Any] = two_ranks.collective_rpc("hold")
    assert results == [0, 1]
