"""Issue 22 item 2, consecutive steps kept in the stages at once: `moe-runtime serve --model
DIR --data-parallel-size 2 --pipeline-parallel-size 2 --pipeline-interleave` (Mixtral shape,
tiny random checkpoint). The engine steps the running sequences in two sets in turn and
each DP rank's leader runs stage 0 of a step while its stage actor still runs the step
before (`Stepper.begin`/`end`, `engine.step_groups`): every greedy answer equals
transformers' `generate`, the overlap happened (`moe_pipeline_overlapped_steps_total`),
and the elastic paths keep it: a live resize 2 -> 3 -> 2 under checked load, and the
SIGKILL of a stage actor under load (its DP rank out, no request lost, grown back on the
warm spare).

One server for the module, joining the tests' Ray instance.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import mesh_serving
from tests.support.mesh_serving import Served, check_answers

pytestmark = pytest.mark.ray

FAMILY = "mixtral"
MESH = [
    "--pipeline-parallel-size",
    "2",
    "--pipeline-interleave",
    "--no-eplb",
    "--warm-spare-ranks",
    "1",
    "--rank-hang-timeout",
    "15",
]
OVERLAPPED = "moe_pipeline_overlapped_steps_total"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ray_address: str) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("interleave")
    yield from mesh_serving.serve(root, FAMILY, ray_address, size=2, mesh=MESH)


def _overlapped(served: Served) -> float:
    return mesh_serving.metric(served.server.url, OVERLAPPED)


def test_interleaved_steps_overlap_in_the_stages_and_answer_as_transformers(
    served: Served,
) -> None:
    mesh_serving.assert_mesh(served, 2, "pp_pids")
    before = _overlapped(served)
    check_answers(served)  # twelve requests, six at a time: two sets of sequences
    assert _overlapped(served) > before


def test_a_live_resize_keeps_the_interleaved_steps(served: Served) -> None:
    for size in (3, 2):
        before = _overlapped(served)
        mesh_serving.resize_under_load(served, size)
        mesh_serving.assert_mesh(served, size, "pp_pids")
        check_answers(served)
        assert _overlapped(served) > before


def test_a_killed_stage_actor_under_interleaved_steps_loses_nothing(served: Served) -> None:
    victim = mesh_serving.serving(served)[-1]
    mesh_serving.signal_under_load(served, victim, victim["pp_pids"][0])
    mesh_serving.assert_mesh(served, 2, "pp_pids")
    before = _overlapped(served)
    check_answers(served)
    assert _overlapped(served) > before
