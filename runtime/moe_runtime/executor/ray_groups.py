"""The groups of an epoch over `RayExecutor`'s rank actors (`RayGroups`, a part of it).

Rendezvous: a FileStore in `group_dir` when every member of the new group has one IP (nothing
listens on a port), else a TCPStore hosted by the group's rank 0 on a port it reports as free
(`RankGroups.free_port`, asked on its health lane). Each member joins on its control lane (in
the background) or its default lane (a recovery); `joins.gather_joins` fails the build at the
first member that fails or that the heartbeat loses, and calls the others off on their health
lane, where nothing queues.

Backends: the step group's is the executor's (NCCL on GPUs); the transfer group's is
`transfer_backend` ("auto": NCCL when every member is a GPU rank reporting the same NCCL
version, `RankWorker.info`, else gloo through pinned host memory: `comm.transfer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import ray

from moe_runtime.comm import group as group_mod
from moe_runtime.executor import joins, ray_actor, ray_calls, roster
from moe_runtime.rank import groups as groups_mod

log = logging.getLogger(__name__)

#: Values of the transfer groups' backend ("auto": see the module docstring).
TRANSFER_BACKENDS = ("auto", "gloo", "nccl")


class RayGroups:
    """Builds epochs' step and transfer groups over rank actors.

    members: the executor's roster; lost(): the labels its heartbeat lost; step_backend /
    transfer_backend: the backends of the two groups; rendezvous: "auto", "tcp" or "file";
    group_dir: where FileStores live.
    """

    def __init__(
        self,
        *,
        members: roster.Roster[ray_actor.RankHandle],
        lost: Callable[[], Collection[int]],
        step_backend: group_mod.Backend,
        transfer_backend: str,
        rendezvous: str,
        group_dir: str,
    ) -> None:
        self._members = members
        self._lost = lost
        self._step_backend = step_backend
        self._transfer_backend = transfer_backend
        self._rendezvous = rendezvous
        self._group_dir = group_dir

    def build(
        self,
        ranks: Sequence[int],
        *,
        epoch: int,
        timeout: float | None,
        background: bool,
        step_op_timeout: float | None,
    ) -> None:
        """See `base.Executor.build_groups`."""
        members = self._members.targets("build_groups", ranks)
        one_host = self._rendezvous == "file" or (
            self._rendezvous == "auto" and len({m.info["ip"] for m in members}) == 1
        )
        lane = {"concurrency_group": ray_actor.CTL_LANE} if background else {}
        for role in groups_mod.ROLES:
            spec = self._spec(members, epoch=epoch, role=role, one_host=one_host)
            started = time.monotonic()
            handles = {
                m.label: m.handle.actor.execute_method.options(**lane).remote(
                    "join_group",
                    spec,
                    rank=i,
                    role=role,
                    group_timeout=timeout,
                    op_timeout=step_op_timeout if role == groups_mod.STEP else None,
                )
                for i, m in enumerate(members)
            }
            joins.gather_joins(
                handles,
                self._join_calls(members, epoch),
                what=f"join_group (epoch {epoch}, {role})",
                timeout=timeout,
            )
            log.info(
                "epoch %d %s group over ranks %s built in %.2fs (%s)",
                epoch,
                role,
                list(ranks),
                time.monotonic() - started,
                "FileStore" if one_host else f"TCPStore {spec.host}:{spec.port}",
            )

    def _spec(
        self, members: Sequence[ray_actor.Member], *, epoch: int, role: str, one_host: bool
    ) -> group_mod.GroupSpec:
        backend = self._backend(role, members)
        if one_host:
            return group_mod.GroupSpec.local(
                len(members), epoch=epoch, backend=backend, directory=self._group_dir
            )
        host, port = ray.get(
            members[0]
            .handle.actor.free_port.options(concurrency_group=ray_actor.HEALTH_LANE)
            .remote(),
            timeout=30,
        )
        return group_mod.GroupSpec.tcp(host, port, len(members), epoch=epoch, backend=backend)

    def _backend(self, role: str, members: Sequence[ray_actor.Member]) -> group_mod.Backend:
        if role == groups_mod.STEP:
            return self._step_backend
        if self._transfer_backend in ("gloo", "nccl"):
            return "nccl" if self._transfer_backend == "nccl" else "gloo"
        return "nccl" if nccl_compatible([m.info for m in members]) else "gloo"

    def _join_calls(self, members: Sequence[ray_actor.Member], epoch: int) -> joins.JoinCalls[Any]:
        actors = {m.label: m.handle.actor for m in members}

        def wait(pending: list[Any], timeout: float) -> list[Any]:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            return list(done)

        def result(label: int, ref: Any) -> object:
            return ray_calls.get_all([ref], [label], what="join_group", timeout=0)[0]

        def abort(labels: list[int]) -> None:
            health = {"concurrency_group": ray_actor.HEALTH_LANE}
            refs = [
                actors[r].execute_method.options(**health).remote("abort_join", epoch)
                for r in labels
            ]
            ray.wait(refs, num_returns=len(refs), timeout=joins.ABORT_GRACE_SECONDS)

        return joins.JoinCalls(wait=wait, result=result, abort=abort, lost=self._lost)


def nccl_compatible(infos: Sequence[Any]) -> bool:
    """Every member is a GPU rank and all report one NCCL version (`RankWorker.info`): they can
    share an NCCL communicator. Pure."""
    versions = {i.get("nccl") for i in infos}
    gpus = all(str(i.get("device", "")).startswith("cuda") for i in infos)
    return bool(infos) and gpus and len(versions) == 1 and None not in versions
