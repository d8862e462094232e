"""The manifest builders, checked on their output."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import time
from typing import Any

import pytest

from moe_contract import serve as flags
from moe_operator.api import spec as spec_
from moe_operator.plan import access, builders, storage

OWNER = builders.Owner(name="tiny", namespace="ml", uid="1234")


def make_spec(**overrides: Any) -> spec_.MoEDeploymentSpec:
    raw: dict[str, Any] = {
        "model": {"source": "synthetic://tiny?seed=0"},
        "dataParallelSize": 2,
        "minDataParallelSize": 1,
        "maxDataParallelSize": 4,
    }
    raw.update(overrides)
    return spec_.MoEDeploymentSpec.model_validate(raw)


def worker_group(obj: dict[str, Any]) -> dict[str, Any]:
    (group,) = obj["spec"]["workerGroupSpecs"]
    return dict(group)


def head_container(obj: dict[str, Any]) -> dict[str, Any]:
    (container,) = obj["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return dict(container)


def test_every_child_is_owned_and_labelled() -> None:
    objs = [
        builders.build_raycluster(owner=OWNER, spec=make_spec()),
        access.build_service(owner=OWNER),
        access.build_secret(owner=OWNER, token="s3cret", ray_token="r4y"),
        access.build_network_policy(owner=OWNER),
    ]
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "elasticmoe.io/v1alpha1",
                "kind": "MoEDeployment",
                "name": "tiny",
                "uid": "1234",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["elasticmoe.io/deployment"] == "tiny"


def test_worker_group_follows_the_sizes() -> None:
    group = worker_group(builders.build_raycluster(owner=OWNER, spec=make_spec()))
    assert group["groupName"] == "ranks"
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 4)


def test_worker_replicas_override() -> None:
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec(), worker_replicas=3)
    assert worker_group(obj)["replicas"] == 3


def test_each_worker_offers_one_rank_resource() -> None:
    params = worker_group(builders.build_raycluster(owner=OWNER, spec=make_spec()))[
        "rayStartParams"
    ]
    # KubeRay passes the value verbatim to `ray start --resources=...`: a quoted JSON object.
    assert json.loads(json.loads(params["resources"])) == {"moe_rank": 1}


def test_head_runs_the_runtime() -> None:
    container = head_container(
        builders.build_raycluster(
            owner=OWNER,
            spec=make_spec(
                model={"source": "/models/mixtral", "servedModelName": "m", "dtype": "bfloat16"}
            ),
        )
    )
    command = container["args"][0].split("exec ", 1)[1]
    assert shlex.split(command) == [
        "moe-runtime", "serve", "--model", "/models/mixtral", "--data-parallel-size", "2",
        "--served-model-name", "m", "--host", "0.0.0.0", "--port", "8000",
        "--min-data-parallel-size", "1", "--max-data-parallel-size", "4",
        "--num-redundant-experts", "0", "--eplb", "--eplb-window-size", "1000",
        "--eplb-step-interval", "3000", "--device", "cpu", "--dtype", "bfloat16",
        "--drain-timeout", "120", "--max-queued-requests", "1024",
        "--admin-token-file", "/var/run/elastic-moe/admin/token", "--no-auto-recover",
    ]  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    # KubeRay sets RAY_ADDRESS=127.0.0.1:6379 on the head when the template has none.
    assert "RAY_ADDRESS" not in env
    # the admin token is a file only the head mounts, not an env var its processes inherit
    assert "MOE_ADMIN_TOKEN" not in env
    assert {"name": "admin-token", "mountPath": "/var/run/elastic-moe/admin",
            "readOnly": True} in container["volumeMounts"]  # fmt: skip
    assert env["MOE_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # `bash -c`: a login shell (-l) resets PATH on Debian-based images and loses the venv.
    assert container["command"] == ["/bin/bash", "-c", "--"]


@pytest.mark.parametrize(("load_timeout", "failures"), [(1800, 900), (45, 23)])
def test_head_probes_allow_model_loading_then_watch_readiness(
    load_timeout: int, failures: int
) -> None:
    spec = make_spec(model={"source": "/m", "loadTimeoutSeconds": load_timeout})
    container = head_container(builders.build_raycluster(owner=OWNER, spec=spec))
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": 8000}
    # the head may fail its startup probe for the whole load timeout, never longer
    assert startup["periodSeconds"] * startup["failureThreshold"] >= load_timeout
    assert startup["periodSeconds"] * (startup["failureThreshold"] - 1) < load_timeout
    assert startup["failureThreshold"] == failures
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8000}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert "initialDelaySeconds" not in container["livenessProbe"]


@pytest.mark.parametrize(("accelerator", "device"), [("cpu", "cpu"), ("nvidia.com/gpu", "cuda")])
def test_the_runtime_is_told_its_device(accelerator: str, device: str) -> None:
    spec = make_spec(ray={"accelerator": accelerator})
    args = head_container(builders.build_raycluster(owner=OWNER, spec=spec))["args"][0]
    command = shlex.split(args.split("exec ", 1)[1])
    assert command[command.index("--device") + 1] == device


@pytest.mark.parametrize(
    ("accelerator", "model", "dtype"),
    [
        pytest.param("nvidia.com/gpu", {"source": "synthetic://tiny?seed=0"}, "bfloat16",
                     id="gpu-synthetic-bf16"),
        pytest.param("nvidia.com/gpu", {"source": "/models/mixtral"}, "auto",
                     id="gpu-checkpoint-its-own-dtype"),
        pytest.param("cpu", {"source": "synthetic://tiny?seed=0"}, "auto", id="cpu-auto"),
        pytest.param("nvidia.com/gpu", {"source": "/m", "dtype": "float16"}, "float16",
                     id="gpu-override"),
        pytest.param("cpu", {"source": "synthetic://t", "dtype": "bfloat16"}, "bfloat16",
                     id="cpu-override"),
    ],
)  # fmt: skip
def test_the_runtime_is_told_its_dtype(accelerator: str, model: dict[str, str], dtype: str) -> None:
    """bfloat16 on nvidia.com/gpu workers unless the spec says otherwise; a checkpoint's own
    dtype is the runtime's to read (`auto`); spec.model.dtype wins."""
    spec = make_spec(ray={"accelerator": accelerator}, model=model)
    args = head_container(builders.build_raycluster(owner=OWNER, spec=spec))["args"][0]
    command = shlex.split(args.split("exec ", 1)[1])
    assert command[command.index("--dtype") + 1] == dtype


