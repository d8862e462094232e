"""Groups and weight moves over `RayExecutor`'s rank actors (inherited by `RayExecutor`).

- `build_groups`: the step and transfer groups of an epoch (FileStore rendezvous when the
  members share one IP, else a TCPStore hosted by the group's rank 0);
- `stage_experts` / `transfer_non_expert`: between ranks of one Ray node (CPU) the weights go
  through Ray's object store (`ray_transfer`: shared memory, one copy in and one out); the
  other moves go over the transfer group, as `base.Executor` does them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from moe_runtime.comm import group as group_mod
from moe_runtime.executor import base, joins, ray_actor, ray_transfer

log = logging.getLogger(__name__)


class GroupsAndWeights:
    """Mixin of `RayExecutor` (see the module docstring); the state is the executor's."""

    _lock: threading.RLock
    _ranks: dict[int, ray_actor.Rank]
    _active: list[int]
    _rendezvous: str
    _transfer_backend: group_mod.Backend
    _group_dir: str
    use_gpu: bool
    lost_ranks: Callable[[], Mapping[int, Any]]  # the executor's (health.HealthMonitor)
    #: Weight moves between ranks of one node go through the object store (`ray_transfer`).
    shared_memory_moves: bool = True

    def collective_rpc(
        self,
        method: str,
        *args: Any,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        background: bool = False,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        raise NotImplementedError

    def build_groups(
        self,
        ranks: Sequence[int],
        *,
        epoch: int,
        timeout: float | None = None,
        background: bool = True,
    ) -> None:
        ranks = list(ranks)
        with self._lock:
            _, members = base.rpc_targets(
                "build_groups", ranks, active=self._active, members=self._ranks
            )
        step_backend: group_mod.Backend = "nccl" if self.use_gpu else "gloo"
        backends = {base.STEP_GROUP: step_backend, base.TRANSFER_GROUP: self._transfer_backend}
        one_host = self._rendezvous == "file" or (
            self._rendezvous == "auto" and len({m.info["ip"] for m in members}) == 1
        )
        for role in base.GROUP_ROLES:
            backend = backends[role]
            if one_host:
                spec = group_mod.GroupSpec.local(
                    len(ranks), epoch=epoch, backend=backend, directory=self._group_dir
                )
            else:
                host, port = ray.get(
                    members[0]
                    .actor.free_port.options(concurrency_group=ray_actor.HEALTH_LANE)
                    .remote(),
                    timeout=30,
                )
                spec = group_mod.GroupSpec.tcp(host, port, len(ranks), epoch=epoch, backend=backend)
            started = time.monotonic()
            lane = {"concurrency_group": ray_actor.CTL_LANE} if background else {}
            handles = {
                r: m.actor.execute_method.options(**lane).remote(
                    "join_group", spec, rank=i, role=role, group_timeout=timeout
                )
                for i, (r, m) in enumerate(zip(ranks, members, strict=True))
            }
            joins.gather_joins(
                handles,
                self._join_calls(members, ranks, epoch),
                what=f"join_group (epoch {epoch}, {role})",
                timeout=timeout,
            )
            log.info(
                "epoch %d %s group over ranks %s built in %.2fs (%s)",
                epoch,
                role,
                ranks,
                time.monotonic() - started,
                "FileStore" if one_host else f"TCPStore {spec.host}:{spec.port}",
            )

    def _join_calls(
        self, members: Sequence[Any], ranks: Sequence[int], epoch: int
    ) -> joins.JoinCalls[Any]:
        actors = dict(zip(ranks, (m.actor for m in members), strict=True))

        def wait(pending: list[Any], timeout: float) -> list[Any]:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            return list(done)

        def result(label: int, ref: Any) -> object:
            return ray_actor.get_all([ref], [label], what="join_group", timeout=0)[0]

        def abort(labels: list[int]) -> None:
            health = {"concurrency_group": ray_actor.HEALTH_LANE}
            refs = [
                actors[r].execute_method.options(**health).remote("abort_join", epoch)
                for r in labels
            ]
            ray.wait(refs, num_returns=len(refs), timeout=joins.ABORT_GRACE_SECONDS)

        return joins.JoinCalls(wait=wait, result=result, abort=abort, lost=self.lost_ranks)

    # -- weight moves ----------------------------------------------------------------------
    def _actors_and_nodes(self, labels: Sequence[int]) -> tuple[dict[int, Any], dict[int, str]]:
        with self._lock:
            _, members = base.rpc_targets(
                "weights", labels, active=self._active, members=self._ranks
            )
        actors = {r: m.actor for r, m in zip(labels, members, strict=True)}
        nodes = {r: str(m.info["node_id"]) for r, m in zip(labels, members, strict=True)}
        return actors, nodes

    def _shared_memory(self) -> bool:
        return self.shared_memory_moves and not self.use_gpu

    def stage_experts(
        self,
        epoch: int,
        moves: Sequence[Any],
        target: Any,
        *,
        members: Sequence[int],
        new_num_ranks: int,
        staging_id: int | None = None,
        timeout: float | None = None,
        background: bool = True,
        from_source: bool = False,
    ) -> int:
        members = list(members)
        return self._move_experts(
            "stage_experts",
            epoch,
            moves,
            members=members,
            call_all=True,
            timeout=timeout,
            background=background,
            call=lambda actor, i, lane, rest, parts: actor.stage_experts_shared.options(
                **lane
            ).remote(
                epoch,
                rest,
                target,
                parts,
                new_rank=(i if i < new_num_ranks else None),
                new_num_ranks=new_num_ranks,
                stage=staging_id,
                from_source=from_source,
            ),
        )

    def prestage_experts(
        self,
        epoch: int,
        moves: Sequence[Any],
        *,
        members: Sequence[int],
        timeout: float | None = None,
    ) -> int:
        return self._move_experts(
            "prestage_experts",
            epoch,
            moves,
            members=list(members),
            call_all=False,
            timeout=timeout,
            background=True,
            call=lambda actor, _i, lane, rest, parts: actor.prestage_experts_shared.options(
                **lane
            ).remote(epoch, rest, parts),
        )

    def _move_experts(
        self,
        what: str,
        epoch: int,
        moves: Sequence[Any],
        *,
        members: list[int],
        call_all: bool,
        timeout: float | None,
        background: bool,
        call: Callable[[Any, int, dict[str, Any], list[Any], list[Any]], Any],
    ) -> int:
        """The moves between co-located members through the object store (exports on the
        senders' `EXPORT_LANE`), the rest over epoch's transfer group; `call(actor, member
        index, its lane options, the other moves, export refs for it)` starts each member's part. Members are
        all called (`call_all`, or when some moves use the transfer group), else only the
        destinations of the moves. Returns the bytes received."""
        actors, nodes = self._actors_and_nodes(members)
        if self._shared_memory():
            shared, rest = ray_transfer.split_moves(moves, members, nodes.__getitem__)
        else:
            shared, rest = {}, list(moves)
        lane: dict[str, Any] = {"concurrency_group": ray_actor.CTL_LANE} if background else {}
        export = {"concurrency_group": ray_actor.EXPORT_LANE}
        started = time.monotonic()
        refs = [
            (pair, actors[pair[0]].export_experts.options(**export).remote(keys))
            for pair, keys in ray_transfer.exporters(shared)
        ]
        if call_all or rest:
            called = list(members)
        else:
            wanted = {dst for (_, dst) in shared}
            called = [r for r in members if r in wanted]
        calls = [
            call(actors[r], i, lane, rest, ray_transfer.received_by(refs, r))
            for i, r in enumerate(members)
            if r in called
        ]
        received = ray_actor.get_all(calls, called, what=what, timeout=timeout)
        log.info(
            "%s on ranks %s in %.2fs: %d moves through shared memory (%d exports), %d over the "
            "transfer group of epoch %d",
            what,
            called,
            time.monotonic() - started,
            sum(len(m) for m in shared.values()),
            len(refs),
            len(rest),
            epoch,
        )
        return int(sum(int(b) for b in received))

    def transfer_non_expert(
        self,
        epoch: int,
        *,
        members: Sequence[int],
        src_ranks: Sequence[int],
        dst_ranks: Sequence[int],
        timeout: float | None = None,
    ) -> int:
        members = list(members)
        actors, nodes = self._actors_and_nodes(members)
        senders = [members[i] for i in src_ranks]
        receivers = [members[i] for i in dst_ranks]
        local = {r: next((s for s in senders if nodes[s] == nodes[r]), None) for r in receivers}
        if not self._shared_memory() or any(s is None for s in local.values()):
            gloo = self.collective_rpc(
                "transfer_non_expert",
                epoch,
                ranks=members,
                timeout=timeout,
                background=True,
                src_ranks=list(src_ranks),
                dst_ranks=list(dst_ranks),
            )
            return int(sum(int(b) for b in gloo))
        lane = {"concurrency_group": ray_actor.CTL_LANE}
        exports = {
            s: actors[s].export_non_expert.options(**lane).remote()
            for s in set(local.values())
            if s is not None
        }
        calls = [
            actors[r].load_non_expert_shared.options(**lane).remote(exports[s])
            for r, s in local.items()
            if s is not None
        ]
        received = ray_actor.get_all(calls, receivers, what="load_non_expert", timeout=timeout)
        return int(sum(int(b) for b in received))
