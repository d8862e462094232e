"""The autoscaler inside one reconcile (in-memory API, fake runtime): the scale subresource is
written with the object's resourceVersion, an HPA that targets the deployment makes it stand
down, a refused write is reported, and the status, events and metrics say what happened."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from moe_contract import status as runtime_status
from moe_operator import metrics, reconcile
from moe_operator.k8s import api as k8s_api
from tests.support import reconcile_fakes as rec

LOG = logging.getLogger("test")


class ScalingApi(rec.FakeApi):
    """The in-memory API plus the scale subresource (``refuse``: the HTTP status to answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.scales: list[tuple[str, int, str | None]] = []
        self.refuse: int | None = None

    async def patch_scale(
        self, *, namespace: str, name: str, replicas: int, resource_version: str | None
    ) -> dict[str, Any]:
        if self.refuse is not None:
            raise k8s_api.ApiError(method="PATCH", url="scale", status=self.refuse, body="no")
        self.scales.append((name, replicas, resource_version))
        return {"spec": {"replicas": replicas}}


def autoscaled(dp: int, *, status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = rec.body(dp=dp, status=status)
    obj["metadata"]["resourceVersion"] = "42"
    obj["spec"]["autoscaling"] = {"enabled": True, "scaleUpStabilizationSeconds": 0}
    return obj


def serve(api: ScalingApi, in_flight: int, *, events: list[tuple[str, str]]) -> reconcile.Outcome:
    rec.run(api, autoscaled(1), events=events)
    rec.make_ready(api, 1)
    status = runtime_status.ElasticStatus(
        data_parallel_size=1, load=runtime_status.Load(running=in_flight, waiting=0)
    )  # an older runtime's load: no in_flight
    factory = rec.runtime_answering(status, [])
    return asyncio.run(
        reconcile.reconcile(
            api=api,  # type: ignore[arg-type]
            body=autoscaled(1, status=api.status),
            events=lambda reason, message: events.append((reason, message)),
            logger=LOG,
            now=rec.LATER,
            runtime_factory=factory,
        )
    )


def test_a_decision_writes_the_scale_subresource_and_says_so() -> None:
    api, events = ScalingApi(), []
    outcome = serve(api, 20, events=events)
    assert api.scales == [("tiny", 3, "42")]  # conditional on the version it decided on
    auto = api.status["autoscaling"]
    assert (auto["reason"], auto["desiredSize"], auto["inFlight"], auto["metric"]) == (
        "ScaledUp",
        3,
        20,
        20.0,
    )
    assert auto["lastDecisionTime"] == rec.LATER
    assert [r for r, _ in events if r == "ScaledUp"] == ["ScaledUp"]
    assert outcome.autoscale_decision == "scale_up"
    assert outcome.requeue_after is not None and outcome.requeue_after <= 5.0


def test_an_hpa_on_the_deployment_makes_it_stand_down() -> None:
    api, events = ScalingApi(), []
    api.objects[("HorizontalPodAutoscaler", "ml", "tiny")] = {
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "tiny", "namespace": "ml"},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "elasticmoe.io/v1alpha1",
                "kind": "MoEDeployment",
                "name": "tiny",
            }
        },
    }
    outcome = serve(api, 20, events=events)
    assert api.scales == []
    assert api.status["autoscaling"]["reason"] == "ExternalAutoscaler"
    assert "HorizontalPodAutoscaler tiny" in api.status["autoscaling"]["message"]
    # said once, at the first reconcile (before the runtime even answered)
    assert [r for r, _ in events].count("ExternalAutoscaler") == 1
    assert outcome.autoscale_decision is None


@pytest.mark.parametrize("code", [409, 403], ids=["conflict", "forbidden"])
def test_a_refused_scale_is_reported(code: int) -> None:
    api, events = ScalingApi(), []
    api.refuse = code
    outcome = serve(api, 20, events=events)
    auto = api.status["autoscaling"]
    assert auto["reason"] == "AutoscaleFailed"
    assert "lastDecisionTime" not in auto
    assert outcome.autoscale_decision == "failed"


def test_the_operator_metrics_count_it() -> None:
    api, events = ScalingApi(), []
    outcome = serve(api, 20, events=events)
    registry = metrics.OperatorMetrics()
    registry.observe("ml", "tiny", outcome)
    text = registry.render().decode()
    assert (
        'moe_operator_autoscaler_decisions_total{decision="scale_up",deployment="tiny",'
        'namespace="ml"} 1.0' in text
    )
    assert 'moe_operator_autoscaler_in_flight_per_rank{deployment="tiny",namespace="ml"} 20.0' in (
        text
    )
    assert 'moe_operator_runtime_reachable{deployment="tiny",namespace="ml"} 1.0' in text
