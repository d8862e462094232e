"""The follower actors of a DP rank at tensor-parallel size T > 1 (`rank.tensor_group`).

- `FollowerActor`: TP rank t (1..T-1) of one DP rank (of its pipeline stage s at P > 1), a
  `tensor_follower.TensorFollower` in its own actor, placed in bundle s x T + t of the DP rank's
  placement group (bundle s x T is its stage's TP leader: STRICT_PACK, one node, so the TP
  group runs over loopback). Two lanes: the default one
  (join, load, steps: in the order the leader sent them) and `HEALTH_LANE` (pings).
- `RayFollowers`: the leader's `tensor_group.Followers` over their handles: a call per
  follower, results read with errors turned into `tensor_group.FollowerLost` for a dead
  actor; `alive` keeps one ping in flight per follower and reads it without blocking, and
  kills (fences) a follower that leaves one unanswered for `tensor_group.FOLLOWER_HANG_S`.
- In the step graph (`ray_mesh`, pipeline size 1): a follower is a node of the compiled graph
  (`FollowerActor.graph_step`), fed by its leader's `prepare_step` node with the step's
  forward pass (`FollowerStep`) instead of a plain call per step: `RayFollowers.handoff`
  takes the leader's "step" send while a graph step runs, and the followers' answers go to
  the graph's output (the driver adds their reads to the leader's `StepOutput`).

The executor creates the followers with the leader (`ray_start.start_ranks`) and hands their
handles to it; removing the DP rank's placement group ends them with it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import ray.exceptions

from moe_runtime import logs
from moe_runtime.executor import niceness
from moe_runtime.rank import allocator, tensor_follower, tensor_group

log = logging.getLogger(__name__)

HEALTH_LANE = "health"
#: Seconds a leader's `promote` waits for its TP followers' answers.
PROMOTE_TIMEOUT_S = 30.0
#: `FollowerStep.step_id` of a parked graph's hold (`ray_actor.HOLD_STEP_ID`): the
#: follower's graph loop waits on an event until `FollowerActor.release_hold`.
HOLD_STEP_ID = -2


@dataclasses.dataclass(frozen=True)
class FollowerStep:
    """What a leader's `prepare_step` node hands its followers' `graph_step` nodes: the step's
    id and the arguments of `TensorFollower.step` (None: no forward pass for them this step,
    a probe, or a hold: `HOLD_STEP_ID`)."""

    step_id: int
    args: tuple[Any, ...] | None = None


#: What `RayFollowers.send("step", ...)` returns while a graph step takes the send
#: (`RayFollowers.handoff`): the followers answer the graph's output, not the leader.
IN_GRAPH = object()


class FollowerActor:
    """TP rank `tp_rank` of `tp_size` of DP rank `label` (module docstring). `spare`: its DP
    rank starts as a warm spare or a rank pool's process: like its leader it waits (and loads)
    below the serving ranks' CPU priority (its process began there: `niceness.spare_setup`)
    and takes 0 again when a grow takes the rank (`promote`) or at its first step."""

    def __init__(
        self,
        *,
        label: int,
        tp_rank: int,
        tp_size: int,
        device: str,
        spare: bool = False,
        stage: int = 0,
        stages: int = 1,
        expert_layout: str = "leader",
    ) -> None:
        logs.configure_rank()
        allocator.tune()
        if spare:
            niceness.set_niceness(label, niceness.SPARE_NICENESS, why="waits as a spare")
        import torch

        torch.set_num_threads(1)
        self.label = label
        self._serving = False
        #: a graph step and a plain call's step never run at once (the step path's handover:
        #: the tail of one may still run when its leader sends the next)
        self._step_lock = threading.Lock()
        #: set by `release_hold`: the graph loop, parked in a hold, goes on
        self._hold = threading.Event()
        self.steps = {"graph": 0, "plain": 0, "holding": 0}
        self.follower = tensor_follower.TensorFollower(
            rank=tp_rank,
            size=tp_size,
            device=device,
            label=label,
            stage=stage,
            stages=stages,
            expert_layout=expert_layout,
        )

    def promote(self) -> None:
        """Its DP rank joins a grow or begins to step: the serving ranks' priority for every
        thread."""
        niceness.set_niceness(self.label, 0, why="serves (TP follower)")

    def pid(self) -> int:
        import os

        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        if method not in ("join", "load", "step", "shutdown"):
            raise AttributeError(f"a TP follower has no method {method!r}")
        if method != "step":
            return getattr(self.follower, method)(*args)
        self.steps["plain"] += 1
        return self._step(args)

    def _step(self, args: tuple[Any, ...]) -> Any:
        if not self._serving:
            self._serving = True
            niceness.set_niceness(self.label, 0, why="steps (TP follower)")
        with self._step_lock:
            return self.follower.step(*args)

    def graph_step(self, work: FollowerStep) -> dict[str, Any]:
        """Its node of the step graph (`ray_mesh`): the forward pass its leader's
        `prepare_step` handed out, if any. Never raises (an error would fail every rank's
        output of the step): a failed step answers {"error": ...}; its leader's forward pass
        fails with it (the follower aborts their TP group)."""
        if work.step_id == HOLD_STEP_ID:
            self.steps["holding"] = 1
            self._hold.wait()
            self._hold.clear()
            self.steps["holding"] = 0
            return {}
        if work.args is None:
            return {}
        self.steps["graph"] += 1
        try:
            answer: dict[str, Any] = self._step(work.args)
        except Exception as exc:  # noqa: BLE001 - answered; the leader's step fails too
            return {"error": f"{type(exc).__name__}: {exc}"}
        return answer

    def step_counts(self) -> dict[str, int]:
        """Forward passes run from the step graph and from plain calls, and whether its graph
        loop waits in a parked graph's hold now (tests, benchmarks)."""
        return dict(self.steps)

    def release_hold(self) -> None:
        """End the hold its graph loop waits in (`graph_step`); on the health lane."""
        self._hold.set()

    def echo(self, value: Any) -> Any:
        """Does nothing: the method of the throwaway graph that warms a new actor up."""
        return value

    def ping(self) -> dict[str, Any]:
        return self.follower.ping()

    def control(self, method: str, *args: Any) -> Any:
        """Calls beside the steps (`CTL_METHODS`) and aborts (`HEALTH_METHODS`)."""
        if method not in CTL_METHODS + HEALTH_METHODS:
            raise AttributeError(f"a TP follower has no control method {method!r}")
        return getattr(self.follower, method)(*args)


