"""The operator's loop (``loop.Operator`` over ``workqueue.WorkQueue``): what queues a
deployment, that its reconciles never overlap, that failures are retried with backoff, that an
invalid spec warns once per generation, and that reconciles can post events (kopf's thin
handlers)."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from moe_operator import handlers, loop, metrics, reconcile, workqueue
from moe_operator.api import status as status_

Key = tuple[str, str]


def deployment(name: str = "a", *, generation: int = 1, uid: str = "u1") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": uid,
            "generation": generation,
            "resourceVersion": "10",
        },
        "spec": {"dataParallelSize": 2},
    }


def outcome(requeue_after: float | None = None) -> reconcile.Outcome:
    return reconcile.Outcome(
        phase=status_.Phase.SERVING,
        created=(),
        status_written=False,
        requeue_after=requeue_after,
    )


class Stored:
    """The API server's copy of the deployments (what a fresh read gets)."""

    def __init__(self, *bodies: dict[str, Any]) -> None:
        self.bodies = {loop.key_of(b): b for b in bodies}

    async def get(self, *, namespace: str, name: str, **_: Any) -> dict[str, Any] | None:
        body = self.bodies.get((namespace, name))
        return copy.deepcopy(body) if body is not None else None

    async def close(self) -> None:
        pass


Reconcile = Callable[..., Awaitable[reconcile.Outcome]]


def operator(
    reconcile_fn: Reconcile, *bodies: dict[str, Any], posts: list[tuple[str, str, bool]] | None
) -> loop.Operator:
    seen = posts if posts is not None else []
    return loop.Operator(
        api=Stored(*bodies),  # type: ignore[arg-type]
        operator_key=b"k",
        post=lambda body, reason, message, warning: seen.append((reason, message, warning)),
        metrics=metrics.OperatorMetrics(),
        reconcile_fn=reconcile_fn,
    )


