"""The KubeRay stand-in against the real local API server: a RayCluster becomes a head process and
Ray worker nodes, scales like KubeRay (``workersToDelete`` first, then random) and leaves nothing
behind when deleted."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e.controlplane import cluster
from e2e.kube import wait_for
from e2e.local import kubeapi, kuberay, podspec, procs

pytestmark = [pytest.mark.controlplane, pytest.mark.ray, pytest.mark.timeout(300)]

NAME = "rc-e2e"
ADMIN_TOKEN = "s3cret-token"

# The head container's command: a stand-in for `moe-runtime serve` with the routes the stand-in
# needs (/health) and one that shows the container's environment (/env).
FAKE_RUNTIME = textwrap.dedent(
    """
    import argparse, http.server, json, os
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    a = p.parse_args()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                body = b"ok"
            elif self.path == "/env":
                body = json.dumps({k: os.environ.get(k) for k in
                    ("POD_NAME", "POD_NAMESPACE", "MOE_ADMIN_TOKEN", "RAY_ADDRESS", "GREETING",
                     )}).encode()
            else:
                self.send_error(404); return
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *args): pass
    http.server.ThreadingHTTPServer((a.host, a.port), H).serve_forever()
    """
)

# A Ray driver that places one actor per worker node ({"moe_rank": 1} bundles, STRICT_SPREAD, as
# the executor does) and prints what each actor reads from MOE_POD_NAME.
POD_NAMES_DRIVER = textwrap.dedent(
    """
    import json, os, sys, ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    n = int(sys.argv[1])
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    pg = placement_group([{"moe_rank": 1}] * n, strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    @ray.remote(num_cpus=0, resources={"moe_rank": 1})
    class Rank:
        def pod(self):
            return os.environ.get("MOE_POD_NAME")
    ranks = [Rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(n)]
    print(json.dumps(sorted(ray.get([r.pod.remote() for r in ranks], timeout=60))))
    """
)


def raycluster(namespace: str, *, replicas: int) -> dict[str, Any]:
    """A RayCluster shaped like the operator's: runtime on the head, moe_rank workers."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {
                "rayStartParams": {"num-cpus": "0"},
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": "elastic-moe/runtime:dev",
                                "command": [sys.executable, "-c", FAKE_RUNTIME],
                                "args": ["--host", "0.0.0.0", "--port", "8000"],
                                "ports": [{"name": "http", "containerPort": 8000}],
                                "env": [
                                    {
                                        "name": "POD_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                    },
                                    {
                                        "name": "POD_NAMESPACE",
                                        "valueFrom": {
                                            "fieldRef": {"fieldPath": "metadata.namespace"}
                                        },
                                    },
                                    # $(VAR) refers to variables defined above it.
                                    {"name": "GREETING", "value": "hi $(POD_NAMESPACE)"},
                                    {
                                        "name": "MOE_ADMIN_TOKEN",
                                        "valueFrom": {
                                            "secretKeyRef": {
                                                "name": f"{NAME}-admin",
                                                "key": "token",
                                            }
                                        },
                                    },
                                ],
                            }
                        ]
                    }
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": "ranks",
                    "replicas": replicas,
                    "minReplicas": 0,
                    "maxReplicas": 8,
                    "rayStartParams": {"resources": '"{\\"moe_rank\\": 1}"', "num-cpus": "1"},
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "ray-worker",
                                    "image": "elastic-moe/runtime:dev",
                                    "env": [
                                        {
                                            "name": "MOE_POD_NAME",
                                            "valueFrom": {
                                                "fieldRef": {"fieldPath": "metadata.name"}
                                            },
                                        }
                                    ],
                                }
                            ]
                        }
                    },
                }
            ],
        },
    }


# --- pure helpers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param('"{\\"moe_rank\\": 1}"', {"moe_rank": 1.0}, id="kuberay-shell-word"),
        pytest.param('{"moe_rank": 2, "x": 0.5}', {"moe_rank": 2.0, "x": 0.5}, id="plain-json"),
        pytest.param({"moe_rank": 1}, {"moe_rank": 1.0}, id="mapping"),
    ],
)
def test_parse_resources(value: Any, expected: dict[str, float]) -> None:
    assert podspec.parse_resources(value) == expected


def test_parse_resources_refuses_non_json() -> None:
    with pytest.raises(ValueError, match="rayStartParams.resources"):
        podspec.parse_resources("moe_rank=1")


