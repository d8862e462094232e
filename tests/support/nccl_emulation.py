"""NCCL's failure semantics over gloo, on CPUs: what a rank sees on GPUs when a peer is gone.

`EmulatedNccl` takes gloo's entry of `moe_runtime.comm.semantics.BY_BACKEND` (`install`, undone
by `restore`; in a Ray rank actor, `NcclFaults` installs it through the rank hooks seam:
`RayExecutor(..., rank_hooks=NcclFaults)`). Then a collective of a `StatelessGroup` behaves as
on NCCL (`moe_runtime.comm.semantics` says what PyTorch does there, with the environment
`semantics.Nccl.ENV` sets):

- it never raises at the call. An op whose peer is gone blocks, as a rank blocks at the host
  read behind an NCCL kernel that spins (NVLink notices no dead peer), until the group is
  aborted (`StatelessGroup.abort`: what the executor's `abort_peers` makes a rank do) or its op
  timeout passes (PyTorch's watchdog with CleanUpOnly: it aborts the communicator); then it
  returns with whatever the buffers hold. The failure is recorded on the group and shows at
  `check()` (as ``ProcessGroupNCCL.get_error()``) or at the group's next call;
- `detect_errors`: a gloo error (a peer's connection closed) is recorded at once (NCCL over
  sockets or InfiniBand, which sees the connection go) instead of being held until the abort
  or the timeout (the default: NVLink, the worst case).

Point-to-point ops (gloo gives them no future) wait as gloo does: weight transfers are not
part of the emulation.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from moe_runtime.comm import semantics
from tests.support import faults

if TYPE_CHECKING:
    from moe_runtime.comm import group as group_mod

#: Seconds between two looks at the group's abort while an op is held.
POLL_SECONDS = 0.005


class EmulatedNccl(semantics.Semantics):
    """NCCL's semantics over gloo transport (see the module docstring)."""

    name = "nccl-emulated"

    def __init__(self, *, detect_errors: bool = False) -> None:
        self.detect_errors = detect_errors

    def wait(self, work: Any, group: group_mod.StatelessGroup) -> None:
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's send/recv: no future
            super().wait(work, group)
            return
        done = threading.Event()
        future.add_done_callback(lambda _future: done.set())
        deadline = time.monotonic() + group.op_timeout
        if not self._until(done, group, deadline):
            return
        try:
            work.wait()
        except RuntimeError as exc:
            reason = f"NCCL error: {str(exc).strip().splitlines()[0]}"
            if self.detect_errors:
                group.abort(reason)
                return
            self._until(threading.Event(), group, deadline)  # the kernel spins on

    @staticmethod
    def _until(event: threading.Event, group: group_mod.StatelessGroup, deadline: float) -> bool:
        """True when `event` came first; False once the group is aborted or the op timed out
        (then the group is aborted: PyTorch's watchdog)."""
        while not event.wait(POLL_SECONDS):
            if group.aborted.is_set():
                return False
            if time.monotonic() > deadline:
                group.abort(f"NCCL timeout: an op ran past {group.op_timeout:g}s (watchdog)")
                return False
        return True


def install(*, detect_errors: bool = False) -> semantics.Semantics:
    """gloo groups built from now on in this process fail as NCCL ones; returns what gloo's
    entry was (give it to `restore`)."""
    previous = semantics.BY_BACKEND["gloo"]
    semantics.BY_BACKEND["gloo"] = EmulatedNccl(detect_errors=detect_errors)
    return previous


def restore(previous: semantics.Semantics) -> None:
    semantics.BY_BACKEND["gloo"] = previous


class NcclFaults(faults.Faults):
    """The fault hooks of a rank whose gloo groups fail as NCCL ones (`install` on creation:
    the rank hooks factory of a Ray actor runs in the actor's process)."""

    def __init__(self) -> None:
        super().__init__()
        install()
