"""A head that loads or fails to start, as the operator reports it (``plan.load_report``,
``plan.observe.pods``): load progress from the runtime's ``GET /ready`` (the fake runtime
answers with the contract's models, ``moe_contract.loading``) in the Ready condition and
``status.loading``; a head's termination message as a ``LoadFailed`` condition."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest

from moe_contract import loading
from moe_operator import runtime_client
from moe_operator.api import status as status_
from moe_operator.plan import actions, load_report, observe
from tests.support import reconcile_fakes as fakes

Phase = status_.Phase
REFUSED = "cannot open model /models/m/tiny: /models/m/tiny/config.json: model_type 'llama' is not supported"
PROGRESS = loading.LoadProgress(
    activity=loading.ACTIVITY_WEIGHTS,
    ranks_total=2,
    ranks=[
        loading.RankLoad(rank=0, bytes_loaded=12_400_000, bytes_total=30_000_000, done=False),
        loading.RankLoad(rank=1, bytes_loaded=30_100_000, bytes_total=30_100_000, done=True),
    ],
)


def head_pod(
    *, running: bool, failed: str | None = None, waiting: str | None = None
) -> dict[str, Any]:
    """A head pod as the kubelet reports it: not Ready; running (the runtime loads) or
    waiting after a failed start (its last termination carries ``failed``)."""
    container: dict[str, Any] = {"name": "ray-head", "restartCount": 0, "ready": False}
    if running:
        container["state"] = {"running": {"startedAt": fakes.NOW}}
    else:
        container["state"] = {"waiting": {"reason": waiting or "CrashLoopBackOff"}}
    if failed is not None:
        container["restartCount"] = 3
        container["lastState"] = {
            "terminated": {"exitCode": 1, "reason": "Error", "message": failed + "\n"}
        }
    return {
        "kind": "Pod",
        "metadata": {
            "name": "tiny-head-x",
            "namespace": "ml",
            "labels": {"ray.io/cluster": "tiny", "ray.io/node-type": "head"},
        },
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [container],
        },
    }


def loading_runtime(body: loading.ReadyBody | None, seen: list[httpx.Request]) -> Any:
    """A runtime that answers ``GET /ready`` with ``body`` (503, as a loading one does)."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if body is None or request.url.path != "/ready":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(503, json=body.to_json())

    def factory(url: str, token: str | None) -> runtime_client.RuntimeClient:
        return runtime_client.RuntimeClient(
            url, token=token, transport=httpx.MockTransport(handler)
        )

    return factory


def created() -> fakes.FakeApi:
    api: fakes.FakeApi = fakes.FakeApi()
    fakes.run(api, fakes.body(), events=[])
    return api


def ready_condition(status: dict[str, Any]) -> dict[str, Any]:
    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    return ready


# -- what the pods say ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pod", "ip", "failure"),
    [
        (head_pod(running=True), "10.1.2.3", None),
        (head_pod(running=False, failed=REFUSED), None, REFUSED),
        (head_pod(running=True, failed=REFUSED), "10.1.2.3", REFUSED),
    ],
    ids=["loading", "crash-loop", "trying-again"],
)
def test_the_pods_say_where_a_head_loads_and_how_it_last_failed(
    pod: dict[str, Any], ip: str | None, failure: str | None
) -> None:
    seen = observe.pods([pod])
    assert seen.head_loading_ip == ip
    assert (seen.head_failure.message if seen.head_failure else None) == failure


def test_a_ready_head_reports_neither() -> None:
    pod = head_pod(running=True, failed=REFUSED)
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    seen = observe.pods([pod])
    assert seen.head_loading_ip is None and seen.head_failure is None


def test_an_oom_kill_without_a_message_is_named() -> None:
    pod = head_pod(running=False)
    pod["status"]["containerStatuses"][0]["lastState"] = {
        "terminated": {"exitCode": 137, "reason": "OOMKilled"}
    }
    failure = observe.pods([pod]).head_failure
    assert failure is not None and failure.reason == "OOMKilled"
    assert "out of memory" in load_report.failure_text(failure)


# -- the plan --------------------------------------------------------------------------------
def _observed(**kw: Any) -> observe.Observed:
    ray = observe.RayClusterObservation(worker_replicas=2, ready_workers=0, head_ready=False)
    return observe.Observed(raycluster=ray, **kw)


WAITING = [actions.SetPhase(Phase.PROVISIONING, "WaitingForRayCluster", "waiting for the Ray head")]


def test_a_running_head_that_says_nothing_yet_is_looked_at_again_soon() -> None:
    out = load_report.report(
        WAITING,
        observed=_observed(head_loading_ip="10.1.2.3"),
        status=status_.MoEDeploymentStatus(),
    )
    assert out == [actions.Requeue(load_report.LOADING_REQUEUE_SECONDS), *WAITING]


