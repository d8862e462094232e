"""Rollouts driven reconcile by reconcile against an in-memory API, KubeRay played by
``rollout_fakes.World`` and one fake runtime per RayCluster (no cluster)."""

from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Any

import pytest

from moe_operator import metrics
from moe_operator.api import spec as spec_
from moe_operator.api import status as status_
from moe_operator.plan import clock, revision
from tests.support import reconcile_fakes as fakes
from tests.support import rollout_fakes

START = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
NEW_IMAGE = "ghcr.io/elastic-moe/runtime:0.1.0-b"


class Driver:
    """Reconciles one deployment, a second apart, with KubeRay acting between them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, dp: int = 2, **spec: Any) -> None:
        monkeypatch.setenv("MOE_RUNTIME_URL_TEMPLATE", rollout_fakes.URL_TEMPLATE)
        self.api = fakes.FakeApi()
        self.world = rollout_fakes.World(self.api)
        self.events: list[tuple[str, str]] = []
        self.spec: dict[str, Any] = {
            "model": {"source": "synthetic://tiny?seed=0"},
            "dataParallelSize": dp,
            "maxDataParallelSize": 4,
            **spec,
        }
        self.generation = 1
        self.moment = START
        #: the head image of every RayCluster, as each reconcile left it
        self.images: dict[str, set[str]] = {}
        self.heads: dict[str, str] = {}

    @property
    def status(self) -> dict[str, Any]:
        return getattr(self.api, "status", {})

    def change(self, path: str, value: Any) -> None:
        node = self.spec
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
        self.generation += 1

    def step(self) -> None:
        self.world.kuberay()
        body = fakes.body(status=copy.deepcopy(self.status))
        body["spec"] = copy.deepcopy(self.spec)
        body["metadata"]["generation"] = self.generation
        fakes.run(
            self.api,
            body,
            events=self.events,
            now=clock.rfc3339(self.moment),
            factory=self.world.factory,
        )
        self.moment += datetime.timedelta(seconds=1)
        for name, obj in self.world.rayclusters().items():
            head = obj["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
            self.images.setdefault(name, set()).add(head["image"])
            # a RayCluster's head keeps the size it started at (a resize never rewrites it)
            meta = obj["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
            size = meta["elasticmoe.io/initial-data-parallel-size"]
            assert self.heads.setdefault(name, size) == size, f"{name}: head size rewritten"

    def until(self, done: Any, *, steps: int = 80) -> None:
        for _ in range(steps):
            self.step()
            if done():
                return
        raise AssertionError(f"not done after {steps} reconciles: {self.status.get('rollout')}")

    def serve(self) -> None:
        self.until(lambda: self.status.get("phase") == "Serving")

    def rollout(self) -> dict[str, Any]:
        return self.status.get("rollout") or {}

    def finished(self) -> bool:
        return self.rollout().get("stage") in ("Completed", "RolledBack")

    def reasons(self) -> list[str]:
        return [reason for reason, _ in self.events]


def test_an_image_change_moves_capacity_rank_by_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(monkeypatch)
    d.serve()
    d.change("ray.image", NEW_IMAGE)
    d.until(d.finished)
    new = f"tiny-{d.rollout()['toRevision']}"
    assert d.rollout()["stage"] == "Completed"
    assert d.rollout()["ranksMoved"] == 2
    assert set(d.world.rayclusters()) == {new}  # the old one is gone
    assert d.status["rayCluster"] == new and d.status["revision"] == d.rollout()["toRevision"]
    service = d.api.objects[("Service", "ml", "tiny-api")]
    assert service["spec"]["selector"]["ray.io/cluster"] == new
    # never a mixed RayCluster: the old one kept its image, the new one only had the new one
    assert d.images["tiny"] == {spec_.DEFAULT_IMAGE} and d.images[new] == {NEW_IMAGE}
    # maxSurgeRanks 0: the old one gave up a rank first; never more than 2 worker pods
    assert d.world.max_pods == 2
    assert d.world.runtimes[new].scales == [2]
    for reason in ("RolloutStarted", "RolloutSwitched", "RolloutOldDeleted", "RolloutCompleted"):
        assert reason in d.reasons()
    d.step()  # the normal path takes over: nothing more to do
    assert d.status["phase"] == "Serving" and d.status["dataParallelSize"] == 2
    conditions = {c["type"]: c for c in d.status["conditions"]}
    assert conditions["Rollout"]["status"] == "False"
    assert conditions["Rollout"]["reason"] == "RolledOut"


def test_pods_of_the_deleted_cluster_count_until_they_are_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deleting a RayCluster leaves its pods terminating a while (their grace period): the
    new one grows only once they are gone, so the bound holds."""
    d = Driver(monkeypatch)
    d.world.linger = 4
    d.serve()
    d.change("ray.image", NEW_IMAGE)
    d.until(lambda: "tiny" not in d.world.rayclusters())
    d.step()
    assert "worker pods of deleted RayClusters" in d.rollout()["message"]
    d.until(d.finished)
    assert d.rollout()["stage"] == "Completed"
    assert d.world.max_pods == 2


