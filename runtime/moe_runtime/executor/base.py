"""The executor seam: how the engine and the resize coordinator reach the ranks.

An executor owns one `RankWorker` per DP rank (a Ray actor, or an object in this process) and
offers one RPC primitive (`collective_rpc`), the lockstep step (`execute_step`), and the
primitives a live resize is made of:

- `add_ranks(count)`: start workers, wait until they answer; they are *pending* (not stepped).
- `build_groups(ranks, epoch=k)`: every listed worker joins the step group and the transfer
  group of epoch k (rendezvous chosen here: a FileStore on one host, else a TCPStore hosted by
  the group's rank 0). Runs in the background: steps keep running on the active group.
- `switch(ranks, epoch=k, placement=p)`: at a step boundary, `activate` epoch k on those
  workers (worker `ranks[i]` becomes rank i) and step them from the next step on.
- `remove_ranks(ranks)`: stop workers, return their infos (pod names for `workersToDelete`).

It is made of parts, each built with what it needs: `roster` (`roster.Roster`: the workers by
label, active and pending), `heartbeat` (`health.Heartbeat`), `switcher` (`switch.Switch`) and
`weights` (`weight_moves.WeightMoves`: expert staging and the non-expert transfer), shared by
both executors and built here, and `groups` (how an epoch's groups are built: a rendezvous per
executor). An executor adds how it reaches its workers (`_call`, `_send_ping`, `_poll_ping`),
how it steps them (`execute_step` and its step path), starts, stops and fences them.

Rank labels: the active ranks are always 0..n-1 in step order. A pending worker keeps the label
it was given by `add_ranks` (n, n+1, ...) or the label it had when a `switch` left it out, until
it is removed or switched in.

Failures (every path ends in a known state):
- Heartbeat and step deadline: see `health`; a hung worker is fenced at once, a lost one is
  reported through the heartbeat's `on_lost`.
- A failed step: when every stepped worker is healthy the step path is rebuilt on the same
  ranks before `execute_step` raises `ExecutorError` (retry it); otherwise it raises `RankDied`
  naming the lost ranks and leaves no step path (`has_step_path()` is False) until a `switch`.
- A step whose outputs say the step group failed (`StepOutput.failure`, `after_step`): no step
  path (the group is aborted; the recovery builds a new epoch's groups); a rank that failed
  itself (out of memory) is reported lost first (`RankDied`).
- A stepped worker lost (heartbeat, failed step): its peers abort their live groups at once
  (`abort_peers`), so no collective waits for it (NCCL notices no dead peer by itself).
- A failed `switch` goes back to the old step path (`switch`): workers that activated the new
  epoch `revert`; it raises afterwards.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from moe_runtime import step as step_mod
from moe_runtime.executor import health as health_mod
from moe_runtime.executor import roster as roster_mod
from moe_runtime.executor import switch as switch_mod
from moe_runtime.executor import weight_moves

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Calls:
    """One `collective_rpc`: `method(*args, **kwargs)` on each member with its own keyword
    arguments (`per_member`, in call order), within `timeout`, on the control lane when
    `background`."""

    method: str
    args: tuple[Any, ...]
    per_member: list[tuple[roster_mod.Member[Any], dict[str, Any]]]
    timeout: float | None
    background: bool

    @property
    def labels(self) -> list[int]:
        return [m.label for m, _ in self.per_member]


class GroupBuilder(Protocol):
    """How an executor builds the step and transfer groups of an epoch (`build_groups`)."""

    def build(
        self,
        ranks: Sequence[int],
        *,
        epoch: int,
        timeout: float | None,
        background: bool,
        step_op_timeout: float | None,
    ) -> None: ...


class ExecutorError(RuntimeError):
    """A call on the ranks failed; `ranks` names the ranks that failed (may be empty)."""

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class RankDied(ExecutorError):
    """A rank's worker is gone (its process or node died, or it was fenced after a hang)."""


