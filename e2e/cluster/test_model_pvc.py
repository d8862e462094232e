"""A real checkpoint on a PersistentVolumeClaim, served on the real node, behind a
NetworkPolicy that the node enforces.

A PersistentVolume (a host directory the test fills) and its ReadWriteOnce claim hold a tiny
random checkpoint written by transformers' ``save_pretrained``; a MoEDeployment with
``source: pvc://CLAIM/DIR`` at DP=2, in a namespace that enforces Pod Security `restricted`,
serves it (the claim mounted read-only in the head and every worker). Its greedy answers,
through ``kubectl port-forward``, are token for token transformers' ``generate``; they stay so
under checked load while ``kubectl scale`` grows it to 3 and a worker pod is deleted. A
MoEDeployment naming a claim that does not exist says so in its Ready condition and creates
nothing. A probe pod in another namespace reaches the runtime's port 8000 and not the GCS
or a worker's raylet; with the NetworkPolicy deleted (and the operator, which puts it back,
stopped) the same probe reaches them: the node enforces it. Last, short-lived one-rank
deployments on the same claim: one naming a path without ``config.json`` is reported as a
failed start (``LoadFailed``, the runtime's reason) within 2 minutes, and one whose reads are
slowed (the test-only hook ``tests/support/slow_load.py``, put on the volume and named in
``spec.ray.env``) shows its load progress in ``kubectl get moed`` while it loads; and a
third, whose worker pods' memory limit is below what a rank needs, is reported ``Failed``
(``LoadFailed``) with a message that names memory.

One deployment serves every check, in order.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e import kube
from e2e import load as load_mod
from e2e.cluster import conftest
from e2e.node import config, install
from tests.support import checkpoints, slow_load

pytestmark = pytest.mark.cluster

NAME = "pvc-tiny"
MISSING = "no-claim"
CLAIM = "models"
MODEL_DIR = "mixtral/tiny"
PV_NAME = "moe-e2e-models"
#: Host directories the test's PersistentVolumes point at (hostPath; removed afterwards).
HOST_ROOT = pathlib.Path("/var/lib/elastic-moe/e2e-models")
LENGTHS = (8, 24, 64)
TIMEOUT_S = 420.0
PROBE_NAMESPACE = "moe-e2e-probe"
NO_CONFIG = "no-config"
NO_CONFIG_DIR = "empty"
SLOW = "slow-load"
HOOKS_DIR = "hooks"
#: Seconds each tensor (or expert) read of the slowed load waits: about 10 s for a rank.
SLOW_READ_S = 0.3


@pytest.fixture(scope="module")
def checkpoint() -> Iterator[tuple[pathlib.Path, Any]]:
    """The volume's directory on this machine, holding ``MODEL_DIR``, and the model."""
    if conftest.EXTERNAL_KUBECONFIG:
        pytest.skip("the PersistentVolume is a directory of the local node")
    root = HOST_ROOT / uuid.uuid4().hex[:8]
    model = checkpoints.build(root / MODEL_DIR)
    (root / NO_CONFIG_DIR).mkdir(parents=True)  # a path without config.json
    # the test-only load hook (tests/support/slow_load.py), importable from the volume
    hooks = root / HOOKS_DIR / "tests" / "support"
    hooks.mkdir(parents=True)
    for package in (hooks, hooks.parent):
        (package / "__init__.py").write_text("")
    shutil.copy(pathlib.Path(slow_load.__file__), hooks / "slow_load.py")
    # what a download Job leaves: world-readable files (the runtime runs as uid 1000)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    for parent in (HOST_ROOT, HOST_ROOT.parent):
        parent.chmod(0o755)
    yield root, model
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(
    checkpoint: tuple[pathlib.Path, Any],
) -> dict[tuple[int, int, int | None], list[int]]:
    """transformers' greedy tokens for every prompt and length of the checked load."""
    _, model = checkpoint
    tokens = checkpoints.greedy_tokens(model, load_mod.PROMPTS, max(LENGTHS))
    return {(p, n, None): tokens[p][:n] for p in range(len(load_mod.PROMPTS)) for n in LENGTHS}


