"""A local stand-in for KubeRay: RayClusters in the local control plane become Ray nodes here.

``LocalKubeRay(kubeconfig, namespace=None, workdir=...)`` polls ``ray.io/v1`` RayClusters (one
namespace, or all) and does on this machine what KubeRay does on a cluster:

- **Head.** A Pod object ``<cluster>-head-<5 chars>`` (labels ``ray.io/cluster``,
  ``ray.io/node-type=head``, ``ray.io/group=headgroup``) and a local Ray head node,
  ``ray start --head --block --port=<free> --temp-dir=<per node> --include-dashboard=false``
  with the head group's ``rayStartParams`` (``num-cpus`` (default 1), ``num-gpus``,
  ``resources``, ``object-store-memory``, ``labels``). Once the GCS answers, the head
  container's ``command`` + ``args`` run as a process with the container's ``env``/``envFrom``
  resolved (plain values with ``$(VAR)`` expansion, ``secretKeyRef``/``configMapKeyRef`` read
  from the API server, ``fieldRef`` on the pod) plus KubeRay's variables and
  ``RAY_ADDRESS=127.0.0.1:<gcs port>``. The pod turns Running/Ready (``podIP`` 127.0.0.1) when
  that process answers 200 on its readiness path; a container without a command is Ready when
  the Ray head is. The process is restarted with a back-off when it exits (``restartCount``).
- **Runtime port convention.** The runtime serves on the port given by ``--port`` in the head
  container's command/args (DESIGN §4's default 8000 when absent). The stand-in rewrites
  ``--port N``/``--port=N`` to a free loopback port and ``--host H``/``--host=H`` to 127.0.0.1,
  in argv items and inside shell strings (``sh -c "... --port 8000"``); when there is no
  ``--port`` it appends ``--host 127.0.0.1 --port <free>``. A shell's login flag is dropped
  (``bash -lc`` → ``bash -c``: /etc/profile would reset PATH and lose the venv), and
  ``$KUBERAY_GEN_RAY_START_CMD`` (KubeRay's ``ray start`` under the
  ``ray.io/overwrite-container-cmd`` annotation) is ``true``: the node already runs. The
  readiness path is the
  container's ``readinessProbe.httpGet.path``, else ``/health``. Where the runtime listens is
  published as the annotation ``elasticmoe.io/local-endpoint: http://127.0.0.1:<port>`` on the
  RayCluster (the operator run locally reaches the runtime through it) and in
  ``status.endpoints``.
- **Workers.** For each worker group, ``replicas`` × ``numOfHosts`` Pod objects named
  ``<cluster>-<group>-worker-<5 chars>`` (labels ``ray.io/cluster``, ``ray.io/group``,
  ``ray.io/node-type=worker``), each one local Ray worker node
  ``ray start --block --address=127.0.0.1:<gcs port>`` with the group's ``rayStartParams``
  (``resources`` as KubeRay takes it, e.g. ``'"{\\"moe_rank\\": 1}"'``), the worker container's
  env resolved and ``MOE_POD_NAME=<pod name>``, so actors on that node read their pod's name.
  The node carries the Ray node label ``elasticmoe.io/pod=<pod name>``. A worker pod is Ready
  once its node (told apart by its node-manager port, fresh per start) is ALIVE in the GCS.
  Every node has its own Ray temp dir, as every pod has its own /tmp (nodes sharing one raced
  for socket names when started together, and one of them failed).
- **Scaling as KubeRay does (autoscaling off).** Pods named in a group's
  ``scaleStrategy.workersToDelete`` are deleted whatever ``replicas`` says and the list is then
  cleared in the spec (a JSON patch that first tests the list, so a concurrent writer wins);
  then pods are created up to ``replicas``, or RANDOM pods are deleted down to it. Pods are
  bound to the node ``local-kuberay`` when created, so a deleted pod shows its
  ``deletionTimestamp`` while it terminates, as on a cluster: the stand-in sends SIGTERM to
  exactly that pod's ``ray start --block`` (Ray drains and stops that node's processes;
  SIGKILL past ``terminationGracePeriodSeconds``) and removes the Pod object (grace 0, the
  kubelet's part) once its processes are gone. A worker pod deleted by someone else is stopped
  the same way and replaced. A Ray node that exits, or does not come up within
  ``node_start_timeout_s``, is restarted in place after a back-off (``restartCount``), as a
  kubelet restarts a container.
- **Status** (status subresource, written only when something but a timestamp changed):
  ``state: ready`` once every pod was ready once (``RayClusterProvisioned``, latched),
  ``HeadPodReady``, ``desired/ready/availableWorkerReplicas``, ``min/maxWorkerReplicas``,
  ``head.podIP``/``serviceIP``/``podName`` (127.0.0.1), ``endpoints``, ``observedGeneration``.
  ``spec.suspend: true`` stops every pod (``state: suspended``).
- **Deletion.** A RayCluster that disappears has its processes stopped and its Pod objects
  deleted (this control plane has no garbage collector). ``stop()`` stops every cluster it
  started and leaves no process behind (checked with the tags of ``e2e.local.procs``).

What a real cluster has and this does not: Services (``status.head.serviceIP`` is 127.0.0.1),
init containers, resource limits, image pulls, liveness probes, the autoscaler, GCS fault
tolerance (a head that dies, or whose pod is deleted, takes its workers with it and the cluster
is started again). Pods this instance did not start (e.g. after a restart of the stand-in) are
deleted and made again. Run one stand-in per namespace (two watching one namespace fight).

Ray 2.60 on this host: ``--node-ip-address=127.0.0.1`` (and ``--address=127.0.0.1:port``) are
resolved by Ray itself to the host's address, and Ray's gRPC servers listen on all interfaces;
Ray has no bind-address option. Everything else started here (the runtime) listens on 127.0.0.1.
Ray's token authentication (on by default, token in ``~/.ray``) is kept; this process enables it
for its own GCS queries when a token exists.

Run it alone with ``python -m e2e.local.kuberay --kubeconfig PATH [--namespace NS]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import os
import random
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from e2e.local import kubeapi, podenv, podspec, procs

log = logging.getLogger(__name__)

GROUP = "ray.io"
VERSION = "v1"
PLURAL = "rayclusters"
ENDPOINT_ANNOTATION = "elasticmoe.io/local-endpoint"
NODE_POD_LABEL = podspec.NODE_POD_LABEL
HEAD_GROUP = "headgroup"
LOOPBACK = podspec.LOOPBACK
DEFAULT_RUNTIME_PORT = podspec.DEFAULT_RUNTIME_PORT
DEFAULT_HEALTH_PATH = "/health"
RAY_BIN = str(Path(sys.executable).with_name("ray"))


# Condition types and reasons as KubeRay names them.
COND_HEAD_READY = "HeadPodReady"
COND_PROVISIONED = "RayClusterProvisioned"
REASON_HEAD_READY = "HeadPodRunningAndReady"
REASON_HEAD_NOT_READY = "HeadPodNotReady"
REASON_ALL_READY = "AllPodRunningAndReadyFirstTime"
REASON_PROVISIONING = "RayClusterPodsProvisioning"
STATE_READY = "ready"
STATE_SUSPENDED = "suspended"


def _cluster_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    return f"{base}/{name}" if name else base


def _pods_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")


@dataclasses.dataclass
class _Pod:
    """One pod of a cluster and the local process that plays its container."""

    name: str
    group: str
    kind: str  # "head" | "worker"
    uid: str = ""
    proc: procs.Proc | None = None
    ready: bool = False
    reported: tuple[bool, bool, int] | None = None  # (running, ready, restarts) in the API
    terminating: bool = False
    grace_s: float = 30.0
    started_at: str = ""
    restarts: int = 0  # container restarts, as a kubelet counts them
    next_start: float = 0.0  # back-off before the next restart (monotonic time)
    node_port: int = 0  # the Ray node's node-manager port: tells this start's node from older


@dataclasses.dataclass
class _Cluster:
    """What this stand-in holds for one RayCluster."""

    namespace: str
    name: str
    uid: str
    workdir: Path
    ray_temp: Path
    gcs_port: int = 0
    client_port: int = 0
    node_count: int = 0  # names the nodes' temp dirs
    head: _Pod | None = None
    gcs_up: bool = False
    gcs: Any = None  # ray._raylet.GcsClient once the head answers
    runtime: procs.Proc | None = None
    runtime_port: int = 0
    declared_port: int = DEFAULT_RUNTIME_PORT
    has_runtime: bool = False  # the head container has a command to run
    health_path: str = DEFAULT_HEALTH_PATH
    runtime_restarts: int = 0
    runtime_next_start: float = 0.0
    published_endpoint: str = ""
    workers: dict[str, _Pod] = dataclasses.field(default_factory=dict)
    stopping: list[_Pod] = dataclasses.field(default_factory=list)
    provisioned: bool = False
    last_status: dict[str, Any] = dataclasses.field(default_factory=dict)
    conditions: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    said: set[str] = dataclasses.field(default_factory=set)  # waits already logged

    def say_once(self, message: str) -> None:
        """Log a wait once, not on every pass of the loop."""
        if message not in self.said:
            self.said.add(message)
            log.info("%s: %s", self.ctx, message)

    @property
    def ctx(self) -> str:
        return f"raycluster {self.namespace}/{self.name}"

    @property
    def gcs_address(self) -> str:
        return f"{LOOPBACK}:{self.gcs_port}"


class LocalKubeRay:
    """Turns RayCluster objects into local Ray nodes and processes (see the module docstring).

    ``start()`` runs the reconcile loop in a thread; ``stop()`` ends it and stops everything it
    started. Also a context manager.
    """

    def __init__(
        self,
        kubeconfig: str | Path,
        *,
        namespace: str | None = None,
        workdir: str | Path,
        poll_interval_s: float = 0.25,
        object_store_memory: int = 128 * 1024 * 1024,
        drain_timeout_s: float = 2.0,
        node_start_timeout_s: float = 120.0,
        seed: int | None = None,
    ) -> None:
        self.kube = kubeapi.Kube(kubeconfig)
        self.env_resolver = podenv.EnvResolver(self.kube)
        self.kubeconfig = Path(kubeconfig)
        self.namespace = namespace
        self.workdir = Path(workdir)
        self.poll_interval_s = poll_interval_s
        self.object_store_memory = object_store_memory
        self.drain_timeout_s = drain_timeout_s
        self.node_start_timeout_s = node_start_timeout_s
        self.owner = f"lkr-{os.getpid()}-{podspec.random_suffix(random.Random(), 8)}"
        self._rng = random.Random(seed)
        self._clusters: dict[tuple[str, str], _Cluster] = {}
        self._service_accounts: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._auth_checked = False

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> LocalKubeRay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._thread is not None:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="local-kuberay", daemon=True)
        self._thread.start()
        log.info("local kuberay %s watching %s", self.owner, self.namespace or "all namespaces")

    def stop(self) -> None:
        """Stop the loop, every cluster's processes and their Pod objects."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        with self._lock:
            for cluster in list(self._clusters.values()):
                self._teardown(cluster, delete_pods=True, final=True)
            self._clusters.clear()
        leftover = procs.tagged_pids(procs.OWNER_ENV, self.owner)
        if leftover:
            log.warning("local kuberay %s: killing leftover pids %s", self.owner, leftover)
            for pid in leftover:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
        self.kube.close()

    def leftover_pids(self) -> list[int]:
        """Live processes started by this instance (its tests expect none after ``stop()``)."""
        return procs.tagged_pids(procs.OWNER_ENV, self.owner)

    def endpoint(self, namespace: str, name: str) -> str | None:
        """``http://127.0.0.1:<port>`` of a cluster's runtime, once started."""
        cluster = self._clusters.get((namespace, name))
        if cluster is None or not cluster.runtime_port:
            return None
        return f"http://{LOOPBACK}:{cluster.runtime_port}"

    def gcs_address(self, namespace: str, name: str) -> str | None:
        cluster = self._clusters.get((namespace, name))
        return cluster.gcs_address if cluster is not None and cluster.gcs_up else None

    def ray_temp_dir(self, namespace: str, name: str) -> Path | None:
        """The Ray temp dir of a cluster's nodes (every Ray process of it names it)."""
        cluster = self._clusters.get((namespace, name))
        return cluster.ray_temp if cluster is not None else None

    def pod_pids(self, namespace: str, name: str, pod: str) -> list[int]:
        """Live processes of one pod's container (its Ray node, or the head's too), for tests
        that kill a part of a node."""
        cluster = self._clusters.get((namespace, name))
        if cluster is None:
            return []
        found = cluster.workers.get(pod) or (
            cluster.head if cluster.head is not None and cluster.head.name == pod else None
        )
        return found.proc.leftovers() if found is not None and found.proc is not None else []

    # --- loop -----------------------------------------------------------------------------------

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                with self._lock:
                    self.reconcile_all()
                if failing:
                    log.info("local kuberay %s: reconcile passes work again", self.owner)
                failing = False
            except Exception:
                if not failing:  # once per outage (e.g. the API server is down), not per pass
                    log.exception("local kuberay %s: reconcile pass failed", self.owner)
                failing = True
            self._stop.wait(self.poll_interval_s)

    def reconcile_all(self) -> None:
        """One pass over every RayCluster: make them real, stop the ones that are gone."""
        path = (
            _cluster_path(self.namespace) if self.namespace else f"/apis/{GROUP}/{VERSION}/{PLURAL}"
        )
        seen: set[tuple[str, str]] = set()
        for obj in self.kube.list(path):
            meta = obj["metadata"]
            key = (meta["namespace"], meta["name"])
            seen.add(key)
            cluster = self._clusters.get(key)
            if cluster is not None and cluster.uid != meta["uid"]:
                log.info("%s: recreated (new uid); starting over", cluster.ctx)
                self._teardown(cluster, delete_pods=True, final=True)
                cluster = None
            if cluster is None:
                cluster = self._new_cluster(obj)
                self._clusters[key] = cluster
            try:
                self._reconcile(cluster, obj)
            except kubeapi.ApiError as exc:
                log.warning("%s: API error %s %s; retrying", cluster.ctx, exc.status, exc.reason)
            except Exception:
                log.exception("%s: reconcile failed; retrying", cluster.ctx)
        for key in [k for k in self._clusters if k not in seen]:
            cluster = self._clusters.pop(key)
            log.info("%s: deleted; stopping its pods", cluster.ctx)
            self._teardown(cluster, delete_pods=True, final=True)

    def _new_cluster(self, obj: dict[str, Any]) -> _Cluster:
        meta = obj["metadata"]
        workdir = self.workdir / f"{meta['namespace']}.{meta['name']}.{meta['uid'][:8]}"
        workdir.mkdir(parents=True, exist_ok=True)
        # Ray's Unix sockets live under the temp dir: keep its path short.
        ray_temp = Path(tempfile.mkdtemp(prefix="lkr-", dir="/tmp"))
        return _Cluster(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta["uid"],
            workdir=workdir,
            ray_temp=ray_temp,
        )

    # --- one cluster ----------------------------------------------------------------------------

    def _reconcile(self, c: _Cluster, obj: dict[str, Any]) -> None:
        spec = obj.get("spec") or {}
        if obj["metadata"].get("deletionTimestamp"):
            self._teardown(c, delete_pods=True)
            return
        if spec.get("suspend"):
            if c.head is not None or c.workers:
                log.info("%s: suspended; stopping its pods", c.ctx)
                self._teardown(c, delete_pods=True)
            self._write_status(c, obj, suspended=True)
            return
        self._progress_stopping(c)  # before listing: pods it deletes are not in the list
        pods = {
            p["metadata"]["name"]: p
            for p in self.kube.list(
                _pods_path(c.namespace), label_selector=f"ray.io/cluster={c.name}"
            )
        }
        self._reconcile_head(c, obj, pods)
        self._reconcile_workers(c, obj, pods)
        self._report_pods(c)
        self._write_status(c, obj, suspended=False)

    # --- head -----------------------------------------------------------------------------------

    def _reconcile_head(
        self, c: _Cluster, obj: dict[str, Any], pods: dict[str, dict[str, Any]]
    ) -> None:
        head_spec = (obj.get("spec") or {}).get("headGroupSpec") or {}
        if c.head is not None:
            api_pod = pods.get(c.head.name)
            gone = api_pod is None or bool(api_pod["metadata"].get("deletionTimestamp"))
            proc = c.head.proc
            died = proc is not None and not proc.alive()
            if gone:
                log.warning("%s: head pod deleted; starting the cluster again", c.ctx)
            elif died and proc is not None:
                log.error(
                    "%s: ray head exited (%s); starting the cluster again; log tail:\n%s",
                    c.ctx,
                    proc.poll(),
                    proc.tail(),
                )
            if gone or died:
                self._teardown(c, delete_pods=True)
                pods.clear()
        for name, pod in pods.items():  # head pods this instance does not run
            labels = pod["metadata"].get("labels") or {}
            if labels.get("ray.io/node-type") == "head" and (c.head is None or name != c.head.name):
                self._delete_pod_object(c, name)
        if c.head is None:
            self._start_head(c, obj, head_spec)
            return
        if not c.gcs_up:
            self._check_gcs(c)
            if not c.gcs_up:
                return
        self._ensure_runtime(c, obj, head_spec)
        self._check_head_ready(c)

    def _start_head(self, c: _Cluster, obj: dict[str, Any], head_spec: dict[str, Any]) -> None:
        template = head_spec.get("template") or {}
        name = f"{c.name}-head-{podspec.random_suffix(self._rng)}"
        pod = _Pod(name=name, group=HEAD_GROUP, kind="head")
        pod.grace_s = podspec.grace_seconds(template)
        created = self._create_pod_object(c, obj, pod, template)
        pod.uid = created["metadata"]["uid"]
        c.gcs_port = procs.free_port()
        c.client_port = procs.free_port()
        c.gcs_up = False
        params = head_spec.get("rayStartParams") or {}
        argv = [
            RAY_BIN,
            "start",
            "--head",
            "--block",
            f"--node-ip-address={LOOPBACK}",
            f"--port={c.gcs_port}",
            f"--temp-dir={self._node_temp(c)}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--ray-client-server-port={c.client_port}",
            f"--dashboard-agent-listen-port={procs.free_port()}",
            *podspec.ray_params_argv(
                params,
                pod_name=name,
                default_cpus="1",
                object_store_memory=self.object_store_memory,
            ),
        ]
        env = self._base_env(c, pod_name=name, group=HEAD_GROUP)
        pod.proc = procs.Proc(
            argv,
            env=env,
            log_path=c.workdir / f"{name}.ray.log",
            owner=self.owner,
            name=f"{c.ctx} pod {name} (ray head)",
        )
        pod.started_at = podspec.now_rfc3339()
        c.head = pod
        log.info("%s: head pod %s: ray head starting on port %d", c.ctx, name, c.gcs_port)

    def _check_gcs(self, c: _Cluster) -> None:
        assert c.head is not None and c.head.proc is not None
        try:
            socket.create_connection((LOOPBACK, c.gcs_port), timeout=0.2).close()
        except OSError:
            nodes = None
        else:
            if c.gcs is None:
                c.gcs = self._gcs_client(c.gcs_address)
            nodes = self._alive_nodes(c)
        if nodes is not None and any(lb.get(NODE_POD_LABEL) == c.head.name for lb, _ in nodes):
            c.gcs_up = True
            log.info("%s: ray head up at %s", c.ctx, c.gcs_address)
        elif self._start_timed_out(c, c.head):  # as a liveness probe would: start again
            self._teardown(c, delete_pods=True)

    def _start_timed_out(self, c: _Cluster, pod: _Pod) -> bool:
        assert pod.proc is not None
        if time.monotonic() - pod.proc.started_at <= self.node_start_timeout_s:
            return False
        log.error(
            "%s: pod %s: ray node not up after %.0fs; replacing it; log tail:\n%s",
            c.ctx,
            pod.name,
            self.node_start_timeout_s,
            pod.proc.tail(),
        )
        return True

    def _ensure_runtime(self, c: _Cluster, obj: dict[str, Any], head_spec: dict[str, Any]) -> None:
        assert c.head is not None
        container = podspec.first_container(head_spec.get("template") or {})
        argv0 = list(container.get("command") or []) + list(container.get("args") or [])
        c.has_runtime = bool(argv0)
        if not argv0:
            return  # no runtime: the head is Ready when Ray is
        if c.runtime is not None and c.runtime.alive():
            return
        if c.runtime is not None:  # it exited: restart with a back-off, as a kubelet would
            code = c.runtime.poll()
            log.error(
                "%s: pod %s: runtime exited with %s; log tail:\n%s",
                c.ctx,
                c.head.name,
                code,
                c.runtime.tail(),
            )
            c.runtime.kill()
            c.runtime = None
            c.runtime_restarts += 1
            c.runtime_next_start = time.monotonic() + min(30.0, 2.0 ** (c.runtime_restarts - 1))
            c.head.ready = False
        if time.monotonic() < c.runtime_next_start:
            return
        try:
            env = self._container_env(c, container, pod=c.head)
        except podenv.EnvNotReady as exc:
            c.say_once(f"pod {c.head.name} waits: {exc}")
            return
        env["RAY_ADDRESS"] = c.gcs_address
        argv0 = [podspec.expand_vars(a, env) for a in argv0]
        if not c.runtime_port:
            c.runtime_port = procs.free_port()
        argv, c.declared_port = podspec.rewrite_runtime_argv(
            podspec.local_shell_argv(argv0), port=c.runtime_port
        )
        probe = (container.get("readinessProbe") or {}).get("httpGet") or {}
        c.health_path = probe.get("path") or DEFAULT_HEALTH_PATH
        c.runtime = procs.Proc(
            argv,
            env=env,
            log_path=c.workdir / f"{c.head.name}.runtime.log",
            owner=self.owner,
            name=f"{c.ctx} pod {c.head.name} (runtime)",
        )
        log.info(
            "%s: pod %s: runtime started on %s:%d: %s",
            c.ctx,
            c.head.name,
            LOOPBACK,
            c.runtime_port,
            shlex.join(argv),
        )
        self._publish_endpoint(c)

    def _publish_endpoint(self, c: _Cluster) -> None:
        url = f"http://{LOOPBACK}:{c.runtime_port}"
        if c.published_endpoint == url:
            return
        self.kube.patch(
            _cluster_path(c.namespace, c.name),
            {"metadata": {"annotations": {ENDPOINT_ANNOTATION: url}}},
        )
        c.published_endpoint = url

    def _check_head_ready(self, c: _Cluster) -> None:
        assert c.head is not None
        if c.runtime is None:
            c.head.ready = c.gcs_up and not c.has_runtime
            return
        if not c.runtime.alive():
            c.head.ready = False
            return
        url = f"http://{LOOPBACK}:{c.runtime_port}{c.health_path}"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:  # noqa: S310 - loopback
                ok = response.status == 200
        except (urllib.error.URLError, OSError):
            ok = False
        if ok != c.head.ready:
            log.info("%s: pod %s ready=%s", c.ctx, c.head.name, ok)
        c.head.ready = ok

    # --- workers --------------------------------------------------------------------------------

    def _reconcile_workers(
        self, c: _Cluster, obj: dict[str, Any], pods: dict[str, dict[str, Any]]
    ) -> None:
        # Pods of this cluster the API has but this instance does not run: not ours to adopt.
        for name, pod in pods.items():
            labels = pod["metadata"].get("labels") or {}
            if labels.get("ray.io/node-type") == "worker" and name not in c.workers:
                if not any(p.name == name for p in c.stopping):
                    log.info("%s: deleting pod %s (not started by this stand-in)", c.ctx, name)
                    self._delete_pod_object(c, name)
        # Pods deleted by someone else, and nodes that died: stop / forget them.
        for name, wp in list(c.workers.items()):
            api_pod = pods.get(name)
            if api_pod is None or api_pod["metadata"].get("deletionTimestamp"):
                log.info("%s: pod %s deleted; stopping its ray node", c.ctx, name)
                self._begin_stop(c, wp, api_delete=False)
            elif wp.proc is not None and not wp.proc.alive():
                log.error(
                    "%s: pod %s: ray node exited (%s); restarting it; log tail:\n%s",
                    c.ctx,
                    name,
                    wp.proc.poll(),
                    wp.proc.tail(),
                )
                self._restart_later(wp)
        groups = (obj.get("spec") or {}).get("workerGroupSpecs") or []
        for index, group in enumerate(groups):
            self._reconcile_group(c, obj, index, group)
        known = {g.get("groupName") for g in groups}
        for wp in list(c.workers.values()):
            if wp.group not in known:
                log.info("%s: group %s removed; stopping pod %s", c.ctx, wp.group, wp.name)
                self._begin_stop(c, wp)
        if c.gcs_up:
            self._start_pending_workers(c, obj)
            self._check_workers_ready(c)

    def _reconcile_group(
        self, c: _Cluster, obj: dict[str, Any], index: int, group: dict[str, Any]
    ) -> None:
        name = group.get("groupName") or f"group{index}"
        to_delete = list((group.get("scaleStrategy") or {}).get("workersToDelete") or [])
        if to_delete:
            for pod_name in to_delete:
                wp = c.workers.get(pod_name)
                if wp is not None:
                    log.info(
                        "%s: group %s: deleting pod %s (workersToDelete)", c.ctx, name, pod_name
                    )
                    self._begin_stop(c, wp)
                else:
                    log.info(
                        "%s: group %s: workersToDelete names unknown pod %s", c.ctx, name, pod_name
                    )
            self._clear_workers_to_delete(c, index, to_delete)
        replicas = podspec.group_replicas(group)
        running = [wp for wp in c.workers.values() if wp.group == name]
        diff = replicas - len(running)
        if diff > 0:
            template = group.get("template") or {}
            for _ in range(diff):
                pod_name = f"{c.name}-{name}-worker-{podspec.random_suffix(self._rng)}"
                wp = _Pod(
                    name=pod_name,
                    group=name,
                    kind="worker",
                    grace_s=podspec.grace_seconds(template),
                )
                created = self._create_pod_object(c, obj, wp, template)
                wp.uid = created["metadata"]["uid"]
                c.workers[pod_name] = wp
                log.info("%s: group %s: created pod %s", c.ctx, name, pod_name)
        elif diff < 0:
            victims = self._rng.sample(running, -diff)
            for wp in victims:
                log.info(
                    "%s: group %s: deleting random pod %s (replicas %d)",
                    c.ctx,
                    name,
                    wp.name,
                    replicas,
                )
                self._begin_stop(c, wp)

    def _clear_workers_to_delete(self, c: _Cluster, index: int, names: list[str]) -> None:
        path = f"/spec/workerGroupSpecs/{index}/scaleStrategy/workersToDelete"
        try:
            self.kube.patch(
                _cluster_path(c.namespace, c.name),
                [
                    {"op": "test", "path": path, "value": names},
                    {"op": "replace", "path": path, "value": []},
                ],
                kind="json",
            )
        except kubeapi.ApiError as exc:
            if exc.status not in (409, 422):
                raise
            log.info("%s: workersToDelete changed meanwhile; next pass handles it", c.ctx)

    def _start_pending_workers(self, c: _Cluster, obj: dict[str, Any]) -> None:
        groups = {
            g.get("groupName"): g for g in (obj.get("spec") or {}).get("workerGroupSpecs") or []
        }
        for wp in c.workers.values():
            if wp.proc is not None or time.monotonic() < wp.next_start:
                continue
            group = groups.get(wp.group) or {}
            container = podspec.first_container(group.get("template") or {})
            try:
                env = self._container_env(c, container, pod=wp)
            except podenv.EnvNotReady as exc:
                c.say_once(f"pod {wp.name} waits: {exc}")
                continue
            env["MOE_POD_NAME"] = wp.name
            wp.node_port = procs.free_port()
            argv = [
                RAY_BIN,
                "start",
                "--block",
                f"--address={c.gcs_address}",
                f"--node-ip-address={LOOPBACK}",
                f"--temp-dir={self._node_temp(c)}",
                f"--node-manager-port={wp.node_port}",
                f"--dashboard-agent-listen-port={procs.free_port()}",
                *podspec.ray_params_argv(
                    group.get("rayStartParams") or {},
                    pod_name=wp.name,
                    default_cpus="1",
                    object_store_memory=self.object_store_memory,
                ),
            ]
            wp.proc = procs.Proc(
                argv,
                env=env,
                log_path=c.workdir / f"{wp.name}.ray.log",
                owner=self.owner,
                name=f"{c.ctx} pod {wp.name} (ray worker)",
            )
            wp.started_at = podspec.now_rfc3339()
            log.info("%s: pod %s: ray worker node starting", c.ctx, wp.name)

    def _check_workers_ready(self, c: _Cluster) -> None:
        waiting = [wp for wp in c.workers.values() if wp.proc is not None]
        if not waiting:
            return
        nodes = self._alive_nodes(c)
        if nodes is None:
            return
        alive = {(labels.get(NODE_POD_LABEL), port) for labels, port in nodes}
        for wp in waiting:
            ready = (wp.name, wp.node_port) in alive
            if ready != wp.ready:
                log.info("%s: pod %s ready=%s", c.ctx, wp.name, ready)
            if not ready and not wp.ready and self._start_timed_out(c, wp):
                self._restart_later(wp)  # as a failing liveness probe would
            wp.ready = ready

    def _restart_later(self, wp: _Pod) -> None:
        """Restart a worker pod's Ray node in place after a back-off (restartPolicy Always)."""
        if wp.proc is not None:
            wp.proc.kill()
        wp.proc = None
        wp.ready = False
        wp.restarts += 1
        wp.next_start = time.monotonic() + min(30.0, 2.0 ** (wp.restarts - 1))

    # --- stopping -------------------------------------------------------------------------------

    def _begin_stop(self, c: _Cluster, pod: _Pod, *, api_delete: bool = True) -> None:
        """Delete a worker pod as KubeRay does: a graceful delete in the API (the pod shows its
        ``deletionTimestamp``), then its node stops without blocking the loop, and the Pod object
        goes (grace 0, the kubelet's part) once every process of it is gone."""
        if api_delete:
            try:
                self.kube.delete(_pods_path(c.namespace, pod.name))
            except kubeapi.ApiError as exc:
                log.warning("%s: delete pod %s: %s %s", c.ctx, pod.name, exc.status, exc.reason)
        c.workers.pop(pod.name, None)
        pod.terminating = True
        pod.ready = False
        if pod.proc is not None:
            pod.proc.request_stop()
        c.stopping.append(pod)
        self._progress_stopping(c)

    def _progress_stopping(self, c: _Cluster) -> None:
        still = []
        for pod in c.stopping:
            if pod.proc is None or pod.proc.progress_stop(grace_s=pod.grace_s):
                self._delete_pod_object(c, pod.name)
                log.info("%s: pod %s stopped and deleted", c.ctx, pod.name)
            else:
                still.append(pod)
        c.stopping = still

    def _teardown(self, c: _Cluster, *, delete_pods: bool, final: bool = False) -> None:
        """Stop everything of a cluster (runtime first, then nodes) and delete its Pod objects."""
        if c.runtime is not None:
            procs.stop_all([c.runtime], grace_s=10.0)
            c.runtime = None
        nodes = [p for p in [*c.workers.values(), *c.stopping] if p.proc is not None]
        if c.head is not None and c.head.proc is not None:
            nodes.append(c.head)
        stuck = procs.stop_all(
            [p.proc for p in nodes if p.proc is not None],
            grace_s=max(self.drain_timeout_s + 5.0, 5.0),
        )
        for proc in stuck:
            log.error("%s: could not stop %s (pids %s)", c.ctx, proc.name, proc.leftovers())
        if delete_pods:
            names = {p.name for p in [*c.workers.values(), *c.stopping]}
            if c.head is not None:
                names.add(c.head.name)
            try:
                for pod in self.kube.list(
                    _pods_path(c.namespace), label_selector=f"ray.io/cluster={c.name}"
                ):
                    names.add(pod["metadata"]["name"])
                for name in names:
                    self._delete_pod_object(c, name)
            except Exception:  # the API server may be gone already (stop() at shutdown)
                log.exception("%s: could not delete its pods", c.ctx)
        if c.gcs is not None:
            c.gcs = None
        c.head = None
        c.gcs_up = False
        c.workers.clear()
        c.stopping.clear()
        c.runtime_port = 0
        c.runtime_restarts = 0
        c.runtime_next_start = 0.0
        c.provisioned = False
        c.said.clear()
        # Ray's session files go with the nodes; a cluster that starts again gets a fresh dir.
        shutil.rmtree(c.ray_temp, ignore_errors=True)
        if not final:
            c.ray_temp.mkdir(parents=True, exist_ok=True)

    # --- pods in the API ------------------------------------------------------------------------

    def _create_pod_object(
        self, c: _Cluster, obj: dict[str, Any], pod: _Pod, template: dict[str, Any]
    ) -> dict[str, Any]:
        meta_t = template.get("metadata") or {}
        labels = {
            **(meta_t.get("labels") or {}),
            "ray.io/cluster": c.name,
            "ray.io/node-type": pod.kind,
            "ray.io/group": pod.group,
            "ray.io/identifier": f"{c.name}-{pod.kind}",
            "ray.io/is-ray-node": "yes",
            "app.kubernetes.io/name": "kuberay",
            "app.kubernetes.io/created-by": "kuberay-operator",
        }
        spec = copy.deepcopy(template.get("spec") or {})
        self._ensure_service_account(c.namespace, spec.get("serviceAccountName") or "default")
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod.name,
                "namespace": c.namespace,
                "labels": labels,
                "annotations": dict(meta_t.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": f"{GROUP}/{VERSION}",
                        "kind": "RayCluster",
                        "name": c.name,
                        "uid": c.uid,
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            # Bound at once (no scheduler here): like a scheduled pod, it then shows a
            # deletionTimestamp while it terminates instead of vanishing on delete.
            "spec": {**spec, "nodeName": podspec.NODE_NAME},
        }
        return self.kube.create(_pods_path(c.namespace), body)

    def _ensure_service_account(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key in self._service_accounts:
            return
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts"
        if self.kube.get(f"{path}/{name}") is None:
            try:
                self.kube.create(path, {"metadata": {"name": name, "namespace": namespace}})
                log.info(
                    "created service account %s/%s (no controller-manager here)", namespace, name
                )
            except kubeapi.ApiError as exc:
                if exc.status != 409:
                    raise
        self._service_accounts.add(key)

    def _delete_pod_object(self, c: _Cluster, name: str) -> None:
        try:
            self.kube.delete(_pods_path(c.namespace, name), grace_period_seconds=0)
        except kubeapi.ApiError as exc:
            log.warning("%s: delete pod %s: %s %s", c.ctx, name, exc.status, exc.reason)

    def _report_pods(self, c: _Cluster) -> None:
        """Write each pod's phase/readiness to its status subresource when it changed."""
        pods = [p for p in [c.head, *c.workers.values()] if p is not None]
        for pod in pods:
            running = pod.proc is not None and pod.proc.alive()
            restarts = c.runtime_restarts if pod.kind == "head" else pod.restarts
            state = (running, pod.ready, restarts)
            if pod.reported == state:
                continue
            body = podspec.pod_status(
                kind=pod.kind,
                ready=pod.ready,
                running=running,
                restarts=restarts,
                started_at=pod.started_at,
            )
            try:
                self.kube.patch(_pods_path(c.namespace, pod.name) + "/status", body, kind="merge")
            except kubeapi.ApiError as exc:
                if exc.status == 404:
                    continue
                raise
            pod.reported = state

    # --- RayCluster status ----------------------------------------------------------------------

    def _write_status(self, c: _Cluster, obj: dict[str, Any], *, suspended: bool) -> None:
        spec = obj.get("spec") or {}
        groups = spec.get("workerGroupSpecs") or []
        desired = sum(podspec.group_replicas(g) for g in groups)
        workers = list(c.workers.values())
        ready_workers = sum(1 for w in workers if w.ready)
        available = sum(1 for w in workers if w.proc is not None and w.proc.alive())
        head_ready = c.head is not None and c.head.ready
        if head_ready and ready_workers >= desired and not suspended:
            c.provisioned = True
        self._condition(
            c,
            COND_HEAD_READY,
            head_ready,
            REASON_HEAD_READY if head_ready else REASON_HEAD_NOT_READY,
        )
        self._condition(
            c,
            COND_PROVISIONED,
            c.provisioned,
            REASON_ALL_READY if c.provisioned else REASON_PROVISIONING,
        )
        status: dict[str, Any] = {
            "desiredWorkerReplicas": desired,
            "minWorkerReplicas": sum(int(g.get("minReplicas") or 0) for g in groups),
            "maxWorkerReplicas": sum(int(g.get("maxReplicas") or 0) for g in groups),
            "readyWorkerReplicas": ready_workers,
            "availableWorkerReplicas": available,
            "observedGeneration": obj["metadata"].get("generation", 0),
            "conditions": [dict(v) for v in c.conditions.values()],
        }
        if suspended:
            status["state"] = STATE_SUSPENDED
        elif c.provisioned:
            status["state"] = STATE_READY
        if c.head is not None:
            status["head"] = {"podIP": LOOPBACK, "serviceIP": LOOPBACK, "podName": c.head.name}
            status["endpoints"] = self._endpoints(c, spec)
        if status == c.last_status:
            return
        body = {"status": {**status, "lastUpdateTime": podspec.now_rfc3339()}}
        if "state" in status and status.get("state") != c.last_status.get("state"):
            body["status"]["stateTransitionTimes"] = {status["state"]: podspec.now_rfc3339()}
        # Merge patch: fields absent here (e.g. state before provisioning) are removed explicitly.
        for key in ("state", "head", "endpoints"):
            if key not in status and key in c.last_status:
                body["status"][key] = None
        self.kube.patch(_cluster_path(c.namespace, c.name) + "/status", body)
        c.last_status = status

    @staticmethod
    def _endpoints(c: _Cluster, spec: dict[str, Any]) -> dict[str, str]:
        """KubeRay's ``status.endpoints`` (head container port name -> port), with the local
        ports: the runtime's, the GCS's and the Ray client's; others (the dashboard) are off."""
        endpoints = {"gcs-server": str(c.gcs_port)}
        head_spec = spec.get("headGroupSpec") or {}
        for port in podspec.first_container(head_spec.get("template") or {}).get("ports") or []:
            name, number = port.get("name"), port.get("containerPort")
            if not name:
                continue
            if number == c.declared_port and c.runtime_port:
                endpoints[name] = str(c.runtime_port)
            elif number == 6379 or name in ("gcs", "gcs-server"):
                endpoints[name] = str(c.gcs_port)
            elif number == 10001 or name == "client":
                endpoints[name] = str(c.client_port)
        return endpoints

    def _condition(self, c: _Cluster, kind: str, ok: bool, reason: str) -> None:
        status = "True" if ok else "False"
        old = c.conditions.get(kind)
        if old is not None and old["status"] == status and old["reason"] == reason:
            return
        c.conditions[kind] = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": "",
            "lastTransitionTime": podspec.now_rfc3339(),
        }

    # --- env and Ray parameters -----------------------------------------------------------------

    def _base_env(self, c: _Cluster, *, pod_name: str, group: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        env.update(
            {
                "RAY_CLUSTER_NAME": c.name,
                "RAY_CLOUD_INSTANCE_ID": pod_name,
                "RAY_NODE_TYPE_NAME": group,
                "RAY_IP": LOOPBACK,
                "RAY_PORT": str(c.gcs_port),
                "RAY_ADDRESS": c.gcs_address,
                "RAY_USAGE_STATS_ENABLED": "0",
                # KubeRay's generated `ray start` (set when the head overwrites the container
                # command); the Ray node already runs here, so the command is a no-op.
                "KUBERAY_GEN_RAY_START_CMD": "true",
            }
        )
        env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", str(self.drain_timeout_s))
        return env

    def _container_env(
        self, c: _Cluster, container: dict[str, Any], *, pod: _Pod
    ) -> dict[str, str]:
        """The environment of ``pod``'s container process (raises ``podenv.EnvNotReady``)."""
        base = self._base_env(c, pod_name=pod.name, group=pod.group)
        ref = podenv.PodRef(namespace=c.namespace, name=pod.name, uid=pod.uid)
        env = self.env_resolver.container_env(base, container, pod=ref)
        env["RAY_ADDRESS"] = c.gcs_address  # KubeRay's service DNS name does not resolve here
        return env

    @staticmethod
    def _node_temp(c: _Cluster) -> Path:
        """A Ray temp dir per node, as each pod has its own /tmp: nodes sharing one race for
        socket names when they start together. Short, for Ray's Unix socket paths."""
        c.node_count += 1
        path = c.ray_temp / str(c.node_count)
        path.mkdir(parents=True, exist_ok=True)
        return path

    # --- Ray GCS --------------------------------------------------------------------------------

    def _gcs_client(self, address: str) -> Any:
        if not self._auth_checked:
            # Ray 2.60 turns on token authentication by default for `ray start`; use the same
            # token (~/.ray/auth_token) for this process's queries unless RAY_AUTH_MODE says no.
            from ray._private.authentication import authentication_token_setup

            quiet = logging.getLogger(authentication_token_setup.__name__)
            level = quiet.level
            quiet.setLevel(logging.ERROR)  # it warns that token auth is on: that is the default
            try:
                authentication_token_setup.maybe_enable_token_auth_if_token_available(
                    warn_if_disabled=False
                )
            finally:
                quiet.setLevel(level)
            self._auth_checked = True
        from ray import _raylet

        return _raylet.GcsClient(address=address)  # type: ignore[attr-defined]

    def _alive_nodes(self, c: _Cluster) -> list[tuple[dict[str, str], int]] | None:
        """(labels, node-manager port) of the ALIVE nodes of the cluster, or None when the GCS
        did not answer."""
        if c.gcs is None:
            return None
        try:
            info = c.gcs.get_all_node_info(timeout=2)
        except Exception as exc:  # noqa: BLE001 - Ray raises several RPC error types
            c.say_once(f"GCS query failed: {exc}")
            return None
        return [(dict(n.labels), n.node_manager_port) for n in info.values() if n.state == 0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.local.kuberay", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", default=None, help="watch one namespace (default: all)")
    parser.add_argument("--workdir", default=None, help="logs of the pods' processes")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    workdir = args.workdir or tempfile.mkdtemp(prefix="local-kuberay-")
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    stand_in = LocalKubeRay(args.kubeconfig, namespace=args.namespace, workdir=workdir)
    stand_in.start()
    print(
        f"local kuberay watching {args.namespace or 'all namespaces'}; logs in {workdir}",
        flush=True,
    )
    try:
        done.wait()
    finally:
        stand_in.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
