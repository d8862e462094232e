"""The heartbeat's calls to rank actors, on their health lane (`ray_actor.HEALTH_LANE`, never
queued behind a step or a transfer): `ping` / `poll` / `ping_error` (one ping in flight per
rank, read without waiting), `check_health` (every rank at once, with a deadline) and
`load_progress` (how far each rank's weight load is).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import ray.exceptions

from moe_runtime.executor import health as health_mod
from moe_runtime.executor.ray_actor import HEALTH_LANE, Member
from moe_runtime.rank import worker as worker_mod

log = logging.getLogger(__name__)


def check_health(ranks: Mapping[int, Member], *, timeout: float) -> dict[int, str]:
    """Ping every rank now and wait up to `timeout`: "ok", "dead" or "unresponsive" by label."""
    labels = sorted(ranks)
    refs = [ping(ranks[r].handle.actor) for r in labels]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    done = set(ready)
    report: dict[int, str] = {}
    for label, ref in zip(labels, refs, strict=True):
        if ref not in done:
            report[label] = "unresponsive"
            continue
        try:
            ray.get(ref)
            report[label] = "ok"
        except ray.exceptions.RayActorError:
            report[label] = "dead"
        except ray.exceptions.RayError as exc:
            report[label] = "dead" if _rank_failed(exc) else "unresponsive"
    return report


def load_progress(actors: Sequence[Any], *, timeout: float) -> list[dict[str, Any]]:
    """`RankWorker.load_progress` of each actor, asked on its health lane (a load runs on the
    default lane); those that do not answer within `timeout` s, or fail, are left out."""
    refs = [
        a.execute_method.options(concurrency_group=HEALTH_LANE).remote("load_progress")
        for a in actors
    ]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out: list[dict[str, Any]] = []
    for ref in refs:
        if ref not in done:
            continue
        try:
            out.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - a rank that cannot say is left out
            log.debug("load progress not read: %s", exc)
    return out


def ping(actor: Any) -> Any:
    """Start a ping of `actor` on its health lane; the ref goes to `poll`."""
    return actor.execute_method.options(concurrency_group=HEALTH_LANE).remote("ping")


def poll(ref: Any) -> str | None:
    """None while the ping is pending, else health_mod.HEALTH_OK or health_mod.HEALTH_DEAD."""
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return None
    try:
        ray.get(ref)
    except ray.exceptions.RayActorError:
        return health_mod.HEALTH_DEAD
    except ray.exceptions.RayError as exc:
        # it answered with an error: alive, unless the rank failed (`RankWorker.fail`)
        return health_mod.HEALTH_DEAD if _rank_failed(exc) else health_mod.HEALTH_OK
    return health_mod.HEALTH_OK


def ping_error(ref: Any) -> str | None:
    """The `worker.RankFailed` message a finished ping raised, else None."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayError as exc:
        if _rank_failed(exc):
            cause = getattr(exc, "cause", None)
            return str(cause if cause is not None else exc)
    except Exception:  # noqa: BLE001 - a ping that cannot be read says nothing more
        return None
    return None


def _rank_failed(exc: BaseException) -> bool:
    """A ping answered with `worker.RankFailed` (the rank cannot step again)."""
    cause = getattr(exc, "cause", None)
    return isinstance(exc, worker_mod.RankFailed) or isinstance(cause, worker_mod.RankFailed)
