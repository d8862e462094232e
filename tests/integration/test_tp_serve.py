"""Issue 22 acceptance, tensor parallelism in `serve`: `moe-runtime serve --model DIR
--data-parallel-size 2 --tensor-parallel-size 2 --dtype float32` (Ray ranks: each DP rank a
leader actor and one TP follower actor) answers every greedy request token for token as
transformers' `generate`, before and after a live resize to DP = 3 under load (every answer
during the resize checked too); a follower SIGKILLed or SIGSTOPped under load takes its DP
rank out, no request is lost, and the deployment grows back to its size.

One server per family (a module-scoped fixture per family: Mixtral, Qwen3-MoE, DeepSeek-V3
shapes, tiny random checkpoints saved by `save_pretrained`), joining the tests' Ray instance.
Mixtral runs the default expert layout (the routed experts on each DP rank's leader); Qwen3-MoE
and DeepSeek-V3 (MLA, a shared expert) run `--expert-layout mesh` (a part of each DP rank's
expert slots on each device: `test_tp_expert_mesh.py` tests that layout's elastic paths).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.support import mesh_serving
from tests.support.mesh_serving import Served, check_answers

pytestmark = pytest.mark.ray

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
MESH = ["--tensor-parallel-size", "2", "--max-data-parallel-size", "3"]
#: the expert layout of each family's server
LAYOUT = {"mixtral": "leader", "qwen3_moe": "mesh", "deepseek_v3": "mesh"}


@pytest.fixture(scope="module", params=FAMILIES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, ray_address: str
) -> Iterator[Served]:
    family: str = request.param
    root = tmp_path_factory.mktemp(family)
    mesh = [*MESH, "--expert-layout", LAYOUT[family]]
    yield from mesh_serving.serve(root, family, ray_address, size=2, mesh=mesh)


def test_answers_equal_transformers_at_dp2_tp2(served: Served) -> None:
    mesh_serving.assert_mesh(served, 2, "tp_pids")
    check_answers(served)


def test_live_resize_to_three_under_load(served: Served) -> None:
    mesh_serving.resize_under_load(served, 3)
    mesh_serving.assert_mesh(served, 3, "tp_pids")
    check_answers(served)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_lost_follower_takes_its_rank_out_and_the_deployment_grows_back(
    served: Served, sig: signal.Signals
) -> None:
    """SIGKILL: the leader's step fails at once; SIGSTOP (a hung follower): its leader's pings
    fail after `tensor_group.FOLLOWER_HANG_S`. Either way the recovery takes the DP rank out
    (its placement group, the stopped process with it) and auto-recover grows back."""
    if served.family != FAMILIES[0]:
        pytest.skip("one family is enough for the failure path")
    size = len(mesh_serving.serving(served))
    victim = mesh_serving.serving(served)[-1]
    done = mesh_serving.signal_under_load(served, victim, victim["tp_pids"][0], sig)
    # a hung follower is fenced by its leader: the rank is out well before the step graph's
    # own timeout (60 s) would end the stuck step
    assert done.out_after is not None and done.out_after < 45, done.out_after
    mesh_serving.assert_mesh(served, size, "tp_pids")
    check_answers(served)
