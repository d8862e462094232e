"""`LocalExecutor`'s threads: a collective needs every member inside it at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from moe_runtime import worker as worker_mod
from moe_runtime.executor import base, local

#: More calls held at once than the bounded pool the executor once ran every call on (64).
HELD_PER_RANK = 40


@pytest.fixture()
def two_ranks() -> Iterator[local.LocalExecutor]:
    ex = local.LocalExecutor(2)
    yield ex
    ex.shutdown()


def test_a_group_builds_while_many_calls_are_held_on_every_rank(
    two_ranks: local.LocalExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many slow control calls in flight (exports, stagings, pings of a busy deployment) never
    keep a rendezvous from gathering its members: before, the members of a group join queued
    behind them and the build waited out its whole timeout."""
    release = threading.Event()
    held = threading.Semaphore(0)

    def hold(self: worker_mod.RankWorker) -> int:
        held.release()
        release.wait(120)
        return self.label

    monkeypatch.setattr(worker_mod.RankWorker, "hold", hold, raising=False)
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
            assert {role for epoch, role in two_ranks.worker(rank).groups() if epoch == 1} == set(
                base.GROUP_ROLES
            )
    finally:
        release.set()
        for t in callers:
            t.join(30)
    results: list[Any] = two_ranks.collective_rpc("hold")
    assert results == [0, 1]
