"""Builders of the children of a MoEDeployment: data in, manifests (plain dicts) out.

Like KubeRay's ``BuildServiceForHeadPod(cluster)``, each builder takes the owner and its spec and
returns one object, with no client inside; they are unit-tested on their output. Every child
carries an owner reference to the MoEDeployment and the ``elasticmoe.io/deployment`` label.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from typing import Any, Final

from moe_operator.api import group
from moe_operator.api import spec as spec_

RUNTIME_PORT: Final = 8000
HEAD_CONTAINER: Final = "ray-head"
WORKER_CONTAINER: Final = "ray-worker"
WORKER_GROUP: Final = "ranks"
#: Custom Ray resource each worker pod offers once: one DP rank actor per worker.
RANK_RESOURCE: Final = "moe_rank"
SECRET_TOKEN_KEY: Final = "token"
RUN_AS_USER: Final = 1000
#: KubeRay annotation: run our command after KubeRay's generated ``ray start`` (head only).
OVERWRITE_CMD_ANNOTATION: Final = "ray.io/overwrite-container-cmd"
#: Environment variable in which KubeRay passes its generated ``ray start`` command.
RAY_START_ENV: Final = "KUBERAY_GEN_RAY_START_CMD"

COMPONENT_RAY: Final = "ray"
COMPONENT_HEAD: Final = "head"
COMPONENT_WORKER: Final = "worker"
COMPONENT_API: Final = "api"
COMPONENT_ADMIN: Final = "admin"


@dataclasses.dataclass(frozen=True)
class Owner:
    """Identity of the MoEDeployment that owns the children."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": group.API_VERSION,
            "kind": group.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def raycluster_name(owner_name: str) -> str:
    return owner_name


def service_name(owner_name: str) -> str:
    return f"{owner_name}-api"


def secret_name(owner_name: str) -> str:
    return f"{owner_name}-admin"


def selector(owner_name: str) -> str:
    """``status.selector``: the label selector of everything the deployment runs."""
    return f"{group.LABEL_DEPLOYMENT}={owner_name}"


def endpoint(*, owner_name: str, namespace: str) -> str:
    """The in-cluster URL of the OpenAI-compatible and admin API."""
    return f"http://{service_name(owner_name)}.{namespace}.svc:{RUNTIME_PORT}"


def labels(owner_name: str, component: str) -> dict[str, str]:
    return {
        group.LABEL_DEPLOYMENT: owner_name,
        group.LABEL_COMPONENT: component,
        group.LABEL_MANAGED_BY: group.MANAGED_BY,
    }


def _metadata(*, owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, component),
        "ownerReferences": [owner.reference()],
    }


def served_model_name(*, owner_name: str, spec: spec_.MoEDeploymentSpec) -> str:
    return spec.model.served_model_name or owner_name


def serve_command(
    *, owner_name: str, spec: spec_.MoEDeploymentSpec, size: int | None = None
) -> list[str]:
    """The runtime command line the head runs (DESIGN §4); ``size``: the data-parallel size it
    starts at (default ``spec.dataParallelSize``; live resizes change it from there)."""
    experts = spec.expert_parallel
    command = [
        "moe-runtime",
        "serve",
        "--model",
        spec.model.source,
        "--data-parallel-size",
        str(spec.data_parallel_size if size is None else size),
        "--served-model-name",
        served_model_name(owner_name=owner_name, spec=spec),
        "--host",
        "0.0.0.0",  # inside the pod; the Service is the way in
        "--port",
        str(RUNTIME_PORT),
        "--min-data-parallel-size",
        str(spec.min_data_parallel_size),
        "--max-data-parallel-size",
        str(spec.max_data_parallel_size),
        "--num-redundant-experts",
        str(experts.num_redundant_experts),
        "--eplb" if experts.eplb.enabled else "--no-eplb",
        "--eplb-window-size",
        str(experts.eplb.window_size),
        "--eplb-step-interval",
        str(experts.eplb.step_interval),
    ]
    if experts.max_experts_per_rank is not None:
        command += ["--max-experts-per-rank", str(experts.max_experts_per_rank)]
    return command


