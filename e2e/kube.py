"""Handles on a MoEDeployment for end-to-end runs, through the real kubectl: its status and
events, its pods, the runtime's admin API, a ``kubectl get -w`` of its resize stages, and a
``kubectl port-forward`` that follows the Service. Shared by the e2e tiers and the demo."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import httpx

from e2e import load as load_mod

T = TypeVar("T")


class Kubectl(Protocol):
    """What a cluster handle offers (``e2e.controlplane.cluster.ControlPlane``, ``e2e.node``)."""

    def kubectl(
        self,
        *args: str,
        input: str | None = None,  # noqa: A002 - mirrors subprocess.run
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]: ...

    def env(self) -> dict[str, str]: ...


def seconds_between(start: str, end: str) -> float:
    """Seconds from one of the API's RFC 3339 timestamps (whole seconds) to another."""

    def parse(moment: str) -> datetime.datetime:
        return datetime.datetime.fromisoformat(moment.replace("Z", "+00:00"))

    return (parse(end) - parse(start)).total_seconds()


def seconds_to_ready(pod: dict[str, Any]) -> float | None:
    """From a pod's first container starting to its Ready condition turning True (``None``
    while it is not Ready, or has not started); a figure to print, not to assert on."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    running = ((statuses[0].get("state") or {}).get("running") or {}) if statuses else {}
    ready = [c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"]
    if not running.get("startedAt") or not ready or ready[0]["status"] != "True":
        return None
    return seconds_between(running["startedAt"], ready[0]["lastTransitionTime"])


def wait_for(
    check: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.2,
) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` past the deadline."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)  # poll interval; the deadline above bounds the wait
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


@dataclasses.dataclass
class Deployment:
    """A MoEDeployment seen through kubectl; ``endpoint()`` is where its runtime answers
    from here (``None`` while it does not)."""

    cluster: Kubectl
    name: str
    namespace: str
    endpoint: Callable[[], str | None] = lambda: None

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, check=check)

    def get(self, kind: str = "moed", name: str | None = None) -> dict[str, Any]:
        done = self.kubectl("get", kind, name or self.name, "-n", self.namespace, "-o", "json")
        obj: dict[str, Any] = json.loads(done.stdout)
        return obj

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.get().get("status") or {}
        return status

    def resize(self) -> dict[str, Any]:
        resize: dict[str, Any] = self.status().get("resize") or {}
        return resize

    def raycluster(self) -> dict[str, Any]:
        return self.get("raycluster")

    def pods(self, node_type: str = "worker") -> list[dict[str, Any]]:
        """The RayCluster's pods of one kind, terminating ones included."""
        done = self.kubectl(
            "get", "pods", "-n", self.namespace, "-l",
            f"ray.io/cluster={self.name},ray.io/node-type={node_type}", "-o", "json",
        )  # fmt: skip
        items: list[dict[str, Any]] = json.loads(done.stdout)["items"]
        return items

    def worker_pods(self) -> list[str]:
        """Names of the worker pods that are not terminating."""
        return sorted(
            p["metadata"]["name"] for p in self.pods() if not p["metadata"].get("deletionTimestamp")
        )

    def ready_worker_pods(self) -> list[str]:
        def ready(pod: dict[str, Any]) -> bool:
            conditions = (pod.get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

        return sorted(
            p["metadata"]["name"]
            for p in self.pods()
            if not p["metadata"].get("deletionTimestamp") and ready(p)
        )

    def admin_token(self) -> str:
        secret = self.get("secret", f"{self.name}-admin")
        return base64.b64decode(secret["data"]["token"]).decode()

    def runtime_status(self) -> dict[str, Any]:
        url = self.endpoint()
        assert url is not None, "the runtime has no endpoint yet"
        r = httpx.get(
            f"{url}/elastic_ep/status",
            headers={"Authorization": f"Bearer {self.admin_token()}"},
            timeout=30,
        )
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def serving(self, size: int) -> dict[str, Any] | None:
        """The status once the deployment serves ``size`` ranks with nothing in flight."""
        status = self.status()
        resize = status.get("resize") or {}
        if resize.get("stage") == "Failed" and resize.get("toSize") == size:
            raise AssertionError(f"resize to {size} failed: {resize.get('message')}")
        idle = not resize or resize.get("stage") in ("Completed", "Failed")
        ok = status.get("phase") == "Serving" and status.get("dataParallelSize") == size
        return status if ok and idle else None

    def watch(self) -> StageWatch:
        return StageWatch(self.cluster, self.name, self.namespace)

    def events(self) -> list[dict[str, Any]]:
        done = self.kubectl(
            "get", "events", "-n", self.namespace, "--field-selector",
            f"involvedObject.name={self.name},involvedObject.kind=MoEDeployment", "-o", "json",
        )  # fmt: skip
        items: list[dict[str, Any]] = json.loads(done.stdout)["items"]
        return sorted(items, key=lambda e: e["metadata"]["creationTimestamp"])


class StageWatch:
    """``kubectl get -w`` of a MoEDeployment's ``status.resize`` (stage/toSize): every write."""

    def __init__(self, cluster: Kubectl, name: str, namespace: str) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            ["kubectl", "get", "moed", name, "-n", namespace, "-w", "-o",
             'jsonpath={.status.resize.stage}/{.status.resize.toSize}{"\\n"}'],
            env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.strip()))

    def stages(self, to_size: int) -> list[str]:
        """Distinct consecutive stages seen for resizes to ``to_size``."""
        out: list[str] = []
        for _, line in list(self.lines):
            stage, _, size = line.partition("/")
            if stage and size == str(to_size) and (not out or out[-1] != stage):
                out.append(stage)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.thread.join(timeout=5)


