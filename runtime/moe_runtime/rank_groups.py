"""The group half of a rank (`RankGroups`, inherited by `RankWorker`): its communication
groups and the non-expert weight transfer over them.

Groups are keyed by (epoch, role): the *step* group is used only by `execute_step`
collectives (expert dispatch/combine); the *transfer* group only by background weight moves
(`transfer_non_expert` here, expert moves in `slots`), so a transfer never interleaves with
step collectives on one gloo group. `join_group` runs in the control lane while the rank
serves steps on its active group; `drop_epoch` destroys an epoch's groups (not the active
one's); `free_port` gives a port for a TCPStore this rank hosts.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import torch

from moe_runtime import faults
from moe_runtime import slots as slots_mod
from moe_runtime import staging as staging_mod
from moe_runtime.comm import group as group_mod
from moe_runtime.model import config as config_mod
from moe_runtime.model import decoder

log = logging.getLogger(__name__)

ROLES = (slots_mod.STEP_ROLE, slots_mod.TRANSFER_ROLE)


class RankGroups:
    """Groups and the non-expert transfer of a rank; the state is `RankWorker`'s."""

    epoch: int | None
    dtype: torch.dtype
    _groups: dict[tuple[int, str], group_mod.StatelessGroup]
    _aborted_joins: set[int]
    _group_ranks: dict[tuple[int, str], int]
    _previous: slots_mod.Live | None
    _lock: threading.RLock

    def _ctx(self) -> str:
        raise NotImplementedError

    def _check_fail(self, operation: str) -> None:
        raise NotImplementedError

    def _require_model(self) -> tuple[config_mod.ModelConfig, decoder.MoEModel]:
        raise NotImplementedError

    def free_port(self, host: str | None = None) -> tuple[str, int]:
        """(address, port) of a port free on this host now, for a TCPStore this rank hosts."""
        address = host or host_ip()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
            return address, int(sock.getsockname()[1])

    def join_group(
        self,
        spec: group_mod.GroupSpec,
        rank: int,
        *,
        role: str = slots_mod.STEP_ROLE,
        group_timeout: float | None = None,
    ) -> None:
        """Build the `role` group of `spec.epoch` as member `rank` (blocks until all joined).

        Runs in the background while this rank serves steps on its active group. group_timeout:
        seconds the rendezvous and each later collective of the group may take (None: the
        group's default), so a member that never comes does not hold this rank for long.
        `abort_join(spec.epoch)` calls it off (`group.JoinAborted`), also before it began.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        started = time.monotonic()
        epoch = spec.epoch

        def aborted() -> bool:
            with self._lock:
                return epoch in self._aborted_joins

        if group_timeout is None:
            built = group_mod.StatelessGroup(spec, rank, aborted=aborted)
        else:
            built = group_mod.StatelessGroup(spec, rank, timeout=group_timeout, aborted=aborted)
        key = (spec.epoch, role)
        with self._lock:
            old = self._groups.pop(key, None)
            self._groups[key] = built
            self._group_ranks[key] = rank
        if old is not None:
            old.destroy()
        log.info(
            "joined %s group of epoch %d as %d/%d in %.2fs (%s)",
            role,
            spec.epoch,
            rank,
            spec.world_size,
            time.monotonic() - started,
            self._ctx(),
        )
        try:
            self._check_fail("join_group")
        except faults.InjectedFailure:
            self._drop_group(key)
            raise

    def abort_join(self, epoch: int) -> None:
        """Call off this rank's joins of `epoch`'s groups, running or still to come (a member
        died before joining; epochs are never reused). Quick: it only marks the epoch."""
        with self._lock:
            self._aborted_joins.add(epoch)
        log.info("joins of epoch %d called off (%s)", epoch, self._ctx())

    def _group(self, epoch: int, role: str) -> tuple[group_mod.StatelessGroup, int]:
        with self._lock:
            key = (epoch, role)
            if key not in self._groups:
                raise RuntimeError(f"no {role} group for epoch {epoch} ({self._ctx()})")
            return self._groups[key], self._group_ranks[key]

    def _drop_group(self, key: tuple[int, str], *, wait: bool = True) -> None:
        """Forget the group of `key` at once and destroy it: here, or with wait False in a
        thread of its own (a gloo group whose peers are leaving takes up to ~0.5 s to close,
        which a confirmed switch need not wait for)."""
        with self._lock:
            dropped = self._groups.pop(key, None)
            self._group_ranks.pop(key, None)
        if dropped is None:
            return
        if wait:
            dropped.destroy()
        else:
            threading.Thread(target=dropped.destroy, name=f"destroy-{key}", daemon=True).start()

    def groups(self) -> list[tuple[int, str]]:
        """The (epoch, role) of every group this rank holds."""
        with self._lock:
            return sorted(self._groups)

    # -- non-expert transfer -------------------------------------------------------------
    def transfer_non_expert(
        self, epoch: int, *, src_ranks: Sequence[int], dst_ranks: Sequence[int]
    ) -> int:
        """Copy the non-expert weights from src_ranks to dst_ranks over epoch's transfer group.

        Peer to peer: receivers are spread over senders (`staging.senders_for`: the first
        ``len(dst) % len(src)`` senders get one extra), each sender sends its whole state as one
        flat buffer to each of its receivers at once. Ranks are ranks of that group; members
        that neither send nor receive return at once. Returns the bytes this rank received.
        """
        _, model = self._require_model()
        grp, me = self._group(epoch, slots_mod.TRANSFER_ROLE)
        started = time.monotonic()
        tag = 1_000_000 + epoch  # apart from expert-move tags (move indices)
        sent_to, received = staging_mod.exchange_non_expert(
            grp, me, model, src_ranks=src_ranks, dst_ranks=dst_ranks, tag=tag, dtype=self.dtype
        )
        log.info(
            "non-expert transfer epoch %d: sent to %s, received %d B in %.2fs (%s)",
            epoch,
            sent_to,
            received,
            time.monotonic() - started,
            self._ctx(),
        )
        self._check_fail("transfer_non_expert")
        return received

    def drop_epoch(self, epoch: int) -> None:
        """Destroy the step and transfer groups of `epoch` (a resize undone before its switch).

        The active epoch cannot be dropped.
        """
        if epoch == self.epoch:
            raise ValueError(f"epoch {epoch} is the active one ({self._ctx()})")
        with self._lock:
            if self._previous is not None and self._previous.epoch == epoch:
                self._previous = None  # nothing to go back to without its groups
        for role in ROLES:
            self._drop_group((epoch, role))


def host_ip() -> str:
    """This host's address for peers: env MOE_POD_IP, else the host name's address."""
    env = os.environ.get("MOE_POD_IP")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
