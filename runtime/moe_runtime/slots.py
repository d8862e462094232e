"""The expert-slot half of a rank (`RankWorker` inherits it): live, staged and previous slots.

- live: the slots the rank serves with, under `placement` as rank `rank` of `num_ranks`, with
  the step group of `epoch` (the expert-parallel backend);
- staged: slots prepared for another placement (`stage_experts`) while the live ones serve;
- previous: the live state that the last `activate` or EPLB commit replaced, kept (with the
  older epochs' groups) until `retire_previous`, so that `revert` can undo the change;
- pre-staged: experts a future placement will give this rank, fetched ahead of a resize
  (`prestage_experts`: a warm spare, in the background); `stage_experts` takes them from there
  instead of moving them again; forgotten when the rank is activated;
- retained: experts a confirmed change took off the live slots (`retention.Retained`, bounded
  by the most the rank held at once), kept for a later `stage_experts` (a shrink back after a
  grow moves nothing for them; `retained_keys` tells the planner).

A change of the live slots is all-or-nothing across ranks: `activate` runs on every rank
between two steps and is undone with `revert` where a peer failed; an EPLB commit inside a step
(`StepInput.control["expert_epoch"]`) is voted on first with a min all-reduce over the step
group, so every rank commits or none does (then every rank discards the staged set).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from moe_runtime import retention
from moe_runtime import staging as staging_mod
from moe_runtime.comm import ep as ep_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.comm import transfer as transfer_mod
from moe_runtime.eplb import moves as moves_mod
from moe_runtime.eplb import policy
from moe_runtime.model import config as config_mod
from moe_runtime.model import decoder
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import source as source_mod

log = logging.getLogger(__name__)

#: Role of the group used only by `execute_step` collectives (expert dispatch/combine).
STEP_ROLE = "step"
#: Role of the group used only by background weight moves.
TRANSFER_ROLE = "transfer"


@dataclasses.dataclass
class Staged:
    """Expert slots prepared for a future placement; the live slots keep serving meanwhile."""

    stage: int
    placement: policy.Placement
    rank: int
    num_ranks: int
    experts: dict[tuple[int, int], experts_mod.ExpertWeights]


@dataclasses.dataclass(frozen=True)
class Live:
    """What a rank serves with, as one value: kept as the previous state when it is replaced.

    origin: the epoch (`activate`) or staging id (EPLB commit) this state came from.
    """

    placement: policy.Placement | None
    rank: int | None
    num_ranks: int | None
    experts: dict[tuple[int, int], experts_mod.ExpertWeights]
    epoch: int | None
    backend: experts_mod.ExpertBackend | None
    origin: int | None

    def serves(self, placement: policy.Placement, rank: int, num_ranks: int) -> bool:
        return (
            self.placement is not None
            and self.placement.equals(placement)
            and (self.rank, self.num_ranks) == (rank, num_ranks)
        )


class ExpertSlots:
    """Slot state and its changes; the rest of the rank (model, groups, KV) is `RankWorker`'s."""

    device: str
    dtype: torch.dtype
    source_name: str | None
    rank: int | None
    num_ranks: int | None
    epoch: int | None
    placement: policy.Placement | None
    experts: dict[tuple[int, int], experts_mod.ExpertWeights]
    _backend: experts_mod.ExpertBackend | None
    _staged: Staged | None
    _previous: Live | None
    _prestaged: dict[tuple[int, int], experts_mod.ExpertWeights]
    _retained: retention.Retained
    _origin: int | None
    _groups: dict[tuple[int, str], group_mod.StatelessGroup]
    _lock: threading.RLock

    def _ctx(self) -> str:
        raise NotImplementedError

    def _check_fail(self, operation: str) -> None:
        raise NotImplementedError

    def _require_model(self) -> tuple[config_mod.ModelConfig, decoder.MoEModel]:
        raise NotImplementedError

    def _group(self, epoch: int, role: str) -> tuple[group_mod.StatelessGroup, int]:
        raise NotImplementedError

    def _drop_group(self, key: tuple[int, str], *, wait: bool = True) -> None:
        raise NotImplementedError

    def _require_epoch(self) -> int:
        if self.epoch is None:
            raise RuntimeError(f"rank not activated ({self._ctx()})")
        return self.epoch

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
    ) -> int:
        """Prepare this rank's slots of `new_placement` in a staging area; returns bytes received.

        from_source: experts that neither this rank holds nor a move brings are read from the
        model source (recovery after a rank died with the only copy); otherwise that is an error.
        provided: experts (layer, logical) -> weights that the executor already brought by
        another path (co-located peers, through shared memory); `moves` then leaves them out.

        new_rank None: this rank leaves (scale-down); it only sends and stages nothing.

        Every member of epoch's transfer group calls it with the same `moves` (a move's
        src_rank / dst_rank are ranks of that group, which are the old and the new ranks since
        survivors keep their rank); moves run peer to peer (`comm.transfer.execute_moves`).
        Slots whose expert this rank already holds are filled locally (shared tensors, no
        copy). The live slots keep serving until the stage is committed: by
        `StepInput.control["expert_epoch"] == stage` (same ranks) or by `activate` (new group).
        stage (the staging id) defaults to epoch.
        """
        cfg, _ = self._require_model()
        grp, _me = self._group(epoch, TRANSFER_ROLE)
        new_placement.validate(new_num_ranks)
        started = time.monotonic()
        held = self._held_experts()
        with self._lock:
            prestaged = dict(self._prestaged)
            retained = dict(self._retained.experts)
        stats, received = self._run_moves(grp, moves, held, cfg)
        self._check_fail("stage_experts")
        if new_rank is None:
            log.info(
                "sent %d experts for a placement without this rank in %.2fs (%s)",
                stats.sent,
                time.monotonic() - started,
                self._ctx(),
            )
            return stats.bytes_received
        src = (
            source_mod.open_source(self.source_name)
            if from_source and self.source_name is not None
            else None
        )
        slots, loaded, missing = staging_mod.fill_slots(
            new_placement,
            rank=new_rank,
            num_ranks=new_num_ranks,
            available={**retained, **prestaged, **held, **received, **(provided or {})},
            source=src,
            dtype=self.dtype,
            device=self.device,
        )
        if loaded:
            log.info("read %d experts from %s (%s)", loaded, self.source_name, self._ctx())
        if missing:
            raise RuntimeError(
                f"stage_experts: the moves bring no weights for (layer, expert) {missing[:5]} "
                f"({len(missing)} missing) that new rank {new_rank} needs ({self._ctx()})"
            )
        staging_id = epoch if stage is None else stage
        with self._lock:
            self._staged = Staged(
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
            self._ctx(),
        )
        return stats.bytes_received

    def _run_moves(
        self,
        grp: group_mod.StatelessGroup,
        moves: Sequence[moves_mod.ExpertMove],
        held: staging_mod.Experts,
        cfg: config_mod.ModelConfig,
    ) -> tuple[transfer_mod.TransferStats, staging_mod.Experts]:
        """This rank's part of `moves` over `grp`: sends from `held`; returns what it got."""
        received: staging_mod.Experts = {}

        def read_expert(layer: int, logical: int) -> experts_mod.ExpertWeights:
            weights = held.get((layer, logical))
            if weights is None:
                raise RuntimeError(
                    f"a move names this rank as source of expert {logical} of layer {layer}, "
                    f"which it does not hold ({self._ctx()})"
                )
            return weights

        def write_expert(move: moves_mod.ExpertMove, weights: experts_mod.ExpertWeights) -> None:
            received[(move.layer, move.logical)] = weights.to(dtype=self.dtype, device=self.device)

        stats = transfer_mod.execute_moves(
            grp,
            list(moves),
            read_expert=read_expert,
            write_expert=write_expert,
            like=experts_mod.zero_expert(cfg, dtype=self.dtype, device=grp.device),
        )
        return stats, received

    # -- pre-staging (ahead of a resize) -------------------------------------------------
    def prestage_experts(
        self,
        epoch: int,
        moves: Sequence[moves_mod.ExpertMove],
        *,
        provided: Mapping[tuple[int, int], experts_mod.ExpertWeights] | None = None,
    ) -> int:
        """Keep the experts `moves` bring to this rank (and `provided`: brought by the executor
        another way) beside the live slots, for a later `stage_experts`; returns the bytes
        received. Every member of epoch's transfer group that a move names calls it with the
        same `moves` (as `stage_experts`); a move's dst_slot is not used."""
        cfg, _ = self._require_model()
        grp, _me = self._group(epoch, TRANSFER_ROLE)
        stats, received = self._run_moves(grp, moves, self._held_experts(), cfg)
        extra = {k: w.to(dtype=self.dtype, device=self.device) for k, w in (provided or {}).items()}
        with self._lock:
            self._prestaged.update(received)
            self._prestaged.update(extra)
            count = len(self._prestaged)
        log.info(
            "pre-staged %d experts (%d held now) (%s)",
            len(received) + len(extra),
            count,
            self._ctx(),
        )
        return stats.bytes_received

    def prestaged_keys(self) -> list[tuple[int, int]]:
        """The (layer, logical) keys of the pre-staged experts."""
        with self._lock:
            return sorted(self._prestaged)

    def drop_prestaged(self, keep: Sequence[tuple[int, int]] = ()) -> int:
        """Forget the pre-staged experts not in `keep`; returns how many are left."""
        wanted = {(int(a), int(b)) for a, b in keep}
        with self._lock:
            self._prestaged = {k: w for k, w in self._prestaged.items() if k in wanted}
            return len(self._prestaged)

    def retained_keys(self) -> list[tuple[int, int]]:
        """The (layer, logical) keys of the retained experts (module docstring)."""
        with self._lock:
            return self._retained.keys()

    def held_experts(self, keys: Sequence[tuple[int, int]]) -> staging_mod.Experts:
        """{(layer, logical): weights} of the live slots for `keys` (what a peer asked for);
        a key this rank does not hold is an error naming it."""
        held = self._held_experts()
        missing = [k for k in keys if k not in held]
        if missing:
            raise RuntimeError(
                f"asked for (layer, expert) {missing[:5]} ({len(missing)}) that this rank does "
                f"not hold ({self._ctx()})"
            )
        return {k: held[k] for k in keys}

    def _held_experts(self) -> staging_mod.Experts:
        """{(layer, logical): weights} of the live slots."""
        with self._lock:
            placement, rank, num_ranks = self.placement, self.rank, self.num_ranks
            experts = dict(self.experts)
        return staging_mod.held_experts(placement, rank, num_ranks, experts)

    def discard_staged(self) -> None:
        """Forget staged experts (a resize or a rebalance that failed)."""
        with self._lock:
            self._staged = None

    # -- the live state: replace, undo, confirm ------------------------------------------
    def _snapshot(self) -> Live:
        with self._lock:
            return Live(
                placement=self.placement,
                rank=self.rank,
                num_ranks=self.num_ranks,
                experts=self.experts,
                epoch=self.epoch,
                backend=self._backend,
                origin=self._origin,
            )

    def _become(self, live: Live, *, previous: Live | None) -> None:
        """Make `live` the serving state at once; `previous` is what `revert` goes back to."""
        with self._lock:
            self.placement, self.rank, self.num_ranks = live.placement, live.rank, live.num_ranks
            self.experts, self.epoch, self._backend = live.experts, live.epoch, live.backend
            self._origin = live.origin
            self._previous = previous

    def revert(self, origin: int) -> bool:
        """Go back to the previous live state if the live one came from `origin` (the epoch of
        an `activate`, or the staging id of an EPLB commit); True when it did.

        Called while no step runs (a failed switch, the rollback of a resize or a rebalance).
        The previous state's groups still exist: nothing is destroyed before `retire_previous`.
        """
        with self._lock:
            previous = self._previous
            if previous is None or self._origin != origin:
                return False
        self._become(previous, previous=None)
        log.info("reverted the live state of %d (%s)", origin, self._ctx())
        return True

    def retire_previous(self) -> None:
        """The last change is confirmed: forget the previous state (retaining the experts it
        served that the live slots do not) and destroy the groups of epochs older than the
        active one (in the background: nothing waits for their peers to close)."""
        with self._lock:
            previous, self._previous = self._previous, None
            if previous is not None:
                before = staging_mod.held_experts(
                    previous.placement, previous.rank, previous.num_ranks, previous.experts
                )
                count = self._retained.absorb(before, self._held_experts())
                log.debug("retaining %d experts (%s)", count, self._ctx())
            active = self.epoch
            old_keys = [key for key in self._groups if active is not None and key[0] < active]
        for key in old_keys:
            self._drop_group(key, wait=False)  # nothing uses them: closed in the background

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
        self._check_fail("activate")
        cfg, _ = self._require_model()
        grp, group_rank = self._group(epoch, STEP_ROLE)
        if grp.world_size != num_ranks or group_rank != rank:
            raise ValueError(
                f"activate: epoch {epoch}'s step group has this worker as {group_rank}/"
                f"{grp.world_size}, not {rank}/{num_ranks} ({self._ctx()})"
            )
        placement.validate(num_ranks)
        before = self._snapshot()
        with self._lock:
            staged, previous = self._staged, self._previous
        if staged is not None:
            if staged.rank != rank or not staged.placement.equals(placement):
                raise ValueError(
                    f"activate: the staged experts (stage {staged.stage}) are for rank "
                    f"{staged.rank}/{staged.num_ranks} under another placement ({self._ctx()})"
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
            wanted = [
                placement.experts_on_rank(layer, rank, num_ranks)
                for layer in range(cfg.num_moe_layers)
            ]
            current = (
                None
                if before.placement is None or before.rank is None or before.num_ranks is None
                else [
                    before.placement.experts_on_rank(layer, before.rank, before.num_ranks)
                    for layer in range(cfg.num_moe_layers)
                ]
            )
            if current != wanted:
                raise ValueError(
                    f"activate: this rank's slots do not hold the experts rank {rank}/{num_ranks} "
                    f"needs under the new placement: stage them first ({self._ctx()})"
                )
            experts = before.experts
        backend = _make_backend(grp, placement, rank, num_ranks, experts)
        live = Live(placement, rank, num_ranks, experts, epoch, backend, origin=epoch)
        with self._lock:
            self._staged = None
            self._prestaged = {}  # what it needed is in its slots now
        self._become(live, previous=before)
        log.info("activated epoch %d with %d slots (%s)", epoch, len(self.experts), self._ctx())

    def _commit_vote(self, staging_id: int) -> bool:
        """The EPLB commit inside a step, all-or-nothing: every rank prepares the staged set
        (and its backend), votes, and commits only if every rank voted yes; otherwise every
        rank discards it. Returns whether it committed. Every rank must call it in that step.
        """
        epoch = self._require_epoch()
        grp, _ = self._group(epoch, STEP_ROLE)
        ready: Live | None = None
        try:
            self._check_fail("commit_staged")
            with self._lock:
                staged = self._staged
            if staged is None or staged.stage != staging_id:
                have = None if staged is None else staged.stage
                raise RuntimeError(f"no experts staged for stage {staging_id} (have {have})")
            if staged.num_ranks != self.num_ranks:
                raise RuntimeError(
                    f"experts of stage {staged.stage} were staged for {staged.num_ranks} ranks, "
                    f"not {self.num_ranks}"
                )
            backend = _make_backend(
                grp, staged.placement, staged.rank, staged.num_ranks, staged.experts
            )
            ready = Live(
                staged.placement,
                staged.rank,
                staged.num_ranks,
                staged.experts,
                epoch,
                backend,
                origin=staging_id,
            )
        except Exception:  # noqa: BLE001 - this rank votes no; the peers learn it from the vote
            log.exception("cannot commit stage %d: voting no (%s)", staging_id, self._ctx())
        vote = torch.tensor([1 if ready is not None else 0], dtype=torch.int32, device=grp.device)
        grp.all_reduce(vote, "min")
        with self._lock:
            self._staged = None
        if ready is None or int(vote.item()) != 1:
            log.warning(
                "stage %d not committed by every rank: discarded (%s)", staging_id, self._ctx()
            )
            return False
        self._become(ready, previous=self._snapshot())
        log.info("committed staged experts of stage %d (%s)", staging_id, self._ctx())
        return True


def _make_backend(
    grp: group_mod.StatelessGroup,
    placement: policy.Placement | None,
    rank: int | None,
    num_ranks: int | None,
    experts: Mapping[tuple[int, int], experts_mod.ExpertWeights],
) -> experts_mod.ExpertBackend:
    """The expert-parallel backend over the step group (it keys slots by global index)."""
    if placement is None or rank is None or num_ranks is None:
        raise RuntimeError("no placement to serve")
    base = placement.slots_of_rank(rank, num_ranks).start
    slots = {(layer, base + slot): w for (layer, slot), w in experts.items()}
    return ep_mod.ExpertParallelBackend(grp, placement, slots, rank=rank)