def _claim_objects(host_dir: pathlib.Path, namespace: str) -> list[dict[str, Any]]:
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": PV_NAME},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(host_dir), "type": "Directory"},
            "claimRef": {"namespace": namespace, "name": CLAIM},
        },
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "volumeName": PV_NAME,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return [volume, claim]


def _moed(name: str, source: str, *, size: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "elasticmoe.io/v1alpha1",
        "kind": "MoEDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": source, "servedModelName": name},
            "dataParallelSize": size,
            "minDataParallelSize": 1,
            "maxDataParallelSize": 3,
            "ray": dict(conftest.sample()["spec"]["ray"]),  # type: ignore[index]
        },
    }


@pytest.fixture(scope="module")
def dep(
    node: kube.Kubectl, namespace: str, checkpoint: tuple[pathlib.Path, Any]
) -> Iterator[kube.Deployment]:
    host_dir, _ = checkpoint
    node.kubectl("delete", "pv", PV_NAME, "--ignore-not-found", "--wait=true", timeout=120)
    manifests = [
        *_claim_objects(host_dir, namespace),
        _moed(NAME, f"pvc://{CLAIM}/{MODEL_DIR}"),
        _moed(MISSING, f"pvc://absent/{MODEL_DIR}"),
    ]
    started = time.monotonic()
    node.kubectl(
        "apply", "-n", namespace, "-f", "-", input="\n---\n".join(map(yaml.safe_dump, manifests))
    )
    forward = kube.PortForward(node, namespace=namespace, target=f"svc/{NAME}-api", port=8000)
    d = kube.Deployment(cluster=node, name=NAME, namespace=namespace, endpoint=forward.url)
    try:
        kube.wait_for(lambda: d.serving(2), timeout_s=TIMEOUT_S, what="DP=2 Serving")
        print(f"\n[pvc] kubectl apply -> Serving at DP=2: {time.monotonic() - started:.1f}s")
        yield d
    finally:
        forward.stop()
        node.kubectl("delete", "moed", NAME, MISSING, "-n", namespace, "--wait=true",
                     check=False, timeout=180)  # fmt: skip
        kube.wait_for(lambda: not d.pods() and not d.pods("head"), timeout_s=180, what="pods gone")
        node.kubectl("delete", "pvc", CLAIM, "-n", namespace, "--wait=true", check=False,
                     timeout=120)  # fmt: skip
        node.kubectl("delete", "pv", PV_NAME, "--wait=true", check=False, timeout=120)


def test_a_missing_claim_is_reported_and_nothing_is_created(
    dep: kube.Deployment, namespace: str
) -> None:
    missing = kube.Deployment(cluster=dep.cluster, name=MISSING, namespace=namespace)

    def reported() -> dict[str, Any] | None:
        conditions = {c["type"]: c for c in missing.status().get("conditions") or []}
        ready = conditions.get("Ready") or {}
        return ready if ready.get("reason") == "ModelUnavailable" else None

    # the deployment next to it has been serving for a while: far more than the 2 minutes
    ready = kube.wait_for(reported, timeout_s=120, what="Ready=False ModelUnavailable")
    assert ready["status"] == "False" and "'absent'" in ready["message"]
    assert missing.status()["phase"] == "Pending"
    assert [e for e in missing.events() if e["reason"] == "ModelUnavailable"]
    none = dep.kubectl("get", "raycluster", MISSING, "-n", namespace, check=False)
    assert none.returncode != 0 and "NotFound" in none.stderr
    assert missing.pods("head") == [] and missing.pods() == []  # no head to crash-loop


