"""Issue 22, warm spares at tensor-parallel size T > 1: `moe-runtime serve --data-parallel-size 2
--tensor-parallel-size 2 --warm-spare-ranks 1` keeps its spare as a whole DP rank (a leader and
its TP follower, both loaded), a grow to 3 takes it whole (no Standby), the pool starts a whole
replacement, and a follower SIGKILLed under load takes its DP rank out and the recovery grows
back on the spare: no request fails, every answer equals transformers' (greedy and seeded,
streamed or not).

One server for the module (tiny random Mixtral shape, saved by `save_pretrained`), joining the
tests' Ray instance (8 rank slots: 3 DP ranks and one spare, 2 actors each).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers

from e2e import load as load_mod
from moe_runtime import step
from moe_runtime.executor import niceness
from tests.support import hf_families, runtime_proc

pytestmark = pytest.mark.ray

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAMILY = "mixtral"
PROMPTS = tuple(range(6))
LENGTHS = (6, 12)
SEED = 1
Reference = dict[tuple[int, int, int | None], list[int]]


@dataclasses.dataclass
class Served:
    server: runtime_proc.RuntimeProcess
    reference: Reference


def _reference(model: transformers.PreTrainedModel) -> Reference:
    """transformers' answer to every (prompt, length, seed) case the load sends."""
    params = step.SamplingParams(temperature=load_mod.TEMPERATURE, top_p=load_mod.TOP_P, seed=SEED)
    out: Reference = {}
    for p in PROMPTS:
        prompt = load_mod.PROMPTS[p]
        greedy = hf_families.greedy(model, prompt, max(LENGTHS))
        seeded = hf_families.sampled(model, prompt, max(LENGTHS), params)
        for n in LENGTHS:
            out[(p, n, None)] = greedy[:n]
            out[(p, n, SEED)] = seeded[:n]
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ray_session: None) -> Iterator[Served]:
    import ray

    address = ray.get_runtime_context().gcs_address
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tp_spares")
    model = hf_families.build(FAMILY)
    path = hf_families.save(model, root / "ckpt")
    args = ["--model", str(path), "--data-parallel-size", "2", "--tensor-parallel-size", "2"]
    args += ["--dtype", "float32", "--max-data-parallel-size", "3", "--warm-spare-ranks", "1"]
    args += ["--served-model-name", FAMILY]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(
            runtime_proc.start,
            args,
            log=root / "serve.log",
            env={"MOE_ADMIN_TOKEN": TOKEN, "RAY_ADDRESS": address},
        )
        try:
            reference = _reference(model)
        finally:
            server = starting.result()
    try:
        yield Served(server, reference)
    finally:
        server.stop()


def _status(s: Served) -> dict[str, Any]:
    return runtime_proc.status(s.server.url, headers=AUTH)


def _serving(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in st["ranks"] if r["rank"] is not None and r["active"]]


def _load(s: Served) -> load_mod.Load:
    return load_mod.Load(
        lambda: s.server.url,
        model_name=FAMILY,
        reference=s.reference,
        clients=4,
        lengths=LENGTHS,
        seeds=(SEED,),
        prompts=PROMPTS,
    )


def _wait_spare_ready(s: Served, timeout: float = 180.0) -> dict[str, Any]:
    """The status once one spare is ready (loaded, warm, in standby groups)."""
    deadline = time.monotonic() + timeout
    while True:
        st = _status(s)
        if [sp for sp in st["spares"] if sp["ready"]]:
            return st
        assert time.monotonic() < deadline, (st["spares"], s.server.tail())
        time.sleep(0.2)


def _assert_whole(ranks: list[dict[str, Any]], *, nice: int | None = None) -> None:
    """Each DP rank a leader and one live follower process of its own (`nice`: both at that
    CPU niceness)."""
    for r in ranks:
        assert len(r["tp_pids"]) == 1 and r["tp_pids"][0] != r["pid"], r
        os.kill(r["tp_pids"][0], 0)  # alive
        if nice is not None:
            pids = [r["pid"], r["tp_pids"][0]]
            assert [os.getpriority(os.PRIO_PROCESS, p) for p in pids] == [nice] * 2, r


def _wait_traffic(traffic: load_mod.Load, count: int) -> None:
    deadline = time.monotonic() + 60
    while traffic.ok < count:
        assert time.monotonic() < deadline, traffic.summary()
        time.sleep(0.05)


def test_spare_is_whole_taken_by_a_grow_and_replaces_a_lost_rank(served: Served) -> None:
    st = _wait_spare_ready(served)
    assert st["warm_spare_ranks"] == 1
    assert len(_serving(st)) == 2
    _assert_whole(_serving(st))
    # the spare is a whole DP rank: its follower started with it (listed under "spares")
    # and waits below the serving ranks' CPU priority, its follower too
    spare = st["spares"][0]
    _assert_whole([spare], nice=niceness.SPARE_NICENESS)
    before = len(st["history"])

    traffic = _load(served)
    with traffic:
        _wait_traffic(traffic, 4)
        done = runtime_proc.scale(served.server.url, 3, headers=AUTH)
        assert done["stage"] == "Completed", done
        st = _status(served)
        grow = next(h for h in st["history"] if h["resize_id"] == done["resize_id"])
        # the grow took the spare: no Standby (no rank started, no rendezvous)
        assert grow["warm_spares"] == 1, grow
        assert "Standby" not in [s["stage"] for s in grow["stages"]], grow
        ranks = _serving(st)
        assert len(ranks) == 3
        _assert_whole(ranks, nice=0)
        # the spare itself serves now: its leader and its follower
        assert (spare["pid"], spare["tp_pids"]) in [(r["pid"], r["tp_pids"]) for r in ranks], (
            spare,
            ranks,
        )

        # a whole replacement spare comes up on the freed slots
        st = _wait_spare_ready(served)
        replacement = st["spares"][0]
        assert replacement["pid"] != spare["pid"]
        _assert_whole([replacement], nice=niceness.SPARE_NICENESS)

        # a follower SIGKILLed under load: its DP rank out, the spare takes its place
        victim = _serving(st)[0]
        os.kill(victim["tp_pids"][0], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:
            st = _status(served)
            history = st["history"][before:]
            recoveries = [h for h in history if h.get("recovery")]
            pids = {r["pid"] for r in _serving(st)}
            if (
                recoveries
                and victim["pid"] not in pids
                and replacement["pid"] in pids
                and st["data_parallel_size"] == 3
                and not st["is_scaling"]
            ):
                break
            assert time.monotonic() < deadline, (st, served.server.tail())
            time.sleep(0.2)
        _wait_traffic(traffic, traffic.ok + 4)
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.by_kind, traffic.summary()
    lost = [lost for h in recoveries for lost in h["recovery"]["ranks_lost"]]
    assert [r["pid"] for r in lost] == [victim["pid"]], recoveries
    grown_back = [h for h in history if h["warm_spares"] and not h.get("recovery")]
    assert grown_back, history
    _assert_whole(_serving(st))
