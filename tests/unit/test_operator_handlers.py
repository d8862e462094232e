"""The operator's own loops survive what a reconcile meets (kopf's handlers are thin)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import types
from typing import Any

import httpx
import pytest

from moe_operator import handlers


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
    calls: list[tuple[str, str]] = []

    async def reconcile_fresh(key: tuple[str, str], memo: Any, log: Any) -> None:
        calls.append(key)
        if len(calls) <= 2:
            raise error

    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 0.01)
    monkeypatch.setattr(handlers, "_reconcile_fresh", reconcile_fresh)
    memo = types.SimpleNamespace(known={("ml", "a"), ("ml", "b")})

    async def run() -> None:
        task = asyncio.get_running_loop().create_task(handlers._resync_forever(memo))
        deadline = asyncio.get_running_loop().time() + 5
        while len(calls) < 6 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert not task.done(), "the resync loop died"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    # both deployments are reconciled again after the failures
    assert calls.count(("ml", "a")) >= 2 and calls.count(("ml", "b")) >= 2


def test_a_failed_requeued_reconcile_is_requeued(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[int] = []

    async def reconcile_fresh(key: tuple[str, str], memo: Any, log: Any) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise httpx.ConnectError("refused")

    monkeypatch.setattr(handlers, "RETRY_BACKOFF_SECONDS", 0.01)
    monkeypatch.setattr(handlers, "_reconcile_fresh", reconcile_fresh)

    async def run() -> None:
        memo = types.SimpleNamespace(known={("ml", "a")}, requeues={})
        handlers._requeue(memo, ("ml", "a"), 0.0)
        deadline = asyncio.get_running_loop().time() + 5
        while len(attempts) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert len(attempts) == 2


def test_a_change_seen_during_a_requeued_reconcile_is_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod turns Ready while a requeued reconcile runs (it read the pods just before): the
    event must bring another reconcile, not be folded into the running one."""
    runs: list[int] = []

    async def run() -> None:
        memo = types.SimpleNamespace(known={("ml", "a")}, requeues={})
        started = asyncio.Event()
        release = asyncio.Event()

        async def reconcile_fresh(key: tuple[str, str], memo: Any, log: Any) -> None:
            runs.append(1)
            if len(runs) == 1:
                started.set()
                await release.wait()

        monkeypatch.setattr(handlers, "_reconcile_fresh", reconcile_fresh)
        handlers._requeue(memo, ("ml", "a"), 0.0)
        await asyncio.wait_for(started.wait(), 5)
        handlers._requeue(memo, ("ml", "a"), 0.0)  # the event, mid-reconcile
        release.set()
        deadline = asyncio.get_running_loop().time() + 5
        while len(runs) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert len(runs) == 2


def test_requeued_and_resync_reconciles_run_in_kopfs_task_context() -> None:
    """kopf keeps its event queue in context variables of its per-object tasks; the resync
    loop and the requeues it starts run in that context (captured by ``track``), so their
    reconciles can post events (a lost ScaledUp event on the real node)."""
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker")
    seen: list[str] = []

    async def reads_marker() -> None:
        seen.append(marker.get("missing"))

    async def run() -> None:
        memo = types.SimpleNamespace(known=set(), contexts={}, locks={}, requeues={})
        await handlers._spawn(memo, reads_marker(), name="before")  # nothing captured yet

        async def kopf_task() -> None:  # kopf sets its variables in each object's task
            marker.set("kopf")
            await handlers.track(type="ADDED", namespace="ml", name="a", memo=memo)

        await asyncio.get_running_loop().create_task(kopf_task())
        await handlers._spawn(memo, reads_marker(), name="after")

    asyncio.run(run())
    assert seen == ["missing", "kopf"]


def test_an_event_that_cannot_be_posted_does_not_fail_the_reconcile(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def reconcile(*, events: Any, **_: Any) -> Any:
        events("ScaledUp", "dataParallelSize 1->2")  # outside kopf's tasks: no event queue
        return types.SimpleNamespace(
            requeue_after=None, previous=None, status=None, runtime_reachable=None,
            autoscale_decision=None,
        )  # fmt: skip

    monkeypatch.setattr(handlers.reconcile, "reconcile", reconcile)
    body = {"metadata": {"name": "a", "namespace": "ml", "uid": "u"}}
    memo = types.SimpleNamespace(api=None, operator_key=b"k", requeues={}, contexts={})
    asyncio.run(handlers._reconcile(body, memo, logging.getLogger("test")))
    assert "event ScaledUp not posted" in caplog.text
