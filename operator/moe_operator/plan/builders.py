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

from moe_contract import names
from moe_contract import serve as flags
from moe_operator.api import group
from moe_operator.api import spec as spec_
from moe_operator.plan import probes, storage
from moe_operator.plan import revision as revision_

HEAD_CONTAINER: Final = "ray-head"
WORKER_CONTAINER: Final = "ray-worker"
WORKER_GROUP: Final = "ranks"
SECRET_TOKEN_KEY: Final = "token"
#: The Ray cluster's own token (Ray's token authentication, RAY_AUTH_MODE=token).
SECRET_RAY_TOKEN_KEY: Final = "ray-token"
RAY_TOKEN_VOLUME: Final = "ray-auth"
ADMIN_TOKEN_VOLUME: Final = "admin-token"
ADMIN_TOKEN_DIR: Final = "/var/run/elastic-moe/admin"
RAY_TOKEN_DIR: Final = "/var/run/elastic-moe/ray-auth"
RUN_AS_USER: Final = 1000
#: The runtime image's user ``ray`` (uid 1000, gid 100 ``users``), as in rayproject/ray.
RUN_AS_GROUP: Final = 100
SHM_VOLUME: Final = "dshm"
#: Seconds a worker pod gets to stop: its rank was released (or lost) before the pod is
#: deleted, and KubeRay creates no new worker while a deleted one still terminates.
WORKER_GRACE_SECONDS: Final = 10
#: The head command's first statement: a stop signal that arrives before the runtime runs
#: (KubeRay's ``ray start``) ends the shell, with the signal's status, once ``ray start``
#: returns (bash runs a trap after its foreground command).
HEAD_STOP_TRAP: Final = "trap 'exit 143' TERM; trap 'exit 130' INT"
#: Seconds the head pod gets to stop: the runtime's ``--shutdown-timeout`` (its default: the
#: requests in flight finish or are ended, new connections refused at once), then the time
#: it takes to stop its ranks. Past it the kubelet kills the runtime mid-shutdown.
HEAD_GRACE_SECONDS: Final = flags.DEFAULT_SHUTDOWN_TIMEOUT_S + 25
#: KubeRay annotation: run our command after KubeRay's generated ``ray start`` (head only).
OVERWRITE_CMD_ANNOTATION: Final = "ray.io/overwrite-container-cmd"
#: Environment variable in which KubeRay passes its generated ``ray start`` command.
RAY_START_ENV: Final = "KUBERAY_GEN_RAY_START_CMD"
#: A container that fails says why in its status (``kubectl describe pod``, and the operator
#: reads it): the runtime writes its reason to /dev/termination-log, and the log's last lines
#: stand in when it could not (``ray start`` failed, a kill).
TERMINATION_MESSAGE_POLICY: Final = "FallbackToLogsOnError"

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


def raycluster_name(owner_name: str, revision: str | None = None) -> str:
    """The RayCluster of a deployment: its own name for the first one, the name and the
    template revision for each one a rollout starts (``plan.rollout``)."""
    return owner_name if revision is None else f"{owner_name}-{revision}"


def service_name(owner_name: str) -> str:
    return f"{owner_name}-api"


def secret_name(owner_name: str) -> str:
    return f"{owner_name}-admin"


def selector(owner_name: str) -> str:
    """``status.selector``: the label selector of everything the deployment runs."""
    return f"{group.LABEL_DEPLOYMENT}={owner_name}"


def endpoint(*, owner_name: str, namespace: str) -> str:
    """The in-cluster URL of the OpenAI-compatible and admin API."""
    return f"http://{service_name(owner_name)}.{namespace}.svc:{names.RUNTIME_PORT}"


def labels(owner_name: str, component: str) -> dict[str, str]:
    return {
        group.LABEL_DEPLOYMENT: owner_name,
        group.LABEL_COMPONENT: component,
        group.LABEL_MANAGED_BY: group.MANAGED_BY,
    }


def metadata(*, owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, component),
        "ownerReferences": [owner.reference()],
    }


def served_model_name(*, owner_name: str, spec: spec_.MoEDeploymentSpec) -> str:
    return spec.model.served_model_name or owner_name