@pytest.mark.parametrize(
    ("argv", "expected", "declared"),
    [
        pytest.param(
            ["moe-runtime", "serve", "--host", "0.0.0.0", "--port", "8000"],
            ["moe-runtime", "serve", "--host", "127.0.0.1", "--port", "9999"],
            8000,
            id="separate-values",
        ),
        pytest.param(
            ["moe-runtime", "serve", "--port=8080", "--host=0.0.0.0"],
            ["moe-runtime", "serve", "--port=9999", "--host=127.0.0.1"],
            8080,
            id="equals-values",
        ),
        pytest.param(
            ["sh", "-c", "exec moe-runtime serve --port 8000 --host 0.0.0.0"],
            ["sh", "-c", "exec moe-runtime serve --port 9999 --host 127.0.0.1"],
            8000,
            id="shell-string",
        ),
        pytest.param(
            [
                "/bin/bash",
                "-lc",
                "--",
                "ulimit -n 65536; $KUBERAY_GEN_RAY_START_CMD && exec moe-runtime serve"
                " --model m --host 0.0.0.0 --port 8000",
            ],
            [
                "/bin/bash",
                "-c",
                "--",
                "ulimit -n 65536; $KUBERAY_GEN_RAY_START_CMD && exec moe-runtime serve"
                " --model m --host 127.0.0.1 --port 9999",
            ],
            8000,
            id="operator-head-command",
        ),
        pytest.param(
            ["bash", "-l", "-c", "moe-runtime serve"],
            ["bash", "-c", "moe-runtime serve --host 127.0.0.1 --port 9999"],
            8000,
            id="login-shell-absent-port",
        ),
        pytest.param(
            ["moe-runtime", "serve"],
            ["moe-runtime", "serve", "--host", "127.0.0.1", "--port", "9999"],
            8000,
            id="absent-appended",
        ),
    ],
)
def test_rewrite_runtime_argv(argv: list[str], expected: list[str], declared: int) -> None:
    local = podspec.local_shell_argv(argv)
    assert podspec.rewrite_runtime_argv(local, port=9999) == (expected, declared)


def test_expand_vars() -> None:
    env = {"A": "x"}
    assert podspec.expand_vars("$(A)-$(B)-$$(A)", env) == "x-$(B)-$(A)"


# --- against the control plane ------------------------------------------------------------------


@pytest.fixture(scope="module")
def kube(control_plane: cluster.ControlPlane) -> Any:
    client = kubeapi.Kube(control_plane.kubeconfig)
    yield client
    client.close()


@pytest.fixture(scope="module")
def rc(
    kube: kubeapi.Kube, kuberay_namespace: str, local_kuberay: kuberay.LocalKubeRay
) -> dict[str, Any]:
    """The RayCluster under test (2 workers) and its admin Secret, created once per module."""
    kube.create(
        f"/api/v1/namespaces/{kuberay_namespace}/secrets",
        {
            "metadata": {"name": f"{NAME}-admin"},
            "data": {"token": base64.b64encode(ADMIN_TOKEN.encode()).decode()},
        },
    )
    return kube.create(
        f"/apis/ray.io/v1/namespaces/{kuberay_namespace}/rayclusters",
        raycluster(kuberay_namespace, replicas=2),
    )


def rc_path(namespace: str) -> str:
    return f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters/{NAME}"


def worker_pods(kube: kubeapi.Kube, namespace: str) -> dict[str, dict[str, Any]]:
    pods = kube.list(
        f"/api/v1/namespaces/{namespace}/pods",
        label_selector=f"ray.io/cluster={NAME},ray.io/node-type=worker",
    )
    return {p["metadata"]["name"]: p for p in pods}


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def ready_workers(kube: kubeapi.Kube, namespace: str, n: int) -> dict[str, dict[str, Any]] | None:
    """The worker pods when exactly ``n`` exist and all are Ready, and the RayCluster's status
    agrees; else None."""
    pods = worker_pods(kube, namespace)
    if len(pods) != n or not all(is_ready(p) for p in pods.values()):
        return None
    status = (kube.get(rc_path(namespace)) or {}).get("status") or {}
    if status.get("readyWorkerReplicas") != n or status.get("desiredWorkerReplicas") != n:
        return None
    return pods


