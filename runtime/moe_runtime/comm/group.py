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

Tensor shapes are the caller's; each method states how its arguments relate (W = world size).
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

Backend = Literal["gloo", "nccl"]
LOOPBACK = "127.0.0.1"
#: Longest wait between two looks at the store while members gather (the first are shorter).
MEMBER_POLL_SECONDS = 0.05
#: Longest single attempt of a TCPStore client to reach rank 0's store (retried until the
#: join's timeout, looking at `aborted` between attempts).
CONNECT_ATTEMPT_SECONDS = 1.0


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
    """

    host: str
    port: int
    world_size: int
    epoch: int
    backend: Backend = "gloo"
    store_path: str | None = None

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


class StatelessGroup:
    """One member of one group: collectives and point-to-point over its own c10d backend.

    Every call blocks until done (``wait()``), except ``isend``/``irecv`` which return the work
    handle. All members must make the same collective calls in the same order.

    The constructor joins (see the module docstring): timeout bounds the wait for the other
    members and every later collective; aborted, polled while members gather, calls the join
    off (``JoinAborted``).
    """

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        *,
        timeout: float = 300.0,
        bind_host: str | None = None,
        aborted: Callable[[], bool] | None = None,
    ) -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank must be in [0, {spec.world_size}), got {rank}")
        self.spec = spec
        self.rank = rank
        self.world_size = spec.world_size
        self.timeout = datetime.timedelta(seconds=timeout)
        deadline = time.monotonic() + timeout
        self._aborted = aborted or (lambda: False)
        self._check_join(deadline, missing=lambda: list(range(spec.world_size)))  # called off?
        self._store: Any = c10d.PrefixStore(
            f"elastic-moe/epoch-{spec.epoch}/", self._make_store(deadline)
        )
        self.wait_for_members(deadline)
        self._pg: Any = self._make_backend(bind_host)
        self._destroyed = False

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
        if self.rank == 0:
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

    def _make_backend(self, bind_host: str | None) -> Any:
        spec = self.spec
        if spec.backend == "gloo":
            gloo: Any = c10d.ProcessGroupGloo
            opts = gloo._Options()
            opts._timeout = self.timeout
            host = bind_host or (LOOPBACK if spec.is_local else "")
            device = gloo.create_device(hostname=host) if host else gloo.create_default_device()
            opts._devices = [device]
            return gloo(self._store, self.rank, spec.world_size, opts)
        nccl_opts = c10d.ProcessGroupNCCL.Options()
        nccl_opts._timeout = self.timeout
        pg = c10d.ProcessGroupNCCL(self._store, self.rank, spec.world_size, nccl_opts)
        pg._set_sequence_number_for_group()
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
        self._check_open()
        self._pg.alltoall_base(
            output, input, list(output_split_sizes or []), list(input_split_sizes or [])
        ).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on all ranks), in rank order."""
        out = torch.empty(
            (self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
        )
        self.all_gather_into(out, tensor)
        return list(out.unbind(0))

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """output [W * n, ...] (or [W, n, ...]) <- every rank's tensor [n, ...], in rank order."""
        self._check_open()
        if output.numel() != tensor.numel() * self.world_size:
            raise ValueError(
                f"output must hold world_size ({self.world_size}) x tensor "
                f"{tuple(tensor.shape)}, got {tuple(output.shape)}"
            )
        if not output.is_contiguous():
            raise ValueError("output must be contiguous")
        # gloo splits the output along dim 0 and wants each chunk shaped like the input: flatten.
        self._pg._allgather_base(output.view(-1), tensor.reshape(-1).contiguous()).wait()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In place: ``tensor`` becomes the reduction over ranks (op: sum, max, min, product)."""
        self._check_open()
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
        self._pg.allreduce([tensor], opts).wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place: every rank's ``tensor`` becomes rank ``src``'s (same shape and dtype)."""
        self._check_open()
        self._check_peer(src, "src")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        self._check_open()
        if self.spec.backend == "nccl":
            self.all_reduce(torch.zeros(1, device=self.device))
            torch.cuda.synchronize()
            return
        self._pg.barrier().wait()

    # --- point to point -----------------------------------------------------------------------

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        """Starts sending a contiguous ``tensor`` to ``dst``; returns the work (``.wait()``)."""
        self._check_open()
        self._check_peer(dst, "dst")
        return self._pg.send([tensor.contiguous()], dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Any:
        """Starts receiving into contiguous ``tensor`` from ``src``; returns the work."""
        self._check_open()
        self._check_peer(src, "src")
        return self._pg.recv([tensor], src, tag)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    # --- lifetime -------------------------------------------------------------------------

    def destroy(self) -> None:
        """Releases the backend and the store (rank 0's listening socket with it); idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        shutdown = getattr(self._pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self._pg = None
        self._store = None

    def __repr__(self) -> str:
        return (
            f"StatelessGroup(epoch={self.spec.epoch}, rank={self.rank}/{self.world_size}, "
            f"backend={self.spec.backend})"
        )

    def _check_open(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"{self!r} was destroyed")

    def _check_peer(self, peer: int, name: str) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{name} must be in [0, {self.world_size}), got {peer}")
