"""`RayExecutor`: one Ray actor per DP rank, stepped through a Ray compiled graph.

- Each rank is one actor (`ray_actor.RankActor`, wrapping a `RankWorker`, three concurrency
  lanes) in its own placement group of one bundle ``{"moe_rank": 1}`` (plus ``{"GPU": 1}`` on
  GPU clusters, where groups use NCCL): the resource a worker pod offers, so the operator can
  map ranks to pods. Ranks are ordered as vLLM's RayDistributedExecutor orders workers.
- Each step is one execution of a compiled graph (`ray_graph`; about half the per-step
  overhead of plain actor calls, see tests/integration/test_executor.py), or plain actor calls
  in "remote" mode (`ray_step.StepPath` carries both).
- Rules learned on Ray 2.60 (REFERENCE.md): two compiled graphs must never be live on the same
  actors, and compiling takes ~0.2 s (~2.5 s over an actor that was just created). So a
  `switch` compiles nothing: it activates the workers, and the new rank set steps through plain
  actor calls at once while the graph over it is compiled in the background and takes over
  (`ray_step`): the switch pause is the workers' `activate`. `warm_up(ranks)` pays a fresh
  actor's first compile ahead (warm spare ranks).
- Failures, measured here (3 ranks, CPU): a SIGKILLed actor makes the running compiled step
  raise `ActorDiedError` within ~0.07 s (its peers' gloo collectives fail with "Connection
  reset by peer"), and the teardown leaves the survivors alive. A SIGSTOPped actor makes the
  step wait for `RAY_CGRAPH_get_timeout`, and a teardown then waits 30 s on it: so the
  heartbeat fences a hung actor (`ray.kill`), after which the step raises within ~0.2 s when
  the raylet's `kill_worker_timeout_milliseconds` is small (a stopped process cannot exit by
  itself; the raylet SIGKILLs it after that delay, 5 s by default; `cluster.connect` sets
  200 ms). Shrinking around the lost rank then takes ~0.3 s (groups, staging, compile).
- Group rendezvous: a FileStore in `group_dir` when every member of a new group has one IP
  (nothing listens on a port), else a TCPStore hosted by the group's rank 0 on a port it
  reports as free (`RankWorker.free_port`).
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import ray.dag
import ray.exceptions
import ray.util

from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.executor import base, ray_actor, ray_step, ray_switch, ray_weights
from moe_runtime.executor import health as health_mod
from moe_runtime.rank import hooks as hooks_mod

log = logging.getLogger(__name__)

STEP_COMPILED = "compiled"
STEP_REMOTE = "remote"


class RayExecutor(ray_switch.SwitchAndWarmUp, ray_weights.GroupsAndWeights, base.Executor):
    """DP ranks as Ray actors (see the module docstring).

    use_gpu: None = when the cluster has GPUs. ready_timeout: seconds to wait for placement
    groups and new actors. step_timeout: seconds one step may take before it is reported.
    rendezvous: "auto" (FileStore when a group's members share one IP, else TCPStore), "tcp"
    or "file" (forced; tests use "tcp" to cover the multi-host path on one machine).
    transfer_backend: backend of the transfer groups. Default gloo even on GPUs: background
    weight moves then never run NCCL kernels next to the step's NCCL collectives (two
    communicators whose kernels interleave in different orders on different ranks can
    deadlock), at the cost of staging weights through host memory. "nccl" is faster.
    step_timeout is the hard limit of one step whose ranks all stay healthy; a hung or dead rank
    is found much sooner, from the heartbeat and the deadline derived from observed step times
    (`health_mod.StepClock`). switch_timeout bounds a `switch` called without a timeout.
    step_mode: "compiled" (a Ray compiled graph per step; the default) or "remote" (plain actor
    calls). Measured on Ray 2.60: while a compiled graph is live, each idle actor busy-waits
    on its input channel (~0.45 of a core, sched_yield loop), so on hosts with fewer cores
    than ranks (laptops, CI, the local demo) "remote" keeps the CPUs for the work; per-step
    latency is similar there. Default: env MOE_STEP_MODE, else "compiled".
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        use_gpu: bool | None = None,
        dtype: str = "float32",
        ready_timeout: float = 120.0,
        step_timeout: float = 120.0,
        switch_timeout: float = 60.0,
        group_dir: str | None = None,
        rendezvous: str = "auto",
        transfer_backend: group_mod.Backend = "gloo",
        step_mode: str | None = None,
        rank_hooks: hooks_mod.HooksFactory | None = None,
    ) -> None:
        mode = step_mode or os.environ.get("MOE_STEP_MODE") or STEP_COMPILED
        if mode not in (STEP_COMPILED, STEP_REMOTE):
            raise ValueError(
                f"step_mode must be {STEP_COMPILED!r} or {STEP_REMOTE!r}, got {mode!r}"
            )
        self.step_mode = mode
        if rendezvous not in ("auto", "tcp", "file"):
            raise ValueError(f"rendezvous must be 'auto', 'tcp' or 'file', got {rendezvous!r}")
        self._rendezvous = rendezvous
        if transfer_backend not in ("gloo", "nccl"):
            raise ValueError(f"transfer_backend must be 'gloo' or 'nccl', got {transfer_backend!r}")
        self._transfer_backend: group_mod.Backend = transfer_backend
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0  # type: ignore[no-untyped-call]
        self.use_gpu = use_gpu
        self._dtype = dtype
        self._rank_hooks = rank_hooks
        self._ready_timeout = ready_timeout
        self._step_timeout = step_timeout
        self._switch_timeout = switch_timeout
        self.clock = health_mod.StepClock()
        self._group_dir = group_dir or tempfile.gettempdir()
        self._driver_node = ray.get_runtime_context().get_node_id()
        self._lock = threading.RLock()
        self._ranks: dict[int, ray_actor.Rank] = {}
        self._active: list[int] = []
        #: The step path (plain calls, or a compiled graph over the stepped actors); no path
        #: after a failed step with lost ranks until the next switch.
        self._path = ray_step.StepPath(
            compiled=mode == STEP_COMPILED, compile_timeout=switch_timeout
        )
        self._switching = False
        self._closed = False
        self._warming: threading.Thread | None = None
        #: Labels held by workers that are still starting (concurrent add_ranks).
        self._starting: set[int] = set()
        self._uids = itertools.count()
        #: Seconds of the last switch: activate (the workers) and the whole switch. The graph
        #: compile that follows in the background is in `last_graph_compile`.
        self.last_switch: dict[str, float] = {}
        started = self._start_ranks(num_ranks, first_label=0)
        with self._lock:
            for r in started:
                self._ranks[r.label] = r
            self._active = [r.label for r in started]

    # -- ranks ---------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        with self._lock:
            return list(self._active)

    @property
    def pending_ranks(self) -> list[int]:
        with self._lock:
            return sorted(r for r in self._ranks if r not in self._active)

    def rank_infos(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return {label: {**r.info, "label": label} for label, r in sorted(self._ranks.items())}

    def actor(self, rank: int) -> Any:
        """The actor handle of rank label `rank` (tests kill it to simulate a lost pod)."""
        with self._lock:
            return self._ranks[rank].actor

    def _start_ranks(
        self, count: int, *, first_label: int, spare: bool = False
    ) -> list[ray_actor.Rank]:
        with self._lock:
            existing = [r.info["node_id"] for r in self._ranks.values()]
        started = ray_actor.start_ranks(
            count,
            first_label=first_label,
            use_gpu=self.use_gpu,
            dtype=self._dtype,
            timeout=self._ready_timeout,
            driver_node=self._driver_node,
            existing_nodes=existing,
            spare=spare,
            hooks=self._rank_hooks,
        )
        with self._lock:
            for r in started:
                r.info["uid"] = next(self._uids)  # follows the worker through relabels
        return started

    # -- calls ---------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str,
        *args: Any,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        background: bool = False,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        with self._lock:
            targets, rank_list = base.rpc_targets(
                method, ranks, active=self._active, members=self._ranks
            )
            actors = [r.actor for r in rank_list]
        refs = []
        for label, actor in zip(targets, actors, strict=True):
            call = actor.execute_method
            if background:
                call = call.options(concurrency_group=ray_actor.CTL_LANE)
            refs.append(call.remote(method, *args, **kwargs, **base.extra_kwargs(per_rank, label)))
        return ray_actor.get_all(refs, targets, what=method, timeout=timeout)

    def execute_step(self, step: step_mod.StepInput) -> list[step_mod.StepOutput]:
        ranks = self._path.ranks
        if ranks is None:
            lost = sorted(self.lost_ranks())
            if lost:
                raise base.RankDied(f"no step path: ranks {lost} are lost", ranks=lost)
            self._set_path()  # after a failure: plain calls now, the graph in the background
            ranks = self._path.ranks
            assert ranks is not None
        self.clock.begin()
        try:
            outs = self._path.execute(step, timeout=self._step_timeout)
        except Exception as exc:  # noqa: BLE001 - every step failure ends in one of two states
            self.clock.end(ok=False)
            self._step_failed(step, ranks, exc)  # always raises
        self.clock.end(ok=True)
        return outs

    def _step_failed(self, step: step_mod.StepInput, ranks: list[int], exc: Exception) -> None:
        """Known state after a failed step, then raise: with every stepped rank healthy the step
        path is rebuilt on the same ranks (ExecutorError: retry); otherwise no step path until
        a switch (RankDied naming the lost ranks)."""
        health = self.check_health(timeout=1.0)
        bad = sorted(
            r for r in ranks if health.get(r) != health_mod.HEALTH_OK or r in self.lost_ranks()
        )
        now = time.monotonic()
        with self._lock:
            for r in bad:
                if r in self._ranks:
                    state = health.get(r, health_mod.HEALTH_DEAD)
                    reason = f"step {step.step_id} failed: {ray_actor.first_line(exc)}"
                    self._ranks[r].health.lose(state, reason, now)
        hung = [r for r in bad if health.get(r) == health_mod.HEALTH_UNRESPONSIVE]
        if hung:
            self.fence(hung, reason="unresponsive in a failed step")
        self._path.clear()
        if bad:
            log.error("step %d failed; ranks %s are lost: %s", step.step_id, bad, exc)
            raise base.RankDied(f"step {step.step_id} failed: {exc}", ranks=bad) from exc
        log.error("step %d failed with every rank healthy: %s; rebuilding", step.step_id, exc)
        self._set_path()  # plain calls at once; a fresh graph in the background
        raise base.ExecutorError(
            f"step {step.step_id} failed: {exc} (step path rebuilt on ranks {ranks})"
        ) from exc

    def execute_step_remote(self, step: step_mod.StepInput) -> list[step_mod.StepOutput]:
        """The same step through plain actor calls, whatever the step mode (benchmarks)."""
        return self._remote_step(step, self.ranks)

    def _remote_step(
        self, step: step_mod.StepInput, ranks: Sequence[int]
    ) -> list[step_mod.StepOutput]:
        with self._lock:
            actors = [self._ranks[r].actor for r in ranks]
        refs = [a.execute_step.remote(step) for a in actors]
        outs: list[step_mod.StepOutput] = ray_actor.get_all(
            refs, list(ranks), what="execute_step", timeout=self._step_timeout
        )
        return outs

    # -- the step path -------------------------------------------------------------------
    def _set_path(self) -> None:
        """Step the active ranks from the next step on (`ray_step.StepPath.set`)."""
        with self._lock:
            ranks = list(self._active)
            actors = [self._ranks[r].actor for r in ranks]
        self._path.set(ranks, actors)

    def fail_next_compile(self) -> None:
        """Test hook: the next background compile of the step graph fails (plain actor calls
        keep serving; the compile is tried again later)."""
        self._path.fail_next_compile()

    def step_graph_live(self) -> bool:
        """A compiled graph carries the steps now (else plain actor calls do)."""
        return self._path.graph_live()

    def wait_step_graph(self, timeout: float = 60.0) -> bool:
        """Wait until no background compile runs (tests, benchmarks); True when none does."""
        return self._path.wait_idle(timeout)

    @property
    def last_graph_compile(self) -> dict[str, Any]:
        """Seconds of the last background compile (teardown, compile, probe), or its error."""
        return dict(self._path.last_compile)

    def has_step_path(self) -> bool:
        with self._lock:
            switching = self._switching
        return switching or self._path.ranks is not None

    # -- elastic primitives --------------------------------------------------------------
    def add_ranks(
        self, count: int, *, timeout: float | None = None, spare: bool = False
    ) -> list[int]:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._lock:
            first = max([-1, *self._ranks, *self._starting]) + 1
            labels = range(first, first + count)
            self._starting.update(labels)  # concurrent add_ranks get other labels
        try:
            started = self._start_ranks(count, first_label=first, spare=spare)
        finally:
            with self._lock:
                self._starting.difference_update(labels)
        with self._lock:
            for r in started:
                self._ranks[r.label] = r
        return [r.label for r in started]

    def remove_ranks(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        started = time.monotonic()
        self._join_warm_up()
        with self._lock:
            unknown = [r for r in ranks if r not in self._ranks]
            if unknown:
                raise ValueError(f"remove_ranks: no worker for ranks {unknown}")
        if any(r in (self._path.ranks or []) for r in ranks):
            self._path.clear()
        with self._lock:
            removed = [self._ranks.pop(r) for r in ranks]
            self._active = [r for r in self._active if r not in ranks]
        healthy = [r for r in removed if r.health.state == health_mod.HEALTH_OK]
        refs = [r.actor.execute_method.remote("shutdown") for r in healthy]
        asked = time.monotonic()
        ray.wait(refs, num_returns=len(refs), timeout=10.0)
        shut = time.monotonic()
        infos = []
        for r in removed:
            ray.kill(r.actor, no_restart=True)
            ray.util.remove_placement_group(r.pg)
            infos.append(dict(r.info))
        log.info(
            "removed ranks %s in %.2fs (their shutdown %.2fs, waiting before it %.2fs): pods %s",
            list(ranks),
            time.monotonic() - started,
            shut - asked,
            asked - started,
            [i.get("pod") for i in infos],
        )
        return infos

    def check_health(self, *, timeout: float = 5.0) -> dict[int, str]:
        with self._lock:
            ranks = dict(self._ranks)
        return ray_actor.check_health(ranks, timeout=timeout)

    def _health_members(self) -> dict[int, health_mod.RankHealth]:
        with self._lock:
            return {label: r.health for label, r in self._ranks.items()}

    def _send_ping(self, label: int) -> Any:
        with self._lock:
            actor = self._ranks[label].actor
        return ray_actor.ping(actor)

    def _poll_ping(self, handle: Any) -> str | None:
        return ray_actor.poll(handle)

    def fence(self, ranks: Sequence[int], *, reason: str = "fenced") -> None:
        now = time.monotonic()
        with self._lock:
            targets = [self._ranks[r] for r in ranks if r in self._ranks]
        for r in targets:
            r.health.lose(health_mod.HEALTH_UNRESPONSIVE, reason, now)
            r.health.fenced = True
            log.error(
                "fencing rank %d (pid %s, %s): %s",
                r.label,
                r.info.get("pid"),
                r.info.get("pod"),
                reason,
            )
            ray.kill(r.actor, no_restart=True)

    def free_rank_slots(self) -> int | None:
        return int(ray_actor.free_resource(ray_actor.RANK_RESOURCE))

    def shutdown(self) -> None:
        self.stop_heartbeat()
        self._join_warm_up()
        if self._closed:
            return
        self._closed = True
        self._path.close()
        with self._lock:
            ranks = list(self._ranks.values())
            self._ranks = {}
            self._active = []
        for r in ranks:
            ray.kill(r.actor)
            ray.util.remove_placement_group(r.pg)
        self._close_async_pool()
