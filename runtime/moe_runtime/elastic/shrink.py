"""The scale-down stages of a resize M→N (`Shrink`, over the resize's `resize.ResizeContext`).

The highest ranks leave.
- Reshuffling: the placement for the N survivors is staged on them (experts on departing
  ranks are copied to survivors first; the live placement keeps serving); the survivors build
  the next epoch's groups in the background. A survivor copies nothing it retains
  (`retention`); shrinking back to a size it served at, it may take that size's placement
  again (`Shrink._target`), whose experts the survivors retain.
- Migrating: departing ranks take no new sequence; the sequences on them get up to the
  record's `drain_timeout_s` to finish there (`drain_timeout` of the request, else
  `--drain-timeout`), then the rest move to survivors at a step boundary and are re-prefilled
  there with prompt + tokens generated so far (none is aborted). Without a drain (0, the
  default) they move inside the switch's pause instead: the survivors re-prefill them at the
  new size, and the switch waits for no re-prefill step of the old size.
- Switching: at one boundary the graph is rebuilt over the N survivors under the new epoch.
- Releasing: the departing workers stop; the record names their pods (`freed`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from moe_runtime.elastic import rebalance, records, resize
from moe_runtime.eplb import policy

log = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.01


@dataclasses.dataclass(frozen=True)
class Shrink:
    """Reshuffling, Migrating, Switching and Releasing of a shrink (see the module docstring),
    each a method of (plan, record) over `ctx`."""

    ctx: resize.ResizeContext

    def reshuffle(self, plan: resize.Plan, record: records.ResizeRecord) -> None:
        """The survivors' placement staged on them, and their next epoch's groups built."""
        ctx = self.ctx
        members = ctx.executor.ranks
        plan.departing = members[plan.to_size :]
        survivors = members[: plan.to_size]
        retained = ctx.retained_keys(survivors)
        plan.target = self._target(plan, members, retained)
        ctx.stage_experts(plan, record, epoch=ctx.serving.epoch, members=members, retained=retained)
        plan.groups_on = list(survivors)
        ctx.executor.build_groups(survivors, epoch=plan.epoch, timeout=ctx.config.rpc_timeout)

    def _target(
        self,
        plan: resize.Plan,
        members: list[int],
        retained: dict[int, set[resize.Key]],
    ) -> policy.Placement:
        """A fresh target for the survivors (it keeps experts on the survivors that hold them,
        live or retained, where balance allows), or the placement this size served with when
        a resize left it (`Serving.left`; a shrink back after a grow) when that still fits the
        load and needs fewer moves (as many: the better balanced one): the survivors retain
        its experts, so usually none."""
        ctx = self.ctx
        fresh = ctx.target_for(
            plan.from_size,
            plan.to_size,
            held=rebalance.by_index(members[: plan.to_size], retained),
        )
        earlier = ctx.serving.left.get(plan.to_size)
        if earlier is None or earlier.num_physical != fresh.num_physical:
            return fresh
        if not ctx.fits(earlier, plan.from_size, plan.to_size):
            log.info("shrink to %d: the placement it served with no longer fits", plan.to_size)
            return fresh

        def needed(target: policy.Placement) -> int:
            return len(
                rebalance.moves_needed(
                    ctx.serving.placement,
                    target,
                    old_num_ranks=plan.from_size,
                    new_num_ranks=plan.to_size,
                    members=members,
                    retained=retained,
                )
            )

        before, now = needed(earlier), needed(fresh)
        log.info(
            "shrink to %d: the placement it served with needs %d moves, a fresh one %d",
            plan.to_size,
            before,
            now,
        )
        if before != now:
            return earlier if before < now else fresh
        # As many moves (often none: the fresh target keeps what the survivors retain too):
        # the better balanced one (over every device holding experts: `ElasticConfig.slot_multiple`).
        load, devices = ctx.load.total(), plan.to_size * ctx.config.slot_multiple
        earlier_balance = policy.balancedness(load, earlier, devices)
        return earlier if earlier_balance >= policy.balancedness(load, fresh, devices) else fresh

    def migrate(self, plan: resize.Plan, record: records.ResizeRecord) -> None:
        """Departing ranks take no new sequence; theirs drain, then move to survivors."""
        ctx = self.ctx
        plan.migrated = True  # from here on, rollback clears the draining marks
        if record.drain_timeout_s <= 0:
            # No drain: the sequences move inside the switch's pause (`switch`), so the
            # survivors re-prefill them in their first step at the new size, and the switch
            # does not wait for a re-prefill step of the old one.
            return
        there = set(ctx.at_boundary(lambda: ctx.engine.drain(plan.departing).result()))
        self._wait_drained(plan, record.drain_timeout_s)
        moved = ctx.at_boundary(lambda: ctx.engine.migrate_from(plan.departing).result())
        record.sequences_migrated += len(moved)
        record.sequences_drained += len(there - set(moved))
        log.info(
            "resize %s: migrated %d sequences off ranks %s",
            record.resize_id,
            len(moved),
            plan.departing,
        )

    def _wait_drained(self, plan: resize.Plan, timeout: float) -> None:
        """Until no sequence runs on the departing ranks, or `timeout` s (the engine steps)."""
        ctx = self.ctx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if plan.generation != ctx.serving.generation:
                raise RuntimeError("a rank was lost and the runtime recovered meanwhile")
            per_rank = ctx.engine.stats().seqs_per_rank
            if not any(per_rank.get(r, 0) for r in plan.departing):
                return
            time.sleep(DRAIN_POLL_SECONDS)

    def switch(self, plan: resize.Plan, record: records.ResizeRecord) -> None:
        """At one step boundary: the survivors step under the new epoch and placement; what
        still runs on departing ranks moves in the same pause."""
        ctx = self.ctx

        def migrate_late() -> None:
            # Sequences still on departing ranks move now, in the same pause: all of them
            # without a drain, else any that arrived between the two boundaries.
            late = ctx.engine.migrate_from(plan.departing).result()
            record.sequences_migrated += len(late)
            if late:
                log.info(
                    "resize %s: migrated %d sequences off ranks %s in the switch",
                    record.resize_id,
                    len(late),
                    plan.departing,
                )

        ctx.switch(plan, ctx.executor.ranks[: plan.to_size], record, before=migrate_late)

    def release(self, plan: resize.Plan, record: records.ResizeRecord) -> None:
        """The departing workers stop; the record names their pods."""
        ctx = self.ctx
        record.freed = ctx.executor.remove_ranks(plan.departing)
        record.balancedness_after = ctx.balancedness()
