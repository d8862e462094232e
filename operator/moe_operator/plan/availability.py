"""Whether the model a deployment names can be served before anything is created for it
(pure): the claim of a ``pvc://`` source must exist in the deployment's namespace.

A head whose model is missing would only restart in a loop; instead the reconcile creates
nothing, says why in the Ready condition (reason ``ModelUnavailable``, the claim named) and in
one warning event, and looks again soon: the deployment starts once the claim is there. Only
the first creation is held back: a deployment whose RayCluster exists keeps it (its pods
hold the claim; Kubernetes keeps a claim in use until they are gone).

A claim that exists but is not bound yet (``Pending``: e.g. a StorageClass that binds when a
pod first uses the claim) is not a problem: the pods wait for it, as any pod does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from moe_operator.api import status as status_
from moe_operator.api import storage
from moe_operator.plan import actions

#: Seconds before a held-back deployment looks for its claim again.
RECHECK_SECONDS: Final = 10.0
#: Actions that create or change something in the cluster or the runtime.
_WRITES: Final = (
    actions.EnsureSecret,
    actions.ApplyRayCluster,
    actions.ApplyService,
    actions.ApplyNetworkPolicy,
    actions.ScaleRuntime,
)


def claim_problem(
    *, source: storage.PvcSource, claim: dict[str, Any] | None, namespace: str
) -> str | None:
    """Why the claim ``claim`` (as read from the API; ``None``: not found) cannot hold the
    model of ``source``, or ``None`` when it can."""
    where = f"persistentvolumeclaim {source.claim!r} in namespace {namespace!r}"
    fix = f"(spec.model.source {source.uri}): create the claim, or change the source"
    if claim is None:
        return f"{where} not found {fix}"
    if (claim.get("metadata") or {}).get("deletionTimestamp"):
        return f"{where} is being deleted {fix}"
    if (claim.get("status") or {}).get("phase") == "Lost":
        return f"{where} lost its PersistentVolume {fix}"
    return None


def hold_back(
    steps: Sequence[actions.Action],
    *,
    problem: str,
    status: status_.MoEDeploymentStatus,
) -> list[actions.Action]:
    """The actions of a reconcile of a deployment not created yet whose model is unavailable:
    no write, phase ``Pending`` with Ready False (``ModelUnavailable``, ``problem``), a
    warning event when that is news, and a recheck soon."""
    reason = status_.REASON_MODEL_UNAVAILABLE
    ready = next((c for c in status.conditions or [] if c.type == status_.CONDITION_READY), None)
    known = ready is not None and ready.reason == reason and ready.message == problem
    kept = [
        a
        for a in steps
        if not isinstance(a, (*_WRITES, actions.SetPhase, actions.Requeue, actions.Event))
    ]
    events = [] if known else [actions.Event(reason, problem)]
    return [
        *kept,
        *events,
        actions.Requeue(RECHECK_SECONDS),
        actions.SetPhase(status_.Phase.PENDING, reason, problem, ready=False),
    ]