def pod_names_seen_by_actors(stand_in: kuberay.LocalKubeRay, namespace: str, n: int) -> list[str]:
    address = stand_in.gcs_address(namespace, NAME)
    assert address is not None
    done = subprocess.run(
        [sys.executable, "-c", POD_NAMES_DRIVER, str(n)],
        env={**os.environ, "RAY_ADDRESS": address},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return names


def set_replicas(
    kube: kubeapi.Kube, namespace: str, replicas: int, workers_to_delete: list[str] | None = None
) -> None:
    patch: list[dict[str, Any]] = [
        {"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": replicas}
    ]
    if workers_to_delete is not None:
        patch.append(
            {
                "op": "add",
                "path": "/spec/workerGroupSpecs/0/scaleStrategy",
                "value": {"workersToDelete": workers_to_delete},
            }
        )
    kube.patch(rc_path(namespace), patch, kind="json")


def test_head_runs_the_runtime_with_its_env_and_publishes_the_endpoint(
    kube: kubeapi.Kube, kuberay_namespace: str, rc: dict[str, Any]
) -> None:
    def head_ready() -> dict[str, Any] | None:
        obj = kube.get(rc_path(kuberay_namespace)) or {}
        status = obj.get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        return obj if conditions.get(kuberay.COND_HEAD_READY) == "True" else None

    obj = wait_for(head_ready, timeout_s=90, what="HeadPodReady")
    endpoint = obj["metadata"]["annotations"][kuberay.ENDPOINT_ANNOTATION]
    assert endpoint.startswith("http://127.0.0.1:")
    assert obj["status"]["head"]["podIP"] == "127.0.0.1"
    port = endpoint.rsplit(":", 1)[1]
    assert obj["status"]["endpoints"]["http"] == port
    heads = kube.list(
        f"/api/v1/namespaces/{kuberay_namespace}/pods",
        label_selector=f"ray.io/cluster={NAME},ray.io/node-type=head,ray.io/group=headgroup",
    )
    assert len(heads) == 1 and is_ready(heads[0])
    assert heads[0]["status"]["podIP"] == "127.0.0.1"
    with urllib.request.urlopen(f"{endpoint}/env", timeout=5) as response:  # noqa: S310
        env = json.loads(response.read())
    gcs_port = obj["status"]["endpoints"]["gcs-server"]
    assert env == {
        "POD_NAME": heads[0]["metadata"]["name"],
        "POD_NAMESPACE": kuberay_namespace,
        "MOE_ADMIN_TOKEN": ADMIN_TOKEN,
        "RAY_ADDRESS": f"127.0.0.1:{gcs_port}",
        "GREETING": f"hi {kuberay_namespace}",
    }


def test_two_replicas_become_two_ready_pods_with_their_own_ray_nodes(
    kube: kubeapi.Kube,
    kuberay_namespace: str,
    rc: dict[str, Any],
    local_kuberay: kuberay.LocalKubeRay,
) -> None:
    pods = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 2), timeout_s=90, what="2 ready workers"
    )
    for name, pod in pods.items():
        assert re.fullmatch(rf"{NAME}-ranks-worker-[a-z0-9]{{5}}", name), name
        assert pod["metadata"]["labels"]["ray.io/group"] == "ranks"
    assert pod_names_seen_by_actors(local_kuberay, kuberay_namespace, 2) == sorted(pods)
    status = (kube.get(rc_path(kuberay_namespace)) or {})["status"]
    assert status["state"] == "ready"
    assert status["observedGeneration"] == rc["metadata"]["generation"]


def test_scale_up_adds_a_pod_and_a_node(
    kube: kubeapi.Kube, kuberay_namespace: str, rc: dict[str, Any]
) -> None:
    before = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 2), timeout_s=90, what="2 ready workers"
    )
    set_replicas(kube, kuberay_namespace, 3)
    after = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 3), timeout_s=90, what="3 ready workers"
    )
    assert set(before) < set(after)


def test_workers_to_delete_removes_exactly_the_named_pod_and_clears_the_list(
    kube: kubeapi.Kube,
    kuberay_namespace: str,
    rc: dict[str, Any],
    local_kuberay: kuberay.LocalKubeRay,
) -> None:
    before = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 3), timeout_s=90, what="3 ready workers"
    )
    victim = sorted(before)[1]
    set_replicas(kube, kuberay_namespace, 2, workers_to_delete=[victim])
    after = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 2), timeout_s=60, what="2 ready workers"
    )
    assert set(after) == set(before) - {victim}
    spec = (kube.get(rc_path(kuberay_namespace)) or {})["spec"]
    assert spec["workerGroupSpecs"][0]["scaleStrategy"].get("workersToDelete", []) == []
    assert pod_names_seen_by_actors(local_kuberay, kuberay_namespace, 2) == sorted(after)


def test_scale_down_without_names_deletes_some_pod(
    kube: kubeapi.Kube, kuberay_namespace: str, rc: dict[str, Any]
) -> None:
    before = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 2), timeout_s=90, what="2 ready workers"
    )
    set_replicas(kube, kuberay_namespace, 1)
    after = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 1), timeout_s=60, what="1 ready worker"
    )
    assert set(after) < set(before)