def test_extra_env_and_shared_memory_reach_head_and_workers() -> None:
    spec = make_spec(
        ray={"env": [{"name": "MOE_STEP_MODE", "value": "remote"}], "sharedMemorySize": "2Gi"}
    )
    obj = builders.build_raycluster(owner=OWNER, spec=spec)
    for pod in (obj["spec"]["headGroupSpec"]["template"], worker_group(obj)["template"]):
        container = pod["spec"]["containers"][0]
        assert {"name": "MOE_STEP_MODE", "value": "remote"} in container["env"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod[
            "spec"
        ]["volumes"]


def test_served_model_name_defaults_to_the_deployment_name() -> None:
    command = head_container(builders.build_raycluster(owner=OWNER, spec=make_spec()))["args"][0]
    assert "--served-model-name tiny" in command


@pytest.mark.parametrize(
    ("accelerator", "tp", "gpus"),
    [("cpu", 1, None), ("cpu", 2, None), ("nvidia.com/gpu", 1, 1), ("nvidia.com/gpu", 2, 2),
     ("nvidia.com/gpu", 8, 8)],
    ids=["cpu", "cpu-tp2", "gpu", "gpu-tp2", "gpu-tp8"],
)  # fmt: skip
def test_gpus_per_worker_follow_tensor_parallel_size(
    accelerator: str, tp: int, gpus: int | None
) -> None:
    spec = make_spec(tensorParallelSize=tp, ray={"accelerator": accelerator})
    group = worker_group(builders.build_raycluster(owner=OWNER, spec=spec))
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources.get("limits", {}).get("nvidia.com/gpu") == gpus
    assert resources.get("requests", {}).get("nvidia.com/gpu") == gpus
    assert group["rayStartParams"].get("num-gpus") == (str(gpus) if gpus else None)


def test_a_tp2_rank_is_one_worker_pod_holding_both_devices() -> None:
    """One worker pod per DP rank: at T = 2 the pod offers two rank slots (one per rank actor
    of the rank's placement group) and two GPUs; the user's CPU and memory stay as given;
    as many workers as ranks."""
    spec = make_spec(
        tensorParallelSize=2,
        ray={
            "accelerator": "nvidia.com/gpu",
            "workerResources": {"requests": {"cpu": "4", "memory": "8Gi"}},
        },
    )
    obj = builders.build_raycluster(owner=OWNER, spec=spec)
    group = worker_group(obj)
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 4)
    params = group["rayStartParams"]
    assert json.loads(json.loads(params["resources"])) == {"moe_rank": 2}
    assert params["num-gpus"] == "2" and "num-cpus" not in params
    assert group["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": 2},
        "limits": {"nvidia.com/gpu": 2},
    }
    head = obj["spec"]["headGroupSpec"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"].get(
        "limits", {}
    )
    assert head["template"]["metadata"]["annotations"]["elasticmoe.io/tensor-parallel-size"] == "2"
    argv = shlex.split(head_container(obj)["args"][0].split("&& exec ", 1)[1])
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--pipeline-parallel-size" not in argv


