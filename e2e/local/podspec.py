"""Pure functions on RayCluster and pod specs for the local KubeRay stand-in: resources, command
lines, ``$(VAR)`` expansion, Ray start flags, pod status bodies. No I/O."""

from __future__ import annotations

import datetime
import json
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
DEFAULT_RUNTIME_PORT = 8000
#: The node every local pod is bound to (``spec.nodeName``).
NODE_NAME = "local-kuberay"
#: Ray node label naming the pod a local Ray node stands for.
NODE_POD_LABEL = "elasticmoe.io/pod"

# KubeRay's pod name suffix alphabet (k8s.io/apimachinery utilrand: no vowels, no 0/1/3).
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_PORT_FLAG = re.compile(r"(--port(?:=|\s+))(\d+)")
_HOST_FLAG = re.compile(r"(--host(?:=|\s+))(\S+)")
_SHELLS = {"sh", "bash", "dash", "zsh", "ash"}


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def random_suffix(rng: random.Random, n: int = 5) -> str:
    return "".join(rng.choice(_SUFFIX_ALPHABET) for _ in range(n))


def parse_resources(value: Any) -> dict[str, float]:
    """``rayStartParams.resources`` as KubeRay takes it: ``'"{\\"moe_rank\\": 1}"'`` (a shell
    word: outer quotes, escaped inner quotes) or plain JSON; a mapping passes through."""
    if isinstance(value, Mapping):
        return {str(k): float(v) for k, v in value.items()}
    text = str(value).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1].replace('\\"', '"')
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"rayStartParams.resources is not JSON: {value!r}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"rayStartParams.resources must be a JSON object: {value!r}")
    return {str(k): float(v) for k, v in parsed.items()}


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names are replaced, ``$$`` escapes ``$``."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_REF.sub(sub, text)


def rewrite_runtime_argv(argv: list[str], *, port: int) -> tuple[list[str], int]:
    """Point the runtime at 127.0.0.1:``port`` (see the module docstring); returns the new argv
    and the port it declared (8000 when it declared none)."""
    out = list(argv)
    declared: int | None = None
    i = 0
    while i < len(out):
        item = out[i]
        if item == "--port" and i + 1 < len(out):
            declared = declared or _int_or_none(out[i + 1])
            out[i + 1] = str(port)
            i += 2
            continue
        if item == "--host" and i + 1 < len(out):
            out[i + 1] = LOOPBACK
            i += 2
            continue
        if item.startswith("--port="):
            declared = declared or _int_or_none(item.split("=", 1)[1])
            out[i] = f"--port={port}"
        elif item.startswith("--host="):
            out[i] = f"--host={LOOPBACK}"
        elif " " in item and ("--port" in item or "--host" in item):  # a shell string
            found = _PORT_FLAG.search(item)
            if found:
                declared = declared or int(found.group(2))
            item = _PORT_FLAG.sub(lambda m: f"{m.group(1)}{port}", item)
            out[i] = _HOST_FLAG.sub(lambda m: f"{m.group(1)}{LOOPBACK}", item)
        i += 1
    if declared is None and not any(_PORT_FLAG.search(x) or x == "--port" for x in out):
        if _is_shell_c(out):  # sh -c "...": extend the script
            out[-1] = f"{out[-1]} --host {LOOPBACK} --port {port}"
        else:
            out += ["--host", LOOPBACK, "--port", str(port)]
    return out, declared or DEFAULT_RUNTIME_PORT


def local_shell_argv(argv: list[str]) -> list[str]:
    """Drop the login flag of a shell command (``bash -lc``): a login shell resets PATH from
    /etc/profile, and the local processes need the stand-in's PATH (the venv's ``bin`` first)."""
    if not argv or Path(argv[0]).name not in _SHELLS:
        return list(argv)
    out = [argv[0]]
    options = True
    for item in argv[1:]:
        if options and item == "--login":
            continue
        if options and item.startswith("-") and item != "--" and not item.startswith("--"):
            item = "-" + item[1:].replace("l", "")
            if item == "-":
                continue
        elif options:
            options = False
        out.append(item)
    return out


def _is_shell_c(argv: list[str]) -> bool:
    if not argv or Path(argv[0]).name not in _SHELLS:
        return False
    return any(a.startswith("-") and not a.startswith("--") and "c" in a for a in argv[1:3])


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def group_replicas(group: dict[str, Any]) -> int:
    """Pods a worker group asks for: ``replicas`` (default 1) × ``numOfHosts``."""
    replicas = group.get("replicas")
    hosts = group.get("numOfHosts") or 1
    return max(0, int(1 if replicas is None else replicas)) * max(1, int(hosts))


def first_container(template: dict[str, Any]) -> dict[str, Any]:
    containers = (template.get("spec") or {}).get("containers") or [{}]
    first: dict[str, Any] = containers[0]
    return first


def ray_params_argv(
    params: dict[str, Any], *, pod_name: str, default_cpus: str, object_store_memory: int
) -> list[str]:
    """`ray start` flags from a group's ``rayStartParams`` (those that make sense on one host)
    plus the node label naming the pod."""
    argv = [f"--num-cpus={params.get('num-cpus', default_cpus)}"]
    if "num-gpus" in params:
        argv.append(f"--num-gpus={params['num-gpus']}")
    if "resources" in params:
        argv.append(f"--resources={json.dumps(parse_resources(params['resources']))}")
    argv.append(f"--object-store-memory={params.get('object-store-memory', object_store_memory)}")
    labels = {NODE_POD_LABEL: pod_name}
    if "labels" in params:
        for part in str(params["labels"]).strip("'\"").split(","):
            if "=" in part:
                key, value = part.split("=", 1)
                labels[key.strip()] = value.strip()
    argv.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
    return argv


def grace_seconds(template: dict[str, Any]) -> float:
    value = (template.get("spec") or {}).get("terminationGracePeriodSeconds")
    return float(value) if value is not None else 30.0


def pod_status(
    *, kind: str, ready: bool, running: bool, restarts: int, started_at: str
) -> dict[str, Any]:
    """The status subresource body of a pod, as a kubelet would report it."""
    ts = now_rfc3339()
    ready_s = "True" if ready else "False"

    def cond(kind: str, status: str) -> dict[str, Any]:
        return {"type": kind, "status": status, "lastTransitionTime": ts, "lastProbeTime": None}

    status: dict[str, Any] = {
        "phase": "Running" if running else "Pending",
        "hostIP": LOOPBACK,
        "hostIPs": [{"ip": LOOPBACK}],
        "conditions": [
            cond("PodScheduled", "True"),
            cond("Initialized", "True"),
            cond("ContainersReady", ready_s),
            cond("Ready", ready_s),
        ],
    }
    if running:
        status.update(
            podIP=LOOPBACK,
            podIPs=[{"ip": LOOPBACK}],
            startTime=started_at or ts,
            containerStatuses=[
                {
                    "name": "ray-head" if kind == "head" else "ray-worker",
                    "image": "local",
                    "imageID": "",
                    "ready": ready,
                    "started": True,
                    "restartCount": restarts,
                    "state": {"running": {"startedAt": started_at or ts}},
                }
            ],
        )
    return {"status": status}
