"""The step graph over a DP rank's tensor-parallel mesh (pipeline size 1, T > 1): each TP
follower is a node of the compiled graph, as in vLLM's executor (``InputNode -> TP group ->
MultiOutputNode``), instead of a plain Ray call its leader makes in every step.

The leader's part of a graph step is two nodes on its actor:

- ``prepare_step(step)`` starts the step on the rank's step thread (`MeshStep`), where the
  worker runs it as in any step; when the worker sends its followers the forward pass
  (`tensor_group.TensorLeader.begin` -> `ray_tensor.RayFollowers.send("step", ...)`), the
  send is handed to this node instead (`RayFollowers.handoff`), which returns it: a
  `ray_tensor.FollowerStep` for the followers' `graph_step` nodes, through the graph's
  channels. A step without a forward pass for the followers ends before the node returns
  (``args`` None).
- ``finish_step(work)`` waits (on an event, idle) for the step thread's `StepOutput`.

So the followers start their part of the forward pass as soon as the leader has planned it,
and the TP collectives run between them as before; the followers' answers (``reads`` of the
mesh expert layout, or an ``error``) are outputs of the graph after the leaders' (`outputs`
adds them to their leader's). A probe passes through every node; a hold (parking) makes the
leader's ``finish_step`` and every follower's ``graph_step`` wait on their own event (none of
them spins on a channel read meanwhile), each released by its `release_hold`.

Plain calls (right after a switch, in remote mode, at P > 1) keep the leader's `execute_step`,
which reaches its followers by a Ray call per step; a follower runs the two kinds of step one at
a time (`ray_tensor.FollowerActor`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from moe_runtime import step as step_mod
from moe_runtime.executor import ray_tensor

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Stepped:
    """What a step path steps: the ranks' labels, their actors and each one's TP followers
    with a node of their own in the step graph (() each where none)."""

    ranks: tuple[int, ...]
    actors: tuple[Any, ...]
    followers: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(
        cls, ranks: Sequence[int], actors: Sequence[Any], followers: Sequence[Sequence[Any]] = ()
    ) -> Stepped:
        theirs = tuple(tuple(f) for f in followers) or tuple(() for _ in actors)
        return cls(tuple(ranks), tuple(actors), theirs)

    def graph_actors(self) -> list[Any]:
        """Every actor with a node in the graph: the stepped ones, then their followers."""
        return [*self.actors, *(f for theirs in self.followers for f in theirs)]

    def counts(self) -> list[int]:
        """How many followers of each rank answer the graph (`outputs`)."""
        return [len(f) for f in self.followers]


class _Job:
    """One graph step on the step thread: the followers' forward pass (once handed out), the
    output (once done)."""

    def __init__(self, step: step_mod.StepInput) -> None:
        self.step = step
        self.args: tuple[Any, ...] | None = None
        self.output: step_mod.StepOutput | None = None
        self.error: BaseException | None = None
        self.handed = threading.Event()  # args set, or the step is over
        self.done = threading.Event()

    def hand(self, args: tuple[Any, ...]) -> None:
        if self.handed.is_set():
            raise RuntimeError(
                "a graph step hands its TP followers one forward pass (pipeline size 1)"
            )
        self.args = args
        self.handed.set()


class MeshStep:
    """A leader's graph steps on a thread of their own (module docstring). `run`: the actor's
    step (its worker's `execute_step`, with the actor's bookkeeping); `followers`: the DP
    rank's TP followers, whose "step" sends a graph step takes."""

    def __init__(
        self, run: Callable[[step_mod.StepInput], step_mod.StepOutput], followers: Any
    ) -> None:
        self._run = run
        self._followers = followers
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._job: _Job | None = None
        self._thread = threading.Thread(target=self._loop, name="mesh-step", daemon=True)
        self._thread.start()

    def prepare(self, step: step_mod.StepInput) -> ray_tensor.FollowerStep:
        """Start `step` on the step thread; what the followers run of it (once the worker
        handed it out, or once the step is over without a forward pass for them)."""
        job = _Job(step)
        self._job = job
        self._jobs.put(job)
        job.handed.wait()
        return ray_tensor.FollowerStep(step.step_id, job.args)

    def finish(self) -> step_mod.StepOutput:
        """The output of the step `prepare` started (raises what the step raised)."""
        job, self._job = self._job, None
        if job is None:
            raise RuntimeError("finish_step without prepare_step")
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.output is not None
        return job.output

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._followers.handoff = job.hand
            try:
                job.output = self._run(job.step)
            except BaseException as exc:  # noqa: BLE001 - raised by `finish`
                job.error = exc
            finally:
                self._followers.handoff = None
                job.handed.set()  # no forward pass for the followers: they skip it
                job.done.set()

    def close(self) -> None:
        self._jobs.put(None)


def outputs(
    raw: Sequence[Any], ranks: Sequence[int], followers: Sequence[int]
) -> list[step_mod.StepOutput]:
    """The leaders' outputs of a graph step from the graph's `raw` output (the leaders', then
    each leader's `followers[i]` followers' answers in order): their experts read from the
    model source (the mesh layout) added to their leader's `source_reads`; a follower's error
    logged (its leader's step failed with it: they share the TP collectives)."""
    outs: list[step_mod.StepOutput] = list(raw[: len(ranks)])
    if not any(followers):
        return outs
    answers = iter(raw[len(ranks) :])
    for out, label, count in zip(outs, ranks, followers, strict=True):
        for tp_rank in range(1, count + 1):
            answer = next(answers)
            if not isinstance(answer, dict):
                continue
            if answer.get("error"):
                log.warning(
                    "step %d: TP follower %d of rank %d failed: %s",
                    out.step_id,
                    tp_rank,
                    label,
                    answer["error"],
                )
            out.source_reads += int(answer.get("reads", 0))
    return outs
