"""The placement group bundles of a DP rank's actors (`ray_start.start_ranks`): one rank slot
(and one GPU on GPU) per actor, and the scheduling options that put an actor in its bundle."""

from __future__ import annotations

from typing import Any

import ray
import ray.util.scheduling_strategies as ray_sched

from moe_contract import names

RANK_RESOURCE = names.RANK_RESOURCE


def bundles(tp_size: int, *, use_gpu: bool) -> list[dict[str, float]]:
    """The placement group bundles of one DP rank: one rank slot (and one GPU on GPU) for each
    of its T tensor-parallel actors (or P pipeline stages: `tp_size` is then T x P), bundle 0
    the leader's."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    bundle: dict[str, float] = {RANK_RESOURCE: 1}
    if use_gpu:
        bundle["GPU"] = 1
    return [dict(bundle) for _ in range(tp_size)]


def options(pg: Any, index: int, use_gpu: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """The actor options of bundle `index` of `pg`: one rank slot (and one GPU) there, with
    `extra` (the actor's environment)."""
    return dict(
        scheduling_strategy=ray_sched.PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        ),
        resources={RANK_RESOURCE: 1},
        num_gpus=1 if use_gpu else 0,
        **extra,
    )


def free(resource: str) -> float:
    """How much of `resource` the cluster has free now."""
    available: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
    return available.get(resource, 0.0)
