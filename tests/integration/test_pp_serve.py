"""Issue 22 item 2, pipeline stages in `serve`: `moe-runtime serve --model DIR
--pipeline-parallel-size 2 --no-eplb --dtype float32` (Ray ranks: each DP rank its leader,
pipeline stage 0, and one stage actor) answers every greedy request token for token as
transformers' `generate` (prefills going through the stages as micro-batches; Mixtral and
DeepSeek-V3 with interleaved steps, the default: two sets of sequences in turn, a step's
stage 0 beside the previous step's stage 1, which the overlap counter shows; Mixtral's down
the compiled graph with the last stage sampling, as on GPUs (`MOE_STEP_GRAPH_STAGES=1`),
DeepSeek-V3's by plain calls, the default on CPUs; Qwen3-MoE with `--no-pipeline-interleave`:
every step down the graph's lanes back to the leader, one at a time), at DP = 2 (each
stage's experts over its own expert-parallel group: stage s of both DP ranks; concurrent
requests leave a DP rank idle in some steps, which still runs an empty batch through its
stages), and after a live grow to DP = 3 under load (every family; issue 22's acceptance);
Mixtral's resize 2 -> 3 -> 2 under load on a warm spare (every answer checked, steps
overlapped down the graph after each), a SIGKILLed stage actor under load (its DP rank out,
no request lost, grown back); EPLB switched on live rebalances under load (DeepSeek-V3 at
DP = 3; interleaved steps: the commit's step has none beside it). At P = 3 (Mixtral, DP = 1,
down the graph): three sets of sequences, three steps in flight, every answer the same.

One server per family (a module-scoped fixture, DP = 2; tiny random checkpoints saved by
`save_pretrained`), joining the tests' Ray instance; the warm-spare resizes and the failure
test run on Mixtral only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from moe_runtime.executor import ray_mesh
from tests.support import mesh_serving, polling
from tests.support.mesh_serving import AUTH, Served, check_answers

pytestmark = pytest.mark.ray

#: (family, data-parallel size, pipeline size); Mixtral at DP = 2 keeps a warm spare (a whole
#: DP rank: a leader and a stage actor) for its grows and its recovery; Mixtral at P = 3
#: (DP = 1): three sets of sequences, three steps in flight, one per stage
CASES = (("mixtral", 2, 2), ("qwen3_moe", 2, 2), ("deepseek_v3", 2, 2), ("mixtral", 1, 3))
#: a step whose busiest DP rank has 8 new tokens goes through the stages as micro-batches (a
#: prefill beside decodes): every answer below is also one of micro-batched steps
MESH = ["--no-eplb", "--pipeline-micro-batch-tokens", "8"]
MICRO_BATCHED = "moe_pipeline_micro_batched_steps_total"
#: experts a stage read from the source: inside a step (when="step"), none when every
#: placement change was prefetched while the leaders staged it; ahead of one
#: (when="prefetch"), none when peers' stages held every expert it lacked
SOURCE_READS = "moe_pipeline_source_reads_total"
#: steps whose stage 0 ran beside the step before in stage 1 (interleaved steps)
OVERLAPPED = "moe_pipeline_overlapped_steps_total"
#: the case that steps down the compiled graph's lanes, not interleaved
GRAPH = "qwen3_moe"
#: the case whose interleaved steps go down the compiled graph (the last stage sampling), as
#: on GPUs (`MOE_STEP_GRAPH_STAGES=1`); the other interleaved case by plain calls, the
#: default on CPUs
INTERLEAVED_GRAPH = "mixtral"


def _source_reads(served: Served) -> dict[str, float]:
    url = served.server.url
    return {w: mesh_serving.metric(url, SOURCE_READS, when=w) for w in ("step", "prefetch")}


SPARE = ["--warm-spare-ranks", "1", "--rank-hang-timeout", "15"]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-dp{n}-pp{p}" for f, n, p in CASES])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, ray_address: str
) -> Iterator[Served]:
    family, size, pp = request.param
    root = tmp_path_factory.mktemp(f"{family}-dp{size}-pp{pp}")
    mesh = [*MESH, "--pipeline-parallel-size", str(pp)]
    mesh += SPARE if (family, size) == CASES[0][:2] else []
    mesh += ["--no-pipeline-interleave"] if family == GRAPH else []
    env = {ray_mesh.STAGES_ENV: "1"} if family == INTERLEAVED_GRAPH else {}
    yield from mesh_serving.serve(root, family, ray_address, size=size, mesh=mesh, env=env)


def _spare_is_whole(served: Served) -> dict[str, Any]:
    """The one warm spare: a leader and a live stage actor of its own, not serving."""
    polling.poll(
        lambda: [s for s in mesh_serving.status(served)["spares"] if s["ready"]],
        lambda: mesh_serving.status(served)["spares"],
        120,
    )
    (spare,) = mesh_serving.status(served)["spares"]
    assert len(spare["pp_pids"]) == 1 and spare["pp_pids"][0] != spare["pid"], spare
    os.kill(spare["pp_pids"][0], 0)  # alive
    return dict(spare)


def _spare_prestaged(served: Served) -> dict[str, int] | None:
    spares = mesh_serving.status(served)["spares"]
    return spares[0]["prestaged"] if spares else None


def _stages(served: Served) -> int:
    """The case's pipeline size (`CASES`: P = 3 is the one case at DP = 1)."""
    return 3 if served.size == 1 else 2


