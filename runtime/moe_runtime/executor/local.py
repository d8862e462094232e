"""`LocalExecutor`: every rank is a `RankWorker` in this process, each on its own thread.

The fast path for unit tests of the engine and the resize coordinator: no Ray, real gloo groups
(FileStore rendezvous in a private temporary directory, loopback connections). A step runs
every rank's `execute_step` at once on one thread per rank, because the expert collectives need
every rank inside them together. Control calls (`collective_rpc`) also run one thread per rank;
with `background=True` they may overlap steps, as on Ray. The roster, heartbeat, switch and
weight moves are the parts `RayExecutor` uses too (`base`).

Each call runs on a thread of its own (`_submit`), never on a bounded pool: a collective over N
ranks needs all N inside it at once, and with a pool, calls queued behind the members of an
unfinished rendezvous would never start (a group join over more ranks than free pool threads
waited out its whole timeout).
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.executor import base, joins, roster
from moe_runtime.executor import health as health_mod
from moe_runtime.rank import groups as groups_mod
from moe_runtime.rank import hooks as hooks_mod
from moe_runtime.rank import worker as worker_mod

log = logging.getLogger(__name__)

Member = roster.Member[worker_mod.RankWorker]


class LocalExecutor(base.Executor):
    """`num_ranks` in-process ranks (see the module docstring).

    rank_hooks: a factory of hooks for every worker (`moe_runtime.rank.hooks`; tests install
    fault hooks with it).
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        step_timeout: float | None = 300.0,
        rank_hooks: hooks_mod.HooksFactory | None = None,
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self._device = device
        self._backend: group_mod.Backend = "nccl" if device.startswith("cuda") else "gloo"
        self._dtype = dtype
        self._step_timeout = step_timeout
        self._rank_hooks = rank_hooks
        self._tmp = tempfile.mkdtemp(prefix="elastic-moe-local-")
        members: roster.Roster[worker_mod.RankWorker] = roster.Roster()
        #: No step path after an active rank was removed, or a switch could not go back.
        self._path_lost = threading.Event()
        super().__init__(
            roster=members,
            groups=LocalGroups(
                members=members,
                submit=self._submit,
                lost=self.lost_ranks,
                backend=self._backend,
                directory=self._tmp,
            ),
        )
        members.add([self._new_worker(label) for label in range(num_ranks)], active=True)
        self._closed = False

    def _submit(
        self, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        """`fn(*args, **kwargs)` on a new thread (see the module docstring); its future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(exc)

        name = f"local-rank-{getattr(fn, '__name__', 'call')}"
        threading.Thread(target=run, name=name, daemon=True).start()
        return future

    def _new_worker(self, label: int) -> Member:
        hooks = None if self._rank_hooks is None else self._rank_hooks()
        w = worker_mod.RankWorker(device=self._device, dtype=self._dtype, label=label, hooks=hooks)
        return roster.Member(label=label, handle=w)

    # -- ranks ---------------------------------------------------------------------------
    def rank_infos(self) -> dict[int, dict[str, Any]]:
        """What every worker says now (`RankWorker.info`), with its label and uid."""
        return {
            label: {**m.handle.info(), **m.info}
            for label, m in sorted(self.roster.members().items())
        }

    def load_progress(self) -> list[dict[str, Any]]:
        return [m.handle.load_progress() for _, m in sorted(self.roster.members().items())]

    def worker(self, rank: int) -> worker_mod.RankWorker:
        """The worker object labelled `rank` (it runs in this process)."""
        worker: worker_mod.RankWorker = self.roster.member(rank).handle
        return worker

    # -- calls ---------------------------------------------------------------------------
    def _call(self, calls: base.Calls) -> list[Any]:
        members = [m for m, _ in calls.per_member]
        _check_fenced(members, what=calls.method)
        futures = [
            self._submit(m.handle.call, calls.method, *calls.args, **kw)
            for m, kw in calls.per_member
        ]
        return _gather(futures, calls.labels, what=calls.method, timeout=calls.timeout)

    def execute_step(self, step: step_mod.StepInput) -> list[step_mod.StepOutput]:
        members = self.roster.targets("execute_step", None)
        if not members or self._path_lost.is_set():
            raise base.ExecutorError("no step path: switch to a set of ranks first")
        _check_fenced(members, what="execute_step")
        clock = self.heartbeat.clock
        clock.begin()
        futures = [self._submit(m.handle.execute_step, step) for m in members]
        try:
            outs: list[step_mod.StepOutput] = _gather(
                futures, [m.label for m in members], what="execute_step", timeout=self._step_timeout
            )
        except BaseException:
            clock.end(ok=False)
            raise
        clock.end(ok=True)
        self.after_step(step, [m.label for m in members], outs)
        return outs

    def has_step_path(self) -> bool:
        return bool(self.ranks) and not self._path_lost.is_set()

    def _set_path(self) -> None:
        self._path_lost.clear()

    def _clear_path(self) -> None:
        self._path_lost.set()

    def _tell(self, members: list[Member]) -> None:
        for m in members:
            m.handle.set_label(m.label)

    def _poll_ping(self, handle: Any) -> str | None:
        """None while pending, dead when the ping raised (the worker was fenced), else ok."""
        if not handle.done():
            return None
        return health_mod.HEALTH_DEAD if handle.exception() is not None else health_mod.HEALTH_OK

    def _ping_error(self, handle: Any) -> str | None:
        exc = handle.exception() if handle.done() else None
        return str(exc) if isinstance(exc, worker_mod.RankFailed) else None

    def _send_abort(self, member: Member, reason: str) -> None:
        self._submit(member.handle.abort_live_groups, reason)

    def _send_ping(self, label: int) -> Any:
        m = self.roster.member(label)
        if m.health.fenced:
            failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
            failed.set_exception(base.RankDied(f"rank {label} was fenced", ranks=[label]))
            return failed
        return self._submit(m.handle.ping)

    def fence(self, ranks: Sequence[int], *, reason: str = "fenced") -> None:
        now = time.monotonic()
        members = self.roster.members()
        for r in ranks:
            if r in members:
                members[r].health.lose(health_mod.HEALTH_DEAD, reason, now)
                members[r].health.fenced = True
        log.error("fenced ranks %s: %s", list(ranks), reason)

    # -- elastic primitives --------------------------------------------------------------
    def add_ranks(
        self, count: int, *, timeout: float | None = None, spare: bool = False
    ) -> list[int]:
        labels = self.roster.reserve(count)
        try:
            started = [self._new_worker(label) for label in labels]
            for m in self.roster.add(started):
                m.handle.set_label(m.label)
        finally:
            self.roster.unreserve(labels)
        labels = [m.label for m in started]
        log.info("added ranks %s (pending)", labels)
        return labels

    def remove_ranks(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        stepped = set(self.ranks)
        removed = self.roster.remove(ranks)
        if stepped & set(ranks):
            self._path_lost.set()  # steps wait for a switch
        infos: list[dict[str, Any]] = []
        for m in removed:
            info = m.handle.info()
            info["label"] = m.label
            m.handle.shutdown()
            infos.append(info)
        log.info("removed ranks %s", list(ranks))
        return infos

    def check_health(self, *, timeout: float = 5.0) -> dict[int, str]:
        futures = {label: self._send_ping(label) for label in self.roster.members()}
        done, _ = concurrent.futures.wait(futures.values(), timeout=timeout)
        report = {}
        for label, f in sorted(futures.items()):
            if f not in done:
                report[label] = health_mod.HEALTH_UNRESPONSIVE
            else:
                report[label] = self._poll_ping(f) or health_mod.HEALTH_UNRESPONSIVE
        return report

    def shutdown(self) -> None:
        self._close()
        if self._closed:
            return
        self._closed = True
        for m in self.roster.clear():
            m.handle.shutdown()
        shutil.rmtree(self._tmp, ignore_errors=True)


class LocalGroups:
    """Builds an epoch's groups over in-process workers (`base.GroupBuilder`): a FileStore
    rendezvous in `directory`, every member's join on a thread of its own (`submit`), a call-off
    through the members' `abort_join` (`joins`)."""

    def __init__(
        self,
        *,
        members: roster.Roster[worker_mod.RankWorker],
        submit: Callable[..., concurrent.futures.Future[Any]],
        lost: Callable[[], Collection[int]],
        backend: group_mod.Backend,
        directory: str,
    ) -> None:
        self._members = members
        self._submit = submit
        self._lost = lost
        self._backend = backend
        self._directory = directory

    def build(
        self,
        ranks: Sequence[int],
        *,
        epoch: int,
        timeout: float | None,
        background: bool,
        step_op_timeout: float | None,
    ) -> None:
        members = self._members.targets("join_group", ranks)
        _check_fenced(members, what="join_group")
        by_label = {m.label: m.handle for m in members}

        def wait(pending: list[Any], timeout: float) -> list[Any]:
            done, _ = concurrent.futures.wait(
                pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )
            return list(done)

        def result(label: int, future: Any) -> object:
            return _gather([future], [label], what="join_group", timeout=0)[0]

        def abort(labels: list[int]) -> None:
            for label in labels:
                by_label[label].groups.abort_join(epoch)

        calls = joins.JoinCalls(wait=wait, result=result, abort=abort, lost=self._lost)
        for role in groups_mod.ROLES:
            spec = group_mod.GroupSpec.local(
                len(members), epoch=epoch, backend=self._backend, directory=self._directory
            )
            handles = {
                m.label: self._submit(
                    m.handle.groups.join_group,
                    spec,
                    i,
                    role=role,
                    group_timeout=timeout,
                    op_timeout=step_op_timeout if role == groups_mod.STEP else None,
                )
                for i, m in enumerate(members)
            }
            joins.gather_joins(
                handles, calls, what=f"join_group (epoch {epoch}, {role})", timeout=timeout
            )


def _check_fenced(members: Sequence[Member], *, what: str) -> None:
    dead = [m.label for m in members if m.health.fenced]
    if dead:
        raise base.RankDied(f"{what}: ranks {dead} were fenced", ranks=dead)


def _gather(
    futures: Sequence[concurrent.futures.Future[Any]],
    ranks: Sequence[int],
    *,
    what: str,
    timeout: float | None,
) -> list[Any]:
    done, pending = concurrent.futures.wait(futures, timeout=timeout)
    if pending:
        late = [r for r, f in zip(ranks, futures, strict=True) if f in pending]
        raise TimeoutError(f"{what}: ranks {late} did not answer within {timeout}s")
    results = []
    for rank, future in zip(ranks, futures, strict=True):
        exc = future.exception()
        if exc is not None:
            raise base.ExecutorError(f"{what} failed on rank {rank}: {exc}", ranks=[rank]) from exc
        results.append(future.result())
    return results
