"""Structured logs of the runtime (``moe-runtime serve --log-format json``, or
``MOE_LOG_FORMAT=json`` in the pods): one JSON object per line with the deployment, the pod, the
rank and the resize (id and stage) a line is about.

``deployment`` comes from ``$MOE_DEPLOYMENT``, else ``$RAY_CLUSTER_NAME``, which KubeRay sets in
every Ray container (``setContainerEnvVars`` in its ``common/pod.go``; the operator names the
RayCluster after the MoEDeployment); ``pod`` from ``$MOE_POD_NAME`` (the operator's downward
API). ``resize_id`` and ``stage`` are those of the resize running when the line was logged
(:class:`ResizeContext`, fed by the coordinator's change callback); a record's own ``extra``
fields (``rank``, ``stage``, ``resize_id``) win.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Final

FIELDS: Final = ("deployment", "pod", "rank", "stage", "resize_id")
FORMATS: Final = ("text", "json")
FORMAT_ENV: Final = "MOE_LOG_FORMAT"
#: The level of the rank processes' logs (``moe-runtime serve --log-level`` sets it for the
#: ranks of a local instance; in the pods it comes from their environment; default INFO).
LEVEL_ENV: Final = "MOE_LOG_LEVEL"
TEXT_FORMAT: Final = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT: Final = "%Y-%m-%dT%H:%M:%S"


class ResizeContext:
    """The resize running now, as the coordinator last reported it (``on_change``). Reading
    it takes no lock: a log call may come from code that holds the coordinator's."""

    def __init__(self) -> None:
        self._record: Any = None

    def on_change(self, record: Any) -> None:
        self._record = record

    def fields(self) -> dict[str, Any]:
        record = self._record
        if record is None or getattr(record, "done", True):
            return {}
        stage = getattr(record, "stage", None)
        return {"resize_id": record.resize_id, "stage": getattr(stage, "value", stage)}


class JsonFormatter(logging.Formatter):
    """``time`` (RFC 3339, UTC, ms), ``level``, ``logger``, ``message``, the fields that are
    known, and ``exception`` when there is one."""

    def __init__(
        self, *, context: ResizeContext | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__()
        env = os.environ if environ is None else environ
        self._static = {
            "deployment": env.get("MOE_DEPLOYMENT") or env.get("RAY_CLUSTER_NAME"),
            "pod": env.get("MOE_POD_NAME"),
        }
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
        fields = dict(self._static)
        if self._context is not None:
            fields.update(self._context.fields())
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                fields[name] = value
        line.update({k: v for k, v in fields.items() if v is not None})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def use_json(context: ResizeContext | None = None) -> None:
    """Format every handler of the root logger as JSON lines."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonFormatter(context=context))


def configure(level: str, *, json_lines: bool, context: ResizeContext | None = None) -> None:
    """The root logger at `level`, in text lines (TEXT_FORMAT) or JSON lines."""
    logging.basicConfig(level=level.upper(), format=TEXT_FORMAT, datefmt=DATE_FORMAT)
    if json_lines:
        use_json(context)


def configure_rank() -> None:
    """A rank process's logs, from ``$MOE_LOG_LEVEL`` and ``$MOE_LOG_FORMAT``: without it a
    rank's INFO lines (staging, group joins, its niceness) were dropped. Ray forwards them to
    the driver's output, prefixed with the actor and its pid."""
    configure(os.environ.get(LEVEL_ENV, "INFO"), json_lines=os.environ.get(FORMAT_ENV) == "json")
