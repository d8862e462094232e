"""Rollouts on the real node (docs/ROLLOUTS.md): a template change of a live deployment moves
its capacity rank by rank to a second RayCluster, under a checked load.

The sample deployment (DP=2, minDataParallelSize 1) serves a load through its Service's
ClusterIP (kube-proxy, as in-cluster clients reach it: the Service's selector decides where a
new connection goes; the clients keep their connections alive). Every answer (greedy, seeded,
streamed and not, up to 96 tokens) is checked token for token.

1. ``spec.ray.image`` → a second tag of the runtime image (``ctr images tag`` in the node's
   containerd: the same image under another name, so new pods of a new revision): zero failed
   requests, the old RayCluster gone, never more than 2 worker pods (maxSurgeRanks 0), the
   rollout visible in ``status.rollout``, ``kubectl get moed -o wide`` and the events.
2. ``spec.ray.image`` → a tag that exists nowhere (maxSurgeRanks 1): the new head never starts
   (ErrImagePull), the rollout rolls back by itself after ``readyTimeoutSeconds`` with the
   reason in status, and the deployment serves at 2 ranks throughout.
3. ``spec.model.source`` → another seed of the synthetic model: answers match the old model
   before the switch and the new one after it; none fails.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e import kube
from e2e import load as load_mod
from e2e.cluster import conftest
from e2e.node import install, stack

pytestmark = pytest.mark.cluster

NAME = "tiny"
READY_TIMEOUT_S = 420.0
ROLLOUT_TIMEOUT_S = 900.0
#: The new RayCluster's time to serve before a rollback (the sample's head serves in ~1 min).
NEW_READY_TIMEOUT_S = 240
SECOND_TAG_SUFFIX = "-rollout"
#: A registry on loopback where nothing listens: the pull is refused at once (no outside
#: lookup), as an image that exists nowhere would be.
MISSING_IMAGE = "127.0.0.1:1/elastic-moe/runtime:does-not-exist"
#: The missing image's rollout: the pull fails in seconds, so a short wait shows the rollback.
MISSING_READY_TIMEOUT_S = 30
NEW_SOURCE = "synthetic://tiny?seed=1"


def _spec() -> dict[str, Any]:
    doc = conftest.sample()
    spec = doc["spec"]
    assert isinstance(spec, dict)
    spec["rollout"] = {"maxSurgeRanks": 0, "readyTimeoutSeconds": NEW_READY_TIMEOUT_S}
    return doc


@pytest.fixture(scope="module")
def second_tag(node: kube.Kubectl) -> str:
    """The runtime image under a second name in the node's containerd."""
    if not isinstance(node, stack.Node):
        pytest.skip("tags the image in the local node's containerd (e2e/node)")
    source = f"{install.RUNTIME_IMAGE_REPO}:{install.project_version()}"
    target = source + SECOND_TAG_SUFFIX
    install.ctr("images", "rm", target, check=False, paths=node.paths)
    install.ctr("images", "tag", source, target, paths=node.paths)
    return target


@pytest.fixture(scope="module")
def dep(node: kube.Kubectl, namespace: str) -> kube.Deployment:
    started = time.monotonic()
    node.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(_spec()))
    service = kube.ServiceUrl(node, namespace=namespace, name=f"{NAME}-api", port=8000)
    d = kube.Deployment(cluster=node, name=NAME, namespace=namespace, endpoint=service.url)
    kube.wait_for(lambda: d.serving(2), timeout_s=READY_TIMEOUT_S, what="DP=2 Serving")
    print(f"\n[rollout] kubectl apply -> Serving at DP=2: {time.monotonic() - started:.1f}s")
    return d