#: Calls on a follower's control lane (the mesh layout's expert calls, a new DP rank's
#: non-expert transfer): a join waits for the other DP ranks' members and reads of experts
#: take a while, neither may hold the steps.
CTL_METHODS = ("join_mesh", "prefetch", "held", "lacks", "transfer_non_expert")
#: Calls on its health lane (never queued behind a step or a join).
HEALTH_METHODS = ("abort", "abort_join")
CTL_LANE = "ctl"

RemoteFollower: Any = ray.remote(  # type: ignore[call-overload]
    num_cpus=0, concurrency_groups={HEALTH_LANE: 1, CTL_LANE: 1}
)(FollowerActor)


class RayFollowers:
    """`tensor_group.Followers` over follower actor handles (TP ranks 1..T-1, in order)."""

    def __init__(
        self,
        actors: Sequence[Any],
        pids: Sequence[int],
        *,
        what: str = "TP follower",
        lost: type[tensor_group.FollowerLost] = tensor_group.FollowerLost,
    ) -> None:
        self._actors = list(actors)
        self._pids = list(pids)
        #: how errors name an actor ("TP follower 1"; pipeline stages: "pipeline stage 1")
        self._what = what
        self._lost_type = lost
        self._pings: list[tuple[Any, float]] = []
        self._lock = threading.Lock()  # the step thread and the health lane both look
        #: While a graph step runs (`ray_mesh.MeshStep`): takes the step's "step" send, whose
        #: arguments go to the followers' graph nodes; None: plain calls.
        self.handoff: Callable[[tuple[Any, ...]], None] | None = None

    def send(self, method: str, *args: Any) -> Any:
        if method == "step" and self.handoff is not None:
            self.handoff(args)
            return IN_GRAPH
        if method in CTL_METHODS + HEALTH_METHODS:
            lane = {"concurrency_group": CTL_LANE if method in CTL_METHODS else HEALTH_LANE}
            return [a.control.options(**lane).remote(method, *args) for a in self._actors]
        return [a.call.remote(method, *args) for a in self._actors]

    def wait(self, pending: Any, timeout: float | None) -> list[Any]:
        if pending is IN_GRAPH:
            return []  # their answers are the graph's output (`ray_mesh`)
        refs = list(pending)
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: list[Any] = []
        for tp_rank, ref in enumerate(refs, start=1):
            if ref in late:
                raise TimeoutError(f"{self._what} {tp_rank} did not answer within {timeout}s")
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                raise self._lost_type(
                    f"{self._what} {tp_rank} (pid {self._pids[tp_rank - 1]}) died: "
                    f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
                ) from exc
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, tensor_group.FollowerLost):
                    # a pipeline stage whose own TP follower is lost: so is its DP rank
                    raise self._lost_type(f"{self._what} {tp_rank}: {exc.cause}") from exc
                raise RuntimeError(f"{self._what} {tp_rank} failed: {exc.cause!r}") from exc
        return out

    def alive(self) -> str | None:
        with self._lock:
            return self._alive()

    def _alive(self) -> str | None:
        now = time.monotonic()
        if not self._pings:
            self._pings = [
                (a.ping.options(concurrency_group=HEALTH_LANE).remote(), now) for a in self._actors
            ]
            return None
        for tp_rank, (ref, sent) in enumerate(self._pings, start=1):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                if now - sent > tensor_group.FOLLOWER_HANG_S:
                    # Fenced, as the heartbeat fences a hung leader: the leader's step may wait
                    # for it in a TP collective that only its death ends (gloo).
                    ray.kill(self._actors[tp_rank - 1], no_restart=True)
                    return (
                        f"{self._what} {tp_rank} (pid {self._pids[tp_rank - 1]}) did not answer "
                        f"a ping for {now - sent:.1f}s (fenced)"
                    )
                continue
            try:
                answer = ray.get(ref)
            except ray.exceptions.RayActorError:
                return f"{self._what} {tp_rank} (pid {self._pids[tp_rank - 1]}) died"
            except ray.exceptions.RayError:
                answer = None  # it answered: alive
            if isinstance(answer, dict) and answer.get("lost"):
                # a pipeline stage that lost one of its own TP followers
                return f"{self._what} {tp_rank}: {answer['lost']}"
            actor = self._actors[tp_rank - 1]
            self._pings[tp_rank - 1] = (
                actor.ping.options(concurrency_group=HEALTH_LANE).remote(),
                now,
            )
        return None

    def pids(self) -> list[int]:
        return list(self._pids)

    def promote(self, timeout: float) -> None:
        """Every follower at the serving ranks' priority (`FollowerActor.promote`), waited for
        up to `timeout` s (a claimed warm spare, never promoted, raises them at their first
        step: `FollowerActor.call`)."""
        self.wait([a.promote.remote() for a in self._actors], timeout)
