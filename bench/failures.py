"""How fast failures are noticed and called off: the figures the failure tests assert no longer.

The tests check outcomes (who is named, which error, what state is left); how long each took
is printed here, median of `--repeats` runs:
- a group join whose member never comes ends at its timeout (`group.JoinTimeout`), against
  the timeout asked;
- a join called off (`abort_join`) returns (`group.JoinAborted`) after the call-off;
- a pending worker whose pings hang is fenced after `pending_hang_timeout` (the heartbeat);
- on Ray: a group build over a new rank whose process died before it joined fails naming it,
  and the serving ranks' control lanes answer again after it (not after the group timeout).

Run: .venv/bin/python bench/failures.py   (about a minute on 2 cores; prints figures, asserts
none) .venv/bin/python bench/failures.py --no-ray --repeats 5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from moe_runtime.comm import group as group_mod
from moe_runtime.eplb import policy
from moe_runtime.executor import base, health

SOURCE = "synthetic://tiny?seed=0"
#: The group timeout of a resize: what a lost member would hold the others for.
GROUP_TIMEOUT = 300.0


def _joins(spec: group_mod.GroupSpec, ranks: list[int], **kwargs: Any) -> list[Any]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(ranks))
    futures = [pool.submit(group_mod.StatelessGroup, spec, r, **kwargs) for r in ranks]
    pool.shutdown(wait=False)
    return futures


def join_timeout(timeout: float) -> float:
    """Seconds until the joins of a 3-member group whose member 2 never comes fail."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = group_mod.GroupSpec.local(3, epoch=1, directory=tmp)
        started = time.monotonic()
        for f in _joins(spec, [0, 1], timeout=timeout):
            try:
                f.result(timeout=timeout + 60)
            except group_mod.JoinTimeout:
                pass
        return time.monotonic() - started


def join_call_off() -> float:
    """Seconds from a call-off to the end of the joins it calls off (member 0 never comes)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = group_mod.GroupSpec.local(3, epoch=1, directory=tmp)
        stop = threading.Event()
        futures = _joins(spec, [1, 2], timeout=GROUP_TIMEOUT, aborted=stop.is_set)
        time.sleep(0.3)  # they wait for member 0 now
        called_off = time.monotonic()
        stop.set()
        for f in futures:
            try:
                f.result(timeout=GROUP_TIMEOUT)
            except group_mod.JoinAborted:
                pass
        return time.monotonic() - called_off


def pending_hang(pending_hang_timeout: float) -> float:
    """Seconds from the heartbeat's start until a pending worker whose pings never come back
    is fenced (the heartbeat's own rounds, every 0.02 s; rank 0 steps and answers)."""
    members = {0: health.RankHealth(), 1: health.RankHealth()}
    fenced = threading.Event()
    beat = health.Heartbeat(
        members=lambda: members,
        stepping=lambda: [0],
        send_ping=lambda label: label,
        poll_ping=lambda label: None if label == 1 else health.HEALTH_OK,
        fence=lambda labels, reason: fenced.set(),
        clock=health.StepClock(),
    )
    beat.pending_hang_timeout = pending_hang_timeout
    started = time.monotonic()
    beat.start(interval=0.02, hang_timeout=0.2)
    try:
        fenced.wait(GROUP_TIMEOUT)
        return time.monotonic() - started
    finally:
        beat.stop()


def lost_member_build() -> tuple[float, float]:
    """(seconds until a build over a dead new rank fails, then until the serving ranks'
    control lanes answer), on a local Ray instance."""
    from moe_runtime.executor import cluster, ray_executor

    owns = cluster.connect(num_rank_slots=4)
    ex = ray_executor.RayExecutor(2)
    try:
        ex.start(SOURCE, placement=policy.identity(4, 8, 8, 2))
        new = ex.add_ranks(1, timeout=120)
        os.kill(int(ex.rank_infos()[new[0]]["pid"]), signal.SIGKILL)
        started = time.monotonic()
        try:
            ex.build_groups([0, 1, *new], epoch=7, timeout=GROUP_TIMEOUT)
        except base.RankDied:
            pass
        failed = time.monotonic() - started
        started = time.monotonic()
        ex.collective_rpc("groups", ranks=[0, 1], background=True, timeout=GROUP_TIMEOUT)
        return failed, time.monotonic() - started
    finally:
        ex.shutdown()
        if owns:
            cluster.disconnect()


def median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray figures")
    args = parser.parse_args()
    print(
        f"join, member never comes, timeout 1 s: {median(lambda: join_timeout(1.0), args.repeats):.2f} s"
    )
    print(
        f"join called off: returned {median(join_call_off, args.repeats):.3f} s after the call-off"
    )
    print(
        "pending worker hung, pending_hang_timeout 1 s: fenced after "
        f"{median(lambda: pending_hang(1.0), args.repeats):.2f} s"
    )
    if not args.no_ray:
        failed, lanes = lost_member_build()
        print(
            f"Ray: build over a new rank lost before joining failed in {failed:.2f} s "
            f"(group timeout {GROUP_TIMEOUT:.0f} s); control lanes answered {lanes:.2f} s later"
        )


if __name__ == "__main__":
    main()
