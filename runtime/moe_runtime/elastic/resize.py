"""What every resize stage works with: the `Plan` of one resize and the `ResizeContext`
every stage runs over (`grow.Grow`, `shrink.Shrink` and `ops.EngineResizeOps` hold the same
one: the state is passed in, never inherited).

- `Plan`: one resize in progress, what `EngineResizeOps.rollback` must undo;
- `ResizeContext`: the serving process's pieces a resize changes (engine, executor, the
  serving state, the live config, EPLB, the warm spares, the rank pool), the figures (`num_physical_for`,
  `balancedness`), the placement a resize aims at (`target_for`, and `fits` for a target
  made earlier), and the calls the stages are made of: `rpc` (a bounded `collective_rpc`),
  `at_boundary` (a bounded boundary call), `stage_experts` (stage a target, leaving out what
  warm spares hold pre-staged and what ranks retain) and `switch` (the step path over new
  members at one step boundary).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from moe_runtime.elastic import rank_pool as rank_pool_mod
from moe_runtime.elastic import rebalance, records
from moe_runtime.elastic import serving as serving_mod
from moe_runtime.elastic import spares as spares_mod
from moe_runtime.engine import core as engine_core
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base as executor_base
from moe_runtime.executor import weight_moves
from moe_runtime.model import config as config_mod

Key = rebalance.Key


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
    #: started by this resize or taken from the rank pool (they need the non-expert weights).
    from_spares: list[int] = dataclasses.field(default_factory=list)
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


class ResizeContext:
    """The state every resize stage works on, and the primitives they share (see the module
    docstring). `config` is replaced live (`settings.LiveSettings`); `spares` and `rank_pool`
    are set once they exist (`service.ElasticService.attach`)."""

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
        rank_pool: rank_pool_mod.RankPool | None = None,
    ) -> None:
        self.engine = engine
        self.executor = executor
        self.model_config = model_config
        self.serving = serving
        self.config = config
        self.rebalancer = rebalancer
        self.spares = spares
        self.rank_pool = rank_pool
        #: The expert load window (EPLB's) and the lock that keeps resizes and rebalances apart.
        self.load: serving_mod.LoadTracker = rebalancer.load
        self.mechanics: threading.Lock = rebalancer.mechanics

    # -- figures -------------------------------------------------------------------------
    def num_physical_for(self, size: int) -> int:
        return self.config.num_physical_for(self.model_config.num_experts, size)

    def balancedness(self) -> float:
        """Of the serving placement over every device that holds experts (DP x T in the mesh
        expert layout, `ElasticConfig.slot_multiple`)."""
        placement, n = self.serving.layout()
        return policy.balancedness(self.load.total(), placement, n * self.config.slot_multiple)

    # -- placements ----------------------------------------------------------------------
    def target_for(
        self, from_size: int, to_size: int, *, held: Mapping[int, set[Key]] | None = None
    ) -> policy.Placement:
        """The placement for `to_size` ranks from the live one over `from_size` (the current
        load) that keeps experts where they are when it can (also the spares' pre-staging):
        where they live, or where `held` says a rank holds them beside its live slots (new rank
        index -> keys it retains or has pre-staged), at up to `eplb_min_gain` of balancedness
        (`moves.rebalance_for_resize`'s tolerance: the gain a periodic rebalance would not
        move experts for). In the mesh expert layout the load is balanced over every device
        (`rebalance.periodic_target`: DP x T packs; `held` counted on each rank's leader)."""
        units = self.config.slot_multiple
        return moves_mod.rebalance_for_resize(
            self.load.total(),
            self.serving.placement,
            old_num_ranks=from_size * units,
            new_num_ranks=to_size * units,
            num_physical=self.num_physical_for(to_size),
            tolerance=self.config.eplb_min_gain,
            held=None if held is None else {i * units: keys for i, keys in held.items()},
        )

    def fits(self, target: policy.Placement, from_size: int, to_size: int) -> bool:
        """A target made earlier (the spares' pre-staging) is as good for today's load as a
        fresh one, within twice `eplb_min_gain` of balancedness (Reshuffling improves it after;
        a tighter bound re-fetched half the spares' experts every few seconds under a load
        that drifts, since balanced packing is chaotic)."""
        fresh = self.target_for(from_size, to_size)
        units = self.config.slot_multiple
        return rebalance.fits(
            self.load.total(), target, fresh, to_size * units, min_gain=self.config.eplb_min_gain
        )

    # -- the calls stages are made of -----------------------------------------------------
    def rpc(
        self,
        method: str,
        *args: Any,
        ranks: Sequence[int],
        background: bool = False,
        per_rank: dict[int, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """`collective_rpc` on `ranks`, within `rpc_timeout`."""
        return self.executor.collective_rpc(
            method,
            *args,
            ranks=list(ranks),
            timeout=self.config.rpc_timeout,
            background=background,
            per_rank=per_rank,
            **kwargs,
        )

    def at_boundary(self, fn: Callable[[], Any]) -> Any:
        """`fn` at the next step boundary, within `boundary_timeout` (see
        `Engine.run_at_boundary`)."""
        return self.engine.run_at_boundary(fn, timeout=self.config.boundary_timeout)

    def stage_experts(
        self,
        plan: Plan,
        record: records.ResizeRecord,
        *,
        epoch: int,
        members: Sequence[int],
        retained: Mapping[int, set[Key]] | None = None,
    ) -> None:
        """Stage `plan.target` (over `plan.to_size` ranks, from the live placement over
        `plan.from_size`) on the members of epoch's transfer group (member i = rank i); a move
        to a member that holds its expert already beside its live slots is left out: a warm
        spare's pre-staged experts (`plan.prestaged`), a serving rank's retained ones
        (`retained`, asked from the serving members when not given)."""
        assert plan.target is not None
        old, target = self.serving.placement, plan.target
        old_num_ranks, new_num_ranks = plan.from_size, plan.to_size
        planned = moves_mod.plan_moves(
            old, target, old_num_ranks=old_num_ranks, new_num_ranks=new_num_ranks
        )
        if retained is None:
            retained = self.retained_keys({members[m.dst_rank] for m in planned})
        moves, prestaged, kept = rebalance.outstanding(planned, members, plan.prestaged, retained)
        record.experts_prestaged += prestaged
        record.experts_retained += kept
        record.expert_moves += len(moves)
        record.expert_moves_lower_bound += moves_mod.lower_bound_moves(
            old, target, old_num_ranks=old_num_ranks, new_num_ranks=new_num_ranks
        )
        plan.staged_on = list(members)
        staging = weight_moves.Staging(
            epoch=epoch, moves=moves, target=target, members=members, new_num_ranks=new_num_ranks
        )
        record.bytes_expert += rebalance.stage_experts(
            self.executor, staging, timeout=self.config.rpc_timeout
        )

    def retained_keys(self, labels: Iterable[int]) -> dict[int, set[Key]]:
        """label -> the keys it retains, for the serving ranks among `labels`."""
        return rebalance.retained_keys(self.executor, labels, timeout=self.config.rpc_timeout)

    def switch(
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
            plan.from_spares = [members.index(r) for r in plan.from_spares if r in members]
            self.serving.left[plan.from_size] = self.serving.placement
            self.serving.serve(target, plan.to_size)
            self.serving.epoch = plan.epoch
            # The KV budget of each rank follows the expert slots it holds from now on.
            self.engine.set_active_ranks(
                range(plan.to_size), slots=target.slot_counts(plan.to_size)
            )

        self.executor.prepare_switch()  # outside the pause
        self.at_boundary(switch)
        plan.staged_on = []