class Executor(abc.ABC):
    """One worker per DP rank, stepped in lockstep, made of parts (see the module docstring)."""

    def __init__(
        self,
        *,
        roster: roster_mod.Roster[Any],
        groups: GroupBuilder,
        shared: weight_moves.Shared | None = None,
        switch_timeout: float | None = None,
    ) -> None:
        """roster: the workers; groups: the group builder; shared: weight moves another way
        than the transfer group (`weight_moves.Shared`); switch_timeout: the bound of a switch
        called without one (None: none)."""
        self.roster = roster
        self.groups = groups
        self.heartbeat = health_mod.Heartbeat(
            members=roster.health,
            stepping=roster.active,
            send_ping=self._send_ping,
            poll_ping=self._poll_ping,
            fence=self.fence,
            clock=health_mod.StepClock(),
            abort_peers=self.abort_peers,
            ping_error=self._ping_error,
        )
        self.switcher = switch_mod.Switch(
            roster=roster,
            rpc=self.collective_rpc,
            lost=self.lost_ranks,
            set_path=self._set_path,
            clear_path=self._clear_path,
            tell=self._tell,
            prepare=self._prepare,
            timeout=switch_timeout,
        )
        self.weights = weight_moves.WeightMoves(self.collective_rpc, shared=shared)
        self._async_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # -- ranks ---------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """The ranks in the step graph, in step order (always 0..n-1)."""
        return self.roster.active()

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def pending_ranks(self) -> list[int]:
        """Live workers that are not in the step graph (added, or left out by a switch)."""
        return self.roster.pending()

    def rank_infos(self) -> dict[int, dict[str, Any]]:
        """`RankWorker.info()` of every live worker, active and pending, by rank label."""
        return self.roster.infos()

    def health(self) -> dict[int, health_mod.RankHealth]:
        """What the heartbeat knows of every live worker, by label (no call is made)."""
        return self.heartbeat.health()

    def lost_ranks(self) -> dict[int, health_mod.RankHealth]:
        """Live workers the heartbeat (or a failed step) found dead or unresponsive."""
        return self.heartbeat.lost_ranks()

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
        """Call the control method `method(*args, **kwargs)` (`RankWorker.call`) on every rank
        at once; results in order.

        ranks: rank labels to call (default: the active ranks); may name pending workers.
        timeout: seconds to wait for all results; TimeoutError past it.
        background: run in the workers' control lane, so the call overlaps running steps
        (group building, weight transfers). Control calls run one at a time per worker.
        per_rank: extra keyword arguments for some ranks (e.g. each one's rank in a new group).
        The names ranks, timeout, background and per_rank are this call's own: a worker
        method cannot take keyword arguments of those names through it.
        A worker's exception is raised as ExecutorError naming the rank (RankDied if it died).
        """
        members = self.roster.targets(f"collective_rpc({method})", ranks)
        extra = per_rank or {}
        per_member = [(m, {**kwargs, **extra.get(m.label, {})}) for m in members]
        return self._call(Calls(method, args, per_member, timeout, background))

    @abc.abstractmethod
    def _call(self, calls: Calls) -> list[Any]:
        """The calls of one `collective_rpc`, made at once; results in order."""

    def collective_rpc_async(
        self, method: str, *args: Any, background: bool = True, **kwargs: Any
    ) -> concurrent.futures.Future[list[Any]]:
        """`collective_rpc(method, *args, **kwargs)` without blocking the caller (in the
        control lane unless `background=False`)."""
        if self._async_pool is None:
            self._async_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="executor-rpc"
            )
        return self._async_pool.submit(
            self.collective_rpc, method, *args, background=background, **kwargs
        )

    @abc.abstractmethod
    def execute_step(self, step: step_mod.StepInput) -> list[step_mod.StepOutput]:
        """Run one lockstep step on every active rank; outputs in rank order."""

    # -- elastic primitives --------------------------------------------------------------
    @abc.abstractmethod
    def add_ranks(
        self, count: int, *, timeout: float | None = None, spare: bool = False
    ) -> list[int]:
        """Start `count` workers, wait until each answers, return their (pending) rank labels.

        `spare`: they will wait as warm spares, so they run below the serving ranks' CPU
        priority once started, where the executor can (Ray: `niceness.SPARE_NICENESS`); a
        grow's new ranks start at the serving ranks' priority, the grow waits for them."""

    def build_groups(
        self,
        ranks: Sequence[int],
        *,
        epoch: int,
        timeout: float | None = None,
        background: bool = True,
    ) -> None:
        """Workers `ranks` (labels, in group order) join epoch's step and transfer groups.

        In the background by default: the active step group keeps serving meanwhile.
        background=False uses the workers' default lane (no step path may be live: a recovery,
        which must not queue behind a transfer stuck on a dead peer). timeout also bounds the
        rendezvous inside the workers and the transfer group's collectives; the step group's
        collectives get the op timeout derived from observed steps
        (`health.StepClock.group_timeout`). The first member that fails (or that the heartbeat
        loses) fails the build naming it (`joins`).
        """
        self.groups.build(
            ranks,
            epoch=epoch,
            timeout=timeout,
            background=background,
            step_op_timeout=self.heartbeat.clock.group_timeout(),
        )

    def switch(
        self,
        ranks: Sequence[int],
        *,
        epoch: int | None = None,
        placement: Any = None,
        timeout: float | None = None,
    ) -> None:
        """Replace the step path by one over exactly `ranks` (labels, new step order).

        Call it between steps. With `epoch`, each worker `ranks[i]` first runs
        `activate(epoch, rank=i, num_ranks=len(ranks), placement=placement)`; without it, the
        caller has activated them. Afterwards worker `ranks[i]` is rank i. timeout bounds the
        whole switch. On any failure the old step path serves again (`switch` module) before
        the error is raised; the workers keep their previous state until
        `collective_rpc("retire_previous")` confirms the switch.
        """
        self.switcher.switch(ranks, epoch=epoch, placement=placement, timeout=timeout)

    def promote(self, ranks: Sequence[int]) -> None:
        """Pending workers started with `add_ranks(spare=True)` that a grow takes now run at
        the serving ranks' CPU priority (the grow waits for them). No-op unless an executor
        lowers a spare's priority (Ray: `niceness.SPARE_NICENESS`)."""
        return None

    def warm_up(self, ranks: Sequence[int]) -> None:
        """Pay one-time costs of pending workers ahead (RayExecutor: their first compiled
        graph); `prepare_switch` waits for it. No-op unless an executor has any."""
        return None

    def prepare_switch(self) -> None:
        """Finish background preparation of added workers (call before the step boundary of a
        switch, so the pause does not include it). No-op unless an executor prepares any."""
        return None

    @abc.abstractmethod
    def remove_ranks(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        """Stop those workers (shutdown, then kill); return their infos (pod, host, node_id)."""

    @abc.abstractmethod
    def check_health(self, *, timeout: float = 5.0) -> dict[int, str]:
        """Ping every live worker: {"ok" | "dead" | "unresponsive"} by rank label."""

    @abc.abstractmethod
    def fence(self, ranks: Sequence[int], *, reason: str = "fenced") -> None:
        """Kill those workers now (a hung worker must not hold its peers in a collective);
        they stay listed (state dead) until `remove_ranks`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release what the executor holds."""

    @abc.abstractmethod
    def has_step_path(self) -> bool:
        """A step can run now: the step path is built (a switch in progress counts)."""

    # -- failures --------------------------------------------------------------------------
    def abort_peers(self, lost: Sequence[int]) -> None:
        """Stepped workers `lost` are gone: every other stepped worker aborts its live groups
        now, on its health lane, not waited for (a collective of theirs that waits for a lost
        one ends; the recovery builds a new epoch's groups)."""
        gone = set(lost)
        peers = [r for r in self.roster.active() if r not in gone]
        members = self.roster.members()
        reason = f"ranks {sorted(gone)} were lost"
        for r in peers:
            m = members.get(r)
            if m is None or m.health.state != health_mod.HEALTH_OK:
                continue
            try:
                self._send_abort(m, reason)
            except Exception:  # noqa: BLE001 - a peer that cannot be told fails its step later
                log.exception("telling rank %d to abort its groups failed", r)
        if peers:
            log.warning("ranks %s lost: ranks %s abort their live groups", sorted(gone), peers)

    def after_step(
        self, step: step_mod.StepInput, ranks: Sequence[int], outs: Sequence[step_mod.StepOutput]
    ) -> None:
        """Raise when the outputs (of `ranks`, in order) say the step group failed
        (`StepOutput.failure`): no step path is left (the recovery rebuilds the groups); a
        rank that failed itself is reported lost first (`RankDied` naming it)."""
        failed = [(r, o) for r, o in zip(ranks, outs, strict=True) if o.failure is not None]
        if not failed:
            return
        now = time.monotonic()
        members = self.roster.members()
        lost = [r for r, o in failed if o.failure == step_mod.FAILURE_RANK]
        for r, o in failed:
            if r in lost and r in members:
                members[r].health.lose(
                    health_mod.HEALTH_DEAD, f"step {step.step_id}: {o.error}", now
                )
        self._clear_path()
        if lost:
            self.abort_peers(lost)
            log.error("step %d: ranks %s failed: %s", step.step_id, lost, failed[0][1].error)
            raise RankDied(f"step {step.step_id}: ranks {lost} failed", ranks=lost)
        message = f"step {step.step_id}: the step group failed on ranks {[r for r, _ in failed]}"
        log.error("%s (%s); no step path until new groups", message, failed[0][1].error)
        raise ExecutorError(f"{message}: {failed[0][1].error}", ranks=[r for r, _ in failed])

    # -- what the parts need of an executor -----------------------------------------------
    @abc.abstractmethod
    def _send_abort(self, member: roster_mod.Member[Any], reason: str) -> None:
        """Make `member` abort its live groups (`RankWorker.abort_live_groups`) on its health
        lane; not waited for."""

    @abc.abstractmethod
    def _send_ping(self, label: int) -> Any:
        """Start a ping of worker `label` on its health lane; a handle for `_poll_ping`."""

    @abc.abstractmethod
    def _poll_ping(self, handle: Any) -> str | None:
        """None while the ping is pending, else HEALTH_OK or HEALTH_DEAD (the worker is gone)."""

    def _ping_error(self, handle: Any) -> str | None:
        """What a finished ping that made its worker dead said (a `RankFailed` message), if
        anything."""
        return None

    @abc.abstractmethod
    def _set_path(self) -> None:
        """Step the roster's active ranks from the next step on (after a switch)."""

    @abc.abstractmethod
    def _clear_path(self) -> None:
        """No step path until the next switch (a switch that could not go back)."""

    @abc.abstractmethod
    def _tell(self, members: list[roster_mod.Member[Any]]) -> None:
        """Let relabelled workers know their labels (they name them in their logs)."""

    def _prepare(self, left: float | None) -> None:
        """Finish what must not overlap a switch, within `left` s; no-op unless an executor
        prepares anything (Ray: the warm-up of new actors)."""
        return None

    def load_progress(self) -> list[dict[str, Any]]:
        """What each rank has read of the weights it loads (`RankWorker.load_progress`:
        `moe_contract.loading.RankLoad` as JSON), for the ranks that answer at once; asked
        while `start` loads them, from another thread. None here: an executor that cannot
        ask while a load runs."""
        return []

    def free_rank_slots(self) -> int | None:
        """Ranks that could be added now (free capacity), or None when unknown/unbounded."""
        return None

    # -- conveniences built on the primitives ---------------------------------------------
    def start(
        self,
        source: str,
        *,
        placement: Any,
        epoch: int = 0,
        timeout: float | None = None,
    ) -> None:
        """Bring the active ranks up serving: load weights, build epoch's groups, activate.

        placement: a `moe_runtime.eplb.policy.Placement` over `num_ranks` ranks.
        """
        ranks = self.ranks
        n = len(ranks)
        self.collective_rpc(
            "load_weights",
            ranks=ranks,
            timeout=timeout,
            per_rank={r: {"rank": i} for i, r in enumerate(ranks)},
            source=source,
            num_ranks=n,
            placement=placement,
        )
        self.build_groups(ranks, epoch=epoch, timeout=timeout)
        self.switch(ranks, epoch=epoch, placement=placement, timeout=timeout)
        self.collective_rpc("retire_previous", ranks=ranks, timeout=timeout)

    def _close(self) -> None:
        """Stop the parts' threads (the heartbeat, async calls); executors call it first
        when they shut down."""
        self.heartbeat.stop()
        if self._async_pool is not None:
            self._async_pool.shutdown(wait=False, cancel_futures=True)
            self._async_pool = None


def order_ranks(
    infos: Sequence[Mapping[str, Any]],
    *,
    driver_node: str,
    existing_nodes: Sequence[str] = (),
) -> list[int]:
    """Rank order of new workers, as vLLM's RayDistributedExecutor orders them.

    infos: each new worker's `node_id` and `ip`. Returns indices into `infos`: workers on the
    driver's node first, then those on nodes with fewer workers (existing ones counted), then
    by IP and node id; ties keep their order. Pure: data in, data out.
    """
    per_node: dict[str, int] = {}
    for node in [*existing_nodes, *(str(i["node_id"]) for i in infos)]:
        per_node[node] = per_node.get(node, 0) + 1
    return sorted(
        range(len(infos)),
        key=lambda i: (
            infos[i]["node_id"] != driver_node,
            per_node[str(infos[i]["node_id"])],
            str(infos[i]["ip"]),
            str(infos[i]["node_id"]),
        ),
    )
