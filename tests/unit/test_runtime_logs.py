"""`moe-runtime serve --log-format json`: one JSON object per line with the deployment and pod
(from the pod's environment), the running resize's id and stage, and a record's own rank."""

from __future__ import annotations

import io
import json
import logging

import pytest

from moe_runtime import cli, logs
from moe_runtime.elastic import records, stages


def lines(formatter: logs.JsonFormatter, emit: object) -> list[dict[str, object]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    log = logging.getLogger("test.runtime.json")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        emit(log)  # type: ignore[operator]
    finally:
        log.removeHandler(handler)
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_lines_name_the_deployment_the_resize_and_the_rank() -> None:
    context = logs.ResizeContext()
    formatter = logs.JsonFormatter(
        context=context, environ={"RAY_CLUSTER_NAME": "tiny", "MOE_POD_NAME": "tiny-head-x"}
    )
    record = records.ResizeRecord(resize_id="r1", from_size=1, to_size=2)

    def emit(log: logging.Logger) -> None:
        log.info("idle")
        record.enter(stages.Stage.STANDBY)
        context.on_change(record)
        log.info("rank joined", extra={"rank": 1})
        record.enter(stages.Stage.COMPLETED)
        context.on_change(record)
        log.info("done")

    idle, joined, done = lines(formatter, emit)
    assert (idle["deployment"], idle["pod"]) == ("tiny", "tiny-head-x")
    assert "resize_id" not in idle
    assert (joined["resize_id"], joined["stage"], joined["rank"]) == ("r1", "Standby", 1)
    assert "resize_id" not in done  # the resize ended


def test_an_explicit_deployment_wins() -> None:
    formatter = logs.JsonFormatter(environ={"MOE_DEPLOYMENT": "a", "RAY_CLUSTER_NAME": "b"})
    (line,) = lines(formatter, lambda log: log.warning("x"))
    assert (line["deployment"], line["level"]) == ("a", "warning")


@pytest.mark.parametrize(
    ("argv", "env", "want"),
    [([], None, "text"), (["--log-format", "json"], None, "json"), ([], "json", "json")],
    ids=["default", "flag", "environment"],
)
def test_log_format_flag(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str | None, want: str
) -> None:
    if env is not None:
        monkeypatch.setenv(logs.FORMAT_ENV, env)
    else:
        monkeypatch.delenv(logs.FORMAT_ENV, raising=False)
    args = cli.build_parser().parse_args(
        ["serve", "--model", "synthetic://tiny", "--data-parallel-size", "1", *argv]
    )
    assert args.log_format == want
