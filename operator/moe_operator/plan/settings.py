"""Spec fields a running runtime takes without a restart (pure).

The head's command line carries the spec as it was when its pod was made (KubeRay never
rolls a pod, and a container restart keeps the pod's command); a later change of these
fields reaches the running runtime through ``PATCH /elastic_ep/config``, compared on every
reconcile with what ``GET /elastic_ep/config`` reports (so a head restarted with old flags is
brought back to the spec too):

| spec | runtime setting | takes effect |
|---|---|---|
| ``expertParallel.eplb.{enabled,windowSize,stepInterval}`` | ``eplb_*`` | the next step |
| ``min/maxDataParallelSize``, ``expertParallel.maxExpertsPerRank`` | size bounds | the next resize request |
| ``expertParallel.numRedundantExperts`` | ``num_redundant_experts`` | the next resize or recovery (sent only while none runs) |
| ``elastic.drainTimeoutSeconds`` | ``drain_timeout`` | the next shrink |
| ``maxQueuedRequests`` | ``max_queued_requests`` | the next arrival |
| (a rollout's switch, ``plan.rollout``) | ``draining`` | the next answer (``Connection: close``) |
| ``elastic.warmSpareRanks`` | ``warm_spare_ranks`` | within a second (spares started or stopped; the RayCluster's spare pods follow the spec at once) |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_operator.api import spec as spec_


def desired(spec: spec_.MoEDeploymentSpec) -> dict[str, Any]:
    """The runtime settings ``spec`` asks for (the runtime's snake_case names)."""
    experts = spec.expert_parallel
    return {
        "eplb_enabled": experts.eplb.enabled,
        "eplb_window_size": experts.eplb.window_size,
        "eplb_step_interval": experts.eplb.step_interval,
        "min_data_parallel_size": spec.min_data_parallel_size,
        "max_data_parallel_size": spec.max_data_parallel_size,
        "max_experts_per_rank": experts.max_experts_per_rank,
        "num_redundant_experts": experts.num_redundant_experts,
        "drain_timeout": spec.elastic.drain_timeout_seconds,
        "max_queued_requests": spec.max_queued_requests,
        "warm_spare_ranks": spec.elastic.warm_spare_ranks,
        # Only a rollout's old runtime drains (``plan.rollout``); one that serves again
        # (a rollout rolled back) stops closing connections.
        "draining": False,
    }


def changes(
    spec: spec_.MoEDeploymentSpec, current: Mapping[str, Any], *, resizing: bool
) -> dict[str, Any]:
    """What to PATCH: the settings the runtime reports and has at another value. The slot
    count is left for later while a resize runs (the runtime refuses it then)."""
    out = {
        name: value
        for name, value in desired(spec).items()
        if name in current and current[name] != value
    }
    if resizing:
        out.pop("num_redundant_experts", None)
    return out