def test_a_deleted_worker_pod_is_replaced_by_a_new_one(
    kube: kubeapi.Kube, kuberay_namespace: str, rc: dict[str, Any]
) -> None:
    (before,) = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 1), timeout_s=90, what="1 ready worker"
    )
    kube.delete(f"/api/v1/namespaces/{kuberay_namespace}/pods/{before}")
    after = wait_for(
        lambda: (pods := ready_workers(kube, kuberay_namespace, 1)) and before not in pods and pods,
        timeout_s=60,
        what="a new ready worker",
    )
    assert before not in after


def test_a_dead_ray_node_is_restarted_in_the_same_pod(
    kube: kubeapi.Kube, kuberay_namespace: str, local_kuberay: kuberay.LocalKubeRay
) -> None:
    (name,) = wait_for(
        lambda: ready_workers(kube, kuberay_namespace, 1), timeout_s=90, what="1 ready worker"
    )
    raylets = [
        p
        for p in local_kuberay.pod_pids(kuberay_namespace, NAME, name)
        if "/raylet" in cmdline(p).split(" ")[0]
    ]
    assert len(raylets) == 1, [
        cmdline(p) for p in local_kuberay.pod_pids(kuberay_namespace, NAME, name)
    ]
    os.kill(raylets[0], signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        pods = ready_workers(kube, kuberay_namespace, 1)
        if not pods or name not in pods:
            return None
        statuses = pods[name]["status"].get("containerStatuses") or [{}]
        return pods[name] if statuses[0].get("restartCount") == 1 else None

    wait_for(restarted, timeout_s=90, what=f"pod {name} ready again with restartCount 1")


def test_deleting_the_raycluster_stops_everything(
    kube: kubeapi.Kube,
    kuberay_namespace: str,
    rc: dict[str, Any],
    local_kuberay: kuberay.LocalKubeRay,
) -> None:
    wait_for(lambda: ready_workers(kube, kuberay_namespace, 1), timeout_s=90, what="1 ready worker")
    ray_temp = local_kuberay.ray_temp_dir(kuberay_namespace, NAME)
    assert ray_temp is not None
    ray_pids = pids_mentioning(str(ray_temp))  # raylets, GCS, agents, workers of this cluster
    assert ray_pids, "no Ray process names the cluster's temp dir"
    untagged = [p for p in set(ray_pids) - set(local_kuberay.leftover_pids()) if alive(p)]
    assert not untagged, f"untagged Ray processes: {[cmdline(p) for p in untagged]}"
    kube.delete(rc_path(kuberay_namespace))

    def all_gone() -> bool:
        pods = kube.list(
            f"/api/v1/namespaces/{kuberay_namespace}/pods", label_selector=f"ray.io/cluster={NAME}"
        )
        return not pods and not local_kuberay.leftover_pids() and not ray_temp.exists()

    wait_for(all_gone, timeout_s=60, what="no pod and no process of the deleted cluster")
    assert procs.tagged_pids(procs.OWNER_ENV, local_kuberay.owner) == []
    left = pids_mentioning(str(ray_temp))
    assert left == [], [cmdline(p) for p in left]


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:300]
    except OSError:
        return f"{pid} (gone)"


def pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(entry))
    return found


def test_cli_runs_a_head_only_cluster_and_stops_everything_on_sigterm(
    control_plane: cluster.ControlPlane, kube: kubeapi.Kube, tmp_path: Path
) -> None:
    namespace = "e2e-kuberay-cli"
    if kube.get(f"/api/v1/namespaces/{namespace}") is None:
        kube.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    head_only = raycluster(namespace, replicas=0)
    head_only["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("command")
    head_only["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("args")
    kube.create(f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters", head_only)
    cli = subprocess.Popen(
        [sys.executable, "-m", "e2e.local.kuberay", "--kubeconfig", str(control_plane.kubeconfig)]
        + ["--namespace", namespace, "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    owner = f"{procs.OWNER_ENV}=lkr-{cli.pid}-".encode()
    try:

        def head_ready() -> bool:
            status = (kube.get(rc_path(namespace)) or {}).get("status") or {}
            return status.get("state") == "ready" and status.get("desiredWorkerReplicas") == 0

        wait_for(head_ready, timeout_s=90, what="the head-only cluster ready")
        assert pids_with_env_prefix(owner), "the CLI's Ray head is not tagged"
    finally:
        cli.send_signal(signal.SIGTERM)
        output, _ = cli.communicate(timeout=60)
    assert cli.returncode == 0, output[-3000:]
    assert pids_with_env_prefix(owner) == []
    heads = kube.list(f"/api/v1/namespaces/{namespace}/pods")
    assert heads == [], "stop() deletes the pods it made"
    kube.delete(rc_path(namespace))


def pids_with_env_prefix(prefix: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if any(item.startswith(prefix) for item in environ.split(b"\0")):
            found.append(int(entry))
    return found
