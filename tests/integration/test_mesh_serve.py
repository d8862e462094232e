"""Issue 22, the whole mesh in `serve`: `moe-runtime serve --model DIR --tensor-parallel-size 2
--pipeline-parallel-size 2 --no-eplb --dtype float32` (Ray ranks: each DP rank four actors,
TP rank t of stage s in bundle 2s + t of its placement group: its leader (stage 0, TP 0)
leads stage 0's TP follower and stage 1's actor, which leads stage 1's own TP follower)
answers every greedy request token for token as transformers' `generate` (prefills going
through the stages as micro-batches, stage 0's TP follower sent each); Mixtral at DP = 2
also before and after a live resize to DP = 3 under load (every answer checked), and after
the SIGKILL of stage 1's TP follower under load (a process its leader does not reach
directly: the stage reports it lost, the DP rank is taken out, no request is lost and the
deployment grows back). DeepSeek-V3 is served in the mesh expert layout (`--expert-layout
mesh`: each stage's routed experts split over its two TP ranks, expert parallelism over
DP x T per stage): the same answers, and the same resize and follower kill, the resize
reading no expert from the model source (the stages' leaders move their DP ranks' experts
and hand their followers their parts).

One server per case (module-scoped: Mixtral and DeepSeek-V3 at DP = 2, Qwen3-MoE at DP = 1;
tiny random checkpoints saved by `save_pretrained`), joining the tests' Ray instance.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import mesh_serving
from tests.support.mesh_serving import Served, check_answers

pytestmark = pytest.mark.ray

#: (family, data-parallel size)
CASES = (("mixtral", 2), ("qwen3_moe", 1), ("deepseek_v3", 2))
#: where each family's routed experts live (`--expert-layout`)
LAYOUT = {"mixtral": "leader", "qwen3_moe": "leader", "deepseek_v3": "mesh"}
READS = "moe_pipeline_source_reads_total"
MESH = [
    "--tensor-parallel-size",
    "2",
    "--pipeline-parallel-size",
    "2",
    "--no-eplb",
    "--max-data-parallel-size",
    "3",
    # 12 rank processes under load on 2 cores: a heartbeat answer can take several seconds
    # (ranks fenced with no fault); the follower the test kills fails its step at once anyway
    "--rank-hang-timeout",
    "20",
    # prefills beside decodes go through the stages as micro-batches, each sent to stage 0's
    # TP follower too
    "--pipeline-micro-batch-tokens",
    "8",
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-dp{n}" for f, n in CASES])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, ray_address: str
) -> Iterator[Served]:
    family, size = request.param
    root = tmp_path_factory.mktemp(f"{family}-dp{size}")
    mesh = [*MESH, "--expert-layout", LAYOUT[family]]
    yield from mesh_serving.serve(root, family, ray_address, size=size, mesh=mesh)


def _assert_whole(served: Served, size: int) -> list[dict[str, object]]:
    """`size` DP ranks, each its leader, one stage actor and a TP follower in each stage."""
    mesh_serving.assert_mesh(served, size, "pp_pids")
    ranks = mesh_serving.assert_mesh(served, size, "tp_pids", count=2)
    for r in ranks:
        assert not set(r["tp_pids"]) & set(r["pp_pids"]), r
    return ranks


def test_answers_equal_transformers_at_tp2_pp2(served: Served) -> None:
    _assert_whole(served, served.size)
    check_answers(served)
    micro_batched = "moe_pipeline_micro_batched_steps_total"
    assert mesh_serving.metric(served.server.url, micro_batched) > 0


def test_live_resize_to_three_under_load(served: Served) -> None:
    """The new DP rank is four actors (its stage 1 leading its own TP follower); every
    answer during and after the resize equals transformers'. In the mesh layout no expert
    is read from the source: the new rank's stage leaders receive their DP rank's experts
    and hand their followers their parts."""
    if served.size != 2:
        pytest.skip("the cases at DP = 2 (one per expert layout)")
    before = mesh_serving.metric(served.server.url, READS)
    mesh_serving.resize_under_load(served, 3)
    _assert_whole(served, 3)
    check_answers(served)
    if LAYOUT[served.family] == "mesh":
        assert mesh_serving.metric(served.server.url, READS) == before


def test_a_killed_follower_of_a_later_stage_takes_its_rank_out(served: Served) -> None:
    """SIGKILL of stage 1's TP follower: stage 1's step fails and its pings say the follower
    is lost, so its leader's DP rank is lost; the recovery shrinks around it (no request
    fails) and auto-recover grows back with four fresh actors."""
    if served.size != 2:
        pytest.skip("the cases at DP = 2 (one per expert layout)")
    size = len(mesh_serving.serving(served))
    victim = mesh_serving.serving(served)[-1]
    mesh_serving.signal_under_load(served, victim, victim["tp_pids"][-1])
    _assert_whole(served, size)
    check_answers(served)
