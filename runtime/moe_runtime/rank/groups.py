"""A rank's communication groups (`RankGroups`) and the non-expert weight transfer over them.

Groups are keyed by (epoch, role): the *step* group is used only by `execute_step`
collectives (expert dispatch/combine); the *transfer* group only by background weight moves
(`transfer_non_expert` here, expert moves in `slots`), so a transfer never interleaves with
step collectives on one gloo group. `join_group` runs in the control lane while the rank
serves steps on its active group; `drop_epoch` destroys an epoch's groups; `free_port` gives a
port for a TCPStore this rank hosts.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from moe_runtime.comm import group as group_mod
from moe_runtime.rank import context as context_mod
from moe_runtime.rank import staging as staging_mod

log = logging.getLogger(__name__)

#: Role of the group used only by `execute_step` collectives (expert dispatch/combine).
STEP = "step"
#: Role of the group used only by background weight moves (non-expert and expert transfers).
TRANSFER = "transfer"
#: Role of a leader's mesh group in the mesh expert layout (`rank.mesh`): the step's expert
#: collectives over every TP rank of every DP rank.
MESH = "mesh"
#: The roles the executor builds each epoch (a leader joins its mesh group itself).
ROLES = (STEP, TRANSFER)
_ALL_ROLES = (*ROLES, MESH)

Key = tuple[int, str]


#: Starts a non-expert transfer's part over (the leaders' transfer group, src_ranks,
#: dst_ranks) and returns the wait for it (the bytes received).
NonExpertParts = Callable[
    [group_mod.StatelessGroup, Sequence[int], Sequence[int]], Callable[[], int]
]


class NonExpertHolder(Protocol):
    """A part of a rank that holds non-expert weights of its own (its TP followers:
    `TensorLeader`, its pipeline stages: `PipelineLeader`)."""

    def transfer_non_expert(
        self, group: group_mod.StatelessGroup, src_ranks: Sequence[int], dst_ranks: Sequence[int]
    ) -> Callable[[], int]: ...


def non_expert_parts(*holders: NonExpertHolder | None) -> NonExpertParts | None:
    """One `NonExpertParts` starting the transfer of each of `holders` (None: no holder)."""
    active = [h for h in holders if h is not None]
    if not active:
        return None

    def start(
        group: group_mod.StatelessGroup, src: Sequence[int], dst: Sequence[int]
    ) -> Callable[[], int]:
        waits = [h.transfer_non_expert(group, src, dst) for h in active]
        return lambda: sum(wait() for wait in waits)

    return start


class RankGroups:
    """The groups of one rank by (epoch, role), and the non-expert transfer over them (whose
    weights are the rank's `ctx.loaded`)."""

    def __init__(
        self,
        ctx: context_mod.RankContext,
        *,
        on_join: Callable[[group_mod.GroupSpec, int, str], None] | None = None,
        on_abort_join: Callable[[int], None] | None = None,
        on_non_expert: NonExpertParts | None = None,
    ) -> None:
        self._ctx = ctx
        #: called after each successful join with (spec, rank, role): a pipeline leader's
        #: stages join their own groups of the epoch then (`pipeline_group`)
        self._on_join = on_join
        #: called with the epoch when its joins are called off: a pipeline leader's stages
        #: call off theirs (a stage waiting for a member that died ends at once)
        self._on_abort_join = on_abort_join
        #: called at a non-expert transfer: a leader's TP followers and pipeline stages start
        #: theirs (`non_expert_parts`)
        self._on_non_expert = on_non_expert
        self._lock = threading.Lock()
        self._groups: dict[Key, group_mod.StatelessGroup] = {}
        self._group_ranks: dict[Key, int] = {}
        self._aborted_joins: set[int] = set()

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
        role: str = STEP,
        group_timeout: float | None = None,
        op_timeout: float | None = None,
    ) -> None:
        """Build the `role` group of `spec.epoch` as member `rank` (blocks until all joined).

        Runs in the background while this rank serves steps on its active group. group_timeout:
        seconds the rendezvous and each later collective of the group may take (None: the
        group's default), so a member that never comes does not hold this rank for long;
        op_timeout: the collectives' own bound when given (the step group's, from observed
        step times). The step group's collectives go first on the device (high priority).
        `abort_join(spec.epoch)` calls it off (`group.JoinAborted`), also before it began. A
        join that fails after the rendezvous (at its fault point) leaves no group behind.
        """
        if role not in _ALL_ROLES:
            raise ValueError(f"role must be one of {_ALL_ROLES}, got {role!r}")
        started = time.monotonic()
        epoch = spec.epoch

        def aborted() -> bool:
            with self._lock:
                return epoch in self._aborted_joins

        built = group_mod.StatelessGroup(
            spec,
            rank,
            timeout=group_mod.DEFAULT_TIMEOUT if group_timeout is None else group_timeout,
            op_timeout=op_timeout,
            aborted=aborted,
            high_priority=role == STEP,
        )
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
            self._ctx.where(),
        )
        try:
            self._ctx.check("join_group")
            if self._on_join is not None:
                self._on_join(spec, rank, role)
        except Exception:
            self.drop_group(key)
            raise

    def abort_join(self, epoch: int) -> None:
        """Call off this rank's joins of `epoch`'s groups, running or still to come (a member
        died before joining; epochs are never reused). Quick: it only marks the epoch."""
        with self._lock:
            self._aborted_joins.add(epoch)
        log.info("joins of epoch %d called off (%s)", epoch, self._ctx.where())
        if self._on_abort_join is not None:
            self._on_abort_join(epoch)

    def abort(self, epoch: int | None, reason: str) -> list[Key]:
        """Abort the groups of `epoch` (None: every group) at once, without waiting on any
        peer (a peer is lost: a collective of this rank that waits for it ends now); they stay
        listed until dropped. Returns the (epoch, role) aborted. Any thread."""
        with self._lock:
            hit = {k: g for k, g in self._groups.items() if epoch is None or k[0] == epoch}
        for grp in hit.values():
            grp.abort(reason)
        if hit:
            log.warning("aborted groups %s: %s (%s)", sorted(hit), reason, self._ctx.where())
        return sorted(hit)

    def group(self, epoch: int, role: str) -> tuple[group_mod.StatelessGroup, int]:
        """The `role` group of `epoch` and this rank's rank in it; RuntimeError when absent."""
        with self._lock:
            key = (epoch, role)
            if key not in self._groups:
                raise RuntimeError(f"no {role} group for epoch {epoch} ({self._ctx.where()})")
            return self._groups[key], self._group_ranks[key]

    def drop_group(self, key: Key, *, wait: bool = True) -> None:
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

    def drop_epoch(self, epoch: int) -> None:
        """Destroy the step and transfer groups of `epoch`, here."""
        for role in _ALL_ROLES:
            self.drop_group((epoch, role))

    def retire_before(self, epoch: int | None) -> None:
        """Destroy (in the background: nothing waits for their peers to close) the groups of
        the epochs older than `epoch`, the active one (None: none is active, nothing goes)."""
        with self._lock:
            old = [key for key in self._groups if epoch is not None and key[0] < epoch]
        for key in old:
            self.drop_group(key, wait=False)

    def close(self) -> None:
        """Destroy every group in the background (the process is about to stop)."""
        with self._lock:
            keys = list(self._groups)
        for key in keys:
            self.drop_group(key, wait=False)

    def groups(self) -> list[Key]:
        """The (epoch, role) of every group this rank holds."""
        with self._lock:
            return sorted(self._groups)

    def epochs(self) -> list[int]:
        """The epochs this rank holds a group of."""
        with self._lock:
            return sorted({epoch for epoch, _ in self._groups})

    # -- non-expert transfer -------------------------------------------------------------
    def transfer_non_expert(
        self, epoch: int, *, src_ranks: Sequence[int], dst_ranks: Sequence[int]
    ) -> int:
        """Copy the non-expert weights from src_ranks to dst_ranks over epoch's transfer group.

        Peer to peer: receivers are spread over senders (`staging.senders_for`: the first
        ``len(dst) % len(src)`` senders get one extra), each sender sends its whole state as one
        flat buffer to each of its receivers at once. Ranks are ranks of that group; members
        that neither send nor receive return at once. A leader's TP followers and pipeline
        stages run theirs meanwhile, over groups of their own (`on_non_expert`). Returns the
        bytes this rank received (its followers' and stages' included).
        """
        _, model = self._ctx.loaded.require(self._ctx.where())
        grp, _ = self.group(epoch, TRANSFER)
        parts = (
            None if self._on_non_expert is None else self._on_non_expert(grp, src_ranks, dst_ranks)
        )
        received = staging_mod.transfer_non_expert(
            grp, model, epoch=epoch, src_ranks=src_ranks, dst_ranks=dst_ranks, what="rank",
            where=self._ctx.where(),
        )  # fmt: skip
        if parts is not None:
            received += parts()
        self._ctx.check("transfer_non_expert")
        return received


def host_ip() -> str:
    """This host's address for peers: env MOE_POD_IP, else the host name's address."""
    env = os.environ.get("MOE_POD_IP")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
