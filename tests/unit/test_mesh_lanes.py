"""A leader's graph step over its pipeline stages (`executor.ray_mesh.MeshStep` with stages,
`ray_pipeline.RayStages` in graph mode), without Ray: this test plays the leader's graph
loop (`prepare_step` -> `next_lane` -> `finish_step`) and its worker's step sends
micro-batches down the lanes (`RayStages.chain`) and waits for their answers.

- each micro-batch goes down its own lane as soon as it is sent (lane 0 from `prepare`, lane
  1 from `lane(1)`), before the step waits for any answer: the stages can run micro-batch 0
  while stage 0 runs micro-batch 1;
- a lane the step does not use comes back empty once the step waits (a decode step: one
  micro-batch), so the graph's later nodes pass it on;
- the last stage's answers reach the step's waits, every stage's reads counted;
- a stage's error fails the wait (a lost TP follower of a stage: `StageLost`, its DP rank is
  lost), an abort of the stages ends it at once, and so does a stage that stopped answering
  pings (`alive`), each naming why;
- more micro-batches than lanes are refused;
- which DP ranks' stages are graph nodes (`stage_nodes`, `MOE_STEP_GRAPH_STAGES`), and how
  their lanes carry tensors (`stage_transport`, `MOE_STEP_GRAPH_TRANSPORT`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from moe_runtime import step as step_mod
from moe_runtime.executor import ray_mesh, ray_pipeline
from moe_runtime.rank import pipeline_group
from tests.support import polling

STEP = step_mod.StepInput(step_id=7, batches={})


class Leader:
    """A MeshStep over RayStages without actors; `body(stages)` is the worker's step."""

    def __init__(self, body: Callable[[ray_pipeline.RayStages], Any], lanes: int = 2) -> None:
        self.stages = ray_pipeline.RayStages([], [])
        self.result: Any = None
        self.error: BaseException | None = None

        def run(step: step_mod.StepInput) -> step_mod.StepOutput:
            try:
                self.result = body(self.stages)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                self.error = exc
            return step_mod.StepOutput(rank=0, step_id=step.step_id)

        self.mesh = ray_mesh.MeshStep(run, stages=self.stages, lanes=lanes)

    def close(self) -> None:
        self.mesh.close()


def answered(lane: ray_pipeline.StageLane, out: str, reads: int) -> ray_pipeline.StageLane:
    """`lane` as the last stage hands it to `finish_step`."""
    return ray_pipeline.StageLane(lane.step_id, lane.lane, answer={"out": out}, reads=reads)


def send_and_wait(parts: int) -> Callable[[ray_pipeline.RayStages], Any]:
    def body(stages: ray_pipeline.RayStages) -> Any:
        pending = [stages.chain(0, ["gone"], f"mb{i}", f"h{i}", None) for i in range(parts)]
        return [stages.wait(p, 10.0) for p in pending]

    return body


def test_micro_batches_go_down_their_lanes_before_any_answer() -> None:
    leader = Leader(send_and_wait(2))
    try:
        first = leader.mesh.prepare(STEP)
        second = leader.mesh.lane(1)
        assert (first.lane, first.args) == (0, (0, ["gone"], "mb0", "h0", None))
        assert (second.lane, second.args) == (1, (0, ["gone"], "mb1", "h1", None))
        out = leader.mesh.finish([answered(first, "o0", 2), answered(second, "o1", 1)])
        assert out.step_id == STEP.step_id
        assert leader.error is None
        # each wait: the last stage's answer, with every stage's reads of its lane
        assert leader.result == [[{"out": "o0", "reads": 2}], [{"out": "o1", "reads": 1}]]
        assert leader.stages.lanes is None  # the next plain call's chain is a Ray call again
    finally:
        leader.close()


def test_a_lane_the_step_does_not_use_comes_back_empty() -> None:
    leader = Leader(send_and_wait(1), lanes=3)
    try:
        first = leader.mesh.prepare(STEP)
        # the step waits for lane 0: lanes 1 and 2 carry nothing (their nodes pass them on)
        empty = [leader.mesh.lane(k) for k in (1, 2)]
        assert [(e.lane, e.args, e.step_id) for e in empty] == [(1, None, 7), (2, None, 7)]
        leader.mesh.finish([answered(first, "o0", 0), *empty])
        assert leader.result == [[{"out": "o0", "reads": 0}]]
    finally:
        leader.close()


def test_a_step_without_a_forward_pass_leaves_every_lane_empty() -> None:
    leader = Leader(lambda stages: "no tokens anywhere")
    try:
        lanes = [leader.mesh.prepare(STEP), leader.mesh.lane(1)]
        assert [lane.args for lane in lanes] == [None, None]
        leader.mesh.finish(lanes)
        assert leader.result == "no tokens anywhere"
    finally:
        leader.close()


@pytest.mark.parametrize(
    ("lost", "error"),
    [(False, RuntimeError), (True, pipeline_group.StageLost)],
    ids=["stage-error", "stage-lost-a-follower"],
)
def test_a_stages_error_fails_the_wait(lost: bool, error: type[Exception]) -> None:
    leader = Leader(send_and_wait(1))
    try:
        first = leader.mesh.prepare(STEP)
        failed = ray_pipeline.StageLane(7, 0, error="FollowerLost: TP follower 1 died", lost=lost)
        leader.mesh.finish([failed, leader.mesh.lane(1)])
        assert isinstance(leader.error, error), leader.error
        assert "TP follower 1 died" in str(leader.error)
        assert first.args is not None
    finally:
        leader.close()