def test_a_checkpoint_on_a_claim_answers_as_transformers(
    dep: kube.Deployment, reference: dict[tuple[int, int, int | None], list[int]]
) -> None:
    head = dep.pods("head")[0]
    mounts = {m["name"]: m for m in head["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True
    assert mounts["model"]["mountPath"] == f"/models/{CLAIM}"
    for pod in [head, *dep.pods()]:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": CLAIM, "readOnly": True}
    with load_mod.Load(
        dep.endpoint, model_name=NAME, reference=reference, clients=2, lengths=LENGTHS, seeds=()
    ) as load:
        kube.wait_for(lambda: load.ok >= 12 or load.failed, timeout_s=300, what="12 answers")
    assert load.failures == []


PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("open")
except OSError as error:
    print(type(error).__name__)
"""

#: The TCP ports the raylet listens on outside loopback (node manager, object manager: Ray
#: picks them at random), from its sockets' inodes and /proc/net/tcp{,6} (gRPC listens on
#: "::", an IPv6 socket that also takes IPv4).
RAYLET_PORTS = """
import os, re
socks = set()
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        if open(f"/proc/{pid}/comm").read().strip() != "raylet":
            continue
        for fd in os.listdir(f"/proc/{pid}/fd"):
            m = re.match(r"socket:\\[(\\d+)\\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
            if m:
                socks.add(m.group(1))
    except OSError:
        pass
loopback = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")
ports = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        address, port = f[1].split(":")
        if f[3] == "0A" and f[9] in socks and address not in loopback:
            ports.add(int(port, 16))
print(" ".join(map(str, sorted(ports))))
"""


@pytest.fixture(scope="module")
def probe(node: kube.Kubectl) -> Iterator[str]:
    """A pod in another namespace, outside the RayCluster; the pod's name."""
    install.ensure_namespace(node, PROBE_NAMESPACE, labels=conftest.RESTRICTED)
    image = f"{install.RUNTIME_IMAGE_REPO}:{install.project_version()}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe", "namespace": PROBE_NAMESPACE},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "probe", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "infinity"],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }  # fmt: skip
    node.kubectl("apply", "-f", "-", input=json.dumps(pod))
    node.kubectl("wait", "-n", PROBE_NAMESPACE, "--for=condition=Ready", "pod/probe",
                 "--timeout=120s", timeout=150)  # fmt: skip
    yield "probe"
    node.kubectl("delete", "namespace", PROBE_NAMESPACE, "--wait=false", check=False)


def _reach(node: kube.Kubectl, targets: list[tuple[str, int]]) -> list[str]:
    """What the probe pod gets connecting to each (ip, port): ``open`` or the error's name."""
    out = []
    for ip, port in targets:
        done = node.kubectl("exec", "-n", PROBE_NAMESPACE, "probe", "--",
                            "python3", "-c", PROBE, ip, str(port))  # fmt: skip
        out.append(done.stdout.strip())
    return out


def _operator_replicas(node: kube.Kubectl, replicas: int) -> None:
    node.kubectl("scale", "deployment/moe-operator", "-n", config.OPERATOR_NAMESPACE,
                 f"--replicas={replicas}")  # fmt: skip
    kube.wait_for(
        lambda: len(json.loads(node.kubectl(
            "get", "pods", "-n", config.OPERATOR_NAMESPACE, "-l",
            "app.kubernetes.io/name=moe-operator", "-o", "json").stdout)["items"]) == replicas,
        timeout_s=120, what=f"{replicas} operator pods",
    )  # fmt: skip