def test_a_tp1_head_keeps_its_template_as_before() -> None:
    """At 1 x 1 the head says neither size (annotations, flags): the template of a RayCluster
    made before TP existed is what this operator builds, so nothing changes under it."""
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec())
    annotations = obj["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert set(annotations) == {
        "ray.io/overwrite-container-cmd",
        "elasticmoe.io/initial-data-parallel-size",
    }
    assert "parallel-size" not in head_container(obj)["args"][0].replace("data-parallel-size", "")


def test_ray_placement_and_resources_come_from_the_spec() -> None:
    spec = make_spec(
        ray={
            "image": "registry.local/moe:1",
            "workerResources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": 4}},
            "nodeSelector": {"pool": "moe"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )
    obj = builders.build_raycluster(owner=OWNER, spec=spec)
    pod = worker_group(obj)["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "moe"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["containers"][0]["image"] == "registry.local/moe:1"
    assert pod["containers"][0]["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"cpu": 4},
    }
    assert obj["spec"]["headGroupSpec"]["template"]["spec"]["nodeSelector"] == {"pool": "moe"}


def test_ray_pods_meet_pod_security_restricted() -> None:
    """What the `restricted` profile checks (KubeRay copies the Ray container's security
    context into the `wait-gcs-ready` init container it injects)."""
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec())
    pods = [obj["spec"]["headGroupSpec"]["template"], worker_group(obj)["template"]]
    for pod in pods:
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        container = pod["spec"]["containers"][0]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "hostNetwork" not in pod["spec"] and "hostPath" not in str(pod)


def test_workers_to_delete_is_always_written() -> None:
    """An empty list is written explicitly: KubeRay never clears it, the operator does."""
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec())
    assert worker_group(obj)["scaleStrategy"] == {"workersToDelete": []}
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec(), workers_to_delete=["b", "a"])
    assert worker_group(obj)["scaleStrategy"] == {"workersToDelete": ["a", "b"]}


def test_service_selects_the_head_on_port_8000() -> None:
    svc = access.build_service(owner=OWNER)
    assert svc["metadata"]["name"] == "tiny-api"
    assert svc["spec"]["selector"] == {
        "elasticmoe.io/deployment": "tiny",
        "elasticmoe.io/component": "head",
        "ray.io/cluster": "tiny",  # the serving RayCluster's head (a rollout moves it)
    }
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    head = builders.build_raycluster(owner=OWNER, spec=make_spec())["spec"]["headGroupSpec"]
    # KubeRay adds ray.io/cluster (the RayCluster's name) to every pod it makes
    pod_labels = {**head["template"]["metadata"]["labels"], "ray.io/cluster": "tiny"}
    assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_secret_holds_the_tokens() -> None:
    secret = access.build_secret(owner=OWNER, token="s3cret", ray_token="r4y")
    assert secret["metadata"]["name"] == "tiny-admin"
    assert secret["stringData"] == {"token": "s3cret", "ray-token": "r4y"}


def test_ray_runs_with_token_authentication_from_a_file() -> None:
    """Every Ray container (KubeRay copies env and mounts into its wait-gcs-ready init
    container) authenticates with the deployment's own token; the file holds only that one."""
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec())
    for pod in (obj["spec"]["headGroupSpec"]["template"], worker_group(obj)["template"]):
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN_PATH"] == "/var/run/elastic-moe/ray-auth/token"
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "ray-auth"]
        assert volume["secret"]["items"] == [{"key": "ray-token", "path": "token"}]
        assert {"name": "ray-auth", "mountPath": "/var/run/elastic-moe/ray-auth",
                "readOnly": True} in container["volumeMounts"]  # fmt: skip


