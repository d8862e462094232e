"""kopf registrations, kept thin: every trigger ends in ``reconcile.reconcile``.

Every watch event of a MoEDeployment that is new to this process (its initial listing after a
start: a restart resumes; ``ADDED``) or changed its spec, labels or annotations
(``plan.changes``), any event on a RayCluster the operator manages, and a periodic resync all
run the same idempotent reconcile; one lock per deployment keeps them from racing. Only
``@kopf.on.event`` handlers: kopf's create/update/resume handlers would PATCH their progress and
diff base into annotations after every handling (one more write and one more watch event per
change), and timers or daemons would make kopf put a finalizer on every object, so deleting a
deployment would hang whenever the operator is down. An event that changed only ``status`` (our
own write) reconciles nothing. The reconcile starts from the watched body, not from a GET,
unless our last status write has not come back on the watch yet (``changes.OwnWrites``).

A failed reconcile is tried again after ``RETRY_BACKOFF_SECONDS`` (as kopf's handler backoff
did); an invalid spec is not, until the spec changes. While a resize runs, a reconcile asks to
be run again (``Outcome.requeue_after``, ~1 s): one plain asyncio task per deployment sleeps
and reconciles the fresh object. A restarted operator picks the resize up from
``status.resize`` when it lists the deployments and requeues from there.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import logging
import os
import time
from typing import Any, Final, Union, cast

import kopf

from moe_operator import logs, metrics, reconcile
from moe_operator.api import group
from moe_operator.api import status as status_
from moe_operator.k8s import api as k8s_api
from moe_operator.plan import changes

Logger = Union[logging.Logger, "logging.LoggerAdapter[Any]"]
Key = tuple[str, str]

RESYNC_SECONDS: Final = float(os.environ.get("MOE_RESYNC_SECONDS", "60"))
RETRY_BACKOFF_SECONDS: Final = 5.0
RESOURCE: Final = (group.GROUP, group.VERSION, group.PLURAL)
RAYCLUSTERS: Final = ("ray.io", "v1", "rayclusters")
PODS: Final = ("", "v1", "pods")
#: Pod events come in bursts (every probe result, every phase): one reconcile per burst.
POD_DEBOUNCE_SECONDS: Final = 0.5

logger = logging.getLogger(__name__)

#: The operator's metrics (one registry per process); served on ``METRICS_ADDRESS`` when set
#: (``moe-operator run --metrics HOST:PORT`` sets it before kopf starts).
METRICS: Final = metrics.OperatorMetrics()
METRICS_ADDRESS: tuple[str, int] | None = None


class _NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base, never built: with no change handlers registered (only
    ``@kopf.on.event``) nothing reads it, and kopf would deep-copy every watched body (status
    and managedFields included) to build it, for every event on every watched kind."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    # No change handlers, so kopf stores nothing on the objects; these name where it would.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=group.GROUP)
    settings.persistence.diffbase_storage = _NoDiffBase(
        prefix=group.GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{group.GROUP}/operator"
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    memo.api = k8s_api.Api.from_environment()
    # Every deployment's tokens derive from this key (plan.credentials): no Secret is read
    # outside the operator's own namespace.
    memo.operator_key = await memo.api.operator_key(namespace=k8s_api.operator_namespace())
    memo.locks = {}  # Key -> asyncio.Lock, shared by every per-object memo (shallow copies)
    memo.known = set()  # Keys of the MoEDeployments seen, for the periodic resync
    memo.requeues = {}  # Key -> asyncio.Task of the next reconcile a running resize asked for
    memo.contexts = {}  # "kopf" -> the context of kopf's per-object tasks (see _spawn)
    memo.fingerprints = {}  # Key -> plan.changes.fingerprint of the body last reconciled
    memo.writes = changes.OwnWrites()  # our status writes the watch has not delivered yet
    memo.resync = asyncio.get_running_loop().create_task(_resync_forever(memo))
    memo.metrics_server = None
    if METRICS_ADDRESS is not None:
        memo.metrics_server = METRICS.serve(*METRICS_ADDRESS)
        logger.info("metrics on http://%s:%d/metrics", *METRICS_ADDRESS)


@kopf.on.cleanup()
async def close(memo: Any, **_: Any) -> None:
    task = memo.get("resync")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    requeues: dict[Key, asyncio.Task[None]] = memo.get("requeues") or {}
    for pending in list(requeues.values()):
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
    api = memo.get("api")
    if api is not None:
        await api.close()
    server = memo.get("metrics_server")
    if server is not None:
        server.shutdown()


def _lock(memo: Any, key: Key) -> asyncio.Lock:
    locks: dict[Key, asyncio.Lock] = memo.locks
    return locks.setdefault(key, asyncio.Lock())


async def _reconcile(body: dict[str, Any], memo: Any, log: Logger) -> None:
    target = kopf.Body(cast(kopf.RawBody, body))

    def events(reason: str, message: str) -> None:
        post = kopf.warn if reason in status_.WARNING_REASONS else kopf.info
        try:
            post(target, reason=reason, message=message[:1000])
        except LookupError:
            # kopf's event queue lives in context variables of its per-object tasks: a
            # reconcile outside them (none captured yet, see _spawn) cannot post. The
            # reconcile must go on (it may have written already); the log keeps the event.
            log.warning("event %s not posted (outside kopf's tasks): %s", reason, message)

    meta = body["metadata"]
    key = (meta.get("namespace") or "", meta["name"])
    started = time.monotonic()
    with logs.context(deployment=f"{key[0]}/{key[1]}"):
        try:
            outcome = await reconcile.reconcile(
                api=memo.api, body=body, events=events, logger=log, operator_key=memo.operator_key
            )
        except reconcile.InvalidSpec as error:
            METRICS.observe_reconcile(time.monotonic() - started, metrics.RESULT_INVALID_SPEC)
            kopf.warn(target, reason="InvalidSpec", message=str(error)[:1000])
            raise kopf.PermanentError(str(error)) from error
        except Exception:
            METRICS.observe_reconcile(time.monotonic() - started, metrics.RESULT_ERROR)
            raise
    METRICS.observe_reconcile(time.monotonic() - started, metrics.RESULT_OK)
    METRICS.observe(key[0], key[1], outcome)
    writes: changes.OwnWrites | None = getattr(memo, "writes", None)
    if writes is not None:
        writes.wrote(key, outcome.resource_version)
    if outcome.requeue_after is not None:
        _requeue(memo, key, outcome.requeue_after)


def _requeue(memo: Any, key: Key, delay: float) -> None:
    """Reconcile ``key`` again in ``delay`` seconds (once: a pending requeue is kept)."""
    requeues: dict[Key, asyncio.Task[None]] = memo.requeues
    pending = requeues.get(key)
    if pending is not None and not pending.done() and pending is not asyncio.current_task():
        return
    requeues[key] = _spawn(
        memo, _reconcile_later(memo, key, delay), name=f"requeue {key[0]}/{key[1]}"
    )


def _spawn(memo: Any, coro: Any, *, name: str) -> asyncio.Task[None]:
    """A task for ``coro`` in the context kopf gives its per-object tasks (captured by
    :func:`track`; it holds kopf's event queue): a reconcile from the resync loop, or from a
    requeue that loop started, can then post events (``kopf.info``) like one from a handler."""
    loop = asyncio.get_running_loop()
    context: contextvars.Context | None = (getattr(memo, "contexts", None) or {}).get("kopf")
    if context is None:
        return loop.create_task(coro, name=name)
    task: asyncio.Task[None] = context.run(loop.create_task, coro, name=name)
    return task


async def _reconcile_later(memo: Any, key: Key, delay: float) -> None:
    await asyncio.sleep(delay)
    # From here on this one no longer counts as pending: a change seen while it reconciles
    # (it may have read the world just before) schedules another one after it.
    if memo.requeues.get(key) is asyncio.current_task():
        del memo.requeues[key]
    try:
        await _reconcile_fresh(key, memo, logger)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - a requeued resize must be driven again
        logger.warning(
            "requeued reconcile of %s/%s failed (%s: %s); again in %.0fs",
            key[0], key[1], type(error).__name__, error, RETRY_BACKOFF_SECONDS,
        )  # fmt: skip
        if key in memo.known:
            _requeue(memo, key, RETRY_BACKOFF_SECONDS)


async def _reconcile_fresh(key: Key, memo: Any, log: Logger) -> None:
    """Reconcile the current version of a deployment (read again, not from a cached body)."""
    async with _lock(memo, key):
        await _read_and_reconcile(key, memo, log)


async def _read_and_reconcile(key: Key, memo: Any, log: Logger) -> None:
    """Under the deployment's lock: read it and reconcile what was read."""
    body = await memo.api.get(
        api_version=group.API_VERSION, kind=group.KIND, namespace=key[0], name=key[1]
    )
    writes: changes.OwnWrites | None = getattr(memo, "writes", None)
    if writes is not None:
        writes.read(key)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    await _reconcile(body, memo, log)


@kopf.on.event(*RESOURCE)
async def track(
    type: str,  # noqa: A002 - kopf's name
    namespace: str | None,
    name: str,
    memo: Any,
    **_: Any,
) -> None:
    """Remember which deployments exist, for the periodic resync (and kopf's task context,
    for :func:`_spawn`)."""
    memo.contexts.setdefault("kopf", contextvars.copy_context())
    key = (namespace or "", name)
    if type == "DELETED":
        METRICS.forget(*key)
        memo.known.discard(key)
        memo.locks.pop(key, None)
        pending = memo.requeues.pop(key, None)
        if pending is not None and pending is not asyncio.current_task():
            pending.cancel()
    else:
        memo.known.add(key)


@kopf.on.event(*RESOURCE)
async def reconcile_on_change(
    type: str | None,  # noqa: A002 - kopf's name
    event: kopf.RawEvent,
    namespace: str | None,
    name: str,
    memo: Any,
    logger: Logger,
    **_: Any,
) -> None:
    """Reconcile a deployment new to this process, or whose spec, labels or annotations
    changed (``plan.changes``): from the watched body when it holds our last status write."""
    key = (namespace or "", name)
    body = cast(dict[str, Any], event["object"])
    meta = body.get("metadata") or {}
    writes: changes.OwnWrites = memo.writes
    writes.seen(key, meta.get("resourceVersion"))
    if type == "DELETED":
        memo.fingerprints.pop(key, None)
        writes.read(key)
        return
    if not changes.needs_reconcile(event_type=type, body=body, last=memo.fingerprints.get(key)):
        return
    memo.fingerprints[key] = changes.fingerprint(body)
    memo.known.add(key)
    if meta.get("deletionTimestamp"):
        return
    try:
        async with _lock(memo, key):
            if writes.current(key):
                await _reconcile(body, memo, logger)
            else:
                await _read_and_reconcile(key, memo, logger)
    except kopf.PermanentError as error:  # an invalid spec: again when the spec changes
        logger.error("reconcile of %s/%s failed permanently: %s", key[0], key[1], error)
    except Exception as error:  # noqa: BLE001 - tried again, as kopf's handler backoff did
        logger.exception(
            "reconcile of %s/%s failed (%s: %s); again in %.0fs",
            key[0], key[1], builtins.type(error).__name__, error, RETRY_BACKOFF_SECONDS,
        )  # fmt: skip
        _requeue(memo, key, RETRY_BACKOFF_SECONDS)


@kopf.on.event(*RAYCLUSTERS, labels={group.LABEL_MANAGED_BY: group.MANAGED_BY})
async def raycluster_changed(
    type: str | None,  # noqa: A002 - kopf's name
    labels: kopf.Labels,
    namespace: str | None,
    memo: Any,
    logger: Logger,
    **_: Any,
) -> None:
    """A managed RayCluster changed (status, deletion, someone's edit): reconcile its owner."""
    owner = labels.get(group.LABEL_DEPLOYMENT)
    key = (namespace or "", owner or "")
    # None: the initial listing (resume handles those); ADDED: almost always our own create.
    if type in (None, "ADDED") or owner is None or key not in memo.known:
        return
    try:
        await _reconcile_fresh(key, memo, logger)
    except (k8s_api.ApiError, kopf.PermanentError) as error:
        logger.warning(
            "reconcile of %s/%s after a RayCluster %s failed: %s", namespace, owner, type, error
        )


@kopf.on.event(*PODS, labels={group.LABEL_MANAGED_BY: group.MANAGED_BY})
async def pod_changed(
    type: str | None,  # noqa: A002 - kopf's name
    labels: kopf.Labels,
    namespace: str | None,
    memo: Any,
    **_: Any,
) -> None:
    """A Ray pod of a managed RayCluster changed (Ready, terminating, gone): reconcile its
    owner soon. KubeRay's status does not change when a pod starts terminating (it still
    counts it), so without this a deleted pod would be noticed only at the next resync."""
    owner = labels.get(group.LABEL_DEPLOYMENT)
    key = (namespace or "", owner or "")
    if type is None or owner is None or key not in memo.known:
        return
    _requeue(memo, key, POD_DEBOUNCE_SECONDS)


async def _resync_forever(memo: Any) -> None:
    """Level-triggered safety net: every ``MOE_RESYNC_SECONDS`` reconcile every deployment.

    It must outlive anything one reconcile meets (an API server or a runtime that is away,
    a bug): a failure is logged with its deployment and the loop goes on with the next one.
    """
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        for key in sorted(memo.known):
            try:
                await _spawn(memo, _reconcile_fresh(key, memo, logger), name=f"resync {key}")
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - the loop must survive every reconcile
                logger.warning(
                    "resync of %s/%s failed (%s: %s); next resync in %.0fs",
                    key[0], key[1], type(error).__name__, error, RESYNC_SECONDS,
                )  # fmt: skip
