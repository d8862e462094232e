"""The runtime and the cluster around the operator in its integration tests: ``FakeRuntime``
(the admin routes of ``moe-runtime serve`` over HTTP on 127.0.0.1 with a scripted resize;
its status is the contract's model, ``moe_contract.status``, with records made by the
runtime's own ``moe_runtime.elastic.records``) and ``Deployment``, with which a test plays
KubeRay and the kubelet: it creates the Ray pods (Ready) and deletes the ones named in
workersToDelete; like the real KubeRay it never clears that list (the real-node tier runs the
real thing)."""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
import uuid
from typing import Any

from e2e.controlplane import cluster
from moe_contract import loading, names
from moe_contract import status as runtime_status
from moe_runtime.elastic import records, stages
from tests.support import operator_ops as ops

NAME = "tiny"
NUM_EXPERTS = 8
MAX_EXPERTS_PER_RANK = 4  # so size 1 (8 slots per rank) is refused by the runtime


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
        #: Sequences running in the engine (``load`` of the status; ``None``: not reported).
        self.in_flight: int | None = None
        #: What ``GET /ready`` says while set: a load part-way (503, status ``loading``).
        self.loading: loading.LoadProgress | None = None
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
        """``GET /elastic_ep/status``: the contract's model, records as the runtime's own
        (``moe_runtime.elastic.records``) serialise them, checked strictly."""
        with self.lock:
            self._advance()
            running = self.current if self.current is not None and not self.current.done else None
            last = self.current or (self.history[-1] if self.history else None)
            load = (
                runtime_status.Load(running=self.in_flight, waiting=0, in_flight=self.in_flight)
                if self.in_flight is not None
                else None
            )
            return runtime_status.ElasticStatus(
                data_parallel_size=self.size,
                target_data_parallel_size=running.to_size if running else self.size,
                is_scaling=running is not None,
                stage=(last.stage.value if last else stages.Stage.IDLE.value),
                resize=runtime_status.Resize.exact(last.to_json()) if last else None,
                history=[runtime_status.Resize.exact(r.to_json()) for r in self.history],
                ranks=[
                    runtime_status.Rank(rank=r, pod=pod, active=True, healthy=True, node_id=None)
                    for r, pod in enumerate(self.pods)
                ],
                load=load,
                eplb=runtime_status.Eplb(balancedness=1.0),
            ).to_json()

    def ready(self) -> tuple[int, dict[str, Any]]:
        """``GET /ready``: the contract's body, loading while ``loading`` is set."""
        with self.lock:
            now = self.loading
        if now is None:
            return 200, loading.ReadyBody(status=loading.READY, reason="serving").to_json()
        body = loading.ReadyBody(status=loading.LOADING, reason=now.message(), loading=now)
        return 503, body.to_json()

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
                if self.path == names.HEALTH_PATH:
                    self._send(200, {"status": "ok"})
                elif self.path == names.STATUS_PATH:
                    self._send(200, fake.status())
                elif self.path == names.READY_PATH:
                    self._send(*fake.ready())
                else:
                    self._send(404, _error("not found"))

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path.split("?")[0] != names.SCALE_PATH:
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

    def _pod(self, name: str, node_type: str, *, status: dict[str, Any] | None = None) -> None:
        """A Ray pod as KubeRay labels it, Running and Ready as the kubelet would report (or
        with ``status`` as the kubelet reports it)."""
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
        status = status or {"phase": "Running",
                             "conditions": [{"type": "Ready", "status": "True"}]}  # fmt: skip
        self.plane.kubectl(
            "patch", "pod", name, "-n", self.namespace, "--subresource=status",
            "--type=merge", "-p", json.dumps({"status": status}),
        )  # fmt: skip

    def set_head(self, status: dict[str, Any]) -> None:
        """Play KubeRay and the kubelet: the head pod, with ``status`` (e.g. not Ready,
        its container in CrashLoopBackOff)."""
        self._ensure_service_account()
        self._pod(f"{NAME}-head-x", "head", status=status)

    def _ensure_service_account(self) -> None:
        if self.plane.kubectl("get", "sa", "default", "-n", self.namespace,
                              check=False).returncode != 0:  # fmt: skip
            self.plane.kubectl("create", "sa", "default", "-n", self.namespace)

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
        self._ensure_service_account()
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
