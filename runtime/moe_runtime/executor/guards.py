"""Start-up guard rails of `RayExecutor` (the seed's, vLLM's RayDistributedExecutor):

- `check_node_ips`: ranks on different Ray nodes must report different IPs (the seed checks
  `n_nodes == n_ips`): ranks that share an IP are taken for one node (loopback, a FileStore
  rendezvous on its disk: `ray_groups.RayGroups`), so two nodes behind one address would never
  meet. Checked when ranks start and when a grow adds ranks.
- `check_compiled_graph`: the "compiled" step mode needs Ray's compiled graph; a Ray that lacks
  it is refused at start-up, naming its version and `MOE_STEP_MODE=remote`.
- `rank_env`: the head's environment that every rank actor gets (`runtime_env["env_vars"]`).
- `float_from_env`: a numeric setting of the environment, refused at start-up when bad.

Pure functions (data in, data out) but `check_compiled_graph`'s default probe and
`float_from_env` (reads os.environ).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moe_runtime.executor import base

#: Prefixes of the head's variables that reach every rank actor: log settings (MOE_LOG_LEVEL,
#: MOE_LOG_FORMAT, ...), the collectives' settings (NCCL_SOCKET_IFNAME, NCCL_DEBUG,
#: GLOO_SOCKET_IFNAME, TORCH_NCCL_*), the Hugging Face caches' (HF_HOME, ...), Ray's compiled
#: graph settings (RAY_CGRAPH_buffer_size_bytes: a channel's ends read it where they run).
RANK_ENV_PREFIXES = (
    "MOE_",
    "NCCL_",
    "GLOO_",
    "TORCH_NCCL_",
    "TORCH_DISTRIBUTED_",
    "HF_",
    "RAY_CGRAPH_",
)
#: Variables under those prefixes that stay where they are set: per worker (its pod's name and
#: IP, its termination log) or secrets (they would travel through Ray's GCS). Not copied
#: either, being outside the prefixes: CUDA_VISIBLE_DEVICES (Ray sets it per actor), RAY_*
#: but RAY_CGRAPH_*,
#: HOSTNAME, POD_*, OMP_*/MKL_* thread counts (a rank sets its own), the spare's setup hook.
RANK_ENV_KEPT = frozenset(
    {
        "MOE_POD_IP",
        "MOE_POD_NAME",
        "MOE_TERMINATION_LOG",
        "MOE_ADMIN_TOKEN",
        "MOE_ADMIN_TOKEN_FILE",
        "HF_TOKEN",
        "HF_TOKEN_PATH",
    }
)
#: The oldest Ray whose compiled graph (`ray.dag` ... `experimental_compile`) runs the step
#: graph (`ray_graph`); the runtime is developed on 2.60.
MIN_COMPILED_RAY = (2, 40)
#: The setting that steps through plain actor calls instead (`ray_executor.STEP_REMOTE`).
REMOTE_MODE_HINT = "MOE_STEP_MODE=remote"


class NodeAddressError(base.ExecutorError):
    """Ranks on different Ray nodes report the same IP: their groups cannot rendezvous."""


class CompiledGraphUnavailable(RuntimeError):
    """The "compiled" step mode cannot run on this Ray install."""


def check_node_ips(
    infos: Sequence[Mapping[str, Any]], *, existing: Sequence[Mapping[str, Any]] = ()
) -> None:
    """Refuse ranks (`infos`: new ones, `existing`: those already running; each with `node_id`
    and `ip`) when two Ray nodes report one IP. Ranks on one node share its IP (loopback on a
    local instance): fine."""
    nodes_of: dict[str, set[str]] = {}
    for info in [*existing, *infos]:
        nodes_of.setdefault(str(info["ip"]), set()).add(str(info["node_id"]))
    shared = {ip: sorted(nodes) for ip, nodes in nodes_of.items() if len(nodes) > 1}
    if shared:
        where = "; ".join(f"IP {ip}: nodes {', '.join(n)}" for ip, n in sorted(shared.items()))
        raise NodeAddressError(
            f"ranks on different Ray nodes report the same IP ({where}): each node needs its "
            "own routable address; start its Ray node with --node-ip-address (or set "
            "RAY_NODE_IP_ADDRESS) to that node's IP"
        )


def _ray_probe() -> tuple[str, str | None]:
    """(Ray's version, why its compiled graph is missing or None)."""
    import ray

    try:
        import ray.dag
        from ray.dag.compiled_dag_node import CompiledDAG  # noqa: F401
    except ImportError as exc:
        return ray.__version__, f"ray.dag cannot be imported ({exc})"
    missing = [
        name
        for name, ok in (
            ("ray.dag.InputNode", hasattr(ray.dag, "InputNode")),
            ("ray.dag.MultiOutputNode", hasattr(ray.dag, "MultiOutputNode")),
            ("DAGNode.experimental_compile", hasattr(ray.dag.DAGNode, "experimental_compile")),
        )
        if not ok
    ]
    return ray.__version__, (f"missing {', '.join(missing)}" if missing else None)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_compiled_graph(probe: Callable[[], tuple[str, str | None]] = _ray_probe) -> None:
    """Raise `CompiledGraphUnavailable` (naming Ray's version and `REMOTE_MODE_HINT`) when
    this Ray cannot compile the step graph. Called at start-up in "compiled" mode: the step
    path would otherwise keep serving on plain calls and retry the compile for ever."""
    version, missing = probe()
    if missing is None and _version(version) < MIN_COMPILED_RAY:
        missing = "older than " + ".".join(map(str, MIN_COMPILED_RAY))
    if missing is not None:
        raise CompiledGraphUnavailable(
            f"step mode 'compiled' needs Ray's compiled graph, which Ray {version} lacks "
            f"({missing}): install ray>={'.'.join(map(str, MIN_COMPILED_RAY))} or set "
            f"{REMOTE_MODE_HINT} (plain actor calls)"
        )


def float_from_env(
    name: str, default: float, *, valid: Callable[[float], bool], wanted: str
) -> float:
    """The environment's `name` as a float, `default` when unset or empty; ValueError naming
    the variable and `wanted` (e.g. "a number of seconds >= 0") when not a number or not
    `valid`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be {wanted}, got {raw!r}") from None
    if not valid(value):
        raise ValueError(f"{name} must be {wanted}, got {raw!r}")
    return value


def choice_from_env(name: str, choices: Sequence[str], *, wanted: str) -> str:
    """The environment's `name`, stripped and lower-cased, the first of `choices` when unset or
    empty; ValueError naming the variable and `wanted` (e.g. "auto, 1 or 0") for another."""
    raw = os.environ.get(name, "").strip().lower() or choices[0]
    if raw not in choices:
        raise ValueError(f"{name} must be {wanted}, got {raw!r}")
    return raw


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The head's variables every rank actor gets (`RANK_ENV_PREFIXES` less `RANK_ENV_KEPT`)."""
    return {
        k: v
        for k, v in sorted(environ.items())
        if k.startswith(RANK_ENV_PREFIXES) and k not in RANK_ENV_KEPT
    }


def actor_env_options(copied: Mapping[str, str], own: Mapping[str, str]) -> dict[str, Any]:
    """An actor's `.options` for its environment: the copied head variables, then its own
    (`own`, e.g. a spare's setup hook: it wins). Empty when both are: no runtime_env, so Ray
    may give the actor any worker process, as without this guard."""
    env = {**copied, **own}
    return {"runtime_env": {"env_vars": env}} if env else {}
