"""Elasticity of one serving process: coordinator + stage mechanics + status + metrics + routes.

`ElasticService.attach(...)` is what `moe-runtime serve` calls once its engine and executor
serve; it returns the admin router to mount and keeps the Prometheus figures of resizes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import fastapi
import prometheus_client

from moe_runtime.elastic import admin, records, stages
from moe_runtime.elastic import coordinator as coord_mod
from moe_runtime.elastic import ops as ops_mod
from moe_runtime.engine import core as engine_core
from moe_runtime.eplb import policy
from moe_runtime.executor import base as executor_base
from moe_runtime.model import config as config_mod

log = logging.getLogger(__name__)

_RESIZE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_BLACKOUT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
HEALTH_CACHE_SECONDS = 2.0


class ElasticMetrics:
    """Prometheus figures of resizes and EPLB, in the server's registry."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        r = registry
        self.resizes = prometheus_client.Counter(
            "moe_resizes", "Finished resizes by outcome.", ["outcome", "direction"], registry=r
        )
        self.resize_seconds = prometheus_client.Histogram(
            "moe_resize_seconds", "Duration of a resize.", buckets=_RESIZE_BUCKETS, registry=r
        )
        self.stage_seconds = prometheus_client.Histogram(
            "moe_resize_stage_seconds",
            "Duration of one resize stage.",
            ["stage"],
            buckets=_RESIZE_BUCKETS,
            registry=r,
        )
        self.blackout_seconds = prometheus_client.Histogram(
            "moe_resize_blackout_seconds",
            "Longest interval of a resize in which no request made progress.",
            buckets=_BLACKOUT_BUCKETS,
            registry=r,
        )
        self.bytes_moved = prometheus_client.Counter(
            "moe_resize_bytes_moved", "Weight bytes moved by resizes.", ["kind"], registry=r
        )
        self.scaling = prometheus_client.Gauge(
            "moe_is_scaling", "1 while a resize runs.", registry=r
        )
        self.target = prometheus_client.Gauge(
            "moe_target_data_parallel_size", "DP size being resized to.", registry=r
        )
        self.balancedness = prometheus_client.Gauge(
            "moe_eplb_balancedness",
            "Mean over max tokens per EP rank, over the EPLB window (1 = perfect).",
            registry=r,
        )
        self.rebalances = prometheus_client.Gauge(
            "moe_eplb_rebalances", "Dynamic EPLB placement changes applied.", registry=r
        )

    def on_record(self, record: records.ResizeRecord) -> None:
        self.scaling.set(0 if record.done else 1)
        self.target.set(record.to_size)
        if not record.done:
            return
        direction = "up" if record.to_size > record.from_size else "down"
        outcome = "completed" if record.succeeded else "failed"
        self.resizes.labels(outcome=outcome, direction=direction).inc()
        if record.duration_s is not None:
            self.resize_seconds.observe(record.duration_s)
        for stage, seconds in record.stage_durations().items():
            self.stage_seconds.labels(stage=stage).observe(seconds)
        self.blackout_seconds.observe(record.blackout_s)
        self.bytes_moved.labels(kind="non_expert").inc(record.bytes_non_expert)
        self.bytes_moved.labels(kind="expert").inc(record.bytes_expert)


@dataclasses.dataclass
class ElasticService:
    """Everything a serving process needs to resize; build it with `attach`."""

    coordinator: coord_mod.Coordinator
    ops: ops_mod.EngineResizeOps
    engine: engine_core.Engine
    executor: executor_base.Executor
    metrics: ElasticMetrics | None = None
    _health: dict[int, str] = dataclasses.field(default_factory=dict)
    _health_at: float = 0.0
    _health_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @classmethod
    def attach(
        cls,
        *,
        engine: engine_core.Engine,
        executor: executor_base.Executor,
        model_config: config_mod.ModelConfig,
        placement: policy.Placement,
        config: ops_mod.ElasticConfig,
        limits: coord_mod.Limits,
        registry: prometheus_client.CollectorRegistry | None = None,
        epoch: int = 0,
    ) -> ElasticService:
        serving = ops_mod.Serving(
            placement=placement, num_ranks=executor.num_ranks, epoch=epoch, next_epoch=epoch + 1
        )
        mechanics = ops_mod.EngineResizeOps(
            engine=engine,
            executor=executor,
            model_config=model_config,
            serving=serving,
            config=config,
        )

        def busy() -> bool:
            stats = engine.stats()
            return stats.num_running + stats.num_waiting > 0

        coord = coord_mod.Coordinator(mechanics, limits=limits, busy=busy)
        service = cls(coordinator=coord, ops=mechanics, engine=engine, executor=executor)
        engine.on_step(lambda outputs: coord.tracker.on_step(_produced(outputs), busy()))
        if registry is not None:
            service.metrics = ElasticMetrics(registry)
            coord.on_change(service.metrics.on_record)
            service.metrics.balancedness.set_function(mechanics.balancedness)
            service.metrics.rebalances.set_function(lambda: mechanics.rebalances)
        coord.on_change(_log_stage)
        return service

    def router(self, *, token: str | None = None) -> fastapi.APIRouter:
        return admin.build_router(self.coordinator, status_fn=self.status, token=token)

    def _rank_health(self) -> dict[int, str]:
        now = time.monotonic()
        with self._health_lock:
            if now - self._health_at < HEALTH_CACHE_SECONDS and self._health:
                return dict(self._health)
        health = self.executor.check_health(timeout=2.0)
        with self._health_lock:
            self._health, self._health_at = health, time.monotonic()
        return dict(health)

    def status(self) -> dict[str, Any]:
        """The body of GET /elastic_ep/status (DESIGN §4)."""
        current = self.coordinator.current
        last = self.coordinator.last()
        serving = self.ops.serving
        active = set(self.executor.ranks)
        infos = self.executor.rank_infos()
        health = self._rank_health()
        ranks = []
        for label, info in sorted(infos.items()):
            slots = serving.placement.slots_per_rank(serving.num_ranks)
            ranks.append(
                {
                    "rank": label,
                    "active": label in active,
                    "node_id": info.get("node_id"),
                    "pod": info.get("pod"),
                    "healthy": health.get(label) == "ok",
                    "num_experts": slots if label in active else 0,
                }
            )
        stage = current.stage if current is not None else stages.Stage.IDLE
        if current is None and last is not None:
            stage = last.stage
        return {
            "data_parallel_size": self.executor.num_ranks,
            "target_data_parallel_size": current.to_size if current else self.executor.num_ranks,
            "is_scaling": current is not None,
            "stage": stage.value,
            "resize": last.to_json() if last is not None else None,
            "history": [r.to_json() for r in self.coordinator.history()],
            "ranks": ranks,
            "eplb": {
                "balancedness": self.ops.balancedness(),
                "num_physical_experts": serving.placement.num_physical,
                "rebalances": self.ops.rebalances,
                "last_rebalance": self.ops.last_rebalance,
            },
        }


def _produced(outputs: list[Any]) -> int:
    return sum(len(o.tokens) for o in outputs)


def _log_stage(record: records.ResizeRecord) -> None:
    log.info(
        "resize %s %d->%d: %s%s",
        record.resize_id,
        record.from_size,
        record.to_size,
        record.stage.value,
        f" ({record.message})" if record.message else "",
    )
