"""Pre-staging on warm spares: the experts a grow would give them, fetched ahead of it.

For every k in 1..K (K ready spares, within the size limit) the target placement of a grow by
k is computed as the grow itself computes it (`resize.ResizeContext.target_for`: the
rebalance-for-resize policy over the current load and live placement). Spare j (in group
order) is rank n + j of every grow by k > j, so it wants the union of its slots' experts over
those k. `Prestager.step` fetches what the spares lack from the active ranks in batches of
`BATCH` experts (`Executor.prestage_experts`, over the standby transfer group of all K spares:
shared memory on one node), under the resize lock so that it never overlaps a resize or a
rebalance; a grow that begins meanwhile waits for at most one batch.

A grow by k that ready spares cover then takes the pre-staged target for k when it was
computed from today's live placement and still `fits` today's load (its balancedness within
2 x `eplb_min_gain` of a fresh target's: Reshuffling then has little to improve), else a fresh
target; either way only what the spares still lack moves (usually nothing). The plan is
computed again when the live placement changes (a resize, an EPLB commit, a recovery) or, checked
every `CHECK_SECONDS`, when a target no longer fits the load; each spare keeps the experts the
new plan still wants and drops the rest (memory).

Memory: a spare holds the experts of its slots for every grow size it may serve, which is at
most the expert share of rank n of a grow by 1 plus that of the larger grows (for synthetic
`small` 2 -> 4 with 2 spares, ~0.5-0.7 GB per spare).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base as executor_base
from moe_runtime.executor import weight_moves

log = logging.getLogger(__name__)

#: Experts fetched per pass (one pass holds the resize lock; ~50 MB of `small` per 8).
BATCH = 24
#: Seconds between two checks that the pre-staged targets still fit the load.
CHECK_SECONDS = 10.0

Key = tuple[int, int]


def wanted_keys(
    targets: Mapping[int, policy.Placement], *, num_active: int, num_layers: int
) -> dict[int, set[Key]]:
    """{spare index j: the (layer, logical) keys rank num_active + j holds in the target of
    any grow by k > j}; targets: k -> placement over num_active + k ranks. Pure."""
    out: dict[int, set[Key]] = {}
    for k, target in sorted(targets.items()):
        for j in range(k):
            keys = out.setdefault(j, set())
            for layer in range(num_layers):
                for logical in target.experts_on_rank(layer, num_active + j, num_active + k):
                    keys.add((layer, logical))
    return out


def fetch_moves(
    missing: Mapping[int, Sequence[Key]],
    live: policy.Placement,
    *,
    num_active: int,
    limit: int,
) -> list[moves_mod.ExpertMove]:
    """Up to `limit` moves that bring the spares (index j is transfer-group rank
    num_active + j) the keys they miss, each from an active rank that holds it under `live`,
    spread over the holders (the least used first). dst_slot is unused (-1). Pure."""
    holders: dict[Key, list[int]] = {}
    for rank in range(num_active):
        for layer in range(live.num_layers):
            for logical in live.experts_on_rank(layer, rank, num_active):
                holders.setdefault((layer, logical), []).append(rank)
    sent = [0] * num_active
    moves: list[moves_mod.ExpertMove] = []
    queues = {j: sorted(keys) for j, keys in sorted(missing.items())}
    while len(moves) < limit and any(queues.values()):
        for j, queue in queues.items():  # the spares in turn: each gets some in every batch
            if not queue or len(moves) >= limit:
                continue
            layer, logical = queue.pop(0)
            src = min(holders[(layer, logical)], key=lambda r: (sent[r], r))
            sent[src] += 1
            moves.append(
                moves_mod.ExpertMove(
                    layer=layer,
                    logical=logical,
                    src_rank=src,
                    dst_rank=num_active + j,
                    dst_slot=-1,
                )
            )
    return moves


@dataclasses.dataclass
class Plan:
    """What the spares should hold for the active ranks and live placement of then."""

    active: tuple[int, ...]
    live: policy.Placement
    spares: tuple[int, ...]  # labels, in group order
    targets: dict[int, policy.Placement]
    wanted: dict[int, set[Key]]  # spare label -> keys
    have: dict[int, set[Key]]  # spare label -> keys it holds (asked at planning, then kept)

    def missing(self, label: int) -> set[Key]:
        return self.wanted.get(label, set()) - self.have.get(label, set())

    def complete(self) -> bool:
        return not any(self.missing(label) for label in self.spares)


class Prestager:
    """The pre-staging half of `spares.SparePool` (see the module docstring).

    target_for(from_size, to_size): the placement a grow would take (None: no pre-staging);
    fits(target, from_size, to_size): a pre-staged target is still good for today's load;
    max_size(): the largest size allowed now.
    """

    def __init__(
        self,
        *,
        executor: executor_base.Executor,
        num_layers: int,
        timeout: float,
        target_for: Callable[[int, int], policy.Placement] | None = None,
        fits: Callable[[policy.Placement, int, int], bool] | None = None,
        max_size: Callable[[], int] | None = None,
    ) -> None:
        self.fits = fits
        self._checked = 0.0
        self.executor = executor
        self.num_layers = num_layers
        self.timeout = timeout
        self.target_for = target_for
        self.max_size = max_size
        self.plan: Plan | None = None

    def current(self, active: Sequence[int], live: policy.Placement) -> Plan | None:
        plan = self.plan
        if plan is None or plan.active != tuple(active) or not plan.live.equals(live):
            return None
        return plan

    def step(
        self,
        *,
        active: Sequence[int],
        live: policy.Placement,
        spares: Sequence[int],
        epoch: int,
    ) -> bool:
        """One pass: plan if needed, then fetch one batch over epoch's transfer group (active
        ranks then `spares`, the standby epoch of all of them). True when work was done."""
        if self.target_for is None:
            return False
        plan = self.current(active, live)
        if plan is None or plan.spares != tuple(spares) or not self._still_fits(plan):
            plan = self._replan(active, live, spares)
            return True
        missing = {j: sorted(plan.missing(label)) for j, label in enumerate(plan.spares)}
        moves = fetch_moves(missing, live, num_active=len(active), limit=BATCH)
        if not moves:
            return False
        started = time.monotonic()
        members = list(active) + list(spares)
        self.executor.weights.prestage_experts(
            weight_moves.Prestaging(epoch=epoch, moves=moves, members=members),
            timeout=self.timeout,
        )
        for move in moves:
            plan.have.setdefault(members[move.dst_rank], set()).add((move.layer, move.logical))
        if plan.complete():
            log.info("warm spares: experts of every grow by 1..%d pre-staged", len(plan.targets))
        else:
            log.debug("pre-staged %d experts in %.2fs", len(moves), time.monotonic() - started)
        return True

    def _still_fits(self, plan: Plan) -> bool:
        """False when (checked at most every CHECK_SECONDS) a target no longer fits the load."""
        now = time.monotonic()
        if self.fits is None or now - self._checked < CHECK_SECONDS:
            return True
        self._checked = now
        n = len(plan.active)
        return all(self.fits(target, n, n + k) for k, target in plan.targets.items())

    def _replan(self, active: Sequence[int], live: policy.Placement, spares: Sequence[int]) -> Plan:
        assert self.target_for is not None
        n = len(active)
        top = len(spares) if self.max_size is None else min(len(spares), self.max_size() - n)
        targets = {k: self.target_for(n, n + k) for k in range(1, top + 1)}
        by_index = wanted_keys(targets, num_active=n, num_layers=self.num_layers)
        wanted = {label: by_index.get(j, set()) for j, label in enumerate(spares)}
        kept = self.executor.collective_rpc(
            "drop_prestaged",
            ranks=list(spares),
            timeout=self.timeout,
            background=True,
            per_rank={label: {"keep": sorted(wanted[label])} for label in spares},
        )
        held = self.executor.collective_rpc(
            "prestaged_keys", ranks=list(spares), timeout=self.timeout, background=True
        )
        have = {
            label: {(int(a), int(b)) for a, b in keys}
            for label, keys in zip(spares, held, strict=True)
        }
        self.plan = Plan(
            active=tuple(active),
            live=live,
            spares=tuple(spares),
            targets=targets,
            wanted=wanted,
            have=have,
        )
        log.info(
            "warm spares: pre-staging grows by 1..%d on ranks %s (%s experts wanted, %s held)",
            top,
            list(spares),
            [len(wanted[s]) for s in spares],
            list(kept),
        )
        return self.plan

    def take(
        self, labels: Sequence[int], *, active: Sequence[int], live: policy.Placement
    ) -> tuple[policy.Placement | None, dict[int, set[Key]]]:
        """For a grow on the spares `labels` (their group order; k = len(labels)) from
        `active` under `live`: the pre-staged target for k (None when there is none or it no
        longer fits the load) and what each of them holds. The plan is forgotten (the spares
        leave the pool)."""
        plan, self.plan = self.current(active, live), None
        k = len(labels)
        if plan is None or tuple(labels) != plan.spares[:k]:
            return None, {}
        target = plan.targets.get(k)
        n = len(plan.active)
        if target is not None and self.fits is not None and not self.fits(target, n, n + k):
            log.info("warm spares: the pre-staged target of a grow by %d no longer fits", k)
            target = None
        return target, {label: set(plan.have.get(label, set())) for label in labels}

    def forget(self) -> None:
        self.plan = None
