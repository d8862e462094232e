"""Issue 22 item 2, pipeline stages in `serve`: `moe-runtime serve --model DIR
--pipeline-parallel-size 2 --no-eplb --dtype float32` (Ray ranks: each DP rank its leader,
pipeline stage 0, and one stage actor) answers every greedy request token for token as
transformers' `generate`, at DP = 1 and at DP = 2 (each stage's experts over its own
expert-parallel group: stage s of both DP ranks; concurrent requests leave a DP rank idle in
some steps, which still runs an empty batch through its stages); a live resize 2 -> 3 -> 2
under load (every answer checked), a SIGKILLed stage actor under load (its DP rank out, no
request lost, grown back); EPLB cannot be turned on.

One server per case (a module-scoped fixture: Mixtral and DeepSeek-V3 shapes at DP = 2,
Qwen3-MoE at DP = 1; tiny random checkpoints saved by `save_pretrained`), joining the tests'
Ray instance; the resize and failure tests run on Mixtral only (which passes DP = 3 too).
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

from e2e import load as load_mod
from tests.support import hf_families, runtime_proc

pytestmark = pytest.mark.ray

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: (family, data-parallel size)
CASES = (("mixtral", 2), ("qwen3_moe", 1), ("deepseek_v3", 2))
PROMPTS = tuple(range(6))
LENGTHS = (6, 12)
Reference = dict[tuple[int, int, int | None], list[int]]


@dataclasses.dataclass
class Served:
    family: str
    size: int
    server: runtime_proc.RuntimeProcess
    reference: Reference


def _reference(model: Any) -> Reference:
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


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-dp{n}" for f, n in CASES])
def served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    ray_address: str,
) -> Iterator[Served]:
    family, size = request.param
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(f"{family}-dp{size}")
    model = hf_families.build(family)
    path = hf_families.save(model, root / "ckpt")
    args = ["--model", str(path), "--data-parallel-size", str(size)]
    args += ["--pipeline-parallel-size", "2", "--no-eplb", "--dtype", "float32"]
    args += ["--served-model-name", family]
    server, reference = runtime_proc.start_while(
        args,
        lambda: _reference(model),
        log=root / "serve.log",
        env={"MOE_ADMIN_TOKEN": TOKEN, "RAY_ADDRESS": ray_address},
    )
    try:
        yield Served(family, size, server, reference)
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


def test_answers_equal_transformers_at_pp2(served: Served) -> None:
    ranks = _serving(served)
    assert len(ranks) == served.size, ranks
    for r in ranks:  # each DP rank: its leader (stage 0) and one live stage actor of its own
        assert len(r["pp_pids"]) == 1 and r["pp_pids"][0] != r["pid"], r
        assert r["tp_pids"] == [], r
        os.kill(r["pp_pids"][0], 0)
    _check_answers(served)


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


def test_live_resize_to_three_and_back_to_two_under_load(served: Served) -> None:
    """Each stage follows its leader's new placement (the experts it lacks from the source);
    the new DP rank is a leader and a stage actor; every answer during and after equal."""
    if served.size != 2 or served.family != CASES[0][0]:
        pytest.skip("one case is enough for the resizes")
    for size in (3, 2):
        traffic = _load(served)
        with traffic:
            done = runtime_proc.scale(served.server.url, size, headers=AUTH)
        assert done["stage"] == "Completed", done
        assert not traffic.failures, traffic.failures[:3]
        assert traffic.ok > 0, traffic.summary()
        ranks = _serving(served)
        assert len(ranks) == size, ranks
        assert all(len(r["pp_pids"]) == 1 for r in ranks), ranks
        _check_answers(served)


def test_a_killed_stage_actor_takes_its_rank_out_and_the_deployment_grows_back(
    served: Served,
) -> None:
    """SIGKILL of a DP rank's stage actor under load: its leader's step fails (the stage is
    lost), the recovery shrinks around the DP rank (no request fails: they re-run on the
    survivor) and auto-recover grows back to the size with a fresh leader and stage."""
    if served.size != 2 or served.family != CASES[0][0]:
        pytest.skip("one case is enough for the failure path")
    size = len(_serving(served))
    victim = _serving(served)[-1]
    before = len(_status(served)["history"])
    traffic = _load(served)
    with traffic:
        deadline = time.monotonic() + 60
        while traffic.ok < 4:
            assert time.monotonic() < deadline, traffic.summary()
            time.sleep(0.05)
        os.kill(victim["pp_pids"][0], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:
            st = _status(served)
            recoveries = [h for h in st["history"][before:] if h.get("recovery")]
            pids = {r["pid"] for r in _serving(served)}
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
    lost = [lost for h in recoveries for lost in h["recovery"]["ranks_lost"]]
    assert [r["pid"] for r in lost] == [victim["pid"]], recoveries
    ranks = _serving(served)
    assert all(len(r["pp_pids"]) == 1 for r in ranks), ranks
    for r in ranks:
        os.kill(r["pp_pids"][0], 0)
    _check_answers(served)


def test_eplb_cannot_be_turned_on_while_serving(served: Served) -> None:
    """`--no-eplb` is required at P > 1 (start-up); a PATCH turning it on answers 409."""
    if served.size != 1:
        pytest.skip("one case is enough for the refusal")
    r = httpx.patch(
        f"{served.server.url}/elastic_ep/config",
        json={"eplb_enabled": True},
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 409, r.text
    assert "--pipeline-parallel-size 2" in r.text, r.text
    r = httpx.get(f"{served.server.url}/elastic_ep/config", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["eplb_enabled"] is False, r.text
