"""The operator's metrics and structured logs: what a reconcile's outcome turns into, a resize
counted once when it ends (also across a restart), the series of a deleted deployment dropped,
/metrics served over HTTP, and JSON lines with the deployment, stage and resize id."""

from __future__ import annotations

import dataclasses
import io
import json
import logging

import httpx
import pytest

from moe_operator import logs, metrics
from moe_operator.api import status as status_


@dataclasses.dataclass(frozen=True)
class Outcome:
    previous: status_.MoEDeploymentStatus | None
    status: status_.MoEDeploymentStatus | None
    runtime_reachable: bool | None = True
    autoscale_decision: str | None = None


def resize(stage: status_.Stage, **more: object) -> status_.ResizeStatus:
    return status_.ResizeStatus(
        from_size=1, to_size=2, stage=stage, resize_id="r1", started_at="2026-01-01T00:00:00Z",
        **more,  # type: ignore[arg-type]
    )  # fmt: skip


def status(r: status_.ResizeStatus | None, dp: int = 1) -> status_.MoEDeploymentStatus:
    return status_.MoEDeploymentStatus(data_parallel_size=dp, target_data_parallel_size=2, resize=r)


def sample(m: metrics.OperatorMetrics, name: str, **labels: str) -> float | None:
    value = m.registry.get_sample_value(name, labels)
    return value


def test_a_resize_is_counted_once_when_it_ends() -> None:
    m = metrics.OperatorMetrics()
    running = status(resize(status_.Stage.STANDBY))
    done = status(
        resize(status_.Stage.COMPLETED, stage_durations={"Provisioning": 20.0, "Standby": 3.5}),
        dp=2,
    )
    m.observe("ml", "tiny", Outcome(previous=status(None), status=running))
    assert sample(m, "moe_operator_resize_stage", namespace="ml", deployment="tiny",
                  stage="Standby") == 1.0  # fmt: skip
    m.observe("ml", "tiny", Outcome(previous=running, status=done))
    m.observe("ml", "tiny", Outcome(previous=done, status=done))  # the next reconcile
    assert sample(m, "moe_operator_resizes_total", direction="up", outcome="completed",
                  kind="resize") == 1.0  # fmt: skip
    assert sample(m, "moe_operator_resize_stage_seconds_count", stage="Provisioning") == 1.0
    assert sample(m, "moe_operator_resize_stage_seconds_sum", stage="Standby") == 3.5
    assert sample(m, "moe_operator_resize_seconds_sum", direction="up",
                  outcome="completed") == 23.5  # fmt: skip
    assert sample(m, "moe_operator_resize_stage", namespace="ml", deployment="tiny",
                  stage="Idle") == 1.0  # fmt: skip
    assert sample(m, "moe_operator_data_parallel_size", namespace="ml", deployment="tiny") == 2


def test_a_failed_resize_is_counted_as_failed() -> None:
    m = metrics.OperatorMetrics()
    m.observe("ml", "tiny", Outcome(previous=status(resize(status_.Stage.STANDBY)),
                                     status=status(resize(status_.Stage.FAILED))))  # fmt: skip
    assert sample(m, "moe_operator_resizes_total", direction="up", outcome="failed",
                  kind="resize") == 1.0  # fmt: skip


def test_reconciles_and_reachability() -> None:
    m = metrics.OperatorMetrics()
    m.observe_reconcile(0.05, metrics.RESULT_OK)
    m.observe_reconcile(0.2, metrics.RESULT_ERROR)
    m.observe("ml", "tiny", Outcome(previous=None, status=None, runtime_reachable=False))
    assert sample(m, "moe_operator_reconciles_total", result="ok") == 1.0
    assert sample(m, "moe_operator_reconciles_total", result="error") == 1.0
    assert sample(m, "moe_operator_reconcile_seconds_count") == 2.0
    assert sample(m, "moe_operator_runtime_reachable", namespace="ml", deployment="tiny") == 0.0
    assert sample(m, "moe_operator_runtime_unreachable_total", namespace="ml",
                  deployment="tiny") == 1.0  # fmt: skip


def test_a_deleted_deployment_leaves_no_series() -> None:
    m = metrics.OperatorMetrics()
    m.observe("ml", "tiny", Outcome(previous=None, status=status(None),
                                     autoscale_decision="scale_up"))  # fmt: skip
    m.forget("ml", "tiny")
    assert 'deployment="tiny"' not in m.render().decode()


def test_metrics_are_served_over_http() -> None:
    m = metrics.OperatorMetrics()
    m.observe_reconcile(0.01, metrics.RESULT_OK)
    server = m.serve("127.0.0.1", 0)
    try:
        port = server.server_address[1]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        server.shutdown()
    assert 'moe_operator_reconciles_total{result="ok"} 1.0' in text


@pytest.mark.parametrize(
    ("text", "want"),
    [("0.0.0.0:8081", ("0.0.0.0", 8081)), ("127.0.0.1:0", ("127.0.0.1", 0)),
     (":9000", ("0.0.0.0", 9000)), ("[::1]:8081", ("::1", 8081))],
    ids=["all", "loopback", "port-only", "ipv6"],
)  # fmt: skip
def test_metrics_address(text: str, want: tuple[str, int]) -> None:
    assert metrics.parse_address(text) == want


def test_metrics_address_is_checked() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        metrics.parse_address("8081")


def json_lines(emit: object) -> list[dict[str, object]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("test.json")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        emit(log)  # type: ignore[operator]
    finally:
        log.removeHandler(handler)
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_logs_carry_the_reconcile_context() -> None:
    def emit(log: logging.Logger) -> None:
        log.info("outside")
        with logs.context(deployment="ml/tiny"):
            logs.bind(stage="Standby", resize_id="r1")
            log.info("resizing %d->%d", 1, 2)
            log.info("a rank", extra={"rank": 3})
        log.info("after")

    outside, inside, rank, after = json_lines(emit)
    assert set(outside) == {"time", "level", "logger", "message"}
    assert inside["message"] == "resizing 1->2"
    assert (inside["deployment"], inside["stage"], inside["resize_id"]) == (
        "ml/tiny",
        "Standby",
        "r1",
    )
    assert rank["rank"] == 3
    assert "deployment" not in after  # the context ends with the block


def test_json_logs_name_kopfs_object() -> None:
    def emit(log: logging.Logger) -> None:
        log.info("handled", extra={"k8s_ref": {"name": "tiny", "namespace": "ml"}})

    (line,) = json_lines(emit)
    assert line["deployment"] == "ml/tiny" and line["level"] == "info"
