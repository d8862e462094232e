"""The mechanics of each resize stage on a real engine and executor (`ResizeOps`).

Scale up N→M (ranks keep their labels; the new ones are N..M-1):
- Standby: start M-N rank workers with placeholder weights (or the model source's non-expert
  weights with `weight_source="storage"`); build the step and transfer groups of a new epoch
  over all M ranks in the background while the old group keeps serving.
- Transferring: non-expert weights go from old ranks to new ones over the new transfer group
  (peer to peer); the placement for M ranks is computed (`rebalance_for_resize`, which keeps
  experts where they are) and the experts every rank lacks are staged beside the live ones.
- Switching: at one step boundary, the step graph is torn down, every rank activates the new
  epoch (staged experts become live), the graph is compiled over M ranks and the engine starts
  giving sequences to the new ranks. Requests that arrive meanwhile wait in the queue.
- Reshuffling: EPLB recomputes the placement from the recent load and moves experts in the
  background; the new map is swapped in at a step boundary (`StepInput.control`).

Scale down M→N (the highest ranks leave):
- Reshuffling: the placement for the N survivors is staged on them (experts on departing
  ranks are copied to survivors first; the live placement keeps serving); the survivors build
  the next epoch's groups in the background.
- Migrating: sequences on departing ranks move to survivors at a step boundary and are
  re-prefilled there with prompt + tokens generated so far (none is aborted).
- Switching: at one boundary the graph is rebuilt over the N survivors under the new epoch.
- Releasing: the departing workers stop; the record names their pods (`freed`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moe_runtime import step as step_mod
from moe_runtime.elastic import records, stages
from moe_runtime.engine import core as engine_core
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.eplb import window as window_mod
from moe_runtime.executor import base as executor_base
from moe_runtime.model import config as config_mod

log = logging.getLogger(__name__)

CONTROL_EXPERT_EPOCH = "expert_epoch"  # the worker's StepInput.control key


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """How the runtime resizes and rebalances.

    weight_source: "peer" (new ranks get non-expert weights from serving ranks) or "storage"
    (new ranks read them from the model source). eplb_*: dynamic EPLB while serving (every
    `eplb_step_interval` steps, from the load of the last `eplb_window_size` steps; applied only
    when balancedness improves by at least `eplb_min_gain`). rpc_timeout: seconds for one
    collective call; boundary_timeout: seconds to wait for a step boundary.
    """

    source: str
    num_redundant_experts: int = 0
    weight_source: str = "peer"
    eplb_enabled: bool = True
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000
    eplb_min_gain: float = 0.02
    rpc_timeout: float = 300.0
    boundary_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.weight_source not in ("peer", "storage"):
            raise ValueError(
                f"weight_source must be 'peer' or 'storage', got {self.weight_source!r}"
            )


@dataclasses.dataclass
class Serving:
    """What serves now: the placement over `num_ranks` ranks, and the group epoch."""

    placement: policy.Placement
    num_ranks: int
    epoch: int
    next_epoch: int = 1
    next_stage: int = 1_000

    def take_epoch(self) -> int:
        epoch = self.next_epoch
        self.next_epoch += 1
        return epoch

    def take_stage(self) -> int:
        stage = self.next_stage
        self.next_stage += 1
        return stage


@dataclasses.dataclass
class Plan:
    """One resize in progress (what `rollback` must undo)."""

    from_size: int
    to_size: int
    epoch: int
    new_labels: list[int] = dataclasses.field(default_factory=list)
    departing: list[int] = dataclasses.field(default_factory=list)
    target: policy.Placement | None = None
    staged_on: list[int] = dataclasses.field(default_factory=list)
    groups_on: list[int] = dataclasses.field(default_factory=list)
    switched: bool = False
    migrated: bool = False


class LoadTracker:
    """Expert load per step (summed over ranks) into a window, for EPLB and balancedness."""

    def __init__(self, config: config_mod.ModelConfig, window_size: int) -> None:
        self._lock = threading.Lock()
        self.window = window_mod.LoadWindow(config.num_layers, config.num_experts, window_size)
        self.steps = 0

    def observe(self, outputs: Sequence[step_mod.StepOutput]) -> None:
        loads = [o.expert_load for o in outputs if isinstance(o.expert_load, torch.Tensor)]
        if not loads:
            return
        with self._lock:
            self.window.record(torch.stack(loads).sum(0))
            self.steps += 1

    def total(self) -> torch.Tensor:
        with self._lock:
            return self.window.total()


class EngineResizeOps:
    """`ResizeOps` over an `Engine` and an `Executor` (see the module docstring)."""

    def __init__(
        self,
        *,
        engine: engine_core.Engine,
        executor: executor_base.Executor,
        model_config: config_mod.ModelConfig,
        serving: Serving,
        config: ElasticConfig,
    ) -> None:
        self.engine = engine
        self.executor = executor
        self.model_config = model_config
        self.serving = serving
        self.config = config
        self.load = LoadTracker(model_config, config.eplb_window_size)
        # One mechanism at a time: a resize and a dynamic rebalance never overlap.
        self.mechanics = threading.Lock()
        self.rebalances = 0
        self.last_rebalance: dict[str, Any] = {}
        self._eplb_thread: threading.Thread | None = None
        engine.on_step(self._on_step)

    # -- figures -------------------------------------------------------------------------
    @property
    def bytes_per_expert(self) -> int:
        cfg = self.model_config
        return 3 * cfg.hidden_size * cfg.intermediate_size * 4

    def num_physical_for(self, size: int) -> int:
        return policy.num_physical_for(
            self.model_config.num_experts, size, self.config.num_redundant_experts
        )

    def balancedness(self) -> float:
        placement, n = self.serving.placement, self.serving.num_ranks
        return policy.balancedness(self.load.total(), placement, n)

    # -- ResizeOps -----------------------------------------------------------------------
    def current_size(self) -> int:
        return self.executor.num_ranks

    def begin(self, record: records.ResizeRecord) -> Plan:
        if not self.mechanics.acquire(timeout=self.config.boundary_timeout):
            raise TimeoutError("an expert rebalance did not finish in time")
        try:
            record.balancedness_before = self.balancedness()
        except Exception:
            self.mechanics.release()
            raise
        return Plan(
            from_size=record.from_size,
            to_size=record.to_size,
            epoch=self.serving.take_epoch(),
        )

    def end(self, plan: Any) -> None:
        """The resize is over (completed or rolled back): let dynamic EPLB run again."""
        self.mechanics.release()

    def run_stage(self, stage: stages.Stage, plan: Any, record: records.ResizeRecord) -> None:
        assert isinstance(plan, Plan)
        up = plan.to_size > plan.from_size
        handlers = {
            (True, stages.Stage.STANDBY): self._up_standby,
            (True, stages.Stage.TRANSFERRING): self._up_transfer,
            (True, stages.Stage.SWITCHING): self._up_switch,
            (True, stages.Stage.RESHUFFLING): self._up_reshuffle,
            (False, stages.Stage.RESHUFFLING): self._down_reshuffle,
            (False, stages.Stage.MIGRATING): self._down_migrate,
            (False, stages.Stage.SWITCHING): self._down_switch,
            (False, stages.Stage.RELEASING): self._down_release,
        }
        handler = handlers.get((up, stage))
        if handler is None:
            raise ValueError(f"no {stage.value} stage in a resize {plan.from_size}->{plan.to_size}")
        handler(plan, record)

    def rollback(self, plan: Any, record: records.ResizeRecord, failed: stages.Stage) -> str:
        if not isinstance(plan, Plan):
            return f"serving at data parallel size {self.executor.num_ranks}"
        if plan.switched:
            if plan.departing and any(r in self.executor.pending_ranks for r in plan.departing):
                record.freed = self.executor.remove_ranks(
                    [r for r in plan.departing if r in self.executor.pending_ranks]
                )
            if plan.staged_on:
                self._rpc("discard_staged", ranks=self.executor.ranks)
            return f"serving at data parallel size {self.executor.num_ranks}"
        problems: list[str] = []
        live = set(self.executor.ranks) | set(self.executor.pending_ranks)
        if plan.staged_on:
            try:
                self._rpc("discard_staged", ranks=[r for r in plan.staged_on if r in live])
            except Exception as exc:  # noqa: BLE001 - go on releasing the rest
                problems.append(f"discard_staged: {exc}")
        old = [r for r in plan.groups_on if r in set(self.executor.ranks)]
        if old:
            try:
                self._rpc("drop_epoch", plan.epoch, ranks=old, background=True)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"drop_epoch: {exc}")
        new = [r for r in plan.new_labels if r in live]
        if new:
            try:
                self.executor.remove_ranks(new)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"remove_ranks: {exc}")
        if plan.migrated:
            try:
                self.engine.set_active_ranks(self.executor.ranks).result(
                    timeout=self.config.boundary_timeout
                )
            except Exception as exc:  # noqa: BLE001
                problems.append(f"set_active_ranks: {exc}")
        where = f"serving at data parallel size {self.executor.num_ranks}"
        return where + (f" (cleanup problems: {'; '.join(problems)})" if problems else "")

    # -- helpers -------------------------------------------------------------------------
    def _rpc(
        self,
        method: str,
        *args: Any,
        ranks: Sequence[int],
        background: bool = False,
        per_rank: dict[int, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        return self.executor.collective_rpc(
            method,
            *args,
            ranks=list(ranks),
            timeout=self.config.rpc_timeout,
            background=background,
            per_rank=per_rank,
            **kwargs,
        )

    def _at_boundary(self, fn: Any) -> Any:
        return self.engine.call_at_boundary(fn).result(timeout=self.config.boundary_timeout)

    def _stage_experts(
        self,
        plan: Plan,
        *,
        epoch: int,
        members: Sequence[int],
        old: policy.Placement,
        old_num_ranks: int,
        target: policy.Placement,
        new_num_ranks: int,
        record: records.ResizeRecord,
        stage_id: int | None = None,
    ) -> None:
        """Stage `target` on the members of epoch's transfer group (member i = rank i)."""
        moves = moves_mod.plan_moves(
            old, target, old_num_ranks=old_num_ranks, new_num_ranks=new_num_ranks
        )
        record.expert_moves += len(moves)
        record.expert_moves_lower_bound += moves_mod.lower_bound_moves(
            old, target, old_num_ranks=old_num_ranks, new_num_ranks=new_num_ranks
        )
        plan.staged_on = list(members)
        record.bytes_expert += self._stage_rpc(
            epoch, moves, target, members=members, new_num_ranks=new_num_ranks, stage_id=stage_id
        )

    def _stage_rpc(
        self,
        epoch: int,
        moves: list[moves_mod.ExpertMove],
        target: policy.Placement,
        *,
        members: Sequence[int],
        new_num_ranks: int,
        stage_id: int | None,
    ) -> int:
        """Every member stages its slots of `target` (member i is rank i; i >= new_num_ranks
        leaves and only sends) over epoch's transfer group; returns the bytes received."""
        received = self._rpc(
            "stage_experts",
            epoch,
            moves,
            target,
            ranks=members,
            background=True,
            per_rank={
                r: {"new_rank": (i if i < new_num_ranks else None)} for i, r in enumerate(members)
            },
            new_num_ranks=new_num_ranks,
            stage=stage_id,
        )
        return int(sum(int(b) for b in received))

    # -- scale up ------------------------------------------------------------------------
    def _up_standby(self, plan: Plan, record: records.ResizeRecord) -> None:
        old = self.executor.ranks
        plan.new_labels = self.executor.add_ranks(
            plan.to_size - plan.from_size, timeout=self.config.rpc_timeout
        )
        storage = self.config.weight_source == "storage"
        loaded = self._rpc(
            "load_weights",
            ranks=plan.new_labels,
            per_rank={r: {"rank": len(old) + i} for i, r in enumerate(plan.new_labels)},
            source=self.config.source,
            num_ranks=plan.to_size,
            placement=None,
            placeholder=not storage,
        )
        if storage:
            record.bytes_non_expert += int(sum(int(b) for b in loaded))
        plan.groups_on = list(old)
        self.executor.build_groups(
            old + plan.new_labels, epoch=plan.epoch, timeout=self.config.rpc_timeout
        )

    def _up_transfer(self, plan: Plan, record: records.ResizeRecord) -> None:
        members = self.executor.ranks + plan.new_labels
        if self.config.weight_source == "peer":
            received = self._rpc(
                "transfer_non_expert",
                plan.epoch,
                ranks=members,
                background=True,
                src_ranks=list(range(plan.from_size)),
                dst_ranks=list(range(plan.from_size, plan.to_size)),
            )
            record.bytes_non_expert += int(sum(int(b) for b in received))
        old = self.serving.placement
        plan.target = self._target_for(plan)
        self._stage_experts(
            plan,
            epoch=plan.epoch,
            members=members,
            old=old,
            old_num_ranks=plan.from_size,
            target=plan.target,
            new_num_ranks=plan.to_size,
            record=record,
        )

    def _switch(
        self,
        plan: Plan,
        members: list[int],
        *,
        before: Callable[[], None] | None = None,
    ) -> None:
        """At one step boundary: graph over `members` under the new epoch and placement."""
        assert plan.target is not None
        target = plan.target

        def switch() -> None:
            if before is not None:
                before()
            self.executor.switch(members, epoch=plan.epoch, placement=target)
            plan.switched = True
            self.serving.placement = target
            self.serving.num_ranks = plan.to_size
            self.serving.epoch = plan.epoch
            self.engine.set_active_ranks(range(plan.to_size))

        self.executor.prepare_switch()  # outside the pause
        self._at_boundary(switch)
        plan.staged_on = []

    def _target_for(self, plan: Plan) -> policy.Placement:
        """The placement for the new size that keeps experts where they are when it can."""
        return moves_mod.rebalance_for_resize(
            self.load.total(),
            self.serving.placement,
            old_num_ranks=plan.from_size,
            new_num_ranks=plan.to_size,
            num_physical=self.num_physical_for(plan.to_size),
        )

    def _up_switch(self, plan: Plan, record: records.ResizeRecord) -> None:
        self._switch(plan, self.executor.ranks + plan.new_labels)

    def _up_reshuffle(self, plan: Plan, record: records.ResizeRecord) -> None:
        self._rebalance(record=record, force=False)
        record.balancedness_after = self.balancedness()

    # -- scale down ----------------------------------------------------------------------
    def _down_reshuffle(self, plan: Plan, record: records.ResizeRecord) -> None:
        members = self.executor.ranks
        plan.departing = members[plan.to_size :]
        survivors = members[: plan.to_size]
        old = self.serving.placement
        plan.target = self._target_for(plan)
        self._stage_experts(
            plan,
            epoch=self.serving.epoch,
            members=members,
            old=old,
            old_num_ranks=plan.from_size,
            target=plan.target,
            new_num_ranks=plan.to_size,
            record=record,
        )
        plan.groups_on = list(survivors)
        self.executor.build_groups(survivors, epoch=plan.epoch, timeout=self.config.rpc_timeout)

    def _down_migrate(self, plan: Plan, record: records.ResizeRecord) -> None:
        plan.migrated = True
        moved = self.engine.migrate_from(plan.departing).result(
            timeout=self.config.boundary_timeout
        )
        record.sequences_migrated += len(moved)
        log.info(
            "resize %s: migrated %d sequences off ranks %s",
            record.resize_id,
            len(moved),
            plan.departing,
        )

    def _down_switch(self, plan: Plan, record: records.ResizeRecord) -> None:
        def migrate_late() -> None:
            # Sequences still on departing ranks (none after Migrating, unless one arrived
            # between the two boundaries) move now, in the same pause.
            late = self.engine.migrate_from(plan.departing).result()
            record.sequences_migrated += len(late)

        self._switch(plan, self.executor.ranks[: plan.to_size], before=migrate_late)

    def _down_release(self, plan: Plan, record: records.ResizeRecord) -> None:
        record.freed = self.executor.remove_ranks(plan.departing)
        record.balancedness_after = self.balancedness()

    # -- dynamic EPLB --------------------------------------------------------------------
    def _on_step(self, outputs: list[step_mod.StepOutput]) -> None:
        """Engine-thread callback: count load; every step_interval steps, rebalance."""
        self.load.observe(outputs)
        if not self.config.eplb_enabled or self.load.steps == 0:
            return
        if self.load.steps % self.config.eplb_step_interval != 0:
            return
        if self._eplb_thread is not None and self._eplb_thread.is_alive():
            return
        self._eplb_thread = threading.Thread(
            target=self._rebalance_in_background, name="eplb-rebalance", daemon=True
        )
        self._eplb_thread.start()

    def _rebalance_in_background(self) -> None:
        if not self.mechanics.acquire(blocking=False):
            return  # a resize is running; it rebalances itself
        try:
            self._rebalance(record=None, force=False)
        except Exception:  # noqa: BLE001 - a failed rebalance keeps the old placement
            log.exception("dynamic EPLB rebalance failed; keeping the current placement")
            try:
                self._rpc("discard_staged", ranks=self.executor.ranks)
            except Exception:  # noqa: BLE001
                log.exception("discarding staged experts after a failed rebalance failed")
        finally:
            self.mechanics.release()

    def rebalance_now(self) -> dict[str, Any]:
        """Rebalance at once (admin/test use); returns the figures of the attempt."""
        with self.mechanics:
            return self._rebalance(record=None, force=True)

    def _rebalance(self, *, record: records.ResizeRecord | None, force: bool) -> dict[str, Any]:
        """Recompute the placement for the serving size; stage and swap it when it helps."""
        load = self.load.total()
        n = self.serving.num_ranks
        old = self.serving.placement
        before = policy.balancedness(load, old, n)
        target = moves_mod.rebalance_for_resize(
            load,
            old,
            old_num_ranks=n,
            new_num_ranks=n,
            num_physical=old.num_physical,
            tolerance=0.0 if force else self.config.eplb_min_gain,
        )
        after = policy.balancedness(load, target, n)
        result: dict[str, Any] = {"before": before, "after": after, "applied": False}
        if not force and after - before < self.config.eplb_min_gain:
            self.last_rebalance = result
            return result
        moves = moves_mod.plan_moves(old, target, old_num_ranks=n, new_num_ranks=n)
        if not moves and target.equals(old):
            self.last_rebalance = result
            return result
        started = time.monotonic()
        stage_id = self.serving.take_stage()
        nbytes = self._stage_rpc(
            self.serving.epoch,
            moves,
            target,
            members=self.executor.ranks,
            new_num_ranks=n,
            stage_id=stage_id,
        )
        outputs = self.engine.add_step_control({CONTROL_EXPERT_EPOCH: stage_id}).result(
            timeout=self.config.boundary_timeout
        )
        errors = [o.error for o in outputs if o.error]
        if errors:
            raise RuntimeError(f"committing expert stage {stage_id} failed: {errors}")
        self.serving.placement = target
        self.rebalances += 1
        result.update(
            applied=True,
            moves=len(moves),
            bytes=nbytes,
            seconds=time.monotonic() - started,
            at=time.time(),
        )
        self.last_rebalance = result
        if record is not None:
            record.bytes_expert += nbytes
            record.expert_moves += len(moves)
        log.info(
            "EPLB: balancedness %.3f -> %.3f, %d expert moves (%d B) in %.2fs",
            before,
            after,
            len(moves),
            nbytes,
            result["seconds"],
        )
        return result
