"""The step graph of `RayExecutor`: a Ray compiled graph ``InputNode -> [rank.execute_step]
-> MultiOutputNode``, compiled within a deadline, and the warm-up that pays an actor's first
compile while the old graph still serves.

Two compiled graphs must never be live on the same actors (REFERENCE.md): `compile_graph`
tears down a graph that finished compiling after its deadline, and the executor tears the old
graph down before it compiles a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
import ray.dag

log = logging.getLogger(__name__)


def compile_graph(actors: Sequence[Any], *, timeout: float) -> Any:
    """The step graph over `actors`, compiled within `timeout` seconds (TimeoutError past it;
    a compile that completes later is torn down by its thread, so it never stays live)."""
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def build() -> None:
        try:
            with ray.dag.InputNode() as inp:
                dag = ray.dag.MultiOutputNode([a.execute_step.bind(inp) for a in actors])
            graph = dag.experimental_compile()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            with lock:
                box["error"] = exc
            return
        with lock:
            late = box.get("abandoned", False)
            if not late:
                box["graph"] = graph
        if late:
            log.warning("a step graph compiled after its deadline: tearing it down")
            graph.teardown()

    thread = threading.Thread(target=build, name="step-graph-compile", daemon=True)
    thread.start()
    thread.join(timeout)
    with lock:
        if "graph" in box:
            return box["graph"]
        if "error" in box:
            raise box["error"]
        box["abandoned"] = True
    raise TimeoutError(f"compiling the step graph over {len(actors)} ranks took over {timeout}s")


def warm_up(actors: Sequence[Any], *, timeout: float) -> None:
    """Compile, run once and tear down a throwaway graph over new actors.

    An actor's first compiled graph costs seconds of one-time setup (measured here: a
    switch onto 2 fresh actors compiled in 2.6-3.3 s, 0.17-0.21 s once they had been in a
    graph before). Paying it now, while the old graph keeps serving on the other actors,
    keeps it out of the Switching pause. It runs in a thread while the resize loads weights
    and builds groups; `switch` waits for it. Best effort: a failure only costs that time
    later.
    """
    started = time.monotonic()
    try:
        with ray.dag.InputNode() as inp:
            dag = ray.dag.MultiOutputNode([a.echo.bind(inp) for a in actors])
        graph = dag.experimental_compile()
        try:
            ray.get(graph.execute(0), timeout=timeout)
        finally:
            graph.teardown()
    except Exception:  # noqa: BLE001 - an optimisation; the switch compiles anyway
        log.exception("warming up %d new actors failed; the switch will be slower", len(actors))
        return
    log.info("warmed up %d new actors in %.2fs", len(actors), time.monotonic() - started)
