"""The JSON log line both processes write (``--log-format json``): one object per line with
``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``message``, the context fields
that are known (deployment, pod, rank, stage, resize_id: a log search joins the operator's
lines and the runtime's on them) and ``exception`` when there is one."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

#: Every context field a line may carry, in the order they are written.
FIELDS: Final = ("deployment", "pod", "rank", "stage", "resize_id")
#: Values of ``--log-format``.
FORMATS: Final = ("text", "json")

#: ``context(record)``: the fields known when ``record`` was logged (``None`` values are left
#: out). A record's own attributes of those names (``logger.info(..., extra={...})``) win.
Context = Callable[[logging.LogRecord], Mapping[str, Any]]


def _no_context(record: logging.LogRecord) -> Mapping[str, Any]:
    return {}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``fields``: the context fields this process writes (a
    subset of :data:`FIELDS`), taken from ``context`` and the record."""

    def __init__(self, *, fields: tuple[str, ...] = FIELDS, context: Context = _no_context) -> None:
        super().__init__()
        self._fields = fields
        self._context = context

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = dict(self._context(record))
        for name in self._fields:
            value = getattr(record, name, None)
            if value is not None:
                fields[name] = value
        line.update({k: fields[k] for k in self._fields if fields.get(k) is not None})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)
