"""Stateless communication groups: one object per (member set, epoch), no torch.distributed globals.

A ``StatelessGroup`` owns its rendezvous store and a torch c10d backend (``ProcessGroupGloo`` for
CPU tensors, ``ProcessGroupNCCL`` for CUDA tensors) built directly, without
``torch.distributed.init_process_group``. So several groups live side by side in one process:
the active group keeps serving while a standby group over the new member set is built, and the
old one is destroyed after the switch. Groups are always passed explicitly; there is no default
group.

Glossary (for the expert-parallel users of these groups): a *logical expert* is one of the
model's E experts of a layer; a *physical expert* or *slot* holds one logical expert's weights on
one rank; a *redundant expert* is a slot beyond the first E; a *replica* is any slot holding the
same logical expert. Group ranks are the expert-parallel ranks: rank r holds slots
``[r * P/N, (r + 1) * P/N)``.

Rendezvous: either a FileStore (all members on one host: nothing listens on any port) or a
TCPStore hosted by group rank 0 on ``host:port`` and bound to that address only (not to every
interface). The coordinator obtains the port from rank 0 with ``free_port(host)`` beforehand.
Gloo's own connections are bound to ``127.0.0.1`` for local groups.

Joining is cancellable: before the backend is built, every member announces itself in the store
and waits, in short polls, until all have (``wait_for_members``). A member that never comes (its
process died, its pod was lost) makes the others fail with ``JoinTimeout`` naming it, or sooner
with ``JoinAborted`` once whoever drives the join says so (``aborted``). The c10d backend's own
rendezvous, which cannot be interrupted, only starts once every member is there.

Failures (`semantics`: what differs between gloo and NCCL): a group whose communicator failed
(a peer gone, an op timed out, `abort` called) is aborted and raises `semantics.GroupFailed` at
its next call or `check`; it never serves again (a new epoch's groups replace it). `abort`
never waits on a peer; `destroy` aborts too (no waiting ``shutdown()``). The op timeout of a
group (``op_timeout``) is apart from its join timeout: the step group's comes from observed
step times (`moe_runtime.executor.health.StepClock.group_timeout`).

Tensor shapes are the caller's; each method states how its arguments relate (W = world size).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from moe_runtime.comm import semantics as semantics_mod

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
LOOPBACK = "127.0.0.1"
#: Longest wait between two looks at the store while members gather (the first are shorter).
MEMBER_POLL_SECONDS = 0.05
#: Longest single attempt of a TCPStore client to reach rank 0's store (retried until the
#: join's timeout, looking at `aborted` between attempts).
CONNECT_ATTEMPT_SECONDS = 1.0
#: Seconds a group's join (and, unless its op_timeout says otherwise, each op) may take.
DEFAULT_TIMEOUT = 300.0


class JoinAborted(RuntimeError):
    """The join was called off (`aborted` said so) before every member came."""


class JoinTimeout(TimeoutError):
    """Members did not come within the join's timeout; `missing` names them (group ranks)."""

    def __init__(self, message: str, *, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` now (bound then released); rank 0 of a group calls it
    on its own host so the coordinator can put it in the ``GroupSpec``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join one group; pickles (sent to every rank actor).

    host, port: TCPStore hosted by group rank 0 (ignored when store_path is set).
    world_size: members, ranks 0..world_size-1.
    epoch: which group generation this is; keys of different epochs never mix.
    backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
    store_path: FileStore path, used instead of TCP when every member runs on one host.
    namespace: a prefix of this group's keys in the store, so that several groups of one
        epoch can meet in one store (a pipeline stage's group in its leaders' store).
    hosted: whether group rank 0 hosts the TCPStore (False: every member is a client of a
        store another group's rank 0 hosts on host:port, and that group outlives the join).
    """

    host: str
    port: int
    world_size: int
    epoch: int
    backend: Backend = "gloo"
    store_path: str | None = None
    namespace: str = ""
    hosted: bool = True

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.store_path is None and not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535 for a TCP rendezvous, got {self.port}")

    @classmethod
    def local(
        cls,
        world_size: int,
        *,
        epoch: int,
        backend: Backend = "gloo",
        directory: str | None = None,
    ) -> GroupSpec:
        """A group whose members all run on this host: FileStore rendezvous, loopback gloo."""
        base = directory or tempfile.gettempdir()
        path = os.path.join(base, f"elastic-moe-group-e{epoch}-{uuid.uuid4().hex}")
        return cls(LOOPBACK, 0, world_size, epoch, backend, path)

    @classmethod
    def tcp(
        cls, host: str, port: int, world_size: int, *, epoch: int, backend: Backend = "gloo"
    ) -> GroupSpec:
        """A group whose rank 0 hosts a TCPStore on host:port (see ``free_port``)."""
        return cls(host, port, world_size, epoch, backend, None)

    @property
    def is_local(self) -> bool:
        return self.store_path is not None or self.host in (LOOPBACK, "localhost")


class Work:
    """A point-to-point op in flight: ``wait()`` as the group's semantics wait."""

    def __init__(self, group: StatelessGroup, work: Any) -> None:
        self.group = group
        self.work = work

    def wait(self) -> None:
        self.group.semantics.wait(self.work, self.group)


class StatelessGroup:
    """One member of one group: collectives and point-to-point over its own c10d backend.

    Every call blocks until done (``wait()``), except ``isend``/``irecv`` which return the work
    handle. All members must make the same collective calls in the same order.

    The constructor joins (see the module docstring): timeout bounds the wait for the other
    members (and every later collective unless op_timeout is given); aborted, polled while
    members gather, calls the join off (``JoinAborted``). high_priority: the backend's
    collectives go first on the device (NCCL: a high-priority stream; the step group's).
    """

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        op_timeout: float | None = None,
        bind_host: str | None = None,
        aborted: Callable[[], bool] | None = None,
        high_priority: bool = False,
    ) -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank must be in [0, {spec.world_size}), got {rank}")
        if op_timeout is not None and op_timeout <= 0:
            raise ValueError(f"op_timeout must be > 0 seconds, got {op_timeout}")
        self.spec = spec
        self.rank = rank
        self.world_size = spec.world_size
        self.timeout = datetime.timedelta(seconds=timeout)
        #: Seconds one op (collective or point to point) may take before it fails the group.
        self.op_timeout = float(timeout if op_timeout is None else op_timeout)
        self.semantics = semantics_mod.for_backend(spec.backend)
        #: Set once the group is aborted (by `abort`, or by its backend's failure).
        self.aborted = threading.Event()
        self.failure: str | None = None
        #: Called once by the first `abort` or `destroy` (`comm.shm`: its peers' waits end).
        self.on_abort: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._destroyed = False
        deadline = time.monotonic() + timeout
        self._aborted = aborted or (lambda: False)
        self._check_join(deadline, missing=lambda: list(range(spec.world_size)))  # called off?
        self._store: Any = c10d.PrefixStore(
            f"elastic-moe/epoch-{spec.epoch}/{spec.namespace}", self._make_store(deadline)
        )
        self.wait_for_members(deadline)
        self._pg: Any = self._make_backend(bind_host, high_priority=high_priority)

    @property
    def device(self) -> torch.device:
        """Where tensors given to this group must live."""
        if self.spec.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # --- construction ---------------------------------------------------------------------

    def wait_for_members(self, deadline: float) -> None:
        """Announce this member in the store, then wait until every member has (or JoinAborted /
        JoinTimeout)."""
        self._store.set(f"members/{self.rank}", "1")
        keys = [f"members/{r}" for r in range(self.world_size)]

        def missing() -> list[int]:
            return [r for r, key in enumerate(keys) if not self._store.check([key])]

        pause = 0.002
        while not self._store.check(keys):
            self._check_join(deadline, missing=missing)
            time.sleep(pause)
            pause = min(pause * 2, MEMBER_POLL_SECONDS)

    def _check_join(self, deadline: float, *, missing: Callable[[], list[int]]) -> None:
        """JoinAborted if called off; past the deadline, JoinTimeout naming `missing()` (the
        group ranks not there)."""
        if self._aborted():
            raise JoinAborted(f"{self._what()}: the join was called off")
        if time.monotonic() >= deadline:
            absent = missing()
            raise JoinTimeout(
                f"{self._what()}: members {absent} did not join within "
                f"{self.timeout.total_seconds():g}s",
                missing=absent,
            )

    def _what(self) -> str:
        return (
            f"group of epoch {self.spec.epoch} (member {self.rank} of {self.world_size}, "
            f"{self.spec.backend})"
        )

    def _make_store(self, deadline: float) -> c10d.Store:
        spec = self.spec
        if spec.store_path is not None:
            return c10d.FileStore(spec.store_path, spec.world_size)
        if self.rank == 0 and spec.hosted:
            # Listen on spec.host only: TCPStore alone would bind every interface.
            # The store takes ownership of the listening descriptor (detach).
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listen:
                listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listen.bind((spec.host, spec.port))
                listen.listen(max(128, spec.world_size))
                listen_fd = listen.detach()
            # No wait for the workers here (it cannot be called off): wait_for_members does it.
            return c10d.TCPStore(
                spec.host,
                spec.port,
                spec.world_size,
                True,
                self.timeout,
                wait_for_workers=False,
                master_listen_fd=listen_fd,
            )
        while True:  # short attempts, so that a call-off is seen while rank 0 is not there
            attempt = min(CONNECT_ATTEMPT_SECONDS, max(0.05, deadline - time.monotonic()))
            try:
                store = c10d.TCPStore(
                    spec.host,
                    spec.port,
                    spec.world_size,
                    False,
                    datetime.timedelta(seconds=attempt),
                    wait_for_workers=False,
                )
            except (RuntimeError, TimeoutError):  # DistNetworkError / DistStoreError
                self._check_join(deadline, missing=lambda: [0])  # rank 0's store is not up
                continue
            store.set_timeout(self.timeout)
            return store

    def _make_backend(self, bind_host: str | None, *, high_priority: bool) -> Any:
        spec = self.spec
        op_timeout = datetime.timedelta(seconds=self.op_timeout)
        self.semantics.prepare()
        if spec.backend == "gloo":
            gloo: Any = c10d.ProcessGroupGloo
            opts = gloo._Options()
            opts._timeout = op_timeout
            host = bind_host or (LOOPBACK if spec.is_local else "")
            device = gloo.create_device(hostname=host) if host else gloo.create_default_device()
            opts._devices = [device]
            self.semantics.options(opts, high_priority=high_priority)
            return gloo(self._store, self.rank, spec.world_size, opts)
        nccl_opts = c10d.ProcessGroupNCCL.Options()
        nccl_opts._timeout = op_timeout
        self.semantics.options(nccl_opts, high_priority=high_priority)
        pg = c10d.ProcessGroupNCCL(self._store, self.rank, spec.world_size, nccl_opts)
        pg._set_sequence_number_for_group()
        self.semantics.connect(pg, self.device)
        return pg

    # --- collectives ------------------------------------------------------------------------

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        """Rows of ``input`` [sum(input_split_sizes), ...] go to ranks in order; ``output``
        [sum(output_split_sizes), ...] receives each rank's rows in rank order. None = equal
        splits of dim 0 into W parts. Zero-row splits (and empty tensors) are fine."""
        pg = self._open()
        self._wait(
            pg.alltoall_base(
                output, input, list(output_split_sizes or []), list(input_split_sizes or [])
            )
        )

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on all ranks), in rank order."""
        out = torch.empty(
            (self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
        )
        self.all_gather_into(out, tensor)
        return list(out.unbind(0))

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """output [W * n, ...] (or [W, n, ...]) <- every rank's tensor [n, ...], in rank order."""
        pg = self._open()
        if output.numel() != tensor.numel() * self.world_size:
            raise ValueError(
                f"output must hold world_size ({self.world_size}) x tensor "
                f"{tuple(tensor.shape)}, got {tuple(output.shape)}"
            )
        if not output.is_contiguous():
            raise ValueError("output must be contiguous")
        # gloo splits the output along dim 0 and wants each chunk shaped like the input: flatten.
        self._wait(pg._allgather_base(output.view(-1), tensor.reshape(-1).contiguous()))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In place: ``tensor`` becomes the reduction over ranks (op: sum, max, min, product)."""
        pg = self._open()
        ops = {
            "sum": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
            "product": dist.ReduceOp.PRODUCT,
        }
        if op not in ops:
            raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
        opts = dist.AllreduceOptions()
        opts.reduceOp = ops[op]
        self._wait(pg.allreduce([tensor], opts))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place: every rank's ``tensor`` becomes rank ``src``'s (same shape and dtype)."""
        pg = self._open()
        self._check_peer(src, "src")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._wait(pg.broadcast([tensor], opts))

    def barrier(self) -> None:
        pg = self._open()
        if self.spec.backend == "nccl":
            self.all_reduce(torch.zeros(1, device=self.device))
            torch.cuda.synchronize()
            self.check()
            return
        self._wait(pg.barrier())

    # --- point to point -----------------------------------------------------------------------

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Starts sending a contiguous ``tensor`` to ``dst``; returns the work (``.wait()``)."""
        pg = self._open()
        self._check_peer(dst, "dst")
        return Work(self, pg.send([tensor.contiguous()], dst, tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Starts receiving into contiguous ``tensor`` from ``src``; returns the work."""
        pg = self._open()
        self._check_peer(src, "src")
        return Work(self, pg.recv([tensor], src, tag))

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    # --- failures -------------------------------------------------------------------------

    def check(self) -> None:
        """GroupFailed when the group failed (see the module docstring); call it after a host
        read that waited for this group's ops (NCCL shows errors only there)."""
        if self.failure is None and not self._destroyed:
            with self._lock:
                pg = self._pg
            found = None if pg is None else self.semantics.error(pg)
            if found is not None:
                self.abort(found)
        if self.failure is not None:
            raise semantics_mod.GroupFailed(f"{self!r} failed: {self.failure}")

    def abort(self, reason: str = "aborted") -> None:
        """Abort the communicator now, whatever its peers do (never waits); later calls raise
        GroupFailed naming `reason` (the first one given). Idempotent, any thread: a thread
        waiting in one of this group's ops is released as its backend allows (NCCL: the
        kernel ends; gloo: when its peers let go, or at the op timeout)."""
        with self._lock:
            if self.failure is None:
                self.failure = reason
            pg, self._pg = self._pg, None
            first = not self.aborted.is_set()
        self.aborted.set()
        if first:
            self._tell_abort()
        if pg is None:
            return
        try:
            self.semantics.abort(pg)
        except Exception:  # noqa: BLE001 - the group is failed and let go whatever abort says
            log.exception("%r: abort failed", self)
        log.info("%r aborted: %s", self, self.failure)

    # --- lifetime -------------------------------------------------------------------------

    def destroy(self) -> None:
        """Releases the backend and the store (rank 0's listening socket with it) without
        waiting for any peer (an abort, never a waiting shutdown); idempotent."""
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
            pg, self._pg = self._pg, None
            self._store = None
        self._tell_abort()
        if pg is not None:
            try:
                self.semantics.abort(pg)
            except Exception:  # noqa: BLE001 - it is let go whatever abort says
                log.exception("%r: abort on destroy failed", self)

    def _tell_abort(self) -> None:
        hooks, self.on_abort = self.on_abort, []
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - the group is let go whatever a hook says
                log.exception("%r: an abort hook failed", self)

    def __repr__(self) -> str:
        return (
            f"StatelessGroup(epoch={self.spec.epoch}, rank={self.rank}/{self.world_size}, "
            f"backend={self.spec.backend})"
        )

    def _open(self) -> Any:
        """The backend; RuntimeError when destroyed, GroupFailed when failed."""
        with self._lock:
            pg, destroyed = self._pg, self._destroyed
        if destroyed:
            raise RuntimeError(f"{self!r} was destroyed")
        if pg is None or self.failure is not None:
            raise semantics_mod.GroupFailed(f"{self!r} failed: {self.failure}")
        return pg

    def _wait(self, work: Any) -> None:
        self.semantics.wait(work, self)

    def _check_peer(self, peer: int, name: str) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{name} must be in [0, {self.world_size}), got {peer}")


def nccl_version() -> str | None:
    """The NCCL version this process's torch runs ("2.27.3"), None without NCCL."""
    try:
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError):
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