def test_answers_equal_transformers(served: Served) -> None:
    # each DP rank: its leader (stage 0) and P - 1 live stage actors of its own, no TP follower
    ranks = mesh_serving.assert_mesh(served, served.size, "pp_pids", count=_stages(served) - 1)
    assert all(r["tp_pids"] == [] for r in ranks), ranks
    overlapped = {path: _overlapped(served, path) for path in ("graph", "calls")}
    check_answers(served)
    # prefills went through the stages as two micro-batches, the stages working at once
    assert mesh_serving.metric(served.server.url, MICRO_BATCHED) > 0
    # interleaved: consecutive steps in the two stages at once (twelve requests, six at a
    # time, in two sets), down the compiled graph or by plain calls; over the
    # non-interleaved graph, never
    path = "graph" if served.family == INTERLEAVED_GRAPH else "calls"
    assert (_overlapped(served, path) > overlapped[path]) == (served.family != GRAPH)


def _overlapped(served: Served, path: str | None = None) -> float:
    """Steps overlapped so far (`path`: down the step graph, "graph", or by plain calls)."""
    labels = {} if path is None else {"path": path}
    return mesh_serving.metric(served.server.url, OVERLAPPED, **labels)


def test_live_resize_to_three_and_back_to_two_under_load(served: Served) -> None:
    """The grow takes the warm spare (a whole DP rank: its leader and its stage actor, each
    holding the experts of its layers that the grow gives it, pre-staged from the serving
    ranks: its stage's reads from the source, reported from its first step, are 0), and a
    new spare is started; each stage follows its leader's new placement with the experts it
    prefetched while its leader staged its slots, moved from the other DP ranks' stages (no
    stage reads the source, inside a step or ahead of it); every answer during and after
    equal."""
    if served.size != 2 or served.family != CASES[0][0]:
        pytest.skip("one case is enough for the resizes")
    spare = _spare_is_whole(served)
    # pre-staged: the experts of stage 0's layers by its leader, of stage 1's by its stage
    polling.poll(
        lambda: (p := _spare_prestaged(served)) is not None and p["held"] == p["wanted"] > 0,
        lambda: _spare_prestaged(served),
        120,
    )
    for size in (3, 2):
        overlapped = _overlapped(served, "graph")
        done = mesh_serving.resize_under_load(served, size)
        ranks = mesh_serving.assert_mesh(served, size, "pp_pids")
        assert _source_reads(served) == {"step": 0, "prefetch": 0}
        if size == 3:
            history = mesh_serving.status(served)["history"]
            grow = next(h for h in history if h["resize_id"] == done["resize_id"])
            assert grow["warm_spares"] == 1, grow  # it took the spare: no rank started
            assert spare["pid"] in {r["pid"] for r in ranks}, (spare, ranks)
            assert spare["pp_pids"] == [r for r in ranks if r["pid"] == spare["pid"]][0]["pp_pids"]
        check_answers(served)
        # interleaved at every size, down the step graph compiled over the new DP ranks
        assert _overlapped(served, "graph") > overlapped
    assert _spare_is_whole(served)["pid"] != spare["pid"]  # a new one replaced it


