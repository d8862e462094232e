"""Backpressure: the queue bound refuses a flood with 429 + Retry-After, never during a resize,
and every request it accepted completes (engine over the fake executor, HTTP in process)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import fastapi
import httpx
import pytest

from moe_runtime import server
from moe_runtime.engine import core, request, seam
from moe_runtime.engine import queue as queue_mod
from tests.support import engine_fakes as fakes

BOUND = 4


def test_the_bound_counts_only_arrivals_outside_a_resize() -> None:
    resizing = threading.Event()
    q = queue_mod.RequestQueue(max_queued=2, exempt=resizing.is_set)
    handles = [request.RequestHandle(fakes.req(f"r{i}")) for i in range(6)]
    q.put(handles[0], exempt=q.exempt_now())
    q.put(handles[1], exempt=q.exempt_now())
    with pytest.raises(queue_mod.QueueFull) as full:
        q.put(handles[2], exempt=q.exempt_now())
    assert full.value.retry_after >= queue_mod.MIN_RETRY_AFTER
    assert "--max-queued-requests" in str(full.value)
    resizing.set()
    q.put(handles[2], exempt=q.exempt_now())  # a resize runs: queued, not counted
    q.put(handles[3], exempt=q.exempt_now())
    resizing.clear()
    assert (q.counted(), q.inbox_len()) == (2, 4)
    q.take_inbox()
    assert q.pop_head(admitted=True) is handles[0]  # a counted one leaves: one place frees
    assert q.remove({"r2"}) == [handles[2]]  # an uncounted one leaves: no place frees
    q.put(handles[4], exempt=q.exempt_now())
    with pytest.raises(queue_mod.QueueFull):
        q.put(handles[5], exempt=q.exempt_now())
    q.set_max_queued(None)
    q.put(handles[5], exempt=q.exempt_now())
    assert len(q.clear()) == 4 and q.counted() == 0


@pytest.fixture()
def app() -> Iterator[fastapi.FastAPI]:
    engine = core.Engine(
        fakes.FakeExecutor(1),
        fakes.Tokenizer(),
        seam.EngineConfig(max_model_len=64, max_num_seqs_per_rank=2, max_tokens_per_step=64),
        max_queued_requests=BOUND,
    )
    application = server.create_app(engine, served_model_name=fakes.MODEL)
    engine.start()
    yield application
    engine.stop()


async def flood(app: fastapi.FastAPI, n: int, *, hold: threading.Event) -> list[httpx.Response]:
    """`n` requests sent while the engine loop is held at a boundary (nothing is admitted), then
    released: the queue holds every accepted one at once."""
    engine: core.Engine = app.state.api.engine
    body = {"model": fakes.MODEL, "prompt": "ab", "max_tokens": 3, "temperature": 0}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        pending = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(n)]
        while sum(f.done() for f in pending) + engine.stats().num_waiting < n:
            await asyncio.sleep(0.005)  # every request is either answered or queued
        hold.set()
        return list(await asyncio.gather(*pending))


def held(app: fastapi.FastAPI) -> threading.Event:
    """Hold the engine loop at a step boundary until the returned event is set."""
    release, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        assert release.wait(30)

    app.state.api.engine.call_at_boundary(hold)
    assert entered.wait(30)
    return release


def test_a_flood_beyond_the_bound_gets_429_and_the_accepted_complete(app: fastapi.FastAPI) -> None:
    responses = asyncio.run(flood(app, 3 * BOUND, hold=held(app)))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) == BOUND and len(refused) == 2 * BOUND
    assert all(r.json()["choices"][0]["text"] == "cde" for r in ok)  # every accepted one, whole
    for r in refused:
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        assert int(r.headers["Retry-After"]) >= 1
    metrics = asyncio.run(fakes.get(app, "/metrics")).text
    assert f'moe_requests_total{{outcome="queue_full"}} {2.0 * BOUND}' in metrics


def test_a_flood_while_a_resize_runs_is_queued_whole(app: fastapi.FastAPI) -> None:
    engine: core.Engine = app.state.api.engine
    engine.queue.set_exempt(lambda: True)  # what ElasticService installs: coordinator.is_scaling
    responses = asyncio.run(flood(app, 3 * BOUND, hold=held(app)))
    assert [r.status_code for r in responses] == [200] * (3 * BOUND)
    # Those do not count once the resize is over: the bound applies to new arrivals.
    engine.queue.set_exempt(None)
    assert engine.queue.counted() == 0
    responses = asyncio.run(flood(app, BOUND + 1, hold=held(app)))
    assert sorted(r.status_code for r in responses) == [200] * BOUND + [429]


def test_no_bound_refuses_nothing(app: fastapi.FastAPI) -> None:
    app.state.api.engine.queue.set_max_queued(None)
    responses = asyncio.run(flood(app, 3 * BOUND, hold=held(app)))
    assert {r.status_code for r in responses} == {200}


def test_a_flood_of_long_prompts_beyond_the_kv_budget_queues() -> None:
    """Each request reserves prompt + max_tokens of KV (in blocks): with room for one such
    request per rank, a flood waits in the queue and runs one per rank at a time; every
    request completes, none fails; past the queue's bound, arrivals are refused (429), and a
    prompt longer than a rank's whole cache is refused (400)."""
    engine, executor = fakes.make_engine(
        2, kv_tokens_per_rank=64, kv_block_size=16, max_num_seqs_per_rank=8
    )
    engine.queue.set_max_queued(10)
    held: list[int] = []

    def record(_: object) -> None:
        held.append(max(sum(len(t) for t in kv.values()) for kv in executor.kv.values()))

    engine.on_step(record)
    with engine:
        handles = [
            engine.add_request(fakes.req(f"r{i}", "b" * 40, max_tokens=8, ignore_eos=True))
            for i in range(10)
        ]
        with pytest.raises(queue_mod.QueueFull):
            for i in range(10, 20):
                engine.add_request(fakes.req(f"r{i}", "b" * 40, max_tokens=8, ignore_eos=True))
        with pytest.raises(ValueError, match="KV cache holds 64"):
            engine.add_request(fakes.req("huge", "b" * 65, max_tokens=1))
        done = [h.result(30.0) for h in handles]
    assert all(d.finish_reason is request.FinishReason.LENGTH for d in done)
    assert all(len(d.token_ids) == 8 for d in done)
    assert max(held) <= 64  # never more than the budget on a rank
    per_step = [sum(len(b.seqs) for b in s.batches.values()) for s in executor.steps]
    assert max(per_step) == 2  # one request a rank at a time: the rest waited
