"""Shared fixtures of the runtime integration tests: one local Ray instance for the package (shut down before the e2e tier)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Compiled-graph waits are bounded so a broken graph fails a test instead of hanging it.
os.environ.setdefault("RAY_CGRAPH_get_timeout", "60")


@pytest.fixture(scope="package")
def ray_session() -> Iterator[None]:
    """A local Ray instance on loopback with room for 12 rank actors (3 DP ranks of TP 2 x PP 2);
    shut down at session end.

    Rank actors take no CPU (num_cpus=0) and one `moe_rank` each, so they all fit on 2 cores.
    """
    ray = pytest.importorskip("ray")
    from moe_runtime.executor import cluster

    if ray.is_initialized():
        yield
        return
    cluster.keep_on_loopback()
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=2,
        num_gpus=0,
        resources={"moe_rank": 12},
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        # Workers keep Ray's default niceness (15) here: ranks raise themselves to 0 when they
        # step, a warm spare takes SPARE_NICENESS, and workers other tests leave behind never
        # take CPU from the in-process ranks of the local-executor tests.
        _system_config={"kill_worker_timeout_milliseconds": cluster.KILL_WORKER_TIMEOUT_MS},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_address(ray_session: None) -> str:
    """The tests' Ray instance's address, for a `serve` process to join (`RAY_ADDRESS`)."""
    import ray

    address: str = ray.get_runtime_context().gcs_address
    return address
