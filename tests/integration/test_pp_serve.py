"""Issue 22 item 2, pipeline stages in `serve`: `moe-runtime serve --model DIR
--pipeline-parallel-size 2 --no-eplb --dtype float32` (Ray ranks: each DP rank its leader,
pipeline stage 0, and one stage actor) answers every greedy request token for token as
transformers' `generate`, at DP = 1 and at DP = 2 (each stage's experts over its own
expert-parallel group: stage s of both DP ranks; concurrent requests leave a DP rank idle in
some steps, which still runs an empty batch through its stages); a resize is refused with 409
naming the flag, and the deployment keeps serving.

One server per case (a module-scoped fixture: Mixtral at DP = 1 and 2, Qwen3-MoE and
DeepSeek-V3 shapes at DP = 2; tiny random checkpoints saved by `save_pretrained`), joining
the tests' Ray instance.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
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
CASES = (("mixtral", 1), ("mixtral", 2), ("qwen3_moe", 2), ("deepseek_v3", 2))
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


def test_a_resize_is_refused_with_409_naming_the_flag(served: Served) -> None:
    if served.size != 2 or served.family != CASES[0][0]:
        pytest.skip("one case is enough for the refusal")
    r = httpx.post(
        f"{served.server.url}/scale_elastic_ep",
        json={"new_data_parallel_size": 3},
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 409, r.text
    assert "--pipeline-parallel-size 2" in r.text, r.text
    st = _status(served)
    assert st["data_parallel_size"] == 2 and not st["is_scaling"], st
    _check_answers(served)