def test_a_resize_is_never_overwritten() -> None:
    steps = [actions.SetPhase(Phase.RESIZING, "ResizeInProgress", "resizing 2->4")]
    failure = observe.HeadFailure(message=REFUSED, reason="Error", exit_code=1, restarts=1)
    out = load_report.report(
        steps, observed=_observed(head_failure=failure), status=status_.MoEDeploymentStatus()
    )
    assert out == steps


@pytest.mark.parametrize(
    ("served", "phase"), [(False, Phase.FAILED), (True, Phase.DEGRADED)], ids=["new", "served"]
)
def test_a_failed_start_is_failed_or_degraded_with_its_reason(served: bool, phase: Phase) -> None:
    failure = observe.HeadFailure(
        message=REFUSED, reason="Error", exit_code=1, restarts=3, waiting="CrashLoopBackOff"
    )
    status = status_.MoEDeploymentStatus(phase=Phase.SERVING if served else None)
    out = load_report.report(WAITING, observed=_observed(head_failure=failure), status=status)
    final = out[-1]
    assert isinstance(final, actions.SetPhase)
    assert (final.phase, final.reason, final.ready) == (phase, "LoadFailed", False)
    assert REFUSED in final.message and "CrashLoopBackOff" in final.message
    assert ("stopped" if served else "did not start") in final.message
    assert actions.Requeue(load_report.FAILED_REQUEUE_SECONDS) in out


def test_a_served_head_that_runs_again_shows_its_load_not_its_last_stop() -> None:
    failure = observe.HeadFailure(
        message="killed", reason="Error", exit_code=143, restarts=1, running=True
    )
    observed = _observed(head_failure=failure, loading=PROGRESS)
    status = status_.MoEDeploymentStatus(phase=Phase.DEGRADED)
    degraded = [actions.SetPhase(Phase.DEGRADED, "RanksMissing", "0 of 2 ranks ready")]
    final = load_report.report(degraded, observed=observed, status=status)[-1]
    assert isinstance(final, actions.SetPhase)
    assert (final.phase, final.reason) == (Phase.DEGRADED, "LoadingModel")
    assert final.message == PROGRESS.message()


# -- whole reconciles --------------------------------------------------------------------------
def test_load_progress_reaches_the_condition_the_status_and_one_event() -> None:
    api = created()
    api.objects[("Pod", "ml", "tiny-head-x")] = head_pod(running=True)
    seen: list[httpx.Request] = []
    body = loading.ReadyBody(status=loading.LOADING, reason=PROGRESS.message(), loading=PROGRESS)
    events: list[tuple[str, str]] = []
    outcome = fakes.run(
        api,
        fakes.body(status=copy.deepcopy(api.status)),
        events=events,
        factory=loading_runtime(body, seen),
    )
    # asked at the head pod itself (the Service routes to ready heads only), with no token
    assert [str(r.url) for r in seen] == ["http://10.1.2.3:8000/ready"]
    assert "authorization" not in seen[0].headers
    ready = ready_condition(api.status)
    assert (api.status["phase"], ready["reason"]) == ("Provisioning", "LoadingModel")
    assert ready["message"] == "loading weights 42.5/60.1 MB, rank 0/2 (1 of 2 ranks loaded)"
    assert api.status["loading"] == {
        "bytesLoaded": 42_500_000,
        "bytesTotal": 60_100_000,
        "ranksReady": 1,
        "ranksTotal": 2,
    }
    assert [r for r, _ in events] == ["LoadingModel"]
    assert outcome.requeue_after == load_report.LOADING_REQUEUE_SECONDS
    # the next look: new figures, no new event
    events.clear()
    fakes.run(
        api,
        fakes.body(status=copy.deepcopy(api.status)),
        events=events,
        factory=loading_runtime(body, seen),
        now=fakes.LATER,
    )
    assert events == []


def test_a_head_in_a_crash_loop_is_failed_with_its_termination_message() -> None:
    api = created()
    api.objects[("Pod", "ml", "tiny-head-x")] = head_pod(running=False, failed=REFUSED)
    events: list[tuple[str, str]] = []
    seen: list[httpx.Request] = []
    fakes.run(
        api,
        fakes.body(status=copy.deepcopy(api.status)),
        events=events,
        factory=loading_runtime(None, seen),
    )
    assert seen == []  # a head that does not run is not asked
    ready = ready_condition(api.status)
    assert (api.status["phase"], ready["reason"]) == ("Failed", "LoadFailed")
    assert REFUSED in ready["message"]
    degraded = [c for c in api.status["conditions"] if c["type"] == "Degraded"][0]
    assert degraded["status"] == "True" and degraded["reason"] == "LoadFailed"
    assert [r for r, _ in events] == ["LoadFailed"] and REFUSED in events[0][1]
    assert "loading" not in api.status
    events.clear()
    fakes.run(api, fakes.body(status=copy.deepcopy(api.status)), events=events, now=fakes.LATER)
    assert events == []  # said once
