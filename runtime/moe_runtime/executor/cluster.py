"""Joining the Ray cluster that `RayExecutor` runs on, or starting a local one on loopback.

Kept here because only `moe_runtime.executor` imports ray; the CLI calls `connect` before it
builds the executor and `disconnect` after it shut the executor down.
"""

from __future__ import annotations

import logging
import os

import ray
from ray._private import ray_constants

from moe_contract import names
from moe_runtime.executor import ray_actor

log = logging.getLogger(__name__)

#: Milliseconds the raylet waits for a killed worker to exit before it SIGKILLs it (the
#: contract's: the operator sets the same on the pods' Ray nodes).
KILL_WORKER_TIMEOUT_MS = names.RAY_KILL_WORKER_TIMEOUT_MS
#: Scheduling niceness of the local instance's worker processes (Ray's default is 15, below
#: everything else on the host). 0: a rank a grow waits for starts (Python, Ray, torch: seconds
#: of CPU) at the serving ranks' priority. Measured here (2 cores, `small` 2->4 under 4
#: streaming clients): Standby 12.5 s with new workers at 10, 9.9 s when they raised themselves
#: in `__init__` (the imports before it dominate), 4.3 s at 0, with no longer blackout. A warm
#: spare lowers itself to `niceness.SPARE_NICENESS` once started, so its idle life and
#: pre-staging yield to serving; a rank at 15 served `small` at 12.8 tokens/s against 22.0 at 0.
WORKER_NICENESS = 0


#: Ray's switch (ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR): "0" keeps a node's address on
#: loopback instead of the host's routable one.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_on_loopback() -> None:
    """A Ray instance this process starts (and every process it starts) stays on 127.0.0.1.

    Asked for 127.0.0.1, Ray 2.60 takes the host's routable address instead
    (`services.resolve_ip_for_localhost`) and binds its gRPC servers (GCS, raylet, every worker)
    on all interfaces and its agents on that address; only with a node address of 127.0.0.1
    do they bind loopback alone, and on Linux only ENABLE_RAY_CLUSTER off gives one
    (`services.get_node_ip_address`). The environment reaches the processes Ray starts; this
    process read the constant at import, so it is set here too.
    """
    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def connect(*, num_rank_slots: int, address: str | None = None) -> bool:
    """Join the cluster at `address` (default: env RAY_ADDRESS), or start a local one.

    A local instance listens on 127.0.0.1 only (`keep_on_loopback`), has no dashboard, and
    offers `num_rank_slots` rank slots (the `moe_rank` resource that worker pods offer on
    Kubernetes; rank actors take no CPU). Its raylet SIGKILLs a killed worker that does not
    exit by itself after KILL_WORKER_TIMEOUT_MS (Ray's default is 5 s), so a fenced hung rank
    releases its peers fast (see `ray_executor`; on a cluster, set
    RAY_kill_worker_timeout_milliseconds on the nodes), and its workers run at WORKER_NICENESS
    (on a cluster: RAY_worker_niceness). Returns True when this call started Ray: the caller
    then owns it and must call `disconnect`, which stops every process it started.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        log.info("ray: joining the cluster at %s", address)
        ray.init(address=address, configure_logging=False)
        return False
    log.info("ray: starting a local instance on 127.0.0.1 with %d rank slots", num_rank_slots)
    keep_on_loopback()
    ray.init(
        address="local",  # never attach to another instance found on this host
        _node_ip_address="127.0.0.1",
        resources={ray_actor.RANK_RESOURCE: num_rank_slots},
        include_dashboard=False,
        configure_logging=False,
        _system_config={
            "kill_worker_timeout_milliseconds": KILL_WORKER_TIMEOUT_MS,
            "worker_niceness": WORKER_NICENESS,
        },
    )
    return True


def disconnect() -> None:
    """Leave the cluster; a local instance started by `connect` is shut down with its processes."""
    if ray.is_initialized():
        ray.shutdown()
        log.info("ray: disconnected")