def test_an_abort_of_the_stages_ends_the_wait() -> None:
    leader = Leader(send_and_wait(1))
    try:
        leader.mesh.prepare(STEP)
        leader.mesh.lane(1)  # the step waits now
        lanes = leader.stages.lanes
        assert lanes is not None
        lanes.cancel("ranks [2] were lost")  # `RayStages.abort` from the health lane
        out = leader.mesh.finish([])  # the graph may still bring its (now stale) answers
        assert out.step_id == 7
        assert isinstance(leader.error, RuntimeError)
        assert "ranks [2] were lost" in str(leader.error)
    finally:
        leader.close()


def test_a_stage_that_stops_answering_pings_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leader = Leader(send_and_wait(1))
    dead = threading.Event()
    monkeypatch.setattr(
        leader.stages, "alive", lambda: "pipeline stage 1 (pid 42) died" if dead.is_set() else None
    )
    try:
        leader.mesh.prepare(STEP)
        leader.mesh.lane(1)
        dead.set()  # no answer comes: the graph was torn down with the dead stage
        polling.poll(lambda: leader.error is not None, "the step's wait ended", 10, every=0.02)
        leader.mesh.finish([])  # (the leader's graph loop is gone with the graph)
        assert isinstance(leader.error, pipeline_group.StageLost)
        assert "pid 42" in str(leader.error)
    finally:
        leader.close()


def test_more_micro_batches_than_lanes_are_refused() -> None:
    leader = Leader(send_and_wait(3))
    try:
        leader.mesh.prepare(STEP)
        leader.mesh.lane(1)
        leader.mesh.finish([])
        assert isinstance(leader.error, RuntimeError)
        assert "at most 2 micro-batches" in str(leader.error)
    finally:
        leader.close()


@pytest.mark.parametrize(
    ("setting", "tp_size", "use_gpu", "interleave", "nodes"),
    [
        (None, 1, False, False, True),  # the pipeline-only mesh on CPUs
        (None, 2, False, False, False),  # T x P processes per DP rank on CPUs: Ray calls
        (None, 2, True, False, True),  # one device per actor
        (None, 1, False, True, False),  # interleaved on CPUs: plain calls, faster there
        (None, 2, True, True, True),  # interleaved on GPUs: vLLM's shape
        ("1", 2, False, True, True),
        ("0", 1, True, False, False),
    ],
)
def test_which_stages_are_graph_nodes(
    monkeypatch: pytest.MonkeyPatch,
    setting: str | None,
    tp_size: int,
    use_gpu: bool,
    interleave: bool,
    nodes: bool,
) -> None:
    if setting is None:
        monkeypatch.delenv(ray_mesh.STAGES_ENV, raising=False)
    else:
        monkeypatch.setenv(ray_mesh.STAGES_ENV, setting)
    assert ray_mesh.stage_nodes(tp_size, use_gpu=use_gpu, interleave=interleave) is nodes


def test_a_bad_stage_nodes_setting_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ray_mesh.STAGES_ENV, "yes")
    with pytest.raises(ValueError, match="MOE_STEP_GRAPH_STAGES must be auto, 1 or 0"):
        ray_mesh.stage_nodes(1, use_gpu=False)


@pytest.mark.parametrize(
    ("setting", "use_gpu", "transport"),
    [
        (None, False, "pickle"),  # Ray 2.60's shared-memory tensor channels: see TRANSPORT_ENV
        (None, True, "auto"),  # NCCL between GPU actors
        ("", True, "auto"),
        ("SHM", False, "shm"),
        ("pickle", True, "pickle"),
    ],
)
def test_the_lanes_transport_setting(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, use_gpu: bool, transport: str
) -> None:
    if setting is None:
        monkeypatch.delenv(ray_mesh.TRANSPORT_ENV, raising=False)
    else:
        monkeypatch.setenv(ray_mesh.TRANSPORT_ENV, setting)
    assert ray_mesh.stage_transport(use_gpu=use_gpu) == transport


def test_a_bad_transport_setting_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ray_mesh.TRANSPORT_ENV, "nccl")
    with pytest.raises(ValueError, match="MOE_STEP_GRAPH_TRANSPORT must be one of auto, shm"):
        ray_mesh.stage_transport(use_gpu=True)


def test_interleaved_steps_take_a_set_per_stage_unless_told_fewer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ray_mesh.STEP_GROUPS_ENV, raising=False)
    assert ray_mesh.step_groups(3, interleave=True) == 3  # a step per stage
    assert ray_mesh.step_groups(3, interleave=False) == 1
    assert ray_mesh.step_groups(1, interleave=True) == 1
    monkeypatch.setenv(ray_mesh.STEP_GROUPS_ENV, "2")
    assert ray_mesh.step_groups(3, interleave=True) == 2
    for bad in ("4", "1", "2.5", "two"):
        monkeypatch.setenv(ray_mesh.STEP_GROUPS_ENV, bad)
        with pytest.raises(ValueError, match="MOE_PIPELINE_STEP_GROUPS must be a whole number"):
            ray_mesh.step_groups(3, interleave=True)