class ServiceUrl:
    """A Service's ClusterIP URL, for clients that reach the cluster's Service range directly
    (the local node routes it to this machine): no API server in the data path."""

    def __init__(self, cluster: Kubectl, *, namespace: str, name: str, port: int) -> None:
        self.cluster, self.namespace, self.name, self.port = cluster, namespace, name, port
        self._url: str | None = None

    def url(self) -> str | None:
        if self._url is None:
            done = self.cluster.kubectl(
                "get", "svc", self.name, "-n", self.namespace, "-o",
                "jsonpath={.spec.clusterIP}", check=False,
            )  # fmt: skip
            if done.returncode == 0 and done.stdout.strip():
                self._url = f"http://{done.stdout.strip()}:{self.port}"
        return self._url


class PortForward:
    """``kubectl port-forward svc/NAME :PORT`` on 127.0.0.1, restarted when it exits (the pod
    behind it restarted); ``url()`` is the current local URL or ``None`` while it is down."""

    _FORWARDING = re.compile(r"Forwarding from 127\.0\.0\.1:(\d+)")

    def __init__(self, cluster: Kubectl, *, namespace: str, target: str, port: int) -> None:
        self.cluster, self.namespace, self.target, self.port = cluster, namespace, target, port
        self._proc: subprocess.Popen[str] | None = None
        self._url: str | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def _start(self) -> None:
        proc = subprocess.Popen(
            ["kubectl", "port-forward", "-n", self.namespace, "--address", "127.0.0.1",
             self.target, f":{self.port}"],
            env=self.cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        url = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            match = self._FORWARDING.search(line)
            if match:
                url = f"http://127.0.0.1:{match.group(1)}"
                break
        if url is None:
            proc.kill()
            proc.wait()
            return
        # keep draining its output (it logs every connection) so it never blocks on a pipe
        threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True).start()
        self._proc, self._url = proc, url

    def url(self) -> str | None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None:
                self._proc, self._url = None, None
                self.restarts += 1
            if self._proc is None:
                self._start()
            return self._url

    def stop(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                self._proc, self._url = None, None


@dataclasses.dataclass
class ExternalCluster:
    """A cluster given by a kubeconfig (e.g. kind, ``MOE_E2E_KUBECONFIG``): the e2e tier runs
    against it instead of starting the local node."""

    kubeconfig: str

    def env(self) -> dict[str, str]:
        import os

        return {**os.environ, "KUBECONFIG": self.kubeconfig}

    def kubectl(
        self,
        *args: str,
        input: str | None = None,  # noqa: A002 - mirrors subprocess.run
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        cmd = ["kubectl", "--kubeconfig", self.kubeconfig, *args]
        done = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
        return done


@contextlib.contextmanager
def checked_load(
    dep: Deployment,
    *,
    model_name: str,
    reference: dict[tuple[int, int, int | None], list[int]],
    tag: str,
    clients: int = 4,
) -> Iterator[load_mod.Load]:
    """A checked load (`e2e.load.Load`) on `dep`'s endpoint, yielded once it has its first
    answers; its summary and first failures are printed (``[tag] ...``) when it stops."""
    with load_mod.Load(
        dep.endpoint, model_name=model_name, reference=reference, clients=clients
    ) as lg:
        try:
            wait_for(lambda: lg.ok >= clients or lg.failed, timeout_s=180, what="first answers")
            yield lg
        finally:
            print(f"\n[{tag}] {lg.summary()}")
            for failure in lg.failures[:10]:
                print(f"[{tag}] failure: {failure}")
