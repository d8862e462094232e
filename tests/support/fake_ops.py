"""Stage mechanics for coordinator tests (`FakeOps`): they only record what ran; a stage can
be made to block (`gate`) or fail (`fail_in`)."""

from __future__ import annotations

import threading
from typing import Any

from moe_runtime.elastic import coordinator, records, stages


class FakeOps:
    """Stage mechanics that only record what ran; a stage can be made to block or fail."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ran: list[tuple[str, stages.Stage]] = []
        self.rolled_back: list[stages.Stage] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_in: stages.Stage | None = None
        self.ended = 0

    def current_size(self) -> int:
        return self.size

    def begin(self, record: records.ResizeRecord) -> Any:
        return {"to": record.to_size}

    def run_stage(self, stage: stages.Stage, plan: Any, record: records.ResizeRecord) -> None:
        assert self.gate.wait(10)
        self.ran.append((record.resize_id, stage))
        if stage is self.fail_in:
            raise RuntimeError("rank 3 unreachable")
        if stage is stages.Stage.SWITCHING:
            self.size = plan["to"]

    def rollback(self, plan: Any, record: records.ResizeRecord, failed: stages.Stage) -> str:
        self.rolled_back.append(failed)
        return f"serving at {self.size}"

    def end(self, plan: Any) -> None:
        self.ended += 1


def make(size: int = 2, **limits: Any) -> tuple[FakeOps, coordinator.Coordinator]:
    ops = FakeOps(size)
    lim = coordinator.Limits(min_size=1, max_size=8, num_experts=8, **limits)
    return ops, coordinator.Coordinator(ops, limits=lim)