class Watch:
    """Polls the deployment while a rollout runs: the most worker pods of all its
    RayClusters at once, the rollout stages ``kubectl get moed -o wide`` printed."""

    def __init__(self, dep: kube.Deployment) -> None:
        self.dep = dep
        self.max_workers = 0
        self.max_heads = 0
        self.wide: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _count(self, node_type: str) -> int:
        done = self.dep.kubectl(
            "get", "pods", "-n", self.dep.namespace, "-l",
            f"elasticmoe.io/deployment={NAME},ray.io/node-type={node_type}", "-o", "json",
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            return 0
        return len(json.loads(done.stdout)["items"])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_workers = max(self.max_workers, self._count("worker"))
            self.max_heads = max(self.max_heads, self._count("head"))
            done = self.dep.kubectl(
                "get", "moed", NAME, "-n", self.dep.namespace, "-o", "wide", "--no-headers",
                check=False,
            )  # fmt: skip
            if done.returncode == 0 and (not self.wide or self.wide[-1] != done.stdout.strip()):
                self.wide.append(done.stdout.strip())
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _patch(dep: kube.Deployment, spec: dict[str, Any]) -> None:
    body = json.dumps({"spec": spec})
    dep.kubectl("patch", "moed", NAME, "-n", dep.namespace, "--type=merge", "-p", body)


def _rollout(dep: kube.Deployment) -> dict[str, Any]:
    rollout: dict[str, Any] = dep.status().get("rollout") or {}
    return rollout


def _rayclusters(dep: kube.Deployment) -> list[str]:
    done = dep.kubectl("get", "raycluster", "-n", dep.namespace, "-o", "json")
    return sorted(r["metadata"]["name"] for r in json.loads(done.stdout)["items"])


def _ended(dep: kube.Deployment, *, seen: set[str]) -> dict[str, Any] | None:
    """The rollout once it ended, ignoring the earlier ones (their ``toRevision`` in
    ``seen``)."""
    rollout = _rollout(dep)
    if rollout.get("toRevision") in seen:
        return None
    if rollout.get("stage") not in ("Completed", "RolledBack"):
        return None
    return rollout


def _earlier(dep: kube.Deployment) -> set[str]:
    status = dep.status()
    return {r for r in (status.get("revision"), _rollout(dep).get("toRevision")) if r}


class EitherModel(load_mod.Load):
    """A load whose answers must each be one of several models' (a model switch)."""

    def __init__(
        self, *args: Any, references: list[dict[tuple[int, int, int | None], list[int]]],
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, reference=None, **kwargs)
        self.references = references

    def _check(self, case: load_mod.Case, got: list[int]) -> str | None:
        if any(got == reference[case.key] for reference in self.references):
            return None
        return f"{case}: the answer is neither model's ({len(got)} tokens)"


@pytest.fixture(scope="module")
def load(
    dep: kube.Deployment, reference: dict[tuple[int, int, int | None], list[int]]
) -> Iterator[load_mod.Load]:
    with kube.checked_load(dep, model_name=NAME, reference=reference, tag="rollout") as lg:
        yield lg


def test_an_image_change_moves_capacity_rank_by_rank_with_no_failed_request(
    dep: kube.Deployment, load: load_mod.Load, second_tag: str
) -> None:
    before = dep.status()
    assert before.get("revision") and _rayclusters(dep) == [NAME]
    ok_before = load.ok
    watch = Watch(dep)
    started = time.monotonic()
    try:
        seen = _earlier(dep)
        _patch(dep, {"ray": {"image": second_tag}})
        rollout = kube.wait_for(
            lambda: _ended(dep, seen=seen), timeout_s=ROLLOUT_TIMEOUT_S, what="the rollout to end"
        )
        kube.wait_for(lambda: dep.serving(2), timeout_s=READY_TIMEOUT_S, what="DP=2 Serving")
    finally:
        watch.stop()
    print(f"\n[rollout] image rollout 2 ranks: {time.monotonic() - started:.1f}s; "
          f"max worker pods {watch.max_workers}, heads {watch.max_heads}")  # fmt: skip
    for line in watch.wide:
        print(f"[rollout] {line}")
    assert rollout["stage"] == "Completed", rollout
    assert rollout["ranksMoved"] == 2 and rollout["fromRevision"] == before["revision"]
    new = f"{NAME}-{rollout['toRevision']}"
    status = dep.status()
    assert status["rayCluster"] == new and status["revision"] == rollout["toRevision"]
    # the old RayCluster is gone, the new one runs the second tag only
    kube.wait_for(lambda: _rayclusters(dep) == [new], timeout_s=120, what="the old RayCluster gone")
    pods = json.loads(
        dep.kubectl("get", "pods", "-n", dep.namespace, "-l", f"ray.io/cluster={new}",
                    "-o", "json").stdout
    )["items"]  # fmt: skip
    assert pods and {p["spec"]["containers"][0]["image"] for p in pods} == {second_tag}
    # maxSurgeRanks 0: never more than dataParallelSize worker pods (+ the new head)
    assert watch.max_workers <= 2, watch.max_workers
    assert watch.max_heads <= 2, watch.max_heads
    # visible as it went: the wide column, the condition, the events
    assert any("Moving" in line for line in watch.wide), watch.wide
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Rollout"]["reason"] == "RolledOut"
    reasons = {e["reason"] for e in dep.events()}
    assert {"RolloutStarted", "RolloutSwitched", "RolloutCompleted"} <= reasons, reasons
    # served all along, nothing failed
    assert load.ok > ok_before
    assert load.failures == []


def test_a_missing_image_rolls_back_by_itself_and_keeps_serving_at_its_size(
    dep: kube.Deployment, load: load_mod.Load
) -> None:
    serving = dep.status()["rayCluster"]
    watch = Watch(dep)
    sizes: list[int] = []
    stop = threading.Event()

    def sample_sizes() -> None:
        while not stop.is_set():
            size = dep.status().get("dataParallelSize")
            if isinstance(size, int):
                sizes.append(size)
            stop.wait(2.0)

    sampler = threading.Thread(target=sample_sizes, daemon=True)
    sampler.start()
    try:
        seen = _earlier(dep)
        _patch(
            dep,
            {
                "ray": {"image": MISSING_IMAGE},
                "rollout": {
                    "maxSurgeRanks": 1,
                    "readyTimeoutSeconds": MISSING_READY_TIMEOUT_S,
                },
            },
        )
        rollout = kube.wait_for(
            lambda: _ended(dep, seen=seen),
            timeout_s=MISSING_READY_TIMEOUT_S + 300,
            what="the rollout to roll back",
        )
    finally:
        stop.set()
        sampler.join(timeout=30)
        watch.stop()
    assert rollout["stage"] == "RolledBack", rollout
    assert f"did not serve within {MISSING_READY_TIMEOUT_S}s" in rollout["message"]
    assert "ErrImagePull" in rollout["message"] or "ImagePullBackOff" in rollout["message"]
    assert _rayclusters(dep) == [serving]
    assert min(sizes) == 2, sizes  # maxSurgeRanks 1: the serving one never gave up a rank
    assert watch.max_workers <= 3
    conditions = {c["type"]: c for c in dep.status()["conditions"]}
    assert conditions["Rollout"]["reason"] == "RolledBack"
    assert "RolledBack" in {e["reason"] for e in dep.events()}
    assert load.failures == []


def test_a_new_model_source_switches_answers_with_no_failed_request(
    dep: kube.Deployment,
    load: load_mod.Load,
    second_tag: str,
) -> None:
    """Seed 0 → seed 1: checked against seed 0 before, against seed 1 after, and during the
    switch each answer must be one of the two models' answers."""
    load.stop()
    assert load.failures == []
    old = load_mod.reference_tokens(conftest.sample_model())
    new = load_mod.reference_tokens(NEW_SOURCE)
    assert old != new  # the two seeds answer differently
    during = EitherModel(dep.endpoint, model_name=NAME, references=[old, new], clients=2)
    with during:
        seen = _earlier(dep)
        _patch(
            dep,
            {
                "model": {"source": NEW_SOURCE},
                "ray": {"image": second_tag},
                "rollout": {"readyTimeoutSeconds": NEW_READY_TIMEOUT_S},  # the case above's 60
            },
        )
        rollout = kube.wait_for(
            lambda: _ended(dep, seen=seen),
            timeout_s=ROLLOUT_TIMEOUT_S,
            what="the model rollout to end",
        )
    print(f"\n[rollout] model switch: {during.summary()}")
    assert rollout["stage"] == "Completed", rollout
    assert during.failures == [], during.failures[:5]
    assert during.ok > 0
    with load_mod.Load(dep.endpoint, model_name=NAME, reference=new, clients=2) as after:
        kube.wait_for(lambda: after.ok >= 8 or after.failed, timeout_s=180, what="new answers")
    assert after.failures == [], after.failures[:5]
