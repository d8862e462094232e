"""The status payload of the contract (``moe_contract.status``), end to end: a real runtime
(``moe-runtime serve``'s wiring over the LocalExecutor: real ranks and gloo groups, no Ray),
started from the command line the operator builds for a MoEDeployment, resized by the
operator's own client, and its ``GET /elastic_ep/status`` read by the operator's
``plan.observe.runtime``: every key the runtime sends is one the contract declares, and what
the planner reads of it is what was sent. A field renamed on one side only fails here (the
runtime builds its payload strictly, ``Payload.exact``)."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from moe_contract import stages
from moe_contract import status as runtime_status
from moe_operator import runtime_client
from moe_operator.api import spec as spec_
from moe_operator.plan import builders, decide, observe
from moe_runtime import cli

TOKEN = "contract-token"
SPEC = spec_.MoEDeploymentSpec.model_validate(
    {
        "model": {"source": "synthetic://tiny?seed=0&max_position_embeddings=512"},
        "dataParallelSize": 2,
        "maxDataParallelSize": 4,
        "expertParallel": {"eplb": {"enabled": False}},
        "elastic": {"drainTimeoutSeconds": 0, "warmSpareRanks": 1},
    }
)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cli.Runtime]:
    """The runtime the operator's head command line describes (its token file here, ranks in
    this process: ``--executor local``, a flag the operator never passes)."""
    torch.set_num_threads(1)
    token_file = pathlib.Path(tmp_path_factory.mktemp("admin")) / "token"
    token_file.write_text(TOKEN)
    args = dataclasses.replace(
        builders.serve_args(owner_name="tiny", spec=SPEC), admin_token_file=str(token_file)
    )
    rt = cli.build(cli.build_parser().parse_args([*args.argv()[1:], "--executor", "local"]))
    yield rt
    rt.close()


def _spare_ready(pool: Any, timeout: float = 120.0) -> bool:
    """Polls until the pool has a ready spare (deadline: ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not pool.ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def payload(runtime: cli.Runtime) -> dict[str, Any]:
    """``/elastic_ep/status`` after a grow the warm spare covers (2->3) and a shrink (3->2):
    records with stages, freed ranks and a spare, as the operator's client reads them."""
    assert runtime.app is not None and runtime.elastic is not None
    pool = runtime.elastic.spares
    assert pool is not None and _spare_ready(pool)
    transport = httpx.ASGITransport(app=runtime.app)

    async def drive() -> dict[str, Any]:
        client = runtime_client.RuntimeClient(
            "http://runtime", token=TOKEN, timeout=300, transport=transport
        )
        async with client:
            for size in (3, 2):
                answer = await client.scale(size, wait=True)
                assert answer.resize_id and answer.stage == stages.Stage.COMPLETED.value
            assert _spare_ready(pool)
            return await client.status_json()

    return asyncio.run(drive())


def test_every_key_the_runtime_sends_is_the_contracts(payload: dict[str, Any]) -> None:
    status = runtime_status.ElasticStatus.exact(payload)
    assert status.to_json() == payload  # a round trip loses nothing
    assert [(r.from_size, r.to_size) for r in status.history][-2:] == [(2, 3), (3, 2)]
    assert status.spares and status.resize is not None and status.resize.freed


def test_the_operator_reads_what_the_runtime_sent(payload: dict[str, Any]) -> None:
    seen = observe.runtime(payload)
    assert seen is not None
    assert (seen.data_parallel_size, seen.target_data_parallel_size) == (2, 2)
    assert seen.stage == payload["stage"] == stages.Stage.COMPLETED.value
    assert seen.running is None and seen.resize is not None
    assert seen.resize.resize_id == payload["resize"]["resize_id"]
    assert [r.resize_id for r in seen.history] == [r["resize_id"] for r in payload["history"]]
    for parsed, sent in zip(seen.history, payload["history"], strict=True):
        assert (parsed.from_size, parsed.to_size, parsed.stage) == (
            sent["from"],
            sent["to"],
            sent["stage"],
        )
        assert parsed.stages == tuple((s["stage"], s["duration_s"]) for s in sent["stages"])
        assert parsed.freed_pods == tuple(f["pod"] for f in sent["freed"] if f["pod"])
        assert parsed.started_at == sent["started_at"] and parsed.kind == sent["kind"]
        # every stage the runtime names is one the operator mirrors into status.resize.stage
        assert all(decide.stage_of(name) is not None for name, _ in parsed.stages)
    assert seen.history[-1].freed_pods  # the shrink names the pods it freed
    active = sorted(r["pod"] for r in payload["ranks"] if r["active"])
    assert seen.active_pods == tuple(active)
    assert seen.spare_pods == tuple(sorted(s["pod"] for s in payload["spares"]))
    assert seen.spares_ready == sum(s["ready"] for s in payload["spares"]) == 1
    assert seen.warm_spare_ranks == payload["warm_spare_ranks"] == 1
    assert seen.in_flight == payload["load"]["in_flight"]
    assert seen.balancedness == payload["eplb"]["balancedness"]
    assert seen.ready is payload["ready"] is True
    assert seen.lost == () and seen.unhealthy == ()
