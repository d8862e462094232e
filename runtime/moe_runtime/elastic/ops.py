"""The mechanics of each resize stage on a real engine and executor (`ResizeOps`).

Scale up N→M (ranks keep their labels; the new ones are N..M-1):
- With warm spare ranks covering M-N (`spares.SparePool.claim`): no Standby. The spares hold
  the non-expert weights and a standby epoch's groups over the N ranks and them exist: the
  resize is Transferring (experts only) + Switching (+ Reshuffling). When the spares hold the
  experts of this grow pre-staged (`prestage`), its target is the pre-staged one and only what
  they still lack moves (`record.experts_prestaged` counts the moves they made unneeded).
- Standby: take the warm spares there are (`SparePool.take`), start the other rank workers with
  placeholder weights (or the model source's non-expert weights with
  `weight_source="storage"`); build the step and transfer groups of a new epoch over all M
  ranks in the background while the old group keeps serving.
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
- Migrating: departing ranks take no new sequence; the sequences on them get up to the
  record's `drain_timeout_s` to finish there (`drain_timeout` of the request, else
  `--drain-timeout`), then the rest move to survivors at a step boundary and are re-prefilled
  there with prompt + tokens generated so far (none is aborted).
- Switching: at one boundary the graph is rebuilt over the N survivors under the new epoch.
- Releasing: the departing workers stop; the record names their pods (`freed`).

Failures (`rollback`, every path ends serving): before the switch, what the stages allocated is
released (standby ranks, groups, staged experts) and the old size never stopped serving. A
failed switch goes back to the old step path inside `Executor.switch`. A failure after a
completed switch but before it is confirmed (the Switching stage itself, e.g. an injected
failure) switches back to the old ranks, epoch and placement at a boundary: workers kept their
previous state for that (`RankWorker.revert`). The stage after Switching first confirms the
switch (`retire_previous`); a failure from then on leaves the new size serving, which is then
the last good size. Boundary calls have deadlines and are cancelled when they pass them, so
nothing queued by a failed resize runs after its rollback. A recovery that runs during a resize
(`Serving.generation` changed) wins: the rollback only releases what the resize allocated.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from moe_runtime.elastic import rebalance, records, stages
from moe_runtime.elastic import serving as serving_mod
from moe_runtime.elastic import spares as spares_mod
from moe_runtime.engine import core as engine_core
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base as executor_base
from moe_runtime.model import config as config_mod

log = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.01


@dataclasses.dataclass
class Plan:
    """One resize in progress (what `rollback` must undo).

    old_*: what served when it began (the switch-back target); generation: the serving
    generation then (a recovery since makes the plan stale); confirmed: the switch was
    confirmed (workers retired their previous state) and cannot be undone any more.
    """

    from_size: int
    to_size: int
    epoch: int
    old_epoch: int
    old_placement: policy.Placement
    old_ranks: list[int]
    generation: int
    new_labels: list[int] = dataclasses.field(default_factory=list)
    #: new_labels that came from the warm spares (given back on rollback), and the ones
    #: started by this resize (they need the non-expert weights).
    from_pool: list[int] = dataclasses.field(default_factory=list)
    fresh: list[int] = dataclasses.field(default_factory=list)
    #: Warm spares covered the grow: their standby epoch is `epoch`, no Standby stage.
    warm: bool = False
    #: The spares' pre-staged target for this grow and the keys each of them holds.
    prestaged_target: policy.Placement | None = None
    prestaged: dict[int, set[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    departing: list[int] = dataclasses.field(default_factory=list)
    target: policy.Placement | None = None
    staged_on: list[int] = dataclasses.field(default_factory=list)
    groups_on: list[int] = dataclasses.field(default_factory=list)
    switched: bool = False
    confirmed: bool = False
    migrated: bool = False


class EngineResizeOps:
    """`ResizeOps` over an `Engine` and an `Executor` (see the module docstring)."""

    def __init__(
        self,
        *,
        engine: engine_core.Engine,
        executor: executor_base.Executor,
        model_config: config_mod.ModelConfig,
        serving: serving_mod.Serving,
        config: serving_mod.ElasticConfig,
        rebalancer: rebalance.Rebalancer,
        spares: spares_mod.SparePool | None = None,
    ) -> None:
        self.spares = spares
        self.engine = engine
        self.executor = executor
        self.model_config = model_config
        self.serving = serving
        self.config = config
        self.rebalancer = rebalancer
        self.load = rebalancer.load
        self.mechanics = rebalancer.mechanics

    # -- figures -------------------------------------------------------------------------
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

    def stages_for(self, from_size: int, to_size: int) -> tuple[stages.Stage, ...]:
        """The stages of this resize: a grow that warm spares cover has no Standby."""
        if self.spares is not None and self.spares.covers(to_size - from_size):
            return stages.SCALE_UP_WARM
        return stages.stages_for(from_size, to_size)

    def begin(self, record: records.ResizeRecord) -> Plan:
        if not self.mechanics.acquire(timeout=self.config.boundary_timeout):
            raise TimeoutError("an expert rebalance did not finish in time")
        try:
            record.balancedness_before = self.balancedness()
            claim = None
            if self.spares is not None and record.to_size > record.from_size:
                claim = self.spares.claim(record.to_size - record.from_size)
        except Exception:
            self.mechanics.release()
            raise
        plan = Plan(
            from_size=record.from_size,
            to_size=record.to_size,
            epoch=self.serving.take_epoch()
            if claim is None or claim.epoch is None
            else claim.epoch,
            old_epoch=self.serving.epoch,
            old_placement=self.serving.placement,
            old_ranks=self.executor.ranks,
            generation=self.serving.generation,
        )
        if claim is not None:
            plan.new_labels = list(claim.labels)
            plan.from_pool = list(claim.labels)
            plan.warm = True
            plan.groups_on = list(plan.old_ranks)
            plan.prestaged_target, plan.prestaged = claim.target, claim.prestaged
            log.info(
                "resize %s: warm spares %s, standby epoch %d",
                record.resize_id,
                claim.labels,
                plan.epoch,
            )
        return plan

    def end(self, plan: Any) -> None:
        """The resize is over (completed or rolled back): let dynamic EPLB run again."""
        try:
            if isinstance(plan, Plan) and plan.switched and not plan.confirmed:
                self._confirm(plan)
        finally:
            self.mechanics.release()

    def run_stage(self, stage: stages.Stage, plan: Any, record: records.ResizeRecord) -> None:
        assert isinstance(plan, Plan)
        if plan.generation != self.serving.generation:
            raise RuntimeError("a rank was lost and the runtime recovered meanwhile")
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
        if plan.switched and not plan.confirmed:
            self._confirm(plan)  # the stage after Switching: the new size is the good one now
        handler(plan, record)

    def rollback(self, plan: Any, record: records.ResizeRecord, failed: stages.Stage) -> str:
        if not isinstance(plan, Plan):
            return self._where()
        problems: list[str] = []
        stale = plan.generation != self.serving.generation
        if plan.switched and not plan.confirmed and not stale:
            try:
                self._switch_back(plan)
            except Exception as exc:  # noqa: BLE001 - reported; the rest is still released
                log.exception("resize %s: switching back failed", record.resize_id)
                problems.append(f"switch back: {exc}")
        if plan.switched and not stale:
            if plan.confirmed and plan.departing:
                problems += self._release(plan.departing, record)
            if plan.staged_on:
                rebalance.discard_everywhere(
                    self.executor, self.executor.ranks, timeout=self.config.rpc_timeout
                )
            return self._where(problems)
        live = set(self.executor.ranks) | set(self.executor.pending_ranks)
        if plan.staged_on:
            rebalance.discard_everywhere(
                self.executor,
                [r for r in plan.staged_on if r in live],
                timeout=self.config.rpc_timeout,
            )
        old = [r for r in plan.groups_on if r in set(self.executor.ranks)]
        if old and not stale:
            try:
                self._rpc("drop_epoch", plan.epoch, ranks=old, background=True)
            except Exception as exc:  # noqa: BLE001 - go on releasing the rest
                problems.append(f"drop_epoch: {exc}")
        new = [r for r in plan.new_labels if r in set(self.executor.pending_ranks)]
        spared = [r for r in new if r in plan.from_pool]
        if spared and self.spares is not None and not stale:
            self.spares.give_back(spared)  # still loaded and warm; the pool rebuilds its groups
            new = [r for r in new if r not in spared]
        if new:
            problems += self._release(new, record)
        if plan.migrated and not stale:
            try:
                self._at_boundary(lambda: self.engine.set_active_ranks(self.executor.ranks))
            except Exception as exc:  # noqa: BLE001
                problems.append(f"set_active_ranks: {exc}")
        where = self._where(problems)
        return where + (
            "; a rank was lost during the resize and the runtime recovered" if stale else ""
        )

    def _where(self, problems: Sequence[str] = ()) -> str:
        where = f"serving at data parallel size {self.executor.num_ranks}"
        return where + (f" (cleanup problems: {'; '.join(problems)})" if problems else "")

    def _release(self, labels: list[int], record: records.ResizeRecord) -> list[str]:
        pending = [r for r in labels if r in self.executor.pending_ranks]
        if not pending:
            return []
        try:
            record.freed = self.executor.remove_ranks(pending)
        except Exception as exc:  # noqa: BLE001 - reported in the record's message
            return [f"remove_ranks: {exc}"]
        return []

    def _switch_back(self, plan: Plan) -> None:
        """At a boundary: the old ranks, epoch and placement serve again (module docstring)."""
        old = list(range(len(plan.old_ranks)))

        def back() -> None:
            self.executor.switch(
                old,
                epoch=plan.old_epoch,
                placement=plan.old_placement,
                timeout=self.config.switch_timeout,
            )
            self.serving.placement = plan.old_placement
            self.serving.num_ranks = len(old)
            self.serving.epoch = plan.old_epoch
            self.engine.set_active_ranks(old)  # sequences on the new ranks re-run on the old
            plan.switched = False

        self._at_boundary(back)
        log.warning("switched back to data parallel size %d (epoch %d)", len(old), plan.old_epoch)
        self._rpc("drop_epoch", plan.epoch, ranks=old, background=True)
        self._rpc("retire_previous", ranks=old, background=True)  # the undone state

    def _confirm(self, plan: Plan) -> None:
        """The switch stands: workers forget their previous state and the old groups."""
        self._rpc("retire_previous", ranks=self.executor.ranks, background=True)
        plan.confirmed = True

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

    def _at_boundary(self, fn: Callable[[], Any]) -> Any:
        return self.engine.run_at_boundary(fn, timeout=self.config.boundary_timeout)

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
    ) -> None:
        """Stage `target` on the members of epoch's transfer group (member i = rank i); a move
        to a member that holds its expert pre-staged (`plan.prestaged`) is left out."""
        planned = moves_mod.plan_moves(
            old, target, old_num_ranks=old_num_ranks, new_num_ranks=new_num_ranks
        )
        moves = [
            m
            for m in planned
            if (m.layer, m.logical) not in plan.prestaged.get(members[m.dst_rank], ())
        ]
        record.experts_prestaged += len(planned) - len(moves)
        record.expert_moves += len(moves)
        record.expert_moves_lower_bound += moves_mod.lower_bound_moves(
            old, target, old_num_ranks=old_num_ranks, new_num_ranks=new_num_ranks
        )
        plan.staged_on = list(members)
        record.bytes_expert += rebalance.stage_experts(
            self.executor,
            epoch=epoch,
            moves=moves,
            target=target,
            members=members,
            new_num_ranks=new_num_ranks,
            staging_id=None,
            timeout=self.config.rpc_timeout,
        )

    # -- scale up ------------------------------------------------------------------------
    def _up_standby(self, plan: Plan, record: records.ResizeRecord) -> None:
        if plan.warm:
            return  # the warm spares' standby groups exist already
        old = self.executor.ranks
        count = plan.to_size - plan.from_size
        plan.from_pool = self.spares.take(count) if self.spares is not None else []
        plan.new_labels = list(plan.from_pool)
        if plan.from_pool:
            log.info("resize %s: warm spares %s join", record.resize_id, plan.from_pool)
        if len(plan.new_labels) < count:
            plan.fresh = self.executor.add_ranks(
                count - len(plan.new_labels), timeout=self.config.rpc_timeout
            )
            plan.new_labels += plan.fresh
        storage = self.config.weight_source == "storage"
        if plan.fresh:
            first = len(old) + len(plan.from_pool)
            loaded = self._rpc(
                "load_weights",
                ranks=plan.fresh,
                per_rank={r: {"rank": first + i} for i, r in enumerate(plan.fresh)},
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
        if not plan.new_labels:
            # Planned on warm spares that were gone by the time it began: Standby's work here.
            log.warning("resize %s: no warm spare left; starting ranks", record.resize_id)
            self._up_standby(plan, record)
        members = self.executor.ranks + plan.new_labels
        if self.config.weight_source == "peer" and plan.fresh:
            record.bytes_non_expert += self.executor.transfer_non_expert(
                plan.epoch,
                members=members,
                src_ranks=list(range(plan.from_size)),
                dst_ranks=[members.index(r) for r in plan.fresh],
                timeout=self.config.rpc_timeout,
            )
        old = self.serving.placement
        plan.target = (
            plan.prestaged_target
            if plan.prestaged_target is not None
            else self.target_for(plan.from_size, plan.to_size)
        )
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
        record: records.ResizeRecord,
        *,
        before: Callable[[], None] | None = None,
    ) -> None:
        """At one step boundary: graph over `members` under the new epoch and placement."""
        assert plan.target is not None
        target = plan.target

        def switch() -> None:
            started = time.monotonic()
            try:
                step_boundary()
            finally:
                record.switch_pause_s = time.monotonic() - started

        def step_boundary() -> None:
            if before is not None:
                before()
            self.executor.switch(
                members, epoch=plan.epoch, placement=target, timeout=self.config.switch_timeout
            )
            plan.switched = True
            # members[i] is rank i now: the new ranks are from_size.. (they keep those labels
            # if the switch is undone, as ranks left out of a switch above its size do).
            plan.new_labels = list(range(plan.from_size, len(members)))
            plan.from_pool = [members.index(r) for r in plan.from_pool if r in members]
            self.serving.placement = target
            self.serving.num_ranks = plan.to_size
            self.serving.epoch = plan.epoch
            self.engine.set_active_ranks(range(plan.to_size))

        self.executor.prepare_switch()  # outside the pause
        self._at_boundary(switch)
        plan.staged_on = []

    def target_for(self, from_size: int, to_size: int) -> policy.Placement:
        """The placement for `to_size` ranks from the live one over `from_size` (the current
        load) that keeps experts where they are when it can (also the spares' pre-staging)."""
        return moves_mod.rebalance_for_resize(
            self.load.total(),
            self.serving.placement,
            old_num_ranks=from_size,
            new_num_ranks=to_size,
            num_physical=self.num_physical_for(to_size),
        )

    def fits(self, target: policy.Placement, from_size: int, to_size: int) -> bool:
        """A target made earlier (the spares' pre-staging) is as good for today's load as a
        fresh one, within twice `eplb_min_gain` of balancedness (Reshuffling improves it after;
        a tighter bound re-fetched half the spares' experts every few seconds under a load
        that drifts, since balanced packing is chaotic)."""
        load = self.load.total()
        fresh = self.target_for(from_size, to_size)
        gain = policy.balancedness(load, fresh, to_size) - policy.balancedness(
            load, target, to_size
        )
        return gain < 2 * self.config.eplb_min_gain

    def _up_switch(self, plan: Plan, record: records.ResizeRecord) -> None:
        record.warm_spares = len(plan.from_pool)
        self._switch(plan, self.executor.ranks + plan.new_labels, record)

    def _up_reshuffle(self, plan: Plan, record: records.ResizeRecord) -> None:
        self.rebalancer.rebalance(record=record, force=False)
        record.balancedness_after = self.balancedness()

    # -- scale down ----------------------------------------------------------------------
    def _down_reshuffle(self, plan: Plan, record: records.ResizeRecord) -> None:
        members = self.executor.ranks
        plan.departing = members[plan.to_size :]
        survivors = members[: plan.to_size]
        old = self.serving.placement
        plan.target = self.target_for(plan.from_size, plan.to_size)
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
        plan.migrated = True  # from here on, rollback clears the draining marks
        there: set[str] = set()
        if record.drain_timeout_s > 0:
            there = set(self._at_boundary(lambda: self.engine.drain(plan.departing).result()))
            self._wait_drained(plan, record.drain_timeout_s)
        moved = self._at_boundary(lambda: self.engine.migrate_from(plan.departing).result())
        record.sequences_migrated += len(moved)
        record.sequences_drained += len(there - set(moved))
        log.info(
            "resize %s: migrated %d sequences off ranks %s",
            record.resize_id,
            len(moved),
            plan.departing,
        )

    def _wait_drained(self, plan: Plan, timeout: float) -> None:
        """Until no sequence runs on the departing ranks, or `timeout` s (the engine steps)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if plan.generation != self.serving.generation:
                raise RuntimeError("a rank was lost and the runtime recovered meanwhile")
            per_rank = self.engine.stats().seqs_per_rank
            if not any(per_rank.get(r, 0) for r in plan.departing):
                return
            time.sleep(DRAIN_POLL_SECONDS)

    def _down_switch(self, plan: Plan, record: records.ResizeRecord) -> None:
        def migrate_late() -> None:
            # Sequences still on departing ranks (none after Migrating, unless one arrived
            # between the two boundaries) move now, in the same pause.
            late = self.engine.migrate_from(plan.departing).result()
            record.sequences_migrated += len(late)

        self._switch(plan, self.executor.ranks[: plan.to_size], record, before=migrate_late)

    def _down_release(self, plan: Plan, record: records.ResizeRecord) -> None:
        record.freed = self.executor.remove_ranks(plan.departing)
        record.balancedness_after = self.balancedness()