def test_a_grow_to_three_under_load_answers_as_transformers(served: Served) -> None:
    """Qwen3-MoE (down the non-interleaved graph) and DeepSeek-V3 (interleaved, plain calls):
    a live grow to DP = 3 under checked load starts a whole new DP rank (its leader and its
    stage actor); no request fails and every answer during and after equals transformers'.
    (Mixtral's resizes: above, on its warm spare.)"""
    if served.family == CASES[0][0]:
        pytest.skip("Mixtral resizes above")
    mesh_serving.resize_under_load(served, 3)
    mesh_serving.assert_mesh(served, 3, "pp_pids")
    check_answers(served)


def test_a_killed_stage_actor_takes_its_rank_out_and_the_deployment_grows_back(
    served: Served,
) -> None:
    """SIGKILL of a DP rank's stage actor under load: its leader's step fails (the stage is
    lost), the recovery shrinks around the DP rank (no request fails: they re-run on the
    survivor) and auto-recover grows back to the size on the warm spare (a leader and its
    stage)."""
    if served.size != 2 or served.family != CASES[0][0]:
        pytest.skip("one case is enough for the failure path")
    size = len(mesh_serving.serving(served))
    victim = mesh_serving.serving(served)[-1]
    mesh_serving.signal_under_load(served, victim, victim["pp_pids"][0])
    mesh_serving.assert_mesh(served, size, "pp_pids")
    # the survivor's stage served alone meanwhile: the lost stage's experts, which no live
    # peer held, came from the source, ahead of the switch (none inside a step)
    reads = _source_reads(served)
    assert reads["step"] == 0 and reads["prefetch"] > 0, reads
    overlapped = _overlapped(served, "graph")
    check_answers(served)
    assert _overlapped(served, "graph") > overlapped  # the graph back over the new DP rank


def test_eplb_switched_on_live_moves_the_stages_experts_and_answers_stay_equal(
    served: Served,
) -> None:
    """EPLB at P = 2 (DeepSeek-V3, DP = 2): switched on live with a short interval, it
    rebalances under load (the leaders move their slots while each stage moves the experts
    of its layers from its peers; each stage follows the committed placement at its next
    step; nothing read from the source); no request fails and every answer after still
    equals transformers'."""
    if served.family != "deepseek_v3":
        pytest.skip("one case is enough for EPLB")
    url = f"{served.server.url}/elastic_ep/config"
    before = mesh_serving.status(served)["eplb"]["rebalances"]
    live = {"eplb_enabled": True, "eplb_step_interval": 10, "eplb_window_size": 10}
    r = httpx.patch(url, json=live, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["eplb_enabled"] is True, r.text
    traffic = mesh_serving.load(served)
    with traffic:
        polling.poll(
            lambda: mesh_serving.status(served)["eplb"]["rebalances"] > before,
            lambda: mesh_serving.status(served)["eplb"],
            120,
            every=0.5,
        )
    assert not traffic.failures, traffic.failures[:3]
    assert traffic.ok > 0, traffic.summary()
    assert _source_reads(served) == {"step": 0, "prefetch": 0}
    r = httpx.patch(url, json={"eplb_enabled": False}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    check_answers(served)
