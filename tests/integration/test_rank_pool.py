"""The rank pool of `moe-runtime serve --rank-pool N` (Ray ranks, compiled step graph).

One server for the module: DP 2 on synthetic://tiny, at most 4 ranks, a pool of 2 rank
processes started ahead with no weights. Under continuous checked load:
- the pool's processes are up before any grow (listed as inactive ranks holding no expert),
  below the serving ranks' CPU priority;
- a grow 2→4 takes them (the new ranks are those processes: no process starts in its
  Standby), every answer stays token-identical, and the pool refills with new processes;
- a later grow takes the refilled ones.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from e2e import load as load_mod
from moe_runtime.elastic import stages
from moe_runtime.executor import niceness
from tests.support import runtime_proc

pytestmark = pytest.mark.ray

MODEL = "synthetic://tiny?seed=0"
TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LENGTHS = (8, 16)
POOL = 2
Reference = dict[tuple[int, int, int | None], list[int]]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return load_mod.reference_tokens(MODEL, load_mod.cases(lengths=LENGTHS, seeds=(1,)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runtime_proc.RuntimeProcess]:
    log: pathlib.Path = tmp_path_factory.mktemp("rank-pool") / "serve.log"
    srv = runtime_proc.start(
        ["--model", MODEL, "--data-parallel-size", "2", "--max-data-parallel-size", "4"]
        + ["--no-eplb", "--rank-pool", str(POOL)],
        log=log,
        env={"MOE_ADMIN_TOKEN": TOKEN},
    )
    yield srv
    srv.stop()


def status(url: str) -> dict[str, Any]:
    return runtime_proc.status(url, headers=AUTH)


def pool_ready(url: str) -> int:
    """`moe_rank_pool_ready` of /metrics."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("moe_rank_pool_ready "):
            return int(float(line.split()[-1]))
    raise AssertionError("no moe_rank_pool_ready series in /metrics")


def pooled_pids(url: str, count: int = POOL, timeout: float = 180.0) -> set[int]:
    """Pids of the pool's processes once `count` are ready: the inactive ranks, holding no
    expert, outside any resize."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(url)
        idle = [r for r in st["ranks"] if not r["active"]]
        if not st["is_scaling"] and pool_ready(url) == count and len(idle) == count:
            assert all(r["healthy"] and r["num_experts"] == 0 for r in idle), idle
            return {int(r["pid"]) for r in idle}
        assert time.monotonic() < deadline, (pool_ready(url), st["ranks"])
        time.sleep(0.1)


def active_pids(url: str) -> set[int]:
    return {int(r["pid"]) for r in status(url)["ranks"] if r["active"]}


def stage_names(record: dict[str, Any]) -> list[str]:
    return [s["stage"] for s in record["stages"]]


def test_a_grow_takes_the_pooled_processes_and_the_pool_refills(
    server: runtime_proc.RuntimeProcess, reference: Reference
) -> None:
    pooled = pooled_pids(server.url)
    serving = active_pids(server.url)
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in pooled} == {niceness.SPARE_NICENESS}
    traffic = load_mod.Load(
        lambda: server.url,
        model_name="tiny",
        reference=reference,
        clients=4,
        lengths=LENGTHS,
        seeds=(1,),
    )
    with traffic:
        done = runtime_proc.scale(server.url, 4, headers=AUTH)
        deadline = time.monotonic() + 60
        while traffic.ok < 20 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert done["stage"] == "Completed", server.tail()
    assert traffic.failures == [], server.tail()
    assert traffic.ok >= 20
    record = status(server.url)["history"][-1]
    assert stage_names(record) == [s.value for s in stages.SCALE_UP[:-1]]
    assert record["warm_spares"] == 0
    # The new ranks are the processes the pool had started before the grow.
    assert active_pids(server.url) == serving | pooled
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in pooled} == {0}  # they serve now
    # The pool refills with new processes (the grow's are serving now).
    refilled = pooled_pids(server.url)
    assert not refilled & (serving | pooled)
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for case in load_mod.cases(lengths=LENGTHS, seeds=(1,))[:4]:
            got = client.post("/v1/completions", json=case.body("tiny")).json()
            assert got["choices"][0]["token_ids"] == reference[case.key], case


def test_a_later_grow_takes_the_refilled_processes(
    server: runtime_proc.RuntimeProcess,
) -> None:
    if status(server.url)["data_parallel_size"] != 2:
        runtime_proc.scale(server.url, 2, headers=AUTH)
    pooled = pooled_pids(server.url)
    serving = active_pids(server.url)
    assert runtime_proc.scale(server.url, 3, headers=AUTH)["stage"] == "Completed"
    joined = active_pids(server.url) - serving
    assert len(joined) == 1 and joined <= pooled
    assert len(pooled_pids(server.url)) == POOL
