"""Dynamic EPLB while serving, and the expert staging that resizes and recoveries share
(`stage_experts`; `outstanding`: the moves left once ranks' retained and pre-staged experts
are counted, `retained_keys`).

A rebalance is prepare-then-commit, all or nothing across ranks:

1. prepare: every rank stages its slots of the new placement in the background
   (`stage_experts`; a failure on any rank discards the staged sets everywhere);
2. commit: one step carries `StepInput.control["expert_epoch"] = staging id`; in that step
   every rank votes (a min all-reduce over the step group) and commits only if every rank
   could (`moe_runtime.rank.slots`), so ranks never dispatch tokens with two placements;
3. confirm: every rank said it committed (`StepOutput.committed`): the previous slots are
   retired. Otherwise, at the next step boundary, ranks that committed `revert` and every rank
   discards what it staged: the old placement serves everywhere.

If a recovery runs meanwhile (`Serving.generation` changed), the recovery has already put the
survivors back on one placement; the rebalance then changes nothing and reports it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from moe_runtime import step as step_mod
from moe_runtime.elastic import records
from moe_runtime.elastic import serving as serving_mod
from moe_runtime.engine import core as engine_core
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base as executor_base
from moe_runtime.executor import weight_moves

log = logging.getLogger(__name__)


Key = tuple[int, int]


class CommitRefused(RuntimeError):
    """An EPLB commit that some rank could not make: no rank changed its placement."""


def outstanding(
    planned: Sequence[moves_mod.ExpertMove],
    members: Sequence[int],
    prestaged: Mapping[int, set[Key]],
    retained: Mapping[int, set[Key]],
) -> tuple[list[moves_mod.ExpertMove], int, int]:
    """The moves of `planned` still needed when each member (label; member i = rank i of the
    moves) already holds the keys it has `prestaged` or `retained`; also how many each of those
    made unneeded. Pure."""
    moves: list[moves_mod.ExpertMove] = []
    by_prestage = by_retention = 0
    for m in planned:
        key, dst = (m.layer, m.logical), members[m.dst_rank]
        if key in prestaged.get(dst, ()):
            by_prestage += 1
        elif key in retained.get(dst, ()):
            by_retention += 1
        else:
            moves.append(m)
    return moves, by_prestage, by_retention


def fits(
    load: Any,
    target: policy.Placement,
    fresh: policy.Placement,
    num_ranks: int,
    *,
    min_gain: float,
) -> bool:
    """A placement made earlier (`target`: the spares' pre-staged one, or the one a size
    served with before) is as good for `load` as a `fresh` one: within twice `min_gain` of
    its balancedness."""
    gain = policy.balancedness(load, fresh, num_ranks) - policy.balancedness(
        load, target, num_ranks
    )
    return gain < 2 * min_gain


def moves_needed(
    current: policy.Placement,
    target: policy.Placement,
    *,
    old_num_ranks: int,
    new_num_ranks: int,
    members: Sequence[int],
    retained: Mapping[int, set[Key]],
    senders: Sequence[int] | None = None,
) -> list[moves_mod.ExpertMove]:
    """The moves from `current` to `target` that still need doing once the members' (labels;
    member i = rank i of the moves) `retained` experts are counted. Pure."""
    planned = moves_mod.plan_moves(
        current,
        target,
        old_num_ranks=old_num_ranks,
        new_num_ranks=new_num_ranks,
        senders=senders,
    )
    return outstanding(planned, members, {}, retained)[0]


def by_index(labels: Sequence[int], keys: Mapping[int, set[Key]]) -> dict[int, set[Key]]:
    """{i: keys[labels[i]]} for the labels that have keys: what a placement's rank i (member
    labels[i]) holds beside its live slots, as ``moves.rebalance_for_resize`` takes it. Pure."""
    return {i: keys[label] for i, label in enumerate(labels) if keys.get(label)}


def periodic_target(
    load: torch.Tensor,
    old: policy.Placement,
    num_ranks: int,
    *,
    units: int = 1,
    tolerance: float,
    held: Mapping[int, set[Key]] | None = None,
) -> tuple[policy.Placement, float, float]:
    """A periodic rebalance's target over `num_ranks` DP ranks, (target, balancedness before,
    after). `units`: the devices a DP rank's slots split over (T in the mesh expert layout):
    the load is balanced over every device, DP x T packs of slots, so each TP rank's part of
    its rank's slots carries an even share (a placement balanced by DP rank alone may put a
    rank's hot experts all in one part); the result is still a placement of `num_ranks` DP
    ranks (each one's slots are its devices' packs, in order). `held`: by DP rank index,
    counted on its first device (the leader's: what a planner knows). Pure."""
    n = num_ranks * units
    held_by = {i * units: keys for i, keys in (held or {}).items()}
    target = moves_mod.rebalance_for_resize(
        load,
        old,
        old_num_ranks=n,
        new_num_ranks=n,
        num_physical=old.num_physical,
        tolerance=tolerance,
        held=held_by,
    )
    return target, policy.balancedness(load, old, n), policy.balancedness(load, target, n)


def retained_keys(
    executor: executor_base.Executor,
    labels: Iterable[int],
    *,
    timeout: float,
    background: bool = True,
) -> dict[int, set[Key]]:
    """label -> the (layer, logical) keys it retains (`moe_runtime.rank.retention`), for the
    serving ranks among `labels` (a rank started by a resize retains nothing)."""
    ranks = sorted(set(labels) & set(executor.ranks))
    if not ranks:
        return {}
    answers = executor.collective_rpc(
        "retained_keys", ranks=ranks, timeout=timeout, background=background
    )
    return {
        label: {(int(a), int(b)) for a, b in keys}
        for label, keys in zip(ranks, answers, strict=True)
    }


def stage_experts(
    executor: executor_base.Executor,
    staging: weight_moves.Staging,
    *,
    timeout: float,
    background: bool = True,
) -> int:
    """Every member stages its slots of the target (`weight_moves.Staging`); returns the bytes
    received. On failure every member's staged set is discarded before the error is raised."""
    try:
        return executor.weights.stage_experts(staging, timeout=timeout, background=background)
    except Exception:
        discard_everywhere(executor, staging.members, timeout=timeout)
        raise


def discard_everywhere(
    executor: executor_base.Executor, members: Sequence[int], *, timeout: float
) -> None:
    """Every live member forgets its staged set (best effort: a dead one has nothing to keep)."""
    live = set(executor.rank_infos()) - set(executor.lost_ranks())
    targets = [r for r in members if r in live]
    try:
        executor.collective_rpc("discard_staged", ranks=targets, timeout=timeout, background=True)
    except Exception:  # noqa: BLE001 - staged sets are only memory; the next staging replaces them
        log.exception("discarding staged experts on ranks %s failed", targets)


class Rebalancer:
    """Dynamic EPLB for the serving size (see the module docstring).

    mechanics: the lock that keeps resizes and rebalances apart (a resize runs its own
    rebalance in Reshuffling while it holds it).
    """

    def __init__(
        self,
        *,
        engine: engine_core.Engine,
        executor: executor_base.Executor,
        serving: serving_mod.Serving,
        load: serving_mod.LoadTracker,
        config: serving_mod.ElasticConfig,
        mechanics: threading.Lock,
    ) -> None:
        self.engine = engine
        self.executor = executor
        self.serving = serving
        self.load = load
        self.config = config
        self.mechanics = mechanics
        self.rebalances = 0
        self.last_rebalance: dict[str, Any] = {}
        self._thread: threading.Thread | None = None

    def on_step(self, outputs: list[step_mod.StepOutput]) -> None:
        """Engine-thread callback: count load; every step_interval steps, rebalance."""
        self.load.observe(outputs)
        if not self.config.eplb_enabled or self.load.steps == 0:
            return
        if self.load.steps % self.config.eplb_step_interval != 0:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(
            target=self._in_background, name="eplb-rebalance", daemon=True
        )
        self._thread.start()

    def _in_background(self) -> None:
        if not self.mechanics.acquire(blocking=False):
            return  # a resize is running; it rebalances itself
        try:
            self.rebalance(record=None, force=False)
        except Exception:  # noqa: BLE001 - a failed rebalance left the old placement everywhere
            log.exception("dynamic EPLB rebalance failed; the current placement serves")
        finally:
            self.mechanics.release()

    def rebalance_now(self) -> dict[str, Any]:
        """Rebalance at once (admin/test use); returns the figures of the attempt."""
        with self.mechanics:
            return self.rebalance(record=None, force=True)

    def rebalance(self, *, record: records.ResizeRecord | None, force: bool) -> dict[str, Any]:
        """Recompute the placement for the serving size; stage and commit it when it helps.

        The caller holds `mechanics`. Raises (CommitRefused or the failure) with the old
        placement serving on every rank.
        """
        load = self.load.total()
        n = self.serving.num_ranks
        old = self.serving.placement
        generation = self.serving.generation
        members = self.executor.ranks
        held = retained_keys(self.executor, members, timeout=self.config.rpc_timeout)
        target, before, after = periodic_target(
            load,
            old,
            n,
            units=self.config.slot_multiple,
            tolerance=0.0 if force else self.config.eplb_min_gain,
            held=by_index(members, held),
        )
        result: dict[str, Any] = {"before": before, "after": after, "applied": False}
        if not force and after - before < self.config.eplb_min_gain:
            self.last_rebalance = result
            return result
        planned = moves_mod.plan_moves(old, target, old_num_ranks=n, new_num_ranks=n)
        if not planned and target.equals(old):
            self.last_rebalance = result
            return result
        started = time.monotonic()
        staging_id = self.serving.take_stage()
        moves, _, kept = outstanding(planned, members, {}, held)
        staging = weight_moves.Staging(
            epoch=self.serving.epoch,
            moves=moves,
            target=target,
            members=members,
            new_num_ranks=n,
            staging_id=staging_id,
        )
        nbytes = stage_experts(self.executor, staging, timeout=self.config.rpc_timeout)
        self._commit(staging_id, members=members, generation=generation)
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
            record.experts_retained += kept
        log.info(
            "EPLB: balancedness %.3f -> %.3f, %d expert moves (%d B; %d retained) in %.2fs",
            before,
            after,
            len(moves),
            nbytes,
            kept,
            result["seconds"],
        )
        return result

    def _commit(self, staging_id: int, *, members: list[int], generation: int) -> None:
        """Commit `staging_id` on every member in one step, or on none (module docstring)."""
        timeout = self.config.boundary_timeout
        self.serving.committing = staging_id
        try:
            try:
                outputs = self.engine.run_step_control(
                    {step_mod.CONTROL_EXPERT_EPOCH: staging_id}, timeout=timeout
                )
            except Exception as exc:
                self._undo(staging_id, members=members, generation=generation)
                raise RuntimeError(f"the step committing stage {staging_id} failed: {exc}") from exc
            committed = sorted(o.rank for o in outputs if o.committed == staging_id)
            if committed == list(range(len(members))):
                self._retire(members)
                return
            self._undo(staging_id, members=members, generation=generation)
            if committed:
                raise RuntimeError(
                    f"stage {staging_id} committed on ranks {committed} only; reverted there"
                )
            raise CommitRefused(
                f"stage {staging_id} was refused by the vote (a rank could not commit it); "
                "no rank changed its placement"
            )
        finally:
            self.serving.committing = None

    def _undo(self, staging_id: int, *, members: list[int], generation: int) -> None:
        """At a boundary: ranks that committed `staging_id` revert, every rank discards it."""
        timeout = self.config.rpc_timeout

        def undo() -> None:
            if self.serving.generation != generation:
                log.warning("EPLB stage %d: a recovery ran meanwhile and undid it", staging_id)
                return
            live = [r for r in members if r not in self.executor.lost_ranks()]
            reverted = self.executor.collective_rpc(
                "revert", staging_id, ranks=live, timeout=timeout
            )
            log.warning("EPLB stage %d undone: reverted %s", staging_id, reverted)
            discard_everywhere(self.executor, live, timeout=timeout)

        self.engine.run_at_boundary(undo, timeout=self.config.boundary_timeout)

    def _retire(self, members: list[int]) -> None:
        try:
            self.executor.collective_rpc(
                "retire_previous",
                ranks=members,
                timeout=self.config.rpc_timeout,
                background=True,
            )
        except Exception:  # noqa: BLE001 - only memory is kept longer; the next change retires it
            log.exception("retiring the previous expert slots on ranks %s failed", members)