def serve_args(
    *, owner_name: str, spec: spec_.MoEDeploymentSpec, size: int | None = None
) -> flags.ServeArgs:
    """What the head's runtime is told (docs/RUNTIME.md; the flags are ``moe_contract.serve``'s);
    ``size``: the data-parallel size it starts at (default ``spec.dataParallelSize``; live
    resizes change it from there)."""
    experts = spec.expert_parallel
    return flags.ServeArgs(
        model=storage.model_path(spec),  # a pvc:// source: the claim's directory in the pod
        data_parallel_size=spec.data_parallel_size if size is None else size,
        served_model_name=served_model_name(owner_name=owner_name, spec=spec),
        host="0.0.0.0",  # inside the pod; the Service is the way in
        port=names.RUNTIME_PORT,
        min_data_parallel_size=spec.min_data_parallel_size,
        max_data_parallel_size=spec.max_data_parallel_size,
        num_redundant_experts=experts.num_redundant_experts,
        eplb=experts.eplb.enabled,
        eplb_window_size=experts.eplb.window_size,
        eplb_step_interval=experts.eplb.step_interval,
        max_experts_per_rank=experts.max_experts_per_rank,
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
        pipeline_micro_batch_tokens=spec.pipeline_micro_batch_tokens,
        pipeline_interleave=spec.pipeline_interleave,
        expert_layout=spec.expert_layout,
        # Said, not guessed: at start the head may not see the GPU workers yet.
        device=flags.DEVICE_CUDA if spec.wants_gpus else flags.DEVICE_CPU,
        dtype=serve_dtype(spec),
        drain_timeout=spec.elastic.drain_timeout_seconds,
        max_queued_requests=spec.max_queued_requests,
        # a file, not an environment variable every process of the head would inherit
        admin_token_file=f"{ADMIN_TOKEN_DIR}/token",
        warm_spare_ranks=spec.elastic.warm_spare_ranks,
        # The operator owns the grow back after a lost rank (spec.faultTolerance.autoRecover,
        # read live): the runtime only shrinks around a loss and waits to be asked.
        auto_recover=False,
    )


def serve_dtype(spec: spec_.MoEDeploymentSpec) -> str:
    """``--dtype``: spec.model.dtype when it names one; for ``auto``, bfloat16 when the workers
    get GPUs and the model is synthetic (nothing to read a dtype from), else ``auto`` (the
    runtime takes the checkpoint's dtype, which the operator cannot read: it lives on the
    workers' volume; without one, bfloat16 on GPUs and float32 on CPUs)."""
    if spec.model.dtype != flags.DTYPE_AUTO:
        return spec.model.dtype
    if spec.wants_gpus and spec.model.source.startswith(names.SYNTHETIC_SCHEME):
        return flags.DTYPE_BFLOAT16
    return flags.DTYPE_AUTO


def serve_command(
    *, owner_name: str, spec: spec_.MoEDeploymentSpec, size: int | None = None
) -> list[str]:
    """The runtime command line the head runs: :func:`serve_args` rendered."""
    return serve_args(owner_name=owner_name, spec=spec, size=size).argv()


