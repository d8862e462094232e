"""Issue 22, expert parallelism over DP x T in `serve` (`--expert-layout mesh`,
docs/TENSOR-PARALLEL.md): each DP rank's TP followers hold a part of its expert slots (the
leader only part 0: its `num_experts` is slots / T) and the expert-parallel group is every
actor of every DP rank. Answers equal transformers' `generate` at DP = 2 x T = 2, after live
resizes to DP = 3 and DP = 1 under checked load (the slots per DP rank change, and the
followers' parts follow the leader's placement), and after a follower is SIGKILLed under
load (its DP rank is taken out, none of the load's requests fails, the deployment grows
back). One server (Mixtral shape), the tests' Ray instance.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.support import mesh_serving
from tests.support.mesh_serving import Served, check_answers

pytestmark = pytest.mark.ray

T = 2
#: the checkpoint's experts (`hf_families`): DP = 2 -> 8 slots (4 a DP rank, 2 a device);
#: DP = 3 -> 6 (2, 1); DP = 1 -> 6 (6, 3)
EXPERTS = 5
MESH = ["--tensor-parallel-size", str(T), "--expert-layout", "mesh"]
MESH += ["--max-data-parallel-size", "3"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ray_address: str) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("mixtral")
    yield from mesh_serving.serve(root, "mixtral", ray_address, size=2, mesh=MESH)


def _assert_parts(served: Served, size: int) -> None:
    """`size` DP ranks serve, each a leader and its follower, with slots that split over
    both (the slots a DP rank holds: a multiple of T)."""
    ranks = mesh_serving.assert_mesh(served, size, "tp_pids", count=T - 1)
    physical = -(-EXPERTS // (size * T)) * size * T
    for r in ranks:
        assert r["num_experts"] == physical // size, r


def test_answers_equal_transformers_with_experts_on_every_device(served: Served) -> None:
    _assert_parts(served, 2)
    check_answers(served)


@pytest.mark.parametrize("size", [3, 1])
def test_live_resizes_move_the_parts(served: Served, size: int) -> None:
    mesh_serving.resize_under_load(served, size)
    _assert_parts(served, size)
    check_answers(served)


def test_a_killed_follower_takes_its_rank_out_and_the_deployment_grows_back(
    served: Served,
) -> None:
    if len(mesh_serving.serving(served)) < 2:
        mesh_serving.resize_under_load(served, 2)
    victim = mesh_serving.serving(served)[-1]
    done = mesh_serving.signal_under_load(served, victim, victim["tp_pids"][0], signal.SIGKILL)
    assert done.out_after is not None and done.out_after < 45, done.out_after
    _assert_parts(served, 2)
    check_answers(served)
