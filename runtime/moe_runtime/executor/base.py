"""The executor seam: how the engine and the resize coordinator reach the ranks.

An executor owns one `RankWorker` per DP rank (a Ray actor, or an object in this process) and
offers one RPC primitive (`collective_rpc`), the lockstep step (`execute_step`), and the
primitives a live resize is made of:

- `add_ranks(count)`: start workers, wait until they answer; they are *pending* (not stepped).
- `build_groups(ranks, epoch=k)`: every listed worker joins the step group and the transfer
  group of epoch k (rendezvous chosen here: a FileStore on one host, else a TCPStore hosted by
  the group's rank 0). Runs in the background: steps keep running on the active group.
- `switch(ranks, epoch=k, placement=p)`: at a step boundary, drop the step graph, `activate`
  epoch k on those workers (worker `ranks[i]` becomes rank i), compile the new step graph.
- `remove_ranks(ranks)`: stop workers, return their infos (pod names for `workersToDelete`).

Rank labels: the active ranks are always 0..n-1 in step order. A pending worker keeps the label
it was given by `add_ranks` (n, n+1, ...) or the label it had when a `switch` left it out, until
it is removed or switched in.

Failures (every path ends in a known state):
- Heartbeat and step deadline: see `health` (`Heartbeat`, inherited by `Executor`); a hung
  worker is fenced at once, a lost one is reported through `on_lost`.
- A failed step: when every stepped worker is healthy the step path is rebuilt on the same
  ranks before `execute_step` raises `ExecutorError` (retry it); otherwise it raises `RankDied`
  naming the lost ranks and leaves no step path (`has_step_path()` is False) until a `switch`.
- A failed `switch` goes back to the old step path: workers that activated the new epoch
  `revert` and the old graph is compiled again; it raises afterwards.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from moe_runtime import step as step_mod
from moe_runtime.executor import health as health_mod
from moe_runtime.executor import weight_moves

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Role of the group used only by `execute_step` collectives (expert dispatch/combine).
STEP_GROUP = "step"
#: Role of the group used only by background weight moves (non-expert and expert transfers).
TRANSFER_GROUP = "transfer"
GROUP_ROLES = (STEP_GROUP, TRANSFER_GROUP)


class ExecutorError(RuntimeError):
    """A call on the ranks failed; `ranks` names the ranks that failed (may be empty)."""

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class RankDied(ExecutorError):
    """A rank's worker is gone (its process or node died, or it was fenced after a hang)."""


class Executor(weight_moves.WeightMoves, health_mod.Heartbeat, abc.ABC):
    """One worker per DP rank, stepped in lockstep. See the module docstring."""

    _async_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # -- ranks ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def ranks(self) -> list[int]:
        """The ranks in the step graph, in step order (always 0..n-1)."""

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    @abc.abstractmethod
    def pending_ranks(self) -> list[int]:
        """Live workers that are not in the step graph (added, or left out by a switch)."""

    @abc.abstractmethod
    def rank_infos(self) -> dict[int, dict[str, Any]]:
        """`RankWorker.info()` of every live worker, active and pending, by rank label."""

    # -- calls ---------------------------------------------------------------------------
    @abc.abstractmethod
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
        """Call `RankWorker.<method>(*args, **kwargs)` on every rank at once; results in order.

        ranks: rank labels to call (default: the active ranks); may name pending workers.
        timeout: seconds to wait for all results; TimeoutError past it.
        background: run in the workers' control lane, so the call overlaps running steps
        (group building, weight transfers). Control calls run one at a time per worker.
        per_rank: extra keyword arguments for some ranks (e.g. each one's rank in a new group).
        The names ranks, timeout, background and per_rank are this call's own: a worker
        method cannot take keyword arguments of those names through it.
        A worker's exception is raised as ExecutorError naming the rank (RankDied if it died).
        """

    def collective_rpc_async(
        self,
        method: str,
        *args: Any,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        background: bool = True,
        per_rank: Mapping[int, Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> concurrent.futures.Future[list[Any]]:
        """`collective_rpc` without blocking the caller (defaults to the control lane)."""
        if self._async_pool is None:
            self._async_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="executor-rpc"
            )
        return self._async_pool.submit(
            self.collective_rpc,
            method,
            *args,
            ranks=ranks,
            timeout=timeout,
            background=background,
            per_rank=per_rank,
            **kwargs,
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
        priority once started, where the executor can (Ray: `ray_actor.SPARE_NICENESS`); a
        grow's new ranks start at the serving ranks' priority, the grow waits for them."""

    @abc.abstractmethod
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
        rendezvous inside the workers and the new groups' collectives.
        """

    @abc.abstractmethod
    def switch(
        self,
        ranks: Sequence[int],
        *,
        epoch: int | None = None,
        placement: Any = None,
        timeout: float | None = None,
    ) -> None:
        """Replace the step graph by one over exactly `ranks` (labels, new step order).

        Call it between steps. With `epoch`, each worker `ranks[i]` first runs
        `activate(epoch, rank=i, num_ranks=len(ranks), placement=placement)`; without it, the
        caller has activated them. Afterwards worker `ranks[i]` is rank i. timeout bounds the
        whole switch. On any failure the old step path serves again (see the module
        docstring) before the error is raised; the workers keep their previous state until
        `collective_rpc("retire_previous")` confirms the switch.
        """

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
    def shutdown(self) -> None:
        """Stop every worker and release what the executor holds."""

    @abc.abstractmethod
    def has_step_path(self) -> bool:
        """A step can run now: the step graph (or its plain-call equivalent) is built."""

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

    def _close_async_pool(self) -> None:
        if self._async_pool is not None:
            self._async_pool.shutdown(wait=False, cancel_futures=True)
            self._async_pool = None


def rpc_targets(
    method: str,
    ranks: Sequence[int] | None,
    *,
    active: Sequence[int],
    members: Mapping[int, T],
) -> tuple[list[int], list[T]]:
    """The rank labels a `collective_rpc` calls (default: the active ones) and their members.

    Raises ValueError naming the labels that have no worker.
    """
    targets = list(active if ranks is None else ranks)
    unknown = [r for r in targets if r not in members]
    if unknown:
        raise ValueError(f"collective_rpc({method}): no worker for ranks {unknown}")
    return targets, [members[r] for r in targets]


def extra_kwargs(per_rank: Mapping[int, Mapping[str, Any]] | None, rank: int) -> dict[str, Any]:
    """The keyword arguments `per_rank` adds for one rank's call."""
    return dict(per_rank.get(rank, {})) if per_rank else {}


def check_switch(ranks: Sequence[int], *, live: Sequence[int], reserved: int = 0) -> dict[int, int]:
    """Validate a switch and return {old label: new label} for every live worker.

    Workers left out keep their label, unless the new ranks 0..len(ranks)-1 take it: then
    they get the next labels above every label in use and below `reserved` (labels handed out
    to workers still starting), in the order of their old labels, so pending workers (warm
    spares, workers being prepared) never block a switch.
    """
    if not ranks:
        raise ValueError("switch needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"switch ranks must be distinct, got {list(ranks)}")
    unknown = sorted(set(ranks) - set(live))
    if unknown:
        raise ValueError(f"switch names ranks {unknown} that are not live workers {sorted(live)}")
    mapping = {old: new for new, old in enumerate(ranks)}
    left_out = [r for r in live if r not in mapping]
    clash = sorted(r for r in left_out if r < len(ranks))
    mapping.update({r: r for r in left_out if r not in clash})
    free = max([len(ranks) - 1, reserved - 1, *live]) + 1
    mapping.update({r: free + i for i, r in enumerate(clash)})
    return mapping


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
