"""The resize timeline picture (e2e/timeline.py): the runtime's metrics page parsed into
samples, the autoscaler's events into decisions, and a PNG drawn from a synthetic run."""

from __future__ import annotations

import pathlib

from e2e import timeline
from moe_runtime import metrics as runtime_metrics


def test_samples_come_from_the_runtime_metrics_page() -> None:
    m = runtime_metrics.RuntimeMetrics()
    m.expert_load.labels(rank="0").set(300)
    m.expert_load.labels(rank="1").set(100)
    sample = timeline.sample_of(timeline.parse_metrics(m.render().decode()), 12.0)
    assert sample.shares == {"0": 0.75, "1": 0.25}
    assert (sample.time, sample.in_flight, sample.size) == (12.0, 0, 0)


def test_decisions_come_from_the_autoscaler_events() -> None:
    events = [
        {"reason": "Provisioning", "message": "resize 1->2: Provisioning",
         "metadata": {"creationTimestamp": "2026-01-01T00:00:10Z"}},
        {"reason": "ScaledUp", "message": "dataParallelSize 1->2: 12.00 in flight per rank",
         "eventTime": "2026-01-01T00:00:05.123456Z", "metadata": {}},
    ]  # fmt: skip
    assert timeline.events_as_decisions(events) == [(1767225605.0, "ScaledUp 1→2")]


def test_provisioning_bands_come_from_the_operator_stage_events() -> None:
    events = [
        {"reason": "Standby", "message": "resize 1->2: Standby",
         "metadata": {"creationTimestamp": "2026-01-01T00:00:40Z"}},
        {"reason": "Provisioning", "message": "resize 1->2: Provisioning",
         "metadata": {"creationTimestamp": "2026-01-01T00:00:10Z"}},
    ]  # fmt: skip
    (record,) = timeline.provisioning(events)
    assert (record["from"], record["to"]) == (1, 2)
    assert record["stages"] == [
        {"stage": "Provisioning", "started_at": 1767225610.0, "duration_s": 30.0}
    ]


def run(start: float = 1000.0) -> timeline.Timeline:
    tokens = [(start + i * 0.1, 1) for i in range(600)]
    samples = [
        timeline.Sample(time=start + s, shares={"0": 0.5, "1": 0.5} if s > 30 else {"0": 1.0},
                        size=2 if s > 30 else 1, in_flight=12)
        for s in range(0, 60, 2)
    ]  # fmt: skip
    resizes = [
        {"from": 1, "to": 2, "stage": "Completed", "started_at": start + 20, "duration_s": 10,
         "stages": [{"stage": "Provisioning", "started_at": start + 20, "duration_s": 5},
                    {"stage": "Standby", "started_at": start + 25, "duration_s": 3},
                    {"stage": "Switching", "started_at": start + 28, "duration_s": 0.1}]},
    ]  # fmt: skip
    return timeline.Timeline(
        title="test", start=start, end=start + 60, tokens=tokens, samples=samples,
        resizes=resizes, decisions=[(start + 19, "ScaledUp 1→2")], ok=30, failed=0,
    )  # fmt: skip


def test_a_png_is_drawn(tmp_path: pathlib.Path) -> None:
    path = timeline.render(run(), tmp_path / "out" / "timeline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_a_run_round_trips_through_json(tmp_path: pathlib.Path) -> None:
    original = run()
    original.save_json(tmp_path / "run.json")
    import json

    again = timeline.Timeline.from_json(json.loads((tmp_path / "run.json").read_text()))
    assert again == original
    assert again.sizes()[0] == (1000.0, 1) and again.sizes()[-1][1] == 2