async def until(condition: Callable[[], bool], *, timeout: float = 5.0) -> None:
    """Poll ``condition`` (a deadline, never a fixed sleep)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("connection refused"),  # the runtime away (not an OSError)
        OSError("network unreachable"),  # the API server away
        RuntimeError("a bug in one reconcile"),
    ],
    ids=["runtime-unreachable", "apiserver-unreachable", "bug"],
)
def test_resync_goes_on_after_a_failed_reconcile(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    calls: list[Key] = []

    async def reconcile_fn(*, body: dict[str, Any], **_: Any) -> reconcile.Outcome:
        calls.append(loop.key_of(body))
        if len(calls) <= 2:
            raise error
        return outcome()

    monkeypatch.setattr(loop, "RESYNC_SECONDS", 0.01)
    monkeypatch.setattr(workqueue, "RETRY_BACKOFF_SECONDS", 0.01)

    async def run() -> None:
        op = operator(reconcile_fn, deployment("a"), deployment("b"), posts=None)
        op.known |= {("ml", "a"), ("ml", "b")}
        op.start()
        await until(lambda: calls.count(("ml", "a")) >= 2 and calls.count(("ml", "b")) >= 2)
        assert op.resync_task is not None and not op.resync_task.done(), "the resync loop died"
        await op.close()

    asyncio.run(run())
    # both deployments are reconciled again after the failures
    assert calls.count(("ml", "a")) >= 2 and calls.count(("ml", "b")) >= 2


def test_a_failed_requeued_reconcile_is_requeued(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[int] = []

    async def reconcile_fn(**_: Any) -> reconcile.Outcome:
        attempts.append(1)
        if len(attempts) == 1:
            raise httpx.ConnectError("refused")
        return outcome()

    monkeypatch.setattr(workqueue, "RETRY_BACKOFF_SECONDS", 0.01)

    async def run() -> None:
        op = operator(reconcile_fn, deployment(), posts=None)
        op.known.add(("ml", "a"))
        op.child_event(("ml", "a"))
        await until(lambda: len(attempts) >= 2)
        await op.queue.idle()

    asyncio.run(run())
    assert len(attempts) == 2


def test_a_change_seen_during_a_requeued_reconcile_is_not_lost() -> None:
    """A pod turns Ready while a reconcile runs (it read the pods just before): the event must
    bring another reconcile, not be folded into the running one."""
    runs: list[int] = []

    async def run() -> None:
        started = asyncio.Event()
        release = asyncio.Event()

        async def reconcile_fn(**_: Any) -> reconcile.Outcome:
            runs.append(1)
            if len(runs) == 1:
                started.set()
                await release.wait()
            return outcome()

        op = operator(reconcile_fn, deployment(), posts=None)
        op.known.add(("ml", "a"))
        op.child_event(("ml", "a"))
        await asyncio.wait_for(started.wait(), 5)
        op.child_event(("ml", "a"))  # the event, mid-reconcile
        release.set()
        await until(lambda: len(runs) >= 2)
        await op.queue.idle()

    asyncio.run(run())
    assert len(runs) == 2


def test_reconciles_of_one_deployment_never_overlap_and_bursts_are_folded() -> None:
    """Many triggers while one reconcile runs bring exactly one more; a DELETED and a new
    object of the same name meanwhile wait for the running one too."""
    active: list[int] = []
    overlaps: list[int] = []
    runs: list[str] = []

    async def run() -> None:
        release = asyncio.Event()

        async def reconcile_fn(*, body: dict[str, Any], **_: Any) -> reconcile.Outcome:
            active.append(1)
            if len(active) > 1:
                overlaps.append(1)
            runs.append(body["metadata"]["uid"])
            if len(runs) == 1:
                await release.wait()
            active.pop()
            return outcome()

        op = operator(reconcile_fn, deployment(), posts=None)
        op.deployment_event("ADDED", deployment())
        await until(lambda: len(runs) == 1)
        for _ in range(5):
            op.child_event(("ml", "a"))
        op.deployment_event("DELETED", deployment())  # the queued ones are dropped
        recreated = deployment(uid="u2")
        op.api.bodies[("ml", "a")] = recreated  # type: ignore[attr-defined]
        op.deployment_event("ADDED", recreated)
        release.set()
        await op.queue.idle()

    asyncio.run(run())
    assert overlaps == []
    assert runs == ["u1", "u2"]


def test_an_invalid_spec_warns_once_per_generation_and_waits_for_a_spec_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop, "RESYNC_SECONDS", 0.01)
    tried: list[int] = []
    posts: list[tuple[str, str, bool]] = []

    async def reconcile_fn(*, body: dict[str, Any], **_: Any) -> reconcile.Outcome:
        generation = body["metadata"]["generation"]
        tried.append(generation)
        if generation < 3:
            raise reconcile.InvalidSpec(f"dataParallelSize: too large (generation {generation})")
        return outcome()

    async def run() -> None:
        op = operator(reconcile_fn, deployment(generation=1), posts=posts)
        op.deployment_event("ADDED", deployment(generation=1))
        await op.queue.idle()
        op.start()  # resyncs every 10 ms, as do pod and RayCluster events
        for _ in range(5):
            op.child_event(("ml", "a"))
            await asyncio.sleep(0.02)
            await op.queue.idle()
        assert tried == [1]  # dropped until the spec changes
        changed = deployment(generation=2)
        op.api.bodies[("ml", "a")] = changed  # type: ignore[attr-defined]
        op.deployment_event("MODIFIED", changed)  # still invalid: one more warning
        await op.queue.idle()
        fixed = deployment(generation=3)
        op.api.bodies[("ml", "a")] = fixed  # type: ignore[attr-defined]
        op.deployment_event("MODIFIED", fixed)
        await until(lambda: 3 in tried)
        await op.close()

    asyncio.run(run())
    warnings = [(reason, warning) for reason, _, warning in posts]
    assert warnings == [("InvalidSpec", True), ("InvalidSpec", True)]
    assert tried[:2] == [1, 2] and set(tried) == {1, 2, 3}


def test_requeued_and_resync_reconciles_run_in_kopfs_task_context() -> None:
    """kopf keeps its event queue in context variables of its per-object tasks; the workers
    of the resync, the requeues and the child events run in that context (captured from
    kopf's handlers), so their reconciles can post events (a lost ScaledUp event on the real
    node)."""
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker")
    seen: list[str] = []

    async def reconcile_fn(**_: Any) -> reconcile.Outcome:
        seen.append(marker.get("missing"))
        return outcome()

    async def run() -> None:
        op = operator(reconcile_fn, deployment(), posts=None)
        op.known.add(("ml", "a"))
        op.child_event(("ml", "a"))  # nothing captured yet
        await op.queue.idle()

        async def kopf_task() -> None:  # kopf sets its variables in each object's task
            marker.set("kopf")
            op.capture_context()

        await asyncio.get_running_loop().create_task(kopf_task())
        op.child_event(("ml", "a"))
        await op.queue.idle()

    asyncio.run(run())
    assert seen == ["missing", "kopf"]


def test_an_event_that_cannot_be_posted_does_not_fail_the_reconcile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def reconcile_fn(*, events: Any, **_: Any) -> reconcile.Outcome:
        events("ScaledUp", "dataParallelSize 1->2")  # outside kopf's tasks: no event queue
        return outcome()

    async def run() -> float | None:
        op = loop.Operator(
            api=Stored(deployment()),  # type: ignore[arg-type]
            operator_key=b"k",
            post=handlers.post_event,
            metrics=metrics.OperatorMetrics(),
            reconcile_fn=reconcile_fn,
        )
        return await op.reconcile_key(("ml", "a"), deployment())

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(run()) is None
    assert "event ScaledUp not posted" in caplog.text


def test_the_queue_keeps_the_earliest_due_time_and_the_newest_body() -> None:
    runs: list[tuple[Key, str | None]] = []

    async def work(key: Key, body: dict[str, Any] | None) -> float | None:
        runs.append((key, body["metadata"]["resourceVersion"] if body else None))
        return None

    async def run() -> None:
        queue = workqueue.WorkQueue(work)
        queue.add(("ml", "a"), delay=30.0)  # a resize's requeue, far away
        first, second = deployment(), deployment()
        second["metadata"]["resourceVersion"] = "11"
        queue.add(("ml", "a"), body=first)
        queue.add(("ml", "a"), body=second)
        queue.add(("ml", "a"), delay=0.5)  # a pod event keeps the watched body
        await asyncio.wait_for(queue.idle(), 5)

    asyncio.run(run())
    assert runs == [(("ml", "a"), "11")]


def test_backoff_doubles_up_to_kopfs_default() -> None:
    waits = [workqueue.backoff(n) for n in range(1, 8)]
    assert waits[0] == workqueue.RETRY_BACKOFF_SECONDS
    assert waits == sorted(waits) and waits[-1] == workqueue.MAX_BACKOFF_SECONDS
