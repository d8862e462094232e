"""The operator's loop: what it keeps between reconciles (:class:`Operator`, one per process)
and what brings a deployment to its work queue (``moe_operator.workqueue``: one worker per
deployment, so two reconciles of one deployment never overlap).

What queues a deployment:

- a watch event of a MoEDeployment new to this process (its initial listing after a start: a
  restart resumes; ``ADDED``) or whose spec, labels or annotations changed (``plan.changes``):
  reconciled from the watched body, unless our last status write has not come back on the
  watch yet (``changes.OwnWrites``: then the object is read again);
- an event of a managed RayCluster (at once) or Ray pod (after ``POD_DEBOUNCE_SECONDS``: pod
  events come in bursts) of a known deployment: KubeRay's status does not change when a pod
  starts terminating, so without the pod events a deleted pod would wait for the resync;
- a running resize asking to be reconciled again (``reconcile.Outcome.requeue_after``, ~1 s),
  a failed reconcile (the queue's backoff), and the periodic resync (every known deployment
  every ``RESYNC_SECONDS``: the level-triggered safety net). These read the object again.

An invalid spec (``reconcile.InvalidSpec``: the CRD should have refused it) is reconciled once
per spec generation: one ``InvalidSpec`` Warning event, no retry, and every trigger is dropped
until ``metadata.generation`` changes (every spec change bumps it).

Nothing here imports kopf: ``handlers`` feeds the watch events in and passes the function that
posts Kubernetes events (kopf's, which needs kopf's task context: see :attr:`kopf_context`).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from moe_operator import logs, metrics, reconcile, workqueue
from moe_operator.api import group
from moe_operator.api import status as status_
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import changes

Key = workqueue.Key
#: ``post(body, reason, message, warning)``: a Kubernetes event on the MoEDeployment ``body``.
Poster = Callable[[dict[str, Any], str, str, bool], None]
#: ``reconcile.reconcile`` (tests pass a stand-in).
ReconcileFn = Callable[..., Awaitable[reconcile.Outcome]]

RESYNC_SECONDS: Final = float(os.environ.get("MOE_RESYNC_SECONDS", "60"))
#: Pod events come in bursts (every probe result, every phase): one reconcile per burst.
POD_DEBOUNCE_SECONDS: Final = 0.5

logger = logging.getLogger(__name__)


def key_of(body: dict[str, Any]) -> Key:
    meta = body.get("metadata") or {}
    return (meta.get("namespace") or "", str(meta.get("name") or ""))


@dataclasses.dataclass
class Operator:
    """The operator's state, one per process (kopf's memo holds it: ``handlers``)."""

    api: k8s_api.Api
    #: Every deployment's tokens derive from it (``plan.credentials``).
    operator_key: bytes
    post: Poster
    metrics: metrics.OperatorMetrics
    reconcile_fn: ReconcileFn = reconcile.reconcile
    #: The MoEDeployments seen (what the resync and the child events reconcile).
    known: set[Key] = dataclasses.field(default_factory=set)
    #: ``plan.changes.fingerprint`` of the body last queued from the watch, per deployment.
    fingerprints: dict[Key, changes.Fingerprint] = dataclasses.field(default_factory=dict)
    #: Our status writes the watch has not delivered yet.
    writes: changes.OwnWrites = dataclasses.field(default_factory=changes.OwnWrites)
    #: (uid, generation) of a deployment whose spec is invalid: warned once, not retried.
    invalid: dict[Key, tuple[str, int]] = dataclasses.field(default_factory=dict)
    #: The context of kopf's per-object tasks: kopf sets its event queue in context variables
    #: of each object's task (``posting.event_queue_var.set`` in
    #: kopf/_core/reactor/processing.py, ``process_resource_event``), the same queue for every
    #: object. Workers run in a copy of it, so the reconciles of a requeue or the resync can
    #: post events like one started by a watch event (``None`` until the first event).
    kopf_context: contextvars.Context | None = None
    queue: workqueue.WorkQueue = dataclasses.field(init=False)
    resync_task: asyncio.Task[None] | None = None
    #: The Prometheus HTTP server (``--metrics``), shut down with the operator.
    metrics_server: Any = None

    def __post_init__(self) -> None:
        self.queue = workqueue.WorkQueue(self.reconcile_key, context=lambda: self.kopf_context)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the periodic resync (in the running event loop)."""
        self.resync_task = asyncio.get_running_loop().create_task(
            self.resync_forever(), name="resync"
        )

    async def close(self) -> None:
        """Stop the resync and every worker; close the API client and the metrics server."""
        if self.resync_task is not None:
            self.resync_task.cancel()
            try:
                await self.resync_task
            except asyncio.CancelledError:
                pass
        await self.queue.close()
        await self.api.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()

    # -- triggers -----------------------------------------------------------------------------
    def capture_context(self) -> None:
        """Called from kopf's per-object tasks: keep their context for the workers."""
        if self.kopf_context is None:
            self.kopf_context = contextvars.copy_context()

    def deployment_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        """A watch event of a MoEDeployment (``event_type`` ``None``: kopf's initial listing)."""
        key = key_of(body)
        meta = body.get("metadata") or {}
        self.writes.seen(key, meta.get("resourceVersion"))
        if event_type == "DELETED":
            self.metrics.forget(*key)
            self.known.discard(key)
            self.fingerprints.pop(key, None)
            self.invalid.pop(key, None)
            self.writes.read(key)
            # A reconcile in progress ends (its worker holds the key until then: one that
            # starts for a new object of that name waits for it); nothing queued runs.
            self.queue.forget(key)
            return
        self.known.add(key)
        if not changes.needs_reconcile(
            event_type=event_type, body=body, last=self.fingerprints.get(key)
        ):
            return
        self.fingerprints[key] = changes.fingerprint(body)
        if meta.get("deletionTimestamp"):
            return
        self.queue.add(key, body=body)

    def child_event(self, key: Key, *, delay: float = 0.0) -> None:
        """A child (RayCluster, Ray pod) of deployment ``key`` changed: reconcile it fresh."""
        if key in self.known:
            self.queue.add(key, delay=delay)

    async def resync_forever(self) -> None:
        """Level-triggered safety net: every ``RESYNC_SECONDS`` queue every deployment (the
        queue's workers survive whatever one reconcile meets)."""
        while True:
            await asyncio.sleep(RESYNC_SECONDS)
            for key in sorted(self.known):
                self.queue.add(key)

    # -- the work -----------------------------------------------------------------------------
    async def reconcile_key(self, key: Key, body: dict[str, Any] | None) -> float | None:
        """One reconcile of ``key`` (the queue's work): from ``body`` when it holds our last
        status write, else from a fresh read. Returns when to reconcile again."""
        if body is None or not self.writes.current(key):
            body = await self.api.get(
                api_version=group.API_VERSION, kind=group.KIND, namespace=key[0], name=key[1]
            )
            self.writes.read(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        meta = body["metadata"]
        spec_version = (str(meta.get("uid") or ""), int(meta.get("generation") or 1))
        if self.invalid.get(key) == spec_version:
            return None  # an invalid spec waits for a spec change
        started = time.monotonic()
        with logs.context(deployment=f"{key[0]}/{key[1]}"):
            try:
                outcome = await self.reconcile_fn(
                    api=self.api,
                    body=body,
                    events=self._events(body),
                    logger=logger,
                    operator_key=self.operator_key,
                )
            except reconcile.InvalidSpec as error:
                self.metrics.observe_reconcile(
                    time.monotonic() - started, metrics.RESULT_INVALID_SPEC
                )
                self.invalid[key] = spec_version
                logger.error(
                    "%s/%s: invalid spec (generation %d); not reconciled until it changes: %s",
                    key[0], key[1], spec_version[1], error,
                )  # fmt: skip
                self._post(body, status_.REASON_INVALID_SPEC, str(error)[:1000])
                return None
            except Exception:
                self.metrics.observe_reconcile(time.monotonic() - started, metrics.RESULT_ERROR)
                raise
        self.invalid.pop(key, None)
        self.metrics.observe_reconcile(time.monotonic() - started, metrics.RESULT_OK)
        self.metrics.observe(key[0], key[1], outcome)
        self.writes.wrote(key, outcome.resource_version)
        return outcome.requeue_after

    def _events(self, body: dict[str, Any]) -> reconcile.EventSink:
        def events(reason: str, message: str) -> None:
            self._post(body, reason, message[:1000])

        return events

    def _post(self, body: dict[str, Any], reason: str, message: str) -> None:
        self.post(body, reason, message, reason in status_.WARNING_REASONS)