def _resources(requirements: spec_.ResourceRequirements | None, *, gpus: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = requirements.to_wire() if requirements is not None else {}
    if gpus:
        for key in ("requests", "limits"):
            out.setdefault(key, {})[spec_.ACCELERATOR_NVIDIA_GPU] = gpus
    return out


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_placement(spec: spec_.MoEDeploymentSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if spec.ray.node_selector:
        out["nodeSelector"] = dict(spec.ray.node_selector)
    if spec.ray.tolerations:
        out["tolerations"] = [t.to_wire() for t in spec.ray.tolerations]
    if spec.ray.service_account_name:
        out["serviceAccountName"] = spec.ray.service_account_name
    return out


def _pod_name_env() -> dict[str, Any]:
    return {"name": "MOE_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def _health_probe(*, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": RUNTIME_PORT},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _head_template(
    *, owner: Owner, spec: spec_.MoEDeploymentSpec, size: int | None = None
) -> dict[str, Any]:
    size = spec.data_parallel_size if size is None else size
    serve = shlex.join(serve_command(owner_name=owner.name, spec=spec, size=size))
    container = {
        "name": HEAD_CONTAINER,
        "image": spec.ray.image,
        "imagePullPolicy": spec.ray.image_pull_policy,
        # With the overwrite annotation KubeRay leaves our command alone and hands us its
        # generated `ray start --head ... --block` in $KUBERAY_GEN_RAY_START_CMD. Without
        # --block it returns once Ray is up; the runtime then becomes the container's main
        # process and joins that Ray instance (RAY_ADDRESS=auto).
        "command": ["/bin/bash", "-lc", "--"],
        "args": [f'ulimit -n 65536; eval "${{{RAY_START_ENV}/--block/}}" && exec {serve}'],
        "ports": [
            {"name": "gcs", "containerPort": 6379},
            {"name": "dashboard", "containerPort": 8265},
            {"name": "client", "containerPort": 10001},
            {"name": "http", "containerPort": RUNTIME_PORT},
        ],
        "env": [
            {"name": "RAY_ADDRESS", "value": "auto"},
            {
                "name": "MOE_ADMIN_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {"name": secret_name(owner.name), "key": SECRET_TOKEN_KEY}
                },
            },
            _pod_name_env(),
        ],
        "readinessProbe": _health_probe(period=5, failures=3),
        "livenessProbe": {**_health_probe(period=10, failures=6), "initialDelaySeconds": 30},
        "resources": _resources(spec.ray.head_resources),
        "securityContext": _container_security(),
    }
    return {
        "metadata": {
            "labels": labels(owner.name, COMPONENT_HEAD),
            "annotations": {
                OVERWRITE_CMD_ANNOTATION: "true",
                group.ANNOTATION_HEAD_SIZE: str(size),
            },
        },
        "spec": {
            "securityContext": _pod_security(),
            **_pod_placement(spec),
            "containers": [container],
        },
    }


def _worker_template(*, owner: Owner, spec: spec_.MoEDeploymentSpec) -> dict[str, Any]:
    gpus = spec.tensor_parallel_size if spec.wants_gpus else 0
    container = {
        "name": WORKER_CONTAINER,
        "image": spec.ray.image,
        "imagePullPolicy": spec.ray.image_pull_policy,
        "env": [_pod_name_env()],
        "resources": _resources(spec.ray.worker_resources, gpus=gpus),
        "securityContext": _container_security(),
    }
    return {
        "metadata": {"labels": labels(owner.name, COMPONENT_WORKER)},
        "spec": {
            "securityContext": _pod_security(),
            **_pod_placement(spec),
            "containers": [container],
        },
    }


def rank_resources_param() -> str:
    """``rayStartParams.resources``: KubeRay passes it verbatim to ``ray start --resources``."""
    return json.dumps(json.dumps({RANK_RESOURCE: 1}))


def build_raycluster(
    *,
    owner: Owner,
    spec: spec_.MoEDeploymentSpec,
    worker_replicas: int | None = None,
    workers_to_delete: Sequence[str] = (),
    head_size: int | None = None,
) -> dict[str, Any]:
    """The ``ray.io/v1`` RayCluster: a head running the runtime and one worker per DP rank.

    ``worker_replicas`` overrides ``spec.dataParallelSize`` (a resize provisions workers before
    the runtime uses them, and releases them after); ``workers_to_delete`` names the pods a
    shrink removes (``scaleStrategy.workersToDelete``: KubeRay deletes random ones otherwise);
    ``head_size`` is the size the head's runtime starts at (default ``spec.dataParallelSize``;
    it stays what the RayCluster was created with, so a resize never rewrites the head).
    """
    replicas = spec.data_parallel_size if worker_replicas is None else worker_replicas
    worker_params = {"resources": rank_resources_param()}
    if spec.wants_gpus:
        worker_params["num-gpus"] = str(spec.tensor_parallel_size)
    worker_group: dict[str, Any] = {
        "groupName": WORKER_GROUP,
        "replicas": replicas,
        "minReplicas": spec.min_data_parallel_size,
        "maxReplicas": spec.max_data_parallel_size,
        "rayStartParams": worker_params,
        "template": _worker_template(owner=owner, spec=spec),
    }
    if workers_to_delete:
        worker_group["scaleStrategy"] = {"workersToDelete": sorted(workers_to_delete)}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _metadata(
            owner=owner, name=raycluster_name(owner.name), component=COMPONENT_RAY
        ),
        "spec": {
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                "template": _head_template(owner=owner, spec=spec, size=head_size),
            },
            "workerGroupSpecs": [worker_group],
        },
    }


def build_service(*, owner: Owner) -> dict[str, Any]:
    """The ClusterIP Service in front of the head's runtime API (port 8000)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner=owner, name=service_name(owner.name), component=COMPONENT_API),
        "spec": {
            "type": "ClusterIP",
            "selector": {
                group.LABEL_DEPLOYMENT: owner.name,
                group.LABEL_COMPONENT: COMPONENT_HEAD,
            },
            "ports": [
                {"name": "http", "port": RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_secret(*, owner: Owner, token: str) -> dict[str, Any]:
    """The Secret holding the runtime's admin token (created once, never rotated)."""
    if not token:
        raise ValueError("token must not be empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(owner=owner, name=secret_name(owner.name), component=COMPONENT_ADMIN),
        "stringData": {SECRET_TOKEN_KEY: token},
    }
