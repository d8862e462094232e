"""What a resize leaves behind: per-stage durations, bytes moved, blackout, outcome.

A record is updated by the coordinator thread and read by HTTP handlers; `snapshot()` returns
plain JSON-ready dicts (camelCase keys are not used here: the runtime API is snake_case, like
vLLM's).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from moe_contract import status as contract
from moe_runtime.elastic import stages as st


@dataclasses.dataclass
class StageRecord:
    """One stage of one resize: wall-clock start and duration in seconds."""

    stage: st.Stage
    started_at: float
    duration_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage.value,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
        }


# The values of a record's kind and trigger are the contract's (``moe_contract.status``).
KIND_RESIZE = contract.KIND_RESIZE
KIND_RECOVERY = contract.KIND_RECOVERY
TRIGGER_API = contract.TRIGGER_API  # POST /scale_elastic_ep
TRIGGER_AUTO_RECOVER = contract.TRIGGER_AUTO_RECOVER  # the grow back after a recovery
TRIGGER_RANK_LOST = contract.TRIGGER_RANK_LOST  # a recovery


@dataclasses.dataclass
class RecoveryInfo:
    """What a recovery (kind "recovery") did; wall-clock times (time.time()).

    last_heartbeat_at: the lost ranks' last answered heartbeat (the loss happened after it);
    detected_at: when the runtime knew; recovered_at: when the survivors served again.
    ranks_lost: {"rank", "pod", "node_id", "pid", "reason"} of each lost rank (labels before
    the recovery). experts_restored: lost experts that survivors also held (from_replicas),
    those read from the model source (from_source) and those the survivors that needed them
    retained from an earlier placement (from_retained: no read, no copy). requests_rerun: sequences that were on the
    lost ranks and re-ran on survivors from prompt + generated tokens.
    """

    detected_at: float
    last_heartbeat_at: float | None = None
    recovered_at: float | None = None
    ranks_lost: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    experts_from_replicas: int = 0
    experts_from_source: int = 0
    experts_from_retained: int = 0
    requests_rerun: int = 0

    def to_json(self) -> dict[str, Any]:
        last, detected, recovered = self.last_heartbeat_at, self.detected_at, self.recovered_at
        return {
            "last_heartbeat_at": last,
            "detected_at": detected,
            "recovered_at": recovered,
            "detection_s": None if last is None else max(0.0, detected - last),
            "recovery_s": None if recovered is None else recovered - detected,
            "ranks_lost": [dict(r) for r in self.ranks_lost],
            "experts_restored": {
                "from_replicas": self.experts_from_replicas,
                "from_source": self.experts_from_source,
                "from_retained": self.experts_from_retained,
            },
            "requests_rerun": self.requests_rerun,
        }


@dataclasses.dataclass
class ResizeRecord:
    """One resize from `from_size` to `to_size` ranks, or one recovery (kind "recovery").

    trigger: what started it (TRIGGER_*); recovery: set for kind "recovery". drain_timeout_s: how
    long a shrink lets sequences on departing ranks finish there before it migrates the rest;
    sequences_drained: those that finished there, sequences_migrated: those moved.
    switch_pause_s: how long the switch held the step loop (its boundary call: no step ran);
    warm_spares: how many warm spare ranks a grow took; experts_prestaged: expert moves of
    the placement change that the warm spares made unneeded (they held those experts
    pre-staged); experts_retained: the moves that ranks made unneeded by retaining those
    experts from an earlier placement (a shrink back after a grow: `retention`).
    expert_moves + experts_prestaged + experts_retained >= expert_moves_lower_bound.
    """

    resize_id: str
    from_size: int
    to_size: int
    kind: str = KIND_RESIZE
    trigger: str = TRIGGER_API
    recovery: RecoveryInfo | None = None
    started_at: float = dataclasses.field(default_factory=time.time)
    stage: st.Stage = st.Stage.IDLE
    stage_started_at: float = dataclasses.field(default_factory=time.time)
    finished_at: float | None = None
    message: str = ""
    stages: list[StageRecord] = dataclasses.field(default_factory=list)
    bytes_non_expert: int = 0
    bytes_expert: int = 0
    expert_moves: int = 0
    expert_moves_lower_bound: int = 0
    experts_prestaged: int = 0
    experts_retained: int = 0
    blackout_s: float = 0.0
    balancedness_before: float | None = None
    balancedness_after: float | None = None
    freed: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sequences_migrated: int = 0
    drain_timeout_s: float = 0.0
    sequences_drained: int = 0
    switch_pause_s: float | None = None
    warm_spares: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def done(self) -> bool:
        return self.stage in (st.Stage.COMPLETED, st.Stage.FAILED)

    @property
    def succeeded(self) -> bool:
        return self.stage is st.Stage.COMPLETED

    @property
    def duration_s(self) -> float | None:
        if self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    def enter(self, stage: st.Stage, *, now: float | None = None) -> None:
        """Close the running stage and open `stage` (terminal stages get a zero duration)."""
        now = time.time() if now is None else now
        with self._lock:
            if self.stages and self.stages[-1].duration_s is None:
                self.stages[-1].duration_s = now - self.stages[-1].started_at
            self.stage = stage
            self.stage_started_at = now
            if stage in (st.Stage.COMPLETED, st.Stage.FAILED):
                self.finished_at = now
            else:
                self.stages.append(StageRecord(stage=stage, started_at=now))

    def stage_durations(self) -> dict[str, float]:
        with self._lock:
            return {s.stage.value: s.duration_s for s in self.stages if s.duration_s is not None}

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "resize_id": self.resize_id,
                "kind": self.kind,
                "trigger": self.trigger,
                "from": self.from_size,
                "to": self.to_size,
                "stage": self.stage.value,
                "started_at": self.started_at,
                "stage_started_at": self.stage_started_at,
                "finished_at": self.finished_at,
                "duration_s": self.duration_s,
                "message": self.message,
                "stages": [s.to_json() for s in self.stages],
                "bytes_moved": {"non_expert": self.bytes_non_expert, "expert": self.bytes_expert},
                "expert_moves": self.expert_moves,
                "expert_moves_lower_bound": self.expert_moves_lower_bound,
                "experts_prestaged": self.experts_prestaged,
                "experts_retained": self.experts_retained,
                "blackout_s": self.blackout_s,
                "balancedness": {
                    "before": self.balancedness_before,
                    "after": self.balancedness_after,
                },
                "freed": list(self.freed),
                "sequences_migrated": self.sequences_migrated,
                "drain_timeout_s": self.drain_timeout_s,
                "sequences_drained": self.sequences_drained,
                "switch_pause_s": self.switch_pause_s,
                "warm_spares": self.warm_spares,
                "recovery": None if self.recovery is None else self.recovery.to_json(),
            }
