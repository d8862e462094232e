"""Every live setting does what it says, on a live deployment (`moe-runtime serve`'s wiring,
LocalExecutor: real ranks and gloo groups, no Ray), changed through PATCH /elastic_ep/config:
drain timeout, EPLB, size bounds, max experts per rank, redundant experts, the queue bound; and
a request flood during a real resize is queued whole (no 429), while one outside it is not."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
from fastapi import testclient

from moe_runtime import cli
from moe_runtime import step as step_mod
from moe_runtime.engine import core
from moe_runtime.engine import request as req
from moe_runtime.eplb import policy
from moe_runtime.model import generate as generate_mod

SOURCE = "synthetic://tiny?seed=0&max_position_embeddings=512"
TOKEN = "live-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + (i * 5) % 11)] for i in range(8)]
LONG = 120
DEFAULTS = {
    "eplb_enabled": False,
    "eplb_window_size": 40,
    "eplb_step_interval": 40,
    "min_data_parallel_size": 1,
    "max_data_parallel_size": 4,
    "max_experts_per_rank": None,
    "num_redundant_experts": 0,
    "drain_timeout": 0,
    "max_queued_requests": 0,
    "warm_spare_ranks": 0,
    "draining": False,
}


@pytest.fixture(scope="module")
def runtime() -> Iterator[cli.Runtime]:
    torch.set_num_threads(1)
    args = cli.build_parser().parse_args(
        ["serve", "--model", SOURCE, "--data-parallel-size", "2", "--executor", "local"]
        + ["--max-data-parallel-size", "4", "--admin-token", TOKEN, "--no-eplb"]
    )
    rt = cli.build(args)
    yield rt
    rt.close()


@pytest.fixture()
def client(runtime: cli.Runtime) -> Iterator[testclient.TestClient]:
    """The app; after each test the settings are back to DEFAULTS and the size to 2."""
    assert runtime.app is not None
    c = testclient.TestClient(runtime.app)
    assert c.patch("/elastic_ep/config", json=DEFAULTS, headers=AUTH).status_code == 200
    yield c
    assert c.patch("/elastic_ep/config", json=DEFAULTS, headers=AUTH).status_code == 200
    scale(c, 2)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return generate_mod.generate_greedy(SOURCE, PROMPTS, LONG)


def scale(c: testclient.TestClient, to: int, **body: Any) -> dict[str, Any]:
    r = c.post(
        "/scale_elastic_ep?wait=true", json={"new_data_parallel_size": to, **body}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    last: dict[str, Any] = c.get("/elastic_ep/status", headers=AUTH).json()["resize"]
    return last


def patch(c: testclient.TestClient, **fields: Any) -> dict[str, Any]:
    r = c.patch("/elastic_ep/config", json=fields, headers=AUTH)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def engine_of(runtime: cli.Runtime) -> core.Engine:
    assert runtime.engine is not None
    return runtime.engine


def generate(engine: core.Engine, p: int, n: int, rid: str) -> req.RequestHandle:
    return engine.add_request(
        req.Request(
            request_id=rid,
            prompt_token_ids=PROMPTS[p],
            sampling=step_mod.SamplingParams(temperature=0.0),
            max_tokens=n,
            ignore_eos=True,
        )
    )


def poll(condition: Callable[[], bool], what: str, deadline: float = 60.0) -> None:
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize(
    ("live", "body", "finish_there"),
    [
        pytest.param({"drain_timeout": 600}, {}, True, id="long-live-default-finish-there"),
        pytest.param({"drain_timeout": 600}, {"drain_timeout": 0}, False, id="zero-migrate"),
    ],
)
def test_drain_timeout_bounds_how_long_a_shrink_waits_before_it_migrates(
    runtime: cli.Runtime,
    client: testclient.TestClient,
    reference: list[list[int]],
    live: dict[str, Any],
    body: dict[str, Any],
    finish_there: bool,
) -> None:
    engine = engine_of(runtime)
    scale(client, 4)
    patch(client, **live)
    handles = [generate(engine, p, LONG, f"drain-{p}") for p in range(len(PROMPTS))]
    poll(
        lambda: sum(engine.stats().seqs_per_rank.get(r, 0) for r in (2, 3)) >= 2,
        "long generations on ranks 2 and 3",
    )
    record = scale(client, 2, **body)
    results = [h.result(timeout=120) for h in handles]
    assert [r.token_ids for r in results] == reference  # none lost, none changed
    assert record["drain_timeout_s"] == (body or live)["drain_timeout"]
    if finish_there:
        assert record["sequences_migrated"] == 0
        assert record["sequences_drained"] >= 2
    else:
        assert record["sequences_migrated"] >= 2
        assert record["sequences_drained"] == 0


def test_eplb_switched_on_live_rebalances_and_off_does_not(
    runtime: cli.Runtime, client: testclient.TestClient
) -> None:
    engine = engine_of(runtime)
    assert runtime.elastic is not None
    rebalancer = runtime.elastic.rebalancer

    def load_for(steps: int) -> None:
        start = engine.stats().step_count
        handles = [generate(engine, p % 8, LONG, f"eplb-{start}-{p}") for p in range(16)]
        poll(lambda: engine.stats().step_count >= start + steps, f"{steps} steps")
        for h in handles:
            engine.abort(h.request_id)

    before = rebalancer.rebalances
    load_for(3 * DEFAULTS["eplb_step_interval"])
    assert rebalancer.rebalances == before  # off: nothing moves
    config = patch(client, eplb_enabled=True, eplb_step_interval=20, eplb_window_size=20)
    assert (config["eplb_enabled"], config["eplb_step_interval"]) == (True, 20)
    assert rebalancer.load.window.window_size == 20  # the window itself was resized
    deadline = time.monotonic() + 60
    while rebalancer.rebalances == before and time.monotonic() < deadline:
        load_for(20)
    assert rebalancer.rebalances > before, rebalancer.last_rebalance


@pytest.mark.parametrize(
    ("fields", "size", "words"),
    [
        pytest.param({"max_data_parallel_size": 3}, 4, "[1, 3]", id="max-size"),
        pytest.param({"min_data_parallel_size": 2}, 1, "[2, 4]", id="min-size"),
        pytest.param({"maxExpertsPerRank": 3}, 2, "at most 3", id="max-experts-per-rank"),
    ],
)
def test_size_bounds_and_max_experts_per_rank_apply_to_the_next_resize(
    client: testclient.TestClient, fields: dict[str, Any], size: int, words: str
) -> None:
    patch(client, **fields)
    r = client.post("/scale_elastic_ep", json={"new_data_parallel_size": size}, headers=AUTH)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "new_data_parallel_size" and words in error["message"]
    patch(client, **DEFAULTS)
    assert scale(client, size)["stage"] == "Completed"


def test_bad_settings_are_refused_whole(client: testclient.TestClient) -> None:
    before = client.get("/elastic_ep/config", headers=AUTH).json()
    r = client.patch(
        "/elastic_ep/config",
        json={"eplb_enabled": True, "min_data_parallel_size": 3, "max_data_parallel_size": 2},
        headers=AUTH,
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "min_data_parallel_size" and "<=" in error["message"]
    assert client.get("/elastic_ep/config", headers=AUTH).json() == before


def test_num_redundant_experts_changes_the_slots_with_the_next_resize(
    runtime: cli.Runtime, client: testclient.TestClient, reference: list[list[int]]
) -> None:
    config = patch(client, num_redundant_experts=4)
    assert (config["num_physical_experts"], config["pending"]) == (8, ["num_redundant_experts"])
    scale(client, 4)
    config = client.get("/elastic_ep/config", headers=AUTH).json()
    assert config["num_physical_experts"] == policy.num_physical_for(8, 4, 4) == 12
    assert config["pending"] == []
    engine = engine_of(runtime)
    outs = [generate(engine, p, 16, f"redundant-{p}").result(timeout=120) for p in range(8)]
    assert [o.token_ids for o in outs] == [ref[:16] for ref in reference]


async def _flood(runtime: cli.Runtime, n: int, release: threading.Event) -> list[int]:
    engine = engine_of(runtime)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    transport = httpx.ASGITransport(app=runtime.app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        sent = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(n)]
        while sum(f.done() for f in sent) + engine.stats().num_waiting < n:
            await asyncio.sleep(0.005)
        release.set()
        return [r.status_code for r in await asyncio.gather(*sent)]


def _hold(engine: core.Engine) -> threading.Event:
    release, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        assert release.wait(60)

    engine.call_at_boundary(hold)
    assert entered.wait(30)
    return release


def test_a_flood_gets_429_beyond_the_bound_but_never_during_a_resize(
    runtime: cli.Runtime, client: testclient.TestClient
) -> None:
    engine = engine_of(runtime)
    assert runtime.elastic is not None
    coordinator = runtime.elastic.coordinator
    assert patch(client, maxQueuedRequests=3)["max_queued_requests"] == 3
    codes = asyncio.run(_flood(runtime, 12, _hold(engine)))
    assert sorted(codes) == [200] * 3 + [429] * 9  # the accepted ones all completed
    # The same flood while a resize runs: the engine is held at a boundary (the resize's
    # Switching waits behind it), so every request queues; none is refused.
    release = _hold(engine)
    r = client.post("/scale_elastic_ep", json={"new_data_parallel_size": 3}, headers=AUTH)
    assert r.status_code == 202
    assert coordinator.is_scaling
    done = threading.Event()
    codes_during: list[int] = []

    def flood() -> None:
        codes_during.extend(asyncio.run(_flood(runtime, 12, done)))

    thread = threading.Thread(target=flood)
    thread.start()
    assert done.wait(60)  # every request queued (or answered)
    assert coordinator.is_scaling  # ... while the resize ran
    release.set()
    thread.join(120)
    assert codes_during == [200] * 12
    record = coordinator.last()
    assert record is not None and coordinator.wait(record, 120) and record.succeeded
    metrics = client.get("/metrics").text
    assert 'moe_requests_total{outcome="queue_full"} 9.0' in metrics


def test_a_draining_runtime_closes_each_connection_after_its_answer(
    client: testclient.TestClient,
) -> None:
    """A rollout moved the Service away from this runtime: its answers say Connection: close
    (kept-alive clients reconnect through the Service); the request itself is served."""
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    assert "close" not in client.post("/v1/completions", json=body).headers.get("connection", "")
    assert patch(client, draining=True)["draining"] is True
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["connection"] == "close"
    assert patch(client, draining=False)["draining"] is False
    assert "close" not in client.post("/v1/completions", json=body).headers.get("connection", "")
