"""A pipeline stage's communication groups by epoch (`StageGroups`, a part of
`stage_worker.StageWorker`): its stage group (the experts' collectives of its MoE layers, or in
the mesh expert layout its mesh group beside it), its transfer group (expert moves, a new DP
rank's non-expert tensors), and the expert backend over the group of each epoch. Joined whenever the leaders join theirs
(`pipeline_group.PipelineLeader.join`); the leader's side of its own: `groups.RankGroups`."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moe_runtime.comm import ep
from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.model import decoder
from moe_runtime.model import experts as experts_mod
from moe_runtime.rank import groups as groups_mod
from moe_runtime.rank import mesh as mesh_mod
from moe_runtime.rank import staging as staging_mod
from moe_runtime.rank.pipeline_group import GROUP_TIMEOUT_S, stage_spec

log = logging.getLogger(__name__)

Groups = dict[int, group_mod.StatelessGroup]


class StageGroups:
    """Stage `stage`'s groups of each epoch; `where()` names the stage in errors; `parts`:
    the mesh layout's followers' parts (their joins of the stage's mesh group go with its
    own), else None."""

    def __init__(
        self, stage: int, where: Callable[[], str], parts: mesh_mod.MeshParts | None = None
    ) -> None:
        self.stage = stage
        self._where = where
        self.parts = parts
        self.step: Groups = {}
        #: expert moves between the same stage of the DP ranks, never beside a step's
        #: collectives on one group
        self.transfer: Groups = {}
        #: the mesh layout's mesh groups (the step's expert collectives over DP x T)
        self.mesh: Groups = {}
        self._backends: dict[int, experts_mod.ExpertBackend] = {}
        #: epochs whose joins were called off (`abort_join`; epochs are never reused)
        self._aborted: set[int] = set()
        self._stepped: list[int] = []  # the epochs stepped, latest last

    def __contains__(self, epoch: object) -> bool:
        return epoch in self.step

    def epochs(self) -> list[int]:
        return sorted(self.step)

    def join(self, spec: group_mod.GroupSpec, rank: int, role: str) -> None:
        """Join the stage group of `spec.epoch` derived from the leaders' `role` group ("step"
        or "transfer") as `rank`; in the mesh layout, with "step", the mesh group beside it
        too, its followers with it (blocks until every member joined)."""
        own = stage_spec(spec, self.stage)
        self._join(self.step if role == "step" else self.transfer, own, rank, what=role)
        if self.parts is not None and role == "step":
            self.parts.join(own, rank, functools.partial(self._join, self.mesh, what="mesh"))

    def _join(self, groups: Groups, spec: group_mod.GroupSpec, rank: int, *, what: str) -> None:
        started = time.monotonic()
        group = group_mod.StatelessGroup(
            spec, rank, timeout=GROUP_TIMEOUT_S, aborted=lambda: spec.epoch in self._aborted
        )
        log.info(
            "joined the stage's %s group of epoch %d as %d/%d in %.2fs (%s)",
            what,
            spec.epoch,
            rank,
            spec.world_size,
            time.monotonic() - started,
            self._where(),
        )
        old = groups.pop(spec.epoch, None)
        groups[spec.epoch] = group
        self._backends.pop(spec.epoch, None)
        if old is not None:
            old.destroy()

    def abort_join(self, epoch: int) -> None:
        """Call off the joins of `epoch`, running or still to come (any thread), the
        followers' mesh joins too."""
        self._aborted.add(epoch)
        if self.parts is not None:
            self.parts.abort_join(epoch)

    def all(self) -> list[group_mod.StatelessGroup]:
        return [*self.step.values(), *self.transfer.values(), *self.mesh.values()]

    def abort(self, reason: str) -> None:
        for group in self.all():
            group.abort(reason)

    def destroy(self) -> None:
        for group in self.all():
            group.destroy()
        for groups in (self.step, self.transfer, self.mesh):
            groups.clear()
        self._backends.clear()

    def forget_backends(self) -> None:
        """The experts changed: each epoch's backend is made again at its next step."""
        self._backends.clear()

    def transfer_non_expert(
        self,
        epoch: int,
        model: decoder.MoEModel,
        src_ranks: Sequence[int],
        dst_ranks: Sequence[int],
        followers: groups_mod.NonExpertHolder | None = None,
    ) -> int:
        """The stage's non-expert tensors (`model`'s) from the same stage of `src_ranks` to
        that of `dst_ranks` over its transfer group of `epoch` (ranks of its leaders' group:
        `RankGroups.transfer_non_expert`, whose leaders run theirs meanwhile), and its TP
        `followers`' shards meanwhile (`TensorLeader.transfer_non_expert`). Returns the
        bytes received (its followers' included)."""
        grp = self.transfer_group(epoch)
        theirs = (
            None if followers is None else followers.transfer_non_expert(grp, src_ranks, dst_ranks)
        )
        received = staging_mod.transfer_non_expert(
            grp, model, epoch=epoch, src_ranks=src_ranks, dst_ranks=dst_ranks,
            what="pipeline stage", where=self._where(),
        )  # fmt: skip
        return received + (0 if theirs is None else theirs())

    def transfer_group(self, epoch: int) -> group_mod.StatelessGroup:
        group = self.transfer.get(epoch)
        if group is None:
            raise RuntimeError(f"no stage transfer group of epoch {epoch} joined ({self._where()})")
        return group

    def backend(
        self,
        epoch: int,
        placement: policy.Placement | None,
        experts: Mapping[tuple[int, int], Any],
        member: int,
    ) -> experts_mod.ExpertBackend:
        """The stage's `experts` (its slots of `placement`, held as group member `member`)
        over its group of `epoch` (the mesh group in the mesh layout); the groups of epochs
        before the two last stepped go (a revert steps the one before)."""
        backend = self._backends.get(epoch)
        if backend is not None:
            return backend
        group = (self.step if self.parts is None else self.mesh).get(epoch)
        if group is None:
            raise RuntimeError(f"no stage group of epoch {epoch} joined ({self._where()})")
        if epoch not in self._stepped:
            self._stepped = [*self._stepped[-1:], epoch]
        for groups in (self.step, self.transfer, self.mesh):
            for old in [e for e in groups if e < min(self._stepped)]:
                groups.pop(old).destroy()
                self._backends.pop(old, None)
        if placement is None:
            backend = experts_mod.LocalExperts({})  # dense layers only: never called
        else:
            if group.rank != member:
                raise RuntimeError(
                    f"stage group rank {group.rank} but experts held for member {member} "
                    f"({self._where()})"
                )
            backend = ep.ExpertParallelBackend(group, placement, dict(experts))
        self._backends[epoch] = backend
        return backend
