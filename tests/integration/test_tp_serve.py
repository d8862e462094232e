"""Issue 22 acceptance, tensor parallelism in `serve`: `moe-runtime serve --model DIR
--data-parallel-size 2 --tensor-parallel-size 2 --dtype float32` (Ray ranks: each DP rank a
leader actor and one TP follower actor) answers every greedy request token for token as
transformers' `generate`, before and after a live resize to DP = 3 under load (every answer
during the resize checked too); a follower SIGKILLed or SIGSTOPped under load takes its DP
rank out, no request is lost, and the deployment grows back to its size.

One server per family (a module-scoped fixture per family: Mixtral, Qwen3-MoE, DeepSeek-V3
shapes, tiny random checkpoints saved by `save_pretrained`), joining the tests' Ray instance.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
import transformers

from e2e import load as load_mod
from tests.support import hf_families, runtime_proc

pytestmark = pytest.mark.ray

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
PROMPTS = tuple(range(6))
LENGTHS = (6, 12)
Reference = dict[tuple[int, int, int | None], list[int]]


@dataclasses.dataclass
class Served:
    family: str
    server: runtime_proc.RuntimeProcess
    model: transformers.PreTrainedModel
    reference: Reference


def _reference(model: transformers.PreTrainedModel) -> Reference:
    out: Reference = {}
    for p in PROMPTS:
        greedy = hf_families.greedy(model, load_mod.PROMPTS[p], max(LENGTHS))
        for n in LENGTHS:
            out[(p, n, None)] = greedy[:n]
    return out


@pytest.fixture(scope="module")
def ray_address(ray_session: None) -> str:
    import ray

    address: str = ray.get_runtime_context().gcs_address
    return address


@pytest.fixture(scope="module", params=FAMILIES)
def served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    ray_address: str,
) -> Iterator[Served]:
    family: str = request.param
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(family)
    model = hf_families.build(family)
    path = hf_families.save(model, root / "ckpt")
    args = ["--model", str(path), "--data-parallel-size", "2", "--tensor-parallel-size", "2"]
    args += ["--dtype", "float32", "--max-data-parallel-size", "3"]
    args += ["--served-model-name", family]
    server, reference = runtime_proc.start_while(
        args,
        lambda: _reference(model),
        log=root / "serve.log",
        env={"MOE_ADMIN_TOKEN": TOKEN, "RAY_ADDRESS": ray_address},
    )
    try:
        yield Served(family, server, model, reference)
    finally:
        server.stop()


def _status(s: Served) -> dict[str, Any]:
    return runtime_proc.status(s.server.url, headers=AUTH)


def _serving(s: Served) -> list[dict[str, Any]]:
    return [r for r in _status(s)["ranks"] if r["rank"] is not None and r["active"]]


def _answer(client: httpx.Client, family: str, case: load_mod.Case) -> list[int]:
    body = dict(case.body(family), stream=False)
    r = client.post("/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["choices"][0]["token_ids"]
    return tokens


def _check_answers(s: Served) -> None:
    cases = [load_mod.Case(p, n, None) for p in PROMPTS for n in LENGTHS]
    with (
        httpx.Client(base_url=s.server.url) as client,
        concurrent.futures.ThreadPoolExecutor(6) as pool,
    ):
        got = list(pool.map(lambda c: _answer(client, s.family, c), cases))
    wrong = [
        (c.key, g, s.reference[c.key])
        for c, g in zip(cases, got, strict=True)
        if g != s.reference[c.key]
    ]
    assert not wrong, f"{s.family}: {len(wrong)} answers differ from transformers: {wrong[:3]}"


def _load(s: Served) -> load_mod.Load:
    return load_mod.Load(
        lambda: s.server.url,
        model_name=s.family,
        reference=s.reference,
        clients=4,
        lengths=LENGTHS,
        seeds=(),
        prompts=PROMPTS,
    )


def _assert_tensor_parallel(s: Served, size: int) -> None:
    """`size` DP ranks serve, each a leader and one live TP follower process of its own."""
    ranks = _serving(s)
    assert len(ranks) == size, ranks
    for r in ranks:
        assert len(r["tp_pids"]) == 1 and r["tp_pids"][0] != r["pid"], r
        os.kill(r["tp_pids"][0], 0)  # alive


def test_answers_equal_transformers_at_dp2_tp2(served: Served) -> None:
    _assert_tensor_parallel(served, 2)
    _check_answers(served)


def test_live_resize_to_three_under_load(served: Served) -> None:
    traffic = _load(served)
    with traffic:
        done = runtime_proc.scale(served.server.url, 3, headers=AUTH)
    assert done["stage"] == "Completed", done
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.ok > 0, traffic.summary()
    _assert_tensor_parallel(served, 3)
    _check_answers(served)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_lost_follower_takes_its_rank_out_and_the_deployment_grows_back(
    served: Served, sig: signal.Signals
) -> None:
    """SIGKILL: the leader's step fails at once; SIGSTOP (a hung follower): its leader's pings
    fail after `tensor_group.FOLLOWER_HANG_S`. Either way the recovery takes the DP rank out
    (its placement group, the stopped process with it) and auto-recover grows back."""
    if served.family != FAMILIES[0]:
        pytest.skip("one family is enough for the failure path")
    size = len(_serving(served))
    victim = _serving(served)[-1]
    before = len(_status(served)["history"])
    traffic = _load(served)
    with traffic:
        deadline = time.monotonic() + 60
        while traffic.ok < 4:
            assert time.monotonic() < deadline, traffic.summary()
            time.sleep(0.05)
        os.kill(victim["tp_pids"][0], sig)
        signalled = time.monotonic()
        deadline = signalled + 180
        out_after = None
        while True:
            st = _status(served)
            recoveries = [h for h in st["history"][before:] if h.get("recovery")]
            pids = {r["pid"] for r in _serving(served)}
            if out_after is None and victim["pid"] not in pids:
                out_after = time.monotonic() - signalled
            if (
                recoveries
                and victim["pid"] not in pids
                and st["data_parallel_size"] == size
                and not st["is_scaling"]
            ):
                break
            assert time.monotonic() < deadline, (st, served.server.tail())
            time.sleep(0.2)
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.ok > 0, traffic.summary()
    # a hung follower is fenced by its leader: the rank is out well before the step graph's
    # own timeout (60 s) would end the stuck step
    assert out_after is not None and out_after < 45, out_after
    lost = [lost for h in recoveries for lost in h["recovery"]["ranks_lost"]]
    assert [r["pid"] for r in lost] == [victim["pid"]], recoveries
    _assert_tensor_parallel(served, size)
    _check_answers(served)
