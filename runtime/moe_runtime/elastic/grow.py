"""The scale-up stages of a resize N→M (`Grow`, over the resize's `resize.ResizeContext`).

Ranks keep their labels; the new ones are N..M-1.
- With warm spare ranks covering M-N (`spares.SparePool.claim`): no Standby. The spares hold
  the non-expert weights and a standby epoch's groups over the N ranks and them exist: the
  resize is Transferring (experts only) + Switching (+ Reshuffling). When the spares hold the
  experts of this grow pre-staged (`prestage`), its target is the pre-staged one and only what
  they still lack moves (`record.experts_prestaged` counts the moves they made unneeded).
- Standby: take the warm spares there are (`SparePool.take`), then the rank pool's started,
  weightless processes (`rank_pool.RankPool.take`), start the other rank workers; load the
  ones that hold no weights with placeholders (or the model source's non-expert weights with
  `weight_source="storage"`) while the step and transfer groups of a new epoch over all M
  ranks are built in the background (the old group keeps serving).
- Transferring: non-expert weights go from old ranks to new ones over the new transfer group
  (peer to peer); the placement for M ranks is computed (`rebalance_for_resize`, which keeps
  experts where they are held: live, retained, pre-staged) and the experts every rank lacks
  are staged beside the live ones.
- Switching: at one step boundary, the step graph is torn down, every rank activates the new
  epoch (staged experts become live), the graph is compiled over M ranks and the engine starts
  giving sequences to the new ranks. Requests that arrive meanwhile wait in the queue.
- Reshuffling: EPLB recomputes the placement from the recent load and moves experts in the
  background; the new map is swapped in at a step boundary (`StepInput.control`).
"""

from __future__ import annotations

import dataclasses
import logging

from moe_runtime.elastic import rebalance, records, resize
from moe_runtime.executor import weight_moves

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Grow:
    """Standby, Transferring, Switching and Reshuffling of a grow (see the module docstring),
    each a method of (plan, record) over `ctx`."""

    ctx: resize.ResizeContext

    def standby(self, plan: resize.Plan, record: records.ResizeRecord) -> None:
        """Start the new ranks (warm spares first), load them, and build the new epoch's
        groups over all the ranks while the old group serves."""
        ctx = self.ctx
        if plan.warm:
            return  # the warm spares' standby groups exist already
        old = ctx.executor.ranks
        count = plan.to_size - plan.from_size
        plan.from_spares = ctx.spares.take(count) if ctx.spares is not None else []
        plan.new_labels = list(plan.from_spares)
        if plan.from_spares:
            ctx.executor.promote(plan.from_spares)
            log.info("resize %s: warm spares %s join", record.resize_id, plan.from_spares)
        short = count - len(plan.new_labels)
        pooled = ctx.rank_pool.take(short) if ctx.rank_pool is not None else []
        if pooled:
            log.info(
                "resize %s: pooled rank processes %s join (%d to start)",
                record.resize_id,
                pooled,
                short - len(pooled),
            )
        plan.fresh = pooled
        if len(pooled) < short:
            plan.fresh += ctx.executor.add_ranks(
                short - len(pooled), timeout=ctx.config.rpc_timeout
            )
        plan.new_labels += plan.fresh
        storage = ctx.config.weight_source == "storage"
        loading = None
        if plan.fresh:
            # The new ranks load (their default lane) while every rank joins the new epoch's
            # groups (the control lane; a join needs no weights): the two overlap.
            first = len(old) + len(plan.from_spares)
            loading = ctx.executor.collective_rpc_async(
                "load_weights",
                ranks=plan.fresh,
                background=False,
                timeout=ctx.config.rpc_timeout,
                per_rank={r: {"rank": first + i} for i, r in enumerate(plan.fresh)},
                source=ctx.config.source,
                num_ranks=plan.to_size,
                placement=None,
                placeholder=not storage,
            )
        plan.groups_on = list(old)
        try:
            ctx.executor.build_groups(
                old + plan.new_labels, epoch=plan.epoch, timeout=ctx.config.rpc_timeout
            )
        finally:
            # Always waited for: a rollback releases these ranks only once their load ended.
            loaded = loading.result() if loading is not None else []
        if storage:
            record.bytes_non_expert += int(sum(int(b) for b in loaded))

    def transfer(self, plan: resize.Plan, record: records.ResizeRecord) -> None:
        """Non-expert weights to the new ranks, and the target placement's experts staged
        beside the live ones."""
        ctx = self.ctx
        if not plan.new_labels:
            # Planned on warm spares that were gone by the time it began: Standby's work here.
            log.warning("resize %s: no warm spare left; starting ranks", record.resize_id)
            self.standby(plan, record)
        members = ctx.executor.ranks + plan.new_labels
        if ctx.config.weight_source == "peer" and plan.fresh:
            transfer = weight_moves.NonExpertTransfer(
                epoch=plan.epoch,
                members=members,
                src_ranks=list(range(plan.from_size)),
                dst_ranks=[members.index(r) for r in plan.fresh],
            )
            record.bytes_non_expert += ctx.executor.weights.transfer_non_expert(
                transfer, timeout=ctx.config.rpc_timeout
            )
        retained = ctx.retained_keys(ctx.executor.ranks)
        if plan.prestaged_target is not None:
            plan.target = plan.prestaged_target
        else:
            # Experts stay where they are held: live or retained on the serving ranks, or
            # pre-staged on warm spares whose pre-staged target no longer fits.
            held = {**retained, **plan.prestaged}
            plan.target = ctx.target_for(
                plan.from_size, plan.to_size, held=rebalance.by_index(members, held)
            )
        ctx.stage_experts(plan, record, epoch=plan.epoch, members=members, retained=retained)

    def switch(self, plan: resize.Plan, record: records.ResizeRecord) -> None:
        """At one step boundary: the new epoch and placement, and every rank steps."""
        ctx = self.ctx
        record.warm_spares = len(plan.from_spares)
        ctx.switch(plan, ctx.executor.ranks + plan.new_labels, record)

    def reshuffle(self, plan: resize.Plan, record: records.ResizeRecord) -> None:
        """Confirmed: EPLB balances the new size from the recent load."""
        ctx = self.ctx
        ctx.rebalancer.rebalance(record=record, force=False)
        record.balancedness_after = ctx.balancedness()
