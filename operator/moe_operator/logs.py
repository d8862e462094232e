"""Structured logs (``moe-operator run --log-format json``): one JSON object per line with the
deployment, the resize stage and the resize id of the reconcile that logged it.

The context travels in a :class:`contextvars.ContextVar`: :func:`context` sets the deployment
around one reconcile (each asyncio task has its own copy), :func:`bind` adds what the reconcile
learns (stage, resize id). A record's own ``extra`` fields win; kopf's per-object records carry
``k8s_ref``, which names the deployment too.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any, Final

from moe_contract import logs as contract

#: The fields a line may carry beyond time, level, logger and message.
FIELDS: Final = ("deployment", "rank", "stage", "resize_id")
FORMATS: Final = contract.FORMATS

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "moe_operator_log_context", default=None
)


@contextlib.contextmanager
def context(**fields: Any) -> Iterator[None]:
    """Fields added to every line logged inside the block (this task only)."""
    token = _context.set({**(_context.get() or {}), **fields})
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Add fields to the current context (a ``None`` value removes the field)."""
    merged = {**(_context.get() or {}), **fields}
    _context.set({k: v for k, v in merged.items() if v is not None})


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = dict(_context.get() or {})
    ref = getattr(record, "k8s_ref", None)
    if isinstance(ref, dict) and ref.get("name"):
        where = f"{ref.get('namespace')}/{ref['name']}" if ref.get("namespace") else ref["name"]
        fields.setdefault("deployment", where)
    return fields


class JsonFormatter(contract.JsonFormatter):
    """The contract's JSON line (``moe_contract.logs``, the runtime's too) with the operator's
    fields: those of :func:`context` / :func:`bind`, else the deployment of kopf's
    ``k8s_ref``."""

    def __init__(self) -> None:
        super().__init__(fields=FIELDS, context=_fields)


def use_json(logger: logging.Logger | None = None) -> None:
    """Format every handler of ``logger`` (default: the root logger) as JSON lines."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        handler.setFormatter(JsonFormatter())