def test_the_network_policy_is_enforced(
    node: kube.Kubectl, dep: kube.Deployment, probe: str
) -> None:
    if os.environ.get("MOE_E2E_KUBECONFIG"):
        pytest.skip("another cluster's network plugin may not enforce NetworkPolicies")
    head_ip = dep.pods("head")[0]["status"]["podIP"]
    worker = dep.pods()[0]
    ports = dep.kubectl(
        "exec", "-n", dep.namespace, worker["metadata"]["name"], "-c", "ray-worker", "--",
        "python3", "-c", RAYLET_PORTS,
    ).stdout.split()  # fmt: skip
    assert ports, "no raylet port found in the worker"
    ray = [(head_ip, 6379), *[(worker["status"]["podIP"], int(p)) for p in ports]]
    api = [(head_ip, 8000)]
    print(f"\n[netpol] runtime API {api}, GCS and raylet ports {ray}")
    blocked = kube.wait_for(
        lambda: (lambda got: got if got[0] == "open" and "open" not in got[1:] else None)(
            _reach(node, api + ray)
        ),
        timeout_s=60,
        what="port 8000 open, the Ray ports closed to the probe",
    )
    print(f"[netpol] with the policy: {blocked}")
    # Without the policy the same probe reaches them (the operator, which puts the policy
    # back at its next reconcile, is stopped meanwhile).
    _operator_replicas(node, 0)
    try:
        dep.kubectl("delete", "networkpolicy", f"{NAME}-ray", "-n", dep.namespace)
        kube.wait_for(
            lambda: set(_reach(node, api + ray)) == {"open"},
            timeout_s=60,
            what="every port open once the policy is gone",
        )
    finally:
        _operator_replicas(node, 1)
    kube.wait_for(
        lambda: dep.kubectl("get", "networkpolicy", f"{NAME}-ray", "-n", dep.namespace,
                            check=False).returncode == 0,
        timeout_s=120, what="the operator to put the policy back",
    )  # fmt: skip
    kube.wait_for(
        lambda: "open" not in _reach(node, ray), timeout_s=60, what="the Ray ports closed again"
    )


def test_scale_to_three_and_a_deleted_worker_keep_the_answers(
    dep: kube.Deployment, reference: dict[tuple[int, int, int | None], list[int]]
) -> None:
    with load_mod.Load(
        dep.endpoint, model_name=NAME, reference=reference, clients=2, lengths=LENGTHS, seeds=()
    ) as load:
        kube.wait_for(lambda: load.ok >= 2 or load.failed, timeout_s=180, what="first answers")
        dep.kubectl("scale", "moed", NAME, "-n", dep.namespace, "--replicas=3")
        kube.wait_for(
            lambda: dep.serving(3) and len(dep.ready_worker_pods()) == 3,
            timeout_s=TIMEOUT_S,
            what="DP=3",
        )
        history = len(dep.runtime_status()["history"])
        ranks = [r["pod"] for r in dep.runtime_status()["ranks"] if r.get("pod")]
        victim = ranks[-1]
        dep.kubectl("delete", "pod", victim, "-n", dep.namespace, "--wait=false")
        kube.wait_for(
            lambda: [
                r
                for r in dep.runtime_status()["history"][history:]
                if r.get("kind") == "recovery" and r["stage"] == "Completed"
            ],
            timeout_s=TIMEOUT_S,
            what="the runtime's recovery from the deleted worker",
        )
        kube.wait_for(
            lambda: (
                dep.serving(3)
                and len(dep.ready_worker_pods()) == 3
                and victim not in dep.worker_pods()
            ),
            timeout_s=TIMEOUT_S,
            what="DP=3 again after the deleted worker",
        )
        settled = load.ok + 4
        kube.wait_for(lambda: load.ok >= settled, timeout_s=180, what="answers at DP=3")
    print(f"\n[pvc] {load.summary()}")
    assert load.failures == []
    assert load.ok >= 10


def _ready(d: kube.Deployment) -> dict[str, Any]:
    conditions = {c["type"]: c for c in d.status().get("conditions") or []}
    return conditions.get("Ready") or {}


def test_a_path_without_config_json_is_a_failed_start_with_its_reason(
    dep: kube.Deployment, namespace: str
) -> None:
    doc = _moed(NO_CONFIG, f"pvc://{CLAIM}/{NO_CONFIG_DIR}", size=1)
    started = time.monotonic()
    dep.cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    bad = kube.Deployment(cluster=dep.cluster, name=NO_CONFIG, namespace=namespace)
    try:
        ready = kube.wait_for(
            lambda: (c := _ready(bad)).get("reason") == "LoadFailed" and c,
            timeout_s=120,
            what="Ready=False LoadFailed",
        )
        print(f"\n[pvc] a path without config.json reported in {time.monotonic() - started:.1f}s")
        assert "config.json" in ready["message"] and NO_CONFIG_DIR in ready["message"]
        assert bad.status()["phase"] == "Failed"
        assert [e for e in bad.events() if e["reason"] == "LoadFailed"]
        table = dep.kubectl("get", "moed", NO_CONFIG, "-n", namespace).stdout
        assert "needs config.json" in table  # the MESSAGE column
    finally:
        dep.cluster.kubectl("delete", "moed", NO_CONFIG, "-n", namespace, "--wait=true",
                    check=False, timeout=180)  # fmt: skip


