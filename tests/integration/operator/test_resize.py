"""Live resizes driven by the real operator process against a real kube-apiserver and a fake
runtime HTTP server (``FakeRuntime``: the admin routes of DESIGN §4 with a scripted stage
progression, records shaped by ``moe_runtime.elastic.records``). The test plays KubeRay and
the kubelet: it creates the Ray pods (Ready) and deletes the ones named in workersToDelete;
like the real KubeRay it never clears that list (the real-node tier runs the real thing).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e import kube
from e2e.controlplane import cluster
from moe_runtime.elastic import records, stages
from tests.integration.operator import conftest as ops

pytestmark = pytest.mark.controlplane

NAME = "tiny"
NUM_EXPERTS = 8
MAX_EXPERTS_PER_RANK = 4  # so size 1 (8 slots per rank) is refused by the runtime
UP = ["Provisioning", "Standby", "Transferring", "Switching", "Reshuffling", "Completed"]
DOWN = ["Reshuffling", "Migrating", "Switching", "Releasing", "Completed"]


class FakeRuntime:
    """The admin API of ``moe-runtime serve`` on 127.0.0.1 with a scripted resize.

    A running resize enters its next stage on a ``GET /elastic_ep/status`` once the current
    stage was reported by an earlier GET and ``dwell`` seconds passed: every stage is seen by
    the operator at least once, whatever its polling cadence.
    """

    def __init__(self, *, size: int = 2, dwell: float = 0.3) -> None:
        self.lock = threading.Lock()
        self.size = size
        self.dwell = dwell
        self.pods = [f"{NAME}-ranks-worker-{uuid.uuid4().hex[:5]}" for _ in range(size)]
        #: Worker pods that exist but run no rank (new ranks go there, as on Ray nodes).
        self.spare: list[str] = []
        self.current: records.ResizeRecord | None = None
        self.seen = False
        self.history: list[records.ResizeRecord] = []
        self.posts: list[int] = []
        self.answers: list[int] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    # -- behaviour ---------------------------------------------------------------------------
    def scale(self, new_size: int) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.posts.append(new_size)
            running = self.current
            if running is not None and not running.done:
                if running.to_size == new_size:
                    return 202, self._summary(running)
                return 409, _error(f"a resize to {running.to_size} runs; retry when it ends")
            need = -(-NUM_EXPERTS // new_size)
            if need > MAX_EXPERTS_PER_RANK:
                return 400, _error(
                    f"new_data_parallel_size {new_size} is too small to hold every expert: "
                    f"{NUM_EXPERTS} experts + 0 redundant need {need} slots per rank, but a "
                    f"rank holds at most {MAX_EXPERTS_PER_RANK}"
                )
            record = records.ResizeRecord(
                resize_id=uuid.uuid4().hex[:12], from_size=self.size, to_size=new_size
            )
            record.enter(stages.stages_for(self.size, new_size)[0])
            self.current, self.seen = record, False
            return 202, self._summary(record)

    def _advance(self) -> None:
        record = self.current
        if record is None or record.done:
            return
        if not self.seen or time.time() - record.stage_started_at < self.dwell:
            self.seen = True
            return
        order = stages.stages_for(record.from_size, record.to_size)
        following = order[order.index(record.stage) + 1]
        if following is stages.Stage.COMPLETED:
            if record.to_size < record.from_size:
                record.freed = [
                    {"rank": r, "pod": pod}
                    for r, pod in enumerate(self.pods)
                    if r >= record.to_size
                ]
                self.pods = self.pods[: record.to_size]
            else:
                grow = record.to_size - record.from_size
                self.spare += [
                    f"{NAME}-ranks-worker-{uuid.uuid4().hex[:5]}"
                    for _ in range(grow - len(self.spare))
                ]
                self.pods, self.spare = self.pods + self.spare[:grow], self.spare[grow:]
            self.size = record.to_size
            record.message = f"Scaled to {record.to_size} data parallel engines"
            record.enter(following)
            self.history.append(record)
        else:
            record.enter(following)
        self.seen = True

    def status(self) -> dict[str, Any]:
        with self.lock:
            self._advance()
            running = self.current if self.current is not None and not self.current.done else None
            last = self.current or (self.history[-1] if self.history else None)
            return {
                "data_parallel_size": self.size,
                "target_data_parallel_size": running.to_size if running else self.size,
                "is_scaling": running is not None,
                "stage": (last.stage.value if last else "Idle"),
                "resize": last.to_json() if last else None,
                "history": [r.to_json() for r in self.history],
                "ranks": [
                    {"rank": r, "pod": pod, "active": True, "healthy": True, "node_id": None}
                    for r, pod in enumerate(self.pods)
                ],
                "eplb": {"balancedness": 1.0},
            }

    def records_for(self, from_size: int, to_size: int) -> list[dict[str, Any]]:
        with self.lock:
            return [
                r.to_json()
                for r in self.history
                if (r.from_size, r.to_size) == (from_size, to_size)
            ]

    @staticmethod
    def _summary(record: records.ResizeRecord) -> dict[str, Any]:
        return {
            "resize_id": record.resize_id,
            "from": record.from_size,
            "to": record.to_size,
            "stage": record.stage.value,
        }

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, code: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/health":
                    self._send(200, {"status": "ok"})
                elif self.path == "/elastic_ep/status":
                    self._send(200, fake.status())
                else:
                    self._send(404, _error("not found"))

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path.split("?")[0] != "/scale_elastic_ep":
                    self._send(404, _error("not found"))
                    return
                code, payload = fake.scale(int(body["new_data_parallel_size"]))
                with fake.lock:
                    fake.answers.append(code)
                self._send(code, payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        return Handler


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None}}


@dataclasses.dataclass
class Deployment:
    plane: cluster.ControlPlane
    namespace: str
    runtime: FakeRuntime

    def get(self) -> dict[str, Any]:
        obj = ops.get_json(self.plane, "moed", NAME, namespace=self.namespace)
        assert obj is not None
        return obj

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.get().get("status") or {}
        return status

    def resize(self) -> dict[str, Any]:
        resize: dict[str, Any] = self.status().get("resize") or {}
        return resize

    def raycluster(self) -> dict[str, Any]:
        obj = ops.get_json(self.plane, "raycluster", NAME, namespace=self.namespace)
        assert obj is not None
        return obj

    def workers(self) -> dict[str, Any]:
        group: dict[str, Any] = self.raycluster()["spec"]["workerGroupSpecs"][0]
        return group

    def _pod(self, name: str, node_type: str) -> None:
        """A Ray pod as KubeRay labels it, Running and Ready as the kubelet would report."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                # KubeRay's labels, and the template's (ours: the operator watches those pods)
                "labels": {
                    "ray.io/cluster": NAME,
                    "ray.io/node-type": node_type,
                    "elasticmoe.io/deployment": NAME,
                    "app.kubernetes.io/managed-by": "elastic-moe",
                },
            },
            "spec": {"containers": [{"name": "ray", "image": "none"}]},
        }
        self.plane.kubectl("apply", "-f", "-", input=json.dumps(pod))
        status = {"status": {"phase": "Running",
                             "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
        self.plane.kubectl(
            "patch", "pod", name, "-n", self.namespace, "--subresource=status",
            "--type=merge", "-p", json.dumps(status),
        )  # fmt: skip

    def pods(self) -> list[str]:
        listing = ops.get_json(
            self.plane, "pods", "-l", f"ray.io/cluster={NAME},ray.io/node-type=worker",
            namespace=self.namespace,
        )  # fmt: skip
        assert listing is not None
        return sorted(p["metadata"]["name"] for p in listing["items"])

    def set_ready_workers(self, ready: int) -> None:
        """Play KubeRay: a Ready head pod and ``ready`` Ready worker pods (the ranks' pods
        first, then spare ones the runtime's next grow takes)."""
        if self.plane.kubectl("get", "sa", "default", "-n", self.namespace,
                              check=False).returncode != 0:  # fmt: skip
            self.plane.kubectl("create", "sa", "default", "-n", self.namespace)
        self._pod(f"{NAME}-head-x", "head")
        with self.runtime.lock:
            extra = ready - len(self.runtime.pods) - len(self.runtime.spare)
            self.runtime.spare += [
                f"{NAME}-ranks-worker-{uuid.uuid4().hex[:5]}" for _ in range(max(extra, 0))
            ]
            names = (self.runtime.pods + self.runtime.spare)[:ready]
        for name in names:
            self._pod(name, "worker")

    def kuberay_deletes(self) -> list[str]:
        """Play KubeRay: delete the pods named in workersToDelete (never clearing the list)."""
        names: list[str] = (self.workers().get("scaleStrategy") or {}).get("workersToDelete") or []
        for name in names:
            self.plane.kubectl("delete", "pod", name, "-n", self.namespace, "--ignore-not-found")
        return names

    def scale(self, replicas: int) -> None:
        self.plane.kubectl("scale", "moed", NAME, "-n", self.namespace, f"--replicas={replicas}")

    def wait_completed(self, to_size: int, *, timeout: float = 60) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            status = self.status()
            resize = status.get("resize") or {}
            if resize.get("stage") == "Failed":
                raise AssertionError(f"resize failed: {resize}")
            ok = (resize.get("stage"), resize.get("toSize"), status.get("dataParallelSize")) == (
                "Completed",
                to_size,
                to_size,
            )
            return status if ok else None

        return ops.wait_for(done, timeout=timeout, what=f"a completed resize to {to_size}")

    def events(self) -> list[str]:
        listing = ops.get_json(
            self.plane, "events", "--field-selector", f"involvedObject.name={NAME}",
            namespace=self.namespace,
        )  # fmt: skip
        assert listing is not None
        items = sorted(listing["items"], key=lambda e: e["metadata"]["creationTimestamp"])
        return [e["reason"] for e in items]


@pytest.fixture
def deployment(
    control_plane: cluster.ControlPlane, operator: ops.OperatorProcess, namespace: str
) -> Iterator[Deployment]:
    """A MoEDeployment serving at DP 2 through the fake runtime."""
    runtime = FakeRuntime(size=2)
    runtime.start()
    doc = yaml.safe_load(ops.SAMPLE.read_text())
    doc["metadata"]["annotations"] = {"elasticmoe.io/runtime-url": runtime.url}
    doc["spec"]["expertParallel"] = {"maxExpertsPerRank": MAX_EXPERTS_PER_RANK}
    doc["spec"]["elastic"] = {"resizeTimeoutSeconds": 120}
    control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    dep = Deployment(plane=control_plane, namespace=namespace, runtime=runtime)
    ops.wait_for(
        lambda: ops.get_json(control_plane, "raycluster", NAME, namespace=namespace),
        what="the RayCluster",
    )
    dep.set_ready_workers(2)
    ops.wait_for(lambda: dep.status().get("phase") == "Serving", what="phase Serving")
    try:
        yield dep
    finally:
        control_plane.kubectl("delete", "moed", NAME, "-n", namespace, "--wait=false")
        runtime.stop()


def test_head_gets_the_elastic_flags(deployment: Deployment) -> None:
    args = deployment.raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "args"
    ][0]
    for flag in ("--max-experts-per-rank 4", "--min-data-parallel-size 1",
                 "--max-data-parallel-size 4", "--eplb ", "--num-redundant-experts 0"):  # fmt: skip
        assert flag in args


def test_scale_up_then_down_mirrors_every_stage(deployment: Deployment) -> None:
    dep = deployment
    done = dep.plane.kubectl(
        "wait", "--for=condition=Ready", f"moed/{NAME}", "-n", dep.namespace, "--timeout=30s"
    )
    assert done.returncode == 0
    watch = kube.StageWatch(dep.plane, NAME, dep.namespace)
    try:
        dep.scale(4)
        ops.wait_for(
            lambda: dep.workers()["replicas"] == 4 and dep.resize().get("stage") == "Provisioning",
            what="Provisioning with 4 worker replicas",
        )
        assert dep.runtime.posts == []  # the runtime waits for the workers
        ready = {c["type"]: c for c in dep.status()["conditions"]}
        assert ready["Ready"]["status"] == "True"
        assert (ready["Resizing"]["status"], ready["Resizing"]["reason"]) == (
            "True",
            "Provisioning",
        )
        dep.set_ready_workers(4)
        status = dep.wait_completed(4)
        assert status["resize"]["resizeId"] == dep.runtime.history[-1].resize_id
        assert set(status["resize"]["stageDurations"]) >= {"Provisioning", "Standby"}
        ops.wait_for(lambda: watch.stages(4)[-1:] == ["Completed"], what="the watch to catch up")
        assert watch.stages(4) == UP
        assert dep.runtime.posts == [4]

        dep.scale(2)
        status = dep.wait_completed(2)
        ops.wait_for(lambda: watch.stages(2)[-1:] == ["Completed"], what="the watch to catch up")
        assert watch.stages(2) == DOWN
        assert dep.runtime.posts == [4, 2]
        (record,) = dep.runtime.records_for(4, 2)
        freed = sorted(f["pod"] for f in record["freed"])
        workers = dep.workers()
        assert workers["replicas"] == 2
        assert sorted(workers["scaleStrategy"]["workersToDelete"]) == freed
        assert sorted(status["resize"]["freedPods"]) == freed
        # once KubeRay deleted those pods, the operator drops their names (KubeRay never does)
        assert sorted(dep.kuberay_deletes()) == freed
        ops.wait_for(
            lambda: dep.workers()["scaleStrategy"]["workersToDelete"] == [],
            what="workersToDelete emptied by the operator",
        )
        # and a grow after that shrink is not held back by stale names
        dep.scale(3)
        dep.set_ready_workers(3)
        dep.wait_completed(3)
        assert dep.runtime.posts == [4, 2, 3]
    finally:
        watch.stop()
    reasons = dep.events()
    for stage in dict.fromkeys(UP + DOWN):
        assert stage in reasons
    done = dep.plane.kubectl(
        "wait", "--for=condition=Ready", f"moed/{NAME}", "-n", dep.namespace, "--timeout=30s"
    )
    assert done.returncode == 0
    assert dep.status()["phase"] == "Serving"


def test_a_restarted_operator_resumes_without_asking_twice(
    deployment: Deployment, operator: ops.OperatorProcess
) -> None:
    dep = deployment
    dep.runtime.dwell = 1.0
    dep.set_ready_workers(4)  # workers already there: the runtime is asked at once
    dep.scale(4)
    ops.wait_for(lambda: dep.resize().get("resizeId"), what="status.resize.resizeId")
    assert dep.resize()["stage"] not in ("Completed", "Failed")
    assert operator.proc is not None
    operator.proc.kill()  # no goodbye: mid-resize
    operator.proc.wait(timeout=10)
    operator.proc = None
    operator.start()
    dep.wait_completed(4)
    assert dep.runtime.posts == [4]
    assert len(dep.runtime.records_for(2, 4)) == 1
    assert dep.workers()["replicas"] == 4


def test_a_new_target_during_a_resize_is_applied_after_it(deployment: Deployment) -> None:
    dep = deployment
    dep.runtime.dwell = 1.0
    dep.set_ready_workers(4)
    dep.scale(4)
    ops.wait_for(lambda: dep.resize().get("resizeId"), what="the runtime to be asked for 4")
    dep.scale(3)
    dep.wait_completed(3)
    assert dep.runtime.posts == [4, 3]
    assert 409 not in dep.runtime.answers
    assert [len(dep.runtime.records_for(*step)) for step in ((2, 4), (4, 3))] == [1, 1]
    workers = dep.workers()
    assert workers["replicas"] == 3
    assert workers["scaleStrategy"]["workersToDelete"] == [
        f["pod"] for f in dep.runtime.records_for(4, 3)[0]["freed"]
    ]


def test_a_refused_size_fails_once_and_keeps_serving(deployment: Deployment) -> None:
    dep = deployment
    dep.scale(1)

    def failed() -> dict[str, Any] | None:
        status = dep.status()
        return status if (status.get("resize") or {}).get("stage") == "Failed" else None

    status = ops.wait_for(failed, what="a Failed resize")
    assert "too small to hold every expert" in status["resize"]["message"]
    assert status["phase"] == "Degraded"
    assert status["dataParallelSize"] == 2
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == (
        "True",
        "ResizeFailed",
    )
    assert "too small to hold every expert" in conditions["Degraded"]["message"]
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Resizing"]["status"] == "False"
    # No retry loop: over several reconcile periods the runtime is asked once.
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert dep.runtime.posts == [1]
        time.sleep(0.2)
    assert dep.workers()["replicas"] == 2
    assert "Failed" in dep.events()
    # A new generation (another target) is tried.
    dep.scale(3)
    dep.set_ready_workers(3)
    dep.wait_completed(3)
    assert dep.runtime.posts == [1, 3]