def test_network_policy_keeps_ray_ports_inside_the_deployments_rayclusters() -> None:
    policy = access.build_network_policy(owner=OWNER)
    spec = policy["spec"]
    ray_pods = {
        "matchLabels": {"elasticmoe.io/deployment": "tiny"},
        "matchExpressions": [{"key": "ray.io/cluster", "operator": "Exists"}],
    }
    assert spec["podSelector"] == ray_pods
    assert spec["policyTypes"] == ["Ingress"]
    same_cluster, api = spec["ingress"]
    assert same_cluster == {"from": [{"podSelector": ray_pods}]}
    assert api == {"ports": [{"protocol": "TCP", "port": 8000}]}  # the runtime API, from anywhere


def test_secret_refuses_an_empty_token() -> None:
    with pytest.raises(ValueError, match="token"):
        access.build_secret(owner=OWNER, token="", ray_token="r4y")


def test_names_and_endpoint() -> None:
    assert builders.selector("tiny") == "elasticmoe.io/deployment=tiny"
    assert builders.endpoint(owner_name="tiny", namespace="ml") == "http://tiny-api.ml.svc:8000"


def test_head_starts_ray_without_blocking_then_the_runtime() -> None:
    """KubeRay's generated `ray start` always carries --block; the head must drop it so the
    runtime can start after Ray."""
    args = head_container(builders.build_raycluster(owner=OWNER, spec=make_spec()))["args"][0]
    start, runtime = args.split(" && exec ", 1)
    assert runtime.startswith("moe-runtime serve ")
    fake = 'echo ray start --head  --block  --resources="{\\"moe_rank\\": 1}" '
    done = subprocess.run(
        ["bash", "-c", f"{start} && echo runtime"],
        env={"PATH": os.environ["PATH"], builders.RAY_START_ENV: fake},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines() == ['ray start --head --resources={"moe_rank": 1}', "runtime"]


def test_a_deleted_worker_stops_its_ray_node_first() -> None:
    """KubeRay's bash (PID 1) ignores SIGTERM: without the hook a deleted worker's rank would
    live on for the whole grace period before the runtime can recover around it."""
    container = worker_group(builders.build_raycluster(owner=OWNER, spec=make_spec()))["template"][
        "spec"
    ]["containers"][0]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/bash", "-c"] and "ray stop --force" in command[2]


def test_the_head_gets_the_runtimes_shutdown_timeout_and_time_to_stop_its_ranks() -> None:
    """The runtime's stop signal waits up to `--shutdown-timeout` for the requests in flight,
    then stops its ranks: the head pod's grace period covers both (the kubelet's default
    30 s would kill it mid-shutdown), and the head runs with the runtime's default."""
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec())
    pod = obj["spec"]["headGroupSpec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= flags.DEFAULT_SHUTDOWN_TIMEOUT_S + 20
    assert flags.SHUTDOWN_TIMEOUT not in " ".join(pod["containers"][0]["args"])


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="runs the head command as PID 1 of a PID namespace of its own (root, unshare)",
)
def test_a_head_stopped_while_ray_starts_ends_when_ray_start_returns() -> None:
    """The head command runs as PID 1 of its container until it execs the runtime, and the
    kernel drops a signal PID 1 has no handler for: without the trap a pod deleted during
    `ray start` waited out its grace period. Here the command runs as PID 1 of a PID
    namespace of its own with a `ray start` that takes 1.5 s; a SIGTERM after 0.5 s ends it
    with 143 once `ray start` returns, and the runtime is never started."""
    args = head_container(builders.build_raycluster(owner=OWNER, spec=make_spec()))["args"][0]
    start, runtime = args.split(" && exec ", 1)
    assert runtime.startswith("moe-runtime serve ")
    env = {"PATH": os.environ["PATH"], builders.RAY_START_ENV: "sleep 1.5 --block"}
    with subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "bash", "-c", f"{start} && echo runtime"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        deadline = time.monotonic() + 10
        pid1 = None
        while pid1 is None and time.monotonic() < deadline:  # unshare's child: the PID 1
            children = pathlib.Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            pid1 = next((int(c) for c in children.read_text().split()), None)
        assert pid1 is not None
        time.sleep(0.5)  # inside `ray start`
        os.kill(pid1, signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    assert "runtime" not in out
    assert proc.returncode == 143


def test_the_users_env_overrides_ray_settings() -> None:
    spec = make_spec(ray={"env": [{"name": "RAY_kill_worker_timeout_milliseconds", "value": "1"}]})
    obj = builders.build_raycluster(owner=OWNER, spec=spec)
    env = worker_group(obj)["template"]["spec"]["containers"][0]["env"]
    values = [e["value"] for e in env if e["name"] == "RAY_kill_worker_timeout_milliseconds"]
    assert values == ["1"]  # the user's wins, one entry per name
    default = builders.build_raycluster(owner=OWNER, spec=make_spec())
    env = worker_group(default)["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RAY_kill_worker_timeout_milliseconds", "value": "200"} in env


#: KubeRay's injected readiness probe first runs after this many seconds.
KUBERAY_FIRST_READINESS_CHECK_S = 10


def test_a_worker_is_ready_when_its_raylet_answers_not_after_kuberays_delay() -> None:
    """KubeRay injects its probes (a first readiness check after 10 s) only into containers
    that have none: ours check the raylet's health endpoint from the first second on."""
    container = worker_group(builders.build_raycluster(owner=OWNER, spec=make_spec()))["template"][
        "spec"
    ]["containers"][0]
    ready, live = container["readinessProbe"], container["livenessProbe"]
    for probe in (ready, live):
        assert probe["httpGet"] == {"path": "/api/local_raylet_healthz", "port": 52365}
    # the first readiness check comes before KubeRay's injected one would (a setting compared
    # with KubeRay's, not a measured time)
    first_check = ready["initialDelaySeconds"] + ready["periodSeconds"]
    assert first_check < KUBERAY_FIRST_READINESS_CHECK_S
    assert live["initialDelaySeconds"] >= 30  # a slow start is not a dead raylet


def _pods(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [obj["spec"]["headGroupSpec"]["template"], worker_group(obj)["template"]]


def test_a_pvc_source_is_mounted_read_only_at_one_path_in_every_ray_pod() -> None:
    spec = make_spec(model={"source": "pvc://models/mixtral/tiny"}, elastic={"warmSpareRanks": 1})
    obj = builders.build_raycluster(owner=OWNER, spec=spec)
    for pod in _pods(obj):  # the head, and every worker (warm spares are workers too)
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == storage.VOLUME]
        assert volume == {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
        }
        (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models/models", "readOnly": True}
    # the runtime is given the checkpoint's directory inside the pod, not the URI
    command = shlex.split(head_container(obj)["args"][0].split("&& exec ", 1)[1])
    assert command[command.index("--model") + 1] == "/models/models/mixtral/tiny"


def test_the_root_of_a_claim_is_a_checkpoint_directory_too() -> None:
    spec = make_spec(model={"source": "pvc://hf-cache"})
    assert storage.model_path(spec) == "/models/hf-cache"


@pytest.mark.parametrize("source", ["synthetic://tiny?seed=0", "/opt/models/tiny"])
def test_other_sources_mount_nothing_and_pass_through(source: str) -> None:
    spec = make_spec(model={"source": source})
    obj = builders.build_raycluster(owner=OWNER, spec=spec)
    for pod in _pods(obj):
        assert all("persistentVolumeClaim" not in v for v in pod["spec"]["volumes"])
    assert storage.model_path(spec) == source


def test_a_pvc_mount_keeps_the_pods_pod_security_restricted() -> None:
    """`restricted` allows persistentVolumeClaim volumes; nothing else changes."""
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec(model={"source": "pvc://m/d"}))
    allowed = {"emptyDir", "secret", "persistentVolumeClaim", "configMap", "projected"}
    for pod in _pods(obj):
        for volume in pod["spec"]["volumes"]:
            assert set(volume) - {"name"} <= allowed, volume
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_ray_containers_report_why_they_failed() -> None:
    obj = builders.build_raycluster(owner=OWNER, spec=make_spec())
    for pod in _pods(obj):
        container = pod["spec"]["containers"][0]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert "terminationMessagePath" not in container  # the default: /dev/termination-log
