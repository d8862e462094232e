"""The operator's autoscaler on the real node: the load decides the size.

The autoscaling sample (``manifests/samples/moedeployment-autoscaling.yaml``, DP 1 in [1, 3],
8 in flight per rank, up window 15 s; here a 15 s down window and a 2 s sync to keep the
module to a few minutes) serves 2 checked clients, then 16: the operator reads the runtime's
in-flight count, grows it to 2 through the scale subresource once the up window has passed,
and the resize runs on the real KubeRay. The surge stops: after the down window it shrinks
back to 1 while the 2 clients go on. Then 16 clients flap on and off every 4 s, faster than
the up window: no resize at all. Every answer is checked token for token; none fails. The
decisions show in ``kubectl get moed -o wide``, ``kubectl describe``, status, events and the
operator's ``/metrics`` (scraped through its Service); the run is drawn to
``out/e2e-autoscale-timeline.png``.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import yaml

from e2e import kube, timeline
from e2e import load as load_mod
from e2e.cluster import conftest
from e2e.node import config

pytestmark = pytest.mark.cluster

NAME = "tiny"
SAMPLE = conftest.REPO / "manifests" / "samples" / "moedeployment-autoscaling.yaml"
UP_S, DOWN_S, SYNC_S = 15, 15, 2
READY_TIMEOUT_S = 420.0
RESIZE_TIMEOUT_S = 420.0
PICTURE = conftest.REPO / "out" / "e2e-autoscale-timeline.png"


def _sample() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    doc["spec"]["maxDataParallelSize"] = 3  # 16 clients ask for 2: the load decides, not the cap
    doc["spec"]["autoscaling"].update(
        scaleUpStabilizationSeconds=UP_S,
        scaleDownStabilizationSeconds=DOWN_S,
        syncPeriodSeconds=SYNC_S,
    )
    return doc


@pytest.fixture(scope="module")
def endpoint(node: kube.Kubectl, namespace: str) -> Iterator[Callable[[], str | None]]:
    yield from conftest.service_url(node, namespace, NAME)


@pytest.fixture(scope="module")
def dep(node: kube.Kubectl, namespace: str, endpoint: Callable[[], str | None]) -> kube.Deployment:
    return conftest.apply(
        node, namespace, _sample(), endpoint=endpoint, ready=lambda d: d.serving(1),
        what="Serving at DP=1", timeout_s=READY_TIMEOUT_S, tag="autoscale",
    )  # fmt: skip


class Gate:
    """Clients that send only while the gate is open (their URL is ``None`` otherwise)."""

    def __init__(self, url: Callable[[], str | None]) -> None:
        self._url = url
        self.open = threading.Event()

    def url(self) -> str | None:
        return self._url() if self.open.is_set() else None


@pytest.fixture(scope="module")
def run(
    dep: kube.Deployment, reference: dict[tuple[int, int, int | None], list[int]]
) -> Iterator[dict[str, Any]]:
    """The whole story (the tests below check its parts): base load, surge, stop, flapping."""
    sampler = timeline.Sampler(dep.endpoint, interval_s=1.0).start()
    started = time.time()
    base = load_mod.Load(dep.endpoint, model_name=NAME, reference=reference, clients=2)
    surge_gate = Gate(dep.endpoint)
    surge = load_mod.Load(surge_gate.url, model_name=NAME, reference=reference, clients=14)
    flap_gate = Gate(dep.endpoint)
    # short generations: the in-flight count follows the gate within a second or two
    flap = load_mod.Load(
        flap_gate.url, model_name=NAME, reference=reference, clients=16, lengths=(8, 24)
    )
    loads = [base, surge, flap]
    story: dict[str, Any] = {"loads": loads}
    for lg in loads:
        lg.start()
    try:
        kube.wait_for(lambda: base.ok >= 4 or base.failed, timeout_s=180, what="first answers")
        story["history_before"] = len(dep.runtime_status()["history"])

        surge_gate.open.set()
        story["surge_at"] = time.time()
        kube.wait_for(
            lambda: _settled(dep, 2), timeout_s=UP_S + SYNC_S + RESIZE_TIMEOUT_S, what="DP=2"
        )
        story["grown_at"] = time.time()
        story["after_grow"] = dep.status()
        story["wide_after_grow"] = dep.kubectl("get", "moed", NAME, "-n", dep.namespace,
                                               "-o", "wide").stdout  # fmt: skip
        served = surge.ok  # the surge served at 2 for a while (and it stays at 2)
        kube.wait_for(
            lambda: surge.ok >= served + 24 or surge.failed, timeout_s=300, what="answers at 2"
        )
        story["held_at_two"] = dep.status()

        surge_gate.open.clear()
        story["surge_stopped_at"] = time.time()
        kube.wait_for(
            lambda: _settled(dep, 1), timeout_s=DOWN_S + SYNC_S + RESIZE_TIMEOUT_S, what="DP=1"
        )
        story["shrunk_at"] = time.time()
        story["after_shrink"] = dep.status()
        story["history_before_flapping"] = len(dep.runtime_status()["history"])

        flap_started = time.monotonic()
        story["reasons_flapping"] = set()
        while time.monotonic() - flap_started < 24:  # 3 cycles of 4 s on, 4 s off
            on = int((time.monotonic() - flap_started) // 4) % 2 == 0
            (flap_gate.open.set if on else flap_gate.open.clear)()
            reason = (dep.status().get("autoscaling") or {}).get("reason")
            story["reasons_flapping"].add(reason)
            time.sleep(0.5)  # poll interval of the gate; the loop's deadline bounds it
        flap_gate.open.clear()
        story["after_flapping"] = dep.status()
        story["history"] = dep.runtime_status()["history"]
        story["describe"] = dep.kubectl("describe", "moed", NAME, "-n", dep.namespace).stdout
        story["events"] = dep.events()
        kube.wait_for(lambda: base.ok >= 20 or base.failed, timeout_s=180, what="base answers")
    finally:
        for lg in loads:
            lg.stop()
        sampler.stop()
    offset = time.time() - time.monotonic()  # the loads' monotonic times as wall clock
    picture = timeline.Timeline(
        title="e2e/cluster/test_autoscale.py: load decides the size (real node, real KubeRay)",
        start=started,
        end=time.time(),
        tokens=[(t + offset, n) for lg in loads for t, n in lg.token_times],
        samples=sampler.samples,
        resizes=[r for r in story.get("history", []) if (r.get("started_at") or 0) >= started]
        + timeline.provisioning(story.get("events", [])),
        decisions=timeline.events_as_decisions(story.get("events", [])),
        ok=sum(lg.ok for lg in loads),
        failed=sum(lg.failed for lg in loads),
        initial_size=1,
    )
    picture.save_json(PICTURE.with_suffix(".json"))  # to draw it again
    print(f"\n[autoscale] timeline: {timeline.render(picture, PICTURE)}")
    for lg in loads:
        print(f"[autoscale] {lg.summary()}")
    yield story


def _settled(dep: kube.Deployment, size: int) -> dict[str, Any] | None:
    status = dep.serving(size)
    if status is None or len(dep.worker_pods()) != size:
        return None
    return status


def _stamp(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _decisions(story: dict[str, Any], reason: str) -> list[dict[str, Any]]:
    return [e for e in story["events"] if e["reason"] == reason]


def test_load_grows_it_after_the_up_window(run: dict[str, Any]) -> None:
    auto = run["after_grow"]["autoscaling"]
    (up,) = _decisions(run, "ScaledUp")
    assert "dataParallelSize 1->2" in up["message"]
    decided = _stamp(auto["lastDecisionTime"])
    # never before the load asked for more during the whole up window (whole-second stamps)
    assert decided >= run["surge_at"] + UP_S - 1.0, (decided - run["surge_at"], auto)
    print(
        f"\n[autoscale] surge -> ScaledUp {decided - run['surge_at']:.0f}s (window {UP_S}s); "
        f"surge -> serving at 2: {run['grown_at'] - run['surge_at']:.0f}s"
    )
    assert run["held_at_two"]["dataParallelSize"] == 2  # 8 in flight per rank: stable at 2
    header, row = run["wide_after_grow"].splitlines()[:2]
    assert "AUTOSCALER" in header and "DESIRED" in header
    assert any(reason in row for reason in ("ScaledUp", "Stable", "WaitingForResize"))


def test_no_load_shrinks_it_back_to_the_minimum_after_the_down_window(
    run: dict[str, Any],
) -> None:
    status = run["after_shrink"]
    assert status["dataParallelSize"] == 1
    (down,) = _decisions(run, "ScaledDown")
    assert "dataParallelSize 2->1" in down["message"]
    decided = _stamp(status["autoscaling"]["lastDecisionTime"])
    assert decided >= run["surge_stopped_at"] + DOWN_S - 1.0
    print(
        f"\n[autoscale] surge stopped -> ScaledDown {decided - run['surge_stopped_at']:.0f}s "
        f"(window {DOWN_S}s); -> serving at 1: {run['shrunk_at'] - run['surge_stopped_at']:.0f}s"
    )
    assert "ScaledUp" in run["describe"] and "ScaledDown" in run["describe"]


def test_a_flapping_load_resizes_nothing(run: dict[str, Any]) -> None:
    assert len(run["history"]) == run["history_before_flapping"], run["history"][-1]
    assert run["after_flapping"]["dataParallelSize"] == 1
    assert len(_decisions(run, "ScaledUp")) == 1  # the surge's, none since
    # the load did ask for more at times: the window held it back
    assert "ScaleUpStabilizing" in run["reasons_flapping"], run["reasons_flapping"]


def test_exactly_two_resizes_and_no_failed_request(run: dict[str, Any]) -> None:
    resizes = run["history"][run["history_before"] :]
    assert [(r["from"], r["to"], r["stage"]) for r in resizes] == [
        (1, 2, "Completed"),
        (2, 1, "Completed"),
    ]
    for lg in run["loads"]:
        assert lg.failures == [], lg.failures[:5]
    assert sum(lg.ok for lg in run["loads"]) >= 40


def test_the_operator_metrics_hold_the_decisions(
    run: dict[str, Any], node: kube.Kubectl, namespace: str
) -> None:
    if conftest.EXTERNAL_KUBECONFIG:
        forward = kube.PortForward(
            node, namespace=config.OPERATOR_NAMESPACE, target="svc/moe-operator-metrics", port=8081
        )
        url = kube.wait_for(forward.url, timeout_s=30, what="a port-forward")
    else:
        forward = None
        url = kube.wait_for(
            kube.ServiceUrl(
                node, namespace=config.OPERATOR_NAMESPACE, name="moe-operator-metrics", port=8081
            ).url,
            timeout_s=30,
            what="the metrics Service",
        )
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        if forward is not None:
            forward.stop()
    assert 'moe_operator_reconciles_total{result="ok"}' in text
    assert "moe_operator_reconcile_seconds_bucket" in text
    for direction in ("up", "down"):
        assert (
            f'moe_operator_resizes_total{{direction="{direction}",kind="resize",outcome="completed"}}'
            in text
        )
    labels = f'deployment="{NAME}",namespace="{namespace}"'
    for decision in ("scale_up", "scale_down"):
        assert (
            f'moe_operator_autoscaler_decisions_total{{decision="{decision}",{labels}}} 1.0' in text
        )
    assert f"moe_operator_runtime_reachable{{{labels}}} 1.0" in text
    assert PICTURE.exists()
    print(json.dumps({"metrics_bytes": len(text)}))
