"""A ``pvc://`` model whose claim is missing (``plan.availability``, pure): which claims cannot
hold the model, and the plan of a deployment held back (through a whole reconcile:
``test_operator_reconcile``)."""

from __future__ import annotations

from typing import Any

import pytest

from moe_operator.api import status as status_
from moe_operator.api import storage
from moe_operator.plan import actions, availability

SOURCE = storage.PvcSource(claim="models", path="mixtral/tiny")


def claim(phase: str = "Bound", **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "models", "namespace": "ml", **meta},
        "status": {"phase": phase},
    }


@pytest.mark.parametrize(
    ("stored", "problem"),
    [
        (None, "persistentvolumeclaim 'models' in namespace 'ml' not found"),
        (claim(deletionTimestamp="2026-01-01T00:00:00Z"), "is being deleted"),
        (claim("Lost"), "lost its PersistentVolume"),
        (claim("Bound"), None),
        # not bound yet (e.g. a StorageClass that binds when a pod first uses the claim): the
        # pods wait for it as any pod does
        (claim("Pending"), None),
    ],
    ids=["missing", "being-deleted", "lost", "bound", "pending"],
)
def test_a_claim_that_cannot_hold_the_model_is_named(
    stored: dict[str, Any] | None, problem: str | None
) -> None:
    found = availability.claim_problem(source=SOURCE, claim=stored, namespace="ml")
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found
        assert "pvc://models/mixtral/tiny" in found  # what to fix, in the user's words


def test_held_back_the_plan_writes_nothing_and_says_why_once() -> None:
    planned: list[actions.Action] = [
        actions.EnsureSecret(),
        actions.ApplyRayCluster(worker_replicas=2),
        actions.ApplyService(),
        actions.ApplyNetworkPolicy(),
        actions.SetResize(None),
        actions.SetPhase(status_.Phase.PROVISIONING, "WaitingForRayCluster", "waiting"),
    ]
    first = availability.hold_back(planned, problem="gone", status=status_.MoEDeploymentStatus())
    assert first == [
        actions.SetResize(None),
        actions.Event(status_.REASON_MODEL_UNAVAILABLE, "gone"),
        actions.Requeue(availability.RECHECK_SECONDS),
        actions.SetPhase(
            status_.Phase.PENDING, status_.REASON_MODEL_UNAVAILABLE, "gone", ready=False
        ),
    ]
    said = status_.MoEDeploymentStatus(
        conditions=[
            status_.Condition(
                type=status_.CONDITION_READY,
                status=status_.ConditionStatus.FALSE,
                reason=status_.REASON_MODEL_UNAVAILABLE,
                message="gone",
                last_transition_time="2026-01-01T00:00:00Z",
            )
        ]
    )
    again = availability.hold_back(planned, problem="gone", status=said)
    assert not [a for a in again if isinstance(a, actions.Event)]  # no second event
    assert status_.REASON_MODEL_UNAVAILABLE in status_.WARNING_REASONS
