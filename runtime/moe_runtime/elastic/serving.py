"""What serves now and how the runtime changes it: the elastic config, the serving state shared
by resizes, rebalances and recoveries, and the expert-load window they plan from."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch

from moe_runtime import step as step_mod
from moe_runtime.eplb import policy
from moe_runtime.eplb import window as window_mod
from moe_runtime.model import config as config_mod


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """How the runtime resizes, rebalances and recovers.

    weight_source: "peer" (new ranks get non-expert weights from serving ranks) or "storage"
    (new ranks read them from the model source). eplb_*: dynamic EPLB while serving (every
    `eplb_step_interval` steps, from the load of the last `eplb_window_size` steps; applied only
    when balancedness improves by at least `eplb_min_gain`). rpc_timeout: seconds for one
    collective call; boundary_timeout: seconds to wait for a step boundary (a boundary call not
    started by then is cancelled); switch_timeout: seconds one switch may take (it goes back to
    the old step path past them). auto_recover: after a rank was lost and the runtime shrank
    around it, grow back to the size before the failure when rank capacity returns.
    hang_timeout: seconds without a heartbeat answer before a rank counts as hung (it is
    fenced); heartbeat_interval: seconds between pings. warm_spare_ranks: workers kept started,
    loaded and in standby groups beside the active ranks (`moe_runtime.elastic.spares`).
    rank_pool: rank processes kept started, weightless, for grows the spares do not cover
    (`moe_runtime.elastic.rank_pool`). slot_multiple: the slots per DP rank divide by it (T in
    the mesh expert layout, `rank.mesh`: each TP rank holds an equal part), at every size.
    """

    source: str
    num_redundant_experts: int = 0
    slot_multiple: int = 1
    weight_source: str = "peer"
    eplb_enabled: bool = True
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000
    eplb_min_gain: float = 0.02
    rpc_timeout: float = 300.0
    boundary_timeout: float = 60.0
    switch_timeout: float = 60.0
    auto_recover: bool = True
    hang_timeout: float = 3.0
    heartbeat_interval: float = 0.1
    warm_spare_ranks: int = 0

    def num_physical_for(self, num_experts: int, num_ranks: int) -> int:
        """The slots of a placement over `num_ranks` DP ranks (`policy.num_physical_for`)."""
        return policy.num_physical_for(
            num_experts, num_ranks * self.slot_multiple, self.num_redundant_experts
        )

    rank_pool: int = 0

    def __post_init__(self) -> None:
        if self.warm_spare_ranks < 0:
            raise ValueError(f"warm_spare_ranks must be >= 0, got {self.warm_spare_ranks}")
        if self.rank_pool < 0:
            raise ValueError(f"rank_pool must be >= 0, got {self.rank_pool}")
        if self.weight_source not in ("peer", "storage"):
            raise ValueError(
                f"weight_source must be 'peer' or 'storage', got {self.weight_source!r}"
            )
        if self.hang_timeout <= 0 or self.heartbeat_interval <= 0:
            raise ValueError("hang_timeout and heartbeat_interval must be > 0")


@dataclasses.dataclass
class Serving:
    """What serves now: the placement over `num_ranks` ranks, and the group epoch.

    generation: bumped by every recovery, so a resize or rebalance that began before one knows
    that what it planned from is gone (it then only releases what it allocated). committing:
    the staging id of an EPLB commit whose step is in flight (a recovery reverts it first).
    left: size -> the placement that size served with when a resize left it (ranks keep their
    index across resizes; a recovery, which renumbers them, clears it): a shrink back to that
    size may take it again, its ranks retain those experts (`retention`).
    """

    placement: policy.Placement
    num_ranks: int
    epoch: int
    next_epoch: int = 1
    next_stage: int = 1_000
    generation: int = 0
    committing: int | None = None
    left: dict[int, policy.Placement] = dataclasses.field(default_factory=dict)
    _ids: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )
    _layout: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )

    def serve(self, placement: policy.Placement, num_ranks: int) -> None:
        """A new placement over a new rank count, both at once for `layout` readers."""
        with self._layout:
            self.placement, self.num_ranks = placement, num_ranks

    def layout(self) -> tuple[policy.Placement, int]:
        """(placement, num_ranks) of one moment: another thread (the status route, while a
        resize or a recovery switches) never sees a placement with the other's rank count."""
        with self._layout:
            return self.placement, self.num_ranks

    def take_epoch(self) -> int:
        """A new group epoch (resizes, recoveries and the warm spares' standby groups take
        them from different threads)."""
        with self._ids:
            epoch = self.next_epoch
            self.next_epoch += 1
            return epoch

    def take_stage(self) -> int:
        with self._ids:
            stage = self.next_stage
            self.next_stage += 1
            return stage


class LoadTracker:
    """Expert load per step (summed over ranks) into a window, for EPLB and balancedness."""

    def __init__(self, config: config_mod.ModelConfig, window_size: int) -> None:
        self._lock = threading.Lock()
        self.window = window_mod.LoadWindow(config.num_moe_layers, config.num_experts, window_size)
        self.steps = 0

    def observe(self, outputs: Sequence[step_mod.StepOutput]) -> None:
        loads = [o.expert_load for o in outputs if isinstance(o.expert_load, torch.Tensor)]
        if not loads:
            return
        with self._lock:
            self.window.record(torch.stack(loads).sum(0))
            self.steps += 1

    def total(self) -> torch.Tensor:
        with self._lock:
            return self.window.total()

    def set_window_size(self, window_size: int) -> None:
        """A window of `window_size` steps that keeps the most recent steps recorded."""
        with self._lock:
            self.window = self.window.resized(window_size)
