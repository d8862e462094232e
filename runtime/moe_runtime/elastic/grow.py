"""The scale-up stages of a resize N→M (`GrowStages`, inherited by `ops.EngineResizeOps`).

Ranks keep their labels; the new ones are N..M-1.
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
  experts where they are held: live, retained, pre-staged) and the experts every rank lacks
  are staged beside the live ones.
- Switching: at one step boundary, the step graph is torn down, every rank activates the new
  epoch (staged experts become live), the graph is compiled over M ranks and the engine starts
  giving sequences to the new ranks. Requests that arrive meanwhile wait in the queue.
- Reshuffling: EPLB recomputes the placement from the recent load and moves experts in the
  background; the new map is swapped in at a step boundary (`StepInput.control`).
"""

from __future__ import annotations

import logging

from moe_runtime.elastic import rebalance, records, resize_base

log = logging.getLogger(__name__)


class GrowStages(resize_base.ResizeBase):
    """Standby, Transferring, Switching and Reshuffling of a grow (see the module docstring)."""

    def _up_standby(self, plan: resize_base.Plan, record: records.ResizeRecord) -> None:
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

    def _up_transfer(self, plan: resize_base.Plan, record: records.ResizeRecord) -> None:
        if not plan.new_labels:
            # Planned on warm spares that were gone by the time it began: Standby's work here.
            log.warning("resize %s: no warm spare left; starting ranks", record.resize_id)
            self._up_standby(plan, record)
        members = self.executor.ranks + plan.new_labels
        if self.config.weight_source == "peer" and plan.fresh:
            record.bytes_non_expert += self.executor.weights.transfer_non_expert(
                plan.epoch,
                members=members,
                src_ranks=list(range(plan.from_size)),
                dst_ranks=[members.index(r) for r in plan.fresh],
                timeout=self.config.rpc_timeout,
            )
        old = self.serving.placement
        retained = self._retained_keys(self.executor.ranks)
        if plan.prestaged_target is not None:
            plan.target = plan.prestaged_target
        else:
            # Experts stay where they are held: live or retained on the serving ranks, or
            # pre-staged on warm spares whose pre-staged target no longer fits.
            held = {**retained, **plan.prestaged}
            plan.target = self.target_for(
                plan.from_size, plan.to_size, held=rebalance.by_index(members, held)
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
            retained=retained,
        )

    def _up_switch(self, plan: resize_base.Plan, record: records.ResizeRecord) -> None:
        record.warm_spares = len(plan.from_pool)
        self._switch(plan, self.executor.ranks + plan.new_labels, record)

    def _up_reshuffle(self, plan: resize_base.Plan, record: records.ResizeRecord) -> None:
        self.rebalancer.rebalance(record=record, force=False)
        record.balancedness_after = self.balancedness()
