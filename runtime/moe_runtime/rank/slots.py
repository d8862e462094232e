"""A rank's expert slots (`ExpertSlots`, a part of `RankWorker`): live, staged and previous slots.

- live: the slots the rank serves with, under `placement` as rank `rank` of `num_ranks`, with
  the step group of `epoch` (the expert-parallel backend);
- staged: slots prepared for another placement (`stage_experts`) while the live ones serve;
- previous: the live state that the last `activate` or EPLB commit replaced, kept (with the
  older epochs' groups) until `retire_previous`, so that `revert` can undo the change;
- pre-staged (`ahead`, `prestaged.Prestaged`): experts a future placement will give this rank,
  fetched ahead of a resize (a warm spare, in the background); `stage_experts` takes them
  from there instead of moving them again; forgotten when the rank is activated;
- retained: experts a confirmed change took off the live slots (`retention.Retained`, bounded
  by the most the rank held at once), kept for a later `stage_experts` (a shrink back after a
  grow moves nothing for them; `retained_keys` tells the planner).

A change of the live slots is all-or-nothing across ranks: `activate` runs on every rank
between two steps and is undone with `revert` where a peer failed; an EPLB commit inside a step
(`StepInput.control["expert_epoch"]`) is voted on first with a min all-reduce over the step
group, so every rank commits or none does (then every rank discards the staged set).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import source as source_mod
from moe_runtime.rank import context as context_mod
from moe_runtime.rank import groups as groups_mod
from moe_runtime.rank import live as live_mod
from moe_runtime.rank import mesh as mesh_mod
from moe_runtime.rank import prestaged as prestaged_mod
from moe_runtime.rank import retention
from moe_runtime.rank import staging as staging_mod

if TYPE_CHECKING:
    from moe_runtime.rank import pipeline_group

log = logging.getLogger(__name__)


class ExpertSlots:
    """The slot state of one rank and its changes (see the module docstring).

    The live state (`placement`, `rank`, `num_ranks`, `experts`, `epoch`, `backend`, `origin`)
    changes only as a whole (`_become`). ctx: the rank's (its loaded model gives the shapes
    and the model source); groups: its groups (moves over the transfer group, the backend over
    the step group).
    """

    def __init__(
        self,
        ctx: context_mod.RankContext,
        *,
        groups: groups_mod.RankGroups,
        stages: pipeline_group.PipelineLeader | None = None,
        parts: mesh_mod.MeshParts | None = None,
    ) -> None:
        self._ctx = ctx
        self._groups = groups
        #: At P > 1 the pipeline stages, which read the experts of their layers ahead of a
        #: placement change this rank stages (`prefetch`) or pre-stages (`prestage`).
        self._stages = stages
        #: In the mesh expert layout (`rank.mesh`) the TP followers, each holding its part of
        #: this DP rank's slots; this rank's own slots are part 0 (`_member`).
        self._parts = parts
        self._lock = threading.RLock()
        self.placement: policy.Placement | None = None
        self.rank: int | None = None
        self.num_ranks: int | None = None
        self.experts: dict[tuple[int, int], experts_mod.ExpertWeights] = {}
        self.epoch: int | None = None
        self.backend: experts_mod.ExpertBackend | None = None
        self.origin: int | None = None
        self.staged: live_mod.Staged | None = None
        self.previous: live_mod.Live | None = None
        #: experts a future placement will give this rank (`prestaged.Prestaged`)
        self.ahead = prestaged_mod.Prestaged(
            ctx,
            groups=groups,
            stages=stages,
            held=lambda keys: self._with_parts(self._held_experts(), keys),
        )
        self.retained = retention.Retained()

    def reset(
        self,
        *,
        placement: policy.Placement | None,
        rank: int,
        num_ranks: int,
        experts: dict[tuple[int, int], experts_mod.ExpertWeights],
        placeholder: bool,
    ) -> None:
        """The slots `load_weights` loaded, as rank `rank` of `num_ranks` under `placement`;
        nothing retained (`placeholder`: the experts are zeros, never to be retained)."""
        with self._lock:
            self.experts, self.placement = experts, placement
            self.rank, self.num_ranks = rank, num_ranks
            self.retained.reset(experts.values() if placeholder else ())

    def _member(self, rank: int | None, num_ranks: int | None) -> tuple[int | None, int | None]:
        """The (rank, ranks) this rank's slots are counted as: its DP rank, or in the mesh
        layout member `rank` x T of DP x T (its part 0)."""
        return (rank, num_ranks) if self._parts is None else self._parts.member(rank, num_ranks)

    def _backend(
        self, epoch: int, placement: policy.Placement, rank: int, num_ranks: int, experts: Any
    ) -> experts_mod.ExpertBackend:
        """The backend over epoch's step group (the mesh group in the mesh layout)."""
        if self._parts is None:
            grp, _ = self._groups.group(epoch, groups_mod.STEP)
            return live_mod.make_backend(grp, placement, rank, num_ranks, experts)
        grp, _ = self._groups.group(epoch, mesh_mod.ROLE)
        me, members = self._member(rank, num_ranks)
        return live_mod.make_backend(grp, placement, me, members, experts)

    def _with_parts(
        self, held: staging_mod.Experts, keys: Sequence[tuple[int, int]]
    ) -> staging_mod.Experts:
        """`held` and those of `keys` it lacks that the mesh layout's followers hold."""
        return held if self._parts is None else self._parts.with_held(held, keys)

    def require_epoch(self) -> int:
        """The active epoch; RuntimeError before the first `activate`."""
        if self.epoch is None:
            raise RuntimeError(f"rank not activated ({self._ctx.where()})")
        return self.epoch

    def forget_previous(self, epoch: int) -> None:
        """The previous state was `epoch`'s, whose groups go: nothing to go back to."""
        with self._lock:
            if self.previous is not None and self.previous.epoch == epoch:
                self.previous = None

    def close(self) -> None:
        """Drop every slot set but the live experts (the rank shuts down)."""
        with self._lock:
            self.backend = None
            self.staged = None
            self.previous = None
            self.retained.reset()

    # -- expert staging ------------------------------------------------------------------
    def stage_experts(
        self,
        epoch: int,
        moves: Sequence[moves_mod.ExpertMove],
        new_placement: policy.Placement,
        *,
        new_rank: int | None,
        new_num_ranks: int,
        stage: int | None = None,
        from_source: bool = False,
        provided: Mapping[tuple[int, int], experts_mod.ExpertWeights] | None = None,
        every_move: Sequence[moves_mod.ExpertMove] | None = None,
    ) -> int:
        """Prepare this rank's slots of `new_placement` in a staging area; returns bytes received.

        from_source: experts that neither this rank holds nor a move brings are read from the
        model source (recovery after a rank died with the only copy); otherwise that is an error.
        provided: experts (layer, logical) -> weights that the executor already brought by
        another path (co-located peers, through shared memory); `moves` then leaves them out,
        `every_move` does not (default: `moves`): at P > 1 the pipeline stages run those of
        their layers (`PipelineLeader.prefetch`).

        new_rank None: this rank leaves (scale-down); it only sends and stages nothing.

        Every member of epoch's transfer group calls it with the same `moves` (a move's
        src_rank / dst_rank are ranks of that group, which are the old and the new ranks since
        survivors keep their rank); moves run peer to peer (`comm.transfer.execute_moves`).
        Slots whose expert this rank already holds are filled locally (shared tensors, no
        copy). The live slots keep serving until the stage is committed: by
        `StepInput.control["expert_epoch"] == stage` (same ranks) or by `activate` (new group).
        stage (the staging id) defaults to epoch.
        """
        _, model = self._ctx.loaded.require(self._ctx.where())
        grp, me = self._groups.group(epoch, groups_mod.TRANSFER)
        new_placement.validate(new_num_ranks)
        started = time.monotonic()
        stages, every = self._stages, moves if every_move is None else every_move
        prefetching = (
            None
            if stages is None
            else stages.prefetch(
                new_placement, rank=new_rank, num_ranks=new_num_ranks, epoch=epoch, moves=every
            )
        )
        parts = self._parts
        if parts is not None:
            mesh_mod.check_slots(new_placement.num_physical, new_num_ranks, parts.size)
        # the leaders move every slot of their DP ranks (in the mesh layout a leader sends
        # from its followers' parts too, and hands them theirs: `mesh.relay`)
        held = self._with_parts(
            self._held_experts(), [(m.layer, m.logical) for m in moves if m.src_rank == me]
        )
        with self._lock:
            prestaged = self.ahead.snapshot()
            retained = dict(self.retained.experts)
        ctx = self._ctx
        stats, received = staging_mod.run_moves(
            grp, moves, held, model, dtype=ctx.dtype, device=ctx.device, where=ctx.where()
        )
        self._ctx.check("stage_experts")
        if new_rank is None:
            if stages is not None:
                stages.finish_prefetch(prefetching)  # they sent their layers' experts
            log.info(
                "sent %d experts for a placement without this rank in %.2fs (%s)",
                stats.sent,
                time.monotonic() - started,
                self._ctx.where(),
            )
            return stats.bytes_received
        src = (
            source_mod.open_source(self._ctx.loaded.source_name)
            if from_source and self._ctx.loaded.source_name is not None
            else None
        )
        part_rank, part_ranks = self._member(new_rank, new_num_ranks)
        assert part_rank is not None and part_ranks is not None
        available = {
            **staging_mod.elsewhere(model, dtype=self._ctx.dtype, device=self._ctx.device),
            **retained,
            **prestaged,
            **held,
            **received,
            **(provided or {}),
        }
        relaying = None
        if parts is not None:  # the followers' parts, and what only they held of part 0
            relaying, available = mesh_mod.relay(
                parts, new_placement, new_rank, new_num_ranks, available
            )
        slots = staging_mod.fill_slots(
            new_placement,
            rank=part_rank,
            num_ranks=part_ranks,
            available=available,
            source=src,
            dtype=self._ctx.dtype,
            device=self._ctx.device,
            where=self._ctx.where(),
        )
        stages_read = 0 if stages is None else stages.finish_prefetch(prefetching)
        if parts is not None:
            stages_read += parts.finish_prefetch(relaying)
        if stages_read:
            log.info("the pipeline stages read %d experts (%s)", stages_read, self._ctx.where())
        staging_id = epoch if stage is None else stage
        with self._lock:
            self.staged = live_mod.Staged(
                stage=staging_id,
                placement=new_placement,
                rank=new_rank,
                num_ranks=new_num_ranks,
                experts=slots,
            )
        log.info(
            "staged %d slots for stage %d (new rank %d/%d): sent %d, received %d experts "
            "(%d B) in %.2fs (%s)",
            len(slots),
            staging_id,
            new_rank,
            new_num_ranks,
            stats.sent,
            stats.received,
            stats.bytes_received,
            time.monotonic() - started,
            self._ctx.where(),
        )
        return stats.bytes_received

    def retained_keys(self) -> list[tuple[int, int]]:
        """The (layer, logical) keys of the retained experts (module docstring)."""
        with self._lock:
            return self.retained.keys()

    def held_experts(self, keys: Sequence[tuple[int, int]]) -> staging_mod.Experts:
        """{(layer, logical): weights} of the live slots for `keys` (what a peer asked for);
        a key this rank does not hold is an error naming it."""
        _, model = self._ctx.loaded.require(self._ctx.where())
        later = staging_mod.later_layers(model)
        if later is not None:
            keys = [k for k in keys if k[0] < later]  # zeros of later stages: not sent
        held = self._with_parts(self._held_experts(), keys)
        missing = [k for k in keys if k not in held]
        if missing:
            raise RuntimeError(
                f"asked for (layer, expert) {missing[:5]} ({len(missing)}) that this rank does "
                f"not hold ({self._ctx.where()})"
            )
        return {k: held[k] for k in keys}

    def _held_experts(self) -> staging_mod.Experts:
        """{(layer, logical): weights} of the live slots."""
        with self._lock:
            placement, rank, num_ranks = self.placement, self.rank, self.num_ranks
            experts = dict(self.experts)
        return staging_mod.held_experts(placement, *self._member(rank, num_ranks), experts)

    def discard_staged(self) -> None:
        """Forget staged experts (a resize or a rebalance that failed)."""
        with self._lock:
            self.staged = None

    # -- the live state: replace, undo, confirm ------------------------------------------
    def _snapshot(self) -> live_mod.Live:
        with self._lock:
            return live_mod.Live(
                placement=self.placement,
                rank=self.rank,
                num_ranks=self.num_ranks,
                experts=self.experts,
                epoch=self.epoch,
                backend=self.backend,
                origin=self.origin,
            )

    def _become(self, live: live_mod.Live, *, previous: live_mod.Live | None) -> None:
        """Make `live` the serving state at once; `previous` is what `revert` goes back to."""
        with self._lock:
            self.placement, self.rank, self.num_ranks = live.placement, live.rank, live.num_ranks
            self.experts, self.epoch, self.backend = live.experts, live.epoch, live.backend
            self.origin = live.origin
            self.previous = previous

    def revert(self, origin: int) -> bool:
        """Go back to the previous live state if the live one came from `origin` (the epoch of
        an `activate`, or the staging id of an EPLB commit); True when it did.

        Called while no step runs (a failed switch, the rollback of a resize or a rebalance).
        The previous state's groups still exist: nothing is destroyed before `retire_previous`.
        """
        with self._lock:
            previous = self.previous
            if previous is None or self.origin != origin:
                return False
        self._become(previous, previous=None)
        log.info("reverted the live state of %d (%s)", origin, self._ctx.where())
        return True

    def retire_previous(self) -> None:
        """The last change is confirmed: forget the previous state (retaining the experts it
        served that the live slots do not) and destroy the groups of epochs older than the
        active one (in the background: nothing waits for their peers to close)."""
        with self._lock:
            previous, self.previous = self.previous, None
            if previous is not None:
                before = staging_mod.held_experts(
                    previous.placement,
                    *self._member(previous.rank, previous.num_ranks),
                    previous.experts,
                )
                count = self.retained.absorb(before, self._held_experts())
                log.debug("retaining %d experts (%s)", count, self._ctx.where())
            active = self.epoch
        self._groups.retire_before(active)  # nothing uses them: closed in the background

    # -- activation ----------------------------------------------------------------------
    def activate(
        self, epoch: int, *, rank: int, num_ranks: int, placement: policy.Placement
    ) -> None:
        """Serve with epoch's step group as `rank` of `num_ranks` under `placement`.

        Called while no step runs. The slots come from the staged set (when it is for this
        placement and rank), else from the previous live state when that was epoch's under
        this placement (switching back), else the live slots must already match `placement`.
        The replaced state is kept for `revert(epoch)` until `retire_previous`.
        """
        self._ctx.check("activate")
        cfg, _ = self._ctx.loaded.require(self._ctx.where())
        grp, group_rank = self._groups.group(epoch, groups_mod.STEP)
        if grp.world_size != num_ranks or group_rank != rank:
            raise ValueError(
                f"activate: epoch {epoch}'s step group has this worker as {group_rank}/"
                f"{grp.world_size}, not {rank}/{num_ranks} ({self._ctx.where()})"
            )
        placement.validate(num_ranks)
        before = self._snapshot()
        with self._lock:
            staged, previous = self.staged, self.previous
        if staged is not None:
            if staged.rank != rank or not staged.placement.equals(placement):
                raise ValueError(
                    f"activate: the staged experts (stage {staged.stage}) are for rank "
                    f"{staged.rank}/{staged.num_ranks} under another placement ({self._ctx.where()})"
                )
            if staged.num_ranks != num_ranks:
                raise ValueError(
                    f"experts of stage {staged.stage} were staged for {staged.num_ranks} ranks, "
                    f"not {num_ranks}"
                )
            experts = staged.experts
        elif (
            previous is not None
            and previous.epoch == epoch
            and previous.serves(placement, rank, num_ranks)
        ):
            experts = previous.experts
        else:
            me, members = self._member(rank, num_ranks)
            assert me is not None and members is not None
            wanted = [
                placement.experts_on_rank(layer, me, members) for layer in range(cfg.num_moe_layers)
            ]
            was, was_of = self._member(before.rank, before.num_ranks)
            current = (
                None
                if before.placement is None or was is None or was_of is None
                else [
                    before.placement.experts_on_rank(layer, was, was_of)
                    for layer in range(cfg.num_moe_layers)
                ]
            )
            if current != wanted:
                raise ValueError(
                    f"activate: this rank's slots do not hold the experts rank {rank}/{num_ranks} "
                    f"needs under the new placement: stage them first ({self._ctx.where()})"
                )
            experts = before.experts
        backend = self._backend(epoch, placement, rank, num_ranks, experts)
        live = live_mod.Live(placement, rank, num_ranks, experts, epoch, backend, origin=epoch)
        with self._lock:
            self.staged = None
            self.ahead.clear()  # what it needed is in its slots now
        self._become(live, previous=before)
        log.info(
            "activated epoch %d with %d slots (%s)", epoch, len(self.experts), self._ctx.where()
        )

    def commit_vote(self, staging_id: int) -> bool:
        """The EPLB commit inside a step, all-or-nothing: every rank prepares the staged set
        (and its backend), votes, and commits only if every rank voted yes; otherwise every
        rank discards it. Returns whether it committed. Every rank must call it in that step.
        """
        epoch = self.require_epoch()
        grp, _ = self._groups.group(epoch, groups_mod.STEP)
        ready: live_mod.Live | None = None
        try:
            self._ctx.check("commit_staged")
            with self._lock:
                staged = self.staged
            if staged is None or staged.stage != staging_id:
                have = None if staged is None else staged.stage
                raise RuntimeError(f"no experts staged for stage {staging_id} (have {have})")
            if staged.num_ranks != self.num_ranks:
                raise RuntimeError(
                    f"experts of stage {staged.stage} were staged for {staged.num_ranks} ranks, "
                    f"not {self.num_ranks}"
                )
            backend = self._backend(
                epoch, staged.placement, staged.rank, staged.num_ranks, staged.experts
            )
            ready = live_mod.Live(
                staged.placement,
                staged.rank,
                staged.num_ranks,
                staged.experts,
                epoch,
                backend,
                origin=staging_id,
            )
        except Exception:  # noqa: BLE001 - this rank votes no; the peers learn it from the vote
            log.exception("cannot commit stage %d: voting no (%s)", staging_id, self._ctx.where())
        vote = torch.tensor([1 if ready is not None else 0], dtype=torch.int32, device=grp.device)
        grp.all_reduce(vote, "min")
        with self._lock:
            self.staged = None
        if ready is None or int(vote.item()) != 1:
            log.warning(
                "stage %d not committed by every rank: discarded (%s)",
                staging_id,
                self._ctx.where(),
            )
            return False
        self._become(ready, previous=self._snapshot())
        log.info("committed staged experts of stage %d (%s)", staging_id, self._ctx.where())
        return True