def test_load_progress_is_shown_while_a_slowed_read_loads(
    dep: kube.Deployment, namespace: str
) -> None:
    doc = _moed(SLOW, f"pvc://{CLAIM}/{MODEL_DIR}", size=1)
    doc["spec"]["ray"]["env"] = [
        {"name": "PYTHONPATH", "value": f"/models/{CLAIM}/{HOOKS_DIR}"},
        {"name": "MOE_RANK_HOOKS", "value": slow_load.PATH},
        {"name": slow_load.DELAY_ENV, "value": str(SLOW_READ_S)},
    ]
    dep.cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    slow = kube.Deployment(cluster=dep.cluster, name=SLOW, namespace=namespace)
    try:
        table = kube.wait_for(
            lambda: (
                (out := dep.kubectl("get", "moed", SLOW, "-n", namespace).stdout)
                and "loading weights" in out
                and out
            ),
            timeout_s=TIMEOUT_S,
            what="load progress in kubectl get moed",
        )
        print(f"\n[pvc] {table.splitlines()[-1]}")
        loading = slow.status().get("loading") or {}
        assert loading.get("bytesTotal", 0) > 0 and loading.get("ranksTotal") == 1
        assert [e for e in slow.events() if e["reason"] == "LoadingModel"]
        kube.wait_for(lambda: slow.serving(1), timeout_s=TIMEOUT_S, what="DP=1 Serving")
        assert "loading" not in slow.status()
    except BaseException:
        heads = dep.cluster.kubectl("get", "pods", "-n", namespace, "-o", "name", check=False)
        for pod in heads.stdout.split():
            if SLOW in pod:
                log = dep.cluster.kubectl("logs", pod, "-n", namespace, "--all-containers",
                                          check=False, timeout=60)  # fmt: skip
                print(f"\n===== {pod}\n{log.stdout[-20000:]}")
        raise
    finally:
        dep.cluster.kubectl("delete", "moed", SLOW, "-n", namespace, "--wait=true",
                    check=False, timeout=180)  # fmt: skip


OOM = "oom-rank"
#: A worker memory limit below what one rank process needs (~770 MB before any weight).
OOM_LIMIT = "400Mi"


def test_a_rank_out_of_memory_is_a_failed_start_that_says_so(
    dep: kube.Deployment, namespace: str
) -> None:
    doc = _moed(OOM, f"pvc://{CLAIM}/{MODEL_DIR}", size=1)
    doc["spec"]["ray"]["workerResources"] = {
        "requests": {"memory": OOM_LIMIT},
        "limits": {"memory": OOM_LIMIT},
    }
    dep.cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    oom = kube.Deployment(cluster=dep.cluster, name=OOM, namespace=namespace)
    try:

        def reported() -> str | None:
            conditions = oom.status().get("conditions") or []
            ready = next((c for c in conditions if c.get("type") == "Ready"), {})
            message = str(ready.get("message") or "")
            if ready.get("reason") == "LoadFailed" and "memory" in message:
                return message
            return None

        message = kube.wait_for(reported, timeout_s=300, what="LoadFailed naming memory")
        print(f"\n[pvc] {OOM}: {message}")
        assert oom.status().get("phase") == "Failed"
        assert [e for e in oom.events() if e["reason"] == "LoadFailed"]
    finally:
        dep.cluster.kubectl("delete", "moed", OOM, "-n", namespace, "--wait=true",
                    check=False, timeout=180)  # fmt: skip
