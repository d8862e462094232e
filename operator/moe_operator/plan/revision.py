"""Which spec changes need new pods, and the template revision they make (pure).

A RayCluster's pods are made from its templates once: KubeRay never replaces a running pod
when a template changes (only new pods get it). So the operator splits the spec in two:

- **live** fields (:data:`LIVE_FIELDS`): the size and its bounds, the expert-parallel and
  EPLB settings, the resize timeouts and warm spares, the queue bound, fault tolerance, the
  autoscaler and the rollout's own settings. The runtime takes them without a restart
  (``plan.settings``) or the operator alone reads them; they never start a rollout.
- **template** fields: everything else (``model.source``, ``model.dtype``,
  ``model.servedModelName``, ``model.loadTimeoutSeconds``, every ``ray.*`` field: image,
  pull policy, accelerator, head/worker resources, node selector, tolerations, service
  account, shared memory, env). A new field of the spec is a template field until it is
  listed as live: unknown means "new pods", never a mixed RayCluster.

:func:`revision` hashes the template fields; the RayCluster carries it
(``elasticmoe.io/revision``), and a spec of another revision rolls over to a second
RayCluster (``plan.rollout``) instead of being written into the templates of the running one.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from typing import Any, Final

from moe_operator.api import group
from moe_operator.api import spec as spec_

#: Top-level spec fields (wire names) the running runtime or the operator takes live.
LIVE_FIELDS: Final = frozenset(
    {
        "dataParallelSize",
        "minDataParallelSize",
        "maxDataParallelSize",
        "maxQueuedRequests",
        "expertParallel",
        "elastic",
        "faultTolerance",
        "autoscaling",
        "rollout",
    }
)
#: Template fields added after revisions existed, with the value every older spec meant: at
#: that value a field is left out of the hash, so an operator upgrade rolls no deployment over.
ADDED_LATER: Final = {
    "pipelineParallelSize": 1,
    "pipelineMicroBatchTokens": None,
    "pipelineInterleave": None,
    "expertLayout": None,
}
#: Hex digits of a revision (enough to tell the revisions of one deployment apart).
LENGTH: Final = 10


def template_fields(spec: spec_.MoEDeploymentSpec) -> dict[str, Any]:
    """The spec without its live fields: what the pods are made from."""
    wire = spec.model_dump(by_alias=True, mode="json")
    return {
        key: value
        for key, value in wire.items()
        if key not in LIVE_FIELDS and not (key in ADDED_LATER and ADDED_LATER[key] == value)
    }


def revision(spec: spec_.MoEDeploymentSpec) -> str:
    """The template revision of ``spec`` (hex, :data:`LENGTH` digits)."""
    canonical = json.dumps(template_fields(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:LENGTH]


def changed_fields(old: spec_.MoEDeploymentSpec, new: spec_.MoEDeploymentSpec) -> list[str]:
    """The template fields (dotted wire paths) that differ between two specs."""
    out: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted({*a, *b}):
                walk(a.get(key), b.get(key), f"{where}.{key}" if where else key)
        elif a != b:
            out.append(where)

    walk(template_fields(old), template_fields(new), "")
    return out


def of_raycluster(obj: dict[str, Any] | None) -> str | None:
    """The template revision a stored RayCluster says its pods are made from."""
    meta = (obj or {}).get("metadata") or {}
    value = (meta.get("annotations") or {}).get(group.REVISION)
    return str(value) if value else None


def resized(
    stored: dict[str, Any],
    *,
    metadata: dict[str, Any],
    worker_replicas: int,
    workers_to_delete: Sequence[str],
) -> dict[str, Any]:
    """What to apply to a RayCluster of another revision than the spec: its stored spec with
    only the worker replicas and ``workersToDelete`` changed, so its templates stay the ones
    its pods were made from (a rollout's old RayCluster shrinks, a rolled-back one grows back;
    neither ever gets the new image). ``metadata``: the operator's labels and owner."""
    spec = copy.deepcopy(stored.get("spec") or {})
    for worker_group in spec.get("workerGroupSpecs") or []:
        worker_group["replicas"] = worker_replicas
        strategy = worker_group.setdefault("scaleStrategy", {})
        strategy["workersToDelete"] = sorted(workers_to_delete)
        worker_group["maxReplicas"] = max(
            int(worker_group.get("maxReplicas") or 0), worker_replicas
        )
    meta = dict(metadata)
    meta["annotations"] = {group.REVISION: of_raycluster(stored) or ""}
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta, "spec": spec}
