"""The `mesh` expert layout at serving time (`serve --expert-layout mesh`, docs/TENSOR-PARALLEL.md):
expert parallelism over every TP actor of every DP rank, vLLM's layout.

The placement stays one of DP ranks (every planner, EPLB, resize and recovery path keeps
planning by DP rank); TP rank t of DP rank d is expert-parallel member d x T + t of DP x T and
holds part t of its DP rank's slots (`Placement.slots_of_rank(d x T + t, DP x T)`: the slots
per DP rank divide by T, `slot_multiple`). Each epoch the leaders' step group has a mesh
group beside it (`mesh_spec`, joined by every leader and follower: the step's expert
collectives); in each MoE layer every TP rank routes every row and dispatches rows t, t + T,
... (`model.tensor_parallel.MESH`).

- The leader (`slots.ExpertSlots` with `parts` = T) keeps the slots of part 0. The leaders'
  expert moves run as at T = 1, over the leaders' transfer group, for every slot of their DP
  ranks: a leader sends from its own part and from its followers' (`TensorLeader.held`),
  and hands each follower, ahead of the switch, the experts of its new part it lacks
  (`relay`: moved in, held by the leader or retained, pre-staged on a warm spare's leader);
- a follower (`MeshExperts`, in `tensor_follower.TensorFollower`) follows the leader's live
  token as a pipeline stage does (`stage_worker.StageWorker.follow`): experts it holds,
  retained or was handed are kept; what no peer held (a lost rank's only copy) it reads
  from the model source, ahead of the switch (`prefetch`) or, failing that, in the step.

At pipeline-parallel size P > 1 each stage is such a mesh of its own: stage s's TP leader
(stage 0: the DP rank's leader; stage s > 0: `stage_worker.StageWorker`) holds part 0 of its
DP rank's slots of the stage's MoE layers, its followers the other parts, over the stage's
mesh group (`mesh_spec` of the stage group's rendezvous); the followers see only the stage's
rows of a placement (`MeshParts.restrict`, `MeshExperts.first`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moe_runtime.comm import ep
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.model import experts as experts_mod
from moe_runtime.model import source as source_mod
from moe_runtime.rank import retention
from moe_runtime.rank.groups import MESH as ROLE  # a leader's mesh group, by epoch

__all__ = ["ROLE", "MeshExperts", "MeshParts", "check_slots", "member", "mesh_spec", "relay"]

log = logging.getLogger(__name__)

#: Seconds a mesh group's join, and each of its collectives, may take.
GROUP_TIMEOUT_S = 60.0
#: Seconds a leader waits for its followers' expert calls (reads from the source included).
LOAD_TIMEOUT_S = 600.0

Key = tuple[int, int]
Experts = dict[Key, experts_mod.ExpertWeights]
#: (epoch, origin, DP rank, DP size) of the leader's live state, as a pipeline stage's.
Token = tuple[int, int | None, int, int]


def mesh_spec(spec: group_mod.GroupSpec, size: int) -> group_mod.GroupSpec:
    """The rendezvous of the mesh group of the leaders' step group `spec` at TP size `size`:
    DP x T members, a FileStore beside the leaders' (one host) or its own keys in the leaders'
    TCPStore (the followers of a DP rank share their leader's host)."""
    world = spec.world_size * size
    if spec.store_path is not None:
        return dataclasses.replace(spec, store_path=f"{spec.store_path}.mesh", world_size=world)
    # after the stage's own prefix (`pipeline_group.stage_spec`): one mesh group per stage
    namespace = f"{spec.namespace}mesh/"
    return dataclasses.replace(spec, namespace=namespace, hosted=False, world_size=world)


def member(rank: int, num_ranks: int, size: int, part: int = 0) -> tuple[int, int]:
    """(member, members) of TP rank `part` of DP rank `rank` of `num_ranks` at TP size `size`."""
    return rank * size + part, num_ranks * size


def check_slots(num_physical: int, num_ranks: int, size: int) -> None:
    """ValueError unless `num_physical` slots split evenly over `num_ranks` x `size` members."""
    if num_physical % (num_ranks * size):
        raise ValueError(
            f"{num_physical} expert slots do not split over {num_ranks} DP ranks x {size} TP "
            f"ranks (the mesh expert layout holds an equal part on each)"
        )


class MeshParts:
    """The leader's side of its followers' parts of the routed experts (module docstring):
    `followers` as `tensor_group.Followers` (TP ranks 1..T-1, in order), `size` T.
    `restrict`: the rows of a placement the followers hold (stage 0's MoE layers on a leader
    at P > 1, `pipeline_group.stage_placement`; None: every row), applied to every placement
    they are sent."""

    def __init__(
        self,
        followers: Any,
        *,
        size: int,
        restrict: Callable[[policy.Placement], policy.Placement] | None = None,
    ) -> None:
        self.followers = followers
        self.size = size
        self.restrict = restrict
        self._prefetch_reads = 0
        self._reads_lock = threading.Lock()

    def view(self, placement: policy.Placement) -> policy.Placement:
        """`placement` as the followers hold it (`restrict`)."""
        return placement if self.restrict is None else self.restrict(placement)

    def rows(self, placement: policy.Placement | None) -> policy.Placement | None:
        """`view` of a placement that may be None (a load without one)."""
        return None if placement is None else self.view(placement)

    def member(self, rank: int | None, num_ranks: int | None) -> tuple[int | None, int | None]:
        """The (member, members) a leader's own slots are counted as: its part 0."""
        if rank is None or num_ranks is None:
            return rank, num_ranks
        return member(rank, num_ranks, self.size)

    def _wait(self, pending: Any, timeout: float = LOAD_TIMEOUT_S) -> list[Any]:
        return list(self.followers.wait(pending, timeout))

    def join(
        self,
        spec: group_mod.GroupSpec,
        rank: int,
        own: Callable[[group_mod.GroupSpec, int], None],
    ) -> None:
        """The leader joined its step group of `spec.epoch` as `rank` (a stage's leader: its
        stage group): it and its followers join the mesh group beside it, the leader as
        member rank x T through `own(mesh spec, member)` (blocks until every member joined)."""
        joining = self.followers.send("join_mesh", spec, rank)
        try:
            own(mesh_spec(spec, self.size), rank * self.size)
        except BaseException:
            self.abort_join(spec.epoch)  # its followers wait for no leader (health lane)
            try:
                self._wait(joining, GROUP_TIMEOUT_S + 10.0)
            except Exception:  # noqa: BLE001 - their joins were called off with the leader's
                log.debug("followers' mesh joins of epoch %d ended", spec.epoch, exc_info=True)
            raise
        self._wait(joining, GROUP_TIMEOUT_S + 10.0)

    def abort_join(self, epoch: int) -> None:
        """Call off the followers' joins of `epoch` (their health lane)."""
        self.followers.send("abort_join", epoch)

    def held(self, keys: Sequence[Key]) -> Experts:
        """Those of the experts `keys` ((MoE layer, logical)) the followers hold."""
        out: Experts = {}
        if keys:
            for part in self._wait(self.followers.send("held", list(keys))):
                out.update(part)
        return out

    def with_held(self, held: Experts, keys: Sequence[Key]) -> Experts:
        """`held` and those of `keys` it lacks that the followers hold."""
        missing = sorted({(int(a), int(b)) for a, b in keys} - set(held))
        return {**held, **self.held(missing)} if missing else held

    def lacks(self, placement: policy.Placement, *, rank: int, num_ranks: int) -> list[Key]:
        """The experts the followers' parts of DP rank `rank` under `placement` lack."""
        pending = self.followers.send("lacks", self.view(placement), rank, num_ranks)
        return sorted({(int(a), int(b)) for part in self._wait(pending) for a, b in part})

    def prefetch(
        self,
        placement: policy.Placement,
        *,
        rank: int | None,
        num_ranks: int,
        provided: Experts | None = None,
    ) -> Any:
        """Every follower starts keeping the experts of its part for DP rank `rank` of
        `num_ranks` under `placement`, from `provided` or read where it lacks them; a handle
        for `finish_prefetch`."""
        view = self.view(placement)
        return self.followers.send("prefetch", view, rank, num_ranks, provided or {})

    def finish_prefetch(self, pending: Any) -> int:
        """Wait for `prefetch`; the experts the followers read from the source (counted for
        `take_prefetch_reads`)."""
        read = sum(int(n) for n in self._wait(pending))
        with self._reads_lock:  # a staging's lane adds, the step thread takes
            self._prefetch_reads += read
        return read

    def take_prefetch_reads(self) -> int:
        """The experts the followers read from the source ahead of a switch since the last
        call."""
        with self._reads_lock:
            read, self._prefetch_reads = self._prefetch_reads, 0
        return read


def relay(
    parts: MeshParts, placement: policy.Placement, rank: int, num_ranks: int, available: Experts
) -> tuple[Any, Experts]:
    """A leader's hand-over of a staging (`slots.ExpertSlots.stage_experts`) as DP rank `rank`
    of `num_ranks` under `placement`, `available` being what it holds or received by key:
    each follower is handed the experts of its new part it lacks (the rest it keeps, or reads
    when no one here has them), and the leader gets those of its own part 0 that only a
    follower held. Returns (the followers' prefetch, for `MeshParts.finish_prefetch`;
    `available` with those)."""
    size, view = parts.size, parts.view(placement)
    wanted: set[Key] = set()
    for t in range(size):
        me, members = member(rank, num_ranks, size, t)
        placed = placement if t == 0 else view  # the leader's part: every row it holds
        for layer in range(placed.num_layers):
            wanted.update((layer, e) for e in placed.experts_on_rank(layer, me, members))
    lacking = set(parts.lacks(placement, rank=rank, num_ranks=num_ranks))
    missing = sorted((wanted - set(available)) | (lacking - set(available)))
    pool = {**available, **parts.held(missing)} if missing else available
    handed = {k: pool[k] for k in sorted(lacking) if k in pool}
    pending = parts.prefetch(placement, rank=rank, num_ranks=num_ranks, provided=handed)
    return pending, pool


class MeshExperts:
    """A follower's routed experts: part `part` of its DP rank's slots (module docstring).
    `first`: the model's MoE layer of a placement's row 0 (a later pipeline stage's first)."""

    def __init__(self, *, part: int, size: int, device: str, where: Any, first: int = 0) -> None:
        self.part = part
        self.size = size
        self.device = device
        self.first = first
        self._where = where
        self.placement: policy.Placement | None = None
        self.token: Token | None = None
        self.rank = -1
        self.num_ranks = 0
        #: (MoE layer, local slot of this member) -> weights
        self.experts: Experts = {}
        self.source: str | None = None
        self.dtype = torch.float32
        self._retained = retention.Retained()
        self._prefetched: Experts = {}
        self._lock = threading.Lock()
        self.groups: dict[int, group_mod.StatelessGroup] = {}
        self._backends: dict[int, experts_mod.ExpertBackend] = {}
        self._stepped: list[int] = []
        self._aborted_joins: set[int] = set()
        self.reads_in_step = 0
        self.prefetched = 0

    def where(self) -> str:
        return f"{self._where()} mesh part {self.part} epochs={sorted(self.groups)}"

    def _slots(self, placement: policy.Placement, rank: int, num_ranks: int) -> dict[Key, Key]:
        """(MoE layer, local slot) -> (MoE layer, logical) of this member under `placement`."""
        me, members = member(rank, num_ranks, self.size, self.part)
        return {
            (layer, slot): (layer, logical)
            for layer in range(placement.num_layers)
            for slot, logical in enumerate(placement.experts_on_rank(layer, me, members))
        }

    def _read(self, keys: set[Key]) -> Experts:
        if not keys:
            return {}
        assert self.source is not None
        src = source_mod.open_source(self.source)
        return experts_mod.load_experts(
            src, keys, first=self.first, dtype=self.dtype, device=self.device
        )

    def _held(self) -> Experts:
        held = dict(self._retained.experts)
        if self.placement is not None:
            keys = self._slots(self.placement, self.rank, self.num_ranks)
            held.update((keys[slot], w) for slot, w in self.experts.items() if slot in keys)
        return held

    def load(
        self,
        source: str,
        dtype: torch.dtype,
        rank: int,
        num_ranks: int,
        placement: policy.Placement | None,
        *,
        placeholder: bool = False,
    ) -> int:
        """Read this member's slots of DP rank `rank` under `placement` (zeros when the
        leader loads placeholders: they come with the first placement change). Bytes held."""
        self.source, self.dtype = source, dtype
        self._retained, self._prefetched = retention.Retained(), {}
        self._backends.clear()
        self.token = None
        experts: Experts = {}
        if placement is not None:
            check_slots(placement.num_physical, num_ranks, self.size)
            slots = self._slots(placement, rank, num_ranks)
            if placeholder:
                src = source_mod.open_source(source)
                zero = experts_mod.zero_expert(src.config, dtype=dtype, device=self.device)
                experts = dict.fromkeys(slots, zero)
                self._retained.reset([zero])
            else:
                read = self._read(set(slots.values()))
                experts = {slot: read[key] for slot, key in slots.items()}
        self.placement, self.rank, self.num_ranks, self.experts = (
            placement,
            rank,
            num_ranks,
            experts,
        )
        return sum(w.nbytes for w in {id(w): w for w in experts.values()}.values())

    def join(self, spec: group_mod.GroupSpec, rank: int) -> None:
        """Join the mesh group of the leaders' step group `spec` as TP rank `part` of DP rank
        `rank` (blocks until every member joined)."""
        me, _ = member(rank, spec.world_size, self.size, self.part)
        group = group_mod.StatelessGroup(
            mesh_spec(spec, self.size),
            me,
            timeout=GROUP_TIMEOUT_S,
            aborted=lambda: spec.epoch in self._aborted_joins,
        )
        old = self.groups.pop(spec.epoch, None)
        self.groups[spec.epoch] = group
        self._backends.pop(spec.epoch, None)
        if old is not None:
            old.destroy()

    def abort_join(self, epoch: int) -> None:
        self._aborted_joins.add(epoch)

    def abort(self, reason: str) -> None:
        for group in list(self.groups.values()):
            group.abort(reason)

    def close(self) -> None:
        for group in list(self.groups.values()):
            group.destroy()
        self.groups.clear()
        self._backends.clear()

    def follow(self, token: Token, placement: policy.Placement | None) -> None:
        """Serve as the leader's live `token` says (DP rank `token[2]` of `token[3]` under
        `placement`): held, retained or prefetched experts kept, the rest read now."""
        if token == self.token:
            return
        if placement is None:
            raise RuntimeError(
                f"the leader serves {token}, this follower {self.token}, and no placement came "
                f"({self.where()})"
            )
        rank, num_ranks = token[2], token[3]
        slots = self._slots(placement, rank, num_ranks)
        with self._lock:
            held = {**self._prefetched, **self._held()}
            self._prefetched = {}
        fetched = self._read(set(slots.values()) - set(held))
        held.update(fetched)
        with self._lock:
            before = self._held()
            self._retained.absorb(before, {key: held[key] for key in slots.values()})
            self.experts = {slot: held[key] for slot, key in slots.items()}
            self.placement, self.rank, self.num_ranks, self.token = (
                placement,
                rank,
                num_ranks,
                token,
            )
        self.reads_in_step += len(fetched)
        self._backends.clear()
        log.info(
            "mesh follower serves %s: %d expert slots, %d read from the source (%s)",
            token,
            len(self.experts),
            len(fetched),
            self.where(),
        )

    def lacks(self, placement: policy.Placement, rank: int, num_ranks: int) -> list[Key]:
        """The experts ((MoE layer, logical)) this member's part of DP rank `rank` of
        `num_ranks` under `placement` needs and it does not hold."""
        wanted = set(self._slots(placement, rank, num_ranks).values())
        with self._lock:
            held = {**self._prefetched, **self._held()}
        return sorted(wanted - set(held))

    def prefetch(
        self,
        placement: policy.Placement,
        rank: int | None,
        num_ranks: int,
        provided: dict[Key, experts_mod.ExpertWeights] | None = None,
    ) -> int:
        """Keep, ahead of the step that switches to it, the experts this member's part of DP
        rank `rank` of `num_ranks` under `placement` needs: those it holds, those `provided`
        (its leader handed them: `relay`), the rest read from the source (rank None: it
        leaves). Returns the experts read from the source."""
        if rank is None or self.source is None:
            return 0
        started = time.monotonic()
        wanted = set(self._slots(placement, rank, num_ranks).values())
        given = {
            (int(a), int(b)): w.to(dtype=self.dtype, device=self.device)
            for (a, b), w in (provided or {}).items()
            if (int(a), int(b)) in wanted
        }
        with self._lock:
            held = {**self._prefetched, **self._held()}
        fetched = self._read(wanted - set(held) - set(given))
        with self._lock:
            kept = {k: w for k, w in self._prefetched.items() if k in wanted}
            self._prefetched = kept | given | fetched
        self.prefetched += len(fetched)
        log.info(
            "mesh follower prefetched %d experts for rank %d of %d in %.2fs: %d handed by its "
            "leader, %d read from the source (%s)",
            len(given) + len(fetched),
            rank,
            num_ranks,
            time.monotonic() - started,
            len(given),
            len(fetched),
            self.where(),
        )
        return len(fetched)

    def held(self, keys: Sequence[Key]) -> Experts:
        """Those of `keys` ((MoE layer, logical)) this member holds (a leader sends them)."""
        with self._lock:
            held = {**self._prefetched, **self._held()}
        return {(int(a), int(b)): held[(int(a), int(b))] for a, b in keys if (a, b) in held}

    def backend(self, epoch: int) -> experts_mod.ExpertBackend:
        """This member's experts over the mesh group of `epoch` (groups of epochs before the
        two last stepped go)."""
        backend = self._backends.get(epoch)
        if backend is not None:
            return backend
        group = self.groups.get(epoch)
        if group is None:
            raise RuntimeError(f"no mesh group of epoch {epoch} joined ({self.where()})")
        if epoch not in self._stepped:
            self._stepped = [*self._stepped[-1:], epoch]
        for old in [e for e in self.groups if e < min(self._stepped)]:
            self.groups.pop(old).destroy()
            self._backends.pop(old, None)
        if self.placement is None:
            raise RuntimeError(f"no placement to serve ({self.where()})")
        me, members = member(self.rank, self.num_ranks, self.size, self.part)
        if group.rank != me or group.world_size != members:
            raise RuntimeError(
                f"mesh group member {group.rank}/{group.world_size} but experts held for "
                f"{me}/{members} ({self.where()})"
            )
        base = self.placement.slots_of_rank(me, members).start
        slots = {(layer, base + slot): w for (layer, slot), w in self.experts.items()}
        backend = ep.ExpertParallelBackend(group, self.placement, slots, rank=me)
        self._backends[epoch] = backend
        return backend
