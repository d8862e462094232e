"""Structured logs of the runtime (``moe-runtime serve --log-format json``, or
``MOE_LOG_FORMAT=json`` in the pods): one JSON object per line with the deployment, the pod, the
rank and the resize (id and stage) a line is about.

``deployment`` comes from ``$MOE_DEPLOYMENT``, else ``$RAY_CLUSTER_NAME``, which KubeRay sets in
every Ray container (``setContainerEnvVars`` in its ``common/pod.go``; the operator names the
RayCluster after the MoEDeployment); ``pod`` from ``$MOE_POD_NAME`` (the operator's downward
API, ``moe_contract.names.POD_NAME_ENV``). ``resize_id`` and ``stage`` are those of the resize
running when the line was logged (:class:`ResizeContext`, fed by the coordinator's change
callback); a record's own ``extra`` fields (``rank``, ``stage``, ``resize_id``) win. The line
itself is the contract's (``moe_contract.logs``), the same as the operator's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Final

from moe_contract import logs as contract
from moe_contract import names

FIELDS: Final = contract.FIELDS
FORMATS: Final = contract.FORMATS
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


class JsonFormatter(contract.JsonFormatter):
    """The contract's JSON line (``moe_contract.logs``) with the runtime's fields: deployment
    and pod from the environment, the running resize from ``context``."""

    def __init__(
        self, *, context: ResizeContext | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        env = os.environ if environ is None else environ
        static = {
            "deployment": env.get("MOE_DEPLOYMENT") or env.get("RAY_CLUSTER_NAME"),
            "pod": env.get(names.POD_NAME_ENV),
        }

        def fields(record: logging.LogRecord) -> dict[str, Any]:
            return {**static, **(context.fields() if context is not None else {})}

        super().__init__(fields=FIELDS, context=fields)


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
