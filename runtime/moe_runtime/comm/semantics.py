"""How a group's backend fails, by backend name (`for_backend`): where an error shows, how a
communicator is let go. `group.StatelessGroup` asks its semantics; nothing else differs.

gloo (`Semantics`): a collective's ``wait()`` blocks the calling thread and raises there when a
peer's connection closes (its process died) or the op timeout passes. Letting go: ``abort()``
and dropping the last reference (gloo closes its connections only then, so peers waiting on
this member raise at once instead of at their timeout; ``abort()`` alone interrupts nothing:
measured with torch 2.15).

nccl (`Nccl`): collectives are queued on the CUDA stream and ``wait()`` returns at once; a peer
that is gone leaves the NCCL kernel spinning (NVLink/P2P notice nothing), so the rank blocks
at its next host read (``.tolist()``, ``.item()``, a copy to the host) until the communicator
is aborted. PyTorch's defaults would then end the process: its watchdog thread rethrows
(``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 3, SkipCleanUp: "taking the entire process down") and its
heartbeat monitor calls ``std::abort`` once a collective timed out
(``TORCH_NCCL_ENABLE_MONITORING``). `Nccl.ENV` selects CleanUpOnly (2: the watchdog aborts
the timed-out communicator and raises nothing), turns the monitor and the timeout dump off and
shortens the dump wait the watchdog sleeps before its abort (4 x
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, 60 s by default). Read in PyTorch's
``ProcessGroupNCCL.cpp`` (``Watchdog::runLoop``, ``HeartbeatMonitor::runLoop``,
``WorkNCCL::handleException``); the variables are read when a ``ProcessGroupNCCL`` is built,
so `Nccl.prepare` sets them just before. The error then shows at `StatelessGroup.check`, which
the rank calls after the host read that ends its step (``ProcessGroupNCCL.get_error()``), or at
the group's next call. Letting go is ``abort()`` (``ncclCommAbort``: it frees the
communicator without waiting for pending kernels or peers), never ``shutdown()``
(``ncclCommFinalize``: it waits for every pending kernel, so for a peer that is gone).

Tests replace an entry of `BY_BACKEND` to run NCCL's semantics over gloo
(tests/support/nccl_emulation.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

if TYPE_CHECKING:
    from moe_runtime.comm import group as group_mod

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """A group's communicator failed (a peer is gone, an op timed out, or it was aborted): it
    is aborted and serves no more collectives; a new epoch's groups replace it."""


class Semantics:
    """gloo's semantics (see the module docstring); `Nccl` overrides what differs."""

    name = "gloo"

    def prepare(self) -> None:
        """Before a backend of this kind is built (process environment)."""

    def options(self, opts: Any, *, high_priority: bool) -> None:
        """Backend options before the backend is built (NCCL: the stream priority)."""

    def connect(self, pg: Any, device: torch.device) -> None:
        """Right after the backend is built, while the group is not serving yet."""

    def wait(self, work: Any, group: group_mod.StatelessGroup) -> None:
        """Wait for one op as this backend does; GroupFailed (the group aborted) on an error."""
        try:
            work.wait()
        except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            group.abort(reason)
            raise GroupFailed(f"{group!r}: {reason}") from exc

    def error(self, pg: Any) -> str | None:
        """An error the backend recorded off the calling thread (None: none, or the backend
        raises at the call)."""
        return None

    def abort(self, pg: Any) -> None:
        """Let go of the backend at once, whatever its peers do."""
        abort = getattr(pg, "abort", None)
        if callable(abort):
            abort()


class Nccl(Semantics):
    """NCCL's semantics (see the module docstring)."""

    name = "nccl"

    #: The process environment a ProcessGroupNCCL is built under (module docstring).
    ENV: Final[Mapping[str, str]] = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        # every connection at the communicator's creation (NCCL >= 2.22): no device allocation
        # (an implicit device synchronisation) in the middle of a transfer or a step, where it
        # would wait for another communicator's spinning kernel
        "NCCL_RUNTIME_CONNECT": "0",
    }

    def prepare(self) -> None:
        for key, value in self.ENV.items():
            old = os.environ.get(key)
            if old is not None and old != value:
                log.warning("%s=%s overridden with %s (NCCL failure semantics)", key, old, value)
            os.environ[key] = value

    def options(self, opts: Any, *, high_priority: bool) -> None:
        opts.is_high_priority_stream = high_priority

    def connect(self, pg: Any, device: torch.device) -> None:
        """Bind the device and create the communicator now (``eager_connect_single_device``):
        a lazily created one costs its first collective 0.5-3 s, inside the serving path
        after a switch; built here, it costs the background join instead."""
        try:
            pg.bound_device_id = device
        except (AttributeError, TypeError):  # an older torch without a settable bound device
            log.debug("bound_device_id not settable on %r", pg)
        connect = getattr(pg, "eager_connect_single_device", None)
        if callable(connect):
            connect(device)

    def error(self, pg: Any) -> str | None:
        get_error = getattr(pg, "get_error", None)
        if not callable(get_error):
            return None
        err = get_error()
        name = str(getattr(err, "name", err))
        return None if name == "SUCCESS" else f"NCCL {name.lower()} (watchdog)"


#: The semantics of each backend name (`for_backend`).
BY_BACKEND: dict[str, Semantics] = {"gloo": Semantics(), "nccl": Nccl()}


def for_backend(name: str) -> Semantics:
    """The semantics of backend `name`; ValueError naming the known ones."""
    if name not in BY_BACKEND:
        raise ValueError(f"no failure semantics for backend {name!r}; known: {sorted(BY_BACKEND)}")
    return BY_BACKEND[name]
