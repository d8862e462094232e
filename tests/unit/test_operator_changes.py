"""Which MoEDeployment watch events reconcile, and from which body (plan.changes, the loop
behind kopf's handlers)."""

from __future__ import annotations

import asyncio
import copy
import types
from typing import Any

import pytest

from moe_operator import handlers, loop, metrics, reconcile, workqueue
from moe_operator.api import status as status_
from moe_operator.plan import changes


def deployment(*, generation: int = 1, rv: str = "10", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "a",
            "namespace": "ml",
            "uid": "u1",
            "generation": generation,
            "resourceVersion": rv,
            **meta,
        },
        "spec": {"dataParallelSize": 2},
    }


@pytest.mark.parametrize(
    ("event_type", "after", "expected"),
    [
        (None, deployment(), True),
        ("ADDED", deployment(), True),
        ("MODIFIED", deployment(rv="11"), False),
        ("MODIFIED", deployment(generation=2), True),
        ("MODIFIED", deployment(labels={"team": "x"}), True),
        ("MODIFIED", deployment(annotations={"elasticmoe.io/runtime-url": "http://x"}), True),
        (
            "MODIFIED",
            deployment(annotations={"kubectl.kubernetes.io/last-applied-configuration": "{}"}),
            False,
        ),
        ("MODIFIED", deployment(uid="u2"), True),
        ("DELETED", deployment(generation=2), False),
    ],
    ids=[
        "initial-listing", "added", "status-only", "spec", "labels", "annotation",
        "kubectl-annotation", "recreated", "deleted",
    ],
)  # fmt: skip
def test_needs_reconcile(event_type: str | None, after: dict[str, Any], expected: bool) -> None:
    last = changes.fingerprint(deployment())
    assert changes.needs_reconcile(event_type=event_type, body=after, last=last) is expected


def test_a_deployment_never_reconciled_is_reconciled_on_any_event() -> None:
    assert changes.needs_reconcile(event_type="MODIFIED", body=deployment(), last=None)


def test_own_writes_make_bodies_stale_until_the_watch_delivers_them() -> None:
    writes = changes.OwnWrites()
    assert writes.current("a")
    writes.wrote("a", "12")
    writes.seen("a", "11")  # an event from before the write
    assert not writes.current("a")
    writes.seen("a", "12")
    assert writes.current("a")
    writes.wrote("a", "13")
    writes.read("a")  # a GET after the write sees it
    assert writes.current("a")


class Recorder:
    """Stands in for ``reconcile.reconcile`` and the API's GET."""

    def __init__(self, *, stored: dict[str, Any], written_rv: str | None = None) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.stored = stored
        self.written_rv = written_rv
        self.fail = False

    async def reconcile(self, *, body: dict[str, Any], **_: Any) -> reconcile.Outcome:
        self.bodies.append(("body", body))
        if self.fail:
            raise ConnectionError("the API server is away")
        return reconcile.Outcome(
            phase=status_.Phase.SERVING,
            created=(),
            status_written=self.written_rv is not None,
            resource_version=self.written_rv,
        )

    async def get(self, **_: Any) -> dict[str, Any]:
        self.bodies.append(("GET", self.stored))
        return copy.deepcopy(self.stored)

    async def close(self) -> None:
        pass


def operator_for(recorder: Recorder) -> loop.Operator:
    return loop.Operator(
        api=recorder,  # type: ignore[arg-type]
        operator_key=b"k",
        post=lambda *_: None,
        metrics=metrics.OperatorMetrics(),
        reconcile_fn=recorder.reconcile,
    )


async def deliver(op: loop.Operator, event_type: str | None, body: dict[str, Any]) -> None:
    """A watch event through kopf's handler, and whatever it queued, done."""
    memo = types.SimpleNamespace(operator=op)
    await handlers.deployment_changed(
        type=event_type, event={"type": event_type, "object": body}, memo=memo
    )
    await op.queue.idle()


def test_events_reconcile_from_the_watched_body_and_skip_status_only_changes() -> None:
    recorder = Recorder(stored=deployment(rv="12"), written_rv="12")

    async def run() -> loop.Operator:
        op = operator_for(recorder)
        await deliver(op, "ADDED", deployment(rv="10"))  # reconciled; it writes status rv 12
        await deliver(op, "MODIFIED", deployment(rv="12"))  # our write: nothing to do
        await deliver(op, "MODIFIED", deployment(rv="13", generation=2))  # a spec change
        return op

    op = asyncio.run(run())
    assert [(how, body["metadata"]["resourceVersion"]) for how, body in recorder.bodies] == [
        ("body", "10"),
        ("body", "13"),
    ]
    assert ("ml", "a") in op.known


def test_an_event_from_before_our_status_write_reconciles_a_fresh_read() -> None:
    """The watch has not delivered our write yet: its body would hold a stale status."""
    recorder = Recorder(stored=deployment(rv="14", generation=2))

    async def run() -> loop.Operator:
        op = operator_for(recorder)
        await deliver(op, "ADDED", deployment(rv="10"))
        op.writes.wrote(("ml", "a"), "12")  # a requeued reconcile wrote status meanwhile
        await deliver(op, "MODIFIED", deployment(rv="11", generation=2))
        return op

    op = asyncio.run(run())
    assert [(how, body["metadata"]["resourceVersion"]) for how, body in recorder.bodies] == [
        ("body", "10"),
        ("GET", "14"),
        ("body", "14"),
    ]
    assert op.writes.current(("ml", "a"))


def test_a_failed_reconcile_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(stored=deployment(rv="10"))
    recorder.fail = True
    monkeypatch.setattr(workqueue, "RETRY_BACKOFF_SECONDS", 0.01)

    async def run() -> None:
        op = operator_for(recorder)
        memo = types.SimpleNamespace(operator=op)
        event = {"type": "ADDED", "object": deployment(rv="10")}
        await handlers.deployment_changed(type="ADDED", event=event, memo=memo)
        deadline = asyncio.get_running_loop().time() + 5
        while not recorder.bodies and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        recorder.fail = False
        await asyncio.wait_for(op.queue.idle(), 5)

    asyncio.run(run())
    # the event's body, then the retry: a fresh read and its reconcile
    assert [how for how, _ in recorder.bodies] == ["body", "GET", "body"]
