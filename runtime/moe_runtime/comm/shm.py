"""The tensor-parallel collectives of CPU ranks on one host through shared memory
(`SharedCollective`), as vLLM's CPU communicator does: a gloo all-reduce of a decode-sized
tensor between two processes takes ~0.6-0.9 ms here (several thread hand-offs per message
in gloo's TCP pairs), where a loopback socket's round trip is ~7 us; a TP rank's step runs a
few of them per layer, so at T = 2 they were ~80 % of a decode step (bench/tensor_parallel.py).

Layout of one group's segment (``/dev/shm``, unlinked once every member mapped it): a header
of int64 words (per member: the generation it last posted, its pid; the group's abort word),
then two buffers (calls alternate between them) of `capacity` bytes per member. A call of
generation g copies the member's tensor into its slot of buffer g % 2, posts g, waits until
every member posted g, and reads every slot: an all-reduce sums them in member order on
every member (the same bits everywhere), an all-gather concatenates them. Double buffering
makes one wait per call enough: a member writes buffer g % 2 again only in call g + 2, after
every member posted g + 1, i.e. finished reading call g.

The wait spins, then yields the CPU (`os.sched_yield`), then sleeps in short steps (a member
waiting for the experts of its leader must not take a core from it on a small host). It
fails at once when a member aborted the group (`StatelessGroup.abort` writes the abort word:
`StatelessGroup.on_abort`), when a member's process is gone (its pid), or at the group's
timeout: never later than gloo would.

Used only on x86-64 (its stores are seen in order by other cores, which the copy-then-post
relies on; elsewhere gloo carries every collective), for gloo groups (NCCL has its own),
and for tensors up to `capacity` (larger ones, a long prefill's, go through gloo, as every
member decides alike). `MOE_TP_SHARED_MEMORY=0` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import platform
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "MOE_TP_SHARED_MEMORY"
#: Bytes of one member's slot in each buffer: decode-sized tensors and short prefills.
CAPACITY = 4 << 20
DIRECTORY = "/dev/shm"
#: Seconds of spinning, then of yielding, before the wait sleeps between looks.
SPIN_S = 20e-6
YIELD_S = 2e-3
SLEEP_S = 100e-6
#: Seconds between looks at the abort word, the members' pids and the deadline.
CHECK_EVERY_S = 0.05
_WORDS = 16  # header words per member (a cache line of its own and more)


class SharedMemoryFailed(RuntimeError):
    """A member aborted, died or timed out while the others waited in a shared-memory call."""


def wanted(group: Any) -> bool:
    """Whether `group` (a `comm.group.StatelessGroup`) should carry its small collectives
    through shared memory: gloo, every member on this host, x86-64, not switched off."""
    if os.environ.get(ENV, "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    spec = group.spec
    return bool(spec.backend == "gloo" and spec.is_local and spec.world_size > 1)


def collective(group: Any, *, capacity: int = CAPACITY) -> Any:
    """`group` with its small all-reduces and all-gathers through shared memory where that
    applies (`wanted`), else `group` itself. A collective call of every member (they map
    one segment); a segment that cannot be made (a full /dev/shm) leaves gloo, logged."""
    if not wanted(group):
        return group
    try:
        return SharedCollective(group, capacity=capacity)
    except OSError as exc:
        log.warning(
            "%r: no shared-memory segment for its collectives (%s); they stay on gloo "
            "(set %s=0 to skip the attempt)",
            group,
            exc,
            ENV,
        )
        group.barrier()  # the members that made theirs wait here too: no one is left behind
        return group


class SharedCollective:
    """A TP group's `all_reduce` and `all_gather_into` through a shared segment (module
    docstring); everything else (and tensors over `capacity`) through `group`."""

    def __init__(self, group: Any, *, capacity: int = CAPACITY) -> None:
        self.group = group
        self.rank: int = group.rank
        self.size: int = group.spec.world_size
        self.capacity = capacity
        self.timeout: float = group.op_timeout
        name = hashlib.sha1(repr(group.spec).encode()).hexdigest()[:20]
        path = os.path.join(DIRECTORY, f"elastic-moe-tp-{name}")
        header = self.size * _WORDS + 8
        total = header * 8 + 2 * self.size * capacity
        made: OSError | None = None
        if self.rank == 0:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.posix_fallocate(fd, 0, total)  # ENOSPC now, never SIGBUS later
                finally:
                    os.close(fd)
            except OSError as exc:
                made = exc
        # every member learns whether rank 0 made it (a failure there is everyone's)
        ok = torch.tensor([0 if made is not None else 1], dtype=torch.int64)
        group.all_reduce(ok, "min")
        if made is not None:
            _unlink(path)
            raise made
        if int(ok) == 0:
            raise OSError(f"rank 0 of {group!r} could not make its shared-memory segment")
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        words = torch.frombuffer(self._map, dtype=torch.int64, count=header)
        self._posted = words[: self.size * _WORDS : _WORDS]
        self._pids = words[1 : self.size * _WORDS : _WORDS]
        self._abort = words[self.size * _WORDS : self.size * _WORDS + 1]
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=header * 8)
        self._pids[self.rank] = os.getpid()
        self._gen = 0
        group.barrier()  # every member mapped it and wrote its pid
        if self.rank == 0:
            _unlink(path)  # the mappings stay; nothing is left in /dev/shm
        self._peer_pids = [int(p) for p in self._pids]
        group.on_abort.append(self._on_abort)

    # -- the collectives -------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if op != "sum" or nbytes > self.capacity or not tensor.is_contiguous():
            self.group.all_reduce(tensor, op)
            return
        slots = self._exchange(tensor, nbytes)
        total = slots[0].clone()
        for other in slots[1:]:
            total += other
        tensor.copy_(total)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.capacity or not tensor.is_contiguous() or not output.is_contiguous():
            self.group.all_gather_into(output, tensor)
            return
        slots = self._exchange(tensor, nbytes)
        torch.cat([s.reshape(-1) for s in slots], out=output.reshape(-1))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)  # every other call: the gloo group's

    # -- the exchange ----------------------------------------------------------------------
    def _slot(self, buffer: int, member: int, nbytes: int) -> torch.Tensor:
        start = (buffer * self.size + member) * self.capacity
        return self._data[start : start + nbytes]

    def _exchange(self, tensor: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
        """Post `tensor` in this member's slot of the call's buffer, wait for every member's,
        and return views of them all (in member order, shaped and typed as `tensor`)."""
        if self.group.failure is not None:
            raise SharedMemoryFailed(f"{self.group!r} failed: {self.group.failure}")
        self._gen += 1
        buffer = self._gen % 2
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        self._slot(buffer, self.rank, nbytes).copy_(flat)
        self._posted[self.rank] = self._gen  # after the copy: x86 keeps the stores in order
        self._wait(self._gen)
        return [
            self._slot(buffer, m, nbytes).view(tensor.dtype).view(tensor.shape)
            for m in range(self.size)
        ]

    def _wait(self, gen: int) -> None:
        posted = self._posted
        if int(posted.min()) >= gen:
            return
        started = time.monotonic()
        next_check = started + CHECK_EVERY_S
        while int(posted.min()) < gen:
            now = time.monotonic()
            waited = now - started
            if waited < SPIN_S:
                continue
            if waited < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S)
            if now >= next_check:
                next_check = now + CHECK_EVERY_S
                self._check(gen, waited)

    def _check(self, gen: int, waited: float) -> None:
        late = [m for m in range(self.size) if int(self._posted[m]) < gen]
        why = None
        if int(self._abort[0]):
            why = "a member aborted the group"
        elif self.group.failure is not None:
            why = f"the group failed: {self.group.failure}"
        else:
            gone = [m for m in late if not _alive(self._peer_pids[m])]
            if gone:
                why = f"member(s) {gone} (pid {[self._peer_pids[m] for m in gone]}) died"
            elif waited > self.timeout:
                why = f"member(s) {late} did not arrive within {self.timeout:.0f}s"
        if why is not None:
            self.group.abort(f"shared-memory collective: {why}")
            raise SharedMemoryFailed(f"{self.group!r}: {why}")

    def _on_abort(self) -> None:
        self._abort[0] = 1  # every member's wait fails at its next look


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
