"""`RayExecutor`: one Ray actor per DP rank, stepped through a Ray compiled graph.

- Each rank is one actor (`ray_actor.RankActor`, wrapping a `RankWorker`, four concurrency
  lanes) in its own placement group of one bundle ``{"moe_rank": 1}`` (plus ``{"GPU": 1}`` on
  GPU clusters, where groups use NCCL): the resource a worker pod offers, so the operator can
  map ranks to pods. Ranks are ordered as vLLM's RayDistributedExecutor orders workers.
- Each step is one execution of a compiled graph (`ray_graph`; about half the per-step
  overhead of plain actor calls, bench/step.py), or plain actor calls in "remote" mode (the
  `path`, `ray_step.StepPath`, carries both; it parks a graph idle for ~2 s, whose actors
  would otherwise busy-wait for input, and compiles it again at the next step).
- Its parts: the roster, heartbeat, switch and weight mover of every executor (`base`), the
  mover's shared-memory way (`ray_weights.SharedMemory`), the group builder
  (`ray_groups.RayGroups`), the step path (`path`: `ray_step.StepPath`) and the warm-up of new
  actors' first compile (`ray_graph.WarmUp`).
- Rules learned on Ray 2.60 (docs/INTERNALS.md, "Ray 2.60 rules"): two compiled graphs must never be live on the same
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
- Group rendezvous: see `ray_groups`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import ray
import ray.util

from moe_runtime import step as step_mod
from moe_runtime.executor import (
    base,
    guards,
    ray_actor,
    ray_bundles,
    ray_calls,
    ray_graph,
    ray_groups,
    ray_health,
    ray_mesh,
    ray_start,
    ray_step,
    ray_weights,
    roster,
)
from moe_runtime.executor import health as health_mod
from moe_runtime.rank import hooks as hooks_mod

log = logging.getLogger(__name__)

STEP_COMPILED = "compiled"
STEP_REMOTE = "remote"
#: Seconds `load_progress` waits for the ranks' answers (a `GET /ready` waits on it).
LOAD_POLL_S = 1.0


class RayExecutor(base.Executor):
    """DP ranks as Ray actors (see the module docstring).

    use_gpu: None = when the cluster has GPUs. ready_timeout: seconds to wait for placement
    groups and new actors. step_timeout: seconds one step may take before it is reported.
    rendezvous: "auto" (FileStore when a group's members share one IP, else TCPStore), "tcp"
    or "file" (forced; tests use "tcp" to cover the multi-host path on one machine).
    transfer_backend: backend of the transfer groups: "auto" (the default; env
    MOE_TRANSFER_BACKEND overrides it) takes NCCL, GPU memory to GPU memory, when every member
    of the group is a GPU rank with the same NCCL version, else gloo through pinned host memory
    (CPU ranks; nodes that cannot share an NCCL communicator); "gloo" or "nccl" force one.
    The NCCL transfer group's kernels run beside the step group's: NVIDIA guarantees no order
    between two communicators' kernels, so they could deadlock if they stopped fitting on the
    GPU together (NCCL issue #195). Both groups connect eagerly (no device allocation mid-run,
    `semantics.Nccl`), the step group's stream has the higher priority, and a deadlock would
    end at the step group's op timeout like any stuck collective (the group fails, the
    recovery rebuilds it): MOE_TRANSFER_BACKEND=gloo trades that for host-staged transfers.
    step_timeout is the hard limit of one step whose ranks all stay healthy; a hung or dead rank
    is found much sooner, from the heartbeat and the deadline derived from observed step times
    (`health_mod.StepClock`). switch_timeout bounds a `switch` called without a timeout.
    step_mode: "compiled" (a Ray compiled graph per step; the default) or "remote" (plain actor
    calls). Default: env MOE_STEP_MODE, else "compiled". Measured on Ray 2.60: while a
    compiled graph is live, each actor busy-waits on its input channel between steps (up to a
    core each, sched_yield loop), so the step path tears an idle graph down after
    park_after s without a step (`ray_step`, "Parking"; default env
    MOE_STEP_GRAPH_PARK_SECONDS, else `ray_step.PARK_AFTER_SECONDS`; 0 never parks) and the
    next step compiles it again in the background. rank_hooks: a
    factory of hooks for every rank (`moe_runtime.rank.hooks`; pickled by reference, so its
    module must be importable in the actors: tests install fault hooks with it).
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        use_gpu: bool | None = None,
        dtype: str = "auto",
        ready_timeout: float = 120.0,
        step_timeout: float = 120.0,
        switch_timeout: float = 60.0,
        group_dir: str | None = None,
        rendezvous: str = "auto",
        transfer_backend: str | None = None,
        step_mode: str | None = None,
        park_after: float | None = None,
        rank_hooks: hooks_mod.HooksFactory | None = None,
        tp_size: int = 1,
        pp_size: int = 1,
        pp_micro_batch_tokens: int | None = None,
        pp_interleave: bool = False,
        expert_layout: str = "leader",
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {pp_size}")
        #: Actors per DP rank: its leader and T-1 tensor-parallel followers (`ray_tensor`).
        self.tp_size = tp_size
        #: Pipeline stages per DP rank: its leader (stage 0) and P-1 stage actors
        #: (`ray_pipeline`).
        self.pp_size = pp_size
        #: The stage leaders' micro-batch threshold (`pipeline_group.micro_batches`; None:
        #: its default).
        self.pp_micro_batch_tokens = pp_micro_batch_tokens
        #: Where the routed experts live at T > 1 (`model.tensor_parallel`: "leader", "mesh").
        self.expert_layout = expert_layout
        #: Interleaved step groups the engine may send (`engine.step_groups`), as many steps
        #: in flight: P (`ray_mesh.step_groups`) where each step's stage 0 overlaps the
        #: earlier steps' later stages (`pp_interleave` at P > 1: the step graph's interleaved
        #: shape, `ray_graph._pipeline`, or plain calls in two parts, `ray_calls.step_calls`).
        self.step_groups = ray_mesh.step_groups(pp_size, interleave=pp_interleave)
        #: Whether the engine may send a step ahead with placeholders (`engine.core`): not
        #: through an interleaved graph, whose leader never samples (set below).
        self.step_placeholders = True
        mode = step_mode or os.environ.get("MOE_STEP_MODE") or STEP_COMPILED
        if mode not in (STEP_COMPILED, STEP_REMOTE):
            raise ValueError(
                f"step_mode must be {STEP_COMPILED!r} or {STEP_REMOTE!r}, got {mode!r}"
            )
        self.step_mode = mode
        if mode == STEP_COMPILED:
            guards.check_compiled_graph()
        if rendezvous not in ("auto", "tcp", "file"):
            raise ValueError(f"rendezvous must be 'auto', 'tcp' or 'file', got {rendezvous!r}")
        transfer_backend = transfer_backend or os.environ.get("MOE_TRANSFER_BACKEND") or "auto"
        if transfer_backend not in ray_groups.TRANSFER_BACKENDS:
            raise ValueError(
                f"transfer_backend must be one of {ray_groups.TRANSFER_BACKENDS}, "
                f"got {transfer_backend!r}"
            )
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0  # type: ignore[no-untyped-call]
        self.use_gpu = use_gpu
        #: Pipeline stage actors are nodes of the step graph (`ray_mesh.stage_nodes`).
        interleave = self.step_groups > 1
        self._stage_nodes = ray_mesh.stage_nodes(tp_size, use_gpu=use_gpu, interleave=interleave)
        if interleave and mode == STEP_COMPILED and not self._stage_nodes:
            # without its stages as nodes a graph step is the leader's whole step: no overlap
            log.info(
                "pipeline interleave: steps go by plain calls (begin, end), not the step graph "
                "(%s=1 puts the stages in it: the default on GPUs)",
                ray_mesh.STAGES_ENV,
            )
            self.step_mode = mode = STEP_REMOTE
        self.step_placeholders = not (self.step_groups > 1 and mode == STEP_COMPILED)
        self._dtype = dtype
        self._ready_timeout = ready_timeout
        #: Seconds one step may take while every rank stays healthy (tests lower it).
        self.step_timeout = step_timeout
        self._rank_hooks = rank_hooks
        #: The head's variables every rank actor gets (`guards.rank_env`), read once here.
        self._rank_env = guards.rank_env(os.environ)
        self._driver_node = ray.get_runtime_context().get_node_id()
        members: roster.Roster[ray_actor.RankHandle] = roster.Roster()
        #: The step path (plain calls, or a compiled graph over the stepped actors); no path
        #: after a failed step with lost ranks until the next switch.
        self.path = ray_step.StepPath(
            compiled=mode == STEP_COMPILED,
            compile_timeout=switch_timeout,
            park_after=ray_step.park_after_from_env() if park_after is None else park_after,
            transport=ray_mesh.stage_transport(use_gpu=use_gpu),  # the stages' lanes' tensors
            split=self.step_groups > 1,
        )
        self._warm = ray_graph.WarmUp(timeout=ready_timeout)
        #: Steps sent and not yet collected (the engine sends a second one ahead of the
        #: first's outputs: `submit_step`); guards the heartbeat clock's begin/end.
        self._sent = 0
        self._sent_lock = threading.Lock()
        super().__init__(
            roster=members,
            groups=ray_groups.RayGroups(
                members=members,
                lost=self.lost_ranks,
                step_backend="nccl" if use_gpu else "gloo",
                transfer_backend=transfer_backend,
                rendezvous=rendezvous,
                group_dir=group_dir or tempfile.gettempdir(),
            ),
            shared=ray_weights.SharedMemory(
                members=members,
                enabled=not use_gpu,
                pipelined=self.pp_size > 1,
                split=self.tp_size * self.pp_size > 1,
            ),
            switch_timeout=switch_timeout,
        )
        self._closed = False
        members.add(self._start_ranks(num_ranks, first_label=0), active=True)

    def _start_ranks(
        self, count: int, *, first_label: int, spare: bool = False
    ) -> list[ray_actor.Member]:
        return ray_start.start_ranks(
            count,
            first_label=first_label,
            use_gpu=self.use_gpu,
            dtype=self._dtype,
            timeout=self._ready_timeout,
            driver_node=self._driver_node,
            existing=[m.info for m in self.roster.members().values()],
            spare=spare,
            hooks=self._rank_hooks,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            micro_batch_tokens=self.pp_micro_batch_tokens,
            env=self._rank_env,
            expert_layout=self.expert_layout,
        )

    # -- calls ---------------------------------------------------------------------------
    def _call(self, calls: base.Calls) -> list[Any]:
        refs = []
        for m, kwargs in calls.per_member:
            call = m.handle.actor.execute_method
            if calls.background:
                call = call.options(concurrency_group=ray_actor.CTL_LANE)
            refs.append(call.remote(calls.method, *calls.args, **kwargs))
        return ray_calls.get_all(refs, calls.labels, what=calls.method, timeout=calls.timeout)

    def execute_step(self, step: step_mod.StepInput) -> list[step_mod.StepOutput]:
        return self.collect_step(self.submit_step(step))

    def submit_step(self, step: step_mod.StepInput) -> ray_step.Submitted:
        """Send `step` to the stepped ranks and return at once; `collect_step` takes its
        outputs. A second step may be sent before the first is collected (the engine's two
        steps in flight): the ranks run them in the order they were sent."""
        ranks = self.path.ranks
        if ranks is None:
            lost = sorted(self.lost_ranks())
            if lost:
                raise base.RankDied(f"no step path: ranks {lost} are lost", ranks=lost)
            self._set_path()  # after a failure: plain calls now, the graph in the background
            ranks = self.path.ranks
            assert ranks is not None
        with self._sent_lock:
            if not self._sent:
                self.heartbeat.clock.begin()
            self._sent += 1
        try:
            return self.path.submit(step)
        except Exception as exc:  # noqa: BLE001 - the same two states as a failed step
            self._sent_landed(ok=False)
            self._step_failed(step, ranks, exc)

    def collect_step(self, sent: ray_step.Submitted) -> list[step_mod.StepOutput]:
        """The outputs of a step `submit_step` sent (in the order they were sent). A step
        sent before an earlier one failed (the path was cleared or rebuilt since) fails
        with `ExecutorError` and no second failure handling."""
        step, ranks = sent.step, sent.ranks
        stale = f"step {step.step_id} was sent before an earlier step failed"
        try:
            outs = self.path.collect(sent, timeout=self.step_timeout)
        except Exception as exc:  # noqa: BLE001 - every step failure ends in one of two states
            self._sent_landed(ok=False)
            if not self.path.current(sent.gen):
                raise base.ExecutorError(f"{stale}: {exc}") from exc
            self._step_failed(step, ranks, exc)  # always raises
        self._sent_landed(ok=True)
        if not self.path.current(sent.gen):
            raise base.ExecutorError(stale)
        self.after_step(step, ranks, outs)
        return outs

    def _sent_landed(self, *, ok: bool) -> None:
        """A sent step ended: the heartbeat's clock times the next one sent, if any, from now
        (it starts on the ranks when this one ends)."""
        clock = self.heartbeat.clock
        with self._sent_lock:
            self._sent -= 1
            clock.end(ok=ok)
            if self._sent:
                clock.begin()

    def _step_failed(self, step: step_mod.StepInput, ranks: list[int], exc: Exception) -> NoReturn:
        """Known state after a failed step, then raise: with every stepped rank healthy the step
        path is rebuilt on the same ranks (ExecutorError: retry); otherwise no step path until
        a switch (RankDied naming the lost ranks)."""
        health = self.check_health(timeout=1.0)
        bad = sorted(
            r for r in ranks if health.get(r) != health_mod.HEALTH_OK or r in self.lost_ranks()
        )
        now = time.monotonic()
        members = self.roster.members()
        for r in bad:
            if r in members:
                state = health.get(r, health_mod.HEALTH_DEAD)
                reason = f"step {step.step_id} failed: {ray_calls.first_line(exc)}"
                members[r].health.lose(state, reason, now)
        hung = [r for r in bad if health.get(r) == health_mod.HEALTH_UNRESPONSIVE]
        if hung:
            self.fence(hung, reason="unresponsive in a failed step")
        self.path.clear()
        if bad:
            self.abort_peers(bad)  # stepped peers still waiting for them in a collective
            log.error("step %d failed; ranks %s are lost: %s", step.step_id, bad, exc)
            raise base.RankDied(f"step {step.step_id} failed: {exc}", ranks=bad) from exc
        log.error("step %d failed with every rank healthy: %s; rebuilding", step.step_id, exc)
        self._set_path()  # plain calls at once; a fresh graph in the background
        raise base.ExecutorError(
            f"step {step.step_id} failed: {exc} (step path rebuilt on ranks {ranks})"
        ) from exc

    def _set_path(self) -> None:
        """Step the active ranks from the next step on (`ray_step.StepPath.set`)."""
        members = self.roster.targets("step", None)
        self.path.set(
            [m.label for m in members],
            [m.handle.actor for m in members],
            [self._graph_followers(m) for m in members],
            [self._graph_stages(m) for m in members],
        )

    def _graph_followers(self, member: ray_actor.Member) -> tuple[Any, ...]:
        """The TP followers of `member` that are nodes of the step graph (`ray_mesh`): all of
        them at pipeline size 1, none with pipeline stages (a stage leader calls its own)."""
        return member.handle.followers if self.pp_size == 1 else ()

    def _graph_stages(self, member: ray_actor.Member) -> tuple[Any, ...]:
        """The pipeline stages of `member` (P > 1): nodes of the step graph, a lane of them
        per micro-batch, where `ray_mesh.stage_nodes` says so; their TP followers are not
        (each stage calls its own)."""
        return member.handle.stages if self._stage_nodes else ()

    def has_step_path(self) -> bool:
        return self.switcher.switching or self.path.ranks is not None

    # -- elastic primitives --------------------------------------------------------------
    def add_ranks(
        self, count: int, *, timeout: float | None = None, spare: bool = False
    ) -> list[int]:
        labels = self.roster.reserve(count)  # concurrent add_ranks get other labels
        try:
            started = self._start_ranks(count, first_label=labels[0], spare=spare)
        finally:
            self.roster.unreserve(labels)
        moved = self.roster.add(started)
        if moved:  # a switch gave their labels to active ranks while they started
            log.info("ranks started as %s take labels %s", labels, [m.label for m in started])
            self._tell(moved)
        return [m.label for m in started]

    def promote(self, ranks: Sequence[int]) -> None:
        members = self.roster.targets("promote", ranks)
        refs = [m.handle.actor.promote.remote() for m in members]
        ray_calls.get_all(refs, list(ranks), what="promote", timeout=self._ready_timeout)

    def warm_up(self, ranks: Sequence[int]) -> None:
        """Pay the first compiled graph of pending workers now, in a thread (compiled mode;
        a no-op otherwise): a throwaway graph over them only, never over stepped workers.
        `switch` and `remove_ranks` wait for it; `prepare_switch` does so outside the pause."""
        if not self.path.compiled or not ranks:
            return
        stepped = set(self.path.ranks or [])
        if stepped & set(ranks):
            raise ValueError(f"warm_up: ranks {sorted(stepped & set(ranks))} are stepped")
        members = self.roster.targets("warm_up", ranks)
        self._warm.start(
            [m.handle.actor for m in members]
            + [f for m in members for f in self._graph_followers(m)]
            + [s for m in members for s in self._graph_stages(m)]
        )

    def prepare_switch(self) -> None:
        self._warm.join()

    def _prepare(self, left: float | None) -> None:
        self._warm.join(left)

    def _tell(self, members: list[ray_actor.Member]) -> None:
        """Relabelled actors learn their labels: sent, not awaited (they run before any later
        call on the same lane)."""
        for m in members:
            m.handle.actor.execute_method.remote("set_label", m.label)

    def _clear_path(self) -> None:
        self.path.clear()

    def remove_ranks(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        started = time.monotonic()
        self._warm.join()
        self.roster.targets("remove_ranks", ranks)  # every one exists, or nothing changes
        if any(r in (self.path.ranks or []) for r in ranks):
            self.path.clear()
        removed = self.roster.remove(ranks)
        healthy = [m for m in removed if m.health.state == health_mod.HEALTH_OK]
        refs = [m.handle.actor.execute_method.remote("shutdown") for m in healthy]
        asked = time.monotonic()
        ray.wait(refs, num_returns=len(refs), timeout=10.0)
        shut = time.monotonic()
        infos = []
        for m in removed:
            ray.kill(m.handle.actor, no_restart=True)
            ray.util.remove_placement_group(m.handle.pg)
            infos.append(dict(m.info))
        log.info(
            "removed ranks %s in %.2fs (their shutdown %.2fs, waiting before it %.2fs): pods %s",
            list(ranks),
            time.monotonic() - started,
            shut - asked,
            asked - started,
            [i.get("pod") for i in infos],
        )
        return infos

    def load_progress(self) -> list[dict[str, Any]]:
        members = [m for _, m in sorted(self.roster.members().items())]
        return ray_health.load_progress([m.handle.actor for m in members], timeout=LOAD_POLL_S)

    def check_health(self, *, timeout: float = 5.0) -> dict[int, str]:
        return ray_health.check_health(self.roster.members(), timeout=timeout)

    def _send_ping(self, label: int) -> Any:
        return ray_health.ping(self.roster.member(label).handle.actor)

    def _poll_ping(self, handle: Any) -> str | None:
        return ray_health.poll(handle)

    def _ping_error(self, handle: Any) -> str | None:
        return ray_health.ping_error(handle)

    def _send_abort(self, member: ray_actor.Member, reason: str) -> None:
        health = {"concurrency_group": ray_actor.HEALTH_LANE}
        member.handle.actor.execute_method.options(**health).remote("abort_live_groups", reason)

    def fence(self, ranks: Sequence[int], *, reason: str = "fenced") -> None:
        now = time.monotonic()
        members = self.roster.members()
        for m in [members[r] for r in ranks if r in members]:
            m.health.lose(health_mod.HEALTH_UNRESPONSIVE, reason, now)
            m.health.fenced = True
            log.error(
                "fencing rank %d (pid %s, %s): %s",
                m.label,
                m.info.get("pid"),
                m.info.get("pod"),
                reason,
            )
            ray.kill(m.handle.actor, no_restart=True)

    def free_rank_slots(self) -> int | None:
        # in DP ranks: each takes T rank slots (its leader and followers)
        per_rank = self.tp_size * self.pp_size
        return int(ray_bundles.free(ray_bundles.RANK_RESOURCE)) // per_rank

    def shutdown(self) -> None:
        self._close()
        self._warm.join()
        if self._closed:
            return
        self._closed = True
        self.path.close()
        for m in self.roster.clear():
            ray.kill(m.handle.actor)
            ray.util.remove_placement_group(m.handle.pg)
