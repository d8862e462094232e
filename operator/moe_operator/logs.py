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
import datetime
import json
import logging
from collections.abc import Iterator
from typing import Any, Final

#: The fields a line may carry beyond time, level, logger and message.
FIELDS: Final = ("deployment", "rank", "stage", "resize_id")
FORMATS: Final = ("text", "json")

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


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (RFC 3339, UTC, ms), ``level``, ``logger``,
    ``message``, the context fields that are set, and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = dict(_context.get() or {})
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("name"):
            where = f"{ref.get('namespace')}/{ref['name']}" if ref.get("namespace") else ref["name"]
            fields.setdefault("deployment", where)
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                fields[name] = value
        line.update({k: v for k, v in fields.items() if k in FIELDS and v is not None})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def use_json(logger: logging.Logger | None = None) -> None:
    """Format every handler of ``logger`` (default: the root logger) as JSON lines."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        handler.setFormatter(JsonFormatter())