def test_a_surge_starts_the_new_cluster_beside_the_full_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = Driver(monkeypatch, dp=3, rollout={"maxSurgeRanks": 1})
    d.serve()
    d.change("model.source", "synthetic://tiny?seed=1")
    d.until(d.finished)
    assert d.rollout()["stage"] == "Completed"
    assert d.world.max_pods == 4  # 3 + maxSurgeRanks
    (only,) = d.world.rayclusters().values()
    args = only["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "synthetic://tiny?seed=1" in args


def test_the_old_runtime_closes_kept_alive_connections_after_the_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = Driver(monkeypatch)
    d.serve()
    d.world.runtimes["tiny"].in_flight = 1
    d.change("ray.image", NEW_IMAGE)
    d.until(lambda: d.rollout().get("stage") == "Moving")
    assert not d.world.runtimes["tiny"].draining  # it still got the requests until now
    d.step()
    assert d.world.runtimes["tiny"].draining
    new = d.rollout()["toCluster"]
    assert not d.world.runtimes[new].draining
    assert any("draining=True" in message for _, message in d.events)


def test_in_flight_requests_keep_the_old_cluster_until_they_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = Driver(monkeypatch)
    d.serve()
    d.world.runtimes["tiny"].in_flight = 3
    d.change("ray.image", NEW_IMAGE)
    d.until(lambda: d.rollout().get("stage") == "Draining")
    for _ in range(5):
        d.step()
    assert "tiny" in d.world.rayclusters()
    assert "3 requests in flight" in d.rollout()["message"]
    d.world.runtimes["tiny"].in_flight = 0
    d.until(d.finished)
    assert "tiny" not in d.world.rayclusters()


def test_an_old_runtime_that_stops_answering_is_given_the_drain_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its in-flight requests are unknown while its head runs: it is deleted only after
    elastic.drainTimeoutSeconds, not at once."""
    d = Driver(monkeypatch, elastic={"drainTimeoutSeconds": 8})
    d.serve()
    d.change("ray.image", NEW_IMAGE)
    d.until(lambda: d.rollout().get("stage") == "Moving")
    d.world.silent.add("tiny")
    d.until(lambda: d.rollout().get("stage") == "Draining")
    for _ in range(5):
        d.step()
    assert "tiny" in d.world.rayclusters()
    d.until(d.finished)
    assert d.rollout()["stage"] == "Completed" and "tiny" not in d.world.rayclusters()


def test_a_serving_cluster_that_cannot_give_up_ranks_rolls_the_rollout_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """maxSurgeRanks 0 needs the serving RayCluster to shrink first; its runtime does not
    answer, so no new RayCluster is ever made: after readyTimeoutSeconds the rollout ends
    RolledBack, and nothing was deleted."""
    d = Driver(monkeypatch, rollout={"readyTimeoutSeconds": 10})
    d.serve()
    d.world.silent.add("tiny")
    d.change("ray.image", NEW_IMAGE)
    d.until(d.finished, steps=30)
    assert d.rollout()["stage"] == "RolledBack"
    assert "was not started within 10s" in d.rollout()["message"]
    assert set(d.world.rayclusters()) == {"tiny"}


def test_a_new_cluster_that_never_serves_is_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(monkeypatch, rollout={"readyTimeoutSeconds": 30})
    d.serve()
    d.change("ray.image", "ghcr.io/elastic-moe/runtime:does-not-exist")
    bad = f"tiny-{revision.revision(spec_.MoEDeploymentSpec.model_validate(d.spec))}"
    d.world.broken.add(bad)
    d.until(d.finished, steps=60)
    rolled = d.rollout()
    assert rolled["stage"] == "RolledBack"
    assert "did not serve within 30s" in rolled["message"]
    assert "ErrImagePull" in rolled["message"]
    assert "RolledBack" in d.reasons()
    assert set(d.world.rayclusters()) == {"tiny"}
    assert not d.world.runtimes["tiny"].draining
    # the normal resize grows the old one back; its template is still its own
    d.until(lambda: d.status.get("dataParallelSize") == 2 and d.status["phase"] == "Serving")
    assert d.images["tiny"] == {spec_.DEFAULT_IMAGE}
    assert d.status["rayCluster"] in (None, "tiny")
    conditions = {c["type"]: c for c in d.status["conditions"]}
    assert conditions["Rollout"]["reason"] == "RolledBack"
    # the same revision is not tried again
    for _ in range(5):
        d.step()
    assert set(d.world.rayclusters()) == {"tiny"}


def test_a_change_mid_rollout_restarts_from_where_it_stands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = Driver(monkeypatch, dp=3)
    d.serve()
    d.change("ray.image", NEW_IMAGE)
    d.until(lambda: d.rollout().get("stage") == "Moving")
    first = d.rollout()["toCluster"]
    d.change("ray.image", NEW_IMAGE + "-c")
    d.until(d.finished)
    assert "RolloutRestarted" in d.reasons()
    (name,) = d.world.rayclusters()
    assert name not in ("tiny", first)
    assert d.images[name] == {NEW_IMAGE + "-c"}
    assert d.world.max_pods <= 3


def test_paused_holds_the_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(monkeypatch, rollout={"paused": True})
    d.serve()
    d.change("ray.image", NEW_IMAGE)
    for _ in range(5):
        d.step()
    assert set(d.world.rayclusters()) == {"tiny"}
    assert "paused" in d.rollout()["message"]
    d.change("rollout.paused", False)
    d.until(d.finished)
    assert d.rollout()["stage"] == "Completed"


# -- every template field: a rollout, never a mixed RayCluster ------------------------------

TEMPLATE_CHANGES = {
    "image": ("ray.image", NEW_IMAGE),
    "model-source": ("model.source", "synthetic://tiny?seed=7"),
    "dtype": ("model.dtype", "bfloat16"),
    "served-name": ("model.servedModelName", "other"),
    "load-timeout": ("model.loadTimeoutSeconds", 60),
    "pull-policy": ("ray.imagePullPolicy", "Always"),
    "head-resources": ("ray.headResources", {"limits": {"memory": "4Gi"}}),
    "worker-resources": ("ray.workerResources", {"requests": {"cpu": "2"}}),
    "node-selector": ("ray.nodeSelector", {"pool": "b"}),
    "tolerations": ("ray.tolerations", [{"key": "gpu", "operator": "Exists"}]),
    "env": ("ray.env", [{"name": "NCCL_DEBUG", "value": "INFO"}]),
    "service-account": ("ray.serviceAccountName", "runner"),
    "shm": ("ray.sharedMemorySize", "2Gi"),
    "accelerator": ("ray.accelerator", "nvidia.com/gpu"),
    "tensor-parallel": ("tensorParallelSize", 2),
    "pipeline-micro-batch": ("pipelineMicroBatchTokens", 64),
    "pipeline-interleave": ("pipelineInterleave", False),
    "expert-layout": ("expertLayout", "leader"),  # "mesh" needs T > 1 (`api.spec`)
}
LIVE_CHANGES = {
    "size": ("dataParallelSize", 3),
    "bounds": ("maxDataParallelSize", 6),
    "eplb": ("expertParallel.eplb.windowSize", 7),
    "redundant": ("expertParallel.numRedundantExperts", 2),
    "spares": ("elastic.warmSpareRanks", 1),
    "drain": ("elastic.drainTimeoutSeconds", 5),
    "queue": ("maxQueuedRequests", 8),
    "fault": ("faultTolerance.autoRecover", False),
    "autoscaling": ("autoscaling.targetInFlightPerRank", 3),
    "surge": ("rollout.maxSurgeRanks", 1),
}


@pytest.mark.parametrize(("path", "value"), TEMPLATE_CHANGES.values(), ids=TEMPLATE_CHANGES)
def test_a_template_field_rolls_over_and_never_touches_the_serving_template(
    monkeypatch: pytest.MonkeyPatch, path: str, value: Any
) -> None:
    d = Driver(monkeypatch)
    d.serve()
    before = copy.deepcopy(d.world.rayclusters()["tiny"]["spec"]["headGroupSpec"]["template"])
    workers = copy.deepcopy(
        d.world.rayclusters()["tiny"]["spec"]["workerGroupSpecs"][0]["template"]
    )
    d.change(path, value)
    d.step()
    d.step()
    old = d.world.rayclusters()["tiny"]["spec"]
    assert old["headGroupSpec"]["template"] == before
    assert old["workerGroupSpecs"][0]["template"] == workers
    assert d.rollout()["stage"] in ("Starting", "Moving")
    assert path.split(".")[-1] in ".".join(
        revision.changed_fields(
            spec_.MoEDeploymentSpec.model_validate(
                fakes.body()["spec"] | {"maxDataParallelSize": 4}
            ),
            spec_.MoEDeploymentSpec.model_validate(d.spec),
        )
    )


@pytest.mark.parametrize(("path", "value"), LIVE_CHANGES.values(), ids=LIVE_CHANGES)
def test_a_live_field_starts_no_rollout(
    monkeypatch: pytest.MonkeyPatch, path: str, value: Any
) -> None:
    d = Driver(monkeypatch)
    d.serve()
    d.change(path, value)
    for _ in range(3):
        d.step()
    assert set(d.world.rayclusters()) == {"tiny"}
    assert not d.rollout()


def test_a_pipeline_size_change_rolls_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """pipelineParallelSize is a template field (the rank's actors and its pod's devices):
    changing it (EPLB off first, a live change, as the CRD asks at P > 1) rolls over."""
    d = Driver(monkeypatch)
    d.serve()
    d.change("expertParallel.eplb.enabled", False)
    for _ in range(2):
        d.step()
    assert not d.rollout()
    d.change("pipelineParallelSize", 2)
    d.step()
    d.step()
    assert d.rollout()["stage"] in ("Starting", "Moving")


def test_every_spec_field_is_classified() -> None:
    """A new top-level spec field is a template field unless listed live; this test names
    each one, so adding a field means deciding (and testing) which it is."""
    fields = {f.alias or name for name, f in spec_.MoEDeploymentSpec.model_fields.items()}
    tested = {
        path.split(".")[0] for path, _ in (*TEMPLATE_CHANGES.values(), *LIVE_CHANGES.values())
    }
    assert fields - revision.LIVE_FIELDS == {
        "model",
        "ray",
        "tensorParallelSize",
        "pipelineParallelSize",
        "pipelineMicroBatchTokens",
        "pipelineInterleave",
        "expertLayout",
    }
    assert revision.LIVE_FIELDS <= fields
    assert fields <= tested | {"minDataParallelSize", "pipelineParallelSize"}


def test_an_operator_upgrade_keeps_every_revision() -> None:
    """A template field added later (pipelineParallelSize, pipelineMicroBatchTokens) leaves the
    hash of a spec that does not use it as it was: the revision below is what the operator computed before the
    field existed, so upgrading the operator rolls no deployment over."""
    spec = spec_.MoEDeploymentSpec.model_validate(
        {"model": {"source": "synthetic://tiny"}, "dataParallelSize": 2, "ray": {"image": "x:1"}}
    )
    assert revision.revision(spec) == "41fcdfb6eb"
    assert "pipelineParallelSize" not in revision.template_fields(spec)
    assert "pipelineMicroBatchTokens" not in revision.template_fields(spec)
    assert "pipelineInterleave" not in revision.template_fields(spec)
    assert "expertLayout" not in revision.template_fields(spec)
    assert revision.revision(spec.model_copy(update={"tensor_parallel_size": 2})) != "41fcdfb6eb"


def test_the_operator_counts_rollouts(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(monkeypatch)
    d.serve()
    d.change("ray.image", NEW_IMAGE)
    registry = metrics.OperatorMetrics()
    previous = status_.MoEDeploymentStatus.model_validate(d.status)
    for _ in range(40):
        d.step()
        new = status_.MoEDeploymentStatus.model_validate(d.status)
        registry.observe("ml", "tiny", _Outcome(previous=previous, status=new))
        previous = new
        if d.finished():
            break
    text = registry.render().decode()
    assert 'moe_operator_rollouts_total{outcome="Completed"} 1.0' in text
    assert 'moe_operator_rollout_ranks_moved{deployment="tiny",namespace="ml"} 0.0' in text


@dataclasses.dataclass(frozen=True)
class _Outcome:
    previous: status_.MoEDeploymentStatus | None
    status: status_.MoEDeploymentStatus | None
    runtime_reachable: bool | None = None
    autoscale_decision: str | None = None
