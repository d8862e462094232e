"""The API client's connection slots (``k8s.api.Slots``): a bounded number of requests in
flight, the waiting ones served by priority, then in arrival order."""

from __future__ import annotations

import asyncio

import pytest

from moe_operator.k8s import api as k8s_api


def test_waiters_get_slots_by_priority_then_arrival() -> None:
    async def scenario() -> list[str]:
        slots = k8s_api.Slots(1)
        order: list[str] = []
        gate = asyncio.Event()

        async def holder() -> None:
            async with slots.held():
                await gate.wait()

        async def request(name: str, priority: int) -> None:
            async with slots.held(priority):
                order.append(name)

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiting = [
            asyncio.create_task(request(name, priority))
            for name, priority in [
                ("read-1", k8s_api.PRIORITY_DEFAULT),
                ("status-1", k8s_api.PRIORITY_DEFAULT),
                ("raycluster-1", k8s_api.PRIORITY_FIRST),
                ("read-2", k8s_api.PRIORITY_DEFAULT),
                ("raycluster-2", k8s_api.PRIORITY_FIRST),
            ]
        ]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *waiting)
        return order

    assert asyncio.run(scenario()) == [
        "raycluster-1",
        "raycluster-2",
        "read-1",
        "status-1",
        "read-2",
    ]


def test_a_cancelled_waiter_gives_its_turn_away_and_no_slot_is_lost() -> None:
    async def scenario() -> None:
        slots = k8s_api.Slots(2)
        await slots.acquire()
        await slots.acquire()
        cancelled = asyncio.create_task(slots.acquire(k8s_api.PRIORITY_FIRST))
        after = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        slots.release()
        await asyncio.wait_for(after, 1.0)  # the cancelled one's turn went to the next
        slots.release()
        slots.release()
        # both slots are free again: two acquire at once, a third waits
        await asyncio.wait_for(slots.acquire(), 1.0)
        await asyncio.wait_for(slots.acquire(), 1.0)
        third = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0.01)
        assert not third.done()
        slots.release()
        await asyncio.wait_for(third, 1.0)

    asyncio.run(scenario())
