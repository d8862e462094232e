"""The mechanics of a resize on a real engine and executor (`ResizeOps`): its begin, its
stages, its end and its rollback.

The stages themselves are in `grow` (`Grow`, scale up N→M: Standby, Transferring, Switching,
Reshuffling; warm spares skip Standby) and `shrink` (`Shrink`, scale down M→N: Reshuffling,
Migrating, Switching, Releasing); both run over the one `resize.ResizeContext` this object
holds (the state, the boundary calls with deadlines, expert staging, the switch), and a
resize's `resize.Plan`. `run_stage` picks the stage's method.

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

import logging
from collections.abc import Sequence
from typing import Any

from moe_runtime.elastic import grow, rebalance, records, resize, shrink, stages

log = logging.getLogger(__name__)


class EngineResizeOps:
    """`ResizeOps` over an `Engine` and an `Executor` (see the module docstring): a resize
    context (`ctx`) and the grow and shrink stages over it."""

    def __init__(self, ctx: resize.ResizeContext) -> None:
        self.ctx = ctx
        self.grow = grow.Grow(ctx)
        self.shrink = shrink.Shrink(ctx)

    # -- ResizeOps -----------------------------------------------------------------------
    def current_size(self) -> int:
        ctx = self.ctx
        return ctx.executor.num_ranks

    def stages_for(self, from_size: int, to_size: int) -> tuple[stages.Stage, ...]:
        """The stages of this resize: a grow that warm spares cover has no Standby."""
        ctx = self.ctx
        if ctx.spares is not None and ctx.spares.covers(to_size - from_size):
            return stages.SCALE_UP_WARM
        return stages.stages_for(from_size, to_size)

    def begin(self, record: records.ResizeRecord) -> resize.Plan:
        ctx = self.ctx
        if not ctx.mechanics.acquire(timeout=ctx.config.boundary_timeout):
            raise TimeoutError("an expert rebalance did not finish in time")
        try:
            record.balancedness_before = ctx.balancedness()
            claim = None
            if ctx.spares is not None and record.to_size > record.from_size:
                claim = ctx.spares.claim(record.to_size - record.from_size)
        except Exception:
            ctx.mechanics.release()
            raise
        plan = resize.Plan(
            from_size=record.from_size,
            to_size=record.to_size,
            epoch=ctx.serving.take_epoch() if claim is None or claim.epoch is None else claim.epoch,
            old_epoch=ctx.serving.epoch,
            old_placement=ctx.serving.placement,
            old_ranks=ctx.executor.ranks,
            generation=ctx.serving.generation,
        )
        if claim is not None:
            plan.new_labels = list(claim.labels)
            plan.from_spares = list(claim.labels)
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
        ctx = self.ctx
        try:
            if isinstance(plan, resize.Plan) and plan.switched and not plan.confirmed:
                self._confirm(plan)
        finally:
            ctx.mechanics.release()

    def run_stage(self, stage: stages.Stage, plan: Any, record: records.ResizeRecord) -> None:
        ctx = self.ctx
        assert isinstance(plan, resize.Plan)
        if plan.generation != ctx.serving.generation:
            raise RuntimeError("a rank was lost and the runtime recovered meanwhile")
        up = plan.to_size > plan.from_size
        handlers = {
            (True, stages.Stage.STANDBY): self.grow.standby,
            (True, stages.Stage.TRANSFERRING): self.grow.transfer,
            (True, stages.Stage.SWITCHING): self.grow.switch,
            (True, stages.Stage.RESHUFFLING): self.grow.reshuffle,
            (False, stages.Stage.RESHUFFLING): self.shrink.reshuffle,
            (False, stages.Stage.MIGRATING): self.shrink.migrate,
            (False, stages.Stage.SWITCHING): self.shrink.switch,
            (False, stages.Stage.RELEASING): self.shrink.release,
        }
        handler = handlers.get((up, stage))
        if handler is None:
            raise ValueError(f"no {stage.value} stage in a resize {plan.from_size}->{plan.to_size}")
        if plan.switched and not plan.confirmed:
            self._confirm(plan)  # the stage after Switching: the new size is the good one now
        handler(plan, record)

    def rollback(self, plan: Any, record: records.ResizeRecord, failed: stages.Stage) -> str:
        ctx = self.ctx
        if not isinstance(plan, resize.Plan):
            return self._where()
        problems: list[str] = []
        stale = plan.generation != ctx.serving.generation
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
                    ctx.executor, ctx.executor.ranks, timeout=ctx.config.rpc_timeout
                )
            return self._where(problems)
        live = set(ctx.executor.ranks) | set(ctx.executor.pending_ranks)
        if plan.staged_on:
            rebalance.discard_everywhere(
                ctx.executor,
                [r for r in plan.staged_on if r in live],
                timeout=ctx.config.rpc_timeout,
            )
        old = [r for r in plan.groups_on if r in set(ctx.executor.ranks)]
        if old and not stale:
            try:
                ctx.rpc("drop_epoch", plan.epoch, ranks=old, background=True)
            except Exception as exc:  # noqa: BLE001 - go on releasing the rest
                problems.append(f"drop_epoch: {exc}")
        new = [r for r in plan.new_labels if r in set(ctx.executor.pending_ranks)]
        spared = [r for r in new if r in plan.from_spares]
        if spared and ctx.spares is not None and not stale:
            ctx.spares.give_back(spared)  # still loaded and warm; the pool rebuilds its groups
            new = [r for r in new if r not in spared]
        if new:
            problems += self._release(new, record)
        if plan.migrated and not stale:
            try:
                ranks = ctx.executor.ranks
                slots = ctx.serving.placement.slot_counts(len(ranks))
                ctx.at_boundary(lambda: ctx.engine.set_active_ranks(ranks, slots=slots))
            except Exception as exc:  # noqa: BLE001
                problems.append(f"set_active_ranks: {exc}")
        where = self._where(problems)
        return where + (
            "; a rank was lost during the resize and the runtime recovered" if stale else ""
        )

    def _where(self, problems: Sequence[str] = ()) -> str:
        ctx = self.ctx
        where = f"serving at data parallel size {ctx.executor.num_ranks}"
        return where + (f" (cleanup problems: {'; '.join(problems)})" if problems else "")

    def _release(self, labels: list[int], record: records.ResizeRecord) -> list[str]:
        ctx = self.ctx
        pending = [r for r in labels if r in ctx.executor.pending_ranks]
        if not pending:
            return []
        try:
            record.freed = ctx.executor.remove_ranks(pending)
        except Exception as exc:  # noqa: BLE001 - reported in the record's message
            return [f"remove_ranks: {exc}"]
        return []

    def _switch_back(self, plan: resize.Plan) -> None:
        """At a boundary: the old ranks, epoch and placement serve again (module docstring)."""
        ctx = self.ctx
        old = list(range(len(plan.old_ranks)))

        def back() -> None:
            ctx.executor.switch(
                old,
                epoch=plan.old_epoch,
                placement=plan.old_placement,
                timeout=ctx.config.switch_timeout,
            )
            ctx.serving.serve(plan.old_placement, len(old))
            ctx.serving.epoch = plan.old_epoch
            # Sequences on the new ranks re-run on the old; the KV budget follows their slots.
            ctx.engine.set_active_ranks(old, slots=plan.old_placement.slot_counts(len(old)))
            plan.switched = False

        ctx.at_boundary(back)
        log.warning("switched back to data parallel size %d (epoch %d)", len(old), plan.old_epoch)
        ctx.rpc("drop_epoch", plan.epoch, ranks=old, background=True)
        ctx.rpc("retire_previous", ranks=old, background=True)  # the undone state

    def _confirm(self, plan: resize.Plan) -> None:
        """The switch stands: workers forget their previous state and the old groups."""
        ctx = self.ctx
        ctx.rpc("retire_previous", ranks=ctx.executor.ranks, background=True)
        plan.confirmed = True
