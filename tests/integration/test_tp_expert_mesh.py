"""Issue 22, expert parallelism over DP x T in `serve` (`--expert-layout mesh`,
docs/TENSOR-PARALLEL.md): each DP rank's TP follower holds a part of its expert slots and the
expert-parallel group is every actor of every DP rank. With a warm spare (a whole DP rank:
leader and follower) and EPLB every 40 steps, one server (Mixtral shape, the tests' Ray
instance), every answer checked against transformers' `generate`:

- at DP = 2 x T = 2;
- EPLB rebalances under checked load and moves experts (the followers' parts follow the
  commit inside a step);
- live resizes to DP = 3 (the grow takes the spare, its follower handed its part by its
  leader) and DP = 1 under checked load, the slots per DP rank changing with the size;
- a follower SIGKILLed under load: its DP rank is taken out, no request fails, the
  deployment is back at its size.

The experts the followers read from the model source are counted
(`moe_pipeline_source_reads_total`): a resize reads none, the grown rank's follower and the
survivor's get their parts from peers through their leaders.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.support import mesh_serving, polling
from tests.support.mesh_serving import Served, check_answers

pytestmark = pytest.mark.ray

T = 2
#: the checkpoint's experts (`hf_families`): DP = 2 -> 8 slots (4 a DP rank, 2 a device);
#: DP = 3 -> 6 (2, 1); DP = 1 -> 6 (6, 3)
EXPERTS = 5
MESH = ["--tensor-parallel-size", str(T), "--expert-layout", "mesh"]
MESH += ["--max-data-parallel-size", "3", "--warm-spare-ranks", "1", "--rank-pool", "1"]
MESH += ["--eplb-window-size", "40", "--eplb-step-interval", "40"]
READS = "moe_pipeline_source_reads_total"


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


def _reads(served: Served) -> float:
    """Experts the followers read from the model source so far (in and ahead of steps)."""
    return mesh_serving.metric(served.server.url, READS)


def _spare_prestaged(served: Served) -> dict[str, int] | None:
    spares = [s for s in mesh_serving.status(served)["spares"] if s["ready"]]
    return spares[0]["prestaged"] if spares else None


def test_answers_equal_transformers_with_experts_on_every_device(served: Served) -> None:
    _assert_parts(served, 2)
    check_answers(served)


def test_eplb_moves_experts_under_load(served: Served) -> None:
    traffic = mesh_serving.load(served)
    with traffic:

        def moved() -> dict[str, object] | None:
            last = (mesh_serving.status(served).get("eplb") or {}).get("last_rebalance") or {}
            return last if last.get("applied") and last.get("moves") else None

        polling.poll(moved, lambda: mesh_serving.status(served).get("eplb"), 120, every=0.2)
    assert not traffic.failures, traffic.failures[:3]
    check_answers(served)


@pytest.mark.parametrize("size", [3, 1])
def test_live_resizes_move_the_parts(served: Served, size: int) -> None:
    if size == 3:  # the spare is ready, its experts for this grow pre-staged on its leader
        polling.poll(
            lambda: (p := _spare_prestaged(served)) is not None and p["held"] == p["wanted"] > 0,
            lambda: mesh_serving.status(served)["spares"],
            120,
        )
    before = _reads(served)
    done = mesh_serving.resize_under_load(served, size)
    if size == 3:
        history = mesh_serving.status(served)["history"]
        grow = next(h for h in history if h["resize_id"] == done["resize_id"])
        assert grow["warm_spares"] == 1, grow  # it took the spare: no rank started
    _assert_parts(served, size)
    check_answers(served)
    assert _reads(served) == before


def test_a_grow_takes_the_spare_and_the_pooled_rank(served: Served) -> None:
    """1 -> 3: the ready spare and the pooled (weightless) rank, leader and follower each:
    their experts from peers, none read from the source."""
    polling.poll(
        lambda: _spare_prestaged(served) is not None,
        lambda: mesh_serving.status(served)["spares"],
        120,
    )
    pooled = {r["pid"] for r in mesh_serving.status(served)["ranks"] if not r["active"]}
    assert len(pooled) == 1, mesh_serving.status(served)["ranks"]
    before = _reads(served)
    done = mesh_serving.resize_under_load(served, 3)
    history = mesh_serving.status(served)["history"]
    grow = next(h for h in history if h["resize_id"] == done["resize_id"])
    assert grow["warm_spares"] == 1, grow
    _assert_parts(served, 3)
    assert pooled <= {r["pid"] for r in mesh_serving.serving(served)}
    check_answers(served)
    assert _reads(served) == before
    # the replacement spare is built (its leader's and follower's weights from the serving
    # ranks' over the standby groups) at the first try: no upkeep pass failed in the module
    polling.poll(
        lambda: _spare_prestaged(served) is not None,
        lambda: mesh_serving.status(served)["spares"],
        120,
    )
    assert mesh_serving.metric(served.server.url, "moe_warm_spare_failures_total") == 0


def test_a_killed_follower_takes_its_rank_out_and_the_deployment_grows_back(
    served: Served,
) -> None:
    size = len(mesh_serving.serving(served))
    victim = mesh_serving.serving(served)[-1]
    done = mesh_serving.signal_under_load(served, victim, victim["tp_pids"][0], signal.SIGKILL)
    assert done.out_after is not None and done.out_after < 45, done.out_after
    _assert_parts(served, size)
    check_answers(served)
