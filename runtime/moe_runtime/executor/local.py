"""`LocalExecutor`: every rank is a `RankWorker` in this process, each on its own thread.

The fast path for unit tests of the engine and the resize coordinator: no Ray, real gloo groups
(FileStore rendezvous in a private temporary directory, loopback connections). A step runs
every rank's `execute_step` at once on one thread per rank, because the expert collectives need
every rank inside them together. Control calls (`collective_rpc`) also run one thread per rank;
with `background=True` they may overlap steps, as on Ray.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moe_runtime import step as step_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.executor import base, joins
from moe_runtime.executor import health as health_mod
from moe_runtime.rank import hooks as hooks_mod
from moe_runtime.rank import worker as worker_mod

log = logging.getLogger(__name__)


class LocalExecutor(base.Executor):
    """`num_ranks` in-process ranks (see the module docstring)."""

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
        self._lock = threading.Lock()
        self._workers: dict[int, worker_mod.RankWorker] = {}
        self._health: dict[int, health_mod.RankHealth] = {}  # by id() of the worker
        self._uid: dict[int, int] = {}  # id() of the worker -> its uid in rank_infos
        self._active: list[int] = []
        self.clock = health_mod.StepClock()
        for label in range(num_ranks):
            self._workers[label] = self._new_worker(label)
        self._active = list(range(num_ranks))
        self._needs_switch = False  # an active rank was removed: steps wait for a switch
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

    def _new_worker(self, label: int) -> worker_mod.RankWorker:
        hooks = None if self._rank_hooks is None else self._rank_hooks()
        w = worker_mod.RankWorker(device=self._device, dtype=self._dtype, label=label, hooks=hooks)
        self._uid[id(w)] = len(self._uid)
        return w

    # -- ranks ---------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        with self._lock:
            return list(self._active)

    @property
    def pending_ranks(self) -> list[int]:
        with self._lock:
            return sorted(r for r in self._workers if r not in self._active)

    def rank_infos(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            workers = dict(self._workers)
        return {
            label: {**w.info(), "label": label, "uid": self._uid.get(id(w))}
            for label, w in sorted(workers.items())
        }

    def worker(self, rank: int) -> worker_mod.RankWorker:
        """The worker object labelled `rank` (tests inspect it directly)."""
        with self._lock:
            return self._workers[rank]

    # -- calls ---------------------------------------------------------------------------
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
        with self._lock:
            targets, workers = base.rpc_targets(
                method, ranks, active=self._active, members=self._workers
            )
        self._check_fenced(targets, workers, what=method)
        futures = []
        for label, w in zip(targets, workers, strict=True):
            extra = base.extra_kwargs(per_rank, label)
            futures.append(self._submit(w.call, method, *args, **kwargs, **extra))
        return _gather(futures, targets, what=method, timeout=timeout)

    def execute_step(self, step: step_mod.StepInput) -> list[step_mod.StepOutput]:
        with self._lock:
            active = list(self._active)
            workers = [self._workers[r] for r in active]
        if not workers or self._needs_switch:
            raise base.ExecutorError("no step path: switch to a set of ranks first")
        self._check_fenced(active, workers, what="execute_step")
        self.clock.begin()
        futures = [self._submit(w.execute_step, step) for w in workers]
        try:
            outs: list[step_mod.StepOutput] = _gather(
                futures, active, what="execute_step", timeout=self._step_timeout
            )
        except BaseException:
            self.clock.end(ok=False)
            raise
        self.clock.end(ok=True)
        return outs

    def _check_fenced(
        self, labels: Sequence[int], workers: Sequence[worker_mod.RankWorker], *, what: str
    ) -> None:
        dead = [r for r, w in zip(labels, workers, strict=True) if self._health_of(w).fenced]
        if dead:
            raise base.RankDied(f"{what}: ranks {dead} were fenced", ranks=dead)

    def _health_of(self, w: worker_mod.RankWorker) -> health_mod.RankHealth:
        with self._lock:
            return self._health.setdefault(id(w), health_mod.RankHealth())

    def has_step_path(self) -> bool:
        with self._lock:
            return bool(self._active) and not self._needs_switch

    def _health_members(self) -> dict[int, health_mod.RankHealth]:
        with self._lock:
            workers = dict(self._workers)
        return {label: self._health_of(w) for label, w in workers.items()}

    def _send_ping(self, label: int) -> Any:
        with self._lock:
            w = self._workers[label]
        if self._health_of(w).fenced:
            failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
            failed.set_exception(base.RankDied(f"rank {label} was fenced", ranks=[label]))
            return failed
        return self._submit(w.ping)

    def _poll_ping(self, handle: Any) -> str | None:
        if not handle.done():
            return None
        return health_mod.HEALTH_DEAD if handle.exception() is not None else health_mod.HEALTH_OK

    def fence(self, ranks: Sequence[int], *, reason: str = "fenced") -> None:
        now = time.monotonic()
        with self._lock:
            workers = [self._workers[r] for r in ranks if r in self._workers]
        for w in workers:
            h = self._health_of(w)
            h.lose(health_mod.HEALTH_DEAD, reason, now)
            h.fenced = True
        log.error("fenced ranks %s: %s", list(ranks), reason)

    # -- elastic primitives --------------------------------------------------------------
    def add_ranks(
        self, count: int, *, timeout: float | None = None, spare: bool = False
    ) -> list[int]:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._lock:
            start = max(self._workers, default=-1) + 1
            labels = list(range(start, start + count))
            for label in labels:
                self._workers[label] = self._new_worker(label)
        log.info("added ranks %s (pending)", labels)
        return labels

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
            targets, workers = base.rpc_targets(
                "join_group", ranks, active=self._active, members=self._workers
            )
        self._check_fenced(targets, workers, what="join_group")
        by_label = dict(zip(targets, workers, strict=True))

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

        calls = joins.JoinCalls(wait=wait, result=result, abort=abort, lost=self.lost_ranks)
        for role in base.GROUP_ROLES:
            spec = group_mod.GroupSpec.local(
                len(ranks), epoch=epoch, backend=self._backend, directory=self._tmp
            )
            handles = {
                r: self._submit(
                    by_label[r].groups.join_group, spec, i, role=role, group_timeout=timeout
                )
                for i, r in enumerate(targets)
            }
            joins.gather_joins(
                handles, calls, what=f"join_group (epoch {epoch}, {role})", timeout=timeout
            )

    def switch(
        self,
        ranks: Sequence[int],
        *,
        epoch: int | None = None,
        placement: Any = None,
        timeout: float | None = None,
    ) -> None:
        ranks = list(ranks)
        with self._lock:
            mapping = base.check_switch(ranks, live=list(self._workers))
        if epoch is not None:
            try:
                self.collective_rpc(
                    "activate",
                    epoch,
                    ranks=ranks,
                    timeout=timeout,
                    per_rank={r: {"rank": i} for i, r in enumerate(ranks)},
                    num_ranks=len(ranks),
                    placement=placement,
                )
            except BaseException:
                # Back to the old ranks' state: whoever activated the epoch reverts it.
                live = [r for r in ranks if not self._health_of(self._workers[r]).fenced]
                self.collective_rpc("revert", epoch, ranks=live, timeout=timeout)
                raise
        with self._lock:
            self._workers = {mapping[old]: w for old, w in self._workers.items()}
            self._active = list(range(len(ranks)))
            self._needs_switch = False
            for label, w in self._workers.items():
                w.set_label(label)
        log.info("switched to %d ranks (old labels %s)", len(ranks), ranks)

    def remove_ranks(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        infos: list[dict[str, Any]] = []
        with self._lock:
            unknown = [r for r in ranks if r not in self._workers]
            if unknown:
                raise ValueError(f"remove_ranks: no worker for ranks {unknown}")
            removed = [(r, self._workers.pop(r)) for r in ranks]
            if any(r in self._active for r in ranks):
                self._needs_switch = True
            self._active = [r for r in self._active if r not in ranks]
        for label, w in removed:
            info = w.info()
            info["label"] = label
            w.shutdown()
            infos.append(info)
        log.info("removed ranks %s", list(ranks))
        return infos

    def check_health(self, *, timeout: float = 5.0) -> dict[int, str]:
        with self._lock:
            workers = dict(self._workers)
        futures = {label: self._send_ping(label) for label in workers}
        done, _ = concurrent.futures.wait(futures.values(), timeout=timeout)
        report = {}
        for label, f in sorted(futures.items()):
            if f not in done:
                report[label] = health_mod.HEALTH_UNRESPONSIVE
            else:
                report[label] = self._poll_ping(f) or health_mod.HEALTH_UNRESPONSIVE
        return report

    def shutdown(self) -> None:
        self.stop_heartbeat()
        if self._closed:
            return
        self._closed = True
        with self._lock:
            workers = list(self._workers.values())
            self._workers = {}
            self._active = []
        for w in workers:
            w.shutdown()
        self._close_async_pool()
        shutil.rmtree(self._tmp, ignore_errors=True)


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