def _resources(requirements: spec_.ResourceRequirements | None, *, gpus: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = requirements.to_wire() if requirements is not None else {}
    if gpus:
        for key in ("requests", "limits"):
            out.setdefault(key, {})[spec_.ACCELERATOR_NVIDIA_GPU] = gpus
    return out


def _pod_security() -> dict[str, Any]:
    """Pod Security ``restricted``: non-root, the runtime's default seccomp profile (KubeRay's
    injected ``wait-gcs-ready`` init container copies the Ray container's settings)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_GROUP,
        "fsGroup": RUN_AS_GROUP,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


#: Ray settings of every Ray container: a fenced (hung) rank is SIGKILLed 0.2 s after Ray's
#: SIGTERM instead of 5 s (a stopped process cannot exit by itself; the contract's figure).
RAY_ENV: Final = (
    {"name": names.RAY_KILL_WORKER_TIMEOUT_ENV, "value": str(names.RAY_KILL_WORKER_TIMEOUT_MS)},
)


#: Ray's token authentication (Ray 2.60): every GCS/raylet/worker connection, the
#: ``ray health-check`` of KubeRay's init container included, carries the deployment's own
#: token, read from a file only the Ray containers mount.
RAY_AUTH_ENV: Final = (
    {"name": "RAY_AUTH_MODE", "value": "token"},
    {"name": "RAY_AUTH_TOKEN_PATH", "value": f"{RAY_TOKEN_DIR}/token"},
)


def _env(spec: spec_.MoEDeploymentSpec) -> list[dict[str, Any]]:
    """Ray's settings and the user's ``spec.ray.env``; a name the user sets wins (one entry
    per name: server-side apply keys the list by name)."""
    user = [e.to_wire() for e in spec.ray.env or ()]
    names = {e["name"] for e in user}
    ours = [*RAY_ENV, *RAY_AUTH_ENV]
    return [dict(e) for e in ours if e["name"] not in names] + user


def _ray_token_volume(owner: Owner) -> dict[str, Any]:
    return {
        "name": RAY_TOKEN_VOLUME,
        "secret": {
            "secretName": secret_name(owner.name),
            "items": [{"key": SECRET_RAY_TOKEN_KEY, "path": "token"}],
            "defaultMode": 0o440,
        },
    }


_RAY_TOKEN_MOUNT: Final = {"name": RAY_TOKEN_VOLUME, "mountPath": RAY_TOKEN_DIR, "readOnly": True}


def _admin_token_volume(owner: Owner) -> dict[str, Any]:
    """The admin token, for the head's runtime only (workers never mount it)."""
    return {
        "name": ADMIN_TOKEN_VOLUME,
        "secret": {
            "secretName": secret_name(owner.name),
            "items": [{"key": SECRET_TOKEN_KEY, "path": "token"}],
            "defaultMode": 0o440,
        },
    }


_ADMIN_TOKEN_MOUNT: Final = {
    "name": ADMIN_TOKEN_VOLUME,
    "mountPath": ADMIN_TOKEN_DIR,
    "readOnly": True,
}


#: A worker pod being deleted stops its Ray node first: its rank dies at once and the
#: runtime recovers around it (requests re-run on survivors) instead of after the grace
#: period (PID 1 is KubeRay's bash, which ignores SIGTERM). A rank released by a shrink is
#: gone already; stopping its node changes nothing.
WORKER_PRESTOP: Final = {
    "exec": {"command": ["/bin/bash", "-c", "ray stop --force >/dev/null 2>&1 || true"]}
}


def _shm_volume(spec: spec_.MoEDeploymentSpec) -> dict[str, Any]:
    return {
        "name": SHM_VOLUME,
        "emptyDir": {"medium": "Memory", "sizeLimit": spec.ray.shared_memory_size},
    }


_SHM_MOUNT: Final = {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


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
    return {
        "name": names.POD_NAME_ENV,
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
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
        # process and joins that Ray instance ($RAY_ADDRESS, which KubeRay sets to
        # 127.0.0.1:6379). `bash -c`, not `-l`: a login shell resets PATH on Debian images.
        # `ulimit` needs CAP_SYS_RESOURCE, which restricted pods lack: best effort.
        # The trap: until the exec the container's PID 1 is bash, and the kernel drops a
        # signal PID 1 has no handler for, so a pod deleted while Ray starts waited out its
        # whole grace period (measured: 46 s); with it, bash exits once `ray start` returns.
        "command": ["/bin/bash", "-c", "--"],
        "args": [
            f"{HEAD_STOP_TRAP}; ulimit -n 65536 2>/dev/null || true; "
            f'eval "${{{RAY_START_ENV}/--block/}}" && exec {serve}'
        ],
        "ports": [
            {"name": "gcs", "containerPort": 6379},
            {"name": "dashboard", "containerPort": 8265},
            {"name": "client", "containerPort": 10001},
            {"name": "http", "containerPort": names.RUNTIME_PORT},
        ],
        "env": [_pod_name_env(), *_env(spec)],
        **probes.head_probes(spec),
        "resources": _resources(spec.ray.head_resources),
        "securityContext": _container_security(),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "volumeMounts": [
            dict(_SHM_MOUNT),
            dict(_RAY_TOKEN_MOUNT),
            dict(_ADMIN_TOKEN_MOUNT),
            *storage.mounts(spec),
        ],
    }
    return {
        "metadata": {
            "labels": {
                **labels(owner.name, COMPONENT_HEAD),
                group.REVISION: revision_.revision(spec),
            },
            "annotations": {
                OVERWRITE_CMD_ANNOTATION: "true",
                group.ANNOTATION_HEAD_SIZE: str(size),
                **mesh_annotations(spec),
            },
        },
        "spec": {
            "securityContext": _pod_security(),
            **_pod_placement(spec),
            "terminationGracePeriodSeconds": HEAD_GRACE_SECONDS,
            "containers": [container],
            "volumes": [
                _shm_volume(spec),
                _ray_token_volume(owner),
                _admin_token_volume(owner),
                *storage.volumes(spec),
            ],
        },
    }


def _worker_template(*, owner: Owner, spec: spec_.MoEDeploymentSpec) -> dict[str, Any]:
    # One worker pod per DP rank: it holds the rank's T x P devices (docs/INTERNALS.md).
    gpus = spec.devices_per_rank if spec.wants_gpus else 0
    container = {
        "name": WORKER_CONTAINER,
        "image": spec.ray.image,
        "imagePullPolicy": spec.ray.image_pull_policy,
        "env": [_pod_name_env(), *_env(spec)],
        **probes.worker_probes(),
        "resources": _resources(spec.ray.worker_resources, gpus=gpus),
        "securityContext": _container_security(),
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "volumeMounts": [dict(_SHM_MOUNT), dict(_RAY_TOKEN_MOUNT), *storage.mounts(spec)],
        "lifecycle": {"preStop": WORKER_PRESTOP},
    }
    return {
        "metadata": {
            "labels": {
                **labels(owner.name, COMPONENT_WORKER),
                group.REVISION: revision_.revision(spec),
            }
        },
        "spec": {
            "securityContext": _pod_security(),
            **_pod_placement(spec),
            "terminationGracePeriodSeconds": WORKER_GRACE_SECONDS,
            "containers": [container],
            "volumes": [_shm_volume(spec), _ray_token_volume(owner), *storage.volumes(spec)],
        },
    }


def rank_resources_param(spec: spec_.MoEDeploymentSpec) -> str:
    """``rayStartParams.resources``: KubeRay passes it verbatim to ``ray start --resources``.
    A worker pod offers one rank slot per device of its DP rank (T x P): the runtime's
    placement group of a rank asks one slot per rank actor, so the rank fills the pod."""
    return json.dumps(json.dumps({names.RANK_RESOURCE: spec.devices_per_rank}))


def mesh_annotations(spec: spec_.MoEDeploymentSpec) -> dict[str, str]:
    """The head template's record of the mesh its runtime serves (``status.tensorParallelSize``
    and ``status.pipelineParallelSize`` read it from the serving RayCluster); a size of 1 is
    left out, so a RayCluster made before these existed reads as 1 x 1, as it serves."""
    out: dict[str, str] = {}
    if spec.tensor_parallel_size != 1:
        out[group.ANNOTATION_TENSOR_PARALLEL_SIZE] = str(spec.tensor_parallel_size)
    if spec.pipeline_parallel_size != 1:
        out[group.ANNOTATION_PIPELINE_PARALLEL_SIZE] = str(spec.pipeline_parallel_size)
    return out


def build_raycluster(
    *,
    owner: Owner,
    spec: spec_.MoEDeploymentSpec,
    worker_replicas: int | None = None,
    workers_to_delete: Sequence[str] = (),
    head_size: int | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """The ``ray.io/v1`` RayCluster: a head running the runtime and one worker per DP rank
    (and one per warm spare rank, ``spec.elastic.warmSpareRanks``).

    ``worker_replicas`` overrides ``spec.dataParallelSize`` (a resize provisions workers before
    the runtime uses them, and releases them after); ``workers_to_delete`` names the pods a
    shrink removes (``scaleStrategy.workersToDelete``: KubeRay deletes random ones otherwise);
    ``head_size`` is the size the head's runtime starts at (default ``spec.dataParallelSize``;
    it stays what the RayCluster was created with, so a resize never rewrites the head);
    ``name``: the RayCluster's name (default :func:`raycluster_name`). The RayCluster carries
    its template revision (``plan.revision``) as an annotation.
    """
    spares = spec.elastic.warm_spare_ranks
    replicas = spec.data_parallel_size + spares if worker_replicas is None else worker_replicas
    # num-cpus is KubeRay's, from the worker container's CPU (ray.workerResources; rank
    # actors ask for no CPU): the operator sets none of its own.
    worker_params = {"resources": rank_resources_param(spec)}
    if spec.wants_gpus:
        worker_params["num-gpus"] = str(spec.devices_per_rank)
    worker_group: dict[str, Any] = {
        "groupName": WORKER_GROUP,
        "replicas": replicas,
        "minReplicas": spec.min_data_parallel_size,
        # KubeRay clamps replicas into [minReplicas, maxReplicas]: the spares ride on top.
        "maxReplicas": spec.max_data_parallel_size + spares,
        "rayStartParams": worker_params,
        "template": _worker_template(owner=owner, spec=spec),
        # Ours to keep: KubeRay deletes the named pods but never clears the list (only its
        # autoscaler would), so the operator drops each name once its pod is gone and writes
        # an empty list explicitly.
        "scaleStrategy": {"workersToDelete": sorted(workers_to_delete)},
    }
    meta = metadata(owner=owner, name=name or raycluster_name(owner.name), component=COMPONENT_RAY)
    meta["annotations"] = {group.REVISION: revision_.revision(spec)}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": meta,
        "spec": {
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                # The dashboard stays inside the pod (KubeRay would bind 0.0.0.0); the head
                # runs no Ray tasks of its own (num-cpus 0): ranks live on the workers.
                "rayStartParams": {"dashboard-host": "127.0.0.1", "num-cpus": "0"},
                "template": _head_template(owner=owner, spec=spec, size=head_size),
            },
            "workerGroupSpecs": [worker_group],
        },
    }
