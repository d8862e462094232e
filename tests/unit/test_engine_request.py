"""RequestHandle: outputs pushed from another thread reach an asyncio consumer, in order,
with one loop wake-up per burst of pushes."""

from __future__ import annotations

import asyncio
import threading

from moe_runtime.engine import request


def _output(rid: str, i: int, *, finished: bool = False) -> request.RequestOutput:
    return request.RequestOutput(
        request_id=rid,
        new_token_ids=[i],
        new_text=str(i),
        finished=finished,
        finish_reason=request.FinishReason.LENGTH if finished else None,
    )


def test_outputs_pushed_from_a_thread_arrive_in_order_on_every_stream():
    streams, per_stream = 16, 50

    async def main() -> dict[str, list[int]]:
        handles = [request.RequestHandle(request.Request(f"r{i}", [1])) for i in range(streams)]

        def engine_thread() -> None:  # pushes as the engine does: one output per stream a step
            for step in range(per_stream):
                for h in handles:
                    h.push(_output(h.request_id, step, finished=step == per_stream - 1))

        async def consume(h: request.RequestHandle) -> list[int]:
            return [t async for out in h for t in out.new_token_ids]

        pusher = threading.Thread(target=engine_thread)
        pusher.start()
        got = await asyncio.gather(*(consume(h) for h in handles))
        pusher.join()
        return {h.request_id: g for h, g in zip(handles, got, strict=True)}

    got = asyncio.run(main())
    assert got == {f"r{i}": list(range(per_stream)) for i in range(streams)}


def test_a_burst_of_pushes_wakes_the_loop_once():
    async def main() -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal wakeups
            wakeups += 1
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        handles = [request.RequestHandle(request.Request(f"r{i}", [1])) for i in range(8)]
        # The loop is busy in this coroutine (no await) while the burst is pushed.
        pusher = threading.Thread(
            target=lambda: [h.push(_output(h.request_id, 7, finished=True)) for h in handles]
        )
        pusher.start()
        pusher.join()
        firsts = []
        for h in handles:
            firsts += [out.new_token_ids[0] async for out in h]
        return wakeups, firsts

    wakeups, firsts = asyncio.run(main())
    assert wakeups == 1
    assert firsts == [7] * 8


def test_pushing_after_the_consumer_loop_closed_drops_outputs_quietly():
    async def make() -> request.RequestHandle:
        return request.RequestHandle(request.Request("r", [1]))

    handle = asyncio.run(make())  # the loop is closed when run() returns
    handle.push(_output("r", 1))
    handle.push(_output("r", 2, finished=True))
    # The blocking side still sees everything.
    assert [o.new_token_ids for o in handle.iter_outputs(timeout=1)] == [[1], [2]]
    assert handle.result(timeout=1).token_ids == [1, 2]
