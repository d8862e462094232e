"""The rank pool over in-process workers (`LocalExecutor`): what a grow takes, the refill, and
the processes it drops (the Ray side: tests/integration/test_rank_pool.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from moe_runtime.elastic import rank_pool
from moe_runtime.executor import local


@pytest.fixture
def executor() -> Iterator[local.LocalExecutor]:
    ex = local.LocalExecutor(2)
    yield ex
    ex.shutdown()


def pool_of(ex: local.LocalExecutor, size: int, busy: list[bool]) -> rank_pool.RankPool:
    return rank_pool.RankPool(executor=ex, size=size, busy=lambda: busy[0], timeout=30)


def test_a_pass_starts_the_pool_beside_the_active_ranks(executor: local.LocalExecutor) -> None:
    pool = pool_of(executor, 2, [False])
    pool.maintain()
    assert pool.ready() == executor.pending_ranks == [2, 3]
    assert executor.ranks == [0, 1]
    pool.maintain()  # full: nothing more
    assert pool.started == 2 and len(executor.rank_infos()) == 4


def test_take_hands_over_processes_and_the_next_pass_refills(
    executor: local.LocalExecutor,
) -> None:
    pool = pool_of(executor, 2, [False])
    pool.maintain()
    assert pool.take(1) == [2]
    assert pool.ready() == [3] and pool.labels() == {3}
    assert pool.take(0) == []
    pool.maintain()
    assert pool.ready() == [3, 4] and pool.started == 3  # a new process beside the one left
    assert 2 in executor.pending_ranks  # the grow's now


def test_take_gives_what_there_is(executor: local.LocalExecutor) -> None:
    pool = pool_of(executor, 1, [False])
    pool.maintain()
    assert pool.take(3) == [2]
    assert pool.take(3) == []


def test_no_refill_while_a_resize_runs(executor: local.LocalExecutor) -> None:
    busy = [True]
    pool = pool_of(executor, 2, busy)
    pool.maintain()
    assert pool.ready() == [] and executor.pending_ranks == []
    busy[0] = False
    pool.maintain()
    assert len(pool.ready()) == 2


def test_a_lost_process_is_dropped_and_replaced(executor: local.LocalExecutor) -> None:
    pool = pool_of(executor, 2, [False])
    pool.maintain()
    executor.fence([2], reason="test")
    assert pool.ready() == [3]
    pool.maintain()
    assert 2 not in executor.rank_infos()
    assert len(pool.ready()) == 2 and pool.started == 3


def test_a_negative_size_is_refused(executor: local.LocalExecutor) -> None:
    with pytest.raises(ValueError, match="rank_pool must be >= 0"):
        pool_of(executor, -1, [False])
