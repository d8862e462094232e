"""Spec fields a running runtime takes without a restart (plan.settings), and the reconcile
that sends them (PATCH /elastic_ep/config) when the runtime reports other values."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from moe_contract import status as runtime_status
from moe_operator import reconcile, runtime_client
from moe_operator.api import spec as spec_
from moe_operator.plan import settings
from moe_runtime.elastic import settings as runtime_settings
from tests.support import reconcile_fakes as rec

RUNTIME_NOW = {
    "eplb_enabled": True, "eplb_window_size": 1000, "eplb_step_interval": 3000,
    "min_data_parallel_size": 1, "max_data_parallel_size": 4, "max_experts_per_rank": None,
    "num_redundant_experts": 0, "drain_timeout": 120.0, "max_queued_requests": 1024,
    "num_physical_experts": 8, "pending": [],
}  # fmt: skip


def spec(**extra: Any) -> spec_.MoEDeploymentSpec:
    return spec_.MoEDeploymentSpec.model_validate(
        {"model": {"source": "synthetic://tiny"}, "dataParallelSize": 2,
         "maxDataParallelSize": 4, **extra}
    )  # fmt: skip


def test_nothing_to_change_when_the_runtime_has_the_spec() -> None:
    assert settings.changes(spec(), RUNTIME_NOW, resizing=False) == {}


def test_each_live_field_is_sent_when_it_differs() -> None:
    changed = spec(
        minDataParallelSize=2,
        maxQueuedRequests=10,
        elastic={"drainTimeoutSeconds": 5},
        expertParallel={
            "eplb": {"enabled": False, "windowSize": 10, "stepInterval": 20},
            "maxExpertsPerRank": 6,
            "numRedundantExperts": 4,
        },
    )
    assert settings.changes(changed, RUNTIME_NOW, resizing=False) == {
        "eplb_enabled": False, "eplb_window_size": 10, "eplb_step_interval": 20,
        "min_data_parallel_size": 2, "max_experts_per_rank": 6, "num_redundant_experts": 4,
        "drain_timeout": 5, "max_queued_requests": 10,
    }  # fmt: skip
    # the slot count waits while a resize runs (the runtime would refuse it then)
    assert "num_redundant_experts" not in settings.changes(changed, RUNTIME_NOW, resizing=True)


def test_a_setting_the_runtime_does_not_report_is_not_sent() -> None:
    older = {k: v for k, v in RUNTIME_NOW.items() if k != "max_queued_requests"}
    assert settings.changes(spec(maxQueuedRequests=3), older, resizing=False) == {}


def test_reconcile_patches_the_runtime_live() -> None:
    patches: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/elastic_ep/config":
            if request.method == "PATCH":
                patches.append(json.loads(request.content))
            return httpx.Response(200, json=RUNTIME_NOW)
        return httpx.Response(
            200, json=runtime_status.ElasticStatus(data_parallel_size=2).to_json()
        )

    def factory(url: str, token: str | None) -> runtime_client.RuntimeClient:
        return runtime_client.RuntimeClient(
            url, token=token, transport=httpx.MockTransport(handler)
        )

    api, events = rec.FakeApi(), []
    rec.run(api, rec.body(), events=events)
    rec.make_ready(api, 2)
    obj = rec.body(status=api.status)
    obj["spec"]["expertParallel"] = {"eplb": {"enabled": False}}
    asyncio.run(
        reconcile.reconcile(
            api=api,  # type: ignore[arg-type]
            body=obj,
            events=lambda reason, message: events.append((reason, message)),
            logger=rec.LOG,
            runtime_factory=factory,
        )
    )
    assert patches == [{"eplb_enabled": False}]
    assert any(reason == "SettingsApplied" and "eplb_enabled=False" in m for reason, m in events)


def test_every_setting_the_operator_sends_is_one_the_runtime_takes_and_reports() -> None:
    """The operator's names (``draining`` included, a rollout's) are the runtime's: a rename
    on either side fails here."""
    spec = spec_.MoEDeploymentSpec.model_validate(
        {"model": {"source": "synthetic://tiny"}, "dataParallelSize": 2}
    )
    sent = set(settings.desired(spec))
    assert sent <= set(runtime_settings.ConfigPatch.model_fields)
    assert sent <= set(runtime_settings.Config.model_fields)
