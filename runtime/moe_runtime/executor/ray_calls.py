"""Reading Ray calls' results with the rank named (`get_all`), and one line for a rank actor
that died (`death`) or any Ray error (`first_line`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
import ray.exceptions

from moe_runtime.executor import base

#: The rank actor's lane of `end_step` (`ray_actor.END_LANE`).
END_LANE = "end"
#: The rank actor's lane of pings, aborts and settles (`ray_actor.HEALTH_LANE`).
HEALTH_LANE = "health"


def step_calls(actors: Sequence[Any], step: Any, *, split: bool) -> list[Any]:
    """A step sent to every rank actor by plain calls; the refs of its outputs. `split`
    (`--pipeline-interleave`): `begin_step` on the default lane, then `end_step` on the end
    lane (`END_LANE`), so the next step's `begin_step` runs while this one's
    `end_step` waits for the later pipeline stages."""
    if not split:
        return [a.execute_step.remote(step) for a in actors]
    for actor in actors:
        actor.begin_step.remote(step)  # never raises: its errors are in end_step's output
    return [a.end_step.options(concurrency_group=END_LANE).remote(step.step_id) for a in actors]


def get_all(
    refs: Sequence[Any], ranks: Sequence[int], *, what: str, timeout: float | None
) -> list[Any]:
    """ray.get every ref; errors name the rank (RankDied for a dead actor)."""
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    if pending:
        late = [r for r, ref in zip(ranks, refs, strict=True) if ref not in set(ready)]
        raise TimeoutError(f"{what}: ranks {late} did not answer within {timeout}s")
    results = []
    for rank, ref in zip(ranks, refs, strict=True):
        try:
            results.append(ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            raise base.RankDied(f"{what}: rank {rank} died: {death(exc)}", ranks=[rank]) from exc
        except ray.exceptions.RayTaskError as exc:
            raise base.ExecutorError(
                f"{what} failed on rank {rank}: {exc.cause!r}", ranks=[rank]
            ) from exc
    return results


#: What Ray says of a worker process killed by the kernel's OOM killer (a possible cause it
#: names first) or by its own memory monitor: either way the rank ran out of memory.
_OOM_WORDS = ("OOM killer", "low on memory")
MEMORY_HINT = (
    "its process was killed, most likely out of memory: a rank needs the runtime's fixed "
    "~0.8 GB plus its shard within the worker pod's memory limit (spec.ray.workerResources)"
)


def death(exc: BaseException) -> str:
    """One line for a rank actor that died: Ray's first line, and what to do when Ray says
    the process may have been killed for memory (its message runs to many lines)."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    head = lines[0] if lines else type(exc).__name__
    if any(word in text for word in _OOM_WORDS):
        return f"{head} ({MEMORY_HINT})"
    return head


def first_line(exc: BaseException, limit: int = 160) -> str:
    """A short description of exc (Ray's messages run to many lines)."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"
