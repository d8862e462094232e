"""Why `moe-runtime serve` stopped: one line on stderr and in the container's termination
message (`moe_contract.loading`: the operator reads it from the head pod's status and shows it
in the deployment's conditions)."""

from __future__ import annotations

import logging
import os
import sys

from moe_contract import loading

log = logging.getLogger("moe_runtime.cli")


def failed(reason: str) -> int:
    """`serve` could not start or stopped on an error: ``reason`` as one line on stderr and in
    the container's termination message (``kubectl describe pod``; the operator reads it),
    and the exit status 1."""
    line = " ".join(reason.split())[: loading.MAX_TERMINATION_MESSAGE]
    print(f"moe-runtime serve: {line}", file=sys.stderr, flush=True)  # noqa: T201
    path = os.environ.get(loading.TERMINATION_LOG_ENV, loading.DEFAULT_TERMINATION_LOG)
    if os.path.isfile(path) and os.access(path, os.W_OK):  # never created outside a pod
        try:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(line + "\n")
        except OSError as exc:
            log.warning("serve: termination message not written to %s: %s", path, exc)
    return 1


def first_line(exc: BaseException) -> str:
    """The message of ``exc`` that says what went wrong: a rank's error reaches the head
    wrapped with its traceback (Ray's task errors), whose last line is the cause."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and "Traceback" in str(exc):
        return lines[-1]
    return lines[0] if lines else repr(exc)
