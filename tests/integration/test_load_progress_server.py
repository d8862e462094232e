"""Both sides of load progress at once: a real `moe-runtime serve` (in-process ranks, reads
slowed by the test-only hook `tests/support/slow_load.py`) answers `GET /ready` while it loads,
and the operator's own reader (`observation.observe_loading`, through `RuntimeClient.ready`)
reads it into the contract's `LoadProgress`; once the model serves it reads nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import threading
import time

import httpx

from moe_contract import loading
from moe_operator import observation, reconcile
from tests.support import checkpoints, runtime_proc, slow_load

LOG = logging.getLogger("test")
DEADLINE_S = 240.0
#: The served process imports the hook from `tests.support`: the checkout's root on its path.
_ROOT_ON_PATH = os.pathsep.join(
    p for p in (str(pathlib.Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p
)


def _observe(url: str) -> loading.LoadProgress | None:
    return asyncio.run(
        observation.observe_loading(url=url, factory=reconcile.default_runtime_factory, logger=LOG)
    )


def test_the_operator_reads_a_real_runtimes_load_progress(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "model"
    checkpoints.build(model)
    server = runtime_proc.spawn(
        ["--model", str(model), "--data-parallel-size", "2", "--executor", "local"],
        log=tmp_path / "serve.log",
        env={
            "MOE_RANK_HOOKS": slow_load.PATH,
            slow_load.DELAY_ENV: "0.1",
            "PYTHONPATH": _ROOT_ON_PATH,
        },
    )
    tick = threading.Event()
    try:
        deadline = time.monotonic() + DEADLINE_S
        part_way: loading.LoadProgress | None = None
        while part_way is None and time.monotonic() < deadline:
            assert server.proc.poll() is None, server.tail()
            now = _observe(server.url)
            if now is not None and now.activity == loading.ACTIVITY_WEIGHTS:
                if 0 < now.bytes_loaded < now.bytes_total:
                    part_way = now
            tick.wait(0.1)  # a poll with a deadline
        assert part_way is not None, server.tail()
        assert part_way.ranks_total == 2
        assert part_way.message().startswith("loading weights ")
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            tick.wait(0.2)
        assert httpx.get(f"{server.url}/ready", timeout=2).json()["status"] == loading.READY
        assert _observe(server.url) is None  # serving: nothing is loading
    finally:
        server.stop()
