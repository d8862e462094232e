"""CPU niceness of a rank's process and threads (no torch, no ray: `spare_setup` runs in a new
Ray worker process before it imports anything else of the runtime).

Linux keeps a niceness per thread; a thread inherits its creator's. Raising the priority back
(a lower niceness) needs CAP_SYS_NICE (or RLIMIT_NICE): without it a thread keeps its own.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

#: Niceness of a warm spare or a rank pool's process (`add_ranks(spare=True)`): from its first
#: line of Python on (`spare_setup`, so its imports too), it waits, or pre-stages experts, below
#: the serving ranks, and takes 0 again when a grow takes it (`RankActor.promote`).
SPARE_NICENESS = 10
#: Niceness of a serving rank's threads other than its step thread while they move weights
#: (exports, staging, pre-staging, background control calls): a step waits for its slowest
#: rank, so the copies take what CPU the step threads leave
#: (`ray_actor.RankActor._in_background`). Not the copies a resize or a recovery stages
#: (`ray_actor.RankActor.stage_experts_shared` without a staging id): the resize waits for them, and since resizes keep most experts in place (`eplb.settle`)
#: they are few. Measured (bench/resize.py, `small`, 4 clients, 2 cores): a first shrink 4->2
#: moving ~30 experts took 1.1-2.2 s with them at 10, 0.54-0.62 s at 0, with no longer
#: blackout than plain serving's longest gap.
BACKGROUND_NICENESS = 10
#: The environment variable Ray 2.60's worker reads for its process setup hook (a module's
#: function by name, run after the worker connected and before it loads any task or actor;
#: `ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR`). Set in an actor's
#: `runtime_env["env_vars"]` it applies to that actor's process only.
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
#: The hook of a spare's process (`ray_start.start_ranks(spare=True)`).
SPARE_SETUP_HOOK = f"{__name__}.spare_setup"
#: The hook of a process a grow starts beside serving ranks (`ray_start.start_ranks` with
#: `existing` ranks, not a spare).
GROW_SETUP_HOOK = f"{__name__}.grow_setup"
#: Niceness of a serving rank (and of a grow's new one from its first import on).
SERVING_NICENESS = 0


def spare_setup() -> None:
    """Ray's process setup hook of a spare: SPARE_NICENESS for every thread before the actor's
    module (Python, torch, the runtime: ~3 s of CPU) is imported, so a process started beside
    serving ranks never takes CPU from their steps at their priority."""
    set_niceness(None, SPARE_NICENESS, why="starts as a spare")


def grow_setup() -> None:
    """Ray's process setup hook of a rank a grow starts: the serving ranks' niceness before
    the actor's module is imported (the grow waits for this process; at a lower priority
    beside busy ranks its imports would take the CPU they leave). Without CAP_SYS_NICE a
    worker that began nicer keeps its niceness."""
    set_niceness(None, SERVING_NICENESS, why="starts for a grow")


def thread_niceness(label: int | None, tid: int, niceness: int, *, only_up: bool = False) -> None:
    """`niceness` for one thread of this process (`only_up`: unless it is nicer already).
    Without CAP_SYS_NICE a thread cannot take a lower niceness back: it keeps its own."""
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if now != niceness and not (only_up and now >= niceness):
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError as exc:
        log.debug(
            "rank %s: thread %d keeps its niceness (wanted %d): %s", label, tid, niceness, exc
        )


def set_niceness(label: int | None, niceness: int, *, why: str) -> None:
    """`niceness` for every thread of this process (threads it starts later inherit it).

    Workers start at the serving ranks' priority (`cluster.WORKER_NICENESS`); a warm spare
    lowers itself (`SPARE_NICENESS`) so it never takes CPU from them, and takes 0 again when it
    steps or stages for a grow. Raising the priority back needs CAP_SYS_NICE (or RLIMIT_NICE):
    without it the rank keeps the niceness it has (in a pod of its own, its cgroup's CPU share
    is what counts, not its niceness beside the pod's other processes).
    """
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        if all(os.getpriority(os.PRIO_PROCESS, t) == niceness for t in tids):
            return
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except (OSError, ValueError) as exc:
        log.info("rank %s keeps its scheduling niceness (wanted %d): %s", label, niceness, exc)
        return
    log.info("rank %s %s: niceness %d for its %d threads", label, why, niceness, len(tids))
